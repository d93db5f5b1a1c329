/*
 * kvi_inject, kvi_inject_deviation and kvi_inject_plan: the requests read,
 * their facts looked up and one plan made for the call (kvi__inject_locked,
 * which kvi_retrieve_inject's host path and kvi_inject_batched share); and
 * the injector's async-error query.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/transfer.h"

/* Refuses request r's fact ft, injected from sequence index slot0 on, when
 * its stored token ids are not want[0 .. ft->tokens). */
static kvi_status check_token_ids(const ireq *rq, int32_t r, const fact *ft, const int32_t *want, int64_t slot0,
                                  const char *fn) {
  if (!ft->token_ids)
    return kvi__fail(KVI_ERR_TOKEN_MISMATCH, fn,
                     "request %d: fact %llu of tenant %llu has no stored token ids (expect_token_ids given)", (int)r,
                     (unsigned long long)ft->id, (unsigned long long)rq->tenant);
  if (memcmp(ft->token_ids, want, (size_t)ft->tokens * sizeof *want) == 0) return KVI_OK;
  int32_t i = 0;
  while (ft->token_ids[i] == want[i]) i++;
  return kvi__fail(KVI_ERR_TOKEN_MISMATCH, fn,
                   "request %d: fact %llu of tenant %llu: its token %d (sequence slot %lld) is %d in "
                   "expect_token_ids, %d stored",
                   (int)r, (unsigned long long)ft->id, (unsigned long long)rq->tenant, (int)i,
                   (long long)(slot0 + i), (int)want[i], (int)ft->token_ids[i]);
}

/* Looks request r's facts up and sums their tokens and pages (store
 * locked); the job is checked later (kvi__check_request_job). */
static kvi_status inject_job(const xfer *x, const ireq *rq, int32_t r, job *j, int64_t *npages, fact **found,
                             const char *fn) {
  *j = rq->j;
  j->tokens = 0;
  *npages = 0;
  if (rq->num_facts < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: num_facts is %d", (int)r, (int)rq->num_facts);
  if (rq->num_facts > 0 && !rq->fact_ids)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: fact_ids is NULL", (int)r);
  kvi__store_find_many(x->store, &rq->tenant, 0, rq->fact_ids, (size_t)rq->num_facts, found);
  for (int32_t f = 0; f < rq->num_facts; f++) {
    const fact *ft = found[f];
    if (!ft)
      return kvi__fail(KVI_ERR_NOT_FOUND, fn, "request %d: no fact %llu for tenant %llu", (int)r,
                       (unsigned long long)rq->fact_ids[f], (unsigned long long)rq->tenant);
    __builtin_prefetch(ft->pages); /* read when the plan is written */
    kvi_status st;
    if (ft->stale) return kvi__store_stale_fail(ft, r, fn);
    if (rq->expect_ids && rq->expect_sized && j->tokens + ft->tokens > rq->num_expect)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "request %d: %lld expected token ids, its facts have more tokens (one id per token)", (int)r,
                       (long long)rq->num_expect);
    if (rq->expect_ids &&
        (st = check_token_ids(rq, r, ft, rq->expect_ids + j->tokens, rq->j.first_slot + j->tokens, fn)))
      return st;
    j->tokens += ft->tokens;
    *npages += ft->npages;
  }
  if (rq->expect_ids && rq->expect_sized && rq->num_expect != j->tokens)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "request %d: %lld expected token ids, its facts have %lld tokens (one id per token)", (int)r,
                     (long long)rq->num_expect, (long long)j->tokens);
  if (rq->num_positions < 0 || (rq->num_positions > 0 && !rq->j.positions))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: num_positions is %lld with positions %s", (int)r,
                     (long long)rq->num_positions, rq->j.positions ? "given" : "NULL");
  if (rq->num_positions > 0 && rq->num_positions != j->tokens)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "request %d: num_positions is %lld, its facts have %lld tokens (one position per token)", (int)r,
                     (long long)rq->num_positions, (long long)j->tokens);
  return KVI_OK;
}

/* The injection of both forms of the call (rq: the requests, their tables'
 * kinds checked), both locks held: kvi_inject, kvi_inject_batched, and
 * kvi_retrieve_inject's host path, which holds them from its search on; and
 * kvi_inject_deviation (dv not NULL: the plan is scored, nothing written).
 * out_tokens: NULL, or host memory for each request's tokens (written on
 * success). */
