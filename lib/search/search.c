/*
 * Retrieval: the top-k facts of each query's tenant, by the inner product of
 * the query with the tenant's embedding matrix (see kvinject/search.h).
 * SPDX-License-Identifier: Apache-2.0
 *
 * CPU store (the reference): each query is prepared as a stored embedding is
 * (kvi__emb_prepare), every row of its tenant is scored in double and
 * rounded once to fp32, and a bounded heap keeps the best k by (score
 * descending, id ascending).
 *
 * CUDA store: planned on the host under the store's lock, enqueued on the
 * caller's stream without waiting for it:
 *   1. the plan (and host queries) go up in one copy from a pinned staging
 *      slot; a prep kernel checks, scales and rounds every query into the
 *      workspace, grouped by tenant;
 *   2. the work is cut into score tiles (queries of one tenant x a range of
 *      its rows) packed into rounds whose scores and candidates fit in
 *      opts->workspace_bytes. A round computes its tiles' scores (a scan
 *      kernel for up to KVI__SCAN_MAX_Q queries of a tenant, cuBLASLt for
 *      more) and selects the top k of every segment of every query's scores
 *      (stage 1). Stage 2 merges a query's candidates: once after the last
 *      round when all of the call's stage-1 outputs fit an eighth of the
 *      area, else each round into the query's running top k;
 *   3. a query's last selection writes its results (or sentinels) to the
 *      outputs; an emit kernel does it for queries without any selection.
 * Ordering: the stream first waits for the store's last change to device
 * embeddings (kvi__emb_read_begin) and for the previous search (`done`, as
 * searches share the workspace); at the end it records `done`, and the
 * embedding stream waits for it (kvi__emb_read_end), so a later put or
 * remove cannot change rows this search still reads.
 */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "search/search.h"

#define MIN_WORKSPACE (1u << 20)
#define SLOTS 4
#define LT_WS (32u << 20) /* cuBLASLt's workspace, when a GEMM is planned */
#define SEG 4096          /* scores per stage-1 selection, at least */
#define SEG_MAX 65536     /* and at most */
#define GEMM_QT 256       /* queries per GEMM tile */
#define PAIR_BYTES 12     /* a candidate: fp32 score + 64-bit id */

/* ------------------------------------------------------------------------ */
/* argument checks                                                          */
/* ------------------------------------------------------------------------ */

/* Host queries: every element finite and, scaled and rounded, still finite.
 * Scaling (cosine) cannot make a value larger than 1; rounding to a narrower
 * range overflows exactly above a threshold on the fp32 value. */
static kvi_status check_host_queries(const kvi_store *s, const void *q, kvi_dtype t, int32_t nq, int32_t dim,
                                     const char *fn) {
  uint32_t limit = 0x7f800000u; /* |x| below: finite */
  if (s->emb.metric == KVI_METRIC_INNER_PRODUCT && t != KVI_DTYPE_FP16) {
    if (s->emb.dtype == KVI_DTYPE_FP16) limit = 0x477ff000u; /* 65520 rounds to fp16 infinity */
    if (s->emb.dtype == KVI_DTYPE_BF16 && t == KVI_DTYPE_FP32) limit = 0x7f7f8000u; /* rounds to bf16 infinity */
  }
  const int64_t n = (int64_t)nq * dim;
  for (int64_t i = 0; i < n; i++) {
    uint32_t u;
    if (t == KVI_DTYPE_FP32) memcpy(&u, (const char *)q + i * 4, 4);
    else if (t == KVI_DTYPE_BF16) u = (uint32_t)((const uint16_t *)q)[i] << 16;
    else u = (((const uint16_t *)q)[i] & 0x7c00u) == 0x7c00u ? 0x7f800000u : 0; /* fp16: only inf/NaN */
    if ((u & 0x7fffffffu) >= limit) {
      const float x = kvi__load(q, t, i);
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "queries[%lld][%lld] is %g; %s", (long long)(i / dim),
                       (long long)(i % dim), (double)x,
                       isfinite(x) ? (s->emb.dtype == KVI_DTYPE_FP16 ? "too large for the store's fp16 embeddings"
                                                                     : "too large for the store's bf16 embeddings")
                                   : "queries must be finite");
    }
  }
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* CPU: the reference                                                       */
/* ------------------------------------------------------------------------ */

static bool better(float as, uint64_t ai, float bs, uint64_t bi) { return as > bs || (as == bs && ai < bi); }

/* A heap of at most cap (score, id) pairs with the worst at the root. */
typedef struct heap {
  float *s;
  uint64_t *id;
  int32_t n, cap;
} heap;

static void heap_swap(heap *h, int32_t a, int32_t b) {
  float s = h->s[a];
  uint64_t id = h->id[a];
  h->s[a] = h->s[b], h->id[a] = h->id[b];
  h->s[b] = s, h->id[b] = id;
}

static void heap_down(heap *h, int32_t i) {
  for (;;) {
    int32_t w = i;
    const int32_t l = 2 * i + 1, r = l + 1;
    if (l < h->n && better(h->s[w], h->id[w], h->s[l], h->id[l])) w = l;
    if (r < h->n && better(h->s[w], h->id[w], h->s[r], h->id[r])) w = r;
    if (w == i) return;
    heap_swap(h, i, w);
    i = w;
  }
}

static void heap_offer(heap *h, float s, uint64_t id) {
  if (h->n < h->cap) {
    int32_t i = h->n++;
    h->s[i] = s, h->id[i] = id;
    while (i > 0 && better(h->s[(i - 1) / 2], h->id[(i - 1) / 2], h->s[i], h->id[i])) {
      heap_swap(h, i, (i - 1) / 2);
      i = (i - 1) / 2;
    }
  } else if (h->cap > 0 && better(s, id, h->s[0], h->id[0])) {
    h->s[0] = s, h->id[0] = id;
    heap_down(h, 0);
  }
}

