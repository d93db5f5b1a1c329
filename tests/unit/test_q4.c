/*
 * unit-q4: group-wise 4-bit fact storage (KVI_DTYPE_Q4) on the CPU backend,
 * against a float64 model of the format written here from the header's
 * description (kvinject/store.h, "4-bit storage"): per key channel over a
 * page's tokens, per value token over its channels, a group's minimum
 * rounded down and maximum rounded up to fp16 (m, M), a scale s of at most
 * one fp16 step above (M - m) / 15 rounded up, and every finite x in the
 * group read back within s / 2 of itself (plus fp32 rounding).
 *   - put from fp32/bf16 views, read back into fp32/bf16: within the bound;
 *     the relative Frobenius error of K and V, reported;
 *   - page geometry: bytes per page and per token, 4-bit at most 0.28x bf16
 *     at head size 128 and 64-token pages;
 *   - zeros, constant groups, NaN and infinities, values past fp16's range;
 *   - injection into every CPU cache dtype and layout against the float64
 *     rotation of the values a read gives; the deviation of what was
 *     injected is zero (fp32 cache);
 *   - capture: the same codes and scales as a put of what an fp32 store
 *     captures;
 *   - tenants: same ids under two tenants stay apart;
 *   - store files: records byte for byte the same after save and load, the
 *     journal, other dtypes and page sizes refused;
 *   - bad input: odd head sizes, 4-bit views and caches.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "ref64.h"

#include <float.h>
#include <unistd.h>

enum { L = 3, HT = 4, D = 32 };

/* ---- the float64 model ---------------------------------------------------- */

/* Every finite fp16 value, ascending (from the reference fp16 decoder). */
static double f16_grid[63488];
static int f16_count;

static int cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void grid_init(void) {
  if (f16_count) return;
  for (uint32_t h = 0; h < 65536; h++) {
    const float v = ref_f16_to_f32((uint16_t)h);
    if (isfinite(v) && !(v == 0 && signbit(v))) f16_grid[f16_count++] = v;
  }
  qsort(f16_grid, (size_t)f16_count, sizeof *f16_grid, cmp_double);
}

/* The largest fp16 <= x (the smallest for x below the range), and the
 * smallest fp16 >= x (the largest above it). */
static double f16_down(double x) {
  int lo = 0, hi = f16_count - 1;
  if (x <= f16_grid[0]) return f16_grid[0];
  while (lo < hi) { /* largest index with grid <= x */
    const int mid = (lo + hi + 1) / 2;
    if (f16_grid[mid] <= x) lo = mid;
    else hi = mid - 1;
  }
  return f16_grid[lo];
}

static double f16_up(double x) {
  int lo = 0, hi = f16_count - 1;
  if (x >= f16_grid[hi]) return f16_grid[hi];
  while (lo < hi) { /* smallest index with grid >= x */
    const int mid = (lo + hi) / 2;
    if (f16_grid[mid] >= x) hi = mid;
    else lo = mid + 1;
  }
  return f16_grid[lo];
}

/* The next fp16 above x (x on the grid). */
static double f16_next(double x) { return f16_up(nextafter(x, INFINITY)); }

/* A group's model: bounds m, M and the largest scale the format allows. */
typedef struct qgroup {
  double m, M, smax;
} qgroup;

static qgroup ref_group(const float *x, int n, int step) {
  double mn = INFINITY, mx = -INFINITY;
  for (int i = 0; i < n; i++) {
    const double v = x[(size_t)i * (size_t)step];
    if (!isfinite(v)) continue;
    if (v < mn) mn = v;
    if (v > mx) mx = v;
  }
  if (mn > mx) mn = mx = 0.0;
  qgroup g;
  g.m = f16_down(mn), g.M = f16_up(mx);
  g.smax = f16_next(f16_up((g.M - g.m) / 15.0));
  if (g.M == g.m) g.smax = 0.0;
  return g;
}

/* |x - y| within the group's bound: half a scale, plus fp32 roundings. */
static bool within(double x, double y, const qgroup *g) {
  const double eps = 0x1p-21 * (fabs(g->m) + fabs(g->M) + fabs(x)) + 0x1p-40;
  return fabs(x - y) <= 0.5 * g->smax + eps;
}

