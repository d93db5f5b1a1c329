/*
 * Thread torture: every call the headers promise thread-safe, on one CPU
 * store (with embeddings), its injector and its encoder and the model, from
 * NTHREADS threads at once for a given time (argument 1, seconds; default
 * 10). Built with ThreadSanitizer in CI (.ci/run: build-tsan/), where any
 * data race fails the run; in the ordinary build it runs briefly in suite
 * 'torture'.
 *
 * Each thread owns a tenant and a range of cache blocks, so every result is
 * checkable without a shared model: a fact read back is exactly one version
 * that was put (its tag in element 0, the rest derived from the tag); an
 * injection writes the fact's keys (NoPE model: unrotated) into the
 * thread's blocks; an encode captures them back bit for bit. One tenant is
 * shared: its facts are replaced, removed and read by every thread, and each
 * read must still be some whole version. Around them run list, count,
 * stats, search, retrieve_inject, prefetch, save, load, journal open/close
 * (compaction) and the model's readers.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <kvinject.h>

enum { NTHREADS = 6, L = 2, H = 2, D = 4, BS = 4, BLOCKS_PER = 4, NB = NTHREADS * BLOCKS_PER, MAX_T = 6, DIM = 4 };
enum { PER_TOKEN = L * H * D, IDS = 8, SHARED = 1000 };

static kvi_model *model;
static kvi_store *store;
static kvi_injector *inj;
static kvi_encoder *enc;
static float cache[L][2][NB][BS][H][D];
static char dir[256];
static atomic_int failed;
static atomic_long ops;
static double deadline;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define FAIL(...)                                                                                          \
  do {                                                                                                     \
    fprintf(stderr, "torture: " __VA_ARGS__);                                                              \
    fprintf(stderr, " (kvi_last_error: %s)\n", kvi_last_error());                                          \
    atomic_store(&failed, 1);                                                                              \
  } while (0)

/* A call whose status must be one of the listed ones. */
#define EXPECT(call, ...)                                                                                  \
  do {                                                                                                     \
    const kvi_status st_ = (call), ok_[] = {__VA_ARGS__};                                                  \
    int good_ = 0;                                                                                         \
    for (size_t i_ = 0; i_ < sizeof ok_ / sizeof ok_[0]; i_++) good_ |= st_ == ok_[i_];                   \
    if (!good_) FAIL("%s:%d: %s returned %d (%s)", __FILE__, __LINE__, #call, (int)st_, kvi_status_string(st_)); \
    atomic_fetch_add(&ops, 1);                                                                             \
  } while (0)

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13, *s ^= *s >> 7, *s ^= *s << 17;
  return *s;
}

/* Element i of a version tagged `tag` (K: i < n, V: after): small integers, exact in fp32. */
static float value(uint32_t tag, int64_t i) { return (float)(int32_t)((tag * 2654435761u + (uint32_t)i * 40503u) % 4099u) - 2049.0f; }

static int32_t tokens_of(uint32_t tag) { return 1 + (int32_t)(tag % MAX_T); }

static void fill(float *kv, uint32_t tag) {
  const int32_t T = tokens_of(tag);
  const int64_t n = 2 * (int64_t)T * PER_TOKEN;
  for (int64_t i = 0; i < n; i++) kv[i] = value(tag, i);
  kv[0] = (float)(tag & 0xfffff); /* exact: < 2^24 */
}

/* The buffer holds exactly one version, of T tokens. */
static int check(const float *kv, int32_t T, uint32_t *tag_out) {
  const uint32_t lo = (uint32_t)kv[0];
  for (uint32_t hi = 0; hi < 4096; hi++) { /* tags are 32-bit: find the one whose low bits match */
    const uint32_t tag = hi << 20 | lo;
    if (tokens_of(tag) != T) continue;
    const int64_t n = 2 * (int64_t)T * PER_TOKEN;
    int64_t i = 1;
    while (i < n && kv[i] == value(tag, i)) i++;
    if (i == n) {
      if (tag_out) *tag_out = tag;
      return 1;
    }
  }
  return 0;
}

static void view(kvi_kv_view *v, float *kv, int32_t T) {
  kvi_kv_view_contiguous(v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, kv, kv + (int64_t)T * PER_TOKEN);
}

static void embedding(float *e, uint32_t tag) {
  for (int i = 0; i < DIM; i++) e[i] = (float)((tag >> (4 * i)) % 7) - 3.0f;
}

