/*
 * internal-store: the store's all-or-nothing put (kvi__store_put_views:
 * a put the tensor-parallel gate refuses, or one that runs out of pages
 * part way, leaves the free stack, the facts, the tenants and their
 * embedding rows exactly as they were), the tiered store's LRU list
 * (kvi__store_touch) against a list model, the write transaction (a
 * failure at each step, from kvi__txn_add to the gate, leaves the pool, the
 * LRU list, the index and the journal as they were; a commit becomes
 * visible at once), leases (a pinned fact is never a tier move's victim)
 * and a remove's deferred frees (its pages free before it returns when
 * the tracked device work has completed).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <unistd.h>

#include "unit.h"

#include "store/store.h"
#include "store/store_impl.h" /* kvi__tier_lru_remove */

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
    kvi__put_item x = {tenant[i], id[i], &v[i], KVI_PUT_REPLACE, e, NULL, NULL, 0};
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

/* Tier q's list from head to tail equals model[0..n) (most recent first),
 * and its back links, tail, list marks and in_lru flags agree. */
static void check_list(const kvi_store *s, int q, fact *const *model, int n) {
  const fact *prev = NULL, *f = s->tier.lru_head[q];
  for (int i = 0; i < n; i++, prev = f, f = f->lru_next) {
    if (f != model[i]) fail_msg("tier %d's LRU position %d holds fact %lld, expected %lld", q, i,
                                f ? (long long)f->id : -1LL, (long long)model[i]->id);
    assert_true(f->lru_prev == prev);
    assert_true(f->in_lru);
    assert_int_equal(f->lru_list, q);
  }
  assert_null(f);
  assert_true(s->tier.lru_tail[q] == (n ? model[n - 1] : NULL));
}

/* Both tiers' lists against model[0..n) (every listed fact, most recent
 * first, whatever its tier): each tier's list is the model's facts of that
 * tier in the model's order; in_lru is set for the listed facts only. */
static void check_lru(const kvi_store *s, fact *const *model, int n, const fact *all, int nall) {
  for (int q = 0; q < 2; q++) {
    fact *sub[64];
    int k = 0;
    for (int i = 0; i < n; i++)
      if ((model[i]->pages[0] >= s->pool.dev.npages) == (q == 1)) sub[k++] = model[i];
    check_list(s, q, sub, k);
  }
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
    int at = 0; /* to the front of the model (of its tier's list) */
    while (at < n && model[at] != x) at++;
    if (at == n) n++;
    memmove(model + 1, model, (size_t)at * sizeof *model);
    model[0] = x;
    check_lru(s, model, n, f, NF);
  }
  assert_int_equal(n, NF);
  /* demotions take device-tier facts only, least recently used first; the
   * count stops at its cap */
  fact *v[NF];
  assert_int_equal(kvi__store_evictable(s, UINT64_MAX), NF - NF / 4);
  assert_int_equal(kvi__store_evictable(s, 3), 3);
  assert_int_equal(kvi__store_evictable(s, 0), 0);
  assert_int_equal(kvi__store_victims(s, 1000, v), NF - NF / 4);
  for (int i = n - 1, k = 0; i >= 0; i--)
    if (model[i]->pages[0] < s->pool.dev.npages) assert_true(v[k++] == model[i]);
  /* a demoted fact (its pages now on the host tier) moves to the front of
   * the host tier's list when touched; a promoted one to the device's */
  fact *moved = v[0];
  uint32_t host_page = 140;
  moved->pages = &host_page;
  kvi__store_touch(s, moved);
  int at = 0;
  while (model[at] != moved) at++;
  memmove(model + 1, model, (size_t)at * sizeof *model);
  model[0] = moved;
  check_lru(s, model, n, f, NF);
  assert_true(s->tier.lru_head[1] == moved);
  assert_int_equal(kvi__store_evictable(s, UINT64_MAX), NF - NF / 4 - 1);
  uint32_t dev_page = 60;
  moved->pages = &dev_page;
  kvi__store_touch(s, moved);
  check_lru(s, model, n, f, NF);
  assert_true(s->tier.lru_head[0] == moved);
  kvi__tier_lru_remove(s, moved);
  assert_false(moved->in_lru);
  memmove(model, model + 1, (size_t)(n - 1) * sizeof *model);
  check_lru(s, model, n - 1, f, NF);
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
  assert_null(flat->tier.lru_head[0]);
  assert_false(g.in_lru);
  free(flat);
  free(s);
}

