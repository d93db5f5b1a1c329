/*
 * libkvinject — the persist part (format.c, file.c, snapshot.c, journal.c,
 * load.c, disk.c, sharing persist/internal.h): snapshot files, the journal and the
 * loader of kvinject/persist.h. lib/api/persist.c holds the entry
 * points; these are their internal twins: the same parameters, plus the
 * public name for messages.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_PERSIST_H
#define KVI_PERSIST_H

#include "base/base.h"
#include "kvinject/persist.h"

/* The first versions of the options structs (kvi__init_struct, kvi__read_struct). */
#define KVI__SAVE_OPTIONS_V1 sizeof(kvi_save_options)
#define KVI__LOAD_OPTIONS_V1 sizeof(kvi_load_options)

/* kvi_store_save; runs on the store's device. */
kvi_status kvi__store_save(const kvi_store *store, const char *path, const kvi_save_options *opts, const char *fn);
/* kvi_store_journal_open; runs on the store's device. */
kvi_status kvi__store_journal_open(kvi_store *store, const char *path, uint32_t flags, const char *fn);
/* kvi_store_journal_close (no device work). */
kvi_status kvi__store_journal_close(kvi_store *store, const char *fn);
/* kvi_store_load; runs on the device of the store it creates
 * (kvi__shard_store_device of opts). */
kvi_status kvi__store_load(kvi_store **out, const kvi_model *model, const kvi_store_options *opts, const char *path,
                           const kvi_load_options *load_opts, const char *fn);

/* The disk tier (disk.c): gives a store just created (not shared yet) the
 * disk tier its options ask for (opts->disk_dir; none: nothing done),
 * checking the directory. */
kvi_status kvi__disk_attach(kvi_store *s, const kvi_store_options *opts, const char *fn);
/* kvi_store_tenant_release (no device work). */
kvi_status kvi__store_tenant_release(kvi_store *store, uint64_t tenant, const char *fn);

#endif /* KVI_PERSIST_H */
