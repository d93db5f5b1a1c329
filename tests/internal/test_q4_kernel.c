/*
 * internal-q4-kernel: what the fused kernel's 4-bit paths
 * (cuda/transfer_kernels.cu, "4-bit pages") rely on, checked on the host:
 *   - kvi__q4_bounds(min, max) of a group's finite values is the word that
 *     folding every value gives (NaN, infinities, signed zeros, fp16
 *     subnormals and values below them, values past +-65504);
 *   - the decode's shortcuts: (0x4b000000 | c) - 2^23 is c, and fp16 -> fp32
 *     by the hardware's exact conversion (here _Float16) is kvi__q4_h2f;
 *   - the thread mapping, replayed: items (slice, head, chunk) of K and V
 *     cover every (plane, head, token, column) once, each rotated column's
 *     pair, cos/sin column and partner are the reference's (NeoX, GPT-J,
 *     odd half), 8-column NeoX chunks have consecutive partners, and the
 *     value rows' lane groups cover every (row, column) once.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "unit.h"

#include "base/q4.h"

static uint64_t q4rng = 0x9e3779b97f4a7c15ull;
static uint32_t rnd(void) {
  q4rng ^= q4rng << 13;
  q4rng ^= q4rng >> 7;
  q4rng ^= q4rng << 17;
  return (uint32_t)(q4rng >> 32);
}

static float special(void) {
  static const float v[] = {0.0f, -0.0f, 1.0f, -1.0f, 0x1p-24f, -0x1p-24f, 0x1p-25f, -0x1p-30f, 0x1p-140f,
                            65504.0f, -65504.0f, 65520.0f, -1e6f, 1e30f, 3.14159f, -2.5e-5f};
  switch (rnd() % 8) {
  case 0: return v[rnd() % (sizeof v / sizeof *v)];
  case 1: return kvi__q4_float(rnd()); /* any bits: NaN, inf, subnormal */
  case 2: return (float)((int)(rnd() % 2001) - 1000) * 0x1p-12f;
  default: return ((float)rnd() / 4294967296.0f - 0.5f) * (float)(1u << (rnd() % 20));
  }
}

static void test_bounds_is_fold(void **state) {
  (void)state;
  for (int t = 0; t < 200000; t++) {
    const int n = 1 + (int)(rnd() % 16);
    uint32_t fold = KVI__Q4_BOUNDS_EMPTY;
    float mn = INFINITY, mx = -INFINITY;
    for (int i = 0; i < n; i++) {
      const float x = special();
      fold = kvi__q4_fold(fold, x);
      if (x - x == 0.0f) mn = fminf(mn, x), mx = fmaxf(mx, x);
    }
    const uint32_t b = kvi__q4_bounds(mn, mx);
    if (b != fold) fail_msg("group %d: bounds(%a, %a) = %08x, folding gives %08x", t, (double)mn, (double)mx, b, fold);
    if (kvi__q4_params(b) != kvi__q4_params(fold)) fail_msg("params differ");
  }
}

static void test_decode_shortcuts(void **state) {
  (void)state;
  for (uint32_t c = 0; c < 16; c++) assert_true(kvi__q4_float(0x4b000000u | c) - 8388608.0f == (float)c);
  for (uint32_t h = 0; h < 65536; h++) {
    _Float16 x;
    const uint16_t hb = (uint16_t)h;
    memcpy(&x, &hb, 2);
    const float hw = (float)x, ref = kvi__q4_h2f(hb);
    if (isnan(ref)) {
      assert_true(isnan(hw));
      continue;
    }
    if (kvi__q4_bits(hw) != kvi__q4_bits(ref)) fail_msg("fp16 %04x: %a against %a", h, (double)hw, (double)ref);
  }
}

/* ---- the mapping, as the kernel computes it ---------------------------------- */

enum { THREADS = 128, TS = 16 };

static void pair_of(int W, bool neox, unsigned d0, unsigned half, int i, bool *first, unsigned *k, unsigned *p) {
  const unsigned d = d0 + (unsigned)i;
  if (neox) {
    *first = (W == 8 ? d0 : d) < half;
    *k = *first ? d : d - half;
    *p = *first ? d + half : d - half;
  } else {
    *first = (i & 1) == 0;
    *k = d >> 1;
    *p = d ^ 1;
  }
}

