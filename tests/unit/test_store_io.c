/*
 * unit-store-io: kvi_store_put / kvi_store_read round trips, checked element
 * by element against an independent reference conversion (unit.h), for every
 * source, storage and destination dtype, strided and aliased layouts, and
 * page sizes 1, 16 and 5.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#define L 3
#define H 4 /* tp 2, rank 1: 2 local heads */
#define LH 2
#define D 6

static int setup(void **state) {
  store_fixture *f = store_fixture_new(L, H, D, 1, 2);
  *state = f;
  return 0;
}

static uint64_t page_bytes_for(int32_t P, kvi_dtype dt) {
  return (uint64_t)P * L * 2 * LH * D * kvi_dtype_size(dt);
}

static void new_store(store_fixture *f, kvi_dtype dt, int32_t P, uint32_t pages) {
  kvi_store_destroy(f->s);
  f->s = NULL;
  kvi_store_options o = cpu_store_options(dt, P, page_bytes_for(P, dt) * pages);
  assert_ok(kvi_store_create(&f->s, f->m, &o));
}

/* Values whose rounding is easy to get wrong: fp16 overflow, fp16 and fp32
 * subnormals, ties in fp16 and bf16, the largest finite values, -0. */
static const float edge_values[] = {
    70000.0f,      -70000.0f,    65504.0f,     65519.0f,    65520.0f,      -65520.0f,
    0x1p-24f,      0x1p-25f,     0x1.8p-24f,   0x1.8p-25f,  0x1p-26f,      0x1.ff8p-15f,
    0x1.ffcp-15f,  0x1.002p0f,   0x1.006p0f,   0x1.01p0f,   0x1.03p0f,     0x1.0101p0f,
    FLT_MAX,       -FLT_MAX,     0x1.ffp127f,  0x1.fep127f, 0x1.fefffep127f, 1e-40f,
    -0.0f,         3.0f,         -0x1p-149f,   0x1.7ffp-10f,
};
#define N_EDGES (sizeof edge_values / sizeof edge_values[0])

/* Writes the edge values over the first elements of K (fp32 sources only). */
static void put_edges(kvbuf *b) {
  size_t i = 0;
  for (int l = 0; l < L && i < N_EDGES; l++)
    for (int t = 0; t < b->v.num_tokens && i < N_EDGES; t++)
      for (int h = 0; h < LH && i < N_EDGES; h++)
        for (int d = 0; d < D && i < N_EDGES; d++) ((float *)b->mem)[kvbuf_index(b, 0, l, t, h, d)] = edge_values[i++];
}

/* Checks dst against src converted to store_dt then to dst's dtype, and that
 * no byte outside dst's elements was written. */
static void check_read(const kvbuf *src, kvi_dtype store_dt, const kvbuf *dst, const char *what) {
  const int T = dst->v.num_tokens;
  const size_t es = kvi_dtype_size(dst->v.dtype);
  unsigned char *mask = calloc((size_t)dst->elems, 1);
  assert_non_null(mask);
  for (int p = 0; p < 2; p++)
    for (int l = 0; l < L; l++)
      for (int t = 0; t < T; t++)
        for (int h = 0; h < LH; h++)
          for (int d = 0; d < D; d++) {
            const float x = ref_load(src->mem, src->v.dtype, kvbuf_index(src, p, l, t, h, d));
            const uint32_t want = ref_bits(ref_round(x, store_dt), dst->v.dtype);
            const int64_t j = kvbuf_index(dst, p, l, t, h, d);
            const uint32_t got = load_bits(dst->mem, dst->v.dtype, j);
            mask[j] = 1;
            if (got != want) {
              free(mask);
              fail_msg("%s: %s[l=%d t=%d h=%d d=%d]: source %a (%s) stored as %s, read as %s: got 0x%x, "
                       "expected 0x%x",
                       what, p ? "V" : "K", l, t, h, d, (double)x, dtype_name(src->v.dtype), dtype_name(store_dt),
                       dtype_name(dst->v.dtype), got, want);
            }
          }
  for (int64_t j = 0; j < dst->elems; j++)
    if (!mask[j])
      for (size_t b = 0; b < es; b++)
        if (dst->mem[(size_t)j * es + b] != 0xA5) {
          free(mask);
          fail_msg("%s: element %lld of the destination is not part of the view but was written", what,
                   (long long)j);
        }
  free(mask);
}

/* One store dtype: every source dtype, page size, token count and layout;
 * each fact read back into every dtype. */
