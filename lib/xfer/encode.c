/*
 * kvi_encode: the captures read and checked, then one write transaction of
 * the store whose pages the capture kernel fills (in chunks of
 * KVI__CAPTURE_CHUNK captures), committed once that work is enqueued.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "xfer/transfer.h"

/* A capture, as read and checked (its embedding owned until the
 * transaction takes it). */
typedef struct cap_state {
  kvi_capture c;
  float *emb;
  uint32_t need;
  uint32_t first; /* its pages are pg[first, first + need) of the call */
} cap_state;

static void free_caps(cap_state *cs, int32_t n) {
  for (int32_t i = 0; i < n; i++) free(cs[i].emb);
  free(cs);
}

/* A capture's job (the transfer's view of it); pos64: its positions are
 * int64 (kvi__encode_captures). */
static void capture_job(const kvi_capture *c, bool pos64, job *j) {
  memset(j, 0, sizeof *j);
  j->table = c->block_table;
  j->table_len = c->block_table_len;
  j->table_on_host = true;
  j->first_slot = c->first_slot;
  j->tokens = c->num_tokens;
  j->positions = c->positions;
  j->pos64 = pos64 && c->positions;
  j->start_position = c->start_position;
}

/* The plan sizes of a run of captures (kvi_encode's chunks). */
typedef struct chunk_size {
  int64_t nsegs;
  int64_t ntok, npos, ntables;
} chunk_size;

/* The captures of a call, read and checked (everything checkable without
 * the store's lock); cs[0, nread) need freeing. */
typedef struct cap_read {
  bool pos64; /* the captures' positions are int64 */
  cap_state *cs;
  int32_t nread, nchunks;
  chunk_size *csz; /* per chunk of KVI__CAPTURE_CHUNK captures */
  int64_t ntok, ntables;
  uint32_t need_total;
} cap_read;

/* Whether (tenant, id) a sorts before b. */
static bool key_less(const kvi_capture *a, const kvi_capture *b) {
  return a->tenant != b->tenant ? a->tenant < b->tenant : a->fact_id < b->fact_id;
}

/* The second pass over captures read and checked by the first (everything
 * but their positions): the positions (a capture claims num_tokens of them,
 * read only once every capture and the limits have passed) and the
 * embeddings. */
static kvi_status read_positions(xfer *x, cap_read *r, int32_t num_captures, struct CUstream_st *stream,
                                 const char *fn) {
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < num_captures && st == KVI_OK; i++) {
    const kvi_capture *c = &r->cs[i].c;
    job j;
    capture_job(c, r->pos64, &j);
    if ((st = kvi__check_job_positions(x, &j, i, "capture", fn)) == KVI_OK)
      st = kvi__store_read_embedding(x->store, c->embedding, c->embedding_dtype, c->embedding_memory, stream,
                                     &r->cs[i].emb, fn);
  }
  return st;
}

/* Reads and checks a call's captures: every capture's flags, count, key and
 * table, then the call's limits, then (read_positions) the positions and
 * embeddings, so that a bad call fails before it reads what its captures
 * claim. pos64: as kvi__encode_captures. */
