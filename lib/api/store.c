/*
 * Entry points of the store part (kvinject/store.h, and
 * kvi_store_embedding_rank of kvinject/comm.h); kvi_store_create is the tp
 * part's (lib/api/tp.c). Calls that may touch the store's device make it
 * current first; count, list, stats, fact_tier, fact_tokens, fact_token_ids, fact_context and stale read host state only
 * and enter no device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"
#include "store/store.h"

KVI_API kvi_status kvi_store_options_init(kvi_store_options *opts, size_t size) {
  static const kvi_store_options d = KVI_STORE_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__STORE_OPTIONS_V1, "kvi_store_options_init");
}

KVI_API kvi_status kvi_put_options_init(kvi_put_options *opts, size_t size) {
  static const kvi_put_options d = KVI_PUT_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__PUT_OPTIONS_V1, "kvi_put_options_init");
}

KVI_API void kvi_store_destroy(kvi_store *store) {
  if (!store) return;
  bool ok;
  KVI__API_DESTROY(kvi__store_device(store), "kvi_store_destroy", ok, kvi__store_destroy(store, ok));
}

KVI_API kvi_status kvi_store_prefetch(kvi_store *store, uint64_t tenant_id, const uint64_t *fact_ids, int32_t count,
                                      struct CUstream_st *stream) {
  static const char fn[] = "kvi_store_prefetch";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_prefetch(store, tenant_id, fact_ids, count, stream, fn));
  return st;
}

KVI_API kvi_status kvi_store_prefetch_wait(kvi_store *store) {
  static const char fn[] = "kvi_store_prefetch_wait";
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__disk_wait(store, fn));
  return st;
}

KVI_API kvi_status kvi_store_put(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *kv,
                                 const kvi_put_options *opts, struct CUstream_st *stream) {
  static const char fn[] = "kvi_store_put";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_put(store, tenant_id, fact_id, kv, opts, stream, fn));
  return st;
}

KVI_API kvi_status kvi_store_remove(kvi_store *store, uint64_t tenant_id, uint64_t fact_id) {
  static const char fn[] = "kvi_store_remove";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_remove(store, tenant_id, fact_id, 0, fn));
  return st;
}

KVI_EXPERIMENTAL kvi_status kvi_store_remove_ex(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, uint32_t flags) {
  static const char fn[] = "kvi_store_remove_ex";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_remove(store, tenant_id, fact_id, flags, fn));
  return st;
}

KVI_EXPERIMENTAL kvi_status kvi_store_fact_context(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id,
                                                   uint64_t *out_ids, int32_t capacity, int32_t *out_num,
                                                   int32_t *out_stale) {
  return kvi__store_fact_context(store, tenant_id, fact_id, out_ids, capacity, out_num, out_stale,
                                 "kvi_store_fact_context");
}

KVI_EXPERIMENTAL kvi_status kvi_store_stale(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                                            size_t *out_total) {
  return kvi__store_stale(store, tenant_id, ids, capacity, out_total, "kvi_store_stale");
}

KVI_API kvi_status kvi_store_read(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *dst,
                                  struct CUstream_st *stream) {
  static const char fn[] = "kvi_store_read";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_read(store, tenant_id, fact_id, dst, stream, fn));
  return st;
}

KVI_API kvi_status kvi_store_fact_tokens(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id,
                                         int32_t *out_tokens) {
  return kvi__store_fact_tokens(store, tenant_id, fact_id, out_tokens, "kvi_store_fact_tokens");
}

KVI_EXPERIMENTAL kvi_status kvi_store_fact_token_ids(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id,
                                                     int32_t *out_ids, int32_t capacity, int32_t *out_num,
                                                     uint64_t *out_hash) {
  return kvi__store_fact_token_ids(store, tenant_id, fact_id, out_ids, capacity, out_num, out_hash,
                                   "kvi_store_fact_token_ids");
}

KVI_API kvi_status kvi_store_get_embedding(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, float *out) {
  static const char fn[] = "kvi_store_get_embedding";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_get_embedding(store, tenant_id, fact_id, out, fn));
  return st;
}

KVI_API kvi_status kvi_store_count(const kvi_store *store, uint64_t tenant_id, size_t *out_count) {
  return kvi__store_count(store, tenant_id, out_count, "kvi_store_count");
}

KVI_API kvi_status kvi_store_list(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                                  size_t *out_total) {
  return kvi__store_list(store, tenant_id, ids, capacity, out_total, "kvi_store_list");
}

KVI_API kvi_status kvi_store_list_on_disk(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                                          size_t *out_total) {
  return kvi__store_list_on_disk(store, tenant_id, ids, capacity, out_total, "kvi_store_list_on_disk");
}

KVI_API kvi_status kvi_store_stats_get(const kvi_store *store, kvi_store_stats *out) {
  return kvi__store_stats_get(store, out, "kvi_store_stats_get");
}

KVI_API int32_t kvi_store_embedding_rank(uint64_t tenant, uint64_t fact_id, int32_t tp_size) {
  return kvi__store_embedding_rank(tenant, fact_id, tp_size);
}

KVI_API kvi_status kvi_store_fact_tier(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, int32_t *out_tier) {
  return kvi__store_fact_tier(store, tenant_id, fact_id, out_tier, "kvi_store_fact_tier");
}

KVI_API kvi_status kvi_store_disk_changes(kvi_store *store, uint64_t *tenants, size_t capacity, size_t *count) {
  return kvi__store_disk_changes(store, tenants, capacity, count, "kvi_store_disk_changes");
}
