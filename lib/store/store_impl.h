/*
 * libkvinject — the store part's private header: what the files of
 * lib/store/ share among themselves. The parts above include store/store.h
 * only; nothing here is for them. The files:
 *   store.c       creation and destruction
 *   copy.c        copies between views and pages (CPU reference, CUDA)
 *   embeddings.c  the embedding state (struct kvi__store_emb) and the
 *                 tenants' matrices; it alone changes s->emb
 *   pools.c       the page pools and their deferred frees
 *   tiers.c       the LRU list, tier moves, prefetch, leases, the disk
 *                 tier's drops and reads back
 *   fetch.c       the disk tier's reads back: at once, or by the I/O thread
 *   txn.c         the write transaction
 *   put.c         facts in and out of the index, put and remove
 *   read.c        reads and queries
 * Callers hold the store's lock.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_STORE_IMPL_H
#define KVI_STORE_IMPL_H

#include <stdlib.h>

#include "store/store.h"

static inline void kvi__fact_free(fact *f) {
  free(f->pages);
  free(f->hpages);
  free(f->token_ids);
  free(f->context);
  free(f);
}

static inline kvi_status kvi__store_not_found(const char *fn, uint64_t tenant_id, uint64_t fact_id) {
  return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no fact %llu for tenant %llu", (unsigned long long)fact_id,
                   (unsigned long long)tenant_id);
}

/* Checks that the view's pointers are memory of its kind; k_name, v_name:
 * their names in messages ("kv->k", "kv->v"). */
static inline kvi_status kvi__store_view_memory(const kvi_store *s, const kvi_kv_view *v, const char *fn,
                                                const char *k_name, const char *v_name) {
  const bool cuda = s->backend == KVI_BACKEND_CUDA;
  kvi_status st = kvi__check_memory(v->k, v->memory, cuda, s->device, fn, k_name);
  return st ? st : kvi__check_memory(v->v, v->memory, cuda, s->device, fn, v_name);
}

/* ---- copies (copy.c) ----------------------------------------------------- */

/* Copies a fact's first `tokens` tokens between the view v and its pages
 * (to_pages: into them): the CPU copies for a CPU store and for host-tier
 * pages with a host view; kernels on `stream` for a device view (untracked);
 * pinned staging on the copy stream for a host view of device pages,
 * complete when this returns. raw: a quantized store's stored elements as
 * they are, with the pages' scales (s->scale_bytes a page) in raw (host
 * views only), or NULL. */
kvi_status kvi__copy_fact(const kvi_store *s, const kvi_kv_view *v, const uint32_t *pages, int32_t tokens,
                          bool to_pages, unsigned char *raw, struct CUstream_st *stream, const char *fn);

/* ---- embeddings (embeddings.c) -------------------------------------------- */

/* The state's fields the options decide (s->backend and s->emb_dim set);
 * host_tier: the store has a host tier. */
void kvi__emb_setup(kvi_store *s, const kvi_store_options *o, bool host_tier);
/* A CUDA store with embeddings: its embedding stream, staging ring and event. */
kvi_status kvi__emb_init(kvi_store *s, const char *fn);
/* Releases what kvi__emb_init made; device_ok: the device is current (else
 * it is left). */
void kvi__emb_release(kvi_store *s, bool device_ok);

/* Frees a tenant's matrix, ids, directory and rows; device_ok: the device
 * is current (else a CUDA store's matrices are left). */
void kvi__emb_free(kvi_store *s, tenant *t, bool device_ok);

/* Makes room for `n` more embedding rows in tenant_id's matrix (and, on a
 * CUDA store, their staging; with emb.dir_on, directory rows for facts of
 * up to `tokens` tokens), creating the tenant without facts if it is new.
 * No-op for a store without embeddings. A transaction that then fails calls
 * kvi__emb_unreserve_rows for each of those tenants, so that no empty tenant
 * stays behind. The room that was made stays (as a hash map's). */
kvi_status kvi__emb_reserve_rows(kvi_store *s, uint64_t tenant_id, size_t n, int32_t tokens, const char *fn);
void kvi__emb_unreserve_rows(kvi_store *s, uint64_t tenant_id);

/* Writes f's embedding e (fp32, already what the store keeps) as row
 * `reuse` (the row of the fact f replaces) or, for SIZE_MAX, as a new row
 * t->nrows: a reserved row (and its staging). */
void kvi__emb_append(kvi_store *s, tenant *t, fact *f, const float *e, size_t reuse);
/* Gives back a reserved row (and its staging) that a fact of `tokens`
 * tokens does not take: another rank keeps its embedding. */
