/*
 * libkvinject — the search part (lib/search/): what its files offer the
 * parts above it (the searches and checks kvi_retrieve_inject and the tp part
 * use), and the plan of a CUDA search, built on the host: tiles of the score
 * area, scan blocks, the top-k selections of each round and the final emits
 * (the kernels' view of them is in gpu/kernels.h).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_SEARCH_H
#define KVI_SEARCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/kernels.h"
#include "store/store.h"

/* The first version of kvi_search_options (read by search.c and xfer/retrieve.c). */
#define KVI__SEARCH_OPTIONS_V1 sizeof(kvi_search_options)

/* kvi_store_async_errors (no device work): the searches' bad queries and the
 * store's latched embedding failure */
kvi_status kvi__store_async_errors(kvi_store *store, int64_t *out_count, const char *fn);

/* kvi_store_search, its device made current by the caller; fn names the
 * public function in messages */
kvi_status kvi__store_search(kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, const kvi_search_options *opts, struct CUstream_st *stream,
                             const char *fn);

/* kvi_store_search on this rank's embeddings only (arguments
 * already checked). locked: the caller holds the store's lock (for the
 * whole call: host outputs of a CUDA store are then waited for under it). */
kvi_status kvi__search_local(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn);

/* kvi_store_search's search after its checks (kvi_retrieve_inject's on the
 * host too): the collective search the tp part registered on a store with
 * sharded embeddings (s->search.collective), else kvi__search_local.
 * Arguments as kvi__search_local's. */
kvi_status kvi__search_all(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                           const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                           int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked, struct CUstream_st *stream,
                           const char *fn);

/* kvi_store_search's checks of everything but its outputs (opts
 * already read into *o). */
kvi_status kvi__search_check(const kvi_store *s, const void *queries, int32_t nq, int32_t dim, const uint64_t *tenants,
                             int32_t k, const kvi_search_options *o, const char *fn);

/* The device search of kvi_retrieve_inject (a CUDA store without
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

typedef struct kvi__ptile {
  kvi__stile d;        /* as uploaded */
  const uint64_t *ids; /* fact id of the tile's row 0 (device) */
  int32_t row0;        /* the tenant row of the tile's row 0 */
  int32_t seg;         /* scores per stage-1 selection */
  bool gemm;
} kvi__ptile;

typedef struct kvi__pround {
  size_t t0, t1, b0, b1, s0, s1, s2; /* tiles, scan blocks, stage-1 sels, stage-2 sels */
  int32_t qmax;                      /* largest qn of its scan tiles */
} kvi__pround;

typedef struct kvi__search_plan {
  int32_t *perm; /* slot -> query */
  kvi__emit *emits; /* nemits of them */
  size_t nemits;
  kvi__ptile *tiles;
  size_t ntiles, ctiles;
  kvi__sblock *blocks;
  size_t nblocks, cblocks;
  kvi__sel *sels;
  size_t nsels, csels;
  kvi__pround *rounds;
  size_t nrounds, crounds;
  size_t score_floats; /* the largest round's */
  size_t cand_pairs;   /* the largest round's stage-1 outputs */
  bool any_gemm;
} kvi__search_plan;

/* Cuts a search of nq queries (tenants[i]: query i's tenant) for the top k
 * into tiles and rounds whose scores and candidates fit `area` bytes (a
 * round of one tile may exceed it), for a device of `sms` multiprocessors.
 * Pure host code: reads the store's tenants (its lock held) and computes
 * device addresses from their matrices without touching them. On failure
 * (KVI_ERR_OUT_OF_MEMORY) *p is left empty. */
kvi_status kvi__search_plan_build(const kvi_store *s, kvi__search_plan *p, const uint64_t *tenants, int32_t nq,
                                  int32_t k, uint64_t area, int sms, const char *fn);
/* Frees a plan's arrays and empties it (freeing an empty plan again is a no-op). */
void kvi__search_plan_free(kvi__search_plan *p);

#endif /* KVI_SEARCH_H */
