/*
 * CUDA runtime glue: device choice and guard, allocation, copies, pointer
 * classification. Without CUDA every entry point answers "none" or
 * KVI_ERR_NOT_BUILT, so the rest of the library needs no #ifdefs.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

#ifdef KVI_HAVE_CUDA
#include <cuda_runtime_api.h>

static kvi_status cuda_fail(cudaError_t e, const char *fn, const char *call) {
  cudaGetLastError(); /* clear a non-sticky error so it is not reported again later */
  return kvi__fail(e == cudaErrorMemoryAllocation ? KVI_ERR_OUT_OF_MEMORY : KVI_ERR_CUDA, fn,
                   "%s failed: %s (%s)", call, cudaGetErrorString(e), cudaGetErrorName(e));
}

int kvi__cuda_count(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

kvi__ptr_kind kvi__cuda_ptr_kind(const void *p, int *device) {
  struct cudaPointerAttributes a;
  if (kvi__cuda_count() == 0) return KVI__PTR_UNKNOWN;
  cudaError_t e = cudaPointerGetAttributes(&a, p);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return KVI__PTR_UNKNOWN;
  }
  if (device) *device = a.device;
  switch (a.type) {
  case cudaMemoryTypeDevice: return KVI__PTR_DEVICE;
  case cudaMemoryTypeManaged: return KVI__PTR_MANAGED;
  default: return KVI__PTR_HOST; /* unregistered or pinned host memory */
  }
}

bool kvi__cuda_host_mapped(const void *p) {
  struct cudaPointerAttributes a;
  if (kvi__cuda_count() == 0) return false;
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeHost && a.devicePointer == p;
}

kvi_status kvi__cuda_current_device(int *dev, const char *fn) {
  cudaError_t e = cudaGetDevice(dev);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaGetDevice");
}

kvi_status kvi__cuda_enter(int device, kvi__devguard *g, const char *fn) {
  g->switched = false;
  cudaError_t e = cudaGetDevice(&g->prev);
  if (e != cudaSuccess) return cuda_fail(e, fn, "cudaGetDevice");
  if (g->prev != device) {
    e = cudaSetDevice(device);
    if (e != cudaSuccess) return cuda_fail(e, fn, "cudaSetDevice");
    g->switched = true;
  }
  return KVI_OK;
}

void kvi__cuda_leave(kvi__devguard *g) {
  if (g->switched) cudaSetDevice(g->prev);
  g->switched = false;
}

kvi_status kvi__cuda_malloc(void **p, size_t bytes, const char *fn) {
  cudaError_t e = cudaMalloc(p, bytes);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMalloc");
}

kvi_status kvi__cuda_host_alloc(void **p, size_t bytes, const char *fn) {
  cudaError_t e = cudaHostAlloc(p, bytes, cudaHostAllocDefault);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaHostAlloc");
}

void kvi__cuda_free(void *p) {
  if (p) cudaFree(p);
}

void kvi__cuda_host_free(void *p) {
  if (p) cudaFreeHost(p);
}

kvi_status kvi__cuda_h2d(void *dst, const void *src, size_t bytes, struct CUstream_st *s,
                         const char *fn) {
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMemcpyAsync (host to device)");
}

kvi_status kvi__cuda_d2h(void *dst, const void *src, size_t bytes, struct CUstream_st *s,
                         const char *fn) {
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMemcpyAsync (device to host)");
}

kvi_status kvi__cuda_sync(struct CUstream_st *s, const char *fn) {
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaStreamSynchronize");
}

kvi_status kvi__cuda_stream_create(struct CUstream_st **s, const char *fn) {
  cudaStream_t st;
  cudaError_t e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  if (e != cudaSuccess) return cuda_fail(e, fn, "cudaStreamCreateWithFlags");
  *s = (struct CUstream_st *)st;
  return KVI_OK;
}

void kvi__cuda_stream_destroy(struct CUstream_st *s) {
  if (s) cudaStreamDestroy((cudaStream_t)s);
}

kvi_status kvi__cuda_event_create(struct CUevent_st **e, const char *fn) {
  cudaEvent_t ev;
  cudaError_t r = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (r != cudaSuccess) return cuda_fail(r, fn, "cudaEventCreateWithFlags");
  *e = (struct CUevent_st *)ev;
  return KVI_OK;
}

void kvi__cuda_event_destroy(struct CUevent_st *e) {
  if (e) cudaEventDestroy((cudaEvent_t)e);
}

