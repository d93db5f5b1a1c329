/*
 * Scalar fp32 <-> fp16/bf16 conversion, the reference the CUDA kernels match
 * bit for bit on finite values (round to nearest, ties to even).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "base/base.h"

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
  case KVI_DTYPE_Q4: return "q4";
  }
  return "unknown dtype";
}

size_t kvi__dtype_size(kvi_dtype dtype) {
  switch (dtype) {
  case KVI_DTYPE_FP32: return 4;
  case KVI_DTYPE_FP16:
  case KVI_DTYPE_BF16: return 2;
  case KVI_DTYPE_FP8_E4M3:
  case KVI_DTYPE_FP8_E5M2: return 1;
  case KVI_DTYPE_Q4: return 0; /* half a byte: kvi__dtype_bytes */
  }
  return 0;
}

uint64_t kvi__dtype_bytes(kvi_dtype dtype, uint64_t n) {
  return dtype == KVI_DTYPE_Q4 ? (n + 1u) / 2u : n * kvi__dtype_size(dtype);
}

uint64_t kvi__page_scale_bytes(kvi_dtype dtype, int32_t L, int32_t H, int32_t D, int32_t P) {
  if (dtype == KVI_DTYPE_FP8_E4M3) return kvi__fp8_meta_bytes(L, H, D); /* scales, then key offsets */
  if (dtype == KVI_DTYPE_Q4) return (uint64_t)L * (uint64_t)H * ((uint64_t)D + (uint64_t)P) * 4u;
  return 0;
}

/* ---- 4-bit fact storage (base/q4.h) --------------------------------------- */

void kvi__q4_pack_row(uint8_t *dst, const float *x, int32_t n, const uint32_t *w, int32_t wstep) {
  for (int32_t i = 0; i < n; i += 2) {
    const uint32_t lo = kvi__q4_code(x[i], w[i * wstep]);
    const uint32_t hi = i + 1 < n ? kvi__q4_code(x[i + 1], w[(i + 1) * wstep]) : 0u;
    dst[i / 2] = (uint8_t)(lo | hi << 4);
  }
}

void kvi__q4_unpack_row(float *dst, const uint8_t *src, int32_t n, const uint32_t *w, int32_t wstep) {
  for (int32_t i = 0; i < n; i++) dst[i] = kvi__q4_decode(src, i, w[i * wstep]);
}

uint32_t kvi__q4_fold_row(uint32_t bounds, const float *x, int32_t n) {
  for (int32_t i = 0; i < n; i++) bounds = kvi__q4_fold(bounds, x[i]);
  return bounds;
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
    memcpy(dst, src, (size_t)n * kvi__dtype_size(dt));
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

/* ---- fp8 (OCP e4m3fn and e5m2), saturating like __NV_SATFINITE ---------- */

typedef struct fp8_fmt {
  int mbits, bias;
  float max;       /* largest finite value */
  uint8_t max_bits;
  uint8_t nan_bits;
  bool has_inf;
} fp8_fmt;

static const fp8_fmt E4M3 = {3, 7, 448.0f, 0x7e, 0x7f, false};
static const fp8_fmt E5M2 = {2, 15, 57344.0f, 0x7b, 0x7f, true};

static uint8_t to_fp8(float x, const fp8_fmt *f) {
  if (isnan(x)) return f->nan_bits;
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  float a = fabsf(x);
  if (a >= f->max) return sign | f->max_bits; /* saturate, infinities too */
  const int emin = 1 - f->bias;
  int e;
  frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
  e -= 1;        /* a = m' * 2^e, m' in [1, 2) */
  if (a == 0.0f) return sign;
  if (e < emin) { /* subnormal: multiples of 2^(emin - mbits) */
    const float q = rintf(ldexpf(a, f->mbits - emin));
    return sign | (uint8_t)q; /* q == 2^mbits encodes the smallest normal */
  }
  float q = rintf(ldexpf(a, f->mbits - e)) - ldexpf(1.0f, f->mbits); /* mantissa, rounded */
  if (q >= ldexpf(1.0f, f->mbits)) {
    q = 0;
    e++;
  }
  uint8_t bits = (uint8_t)(((e + f->bias) << f->mbits) | (int)q);
  if (bits > f->max_bits) bits = f->max_bits;
  return sign | bits;
}

static float from_fp8(uint8_t b, const fp8_fmt *f) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int e = (b & 0x7f) >> f->mbits, m = b & ((1 << f->mbits) - 1);
  const int emax_field = (1 << (7 - f->mbits)) - 1;
  if (f->has_inf && e == emax_field) return m ? NAN : sign * INFINITY;
  if (!f->has_inf && (b & 0x7f) == 0x7f) return NAN;
  if (e == 0) return sign * ldexpf((float)m, 1 - f->bias - f->mbits);
  return sign * ldexpf(1.0f + (float)m / (float)(1 << f->mbits), e - f->bias);
}

uint8_t kvi__f32_to_fp8(float x, kvi_dtype t) { return to_fp8(x, t == KVI_DTYPE_FP8_E5M2 ? &E5M2 : &E4M3); }

float kvi__fp8_to_f32(uint8_t b, kvi_dtype t) { return from_fp8(b, t == KVI_DTYPE_FP8_E5M2 ? &E5M2 : &E4M3); }

/* ---- fp8 fact storage: one scale per (page, layer, K/V, head) ------------- */

float kvi__fp8_amax(float amax, const float *x, const float *m, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    const float a = m ? kvi__fp8_key_mag(x[i], m[i]) : fabsf(x[i]);
    if (a <= FLT_MAX && a > amax) amax = a; /* false for NaN and infinities */
  }
  return amax;
}

float kvi__fp8_scale(float amax) { return kvi__fp8_scale_of(amax); /* base/fp8.h: the kernels' too */ }

void kvi__fp8_quantize(uint8_t *dst, const float *x, const float *m, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = kvi__f32_to_fp8(m ? kvi__fp8_key_quotient(x[i], m[i], scale) : x[i] / scale, KVI_DTYPE_FP8_E4M3);
}

void kvi__fp8_dequantize(float *dst, const uint8_t *src, const float *m, int64_t n, float scale) {
  for (int64_t i = 0; i < n; i++)
    dst[i] = kvi__fp8_value(kvi__fp8_to_f32(src[i], KVI_DTYPE_FP8_E4M3), scale, m ? m[i] : -0.0f);
}

void kvi__fp8_key_offsets(uint16_t *stored, float *m, const uint32_t *bounds, int32_t n) {
  for (int32_t i = 0; i < n; i++) {
    const uint16_t h = kvi__fp8_offset_of(bounds[i]);
    if (stored) stored[i] = h;
    if (m) m[i] = kvi__q4_h2f(h);
  }
}

void kvi__fp8_offsets_f32(float *m, const uint16_t *stored, int32_t n) {
  for (int32_t i = 0; i < n; i++) m[i] = stored ? kvi__q4_h2f(stored[i]) : -0.0f;
}
