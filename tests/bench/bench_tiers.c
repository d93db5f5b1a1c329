/*
 * bench_tiers — injecting one tenant's k facts from each tier of a store
 * (device pages, the pinned-host tier, the disk tier), per store dtype,
 * against the ceiling of each tier measured in the same run.
 *
 * Llama-3.1-8B geometry by default (32 layers, 8 KV heads, head size 128,
 * llama3 RoPE), k = 50 facts of 20 tokens, injected into a bf16 vLLM
 * FlashAttention cache (16-token blocks, scattered), for store dtypes bf16
 * and fp8 (16-token pages) and q4 (64-token pages). Cases:
 *   - device: the facts already on the device (kvi_inject);
 *   - promote: the facts on the host tier, moved up by the call
 *     (KVI_HOST_PAGES_PROMOTE; two sets alternate as in bench_tier);
 *   - mapped: the facts on the host tier, read in place (READ_MAPPED);
 *   - disk cold: the facts only in the tenant's file, the files' page cache
 *     dropped before each call (fdatasync, posix_fadvise POSIX_FADV_DONTNEED):
 *     a store with a disk tier whose device tier holds one set and host tier
 *     two, four tenants of a set in turn, so that each call finds its tenant
 *     on disk only; the call reads it back onto the host tier (dropping the
 *     least recently used host facts), promotes it and injects;
 *   - disk prefetched: the same, after kvi_store_prefetch of the tenant (all
 *     its facts) has completed: its reads run on the store's I/O thread and a
 *     CUDA store publishes and promotes the finished ones at its next
 *     prefetch, so the benchmark prefetches again until kvi_store_fact_tier
 *     finds none on disk, then waits for the copies ("prefetch ms": all that);
 *   - capture and capture + disk: kvi_encode of k facts from the cache into
 *     device pages, and into a store with a disk tier, which writes them
 *     through to the tenant's file inside the call (the facts are removed
 *     after each call, untimed).
 * Ceilings, in the same run: a device-to-device cudaMemcpyAsync of the bf16
 * bytes the injection writes (device, and a prefetched tenant found on the
 * device) or the capture reads; a pinned host-to-device cudaMemcpyAsync of the store bytes the
 * call moves (host cases); the disk's sequential read rate, measured here on
 * a file of DISK_FILE_MB in the same directory (written, fdatasync'ed,
 * dropped from the page cache, read with 16 MiB O_DIRECT preads; buffered
 * where O_DIRECT is refused), applied to the bytes the call read from disk
 * (kvi_store_stats.disk_read_bytes). "of ceiling" = ceiling ms / call ms.
 * Times: median over ITERS calls after warm-ups, CUDA events around the
 * call (the GPU idles before it, so host work and file reads are inside).
 *
 * Environment (KVI_BENCH_*): K (50), FACT_TOKENS (20), LAYERS (32), HEADS
 * (8), HEAD_SIZE (128), DTYPES ("bf16,fp8,q4"), ITERS (fewer calls for a
 * quick run), DIR (the disk tier's directory's parent; default $TMPDIR or
 * /tmp: point it at the NVMe to measure), DISK_FILE_MB (1024).
 * Exits 77 without a CUDA device.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include <kvinject.h>

#include "bench.h"

enum { BS = 16, ITERS = 40, DISK_ITERS = 10, MAXL = 256 };

static int L = 32, H = 8, D = 128, K = 50, T = 20;
static size_t token_bf16; /* K and V of one token, bf16 */

static long env_long(const char *name, long def) {
  const char *e = getenv(name);
  return e && *e ? atol(e) : def;
}

/* ------------------------------------------------------------ the disk */

/* Writes back and drops from the page cache every file of dir. */
static void drop_dir_cache(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char p[4096 + 256 + 2];
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    const int fd = open(p, O_RDONLY);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
  closedir(d);
}

static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char p[4096 + 256 + 2];
  while ((e = readdir(d))) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    if (unlink(p)) remove_dir(p);
  }
  closedir(d);
  rmdir(dir);
}

/* The sequential read rate of the directory's file system in GB/s: a file
 * of mb MiB written, synced, dropped, read back in 16 MiB preads; median of 3. */
