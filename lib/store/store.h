/*
 * libkvinject — the store part (lib/store/): the store's insides, for its
 * files (store_impl.h) and the parts above it (search, tp, xfer, persist).
 * The store calls none of them: what it must tell them goes through the
 * hooks they register (the search and journal parts of struct kvi_store).
 * Each part of struct kvi_store is changed only by its owner; facts are
 * added only through the write transaction (kvi__txn_*), read through
 * leases (kvi__store_lease). Callers hold the store's lock.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_STORE_H
#define KVI_STORE_H

#include <pthread.h>

#include "gpu/gpu.h"

/* kvi_store_options' first version: the fields before comm (older sizes are accepted) */
#define KVI__STORE_OPTIONS_V1 offsetof(kvi_store_options, comm)
/* kvi_put_options' first version */
#define KVI__PUT_OPTIONS_V1 offsetof(kvi_put_options, token_ids) /* before the token ids */

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
struct kvi__journal_ops;
struct kvi__disk_ops;

typedef struct fact {
  uint64_t tenant_id, id;
  int32_t tokens;
  uint32_t npages;
  uint32_t *pages;
  size_t row; /* its row of the tenant's embedding matrix (stores with embeddings) */
  struct fact *prev, *next; /* the tenant's list */
  tenant *owner;
  /* Tiered and disk-tier stores: facts with pages are on their tier's LRU
   * list (lru_list: 0 the device tier, or a CPU store's memory; 1 the host
   * tier), most recently injected, put, captured, promoted, demoted or read
   * back first; `pins` counts the leases (kvi__store_lease) of the call
   * holding the lock: a pinned fact is not demoted. */
  struct fact *lru_prev, *lru_next;
  bool in_lru;
  uint8_t lru_list;
  uint32_t pins;
  /* A device-tier fact promoted from the host keeps its host pages as a
   * clean copy (facts never change in place): demoting it again copies
   * nothing. NULL when there is none; dropped when the host needs room. */
  uint32_t *hpages;
  /* Its token ids (host memory, `tokens` of them, owned) and their hash
   * (kvi__token_hash), or NULL and 0: stored without them. */
  int32_t *token_ids;
  uint64_t token_hash;
  /* Its context (kvinject/store.h, "Context and stale facts"): ncontext
   * fact ids of its tenant (host memory, owned; NULL and 0 without), and
   * whether it is stale (counted in its tenant's and the index's `stale`). */
  uint64_t *context;
  int32_t ncontext;
  bool stale;
  /* Disk tier: where its record is in its tenant's file (the entry's
   * offset and the record's; 0: none yet). pages NULL: on disk only (npages
   * pages when read back), counted in its tenant's and the index's on_disk. */
  uint64_t disk_entry, disk_rec;
  /* Being read back by the store's I/O thread (kvi_store_prefetch): its job
   * (fetch.c), whose pages it gets when the read is published; else NULL. */
  struct kvi__disk_job *loading;
} fact;

/* A tenant's embeddings (stores with embedding_dim > 0): row r < nrows of the
 * [cap][emb.ld] matrix `emb` (emb.dtype, padding elements zero) is the
 * embedding of fact rows[r], and ids[r] == rows[r]->id. A CUDA store keeps
 * emb and ids in device memory, changed only on the store's emb.stream; a
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
  size_t pending; /* rows reserved by the call holding the lock (kvi__emb_reserve_rows, a transaction) */
  int32_t max_tokens; /* the largest fact it has held (never lowered) */
  size_t stale;       /* its stale facts */
  size_t on_disk;     /* its facts on disk only (disk tier) */
  bool disk_changed;  /* on the store's list of tenants whose disk-only facts changed (disk.changed) */
  /* The directory of a store with emb.dir_on (kernels.h, kvi__rquery): [cap] rows
   * of dir_stride words, in device memory, changed with the matrix. */
  uint32_t *dir;
  int32_t dir_stride;
};

/* The store's page pools (pools.c's functions alone take and return
 * pages): page ids [0, dev.npages) are device memory on a CUDA store, host
 * memory on a CPU store; a CUDA store with a host budget has the pinned,
 * mapped host tier after them, ids [dev.npages, dev.npages + host.npages)
 * (host.npages 0 without one), host_dev the device address of host.base. A
 * fact's pages are all on one tier. */
typedef struct kvi__store_pools {
  pool dev;
  pool host;
  char *host_dev;
} kvi__store_pools;

/* The facts and tenants (put.c, and embeddings.c for the tenants a
 * transaction reserves rows in; others read them through kvi__store_find,
 * kvi__store_tenant and kvi__store_next_fact). */
