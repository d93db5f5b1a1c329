/*
 * libkvinject — model geometry (kvi_model) and its RoPE slot.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * A kvi_model describes the attention KV of one model as this process sees
 * it: layers, KV heads, head size, the tensor-parallel slice this process
 * holds, and a RoPE spec per layer. Every other handle is created from a
 * model and checks what it is given against it.
 *
 * Tensor parallelism follows vLLM/SGLang/TensorRT-LLM: with H total KV heads
 * and tp ranks, rank r holds heads [r*H/tp, (r+1)*H/tp) when tp <= H (tp must
 * divide H), and head r / (tp/H) when tp > H (H must divide tp; each head is
 * then replicated on tp/H ranks).
 *
 * Thread rules: a kvi_model may be read (kvi_model_info, kvi_model_get_rope,
 * handle creation) from any number of threads at once; kvi_model_set_rope
 * must not run concurrently with any other call on the same model. Handles
 * created from a model copy what they need: the model may be changed or
 * destroyed afterwards without affecting them.
 */
#ifndef KVINJECT_MODEL_H
#define KVINJECT_MODEL_H

#include "kvinject/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvi_model kvi_model;

/* Options for kvi_model_create. Initialize with KVI_MODEL_OPTIONS_INIT or
 * kvi_model_options_init(&o, sizeof o); fields may only be appended in later
 * versions. */
typedef struct kvi_model_options {
  size_t struct_size;   /* sizeof(kvi_model_options) */
  int32_t num_layers;   /* attention layers, 1..65536 (required) */
  int32_t num_kv_heads; /* KV heads of the whole model, before TP, 1..65536 (required) */
  int32_t head_size;    /* elements per head, 1..1024 (required) */
  int32_t tp_rank;      /* this process's tensor-parallel rank, default 0 */
  int32_t tp_size;      /* tensor-parallel size, 1..65536, default 1 */
} kvi_model_options;

#define KVI_MODEL_OPTIONS_INIT {sizeof(kvi_model_options), 0, 0, 0, 0, 1}

/* Fills *opts with KVI_MODEL_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_model_options_init(kvi_model_options *opts, size_t size);

/*
 * Creates a model.
 * out:  host memory; receives the new model, owned by the caller (free it
 *       with kvi_model_destroy). Unchanged on error.
 * opts: host memory, required (the geometry has no defaults).
 * Every layer starts with its RoPE unset (KVI_ROPE_UNSET): give each layer a
 * spec, or KVI_ROPE_NONE for a layer without rotary embedding, with
 * kvi_model_set_rope. Stores may be made and filled from a model with unset
 * layers (put, read, search, save), but kvi_inject, kvi_encode and
 * kvi_retrieve_inject on such a store fail with KVI_ERR_INVALID_ARGUMENT
 * naming the first unset layer (keys would otherwise land unrotated).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, a field out of range, tp_rank not
 * in [0, tp_size), tp_size and num_kv_heads where neither divides the other),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_OUT_OF_MEMORY.
 */
KVI_API kvi_status kvi_model_create(kvi_model **out, const kvi_model_options *opts);

/* Frees a model. NULL is a no-op. */
KVI_API void kvi_model_destroy(kvi_model *model);

/* What a model resolves to. An output struct: set struct_size (use
 * KVI_MODEL_INFO_INIT); the library writes only the first struct_size bytes. */
typedef struct kvi_model_info {
  size_t struct_size;
  int32_t num_layers;
  int32_t num_kv_heads;     /* whole model */
  int32_t head_size;
  int32_t tp_rank;
  int32_t tp_size;
  int32_t local_head_first; /* first KV head (global index) this rank holds */
  int32_t local_heads;      /* how many consecutive heads it holds */
  int32_t head_replicas;    /* ranks holding each of these heads (1 unless tp > H) */
} kvi_model_info;

#define KVI_MODEL_INFO_INIT {sizeof(kvi_model_info), 0, 0, 0, 0, 0, 0, 0, 0}

/* Fills *out. host memory. Errors: KVI_ERR_INVALID_ARGUMENT, KVI_ERR_STRUCT_SIZE. */
KVI_API kvi_status kvi_model_info_get(const kvi_model *model, kvi_model_info *out);

/* ------------------------------------------------------------------------ */
/* RoPE slot                                                                */
/* ------------------------------------------------------------------------ */

/* How a layer's keys are rotated. */
typedef enum kvi_rope_style {
  KVI_ROPE_UNSET = -1, /* never set (a new model's layers; kvi_model_get_rope reports it,
                          kvi_model_set_rope refuses it): injection and capture fail */
  KVI_ROPE_NONE = 0, /* no rotary embedding on this layer (NoPE) */
  KVI_ROPE_NEOX = 1, /* half split: pairs (x_i, x_{i + rotary_dim/2}) */
  KVI_ROPE_GPTJ = 2  /* interleaved: pairs (x_{2i}, x_{2i+1}) */
} kvi_rope_style;

/* Frequency scaling of a layer's RoPE (Hugging Face `rope_scaling` types). */
typedef enum kvi_rope_scaling {
  KVI_ROPE_SCALING_NONE = 0,   /* inv_freq_i = theta^(-2i/rotary_dim) */
  KVI_ROPE_SCALING_LINEAR = 1, /* inv_freq_i / factor */
  KVI_ROPE_SCALING_LLAMA3 = 2, /* Llama 3.1: factor, low/high_freq_factor, original_max_position */
  KVI_ROPE_SCALING_YARN = 3,   /* factor, beta_fast/slow, original_max_position, attention_factor */
  KVI_ROPE_SCALING_NTK = 4     /* fixed NTK: theta * factor^(rotary_dim / (rotary_dim - 2)) */
} kvi_rope_scaling;

