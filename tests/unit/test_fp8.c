/*
 * unit-fp8: fp8 e4m3 fact storage on the CPU backend (the reference the CUDA
 * kernels match bit for bit), against an independent float64 model of the
 * quantization written here: per (page, layer, K/V, head) group, keys with
 * one offset m per channel (for a channel on one side of zero in a band
 * narrower than its distance from zero, the midpoint of its bounds rounded
 * outward to fp16, itself rounded to the nearest fp16; else, and for
 * values, m = 0),
 * amax = largest finite |x - m|, scale = max(amax / 448, 2^-126) rounded to
 * fp32, code = nearest-even e4m3 of (x - m) / scale (saturating), value =
 * code * scale + m rounded once (values code * scale).
 *   - put from fp32/bf16 views and read back into fp32/bf16: bit-exact against
 *     the model; the e4m3 bound (2^-4 relative per element in the normal
 *     range) and the per-head relative Frobenius error, reported;
 *   - zeros, -0, tiny values, NaN and infinities (defined behaviour);
 *   - statistics: page bytes with the scales, payload bytes;
 *   - injection from an fp8 store (fp32, bf16 and fp8 caches) against the
 *     float64 rotation of the dequantized values;
 *   - capture into an fp8 store (pages split into several segments or not)
 *     against the model applied to what an fp32 store captures;
 *   - store files: save/load and the journal round trip bit for bit; a file
 *     loads only into an fp8 store of the same page size; a version-3 file
 *     (before the key offsets, fp8_v3_file.h) loads and reads as it did;
 *   - a key channel with a large bias (358 + N(0, 1)): within 2^-4 of the
 *     group's largest |x - m|.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "ref64.h"

#include "fp8_v3_file.h"

#include <float.h>
#include <unistd.h>

enum { L = 3, HT = 4, D = 32 };

/* ---- the float64 model -------------------------------------------------- */

/* The finite fp16 values, ascending (-0 left out), with their bits. */
static double f16_val[63488];
static uint16_t f16_bits[63488];
static int f16_n;

static void f16_grid_init(void) {
  if (f16_n) return;
  for (uint32_t b = 0xfbffu;; b--) { /* negative: descending bits ascend in value */
    if (b != 0x8000u) f16_val[f16_n] = ref_f16_to_f32((uint16_t)b), f16_bits[f16_n++] = (uint16_t)b;
    if (b == 0x8000u) break;
  }
  for (uint32_t b = 0; b <= 0x7bffu; b++) f16_val[f16_n] = ref_f16_to_f32((uint16_t)b), f16_bits[f16_n++] = (uint16_t)b;
}

