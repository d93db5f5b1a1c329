/*
 * libkvinject — communicators and tensor-parallel fact stores.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * Under tensor parallelism rank r of tp holds KV heads [r*H/tp, (r+1)*H/tp)
 * of every layer (one head replicated on tp/H ranks when H < tp; see
 * kvinject/model.h). A store created from such a model holds only those
 * heads of every fact, so capture (kvi_encode) and injection (kvi_inject)
 * stay rank-local: no collective runs on the hot path. A communicator
 * (kvi_comm) lets the ranks' stores agree and move what must be moved:
 *
 * - creation: a store given a communicator (kvi_store_options.comm) checks
 *   with the other ranks that they agree on the model geometry, RoPE, storage
 *   dtype, embeddings and tp layout; all ranks fail together if not;
 * - sharded retrieval (KVI_EMBEDDINGS_SHARDED): each fact's embedding is kept
 *   by one rank only (1/tp of a tenant's embeddings per rank); a search scores
 *   the local share, exchanges each query's k best candidates with one
 *   all-gather and merges them, so every rank gets the same top-k in the same
 *   order and injects the same facts;
 * - put from a full-head source (kvi_store_put_scatter) and its reverse
 *   (kvi_store_gather): facts with all heads on one rank are split so that
 *   each rank keeps its slice, and facts' slices are joined on one rank, a
 *   batch of facts per call. Re-sharding a store to another tp size is gather
 *   under the old communicator then put (or put_scatter) under the new one.
 *
 * Two transports carry the same logic:
 * - NCCL (kvi_comm_create_nccl): for CUDA stores, one process or thread per
 *   GPU; data moves between device buffers on the caller's stream.
 * - in-process (kvi_comm_group_create + kvi_comm_create_local): ranks are
 *   threads of one process and data moves by memcpy. For CPU stores; it is
 *   how the tensor-parallel logic is tested without GPUs, and what a CPU
 *   engine running ranks as threads uses.
 *
 * Collective calls. kvi_store_create with a communicator,
 * kvi_store_put_scatter, kvi_store_gather, kvi_store_check_agreement and
 * kvi_store_search on a store with KVI_EMBEDDINGS_SHARDED are collective:
 * every rank of the communicator makes the same call (same tenant, fact id,
 * root, query count and k) in the same order, as with NCCL's collectives; a
 * rank that never calls leaves the others waiting. Arguments that every rank
 * checks the same way (NULL, k out of range) are refused before the exchange
 * on every rank alike. Anything else that fails on one rank (a full store, an
 * allocation, a CUDA error) fails the call on every rank: the failing rank
 * returns its own status, the others KVI_ERR_PEER, and no rank's store has
 * changed. A collective call holds its store's lock until it returns.
 *
 * Rank-local calls (kvi_store_put, kvi_store_remove, kvi_encode, kvi_inject,
 * kvi_store_read) are not collective. The ranks must still put and remove
 * the same facts; kvi_store_check_agreement verifies that they did.
 *
 * A communicator is used by one thread at a time (a collective call on it
 * runs to completion before the next), and must outlive every store created
 * with it.
 */
#ifndef KVINJECT_COMM_H
#define KVINJECT_COMM_H

#include "kvinject/common.h"
#include "kvinject/store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvi_comm kvi_comm;
typedef struct kvi_comm_group kvi_comm_group;

/* NCCL's communicator (ncclComm_t is `struct ncclComm *`). Opaque here, so
 * programs that do not use NCCL compile without its header. */
struct ncclComm;

/* ------------------------------------------------------------------------ */
/* Communicators                                                            */
/* ------------------------------------------------------------------------ */

/*
 * Wraps an initialized NCCL communicator (ncclCommInitRank and friends) for
 * the ranks of one tensor-parallel group. The library borrows `nccl`: the
 * caller keeps it alive until kvi_comm_destroy and destroys it afterwards.
 * The kvi_comm's rank and size are NCCL's; its device is the communicator's
 * CUDA device (ncclCommCuDevice). It allocates a small device buffer and a
 * stream there for the exchanges of control data.
 * out: host memory; receives the communicator, owned by the caller.
 * The first call opens libnccl.so.N (N: NCCL's major version at build time).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL), KVI_ERR_NOT_BUILT (library built
 * without NCCL, or libnccl does not load: kvi_last_error names it and the
 * loader's message), KVI_ERR_CUDA (an NCCL or CUDA call failed; kvi_last_error
 * names it), KVI_ERR_OUT_OF_MEMORY.
 */
