/*
 * Independent float64 references for the RoPE, layout and injection suites
 * (unit-rope, unit-layouts, unit-inject). Nothing here calls the library or
 * shares code with lib/:
 *   - inverse frequencies of every scaling, written from Hugging Face
 *     transformers' modeling_rope_utils (docs: engines.md section 3): default,
 *     linear, llama3 (in FlashInfer's clamp form, which engines.md shows
 *     equal to HF's three-way form), YaRN (find_correction_range,
 *     linear_ramp_factor, get_mscale), fixed NTK;
 *   - NeoX / GPT-J rotation with partial rotary, in double;
 *   - fp8 e4m3fn / e5m2 by table: every finite code decoded from its bit
 *     fields, a value rounded to the nearest code (ties to the even code),
 *     saturating to the largest finite code;
 *   - engine cache tensors allocated with the engine's own shape and indexed
 *     with that shape (never with the library's strides);
 *   - FNV-1a for "nothing changed" checks.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_REF64_H
#define KVI_REF64_H

#include "unit.h"

#define REF_TWO_PI 6.283185307179586476925286766559
#define REF_MAX_PAIRS 512

/* ------------------------------------------------------------------------ */
/* random data: non-zero, moderate, random mantissa                          */
/* ------------------------------------------------------------------------ */

/* +-(1 + m) * 2^e with e uniform in [lo_exp, hi_exp]. */
static inline float rand_val(rng *r, int lo_exp, int hi_exp) {
  const int e = (int)rng_range(r, lo_exp, hi_exp);
  const uint32_t m = (uint32_t)(rng_next(r) & 0x7fffffu);
  const float v = ldexpf(1.0f + (float)m * 0x1p-23f, e);
  return (rng_next(r) & 1u) ? -v : v;
}

