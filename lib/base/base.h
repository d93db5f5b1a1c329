/*
 * libkvinject — the base part (lib/base/): errors and size-versioned structs,
 * element conversion, model geometry and RoPE, view checks, the hash map,
 * CRC32C. Host code only; it uses no other part.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_BASE_H
#define KVI_BASE_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/fp8.h"
#include "base/q4.h"
#include "kvinject.h"

/* ---- errors (error.c) ---------------------------------------------------- */

/* The status's one-line description (kvi_status_string). */
const char *kvi__status_string(kvi_status status);
/* The calling thread's last error message (kvi_last_error). */
const char *kvi__last_error(void);

/* Records "fn: message" as the thread's last error and returns status. */
kvi_status kvi__fail(kvi_status status, const char *fn, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Copies a caller's size-versioned struct into `local` (already holding the
 * defaults, `known` bytes). Rejects a struct smaller than `min_size` or larger
 * than KVI__STRUCT_SIZE_MAX, and one with non-zero bytes past `known`. */
kvi_status kvi__read_struct(void *local, size_t known, const void *user, size_t min_size,
                            const char *fn, const char *what);

/* The largest struct_size accepted anywhere (KVI_STRUCT_SIZE_MAX). */
#define KVI__STRUCT_SIZE_MAX ((size_t)KVI_STRUCT_SIZE_MAX)

/* A caller's array of n size-versioned structs (common.h): stepped through
 * by elements[0].struct_size, which every element must share. The one reader
 * of such arrays: kvi__struct_array_open, then kvi__struct_array_read per
 * element. */
typedef struct kvi__struct_array {
  const char *base;
  size_t stride;
  int64_t n;
  const char *name; /* the parameter, for messages ("reqs") */
} kvi__struct_array;

/* Opens an array of n (>= 0) elements: the stride must lie in [min_size,
 * KVI__STRUCT_SIZE_MAX] (KVI_ERR_STRUCT_SIZE). Reads nothing for n == 0;
 * elements must not be NULL otherwise. */
kvi_status kvi__struct_array_open(kvi__struct_array *a, const void *elements, int64_t n, size_t min_size,
                                  const char *fn, const char *name);

/* Element i (< a->n) as kvi__read_struct reads one struct into `local`
 * (holding the defaults, `known` bytes); its struct_size must equal the
 * array's stride (KVI_ERR_STRUCT_SIZE). */
kvi_status kvi__struct_array_read(const kvi__struct_array *a, int64_t i, void *local, size_t known, size_t min_size,
                                  const char *fn);

/* A kvi_x_init(ptr, size): NULL is KVI_ERR_INVALID_ARGUMENT, a size below
 * min_size KVI_ERR_STRUCT_SIZE (nothing written); otherwise the first
 * min(size, known) bytes of `defaults` are copied, bytes past `known` (up to
 * size) zeroed, and struct_size set to `size`. Never writes past `size`. */
kvi_status kvi__init_struct(void *user, size_t size, const void *defaults, size_t known, size_t min_size,
                           const char *fn);

/* The first published size of each public struct of the base part: the
 * smallest struct_size accepted. */
#define KVI__MODEL_OPTIONS_V1 sizeof(kvi_model_options)
#define KVI__MODEL_INFO_V1 sizeof(kvi_model_info)
#define KVI__ROPE_SPEC_V1 sizeof(kvi_rope_spec)
#define KVI__KV_VIEW_V1 sizeof(kvi_kv_view)

/* The hash of a fact's token ids (kvinject/store.h, "Token ids"): FNV-1a 64
 * over the ids' bytes as little-endian int32. n == 0 gives the offset basis;
 * a fact without ids has hash 0, which callers write themselves. */
static inline uint64_t kvi__token_hash(const int32_t *ids, int64_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int64_t i = 0; i < n; i++) {
    const uint32_t v = (uint32_t)ids[i];
    for (int b = 0; b < 32; b += 8) h = (h ^ ((v >> b) & 0xffu)) * 0x100000001b3ull;
  }
  return h;
}

/* Checks an output struct's struct_size (>= min_size) and copies the first
 * min(struct_size, known) bytes of `full` into it, keeping its struct_size. */
kvi_status kvi__write_struct(void *user, const void *full, size_t known, size_t min_size,
                             const char *fn, const char *what);

/* ---- element conversion (convert.c) --------------------------------------- */

size_t kvi__dtype_size(kvi_dtype dtype); /* bytes per element; 0 for an unknown dtype and Q4 */
uint64_t kvi__dtype_bytes(kvi_dtype dtype, uint64_t n); /* bytes of n elements (Q4: n / 2 rounded up) */
/* Bytes of the scales of one page of a store of that dtype (L layers, H
 * local heads, head size D, P tokens a page), unpadded, as store files keep
 * them (fp8: the scales, then the key offsets: base/fp8.h); 0 for
 * unquantized dtypes. */