/* Index of the largest fp16 value <= x (x within the grid). */
static int f16_floor(double x) {
  int lo = 0, hi = f16_n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (f16_val[mid] <= x) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* A key channel's offset: with its finite values' bounds, the minimum lo
 * rounded down and the maximum hi rounded up to fp16 (saturated), and the
 * channel on one side of zero in a band narrower than its distance from it
 * (0 < lo, hi - lo < lo; or hi < 0, hi - lo < -hi), their fp32 sum halved,
 * rounded to the nearest fp16 (ties to the even bits); else (no finite
 * value too) 0. */
static double ref_offset(const float *const *rows, int n, int d) {
  f16_grid_init();
  double mn = INFINITY, mx = -INFINITY;
  for (int t = 0; t < n; t++)
    if (isfinite(rows[t][d])) mn = fmin(mn, rows[t][d]), mx = fmax(mx, rows[t][d]);
  if (mn > mx) return 0.0;
  const double lo = mn <= f16_val[0] ? f16_val[0] : f16_val[f16_floor(mn)];
  int iu = mx >= f16_val[f16_n - 1] ? f16_n - 1 : f16_floor(mx);
  if (f16_val[iu] < mx) iu++;
  const double hi = f16_val[iu], spread = (double)(float)(hi - lo); /* the fp32 difference */
  if (!((lo > 0 && spread < lo) || (hi < 0 && spread < -hi))) return 0.0; /* around zero, or wide: none */
  const double mid = (double)(float)(lo + hi) * 0.5; /* the fp32 sum (one rounding), halved exactly */
  const int i = f16_floor(mid);
  if (f16_val[i] == mid) return mid;
  const double below = mid - f16_val[i], above = f16_val[i + 1] - mid;
  if (below != above) return below < above ? f16_val[i] : f16_val[i + 1];
  return (f16_bits[i] & 1) ? f16_val[i + 1] : f16_val[i];
}

/* m: the group's offsets, one per channel (NULL: values, none). */
static float ref_scale(const float *const *rows, int n, int d, const double *m) {
  double amax = 0.0;
  for (int t = 0; t < n; t++)
    for (int i = 0; i < d; i++) {
      const double a = fabs((double)(float)((double)rows[t][i] - (m ? m[i] : 0.0))); /* the fp32 difference */
      if (isfinite(a) && a > amax) amax = a;
    }
  float s = (float)(amax / 448.0); /* a float quotient rounded once: the fp32 division */
  return s < 0x1p-126f ? 0x1p-126f : s;
}

/* keys: code = e4m3((x - m) / scale), value = code * scale + m rounded once;
 * values (key = false): e4m3(x / scale), code * scale. */
static float ref_value(float x, float scale, double m, bool key) {
  if (isnan(x)) return NAN; /* NaN stays NaN */
  const float dx = key ? (float)((double)x - m) : x; /* one fp32 subtraction */
  const uint8_t c = ref_fp8_encode((float)((double)dx / (double)scale), KVI_DTYPE_FP8_E4M3);
  const double v = ref_fp8_decode(c, KVI_DTYPE_FP8_E4M3);
  if (isnan(v)) return NAN;
  return key ? (float)(v * (double)scale + m) : (float)(v * (double)scale); /* exact product (and sum), rounded once */
}

/* What an fp8 store of page size P keeps of f (src rounded to the put view's
 * dtype first), as fp32; and the scales, [page][l][kv][h], and the key
 * offsets, [page][l][h][d], if wanted. */
static void ref_quantize_ex(const rfact *f, int32_t P, rfact *out, float *scales, double *offsets, bool key_offsets) {
  *out = *f;
  const size_t n = (size_t)f->L * f->T * f->H * f->D;
  out->k = malloc(n * sizeof(float));
  out->v = malloc(n * sizeof(float));
  assert_non_null(out->k);
  assert_non_null(out->v);
  const float **rows = malloc((size_t)P * sizeof *rows);
  double *m = malloc((size_t)f->D * sizeof *m);
  assert_non_null(rows);
  assert_non_null(m);
  for (int32_t t0 = 0, pg = 0; t0 < f->T; t0 += P, pg++) {
    const int32_t nt = f->T - t0 < P ? f->T - t0 : P;
    for (int l = 0; l < f->L; l++)
      for (int kv = 0; kv < 2; kv++)
        for (int h = 0; h < f->H; h++) {
          for (int32_t t = 0; t < nt; t++) rows[t] = rfact_row(f, kv, l, t0 + t, h);
          for (int d = 0; d < f->D; d++) {
            m[d] = kv || !key_offsets ? 0.0 : ref_offset(rows, nt, d);
            if (offsets && !kv) offsets[(((size_t)pg * f->L + l) * f->H + h) * f->D + d] = m[d];
          }
          const float sc = ref_scale(rows, nt, f->D, kv || !key_offsets ? NULL : m);
          if (scales) scales[(((size_t)pg * f->L + l) * 2 + kv) * f->H + h] = sc;
          for (int32_t t = 0; t < nt; t++)
            for (int d = 0; d < f->D; d++)
              rfact_row(out, kv, l, t0 + t, h)[d] = ref_value(rows[t][d], sc, m[d], !kv && key_offsets);
        }
  }
  free(m);
  free(rows);
}

static void ref_quantize(const rfact *f, int32_t P, rfact *out, float *scales) {
  ref_quantize_ex(f, P, out, scales, NULL, true);
}

static bool same_float(float a, float b) { return f2u(a) == f2u(b) || (isnan(a) && isnan(b)); }

static void expect_fact(const rfact *got, const rfact *want, const char *what) {
  const size_t n = (size_t)want->L * want->T * want->H * want->D;
  for (size_t i = 0; i < n; i++)
    for (int kv = 0; kv < 2; kv++) {
      const float g = (kv ? got->v : got->k)[i], w = (kv ? want->v : want->k)[i];
      if (!same_float(g, w)) fail_msg("%s: %s element %zu is %a, the model gives %a", what, kv ? "V" : "K", i, (double)g, (double)w);
    }
}

static kvi_store *fp8_store(kvi_model *m, int32_t P, uint32_t pages) {
  const int32_t H = HT;
  /* e4m3 bytes, the scales, the key offsets (fp16 per key channel), each 16-byte aligned */
  const uint64_t page = (((uint64_t)L * 2 * H * P * D + 15) & ~15ull) + (((uint64_t)L * 2 * H * 4 + 15) & ~15ull) +
                        (((uint64_t)L * H * D * 2 + 15) & ~15ull);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP8_E4M3, P, page * pages);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.page_bytes, page);
  assert_int_equal(st.pages_total, pages);
  assert_int_equal(st.dtype, KVI_DTYPE_FP8_E4M3);
  return s;
}