static void roundtrip(store_fixture *f, kvi_dtype store_dt) {
  const int32_t Ps[] = {1, 16, 5};
  uint64_t id = 0;
  for (size_t pi = 0; pi < 3; pi++) {
    const int32_t P = Ps[pi];
    new_store(f, store_dt, P, 8);
    const uint64_t bytes_per_token = page_bytes_for(P, store_dt) / (uint64_t)P;
    for (size_t si = 0; si < 3; si++) {
      const kvi_dtype src_dt = float_dtypes[si];
      const int32_t Ts[] = {1, P, 2 * P, 3 * P + 2};
      for (size_t ti = 0; ti < 4; ti++) {
        const int32_t T = Ts[ti];
        for (int lay = 0; lay < LAYOUT_COUNT; lay++) {
          kvbuf src;
          kvbuf_make(&src, (layout)lay, src_dt, L, T, LH, D);
          kvbuf_fill(&src, &f->r);
          if (src_dt == KVI_DTYPE_FP32) put_edges(&src);
          id++;
          const uint64_t tenant = 1000 + pi;
          assert_ok(kvi_store_put(f->s, tenant, id, &src.v, NULL, NULL));
          int32_t tokens = 0;
          assert_ok(kvi_store_fact_tokens(f->s, tenant, id, &tokens));
          assert_int_equal(tokens, T);
          const kvi_store_stats st = store_stats(f->s);
          assert_int_equal(st.pages_used, div_up((uint64_t)T, (uint64_t)P));
          assert_int_equal(st.bytes_payload, (uint64_t)T * bytes_per_token);
          assert_int_equal(st.facts, 1);
          for (size_t ri = 0; ri < 3; ri++) {
            const kvi_dtype dst_dt = float_dtypes[ri];
            const layout dl = (layout)((lay + ri + ti + si) % LAYOUT_DST_COUNT);
            kvbuf dst;
            kvbuf_make(&dst, dl, dst_dt, L, T, LH, D);
            assert_ok(kvi_store_read(f->s, tenant, id, &dst.v, NULL));
            char what[160];
            snprintf(what, sizeof what, "P=%d T=%d %s source (%s) -> %s store -> %s destination (%s)", P, T,
                     dtype_name(src_dt), layout_name((layout)lay), dtype_name(store_dt), dtype_name(dst_dt),
                     layout_name(dl));
            check_read(&src, store_dt, &dst, what);
            kvbuf_free(&dst);
          }
          assert_ok(kvi_store_remove(f->s, tenant, id));
          assert_int_equal(store_stats(f->s).pages_used, 0);
          kvbuf_free(&src);
        }
      }
    }
  }
}

static void test_roundtrip_fp32_store(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  roundtrip(f, KVI_DTYPE_FP32);
}

static void test_roundtrip_fp16_store(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  roundtrip(f, KVI_DTYPE_FP16);
}

static void test_roundtrip_bf16_store(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  roundtrip(f, KVI_DTYPE_BF16);
}

/* The reference itself, on values worked out by hand. */
static void test_reference_conversions(void **state) {
  (void)state;
  assert_int_equal(ref_f32_to_f16(70000.0f), 0x7c00);
  assert_int_equal(ref_f32_to_f16(-70000.0f), 0xfc00);
  assert_int_equal(ref_f32_to_f16(65504.0f), 0x7bff);
  assert_int_equal(ref_f32_to_f16(65519.0f), 0x7bff);
  assert_int_equal(ref_f32_to_f16(65520.0f), 0x7c00);
  assert_int_equal(ref_f32_to_f16(0x1p-24f), 0x0001);
  assert_int_equal(ref_f32_to_f16(0x1p-25f), 0x0000);
  assert_int_equal(ref_f32_to_f16(0x1.8p-24f), 0x0002);
  assert_int_equal(ref_f32_to_f16(0x1.ffcp-15f), 0x0400);
  assert_int_equal(ref_f32_to_f16(0x1.002p0f), 0x3c00);
  assert_int_equal(ref_f32_to_f16(0x1.006p0f), 0x3c02);
  assert_int_equal(ref_f32_to_f16(-0.0f), 0x8000);
  assert_true(ref_f16_to_f32(0x0001) == 0x1p-24f);
  assert_true(ref_f16_to_f32(0x7bff) == 65504.0f);
  assert_int_equal(ref_f32_to_bf16(1.0f), 0x3f80);
  assert_int_equal(ref_f32_to_bf16(0x1.01p0f), 0x3f80);
  assert_int_equal(ref_f32_to_bf16(0x1.03p0f), 0x3f82);
  assert_int_equal(ref_f32_to_bf16(0x1.0101p0f), 0x3f81);
  assert_int_equal(ref_f32_to_bf16(-0x1.03p0f), 0xbf82);
  assert_int_equal(ref_f32_to_bf16(FLT_MAX), 0x7f80);
  assert_int_equal(ref_f32_to_bf16(0x1.ffp127f), 0x7f80);
  assert_int_equal(ref_f32_to_bf16(0x1.fefffep127f), 0x7f7f);
  assert_int_equal(ref_f32_to_bf16(1e-40f), 0x0001);
  assert_int_equal(ref_f32_to_bf16(-0x1p-149f), 0x8000);
  assert_int_equal(ref_f32_to_bf16(INFINITY), 0x7f80);
  assert_int_equal(ref_f32_to_bf16(-0.0f), 0x8000);
}

