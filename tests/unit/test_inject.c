/*
 * unit-inject: the Chunked-RoPE encoder and the block-table injector on the
 * CPU backend, against the float64 reference of ref64.h:
 *   - capture at positions P, inject at Q == direct rotation at Q (every
 *     scaling, NeoX/GPT-J, partial rotary, NoPE, cos/sin tables; fp32 and
 *     bf16 stores);
 *   - Context-Window Encoding: sub-ranges of longer sequences, many captures
 *     in one call;
 *   - batched injection (tenants, fact lists, tables, first slots, positions),
 *     kvi_inject_plan, layer ranges, fp8 round trips and saturation;
 *   - every rejected call leaves cache and store as they were (FNV-1a of
 *     every cache byte, the store's statistics, and every fact read back);
 *   - creation errors, transfer limits, frees on the CPU backend.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "ref64.h"
#include "rope_catalogue.h"

/* ------------------------------------------------------------------------ */
/* an environment: model, store, cache, injector, encoder                   */
/* ------------------------------------------------------------------------ */

typedef struct env {
  int32_t L, H, D;
  kvi_model *m;
  kvi_store *s;
  kvi_dtype store_dt;
  ref_rope rr[EC_MAXL];
  ecache c;
  kvi_injector *inj;
  kvi_encoder *enc;
} env;

typedef struct env_cfg {
  int32_t L, HT, tp, rank, D;
  const kvi_rope_spec *specs; /* L specs */
  kvi_dtype store_dt;
  int32_t P;
  uint32_t pages;
  kvi_cache_preset preset;
  kvi_dtype cache_dt;
  kvi_scale_mode sm;
  int32_t BS;
  int64_t NB;
  const kvi_transfer_options *to;
} env_cfg;

static void env_open(env *e, const env_cfg *g, rng *r) {
  memset(e, 0, sizeof *e);
  e->L = g->L, e->D = g->D, e->H = g->HT / (g->tp > g->HT ? g->HT : g->tp);
  if (g->tp > g->HT) e->H = 1;
  e->store_dt = g->store_dt;
  e->m = make_model(g->L, g->HT, g->D, g->rank, g->tp);
  for (int l = 0; l < g->L; l++) {
    assert_ok(kvi_model_set_rope(e->m, l, &g->specs[l]));
    ref_rope_init(&e->rr[l], &g->specs[l], g->D);
  }
  const uint64_t page_bytes = (uint64_t)g->P * g->L * 2 * e->H * g->D * kvi_dtype_size(g->store_dt);
  kvi_store_options o = cpu_store_options(g->store_dt, g->P, page_bytes * g->pages);
  assert_ok(kvi_store_create(&e->s, e->m, &o));
  ec_make(&e->c, g->preset, g->cache_dt, g->L, e->H, g->D, g->BS, g->NB, g->sm, r);
  assert_ok(kvi_injector_create(&e->inj, e->s, &e->c.lay, g->to));
  assert_ok(kvi_encoder_create(&e->enc, e->s, &e->c.lay, g->to));
}

static void env_close(env *e) {
  kvi_encoder_destroy(e->enc);
  kvi_injector_destroy(e->inj);
  kvi_store_destroy(e->s);
  kvi_model_destroy(e->m);
  for (int l = 0; l < e->L; l++) ref_rope_free(&e->rr[l]);
  ec_free(&e->c);
}

/* A copy of f with values rounded to dt (what a dt store keeps). */
static void rfact_rounded(const rfact *f, kvi_dtype dt, rfact *out) {
  *out = *f;
  const size_t n = (size_t)f->L * f->T * f->H * f->D;
  out->k = malloc(n * sizeof(float));
  out->v = malloc(n * sizeof(float));
  assert_non_null(out->k);
  assert_non_null(out->v);
  for (size_t i = 0; i < n; i++) out->k[i] = ref_round(f->k[i], dt), out->v[i] = ref_round(f->v[i], dt);
}

static kvi_inject_request request(uint64_t tenant, const uint64_t *ids, int32_t n, const int32_t *table, int32_t len,
                                  int64_t first_slot, const int32_t *positions, int32_t start_position) {
  kvi_inject_request q;
  kvi_inject_request_init(&q, sizeof q);
  q.tenant = tenant, q.fact_ids = ids, q.num_facts = n, q.block_table = table, q.block_table_len = len;
  q.first_slot = first_slot, q.positions = positions, q.start_position = start_position;
  return q;
}

static kvi_capture capture(uint64_t tenant, uint64_t id, const int32_t *table, int32_t len, int64_t first_slot,
                           int32_t n, const int32_t *positions, int32_t start_position) {
  kvi_capture c;
  kvi_capture_init(&c, sizeof c);
  c.tenant = tenant, c.fact_id = id, c.block_table = table, c.block_table_len = len, c.first_slot = first_slot;
  c.num_tokens = n, c.positions = positions, c.start_position = start_position;
  return c;
}


/* ------------------------------------------------------------------------ */
/* "nothing changed": cache bytes, store statistics, every fact's bytes     */
/* ------------------------------------------------------------------------ */

static const uint64_t snap_tenants[] = {0, 1, 2, 3, 9, 77};

static uint64_t snapshot(const env *e) {
  uint64_t h = ec_hash(&e->c);
  const kvi_store_stats st = store_stats(e->s);
  const uint64_t f[] = {(uint64_t)st.backend, (uint64_t)st.device,       (uint64_t)st.dtype,  (uint64_t)st.page_tokens,
                        (uint64_t)st.embedding_dim, st.page_bytes,        st.pages_total,      st.pages_used,
                        st.bytes_reserved,          st.bytes_used,        st.bytes_payload,    st.facts,
                        st.tenants};
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) h = fnv_u64(h, f[i]);
  for (size_t t = 0; t < sizeof snap_tenants / sizeof snap_tenants[0]; t++) {
    size_t total = 0, count = 0;
    assert_ok(kvi_store_list(e->s, snap_tenants[t], NULL, 0, &total));
    assert_ok(kvi_store_count(e->s, snap_tenants[t], &count));
    assert_int_equal(total, count);
    h = fnv_u64(fnv_u64(h, snap_tenants[t]), total);
    if (!total) continue;
    uint64_t *ids = malloc(total * sizeof *ids);
    assert_non_null(ids);
    size_t again = 0;
    assert_ok(kvi_store_list(e->s, snap_tenants[t], ids, total, &again));
    assert_int_equal(again, total);
    for (size_t i = 0; i < total; i++) {
      rfact g;
      rfact_read(e->s, snap_tenants[t], ids[i], e->L, e->H, e->D, &g);
      const size_t n = (size_t)g.L * g.T * g.H * g.D * sizeof(float);
      h = fnv_u64(fnv_u64(h, ids[i]), (uint64_t)g.T);
      h = fnv1a(fnv1a(h, g.k, n), g.v, n);
      rfact_free(&g);
    }
    free(ids);
  }
  return h;
}

