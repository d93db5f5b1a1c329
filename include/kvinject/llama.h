/*
 * libkvinject — llama.cpp's sequence state as an injection target and a
 * capture source.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * llama.cpp exchanges one sequence's KV cells through its public API:
 * llama_state_seq_get_data / llama_state_seq_set_data (and the _ext variants
 * with flags 0). The bytes ("a state") are, in this order, all little-endian:
 *
 *   u32 magic (KVI_LLAMA_STATE_MAGIC), i32 seq id,
 *   then one section per KV cache (one; two for iSWA models: the full-
 *   attention cache, then the sliding-window one):
 *     u32 stream count; per stream: u32 cell count, and when it is not 0:
 *       per cell: i32 position, u32 seq-id count (1), i32 seq id;
 *       u32 v_trans, u32 layer count;
 *       per layer: i32 ggml type of K, u64 K row bytes, one K row per cell
 *         (all KV heads of the token, head-major: [cells][heads][head size]);
 *       V: per layer as K (v_trans 0, flash attention on), or (v_trans 1)
 *         i32 ggml type, u32 element bytes, u32 row elements (heads x head
 *         size), then element-major data: [heads x head size][cells].
 *
 * Keys in a state are rotated (RoPE) at their cells' positions. A state can
 * therefore be seen as a cache with one block of `cells` tokens, and the
 * ordinary injector and encoder (kvinject/inject.h) work on it:
 * kvi_llama_state_layout gives the kvi_cache_layout of a state's cells (its
 * block table is {0}, a cell's index is its slot), kvi_inject writes facts
 * into a state (keys rotated at the positions given to it), kvi_encode
 * captures them from one (keys un-rotated). kvi_llama_state_write_header
 * lays out a fresh state for n cells at given positions, to inject into and
 * hand to llama_state_seq_set_data.
 *
 * RoPE: llama.cpp rotates Llama-family keys with its "NORM" type, adjacent
 * pairs (x_2i, x_2i+1): KVI_ROPE_GPTJ, with the model's rope.freq_base as
 * theta. (Its converter permutes the Q/K weights so that this pairing
 * reproduces the original model.) NEOX-type models (Qwen2, GPT-NeoX, ...)
 * use KVI_ROPE_NEOX. kvi_llama_rope_table gives the cos/sin values exactly
 * as llama.cpp's CPU backend computes them, for kvi_rope_spec.cos_sin_table.
 *
 * Supported: K and V of one dtype among f32, f16 and bf16 (ggml types 0, 1,
 * 30), V per cell or transposed (flash attention on or off), every layer of
 * a section with the same row size, cells of one sequence (what llama.cpp
 * writes for a seq id >= 0), any number of streams of which at most one
 * holds cells. What is not supported (quantized caches, per-layer row
 * sizes, K and V of different types, cells of several sequences) is
 * refused with
 * KVI_ERR_UNSUPPORTED; bytes that do not follow the format are
 * KVI_ERR_CORRUPT, a state for another model geometry KVI_ERR_MISMATCH.
 * Every size is checked before it is used (64-bit, overflow-checked): a call
 * never reads or writes past `size` bytes.
 *
 * Memory: states live in host memory (ordinary memory for a CPU store). For
 * a CUDA store the state must be in pinned host memory mapped into the
 * device's address space (cudaHostAlloc / cudaMallocHost on a system with
 * unified addressing): give its layout KVI_MEMORY_DEVICE and the kernels
 * write and read it over the bus, in place. (llama.cpp's
 * LLAMA_STATE_SEQ_FLAGS_ON_DEVICE keeps tensor data in buffers private to
 * the context, which no caller can write: it is no injection path.)
 *
 * Thread rules: these functions keep no state; they may be called from any
 * thread, concurrently on different states (and concurrently on one state
 * when all of them only read it).
 */
#ifndef KVINJECT_LLAMA_H
#define KVINJECT_LLAMA_H

#include "kvinject/cache.h"
#include "kvinject/common.h"
#include "kvinject/model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The first word of every sequence state (llama.cpp's io magic). */
#define KVI_LLAMA_STATE_MAGIC 0xaf143cd8u