/* Fisher-Yates shuffle of 0..n-1. */
static inline void rand_perm(rng *r, int32_t *a, int32_t n) {
  for (int32_t i = 0; i < n; i++) a[i] = i;
  for (int32_t i = n - 1; i > 0; i--) {
    const int32_t j = (int32_t)rng_range(r, 0, i);
    const int32_t t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

/* n distinct positions in [lo, hi), not consecutive (random gaps >= 2), in
 * random order when `shuffle`. */
static inline void rand_positions(rng *r, int32_t *p, int32_t n, int32_t lo, int32_t hi, bool shuffle) {
  const int64_t room = (int64_t)hi - lo - 1 - 2 * (int64_t)n;
  assert_true(room > 0);
  int64_t cur = lo + rng_range(r, 0, room / 4);
  for (int32_t i = 0; i < n; i++) {
    p[i] = (int32_t)cur;
    const int64_t left = (int64_t)hi - 1 - cur - 2 * (int64_t)(n - 1 - i);
    const int64_t maxgap = left / (n - i) > 2 ? left / (n - i) : 2;
    cur += rng_range(r, 2, maxgap);
  }
  assert_true(p[n - 1] < hi);
  if (shuffle)
    for (int32_t i = n - 1; i > 0; i--) {
      const int32_t j = (int32_t)rng_range(r, 0, i);
      const int32_t t = p[i];
      p[i] = p[j];
      p[j] = t;
    }
}

/* ------------------------------------------------------------------------ */
/* FNV-1a                                                                    */
/* ------------------------------------------------------------------------ */

#define FNV_INIT 0xcbf29ce484222325ull

static inline uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

static inline uint64_t fnv_u64(uint64_t h, uint64_t v) { return fnv1a(h, &v, sizeof v); }

/* ------------------------------------------------------------------------ */
/* RoPE reference                                                            */
/* ------------------------------------------------------------------------ */

typedef struct ref_rope {
  kvi_rope_style style;
  int32_t rot;                /* rotated dims */
  double attn;                /* multiplies cos and sin (formula specs) */
  double inv[REF_MAX_PAIRS];  /* formula specs */
  double *table;              /* positions x rot doubles (cos half, sin half), or NULL */
  int32_t table_positions;
} ref_rope;

/* HF: find_correction_dim */
static inline double ref_yarn_dim(double rotations, int32_t dim, double base, double max_pos) {
  return (dim * log(max_pos / (rotations * REF_TWO_PI))) / (2.0 * log(base));
}

/* Fills r from a spec, as Hugging Face would compute it. The table (if any)
 * is converted with unit.h's reference conversions. */
static inline void ref_rope_init(ref_rope *r, const kvi_rope_spec *s, int32_t head_size) {
  memset(r, 0, sizeof *r);
  r->style = s->style;
  if (s->style == KVI_ROPE_NONE) return;
  const int32_t rot = s->rotary_dim ? s->rotary_dim : head_size;
  const int32_t half = rot / 2;
  assert_true(half <= REF_MAX_PAIRS);
  r->rot = rot;
  if (s->cos_sin_table) {
    const size_t n = (size_t)s->table_positions * (size_t)rot;
    r->table = malloc(n * sizeof *r->table);
    assert_non_null(r->table);
    for (size_t i = 0; i < n; i++) r->table[i] = (double)ref_load(s->cos_sin_table, s->table_dtype, (int64_t)i);
    r->table_positions = s->table_positions;
    r->attn = 1.0;
    return;
  }
  double base = s->theta;
  if (s->scaling == KVI_ROPE_SCALING_NTK) base = s->theta * exp(log(s->factor) * (double)rot / (double)(rot - 2));
  /* default: 1 / base^(2i / dim), as exp(-ln(base) * 2i/dim) */
  for (int32_t i = 0; i < half; i++) r->inv[i] = exp(-log(base) * (double)(2 * i) / (double)rot);
  double attn = 1.0;
  switch (s->scaling) {
  case KVI_ROPE_SCALING_NONE:
  case KVI_ROPE_SCALING_NTK: break;
  case KVI_ROPE_SCALING_LINEAR:
    for (int32_t i = 0; i < half; i++) r->inv[i] = r->inv[i] / s->factor;
    break;
  case KVI_ROPE_SCALING_LLAMA3: {
    /* FlashInfer pos_enc.cuh: smooth = clamp(f * a + b, 0, 1),
     * a = L_old / (2 pi (h - l)), b = -1 / (h/l - 1), f' = (1 - smooth) f / s + smooth f */
    const double lo = s->low_freq_factor, hi = s->high_freq_factor;
    const double a = (double)s->original_max_position / (REF_TWO_PI * (hi - lo));
    const double b = -1.0 / (hi / lo - 1.0);
    for (int32_t i = 0; i < half; i++) {
      double sm = r->inv[i] * a + b;
      sm = sm < 0.0 ? 0.0 : sm > 1.0 ? 1.0 : sm;
      r->inv[i] = (1.0 - sm) * r->inv[i] / s->factor + sm * r->inv[i];
    }
    break;
  }
  case KVI_ROPE_SCALING_YARN: {
    /* HF find_correction_range(beta_fast, beta_slow, dim, base, original_max, truncate) */
    double low = ref_yarn_dim(s->beta_fast, rot, s->theta, s->original_max_position);
    double high = ref_yarn_dim(s->beta_slow, rot, s->theta, s->original_max_position);
    if (s->yarn_truncate) {
      low = floor(low);
      high = ceil(high);
    }
    low = fmax(low, 0.0);
    high = fmin(high, (double)(rot - 1));
    /* HF linear_ramp_factor(low, high, dim // 2) */
    if (low == high) high += 0.001;
    for (int32_t i = 0; i < half; i++) {
      double ramp = ((double)i - low) / (high - low);
      ramp = ramp < 0.0 ? 0.0 : ramp > 1.0 ? 1.0 : ramp;
      const double extrap_factor = 1.0 - ramp;
      const double inv_extrap = r->inv[i], inv_interp = r->inv[i] / s->factor;
      r->inv[i] = inv_interp * (1.0 - extrap_factor) + inv_extrap * extrap_factor;
    }
    /* HF get_mscale */
    attn = s->factor <= 1.0 ? 1.0 : 0.1 * log(s->factor) + 1.0;
    break;
  }
  }
  if (s->attention_factor != 0.0) attn = s->attention_factor;
  r->attn = attn;
}

static inline void ref_rope_free(ref_rope *r) {
  free(r->table);
  r->table = NULL;
}

/* cos and sin (attention factor included) of pair i at pos, in double. */
static inline void ref_cs(const ref_rope *r, int32_t pos, int32_t i, double *c, double *s) {
  if (r->table) {
    const double *row = r->table + (size_t)pos * (size_t)r->rot;
    *c = row[i];
    *s = row[r->rot / 2 + i];
    return;
  }
  const double a = (double)pos * r->inv[i];
  *c = r->attn * cos(a);
  *s = r->attn * sin(a);
}

/*
 * Bound on |library cos/sin - reference| at (pos, pair i).
 * The library's angle is fl32(fl32(pos) * fl32(inv)): fl32(pos) is exact
 * below 2^24, fl32(inv) = inv (1 + d1) and the product adds (1 + d2), with
 * |d1|, |d2| <= 2^-24, so |angle error| <= pos * inv * (2^-23 + 2^-48), which
 * pos * inv * 2^-22 bounds with a factor 2 to spare (that also covers the
 * last-bit differences between this double inv and the library's). cos and
 * sin move by at most the angle error; their fp32 rounding, the fp32 attention
 * factor and its product add <= 3 * 2^-24 < 1e-6 relative. Everything scales
 * with the attention factor m. Tables are used as given: only fp32 rounding.
 */
static inline double ref_cs_tol(const ref_rope *r, int32_t pos, int32_t i) {
  if (r->table) {
    double c, s;
    ref_cs(r, pos, i, &c, &s);
    return 1e-6 * (fabs(c) + fabs(s)) + 1e-30;
  }
  return fabs(r->attn) * ((double)pos * fabs(r->inv[i]) * 0x1p-22 + 1e-6);
}

/* Pair element indices of pair i. */
static inline void ref_pair(const ref_rope *r, int32_t i, int32_t *a, int32_t *b) {
  if (r->style == KVI_ROPE_NEOX) {
    *a = i;
    *b = i + r->rot / 2;
  } else {
    *a = 2 * i;
    *b = 2 * i + 1;
  }
}

/* Rotates x (D values) at pos into y, in double; elements past rot copied. */
static inline void ref_rotate(const ref_rope *r, const float *x, int32_t D, int32_t pos, double *y) {
  for (int32_t d = 0; d < D; d++) y[d] = (double)x[d];
  if (r->style == KVI_ROPE_NONE) return;
  for (int32_t i = 0; i < r->rot / 2; i++) {
    int32_t a, b;
    ref_pair(r, i, &a, &b);
    double c, s;
    ref_cs(r, pos, i, &c, &s);
    y[a] = (double)x[a] * c - (double)x[b] * s;
    y[b] = (double)x[b] * c + (double)x[a] * s;
  }
}

/*
 * Bound on |library rotation - reference| per output element, for an input
 * pair of magnitude rin. Forward: the output pair moves by at most rin times
 * the norm of the (cos, sin) error (m * angle error + rounding), plus the fp32
 * products and sum of the rotation (3 * 2^-24 * m * rin): together below
 * m * rin * (pos * inv * 2^-22 + 4e-6). The inverse (capture) divides by
 * cos^2 + sin^2 = m^2, so its bound is the same without m.
 */
static inline double ref_rot_tol(const ref_rope *r, int32_t pos, int32_t i, double rin, bool inverse) {
  if (r->style == KVI_ROPE_NONE) return 0.0;
  if (r->table) {
    double c, s;
    ref_cs(r, pos, i, &c, &s);
    return rin * 4e-6 * (inverse ? 1.0 : hypot(c, s)) + 1e-30;
  }
  const double m = inverse ? 1.0 : fabs(r->attn);
  return m * rin * ((double)pos * fabs(r->inv[i]) * 0x1p-22 + 4e-6);
}

/* Per-element tolerance vector for a rotation of x at pos. */
static inline void ref_rot_tols(const ref_rope *r, const float *x, int32_t D, int32_t pos, bool inverse, double *tol) {
  for (int32_t d = 0; d < D; d++) tol[d] = 0.0;
  if (r->style == KVI_ROPE_NONE) return;
  for (int32_t i = 0; i < r->rot / 2; i++) {
    int32_t a, b;
    ref_pair(r, i, &a, &b);
    const double rin = hypot((double)x[a], (double)x[b]);
    tol[a] = tol[b] = ref_rot_tol(r, pos, i, rin, inverse);
  }
}

/* ------------------------------------------------------------------------ */
/* fp8 reference (by table)                                                  */
/* ------------------------------------------------------------------------ */

/* Decodes an fp8 code from its bit fields (NaN for NaN codes, inf for e5m2's
 * infinities). */
static inline double ref_fp8_decode(uint8_t c, kvi_dtype t) {
  const double sign = (c & 0x80) ? -1.0 : 1.0;
  if (t == KVI_DTYPE_FP8_E4M3) {
    const int e = (c >> 3) & 0xf, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) return sign * (double)m / 8.0 * 0x1p-6;
    return sign * (1.0 + (double)m / 8.0) * ldexp(1.0, e - 7);
  }
  const int e = (c >> 2) & 0x1f, m = c & 3;
  if (e == 31) return m ? NAN : sign * INFINITY;
  if (e == 0) return sign * (double)m / 4.0 * 0x1p-14;
  return sign * (1.0 + (double)m / 4.0) * ldexp(1.0, e - 15);
}

static inline uint8_t ref_fp8_max_code(kvi_dtype t) { return t == KVI_DTYPE_FP8_E4M3 ? 0x7e : 0x7b; }

/* Whether a code is NaN or infinite. */
static inline bool ref_fp8_nonfinite(uint8_t c, kvi_dtype t) { return !isfinite(ref_fp8_decode(c, t)); }

/* Rounds x (a float) to the nearest finite fp8 code, ties to the even code,
 * saturating beyond the largest finite value (vLLM's __NV_SATFINITE). */
static inline uint8_t ref_fp8_encode(float x, kvi_dtype t) {
  const uint8_t maxc = ref_fp8_max_code(t);
  const uint8_t sign = signbit(x) ? 0x80 : 0;
  const double a = fabs((double)x);
  /* the non-negative finite codes 0..maxc have increasing values */
  if (a >= ref_fp8_decode(maxc, t)) return sign | maxc;
  int lo = 0, hi = maxc; /* value(lo) <= a < value(hi) */
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (ref_fp8_decode((uint8_t)mid, t) <= a) lo = mid;
    else hi = mid;
  }
  const double dlo = a - ref_fp8_decode((uint8_t)lo, t), dhi = ref_fp8_decode((uint8_t)hi, t) - a;
  int c = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return (uint8_t)(sign | c);
}