KVI_API kvi_status kvi_comm_create_nccl(kvi_comm **out, struct ncclComm *nccl);

/*
 * A group of `size` (1..1024) in-process ranks. Each rank's thread makes
 * its communicator with kvi_comm_create_local. The group must outlive its
 * communicators. Errors: KVI_ERR_INVALID_ARGUMENT, KVI_ERR_OUT_OF_MEMORY.
 */
KVI_API kvi_status kvi_comm_group_create(kvi_comm_group **out, int32_t size);

/* Frees a group; its communicators must be destroyed first. NULL is a no-op. */
KVI_API void kvi_comm_group_destroy(kvi_comm_group *group);

/*
 * The communicator of rank `rank` (0..size-1) of an in-process group; each
 * rank at most once at a time. Not collective: ranks may create theirs in
 * any order, from any thread.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, rank out of range), KVI_ERR_EXISTS
 * (that rank already has a live communicator), KVI_ERR_OUT_OF_MEMORY.
 */
KVI_API kvi_status kvi_comm_create_local(kvi_comm **out, kvi_comm_group *group, int32_t rank);

/* Frees a communicator (not the NCCL communicator it wraps). Stores created
 * with it must be destroyed first. NULL is a no-op. */
KVI_API void kvi_comm_destroy(kvi_comm *comm);

/* This communicator's rank and size into *out_rank and *out_size (host
 * memory; either may be NULL). Errors: KVI_ERR_INVALID_ARGUMENT. */
KVI_API kvi_status kvi_comm_rank(const kvi_comm *comm, int32_t *out_rank, int32_t *out_size);

/*
 * The communicator's asynchronous errors ("Asynchronous errors" in
 * kvinject/common.h):
 * - Latched: NCCL's asynchronous error state (ncclCommGetAsyncError) of the
 *   wrapped communicator, as KVI_ERR_CUDA with NCCL's message. A peer that
 *   died or a broken link shows up here while a collective waits; the
 *   caller then aborts the NCCL communicator (ncclCommAbort) and destroys
 *   the stores made with it. KVI_OK for an in-process communicator.
 * - Counted: nothing; *out_count is 0.
 * Threads: thread-safe; never waits for a collective.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL comm).
 */
KVI_API kvi_status kvi_comm_async_errors(kvi_comm *comm, int64_t *out_count);

/* ------------------------------------------------------------------------ */
/* Tensor-parallel stores                                                   */
/* ------------------------------------------------------------------------ */

/*
 * A store is given its communicator and embedding placement through
 * kvi_store_options (kvi_store_options.comm, .embedding_placement). With a
 * communicator, kvi_store_create is collective and additionally requires:
 * the model's tp_size equal to the communicator's size and its tp_rank equal
 * to the rank; a CUDA store on the NCCL communicator's device, or a CPU
 * store with an in-process communicator; and on every rank the same number
 * of layers, KV heads, head size, RoPE of every layer, storage dtype,
 * page_tokens, embedding_dim, embedding_dtype, metric and placement (the
 * budgets may differ). A disagreement fails every rank with KVI_ERR_MISMATCH
 * and kvi_last_error naming the field and the ranks.
 *
 * Embedding placement (stores with embeddings):
 * - KVI_EMBEDDINGS_REPLICATED (default): every rank keeps every embedding
 *   and searches alone; no collective, tp times the embedding memory.
 * - KVI_EMBEDDINGS_SHARDED: the fact (tenant, id) keeps its embedding only
 *   on rank kvi_store_embedding_rank(tenant, id, tp_size); every rank still
 *   passes it to kvi_store_put (the others check and drop it). A search is
 *   then collective: 1/tp of the scoring work and memory per rank, plus one
 *   all-gather of num_queries x k candidates. kvi_store_get_embedding on
 *   another rank than the keeper returns KVI_ERR_NOT_FOUND.
 * A store with a communicator cannot take an append log (kvi_store_journal_open)
 * in this version; one with sharded embeddings cannot be saved
 * (kvi_store_save): both return KVI_ERR_UNSUPPORTED.
 */

/* The rank (0..tp_size-1) that keeps the embedding of fact (tenant, fact_id)
 * in a store with KVI_EMBEDDINGS_SHARDED: a fixed hash, the same in every
 * version and on every platform. -1 when tp_size < 1. */
KVI_API int32_t kvi_store_embedding_rank(uint64_t tenant, uint64_t fact_id, int32_t tp_size);

