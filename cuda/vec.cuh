/*
 * libkvinject — the kernels' element access: element types and their fp32
 * conversions (round to nearest even; fp8 saturating to the largest finite
 * value, as the CPU reference in lib/base/convert.c does), vector loads and
 * stores, and the fp8 fact-storage arithmetic (base/fp8.h's scale and key
 * offsets, the functions lib/base/convert.c computes them with). Every kernel file that
 * reads or writes elements goes through this header.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_CUDA_VEC_CUH
#define KVI_CUDA_VEC_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <cfloat>
#include <cmath>
#include <type_traits>

#include "gpu/kernels.h"

namespace kvi {

/* ---- element types ---------------------------------------------------------- */

struct fp8e4 {
  uint8_t b;
};
struct fp8e5 {
  uint8_t b;
};
/* 4-bit store pages (KVI_DTYPE_Q4): a tag for the page type; a page pointer
 * of it addresses bytes (codes two a byte, then the scale words: base/q4.h) */
struct q4 {
  uint8_t b;
};
template <typename T> struct is_q4 {
  static constexpr bool value = false;
};
template <> struct is_q4<q4> {
  static constexpr bool value = true;
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

/* S -> D through fp32; equal types (other than fp8) are bit copies. */
template <typename S, typename D> __device__ inline D convert(S x) { return cvt<D>::from(cvt<S>::to(x)); }
template <> __device__ inline float convert<float, float>(float x) { return x; }
template <> __device__ inline __half convert<__half, __half>(__half x) { return x; }
template <> __device__ inline __nv_bfloat16 convert<__nv_bfloat16, __nv_bfloat16>(__nv_bfloat16 x) { return x; }

/* Element i of an array of `dtype` (a kvi_dtype) elements as fp32, and the
 * size of one. */
__device__ inline float load(const void *base, int dtype, int64_t i) {
  switch (dtype) {
  case KVI_DTYPE_FP32: return static_cast<const float *>(base)[i];
  case KVI_DTYPE_FP16: return cvt<__half>::to(static_cast<const __half *>(base)[i]);
  case KVI_DTYPE_BF16: return cvt<__nv_bfloat16>::to(static_cast<const __nv_bfloat16 *>(base)[i]);
  case KVI_DTYPE_FP8_E4M3: return cvt<fp8e4>::to(static_cast<const fp8e4 *>(base)[i]);
  case KVI_DTYPE_FP8_E5M2: return cvt<fp8e5>::to(static_cast<const fp8e5 *>(base)[i]);
  }
  return NAN;
}

__device__ inline int64_t elem_size(int dtype) {
  return dtype == KVI_DTYPE_FP32 ? 4 : dtype == KVI_DTYPE_FP16 || dtype == KVI_DTYPE_BF16 ? 2 : 1;
}

/* ---- vectors ------------------------------------------------------------------ */

/* E raw elements of T, loaded and stored in the widest aligned accesses. */
template <typename T, int E> struct alignas(E * sizeof(T) >= 16 ? 16 : E * sizeof(T) >= 8 ? 8 : sizeof(T)) Vec {
  T v[E];
};

template <typename T, int E> __device__ inline void ld(Vec<T, E> &r, const T *p) {
  constexpr int B = E * (int)sizeof(T);
  if constexpr (E > 1 && B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; i++) reinterpret_cast<uint4 *>(r.v)[i] = reinterpret_cast<const uint4 *>(p)[i];
  } else if constexpr (E > 1 && B == 8) {
    *reinterpret_cast<uint2 *>(r.v) = *reinterpret_cast<const uint2 *>(p);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) r.v[i] = p[i];
  }
}

/* Stores a loaded vector as it is (a copy between equal dtypes). */
template <typename T, int E> __device__ inline void st_raw(T *p, const Vec<T, E> &r) {
  constexpr int B = E * (int)sizeof(T);
  if constexpr (E > 1 && B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; i++) reinterpret_cast<uint4 *>(p)[i] = reinterpret_cast<const uint4 *>(r.v)[i];
  } else if constexpr (E > 1 && B == 8) {
    *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<const uint2 *>(r.v);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) p[i] = r.v[i];
  }
}

/* Converts E floats to T and stores them. */
template <typename T, int E> __device__ inline void st(T *p, const float *in) {
  Vec<T, E> r;
#pragma unroll
  for (int i = 0; i < E; i++) r.v[i] = cvt<T>::from(in[i]);
  st_raw<T, E>(p, r);
}

