/*
 * Retrieval: the top-k facts of each query's tenant, by the inner product of
 * the query with the tenant's embedding matrix (see kvinject/search.h).
 * SPDX-License-Identifier: Apache-2.0
 *
 * This file checks the arguments and dispatches: to the CPU reference
 * (search_cpu.c) or to the CUDA search, planned on the host (search_plan.c)
 * and enqueued on the caller's stream (search_cuda.c); search_impl.h is
 * what they share.
 */
#include <math.h>
#include <string.h>

#include "search/search_impl.h"

#define MIN_WORKSPACE (1u << 20)

/* ------------------------------------------------------------------------ */
/* argument checks                                                          */
/* ------------------------------------------------------------------------ */

/* Host queries: every element finite and, scaled and rounded, still finite.
 * Scaling (cosine) cannot make a value larger than 1; rounding to a narrower
 * range overflows exactly above a threshold on the fp32 value. */
static kvi_status check_host_queries(const kvi_store *s, const void *q, kvi_dtype t, int32_t nq, int32_t dim,
                                     const char *fn) {
  uint32_t limit = 0x7f800000u; /* |x| below: finite */
  if (s->emb.metric == KVI_METRIC_INNER_PRODUCT && t != KVI_DTYPE_FP16) {
    if (s->emb.dtype == KVI_DTYPE_FP16) limit = 0x477ff000u; /* 65520 rounds to fp16 infinity */
    if (s->emb.dtype == KVI_DTYPE_BF16 && t == KVI_DTYPE_FP32) limit = 0x7f7f8000u; /* rounds to bf16 infinity */
  }
  const int64_t n = (int64_t)nq * dim;
  for (int64_t i = 0; i < n; i++) {
    uint32_t u;
    if (t == KVI_DTYPE_FP32) memcpy(&u, (const char *)q + i * 4, 4);
    else if (t == KVI_DTYPE_BF16) u = (uint32_t)((const uint16_t *)q)[i] << 16;
    else u = (((const uint16_t *)q)[i] & 0x7c00u) == 0x7c00u ? 0x7f800000u : 0; /* fp16: only inf/NaN */
    if ((u & 0x7fffffffu) >= limit) {
      const float x = kvi__load(q, t, i);
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "queries[%lld][%lld] is %g; %s", (long long)(i / dim),
                       (long long)(i % dim), (double)x,
                       isfinite(x) ? (s->emb.dtype == KVI_DTYPE_FP16 ? "too large for the store's fp16 embeddings"
                                                                     : "too large for the store's bf16 embeddings")
                                   : "queries must be finite");
    }
  }
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* the entry point                                                          */
/* ------------------------------------------------------------------------ */

kvi_status kvi__search_check(const kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                             const uint64_t *tenants, int32_t k, const kvi_search_options *o, const char *fn) {
  if (!kvi__dtype_is_float(o->query_dtype))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->query_dtype is %d, expected KVI_DTYPE_FP32, FP16 or BF16",
                     (int)o->query_dtype);
  if (o->query_memory != KVI_MEMORY_HOST && o->query_memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->query_memory is %d, expected KVI_MEMORY_HOST or DEVICE",
                     (int)o->query_memory);
  if (o->out_memory != KVI_MEMORY_HOST && o->out_memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->out_memory is %d, expected KVI_MEMORY_HOST or DEVICE",
                     (int)o->out_memory);
  if (o->workspace_bytes < MIN_WORKSPACE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->workspace_bytes is %llu, expected at least %u (1 MiB)",
                     (unsigned long long)o->workspace_bytes, MIN_WORKSPACE);
  if (num_queries < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_queries is %d", (int)num_queries);
  if (store->emb_dim == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store keeps no embeddings (created with embedding_dim 0)");
  if (dim != store->emb_dim)
    return kvi__fail(KVI_ERR_MISMATCH, fn, "dim is %d, the store's embeddings have %d elements", (int)dim,
                     (int)store->emb_dim);
  if (k < 1 || k > KVI_SEARCH_MAX_K)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "k is %d, expected 1..%d", (int)k, KVI_SEARCH_MAX_K);
  if (num_queries == 0) return KVI_OK;
  if (!queries || !tenants)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !queries ? "queries" : "tenants");
  const bool cuda = store->backend == KVI_BACKEND_CUDA;
  kvi_status st;
  if ((st = kvi__check_memory(queries, o->query_memory, cuda, store->device, fn, "queries")) ||
      (st = kvi__check_memory(tenants, KVI_MEMORY_HOST, cuda, store->device, fn, "tenants")))
    return st;
  if (o->query_memory == KVI_MEMORY_HOST && (st = check_host_queries(store, queries, o->query_dtype, num_queries, dim, fn)))
    return st;
  return KVI_OK;
}

kvi_status kvi__store_search(kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, const kvi_search_options *opts, struct CUstream_st *stream,
                             const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__SEARCH_OPTIONS_V1, fn, "opts"))) return st;
  if (num_queries > 0 && (!out_ids || !out_scores || !out_counts))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL",
                     !out_ids ? "out_ids" : !out_scores ? "out_scores" : "out_counts");
  if ((st = kvi__search_check(store, queries, num_queries, dim, tenants, k, &o, fn)) || num_queries == 0) return st;
  const bool cuda = store->backend == KVI_BACKEND_CUDA;
  if ((st = kvi__check_memory(out_ids, o.out_memory, cuda, store->device, fn, "out_ids")) ||
      (st = kvi__check_memory(out_scores, o.out_memory, cuda, store->device, fn, "out_scores")) ||
      (st = kvi__check_memory(out_counts, o.out_memory, cuda, store->device, fn, "out_counts")))
    return st;
  return kvi__search_all(store, queries, o.query_dtype, o.query_memory, num_queries, tenants, k, out_ids, out_scores,
                         out_counts, o.out_memory, o.workspace_bytes, false, stream, fn);
}

kvi_status kvi__search_all(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                           const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                           int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked, struct CUstream_st *stream,
                           const char *fn) {
  return (s->search.collective ? s->search.collective : kvi__search_local)(
      s, queries, qt, qm, nq, tenants, k, out_ids, out_scores, out_counts, om, ws, locked, stream, fn);
}

kvi_status kvi__search_local(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn) {
  if (s->backend != KVI_BACKEND_CUDA)
    return kvi__search_cpu(s, queries, qt, nq, tenants, k, out_ids, out_scores, out_counts, locked, fn);
  return kvi__search_cuda(s, queries, qt, qm, nq, tenants, k, out_ids, out_scores, out_counts, NULL, om, ws, NULL,
                          locked, stream, fn);
}

kvi_status kvi__search_then_run(kvi_store *s, const void *queries, const kvi_search_options *o, int32_t nq,
                                const uint64_t *tenants, int32_t k, uint64_t *out_ids, int32_t *out_counts,
                                int32_t *out_tokens, const kvi__search_then *then, struct CUstream_st *stream,
                                const char *fn) {
  return kvi__search_cuda(s, queries, o->query_dtype, o->query_memory, nq, tenants, k, out_ids, NULL, out_counts,
                          out_tokens, o->out_memory, o->workspace_bytes, then, false, stream, fn);
}
