/*
 * Cache layouts: engine presets, validation, and the resolved form the
 * transfer code uses.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cache_internal.h"

#define CACHE_LAYOUT_V1 sizeof(kvi_cache_layout)

KVI_API kvi_status kvi_cache_layout_init(kvi_cache_layout *layout, size_t size) {
  static const kvi_cache_layout d = KVI_CACHE_LAYOUT_INIT;
  return kvi__init_struct(layout, size, &d, sizeof d, CACHE_LAYOUT_V1, "kvi_cache_layout_init");
}

KVI_API kvi_status kvi_cache_layout_preset(kvi_cache_layout *out, kvi_cache_preset preset, kvi_dtype dtype,
                                           int32_t num_layers, int32_t num_heads, int32_t head_size,
                                           int32_t block_size, int64_t num_blocks, void *const *k_layers,
                                           void *const *v_layers, void *base) {
  static const char fn[] = "kvi_cache_layout_preset";
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  if (num_layers < 1 || num_heads < 1 || head_size < 1 || block_size < 1 || num_blocks < 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "sizes must be >= 1 (layers %d, heads %d, head_size %d, block_size %d, blocks %lld)",
                     (int)num_layers, (int)num_heads, (int)head_size, (int)block_size, (long long)num_blocks);
  const int64_t H = num_heads, D = head_size, BS = block_size, NB = num_blocks, L = num_layers;
  kvi_cache_layout l = KVI_CACHE_LAYOUT_INIT;
  l.dtype = dtype;
  l.num_layers = num_layers;
  l.num_heads = num_heads;
  l.head_size = head_size;
  l.block_size = block_size;
  l.num_blocks = num_blocks;
  l.k_layers = k_layers;
  bool per_layer = true, separate_v = false;
  switch (preset) {
  case KVI_CACHE_VLLM_FLASH_ATTN: /* [2, NB, BS, H, D] */
    l.block_stride = BS * H * D, l.token_stride = H * D, l.head_stride = D, l.v_offset = NB * BS * H * D;
    break;
  case KVI_CACHE_VLLM_FLASH_ATTN_HND: /* [2, NB, H, BS, D] */
    l.block_stride = H * BS * D, l.token_stride = D, l.head_stride = BS * D, l.v_offset = NB * H * BS * D;
    break;
  case KVI_CACHE_VLLM_FLASHINFER: /* [NB, 2, BS, H, D] */
    l.block_stride = 2 * BS * H * D, l.token_stride = H * D, l.head_stride = D, l.v_offset = BS * H * D;
    break;
  case KVI_CACHE_VLLM_FLASHINFER_HND: /* [NB, 2, H, BS, D] */
    l.block_stride = 2 * H * BS * D, l.token_stride = D, l.head_stride = BS * D, l.v_offset = H * BS * D;
    break;
  case KVI_CACHE_VLLM_PACKED: /* [NB, BS, H, 2D] */
    l.block_stride = BS * H * 2 * D, l.token_stride = H * 2 * D, l.head_stride = 2 * D, l.v_offset = D;
    break;
  case KVI_CACHE_VLLM_PACKED_HND: /* [NB, H, BS, 2D] */
    l.block_stride = H * BS * 2 * D, l.token_stride = 2 * D, l.head_stride = BS * 2 * D, l.v_offset = D;
    break;
  case KVI_CACHE_SGLANG: /* k_buffer[l], v_buffer[l]: [slots, H, D] */
    l.block_stride = BS * H * D, l.token_stride = H * D, l.head_stride = D;
    separate_v = true;
    break;
  case KVI_CACHE_HF_CONTIGUOUS: /* key[l], value[l]: [batch, H, S, D] */
    l.block_stride = H * BS * D, l.token_stride = D, l.head_stride = BS * D;
    separate_v = true;
    break;
  case KVI_CACHE_TRTLLM: /* pool [NB, L, 2, H, BS, D] */
    per_layer = false;
    l.k_layers = NULL;
    l.k_base = base;
    l.layer_stride = 2 * H * BS * D;
    l.block_stride = L * 2 * H * BS * D, l.token_stride = D, l.head_stride = BS * D, l.v_offset = H * BS * D;
    break;
  default: return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "unknown preset %d", (int)preset);
  }
  if (per_layer && !k_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "preset %d takes one pointer per layer in k_layers", (int)preset);
  if (separate_v && !v_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "preset %d keeps V in separate tensors: pass v_layers", (int)preset);
  if (!per_layer && !base) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "preset %d takes the pool's base pointer", (int)preset);
  if (separate_v) l.v_layers = v_layers;
  l.struct_size = CACHE_LAYOUT_V1;
  memcpy(out, &l, CACHE_LAYOUT_V1); /* the first version only: never past an older caller's struct */
  return KVI_OK;
}

