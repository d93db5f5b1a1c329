/*
 * unit-recompute: kvi_inject_deviation and kvi_recompute_select
 * (kvinject/recompute.h) on the CPU backend.
 *
 * Deviation: on every engine preset of kvi_cache_preset and every cache
 * dtype (fp8 with per-tensor and per-head scales), the cache's slots are
 * filled with random values written through the engine's own tensor shape
 * (ref64.h), and each layer's scores are checked against a float64 sum of
 * (decoded cache value - the fact's key rotated in double)^2 and V's squared
 * differences. The call never writes the cache; right after kvi_inject of the
 * same requests an fp32 cache scores exactly 0 and others at most their
 * rounding. Bad input fails with a clear error and writes nothing.
 *
 * Selection: hand-made cases with their expected plans, and random cases
 * (ties, NaN, empty facts) against a brute-force reference that ranks by
 * repeated maximum search.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "ref64.h"

#define L 3
#define HT 4 /* KV heads of the model; tp 2, rank 1: 2 local heads */
#define H 2
#define D 16
#define P 4

#include "mixed_store.h"

static int setup(void **state) { return mixed_store_setup(state, "unit-recompute fixture"); }
static int teardown(void **state) { return mixed_store_teardown(state); }

/* ------------------------------------------------------------------------ */
/* deviation                                                                 */
/* ------------------------------------------------------------------------ */

static const dcase dcases[] = {
    {KVI_DTYPE_FP32, KVI_SCALE_NONE},         {KVI_DTYPE_FP16, KVI_SCALE_NONE},
    {KVI_DTYPE_BF16, KVI_SCALE_NONE},         {KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_TENSOR},
    {KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_HEAD}, {KVI_DTYPE_FP8_E5M2, KVI_SCALE_NONE},
};
#define N_DCASES (sizeof dcases / sizeof dcases[0])

/* The float64 score of every token of the requests at layer l, from the
 * cache as the engine's tensors hold it; *bound: per token, a bound on the
 * fp32 computation's error. */
static void ref_scores(const fixture *f, const ecache *c, const mixed_requests *q, int l, double *want,
                       double *bound) {
  const rfact *facts[2][2] = {{&f->a, &f->b}, {&f->c, NULL}};
  const int nf[2] = {2, 1};
  double y[D];
  int64_t o = 0;
  for (int r = 0; r < 2; r++) {
    int64_t j = 0;
    for (int fi = 0; fi < nf[r]; fi++) {
      const rfact *ft = facts[r][fi];
      for (int32_t t = 0; t < ft->T; t++, j++, o++) {
        const int64_t slot = q->rq[r].first_slot + j;
        const int64_t b = q->rq[r].block_table[slot / c->BS];
        const int tt = (int)(slot % c->BS);
        const int32_t pos = q->rq[r].positions ? q->rq[r].positions[j] : q->rq[r].start_position + (int32_t)j;
        double sum = 0.0, mag = 0.0;
        for (int kv = 0; kv < 2; kv++)
          for (int h = 0; h < H; h++) {
            const float *x = rfact_row(ft, kv, l, t, h);
            ref_rotate(kv ? &f->rr[0] : &f->rr[l], x, D, pos, y); /* rr[0] is NoPE: V copied */
            const float sc = ec_scale(c, kv, l, h);
            for (int d = 0; d < D; d++) {
              const double got = (double)ref_decode(ec_elem(c, kv, l, b, tt, h, d, NULL), c->dt, sc);
              sum += (got - y[d]) * (got - y[d]);
              mag += (fabs(got) + fabs(y[d])) * (fabs(got) + fabs(y[d]));
            }
          }
        want[o] = sum;
        /* fp32 rotation (relative ~4e-6 of the pair, positions below 7000) enters the squared difference
         * linearly; the accumulation is double */
        bound[o] = 2e-5 * mag + 1e-30;
      }
    }
  }
}

