/*
 * unit-basics: status strings, the per-thread last error, version, features,
 * dtypes, and the options initializers.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>

#include "unit.h"

static const kvi_status all_statuses[] = {
    KVI_OK,           KVI_ERR_INVALID_ARGUMENT, KVI_ERR_STRUCT_SIZE, KVI_ERR_OUT_OF_MEMORY,
    KVI_ERR_CAPACITY, KVI_ERR_EXISTS,           KVI_ERR_NOT_FOUND,   KVI_ERR_MISMATCH,
    KVI_ERR_MEMORY_KIND, KVI_ERR_NOT_BUILT,     KVI_ERR_NO_DEVICE,   KVI_ERR_CUDA,
    KVI_ERR_UNSUPPORTED, KVI_ERR_INTERNAL,     KVI_ERR_CORRUPT,     KVI_ERR_INCOMPATIBLE,
    KVI_ERR_IO,           KVI_ERR_PEER,             KVI_ERR_TOKEN_MISMATCH, KVI_ERR_STALE,
    KVI_ERR_LEASED,
};
#define N_STATUSES (sizeof all_statuses / sizeof all_statuses[0])

/* The values are ABI: they must never move. */
static void test_status_values_fixed(void **state) {
  (void)state;
  assert_int_equal(KVI_OK, 0);
  for (size_t i = 0; i < N_STATUSES; i++) assert_int_equal((int)all_statuses[i], -(int)i);
}

static void test_status_strings_distinct(void **state) {
  (void)state;
  for (size_t i = 0; i < N_STATUSES; i++) {
    const char *s = kvi_status_string(all_statuses[i]);
    assert_non_null(s);
    assert_true(strlen(s) > 0);
    assert_string_not_equal(s, "unknown status");
    for (size_t j = 0; j < i; j++) assert_string_not_equal(s, kvi_status_string(all_statuses[j]));
  }
  /* static text: the same pointer every time */
  assert_ptr_equal(kvi_status_string(KVI_ERR_CAPACITY), kvi_status_string(KVI_ERR_CAPACITY));
}

static void test_status_string_unknown(void **state) {
  (void)state;
  const int unknown[] = {1, 2, -21, -100, 12345, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
    assert_string_equal(kvi_status_string((kvi_status)unknown[i]), "unknown status");
}

static void *check_fresh_string(void *arg) {
  int *ok = arg;
  const char *e = kvi_last_error();
  *ok = e != NULL && e[0] == '\0';
  return NULL;
}

/* A thread that never failed sees "" (not NULL), whatever other threads did. */
static void test_last_error_fresh_thread_is_empty_string(void **state) {
  (void)state;
  assert_status(kvi_store_remove(NULL, 1, 2), KVI_ERR_INVALID_ARGUMENT);
  assert_true(strlen(kvi_last_error()) > 0);
  int ok = 0;
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, check_fresh_string, &ok), 0);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_true(ok);
}

