/*
 * unit-store-create: kvi_store_create's validation, backend choice, budget
 * rounding and the statistics of a fresh store.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#define L 3
#define H 4 /* 2 local heads: tp 2, rank 1 */
#define D 8
#define LOCAL_H 2

static int setup(void **state) {
  *state = make_model(L, H, D, 1, 2);
  return 0;
}

static int teardown(void **state) {
  kvi_model_destroy(*state);
  return 0;
}

static uint64_t page_bytes_for(int32_t P, kvi_dtype dt) {
  return (uint64_t)P * L * 2 * LOCAL_H * D * kvi_dtype_size(dt);
}

/* A create that must fail with `want` and leave *out untouched. */
static void expect_fails(const kvi_model *m, const kvi_store_options *o, kvi_status want) {
  static int sentinel_obj;
  kvi_store *const sentinel = (kvi_store *)&sentinel_obj;
  kvi_store *s = sentinel;
  assert_status(kvi_store_create(&s, m, o), want);
  assert_ptr_equal(s, sentinel);
}

static void test_create_null_arguments(void **state) {
  kvi_model *m = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  assert_status(kvi_store_create(NULL, m, &o), KVI_ERR_INVALID_ARGUMENT);
  expect_fails(NULL, &o, KVI_ERR_INVALID_ARGUMENT);
  expect_fails(m, NULL, KVI_ERR_INVALID_ARGUMENT);
  kvi_store_destroy(NULL);
}

static void test_create_budget(void **state) {
  kvi_model *m = *state;
  const uint64_t pb = page_bytes_for(16, KVI_DTYPE_BF16);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 0);
  expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
  o.budget_bytes = pb - 1;
  expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
  char num[32];
  snprintf(num, sizeof num, "%llu", (unsigned long long)(pb - 1));
  assert_last_error_has("kvi_store_create", num);

  /* exactly one page */
  o.budget_bytes = pb;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  kvi_store_stats st = store_stats(s);
  assert_int_equal(st.page_bytes, pb);
  assert_int_equal(st.pages_total, 1);
  assert_int_equal(st.bytes_reserved, pb);
  kvi_store_destroy(s);

  /* rounded down to whole pages */
  o.budget_bytes = 3 * pb + pb / 2;
  assert_ok(kvi_store_create(&s, m, &o));
  st = store_stats(s);
  assert_int_equal(st.pages_total, 3);
  assert_int_equal(st.bytes_reserved, 3 * pb);
  kvi_store_destroy(s);
}

static void test_create_invalid_fields(void **state) {
  kvi_model *m = *state;
  kvi_store_options o;

  const int32_t bad_pt[] = {0, -1, 4097, INT32_MIN};
  for (size_t i = 0; i < sizeof bad_pt / sizeof bad_pt[0]; i++) {
    o = cpu_store_options(KVI_DTYPE_BF16, bad_pt[i], 1u << 24);
    expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
    char num[16];
    snprintf(num, sizeof num, "%d", (int)bad_pt[i]);
    assert_last_error_has("kvi_store_create", num);
  }
  const int32_t bad_emb[] = {-1, 65537, INT32_MAX};
  for (size_t i = 0; i < sizeof bad_emb / sizeof bad_emb[0]; i++) {
    o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 24);
    o.embedding_dim = bad_emb[i];
    expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
    char num[16];
    snprintf(num, sizeof num, "%d", (int)bad_emb[i]);
    assert_last_error_has("kvi_store_create", num);
  }
  const int bad_dtype[] = {0, 7, 99, -1};
  for (size_t i = 0; i < sizeof bad_dtype / sizeof bad_dtype[0]; i++) {
    o = cpu_store_options((kvi_dtype)bad_dtype[i], 16, 1u << 24);
    expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
  }
  o = cpu_store_options(KVI_DTYPE_FP8_E5M2, 16, 1u << 24); /* e4m3 stores only (unit-fp8) */
  expect_fails(m, &o, KVI_ERR_UNSUPPORTED);

  const int bad_backend[] = {7, 3, -1};
  for (size_t i = 0; i < sizeof bad_backend / sizeof bad_backend[0]; i++) {
    o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 24);
    o.backend = (kvi_backend)bad_backend[i];
    expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
    char num[16];
    snprintf(num, sizeof num, "%d", bad_backend[i]);
    assert_last_error_has("kvi_store_create", num);
  }
}