/* ------------------------------------------------------------------------ */
/* the write transaction                                                     */
/* ------------------------------------------------------------------------ */

/* A journal hook between the store and persist.c's: it counts what it is
 * asked, can fail the next put (the journal then untouched), and records
 * what a put sees of the store. */
typedef struct hook_probe {
  const kvi__journal_ops *real;
  void *real_ctx;
  int puts, passed;
  bool fail;
  int new_visible;        /* facts of the transaction's new keys found in the store when it was asked */
  int32_t replaced_tokens; /* the tokens of (1, 0) it found */
} hook_probe;

static kvi_status hook_put(void *ctx, const kvi__txn *t) {
  hook_probe *h = ctx;
  h->puts++;
  h->new_visible = 0;
  for (int32_t i = 0; i < t->n; i++) {
    const fact *f = kvi__store_find(t->s, t->facts[i].tenant, t->facts[i].id);
    if (t->facts[i].tenant == 1 && t->facts[i].id == 0) h->replaced_tokens = f ? f->tokens : -1;
    else if (f) h->new_visible++;
  }
  if (h->fail) {
    h->fail = false;
    return kvi__fail(KVI_ERR_IO, t->fn, "a journal failure the test injects");
  }
  h->passed++;
  return h->real->put(h->real_ctx, t);
}

static kvi_status hook_remove(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn) {
  hook_probe *h = ctx;
  return h->real->remove(h->real_ctx, s, tenant, id, flags, fn);
}

static void hook_release(void *ctx) {
  hook_probe *h = ctx;
  h->real->release(h->real_ctx);
}

static const kvi__journal_ops hook_ops = {hook_put, hook_remove, hook_release};

static void hook_install(kvi_store *s, hook_probe *h) {
  memset(h, 0, sizeof *h);
  h->real = s->journal.ops;
  h->real_ctx = s->journal.ctx;
  assert_non_null(h->real);
  s->journal.ops = &hook_ops;
  s->journal.ctx = h;
}

static void hook_remove_probe(kvi_store *s, const hook_probe *h) {
  s->journal.ops = h->real;
  s->journal.ctx = h->real_ctx;
}

/* Where a transaction is made to fail. */
typedef enum fail_at { AT_NONE, AT_ADD, AT_EXISTS, AT_PAGES, AT_WRITE, AT_JOURNAL, AT_GATE } fail_at;

/* One transaction of n facts (data from tag 100 + i, embeddings 100 + i +
 * j), through the steps a put takes, failing at `at`: AT_ADD fails the last
 * add's row reservation (a latched embedding failure, as a dead context
 * leaves), AT_EXISTS and AT_PAGES expect the caller's last item to fail when
 * the pages are taken (an existing key without KVI_PUT_REPLACE, a fact too
 * large for the free pages); AT_WRITE fails the caller's work on the pages
 * after it wrote them; AT_JOURNAL arms the hook; AT_GATE has the gate
 * refuse. Returns the transaction's status. */