static double disk_read_gbps(const char *dir, long mb, int *direct) {
  char p[4096 + 256 + 2];
  snprintf(p, sizeof p, "%s/seq-read.bin", dir);
  const size_t chunk = (size_t)16 << 20, total = (size_t)mb << 20;
  char *buf;
  if (posix_memalign((void **)&buf, 4096, chunk)) exit(1);
  for (size_t i = 0; i < chunk; i++) buf[i] = (char)(i * 131 + 7);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  if (fd < 0) {
    perror(p);
    exit(1);
  }
  for (size_t off = 0; off < total; off += chunk)
    if (pwrite(fd, buf, chunk, (off_t)off) != (ssize_t)chunk) {
      perror("pwrite");
      exit(1);
    }
  fdatasync(fd);
  close(fd);
  float t[3];
  for (int r = 0; r < 3; r++) {
    fd = open(p, O_RDONLY);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
    fd = open(p, O_RDONLY | O_DIRECT);
    *direct = fd >= 0;
    if (fd < 0) fd = open(p, O_RDONLY);
    const double t0 = now_ms();
    for (size_t off = 0; off < total; off += chunk)
      if (pread(fd, buf, chunk, (off_t)off) != (ssize_t)chunk) {
        perror("pread");
        exit(1);
      }
    t[r] = (float)(now_ms() - t0);
    close(fd);
  }
  unlink(p);
  free(buf);
  return (double)total / (median(t, 3) * 1e-3) / 1e9;
}

/* ------------------------------------------------------------ timing */

static cudaEvent_t e0, e1;

/* Calls a case makes: its warm-ups and iters. */
static int calls_of(int iters) { return iters + (bench_warm < 2 ? bench_warm : 2); }

/* Median ms of a cudaMemcpyAsync of `bytes` of the given kind. */
static float copy_ms(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind) {
  float t[ITERS];
  for (int i = -bench_warm; i < bench_iters; i++) {
    CU(cudaEventRecord(e0, 0));
    CU(cudaMemcpyAsync(dst, src, bytes, kind, 0));
    CU(cudaEventRecord(e1, 0));
    CU(cudaEventSynchronize(e1));
    if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
  }
  return median(t, bench_iters);
}

typedef struct {
  kvi_model *model;
  const uint16_t *noise; /* bf16 K then V of one fact, and slack */
  void **layers;
  int64_t NB;
  const int32_t *table;
  float d2d_ms;
  double disk_gbps;
} setup;

typedef struct {
  const char *name;
  kvi_dtype dtype;
  int P;
} dtype_case;

static kvi_store *make_store(const setup *su, const dtype_case *dc, uint64_t dev_sets, uint64_t host_sets,
                             const char *disk_dir) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  so.dtype = dc->dtype;
  so.page_tokens = dc->P;
  /* a set's bytes: K facts' pages, a page's bytes from a small probe store */
  kvi_store_options po = so;
  po.budget_bytes = (uint64_t)64 << 20;
  kvi_store *probe;
  CK(kvi_store_create(&probe, su->model, &po));
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CK(kvi_store_stats_get(probe, &st));
  kvi_store_destroy(probe);
  const uint64_t set = (uint64_t)K * (uint64_t)((T + dc->P - 1) / dc->P) * st.page_bytes;
  so.budget_bytes = dev_sets * set;
  so.host_budget_bytes = host_sets * set;
  so.disk_dir = disk_dir;
  kvi_store *store;
  CK(kvi_store_create(&store, su->model, &so));
  return store;
}

static void put_set(kvi_store *store, const setup *su, uint64_t tenant, int first) {
  const size_t fe = (size_t)L * T * H * D;
  for (int f = first; f < first + K; f++) {
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_BF16, L, T, H, D, (void *)(su->noise + (size_t)(f % 7) * 64),
                           (void *)(su->noise + fe + (size_t)(f % 5) * 64));
    CK(kvi_store_put(store, tenant, (uint64_t)f, &kv, NULL, NULL));
  }
}

/* Facts of tenant (first..first+K) on `tier` now. */
static int count_on(const kvi_store *store, uint64_t tenant, int first, int tier) {
  int n = 0;
  for (int f = first; f < first + K; f++) {
    int32_t t;
    CK(kvi_store_fact_tier(store, tenant, (uint64_t)f, &t));
    n += t == tier;
  }
  return n;
}

static kvi_status inject(kvi_injector *inj, uint64_t tenant, int first, int i, const kvi_inject_options *io,
                         const setup *su) {
  uint64_t ids[4096];
  for (int f = 0; f < K; f++) ids[f] = (uint64_t)(first + f);
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = tenant;
  rq.fact_ids = ids;
  rq.num_facts = K;
  rq.block_table = su->table + (i & 7) * 8;
  rq.block_table_len = (int32_t)(su->NB - 64);
  rq.start_position = 100;
  return kvi_inject(inj, &rq, 1, io, NULL);
}

