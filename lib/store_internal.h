/*
 * libkvinject — the store's insides, shared by store.c and the transfer code
 * (injector and encoder). Callers hold the store's lock.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_STORE_INTERNAL_H
#define KVI_STORE_INTERNAL_H

#include <pthread.h>

#include "internal.h"

#define KVI__TRACK_EVENTS 64 /* device operations tracked for deferred frees */

typedef enum tier { TIER_HOST = 0, TIER_DEVICE = 1 } tier;

typedef struct pool {
  tier tier;
  char *base;
  uint32_t npages;
  uint32_t nfree;
  uint32_t *free; /* stack of free page ids */
} pool;

typedef struct tenant tenant;

typedef struct fact {
  uint64_t tenant_id, id;
  int32_t tokens;
  uint32_t npages;
  uint32_t *pages;
  size_t row; /* its row of the tenant's embedding matrix (stores with embeddings) */
  struct fact *prev, *next; /* the tenant's list */
  tenant *owner;
  /* Tiered stores: device-tier facts are on the store's LRU list (most
   * recently injected, put or captured first); `mark` tags the facts of the
   * call holding the lock, which must not be demoted by it. */
  struct fact *lru_prev, *lru_next;
  bool in_lru;
  uint64_t mark;
  /* A device-tier fact promoted from the host keeps its host pages as a
   * clean copy (facts never change in place): demoting it again copies
   * nothing. NULL when there is none; dropped when the host needs room. */
  uint32_t *hpages;
} fact;

/* A tenant's embeddings (stores with embedding_dim > 0): row r < nrows of the
 * [cap][emb_ld] matrix `emb` (emb_dtype, padding elements zero) is the
 * embedding of fact rows[r], and ids[r] == rows[r]->id. A CUDA store keeps
 * emb and ids in device memory, changed only on the store's emb_stream; a
 * CPU store keeps emb in host memory and no ids (rows[r]->id). Removing a
 * fact moves the last row into its place. */
struct tenant {
  uint64_t id;
  size_t count;   /* facts */
  fact *head;
  size_t nrows;   /* embedding rows: count, or fewer where embeddings are sharded
                     across tensor-parallel ranks (a fact whose embedding another
                     rank holds has row SIZE_MAX) */
  void *emb;
  uint64_t *ids;  /* device memory, CUDA stores only */
  fact **rows;    /* host memory */
  size_t cap;     /* rows allocated */
  size_t pending; /* rows reserved by the call holding the lock (kvi__store_reserve_rows) */
  int32_t max_tokens; /* the largest fact it has held (never lowered) */
  /* The directory of a store with dir_on (kernels.h, kvi__rquery): [cap] rows
   * of dir_stride words, in device memory, changed with the matrix. */
  uint32_t *dir;
  int32_t dir_stride;
};

