/*
 * cuBLASLt and NCCL are opened on first use, not linked: with both hidden
 * (run under the hide_optional_libs.so LD_PRELOAD shim, argument "hidden")
 * the library loads, kvi_features() drops their bits, CPU stores work
 * (create, put, read, search, inject), kvi_comm_create_nccl and, where a
 * CUDA device answers, a CUDA store's search return KVI_ERR_NOT_BUILT with a
 * message naming the library. Without the shim (argument "present",
 * features C,B,N as Meson built them) kvi_features() reports the build.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>

static int hidden, built_cuda, built_lt, built_nccl;

#define CHECK(call, want)                                                                                   \
  do {                                                                                                      \
    kvi_status st_ = (call);                                                                                \
    if (st_ != (want))                                                                                      \
      fail_msg("%s -> %d (%s), expected %d: %s", #call, (int)st_, kvi_status_string(st_), (int)(want),      \
               kvi_last_error());                                                                           \
  } while (0)

static void expect_error_names(const char *needle) {
  if (!strstr(kvi_last_error(), needle)) fail_msg("kvi_last_error() \"%s\" does not name %s", kvi_last_error(), needle);
}

static void test_features(void **state) {
  (void)state;
  const unsigned f = kvi_features();
  assert_int_equal(!!(f & KVI_FEATURE_CUDA), built_cuda);
  assert_int_equal(!!(f & KVI_FEATURE_CUBLASLT), hidden ? 0 : built_lt);
  assert_int_equal(!!(f & KVI_FEATURE_NCCL), hidden ? 0 : built_nccl);
}

enum { L = 2, H = 2, D = 8, T = 5, DIM = 4 };

static kvi_store *make_store(kvi_model *m, kvi_backend backend) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = backend, so.dtype = KVI_DTYPE_FP32, so.page_tokens = 4, so.budget_bytes = 1 << 20;
  so.embedding_dim = DIM;
  kvi_store *s = NULL;
  CHECK(kvi_store_create(&s, m, &so), KVI_OK);
  return s;
}

static void put_facts(kvi_store *s, float *k, float *v, float *emb) {
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, v);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  for (uint64_t id = 1; id <= 3; id++) {
    for (int i = 0; i < DIM; i++) emb[i] = (float)(id == 2 ? 4 - i : i);
    po.embedding = emb;
    CHECK(kvi_store_put(s, 9, id, &kv, &po, NULL), KVI_OK);
  }
}

static void test_cpu_store_works(void **state) {
  (void)state;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_model *m;
  CHECK(kvi_model_create(&m, &mo), KVI_OK);
  kvi_store *s = make_store(m, KVI_BACKEND_CPU);
  static float k[L * T * H * D], v[L * T * H * D], k2[L * T * H * D], v2[L * T * H * D];
  for (int i = 0; i < L * T * H * D; i++) k[i] = (float)i * 0.5f, v[i] = (float)-i;
  float emb[DIM];
  put_facts(s, k, v, emb);
  kvi_kv_view out;
  kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k2, v2);
  CHECK(kvi_store_read(s, 9, 2, &out, NULL), KVI_OK);
  assert_memory_equal(k, k2, sizeof k);
  assert_memory_equal(v, v2, sizeof v);
  const float q[DIM] = {1, 0, 0, 0}; /* fact 2's embedding is {4, 3, 2, 1}: the best */
  const uint64_t tenant = 9;
  uint64_t ids[2];
  float scores[2];
  int32_t counts[1];
  CHECK(kvi_store_search(s, q, 1, DIM, &tenant, 2, ids, scores, counts, NULL, NULL), KVI_OK);
  assert_int_equal(counts[0], 2);
  assert_int_equal(ids[0], 2);
  assert_true(scores[0] == 4.0f);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_nccl_comm_refused(void **state) {
  (void)state;
  if (!hidden && built_nccl) skip(); /* a real NCCL would dereference the fake communicator */
  kvi_comm *c = NULL;
  CHECK(kvi_comm_create_nccl(&c, (struct ncclComm *)(uintptr_t)0x10), KVI_ERR_NOT_BUILT);
  assert_null(c);
  expect_error_names(built_nccl ? "libnccl.so." : "NCCL");
  if (built_nccl) expect_error_names("hidden-by-hide_optional_libs"); /* dlerror()'s text */
}

static void test_cuda_search_refused(void **state) {
  (void)state;
  int n = 0;
  if (!hidden || !built_cuda || kvi_cuda_device_count(&n) != KVI_OK || n < 1) skip(); /* needs a device */
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_model *m;
  CHECK(kvi_model_create(&m, &mo), KVI_OK);
  kvi_store *s = make_store(m, KVI_BACKEND_CUDA);
  static float k[L * T * H * D], v[L * T * H * D];
  float emb[DIM];
  put_facts(s, k, v, emb); /* puts need no cuBLASLt */
  const float q[DIM] = {1, 0, 0, 0};
  const uint64_t tenant = 9;
  uint64_t ids[2];
  float scores[2];
  int32_t counts[1] = {-7};
  CHECK(kvi_store_search(s, q, 1, DIM, &tenant, 2, ids, scores, counts, NULL, NULL), KVI_ERR_NOT_BUILT);
  assert_int_equal(counts[0], -7);
  expect_error_names(built_lt ? "libcublasLt.so." : "cuBLASLt");
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

int main(int argc, char **argv) {
  if (argc != 3 || sscanf(argv[2], "%d,%d,%d", &built_cuda, &built_lt, &built_nccl) != 3) {
    fprintf(stderr, "usage: %s hidden|present C,B,N\n", argv[0]);
    return 2;
  }
  hidden = strcmp(argv[1], "hidden") == 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_features),
      cmocka_unit_test(test_cpu_store_works),
      cmocka_unit_test(test_nccl_comm_refused),
      cmocka_unit_test(test_cuda_search_refused),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
