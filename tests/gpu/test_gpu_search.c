/*
 * gpu suite: kvi_store_search on a CUDA store compared with the CPU store
 * (the reference) holding the same facts. With small-integer embeddings
 * every score is exact on both, so results must agree bit for bit, ties
 * included, through the scan kernel, cuBLASLt and tiled (multi-round)
 * searches. With random floats, scores agree to fp32 accumulation rounding
 * and fact ids wherever the reference's scores are further apart than that.
 * Also: isolation under random puts and removes, device queries with NaN,
 * stream ordering of searches against later removes, threads.
 * Every test skips, and the binary exits 77, where no CUDA device answers
 * (or the library has no cuBLASLt), so the list of tests is the same on
 * every machine.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define GPU_TEST_SEED 0x2545f4914f6cdd1dull
#include "gpu_test.h"

static int g_devices;
static bool g_search; /* a device and cuBLASLt */
static bool g_quick;  /* KVI_TEST_QUICK=1: smaller sizes, for the sanitizers */

static int sized(int full, int quick) { return g_quick ? quick : full; }

#define REQUIRE_GPU()                                                                                              \
  do {                                                                                                             \
    if (!g_search) skip();                                                                                         \
  } while (0)

/* ---------------------------------------------------------------- stores */

enum { KV_D = 8 };

typedef struct pair {
  kvi_model *model;
  kvi_store *gpu, *cpu;
  int32_t dim;
  float kv[2 * KV_D];
} pair;

static void pair_make(pair *p, kvi_dtype edt, kvi_metric metric, int32_t dim, uint32_t facts) {
  memset(p, 0, sizeof *p);
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = 1;
  mo.num_kv_heads = 1;
  mo.head_size = KV_D;
  CHECK_OK(kvi_model_create(&p->model, &mo));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.page_tokens = 1;
  so.budget_bytes = (uint64_t)facts * 2 * KV_D * 2 + 1024;
  so.embedding_dim = dim;
  so.embedding_dtype = edt;
  so.metric = metric;
  so.backend = KVI_BACKEND_CPU;
  CHECK_OK(kvi_store_create(&p->cpu, p->model, &so));
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  CHECK_OK(kvi_store_create(&p->gpu, p->model, &so));
  p->dim = dim;
  for (int i = 0; i < 2 * KV_D; i++) p->kv[i] = (float)i;
}

static void pair_free(pair *p) {
  kvi_store_destroy(p->gpu);
  kvi_store_destroy(p->cpu);
  kvi_model_destroy(p->model);
}

static void put_both(pair *p, uint64_t tenant, uint64_t id, const float *emb, uint32_t flags) {
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, KV_D, p->kv, p->kv + KV_D);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = emb;
  po.flags = flags;
  CHECK_OK(kvi_store_put(p->cpu, tenant, id, &v, &po, NULL));
  CHECK_OK(kvi_store_put(p->gpu, tenant, id, &v, &po, NULL));
}

static void rand_unit(float *x, size_t n) { /* [-1, 1) */
  for (size_t i = 0; i < n; i++) x[i] = rndf() * 0.5f;
}

/* ---------------------------------------------------------------- searching */

typedef struct result {
  uint64_t *ids;
  float *scores;
  int32_t *counts;
  int32_t nq, k;
} result;

static void result_free(result *r) {
  free(r->ids);
  free(r->scores);
  free(r->counts);
}

/* Searches with queries and outputs in the given memory (host results in r
 * either way). queries: host array of nq x dim elements of qdt. */
