/*
 * libkvinject — group-wise 4-bit fact storage (KVI_DTYPE_Q4): the one
 * definition of a group's parameters, of a code and of its value, written
 * for host and device alike so every path gives the same bits.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_BASE_Q4_H
#define KVI_BASE_Q4_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define KVI__Q4_HD __host__ __device__
#else
#define KVI__Q4_HD
#endif

/*
 * A page of a Q4 store holds its elements as 4-bit codes, two per byte
 * (element 2i in the low nibble, 2i + 1 in the high one), in the rows of
 * the usual page layout ([layer][K, V][head][token][dim], a row of D
 * elements taking D / 2 bytes). At scale_off (16-byte aligned) follow the
 * groups' parameters, each one 32-bit word: the fp16 scale in the low half,
 * the fp16 minimum in the high half:
 *   K, channel d of layer l, head h (the page's tokens of that channel):
 *     word (l * H + h) * D + d;
 *   V, token t of layer l, head h (its D channels):
 *     word L * H * D + (l * H + h) * P + t.
 * A group of values x (its finite ones; none: min 0, max 0):
 *   m = min rounded down to fp16 (saturated to -65504 .. 65504; -0 is +0),
 *   M = max rounded up to fp16 (saturated likewise),
 *   s = (M - m) / 15 in fp32 rounded up to fp16, then raised by fp16 steps
 *       while fmaf(15, s, m) < M (so m + 15 s covers the group);
 *   code = clamp(rint((x - m) / s), 0, 15) (fp32 subtraction and division,
 *       nearest even; s = 0: 0; NaN: 0; +inf: 15; -inf: 0);
 *   value = fmaf(code, s, m) (one rounding).
 * For x in [m, m + 15 s]: |x - value| <= s / 2 plus one fp32 rounding of the
 * quotient and one of the value.
 */

static inline KVI__Q4_HD uint32_t kvi__q4_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline KVI__Q4_HD float kvi__q4_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* fp16 bits -> fp32 (exact). */
static inline KVI__Q4_HD float kvi__q4_h2f(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = (float)m * 0x1p-24f; /* zero or subnormal, exact */
    return sign ? -v : v;
  }
  if (e == 31) return kvi__q4_float(sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
  return kvi__q4_float(sign | ((e + 112u) << 23) | (m << 13));
}

/* A finite fp32 value in -65504 .. 65504 -> fp16 bits, truncated toward
 * zero (|result| <= |x|). */
static inline KVI__Q4_HD uint16_t kvi__q4_f2h_trunc(float x) {
  const uint32_t u = kvi__q4_bits(x), a = u & 0x7fffffffu;
  const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  if (a < 0x38800000u) { /* below 2^-14: subnormal steps of 2^-24 */
    const float v = kvi__q4_float(a) * 0x1p24f; /* exact */
    return (uint16_t)(sign | (uint16_t)(uint32_t)v); /* truncating conversion */
  }
  return (uint16_t)(sign | (uint16_t)((((a >> 23) - 112u) << 10) | ((a & 0x7fffffu) >> 13)));
}

/* fp32 -> fp16 bits rounded toward +infinity (up) or -infinity (down),
 * saturated to +-65504; x finite. */
static inline KVI__Q4_HD uint16_t kvi__q4_f2h_dir(float x, int up) {
  if (x > 65504.0f) return 0x7bffu;
  if (x < -65504.0f) return 0xfbffu;
  uint16_t h = kvi__q4_f2h_trunc(x);
  const float back = kvi__q4_h2f(h);
  if (back != x) { /* truncation moved toward zero: one step away when that is the direction asked */
    if (up && x > 0.0f) h++;
    else if (!up && x < 0.0f) h++;
  }
  if (h == 0x8000u) h = 0; /* -0: +0 */
  return h;
}

/* The fp16 value one step above h (h finite, below 65504). */
static inline KVI__Q4_HD uint16_t kvi__q4_h_next(uint16_t h) {
  if (h == 0x8000u || h == 0) return 1;
  return (h & 0x8000u) ? (uint16_t)(h - 1u) : (uint16_t)(h + 1u);
}

/* A group's running bounds, one word: its finite minimum rounded down to
 * fp16 in the low half, its finite maximum rounded up to fp16 in the high
 * half; KVI__Q4_BOUNDS_EMPTY before any finite value (+inf, -inf). Folding
 * commutes, so any order of the group's values gives the same word. */
#define KVI__Q4_BOUNDS_EMPTY 0xfc007c00u

static inline KVI__Q4_HD uint32_t kvi__q4_fold(uint32_t bounds, float x) {
  if (!(x - x == 0.0f)) return bounds; /* NaN or infinite: left out */
  uint16_t mh = (uint16_t)(bounds & 0xffffu), Mh = (uint16_t)(bounds >> 16);
  const uint16_t xl = kvi__q4_f2h_dir(x, 0), xu = kvi__q4_f2h_dir(x, 1);
  if (kvi__q4_h2f(xl) < kvi__q4_h2f(mh)) mh = xl;
  if (kvi__q4_h2f(xu) > kvi__q4_h2f(Mh)) Mh = xu;
  return (uint32_t)mh | ((uint32_t)Mh << 16);
}