/* Checks every finite element of got (what a read gave) against src. */
static void check_bound(const rfact *src, const rfact *got, int32_t P, const char *what, double *rel) {
  double num[2] = {0, 0}, den[2] = {0, 0};
  float col[4096];
  for (int l = 0; l < src->L; l++)
    for (int h = 0; h < src->H; h++)
      for (int32_t t0 = 0; t0 < src->T; t0 += P) {
        const int32_t n = src->T - t0 < P ? src->T - t0 : P;
        for (int d = 0; d < src->D; d++) { /* K: channel d over the page's tokens */
          for (int32_t t = 0; t < n; t++) col[t] = rfact_row(src, 0, l, t0 + t, h)[d];
          const qgroup g = ref_group(col, n, 1);
          for (int32_t t = 0; t < n; t++) {
            const double x = col[t], y = rfact_row(got, 0, l, t0 + t, h)[d];
            if (isfinite(x) && !within(x, y, &g))
              fail_msg("%s: K l %d h %d t %d d %d: %a read back as %a (m %a M %a s <= %a)", what, l, h, (int)(t0 + t), d,
                       x, y, g.m, g.M, g.smax);
            if (isfinite(x)) num[0] += (x - y) * (x - y), den[0] += x * x;
          }
        }
        for (int32_t t = 0; t < n; t++) { /* V: one token's channels */
          const float *x = rfact_row(src, 1, l, t0 + t, h), *y = rfact_row(got, 1, l, t0 + t, h);
          const qgroup g = ref_group(x, src->D, 1);
          for (int d = 0; d < src->D; d++) {
            if (isfinite(x[d]) && !within(x[d], y[d], &g))
              fail_msg("%s: V l %d h %d t %d d %d: %a read back as %a", what, l, h, (int)(t0 + t), d, (double)x[d],
                       (double)y[d]);
            if (isfinite(x[d])) num[1] += ((double)x[d] - y[d]) * ((double)x[d] - y[d]), den[1] += (double)x[d] * x[d];
          }
        }
      }
  if (rel) rel[0] = sqrt(num[0] / den[0]), rel[1] = sqrt(num[1] / den[1]);
}

static bool same_float(float a, float b) { return f2u(a) == f2u(b) || (isnan(a) && isnan(b)); }

static void expect_same(const rfact *got, const rfact *want, const char *what) {
  const size_t n = (size_t)want->L * want->T * want->H * want->D;
  for (size_t i = 0; i < n; i++)
    for (int kv = 0; kv < 2; kv++) {
      const float g = (kv ? got->v : got->k)[i], w = (kv ? want->v : want->k)[i];
      if (!same_float(g, w)) fail_msg("%s: %s element %zu is %a, expected %a", what, kv ? "V" : "K", i, (double)g, (double)w);
    }
}

/* Bytes of a page of a Q4 store, from the header's description. */
static uint64_t q4_page_bytes(int32_t Lm, int32_t H, int32_t Dm, int32_t P) {
  const uint64_t codes = (uint64_t)Lm * 2 * H * P * Dm / 2, words = (uint64_t)Lm * H * (Dm + P) * 4;
  return ((codes + 15) & ~15ull) + ((words + 15) & ~15ull);
}

static kvi_store *q4_store(kvi_model *m, int32_t P, uint32_t pages) {
  const uint64_t page = q4_page_bytes(L, HT, D, P);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_Q4, P, page * pages);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.page_bytes, page);
  assert_int_equal(st.pages_total, pages);
  assert_int_equal(st.dtype, KVI_DTYPE_Q4);
  return s;
}

/* K with a few channels 10-50x the others and offset (as LLM keys have), V plain. */
static void fill_outliers(rfact *f, rng *r) {
  for (int l = 0; l < f->L; l++)
    for (int t = 0; t < f->T; t++)
      for (int h = 0; h < f->H; h++)
        for (int d = 0; d < f->D; d++) {
          const float g = rand_val(r, -3, 1);
          rfact_row(f, 0, l, t, h)[d] = d % 11 == 3 ? g * (float)(10 + (d * 7) % 41) + 20.0f : g;
          rfact_row(f, 1, l, t, h)[d] = rand_val(r, -4, 0);
        }
}

