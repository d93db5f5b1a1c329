/*
 * Cache layouts: engine presets, validation, and the resolved form the
 * transfer code uses.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/xfer.h"

#define CACHE_LAYOUT_V2 (offsetof(kvi_cache_layout, v_dim_stride) + sizeof(int64_t)) /* with the per-plane strides */

kvi_status kvi__cache_layout_preset(kvi_cache_layout *out, kvi_cache_preset preset, kvi_dtype dtype, int32_t num_layers,
                                    int32_t num_heads, int32_t head_size, int32_t block_size, int64_t num_blocks,
                                    void *const *k_layers, void *const *v_layers, void *base, const char *fn) {
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
  /* The first struct version that holds what the preset sets: a caller built
   * against an older header knows none of the presets that need later fields,
   * so its struct is never overrun. */
  const size_t size = preset == KVI_CACHE_VLLM_CPU ? CACHE_LAYOUT_V2 : KVI__CACHE_LAYOUT_V1;
  l.struct_size = size;
  memcpy(out, &l, size);
  return KVI_OK;
}

/* One plane's dimensions in bytes (es bytes an element): blocks, tokens,
 * heads, dims. */
static void plane_dims(kvi__dim d[4], const kvi_cache_layout *l, const kvi__strides *p, int64_t es) {
  d[0] = (kvi__dim){l->num_blocks, p->block * es}, d[1] = (kvi__dim){l->block_size, p->token * es};
  d[2] = (kvi__dim){l->num_heads, p->head * es}, d[3] = (kvi__dim){l->head_size, p->dim * es};
}

/* The largest byte offset a set of dimensions reaches, plus es: the span of
 * the elements they address. */
static int64_t span(const kvi__dim *d, int n, int64_t es) {
  int64_t r = es;
  for (int i = 0; i < n; i++) r += (d[i].extent - 1) * d[i].stride;
  return r;
}

/*
 * Refuses a layout in which two cache elements of one layer share a byte,
 * for K and V given as dimensions kd and vd (plane_dims) and V starting gap
 * bytes from K. The one rule (kvi__dims_disjoint, a sufficient test of
 * nested dimensions) is applied three ways, the first that proves the
 * layer's elements apart accepting it:
 *  - K and V with the same dimensions: the plane is a fifth dimension of
 *    extent 2 and stride |gap| (vLLM's [2, blocks, ...], FlashInfer's
 *    [blocks, 2, ...], packed K|V, TensorRT-LLM's pool);
 *  - dimensions that K and V share, with strides past what the others reach,
 *    are outer; the others make one interval per plane ([0, K's span) and
 *    [gap, gap + V's span)), which must be apart, and their union a
 *    dimension nested inside the outer ones (vLLM's CPU layout: per block
 *    and head, K then V in other orders);
 *  - K's and V's whole byte ranges apart (separate tensors, anything else).
 * Each plane on its own must pass the rule too. The check compares
 * addresses; its sums stay far inside 64 bits (the caller's extent check).
 */
