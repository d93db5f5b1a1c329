/*
 * internal-segment-plan: the injector's segment planners (lib/xfer/plan.c)
 * against an independent model of what the kernels rely on.
 *  - kvi__plan_run (a fact's tokens cut into segments) and kvi__plan_request (a
 *    request's host block-table slice), driven as kvi_inject drives them:
 *    every token of a request lands in exactly one segment, at its sequence
 *    slot, in its page, with its position; no segment crosses a page or
 *    exceeds the injector's segment length; the segment count is the least
 *    such cut and within the bound the plan's buffer is sized by; each
 *    token's cache block is found inside the request's table slice; ragged,
 *    empty and the largest requests; nothing written past what was planned.
 *  - retr_prepare (kvi_retrieve_inject's device path up to its plan): the
 *    reserve of every request (facts, tokens, segments per fact) lets any
 *    choice of the tenant's facts land inside the reserved segments and the
 *    request's table slice; bad requests fail with the right error and leave
 *    no plan behind.
 * Built on CPU stores: no GPU needed.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#include "xfer/xfer.h"

/* ------------------------------------------------------------------------ */
/* fixtures                                                                 */
/* ------------------------------------------------------------------------ */

#define BS 16 /* cache tokens per block */
#define NB 64 /* cache blocks */

typedef struct rig {
  kvi_model *m;
  kvi_store *s;
  kvi_injector *inj;
  float *cache;
  int32_t P, D, seg;
} rig;

/* A one-layer, one-head CPU store of pages of P tokens, head size D (D
 * decides the injector's segment length), `facts_pages` pages of room, with
 * embeddings of dim 4 when `emb`; an injector over a host cache of NB
 * blocks of BS tokens, with the transfer limits `lim` (NULL: defaults). */
static void rig_make(rig *g, int32_t P, int32_t D, uint64_t facts_pages, bool emb, const kvi_transfer_options *lim) {
  memset(g, 0, sizeof *g);
  g->m = make_model(1, 1, D, 0, 1);
  const kvi_rope_spec rope = KVI_ROPE_SPEC_INIT; /* rotary_dim D: half of D decides the segment length */
  assert_ok(kvi_model_set_rope(g->m, 0, &rope));
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, (facts_pages + 1) * (uint64_t)P * 2 * D * 4);
  if (emb) o.embedding_dim = 4;
  assert_ok(kvi_store_create(&g->s, g->m, &o));
  const int64_t plane = (int64_t)NB * BS * D;
  g->cache = calloc((size_t)(2 * plane), sizeof *g->cache);
  assert_non_null(g->cache);
  kvi_cache_layout l = KVI_CACHE_LAYOUT_INIT;
  l.memory = KVI_MEMORY_HOST;
  l.dtype = KVI_DTYPE_FP32;
  l.num_layers = 1;
  l.num_heads = 1;
  l.head_size = D;
  l.block_size = BS;
  l.num_blocks = NB;
  l.block_stride = (int64_t)BS * D;
  l.token_stride = D;
  l.head_stride = D;
  l.k_base = g->cache;
  l.v_offset = plane;
  assert_ok(kvi_injector_create(&g->inj, g->s, &l, lim));
  g->P = P;
  g->D = D;
  g->seg = kvi__injector_seg_tokens(g->inj);
  assert_true(g->seg >= 1 && g->seg <= 64 && g->seg <= P);
}

static void rig_free(rig *g) {
  kvi_injector_destroy(g->inj);
  kvi_store_destroy(g->s);
  kvi_model_destroy(g->m);
  free(g->cache);
}

/* The model's segment count of a fact of `tokens` tokens: per page, its
 * tokens in runs of at most seg. */
static int64_t model_segs(int64_t tokens, int32_t P, int32_t seg) {
  int64_t n = 0;
  for (int64_t t0 = 0; t0 < tokens; t0 += P) {
    const int64_t in = tokens - t0 < P ? tokens - t0 : P;
    n += (in + seg - 1) / seg;
  }
  return n;
}

/* ------------------------------------------------------------------------ */
/* kvi__plan_run and kvi__plan_request                                      */
/* ------------------------------------------------------------------------ */