/* Writes random values into every slot of the requests, all layers. */
static void fill_slots(fixture *f, ecache *c, const mixed_requests *q) {
  const int32_t T[2] = {f->a.T + f->b.T, f->c.T};
  for (int r = 0; r < 2; r++)
    for (int32_t j = 0; j < T[r]; j++) {
      const int64_t slot = q->rq[r].first_slot + j;
      const int64_t b = q->rq[r].block_table[slot / c->BS];
      for (int l = 0; l < L; l++)
        for (int kv = 0; kv < 2; kv++)
          for (int h = 0; h < H; h++)
            for (int d = 0; d < D; d++)
              ref_encode(ec_elem(c, kv, l, b, (int)(slot % c->BS), h, d, NULL), c->dt, rand_val(&f->r, -4, 2),
                         ec_scale(c, kv, l, h));
    }
}

static void run_deviation(fixture *f, kvi_cache_preset preset, int32_t BS, int64_t NB, int64_t fs0, int64_t fs1,
                          const dcase *dc) {
  char what[256];
  snprintf(what, sizeof what, "%s, %s cache, scales %d", preset_name(preset), cache_dtype_name(dc->dt), (int)dc->sm);
  ecache c;
  ec_make(&c, preset, dc->dt, L, H, D, BS, NB, dc->sm, &f->r);
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &c.lay, NULL));
  mixed_requests q;
  mixed_requests_make(&q, f, &c, fs0, fs1, 0);
  const int64_t T = f->a.T + f->b.T + f->c.T;
  float got[32];
  double want[32], bound[32];
  assert_true(T <= 32);

  fill_slots(f, &c, &q);
  const uint64_t hash = ec_hash(&c);
  for (int l = 0; l < L; l++) {
    for (int i = 0; i < 32; i++) got[i] = -1.0f;
    assert_ok(kvi_inject_deviation(inj, q.rq, 2, l, got, T, KVI_MEMORY_HOST, NULL));
    assert_true(ec_hash(&c) == hash); /* read only */
    assert_true(got[T] == -1.0f);      /* nothing past the call's tokens */
    ref_scores(f, &c, &q, l, want, bound);
    for (int64_t t = 0; t < T; t++)
      if (!(fabs((double)got[t] - want[t]) <= bound[t] + 1e-6 * want[t]))
        fail_msg("%s: layer %d token %lld: score %.9g, float64 reference %.9g (bound %.3g)", what, l, (long long)t,
                 (double)got[t], want[t], bound[t]);
  }

  /* right after injecting the same requests: the conversion error alone */
  assert_ok(kvi_inject(inj, q.rq, 2, NULL, NULL));
  for (int l = 0; l < L; l++) {
    assert_ok(kvi_inject_deviation(inj, q.rq, 2, l, got, T, KVI_MEMORY_HOST, NULL));
    ref_scores(f, &c, &q, l, want, bound);
    for (int64_t t = 0; t < T; t++) {
      if (dc->dt == KVI_DTYPE_FP32 && got[t] != 0.0f)
        fail_msg("%s: layer %d token %lld: score %g right after injection into an fp32 cache", what, l, (long long)t,
                 (double)got[t]);
      if (!(fabs((double)got[t] - want[t]) <= bound[t] + 1e-6 * want[t]))
        fail_msg("%s: after injection, layer %d token %lld: score %.9g, reference %.9g", what, l, (long long)t,
                 (double)got[t], want[t]);
    }
  }
  free(q.perm);
  kvi_injector_destroy(inj);
  ec_free(&c);
}

typedef struct pcase {
  kvi_cache_preset p;
  int32_t BS;
  int64_t NB, fs0, fs1;
} pcase;