#define EXPECT_UNCHANGED(e, call, want)                                                                          \
  do {                                                                                                           \
    const uint64_t before_ = snapshot(e);                                                                        \
    assert_status((call), (want));                                                                               \
    if (snapshot(e) != before_)                                                                                  \
      fail_msg("%s:%d: %s was rejected but changed the cache or the store", __FILE__, __LINE__, #call);          \
  } while (0)

/* ------------------------------------------------------------------------ */
/* capture at P, inject at Q                                                 */
/* ------------------------------------------------------------------------ */

/* Every style and scaling once, partial rotary, and a table in each float
 * dtype; a case pairs entry i with entry i + 5 (or i + 3) on another layer. */
static const rope_id invariant_ropes[] = {
    ROPE_NEOX, ROPE_GPTJ,
    ROPE_NEOX_ROTARY_12, ROPE_GPTJ_ROTARY_20,
    ROPE_LINEAR_4, ROPE_LLAMA3_1, ROPE_YARN_4, ROPE_YARN_16_GPTJ_UNTRUNCATED, ROPE_NTK_3,
    ROPE_TABLE_FP32, ROPE_TABLE_BF16, ROPE_TABLE_FP16,
};

/* Layers: config a, NoPE, config b. Put F, inject at P, capture at P into G,
 * inject G at Q; K at Q must be F's K rotated at Q, V bit-exact. */
static void invariant_case(rng *r, const rope_case *a, const rope_case *b, kvi_dtype store_dt) {
  enum { L = 3, D = 32, T = 11, BS = 8 };
  const kvi_rope_spec specs[L] = {a->s, nope(), b->s};
  const env_cfg g = {L, 2, 1, 0, D, specs, store_dt, 4, 16, KVI_CACHE_VLLM_FLASH_ATTN_HND, KVI_DTYPE_FP32,
                     KVI_SCALE_NONE, BS, 12, NULL};
  env e;
  env_open(&e, &g, r);
  char what[300];
  snprintf(what, sizeof what, "layer 0 %s, layer 2 %s, %s store", a->name, b->name, dtype_name(store_dt));
  rfact f, fq;
  rfact_make(&f, r, 3, 100, L, T, e.H, D, -3, 3);
  rfact_put(e.s, &f, 0);
  rfact_rounded(&f, store_dt, &fq); /* what the store keeps */
  const int32_t maxpos = (a->table || b->table) ? 4096 : 8000;
  int32_t perm[12], P[T], Q[T];
  rand_perm(r, perm, 12);
  const int32_t *t1 = perm, *t2 = perm + 3;
  rand_positions(r, P, T, 0, maxpos, true);
  rand_positions(r, Q, T, 0, maxpos, true);

  const uint64_t id_f = 100, id_g = 200;
  kvi_inject_request q = request(3, &id_f, 1, t1, 3, 5, P, 0);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  const rfact *ff[] = {&fq};
  ec_check_request(&e.c, e.rr, ff, 1, t1, 5, P, 0, 0, L, 0.0, NULL, what);

  kvi_capture cp = capture(3, id_g, t1, 3, 5, T, P, 0);
  assert_ok(kvi_encode(e.enc, &cp, 1, NULL));
  rfact gf;
  rfact_read(e.s, 3, id_g, L, e.H, D, &gf);
  assert_int_equal(gf.T, T);
  check_captured(&gf, &fq, 0, e.rr, &e.c, P, 0, store_dt, what);
  rfact_free(&gf);

  q = request(3, &id_g, 1, t2, 3, 2, Q, 0);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  /* against the original (rounded to the store's dtype): the capture adds at
   * most one step of the store dtype to each element of K */
  ec_check_request(&e.c, e.rr, ff, 1, t2, 2, Q, 0, 0, L, store_dt == KVI_DTYPE_FP32 ? 0.0 : 0x1p-7, NULL, what);
  rfact_free(&f);
  rfact_free(&fq);
  env_close(&e);
}

static void test_capture_inject_invariant(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  rope_case c[16];
  const int n = rope_cases(c, invariant_ropes, (int)(sizeof invariant_ropes / sizeof invariant_ropes[0]), 32);
  for (int i = 0; i < n; i++) invariant_case(&r, &c[i], &c[(i + 5) % n], KVI_DTYPE_FP32);
  rope_cases_free(c, n);
}

static void test_capture_inject_invariant_bf16_store(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  rope_case c[16];
  const int n = rope_cases(c, invariant_ropes, (int)(sizeof invariant_ropes / sizeof invariant_ropes[0]), 32);
  for (int i = 0; i < n; i++) invariant_case(&r, &c[i], &c[(i + 3) % n], KVI_DTYPE_BF16);
  rope_cases_free(c, n);
}

/* ------------------------------------------------------------------------ */
/* Context-Window Encoding                                                   */
/* ------------------------------------------------------------------------ */

/* Writes a sequence into the cache as an engine's prefill would (keys
 * rotated by the reference), from first_slot through `table`. */
static void engine_prefill(env *e, const rfact *s, const int32_t *table, int64_t first_slot, const int32_t *positions,
                           int32_t start) {
  double y[64];
  for (int32_t t = 0; t < s->T; t++) {
    const int64_t slot = first_slot + t;
    const int32_t pos = positions ? positions[t] : start + t;
    for (int l = 0; l < e->L; l++)
      for (int h = 0; h < e->H; h++)
        for (int kv = 0; kv < 2; kv++) {
          const float *x = rfact_row(s, kv, l, t, h);
          if (kv == 0) ref_rotate(&e->rr[l], x, e->D, pos, y);
          else
            for (int d = 0; d < e->D; d++) y[d] = x[d];
          for (int d = 0; d < e->D; d++)
            ref_encode(ec_elem(&e->c, kv, l, table[slot / e->c.BS], (int)(slot % e->c.BS), h, d, NULL), e->c.dt,
                       (float)y[d], ec_scale(&e->c, kv, l, h));
        }
  }
}

static void test_context_window_encoding(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  enum { L = 3, D = 32 };
  kvi_rope_spec specs[L];
  specs[0] = rope(KVI_ROPE_NEOX, 0, 5e5);
  specs[0].scaling = KVI_ROPE_SCALING_LLAMA3;
  specs[0].factor = 8.0;
  specs[1] = rope(KVI_ROPE_GPTJ, 16, 10000.0);
  specs[1].scaling = KVI_ROPE_SCALING_YARN;
  specs[1].factor = 8.0;
  specs[1].original_max_position = 2048;
  specs[2] = nope();
  const env_cfg g = {L, 4, 2, 1, D, specs, KVI_DTYPE_FP32, 4, 64, KVI_CACHE_VLLM_FLASHINFER_HND, KVI_DTYPE_FP32,
                     KVI_SCALE_NONE, 4, 40, NULL};
  env e;
  env_open(&e, &g, &r);
  /* three engine sequences: [context | fact | context | fact ...] */
  rfact s1, s2, s3;
  rfact_make(&s1, &r, 0, 0, L, 30, e.H, D, -3, 3);
  rfact_make(&s2, &r, 0, 0, L, 25, e.H, D, -3, 3);
  rfact_make(&s3, &r, 0, 0, L, 12, e.H, D, -3, 3);
  int32_t perm[40], p1[30];
  rand_perm(&r, perm, 40);
  const int32_t *tb1 = perm, *tb2 = perm + 8, *tb3 = perm + 16;
  rand_positions(&r, p1, 30, 0, 6000, false); /* positions jump (e.g. after an image) */
  engine_prefill(&e, &s1, tb1, 0, p1, 0);
  engine_prefill(&e, &s2, tb2, 3, NULL, 100);
  engine_prefill(&e, &s3, tb3, 1, NULL, 7000);
  const uint64_t cache_before = ec_hash(&e.c);

  kvi_capture caps[5];
  caps[0] = capture(1, 10, tb1, 8, 3, 7, p1 + 3, 0);    /* s1 [3, 10) */
  caps[1] = capture(1, 11, tb1, 8, 12, 9, p1 + 12, 0);  /* s1 [12, 21) */
  caps[2] = capture(1, 12, tb2, 7, 3, 5, NULL, 100);    /* s2 [0, 5) */
  caps[3] = capture(1, 13, tb2, 7, 23, 5, NULL, 120);   /* s2 [20, 25) */
  caps[4] = capture(2, 10, tb3, 4, 1, 12, NULL, 7000);  /* s3, another tenant, the same id */
  assert_ok(kvi_encode(e.enc, caps, 5, NULL));
  assert_true(ec_hash(&e.c) == cache_before);
  const kvi_store_stats st = store_stats(e.s);
  assert_int_equal(st.facts, 5);
  assert_int_equal(st.tenants, 2);
  assert_int_equal(st.pages_used, 2 + 3 + 2 + 2 + 3);
  const struct {
    const rfact *seq;
    int32_t w;
    const int32_t *pos;
    int32_t start;
  } want[5] = {{&s1, 3, p1 + 3, 0}, {&s1, 12, p1 + 12, 0}, {&s2, 0, NULL, 100}, {&s2, 20, NULL, 120},
               {&s3, 0, NULL, 7000}};
  for (int i = 0; i < 5; i++) {
    rfact got;
    rfact_read(e.s, caps[i].tenant, caps[i].fact_id, L, e.H, D, &got);
    assert_int_equal(got.T, caps[i].num_tokens);
    char what[100];
    snprintf(what, sizeof what, "context-window capture %d", i);
    check_captured(&got, want[i].seq, want[i].w, e.rr, &e.c, want[i].pos, want[i].start, KVI_DTYPE_FP32, what);
    rfact_free(&got);
  }
  rfact_free(&s1);
  rfact_free(&s2);
  rfact_free(&s3);
  env_close(&e);
}

/* ------------------------------------------------------------------------ */
/* batched injection, plan                                                   */
/* ------------------------------------------------------------------------ */

static void test_batched_inject(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  enum { L = 2, D = 16, NB = 24, BS = 4 };
  const kvi_rope_spec specs[L] = {rope(KVI_ROPE_NEOX, 0, 10000.0), rope(KVI_ROPE_GPTJ, 8, 1e6)};
  const env_cfg g = {L, 4, 2, 0, D, specs, KVI_DTYPE_FP32, 4, 32, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_FP16,
                     KVI_SCALE_NONE, BS, NB, NULL};
  env e;
  env_open(&e, &g, &r);
  rfact a1, b1, c1, a2, d2;
  rfact_make(&a1, &r, 1, 1, L, 3, e.H, D, -3, 3);
  rfact_make(&b1, &r, 1, 2, L, 6, e.H, D, -3, 3);
  rfact_make(&c1, &r, 1, 3, L, 9, e.H, D, -3, 3);
  rfact_make(&a2, &r, 2, 1, L, 4, e.H, D, -3, 3); /* tenant 2's fact 1: other data */
  rfact_make(&d2, &r, 2, 4, L, 2, e.H, D, -3, 3);
  const rfact *all[] = {&a1, &b1, &c1, &a2, &d2};
  for (int i = 0; i < 5; i++) rfact_put(e.s, all[i], 0);

  int32_t perm[NB];
  rand_perm(&r, perm, NB);
  int32_t pos0[12], pos4[6];
  rand_positions(&r, pos0, 12, 0, 5000, true);
  rand_positions(&r, pos4, 6, 100, 300, false);
  const uint64_t ids0[] = {3, 1}, ids1[] = {1, 4}, ids3[] = {4, 1, 4}, ids4[] = {2};
  const int32_t *tb0 = perm, *tb1 = perm + 5, *tb2 = perm + 7, *tb3 = perm + 9, *tb4 = perm + 15;
  kvi_inject_request rq[5];
  rq[0] = request(1, ids0, 2, tb0, 5, 6, pos0, 0);    /* slots 6..17: 5 blocks */
  rq[1] = request(2, ids1, 2, tb1, 2, 0, NULL, 50);   /* slots 0..5 */
  rq[2] = request(1, NULL, 0, tb2, 2, 3, NULL, 0);    /* nothing */
  rq[3] = request(2, ids3, 3, tb3, 6, 13, NULL, 0);   /* slots 13..20, default start 0 */
  rq[4] = request(1, ids4, 1, tb4, 3, 1, pos4, 0);    /* slots 1..6 */
  int64_t planned = -1;
  assert_ok(kvi_inject_plan(e.inj, 1, ids0, 2, &planned));
  assert_int_equal(planned, 12);
  assert_ok(kvi_inject(e.inj, rq, 5, NULL, NULL));

  ecmask mask;
  ecmask_make(&mask, &e.c);
  const rfact *f0[] = {&c1, &a1}, *f1[] = {&a2, &d2}, *f3[] = {&d2, &a2, &d2}, *f4[] = {&b1};
  ec_check_request(&e.c, e.rr, f0, 2, tb0, 6, pos0, 0, 0, L, 0.0, &mask, "request 0");
  ec_check_request(&e.c, e.rr, f1, 2, tb1, 0, NULL, 50, 0, L, 0.0, &mask, "request 1");
  ec_check_request(&e.c, e.rr, f3, 3, tb3, 13, NULL, 0, 0, L, 0.0, &mask, "request 3");
  ec_check_request(&e.c, e.rr, f4, 1, tb4, 1, pos4, 0, 0, L, 0.0, &mask, "request 4");
  ecmask_check_poison(&mask, &e.c, "batched injection (request 2 has no facts)");
  ecmask_free(&mask);

  /* empty calls write nothing */
  const uint64_t h = ec_hash(&e.c);
  assert_ok(kvi_inject(e.inj, rq, 0, NULL, NULL));
  assert_ok(kvi_inject(e.inj, NULL, 0, NULL, NULL));
  kvi_inject_request empty[2] = {request(1, NULL, 0, NULL, 0, 0, NULL, 0), request(2, ids1, 0, tb1, 2, 0, NULL, 0)};
  assert_ok(kvi_inject(e.inj, empty, 2, NULL, NULL));
  assert_true(ec_hash(&e.c) == h);
  for (int i = 0; i < 5; i++) rfact_free((rfact *)all[i]);
  env_close(&e);
}

/* ------------------------------------------------------------------------ */
/* kvi_inject_batched: flat arrays against the per-request form              */
/* ------------------------------------------------------------------------ */

enum { BT_R = 6, BT_MAXF = 3, BT_BLOCKS = 8, BT_STRIDE = 11, BT_NB = 64, BT_BS = 4 };

/* A random batch over the facts of test_batched_inject's kind: request r's
 * tenant, facts, first slot, blocks (its own slice of perm) and positions. */
typedef struct bcase {
  uint64_t tenants[BT_R];
  uint64_t ids[BT_R * BT_MAXF];
  int32_t off[BT_R + 1];
  int32_t tokens[BT_R];
  int64_t first[BT_R];
  int32_t start[BT_R];
  int32_t pos[BT_R][BT_MAXF * 9];
  int32_t perm[BT_NB];
} bcase;

static const int32_t bt_tok[2][5] = {{0, 3, 6, 9, 0}, {0, 4, 0, 0, 2}}; /* tokens of tenant t+1's fact id */

static void bcase_make(bcase *b, rng *r) {
  rand_perm(r, b->perm, BT_NB);
  b->off[0] = 0;
  for (int q = 0; q < BT_R; q++) {
    b->tenants[q] = 1 + (uint64_t)rng_range(r, 0, 1);
    const int nf = q == 2 ? 0 : (int)rng_range(r, 1, BT_MAXF); /* request 2 injects nothing */
    b->tokens[q] = 0;
    for (int f = 0; f < nf; f++) {
      static const uint64_t t1[] = {1, 2, 3}, t2[] = {1, 4};
      const uint64_t id = b->tenants[q] == 1 ? t1[rng_range(r, 0, 2)] : t2[rng_range(r, 0, 1)];
      b->ids[b->off[q] + f] = id;
      b->tokens[q] += bt_tok[b->tenants[q] - 1][id];
    }
    b->off[q + 1] = b->off[q] + nf;
    b->first[q] = rng_range(r, 0, BT_BS - 1);
    b->start[q] = (int32_t)rng_range(r, 0, 3000);
    if (b->tokens[q] > 0) rand_positions(r, b->pos[q], b->tokens[q], 0, 8000, true);
  }
}

/* Blocks request q's slots need. */
static int32_t bcase_blocks(const bcase *b, int q) {
  return b->tokens[q] == 0 ? 0 : (int32_t)((b->first[q] + b->tokens[q] - 1) / BT_BS + 1);
}

static void cache_save(const ecache *c, unsigned char **keep) {
  for (int i = 0; i < c->nbuf; i++) {
    keep[i] = malloc(c->bytes[i]);
    assert_non_null(keep[i]);
    memcpy(keep[i], c->buf[i], c->bytes[i]);
  }
}

static void cache_restore(ecache *c, unsigned char **keep) {
  for (int i = 0; i < c->nbuf; i++) memcpy(c->buf[i], keep[i], c->bytes[i]);
}

static void batched_case(kvi_cache_preset preset, rng *r) {
  enum { L = 2, D = 16 };
  const kvi_rope_spec specs[L] = {rope(KVI_ROPE_NEOX, 0, 10000.0), rope(KVI_ROPE_GPTJ, 8, 1e6)};
  const env_cfg g = {L, 4, 2, 0, D, specs, KVI_DTYPE_FP32, 4, 64, preset, KVI_DTYPE_BF16, KVI_SCALE_NONE, BT_BS,
                     BT_NB, NULL};
  env e;
  env_open(&e, &g, r);
  rfact a1, b1, c1, a2, d2;
  rfact_make(&a1, r, 1, 1, L, 3, e.H, D, -3, 3);
  rfact_make(&b1, r, 1, 2, L, 6, e.H, D, -3, 3);
  rfact_make(&c1, r, 1, 3, L, 9, e.H, D, -3, 3);
  rfact_make(&a2, r, 2, 1, L, 4, e.H, D, -3, 3);
  rfact_make(&d2, r, 2, 4, L, 2, e.H, D, -3, 3);
  const rfact *all[] = {&a1, &b1, &c1, &a2, &d2};
  for (int i = 0; i < 5; i++) rfact_put(e.s, all[i], 0);
  const rfact *by_id[2][5] = {{NULL, &a1, &b1, &c1, NULL}, {NULL, &a2, NULL, NULL, &d2}};
  unsigned char *orig[2 * EC_MAXL];
  cache_save(&e.c, orig);

  for (int round = 0; round < 4; round++) {
    bcase b;
    bcase_make(&b, r);
    const bool per_token = round & 1, wide = round & 2; /* positions per token; int64 positions */
    char what[120];
    snprintf(what, sizeof what, "preset %d, %s positions, int%d", (int)preset, per_token ? "per-token" : "start",
             wide ? 64 : 32);
    /* the per-request form, each request its own table slice */
    kvi_inject_request rq[BT_R];
    for (int q = 0; q < BT_R; q++)
      rq[q] = request(b.tenants[q], b.ids + b.off[q], b.off[q + 1] - b.off[q], b.perm + q * BT_BLOCKS, BT_BLOCKS,
                      b.first[q], per_token ? b.pos[q] : NULL, per_token ? 0 : b.start[q]);
    cache_restore(&e.c, orig);
    assert_ok(kvi_inject(e.inj, rq, BT_R, NULL, NULL));
    const uint64_t want = ec_hash(&e.c);
    /* and the float64 reference */
    ecmask mask;
    ecmask_make(&mask, &e.c);
    for (int q = 0; q < BT_R; q++) {
      const rfact *ff[BT_MAXF];
      const int nf = b.off[q + 1] - b.off[q];
      for (int f = 0; f < nf; f++) ff[f] = by_id[b.tenants[q] - 1][b.ids[b.off[q] + f]];
      if (nf)
        ec_check_request(&e.c, e.rr, ff, nf, b.perm + q * BT_BLOCKS, b.first[q], per_token ? b.pos[q] : NULL,
                         per_token ? 0 : b.start[q], 0, L, 0.0, &mask, what);
    }
    ecmask_free(&mask);

    /* flat arrays: positions of the whole call, start positions, both widths */
    int32_t flat32[BT_R * BT_MAXF * 9], start32[BT_R];
    int64_t flat64[BT_R * BT_MAXF * 9], start64[BT_R];
    int64_t ntok = 0;
    for (int q = 0; q < BT_R; q++) {
      start32[q] = b.start[q], start64[q] = b.start[q];
      for (int t = 0; t < b.tokens[q]; t++) flat32[ntok] = b.pos[q][t], flat64[ntok++] = b.pos[q][t];
    }
    /* a 2-D table with a row stride (rows longer than used, the rest invalid ids) */
    int32_t t2d[BT_R * BT_STRIDE];
    for (int q = 0; q < BT_R; q++)
      for (int i = 0; i < BT_STRIDE; i++) t2d[q * BT_STRIDE + i] = i < BT_BLOCKS ? b.perm[q * BT_BLOCKS + i] : -7;
    /* CSR pages: each request exactly the blocks it needs */
    int32_t csr[BT_R * BT_BLOCKS], indptr[BT_R + 1];
    indptr[0] = 0;
    for (int q = 0; q < BT_R; q++) {
      const int32_t nb = bcase_blocks(&b, q);
      memcpy(csr + indptr[q], b.perm + q * BT_BLOCKS, (size_t)nb * sizeof(int32_t));
      indptr[q + 1] = indptr[q] + nb;
    }
    for (int form = 0; form < 2; form++) {
      kvi_inject_batch bb;
      assert_ok(kvi_inject_batch_init(&bb, sizeof bb));
      bb.num_requests = BT_R;
      bb.tenants = b.tenants;
      bb.fact_ids = b.ids;
      bb.fact_offsets = b.off;
      if (form == 0) {
        bb.block_tables = t2d, bb.block_table_stride = BT_STRIDE, bb.block_table_len = BT_BLOCKS;
      } else {
        bb.block_tables = csr, bb.block_table_offsets = indptr;
      }
      bb.first_slots = b.first;
      bb.position_bits = wide ? 64 : 32;
      if (per_token) {
        bb.positions = wide ? (const void *)flat64 : (const void *)flat32;
        bb.num_positions = form ? ntok : 0; /* checked, or trusted */
      } else {
        bb.start_positions = wide ? (const void *)start64 : (const void *)start32;
      }
      int32_t out[BT_R];
      for (int q = 0; q < BT_R; q++) out[q] = -1;
      bb.out_tokens = out;
      cache_restore(&e.c, orig);
      assert_ok(kvi_inject_batched(e.inj, &bb, NULL, NULL));
      if (ec_hash(&e.c) != want) fail_msg("%s, %s tables: the batched call differs from kvi_inject", what, form ? "CSR" : "2-D");
      for (int q = 0; q < BT_R; q++) assert_int_equal(out[q], b.tokens[q]);
    }
  }

  /* one tenant for all, no first slots (0), no positions (0, 1, ...) */
  {
    const uint64_t ids[] = {3, 1, 2};
    const int32_t off[] = {0, 2, 3};
    int32_t tab[2 * 4];
    for (int i = 0; i < 8; i++) tab[i] = i * 5 + 1;
    kvi_inject_batch bb = KVI_INJECT_BATCH_INIT;
    bb.num_requests = 2, bb.tenant = 1, bb.fact_ids = ids, bb.fact_offsets = off;
    bb.block_tables = tab, bb.block_table_stride = 4, bb.block_table_len = 4;
    cache_restore(&e.c, orig);
    assert_ok(kvi_inject_batched(e.inj, &bb, NULL, NULL));
    const uint64_t got = ec_hash(&e.c);
    kvi_inject_request rq[2] = {request(1, ids, 2, tab, 4, 0, NULL, 0), request(1, ids + 2, 1, tab + 4, 4, 0, NULL, 0)};
    cache_restore(&e.c, orig);
    assert_ok(kvi_inject(e.inj, rq, 2, NULL, NULL));
    assert_true(ec_hash(&e.c) == got);
  }

  /* rejected batches change nothing, out_tokens included */
  {
    uint64_t ids[] = {3, 1, 2};
    int32_t off[] = {0, 2, 3}, tab[2 * 4], indptr[] = {0, 4, 8};
    int64_t first[] = {0, 1}, pos64[] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25};
    int32_t pos32[21];
    for (int i = 0; i < 21; i++) pos32[i] = (int32_t)pos64[i];
    for (int i = 0; i < 8; i++) tab[i] = i * 5 + 1;
    int32_t out[2] = {-9, -9};
    kvi_inject_batch ok = KVI_INJECT_BATCH_INIT;
    ok.num_requests = 2, ok.tenant = 1, ok.fact_ids = ids, ok.fact_offsets = off, ok.out_tokens = out;
    ok.block_tables = tab, ok.block_table_stride = 4, ok.block_table_len = 4, ok.first_slots = first;
    kvi_inject_batch bb;
#define REJECT(edit, want)                                                  \
  do {                                                                      \
    bb = ok;                                                                \
    edit;                                                                   \
    EXPECT_UNCHANGED(&e, kvi_inject_batched(e.inj, &bb, NULL, NULL), want); \
    assert_true(out[0] == -9 && out[1] == -9);                              \
  } while (0)
    bb = ok; /* the baseline is valid: 9 + 3 tokens, then 6 */
    assert_ok(kvi_inject_batched(e.inj, &bb, NULL, NULL));
    assert_true(out[0] == 12 && out[1] == 6);
    out[0] = out[1] = -9;
    cache_restore(&e.c, orig);
    REJECT(off[1] = 4, KVI_ERR_INVALID_ARGUMENT); /* decreasing */
    off[1] = 2;
    REJECT(bb.fact_offsets = NULL, KVI_ERR_INVALID_ARGUMENT);
    REJECT(bb.fact_ids = NULL, KVI_ERR_INVALID_ARGUMENT);
    REJECT(ids[2] = 99, KVI_ERR_NOT_FOUND);
    ids[2] = 2;
    REJECT(bb.tenant = 2, KVI_ERR_NOT_FOUND);
    REJECT(bb.num_requests = -1, KVI_ERR_INVALID_ARGUMENT);
    REJECT(bb.position_bits = 16, KVI_ERR_INVALID_ARGUMENT);
    REJECT(bb.block_table_len = 5, KVI_ERR_INVALID_ARGUMENT);          /* past the stride */
    REJECT(bb.block_table_offsets = indptr, KVI_ERR_INVALID_ARGUMENT); /* both forms */
    REJECT((bb.block_table_stride = 0, bb.block_table_len = 0), KVI_ERR_INVALID_ARGUMENT); /* CSR without offsets */
    REJECT((bb.block_table_stride = 0, bb.block_table_len = 0, bb.block_table_offsets = indptr, indptr[1] = 1),
           KVI_ERR_INVALID_ARGUMENT); /* request 0 has 1 block for 12 tokens */
    indptr[1] = 4;
    REJECT((bb.block_table_stride = 0, bb.block_table_len = 0, bb.block_table_offsets = indptr, indptr[1] = 9),
           KVI_ERR_INVALID_ARGUMENT); /* decreasing */
    indptr[1] = 4;
    REJECT(bb.block_table_len = 2, KVI_ERR_INVALID_ARGUMENT); /* 12 tokens need 3 blocks of 4 */
    REJECT(tab[5] = BT_NB, KVI_ERR_INVALID_ARGUMENT);         /* a block outside the cache (request 1's second) */
    tab[5] = 26;
    REJECT(first[1] = -1, KVI_ERR_INVALID_ARGUMENT);
    first[1] = 1;
    REJECT((bb.positions = pos32, bb.start_positions = pos32), KVI_ERR_INVALID_ARGUMENT);
    REJECT((bb.positions = pos32, bb.num_positions = 19), KVI_ERR_INVALID_ARGUMENT); /* the call has 18 tokens */
    REJECT(bb.num_positions = 18, KVI_ERR_INVALID_ARGUMENT);                        /* without positions */
    REJECT((bb.positions = pos64, bb.position_bits = 64, pos64[17] = (int64_t)1 << 32), KVI_ERR_INVALID_ARGUMENT);
    pos64[17] = 22;
    REJECT((bb.start_positions = pos64, bb.position_bits = 64, pos64[1] = -1), KVI_ERR_INVALID_ARGUMENT);
    pos64[1] = 6;
    REJECT((bb.start_positions = pos64, bb.position_bits = 64, pos64[0] = (int64_t)INT32_MAX + 2),
           KVI_ERR_INVALID_ARGUMENT);
    pos64[0] = 5;
    REJECT(bb.fact_ids_memory = (kvi_memory)0, KVI_ERR_INVALID_ARGUMENT);
    REJECT(bb.index_memory = (kvi_memory)3, KVI_ERR_INVALID_ARGUMENT);
    REJECT(bb.fact_ids_memory = KVI_MEMORY_DEVICE, KVI_ERR_MEMORY_KIND); /* a CPU store */
    REJECT(bb.block_tables_memory = KVI_MEMORY_DEVICE, KVI_ERR_MEMORY_KIND);
    REJECT(bb.index_memory = KVI_MEMORY_DEVICE, KVI_ERR_MEMORY_KIND);
    REJECT(bb.struct_size = offsetof(kvi_inject_batch, expect_token_ids) - 1, KVI_ERR_STRUCT_SIZE);
    kvi_inject_options io = KVI_INJECT_OPTIONS_INIT;
    io.layer_begin = 1, io.layer_end = 1;
    bb = ok;
    EXPECT_UNCHANGED(&e, kvi_inject_batched(e.inj, &bb, &io, NULL), KVI_ERR_INVALID_ARGUMENT);
    EXPECT_UNCHANGED(&e, kvi_inject_batched(e.inj, NULL, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
    EXPECT_UNCHANGED(&e, kvi_inject_batched(NULL, &ok, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_true(out[0] == -9 && out[1] == -9);
    bb = ok;
    bb.num_requests = 0;
    EXPECT_UNCHANGED(&e, kvi_inject_batched(e.inj, &bb, NULL, NULL), KVI_OK);
#undef REJECT
  }
  /* kvi_encode_batched: the same facts as kvi_encode, from whatever the cache holds now */
  {
    bcase b;
    bcase_make(&b, r);
    kvi_inject_request rq[BT_R];
    for (int q = 0; q < BT_R; q++)
      rq[q] = request(b.tenants[q], b.ids + b.off[q], b.off[q + 1] - b.off[q], b.perm + q * BT_BLOCKS, BT_BLOCKS,
                      b.first[q], NULL, b.start[q]);
    assert_ok(kvi_inject(e.inj, rq, BT_R, NULL, NULL)); /* facts in the cache to capture */
    enum { NC = 5 };
    const int32_t ntok[NC] = {3, 7, 1, 12, 5};
    const int64_t first[NC] = {0, 2, 3, 1, 0};
    int32_t t2d[NC * BT_STRIDE], csr[NC * 4], indptr[NC + 1], starts32[NC], pos32[28];
    int64_t starts64[NC], pos64[28];
    uint64_t ids[NC];
    indptr[0] = 0;
    for (int c = 0; c < NC; c++) {
      ids[c] = 500 + (uint64_t)c;
      starts32[c] = 10 * c + 1, starts64[c] = starts32[c];
      for (int i = 0; i < BT_STRIDE; i++) t2d[c * BT_STRIDE + i] = i < 4 ? b.perm[c * 4 + i] : -1;
      memcpy(csr + indptr[c], b.perm + c * 4, 4 * sizeof(int32_t));
      indptr[c + 1] = indptr[c] + 4;
    }
    rand_positions(r, pos32, 28, 0, 4000, true);
    for (int t = 0; t < 28; t++) pos64[t] = pos32[t];
    for (int variant = 0; variant < 4; variant++) {
      const bool per_token = variant & 1, csr_form = variant & 2;
      kvi_capture cp[NC];
      int64_t at = 0;
      for (int c = 0; c < NC; c++) {
        cp[c] = capture(7, ids[c], b.perm + c * 4, 4, first[c], ntok[c], per_token ? pos32 + at : NULL,
                        per_token ? 0 : starts32[c]);
        cp[c].flags = KVI_PUT_REPLACE;
        at += ntok[c];
      }
      assert_ok(kvi_encode(e.enc, cp, NC, NULL));
      kvi_encode_batch eb;
      assert_ok(kvi_encode_batch_init(&eb, sizeof eb));
      eb.num_captures = NC, eb.tenant = 8, eb.fact_ids = ids, eb.num_tokens = ntok, eb.first_slots = first;
      eb.flags = KVI_PUT_REPLACE;
      if (csr_form)
        eb.block_tables = csr, eb.block_table_offsets = indptr;
      else
        eb.block_tables = t2d, eb.block_table_stride = BT_STRIDE, eb.block_table_len = 4;
      eb.position_bits = variant == 1 ? 64 : 32;
      if (per_token)
        eb.positions = variant == 1 ? (const void *)pos64 : (const void *)pos32, eb.num_positions = 28;
      else
        eb.start_positions = variant == 2 ? (const void *)starts32 : (const void *)starts64,
        eb.position_bits = variant == 2 ? 32 : 64;
      assert_ok(kvi_encode_batched(e.enc, &eb, NULL));
      for (int c = 0; c < NC; c++) {
        rfact x, y;
        rfact_read(e.s, 7, ids[c], e.L, e.H, e.D, &x);
        rfact_read(e.s, 8, ids[c], e.L, e.H, e.D, &y);
        assert_int_equal(x.T, ntok[c]);
        assert_int_equal(y.T, ntok[c]);
        const size_t n = (size_t)x.L * x.T * x.H * x.D * sizeof(float);
        if (memcmp(x.k, y.k, n) || memcmp(x.v, y.v, n))
          fail_msg("variant %d capture %d: kvi_encode_batched stored other values than kvi_encode", variant, c);
        rfact_free(&x);
        rfact_free(&y);
      }
    }
    /* refusals store nothing */
    kvi_encode_batch ok = KVI_ENCODE_BATCH_INIT, bb;
    ok.num_captures = NC, ok.tenant = 9, ok.fact_ids = ids, ok.num_tokens = ntok, ok.first_slots = first;
    ok.block_tables = t2d, ok.block_table_stride = BT_STRIDE, ok.block_table_len = 4;
    bb = ok, bb.positions = pos32, bb.num_positions = 27;
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &bb, NULL), KVI_ERR_INVALID_ARGUMENT);
    bb = ok, bb.positions = pos64, bb.position_bits = 64, pos64[27] = (int64_t)1 << 33;
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &bb, NULL), KVI_ERR_INVALID_ARGUMENT);
    bb = ok, bb.block_table_len = 0; /* the captures need blocks */
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &bb, NULL), KVI_ERR_INVALID_ARGUMENT);
    bb = ok, bb.position_bits = 8;
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &bb, NULL), KVI_ERR_INVALID_ARGUMENT);
    bb = ok, bb.num_tokens = NULL;
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &bb, NULL), KVI_ERR_INVALID_ARGUMENT);
    /* a newer caller's larger struct: trailing bytes this version does not
     * know must be zero (they lie inside the caller's object, not past it) */
    struct {
      kvi_encode_batch b;
      unsigned char newer[8];
    } big = {ok, {0}};
    big.b.struct_size = sizeof big;
    big.newer[3] = 1;
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &big.b, NULL), KVI_ERR_STRUCT_SIZE);
    const uint64_t dup[NC] = {1, 2, 3, 2, 5};
    bb = ok, bb.fact_ids = dup;
    EXPECT_UNCHANGED(&e, kvi_encode_batched(e.enc, &bb, NULL), KVI_ERR_INVALID_ARGUMENT);
  }
  for (int i = 0; i < e.c.nbuf; i++) free(orig[i]);
  for (int i = 0; i < 5; i++) rfact_free((rfact *)all[i]);
  env_close(&e);
}