kvi_status kvi__cuda_event_record(struct CUevent_st *e, struct CUstream_st *s, const char *fn) {
  cudaError_t r = cudaEventRecord((cudaEvent_t)e, (cudaStream_t)s);
  return r == cudaSuccess ? KVI_OK : cuda_fail(r, fn, "cudaEventRecord");
}

bool kvi__cuda_event_done(struct CUevent_st *e) {
  cudaError_t r = cudaEventQuery((cudaEvent_t)e);
  if (r == cudaErrorNotReady) return false;
  if (r != cudaSuccess) cudaGetLastError();
  return true;
}

kvi_status kvi__cuda_event_sync(struct CUevent_st *e, const char *fn) {
  cudaError_t r = cudaEventSynchronize((cudaEvent_t)e);
  return r == cudaSuccess ? KVI_OK : cuda_fail(r, fn, "cudaEventSynchronize");
}

kvi_status kvi__cuda_host_alloc_mapped(void **host, void **dev, size_t bytes, const char *fn) {
  cudaError_t r = cudaHostAlloc(host, bytes, cudaHostAllocMapped);
  if (r != cudaSuccess) return cuda_fail(r, fn, "cudaHostAlloc (mapped)");
  r = cudaHostGetDevicePointer(dev, *host, 0);
  if (r != cudaSuccess) {
    cudaFreeHost(*host);
    return cuda_fail(r, fn, "cudaHostGetDevicePointer");
  }
  return KVI_OK;
}

kvi_status kvi__cuda_error(int err, const char *fn, const char *what) {
  return err == 0 ? KVI_OK : cuda_fail((cudaError_t)err, fn, what);
}

kvi_status kvi__cuda_malloc_async(void **p, size_t bytes, struct CUstream_st *s, const char *fn) {
  cudaError_t e = cudaMallocAsync(p, bytes, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMallocAsync");
}

kvi_status kvi__cuda_free_async(void *p, struct CUstream_st *s, const char *fn) {
  if (!p) return KVI_OK;
  cudaError_t e = cudaFreeAsync(p, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaFreeAsync");
}

kvi_status kvi__cuda_d2d(void *dst, const void *src, size_t bytes, struct CUstream_st *s, const char *fn) {
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMemcpyAsync (device to device)");
}

kvi_status kvi__cuda_stream_wait(struct CUstream_st *s, struct CUevent_st *ev, const char *fn) {
  cudaError_t e = cudaStreamWaitEvent((cudaStream_t)s, (cudaEvent_t)ev, 0);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaStreamWaitEvent");
}

kvi_status kvi__cuda_sm_count(int device, int *count, const char *fn) {
  cudaError_t e = cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaDeviceGetAttribute (multiprocessors)");
}

kvi_status kvi__cuda_cc_major(int device, int *major, const char *fn) {
  cudaError_t e = cudaDeviceGetAttribute(major, cudaDevAttrComputeCapabilityMajor, device);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaDeviceGetAttribute (compute capability)");
}

kvi_status kvi__cuda_copy(void *dst, const void *src, size_t bytes, struct CUstream_st *s, const char *fn) {
  cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMemcpyAsync");
}

kvi_status kvi__cuda_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                            struct CUstream_st *s, const char *fn) {
  cudaError_t e = cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDefault, (cudaStream_t)s);
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, "cudaMemcpy2DAsync");
}

#else /* !KVI_HAVE_CUDA */

static kvi_status not_built(const char *fn) {
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "libkvinject was built without CUDA");
}

