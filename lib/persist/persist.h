/*
 * libkvinject — what persist.c shares with the fuzz target, and the store's
 * reads for it.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_PERSIST_INTERNAL_H
#define KVI_PERSIST_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/base.h"

/* CRC32C (Castagnoli) of n bytes, continuing from crc (0 to start). */
uint32_t kvi__crc32c(uint32_t crc, const void *data, size_t n);

typedef struct kvi__journal kvi__journal;

/* The journal is the store's: persist.c registers its hooks on the store
 * (store_internal.h, kvi__journal_ops) when one is opened or loaded. */

#endif /* KVI_PERSIST_INTERNAL_H */