static void test_deviation_presets(void **state) {
  fixture *f = *state;
  static const pcase pc[] = {
      {KVI_CACHE_VLLM_FLASH_ATTN, 4, 9, 2, 3},     {KVI_CACHE_VLLM_FLASH_ATTN_HND, 4, 9, 3, 1},
      {KVI_CACHE_VLLM_FLASHINFER, 4, 10, 1, 2},    {KVI_CACHE_VLLM_FLASHINFER_HND, 8, 8, 5, 6},
      {KVI_CACHE_VLLM_PACKED, 4, 9, 2, 3},         {KVI_CACHE_VLLM_PACKED_HND, 4, 9, 3, 2},
      {KVI_CACHE_SGLANG, 1, 26, 3, 2},             {KVI_CACHE_SGLANG, 4, 9, 2, 3},
      {KVI_CACHE_TRTLLM, 4, 9, 1, 3},              {KVI_CACHE_HF_CONTIGUOUS, 20, 3, 3, 11},
      {(kvi_cache_preset)EC_GENERIC_VT, 4, 9, 2, 1}, {(kvi_cache_preset)EC_GENERIC_MIXED, 4, 9, 1, 2},
  };
  for (size_t i = 0; i < sizeof pc / sizeof pc[0]; i++)
    for (size_t d = 0; d < N_DCASES; d++) run_deviation(f, pc[i].p, pc[i].BS, pc[i].NB, pc[i].fs0, pc[i].fs1, &dcases[d]);
}

/* A deviation of 1 in one element of one token shows in that token alone. */
static void test_deviation_localized(void **state) {
  fixture *f = *state;
  ecache c;
  ec_make(&c, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, 4, 9, KVI_SCALE_NONE, &f->r);
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &c.lay, NULL));
  mixed_requests q;
  mixed_requests_make(&q, f, &c, 2, 3, 0);
  assert_ok(kvi_inject(inj, q.rq, 2, NULL, NULL));
  const int64_t T = f->a.T + f->b.T + f->c.T;
  /* token 6 of request 0 (fact b's second), layer 1, V head 1 element 3: +1.5; K head 0 element 0: +0.5 */
  const int64_t slot = q.fs0 + 6;
  const int64_t b = q.perm[slot / 4];
  float *v = (float *)ec_elem(&c, 1, 1, b, (int)(slot % 4), 1, 3, NULL);
  float *k = (float *)ec_elem(&c, 0, 1, b, (int)(slot % 4), 0, 0, NULL);
  *v += 1.5f, *k += 0.5f;
  float got[32];
  assert_ok(kvi_inject_deviation(inj, q.rq, 2, 1, got, T, KVI_MEMORY_HOST, NULL));
  for (int64_t t = 0; t < T; t++) {
    const double want = t == 6 ? 1.5 * 1.5 + 0.5 * 0.5 : 0.0;
    if (fabs((double)got[t] - want) > 1e-5) fail_msg("token %lld: score %g, expected %g", (long long)t, got[t], want);
  }
  assert_ok(kvi_inject_deviation(inj, q.rq, 2, 0, got, T, KVI_MEMORY_HOST, NULL));
  for (int64_t t = 0; t < T; t++) assert_true(got[t] == 0.0f);
  free(q.perm);
  kvi_injector_destroy(inj);
  ec_free(&c);
}

static void test_deviation_errors(void **state) {
  fixture *f = *state;
  ecache c;
  ec_make(&c, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, 4, 9, KVI_SCALE_NONE, &f->r);
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &c.lay, NULL));
  mixed_requests q;
  mixed_requests_make(&q, f, &c, 2, 3, 0);
  const int64_t T = f->a.T + f->b.T + f->c.T;
  float out[32], keep[32];
  for (int i = 0; i < 32; i++) out[i] = keep[i] = (float)i - 100.0f;
  const uint64_t hash = ec_hash(&c);
