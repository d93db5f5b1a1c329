/*
 * gpu suite: kvi_inject_deviation on a CUDA store against the CPU store (the
 * reference) on the same facts and the same cache contents, for every cache
 * preset and several store and cache dtypes, host and device outputs; a
 * device block table naming a block outside the cache gives that token NaN
 * and counts it. Skips, and exits 77, with no device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define GPU_TEST_SEED 0x452821e638d01377ull
#include "gpu_test.h"

#ifdef KVI_HAVE_CUDA

enum { L = 3, H = 2, D = 64, BS = 8, NB = 24, NF = 3 };
static const int32_t fact_tokens[NF] = {5, 19, 7};

/* A cache value of `dt` from random bits, finite and of moderate size. */
static void rand_elem(unsigned char *p, kvi_dtype dt) {
  const uint64_t r = rnd();
  switch (dt) {
  case KVI_DTYPE_FP32: {
    const float f = rndf();
    memcpy(p, &f, 4);
    break;
  }
  case KVI_DTYPE_FP16:
  case KVI_DTYPE_BF16: {
    const uint16_t b = (uint16_t)((r & 0x3fffu) | (r & 0x10000u ? 0x8000u : 0u)); /* exponent below the top half */
    memcpy(p, &b, 2);
    break;
  }
  default: p[0] = (unsigned char)(r & 0xf7u); /* e4m3 / e5m2 without the largest exponents: no NaN or infinity */
  }
}