/* K with a few channels 10-50x the others and one with a large bias (as
 * LLM keys have: 358 + N(0, 1)-like), V plain. */
static void fill_outliers(rfact *f, rng *r) {
  for (int l = 0; l < f->L; l++)
    for (int t = 0; t < f->T; t++)
      for (int h = 0; h < f->H; h++)
        for (int d = 0; d < f->D; d++) {
          const float g = rand_val(r, -3, 1);
          rfact_row(f, 0, l, t, h)[d] = d % 11 == 3 ? g * (float)(10 + (d * 7) % 41) : d == 5 ? 358.0f + g : g;
          rfact_row(f, 1, l, t, h)[d] = rand_val(r, -4, 0);
        }
}

/* ---- put / read ---------------------------------------------------------- */

static void test_fp8_put_read(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  const int32_t Ps[] = {4, 16, 1};
  for (int pi = 0; pi < 3; pi++) {
    const int32_t P = Ps[pi], T = 10;
    kvi_store *s = fp8_store(m, P, 64);
    rfact f, want, got;
    rfact_make(&f, &r, 1, 7, L, T, HT, D, -6, 2);
    fill_outliers(&f, &r);
    rfact_put(s, &f, 0);
    float *scales = malloc(div_up(T, P) * L * 2 * HT * sizeof *scales);
    double *offs = malloc(div_up(T, P) * L * HT * D * sizeof *offs);
    assert_non_null(scales);
    assert_non_null(offs);
    ref_quantize_ex(&f, P, &want, scales, offs, true);
    rfact_read(s, 1, 7, L, HT, D, &got);
    char what[64];
    snprintf(what, sizeof what, "fp32 put, P %d", (int)P);
    expect_fact(&got, &want, what);
    /* the e4m3 bound, and the per-head relative Frobenius error */
    double worst = 0.0, num[2] = {0, 0}, den[2] = {0, 0};
    for (int l = 0; l < L; l++)
      for (int t = 0; t < T; t++)
        for (int h = 0; h < HT; h++)
          for (int kv = 0; kv < 2; kv++) {
            const float *x = rfact_row(&f, kv, l, t, h), *y = rfact_row(&got, kv, l, t, h);
            for (int d = 0; d < D; d++) {
              const double e = fabs((double)y[d] - x[d]);
              num[kv] += e * e, den[kv] += (double)x[d] * x[d];
              /* in e4m3's normal range (|x - m| / scale >= 2^-6) the error is at most 2^-4 |x - m|, plus
               * the fp32 roundings of x - m and of the value (keys; values: m = 0) */
              const double sc = scales[(((size_t)(t / P) * L + l) * 2 + kv) * HT + h];
              const double mo = kv ? 0.0 : offs[(((size_t)(t / P) * L + l) * HT + h) * D + d], dx = fabs(x[d] - mo);
              if (dx >= 0x1p-6 * sc && e > 0x1p-4 * dx + 0x1p-23 * (fabs((double)x[d]) + fabs(mo)))
                fail_msg("P %d: |%g - %g| exceeds 2^-4 of |x - m| (m %g)", (int)P, (double)y[d], (double)x[d], mo);
              if (e / fabs((double)x[d]) > worst && fabs((double)x[d]) > 0.25) worst = e / fabs((double)x[d]);
            }
          }
    print_message("fp8 page %2d tokens: relative Frobenius error K %.4f V %.4f (largest per element above 0.25: %.4f)\n",
                  (int)P, sqrt(num[0] / den[0]), sqrt(num[1] / den[1]), worst);
    rfact_free(&got);
    /* into bf16 and from bf16 */
    const size_t n = (size_t)L * T * HT * D;
    uint16_t *kb = malloc(n * 2), *vb = malloc(n * 2);
    assert_non_null(kb);
    assert_non_null(vb);
    kvi_kv_view v;
    kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_BF16, L, T, HT, D, kb, vb);
    assert_ok(kvi_store_read(s, 1, 7, &v, NULL));
    for (size_t i = 0; i < n; i++)
      if (kb[i] != ref_f32_to_bf16(want.k[i]) || vb[i] != ref_f32_to_bf16(want.v[i]))
        fail_msg("bf16 read, element %zu", i);
    /* a bf16 source is quantized from its values */
    rfact fb = f;
    fb.k = malloc(n * 4), fb.v = malloc(n * 4);
    for (size_t i = 0; i < n; i++) fb.k[i] = ref_bf16_to_f32(kb[i]), fb.v[i] = ref_bf16_to_f32(vb[i]);
    assert_ok(kvi_store_put(s, 1, 8, &v, NULL, NULL));
    rfact wb;
    ref_quantize(&fb, P, &wb, NULL);
    rfact_read(s, 1, 8, L, HT, D, &got);
    expect_fact(&got, &wb, "bf16 put");
    /* statistics: the scales are part of every page */
    const kvi_store_stats st = store_stats(s);
    const uint64_t tb = (uint64_t)L * 2 * HT * D, pages = 2 * div_up(T, P);
    assert_int_equal(st.pages_used, pages);
    assert_int_equal(st.bytes_used, pages * st.page_bytes);
    assert_int_equal(st.bytes_payload, 2 * T * tb + pages * (st.page_bytes - P * tb));
    rfact_free(&got);
    rfact_free(&wb);
    rfact_free(&fb);
    free(kb);
    free(vb);
    rfact_free(&want);
    rfact_free(&f);
    free(scales);
    free(offs);
    kvi_store_destroy(s);
  }
  kvi_model_destroy(m);
}