typedef struct kvi__store_index {
  kvi__map facts;   /* (tenant, id) -> fact */
  kvi__map tenants; /* (tenant, 0) -> tenant */
  uint64_t tokens_stored;
  uint64_t pages_stored; /* pages of stored facts (kvi_store_stats.bytes_payload) */
  uint64_t stale;        /* stale facts (kvi_store_stats.facts_stale) */
  uint64_t on_disk;      /* facts on disk only (kvi_store_stats.facts_on_disk_only) */
} kvi__store_index;

/* The tiers of a tiered store (tiers.c). */
typedef struct kvi__store_tier {
  /* facts with pages, a list per tier (fact.lru_list), most recently used
   * first: a tier's victims are found from its list's tail without walking
   * the other tier's facts */
  fact *lru_head[2], *lru_tail[2];
  uint64_t promotions, demotions;
  /* The last tier move: tracked event number move_seq (valid while
   * move_pending) recorded on copy_stream after its copies. Calls that read
   * pages make their stream (or the host) wait for it. */
  uint64_t move_seq;
  bool move_pending;
  struct CUevent_st *prefetch_ev; /* orders a prefetch after its caller's stream */
} kvi__store_tier;

/* The embedding state of a store with embeddings (see struct tenant;
 * embeddings.c alone changes it). ld is emb_dim rounded up to 16 bytes on a
 * CUDA store. On a CUDA store every change to a device matrix is enqueued on
 * `stream`, and `ready` is recorded after it; a reader of the matrices waits
 * for `ready`, and `stream` waits for the reader's end before the next change
 * (kvi__emb_read_begin, kvi__emb_read_end). New rows (with their ids and
 * directory rows) are staged in `stage`, a staging ring of one slot of
 * stage_cap bytes: stage_ent entries from its start, stage_top bytes of rows
 * from its end, stage_reserved bytes promised to the call holding the lock; a
 * commit's rows [stage_sent, stage_ent) go in one launch at its end
 * (kvi__emb_flush), and the slot's event follows the latest launch. A
 * failure to enqueue such a change (a dead context, in practice) is latched
 * in `err` and fails every later reader. */
typedef struct kvi__store_emb {
  kvi_dtype dtype;
  kvi_metric metric;
  bool dir_on;      /* tenants keep a device directory: a CUDA store with embeddings and no host tier */
  int32_t ld;
  uint64_t bytes;   /* capacity of every matrix and id array */
  struct CUstream_st *stream;
  struct CUevent_st *ready;
  bool ready_recorded;
  kvi__ring stage;
  size_t stage_row_bytes;
  size_t stage_cap, stage_top, stage_reserved;
  uint32_t stage_ent, stage_sent;
  kvi_status err;
  char err_msg[256];
} kvi__store_emb;

/* Tensor parallelism (set by tp/create.c at creation): the communicator (or
 * NULL), this rank and the group's size (0 and 1 without one), and whether
 * each embedding is kept only by rank kvi__emb_rank(tenant, id, size). */
typedef struct kvi__store_shard {
  struct kvi_comm *comm;
  int32_t rank, size;
  bool emb_sharded;
} kvi__store_shard;

/* The rank of a group of `size` that keeps a fact's embedding when they are
 * sharded (kvi_store_embedding_rank). */
int32_t kvi__emb_rank(uint64_t tenant, uint64_t fact_id, int32_t size);

/* A search of a store's embeddings: the arguments of kvi__search_local
 * (search/search.h). */
typedef kvi_status (*kvi__search_fn)(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                                     const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                                     int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                                     struct CUstream_st *stream, const char *fn);

