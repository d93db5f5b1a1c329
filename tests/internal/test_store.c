/*
 * internal-store: the store's all-or-nothing put (kvi__store_put_views:
 * a put the tensor-parallel gate refuses, or one that runs out of pages
 * part way, leaves the free stack, the facts, the tenants and their
 * embedding rows exactly as they were) and the tiered store's LRU list
 * (kvi__store_touch) against a list model.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#include "store_internal.h"

#define L 2
#define H 2
#define D 4
#define P 4
#define PAGES 24
#define EMB 8

/* ------------------------------------------------------------------------ */
/* rollback                                                                  */
/* ------------------------------------------------------------------------ */

typedef struct gate_probe {
  kvi__gate g;
  kvi_status answer; /* what the gate decides when the call itself succeeded */
  kvi_store *s;
  uint32_t nfree_seen; /* free pages when it was asked */
  int calls;
} gate_probe;

static kvi_status probe_decide(kvi__gate *g, kvi_status local) {
  gate_probe *p = (gate_probe *)g;
  p->calls++;
  p->nfree_seen = p->s->pool.dev.nfree;
  return local != KVI_OK ? local : p->answer;
}

/* What a put must leave unchanged when it fails. */
typedef struct snapshot {
  uint32_t nfree;
  uint32_t *free; /* the free stack, in order */
  kvi_store_stats stats;
  size_t tenants, facts;
} snapshot;

static void take(snapshot *sn, const kvi_store *s) {
  sn->nfree = s->pool.dev.nfree;
  sn->free = malloc((s->pool.dev.nfree + 1) * sizeof *sn->free);
  assert_non_null(sn->free);
  memcpy(sn->free, s->pool.dev.free, s->pool.dev.nfree * sizeof *sn->free);
  sn->stats = store_stats(s);
  sn->tenants = s->index.tenants.len;
  sn->facts = s->index.facts.len;
}

static void check_same(const snapshot *sn, const kvi_store *s, const char *what) {
  if (s->pool.dev.nfree != sn->nfree) fail_msg("%s: %u pages free, %u before", what, s->pool.dev.nfree, sn->nfree);
  for (uint32_t i = 0; i < sn->nfree; i++)
    if (s->pool.dev.free[i] != sn->free[i])
      fail_msg("%s: free stack entry %u is page %u, was %u", what, i, s->pool.dev.free[i], sn->free[i]);
  const kvi_store_stats now = store_stats(s);
  if (now.facts != sn->stats.facts || now.tenants != sn->stats.tenants || now.pages_used != sn->stats.pages_used ||
      now.bytes_payload != sn->stats.bytes_payload)
    fail_msg("%s: stats changed (facts %llu -> %llu, tenants %llu -> %llu, pages %llu -> %llu)", what,
             (unsigned long long)sn->stats.facts, (unsigned long long)now.facts,
             (unsigned long long)sn->stats.tenants, (unsigned long long)now.tenants,
             (unsigned long long)sn->stats.pages_used, (unsigned long long)now.pages_used);
  assert_int_equal(s->index.tenants.len, sn->tenants);
  assert_int_equal(s->index.facts.len, sn->facts);
}

/* Puts (tenant, id): T tokens of data from tag, embedding e_i = tag + i. */
static void put_one(kvi_store *s, uint64_t tenant, uint64_t id, int32_t T, uint64_t tag) {
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, H, D);
  kvbuf_fill_tag(&b, tag);
  float e[EMB];
  for (int i = 0; i < EMB; i++) e[i] = (float)(tag + (uint64_t)i);
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.embedding = e;
  o.flags = KVI_PUT_REPLACE;
  assert_ok(kvi_store_put(s, tenant, id, &b.v, &o, NULL));
  kvbuf_free(&b);
}

/* The fact (tenant, id) holds tag's data (fp32 store: exactly) and tag's
 * embedding is its search's best match with score sum (tag+i)^2. */
static void check_one(kvi_store *s, uint64_t tenant, uint64_t id, int32_t T, uint64_t tag) {
  kvbuf want, got;
  kvbuf_make(&want, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, H, D);
  kvbuf_fill_tag(&want, tag);
  kvbuf_make(&got, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, H, D);
  assert_ok(kvi_store_read(s, tenant, id, &got.v, NULL));
  assert_memory_equal(want.mem, got.mem, want.bytes);
  kvbuf_free(&want);
  kvbuf_free(&got);
  int32_t tokens = 0;
  assert_ok(kvi_store_fact_tokens(s, tenant, id, &tokens));
  assert_int_equal(tokens, T);
}

