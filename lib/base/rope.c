/*
 * RoPE: frequencies for every scaling variant (computed in double, kept as
 * fp32), cos/sin tables, and the fp32 rotation the CUDA kernels reproduce.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Formulas follow Hugging Face transformers' modeling_rope_utils (the
 * reference the parity harness runs against) and vLLM's rotary_embedding.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"

#define ROPE_SPEC_V1 sizeof(kvi_rope_spec)

static const double TWO_PI = 6.283185307179586476925286766559;

static double yarn_correction_dim(double rotations, int32_t dim, double base, double max_pos) {
  return (dim * log(max_pos / (rotations * TWO_PI))) / (2.0 * log(base));
}

/* Fills inv (rot/2 doubles) for a formula spec; returns the attention factor. */
static double frequencies(const kvi_rope_spec *s, int32_t rot, double *inv) {
  const int32_t half = rot / 2;
  double theta = s->theta;
  if (s->scaling == KVI_ROPE_SCALING_NTK) theta *= pow(s->factor, (double)rot / (rot - 2));
  for (int32_t i = 0; i < half; i++) inv[i] = 1.0 / pow(theta, (2.0 * i) / rot);
  double attn = 1.0;
  switch (s->scaling) {
  case KVI_ROPE_SCALING_NONE:
  case KVI_ROPE_SCALING_NTK: break;
  case KVI_ROPE_SCALING_LINEAR:
    for (int32_t i = 0; i < half; i++) inv[i] /= s->factor;
    break;
  case KVI_ROPE_SCALING_LLAMA3: {
    const double old = s->original_max_position, lo = s->low_freq_factor, hi = s->high_freq_factor;
    const double low_wavelen = old / lo, high_wavelen = old / hi;
    for (int32_t i = 0; i < half; i++) {
      const double wavelen = TWO_PI / inv[i];
      if (wavelen < high_wavelen) continue; /* high frequency: unchanged */
      if (wavelen > low_wavelen) {
        inv[i] /= s->factor; /* low frequency: scaled */
      } else {
        const double smooth = (old / wavelen - lo) / (hi - lo);
        inv[i] = (1.0 - smooth) * inv[i] / s->factor + smooth * inv[i];
      }
    }
    break;
  }
  case KVI_ROPE_SCALING_YARN: {
    double low = yarn_correction_dim(s->beta_fast, rot, s->theta, s->original_max_position);
    double high = yarn_correction_dim(s->beta_slow, rot, s->theta, s->original_max_position);
    if (s->yarn_truncate) {
      low = floor(low);
      high = ceil(high);
    }
    if (low < 0) low = 0;
    if (high > rot - 1) high = rot - 1;
    if (low == high) high += 0.001;
    for (int32_t i = 0; i < half; i++) {
      double ramp = (i - low) / (high - low);
      ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
      const double extrap = 1.0 - ramp; /* weight of the unscaled frequency */
      inv[i] = inv[i] / s->factor * (1.0 - extrap) + inv[i] * extrap;
    }
    attn = s->factor <= 1.0 ? 1.0 : 0.1 * log(s->factor) + 1.0;
    break;
  }
  }
  if (s->attention_factor != 0.0) attn = s->attention_factor;
  return attn;
}

static bool finite_pos(double x) { return isfinite(x) && x > 0.0; }

