/*
 * libkvinject — internal declarations shared across lib/ and cuda/.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_INTERNAL_H
#define KVI_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvinject.h"

struct CUevent_st; /* cudaEvent_t */

/* ---- errors (error.c) ---------------------------------------------------- */

/* Records "fn: message" as the thread's last error and returns status. */
kvi_status kvi__fail(kvi_status status, const char *fn, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Copies a caller's size-versioned struct into `local` (already holding the
 * defaults, `known` bytes). Rejects a struct smaller than `min_size` and one
 * with non-zero bytes past `known`. */
kvi_status kvi__read_struct(void *local, size_t known, const void *user, size_t min_size,
                            const char *fn, const char *what);

/* A kvi_x_init(ptr, size): NULL is KVI_ERR_INVALID_ARGUMENT, a size below
 * min_size KVI_ERR_STRUCT_SIZE (nothing written); otherwise the first
 * min(size, known) bytes of `defaults` are copied, bytes past `known` (up to
 * size) zeroed, and struct_size set to `size`. Never writes past `size`. */
kvi_status kvi__init_struct(void *user, size_t size, const void *defaults, size_t known, size_t min_size,
                           const char *fn);

/* Checks an output struct's struct_size (>= min_size) and copies the first
 * min(struct_size, known) bytes of `full` into it, keeping its struct_size. */
kvi_status kvi__write_struct(void *user, const void *full, size_t known, size_t min_size,
                             const char *fn, const char *what);

/* The first version of kvi_search_options (read by search.c and transfer.c). */
#define KVI__SEARCH_OPTIONS_V1 sizeof(kvi_search_options)

/* ---- element conversion (convert.c) --------------------------------------- */

float kvi__bf16_to_f32(uint16_t h);
uint16_t kvi__f32_to_bf16(float f); /* round to nearest even; NaN stays NaN */
float kvi__f16_to_f32(uint16_t h);
uint16_t kvi__f32_to_f16(float f);  /* round to nearest even; overflow -> inf */

uint8_t kvi__f32_to_fp8(float x, kvi_dtype t); /* E4M3/E5M2: nearest even, saturating, NaN kept */
float kvi__fp8_to_f32(uint8_t b, kvi_dtype t);

/* fp8 fact storage (KVI_DTYPE_FP8_E4M3 stores; the constants live in
 * kernels.h so the kernels share them). A group is one (page, layer, K/V,
 * head): amax is the largest finite |x| of its values in fp32 (NaN and
 * infinities skipped), scale = max(amax / 448, 2^-126) in fp32, each value is
 * stored as e4m3(x / scale) (nearest even, saturating: infinities become
 * +-448, NaN stays NaN) and read back as e4m3 * scale. */
float kvi__fp8_amax(float amax, const float *x, int64_t n); /* amax folded over n more values */
float kvi__fp8_scale(float amax);
void kvi__fp8_quantize(uint8_t *dst, const float *x, int64_t n, float scale);
void kvi__fp8_dequantize(float *dst, const uint8_t *src, int64_t n, float scale);

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

/* Validates a kv view against the geometry (layers, local heads, head size),
 * copies it into *out (a full-size local struct), and checks extents for
 * overflow; `dst` also requires non-overlapping strides. */
kvi_status kvi__view_check(kvi_kv_view *out, const kvi_kv_view *user, const kvi__geom *g,
                           bool dst, const char *fn);

/* ---- CUDA runtime glue (cuda_rt.c) ------------------------------------------ */

/* What a pointer is, as far as the CUDA driver can tell. */
typedef enum kvi__ptr_kind {
  KVI__PTR_UNKNOWN = 0, /* no CUDA here, or no driver: cannot tell */
  KVI__PTR_HOST,        /* host memory (pageable or pinned) */
  KVI__PTR_DEVICE,      /* device memory */
  KVI__PTR_MANAGED      /* managed memory, reachable from both */
} kvi__ptr_kind;

typedef struct kvi__devguard {
  int prev;
  bool switched;
} kvi__devguard;

int kvi__cuda_count(void);  /* usable devices; 0 without CUDA/driver/device */
kvi__ptr_kind kvi__cuda_ptr_kind(const void *p, int *device);
/* Pinned host memory that the device reaches at the same address (mapped,
 * unified addressing): kernels may read and write it in place. */
bool kvi__cuda_host_mapped(const void *p);
kvi_status kvi__cuda_current_device(int *dev, const char *fn);
kvi_status kvi__cuda_enter(int device, kvi__devguard *g, const char *fn);
void kvi__cuda_leave(kvi__devguard *g);
kvi_status kvi__cuda_malloc(void **p, size_t bytes, const char *fn);
kvi_status kvi__cuda_host_alloc(void **p, size_t bytes, const char *fn);
void kvi__cuda_free(void *p);
void kvi__cuda_host_free(void *p);
kvi_status kvi__cuda_h2d(void *dst, const void *src, size_t bytes, struct CUstream_st *s,
                         const char *fn);
