/*
 * bench_capacity — the tier shares of a Zipf-popular population of users
 * against the real store with a disk tier, for the capacity model
 * (docs/capacity.md, python -m kvinject_bench.capacity: its "trace" input).
 *
 * USERS users (tenants 1..USERS), each with 20-50 facts of 10-20 tokens on a
 * small model (LAYERS x HEADS x HEAD_SIZE, no RoPE: the shares do not depend
 * on the geometry), kept by a store with a disk tier (one file per tenant in
 * a temporary directory, every put written through). Memory budget:
 * MEM_FRACTION of all the users' page bytes (the device on a CUDA store, with
 * HOST_FRACTION more as its pinned-host tier; a CPU store's pages are host
 * memory); the disk holds everyone. Users' facts are random data: captured
 * from a device cache of noise by one kvi_encode a user on a CUDA store
 * (written through to the tenant's file together), put one kvi_store_put a
 * fact from host memory on a CPU store; when a visit first meets them
 * (POPULATE=touch, the default: such visits count as new users and are
 * left out of the other columns), or all of them before the trace
 * (POPULATE=all; every write syncs its tenant's file, so this takes a while
 * at 100,000 users on a disk; DIR=/dev/shm, tmpfs, takes the syncs' cost out
 * where only the shares are wanted).
 * For each Zipf exponent s in S (0.8, 1.0, 1.2): visits pick a user by Zipf(s)
 * over a random ranking of the users, prefetch the user
 * (kvi_store_prefetch, all its facts: read on the store's I/O thread), and
 * make R requests, each injecting K distinct random facts of the user into a
 * small paged cache (host memory on a CPU store, device memory on a CUDA
 * store); after the first request the benchmark waits, untimed, until the
 * prefetch has completed (a user's next request comes seconds later). WARM visits first (not
 * counted), then VISITS measured ones. Per request, before anything
 * moves, kvi_store_fact_tier says where each requested fact is: the shares
 * of facts on the device, the host and only on disk are the trace's tier
 * hit rates. Timed per request: from the visit's prefetch (first request)
 * or the request's start to kvi_inject's return (CUDA: the stream's
 * completion): load + inject, p50 and p99, over all requests and over those
 * that found a fact only on disk. Bytes from disk, drops to disk and
 * promotions are the store's counters over the measured visits.
 * Text fallback: a request whose disk-only facts would take longer to load
 * (their bytes at the disk-load rate of the warm-up's requests, or
 * DISK_GBPS) than prefilling their tokens at PREFILL_TOKENS_PER_S would be
 * served from text; the default rate is Llama-3.1-8B's measured 42,344
 * tokens/s (BENCHMARKS.md, vLLM) scaled to this model's bytes per token, so
 * the policy compares bytes per second as it would for the 8B model. At
 * this geometry a fact is a few KiB and its read is dominated by per-read
 * costs that an 8B model's 2.6 MB facts amortize: the measured rate is a
 * lower bound, and DISK_GBPS puts a real one in.
 *
 * Environment (KVI_BENCH_*): USERS (100000), VISITS (10000 per s: visits, each one user's run of requests), WARM
 * (VISITS / 2), S (Zipf exponents, comma-separated: 0.8,1.0,1.2; each runs after the
 * ones before it, on the store as they left it), R (4), K (10), LAYERS (2), HEADS (1), HEAD_SIZE (32),
 * STORE_DTYPE (bf16, fp8, q4), PAGE_TOKENS (16), MEM_FRACTION (0.1),
 * HOST_FRACTION (0.48, CUDA stores: the capacity model's node, whose host
 * tier is 4.8x its GPU tier), POPULATE (touch, all), PREFILL_TOKENS_PER_S,
 * DISK_GBPS, BACKEND (cpu or cuda; default: CUDA when built with it and a
 * device answers), DIR (where the temporary directory goes; default $TMPDIR
 * or /tmp), SEED (1).
 * Quick CPU run: KVI_BENCH_USERS=2000 KVI_BENCH_VISITS=2000.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef BENCH_WITH_CUDA
#define BENCH_CPU_ONLY
#endif
#include "bench.h"

static long env_long(const char *name, long def) {
  const char *e = getenv(name);
  return e && *e ? atol(e) : def;
}
static double env_double(const char *name, double def) {
  const char *e = getenv(name);
  return e && *e ? atof(e) : def;
}

/* KVI_BENCH_S: up to max comma-separated Zipf exponents in (0, 4] (default
 * 0.8,1.0,1.2), into s; their count, or -1 (said on stderr) for a bad list. */