/* ---- put / read ------------------------------------------------------------ */

static void test_q4_put_read(void **state) {
  (void)state;
  grid_init();
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  const int32_t Ps[] = {4, 16, 64, 1};
  for (int pi = 0; pi < 4; pi++) {
    const int32_t P = Ps[pi], T = 70;
    kvi_store *s = q4_store(m, P, 2 * (uint32_t)div_up(T, P));
    rfact f, got;
    rfact_make(&f, &r, 1, 7, L, T, HT, D, -6, 2);
    fill_outliers(&f, &r);
    rfact_put(s, &f, 0);
    rfact_read(s, 1, 7, L, HT, D, &got);
    char what[64];
    snprintf(what, sizeof what, "fp32 put, P %d", (int)P);
    double rel[2];
    check_bound(&f, &got, P, what, rel);
    print_message("q4 page %2d tokens: relative Frobenius error K %.4f V %.4f\n", (int)P, rel[0], rel[1]);
    /* into bf16: the fp32 values rounded */
    const size_t n = (size_t)L * T * HT * D;
    uint16_t *kb = malloc(n * 2), *vb = malloc(n * 2);
    assert_non_null(kb);
    assert_non_null(vb);
    kvi_kv_view v;
    kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_BF16, L, T, HT, D, kb, vb);
    assert_ok(kvi_store_read(s, 1, 7, &v, NULL));
    for (size_t i = 0; i < n; i++)
      if (kb[i] != ref_f32_to_bf16(got.k[i]) || vb[i] != ref_f32_to_bf16(got.v[i])) fail_msg("bf16 read, element %zu", i);
    /* a bf16 source is quantized from its values */
    rfact fb = f, gb;
    fb.k = malloc(n * 4), fb.v = malloc(n * 4);
    for (size_t i = 0; i < n; i++) fb.k[i] = ref_bf16_to_f32(kb[i]), fb.v[i] = ref_bf16_to_f32(vb[i]);
    assert_ok(kvi_store_put(s, 1, 8, &v, NULL, NULL));
    rfact_read(s, 1, 8, L, HT, D, &gb);
    check_bound(&fb, &gb, P, "bf16 put", NULL);
    /* statistics: the scales are part of every page */
    const kvi_store_stats st = store_stats(s);
    const uint64_t tb = (uint64_t)L * 2 * HT * D / 2, pages = 2 * div_up(T, P);
    assert_int_equal(st.pages_used, pages);
    assert_int_equal(st.bytes_used, pages * st.page_bytes);
    assert_int_equal(st.bytes_payload, 2 * T * tb + pages * (st.page_bytes - P * tb));
    rfact_free(&gb);
    rfact_free(&fb);
    free(kb);
    free(vb);
    rfact_free(&got);
    rfact_free(&f);
    kvi_store_destroy(s);
  }
  kvi_model_destroy(m);
}

/* Bytes per stored token: 4-bit K and V with their scales against bf16. */
static void test_q4_geometry(void **state) {
  (void)state;
  kvi_model *m = make_model(2, 2, 128, 0, 1);
  const int32_t Ps[] = {16, 32, 64, 128};
  for (int i = 0; i < 4; i++) {
    const int32_t P = Ps[i];
    kvi_store_options o = cpu_store_options(KVI_DTYPE_Q4, P, 1u << 22);
    kvi_store *s = NULL;
    assert_ok(kvi_store_create(&s, m, &o));
    const uint64_t pb = store_stats(s).page_bytes, bf16 = (uint64_t)2 * 2 * 2 * P * 128 * 2;
    assert_int_equal(pb, q4_page_bytes(2, 2, 128, P));
    const double ratio = (double)pb / (double)bf16; /* 1/4 + 1/P + 1/D */
    print_message("q4 head size 128, %3d-token pages: %.4f x bf16\n", (int)P, ratio);
    assert_true(fabs(ratio - (0.25 + 1.0 / P + 1.0 / 128)) < 1e-3);
    if (P >= 64) assert_true(ratio <= 0.28);
    kvi_store_destroy(s);
  }
  assert_int_equal(kvi_dtype_size(KVI_DTYPE_Q4), 0);
  kvi_model_destroy(m);
}

