/*
 * Entry points of the tp part: communicators and the collective store calls
 * over them (kvinject/comm.h), kvi_store_create included (a store with a
 * communicator is made by the ranks together).
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"
#include "persist/persist.h"
#include "store/store.h"
#include "tp/tp.h"

KVI_API kvi_status kvi_comm_group_create(kvi_comm_group **out, int32_t size) {
  return kvi__comm_group_create(out, size, "kvi_comm_group_create");
}

KVI_API void kvi_comm_group_destroy(kvi_comm_group *group) { kvi__comm_group_destroy(group); }

KVI_API kvi_status kvi_comm_create_local(kvi_comm **out, kvi_comm_group *group, int32_t rank) {
  return kvi__comm_create_local(out, group, rank, "kvi_comm_create_local");
}

KVI_API kvi_status kvi_comm_create_nccl(kvi_comm **out, struct ncclComm *nccl) {
  static const char fn[] = "kvi_comm_create_nccl";
  int device;
  kvi_status st = kvi__comm_nccl_device(out, nccl, &device, fn); /* its checks, and the device */
  if (st == KVI_OK) KVI__API_ON(st, device, fn, kvi__comm_create_nccl(out, nccl, fn));
  return st;
}

KVI_API void kvi_comm_destroy(kvi_comm *comm) {
  if (!comm) return;
  bool ok;
  KVI__API_DESTROY(kvi__comm_device(comm), "kvi_comm_destroy", ok, kvi__comm_destroy(comm, ok));
}

KVI_API kvi_status kvi_comm_rank(const kvi_comm *comm, int32_t *out_rank, int32_t *out_size) {
  return kvi__comm_rank(comm, out_rank, out_size, "kvi_comm_rank");
}

/* The NCCL query is a host call: no device is made current. */
KVI_API kvi_status kvi_comm_async_errors(kvi_comm *comm, int64_t *out_count) {
  return kvi__comm_async_errors(comm, out_count, "kvi_comm_async_errors");
}

/* The store of kvi_store_create, then its disk tier (opts->disk_dir): *out
 * is written only once both are made. */
static kvi_status store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  kvi_store *s = NULL;
  kvi_status st = kvi__shard_store_create(&s, model, opts, fn);
  if (st) return st;
  if ((st = kvi__disk_attach(s, opts, fn))) {
    kvi__store_destroy(s, true);
    return st;
  }
  *out = s;
  return KVI_OK;
}

KVI_API kvi_status kvi_store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts) {
  static const char fn[] = "kvi_store_create";
  kvi_status st;
  KVI__API_ON(st, kvi__shard_store_device(opts, fn), fn, store_create(out, model, opts, fn));
  return st;
}

KVI_API kvi_status kvi_store_put_scatter(kvi_store *store, int32_t root, const kvi_scatter_item *items,
                                         int32_t num_items, struct CUstream_st *stream) {
  static const char fn[] = "kvi_store_put_scatter";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_put_scatter(store, root, items, num_items, stream, fn));
  return st;
}

KVI_API kvi_status kvi_store_gather(kvi_store *store, int32_t root, const kvi_gather_item *items, int32_t num_items,
                                    struct CUstream_st *stream) {
  static const char fn[] = "kvi_store_gather";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_gather(store, root, items, num_items, stream, fn));
  return st;
}

KVI_API kvi_status kvi_store_check_agreement(kvi_store *store) {
  static const char fn[] = "kvi_store_check_agreement";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_check_agreement(store, fn));
  return st;
}