static void test_inject_batched(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  const kvi_cache_preset presets[] = {KVI_CACHE_VLLM_FLASHINFER, KVI_CACHE_VLLM_FLASH_ATTN,
                                      KVI_CACHE_VLLM_FLASHINFER_HND};
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) batched_case(presets[i], &r);
}

static void test_inject_plan(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  const kvi_rope_spec specs[2] = {rope(KVI_ROPE_NEOX, 0, 10000.0), nope()};
  const env_cfg g = {2, 2, 1, 0, 8, specs, KVI_DTYPE_BF16, 4, 16, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_BF16,
                     KVI_SCALE_NONE, 4, 4, NULL};
  env e;
  env_open(&e, &g, &r);
  rfact f[4];
  rfact_make(&f[0], &r, 1, 1, 2, 3, e.H, 8, -2, 2);
  rfact_make(&f[1], &r, 1, 2, 2, 6, e.H, 8, -2, 2);
  rfact_make(&f[2], &r, 1, 3, 2, 9, e.H, 8, -2, 2);
  rfact_make(&f[3], &r, 2, 4, 2, 2, e.H, 8, -2, 2);
  for (int i = 0; i < 4; i++) rfact_put(e.s, &f[i], 0);
  int64_t n = -77;
  const uint64_t all1[] = {3, 1, 2, 2}, one4[] = {4}, mixed[] = {1, 99}, cross[] = {1, 4};
  assert_ok(kvi_inject_plan(e.inj, 1, all1, 4, &n));
  assert_int_equal(n, 9 + 3 + 6 + 6);
  assert_ok(kvi_inject_plan(e.inj, 2, one4, 1, &n));
  assert_int_equal(n, 2);
  assert_ok(kvi_inject_plan(e.inj, 1, NULL, 0, &n));
  assert_int_equal(n, 0);
  n = -77;
  /* tenant 2's fact 4 is unknown to tenant 1, tenant 1's fact 1 to tenant 2 */
  assert_status(kvi_inject_plan(e.inj, 1, one4, 1, &n), KVI_ERR_NOT_FOUND);
  assert_status(kvi_inject_plan(e.inj, 2, all1, 1, &n), KVI_ERR_NOT_FOUND);
  assert_status(kvi_inject_plan(e.inj, 1, mixed, 2, &n), KVI_ERR_NOT_FOUND);
  assert_status(kvi_inject_plan(e.inj, 1, cross, 2, &n), KVI_ERR_NOT_FOUND);
  assert_status(kvi_inject_plan(e.inj, 3, all1, 1, &n), KVI_ERR_NOT_FOUND);
  assert_status(kvi_inject_plan(e.inj, 1, all1, -1, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_inject_plan(e.inj, 1, NULL, 1, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_inject_plan(NULL, 1, all1, 1, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_int_equal(n, -77);
  assert_status(kvi_inject_plan(e.inj, 1, all1, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  /* isolation in kvi_inject too */
  const int32_t tb[] = {0, 1, 2, 3};
  kvi_inject_request q = request(1, one4, 1, tb, 4, 0, NULL, 0);
  EXPECT_UNCHANGED(&e, kvi_inject(e.inj, &q, 1, NULL, NULL), KVI_ERR_NOT_FOUND);
  for (int i = 0; i < 4; i++) rfact_free(&f[i]);
  env_close(&e);
}

/* ------------------------------------------------------------------------ */
/* layer ranges                                                              */
/* ------------------------------------------------------------------------ */

/* Long fact lists: the library looks ids up in prefetched groups, so every
 * position of a list, on and around group boundaries, must be found (and a
 * missing id there reported) like the first. Token counts differ per fact
 * and per tenant, so a lookup landing on the wrong fact changes the sum. */
static void test_inject_plan_long_lists(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  const kvi_rope_spec specs[1] = {rope(KVI_ROPE_NEOX, 0, 10000.0)};
  enum { N = 120, LIST = 200 };
  const env_cfg g = {1, 1, 1, 0, 8, specs, KVI_DTYPE_BF16, 4, 2 * N * 2, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16,
                     KVI_SCALE_NONE, 4, 4, NULL};
  env e;
  env_open(&e, &g, &r);
  rfact *f = calloc(2 * N, sizeof *f);
  assert_non_null(f);
  for (int i = 0; i < N; i++) { /* the same ids in two tenants, different lengths */
    rfact_make(&f[i], &r, 1, 5000 + (uint64_t)i, 1, 1 + i % 5, e.H, 8, -1, 1);
    rfact_make(&f[N + i], &r, 2, 5000 + (uint64_t)i, 1, 6 + i % 2, e.H, 8, -1, 1);
    rfact_put(e.s, &f[i], 0);
    rfact_put(e.s, &f[N + i], 0);
  }
  uint64_t ids[LIST];
  int64_t want1 = 0, want2 = 0, n;
  for (int k = 0; k < LIST; k++) { /* a scattered order with repeats */
    const int i = (k * 37 + 11) % N;
    ids[k] = 5000 + (uint64_t)i;
    want1 += 1 + i % 5;
    want2 += 6 + i % 2;
  }
  for (int len = 1; len <= LIST; len += len < 40 ? 1 : 23) {
    int64_t w = 0;
    for (int k = 0; k < len; k++) w += 1 + (int)((ids[k] - 5000) % 5);
    assert_ok(kvi_inject_plan(e.inj, 1, ids, len, &n));
    assert_int_equal(n, w);
  }
  assert_ok(kvi_inject_plan(e.inj, 1, ids, LIST, &n));
  assert_int_equal(n, want1);
  assert_ok(kvi_inject_plan(e.inj, 2, ids, LIST, &n));
  assert_int_equal(n, want2);
  const int bad_at[] = {0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, LIST - 1};
  const int32_t tb[] = {0, 1, 2, 3};
  for (size_t b = 0; b < sizeof bad_at / sizeof bad_at[0]; b++) {
    uint64_t bad[LIST];
    memcpy(bad, ids, sizeof bad);
    bad[bad_at[b]] = 4999; /* in neither tenant */
    n = -77;
    assert_status(kvi_inject_plan(e.inj, 1, bad, LIST, &n), KVI_ERR_NOT_FOUND);
    assert_int_equal(n, -77);
    assert_non_null(strstr(kvi_last_error(), "4999"));
    kvi_inject_request q = request(1, bad, LIST, tb, 4, 0, NULL, 0);
    EXPECT_UNCHANGED(&e, kvi_inject(e.inj, &q, 1, NULL, NULL), KVI_ERR_NOT_FOUND);
    assert_non_null(strstr(kvi_last_error(), "4999"));
  }
  for (int i = 0; i < 2 * N; i++) rfact_free(&f[i]);
  free(f);
  env_close(&e);
}

/* Between equal dtypes without scales, what is not rotated (V, and K past
 * rotary_dim) moves bit for bit, NaN payloads, signed zeros and subnormals
 * included, both ways; the rotated part stays finite arithmetic. */
static void test_equal_dtypes_copy_bits(void **state) {
  (void)state;
  enum { L = 1, H = 1, D = 8, T = 2, BS = 4, NB = 2 };
  kvi_model *m = make_model(L, H, D, 0, 1);
  kvi_rope_spec rs = rope(KVI_ROPE_NEOX, 4, 10000.0); /* K's [4, 8) passes through */
  assert_ok(kvi_model_set_rope(m, 0, &rs));
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 4, 1 << 20);
  kvi_store *st;
  assert_ok(kvi_store_create(&st, m, &o));
  static const uint16_t special[8] = {0x7f81, 0xffc1, 0x7fa5, 0x8000, 0x0001, 0x8003, 0xff80, 0x7f80};
  uint16_t k[T][H][D], v[T][H][D];
  for (int t = 0; t < T; t++)
    for (int d = 0; d < D; d++) {
      k[t][0][d] = d < 4 ? (uint16_t)(0x3f80 + 0x10 * d + t) : special[(d + t) % 8]; /* 1.0, 1.125, ... */
      v[t][0][d] = special[(d + 3 * t) % 8];
    }
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_BF16, L, T, H, D, k, v);
  assert_ok(kvi_store_put(st, 1, 1, &kv, NULL, NULL));
  uint16_t cache[2][NB][BS][H][D];
  memset(cache, 0x55, sizeof cache);
  void *layers[1] = {cache};
  kvi_cache_layout cl;
  assert_ok(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_HOST;
  kvi_injector *inj;
  kvi_encoder *enc;
  assert_ok(kvi_injector_create(&inj, st, &cl, NULL));
  assert_ok(kvi_encoder_create(&enc, st, &cl, NULL));
  const int32_t table[NB] = {1, 0};
  const uint64_t id = 1;
  kvi_inject_request q = request(1, &id, 1, table, NB, 0, NULL, 7);
  assert_ok(kvi_inject(inj, &q, 1, NULL, NULL));
  for (int t = 0; t < T; t++) { /* slot t lands in block 1 */
    assert_memory_equal(cache[1][1][t][0], v[t][0], sizeof v[t][0]);
    assert_memory_equal(&cache[0][1][t][0][4], &k[t][0][4], 4 * sizeof(uint16_t));
    for (int d = 0; d < 4; d++) assert_true(cache[0][1][t][0][d] != k[t][0][d]); /* rotated at 7 + t */
  }
  kvi_capture c = capture(1, 2, table, NB, 0, T, NULL, 7);
  assert_ok(kvi_encode(enc, &c, 1, NULL));
  uint16_t k2[T][H][D], v2[T][H][D];
  kvi_kv_view out;
  kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_BF16, L, T, H, D, k2, v2);
  assert_ok(kvi_store_read(st, 1, 2, &out, NULL));
  assert_memory_equal(v2, v, sizeof v);
  for (int t = 0; t < T; t++) assert_memory_equal(&k2[t][0][4], &k[t][0][4], 4 * sizeof(uint16_t));
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  kvi_store_destroy(st);
  kvi_model_destroy(m);
}

static void test_layer_range(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  enum { L = 4, D = 16 };
  const kvi_rope_spec specs[L] = {rope(KVI_ROPE_NEOX, 0, 10000.0), nope(), rope(KVI_ROPE_GPTJ, 0, 5e5),
                                  rope(KVI_ROPE_NEOX, 6, 1e4)};
  const env_cfg g = {L, 2, 1, 0, D, specs, KVI_DTYPE_FP32, 4, 8, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16,
                     KVI_SCALE_NONE, 4, 6, NULL};
  env e;
  env_open(&e, &g, &r);
  rfact f;
  rfact_make(&f, &r, 5, 5, L, 6, e.H, D, -3, 3);
  rfact_put(e.s, &f, 0);
  const int32_t tb[] = {4, 1, 3};
  int32_t pos[6];
  rand_positions(&r, pos, 6, 0, 3000, true);
  const uint64_t id = 5;
  const kvi_inject_request q = request(5, &id, 1, tb, 3, 3, pos, 0);
  const int32_t ranges[][2] = {{1, 2}, {0, 1}, {2, 0}, {0, 0}, {3, 4}, {1, 3}, {0, 4}};
  for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
    ec_poison(&e.c);
    kvi_inject_options o;
    kvi_inject_options_init(&o, sizeof o);
    o.layer_begin = ranges[i][0];
    o.layer_end = ranges[i][1];
    assert_ok(kvi_inject(e.inj, &q, 1, &o, NULL));
    const int le = ranges[i][1] ? ranges[i][1] : L;
    char what[80];
    snprintf(what, sizeof what, "layers [%d, %d) (layer_end %d)", ranges[i][0], le, ranges[i][1]);
    ecmask mask;
    ecmask_make(&mask, &e.c);
    const rfact *ff[] = {&f};
    ec_check_request(&e.c, e.rr, ff, 1, tb, 3, pos, 0, ranges[i][0], le, 0.0, &mask, what);
    ecmask_check_poison(&mask, &e.c, what);
    ecmask_free(&mask);
  }
  /* NULL options: every layer */
  ec_poison(&e.c);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  const rfact *ff[] = {&f};
  ec_check_request(&e.c, e.rr, ff, 1, tb, 3, pos, 0, 0, L, 0.0, NULL, "NULL options");
  /* bad ranges */
  const int32_t bad[][2] = {{-1, 0}, {-1, 2}, {0, 5}, {2, 1}, {1, 1}, {4, 0}, {5, 0}, {0, -1}, {3, 3}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kvi_inject_options o = KVI_INJECT_OPTIONS_INIT;
    o.layer_begin = bad[i][0];
    o.layer_end = bad[i][1];
    EXPECT_UNCHANGED(&e, kvi_inject(e.inj, &q, 1, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  }
  kvi_inject_options o = KVI_INJECT_OPTIONS_INIT;
  o.host_pages = (kvi_host_pages)2;
  EXPECT_UNCHANGED(&e, kvi_inject(e.inj, &q, 1, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  /* a store without a host tier ignores host_pages; the layout before it is accepted */
  o.host_pages = KVI_HOST_PAGES_READ_MAPPED;
  ec_poison(&e.c);
  assert_ok(kvi_inject(e.inj, &q, 1, &o, NULL));
  ec_check_request(&e.c, e.rr, ff, 1, tb, 3, pos, 0, 0, L, 0.0, NULL, "READ_MAPPED on a CPU store");
  o = (kvi_inject_options)KVI_INJECT_OPTIONS_INIT;
  o.struct_size = offsetof(kvi_inject_options, host_pages);
  o.host_pages = (kvi_host_pages)9; /* past struct_size: never read */
  ec_poison(&e.c);
  assert_ok(kvi_inject(e.inj, &q, 1, &o, NULL));
  ec_check_request(&e.c, e.rr, ff, 1, tb, 3, pos, 0, 0, L, 0.0, NULL, "first layout of kvi_inject_options");
  o.struct_size = sizeof(size_t);
  EXPECT_UNCHANGED(&e, kvi_inject(e.inj, &q, 1, &o, NULL), KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_inject_options o;
    int32_t later[4];
  } big;
  memset(&big, 0, sizeof big);
  big.o.struct_size = sizeof big;
  big.later[2] = 1;
  EXPECT_UNCHANGED(&e, kvi_inject(e.inj, &q, 1, &big.o, NULL), KVI_ERR_STRUCT_SIZE);
  rfact_free(&f);
  env_close(&e);
}

/* ------------------------------------------------------------------------ */
/* fp8                                                                       */
/* ------------------------------------------------------------------------ */

static void fp8_case(rng *r, kvi_dtype dt, kvi_scale_mode sm) {
  enum { L = 3, D = 16 };
  kvi_rope_spec specs[L] = {rope(KVI_ROPE_NEOX, 0, 10000.0), nope(), rope(KVI_ROPE_GPTJ, 0, 10000.0)};
  specs[2].scaling = KVI_ROPE_SCALING_YARN;
  specs[2].factor = 4.0;
  specs[2].original_max_position = 1024;
  const env_cfg g = {L, 4, 1, 0, D, specs, KVI_DTYPE_FP32, 4, 16, KVI_CACHE_VLLM_FLASH_ATTN, dt, sm, 4, 8, NULL};
  env e;
  env_open(&e, &g, r);
  char what[120];
  snprintf(what, sizeof what, "%s cache, scale mode %d", cache_dtype_name(dt), (int)sm);
  /* round trip: magnitudes that fit (below 8, scales >= 0.05) */
  rfact f;
  rfact_make(&f, r, 1, 1, L, 7, e.H, D, -6, 2);
  rfact_put(e.s, &f, 0);
  const int32_t t1[] = {6, 2, 7};
  int32_t P[7];
  rand_positions(r, P, 7, 0, 4000, true);
  const uint64_t id = 1;
  kvi_inject_request q = request(1, &id, 1, t1, 3, 2, P, 0);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  const rfact *ff[] = {&f};
  ec_check_request(&e.c, e.rr, ff, 1, t1, 2, P, 0, 0, L, 0.0, NULL, what);
  kvi_capture cp = capture(1, 2, t1, 3, 2, 7, P, 0);
  assert_ok(kvi_encode(e.enc, &cp, 1, NULL));
  rfact got;
  rfact_read(e.s, 1, 2, L, e.H, D, &got);
  check_captured(&got, &f, 0, e.rr, &e.c, P, 0, KVI_DTYPE_FP32, what);
  rfact_free(&got);

  /* saturation: half of the values far beyond the fp8 range */
  rfact s;
  rfact_make(&s, r, 1, 3, L, 5, e.H, D, -6, 2);
  const int hlo = dt == KVI_DTYPE_FP8_E4M3 ? 10 : 17, hhi = dt == KVI_DTYPE_FP8_E4M3 ? 20 : 24;
  const size_t n = (size_t)L * 5 * e.H * D;
  for (size_t i = 0; i < n; i++) {
    if (rng_next(r) & 1) s.k[i] = rand_val(r, hlo, hhi);
    if (rng_next(r) & 1) s.v[i] = rand_val(r, hlo, hhi);
  }
  rfact_put(e.s, &s, 0);
  const int32_t t2[] = {0, 4, 5};
  const uint64_t ids = 3;
  q = request(1, &ids, 1, t2, 3, 3, NULL, 900);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  const uint8_t maxc = ref_fp8_max_code(dt);
  const double fmax = ref_fp8_decode(maxc, dt);
  double y[D];
  int saturated = 0;
  for (int t = 0; t < 5; t++) {
    const int64_t slot = 3 + t;
    for (int l = 0; l < L; l++)
      for (int h = 0; h < e.H; h++)
        for (int kv = 0; kv < 2; kv++) {
          const float *x = rfact_row(&s, kv, l, t, h);
          const float sc = ec_scale(&e.c, kv, l, h);
          const bool rotated = kv == 0 && e.rr[l].style != KVI_ROPE_NONE;
          if (rotated) ref_rotate(&e.rr[l], x, D, 900 + t, y);
          for (int d = 0; d < D; d++) {
            const uint8_t code = *ec_elem(&e.c, kv, l, t2[slot / 4], (int)(slot % 4), h, d, NULL);
            if (ref_fp8_nonfinite(code, dt))
              fail_msg("%s: saturation: token %d layer %d head %d %s[%d] holds a non-finite code 0x%02x", what, t, l,
                       h, kv ? "V" : "K", d, code);
            const double want = rotated ? y[d] : (double)x[d];
            const double scaled = want / sc;
            if (fabs(scaled) >= fmax * (1.0 + 1.0 / 64.0)) {
              saturated++;
              const uint8_t wc = (uint8_t)((scaled < 0 ? 0x80 : 0) | maxc);
              if (code != wc)
                fail_msg("%s: token %d layer %d head %d %s[%d] = %.6g (scale %g) holds 0x%02x, expected the saturated "
                         "0x%02x",
                         what, t, l, h, kv ? "V" : "K", d, want, (double)sc, code, wc);
            } else if (!rotated) {
              if (code != ref_fp8_encode(x[d] / sc, dt))
                fail_msg("%s: token %d layer %d head %d %s[%d]: 0x%02x, expected 0x%02x", what, t, l, h,
                         kv ? "V" : "K", d, code, ref_fp8_encode(x[d] / sc, dt));
            }
          }
        }
  }
  assert_true(saturated > 100);
  /* captured back: saturated values come back as +-max * scale, never inf */
  cp = capture(1, 4, t2, 3, 3, 5, NULL, 900);
  assert_ok(kvi_encode(e.enc, &cp, 1, NULL));
  rfact_read(e.s, 1, 4, L, e.H, D, &got);
  for (int t = 0; t < 5; t++)
    for (int l = 0; l < L; l++)
      for (int h = 0; h < e.H; h++) {
        const float *gv = rfact_row(&got, 1, l, t, h), *gk = rfact_row(&got, 0, l, t, h);
        const float *xv = rfact_row(&s, 1, l, t, h);
        const float sc = ec_scale(&e.c, 1, l, h);
        for (int d = 0; d < D; d++) {
          if (!isfinite(gv[d]) || !isfinite(gk[d]))
            fail_msg("%s: captured saturated fact: token %d layer %d head %d dim %d: K %g V %g", what, t, l, h, d,
                     (double)gk[d], (double)gv[d]);
          if (fabs(xv[d] / sc) >= fmax * (1.0 + 1.0 / 64.0) && gv[d] != copysignf((float)fmax * sc, xv[d]))
            fail_msg("%s: captured V %a, expected %a", what, (double)gv[d], (double)copysignf((float)fmax * sc, xv[d]));
        }
      }
  rfact_free(&got);
  rfact_free(&s);
  rfact_free(&f);
  env_close(&e);
}

static void test_fp8_roundtrip_and_saturation(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  fp8_case(&r, KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_HEAD);
  fp8_case(&r, KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_TENSOR);
  fp8_case(&r, KVI_DTYPE_FP8_E4M3, KVI_SCALE_NONE);
  fp8_case(&r, KVI_DTYPE_FP8_E5M2, KVI_SCALE_PER_TENSOR);
  fp8_case(&r, KVI_DTYPE_FP8_E5M2, KVI_SCALE_PER_HEAD);
}

/* ------------------------------------------------------------------------ */
/* rejected calls change nothing                                             */
/* ------------------------------------------------------------------------ */

enum { EL = 3, ED = 16, EBS = 4, ENB = 12, ETAB = 512 };

typedef struct errenv {
  env e;
  rfact f1, f2, f7; /* tenant 1: ids 1 (5 tokens), 2 (3); tenant 2: id 7 (4) */
  int32_t ta[3], tb[3]; /* table A holds a pre-injected request; table B is poison */
  int32_t posa[8], posb[8];
} errenv;

static void errenv_open(errenv *x, rng *r, uint32_t pages) {
  kvi_rope_spec specs[EL] = {rope(KVI_ROPE_NEOX, 0, 10000.0), nope(), rope(KVI_ROPE_GPTJ, 0, 10000.0)};
  void *tab = rope_table(KVI_DTYPE_BF16, ETAB, ED, 10000.0, 1.0);
  specs[2].cos_sin_table = tab;
  specs[2].table_dtype = KVI_DTYPE_BF16;
  specs[2].table_positions = ETAB;
  const env_cfg g = {EL, 2, 1, 0, ED, specs, KVI_DTYPE_FP32, 4, pages, KVI_CACHE_VLLM_PACKED, KVI_DTYPE_FP16,
                     KVI_SCALE_NONE, EBS, ENB, NULL};
  env_open(&x->e, &g, r);
  free(tab);
  rfact_make(&x->f1, r, 1, 1, EL, 5, x->e.H, ED, -3, 3);
  rfact_make(&x->f2, r, 1, 2, EL, 3, x->e.H, ED, -3, 3);
  rfact_make(&x->f7, r, 2, 7, EL, 4, x->e.H, ED, -3, 3);
  rfact_put(x->e.s, &x->f1, 0);
  rfact_put(x->e.s, &x->f2, 0);
  rfact_put(x->e.s, &x->f7, 0);
  int32_t perm[ENB];
  rand_perm(r, perm, ENB);
  memcpy(x->ta, perm, sizeof x->ta);
  memcpy(x->tb, perm + 3, sizeof x->tb);
  rand_positions(r, x->posa, 8, 0, ETAB, true);
  rand_positions(r, x->posb, 8, 0, ETAB, true);
  const uint64_t ids[] = {1, 2};
  kvi_inject_request q = request(1, ids, 2, x->ta, 3, 2, x->posa, 0); /* slots 2..9 */
  assert_ok(kvi_inject(x->e.inj, &q, 1, NULL, NULL));
}

static void errenv_close(errenv *x) {
  rfact_free(&x->f1);
  rfact_free(&x->f2);
  rfact_free(&x->f7);
  env_close(&x->e);
}

static void test_rejected_inject_changes_nothing(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  errenv x;
  errenv_open(&x, &r, 40);
  env *e = &x.e;
  const uint64_t ids[] = {1, 2}, unknown[] = {1, 99}, other[] = {7}, again[] = {2, 1};
  /* a valid request into table B (poison there), and the bad ones */
  const kvi_inject_request ok = request(1, ids, 2, x.tb, 3, 1, x.posb, 0); /* slots 1..8 */
  kvi_inject_request rq[2];
#define BAD_PAIR(want, ...)                                                                                      \
  do {                                                                                                           \
    kvi_inject_request bad_ = ok;                                                                                \
    __VA_ARGS__;                                                                                                 \
    rq[0] = ok, rq[1] = bad_;                                                                                    \
    EXPECT_UNCHANGED(e, kvi_inject(e->inj, rq, 2, NULL, NULL), want);                                            \
    rq[0] = bad_, rq[1] = ok;                                                                                    \
    EXPECT_UNCHANGED(e, kvi_inject(e->inj, rq, 2, NULL, NULL), want);                                            \
    EXPECT_UNCHANGED(e, kvi_inject(e->inj, &bad_, 1, NULL, NULL), want);                                         \
  } while (0)
  int32_t tneg[3], tbig[3], pneg[8], pbig[8];
  memcpy(tneg, x.tb, sizeof tneg);
  tneg[1] = -1;
  memcpy(tbig, x.tb, sizeof tbig);
  tbig[2] = ENB;
  memcpy(pneg, x.posb, sizeof pneg);
  pneg[5] = -1;
  memcpy(pbig, x.posb, sizeof pbig);
  pbig[7] = ETAB;
  BAD_PAIR(KVI_ERR_NOT_FOUND, bad_.fact_ids = unknown);
  BAD_PAIR(KVI_ERR_NOT_FOUND, bad_.fact_ids = other, bad_.num_facts = 1);
  BAD_PAIR(KVI_ERR_NOT_FOUND, bad_.tenant = 2);
  BAD_PAIR(KVI_ERR_NOT_FOUND, bad_.tenant = 3, bad_.fact_ids = again);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table = tneg);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table = tbig);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.first_slot = 5); /* slots 5..12 need 4 blocks */
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table_len = 2);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table_len = -1);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.first_slot = -1);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = pneg);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = x.posb, bad_.num_positions = 7);  /* the facts have 8 tokens */
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = x.posb, bad_.num_positions = 9);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = x.posb, bad_.num_positions = -1);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = NULL, bad_.num_positions = 8);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = NULL, bad_.start_position = -1);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = pbig);                                      /* past the table */
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = NULL, bad_.start_position = ETAB - 7);     /* last = ETAB */
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.positions = NULL, bad_.start_position = INT32_MAX - 3); /* overflows */
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.num_facts = -1);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.fact_ids = NULL);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table = NULL);
  BAD_PAIR(KVI_ERR_MEMORY_KIND, bad_.block_table_memory = KVI_MEMORY_DEVICE);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table_memory = (kvi_memory)0);
  BAD_PAIR(KVI_ERR_INVALID_ARGUMENT, bad_.block_table_memory = (kvi_memory)3);