template <typename T, int E> __device__ inline void to_f32(float *x, const Vec<T, E> &r) {
  if constexpr (std::is_same<T, fp8e4>::value && E % 2 == 0) { /* two per conversion instruction; exact */
#pragma unroll
    for (int i = 0; i < E; i += 2) {
      const __nv_fp8x2_storage_t pr = (__nv_fp8x2_storage_t)(r.v[i].b | (unsigned)r.v[i + 1].b << 8);
      const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pr, __NV_E4M3)));
      x[i] = f.x;
      x[i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) x[i] = cvt<T>::to(r.v[i]);
  }
}

/* The first n < E elements only (a row's unaligned tail): element by element. */
template <typename T, int E> __device__ inline void ld_n(Vec<T, E> &r, const T *p, int n) {
#pragma unroll
  for (int i = 0; i < E; i++)
    if (i < n) r.v[i] = p[i];
}
template <typename T, int E> __device__ inline void st_n(T *p, const Vec<T, E> &r, int n) {
#pragma unroll
  for (int i = 0; i < E; i++)
    if (i < n) p[i] = r.v[i];
}

/* A 16-byte word of S elements (search rows) as fp32. */
template <typename S> struct unpack;
template <> struct unpack<float> {
  static __device__ void to(const uint4 &w, float *f) {
    f[0] = __uint_as_float(w.x), f[1] = __uint_as_float(w.y), f[2] = __uint_as_float(w.z), f[3] = __uint_as_float(w.w);
  }
};
template <> struct unpack<__half> {
  static __device__ void to(const uint4 &w, float *f) {
    const __half2 *h = reinterpret_cast<const __half2 *>(&w);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 t = __half22float2(h[i]);
      f[2 * i] = t.x, f[2 * i + 1] = t.y;
    }
  }
};
template <> struct unpack<__nv_bfloat16> {
  static __device__ void to(const uint4 &w, float *f) {
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&w);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 t = __bfloat1622float2(h[i]);
      f[2 * i] = t.x, f[2 * i + 1] = t.y;
    }
  }
};

/* ---- fp8 fact storage (kernels.h) ----------------------------------------------- */

/* The scale of a group whose largest finite |x| is amax. */
__device__ inline float fp8_scale(float amax) { return kvi__fp8_scale_of(amax); }

/* amax folded over one more value: NaN and infinities are skipped. */
__device__ inline float fp8_amax(float m, float x) {
  const float a = fabsf(x);
  return a <= FLT_MAX && a > m ? a : m;
}

/* The largest finite |x| of n values (0 for none). */
__device__ inline float finite_amax(const float *v, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; i++) m = fp8_amax(m, v[i]);
  return m;
}

/* A value as a stored e4m3 byte under `scale`, and back (values: no
 * offset; e4m3 * scale, which is fmaf(e4m3, scale, -0): base/fp8.h). */
__device__ inline uint8_t fp8_quantize(float x, float scale) { return cvt<fp8e4>::from(__fdiv_rn(x, scale)).b; }
__device__ inline float fp8_dequantize(uint8_t b, float scale) { return __fmul_rn(cvt<fp8e4>::to(fp8e4{b}), scale); }

/* A key under its channel's offset m (base/fp8.h): the stored byte, and back. */
__device__ inline uint8_t fp8_quantize_key(float x, float m, float scale) {
  return cvt<fp8e4>::from(kvi__fp8_key_quotient(x, m, scale)).b;
}
__device__ inline float fp8_dequantize_key(uint8_t b, float scale, float m) {
  return kvi__fp8_value(cvt<fp8e4>::to(fp8e4{b}), scale, m);
}

/* A stored fp16 offset as fp32 (exact). */
__device__ inline float fp8_offset(uint16_t h) { return __half2float(__ushort_as_half(h)); }

/* E consecutive key offsets from p as fp32 (E % 8 == 0: p 16-byte aligned). */
template <int E> __device__ inline void fp8_offsets(float *m, const uint16_t *p) {
  if constexpr (E % 8 == 0) {
#pragma unroll
    for (int q = 0; q < E / 8; q++) {
      const uint4 w = reinterpret_cast<const uint4 *>(p)[q];
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int i = 0; i < 4; i++) {
        m[q * 8 + 2 * i] = fp8_offset((uint16_t)(u[i] & 0xffffu));
        m[q * 8 + 2 * i + 1] = fp8_offset((uint16_t)(u[i] >> 16));
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) m[i] = fp8_offset(p[i]);
  }
}

} // namespace kvi

#endif /* KVI_CUDA_VEC_CUH */