static int zipf_exponents(double *s, int max) {
  const char *e = getenv("KVI_BENCH_S");
  if (!e || !*e) e = "0.8,1.0,1.2";
  int n = 0;
  for (const char *p = e;;) {
    char *end;
    const double v = strtod(p, &end);
    if (end == p || !(v > 0 && v <= 4) || n == max || (*end && *end != ',')) {
      fprintf(stderr, "KVI_BENCH_S is %s: up to %d comma-separated exponents in (0, 4]\n", e, max);
      return -1;
    }
    s[n++] = v;
    if (!*end) return n;
    p = end + 1;
  }
}

/* splitmix64: the users' shapes from their ids, and the trace's draws */
static uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
static uint64_t rng_state;
static uint64_t rnd(void) { return mix(rng_state++); }
static double rnd01(void) { return (double)(rnd() >> 11) * 0x1.0p-53; }

static int user_facts(uint64_t u) { return 20 + (int)(mix(u * 2 + 1) % 31); }
static int fact_tokens(uint64_t u, int f) { return 10 + (int)(mix(u * 1000003u + (uint64_t)f) % 11); }

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}
/* the q-quantile of v[0..n) (sorts v); 0 for n = 0 */
static double quantile(double *v, size_t n, double q) {
  if (!n) return 0;
  qsort(v, n, sizeof *v, cmp_double);
  size_t i = (size_t)(q * (double)(n - 1) + 0.5);
  return v[i < n ? i : n - 1];
}

static void remove_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return;
  struct dirent *e;
  char p[4096 + 256 + 2];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", path, e->d_name);
    unlink(p);
  }
  closedir(d);
  rmdir(path);
}

typedef struct {
  kvi_store *store;
  kvi_injector *inj;
  int32_t *table;
  int32_t table_len;
  int cuda;
  int K, R;
  double prefill_tps;    /* tokens per second of prefill */
  uint64_t token_bytes;  /* page bytes per token of the store */
  double disk_s_per_byte; /* measured in the warm-up */
  int L, H, D;
  const uint16_t *noise; /* bf16 noise: K at noise, V at noise + fe (and 4,096 more) */
  size_t fe;
  unsigned char *stored; /* users put so far */
  uint64_t puts;
  double put_ms;
  kvi_encoder *enc;       /* CUDA stores: users arrive by capture from src */
  const int32_t *src_table;
  int32_t src_blocks;
} ctx;

static void sync_ctx(const ctx *c);

/* Puts user u's facts: on a CUDA store one kvi_encode of all of them from a
 * device cache of bf16 noise (a user's facts at varying slots; written
 * through to the tenant's file together), else a kvi_store_put each of bf16
 * noise at varying offsets. */
static void put_user(ctx *c, uint64_t u) {
  const double t0 = now_ms();
  if (c->enc) {
    kvi_capture cap[50];
    int64_t slot = (int64_t)(mix(u) % 64);
    for (int f = 0; f < user_facts(u); f++) {
      kvi_capture_init(&cap[f], sizeof cap[f]);
      cap[f].tenant = u + 1;
      cap[f].fact_id = (uint64_t)f;
      cap[f].block_table = c->src_table;
      cap[f].block_table_len = c->src_blocks;
      cap[f].first_slot = slot;
      cap[f].num_tokens = fact_tokens(u, f);
      cap[f].start_position = (int32_t)slot;
      slot += fact_tokens(u, f);
    }
    CK(kvi_encode(c->enc, cap, user_facts(u), NULL));
    sync_ctx(c);
  } else {
    for (int f = 0; f < user_facts(u); f++) {
      kvi_kv_view kv;
      const size_t off = (size_t)(mix(u * 64 + (uint64_t)f) % 4096);
      kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_BF16, c->L, fact_tokens(u, f), c->H, c->D,
                             (void *)(c->noise + off), (void *)(c->noise + c->fe + off));
      CK(kvi_store_put(c->store, u + 1, (uint64_t)f, &kv, NULL, NULL));
    }
  }
  c->puts += (uint64_t)user_facts(u);
  c->stored[u] = 1;
  c->put_ms += now_ms() - t0;
}

