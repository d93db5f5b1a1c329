/*
 * internal-planners: the injector's host planning (lib/xfer/injector.c, execute.c) checked
 * against invariants over sweeps of its inputs: the layers per CTA of a
 * launch, the kernel variant (vector width) chosen for a cache layout, the
 * segment length that bounds the kernel's shared memory, and the per-layer
 * tables a CUDA injector uploads (built here on the host, never uploaded).
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#include "gpu/kernels.h"
#include "xfer/xfer.h"

/* ------------------------------------------------------------------------ */
/* layers per CTA                                                           */
/* ------------------------------------------------------------------------ */

static void check_layers_per_cta(int32_t sms, int32_t nsegs, int32_t nl, int32_t *prev) {
  const int32_t r = kvi__layers_per_cta(sms, nsegs, nl);
  const int64_t target = (int64_t)(sms > 0 ? sms : 132) * 128;
  if (r < 1 || r > nl) fail_msg("sms %d nsegs %d nl %d: %d layers per CTA, expected 1..%d", sms, nsegs, nl, r, nl);
  const int64_t chunks = (nl + r - 1) / r;
  /* the chunks are as even as that many chunks can be: none is two layers
   * shorter than another */
  if ((nl + chunks - 1) / chunks != r)
    fail_msg("sms %d nsegs %d nl %d: %d layers per CTA in %lld chunks; %lld chunks hold %lld layers each", sms, nsegs,
             nl, r, (long long)chunks, (long long)chunks, (long long)((nl + chunks - 1) / chunks));
  /* the grid keeps the target CTA count (or every (segment, layer) pair
   * its own CTA when there are fewer) */
  const int64_t ctas = (int64_t)nsegs * chunks, pairs = (int64_t)nsegs * nl;
  if (ctas < (pairs < target ? pairs : target))
    fail_msg("sms %d nsegs %d nl %d: %lld CTAs, fewer than min(%lld pairs, target %lld)", sms, nsegs, nl,
             (long long)ctas, (long long)pairs, (long long)target);
  /* and a CTA takes no more layers than that needs */
  if (r > 1 && (double)r > (double)pairs / (double)target)
    fail_msg("sms %d nsegs %d nl %d: %d layers per CTA where %.3f would keep the target", sms, nsegs, nl, r,
             (double)pairs / (double)target);
  /* but at least half of what keeping it allows, so the prologue is amortized */
  const int64_t allowed = pairs / target < nl ? pairs / target : nl;
  if (2 * (int64_t)r < allowed)
    fail_msg("sms %d nsegs %d nl %d: %d layers per CTA where %lld keep the target", sms, nsegs, nl, r, (long long)allowed);
  /* more segments never mean fewer layers per CTA */
  if (prev && r < *prev) fail_msg("sms %d nl %d: %d layers per CTA at %d segments, %d at fewer", sms, nl, r, nsegs, *prev);
  if (prev) *prev = r;
}

static void test_layers_per_cta(void **state) {
  (void)state;
  static const int32_t sms_list[] = {-1, 0, 1, 8, 78, 132};
  for (size_t i = 0; i < sizeof sms_list / sizeof *sms_list; i++)
    for (int32_t nl = 1; nl <= 130; nl += nl < 10 ? 1 : 7) {
      int32_t prev = 0;
      for (int32_t nsegs = 1; nsegs <= 400000; nsegs += 1 + nsegs / 16) check_layers_per_cta(sms_list[i], nsegs, nl, &prev);
    }
  /* an unknown SM count is taken as 132 */
  for (int32_t nsegs = 1; nsegs < 100000; nsegs = nsegs * 3 + 1) {
    assert_int_equal(kvi__layers_per_cta(0, nsegs, 64), kvi__layers_per_cta(132, nsegs, 64));
    assert_int_equal(kvi__layers_per_cta(-5, nsegs, 64), kvi__layers_per_cta(132, nsegs, 64));
  }
  /* the extremes: one segment on one SM; more segments than the target */
  assert_int_equal(kvi__layers_per_cta(1, 1, 1), 1);
  assert_int_equal(kvi__layers_per_cta(132, 132 * 128 * 64, 64), 64);
  check_layers_per_cta(132, INT32_MAX / 2, 128, NULL);
}

