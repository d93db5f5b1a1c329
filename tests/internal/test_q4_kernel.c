/*
 * internal-q4-kernel: what the fused kernel's 4-bit paths
 * (cuda/transfer_kernels.cu, "4-bit pages") rely on, checked on the host:
 *   - kvi__q4_bounds(min, max) of a group's finite values is the word that
 *     folding every value gives (NaN, infinities, signed zeros, fp16
 *     subnormals and values below them, values past +-65504);
 *   - kvi__q4_code_rcp (the quotient as a product with 1 / s, the division
 *     near half-integers) gives kvi__q4_code_sm's code: every group's
 *     parameters, values across and beyond the group, special values, and
 *     values built to land on and next to each rounding boundary;
 *   - the decode's shortcuts: (0x4b000000 | c) - 2^23 is c, and fp16 -> fp32
 *     by the hardware's exact conversion (here _Float16) is kvi__q4_h2f;
 *   - the thread mapping, replayed: injection's items (slice, head, chunk)
 *     of K and V cover every (plane, head, token, column) once, each
 *     rotated column's pair, cos/sin column and partner are the reference's
 *     (NeoX, GPT-J, odd half), 8-column NeoX chunks have consecutive
 *     partners; capture's key units (head, chunk) and their token slices
 *     cover every (head, token, column) once, the slices of a unit being
 *     the threads its shared-memory merge reads, one round when there are
 *     slices; and the value rows' lane groups (2 to 4 rows in flight) cover
 *     every (row, column) once.
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

static void check_code(float x, float s, float m) {
  const uint32_t want = kvi__q4_code_sm(x, s, m), got = kvi__q4_code_rcp(x, s, m, kvi__q4_rcp(s));
  if (got != want)
    fail_msg("code of %a (s %a, m %a): %u, the division gives %u", (double)x, (double)s, (double)m, got, want);
}

static void test_code_rcp(void **state) {
  (void)state;
  for (int t = 0; t < 300000; t++) {
    /* a group's parameters from random bounds, as the kernels get them */
    float a = special(), b = special();
    if (!(a - a == 0.0f)) a = 0.0f;
    if (!(b - b == 0.0f)) b = 1.0f;
    const uint32_t w = kvi__q4_params(kvi__q4_bounds(fminf(a, b), fmaxf(a, b)));
    const float s = kvi__q4_scale(w), m = kvi__q4_min(w);
    for (int i = 0; i < 8; i++) check_code(m + (float)(rnd() % 17000) / 1000.0f * s, s, m); /* across, a bit beyond */
    check_code(special(), s, m);
    for (int k = 0; k < 16; k++) { /* on and next to the boundaries m + (k + 1/2) s */
      const float x = m + ((float)k + 0.5f) * s;
      check_code(x, s, m);
      check_code(nextafterf(x, INFINITY), s, m);
      check_code(nextafterf(x, -INFINITY), s, m);
    }
  }
  /* every fp16 scale, m 0 and a few others, near each boundary */
  for (uint32_t h = 1; h < 0x7c00u; h++) {
    const float s = kvi__q4_h2f((uint16_t)h), ms[] = {0.0f, -1.0f, 3.5f, -65504.0f};
    for (size_t mi = 0; mi < sizeof ms / sizeof *ms; mi++)
      for (int k = 0; k < 16; k += 5) {
        const float x = ms[mi] + ((float)k + 0.5f) * s;
        check_code(x, s, ms[mi]);
        check_code(nextafterf(x, INFINITY), s, ms[mi]);
        check_code(nextafterf(x, -INFINITY), s, ms[mi]);
      }
  }
  check_code(INFINITY, 1.0f, 0.0f);
  check_code(-INFINITY, 1.0f, 0.0f);
  check_code(NAN, 1.0f, 0.0f);
  check_code(1.0f, 0.0f, 0.0f);
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
  /* q4_capture_keys: units (head, chunk), S slices of the tokens each */
  memset(seen, 0, (size_t)H * ntok * D);
  const unsigned S = units < THREADS ? THREADS / units : 1u, ts = (ntok + S - 1) / S;
  if (S > 1) assert_true(units * S <= THREADS); /* one round: every thread reaches the barriers */
  for (unsigned it0 = 0; it0 < units * S; it0 += THREADS)
    for (unsigned t = 0; t < THREADS; t++) {
      const unsigned it = it0 + t, s = it / units, un = it - s * units, h = un / nch;
      const unsigned d0 = (un - h * nch) * (unsigned)W, j0 = s * ts < ntok ? s * ts : ntok;
      const unsigned j1 = j0 + ts < ntok ? j0 + ts : ntok;
      if (it >= units * S) continue;
      assert_true(h < H && d0 + (unsigned)W <= D);
      if (S > 1) /* the merge reads thread q * units + un for each slice q: the unit's slices */
        for (unsigned q = 0; q < S; q++) {
          const unsigned o = q * units + un;
          assert_true(o < THREADS);
          assert_int_equal(o % units, un);
          assert_int_equal(o / units, q);
        }
      for (unsigned j = j0; j < j1; j++)
        for (int i = 0; i < W; i++) {
          unsigned char *e = &seen[((size_t)h * ntok + j) * D + d0 + (unsigned)i];
          assert_int_equal(*e, 0);
          *e = 1;
        }
    }
  for (size_t e = 0; e < (size_t)H * ntok * D; e++) assert_int_equal(seen[e], 1);
  /* q4_capture_values: rows in groups of G lanes, R rows a group in flight */
  const unsigned nchv = D / (unsigned)W, rows = H * ntok;
  unsigned G = 1;
  while (G < nchv && G < 32) G <<= 1;
  for (unsigned R = 2; R <= 4; R++) {
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
  }
  free(seen);
}

static void test_mapping(void **state) {
  (void)state;
  static const unsigned Hs[] = {1, 3, 8, 16}, Ds[] = {2, 6, 40, 64, 80, 128, 256, 512}, Ns[] = {1, 5, 16, 17, 24, 64};
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
      cmocka_unit_test(test_code_rcp),
      cmocka_unit_test(test_decode_shortcuts),
      cmocka_unit_test(test_mapping),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
