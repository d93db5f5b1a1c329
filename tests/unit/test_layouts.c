/*
 * unit-layouts: injection into (and capture from) every engine preset of
 * kvi_cache_preset and hand-made generic layouts. Each cache is allocated as
 * the engine's tensor(s), poisoned with 0x7f bytes, and checked element by
 * element at indices computed here from the engine's shape (ref64.h), never
 * through the library's strides; every byte no injected token lives in must
 * still be poison. Cache dtypes fp32, fp16, bf16, fp8 e4m3 (per-tensor and
 * per-head scales) and e5m2; block tables of shuffled block ids; first slots
 * in the middle of a block, so facts straddle blocks. Layouts whose head
 * vectors are not contiguous and whose V has its own strides (vLLM's CPU
 * cache, a transposed V), callers of the first struct_size, and the
 * layout checks.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "ref64.h"

#define L 3
#define HT 4 /* KV heads of the model; tp 2, rank 1: 2 local heads */
#define H 2
#define D 16
#define P 4 /* store page tokens */

#include "mixed_store.h"

static int setup(void **state) { return mixed_store_setup(state, "unit-layouts fixture"); }
static int teardown(void **state) { return mixed_store_teardown(state); }

typedef struct cfg {
  int preset;
  int32_t BS;
  int64_t NB;
  int64_t fs0, fs1; /* first slots of the two requests */
  int extra;        /* spare table entries past the ones used */
  bool old_size;    /* the layout as a caller of the first kvi_cache_layout passes it */
} cfg;

static const dcase dcases[] = {
    {KVI_DTYPE_FP32, KVI_SCALE_NONE},         {KVI_DTYPE_FP16, KVI_SCALE_NONE},
    {KVI_DTYPE_BF16, KVI_SCALE_NONE},         {KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_TENSOR},
    {KVI_DTYPE_FP8_E4M3, KVI_SCALE_PER_HEAD}, {KVI_DTYPE_FP8_E5M2, KVI_SCALE_PER_HEAD},
    {KVI_DTYPE_FP8_E5M2, KVI_SCALE_NONE},
};
#define N_DCASES (sizeof dcases / sizeof dcases[0])

/* One cache: two requests (tenant 7: facts a then b, explicit shuffled
 * positions; tenant 9: fact c, start_position), checked in the engine's
 * tensors; then both regions captured back in one kvi_encode call. */