static void test_fp8_special_values(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_store *s = fp8_store(m, 4, 16);
  rfact f, want, got;
  rfact_make(&f, &r, 1, 1, L, 6, HT, D, -6, 2);
  /* layer 0, K and V, head 0: zeros and -0 (a zero group: exact; values keep their signs, keys read
   * back +0: fmaf(-0, scale, +0)) */
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) rfact_row(&f, 0, 0, t, 0)[d] = rfact_row(&f, 1, 0, t, 0)[d] = (d & 1) ? -0.0f : 0.0f;
  /* layer 0, K, head 1: fp32 subnormals and tiny normals (the scale floor) */
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) rfact_row(&f, 0, 0, t, 1)[d] = (float)((d - 16) * 3) * 0x1p-140f;
  /* layer 1, V, head 2: NaN and infinities among ordinary values */
  rfact_row(&f, 1, 1, 1, 2)[3] = NAN;
  rfact_row(&f, 1, 1, 2, 2)[5] = INFINITY;
  rfact_row(&f, 1, 1, 3, 2)[7] = -INFINITY;
  /* layer 2, V, head 3: huge values (no saturation short of FLT_MAX) */
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) rfact_row(&f, 1, 2, t, 3)[d] = (float)(d + 1) * 1e36f;
  rfact_put(s, &f, 0);
  ref_quantize(&f, 4, &want, NULL);
  rfact_read(s, 1, 1, L, HT, D, &got);
  expect_fact(&got, &want, "special values");
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) {
      assert_int_equal(f2u(rfact_row(&got, 0, 0, t, 0)[d]), 0u);
      assert_int_equal(f2u(rfact_row(&got, 1, 0, t, 0)[d]), (d & 1) ? 0x80000000u : 0u);
    }
  assert_true(isnan(rfact_row(&got, 1, 1, 1, 2)[3]));
  /* infinities come back as +-448 * scale: the largest finite magnitude of the group, in e4m3 */
  const float big = rfact_row(&got, 1, 1, 2, 2)[5], nbig = rfact_row(&got, 1, 1, 3, 2)[7];
  assert_true(isfinite(big) && big > 0 && nbig == -big);
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) assert_true(fabsf(rfact_row(&got, 1, 1, t, 2)[d]) <= big || isnan(rfact_row(&got, 1, 1, t, 2)[d]));
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) assert_true(isfinite(rfact_row(&got, 1, 2, t, 3)[d]));
  /* the largest magnitude of a group is stored as code 448 exactly */
  const float top = rfact_row(&got, 1, 2, 3, 3)[D - 1], x = rfact_row(&f, 1, 2, 3, 3)[D - 1];
  assert_true(fabs((double)top - x) <= 0x1p-20 * x);
  rfact_free(&got);
  rfact_free(&want);
  rfact_free(&f);
  /* an fp8 view is no dense source; e5m2 stores are not offered */
  uint8_t buf[L * HT * D];
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP8_E4M3, L, 1, HT, D, buf, buf);
  assert_status(kvi_store_put(s, 1, 2, &v, NULL, NULL), KVI_ERR_MISMATCH);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP8_E5M2, 4, 1u << 20);
  kvi_store *s2 = NULL;
  assert_status(kvi_store_create(&s2, m, &o), KVI_ERR_UNSUPPORTED);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ---- inject and capture -------------------------------------------------- */