static void test_q4_special_values(void **state) {
  (void)state;
  grid_init();
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_store *s = q4_store(m, 4, 16);
  rfact f, got;
  rfact_make(&f, &r, 1, 1, L, 6, HT, D, -6, 2);
  /* layer 0, K, head 0: zeros and -0 (a zero group: +0) */
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) rfact_row(&f, 0, 0, t, 0)[d] = (d & 1) ? -0.0f : 0.0f;
  /* layer 0, V, head 1: a constant row that fp16 holds (exact) */
  for (int d = 0; d < D; d++) rfact_row(&f, 1, 0, 2, 1)[d] = 1.5f;
  /* layer 1, V, head 2: NaN and infinities among ordinary values */
  rfact_row(&f, 1, 1, 1, 2)[3] = NAN;
  rfact_row(&f, 1, 1, 2, 2)[5] = INFINITY;
  rfact_row(&f, 1, 1, 3, 2)[7] = -INFINITY;
  /* layer 2, K, head 3, channel 0: past fp16's range (clamped to +-65504) */
  rfact_row(&f, 0, 2, 0, 3)[0] = 1e6f;
  rfact_row(&f, 0, 2, 1, 3)[0] = -1e6f;
  rfact_put(s, &f, 0);
  rfact_read(s, 1, 1, L, HT, D, &got);
  for (int t = 0; t < 4; t++)
    for (int d = 0; d < D; d++) assert_int_equal(f2u(rfact_row(&got, 0, 0, t, 0)[d]), 0u);
  for (int d = 0; d < D; d++) assert_true(rfact_row(&got, 1, 0, 2, 1)[d] == 1.5f);
  /* NaN reads back as the row's minimum, infinities as its ends */
  const float *row = rfact_row(&got, 1, 1, 1, 2), *row2 = rfact_row(&got, 1, 1, 2, 2), *row3 = rfact_row(&got, 1, 1, 3, 2);
  float lo = INFINITY, hi = -INFINITY;
  for (int d = 0; d < D; d++) lo = fminf(lo, row[d]);
  assert_true(row[3] == lo);
  for (int d = 0; d < D; d++) hi = fmaxf(hi, row2[d]);
  assert_true(row2[5] == hi && isfinite(hi));
  lo = INFINITY;
  for (int d = 0; d < D; d++) lo = fminf(lo, row3[d]);
  assert_true(row3[7] == lo && isfinite(lo));
  assert_true(rfact_row(&got, 0, 2, 0, 3)[0] >= 65504.0f - 65504.0f / 1024 && rfact_row(&got, 0, 2, 1, 3)[0] == -65504.0f);
  /* everything else stays within the bound */
  rfact_row(&f, 1, 1, 1, 2)[3] = rfact_row(&got, 1, 1, 1, 2)[3];
  rfact_row(&f, 1, 1, 2, 2)[5] = rfact_row(&got, 1, 1, 2, 2)[5];
  rfact_row(&f, 1, 1, 3, 2)[7] = rfact_row(&got, 1, 1, 3, 2)[7];
  rfact_row(&f, 0, 2, 0, 3)[0] = rfact_row(&got, 0, 2, 0, 3)[0];
  rfact_row(&f, 0, 2, 1, 3)[0] = rfact_row(&got, 0, 2, 1, 3)[0];
  check_bound(&f, &got, 4, "special values", NULL);
  rfact_free(&got);
  rfact_free(&f);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_q4_bad_input(void **state) {
  (void)state;
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_store *s = q4_store(m, 4, 16);
  /* a 4-bit view is no dense source or destination */
  uint8_t buf[L * HT * D];
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_Q4, L, 1, HT, D, buf, buf);
  assert_status(kvi_store_put(s, 1, 2, &v, NULL, NULL), KVI_ERR_MISMATCH);
  /* nor a cache */
  ecache c;
  rng r;
  rng_seed(&r, __func__);
  ec_make(&c, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, HT, D, 4, 4, KVI_SCALE_NONE, &r);
  c.lay.dtype = KVI_DTYPE_Q4;
  kvi_injector *inj = NULL;
  assert_status(kvi_injector_create(&inj, s, &c.lay, NULL), KVI_ERR_UNSUPPORTED);
  assert_null(inj);
  ec_free(&c);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  /* an odd head size cannot be packed two a byte */
  kvi_model *odd = make_model(L, HT, 33, 0, 1);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_Q4, 4, 1u << 20);
  s = NULL;
  assert_status(kvi_store_create(&s, odd, &o), KVI_ERR_UNSUPPORTED);
  assert_null(s);
  kvi_model_destroy(odd);
}