/* The put of n items (tenant[i], id[i], tokens[i], data from tag 100 + i)
 * through kvi__store_put_views with gate g (NULL: none). */
static kvi_status put_batch(kvi_store *s, int32_t n, const uint64_t *tenant, const uint64_t *id, const int32_t *tokens,
                            kvi__gate *g) {
  kvbuf b[8];
  kvi_kv_view v[8];
  kvi__put_item it[8];
  assert_true(n <= 8);
  for (int32_t i = 0; i < n; i++) {
    kvbuf_make(&b[i], LAYOUT_CONTIG, KVI_DTYPE_FP32, L, tokens[i], H, D);
    kvbuf_fill_tag(&b[i], 100 + (uint64_t)i);
    assert_ok(kvi__view_check(&v[i], &b[i].v, &s->geom, false, "test"));
    float *e = malloc(EMB * sizeof *e);
    assert_non_null(e);
    for (int j = 0; j < EMB; j++) e[j] = (float)(100 + i + j);
    kvi__put_item x = {tenant[i], id[i], &v[i], KVI_PUT_REPLACE, e};
    it[i] = x;
  }
  const kvi_status st = kvi__store_put_views(s, it, n, NULL, g, "test");
  for (int32_t i = 0; i < n; i++) kvbuf_free(&b[i]);
  return st;
}

static kvi_store *emb_store(kvi_model **m) {
  *m = make_model(L, H, D, 0, 1);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, (uint64_t)P * L * 2 * H * D * 4 * PAGES);
  o.embedding_dim = EMB;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, *m, &o));
  assert_int_equal(s->pool.dev.npages, PAGES);
  return s;
}