#undef BAD_PAIR
  /* the last valid position is fine */
  {
    kvi_inject_request q = ok;
    q.positions = NULL, q.start_position = ETAB - 8;
    const uint64_t h = snapshot(e);
    assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
    assert_true(snapshot(e) != h);
    ec_poison(&e->c); /* back to poison except table A: re-inject A */
    kvi_inject_request qa = request(1, ids, 2, x.ta, 3, 2, x.posa, 0);
    qa.num_positions = 8; /* stated, and right */
    assert_ok(kvi_inject(e->inj, &qa, 1, NULL, NULL));
    /* the first layout (no num_positions) is still read, its positions trusted */
    kvi_inject_request old = qa;
    old.struct_size = offsetof(kvi_inject_request, num_positions);
    old.num_positions = 3; /* past struct_size: not read */
    assert_ok(kvi_inject(e->inj, &old, 1, NULL, NULL));
  }
  /* struct sizes */
  kvi_inject_request small = ok;
  small.struct_size = offsetof(kvi_inject_request, positions);
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, &small, 1, NULL, NULL), KVI_ERR_STRUCT_SIZE);
  small.struct_size = 0;
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, &small, 1, NULL, NULL), KVI_ERR_STRUCT_SIZE);
  /* differing sizes in one array; the 8 bytes past rq3[1] (rq3[2]) are zero,
   * so only the equal-sizes rule rejects it */
  kvi_inject_request rq3[3];
  memset(rq3, 0, sizeof rq3);
  rq3[0] = ok, rq3[1] = ok;
  rq3[1].struct_size = sizeof(kvi_inject_request) + 8;
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, rq3, 2, NULL, NULL), KVI_ERR_STRUCT_SIZE);
  assert_non_null(strstr(kvi_last_error(), "reqs[1].struct_size")); /* the element, by index */
  /* a garbage struct_size is refused before anything past the first element is read */
  rq3[0].struct_size = (size_t)KVI_STRUCT_SIZE_MAX + 1;
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, rq3, 2, NULL, NULL), KVI_ERR_STRUCT_SIZE);
  assert_non_null(strstr(kvi_last_error(), "KVI_STRUCT_SIZE_MAX"));
  rq3[0] = ok;
  rq3[1].struct_size = sizeof(kvi_inject_request) - 8;
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, rq3, 2, NULL, NULL), KVI_ERR_STRUCT_SIZE);
  struct bigreq {
    kvi_inject_request q;
    uint64_t later[2];
  } big[2];
  memset(big, 0, sizeof big);
  big[0].q = ok, big[1].q = ok;
  big[0].q.struct_size = big[1].q.struct_size = sizeof big[0];
  big[1].later[1] = 5; /* a set byte past the known fields */
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, &big[0].q, 2, NULL, NULL), KVI_ERR_STRUCT_SIZE);
  /* arguments */
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, &ok, -1, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  EXPECT_UNCHANGED(e, kvi_inject(e->inj, NULL, 1, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  EXPECT_UNCHANGED(e, kvi_inject(NULL, &ok, 1, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  /* finally the valid request does write (in an array stepped by a larger
   * struct_size with zero tails, next to a request without facts) */
  big[1].later[1] = 0;
  big[1].q = request(2, NULL, 0, NULL, 0, 0, NULL, 0);
  big[1].q.struct_size = sizeof big[0];
  const uint64_t h = snapshot(e);
  assert_ok(kvi_inject(e->inj, &big[0].q, 2, NULL, NULL));
  assert_true(snapshot(e) != h);
  const rfact *fb[] = {&x.f1, &x.f2};
  ec_check_request(&e->c, e->rr, fb, 2, x.tb, 1, x.posb, 0, 0, EL, 0.0, NULL, "the valid request");
  /* a CPU injector's asynchronous errors: nothing latched, nothing skipped */
  int64_t skipped = -1;
  assert_ok(kvi_injector_async_errors(e->inj, &skipped));
  assert_int_equal(skipped, 0);
  assert_ok(kvi_injector_async_errors(e->inj, NULL));
  skipped = -1;
  assert_status(kvi_injector_async_errors(NULL, &skipped), KVI_ERR_INVALID_ARGUMENT);
  assert_int_equal(skipped, -1);
  errenv_close(&x);
}

static void test_rejected_capture_changes_nothing(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  errenv x;
  errenv_open(&x, &r, 40);
  env *e = &x.e;
  /* table A holds facts 1 and 2 of tenant 1 at slots 2..9, positions posa */
  const kvi_capture ok = capture(1, 50, x.ta, 3, 2, 8, x.posa, 0);
  const kvi_capture ok2 = capture(1, 51, x.ta, 3, 4, 3, x.posa + 2, 0);
  kvi_capture cs[3];
  int32_t tneg[3], tbig[3], pneg[8], pbig[8];
  memcpy(tneg, x.ta, sizeof tneg);
  tneg[1] = -3; /* block 1 holds slots 4..7 */
  memcpy(tbig, x.ta, sizeof tbig);
  tbig[0] = ENB + 100;
  memcpy(pneg, x.posa, sizeof pneg);
  pneg[0] = -1;
  memcpy(pbig, x.posa, sizeof pbig);
  pbig[3] = ETAB + 1;
  float emb[4] = {1, 2, 3, 4};
#define BAD_LAST(want, ...)                                                                                      \
  do {                                                                                                           \
    kvi_capture bad_ = capture(1, 52, x.ta, 3, 3, 4, x.posa + 1, 0);                                             \
    __VA_ARGS__;                                                                                                 \
    cs[0] = ok, cs[1] = ok2, cs[2] = bad_;                                                                       \
    EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 3, NULL), want);                                                  \
    EXPECT_UNCHANGED(e, kvi_encode(e->enc, &bad_, 1, NULL), want);                                               \
  } while (0)
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.flags = 0x2u);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.flags = KVI_PUT_REPLACE | 0x80000000u);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.block_table = tneg);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.block_table = tbig);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.first_slot = 10); /* slots 10..13: a 4th block */
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.block_table_len = 1);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.first_slot = -2);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.positions = pneg);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.positions = pbig);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.positions = NULL, bad_.start_position = -5);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.positions = NULL, bad_.start_position = ETAB - 3);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.block_table = NULL);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.num_tokens = 0);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.num_tokens = -4);
  BAD_LAST(KVI_ERR_INVALID_ARGUMENT, bad_.embedding = emb); /* the store keeps no embeddings */
  BAD_LAST(KVI_ERR_EXISTS, bad_.fact_id = 1);               /* tenant 1's fact 1 exists */
  BAD_LAST(KVI_ERR_EXISTS, bad_.tenant = 2, bad_.fact_id = 7);