/* Half the spacing of fp8 codes around |x| (x in the scaled domain), i.e. the
 * largest rounding error; at least the subnormal half step. */
static inline double ref_fp8_half_step(double x, kvi_dtype t) {
  const int mbits = t == KVI_DTYPE_FP8_E4M3 ? 3 : 2, emin = t == KVI_DTYPE_FP8_E4M3 ? -6 : -14;
  int e;
  frexp(fabs(x) * (1.0 + 1.0 / 16.0), &e); /* a little up: the spacing above */
  e -= 1;
  if (e < emin) e = emin;
  return ldexp(1.0, e - mbits - 1);
}

/* ------------------------------------------------------------------------ */
/* cache element references                                                  */
/* ------------------------------------------------------------------------ */

static inline bool is_fp8(kvi_dtype t) { return t == KVI_DTYPE_FP8_E4M3 || t == KVI_DTYPE_FP8_E5M2; }

static inline const char *cache_dtype_name(kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP8_E4M3: return "fp8_e4m3";
  case KVI_DTYPE_FP8_E5M2: return "fp8_e5m2";
  default: return dtype_name(t);
  }
}

/* Writes the cache encoding of the fp32 value x (fp8: x / scale in fp32,
 * then rounded) to dst. */
static inline void ref_encode(unsigned char *dst, kvi_dtype t, float x, float scale) {
  if (is_fp8(t)) {
    const float q = x / scale;
    dst[0] = ref_fp8_encode(q, t);
    return;
  }
  const uint32_t bits = ref_bits(x, t);
  if (t == KVI_DTYPE_FP32) memcpy(dst, &bits, 4);
  else {
    const uint16_t h = (uint16_t)bits;
    memcpy(dst, &h, 2);
  }
}

/* The value an element of the cache stands for (fp8: code * scale in fp32). */
static inline float ref_decode(const unsigned char *src, kvi_dtype t, float scale) {
  if (is_fp8(t)) return (float)ref_fp8_decode(src[0], t) * scale;
  uint16_t h;
  switch (t) {
  case KVI_DTYPE_FP32: {
    float f;
    memcpy(&f, src, 4);
    return f;
  }
  case KVI_DTYPE_FP16: memcpy(&h, src, 2); return ref_f16_to_f32(h);
  case KVI_DTYPE_BF16: memcpy(&h, src, 2); return ref_bf16_to_f32(h);
  default: fail_msg("ref_decode: dtype %d", (int)t);
  }
  return 0.0f;
}

/* Largest distance between y and the cache's encoding of a fp32 value within
 * a hair of y (one full step of the dtype at |y|, the encoding of the
 * library's fp32 value may round the other way). */
static inline double ref_quant_tol(kvi_dtype t, double y, float scale) {
  int e;
  frexp(fabs(y) * (1.0 + 1.0 / 64.0), &e);
  e -= 1; /* |y| in [2^e, 2^(e+1)) */
  switch (t) {
  case KVI_DTYPE_FP32: return ldexp(1.0, e - 22);
  case KVI_DTYPE_FP16: return ldexp(1.0, (e < -14 ? -14 : e) - 10);
  case KVI_DTYPE_BF16: return ldexp(1.0, e - 7);
  case KVI_DTYPE_FP8_E4M3:
  case KVI_DTYPE_FP8_E5M2: return 2.0 * ref_fp8_half_step(y / scale, t) * scale;
  default: fail_msg("ref_quant_tol: dtype %d", (int)t);
  }
  return 0.0;
}