int kvi__cuda_count(void) { return 0; }
kvi__ptr_kind kvi__cuda_ptr_kind(const void *p, int *device) {
  (void)p, (void)device;
  return KVI__PTR_UNKNOWN;
}
bool kvi__cuda_host_mapped(const void *p) {
  (void)p;
  return false;
}
kvi_status kvi__cuda_current_device(int *dev, const char *fn) {
  *dev = -1;
  return not_built(fn);
}
kvi_status kvi__cuda_enter(int device, kvi__devguard *g, const char *fn) {
  (void)device, (void)g;
  return not_built(fn);
}
void kvi__cuda_leave(kvi__devguard *g) { (void)g; }
kvi_status kvi__cuda_malloc(void **p, size_t bytes, const char *fn) {
  (void)p, (void)bytes;
  return not_built(fn);
}
kvi_status kvi__cuda_host_alloc(void **p, size_t bytes, const char *fn) {
  (void)p, (void)bytes;
  return not_built(fn);
}
void kvi__cuda_free(void *p) { (void)p; }
void kvi__cuda_host_free(void *p) { (void)p; }
kvi_status kvi__cuda_h2d(void *dst, const void *src, size_t bytes, struct CUstream_st *s,
                         const char *fn) {
  (void)dst, (void)src, (void)bytes, (void)s;
  return not_built(fn);
}
kvi_status kvi__cuda_d2h(void *dst, const void *src, size_t bytes, struct CUstream_st *s,
                         const char *fn) {
  (void)dst, (void)src, (void)bytes, (void)s;
  return not_built(fn);
}
kvi_status kvi__cuda_sync(struct CUstream_st *s, const char *fn) {
  (void)s;
  return not_built(fn);
}
kvi_status kvi__cuda_stream_create(struct CUstream_st **s, const char *fn) {
  (void)s;
  return not_built(fn);
}
void kvi__cuda_stream_destroy(struct CUstream_st *s) { (void)s; }
kvi_status kvi__cuda_event_create(struct CUevent_st **e, const char *fn) {
  (void)e;
  return not_built(fn);
}
void kvi__cuda_event_destroy(struct CUevent_st *e) { (void)e; }
kvi_status kvi__cuda_event_record(struct CUevent_st *e, struct CUstream_st *s, const char *fn) {
  (void)e, (void)s;
  return not_built(fn);
}
bool kvi__cuda_event_done(struct CUevent_st *e) {
  (void)e;
  return true;
}
kvi_status kvi__cuda_event_sync(struct CUevent_st *e, const char *fn) {
  (void)e;
  return not_built(fn);
}
kvi_status kvi__cuda_host_alloc_mapped(void **host, void **dev, size_t bytes, const char *fn) {
  (void)host, (void)dev, (void)bytes;
  return not_built(fn);
}
kvi_status kvi__cuda_error(int err, const char *fn, const char *what) {
  (void)what;
  return err == 0 ? KVI_OK : not_built(fn);
}
kvi_status kvi__cuda_malloc_async(void **p, size_t bytes, struct CUstream_st *s, const char *fn) {
  (void)p, (void)bytes, (void)s;
  return not_built(fn);
}
kvi_status kvi__cuda_free_async(void *p, struct CUstream_st *s, const char *fn) {
  (void)s;
  return p ? not_built(fn) : KVI_OK;
}
kvi_status kvi__cuda_d2d(void *dst, const void *src, size_t bytes, struct CUstream_st *s, const char *fn) {
  (void)dst, (void)src, (void)bytes, (void)s;
  return not_built(fn);
}
kvi_status kvi__cuda_stream_wait(struct CUstream_st *s, struct CUevent_st *e, const char *fn) {
  (void)s, (void)e;
  return not_built(fn);
}
kvi_status kvi__cuda_sm_count(int device, int *count, const char *fn) {
  (void)device;
  *count = 0;
  return not_built(fn);
}
kvi_status kvi__cuda_cc_major(int device, int *major, const char *fn) {
  (void)device;
  *major = 0;
  return not_built(fn);
}
kvi_status kvi__cuda_copy(void *dst, const void *src, size_t bytes, struct CUstream_st *s, const char *fn) {
  (void)dst, (void)src, (void)bytes, (void)s;
  return not_built(fn);
}
kvi_status kvi__cuda_copy2d(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height,
                            struct CUstream_st *s, const char *fn) {
  (void)dst, (void)dpitch, (void)src, (void)spitch, (void)width, (void)height, (void)s;
  return not_built(fn);
}

#endif /* KVI_HAVE_CUDA */

/* ---- cuBLASLt ---------------------------------------------------------------- */

#ifdef KVI_HAVE_CUBLASLT
#include <cublasLt.h>


/* libcublasLt.so.<major of the headers>, opened on first use. */
#define LT_FUNCS(X)                                                                                                \
  X(cublasLtGetStatusName) X(cublasLtCreate) X(cublasLtDestroy) X(cublasLtMatmulDescCreate)                        \
  X(cublasLtMatmulDescSetAttribute) X(cublasLtMatmulDescDestroy) X(cublasLtMatrixLayoutCreate)                     \
  X(cublasLtMatrixLayoutDestroy) X(cublasLtMatmulPreferenceCreate) X(cublasLtMatmulPreferenceSetAttribute)         \
  X(cublasLtMatmulPreferenceDestroy) X(cublasLtMatmulAlgoGetHeuristic) X(cublasLtMatmul)