/* The bounds of a group whose finite values have smallest mn and largest
 * mx (mn > mx: none finite): the word that folding all of them gives, as
 * folding is monotone (rounding down or up to fp16 keeps the order). The
 * kernels reduce a group to (mn, mx) in fp32 first, then call this. */
static inline KVI__Q4_HD uint32_t kvi__q4_bounds(float mn, float mx) {
  return mn <= mx ? kvi__q4_fold(kvi__q4_fold(KVI__Q4_BOUNDS_EMPTY, mn), mx) : KVI__Q4_BOUNDS_EMPTY;
}

/* A group's parameter word from its bounds (no finite value: the word of
 * a group of zeros). */
static inline KVI__Q4_HD uint32_t kvi__q4_params(uint32_t bounds) {
  uint16_t mh = (uint16_t)(bounds & 0xffffu), Mh = (uint16_t)(bounds >> 16);
  if (mh == 0x7c00u) mh = Mh = 0;
  const float m = kvi__q4_h2f(mh), M = kvi__q4_h2f(Mh);
#ifdef __CUDA_ARCH__
  const float q = __fdiv_rn(__fsub_rn(M, m), 15.0f);
#else
  const float q = (M - m) / 15.0f;
#endif
  uint16_t sh = kvi__q4_f2h_dir(q, 1);
  while (sh < 0x7bffu && fmaf(15.0f, kvi__q4_h2f(sh), m) < M) sh = kvi__q4_h_next(sh);
  return (uint32_t)sh | ((uint32_t)mh << 16);
}

static inline KVI__Q4_HD float kvi__q4_scale(uint32_t w) { return kvi__q4_h2f((uint16_t)(w & 0xffffu)); }
static inline KVI__Q4_HD float kvi__q4_min(uint32_t w) { return kvi__q4_h2f((uint16_t)(w >> 16)); }

/* The code of x in a group of scale s and minimum m (a word's, as floats). */
static inline KVI__Q4_HD uint32_t kvi__q4_code_sm(float x, float s, float m) {
  if (!(s > 0.0f)) return 0u;
#ifdef __CUDA_ARCH__
  const float r = rintf(__fdiv_rn(__fsub_rn(x, m), s));
#else
  const float r = rintf((x - m) / s);
#endif
  return r > 0.0f ? (r < 15.0f ? (uint32_t)r : 15u) : 0u;
}

/* kvi__q4_code_sm(x, s, m) given r, 1 / s rounded to nearest (the kernels'
 * shortcut, the same codes): the quotient as (x - m) * r. While the
 * quotient is below 16 in magnitude, that is within 3 * 2^-20 of
 * (x - m) / s rounded (three roundings of 2^-24 relative at most between
 * them), so the two round to the same integer unless they straddle a
 * half-integer (or the quotient is one: a tie); past 16 both give 15 or 0
 * alike. A product within 2^-17 of
 * a half-integer, and one not finite, takes the division. (q - t is exact:
 * |q - t| <= 0.5 with t = rint(q); so is f - 0.5 for f >= 0.25.) */
static inline KVI__Q4_HD uint32_t kvi__q4_code_rcp(float x, float s, float m, float r) {
  if (!(s > 0.0f)) return 0u;
#ifdef __CUDA_ARCH__
  const float q = __fmul_rn(__fsub_rn(x, m), r), t = rintf(q), f = fabsf(__fsub_rn(q, t));
  if (!(fabsf(__fsub_rn(f, 0.5f)) > 0x1p-17f)) return kvi__q4_code_sm(x, s, m);
#else
  const float q = (x - m) * r, t = rintf(q), f = fabsf(q - t);
  if (!(fabsf(f - 0.5f) > 0x1p-17f)) return kvi__q4_code_sm(x, s, m);
#endif
  return t > 0.0f ? (t < 15.0f ? (uint32_t)t : 15u) : 0u;
}

/* 1 / s rounded to nearest, for kvi__q4_code_rcp (s = 0: 0, unused). */
static inline KVI__Q4_HD float kvi__q4_rcp(float s) {
  if (!(s > 0.0f)) return 0.0f;
#ifdef __CUDA_ARCH__
  return __frcp_rn(s);
#else
  return 1.0f / s;
#endif
}

/* The code of x in a group of parameter word w. */
static inline KVI__Q4_HD uint32_t kvi__q4_code(float x, uint32_t w) {
  return kvi__q4_code_sm(x, kvi__q4_scale(w), kvi__q4_min(w));
}

/* The value of a code. */
static inline KVI__Q4_HD float kvi__q4_value(uint32_t code, uint32_t w) {
  return fmaf((float)code, kvi__q4_scale(w), kvi__q4_min(w));
}

/* The value of element e of packed codes (two a byte, even elements low). */
static inline KVI__Q4_HD float kvi__q4_decode(const uint8_t *codes, int64_t e, uint32_t w) {
  return kvi__q4_value((uint32_t)(codes[e >> 1] >> (4 * (unsigned)(e & 1))) & 15u, w);
}

#ifdef __cplusplus
}
#endif

#endif /* KVI_BASE_Q4_H */