/* ------------------------------------------------------------------------ */
/* kernel variant and segment length                                        */
/* ------------------------------------------------------------------------ */

#define VL 3  /* layers */
#define VH 2  /* heads */
#define VNB 3 /* blocks */
#define VBS 4 /* tokens per block */

typedef struct vcase {
  kvi_dtype store_dt, cache_dt;
  int32_t D;
  int32_t rot[VL];   /* rotary_dim per layer; -1: KVI_ROPE_NONE */
  int32_t head_pad;  /* elements between one head's row end and the next head's start */
  int32_t base_off;  /* elements from an aligned buffer start to the cache's start */
  int64_t dim_stride;
  int32_t P;         /* store page tokens */
} vcase;

/* Whether every K and V row start of the cache lies at a multiple of `al`
 * bytes: found by walking every (layer, block, token, head) address. */
static bool rows_aligned(char *const *k, char *const *v, int64_t bs, int64_t ts, int64_t hs, size_t es, size_t al) {
  for (int l = 0; l < VL; l++)
    for (int b = 0; b < VNB; b++)
      for (int t = 0; t < VBS; t++)
        for (int h = 0; h < VH; h++) {
          const int64_t off = ((int64_t)b * bs + (int64_t)t * ts + (int64_t)h * hs) * (int64_t)es;
          if ((uintptr_t)(k[l] + off) % al || (uintptr_t)(v[l] + off) % al) return false;
        }
  return true;
}

/* Checks an injector's choices for case c; returns its vector width. */
static int32_t check_variant(const vcase *c) {
  const int32_t D = c->D;
  kvi_model *m = make_model(VL, VH, D, 0, 1);
  int32_t half_max = 0;
  bool rot16 = true;
  for (int l = 0; l < VL; l++) {
    kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
    if (c->rot[l] < 0) {
      r.style = KVI_ROPE_NONE;
    } else {
      r.rotary_dim = c->rot[l];
      const int32_t rd = c->rot[l] ? c->rot[l] : D;
      if (rd / 2 > half_max) half_max = rd / 2;
      rot16 = rot16 && rd % 16 == 0;
    }
    assert_ok(kvi_model_set_rope(m, l, &r));
  }
  const size_t pes = c->store_dt == KVI_DTYPE_FP8_E4M3 ? 1 : kvi_dtype_size(c->store_dt);
  kvi_store_options so = cpu_store_options(c->store_dt, c->P, (uint64_t)c->P * VL * 2 * VH * D * pes * 8 + 4096);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &so));

  /* cache: per layer [2][NB][BS][H][hs] with hs = D + pad (or D * dim_stride) */
  const size_t es = kvi_dtype_size(c->cache_dt);
  const int64_t ds = c->dim_stride ? c->dim_stride : 1;
  const int64_t hs = (int64_t)D * ds + c->head_pad, ts = VH * hs, bs = VBS * ts, plane = VNB * bs;
  const size_t bytes = (size_t)(VL * 2 * plane + c->base_off + 64) * es;
  char *buf = aligned_alloc(64, (bytes + 63) / 64 * 64);
  assert_non_null(buf);
  char *k[VL], *v[VL];
  for (int l = 0; l < VL; l++) {
    k[l] = buf + ((int64_t)c->base_off + (int64_t)l * 2 * plane) * (int64_t)es;
    v[l] = k[l] + plane * (int64_t)es;
  }
  kvi_cache_layout lay = KVI_CACHE_LAYOUT_INIT;
  lay.memory = KVI_MEMORY_HOST;
  lay.dtype = c->cache_dt;
  lay.num_layers = VL;
  lay.num_heads = VH;
  lay.head_size = D;
  lay.block_size = VBS;
  lay.num_blocks = VNB;
  lay.block_stride = bs;
  lay.token_stride = ts;
  lay.head_stride = hs;
  lay.dim_stride = ds;
  lay.k_layers = (void *const *)k;
  lay.v_layers = (void *const *)v;
  if (c->cache_dt == KVI_DTYPE_FP8_E4M3 || c->cache_dt == KVI_DTYPE_FP8_E5M2) lay.scale_mode = KVI_SCALE_NONE;
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, s, &lay, NULL));

  /* the variant: the widest whose every access is valid for this layout */
  const size_t al8 = 8 * es < 16 ? 8 * es : 16;
  const bool ok8 = D % 8 == 0 && rot16 && ds == 1 && rows_aligned(k, v, bs, ts, hs, es, al8);
  const int32_t want = ok8 ? 8 : 1, got = kvi__injector_vec(inj);
  if (got != want)
    fail_msg("store %s cache %s D %d rot %d/%d/%d pad %d off %d dim stride %lld: vector width %d, expected %d",
             dtype_name(c->store_dt), dtype_name(c->cache_dt), D, c->rot[0], c->rot[1], c->rot[2], c->head_pad,
             c->base_off, (long long)ds, got, want);

  /* the segment: a power of two up to 64 (or the page) whose cos/sin and
   * offsets fit 24 KiB of shared memory, the longest such */
  assert_int_equal(kvi__injector_half_max(inj), half_max);
  const int32_t seg = kvi__injector_seg_tokens(inj);
  int32_t want_seg = 1;
  for (int32_t t = 2; t <= 64; t *= 2)
    if (KVI__XFER_SMEM(t, half_max, false) <= 24576) want_seg = t;
  if (want_seg > c->P) want_seg = c->P;
  if (seg != want_seg) fail_msg("D %d half_max %d P %d: segments of %d tokens, expected %d", D, half_max, c->P, seg, want_seg);
  assert_true(seg == 1 || KVI__XFER_SMEM(seg, half_max, false) <= 24576);

  kvi_injector_destroy(inj);
  free(buf);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  return got;
}