KVI__DYNLIB(lt, "libcublasLt.so." KVI__STR(CUBLAS_VER_MAJOR), "cuBLASLt", LT_FUNCS)
#define cublasLtGetStatusName KVI__DYNFN(lt, cublasLtGetStatusName)
#define cublasLtCreate KVI__DYNFN(lt, cublasLtCreate)
#define cublasLtDestroy KVI__DYNFN(lt, cublasLtDestroy)
#define cublasLtMatmulDescCreate KVI__DYNFN(lt, cublasLtMatmulDescCreate)
#define cublasLtMatmulDescSetAttribute KVI__DYNFN(lt, cublasLtMatmulDescSetAttribute)
#define cublasLtMatmulDescDestroy KVI__DYNFN(lt, cublasLtMatmulDescDestroy)
#define cublasLtMatrixLayoutCreate KVI__DYNFN(lt, cublasLtMatrixLayoutCreate)
#define cublasLtMatrixLayoutDestroy KVI__DYNFN(lt, cublasLtMatrixLayoutDestroy)
#define cublasLtMatmulPreferenceCreate KVI__DYNFN(lt, cublasLtMatmulPreferenceCreate)
#define cublasLtMatmulPreferenceSetAttribute KVI__DYNFN(lt, cublasLtMatmulPreferenceSetAttribute)
#define cublasLtMatmulPreferenceDestroy KVI__DYNFN(lt, cublasLtMatmulPreferenceDestroy)
#define cublasLtMatmulAlgoGetHeuristic KVI__DYNFN(lt, cublasLtMatmulAlgoGetHeuristic)
#define cublasLtMatmul KVI__DYNFN(lt, cublasLtMatmul)

kvi_status kvi__lt_load(const char *fn) { return kvi__dynlib_get(&lt_lib, fn); }
bool kvi__lt_usable(void) { return kvi__dynlib_usable(&lt_lib); }

#define LT_CACHE 16

/* A chosen algorithm for one problem shape (and operand alignments). */
typedef struct lt_entry {
  int64_t key[9];
  cublasLtMatmulAlgo_t algo;
  size_t ws;
  uint64_t stamp; /* 0: empty */
} lt_entry;

struct kvi__lt {
  cublasLtHandle_t h;
  lt_entry cache[LT_CACHE];
  uint64_t clock;
};

static kvi_status lt_fail(cublasStatus_t e, const char *fn, const char *call) {
  return kvi__fail(e == CUBLAS_STATUS_ALLOC_FAILED ? KVI_ERR_OUT_OF_MEMORY
                   : e == CUBLAS_STATUS_NOT_SUPPORTED ? KVI_ERR_UNSUPPORTED
                                                      : KVI_ERR_CUDA,
                   fn, "%s failed: cuBLAS status %d (%s)", call, (int)e, cublasLtGetStatusName(e));
}

kvi_status kvi__lt_create(kvi__lt **out, const char *fn) {
  kvi_status st = kvi__lt_load(fn);
  if (st) return st;
  kvi__lt *lt = calloc(1, sizeof *lt);
  if (!lt) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a cuBLASLt handle");
  cublasStatus_t e = cublasLtCreate(&lt->h);
  if (e != CUBLAS_STATUS_SUCCESS) {
    free(lt);
    return lt_fail(e, fn, "cublasLtCreate");
  }
  *out = lt;
  return KVI_OK;
}

void kvi__lt_destroy(kvi__lt *lt) {
  if (!lt) return;
  cublasLtDestroy(lt->h);
  free(lt);
}

/* Largest power of two (<= 256) dividing the address: what cuBLASLt may assume. */
static int64_t lt_align(const void *p) {
  int64_t a = 256;
  while (a > 1 && (uintptr_t)p % (uintptr_t)a) a /= 2;
  return a;
}