static void put(uint64_t tenant, uint64_t id, uint32_t tag, uint32_t flags) {
  float kv[2 * MAX_T * PER_TOKEN], e[DIM];
  fill(kv, tag);
  embedding(e, tag);
  kvi_kv_view v;
  view(&v, kv, tokens_of(tag));
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.flags = flags, po.embedding = e;
  EXPECT(kvi_store_put(store, tenant, id, &v, &po, NULL), KVI_OK, KVI_ERR_EXISTS, KVI_ERR_CAPACITY);
}

/* Reads (tenant, id): absent, or one whole version. */
static void read_back(uint64_t tenant, uint64_t id) {
  for (int attempt = 0; attempt < 4; attempt++) {
    int32_t T = 0;
    kvi_status st = kvi_store_fact_tokens(store, tenant, id, &T);
    atomic_fetch_add(&ops, 1);
    if (st == KVI_ERR_NOT_FOUND) return;
    if (st != KVI_OK) { FAIL("fact_tokens(%" PRIu64 ", %" PRIu64 "): %d", tenant, id, (int)st); return; }
    float kv[2 * MAX_T * PER_TOKEN];
    kvi_kv_view v;
    view(&v, kv, T);
    st = kvi_store_read(store, tenant, id, &v, NULL);
    atomic_fetch_add(&ops, 1);
    if (st == KVI_ERR_NOT_FOUND || st == KVI_ERR_MISMATCH) continue; /* replaced or removed in between */
    if (st != KVI_OK) { FAIL("read(%" PRIu64 ", %" PRIu64 "): %d", tenant, id, (int)st); return; }
    if (!check(kv, T, NULL)) { FAIL("read(%" PRIu64 ", %" PRIu64 ") is no whole version", tenant, id); return; }
    float e[DIM];
    EXPECT(kvi_store_get_embedding(store, tenant, id, e), KVI_OK, KVI_ERR_NOT_FOUND);
    return;
  }
}

typedef struct worker {
  int index;
  uint64_t seed;
  uint32_t tags[IDS]; /* own tenant: the version of each id, 0 = absent */
} worker;

static int32_t block_table(const worker *w, int32_t *table) {
  for (int i = 0; i < BLOCKS_PER; i++) table[i] = w->index * BLOCKS_PER + i;
  return BLOCKS_PER;
}

/* The cache's K at the thread's first `T` slots equals the fact's K. */
static int cache_holds(const worker *w, uint32_t tag, int64_t first_slot) {
  float kv[2 * MAX_T * PER_TOKEN];
  fill(kv, tag);
  const int32_t T = tokens_of(tag);
  for (int l = 0; l < L; l++)
    for (int t = 0; t < T; t++)
      for (int h = 0; h < H; h++)
        for (int d = 0; d < D; d++) {
          const int64_t s = first_slot + t;
          const int b = w->index * BLOCKS_PER + (int)(s / BS);
          const float want_k = kv[((int64_t)l * T + t) * H * D + h * D + d];
          const float want_v = kv[(int64_t)T * PER_TOKEN + ((int64_t)l * T + t) * H * D + h * D + d];
          if (cache[l][0][b][s % BS][h][d] != want_k || cache[l][1][b][s % BS][h][d] != want_v) return 0;
        }
  return 1;
}

