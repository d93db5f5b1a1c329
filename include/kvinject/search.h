/*
 * libkvinject — semantic retrieval in the fact store (kvi_store_search).
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * A store created with embedding_dim > 0 keeps each fact's embedding beside
 * its KV, so one handle answers "which facts for this question" and "write
 * them into this cache". A search takes a batch of query embeddings, each
 * with its tenant, and returns for each query the k facts of that tenant
 * with the highest scores (kvi_store_options.metric: inner product, or cosine
 * similarity), sorted.
 *
 * What is scored. Embeddings are kept in the store's embedding_dtype (fp32,
 * fp16 or bf16; for cosine, scaled to unit length before rounding). Queries
 * are treated the same way: converted to fp32, scaled to unit length for
 * cosine (in double precision), rounded to the store's embedding_dtype. The
 * score of a fact is the inner product of the two rounded vectors:
 * - CPU store (the reference): products and sum in double, rounded once to
 *   fp32, so it is the exact inner product to fp32 rounding.
 * - CUDA store: fp32 accumulation: a bandwidth-bound scan kernel when a
 *   tenant has at most 8 queries in the call (fewer for dim > 1536),
 *   otherwise cuBLASLt (fp16/bf16 inputs with fp32 accumulation; plain fp32,
 *   no TF32, for fp32 storage). Scores differ from the CPU's by fp32
 *   accumulation rounding, so facts whose scores are that close may come back
 *   in another order.
 * A score that overflows fp32 is +-infinity; one that is NaN (an infinite
 * sum of opposite signs, only possible with huge fp32 or bf16 values) ranks
 * as -infinity.
 *
 * Order. Results are sorted by score, highest first; equal scores by fact
 * id, smallest first. A tenant with fewer than k facts returns all of them.
 *
 * Tensor-parallel stores (kvinject/comm.h). On a store created with
 * KVI_EMBEDDINGS_SHARDED the call is collective: every rank of the
 * communicator calls it with the same queries' tenants, num_queries and k
 * (equal counts are required, as for any NCCL collective; the tenants and k
 * are checked). Each rank scores the embeddings it keeps, the candidates are
 * exchanged with one all-gather, and every rank gets the same merged results:
 * those of one store holding every embedding (tested bit for bit on CPU
 * stores). A rank that fails its part, or ranks that disagree, give host
 * outputs KVI_ERR_PEER or KVI_ERR_MISMATCH; with device outputs the call
 * cannot report it and writes every count as -1 (a rank failed) or -2 (the
 * ranks disagree), ids KVI_SEARCH_NO_ID and scores -INFINITY. With replicated
 * embeddings (the default) the call is rank-local, as on any store.
 *
 * Isolation and freshness. A query scores only its own tenant's facts. A
 * search sees every put and remove that returned before it was called; on a
 * CUDA store, changes made after it was called wait, on the device, for it
 * to finish (so a search already enqueued is not disturbed by a later
 * remove).
 */
#ifndef KVINJECT_SEARCH_H
#define KVINJECT_SEARCH_H

#include "kvinject/common.h"
#include "kvinject/store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The largest k a search accepts. */
#define KVI_SEARCH_MAX_K 1024

/* out_ids entries past a query's count hold KVI_SEARCH_NO_ID, and the
 * matching out_scores entries -INFINITY. */
#define KVI_SEARCH_NO_ID UINT64_MAX

typedef struct kvi_search_options {
  size_t struct_size;       /* sizeof(kvi_search_options) */
  kvi_dtype query_dtype;    /* element type of `queries`: FP32 (default), FP16 or BF16 */
  kvi_memory query_memory;  /* where `queries` is: KVI_MEMORY_HOST (default) or DEVICE */
  kvi_memory out_memory;    /* where out_ids, out_scores and out_counts are:
                               KVI_MEMORY_HOST (default) or DEVICE */
  uint64_t workspace_bytes; /* CUDA store: bound on the device memory for the
                               score tiles and their top-k candidates, >= 1 MiB,
                               default 64 MiB (KVI_SEARCH_DEFAULT_WORKSPACE).
                               A larger tenant or batch is searched in tiles.
                               Ignored by a CPU store. */
} kvi_search_options;

#define KVI_SEARCH_DEFAULT_WORKSPACE (64ull << 20)

#define KVI_SEARCH_OPTIONS_INIT \
  {sizeof(kvi_search_options), KVI_DTYPE_FP32, KVI_MEMORY_HOST, KVI_MEMORY_HOST, KVI_SEARCH_DEFAULT_WORKSPACE}