#define GUARD 4 /* sentinel entries past the model's count */

/* One request of the model: facts back to back from first_slot on. */
typedef struct mreq {
  int64_t first_slot, start_position;
  int32_t nfacts;
  int64_t tokens[8];
  int pos_kind; /* 0: start_position on, 1: int32 positions, 2: int64 positions */
  bool host_table;
} mreq;

static const kvi__xseg SENT = {-7, 0xdeadbeefu, -7, -7, 0xbeef, 0xbeef, -7};

static bool seg_is_sentinel(const kvi__xseg *s) {
  return s->seq0 == SENT.seq0 && s->page == SENT.page && s->req == SENT.req && s->pos0 == SENT.pos0 &&
         s->tok0 == SENT.tok0 && s->ntok == SENT.ntok && s->explicit_pos == SENT.explicit_pos;
}

/* Plans the requests as kvi_inject does (kvi__plan_request, then kvi__plan_run
 * per fact, facts back to back) and checks the plan against the model. */
static void check_requests(const rig *g, const mreq *rq, int32_t n, int32_t *table, int32_t table_len, rng *r) {
  const int32_t P = g->P, seg = g->seg;
  /* the model's counts and the inputs: page ids and positions per fact */
  int64_t want_segs = 0, want_pos = 0, want_tab = 0, bound = 0;
  uint32_t *pages[8][8];
  int64_t *pos64[8][8];
  int32_t *pos32[8][8];
  for (int32_t i = 0; i < n; i++) {
    int64_t tok = 0;
    for (int32_t f = 0; f < rq[i].nfacts; f++) {
      const int64_t T = rq[i].tokens[f], np = (T + P - 1) / P;
      want_segs += model_segs(T, P, seg);
      bound += kvi__plan_segs_for(g->inj, np);
      /* the bound the plan's buffer is sized by holds the cut */
      assert_true(model_segs(T, P, seg) <= kvi__plan_segs_for(g->inj, np));
      pages[i][f] = malloc((size_t)(np ? np : 1) * sizeof(uint32_t));
      for (int64_t p = 0; p < np; p++) pages[i][f][p] = (uint32_t)rng_range(r, 0, 1 << 30);
      pos64[i][f] = malloc((size_t)(T ? T : 1) * sizeof(int64_t));
      pos32[i][f] = malloc((size_t)(T ? T : 1) * sizeof(int32_t));
      for (int64_t t = 0; t < T; t++) {
        const int32_t v = t % 5 == 0 ? INT32_MAX - 1 - (int32_t)t : (int32_t)rng_range(r, 0, INT32_MAX - 1);
        pos64[i][f][t] = v;
        pos32[i][f][t] = v;
      }
      if (rq[i].pos_kind) want_pos += T;
      tok += T;
    }
    if (tok > 0 && rq[i].host_table) want_tab += (rq[i].first_slot + tok - 1) / BS - rq[i].first_slot / BS + 1;
  }
  /* the arrays: GUARD sentinels past the model's counts, a prefix before */
  const int32_t pre_segs = 3, pre_pos = 5, pre_tab = 2;
  kvi__xseg *segs = malloc((size_t)(pre_segs + want_segs + GUARD) * sizeof *segs);
  int32_t *positions = malloc((size_t)(pre_pos + want_pos + GUARD) * sizeof *positions);
  const size_t tab_off = 64; /* the tables' byte offset in buf */
  char *buf = malloc(tab_off + (size_t)(pre_tab + want_tab + GUARD) * sizeof(int32_t));
  kvi__xreq *reqs = malloc((size_t)(1 + n) * sizeof *reqs);
  for (int64_t i = 0; i < pre_segs + want_segs + GUARD; i++) segs[i] = SENT;
  for (int64_t i = 0; i < pre_pos + want_pos + GUARD; i++) positions[i] = -77;
  int32_t *tables = (int32_t *)(buf + tab_off);
  for (int64_t i = 0; i < pre_tab + want_tab + GUARD; i++) tables[i] = -55;
  memset(&reqs[0], 0x5a, sizeof reqs[0]);
  kvi__plan_view v = {segs, reqs, positions, tables, buf, NULL, pre_segs, 1, pre_pos, pre_tab};

  for (int32_t i = 0; i < n; i++) {
    int64_t tok = 0;
    for (int32_t f = 0; f < rq[i].nfacts; f++) tok += rq[i].tokens[f];
    const int32_t ri = kvi__plan_request_into(g->inj, &v, table, table_len, rq[i].host_table, rq[i].first_slot, tok);
    assert_int_equal(ri, 1 + i);
    int64_t done = 0;
    for (int32_t f = 0; f < rq[i].nfacts; f++) {
      const void *pos = rq[i].pos_kind == 1   ? (const void *)pos32[i][f]
                        : rq[i].pos_kind == 2 ? (const void *)pos64[i][f]
                                              : NULL;
      kvi__plan_run_into(g->inj, &v, ri, rq[i].first_slot + done, rq[i].tokens[f], pos, rq[i].pos_kind == 2,
                         (int32_t)(rq[i].start_position + done), pages[i][f]);
      done += rq[i].tokens[f];
    }
  }
  /* counts: the least cut, within the buffer's bound; the prefixes and
   * everything past the counts untouched */
  assert_int_equal(v.nsegs, pre_segs + want_segs);
  assert_true(want_segs <= bound);
  assert_int_equal(v.ntok, pre_pos + want_pos);
  assert_int_equal(v.ntables, pre_tab + want_tab);
  assert_int_equal(v.nreqs, 1 + n);
  for (int32_t i = 0; i < pre_segs; i++) assert_true(seg_is_sentinel(&segs[i]));
  for (int32_t i = 0; i < GUARD; i++) assert_true(seg_is_sentinel(&segs[pre_segs + want_segs + i]));
  for (int32_t i = 0; i < pre_pos; i++) assert_int_equal(positions[i], -77);
  for (int32_t i = 0; i < GUARD; i++) assert_int_equal(positions[pre_pos + want_pos + i], -77);
  for (int32_t i = 0; i < pre_tab; i++) assert_int_equal(tables[i], -55);
  for (int32_t i = 0; i < GUARD; i++) assert_int_equal(tables[pre_tab + want_tab + i], -55);

  /* the model: per request, each of its tokens covered exactly once */
  int64_t si = pre_segs;
  for (int32_t i = 0; i < n; i++) {
    const kvi__xreq *q = &reqs[1 + i];
    int64_t tok = 0;
    for (int32_t f = 0; f < rq[i].nfacts; f++) tok += rq[i].tokens[f];
    /* the request's table: a host table's slice of exactly its blocks, copied */
    if (tok > 0 && rq[i].host_table) {
      const int64_t b0 = rq[i].first_slot / BS, b1 = (rq[i].first_slot + tok - 1) / BS;
      assert_null(q->table);
      assert_int_equal(q->first_block, b0);
      assert_int_equal(q->table_len, b1 - b0 + 1);
      assert_true(q->table_off >= (int64_t)tab_off && (q->table_off - (int64_t)tab_off) % 4 == 0);
      const int32_t *slice = (const int32_t *)(buf + q->table_off);
      for (int64_t b = b0; b <= b1; b++) assert_int_equal(slice[b - b0], table[b]);
    } else {
      assert_ptr_equal(q->table, table);
      assert_int_equal(q->first_block, 0);
      assert_int_equal(q->table_len, table_len);
      assert_int_equal(q->table_off, 0);
    }
    const int32_t *lookup = q->table ? q->table : (const int32_t *)(buf + q->table_off);
    int64_t done = 0;
    for (int32_t f = 0; f < rq[i].nfacts; f++) {
      const int64_t T = rq[i].tokens[f], fs0 = rq[i].first_slot + done;
      uint8_t *hit = calloc((size_t)(T ? T : 1), 1);
      const int64_t nseg = model_segs(T, P, seg);
      for (int64_t k = 0; k < nseg; k++, si++) {
        const kvi__xseg *s = &segs[si];
        assert_int_equal(s->req, 1 + i);
        assert_true(s->ntok >= 1 && s->ntok <= seg);
        const int64_t t = s->seq0 - fs0; /* the fact's token at the segment's start */
        assert_true(t >= 0 && t + s->ntok <= T);
        assert_int_equal(s->tok0, t % P);                /* where it sits in its page */
        assert_true(s->tok0 + s->ntok <= P);             /* no page crossed */
        assert_int_equal(s->page, pages[i][f][t / P]);   /* its page */
        assert_int_equal(s->explicit_pos, rq[i].pos_kind != 0);
        for (int32_t j = 0; j < s->ntok; j++) {
          assert_int_equal(hit[t + j], 0);
          hit[t + j] = 1;
          const int64_t want = rq[i].pos_kind ? pos32[i][f][t + j] : rq[i].start_position + done + t + j;
          const int64_t got = s->explicit_pos ? positions[s->pos0 + j] : (int64_t)s->pos0 + j;
          if (got != want)
            fail_msg("request %d fact %d token %lld: position %lld, expected %lld", (int)i, (int)f,
                     (long long)(t + j), (long long)got, (long long)want);
          /* its cache block, through the request's table (a device
           * table is the caller's own: only its bounds are the plan's) */
          const int64_t seq = s->seq0 + j, b = seq / BS - q->first_block;
          assert_true(b >= 0 && b < q->table_len);
          if (!q->table) assert_int_equal(lookup[b], table[seq / BS]);
        }
      }
      for (int64_t t = 0; t < T; t++) assert_int_equal(hit[t], 1);
      free(hit);
      done += T;
      free(pages[i][f]);
      free(pos64[i][f]);
      free(pos32[i][f]);
    }
  }
  assert_int_equal(si, pre_segs + want_segs);
  free(segs);
  free(positions);
  free(buf);
  free(reqs);
}