static void row(const char *dt, int P, const char *what, double bytes, float ms, float hms, const char *ceil_name,
                float ceil_ms, const char *note) {
  printf("| %-5s | %2d | %-15s | %8.1f | %8.3f | %7.3f | %7.1f | %-8s | %8.3f | %6.1f%% | %s |\n", dt, P, what,
         bytes / 1048576.0, ms, hms, bytes / (ms * 1e-3) / 1e9, ceil_name, ceil_ms, 100.0 * ceil_ms / ms, note);
}

/* Times one case: its warm-ups and `iters` calls, each before(i) untimed, then the
 * injection; a failed call ends the case and is returned (its row then says so). */
typedef void (*before_fn)(void *arg, int i, uint64_t *tenant, int *first);

static kvi_status time_case(kvi_injector *inj, const setup *su, const kvi_inject_options *io, int iters, before_fn before,
                      void *arg, float *ms, float *hms) {
  float t[ITERS], th[ITERS];
  const int warm = bench_warm < 2 ? bench_warm : 2;
  for (int i = -warm; i < iters; i++) {
    uint64_t tenant;
    int first;
    before(arg, i + warm, &tenant, &first);
    CU(cudaDeviceSynchronize());
    CU(cudaEventRecord(e0, 0));
    const double h0 = now_ms();
    const kvi_status st = inject(inj, tenant, first, i + warm, io, su);
    const double h1 = now_ms();
    if (st != KVI_OK) return st;
    CU(cudaEventRecord(e1, 0));
    CU(cudaEventSynchronize(e1));
    if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
    if (i >= 0) th[i] = (float)(h1 - h0);
  }
  *ms = median(t, iters);
  *hms = median(th, iters);
  return KVI_OK;
}

/* A case's row, or the error that ended it. */
static void row_or_error(kvi_status st, const char *dt, int P, const char *what, double bytes, float ms, float hms,
                         const char *ceil_name, float ceil_ms, const char *note) {
  if (st == KVI_OK) row(dt, P, what, bytes, ms, hms, ceil_name, ceil_ms, note);
  else printf("| %-5s | %2d | %-15s | failed: %s: %s |\n", dt, P, what, kvi_status_string(st), kvi_last_error());
}

/* the cases' set-up before each call */
typedef struct {
  kvi_store *store;
  kvi_injector *inj;
  const char *dir;
  int mode; /* 0 device, 1 promote, 2 mapped, 3 disk cold, 4 disk prefetched */
  int found; /* calls whose facts were all where the case wants them */
  double prefetch_ms;
  int turn; /* disk cases: the next of tenants 1..4, least recently used first */
} case_arg;

static void before(void *p, int i, uint64_t *tenant, int *first) {
  case_arg *a = p;
  switch (a->mode) {
  case 0: *tenant = 1, *first = 0; break;
  case 1: *tenant = 1, *first = i % 2 ? 0 : K; a->found += count_on(a->store, 1, *first, KVI_TIER_HOST) == K; break;
  case 2: *tenant = 1, *first = 2 * K; a->found += count_on(a->store, 1, *first, KVI_TIER_HOST) == K; break;
  default: {
    (void)i;
    *tenant = 1 + (uint64_t)(a->turn++ % 4), *first = 0;
    drop_dir_cache(a->dir);
    if (a->mode == 4) {
      /* the reads run on the store's I/O thread; a CUDA store publishes (and promotes) the
       * finished ones at its next prefetch: prefetch again until none is left on disk */
      const double t0 = now_ms();
      CK(kvi_store_prefetch(a->store, *tenant, NULL, 0, NULL));
      while (count_on(a->store, *tenant, 0, KVI_TIER_DISK) > 0) {
        if (now_ms() - t0 > 60e3) {
          fprintf(stderr, "bench_tiers: a prefetch did not complete in 60 s\n");
          exit(1);
        }
        usleep(50);
        CK(kvi_store_prefetch(a->store, *tenant, NULL, 0, NULL));
      }
      CU(cudaDeviceSynchronize()); /* the promotions on the store's copy stream too */
      a->prefetch_ms += now_ms() - t0;
      a->found += count_on(a->store, *tenant, 0, KVI_TIER_DEVICE) == K;
    } else {
      a->found += count_on(a->store, *tenant, 0, KVI_TIER_DISK) == K;
    }
  }
  }
}

