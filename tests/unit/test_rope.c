/*
 * unit-rope: the model's RoPE slot against an independent float64 reference
 * (ref64.h, Hugging Face modeling_rope_utils formulas): cos/sin of every
 * scaling variant on several layers with per-layer overrides, the llama3
 * frequencies of Llama-3.1-8B, engine cos/sin tables in every float dtype,
 * validation (a rejected spec changes no layer), and the resolved spec that
 * kvi_model_get_rope returns.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "ref64.h"
#include "rope_catalogue.h"

#define L 6
#define H 2
#define D 64

/* ------------------------------------------------------------------------ */
/* scaling variants                                                          */
/* ------------------------------------------------------------------------ */

/* Every scaling variant on NeoX at full rotary; test_cos_sin_every_scaling
 * sets the GPT-J, partial rotary and NoPE layers around each one itself. */
static const rope_id variants[] = {
    ROPE_NEOX,   ROPE_NEOX_ATTENTION_1_5, ROPE_LINEAR_4, ROPE_LLAMA3_1,  ROPE_LLAMA3_2,
    ROPE_YARN_4, ROPE_YARN_32_GPT_OSS,    ROPE_YARN_16,  ROPE_YARN_HALF, ROPE_NTK_3,
};

/* Positions 0..40, random ones up to 8191, and a few fixed ones. */
static int positions(rng *r, int32_t *p) {
  int n = 0;
  for (int32_t i = 0; i <= 40; i++) p[n++] = i;
  for (int i = 0; i < 120; i++) p[n++] = (int32_t)rng_range(r, 41, 8191);
  p[n++] = 4095, p[n++] = 4096, p[n++] = 8000, p[n++] = 8191;
  return n;
}

/* Every pair of `layer` at every position against the reference of `set`. */
static void check_cos_sin(const kvi_model *m, int32_t layer, const kvi_rope_spec *set, const int32_t *pos, int npos,
                          const char *what) {
  ref_rope rr;
  ref_rope_init(&rr, set, D);
  for (int k = 0; k < npos; k++)
    for (int32_t i = 0; i < rr.rot / 2; i++) {
      float c = NAN, s = NAN;
      assert_ok(kvi_model_rope_cos_sin(m, layer, pos[k], i, &c, &s));
      double wc, ws;
      ref_cs(&rr, pos[k], i, &wc, &ws);
      const double tol = ref_cs_tol(&rr, pos[k], i);
      if (!(fabs((double)c - wc) <= tol && fabs((double)s - ws) <= tol))
        fail_msg("%s, layer %d, pos %d, pair %d (inv_freq %.17g, attention factor %.17g): cos %.9g sin %.9g, "
                 "expected %.12g %.12g (tolerance %.3g)",
                 what, layer, pos[k], i, rr.inv[i], rr.attn, (double)c, (double)s, wc, ws, tol);
    }
  /* the pair past rotary_dim / 2 is out of range */
  float c = 3.0f, s = 3.0f;
  assert_status(kvi_model_rope_cos_sin(m, layer, 0, rr.rot / 2, &c, &s), KVI_ERR_INVALID_ARGUMENT);
  assert_true(c == 3.0f && s == 3.0f);
  ref_rope_free(&rr);
}