/* One fact per request over sizes around the page and segment lengths. */
static void test_plan_run_sizes(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "test_plan_run_sizes");
  static const int32_t Ps[] = {1, 2, 3, 16, 17, 64, 100, 4096};
  static const int32_t Ds[] = {4, 128, 256}; /* segments of 64, 32 and 16 tokens */
  int32_t table[NB];
  for (int32_t b = 0; b < NB; b++) table[b] = (b * 37 + 11) % NB;
  for (size_t pi = 0; pi < sizeof Ps / sizeof *Ps; pi++)
    for (size_t di = 0; di < sizeof Ds / sizeof *Ds; di++) {
      rig g;
      rig_make(&g, Ps[pi], Ds[di], 1, false, NULL);
      const int32_t P = g.P, seg = g.seg;
      /* segments: 64, 32 and 16 tokens for D 4, 128 and 256, at most a page */
      const int32_t want_seg = Ds[di] == 4 ? 64 : Ds[di] == 128 ? 32 : 16;
      assert_int_equal(seg, want_seg < P ? want_seg : P);
      const int64_t sizes[] = {0, 1, seg - 1, seg, seg + 1, P - 1, P, P + 1, 2 * P + seg + 1, NB * BS - 1};
      for (size_t si = 0; si < sizeof sizes / sizeof *sizes; si++)
        for (int kind = 0; kind < 3; kind++) {
          const int64_t T = sizes[si];
          if (T < 0 || T > NB * BS) continue;
          mreq q;
          memset(&q, 0, sizeof q);
          q.nfacts = 1;
          q.tokens[0] = T;
          q.first_slot = rng_range(&r, 0, NB * BS - T);
          q.start_position = kind == 0 && si % 2 ? INT32_MAX - T : rng_range(&r, 0, 1 << 20);
          q.pos_kind = kind;
          q.host_table = si % 3 != 0;
          check_requests(&g, &q, 1, table, NB, &r);
        }
      rig_free(&g);
    }
}

