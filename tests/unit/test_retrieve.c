/*
 * kvi_retrieve_inject (CPU store): one call that searches and injects equals
 * kvi_store_search followed by kvi_inject of the winners (both tested against
 * float64 references in their own suites), byte for byte in the cache, in
 * both orders; tenants stay isolated; failed calls write nothing.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#define L 2
#define H 2
#define D 8
#define E 12
#define BS 4
#define NB 64
#define NF 30

typedef struct fx {
  kvi_model *m;
  kvi_store *s;
  float *cache_a, *cache_b; /* two host caches of the same layout */
  kvi_injector *ia, *ib;
  rng r;
  float q[4 * E];
} fx;

static size_t cache_floats(void) { return (size_t)L * 2 * NB * BS * H * D; }

static kvi_injector *injector(fx *f, float *cache) {
  void *layers[L];
  for (int l = 0; l < L; l++) layers[l] = cache + (size_t)l * 2 * NB * BS * H * D;
  kvi_cache_layout cl;
  assert_ok(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_FP32, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_HOST;
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &cl, NULL));
  return inj;
}

static int setup(void **state) {
  fx *f = calloc(1, sizeof *f);
  rng_seed(&f->r, "retrieve");
  const kvi_model_options mo = model_options(L, H, D, 0, 1);
  assert_ok(kvi_model_create(&f->m, &mo));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  assert_ok(kvi_model_set_rope(f->m, -1, &rs));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU, so.dtype = KVI_DTYPE_FP32, so.page_tokens = 4, so.budget_bytes = 4u << 20;
  so.embedding_dim = E;
  assert_ok(kvi_store_create(&f->s, f->m, &so));
  for (int i = 0; i < NF; i++) { /* tenants 1 and 2, facts of 1..6 tokens */
    const int T = (int)rng_range(&f->r, 1, 6);
    const size_t n = (size_t)L * T * H * D;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v), e[E];
    for (size_t j = 0; j < n; j++) k[j] = (float)rng_range(&f->r, -64, 64) / 16.0f, v[j] = (float)rng_range(&f->r, -64, 64) / 8.0f;
    for (int j = 0; j < E; j++) e[j] = (float)rng_range(&f->r, -16, 16) / 8.0f;
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, v);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = e;
    assert_ok(kvi_store_put(f->s, 1 + (uint64_t)(i % 2), 100 + (uint64_t)i, &kv, &po, NULL));
    free(k);
    free(v);
  }
  for (int j = 0; j < 4 * E; j++) f->q[j] = (float)rng_range(&f->r, -16, 16) / 8.0f;
  f->cache_a = calloc(cache_floats(), sizeof(float));
  f->cache_b = calloc(cache_floats(), sizeof(float));
  f->ia = injector(f, f->cache_a);
  f->ib = injector(f, f->cache_b);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fx *f = *state;
  kvi_injector_destroy(f->ia);
  kvi_injector_destroy(f->ib);
  kvi_store_destroy(f->s);
  kvi_model_destroy(f->m);
  free(f->cache_a);
  free(f->cache_b);
  free(f);
  return 0;
}

/* disjoint, scattered block tables of 32 blocks (128 slots: 16 facts of up to 6 tokens fit) */
static const int32_t table0[] = {7,  3,  12, 0,  1,  9,  22, 23, 30, 31, 2,  4,  5,  6,  8,  10,
                                 11, 13, 14, 15, 16, 17, 18, 19, 20, 21, 24, 25, 26, 27, 28, 29};
static const int32_t table1[] = {50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 32, 33,
                                 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49};

static kvi_retrieve_request req(uint64_t tenant, const int32_t *table, int64_t first, int32_t pos, uint32_t flags) {
  kvi_retrieve_request r;
  kvi_retrieve_request_init(&r, sizeof r);
  r.tenant = tenant, r.block_table = table, r.block_table_len = 32, r.first_slot = first, r.start_position = pos;
  r.flags = flags;
  return r;
}