kvi_status kvi__rope_resolve(kvi__rope *out, const kvi_rope_spec *spec, int32_t head_size, const char *fn) {
  kvi_rope_spec s = KVI_ROPE_SPEC_INIT;
  kvi_status st = kvi__read_struct(&s, sizeof s, spec, ROPE_SPEC_V1, fn, "spec");
  if (st) return st;
  kvi__rope r;
  memset(&r, 0, sizeof r);
  r.style = s.style;
  if (s.style == KVI_ROPE_NONE) {
    kvi_rope_spec none = KVI_ROPE_SPEC_INIT;
    none.style = KVI_ROPE_NONE;
    r.spec = none;
    *out = r;
    return KVI_OK;
  }
  if (s.style == KVI_ROPE_UNSET)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "style is %d (KVI_ROPE_UNSET), the state of a new model's layers; set NEOX, GPTJ or NONE", (int)s.style);
  if (s.style != KVI_ROPE_NEOX && s.style != KVI_ROPE_GPTJ)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "unknown RoPE style %d", (int)s.style);
  const int32_t rot = s.rotary_dim ? s.rotary_dim : head_size;
  if (rot < 2 || rot > head_size || rot % 2)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "rotary_dim is %d, expected an even number in 2..head_size (%d), or 0", (int)s.rotary_dim,
                     (int)head_size);
  r.rotary_dim = rot;
  if (!(s.attention_factor == 0.0 || finite_pos(s.attention_factor)))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "attention_factor is %g, expected 0 (default) or a finite value > 0",
                     s.attention_factor);
  if (s.cos_sin_table) {
    if (!kvi__dtype_is_float(s.table_dtype))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "table_dtype is %d, expected FP32, FP16 or BF16", (int)s.table_dtype);
    if (s.table_positions < 1)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "table_positions is %d, expected >= 1", (int)s.table_positions);
    const size_t n = (size_t)s.table_positions * (size_t)rot;
    kvi__table *t = malloc(sizeof *t + n * sizeof(float));
    if (!t) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "copying a %d x %d cos/sin table", (int)s.table_positions, (int)rot);
    atomic_init(&t->refs, 1);
    t->positions = s.table_positions;
    t->rotary_dim = rot;
    kvi__convert(t->data, KVI_DTYPE_FP32, s.cos_sin_table, s.table_dtype, (int64_t)n);
    for (size_t i = 0; i < n; i++)
      if (!isfinite(t->data[i])) {
        const float bad = t->data[i];
        free(t);
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "cos_sin_table[%zu][%zu] is %g; a table must be finite",
                         i / (size_t)rot, i % (size_t)rot, (double)bad);
      }
    r.table = t;
    r.attn = 1.0f;
    s.rotary_dim = rot;
    s.cos_sin_table = NULL;
    s.table_dtype = KVI_DTYPE_FP32;
    s.attention_factor = 1.0;
    r.spec = s;
    *out = r;
    return KVI_OK;
  }
  if (!finite_pos(s.theta))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "theta is %g, expected a finite value > 0", s.theta);
  switch (s.scaling) {
  case KVI_ROPE_SCALING_NONE: break;
  case KVI_ROPE_SCALING_NTK:
    if (rot < 4)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "NTK scaling needs rotary_dim >= 4, got %d", (int)rot);
    /* fall through */
  case KVI_ROPE_SCALING_LINEAR:
  case KVI_ROPE_SCALING_LLAMA3:
  case KVI_ROPE_SCALING_YARN:
    if (!finite_pos(s.factor))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "factor is %g, expected a finite value > 0", s.factor);
    break;
  default: return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "unknown RoPE scaling %d", (int)s.scaling);
  }
  if (s.scaling == KVI_ROPE_SCALING_LLAMA3 &&
      !(finite_pos(s.low_freq_factor) && isfinite(s.high_freq_factor) && s.high_freq_factor > s.low_freq_factor))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "llama3 needs 0 < low_freq_factor < high_freq_factor, got %g and %g", s.low_freq_factor,
                     s.high_freq_factor);
  if ((s.scaling == KVI_ROPE_SCALING_LLAMA3 || s.scaling == KVI_ROPE_SCALING_YARN) && s.original_max_position < 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "original_max_position is %d, expected >= 1",
                     (int)s.original_max_position);
  if (s.scaling == KVI_ROPE_SCALING_YARN && !(finite_pos(s.beta_fast) && finite_pos(s.beta_slow)))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "YaRN needs beta_fast and beta_slow > 0, got %g and %g",
                     s.beta_fast, s.beta_slow);
  double *inv = malloc((size_t)(rot / 2) * sizeof *inv);
  r.inv_freq = malloc((size_t)(rot / 2) * sizeof *r.inv_freq);
  if (!inv || !r.inv_freq) {
    free(inv);
    free(r.inv_freq);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d frequencies", (int)rot / 2);
  }
  const double attn = frequencies(&s, rot, inv);
  for (int32_t i = 0; i < rot / 2; i++) r.inv_freq[i] = (float)inv[i];
  free(inv);
  r.attn = (float)attn;
  s.attention_factor = attn;
  s.rotary_dim = rot;
  r.spec = s;
  *out = r;
  return KVI_OK;
}

kvi_status kvi__rope_copy(kvi__rope *dst, const kvi__rope *src, const char *fn) {
  *dst = *src;
  if (src->inv_freq) {
    size_t n = (size_t)(src->rotary_dim / 2);
    dst->inv_freq = malloc(n * sizeof *dst->inv_freq);
    if (!dst->inv_freq) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "copying RoPE frequencies");
    memcpy(dst->inv_freq, src->inv_freq, n * sizeof *dst->inv_freq);
  }
  if (src->table) atomic_fetch_add(&src->table->refs, 1);
  return KVI_OK;
}

void kvi__rope_release(kvi__rope *r) {
  free(r->inv_freq);
  r->inv_freq = NULL;
  if (r->table && atomic_fetch_sub(&r->table->refs, 1) == 1) free(r->table);
  r->table = NULL;
}

int32_t kvi__rope_max_positions(const kvi__rope *r) { return r->table ? r->table->positions : INT32_MAX; }

void kvi__rope_cs(const kvi__rope *r, int32_t pos, int32_t i, float *c, float *s) {
  if (r->table) {
    const float *row = r->table->data + (size_t)pos * (size_t)r->rotary_dim;
    *c = row[i];
    *s = row[r->rotary_dim / 2 + i];
    return;
  }
  /* fp32 angle, as engines compute it; cos/sin of that fp32 value in double */
  const float a = (float)pos * r->inv_freq[i];
  *c = (float)cos((double)a) * r->attn;
  *s = (float)sin((double)a) * r->attn;
}

void kvi__rope_rotate(const kvi__rope *r, float *x, int32_t pos, bool inverse) {
  if (r->style == KVI_ROPE_NONE) return;
  const int32_t half = r->rotary_dim / 2;
  for (int32_t i = 0; i < half; i++) {
    float c, s;
    kvi__rope_cs(r, pos, i, &c, &s);
    float *a = r->style == KVI_ROPE_NEOX ? &x[i] : &x[2 * i];
    float *b = r->style == KVI_ROPE_NEOX ? &x[i + half] : &x[2 * i + 1];
    const float xa = *a, xb = *b;
    if (!inverse) {
      *a = xa * c - xb * s;
      *b = xb * c + xa * s;
    } else {
      /* R^T / (cos^2 + sin^2), the reciprocal folded into cos and sin once
       * (the CUDA kernel does the same, per pair rather than per head) */
      const float r = 1.0f / (c * c + s * s), ci = c * r, si = s * r;
      *a = xa * ci + xb * si;
      *b = xb * ci - xa * si;
    }
  }
}