#undef BAD_LAST
  /* duplicates in one call */
  cs[0] = ok, cs[1] = ok2, cs[2] = ok;
  cs[2].first_slot = 5, cs[2].num_tokens = 2;
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 3, NULL), KVI_ERR_INVALID_ARGUMENT);
  cs[0] = ok, cs[1] = ok;
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  cs[1].flags = KVI_PUT_REPLACE; /* replace does not make a duplicate fine */
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  /* the same id for another tenant is not a duplicate (checked at the end) */
  /* struct sizes */
  memset(cs, 0, sizeof cs); /* the bytes past cs[1] are zero: only the equal-sizes rule rejects */
  cs[0] = ok, cs[1] = ok2;
  cs[1].struct_size = sizeof(kvi_capture) - 8;
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 2, NULL), KVI_ERR_STRUCT_SIZE);
  cs[1].struct_size = sizeof(kvi_capture) + 8;
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 2, NULL), KVI_ERR_STRUCT_SIZE);
  assert_non_null(strstr(kvi_last_error(), "caps[1].struct_size"));
  cs[0].struct_size = offsetof(kvi_capture, flags);
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 1, NULL), KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_capture c;
    uint32_t later[4];
  } big;
  memset(&big, 0, sizeof big);
  big.c = ok;
  big.c.struct_size = sizeof big;
  big.later[3] = 9;
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, &big.c, 1, NULL), KVI_ERR_STRUCT_SIZE);
  /* arguments */
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, &ok, -1, NULL), KVI_ERR_INVALID_ARGUMENT);
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, NULL, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  EXPECT_UNCHANGED(e, kvi_encode(NULL, &ok, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, NULL, 0, NULL), KVI_OK);

  /* capacity: fill the store to one free page */
  const kvi_store_stats st0 = store_stats(e->s);
  const uint64_t free_pages = st0.pages_total - st0.pages_used;
  rfact filler;
  rfact_make(&filler, &r, 77, 1, EL, (int32_t)(free_pages - 1) * 4, e->H, ED, -2, 2);
  rfact_put(e->s, &filler, 0);
  assert_int_equal(store_stats(e->s).pages_total - store_stats(e->s).pages_used, 1);
  cs[0] = ok; /* 8 tokens: 2 pages */
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 1, NULL), KVI_ERR_CAPACITY);
  cs[0] = capture(1, 60, x.ta, 3, 2, 4, x.posa, 0); /* 1 page each: fits alone, not both */
  cs[1] = capture(1, 61, x.ta, 3, 6, 4, x.posa + 4, 0);
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 2, NULL), KVI_ERR_CAPACITY);
  cs[0] = capture(1, 1, x.ta, 3, 2, 5, x.posa, 0); /* a replacement needs room for both copies */
  cs[0].flags = KVI_PUT_REPLACE;
  EXPECT_UNCHANGED(e, kvi_encode(e->enc, cs, 1, NULL), KVI_ERR_CAPACITY);
  cs[0] = capture(1, 60, x.ta, 3, 2, 4, x.posa, 0);
  assert_ok(kvi_encode(e->enc, cs, 1, NULL)); /* one page: fits */
  assert_ok(kvi_store_remove(e->s, 1, 60));
  assert_ok(kvi_store_remove(e->s, 77, 1));
  rfact_free(&filler);

  /* every capture of a good call is stored: two tenants, the same id */
  cs[0] = ok, cs[1] = ok2;
  cs[2] = capture(2, 50, x.ta, 3, 2, 5, x.posa, 0); /* tenant 2 may capture tenant 1's cache slots too */
  assert_ok(kvi_encode(e->enc, cs, 3, NULL));
  rfact got;
  rfact_read(e->s, 1, 50, EL, e->H, ED, &got);
  rfact both;
  {
    /* facts 1 and 2 back to back, as they lie in the cache */
    both = x.f1;
    both.T = 8;
    const size_t row = (size_t)e->H * ED;
    both.k = malloc((size_t)EL * 8 * row * sizeof(float));
    both.v = malloc((size_t)EL * 8 * row * sizeof(float));
    assert_non_null(both.k);
    assert_non_null(both.v);
    for (int l = 0; l < EL; l++)
      for (int t = 0; t < 8; t++)
        for (int kv = 0; kv < 2; kv++) {
          const rfact *src = t < 5 ? &x.f1 : &x.f2;
          memcpy((kv ? both.v : both.k) + ((size_t)l * 8 + t) * row, rfact_row(src, kv, l, t < 5 ? t : t - 5, 0),
                 row * sizeof(float));
        }
  }
  check_captured(&got, &both, 0, e->rr, &e->c, x.posa, 0, KVI_DTYPE_FP32, "capture 50");
  rfact_free(&got);
  rfact_read(e->s, 1, 51, EL, e->H, ED, &got);
  check_captured(&got, &both, 2, e->rr, &e->c, x.posa + 2, 0, KVI_DTYPE_FP32, "capture 51");
  rfact_free(&got);
  rfact_read(e->s, 2, 50, EL, e->H, ED, &got);
  check_captured(&got, &both, 0, e->rr, &e->c, x.posa, 0, KVI_DTYPE_FP32, "tenant 2's capture 50");
  rfact_free(&got);
  /* replacing an existing fact with a capture */
  cs[0] = capture(1, 2, x.ta, 3, 4, 2, x.posa + 2, 0);
  cs[0].flags = KVI_PUT_REPLACE;
  assert_ok(kvi_encode(e->enc, cs, 1, NULL));
  rfact_read(e->s, 1, 2, EL, e->H, ED, &got);
  assert_int_equal(got.T, 2);
  check_captured(&got, &both, 2, e->rr, &e->c, x.posa + 2, 0, KVI_DTYPE_FP32, "replaced fact 2");
  rfact_free(&got);
  rfact_free(&both);
  errenv_close(&x);
}