/* ggml type ids of the cache dtypes the library reads and writes. */
#define KVI_LLAMA_GGML_F32 0
#define KVI_LLAMA_GGML_F16 1
#define KVI_LLAMA_GGML_BF16 30

/* Sections one state holds at most (iSWA: base and sliding window). */
#define KVI_LLAMA_MAX_SECTIONS 2

/* One KV cache of a state. Offsets are bytes from the state's first byte. */
typedef struct kvi_llama_section {
  int32_t num_streams;    /* streams the cache has (its u32 stream count) */
  int32_t stream;         /* the stream that holds the cells; -1: none does */
  int32_t num_cells;      /* cells of the sequence (0: an empty section) */
  int32_t v_trans;        /* 0: V rows per cell; 1: V element-major */
  int32_t num_layers;     /* layers of this cache (0 when empty) */
  kvi_dtype dtype;        /* K and V element type (0 when empty) */
  int32_t k_row_elements; /* K elements per cell and layer: heads x head size */
  int32_t v_row_elements; /* V elements per cell and layer */
  uint64_t cells_offset;  /* the first cell record (i32 pos, u32 1, i32 seq) */
  uint64_t k_offset;      /* layer 0's K data */
  uint64_t v_offset;      /* layer 0's V data */
  uint64_t layer_bytes;   /* from one layer's K (or V) data to the next's */
  uint64_t end_offset;    /* one past the section's last byte */
} kvi_llama_section;

/* What kvi_llama_state_parse finds. An output struct: set struct_size (use
 * KVI_LLAMA_STATE_INFO_INIT); the library writes only the first struct_size
 * bytes. */
typedef struct kvi_llama_state_info {
  size_t struct_size;  /* sizeof(kvi_llama_state_info) */
  int32_t seq_id;      /* the seq id the state was taken from */
  int32_t num_sections; /* 1, or 2 (iSWA) */
  uint64_t size;       /* bytes the state occupies (the end of its last section) */
  kvi_llama_section sections[KVI_LLAMA_MAX_SECTIONS];
} kvi_llama_state_info;

/* An all-zero kvi_llama_section initializer (used by KVI_LLAMA_STATE_INFO_INIT). */
#define KVI_LLAMA_SECTION_ZERO {0, 0, 0, 0, 0, KVI_ENUM_ZERO(kvi_dtype), 0, 0, 0, 0, 0, 0, 0}
#define KVI_LLAMA_STATE_INFO_INIT \
  {sizeof(kvi_llama_state_info), 0, 0, 0, {KVI_LLAMA_SECTION_ZERO, KVI_LLAMA_SECTION_ZERO}}

/*
 * Parses and validates a state: state is `size` bytes of host memory (the
 * whole buffer llama_state_seq_get_data filled; its return value is the
 * size). The state must end exactly at `size`. Writes *out (host memory).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL), KVI_ERR_STRUCT_SIZE,
 * KVI_ERR_CORRUPT (a wrong magic, a count or size past the buffer or out of
 * range, row bytes that are not a whole number of elements, trailing bytes;
 * the message names the offset), KVI_ERR_UNSUPPORTED (see above).
 */
KVI_API kvi_status kvi_llama_state_parse(const void *state, size_t size, kvi_llama_state_info *out);

/*
 * The cache layout of section `section`'s cells: dtype, one block of
 * num_cells tokens (num_blocks 1; block table {0}; cell i is slot i),
 * strides (transposed V: V's own token, head and dim strides), base
 * pointers into `state`, and `memory` (HOST for a CPU store;
 * DEVICE for a CUDA store, with the state in mapped pinned memory). The
 * state is parsed as by kvi_llama_state_parse and checked against `model`:
 * the section's layers must be the model's, its row elements the model's
 * KV heads (all of them, before tensor parallelism) x head size; a
 * tensor-parallel rank's layout addresses its own heads' slice of every row.
 * Section 1 of an iSWA state is the sliding-window cache: give a model of
 * that cache's layers. *out references `state`, which must stay valid while
 * an injector or encoder made from the layout is in use.
 * Errors: those of kvi_llama_state_parse; KVI_ERR_INVALID_ARGUMENT (NULL, a
 * section out of range, a bad memory kind, a section with no cells),
 * KVI_ERR_MISMATCH (layers or row size differ from the model).
 */