/* Refuses a layout in which two elements of one layer share an address:
 * blocks, tokens or heads of a plane overlapping (checked on K's and V's
 * dimensions, kd and vd, each of 4), or K overlapping V at their distance
 * in that layer (kb, vb; es bytes an element; ext the elements a plane
 * spans). K and V with the same dimensions may interleave (V as a fifth
 * dimension of extent 2 at their distance, as packed K|V caches do);
 * otherwise their byte ranges must be disjoint. */
static kvi_status check_overlap(const kvi__dim kd[4], const kvi__dim vd[4], const char *kb, const char *vb,
                                int64_t ext, size_t es, int32_t layer, const char *fn) {
  kvi__dim e[5];
  for (int plane = 0; plane < 2; plane++) {
    memcpy(e, plane ? vd : kd, 4 * sizeof e[0]);
    if (!kvi__dims_disjoint(e, 4))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "layout: the %s blocks, tokens or heads overlap (block_stride %lld, token_stride %lld, "
                       "head_stride %lld, head_size %lld): one cache element would be written twice",
                       plane ? "V" : "K", (long long)(plane ? vd : kd)[0].stride, (long long)(plane ? vd : kd)[1].stride,
                       (long long)(plane ? vd : kd)[2].stride, (long long)(plane ? vd : kd)[3].extent);
  }
  const intptr_t gap = vb - kb, agap = gap < 0 ? -gap : gap;
  const int64_t bytes = ext * (int64_t)es; /* fits: the extent check scaled it by 8 */
  bool disjoint;
  if (agap % (intptr_t)es == 0 && memcmp(kd, vd, 4 * sizeof kd[0]) == 0) {
    memcpy(e, kd, 4 * sizeof e[0]);
    e[4].extent = 2, e[4].stride = (int64_t)(agap / (intptr_t)es);
    disjoint = kvi__dims_disjoint(e, 5);
  } else {
    disjoint = (int64_t)agap >= bytes;
  }
  if (!disjoint)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "layout: layer %d's K and V overlap (V is %lld bytes from K, a plane spans %lld bytes)", (int)layer,
                     (long long)gap, (long long)bytes);
  return KVI_OK;
}

void kvi__cache_release(kvi__cache *c) {
  free(c->k);
  free(c->v);
  free(c->k_scale);
  free(c->v_scale);
  memset(c, 0, sizeof *c);
}