/*
 * A layer's RoPE. Keys are stored before rotation and rotated at the
 * positions where they land; capture from an engine's cache un-rotates them
 * at the positions they were written with.
 *
 * Rotation of the pair (x, y) at position p by angle a = p * inv_freq_i:
 *   x' = (x cos a - y sin a) * m,  y' = (y cos a + x sin a) * m
 * with m = attention_factor (YaRN's mscale; 1 otherwise), applied exactly
 * once. The angle is computed as an fp32 product of the fp32 position and the
 * fp32 inv_freq_i (what Hugging Face and vLLM do), cos/sin and the rotation in
 * fp32 on every backend. Pairs: NEOX (x_i, x_{i+rotary_dim/2}), GPTJ
 * (x_{2i}, x_{2i+1}); elements past rotary_dim pass through unchanged.
 *
 * Instead of the frequency fields, a layer may take the engine's own table
 * (cos_sin_table): row p holds rotary_dim/2 cosines then rotary_dim/2 sines
 * (vLLM's, SGLang's and FlashInfer's cos_sin_cache), already including any
 * attention factor. The values are used as given (converted exactly to
 * fp32), which gives parity with that engine's cache.
 *
 * Fields are only ever appended.
 */
typedef struct kvi_rope_spec {
  size_t struct_size;             /* sizeof(kvi_rope_spec) */
  kvi_rope_style style;           /* default KVI_ROPE_NEOX */
  int32_t rotary_dim;             /* rotated leading dims, even, 2..head_size; 0 = head_size (default) */
  double theta;                   /* base, > 0; default 10000 */
  kvi_rope_scaling scaling;       /* default KVI_ROPE_SCALING_NONE */
  int32_t original_max_position;  /* LLAMA3 and YARN: the pre-scaling context, default 8192 */
  double factor;                  /* LINEAR, LLAMA3, YARN, NTK: > 0, default 1 */
  double low_freq_factor;         /* LLAMA3, default 1 */
  double high_freq_factor;        /* LLAMA3, > low_freq_factor, default 4 */
  double beta_fast;               /* YARN, default 32 */
  double beta_slow;               /* YARN, default 1 */
  double attention_factor;        /* multiplies cos and sin; 0 (default) = YARN's
                                     0.1 * ln(factor) + 1 for YARN, 1 otherwise */
  int32_t yarn_truncate;          /* YARN: 1 (default) rounds the ramp ends down/up as
                                     Hugging Face does; 0 keeps them fractional (gpt-oss) */
  kvi_dtype table_dtype;          /* FP32 (default), FP16 or BF16 */
  const void *cos_sin_table;      /* host memory, or NULL (default): see above. Copied. */
  int32_t table_positions;        /* rows of the table; positions must be below it */
} kvi_rope_spec;

#define KVI_ROPE_SPEC_INIT                                                                          \
  {sizeof(kvi_rope_spec), KVI_ROPE_NEOX, 0, 10000.0, KVI_ROPE_SCALING_NONE, 8192, 1.0, 1.0, 4.0, 32.0, \
   1.0, 0.0, 1, KVI_DTYPE_FP32, NULL, 0}

/* Fills *spec with KVI_ROPE_SPEC_INIT for a struct of `size` bytes (pass sizeof *spec):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_rope_spec_init(kvi_rope_spec *spec, size_t size);

/*
 * Sets the RoPE of one layer (0 <= layer < num_layers) or of every layer
 * (layer = -1): per-layer overrides are later calls for single layers (a NoPE
 * layer, a layer with its own theta). spec: host memory; a cos/sin table is
 * copied. With style KVI_ROPE_NONE the other fields are ignored.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, layer out of range, unknown style or
 * scaling, rotary_dim odd or > head_size, theta/factor not finite and > 0,
 * high_freq_factor <= low_freq_factor, original_max_position < 1, a table
 * with table_positions < 1 or a non-float dtype, a table holding a NaN or an
 * infinity; style KVI_ROPE_UNSET), KVI_ERR_STRUCT_SIZE,
 * KVI_ERR_OUT_OF_MEMORY. On error no layer is changed.
 */
KVI_API kvi_status kvi_model_set_rope(kvi_model *model, int32_t layer, const kvi_rope_spec *spec);

/* Reads one layer's RoPE into *out (host memory; set out->struct_size). A
 * resolved spec: rotary_dim is never 0 for a rotated layer, attention_factor
 * is the one applied; a layer never set reads as KVI_ROPE_UNSET (its other
 * fields as for KVI_ROPE_NONE). cos_sin_table points to the model's own fp32 copy
 * (table_dtype FP32), valid while the model lives and its RoPE is unchanged.
 * Errors: KVI_ERR_INVALID_ARGUMENT, KVI_ERR_STRUCT_SIZE. */
KVI_API kvi_status kvi_model_get_rope(const kvi_model *model, int32_t layer, kvi_rope_spec *out);

/*
 * The rotation the model applies to layer `layer` at position `pos`, for
 * pair i (0 <= i < rotary_dim/2): writes cos and sin, attention factor
 * included, to *out_cos / *out_sin (host memory). What the encoder and
 * injector use, exposed so engines and tests can check their own tables.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, layer/pair out of range, a NoPE
 * or unset layer, pos < 0 or past a table's rows).
 */
KVI_API kvi_status kvi_model_rope_cos_sin(const kvi_model *model, int32_t layer, int32_t pos, int32_t pair,
                                          float *out_cos, float *out_sin);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_MODEL_H */
