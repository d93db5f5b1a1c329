/*
 * Jobs and plans: a request or capture normalized as a job and checked
 * against the cache layout, the transfer limits checked, and the call's work
 * laid out as the kernels read it (segments, requests, positions, host
 * block-table slices) in a buffer on the host, in the kernel parameters or in
 * a staging slot; and the view tests/internal has of plans (xfer/xfer.h).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/transfer.h"

/* Position t of a job's explicit positions. */
static inline int64_t job_pos(const job *j, int64_t t) {
  return j->pos64 ? ((const int64_t *)j->positions)[t] : ((const int32_t *)j->positions)[t];
}

/* Segments a fact of `npages` pages can need, at most. */
int64_t kvi__segs_for(const xfer *x, int64_t npages) {
  return npages * ((x->store->P + x->seg_tokens - 1) / x->seg_tokens);
}

/* "first..last" for `tokens` >= 1 positions from `start`, whatever start
 * is: an int64 start (kvi_inject_batched's) near INT64_MAX has its last
 * position past INT64_MAX, so that one is computed in uint64 (start >= 0:
 * at most 2^64 - 3, exact); from a negative start, int64 cannot overflow. */
static void position_range(char *out, size_t n, int64_t start, int64_t tokens) {
  if (start >= 0)
    snprintf(out, n, "%lld..%llu", (long long)start, (unsigned long long)start + (unsigned long long)(tokens - 1));
  else
    snprintf(out, n, "%lld..%lld", (long long)start, (long long)(start + (tokens - 1)));
}

/* Checks a job's sequence range and block ids. */
kvi_status kvi__check_job_slots(const xfer *x, const job *j, int32_t index, const char *what, const char *fn) {
  const kvi__cache *c = &x->cache;
  if (j->tokens == 0) return KVI_OK;
  if (j->first_slot < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: first_slot is %lld", what, (int)index, (long long)j->first_slot);
  if (!j->table) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: block_table is NULL", what, (int)index);
  if (j->table_len < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: block_table_len is %d", what, (int)index, (int)j->table_len);
  if (j->tokens > INT64_MAX - j->first_slot) /* first_slot + tokens would wrap */
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: first_slot %lld + %lld tokens passes the largest sequence index",
                     what, (int)index, (long long)j->first_slot, (long long)j->tokens);
  const int64_t last = j->first_slot + j->tokens - 1;
  if (last / c->BS >= j->table_len)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "%s %d: sequence slots %lld..%lld need %lld blocks of %d, the block table has %d", what, (int)index,
                     (long long)j->first_slot, (long long)last, (long long)(last / c->BS + 1), (int)c->BS,
                     (int)j->table_len);
  if (j->table_on_host)
    for (int64_t b = j->first_slot / c->BS; b <= last / c->BS; b++)
      if (j->table[b] < 0 || j->table[b] >= c->NB)
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: block_table[%lld] is %d, the cache has blocks 0..%lld",
                         what, (int)index, (long long)b, (int)j->table[b], (long long)c->NB - 1);
  return KVI_OK;
}

/* Checks a job's positions (explicit ones are read here). */
kvi_status kvi__check_job_positions(const xfer *x, const job *j, int32_t index, const char *what, const char *fn) {
  if (j->tokens == 0) return KVI_OK;
  if (j->positions) {
    for (int64_t t = 0; t < j->tokens; t++)
      if (job_pos(j, t) < 0 || job_pos(j, t) >= x->max_pos)
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: positions[%lld] is %lld, expected 0..%d", what, (int)index,
                         (long long)t, (long long)job_pos(j, t), (int)x->max_pos - 1);
  } else if (j->start_position < 0 || j->start_position > x->max_pos - j->tokens) {
    char range[64];
    position_range(range, sizeof range, j->start_position, j->tokens);
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: positions %s are outside 0..%d", what, (int)index, range,
                     (int)x->max_pos - 1);
  }
  return KVI_OK;
}

kvi_status kvi__check_job(const xfer *x, const job *j, int32_t index, const char *what, const char *fn) {
  const kvi_status st = kvi__check_job_slots(x, j, index, what, fn);
  return st ? st : kvi__check_job_positions(x, j, index, what, fn);
}

/* A request's block-table memory kind: host or device, device only on a
 * CUDA store. */
kvi_status kvi__check_table_kind(const xfer *x, kvi_memory memory, int32_t r, const char *fn) {
  if (memory != KVI_MEMORY_HOST && memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: block_table_memory is %d", (int)r, (int)memory);
  if (memory == KVI_MEMORY_DEVICE && !x->cuda)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "request %d: a CPU store reads host block tables only", (int)r);
  return KVI_OK;
}

/* A request's job: a host table is read here, so it must not be device
 * memory (the driver tells, in about a microsecond), nor a device table host
 * memory; then kvi__check_job. */