/* Captures K facts of T tokens from the cache (kvi_encode) into a store with
 * room for two sets on the device and no host tier, with a disk tier in `dir`
 * (NULL: none): the median ms over the calls (CUDA events; a write-through
 * completes inside the call), host ms too, and the disk bytes written a call.
 * The facts are removed after each call, untimed. */
static float capture_ms(const setup *su, const dtype_case *dc, const kvi_cache_layout *cl, const char *dir, float *hms,
                        double *disk_bytes) {
  kvi_store *store = make_store(su, dc, 2, 0, dir);
  kvi_encoder *enc;
  CK(kvi_encoder_create(&enc, store, cl, NULL));
  kvi_capture *cap = calloc((size_t)K, sizeof *cap);
  float t[ITERS], th[ITERS];
  uint64_t written = 0; /* by the timed calls (the removals write too) */
  const int warm = bench_warm < 2 ? bench_warm : 2;
  for (int i = -warm; i < bench_iters; i++) {
    for (int f = 0; f < K; f++) {
      kvi_capture_init(&cap[f], sizeof cap[f]);
      cap[f].tenant = 1;
      cap[f].fact_id = (uint64_t)f;
      cap[f].block_table = su->table + ((i + warm) & 7) * 8;
      cap[f].block_table_len = (int32_t)(su->NB - 64);
      cap[f].first_slot = (int64_t)f * T;
      cap[f].num_tokens = T;
      cap[f].start_position = 100 + f * T;
    }
    kvi_store_stats s0 = KVI_STORE_STATS_INIT, s1 = KVI_STORE_STATS_INIT;
    CK(kvi_store_stats_get(store, &s0));
    CU(cudaDeviceSynchronize());
    CU(cudaEventRecord(e0, 0));
    const double h0 = now_ms();
    CK(kvi_encode(enc, cap, K, NULL));
    const double h1 = now_ms();
    CU(cudaEventRecord(e1, 0));
    CU(cudaEventSynchronize(e1));
    CK(kvi_store_stats_get(store, &s1));
    written += s1.disk_write_bytes - s0.disk_write_bytes;
    if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
    if (i >= 0) th[i] = (float)(h1 - h0);
    for (int f = 0; f < K; f++) CK(kvi_store_remove(store, 1, (uint64_t)f));
  }
  *disk_bytes = (double)written / calls_of(bench_iters);
  *hms = median(th, bench_iters);
  free(cap);
  kvi_encoder_destroy(enc);
  kvi_store_destroy(store);
  return median(t, bench_iters);
}

