/*
 * unit-search: kvi_store_search on the CPU backend (the reference) against a
 * brute-force ranking computed here from the embeddings the test expects the
 * store to keep (rounded, and for cosine scaled, by this file's own rules);
 * ties, k beyond the tenant's facts, unknown tenants, tenant isolation under
 * random puts and removes, every rejected input, encode with embeddings,
 * and searches racing puts and removes.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>

#include "unit.h"

#define L 1
#define H 1
#define D 8

typedef struct fixture {
  kvi_model *m;
  rng r;
  float kv[2 * D]; /* one token of K and V, the same for every fact */
} fixture;

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  assert_non_null(f);
  f->m = make_model(L, H, D, 0, 1);
  kvi_rope_spec none = KVI_ROPE_SPEC_INIT;
  none.style = KVI_ROPE_NONE; /* the encode test captures unrotated keys */
  assert_ok(kvi_model_set_rope(f->m, -1, &none));
  for (int i = 0; i < 2 * D; i++) f->kv[i] = (float)i;
  rng_seed(&f->r, "unit-search");
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  kvi_model_destroy(f->m);
  free(f);
  return 0;
}

static kvi_store *make_store(fixture *f, kvi_dtype edt, kvi_metric metric, int32_t dim, uint32_t pages) {
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, 1, (uint64_t)pages * 2 * D * sizeof(float));
  o.embedding_dim = dim;
  o.embedding_dtype = edt;
  o.metric = metric;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, f->m, &o));
  return s;
}

static kvi_status put(fixture *f, kvi_store *s, uint64_t tenant, uint64_t id, const float *emb, uint32_t flags) {
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 1, H, D, f->kv, f->kv + D);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = emb;
  po.flags = flags;
  return kvi_store_put(s, tenant, id, &v, &po, NULL);
}

/* ------------------------------------------------------------------------ */
/* the reference                                                            */
/* ------------------------------------------------------------------------ */

/* What the store keeps of x (and what a query becomes), by the documented
 * rule: cosine scales by 1/sqrt(sum of squares) in double; then rounding to
 * the embedding dtype (unit.h's reference rounding). */
static void ref_prepare(float *out, const float *x, int32_t dim, kvi_dtype dt, kvi_metric metric) {
  double ss = 0.0;
  for (int32_t i = 0; i < dim; i++) ss += (double)x[i] * (double)x[i];
  const double inv = metric == KVI_METRIC_COSINE && ss > 0.0 ? 1.0 / sqrt(ss) : 1.0;
  for (int32_t i = 0; i < dim; i++)
    out[i] = ref_round(metric == KVI_METRIC_COSINE ? (float)((double)x[i] * inv) : x[i], dt);
}

typedef struct rfact {
  uint64_t tenant, id;
  float *kept; /* the embedding as the store should keep it */
} rfact;

/* The facts a store should hold. */
typedef struct rmodel {
  rfact *f;
  size_t n, cap;
  int32_t dim;
  kvi_dtype dt;
  kvi_metric metric;
} rmodel;

static void rm_init(rmodel *m, int32_t dim, kvi_dtype dt, kvi_metric metric) {
  memset(m, 0, sizeof *m);
  m->dim = dim, m->dt = dt, m->metric = metric;
}

static void rm_free(rmodel *m) {
  for (size_t i = 0; i < m->n; i++) free(m->f[i].kept);
  free(m->f);
}

static rfact *rm_find(rmodel *m, uint64_t tenant, uint64_t id) {
  for (size_t i = 0; i < m->n; i++)
    if (m->f[i].tenant == tenant && m->f[i].id == id) return &m->f[i];
  return NULL;
}

static void rm_put(rmodel *m, uint64_t tenant, uint64_t id, const float *x) {
  rfact *r = rm_find(m, tenant, id);
  if (!r) {
    if (m->n == m->cap) {
      m->cap = m->cap ? 2 * m->cap : 64;
      m->f = realloc(m->f, m->cap * sizeof *m->f);
      assert_non_null(m->f);
    }
    r = &m->f[m->n++];
    r->tenant = tenant, r->id = id;
    r->kept = malloc((size_t)m->dim * sizeof(float));
  }
  ref_prepare(r->kept, x, m->dim, m->dt, m->metric);
}

static void rm_remove(rmodel *m, uint64_t tenant, uint64_t id) {
  rfact *r = rm_find(m, tenant, id);
  assert_non_null(r);
  free(r->kept);
  *r = m->f[--m->n];
}