/* Several ragged requests a call: facts of mixed sizes back to back, empty
 * facts and empty requests, host and device tables, every position form. */
static void test_plan_requests_ragged(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "test_plan_requests_ragged");
  int32_t table[NB];
  for (int32_t b = 0; b < NB; b++) table[b] = NB - 1 - b;
  static const int32_t Ps[] = {1, 5, 16, 48, 256};
  for (size_t pi = 0; pi < sizeof Ps / sizeof *Ps; pi++) {
    rig g;
    rig_make(&g, Ps[pi], pi % 2 ? 128 : 4, 1, false, NULL);
    for (int rep = 0; rep < 60; rep++) {
      mreq q[8];
      const int32_t n = (int32_t)rng_range(&r, 1, 8);
      for (int32_t i = 0; i < n; i++) {
        memset(&q[i], 0, sizeof q[i]);
        q[i].nfacts = (int32_t)rng_range(&r, 0, 8);
        int64_t tok = 0;
        for (int32_t f = 0; f < q[i].nfacts; f++) {
          const int64_t cap = NB * BS / 2 - tok;
          q[i].tokens[f] = rng_range(&r, 0, 4) == 0 ? 0 : rng_range(&r, 1, cap / 4 + 2);
          if (q[i].tokens[f] > cap) q[i].tokens[f] = 0;
          tok += q[i].tokens[f];
        }
        q[i].first_slot = rng_range(&r, 0, NB * BS - tok);
        q[i].start_position = rng_range(&r, 0, 1 << 24);
        q[i].pos_kind = (int)rng_range(&r, 0, 2);
        q[i].host_table = rng_range(&r, 0, 4) != 0;
      }
      check_requests(&g, q, n, table, NB, &r);
    }
    rig_free(&g);
  }
}