kvi_status kvi__inject_locked(xfer *x, const ireq *rq, int32_t num_requests, const flat_pos *fp, int32_t lb,
                              int32_t le, kvi_host_pages host_pages, const deviation *dv, int32_t *out_tokens,
                              struct CUstream_st *stream,
                              const char *fn) {
  int64_t nfacts = 0;
  for (int32_t r = 0; r < num_requests; r++)
    if (rq[r].num_facts > 0) nfacts += rq[r].num_facts;
  job *jobs = malloc((size_t)num_requests * sizeof *jobs);
  int64_t *npages = malloc((size_t)num_requests * sizeof *npages);
  /* the facts each request names, looked up once */
  fact **found = malloc((size_t)(nfacts ? nfacts : 1) * sizeof *found);
  kvi_status st = KVI_OK;
  if (!jobs || !npages || !found) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests of %lld facts", (int)num_requests,
                   (long long)nfacts);
    goto out;
  }
  int64_t ntok = 0, npos = 0, ntables = 0, first = 0, nsegs = 0;
  for (int32_t r = 0; r < num_requests; r++) {
    if ((st = inject_job(x, &rq[r], r, &jobs[r], &npages[r], found + first, fn))) goto out;
    first += rq[r].num_facts;
    ntok = kvi__sat_add(ntok, jobs[r].tokens);
  }
  if (fp && fp->p && fp->n > 0 && fp->n != ntok) {
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_positions is %lld, the call's facts have %lld tokens",
                   (long long)fp->n, (long long)ntok);
    goto out;
  }
  int64_t at = 0; /* the call's tokens before request r */
  for (int32_t r = 0; r < num_requests; r++) {
    job *j = &jobs[r];
    if (fp && fp->p) {
      j->positions = (const char *)fp->p + (size_t)at * (fp->pos64 ? 8 : 4);
      j->pos64 = fp->pos64;
    }
    at += j->tokens;
    if ((st = kvi__check_request_job(x, j, r, fn))) goto out;
    if (j->positions) npos = kvi__sat_add(npos, j->tokens);
    nsegs = kvi__sat_add(nsegs, kvi__segs_for(x, npages[r]));
    ntables = kvi__sat_add(ntables, kvi__host_table_entries(x, j));
  }
  if (dv && dv->num_scores < ntok) {
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_scores %s %lld scores, the requests inject %lld tokens",
                   dv->out ? "holds" : "is NULL:", (long long)dv->num_scores, (long long)ntok);
    goto out;
  }
  plan p;
  if ((st = kvi__plan_alloc(&p, x, nsegs, num_requests, ntok, npos, ntables, kvi__deviation_ext(x, dv, nsegs, ntok),
                            fn)))
    goto out;
  /* a tiered store keeps the call's facts on their tier (promoting, moves
   * those on the host to the device) until the work is enqueued; a
   * disk-tier store reads those on disk only back first */
  if ((st = kvi__store_lease(x->store, found, (size_t)nfacts, host_pages == KVI_HOST_PAGES_PROMOTE, stream, fn))) {
    kvi__plan_free(x, &p);
    goto out;
  }
  first = 0;
  for (int32_t r = 0; r < num_requests; r++) {
    const job *j = &jobs[r];
    const int32_t ri = kvi__plan_request(&p, x, j);
    int64_t done = 0; /* facts land back to back */
    for (int32_t f = 0; f < rq[r].num_facts; f++) {
      const fact *ft = found[first++];
      const void *pos = j->positions ? (const char *)j->positions + done * (j->pos64 ? 8 : 4) : NULL;
      kvi__plan_run(&p, x, ri, j->first_slot + done, ft->tokens, pos, j->pos64, (int32_t)(j->start_position + done),
                    ft->pages);
      done += ft->tokens;
    }
  }
  st = dv ? kvi__run_deviation(x, &p, dv, stream, fn) : kvi__execute(x, &p, lb, le, true, stream, fn);
  kvi__plan_free(x, &p);
  kvi__store_unlease(x->store, found, (size_t)nfacts, st == KVI_OK); /* used: the first named the most recent */
  if (st == KVI_OK && out_tokens)
    for (int32_t r = 0; r < num_requests; r++) out_tokens[r] = (int32_t)jobs[r].tokens;
out:
  free(found);
  free(npages);
  free(jobs);
  return st;
}