static kvi_status txn_run(kvi_store *s, hook_probe *h, fail_at at, int32_t n, const uint64_t *tenant,
                          const uint64_t *id, const int32_t *tokens, const uint32_t *flags, gate_probe *g) {
  kvbuf b[8];
  kvi_kv_view v[8];
  assert_true(n <= 8);
  for (int32_t i = 0; i < n; i++) {
    kvbuf_make(&b[i], LAYOUT_CONTIG, KVI_DTYPE_FP32, L, tokens[i], H, D);
    kvbuf_fill_tag(&b[i], 100 + (uint64_t)i);
    assert_ok(kvi__view_check(&v[i], &b[i].v, &s->geom, false, "test"));
  }
  g->answer = at == AT_GATE ? KVI_ERR_PEER : KVI_OK;
  h->fail = at == AT_JOURNAL;
  kvi__store_lock(s);
  kvi__txn t;
  kvi_status st = kvi__txn_begin(&t, s, n, KVI__PLACE_ANY, &g->g, NULL, "test");
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    float *e = malloc(EMB * sizeof *e);
    assert_non_null(e);
    for (int j = 0; j < EMB; j++) e[j] = (float)(100 + i + j);
    if (at == AT_ADD && i == n - 1) s->emb.err = KVI_ERR_CUDA;
    st = kvi__txn_add(&t, tenant[i], id[i], tokens[i], flags[i], e);
    s->emb.err = KVI_OK;
  }
  if (at == AT_ADD) assert_int_equal(st, KVI_ERR_CUDA);
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  if (at == AT_EXISTS) assert_int_equal(st, KVI_ERR_EXISTS);
  if (at == AT_PAGES) assert_int_equal(st, KVI_ERR_CAPACITY);
  for (int32_t i = 0; i < n && st == KVI_OK; i++)
    st = kvi__store_write_pages(s, kvi__txn_pages(&t, i), &v[i], NULL, NULL, "test");
  if (st == KVI_OK && at == AT_WRITE) st = kvi__fail(KVI_ERR_CUDA, "test", "device work the test fails");
  st = st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
  kvi__store_unlock(s);
  for (int32_t i = 0; i < n; i++) kvbuf_free(&b[i]);
  return st;
}

/* What a failed transaction must leave as it was, beyond the snapshot. */
typedef struct txn_snapshot {
  snapshot sn;
  uint64_t journal_bytes;
  int journal_puts;
  const fact *lru_head[2], *lru_tail[2];
} txn_snapshot;

static void txn_take(txn_snapshot *ts, const kvi_store *s, const char *path, const hook_probe *h) {
  take(&ts->sn, s);
  ts->journal_bytes = file_size(path);
  ts->journal_puts = h->passed;
  for (int q = 0; q < 2; q++) ts->lru_head[q] = s->tier.lru_head[q], ts->lru_tail[q] = s->tier.lru_tail[q];
}

static void txn_check_same(const txn_snapshot *ts, const kvi_store *s, const char *path, const hook_probe *h,
                           const char *what) {
  check_same(&ts->sn, s, what);
  if (file_size(path) != ts->journal_bytes)
    fail_msg("%s: the journal has %llu bytes, %llu before", what, (unsigned long long)file_size(path),
             (unsigned long long)ts->journal_bytes);
  assert_int_equal(h->passed, ts->journal_puts);
  for (int q = 0; q < 2; q++)
    assert_true(s->tier.lru_head[q] == ts->lru_head[q] && s->tier.lru_tail[q] == ts->lru_tail[q]);
  /* the stored facts keep their data, the new keys are absent, no empty tenant 7 stays */
  for (uint64_t i = 0; i < 6; i++)
    if (i != 1 && i != 4) check_one((kvi_store *)s, 1, i, 1 + (int32_t)i * 2, i);
  int32_t t = 0;
  assert_status(kvi_store_fact_tokens(s, 1, 40, &t), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_fact_tokens(s, 7, 3, &t), KVI_ERR_NOT_FOUND);
  float q[EMB] = {1, 1, 1, 1, 1, 1, 1, 1};
  uint64_t ids[4];
  float scores[4];
  int32_t counts[1] = {-1};
  const uint64_t t7 = 7;
  assert_ok(kvi_store_search((kvi_store *)s, q, 1, EMB, &t7, 4, ids, scores, counts, NULL, NULL));
  assert_int_equal(counts[0], 0);
}

static int journal_dir(char *dir, size_t cap, char *path, size_t pcap) {
  const char *tmp = getenv("TMPDIR");
  snprintf(dir, cap, "%s/kvi-txn-XXXXXX", tmp && *tmp ? tmp : "/tmp");
  if (!mkdtemp(dir)) return -1;
  snprintf(path, pcap, "%s/store.kvi", dir);
  return 0;
}

