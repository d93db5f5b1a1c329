/*
 * The RoPE configurations the unit suites check against the float64
 * reference, each written once: the spec builder, NoPE, engine cos/sin
 * tables, and a catalogue of named configurations (every scaling variant,
 * NeoX and GPT-J, partial rotary, tables in each float dtype). A suite lists
 * the entries it runs, in its own order, and takes them with rope_cases().
 * Last, a layer's RoPE read back, and the check that a rejected call changed
 * no layer.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_ROPE_CATALOGUE_H
#define KVI_ROPE_CATALOGUE_H

#include "unit.h"

static inline kvi_rope_spec rope(kvi_rope_style style, int32_t rot, double theta) {
  kvi_rope_spec s = KVI_ROPE_SPEC_INIT;
  s.style = style;
  s.rotary_dim = rot;
  s.theta = theta;
  return s;
}

static inline kvi_rope_spec nope(void) { return rope(KVI_ROPE_NONE, 0, 0.0); }

/* A cos/sin table of `positions` rows for NeoX/GPT-J rot, from theta, times
 * `m` (an attention factor the engine folded in), in dtype dt. */
static inline void *rope_table(kvi_dtype dt, int32_t positions, int32_t rot, double theta, double m) {
  const size_t es = kvi_dtype_size(dt);
  unsigned char *t = malloc((size_t)positions * (size_t)rot * es);
  assert_non_null(t);
  for (int32_t p = 0; p < positions; p++)
    for (int32_t i = 0; i < rot / 2; i++) {
      const double a = (double)p * pow(theta, -(2.0 * i) / rot);
      ref_store_bits(t, dt, (int64_t)p * rot + i, ref_bits((float)(m * cos(a)), dt));
      ref_store_bits(t, dt, (int64_t)p * rot + rot / 2 + i, ref_bits((float)(m * sin(a)), dt));
    }
  return t;
}

/* ------------------------------------------------------------------------ */
/* the catalogue                                                             */
/* ------------------------------------------------------------------------ */

typedef enum rope_id {
  ROPE_NEOX,                  /* no scaling, theta 1e4 */
  ROPE_NEOX_ATTENTION_1_5,    /* no scaling, an explicit attention factor */
  ROPE_GPTJ,                  /* no scaling, theta 1e4 */
  ROPE_NEOX_ROTARY_12,        /* partial rotary */
  ROPE_GPTJ_ROTARY_20,        /* partial rotary */
  ROPE_LINEAR_4,              /* linear scaling */
  ROPE_LLAMA3_1,              /* Llama-3.1's llama3 scaling (the defaults written out) */
  ROPE_LLAMA3_2,              /* llama3 scaling, factor 32, other bands */
  ROPE_YARN_4,                /* YaRN, default attention factor, truncated ramp */
  ROPE_YARN_32_GPT_OSS,       /* YaRN as gpt-oss has it: no truncation */
  ROPE_YARN_16,               /* YaRN, beta 24/2, explicit attention factor */
  ROPE_YARN_16_GPTJ_UNTRUNCATED,
  ROPE_YARN_HALF,             /* YaRN factor below 1 */
  ROPE_NTK_3,                 /* fixed NTK */
  ROPE_TABLE_FP32,            /* engine tables (rope_table) */
  ROPE_TABLE_BF16,
  ROPE_TABLE_FP16,
} rope_id;

typedef struct rope_case {
  const char *name;
  kvi_rope_spec s;
  void *table; /* owned: rope_cases_free */
} rope_case;