/* kvi_inject_options read and checked into [*lb, *le) and *hp. */
kvi_status kvi__read_inject_options(const xfer *x, const kvi_inject_options *opts, int32_t *lb, int32_t *le,
                                    kvi_host_pages *hp, const char *fn) {
  kvi_inject_options o = KVI_INJECT_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__INJECT_OPTIONS_V1, fn, "opts"))) return st;
  const int32_t L = x->cache.L;
  *lb = o.layer_begin;
  *le = o.layer_end ? o.layer_end : L;
  *hp = o.host_pages;
  if (*lb < 0 || *le > L || *lb >= *le)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer range [%d, %d) is not within [0, %d)", (int)*lb, (int)*le,
                     (int)L);
  if (o.host_pages != KVI_HOST_PAGES_PROMOTE && o.host_pages != KVI_HOST_PAGES_READ_MAPPED)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->host_pages is %d, expected KVI_HOST_PAGES_PROMOTE (0) or KVI_HOST_PAGES_READ_MAPPED (1)",
                     (int)o.host_pages);
  return kvi__check_rope_set(x, fn);
}

kvi_status kvi__batch_expect(const xfer *x, ireq *rq, int32_t n, const int32_t *ids, const int64_t *off,
                             const char *fn) {
  if (!ids) return KVI_OK;
  if (!off) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->expect_token_offsets is NULL");
  kvi_status st;
  if (x->cuda && ((st = kvi__check_memory(ids, KVI_MEMORY_HOST, true, x->store->device, fn, "batch->expect_token_ids")) ||
                  (st = kvi__check_memory(off, KVI_MEMORY_HOST, true, x->store->device, fn,
                                          "batch->expect_token_offsets"))))
    return st;
  if (off[0] < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->expect_token_offsets[0] is %lld", (long long)off[0]);
  for (int32_t r = 0; r < n; r++) {
    if (off[r + 1] < off[r])
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->expect_token_offsets[%d] is %lld, below [%d] = %lld",
                       (int)r + 1, (long long)off[r + 1], (int)r, (long long)off[r]);
    rq[r].expect_ids = ids + off[r];
    rq[r].expect_sized = true;
    rq[r].num_expect = off[r + 1] - off[r];
  }
  return KVI_OK;
}

/* A kvi_inject_request (full-size copy) as the call's request. */
kvi_status kvi__request_of(const xfer *x, const kvi_inject_request *q, int32_t r, ireq *out, const char *fn) {
  kvi_status st = kvi__check_table_kind(x, q->block_table_memory, r, fn);
  if (st) return st;
  memset(out, 0, sizeof *out);
  out->tenant = q->tenant;
  out->fact_ids = q->fact_ids;
  out->num_facts = q->num_facts;
  out->num_positions = q->num_positions;
  out->expect_ids = q->expect_token_ids;
  if (q->num_expect_token_ids < 0 || (q->num_expect_token_ids > 0 && !q->expect_token_ids))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: num_expect_token_ids is %lld with expect_token_ids %s",
                     (int)r, (long long)q->num_expect_token_ids, q->expect_token_ids ? "given" : "NULL");
  out->expect_sized = q->num_expect_token_ids > 0; /* else trusted to hold one id per token */
  out->num_expect = q->num_expect_token_ids;
  out->j.table = q->block_table;
  out->j.table_len = q->block_table_len;
  out->j.table_on_host = q->block_table_memory == KVI_MEMORY_HOST;
  out->j.first_slot = q->first_slot;
  out->j.positions = q->positions;
  out->j.start_position = q->start_position;
  return KVI_OK;
}

/* A call's requests (each read by its struct_size, which all must share)
 * as the call's requests, into *out (malloc'd; num_requests > 0). */
static kvi_status read_requests(const xfer *x, const kvi_inject_request *reqs, int32_t num_requests, ireq **out,
                                const char *fn) {
  kvi__struct_array a;
  kvi_status st = kvi__struct_array_open(&a, reqs, num_requests, KVI__INJECT_REQUEST_V1, fn, "reqs");
  if (st) return st;
  ireq *rq = malloc((size_t)num_requests * sizeof *rq);
  if (!rq) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)num_requests);
  for (int32_t r = 0; r < num_requests && st == KVI_OK; r++) {
    kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
    if ((st = kvi__struct_array_read(&a, r, &q, sizeof q, KVI__INJECT_REQUEST_V1, fn)) == KVI_OK)
      st = kvi__request_of(x, &q, r, &rq[r], fn);
  }
  if (st) {
    free(rq);
    return st;
  }
  *out = rq;
  return KVI_OK;
}

