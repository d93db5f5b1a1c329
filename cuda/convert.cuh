/*
 * libkvinject — element types and their fp32 conversions for the kernels
 * (round to nearest even; fp8 saturating to the largest finite value, as the
 * CPU reference in lib/convert.c does).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_CUDA_CONVERT_CUH
#define KVI_CUDA_CONVERT_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace kvi {

struct fp8e4 {
  uint8_t b;
};
struct fp8e5 {
  uint8_t b;
};

template <typename T> struct cvt;
template <> struct cvt<float> {
  static __device__ float to(float x) { return x; }
  static __device__ float from(float x) { return x; }
};
template <> struct cvt<__half> {
  static __device__ float to(__half x) { return __half2float(x); }
  static __device__ __half from(float x) { return __float2half_rn(x); }
};
template <> struct cvt<__nv_bfloat16> {
  static __device__ float to(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __nv_bfloat16 from(float x) { return __float2bfloat16_rn(x); }
};
template <> struct cvt<fp8e4> {
  static __device__ float to(fp8e4 x) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.b, __NV_E4M3))); }
  static __device__ fp8e4 from(float x) { return fp8e4{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)}; }
};
template <> struct cvt<fp8e5> {
  static __device__ float to(fp8e5 x) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.b, __NV_E5M2))); }
  static __device__ fp8e5 from(float x) { return fp8e5{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)}; }
};

template <typename T> struct is_fp8 {
  static constexpr bool value = false;
};
template <> struct is_fp8<fp8e4> {
  static constexpr bool value = true;
};
template <> struct is_fp8<fp8e5> {
  static constexpr bool value = true;
};

} // namespace kvi

#endif /* KVI_CUDA_CONVERT_CUH */