typedef struct hit {
  float s;
  uint64_t id;
} hit;

static int cmp_hit(const void *a, const void *b) {
  const hit *x = a, *y = b;
  if (x->s != y->s) return x->s > y->s ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

/* Searches `s` and checks every output against the brute-force ranking of
 * the model: scores summed in double and rounded once, sorted by (score,
 * id). queries: nq x dim raw elements of qdt; qf: the same as fp32. */
static void check_search(kvi_store *s, const rmodel *m, const void *queries, kvi_dtype qdt, const float *qf, int32_t nq,
                         const uint64_t *tenants, int32_t k) {
  const size_t no = (size_t)nq * k;
  uint64_t *ids = malloc(no * sizeof *ids);
  float *scores = malloc(no * sizeof *scores);
  int32_t *counts = malloc((size_t)nq * sizeof *counts);
  hit *hits = malloc((m->n + 1) * sizeof *hits);
  float *q = malloc((size_t)m->dim * sizeof *q);
  assert_true(ids && scores && counts && hits && q);
  memset(ids, 0x5a, no * sizeof *ids);
  memset(scores, 0x5a, no * sizeof *scores);
  memset(counts, 0x5a, (size_t)nq * sizeof *counts);
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  o.query_dtype = qdt;
  assert_ok(kvi_store_search(s, queries, nq, m->dim, tenants, k, ids, scores, counts, &o, NULL));
  for (int32_t i = 0; i < nq; i++) {
    ref_prepare(q, qf + (size_t)i * m->dim, m->dim, m->dt, m->metric);
    size_t n = 0;
    for (size_t j = 0; j < m->n; j++) {
      if (m->f[j].tenant != tenants[i]) continue;
      double d = 0.0;
      for (int32_t e = 0; e < m->dim; e++) d += (double)q[e] * (double)m->f[j].kept[e];
      hits[n].s = (float)d;
      hits[n++].id = m->f[j].id;
    }
    qsort(hits, n, sizeof *hits, cmp_hit);
    const int32_t want = n < (size_t)k ? (int32_t)n : k;
    if (counts[i] != want)
      fail_msg("query %d (tenant %llu, k %d): count %d, expected %d", (int)i, (unsigned long long)tenants[i], (int)k,
               (int)counts[i], (int)want);
    for (int32_t j = 0; j < k; j++) {
      const uint64_t gi = ids[(size_t)i * k + j];
      const float gs = scores[(size_t)i * k + j];
      if (j < want) {
        if (gi != hits[j].id || f2u(gs) != f2u(hits[j].s))
          fail_msg("query %d (tenant %llu, k %d) rank %d: fact %llu score %.9g, expected fact %llu score %.9g", (int)i,
                   (unsigned long long)tenants[i], (int)k, (int)j, (unsigned long long)gi, (double)gs,
                   (unsigned long long)hits[j].id, (double)hits[j].s);
      } else if (gi != KVI_SEARCH_NO_ID || !(isinf(gs) && gs < 0)) {
        fail_msg("query %d rank %d past its count %d: fact %llu score %g, expected the sentinel", (int)i, (int)j,
                 (int)want, (unsigned long long)gi, (double)gs);
      }
    }
  }
  free(ids);
  free(scores);
  free(counts);
  free(hits);
  free(q);
}

/* get_embedding returns, bit for bit, what the model says the store keeps. */
static void check_kept(const kvi_store *s, const rmodel *m) {
  float *out = malloc((size_t)m->dim * sizeof *out);
  for (size_t i = 0; i < m->n; i++) {
    assert_ok(kvi_store_get_embedding(s, m->f[i].tenant, m->f[i].id, out));
    for (int32_t e = 0; e < m->dim; e++)
      if (f2u(out[e]) != f2u(m->f[i].kept[e]))
        fail_msg("fact %llu element %d: kept %.9g, expected %.9g", (unsigned long long)m->f[i].id, (int)e,
                 (double)out[e], (double)m->f[i].kept[e]);
  }
  free(out);
}

static void rand_ints(rng *r, float *x, int32_t n, int lo, int hi) {
  for (int32_t i = 0; i < n; i++) x[i] = (float)rng_range(r, lo, hi);
}

/* Moderate random floats with full mantissas, in (-4, 4). */
static void rand_floats(rng *r, float *x, int32_t n) {
  for (int32_t i = 0; i < n; i++) {
    const float v = ldexpf(1.0f + (float)(rng_next(r) & 0x7fffffu) * 0x1p-23f, (int)rng_range(r, -6, 1));
    x[i] = (rng_next(r) & 1u) ? -v : v;
  }
}

/* ------------------------------------------------------------------------ */
/* tests                                                                    */
/* ------------------------------------------------------------------------ */

/* Small integers: every score is exact, so ties are real ties and the
 * expected order is exact; every storage dtype holds them exactly. */
static void test_exact_ranking_and_ties(void **state) {
  fixture *f = *state;
  enum { DIM = 24, N1 = 60, N2 = 40 };
  for (int d = 0; d < 3; d++) {
    const kvi_dtype dt = float_dtypes[d];
    kvi_store *s = make_store(f, dt, KVI_METRIC_INNER_PRODUCT, DIM, N1 + N2);
    rmodel m;
    rm_init(&m, DIM, dt, KVI_METRIC_INNER_PRODUCT);
    float x[DIM];
    for (int i = 0; i < N1 + N2; i++) {
      const uint64_t tenant = i < N1 ? 1 : 2;
      /* ids spread over the 64-bit range, 0 and UINT64_MAX - 1 included */
      const uint64_t id = i == 0 ? 0 : i == 1 ? UINT64_MAX - 1 : rng_next(&f->r) >> (rng_next(&f->r) % 60);
      if (rm_find(&m, tenant, id)) continue;
      rand_ints(&f->r, x, DIM, -3, 3);
      assert_ok(put(f, s, tenant, id, x, 0));
      rm_put(&m, tenant, id, x);
    }
    check_kept(s, &m);
    /* queries: random, all zeros (every score ties), and a fact's own embedding */
    enum { NQ = 7 };
    float qf[NQ * DIM];
    rand_ints(&f->r, qf, NQ * DIM, -2, 2);
    memset(qf + DIM, 0, DIM * sizeof(float));
    memcpy(qf + 2 * DIM, m.f[3].kept, DIM * sizeof(float));
    const uint64_t tenants[NQ] = {1, 1, 1, 2, 3, 2, 1};
    const int32_t ks[] = {1, 5, 40, 64, 1024};
    for (size_t j = 0; j < sizeof ks / sizeof *ks; j++) check_search(s, &m, qf, KVI_DTYPE_FP32, qf, NQ, tenants, ks[j]);
    /* the zero query's results: the first k ids, ascending, all scored 0 */
    uint64_t ids[10];
    float sc[10];
    int32_t cnt = -1;
    assert_ok(kvi_store_search(s, qf + DIM, 1, DIM, &tenants[1], 10, ids, sc, &cnt, NULL, NULL));
    assert_int_equal(cnt, 10);
    for (int j = 0; j < 10; j++) {
      assert_true(sc[j] == 0.0f);
      if (j > 0) assert_true(ids[j - 1] < ids[j]);
    }
    assert_int_equal(ids[0], 0);
    rm_free(&m);
    kvi_store_destroy(s);
  }
}

/* Random floats: every storage dtype, both metrics, every query dtype. */
static void test_random_floats(void **state) {
  fixture *f = *state;
  enum { DIM = 37, N = 150, NQ = 6 };
  for (int d = 0; d < 3; d++)
    for (int metric = 0; metric < 2; metric++) {
      const kvi_dtype dt = float_dtypes[d];
      kvi_store *s = make_store(f, dt, (kvi_metric)metric, DIM, N);
      rmodel m;
      rm_init(&m, DIM, dt, (kvi_metric)metric);
      float x[DIM];
      for (int i = 0; i < N; i++) {
        const uint64_t tenant = (uint64_t)rng_range(&f->r, 7, 9), id = rng_next(&f->r) % 1000;
        rand_floats(&f->r, x, DIM);
        assert_ok(put(f, s, tenant, id, x, KVI_PUT_REPLACE)); /* a repeated id replaces */
        rm_put(&m, tenant, id, x);
      }
      check_kept(s, &m);
      const uint64_t tenants[NQ] = {7, 8, 9, 7, 10, 9};
      for (int qd = 0; qd < 3; qd++) {
        const kvi_dtype qdt = float_dtypes[qd];
        float qf[NQ * DIM];
        uint16_t q16[NQ * DIM];
        rand_floats(&f->r, qf, NQ * DIM);
        for (int i = 0; i < NQ * DIM; i++) { /* the query as its dtype holds it */
          if (qdt == KVI_DTYPE_FP32) continue;
          q16[i] = (uint16_t)ref_bits(qf[i], qdt);
          qf[i] = ref_load(q16, qdt, i);
        }
        check_search(s, &m, qdt == KVI_DTYPE_FP32 ? (const void *)qf : (const void *)q16, qdt, qf, NQ, tenants,
                     (int32_t)rng_range(&f->r, 1, 70));
      }
      rm_free(&m);
      kvi_store_destroy(s);
    }
}

/* Cosine: unit length kept, a zero vector stays zero, a fact's own direction
 * ranks it first with a score of about 1, whatever the query's length. */
static void test_cosine(void **state) {
  fixture *f = *state;
  enum { DIM = 4 };
  kvi_store *s = make_store(f, KVI_DTYPE_FP32, KVI_METRIC_COSINE, DIM, 8);
  const float a[DIM] = {3, 4, 0, 0}, b[DIM] = {0, 0, 0, 0}, c[DIM] = {-1, 1, 1, -1}, big[DIM] = {1e30f, 0, 0, 1e30f};
  assert_ok(put(f, s, 1, 10, a, 0));
  assert_ok(put(f, s, 1, 11, b, 0));
  assert_ok(put(f, s, 1, 12, c, 0));
  assert_ok(put(f, s, 1, 13, big, 0));
  float out[DIM];
  assert_ok(kvi_store_get_embedding(s, 1, 10, out));
  assert_true(out[0] == 0.6f && out[1] == 0.8f && out[2] == 0.0f && out[3] == 0.0f);
  assert_ok(kvi_store_get_embedding(s, 1, 11, out));
  for (int i = 0; i < DIM; i++) assert_true(out[i] == 0.0f);
  assert_ok(kvi_store_get_embedding(s, 1, 12, out));
  for (int i = 0; i < DIM; i++) assert_true(out[i] == 0.5f * c[i]);
  assert_ok(kvi_store_get_embedding(s, 1, 13, out)); /* squares summed in double do not overflow */
  assert_true(fabsf(out[0] - 0.70710677f) < 1e-7f && out[1] == 0.0f && fabsf(out[3] - 0.70710677f) < 1e-7f);
  const float q[DIM] = {300, 400, 0, 0}; /* a's direction, 100 times longer */
  const uint64_t t = 1;
  uint64_t ids[4];
  float sc[4];
  int32_t cnt;
  assert_ok(kvi_store_search(s, q, 1, DIM, &t, 4, ids, sc, &cnt, NULL, NULL));
  assert_int_equal(cnt, 4);
  assert_int_equal(ids[0], 10);
  assert_true(fabsf(sc[0] - 1.0f) < 1e-6f);
  /* 13: 0.6 * 0.7071; 12: (-0.6 + 0.8) / 2; 11: 0 */
  assert_int_equal(ids[1], 13);
  assert_int_equal(ids[2], 12);
  assert_true(fabsf(sc[2] - 0.1f) < 1e-6f);
  assert_int_equal(ids[3], 11);
  assert_true(sc[3] == 0.0f);
  kvi_store_destroy(s);
}

/* Random puts, replaces and removes over tenants that share fact ids; after
 * every few operations each tenant's search equals the brute force over its
 * own facts only. Failed puts change nothing. */
static void test_isolation_random(void **state) {
  fixture *f = *state;
  enum { DIM = 16, TENANTS = 4, OPS = 400, IDS = 24 };
  kvi_store *s = make_store(f, KVI_DTYPE_BF16, KVI_METRIC_INNER_PRODUCT, DIM, 2 * TENANTS * IDS);
  rmodel m;
  rm_init(&m, DIM, KVI_DTYPE_BF16, KVI_METRIC_INNER_PRODUCT);
  float x[DIM];
  enum { NQ = TENANTS + 1 };
  float qf[NQ * DIM];
  uint64_t tenants[NQ];
  for (int i = 0; i < NQ; i++) tenants[i] = (uint64_t)i + 100; /* 100..103, and 104 never has facts */
  for (int op = 0; op < OPS; op++) {
    const uint64_t tenant = 100 + (uint64_t)rng_range(&f->r, 0, TENANTS - 1), id = (uint64_t)rng_range(&f->r, 0, IDS);
    const bool exists = rm_find(&m, tenant, id) != NULL;
    const int what = (int)rng_range(&f->r, 0, 9);
    rand_ints(&f->r, x, DIM, -5, 5);
    if (what < 5) { /* put (replace or new) */
      assert_ok(put(f, s, tenant, id, x, KVI_PUT_REPLACE));
      rm_put(&m, tenant, id, x);
    } else if (what < 8) { /* remove */
      assert_status(kvi_store_remove(s, tenant, id), exists ? KVI_OK : KVI_ERR_NOT_FOUND);
      if (exists) rm_remove(&m, tenant, id);
    } else if (what == 8) { /* a put that must fail: key present, or a NaN embedding */
      if (exists) {
        assert_status(put(f, s, tenant, id, x, 0), KVI_ERR_EXISTS);
      } else {
        x[(int)rng_range(&f->r, 0, DIM - 1)] = NAN;
        assert_status(put(f, s, tenant, id, x, 0), KVI_ERR_INVALID_ARGUMENT);
      }
    } else { /* remove a whole tenant */
      for (size_t i = m.n; i-- > 0;)
        if (m.f[i].tenant == tenant) {
          assert_ok(kvi_store_remove(s, tenant, m.f[i].id));
          rm_remove(&m, tenant, m.f[i].id);
        }
    }
    if (op % 10 == 9 || op == OPS - 1) {
      rand_ints(&f->r, qf, NQ * DIM, -3, 3);
      check_search(s, &m, qf, KVI_DTYPE_FP32, qf, NQ, tenants, (int32_t)rng_range(&f->r, 1, IDS + 3));
      const kvi_store_stats st = store_stats(s);
      assert_int_equal(st.facts, m.n);
      if (m.n > 0) assert_true(st.bytes_embeddings >= m.n * DIM * 2);
      else assert_int_equal(st.bytes_embeddings, 0);
    }
  }
  check_kept(s, &m);
  for (size_t i = m.n; i-- > 0;) {
    assert_ok(kvi_store_remove(s, m.f[i].tenant, m.f[i].id));
    rm_remove(&m, m.f[i].tenant, m.f[i].id);
  }
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.tenants, 0);
  assert_int_equal(st.bytes_embeddings, 0);
  rm_free(&m);
  kvi_store_destroy(s);
}