struct kvi_store {
  pthread_mutex_t lock;
  kvi__geom geom;
  kvi__rope *rope; /* per layer, copied from the model */
  kvi_backend backend;
  int device;
  kvi_dtype dtype;
  int32_t P;
  int32_t emb_dim;
  uint64_t page_bytes;
  uint64_t page_elems; /* elements (of dtype) of K and V in a page: L * 2 * H * P * D */
  bool fp8;            /* dtype is KVI_DTYPE_FP8_E4M3: scales follow the elements (kernels.h) */
  uint64_t scale_off;  /* fp8: byte offset of a page's scales (page_elems rounded up to 16) */
  uint64_t pages_stored; /* pages of stored facts (kvi_store_stats.bytes_payload) */
  pool pool;  /* page ids [0, pool.npages): device memory (CUDA) or host memory (CPU) */
  /* The pinned-host tier of a CUDA store (hpool.npages 0 without one): page
   * ids [pool.npages, pool.npages + hpool.npages), mapped, hpool_dev the
   * device address of hpool.base. A fact's pages are all on one tier. */
  pool hpool;
  char *hpool_dev;
  fact *lru_head, *lru_tail; /* device-tier facts of a tiered store, most recently used first */
  uint64_t mark_clock;
  uint64_t promotions, demotions;
  /* The last tier move: tracked event number move_seq (valid while
   * move_pending) recorded on copy_stream after its copies. Calls that read
   * pages make their stream (or the host) wait for it. */
  uint64_t move_seq;
  bool move_pending;
  struct CUevent_st *prefetch_ev; /* orders a prefetch after its caller's stream */
  /* CUDA stores: pinned staging (a ring of one slot of staging_pages pages)
   * and a private stream for host copies */
  kvi__ring staging;
  uint32_t staging_pages;
  struct CUstream_st *copy_stream;
  /* Embeddings (see struct tenant). emb_ld is emb_dim rounded up to 16 bytes
   * on a CUDA store. On a CUDA store every change to a device matrix is
   * enqueued on emb_stream, which first waits for every search enqueued
   * before it (search.c), and emb_ready is recorded after it; a search waits
   * for emb_ready. Rows put from the host go through emb_stage, a staging
   * ring of one slot of stage_cap rows (stage_used in flight, stage_reserved
   * promised to the call holding the lock; the slot's event follows the last
   * row's copy). A failure to enqueue such a change (a dead
   * context, in practice) is latched in emb_err and fails every later
   * search. */
  kvi_dtype emb_dtype;
  kvi_metric metric;
  bool emb_as_kept; /* kvi_store_load: incoming embeddings are already scaled and rounded */
  bool dir_on;      /* tenants keep a device directory: a CUDA store with embeddings and no host tier */
  int32_t emb_ld;
  uint64_t emb_bytes; /* capacity of every matrix and id array */
  struct CUstream_st *emb_stream;
  struct CUevent_st *emb_ready;
  bool emb_ready_recorded;
  kvi__ring emb_stage;
  size_t stage_row_bytes;
  uint32_t stage_cap, stage_used, stage_reserved;
  kvi_status emb_err;
  char emb_err_msg[256];
  struct kvi__search *search; /* search workspace (search.c), made by the first search */
  kvi__map facts;   /* (tenant, id) -> fact */
  kvi__map tenants; /* (tenant, 0) -> tenant */
  uint64_t tokens_stored;
  /* Stream-ordered deferred frees (CUDA stores). Device work touching pages
   * records the next event number in `track` (KVI__TRACK_EVENTS events); all
   * numbers < track.done have completed. A page freed while numbers < tag
   * were outstanding waits in `deferred` until track.done >= tag. */
  kvi__events track;
  uint32_t *deferred_page;
  uint64_t *deferred_tag;
  uint32_t ndeferred;
  struct kvi__journal *journal; /* persist.c: the append log, or NULL */
  /* Tensor parallelism (shard.c): the communicator given at creation (or
   * NULL), this rank and the group's size (0 and 1 without one), and whether
   * each embedding is kept only by rank kvi__emb_rank(tenant, id, size). */
  struct kvi_comm *comm;
  int32_t comm_rank, comm_size;
  bool emb_sharded;
};

/* Whether a page id is on the pinned-host tier. */
static inline bool page_on_host_tier(const kvi_store *s, uint32_t page) { return page >= s->pool.npages; }

/* The host address of a page (a device address for a device-tier page). */
static inline char *page_addr(const kvi_store *s, uint32_t page) {
  if (page >= s->pool.npages) return s->hpool.base + (uint64_t)(page - s->pool.npages) * s->page_bytes;
  return s->pool.base + (uint64_t)page * s->page_bytes;
}

/* Whether a tiered store keeps f on the host (all its pages are there). */
static inline bool fact_on_host(const kvi_store *s, const fact *f) {
  return s->hpool.npages > 0 && f->npages > 0 && page_on_host_tier(s, f->pages[0]);
}

/* fp8 stores: the scales of a page, (l * 2 + kv) * H + h */
static inline float *page_scales(const kvi_store *s, uint32_t page) {
  return (float *)(page_addr(s, page) + s->scale_off);
}

/* The page stride the kernels use, in elements of the store's dtype. */
static inline int64_t page_stride_elems(const kvi_store *s) {
  return s->fp8 ? (int64_t)s->page_bytes : (int64_t)s->page_elems;
}

static inline uint32_t pages_for(const kvi_store *s, int32_t tokens) {
  return (uint32_t)(((int64_t)tokens + s->P - 1) / s->P);
}