uint64_t kvi__page_scale_bytes(kvi_dtype dtype, int32_t L, int32_t H, int32_t D, int32_t P);
/* 4-bit storage (base/q4.h): codes of n values packed two a byte, value i
 * of the group whose parameter word is w[i * wstep] (keys: wstep 1, a word
 * per channel; values: wstep 0, one word for the row); unpacked likewise;
 * n values folded into a group's bounds (kvi__q4_fold). */
void kvi__q4_pack_row(uint8_t *dst, const float *x, int32_t n, const uint32_t *w, int32_t wstep);
void kvi__q4_unpack_row(float *dst, const uint8_t *src, int32_t n, const uint32_t *w, int32_t wstep);
uint32_t kvi__q4_fold_row(uint32_t bounds, const float *x, int32_t n);
float kvi__bf16_to_f32(uint16_t h);
uint16_t kvi__f32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
float kvi__f16_to_f32(uint16_t h);
uint16_t kvi__f32_to_f16(float f);  /* round to nearest even; overflow -> inf */

uint8_t kvi__f32_to_fp8(float x, kvi_dtype t); /* E4M3/E5M2: nearest even, saturating, NaN kept */
float kvi__fp8_to_f32(uint8_t b, kvi_dtype t);

/* fp8 fact storage (KVI_DTYPE_FP8_E4M3 stores; base/fp8.h defines the
 * arithmetic, shared with the kernels). A group is one (page, layer, K/V,
 * head); m: its key channels' offsets as fp32 (one per element of a row of
 * n), NULL for values (no offset). amax folds the largest finite |x - m|
 * (values |x|) of n more values; each value is stored as
 * e4m3((x - m) / scale) (values e4m3(x / scale)) and read back as
 * fmaf(e4m3, scale, m) (values e4m3 * scale). */
float kvi__fp8_amax(float amax, const float *x, const float *m, int64_t n);
float kvi__fp8_scale(float amax);
void kvi__fp8_quantize(uint8_t *dst, const float *x, const float *m, int64_t n, float scale);
void kvi__fp8_dequantize(float *dst, const uint8_t *src, const float *m, int64_t n, float scale);
/* Key offsets: n channels' fp16 offsets (stored) and their fp32 values (m)
 * from the channels' bounds words (kvi__q4_fold); stored or m may be NULL. */
void kvi__fp8_key_offsets(uint16_t *stored, float *m, const uint32_t *bounds, int32_t n);
/* n stored fp16 offsets as fp32 (NULL: none, all -0, e4m3 * scale). */
void kvi__fp8_offsets_f32(float *m, const uint16_t *stored, int32_t n);

bool kvi__dtype_is_float(kvi_dtype t); /* FP32, FP16, BF16 */
const char *kvi__dtype_name(kvi_dtype t);

/* Loads element i of a buffer of type t as float. */
float kvi__load(const void *p, kvi_dtype t, int64_t i);
/* Converts n contiguous elements. */
void kvi__convert(void *dst, kvi_dtype dt, const void *src, kvi_dtype st, int64_t n);

/* ---- model (model.c) ------------------------------------------------------ */

/* An engine's cos/sin table, converted to fp32, shared (refcounted) by every
 * layer and handle that uses it. */
typedef struct kvi__table {
  _Atomic long refs;
  int32_t positions;
  int32_t rotary_dim;
  float data[]; /* positions x rotary_dim: cos half, then sin half */
} kvi__table;

/* A layer's resolved RoPE. */
typedef struct kvi__rope {
  kvi_rope_style style;   /* NONE: nothing else is used */
  int32_t rotary_dim;
  float attn;             /* attention factor applied with the formula */
  float *inv_freq;        /* rotary_dim/2 values (formula), or NULL with a table */
  kvi__table *table;      /* or NULL */
  kvi_rope_spec spec;     /* as resolved, for kvi_model_get_rope; cos_sin_table NULL */
  bool unset;             /* never set (style NONE meanwhile): injection and capture refuse it */
} kvi__rope;

kvi_status kvi__rope_resolve(kvi__rope *out, const kvi_rope_spec *spec, int32_t head_size, const char *fn);
kvi_status kvi__rope_copy(kvi__rope *dst, const kvi__rope *src, const char *fn); /* shares the table */
void kvi__rope_release(kvi__rope *r);
/* cos/sin (attention factor included) of pair i at position pos; pos must be
 * valid (>= 0, below a table's rows). */
void kvi__rope_cs(const kvi__rope *r, int32_t pos, int32_t i, float *c, float *s);
/* Rotates the first rotary_dim elements of a head vector (fp32) at pos;
 * inverse undoes a forward rotation (dividing by cos^2 + sin^2). */