/* ------------------------------------------------------------------------ */
/* engine caches, indexed by the engine's own tensor shapes                  */
/* ------------------------------------------------------------------------ */

#define EC_MAXL 4
#define EC_MAXH 4

typedef struct ecache {
  kvi_cache_preset preset;
  kvi_dtype dt;
  int32_t L, H, D, BS;
  int64_t NB;
  int nbuf;
  unsigned char *buf[2 * EC_MAXL];
  size_t bytes[2 * EC_MAXL];
  void *kl[EC_MAXL], *vl[EC_MAXL];
  float ks[EC_MAXL * EC_MAXH], vs[EC_MAXL * EC_MAXH];
  kvi_scale_mode sm;
  kvi_cache_layout lay;
} ecache;

#define POISON 0x7f

/* Hand-made layouts for the generic descriptor (not presets). */
enum {
  EC_GENERIC_KV_BASES = 101, /* K and V tensors [L][NB][H][BS][D+3] with a gap between layers: k_base, v_base, layer_stride */
  EC_GENERIC_V_OFFSET,       /* per layer [NB][BS][2][H][D]: k_layers, V = K + v_offset */
  EC_GENERIC_POOL,           /* one pool [L][2][NB][BS][H][D]: k_base, layer_stride, V = kbase(l) + v_offset */
  EC_GENERIC_GAPS,           /* per layer K and V [NB][BS+1][H][D] (a spare row per block): k_layers, v_layers */
  EC_GENERIC_VT,             /* transposed V (llama.cpp's state, flash attention off): per layer one tensor holding
                                K [cells][H][D] then V [H][D][cells], cells = NB * BS: k_layers, V = K + v_offset,
                                V's own strides */
  EC_GENERIC_MIXED           /* per layer K [NB][BS][H][D] and V [NB][H][BS][D] (contiguous head vectors, V's own
                                token and head strides): k_layers, v_layers */
};

/* Row-major linear index of idx in a tensor of the given shape. */
static inline int64_t lin(int n, const int64_t *shape, const int64_t *idx) {
  int64_t o = 0;
  for (int i = 0; i < n; i++) {
    assert_true(idx[i] >= 0 && idx[i] < shape[i]);
    o = o * shape[i] + idx[i];
  }
  return o;
}

static inline const char *preset_name(kvi_cache_preset p) {
  switch (p) {
  case KVI_CACHE_VLLM_FLASH_ATTN: return "vllm-flash-attn [2,NB,BS,H,D]";
  case KVI_CACHE_VLLM_FLASH_ATTN_HND: return "vllm-flash-attn-hnd [2,NB,H,BS,D]";
  case KVI_CACHE_VLLM_FLASHINFER: return "vllm-flashinfer [NB,2,BS,H,D]";
  case KVI_CACHE_VLLM_FLASHINFER_HND: return "vllm-flashinfer-hnd [NB,2,H,BS,D]";
  case KVI_CACHE_VLLM_PACKED: return "vllm-packed [NB,BS,H,2D]";
  case KVI_CACHE_VLLM_PACKED_HND: return "vllm-packed-hnd [NB,H,BS,2D]";
  case KVI_CACHE_SGLANG: return "sglang k/v_buffer [slots,H,D]";
  case KVI_CACHE_TRTLLM: return "trtllm pool [NB,L,2,H,BS,D]";
  case KVI_CACHE_HF_CONTIGUOUS: return "hf key/value [B,H,S,D]";
  case KVI_CACHE_VLLM_CPU: return "vllm-cpu [NB,H,{K [D,BS], V [BS,D]}]";
  }
  switch ((int)p) {
  case EC_GENERIC_KV_BASES: return "generic k_base/v_base + layer_stride [L][NB][H][BS][D+3]";
  case EC_GENERIC_V_OFFSET: return "generic k_layers + v_offset [NB][BS][2][H][D]";
  case EC_GENERIC_POOL: return "generic pool k_base + layer_stride + v_offset [L][2][NB][BS][H][D]";
  case EC_GENERIC_GAPS: return "generic k_layers/v_layers [NB][BS+1][H][D]";
  case EC_GENERIC_VT: return "generic transposed V: K [cells][H][D] + V [H][D][cells]";
  case EC_GENERIC_MIXED: return "generic K [NB][BS][H][D], V [NB][H][BS][D]";
  }
  return "?";
}

/* Elements per layer of EC_GENERIC_KV_BASES, with a 5-element gap. */
static inline int64_t ec_generic_ls(const ecache *c) {
  return c->NB * c->H * c->BS * (int64_t)(c->D + 3) + 5;
}