/* A store: its fixed description, then one part per owner. */
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
  bool fp8;            /* dtype is KVI_DTYPE_FP8_E4M3: scales, then key offsets, follow the elements (base/fp8.h) */
  bool q4;             /* dtype is KVI_DTYPE_Q4: codes, then scales (base/q4.h) */
  uint64_t scale_off;  /* quantized stores: byte offset of a page's scales (the elements' bytes
                          rounded up to 16), else 0 */
  uint64_t scale_bytes; /* quantized stores: bytes of a page's scales as files keep them (unpadded;
                           fp8: then the key offsets, kvi__fp8_meta_bytes), else 0 */
  kvi__store_pools pool;
  kvi__store_index index;
  kvi__store_tier tier;
  /* CUDA stores: pinned staging (a ring of one slot of staging_pages pages)
   * and a private stream for host copies */
  kvi__ring staging;
  uint32_t staging_pages;
  struct CUstream_st *copy_stream;
  kvi__store_emb emb;
  /* Stream-ordered deferred frees (CUDA stores). Device work touching pages
   * records the next event number in `track` (KVI__TRACK_EVENTS events); all
   * numbers < track.done have completed. A page freed while numbers < tag
   * were outstanding waits in `deferred` until track.done >= tag. */
  kvi__events track;
  uint32_t *deferred_page;
  uint64_t *deferred_tag;
  uint32_t ndeferred;
  /* The parts of the modules above the store, which register them. */
  struct {
    struct kvi__search *ws;        /* search_cuda.c's workspace, made by the first search */
    void (*release)(kvi_store *s, bool device_ok); /* frees it (kvi__store_destroy's device_ok) */
    /* tp/search.c's search over every rank's embeddings, set at creation on a
     * store with sharded embeddings (NULL: this rank's search is the
     * store's); called by search.c (kvi__search_all) */
    kvi__search_fn collective;
  } search;
  struct {
    const struct kvi__journal_ops *ops; /* persist/journal.c's hooks, NULL without a journal */
    void *ctx;
  } journal;
  /* The disk tier (persist/disk.c registers its hooks and keeps the
   * counters; the store counts drops and reads back through fetch). */
  struct {
    const struct kvi__disk_ops *ops; /* NULL without a disk tier */
    void *ctx;
    uint64_t bytes, reads, read_bytes, writes, write_bytes, drops;
    /* Reads back by the store's I/O thread (fetch.c): the jobs not yet
     * published, oldest first, and the thread; jobs, their states and
     * `stop` are guarded by qm (taken after the store's lock, never before
     * it). */
    struct kvi__disk_job *jobs;
    pthread_mutex_t qm;
    pthread_cond_t qcv;
    pthread_t thread;
    bool thread_on, stop;
    /* The tenants whose disk-only facts changed since kvi_store_disk_changes
     * last took them (kvi__disk_note), oldest first; changed_all: a note
     * found no memory, so the next call lists every tenant. */
    uint64_t *changed;
    size_t nchanged, cchanged;
    bool changed_all;
  } disk;
  kvi__store_shard shard;
};

/* Whether a page id is on the pinned-host tier. */
static inline bool page_on_host_tier(const kvi_store *s, uint32_t page) { return page >= s->pool.dev.npages; }

/* The host address of a page (a device address for a device-tier page). */
static inline char *page_addr(const kvi_store *s, uint32_t page) {
  if (page >= s->pool.dev.npages) return s->pool.host.base + (uint64_t)(page - s->pool.dev.npages) * s->page_bytes;
  return s->pool.dev.base + (uint64_t)page * s->page_bytes;
}

/* Whether a tiered store keeps f on the host (all its pages are there). */
static inline bool fact_on_host(const kvi_store *s, const fact *f) {
  return s->pool.host.npages > 0 && f->npages > 0 && f->pages && page_on_host_tier(s, f->pages[0]);
}

/* fp8 stores: the scales of a page, (l * 2 + kv) * H + h (q4: base/q4.h's words) */
static inline float *page_scales(const kvi_store *s, uint32_t page) {
  return (float *)(page_addr(s, page) + s->scale_off);
}

/* fp8 stores: a page's key offsets at the page address `page`, fp16 bits,
 * (l * H + h) * D + d (base/fp8.h) */
static inline uint16_t *page_key_offsets(const kvi_store *s, const char *page) {
  return (uint16_t *)(page + s->scale_off + kvi__fp8_offsets_rel(s->geom.num_layers, s->geom.local_heads));
}

/* The page stride the kernels use, in elements of the store's dtype. */
static inline int64_t page_stride_elems(const kvi_store *s) {
  return s->scale_off ? (int64_t)s->page_bytes : (int64_t)s->page_elems; /* quantized: bytes */
}

static inline uint32_t pages_for(const kvi_store *s, int32_t tokens) {
  return (uint32_t)(((int64_t)tokens + s->P - 1) / s->P);
}

/* Where, in elements of the store's dtype from its page's start, the row of
 * the D elements of layer l's K (kv 0) or V (kv 1), local head h and token
 * tok < P of a page begins (the page layout: gpu/kernels.h). */
static inline int64_t kvi__page_row_off(const kvi_store *s, int32_t l, int kv, int32_t h, int32_t tok) {
  return ((((int64_t)l * 2 + kv) * s->geom.local_heads + h) * s->P + tok) * s->geom.head_size;
}

/* The pools as the kernels address pages (kvi__xfer_args.pool, host_pool
 * and host_first): the base of the device tier, the device address of the
 * mapped host tier (NULL without one), and the first host-tier page id. */