static void run_dtype(const setup *su, const dtype_case *dc, const char *base) {
  char note[128];
  float ms, hms;
  /* device and host: a device tier of one set, a host tier of four; sets A (0..K-1), B, C */
  kvi_store *store = make_store(su, dc, 1, 4, NULL);
  for (int s = 0; s < 3; s++) put_set(store, su, 1, s * K);
  kvi_cache_layout cl;
  CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, BS, su->NB, su->layers, NULL, NULL));
  cl.memory = KVI_MEMORY_DEVICE;
  kvi_injector *inj;
  CK(kvi_injector_create(&inj, store, &cl, NULL));
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CK(kvi_store_stats_get(store, &st));
  const double set_bytes = (double)st.bytes_payload / (double)st.facts * K, bf16_bytes = (double)K * T * token_bf16;
  /* the ceiling of the host cases: the set's stored bytes (payload: tokens and scales) from pinned memory */
  char *pin, *dev;
  CU(cudaHostAlloc((void **)&pin, (size_t)set_bytes, cudaHostAllocDefault));
  CU(cudaMalloc((void **)&dev, (size_t)set_bytes));
  memset(pin, 1, (size_t)set_bytes);
  const float h2d = copy_ms(dev, pin, (size_t)set_bytes, cudaMemcpyHostToDevice);
  cudaFreeHost(pin);
  cudaFree(dev);
  case_arg a = {store, inj, NULL, 0, 0, 0, 0};
  CK(inject(inj, 1, 0, 0, NULL, su)); /* A up */
  kvi_status st0 = time_case(inj, su, NULL, bench_iters, before, &a, &ms, &hms);
  row_or_error(st0, dc->name, dc->P, "device", bf16_bytes, ms, hms, "D2D", su->d2d_ms, "bf16 bytes written");
  kvi_inject_options io = KVI_INJECT_OPTIONS_INIT;
  a.mode = 1, a.found = 0;
  st0 = time_case(inj, su, &io, bench_iters, before, &a, &ms, &hms);
  snprintf(note, sizeof note, "%d/%d calls found their set on the host", a.found, calls_of(bench_iters));
  row_or_error(st0, dc->name, dc->P, "host promote", set_bytes, ms, hms, "H2D", h2d, note);
  io.host_pages = KVI_HOST_PAGES_READ_MAPPED;
  a.mode = 2, a.found = 0;
  st0 = time_case(inj, su, &io, bench_iters, before, &a, &ms, &hms);
  snprintf(note, sizeof note, "%d/%d calls found their set on the host", a.found, calls_of(bench_iters));
  row_or_error(st0, dc->name, dc->P, "host mapped", set_bytes, ms, hms, "H2D", h2d, note);
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);

  /* disk: a device tier of one set, a host tier of two; tenants 1 to 4 in turn */
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/kvi-tiers-XXXXXX", base);
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    exit(1);
  }
  store = make_store(su, dc, 1, 2, dir);
  for (uint64_t tn = 1; tn <= 4; tn++) put_set(store, su, tn, 0);
  CK(kvi_injector_create(&inj, store, &cl, NULL));
  /* injected in turn once, the least recently used of the four (on disk only) is always the next */
  for (uint64_t tn = 1; tn <= 4; tn++) CK(inject(inj, tn, 0, 0, NULL, su));
  CU(cudaDeviceSynchronize());
  int turn = 0;
  const int iters = bench_iters < DISK_ITERS ? bench_iters : DISK_ITERS;
  for (int mode = 3; mode <= 4; mode++) {
    kvi_store_stats s0 = KVI_STORE_STATS_INIT, s1 = KVI_STORE_STATS_INIT;
    a = (case_arg){store, inj, dir, mode, 0, 0, turn};
    CK(kvi_store_stats_get(store, &s0));
    st0 = time_case(inj, su, NULL, iters, before, &a, &ms, &hms);
    CK(kvi_store_stats_get(store, &s1));
    turn = a.turn;
    const int calls = calls_of(iters);
    if (mode == 3) {
      const double per_call = (double)(s1.disk_read_bytes - s0.disk_read_bytes) / calls;
      snprintf(note, sizeof note, "%d/%d calls found their set on disk only", a.found, calls);
      row_or_error(st0, dc->name, dc->P, "disk cold", per_call, ms, hms, "disk",
                   (float)(per_call / (su->disk_gbps * 1e9) * 1e3), note);
    } else {
      snprintf(note, sizeof note, "prefetch %.3f ms; %d/%d calls found their set on the device", a.prefetch_ms / calls,
               a.found, calls);
      row_or_error(st0, dc->name, dc->P, "disk prefetched", bf16_bytes, ms, hms, "D2D", su->d2d_ms, note);
    }
  }
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);
  remove_dir(dir);

  /* captures: into device pages, and written through to a disk tier as well */
  snprintf(dir, sizeof dir, "%s/kvi-tiers-XXXXXX", base);
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    exit(1);
  }
  double disk_bytes = 0;
  const float cap_ms = capture_ms(su, dc, &cl, NULL, &hms, &disk_bytes);
  row(dc->name, dc->P, "capture", bf16_bytes, cap_ms, hms, "D2D", su->d2d_ms, "bf16 bytes read");
  ms = capture_ms(su, dc, &cl, dir, &hms, &disk_bytes);
  snprintf(note, sizeof note, "%.1f MiB written a call; capture without the disk %.3f ms", disk_bytes / 1048576.0, cap_ms);
  row(dc->name, dc->P, "capture + disk", bf16_bytes, ms, hms, "D2D", su->d2d_ms, note);
  remove_dir(dir);
}