/* The largest: pages of 4,096 tokens, a fact of three pages and a bit at
 * the last sequence slots a table of 2^31 - 1 entries reaches, positions up
 * to INT32_MAX - 1. */
static void test_plan_run_largest(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "test_plan_run_largest");
  rig g;
  rig_make(&g, 4096, 4, 1, false, NULL);
  const int64_t T = 3 * 4096 + 77;
  static int32_t dev_table[1]; /* a device table of INT32_MAX entries: only referenced, never read */
  const int32_t len = INT32_MAX;
  mreq q;
  memset(&q, 0, sizeof q);
  q.nfacts = 1;
  q.tokens[0] = T;
  q.first_slot = (int64_t)len * BS - T;
  q.start_position = INT32_MAX - T;
  q.host_table = false;
  for (int kind = 0; kind < 3; kind++) {
    q.pos_kind = kind;
    check_requests(&g, &q, 1, dev_table, len, &r);
  }
  rig_free(&g);
}

/* ------------------------------------------------------------------------ */
/* retr_prepare                                                             */
/* ------------------------------------------------------------------------ */

/* Puts `n` facts of tokens[i] tokens (ids id0..) for a tenant, with embeddings. */
static void put_facts(rig *g, uint64_t tenant, uint64_t id0, const int32_t *tokens, int32_t n) {
  for (int32_t i = 0; i < n; i++) {
    kvbuf b;
    kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, 1, tokens[i], 1, g->D);
    kvbuf_fill_tag(&b, id0 + (uint64_t)i);
    const float e[4] = {1.0f, (float)i, 0.5f, -1.0f};
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = e;
    assert_ok(kvi_store_put(g->s, tenant, id0 + (uint64_t)i, &b.v, &po, NULL));
    kvbuf_free(&b);
  }
}

/* The tenants of the retrieve rigs: facts and their largest size. */
#define RT 4
static const int32_t rt_counts[RT] = {5, 1, 1030, 0}; /* tenant 4 never gets facts; tenant 9 is unknown */

static int32_t rt_tokens(int32_t t, int32_t i, int32_t P) {
  if (t == 0) return (int32_t[]){7, 2 * P + 1, 1, P, 3}[i];
  if (t == 1) return 1;
  return 1;
}

static void rt_make(rig *g, int32_t P, int32_t D, const kvi_transfer_options *lim) {
  rig_make(g, P, D, 2200, true, lim);
  for (int32_t t = 0; t < RT; t++) {
    int32_t tok[1030];
    for (int32_t i = 0; i < rt_counts[t]; i++) tok[i] = rt_tokens(t, i, P);
    put_facts(g, (uint64_t)t + 1, 1000 * (uint64_t)(t + 1), tok, rt_counts[t]);
  }
}

