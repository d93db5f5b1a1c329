/*
 * unit-model: kvi_model geometry, tensor-parallel head slices, size-versioned
 * structs, and the per-layer RoPE slot.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "rope_catalogue.h"

#define L0 4
#define H0 8
#define D0 64

/* Per-test fixture: a valid model (4 layers, 8 KV heads, head size 64). */
static int setup_model(void **state) {
  *state = make_model(L0, H0, D0, 0, 1);
  return 0;
}

static int teardown_model(void **state) {
  kvi_model_destroy(*state);
  return 0;
}

static kvi_model_info info_of(const kvi_model *m) {
  kvi_model_info i = KVI_MODEL_INFO_INIT;
  assert_ok(kvi_model_info_get(m, &i));
  assert_int_equal(i.struct_size, sizeof i);
  return i;
}

/* A create that must fail with `want` and leave *out untouched. */
static void expect_create_fails(const kvi_model_options *o, kvi_status want) {
  static int sentinel_obj;
  kvi_model *const sentinel = (kvi_model *)&sentinel_obj;
  kvi_model *m = sentinel;
  assert_status(kvi_model_create(&m, o), want);
  assert_ptr_equal(m, sentinel);
  assert_true(strlen(kvi_last_error()) > 0);
}

static void test_model_valid_geometry(void **state) {
  const kvi_model_info i = info_of(*state);
  assert_int_equal(i.num_layers, L0);
  assert_int_equal(i.num_kv_heads, H0);
  assert_int_equal(i.head_size, D0);
  assert_int_equal(i.tp_rank, 0);
  assert_int_equal(i.tp_size, 1);
  assert_int_equal(i.local_head_first, 0);
  assert_int_equal(i.local_heads, H0);
  assert_int_equal(i.head_replicas, 1);

  /* the boundaries of every range are accepted */
  const int32_t ok[][5] = {{1, 1, 1, 0, 1}, {1, 1, 1024, 0, 1}, {96, 1, 2, 0, 1}, {2, 7, 3, 6, 7}};
  for (size_t c = 0; c < sizeof ok / sizeof ok[0]; c++) {
    kvi_model_options o = model_options(ok[c][0], ok[c][1], ok[c][2], ok[c][3], ok[c][4]);
    kvi_model *m = NULL;
    assert_ok(kvi_model_create(&m, &o));
    const kvi_model_info j = info_of(m);
    assert_int_equal(j.num_layers, ok[c][0]);
    assert_int_equal(j.num_kv_heads, ok[c][1]);
    assert_int_equal(j.head_size, ok[c][2]);
    assert_int_equal(j.tp_rank, ok[c][3]);
    assert_int_equal(j.tp_size, ok[c][4]);
    kvi_model_destroy(m);
  }
}

static void test_model_destroy_null(void **state) {
  (void)state;
  kvi_model_destroy(NULL);
}

static void test_model_invalid_fields(void **state) {
  (void)state;
  struct {
    int32_t L, H, D, rank, tp;
    const char *value; /* what the message must mention */
  } bad[] = {
      {0, 8, 64, 0, 1, "0"},     {-3, 8, 64, 0, 1, "-3"},   {4, 0, 64, 0, 1, "0"},
      {4, -1, 64, 0, 1, "-1"},   {4, 8, 0, 0, 1, "0"},      {4, 8, 1025, 0, 1, "1025"},
      {4, 8, -64, 0, 1, "-64"},  {4, 8, 64, 0, 0, "0"},     {4, 8, 64, 0, -2, "-2"},
      {4, 8, 64, 4, 4, "4"},     {4, 8, 64, -1, 4, "-1"},   {4, 8, 64, 9, 8, "9"},
      {4, 8, 64, 0, 3, "3"},     {4, 2, 64, 0, 3, "3"},     {4, 6, 64, 1, 4, "4"},
      {4, 3, 64, 0, 2, "2"},
  };
  for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
    kvi_model_options o = model_options(bad[c].L, bad[c].H, bad[c].D, bad[c].rank, bad[c].tp);
    expect_create_fails(&o, KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_model_create", bad[c].value);
  }
}