static kvi_status check_overlap(const kvi__dim kd[4], const kvi__dim vd[4], int64_t gap, int64_t es, int32_t layer,
                                const char *fn) {
  kvi__dim e[6];
  for (int plane = 0; plane < 2; plane++) {
    const kvi__dim *d = plane ? vd : kd;
    e[0] = (kvi__dim){es, 1};
    memcpy(e + 1, d, 4 * sizeof e[0]);
    if (!kvi__dims_disjoint(e, 5))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "layout: %s's blocks, tokens, heads or dims overlap (%sblock_stride %lld, %stoken_stride %lld, "
                       "%shead_stride %lld, %sdim_stride %lld elements): two elements would share an address",
                       plane ? "V" : "K", plane ? "v_" : "", (long long)(d[0].stride / es), plane ? "v_" : "",
                       (long long)(d[1].stride / es), plane ? "v_" : "", (long long)(d[2].stride / es),
                       plane ? "v_" : "", (long long)(d[3].stride / es));
  }
  const int64_t agap = gap < 0 ? -gap : gap;
  bool same[4], all = true;
  for (int i = 0; i < 4; i++) {
    same[i] = (kd[i].extent == vd[i].extent && kd[i].stride == vd[i].stride) || kd[i].extent == 1;
    all = all && same[i];
  }
  if (all && gap != 0) {
    e[0] = (kvi__dim){es, 1};
    memcpy(e + 1, kd, 4 * sizeof e[0]);
    e[5] = (kvi__dim){2, agap};
    if (kvi__dims_disjoint(e, 6)) return KVI_OK;
  }
  if (!all) {
    /* outer: shared dimensions whose stride passes both inner spans (grown until stable) */
    bool outer[4];
    for (int i = 0; i < 4; i++) outer[i] = same[i];
    int64_t sk = 0, sv = 0;
    for (bool moved = true; moved;) {
      kvi__dim ik[4], iv[4];
      int n = 0;
      for (int i = 0; i < 4; i++)
        if (!outer[i]) ik[n] = kd[i], iv[n] = vd[i], n++;
      sk = span(ik, n, es), sv = span(iv, n, es);
      moved = false;
      for (int i = 0; i < 4; i++)
        if (outer[i] && kd[i].extent > 1 && kd[i].stride < (sk > sv ? sk : sv)) outer[i] = false, moved = true;
    }
    const int64_t lo = gap < 0 ? gap : 0, hi = sk > gap + sv ? sk : gap + sv;
    if (gap >= sk || gap + sv <= 0) { /* the intervals are apart */
      int n = 0;
      for (int i = 0; i < 4; i++)
        if (outer[i]) e[n++] = kd[i];
      e[n++] = (kvi__dim){hi - lo, 1};
      if (kvi__dims_disjoint(e, n)) return KVI_OK;
    }
  }
  const int64_t kspan = span(kd, 4, es), vspan = span(vd, 4, es);
  if (gap >= kspan || -gap >= vspan) return KVI_OK;
  return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                   "layout: layer %d's K and V overlap (V starts %lld bytes from K; K spans %lld bytes, V %lld)",
                   (int)layer, (long long)gap, (long long)kspan, (long long)vspan);
}

void kvi__cache_release(kvi__cache *c) {
  free(c->k);
  free(c->v);
  free(c->k_scale);
  free(c->v_scale);
  memset(c, 0, sizeof *c);
}

/* The layout's fields one by one: memory kind, dtype, shape against the
 * model's, sizes and (non-negative) strides and offsets. */
static kvi_status check_fields(const kvi_cache_layout *l, const kvi__geom *g, bool cuda, const char *fn) {
  if (l->memory != KVI_MEMORY_HOST && l->memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->memory is %d: set KVI_MEMORY_HOST or DEVICE", (int)l->memory);
  if (l->memory != (cuda ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST))
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "a %s store writes a cache in %s memory; layout->memory says %s",
                     cuda ? "CUDA" : "CPU", cuda ? "device" : "host", l->memory == KVI_MEMORY_HOST ? "host" : "device");
  if (l->dtype == KVI_DTYPE_Q4)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "layout->dtype is KVI_DTYPE_Q4, a store dtype; caches are fp32, fp16, bf16 or fp8");
  if (kvi__dtype_size(l->dtype) == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->dtype is %d, not a kvi_dtype", (int)l->dtype);
  if (l->num_layers != g->num_layers || l->num_heads != g->local_heads || l->head_size != g->head_size)
    return kvi__fail(KVI_ERR_MISMATCH, fn,
                     "layout has %d layers x %d heads x %d, the model holds %d layers x %d local heads x %d",
                     (int)l->num_layers, (int)l->num_heads, (int)l->head_size, (int)g->num_layers, (int)g->local_heads,
                     (int)g->head_size);
  if (l->block_size < 1 || l->num_blocks < 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->block_size %d and num_blocks %lld must be >= 1",
                     (int)l->block_size, (long long)l->num_blocks);
  const struct {
    const char *name;
    int64_t v;
  } sv[] = {{"block_stride", l->block_stride},     {"token_stride", l->token_stride},
            {"head_stride", l->head_stride},       {"dim_stride", l->dim_stride},
            {"v_block_stride", l->v_block_stride}, {"v_token_stride", l->v_token_stride},
            {"v_head_stride", l->v_head_stride},   {"v_dim_stride", l->v_dim_stride},
            {"layer_stride", l->layer_stride},     {"v_offset", l->v_offset}};
  for (size_t i = 0; i < sizeof sv / sizeof sv[0]; i++)
    if (sv[i].v < 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->%s is %lld; strides and offsets must be >= 0", sv[i].name,
                       (long long)sv[i].v);
  return KVI_OK;
}

/* The extent of one layer's K and V in elements, and the farthest element
 * of any layer, K or V, from a base: its byte offset (and sums of a few
 * such, in check_overlap) must fit 64 bits. */