/* get_rope gives back the resolved spec of what was set. */
static void check_resolved(const kvi_model *m, int32_t layer, const kvi_rope_spec *set, const char *what) {
  const kvi_rope_spec g = rope_get(m, layer);
  assert_int_equal(g.struct_size, sizeof g);
  if (set->style == KVI_ROPE_NONE) {
    if (g.style != KVI_ROPE_NONE) fail_msg("%s, layer %d: style %d, expected NONE", what, layer, (int)g.style);
    return;
  }
  ref_rope rr;
  ref_rope_init(&rr, set, D);
  if (g.style != set->style || g.rotary_dim != rr.rot || g.theta != set->theta || g.scaling != set->scaling ||
      g.factor != set->factor || g.original_max_position != set->original_max_position ||
      g.low_freq_factor != set->low_freq_factor || g.high_freq_factor != set->high_freq_factor ||
      g.beta_fast != set->beta_fast || g.beta_slow != set->beta_slow || g.yarn_truncate != set->yarn_truncate ||
      g.cos_sin_table != NULL || fabs(g.attention_factor - rr.attn) > 1e-15 * rr.attn)
    fail_msg("%s, layer %d: get_rope gave style %d rotary_dim %d theta %g scaling %d factor %g attention_factor "
             "%.17g table %p; expected style %d rotary_dim %d theta %g scaling %d factor %g attention_factor %.17g",
             what, layer, (int)g.style, g.rotary_dim, g.theta, (int)g.scaling, g.factor, g.attention_factor,
             g.cos_sin_table, (int)set->style, rr.rot, set->theta, (int)set->scaling, set->factor, rr.attn);
  ref_rope_free(&rr);
}

/* Every variant on every layer (set with layer -1), then per-layer
 * overrides: a NoPE layer, a GPT-J layer with its own theta, a partial
 * rotary layer, a plain layer. */
static void test_cos_sin_every_scaling(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  rope_case v[16];
  const int nv = rope_cases(v, variants, (int)(sizeof variants / sizeof variants[0]), D);
  int32_t pos[200];
  const int np = positions(&r, pos);
  kvi_model *m = make_model(L, H, D, 0, 1);
  for (int k = 0; k < nv; k++) {
    kvi_rope_spec set[L];
    for (int l = 0; l < L; l++) set[l] = v[k].s;
    assert_ok(kvi_model_set_rope(m, -1, &v[k].s));
    /* layer 1: NoPE, with garbage in the ignored fields */
    set[1] = rope(KVI_ROPE_NONE, 7, NAN);
    set[1].factor = -1.0;
    assert_ok(kvi_model_set_rope(m, 1, &set[1]));
    /* layer 2: GPT-J, its own theta */
    set[2] = v[k].s;
    set[2].style = KVI_ROPE_GPTJ;
    set[2].theta = v[k].s.theta == 10000.0 ? 5e5 : 10000.0;
    assert_ok(kvi_model_set_rope(m, 2, &set[2]));
    /* layer 3: partial rotary (24 of 64) */
    set[3] = v[k].s;
    set[3].rotary_dim = 24;
    assert_ok(kvi_model_set_rope(m, 3, &set[3]));
    /* layer 4: plain GPT-J, theta 1e6, rotary 32 */
    set[4] = rope(KVI_ROPE_GPTJ, 32, 1e6);
    assert_ok(kvi_model_set_rope(m, 4, &set[4]));
    /* layers 0 and 5 keep the variant */
    for (int32_t l = 0; l < L; l++) {
      char what[200];
      snprintf(what, sizeof what, "%s (layer setting %d)", v[k].name, l);
      check_resolved(m, l, &set[l], what);
      if (set[l].style == KVI_ROPE_NONE) {
        float c = 5.0f, s = 5.0f;
        assert_status(kvi_model_rope_cos_sin(m, l, 0, 0, &c, &s), KVI_ERR_INVALID_ARGUMENT);
        assert_true(c == 5.0f && s == 5.0f);
        continue;
      }
      check_cos_sin(m, l, &set[l], pos, np, what);
    }
  }
  rope_cases_free(v, nv);
  kvi_model_destroy(m);
}