static void inject_case(rng *r, kvi_dtype cdt, kvi_scale_mode sm, int32_t P) {
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_rope_spec specs[L];
  ref_rope rr[L];
  for (int l = 0; l < L; l++) {
    kvi_rope_spec_init(&specs[l], sizeof specs[l]);
    specs[l].style = l == 1 ? KVI_ROPE_NONE : l == 0 ? KVI_ROPE_NEOX : KVI_ROPE_GPTJ;
    specs[l].theta = 10000.0;
    assert_ok(kvi_model_set_rope(m, l, &specs[l]));
    ref_rope_init(&rr[l], &specs[l], D);
  }
  kvi_store *s = fp8_store(m, P, 64);
  ecache c;
  ec_make(&c, KVI_CACHE_VLLM_FLASH_ATTN, cdt, L, HT, D, 4, 16, sm, r);
  kvi_injector *inj;
  assert_ok(kvi_injector_create(&inj, s, &c.lay, NULL));
  rfact f, dq;
  rfact_make(&f, r, 1, 1, L, 9, HT, D, -6, 2);
  if (!is_fp8(cdt)) fill_outliers(&f, r); /* an fp8 cache's own scales (>= 0.05) would saturate them */
  rfact_put(s, &f, 0);
  ref_quantize(&f, P, &dq, NULL);
  const int32_t table[] = {5, 2, 9, 11};
  int32_t pos[9];
  rand_positions(r, pos, 9, 0, 3000, true);
  const uint64_t id = 1;
  kvi_inject_request q;
  kvi_inject_request_init(&q, sizeof q);
  q.tenant = 1, q.fact_ids = &id, q.num_facts = 1, q.block_table = table, q.block_table_len = 4;
  q.first_slot = 3, q.positions = pos;
  assert_ok(kvi_inject(inj, &q, 1, NULL, NULL));
  const rfact *ff[] = {&dq};
  char what[96];
  snprintf(what, sizeof what, "inject from an fp8 store (P %d) into a %s cache", (int)P, cache_dtype_name(cdt));
  ec_check_request(&c, rr, ff, 1, table, 3, pos, 0, 0, L, 0.0, NULL, what);
  if (cdt == KVI_DTYPE_FP32) /* the deviation reads the values the injection wrote (keys with their offsets): none */
    for (int l = 0; l < L; l++) {
      float dev[9];
      assert_ok(kvi_inject_deviation(inj, &q, 1, l, dev, 9, KVI_MEMORY_HOST, NULL));
      for (int t = 0; t < 9; t++)
        if (dev[t] != 0.0f) fail_msg("%s: deviation of layer %d token %d is %g", what, l, t, (double)dev[t]);
    }
  kvi_injector_destroy(inj);
  rfact_free(&dq);
  rfact_free(&f);
  ec_free(&c);
  kvi_store_destroy(s);
  for (int l = 0; l < L; l++) ref_rope_free(&rr[l]);
  kvi_model_destroy(m);
}

static void test_fp8_inject(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  inject_case(&r, KVI_DTYPE_BF16, KVI_SCALE_NONE, 4);
  inject_case(&r, KVI_DTYPE_FP32, KVI_SCALE_NONE, 16);
  inject_case(&r, KVI_DTYPE_FP16, KVI_SCALE_NONE, 3);
  inject_case(&r, KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_HEAD, 4);
}

/* Captures T tokens from a cache into an fp32 store and an fp8 store with
 * page size P: the fp8 store must hold the model applied to the fp32 one. */
