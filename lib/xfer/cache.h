/*
 * libkvinject — a cache layout resolved for the transfer code.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_CACHE_INTERNAL_H
#define KVI_CACHE_INTERNAL_H

#include "gpu/gpu.h"

/* One plane's strides, in elements (defaults applied). */
typedef struct kvi__strides {
  int64_t block, token, head, dim;
} kvi__strides;

typedef struct kvi__cache {
  kvi_dtype dtype;
  kvi_memory memory;
  int32_t L, H, D, BS;
  int64_t NB;
  kvi__strides ks, vs;      /* K's and V's */
  char **k, **v;            /* per layer base addresses (bytes) */
  float *k_scale, *v_scale; /* L * H, 1.0 without scales */
} kvi__cache;

kvi_status kvi__cache_resolve(kvi__cache *c, const kvi_cache_layout *layout, const kvi__geom *g, bool cuda, int device,
                              const char *fn);
void kvi__cache_release(kvi__cache *c);

#endif /* KVI_CACHE_INTERNAL_H */
