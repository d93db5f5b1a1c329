/*
 * unit-context: facts' contexts and stale facts (kvinject/store.h, "Context
 * and stale facts"): contexts kept by puts and captures, replaced with their
 * fact and checked against the tenant's facts; a removal makes the facts
 * computed with the removed one in context stale, transitively (or none,
 * with KVI_REMOVE_KEEP_DEPENDENTS); injections and retrievals refuse stale
 * facts with KVI_ERR_STALE and write nothing; a put again makes a fact
 * fresh; store files and journals keep contexts and stale flags.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <unistd.h>

#include "unit.h"

#include "ref64.h"
#include "rope_catalogue.h"

enum { TL = 2, TH = 2, TD = 16, TBS = 4, TNB = 16, TP = 4, TE = 4, NF = 8 };

typedef struct cenv {
  kvi_model *m;
  kvi_store *s;
  ecache c;
  kvi_injector *inj;
  kvi_encoder *enc;
  rfact f[NF + 1]; /* tenant 1, facts 1..NF */
  int32_t table[TNB];
  rng r;
} cenv;

static kvi_store_options store_opts(void) {
  const uint64_t page_bytes = (uint64_t)TP * TL * 2 * TH * TD * 4;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, TP, page_bytes * 128);
  o.embedding_dim = TE;
  return o;
}

/* Puts f with context ctx (n ids) and flags; returns the status. */
static kvi_status put_ctx(kvi_store *s, const rfact *f, const uint64_t *ctx, int32_t n, uint32_t flags) {
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, f->L, f->T, f->H, f->D, f->k, f->v);
  const float emb[TE] = {(float)f->id, 1.0f, (float)f->tenant, 0.5f};
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.flags = flags;
  o.embedding = emb;
  o.context_ids = ctx;
  o.num_context_ids = n;
  return kvi_store_put(s, f->tenant, f->id, &v, &o, NULL);
}

/* The fact's context and stale flag must be these. */
static void expect_ctx(const kvi_store *s, uint64_t tenant, uint64_t id, const uint64_t *want, int32_t n, int stale) {
  uint64_t got[16];
  int32_t num = -1, st = -1;
  assert_ok(kvi_store_fact_context(s, tenant, id, got, 16, &num, &st));
  assert_int_equal(num, n);
  assert_int_equal(st, stale);
  if (n) assert_memory_equal(got, want, (size_t)n * sizeof *want);
}

/* The tenant's stale facts must be exactly these (ascending). */
static void expect_stale(const kvi_store *s, uint64_t tenant, const uint64_t *want, size_t n) {
  uint64_t got[16];
  size_t total = 99;
  assert_ok(kvi_store_stale(s, tenant, got, 16, &total));
  assert_int_equal(total, n);
  if (n) assert_memory_equal(got, want, n * sizeof *want);
}

static int cenv_setup(void **state) {
  cenv *e = calloc(1, sizeof *e);
  assert_non_null(e);
  rng_seed(&e->r, "unit-context");
  e->m = make_model(TL, TH, TD, 0, 1);
  const kvi_rope_spec sp = rope(KVI_ROPE_NEOX, 0, 10000.0);
  for (int l = 0; l < TL; l++) assert_ok(kvi_model_set_rope(e->m, l, &sp));
  kvi_store_options o = store_opts();
  assert_ok(kvi_store_create(&e->s, e->m, &o));
  ec_make(&e->c, KVI_CACHE_VLLM_PACKED, KVI_DTYPE_FP16, TL, TH, TD, TBS, TNB, KVI_SCALE_NONE, &e->r);
  assert_ok(kvi_injector_create(&e->inj, e->s, &e->c.lay, NULL));
  assert_ok(kvi_encoder_create(&e->enc, e->s, &e->c.lay, NULL));
  for (int i = 1; i <= NF; i++) rfact_make(&e->f[i], &e->r, 1, (uint64_t)i, TL, 1 + i % 3, TH, TD, -3, 3);
  for (int i = 0; i < TNB; i++) e->table[i] = TNB - 1 - i;
  *state = e;
  return 0;
}

