/*
 * libkvinject — the gpu part (lib/gpu/): every CUDA runtime call and the
 * stubs without CUDA (cuda_rt.c), the plumbing the CUDA handles share
 * (gpu_ring.c), cuBLASLt, and optional libraries opened on first use
 * (dynlib.c). The kernels' C interface is kernels.h beside it; the kernels
 * themselves are in cuda/, which belongs to this part.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_GPU_H
#define KVI_GPU_H

#include <pthread.h>

#include "base/base.h"

struct CUevent_st; /* cudaEvent_t */

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
kvi_status kvi__cuda_cc_major(int device, int *major, const char *fn); /* compute capability's major */
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

/* Checks that a buffer declared as `declared` memory really is, and that a
 * device buffer is on `device`. `cuda_store` says whether device memory is
 * acceptable at all. */
kvi_status kvi__check_memory(const void *p, kvi_memory declared, bool cuda_store, int device,
                             const char *fn, const char *what);

/* ---- optional shared libraries (dynlib.c) ------------------------------------
 * cuBLASLt and NCCL are opened on first use instead of being linked, so that
 * libkvinject.so loads where they are absent. */

/*
 * A library and the functions taken from it: `table` receives their
 * addresses in the order of `names` (NULL-terminated). `once` calls
 * kvi__dynlib_open on this descriptor; pthread_once runs it at most once per
 * process. Define one with KVI__DYNLIB below.
 */
typedef struct kvi__dynlib {
  const char *soname; /* "libnccl.so.2" */
  const char *what;   /* "NCCL" */
  const char *const *names;
  void **table;
  pthread_once_t once_flag;
  void (*once)(void);
  kvi_status status;  /* valid after the first kvi__dynlib_get / _usable */
  char error[384];
} kvi__dynlib;

/* What `once` calls: dlopen, then dlsym of every name. */
void kvi__dynlib_open(kvi__dynlib *d);

/* Opens the library on the first call (thread-safe); KVI_OK when it and
 * every function loaded, else KVI_ERR_NOT_BUILT with a message naming the
 * library and dlerror()'s text, recorded for `fn`. */
kvi_status kvi__dynlib_get(kvi__dynlib *d, const char *fn);

/* Whether the library loads (opening it if not tried yet); records no error. */
bool kvi__dynlib_usable(kvi__dynlib *d);

/*
 * KVI__DYNLIB(p, soname, what, FUNCS) defines the descriptor `p##_lib` for
 * the functions FUNCS(X) lists (X(name) each), and KVI__DYNFN(p, name) is the
 * loaded function, typed as the header declares it. A file then routes its
 * calls through the table with one line per function,
 *   #define ncclSend KVI__DYNFN(nccl, ncclSend)
 * (a macro is not expanded inside itself, so the name in the expansion is
 * the header's declaration) and calls the functions by their own names after
 * p##_lib has loaded.
 */
#define KVI__DYNLIB_INDEX(f) KVI__DYN_I_##f,
#define KVI__DYNLIB_NAME(f) #f,
#define KVI__DYNLIB(p, soname, what, FUNCS)                                                                \
  enum { FUNCS(KVI__DYNLIB_INDEX) p##_nfuncs };                                                            \
  static const char *const p##_names[] = {FUNCS(KVI__DYNLIB_NAME) NULL};                                   \
  static void *p##_table[p##_nfuncs];                                                                      \
  static void p##_once(void);                                                                              \
  static kvi__dynlib p##_lib = {soname, what, p##_names, p##_table, PTHREAD_ONCE_INIT, p##_once, KVI_OK, ""}; \
  static void p##_once(void) { kvi__dynlib_open(&p##_lib); }
#define KVI__DYNFN(p, f) ((__typeof__(&f))p##_table[KVI__DYN_I_##f])

#define KVI__STR_(x) #x
#define KVI__STR(x) KVI__STR_(x)

#endif /* KVI_GPU_H */