static void search(kvi_store *s, const void *queries, kvi_dtype qdt, kvi_memory qm, int32_t nq, int32_t dim,
                   const uint64_t *tenants, int32_t k, kvi_memory om, uint64_t ws, result *r) {
  r->nq = nq, r->k = k;
  const size_t no = (size_t)nq * k;
  r->ids = malloc(no * sizeof *r->ids);
  r->scores = malloc(no * sizeof *r->scores);
  r->counts = malloc((size_t)nq * sizeof *r->counts);
  memset(r->ids, 0x5a, no * sizeof *r->ids);
  memset(r->scores, 0x5a, no * sizeof *r->scores);
  memset(r->counts, 0x5a, (size_t)nq * sizeof *r->counts);
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  o.query_dtype = qdt;
  o.query_memory = qm;
  o.out_memory = om;
  if (ws) o.workspace_bytes = ws;
  const bool host_only = qm == KVI_MEMORY_HOST && om == KVI_MEMORY_HOST;
  if (host_only || s == NULL) {
    CHECK_OK(kvi_store_search(s, queries, nq, dim, tenants, k, r->ids, r->scores, r->counts, &o, NULL));
    return;
  }
#ifdef KVI_HAVE_CUDA
  const size_t qbytes = (size_t)nq * dim * kvi_dtype_size(qdt);
  void *dq = NULL, *di = NULL, *ds = NULL, *dc = NULL;
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  if (qm == KVI_MEMORY_DEVICE) {
    CUDA_OK(cudaMalloc(&dq, qbytes));
    CUDA_OK(cudaMemcpy(dq, queries, qbytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize()); /* the pageable copy has landed (test_gpu_store.c, to_device) */
  }
  if (om == KVI_MEMORY_DEVICE) {
    CUDA_OK(cudaMalloc(&di, no * sizeof(uint64_t)));
    CUDA_OK(cudaMalloc(&ds, no * sizeof(float)));
    CUDA_OK(cudaMalloc(&dc, (size_t)nq * sizeof(int32_t)));
    CUDA_OK(cudaMemset(di, 0x5a, no * sizeof(uint64_t)));
    CUDA_OK(cudaMemset(ds, 0x5a, no * sizeof(float)));
    CUDA_OK(cudaMemset(dc, 0x5a, (size_t)nq * sizeof(int32_t)));
  }
  CHECK_OK(kvi_store_search(s, dq ? dq : queries, nq, dim, tenants, k, di ? di : (void *)r->ids,
                            ds ? ds : (void *)r->scores, dc ? dc : (void *)r->counts, &o, (struct CUstream_st *)st));
  CUDA_OK(cudaStreamSynchronize(st));
  if (om == KVI_MEMORY_DEVICE) {
    CUDA_OK(cudaMemcpy(r->ids, di, no * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r->scores, ds, no * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(r->counts, dc, (size_t)nq * sizeof(int32_t), cudaMemcpyDeviceToHost));
  }
  CUDA_OK(cudaFree(dq));
  CUDA_OK(cudaFree(di));
  CUDA_OK(cudaFree(ds));
  CUDA_OK(cudaFree(dc));
  CUDA_OK(cudaStreamDestroy(st));
#endif
}

static uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

/* Bit for bit the same results. */
static void expect_equal(const result *g, const result *c, const char *what) {
  for (int32_t i = 0; i < g->nq; i++) {
    if (g->counts[i] != c->counts[i])
      fail_msg("%s: query %d: count %d on the GPU, %d on the CPU", what, (int)i, (int)g->counts[i], (int)c->counts[i]);
    for (int32_t j = 0; j < g->k; j++) {
      const size_t x = (size_t)i * g->k + j;
      if (g->ids[x] != c->ids[x] || f2u(g->scores[x]) != f2u(c->scores[x]))
        fail_msg("%s: query %d rank %d: GPU fact %llu score %.9g, CPU fact %llu score %.9g", what, (int)i, (int)j,
                 (unsigned long long)g->ids[x], (double)g->scores[x], (unsigned long long)c->ids[x],
                 (double)c->scores[x]);
    }
  }
}

/* Within rounding: ce holds the CPU's results with ke >= k ranks (k + 1
 * where possible, to see past the k-th); tol[i] bounds query i's score
 * error. Scores agree rank by rank within tol; ids agree at every rank whose
 * reference score is more than 2 tol from its neighbours'. */
static void expect_close(const result *g, const result *ce, const double *tol, const char *what) {
  const int32_t k = g->k, ke = ce->k;
  for (int32_t i = 0; i < g->nq; i++) {
    const int32_t n = g->counts[i];
    if (n != (ce->counts[i] < k ? ce->counts[i] : k))
      fail_msg("%s: query %d: count %d on the GPU, %d on the CPU", what, (int)i, (int)n, (int)ce->counts[i]);
    const float *cs = ce->scores + (size_t)i * ke;
    const uint64_t *ci = ce->ids + (size_t)i * ke;
    for (int32_t j = 0; j < k; j++) {
      const size_t x = (size_t)i * k + j;
      if (j >= n) {
        if (g->ids[x] != KVI_SEARCH_NO_ID || !(isinf(g->scores[x]) && g->scores[x] < 0))
          fail_msg("%s: query %d rank %d past count %d is not the sentinel", what, (int)i, (int)j, (int)n);
        continue;
      }
      if (fabs((double)g->scores[x] - (double)cs[j]) > tol[i])
        fail_msg("%s: query %d rank %d: GPU score %.9g, CPU %.9g (tolerance %.3g)", what, (int)i, (int)j,
                 (double)g->scores[x], (double)cs[j], tol[i]);
      const bool near_prev = j > 0 && (double)cs[j - 1] - (double)cs[j] <= 2 * tol[i];
      const bool next_known = j + 1 < ce->counts[i];
      const bool near_next = next_known ? (double)cs[j] - (double)cs[j + 1] <= 2 * tol[i] : j + 1 >= ke;
      if (!near_prev && !near_next && g->ids[x] != ci[j])
        fail_msg("%s: query %d rank %d: GPU fact %llu, CPU fact %llu (scores %.9g, %.9g)", what, (int)i, (int)j,
                 (unsigned long long)g->ids[x], (unsigned long long)ci[j], (double)g->scores[x], (double)cs[j]);
      for (int32_t m = 0; m < j; m++)
        if (g->ids[(size_t)i * k + m] == g->ids[x]) fail_msg("%s: query %d: fact %llu twice", what, (int)i,
                                                             (unsigned long long)g->ids[x]);
    }
  }
}

/* ---------------------------------------------------------------- tests */

static int setup(void **state) {
  (void)state;
  return 0;
}

/* Integer embeddings: exact scores, so the GPU must equal the CPU bit for
 * bit, ties included, through every path (scan with 1..8 queries, GEMM above,
 * empty and one-fact tenants, k above a tenant's facts, k = 1024), with
 * queries and results in either memory. */
static void test_exact(void **state) {
  (void)state;
  REQUIRE_GPU();
  const kvi_dtype dts[3] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16};
  const int32_t dims[2] = {64, 100}; /* 100: padded rows */
  for (int d = 0; d < 3; d++)
    for (int dd = 0; dd < 2; dd++) {
      const int32_t dim = dims[dd];
      pair p;
      pair_make(&p, dts[d], KVI_METRIC_INNER_PRODUCT, dim, 4000);
      float *e = malloc((size_t)dim * sizeof *e);
      for (uint64_t i = 0; i < (uint64_t)sized(3000, 700); i++) { /* tenant 1: 3000 facts, ids scattered */
        rand_ints(e, (size_t)dim, -3, 3);
        put_both(&p, 1, i * 7919 % 100003, e, 0);
      }
      for (uint64_t i = 0; i < 37; i++) {
        rand_ints(e, (size_t)dim, -3, 3);
        put_both(&p, 2, 1000000 + i, e, 0);
      }
      rand_ints(e, (size_t)dim, -3, 3);
      put_both(&p, 4, 42, e, 0);
      free(e);
      enum { NQ = 300 };
      float *q = malloc((size_t)NQ * dim * sizeof *q);
      rand_ints(q, (size_t)NQ * dim, -2, 2);
      memset(q + dim, 0, (size_t)dim * sizeof *q); /* query 1: every score 0, the order is by id */
      uint64_t t[NQ];
      for (int i = 0; i < NQ; i++) t[i] = i < 250 ? 1 : i < 290 ? 2 : i < 295 ? 3 : 4;
      t[2] = 2, t[3] = 3, t[4] = 4; /* a mixed batch in the first five */
      static const struct {
        int32_t nq, k;
      } cases[] = {{1, 50}, {2, 1}, {5, 20}, {5, 1024}, {8, 64}, {9, 50}, {40, 7}, {NQ, 100}, {NQ, 1024}};
      for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int mem = 0; mem < 4; mem++) {
          const kvi_memory qm = mem & 1 ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST;
          const kvi_memory om = mem & 2 ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST;
          if (mem != 0 && c % 3 != 0) continue; /* every memory combination on a third of the cases */
          if (g_quick && (dd == 1 || cases[c].nq == NQ) && mem != 0) continue;
          char what[128];
          snprintf(what, sizeof what, "%s dim %d, %d queries, k %d, memory %d", dts[d] == KVI_DTYPE_FP32 ? "fp32" :
                   dts[d] == KVI_DTYPE_FP16 ? "fp16" : "bf16", (int)dim, (int)cases[c].nq, (int)cases[c].k, mem);
          result g, r;
          search(p.gpu, q, KVI_DTYPE_FP32, qm, cases[c].nq, dim, t, cases[c].k, om, 0, &g);
          search(p.cpu, q, KVI_DTYPE_FP32, KVI_MEMORY_HOST, cases[c].nq, dim, t, cases[c].k, KVI_MEMORY_HOST, 0, &r);
          expect_equal(&g, &r, what);
          result_free(&g);
          result_free(&r);
        }
      free(q);
      pair_free(&p);
    }
}