static void test_variant_selection(void **state) {
  (void)state;
  static const kvi_dtype stores[] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16, KVI_DTYPE_FP8_E4M3};
  static const kvi_dtype caches[] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16, KVI_DTYPE_FP8_E4M3,
                                     KVI_DTYPE_FP8_E5M2};
  static const int32_t Ds[] = {4, 8, 12, 16, 24, 32, 64, 128};
  static const int32_t pads[] = {0, 1, 2, 4, 8, 16};
  static const int32_t offs[] = {0, 1, 2, 8, 16};
  rng r;
  rng_seed(&r, "test_variant_selection");
  int64_t seen[9] = {0};
  for (size_t si = 0; si < 4; si++)
    for (size_t ci = 0; ci < 5; ci++)
      for (size_t di = 0; di < sizeof Ds / sizeof *Ds; di++)
        for (int rep = 0; rep < 6; rep++) {
          vcase c;
          memset(&c, 0, sizeof c);
          c.store_dt = stores[si];
          c.cache_dt = caches[ci];
          c.D = Ds[di];
          for (int l = 0; l < VL; l++) {
            const int64_t pick = rng_range(&r, 0, 3);
            /* none, full, or a random even partial width; rep 0 rotates every
             * layer fully, so each (store, cache, D) has one aligned case and the
             * sweep reaches every variant whatever the seed */
            c.rot[l] = rep == 0 ? 0 : pick == 0 ? -1 : pick == 1 ? 0 : 2 * (int32_t)rng_range(&r, 1, c.D / 2);
          }
          c.head_pad = rep == 0 ? 0 : pads[rng_range(&r, 0, 5)];
          c.base_off = rep == 0 ? 0 : offs[rng_range(&r, 0, 4)];
          c.dim_stride = rep == 5 ? 2 : 1;
          c.P = (int32_t)rng_range(&r, 1, 80);
          seen[check_variant(&c)]++;
        }
  /* the sweep reaches every variant */
  assert_true(seen[1] > 0 && seen[8] > 0);
  /* fp8 pages take 8-element vectors too (16 left the injection at 225
   * registers, the capture at 255 with spills) */
  vcase c = {KVI_DTYPE_FP8_E4M3, KVI_DTYPE_FP16, 64, {0, 32, -1}, 0, 0, 1, 16};
  assert_int_equal(check_variant(&c), 8);
  c.store_dt = KVI_DTYPE_FP16;
  assert_int_equal(check_variant(&c), 8);
  c.head_pad = 1; /* rows two bytes off 16 */
  assert_int_equal(check_variant(&c), 1);
  c.head_pad = 8;
  c.rot[1] = 24; /* a rotated width that is not a multiple of 16 */
  assert_int_equal(check_variant(&c), 1);
}

/* ------------------------------------------------------------------------ */
/* per-layer tables                                                         */
/* ------------------------------------------------------------------------ */