#define REFUSED(call, code, needle)                          \
  do {                                                       \
    assert_status(call, code);                               \
    assert_last_error_has("kvi_inject_deviation", needle);   \
    assert_memory_equal(out, keep, sizeof out);              \
    assert_true(ec_hash(&c) == hash);                        \
  } while (0)
  REFUSED(kvi_inject_deviation(NULL, q.rq, 2, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "injector");
  REFUSED(kvi_inject_deviation(inj, q.rq, -1, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT,
          "num_requests");
  REFUSED(kvi_inject_deviation(inj, NULL, 2, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "reqs");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, L, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "layer");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, -1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "layer");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T - 1, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT,
          "scores");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, NULL, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "NULL");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, -1, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT,
          "num_scores");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, KVI_MEMORY_DEVICE, NULL), KVI_ERR_MEMORY_KIND, "CPU store");
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, (kvi_memory)7, NULL), KVI_ERR_INVALID_ARGUMENT, "out_memory");
  /* the request checks of kvi_inject: an unknown fact, a short block table, a bad position, struct sizes */
  uint64_t bad_ids[2] = {f->a.id, 99};
  q.rq[0].fact_ids = bad_ids;
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_NOT_FOUND, "no fact 99");
  q.rq[0].fact_ids = q.ids0;
  q.rq[1].block_table_len = 0;
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "block table");
  q.rq[1].block_table_len = q.len1;
  q.rq[1].start_position = -3;
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_INVALID_ARGUMENT, "positions");
  q.rq[1].start_position = q.start1;
  q.rq[1].struct_size = sizeof q.rq[1] + 8;
  REFUSED(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, KVI_MEMORY_HOST, NULL), KVI_ERR_STRUCT_SIZE, "struct_size");
  q.rq[1].struct_size = sizeof q.rq[1];
#undef REFUSED
  /* no requests: nothing to score, NULL output accepted */
  assert_ok(kvi_inject_deviation(inj, q.rq, 0, 1, NULL, 0, KVI_MEMORY_HOST, NULL));
  assert_ok(kvi_inject_deviation(inj, q.rq, 2, 1, out, T, KVI_MEMORY_HOST, NULL));
  free(q.perm);
  kvi_injector_destroy(inj);
  ec_free(&c);
}

/* ------------------------------------------------------------------------ */
/* selection                                                                 */
/* ------------------------------------------------------------------------ */

static kvi_recompute_options ropts(double fraction, int per_fact, int boundary) {
  kvi_recompute_options o = KVI_RECOMPUTE_OPTIONS_INIT;
  o.fraction = fraction, o.per_fact = per_fact, o.boundary = boundary;
  return o;
}

static void expect_plan(const float *sc, const int32_t *tok, int32_t nf, kvi_recompute_options o, const int32_t *want,
                        int64_t nwant) {
  int32_t got[64];
  int64_t n = -1;
  assert_ok(kvi_recompute_select(sc, tok, nf, &o, got, 64, &n));
  assert_int_equal(n, nwant);
  for (int64_t i = 0; i < n; i++) assert_int_equal(got[i], want[i]);
}

