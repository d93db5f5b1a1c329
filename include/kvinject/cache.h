/*
 * libkvinject — the engine's paged KV cache, described by strides
 * (kvi_cache_layout), with presets for the common engines.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * Engines change their cache layouts often, so the library never hard-codes
 * one. A layout says, for every layer, where element (block b, token t of the
 * block, local head h, dim d) of K and of V is, in elements of `dtype`:
 *
 *   K: kbase(l) + b * block_stride   + t * token_stride   + h * head_stride   + d * dim_stride
 *   V: vbase(l) + b * v_block_stride + t * v_token_stride + h * v_head_stride + d * v_dim_stride
 *
 * with
 *   kbase(l) = k_layers ? k_layers[l] : k_base + l * layer_stride
 *   vbase(l) = v_layers ? v_layers[l] : v_base ? v_base + l * layer_stride
 *                                              : kbase(l) + v_offset
 * (the last form covers caches that keep K and V in one tensor: vLLM's
 * [2, blocks, ...] and packed K|V layouts, TensorRT-LLM's pool). A V stride
 * of 0 (KVI_STRIDE_SAME) means "the same as K's" (v_dim_stride: dim_stride),
 * and a dim_stride of 0 means 1 (contiguous head vectors), so a layout that
 * sets neither (and any caller built before these fields existed, whose
 * smaller struct_size does not reach them) has K's strides for V and
 * contiguous head vectors. (A stride of 0 is otherwise never useful: it
 * would put two blocks, tokens, heads or dims at one place, unless the count
 * is 1, when the stride does not matter.) A sequence's token s lives in
 * block block_table[s / block_size] at t = s % block_size.
 *
 * Two examples of the per-plane strides (H heads, D head size, BS block size):
 *  - vLLM's CPU attention (KVI_CACHE_VLLM_CPU): per (block, head) K as
 *    [D][BS] (token fastest: token_stride 1, dim_stride BS), then V as
 *    [BS][D] (v_token_stride D, v_dim_stride 1), v_offset D * BS;
 *  - a transposed V (llama.cpp's state with flash attention off: per layer K
 *    [cells][H * D], V [H * D][cells]), as token-granular blocks (BS 1,
 *    NB = cells): block_stride H * D, head_stride D, dim_stride 1;
 *    v_block_stride 1, v_head_stride D * cells, v_dim_stride cells.
 *
 * Checks (kvi_injector_create, kvi_encoder_create): every stride >= 0; the
 * farthest element fits 64-bit byte offsets; and no two elements of a layer,
 * K or V, share a byte. The last is proved with one sufficient rule: a
 * plane's dimensions (blocks, tokens, heads, dims, by stride) must nest,
 * each stride past everything the smaller ones reach. K and V pass together
 * when they have the same dimensions and the plane nests as one more
 * dimension of extent 2 (vLLM's [2, blocks, ...], FlashInfer's [blocks, 2,
 * ...], packed K|V, K and V interleaved by element), or when the dimensions
 * they share enclose two apart intervals, one per plane, holding the others
 * (vLLM's CPU layout), or when their whole byte ranges are apart (separate
 * tensors). Anything else is refused with KVI_ERR_INVALID_ARGUMENT, a message
 * naming the plane or the layer.
 *
 * A CUDA store moves contiguous head vectors (dim strides 1) in 16-byte
 * vectors when D, the rotated widths and the strides allow it; other
 * layouts (dim strides other than 1 among them) take its element-wise path.
 *
 * fp8 caches (KVI_DTYPE_FP8_E4M3 / E5M2, stored as bytes) use the divide
 * convention of vLLM and SGLang: stored = saturate(x / scale), x = stored *
 * scale, with one scale per layer (per tensor) or per layer and head.
 * (FlashInfer's fused kernels multiply by a scale: pass its reciprocal.)
 */
#ifndef KVINJECT_CACHE_H
#define KVINJECT_CACHE_H

#include "kvinject/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How fp8 scales are given. */
typedef enum kvi_scale_mode {
  KVI_SCALE_NONE = 0,       /* no scales: 1.0 (also for non-fp8 caches) */
  KVI_SCALE_PER_TENSOR = 1, /* k_scales / v_scales hold num_layers values */
  KVI_SCALE_PER_HEAD = 2    /* they hold num_layers * num_heads values, layer-major */
} kvi_scale_mode;

typedef struct kvi_cache_layout {
  size_t struct_size;        /* sizeof(kvi_cache_layout) */
  kvi_memory memory;         /* where the cache lives: DEVICE for a CUDA store
                                (device memory of its device, managed memory,
                                or pinned host memory mapped at the same
                                address, which the kernels then reach over the
                                bus), HOST for a CPU store (required) */
  kvi_dtype dtype;           /* any kvi_dtype (required) */
  int32_t num_layers;        /* must equal the model's layers */
  int32_t num_heads;         /* heads this rank's cache holds: the model's local heads */
  int32_t head_size;         /* must equal the model's head size */
  int32_t block_size;        /* tokens per block, >= 1 */
  int64_t num_blocks;        /* valid block ids are 0..num_blocks-1 */
  int64_t block_stride;      /* elements, all strides >= 0; these three are K's
                                (and V's where its own are 0) */
  int64_t token_stride;
  int64_t head_stride;
  int64_t layer_stride;      /* with k_base / v_base */
  int64_t v_offset;          /* with neither v_layers nor v_base */
  void *const *k_layers;     /* host array of num_layers pointers, or NULL */
  void *const *v_layers;     /* host array of num_layers pointers, or NULL */
  void *k_base;              /* with k_layers NULL */
  void *v_base;              /* with v_layers NULL; NULL: V = K + v_offset */
  kvi_scale_mode scale_mode; /* fp8 only; default KVI_SCALE_NONE */
  const float *k_scales;     /* host memory, see kvi_scale_mode; values > 0 */
  const float *v_scales;
  /* appended (callers whose struct_size ends before them get the defaults) */
  int64_t dim_stride;        /* K elements between dims d and d + 1; 0 = 1 */
  int64_t v_block_stride;    /* V's strides; 0 (KVI_STRIDE_SAME) = K's */
  int64_t v_token_stride;
  int64_t v_head_stride;
  int64_t v_dim_stride;      /* 0 = dim_stride (after its default) */
} kvi_cache_layout;