void kvi__store_lock(const kvi_store *s);
void kvi__store_unlock(const kvi_store *s);

/* Looks up a fact; NULL when absent. */
static inline fact *kvi__store_find(const kvi_store *s, uint64_t tenant_id, uint64_t fact_id) {
  return (fact *)kvi__map_get(&s->facts, tenant_id, fact_id);
}

/* Makes `need` pages free, returning deferred pages whose readers have
 * completed (waiting for them if that is what it takes) and room for
 * `new_facts` more facts in the maps. KVI_ERR_CAPACITY when the pool cannot
 * hold them. */
kvi_status kvi__store_reserve(kvi_store *s, uint32_t need, size_t new_facts, const char *fn);

/* Records, on `stream`, the end of device work that reads or writes pages:
 * pages freed from now on wait for it. */
kvi_status kvi__store_track(kvi_store *s, struct CUstream_st *stream, const char *fn);

/* ---- tiers (tiered CUDA stores; store.c) -------------------------------- */

/* Makes `stream` wait for the last tier move if it may not have completed
 * (no-op otherwise, and on stores without a host tier). */
kvi_status kvi__store_order_moves(kvi_store *s, struct CUstream_st *stream, const char *fn);

/* Moves the `nup` host-tier facts up[] to the device and takes `extra` more
 * device pages for the caller (written into extra_pages, off the free stack:
 * the caller commits them to facts or gives them back with
 * kvi__store_give_back), demoting least-recently-used device facts whose
 * mark differs from `mark` when the device pool is short. Copies run on the
 * copy stream after every tracked device operation; `stream` then waits for
 * them. KVI_ERR_CAPACITY, with nothing changed, when the device cannot hold
 * them besides the marked facts or the host has no room for the demoted
 * ones. Device is current; the lock is held. */
kvi_status kvi__store_tier_move(kvi_store *s, fact *const *up, size_t nup, uint32_t extra, uint32_t *extra_pages,
                                uint64_t mark, struct CUstream_st *stream, const char *fn);

/* Returns pages taken by kvi__store_tier_move to their pool, after the
 * device work already tracked. */
void kvi__store_give_back(kvi_store *s, const uint32_t *pages, uint32_t n);

/* Marks f as the most recently used device-tier fact (no-op for host-tier
 * facts and stores without a host tier). */
void kvi__store_touch(kvi_store *s, fact *f);

/* Makes room for `n` more embedding rows in tenant_id's matrix (and, on a
 * CUDA store, n rows of staging; with dir_on, directory rows for facts of
 * up to `tokens` tokens), creating the tenant without facts if it is
 * new. No-op for a store without embeddings. Call after kvi__store_reserve,
 * for every fact the call will commit; if the call then fails, call
 * kvi__store_unreserve_rows for each of those tenants, so that no empty
 * tenant stays behind. The room that was made stays (as a hash map's). */
kvi_status kvi__store_reserve_rows(kvi_store *s, uint64_t tenant_id, size_t n, int32_t tokens, const char *fn);
void kvi__store_unreserve_rows(kvi_store *s, uint64_t tenant_id);

/* Inserts a fact whose `need` pages hold its data, replacing any fact with
 * the same key. The caller has already taken the pages off the free stack
 * (s->pool.nfree -= need for every fact of the call). Takes ownership of f,
 * pages and fresh; copies *emb (from kvi__store_read_embedding) into the
 * tenant's matrix and frees it. Cannot fail: call kvi__store_reserve and
 * kvi__store_reserve_rows and allocate f, pages and fresh first. */
void kvi__store_commit(kvi_store *s, fact *f, uint32_t *pages, uint32_t need, tenant *fresh, float **emb,
                       uint64_t tenant_id, uint64_t fact_id, int32_t tokens);

/* Reads and checks an embedding into a fresh fp32 array holding the values
 * the store will keep (kvi__emb_prepare applied; see kvi_put_options). */
kvi_status kvi__store_read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                     struct CUstream_st *stream, float **out, const char *fn);

/* What the store keeps of an fp32 vector of n elements, in place: for
 * cosine, each element times 1/sqrt(sum of squares), in double, a zero
 * vector left as it is; then rounded to t (nearest even) and back to fp32.
 * Returns the index of the first element that is not finite afterwards, or
 * -1. Queries (search.c) go through the same function. */
