/*
 * Helpers shared by the unit suites: status assertions, a seeded RNG, an
 * independent reference for fp16/bf16 rounding, strided K/V buffers, the
 * model-and-store state of a suite, a monotonic clock and a file's size.
 * SPDX-License-Identifier: Apache-2.0
 *
 * The reference conversions here deliberately do not share code or method
 * with lib/base/convert.c: fp16 goes through the compiler's _Float16, bf16 picks
 * the nearer of the two bracketing bf16 values by comparing distances in
 * double precision.
 */
#ifndef KVI_UNIT_H
#define KVI_UNIT_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sys/stat.h>

#include <cmocka.h>

#include <kvinject.h>

/* ------------------------------------------------------------------------ */
/* assertions                                                               */
/* ------------------------------------------------------------------------ */

#define assert_status(expr, want)                                                                  \
  do {                                                                                             \
    const kvi_status got_ = (expr);                                                                \
    const kvi_status want_ = (want);                                                               \
    if (got_ != want_) {                                                                           \
      print_error("%s:%d: %s\n    returned %d (%s), expected %d (%s)\n    kvi_last_error: %s\n",  \
                  __FILE__, __LINE__, #expr, (int)got_, kvi_status_string(got_), (int)want_,      \
                  kvi_status_string(want_), kvi_last_error());                                     \
      fail();                                                                                      \
    }                                                                                              \
  } while (0)

#define assert_ok(expr) assert_status((expr), KVI_OK)

/* The thread's last error names the function and contains `needle`. */
#define assert_last_error_has(fn, needle)                                                          \
  do {                                                                                             \
    const char *e_ = kvi_last_error();                                                             \
    assert_non_null(e_);                                                                           \
    if (!strstr(e_, (fn)) || !strstr(e_, (needle))) {                                              \
      print_error("%s:%d: kvi_last_error() is \"%s\", expected it to contain \"%s\" and \"%s\"\n", \
                  __FILE__, __LINE__, e_, (fn), (needle));                                         \
      fail();                                                                                      \
    }                                                                                              \
  } while (0)

/* ------------------------------------------------------------------------ */
/* random numbers: a fresh seed per test, printed, KVI_TEST_SEED repeats it */
/* ------------------------------------------------------------------------ */

typedef struct rng {
  uint64_t s;
} rng;