kvi_status kvi__inject(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                       const kvi_inject_options *opts, struct CUstream_st *stream, const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (num_requests < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_requests is %d", (int)num_requests);
  if (num_requests > 0 && !reqs) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "reqs is NULL");
  xfer *x = &injector->x;
  int32_t lb, le;
  kvi_host_pages hp;
  kvi_status st = kvi__read_inject_options(x, opts, &lb, &le, &hp, fn);
  if (st || num_requests == 0) return st;
  ireq *rq;
  if ((st = read_requests(x, reqs, num_requests, &rq, fn))) return st;
  kvi__lock_both(x);
  st = kvi__inject_locked(x, rq, num_requests, NULL, lb, le, hp, NULL, NULL, stream, fn);
  kvi__unlock_both(x);
  free(rq);
  return st;
}

kvi_status kvi__inject_deviation(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                                 int32_t layer, float *out_scores, int64_t num_scores, kvi_memory out_memory,
                                 struct CUstream_st *stream, const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (num_requests < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_requests is %d", (int)num_requests);
  if (num_requests > 0 && !reqs) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "reqs is NULL");
  xfer *x = &injector->x;
  if (layer < 0 || layer >= x->cache.L)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, the model has layers 0..%d", (int)layer,
                     (int)x->cache.L - 1);
  if (num_scores < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_scores is %lld", (long long)num_scores);
  if (out_memory != KVI_MEMORY_HOST && out_memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_memory is %d, expected KVI_MEMORY_HOST or KVI_MEMORY_DEVICE",
                     (int)out_memory);
  if (out_memory == KVI_MEMORY_DEVICE && !x->cuda)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "a CPU store writes host out_scores only");
  kvi_status st;
  if ((st = kvi__check_rope_set(x, fn))) return st;
  if (num_requests == 0) return KVI_OK;
  if (out_scores && x->cuda && (st = kvi__check_memory(out_scores, out_memory, true, x->store->device, fn, "out_scores")))
    return st;
  ireq *rq;
  if ((st = read_requests(x, reqs, num_requests, &rq, fn))) return st;
  /* NULL out_scores is refused once the call is known to have tokens (num_scores then falls short) */
  deviation dv = {layer, out_scores, out_scores ? num_scores : 0, out_memory == KVI_MEMORY_DEVICE};
  kvi__lock_both(x);
  st = kvi__inject_locked(x, rq, num_requests, NULL, 0, x->cache.L, KVI_HOST_PAGES_PROMOTE, &dv, NULL, stream, fn);
  kvi__unlock_both(x);
  free(rq);
  return st;
}

/* kvi_inject_plan's sum, the store's lock held; *out_tokens written on success. */
kvi_status kvi__inject_plan_tokens(const kvi_store *s, uint64_t tenant, const uint64_t *fact_ids, int32_t num_facts,
                                   int64_t *out_tokens, const char *fn) {
  int64_t total = 0;
  for (int32_t f0 = 0; f0 < num_facts; f0 += 64) { /* looked up 64 at a time */
    fact *found[64];
    const int32_t n = num_facts - f0 < 64 ? num_facts - f0 : 64;
    kvi__store_find_many(s, &tenant, 0, fact_ids + f0, (size_t)n, found);
    for (int32_t f = 0; f < n; f++) {
      if (!found[f])
        return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no fact %llu for tenant %llu", (unsigned long long)fact_ids[f0 + f],
                         (unsigned long long)tenant);
      total += found[f]->tokens;
    }
  }
  *out_tokens = total;
  return KVI_OK;
}

kvi_status kvi__inject_plan(const kvi_injector *injector, uint64_t tenant, const uint64_t *fact_ids, int32_t num_facts,
                            int64_t *out_tokens, const char *fn) {
  if (!injector || !out_tokens || (num_facts > 0 && !fact_ids) || num_facts < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s", !injector ? "injector is NULL" : !out_tokens ? "out_tokens is NULL"
                                                         : num_facts < 0 ? "num_facts is negative" : "fact_ids is NULL");
  const kvi_store *s = injector->x.store;
  kvi__store_lock(s);
  const kvi_status st = kvi__inject_plan_tokens(s, tenant, fact_ids, num_facts, out_tokens, fn);
  kvi__store_unlock(s);
  return st;
}

kvi_status kvi__injector_async_errors(kvi_injector *injector, int64_t *out_count, const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  xfer *x = &injector->x;
  pthread_mutex_lock(&x->lock);
  const int64_t skipped = kvi__async_count_take(&x->skipped);
  pthread_mutex_unlock(&x->lock);
  if (out_count) *out_count = skipped;
  return KVI_OK; /* an injector latches no failure */
}