static void test_select_cases(void **state) {
  (void)state;
  /* two facts of 4 and 6 tokens */
  const int32_t tok[] = {4, 6};
  const float sc[] = {5, 1, 9, 2, /**/ 0, 8, 7, 3, 8, 1};
  { /* top 30% of 10 = 3 overall: 9 (2), then 8 (5) and 8 (8), the lower index first */
    const int32_t w[] = {2, 5, 8};
    expect_plan(sc, tok, 2, ropts(0.3, 0, 0), w, 3);
  }
  { /* 25% = 2.5 rounds to 3; ties broken by index: 8 at 5 and 8 (both), not 7 at 6 */
    const int32_t w[] = {2, 5, 8};
    expect_plan(sc, tok, 2, ropts(0.25, 0, 0), w, 3);
  }
  { /* boundary 1: tokens 0 and 4; then the best 2 of the rest: 9 (2), 8 (5) */
    const int32_t w[] = {0, 2, 4, 5};
    expect_plan(sc, tok, 2, ropts(0.2, 0, 1), w, 4);
  }
  { /* per fact, 50%: 2 of fact 0 (9 at 2, 5 at 0), 3 of fact 1 (8 at 5, 8 at 8, 7 at 6) */
    const int32_t w[] = {0, 2, 5, 6, 8};
    expect_plan(sc, tok, 2, ropts(0.5, 1, 0), w, 5);
  }
  { /* boundary past a fact's length: all of it */
    const int32_t w[] = {0, 1, 2, 3, 4, 5, 6, 7, 8};
    const int32_t tk[] = {4, 6};
    expect_plan(sc, tk, 2, ropts(0.0, 0, 5), w, 9);
  }
  { /* fraction 1: everything */
    const int32_t w[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    expect_plan(sc, tok, 2, ropts(1.0, 1, 2), w, 10);
  }
  { /* NaN ranks first, -inf last; an empty fact in between */
    const float s2[] = {1, NAN, -INFINITY, 2};
    const int32_t t2[] = {2, 0, 2};
    const int32_t w[] = {1, 3};
    expect_plan(s2, t2, 3, ropts(0.5, 0, 0), w, 2);
    const int32_t w1[] = {1};
    expect_plan(s2, t2, 3, ropts(0.25, 0, 0), w1, 1); /* 1.0 -> 1 */
  }
  { /* nothing: no facts, or fraction 0 and no boundary (NULL pointers fine without tokens) */
    int64_t n = -1;
    assert_ok(kvi_recompute_select(NULL, NULL, 0, NULL, NULL, 0, &n));
    assert_int_equal(n, 0);
    expect_plan(sc, tok, 2, ropts(0.0, 0, 0), NULL, 0);
    assert_ok(kvi_recompute_select(sc, tok, 2, NULL, NULL, 0, &n)); /* NULL opts: the defaults, fraction 0 */
    assert_int_equal(n, 0);
  }
}

/* Brute force: the boundary, then m times the best unchosen token by a
 * linear scan. */
static int64_t ref_select(const float *sc, const int32_t *tok, int32_t nf, double fr, int per_fact, int boundary,
                          int32_t *out) {
  int64_t T = 0;
  for (int32_t f = 0; f < nf; f++) T += tok[f];
  unsigned char chosen[512] = {0};
  int64_t t0 = 0;
  for (int32_t f = 0; f < nf; t0 += tok[f++])
    for (int32_t t = 0; t < tok[f] && t < boundary; t++) chosen[t0 + t] = 1;
  const int groups = per_fact ? nf : 1;
  t0 = 0;
  for (int g = 0; g < groups; g++) {
    const int64_t n = per_fact ? tok[g] : T;
    int64_t m = (int64_t)floor(fr * (double)n + 0.5);
    for (; m > 0; m--) {
      int64_t best = -1;
      for (int64_t t = t0; t < t0 + n; t++) {
        if (chosen[t]) continue;
        if (best < 0) {
          best = t;
          continue;
        }
        const bool nt = isnan(sc[t]), nb = isnan(sc[best]);
        if ((nt && !nb) || (!nt && !nb && sc[t] > sc[best])) best = t;
      }
      if (best < 0) break;
      chosen[best] = 1;
    }
    t0 += n;
  }
  int64_t k = 0;
  for (int64_t t = 0; t < T; t++)
    if (chosen[t]) out[k++] = (int32_t)t;
  return k;
}

static void test_select_random(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "unit-recompute select");
  for (int it = 0; it < 3000; it++) {
    int32_t tok[16];
    const int32_t nf = (int32_t)rng_range(&r, 0, 15);
    int64_t T = 0;
    for (int32_t f = 0; f < nf; f++) T += tok[f] = (int32_t)rng_range(&r, 0, 30);
    float sc[512];
    for (int64_t t = 0; t < T; t++) {
      const int64_t k = rng_range(&r, 0, 19);
      sc[t] = k == 0 ? NAN : k < 6 ? (float)rng_range(&r, 0, 3) : rand_val(&r, -3, 3); /* ties and NaN */
    }
    const double fr = rng_range(&r, 0, 4) == 0 ? (double)rng_range(&r, 0, 1) : (double)rng_range(&r, 0, 1000) / 1000.0;
    const int per_fact = (int)rng_range(&r, 0, 1), boundary = (int)rng_range(&r, 0, 4);
    int32_t want[512], got[512];
    const int64_t nw = ref_select(sc, tok, nf, fr, per_fact, boundary, want);
    kvi_recompute_options o = ropts(fr, per_fact, boundary);
    int64_t n = -1;
    assert_ok(kvi_recompute_select(sc, tok, nf, &o, got, 512, &n));
    if (n != nw) fail_msg("case %d (T %lld, fraction %g, per_fact %d, boundary %d): %lld chosen, reference %lld", it,
                          (long long)T, fr, per_fact, boundary, (long long)n, (long long)nw);
    for (int64_t i = 0; i < n; i++)
      if (got[i] != want[i])
        fail_msg("case %d: entry %lld is token %d, reference %d", it, (long long)i, got[i], want[i]);
  }
}