static kvi_status cpu_search(kvi_store *s, const void *queries, kvi_dtype qt, int32_t nq, const uint64_t *tenants,
                             int32_t k, uint64_t *out_ids, float *out_scores, int32_t *out_counts, bool locked,
                             const char *fn) {
  const int32_t dim = s->emb_dim;
  const size_t rb = (size_t)s->emb.ld * kvi__dtype_size(s->emb.dtype);
  float *q = malloc((size_t)nq * dim * sizeof *q), *row = malloc((size_t)dim * sizeof *row);
  heap h = {malloc((size_t)k * sizeof(float)), malloc((size_t)k * sizeof(uint64_t)), 0, 0};
  kvi_status st = KVI_OK;
  if (!q || !row || !h.s || !h.id) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d prepared queries", (int)nq);
    goto out;
  }
  for (int32_t i = 0; i < nq; i++) {
    float *qi = q + (size_t)i * dim;
    kvi__convert(qi, KVI_DTYPE_FP32, (const char *)queries + (size_t)i * dim * kvi__dtype_size(qt), qt, dim);
    if (kvi__emb_prepare(qi, dim, s->emb.dtype, s->emb.metric) >= 0) {
      st = kvi__fail(KVI_ERR_INTERNAL, fn, "query %d passed the checks but does not fit the store's embeddings", (int)i);
      goto out;
    }
  }
  /* nothing can fail from here on */
  if (!locked) kvi__store_lock(s);
  for (int32_t i = 0; i < nq; i++) {
    const float *qi = q + (size_t)i * dim;
    const tenant *t = kvi__store_tenant(s, tenants[i]);
    const size_t n = t ? t->nrows : 0;
    h.n = 0;
    h.cap = n < (size_t)k ? (int32_t)n : k;
    for (size_t r = 0; r < n; r++) {
      kvi__convert(row, KVI_DTYPE_FP32, (const char *)t->emb + r * rb, s->emb.dtype, dim);
      double d = 0.0;
      for (int32_t e = 0; e < dim; e++) d += (double)qi[e] * (double)row[e];
      float sc = (float)d;
      if (sc != sc) sc = -INFINITY;
      heap_offer(&h, sc, t->rows[r]->id);
    }
    const int32_t cnt = h.n;
    while (h.n > 0) { /* the worst goes last */
      heap_swap(&h, 0, --h.n);
      heap_down(&h, 0);
    }
    for (int32_t j = 0; j < k; j++) {
      out_ids[(size_t)i * k + j] = j < cnt ? h.id[j] : KVI_SEARCH_NO_ID;
      out_scores[(size_t)i * k + j] = j < cnt ? h.s[j] : -INFINITY;
    }
    out_counts[i] = cnt;
  }
  if (!locked) kvi__store_unlock(s);
out:
  free(q);
  free(row);
  free(h.s);
  free(h.id);
  return st;
}

/* ------------------------------------------------------------------------ */
/* CUDA: state                                                              */
/* ------------------------------------------------------------------------ */

typedef struct kvi__search kvi__search;

struct kvi__search {
  kvi__lt *lt;
  char *ws; /* device workspace, stream-ordered allocation */
  size_t ws_bytes;
  struct CUevent_st *done; /* end of the last search */
  bool done_recorded;
  /* SLOTS pinned slots: upload (plan, host queries), then results for host
   * outputs; each guarded by its last copy, and held (under the store's
   * lock) until a call has copied its host results out */
  kvi__ring ring;
  kvi__async_count bad; /* invalid device queries */
  int sms;
};

/* The store's search.release hook (registered with the workspace);
 * device_ok: the device is current (else its memory is left). */
static void search_release(kvi_store *s, bool device_ok) {
  kvi__search *x = s->search.ws;
  if (!x) return;
  if (device_ok) {
    kvi__ring_destroy(&x->ring, "kvi_store_destroy");
    if (x->done_recorded) kvi__cuda_event_sync(x->done, "kvi_store_destroy");
    kvi__cuda_event_destroy(x->done);
    kvi__cuda_free(x->ws);
    kvi__async_count_destroy(&x->bad);
    kvi__lt_destroy(x->lt);
  }
  free(x);
  s->search.ws = NULL;
  s->search.release = NULL;
}

/* Made by the first search of a CUDA store (store locked, device current). */
static kvi_status search_state(kvi_store *s, const char *fn) {
  if (s->search.ws) return KVI_OK;
  kvi__search *x = calloc(1, sizeof *x);
  if (!x) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the search state");
  s->search.ws = x;
  s->search.release = search_release;
  kvi_status st = kvi__cuda_event_create(&x->done, fn);
  if (st == KVI_OK) st = kvi__ring_init(&x->ring, SLOTS, 0, KVI__RING_GROW, fn);
  if (st == KVI_OK) st = kvi__async_count_init(&x->bad, fn);
  if (st == KVI_OK) st = kvi__cuda_sm_count(s->device, &x->sms, fn);
  if (st) search_release(s, true);
  return st;
}