/* The model's reserve of a request: facts min(count, k), each of at most the
 * tenant's largest fact. */
static void model_reserve(const rig *g, uint64_t tenant, int32_t k, int32_t *nres, int32_t *longest) {
  *nres = 0, *longest = 0;
  if (tenant < 1 || tenant > RT) return;
  const int32_t t = (int32_t)tenant - 1;
  *nres = rt_counts[t] < k ? rt_counts[t] : k;
  for (int32_t i = 0; i < rt_counts[t]; i++)
    if (rt_tokens(t, i, g->P) > *longest) *longest = rt_tokens(t, i, g->P);
}

/* Checks a retrieve plan against the model: each request's reserve, and any
 * choice of its tenant's facts placed as the retrieve-plan kernel places
 * them (kernels.h, kvi__rplan_args) fits its segments and its table slice. */
static void check_retrieve_plan(const rig *g, const kvi_retrieve_request *rq, int32_t nq, int32_t k,
                                const kvi__plan_view *v, rng *r) {
  const int32_t P = g->P, seg = g->seg;
  assert_non_null(v->buf);
  assert_int_equal(v->nreqs, nq);
  const kvi__rquery *q = v->ext;
  assert_non_null(q);
  int64_t seg0 = 0, tokens = 0;
  for (int32_t i = 0; i < nq; i++) {
    int32_t nres, longest;
    model_reserve(g, rq[i].tenant, k, &nres, &longest);
    if (q[i].nres != nres) fail_msg("request %d: %d facts reserved, expected %d", (int)i, (int)q[i].nres, (int)nres);
    assert_int_equal(q[i].cap, (int64_t)nres * longest);
    assert_int_equal(q[i].first_slot, rq[i].first_slot);
    assert_int_equal(q[i].start_position, rq[i].start_position);
    assert_int_equal(q[i].best_last, (rq[i].flags & KVI_RETRIEVE_BEST_LAST) != 0);
    assert_null(q[i].dir); /* a CPU store's tenants have no directory */
    assert_int_equal(q[i].seg0, seg0);
    /* segments per fact: room for the cut of the longest fact, no more than a token each */
    if (q[i].spf < model_segs(longest, P, seg))
      fail_msg("request %d: %d segments per fact; a fact of %d tokens needs %lld", (int)i, (int)q[i].spf,
               (int)longest, (long long)model_segs(longest, P, seg));
    assert_true(q[i].spf <= longest);
    seg0 += (int64_t)nres * q[i].spf;
    tokens += (int64_t)nres * longest;
    /* the request's table: a host table's slice covers the reserved slots */
    const kvi__xreq *x = &v->reqs[i];
    if (q[i].cap > 0 && rq[i].block_table_memory == KVI_MEMORY_HOST) {
      const int64_t b0 = rq[i].first_slot / BS, b1 = (rq[i].first_slot + q[i].cap - 1) / BS;
      assert_null(x->table);
      assert_int_equal(x->first_block, b0);
      assert_int_equal(x->table_len, b1 - b0 + 1);
      const int32_t *slice = (const int32_t *)(v->buf + x->table_off);
      for (int64_t b = b0; b <= b1; b++) assert_int_equal(slice[b - b0], rq[i].block_table[b]);
    }
    /* the kernel's placement of a random choice of facts: each within its
     * fact's spf segments, every slot inside the table */
    if (nres == 0) continue;
    const int32_t t = (int32_t)rq[i].tenant - 1;
    int64_t t0 = 0;
    for (int32_t f = 0; f < nres; f++) {
      const int32_t T = rt_tokens(t, (int32_t)rng_range(r, 0, rt_counts[t] - 1), P);
      if (model_segs(T, P, seg) > q[i].spf)
        fail_msg("request %d: a fact of %d tokens overflows its segments", (int)i, (int)T);
      const int64_t last = q[i].first_slot + t0 + T - 1;
      assert_true(t0 + T <= q[i].cap);
      const int64_t b = last / BS - x->first_block;
      assert_true(b >= 0 && b < x->table_len);
      t0 += T;
    }
  }
  assert_int_equal(v->nsegs, seg0);
  /* the plan holds them: no more segments than tokens, none past the buffer */
  assert_true(seg0 <= tokens);
  assert_true((size_t)seg0 * sizeof(kvi__xseg) <= (size_t)((char *)v->reqs - v->buf));
  assert_int_equal(v->ntok, 0);
}

