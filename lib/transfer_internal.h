/*
 * libkvinject — the injector's host planning that tests/internal reaches
 * (transfer.c).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_TRANSFER_INTERNAL_H
#define KVI_TRANSFER_INTERNAL_H

#include <stdint.h>

#include "cache_internal.h"
#include "kvinject/inject.h"
#include "store_internal.h"

/* The transfer kernel's layers per CTA (kvi__xfer_args.layers_per_cta) for
 * a launch of nsegs >= 1 segments over nl >= 1 layers on a device of `sms`
 * multiprocessors (<= 0: unknown, taken as 132): enough (segment, layer)
 * pairs per CTA to amortize its prologue, while leaving about 128 CTAs per
 * SM so the tail stays short; the nl layers are cut into
 * ceil(nl / result) chunks of nearly equal size. In 1..nl. */
int32_t kvi__layers_per_cta(int32_t sms, int32_t nsegs, int32_t nl);

/* The per-layer tables a CUDA injector uploads once, laid out in one buffer:
 * kvi__xlayer[L] at offset 0 (each layer's cache bases, RoPE style, rotated
 * width, attention factor, rope_id: the first layer whose rotation is the
 * same, and device addresses of its frequencies or table), the cache's K
 * scales [L][H] at *o_k, V scales at *o_v, then every formula layer's
 * rotary_dim/2 frequencies and every distinct engine cos/sin table (a table
 * that layers share is laid out once); all 16-byte aligned. host: the
 * buffer to fill (the returned size), or NULL for the size and offsets
 * only; dev: the device address it will be copied to (the layers' pointers
 * are computed from it, never dereferenced). Pure host code. */
size_t kvi__layer_tables(const kvi_store *s, const kvi__cache *c, char *host, char *dev, size_t *o_k, size_t *o_v);

/* What an injector chose when it was created (these never change): the
 * transfer kernel's vector width (kvi__xfer_args.vec: 16 for fp8 stores
 * whose layout allows 16-byte page loads, 8 where every cache row start is
 * aligned for 8-element vectors, else 1), its longest segment (tokens) and
 * the largest rotary_dim / 2 over the layers. */
int32_t kvi__injector_vec(const kvi_injector *injector);
int32_t kvi__injector_seg_tokens(const kvi_injector *injector);
int32_t kvi__injector_half_max(const kvi_injector *injector);

#endif