/* The reference itself, against numbers worked out by hand. */
static void test_reference_values(void **state) {
  (void)state;
  ref_rope rr;
  kvi_rope_spec s = rope(KVI_ROPE_NEOX, 8, 10000.0);
  ref_rope_init(&rr, &s, 8);
  assert_true(fabs(rr.inv[0] - 1.0) < 1e-15 && fabs(rr.inv[1] - 0.1) < 1e-15 && fabs(rr.inv[2] - 0.01) < 1e-16 &&
              fabs(rr.inv[3] - 0.001) < 1e-17);
  s.scaling = KVI_ROPE_SCALING_NTK, s.factor = 4.0; /* theta' = 1e4 * 4^(8/6) */
  ref_rope_init(&rr, &s, 8);
  assert_true(fabs(rr.inv[1] - 1.0 / pow(1e4 * pow(4.0, 8.0 / 6.0), 0.25)) < 1e-15);
  s.scaling = KVI_ROPE_SCALING_YARN, s.factor = 4.0, s.original_max_position = 4096;
  ref_rope_init(&rr, &s, 8);
  assert_true(fabs(rr.attn - (0.1 * log(4.0) + 1.0)) < 1e-15);
  /* rot 8, theta 1e4, L 4096: low = floor(1.31) = 1, high = ceil(2.81) = 3 */
  assert_true(fabs(rr.inv[0] - 1.0) < 1e-15);             /* ramp 0: extrapolation */
  assert_true(fabs(rr.inv[2] - 0.01 * (0.5 / 4 + 0.5)) < 1e-16); /* ramp 0.5 */
  assert_true(fabs(rr.inv[3] - 0.001 / 4) < 1e-17);       /* ramp 1: interpolation */
  /* fp8 */
  assert_int_equal(ref_fp8_encode(448.0f, KVI_DTYPE_FP8_E4M3), 0x7e);
  assert_int_equal(ref_fp8_encode(1e9f, KVI_DTYPE_FP8_E4M3), 0x7e);
  assert_int_equal(ref_fp8_encode(-1e9f, KVI_DTYPE_FP8_E4M3), 0xfe);
  assert_int_equal(ref_fp8_encode(1.0f, KVI_DTYPE_FP8_E4M3), 0x38);
  assert_int_equal(ref_fp8_encode(1.0625f, KVI_DTYPE_FP8_E4M3), 0x38); /* tie -> even */
  assert_int_equal(ref_fp8_encode(1.1875f, KVI_DTYPE_FP8_E4M3), 0x3a); /* tie -> even */
  assert_int_equal(ref_fp8_encode(0x1p-9f, KVI_DTYPE_FP8_E4M3), 0x01);
  assert_int_equal(ref_fp8_encode(0x1p-10f, KVI_DTYPE_FP8_E4M3), 0x00);
  assert_int_equal(ref_fp8_encode(1e9f, KVI_DTYPE_FP8_E5M2), 0x7b);
  assert_int_equal(ref_fp8_encode(57344.0f, KVI_DTYPE_FP8_E5M2), 0x7b);
  assert_int_equal(ref_fp8_encode(1.0f, KVI_DTYPE_FP8_E5M2), 0x3c);
  assert_int_equal(ref_fp8_encode(0x1p-16f, KVI_DTYPE_FP8_E5M2), 0x01);
  assert_true(isnan(ref_fp8_decode(0x7f, KVI_DTYPE_FP8_E4M3)));
  assert_true(isinf(ref_fp8_decode(0x7c, KVI_DTYPE_FP8_E5M2)));
}

/* Llama-3.1-8B (head 128): 29 pairs unchanged, 29 divided by 8, 6
 * interpolated (engines.md 3.2). The library's inv_freq is recovered from
 * its angle at position 1 (= fp32(inv_freq) exactly). */