static void check_mapping(unsigned H, unsigned D, unsigned ntok, unsigned rot, int E, bool neox) {
  const int W = E == 1 ? 2 : E;
  const unsigned half = rot >> 1, nch = D / (unsigned)W, units = H * nch, nk = units * ((ntok + TS - 1) / TS);
  unsigned char *seen = calloc((size_t)2 * H * ntok * D, 1);
  for (unsigned t = 0; t < THREADS; t++)
    for (unsigned it = t; it < 2 * nk; it += THREADS) { /* q4_item */
      const unsigned kv = it >= nk, r = it - kv * nk, sl = r / units, un = r - sl * units, h = un / nch;
      const unsigned d0 = (un - h * nch) * (unsigned)W, j0 = sl * TS, j1 = j0 + TS < ntok ? j0 + TS : ntok;
      const unsigned hf = kv ? 0u : half;
      const bool on = d0 < 2 * hf;
      if (E == 8) assert_int_equal(d0 % 8, 0);
      for (unsigned j = j0; j < j1; j++)
        for (int i = 0; i < W; i++) {
          const unsigned d = d0 + (unsigned)i;
          unsigned char *s = &seen[((size_t)(kv * H + h) * ntok + j) * D + d];
          assert_int_equal(*s, 0);
          *s = 1;
          if (!on) {
            assert_true(kv || d >= 2 * half);
            continue;
          }
          assert_true(d < 2 * half);
          bool first;
          unsigned k, p;
          pair_of(W, neox, d0, hf, i, &first, &k, &p);
          const bool rf = neox ? d < half : d % 2 == 0;
          assert_true(first == rf);
          assert_int_equal(k, neox ? (rf ? d : d - half) : d / 2);
          assert_int_equal(p, neox ? (rf ? d + half : d - half) : d ^ 1u);
          if (!neox) assert_true(p >= d0 && p < d0 + (unsigned)W); /* inside the chunk */
          if (neox && E == 8) {
            bool f0;
            unsigned k0, p0;
            pair_of(W, neox, d0, hf, 0, &f0, &k0, &p0);
            assert_int_equal(p, p0 + (unsigned)i);
            assert_int_equal(k, k0 + (unsigned)i);
          }
        }
    }
  for (size_t e = 0; e < (size_t)2 * H * ntok * D; e++) assert_int_equal(seen[e], 1);
  /* q4_capture_values: rows in groups of G lanes, R rows a group in flight */
  const unsigned nchv = D / (unsigned)W, rows = H * ntok, R = 2;
  unsigned G = 1;
  while (G < nchv && G < 32) G <<= 1;
  const unsigned rpw = 32 / G, step = (THREADS / 32) * rpw * R;
  memset(seen, 0, (size_t)rows * D);
  for (unsigned t = 0; t < THREADS; t++) {
    const unsigned lane = t & 31, lg = lane & (G - 1);
    for (unsigned r0 = (t >> 5) * rpw * R + lane / G; r0 - lane / G < rows; r0 += step)
      for (unsigned q = 0; q < R; q++) {
        const unsigned r = r0 + q * rpw;
        if (r >= rows) continue;
        for (unsigned c = lg; c < nchv; c += G)
          for (int i = 0; i < W; i++) {
            unsigned char *s = &seen[(size_t)r * D + c * (unsigned)W + (unsigned)i];
            assert_int_equal(*s, 0);
            *s = 1;
          }
      }
  }
  for (size_t e = 0; e < (size_t)rows * D; e++) assert_int_equal(seen[e], 1);
  free(seen);
}

static void test_mapping(void **state) {
  (void)state;
  static const unsigned Hs[] = {1, 3, 8}, Ds[] = {2, 6, 40, 64, 80, 128, 256, 512}, Ns[] = {1, 5, 16, 17, 24, 64};
  int n = 0;
  for (size_t a = 0; a < sizeof Hs / sizeof *Hs; a++)
    for (size_t b = 0; b < sizeof Ds / sizeof *Ds; b++)
      for (size_t c = 0; c < sizeof Ns / sizeof *Ns; c++) {
        const unsigned D = Ds[b], rots[] = {0, 2, 6, D / 2 - (D / 2) % 2, D > 8 ? D - 8 : 0, D};
        for (size_t r = 0; r < sizeof rots / sizeof *rots; r++) {
          if (rots[r] % 2 || rots[r] > D) continue;
          for (int neox = 0; neox < 2; neox++) {
            check_mapping(Hs[a], D, Ns[c], rots[r], 1, neox), n++;
            if (D % 8 == 0 && rots[r] % 16 == 0) check_mapping(Hs[a], D, Ns[c], rots[r], 8, neox), n++;
          }
        }
      }
  print_message("%d geometries\n", n);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bounds_is_fold),
      cmocka_unit_test(test_decode_shortcuts),
      cmocka_unit_test(test_mapping),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