static void test_gate_refusal_rolls_back(void **state) {
  (void)state;
  kvi_model *m;
  kvi_store *s = emb_store(&m);
  /* fragment the free stack: facts put, some removed */
  for (uint64_t i = 0; i < 6; i++) put_one(s, 1, i, 1 + (int32_t)i * 2, i);
  assert_ok(kvi_store_remove(s, 1, 1));
  assert_ok(kvi_store_remove(s, 1, 4));
  /* a batch: a replacement (1, 0), a new fact of tenant 1, a new tenant 7 */
  const uint64_t tenant[3] = {1, 1, 7}, id[3] = {0, 40, 3};
  const int32_t tokens[3] = {9, 5, 3};
  snapshot sn;
  take(&sn, s);
  gate_probe g = {{probe_decide}, KVI_ERR_PEER, s, 0, 0};
  assert_status(put_batch(s, 3, tenant, id, tokens, &g.g), KVI_ERR_PEER);
  assert_int_equal(g.calls, 1);
  /* the gate was asked with the batch's pages taken (and written) */
  assert_int_equal(g.nfree_seen, sn.nfree - (3 + 2 + 1));
  check_same(&sn, s, "a put the gate refused");
  for (uint64_t i = 0; i < 6; i++)
    if (i != 1 && i != 4) check_one(s, 1, i, 1 + (int32_t)i * 2, i);
  int32_t t = 0;
  assert_status(kvi_store_fact_tokens(s, 1, 40, &t), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_fact_tokens(s, 7, 3, &t), KVI_ERR_NOT_FOUND);
  /* no empty tenant 7 stays behind: a search of it finds nothing */
  float q[EMB] = {1, 1, 1, 1, 1, 1, 1, 1};
  uint64_t ids[4];
  float scores[4];
  int32_t counts[1] = {-1};
  const uint64_t t7 = 7;
  assert_ok(kvi_store_search(s, q, 1, EMB, &t7, 4, ids, scores, counts, NULL, NULL));
  assert_int_equal(counts[0], 0);
  free(sn.free);

  /* the same batch, the gate agreeing: committed (the test sees a difference) */
  g.answer = KVI_OK;
  assert_ok(put_batch(s, 3, tenant, id, tokens, &g.g));
  for (int i = 0; i < 3; i++) check_one(s, tenant[i], id[i], tokens[i], 100 + (uint64_t)i);
  assert_int_equal(s->pool.dev.nfree, sn.nfree - (3 + 2 + 1) + 1); /* (1, 0)'s old page is free again */
  assert_ok(kvi_store_search(s, q, 1, EMB, &t7, 4, ids, scores, counts, NULL, NULL));
  assert_int_equal(counts[0], 1);
  assert_int_equal(ids[0], 3);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_capacity_rolls_back(void **state) {
  (void)state;
  kvi_model *m;
  kvi_store *s = emb_store(&m);
  for (uint64_t i = 0; i < 4; i++) put_one(s, 2, i, P * 3, i); /* 12 of 24 pages */
  assert_ok(kvi_store_remove(s, 2, 2));
  snapshot sn;
  take(&sn, s);
  /* the first items fit, the last does not: all or nothing */
  const uint64_t tenant[3] = {2, 9, 2}, id[3] = {0, 1, 50};
  const int32_t tokens[3] = {P * 4, P * 3, P * 9};
  assert_status(put_batch(s, 3, tenant, id, tokens, NULL), KVI_ERR_CAPACITY);
  check_same(&sn, s, "a put that ran out of pages");
  for (uint64_t i = 0; i < 4; i++)
    if (i != 2) check_one(s, 2, i, P * 3, i);
  int32_t t = 0;
  assert_status(kvi_store_fact_tokens(s, 9, 1, &t), KVI_ERR_NOT_FOUND);
  /* a key twice in one call: refused before anything is taken */
  const uint64_t t2[2] = {2, 2}, i2[2] = {8, 8};
  const int32_t k2[2] = {1, 2};
  assert_status(put_batch(s, 2, t2, i2, k2, NULL), KVI_ERR_INVALID_ARGUMENT);
  check_same(&sn, s, "a put naming a key twice");
  free(sn.free);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* LRU                                                                       */
/* ------------------------------------------------------------------------ */

#define NF 12

/* The list from head to tail equals model[0..n) (most recent first), and
 * its back links, tail and in_lru flags agree. */
static void check_lru(const kvi_store *s, fact *const *model, int n, const fact *all, int nall) {
  const fact *prev = NULL, *f = s->tier.lru_head;
  for (int i = 0; i < n; i++, prev = f, f = f->lru_next) {
    if (f != model[i]) fail_msg("LRU position %d holds fact %lld, expected %lld", i, f ? (long long)f->id : -1LL,
                                (long long)model[i]->id);
    assert_true(f->lru_prev == prev);
    assert_true(f->in_lru);
  }
  assert_null(f);
  assert_true(s->tier.lru_tail == (n ? model[n - 1] : NULL));
  for (int i = 0; i < nall; i++) {
    bool listed = false;
    for (int j = 0; j < n; j++) listed |= model[j] == &all[i];
    assert_int_equal(all[i].in_lru, listed);
  }
}

static void test_lru_order(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "test_lru_order");
  kvi_store *s = calloc(1, sizeof *s); /* a tiered store's tier fields only */
  assert_non_null(s);
  s->pool.dev.npages = 100; /* device tier: pages 0..99; host tier: 100.. */
  s->pool.host.npages = 50;
  fact f[NF];
  uint32_t pg[NF];
  memset(f, 0, sizeof f);
  for (int i = 0; i < NF; i++) {
    f[i].id = (uint64_t)i;
    f[i].npages = 1;
    pg[i] = i % 4 == 3 ? 100 + (uint32_t)i : (uint32_t)i; /* every fourth fact is on the host tier */
    f[i].pages = &pg[i];
  }
  fact *model[NF];
  int n = 0;
  for (int step = 0; step < 2000; step++) {
    fact *x = &f[rng_range(&r, 0, NF - 1)];
    kvi__store_touch(s, x);
    if (x->pages[0] < s->pool.dev.npages) { /* device tier: to the front */
      int at = 0;
      while (at < n && model[at] != x) at++;
      if (at == n) n++;
      memmove(model + 1, model, (size_t)at * sizeof *model);
      model[0] = x;
    }
    check_lru(s, model, n, f, NF);
  }
  assert_int_equal(n, NF - NF / 4);
  /* a store without a host tier keeps no list */
  kvi_store *flat = calloc(1, sizeof *flat);
  assert_non_null(flat);
  flat->pool.dev.npages = 100;
  fact g;
  memset(&g, 0, sizeof g);
  uint32_t gp = 0;
  g.npages = 1;
  g.pages = &gp;
  kvi__store_touch(flat, &g);
  assert_null(flat->tier.lru_head);
  assert_false(g.in_lru);
  free(flat);
  free(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gate_refusal_rolls_back),
      cmocka_unit_test(test_capacity_rolls_back),
      cmocka_unit_test(test_lru_order),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
