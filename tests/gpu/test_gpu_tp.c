/*
 * Tensor-parallel stores on real NCCL communicators, one process per GPU:
 * tp = 1 always (the NCCL path on one device), and tp = 2, 4, 8 where that
 * many devices answer. Each rank checks its store against a single-GPU store
 * holding every head of the same facts (kept on the same device):
 * - put from a full-head source (device and host sources, every rank root
 *   in turn): each rank's slice equals those heads of the single store;
 * - sharded search equals the single store's search (host and device
 *   outputs);
 * - injection into the rank's cache slice equals those heads of an injection
 *   from the single store into a full-head cache, byte for byte;
 * - re-sharding tp -> 1 -> tp through gather and scatter;
 * - a scatter that fails on one rank leaves every store as it was;
 * - (tp = 1) the entry points run on the communicator's device whatever
 *   device the caller has current, and give the caller's back.
 * Exits 77 where no device or no NCCL answers.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>

#if defined(KVI_HAVE_CUDA) && defined(KVI_HAVE_NCCL)
#include "tp_harness.h"

#define L 4
#define H 8
#define D 64
#define E 64
#define NF 24
#define NB 64
#define BS 16
#define TENANT 5

static uint64_t g_rng;
static uint64_t rnd(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}
static float rndf(void) { return (float)((double)(rnd() >> 11) * 0x1p-53 * 4.0 - 2.0); }

static int g_fails;
#define T_CHECK(r, cond, ...)                                                   \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "tp %d rank %d, line %d: ", (r)->size, (r)->rank, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                             \
      fprintf(stderr, "\n");                                                    \
      g_fails++;                                                                \
    }                                                                           \
  } while (0)
#define T_OK(r, call)                                                                                   \
  do {                                                                                                  \
    const kvi_status s_ = (call);                                                                       \
    T_CHECK(r, s_ == KVI_OK, "%s -> %s: %s", #call, kvi_status_string(s_), kvi_last_error());          \
  } while (0)
#define T_STATUS(r, call, want)                                                                         \
  do {                                                                                                  \
    const kvi_status s_ = (call);                                                                       \
    T_CHECK(r, s_ == (want), "%s -> %s, expected %s: %s", #call, kvi_status_string(s_),                 \
            kvi_status_string(want), kvi_last_error());                                                 \
  } while (0)
#define CU(r, call) T_CHECK(r, (call) == cudaSuccess, "%s failed", #call)

static kvi_status scatter1(kvi_store *s, uint64_t id, int root, const kvi_kv_view *full, const kvi_put_options *po,
                           cudaStream_t st) {
  kvi_scatter_item it = KVI_SCATTER_ITEM_INIT;
  it.tenant = TENANT;
  it.fact_id = id;
  it.full = full;
  it.opts = po;
  return kvi_store_put_scatter(s, root, &it, 1, (struct CUstream_st *)st);
}

static kvi_model *model_for(int tp, int rank) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L;
  mo.num_kv_heads = H;
  mo.head_size = D;
  mo.tp_rank = rank;
  mo.tp_size = tp;
  kvi_model *m = NULL;
  if (kvi_model_create(&m, &mo) != KVI_OK) return NULL;
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  kvi_model_set_rope(m, -1, &rs);
  return m;
}

static kvi_store *store_for(const kvi_model *m, int device, kvi_comm *comm) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = device;
  so.dtype = KVI_DTYPE_BF16;
  so.page_tokens = 16;
  so.budget_bytes = 64u << 20;
  so.embedding_dim = E;
  so.embedding_dtype = KVI_DTYPE_FP16;
  so.comm = comm;
  so.embedding_placement = comm ? KVI_EMBEDDINGS_SHARDED : KVI_EMBEDDINGS_REPLICATED;
  kvi_store *s = NULL;
  return kvi_store_create(&s, m, &so) == KVI_OK ? s : NULL;
}

typedef struct fact {
  int T;
  float *kv; /* [2][L][T][H][D] fp32 host */
  float emb[E];
} fact;

static kvi_kv_view view_of(kvi_memory mem, kvi_dtype dt, int T, int heads, void *base) {
  kvi_kv_view v;
  const size_t plane = (size_t)L * T * heads * D * kvi_dtype_size(dt);
  kvi_kv_view_contiguous(&v, mem, dt, L, T, heads, D, base, (char *)base + plane);
  return v;
}