static inline uint64_t rng_next(rng *r) { /* splitmix64 */
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static inline int64_t rng_range(rng *r, int64_t lo, int64_t hi) {
  return lo + (int64_t)(rng_next(r) % (uint64_t)(hi - lo + 1));
}

static inline uint64_t unit_seed(void) {
  static uint64_t counter;
  const char *env = getenv("KVI_TEST_SEED");
  if (env && *env) return strtoull(env, NULL, 0);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  counter++;
  return ((uint64_t)ts.tv_sec << 30) ^ (uint64_t)ts.tv_nsec ^ (counter * 0x9e3779b97f4a7c15ull);
}

static inline void rng_seed(rng *r, const char *test) {
  r->s = unit_seed();
  print_message("    %s: seed %llu (KVI_TEST_SEED=%llu repeats it)\n", test, (unsigned long long)r->s,
                (unsigned long long)r->s);
}

/* ------------------------------------------------------------------------ */
/* reference conversions                                                    */
/* ------------------------------------------------------------------------ */

static inline uint32_t f2u(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

static inline float u2f(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t ref_f32_to_f16(float f) {
  __extension__ _Float16 h = (_Float16)f;
  uint16_t b;
  memcpy(&b, &h, 2);
  return b;
}

static inline float ref_f16_to_f32(uint16_t b) {
  __extension__ _Float16 h;
  memcpy(&h, &b, 2);
  return (float)h;
}

static inline float ref_bf16_to_f32(uint16_t b) { return u2f((uint32_t)b << 16); }

/* Round to nearest, ties to even, by comparing the distances to the two bf16
 * values that bracket f (the one above the largest finite bf16 counts as
 * 2^128, as in IEEE rounding with an unbounded exponent). */
static inline uint16_t ref_f32_to_bf16(float f) {
  const uint32_t u = f2u(f);
  if (isnan(f)) return (uint16_t)((u >> 16) | 0x40u);
  if (isinf(f)) return (uint16_t)(u >> 16);
  const uint16_t lo = (uint16_t)(u >> 16); /* |lo| <= |f| */
  const uint16_t hi = (uint16_t)(lo + 1u); /* next bf16 away from zero */
  const double x = fabs((double)f);
  const double vlo = fabs((double)ref_bf16_to_f32(lo));
  const double vhi = (hi & 0x7fffu) == 0x7f80u ? ldexp(1.0, 128) : fabs((double)ref_bf16_to_f32(hi));
  const double dlo = x - vlo, dhi = vhi - x;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1u) ? hi : lo;
}

static inline float ref_load(const void *base, kvi_dtype t, int64_t i) {
  switch (t) {
  case KVI_DTYPE_FP32: return ((const float *)base)[i];
  case KVI_DTYPE_FP16: return ref_f16_to_f32(((const uint16_t *)base)[i]);
  case KVI_DTYPE_BF16: return ref_bf16_to_f32(((const uint16_t *)base)[i]);
  default: fail_msg("ref_load: dtype %d", (int)t);
  }
  return 0.0f;
}

/* Bits of x rounded to t (low 16 bits for fp16/bf16). */
static inline uint32_t ref_bits(float x, kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP32: return f2u(x);
  case KVI_DTYPE_FP16: return ref_f32_to_f16(x);
  case KVI_DTYPE_BF16: return ref_f32_to_bf16(x);
  default: fail_msg("ref_bits: dtype %d", (int)t);
  }
  return 0;
}

/* x rounded to t, as a float (exact). */
static inline float ref_round(float x, kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP32: return x;
  case KVI_DTYPE_FP16: return ref_f16_to_f32(ref_f32_to_f16(x));
  case KVI_DTYPE_BF16: return ref_bf16_to_f32(ref_f32_to_bf16(x));
  default: fail_msg("ref_round: dtype %d", (int)t);
  }
  return 0.0f;
}

static inline void ref_store_bits(void *base, kvi_dtype t, int64_t i, uint32_t bits) {
  if (t == KVI_DTYPE_FP32) memcpy((char *)base + i * 4, &bits, 4);
  else ((uint16_t *)base)[i] = (uint16_t)bits;
}

static inline uint32_t load_bits(const void *base, kvi_dtype t, int64_t i) {
  if (t == KVI_DTYPE_FP32) {
    uint32_t u;
    memcpy(&u, (const char *)base + i * 4, 4);
    return u;
  }
  return ((const uint16_t *)base)[i];
}

static inline const char *dtype_name(kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP32: return "fp32";
  case KVI_DTYPE_FP16: return "fp16";
  case KVI_DTYPE_BF16: return "bf16";
  default: return "?";
  }
}

static const kvi_dtype float_dtypes[3] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16};

/* A random non-zero finite float with a random 23-bit mantissa: mostly of
 * moderate size, sometimes in fp16's overflow or subnormal range. */
static inline float rand_float(rng *r) {
  const int e = rng_range(r, 0, 3) == 0 ? (int)rng_range(r, -30, 20) : (int)rng_range(r, -8, 8);
  const uint32_t m = (uint32_t)(rng_next(r) & 0x7fffffu);
  const float v = ldexpf(1.0f + (float)m * 0x1p-23f, e);
  return (rng_next(r) & 1u) ? -v : v;
}

/* Random non-zero finite element bits of dtype t. */
static inline uint32_t rand_bits(rng *r, kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP32: return f2u(rand_float(r));
  case KVI_DTYPE_FP16:
    for (;;) { /* exponent field 0..30: finite; excluding +-0 */
      const uint32_t b = (uint32_t)(rng_next(r) & 0xffffu);
      if ((b & 0x7c00u) != 0x7c00u && (b & 0x7fffu) != 0) return b;
    }
  case KVI_DTYPE_BF16: return ref_f32_to_bf16(rand_float(r));
  default: fail_msg("rand_bits: dtype %d", (int)t);
  }
  return 0;
}

