/*
 * Entry points of the search part (kvinject/search.h). A search makes its
 * store's device current first; kvi_store_async_errors reads host
 * state only and enters no device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"
#include "search/search.h"

KVI_API kvi_status kvi_search_options_init(kvi_search_options *opts, size_t size) {
  static const kvi_search_options d = KVI_SEARCH_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__SEARCH_OPTIONS_V1, "kvi_search_options_init");
}

KVI_API kvi_status kvi_store_async_errors(kvi_store *store, int64_t *out_count) {
  return kvi__store_async_errors(store, out_count, "kvi_store_async_errors");
}

KVI_API kvi_status kvi_store_search(kvi_store *store, const void *queries, int32_t num_queries, int32_t dim,
                                    const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                                    int32_t *out_counts, const kvi_search_options *opts, struct CUstream_st *stream) {
  static const char fn[] = "kvi_store_search";
  if (!store)
    return kvi__store_search(store, queries, num_queries, dim, tenants, k, out_ids, out_scores, out_counts, opts,
                             stream, fn);
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn,
              kvi__store_search(store, queries, num_queries, dim, tenants, k, out_ids, out_scores, out_counts, opts,
                                stream, fn));
  return st;
}