/* A small workspace: many rounds, stage-2 merges, GEMM tiles of 256 rows
 * (and the scan path in two rounds); still exact. */
static void test_tiled(void **state) {
  (void)state;
  REQUIRE_GPU();
  enum { DIM = 128, NQ = 300 };
  const int N = sized(20000, 3000);
  pair p;
  pair_make(&p, KVI_DTYPE_FP16, KVI_METRIC_INNER_PRODUCT, DIM, N + 10);
  float *e = malloc((size_t)DIM * sizeof *e);
  for (uint64_t i = 0; i < (uint64_t)N; i++) {
    rand_ints(e, DIM, -3, 3);
    put_both(&p, 9, i, e, 0);
  }
  free(e);
  float *q = malloc((size_t)NQ * DIM * sizeof *q);
  rand_ints(q, (size_t)NQ * DIM, -2, 2);
  uint64_t t[NQ];
  for (int i = 0; i < NQ; i++) t[i] = 9;
  static const struct {
    int32_t nq, k;
  } cases[] = {{NQ, 50}, {8, 1024}, {1, 1024}, {3, 5}};
  for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
    char what[96];
    snprintf(what, sizeof what, "1 MiB workspace, %d queries, k %d", (int)cases[c].nq, (int)cases[c].k);
    result g, r;
    search(p.gpu, q, KVI_DTYPE_FP32, KVI_MEMORY_HOST, cases[c].nq, DIM, t, cases[c].k, KVI_MEMORY_DEVICE, 1u << 20, &g);
    search(p.cpu, q, KVI_DTYPE_FP32, KVI_MEMORY_HOST, cases[c].nq, DIM, t, cases[c].k, KVI_MEMORY_HOST, 0, &r);
    expect_equal(&g, &r, what);
    result_free(&g);
    result_free(&r);
  }
  free(q);
  pair_free(&p);
}