#define TL 7
#define TD 16
#define TPOS 64

/* Whether layers a and b rotate alike: same style and width and the same
 * cos/sin at every position and pair (kvi_model_rope_cos_sin). */
static bool rotate_alike(const kvi_model *m, const kvi_store *s, int a, int b) {
  const kvi__rope *x = &s->rope[a], *y = &s->rope[b];
  if (x->style != y->style) return false;
  if (x->style == KVI_ROPE_NONE) return true;
  if (x->rotary_dim != y->rotary_dim) return false;
  for (int32_t pos = 0; pos < TPOS; pos++)
    for (int32_t i = 0; i < x->rotary_dim / 2; i++) {
      float ca, sa, cb, sb;
      assert_ok(kvi_model_rope_cos_sin(m, a, pos, i, &ca, &sa));
      assert_ok(kvi_model_rope_cos_sin(m, b, pos, i, &cb, &sb));
      if (ca != cb || sa != sb) return false;
    }
  return true;
}

static void test_layer_tables(void **state) {
  (void)state;
  kvi_model *m = make_model(TL, 2, TD, 0, 1);
  float table[TPOS * TD];
  for (int p = 0; p < TPOS; p++)
    for (int i = 0; i < TD / 2; i++) {
      table[p * TD + i] = cosf(0.01f * (float)(p * (i + 1)));
      table[p * TD + TD / 2 + i] = sinf(0.01f * (float)(p * (i + 1)));
    }
  kvi_rope_spec t = KVI_ROPE_SPEC_INIT; /* every layer: the engine's table (shared) */
  t.cos_sin_table = table;
  t.table_positions = TPOS;
  assert_ok(kvi_model_set_rope(m, -1, &t));
  kvi_rope_spec neox = KVI_ROPE_SPEC_INIT, gptj = KVI_ROPE_SPEC_INIT, none = KVI_ROPE_SPEC_INIT;
  gptj.style = KVI_ROPE_GPTJ;
  gptj.rotary_dim = 8;
  gptj.theta = 5e5;
  none.style = KVI_ROPE_NONE;
  assert_ok(kvi_model_set_rope(m, 1, &neox));
  assert_ok(kvi_model_set_rope(m, 2, &neox)); /* rotates as layer 1 */
  assert_ok(kvi_model_set_rope(m, 3, &none));
  assert_ok(kvi_model_set_rope(m, 4, &gptj));
  assert_ok(kvi_model_set_rope(m, 6, &none));
  kvi_store_options so = cpu_store_options(KVI_DTYPE_FP16, 4, 1u << 20);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &so));
  /* a host cache with per-head scales, its layers' bases from its own buffer */
  float ks[TL * 2], vs[TL * 2];
  for (int i = 0; i < TL * 2; i++) ks[i] = 0.5f + (float)i, vs[i] = 100.0f + (float)i;
  char *cachebuf = calloc(TL * 2 * 4 * 4 * 2 * TD, 1);
  assert_non_null(cachebuf);
  kvi_cache_layout lay = KVI_CACHE_LAYOUT_INIT;
  lay.memory = KVI_MEMORY_HOST;
  lay.dtype = KVI_DTYPE_FP8_E4M3;
  lay.num_layers = TL;
  lay.num_heads = 2;
  lay.head_size = TD;
  lay.block_size = 4;
  lay.num_blocks = 4;
  lay.head_stride = TD;
  lay.token_stride = 2 * TD;
  lay.block_stride = 4 * 2 * TD;
  lay.layer_stride = 2 * 4 * 4 * 2 * TD;
  lay.v_offset = 4 * 4 * 2 * TD;
  lay.k_base = cachebuf;
  lay.scale_mode = KVI_SCALE_PER_HEAD;
  lay.k_scales = ks;
  lay.v_scales = vs;
  kvi__cache c;
  assert_ok(kvi__cache_resolve(&c, &lay, &s->geom, false, -1, "test"));

  size_t o_k = 0, o_v = 0, o_k2 = 0, o_v2 = 0;
  const size_t total = kvi__layer_tables(s, &c, NULL, NULL, &o_k, &o_v);
  char *host = malloc(total), *dev = malloc(total); /* dev: addresses only */
  assert_true(host && dev);
  memset(host, 0xA5, total);
  assert_int_equal(kvi__layer_tables(s, &c, host, dev, &o_k2, &o_v2), total);
  assert_int_equal(o_k, o_k2);
  assert_int_equal(o_v, o_v2);
  assert_true(o_k % 16 == 0 && o_v % 16 == 0 && o_k >= TL * sizeof(kvi__xlayer) && o_v >= o_k + TL * 2 * sizeof(float));
  assert_memory_equal(host + o_k, c.k_scale, TL * 2 * sizeof(float));
  assert_memory_equal(host + o_v, c.v_scale, TL * 2 * sizeof(float));
  assert_true(c.k_scale[3] == ks[3] && c.v_scale[5] == vs[5]);
  const kvi__xlayer *ly = (const kvi__xlayer *)host;
  /* every byte of [0, total) is claimed by exactly one part (alignment padding aside) */
  unsigned char *claim = calloc(total, 1);
  assert_non_null(claim);