static inline char *kvi__pool_dev_base(const kvi_store *s) { return s->pool.dev.base; }
static inline char *kvi__pool_host_mapped(const kvi_store *s) { return s->pool.host_dev; }
static inline uint32_t kvi__pool_host_first(const kvi_store *s) { return s->pool.dev.npages; }

void kvi__store_lock(const kvi_store *s);
void kvi__store_unlock(const kvi_store *s);

/* Looks up a fact; NULL when absent. */
static inline fact *kvi__store_find(const kvi_store *s, uint64_t tenant_id, uint64_t fact_id) {
  return (fact *)kvi__map_get(&s->index.facts, tenant_id, fact_id);
}

/* Looks up n facts (tenants[i * tenant_stride], ids[i]) into out[i] (NULL when absent). */
static inline void kvi__store_find_many(const kvi_store *s, const uint64_t *tenants, size_t tenant_stride,
                                        const uint64_t *ids, size_t n, fact **out) {
  kvi__map_get_many(&s->index.facts, tenants, tenant_stride, ids, n, (void **)out);
}

/* Looks up a tenant; NULL when the store holds none of its facts. */
static inline tenant *kvi__store_tenant(const kvi_store *s, uint64_t tenant_id) {
  return (tenant *)kvi__map_get(&s->index.tenants, tenant_id, 0);
}

/* The number of stored facts. */
static inline size_t kvi__store_fact_count(const kvi_store *s) { return s->index.facts.len; }

/* The stored facts, one per call from *pos (0 to start), in no order; NULL
 * after the last. */
static inline const fact *kvi__store_next_fact(const kvi_store *s, size_t *pos) {
  for (; *pos < s->index.facts.cap; (*pos)++)
    if (s->index.facts.slots[*pos].val) return s->index.facts.slots[(*pos)++].val;
  return NULL;
}

/* Records, on `stream`, the end of device work that reads or writes pages:
 * pages freed from now on wait for it. */
kvi_status kvi__store_track(kvi_store *s, struct CUstream_st *stream, const char *fn);

/* ---- tiers (tiered CUDA stores; tiers.c) -------------------------------- */

/* The pages of the device-tier facts a tier move may demote now (those no
 * lease pins), counted from the least recently used until they reach `cap`
 * (the walk stops there: its cost is the victims', not the tier's). */
uint64_t kvi__store_evictable(const kvi_store *s, uint64_t cap);

/* The facts a tier move that needs `need` free device pages demotes: the
 * least recently used device-tier facts no lease pins, until their pages
 * and the free ones make `need` (all of them when they cannot), least
 * recently used first, written into out (NULL: only counted). Returns how
 * many. */
size_t kvi__store_victims(const kvi_store *s, uint64_t need, fact **out);

/* A reader's lease on n facts for the call holding the lock (a fact may be
 * named more than once): pins them, so that no tier move demotes them
 * before kvi__store_unlease, makes `stream` wait for the last tier move
 * and, with promote, moves those on the host tier to the device (demoting
 * facts that are not pinned if the device is short). A no-op on a store
 * without a host tier. On failure nothing stays pinned. */
kvi_status kvi__store_lease(kvi_store *s, fact *const *facts, size_t n, bool promote, struct CUstream_st *stream,
                            const char *fn);

/* Ends a lease of the same facts; `used`: the call read them, and they
 * become the most recently used, the first named the most recent. */
void kvi__store_unlease(kvi_store *s, fact *const *facts, size_t n, bool used);

/* Marks f (with pages, any tier) as the most recently used fact (no-op on a
 * store with neither a host tier nor a disk tier, and for a fact on disk). */
void kvi__store_touch(kvi_store *s, fact *f);

/* Reads and checks an embedding into a fresh fp32 array holding the values
 * the store will keep (kvi__emb_prepare applied; see kvi_put_options). */
kvi_status kvi__store_read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                     struct CUstream_st *stream, float **out, const char *fn);

/* The same for an embedding already as a store of this kind keeps it (a
 * store file's, host fp32): checked and rounded, not scaled again. */
kvi_status kvi__store_kept_embedding(const kvi_store *s, const float *embedding, float **out, const char *fn);

/* What the store keeps of an fp32 vector of n elements, in place: for
 * cosine, each element times 1/sqrt(sum of squares), in double, a zero
 * vector left as it is; then rounded to t (nearest even) and back to fp32.
 * Returns the index of the first element that is not finite afterwards, or
 * -1. Queries (search_cpu.c) go through the same function. */
int64_t kvi__emb_prepare(float *x, int32_t n, kvi_dtype t, kvi_metric metric);