/* Random floats, every storage dtype and both metrics, query dtypes too:
 * scores within fp32 accumulation rounding, ids where separated. */
static void test_random(void **state) {
  (void)state;
  REQUIRE_GPU();
  const kvi_dtype dts[3] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16};
  for (int d = 0; d < 3; d++)
    for (int metric = 0; metric < 2; metric++)
      for (int dd = 0; dd < 2; dd++) {
        const int32_t dim = dd ? 1024 : 96;
        if (dim == 1024 && (metric == 1 || g_quick)) continue;
        const uint32_t n1 = dim == 1024 ? 2500 : (uint32_t)sized(5000, 1200), n2 = 300;
        pair p;
        pair_make(&p, dts[d], (kvi_metric)metric, dim, n1 + n2);
        float *e = malloc((size_t)(n1 + n2) * dim * sizeof *e);
        rand_unit(e, (size_t)(n1 + n2) * dim);
        for (uint32_t i = 0; i < n1 + n2; i++) put_both(&p, i < n1 ? 11 : 12, (uint64_t)i * 3, e + (size_t)i * dim, 0);
        enum { NQ = 100 };
        float *q = malloc((size_t)NQ * dim * sizeof *q);
        uint16_t *q16 = malloc((size_t)NQ * dim * sizeof *q16);
        rand_unit(q, (size_t)NQ * dim);
        const kvi_dtype qdt = dts[(d + 1) % 3];
        for (size_t i = 0; i < (size_t)NQ * dim; i++) { /* the query values as qdt holds them */
          if (qdt == KVI_DTYPE_FP16) {
            __extension__ _Float16 h = (_Float16)q[i];
            memcpy(&q16[i], &h, 2);
            q[i] = (float)h;
          } else if (qdt == KVI_DTYPE_BF16) {
            uint32_t u = f2u(q[i]);
            q16[i] = (uint16_t)(u >> 16); /* truncation: some bf16 value, exactly known */
            u = (uint32_t)q16[i] << 16;
            memcpy(&q[i], &u, 4);
          }
        }
        uint64_t t[NQ];
        for (int i = 0; i < NQ; i++) t[i] = i % 4 == 3 ? 12 : 11;
        /* error bound per query, from the largest sum of |q||e| of its tenant */
        double tol[NQ];
        for (int i = 0; i < NQ; i++) {
          double qn = 0, mx = 0;
          for (int32_t x = 0; x < dim; x++) qn += (double)q[(size_t)i * dim + x] * q[(size_t)i * dim + x];
          for (uint32_t f = 0; f < n1 + n2; f++) {
            if ((f < n1 ? 11u : 12u) != t[i]) continue;
            double s = 0, en = 0;
            for (int32_t x = 0; x < dim; x++) {
              s += fabs((double)q[(size_t)i * dim + x] * e[(size_t)f * dim + x]);
              en += (double)e[(size_t)f * dim + x] * e[(size_t)f * dim + x];
            }
            if (metric == 1) s /= sqrt(qn * en); /* both scaled to unit length */
            if (s > mx) mx = s;
          }
          /* fp32 sums in any order, tensor cores truncating: 2 ulps per addition */
          tol[i] = 2.0 * (dim + 2) * 0x1p-24 * mx + 1e-30;
        }
        static const struct {
          int32_t nq, k;
        } cases[] = {{1, 10}, {4, 50}, {8, 1024}, {16, 50}, {NQ, 50}, {NQ, 1024}};
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
          const int32_t k = cases[c].k, ke = k < KVI_SEARCH_MAX_K ? k + 1 : k;
          char what[128];
          snprintf(what, sizeof what, "storage %d metric %d dim %d, %d queries, k %d", (int)dts[d], metric, (int)dim,
                   (int)cases[c].nq, (int)k);
          const void *qs = qdt == KVI_DTYPE_FP32 ? (const void *)q : (const void *)q16;
          result g, r;
          search(p.gpu, qs, qdt, c % 2 ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST, cases[c].nq, dim, t, k,
                 c % 3 ? KVI_MEMORY_HOST : KVI_MEMORY_DEVICE, 0, &g);
          search(p.cpu, qs, qdt, KVI_MEMORY_HOST, cases[c].nq, dim, t, ke, KVI_MEMORY_HOST, 0, &r);
          expect_close(&g, &r, tol, what);
          result_free(&g);
          result_free(&r);
        }
        /* the kept embeddings are the same on both backends */
        float *a = malloc((size_t)dim * sizeof *a), *b = malloc((size_t)dim * sizeof *b);
        for (uint32_t i = 0; i < n1 + n2; i += 97) {
          CHECK_OK(kvi_store_get_embedding(p.gpu, i < n1 ? 11 : 12, (uint64_t)i * 3, a));
          CHECK_OK(kvi_store_get_embedding(p.cpu, i < n1 ? 11 : 12, (uint64_t)i * 3, b));
          assert_memory_equal(a, b, (size_t)dim * sizeof *a);
        }
        free(a);
        free(b);
        free(q);
        free(q16);
        free(e);
        pair_free(&p);
      }
}

