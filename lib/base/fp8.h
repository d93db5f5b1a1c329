/*
 * libkvinject — the fp8 fact-storage arithmetic (scales and key offsets),
 * shared by the CPU reference (base/convert.c, store/copy.c, xfer/execute.c)
 * and the kernels (cuda/, through gpu/kernels.h). Plain C that nvcc compiles
 * too; base.h and kernels.h include it.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_BASE_FP8_H
#define KVI_BASE_FP8_H

#include <math.h>
#include <stdint.h>

#include "base/q4.h" /* the fp16 helpers and a channel's bounds word */

#ifdef __cplusplus
extern "C" {
#endif

/* fp8 fact storage (e4m3). A page holds its elements as bytes at the
 * offsets of kernels.h's page layout, then, at scale_off (16-byte aligned),
 * one fp32 scale per (layer l, plane kv, local head h) at index
 * (l * 2 + kv) * H + h: the scale of that head's tokens in that page; then,
 * kvi__fp8_offsets_rel bytes further (16-byte aligned), one fp16 offset per
 * key channel (layer l, local head h, channel d) at index (l * H + h) * D +
 * d: the channel's offset m over the same tokens (values have none: m = 0).
 *   m     = from the channel's bounds word (base/q4.h: its finite minimum
 *           lo rounded down to fp16, its maximum hi rounded up, saturated to
 *           +-65504): when 0 < lo and hi - lo < lo, or hi < 0 and
 *           hi - lo < -hi (one side of zero, a band narrower than its
 *           distance from zero; hi - lo in fp32), the midpoint
 *           (lo + hi) * 0.5 in fp32 rounded to the nearest fp16 (ties to
 *           even); else (a channel around zero, no finite value) +0;
 *   amax  = the largest finite |x - m| of the group (x - m one fp32
 *           subtraction; values: |x|);
 *   scale = max(amax / KVI__FP8_STORE_MAX, KVI__FP8_SCALE_MIN), one fp32
 *           division;
 *   byte  = e4m3((x - m) / scale) (values: e4m3(x / scale)), one fp32
 *           subtraction then one division, rounded to nearest even,
 *           saturating (infinities become +-448, NaN stays NaN);
 *   value = fmaf(e4m3, scale, m) in fp32, one rounding (values:
 *           e4m3 * scale, which fmaf(e4m3, scale, -0) equals bit for bit).
 * Pages of store files older than version 4 have no offsets: they load with
 * every offset -0 (KVI__FP8_OFFSET_LEGACY), so they read back bit for bit
 * as before. Store files keep each page's scales and offsets back to back
 * (kvi__fp8_meta_bytes); the page pads the scales to 16 bytes
 * (kvi__fp8_page_meta). */
#define KVI__FP8_STORE_MAX 448.0f
#define KVI__FP8_SCALE_MIN 0x1p-126f
#define KVI__FP8_OFFSET_LEGACY 0x8000u /* fp16 -0 */

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

/* Bytes from a page's scales (scale_off) to its key offsets: the scales,
 * L * 2 * H fp32, padded to 16 bytes. */
static inline KVI__HOST_DEVICE uint64_t kvi__fp8_offsets_rel(int32_t L, int32_t H) {
  return ((uint64_t)L * 2u * (uint64_t)H * 4u + 15u) & ~(uint64_t)15u;
}

/* Bytes of a page's scales and key offsets as store files and raw copies
 * keep them, back to back: L * 2 * H fp32, then L * H * D fp16. */
static inline KVI__HOST_DEVICE uint64_t kvi__fp8_meta_bytes(int32_t L, int32_t H, int32_t D) {
  return (uint64_t)L * 2u * (uint64_t)H * 4u + (uint64_t)L * (uint64_t)H * (uint64_t)D * 2u;
}

/* Bytes of a page from scale_off on: the scales, padded to 16 bytes, then
 * the key offsets, padded to 16 bytes. */
static inline KVI__HOST_DEVICE uint64_t kvi__fp8_page_meta(int32_t L, int32_t H, int32_t D) {
  return kvi__fp8_offsets_rel(L, H) + (((uint64_t)L * (uint64_t)H * (uint64_t)D * 2u + 15u) & ~(uint64_t)15u);
}

/* A key channel's fp16 offset from its bounds word (kvi__q4_fold,
 * kvi__q4_bounds; KVI__Q4_BOUNDS_EMPTY: +0): the midpoint of lo .. hi when
 * the channel lies on one side of zero in a band narrower than its distance
 * from zero (0 < lo and hi - lo < lo, or hi < 0 and hi - lo < -hi, hi - lo
 * in fp32), so that every |x - m| is at most about half of |x| (a bias
 * channel: 358 +- 3); else +0, keys stored as values are (a channel around
 * zero keeps e4m3's relative precision near zero). */
static inline KVI__HOST_DEVICE uint16_t kvi__fp8_offset_of(uint32_t bounds) {
  const uint16_t lh = (uint16_t)(bounds & 0xffffu), hh = (uint16_t)(bounds >> 16);
  if (lh == 0x7c00u) return 0; /* no finite value */
  const float lo = kvi__q4_h2f(lh), hi = kvi__q4_h2f(hh);
#ifdef __CUDA_ARCH__
  const float spread = __fsub_rn(hi, lo), mid = __fmul_rn(__fadd_rn(lo, hi), 0.5f);
#else
  const float spread = hi - lo, mid = (lo + hi) * 0.5f;
#endif
  if (!((lo > 0.0f && spread < lo) || (hi < 0.0f && spread < -hi))) return 0;
  /* nearest of the fp16 values around mid (within -65504 .. 65504) */
  const uint16_t dn = kvi__q4_f2h_dir(mid, 0), up = kvi__q4_f2h_dir(mid, 1);
  if (dn == up) return dn;
#ifdef __CUDA_ARCH__
  const float below = __fsub_rn(mid, kvi__q4_h2f(dn)), above = __fsub_rn(kvi__q4_h2f(up), mid); /* exact */
#else
  const float below = mid - kvi__q4_h2f(dn), above = kvi__q4_h2f(up) - mid; /* exact */
#endif
  if (below < above) return dn;
  if (above < below) return up;
  return (dn & 1u) ? up : dn; /* a tie: the even one */
}

/* The stored quotient of a key x under offset m (fp32) and scale: (x - m)
 * / scale, one subtraction then one division, each rounded to nearest; the
 * byte is its e4m3 (saturating). */
static inline KVI__HOST_DEVICE float kvi__fp8_key_quotient(float x, float m, float scale) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(__fsub_rn(x, m), scale);
#else
  return (x - m) / scale;
#endif
}