/* ---- inject and capture ------------------------------------------------------ */

static void inject_case(rng *r, kvi_cache_preset preset, kvi_dtype cdt, kvi_scale_mode sm, int32_t P) {
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
  kvi_store *s = q4_store(m, P, 64);
  ecache c;
  ec_make(&c, preset, cdt, L, HT, D, 4, 16, sm, r);
  kvi_injector *inj;
  assert_ok(kvi_injector_create(&inj, s, &c.lay, NULL));
  rfact f, dq;
  rfact_make(&f, r, 1, 1, L, 9, HT, D, -6, 2);
  if (!is_fp8(cdt)) fill_outliers(&f, r);
  rfact_put(s, &f, 0);
  rfact_read(s, 1, 1, L, HT, D, &dq); /* the dequantized values (bounded by test_q4_put_read) */
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
  char what[160];
  snprintf(what, sizeof what, "inject from a q4 store (P %d) into a %s %s cache", (int)P, cache_dtype_name(cdt),
           preset_name(preset));
  ec_check_request(&c, rr, ff, 1, table, 3, pos, 0, 0, L, 0.0, NULL, what);
  if (cdt == KVI_DTYPE_FP32) /* the deviation reads the values the injection wrote: none */
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

static void test_q4_inject(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  inject_case(&r, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, KVI_SCALE_NONE, 4);
  inject_case(&r, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, KVI_SCALE_NONE, 16);
  inject_case(&r, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP16, KVI_SCALE_NONE, 3);
  inject_case(&r, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_HEAD, 4);
  inject_case(&r, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP8_E5M2, KVI_SCALE_PER_TENSOR, 4);
  const kvi_cache_preset presets[] = {KVI_CACHE_VLLM_FLASH_ATTN_HND, KVI_CACHE_VLLM_FLASHINFER,
                                      KVI_CACHE_VLLM_FLASHINFER_HND, KVI_CACHE_VLLM_PACKED,
                                      KVI_CACHE_VLLM_PACKED_HND,     KVI_CACHE_SGLANG,
                                      KVI_CACHE_TRTLLM,              KVI_CACHE_HF_CONTIGUOUS,
                                      KVI_CACHE_VLLM_CPU,            (kvi_cache_preset)EC_GENERIC_KV_BASES,
                                      (kvi_cache_preset)EC_GENERIC_V_OFFSET, (kvi_cache_preset)EC_GENERIC_POOL,
                                      (kvi_cache_preset)EC_GENERIC_GAPS,     (kvi_cache_preset)EC_GENERIC_VT,
                                      (kvi_cache_preset)EC_GENERIC_MIXED};
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
    inject_case(&r, presets[i], i % 2 ? KVI_DTYPE_FP16 : KVI_DTYPE_BF16, KVI_SCALE_NONE, 8);
}

/* Captures T tokens from a cache into an fp32 store and a q4 store of page
 * size P: the q4 store must hold what a put of the fp32 store's fact gives. */
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
  kvi_store *s4 = q4_store(m, P, (uint32_t)div_up((uint64_t)T, (uint64_t)P) * 3);
  ecache c;
  const int32_t BS = 16, nb = (T + 2 + BS - 1) / BS;
  ec_make(&c, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, HT, D, BS, nb + 2, KVI_SCALE_NONE, r);
  kvi_injector *inj;
  kvi_encoder *e32, *e4;
  assert_ok(kvi_injector_create(&inj, s32, &c.lay, NULL));
  assert_ok(kvi_encoder_create(&e32, s32, &c.lay, NULL));
  assert_ok(kvi_encoder_create(&e4, s4, &c.lay, NULL));
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
  assert_ok(kvi_encode(e4, &cp, 1, NULL));
  rfact u, want, got;
  rfact_read(s32, 1, 2, L, HT, D, &u);
  u.tenant = 1, u.id = 3;
  rfact_put(s4, &u, 0);
  rfact_read(s4, 1, 3, L, HT, D, &want);
  rfact_read(s4, 1, 2, L, HT, D, &got);
  char what[64];
  snprintf(what, sizeof what, "capture into a q4 store, P %d, %d tokens", (int)P, (int)T);
  expect_same(&got, &want, what);
  /* a second capture over the same key (replace): bounds start afresh */
  cp.flags = KVI_PUT_REPLACE;
  assert_ok(kvi_encode(e4, &cp, 1, NULL));
  rfact_free(&got);
  rfact_read(s4, 1, 2, L, HT, D, &got);
  expect_same(&got, &want, what);
  rfact_free(&got);
  rfact_free(&want);
  rfact_free(&u);
  rfact_free(&f);
  free(table);
  kvi_encoder_destroy(e4);
  kvi_encoder_destroy(e32);
  kvi_injector_destroy(inj);
  ec_free(&c);
  kvi_store_destroy(s4);
  kvi_store_destroy(s32);
  kvi_model_destroy(m);
}