void kvi__emb_skip_row(kvi_store *s, tenant *t, int32_t tokens);
/* Moves the last row into f's place. */
void kvi__emb_remove(kvi_store *s, tenant *t, fact *f);

/* Enqueues the rows staged since the last flush (one launch reads them in
 * place), then the slot's event and emb.ready. Every other change to a
 * device matrix flushes first, so that emb.stream keeps the order of the
 * changes. */
void kvi__emb_flush(kvi_store *s);

/* ---- page pools and deferred frees (pools.c) ------------------------------ */

/* The free stacks, full (each pops its lowest page id first). */
kvi_status kvi__pool_make_stacks(kvi_store *s, const char *fn);

/* Pages of pool p that wait for in-flight work. */
uint32_t kvi__pool_deferred(const kvi_store *s, const pool *p);

/* Advances track.done past completed events and frees the deferred pages
 * that were only waiting for them. `wait`: block for every outstanding
 * event. */
kvi_status kvi__pool_reap(kvi_store *s, bool wait, const char *fn);

/* Gives pages back to their pools, after the device work tracked so far
 * (kvi__store_track). */
void kvi__pool_release(kvi_store *s, const uint32_t *pages, uint32_t n);

/* Takes n pages off the top of p's free stack (p->nfree >= n), in pop order. */
void kvi__pool_take(pool *p, uint32_t *out, uint32_t n);

/* Undoes kvi__pool_take exactly: the stack is as it was before. */
void kvi__pool_untake(pool *p, const uint32_t *pages, uint32_t n);

/* Frees what completed work allows in pool p, and waits for in-flight work
 * when the pages it holds would give p `need` free pages. */
kvi_status kvi__pool_room(kvi_store *s, pool *p, uint64_t need, const char *fn);

/* Makes `need` pages of the first pool free, or fails with KVI_ERR_CAPACITY. */
kvi_status kvi__pool_device_room(kvi_store *s, uint32_t need, const char *fn);

/* ---- tiers (tiers.c) ------------------------------------------------------ */

/* Takes f off the LRU list (no-op when it is not on it). */
void kvi__tier_lru_remove(kvi_store *s, fact *f);

/* Whether the last tier move may still be running (its number is still in
 * the tracker: kvi__events_record retires the oldest before reusing one). */
bool kvi__tier_move_outstanding(const kvi_store *s);

/* Makes `stream` wait for the last tier move if it may not have completed
 * (no-op otherwise, and on stores without a host tier). */
kvi_status kvi__tier_order_moves(kvi_store *s, struct CUstream_st *stream, const char *fn);

/* Moves the `nup` host-tier facts up[] to the device and takes `extra` more
 * device pages for the caller (written into extra_pages, off the free stack:
 * the caller commits them to facts or gives them back with
 * kvi__pool_release), demoting least-recently-used device facts that are not
 * pinned when the device pool is short. Copies run on the copy stream after
 * every tracked device operation; `stream` then waits for them.
 * KVI_ERR_CAPACITY, with nothing changed, when the device cannot hold them
 * besides the pinned facts or the host has no room for the demoted ones.
 * Device is current. */
kvi_status kvi__tier_move(kvi_store *s, fact *const *up, size_t nup, uint32_t extra, uint32_t *extra_pages,
                          struct CUstream_st *stream, const char *fn);

/* Where a put of `need` pages goes: the device tier when it has room, else
 * the host tier; waiting for in-flight work only when nothing is free now. */
kvi_status kvi__tier_put_room(kvi_store *s, uint32_t need, pool **into, const char *fn);

/* Makes `need` pages of pool p free, dropping least-recently-used unpinned
 * facts that have a copy on disk (disk tier) when it must; KVI_ERR_CAPACITY,
 * nothing dropped, when that cannot make enough. */
kvi_status kvi__disk_room(kvi_store *s, pool *p, uint64_t need, const char *fn);

/* ---- the index (put.c) ---------------------------------------------------- */

/* Inserts a fact whose `need` pages (off their free stack) hold its data,
 * replacing any fact with the same key. Takes ownership of f, pages and
 * fresh (a spare tenant record, or NULL when the tenant is in the store);
 * copies *emb into the tenant's matrix and frees it. Cannot fail: the
 * transaction has reserved everything. */
void kvi__fact_commit(kvi_store *s, fact *f, uint32_t *pages, uint32_t need, tenant *fresh, float **emb,
                      uint64_t tenant_id, uint64_t fact_id, int32_t tokens);

#endif /* KVI_STORE_IMPL_H */