/* A reader of a CUDA store's device embeddings (matrices, ids, directories:
 * a search, kvi_inject_batched's lookup of device fact ids), the store's
 * lock held from begin until end:
 *   kvi__emb_read_begin  fails with the error latched by an earlier change
 *                        (emb.err, with its message) and enqueues nothing;
 *                        else makes `stream` wait for the last change
 *                        (emb.ready), so that the reads see it
 *   the reader enqueues its reads on `stream`, then records an event of its
 *                        own, `done`, on `stream` after them
 *   kvi__emb_read_end    makes emb.stream wait for `done`, so that no later
 *                        change (a commit's rows, a removal's row move, a
 *                        matrix grown or freed) runs before the reads
 * Once anything was enqueued after a successful begin, end follows, the
 * reader's failure notwithstanding (what was enqueued may run). */
kvi_status kvi__emb_read_begin(kvi_store *s, struct CUstream_st *stream, const char *fn);
kvi_status kvi__emb_read_end(kvi_store *s, struct CUevent_st *done, const char *fn);
/* The failure latched by an earlier change to the device embeddings (for
 * fn, with its message), or KVI_OK (kvi_store_async_errors). */
kvi_status kvi__emb_latched(const kvi_store *s, const char *fn);

/* A decision every rank of a collective call takes together: given this
 * rank's status, returns the combined one (KVI_OK only when every rank's is). */
typedef struct kvi__gate {
  kvi_status (*decide)(struct kvi__gate *gate, kvi_status local);
} kvi__gate;

/* ---- the write transaction (txn.c) ---------------------------------------
 *
 * Every change that adds facts (kvi_store_put, kvi_store_put_scatter,
 * kvi_store_load, kvi_encode) is one transaction, all or nothing, the
 * store's lock held from begin to commit or abort:
 *   kvi__txn_begin    room for `cap` facts in the transaction (no store change)
 *   kvi__txn_add      a fact: reserves its record's room in the maps and its
 *                     embedding row (kvi__txn_token_ids: its token ids)
 *   kvi__txn_take_pages  refuses a key the store holds that was added without
 *                     KVI_PUT_REPLACE (all keys looked up in prefetched groups),
 *                     then takes every added fact's pages off the free stacks
 *                     (kvi__txn_pages: fact i's page ids)
 *   the caller's work writing the pages (kvi__store_write_pages, or the
 *                     encoder's kernels); kvi__txn_wrote when device work was
 *                     enqueued on the transaction's stream (and tracked)
 *   kvi__txn_prepare  (optional, e.g. while the device works) allocates the
 *                     facts' records
 *   kvi__txn_commit   records, then the gate (every rank decides together),
 *                     then the journal hook (durable before visible), then the
 *                     facts become visible at once; cannot fail past the hook
 *   kvi__txn_abort    undoes everything: the pages go back onto their free
 *                     stacks in their old order (after the device work, which
 *                     it waits for), the rows and empty tenants it reserved go.
 * The first failure of any step is passed to kvi__txn_abort; commit aborts
 * by itself. Both end the transaction (and ask the gate, once, when it has
 * not been asked), free what it still owns and return the call's status.
 * A transaction owns the embeddings added to it. Pages taken from a tier
 * move (kvi__txn_take_pages of KVI__PLACE_DEVICE on a tiered store) go back
 * after the device work already tracked, and the facts the move demoted stay
 * on the host. */
typedef enum kvi__place {
  KVI__PLACE_ANY = 0,    /* per fact: the device tier when it has room, else the host tier (puts) */
  KVI__PLACE_DEVICE = 1, /* all on the device tier, demoting facts there if it is short (encodes) */
  KVI__PLACE_DISK = 2,   /* no pages: facts indexed from their tenant's file (disk tier), on disk
                            only; no pages are taken or written and no hook is called */
} kvi__place;

typedef struct kvi__txn_fact {
  uint64_t tenant, id;
  int32_t tokens;
  uint32_t flags;         /* KVI_PUT_REPLACE or 0 */
  uint32_t npages, first; /* its page ids: the transaction's pages[first, first + npages) */
  float *emb;             /* emb_dim fp32 values as the store keeps them, or NULL; owned */
  int32_t *ids;           /* its token ids (tokens of them), or NULL; owned (kvi__txn_token_ids) */
  uint64_t *ctx;          /* its context (nctx ids), or NULL; owned (kvi__txn_context) */
  int32_t nctx;
  bool stale;             /* it is stored stale (kvi__txn_context) */
  pool *into;             /* the pool its pages came from */
  fact *f;                /* records, allocated by kvi__txn_prepare */
  uint32_t *pages;
  tenant *fresh;
} kvi__txn_fact;