int main(void) {
  bench_runs(ITERS);
  if (!bench_device("bench_tiers")) return 77;
  K = (int)env_long("KVI_BENCH_K", 50), T = (int)env_long("KVI_BENCH_FACT_TOKENS", 20);
  L = (int)env_long("KVI_BENCH_LAYERS", 32), H = (int)env_long("KVI_BENCH_HEADS", 8);
  D = (int)env_long("KVI_BENCH_HEAD_SIZE", 128);
  if (K < 1 || K > 1000 || T < 1 || L < 1 || L > MAXL || H < 1 || D < 2) {
    fprintf(stderr, "bench_tiers: bad KVI_BENCH_* geometry\n");
    return 1;
  }
  token_bf16 = (size_t)L * H * D * 2 * 2;
  const char *base = getenv("KVI_BENCH_DIR");
  if (!base || !*base) base = getenv("TMPDIR");
  if (!base || !*base) base = "/tmp";

  setup su = {0};
  su.model = bench_llama_model(L, H, D);
  const size_t fe = (size_t)L * T * H * D;
  uint16_t *noise = malloc((fe * 2 + 1024) * sizeof *noise);
  for (size_t i = 0; i < fe * 2 + 1024; i++) noise[i] = (uint16_t)(0x3c00 + (rand() & 0x3ff)) ^ (rand() & 0x8000);
  su.noise = noise;
  /* the cache: room for K * T tokens at 8 offsets, blocks scattered */
  su.NB = (int64_t)K * T / BS + 128;
  const size_t layer_bytes = (size_t)2 * su.NB * BS * H * D * 2;
  void *layers[MAXL];
  for (int l = 0; l < L; l++) {
    CU(cudaMalloc(&layers[l], layer_bytes));
    CU(cudaMemset(layers[l], 0, layer_bytes));
  }
  su.layers = layers;
  int32_t *table = malloc((size_t)su.NB * sizeof *table);
  for (int64_t b = 0; b < su.NB; b++) table[b] = (int32_t)((b * 7919) % su.NB);
  su.table = table;

  /* ceilings: D2D of the bf16 bytes, pinned H2D (per byte, from the same bytes), the disk */
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));
  const size_t bytes = (size_t)K * T * token_bf16;
  char *pin, *dev, *dev2;
  CU(cudaHostAlloc((void **)&pin, bytes, cudaHostAllocDefault));
  CU(cudaMalloc((void **)&dev, bytes));
  CU(cudaMalloc((void **)&dev2, bytes));
  memset(pin, 1, bytes);
  su.d2d_ms = copy_ms(dev2, dev, bytes, cudaMemcpyDeviceToDevice);
  const float h2d = copy_ms(dev, pin, bytes, cudaMemcpyHostToDevice);
  char dir[4096];
  snprintf(dir, sizeof dir, "%s/kvi-tiers-XXXXXX", base);
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return 1;
  }
  int direct = 0;
  const long file_mb = env_long("KVI_BENCH_DISK_FILE_MB", 1024);
  su.disk_gbps = disk_read_gbps(dir, file_mb, &direct);
  remove_dir(dir);
  printf("k = %d facts of %d tokens, model %d x %d x %d: %.1f MiB of bf16 K and V\n", K, T, L, H, D, bytes / 1048576.0);
  printf("ceilings: D2D %.3f ms (%.1f GB/s), pinned H2D %.3f ms (%.1f GB/s), disk sequential read %.2f GB/s "
         "(%ld MiB, %s, in %s)\n\n",
         su.d2d_ms, bytes / (su.d2d_ms * 1e-3) / 1e9, h2d, bytes / (h2d * 1e-3) / 1e9, su.disk_gbps, file_mb,
         direct ? "O_DIRECT" : "buffered after POSIX_FADV_DONTNEED", base);

  printf("| dtype |  P | case            |      MiB |  call ms | host ms |    GB/s | ceiling  |  ceil ms | of ceil | note |\n");
  printf("|-------|---:|-----------------|---------:|---------:|--------:|--------:|----------|---------:|--------:|------|\n");
  const char *list = getenv("KVI_BENCH_DTYPES");
  if (!list || !*list) list = "bf16,fp8,q4";
  const dtype_case all[] = {{"bf16", KVI_DTYPE_BF16, 16}, {"fp8", KVI_DTYPE_FP8_E4M3, 16}, {"q4", KVI_DTYPE_Q4, 64}};
  for (int d = 0; d < 3; d++)
    if (strstr(list, all[d].name)) run_dtype(&su, &all[d], base);
  printf("\nMiB: device and prefetched rows the bf16 bytes the injection writes; host rows the store bytes moved up\n"
         "(or read in place); disk cold the bytes read from the tenant's file per call. GB/s: MiB / call ms.\n"
         "Ceilings: D2D and H2D a cudaMemcpyAsync of those bytes, disk those bytes at the sequential rate above.\n");

  kvi_model_destroy(su.model);
  for (int l = 0; l < L; l++) cudaFree(layers[l]);
  cudaFreeHost(pin);
  cudaFree(dev);
  cudaFree(dev2);
  free(table);
  free(noise);
  return 0;
}
