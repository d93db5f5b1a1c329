/*
 * kvi_retrieve_inject: a search of the store's embeddings whose results are
 * injected. The host path searches into host memory, then injects; the
 * device path enqueues the search, the plan and the injection without the
 * host, the retrieve-plan kernel writing the plan's segments from the
 * search's results (kvi__plan_on_device and kvi__plan_and_inject, which
 * kvi_inject_batched's device fact ids take too).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "search/search.h"
#include "xfer/transfer.h"

/* A request as the job its reserve makes of it. */
static void retrieve_job(const kvi_retrieve_request *rq, int64_t tokens, job *j) {
  memset(j, 0, sizeof *j);
  j->table = rq->block_table;
  j->table_len = rq->block_table_len;
  j->table_on_host = rq->block_table_memory == KVI_MEMORY_HOST;
  j->first_slot = rq->first_slot;
  j->tokens = tokens;
  j->start_position = rq->start_position;
}

/* Checks request i's reserve (store locked): what the query may inject is
 * at most k of its tenant's facts, each no longer than the longest fact the
 * tenant has held, and its block table and positions must take that many
 * tokens. Counted over facts, not embedding rows: the same on every rank of
 * a store with sharded embeddings, so the ranks of a collective call decide
 * alike. *t: the tenant (NULL when unknown); *nres: facts reserved. */
static kvi_status check_reserve(const xfer *x, const kvi_retrieve_request *rq, int32_t i, int32_t k, job *j,
                                const tenant **t, int32_t *nres, const char *fn) {
  *t = kvi__store_tenant(x->store, rq->tenant);
  const size_t n = *t ? (*t)->count : 0;
  *nres = n < (size_t)k ? (int32_t)n : k;
  kvi_status st = kvi__store_tenant_fresh(*t, i, fn); /* the search may pick any of its facts */
  if (st == KVI_OK) st = kvi__check_table_kind(x, rq->block_table_memory, i, fn);
  if (st) return st;
  retrieve_job(rq, (int64_t)*nres * (*t ? (*t)->max_tokens : 0), j);
  return kvi__check_request_job(x, j, i, fn);
}

/* The host path (CPU stores, and CUDA stores with a host tier or sharded
 * embeddings): the search into host memory, then the injection of its
 * results, which checks everything again before writing; both locks held
 * from the reserve check to the injection, so no put or remove comes in
 * between. Arguments read and checked. */