static void test_txn_abort_at_each_step(void **state) {
  (void)state;
  kvi_model *m;
  kvi_store *s = emb_store(&m);
  char dir[256], path[300];
  assert_int_equal(journal_dir(dir, sizeof dir, path, sizeof path), 0);
  for (uint64_t i = 0; i < 6; i++) put_one(s, 1, i, 1 + (int32_t)i * 2, i);
  assert_ok(kvi_store_journal_open(s, path, 0));
  assert_ok(kvi_store_remove(s, 1, 1)); /* a fragmented free stack, journaled */
  assert_ok(kvi_store_remove(s, 1, 4));
  hook_probe h;
  hook_install(s, &h);
  gate_probe g = {{probe_decide}, KVI_OK, s, 0, 0};
  /* a replacement (1, 0), a new fact of tenant 1, a new tenant 7; then the
   * item that fails AT_ADD, AT_EXISTS (an existing key, no KVI_PUT_REPLACE)
   * or AT_PAGES (more pages than are free) */
  const uint64_t tenant[4] = {1, 1, 7, 1}, id[4] = {0, 40, 3, 2};
  const int32_t tokens[4] = {9, 5, 3, 3}, big[4] = {9, 5, 3, P * PAGES};
  const uint32_t flags[4] = {KVI_PUT_REPLACE, 0, 0, 0}, replace[4] = {KVI_PUT_REPLACE, 0, 0, KVI_PUT_REPLACE};
  static const struct {
    fail_at at;
    kvi_status want;
    int32_t n;
    const char *what;
  } cases[] = {
      {AT_ADD, KVI_ERR_CUDA, 4, "a transaction whose last row could not be reserved"},
      {AT_EXISTS, KVI_ERR_EXISTS, 4, "a transaction whose last fact exists"},
      {AT_PAGES, KVI_ERR_CAPACITY, 4, "a transaction short of pages"},
      {AT_WRITE, KVI_ERR_CUDA, 3, "a transaction whose device work failed"},
      {AT_JOURNAL, KVI_ERR_IO, 3, "a transaction the journal refused"},
      {AT_GATE, KVI_ERR_PEER, 3, "a transaction the gate refused"},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    txn_snapshot ts;
    txn_take(&ts, s, path, &h);
    const int calls = g.calls, puts = h.puts;
    const kvi_status st = txn_run(s, &h, cases[c].at, cases[c].n, tenant, id, cases[c].at == AT_PAGES ? big : tokens,
                                  cases[c].at == AT_EXISTS ? flags : replace, &g);
    assert_int_equal(st, cases[c].want);
    txn_check_same(&ts, s, path, &h, cases[c].what);
    assert_int_equal(g.calls, calls + 1); /* the gate is asked once, whatever failed */
    /* the journal is asked only after the gate agreed */
    assert_int_equal(h.puts, puts + (cases[c].at == AT_JOURNAL ? 1 : 0));
    free(ts.sn.free);
  }
  /* the same transaction, nothing failing: committed, and journaled */
  const uint64_t before = file_size(path);
  assert_ok(txn_run(s, &h, AT_NONE, 3, tenant, id, tokens, flags, &g));
  for (int i = 0; i < 3; i++) check_one(s, tenant[i], id[i], tokens[i], 100 + (uint64_t)i);
  assert_true(file_size(path) > before);
  assert_int_equal(h.passed, 1);
  /* the journal holds the committed facts and nothing of the aborted ones */
  hook_remove_probe(s, &h);
  kvi_store_stats want = store_stats(s);
  kvi_store_destroy(s);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, (uint64_t)P * L * 2 * H * D * 4 * PAGES);
  o.embedding_dim = EMB;
  kvi_store *back = NULL;
  assert_ok(kvi_store_load(&back, m, &o, path, NULL));
  const kvi_store_stats got = store_stats(back);
  assert_int_equal(got.facts, want.facts);
  assert_int_equal(got.tenants, want.tenants);
  for (int i = 0; i < 3; i++) check_one(back, tenant[i], id[i], tokens[i], 100 + (uint64_t)i);
  for (uint64_t i = 2; i < 6; i++)
    if (i != 4) check_one(back, 1, i, 1 + (int32_t)i * 2, i);
  kvi_store_destroy(back);
  unlink(path);
  rmdir(dir);
  kvi_model_destroy(m);
}

/* The gate's view of a committing transaction: its new facts are not yet
 * visible when the gate and the journal are asked, all are after. */
typedef struct seen_gate {
  gate_probe p;
  int new_visible;
} seen_gate;

static kvi_status seen_decide(kvi__gate *g, kvi_status local) {
  seen_gate *sg = (seen_gate *)g;
  sg->new_visible = (kvi__store_find(sg->p.s, 1, 40) != NULL) + (kvi__store_find(sg->p.s, 7, 3) != NULL);
  return probe_decide(g, local);
}

