/*
 * Cache layouts: engine presets, validation, and the resolved form the
 * transfer code uses.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "cache_internal.h"

#define CACHE_LAYOUT_V1 offsetof(kvi_cache_layout, dim_stride) /* before the per-plane strides */

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
  case KVI_CACHE_VLLM_CPU: /* per (block, head): K [D][BS], then V [BS][D] */
    l.block_stride = H * 2 * D * BS, l.token_stride = 1, l.head_stride = 2 * D * BS, l.dim_stride = BS;
    l.v_offset = D * BS, l.v_token_stride = D, l.v_dim_stride = 1;
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

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    const int64_t r = a % b;
    a = b, b = r;
  }
  return a;
}

/* Whether the n1 x n2 offsets i * s1 + j * s2 (i < n1, j < n2, strides >= 0)
 * are all distinct. Two coincide when (i - i') * s1 = (j' - j) * s2 for
 * |i - i'| < n1, |j - j'| < n2, not both 0; with g = gcd(s1, s2) the
 * smallest such pair is (s2 / g, s1 / g). */
static bool distinct_2d(int64_t n1, int64_t s1, int64_t n2, int64_t s2) {
  if (n1 == 1 || n2 == 1) return (n1 == 1 || s1 > 0) && (n2 == 1 || s2 > 0);
  if (s1 == 0 || s2 == 0) return false;
  const int64_t g = gcd64(s1, s2);
  return !(s2 / g < n1 && s1 / g < n2);
}

/* Refuses a layout whose K and V can meet within one token: for each layer
 * whose K and V address ranges meet, no K head vector's byte range [start,
 * end) may meet a V head vector's range of the same (block, token). Their
 * distance is affine in (block, token), so it is checked at the four corners
 * of the blocks x tokens box: all on one side of the K range, or all on the
 * other. (Layers with the same K-to-V distance are checked once.) */
static kvi_status check_kv_overlap(const kvi__cache *c, const kvi_cache_layout *l, const kvi__strides *ks,
                                   const kvi__strides *vs, const int64_t ext[2], const char *fn) {
  const int64_t es = (int64_t)kvi_dtype_size(l->dtype), H = l->num_heads, D = l->head_size;
  const int64_t klen = ((D - 1) * ks->dim + 1) * es, vlen = ((D - 1) * vs->dim + 1) * es;
  bool have_prev = false;
  int64_t prev = 0;
  for (int32_t i = 0; i < l->num_layers; i++) {
    const uintptr_t kb = (uintptr_t)c->k[i], vb = (uintptr_t)c->v[i];
    const uintptr_t kend = kb + (uintptr_t)((ext[0] + 1) * es), vend = vb + (uintptr_t)((ext[1] + 1) * es);
    if (kend <= vb || vend <= kb) continue; /* apart (also when a range wraps: kend < kb cannot be) */
    const int64_t base = vb >= kb ? (int64_t)(vb - kb) : -(int64_t)(kb - vb); /* |base| < the extents */
    if (have_prev && base == prev) continue;
    have_prev = true, prev = base;
    const int64_t bl[2] = {0, l->num_blocks - 1}, tl[2] = {0, l->block_size - 1};
    for (int64_t hk = 0; hk < H; hk++)
      for (int64_t hv = 0; hv < H; hv++) {
        int above = 0, below = 0;
        for (int cb = 0; cb < 2; cb++)
          for (int ct = 0; ct < 2; ct++) {
            /* V head hv's start minus K head hk's start, in bytes (bounded by the checked extents) */
            const int64_t dist = base + es * (bl[cb] * (vs->block - ks->block) + tl[ct] * (vs->token - ks->token) +
                                              hv * vs->head - hk * ks->head);
            above += dist >= klen;
            below += dist <= -vlen;
          }
        if (above != 4 && below != 4)
          return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                           "layout: in layer %d, K head %lld and V head %lld of one token can overlap (V starts %lld "
                           "bytes from K at block 0, token 0; K's head vector spans %lld bytes, V's %lld)",
                           (int)i, (long long)hk, (long long)hv,
                           (long long)(base + es * (hv * vs->head - hk * ks->head)), (long long)klen, (long long)vlen);
      }
  }
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
  const struct {
    const char *name;
    int64_t v;
  } sv[] = {{"block_stride", l.block_stride},     {"token_stride", l.token_stride},     {"head_stride", l.head_stride},
            {"dim_stride", l.dim_stride},         {"v_block_stride", l.v_block_stride}, {"v_token_stride", l.v_token_stride},
            {"v_head_stride", l.v_head_stride},   {"v_dim_stride", l.v_dim_stride},     {"layer_stride", l.layer_stride},
            {"v_offset", l.v_offset}};
  for (size_t i = 0; i < sizeof sv / sizeof sv[0]; i++)
    if (sv[i].v < 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->%s is %lld; strides and offsets must be >= 0", sv[i].name,
                       (long long)sv[i].v);
  /* the per-plane strides, defaults applied */
  const kvi__strides ks = {l.block_stride, l.token_stride, l.head_stride, l.dim_stride ? l.dim_stride : 1};
  const kvi__strides vs = {l.v_block_stride ? l.v_block_stride : ks.block, l.v_token_stride ? l.v_token_stride : ks.token,
                           l.v_head_stride ? l.v_head_stride : ks.head, l.v_dim_stride ? l.v_dim_stride : ks.dim};
  /* extent of one layer's K and V in elements, with overflow checks */
  int64_t ext[2] = {0, 0}, t;
  for (int kv = 0; kv < 2; kv++) {
    const kvi__strides *p = kv ? &vs : &ks;
    const int64_t ds[4][2] = {{l.num_blocks, p->block}, {l.block_size, p->token}, {l.num_heads, p->head}, {l.head_size, p->dim}};
    for (int i = 0; i < 4; i++)
      if (__builtin_mul_overflow(ds[i][0] - 1, ds[i][1], &t) || __builtin_add_overflow(ext[kv], t, &ext[kv]))
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout's %s extent overflows 64-bit offsets", kv ? "V" : "K");
  }
  /* the farthest element of any layer, K or V, from a base: its byte offset
   * (and sums of a few such, in check_kv_overlap) must fit 64 bits */
  int64_t far;
  if (__builtin_mul_overflow((int64_t)(l.num_layers - 1), l.layer_stride, &far) ||
      __builtin_add_overflow(far, ext[0] > ext[1] ? ext[0] : ext[1], &far) || __builtin_add_overflow(far, l.v_offset, &far) ||
      __builtin_add_overflow(far, (int64_t)1, &far) || __builtin_mul_overflow(far, (int64_t)64, &t))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout's extent overflows 64-bit offsets");
  /* within one token, every (head, dim) of a plane is its own element */
  for (int kv = 0; kv < 2; kv++) {
    const kvi__strides *p = kv ? &vs : &ks;
    if (!distinct_2d(l.num_heads, p->head, l.head_size, p->dim))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "layout: %s's %d heads x %d dims at %s %lld and %s %lld put two elements of one token at one "
                       "place",
                       kv ? "V" : "K", (int)l.num_heads, (int)l.head_size, kv ? "v_head_stride" : "head_stride",
                       (long long)p->head, kv ? "v_dim_stride" : "dim_stride", (long long)p->dim);
  }
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
  if ((st = check_kv_overlap(c, &l, &ks, &vs, ext, fn))) {
    kvi__cache_release(c);
    return st;
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
  c->ks = ks;
  c->vs = vs;
  c->memory = l.memory;
  return KVI_OK;
}