kvi_status kvi__store_search_async_errors(kvi_store *store, int64_t *out_bad_queries, const char *fn) {
  if (!store || !out_bad_queries)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_bad_queries" : "store");
  kvi__store_lock(store);
  *out_bad_queries = store->search.ws ? kvi__async_count_take(&store->search.ws->bad) : 0;
  kvi__store_unlock(store);
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* CUDA: the plan                                                           */
/* ------------------------------------------------------------------------ */

/* The plan's types are in search/search.h (tests/internal checks plans). */
typedef kvi__ptile ptile;
typedef kvi__pround pround;
typedef kvi__search_plan plan;

void kvi__search_plan_free(plan *p) {
  free(p->perm);
  free(p->emits);
  free(p->tiles);
  free(p->blocks);
  free(p->sels);
  free(p->rounds);
  memset(p, 0, sizeof *p); /* a failed build frees its plan, and its caller frees it again */
}

/* Room for one more element in a growable array. */
static bool more(void **a, size_t n, size_t *cap, size_t elem) {
  if (n < *cap) return true;
  size_t c = *cap ? *cap * 2 : 64;
  void *p = realloc(*a, c * elem);
  if (!p) return false;
  *a = p;
  *cap = c;
  return true;
}
#define MORE(arr, n, cap) more((void **)&(arr), (n), &(cap), sizeof *(arr))

typedef struct qref {
  const tenant *t;
  uint64_t tenant_id;
  int32_t q;
} qref;

static int cmp_qref(const void *a, const void *b) {
  const qref *x = a, *y = b;
  if (x->tenant_id != y->tenant_id) return x->tenant_id < y->tenant_id ? -1 : 1;
  return (x->q > y->q) - (x->q < y->q);
}

typedef struct selq {
  size_t sel; /* index into plan.sels (which may move as it grows) */
  int32_t slot;
} selq;

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Stage-1 outputs of one query of a tile: min(length, k) per segment. */
static size_t tile_pairs(const ptile *t, int32_t k) {
  size_t pairs = 0;
  for (int32_t f0 = 0; f0 < t->d.nf; f0 += t->seg) {
    const int32_t len = t->d.nf - f0 < t->seg ? t->d.nf - f0 : t->seg;
    pairs += (size_t)(len < k ? len : k);
  }
  return pairs;
}

/* Bytes of the score area a tile takes in its round: scores and candidates. */
static size_t tile_bytes(const ptile *t, int32_t k) {
  return (size_t)t->d.qn * ((size_t)t->d.sld * sizeof(float) + tile_pairs(t, k) * PAIR_BYTES);
}

/* What kvi__search_plan_build keeps from step to step. A step returns
 * false when it could not allocate. */
typedef struct builder {
  const kvi_store *s;
  plan *p;
  int32_t nq, k;
  uint64_t area;
  int sms;
  qref *qs;             /* slot -> query and tenant */
  int32_t *items;       /* stage-1 selections per slot, whole call */
  int32_t *have;        /* pairs in a slot's running top k */
  int32_t *left;        /* stage-1 selections of a slot not yet planned */
  int64_t *base, *fill; /* deferred merge: each query's candidate region and its fill (NULL: a merge per round) */
  selq *sq, *sorted;    /* the round's stage-1 selections, and room to sort them */
  size_t nsq, csq, csorted, cstart, *start;
} builder;

/* Slots: queries grouped by tenant, in query order within a tenant. */
static void plan_slots(builder *b, const uint64_t *tenants) {
  for (int32_t i = 0; i < b->nq; i++) {
    b->qs[i].tenant_id = tenants[i];
    b->qs[i].t = kvi__store_tenant(b->s, tenants[i]);
    b->qs[i].q = i;
  }
  qsort(b->qs, (size_t)b->nq, sizeof *b->qs, cmp_qref);
  for (int32_t i = 0; i < b->nq; i++) b->p->perm[i] = b->qs[i].q;
}

/* Rows per tile of qn queries: whole segments of SEG while scores and
 * candidates fit the area; *seg: scores per stage-1 selection at least. */
static int64_t tile_rows(const builder *b, int32_t qn, int32_t *seg) {
  const int32_t k = b->k;
  const size_t per_seg = (size_t)qn * (SEG * sizeof(float) + (size_t)(k < SEG ? k : SEG) * PAIR_BYTES);
  int64_t ft = (int64_t)(b->area / per_seg) * SEG;
  *seg = SEG;
  if (ft == 0) { /* a small area: one segment per tile; 16 bytes per (query, row) bound both parts */
    ft = (int64_t)(b->area / ((size_t)qn * 16)) / 64 * 64;
    if (ft < 64) ft = 64;
    *seg = (int32_t)ft;
  }
  if (ft > INT32_MAX / 2) ft = INT32_MAX / 2 / SEG * SEG;
  return ft;
}

/* The tiles of slots [g0, g1), one tenant's queries. */
static bool group_tiles(builder *b, int32_t g0, int32_t g1) {
  plan *p = b->p;
  const tenant *t = b->qs[g0].t;
  const int32_t ld = b->s->emb.ld;
  const size_t es = kvi__dtype_size(b->s->emb.dtype);
  const int64_t n = t ? (int64_t)t->nrows : 0;
  const int32_t g = g1 - g0;
  const bool scan = g <= KVI__SCAN_MAX_Q && (size_t)g * ld * sizeof(float) <= KVI__SCAN_SMEM;
  const int32_t qt = scan ? g : (g < GEMM_QT ? g : GEMM_QT);
  for (int32_t q0 = g0; n > 0 && q0 < g1; q0 += qt) {
    const int32_t qn = g1 - q0 < qt ? g1 - q0 : qt;
    int32_t seg;
    const int64_t ft = tile_rows(b, qn, &seg);
    for (int64_t f0 = 0; f0 < n; f0 += ft) {
      if (!MORE(p->tiles, p->ntiles, p->ctiles)) return false;
      ptile *pt = &p->tiles[p->ntiles++];
      memset(pt, 0, sizeof *pt);
      pt->d.mat = (const char *)t->emb + (size_t)f0 * ld * es;
      pt->d.q0 = q0;
      pt->d.qn = qn;
      pt->d.nf = (int32_t)(n - f0 < ft ? n - f0 : ft);
      pt->d.sld = (int32_t)round_up((size_t)pt->d.nf, 4);
      pt->ids = t->ids + f0;
      pt->row0 = (int32_t)f0;
      /* stage-1 runs: about four selections per SM over the tile's queries
       * (a selection reads its run about twice, whatever its length) */
      int64_t run = (int64_t)pt->d.nf * qn / (4 * (b->sms > 0 ? b->sms : 132));
      run = run < seg ? seg : run > SEG_MAX ? SEG_MAX : (int64_t)round_up((size_t)run, 1024);
      pt->seg = pt->d.nf <= 4 * seg ? pt->d.nf : (int32_t)run; /* a small tile: one selection, no merge */
      pt->gemm = !scan;
      p->any_gemm |= !scan;
      const int32_t nseg = (pt->d.nf + pt->seg - 1) / pt->seg; /* its stage-1 selections */
      for (int32_t j = q0; j < q0 + qn; j++) b->items[j] += nseg;
    }
  }
  return true;
}

/* Tiles, group by group. */
static bool plan_tiles(builder *b) {
  for (int32_t g0 = 0; g0 < b->nq;) {
    int32_t g1 = g0 + 1;
    while (g1 < b->nq && b->qs[g1].tenant_id == b->qs[g0].tenant_id) g1++;
    if (!group_tiles(b, g0, g1)) return false;
    g0 = g1;
  }
  return true;
}

/* One merge at the end: when every stage-1 output of the call fits in an
 * eighth of the area (beside it), each query's candidates of all rounds
 * go to one region of its own and a single stage 2 merges them after the
 * last round, instead of a merge into the running top k every round (for
 * 256 queries over 1M facts, 17 merges of 10 us). Sets base and fill then. */
static bool plan_deferred(builder *b) {
  plan *p = b->p;
  size_t pairs = 0;
  for (size_t i = 0; i < p->ntiles; i++) pairs += (size_t)p->tiles[i].d.qn * tile_pairs(&p->tiles[i], b->k);
  if (pairs * PAIR_BYTES > b->area / 8) return true;
  b->base = calloc((size_t)b->nq, sizeof *b->base);
  b->fill = calloc((size_t)b->nq, sizeof *b->fill);
  if (!b->base || !b->fill) return false;
  for (size_t i = 0; i < p->ntiles; i++) { /* each multi-selection query's share */
    const ptile *pt = &p->tiles[i];
    for (int32_t j = pt->d.q0; j < pt->d.q0 + pt->d.qn; j++)
      if (b->items[j] > 1) b->fill[j] += (int64_t)tile_pairs(pt, b->k);
  }
  int64_t at = 0;
  for (int32_t j = 0; j < b->nq; j++) b->base[j] = at, at += b->fill[j], b->fill[j] = 0;
  p->cand_pairs = (size_t)at;
  return true;
}

/* Emits: only the queries without a selection (a tenant without rows);
 * every other query's last selection writes its results itself. */
static void plan_emits(builder *b) {
  plan *p = b->p;
  for (int32_t i = 0; i < b->nq; i++)
    if (b->items[i] == 0) {
      kvi__emit e = {(int64_t)i * b->k, 0, b->qs[i].q, i, 0};
      p->emits[p->nemits++] = e;
    }
  memcpy(b->left, b->items, (size_t)b->nq * sizeof *b->left);
}

/* A new round of the tiles from t0 on while they fit the area (at least
 * one), their score offsets set; NULL when out of memory. */
static pround *round_tiles(builder *b, size_t t0) {
  plan *p = b->p;
  size_t t1 = t0, bytes = 0, floats = 0;
  while (t1 < p->ntiles && (t1 == t0 || bytes + tile_bytes(&p->tiles[t1], b->k) <= b->area)) {
    ptile *pt = &p->tiles[t1];
    pt->d.off = (int64_t)floats;
    floats += (size_t)pt->d.qn * pt->d.sld;
    bytes += tile_bytes(pt, b->k);
    t1++;
  }
  if (!MORE(p->rounds, p->nrounds, p->crounds)) return NULL;
  pround *r = &p->rounds[p->nrounds++];
  memset(r, 0, sizeof *r);
  r->t0 = t0, r->t1 = t1;
  if (floats > p->score_floats) p->score_floats = floats;
  return r;
}

/* Scan blocks: about two CTAs per SM over the round's scan rows. */
static bool round_blocks(builder *b, pround *r) {
  plan *p = b->p;
  r->b0 = p->nblocks;
  size_t scan_rows = 0;
  for (size_t i = r->t0; i < r->t1; i++)
    if (!p->tiles[i].gemm) scan_rows += (size_t)p->tiles[i].d.nf;
  int32_t nr = (int32_t)round_up(scan_rows / (size_t)(2 * (b->sms > 0 ? b->sms : 1)) + 1, KVI__SCAN_ROWS);
  if (nr > 1024) nr = 1024;
  for (size_t i = r->t0; i < r->t1; i++) {
    const ptile *pt = &p->tiles[i];
    if (pt->gemm) continue;
    if (pt->d.qn > r->qmax) r->qmax = pt->d.qn;
    for (int32_t r0 = 0; r0 < pt->d.nf; r0 += nr) {
      if (!MORE(p->blocks, p->nblocks, p->cblocks)) return false;
      kvi__sblock sb = {(int32_t)i, r0, pt->d.nf - r0 < nr ? pt->d.nf - r0 : nr, 0};
      p->blocks[p->nblocks++] = sb;
    }
  }
  r->b1 = p->nblocks;
  return true;
}

/* Stage 1: a selection per (tile, query, segment) of the round, each
 * listed in sq with its slot; destinations come later. */
static bool round_stage1(builder *b, pround *r) {
  plan *p = b->p;
  r->s0 = p->nsels;
  b->nsq = 0;
  for (size_t i = r->t0; i < r->t1; i++) {
    const ptile *pt = &p->tiles[i];
    for (int32_t j = 0; j < pt->d.qn; j++)
      for (int32_t f0 = 0; f0 < pt->d.nf; f0 += pt->seg) {
        if (!MORE(p->sels, p->nsels, p->csels)) return false;
        kvi__sel *sl = &p->sels[p->nsels++];
        memset(sl, 0, sizeof *sl);
        sl->out = -1;
        sl->ids = pt->ids + f0;
        sl->row0 = pt->row0 + f0;
        sl->a = pt->d.off + (int64_t)j * pt->d.sld + f0;
        sl->nb = pt->d.nf - f0 < pt->seg ? pt->d.nf - f0 : pt->seg;
        if (!MORE(b->sq, b->nsq, b->csq)) return false;
        selq e = {p->nsels - 1, pt->d.q0 + j};
        b->sq[b->nsq++] = e;
      }
  }
  r->s1 = p->nsels;
  return true;
}

/* Deferred merge: stage-1 outputs into each query's region; after the last
 * round, one stage 2 per multi-selection query. */
static bool round_deferred(builder *b, pround *r) {
  plan *p = b->p;
  const int32_t k = b->k;
  const int64_t cand0 = (int64_t)b->nq * k;
  for (size_t i = 0; i < b->nsq; i++) {
    kvi__sel *sl = &p->sels[b->sq[i].sel];
    const int32_t slot = b->sq[i].slot;
    if (b->items[slot] == 1) {
      sl->dst = (int64_t)slot * k;
      sl->out = b->qs[slot].q;
    } else {
      sl->dst = cand0 + b->base[slot] + b->fill[slot];
      b->fill[slot] += sl->nb < k ? sl->nb : k;
    }
  }
  if (r->t1 == p->ntiles)
    for (int32_t j = 0; j < b->nq; j++) {
      if (b->items[j] <= 1) continue;
      if (!MORE(p->sels, p->nsels, p->csels)) return false;
      kvi__sel *m = &p->sels[p->nsels++];
      memset(m, 0, sizeof *m);
      m->a = m->dst = (int64_t)j * k;
      m->b = cand0 + b->base[j];
      m->nb = (int32_t)b->fill[j];
      m->out = b->qs[j].q;
    }
  r->s2 = p->nsels;
  return true;
}

/* The round's sq in slot order, stable: a counting sort over the round's
 * slots (qsort of the 512 selections of each of a 256-query batch's 17
 * rounds took most of its 0.7 ms of planning). */
static bool sort_by_slot(builder *b) {
  const size_t nsq = b->nsq;
  if (nsq == 0) return true;
  int32_t lo = b->sq[0].slot, hi = b->sq[0].slot;
  for (size_t i = 1; i < nsq; i++)
    lo = b->sq[i].slot < lo ? b->sq[i].slot : lo, hi = b->sq[i].slot > hi ? b->sq[i].slot : hi;
  const size_t span = (size_t)(hi - lo) + 2;
  if (span > b->cstart) {
    size_t *ns = realloc(b->start, span * sizeof *ns);
    if (!ns) return false;
    b->start = ns, b->cstart = span;
  }
  if (nsq > b->csorted) {
    selq *ns = realloc(b->sorted, nsq * sizeof *ns);
    if (!ns) return false;
    b->sorted = ns, b->csorted = nsq;
  }
  size_t *start = b->start;
  memset(start, 0, span * sizeof *start);
  for (size_t i = 0; i < nsq; i++) start[b->sq[i].slot - lo + 1]++;
  for (size_t i = 1; i < span; i++) start[i] += start[i - 1];
  for (size_t i = 0; i < nsq; i++) b->sorted[start[b->sq[i].slot - lo]++] = b->sq[i];
  memcpy(b->sq, b->sorted, nsq * sizeof *b->sq);
  return true;
}

/* A merge per round: a query's stage-1 outputs contiguous (sq in slot
 * order), then a stage 2 into its running top k; a query's only selection
 * goes straight to its results. */
static bool round_merges(builder *b, pround *r) {
  plan *p = b->p;
  const int32_t k = b->k;
  const int64_t cand0 = (int64_t)b->nq * k;
  int64_t cursor = 0;
  for (size_t i = 0; i < b->nsq;) {
    const int32_t slot = b->sq[i].slot;
    size_t j = i;
    const int64_t first = cursor;
    for (; j < b->nsq && b->sq[j].slot == slot; j++) {
      kvi__sel *sl = &p->sels[b->sq[j].sel];
      const int32_t out = sl->nb < k ? sl->nb : k;
      b->left[slot]--;
      if (b->items[slot] == 1) { /* the only selection of this query: straight into its results */
        sl->dst = (int64_t)slot * k;
        sl->out = b->qs[slot].q;
      } else {
        sl->dst = cand0 + cursor;
        cursor += out;
      }
    }
    if (b->items[slot] > 1) { /* stage 2: merge into the running top k */
      if (!MORE(p->sels, p->nsels, p->csels)) return false;
      kvi__sel *m = &p->sels[p->nsels++];
      memset(m, 0, sizeof *m);
      m->out = b->left[slot] == 0 ? b->qs[slot].q : -1; /* the query's last merge writes its results */
      m->a = (int64_t)slot * k;
      m->na = b->have[slot];
      m->b = cand0 + first;
      m->nb = (int32_t)(cursor - first);
      m->dst = (int64_t)slot * k;
      b->have[slot] = b->have[slot] + m->nb < k ? b->have[slot] + m->nb : k;
    }
    i = j;
  }
  r->s2 = p->nsels;
  if ((size_t)cursor > p->cand_pairs) p->cand_pairs = (size_t)cursor;
  return true;
}

/* Rounds: tiles in order while they fit the area, each with its scan
 * blocks, stage-1 selections and merges. */
static bool plan_rounds(builder *b) {
  for (size_t t0 = 0; t0 < b->p->ntiles;) {
    pround *r = round_tiles(b, t0);
    if (!r || !round_blocks(b, r) || !round_stage1(b, r)) return false;
    if (b->base) { /* deferred: into the query's region; the merge comes after the last round */
      if (!round_deferred(b, r)) return false;
    } else if (!sort_by_slot(b) || !round_merges(b, r)) {
      return false;
    }
    t0 = r->t1;
  }
  return true;
}

kvi_status kvi__search_plan_build(const kvi_store *s, plan *p, const uint64_t *tenants, int32_t nq, int32_t k,
                                  uint64_t area, int sms, const char *fn) {
  memset(p, 0, sizeof *p);
  builder b;
  memset(&b, 0, sizeof b);
  b.s = s, b.p = p, b.nq = nq, b.k = k, b.area = area, b.sms = sms;
  b.qs = malloc((size_t)nq * sizeof *b.qs);
  b.items = calloc((size_t)nq, sizeof *b.items);
  b.have = calloc((size_t)nq, sizeof *b.have);
  b.left = calloc((size_t)nq, sizeof *b.left);
  p->perm = malloc((size_t)nq * sizeof *p->perm);
  p->emits = malloc((size_t)nq * sizeof *p->emits);
  bool ok = b.qs && b.items && b.have && b.left && p->perm && p->emits;
  if (ok) {
    plan_slots(&b, tenants);
    ok = plan_tiles(&b) && plan_deferred(&b);
  }
  if (ok) {
    plan_emits(&b);
    ok = plan_rounds(&b);
  }
  kvi_status st = KVI_OK;
  if (!ok) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the plan of %d queries", (int)nq);
    kvi__search_plan_free(p);
  }
  free(b.qs);
  free(b.items);
  free(b.have);
  free(b.left);
  free(b.sq);
  free(b.sorted);
  free(b.start);
  free(b.base);
  free(b.fill);
  return st;
}