/* |x - m| when finite, else 0 (a key's contribution to its group's amax). */
static inline KVI__HOST_DEVICE float kvi__fp8_key_mag(float x, float m) {
#ifdef __CUDA_ARCH__
  const float a = fabsf(__fsub_rn(x, m));
#else
  const float a = fabsf(x - m);
#endif
  return a <= 3.40282347e38f ? a : 0.0f; /* NaN and infinities left out */
}

/* A stored element's value: fmaf(e, scale, m), e the e4m3 byte as fp32
 * (values: m = -0, which gives e * scale bit for bit). */
static inline KVI__HOST_DEVICE float kvi__fp8_value(float e, float scale, float m) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(e, scale, m);
#else
  return fmaf(e, scale, m);
#endif
}

/* A capture into an fp8 page (kernels.h, kvi__xfer_args.phase) folds each
 * key channel's bounds in two fp16 halves: the low one (its finite minimum
 * rounded down, as kvi__q4_fold) in the channel's offset slot, the high one
 * (its maximum rounded up) at kvi__fp8_capture_hi, scratch in the layer's
 * elements (2 * H * D bytes of its 2 * H * P * D, written over with the
 * e4m3 bytes once the offsets are set): channel (h, d) of layer l at index
 * h * D + d. Empty halves: KVI__FP8_LO_EMPTY, KVI__FP8_HI_EMPTY. Folding
 * commutes and keeps kvi__q4_fold's word, so the offset is the one a
 * kvi_store_put of the same values gives. */
#define KVI__FP8_LO_EMPTY 0x7c00u /* fp16 +inf */
#define KVI__FP8_HI_EMPTY 0xfc00u /* fp16 -inf */

static inline KVI__HOST_DEVICE uint16_t *kvi__fp8_capture_hi(void *page, int32_t l, int32_t H, int32_t P,
                                                              int32_t D) {
  return (uint16_t *)((char *)page + (int64_t)l * 2 * H * P * D);
}

/* x folded into a low (lo != 0) or high half: the half kept (x not finite:
 * h unchanged). */
static inline KVI__HOST_DEVICE uint16_t kvi__fp8_fold_half(uint16_t h, float x, int lo) {
  if (!(x - x == 0.0f)) return h;
  const uint16_t xh = kvi__q4_f2h_dir(x, lo ? 0 : 1);
  return (lo ? kvi__q4_h2f(xh) < kvi__q4_h2f(h) : kvi__q4_h2f(xh) > kvi__q4_h2f(h)) ? xh : h;
}

#ifdef __cplusplus
}
#endif

#endif /* KVI_BASE_FP8_H */