kvi_status kvi__lt_scores(kvi__lt *lt, kvi_dtype t, const void *A, int64_t lda, const void *B, int64_t ldb, float *C,
                          int64_t ldc, int64_t m, int64_t n, int64_t K, void *ws, size_t ws_bytes,
                          struct CUstream_st *stream, const char *fn) {
  const cudaDataType_t dt = t == KVI_DTYPE_FP16 ? CUDA_R_16F : t == KVI_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_32F;
  const int64_t aa = lt_align(A), ab = lt_align(B), ac = lt_align(C);
  const int64_t key[9] = {(int64_t)t, m, n, K, lda, ldb, ldc, aa | ab << 16 | ac << 32, (int64_t)ws_bytes};
  cublasLtMatmulDesc_t op = NULL;
  cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
  cublasLtMatmulPreference_t pref = NULL;
  kvi_status st = KVI_OK;
  cublasStatus_t e;
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
#define LT(call)                                                                                                   \
  do {                                                                                                             \
    if (st == KVI_OK && (e = (call)) != CUBLAS_STATUS_SUCCESS) st = lt_fail(e, fn, #call);                         \
  } while (0)
  LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  LT(cublasLtMatrixLayoutCreate(&la, dt, (uint64_t)K, (uint64_t)m, lda));
  LT(cublasLtMatrixLayoutCreate(&lb, dt, (uint64_t)K, (uint64_t)n, ldb));
  LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, (uint64_t)m, (uint64_t)n, ldc));
  lt_entry *hit = NULL, *victim = &lt->cache[0];
  for (int i = 0; i < LT_CACHE && st == KVI_OK; i++) {
    lt_entry *c = &lt->cache[i];
    if (c->stamp && memcmp(c->key, key, sizeof key) == 0) hit = c;
    if (c->stamp < victim->stamp) victim = c;
  }
  if (st == KVI_OK && !hit) {
    const uint32_t a32 = (uint32_t)aa, b32 = (uint32_t)ab, c32 = (uint32_t)ac;
    const uint64_t wsb = ws_bytes;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    memset(&res, 0, sizeof res);
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a32, sizeof a32));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b32, sizeof b32));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c32, sizeof c32));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c32, sizeof c32));
    LT(cublasLtMatmulAlgoGetHeuristic(lt->h, op, la, lb, lc, lc, pref, 1, &res, &found));
    if (st == KVI_OK && found < 1)
      st = kvi__fail(KVI_ERR_UNSUPPORTED, fn, "cuBLASLt has no algorithm for scores of %lld x %lld (K %lld, %s)",
                     (long long)m, (long long)n, (long long)K, kvi__dtype_name(t));
    if (st == KVI_OK) {
      hit = victim;
      memcpy(hit->key, key, sizeof key);
      hit->algo = res.algo;
      hit->ws = res.workspaceSize;
    }
  }
  if (st == KVI_OK) {
    hit->stamp = ++lt->clock;
    const float alpha = 1.0f, beta = 0.0f;
    LT(cublasLtMatmul(lt->h, op, &alpha, A, la, B, lb, &beta, C, lc, C, lc, &hit->algo, ws, ws_bytes,
                      (cudaStream_t)stream));
  }
#undef LT
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
  return st;
}

#else /* !KVI_HAVE_CUBLASLT */

static kvi_status lt_not_built(const char *fn) {
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "libkvinject was built without cuBLASLt");
}
kvi_status kvi__lt_load(const char *fn) { return lt_not_built(fn); }
bool kvi__lt_usable(void) { return false; }
kvi_status kvi__lt_create(kvi__lt **out, const char *fn) {
  *out = NULL;
  return lt_not_built(fn);
}
void kvi__lt_destroy(kvi__lt *lt) { (void)lt; }
kvi_status kvi__lt_scores(kvi__lt *lt, kvi_dtype t, const void *A, int64_t lda, const void *B, int64_t ldb, float *C,
                          int64_t ldc, int64_t m, int64_t n, int64_t K, void *ws, size_t ws_bytes,
                          struct CUstream_st *stream, const char *fn) {
  (void)lt, (void)t, (void)A, (void)lda, (void)B, (void)ldb, (void)C, (void)ldc, (void)m, (void)n, (void)K, (void)ws,
      (void)ws_bytes, (void)stream;
  return lt_not_built(fn);
}

#endif /* KVI_HAVE_CUBLASLT */

kvi_status kvi__check_memory(const void *p, kvi_memory declared, bool cuda_store, int device,
                             const char *fn, const char *what) {
  if (declared == KVI_MEMORY_DEVICE && !cuda_store)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn,
                     "%s is declared as device memory, but a CPU store reads and writes host memory only",
                     what);
  int dev = -1;
  kvi__ptr_kind kind = kvi__cuda_ptr_kind(p, &dev);
  if (kind == KVI__PTR_UNKNOWN || kind == KVI__PTR_MANAGED) return KVI_OK;
  if (declared == KVI_MEMORY_HOST && kind == KVI__PTR_DEVICE)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn,
                     "%s (%p) is declared as host memory but is device memory of device %d", what, p,
                     dev);
  if (declared == KVI_MEMORY_DEVICE && kind == KVI__PTR_HOST)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "%s (%p) is declared as device memory but is host memory",
                     what, p);
  if (declared == KVI_MEMORY_DEVICE && dev != device)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn,
                     "%s (%p) is memory of device %d, the store lives on device %d", what, p, dev, device);
  return KVI_OK;
}