/* ------------------------------------------------------------------------ */
/* CUDA: execution                                                          */
/* ------------------------------------------------------------------------ */

static size_t align256(size_t n) { return (n + 255) & ~(size_t)255; }

/* Byte layout of a call's upload (plan, host queries), workspace and results. */
typedef struct layout {
  size_t o_perm, o_tiles, o_blocks, o_sels, o_emits, o_raw, upload; /* in the upload */
  size_t o_q, o_valid, o_ps, o_pi, o_pr, o_scores, o_lt, o_rows, ws; /* in the workspace */
  /* results for the host (or scores nobody asked for), back to back */
  size_t o_out_ids, o_out_scores, o_out_counts, o_out_tokens;
  size_t out; /* host results, in the slot after the upload */
  size_t pairs;
} layout;

/* rows: a retrieve-and-inject search (pairs carry rows; tokens are a result) */
static void make_layout(layout *l, const kvi_store *s, const plan *p, int32_t nq, int32_t k, kvi_dtype qt,
                        bool host_queries, bool host_out, bool rows) {
  memset(l, 0, sizeof *l);
  size_t o = 0;
  l->o_perm = o, o = align256(o + (size_t)nq * sizeof(int32_t));
  l->o_tiles = o, o = align256(o + p->ntiles * sizeof(kvi__stile));
  l->o_blocks = o, o = align256(o + p->nblocks * sizeof(kvi__sblock));
  l->o_sels = o, o = align256(o + p->nsels * sizeof(kvi__sel));
  l->o_emits = o, o = align256(o + (size_t)nq * sizeof(kvi__emit));
  l->o_raw = o;
  if (host_queries) o = align256(o + (size_t)nq * s->emb_dim * kvi__dtype_size(qt));
  l->upload = o;
  l->pairs = (size_t)nq * k + p->cand_pairs;
  l->o_q = o, o = align256(o + (size_t)nq * s->emb.ld * kvi__dtype_size(s->emb.dtype));
  l->o_valid = o, o = align256(o + (size_t)nq * sizeof(int32_t));
  l->o_ps = o, o = align256(o + l->pairs * sizeof(float));
  l->o_pi = o, o = align256(o + l->pairs * sizeof(uint64_t));
  if (rows) l->o_pr = o, o = align256(o + l->pairs * sizeof(uint32_t));
  l->o_scores = o, o = align256(o + p->score_floats * sizeof(float));
  l->o_lt = o;
  if (p->any_gemm) o = align256(o + LT_WS);
  const size_t no = (size_t)nq * k;
  if (rows) l->o_rows = o, o = align256(o + no * sizeof(int32_t));
  if (host_out || rows) {
    const size_t o0 = o;
    l->o_out_ids = o, o = align256(o + no * sizeof(uint64_t));
    l->o_out_scores = o, o = align256(o + no * sizeof(float));
    l->o_out_counts = o, o = align256(o + (size_t)nq * sizeof(int32_t));
    l->o_out_tokens = o;
    if (rows) o = align256(o + (size_t)nq * sizeof(int32_t));
    if (host_out) l->out = o - o0;
  }
  l->ws = o;
}