static kvi_status read_captures(xfer *x, const kvi_capture *caps, int32_t num_captures, bool pos64,
                                struct CUstream_st *stream, cap_read *r, const char *fn) {
  const kvi_store *s = x->store;
  memset(r, 0, sizeof *r);
  r->pos64 = pos64;
  r->nchunks = (num_captures + KVI__CAPTURE_CHUNK - 1) / KVI__CAPTURE_CHUNK;
  /* cs is filled as the captures are read (zeroing it all up front costs
   * more than the rest of a capture's checks) */
  cap_state *cs = r->cs = malloc((size_t)num_captures * sizeof *cs);
  chunk_size *csz = r->csz = calloc((size_t)r->nchunks, sizeof *csz);
  kvi_status st = cs && csz ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d captures", (int)num_captures);
  /* Duplicates: keys in increasing order (the usual batch, ids counting up)
   * have none, which a comparison with the previous key shows; the first
   * key out of order moves the check to a hash set of the keys so far. */
  kvi__map seen = {0};
  bool ordered = true;
  kvi__struct_array a;
  if (st == KVI_OK) st = kvi__struct_array_open(&a, caps, num_captures, KVI__CAPTURE_V1, fn, "caps");
  int64_t ntok = 0, ntables = 0;
  uint32_t need_total = 0;
  const int32_t *checked_table = NULL;
  for (int32_t i = 0; i < num_captures && st == KVI_OK; i++) {
    const cap_state blank = {KVI_CAPTURE_INIT, NULL, 0, 0};
    cs[r->nread++] = blank;
    if ((st = kvi__struct_array_read(&a, i, &cs[i].c, sizeof cs[i].c, KVI__CAPTURE_V1, fn))) break;
    const kvi_capture *c = &cs[i].c;
    if (c->flags & ~KVI_PUT_REPLACE) {
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d: unknown flag bits 0x%x", (int)i, c->flags & ~KVI_PUT_REPLACE);
      break;
    }
    if (c->num_tokens < 1) {
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d: num_tokens is %d; a fact has at least one token", (int)i,
                     (int)c->num_tokens);
      break;
    }
    if (ordered && i > 0 && !key_less(&cs[i - 1].c, c)) {
      ordered = false;
      if ((st = kvi__map_reserve(&seen, (size_t)num_captures, fn))) break;
      for (int32_t k = 0; k < i; k++) kvi__map_put(&seen, cs[k].c.tenant, cs[k].c.fact_id, (void *)1);
    }
    if (!ordered) {
      if (kvi__map_get(&seen, c->tenant, c->fact_id)) {
        st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d repeats fact %llu of tenant %llu", (int)i,
                       (unsigned long long)c->fact_id, (unsigned long long)c->tenant);
        break;
      }
      kvi__map_put(&seen, c->tenant, c->fact_id, (void *)1);
    }
    /* the table is read here, so it must be host memory; captures of one
     * batched prefill share it, and asking the driver costs a microsecond */
    if (c->block_table != checked_table) {
      if ((st = kvi__check_memory(c->block_table, KVI_MEMORY_HOST, x->cuda, s->device, fn, "a capture's block table")))
        break;
      checked_table = c->block_table;
    }
    if (c->token_ids &&
        (st = kvi__check_memory(c->token_ids, KVI_MEMORY_HOST, x->cuda, s->device, fn, "a capture's token_ids")))
      break;
    if (c->num_context_ids < 0 || (c->num_context_ids > 0 && !c->context_ids)) {
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     c->num_context_ids < 0 ? "capture %d: num_context_ids is %d"
                                            : "capture %d: context_ids is NULL with num_context_ids %d",
                     (int)i, (int)c->num_context_ids);
      break;
    }
    if (c->num_context_ids > 0 &&
        (st = kvi__check_memory(c->context_ids, KVI_MEMORY_HOST, x->cuda, s->device, fn, "a capture's context_ids")))
      break;
    job j;
    capture_job(c, pos64, &j);
    if ((st = kvi__check_job_slots(x, &j, i, "capture", fn))) break;
    cs[i].need = pages_for(s, c->num_tokens);
    cs[i].first = need_total;
    const int64_t tables = (c->first_slot + c->num_tokens - 1) / x->cache.BS - c->first_slot / x->cache.BS + 1;
    chunk_size *z = &csz[i / KVI__CAPTURE_CHUNK];
    z->nsegs += kvi__segs_for(x, cs[i].need);
    z->ntok += c->num_tokens;
    if (c->positions) z->npos += c->num_tokens;
    z->ntables += tables;
    ntok += c->num_tokens;
    need_total += cs[i].need;
    ntables += tables;
  }
  kvi__map_free(&seen);
  r->ntok = ntok;
  r->ntables = ntables;
  r->need_total = need_total;
  /* the limits before anything is reserved: need_total <= ntok, so within
   * them it cannot have wrapped */
  if (st == KVI_OK) st = kvi__check_limits(x, num_captures, ntok, ntables, fn);
  return st == KVI_OK ? read_positions(x, r, num_captures, stream, fn) : st;
}

/* Plans and runs the captures in chunks of `per`, each its own plan inside
 * one buffer (one staging slot on a CUDA store), so that the device starts
 * on the first chunk while the host plans the rest. *launched: whether any
 * device work was enqueued (it may then still be writing pg's pages). */