typedef struct {
  uint64_t visits, new_users, requests, facts, on[3], disk_requests, fallbacks, tokens;
  uint64_t all_facts, all_on[3]; /* new users' visits too, their first request as from disk */
  size_t n_all, n_disk, n_first;
  double disk_load_ms, disk_load_bytes; /* requests with disk facts: time and bytes read */
  double *t_all, *t_disk, *t_first;     /* kept by reset(); t_first: each visit's first request */
} tally;

static void reset(tally *t) {
  double *a = t->t_all, *d = t->t_disk, *f = t->t_first;
  memset(t, 0, sizeof *t);
  t->t_all = a, t->t_disk = d, t->t_first = f;
}

static void sync_ctx(const ctx *c) {
#ifdef BENCH_WITH_CUDA
  if (c->cuda) CU(cudaStreamSynchronize(0));
#else
  (void)c;
#endif
}

/* Waits (at most 2 s) until no fact of the user is left on disk: the visit's
 * prefetch reads on the store's I/O thread; a CPU store's thread publishes the
 * facts it read, a CUDA store's next prefetch does. */
static void wait_prefetched(const ctx *c, uint64_t u) {
  const double t0 = now_ms();
  for (;;) {
    int on_disk = 0;
    for (int f = 0; f < user_facts(u) && !on_disk; f++) {
      int32_t tier;
      CK(kvi_store_fact_tier(c->store, u + 1, (uint64_t)f, &tier));
      on_disk = tier == KVI_TIER_DISK;
    }
    if (!on_disk || now_ms() - t0 > 2000) return;
    usleep(20);
    if (c->cuda) CK(kvi_store_prefetch(c->store, u + 1, NULL, 0, NULL));
  }
}

/* One visit of user u (tenant u + 1): prefetch, then R requests. A user
 * met for the first time is put first (captured); such a visit's requests
 * run but count only as a new user's. */