/* Random puts, replaces and removes on both stores (device matrices grow,
 * rows move), tenants sharing fact ids; searches of every tenant and an
 * unknown one agree exactly throughout. */
static void test_isolation_random(void **state) {
  (void)state;
  REQUIRE_GPU();
  enum { DIM = 32, TENANTS = 4, IDS = 300, NQ = 12 };
  const int OPS = sized(3000, 600);
  pair p;
  pair_make(&p, KVI_DTYPE_BF16, KVI_METRIC_INNER_PRODUCT, DIM, TENANTS * (IDS + 1) * 2);
  static bool live[TENANTS][IDS + 1];
  memset(live, 0, sizeof live);
  float e[DIM], q[NQ * DIM];
  uint64_t t[NQ];
  for (int op = 0; op < OPS; op++) {
    const int tn = (int)(rnd() % TENANTS), id = (int)(rnd() % (IDS + 1));
    const uint64_t tenant = 500 + (uint64_t)tn;
    if (rnd() % 3 != 0 || !live[tn][id]) {
      rand_ints(e, DIM, -4, 4);
      put_both(&p, tenant, (uint64_t)id, e, KVI_PUT_REPLACE);
      live[tn][id] = true;
    } else {
      CHECK_OK(kvi_store_remove(p.gpu, tenant, (uint64_t)id));
      CHECK_OK(kvi_store_remove(p.cpu, tenant, (uint64_t)id));
      live[tn][id] = false;
    }
    if (op % 100 == 99) {
      rand_ints(q, NQ * DIM, -3, 3);
      for (int i = 0; i < NQ; i++) t[i] = 500 + (uint64_t)(i % (TENANTS + 1)); /* 504: no facts */
      const int32_t k = 1 + (int32_t)(rnd() % 400);
      result g, r;
      search(p.gpu, q, KVI_DTYPE_FP32, KVI_MEMORY_HOST, NQ, DIM, t, k, op % 200 == 99 ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST,
             0, &g);
      search(p.cpu, q, KVI_DTYPE_FP32, KVI_MEMORY_HOST, NQ, DIM, t, k, KVI_MEMORY_HOST, 0, &r);
      char what[64];
      snprintf(what, sizeof what, "after %d operations, k %d", op + 1, (int)k);
      expect_equal(&g, &r, what);
      result_free(&g);
      result_free(&r);
    }
  }
  kvi_store_stats a = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(p.gpu, &a));
  assert_true(a.bytes_embeddings > 0);
  for (int tn = 0; tn < TENANTS; tn++) /* empty every tenant: device matrices freed */
    for (int id = 0; id <= IDS; id++)
      if (live[tn][id]) {
        CHECK_OK(kvi_store_remove(p.gpu, 500 + (uint64_t)tn, (uint64_t)id));
        CHECK_OK(kvi_store_remove(p.cpu, 500 + (uint64_t)tn, (uint64_t)id));
      }
  CHECK_OK(kvi_store_stats_get(p.gpu, &a));
  assert_int_equal(a.bytes_embeddings, 0);
  assert_int_equal(a.tenants, 0);
  pair_free(&p);
}