static void run(fixture *f, const cfg *g, const dcase *dc) {
  char what[256];
  snprintf(what, sizeof what, "%s, %s cache, scales %d, BS %d, NB %lld", preset_name((kvi_cache_preset)g->preset),
           cache_dtype_name(dc->dt), (int)dc->sm, g->BS, (long long)g->NB);
  ecache c;
  ec_make(&c, (kvi_cache_preset)g->preset, dc->dt, L, H, D, g->BS, g->NB, dc->sm, &f->r);
  if (g->old_size) { /* the struct ends before dim_stride: what follows is never read */
    c.lay.struct_size = offsetof(kvi_cache_layout, dim_stride);
    memset((char *)&c.lay + c.lay.struct_size, 0x55, sizeof c.lay - c.lay.struct_size);
  }
  kvi_injector *inj = NULL;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &c.lay, NULL));
  assert_ok(kvi_encoder_create(&enc, f->s, &c.lay, NULL));

  mixed_requests q;
  mixed_requests_make(&q, f, &c, g->fs0, g->fs1, g->extra);
  const int32_t *table0 = q.perm, *table1 = q.perm + q.len0, *pos0 = q.pos0;
  const int32_t len0 = q.len0, len1 = q.len1, start1 = q.start1;
  assert_ok(kvi_inject(inj, q.rq, 2, NULL, NULL));

  ecmask mask;
  ecmask_make(&mask, &c);
  const rfact *facts0[] = {&f->a, &f->b}, *facts1[] = {&f->c};
  ec_check_request(&c, f->rr, facts0, 2, table0, g->fs0, pos0, 0, 0, L, 0.0, &mask, what);
  ec_check_request(&c, f->rr, facts1, 1, table1, g->fs1, NULL, start1, 0, L, 0.0, &mask, what);
  ecmask_check_poison(&mask, &c, what);
  ecmask_free(&mask);

  /* capture both back: fact b's range of request 0 (from the middle of the
   * sequence) and request 1's c */
  kvi_capture cap[2];
  kvi_capture_init(&cap[0], sizeof cap[0]);
  kvi_capture_init(&cap[1], sizeof cap[1]);
  cap[0].tenant = 7, cap[0].fact_id = 100, cap[0].block_table = table0, cap[0].block_table_len = len0;
  cap[0].first_slot = g->fs0 + f->a.T, cap[0].num_tokens = f->b.T, cap[0].positions = pos0 + f->a.T;
  cap[1].tenant = 9, cap[1].fact_id = 100, cap[1].block_table = table1, cap[1].block_table_len = len1;
  cap[1].first_slot = g->fs1, cap[1].num_tokens = f->c.T, cap[1].start_position = start1;
  const uint64_t hash = ec_hash(&c);
  assert_ok(kvi_encode(enc, cap, 2, NULL));
  assert_true(ec_hash(&c) == hash); /* capture only reads the cache */
  rfact got;
  rfact_read(f->s, 7, 100, L, H, D, &got);
  assert_int_equal(got.T, f->b.T);
  check_captured(&got, &f->b, 0, f->rr, &c, pos0 + f->a.T, 0, KVI_DTYPE_FP32, what);
  rfact_free(&got);
  rfact_read(f->s, 9, 100, L, H, D, &got);
  assert_int_equal(got.T, f->c.T);
  check_captured(&got, &f->c, 0, f->rr, &c, NULL, start1, KVI_DTYPE_FP32, what);
  rfact_free(&got);
  assert_ok(kvi_store_remove(f->s, 7, 100));
  assert_ok(kvi_store_remove(f->s, 9, 100));

  free(q.perm);
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  ec_free(&c);
}

static void run_all_dtypes(fixture *f, const cfg *g) {
  for (size_t i = 0; i < N_DCASES; i++) run(f, g, &dcases[i]);
}