static kvi_retrieve_request rreq(uint64_t tenant, const int32_t *table, int32_t len, int64_t first_slot,
                                 int32_t start, uint32_t flags) {
  kvi_retrieve_request q = KVI_RETRIEVE_REQUEST_INIT;
  q.tenant = tenant;
  q.block_table = table;
  q.block_table_len = len;
  q.first_slot = first_slot;
  q.start_position = start;
  q.flags = flags;
  return q;
}

static void test_retrieve_prepare(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "test_retrieve_prepare");
  int32_t table[NB];
  for (int32_t b = 0; b < NB; b++) table[b] = (b * 5 + 3) % NB;
  static const int32_t Ps[] = {3, 16, 48};
  for (size_t pi = 0; pi < 3; pi++) {
    rig g;
    rt_make(&g, Ps[pi], pi == 2 ? 128 : 4, NULL);
    assert_int_equal(g.seg, pi == 2 ? 32 : g.P); /* pages of 48 cut in 32 + 16 */
    static const int32_t ks[] = {1, 2, 4, 5, 64, KVI_SEARCH_MAX_K};
    for (size_t ki = 0; ki < sizeof ks / sizeof *ks; ki++)
      for (int rep = 0; rep < 8; rep++) {
        const int32_t k = ks[ki], nq = (int32_t)rng_range(&r, 1, 6);
        kvi_retrieve_request rq[6];
        for (int32_t i = 0; i < nq; i++) {
          static const uint64_t tenants[] = {1, 2, 3, 4, 9};
          const uint64_t t = tenants[rng_range(&r, 0, 4)];
          int32_t nres, longest;
          model_reserve(&g, t, k, &nres, &longest);
          const int64_t cap = (int64_t)nres * longest;
          const int64_t fs = rng_range(&r, 0, NB * BS - cap);
          /* a tenant without facts needs no table */
          rq[i] = rreq(t, cap || rng_range(&r, 0, 1) ? table : NULL, NB, fs, (int32_t)rng_range(&r, 0, 1 << 20),
                       rng_range(&r, 0, 1) ? KVI_RETRIEVE_BEST_LAST : 0);
        }
        kvi__plan_view v;
        const kvi_status st = kvi__retrieve_prepare(g.inj, rq, nq, k, &v);
        if (st) fail_msg("P %d k %d: %s", (int)g.P, (int)k, kvi_last_error());
        check_retrieve_plan(&g, rq, nq, k, &v, &r);
        kvi__plan_view_free(g.inj, &v);
      }
    rig_free(&g);
  }
}

/* Bad requests fail with the right error, the first bad request named, and
 * leave no plan (no buffer, nothing planned). */
static void expect_error(rig *g, const kvi_retrieve_request *rq, int32_t nq, int32_t k, kvi_status want,
                         const char *needle) {
  kvi__plan_view v;
  memset(&v, 0x5a, sizeof v);
  const kvi_status st = kvi__retrieve_prepare(g->inj, rq, nq, k, &v);
  if (st != want) fail_msg("%s: status %d, expected %d (%s)", needle, (int)st, (int)want, kvi_last_error());
  if (!strstr(kvi_last_error(), needle)) fail_msg("error \"%s\" does not say \"%s\"", kvi_last_error(), needle);
  assert_null(v.buf);
  assert_int_equal(v.nsegs, 0);
  assert_int_equal(v.nreqs, 0);
  assert_int_equal(v.ntables, 0);
  kvi__plan_view_free(g->inj, &v);
}

