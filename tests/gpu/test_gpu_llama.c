/*
 * gpu suite: llama.cpp sequence states (kvinject/llama.h) on a CUDA store.
 * The state lives in pinned host memory mapped into the device (the way an
 * engine hands it to llama_state_seq_set_data); the fused kernel injects
 * into it and captures from it in place. Compared bit for bit with a CPU
 * store doing the same on an ordinary host copy, with V per cell and
 * transposed. Also: pageable host memory
 * declared as device memory is still refused. Exits 77 without a device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gpu_test.h"

static int g_devices;

enum { L = 4, H = 2, D = 64, CELLS = 40, T = 12 };

static int setup(void **state) {
  (void)state;
  g_rng = GPU_TEST_SEED;
  return 0;
}

#ifdef KVI_HAVE_CUDA
static kvi_model *model(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L;
  mo.num_kv_heads = H;
  mo.head_size = D;
  kvi_model *m;
  CHECK_OK(kvi_model_create(&m, &mo));
  float *table = malloc((size_t)256 * D * sizeof *table);
  CHECK_OK(kvi_llama_rope_table(table, 256, D, 10000.0f, 1.0f));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = KVI_ROPE_GPTJ;
  rs.cos_sin_table = table;
  rs.table_positions = 256;
  CHECK_OK(kvi_model_set_rope(m, -1, &rs));
  free(table);
  return m;
}

static kvi_store *store(const kvi_model *m, kvi_backend b) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = b;
  so.device = 0;
  so.dtype = KVI_DTYPE_FP32;
  so.budget_bytes = 16u << 20;
  kvi_store *s;
  CHECK_OK(kvi_store_create(&s, m, &so));
  return s;
}

/* Inject facts 1 (T tokens) and 2 (T tokens) at cells 3.. and 20.., positions 50.. */
static void inject(kvi_store *s, const kvi_model *m, uint8_t *st, size_t size, kvi_memory mem) {
  kvi_cache_layout cl;
  CHECK_OK(kvi_llama_state_layout(st, size, 0, m, mem, &cl));
  kvi_injector *inj;
  CHECK_OK(kvi_injector_create(&inj, s, &cl, NULL));
  const int32_t table[1] = {0};
  for (int i = 0; i < 2; i++) {
    const uint64_t id = (uint64_t)(1 + i);
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = 5;
    rq.fact_ids = &id;
    rq.num_facts = 1;
    rq.block_table = table;
    rq.block_table_len = 1;
    rq.first_slot = i ? 20 : 3;
    rq.start_position = 50 + 17 * i;
    CHECK_OK(kvi_inject(inj, &rq, 1, NULL, NULL));
  }
  if (mem == KVI_MEMORY_DEVICE) CUDA_OK(cudaDeviceSynchronize());
  kvi_injector_destroy(inj);
}

static void capture(kvi_store *s, const kvi_model *m, uint8_t *st, size_t size, kvi_memory mem) {
  kvi_cache_layout cl;
  CHECK_OK(kvi_llama_state_layout(st, size, 0, m, mem, &cl));
  kvi_encoder *enc;
  CHECK_OK(kvi_encoder_create(&enc, s, &cl, NULL));
  const int32_t table[1] = {0};
  kvi_capture c = KVI_CAPTURE_INIT;
  c.tenant = 9;
  c.fact_id = 1;
  c.block_table = table;
  c.block_table_len = 1;
  c.first_slot = 2;
  c.num_tokens = 30;
  c.start_position = 2;
  CHECK_OK(kvi_encode(enc, &c, 1, NULL));
  if (mem == KVI_MEMORY_DEVICE) CUDA_OK(cudaDeviceSynchronize());
  kvi_encoder_destroy(enc);
}
#endif

#ifdef KVI_HAVE_CUDA
/* Elements of a and b that differ: bits unequal, unless both are NaN. */
static size_t differ_nan_aware(const float *a, const float *b, size_t n) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) {
    if (memcmp(&a[i], &b[i], sizeof a[i]) == 0 || (isnan(a[i]) && isnan(b[i]))) continue;
    if (bad++ < 5) fprintf(stderr, "  element %zu: CPU %a, GPU %a\n", i, (double)a[i], (double)b[i]);
  }
  return bad;
}
#endif