/* ------------------------------------------------------------------------ */
/* transfer limits                                                           */
/* ------------------------------------------------------------------------ */

static void test_transfer_limits(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  errenv x;
  errenv_open(&x, &r, 40);
  env *e = &x.e;
  kvi_transfer_options to;
  kvi_transfer_options_init(&to, sizeof to);
  assert_int_equal(to.struct_size, sizeof to);
  assert_int_equal(to.max_tokens_per_call, 1 << 20);
  assert_int_equal(to.max_requests_per_call, 4096);
  assert_int_equal(to.max_table_entries_per_call, 1 << 20);
  to.max_tokens_per_call = 8;
  to.max_requests_per_call = 2;
  to.max_table_entries_per_call = 3;
  kvi_injector *inj = NULL;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_injector_create(&inj, e->s, &e->c.lay, &to));
  assert_ok(kvi_encoder_create(&enc, e->s, &e->c.lay, &to));
  int32_t tb5[5];
  memcpy(tb5, x.tb, sizeof x.tb);
  {
    /* two more unused blocks for table B */
    int n = 3;
    for (int32_t b = 0; b < ENB && n < 5; b++) {
      bool used = false;
      for (int i = 0; i < 3; i++) used = used || x.ta[i] == b || x.tb[i] == b;
      if (!used) tb5[n++] = b;
    }
  }
  const uint64_t ids12[] = {1, 2}, ids122[] = {1, 2, 2}, id2[] = {2}, id1[] = {1};
  /* limits exceeded: tokens, requests, table entries */
  kvi_inject_request q = request(1, ids122, 3, tb5, 5, 0, NULL, 0); /* 11 tokens */
  EXPECT_UNCHANGED(e, kvi_inject(inj, &q, 1, NULL, NULL), KVI_ERR_CAPACITY);
  kvi_inject_request three[3] = {request(1, id2, 1, tb5, 5, 0, NULL, 0), request(1, NULL, 0, NULL, 0, 0, NULL, 0),
                                 request(1, NULL, 0, NULL, 0, 0, NULL, 0)};
  EXPECT_UNCHANGED(e, kvi_inject(inj, three, 3, NULL, NULL), KVI_ERR_CAPACITY);
  kvi_inject_request two[2] = {request(1, id1, 1, tb5, 2, 3, NULL, 0),      /* slots 3..7: 2 entries */
                               request(1, id2, 1, tb5 + 2, 3, 3, NULL, 0)}; /* slots 3..5: 2 entries */
  EXPECT_UNCHANGED(e, kvi_inject(inj, two, 2, NULL, NULL), KVI_ERR_CAPACITY);
  /* at the limits: fine */
  q = request(1, ids12, 2, tb5, 3, 3, NULL, 0); /* 8 tokens, slots 3..10: 3 entries */
  uint64_t h = snapshot(e);
  assert_ok(kvi_inject(inj, &q, 1, NULL, NULL));
  assert_true(snapshot(e) != h);
  const rfact *f12[] = {&x.f1, &x.f2};
  ec_check_request(&e->c, e->rr, f12, 2, tb5, 3, NULL, 0, 0, EL, 0.0, NULL, "at the transfer limits");
  /* encoder */
  kvi_capture c1[3] = {capture(1, 90, x.ta, 3, 1, 9, NULL, 0), capture(1, 91, x.ta, 3, 2, 1, NULL, 0),
                       capture(1, 92, x.ta, 3, 3, 1, NULL, 0)};
  EXPECT_UNCHANGED(e, kvi_encode(enc, c1, 1, NULL), KVI_ERR_CAPACITY);     /* 9 tokens */
  assert_ok(kvi_encode(enc, c1 + 1, 2, NULL)); /* 2 captures, 2 tokens: fine */
  assert_ok(kvi_store_remove(e->s, 1, 91));
  assert_ok(kvi_store_remove(e->s, 1, 92));
  c1[0] = capture(1, 90, x.ta, 3, 2, 1, NULL, 0);
  EXPECT_UNCHANGED(e, kvi_encode(enc, c1, 3, NULL), KVI_ERR_CAPACITY);     /* 3 captures */
  kvi_capture c2[2] = {capture(1, 93, x.ta, 3, 3, 2, NULL, 0), capture(1, 94, x.ta, 3, 7, 2, NULL, 0)};
  EXPECT_UNCHANGED(e, kvi_encode(enc, c2, 2, NULL), KVI_ERR_CAPACITY);     /* 4 table entries */
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);

  /* bad options at creation */
  kvi_transfer_options bad = KVI_TRANSFER_OPTIONS_INIT;
  inj = (kvi_injector *)&bad;
  bad.max_tokens_per_call = 0;
  assert_status(kvi_injector_create(&inj, e->s, &e->c.lay, &bad), KVI_ERR_INVALID_ARGUMENT);
  bad = (kvi_transfer_options)KVI_TRANSFER_OPTIONS_INIT;
  bad.max_requests_per_call = -1;
  assert_status(kvi_encoder_create(&enc, e->s, &e->c.lay, &bad), KVI_ERR_INVALID_ARGUMENT);
  bad = (kvi_transfer_options)KVI_TRANSFER_OPTIONS_INIT;
  bad.max_table_entries_per_call = -1;
  assert_status(kvi_injector_create(&inj, e->s, &e->c.lay, &bad), KVI_ERR_INVALID_ARGUMENT);
  bad = (kvi_transfer_options)KVI_TRANSFER_OPTIONS_INIT;
  bad.struct_size = sizeof(size_t);
  assert_status(kvi_injector_create(&inj, e->s, &e->c.lay, &bad), KVI_ERR_STRUCT_SIZE);
  assert_status(kvi_encoder_create(&enc, e->s, &e->c.lay, &bad), KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_transfer_options o;
    int32_t later[3];
  } big;
  memset(&big, 0, sizeof big);
  big.o = (kvi_transfer_options)KVI_TRANSFER_OPTIONS_INIT;
  big.o.struct_size = sizeof big;
  big.later[0] = 1;
  assert_status(kvi_injector_create(&inj, e->s, &e->c.lay, &big.o), KVI_ERR_STRUCT_SIZE);
  assert_ptr_equal(inj, (kvi_injector *)&bad); /* unchanged on error */
  big.later[0] = 0;
  inj = NULL;
  assert_ok(kvi_injector_create(&inj, e->s, &e->c.lay, &big.o));
  kvi_injector_destroy(inj);
  errenv_close(&x);
}