/* ------------------------------------------------------------------------ */
/* strided K/V buffers                                                      */
/* ------------------------------------------------------------------------ */

typedef enum layout {
  LAYOUT_CONTIG = 0,     /* [L][T][H][D], V after K */
  LAYOUT_TOKEN_MAJOR,    /* [T][L][H][D] */
  LAYOUT_HEAD_MAJOR,     /* [L][H][T][D] */
  LAYOUT_PADDED,         /* head_stride > D, gaps between tokens and layers */
  LAYOUT_KV_INTERLEAVED, /* one [L][T][2][H][D] buffer: v = k + H*D */
  LAYOUT_DST_COUNT,      /* the layouts above can be destinations */
  LAYOUT_BCAST_TOKENS = LAYOUT_DST_COUNT, /* token_stride 0: every token the same */
  LAYOUT_BCAST_HEADS,    /* head_stride 0 and layer_stride 0 */
  LAYOUT_COUNT
} layout;

static inline const char *layout_name(layout l) {
  static const char *const n[] = {"contig", "token-major", "head-major", "padded",
                                  "kv-interleaved", "bcast-tokens", "bcast-heads"};
  return n[l];
}

typedef struct kvbuf {
  kvi_kv_view v;
  unsigned char *mem;
  size_t bytes;
  int64_t elems;
} kvbuf;

/* Allocates a buffer of the given layout (poisoned with 0xA5) and its view. */
static inline void kvbuf_make(kvbuf *b, layout lay, kvi_dtype dt, int L, int T, int H, int D) {
  const int64_t es = (int64_t)kvi_dtype_size(dt);
  int64_t ls = 0, ts = 0, hs = 0, k_off = 0, v_off = 0, total = 0;
  switch (lay) {
  case LAYOUT_CONTIG:
    hs = D, ts = (int64_t)H * D, ls = (int64_t)T * H * D;
    v_off = (int64_t)L * ls, total = 2 * v_off;
    break;
  case LAYOUT_TOKEN_MAJOR:
    hs = D, ls = (int64_t)H * D, ts = (int64_t)L * H * D;
    v_off = (int64_t)T * ts, total = 2 * v_off;
    break;
  case LAYOUT_HEAD_MAJOR:
    ts = D, hs = (int64_t)T * D, ls = (int64_t)H * T * D;
    v_off = (int64_t)L * ls, total = 2 * v_off;
    break;
  case LAYOUT_PADDED:
    hs = D + 3, ts = (int64_t)H * (D + 3) + 1, ls = (int64_t)T * ts + 5;
    k_off = 2, v_off = k_off + (int64_t)L * ls + 7, total = v_off + (int64_t)L * ls + 4;
    break;
  case LAYOUT_KV_INTERLEAVED:
    hs = D, ts = 2 * (int64_t)H * D, ls = (int64_t)T * ts;
    v_off = (int64_t)H * D, total = (int64_t)L * ls;
    break;
  case LAYOUT_BCAST_TOKENS:
    hs = D, ts = 0, ls = (int64_t)H * D;
    v_off = (int64_t)L * ls, total = 2 * v_off;
    break;
  case LAYOUT_BCAST_HEADS:
    hs = 0, ls = 0, ts = D;
    v_off = (int64_t)T * D, total = 2 * v_off;
    break;
  default: fail_msg("layout %d", (int)lay);
  }
  b->elems = total;
  b->bytes = (size_t)(total * es);
  b->mem = malloc(b->bytes ? b->bytes : 1);
  assert_non_null(b->mem);
  memset(b->mem, 0xA5, b->bytes);
  kvi_kv_view_init(&b->v, sizeof b->v);
  b->v.memory = KVI_MEMORY_HOST;
  b->v.dtype = dt;
  b->v.num_layers = L;
  b->v.num_tokens = T;
  b->v.num_heads = H;
  b->v.head_size = D;
  b->v.layer_stride = ls;
  b->v.token_stride = ts;
  b->v.head_stride = hs;
  b->v.k = b->mem + k_off * es;
  b->v.v = b->mem + v_off * es;
}

