/*
 * Tensor-parallel stores over the in-process transport: ranks are threads
 * (kvinject/comm.h). Head split and replication, put from a full-head source
 * and gather back, re-sharding between tp sizes, sharded search against an
 * unsharded store, agreement at creation, and calls that fail on one rank
 * changing nothing on any.
 *
 * References are independent of the library's sharding code: slices are cut
 * from the full source here, with the head rule of kvinject/model.h written
 * out; search results are compared with one unsharded store holding every
 * fact (the CPU search is exact to fp32 rounding, so results match bit for
 * bit).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>

#include "unit.h"

#define L 3
#define D 8
#define MAXR 8

/* ------------------------------------------------------------------------ */
/* ranks as threads                                                         */
/* ------------------------------------------------------------------------ */

typedef struct rank_ctx rank_ctx;
typedef void (*rank_fn)(rank_ctx *);

struct rank_ctx {
  int rank, size;
  kvi_comm_group *group;
  kvi_comm *comm;
  void *shared; /* the test's shared state, read-only in the threads */
  rank_fn fn;
  char fail[600];
};

#define RCHECK(c, cond, ...)                                                                 \
  do {                                                                                       \
    if (!(cond) && !(c)->fail[0]) {                                                          \
      int n_ = snprintf((c)->fail, sizeof (c)->fail, "rank %d, line %d: ", (c)->rank, __LINE__); \
      snprintf((c)->fail + n_, sizeof (c)->fail - (size_t)n_, __VA_ARGS__);                  \
    }                                                                                        \
  } while (0)

#define RSTATUS(c, expr, want)                                                                       \
  do {                                                                                               \
    const kvi_status g_ = (expr);                                                                    \
    RCHECK(c, g_ == (want), "%s returned %s, expected %s (%s)", #expr, kvi_status_string(g_),       \
           kvi_status_string(want), kvi_last_error());                                               \
  } while (0)

static void *rank_main(void *p) {
  rank_ctx *c = p;
  if (kvi_comm_create_local(&c->comm, c->group, c->rank) != KVI_OK) {
    snprintf(c->fail, sizeof c->fail, "rank %d: kvi_comm_create_local: %s", c->rank, kvi_last_error());
    return NULL;
  }
  c->fn(c);
  kvi_comm_destroy(c->comm);
  return NULL;
}

static void run_ranks(int n, rank_fn fn, void *shared) {
  kvi_comm_group *g = NULL;
  assert_ok(kvi_comm_group_create(&g, n));
  rank_ctx ctx[MAXR];
  pthread_t th[MAXR];
  for (int r = 0; r < n; r++) {
    memset(&ctx[r], 0, sizeof ctx[r]);
    ctx[r].rank = r;
    ctx[r].size = n;
    ctx[r].group = g;
    ctx[r].shared = shared;
    ctx[r].fn = fn;
    assert_int_equal(pthread_create(&th[r], NULL, rank_main, &ctx[r]), 0);
  }
  for (int r = 0; r < n; r++) pthread_join(th[r], NULL);
  kvi_comm_group_destroy(g);
  bool bad = false;
  for (int r = 0; r < n; r++)
    if (ctx[r].fail[0]) {
      print_error("tp %d: %s\n", n, ctx[r].fail);
      bad = true;
    }
  if (bad) fail();
}

/* ------------------------------------------------------------------------ */
/* models, stores and facts                                                 */
/* ------------------------------------------------------------------------ */

/* kvinject/model.h's rule, written out. */
static void heads_of(int H, int tp, int r, int *first, int *count) {
  if (tp <= H) {
    *count = H / tp;
    *first = r * (H / tp);
  } else {
    *count = 1;
    *first = r / (tp / H);
  }
}

static kvi_model *tp_model(int H, int tp, int rank, double theta) {
  const kvi_model_options mo = model_options(L, H, D, rank, tp);
  kvi_model *m = NULL;
  if (kvi_model_create(&m, &mo) != KVI_OK) return NULL;
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.theta = theta;
  if (kvi_model_set_rope(m, -1, &rs) != KVI_OK) {
    kvi_model_destroy(m);
    return NULL;
  }
  return m;
}

typedef struct store_cfg {
  kvi_dtype dtype;
  int page_tokens;
  uint64_t budget;
  int emb_dim;
  kvi_embedding_placement placement;
} store_cfg;

static const store_cfg default_cfg = {KVI_DTYPE_FP32, 4, 4u << 20, 0, KVI_EMBEDDINGS_REPLICATED};

static kvi_status make_store(kvi_store **s, const kvi_model *m, const store_cfg *cfg, kvi_comm *comm) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = cfg->dtype;
  so.page_tokens = cfg->page_tokens;
  so.budget_bytes = cfg->budget;
  so.embedding_dim = cfg->emb_dim;
  so.comm = comm;
  so.embedding_placement = cfg->placement;
  return kvi_store_create(s, m, &so);
}

/* A fact with all heads: K then V, each [L][T][H][D] fp32. */
typedef struct full_fact {
  int T, H;
  float *kv;
} full_fact;