static void test_create_range_limits_accepted(void **state) {
  kvi_model *m = *state;
  const int32_t pts[] = {1, 5, 4096};
  for (size_t i = 0; i < 3; i++) {
    kvi_store_options o = cpu_store_options(KVI_DTYPE_FP16, pts[i], page_bytes_for(pts[i], KVI_DTYPE_FP16) * 2);
    o.embedding_dim = i == 2 ? 65536 : 0;
    kvi_store *s = NULL;
    assert_ok(kvi_store_create(&s, m, &o));
    const kvi_store_stats st = store_stats(s);
    assert_int_equal(st.page_tokens, pts[i]);
    assert_int_equal(st.pages_total, 2);
    assert_int_equal(st.embedding_dim, o.embedding_dim);
    kvi_store_destroy(s);
  }
}

typedef struct {
  kvi_store_options o;
  unsigned char later[16];
} store_options_v2;

static void test_create_struct_size(void **state) {
  kvi_model *m = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  o.struct_size = offsetof(kvi_store_options, comm) - 4; /* shorter than the first layout */
  expect_fails(m, &o, KVI_ERR_STRUCT_SIZE);
  o.struct_size = 0;
  expect_fails(m, &o, KVI_ERR_STRUCT_SIZE);
  { /* the layout before comm was appended is still accepted, without a communicator */
    kvi_store_options old = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
    old.struct_size = offsetof(kvi_store_options, comm);
    old.comm = (kvi_comm *)&old; /* past struct_size: never read */
    kvi_store *s0 = NULL;
    assert_ok(kvi_store_create(&s0, m, &old));
    kvi_store_destroy(s0);
  }
  { /* the layout before host_budget_bytes: a value past struct_size is never read */
    kvi_store_options old = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
    old.struct_size = offsetof(kvi_store_options, host_budget_bytes);
    old.host_budget_bytes = 1u << 30;
    kvi_store *s0 = NULL;
    assert_ok(kvi_store_create(&s0, m, &old));
    assert_int_equal(store_stats(s0).pages_host_total, 0);
    kvi_store_destroy(s0);
  }
  o.struct_size = 0;
  expect_fails(m, &o, KVI_ERR_STRUCT_SIZE);

  store_options_v2 big;
  memset(&big, 0, sizeof big);
  big.o = cpu_store_options(KVI_DTYPE_FP16, 8, 1u << 20);
  big.o.struct_size = sizeof big;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &big.o));
  assert_int_equal(store_stats(s).page_tokens, 8);
  assert_int_equal(store_stats(s).dtype, KVI_DTYPE_FP16);
  kvi_store_destroy(s);
  big.later[sizeof big.later - 1] = 0x80;
  expect_fails(m, &big.o, KVI_ERR_STRUCT_SIZE);
  big.later[sizeof big.later - 1] = 0;
  big.later[0] = 1;
  expect_fails(m, &big.o, KVI_ERR_STRUCT_SIZE);
}

static int cuda_devices(void) {
  int n = 0;
  if (kvi_features() & KVI_FEATURE_CUDA) assert_ok(kvi_cuda_device_count(&n));
  return n;
}

static void test_create_cuda_without_device(void **state) {
  kvi_model *m = *state;
  if (cuda_devices() > 0) skip(); /* covered by the gpu suite */
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  o.backend = KVI_BACKEND_CUDA;
  const kvi_status want = (kvi_features() & KVI_FEATURE_CUDA) ? KVI_ERR_NO_DEVICE : KVI_ERR_NOT_BUILT;
  expect_fails(m, &o, want);
  assert_last_error_has("kvi_store_create", "CUDA");
  o.device = 0;
  expect_fails(m, &o, want);
  o.device = 3;
  expect_fails(m, &o, want);
}

static void test_create_auto_resolves_to_cpu(void **state) {
  kvi_model *m = *state;
  if (cuda_devices() > 0) skip();
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  o.backend = KVI_BACKEND_AUTO;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.backend, KVI_BACKEND_CPU);
  assert_int_equal(st.device, -1);
  kvi_store_destroy(s);
  /* the defaults from the initializer need only a budget */
  kvi_store_options d;
  kvi_store_options_init(&d, sizeof d);
  d.budget_bytes = 1u << 20;
  assert_ok(kvi_store_create(&s, m, &d));
  assert_int_equal(store_stats(s).backend, KVI_BACKEND_CPU);
  assert_int_equal(store_stats(s).dtype, KVI_DTYPE_BF16);
  assert_int_equal(store_stats(s).page_tokens, 16);
  kvi_store_destroy(s);
}

/* The CPU backend ignores the device ordinal. */
static void test_create_cpu_ignores_device(void **state) {
  kvi_model *m = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  const int32_t devs[] = {-1, 0, 99, -5};
  for (size_t i = 0; i < 4; i++) {
    o.device = devs[i];
    kvi_store *s = NULL;
    assert_ok(kvi_store_create(&s, m, &o));
    assert_int_equal(store_stats(s).backend, KVI_BACKEND_CPU);
    assert_int_equal(store_stats(s).device, -1);
    kvi_store_destroy(s);
  }
}