/* Edge values through an fp16 / bf16 store into fp32, against hand-worked
 * answers (independent of the reference functions). */
static void edge_case(store_fixture *f, kvi_dtype store_dt, const float *in, const float *want, size_t n) {
  new_store(f, store_dt, 4, 4);
  /* one head vector of each token of layer 0, K; everything else 1.0 */
  const int32_t T = (int32_t)div_up(n, D);
  kvbuf src, dst;
  kvbuf_make(&src, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, LH, D);
  for (int64_t i = 0; i < src.elems; i++) ((float *)src.mem)[i] = 1.0f;
  for (size_t i = 0; i < n; i++) ((float *)src.mem)[kvbuf_index(&src, 0, 0, (int)(i / D), 1, (int)(i % D))] = in[i];
  assert_ok(kvi_store_put(f->s, 1, 1, &src.v, NULL, NULL));
  kvbuf_make(&dst, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, LH, D);
  assert_ok(kvi_store_read(f->s, 1, 1, &dst.v, NULL));
  for (size_t i = 0; i < n; i++) {
    const float got = ((float *)dst.mem)[kvbuf_index(&dst, 0, 0, (int)(i / D), 1, (int)(i % D))];
    if (f2u(got) != f2u(want[i]))
      fail_msg("%s store: %a read back as %a, expected %a", dtype_name(store_dt), (double)in[i], (double)got,
               (double)want[i]);
  }
  kvbuf_free(&src);
  kvbuf_free(&dst);
}

static void test_fp16_edge_values(void **state) {
  const float in[] = {70000.0f, -70000.0f,   65504.0f,     65519.0f,     65520.0f,  0x1p-24f,
                      0x1p-25f, 0x1.8p-24f,  0x1.8p-25f,   0x1p-26f,     0x1.ff8p-15f, 0x1.ffcp-15f,
                      0x1.002p0f, 0x1.006p0f, -0.0f,       FLT_MAX,      1e-40f,    -0x1.0p-25f};
  const float want[] = {INFINITY, -INFINITY,  65504.0f,    65504.0f,     INFINITY,  0x1p-24f,
                        0.0f,     0x1p-23f,   0x1p-24f,    0.0f,         0x1.ff8p-15f, 0x1p-14f,
                        1.0f,     0x1.008p0f, -0.0f,       INFINITY,     0.0f,      -0.0f};
  edge_case(*state, KVI_DTYPE_FP16, in, want, sizeof in / sizeof in[0]);
}

static void test_bf16_edge_values(void **state) {
  const float in[] = {0x1.01p0f,   0x1.03p0f, 0x1.0101p0f,    -0x1.03p0f, FLT_MAX, 0x1.ffp127f,
                      0x1.fefffep127f, 1e-40f, -0x1p-149f, -0.0f,      70000.0f, 0x1.7ffp-10f};
  const float want[] = {1.0f,         0x1.04p0f, 0x1.02p0f,  -0x1.04p0f, INFINITY, INFINITY,
                        0x1.fep127f, 0x1p-133f, -0.0f,      -0.0f,      70144.0f, 0x1.8p-10f};
  edge_case(*state, KVI_DTYPE_BF16, in, want, sizeof in / sizeof in[0]);
}