/* The descriptor of a hand-made layout, written from its shape. */
static inline void ec_generic_layout(ecache *c) {
  const int64_t NB = c->NB, BS = c->BS, H = c->H, D = c->D;
  kvi_cache_layout_init(&c->lay, sizeof c->lay);
  c->lay.dtype = c->dt;
  c->lay.num_layers = c->L;
  c->lay.num_heads = c->H;
  c->lay.head_size = c->D;
  c->lay.block_size = c->BS;
  c->lay.num_blocks = c->NB;
  switch ((int)c->preset) {
  case EC_GENERIC_KV_BASES: /* [L][NB][H][BS][D+3] + gap */
    c->lay.block_stride = H * BS * (D + 3), c->lay.token_stride = D + 3, c->lay.head_stride = BS * (D + 3);
    c->lay.layer_stride = ec_generic_ls(c);
    c->lay.k_base = c->buf[0];
    c->lay.v_base = c->buf[1];
    break;
  case EC_GENERIC_V_OFFSET: /* [NB][BS][2][H][D] */
    for (int l = 0; l < c->L; l++) c->kl[l] = c->buf[l];
    c->lay.block_stride = BS * 2 * H * D, c->lay.token_stride = 2 * H * D, c->lay.head_stride = D;
    c->lay.v_offset = H * D;
    c->lay.k_layers = c->kl;
    break;
  case EC_GENERIC_POOL: /* [L][2][NB][BS][H][D] */
    c->lay.block_stride = BS * H * D, c->lay.token_stride = H * D, c->lay.head_stride = D;
    c->lay.layer_stride = 2 * NB * BS * H * D;
    c->lay.v_offset = NB * BS * H * D;
    c->lay.k_base = c->buf[0];
    break;
  case EC_GENERIC_GAPS: /* [NB][BS+1][H][D] */
    for (int l = 0; l < c->L; l++) c->kl[l] = c->buf[2 * l], c->vl[l] = c->buf[2 * l + 1];
    c->lay.block_stride = (BS + 1) * H * D, c->lay.token_stride = H * D, c->lay.head_stride = D;
    c->lay.k_layers = c->kl;
    c->lay.v_layers = c->vl;
    break;
  case EC_GENERIC_VT: { /* K [cells][H][D], then V [H][D][cells] */
    const int64_t cells = NB * BS;
    for (int l = 0; l < c->L; l++) c->kl[l] = c->buf[l];
    c->lay.block_stride = BS * H * D, c->lay.token_stride = H * D, c->lay.head_stride = D;
    c->lay.v_offset = cells * H * D;
    c->lay.v_block_stride = BS, c->lay.v_token_stride = 1, c->lay.v_head_stride = D * cells, c->lay.v_dim_stride = cells;
    c->lay.k_layers = c->kl;
    break;
  }
  case EC_GENERIC_MIXED: /* K [NB][BS][H][D], V [NB][H][BS][D] */
    for (int l = 0; l < c->L; l++) c->kl[l] = c->buf[2 * l], c->vl[l] = c->buf[2 * l + 1];
    c->lay.block_stride = BS * H * D, c->lay.token_stride = H * D, c->lay.head_stride = D;
    c->lay.v_token_stride = D, c->lay.v_head_stride = BS * D; /* V's block stride: K's (0) */
    c->lay.k_layers = c->kl;
    c->lay.v_layers = c->vl;
    break;
  default: fail_msg("ec_generic_layout: %d", (int)c->preset);
  }
}

/* Allocates the engine's tensors for a preset (poisoned), fills the layout
 * with kvi_cache_layout_preset, memory HOST, and scales (random in
 * [0.05, 2]) for fp8 with mode sm. */
static inline void ec_make(ecache *c, kvi_cache_preset p, kvi_dtype dt, int32_t L, int32_t H, int32_t D, int32_t BS,
                           int64_t NB, kvi_scale_mode sm, rng *r) {
  memset(c, 0, sizeof *c);
  assert_true(L <= EC_MAXL && H <= EC_MAXH);
  c->preset = p, c->dt = dt, c->L = L, c->H = H, c->D = D, c->BS = BS, c->NB = NB, c->sm = sm;
  const size_t es = kvi_dtype_size(dt);
  const size_t plane = (size_t)NB * (size_t)BS * (size_t)H * (size_t)D; /* K or V of one layer */
  switch (p) {
  case KVI_CACHE_VLLM_FLASH_ATTN:
  case KVI_CACHE_VLLM_FLASH_ATTN_HND:
  case KVI_CACHE_VLLM_FLASHINFER:
  case KVI_CACHE_VLLM_FLASHINFER_HND:
  case KVI_CACHE_VLLM_PACKED:
  case KVI_CACHE_VLLM_PACKED_HND:
  case KVI_CACHE_VLLM_CPU:
    c->nbuf = L;
    for (int l = 0; l < L; l++) c->bytes[l] = 2 * plane * es;
    break;
  case KVI_CACHE_SGLANG:
  case KVI_CACHE_HF_CONTIGUOUS:
    c->nbuf = 2 * L;
    for (int i = 0; i < 2 * L; i++) c->bytes[i] = plane * es;
    break;
  case KVI_CACHE_TRTLLM:
    c->nbuf = 1;
    c->bytes[0] = 2 * plane * (size_t)L * es;
    break;
  default:
    switch ((int)p) {
    case EC_GENERIC_KV_BASES:
      c->nbuf = 2;
      c->bytes[0] = c->bytes[1] = (size_t)ec_generic_ls(c) * (size_t)L * es;
      break;
    case EC_GENERIC_V_OFFSET:
    case EC_GENERIC_VT:
      c->nbuf = L;
      for (int l = 0; l < L; l++) c->bytes[l] = 2 * plane * es;
      break;
    case EC_GENERIC_POOL:
      c->nbuf = 1;
      c->bytes[0] = 2 * plane * (size_t)L * es;
      break;
    case EC_GENERIC_GAPS:
      c->nbuf = 2 * L;
      for (int i = 0; i < 2 * L; i++) c->bytes[i] = (size_t)NB * (size_t)(BS + 1) * (size_t)H * (size_t)D * es;
      break;
    case EC_GENERIC_MIXED:
      c->nbuf = 2 * L;
      for (int i = 0; i < 2 * L; i++) c->bytes[i] = plane * es;
      break;
    default: fail_msg("ec_make: preset %d", (int)p);
    }
  }
  for (int i = 0; i < c->nbuf; i++) {
    c->buf[i] = malloc(c->bytes[i]);
    assert_non_null(c->buf[i]);
    memset(c->buf[i], POISON, c->bytes[i]);
  }
  if ((int)p >= EC_GENERIC_KV_BASES) {
    ec_generic_layout(c);
  } else {
    void *base = NULL;
    if (p == KVI_CACHE_TRTLLM) base = c->buf[0];
    else if (p == KVI_CACHE_SGLANG || p == KVI_CACHE_HF_CONTIGUOUS)
      for (int l = 0; l < L; l++) c->kl[l] = c->buf[2 * l], c->vl[l] = c->buf[2 * l + 1];
    else
      for (int l = 0; l < L; l++) c->kl[l] = c->buf[l];
    assert_ok(kvi_cache_layout_preset(&c->lay, p, dt, L, H, D, BS, NB, p == KVI_CACHE_TRTLLM ? NULL : c->kl,
                                      (p == KVI_CACHE_SGLANG || p == KVI_CACHE_HF_CONTIGUOUS) ? c->vl : NULL, base));
  }
  c->lay.memory = KVI_MEMORY_HOST;
  for (int i = 0; i < L * H; i++) c->ks[i] = c->vs[i] = 1.0f;
  if (is_fp8(dt) && sm != KVI_SCALE_NONE) {
    const int n = sm == KVI_SCALE_PER_TENSOR ? L : L * H;
    for (int i = 0; i < n; i++) {
      c->ks[i] = (float)(0.05 + 1.95 * (double)(rng_next(r) >> 11) * 0x1p-53);
      c->vs[i] = (float)(0.05 + 1.95 * (double)(rng_next(r) >> 11) * 0x1p-53);
    }
    c->lay.scale_mode = sm;
    c->lay.k_scales = c->ks;
    c->lay.v_scales = c->vs;
  }
}