/* Reads fact f of s into a fresh host fp32 [2][L][T][heads][D]. */
static float *read_all(tp_rank *r, kvi_store *s, uint64_t id, int T, int heads) {
  float *out = calloc((size_t)2 * L * T * heads * D, sizeof *out);
  const kvi_kv_view w = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, T, heads, out);
  T_OK(r, kvi_store_read(s, TENANT, id, &w, NULL));
  return out;
}

/* s's slice of fact id equals heads [first, first + hl) of the full store's. */
static void compare_slice(tp_rank *r, kvi_store *s, kvi_store *full, uint64_t id, int T, int first, int hl,
                          const char *what) {
  float *a = read_all(r, s, id, T, hl), *b = read_all(r, full, id, T, H);
  int bad = 0;
  for (int kv = 0; kv < 2 && !bad; kv++)
    for (int l = 0; l < L && !bad; l++)
      for (int t = 0; t < T && !bad; t++)
        for (int h = 0; h < hl && !bad; h++) {
          const float *x = a + ((((size_t)kv * L + l) * T + t) * hl + h) * D;
          const float *y = b + ((((size_t)kv * L + l) * T + t) * H + first + h) * D;
          if (memcmp(x, y, D * sizeof *x) != 0) bad = 1;
        }
  T_CHECK(r, !bad, "%s: fact %llu's slice differs from the single-GPU store", what, (unsigned long long)id);
  free(a);
  free(b);
}

/* Injects facts 0..9 of s into a fresh bf16 FlashInfer-layout cache of
 * `heads` heads; returns the cache, copied to the host. */
static uint16_t *inject_into_cache(tp_rank *r, kvi_store *s, int heads, cudaStream_t st) {
  const size_t layer = (size_t)NB * 2 * BS * heads * D;
  void *dev[L];
  for (int l = 0; l < L; l++) {
    CU(r, cudaMalloc(&dev[l], layer * 2));
    CU(r, cudaMemset(dev[l], 0, layer * 2));
  }
  kvi_cache_layout cl;
  T_OK(r, kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_BF16, L, heads, D, BS, NB, dev, NULL, NULL));
  cl.memory = KVI_MEMORY_DEVICE;
  kvi_injector *inj = NULL;
  T_OK(r, kvi_injector_create(&inj, s, &cl, NULL));
  uint64_t ids[10];
  int32_t table[NB];
  for (int i = 0; i < 10; i++) ids[i] = (uint64_t)i;
  for (int i = 0; i < NB; i++) table[i] = NB - 1 - i;
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = TENANT;
  rq.fact_ids = ids;
  rq.num_facts = 10;
  rq.block_table = table;
  rq.block_table_len = NB;
  rq.first_slot = 3;
  rq.start_position = 7;
  T_OK(r, kvi_inject(inj, &rq, 1, NULL, (struct CUstream_st *)st));
  CU(r, cudaStreamSynchronize(st));
  uint16_t *host = malloc(layer * 2 * L);
  for (int l = 0; l < L; l++) {
    CU(r, cudaMemcpy(host + (size_t)l * layer, dev[l], layer * 2, cudaMemcpyDeviceToHost));
    cudaFree(dev[l]);
  }
  kvi_injector_destroy(inj);
  return host;
}