/* Device queries are checked on the device: a query with NaN, or a value
 * fp16 storage cannot hold, gets count 0 and is counted; the others are
 * answered as the CPU answers them. */
static void test_device_query_checks(void **state) {
  (void)state;
  REQUIRE_GPU();
  enum { DIM = 16, NQ = 4 };
  pair p;
  pair_make(&p, KVI_DTYPE_FP16, KVI_METRIC_INNER_PRODUCT, DIM, 100);
  float e[DIM], q[NQ * DIM];
  for (uint64_t i = 0; i < 50; i++) {
    rand_ints(e, DIM, -3, 3);
    put_both(&p, 3, i, e, 0);
  }
  rand_ints(q, NQ * DIM, -2, 2);
  q[1 * DIM + 5] = NAN;
  q[3 * DIM + 0] = 70000.0f;
  const uint64_t t[NQ] = {3, 3, 3, 3};
  int64_t bad = -1;
  CHECK_OK(kvi_store_async_errors(p.gpu, &bad)); /* nothing yet */
  assert_int_equal(bad, 0);
  result g, r;
  search(p.gpu, q, KVI_DTYPE_FP32, KVI_MEMORY_DEVICE, NQ, DIM, t, 10, KVI_MEMORY_DEVICE, 0, &g);
  CHECK_OK(kvi_store_async_errors(p.gpu, &bad));
  assert_int_equal(bad, 2);
  CHECK_OK(kvi_store_async_errors(p.gpu, &bad));
  assert_int_equal(bad, 0);
  assert_int_equal(g.counts[1], 0);
  assert_int_equal(g.counts[3], 0);
  for (int j = 0; j < 10; j++) assert_true(g.ids[10 + j] == KVI_SEARCH_NO_ID && g.ids[30 + j] == KVI_SEARCH_NO_ID);
  /* the same host queries are refused before anything runs */
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  assert_int_equal(kvi_store_search(p.gpu, q, NQ, DIM, t, 10, g.ids, g.scores, g.counts, &o, NULL),
                   KVI_ERR_INVALID_ARGUMENT);
  /* the good ones match the CPU */
  float q2[2 * DIM];
  memcpy(q2, q, DIM * sizeof(float));
  memcpy(q2 + DIM, q + 2 * DIM, DIM * sizeof(float));
  result g2;
  search(p.gpu, q2, KVI_DTYPE_FP32, KVI_MEMORY_HOST, 2, DIM, t, 10, KVI_MEMORY_HOST, 0, &g2);
  search(p.cpu, q2, KVI_DTYPE_FP32, KVI_MEMORY_HOST, 2, DIM, t, 10, KVI_MEMORY_HOST, 0, &r);
  expect_equal(&g2, &r, "valid device queries");
  assert_memory_equal(g.ids, g2.ids, 10 * sizeof(uint64_t));
  assert_memory_equal(g.ids + 20, g2.ids + 10, 10 * sizeof(uint64_t));
  result_free(&g);
  result_free(&g2);
  result_free(&r);
  pair_free(&p);
}

/* Stream order: a search enqueued before a remove (and before puts that
 * grow the matrix and free the old one) sees the facts as they were when it
 * was called; one enqueued after sees the change. Nothing is synchronized in
 * between. */
