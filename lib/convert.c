/*
 * Scalar fp32 <-> fp16/bf16 conversion, the reference the CUDA kernels match
 * bit for bit on finite values (round to nearest, ties to even).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <string.h>

#include "internal.h"

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

float kvi__bf16_to_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

uint16_t kvi__f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

float kvi__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in fp32 */
    float v = (float)man * 0x1p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0));
  return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

uint16_t kvi__f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {
    /* result is subnormal or zero: round a * 2^24 to an integer, ties to even */
    float v = bits_f32(a) * 0x1p24f; /* exact: scaling by a power of two */
    float r = rintf(v);              /* default rounding mode: nearest even */
    return (uint16_t)(sign | (uint16_t)r);
  }
  /* normal: drop 13 mantissa bits with round to nearest even */
  uint32_t e = (a >> 23) - 112u;
  uint32_t m = a & 0x7fffffu;
  uint32_t h = (e << 10) | (m >> 13);
  uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

bool kvi__dtype_is_float(kvi_dtype t) {
  return t == KVI_DTYPE_FP32 || t == KVI_DTYPE_FP16 || t == KVI_DTYPE_BF16;
}

const char *kvi__dtype_name(kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP32: return "fp32";
  case KVI_DTYPE_FP16: return "fp16";
  case KVI_DTYPE_BF16: return "bf16";
  case KVI_DTYPE_FP8_E4M3: return "fp8_e4m3";
  case KVI_DTYPE_FP8_E5M2: return "fp8_e5m2";
  }
  return "unknown dtype";
}

KVI_API size_t kvi_dtype_size(kvi_dtype dtype) {
  switch (dtype) {
  case KVI_DTYPE_FP32: return 4;
  case KVI_DTYPE_FP16:
  case KVI_DTYPE_BF16: return 2;
  case KVI_DTYPE_FP8_E4M3:
  case KVI_DTYPE_FP8_E5M2: return 1;
  }
  return 0;
}

float kvi__load(const void *p, kvi_dtype t, int64_t i) {
  switch (t) {
  case KVI_DTYPE_FP32: return ((const float *)p)[i];
  case KVI_DTYPE_FP16: return kvi__f16_to_f32(((const uint16_t *)p)[i]);
  case KVI_DTYPE_BF16: return kvi__bf16_to_f32(((const uint16_t *)p)[i]);
  default: return NAN;
  }
}

void kvi__convert(void *dst, kvi_dtype dt, const void *src, kvi_dtype st, int64_t n) {
  if (dt == st) {
    memcpy(dst, src, (size_t)n * kvi_dtype_size(dt));
    return;
  }
  switch (dt) {
  case KVI_DTYPE_FP32:
    for (int64_t i = 0; i < n; i++) ((float *)dst)[i] = kvi__load(src, st, i);
    break;
  case KVI_DTYPE_FP16:
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = kvi__f32_to_f16(kvi__load(src, st, i));
    break;
  case KVI_DTYPE_BF16:
    for (int64_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = kvi__f32_to_bf16(kvi__load(src, st, i));
    break;
  default: break;
  }
}
