/*
 * CUDA runtime glue: device choice and guard, allocation, copies, pointer
 * classification. Without CUDA every entry point answers "none" or
 * KVI_ERR_NOT_BUILT, so the rest of the library needs no #ifdefs.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "internal.h"

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

int kvi__cuda_sm_count(int device) {
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
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

kvi_status kvi__cuda_last_launch(const char *fn, const char *kernel) {
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? KVI_OK : cuda_fail(e, fn, kernel);
}

#else /* !KVI_HAVE_CUDA */

static kvi_status not_built(const char *fn) {
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "libkvinject was built without CUDA");
}

int kvi__cuda_count(void) { return 0; }
int kvi__cuda_sm_count(int device) {
  (void)device;
  return 0;
}
kvi__ptr_kind kvi__cuda_ptr_kind(const void *p, int *device) {
  (void)p, (void)device;
  return KVI__PTR_UNKNOWN;
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
kvi_status kvi__cuda_last_launch(const char *fn, const char *kernel) {
  (void)kernel;
  return not_built(fn);
}

#endif /* KVI_HAVE_CUDA */

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