static kvi_status retrieve_on_host(kvi_injector *injector, const void *queries, int32_t nq, int32_t dim,
                                   const kvi_retrieve_request *rq, const uint64_t *tenants, int32_t k,
                                   const kvi_search_options *opts, uint64_t *out_ids, int32_t *out_counts,
                                   int32_t *out_tokens, struct CUstream_st *stream, const char *fn) {
  xfer *x = &injector->x;
  kvi_store *s = x->store;
  (void)dim;
  const size_t n = (size_t)nq;
  ireq *ir = malloc(n * sizeof *ir);
  uint64_t *ids = malloc(n * (size_t)k * sizeof *ids), *order = malloc(n * (size_t)k * sizeof *order);
  float *scores = malloc(n * (size_t)k * sizeof *scores);
  int32_t *counts = malloc(n * sizeof *counts), *tokens = malloc(n * sizeof *tokens);
  kvi_status st = ir && ids && order && scores && counts && tokens
                      ? KVI_OK
                      : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests of %d facts", (int)nq, (int)k);
  /* the same contract as the device path: room for k facts of the tenant's
   * longest size, and the reserves within the transfer limits */
  int64_t ntok = 0, ntables = 0;
  kvi__lock_both(x);
  for (int32_t i = 0; i < nq && st == KVI_OK; i++) {
    job j;
    const tenant *t;
    int32_t nres;
    if ((st = check_reserve(x, &rq[i], i, k, &j, &t, &nres, fn))) break;
    ntok = kvi__sat_add(ntok, j.tokens);
    ntables = kvi__sat_add(ntables, kvi__host_table_entries(x, &j));
  }
  if (st == KVI_OK) st = kvi__check_limits(x, nq, ntok, ntables, fn);
  if (st == KVI_OK)
    st = kvi__search_all(s, queries, opts->query_dtype, opts->query_memory, nq, tenants, k, ids, scores, counts,
                         KVI_MEMORY_HOST, opts->workspace_bytes, true, stream, fn);
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    uint64_t *o = order + i * (size_t)k;
    for (int32_t j = 0; j < counts[i]; j++)
      o[j] = ids[i * (size_t)k + (size_t)((rq[i].flags & KVI_RETRIEVE_BEST_LAST) ? counts[i] - 1 - j : j)];
    int64_t t = 0;
    if (counts[i] > 0 && (st = kvi__inject_plan_tokens(s, rq[i].tenant, o, counts[i], &t, fn))) break;
    if (t > INT32_MAX) st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "query %zu's facts have %lld tokens", i, (long long)t);
    tokens[i] = (int32_t)t;
    kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
    q.tenant = rq[i].tenant;
    q.fact_ids = o;
    q.num_facts = counts[i];
    q.block_table = rq[i].block_table;
    q.block_table_len = rq[i].block_table_len;
    q.block_table_memory = rq[i].block_table_memory;
    q.first_slot = rq[i].first_slot;
    q.start_position = rq[i].start_position;
    st = kvi__request_of(x, &q, (int32_t)i, &ir[i], fn);
  }
  if (st == KVI_OK)
    st = kvi__inject_locked(x, ir, nq, NULL, 0, x->cache.L, KVI_HOST_PAGES_PROMOTE, NULL, NULL, stream, fn);
  kvi__unlock_both(x);
  if (st == KVI_OK) {
    memcpy(out_ids, ids, n * (size_t)k * sizeof *ids);
    memcpy(out_counts, counts, n * sizeof *counts);
    memcpy(out_tokens, tokens, n * sizeof *tokens);
  }
  free(ir);
  free(ids);
  free(order);
  free(scores);
  free(counts);
  free(tokens);
  return st;
}

/* The device path: the search's enqueue hook writes the plan's segments
 * from its results and launches the injection, without the host. */
typedef struct retr {
  xfer *x;
  const kvi_retrieve_request *rq;
  const uint64_t *tenants;
  int32_t nq, k;
  plan p;
} retr;

/* The plan of n device-planned requests (transfer.h). */
kvi_status kvi__plan_on_device(xfer *x, plan *p, const dreq *d, int32_t n, size_t extra, const char *fn) {
  const kvi_store *s = x->store;
  int32_t *spf = malloc((size_t)n * sizeof *spf);
  if (!spf) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)n);
  int64_t ntok = 0, ntables = 0, nsegs = 0;
  for (int32_t i = 0; i < n; i++) {
    const int32_t longest = d[i].t ? d[i].t->max_tokens : 0;
    /* a fact has at most one segment per token, and per page part */
    spf[i] = (int32_t)kvi__segs_for(x, pages_for(s, longest));
    if (spf[i] > longest) spf[i] = longest;
    ntok = kvi__sat_add(ntok, d[i].j.tokens);
    nsegs = kvi__sat_add(nsegs, (int64_t)d[i].nres * spf[i]);
    ntables = kvi__sat_add(ntables, kvi__host_table_entries(x, &d[i].j));
  }
  kvi_status st = KVI_OK;
  if (nsegs > ntok) st = kvi__fail(KVI_ERR_INTERNAL, fn, "%lld segments for %lld tokens", (long long)nsegs, (long long)ntok);
  if (st == KVI_OK)
    st = kvi__plan_alloc(p, x, nsegs, n, ntok, 0, ntables, kvi__align_up((size_t)n * sizeof(kvi__rquery)) + extra, fn);
  if (st == KVI_OK) {
    kvi__rquery *q = (kvi__rquery *)(p->buf + p->o_ext);
    int32_t seg0 = 0;
    for (int32_t i = 0; i < n; i++) {
      const tenant *t = d[i].t;
      kvi__plan_request(p, x, &d[i].j);
      memset(&q[i], 0, sizeof q[i]);
      q[i].dir = d[i].nres > 0 ? t->dir : NULL;
      q[i].first_slot = d[i].j.first_slot;
      q[i].cap = d[i].j.tokens;
      q[i].stride = t ? t->dir_stride : 0;
      q[i].spf = spf[i];
      q[i].seg0 = seg0;
      q[i].nres = d[i].nres;
      q[i].start_position = d[i].start_position;
      q[i].best_last = d[i].best_last;
      seg0 += d[i].nres * spf[i];
    }
    p->nsegs = seg0;
  }
  free(spf);
  return st;
}