typedef struct kvi__txn {
  kvi_store *s;
  kvi__place place;
  kvi__gate *gate;
  struct CUstream_st *stream;
  const char *fn;
  const char *item; /* names the facts in messages ("capture" -> "capture 3: ..."), or NULL */
  kvi__txn_fact *facts;
  int32_t n, cap;
  int32_t nrows;      /* facts [0, nrows) reserved embedding rows (or tried to) */
  uint32_t *pages;    /* every fact's page ids, in order (kvi__txn_take_pages) */
  uint32_t npages, ntaken;
  bool moved;         /* the pages came from a tier move */
  bool device_work, prepared, decided;
} kvi__txn;

kvi_status kvi__txn_begin(kvi__txn *t, kvi_store *s, int32_t cap, kvi__place place, kvi__gate *gate,
                          struct CUstream_st *stream, const char *fn);
kvi_status kvi__txn_add(kvi__txn *t, uint64_t tenant_id, uint64_t fact_id, int32_t tokens, uint32_t flags, float *emb);
/* Gives the fact added last a copy of its token ids (`tokens` of them;
 * NULL: none), kept by the fact once committed. */
kvi_status kvi__txn_token_ids(kvi__txn *t, const int32_t *ids);
/* Gives the fact added last a copy of its context (n ids; NULL and 0:
 * none). stale < 0: each id must name a fact of its tenant that the store
 * holds or that the transaction added before it (else KVI_ERR_NOT_FOUND;
 * its own id is KVI_ERR_INVALID_ARGUMENT), and the fact is stale when one of
 * them is; 0 or 1: the flag as given, the ids unchecked (a store file's). */
kvi_status kvi__txn_context(kvi__txn *t, const uint64_t *ids, int32_t n, int stale);
kvi_status kvi__txn_take_pages(kvi__txn *t);
static inline uint32_t *kvi__txn_pages(const kvi__txn *t, int32_t i) { return t->pages + t->facts[i].first; }
void kvi__txn_wrote(kvi__txn *t);
kvi_status kvi__txn_prepare(kvi__txn *t);
kvi_status kvi__txn_commit(kvi__txn *t);
kvi_status kvi__txn_abort(kvi__txn *t, kvi_status why);

/* Copies the host or device view v (checked) into a fact's pages (on
 * `stream` for a device view of a CUDA store, untracked: see
 * kvi__store_track). scales: NULL, or for a quantized store a host view of
 * its dtype holding the stored elements, stored as they are with these
 * pages' scales (as kvi__store_read_pages gives them). */
kvi_status kvi__store_write_pages(kvi_store *s, const uint32_t *pages, const kvi_kv_view *v, const void *scales,
                                  struct CUstream_st *stream, const char *fn);

/* ---- reads for persist (the caller holds the store's lock) ------------- */

/* Reads `tokens` tokens of K and V from `pages` into a host view. For a
 * quantized store, `host` has the store's dtype and receives the stored
 * elements as they are (q4: the view's strides count 4-bit elements), and
 * scales[ceil(tokens / P) * s->scale_bytes] each page's scales as the page
 * keeps them (fp8: [page][layer][K, V][head] fp32; q4: base/q4.h); else
 * scales is NULL. */
kvi_status kvi__store_read_pages(const kvi_store *s, const uint32_t *pages, int32_t tokens, const kvi_kv_view *host,
                                 void *scales, const char *fn);

/* A stored fact's embedding as emb_dim fp32 values. */
kvi_status kvi__store_fact_embedding(const kvi_store *s, const struct fact *f, float *out, const char *fn);

/* Waits for every device operation the store tracks (puts from device
 * memory, encodes, injections, reads into device memory). */
kvi_status kvi__store_wait_device(kvi_store *s, const char *fn);

/* ---- hooks of the modules above the store --------------------------------
 * The store calls nothing above it; what it must tell them goes through
 * these, registered by their owners (the lock held). */

/* persist/journal.c: the journal. put appends a transaction's facts (their pages
 * written, kvi__txn_prepare done) before they are committed; remove the
 * removal of a stored fact; release closes it (kvi_store_destroy). A
 * failing put or remove changes nothing in the store. */
typedef struct kvi__journal_ops {
  kvi_status (*put)(void *ctx, const kvi__txn *t);
  kvi_status (*remove)(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn);
  void (*release)(void *ctx);
} kvi__journal_ops;