/* A search that must fail with `want`, mention `needle`, and write nothing. */
#define SEARCH_FAILS(want, needle, ...)                                                                            \
  do {                                                                                                             \
    memset(ids, 0x5a, sizeof ids);                                                                                 \
    memset(sc, 0x5a, sizeof sc);                                                                                   \
    memset(cnt, 0x5a, sizeof cnt);                                                                                 \
    assert_status(kvi_store_search(__VA_ARGS__), want);                                                            \
    assert_last_error_has("kvi_store_search", needle);                                                             \
    for (size_t i_ = 0; i_ < sizeof ids; i_++) assert_int_equal(((unsigned char *)ids)[i_], 0x5a);                 \
    for (size_t i_ = 0; i_ < sizeof sc; i_++) assert_int_equal(((unsigned char *)sc)[i_], 0x5a);                   \
    for (size_t i_ = 0; i_ < sizeof cnt; i_++) assert_int_equal(((unsigned char *)cnt)[i_], 0x5a);                 \
  } while (0)

static void test_bad_inputs(void **state) {
  fixture *f = *state;
  enum { DIM = 6 };
  kvi_store *s = make_store(f, KVI_DTYPE_FP16, KVI_METRIC_INNER_PRODUCT, DIM, 4);
  const float e[DIM] = {1, 2, 3, 4, 5, 6};
  assert_ok(put(f, s, 1, 1, e, 0));
  float q[2 * DIM] = {1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0};
  const uint64_t t[2] = {1, 1};
  uint64_t ids[2 * 3];
  float sc[2 * 3];
  int32_t cnt[2];
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;

  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "store is NULL", NULL, q, 2, DIM, t, 3, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_MISMATCH, "dim is 5", s, q, 2, DIM - 1, t, 3, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "k is 0", s, q, 2, DIM, t, 0, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "k is -3", s, q, 2, DIM, t, -3, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "k is 1025", s, q, 2, DIM, t, 1025, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "num_queries is -1", s, q, -1, DIM, t, 3, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "queries is NULL", s, NULL, 2, DIM, t, 3, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "tenants is NULL", s, q, 2, DIM, NULL, 3, ids, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "out_ids is NULL", s, q, 2, DIM, t, 3, NULL, sc, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "out_scores is NULL", s, q, 2, DIM, t, 3, ids, NULL, cnt, NULL, NULL);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "out_counts is NULL", s, q, 2, DIM, t, 3, ids, sc, NULL, NULL, NULL);
  /* NaN, infinity, and a value fp16 embeddings cannot hold (rounds to infinity), named by position */
  const float bad[3] = {NAN, -INFINITY, 65520.0f};
  const char *const where[3] = {"queries[1][4] is nan", "queries[0][2] is -inf", "queries[1][0] is 65520"};
  const int pos[3] = {DIM + 4, 2, DIM};
  for (int i = 0; i < 3; i++) {
    const float keep = q[pos[i]];
    q[pos[i]] = bad[i];
    SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, where[i], s, q, 2, DIM, t, 3, ids, sc, cnt, NULL, NULL);
    q[pos[i]] = keep;
  }
  q[DIM] = 65504.0f; /* the largest fp16: fine */
  assert_ok(kvi_store_search(s, q, 2, DIM, t, 3, ids, sc, cnt, NULL, NULL));
  q[DIM] = 0.0f;
  uint16_t h[DIM] = {0x3c00, 0x7e00, 0, 0, 0, 0}; /* fp16 NaN */
  o.query_dtype = KVI_DTYPE_FP16;
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "queries[0][1] is nan", s, h, 1, DIM, t, 3, ids, sc, cnt, &o, NULL);
  /* options */
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.query_dtype = KVI_DTYPE_FP8_E4M3;
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "query_dtype is 4", s, q, 2, DIM, t, 3, ids, sc, cnt, &o, NULL);
  o.query_dtype = (kvi_dtype)0;
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "query_dtype is 0", s, q, 2, DIM, t, 3, ids, sc, cnt, &o, NULL);
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.query_memory = (kvi_memory)7;
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "query_memory is 7", s, q, 2, DIM, t, 3, ids, sc, cnt, &o, NULL);
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.out_memory = (kvi_memory)0;
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "out_memory is 0", s, q, 2, DIM, t, 3, ids, sc, cnt, &o, NULL);
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.workspace_bytes = 4096;
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "workspace_bytes is 4096", s, q, 2, DIM, t, 3, ids, sc, cnt, &o, NULL);
  /* a CPU store reads and writes host memory only */
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.query_memory = KVI_MEMORY_DEVICE;
  SEARCH_FAILS(KVI_ERR_MEMORY_KIND, "queries is declared as device memory", s, q, 2, DIM, t, 3, ids, sc, cnt, &o,
               NULL);
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.out_memory = KVI_MEMORY_DEVICE;
  SEARCH_FAILS(KVI_ERR_MEMORY_KIND, "out_ids is declared as device memory", s, q, 2, DIM, t, 3, ids, sc, cnt, &o,
               NULL);
  /* struct sizes */
  struct {
    kvi_search_options o;
    uint64_t extra;
  } big;
  memset(&big, 0, sizeof big);
  big.o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  big.o.struct_size = sizeof big;
  big.extra = 1;
  SEARCH_FAILS(KVI_ERR_STRUCT_SIZE, "non-zero byte", s, q, 2, DIM, t, 3, ids, sc, cnt, &big.o, NULL);
  big.extra = 0;
  assert_ok(kvi_store_search(s, q, 2, DIM, t, 3, ids, sc, cnt, &big.o, NULL)); /* zero tail: fine */
  o = (kvi_search_options)KVI_SEARCH_OPTIONS_INIT;
  o.struct_size = sizeof(size_t);
  SEARCH_FAILS(KVI_ERR_STRUCT_SIZE, "struct_size is 8", s, q, 2, DIM, t, 3, ids, sc, cnt, &o, NULL);
  /* a store without embeddings */
  kvi_store *plain = make_store(f, KVI_DTYPE_FP32, KVI_METRIC_INNER_PRODUCT, 0, 2);
  SEARCH_FAILS(KVI_ERR_INVALID_ARGUMENT, "keeps no embeddings", plain, q, 2, DIM, t, 3, ids, sc, cnt, NULL, NULL);
  kvi_store_destroy(plain);
  /* no queries: nothing to do, nothing written, NULL outputs allowed */
  memset(cnt, 0x5a, sizeof cnt);
  assert_ok(kvi_store_search(s, NULL, 0, DIM, NULL, 3, NULL, NULL, NULL, NULL, NULL));
  assert_ok(kvi_store_search(s, q, 0, DIM, t, 3, ids, sc, cnt, NULL, NULL));
  assert_int_equal(((unsigned char *)cnt)[0], 0x5a);
  /* the store is as it was */
  assert_ok(kvi_store_search(s, q, 2, DIM, t, 3, ids, sc, cnt, NULL, NULL));
  assert_int_equal(cnt[0], 1);
  assert_int_equal(ids[0], 1);
  assert_true(sc[0] == 1.0f && sc[3] == 2.0f);
  int64_t nbad = -1;
  assert_ok(kvi_store_async_errors(s, &nbad));
  assert_int_equal(nbad, 0);
  nbad = -1;
  assert_status(kvi_store_async_errors(NULL, &nbad), KVI_ERR_INVALID_ARGUMENT);
  assert_int_equal(nbad, -1); /* nothing written for a NULL handle */
  assert_ok(kvi_store_async_errors(s, NULL)); /* the count is optional */
  kvi_store_destroy(s);
}