KVI_API kvi_status kvi_llama_state_layout(void *state, size_t size, int32_t section, const kvi_model *model,
                                          kvi_memory memory, kvi_cache_layout *out);

/*
 * Copies the positions of cells [first_cell, first_cell + num_cells) of
 * section `section` into out (host memory, num_cells values): the positions
 * to capture those cells with (kvi_capture.positions).
 * Errors: those of kvi_llama_state_parse; KVI_ERR_INVALID_ARGUMENT (NULL, a
 * section or cell range out of range).
 */
KVI_API kvi_status kvi_llama_state_positions(const void *state, size_t size, int32_t section, int32_t first_cell,
                                             int32_t num_cells, int32_t *out);

/* What kvi_llama_state_write_header lays out: one section (a model without
 * sliding-window layers). Initialize with KVI_LLAMA_STATE_SPEC_INIT. */
typedef struct kvi_llama_state_spec {
  size_t struct_size;       /* sizeof(kvi_llama_state_spec) */
  int32_t seq_id;           /* >= 0, written into the state (llama.cpp reads the
                               cells into the seq id given to set_data) */
  int32_t num_streams;      /* the context's stream count: 1 (default) with a
                               unified cache, n_seq_max without */
  int32_t stream;           /* the stream that holds the cells, default 0 */
  int32_t num_cells;        /* >= 1 */
  const int32_t *positions; /* host memory, num_cells positions >= 0, or NULL:
                               start_position + i */
  int32_t start_position;   /* >= 0 */
  int32_t v_trans;          /* 0 (flash attention, default) or 1 */
  kvi_dtype dtype;          /* FP32, FP16 or BF16 (the context's type_k = type_v) */
} kvi_llama_state_spec;

#define KVI_LLAMA_STATE_SPEC_INIT \
  {sizeof(kvi_llama_state_spec), 0, 1, 0, 0, NULL, 0, 0, KVI_ENUM_ZERO(kvi_dtype)}

/* Fills *spec with KVI_LLAMA_STATE_SPEC_INIT for a struct of `size` bytes (pass
 * sizeof *spec): see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_llama_state_spec_init(kvi_llama_state_spec *spec, size_t size);

/* The bytes a state of `spec` takes for `model` (its layers; per row all of
 * the model's KV heads x head size, as llama.cpp's rows hold every KV head and
 * kvi_llama_state_layout requires), into *out_size (host memory).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, a field out of range, a size that
 * overflows), KVI_ERR_STRUCT_SIZE. */
KVI_API kvi_status kvi_llama_state_size(const kvi_model *model, const kvi_llama_state_spec *spec, size_t *out_size);

/*
 * Writes a fresh state's metadata into state (host memory, size bytes, at
 * least kvi_llama_state_size): magic, seq id, streams, cells with their
 * positions and seq id, v_trans, layer count and every layer's type and row
 * size. The K and V data regions are not written: fill every cell (by
 * kvi_inject through kvi_llama_state_layout, or by copying rows) before the
 * state goes to llama_state_seq_set_data. Bytes past the state are left
 * alone. On error nothing is written.
 * Errors: those of kvi_llama_state_size; KVI_ERR_INVALID_ARGUMENT (size too
 * small, a negative position).
 */
KVI_API kvi_status kvi_llama_state_write_header(void *state, size_t size, const kvi_model *model,
                                                const kvi_llama_state_spec *spec);

/*
 * A RoPE cos/sin table (kvi_rope_spec.cos_sin_table, FP32, table_positions =
 * positions) with the values llama.cpp's CPU backend uses for a model
 * without YaRN: pair i of position p has the angle p * freq_scale * s^i with
 * s = powf(freq_base, -2 / rotary_dim), the power taken by repeated fp32
 * products as llama.cpp does, and cosf / sinf of it. out: host memory,
 * positions x rotary_dim floats (row p: rotary_dim/2 cosines, then sines).
 * With it, the injector rotates with exactly llama.cpp's angles.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, positions < 1, rotary_dim odd or
 * < 2, freq_base or freq_scale not finite and > 0).
 */
KVI_API kvi_status kvi_llama_rope_table(float *out, int32_t positions, int32_t rotary_dim, float freq_base,
                                        float freq_scale);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_LLAMA_H */
