/*
 * Entry points of the persist part: snapshot files, the journal and loading
 * (kvinject/persist.h).
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"
#include "persist/persist.h"
#include "store/store.h"
#include "tp/tp.h"

KVI_API kvi_status kvi_save_options_init(kvi_save_options *opts, size_t size) {
  static const kvi_save_options d = KVI_SAVE_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__SAVE_OPTIONS_V1, "kvi_save_options_init");
}

KVI_API kvi_status kvi_load_options_init(kvi_load_options *opts, size_t size) {
  static const kvi_load_options d = KVI_LOAD_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__LOAD_OPTIONS_V1, "kvi_load_options_init");
}

KVI_API kvi_status kvi_store_save(const kvi_store *store, const char *path, const kvi_save_options *opts) {
  static const char fn[] = "kvi_store_save";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_save(store, path, opts, fn));
  return st;
}

KVI_API kvi_status kvi_store_journal_open(kvi_store *store, const char *path, uint32_t flags) {
  static const char fn[] = "kvi_store_journal_open";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__store_journal_open(store, path, flags, fn));
  return st;
}

/* Closing a journal closes a file: no device is made current. */
KVI_API kvi_status kvi_store_journal_close(kvi_store *store) {
  return kvi__store_journal_close(store, "kvi_store_journal_close");
}

/* The new store's device comes from its options, as kvi_store_create's. */
KVI_API kvi_status kvi_store_load(kvi_store **out, const kvi_model *model, const kvi_store_options *opts,
                                  const char *path, const kvi_load_options *load_opts) {
  static const char fn[] = "kvi_store_load";
  kvi_status st;
  KVI__API_ON(st, kvi__shard_store_device(opts, fn), fn, kvi__store_load(out, model, opts, path, load_opts, fn));
  return st;
}

/* Giving up a lease writes a small file: no device is made current. */
KVI_API kvi_status kvi_store_tenant_release(kvi_store *store, uint64_t tenant) {
  return kvi__store_tenant_release(store, tenant, "kvi_store_tenant_release");
}