/* Entry `id` of the catalogue; the bf16 and fp16 tables are head_size wide. */
static inline rope_case rope_case_of(rope_id id, int32_t head_size) {
  rope_case c = {NULL, KVI_ROPE_SPEC_INIT, NULL};
  switch (id) {
  case ROPE_NEOX:
    c.name = "NeoX theta 1e4";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    break;
  case ROPE_NEOX_ATTENTION_1_5:
    c.name = "NeoX with an explicit attention factor 1.5";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    c.s.attention_factor = 1.5;
    break;
  case ROPE_GPTJ:
    c.name = "GPT-J";
    c.s = rope(KVI_ROPE_GPTJ, 0, 10000.0);
    break;
  case ROPE_NEOX_ROTARY_12:
    c.name = "NeoX partial rotary 12";
    c.s = rope(KVI_ROPE_NEOX, 12, 1e5);
    break;
  case ROPE_GPTJ_ROTARY_20:
    c.name = "GPT-J partial rotary 20";
    c.s = rope(KVI_ROPE_GPTJ, 20, 5e5);
    break;
  case ROPE_LINEAR_4:
    c.name = "linear factor 4";
    c.s = rope(KVI_ROPE_NEOX, 0, 1e6);
    c.s.scaling = KVI_ROPE_SCALING_LINEAR;
    c.s.factor = 4.0;
    break;
  case ROPE_LLAMA3_1:
    c.name = "llama3 (Llama-3.1: theta 5e5, factor 8, low 1, high 4, original 8192)";
    c.s = rope(KVI_ROPE_NEOX, 0, 5e5);
    c.s.scaling = KVI_ROPE_SCALING_LLAMA3;
    c.s.factor = 8.0;
    c.s.low_freq_factor = 1.0;
    c.s.high_freq_factor = 4.0;
    c.s.original_max_position = 8192;
    break;
  case ROPE_LLAMA3_2:
    c.name = "llama3 (Llama-3.2: factor 32) with low 2, high 6, original 2048";
    c.s = rope(KVI_ROPE_NEOX, 0, 5e5);
    c.s.scaling = KVI_ROPE_SCALING_LLAMA3;
    c.s.factor = 32.0;
    c.s.low_freq_factor = 2.0;
    c.s.high_freq_factor = 6.0;
    c.s.original_max_position = 2048;
    break;
  case ROPE_YARN_4:
    c.name = "yarn factor 4, original 4096, default attention factor, truncate";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    c.s.scaling = KVI_ROPE_SCALING_YARN;
    c.s.factor = 4.0;
    c.s.original_max_position = 4096;
    break;
  case ROPE_YARN_32_GPT_OSS:
    c.name = "yarn factor 32 (gpt-oss), beta 32/1, original 4096, no truncation";
    c.s = rope(KVI_ROPE_NEOX, 0, 150000.0);
    c.s.scaling = KVI_ROPE_SCALING_YARN;
    c.s.factor = 32.0;
    c.s.original_max_position = 4096;
    c.s.yarn_truncate = 0;
    break;
  case ROPE_YARN_16:
    c.name = "yarn factor 16, beta 24/2, original 2048, explicit attention factor 1.25";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    c.s.scaling = KVI_ROPE_SCALING_YARN;
    c.s.factor = 16.0;
    c.s.beta_fast = 24.0;
    c.s.beta_slow = 2.0;
    c.s.original_max_position = 2048;
    c.s.attention_factor = 1.25;
    break;
  case ROPE_YARN_16_GPTJ_UNTRUNCATED:
    c.name = "yarn x16 GPT-J, no truncation, attention factor 1.25, beta 24/2";
    c.s = rope(KVI_ROPE_GPTJ, 0, 10000.0);
    c.s.scaling = KVI_ROPE_SCALING_YARN;
    c.s.factor = 16.0;
    c.s.original_max_position = 2048;
    c.s.yarn_truncate = 0;
    c.s.beta_fast = 24.0;
    c.s.beta_slow = 2.0;
    c.s.attention_factor = 1.25;
    break;
  case ROPE_YARN_HALF:
    c.name = "yarn factor 0.5 (attention factor 1)";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    c.s.scaling = KVI_ROPE_SCALING_YARN;
    c.s.factor = 0.5;
    c.s.original_max_position = 4096;
    break;
  case ROPE_NTK_3:
    c.name = "fixed NTK factor 3";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    c.s.scaling = KVI_ROPE_SCALING_NTK;
    c.s.factor = 3.0;
    break;
  case ROPE_TABLE_FP32:
    c.name = "fp32 cos/sin table (attention factor 1.1 folded in), NeoX rotary 16";
    c.s = rope(KVI_ROPE_NEOX, 16, 10000.0);
    c.table = rope_table(KVI_DTYPE_FP32, 4096, 16, 10000.0, 1.1);
    c.s.cos_sin_table = c.table;
    c.s.attention_factor = 1.3; /* the table includes it already: never applied on top */
    c.s.table_positions = 4096;
    break;
  case ROPE_TABLE_BF16:
    c.name = "bf16 cos/sin table, GPT-J";
    c.s = rope(KVI_ROPE_GPTJ, 0, 10000.0);
    c.table = rope_table(KVI_DTYPE_BF16, 4096, head_size, 5e5, 1.0);
    c.s.cos_sin_table = c.table;
    c.s.table_dtype = KVI_DTYPE_BF16;
    c.s.table_positions = 4096;
    break;
  case ROPE_TABLE_FP16:
    c.name = "fp16 cos/sin table, NeoX";
    c.s = rope(KVI_ROPE_NEOX, 0, 10000.0);
    c.table = rope_table(KVI_DTYPE_FP16, 4096, head_size, 10000.0, 1.0);
    c.s.cos_sin_table = c.table;
    c.s.table_dtype = KVI_DTYPE_FP16;
    c.s.table_positions = 4096;
    break;
  default: fail_msg("rope_case_of: id %d", (int)id);
  }
  return c;
}