/* A CPU store has one tier: host_budget_bytes must be 0 (also when AUTO
 * resolves to the CPU); prefetch on it only checks its arguments. */
static void test_create_host_budget_cpu(void **state) {
  kvi_model *m = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 16, 1u << 20);
  o.host_budget_bytes = 1u << 20;
  expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_create", "host_budget_bytes");
  if (cuda_devices() == 0) {
    o.backend = KVI_BACKEND_AUTO;
    expect_fails(m, &o, KVI_ERR_INVALID_ARGUMENT);
  }
  o.backend = KVI_BACKEND_CPU;
  o.host_budget_bytes = 0;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.pages_host_total, 0);
  assert_int_equal(st.pages_host_used, 0);
  assert_int_equal(st.promotions, 0);
  assert_int_equal(st.demotions, 0);
  kvi_kv_view kv;
  const size_t n = (size_t)L * 3 * LOCAL_H * D;
  float *k = calloc(n, sizeof *k), *v = calloc(n, sizeof *v);
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 3, LOCAL_H, D, k, v);
  assert_ok(kvi_store_put(s, 4, 40, &kv, NULL, NULL));
  const uint64_t ids[] = {40};
  assert_ok(kvi_store_prefetch(s, 4, ids, 1, NULL));
  assert_ok(kvi_store_prefetch(s, 4, NULL, 0, NULL));
  assert_ok(kvi_store_prefetch(s, 5, NULL, 0, NULL)); /* a tenant never seen */
  assert_ok(kvi_store_prefetch(s, 4, ids, 0, NULL));
  const uint64_t bad[] = {40, 41};
  assert_status(kvi_store_prefetch(s, 4, bad, 2, NULL), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_prefetch(s, 4, NULL, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_prefetch(s, 4, ids, -1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_prefetch(NULL, 4, ids, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_int_equal(store_stats(s).promotions, 0);
  /* stats into the layout before the tier fields: nothing written past it */
  struct {
    kvi_store_stats st;
    char guard[8];
  } old;
  memset(&old, 0x5a, sizeof old);
  old.st.struct_size = offsetof(kvi_store_stats, pages_host_total);
  assert_ok(kvi_store_stats_get(s, &old.st));
  assert_int_equal(old.st.facts, 1);
  const unsigned char *tail = (const unsigned char *)&old.st + offsetof(kvi_store_stats, pages_host_total);
  for (size_t i = 0; i < sizeof old - offsetof(kvi_store_stats, pages_host_total); i++) assert_int_equal(tail[i], 0x5a);
  free(k);
  free(v);
  kvi_store_destroy(s);
}

static void test_fresh_store_stats(void **state) {
  kvi_model *m = *state;
  for (size_t i = 0; i < 3; i++) {
    const kvi_dtype dt = float_dtypes[i];
    const int32_t P = i == 0 ? 5 : i == 1 ? 16 : 1;
    kvi_store_options o = cpu_store_options(dt, P, page_bytes_for(P, dt) * 7 + 3);
    o.embedding_dim = 12;
    kvi_store *s = NULL;
    assert_ok(kvi_store_create(&s, m, &o));
    const kvi_store_stats st = store_stats(s);
    assert_int_equal(st.struct_size, sizeof st);
    assert_int_equal(st.backend, KVI_BACKEND_CPU);
    assert_int_equal(st.device, -1);
    assert_int_equal(st.dtype, dt);
    assert_int_equal(st.page_tokens, P);
    assert_int_equal(st.embedding_dim, 12);
    assert_int_equal(st.page_bytes, (uint64_t)P * L * 2 * LOCAL_H * D * kvi_dtype_size(dt));
    assert_int_equal(st.pages_total, 7);
    assert_int_equal(st.pages_used, 0);
    assert_int_equal(st.bytes_reserved, 7 * st.page_bytes);
    assert_int_equal(st.bytes_used, 0);
    assert_int_equal(st.bytes_payload, 0);
    assert_int_equal(st.facts, 0);
    assert_int_equal(st.tenants, 0);
    size_t n = 99;
    assert_ok(kvi_store_count(s, 0, &n));
    assert_int_equal(n, 0);
    kvi_store_destroy(s);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_create_null_arguments, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_budget, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_invalid_fields, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_range_limits_accepted, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_struct_size, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_cuda_without_device, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_auto_resolves_to_cpu, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_cpu_ignores_device, setup, teardown),
      cmocka_unit_test_setup_teardown(test_fresh_store_stats, setup, teardown),
      cmocka_unit_test_setup_teardown(test_create_host_budget_cpu, setup, teardown),
  };
  return cmocka_run_group_tests_name("unit-store-create", tests, NULL, NULL);
}