static void test_llama3_frequencies(void **state) {
  (void)state;
  kvi_model *m = make_model(1, 8, 128, 0, 1);
  const kvi_rope_spec s = rope_case_of(ROPE_LLAMA3_1, 128).s;
  assert_ok(kvi_model_set_rope(m, 0, &s));
  ref_rope rr;
  ref_rope_init(&rr, &s, 128);
  assert_int_equal(rr.rot, 128);
  int unchanged = 0, divided = 0, interpolated = 0, ref_unchanged = 0, ref_divided = 0, ref_interp = 0;
  for (int32_t i = 0; i < 64; i++) {
    const double base = pow(5e5, -(2.0 * i) / 128.0);
    /* the reference against HF's three-way form */
    const double wavelen = REF_TWO_PI / base;
    double hf;
    if (wavelen < 8192.0 / 4.0) hf = base, ref_unchanged++;
    else if (wavelen > 8192.0 / 1.0) hf = base / 8.0, ref_divided++;
    else {
      const double smooth = (8192.0 / wavelen - 1.0) / (4.0 - 1.0);
      hf = (1.0 - smooth) * base / 8.0 + smooth * base;
      ref_interp++;
    }
    if (fabs(rr.inv[i] - hf) > 1e-14 * hf) fail_msg("reference pair %d: %.17g, HF form %.17g", i, rr.inv[i], hf);
    /* the library's */
    float c, sn;
    assert_ok(kvi_model_rope_cos_sin(m, 0, 1, i, &c, &sn));
    const double got = atan2((double)sn, (double)c);
    if (fabs(got - hf) > 1e-6 * hf)
      fail_msg("pair %d: inv_freq recovered as %.9g, expected %.9g (base %.9g)", i, got, hf, base);
    const double ratio = got / base;
    if (fabs(ratio - 1.0) < 1e-6) {
      unchanged++;
      if (divided || interpolated) fail_msg("pair %d unchanged after lower frequencies were scaled", i);
    } else if (fabs(ratio * 8.0 - 1.0) < 1e-6) {
      divided++;
    } else {
      if (!(ratio > 0.125 && ratio < 1.0)) fail_msg("pair %d: ratio %.9g is not between 1/8 and 1", i, ratio);
      if (divided) fail_msg("pair %d interpolated after a divided one", i);
      interpolated++;
    }
  }
  assert_int_equal(ref_unchanged, 29);
  assert_int_equal(ref_divided, 29);
  assert_int_equal(ref_interp, 6);
  assert_int_equal(unchanged, 29);
  assert_int_equal(divided, 29);
  assert_int_equal(interpolated, 6);
  ref_rope_free(&rr);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* engine tables                                                             */
/* ------------------------------------------------------------------------ */

static void test_tables_used_exactly(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  enum { TP = 37 };
  kvi_model *m = make_model(L, H, D, 0, 1);
  const kvi_rope_spec base = rope(KVI_ROPE_NEOX, 0, 10000.0);
  assert_ok(kvi_model_set_rope(m, -1, &base));
  const int32_t rots[] = {D, 24};
  for (size_t di = 0; di < 3; di++)
    for (int sty = 0; sty < 2; sty++)
      for (size_t ri = 0; ri < 2; ri++) {
        const kvi_dtype dt = float_dtypes[di];
        const int32_t rot = rots[ri];
        const size_t n = (size_t)TP * (size_t)rot, es = kvi_dtype_size(dt);
        unsigned char *tab = malloc(n * es), *orig = malloc(n * es);
        assert_non_null(tab);
        assert_non_null(orig);
        for (size_t i = 0; i < n; i++) ref_store_bits(tab, dt, (int64_t)i, ref_bits(rand_val(&r, -8, 0), dt));
        memcpy(orig, tab, n * es);
        kvi_rope_spec s = rope(sty ? KVI_ROPE_GPTJ : KVI_ROPE_NEOX, rot == D ? 0 : rot, 10000.0);
        s.cos_sin_table = tab;
        s.table_dtype = dt;
        s.table_positions = TP;
        s.attention_factor = 2.0;          /* the table already includes it: not applied */
        s.scaling = KVI_ROPE_SCALING_YARN; /* the table replaces the formula */
        s.factor = 4.0;
        const int32_t layer = (int32_t)(di + ri) % L;
        assert_ok(kvi_model_set_rope(m, layer, &s));
        memset(tab, 0xFF, n * es); /* copied: the caller's buffer is free again */
        for (int32_t p = 0; p < TP; p++)
          for (int32_t i = 0; i < rot / 2; i++) {
            float c, sn;
            assert_ok(kvi_model_rope_cos_sin(m, layer, p, i, &c, &sn));
            const float wc = ref_load(orig, dt, (int64_t)p * rot + i);
            const float ws = ref_load(orig, dt, (int64_t)p * rot + rot / 2 + i);
            if (f2u(c) != f2u(wc) || f2u(sn) != f2u(ws))
              fail_msg("%s table, rot %d, pos %d pair %d: cos %a sin %a, expected the table's %a %a", dtype_name(dt),
                       rot, p, i, (double)c, (double)sn, (double)wc, (double)ws);
          }
        float c = 9.0f, sn = 9.0f;
        assert_status(kvi_model_rope_cos_sin(m, layer, TP, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
        assert_status(kvi_model_rope_cos_sin(m, layer, TP + 1000, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
        assert_status(kvi_model_rope_cos_sin(m, layer, -1, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
        assert_true(c == 9.0f && sn == 9.0f);
        assert_ok(kvi_model_rope_cos_sin(m, layer, TP - 1, rot / 2 - 1, &c, &sn));
        /* get_rope: the model's fp32 copy */
        const kvi_rope_spec g = rope_get(m, layer);
        assert_int_equal(g.style, s.style);
        /* rotary_dim 0 with a table: test_table_rotary_dim_resolved */
        if (s.rotary_dim != 0) assert_int_equal(g.rotary_dim, rot);
        assert_int_equal(g.table_dtype, KVI_DTYPE_FP32);
        assert_int_equal(g.table_positions, TP);
        assert_true(g.attention_factor == 1.0);
        assert_non_null(g.cos_sin_table);
        assert_true(g.cos_sin_table != (const void *)tab);
        const float *ft = g.cos_sin_table;
        for (size_t i = 0; i < n; i++)
          if (f2u(ft[i]) != f2u(ref_load(orig, dt, (int64_t)i)))
            fail_msg("%s table: get_rope's copy[%zu] is %a, expected %a", dtype_name(dt), i, (double)ft[i],
                     (double)ref_load(orig, dt, (int64_t)i));
        /* the neighbours keep the formula */
        const int32_t other = (layer + 1) % L;
        const kvi_rope_spec o = rope_get(m, other);
        assert_null(o.cos_sin_table);
        int32_t p0[] = {0, 1, 17, 5000};
        check_cos_sin(m, other, &base, p0, 4, "neighbour of a table layer");
        assert_ok(kvi_model_set_rope(m, layer, &base)); /* back to the formula */
        assert_null(rope_get(m, layer).cos_sin_table);
        free(tab);
        free(orig);
      }
  /* one table shared by every layer, then one layer overridden */
  float t32[4 * 8];
  for (int i = 0; i < 32; i++) t32[i] = rand_val(&r, -4, 0);
  kvi_rope_spec s = rope(KVI_ROPE_GPTJ, 8, 10000.0);
  s.cos_sin_table = t32;
  s.table_positions = 4;
  assert_ok(kvi_model_set_rope(m, -1, &s));
  const kvi_rope_spec none = rope(KVI_ROPE_NONE, 0, 0.0);
  assert_ok(kvi_model_set_rope(m, 2, &none));
  for (int32_t l = 0; l < L; l++) {
    float c, sn;
    if (l == 2) {
      assert_status(kvi_model_rope_cos_sin(m, l, 1, 1, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
      continue;
    }
    assert_ok(kvi_model_rope_cos_sin(m, l, 3, 2, &c, &sn));
    assert_true(f2u(c) == f2u(t32[3 * 8 + 2]) && f2u(sn) == f2u(t32[3 * 8 + 4 + 2]));
  }
  kvi_model_destroy(m);
}

/* A table layer set with rotary_dim 0 (= head_size) reads back resolved:
 * "rotary_dim is never 0 for a rotated layer". */
static void test_table_rotary_dim_resolved(void **state) {
  (void)state;
  kvi_model *m = make_model(2, 1, 8, 0, 1);
  float tab[3 * 8];
  for (int i = 0; i < 24; i++) tab[i] = 0.5f + (float)i / 64.0f;
  kvi_rope_spec s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  s.cos_sin_table = tab;
  s.table_positions = 3;
  assert_ok(kvi_model_set_rope(m, 1, &s));
  const kvi_rope_spec g = rope_get(m, 1);
  if (g.rotary_dim != 8)
    fail_msg("table layer set with rotary_dim 0 on head_size 8: get_rope gives rotary_dim %d, expected 8",
             g.rotary_dim);
  /* the table is read as 8-wide rows all the same */
  float c, sn;
  assert_ok(kvi_model_rope_cos_sin(m, 1, 2, 3, &c, &sn));
  assert_true(c == tab[2 * 8 + 3] && sn == tab[2 * 8 + 4 + 3]);
  kvi_model_destroy(m);
}

/* ------------------------------------------------------------------------ */
/* validation                                                                */
/* ------------------------------------------------------------------------ */

static void snapshot(const kvi_model *m, kvi_rope_spec out[L]) {
  for (int32_t l = 0; l < L; l++) out[l] = rope_get(m, l);
}

static void test_validation_changes_nothing(void **state) {
  (void)state;
  kvi_model *m = make_model(L, H, D, 0, 1);
  /* a mixed model: llama3 everywhere, a NoPE layer, a table layer, a YaRN layer */
  kvi_rope_spec s = rope(KVI_ROPE_NEOX, 0, 5e5);
  s.scaling = KVI_ROPE_SCALING_LLAMA3;
  s.factor = 8.0;
  assert_ok(kvi_model_set_rope(m, -1, &s));
  const kvi_rope_spec none = rope(KVI_ROPE_NONE, 0, 0.0);
  assert_ok(kvi_model_set_rope(m, 1, &none));
  float table[3 * D];
  for (int i = 0; i < 3 * D; i++) table[i] = 0.25f + (float)i / 1024.0f;
  s = rope(KVI_ROPE_GPTJ, 0, 10000.0);
  s.cos_sin_table = table;
  s.table_positions = 3;
  assert_ok(kvi_model_set_rope(m, 2, &s));
  s = rope(KVI_ROPE_GPTJ, 32, 10000.0);
  s.scaling = KVI_ROPE_SCALING_YARN;
  s.factor = 8.0;
  assert_ok(kvi_model_set_rope(m, 4, &s));
  kvi_rope_spec before[L], after[L];
  snapshot(m, before);

  typedef struct bad {
    const char *what;
    kvi_rope_spec s;
  } bad;
  bad b[64];
  int n = 0;
#define BAD(name, ...)                                                                                             \
  do {                                                                                                             \
    b[n].what = name;                                                                                              \
    b[n].s = rope(KVI_ROPE_NEOX, 0, 10000.0);                                                                      \
    kvi_rope_spec *x = &b[n].s;                                                                                    \
    __VA_ARGS__;                                                                                                   \
    n++;                                                                                                           \
  } while (0)
  BAD("style 3", x->style = (kvi_rope_style)3);
  BAD("style -1", x->style = (kvi_rope_style)-1);
  BAD("scaling 5", x->scaling = (kvi_rope_scaling)5);
  BAD("scaling -1", x->scaling = (kvi_rope_scaling)-1);
  BAD("rotary_dim odd", x->rotary_dim = 7);
  BAD("rotary_dim odd GPT-J", x->style = KVI_ROPE_GPTJ, x->rotary_dim = 63);
  BAD("rotary_dim > head_size", x->rotary_dim = D + 2);
  BAD("rotary_dim negative", x->rotary_dim = -2);
  BAD("theta 0", x->theta = 0.0);
  BAD("theta -1", x->theta = -1.0);
  BAD("theta NaN", x->theta = NAN);
  BAD("theta inf", x->theta = INFINITY);
  BAD("linear factor 0", x->scaling = KVI_ROPE_SCALING_LINEAR, x->factor = 0.0);
  BAD("linear factor -2", x->scaling = KVI_ROPE_SCALING_LINEAR, x->factor = -2.0);
  BAD("linear factor NaN", x->scaling = KVI_ROPE_SCALING_LINEAR, x->factor = NAN);
  BAD("llama3 factor 0", x->scaling = KVI_ROPE_SCALING_LLAMA3, x->factor = 0.0);
  BAD("yarn factor -1", x->scaling = KVI_ROPE_SCALING_YARN, x->factor = -1.0);
  BAD("yarn factor inf", x->scaling = KVI_ROPE_SCALING_YARN, x->factor = INFINITY);
  BAD("ntk factor 0", x->scaling = KVI_ROPE_SCALING_NTK, x->factor = 0.0);
  BAD("llama3 high == low", x->scaling = KVI_ROPE_SCALING_LLAMA3, x->factor = 8.0, x->low_freq_factor = 4.0,
      x->high_freq_factor = 4.0);
  BAD("llama3 high < low", x->scaling = KVI_ROPE_SCALING_LLAMA3, x->factor = 8.0, x->low_freq_factor = 4.0,
      x->high_freq_factor = 1.0);
  BAD("llama3 original_max_position 0", x->scaling = KVI_ROPE_SCALING_LLAMA3, x->factor = 8.0,
      x->original_max_position = 0);
  BAD("yarn original_max_position 0", x->scaling = KVI_ROPE_SCALING_YARN, x->factor = 4.0,
      x->original_max_position = 0);
  BAD("yarn original_max_position -7", x->scaling = KVI_ROPE_SCALING_YARN, x->factor = 4.0,
      x->original_max_position = -7);
  BAD("yarn beta_fast 0", x->scaling = KVI_ROPE_SCALING_YARN, x->factor = 4.0, x->beta_fast = 0.0);
  BAD("yarn beta_slow 0", x->scaling = KVI_ROPE_SCALING_YARN, x->factor = 4.0, x->beta_slow = 0.0);
  BAD("ntk rotary_dim 2", x->scaling = KVI_ROPE_SCALING_NTK, x->factor = 2.0, x->rotary_dim = 2);
  BAD("attention_factor -1", x->attention_factor = -1.0);
  BAD("attention_factor NaN", x->attention_factor = NAN);
  BAD("table_positions 0", x->cos_sin_table = table, x->table_positions = 0);
  BAD("table_positions -3", x->cos_sin_table = table, x->table_positions = -3);
  BAD("table dtype fp8 e4m3", x->cos_sin_table = table, x->table_positions = 1, x->table_dtype = KVI_DTYPE_FP8_E4M3);
  BAD("table dtype fp8 e5m2", x->cos_sin_table = table, x->table_positions = 1, x->table_dtype = KVI_DTYPE_FP8_E5M2);
  BAD("table dtype 0", x->cos_sin_table = table, x->table_positions = 1, x->table_dtype = (kvi_dtype)0);
  BAD("table rotary_dim odd", x->cos_sin_table = table, x->table_positions = 1, x->rotary_dim = 5);
#undef BAD
  for (int c = 0; c < n; c++)
    for (int32_t layer = -1; layer < L; layer += 3) {
      const kvi_status st = kvi_model_set_rope(m, layer, &b[c].s);
      if (st != KVI_ERR_INVALID_ARGUMENT)
        fail_msg("%s on layer %d: got %d (%s), expected KVI_ERR_INVALID_ARGUMENT", b[c].what, layer, (int)st,
                 kvi_last_error());
      assert_last_error_has("kvi_model_set_rope", "");
      snapshot(m, after);
      assert_ropes_equal(before, after, L, b[c].what);
    }
  /* struct sizes */
  kvi_rope_spec ok = rope(KVI_ROPE_NEOX, 0, 123.0);
  const size_t small[] = {0, sizeof(size_t), offsetof(kvi_rope_spec, theta), sizeof ok - 1};
  for (size_t i = 0; i < 4; i++) {
    kvi_rope_spec x = ok;
    x.struct_size = small[i];
    assert_status(kvi_model_set_rope(m, -1, &x), KVI_ERR_STRUCT_SIZE);
    assert_status(kvi_model_set_rope(m, 3, &x), KVI_ERR_STRUCT_SIZE);
    snapshot(m, after);
    assert_ropes_equal(before, after, L, "struct_size too small");
  }
  struct {
    kvi_rope_spec s;
    unsigned char later[24];
  } big;
  memset(&big, 0, sizeof big);
  big.s = ok;
  big.s.struct_size = sizeof big;
  big.later[23] = 1;
  assert_status(kvi_model_set_rope(m, 0, &big.s), KVI_ERR_STRUCT_SIZE);
  snapshot(m, after);
  assert_ropes_equal(before, after, L, "struct_size larger with a set byte");
  /* layer index and NULLs */
  assert_status(kvi_model_set_rope(m, L, &ok), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_set_rope(m, -2, &ok), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_set_rope(m, 0, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_set_rope(NULL, 0, &ok), KVI_ERR_INVALID_ARGUMENT);
  snapshot(m, after);
  assert_ropes_equal(before, after, L, "bad layer or NULL");
  /* a zero tail is fine */
  big.later[23] = 0;
  assert_ok(kvi_model_set_rope(m, 0, &big.s));
  assert_true(rope_get(m, 0).theta == 123.0);
  kvi_model_destroy(m);
}

/* get_rope returns resolved values. */
static void test_get_rope_resolved(void **state) {
  (void)state;
  kvi_model *m = make_model(L, H, D, 0, 1);
  kvi_rope_spec s = rope(KVI_ROPE_GPTJ, 0, 777.0);
  assert_ok(kvi_model_set_rope(m, 0, &s));
  kvi_rope_spec g = rope_get(m, 0);
  assert_int_equal(g.rotary_dim, D);
  assert_true(g.attention_factor == 1.0);
  assert_true(g.theta == 777.0);

  s = rope(KVI_ROPE_NEOX, 16, 10000.0);
  s.scaling = KVI_ROPE_SCALING_YARN;
  s.factor = 40.0;
  s.original_max_position = 4096;
  assert_ok(kvi_model_set_rope(m, 1, &s));
  g = rope_get(m, 1);
  assert_int_equal(g.rotary_dim, 16);
  if (fabs(g.attention_factor - (0.1 * log(40.0) + 1.0)) > 1e-15)
    fail_msg("YaRN factor 40: attention_factor %.17g, expected %.17g", g.attention_factor, 0.1 * log(40.0) + 1.0);
  assert_int_equal(g.scaling, KVI_ROPE_SCALING_YARN);
  assert_true(g.factor == 40.0);
  assert_int_equal(g.original_max_position, 4096);

  s.attention_factor = 0.75; /* explicit: kept */
  assert_ok(kvi_model_set_rope(m, 2, &s));
  assert_true(rope_get(m, 2).attention_factor == 0.75);

  s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  s.scaling = KVI_ROPE_SCALING_LINEAR;
  s.factor = 2.0;
  assert_ok(kvi_model_set_rope(m, 3, &s));
  g = rope_get(m, 3);
  assert_true(g.attention_factor == 1.0);
  assert_int_equal(g.rotary_dim, D);

  /* resolved against this model's head size, after a NoPE layer */
  kvi_model *m2 = make_model(2, 1, 10, 0, 1);
  s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  assert_ok(kvi_model_set_rope(m2, 1, &s));
  assert_int_equal(rope_get(m2, 1).rotary_dim, 10);
  assert_int_equal(rope_get(m2, 0).style, KVI_ROPE_UNSET); /* never set */
  /* an output struct that is too small is rejected and left alone */
  kvi_rope_spec small;
  memset(&small, 0x5A, sizeof small);
  small.struct_size = offsetof(kvi_rope_spec, rotary_dim);
  kvi_rope_spec copy = small;
  assert_status(kvi_model_get_rope(m2, 1, &small), KVI_ERR_STRUCT_SIZE);
  assert_memory_equal(&small, &copy, sizeof small);
  kvi_model_destroy(m2);
  kvi_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reference_values),
      cmocka_unit_test(test_cos_sin_every_scaling),
      cmocka_unit_test(test_llama3_frequencies),
      cmocka_unit_test(test_tables_used_exactly),
      cmocka_unit_test(test_table_rotary_dim_resolved),
      cmocka_unit_test(test_validation_changes_nothing),
      cmocka_unit_test(test_get_rope_resolved),
  };
  return cmocka_run_group_tests_name("unit-rope", tests, NULL, NULL);
}