void kvi__rope_rotate(const kvi__rope *r, float *x, int32_t pos, bool inverse);
/* Largest valid position + 1 for the layer (INT32_MAX without a table). */
int32_t kvi__rope_max_positions(const kvi__rope *r);

/* Resolved geometry, copied into every handle. */
typedef struct kvi__geom {
  int32_t num_layers;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t tp_rank;
  int32_t tp_size;
  int32_t head_first;
  int32_t local_heads;
  int32_t head_replicas;
} kvi__geom;

/* The KV heads [*first, *first + *count) that rank `rank` of g's tp group
 * holds (kvinject/model.h's rule; model.c). */
void kvi__geom_rank_heads(const kvi__geom *g, int32_t rank, int32_t *first, int32_t *count);

struct kvi_model {
  kvi__geom geom;
  kvi__rope *rope; /* num_layers entries */
};

/* The model's entry points' work (kvinject/model.h says what each does and
 * its errors); `fn` names the entry point in messages. */
kvi_status kvi__model_create(kvi_model **out, const kvi_model_options *opts, const char *fn);
void kvi__model_destroy(kvi_model *model);
kvi_status kvi__model_info_get(const kvi_model *model, kvi_model_info *out, const char *fn);
kvi_status kvi__model_set_rope(kvi_model *model, int32_t layer, const kvi_rope_spec *spec, const char *fn);
kvi_status kvi__model_get_rope(const kvi_model *model, int32_t layer, kvi_rope_spec *out, const char *fn);
kvi_status kvi__model_rope_cos_sin(const kvi_model *model, int32_t layer, int32_t pos, int32_t pair, float *out_cos,
                                   float *out_sin, const char *fn);

/* ---- views (view.c) ------------------------------------------------------- */

/* One dimension of a strided array: `extent` indices `stride` elements apart
 * (both >= 0). */
typedef struct kvi__dim {
  int64_t extent, stride;
} kvi__dim;

/* Whether no two indices of the n dimensions reach the same element, by a
 * sufficient condition: ordered by stride (dims is sorted in place), each
 * dimension of extent > 1 steps past everything the smaller ones reach. The
 * extents and strides must not overflow when combined (checked by the
 * caller's extent computation). */
bool kvi__dims_disjoint(kvi__dim *dims, int n);

/* kvi_kv_view_contiguous: a dense [layer][token][head][dim] view. */
void kvi__kv_view_contiguous(kvi_kv_view *view, kvi_memory memory, kvi_dtype dtype, int32_t num_layers,
                             int32_t num_tokens, int32_t num_heads, int32_t head_size, void *k, void *v);

/* Validates a kv view against the geometry (layers, local heads, head size),
 * copies it into *out (a full-size local struct), and checks extents for
 * overflow; `dst` also requires non-overlapping strides. */
kvi_status kvi__view_check(kvi_kv_view *out, const kvi_kv_view *user, const kvi__geom *g,
                           bool dst, const char *fn);

/* ---- hash map (hashmap.c) --------------------------------------------------- */

/* Open addressing, linear probing, backward-shift deletion: no tombstones.
 * Keys are pairs of 64-bit integers; values are non-NULL pointers. */
typedef struct kvi__map_slot {
  uint64_t k1, k2;
  void *val; /* NULL = empty */
} kvi__map_slot;

typedef struct kvi__map {
  kvi__map_slot *slots;
  size_t cap; /* power of two, or 0 */
  size_t len;
} kvi__map;

void *kvi__map_get(const kvi__map *m, uint64_t k1, uint64_t k2);
/* out[i] = kvi__map_get(m, k1[i * k1_step], k2[i]) for i < n (k1_step 0:
 * one k1 for all), the cache misses of the lookups overlapped by
 * prefetching; each value found is prefetched too. */
void kvi__map_get_many(const kvi__map *m, const uint64_t *k1, size_t k1_step, const uint64_t *k2, size_t n,
                       void **out);
/* Makes room for one more entry; call before kvi__map_put so that a put
 * never fails after other state has changed. */
kvi_status kvi__map_reserve(kvi__map *m, size_t extra, const char *fn);
void kvi__map_put(kvi__map *m, uint64_t k1, uint64_t k2, void *val); /* key absent, room reserved */
void *kvi__map_del(kvi__map *m, uint64_t k1, uint64_t k2);
void kvi__map_free(kvi__map *m);

/* splitmix64's finalizer: a fixed, well-mixed hash of a 64-bit key. */
static inline uint64_t kvi__mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* ---- CRC32C (crc32c.c) ------------------------------------------------------ */

/* CRC32C (Castagnoli) of n bytes, continuing from crc (0 to start). */
uint32_t kvi__crc32c(uint32_t crc, const void *data, size_t n);

#endif /* KVI_BASE_H */