static void capture_case(rng *r, int32_t P, int32_t T) {
  kvi_model *m = make_model(L, HT, D, 0, 1);
  for (int l = 0; l < L; l++) {
    kvi_rope_spec sp = KVI_ROPE_SPEC_INIT;
    sp.style = l == 2 ? KVI_ROPE_GPTJ : KVI_ROPE_NEOX;
    sp.theta = 500000.0;
    assert_ok(kvi_model_set_rope(m, l, &sp));
  }
  kvi_store_options o32 = cpu_store_options(KVI_DTYPE_FP32, P, 64ull << 20);
  kvi_store *s32;
  assert_ok(kvi_store_create(&s32, m, &o32));
  kvi_store *s8 = fp8_store(m, P, (uint32_t)div_up((uint64_t)T, (uint64_t)P) * 2);
  ecache c;
  const int32_t BS = 16, nb = (T + 2 + BS - 1) / BS;
  ec_make(&c, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, HT, D, BS, nb + 2, KVI_SCALE_NONE, r);
  kvi_injector *inj;
  kvi_encoder *e32, *e8;
  assert_ok(kvi_injector_create(&inj, s32, &c.lay, NULL));
  assert_ok(kvi_encoder_create(&e32, s32, &c.lay, NULL));
  assert_ok(kvi_encoder_create(&e8, s8, &c.lay, NULL));
  rfact f;
  rfact_make(&f, r, 1, 1, L, T, HT, D, -6, 2);
  fill_outliers(&f, r);
  rfact_put(s32, &f, 0);
  int32_t *table = malloc((size_t)(nb + 2) * sizeof *table);
  for (int i = 0; i < nb + 2; i++) table[i] = nb + 1 - i;
  const uint64_t id = 1;
  kvi_inject_request q;
  kvi_inject_request_init(&q, sizeof q);
  q.tenant = 1, q.fact_ids = &id, q.num_facts = 1, q.block_table = table, q.block_table_len = nb + 2;
  q.first_slot = 2, q.start_position = 77;
  assert_ok(kvi_inject(inj, &q, 1, NULL, NULL));
  kvi_capture cp;
  kvi_capture_init(&cp, sizeof cp);
  cp.tenant = 1, cp.fact_id = 2, cp.block_table = table, cp.block_table_len = nb + 2, cp.first_slot = 2;
  cp.num_tokens = T, cp.start_position = 77;
  assert_ok(kvi_encode(e32, &cp, 1, NULL));
  assert_ok(kvi_encode(e8, &cp, 1, NULL));
  rfact u, want, got;
  rfact_read(s32, 1, 2, L, HT, D, &u);
  ref_quantize(&u, P, &want, NULL);
  rfact_read(s8, 1, 2, L, HT, D, &got);
  char what[64];
  snprintf(what, sizeof what, "capture into an fp8 store, P %d, %d tokens", (int)P, (int)T);
  expect_fact(&got, &want, what);
  /* a second capture over the same pages' ids (replace): slots start afresh */
  cp.flags = KVI_PUT_REPLACE;
  assert_ok(kvi_encode(e8, &cp, 1, NULL));
  rfact_free(&got);
  rfact_read(s8, 1, 2, L, HT, D, &got);
  expect_fact(&got, &want, what);
  rfact_free(&got);
  rfact_free(&want);
  rfact_free(&u);
  rfact_free(&f);
  free(table);
  kvi_encoder_destroy(e8);
  kvi_encoder_destroy(e32);
  kvi_injector_destroy(inj);
  ec_free(&c);
  kvi_store_destroy(s8);
  kvi_store_destroy(s32);
  kvi_model_destroy(m);
}

static void test_fp8_capture(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  capture_case(&r, 4, 7);     /* a segment per page, a partial last page */
  capture_case(&r, 16, 16);
  capture_case(&r, 128, 150); /* pages of several segments (seg_tokens <= 64) */
}

/* ---- store files ---------------------------------------------------------- */