static int tp_test(tp_rank *r, void *arg) {
  (void)arg;
  g_fails = 0;
  const int tp = r->size;
  const int hl = tp <= H ? H / tp : 1, first = tp <= H ? r->rank * hl : r->rank / (tp / H);
  cudaStream_t st;
  CU(r, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  kvi_model *mt = model_for(tp, r->rank), *m1 = model_for(1, 0);
  kvi_store *s = store_for(mt, r->rank, r->comm), *single = store_for(m1, r->rank, NULL);
  T_CHECK(r, s && single, "store creation: %s", kvi_last_error());
  if (!s || !single) return 1;

  /* the same facts on every rank */
  g_rng = 0x243f6a8885a308d3ull;
  fact facts[NF];
  for (int f = 0; f < NF; f++) {
    facts[f].T = 5 + (int)(rnd() % 36);
    const size_t n = (size_t)2 * L * facts[f].T * H * D;
    facts[f].kv = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) facts[f].kv[i] = rndf();
    for (int e = 0; e < E; e++) facts[f].emb[e] = rndf();
  }

  /* 1. put from a full-head source, each rank root in turn, device and host sources */
  for (int f = 0; f < NF; f++) {
    const int root = f % tp, T = facts[f].T;
    void *src = facts[f].kv;
    kvi_memory mem = KVI_MEMORY_HOST;
    const size_t bytes = (size_t)2 * L * T * H * D * sizeof(float);
    if (r->rank == root && f % 2 == 0) {
      CU(r, cudaMalloc(&src, bytes));
      CU(r, cudaMemcpy(src, facts[f].kv, bytes, cudaMemcpyHostToDevice));
      CU(r, cudaDeviceSynchronize()); /* the pageable copy has landed (test_gpu_store.c, to_device) */
      mem = KVI_MEMORY_DEVICE;
    }
    const kvi_kv_view full = view_of(mem, KVI_DTYPE_FP32, T, H, src);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = facts[f].emb;
    T_OK(r, scatter1(s, (uint64_t)f, root, r->rank == root ? &full : NULL, &po, st));
    CU(r, cudaStreamSynchronize(st));
    if (mem == KVI_MEMORY_DEVICE) cudaFree(src);
    const kvi_kv_view hv = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, T, H, facts[f].kv);
    T_OK(r, kvi_store_put(single, TENANT, (uint64_t)f, &hv, &po, NULL));
  }
  for (int f = 0; f < NF; f++) compare_slice(r, s, single, (uint64_t)f, facts[f].T, first, hl, "scatter");
  T_OK(r, kvi_store_check_agreement(s));

  /* 2. sharded search = the single store's search */
  {
    enum { NQ = 4, K = 10 };
    float q[NQ * E];
    uint64_t tenants[NQ] = {TENANT, TENANT, TENANT, 77};
    for (int i = 0; i < NQ * E; i++) q[i] = rndf();
    uint64_t ia[NQ * K], ib[NQ * K], ic[NQ * K];
    float sa[NQ * K], sb[NQ * K], sc[NQ * K];
    int32_t ca[NQ], cb[NQ], cc[NQ];
    T_OK(r, kvi_store_search(s, q, NQ, E, tenants, K, ia, sa, ca, NULL, (struct CUstream_st *)st));
    T_OK(r, kvi_store_search(single, q, NQ, E, tenants, K, ib, sb, cb, NULL, (struct CUstream_st *)st));
    T_CHECK(r, memcmp(ca, cb, sizeof ca) == 0 && ca[0] == K && ca[3] == 0, "search counts differ");
    T_CHECK(r, memcmp(ia, ib, sizeof ia) == 0, "search ids differ from the single store's");
    for (int i = 0; i < NQ * K; i++)
      T_CHECK(r, sa[i] == sb[i] || fabsf(sa[i] - sb[i]) <= 1e-5f * fmaxf(1.0f, fabsf(sb[i])), "score %d: %g vs %g", i,
              (double)sa[i], (double)sb[i]);
    /* device outputs: no host wait in the call */
    uint64_t *di;
    float *ds;
    int32_t *dc;
    CU(r, cudaMalloc((void **)&di, sizeof ic));
    CU(r, cudaMalloc((void **)&ds, sizeof sc));
    CU(r, cudaMalloc((void **)&dc, sizeof cc));
    kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
    so.out_memory = KVI_MEMORY_DEVICE;
    T_OK(r, kvi_store_search(s, q, NQ, E, tenants, K, di, ds, dc, &so, (struct CUstream_st *)st));
    CU(r, cudaMemcpyAsync(ic, di, sizeof ic, cudaMemcpyDeviceToHost, st));
    CU(r, cudaMemcpyAsync(sc, ds, sizeof sc, cudaMemcpyDeviceToHost, st));
    CU(r, cudaMemcpyAsync(cc, dc, sizeof cc, cudaMemcpyDeviceToHost, st));
    CU(r, cudaStreamSynchronize(st));
    T_CHECK(r, memcmp(ic, ia, sizeof ic) == 0 && memcmp(sc, sa, sizeof sc) == 0 && memcmp(cc, ca, sizeof cc) == 0,
            "device-output search differs from host-output search");
    cudaFree(di);
    cudaFree(ds);
    cudaFree(dc);
  }

  /* 3. injection: the rank's cache slice = those heads of a full-head injection */
  {
    uint16_t *a = inject_into_cache(r, s, hl, st), *b = inject_into_cache(r, single, H, st);
    int bad = 0, nonzero = 0;
    for (size_t l = 0; l < L && !bad; l++)
      for (size_t nb = 0; nb < NB * 2 * BS && !bad; nb++) /* (block, plane, token) rows */
        for (int h = 0; h < hl && !bad; h++) {
          const uint16_t *x = a + ((l * NB * 2 * BS + nb) * hl + h) * D;
          const uint16_t *y = b + ((l * NB * 2 * BS + nb) * H + first + h) * D;
          if (memcmp(x, y, D * 2) != 0) bad = 1;
          for (int d = 0; d < D; d++) nonzero += x[d] != 0;
        }
    T_CHECK(r, !bad, "injected cache slice differs from the single-GPU injection");
    T_CHECK(r, nonzero > 0, "nothing was injected");
    free(a);
    free(b);
  }

  /* 4. re-shard tp -> 1 (on rank 0) -> tp, every fact in one gather and one scatter */
  {
    kvi_store *one = r->rank == 0 ? store_for(m1, r->rank, NULL) : NULL, *s2 = store_for(mt, r->rank, r->comm);
    T_CHECK(r, s2 && (r->rank != 0 || one), "re-shard stores: %s", kvi_last_error());
    void *buf[NF];
    kvi_kv_view w[NF];
    kvi_gather_item gi[NF];
    kvi_scatter_item si[NF];
    kvi_put_options po[NF];
    for (int f = 0; f < NF; f++) {
      const size_t bytes = (size_t)2 * L * facts[f].T * H * D * 2;
      CU(r, cudaMalloc(&buf[f], bytes));
      w[f] = view_of(KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, facts[f].T, H, buf[f]);
      kvi_gather_item g = KVI_GATHER_ITEM_INIT;
      g.tenant = TENANT;
      g.fact_id = (uint64_t)f;
      g.full = r->rank == 0 ? &w[f] : NULL;
      gi[f] = g;
      kvi_put_options_init(&po[f], sizeof po[f]);
      po[f].embedding = facts[f].emb;
      kvi_scatter_item it = KVI_SCATTER_ITEM_INIT;
      it.tenant = TENANT;
      it.fact_id = (uint64_t)f;
      it.full = r->rank == 0 ? &w[f] : NULL;
      it.opts = &po[f];
      si[f] = it;
    }
    if (s2) {
      T_OK(r, kvi_store_gather(s, 0, gi, NF, (struct CUstream_st *)st));
      if (r->rank == 0) /* into the tp-1 store, then back out of it for the scatter */
        for (int f = 0; f < NF; f++) {
          T_OK(r, kvi_store_put(one, TENANT, (uint64_t)f, &w[f], &po[f], (struct CUstream_st *)st));
          CU(r, cudaStreamSynchronize(st));
          CU(r, cudaMemset(buf[f], 0, (size_t)2 * L * facts[f].T * H * D * 2));
          T_OK(r, kvi_store_read(one, TENANT, (uint64_t)f, &w[f], (struct CUstream_st *)st));
        }
      T_OK(r, kvi_store_put_scatter(s2, 0, si, NF, (struct CUstream_st *)st));
      CU(r, cudaStreamSynchronize(st));
      for (int f = 0; f < NF; f++) {
        if (r->rank == 0) compare_slice(r, one, single, (uint64_t)f, facts[f].T, 0, H, "gathered to tp 1");
        compare_slice(r, s2, single, (uint64_t)f, facts[f].T, first, hl, "re-sharded");
      }
      T_OK(r, kvi_store_check_agreement(s2));
    }
    for (int f = 0; f < NF; f++) cudaFree(buf[f]);
    kvi_store_destroy(s2);
    kvi_store_destroy(one);
  }

  /* 5. a scatter that fails on the last rank (the fact exists there) changes nothing */
  {
    const int last = tp - 1;
    const fact *f = &facts[0];
    float *slice = malloc((size_t)2 * L * f->T * hl * D * sizeof(float));
    for (int kv = 0; kv < 2; kv++)
      for (int l = 0; l < L; l++)
        for (int t = 0; t < f->T; t++)
          memcpy(slice + ((((size_t)kv * L + l) * f->T + t) * hl) * D,
                 f->kv + ((((size_t)kv * L + l) * f->T + t) * H + first) * D, (size_t)hl * D * sizeof(float));
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = f->emb;
    if (r->rank == last) {
      const kvi_kv_view v = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, f->T, hl, slice);
      T_OK(r, kvi_store_put(s, TENANT, 1000, &v, &po, NULL));
    }
    size_t before = 0, after = 0;
    T_OK(r, kvi_store_count(s, TENANT, &before));
    const kvi_kv_view full = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, f->T, H, f->kv);
    T_STATUS(r, scatter1(s, 1000, 0, r->rank == 0 ? &full : NULL, &po, st),
             r->rank == last ? KVI_ERR_EXISTS : KVI_ERR_PEER);
    T_OK(r, kvi_store_count(s, TENANT, &after));
    T_CHECK(r, before == after, "the failed scatter changed the fact count from %zu to %zu", before, after);
    if (tp > 1) T_STATUS(r, kvi_store_check_agreement(s), KVI_ERR_MISMATCH);
    if (r->rank == last) T_OK(r, kvi_store_remove(s, TENANT, 1000));
    T_OK(r, kvi_store_check_agreement(s));
    free(slice);
  }
  T_OK(r, kvi_comm_async_errors(r->comm, NULL));

  for (int f = 0; f < NF; f++) free(facts[f].kv);
  kvi_store_destroy(s);
  kvi_store_destroy(single);
  kvi_model_destroy(mt);
  kvi_model_destroy(m1);
  cudaStreamDestroy(st);
  if (g_fails == 0) printf("tp %d rank %d: all checks passed\n", tp, r->rank);
  return g_fails ? 1 : 0;
}