static inline void ec_free(ecache *c) {
  for (int i = 0; i < c->nbuf; i++) free(c->buf[i]);
  memset(c, 0, sizeof *c);
}

/* Address of element (kv, layer, block, token-in-block, head, dim), from the
 * engine's shape. *which receives the buffer index. */
static inline unsigned char *ec_elem(const ecache *c, int kv, int l, int64_t b, int t, int h, int d, int *which) {
  const int64_t NB = c->NB, BS = c->BS, H = c->H, D = c->D, L = c->L;
  int w = 0;
  int64_t o = 0;
  switch (c->preset) {
  case KVI_CACHE_VLLM_FLASH_ATTN: {
    const int64_t s[] = {2, NB, BS, H, D}, i[] = {kv, b, t, h, d};
    w = l, o = lin(5, s, i);
    break;
  }
  case KVI_CACHE_VLLM_FLASH_ATTN_HND: {
    const int64_t s[] = {2, NB, H, BS, D}, i[] = {kv, b, h, t, d};
    w = l, o = lin(5, s, i);
    break;
  }
  case KVI_CACHE_VLLM_FLASHINFER: {
    const int64_t s[] = {NB, 2, BS, H, D}, i[] = {b, kv, t, h, d};
    w = l, o = lin(5, s, i);
    break;
  }
  case KVI_CACHE_VLLM_FLASHINFER_HND: {
    const int64_t s[] = {NB, 2, H, BS, D}, i[] = {b, kv, h, t, d};
    w = l, o = lin(5, s, i);
    break;
  }
  case KVI_CACHE_VLLM_PACKED: {
    const int64_t s[] = {NB, BS, H, 2 * D}, i[] = {b, t, h, kv * D + d};
    w = l, o = lin(4, s, i);
    break;
  }
  case KVI_CACHE_VLLM_PACKED_HND: {
    const int64_t s[] = {NB, H, BS, 2 * D}, i[] = {b, h, t, kv * D + d};
    w = l, o = lin(4, s, i);
    break;
  }
  case KVI_CACHE_SGLANG: {
    const int64_t s[] = {NB * BS, H, D}, i[] = {b * BS + t, h, d};
    w = 2 * l + kv, o = lin(3, s, i);
    break;
  }
  case KVI_CACHE_TRTLLM: {
    const int64_t s[] = {NB, L, 2, H, BS, D}, i[] = {b, l, kv, h, t, d};
    w = 0, o = lin(6, s, i);
    break;
  }
  case KVI_CACHE_HF_CONTIGUOUS: {
    const int64_t s[] = {NB, H, BS, D}, i[] = {b, h, t, d};
    w = 2 * l + kv, o = lin(4, s, i);
    break;
  }
  case KVI_CACHE_VLLM_CPU: { /* per (block, head): K [D][BS], then V [BS][D] */
    const int64_t s[] = {NB, H, 2, BS * D}, i[] = {b, h, kv, kv ? t * D + d : d * BS + t};
    w = l, o = lin(4, s, i);
    break;
  }
  default:
    switch ((int)c->preset) {
    case EC_GENERIC_KV_BASES: {
      const int64_t s[] = {NB, H, BS, D + 3}, i[] = {b, h, t, d};
      w = kv, o = l * ec_generic_ls(c) + lin(4, s, i);
      break;
    }
    case EC_GENERIC_V_OFFSET: {
      const int64_t s[] = {NB, BS, 2, H, D}, i[] = {b, t, kv, h, d};
      w = l, o = lin(5, s, i);
      break;
    }
    case EC_GENERIC_POOL: {
      const int64_t s[] = {L, 2, NB, BS, H, D}, i[] = {l, kv, b, t, h, d};
      w = 0, o = lin(6, s, i);
      break;
    }
    case EC_GENERIC_GAPS: {
      const int64_t s[] = {NB, BS + 1, H, D}, i[] = {b, t, h, d};
      w = 2 * l + kv, o = lin(4, s, i);
      break;
    }
    case EC_GENERIC_VT: { /* [2][...]: K [cells][H][D], V [H][D][cells] */
      const int64_t cells = NB * BS;
      const int64_t s[] = {2, cells * H * D}, i[] = {kv, kv ? (h * D + d) * cells + b * BS + t : (b * BS + t) * H * D + h * D + d};
      w = l, o = lin(2, s, i);
      break;
    }
    case EC_GENERIC_MIXED: {
      const int64_t s[] = {NB, BS, H, D}, i[] = {b, t, h, d}, sv[] = {NB, H, BS, D}, iv[] = {b, h, t, d};
      w = 2 * l + kv, o = kv ? lin(4, sv, iv) : lin(4, s, i);
      break;
    }
    default: fail_msg("ec_elem: preset %d", (int)c->preset);
    }
  }
  if (which) *which = w;
  return c->buf[w] + (size_t)o * kvi_dtype_size(c->dt);
}

static inline float ec_scale(const ecache *c, int kv, int l, int h) {
  if (c->sm == KVI_SCALE_NONE) return 1.0f;
  const int i = c->sm == KVI_SCALE_PER_TENSOR ? l : l * c->H + h;
  return kv ? c->vs[i] : c->ks[i];
}