static void visit(ctx *c, uint64_t u, tally *t) {
  const uint64_t tenant = u + 1;
  const int nf = user_facts(u);
  uint64_t ids[64];
  t->visits++;
  const int fresh = !c->stored[u];
  if (fresh) put_user(c, u), t->new_users++;
  double t0 = now_ms();
  for (int r = 0; r < c->R; r++) {
    /* K distinct facts: a partial shuffle of 0..nf-1 */
    int pick[64];
    for (int f = 0; f < nf; f++) pick[f] = f;
    int tokens = 0, disk_tokens = 0;
    uint64_t disk_bytes = 0;
    for (int f = 0; f < c->K && f < nf; f++) {
      const int j = f + (int)(rnd() % (uint64_t)(nf - f)), tmp = pick[f];
      pick[f] = pick[j], pick[j] = tmp;
      ids[f] = (uint64_t)pick[f];
      int32_t tier;
      CK(kvi_store_fact_tier(c->store, tenant, ids[f], &tier));
      const int T = fact_tokens(u, pick[f]);
      tokens += T;
      const int where = tier == KVI_TIER_DEVICE ? 0 : tier == KVI_TIER_HOST ? 1 : 2;
      if (!fresh) t->on[where]++;
      t->all_on[fresh && r == 0 ? 2 : where]++, t->all_facts++;
      if (tier == KVI_TIER_DISK) disk_tokens += T, disk_bytes += (uint64_t)T * c->token_bytes;
    }
    const int k = c->K < nf ? c->K : nf;
    if (r > 0) t0 = now_ms();
    kvi_store_stats s0 = KVI_STORE_STATS_INIT;
    if (disk_tokens) CK(kvi_store_stats_get(c->store, &s0));
    if (r == 0) CK(kvi_store_prefetch(c->store, tenant, NULL, 0, NULL));
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = tenant;
    rq.fact_ids = ids;
    rq.num_facts = k;
    rq.block_table = c->table;
    rq.block_table_len = c->table_len;
    rq.start_position = 32;
    CK(kvi_inject(c->inj, &rq, 1, NULL, NULL));
    sync_ctx(c);
    const double ms = now_ms() - t0;
    /* the user's next request comes seconds later: the prefetch has completed by then */
    if (r == 0) wait_prefetched(c, u);
    if (fresh) continue;
    t->requests++;
    t->facts += (uint64_t)k;
    t->tokens += (uint64_t)tokens;
    t->t_all[t->n_all++] = ms;
    if (r == 0) t->t_first[t->n_first++] = ms;
    if (disk_tokens) {
      kvi_store_stats s1 = KVI_STORE_STATS_INIT;
      CK(kvi_store_stats_get(c->store, &s1));
      t->disk_requests++;
      t->t_disk[t->n_disk++] = ms;
      t->disk_load_ms += ms;
      t->disk_load_bytes += (double)(s1.disk_read_bytes - s0.disk_read_bytes);
      /* the policy: disk-only facts whose predicted load exceeds their prefill */
      if (c->disk_s_per_byte > 0 && (double)disk_bytes * c->disk_s_per_byte > disk_tokens / c->prefill_tps)
        t->fallbacks++;
    }
  }
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* progress as it comes, also into a file */
  const long users = env_long("KVI_BENCH_USERS", 100000);
  const long visits = env_long("KVI_BENCH_VISITS", 10000);
  const long warm = env_long("KVI_BENCH_WARM", visits / 2);
  const int R = (int)env_long("KVI_BENCH_R", 4), K = (int)env_long("KVI_BENCH_K", 10);
  const int L = (int)env_long("KVI_BENCH_LAYERS", 2), H = (int)env_long("KVI_BENCH_HEADS", 1),
            D = (int)env_long("KVI_BENCH_HEAD_SIZE", 32), P = (int)env_long("KVI_BENCH_PAGE_TOKENS", 16);
  const double mem_frac = env_double("KVI_BENCH_MEM_FRACTION", 0.1), host_frac = env_double("KVI_BENCH_HOST_FRACTION", 0.48);
  rng_state = (uint64_t)env_long("KVI_BENCH_SEED", 1) * 0x100000001b3ull;
  const char *pop = getenv("KVI_BENCH_POPULATE");
  const int all = pop && !strcmp(pop, "all");
  if (pop && !all && strcmp(pop, "touch")) {
    fprintf(stderr, "KVI_BENCH_POPULATE is %s: touch or all\n", pop);
    return 1;
  }
  if (users < 1 || visits < 1 || R < 1 || K < 1 || K > 20 || L < 1 || L > 64 || H < 1 || D < 2 || P < 1) {
    fprintf(stderr, "bench_capacity: bad KVI_BENCH_* values (K is 1..20, LAYERS 1..64)\n");
    return 1;
  }
  const char *sdt = getenv("KVI_BENCH_STORE_DTYPE");
  kvi_dtype dtype = KVI_DTYPE_BF16;
  if (sdt && !strcmp(sdt, "fp8")) dtype = KVI_DTYPE_FP8_E4M3;
  else if (sdt && !strcmp(sdt, "q4")) dtype = KVI_DTYPE_Q4;
  else if (sdt && strcmp(sdt, "bf16")) {
    fprintf(stderr, "KVI_BENCH_STORE_DTYPE is %s: bf16, fp8 or q4\n", sdt);
    return 1;
  }

  int cuda = 0;
#ifdef BENCH_WITH_CUDA
  const char *be = getenv("KVI_BENCH_BACKEND");
  int ndev = 0;
  cuda = !(be && !strcmp(be, "cpu")) && kvi_cuda_device_count(&ndev) == KVI_OK && ndev > 0;
#endif

  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_model *model;
  CK(kvi_model_create(&model, &mo));
  kvi_rope_spec rope = KVI_ROPE_SPEC_INIT;
  rope.style = KVI_ROPE_NONE;
  CK(kvi_model_set_rope(model, -1, &rope));

  /* a store of one page, to learn the page's bytes for this dtype */
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = dtype;
  so.page_tokens = P;
  so.budget_bytes = (uint64_t)1 << 30;
  kvi_store *probe;
  CK(kvi_store_create(&probe, model, &so));
  kvi_store_stats ps = KVI_STORE_STATS_INIT;
  CK(kvi_store_stats_get(probe, &ps));
  kvi_store_destroy(probe);
  const uint64_t page_bytes = ps.page_bytes;

  /* every user's page bytes, and the facts' largest size */
  uint64_t total_pages = 0, total_tokens = 0, total_facts = 0;
  for (long u = 0; u < users; u++)
    for (int f = 0; f < user_facts((uint64_t)u); f++) {
      const int T = fact_tokens((uint64_t)u, f);
      total_pages += (uint64_t)((T + P - 1) / P), total_tokens += (uint64_t)T, total_facts++;
    }
  const uint64_t total_bytes = total_pages * page_bytes;

  const char *base = getenv("KVI_BENCH_DIR");
  if (!base || !*base) base = getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/kvi-capacity-XXXXXX", base);
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }

  so.backend = cuda ? KVI_BACKEND_CUDA : KVI_BACKEND_CPU;
  so.device = cuda ? 0 : -1;
  uint64_t mem = (uint64_t)(mem_frac * (double)total_bytes);
  const uint64_t largest_user = (uint64_t)50 * (uint64_t)((20 + P - 1) / P) * page_bytes; /* 50 facts of 20 tokens */
  if (mem < largest_user) mem = largest_user;
  so.budget_bytes = mem;
  so.host_budget_bytes = cuda ? (uint64_t)(host_frac * (double)total_bytes) : 0;
  so.disk_dir = dir;
  so.disk_budget_bytes = 0; /* the file system's room: the disk tier holds everyone */
  kvi_store *store;
  CK(kvi_store_create(&store, model, &so));

  printf("bench_capacity: %s store, %s, %ld users (%llu facts, %llu tokens), model %d x %d x %d, %d-token pages "
         "(%llu bytes)\n",
         cuda ? "CUDA" : "CPU", sdt ? sdt : "bf16", users, (unsigned long long)total_facts,
         (unsigned long long)total_tokens, L, H, D, P, (unsigned long long)page_bytes);
  printf("memory tier %.1f MB (%.0f%% of the users' %.1f MB of pages)", (double)so.budget_bytes / 1e6,
         100.0 * (double)so.budget_bytes / (double)total_bytes, (double)total_bytes / 1e6);
  if (cuda) printf(", host tier %.1f MB (%.0f%%)", (double)so.host_budget_bytes / 1e6, 100.0 * host_frac);
  printf("; disk tier in %s\n", dir);

  /* the facts' data: bf16 noise, read at varying offsets */
  const size_t fe = (size_t)L * 20 * H * D;
  uint16_t *noise = malloc((fe * 2 + 4096) * sizeof *noise);
  for (size_t i = 0; i < fe * 2 + 4096; i++) noise[i] = (uint16_t)(0x3c00 + (rnd() & 0x3ff)) ^ (uint16_t)(rnd() & 0x8000);
  ctx c = {0};
  c.store = store, c.cuda = cuda, c.K = K, c.R = R, c.L = L, c.H = H, c.D = D, c.noise = noise, c.fe = fe;
  c.stored = calloc((size_t)users, 1);
  /* a CUDA store's users arrive by capture: a device cache of bf16 noise,
   * room for a user's 50 facts of 20 tokens after a slot offset below 64 */
  int32_t *src_table = NULL;