static void test_last_error_names_function_and_value(void **state) {
  (void)state;
  kvi_model_options mo = model_options(2, 2, 1025, 0, 1);
  kvi_model *m = NULL;
  assert_status(kvi_model_create(&m, &mo), KVI_ERR_INVALID_ARGUMENT);
  assert_null(m);
  assert_last_error_has("kvi_model_create", "1025");

  mo.head_size = 16;
  mo.tp_size = 3;
  mo.num_kv_heads = 8;
  assert_status(kvi_model_create(&m, &mo), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_model_create", "3");
  assert_last_error_has("kvi_model_create", "8");

  mo.tp_size = 1;
  mo.num_kv_heads = 2;
  assert_ok(kvi_model_create(&m, &mo));

  kvi_store_options so = cpu_store_options(KVI_DTYPE_BF16, 4097, 1u << 20);
  kvi_store *s = NULL;
  assert_status(kvi_store_create(&s, m, &so), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_create", "4097");
  so = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  so.embedding_dim = 70001;
  assert_status(kvi_store_create(&s, m, &so), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_create", "70001");
  so.embedding_dim = 0;
  assert_ok(kvi_store_create(&s, m, &so));

  /* A success does not clear the message. */
  assert_last_error_has("kvi_store_create", "70001");

  float buf[2 * 2 * 1 * 2 * 16];
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 77, 1, 2, 16, buf, buf);
  assert_status(kvi_store_put(s, 1, 2, &v, NULL, NULL), KVI_ERR_MISMATCH);
  assert_last_error_has("kvi_store_put", "77");

  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 2, 1, 2, 16, buf, buf + 64);
  v.head_size = 333;
  assert_status(kvi_store_put(s, 1, 2, &v, NULL, NULL), KVI_ERR_MISMATCH);
  assert_last_error_has("kvi_store_put", "333");

  assert_status(kvi_store_remove(s, 5, 123456789), KVI_ERR_NOT_FOUND);
  assert_last_error_has("kvi_store_remove", "123456789");

  int32_t tokens = -1;
  assert_status(kvi_store_fact_tokens(s, 5, 987654321, &tokens), KVI_ERR_NOT_FOUND);
  assert_last_error_has("kvi_store_fact_tokens", "987654321");
  assert_int_equal(tokens, -1);

  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_version(void **state) {
  (void)state;
  assert_int_equal(kvi_version_number(), KVI_VERSION_NUMBER);
  assert_int_equal(KVI_VERSION_NUMBER, KVI_VERSION_MAJOR * 10000 + KVI_VERSION_MINOR * 100 + KVI_VERSION_PATCH);
  assert_non_null(kvi_version_string());
  assert_string_equal(kvi_version_string(), KVI_VERSION_STRING);
  char expect[64];
  snprintf(expect, sizeof expect, "%d.%d.%d", KVI_VERSION_MAJOR, KVI_VERSION_MINOR, KVI_VERSION_PATCH);
  assert_string_equal(kvi_version_string(), expect);
}

static void test_features_and_device_count(void **state) {
  (void)state;
  const unsigned f = kvi_features();
  assert_int_equal(f & ~(KVI_FEATURE_CUDA | KVI_FEATURE_CUBLASLT | KVI_FEATURE_NCCL), 0);
  if (f & (KVI_FEATURE_CUBLASLT | KVI_FEATURE_NCCL)) assert_true(f & KVI_FEATURE_CUDA);
  assert_int_equal(kvi_features(), f);

  assert_status(kvi_cuda_device_count(NULL), KVI_ERR_INVALID_ARGUMENT);
  int n = -7;
  if (f & KVI_FEATURE_CUDA) {
    assert_ok(kvi_cuda_device_count(&n));
    assert_true(n >= 0);
  } else {
    assert_status(kvi_cuda_device_count(&n), KVI_ERR_NOT_BUILT);
    assert_int_equal(n, 0);
  }
}

static void test_dtype_size(void **state) {
  (void)state;
  assert_int_equal(kvi_dtype_size(KVI_DTYPE_FP32), 4);
  assert_int_equal(kvi_dtype_size(KVI_DTYPE_FP16), 2);
  assert_int_equal(kvi_dtype_size(KVI_DTYPE_BF16), 2);
  assert_int_equal(kvi_dtype_size(KVI_DTYPE_FP8_E4M3), 1);
  assert_int_equal(kvi_dtype_size(KVI_DTYPE_FP8_E5M2), 1);
  const int bad[] = {0, 6, 99, -1, INT32_MAX};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) assert_int_equal(kvi_dtype_size((kvi_dtype)bad[i]), 0);
  /* enum values are ABI */
  assert_int_equal(KVI_DTYPE_FP32, 1);
  assert_int_equal(KVI_DTYPE_FP16, 2);
  assert_int_equal(KVI_DTYPE_BF16, 3);
  assert_int_equal(KVI_DTYPE_FP8_E4M3, 4);
  assert_int_equal(KVI_DTYPE_FP8_E5M2, 5);
  assert_int_equal(KVI_MEMORY_HOST, 1);
  assert_int_equal(KVI_MEMORY_DEVICE, 2);
  assert_int_equal(KVI_BACKEND_AUTO, 0);
  assert_int_equal(KVI_BACKEND_CPU, 1);
  assert_int_equal(KVI_BACKEND_CUDA, 2);
}

/* Each *_init() fills exactly what its _INIT macro does and refuses NULL. */
static void test_options_init_functions(void **state) {
  (void)state;
  {
    kvi_model_options a, b = KVI_MODEL_OPTIONS_INIT;
    memset(&a, 0x5a, sizeof a);
    kvi_model_options_init(&a, sizeof a);
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.tp_size, 1);
    assert_int_equal(a.tp_rank, 0);
    assert_int_equal(a.num_layers, 0);
    assert_int_equal(a.num_kv_heads, 0);
    assert_int_equal(a.head_size, 0);
    assert_int_equal(b.struct_size, sizeof b);
    assert_int_equal(b.tp_size, 1);
    assert_int_equal(kvi_model_options_init(NULL, 64), KVI_ERR_INVALID_ARGUMENT);
  }
  {
    kvi_rope_spec a;
    memset(&a, 0x5a, sizeof a);
    kvi_rope_spec_init(&a, sizeof a);
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.style, KVI_ROPE_NEOX);
    assert_int_equal(a.rotary_dim, 0);
    assert_true(a.theta == 10000.0);
    assert_int_equal(kvi_rope_spec_init(NULL, 64), KVI_ERR_INVALID_ARGUMENT);
  }
  {
    kvi_store_options a;
    memset(&a, 0x5a, sizeof a);
    kvi_store_options_init(&a, sizeof a);
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.backend, KVI_BACKEND_AUTO);
    assert_int_equal(a.device, -1);
    assert_int_equal(a.dtype, KVI_DTYPE_BF16);
    assert_int_equal(a.page_tokens, 16);
    assert_int_equal(a.budget_bytes, 0);
    assert_int_equal(a.embedding_dim, 0);
    assert_int_equal(kvi_store_options_init(NULL, 64), KVI_ERR_INVALID_ARGUMENT);
  }
  {
    kvi_put_options a;
    memset(&a, 0x5a, sizeof a);
    kvi_put_options_init(&a, sizeof a);
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.flags, 0);
    assert_null(a.embedding);
    assert_int_equal(a.embedding_dtype, KVI_DTYPE_FP32);
    assert_int_equal(a.embedding_memory, KVI_MEMORY_HOST);
    assert_int_equal(kvi_put_options_init(NULL, 64), KVI_ERR_INVALID_ARGUMENT);
  }
  {
    kvi_kv_view a;
    memset(&a, 0x5a, sizeof a);
    kvi_kv_view_init(&a, sizeof a);
    assert_int_equal(a.struct_size, sizeof a);
    assert_int_equal(a.memory, 0);
    assert_int_equal(a.dtype, 0);
    assert_int_equal(a.num_layers, 0);
    assert_int_equal(a.num_tokens, 0);
    assert_int_equal(a.layer_stride, 0);
    assert_null(a.k);
    assert_null(a.v);
    assert_int_equal(kvi_kv_view_init(NULL, 64), KVI_ERR_INVALID_ARGUMENT);
  }
}