/* persist/disk.c: the disk tier (kvinject/store.h, "Disk tier"), the lock
 * held by every hook.
 *   claim    before a call writes `tenant`: takes or renews its lease
 *            (KVI_ERR_LEASED when another replica holds it), re-reads the
 *            tenant from its file when it was taken over or the file changed
 *            (every fact of the tenant may be replaced: call it before
 *            looking any up), compacts the file; nothing is pinned then
 *   open     kvi_store_prefetch of a whole tenant: indexes it from its file
 *            when the store does not have it or (without the lease) the file
 *            changed since it was read
 *   put      appends a transaction's facts to their tenants' files, flushed,
 *            and sets each record's disk_entry and disk_rec (as the journal's)
 *   remove   appends the removal of a stored fact
 *   prep     a read of fact f's record back: what it needs, in *io
 *   read     does it: reads the record's entry and checks its checksum;
 *            touches nothing of the store but its geometry (no lock needed:
 *            the store's I/O thread runs it without), and fails into *io
 *   publish  the read's failure, or the record decoded into `pages` (f->npages
 *            pages of the store, taken off their free stack)
 *   discard  frees *io (after publish, or instead of it)
 *   release  ends the tier (kvi_store_destroy) */
typedef struct kvi__disk_ops {
  kvi_status (*claim)(void *ctx, kvi_store *s, uint64_t tenant, const char *fn);
  kvi_status (*open)(void *ctx, kvi_store *s, uint64_t tenant, const char *fn);
  kvi_status (*put)(void *ctx, const kvi__txn *t);
  kvi_status (*remove)(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn);
  kvi_status (*prep)(void *ctx, kvi_store *s, const fact *f, void **io, const char *fn);
  void (*read)(const kvi_store *s, void *io, const char *fn);
  kvi_status (*publish)(void *ctx, kvi_store *s, const fact *f, void *io, const uint32_t *pages, const char *fn);
  void (*discard)(void *io);
  void (*release)(void *ctx);
} kvi__disk_ops;

/* Puts tenant t on the list of tenants whose disk-only facts changed
 * (kvi_store_disk_changes), once; the store's lock held. Called wherever
 * t->on_disk changes. */
void kvi__disk_note(kvi_store *s, tenant *t);
kvi_status kvi__store_disk_changes(kvi_store *store, uint64_t *tenants, size_t capacity, size_t *count,
                                   const char *fn);

/* The disk tier's part of the store (tiers.c), the lock held: */
/* claim (above) for a call that writes `tenant`; KVI_OK without a disk tier. */
kvi_status kvi__disk_claim(kvi_store *s, uint64_t tenant, const char *fn);
/* Gives every fact of facts[0..n) without pages its pages back, read from
 * its tenant's file (the host tier on a tiered CUDA store, else the first
 * pool), dropping least-recently-used unpinned facts of that pool to disk
 * when it is short; a fact the I/O thread is reading is waited for, not
 * read twice. The caller pins the facts (kvi__store_lease does). */
kvi_status kvi__disk_resident(kvi_store *s, fact *const *facts, size_t n, const char *fn);
/* Starts reading fact f (on disk, not loading, pinned by the caller) back
 * on the store's I/O thread: its pages taken now (KVI_ERR_CAPACITY when
 * they cannot be), the read without the lock, the publication under it (by
 * the thread on a CPU store; on a CUDA store by the next call that needs f,
 * or kvi__disk_drain). */
kvi_status kvi__disk_start(kvi_store *s, fact *f, const char *fn);
/* Settles every read back still running or queued (kvi__disk_room, when
 * their pages are what memory lacks). */
void kvi__disk_settle_all(kvi_store *s, const char *fn);
/* Publishes the reads the I/O thread has finished (a CUDA store's). */
kvi_status kvi__disk_drain(kvi_store *s, const char *fn);
/* kvi_store_prefetch_wait: takes the store's lock itself, and leaves it
 * while the I/O thread reads. */
kvi_status kvi__disk_wait(kvi_store *s, const char *fn);
/* Ends f's read back (f->loading): waits for the read if it is running,
 * then publishes it (keep) or gives its pages back. */
kvi_status kvi__disk_settle(kvi_store *s, fact *f, bool keep, const char *fn);
/* Stops the I/O thread and drops the jobs left (kvi_store_destroy). */
void kvi__disk_stop(kvi_store *s);
/* Forgets every fact of `tenant` (no hook is called, no fact becomes stale):
 * its file is about to be read again. */
void kvi__store_forget_tenant(kvi_store *s, uint64_t tenant);
/* Removes a fact as kvi_store_remove_ex does, the lock held, calling no
 * hook (a removal read from a tenant's file). */
kvi_status kvi__store_unindex(kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn);