kvi_status kvi__cache_resolve(kvi__cache *c, const kvi_cache_layout *user, const kvi__geom *g, bool cuda, int device,
                              const char *fn) {
  memset(c, 0, sizeof *c);
  if (!user) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout is NULL");
  kvi_cache_layout l = KVI_CACHE_LAYOUT_INIT;
  kvi_status st = kvi__read_struct(&l, sizeof l, user, CACHE_LAYOUT_V1, fn, "layout");
  if (st) return st;
  if (l.memory != KVI_MEMORY_HOST && l.memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->memory is %d: set KVI_MEMORY_HOST or DEVICE", (int)l.memory);
  if (l.memory != (cuda ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST))
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "a %s store writes a cache in %s memory; layout->memory says %s",
                     cuda ? "CUDA" : "CPU", cuda ? "device" : "host", l.memory == KVI_MEMORY_HOST ? "host" : "device");
  if (kvi_dtype_size(l.dtype) == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->dtype is %d, not a kvi_dtype", (int)l.dtype);
  if (l.num_layers != g->num_layers || l.num_heads != g->local_heads || l.head_size != g->head_size)
    return kvi__fail(KVI_ERR_MISMATCH, fn,
                     "layout has %d layers x %d heads x %d, the model holds %d layers x %d local heads x %d",
                     (int)l.num_layers, (int)l.num_heads, (int)l.head_size, (int)g->num_layers, (int)g->local_heads,
                     (int)g->head_size);
  if (l.block_size < 1 || l.num_blocks < 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->block_size %d and num_blocks %lld must be >= 1",
                     (int)l.block_size, (long long)l.num_blocks);
  if (l.block_stride < 0 || l.token_stride < 0 || l.head_stride < 0 || l.layer_stride < 0 || l.v_offset < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout strides must be >= 0");
  /* extent of one layer's K (or V) in elements, with overflow checks */
  int64_t ext = 0, t;
  const int64_t ds[4][2] = {{l.num_blocks, l.block_stride}, {l.block_size, l.token_stride},
                            {l.num_heads, l.head_stride}, {l.head_size, 1}};
  for (int i = 0; i < 4; i++)
    if (__builtin_mul_overflow(ds[i][0] - 1, ds[i][1], &t) || __builtin_add_overflow(ext, t, &ext))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout's extent overflows 64-bit offsets");
  /* the farthest element of any layer, K or V, from a base, in bytes */
  int64_t far;
  if (__builtin_mul_overflow((int64_t)(l.num_layers - 1), l.layer_stride, &far) || __builtin_add_overflow(far, ext, &far) ||
      __builtin_add_overflow(far, l.v_offset, &far) || __builtin_mul_overflow(far, (int64_t)8, &t))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout's extent overflows 64-bit offsets");
  const size_t es = kvi_dtype_size(l.dtype);
  const bool fp8 = l.dtype == KVI_DTYPE_FP8_E4M3 || l.dtype == KVI_DTYPE_FP8_E5M2;
  if (l.scale_mode != KVI_SCALE_NONE && l.scale_mode != KVI_SCALE_PER_TENSOR && l.scale_mode != KVI_SCALE_PER_HEAD)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->scale_mode is %d", (int)l.scale_mode);
  if (l.scale_mode != KVI_SCALE_NONE && !fp8)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->scale_mode is set for a %s cache; scales are for fp8",
                     kvi__dtype_name(l.dtype));
  if (l.scale_mode != KVI_SCALE_NONE && (!l.k_scales || !l.v_scales))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->scale_mode is set but k_scales or v_scales is NULL");

  const int32_t L = l.num_layers, H = l.num_heads;
  c->k = malloc((size_t)L * sizeof *c->k);
  c->v = malloc((size_t)L * sizeof *c->v);
  c->k_scale = malloc((size_t)L * (size_t)H * sizeof *c->k_scale);
  c->v_scale = malloc((size_t)L * (size_t)H * sizeof *c->v_scale);
  if (!c->k || !c->v || !c->k_scale || !c->v_scale) {
    kvi__cache_release(c);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating layer tables");
  }
  for (int32_t i = 0; i < L; i++) {
    char *kb = l.k_layers ? (char *)l.k_layers[i] : l.k_base ? (char *)l.k_base + (size_t)(i * l.layer_stride) * es : NULL;
    char *vb = l.v_layers ? (char *)l.v_layers[i]
               : l.v_base ? (char *)l.v_base + (size_t)(i * l.layer_stride) * es
               : kb       ? kb + (size_t)l.v_offset * es
                          : NULL;
    if (!kb || !vb) {
      kvi__cache_release(c);
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer %d has no %s base pointer (set k_layers/k_base, v_layers/v_base)",
                       (int)i, kb ? "V" : "K");
    }
    c->k[i] = kb;
    c->v[i] = vb;
    const kvi__dim dims[4] = {{l.num_blocks, l.block_stride}, {l.block_size, l.token_stride},
                              {l.num_heads, l.head_stride}, {l.head_size, 1}};
    if ((st = check_overlap(dims, dims, kb, vb, ext + 1, es, i, fn))) {
      kvi__cache_release(c);
      return st;
    }
    for (int32_t h = 0; h < H; h++) {
      float ks = 1.0f, vs = 1.0f;
      if (l.scale_mode == KVI_SCALE_PER_TENSOR) ks = l.k_scales[i], vs = l.v_scales[i];
      if (l.scale_mode == KVI_SCALE_PER_HEAD) ks = l.k_scales[(size_t)i * H + h], vs = l.v_scales[(size_t)i * H + h];
      if (!(isfinite(ks) && ks > 0 && isfinite(vs) && vs > 0)) {
        kvi__cache_release(c);
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer %d head %d has scales %g / %g; scales must be finite and > 0",
                         (int)i, (int)h, (double)ks, (double)vs);
      }
      c->k_scale[(size_t)i * H + h] = ks;
      c->v_scale[(size_t)i * H + h] = vs;
    }
  }
  /* The cache must be where the layout says it is (checked where a driver
   * answers). A device cache may also be mapped pinned host memory, which the
   * kernels write in place over the bus (a llama.cpp state: kvinject/llama.h). */
  const bool mapped = l.memory == KVI_MEMORY_DEVICE && cuda && kvi__cuda_host_mapped(c->k[0]) &&
                      kvi__cuda_host_mapped(c->v[0]);
  if (!mapped && ((st = kvi__check_memory(c->k[0], l.memory, cuda, device, fn, "the cache's layer 0 K")) ||
                  (st = kvi__check_memory(c->v[0], l.memory, cuda, device, fn, "the cache's layer 0 V")))) {
    kvi__cache_release(c);
    return st;
  }
  c->dtype = l.dtype;
  c->L = L;
  c->H = H;
  c->D = l.head_size;
  c->BS = l.block_size;
  c->NB = l.num_blocks;
  c->block_stride = l.block_stride;
  c->token_stride = l.token_stride;
  c->head_stride = l.head_stride;
  c->memory = l.memory;
  return KVI_OK;
}