/* A V stride of kvi_cache_layout equal to K's. */
#define KVI_STRIDE_SAME 0

#define KVI_CACHE_LAYOUT_INIT                                                                         \
  {sizeof(kvi_cache_layout), KVI_ENUM_ZERO(kvi_memory), KVI_ENUM_ZERO(kvi_dtype), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, NULL, NULL, \
   NULL, NULL, KVI_SCALE_NONE, NULL, NULL, 0, 0, 0, 0, 0}

/* Fills *layout with KVI_CACHE_LAYOUT_INIT for a struct of `size` bytes (pass sizeof *layout):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_cache_layout_init(kvi_cache_layout *layout, size_t size);

/*
 * Engine layouts. H = local KV heads, D = head size, NB = blocks, BS = block
 * size, L = layers. "Per layer" presets take one pointer per layer in
 * `k_layers` (and `v_layers` where K and V are separate tensors); "pool"
 * presets take one base pointer in `base`.
 */
typedef enum kvi_cache_preset {
  /* vLLM FlashAttention, per layer [2, NB, BS, H, D] (K = [0], V = [1]) */
  KVI_CACHE_VLLM_FLASH_ATTN = 1,
  /* the same with the HND stride order: physical [2, NB, H, BS, D] */
  KVI_CACHE_VLLM_FLASH_ATTN_HND = 2,
  /* vLLM FlashInfer / Triton (and FlashAttention from mid-2026), per layer [NB, 2, BS, H, D] */
  KVI_CACHE_VLLM_FLASHINFER = 3,
  /* the same, HND: physical [NB, 2, H, BS, D] */
  KVI_CACHE_VLLM_FLASHINFER_HND = 4,
  /* vLLM K|V packed in the content dimension (PR #44455), per layer physical
   * [NB, BS, H, 2D]: per token and head, D K elements then D V elements */
  KVI_CACHE_VLLM_PACKED = 5,
  /* the same, HND: physical [NB, H, BS, 2D] */
  KVI_CACHE_VLLM_PACKED_HND = 6,
  /* SGLang MHATokenToKVPool: per layer k_buffer and v_buffer, [slots, H, D],
   * token-granular (BS = the engine's page size, 1 by default) */
  KVI_CACHE_SGLANG = 7,
  /* TensorRT-LLM: one pool [NB, L, 2, H, BS, D] (every layer inside a block) */
  KVI_CACHE_TRTLLM = 8,
  /* contiguous per-sequence cache (Hugging Face DynamicCache/StaticCache):
   * per layer key and value tensors [batch, H, S, D]. Blocks are batch rows:
   * NB = batch, BS = S (the capacity), and a request's block table is
   * {its batch row}. */
  KVI_CACHE_HF_CONTIGUOUS = 9,
  /* vLLM's CPU attention (CPU_ATTN, the vec / vec16 ISA), per layer one
   * tensor [NB, H, BS, 2D] that is a container: per (block, head) a region
   * of 2 * D * BS elements holding K as [D][BS] (token fastest) followed by
   * V as [BS][D]. block_stride H * 2D * BS, head_stride 2D * BS,
   * token_stride 1, dim_stride BS; V = K + v_offset D * BS with
   * v_token_stride D, v_dim_stride 1 (V's block and head strides are K's).
   * (The amx ISA packs tiles otherwise: not this preset.) */
  KVI_CACHE_VLLM_CPU = 10
} kvi_cache_preset;

/*
 * Fills *out for an engine's layout: every field but memory, scale_mode and
 * the scales, which the caller sets. The pointer arrays are referenced, not
 * copied, until the layout is given to an injector or encoder (which copy
 * what they need). Writes the first struct version that holds what the
 * preset sets, and sets struct_size to that version's size (the caller's
 * struct_size is not read): the first version (up to the scales) for every
 * preset but KVI_CACHE_VLLM_CPU, which needs the per-plane strides and writes
 * the whole struct of this header. A program built against an older header
 * therefore never has its struct overrun. Fields past the written version
 * are not touched and not read: to set them afterwards (dim_stride, the V
 * strides), start from KVI_CACHE_LAYOUT_INIT or kvi_cache_layout_init and set
 * struct_size = sizeof *out after the preset.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL out, unknown preset, a size < 1, a
 * pointer the preset needs is NULL).
 */
KVI_API kvi_status kvi_cache_layout_preset(kvi_cache_layout *out, kvi_cache_preset preset, kvi_dtype dtype,
                                           int32_t num_layers, int32_t num_heads, int32_t head_size,
                                           int32_t block_size, int64_t num_blocks, void *const *k_layers,
                                           void *const *v_layers, void *base);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_CACHE_H */