static void test_txn_commit_is_atomic(void **state) {
  (void)state;
  kvi_model *m;
  kvi_store *s = emb_store(&m);
  char dir[256], path[300];
  assert_int_equal(journal_dir(dir, sizeof dir, path, sizeof path), 0);
  put_one(s, 1, 0, 1, 0);
  assert_ok(kvi_store_journal_open(s, path, 0));
  hook_probe h;
  hook_install(s, &h);
  const uint64_t tenant[3] = {1, 1, 7}, id[3] = {0, 40, 3};
  const int32_t tokens[3] = {9, 5, 3};
  const uint32_t flags[3] = {KVI_PUT_REPLACE, 0, 0};
  seen_gate g = {{{seen_decide}, KVI_OK, s, 0, 0}, -1};
  const uint32_t nfree = s->pool.dev.nfree;
  assert_ok(txn_run(s, &h, AT_NONE, 3, tenant, id, tokens, flags, &g.p));
  assert_int_equal(g.new_visible, 0);
  assert_int_equal(h.new_visible, 0);
  assert_int_equal(h.replaced_tokens, 1); /* the old (1, 0), still whole */
  assert_int_equal(g.p.nfree_seen, nfree - (3 + 2 + 1)); /* the pages were taken before the gate was asked */
  for (int i = 0; i < 3; i++) check_one(s, tenant[i], id[i], tokens[i], 100 + (uint64_t)i);
  assert_int_equal(s->pool.dev.nfree, nfree - (3 + 2 + 1) + 1); /* and (1, 0)'s old page is free */
  size_t n = 0;
  assert_ok(kvi_store_count(s, 7, &n));
  assert_int_equal(n, 1);
  hook_remove_probe(s, &h);
  kvi_store_destroy(s);
  unlink(path);
  rmdir(dir);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* leases                                                                    */
/* ------------------------------------------------------------------------ */

static void test_lease_blocks_eviction(void **state) {
  (void)state;
  kvi_store *s = calloc(1, sizeof *s); /* a tiered store's tier fields only; the device tier full */
  assert_non_null(s);
  s->pool.dev.npages = 100;
  s->pool.host.npages = 50;
  fact f[6];
  uint32_t pg[6][2];
  memset(f, 0, sizeof f);
  for (int i = 0; i < 6; i++) {
    f[i].id = (uint64_t)i;
    f[i].npages = 2;
    pg[i][0] = 2 * (uint32_t)i, pg[i][1] = 2 * (uint32_t)i + 1;
    f[i].pages = pg[i];
    kvi__store_touch(s, &f[i]); /* f[0] the least recently used */
  }
  fact *v[6];
  assert_int_equal(kvi__store_evictable(s, UINT64_MAX), 12);
  assert_int_equal(kvi__store_victims(s, 4, v), 2);
  assert_true(v[0] == &f[0] && v[1] == &f[1]);
  /* a reader's lease on f[0] (named twice) and f[2] */
  fact *lease[3] = {&f[0], &f[2], &f[0]};
  assert_ok(kvi__store_lease(s, lease, 3, false, NULL, "test"));
  assert_int_equal(f[0].pins, 2);
  assert_int_equal(f[2].pins, 1);
  assert_int_equal(kvi__store_evictable(s, UINT64_MAX), 8);
  assert_int_equal(kvi__store_victims(s, 4, v), 2);
  assert_true(v[0] == &f[1] && v[1] == &f[3]);
  assert_int_equal(kvi__store_victims(s, 1000, v), 4); /* all it may take: never a leased fact */
  for (int i = 0; i < 4; i++) assert_true(v[i] != &f[0] && v[i] != &f[2]);
  /* the lease's end: unpinned, and (used) the most recent, the first named first */
  kvi__store_unlease(s, lease, 3, true);
  assert_int_equal(f[0].pins, 0);
  assert_int_equal(f[2].pins, 0);
  assert_int_equal(kvi__store_evictable(s, UINT64_MAX), 12);
  const int order[6] = {0, 2, 5, 4, 3, 1};
  const fact *at = s->tier.lru_head[0];
  for (int i = 0; i < 6; i++, at = at->lru_next) assert_true(at == &f[order[i]]);
  assert_null(at);
  /* a lease whose call failed: unpinned, the order kept */
  fact *one[1] = {&f[3]};
  assert_ok(kvi__store_lease(s, one, 1, false, NULL, "test"));
  assert_int_equal(kvi__store_evictable(s, UINT64_MAX), 10);
  kvi__store_unlease(s, one, 1, false);
  at = s->tier.lru_head[0];
  for (int i = 0; i < 6; i++, at = at->lru_next) assert_true(at == &f[order[i]]);
  /* a store without a host tier leases nothing */
  kvi_store *flat = calloc(1, sizeof *flat);
  assert_non_null(flat);
  flat->pool.dev.npages = 100;
  fact g;
  memset(&g, 0, sizeof g);
  fact *gl[1] = {&g};
  assert_ok(kvi__store_lease(flat, gl, 1, true, NULL, "test"));
  assert_int_equal(g.pins, 0);
  kvi__store_unlease(flat, gl, 1, true);
  free(flat);
  free(s);
}

/* ------------------------------------------------------------------------ */
/* deferred frees                                                            */
/* ------------------------------------------------------------------------ */

/* A remove on a CUDA store frees the fact's pages after the device work the
 * store tracks (kvi__pool_release defers them to the next event number).
 * That work was only found complete when a later put looked for room, so
 * after an injection (tracked, long over) a remove left its pages counted
 * in pages_used, device idle, until the next put. A remove now finds the
 * tracked work complete and returns them at once. Here a CPU store plays a
 * CUDA one whose tracker has one recorded event that has completed (the
 * CPU build's stub reports every event complete; a CUDA build uses an event
 * never recorded, which reports complete, and skips without a device). */
static void test_remove_frees_after_completed_work(void **state) {
  (void)state;
  struct CUevent_st *ev = NULL;
  int devices = 0;
  if (kvi_cuda_device_count(&devices) != KVI_ERR_NOT_BUILT) {
    if (devices == 0) skip();
    assert_ok(kvi__cuda_event_create(&ev, "test"));
  }
  kvi_model *m = make_model(L, H, D, 0, 1);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, (uint64_t)P * L * 2 * H * D * 4 * PAGES);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 3 * P, H, D);
  kvbuf_fill_tag(&b, 7);
  for (uint64_t id = 1; id <= 3; id++) assert_ok(kvi_store_put(s, 1, id, &b.v, NULL, NULL));
  kvbuf_free(&b);
  assert_int_equal(store_stats(s).pages_used, 9);
  /* a CPU store frees at once */
  assert_ok(kvi__store_remove(s, 1, 3, 0, "test"));
  assert_int_equal(store_stats(s).pages_used, 6);
  /* the CUDA store: one tracked operation, complete, not yet found so */
  struct CUevent_st *evs[1] = {ev};
  uint32_t dpage[PAGES];
  uint64_t dtag[PAGES];
  s->backend = KVI_BACKEND_CUDA;
  s->track.ev = evs, s->track.n = 1, s->track.next = 1, s->track.done = 0;
  s->deferred_page = dpage, s->deferred_tag = dtag, s->ndeferred = 0;
  assert_ok(kvi__store_remove(s, 1, 2, 0, "test"));
  const uint32_t waiting = s->ndeferred;
  const uint64_t used = store_stats(s).pages_used;
  const uint64_t done = s->track.done;
  s->backend = KVI_BACKEND_CPU;
  memset(&s->track, 0, sizeof s->track);
  s->deferred_page = NULL, s->deferred_tag = NULL, s->ndeferred = 0;
  if (waiting != 0 || used != 3)
    fail_msg("after a remove with no device work in flight, %u pages wait and pages_used is %llu (expected 0 and 3)",
             waiting, (unsigned long long)used);
  assert_int_equal(done, 1);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  kvi__cuda_event_destroy(ev);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_gate_refusal_rolls_back),
      cmocka_unit_test(test_capacity_rolls_back),
      cmocka_unit_test(test_lru_order),
      cmocka_unit_test(test_txn_abort_at_each_step),
      cmocka_unit_test(test_txn_commit_is_atomic),
      cmocka_unit_test(test_lease_blocks_eviction),
      cmocka_unit_test(test_remove_frees_after_completed_work),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