/* A stride-0 source repeats one token's data over every token. */
static void test_put_broadcast_source(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_FP32, 5, 8);
  float row_k[L][LH][D], row_v[L][LH][D];
  for (int l = 0; l < L; l++)
    for (int h = 0; h < LH; h++)
      for (int d = 0; d < D; d++) row_k[l][h][d] = rand_float(&f->r), row_v[l][h][d] = rand_float(&f->r);
  kvi_kv_view v = KVI_KV_VIEW_INIT;
  v.memory = KVI_MEMORY_HOST;
  v.dtype = KVI_DTYPE_FP32;
  v.num_layers = L;
  v.num_tokens = 13;
  v.num_heads = LH;
  v.head_size = D;
  v.layer_stride = LH * D;
  v.token_stride = 0;
  v.head_stride = D;
  v.k = row_k;
  v.v = row_v;
  assert_ok(kvi_store_put(f->s, 3, 3, &v, NULL, NULL));
  float out_k[L][13][LH][D], out_v[L][13][LH][D];
  kvi_kv_view o;
  kvi_kv_view_contiguous(&o, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 13, LH, D, out_k, out_v);
  assert_ok(kvi_store_read(f->s, 3, 3, &o, NULL));
  for (int l = 0; l < L; l++)
    for (int t = 0; t < 13; t++) {
      assert_memory_equal(out_k[l][t], row_k[l], sizeof row_k[l]);
      assert_memory_equal(out_v[l][t], row_v[l], sizeof row_v[l]);
    }
}

/* K and V halves of one [T][2][H][D] buffer in, and out again. */
static void test_kv_in_one_buffer(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_BF16, 16, 4);
  const int T = 21;
  kvbuf src, dst;
  kvbuf_make(&src, LAYOUT_KV_INTERLEAVED, KVI_DTYPE_BF16, L, T, LH, D);
  kvbuf_fill(&src, &f->r);
  assert_ptr_equal((unsigned char *)src.v.v, (unsigned char *)src.v.k + LH * D * 2);
  assert_int_equal(src.v.token_stride, 2 * LH * D);
  assert_ok(kvi_store_put(f->s, 9, 9, &src.v, NULL, NULL));
  kvbuf_make(&dst, LAYOUT_KV_INTERLEAVED, KVI_DTYPE_BF16, L, T, LH, D);
  assert_ok(kvi_store_read(f->s, 9, 9, &dst.v, NULL));
  /* bf16 -> bf16 -> bf16 is bit-exact: the buffers are identical */
  assert_memory_equal(src.mem, dst.mem, src.bytes);
  kvbuf_free(&src);
  kvbuf_free(&dst);
}

/* A source may alias itself: K and V the same buffer. */
static void test_put_k_v_same_buffer(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_FP32, 5, 4);
  const int T = 7;
  kvbuf src, dst;
  kvbuf_make(&src, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, LH, D);
  kvbuf_fill(&src, &f->r);
  src.v.v = src.v.k;
  assert_ok(kvi_store_put(f->s, 2, 2, &src.v, NULL, NULL));
  kvbuf_make(&dst, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, LH, D);
  assert_ok(kvi_store_read(f->s, 2, 2, &dst.v, NULL));
  const size_t half = dst.bytes / 2;
  assert_memory_equal(dst.mem, src.mem, half);        /* K */
  assert_memory_equal(dst.mem + half, src.mem, half); /* V is K */
  kvbuf_free(&src);
  kvbuf_free(&dst);
}

/* A destination with V below K in memory is fine. */
static void test_read_v_before_k(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_BF16, 16, 4);
  const int T = 19;
  kvbuf src, dst;
  kvbuf_make(&src, LAYOUT_TOKEN_MAJOR, KVI_DTYPE_FP16, L, T, LH, D);
  kvbuf_fill(&src, &f->r);
  assert_ok(kvi_store_put(f->s, 0, 1, &src.v, NULL, NULL));
  kvbuf_make(&dst, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, LH, D);
  void *k = dst.v.k;
  dst.v.k = dst.v.v;
  dst.v.v = k;
  assert_ok(kvi_store_read(f->s, 0, 1, &dst.v, NULL));
  check_read(&src, KVI_DTYPE_BF16, &dst, "fp16 -> bf16 store -> fp32 with V before K");
  kvbuf_free(&src);
  kvbuf_free(&dst);
}

/* A host source is copied before put returns: it may be changed or freed. */
static void test_source_reusable_after_put(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_FP16, 16, 4);
  const int T = 33;
  kvbuf src, keep, dst;
  kvbuf_make(&src, LAYOUT_PADDED, KVI_DTYPE_BF16, L, T, LH, D);
  kvbuf_fill(&src, &f->r);
  kvbuf_make(&keep, LAYOUT_PADDED, KVI_DTYPE_BF16, L, T, LH, D);
  memcpy(keep.mem, src.mem, src.bytes);
  assert_ok(kvi_store_put(f->s, 5, 5, &src.v, NULL, NULL));
  kvbuf_fill(&src, &f->r);
  kvbuf_free(&src);
  kvbuf_make(&dst, LAYOUT_KV_INTERLEAVED, KVI_DTYPE_BF16, L, T, LH, D);
  assert_ok(kvi_store_read(f->s, 5, 5, &dst.v, NULL));
  check_read(&keep, KVI_DTYPE_FP16, &dst, "source overwritten after put");
  kvbuf_free(&keep);
  kvbuf_free(&dst);
}