static void test_fp8_persist(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_store *s = fp8_store(m, 4, 64);
  char path[] = "/tmp/kvi-fp8-XXXXXX";
  const int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  rfact f[3], got;
  for (int i = 0; i < 3; i++) {
    rfact_make(&f[i], &r, 1, (uint64_t)i, L, 3 + 4 * i, HT, D, -6, 2);
    fill_outliers(&f[i], &r);
    rfact_put(s, &f[i], 0);
  }
  assert_ok(kvi_store_save(s, path, NULL));
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP8_E4M3, 4, store_stats(s).page_bytes * 64);
  kvi_store *l2 = NULL;
  assert_ok(kvi_store_load(&l2, m, &o, path, NULL));
  for (int i = 0; i < 3; i++) {
    rfact want;
    rfact_read(s, 1, (uint64_t)i, L, HT, D, &want);
    rfact_read(l2, 1, (uint64_t)i, L, HT, D, &got);
    expect_fact(&got, &want, "loaded fp8 fact");
    rfact_free(&got);
    rfact_free(&want);
  }
  assert_int_equal(store_stats(l2).bytes_payload, store_stats(s).bytes_payload);
  kvi_store_destroy(l2);
  /* other dtypes and page sizes are refused */
  kvi_store_options ob = cpu_store_options(KVI_DTYPE_BF16, 4, 1u << 22);
  l2 = NULL;
  assert_status(kvi_store_load(&l2, m, &ob, path, NULL), KVI_ERR_INCOMPATIBLE);
  kvi_store_options op = cpu_store_options(KVI_DTYPE_FP8_E4M3, 8, 1u << 22);
  assert_status(kvi_store_load(&l2, m, &op, path, NULL), KVI_ERR_INCOMPATIBLE);
  assert_null(l2);
  /* the journal: puts after the snapshot come back bit for bit */
  assert_ok(kvi_store_journal_open(s, path, 0));
  rfact j;
  rfact_make(&j, &r, 2, 9, L, 5, HT, D, -6, 2);
  rfact_put(s, &j, 0);
  assert_ok(kvi_store_remove(s, 1, 0));
  kvi_store_destroy(s);
  assert_ok(kvi_store_load(&l2, m, &o, path, NULL));
  rfact want;
  ref_quantize(&j, 4, &want, NULL);
  rfact_read(l2, 2, 9, L, HT, D, &got);
  expect_fact(&got, &want, "journaled fp8 fact");
  int32_t T;
  assert_status(kvi_store_fact_tokens(l2, 1, 0, &T), KVI_ERR_NOT_FOUND);
  rfact_free(&got);
  rfact_free(&want);
  rfact_free(&j);
  kvi_store_destroy(l2);
  for (int i = 0; i < 3; i++) rfact_free(&f[i]);
  unlink(path);
  kvi_model_destroy(m);
}

/* ---- a key channel with a large bias ------------------------------------- */

/* The fp16 spacing at |x| (x normal in fp16). */
static double f16_ulp(double x) { return ldexp(1.0, ilogb(fabs(x) < 0x1p-14 ? 0x1p-14 : fabs(x)) - 10); }

/* Keys of N(0, 1)-like channels and one at 358 + N(0, 1) (as Qwen2.5's layer
 * 0 has): each page's offsets take the bias out, so every key comes back
 * within 2^-4 of the group's largest |x - m| (the bias channel's m within
 * half its range plus two fp16 steps of its values, the others' 0), a
 * fraction of a unit where a scale over |x| alone (the format before the
 * offsets) errs by up to 2^-4 x 358. */