static void test_pinned_state(void **state) {
  (void)state;
  if (g_devices == 0) skip();
#ifdef KVI_HAVE_CUDA
  kvi_model *m = model();
  kvi_store *cpu = store(m, KVI_BACKEND_CPU), *gpu = store(m, KVI_BACKEND_CUDA);
  /* two facts of T tokens, random values */
  static float k[L][T][H][D], v[L][T][H][D];
  for (int f = 1; f <= 2; f++) {
    for (size_t i = 0; i < sizeof k / sizeof(float); i++) ((float *)k)[i] = rndf(), ((float *)v)[i] = rndf();
    kvi_kv_view kv = KVI_KV_VIEW_INIT;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, v);
    CHECK_OK(kvi_store_put(cpu, 5, (uint64_t)f, &kv, NULL, NULL));
    CHECK_OK(kvi_store_put(gpu, 5, (uint64_t)f, &kv, NULL, NULL));
  }
  for (int v_trans = 0; v_trans < 2; v_trans++) {
  kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
  sp.num_cells = CELLS;
  sp.dtype = KVI_DTYPE_FP16;
  sp.seq_id = 3;
  sp.v_trans = v_trans;
  size_t size;
  CHECK_OK(kvi_llama_state_size(m, &sp, &size));
  uint8_t *host = malloc(size), *pinned;
  CUDA_OK(cudaHostAlloc((void **)&pinned, size, cudaHostAllocMapped));
  for (size_t i = 0; i < size; i++) host[i] = (uint8_t)rnd(); /* the cells not injected keep their bytes */
  CHECK_OK(kvi_llama_state_write_header(host, size, m, &sp));
  memcpy(pinned, host, size);
  inject(cpu, m, host, size, KVI_MEMORY_HOST);
  inject(gpu, m, pinned, size, KVI_MEMORY_DEVICE);
  assert_memory_equal(host, pinned, size);

  /* capture back through each backend, read both as fp32: equal */
  capture(cpu, m, host, size, KVI_MEMORY_HOST);
  capture(gpu, m, pinned, size, KVI_MEMORY_DEVICE);
  static float k1[L][30][H][D], v1[L][30][H][D], k2[L][30][H][D], v2[L][30][H][D];
  kvi_kv_view a = KVI_KV_VIEW_INIT, b = KVI_KV_VIEW_INIT;
  kvi_kv_view_contiguous(&a, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 30, H, D, k1, v1);
  kvi_kv_view_contiguous(&b, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 30, H, D, k2, v2);
  CHECK_OK(kvi_store_read(cpu, 9, 1, &a, NULL));
  CHECK_OK(kvi_store_read(gpu, 9, 1, &b, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  /* The cells not injected hold random bytes, fp16 NaNs among them: a NaN
   * rotated or converted keeps its payload on the CPU and becomes the
   * canonical NaN on the GPU. Every other value must match bit for bit. */
  assert_int_equal(differ_nan_aware((const float *)k1, (const float *)k2, sizeof k1 / sizeof(float)), 0);
  assert_int_equal(differ_nan_aware((const float *)v1, (const float *)v2, sizeof v1 / sizeof(float)), 0);

  /* pageable memory declared as device memory: refused */
  kvi_cache_layout cl;
  CHECK_OK(kvi_llama_state_layout(host, size, 0, m, KVI_MEMORY_DEVICE, &cl));
  kvi_injector *inj = NULL;
  assert_int_equal(kvi_injector_create(&inj, gpu, &cl, NULL), KVI_ERR_MEMORY_KIND);
  assert_null(inj);

  CHECK_OK(kvi_store_remove(cpu, 9, 1));
  CHECK_OK(kvi_store_remove(gpu, 9, 1));
  cudaFreeHost(pinned);
  free(host);
  }
  kvi_store_destroy(cpu);
  kvi_store_destroy(gpu);
  kvi_model_destroy(m);
#endif
}

int main(void) {
  if (kvi_cuda_device_count(&g_devices) != KVI_OK) g_devices = 0;
  if (!g_devices) fprintf(stderr, "gpu-llama suite: no CUDA device in this build or machine; every test skips\n");
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_pinned_state, setup),
  };
  int failed = cmocka_run_group_tests_name("gpu-llama", tests, NULL, NULL);
  if (failed) return 1;
  return g_devices ? 0 : 77;
}
