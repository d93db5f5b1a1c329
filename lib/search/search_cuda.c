/*
 * The CUDA search: its state (made by a store's first search) and its
 * execution. Planned on the host under the store's lock (search_plan.c),
 * enqueued on the caller's stream without waiting for it:
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
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "search/search_impl.h"

#define SLOTS 4
#define LT_WS (32u << 20) /* cuBLASLt's workspace, when a GEMM is planned */

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

kvi_status kvi__store_async_errors(kvi_store *store, int64_t *out_count, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi__store_lock(store);
  const int64_t bad = store->search.ws ? kvi__async_count_take(&store->search.ws->bad) : 0;
  const kvi_status st = kvi__emb_latched(store, fn);
  kvi__store_unlock(store);
  if (out_count) *out_count = bad;
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

kvi_status kvi__search_cuda(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
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