static void test_select_errors(void **state) {
  (void)state;
  const int32_t tok[] = {4, 6}, neg[] = {4, -1};
  const float sc[10] = {0};
  int32_t out[16], keep[16];
  for (int i = 0; i < 16; i++) out[i] = keep[i] = 1000 + i;
  int64_t n = 77;
  kvi_recompute_options o = ropts(0.5, 0, 0);
#define REFUSED(call, code, needle)                          \
  do {                                                       \
    assert_status(call, code);                               \
    assert_last_error_has("kvi_recompute_select", needle);   \
    assert_memory_equal(out, keep, sizeof out);              \
    assert_int_equal(n, 77);                                 \
  } while (0)
  REFUSED(kvi_recompute_select(sc, tok, 2, &o, out, 16, NULL), KVI_ERR_INVALID_ARGUMENT, "out_count");
  REFUSED(kvi_recompute_select(sc, tok, -1, &o, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "num_facts");
  REFUSED(kvi_recompute_select(sc, NULL, 2, &o, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "fact_tokens");
  REFUSED(kvi_recompute_select(sc, neg, 2, &o, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "fact_tokens[1]");
  REFUSED(kvi_recompute_select(NULL, tok, 2, &o, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "scores");
  REFUSED(kvi_recompute_select(sc, tok, 2, &o, NULL, 16, &n), KVI_ERR_INVALID_ARGUMENT, "out_index");
  REFUSED(kvi_recompute_select(sc, tok, 2, &o, out, -1, &n), KVI_ERR_INVALID_ARGUMENT, "capacity");
  REFUSED(kvi_recompute_select(sc, tok, 2, &o, out, 4, &n), KVI_ERR_CAPACITY, "holds 4");
  const int32_t big[] = {INT32_MAX, 1};
  REFUSED(kvi_recompute_select(sc, big, 2, &o, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "more than");
  kvi_recompute_options b = ropts(1.5, 0, 0);
  REFUSED(kvi_recompute_select(sc, tok, 2, &b, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "fraction");
  b = ropts(NAN, 0, 0);
  REFUSED(kvi_recompute_select(sc, tok, 2, &b, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "fraction");
  b = ropts(-0.1, 0, 0);
  REFUSED(kvi_recompute_select(sc, tok, 2, &b, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "fraction");
  b = ropts(0.5, 2, 0);
  REFUSED(kvi_recompute_select(sc, tok, 2, &b, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "per_fact");
  b = ropts(0.5, 0, -1);
  REFUSED(kvi_recompute_select(sc, tok, 2, &b, out, 16, &n), KVI_ERR_INVALID_ARGUMENT, "boundary");
  b = ropts(0.5, 0, 0);
  b.struct_size = 8;
  REFUSED(kvi_recompute_select(sc, tok, 2, &b, out, 16, &n), KVI_ERR_STRUCT_SIZE, "");
#undef REFUSED
  assert_ok(kvi_recompute_select(sc, tok, 2, &o, out, 5, &n));
  assert_int_equal(n, 5);
}

#define T_(name) cmocka_unit_test_setup_teardown(name, setup, teardown)

int main(void) {
  const struct CMUnitTest tests[] = {
      T_(test_deviation_presets), T_(test_deviation_localized), T_(test_deviation_errors),
      cmocka_unit_test(test_select_cases), cmocka_unit_test(test_select_random), cmocka_unit_test(test_select_errors),
  };
  return cmocka_run_group_tests_name("unit-recompute", tests, NULL, NULL);
}