static void run(kvi_cache_preset preset, kvi_dtype store_dt, kvi_dtype cache_dt) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_model *m;
  CHECK_OK(kvi_model_create(&m, &mo));
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.theta = 500000, r.scaling = KVI_ROPE_SCALING_LLAMA3, r.factor = 8;
  CHECK_OK(kvi_model_set_rope(m, -1, &r));
  r = (kvi_rope_spec)KVI_ROPE_SPEC_INIT;
  r.style = KVI_ROPE_GPTJ, r.rotary_dim = D / 2;
  CHECK_OK(kvi_model_set_rope(m, 2, &r));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.dtype = store_dt, so.page_tokens = 16, so.budget_bytes = 16u << 20, so.backend = KVI_BACKEND_CPU;
  kvi_store *cs, *gs;
  CHECK_OK(kvi_store_create(&cs, m, &so));
  so.backend = KVI_BACKEND_CUDA, so.device = 0;
  CHECK_OK(kvi_store_create(&gs, m, &so));
  for (int f = 0; f < NF; f++) {
    const size_t n = (size_t)L * fact_tokens[f] * H * D;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) k[i] = rndf(), v[i] = rndf();
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, fact_tokens[f], H, D, k, v);
    CHECK_OK(kvi_store_put(cs, 1, (uint64_t)f + 1, &kv, NULL, NULL));
    CHECK_OK(kvi_store_put(gs, 1, (uint64_t)f + 1, &kv, NULL, NULL));
    free(k);
    free(v);
  }
  /* one pool holding L * 2 planes, each plane big enough for any preset's K or V of a layer */
  const size_t es = kvi_dtype_size(cache_dt), plane = (size_t)NB * BS * H * D * es, bytes = plane * 2 * L;
  unsigned char *host = malloc(bytes);
  for (size_t i = 0; i < bytes; i += es) rand_elem(host + i, cache_dt);
  void *dev;
  CUDA_OK(cudaMalloc(&dev, bytes));
  CUDA_OK(cudaMemcpy(dev, host, bytes, cudaMemcpyHostToDevice));
  void *hk[L], *hv[L], *dk[L], *dv[L];
  for (int l = 0; l < L; l++) {
    hk[l] = host + (size_t)l * 2 * plane, hv[l] = (char *)hk[l] + plane;
    dk[l] = (char *)dev + (size_t)l * 2 * plane, dv[l] = (char *)dk[l] + plane;
  }
  kvi_cache_layout hl, dl;
  CHECK_OK(kvi_cache_layout_preset(&hl, preset, cache_dt, L, H, D, BS, NB, hk, hv, host));
  CHECK_OK(kvi_cache_layout_preset(&dl, preset, cache_dt, L, H, D, BS, NB, dk, dv, dev));
  hl.memory = KVI_MEMORY_HOST, dl.memory = KVI_MEMORY_DEVICE;
  float ksc[L], vsc[L];
  for (int l = 0; l < L; l++) ksc[l] = 0.02f * (float)(l + 1), vsc[l] = 0.03f * (float)(l + 1);
  if (cache_dt == KVI_DTYPE_FP8_E4M3 || cache_dt == KVI_DTYPE_FP8_E5M2) {
    hl.scale_mode = dl.scale_mode = KVI_SCALE_PER_TENSOR;
    hl.k_scales = dl.k_scales = ksc, hl.v_scales = dl.v_scales = vsc;
  }
  kvi_injector *ci, *gi;
  CHECK_OK(kvi_injector_create(&ci, cs, &hl, NULL));
  CHECK_OK(kvi_injector_create(&gi, gs, &dl, NULL));

  /* request 0: facts 1, 2 from slot 3 at explicit positions; request 1: fact 3 from slot 5 of its own blocks */
  int32_t table[NB];
  for (int i = 0; i < NB; i++) table[i] = (i * 7 + 5) % NB; /* 7 is prime to 24: a permutation */
  const uint64_t ids0[] = {1, 2}, ids1[] = {3};
  const int32_t T0 = fact_tokens[0] + fact_tokens[1], T = T0 + fact_tokens[2];
  int32_t pos[64];
  for (int i = 0; i < T0; i++) pos[i] = 40 + 3 * i + (int32_t)(rnd() % 3);
  kvi_inject_request rq[2];
  kvi_inject_request_init(&rq[0], sizeof rq[0]);
  kvi_inject_request_init(&rq[1], sizeof rq[1]);
  rq[0].tenant = 1, rq[0].fact_ids = ids0, rq[0].num_facts = 2, rq[0].block_table = table;
  rq[0].block_table_len = 4, rq[0].first_slot = 3, rq[0].positions = pos, rq[0].num_positions = T0;
  rq[1].tenant = 1, rq[1].fact_ids = ids1, rq[1].num_facts = 1, rq[1].block_table = table + 4;
  rq[1].block_table_len = 2, rq[1].first_slot = 5, rq[1].start_position = 1000;
  if (preset == KVI_CACHE_HF_CONTIGUOUS) { /* blocks are batch rows: BS 8 is too short for 26 tokens */
    CHECK_OK(kvi_cache_layout_preset(&hl, preset, cache_dt, L, H, D, NB * BS / 4, 4, hk, hv, host));
    CHECK_OK(kvi_cache_layout_preset(&dl, preset, cache_dt, L, H, D, NB * BS / 4, 4, dk, dv, dev));
    hl.memory = KVI_MEMORY_HOST, dl.memory = KVI_MEMORY_DEVICE;
    if (cache_dt == KVI_DTYPE_FP8_E4M3 || cache_dt == KVI_DTYPE_FP8_E5M2) {
      hl.scale_mode = dl.scale_mode = KVI_SCALE_PER_TENSOR;
      hl.k_scales = dl.k_scales = ksc, hl.v_scales = dl.v_scales = vsc;
    }
    kvi_injector_destroy(ci);
    kvi_injector_destroy(gi);
    CHECK_OK(kvi_injector_create(&ci, cs, &hl, NULL));
    CHECK_OK(kvi_injector_create(&gi, gs, &dl, NULL));
    static const int32_t rows[2] = {2, 0};
    rq[0].block_table = rows, rq[0].block_table_len = 1;
    rq[1].block_table = rows + 1, rq[1].block_table_len = 1;
  }

  float want[64], got[64], *dout;
  CUDA_OK(cudaMalloc((void **)&dout, 64 * sizeof(float)));
  for (int round = 0; round < 2; round++) { /* random cache contents, then right after injection */
    if (round == 1) {
      CHECK_OK(kvi_inject(ci, rq, 2, NULL, NULL));
      CHECK_OK(kvi_inject(gi, rq, 2, NULL, NULL));
      CUDA_OK(cudaDeviceSynchronize());
    }
    for (int l = 0; l < L; l++) {
      CHECK_OK(kvi_inject_deviation(ci, rq, 2, l, want, 64, KVI_MEMORY_HOST, NULL));
      for (int device_out = 0; device_out < 2; device_out++) {
        memset(got, 0, sizeof got);
        if (device_out) {
          CHECK_OK(kvi_inject_deviation(gi, rq, 2, l, dout, 64, KVI_MEMORY_DEVICE, NULL));
          CUDA_OK(cudaMemcpy(got, dout, sizeof got, cudaMemcpyDeviceToHost));
        } else {
          CHECK_OK(kvi_inject_deviation(gi, rq, 2, l, got, 64, KVI_MEMORY_HOST, NULL));
        }
        for (int t = 0; t < T; t++) {
          /* fp32 accumulation and rotation against the CPU's double accumulation */
          const double tol = 2e-4 * fabs((double)want[t]) + (round ? 1e-3 : 1e-5);
          if (!(fabs((double)got[t] - (double)want[t]) <= tol))
            fail_msg("preset %d, store dtype %d, cache dtype %d, round %d, layer %d, %s output, token %d: CUDA %.9g, "
                     "CPU %.9g", (int)preset, (int)store_dt, (int)cache_dt, round, l, device_out ? "device" : "host",
                     t, (double)got[t], (double)want[t]);
        }
      }
    }
  }
  /* a device block table with an entry outside the cache: those tokens NaN, counted */
  if (preset != KVI_CACHE_HF_CONTIGUOUS) {
    int32_t bad[4] = {table[0], 999, table[2], table[3]}, *dtab;
    CUDA_OK(cudaMalloc((void **)&dtab, sizeof bad));
    CUDA_OK(cudaMemcpy(dtab, bad, sizeof bad, cudaMemcpyHostToDevice));
    kvi_inject_request one = rq[0];
    one.block_table = dtab, one.block_table_memory = KVI_MEMORY_DEVICE;
    int64_t skipped = -1;
    CHECK_OK(kvi_injector_async_errors(gi, &skipped));
    CHECK_OK(kvi_inject_deviation(gi, &one, 1, 1, got, 64, KVI_MEMORY_HOST, NULL));
    CHECK_OK(kvi_injector_async_errors(gi, &skipped));
    int nan = 0;
    for (int t = 0; t < T0; t++) {
      const int64_t s = 3 + t;
      const bool in_bad = s / BS == 1;
      if (in_bad != (isnan(got[t]) != 0)) fail_msg("token %d (slot %lld): score %g", t, (long long)s, (double)got[t]);
      nan += in_bad;
    }
    assert_int_equal(skipped, nan);
    CUDA_OK(cudaFree(dtab));
  }
  CUDA_OK(cudaFree(dout));
  kvi_injector_destroy(ci);
  kvi_injector_destroy(gi);
  CUDA_OK(cudaFree(dev));
  free(host);
  kvi_store_destroy(cs);
  kvi_store_destroy(gs);
  kvi_model_destroy(m);
}