/* Fills *opts with KVI_SEARCH_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_search_options_init(kvi_search_options *opts, size_t size);

/*
 * Top-k facts of each query's tenant.
 *
 * queries:    num_queries x dim elements of opts->query_dtype, row-major
 *             (query i at queries + i * dim), in opts->query_memory. Every
 *             element must be finite, and stay finite once scaled and rounded
 *             to the store's embedding_dtype (e.g. |x| < 65520 for fp16).
 * num_queries: >= 0. With 0, opts, dim and k are checked as for any call
 *             (and a store without embeddings is refused); then the call
 *             returns KVI_OK having read and written nothing: queries,
 *             tenants and the outputs may be NULL, stream is not used.
 * dim:        must equal the store's embedding_dim (a check that the caller's
 *             embedding model matches the store's).
 * tenants:    host memory, num_queries tenant ids: query i searches tenant
 *             tenants[i]. Queries may name the same or different tenants. A
 *             tenant with no facts (or never seen) gives count 0; that is not
 *             an error.
 * k:          1..KVI_SEARCH_MAX_K results per query.
 * out_ids:    num_queries x k fact ids: row i holds query i's results.
 * out_scores: num_queries x k scores, matching out_ids.
 * out_counts: num_queries counts: query i has min(k, facts of its tenant)
 *             results; the rest of its row holds KVI_SEARCH_NO_ID and
 *             -INFINITY.
 *             The three outputs are in opts->out_memory and belong to the
 *             caller; the library writes them and keeps no reference.
 * opts:       host memory, or NULL for KVI_SEARCH_OPTIONS_INIT.
 * stream:     CUDA store: the stream the search is enqueued on.
 *
 * CPU store: queries and outputs must be host memory; the results are
 * written before the call returns.
 *
 * CUDA store: the work is enqueued on `stream` and the call returns without
 * waiting for it when the outputs are device memory: the caller reads them
 * after `stream` has passed the search, and keeps device queries valid and
 * unchanged until then. Host queries are copied before the call returns (the
 * buffer may be reused at once). Host outputs make the call wait for its own
 * work on `stream` before it returns with the results written.
 * Device queries are checked for NaN and infinity on the device, not before
 * the call returns: such a query gets count 0 (and KVI_SEARCH_NO_ID /
 * -INFINITY in its row), and is counted by kvi_store_async_errors.
 * Searches on one store share its device workspace and run one after another
 * on the device, whatever their streams; the host waits only when the
 * store's small ring of pinned staging buffers is still in use by earlier
 * calls (it never waits for the search it is enqueuing, except for host
 * outputs). Needs a build with cuBLASLt and libcublasLt.so.N loadable
 * (kvi_features(); the first search on a CUDA store opens it).
 *
 * Thread rules: as every store function (see kvinject/store.h).
 *
 * Errors (nothing is written on an error):
 * KVI_ERR_INVALID_ARGUMENT: store, queries (when num_queries > 0), tenants or
 *   an output is NULL; num_queries < 0; k outside 1..KVI_SEARCH_MAX_K; the
 *   store keeps no embeddings; an options field that is no valid value
 *   (query_dtype other than FP32/FP16/BF16, a memory kind, workspace_bytes
 *   < 1 MiB); a host query element that is NaN, infinite or too large for the
 *   store's embedding_dtype (kvi_last_error names it: "queries[3][17] is nan").
 * KVI_ERR_MISMATCH: dim differs from the store's embedding_dim.
 * KVI_ERR_STRUCT_SIZE: opts.
 * KVI_ERR_MEMORY_KIND: device memory given to a CPU store; a pointer whose
 *   declared kind is wrong, where the driver can tell; memory of another
 *   device.
 * KVI_ERR_NOT_BUILT: a CUDA store in a library built without cuBLASLt, or
 *   where libcublasLt does not load (kvi_last_error names it).
 * KVI_ERR_OUT_OF_MEMORY: host or device memory for the workspace.
 * KVI_ERR_CUDA: a CUDA or cuBLASLt call failed (kvi_last_error names it),
 *   including an earlier failure to update the store's device embeddings,
 *   which every later search reports.
 */
KVI_API kvi_status kvi_store_search(kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                                    const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                                    int32_t *out_counts, const kvi_search_options *opts,
                                    struct CUstream_st *stream);

/*
 * The store's asynchronous errors ("Asynchronous errors" in
 * kvinject/common.h):
 * - Latched: a change to a CUDA store's device embeddings that failed to
 *   enqueue (a dead context, in practice); every later search also fails
 *   with it.
 * - Counted: device queries that searches on this store (kvi_store_search,
 *   kvi_retrieve_inject) found to contain NaN or infinity, each answered
 *   with count 0. Always 0 for a CPU store, which rejects such queries when
 *   called.
 * Threads: thread-safe (it takes the store's lock).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store).
 */
KVI_API kvi_status kvi_store_async_errors(kvi_store *store, int64_t *out_count);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_SEARCH_H */