static void test_stream_order(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  enum { DIM = 256, N = 16, K = 4 };
  pair p;
  pair_make(&p, KVI_DTYPE_FP16, KVI_METRIC_INNER_PRODUCT, DIM, 4096);
  float e[DIM], q[DIM];
  for (int x = 0; x < DIM; x++) q[x] = 1.0f;
  for (uint64_t i = 0; i < N; i++) { /* fact i scores i * DIM / 64 */
    for (int x = 0; x < DIM; x++) e[x] = (float)i / 64.0f;
    put_both(&p, 1, i, e, 0);
  }
  const uint64_t t = 1;
  uint64_t *di;
  float *ds;
  int32_t *dc;
  CUDA_OK(cudaMalloc((void **)&di, 3 * K * sizeof(uint64_t)));
  CUDA_OK(cudaMalloc((void **)&ds, 3 * K * sizeof(float)));
  CUDA_OK(cudaMalloc((void **)&dc, 3 * sizeof(int32_t)));
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  o.out_memory = KVI_MEMORY_DEVICE;
  /* keep s1 busy so that its search runs after the host has moved on */
  for (int r = 0; r < 20; r++)
    CHECK_OK(kvi_store_search(p.gpu, q, 1, DIM, &t, K, di + 2 * K, ds + 2 * K, dc + 2, &o, (struct CUstream_st *)s1));
  CHECK_OK(kvi_store_search(p.gpu, q, 1, DIM, &t, K, di, ds, dc, &o, (struct CUstream_st *)s1));
  CHECK_OK(kvi_store_remove(p.gpu, 1, N - 1)); /* the best fact; the last row: no move */
  CHECK_OK(kvi_store_remove(p.gpu, 1, N - 3)); /* a row moves into its place */
  for (uint64_t i = N; i < 2000; i++) {        /* the matrix grows: the old one is freed, stream-ordered */
    for (int x = 0; x < DIM; x++) e[x] = -1.0f;
    kvi_kv_view v;
    kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, KV_D, p.kv, p.kv + KV_D);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = e;
    CHECK_OK(kvi_store_put(p.gpu, 1, i, &v, &po, NULL));
  }
  CHECK_OK(kvi_store_search(p.gpu, q, 1, DIM, &t, K, di + K, ds + K, dc + 1, &o, (struct CUstream_st *)s2));
  CUDA_OK(cudaDeviceSynchronize());
  uint64_t ids[2 * K];
  int32_t cnt[2];
  CUDA_OK(cudaMemcpy(ids, di, sizeof ids, cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(cnt, dc, sizeof cnt, cudaMemcpyDeviceToHost));
  assert_int_equal(cnt[0], K);
  assert_int_equal(cnt[1], K);
  const uint64_t before[K] = {N - 1, N - 2, N - 3, N - 4}, after[K] = {N - 2, N - 4, N - 5, N - 6};
  for (int j = 0; j < K; j++) {
    assert_int_equal(ids[j], before[j]);
    assert_int_equal(ids[K + j], after[j]);
  }
  CUDA_OK(cudaStreamDestroy(s1));
  CUDA_OK(cudaStreamDestroy(s2));
  CUDA_OK(cudaFree(di));
  CUDA_OK(cudaFree(ds));
  CUDA_OK(cudaFree(dc));
  pair_free(&p);
#endif
}