/* Copies the plan into the upload area of the slot. */
static void write_upload(char *u, const layout *l, const plan *p, int32_t nq) {
  memcpy(u + l->o_perm, p->perm, (size_t)nq * sizeof(int32_t));
  kvi__stile *t = (kvi__stile *)(u + l->o_tiles);
  for (size_t i = 0; i < p->ntiles; i++) t[i] = p->tiles[i].d;
  memcpy(u + l->o_blocks, p->blocks, p->nblocks * sizeof(kvi__sblock));
  memcpy(u + l->o_sels, p->sels, p->nsels * sizeof(kvi__sel));
  memcpy(u + l->o_emits, p->emits, p->nemits * sizeof(kvi__emit));
}

#ifdef KVI_HAVE_CUBLASLT
#define LAUNCH(call, what)                                                                                          \
  do {                                                                                                              \
    if (st == KVI_OK) st = kvi__cuda_error((call), fn, what);                                                       \
  } while (0)
#else
#define LAUNCH(call, what)                                                                                          \
  do {                                                                                                              \
    if (st == KVI_OK) st = kvi__fail(KVI_ERR_NOT_BUILT, fn, "libkvinject was built without cuBLASLt");              \
  } while (0)
#endif

/* Enqueues everything after the upload (store locked, device current). */
static kvi_status enqueue(kvi_store *s, const plan *p, const layout *l, const void *raw, kvi_dtype qt, int32_t nq,
                          int32_t k, uint64_t *out_ids, float *out_scores, int32_t *out_counts, int32_t *out_rows,
                          struct CUstream_st *stream, const char *fn) {
  kvi__search *x = s->search.ws;
  char *ws = x->ws;
  kvi__search_args a;
  memset(&a, 0, sizeof a);
  a.dtype = (int32_t)s->emb.dtype;
  a.dim = s->emb_dim;
  a.ld = s->emb.ld;
  a.k = k;
  a.raw = raw;
  a.raw_dtype = (int32_t)qt;
  a.cosine = s->emb.metric == KVI_METRIC_COSINE;
  a.perm = (const int32_t *)(ws + l->o_perm);
  a.nq = nq;
  a.q = ws + l->o_q;
  a.valid = (int32_t *)(ws + l->o_valid);
  a.bad = x->bad.dev;
  a.scores = (float *)(ws + l->o_scores);
  a.ps = (float *)(ws + l->o_ps);
  a.pi = (uint64_t *)(ws + l->o_pi);
  a.pr = out_rows ? (uint32_t *)(ws + l->o_pr) : NULL;
  a.out_rows = out_rows;
  a.out_ids = out_ids;
  a.out_scores = out_scores;
  a.out_counts = out_counts;
  const kvi__stile *tiles = (const kvi__stile *)(ws + l->o_tiles);
  const kvi__sblock *blocks = (const kvi__sblock *)(ws + l->o_blocks);
  const kvi__sel *sels = (const kvi__sel *)(ws + l->o_sels);
  const size_t es = kvi__dtype_size(s->emb.dtype);
  kvi_status st = KVI_OK;
  LAUNCH(kvi__cuda_search_prep(&a, stream), "search prep kernel");
  for (size_t r = 0; r < p->nrounds && st == KVI_OK; r++) {
    const pround *rd = &p->rounds[r];
    if (rd->b1 > rd->b0) {
      a.tiles = tiles;
      a.blocks = blocks + rd->b0;
      a.nblocks = (int32_t)(rd->b1 - rd->b0);
      a.qmax = rd->qmax;
      LAUNCH(kvi__cuda_search_scan(&a, stream), "search scan kernel");
    }
    for (size_t i = rd->t0; i < rd->t1 && st == KVI_OK; i++) {
      const ptile *pt = &p->tiles[i];
      if (!pt->gemm) continue;
      st = kvi__lt_scores(x->lt, s->emb.dtype, pt->d.mat, s->emb.ld, ws + l->o_q + (size_t)pt->d.q0 * s->emb.ld * es,
                          s->emb.ld, a.scores + pt->d.off, pt->d.sld, pt->d.nf, pt->d.qn, s->emb.ld, ws + l->o_lt,
                          LT_WS, stream, fn);
    }
    a.sels = sels + rd->s0;
    a.nsels = (int32_t)(rd->s1 - rd->s0);
    if (a.nsels > 0) LAUNCH(kvi__cuda_search_select(&a, stream), "search selection kernel (stage 1)");
    a.sels = sels + rd->s1;
    a.nsels = (int32_t)(rd->s2 - rd->s1);
    if (a.nsels > 0) LAUNCH(kvi__cuda_search_select(&a, stream), "search selection kernel (stage 2)");
  }
  a.emits = (const kvi__emit *)(ws + l->o_emits);
  a.nemits = (int32_t)p->nemits;
  if (a.nemits > 0) LAUNCH(kvi__cuda_search_emit(&a, stream), "search emit kernel");
  return st;
}