/* ------------------------------------------------------------------------ */
/* creation errors                                                           */
/* ------------------------------------------------------------------------ */

static void expect_create(kvi_store *s, const kvi_cache_layout *lay, kvi_status want, const char *what) {
  kvi_injector *inj = (kvi_injector *)(uintptr_t)0x1234;
  kvi_encoder *enc = (kvi_encoder *)(uintptr_t)0x5678;
  const kvi_status a = kvi_injector_create(&inj, s, lay, NULL);
  const kvi_status b = kvi_encoder_create(&enc, s, lay, NULL);
  if (a != want || b != want) {
    if (a == KVI_OK) kvi_injector_destroy(inj);
    if (b == KVI_OK) kvi_encoder_destroy(enc);
    fail_msg("%s: kvi_injector_create gave %d, kvi_encoder_create %d, expected %d (%s)", what, (int)a, (int)b,
             (int)want, kvi_last_error());
  }
  if (want == KVI_OK) {
    kvi_injector_destroy(inj);
    kvi_encoder_destroy(enc);
    return;
  }
  if (inj != (kvi_injector *)(uintptr_t)0x1234 || enc != (kvi_encoder *)(uintptr_t)0x5678)
    fail_msg("%s: the output handle was written on error", what);
}

static void test_create_errors(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(2, 2, 8, 0, 1);
  const kvi_rope_spec unrotated = nope();
  assert_ok(kvi_model_set_rope(m, -1, &unrotated));
  kvi_store *s = NULL;
  kvi_store_options so = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 16);
  assert_ok(kvi_store_create(&s, m, &so));
  ecache c, c8;
  ec_make(&c, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_FP16, 2, 2, 8, 4, 4, KVI_SCALE_NONE, &r);
  ec_make(&c8, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP8_E4M3, 2, 2, 8, 4, 4, KVI_SCALE_PER_HEAD, &r);
  ecache cg;
  ec_make(&cg, (kvi_cache_preset)EC_GENERIC_KV_BASES, KVI_DTYPE_BF16, 2, 2, 8, 4, 4, KVI_SCALE_NONE, &r);
  expect_create(s, &c.lay, KVI_OK, "the valid layout");
  expect_create(s, &c8.lay, KVI_OK, "the valid fp8 layout");
  expect_create(s, &cg.lay, KVI_OK, "the valid generic layout");
  kvi_cache_layout l;
#define BAD(want, base, ...)                                                                                     \
  do {                                                                                                           \
    l = (base);                                                                                                  \
    __VA_ARGS__;                                                                                                 \
    expect_create(s, &l, want, #__VA_ARGS__);                                                                    \
  } while (0)
  BAD(KVI_ERR_MEMORY_KIND, c.lay, l.memory = KVI_MEMORY_DEVICE);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.memory = (kvi_memory)0);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.memory = (kvi_memory)3);
  BAD(KVI_ERR_MISMATCH, c.lay, l.num_layers = 3);
  BAD(KVI_ERR_MISMATCH, c.lay, l.num_layers = 1);
  BAD(KVI_ERR_MISMATCH, c.lay, l.num_heads = 1);
  BAD(KVI_ERR_MISMATCH, c.lay, l.num_heads = 4);
  BAD(KVI_ERR_MISMATCH, c.lay, l.head_size = 16);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.dtype = (kvi_dtype)0);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.dtype = (kvi_dtype)7);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.block_size = 0);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.num_blocks = 0);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.num_blocks = -4);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.block_stride = -1);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.token_stride = -8);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.head_stride = -8);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.v_offset = -1);
  BAD(KVI_ERR_INVALID_ARGUMENT, cg.lay, l.layer_stride = -1);
  /* missing base pointers */
  void *kl_hole[2] = {c.kl[0], NULL};
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.k_layers = NULL);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.k_layers = kl_hole);
  BAD(KVI_ERR_INVALID_ARGUMENT, cg.lay, l.k_base = NULL);
  BAD(KVI_ERR_INVALID_ARGUMENT, cg.lay, l.v_layers = kl_hole);
  /* scales */
  const float ks[4] = {1, 1, 1, 1}, zero[4] = {1, 0, 1, 1}, neg[4] = {1, 1, -2, 1}, nan4[4] = {1, 1, 1, NAN},
              inf4[4] = {INFINITY, 1, 1, 1};
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.scale_mode = KVI_SCALE_PER_TENSOR, l.k_scales = ks, l.v_scales = ks);
  BAD(KVI_ERR_INVALID_ARGUMENT, cg.lay, l.scale_mode = KVI_SCALE_PER_HEAD, l.k_scales = ks, l.v_scales = ks);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.k_scales = NULL);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.v_scales = NULL);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.scale_mode = (kvi_scale_mode)3);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.k_scales = zero);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.v_scales = neg);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.k_scales = nan4);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.v_scales = inf4);
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.scale_mode = KVI_SCALE_PER_TENSOR, l.k_scales = zero + 1); /* layer 0: 0 */
  BAD(KVI_ERR_INVALID_ARGUMENT, c8.lay, l.scale_mode = KVI_SCALE_PER_TENSOR, l.v_scales = neg + 1);  /* layer 1: -2 */
  /* extents that overflow 64-bit offsets */
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.block_stride = INT64_MAX / 2);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.num_blocks = INT64_MAX / 4);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.v_offset = INT64_MAX - 8);
  BAD(KVI_ERR_INVALID_ARGUMENT, c.lay, l.token_stride = INT64_MAX / 3, l.head_stride = INT64_MAX / 3);
  BAD(KVI_ERR_INVALID_ARGUMENT, cg.lay, l.layer_stride = INT64_MAX / 2 + 1);
  /* struct sizes */
  BAD(KVI_ERR_STRUCT_SIZE, c.lay, l.struct_size = offsetof(kvi_cache_layout, k_layers));
  BAD(KVI_ERR_STRUCT_SIZE, c.lay, l.struct_size = 0);