static void test_vllm_flash_attn(void **state) {
  const cfg g = {KVI_CACHE_VLLM_FLASH_ATTN, 4, 9, 2, 3, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_vllm_flash_attn_hnd(void **state) {
  const cfg g = {KVI_CACHE_VLLM_FLASH_ATTN_HND, 4, 9, 3, 1, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_vllm_flashinfer(void **state) {
  const cfg g = {KVI_CACHE_VLLM_FLASHINFER, 4, 10, 1, 2, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_vllm_flashinfer_hnd(void **state) {
  const cfg g = {KVI_CACHE_VLLM_FLASHINFER_HND, 8, 8, 5, 6, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_vllm_packed(void **state) {
  const cfg g = {KVI_CACHE_VLLM_PACKED, 4, 9, 2, 3, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_vllm_packed_hnd(void **state) {
  const cfg g = {KVI_CACHE_VLLM_PACKED_HND, 4, 9, 3, 2, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_sglang_token_granular(void **state) {
  const cfg g = {KVI_CACHE_SGLANG, 1, 26, 3, 2, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_sglang_paged(void **state) {
  const cfg g = {KVI_CACHE_SGLANG, 4, 9, 2, 3, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_trtllm(void **state) {
  const cfg g = {KVI_CACHE_TRTLLM, 4, 9, 1, 3, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_hf_contiguous(void **state) {
  /* blocks are batch rows (NB = batch 3), BS = capacity 20; a table is {row} */
  const cfg g = {KVI_CACHE_HF_CONTIGUOUS, 20, 3, 3, 11, 0, false};
  run_all_dtypes(*state, &g);
}

static void test_generic_kv_bases(void **state) {
  const cfg g = {EC_GENERIC_KV_BASES, 4, 9, 2, 1, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_generic_v_offset(void **state) {
  const cfg g = {EC_GENERIC_V_OFFSET, 4, 9, 3, 2, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_generic_pool(void **state) {
  const cfg g = {EC_GENERIC_POOL, 2, 16, 1, 1, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_generic_gaps(void **state) {
  const cfg g = {EC_GENERIC_GAPS, 4, 9, 2, 3, 1, false};
  run_all_dtypes(*state, &g);
}

/* vLLM's CPU cache: K token-fastest ([D][BS] per block and head), V [BS][D]
 * after it in the same region. */
static void test_vllm_cpu(void **state) {
  const cfg g = {KVI_CACHE_VLLM_CPU, 4, 9, 2, 3, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_vllm_cpu_wide_blocks(void **state) {
  const cfg g = {KVI_CACHE_VLLM_CPU, 16, 4, 13, 9, 0, false}; /* facts straddle 16-token blocks */
  run_all_dtypes(*state, &g);
}

static void test_generic_transposed_v(void **state) {
  const cfg g = {EC_GENERIC_VT, 4, 9, 3, 1, 1, false};
  run_all_dtypes(*state, &g);
}

static void test_generic_transposed_v_token_granular(void **state) {
  const cfg g = {EC_GENERIC_VT, 1, 30, 2, 4, 1, false}; /* llama.cpp's cells: one token per block */
  run_all_dtypes(*state, &g);
}

static void test_generic_mixed_planes(void **state) {
  const cfg g = {EC_GENERIC_MIXED, 4, 9, 1, 2, 1, false};
  run_all_dtypes(*state, &g);
}

/* A caller of the first kvi_cache_layout (struct_size before dim_stride)
 * keeps its meaning: V has K's strides, head vectors are contiguous, and
 * the bytes past its struct (0x55 here) are never read. */
static void test_first_struct_size(void **state) {
  const cfg a = {KVI_CACHE_VLLM_FLASHINFER_HND, 4, 9, 3, 2, 1, true};
  run_all_dtypes(*state, &a);
  const cfg b = {EC_GENERIC_GAPS, 4, 9, 2, 3, 1, true};
  run_all_dtypes(*state, &b);
}

/* Layout checks: each one refuses with a message naming the field, and the
 * good layout still works after. */
static void expect_refused(fixture *f, const kvi_cache_layout *lay, const char *needle) {
  kvi_injector *inj = (kvi_injector *)(uintptr_t)1;
  kvi_encoder *enc = (kvi_encoder *)(uintptr_t)1;
  assert_status(kvi_injector_create(&inj, f->s, lay, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_injector_create", needle);
  assert_true(inj == (kvi_injector *)(uintptr_t)1);
  assert_status(kvi_encoder_create(&enc, f->s, lay, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_encoder_create", needle);
  assert_true(enc == (kvi_encoder *)(uintptr_t)1);
}

static void test_layout_checks(void **state) {
  fixture *f = *state;
  ecache c;
  ec_make(&c, KVI_CACHE_VLLM_CPU, KVI_DTYPE_BF16, L, H, D, 4, 9, KVI_SCALE_NONE, &f->r);
  const kvi_cache_layout good = c.lay;
  kvi_cache_layout l;
  /* negative strides, each named */
  static const char *names[] = {"dim_stride", "v_block_stride", "v_token_stride", "v_head_stride", "v_dim_stride"};
  int64_t *fields[5];
  for (int i = 0; i < 5; i++) {
    l = good;
    fields[0] = &l.dim_stride, fields[1] = &l.v_block_stride, fields[2] = &l.v_token_stride;
    fields[3] = &l.v_head_stride, fields[4] = &l.v_dim_stride;
    *fields[i] = -1;
    char needle[64];
    snprintf(needle, sizeof needle, "layout->%s is -1", names[i]);
    expect_refused(f, &l, needle);
  }
  /* overflowing extents, per plane */
  l = good;
  l.v_dim_stride = INT64_MAX / 4;
  expect_refused(f, &l, "V extent overflows");
  l = good;
  l.dim_stride = INT64_MAX / 8;
  expect_refused(f, &l, "K extent overflows");
  l = good;
  l.v_block_stride = INT64_MAX / 16; /* each plane fits, the byte offsets do not */
  expect_refused(f, &l, "extent overflows");
  /* two elements of one token at one place: K heads over each other, V dims
   * over the next head's */
  l = good;
  l.head_stride = (D - 1) * 4; /* = 60 < D * BS: head 1 dim 0 is head 0 dim 15 */
  expect_refused(f, &l, "K's blocks, tokens, heads or dims overlap (block_stride 256, token_stride 1, head_stride 60, dim_stride 4");
  l = good;
  l.v_dim_stride = 2;
  l.v_head_stride = D; /* head 1 dim 0 = head 0 dim 8 */
  l.v_token_stride = 2 * D * H;
  expect_refused(f, &l, "V's blocks, tokens, heads or dims overlap (v_block_stride");
  /* K and V of one token overlapping: V inside K's span, V on K, K and V interleaved */
  l = good;
  l.v_offset = 40; /* K of token 0 spans elements 0..60 (dim stride 4) */
  expect_refused(f, &l, "layer 0's K and V overlap");
  l = good;
  l.v_offset = 0;
  l.v_token_stride = 0, l.v_dim_stride = 0; /* V = K */
  expect_refused(f, &l, "K and V overlap");
  l = good;
  l.v_offset = 1;
  l.v_token_stride = 0, l.v_dim_stride = 0; /* V's dims between K's (dim stride 4 = BS) */
  expect_refused(f, &l, "K and V overlap");
  /* V of a block's last token lies inside the next head's K span of that
   * token (elements 131..191): only a corner of the blocks x tokens box shows it */
  l = good;
  l.v_token_stride = 2 * D;
  expect_refused(f, &l, "K and V overlap");
  /* V's token 0 on K's last element of the block's last token (another token) */
  l = good;
  l.v_offset = D * 4 - 1;
  expect_refused(f, &l, "layer 0's K and V overlap");
  /* K and V interleaved element by element never share an address: accepted */
  l = good;
  l.token_stride = 2 * D, l.dim_stride = 2, l.v_offset = 1, l.v_token_stride = 0, l.v_dim_stride = 0;
  l.head_stride = 2 * D * 4, l.block_stride = 2 * D * 4 * H;
  kvi_injector *il = NULL;
  assert_ok(kvi_injector_create(&il, f->s, &l, NULL));
  kvi_injector_destroy(il);
  /* the good layout is accepted, with the same K strides spelled out and
   * the V defaults written as KVI_STRIDE_SAME */
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &good, NULL));
  kvi_injector_destroy(inj);
  l = good;
  l.v_block_stride = KVI_STRIDE_SAME, l.v_head_stride = l.head_stride;
  assert_ok(kvi_injector_create(&inj, f->s, &l, NULL));
  kvi_injector_destroy(inj);
  ec_free(&c);
}

/* The preset fills what it documents and asks for what it needs. */
static void test_preset_arguments(void **state) {
  (void)state;
  char k0[64], k1[64], v0[64], v1[64];
  void *kl[2] = {k0, k1}, *vl[2] = {v0, v1};
  kvi_cache_layout lay;
  for (int p = KVI_CACHE_VLLM_FLASH_ATTN; p <= KVI_CACHE_VLLM_CPU; p++) {
    const bool pool = p == KVI_CACHE_TRTLLM, sep = p == KVI_CACHE_SGLANG || p == KVI_CACHE_HF_CONTIGUOUS;
    memset(&lay, 0x33, sizeof lay);
    assert_ok(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, pool ? NULL : kl,
                                      sep ? vl : NULL, pool ? k0 : NULL));
    /* the first struct version that holds what the preset sets */
    assert_int_equal(lay.struct_size, p == KVI_CACHE_VLLM_CPU ? sizeof lay : offsetof(kvi_cache_layout, dim_stride));
    assert_int_equal(lay.dtype, KVI_DTYPE_BF16);
    assert_int_equal(lay.num_layers, 2);
    assert_int_equal(lay.num_heads, 2);
    assert_int_equal(lay.head_size, 4);
    assert_int_equal(lay.block_size, 4);
    assert_int_equal(lay.num_blocks, 3);
    assert_int_equal(lay.scale_mode, KVI_SCALE_NONE);
    assert_null(lay.k_scales);
    if (pool) assert_ptr_equal(lay.k_base, k0);
    else assert_ptr_equal(lay.k_layers, kl);
    if (sep) assert_ptr_equal(lay.v_layers, vl);
    if (p == KVI_CACHE_VLLM_CPU) { /* H 2, D 4, BS 4: per (block, head) 32 elements, K [4][4] then V [4][4] */
      assert_int_equal(lay.block_stride, 64);
      assert_int_equal(lay.head_stride, 32);
      assert_int_equal(lay.token_stride, 1);
      assert_int_equal(lay.dim_stride, 4);
      assert_int_equal(lay.v_offset, 16);
      assert_int_equal(lay.v_block_stride, KVI_STRIDE_SAME);
      assert_int_equal(lay.v_head_stride, KVI_STRIDE_SAME);
      assert_int_equal(lay.v_token_stride, 4);
      assert_int_equal(lay.v_dim_stride, 1);
    } else { /* the first version: nothing past it is written */
      const unsigned char *tail = (const unsigned char *)&lay + offsetof(kvi_cache_layout, dim_stride);
      for (size_t j = 0; j < sizeof lay - offsetof(kvi_cache_layout, dim_stride); j++) assert_int_equal(tail[j], 0x33);
    }
    /* missing pointers */
    const kvi_cache_layout keep = lay;
    if (pool) {
      assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, kl, vl, NULL),
                    KVI_ERR_INVALID_ARGUMENT);
    } else {
      assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, NULL, vl, k0),
                    KVI_ERR_INVALID_ARGUMENT);
      if (sep)
        assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, kl, NULL, k0),
                      KVI_ERR_INVALID_ARGUMENT);
    }
    /* sizes < 1 */
    assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 0, 2, 4, 4, 3, kl, vl, k0),
                  KVI_ERR_INVALID_ARGUMENT);
    assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 2, 2, 4, 0, 3, kl, vl, k0),
                  KVI_ERR_INVALID_ARGUMENT);
    assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)p, KVI_DTYPE_BF16, 2, 2, 4, 4, 0, kl, vl, k0),
                  KVI_ERR_INVALID_ARGUMENT);
    assert_memory_equal(&lay, &keep, sizeof lay); /* unchanged on error */
  }
  assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)0, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, kl, vl, k0),
                KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_cache_layout_preset(&lay, (kvi_cache_preset)11, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, kl, vl, k0),
                KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_cache_layout_preset(NULL, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_BF16, 2, 2, 4, 4, 3, kl, vl, k0),
                KVI_ERR_INVALID_ARGUMENT);
}

#define T(name) cmocka_unit_test_setup_teardown(name, setup, teardown)

int main(void) {
  const struct CMUnitTest tests[] = {
      T(test_vllm_flash_attn),    T(test_vllm_flash_attn_hnd),    T(test_vllm_flashinfer),
      T(test_vllm_flashinfer_hnd), T(test_vllm_packed),           T(test_vllm_packed_hnd),
      T(test_sglang_token_granular), T(test_sglang_paged),        T(test_trtllm),
      T(test_hf_contiguous),      T(test_generic_kv_bases),       T(test_generic_v_offset),
      T(test_generic_pool),       T(test_generic_gaps),           T(test_vllm_cpu),
      T(test_vllm_cpu_wide_blocks), T(test_generic_transposed_v), T(test_generic_transposed_v_token_granular),
      T(test_generic_mixed_planes), T(test_first_struct_size),    T(test_layout_checks),
      cmocka_unit_test(test_preset_arguments),
  };
  return cmocka_run_group_tests_name("unit-layouts", tests, NULL, NULL);
}