/* then: kvi__search_then (out_scores NULL, out_tokens a result), or NULL.
 * locked: the caller holds the store's lock, and keeps it while the call
 * waits for host outputs. */
static kvi_status cuda_search(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                              const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                              int32_t *out_counts, int32_t *out_tokens, kvi_memory om, uint64_t area,
                              const kvi__search_then *then, bool locked, struct CUstream_st *stream, const char *fn) {
  kvi_status lst = kvi__lt_load(fn); /* every CUDA search needs it, whichever kernels its plan picks */
  if (lst) return lst;
  const bool host_q = qm == KVI_MEMORY_HOST, host_out = om == KVI_MEMORY_HOST;
  kvi_status st = KVI_OK;
  plan p;
  memset(&p, 0, sizeof p);
  layout l;
  kvi__ring_slot *sl = NULL;
  bool enqueued = false;
  if (!locked) kvi__store_lock(s);
  if ((st = search_state(s, fn))) goto out_record;
  kvi__search *x = s->search.ws;
  if ((st = kvi__search_plan_build(s, &p, tenants, nq, k, area, x->sms, fn))) goto out_record;
  make_layout(&l, s, &p, nq, k, qt, host_q, host_out, then != NULL);
  if (p.any_gemm && !x->lt && (st = kvi__lt_create(&x->lt, fn))) goto out_record;
  /* a free slot of the size (waits for its previous copies, or for a call copying results out of it) */
  if ((st = kvi__ring_acquire(&x->ring, l.upload + l.out, &s->lock, &sl, fn))) goto out_record;
  write_upload(sl->host, &l, &p, nq);
  if (host_q) memcpy(sl->host + l.o_raw, queries, (size_t)nq * s->emb_dim * kvi__dtype_size(qt));
  if (then && (st = then->prepare(then->ctx, fn))) goto out_record;

  /* enqueue: after the last change to the embeddings and the previous search */
  if ((st = kvi__emb_read_begin(s, stream, fn))) goto out_record;
  enqueued = true;
  if (x->done_recorded) st = kvi__cuda_stream_wait(stream, x->done, fn);
  if (st == KVI_OK && l.ws > x->ws_bytes) { /* the previous search is done with the old one in stream order */
    st = kvi__cuda_free_async(x->ws, stream, fn);
    x->ws = NULL;
    x->ws_bytes = 0;
    const size_t want = l.ws + l.ws / 4;
    if (st == KVI_OK) st = kvi__cuda_malloc_async((void **)&x->ws, want, stream, fn);
    if (st == KVI_OK) x->ws_bytes = want;
    else if (st == KVI_ERR_OUT_OF_MEMORY)
      kvi__fail(st, fn, "allocating a %zu-byte search workspace (workspace_bytes %llu)", want, (unsigned long long)area);
  }
  if (st == KVI_OK) st = kvi__cuda_h2d(x->ws, sl->host, l.upload, stream, fn);
  /* results: the caller's device memory, or the workspace (host outputs, scores nobody asked for) */
  uint64_t *d_ids = host_out ? (uint64_t *)(x->ws + l.o_out_ids) : out_ids;
  float *d_scores = host_out || !out_scores ? (float *)(x->ws + l.o_out_scores) : out_scores;
  int32_t *d_counts = host_out ? (int32_t *)(x->ws + l.o_out_counts) : out_counts;
  int32_t *d_tokens = host_out ? (int32_t *)(x->ws + l.o_out_tokens) : out_tokens;
  int32_t *d_rows = then ? (int32_t *)(x->ws + l.o_rows) : NULL;
  if (st == KVI_OK)
    st = enqueue(s, &p, &l, host_q ? (const void *)(x->ws + l.o_raw) : queries, qt, nq, k, d_ids, d_scores, d_counts,
                 d_rows, stream, fn);
  if (st == KVI_OK && then) st = then->enqueue(then->ctx, d_rows, d_counts, d_tokens, stream, fn);
  if (st == KVI_OK && host_out) /* ids, scores, counts (and tokens) sit back to back in both places */
    st = kvi__cuda_d2h(sl->host + l.upload, x->ws + l.o_out_ids, l.out, stream, fn);

out_record:
  if (enqueued) { /* ordering is kept even for a failed call: what was enqueued may run */
    kvi__search *x2 = s->search.ws;
    kvi_status s1 = kvi__ring_record(sl, stream, fn);
    kvi_status s2 = kvi__cuda_event_record(x2->done, stream, fn);
    if (s2 == KVI_OK) {
      x2->done_recorded = true;
      s2 = kvi__emb_read_end(s, x2->done, fn);
    }
    if (st == KVI_OK) st = s1 ? s1 : s2;
  }
  if (sl && !(st == KVI_OK && host_out)) kvi__ring_release(&s->search.ws->ring, sl);
  if (!locked) kvi__store_unlock(s);
  if (sl && st == KVI_OK && host_out) {
    /* wait for this search's results only, outside the lock (unless the
     * caller holds it); the slot stays ours */
    st = kvi__ring_wait(sl, fn);
    if (st == KVI_OK) {
      const char *r = sl->host + l.upload;
      memcpy(out_ids, r, (size_t)nq * k * sizeof(uint64_t));
      if (out_scores) memcpy(out_scores, r + (l.o_out_scores - l.o_out_ids), (size_t)nq * k * sizeof(float));
      memcpy(out_counts, r + (l.o_out_counts - l.o_out_ids), (size_t)nq * sizeof(int32_t));
      if (then) memcpy(out_tokens, r + (l.o_out_tokens - l.o_out_ids), (size_t)nq * sizeof(int32_t));
    }
    if (!locked) kvi__store_lock(s);
    kvi__ring_release(&s->search.ws->ring, sl);
    if (!locked) kvi__store_unlock(s);
  }
  kvi__search_plan_free(&p);
  return st;
}