static void test_fp8_bias_channel(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  const int32_t P = 16, T = 40;
  kvi_store *s = fp8_store(m, P, 64);
  rfact f, got;
  rfact_make(&f, &r, 1, 3, L, T, HT, D, -6, 0);
  for (int l = 0; l < L; l++)
    for (int t = 0; t < T; t++)
      for (int h = 0; h < HT; h++) rfact_row(&f, 0, l, t, h)[7] = 358.0f + rand_val(&r, -4, 0);
  rfact_put(s, &f, 0);
  rfact_read(s, 1, 3, L, HT, D, &got);
  double worst = 0.0, worst_bound = 0.0;
  for (int32_t t0 = 0; t0 < T; t0 += P)
    for (int l = 0; l < L; l++)
      for (int h = 0; h < HT; h++) {
        const int32_t nt = T - t0 < P ? T - t0 : P;
        double g = 0.0; /* the group's largest |x - m|: m 0, or within two fp16 steps of a banded channel's midpoint */
        for (int d = 0; d < D; d++) {
          double mn = INFINITY, mx = -INFINITY;
          for (int32_t t = 0; t < nt; t++) {
            const double x = rfact_row(&f, 0, l, t0 + t, h)[d];
            mn = fmin(mn, x), mx = fmax(mx, x);
          }
          const double a = fmax(fabs(mn), fabs(mx));
          const bool banded = (mn > 0 && mx - mn < mn) || (mx < 0 && mx - mn < -mx); /* the offset: its midpoint */
          g = fmax(g, banded ? (mx - mn) / 2 + 2 * f16_ulp(a) : a);
        }
        for (int32_t t = 0; t < nt; t++)
          for (int d = 0; d < D; d++) {
            const double x = rfact_row(&f, 0, l, t0 + t, h)[d], y = rfact_row(&got, 0, l, t0 + t, h)[d];
            const double e = fabs(y - x), bound = 0x1p-4 * g + 0x1p-22 * fabs(x);
            if (e > bound) fail_msg("layer %d head %d token %d channel %d: |%g - %g| = %g exceeds %g", l, h, (int)(t0 + t), d, y, x, e, bound);
            if (d == 7 && e > worst) worst = e, worst_bound = bound;
          }
      }
  print_message("bias channel (358 + N(0,1)): largest error %.4f (bound %.4f)\n", worst, worst_bound);
  /* and bit for bit the model */
  rfact want;
  ref_quantize(&f, P, &want, NULL);
  expect_fact(&got, &want, "bias channel");
  rfact_free(&want);
  rfact_free(&got);
  rfact_free(&f);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ---- a store file of format version 3 ------------------------------------- */

/* fp8_v3_file.h's file (written before the key offsets) loads: its pages get
 * offsets of -0, so every element reads back as e4m3 * scale, the values
 * that version held (the model without offsets), bit for bit; it takes no
 * journal; saved again it is a version-4 file that reads the same. */
static void test_fp8_version3_file(void **state) {
  (void)state;
  char dir[] = "/tmp/kvi-fp8v3-XXXXXX", path[64], path4[64];
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/v3", dir);
  snprintf(path4, sizeof path4, "%s/v4", dir);
  FILE *fp = fopen(path, "wb");
  assert_non_null(fp);
  assert_int_equal(fwrite(fp8_v3_file, 1, sizeof fp8_v3_file, fp), sizeof fp8_v3_file);
  assert_int_equal(fclose(fp), 0);
  kvi_model *m = make_model(V3_L, V3_H, V3_D, 0, 1);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP8_E4M3, V3_P, 1u << 20);
  kvi_store *s = NULL, *s4 = NULL;
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  lo.flags = KVI_LOAD_JOURNAL;
  assert_status(kvi_store_load(&s, m, &o, path, &lo), KVI_ERR_INCOMPATIBLE);
  assert_last_error_has("kvi_store_load", "format version 3");
  assert_null(s);
  assert_ok(kvi_store_load(&s, m, &o, path, NULL));
  assert_ok(kvi_store_save(s, path4, NULL));
  assert_ok(kvi_store_load(&s4, m, &o, path4, NULL));
  fp = fopen(path4, "rb");
  assert_non_null(fp);
  unsigned char hdr[12];
  assert_int_equal(fread(hdr, 1, sizeof hdr, fp), sizeof hdr);
  fclose(fp);
  assert_int_equal(hdr[8], 4);
  for (int id = 1; id <= 2; id++) {
    const int32_t T = id == 1 ? 6 : 3;
    rfact f = {1, (uint64_t)id, V3_L, T, V3_H, V3_D, NULL, NULL};
    const size_t n = (size_t)V3_L * T * V3_H * V3_D;
    f.k = malloc(n * sizeof(float));
    f.v = malloc(n * sizeof(float));
    assert_non_null(f.k);
    assert_non_null(f.v);
    for (int l = 0; l < V3_L; l++)
      for (int t = 0; t < T; t++)
        for (int h = 0; h < V3_H; h++)
          for (int d = 0; d < V3_D; d++) {
            rfact_row(&f, 0, l, t, h)[d] = fp8_v3_k(l, t, h, d, id);
            rfact_row(&f, 1, l, t, h)[d] = fp8_v3_v(l, t, h, d, id);
          }
    rfact want, got;
    ref_quantize_ex(&f, V3_P, &want, NULL, NULL, false); /* the format without offsets */
    rfact_read(s, 1, (uint64_t)id, V3_L, V3_H, V3_D, &got);
    expect_fact(&got, &want, "version-3 file");
    rfact_free(&got);
    rfact_read(s4, 1, (uint64_t)id, V3_L, V3_H, V3_D, &got);
    expect_fact(&got, &want, "version-3 file saved as version 4");
    rfact_free(&got);
    rfact_free(&want);
    rfact_free(&f);
  }
  kvi_store_destroy(s4);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  unlink(path);
  unlink(path4);
  rmdir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fp8_put_read),   cmocka_unit_test(test_fp8_special_values),
      cmocka_unit_test(test_fp8_inject),     cmocka_unit_test(test_fp8_capture),
      cmocka_unit_test(test_fp8_persist),    cmocka_unit_test(test_fp8_bias_channel),
      cmocka_unit_test(test_fp8_version3_file),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