static void test_model_null_arguments(void **state) {
  (void)state;
  kvi_model_options o = model_options(2, 2, 8, 0, 1);
  assert_status(kvi_model_create(NULL, &o), KVI_ERR_INVALID_ARGUMENT);
  expect_create_fails(NULL, KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_model_create", "opts");
}

/* The options as a prefix of a larger, zeroed struct: a caller built against a
 * later version of the header that left the new fields at their defaults. */
typedef struct {
  kvi_model_options o;
  unsigned char later[24];
} model_options_v2;

static void test_model_options_struct_size(void **state) {
  (void)state;
  kvi_model_options o = model_options(2, 4, 8, 0, 1);
  o.struct_size = sizeof o - 4;
  expect_create_fails(&o, KVI_ERR_STRUCT_SIZE);
  o.struct_size = 0;
  expect_create_fails(&o, KVI_ERR_STRUCT_SIZE);
  o.struct_size = 1;
  expect_create_fails(&o, KVI_ERR_STRUCT_SIZE);

  model_options_v2 big;
  memset(&big, 0, sizeof big);
  big.o = model_options(2, 4, 8, 1, 2);
  big.o.struct_size = sizeof big;
  kvi_model *m = NULL;
  assert_ok(kvi_model_create(&m, &big.o));
  const kvi_model_info i = info_of(m);
  assert_int_equal(i.num_layers, 2);
  assert_int_equal(i.local_head_first, 2);
  assert_int_equal(i.local_heads, 2);
  kvi_model_destroy(m);

  const size_t pos[] = {0, 7, sizeof big.later - 1};
  for (size_t p = 0; p < 3; p++) {
    memset(big.later, 0, sizeof big.later);
    big.later[pos[p]] = 0x01;
    expect_create_fails(&big.o, KVI_ERR_STRUCT_SIZE);
  }
}

static void expect_tp(int32_t H, int32_t tp, int32_t rank, int32_t first, int32_t heads, int32_t replicas) {
  kvi_model_options o = model_options(3, H, 16, rank, tp);
  kvi_model *m = NULL;
  assert_ok(kvi_model_create(&m, &o));
  const kvi_model_info i = info_of(m);
  if (i.local_head_first != first || i.local_heads != heads || i.head_replicas != replicas)
    fail_msg("H=%d tp=%d rank=%d: got first %d heads %d replicas %d, expected %d %d %d", H, tp, rank,
             i.local_head_first, i.local_heads, i.head_replicas, first, heads, replicas);
  assert_int_equal(i.num_kv_heads, H);
  assert_int_equal(i.tp_size, tp);
  assert_int_equal(i.tp_rank, rank);
  kvi_model_destroy(m);
}

static void test_model_tp_head_ranges(void **state) {
  (void)state;
  expect_tp(8, 4, 3, 6, 2, 1);
  expect_tp(8, 4, 0, 0, 2, 1);
  expect_tp(2, 8, 5, 1, 1, 4);
  expect_tp(2, 8, 3, 0, 1, 4);
  expect_tp(8, 8, 7, 7, 1, 1);
  expect_tp(1, 4, 3, 0, 1, 4);
  expect_tp(4, 8, 7, 3, 1, 2);
  expect_tp(4, 8, 0, 0, 1, 2);
  expect_tp(6, 3, 2, 4, 2, 1);
  expect_tp(5, 1, 0, 0, 5, 1);
  /* every rank of a slicing covers the heads exactly once */
  for (int32_t tp = 1; tp <= 8; tp *= 2)
    for (int32_t r = 0; r < tp; r++) expect_tp(8, tp, r, r * (8 / tp), 8 / tp, 1);
}

/* An output struct: a larger struct_size is written only up to the fields
 * the library knows; a smaller one than the first version is refused and
 * nothing is written. */
typedef struct {
  kvi_model_info i;
  unsigned char after[32];
} model_info_v2;

static void test_model_info_struct_size(void **state) {
  model_info_v2 big;
  memset(&big, 0xCD, sizeof big);
  big.i.struct_size = sizeof big;
  assert_ok(kvi_model_info_get(*state, &big.i));
  assert_int_equal(big.i.struct_size, sizeof big); /* kept */
  assert_int_equal(big.i.num_layers, L0);
  assert_int_equal(big.i.head_replicas, 1);
  for (size_t k = 0; k < sizeof big.after; k++) assert_int_equal(big.after[k], 0xCD);

  kvi_model_info small, before;
  memset(&small, 0xCD, sizeof small);
  small.struct_size = offsetof(kvi_model_info, local_head_first);
  memcpy(&before, &small, sizeof small);
  assert_status(kvi_model_info_get(*state, &small), KVI_ERR_STRUCT_SIZE);
  assert_memory_equal(&small, &before, sizeof small);

  small.struct_size = 0;
  memcpy(&before, &small, sizeof small);
  assert_status(kvi_model_info_get(*state, &small), KVI_ERR_STRUCT_SIZE);
  assert_memory_equal(&small, &before, sizeof small);

  kvi_model_info i = KVI_MODEL_INFO_INIT;
  assert_status(kvi_model_info_get(NULL, &i), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_info_get(*state, NULL), KVI_ERR_INVALID_ARGUMENT);
}

/* ------------------------------------------------------------------------ */
/* RoPE                                                                     */
/* ------------------------------------------------------------------------ */

static kvi_rope_spec rope_of(const kvi_model *m, int32_t layer) {
  const kvi_rope_spec s = rope_get(m, layer);
  assert_int_equal(s.struct_size, sizeof s);
  return s;
}

static void assert_rope(const kvi_model *m, int32_t layer, kvi_rope_style style, int32_t rotary_dim, double theta) {
  const kvi_rope_spec s = rope_of(m, layer);
  if (s.style != style || s.rotary_dim != rotary_dim || (style != KVI_ROPE_NONE && style != KVI_ROPE_UNSET && s.theta != theta))
    fail_msg("layer %d: got style %d rotary_dim %d theta %g, expected %d %d %g", layer, (int)s.style,
             s.rotary_dim, s.theta, (int)style, rotary_dim, theta);
}

/* A new model's layers are unset (not NONE): injection and capture refuse
 * them until each is given a spec or KVI_ROPE_NONE (unit-hardening). */
static void test_rope_default_unset(void **state) {
  for (int32_t l = 0; l < L0; l++) {
    const kvi_rope_spec s = rope_of(*state, l);
    assert_int_equal(s.style, KVI_ROPE_UNSET);
    assert_int_equal(s.rotary_dim, 0);
  }
  kvi_rope_spec s = rope(KVI_ROPE_UNSET, 0, 10000.0); /* a state, not a spec */
  assert_status(kvi_model_set_rope(*state, 0, &s), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_model_set_rope", "KVI_ROPE_UNSET");
  assert_int_equal(rope_of(*state, 0).style, KVI_ROPE_UNSET);
}

static void test_rope_set_all_and_one(void **state) {
  kvi_model *m = *state;
  kvi_rope_spec s = KVI_ROPE_SPEC_INIT; /* NEOX, rotary_dim 0 = head_size, theta 10000 */
  assert_ok(kvi_model_set_rope(m, -1, &s));
  for (int32_t l = 0; l < L0; l++) assert_rope(m, l, KVI_ROPE_NEOX, D0, 10000.0);

  s = rope(KVI_ROPE_GPTJ, 32, 500000.0);
  assert_ok(kvi_model_set_rope(m, 2, &s));
  assert_rope(m, 0, KVI_ROPE_NEOX, D0, 10000.0);
  assert_rope(m, 1, KVI_ROPE_NEOX, D0, 10000.0);
  assert_rope(m, 2, KVI_ROPE_GPTJ, 32, 500000.0);
  assert_rope(m, 3, KVI_ROPE_NEOX, D0, 10000.0);

  s = rope(KVI_ROPE_NEOX, 2, 0.5);
  assert_ok(kvi_model_set_rope(m, L0 - 1, &s));
  assert_rope(m, L0 - 1, KVI_ROPE_NEOX, 2, 0.5);
  s = rope(KVI_ROPE_GPTJ, D0, 1e6);
  assert_ok(kvi_model_set_rope(m, 0, &s));
  assert_rope(m, 0, KVI_ROPE_GPTJ, D0, 1e6);

  /* NONE ignores the other fields, even invalid ones */
  s = rope(KVI_ROPE_NONE, 3, NAN);
  assert_ok(kvi_model_set_rope(m, 1, &s));
  assert_rope(m, 1, KVI_ROPE_NONE, 0, 0.0);
  assert_rope(m, 0, KVI_ROPE_GPTJ, D0, 1e6);
  assert_rope(m, 2, KVI_ROPE_GPTJ, 32, 500000.0);

  s = rope(KVI_ROPE_NONE, 0, 0.0);
  assert_ok(kvi_model_set_rope(m, -1, &s));
  for (int32_t l = 0; l < L0; l++) assert_rope(m, l, KVI_ROPE_NONE, 0, 0.0);
}

/* Snapshot of every layer's spec, to check that a failed call changed none
 * (compared field by field: padding bytes carry no meaning). */
static void rope_snapshot(const kvi_model *m, kvi_rope_spec out[L0]) {
  for (int32_t l = 0; l < L0; l++) out[l] = rope_of(m, l);
}

static void test_rope_invalid_changes_nothing(void **state) {
  kvi_model *m = *state;
  kvi_rope_spec s = rope(KVI_ROPE_GPTJ, 16, 2500.0);
  assert_ok(kvi_model_set_rope(m, -1, &s));
  s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  assert_ok(kvi_model_set_rope(m, 1, &s));
  kvi_rope_spec before[L0], after[L0];
  rope_snapshot(m, before);

  struct {
    int32_t layer;
    kvi_rope_spec spec;
    const char *value;
  } bad[] = {
      {-1, rope(KVI_ROPE_NEOX, 3, 10000.0), "3"},
      {0, rope(KVI_ROPE_GPTJ, 63, 10000.0), "63"},
      {-1, rope(KVI_ROPE_NEOX, D0 + 2, 10000.0), "66"},
      {2, rope(KVI_ROPE_NEOX, -2, 10000.0), "-2"},
      {-1, rope(KVI_ROPE_NEOX, 0, 0.0), "theta"},
      {1, rope(KVI_ROPE_GPTJ, 8, -1.0), "theta"},
      {-1, rope(KVI_ROPE_NEOX, 8, NAN), "theta"},
      {3, rope(KVI_ROPE_NEOX, 8, INFINITY), "theta"},
      {3, rope(KVI_ROPE_NEOX, 8, -INFINITY), "theta"},
      {-1, rope((kvi_rope_style)3, 8, 10000.0), "3"},
      {0, rope((kvi_rope_style)-1, 8, 10000.0), "-1"},
      {L0, rope(KVI_ROPE_NEOX, 8, 10000.0), "4"},
      {-2, rope(KVI_ROPE_NEOX, 8, 10000.0), "-2"},
      {INT32_MAX, rope(KVI_ROPE_NONE, 0, 0.0), "2147483647"},
  };
  for (size_t c = 0; c < sizeof bad / sizeof bad[0]; c++) {
    assert_status(kvi_model_set_rope(m, bad[c].layer, &bad[c].spec), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_model_set_rope", bad[c].value);
    rope_snapshot(m, after);
    assert_ropes_equal(before, after, L0, "rejected kvi_model_set_rope");
  }
  assert_status(kvi_model_set_rope(m, 0, NULL), KVI_ERR_INVALID_ARGUMENT);
  s = rope(KVI_ROPE_NEOX, 8, 10000.0);
  assert_status(kvi_model_set_rope(NULL, 0, &s), KVI_ERR_INVALID_ARGUMENT);

  /* struct sizes */
  s.struct_size = sizeof s - 8;
  assert_status(kvi_model_set_rope(m, 0, &s), KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_rope_spec s;
    unsigned char later[16];
  } big;
  memset(&big, 0, sizeof big);
  big.s = rope(KVI_ROPE_NEOX, 8, 123.0);
  big.s.struct_size = sizeof big;
  big.later[3] = 1;
  assert_status(kvi_model_set_rope(m, 0, &big.s), KVI_ERR_STRUCT_SIZE);
  rope_snapshot(m, after);
  assert_ropes_equal(before, after, L0, "struct_size larger with a set byte");

  big.later[3] = 0;
  assert_ok(kvi_model_set_rope(m, 0, &big.s));
  assert_rope(m, 0, KVI_ROPE_NEOX, 8, 123.0);
}

static void test_rope_get_errors(void **state) {
  kvi_model *m = *state;
  kvi_rope_spec s = KVI_ROPE_SPEC_INIT;
  assert_status(kvi_model_get_rope(m, -1, &s), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_get_rope(m, L0, &s), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_model_get_rope", "4");
  assert_status(kvi_model_get_rope(m, 0, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_get_rope(NULL, 0, &s), KVI_ERR_INVALID_ARGUMENT);

  kvi_rope_spec small, before;
  memset(&small, 0x77, sizeof small);
  small.struct_size = offsetof(kvi_rope_spec, theta);
  memcpy(&before, &small, sizeof small);
  assert_status(kvi_model_get_rope(m, 0, &small), KVI_ERR_STRUCT_SIZE);
  assert_memory_equal(&small, &before, sizeof small);

  struct {
    kvi_rope_spec s;
    unsigned char after[16];
  } big;
  memset(&big, 0x77, sizeof big);
  big.s.struct_size = sizeof big;
  kvi_rope_spec set = rope(KVI_ROPE_GPTJ, 4, 42.0);
  assert_ok(kvi_model_set_rope(m, 3, &set));
  assert_ok(kvi_model_get_rope(m, 3, &big.s));
  assert_int_equal(big.s.struct_size, sizeof big);
  assert_int_equal(big.s.style, KVI_ROPE_GPTJ);
  assert_int_equal(big.s.rotary_dim, 4);
  assert_true(big.s.theta == 42.0);
  for (size_t k = 0; k < sizeof big.after; k++) assert_int_equal(big.after[k], 0x77);
}

/* Scaling variants: each parameter rule of kvi_model_set_rope. */
static void test_rope_scaling_invalid_changes_nothing(void **state) {
  kvi_model *m = *state;
  kvi_rope_spec s = rope(KVI_ROPE_NEOX, 0, 500000.0);
  s.scaling = KVI_ROPE_SCALING_LLAMA3;
  s.factor = 8.0;
  assert_ok(kvi_model_set_rope(m, -1, &s));
  kvi_rope_spec before[L0], after[L0];
  rope_snapshot(m, before);

  kvi_rope_spec bad[16];
  size_t n = 0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n++].scaling = (kvi_rope_scaling)5;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_LINEAR, bad[n++].factor = 0.0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_LINEAR, bad[n++].factor = -2.0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_YARN, bad[n++].factor = NAN;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_NTK, bad[n++].factor = INFINITY;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_LLAMA3, bad[n].low_freq_factor = 4.0,
  bad[n++].high_freq_factor = 4.0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_LLAMA3, bad[n++].original_max_position = 0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_YARN, bad[n++].original_max_position = -5;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].scaling = KVI_ROPE_SCALING_YARN, bad[n++].beta_fast = 0.0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n++].attention_factor = -1.0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n++].attention_factor = NAN;
  float table[4 * D0];
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) table[i] = 0.5f;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].cos_sin_table = table, bad[n++].table_positions = 0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].cos_sin_table = table, bad[n].table_positions = 4,
  bad[n++].table_dtype = (kvi_dtype)0;
  bad[n] = rope(KVI_ROPE_NEOX, 0, 10000.0), bad[n].cos_sin_table = table, bad[n].table_positions = 4,
  bad[n++].table_dtype = KVI_DTYPE_FP8_E4M3;
  for (size_t c = 0; c < n; c++) {
    const kvi_status st = kvi_model_set_rope(m, c % 2 ? 1 : -1, &bad[c]);
    if (st != KVI_ERR_INVALID_ARGUMENT)
      fail_msg("bad scaling case %zu: got %d (%s), expected KVI_ERR_INVALID_ARGUMENT", c, (int)st, kvi_last_error());
    rope_snapshot(m, after);
    assert_ropes_equal(before, after, L0, "rejected scaling parameters");
  }
}