/* ------------------------------------------------------------------------ */
/* the entry point                                                          */
/* ------------------------------------------------------------------------ */

kvi_status kvi__search_check(const kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                             const uint64_t *tenants, int32_t k, const kvi_search_options *o, const char *fn) {
  if (!kvi__dtype_is_float(o->query_dtype))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->query_dtype is %d, expected KVI_DTYPE_FP32, FP16 or BF16",
                     (int)o->query_dtype);
  if (o->query_memory != KVI_MEMORY_HOST && o->query_memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->query_memory is %d, expected KVI_MEMORY_HOST or DEVICE",
                     (int)o->query_memory);
  if (o->out_memory != KVI_MEMORY_HOST && o->out_memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->out_memory is %d, expected KVI_MEMORY_HOST or DEVICE",
                     (int)o->out_memory);
  if (o->workspace_bytes < MIN_WORKSPACE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->workspace_bytes is %llu, expected at least %u (1 MiB)",
                     (unsigned long long)o->workspace_bytes, MIN_WORKSPACE);
  if (num_queries < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_queries is %d", (int)num_queries);
  if (store->emb_dim == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store keeps no embeddings (created with embedding_dim 0)");
  if (dim != store->emb_dim)
    return kvi__fail(KVI_ERR_MISMATCH, fn, "dim is %d, the store's embeddings have %d elements", (int)dim,
                     (int)store->emb_dim);
  if (k < 1 || k > KVI_SEARCH_MAX_K)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "k is %d, expected 1..%d", (int)k, KVI_SEARCH_MAX_K);
  if (num_queries == 0) return KVI_OK;
  if (!queries || !tenants)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !queries ? "queries" : "tenants");
  const bool cuda = store->backend == KVI_BACKEND_CUDA;
  kvi_status st;
  if ((st = kvi__check_memory(queries, o->query_memory, cuda, store->device, fn, "queries")) ||
      (st = kvi__check_memory(tenants, KVI_MEMORY_HOST, cuda, store->device, fn, "tenants")))
    return st;
  if (o->query_memory == KVI_MEMORY_HOST && (st = check_host_queries(store, queries, o->query_dtype, num_queries, dim, fn)))
    return st;
  return KVI_OK;
}