kvi_status kvi__cuda_d2h(void *dst, const void *src, size_t bytes, struct CUstream_st *s,
                         const char *fn);
kvi_status kvi__cuda_sync(struct CUstream_st *s, const char *fn);
kvi_status kvi__cuda_stream_create(struct CUstream_st **s, const char *fn); /* non-blocking */
void kvi__cuda_stream_destroy(struct CUstream_st *s);
kvi_status kvi__cuda_event_create(struct CUevent_st **e, const char *fn); /* timing disabled */
void kvi__cuda_event_destroy(struct CUevent_st *e);
kvi_status kvi__cuda_event_record(struct CUevent_st *e, struct CUstream_st *s, const char *fn);
bool kvi__cuda_event_done(struct CUevent_st *e); /* completed (or failed: never blocks forever) */
kvi_status kvi__cuda_event_sync(struct CUevent_st *e, const char *fn);
kvi_status kvi__cuda_host_alloc_mapped(void **host, void **dev, size_t bytes, const char *fn);
/* A launch's own cudaError_t (already taken off cudaGetLastError) as a status. */
kvi_status kvi__cuda_error(int err, const char *fn, const char *what);
/* Stream-ordered allocation (the device's default memory pool); freeing NULL is a no-op. */
kvi_status kvi__cuda_malloc_async(void **p, size_t bytes, struct CUstream_st *s, const char *fn);
kvi_status kvi__cuda_free_async(void *p, struct CUstream_st *s, const char *fn);
kvi_status kvi__cuda_d2d(void *dst, const void *src, size_t bytes, struct CUstream_st *s, const char *fn);
kvi_status kvi__cuda_stream_wait(struct CUstream_st *s, struct CUevent_st *e, const char *fn);
kvi_status kvi__cuda_sm_count(int device, int *count, const char *fn);
/* Copies between any two of device and pinned host memory (the runtime
 * tells which from the addresses), and the pitched form. */
kvi_status kvi__cuda_copy(void *dst, const void *src, size_t bytes, struct CUstream_st *s, const char *fn);
kvi_status kvi__cuda_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                            struct CUstream_st *s, const char *fn);

/* ---- GPU plumbing (gpu_ring.c): event tracker, staging ring, async counter */

/* Every function below runs with the owner's device current and under the
 * owner's serialization (its lock); none of them locks anything itself. */

/* An event tracker: N events recorded in turn and numbered in recording
 * order; number q is ev[q % n]. Every number below `done` has completed;
 * numbers in [done, next) may still run. */
typedef struct kvi__events {
  struct CUevent_st **ev;
  uint32_t n;
  uint64_t next, done;
} kvi__events;

kvi_status kvi__events_init(kvi__events *t, uint32_t n, const char *fn);
void kvi__events_destroy(kvi__events *t); /* does not wait; zeroes *t */
/* Records the next number on stream `s` into *seq (may be NULL); with every
 * event in flight, first waits for the oldest. */
kvi_status kvi__events_record(kvi__events *t, struct CUstream_st *s, uint64_t *seq, const char *fn);
/* Advances `done` past completed events; `wait`: blocks until all have. */
kvi_status kvi__events_retire(kvi__events *t, bool wait, const char *fn);
/* Whether number q may still run (recorded, not retired, not completed). */
bool kvi__events_pending(const kvi__events *t, uint64_t q);
/* Waits on the host for number q (no-op once it has completed), then retires. */
kvi_status kvi__events_sync(kvi__events *t, uint64_t q, const char *fn);
/* Makes stream `on` wait for number q, or for every number that may still
 * run (all). No-op for what has completed. */
kvi_status kvi__events_order(const kvi__events *t, uint64_t q, struct CUstream_st *on, const char *fn);
kvi_status kvi__events_order_all(const kvi__events *t, struct CUstream_st *on, const char *fn);

/* A pinned staging ring: n slots of pinned host memory (and, with
 * KVI__RING_DEVICE, a device buffer of the same size each), each guarded by
 * a tracker of one event: the end of the slot's last copy or launch. */
#define KVI__RING_DEVICE 1u /* each slot has a device buffer too */
#define KVI__RING_GROW 2u   /* acquire grows a slot that is too small */

typedef struct kvi__ring_slot {
  char *host;     /* pinned */
  char *dev;      /* KVI__RING_DEVICE: device memory of the same size, else NULL */
  size_t bytes;
  kvi__events ev; /* one event: recorded after the slot's last use */
  bool held;      /* acquired with a lock and not yet released */
} kvi__ring_slot;

