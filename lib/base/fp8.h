/*
 * libkvinject — the fp8 fact-storage scale, shared by the CPU reference
 * (base/convert.c) and the kernels (cuda/, through gpu/kernels.h). Plain C
 * that nvcc compiles too; base.h and kernels.h include it.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_BASE_FP8_H
#define KVI_BASE_FP8_H

#ifdef __cplusplus
extern "C" {
#endif

/* fp8 fact storage (e4m3): a page holds its elements as bytes at the
 * offsets below, then, at scale_off (16-byte aligned), one fp32 scale per
 * (layer l, plane kv, local head h) at index (l * 2 + kv) * H + h: the scale
 * of that head's tokens in that page. scale = max(amax / KVI__FP8_STORE_MAX,
 * KVI__FP8_SCALE_MIN) with amax the largest finite |x| (fp32 division);
 * stored byte = e4m3(x / scale), saturating; value = e4m3 * scale. */
#define KVI__FP8_STORE_MAX 448.0f
#define KVI__FP8_SCALE_MIN 0x1p-126f

#ifdef __CUDACC__
#define KVI__HOST_DEVICE __host__ __device__
#else
#define KVI__HOST_DEVICE
#endif

/* The one computation of that scale, for the CPU (lib/base/convert.c) and the
 * kernels (cuda/vec.cuh) alike: one fp32 division rounded to nearest
 * (__fdiv_rn on the device, never contracted or approximated), then the
 * floor. */
static inline KVI__HOST_DEVICE float kvi__fp8_scale_of(float amax) {
#ifdef __CUDA_ARCH__
  const float s = __fdiv_rn(amax, KVI__FP8_STORE_MAX);
#else
  const float s = amax / KVI__FP8_STORE_MAX;
#endif
  return s < KVI__FP8_SCALE_MIN ? KVI__FP8_SCALE_MIN : s;
}

#ifdef __cplusplus
}
#endif

#endif /* KVI_BASE_FP8_H */