/* The device work of a device-planned call (transfer.h). */
kvi_status kvi__plan_and_inject(xfer *x, plan *p, size_t host_end, int32_t n, int32_t k, int32_t *rows,
                                const int32_t *counts, const kvi__idreq *look, const uint64_t *fact_ids,
                                int32_t *out_counts, int32_t *out_tokens, int32_t lb, int32_t le,
                                struct CUstream_st *stream, const char *fn) {
  char *dev = p->sl->dev + p->off;
  kvi__rplan_args a;
  memset(&a, 0, offsetof(kvi__rplan_args, blob));
  a.queries = (const kvi__rquery *)(dev + p->o_ext);
  a.nq = n;
  a.k = k;
  a.P = x->store->P;
  a.seg_tokens = x->seg_tokens;
  a.rows = rows;
  a.counts = counts;
  a.segs = (kvi__xseg *)dev;
  a.out_counts = out_counts;
  a.out_tokens = out_tokens;
  a.skipped = x->skipped.dev;
  a.look = look;
  a.fact_ids = fact_ids;
  /* the host-built part (the segments before o_reqs are the kernel's to write): in the
   * kernel's parameters when it fits, else uploaded */
  const size_t bytes = host_end - p->o_reqs;
  if (bytes <= KVI__RPLAN_INLINE && bytes % 8 == 0 && (uintptr_t)(dev + p->o_reqs) % 8 == 0) {
    a.blob_dst = dev + p->o_reqs;
    a.blob_bytes = (int32_t)bytes;
    memcpy(a.blob, p->buf + p->o_reqs, bytes);
  } else {
    kvi_status st = kvi__cuda_h2d(dev + p->o_reqs, p->buf + p->o_reqs, bytes, stream, fn);
    if (st) return st;
  }
  p->uploaded = true;
  p->after_plan_kernel = true;
#ifdef KVI_HAVE_CUDA
  const int err = kvi__cuda_retrieve_plan(&a, stream);
  if (err) return kvi__cuda_error(err, fn, "retrieve plan kernel launch");
#endif
  return kvi__launch(x, p, lb, le, true, stream, fn);
}

static kvi_status retr_prepare(void *ctx, const char *fn) {
  retr *r = ctx;
  xfer *x = r->x;
  dreq *d = malloc((size_t)r->nq * sizeof *d);
  kvi_status st = d ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)r->nq);
  for (int32_t i = 0; i < r->nq && st == KVI_OK; i++) {
    st = check_reserve(x, &r->rq[i], i, r->k, &d[i].j, &d[i].t, &d[i].nres, fn);
    d[i].start_position = r->rq[i].start_position;
    d[i].best_last = (r->rq[i].flags & KVI_RETRIEVE_BEST_LAST) != 0;
  }
  if (st == KVI_OK) st = kvi__plan_on_device(x, &r->p, d, r->nq, 0, fn);
  free(d);
  return st;
}

kvi_status kvi__retrieve_prepare(kvi_injector *injector, const kvi_retrieve_request *reqs, int32_t nq, int32_t k,
                                 kvi__plan_view *out) {
  xfer *x = &injector->x;
  memset(out, 0, sizeof *out);
  if (x->cuda) /* its plan would take a staging slot, which only a launch gives back in order */
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, "kvi__retrieve_prepare", "a CPU injector's plans only");
  retr r = {x, reqs, NULL, nq, k, {0}};
  kvi__lock_both(x);
  const kvi_status st = retr_prepare(&r, "kvi_retrieve_inject");
  kvi__unlock_both(x);
  kvi__view_of_plan(out, &r.p);
  return st;
}

static kvi_status retr_enqueue(void *ctx, const int32_t *rows, int32_t *counts, int32_t *tokens,
                               struct CUstream_st *stream, const char *fn) {
  retr *r = ctx;
  /* the search's rows are only read: no lookups */
  return kvi__plan_and_inject(r->x, &r->p, r->p.bytes, r->nq, r->k, (int32_t *)rows, counts, NULL, NULL, counts,
                              tokens, 0, r->x->cache.L, stream, fn);
}