static void *run(void *arg) {
  worker *w = arg;
  const uint64_t tenant = 1 + (uint64_t)w->index;
  char path[300];
  snprintf(path, sizeof path, "%s/save-%d.kvs", dir, w->index);
  int32_t table[BLOCKS_PER];
  block_table(w, table);
  while (now() < deadline && !atomic_load(&failed)) {
    const uint64_t id = rnd(&w->seed) % IDS;
    const uint32_t tag = (uint32_t)rnd(&w->seed) | 1u;
    switch (rnd(&w->seed) % 16) {
    case 0: case 1: /* own tenant: put or replace, then read back exactly */
      put(tenant, id, tag, KVI_PUT_REPLACE);
      w->tags[id] = tag;
      {
        float kv[2 * MAX_T * PER_TOKEN];
        kvi_kv_view v;
        view(&v, kv, tokens_of(tag));
        uint32_t got = 0;
        EXPECT(kvi_store_read(store, tenant, id, &v, NULL), KVI_OK);
        if (!check(kv, tokens_of(tag), &got) || got != tag) FAIL("own fact %" PRIu64 " reads another version", id);
      }
      break;
    case 2: /* own tenant: remove */
      EXPECT(kvi_store_remove(store, tenant, id), w->tags[id] ? KVI_OK : KVI_ERR_NOT_FOUND);
      w->tags[id] = 0;
      break;
    case 3: { /* own tenant: list and count agree with the thread's own record */
      uint64_t ids[IDS];
      size_t total = 0, count = 0, want = 0;
      for (int i = 0; i < IDS; i++) want += w->tags[i] != 0;
      EXPECT(kvi_store_list(store, tenant, ids, IDS, &total), KVI_OK);
      EXPECT(kvi_store_count(store, tenant, &count), KVI_OK);
      if (total != want || count != want) FAIL("tenant %" PRIu64 ": list %zu, count %zu, expected %zu", tenant, total, count, want);
      for (size_t i = 0; i < total && i < IDS; i++)
        if (ids[i] >= IDS || !w->tags[ids[i]] || (i && ids[i] <= ids[i - 1])) FAIL("tenant %" PRIu64 ": bad list", tenant);
      break;
    }
    case 4: case 5: /* the shared tenant: put, replace, remove, read from every thread */
      if (tag % 3 == 0) EXPECT(kvi_store_remove(store, SHARED, id), KVI_OK, KVI_ERR_NOT_FOUND);
      else put(SHARED, id, tag, tag % 3 == 1 ? KVI_PUT_REPLACE : 0);
      read_back(SHARED, rnd(&w->seed) % IDS);
      break;
    case 6: { /* stats and search */
      kvi_store_stats s = KVI_STORE_STATS_INIT;
      EXPECT(kvi_store_stats_get(store, &s), KVI_OK);
      if (s.pages_used > s.pages_total) FAIL("stats: %" PRIu64 " pages used of %" PRIu64, s.pages_used, s.pages_total);
      float q[2 * DIM];
      embedding(q, tag), embedding(q + DIM, tag >> 3);
      const uint64_t tenants[2] = {tenant, SHARED};
      uint64_t out[2 * 3];
      float scores[2 * 3];
      int32_t counts[2];
      EXPECT(kvi_store_search(store, q, 2, DIM, tenants, 3, out, scores, counts, NULL, NULL), KVI_OK);
      for (int i = 0; i < counts[0]; i++)
        if (out[i] >= IDS || !w->tags[out[i]]) FAIL("search found %" PRIu64 ", not a fact of tenant %" PRIu64, out[i], tenant);
      int64_t bad;
      EXPECT(kvi_store_async_errors(store, &bad), KVI_OK);
      break;
    }
    case 7: case 8: { /* inject one own fact, check the cache, capture it back */
      if (!w->tags[id]) break;
      const uint64_t ids[1] = {id};
      int64_t planned = 0;
      EXPECT(kvi_inject_plan(inj, tenant, ids, 1, &planned), KVI_OK);
      kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
      rq.tenant = tenant, rq.fact_ids = ids, rq.num_facts = 1, rq.block_table = table, rq.block_table_len = BLOCKS_PER;
      rq.first_slot = (int64_t)(tag % 4);
      EXPECT(kvi_inject(inj, &rq, 1, NULL, NULL), KVI_OK);
      if (planned != tokens_of(w->tags[id]) || !cache_holds(w, w->tags[id], rq.first_slot))
        FAIL("inject of fact %" PRIu64 " did not write it", id);
      int64_t skipped;
      EXPECT(kvi_injector_async_errors(inj, &skipped), KVI_OK);
      const uint64_t copy = IDS + id; /* captured copies: ids IDS.. (not in the own record) */
      kvi_capture c = KVI_CAPTURE_INIT;
      float e[DIM];
      embedding(e, w->tags[id]);
      c.tenant = tenant + 100, c.fact_id = copy, c.block_table = table, c.block_table_len = BLOCKS_PER;
      c.first_slot = rq.first_slot, c.num_tokens = tokens_of(w->tags[id]), c.flags = KVI_PUT_REPLACE, c.embedding = e;
      EXPECT(kvi_encode(enc, &c, 1, NULL), KVI_OK, KVI_ERR_CAPACITY);
      break;
    }
    case 9: { /* retrieve and inject the best own fact */
      float q[DIM];
      embedding(q, tag);
      kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
      rr.tenant = tenant, rr.block_table = table, rr.block_table_len = BLOCKS_PER;
      uint64_t out[1];
      int32_t counts[1], toks[1];
      EXPECT(kvi_retrieve_inject(inj, q, 1, DIM, &rr, 1, NULL, out, counts, toks, NULL), KVI_OK);
      if (counts[0] == 1 && (out[0] >= IDS || !w->tags[out[0]] || !cache_holds(w, w->tags[out[0]], 0)))
        FAIL("retrieve_inject wrote %" PRIu64 ", not an own fact", out[0]);
      break;
    }
    case 10: /* prefetch (one tier: checks only) and reads of captured copies */
      EXPECT(kvi_store_prefetch(store, tenant, NULL, 0, NULL), KVI_OK);
      read_back(tenant + 100, IDS + id);
      break;
    case 11: { /* the model's readers */
      kvi_model_info mi = KVI_MODEL_INFO_INIT;
      EXPECT(kvi_model_info_get(model, &mi), KVI_OK);
      kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
      EXPECT(kvi_model_get_rope(model, (int32_t)(id % L), &rs), KVI_OK);
      float c, s;
      EXPECT(kvi_model_rope_cos_sin(model, 0, 3, 0, &c, &s), KVI_ERR_INVALID_ARGUMENT); /* NoPE layer */
      if (mi.num_layers != L) FAIL("model_info: %d layers", (int)mi.num_layers);
      break;
    }
    case 12: /* a failed call's message is this thread's own */
      if (kvi_store_remove(store, tenant, 1u << 30) != KVI_ERR_NOT_FOUND || !strstr(kvi_last_error(), "kvi_store_remove"))
        FAIL("remove of an unknown id: wrong status or message");
      break;
    case 13: { /* save, and load the file into a new store */
      if (tag % 8) break;
      EXPECT(kvi_store_save(store, path, NULL), KVI_OK);
      kvi_store_options so = KVI_STORE_OPTIONS_INIT;
      so.backend = KVI_BACKEND_CPU, so.dtype = KVI_DTYPE_FP32, so.page_tokens = 4, so.budget_bytes = 8 << 20;
      so.embedding_dim = DIM;
      kvi_store *copy = NULL;
      EXPECT(kvi_store_load(&copy, model, &so, path, NULL), KVI_OK);
      kvi_store_destroy(copy);
      break;
    }
    case 14: /* journal: open (or compact), close */
      if (tag % 16) break;
      {
        char jpath[300];
        snprintf(jpath, sizeof jpath, "%s/journal.kvs", dir);
        EXPECT(kvi_store_journal_open(store, jpath, 0), KVI_OK);
        if (tag & 0x10) EXPECT(kvi_store_journal_close(store), KVI_OK);
      }
      break;
    default:
      read_back(tenant, id);
      break;
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  const double seconds = argc > 1 ? atof(argv[1]) : 10.0;
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, sizeof dir, "%s/kvi-torture-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(dir)) return perror("mkdtemp"), 1;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU, so.dtype = KVI_DTYPE_FP32, so.page_tokens = 4, so.budget_bytes = 8 << 20;
  so.embedding_dim = DIM;
  void *layers[L];
  for (int l = 0; l < L; l++) layers[l] = cache[l];
  kvi_cache_layout cl;
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = KVI_ROPE_NONE; /* captures compare bit for bit; the readers expect a NoPE layer */
  if (kvi_model_create(&model, &mo) || kvi_model_set_rope(model, -1, &rs) || kvi_store_create(&store, model, &so) ||
      kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, BS, NB, layers, NULL, NULL)) {
    fprintf(stderr, "torture: setup: %s\n", kvi_last_error());
    return 1;
  }
  cl.memory = KVI_MEMORY_HOST;
  if (kvi_injector_create(&inj, store, &cl, NULL) || kvi_encoder_create(&enc, store, &cl, NULL)) {
    fprintf(stderr, "torture: setup: %s\n", kvi_last_error());
    return 1;
  }
  deadline = now() + seconds;
  pthread_t th[NTHREADS];
  static worker w[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    w[i].index = i, w[i].seed = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
    pthread_create(&th[i], NULL, run, &w[i]);
  }
  for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
  kvi_store_journal_close(store);
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);
  kvi_model_destroy(model);
  char path[300];
  for (int i = 0; i <= NTHREADS; i++) {
    if (i < NTHREADS) snprintf(path, sizeof path, "%s/save-%d.kvs", dir, i);
    else snprintf(path, sizeof path, "%s/journal.kvs", dir);
    unlink(path);
  }
  if (rmdir(dir) != 0) perror(dir);
  printf("torture: %d threads, %.1f s, %ld calls: %s\n", NTHREADS, seconds, atomic_load(&ops),
         atomic_load(&failed) ? "FAILED" : "ok");
  return atomic_load(&failed) ? 1 : 0;
}