#ifdef BENCH_WITH_CUDA
  void *src_layers[64];
  kvi_cache_layout src_cl;
  if (cuda) {
    const int32_t SB = (64 + 50 * 20) / 16 + 1;
    const size_t src_bytes = (size_t)2 * SB * 16 * H * D * 2;
    uint16_t *h = malloc(src_bytes);
    for (size_t i = 0; i < src_bytes / 2; i++) h[i] = noise[(i * 7919) % (fe * 2 + 4096)];
    for (int l = 0; l < L; l++) {
      CU(cudaMalloc(&src_layers[l], src_bytes));
      CU(cudaMemcpy(src_layers[l], h, src_bytes, cudaMemcpyHostToDevice));
    }
    free(h);
    CK(kvi_cache_layout_preset(&src_cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, 16, SB, src_layers, NULL,
                               NULL));
    src_cl.memory = KVI_MEMORY_DEVICE;
    CK(kvi_encoder_create(&c.enc, store, &src_cl, NULL));
    src_table = malloc((size_t)SB * sizeof *src_table);
    for (int32_t b = 0; b < SB; b++) src_table[b] = (b * 5) % SB;
    c.src_table = src_table, c.src_blocks = SB;
  }
#endif
  if (all) {
    for (long u = 0; u < users; u++) put_user(&c, (uint64_t)u);
    kvi_store_stats st = KVI_STORE_STATS_INIT;
    CK(kvi_store_stats_get(store, &st));
    printf("put every user: %.1f s, %.0f facts/s; written to disk %.1f MB in %llu writes; %llu facts on disk only\n",
           c.put_ms / 1e3, (double)c.puts / (c.put_ms / 1e3), (double)st.disk_write_bytes / 1e6,
           (unsigned long long)st.disk_writes, (unsigned long long)st.facts_on_disk_only);
  }
  printf("\n");

  /* the cache: K facts of at most 20 tokens, 16-token blocks */
  const int BS = 16;
  const int32_t NB = (K * 20 + 32) / BS + 4;
  const size_t layer_bytes = (size_t)2 * NB * BS * H * D * 2;
  void *layers[64];
  for (int l = 0; l < L; l++) {
#ifdef BENCH_WITH_CUDA
    if (cuda) {
      CU(cudaMalloc(&layers[l], layer_bytes));
      continue;
    }
#endif
    layers[l] = calloc(1, layer_bytes);
  }
  kvi_cache_layout cl;
  CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = cuda ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST;
  CK(kvi_injector_create(&c.inj, store, &cl, NULL));
  c.table = malloc((size_t)NB * sizeof *c.table);
  for (int32_t b = 0; b < NB; b++) c.table[b] = (b * 7) % NB;
  c.table_len = NB;
  c.token_bytes = page_bytes / (uint64_t)P;
  const double bf16_token = (double)L * H * D * 4;
  c.prefill_tps = env_double("KVI_BENCH_PREFILL_TOKENS_PER_S", 42344.0 * 131072.0 / bf16_token);

  /* Zipf over a random ranking of the users */
  double *cdf = malloc((size_t)users * sizeof *cdf);
  uint64_t *rank = malloc((size_t)users * sizeof *rank);
  for (long i = 0; i < users; i++) rank[i] = (uint64_t)i;
  for (long i = users - 1; i > 0; i--) {
    const long j = (long)(rnd() % (uint64_t)(i + 1));
    const uint64_t x = rank[i];
    rank[i] = rank[j], rank[j] = x;
  }
  tally t;
  t.t_all = malloc((size_t)(visits + warm) * R * sizeof(double));
  t.t_disk = malloc((size_t)(visits + warm) * R * sizeof(double));
  t.t_first = malloc((size_t)(visits + warm) * sizeof(double));
  if (!t.t_all || !t.t_disk || !t.t_first) {
    fprintf(stderr, "bench_capacity: out of memory\n");
    return 1;
  }

  printf("| s | visits | new users | requests | facts | device | host | disk only | requests with disk | MB from disk "
         "| disk reads | drops to disk | promotions | p50 ms | p99 ms | p50 ms, first | p99 ms, first | p50 ms, disk "
         "| p99 ms, disk | to text |\n");
  printf("| --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: "
         "| --: | --: |\n");
  double ss[8];
  const int ns = zipf_exponents(ss, 8);
  if (ns < 0) return 1;
  char trace[1024] = "";
  for (int si = 0; si < ns; si++) {
    const double s = ss[si];
    double acc = 0;
    for (long i = 0; i < users; i++) acc += pow((double)(i + 1), -s), cdf[i] = acc;
    for (int phase = 0; phase < 2; phase++) {
      const long n = phase ? visits : warm;
      reset(&t);
      kvi_store_stats a = KVI_STORE_STATS_INIT, b = KVI_STORE_STATS_INIT;
      CK(kvi_store_stats_get(store, &a));
      for (long i = 0; i < n; i++) {
        const double x = rnd01() * acc;
        long lo = 0, hi = users - 1;
        while (lo < hi) {
          const long mid = (lo + hi) / 2;
          if (cdf[mid] < x) lo = mid + 1;
          else hi = mid;
        }
        visit(&c, rank[lo], &t);
      }
      CK(kvi_store_stats_get(store, &b));
      if (!phase) {
        /* the disk-load rate the policy predicts with: the warm-up's, or KVI_BENCH_DISK_GBPS */
        const double gbps = env_double("KVI_BENCH_DISK_GBPS", 0);
        c.disk_s_per_byte = gbps > 0 ? 1e-9 / gbps
                            : t.disk_load_bytes > 0 ? t.disk_load_ms * 1e-3 / t.disk_load_bytes : c.disk_s_per_byte;
        continue;
      }
      const double F = t.facts ? (double)t.facts : 1, A = t.all_facts ? (double)t.all_facts : 1, Rq = t.requests ? (double)t.requests : 1;
      const double p50 = quantile(t.t_all, t.n_all, 0.5), p99 = quantile(t.t_all, t.n_all, 0.99);
      const double d50 = quantile(t.t_disk, t.n_disk, 0.5), d99 = quantile(t.t_disk, t.n_disk, 0.99);
      const double f50 = quantile(t.t_first, t.n_first, 0.5), f99 = quantile(t.t_first, t.n_first, 0.99);
      printf("| %.1f | %ld | %llu | %llu | %llu | %.2f%% | %.2f%% | %.2f%% | %.2f%% | %.1f | %llu | %llu | %llu | %.3f "
             "| %.3f | %.3f | %.3f | %.3f | %.3f | %.2f%% |\n",
             s, n, (unsigned long long)t.new_users, (unsigned long long)t.requests, (unsigned long long)t.facts, 100 * t.on[0] / F, 100 * t.on[1] / F,
             100 * t.on[2] / F, 100.0 * t.disk_requests / Rq,
             (double)(b.disk_read_bytes - a.disk_read_bytes) / 1e6, (unsigned long long)(b.disk_reads - a.disk_reads),
             (unsigned long long)(b.drops_to_disk - a.drops_to_disk), (unsigned long long)(b.promotions - a.promotions),
             p50, p99, f50, f99, d50, d99, 100.0 * t.fallbacks / Rq);
      snprintf(trace + strlen(trace), sizeof trace - strlen(trace), "%s\"%.1f\": {\"device\": %.4f, \"host\": %.4f, \"disk\": %.4f}",
               si ? ", " : "", s, (t.all_on[0] + (cuda ? 0 : t.all_on[1])) / A, cuda ? t.all_on[1] / A : 0.0,
               t.all_on[2] / A);
    }
  }
  printf("\nnew users: visits that met their user first and put (captured) its facts; their requests are left\n"
         "out of the other columns. device / host / disk only: where each requested fact was when its request came\n"
         "(kvi_store_fact_tier; a CPU store's memory is its host tier). Times: load + inject per request (the\n"
         "first of a visit: its prefetch, then the injection, which waits for its own facts' reads; \"first\":\n"
         "those first requests alone). to text:\n"
         "requests whose disk-only facts would load slower (at %.2f GB/s) than prefilling their tokens at %.0f\n"
         "tokens/s. Counters over the measured visits.\n",
         c.disk_s_per_byte > 0 ? 1e-9 / c.disk_s_per_byte : 0.0, c.prefill_tps);
  /* as the model's placement counts them: every visit, a new user's first request from disk; a CPU
   * store's memory is the top tier, the model's "device" */
  printf("\ncapacity model input (new users' visits included, their first request as from disk%s):\n"
         "{\"trace\": {%s}}\n", cuda ? "" : "; the CPU store's memory as the model's device tier", trace);

  kvi_injector_destroy(c.inj);
  if (c.enc) kvi_encoder_destroy(c.enc);
  kvi_store_destroy(store);
  kvi_model_destroy(model);
  for (int l = 0; l < L; l++) {
#ifdef BENCH_WITH_CUDA
    if (cuda) {
      cudaFree(layers[l]);
      cudaFree(src_layers[l]);
      continue;
    }
#endif
    free(layers[l]);
  }
  free(src_table);
  remove_dir(dir);
  free(noise), free(cdf), free(rank), free(t.t_all), free(t.t_disk), free(c.table);
  return 0;
}