kvi_status kvi__retrieve_inject(kvi_injector *injector, const void *queries, int32_t num_queries, int32_t dim,
                                const kvi_retrieve_request *reqs, int32_t k, const kvi_search_options *opts,
                                uint64_t *out_ids, int32_t *out_counts, int32_t *out_tokens, struct CUstream_st *stream,
                                const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (num_queries < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_queries is %d", (int)num_queries);
  if (num_queries > 0 && (!reqs || !out_ids || !out_counts || !out_tokens))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL",
                     !reqs ? "reqs" : !out_ids ? "out_ids" : !out_counts ? "out_counts" : "out_tokens");
  xfer *x = &injector->x;
  kvi_store *s = x->store;
  kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&so, sizeof so, opts, KVI__SEARCH_OPTIONS_V1, fn, "opts"))) return st;
  if (k < 1 || k > KVI_SEARCH_MAX_K)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "k is %d, expected 1..%d", (int)k, KVI_SEARCH_MAX_K);
  if ((st = kvi__check_rope_set(x, fn))) return st;
  if (num_queries == 0) return KVI_OK;
  kvi__struct_array a;
  const size_t n = (size_t)num_queries;
  kvi_retrieve_request *rq = malloc(n * sizeof *rq);
  uint64_t *tenants = malloc(n * sizeof *tenants);
  st = rq && tenants ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)num_queries);
  if (st == KVI_OK) st = kvi__struct_array_open(&a, reqs, num_queries, KVI__RETRIEVE_REQUEST_V1, fn, "reqs");
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi_retrieve_request init = KVI_RETRIEVE_REQUEST_INIT;
    rq[i] = init;
    if (!(st = kvi__struct_array_read(&a, (int64_t)i, &rq[i], sizeof rq[i], KVI__RETRIEVE_REQUEST_V1, fn)) &&
        (rq[i].flags & ~KVI_RETRIEVE_BEST_LAST))
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "reqs[%zu].flags has unknown bits 0x%x", i,
                     rq[i].flags & ~KVI_RETRIEVE_BEST_LAST);
    if (st == KVI_OK) tenants[i] = rq[i].tenant;
  }
  if (st == KVI_OK) st = kvi__search_check(s, queries, num_queries, dim, tenants, k, &so, fn);
  if (st == KVI_OK && (!x->cuda || !s->emb.dir_on || s->shard.emb_sharded) && so.out_memory != KVI_MEMORY_HOST)
    st = kvi__fail(so.out_memory == KVI_MEMORY_DEVICE ? KVI_ERR_MEMORY_KIND : KVI_ERR_INVALID_ARGUMENT, fn,
                   "opts->out_memory is %d; %s writes host memory only", (int)so.out_memory,
                   !x->cuda ? "a CPU store" : "a store with a host tier or sharded embeddings");
  const char *what[3] = {"out_ids", "out_counts", "out_tokens"};
  const void *outs[3] = {out_ids, out_counts, out_tokens};
  for (int i = 0; i < 3 && st == KVI_OK; i++)
    st = kvi__check_memory(outs[i], so.out_memory, x->cuda, s->device, fn, what[i]);
  if (st == KVI_OK && x->cuda && s->emb.dir_on && !s->shard.emb_sharded) {
    /* the device path: search, plan and inject enqueued under one hold of both locks */
    retr r = {x, rq, tenants, num_queries, k, {0}};
    const kvi__search_then then = {retr_prepare, retr_enqueue, &r};
    pthread_mutex_lock(&x->lock);
    st = kvi__search_then_run(s, queries, &so, num_queries, tenants, k, out_ids, out_counts, out_tokens, &then, stream,
                              fn);
    kvi__plan_free(x, &r.p);
    pthread_mutex_unlock(&x->lock);
  } else if (st == KVI_OK) {
    st = retrieve_on_host(injector, queries, num_queries, dim, rq, tenants, k, &so, out_ids, out_counts, out_tokens,
                          stream, fn);
  }
  free(rq);
  free(tenants);
  return st;
}