/* One fact of a put: view v (checked against the store's geometry, memory
 * kind checked), flags, emb (owned: freed by the put; NULL for a store
 * without embeddings). */
typedef struct kvi__put_item {
  uint64_t tenant, id;
  const kvi_kv_view *v;
  uint32_t flags;
  float *emb;
  const int32_t *ids; /* v->num_tokens token ids (host memory; copied), or NULL */
  const uint64_t *ctx; /* nctx context ids (host memory; copied), or NULL */
  int32_t nctx;
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

/* The store of this rank alone (kvi_store_create's local part, opts read
 * and the placement checked; tp/create.c makes the ranks of a communicator
 * agree on theirs). A CUDA store's memory is allocated on the current
 * device: the caller makes kvi__store_options_device(opts) current first. */
kvi_status kvi__store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts, const char *fn);

/* The store's CUDA device, or -1 for a CPU store (and NULL): the device its entry
 * points make current (lib/api/api.h). */
int kvi__store_device(const kvi_store *s);

/* The device a store created with these (read) options is on, the one to
 * make current before kvi__store_create: its CUDA device, or -1 for a CPU
 * store and for a backend or device that kvi__store_create refuses (it
 * reports why; this may set the same message). No device work. */
int kvi__store_options_device(const kvi_store_options *o, const char *fn);

/* ---- the store's public functions (kvinject/store.h), without entering the
 * device: the caller (lib/api/store.c, or a part whose entry point made the
 * store's device current) has. fn names the public function in messages. */

/* kvi_store_destroy; device_ok false: the device could not be made current,
 * so host memory is freed and device memory left. */
void kvi__store_destroy(kvi_store *s, bool device_ok);
/* kvi_store_prefetch */
kvi_status kvi__store_prefetch(kvi_store *store, uint64_t tenant_id, const uint64_t *fact_ids, int32_t count,
                               struct CUstream_st *stream, const char *fn);
/* kvi_store_put */
kvi_status kvi__store_put(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *kv,
                          const kvi_put_options *opts, struct CUstream_st *stream, const char *fn);
/* kvi_store_remove_ex (kvi_store_remove: flags 0) */
kvi_status kvi__store_remove(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, uint32_t flags, const char *fn);
/* kvi_store_read */
kvi_status kvi__store_read(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *dst,
                           struct CUstream_st *stream, const char *fn);
/* kvi_store_fact_tokens (no device work) */
kvi_status kvi__store_fact_tokens(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, int32_t *out_tokens,
                                  const char *fn);
/* kvi_store_fact_token_ids (no device work) */
kvi_status kvi__store_fact_token_ids(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, int32_t *out_ids,
                                     int32_t capacity, int32_t *out_num, uint64_t *out_hash, const char *fn);
/* kvi_store_fact_context (no device work) */
kvi_status kvi__store_fact_context(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, uint64_t *out_ids,
                                   int32_t capacity, int32_t *out_num, int32_t *out_stale, const char *fn);
/* kvi_store_stale (no device work) */
kvi_status kvi__store_stale(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                            size_t *out_total, const char *fn);
/* KVI_ERR_STALE for a stale fact f, naming it (request r >= 0: "request r: ") */
kvi_status kvi__store_stale_fail(const fact *f, int32_t r, const char *fn);
/* KVI_ERR_STALE when `tenant` has stale facts (calls that cannot look facts
 * up one by one: device fact ids, retrieval); r as above */
kvi_status kvi__store_tenant_fresh(const tenant *t, int32_t r, const char *fn);
/* kvi_store_get_embedding */
kvi_status kvi__store_get_embedding(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, float *out,
                                    const char *fn);
/* kvi_store_count (no device work) */
kvi_status kvi__store_count(const kvi_store *store, uint64_t tenant_id, size_t *out_count, const char *fn);
/* kvi_store_list (no device work) */
kvi_status kvi__store_list(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                           size_t *out_total, const char *fn);
/* kvi_store_list_on_disk (no device work, no file I/O) */
kvi_status kvi__store_list_on_disk(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                                   size_t *out_total, const char *fn);
/* kvi_store_fact_tier (no device work) */
kvi_status kvi__store_fact_tier(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, int32_t *out_tier,
                                const char *fn);
/* kvi_store_stats_get (no device work) */
kvi_status kvi__store_stats_get(const kvi_store *store, kvi_store_stats *out, const char *fn);
/* kvi_store_embedding_rank (-1 for tp_size < 1; no error is set) */
int32_t kvi__store_embedding_rank(uint64_t tenant, uint64_t fact_id, int32_t tp_size);

#endif /* KVI_STORE_H */