static int cenv_teardown(void **state) {
  cenv *e = *state;
  kvi_encoder_destroy(e->enc);
  kvi_injector_destroy(e->inj);
  kvi_store_destroy(e->s);
  kvi_model_destroy(e->m);
  ec_free(&e->c);
  for (int i = 1; i <= NF; i++) rfact_free(&e->f[i]);
  free(e);
  return 0;
}

/* The notes encoding's shape: fact i computed after facts 1..i-1. */
static void put_chain(cenv *e, int n) {
  uint64_t ctx[NF];
  for (int i = 1; i <= n; i++) {
    assert_ok(put_ctx(e->s, &e->f[i], ctx, i - 1, 0));
    ctx[i - 1] = (uint64_t)i;
  }
}

static void test_context_kept(void **state) {
  cenv *e = *state;
  put_chain(e, 4);
  const uint64_t c3[2] = {1, 2}, c4[3] = {1, 2, 3};
  expect_ctx(e->s, 1, 1, NULL, 0, 0);
  expect_ctx(e->s, 1, 3, c3, 2, 0);
  expect_ctx(e->s, 1, 4, c4, 3, 0);
  expect_stale(e->s, 1, NULL, 0);
  /* sizing and errors (nothing written past *out_num on KVI_ERR_CAPACITY) */
  uint64_t out[2] = {77, 77};
  int32_t num = -1, st = -1;
  assert_status(kvi_store_fact_context(e->s, 1, 4, out, 2, &num, &st), KVI_ERR_CAPACITY);
  assert_last_error_has("kvi_store_fact_context", "3 context ids");
  assert_true(num == 3 && st == 0 && out[0] == 77);
  assert_status(kvi_store_fact_context(e->s, 1, 4, NULL, 0, &num, NULL), KVI_ERR_CAPACITY);
  assert_ok(kvi_store_fact_context(e->s, 1, 1, NULL, 0, &num, NULL));
  assert_int_equal(num, 0);
  assert_status(kvi_store_fact_context(e->s, 1, 99, out, 2, &num, &st), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_fact_context(e->s, 2, 1, out, 2, &num, &st), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_fact_context(NULL, 1, 1, out, 2, &num, &st), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_context(e->s, 1, 1, out, 2, NULL, &st), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_context(e->s, 1, 1, out, -1, &num, &st), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_context(e->s, 1, 1, NULL, 2, &num, &st), KVI_ERR_INVALID_ARGUMENT);
  size_t total;
  assert_status(kvi_store_stale(NULL, 1, out, 2, &total), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_stale(e->s, 1, out, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_stale(e->s, 1, NULL, 2, &total), KVI_ERR_INVALID_ARGUMENT);
  assert_ok(kvi_store_stale(e->s, 42, NULL, 0, &total)); /* a tenant never seen */
  assert_int_equal(total, 0);
  /* bad contexts: refused, nothing stored */
  const kvi_store_stats before = store_stats(e->s);
  rfact g;
  rfact_make(&g, &e->r, 1, 20, TL, 3, TH, TD, -3, 3);
  const uint64_t unknown[2] = {1, 99}, self[2] = {1, 20};
  assert_status(put_ctx(e->s, &g, unknown, 2, 0), KVI_ERR_NOT_FOUND);
  assert_last_error_has("kvi_store_put", "context id 1 (99) of fact 20 names no fact of tenant 1");
  assert_status(put_ctx(e->s, &g, self, 2, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_put", "names itself");
  assert_status(put_ctx(e->s, &g, c3, -1, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_put", "num_context_ids is -1");
  assert_status(put_ctx(e->s, &g, NULL, 2, 0), KVI_ERR_INVALID_ARGUMENT);
  /* another tenant's fact of the same id is no fact of this tenant */
  rfact h;
  rfact_make(&h, &e->r, 2, 30, TL, 2, TH, TD, -3, 3);
  assert_ok(put_ctx(e->s, &h, NULL, 0, 0));
  const uint64_t other[1] = {30};
  assert_status(put_ctx(e->s, &g, other, 1, 0), KVI_ERR_NOT_FOUND);
  int32_t tok;
  assert_status(kvi_store_fact_tokens(e->s, 1, 20, &tok), KVI_ERR_NOT_FOUND);
  const kvi_store_stats after = store_stats(e->s);
  assert_int_equal(after.facts, before.facts + 1); /* tenant 2's fact only */
  assert_int_equal(after.pages_used, before.pages_used + 1);
  /* replace replaces the context; without one, none is kept */
  const uint64_t c2[1] = {2};
  assert_ok(put_ctx(e->s, &e->f[4], c2, 1, KVI_PUT_REPLACE));
  expect_ctx(e->s, 1, 4, c2, 1, 0);
  assert_ok(put_ctx(e->s, &e->f[4], NULL, 0, KVI_PUT_REPLACE));
  expect_ctx(e->s, 1, 4, NULL, 0, 0);
  /* a refused replace keeps the old context */
  assert_ok(put_ctx(e->s, &e->f[4], c4, 3, KVI_PUT_REPLACE));
  assert_status(put_ctx(e->s, &e->f[4], unknown, 2, KVI_PUT_REPLACE), KVI_ERR_NOT_FOUND);
  expect_ctx(e->s, 1, 4, c4, 3, 0);
  /* a struct of an earlier version has no context: a fact without one */
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, g.L, g.T, g.H, g.D, g.k, g.v);
  const float emb[TE] = {1, 2, 3, 4};
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.struct_size = offsetof(kvi_put_options, context_ids);
  o.embedding = emb;
  assert_ok(kvi_store_put(e->s, 1, 20, &v, &o, NULL));
  expect_ctx(e->s, 1, 20, NULL, 0, 0);
  rfact_free(&g);
  rfact_free(&h);
}

static kvi_inject_request req(const cenv *e, const uint64_t *ids, int32_t n, int64_t first_slot) {
  kvi_inject_request q;
  kvi_inject_request_init(&q, sizeof q);
  q.tenant = 1, q.fact_ids = ids, q.num_facts = n, q.block_table = e->table, q.block_table_len = TNB;
  q.first_slot = first_slot, q.start_position = 2;
  return q;
}

/* Every fact's bytes, for "the store is unchanged". */
static uint64_t store_hash(const kvi_store *s, uint64_t tenant) {
  uint64_t ids[64], h = 0xcbf29ce484222325ull;
  size_t n;
  assert_ok(kvi_store_list(s, tenant, ids, 64, &n));
  for (size_t i = 0; i < n; i++) {
    rfact g;
    rfact_read(s, tenant, ids[i], TL, TH, TD, &g);
    h = fnv_u64(h, ids[i]);
    h = fnv1a(h, g.k, (size_t)TL * g.T * TH * TD * sizeof(float));
    h = fnv1a(h, g.v, (size_t)TL * g.T * TH * TD * sizeof(float));
    rfact_free(&g);
  }
  return h;
}

/* A refused call: the status, its message, not a byte of the cache or the store changed. */
#define REFUSED(e, call, fn, needle)                                                        \
  do {                                                                                      \
    const uint64_t cache_ = ec_hash(&(e)->c), store_ = store_hash((e)->s, 1);               \
    assert_status((call), KVI_ERR_STALE);                                                   \
    assert_last_error_has((fn), (needle));                                                  \
    assert_true(ec_hash(&(e)->c) == cache_);                                                \
    assert_true(store_hash((e)->s, 1) == store_);                                           \
  } while (0)

static void test_remove_makes_stale(void **state) {
  cenv *e = *state;
  /* 1; 2 after 1; 3 after 2 only (stale through 2); 4 after 1..3; 5 alone; 6 after 5; 7 after 6 */
  const uint64_t c1[1] = {1}, c2[1] = {2}, c4[3] = {1, 2, 3}, c5[1] = {5}, c6[1] = {6};
  assert_ok(put_ctx(e->s, &e->f[1], NULL, 0, 0));
  assert_ok(put_ctx(e->s, &e->f[2], c1, 1, 0));
  assert_ok(put_ctx(e->s, &e->f[3], c2, 1, 0));
  assert_ok(put_ctx(e->s, &e->f[4], c4, 3, 0));
  assert_ok(put_ctx(e->s, &e->f[5], NULL, 0, 0));
  assert_ok(put_ctx(e->s, &e->f[6], c5, 1, 0));
  assert_ok(put_ctx(e->s, &e->f[7], c6, 1, 0));
  /* tenant 2 has a fact 1 and a fact 2 after it: untouched by tenant 1's removal */
  rfact a, b;
  rfact_make(&a, &e->r, 2, 1, TL, 2, TH, TD, -3, 3);
  rfact_make(&b, &e->r, 2, 2, TL, 2, TH, TD, -3, 3);
  assert_ok(put_ctx(e->s, &a, NULL, 0, 0));
  assert_ok(put_ctx(e->s, &b, c1, 1, 0));
  const uint64_t ids567[3] = {5, 6, 7};
  kvi_inject_request q = req(e, ids567, 3, 0);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  assert_ok(kvi_store_remove(e->s, 1, 1));
  const uint64_t s234[3] = {2, 3, 4};
  expect_stale(e->s, 1, s234, 3);
  expect_stale(e->s, 2, NULL, 0);
  expect_ctx(e->s, 1, 3, c2, 1, 1);
  expect_ctx(e->s, 1, 6, c5, 1, 0);
  expect_ctx(e->s, 2, 2, c1, 1, 0);
  assert_int_equal(store_stats(e->s).facts_stale, 3);
  /* the stale list cut short, as kvi_store_list's */
  uint64_t two[2];
  size_t total;
  assert_ok(kvi_store_stale(e->s, 1, two, 2, &total));
  assert_int_equal(total, 3);
  assert_true(two[0] == 2 && two[1] == 3);
  /* a stale fact is still readable */
  rfact g;
  rfact_read(e->s, 1, 3, TL, TH, TD, &g);
  assert_memory_equal(g.k, e->f[3].k, (size_t)TL * g.T * TH * TD * sizeof(float));
  rfact_free(&g);
  /* injections refuse it, alone or among fresh facts, in any request */
  const uint64_t only3[1] = {3}, mixed[3] = {5, 6, 4};
  q = req(e, only3, 1, 0);
  REFUSED(e, kvi_inject(e->inj, &q, 1, NULL, NULL), "kvi_inject", "fact 3 of tenant 1 is stale");
  q = req(e, mixed, 3, 4);
  REFUSED(e, kvi_inject(e->inj, &q, 1, NULL, NULL), "kvi_inject", "request 0: fact 4 of tenant 1 is stale");
  kvi_inject_request qs[2] = {req(e, ids567, 3, 0), req(e, only3, 1, 20)};
  REFUSED(e, kvi_inject(e->inj, qs, 2, NULL, NULL), "kvi_inject", "request 1: fact 3 of tenant 1 is stale");
  const int32_t foff[3] = {0, 3, 4}, boff[3] = {0, TNB / 2, TNB};
  const uint64_t bids[4] = {5, 6, 7, 2};
  kvi_inject_batch bt = KVI_INJECT_BATCH_INIT;
  bt.num_requests = 2, bt.tenant = 1, bt.fact_ids = bids, bt.fact_offsets = foff, bt.block_tables = e->table;
  bt.block_table_offsets = boff;
  REFUSED(e, kvi_inject_batched(e->inj, &bt, NULL, NULL), "kvi_inject_batched", "request 1: fact 2 of tenant 1 is stale");
  /* retrieval: the search could pick any fact of the tenant */
  kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
  rr.tenant = 1, rr.block_table = e->table, rr.block_table_len = TNB;
  const float query[TE] = {1, 0, 0, 0};
  uint64_t rids[4];
  int32_t rcnt, rtok;
  REFUSED(e, kvi_retrieve_inject(e->inj, query, 1, TE, &rr, 2, NULL, rids, &rcnt, &rtok, NULL),
          "kvi_retrieve_inject", "tenant 1 has 3 stale facts");
  rr.tenant = 2; /* a tenant without stale facts retrieves */
  assert_ok(kvi_retrieve_inject(e->inj, query, 1, TE, &rr, 2, NULL, rids, &rcnt, &rtok, NULL));
  assert_int_equal(rcnt, 2);
  /* fresh facts inject as before */
  q = req(e, ids567, 3, 0);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  /* a fact put with a stale fact in context is stale from the start */
  rfact n8;
  rfact_make(&n8, &e->r, 1, 8, TL, 2, TH, TD, -3, 3);
  const uint64_t c8[2] = {5, 3};
  assert_ok(put_ctx(e->s, &n8, c8, 2, 0));
  const uint64_t s2348[4] = {2, 3, 4, 8};
  expect_stale(e->s, 1, s2348, 4);
  /* encoding again, in order, makes them fresh: 2 without 1, 3 after the new 2 */
  assert_ok(put_ctx(e->s, &e->f[2], NULL, 0, KVI_PUT_REPLACE));
  const uint64_t s348[3] = {3, 4, 8};
  expect_stale(e->s, 1, s348, 3);
  assert_ok(put_ctx(e->s, &e->f[3], c2, 1, KVI_PUT_REPLACE));
  const uint64_t c4b[2] = {2, 3};
  assert_ok(put_ctx(e->s, &e->f[4], c4b, 2, KVI_PUT_REPLACE));
  const uint64_t c8b[2] = {5, 3};
  assert_ok(put_ctx(e->s, &n8, c8b, 2, KVI_PUT_REPLACE));
  expect_stale(e->s, 1, NULL, 0);
  assert_int_equal(store_stats(e->s).facts_stale, 0);
  q = req(e, mixed, 3, 4);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  /* removing a stale fact, or the last fact of a chain, is an ordinary removal */
  assert_ok(kvi_store_remove(e->s, 1, 5)); /* 6, 7 after it, 8 through its context */
  const uint64_t s678[3] = {6, 7, 8};
  expect_stale(e->s, 1, s678, 3);
  assert_ok(kvi_store_remove(e->s, 1, 7));
  const uint64_t s68[2] = {6, 8};
  expect_stale(e->s, 1, s68, 2);
  assert_int_equal(store_stats(e->s).facts_stale, 2);
  rfact_free(&a);
  rfact_free(&b);
  rfact_free(&n8);
}

static void test_keep_dependents(void **state) {
  cenv *e = *state;
  put_chain(e, 5);
  const kvi_store_stats before = store_stats(e->s);
  assert_status(kvi_store_remove_ex(e->s, 1, 2, 0x2u), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_remove_ex", "unknown bits 0x2");
  assert_status(kvi_store_remove_ex(NULL, 1, 2, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_remove_ex(e->s, 1, 99, KVI_REMOVE_KEEP_DEPENDENTS), KVI_ERR_NOT_FOUND);
  assert_int_equal(store_stats(e->s).facts, before.facts);
  assert_ok(kvi_store_remove_ex(e->s, 1, 2, KVI_REMOVE_KEEP_DEPENDENTS));
  expect_stale(e->s, 1, NULL, 0);
  const uint64_t all[3] = {3, 4, 5};
  kvi_inject_request q = req(e, all, 3, 0);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  /* flags 0 is kvi_store_remove; a later removal marks through contexts that name a removed id no more */
  assert_ok(kvi_store_remove_ex(e->s, 1, 3, 0));
  const uint64_t s45[2] = {4, 5};
  expect_stale(e->s, 1, s45, 2);
  /* a new fact may not name the removed fact */
  rfact g;
  rfact_make(&g, &e->r, 1, 9, TL, 2, TH, TD, -3, 3);
  const uint64_t c2[1] = {2};
  assert_status(put_ctx(e->s, &g, c2, 1, 0), KVI_ERR_NOT_FOUND);
  rfact_free(&g);
}

static kvi_capture cap(const cenv *e, uint64_t id, int64_t first, int32_t n, const uint64_t *ctx, int32_t nctx) {
  kvi_capture c;
  kvi_capture_init(&c, sizeof c);
  c.tenant = 1, c.fact_id = id, c.block_table = e->table, c.block_table_len = TNB;
  c.first_slot = first, c.num_tokens = n, c.start_position = 2 + (int32_t)first;
  static const float emb[TE] = {0.25f, 0.5f, 0.75f, 1.0f};
  c.embedding = emb;
  c.context_ids = ctx, c.num_context_ids = nctx;
  return c;
}

static void test_captures_keep_context(void **state) {
  cenv *e = *state;
  put_chain(e, 2);
  const uint64_t ids12[2] = {1, 2};
  kvi_inject_request q = req(e, ids12, 2, 0);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  const int32_t t1 = e->f[1].T, t2 = e->f[2].T;
  /* the notes encoding in one call: 11 after 1 and 2, 12 after them and 11 (captured earlier in the call) */
  const uint64_t c11[2] = {1, 2}, c12[3] = {1, 2, 11};
  kvi_capture c[2] = {cap(e, 11, 0, t1, c11, 2), cap(e, 12, t1, t2, c12, 3)};
  assert_ok(kvi_encode(e->enc, c, 2, NULL));
  expect_ctx(e->s, 1, 11, c11, 2, 0);
  expect_ctx(e->s, 1, 12, c12, 3, 0);
  /* a context naming a capture later in the call, an unknown id, itself: nothing stored */
  const uint64_t c13[1] = {14}, c14[1] = {99}, self[1] = {13};
  kvi_capture d[2] = {cap(e, 13, 0, t1, c13, 1), cap(e, 14, t1, t2, NULL, 0)};
  assert_status(kvi_encode(e->enc, d, 2, NULL), KVI_ERR_NOT_FOUND);
  assert_last_error_has("kvi_encode", "capture 0: context id 0 (14) of fact 13 names no fact of tenant 1");
  d[0].context_ids = NULL, d[0].num_context_ids = 0, d[1].context_ids = c14, d[1].num_context_ids = 1;
  assert_status(kvi_encode(e->enc, d, 2, NULL), KVI_ERR_NOT_FOUND);
  d[1].context_ids = self, d[1].num_context_ids = 1, d[1].fact_id = 13;
  d[0].fact_id = 15;
  assert_status(kvi_encode(e->enc, d, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  d[1].num_context_ids = -2;
  assert_status(kvi_encode(e->enc, d, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_encode", "capture 1: num_context_ids is -2");
  size_t n;
  assert_ok(kvi_store_count(e->s, 1, &n));
  assert_int_equal(n, 4);
  /* removal of 2 makes 11 and 12 stale; capturing them again with KVI_PUT_REPLACE after 1 only makes them fresh */
  assert_ok(kvi_store_remove(e->s, 1, 2));
  const uint64_t s1112[2] = {11, 12};
  expect_stale(e->s, 1, s1112, 2);
  const uint64_t r11[1] = {1}, r12[2] = {1, 11};
  kvi_capture r[2] = {cap(e, 11, 0, t1, r11, 1), cap(e, 12, t1, t2, r12, 2)};
  r[0].flags = r[1].flags = KVI_PUT_REPLACE;
  assert_ok(kvi_encode(e->enc, r, 2, NULL));
  expect_stale(e->s, 1, NULL, 0);
  expect_ctx(e->s, 1, 12, r12, 2, 0);
  /* the batched form: contexts as CSR */
  const uint64_t fids[2] = {21, 22}, cids[3] = {1, 1, 21};
  const int32_t ntok[2] = {2, 3}, coff[3] = {0, 1, 3};
  const int64_t first[2] = {0, 2};
  const float embs[2 * TE] = {0};
  int32_t tables[2 * TNB];
  memcpy(tables, e->table, sizeof e->table);
  memcpy(tables + TNB, e->table, sizeof e->table);
  kvi_encode_batch b = KVI_ENCODE_BATCH_INIT;
  b.num_captures = 2, b.tenant = 1, b.fact_ids = fids, b.num_tokens = ntok, b.block_tables = tables;
  b.block_table_stride = TNB, b.block_table_len = TNB, b.first_slots = first, b.embeddings = embs;
  b.context_ids = cids;
  assert_status(kvi_encode_batched(e->enc, &b, NULL), KVI_ERR_INVALID_ARGUMENT); /* offsets missing */
  assert_last_error_has("kvi_encode_batched", "context_offsets");
  const int32_t bad[3] = {0, 2, 1};
  b.context_offsets = bad;
  assert_status(kvi_encode_batched(e->enc, &b, NULL), KVI_ERR_INVALID_ARGUMENT);
  b.context_offsets = coff;
  assert_ok(kvi_encode_batched(e->enc, &b, NULL));
  expect_ctx(e->s, 1, 21, cids, 1, 0);
  expect_ctx(e->s, 1, 22, cids + 1, 2, 0);
}

/* ------------------------------------------------------------------------ */
/* store files and journals                                                 */
/* ------------------------------------------------------------------------ */

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*n);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, *n, f), *n);
  fclose(f);
  return b;
}

static void spit(const char *path, const unsigned char *b, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(b, 1, n, f), n);
  fclose(f);
}

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* CRC32C, bit by bit */
static uint32_t ref_crc32c(const unsigned char *p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
  }
  return ~c;
}

/* Rewrites a file's header as format version v (docs/store-format.md). */
static void set_version(const char *path, uint32_t v) {
  size_t n;
  unsigned char *b = slurp(path, &n);
  const uint32_t hb = le32(b + 16);
  for (int i = 0; i < 4; i++) b[8 + i] = (unsigned char)(v >> (8 * i));
  const uint32_t crc = ref_crc32c(b, hb - 4);
  for (int i = 0; i < 4; i++) b[hb - 4 + i] = (unsigned char)(crc >> (8 * i));
  spit(path, b, n);
  free(b);
}

static kvi_store *load_file(const cenv *e, const char *path, uint32_t flags, kvi_status want) {
  kvi_store_options o = store_opts();
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  lo.flags = flags;
  kvi_store *s = NULL;
  assert_status(kvi_store_load(&s, e->m, &o, path, &lo), want);
  return s;
}

static void test_files_keep_context(void **state) {
  cenv *e = *state;
  char dir[] = "/tmp/kvi-context-XXXXXX", snap[64], jour[64];
  assert_non_null(mkdtemp(dir));
  snprintf(snap, sizeof snap, "%s/snap", dir);
  snprintf(jour, sizeof jour, "%s/jour", dir);
  put_chain(e, 4);
  assert_ok(kvi_store_remove(e->s, 1, 2)); /* 3, 4 stale */
  /* a snapshot: contexts and stale flags as they were */
  assert_ok(kvi_store_save(e->s, snap, NULL));
  kvi_store *s = load_file(e, snap, 0, KVI_OK);
  const uint64_t c3[2] = {1, 2}, c4[3] = {1, 2, 3}, s34[2] = {3, 4};
  expect_ctx(s, 1, 1, NULL, 0, 0);
  expect_ctx(s, 1, 3, c3, 2, 1);
  expect_ctx(s, 1, 4, c4, 3, 1);
  expect_stale(s, 1, s34, 2);
  assert_int_equal(store_stats(s).facts_stale, 2);
  kvi_store_destroy(s);
  /* a journal: puts with contexts, a replace that makes one fresh, removals with and without dependents */
  assert_ok(kvi_store_journal_open(e->s, jour, 0));
  const uint64_t c1[1] = {1}, c5[2] = {1, 4}, c6[1] = {5}, c7[1] = {1};
  assert_ok(put_ctx(e->s, &e->f[3], c1, 1, KVI_PUT_REPLACE)); /* fresh again */
  assert_ok(put_ctx(e->s, &e->f[5], c5, 2, 0));                /* after a stale fact: stale */
  assert_ok(put_ctx(e->s, &e->f[6], c6, 1, 0));                /* after it: stale */
  assert_ok(put_ctx(e->s, &e->f[7], c7, 1, 0));
  assert_ok(put_ctx(e->s, &e->f[8], c1, 1, 0));
  assert_ok(kvi_store_remove_ex(e->s, 1, 7, KVI_REMOVE_KEEP_DEPENDENTS));
  const uint64_t c9[1] = {8};
  rfact g;
  rfact_make(&g, &e->r, 1, 9, TL, 2, TH, TD, -3, 3);
  assert_ok(put_ctx(e->s, &g, c9, 1, 0));
  assert_ok(kvi_store_remove(e->s, 1, 8)); /* 9 stale */
  const uint64_t s4569[4] = {4, 5, 6, 9};
  expect_stale(e->s, 1, s4569, 4);
  assert_ok(kvi_store_journal_close(e->s));
  s = load_file(e, jour, 0, KVI_OK);
  expect_stale(s, 1, s4569, 4);
  expect_ctx(s, 1, 3, c1, 1, 0);
  expect_ctx(s, 1, 5, c5, 2, 1);
  expect_ctx(s, 1, 9, c9, 1, 1);
  const uint64_t only4[1] = {4};
  kvi_injector *inj;
  assert_ok(kvi_injector_create(&inj, s, &e->c.lay, NULL));
  kvi_inject_request q = req(e, only4, 1, 0);
  const uint64_t before = ec_hash(&e->c);
  assert_status(kvi_inject(inj, &q, 1, NULL, NULL), KVI_ERR_STALE);
  assert_true(ec_hash(&e->c) == before);
  kvi_injector_destroy(inj);
  kvi_store_destroy(s);
  /* a context section in a version-2 file is an unknown record type */
  set_version(snap, 2);
  load_file(e, snap, 0, KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "unknown record type");
  /* a version-2 file without contexts loads: facts without context, none stale */
  kvi_store *plain = NULL;
  kvi_store_options o = store_opts();
  assert_ok(kvi_store_create(&plain, e->m, &o));
  assert_ok(put_ctx(plain, &e->f[1], NULL, 0, 0));
  assert_ok(kvi_store_save(plain, snap, NULL));
  kvi_store_destroy(plain);
  set_version(snap, 2);
  s = load_file(e, snap, 0, KVI_OK);
  expect_ctx(s, 1, 1, NULL, 0, 0);
  kvi_store_destroy(s);
  /* a stale flag other than 0 or 1 is corruption (the body's CRC made right) */
  assert_ok(kvi_store_save(e->s, snap, NULL));
  size_t n;
  unsigned char *b = slurp(snap, &n);
  const uint32_t hb = le32(b + 16);
  /* facts sorted: the second entry is fact 3 of tenant 1, with one context id */
  size_t at = hb;
  at += 48 + le32(b + at + 24); /* past the first entry (its body size in its header) */
  const size_t rec = at + 48, payload = le32(b + rec + 24);
  assert_int_equal(le32(b + rec), 0x20001u); /* PUT with a context */
  assert_int_equal(le32(b + rec + 32 + payload - 16), 1u); /* the count */
  b[rec + 32 + payload - 12] = 2; /* the stale flag */
  const uint32_t body = le32(b + at + 24), crc = ref_crc32c(b + rec, body);
  for (int i = 0; i < 4; i++) b[at + 40 + i] = (unsigned char)(crc >> (8 * i));
  const uint32_t hcrc = ref_crc32c(b + at, 44);
  for (int i = 0; i < 4; i++) b[at + 44 + i] = (unsigned char)(hcrc >> (8 * i));
  spit(jour, b, n);
  load_file(e, jour, 0, KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "stale flag 2");
  free(b);
  rfact_free(&g);
  unlink(snap);
  unlink(jour);
  rmdir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_context_kept, cenv_setup, cenv_teardown),
      cmocka_unit_test_setup_teardown(test_remove_makes_stale, cenv_setup, cenv_teardown),
      cmocka_unit_test_setup_teardown(test_keep_dependents, cenv_setup, cenv_teardown),
      cmocka_unit_test_setup_teardown(test_captures_keep_context, cenv_setup, cenv_teardown),
      cmocka_unit_test_setup_teardown(test_files_keep_context, cenv_setup, cenv_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