static kvi_status check_extent(const kvi_cache_layout *l, const kvi__strides *ks, const kvi__strides *vs,
                               const char *fn) {
  int64_t ext[2] = {0, 0}, t;
  for (int kv = 0; kv < 2; kv++) {
    const kvi__strides *p = kv ? vs : ks;
    const int64_t ds[4][2] = {
        {l->num_blocks, p->block}, {l->block_size, p->token}, {l->num_heads, p->head}, {l->head_size, p->dim}};
    for (int i = 0; i < 4; i++)
      if (__builtin_mul_overflow(ds[i][0] - 1, ds[i][1], &t) || __builtin_add_overflow(ext[kv], t, &ext[kv]))
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout's %s extent overflows 64-bit offsets", kv ? "V" : "K");
  }
  int64_t far;
  if (__builtin_mul_overflow((int64_t)(l->num_layers - 1), l->layer_stride, &far) ||
      __builtin_add_overflow(far, ext[0] > ext[1] ? ext[0] : ext[1], &far) ||
      __builtin_add_overflow(far, l->v_offset, &far) || __builtin_add_overflow(far, (int64_t)1, &far) ||
      __builtin_mul_overflow(far, (int64_t)64, &t))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout's extent overflows 64-bit offsets");
  return KVI_OK;
}

/* Scales: a known mode, for fp8 caches only, with both arrays. */
static kvi_status check_scale_mode(const kvi_cache_layout *l, const char *fn) {
  const bool fp8 = l->dtype == KVI_DTYPE_FP8_E4M3 || l->dtype == KVI_DTYPE_FP8_E5M2;
  if (l->scale_mode != KVI_SCALE_NONE && l->scale_mode != KVI_SCALE_PER_TENSOR && l->scale_mode != KVI_SCALE_PER_HEAD)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->scale_mode is %d", (int)l->scale_mode);
  if (l->scale_mode != KVI_SCALE_NONE && !fp8)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->scale_mode is set for a %s cache; scales are for fp8",
                     kvi__dtype_name(l->dtype));
  if (l->scale_mode != KVI_SCALE_NONE && (!l->k_scales || !l->v_scales))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout->scale_mode is set but k_scales or v_scales is NULL");
  return KVI_OK;
}

/* Layer i's K and V base addresses into c, checked for overlap when their
 * gap differs from the previous layer's (*prev_gap). */
static kvi_status layer_bases(kvi__cache *c, const kvi_cache_layout *l, int32_t i, const kvi__dim *kdims,
                              const kvi__dim *vdims, int64_t *prev_gap, const char *fn) {
  const size_t es = kvi__dtype_size(l->dtype);
  char *kb = l->k_layers ? (char *)l->k_layers[i] : l->k_base ? (char *)l->k_base + (size_t)(i * l->layer_stride) * es : NULL;
  char *vb = l->v_layers ? (char *)l->v_layers[i]
             : l->v_base ? (char *)l->v_base + (size_t)(i * l->layer_stride) * es
             : kb        ? kb + (size_t)l->v_offset * es
                         : NULL;
  if (!kb || !vb)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer %d has no %s base pointer (set k_layers/k_base, v_layers/v_base)",
                     (int)i, kb ? "V" : "K");
  c->k[i] = kb;
  c->v[i] = vb;
  /* the gap in bytes, clamped: separate tensors may be any distance apart, and
   * a plane spans < 2^60 bytes (the extent check), so beyond 2^61 is apart
   * whatever the exact distance, and the check's sums stay inside 64 bits */
  const uintptr_t ka = (uintptr_t)kb, va = (uintptr_t)vb, lim = (uintptr_t)1 << 61;
  const int64_t gap = va >= ka ? (int64_t)(va - ka < lim ? va - ka : lim) : -(int64_t)(ka - va < lim ? ka - va : lim);
  if (i == 0 || gap != *prev_gap) {
    kvi_status st = check_overlap(kdims, vdims, gap, (int64_t)es, i, fn);
    if (st) return st;
    *prev_gap = gap;
  }
  return KVI_OK;
}