static void fact_make(full_fact *f, rng *g, int T, int H) {
  f->T = T;
  f->H = H;
  const size_t n = (size_t)2 * L * T * H * D;
  f->kv = malloc(n * sizeof *f->kv);
  assert_non_null(f->kv);
  for (size_t i = 0; i < n; i++) f->kv[i] = (float)((int64_t)(rng_next(g) % 20001) - 10000) / 997.0f;
}

static kvi_kv_view fact_view(const full_fact *f) {
  kvi_kv_view v;
  const size_t plane = (size_t)L * f->T * f->H * D;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, f->T, f->H, D, f->kv, f->kv + plane);
  return v;
}

/* The view of heads [first, first + count) of f, strided into it. */
static kvi_kv_view slice_view(const full_fact *f, int first, int count) {
  kvi_kv_view v = fact_view(f);
  v.num_heads = count;
  v.k = (float *)v.k + (size_t)first * D;
  v.v = (float *)v.v + (size_t)first * D;
  return v;
}

/* Element (kv, l, t, h, d) of the full fact. */
static float full_at(const full_fact *f, int kv, int l, int t, int h, int d) {
  return f->kv[((((size_t)kv * L + l) * f->T + t) * f->H + h) * D + d];
}

/* Reads fact id of the store (its local heads) and compares with f's heads
 * [first, first + count), rounded to the store's dtype. */
static bool slice_matches(rank_ctx *c, kvi_store *s, uint64_t tenant, uint64_t id, const full_fact *f, int first,
                          int count, kvi_dtype dt) {
  const size_t plane = (size_t)L * f->T * count * D;
  float *buf = malloc(2 * plane * sizeof *buf);
  kvi_kv_view w;
  kvi_kv_view_contiguous(&w, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, f->T, count, D, buf, buf + plane);
  const kvi_status st = kvi_store_read(s, tenant, id, &w, NULL);
  RSTATUS(c, st, KVI_OK);
  bool ok = st == KVI_OK;
  for (int kv = 0; ok && kv < 2; kv++)
    for (int l = 0; ok && l < L; l++)
      for (int t = 0; ok && t < f->T; t++)
        for (int h = 0; ok && h < count; h++)
          for (int d = 0; ok && d < D; d++) {
            const float want = ref_round(full_at(f, kv, l, t, first + h, d), dt);
            const float got = buf[(size_t)kv * plane + (((size_t)l * f->T + t) * count + h) * D + d];
            if (got != want) {
              RCHECK(c, false, "fact %llu: %s[%d][%d][%d][%d] is %g, expected %g", (unsigned long long)id,
                     kv ? "V" : "K", l, t, first + h, d, (double)got, (double)want);
              ok = false;
            }
          }
  free(buf);
  return ok;
}

/* One-item forms of the collective calls. */
static kvi_status scatter1(kvi_store *s, uint64_t tenant, uint64_t id, int root, const kvi_kv_view *full,
                           const kvi_put_options *po) {
  kvi_scatter_item it = KVI_SCATTER_ITEM_INIT;
  it.tenant = tenant;
  it.fact_id = id;
  it.full = full;
  it.opts = po;
  return kvi_store_put_scatter(s, root, &it, 1, NULL);
}

static kvi_status gather1(kvi_store *s, uint64_t tenant, uint64_t id, int root, const kvi_kv_view *full) {
  kvi_gather_item it = KVI_GATHER_ITEM_INIT;
  it.tenant = tenant;
  it.fact_id = id;
  it.full = full;
  return kvi_store_gather(s, root, &it, 1, NULL);
}

/* ------------------------------------------------------------------------ */
/* scatter, gather, and equality with rank-local puts                       */
/* ------------------------------------------------------------------------ */

#define NFACTS 6

typedef struct scatter_shared {
  int H;
  kvi_dtype dtype;
  full_fact facts[NFACTS];
} scatter_shared;