int64_t kvi__emb_prepare(float *x, int32_t n, kvi_dtype t, kvi_metric metric);

/* A decision every rank of a collective call takes together: given this
 * rank's status, returns the combined one (KVI_OK only when every rank's is). */
typedef struct kvi__gate {
  kvi_status (*decide)(struct kvi__gate *gate, kvi_status local);
} kvi__gate;

/* One fact of a put: view v (checked against the store's geometry, memory
 * kind checked), flags, emb (owned: freed by the put; NULL for a store
 * without embeddings), raw: see kvi__store_put_raw (NULL otherwise). */
typedef struct kvi__put_item {
  uint64_t tenant, id;
  const kvi_kv_view *v;
  uint32_t flags;
  float *emb;
  const float *raw;
} kvi__put_item;

/* The put of n facts, all or none (a key twice in the list is
 * KVI_ERR_INVALID_ARGUMENT). With a gate, the gate decides, the lock held
 * and the pages written but not yet taken, whether they are committed.
 * Frees every item's emb. */
kvi_status kvi__store_put_views(kvi_store *store, kvi__put_item *items, int32_t n, struct CUstream_st *stream,
                                kvi__gate *gate, const char *fn);

/* kvi_store_put's checks of opts and the view's memory; reads the embedding. */
kvi_status kvi__store_put_args(const kvi_store *store, const kvi_kv_view *v, const kvi_put_options *opts,
                               kvi_put_options *o, float **emb, struct CUstream_st *stream, const char *fn);

/* shard.c: the collective part of kvi_store_create with a communicator.
 * s is the store this rank made (NULL when local is an error). Checks that
 * the ranks agree; on success sets s's comm fields. Returns the combined
 * status; the caller destroys s when it is not KVI_OK. */
kvi_status kvi__shard_create(kvi_store *s, const kvi_model *model, const kvi_store_options *o, kvi_status local,
                             const char *fn);

/* search.c: kvi_store_search on this rank's embeddings only (arguments
 * already checked). locked: the caller holds the store's lock (for the
 * whole call: host outputs of a CUDA store are then waited for under it). */
kvi_status kvi__search_local(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn);

/* shard.c: the collective search of a store with sharded embeddings
 * (locked: as kvi__search_local). */
kvi_status kvi__shard_search(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn);

/* search.c: kvi_store_search's checks of everything but its outputs (opts
 * already read into *o). */
kvi_status kvi__search_check(const kvi_store *s, const void *queries, int32_t nq, int32_t dim, const uint64_t *tenants,
                             int32_t k, const kvi_search_options *o, const char *fn);

/* search.c: the device search of kvi_retrieve_inject (a CUDA store without
 * sharded embeddings; arguments checked). Under the store's lock it plans
 * the search, calls prepare (whose failure fails the call with nothing
 * enqueued), enqueues the search and then calls enqueue with device arrays:
 * rows (nq x k tenant rows of the results, -1 past the count), counts (the
 * facts found, which enqueue may overwrite with the facts injected) and
 * tokens (for enqueue to fill). Both run before the search's end is
 * recorded, so no put or remove changes a row or directory they read
 * before their work is done. Results land in o->out_memory: out_ids (the
 * search's), out_counts and out_tokens (as enqueue leaves them). */
typedef struct kvi__search_then {
  kvi_status (*prepare)(void *ctx, const char *fn);
  kvi_status (*enqueue)(void *ctx, const int32_t *rows, int32_t *counts, int32_t *tokens, struct CUstream_st *stream,
                        const char *fn);
  void *ctx;
} kvi__search_then;

kvi_status kvi__search_then_run(kvi_store *s, const void *queries, const kvi_search_options *o, int32_t nq,
                                const uint64_t *tenants, int32_t k, uint64_t *out_ids, int32_t *out_counts,
                                int32_t *out_tokens, const kvi__search_then *then, struct CUstream_st *stream,
                                const char *fn);

/* Frees the search workspace (search.c); the store's device is current. */
void kvi__search_release(kvi_store *s);

#endif /* KVI_STORE_INTERNAL_H */