static void test_q4_capture(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  capture_case(&r, 4, 7); /* a segment per page, a partial last page */
  capture_case(&r, 16, 16);
  capture_case(&r, 128, 150); /* pages of several segments (seg_tokens <= 64) */
}

/* ---- tenants ------------------------------------------------------------------ */

static void test_q4_tenants(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_store *s = q4_store(m, 8, 16);
  rfact a, b, ga, gb, ra, rb;
  rfact_make(&a, &r, 1, 5, L, 11, HT, D, -6, 2);
  rfact_make(&b, &r, 2, 5, L, 11, HT, D, -2, 3);
  rfact_put(s, &a, 0);
  rfact_put(s, &b, 0);
  rfact_read(s, 1, 5, L, HT, D, &ga);
  rfact_read(s, 2, 5, L, HT, D, &gb);
  check_bound(&a, &ga, 8, "tenant 1", NULL);
  check_bound(&b, &gb, 8, "tenant 2", NULL);
  assert_ok(kvi_store_remove(s, 1, 5));
  int32_t T;
  assert_status(kvi_store_fact_tokens(s, 1, 5, &T), KVI_ERR_NOT_FOUND);
  rfact_read(s, 2, 5, L, HT, D, &rb);
  expect_same(&rb, &gb, "tenant 2 after tenant 1's removal");
  /* a new fact of tenant 1 on the freed pages leaves tenant 2's alone */
  rfact_put(s, &a, 0);
  rfact_read(s, 1, 5, L, HT, D, &ra);
  expect_same(&ra, &ga, "tenant 1 put again");
  rfact_free(&rb);
  rfact_read(s, 2, 5, L, HT, D, &rb);
  expect_same(&rb, &gb, "tenant 2");
  assert_status(kvi_store_fact_tokens(s, 3, 5, &T), KVI_ERR_NOT_FOUND);
  rfact_free(&a), rfact_free(&b), rfact_free(&ga), rfact_free(&gb), rfact_free(&ra), rfact_free(&rb);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

/* ---- store files ---------------------------------------------------------------- */

static unsigned char *read_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*n);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, *n, f), *n);
  fclose(f);
  return b;
}

