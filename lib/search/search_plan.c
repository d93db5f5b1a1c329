/*
 * The plan of a CUDA search (search.h, kvi__search_plan_build), built on the
 * host under the store's lock: the queries grouped by tenant into slots, cut
 * into score tiles (queries of one tenant x a range of its rows, a scan
 * kernel's or a GEMM's), packed into rounds whose scores and candidates fit
 * the workspace's area, with each round's scan blocks, stage-1 selections
 * and merges (search_cuda.c enqueues them).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "search/search_impl.h"

#define SEG 4096          /* scores per stage-1 selection, at least */
#define SEG_MAX 65536     /* and at most */
#define GEMM_QT 256       /* queries per GEMM tile */
#define PAIR_BYTES 12     /* a candidate: fp32 score + 64-bit id */

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
 * last round, instead of a merge into the running top k every round (a
 * large batch over many facts would otherwise pay one merge per round).
 * Sets base and fill then. */
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
 * slots (a qsort of every round's selections dominated a large batch's
 * planning). */
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