static kvi_status run_captures(xfer *x, const cap_state *cs, bool pos64, int32_t n, const uint32_t *pg,
                               const chunk_size *sz, int32_t per, struct CUstream_st *stream, bool *launched,
                               const char *fn) {
  const int32_t nchunks = (n + per - 1) / per;
  plan *cp = malloc((size_t)nchunks * sizeof *cp);
  if (!cp) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d plans", (int)nchunks);
  size_t total = 0;
  for (int32_t k = 0; k < nchunks; k++) {
    const int32_t nreq = k == nchunks - 1 ? n - k * per : per;
    kvi__plan_layout(&cp[k], sz[k].nsegs, nreq, sz[k].ntok, sz[k].npos, sz[k].ntables);
    cp[k].off = total;
    total += kvi__align_up(cp[k].bytes);
  }
  plan whole; /* the buffer of them all */
  memset(&whole, 0, sizeof whole);
  kvi_status st = kvi__plan_buffer(&whole, x, total, nchunks == 1, fn);
  if (st == KVI_OK && whole.sl && total > x->slot_bytes) /* slot_size counts the padding: cannot happen */
    st = kvi__fail(KVI_ERR_INTERNAL, fn, "a %zu-byte capture plan in a %zu-byte staging slot", total, x->slot_bytes);
  for (int32_t k = 0; k < nchunks && st == KVI_OK; k++) {
    plan *p = &cp[k];
    kvi__plan_place(p, whole.buf + p->off);
    p->sl = whole.sl;
    const int32_t i1 = k == nchunks - 1 ? n : (k + 1) * per;
    for (int32_t i = k * per; i < i1; i++) {
      job j;
      capture_job(&cs[i].c, pos64, &j);
      const int32_t ri = kvi__plan_request(p, x, &j);
      kvi__plan_run(p, x, ri, j.first_slot, j.tokens, j.positions, j.pos64, (int32_t)j.start_position,
                    pg + cs[i].first);
    }
    st = kvi__execute(x, p, 0, x->cache.L, false, stream, fn);
    *launched = *launched || (st == KVI_OK && x->cuda);
  }
  kvi__plan_free(x, &whole);
  free(cp);
  return st;
}

/* The captures' transaction, both locks held: their pages on the device
 * tier (a tiered store demotes least-recently-used facts if the device is
 * short), the kernels writing them, then the commit. */
static kvi_status encode_locked(xfer *x, cap_read *r, int32_t num_captures, struct CUstream_st *stream,
                                const char *fn) {
  cap_state *cs = r->cs;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < num_captures && st == KVI_OK; i++) /* a disk tier's leases, before any lookup */
    if (i == 0 || cs[i].c.tenant != cs[i - 1].c.tenant) st = kvi__disk_claim(x->store, cs[i].c.tenant, fn);
  if (st) return st; /* the captures' embeddings are still theirs */
  kvi__txn t;
  st = kvi__txn_begin(&t, x->store, num_captures, KVI__PLACE_DEVICE, NULL, stream, fn);
  t.item = "capture";
  for (int32_t i = 0; i < num_captures && st == KVI_OK; i++) {
    st = kvi__txn_add(&t, cs[i].c.tenant, cs[i].c.fact_id, cs[i].c.num_tokens, cs[i].c.flags, cs[i].emb);
    cs[i].emb = NULL; /* the transaction's */
    if (st == KVI_OK) st = kvi__txn_token_ids(&t, cs[i].c.token_ids);
    if (st == KVI_OK) st = kvi__txn_context(&t, cs[i].c.context_ids, cs[i].c.num_context_ids, -1);
  }
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  bool launched = false;
  if (st == KVI_OK) {
    /* one chunk when the whole plan travels in the kernel parameters */
    chunk_size all = {0, r->ntok, 0, r->ntables};
    for (int32_t k = 0; k < r->nchunks; k++) all.nsegs += r->csz[k].nsegs, all.npos += r->csz[k].npos;
    plan one;
    kvi__plan_layout(&one, all.nsegs, num_captures, all.ntok, all.npos, all.ntables);
    const bool single = r->nchunks == 1 || (x->cuda && one.bytes <= KVI__INLINE_PLAN);
    st = run_captures(x, cs, r->pos64, num_captures, t.pages, single ? &all : r->csz,
                      single ? num_captures : KVI__CAPTURE_CHUNK, stream, &launched, fn);
  }
  if (launched) kvi__txn_wrote(&t);
  if (st == KVI_OK) st = kvi__txn_prepare(&t); /* the facts' records, allocated while the device works */
  return st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
}

kvi_status kvi__encode(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures, struct CUstream_st *stream,
                       const char *fn) {
  return kvi__encode_captures(encoder, caps, num_captures, false, stream, fn);
}

kvi_status kvi__encode_captures(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures, bool pos64,
                                struct CUstream_st *stream, const char *fn) {
  if (!encoder) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "encoder is NULL");
  if (num_captures < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_captures is %d", (int)num_captures);
  if (num_captures > 0 && !caps) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "caps is NULL");
  xfer *x = &encoder->x;
  kvi_status st = kvi__check_rope_set(x, fn);
  if (st || num_captures == 0) return st;
  cap_read r;
  st = read_captures(x, caps, num_captures, pos64, stream, &r, fn);
  if (st == KVI_OK) {
    kvi__lock_both(x);
    st = encode_locked(x, &r, num_captures, stream, fn);
    kvi__unlock_both(x);
  }
  free(r.csz);
  if (r.cs) free_caps(r.cs, r.nread);
  return st;
}