static uint64_t le64(const unsigned char *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* Two store files hold the same facts byte for byte: their first entry's
 * body (the records: embeddings, codes, scales) is the same. The header and
 * entry headers differ only by each file's id and checksums. */
static void expect_same_records(const char *pa, const char *pb) {
  size_t na, nb;
  unsigned char *a = read_all(pa, &na), *b = read_all(pb, &nb);
  assert_int_equal(na, nb);
  const size_t hdr = 88 + 88 * (size_t)L + 4, body = (size_t)le64(a + hdr + 24);
  assert_int_equal(le64(b + hdr + 24), body);
  assert_true(hdr + 48 + body <= na);
  assert_int_equal(memcmp(a + hdr + 48, b + hdr + 48, body), 0);
  free(a);
  free(b);
}

static void test_q4_persist(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, HT, D, 0, 1);
  kvi_store *s = q4_store(m, 4, 64);
  char path[] = "/tmp/kvi-q4-XXXXXX", path2[] = "/tmp/kvi-q4b-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  fd = mkstemp(path2);
  assert_true(fd >= 0);
  close(fd);
  rfact f[3], got;
  for (int i = 0; i < 3; i++) {
    rfact_make(&f[i], &r, 1, (uint64_t)i, L, 3 + 4 * i, HT, D, -6, 2);
    fill_outliers(&f[i], &r);
    rfact_put(s, &f[i], 0);
  }
  assert_ok(kvi_store_save(s, path, NULL));
  kvi_store_options o = cpu_store_options(KVI_DTYPE_Q4, 4, store_stats(s).page_bytes * 64);
  kvi_store *l2 = NULL;
  assert_ok(kvi_store_load(&l2, m, &o, path, NULL));
  for (int i = 0; i < 3; i++) {
    rfact want;
    rfact_read(s, 1, (uint64_t)i, L, HT, D, &want);
    rfact_read(l2, 1, (uint64_t)i, L, HT, D, &got);
    expect_same(&got, &want, "loaded q4 fact");
    rfact_free(&got);
    rfact_free(&want);
  }
  assert_int_equal(store_stats(l2).bytes_payload, store_stats(s).bytes_payload);
  /* saved again from the loaded store: the same packed bytes and scales */
  assert_ok(kvi_store_save(l2, path2, NULL));
  expect_same_records(path, path2);
  kvi_store_destroy(l2);
  /* other dtypes and page sizes are refused */
  kvi_store_options ob = cpu_store_options(KVI_DTYPE_FP8_E4M3, 4, 1u << 22);
  l2 = NULL;
  assert_status(kvi_store_load(&l2, m, &ob, path, NULL), KVI_ERR_INCOMPATIBLE);
  kvi_store_options op = cpu_store_options(KVI_DTYPE_Q4, 8, 1u << 22);
  assert_status(kvi_store_load(&l2, m, &op, path, NULL), KVI_ERR_INCOMPATIBLE);
  assert_null(l2);
  /* the journal: puts after the snapshot come back bit for bit */
  assert_ok(kvi_store_journal_open(s, path, 0));
  rfact j, want;
  rfact_make(&j, &r, 2, 9, L, 5, HT, D, -6, 2);
  rfact_put(s, &j, 0);
  rfact_read(s, 2, 9, L, HT, D, &want);
  assert_ok(kvi_store_remove(s, 1, 0));
  kvi_store_destroy(s);
  assert_ok(kvi_store_load(&l2, m, &o, path, NULL));
  rfact_read(l2, 2, 9, L, HT, D, &got);
  expect_same(&got, &want, "journaled q4 fact");
  int32_t T;
  assert_status(kvi_store_fact_tokens(l2, 1, 0, &T), KVI_ERR_NOT_FOUND);
  rfact_free(&got);
  rfact_free(&want);
  rfact_free(&j);
  kvi_store_destroy(l2);
  for (int i = 0; i < 3; i++) rfact_free(&f[i]);
  unlink(path);
  unlink(path2);
  kvi_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_q4_put_read), cmocka_unit_test(test_q4_geometry),  cmocka_unit_test(test_q4_special_values),
      cmocka_unit_test(test_q4_bad_input), cmocka_unit_test(test_q4_inject),   cmocka_unit_test(test_q4_capture),
      cmocka_unit_test(test_q4_tenants),  cmocka_unit_test(test_q4_persist),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