/* The entry points make the store's (the communicator's) device current and
 * give the caller's back: with two devices the caller sits on device 1
 * while the communicator and its store are on device 0. Create, scatter,
 * gather, agreement, save and load (with and without a communicator) work
 * from there and leave device 1 current; a store on another device than
 * the communicator's fails the create with the mismatch. tp = 1. */
static int device_test(tp_rank *r, void *arg) {
  const int ndev = *(const int *)arg;
  g_fails = 0;
  int comm_dev = -1, cur = -1, now = -1;
  CU(r, cudaGetDevice(&comm_dev));
  if (ndev >= 2) CU(r, cudaSetDevice(1 - comm_dev));
  CU(r, cudaGetDevice(&cur));
#define KEPT(what)                                                                                         \
  do {                                                                                                     \
    CU(r, cudaGetDevice(&now));                                                                            \
    T_CHECK(r, now == cur, "after %s the current device is %d, was %d", what, now, cur);                  \
  } while (0)
  g_rng = 0x5eed;
  kvi_model *m = model_for(1, 0);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = comm_dev;
  so.dtype = KVI_DTYPE_BF16;
  so.page_tokens = 16;
  so.budget_bytes = 16u << 20;
  so.comm = r->comm;
  kvi_store *s = NULL;
  T_OK(r, kvi_store_create(&s, m, &so));
  KEPT("kvi_store_create");
  if (!s) return 1;
  kvi_store_stats stats = KVI_STORE_STATS_INIT;
  T_OK(r, kvi_store_stats_get(s, &stats));
  T_CHECK(r, stats.device == comm_dev, "the store is on device %d, its options say %d", (int)stats.device, comm_dev);

  const int T = 21;
  const size_t n = (size_t)2 * L * T * H * D;
  float *src = malloc(n * sizeof *src), *got = calloc(n, sizeof *got), *ref = calloc(n, sizeof *ref);
  for (size_t i = 0; i < n; i++) src[i] = rndf();
  const kvi_kv_view full = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, T, H, src);
  const kvi_kv_view gv = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, T, H, got);
  const kvi_kv_view rv = view_of(KVI_MEMORY_HOST, KVI_DTYPE_FP32, T, H, ref);
  T_OK(r, scatter1(s, 7, 0, &full, NULL, NULL));
  KEPT("kvi_store_put_scatter");
  kvi_gather_item gi = KVI_GATHER_ITEM_INIT;
  gi.tenant = TENANT;
  gi.fact_id = 7;
  gi.full = &gv;
  T_OK(r, kvi_store_gather(s, 0, &gi, 1, NULL));
  KEPT("kvi_store_gather");
  T_OK(r, kvi_store_read(s, TENANT, 7, &rv, NULL));
  T_CHECK(r, memcmp(got, ref, n * sizeof *got) == 0, "the gathered fact differs from the stored one");
  size_t close_n = 0; /* and both are the source, rounded to bf16 */
  for (size_t i = 0; i < n; i++) close_n += fabsf(ref[i] - src[i]) <= fabsf(src[i]) * 0x1p-8f;
  T_CHECK(r, close_n == n, "%zu of %zu stored values are not the source rounded to bf16", n - close_n, n);
  T_OK(r, kvi_store_check_agreement(s));
  KEPT("kvi_store_check_agreement");

  char path[64];
  snprintf(path, sizeof path, "/tmp/kvi-gpu-tp-device-%d.kvs", (int)getpid());
  T_OK(r, kvi_store_save(s, path, NULL));
  KEPT("kvi_store_save");
  for (int with_comm = 1; with_comm >= 0; with_comm--) { /* the loaded store is on its options' device */
    kvi_store_options lo = so;
    lo.comm = with_comm ? r->comm : NULL;
    kvi_store *l = NULL;
    T_OK(r, kvi_store_load(&l, m, &lo, path, NULL));
    KEPT("kvi_store_load");
    if (!l) continue;
    kvi_store_stats ls = KVI_STORE_STATS_INIT;
    T_OK(r, kvi_store_stats_get(l, &ls));
    T_CHECK(r, ls.device == comm_dev, "the loaded store is on device %d, its options say %d", (int)ls.device, comm_dev);
    memset(got, 0, n * sizeof *got);
    T_OK(r, kvi_store_read(l, TENANT, 7, &gv, NULL));
    T_CHECK(r, memcmp(got, ref, n * sizeof *got) == 0, "the loaded fact differs from the saved one");
    kvi_store_destroy(l);
    KEPT("kvi_store_destroy");
  }
  remove(path);

  /* a store on another device than the communicator's: the mismatch, on every rank */
  kvi_store_options bad = so;
  if (ndev >= 2) bad.device = 1 - comm_dev;
  else bad.backend = KVI_BACKEND_CPU;
  char want[160];
  snprintf(want, sizeof want, "kvi_store_create: the NCCL communicator is on device %d; the store is %s %d", comm_dev,
           ndev >= 2 ? "on device" : "a CPU store, device", ndev >= 2 ? 1 - comm_dev : -1);
  kvi_store *b = (kvi_store *)0x1;
  T_STATUS(r, kvi_store_create(&b, m, &bad), KVI_ERR_MISMATCH);
  T_CHECK(r, strcmp(kvi_last_error(), want) == 0, "message \"%s\", expected \"%s\"", kvi_last_error(), want);
  T_CHECK(r, b == (kvi_store *)0x1, "a failed create wrote *out");
  KEPT("a failed kvi_store_create");
  T_OK(r, kvi_store_check_agreement(s)); /* the communicator still works */
  T_OK(r, kvi_comm_async_errors(r->comm, NULL));
#undef KEPT
  free(src);
  free(got);
  free(ref);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  if (g_fails == 0) printf("tp 1 rank 0: device checks passed (%s)\n", ndev >= 2 ? "caller on another device" : "one device");
  return g_fails ? 1 : 0;
}

int main(void) {
  const int n = tp_device_count();
  if (n == 0) {
    printf("gpu-tp: no CUDA device; skipped\n");
    return 77;
  }
  int bad = tp_run(1, tp_test, NULL);
  int ndev = n;
  bad |= tp_run(1, device_test, &ndev);
  for (int tp = 2; tp <= 8 && tp <= n; tp *= 2) bad |= tp_run(tp, tp_test, NULL);
  if (n < 2) printf("gpu-tp: one device; tp = 1 only (tp >= 2 needs more GPUs)\n");
  return bad;
}
#else
int main(void) {
  printf("gpu-tp: built without CUDA or NCCL; skipped\n");
  return 77;
}
#endif