static inline uint64_t ec_hash(const ecache *c) {
  uint64_t h = FNV_INIT;
  for (int i = 0; i < c->nbuf; i++) h = fnv1a(h, c->buf[i], c->bytes[i]);
  return h;
}

static inline void ec_poison(ecache *c) {
  for (int i = 0; i < c->nbuf; i++) memset(c->buf[i], POISON, c->bytes[i]);
}

/* Byte masks over the buffers: which bytes the test expects written. */
typedef struct ecmask {
  unsigned char *m[2 * EC_MAXL];
  int n;
} ecmask;

static inline void ecmask_make(ecmask *k, const ecache *c) {
  k->n = c->nbuf;
  for (int i = 0; i < c->nbuf; i++) {
    k->m[i] = calloc(c->bytes[i], 1);
    assert_non_null(k->m[i]);
  }
}

static inline void ecmask_free(ecmask *k) {
  for (int i = 0; i < k->n; i++) free(k->m[i]);
}

static inline void ecmask_set(ecmask *k, const ecache *c, int which, const unsigned char *p) {
  const size_t off = (size_t)(p - c->buf[which]);
  for (size_t j = 0; j < kvi_dtype_size(c->dt); j++) {
    if (k->m[which][off + j]) fail_msg("test bug: element written twice (buffer %d byte %zu)", which, off + j);
    k->m[which][off + j] = 1;
  }
}

/* Every byte outside the mask is still poison. */
static inline void ecmask_check_poison(const ecmask *k, const ecache *c, const char *what) {
  for (int i = 0; i < c->nbuf; i++)
    for (size_t j = 0; j < c->bytes[i]; j++)
      if (!k->m[i][j] && c->buf[i][j] != POISON)
        fail_msg("%s: byte %zu of buffer %d (element %zu) was written but no injected token lives there", what, j, i,
                 j / kvi_dtype_size(c->dt));
}

/* ------------------------------------------------------------------------ */
/* facts                                                                     */
/* ------------------------------------------------------------------------ */

typedef struct rfact {
  uint64_t tenant, id;
  int32_t L, T, H, D;
  float *k, *v; /* [L][T][H][D] */
} rfact;

static inline void rfact_make(rfact *f, rng *r, uint64_t tenant, uint64_t id, int32_t L, int32_t T, int32_t H,
                              int32_t D, int lo_exp, int hi_exp) {
  f->tenant = tenant, f->id = id, f->L = L, f->T = T, f->H = H, f->D = D;
  const size_t n = (size_t)L * T * H * D;
  f->k = malloc(n * sizeof(float));
  f->v = malloc(n * sizeof(float));
  assert_non_null(f->k);
  assert_non_null(f->v);
  for (size_t i = 0; i < n; i++) f->k[i] = rand_val(r, lo_exp, hi_exp), f->v[i] = rand_val(r, lo_exp, hi_exp);
}

static inline void rfact_free(rfact *f) {
  free(f->k);
  free(f->v);
  f->k = f->v = NULL;
}

static inline float *rfact_row(const rfact *f, int kv, int l, int t, int h) {
  return (kv ? f->v : f->k) + (((size_t)l * f->T + t) * f->H + h) * f->D;
}

static inline void rfact_put(kvi_store *s, const rfact *f, uint32_t flags) {
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, f->L, f->T, f->H, f->D, f->k, f->v);
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.flags = flags;
  assert_ok(kvi_store_put(s, f->tenant, f->id, &v, &o, NULL));
}

/* Reads a stored fact into a fresh fp32 rfact. */
static inline void rfact_read(const kvi_store *s, uint64_t tenant, uint64_t id, int32_t L, int32_t H, int32_t D,
                              rfact *out) {
  int32_t T = 0;
  assert_ok(kvi_store_fact_tokens(s, tenant, id, &T));
  out->tenant = tenant, out->id = id, out->L = L, out->T = T, out->H = H, out->D = D;
  const size_t n = (size_t)L * T * H * D;
  out->k = malloc(n * sizeof(float));
  out->v = malloc(n * sizeof(float));
  assert_non_null(out->k);
  assert_non_null(out->v);
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, out->k, out->v);
  assert_ok(kvi_store_read(s, tenant, id, &v, NULL));
}

/* ------------------------------------------------------------------------ */
/* checks of a cache after injection and of a fact after capture             */
/* ------------------------------------------------------------------------ */

/*
 * Checks what one request wrote: its facts back to back from first_slot on,
 * through its block table, at `positions` (or start_position + i), layers
 * [lb, le). K of rotated dims: within the rotation bound plus one step of the
 * cache dtype; K of unrotated dims and NoPE layers, and V: bit-exact encodings
 * (fp8: x / scale rounded to nearest even, saturated). Marks the elements in
 * `mask` (may be NULL).
 */