/* Layer i's per-head K and V scales into c (1 without scales): finite and > 0. */
static kvi_status layer_scales(kvi__cache *c, const kvi_cache_layout *l, int32_t i, const char *fn) {
  const int32_t H = l->num_heads;
  for (int32_t h = 0; h < H; h++) {
    float ks = 1.0f, vs = 1.0f;
    if (l->scale_mode == KVI_SCALE_PER_TENSOR) ks = l->k_scales[i], vs = l->v_scales[i];
    if (l->scale_mode == KVI_SCALE_PER_HEAD) ks = l->k_scales[(size_t)i * H + h], vs = l->v_scales[(size_t)i * H + h];
    if (!(isfinite(ks) && ks > 0 && isfinite(vs) && vs > 0))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer %d head %d has scales %g / %g; scales must be finite and > 0",
                       (int)i, (int)h, (double)ks, (double)vs);
    c->k_scale[(size_t)i * H + h] = ks;
    c->v_scale[(size_t)i * H + h] = vs;
  }
  return KVI_OK;
}

/* Every layer's bases and scales into c's tables (allocated here). */
static kvi_status resolve_layers(kvi__cache *c, const kvi_cache_layout *l, const kvi__strides *ks,
                                 const kvi__strides *vs, const char *fn) {
  const int32_t L = l->num_layers, H = l->num_heads;
  const int64_t es = (int64_t)kvi__dtype_size(l->dtype);
  kvi__dim kdims[4], vdims[4];
  plane_dims(kdims, l, ks, es);
  plane_dims(vdims, l, vs, es);
  c->k = malloc((size_t)L * sizeof *c->k);
  c->v = malloc((size_t)L * sizeof *c->v);
  c->k_scale = malloc((size_t)L * (size_t)H * sizeof *c->k_scale);
  c->v_scale = malloc((size_t)L * (size_t)H * sizeof *c->v_scale);
  if (!c->k || !c->v || !c->k_scale || !c->v_scale) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating layer tables");
  int64_t prev_gap = 0;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < L && st == KVI_OK; i++)
    if ((st = layer_bases(c, l, i, kdims, vdims, &prev_gap, fn)) == KVI_OK) st = layer_scales(c, l, i, fn);
  return st;
}

/* The cache must be where the layout says it is (checked where a driver
 * answers). A device cache may also be mapped pinned host memory, which the
 * kernels write in place over the bus (a llama.cpp state: kvinject/llama.h). */
static kvi_status check_cache_memory(const kvi__cache *c, kvi_memory memory, bool cuda, int device, const char *fn) {
  const bool mapped =
      memory == KVI_MEMORY_DEVICE && cuda && kvi__cuda_host_mapped(c->k[0]) && kvi__cuda_host_mapped(c->v[0]);
  kvi_status st = KVI_OK;
  if (!mapped && ((st = kvi__check_memory(c->k[0], memory, cuda, device, fn, "the cache's layer 0 K")) ||
                  (st = kvi__check_memory(c->v[0], memory, cuda, device, fn, "the cache's layer 0 V"))))
    return st;
  return KVI_OK;
}

kvi_status kvi__cache_resolve(kvi__cache *c, const kvi_cache_layout *user, const kvi__geom *g, bool cuda, int device,
                              const char *fn) {
  memset(c, 0, sizeof *c);
  if (!user) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layout is NULL");
  kvi_cache_layout l = KVI_CACHE_LAYOUT_INIT;
  kvi_status st = kvi__read_struct(&l, sizeof l, user, KVI__CACHE_LAYOUT_V1, fn, "layout");
  if (st || (st = check_fields(&l, g, cuda, fn))) return st;
  /* the per-plane strides, defaults applied */
  const kvi__strides ks = {l.block_stride, l.token_stride, l.head_stride, l.dim_stride ? l.dim_stride : 1};
  const kvi__strides vs = {l.v_block_stride ? l.v_block_stride : ks.block, l.v_token_stride ? l.v_token_stride : ks.token,
                           l.v_head_stride ? l.v_head_stride : ks.head, l.v_dim_stride ? l.v_dim_stride : ks.dim};
  if ((st = check_extent(&l, &ks, &vs, fn)) || (st = check_scale_mode(&l, fn))) return st;
  if ((st = resolve_layers(c, &l, &ks, &vs, fn)) || (st = check_cache_memory(c, l.memory, cuda, device, fn))) {
    kvi__cache_release(c);
    return st;
  }
  c->dtype = l.dtype;
  c->L = l.num_layers;
  c->H = l.num_heads;
  c->D = l.head_size;
  c->BS = l.block_size;
  c->NB = l.num_blocks;
  c->ks = ks;
  c->vs = vs;
  c->memory = l.memory;
  return KVI_OK;
}