static void test_deviation_cuda_vs_cpu(void **state) {
  (void)state;
  static const kvi_dtype pairs[][2] = {
      {KVI_DTYPE_FP32, KVI_DTYPE_FP32}, {KVI_DTYPE_BF16, KVI_DTYPE_BF16},     {KVI_DTYPE_FP16, KVI_DTYPE_FP16},
      {KVI_DTYPE_BF16, KVI_DTYPE_FP8_E4M3}, {KVI_DTYPE_FP8_E4M3, KVI_DTYPE_BF16}, {KVI_DTYPE_FP32, KVI_DTYPE_FP8_E5M2},
  };
  for (int p = KVI_CACHE_VLLM_FLASH_ATTN; p <= KVI_CACHE_VLLM_CPU; p++)
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) run((kvi_cache_preset)p, pairs[i][0], pairs[i][1]);
}

#endif

int main(void) {
#ifdef KVI_HAVE_CUDA
  int n = 0;
  if (kvi_cuda_device_count(&n) != KVI_OK || n < 1) {
    printf("skipped: no CUDA device\n");
    return 77;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_deviation_cuda_vs_cpu)};
  return cmocka_run_group_tests_name("gpu-recompute", tests, NULL, NULL);
#else
  printf("skipped: built without CUDA\n");
  return 77;
#endif
}