static void scatter_rank(rank_ctx *c) {
  const scatter_shared *sh = c->shared;
  kvi_model *m = tp_model(sh->H, c->size, c->rank, 10000.0);
  RCHECK(c, m != NULL, "make_model: %s", kvi_last_error());
  if (!m) return;
  store_cfg cfg = default_cfg;
  cfg.dtype = sh->dtype;
  kvi_store *s = NULL, *direct = NULL;
  RSTATUS(c, make_store(&s, m, &cfg, c->comm), KVI_OK);
  RSTATUS(c, make_store(&direct, m, &cfg, NULL), KVI_OK);
  int first, count;
  heads_of(sh->H, c->size, c->rank, &first, &count);
  const int root = 1 % c->size;
  /* one call for all facts but the last, then the last alone; root gives
   * token ids for the even facts (every rank keeps them) */
  kvi_kv_view full[NFACTS];
  kvi_scatter_item items[NFACTS];
  kvi_put_options po[NFACTS];
  int32_t ids[NFACTS][16];
  for (int i = 0; i < NFACTS; i++) {
    full[i] = fact_view(&sh->facts[i]);
    for (int t = 0; t < 16; t++) ids[i][t] = i * 100 + t;
    po[i] = (kvi_put_options)KVI_PUT_OPTIONS_INIT;
    po[i].token_ids = i % 2 == 0 ? ids[i] : NULL;
    kvi_scatter_item it = KVI_SCATTER_ITEM_INIT;
    it.tenant = 7;
    it.fact_id = (uint64_t)i;
    it.full = c->rank == root ? &full[i] : NULL;
    it.opts = c->rank == root ? &po[i] : NULL;
    items[i] = it;
  }
  if (s) RSTATUS(c, kvi_store_put_scatter(s, root, items, NFACTS - 1, NULL), KVI_OK);
  if (s)
    RSTATUS(c, scatter1(s, 7, NFACTS - 1, root, c->rank == root ? &full[NFACTS - 1] : NULL,
                        c->rank == root ? &po[NFACTS - 1] : NULL),
            KVI_OK);
  for (int i = 0; s && i < NFACTS; i++) {
    int32_t got[16], num = -1;
    RSTATUS(c, kvi_store_fact_token_ids(s, 7, (uint64_t)i, got, 16, &num, NULL), KVI_OK);
    const int want = i % 2 == 0 ? sh->facts[i].T : 0;
    RCHECK(c, num == want && memcmp(got, ids[i], (size_t)want * sizeof *got) == 0, "fact %d: %d token ids, expected %d",
           i, (int)num, want);
  }
  for (int i = 0; s && direct && i < NFACTS; i++) {
    const kvi_kv_view mine = slice_view(&sh->facts[i], first, count);
    RSTATUS(c, kvi_store_put(direct, 7, (uint64_t)i, &mine, NULL, NULL), KVI_OK);
  }
  for (int i = 0; s && direct && i < NFACTS; i++) {
    const full_fact *f = &sh->facts[i];
    slice_matches(c, s, 7, (uint64_t)i, f, first, count, sh->dtype);
    slice_matches(c, direct, 7, (uint64_t)i, f, first, count, sh->dtype);
    /* gather to rank 0: the whole fact, every head */
    const size_t plane = (size_t)L * f->T * sh->H * D;
    float *back = calloc(2 * plane, sizeof *back);
    kvi_kv_view w;
    kvi_kv_view_contiguous(&w, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, f->T, sh->H, D, back, back + plane);
    RSTATUS(c, gather1(s, 7, (uint64_t)i, 0, c->rank == 0 ? &w : NULL), KVI_OK);
    if (c->rank == 0)
      for (size_t e = 0; e < 2 * plane; e++)
        if (back[e] != ref_round(f->kv[e], sh->dtype)) {
          RCHECK(c, false, "gathered fact %d element %zu is %g, expected %g", i, e, (double)back[e],
                 (double)ref_round(f->kv[e], sh->dtype));
          break;
        }
    free(back);
  }
  RSTATUS(c, kvi_store_check_agreement(s), KVI_OK);
  /* the same facts, but other token ids for one of them on one rank: the ranks disagree */
  if (s && c->rank == 0) {
    const kvi_kv_view mine = slice_view(&sh->facts[0], first, count);
    kvi_put_options o = KVI_PUT_OPTIONS_INIT;
    o.flags = KVI_PUT_REPLACE;
    o.token_ids = ids[1];
    RSTATUS(c, kvi_store_put(s, 7, 0, &mine, &o, NULL), KVI_OK);
  }
  RSTATUS(c, kvi_store_check_agreement(s), c->size > 1 ? KVI_ERR_MISMATCH : KVI_OK); /* tp 1 agrees with itself */
  kvi_store_destroy(s);
  kvi_store_destroy(direct);
  kvi_model_destroy(m);
}

static void scatter_case(int H, int tp, kvi_dtype dt) {
  scatter_shared sh = {H, dt, {{0}}};
  rng g;
  rng_seed(&g, "scatter");
  for (int i = 0; i < NFACTS; i++) fact_make(&sh.facts[i], &g, (int)rng_range(&g, 1, 11), H);
  run_ranks(tp, scatter_rank, &sh);
  for (int i = 0; i < NFACTS; i++) free(sh.facts[i].kv);
}

/* Each rank keeps its heads; puts from a full-head source equal rank-local
 * puts of the slice; gather returns the whole fact. tp 2, 4, 8. */
static void test_scatter_gather_head_split(void **state) {
  (void)state;
  scatter_case(8, 2, KVI_DTYPE_FP32);
  scatter_case(8, 4, KVI_DTYPE_BF16);
  scatter_case(8, 8, KVI_DTYPE_FP16);
  scatter_case(8, 1, KVI_DTYPE_FP32);
}

/* Fewer KV heads than ranks: each head on tp/H ranks. */
static void test_scatter_gather_replicated_heads(void **state) {
  (void)state;
  scatter_case(2, 4, KVI_DTYPE_FP32);
  scatter_case(2, 8, KVI_DTYPE_BF16);
  scatter_case(1, 2, KVI_DTYPE_FP32);
}

/* ------------------------------------------------------------------------ */
/* re-sharding: tp 2 -> 1 -> 4                                              */
/* ------------------------------------------------------------------------ */

typedef struct reshard_shared {
  int H;
  full_fact facts[NFACTS];
  kvi_store *single;     /* tp 1, every head (made by the main thread) */
  full_fact gathered[NFACTS]; /* written by rank 0 of tp 2 */
} reshard_shared;

