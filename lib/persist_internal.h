/*
 * libkvinject — the journal hooks that store.c and transfer.c call, and the
 * pieces of persist.c shared with the fuzz target.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_PERSIST_INTERNAL_H
#define KVI_PERSIST_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* CRC32C (Castagnoli) of n bytes, continuing from crc (0 to start). */
uint32_t kvi__crc32c(uint32_t crc, const void *data, size_t n);

typedef struct kvi__journal kvi__journal;

/* One fact of a journaled change, before the store commits it: its data is
 * in `pages` already, its embedding (emb_dim fp32 values, or NULL) in emb. */
typedef struct kvi__jfact {
  uint64_t tenant, id;
  int32_t tokens;
  const uint32_t *pages;
  const float *emb;
} kvi__jfact;

/* Appends n facts as one all-or-nothing group and flushes the journal; the
 * caller holds the store's lock and commits only when this returns KVI_OK.
 * device_work: the pages were written by device work on `stream` (waited
 * for first). Fails with KVI_ERR_IO having changed nothing in the store. */
kvi_status kvi__journal_put(kvi_store *s, const kvi__jfact *facts, int32_t n, struct CUstream_st *stream,
                            bool device_work, const char *fn);

/* Appends the removal of (tenant, id), which the store holds; as above. */
kvi_status kvi__journal_remove(kvi_store *s, uint64_t tenant, uint64_t id, const char *fn);

/* Closes a journal (kvi_store_destroy). NULL is a no-op. */
void kvi__journal_free(kvi__journal *j);

/* ---- store.c, for persist.c (the caller holds the store's lock) ----------- */

struct fact;

/* Reads `tokens` tokens of K and V from `pages` into a host view. For an fp8
 * store, `host` has the store's dtype and receives the e4m3 bytes as they
 * are, and scales[ceil(tokens / P) * L * 2 * H] the pages' scales
 * ([page][layer][K, V][head]); else scales is NULL. */
kvi_status kvi__store_read_pages(const kvi_store *s, const uint32_t *pages, int32_t tokens, const kvi_kv_view *host,
                                 float *scales, const char *fn);

/* kvi_store_put of what kvi__store_read_pages gave for an fp8 store: the
 * bytes and scales are kept as they are (a store file loads bit for bit). */
kvi_status kvi__store_put_raw(kvi_store *s, uint64_t tenant, uint64_t id, const kvi_kv_view *host, const float *scales,
                              const kvi_put_options *opts, const char *fn);

/* A stored fact's embedding as emb_dim fp32 values. */
kvi_status kvi__store_fact_embedding(const kvi_store *s, const struct fact *f, float *out, const char *fn);

/* Waits for every device operation the store tracks (puts from device
 * memory, encodes, injections, reads into device memory). */
kvi_status kvi__store_wait_device(kvi_store *s, const char *fn);

#endif /* KVI_PERSIST_INTERNAL_H */