/* The n entries `ids` into c, in that order; returns n. */
static inline int rope_cases(rope_case *c, const rope_id *ids, int n, int32_t head_size) {
  for (int i = 0; i < n; i++) c[i] = rope_case_of(ids[i], head_size);
  return n;
}

static inline void rope_cases_free(rope_case *c, int n) {
  for (int i = 0; i < n; i++) free(c[i].table);
}

/* ------------------------------------------------------------------------ */
/* a model's RoPE, read back                                                 */
/* ------------------------------------------------------------------------ */

/* kvi_model_get_rope of `layer`, into a struct poisoned with 0xEE. */
static inline kvi_rope_spec rope_get(const kvi_model *m, int32_t layer) {
  kvi_rope_spec s;
  memset(&s, 0xEE, sizeof s);
  s.struct_size = sizeof s;
  assert_ok(kvi_model_get_rope(m, layer, &s));
  return s;
}

/* Layers 0..n-1 of a and b (rope_get of each, before and after `what`, a
 * rejected call) agree in every field. */
static inline void assert_ropes_equal(const kvi_rope_spec *a, const kvi_rope_spec *b, int32_t n, const char *what) {
  for (int32_t l = 0; l < n; l++) {
    const kvi_rope_spec *x = &a[l], *y = &b[l];
    if (x->style != y->style || x->rotary_dim != y->rotary_dim || x->theta != y->theta || x->scaling != y->scaling ||
        x->original_max_position != y->original_max_position || x->factor != y->factor ||
        x->low_freq_factor != y->low_freq_factor || x->high_freq_factor != y->high_freq_factor ||
        x->beta_fast != y->beta_fast || x->beta_slow != y->beta_slow || x->attention_factor != y->attention_factor ||
        x->yarn_truncate != y->yarn_truncate || x->table_dtype != y->table_dtype ||
        x->cos_sin_table != y->cos_sin_table || x->table_positions != y->table_positions)
      fail_msg("%s: layer %d's RoPE changed (style %d -> %d, rotary_dim %d -> %d, theta %g -> %g, scaling %d -> %d, "
               "factor %g -> %g)",
               what, l, (int)x->style, (int)y->style, x->rotary_dim, y->rotary_dim, x->theta, y->theta,
               (int)x->scaling, (int)y->scaling, x->factor, y->factor);
  }
}

#endif /* KVI_ROPE_CATALOGUE_H */