#undef BAD
  struct {
    kvi_cache_layout l;
    uint64_t later[2];
  } big;
  memset(&big, 0, sizeof big);
  big.l = c.lay;
  big.l.struct_size = sizeof big;
  big.later[1] = 1;
  expect_create(s, &big.l, KVI_ERR_STRUCT_SIZE, "a larger layout with a set byte past the known fields");
  big.later[1] = 0;
  expect_create(s, &big.l, KVI_OK, "a larger layout with zeros past the known fields");
  /* NULLs */
  kvi_injector *inj = NULL;
  kvi_encoder *enc = NULL;
  assert_status(kvi_injector_create(NULL, s, &c.lay, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_encoder_create(NULL, s, &c.lay, NULL), KVI_ERR_INVALID_ARGUMENT);
  expect_create(NULL, &c.lay, KVI_ERR_INVALID_ARGUMENT, "NULL store");
  expect_create(s, NULL, KVI_ERR_INVALID_ARGUMENT, "NULL layout");
  assert_null(inj);
  assert_null(enc);
  kvi_injector_destroy(NULL);
  kvi_encoder_destroy(NULL);
  /* the layout is copied: changing it after creation changes nothing */
  assert_ok(kvi_injector_create(&inj, s, &c.lay, NULL));
  kvi_cache_layout copy = c.lay;
  void *kl_saved[2] = {c.kl[0], c.kl[1]};
  c.lay.block_stride = 1;
  c.kl[0] = NULL; /* the preset's pointer array is copied too */
  rfact f;
  rfact_make(&f, &r, 1, 1, 2, 3, 2, 8, -2, 2);
  rfact_put(s, &f, 0);
  const int32_t tb[] = {3};
  const uint64_t id = 1;
  kvi_inject_request q = request(1, &id, 1, tb, 1, 1, NULL, 7);
  assert_ok(kvi_inject(inj, &q, 1, NULL, NULL));
  c.kl[0] = kl_saved[0], c.kl[1] = kl_saved[1];
  c.lay = copy;
  ref_rope rr[2];
  const kvi_rope_spec none = nope();
  ref_rope_init(&rr[0], &none, 8);
  ref_rope_init(&rr[1], &none, 8);
  const rfact *ff[] = {&f};
  ecmask mask;
  ecmask_make(&mask, &c);
  ec_check_request(&c, rr, ff, 1, tb, 1, NULL, 7, 0, 2, 0.0, &mask, "layout changed after creation");
  ecmask_check_poison(&mask, &c, "layout changed after creation");
  ecmask_free(&mask);
  kvi_injector_destroy(inj);
  rfact_free(&f);
  ec_free(&c);
  ec_free(&c8);
  ec_free(&cg);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* frees on the CPU backend                                                  */
/* ------------------------------------------------------------------------ */

static void test_cpu_frees(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  enum { L = 2, D = 8 };
  const kvi_rope_spec specs[L] = {rope(KVI_ROPE_NEOX, 0, 10000.0), rope(KVI_ROPE_GPTJ, 4, 500.0)};
  const env_cfg g = {L, 2, 1, 0, D, specs, KVI_DTYPE_FP32, 4, 4, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_FP32,
                     KVI_SCALE_NONE, 4, 8, NULL};
  env e;
  env_open(&e, &g, &r);
  assert_int_equal(store_stats(e.s).pages_total, 4);
  rfact a, a2, b, c;
  rfact_make(&a, &r, 1, 1, L, 8, e.H, D, -2, 2);
  rfact_make(&a2, &r, 1, 1, L, 7, e.H, D, -2, 2);
  rfact_make(&b, &r, 1, 2, L, 16, e.H, D, -2, 2);
  rfact_make(&c, &r, 1, 3, L, 8, e.H, D, -2, 2);
  const int32_t tb[] = {5, 0, 3, 6};
  const uint64_t id1 = 1;
  /* inject, then remove at once: the CPU has finished, the pages are free */
  rfact_put(e.s, &a, 0);
  kvi_inject_request q = request(1, &id1, 1, tb, 4, 2, NULL, 30);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  assert_ok(kvi_store_remove(e.s, 1, 1));
  kvi_store_stats st = store_stats(e.s);
  assert_int_equal(st.pages_used, 0);
  assert_int_equal(st.facts, 0);
  const rfact *fa[] = {&a};
  ec_check_request(&e.c, e.rr, fa, 1, tb, 2, NULL, 30, 0, L, 0.0, NULL, "injected, then removed");
  assert_status(kvi_inject(e.inj, &q, 1, NULL, NULL), KVI_ERR_NOT_FOUND);
  rfact_put(e.s, &b, 0); /* every page */
  assert_int_equal(store_stats(e.s).pages_used, 4);
  assert_ok(kvi_store_remove(e.s, 1, 2));

  /* a replaced fact's pages are reused */
  rfact_put(e.s, &a, 0);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  rfact_put(e.s, &a2, KVI_PUT_REPLACE); /* needs room for both: 4 pages */
  st = store_stats(e.s);
  assert_int_equal(st.pages_used, 2);
  assert_int_equal(st.facts, 1);
  ec_poison(&e.c);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  const rfact *fa2[] = {&a2};
  ecmask mask;
  ecmask_make(&mask, &e.c);
  ec_check_request(&e.c, e.rr, fa2, 1, tb, 2, NULL, 30, 0, L, 0.0, &mask, "the replacement");
  ecmask_check_poison(&mask, &e.c, "the replacement");
  ecmask_free(&mask);
  rfact_put(e.s, &c, 0); /* the two pages the old copy had */
  assert_int_equal(store_stats(e.s).pages_used, 4);
  rfact one;
  rfact_make(&one, &r, 1, 9, L, 1, e.H, D, -2, 2);
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 1, e.H, D, one.k, one.v);
  assert_status(kvi_store_put(e.s, 1, 9, &v, NULL, NULL), KVI_ERR_CAPACITY);

  /* replacing by capture: needs room for both, then frees the old copy */
  kvi_capture cp = capture(1, 3, tb, 4, 2, 7, NULL, 30);
  cp.flags = KVI_PUT_REPLACE;
  EXPECT_UNCHANGED(&e, kvi_encode(e.enc, &cp, 1, NULL), KVI_ERR_CAPACITY);
  assert_ok(kvi_store_remove(e.s, 1, 1));
  assert_ok(kvi_encode(e.enc, &cp, 1, NULL));
  st = store_stats(e.s);
  assert_int_equal(st.pages_used, 2);
  assert_int_equal(st.facts, 1);
  rfact got;
  rfact_read(e.s, 1, 3, L, e.H, D, &got);
  assert_int_equal(got.T, 7);
  check_captured(&got, &a2, 0, e.rr, &e.c, NULL, 30, KVI_DTYPE_FP32, "fact 3 replaced by a capture");
  rfact_free(&got);
  rfact_put(e.s, &a, 0); /* and the freed pages serve a new fact */
  assert_int_equal(store_stats(e.s).pages_used, 4);
  /* an injection reading a fact, then that fact replaced and removed */
  ec_poison(&e.c);
  const uint64_t both[] = {3, 1};
  const int32_t tb2[] = {1, 2, 4, 7};
  q = request(1, both, 2, tb2, 4, 0, NULL, 0);
  assert_ok(kvi_inject(e.inj, &q, 1, NULL, NULL));
  assert_ok(kvi_store_remove(e.s, 1, 3));
  assert_ok(kvi_store_remove(e.s, 1, 1));
  assert_int_equal(store_stats(e.s).pages_used, 0);
  rfact_free(&one);
  rfact_free(&a);
  rfact_free(&a2);
  rfact_free(&b);
  rfact_free(&c);
  env_close(&e);
}

/* ------------------------------------------------------------------------ */
/* calls larger than one launch                                              */
/* ------------------------------------------------------------------------ */

/* kvi_encode plans and launches a large call in chunks of captures
 * (lib/xfer/encode.c, KVI__CAPTURE_CHUNK = 65,536, so 1,100 captures are one
 * chunk): a call of 1,100 captures stores exactly what 1,100 calls of one
 * capture store, in bf16 and
 * fp8 stores (whose page scales are computed per launch), with tenants
 * interleaved, keys out of order, explicit and consecutive positions, and
 * replacements (one of them of a tenant's only fact); a rejected call of
 * that size, failing in its last chunk, changes nothing. */
enum { CN = 1100, CNB = 300, CBS = 4 };

static void chunk_captures(rng *r, kvi_capture *cs, int32_t *table, int32_t *pos) {
  for (int32_t b = 0; b < CNB; b++) table[b] = b;
  for (int32_t b = CNB - 1; b > 0; b--) { /* a scattered table */
    const int32_t k = (int32_t)rng_range(r, 0, b), t = table[b];
    table[b] = table[k], table[k] = t;
  }
  static const uint64_t tenants[] = {1, 2, 3};
  for (int32_t i = 0; i < CN; i++) {
    const int32_t n = (int32_t)rng_range(r, 1, 9);
    const int64_t first = rng_range(r, 0, (int64_t)CNB * CBS - n);
    /* ids out of order within each tenant; tenants change every few captures */
    const uint64_t tenant = tenants[(i / 3) % 3], id = 1000 + (uint64_t)((i * 7919) % CN);
    const bool explicit_pos = rng_range(r, 0, 3) == 0;
    if (explicit_pos) rand_positions(r, pos + (size_t)i * 9, n, 0, 3000, true);
    cs[i] = capture(tenant, id, table, CNB, first, n, explicit_pos ? pos + (size_t)i * 9 : NULL,
                    (int32_t)rng_range(r, 0, 3000));
  }
  /* replacements: the first capture replaces tenant 9's only fact (its
   * tenant goes and comes back), one of tenant 2's facts is replaced late */
  cs[0].tenant = 9, cs[0].fact_id = 5, cs[0].flags = KVI_PUT_REPLACE;
  cs[1].tenant = 9, cs[1].fact_id = 6;
  cs[CN - 2].tenant = 2, cs[CN - 2].fact_id = 7, cs[CN - 2].flags = KVI_PUT_REPLACE;
}

static void chunk_env(env *e, kvi_dtype store_dt, const kvi_rope_spec *specs, rng *r, const rfact *pre, int npre) {
  const env_cfg g = {2, 2, 1, 0, 16, specs, store_dt, 4, 3 * CN, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16,
                     KVI_SCALE_NONE, CBS, CNB, NULL};
  env_open(e, &g, r);
  for (int i = 0; i < npre; i++) rfact_put(e->s, &pre[i], 0);
}

static void test_capture_chunks(void **state) {
  (void)state;
  const kvi_rope_spec specs[2] = {rope(KVI_ROPE_NEOX, 0, 10000.0), rope(KVI_ROPE_GPTJ, 8, 5e5)};
  const kvi_dtype dts[] = {KVI_DTYPE_BF16, KVI_DTYPE_FP8_E4M3};
  for (size_t di = 0; di < sizeof dts / sizeof dts[0]; di++) {
    rng r;
    rng_seed(&r, __func__);
    kvi_capture *cs = malloc(CN * sizeof *cs);
    int32_t *table = malloc(CNB * sizeof *table), *pos = malloc((size_t)CN * 9 * sizeof *pos);
    assert_non_null(cs);
    assert_non_null(table);
    assert_non_null(pos);
    chunk_captures(&r, cs, table, pos);
    rfact pre[2];
    rfact_make(&pre[0], &r, 9, 5, 2, 6, 2, 16, -2, 2);
    rfact_make(&pre[1], &r, 2, 7, 2, 3, 2, 16, -2, 2);
    rng r2 = r; /* the same cache contents for both stores */
    env one, many;
    chunk_env(&one, dts[di], specs, &r, pre, 2);
    chunk_env(&many, dts[di], specs, &r2, pre, 2);
    assert_true(ec_hash(&one.c) == ec_hash(&many.c));

    /* rejected calls of the full size, failing late, change nothing */
    const kvi_capture keep_last = cs[CN - 1], keep_replace = cs[CN - 2];
    cs[CN - 1].first_slot = (int64_t)CNB * CBS; /* past the table */
    EXPECT_UNCHANGED(&one, kvi_encode(one.enc, cs, CN, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_encode", "capture 1099");
    cs[CN - 1] = cs[700]; /* a duplicate, 399 captures later */
    EXPECT_UNCHANGED(&one, kvi_encode(one.enc, cs, CN, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_encode", "capture 1099 repeats");
    cs[CN - 1] = keep_last;
    cs[CN - 2].flags = 0; /* tenant 2's fact 7 exists */
    EXPECT_UNCHANGED(&one, kvi_encode(one.enc, cs, CN, NULL), KVI_ERR_EXISTS);
    assert_last_error_has("kvi_encode", "capture 1098");
    /* ... and a bad flag after it is reported first: checks without the lock come first */
    cs[CN - 1].flags = 0x4u;
    EXPECT_UNCHANGED(&one, kvi_encode(one.enc, cs, CN, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_encode", "capture 1099: unknown flag");
    cs[CN - 1] = keep_last;
    cs[CN - 2] = keep_replace;
    /* keys in increasing order (no hash set needed) with one repeated next to itself */
    {
      kvi_capture *sorted = malloc(CN * sizeof *sorted);
      assert_non_null(sorted);
      for (int32_t i = 0; i < CN; i++) sorted[i] = capture(3, 5000 + (uint64_t)i, table, CNB, i % 100, 2, NULL, 0);
      sorted[900].fact_id = sorted[899].fact_id;
      EXPECT_UNCHANGED(&one, kvi_encode(one.enc, sorted, CN, NULL), KVI_ERR_INVALID_ARGUMENT);
      assert_last_error_has("kvi_encode", "capture 900 repeats");
      free(sorted);
    }

    /* one call against one call per capture */
    assert_ok(kvi_encode(one.enc, cs, CN, NULL));
    for (int32_t i = 0; i < CN; i++) assert_ok(kvi_encode(many.enc, &cs[i], 1, NULL));
    const kvi_store_stats a = store_stats(one.s), b = store_stats(many.s);
    assert_int_equal(a.facts, b.facts);
    assert_int_equal(a.facts, CN); /* two of them replaced the facts put first */
    assert_int_equal(a.tenants, 4);
    assert_int_equal(a.pages_used, b.pages_used);
    assert_int_equal(a.bytes_payload, b.bytes_payload);
    for (int32_t i = 0; i < CN; i++) {
      rfact x, y;
      rfact_read(one.s, cs[i].tenant, cs[i].fact_id, 2, one.H, 16, &x);
      rfact_read(many.s, cs[i].tenant, cs[i].fact_id, 2, many.H, 16, &y);
      assert_int_equal(x.T, cs[i].num_tokens);
      assert_int_equal(y.T, cs[i].num_tokens);
      const size_t n = (size_t)x.L * x.T * x.H * x.D * sizeof(float);
      if (memcmp(x.k, y.k, n) || memcmp(x.v, y.v, n))
        fail_msg("%s store: capture %d (tenant %llu, fact %llu) differs between one call and one call per capture",
                 di ? "fp8" : "bf16", (int)i, (unsigned long long)cs[i].tenant, (unsigned long long)cs[i].fact_id);
      rfact_free(&x);
      rfact_free(&y);
    }
    rfact_free(&pre[0]);
    rfact_free(&pre[1]);
    env_close(&one);
    env_close(&many);
    free(cs);
    free(table);
    free(pos);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_capture_inject_invariant),
      cmocka_unit_test(test_capture_inject_invariant_bf16_store),
      cmocka_unit_test(test_context_window_encoding),
      cmocka_unit_test(test_batched_inject),
      cmocka_unit_test(test_inject_batched),
      cmocka_unit_test(test_inject_plan),
      cmocka_unit_test(test_inject_plan_long_lists),
      cmocka_unit_test(test_equal_dtypes_copy_bits),
      cmocka_unit_test(test_layer_range),
      cmocka_unit_test(test_fp8_roundtrip_and_saturation),
      cmocka_unit_test(test_rejected_inject_changes_nothing),
      cmocka_unit_test(test_rejected_capture_changes_nothing),
      cmocka_unit_test(test_transfer_limits),
      cmocka_unit_test(test_capture_chunks),
      cmocka_unit_test(test_create_errors),
      cmocka_unit_test(test_cpu_frees),
  };
  return cmocka_run_group_tests_name("unit-inject", tests, NULL, NULL);
}
