/*
 * libkvinject — the interface between the C core and the CUDA kernels in
 * cuda/. Plain C; included by both.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_KERNELS_H
#define KVI_KERNELS_H

#include <stdint.h>

#include "kvinject/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pages handled by one launch; the list travels by value in the kernel's
 * parameters (1 KiB), so a launch needs no device-side table. */
#define KVI__LAUNCH_PAGES 256

/*
 * Page layout (internal, shared by the CPU and CUDA paths): a page of P
 * tokens holds, for layer l, plane kv (0 = K, 1 = V), local head h, token
 * t < P and element d < D, the element at offset
 *   (((l * 2 + kv) * H + h) * P + t) * D + d
 * so each (layer, plane, head) is one contiguous run of P * D elements.
 */
typedef struct kvi__copy_args {
  /* dense view */
  const void *vk; /* K base (const for puts; written through for reads) */
  const void *vv; /* V base */
  int32_t view_dtype;
  int64_t layer_stride, token_stride, head_stride;
  int32_t L, H, D;
  /* pages */
  void *pool;         /* base of the page pool */
  int32_t page_dtype; /* storage dtype */
  int32_t P;          /* tokens per page */
  int64_t page_elems; /* elements per page: L * 2 * H * P * D */
  /* this launch: `count` pages covering tokens [token_first, token_first + num_tokens) */
  int32_t count;
  int32_t token_first;
  int32_t num_tokens;
  uint32_t pages[KVI__LAUNCH_PAGES];
} kvi__copy_args;

/* Dense view -> pages (put) and pages -> dense view (read), converting
 * dtypes with round to nearest even. Enqueue on `stream`; return the launch
 * status (0 or a cudaError_t value). */
int kvi__cuda_view_to_pages(const kvi__copy_args *a, struct CUstream_st *stream);
int kvi__cuda_pages_to_view(const kvi__copy_args *a, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVI_KERNELS_H */