/* Store options and puts: the new fields are checked, a value the
 * embedding dtype cannot hold is refused, kept values are rounded. */
static void test_store_embedding_options(void **state) {
  fixture *f = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, 1, 1u << 16);
  o.embedding_dim = 3;
  kvi_store *s = NULL;
  o.embedding_dtype = KVI_DTYPE_FP8_E5M2;
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_create", "embedding_dtype is 5");
  o.embedding_dtype = KVI_DTYPE_FP16;
  o.metric = (kvi_metric)2;
  assert_status(kvi_store_create(&s, f->m, &o), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_create", "metric is 2");
  assert_null(s);
  o.metric = KVI_METRIC_INNER_PRODUCT;
  assert_ok(kvi_store_create(&s, f->m, &o));
  const float too_big[3] = {1.0f, 70000.0f, 2.0f}, ok[3] = {0.1f, -65504.0f, 3e-8f};
  assert_status(put(f, s, 1, 1, too_big, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_put", "embedding[1] is 70000");
  assert_int_equal(store_stats(s).facts, 0);
  assert_int_equal(store_stats(s).tenants, 0);
  assert_int_equal(store_stats(s).bytes_embeddings, 0);
  assert_ok(put(f, s, 1, 1, ok, 0));
  float out[3];
  assert_ok(kvi_store_get_embedding(s, 1, 1, out));
  for (int i = 0; i < 3; i++) assert_int_equal(f2u(out[i]), f2u(ref_round(ok[i], KVI_DTYPE_FP16)));
  /* a failed replace keeps the old row */
  assert_status(put(f, s, 1, 1, too_big, KVI_PUT_REPLACE), KVI_ERR_INVALID_ARGUMENT);
  assert_ok(kvi_store_get_embedding(s, 1, 1, out));
  assert_true(out[1] == -65504.0f);
  const kvi_store_stats st = store_stats(s);
  assert_true(st.bytes_embeddings >= 3 * 2);
  kvi_store_destroy(s);
}

/* Encode keeps embeddings too: captured facts are searchable; a failed
 * encode (all-or-nothing) leaves no trace, not even an empty tenant. */
static void test_encode_embeddings(void **state) {
  fixture *f = *state;
  enum { DIM = 5, SLOTS = 8 };
  kvi_store *s = make_store(f, KVI_DTYPE_FP32, KVI_METRIC_INNER_PRODUCT, DIM, 16);
  float kc[SLOTS * H * D], vc[SLOTS * H * D];
  for (int i = 0; i < SLOTS * H * D; i++) kc[i] = vc[i] = (float)(i % 7);
  void *kl[1] = {kc}, *vl[1] = {vc};
  kvi_cache_layout lay;
  assert_ok(kvi_cache_layout_preset(&lay, KVI_CACHE_SGLANG, KVI_DTYPE_FP32, L, H, D, 1, SLOTS, kl, vl, NULL));
  lay.memory = KVI_MEMORY_HOST;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_encoder_create(&enc, s, &lay, NULL));
  const int32_t table[SLOTS] = {0, 1, 2, 3, 4, 5, 6, 7};
  const float e[3][DIM] = {{1, 0, 0, 0, 0}, {0, 1, 0, 0, 0}, {0, 0, 1, 0, 0}};
  kvi_capture cs[3];
  for (int i = 0; i < 3; i++) {
    kvi_capture_init(&cs[i], sizeof cs[i]);
    cs[i].tenant = i < 2 ? 40 : 41; /* two facts of one new tenant in one call */
    cs[i].fact_id = (uint64_t)(i + 1);
    cs[i].block_table = table;
    cs[i].block_table_len = SLOTS;
    cs[i].first_slot = i;
    cs[i].num_tokens = 1;
    cs[i].embedding = e[i];
  }
  /* a failing call first: the third capture repeats the first's key */
  cs[2].tenant = 40, cs[2].fact_id = 1;
  assert_status(kvi_encode(enc, cs, 3, NULL), KVI_ERR_INVALID_ARGUMENT);
  cs[2].tenant = 41, cs[2].fact_id = 3;
  /* one that fails under the lock, after rows were reserved: an existing key */
  assert_ok(put(f, s, 41, 3, e[0], 0));
  assert_status(kvi_encode(enc, cs, 3, NULL), KVI_ERR_EXISTS);
  assert_int_equal(store_stats(s).tenants, 1);
  assert_int_equal(store_stats(s).facts, 1);
  assert_ok(kvi_store_remove(s, 41, 3));
  assert_int_equal(store_stats(s).tenants, 0);
  assert_ok(kvi_encode(enc, cs, 3, NULL));
  const float q[2][DIM] = {{0, 5, 1, 0, 0}, {0, 0, 2, 0, 0}};
  const uint64_t t[2] = {40, 41};
  uint64_t ids[2][2];
  float sc[2][2];
  int32_t cnt[2];
  assert_ok(kvi_store_search(s, q, 2, DIM, t, 2, &ids[0][0], &sc[0][0], cnt, NULL, NULL));
  assert_int_equal(cnt[0], 2);
  assert_int_equal(ids[0][0], 2);
  assert_true(sc[0][0] == 5.0f);
  assert_int_equal(ids[0][1], 1);
  assert_true(sc[0][1] == 0.0f);
  assert_int_equal(cnt[1], 1);
  assert_int_equal(ids[1][0], 3);
  assert_true(sc[1][0] == 2.0f);
  kvi_encoder_destroy(enc);
  kvi_store_destroy(s);
}

/* Searches racing puts and removes: every result belongs to the searched
 * tenant, and is sorted. */
typedef struct race {
  kvi_store *s;
  fixture *f;
  volatile int stop;
  int failures;
} race;

enum { RACE_DIM = 8 };

static void *race_writer(void *arg) {
  race *r = arg;
  rng g = {12345};
  float x[RACE_DIM];
  for (int i = 0; i < 400; i++) {
    const uint64_t tenant = 1 + (uint64_t)(i & 1), id = (uint64_t)rng_range(&g, 0, 30) + tenant * 1000;
    rand_ints(&g, x, RACE_DIM, -4, 4);
    if (rng_range(&g, 0, 2) == 0) kvi_store_remove(r->s, tenant, id);
    else if (put(r->f, r->s, tenant, id, x, KVI_PUT_REPLACE) != KVI_OK) r->failures++;
  }
  r->stop = 1;
  return NULL;
}

static void test_search_races_writes(void **state) {
  fixture *f = *state;
  race r = {make_store(f, KVI_DTYPE_FP16, KVI_METRIC_INNER_PRODUCT, RACE_DIM, 128), f, 0, 0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, race_writer, &r), 0);
  const float q[2 * RACE_DIM] = {1, 2, 3, 4, 5, 6, 7, 8, -1, 0, 1, 0, -1, 0, 1, 0};
  const uint64_t t[2] = {1, 2};
  uint64_t ids[2 * 40];
  float sc[2 * 40];
  int32_t cnt[2];
  int rounds = 0;
  while (!r.stop || rounds < 5) {
    assert_ok(kvi_store_search(r.s, q, 2, RACE_DIM, t, 40, ids, sc, cnt, NULL, NULL));
    for (int i = 0; i < 2; i++) {
      assert_true(cnt[i] >= 0 && cnt[i] <= 31);
      for (int j = 0; j < cnt[i]; j++) {
        assert_true(ids[i * 40 + j] >= t[i] * 1000 && ids[i * 40 + j] <= t[i] * 1000 + 30);
        if (j > 0) assert_true(cmp_hit(&(hit){sc[i * 40 + j - 1], ids[i * 40 + j - 1]}, &(hit){sc[i * 40 + j], ids[i * 40 + j]}) < 0);
      }
    }
    rounds++;
  }
  pthread_join(th, NULL);
  assert_int_equal(r.failures, 0);
  kvi_store_destroy(r.s);
}

int main(void) {
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
  const struct CMUnitTest tests[] = {
      T(test_exact_ranking_and_ties), T(test_random_floats),   T(test_cosine),
      T(test_isolation_random),       T(test_bad_inputs),      T(test_store_embedding_options),
      T(test_encode_embeddings),      T(test_search_races_writes),
  };
#undef T
  return cmocka_run_group_tests_name("unit-search", tests, NULL, NULL);
}