kvi_status kvi__check_request_job(const xfer *x, const job *j, int32_t r, const char *fn) {
  kvi_status st = KVI_OK;
  if (j->tokens > 0 && j->table && x->cuda && !j->kind_checked)
    st = kvi__check_memory(j->table, j->table_on_host ? KVI_MEMORY_HOST : KVI_MEMORY_DEVICE, true, x->store->device, fn,
                           j->table_on_host ? "a host block table" : "a device block table");
  return st ? st : kvi__check_job(x, j, r, "request", fn);
}

/* Host block-table entries a job copies into its plan (kvi__plan_request). */
int64_t kvi__host_table_entries(const xfer *x, const job *j) {
  if (j->tokens == 0 || !j->table_on_host) return 0;
  return (j->first_slot + j->tokens - 1) / x->cache.BS - j->first_slot / x->cache.BS + 1;
}

/* KVI_ERR_CAPACITY when a call is larger than the transfer options allow
 * (counted for the whole call, however it is launched). */
kvi_status kvi__check_limits(const xfer *x, int32_t nreqs, int64_t ntok, int64_t ntables, const char *fn) {
  if (ntok > x->lim.max_tokens_per_call || nreqs > x->lim.max_requests_per_call ||
      ntables > x->lim.max_table_entries_per_call)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "the call moves %lld tokens for %d requests with %lld host block-table entries; the transfer "
                     "options allow %d, %d and %d",
                     (long long)ntok, (int)nreqs, (long long)ntables, (int)x->lim.max_tokens_per_call,
                     (int)x->lim.max_requests_per_call, (int)x->lim.max_table_entries_per_call);
  return KVI_OK;
}

/* Sets a plan's offsets and size (bytes) for the given counts; no buffer yet. */
void kvi__plan_layout(plan *p, int64_t nsegs, int32_t nreqs, int64_t ntok, int64_t npos, int64_t ntables) {
  memset(p, 0, sizeof *p);
  if (nsegs > ntok) nsegs = ntok; /* every segment has a token */
  p->o_reqs = kvi__align_up((size_t)nsegs * sizeof(kvi__xseg));
  p->o_pos = p->o_reqs + kvi__align_up((size_t)nreqs * sizeof(kvi__xreq));
  p->o_tab = p->o_pos + kvi__align_up((size_t)npos * sizeof(int32_t));
  p->bytes = p->o_tab + (size_t)ntables * sizeof(int32_t);
}

/* Points a laid-out plan's arrays into buf. */
void kvi__plan_place(plan *p, char *buf) {
  p->buf = buf;
  p->segs = (kvi__xseg *)p->buf;
  p->reqs = (kvi__xreq *)(p->buf + p->o_reqs);
  p->positions = (int32_t *)(p->buf + p->o_pos);
  p->tables = (int32_t *)(p->buf + p->o_tab);
}

/* Finds a laid-out plan of `bytes` bytes a buffer: on the host for the CPU,
 * in the kernel parameters when small (`inline_ok`), else in a staging slot. */
kvi_status kvi__plan_buffer(plan *p, xfer *x, size_t bytes, bool inline_ok, const char *fn) {
  if (!x->cuda) {
    char *buf = malloc(bytes ? bytes : 1);
    if (!buf) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %zu-byte plan", bytes);
    kvi__plan_place(p, buf);
  } else if (inline_ok && bytes <= KVI__INLINE_PLAN) {
    kvi__plan_place(p, (char *)x->small);
  } else {
    kvi_status st = kvi__ring_acquire(&x->ring, bytes, NULL, &p->sl, fn); /* x->lock: one call at a time */
    if (st) return st;
    kvi__plan_place(p, p->sl->host);
  }
  return KVI_OK;
}

/* Sizes the plan, with `ext` bytes of the caller's own at o_ext, and finds
 * it a buffer (kvi__plan_buffer). */
kvi_status kvi__plan_alloc(plan *p, xfer *x, int64_t nsegs, int32_t nreqs, int64_t ntok, int64_t npos,
                           int64_t ntables, size_t ext, const char *fn) {
  kvi_status st = kvi__check_limits(x, nreqs, ntok, ntables, fn);
  if (st) {
    memset(p, 0, sizeof *p);
    return st;
  }
  kvi__plan_layout(p, nsegs, nreqs, ntok, npos, ntables);
  if (ext) { /* the caller's area, after the tables: the plan cannot travel inline */
    p->o_ext = kvi__align_up(p->bytes);
    p->bytes = p->o_ext + ext;
    if (x->cuda && p->bytes > x->slot_bytes) /* the limits size the slots; an area on top may not fit */
      return kvi__fail(KVI_ERR_CAPACITY, fn, "the call's plan needs %zu bytes; the transfer options' limits allow %zu",
                       p->bytes, x->slot_bytes);
  }
  return kvi__plan_buffer(p, x, p->bytes, !ext, fn);
}

void kvi__plan_free(const xfer *x, plan *p) {
  if (!x->cuda) free(p->buf);
}

/* Adds a job's request entry: host block tables are copied into the plan
 * (the slice the job touches, found by its offset wherever the plan lives),
 * device tables referenced. Returns the request index. */