static void test_kv_view_contiguous(void **state) {
  (void)state;
  kvi_kv_view v;
  memset(&v, 0x5a, sizeof v);
  int k, vv;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP16, 3, 7, 5, 11, &k, &vv);
  assert_int_equal(v.struct_size, sizeof v);
  assert_int_equal(v.memory, KVI_MEMORY_HOST);
  assert_int_equal(v.dtype, KVI_DTYPE_FP16);
  assert_int_equal(v.num_layers, 3);
  assert_int_equal(v.num_tokens, 7);
  assert_int_equal(v.num_heads, 5);
  assert_int_equal(v.head_size, 11);
  assert_int_equal(v.head_stride, 11);
  assert_int_equal(v.token_stride, 5 * 11);
  assert_int_equal(v.layer_stride, 7 * 5 * 11);
  assert_ptr_equal(v.k, &k);
  assert_ptr_equal(v.v, &vv);
  /* 64-bit strides: no int32 overflow for large shapes */
  kvi_kv_view_contiguous(&v, KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, 80, 65536, 64, 1024, NULL, NULL);
  assert_int_equal(v.token_stride, 64 * 1024);
  assert_true(v.layer_stride == (int64_t)65536 * 64 * 1024);
  kvi_kv_view_contiguous(NULL, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, 1, NULL, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_status_values_fixed),
      cmocka_unit_test(test_status_strings_distinct),
      cmocka_unit_test(test_status_string_unknown),
      cmocka_unit_test(test_last_error_fresh_thread_is_empty_string),
      cmocka_unit_test(test_last_error_names_function_and_value),
      cmocka_unit_test(test_version),
      cmocka_unit_test(test_features_and_device_count),
      cmocka_unit_test(test_dtype_size),
      cmocka_unit_test(test_options_init_functions),
      cmocka_unit_test(test_kv_view_contiguous),
  };
  return cmocka_run_group_tests_name("unit-basics", tests, NULL, NULL);
}