static inline void ec_check_request(const ecache *c, const ref_rope *rr, const rfact *const *facts, int nfacts,
                                    const int32_t *table, int64_t first_slot, const int32_t *positions,
                                    int32_t start_position, int lb, int le, double extra_rel, ecmask *mask,
                                    const char *what) {
  const int32_t D = c->D;
  const size_t es = kvi_dtype_size(c->dt);
  double *y = malloc((size_t)D * sizeof *y), *tol = malloc((size_t)D * sizeof *tol);
  assert_non_null(y);
  assert_non_null(tol);
  int64_t j = 0;
  for (int fi = 0; fi < nfacts; fi++) {
    const rfact *f = facts[fi];
    for (int32_t t = 0; t < f->T; t++, j++) {
      const int64_t slot = first_slot + j;
      const int64_t b = table[slot / c->BS];
      const int tt = (int)(slot % c->BS);
      const int32_t pos = positions ? positions[j] : start_position + (int32_t)j;
      for (int l = lb; l < le; l++)
        for (int h = 0; h < c->H; h++)
          for (int kv = 0; kv < 2; kv++) {
            const float *x = rfact_row(f, kv, l, t, h);
            const float sc = ec_scale(c, kv, l, h);
            const bool rotated = kv == 0 && rr[l].style != KVI_ROPE_NONE;
            if (rotated) {
              ref_rotate(&rr[l], x, D, pos, y);
              ref_rot_tols(&rr[l], x, D, pos, false, tol);
              /* extra_rel: a relative error of the fact's K itself (e.g. a capture into a bf16 store) */
              for (int32_t i = 0; i < rr[l].rot / 2 && extra_rel > 0; i++) {
                int32_t ea, eb;
                ref_pair(&rr[l], i, &ea, &eb);
                double cs, sn;
                ref_cs(&rr[l], pos, i, &cs, &sn);
                const double add = extra_rel * hypot(cs, sn) * hypot((double)x[ea], (double)x[eb]);
                tol[ea] += add, tol[eb] += add;
              }
            }
            for (int d = 0; d < D; d++) {
              int w;
              unsigned char *p = ec_elem(c, kv, l, b, tt, h, d, &w);
              if (mask) ecmask_set(mask, c, w, p);
              if (!rotated || d >= rr[l].rot) {
                unsigned char want[4];
                ref_encode(want, c->dt, x[d], sc);
                if (memcmp(want, p, es) != 0)
                  fail_msg("%s: fact %llu/%llu token %d (slot %lld, block %lld, row %d, position %d) layer %d head %d "
                           "%s[%d]: cache holds %a, expected the %s encoding of %a (scale %g) = %a",
                           what, (unsigned long long)f->tenant, (unsigned long long)f->id, t, (long long)slot,
                           (long long)b, tt, pos, l, h, kv ? "V" : "K", d, (double)ref_decode(p, c->dt, sc),
                           cache_dtype_name(c->dt), (double)x[d], (double)sc, (double)ref_decode(want, c->dt, sc));
              } else {
                const float got = ref_decode(p, c->dt, sc);
                const double lim = tol[d] + ref_quant_tol(c->dt, y[d], sc);
                if (!(fabs((double)got - y[d]) <= lim))
                  fail_msg("%s: fact %llu/%llu token %d (slot %lld, block %lld, row %d, position %d) layer %d head %d "
                           "K[%d]: cache holds %.9g, expected %.9g rotated (pre-RoPE %.9g), |diff| %.3g > %.3g (%s)",
                           what, (unsigned long long)f->tenant, (unsigned long long)f->id, t, (long long)slot,
                           (long long)b, tt, pos, l, h, d, (double)got, y[d], (double)x[d], fabs((double)got - y[d]),
                           lim, cache_dtype_name(c->dt));
              }
            }
          }
    }
  }
  free(y);
  free(tol);
}

/*
 * Checks a captured fact `got` against tokens [t0, t0 + got->T) of `orig`,
 * which the cache held rotated at `positions` (or start_position + i) and
 * encoded in the cache's dtype with its scales; the store keeps store_dt.
 * V and unrotated K: exactly the decoded encoding rounded to store_dt.
 * Rotated K: the pair's encoding error (one step of the dtype each) divided
 * by the attention factor, plus the rotation bounds, plus one step of
 * store_dt.
 */
static inline void check_captured(const rfact *got, const rfact *orig, int32_t t0, const ref_rope *rr,
                                  const ecache *c, const int32_t *positions, int32_t start_position,
                                  kvi_dtype store_dt, const char *what) {
  const int32_t D = got->D;
  double *y = malloc((size_t)D * sizeof *y);
  assert_non_null(y);
  for (int32_t t = 0; t < got->T; t++) {
    const int32_t pos = positions ? positions[t] : start_position + t;
    for (int l = 0; l < got->L; l++)
      for (int h = 0; h < got->H; h++)
        for (int kv = 0; kv < 2; kv++) {
          const float *x = rfact_row(orig, kv, l, t0 + t, h);
          const float *g = rfact_row(got, kv, l, t, h);
          const float sc = ec_scale(c, kv, l, h);
          const bool rotated = kv == 0 && rr[l].style != KVI_ROPE_NONE;
          if (rotated) ref_rotate(&rr[l], x, D, pos, y);
          for (int d = 0; d < D; d++) {
            if (!rotated || d >= rr[l].rot) {
              unsigned char enc[4];
              ref_encode(enc, c->dt, x[d], sc);
              const float want = ref_round(ref_decode(enc, c->dt, sc), store_dt);
              if (f2u(want) != f2u(g[d]))
                fail_msg("%s: captured fact %llu token %d layer %d head %d %s[%d] is %a, expected %a (%a through the %s "
                         "cache, scale %g)",
                         what, (unsigned long long)got->id, t, l, h, kv ? "V" : "K", d, (double)g[d], (double)want,
                         (double)x[d], cache_dtype_name(c->dt), (double)sc);
            }
          }
          if (!rotated) continue;
          for (int32_t i = 0; i < rr[l].rot / 2; i++) {
            int32_t a, b;
            ref_pair(&rr[l], i, &a, &b);
            double cs, sn;
            ref_cs(&rr[l], pos, i, &cs, &sn);
            const double m = hypot(cs, sn), rin = hypot((double)x[a], (double)x[b]);
            const double lim = (ref_quant_tol(c->dt, y[a], sc) + ref_quant_tol(c->dt, y[b], sc) +
                                2.0 * ref_rot_tol(&rr[l], pos, i, rin, false)) / m +
                               ref_rot_tol(&rr[l], pos, i, rin, true);
            const int32_t e[2] = {a, b};
            for (int k = 0; k < 2; k++)
              if (!(fabs((double)g[e[k]] - (double)x[e[k]]) <= lim + ref_quant_tol(store_dt, x[e[k]], 1.0f)))
                fail_msg("%s: captured fact %llu token %d (position %d) layer %d head %d K[%d] is %.9g, expected "
                         "%.9g, |diff| %.3g > %.3g (%s cache)",
                         what, (unsigned long long)got->id, t, pos, l, h, e[k], (double)g[e[k]], (double)x[e[k]],
                         fabs((double)g[e[k]] - (double)x[e[k]]), lim, cache_dtype_name(c->dt));
          }
        }
  }
  free(y);
}

#endif /* KVI_REF64_H */