int32_t kvi__plan_request(plan *p, const xfer *x, const job *j) {
  const int32_t BS = x->cache.BS;
  const int32_t r = p->nreqs++;
  kvi__xreq *rq = &p->reqs[r];
  if (j->tokens > 0 && j->table_on_host) {
    const int64_t b0 = j->first_slot / BS, b1 = (j->first_slot + j->tokens - 1) / BS;
    memcpy(&p->tables[p->ntables], j->table + b0, (size_t)(b1 - b0 + 1) * sizeof(int32_t));
    rq->table = NULL;
    rq->table_off = (int64_t)(p->o_tab + (size_t)p->ntables * sizeof(int32_t));
    rq->first_block = (int32_t)b0;
    rq->table_len = (int32_t)(b1 - b0 + 1);
    p->ntables += (int32_t)(b1 - b0 + 1);
  } else {
    rq->table = j->table;
    rq->table_off = 0;
    rq->first_block = 0;
    rq->table_len = j->table_len;
  }
  return r;
}

/* Adds `tokens` tokens held in `pages` (from the first page's start) landing
 * at sequence indices seq0.. of request r, with their positions, in
 * segments that neither cross a page nor exceed seg_tokens. */
void kvi__plan_run(plan *p, const xfer *x, int32_t r, int64_t seq0, int64_t tokens, const void *positions, bool pos64,
                   int32_t start_position, const uint32_t *pages) {
  const int32_t P = x->store->P, pos0 = positions ? p->ntok : start_position;
  if (positions && pos64) /* checked below max_pos: they fit */
    for (int64_t t = 0; t < tokens; t++) p->positions[p->ntok++] = (int32_t)((const int64_t *)positions)[t];
  else if (positions) /* consecutive positions need no array */
    for (int64_t t = 0; t < tokens; t++) p->positions[p->ntok++] = ((const int32_t *)positions)[t];
  for (int64_t t = 0; t < tokens;) {
    const int32_t in_page = (int32_t)(t % P);
    int64_t n = tokens - t;
    if (n > P - in_page) n = P - in_page;
    if (n > x->seg_tokens) n = x->seg_tokens;
    kvi__xseg *sg = &p->segs[p->nsegs++];
    sg->seq0 = seq0 + t;
    sg->page = pages[t / P];
    sg->req = r;
    sg->pos0 = pos0 + (int32_t)t;
    sg->explicit_pos = positions != NULL;
    sg->tok0 = (uint16_t)in_page;
    sg->ntok = (uint16_t)n;
    t += n;
  }
}

/* tests/internal's view of plans (xfer/xfer.h): a plan over the
 * view's arrays, and back. */
static plan plan_of_view(const kvi__plan_view *v) {
  plan p;
  memset(&p, 0, sizeof p);
  p.segs = v->segs;
  p.reqs = v->reqs;
  p.positions = v->positions;
  p.tables = v->tables;
  p.buf = (char *)v->buf;
  p.o_tab = v->tables && v->buf ? (size_t)((const char *)v->tables - v->buf) : 0;
  p.nsegs = v->nsegs, p.nreqs = v->nreqs, p.ntok = v->ntok, p.ntables = v->ntables;
  return p;
}

void kvi__view_of_plan(kvi__plan_view *v, const plan *p) {
  v->segs = p->segs;
  v->reqs = p->reqs;
  v->positions = p->positions;
  v->tables = p->tables;
  v->buf = p->buf;
  v->ext = p->buf && p->o_ext ? p->buf + p->o_ext : NULL;
  v->nsegs = p->nsegs, v->nreqs = p->nreqs, v->ntok = p->ntok, v->ntables = p->ntables;
}

int32_t kvi__plan_request_into(const kvi_injector *injector, kvi__plan_view *v, const int32_t *table,
                               int32_t table_len, bool table_on_host, int64_t first_slot, int64_t tokens) {
  plan p = plan_of_view(v);
  job j;
  memset(&j, 0, sizeof j);
  j.table = table;
  j.table_len = table_len;
  j.table_on_host = table_on_host;
  j.first_slot = first_slot;
  j.tokens = tokens;
  const int32_t r = kvi__plan_request(&p, &injector->x, &j);
  kvi__view_of_plan(v, &p);
  return r;
}

void kvi__plan_run_into(const kvi_injector *injector, kvi__plan_view *v, int32_t r, int64_t seq0, int64_t tokens,
                        const void *positions, bool pos64, int32_t start_position, const uint32_t *pages) {
  plan p = plan_of_view(v);
  kvi__plan_run(&p, &injector->x, r, seq0, tokens, positions, pos64, start_position, pages);
  kvi__view_of_plan(v, &p);
}

int64_t kvi__plan_segs_for(const kvi_injector *injector, int64_t npages) { return kvi__segs_for(&injector->x, npages); }

void kvi__plan_view_free(kvi_injector *injector, kvi__plan_view *v) {
  plan p = plan_of_view(v);
  kvi__plan_free(&injector->x, &p);
  memset(v, 0, sizeof *v);
}