/* cos/sin of each scaling variant, against the Hugging Face formulas
 * evaluated here: angle = fp32(pos) * fp32(inv_freq), cos/sin times the
 * attention factor. */
static double want_inv(double theta, int i, int rot) { return 1.0 / pow(theta, (2.0 * i) / rot); }

static void expect_cs(const kvi_model *m, int32_t layer, int32_t pos, int32_t pair, double inv, double attn) {
  float c = -9.0f, s = -9.0f;
  assert_ok(kvi_model_rope_cos_sin(m, layer, pos, pair, &c, &s));
  const float a = (float)pos * (float)inv;
  const double wc = cos((double)a) * attn, ws = sin((double)a) * attn;
  if (fabs(c - wc) > 2e-6 * (1 + fabs(attn)) || fabs(s - ws) > 2e-6 * (1 + fabs(attn)))
    fail_msg("layer %d pos %d pair %d: cos/sin %.9g %.9g, expected %.9g %.9g", layer, pos, pair, (double)c,
             (double)s, wc, ws);
}

static void test_rope_cos_sin(void **state) {
  kvi_model *m = *state; /* head size 64 */
  kvi_rope_spec s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  assert_ok(kvi_model_set_rope(m, 0, &s));
  s = rope(KVI_ROPE_GPTJ, 32, 1e6);
  s.scaling = KVI_ROPE_SCALING_LINEAR;
  s.factor = 4.0;
  assert_ok(kvi_model_set_rope(m, 1, &s));
  s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  s.scaling = KVI_ROPE_SCALING_NTK;
  s.factor = 2.0;
  assert_ok(kvi_model_set_rope(m, 2, &s));
  s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  s.scaling = KVI_ROPE_SCALING_YARN;
  s.factor = 4.0;
  assert_ok(kvi_model_set_rope(m, 3, &s));

  const int32_t positions[] = {0, 1, 7, 100, 4095, 131071};
  for (size_t p = 0; p < sizeof positions / sizeof positions[0]; p++)
    for (int32_t i = 0; i < 32; i += 5) {
      expect_cs(m, 0, positions[p], i, want_inv(10000.0, i, 64), 1.0);
      if (i < 16) expect_cs(m, 1, positions[p], i, want_inv(1e6, i, 32) / 4.0, 1.0);
      expect_cs(m, 2, positions[p], i, want_inv(10000.0 * pow(2.0, 64.0 / 62.0), i, 64), 1.0);
    }
  /* YaRN: the highest frequency is not interpolated; mscale = 0.1 ln(4) + 1 */
  const double mscale = 0.1 * log(4.0) + 1.0;
  expect_cs(m, 3, 0, 0, want_inv(10000.0, 0, 64), mscale);
  expect_cs(m, 3, 5, 0, want_inv(10000.0, 0, 64), mscale);
  /* ... and the lowest is divided by the factor */
  expect_cs(m, 3, 1000, 31, want_inv(10000.0, 31, 64) / 4.0, mscale);
  kvi_rope_spec got = rope_of(m, 3);
  assert_true(fabs(got.attention_factor - mscale) < 1e-12);
  assert_int_equal(got.rotary_dim, 64);
  got = rope_of(m, 0);
  assert_true(got.attention_factor == 1.0);

  /* errors */
  float c = 7.0f, sn = 7.0f;
  assert_status(kvi_model_rope_cos_sin(m, 0, 0, 32, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, 1, 0, 16, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, 0, 0, -1, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, 0, -1, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, L0, 0, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, -1, 0, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, 0, 0, 0, NULL, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(m, 0, 0, 0, &c, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_model_rope_cos_sin(NULL, 0, 0, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  s = rope(KVI_ROPE_NONE, 0, 0.0);
  assert_ok(kvi_model_set_rope(m, 2, &s));
  assert_status(kvi_model_rope_cos_sin(m, 2, 0, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  assert_true(c == 7.0f && sn == 7.0f);
}

/* An engine's cos/sin table is copied (as fp32) and used as given. */
static void test_rope_table(void **state) {
  kvi_model *m = *state;
  enum { POS = 6, ROT = 8 };
  uint16_t t16[POS * ROT];
  for (int p = 0; p < POS; p++)
    for (int i = 0; i < ROT; i++) t16[p * ROT + i] = ref_f32_to_f16((float)(p * 100 + i) / 1024.0f - 0.25f);
  kvi_rope_spec s = rope(KVI_ROPE_GPTJ, ROT, 10000.0);
  s.cos_sin_table = t16;
  s.table_dtype = KVI_DTYPE_FP16;
  s.table_positions = POS;
  assert_ok(kvi_model_set_rope(m, 2, &s));
  memset(t16, 0xFF, sizeof t16); /* copied: the caller's buffer is free again */
  for (int p = 0; p < POS; p++)
    for (int i = 0; i < ROT / 2; i++) {
      float c, sn;
      assert_ok(kvi_model_rope_cos_sin(m, 2, p, i, &c, &sn));
      const float wc = ref_f16_to_f32(ref_f32_to_f16((float)(p * 100 + i) / 1024.0f - 0.25f));
      const float ws = ref_f16_to_f32(ref_f32_to_f16((float)(p * 100 + ROT / 2 + i) / 1024.0f - 0.25f));
      assert_true(c == wc);
      assert_true(sn == ws);
    }
  float c, sn;
  assert_status(kvi_model_rope_cos_sin(m, 2, POS, 0, &c, &sn), KVI_ERR_INVALID_ARGUMENT);
  const kvi_rope_spec got = rope_of(m, 2);
  assert_int_equal(got.style, KVI_ROPE_GPTJ);
  assert_int_equal(got.rotary_dim, ROT);
  assert_int_equal(got.table_dtype, KVI_DTYPE_FP32);
  assert_int_equal(got.table_positions, POS);
  assert_non_null(got.cos_sin_table);
  const float *ft = got.cos_sin_table;
  assert_true(ft[3 * ROT + 5] == ref_f16_to_f32(ref_f32_to_f16((float)(3 * 100 + 5) / 1024.0f - 0.25f)));
  /* the other layers are untouched */
  assert_int_equal(rope_of(m, 1).style, KVI_ROPE_UNSET);
  assert_null(rope_of(m, 1).cos_sin_table);
}

/* rotary_dim 0 resolves against this model's head size, not a default. */
static void test_rope_zero_resolves_to_head_size(void **state) {
  (void)state;
  kvi_model *m = make_model(2, 2, 6, 0, 1);
  kvi_rope_spec s = rope(KVI_ROPE_GPTJ, 0, 77.0);
  assert_ok(kvi_model_set_rope(m, 1, &s));
  assert_rope(m, 1, KVI_ROPE_GPTJ, 6, 77.0);
  assert_rope(m, 0, KVI_ROPE_UNSET, 0, 0.0);
  kvi_model_destroy(m);
  /* head size 1: no even rotary_dim fits, so rotation cannot be set */
  m = make_model(1, 1, 1, 0, 1);
  s = rope(KVI_ROPE_NEOX, 0, 10000.0);
  assert_status(kvi_model_set_rope(m, 0, &s), KVI_ERR_INVALID_ARGUMENT);
  assert_rope(m, 0, KVI_ROPE_UNSET, 0, 0.0);
  kvi_model_destroy(m);
}

/* A store copies the geometry: the model may be destroyed first. */
static void test_model_destroyed_before_store(void **state) {
  (void)state;
  kvi_model *m = make_model(2, 4, 8, 1, 2);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 16);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  kvi_model_destroy(m);
  float k[2 * 3 * 2 * 8], v[2 * 3 * 2 * 8];
  for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) k[i] = (float)i + 0.5f, v[i] = -(float)i - 0.25f;
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 2, 3, 2, 8, k, v);
  assert_ok(kvi_store_put(s, 1, 1, &kv, NULL, NULL));
  float k2[sizeof k / sizeof k[0]], v2[sizeof v / sizeof v[0]];
  memset(k2, 0, sizeof k2);
  memset(v2, 0, sizeof v2);
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 2, 3, 2, 8, k2, v2);
  assert_ok(kvi_store_read(s, 1, 1, &kv, NULL));
  assert_memory_equal(k, k2, sizeof k);
  assert_memory_equal(v, v2, sizeof v);
  /* the view must use the local heads (2 of 4), not all of them */
  kv.num_heads = 4;
  assert_status(kvi_store_read(s, 1, 1, &kv, NULL), KVI_ERR_MISMATCH);
  kvi_store_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_model_valid_geometry, setup_model, teardown_model),
      cmocka_unit_test(test_model_destroy_null),
      cmocka_unit_test(test_model_invalid_fields),
      cmocka_unit_test(test_model_null_arguments),
      cmocka_unit_test(test_model_options_struct_size),
      cmocka_unit_test(test_model_tp_head_ranges),
      cmocka_unit_test_setup_teardown(test_model_info_struct_size, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_default_unset, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_set_all_and_one, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_invalid_changes_nothing, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_get_errors, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_scaling_invalid_changes_nothing, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_cos_sin, setup_model, teardown_model),
      cmocka_unit_test_setup_teardown(test_rope_table, setup_model, teardown_model),
      cmocka_unit_test(test_rope_zero_resolves_to_head_size),
      cmocka_unit_test(test_model_destroyed_before_store),
  };
  return cmocka_run_group_tests_name("unit-model", tests, NULL, NULL);
}