typedef struct kvi__ring {
  kvi__ring_slot *slot;
  int n, next;
  unsigned flags;
  pthread_cond_t cond; /* a held slot was released */
  bool has_cond;
} kvi__ring;

/* n slots of `bytes` each (0: allocated by the first acquire, GROW only). */
kvi_status kvi__ring_init(kvi__ring *r, int n, size_t bytes, unsigned flags, const char *fn);
/* Frees everything, after waiting for every slot's last event. Zeroes *r;
 * destroying a zeroed ring is a no-op. */
void kvi__ring_destroy(kvi__ring *r, const char *fn);
/* The next slot in turn that is not held, once its last event has completed,
 * of at least `bytes` bytes: a GROW ring replaces a smaller slot's memory
 * with max(bytes, 2 x its size); otherwise a larger request is
 * KVI_ERR_INTERNAL. lock NULL: the caller is done with each slot before its
 * next acquire (the slot is not held). lock non-NULL (held by the caller):
 * the slot is held until kvi__ring_release, and when every slot is held the
 * call waits on the ring's condition with that lock. */
kvi_status kvi__ring_acquire(kvi__ring *r, size_t bytes, pthread_mutex_t *lock, kvi__ring_slot **out,
                             const char *fn);
/* The slot's latest use is enqueued on `s`: records its event there (the
 * next acquire of the slot waits for it). Recorded again before the next
 * acquire, the event moves to the later point. */
kvi_status kvi__ring_record(kvi__ring_slot *sl, struct CUstream_st *s, const char *fn);
/* Waits on the host for the slot's last recorded event. Touches the slot
 * only: a caller holding the slot may call it without the owner's lock. */
kvi_status kvi__ring_wait(kvi__ring_slot *sl, const char *fn);
/* Ends a hold (acquire with a lock, the lock held) and wakes waiters. */
void kvi__ring_release(kvi__ring *r, kvi__ring_slot *sl);

/* A mapped async-error counter: a 64-bit count in mapped pinned host memory
 * that kernels add to through `dev`, read on the host without synchronizing
 * (it holds what completed work added). */
typedef struct kvi__async_count {
  unsigned long long *host; /* mapped pinned */
  unsigned long long *dev;  /* the device's address of host */
  unsigned long long taken; /* the value the last take returned up to */
} kvi__async_count;

kvi_status kvi__async_count_init(kvi__async_count *c, const char *fn); /* zero */
void kvi__async_count_destroy(kvi__async_count *c);                   /* zeroes *c */
/* What was added since the previous take (read and clear); 0 for a
 * zeroed (never initialized) counter. */
int64_t kvi__async_count_take(kvi__async_count *c);

/* ---- cuBLASLt (cuda_rt.c; KVI_ERR_NOT_BUILT without it) ------------------- */

/* Opens libcublasLt on the first call (lib/gpu/dynlib.c): KVI_OK, or
 * KVI_ERR_NOT_BUILT naming the library (not built in, or it does not load). */
kvi_status kvi__lt_load(const char *fn);
bool kvi__lt_usable(void); /* the same, recording no error */
/* A cuBLASLt handle with a small cache of chosen algorithms (kvi__lt_create
 * loads the library first). */
typedef struct kvi__lt kvi__lt;
kvi_status kvi__lt_create(kvi__lt **out, const char *fn);
void kvi__lt_destroy(kvi__lt *lt);
/*
 * Scores of n queries against m rows: C[j * ldc + i] = sum over e < K of
 * A[i * lda + e] * B[j * ldb + e] for i < m, j < n, with A and B of dtype t
 * (FP16, BF16: fp32 accumulation; FP32: fp32, no TF32) and C fp32, all
 * device memory. Column-major, that is C (m x n) = A^T (m x K) * B (K x n).
 * Enqueued on `stream` with `ws` (ws_bytes) as cuBLASLt's workspace.
 * KVI_ERR_UNSUPPORTED when cuBLASLt offers no algorithm for the shape.
 */
kvi_status kvi__lt_scores(kvi__lt *lt, kvi_dtype t, const void *A, int64_t lda, const void *B, int64_t ldb, float *C,
                          int64_t ldc, int64_t m, int64_t n, int64_t K, void *ws, size_t ws_bytes,
                          struct CUstream_st *stream, const char *fn);

/* Whether libnccl loads (comm.c; false without NCCL in the build). */
bool kvi__nccl_usable(void);

/* Checks that a buffer declared as `declared` memory really is, and that a
 * device buffer is on `device`. `cuda_store` says whether device memory is
 * acceptable at all. */
kvi_status kvi__check_memory(const void *p, kvi_memory declared, bool cuda_store, int device,
                             const char *fn, const char *what);

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

#endif /* KVI_INTERNAL_H */