/* One fact of kvi_store_put_scatter. */
typedef struct kvi_scatter_item {
  size_t struct_size;          /* sizeof(kvi_scatter_item); the same for every item */
  uint64_t tenant;
  uint64_t fact_id;
  const kvi_kv_view *full;     /* root: the source, with every KV head (num_heads =
                                  the model's num_kv_heads, in their global order),
                                  otherwise as for kvi_store_put; ignored elsewhere */
  const kvi_put_options *opts; /* root: as for kvi_store_put, or NULL; ignored elsewhere
                                  (every rank uses root's flags and embedding) */
} kvi_scatter_item;

#define KVI_SCATTER_ITEM_INIT {sizeof(kvi_scatter_item), 0, 0, NULL, NULL}

/*
 * Collective. Stores facts given with all KV heads on rank `root`: each rank
 * keeps its heads (the model's local head range) of every layer, exactly as
 * a rank-local kvi_store_put of that slice would. All items or none: on any
 * failure on any rank, no rank's store changes.
 * root: 0..size-1, the same on every rank.
 * items: host memory, num_items items (0..2^20); every rank passes the same
 *   tenants and fact ids in the same order (checked: KVI_ERR_MISMATCH);
 *   `full` and `opts` are read on root only (root's opts->token_ids, if
 *   given, are kept by every rank's store). A key twice in the list is
 *   KVI_ERR_INVALID_ARGUMENT.
 * stream: on a CUDA store, the stream the packing, the NCCL transfers and the
 *   copies into the store are enqueued on; a device `full` must stay valid
 *   until it has passed them. The call waits for the stream at each of its
 *   few control exchanges (not per item), so batch items: one call moves all
 *   of them with one send per rank.
 * Errors: those of kvi_store_put on any rank (the failing rank returns its
 * status, the others KVI_ERR_PEER), KVI_ERR_MISMATCH (the ranks disagree on
 * root or on the list), KVI_ERR_INVALID_ARGUMENT (NULL store or items, root
 * or num_items out of range, NULL full on root), KVI_ERR_STRUCT_SIZE,
 * KVI_ERR_UNSUPPORTED (a store without a communicator; root's opts with
 * context ids: a scattered put keeps no context), KVI_ERR_CUDA.
 */
KVI_API kvi_status kvi_store_put_scatter(kvi_store *store, int32_t root, const kvi_scatter_item *items,
                                         int32_t num_items, struct CUstream_st *stream);

/* One fact of kvi_store_gather. */
typedef struct kvi_gather_item {
  size_t struct_size;      /* sizeof(kvi_gather_item); the same for every item */
  uint64_t tenant;
  uint64_t fact_id;
  const kvi_kv_view *full; /* root: the destination, every KV head in global
                              order, num_tokens = the fact's; ignored elsewhere */
} kvi_gather_item;

#define KVI_GATHER_ITEM_INIT {sizeof(kvi_gather_item), 0, 0, NULL}

/*
 * Collective. Joins stored facts' slices into their `full` views on rank
 * `root`, converted to each view's dtype as kvi_store_read does. With
 * replicated heads (tp > H) the first rank holding a head provides it.
 * items: as for kvi_store_put_scatter (same list on every rank; `full` read
 * on root only). stream: as for kvi_store_read; host views on root are
 * written before the call returns.
 * Errors: KVI_ERR_NOT_FOUND (a fact missing on some rank), KVI_ERR_MISMATCH
 * (token counts differ between ranks or from a view; the ranks' lists
 * differ), those of kvi_store_read, KVI_ERR_PEER, KVI_ERR_INVALID_ARGUMENT,
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_UNSUPPORTED (no communicator), KVI_ERR_CUDA.
 * A gather changes no store; after an error the contents of root's views are
 * unspecified.
 */
KVI_API kvi_status kvi_store_gather(kvi_store *store, int32_t root, const kvi_gather_item *items, int32_t num_items,
                                    struct CUstream_st *stream);

/*
 * Collective. Checks that every rank holds the same facts: the same
 * (tenant, id, token count, token ids' hash) set (the hash 0 for a fact
 * without token ids), compared through a 128-bit digest and the counts. KVI_OK on every rank when they agree; KVI_ERR_MISMATCH on every
 * rank when not (kvi_last_error gives the ranks' fact counts). Reads only.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL), KVI_ERR_UNSUPPORTED (no
 * communicator), KVI_ERR_CUDA.
 */
KVI_API kvi_status kvi_store_check_agreement(kvi_store *store);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_COMM_H */