static void reshard_from2(rank_ctx *c) {
  reshard_shared *sh = c->shared;
  kvi_model *m = tp_model(sh->H, c->size, c->rank, 10000.0);
  kvi_store *s = NULL;
  RSTATUS(c, make_store(&s, m, &default_cfg, c->comm), KVI_OK);
  for (int i = 0; s && i < NFACTS; i++) {
    const kvi_kv_view full = fact_view(&sh->facts[i]);
    RSTATUS(c, scatter1(s, 3, (uint64_t)i, 0, c->rank == 0 ? &full : NULL, NULL), KVI_OK);
  }
  /* tp 2 -> 1: gather each fact to rank 0, which puts it into the tp-1 store */
  for (int i = 0; s && i < NFACTS; i++) {
    const kvi_kv_view w = fact_view(&sh->gathered[i]);
    RSTATUS(c, gather1(s, 3, (uint64_t)i, 0, c->rank == 0 ? &w : NULL), KVI_OK);
    if (c->rank == 0) RSTATUS(c, kvi_store_put(sh->single, 3, (uint64_t)i, &w, NULL, NULL), KVI_OK);
  }
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void reshard_to4(rank_ctx *c) {
  reshard_shared *sh = c->shared;
  kvi_model *m = tp_model(sh->H, c->size, c->rank, 10000.0);
  kvi_store *s = NULL;
  RSTATUS(c, make_store(&s, m, &default_cfg, c->comm), KVI_OK);
  int first, count;
  heads_of(sh->H, c->size, c->rank, &first, &count);
  for (int i = 0; s && i < NFACTS; i++) { /* tp 1 -> 4: rank 2 reads the tp-1 store and scatters */
    const full_fact *f = &sh->facts[i];
    const size_t plane = (size_t)L * f->T * sh->H * D;
    float *buf = malloc(2 * plane * sizeof *buf);
    kvi_kv_view w;
    kvi_kv_view_contiguous(&w, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, f->T, sh->H, D, buf, buf + plane);
    if (c->rank == 2) RSTATUS(c, kvi_store_read(sh->single, 3, (uint64_t)i, &w, NULL), KVI_OK);
    RSTATUS(c, scatter1(s, 3, (uint64_t)i, 2, c->rank == 2 ? &w : NULL, NULL), KVI_OK);
    free(buf);
    slice_matches(c, s, 3, (uint64_t)i, f, first, count, KVI_DTYPE_FP32);
  }
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_reshard_2_1_4(void **state) {
  (void)state;
  reshard_shared sh;
  memset(&sh, 0, sizeof sh);
  sh.H = 4;
  rng g;
  rng_seed(&g, "reshard");
  for (int i = 0; i < NFACTS; i++) {
    const int T = (int)rng_range(&g, 1, 9);
    fact_make(&sh.facts[i], &g, T, sh.H);
    fact_make(&sh.gathered[i], &g, T, sh.H); /* overwritten by the gather */
  }
  kvi_model *m1 = tp_model(sh.H, 1, 0, 10000.0);
  assert_non_null(m1);
  assert_ok(make_store(&sh.single, m1, &default_cfg, NULL));
  run_ranks(2, reshard_from2, &sh);
  for (int i = 0; i < NFACTS; i++)
    assert_memory_equal(sh.gathered[i].kv, sh.facts[i].kv, (size_t)2 * L * sh.facts[i].T * sh.H * D * sizeof(float));
  run_ranks(4, reshard_to4, &sh);
  kvi_store_destroy(sh.single);
  kvi_model_destroy(m1);
  for (int i = 0; i < NFACTS; i++) {
    free(sh.facts[i].kv);
    free(sh.gathered[i].kv);
  }
}

/* ------------------------------------------------------------------------ */
/* sharded search                                                           */
/* ------------------------------------------------------------------------ */

#define SF 60  /* facts */
#define E 16   /* embedding elements */
#define NQ 6

typedef struct search_shared {
  int H;
  kvi_embedding_placement placement;
  uint64_t tenant[SF];
  bool removed[SF];
  float emb[SF][E];
  full_fact facts[SF];
  float queries[NQ * E];
  uint64_t qtenants[NQ];
  int ks[3];
  /* the unsharded reference's answers, per k */
  uint64_t ids[3][NQ * 64];
  float scores[3][NQ * 64];
  int32_t counts[3][NQ];
} search_shared;

static void search_rank(rank_ctx *c) {
  const search_shared *sh = c->shared;
  kvi_model *m = tp_model(sh->H, c->size, c->rank, 10000.0);
  store_cfg cfg = default_cfg;
  cfg.emb_dim = E;
  cfg.placement = sh->placement;
  kvi_store *s = NULL;
  RSTATUS(c, make_store(&s, m, &cfg, c->comm), KVI_OK);
  if (!s) {
    kvi_model_destroy(m);
    return;
  }
  int first, count;
  heads_of(sh->H, c->size, c->rank, &first, &count);
  for (int i = 0; i < SF; i++) { /* rank-local puts of each rank's slice, every embedding given */
    const kvi_kv_view v = slice_view(&sh->facts[i], first, count);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = sh->emb[i];
    RSTATUS(c, kvi_store_put(s, sh->tenant[i], (uint64_t)i, &v, &po, NULL), KVI_OK);
  }
  for (int i = 0; i < SF; i++)
    if (sh->removed[i]) RSTATUS(c, kvi_store_remove(s, sh->tenant[i], (uint64_t)i), KVI_OK);
  RSTATUS(c, kvi_store_check_agreement(s), KVI_OK);
  /* each embedding lives on exactly its keeper (sharded) or everywhere (replicated) */
  for (int i = 0; i < SF; i++) {
    if (sh->removed[i]) continue;
    float e[E];
    const bool keeper = sh->placement == KVI_EMBEDDINGS_REPLICATED ||
                        kvi_store_embedding_rank(sh->tenant[i], (uint64_t)i, c->size) == c->rank;
    RSTATUS(c, kvi_store_get_embedding(s, sh->tenant[i], (uint64_t)i, e), keeper ? KVI_OK : KVI_ERR_NOT_FOUND);
  }
  for (int ki = 0; ki < 3; ki++) {
    const int k = sh->ks[ki];
    uint64_t ids[NQ * 64];
    float scores[NQ * 64];
    int32_t counts[NQ];
    RSTATUS(c, kvi_store_search(s, sh->queries, NQ, E, sh->qtenants, k, ids, scores, counts, NULL, NULL), KVI_OK);
    RCHECK(c, memcmp(counts, sh->counts[ki], sizeof counts) == 0, "k %d: counts differ from the unsharded store", k);
    RCHECK(c, memcmp(ids, sh->ids[ki], (size_t)NQ * k * sizeof *ids) == 0, "k %d: ids differ from the unsharded store", k);
    RCHECK(c, memcmp(scores, sh->scores[ki], (size_t)NQ * k * sizeof *scores) == 0,
           "k %d: scores differ from the unsharded store", k);
  }
  if (sh->placement == KVI_EMBEDDINGS_SHARDED && c->size > 1) { /* ranks that ask different questions */
    uint64_t t2[NQ];
    memcpy(t2, sh->qtenants, sizeof t2);
    if (c->rank == c->size - 1) t2[0] ^= 1;
    uint64_t ids[NQ * 4];
    float scores[NQ * 4];
    int32_t counts[NQ];
    RSTATUS(c, kvi_store_search(s, sh->queries, NQ, E, t2, 4, ids, scores, counts, NULL, NULL), KVI_ERR_MISMATCH);
    RSTATUS(c, kvi_store_save(s, "/nonexistent/never-written.kvi", NULL), KVI_ERR_UNSUPPORTED);
  }
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void search_case(int H, int tp, kvi_embedding_placement placement) {
  search_shared *sh = calloc(1, sizeof *sh);
  assert_non_null(sh);
  sh->H = H;
  sh->placement = placement;
  sh->ks[0] = 1;
  sh->ks[1] = 7;
  sh->ks[2] = 64;
  rng g;
  rng_seed(&g, "search");
  for (int i = 0; i < SF; i++) {
    sh->tenant[i] = 100 + (uint64_t)rng_range(&g, 0, 2);
    sh->removed[i] = rng_range(&g, 0, 4) == 0;
    for (int e = 0; e < E; e++) sh->emb[i][e] = (float)rng_range(&g, -8, 8) / 4.0f; /* ties happen */
    fact_make(&sh->facts[i], &g, (int)rng_range(&g, 1, 5), H);
  }
  for (int q = 0; q < NQ; q++) {
    sh->qtenants[q] = 100 + (uint64_t)(q % 4); /* tenant 103 has no facts */
    for (int e = 0; e < E; e++) sh->queries[q * E + e] = (float)rng_range(&g, -8, 8) / 4.0f;
  }
  /* the reference: one unsharded store with every head and every fact */
  kvi_model *m1 = tp_model(H, 1, 0, 10000.0);
  store_cfg cfg = default_cfg;
  cfg.emb_dim = E;
  kvi_store *ref = NULL;
  assert_ok(make_store(&ref, m1, &cfg, NULL));
  for (int i = 0; i < SF; i++) {
    const kvi_kv_view v = fact_view(&sh->facts[i]);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = sh->emb[i];
    assert_ok(kvi_store_put(ref, sh->tenant[i], (uint64_t)i, &v, &po, NULL));
    if (sh->removed[i]) assert_ok(kvi_store_remove(ref, sh->tenant[i], (uint64_t)i));
  }
  for (int ki = 0; ki < 3; ki++)
    assert_ok(kvi_store_search(ref, sh->queries, NQ, E, sh->qtenants, sh->ks[ki], sh->ids[ki], sh->scores[ki],
                               sh->counts[ki], NULL, NULL));
  assert_int_equal(sh->counts[0][3], 0); /* the tenant without facts */
  run_ranks(tp, search_rank, sh);
  kvi_store_destroy(ref);
  kvi_model_destroy(m1);
  for (int i = 0; i < SF; i++) free(sh->facts[i].kv);
  free(sh);
}

/* Sharded search returns exactly what one unsharded store returns. */
static void test_sharded_search_equals_unsharded(void **state) {
  (void)state;
  search_case(4, 2, KVI_EMBEDDINGS_SHARDED);
  search_case(4, 4, KVI_EMBEDDINGS_SHARDED);
  search_case(2, 8, KVI_EMBEDDINGS_SHARDED);
  search_case(4, 2, KVI_EMBEDDINGS_REPLICATED);
}

/* The keeper rank is a fixed function: the same in every version. */
static void test_embedding_rank_fixed(void **state) {
  (void)state;
  assert_int_equal(kvi_store_embedding_rank(1, 2, 0), -1);
  assert_int_equal(kvi_store_embedding_rank(1, 2, 1), 0);
  int hist[8] = {0};
  for (uint64_t i = 0; i < 8000; i++) {
    const int r = kvi_store_embedding_rank(5, i, 8);
    assert_true(r >= 0 && r < 8);
    hist[r]++;
  }
  for (int r = 0; r < 8; r++) assert_true(hist[r] > 850 && hist[r] < 1150); /* balanced */
  /* golden values: changing the hash would strand every saved placement */
  assert_int_equal(kvi_store_embedding_rank(0, 0, 8), 0);
  assert_int_equal(kvi_store_embedding_rank(7, 123456789, 8), 7);
  assert_int_equal(kvi_store_embedding_rank(UINT64_MAX, 42, 3), 0);
  assert_int_equal(kvi_store_embedding_rank(3, 1000, 5), 2);
}

/* ------------------------------------------------------------------------ */
/* agreement at creation                                                    */
/* ------------------------------------------------------------------------ */

typedef struct create_shared {
  int variant;
} create_shared;

static void create_rank(rank_ctx *c) {
  const create_shared *sh = c->shared;
  const int v = sh->variant;
  const bool odd = c->rank == c->size - 1; /* the rank that differs */
  kvi_model *m = tp_model(4, v == 2 && odd ? c->size * 2 : c->size, v == 2 && odd ? 0 : c->rank,
                            v == 3 && odd ? 500000.0 : 10000.0);
  store_cfg cfg = default_cfg;
  if (v == 0 && odd) cfg.page_tokens = 8;
  if (v == 1 && odd) cfg.budget = 16; /* smaller than a page: fails on this rank only */
  kvi_store *s = NULL;
  const kvi_status st = make_store(&s, m, &cfg, c->comm);
  switch (v) {
  case 0: /* a shared field differs: every rank says so */
    RSTATUS(c, st, KVI_ERR_MISMATCH);
    RCHECK(c, strstr(kvi_last_error(), "page_tokens") != NULL, "message: %s", kvi_last_error());
    break;
  case 1: /* a local failure: its own status there, KVI_ERR_PEER elsewhere */
    RSTATUS(c, st, odd ? KVI_ERR_INVALID_ARGUMENT : KVI_ERR_PEER);
    break;
  case 2: /* a model for another tp layout on one rank */
    RSTATUS(c, st, odd ? KVI_ERR_MISMATCH : KVI_ERR_PEER);
    break;
  case 3: /* RoPE differs */
    RSTATUS(c, st, KVI_ERR_MISMATCH);
    RCHECK(c, strstr(kvi_last_error(), "RoPE") != NULL, "message: %s", kvi_last_error());
    break;
  default: /* all agree */
    RSTATUS(c, st, KVI_OK);
    RSTATUS(c, kvi_store_journal_open(s, "/tmp/kvi-never-opened.log", 0), KVI_ERR_UNSUPPORTED);
  }
  RCHECK(c, (st == KVI_OK) == (s != NULL), "store %p with status %d", (void *)s, (int)st);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_create_agreement(void **state) {
  (void)state;
  for (int v = 0; v <= 4; v++) {
    create_shared sh = {v};
    run_ranks(2, create_rank, &sh);
    run_ranks(4, create_rank, &sh);
  }
}

/* ------------------------------------------------------------------------ */
/* a collective that fails on one rank changes nothing anywhere             */
/* ------------------------------------------------------------------------ */

static void failure_rank(rank_ctx *c) {
  kvi_model *m = tp_model(4, c->size, c->rank, 10000.0);
  const bool odd = c->rank == c->size - 1;
  rng g = {777}; /* the same facts on every rank (rng_seed would differ per thread) */
  full_fact big, small;
  fact_make(&big, &g, 12, 4);
  fact_make(&small, &g, 2, 4);
  const kvi_kv_view vbig = fact_view(&big), vsmall = fact_view(&small);
  store_cfg cfg = default_cfg;
  /* pages of 4 tokens: the odd rank has room for 2 pages only */
  const uint64_t page = (uint64_t)L * 2 * (4 / c->size) * 4 * D * 4;
  cfg.budget = odd ? 2 * page : 64 * page;
  kvi_store *s = NULL;
  RSTATUS(c, make_store(&s, m, &cfg, c->comm), KVI_OK);
  if (!s) return;
  kvi_store_stats before = KVI_STORE_STATS_INIT, after = KVI_STORE_STATS_INIT;
  RSTATUS(c, kvi_store_stats_get(s, &before), KVI_OK);
  /* 12 tokens need 3 pages: the odd rank is full */
  RSTATUS(c, scatter1(s, 1, 10, 0, c->rank == 0 ? &vbig : NULL, NULL),
          odd ? KVI_ERR_CAPACITY : KVI_ERR_PEER);
  RSTATUS(c, kvi_store_stats_get(s, &after), KVI_OK);
  RCHECK(c, after.facts == 0 && after.pages_used == before.pages_used, "the failed put left %llu facts, %llu pages",
         (unsigned long long)after.facts, (unsigned long long)after.pages_used);
  /* the fact exists on one rank only: KVI_ERR_EXISTS there, nothing anywhere else */
  const kvi_kv_view mine = slice_view(&small, 0, 4 / c->size);
  if (odd) RSTATUS(c, kvi_store_put(s, 1, 11, &mine, NULL, NULL), KVI_OK);
  RSTATUS(c, scatter1(s, 1, 11, 0, c->rank == 0 ? &vsmall : NULL, NULL),
          odd ? KVI_ERR_EXISTS : KVI_ERR_PEER);
  size_t n = 99;
  RSTATUS(c, kvi_store_count(s, 1, &n), KVI_OK);
  RCHECK(c, n == (odd ? 1u : 0u), "tenant 1 has %zu facts", n);
  RSTATUS(c, kvi_store_check_agreement(s), KVI_ERR_MISMATCH);
  if (odd) RSTATUS(c, kvi_store_remove(s, 1, 11), KVI_OK);
  RSTATUS(c, kvi_store_check_agreement(s), KVI_OK);
  /* the ranks disagree on the fact id */
  RSTATUS(c, scatter1(s, 1, odd ? 13 : 12, 0, c->rank == 0 ? &vsmall : NULL, NULL),
          KVI_ERR_MISMATCH);
  /* and root's view is bad: its own status there, peers told */
  kvi_kv_view bad = vsmall;
  bad.num_heads = 3;
  RSTATUS(c, scatter1(s, 1, 12, 0, c->rank == 0 ? &bad : NULL, NULL),
          c->rank == 0 ? KVI_ERR_MISMATCH : KVI_ERR_PEER);
  /* then a good one works */
  RSTATUS(c, scatter1(s, 1, 12, 0, c->rank == 0 ? &vsmall : NULL, NULL), KVI_OK);
  int first, count;
  heads_of(4, c->size, c->rank, &first, &count);
  slice_matches(c, s, 1, 12, &small, first, count, KVI_DTYPE_FP32);
  /* gather of a fact missing on one rank */
  if (odd) RSTATUS(c, kvi_store_remove(s, 1, 12), KVI_OK);
  const kvi_kv_view back = fact_view(&small);
  RSTATUS(c, gather1(s, 1, 12, 0, c->rank == 0 ? &back : NULL), odd ? KVI_ERR_NOT_FOUND : KVI_ERR_PEER);
  /* the message names the call the caller made (it named an internal read) */
  if (odd) RCHECK(c, strncmp(kvi_last_error(), "kvi_store_gather: ", 18) == 0, "gather's message: %s", kvi_last_error());
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  free(big.kv);
  free(small.kv);
}

static void test_failure_on_one_rank_changes_nothing(void **state) {
  (void)state;
  run_ranks(2, failure_rank, NULL);
  run_ranks(4, failure_rank, NULL);
}

/* ------------------------------------------------------------------------ */
/* argument errors                                                          */
/* ------------------------------------------------------------------------ */

static void test_comm_errors(void **state) {
  (void)state;
  kvi_comm_group *g = NULL;
  kvi_comm *c = NULL, *c2 = NULL;
  assert_status(kvi_comm_group_create(&g, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_comm_group_create(NULL, 2), KVI_ERR_INVALID_ARGUMENT);
  assert_ok(kvi_comm_group_create(&g, 2));
  assert_status(kvi_comm_create_local(&c, g, 2), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_comm_create_local(&c, NULL, 0), KVI_ERR_INVALID_ARGUMENT);
  assert_ok(kvi_comm_create_local(&c, g, 1));
  assert_status(kvi_comm_create_local(&c2, g, 1), KVI_ERR_EXISTS);
  int32_t r = -1, n = -1;
  assert_ok(kvi_comm_rank(c, &r, &n));
  assert_int_equal(r, 1);
  assert_int_equal(n, 2);
  int64_t count = -1;
  assert_ok(kvi_comm_async_errors(c, &count)); /* the shape every handle's query has */
  assert_int_equal(count, 0);
  assert_ok(kvi_comm_async_errors(c, NULL));
  assert_status(kvi_comm_async_errors(NULL, &count), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_comm_rank(NULL, &r, &n), KVI_ERR_INVALID_ARGUMENT);
  kvi_comm_destroy(c);
  assert_ok(kvi_comm_create_local(&c, g, 1)); /* free again once destroyed */
  kvi_comm_destroy(c);
  kvi_comm_group_destroy(g);
  assert_status(kvi_comm_create_nccl(NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  kvi_comm_destroy(NULL);
  kvi_comm_group_destroy(NULL);

  /* collective calls on a store without a communicator, and bad roots */
  kvi_model *m = tp_model(4, 1, 0, 10000.0);
  kvi_store *s = NULL;
  assert_ok(make_store(&s, m, &default_cfg, NULL));
  rng rg;
  rng_seed(&rg, "errors");
  full_fact f;
  fact_make(&f, &rg, 2, 4);
  const kvi_kv_view v = fact_view(&f);
  assert_status(scatter1(s, 1, 1, 0, &v, NULL), KVI_ERR_UNSUPPORTED);
  assert_status(gather1(s, 1, 1, 0, &v), KVI_ERR_UNSUPPORTED);
  assert_status(kvi_store_check_agreement(s), KVI_ERR_UNSUPPORTED);
  assert_status(scatter1(NULL, 1, 1, 0, &v, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_check_agreement(NULL), KVI_ERR_INVALID_ARGUMENT);
  kvi_store_destroy(s);
  /* sharded embeddings need a communicator; placement must be a known value */
  store_cfg cfg = default_cfg;
  cfg.emb_dim = 4;
  cfg.placement = KVI_EMBEDDINGS_SHARDED;
  s = NULL;
  assert_status(make_store(&s, m, &cfg, NULL), KVI_ERR_INVALID_ARGUMENT);
  cfg.placement = (kvi_embedding_placement)7;
  assert_status(make_store(&s, m, &cfg, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_null(s);
  kvi_model_destroy(m);
  free(f.kv);
}

static void root_rank(rank_ctx *c) {
  kvi_model *m = tp_model(4, c->size, c->rank, 10000.0);
  kvi_store *s = NULL;
  RSTATUS(c, make_store(&s, m, &default_cfg, c->comm), KVI_OK);
  RSTATUS(c, scatter1(s, 1, 1, c->size, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  RSTATUS(c, gather1(s, 1, 1, -1, NULL), KVI_ERR_INVALID_ARGUMENT);
  RSTATUS(c, kvi_store_put_scatter(s, 0, NULL, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  RSTATUS(c, kvi_store_put_scatter(s, 0, NULL, 0, NULL), KVI_OK); /* nothing to do, on every rank */
  {
    kvi_scatter_item tiny = KVI_SCATTER_ITEM_INIT;
    kvi_gather_item gtiny = KVI_GATHER_ITEM_INIT;
    tiny.struct_size = gtiny.struct_size = sizeof(size_t);
    RSTATUS(c, kvi_store_put_scatter(s, 0, &tiny, 1, NULL), KVI_ERR_STRUCT_SIZE);
    RSTATUS(c, kvi_store_gather(s, 0, &gtiny, 1, NULL), KVI_ERR_STRUCT_SIZE);
  }
  RSTATUS(c, scatter1(s, 1, 1, 0, NULL, NULL), c->rank == 0 ? KVI_ERR_INVALID_ARGUMENT : KVI_ERR_PEER);
  rng g = {99};
  full_fact f;
  fact_make(&f, &g, 3, 4);
  const kvi_kv_view v = fact_view(&f);
  RSTATUS(c, scatter1(s, 1, 1, 0, c->rank == 0 ? &v : NULL, NULL), KVI_OK);
  RSTATUS(c, gather1(s, 1, 1, 0, NULL), c->rank == 0 ? KVI_ERR_INVALID_ARGUMENT : KVI_ERR_PEER);
  { /* a key twice in one call; lists that differ between ranks */
    kvi_scatter_item two[2] = {KVI_SCATTER_ITEM_INIT, KVI_SCATTER_ITEM_INIT};
    two[0].tenant = two[1].tenant = 1;
    two[0].fact_id = two[1].fact_id = 5;
    two[0].full = two[1].full = c->rank == 0 ? &v : NULL;
    RSTATUS(c, kvi_store_put_scatter(s, 0, two, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
    two[1].fact_id = c->rank == 0 ? 6 : 7;
    RSTATUS(c, kvi_store_put_scatter(s, 0, two, 2, NULL), KVI_ERR_MISMATCH);
    two[1].fact_id = 6;
    RSTATUS(c, kvi_store_put_scatter(s, 0, two, 1, NULL), KVI_OK);
    RSTATUS(c, kvi_store_put_scatter(s, 0, two, 2, NULL), KVI_ERR_EXISTS); /* 5 is on every rank */
    /* a context (store.h, "Context and stale facts") is not scattered: refused on root, nothing stored */
    const uint64_t ctx[1] = {5};
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.context_ids = ctx, po.num_context_ids = 1;
    two[1].fact_id = 8;
    two[1].opts = &po;
    RSTATUS(c, kvi_store_put_scatter(s, 0, two + 1, 1, NULL), c->rank == 0 ? KVI_ERR_UNSUPPORTED : KVI_ERR_PEER);
    size_t cnt = 0;
    RSTATUS(c, kvi_store_count(s, 1, &cnt), KVI_OK);
    RCHECK(c, cnt == 2, "tenant 1 has %zu facts after a failed batch, expected 2", cnt);
  }
  kvi_kv_view w = v;
  w.num_tokens = 2; /* the fact has 3 */
  RSTATUS(c, gather1(s, 1, 1, 0, c->rank == 0 ? &w : NULL), c->rank == 0 ? KVI_ERR_MISMATCH : KVI_ERR_PEER);
  free(f.kv);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_collective_argument_errors(void **state) {
  (void)state;
  run_ranks(2, root_rank, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_scatter_gather_head_split),
      cmocka_unit_test(test_scatter_gather_replicated_heads),
      cmocka_unit_test(test_reshard_2_1_4),
      cmocka_unit_test(test_sharded_search_equals_unsharded),
      cmocka_unit_test(test_embedding_rank_fixed),
      cmocka_unit_test(test_create_agreement),
      cmocka_unit_test(test_failure_on_one_rank_changes_nothing),
      cmocka_unit_test(test_comm_errors),
      cmocka_unit_test(test_collective_argument_errors),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