/* Many facts at once: none overwrites another's pages. */
static void test_many_facts_coexist(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  const int32_t P = 5;
  new_store(f, KVI_DTYPE_FP16, P, 64);
  enum { N = 24 };
  kvbuf src[N];
  uint32_t used = 0;
  int n = 0;
  for (; n < N; n++) {
    const int32_t T = (int32_t)rng_range(&f->r, 1, 3 * P);
    if (used + div_up((uint64_t)T, P) > 64) break;
    used += (uint32_t)div_up((uint64_t)T, P);
    kvbuf_make(&src[n], (layout)(n % LAYOUT_COUNT), float_dtypes[n % 3], L, T, LH, D);
    kvbuf_fill(&src[n], &f->r);
    assert_ok(kvi_store_put(f->s, (uint64_t)(n % 3), (uint64_t)n, &src[n].v, NULL, NULL));
  }
  assert_int_equal(store_stats(f->s).pages_used, used);
  for (int i = n - 1; i >= 0; i--) {
    kvbuf dst;
    kvbuf_make(&dst, (layout)(i % LAYOUT_DST_COUNT), KVI_DTYPE_FP32, L, src[i].v.num_tokens, LH, D);
    assert_ok(kvi_store_read(f->s, (uint64_t)(i % 3), (uint64_t)i, &dst.v, NULL));
    check_read(&src[i], KVI_DTYPE_FP16, &dst, "coexisting facts");
    kvbuf_free(&dst);
    kvbuf_free(&src[i]);
  }
}

/* A read may repeat: reading does not consume or change the fact. */
static void test_read_twice_same_bytes(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_FP16, 16, 4);
  kvbuf src, a, b;
  kvbuf_make(&src, LAYOUT_PADDED, KVI_DTYPE_FP32, L, 17, LH, D);
  kvbuf_fill(&src, &f->r);
  assert_ok(kvi_store_put(f->s, 0, 0, &src.v, NULL, NULL));
  kvbuf_make(&a, LAYOUT_HEAD_MAJOR, KVI_DTYPE_FP16, L, 17, LH, D);
  kvbuf_make(&b, LAYOUT_HEAD_MAJOR, KVI_DTYPE_FP16, L, 17, LH, D);
  assert_ok(kvi_store_read(f->s, 0, 0, &a.v, NULL));
  assert_ok(kvi_store_read(f->s, 0, 0, &b.v, NULL));
  assert_memory_equal(a.mem, b.mem, a.bytes);
  check_read(&src, KVI_DTYPE_FP16, &a, "fp32 padded -> fp16 store -> fp16 head-major");
  kvbuf_free(&src);
  kvbuf_free(&a);
  kvbuf_free(&b);
}

/* A source view struct larger than this version's, zero past the known
 * fields, is accepted and read only up to them. */
static void test_view_larger_struct_size(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  new_store(f, KVI_DTYPE_FP32, 4, 4);
  kvbuf src;
  kvbuf_make(&src, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 3, LH, D);
  kvbuf_fill(&src, &f->r);
  struct {
    kvi_kv_view v;
    unsigned char later[16];
  } big;
  memset(&big, 0, sizeof big);
  big.v = src.v;
  big.v.struct_size = sizeof big;
  assert_ok(kvi_store_put(f->s, 1, 2, &big.v, NULL, NULL));
  kvbuf dst;
  kvbuf_make(&dst, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 3, LH, D);
  memset(&big, 0, sizeof big);
  big.v = dst.v;
  big.v.struct_size = sizeof big;
  assert_ok(kvi_store_read(f->s, 1, 2, &big.v, NULL));
  assert_memory_equal(src.mem, dst.mem, src.bytes);
  kvbuf_free(&src);
  kvbuf_free(&dst);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_reference_conversions),
      cmocka_unit_test_setup_teardown(test_roundtrip_fp32_store, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_roundtrip_fp16_store, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_roundtrip_bf16_store, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_fp16_edge_values, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_bf16_edge_values, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_put_broadcast_source, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_kv_in_one_buffer, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_put_k_v_same_buffer, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_read_v_before_k, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_source_reusable_after_put, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_many_facts_coexist, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_read_twice_same_bytes, setup, store_fixture_teardown),
      cmocka_unit_test_setup_teardown(test_view_larger_struct_size, setup, store_fixture_teardown),
  };
  return cmocka_run_group_tests_name("unit-store-io", tests, NULL, NULL);
}