#define CLAIM(off, n)                                                                              \
  do {                                                                                             \
    assert_true((size_t)(off) % 16 == 0 && (size_t)(off) + (size_t)(n) <= total);                 \
    for (size_t z_ = 0; z_ < (size_t)(n); z_++) assert_int_equal(claim[(size_t)(off) + z_]++, 0);  \
  } while (0)
  CLAIM(0, TL * sizeof(kvi__xlayer));
  CLAIM(o_k, TL * 2 * sizeof(float));
  CLAIM(o_v, TL * 2 * sizeof(float));
  for (int l = 0; l < TL; l++) {
    const kvi__rope *r = &s->rope[l];
    assert_ptr_equal(ly[l].k, c.k[l]);
    assert_ptr_equal(ly[l].v, c.v[l]);
    assert_int_equal(ly[l].style, (int32_t)r->style);
    assert_int_equal(ly[l].rot, r->style == KVI_ROPE_NONE ? 0 : r->rotary_dim);
    /* rope_id: the first layer that rotates alike */
    int first = 0;
    while (!rotate_alike(m, s, first, l)) first++;
    assert_true(ly[l].rope_id <= l && ly[ly[l].rope_id].rope_id == ly[l].rope_id);
    assert_true(rotate_alike(m, s, ly[l].rope_id, l)); /* never shared between different rotations */
    if (r->style == KVI_ROPE_NONE) {
      assert_null(ly[l].table);
      assert_null(ly[l].inv_freq);
      continue;
    }
    if (!r->table) { /* a formula: its own frequencies */
      assert_int_equal(ly[l].rope_id, first); /* alike formulas share */
      assert_null(ly[l].table);
      const size_t off = (size_t)((const char *)ly[l].inv_freq - dev);
      CLAIM(off, (size_t)(r->rotary_dim / 2) * sizeof(float));
      assert_memory_equal(host + off, r->inv_freq, (size_t)(r->rotary_dim / 2) * sizeof(float));
    } else { /* a table: laid out once, shared by the layers holding it */
      assert_null(ly[l].inv_freq);
      int owner = 0;
      while (s->rope[owner].table != r->table) owner++;
      const size_t off = (size_t)((const char *)ly[l].table - dev);
      if (owner == l) {
        CLAIM(off, (size_t)r->table->positions * (size_t)r->rotary_dim * sizeof(float));
        assert_memory_equal(host + off, r->table->data, (size_t)r->table->positions * r->rotary_dim * sizeof(float));
      } else {
        assert_ptr_equal(ly[l].table, ly[owner].table);
      }
    }
  }
#undef CLAIM
  size_t end = 0; /* no byte past the last part */
  for (size_t z = 0; z < total; z++)
    if (claim[z]) end = z + 1;
  assert_int_equal(end, total);
  /* the layers the test set: 2 shares 1's id, table layers 0, 5 share 0's,
   * NoPE layers 3 and 6 share an id, 4 is alone */
  assert_int_equal(ly[2].rope_id, 1);
  assert_int_equal(ly[5].rope_id, 0);
  assert_int_equal(ly[6].rope_id, 3);
  assert_int_equal(ly[4].rope_id, 4);
  free(claim);
  free(host);
  free(dev);
  kvi__cache_release(&c);
  free(cachebuf);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layers_per_cta),
      cmocka_unit_test(test_variant_selection),
      cmocka_unit_test(test_layer_tables),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