/* Declared memory kinds are checked where the driver can tell. */
static void test_memory_kinds(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  enum { DIM = 8 };
  pair p;
  pair_make(&p, KVI_DTYPE_FP32, KVI_METRIC_INNER_PRODUCT, DIM, 4);
  float e[DIM] = {1, 2, 3, 4, 5, 6, 7, 8};
  put_both(&p, 1, 1, e, 0);
  void *dq;
  CUDA_OK(cudaMalloc(&dq, sizeof e));
  CUDA_OK(cudaMemcpy(dq, e, sizeof e, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize()); /* the pageable copy has landed (test_gpu_store.c, to_device) */
  const uint64_t t = 1;
  uint64_t ids[2] = {7, 7};
  float sc[2] = {7, 7};
  int32_t cnt = 7;
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  assert_int_equal(kvi_store_search(p.gpu, dq, 1, DIM, &t, 2, ids, sc, &cnt, &o, NULL), KVI_ERR_MEMORY_KIND);
  o.query_memory = KVI_MEMORY_DEVICE;
  assert_int_equal(kvi_store_search(p.gpu, e, 1, DIM, &t, 2, ids, sc, &cnt, &o, NULL), KVI_ERR_MEMORY_KIND);
  o.out_memory = KVI_MEMORY_DEVICE;
  assert_int_equal(kvi_store_search(p.gpu, dq, 1, DIM, &t, 2, ids, sc, &cnt, &o, NULL), KVI_ERR_MEMORY_KIND);
  o.out_memory = KVI_MEMORY_HOST;
  assert_int_equal(kvi_store_search(p.gpu, dq, 1, DIM, (const uint64_t *)dq, 2, ids, sc, &cnt, &o, NULL),
                   KVI_ERR_MEMORY_KIND); /* tenants must be host memory */
  assert_true(ids[0] == 7 && ids[1] == 7 && cnt == 7);
  CHECK_OK(kvi_store_search(p.gpu, dq, 1, DIM, &t, 2, ids, sc, &cnt, &o, NULL));
  assert_int_equal(cnt, 1);
  assert_int_equal(ids[0], 1);
  assert_true(sc[0] == 204.0f && ids[1] == KVI_SEARCH_NO_ID);
  CUDA_OK(cudaFree(dq));
  pair_free(&p);
#endif
}

/* Threads: two searchers with host results on their own streams (they
 * share the staging slots and wait for each other's results only through
 * them) and a writer. */
typedef struct worker {
  pair *p;
  int id;
  int failures;
  volatile int *stop;
} worker;

static void *searcher(void *arg) {
  worker *w = arg;
  (void)w; /* unused where CUDA is not built */
#ifdef KVI_HAVE_CUDA
  cudaStream_t st;
  if (cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess) {
    w->failures++;
    return NULL;
  }
  float q[2 * 32];
  for (int i = 0; i < 64; i++) q[i] = (float)((i * 7 + w->id) % 5) - 2.0f;
  const uint64_t t[2] = {1, 2};
  uint64_t ids[2 * 64];
  float sc[2 * 64];
  int32_t cnt[2];
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  for (int r = 0; r < sized(300, 20) || !*w->stop; r++) {
    if (kvi_store_search(w->p->gpu, q, 2, 32, t, 64, ids, sc, cnt, &o, (struct CUstream_st *)st) != KVI_OK) {
      w->failures++;
      break;
    }
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < cnt[i]; j++) {
        const uint64_t x = ids[i * 64 + j];
        if (x < t[i] * 1000 || x >= t[i] * 1000 + 200) w->failures++;
        if (j > 0 && (sc[i * 64 + j - 1] < sc[i * 64 + j] ||
                      (sc[i * 64 + j - 1] == sc[i * 64 + j] && ids[i * 64 + j - 1] > x)))
          w->failures++;
      }
  }
  cudaStreamDestroy(st);
#endif
  return NULL;
}

static void test_threads(void **state) {
  (void)state;
  REQUIRE_GPU();
  pair p;
  pair_make(&p, KVI_DTYPE_FP16, KVI_METRIC_INNER_PRODUCT, 32, 1000);
  volatile int stop = 0;
  worker w[2] = {{&p, 0, 0, &stop}, {&p, 1, 0, &stop}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, searcher, &w[i]), 0);
  float e[32];
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, KV_D, p.kv, p.kv + KV_D);
  for (int i = 0; i < sized(2000, 200); i++) {
    const uint64_t tenant = 1 + (uint64_t)(i & 1), id = tenant * 1000 + rnd() % 200;
    rand_ints(e, 32, -3, 3);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = e;
    po.flags = KVI_PUT_REPLACE;
    if (rnd() % 3 == 0) {
      kvi_store_remove(p.gpu, tenant, id);
    } else {
      CHECK_OK(kvi_store_put(p.gpu, tenant, id, &v, &po, NULL));
    }
  }
  stop = 1;
  for (int i = 0; i < 2; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(w[i].failures, 0);
  }
  pair_free(&p);
}

int main(void) {
  if (kvi_cuda_device_count(&g_devices) != KVI_OK) g_devices = 0;
  g_search = g_devices > 0 && (kvi_features() & KVI_FEATURE_CUBLASLT);
  g_quick = getenv("KVI_TEST_QUICK") && atoi(getenv("KVI_TEST_QUICK")) != 0;
  if (!g_search)
    fprintf(stderr, "gpu-search suite: no CUDA device or no cuBLASLt in this build (%s); every test skips\n",
            kvi_last_error());
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_exact, setup),
      cmocka_unit_test_setup(test_tiled, setup),
      cmocka_unit_test_setup(test_random, setup),
      cmocka_unit_test_setup(test_isolation_random, setup),
      cmocka_unit_test_setup(test_device_query_checks, setup),
      cmocka_unit_test_setup(test_stream_order, setup),
      cmocka_unit_test_setup(test_memory_kinds, setup),
      cmocka_unit_test_setup(test_threads, setup),
  };
  int failed = cmocka_run_group_tests_name("gpu-search", tests, NULL, NULL);
  if (failed) return 1;
  return g_search ? 0 : 77;
}