static void test_retrieve_prepare_errors(void **state) {
  (void)state;
  int32_t table[NB], bad[NB];
  for (int32_t b = 0; b < NB; b++) table[b] = b, bad[b] = b;
  bad[NB - 1] = NB; /* past the cache */
  rig g;
  rt_make(&g, 16, 4, NULL);
  /* tenant 1: 5 facts, the longest 33 tokens; k = 5 reserves 165 slots */
  const kvi_retrieve_request ok = rreq(1, table, NB, 0, 0, 0);
  kvi_retrieve_request rq[3] = {ok, ok, ok};
  rq[1] = rreq(1, NULL, NB, 0, 0, 0);
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "request 1: block_table is NULL");
  rq[1] = rreq(1, table, 10, 0, 0, 0); /* 165 slots need 11 blocks */
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "the block table has 10");
  rq[1] = rreq(1, table, NB, NB * BS - 164, 0, 0); /* one slot past the table */
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "request 1: sequence slots");
  rq[1] = rreq(1, table, -1, 0, 0, 0);
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "block_table_len is -1");
  rq[1] = rreq(1, table, NB, -1, 0, 0);
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "first_slot is -1");
  rq[1] = rreq(1, bad, NB, NB * BS - 165, 0, 0);
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "block_table[63] is 64");
  rq[1] = rreq(1, table, NB, 0, -1, 0);
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "request 1: positions -1..");
  rq[1] = rreq(1, table, NB, 0, INT32_MAX - 100, 0); /* positions past INT32_MAX */
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "request 1: positions");
  rq[1] = ok;
  rq[1].block_table_memory = KVI_MEMORY_DEVICE;
  expect_error(&g, rq, 2, 5, KVI_ERR_MEMORY_KIND, "request 1: a CPU store reads host block tables only");
  rq[1].block_table_memory = (kvi_memory)7;
  expect_error(&g, rq, 2, 5, KVI_ERR_INVALID_ARGUMENT, "request 1: block_table_memory is 7");
  /* tenant 3: 1,030 facts of one token; k = 1024 reserves 1,024 slots, all
   * the cache has: one more slot does not fit */
  rq[1] = rreq(3, table, NB, 1, 0, 0);
  expect_error(&g, rq + 1, 1, KVI_SEARCH_MAX_K, KVI_ERR_INVALID_ARGUMENT, "request 0: sequence slots 1..1024");
  /* the largest reserve that fits is fine */
  rq[1] = rreq(3, table, NB, 0, 0, 0);
  kvi__plan_view v;
  assert_ok(kvi__retrieve_prepare(g.inj, rq + 1, 1, KVI_SEARCH_MAX_K, &v));
  kvi__plan_view_free(g.inj, &v);
  rig_free(&g);

  /* the transfer limits, counted over the whole call's reserves */
  kvi_transfer_options lim = KVI_TRANSFER_OPTIONS_INIT;
  lim.max_tokens_per_call = 330; /* two reserves of 165 */
  lim.max_requests_per_call = 2;
  lim.max_table_entries_per_call = 22; /* 11 blocks each */
  rt_make(&g, 16, 4, &lim);
  rq[0] = rq[1] = rq[2] = ok;
  assert_ok(kvi__retrieve_prepare(g.inj, rq, 2, 5, &v));
  kvi__plan_view_free(g.inj, &v);
  expect_error(&g, rq, 3, 5, KVI_ERR_CAPACITY, "the transfer options allow");
  rq[1].first_slot = 15; /* 165 slots from 15: 12 blocks */
  expect_error(&g, rq, 2, 5, KVI_ERR_CAPACITY, "with 23 host block-table entries");
  rq[1] = rreq(9, NULL, 0, 0, 0, 0); /* an unknown tenant reserves nothing */
  rq[2] = ok;
  assert_ok(kvi__retrieve_prepare(g.inj, rq, 2, 5, &v));
  kvi__plan_view_free(g.inj, &v);
  rig_free(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plan_run_sizes),
      cmocka_unit_test(test_plan_requests_ragged),
      cmocka_unit_test(test_plan_run_largest),
      cmocka_unit_test(test_retrieve_prepare),
      cmocka_unit_test(test_retrieve_prepare_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