/* The same through kvi_store_search + kvi_inject into cache_b. */
static void reference(fx *f, const kvi_retrieve_request *rq, int nq, int k, uint64_t *ids, int32_t *cnt, int32_t *tok) {
  uint64_t tenants[4];
  float sc[4 * 16];
  for (int i = 0; i < nq; i++) tenants[i] = rq[i].tenant;
  assert_ok(kvi_store_search(f->s, f->q, nq, E, tenants, k, ids, sc, cnt, NULL, NULL));
  uint64_t order[4][16];
  kvi_inject_request ir[4];
  for (int i = 0; i < nq; i++) {
    for (int j = 0; j < cnt[i]; j++)
      order[i][j] = ids[i * k + ((rq[i].flags & KVI_RETRIEVE_BEST_LAST) ? cnt[i] - 1 - j : j)];
    int64_t t = 0;
    if (cnt[i]) assert_ok(kvi_inject_plan(f->ib, rq[i].tenant, order[i], cnt[i], &t));
    tok[i] = (int32_t)t;
    kvi_inject_request_init(&ir[i], sizeof ir[i]);
    ir[i].tenant = rq[i].tenant, ir[i].fact_ids = order[i], ir[i].num_facts = cnt[i];
    ir[i].block_table = rq[i].block_table, ir[i].block_table_len = rq[i].block_table_len;
    ir[i].first_slot = rq[i].first_slot, ir[i].start_position = rq[i].start_position;
  }
  assert_ok(kvi_inject(f->ib, ir, nq, NULL, NULL));
}

static void test_equals_search_then_inject(void **state) {
  fx *f = *state;
  const int ks[] = {1, 5, 16};
  for (int ki = 0; ki < 3; ki++) {
    const int k = ks[ki];
    kvi_retrieve_request rq[3] = {req(1, table0, 2, 5, 0), req(2, table1, 0, 100, KVI_RETRIEVE_BEST_LAST),
                                  req(9, table0, 0, 0, 0)}; /* tenant 9 has no facts */
    uint64_t ids[3 * 16], rids[3 * 16];
    int32_t cnt[3], rcnt[3], tok[3], rtok[3];
    memset(f->cache_a, 0, cache_floats() * sizeof(float));
    memset(f->cache_b, 0, cache_floats() * sizeof(float));
    assert_ok(kvi_retrieve_inject(f->ia, f->q, 3, E, rq, k, NULL, ids, cnt, tok, NULL));
    reference(f, rq, 3, k, rids, rcnt, rtok);
    assert_memory_equal(cnt, rcnt, sizeof cnt);
    assert_memory_equal(tok, rtok, sizeof tok);
    assert_memory_equal(ids, rids, (size_t)3 * k * sizeof *ids);
    assert_int_equal(cnt[0], k < 15 ? k : 15); /* 15 facts per tenant */
    assert_int_equal(cnt[2], 0);
    assert_int_equal(tok[2], 0);
    assert_memory_equal(f->cache_a, f->cache_b, cache_floats() * sizeof(float));
    bool wrote = false;
    for (size_t i = 0; i < cache_floats() && !wrote; i++) wrote = f->cache_a[i] != 0.0f;
    assert_true(wrote);
    for (int i = 0; i < cnt[0]; i++) assert_int_equal((int)(ids[i] % 2), 0);     /* tenant 1: even ids */
    for (int i = 0; i < cnt[1]; i++) assert_int_equal((int)(ids[k + i] % 2), 1); /* tenant 2: odd ids */
  }
}

/* The best fact lands first or last: the two orders write different caches. */
static void test_order_flag(void **state) {
  fx *f = *state;
  kvi_retrieve_request a = req(1, table0, 0, 0, 0), b = req(1, table0, 0, 0, KVI_RETRIEVE_BEST_LAST);
  uint64_t ids[8];
  int32_t cnt, tok;
  memset(f->cache_a, 0, cache_floats() * sizeof(float));
  memset(f->cache_b, 0, cache_floats() * sizeof(float));
  assert_ok(kvi_retrieve_inject(f->ia, f->q, 1, E, &a, 8, NULL, ids, &cnt, &tok, NULL));
  assert_ok(kvi_retrieve_inject(f->ib, f->q, 1, E, &b, 8, NULL, ids, &cnt, &tok, NULL));
  assert_true(memcmp(f->cache_a, f->cache_b, cache_floats() * sizeof(float)) != 0);
}

