/*
 * libkvinject — the search part's private header: what the files of
 * lib/search/ share among themselves (search.c: the checks and entry points;
 * search_cpu.c: the CPU reference; search_plan.c and search_cuda.c: the CUDA
 * search's plan and execution). The parts above include search/search.h only.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_SEARCH_IMPL_H
#define KVI_SEARCH_IMPL_H

#include "search/search.h"

/* The plan's types are in search/search.h (tests/internal checks plans). */
typedef kvi__ptile ptile;
typedef kvi__pround pround;
typedef kvi__search_plan plan;

/* The search of a CPU store (arguments checked; kvi__search_local's). */
kvi_status kvi__search_cpu(kvi_store *s, const void *queries, kvi_dtype qt, int32_t nq, const uint64_t *tenants,
                           int32_t k, uint64_t *out_ids, float *out_scores, int32_t *out_counts, bool locked,
                           const char *fn);

/* The search of a CUDA store (arguments checked). then: kvi__search_then
 * (out_scores NULL, out_tokens a result), or NULL. locked: the caller holds
 * the store's lock, and keeps it while the call waits for host outputs. */
kvi_status kvi__search_cuda(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                            const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                            int32_t *out_counts, int32_t *out_tokens, kvi_memory om, uint64_t area,
                            const kvi__search_then *then, bool locked, struct CUstream_st *stream, const char *fn);

#endif /* KVI_SEARCH_IMPL_H */
