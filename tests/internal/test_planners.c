/*
 * internal-planners: the injector's host planning (lib/transfer.c) checked
 * against invariants over sweeps of its inputs: the layers per CTA of a
 * launch, the kernel variant (vector width) chosen for a cache layout, and
 * the segment length that bounds the kernel's shared memory.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#include "kernels.h"
#include "transfer_internal.h"

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
  bool rot16 = true, rot32 = true;
  for (int l = 0; l < VL; l++) {
    kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
    if (c->rot[l] < 0) {
      r.style = KVI_ROPE_NONE;
    } else {
      r.rotary_dim = c->rot[l];
      const int32_t rd = c->rot[l] ? c->rot[l] : D;
      if (rd / 2 > half_max) half_max = rd / 2;
      rot16 = rot16 && rd % 16 == 0;
      rot32 = rot32 && rd % 32 == 0;
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
  const bool ok16 = ok8 && c->store_dt == KVI_DTYPE_FP8_E4M3 && D % 16 == 0 && rot32 && rows_aligned(k, v, bs, ts, hs, es, 16);
  const int32_t want = ok16 ? 16 : ok8 ? 8 : 1, got = kvi__injector_vec(inj);
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
  int64_t seen[17] = {0};
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
            /* none, full, or a random even partial width */
            c.rot[l] = pick == 0 ? -1 : pick == 1 ? 0 : 2 * (int32_t)rng_range(&r, 1, c.D / 2);
          }
          c.head_pad = rep == 0 ? 0 : pads[rng_range(&r, 0, 5)];
          c.base_off = rep == 0 ? 0 : offs[rng_range(&r, 0, 4)];
          c.dim_stride = rep == 5 ? 2 : 1;
          c.P = (int32_t)rng_range(&r, 1, 80);
          seen[check_variant(&c)]++;
        }
  /* the sweep reaches every variant */
  assert_true(seen[1] > 0 && seen[8] > 0 && seen[16] > 0);
  vcase c = {KVI_DTYPE_FP8_E4M3, KVI_DTYPE_FP16, 64, {0, 32, -1}, 0, 0, 1, 16};
  assert_int_equal(check_variant(&c), 16);
  c.store_dt = KVI_DTYPE_FP16;
  assert_int_equal(check_variant(&c), 8);
  c.head_pad = 1; /* rows two bytes off 16 */
  assert_int_equal(check_variant(&c), 1);
  c.head_pad = 8;
  c.rot[1] = 24; /* a rotated width that is not a multiple of 16 */
  assert_int_equal(check_variant(&c), 1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layers_per_cta),
      cmocka_unit_test(test_variant_selection),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