static void test_failures_write_nothing(void **state) {
  fx *f = *state;
  for (size_t i = 0; i < cache_floats(); i++) f->cache_a[i] = -7.0f;
  uint64_t ids[16];
  int32_t cnt[2] = {-5, -5}, tok[2] = {-5, -5};
  kvi_retrieve_request rq[2] = {req(1, table0, 0, 0, 0), req(2, table1, 0, 0, 0)};
  rq[1].block_table_len = 1; /* 4 slots: too few for 8 facts */
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  rq[1].block_table_len = 32;
  rq[1].flags = 0x4u;
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  rq[1].flags = 0;
  rq[1].struct_size = sizeof rq[1] - 4;
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_STRUCT_SIZE);
  rq[1].struct_size = sizeof rq[1];
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E + 1, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_MISMATCH);
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E, rq, 0, NULL, ids, cnt, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E, rq, 8, NULL, ids, NULL, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_retrieve_inject(NULL, f->q, 2, E, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_retrieve_inject(f->ia, f->q, -1, E, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  float nan_q[2 * E];
  memcpy(nan_q, f->q, sizeof nan_q);
  nan_q[E + 3] = NAN;
  assert_status(kvi_retrieve_inject(f->ia, nan_q, 2, E, rq, 8, NULL, ids, cnt, tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
  so.out_memory = KVI_MEMORY_DEVICE;
  assert_status(kvi_retrieve_inject(f->ia, f->q, 2, E, rq, 8, &so, ids, cnt, tok, NULL), KVI_ERR_MEMORY_KIND);
  for (size_t i = 0; i < cache_floats(); i++) assert_true(f->cache_a[i] == -7.0f);
  assert_int_equal(cnt[0], -5);
  assert_int_equal(tok[1], -5);
  assert_ok(kvi_retrieve_inject(f->ia, f->q, 0, E, NULL, 8, NULL, NULL, NULL, NULL, NULL)); /* nothing to do */
}

/* The reserve: room for min(k, facts) facts of the longest size the tenant
 * has held, exactly; removing its longest fact does not lower it. */
static void test_reserve(void **state) {
  fx *f = *state;
  uint64_t ids[16];
  int32_t cnt, tok;
  /* tenant 5: two facts of 3 tokens and one of 9 (BS 4) */
  const int sizes[3] = {3, 9, 3};
  for (int i = 0; i < 3; i++) {
    const int T = sizes[i];
    const size_t n = (size_t)L * T * H * D;
    float *k = calloc(n, sizeof *k), *v = calloc(n, sizeof *v), e[E];
    for (int j = 0; j < E; j++) e[j] = (float)(j + i);
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, v);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = e;
    assert_ok(kvi_store_put(f->s, 5, 500 + (uint64_t)i, &kv, &po, NULL));
    free(k);
    free(v);
  }
  /* k = 2: 2 x 9 tokens from slot 1 need slots 1..18, blocks 0..4 */
  kvi_retrieve_request r = req(5, table0, 1, 0, 0);
  r.block_table_len = 4;
  for (size_t i = 0; i < cache_floats(); i++) f->cache_a[i] = -7.0f;
  assert_status(kvi_retrieve_inject(f->ia, f->q, 1, E, &r, 2, NULL, ids, &cnt, &tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_non_null(strstr(kvi_last_error(), "request 0"));
  for (size_t i = 0; i < cache_floats(); i++) assert_true(f->cache_a[i] == -7.0f);
  r.block_table_len = 5;
  assert_ok(kvi_retrieve_inject(f->ia, f->q, 1, E, &r, 2, NULL, ids, &cnt, &tok, NULL));
  assert_int_equal(cnt, 2);
  /* removing the 9-token fact leaves the reserve where it was */
  assert_ok(kvi_store_remove(f->s, 5, 501));
  r.block_table_len = 2; /* enough for 2 x 3 tokens, not for 2 x 9 */
  assert_status(kvi_retrieve_inject(f->ia, f->q, 1, E, &r, 2, NULL, ids, &cnt, &tok, NULL), KVI_ERR_INVALID_ARGUMENT);
  r.block_table_len = 5;
  assert_ok(kvi_retrieve_inject(f->ia, f->q, 1, E, &r, 2, NULL, ids, &cnt, &tok, NULL));
  assert_int_equal(tok, 6);
  /* the transfer limits apply to the reserve (18 tokens), not to the 6 injected */
  void *layers[L];
  for (int l = 0; l < L; l++) layers[l] = f->cache_b + (size_t)l * 2 * NB * BS * H * D;
  kvi_cache_layout cl;
  assert_ok(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_FP32, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_HOST;
  kvi_transfer_options to = KVI_TRANSFER_OPTIONS_INIT;
  to.max_tokens_per_call = 17;
  kvi_injector *small = NULL;
  assert_ok(kvi_injector_create(&small, f->s, &cl, &to));
  assert_status(kvi_retrieve_inject(small, f->q, 1, E, &r, 2, NULL, ids, &cnt, &tok, NULL), KVI_ERR_CAPACITY);
  kvi_injector_destroy(small);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_equals_search_then_inject, setup, teardown),
      cmocka_unit_test_setup_teardown(test_order_flag, setup, teardown),
      cmocka_unit_test_setup_teardown(test_failures_write_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(test_reserve, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