kvi_status kvi__store_search(kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, const kvi_search_options *opts, struct CUstream_st *stream,
                             const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__SEARCH_OPTIONS_V1, fn, "opts"))) return st;
  if (num_queries > 0 && (!out_ids || !out_scores || !out_counts))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL",
                     !out_ids ? "out_ids" : !out_scores ? "out_scores" : "out_counts");
  if ((st = kvi__search_check(store, queries, num_queries, dim, tenants, k, &o, fn)) || num_queries == 0) return st;
  const bool cuda = store->backend == KVI_BACKEND_CUDA;
  if ((st = kvi__check_memory(out_ids, o.out_memory, cuda, store->device, fn, "out_ids")) ||
      (st = kvi__check_memory(out_scores, o.out_memory, cuda, store->device, fn, "out_scores")) ||
      (st = kvi__check_memory(out_counts, o.out_memory, cuda, store->device, fn, "out_counts")))
    return st;
  return kvi__search_all(store, queries, o.query_dtype, o.query_memory, num_queries, tenants, k, out_ids, out_scores,
                         out_counts, o.out_memory, o.workspace_bytes, false, stream, fn);
}

kvi_status kvi__search_all(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                           const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                           int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked, struct CUstream_st *stream,
                           const char *fn) {
  return (s->search.collective ? s->search.collective : kvi__search_local)(
      s, queries, qt, qm, nq, tenants, k, out_ids, out_scores, out_counts, om, ws, locked, stream, fn);
}

kvi_status kvi__search_local(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn) {
  if (s->backend != KVI_BACKEND_CUDA)
    return cpu_search(s, queries, qt, nq, tenants, k, out_ids, out_scores, out_counts, locked, fn);
  return cuda_search(s, queries, qt, qm, nq, tenants, k, out_ids, out_scores, out_counts, NULL, om, ws, NULL, locked,
                     stream, fn);
}

kvi_status kvi__search_then_run(kvi_store *s, const void *queries, const kvi_search_options *o, int32_t nq,
                                const uint64_t *tenants, int32_t k, uint64_t *out_ids, int32_t *out_counts,
                                int32_t *out_tokens, const kvi__search_then *then, struct CUstream_st *stream,
                                const char *fn) {
  return cuda_search(s, queries, o->query_dtype, o->query_memory, nq, tenants, k, out_ids, NULL, out_counts, out_tokens,
                     o->out_memory, o->workspace_bytes, then, false, stream, fn);
}