static inline void kvbuf_free(kvbuf *b) {
  free(b->mem);
  b->mem = NULL;
}

/* Element index (in elements from b->mem) of (plane, l, t, h, d). */
static inline int64_t kvbuf_index(const kvbuf *b, int plane, int l, int t, int h, int d) {
  const int64_t es = (int64_t)kvi_dtype_size(b->v.dtype);
  const unsigned char *base = plane ? b->v.v : b->v.k;
  return (int64_t)(base - b->mem) / es + l * b->v.layer_stride + t * b->v.token_stride +
         h * b->v.head_stride + d;
}

/* Fills every element of the buffer (padding included) with random bits. */
static inline void kvbuf_fill(kvbuf *b, rng *r) {
  for (int64_t i = 0; i < b->elems; i++) ref_store_bits(b->mem, b->v.dtype, i, rand_bits(r, b->v.dtype));
}

/* Makes a contiguous fp32 buffer whose element (plane, l, t, h, d) is a value
 * derived from `tag` alone, so that any thread can recompute it. */
static inline float tag_value(uint64_t tag, int64_t i) {
  rng r = {tag * 0x100000001b3ull + (uint64_t)i * 0x9e3779b97f4a7c15ull};
  rng_next(&r);
  return rand_float(&r);
}

static inline void kvbuf_fill_tag(kvbuf *b, uint64_t tag) {
  assert_int_equal(b->v.dtype, KVI_DTYPE_FP32);
  for (int64_t i = 0; i < b->elems; i++) ((float *)b->mem)[i] = tag_value(tag, i);
}

/* Store options for a CPU store. */
static inline kvi_store_options cpu_store_options(kvi_dtype dt, int32_t page_tokens, uint64_t budget) {
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  o.backend = KVI_BACKEND_CPU;
  o.dtype = dt;
  o.page_tokens = page_tokens;
  o.budget_bytes = budget;
  return o;
}

/* Model options of L layers of H KV heads of D, this process rank tp_rank of
 * tp_size. */
static inline kvi_model_options model_options(int32_t L, int32_t H, int32_t D, int32_t tp_rank, int32_t tp_size) {
  kvi_model_options o = KVI_MODEL_OPTIONS_INIT;
  o.num_layers = L;
  o.num_kv_heads = H;
  o.head_size = D;
  o.tp_rank = tp_rank;
  o.tp_size = tp_size;
  return o;
}

static inline kvi_model *make_model(int32_t L, int32_t H, int32_t D, int32_t tp_rank, int32_t tp_size) {
  const kvi_model_options o = model_options(L, H, D, tp_rank, tp_size);
  kvi_model *m = NULL;
  assert_ok(kvi_model_create(&m, &o));
  assert_non_null(m);
  return m;
}

/* The state of a suite over one model and one store. */
typedef struct store_fixture {
  kvi_model *m;
  kvi_store *s; /* NULL until the suite makes it */
  rng r;
} store_fixture;

/* A fixture whose model has the given geometry, and no store yet. */
static inline store_fixture *store_fixture_new(int32_t L, int32_t H, int32_t D, int32_t tp_rank, int32_t tp_size) {
  store_fixture *f = calloc(1, sizeof *f);
  assert_non_null(f);
  f->m = make_model(L, H, D, tp_rank, tp_size);
  return f;
}

static inline int store_fixture_teardown(void **state) {
  store_fixture *f = *state;
  kvi_store_destroy(f->s);
  kvi_model_destroy(f->m);
  free(f);
  return 0;
}

static inline kvi_store_stats store_stats(const kvi_store *s) {
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  assert_ok(kvi_store_stats_get(s, &st));
  return st;
}

static inline uint64_t div_up(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

/* CLOCK_MONOTONIC in seconds. */
static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The size of the file at path, which exists. */
static inline uint64_t file_size(const char *path) {
  struct stat sb;
  assert_int_equal(stat(path, &sb), 0);
  return (uint64_t)sb.st_size;
}

#endif /* KVI_UNIT_H */
