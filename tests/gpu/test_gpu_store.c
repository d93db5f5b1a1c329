/*
 * gpu suite: the fact store through the CUDA backend, compared with the CPU
 * backend (the reference) on the same inputs. Every test skips, and the
 * binary exits 77, where no CUDA device answers, so the list of tests is the
 * same on every machine.
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "gpu_test.h"

static int g_devices;

#define REQUIRE_GPU()                                                                                          \
  do {                                                                                                         \
    if (g_devices == 0) skip();                                                                                \
  } while (0)

/* ---------------------------------------------------------------- fixtures */

typedef struct fixture {
  kvi_model *model;
  kvi_store *gpu;
  kvi_store *cpu;
  int32_t L, H, D;
} fixture;

static void fill_random(void *p, kvi_dtype t, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float x = rndf();
    if (t == KVI_DTYPE_FP32) {
      ((float *)p)[i] = x;
    } else {
      /* any 16-bit pattern of a finite value; reuse the float's top bits for bf16,
       * and build a finite half from random bits for fp16 */
      uint16_t h = (uint16_t)rnd();
      if (t == KVI_DTYPE_FP16 && ((h >> 10) & 0x1f) == 0x1f) h &= 0xbfff; /* not inf/NaN */
      if (t == KVI_DTYPE_BF16 && ((h >> 7) & 0xff) == 0xff) h &= 0xbfff;
      ((uint16_t *)p)[i] = h;
    }
  }
}

static int make_fixture(void **state, int32_t L, int32_t H, int32_t D, int32_t tp_size, kvi_dtype dtype,
                        int32_t page_tokens, uint64_t budget, int32_t emb_dim) {
  fixture *f = calloc(1, sizeof *f);
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L;
  mo.num_kv_heads = H * tp_size;
  mo.head_size = D;
  mo.tp_size = tp_size;
  mo.tp_rank = tp_size - 1;
  if (kvi_model_create(&f->model, &mo)) return -1;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.dtype = dtype;
  so.page_tokens = page_tokens;
  so.budget_bytes = budget;
  so.embedding_dim = emb_dim;
  so.backend = KVI_BACKEND_CPU;
  if (kvi_store_create(&f->cpu, f->model, &so)) return -1;
  if (g_devices > 0) {
    so.backend = KVI_BACKEND_CUDA;
    so.device = 0;
    if (kvi_store_create(&f->gpu, f->model, &so)) {
      fprintf(stderr, "gpu store: %s\n", kvi_last_error());
      return -1;
    }
  }
  f->L = L;
  f->H = H;
  f->D = D;
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  if (f) {
    kvi_store_destroy(f->gpu);
    kvi_store_destroy(f->cpu);
    kvi_model_destroy(f->model);
    free(f);
  }
  return 0;
}

static int setup_bf16(void **state) { return make_fixture(state, 3, 4, 128, 1, KVI_DTYPE_BF16, 16, 64u << 20, 0); }
static int setup_fp16_odd(void **state) { return make_fixture(state, 2, 3, 20, 2, KVI_DTYPE_FP16, 5, 8u << 20, 0); }
static int setup_fp32(void **state) { return make_fixture(state, 2, 2, 64, 1, KVI_DTYPE_FP32, 16, 16u << 20, 0); }
static int setup_emb(void **state) { return make_fixture(state, 2, 2, 64, 1, KVI_DTYPE_BF16, 16, 8u << 20, 96); }

/* A strided buffer for one fact: [L][T][H][D] with padding between heads and
 * tokens, so the copy paths cannot get away with contiguous assumptions. */
typedef struct strided {
  kvi_kv_view view;
  void *host_k, *host_v; /* host copies of the buffers */
  size_t elems;          /* elements per buffer */
} strided;

static void strided_make(strided *s, const fixture *f, int32_t T, kvi_dtype dt, int64_t head_pad, int64_t tok_pad,
                         int64_t offset) {
  kvi_kv_view_init(&s->view, sizeof s->view);
  s->view.dtype = dt;
  s->view.num_layers = f->L;
  s->view.num_tokens = T;
  s->view.num_heads = f->H;
  s->view.head_size = f->D;
  s->view.head_stride = f->D + head_pad;
  s->view.token_stride = f->H * s->view.head_stride + tok_pad;
  s->view.layer_stride = T * s->view.token_stride;
  s->elems = (size_t)(offset + f->L * s->view.layer_stride);
  size_t es = kvi_dtype_size(dt);
  s->host_k = malloc(s->elems * es);
  s->host_v = malloc(s->elems * es);
  fill_random(s->host_k, dt, s->elems);
  fill_random(s->host_v, dt, s->elems);
  s->view.memory = KVI_MEMORY_HOST;
  s->view.k = (char *)s->host_k + offset * es;
  s->view.v = (char *)s->host_v + offset * es;
}

static void strided_free(strided *s) {
  free(s->host_k);
  free(s->host_v);
}

#ifdef KVI_HAVE_CUDA
/* Device copy of a host strided buffer: same strides and offset. */
static void to_device(const strided *s, kvi_kv_view *dv, void **dk, void **dvv) {
  size_t es = kvi_dtype_size(s->view.dtype), bytes = s->elems * es;
  CUDA_OK(cudaMalloc(dk, bytes));
  CUDA_OK(cudaMalloc(dvv, bytes));
  CUDA_OK(cudaMemcpy(*dk, s->host_k, bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(*dvv, s->host_v, bytes, cudaMemcpyHostToDevice));
  /* From pageable memory cudaMemcpy returns once the data is staged, before
   * the DMA into the buffer has completed; work on a non-blocking stream (the
   * puts in test_persist) does not wait for the legacy stream, and read the
   * buffer's last bytes before they landed (zeros). */
  CUDA_OK(cudaDeviceSynchronize());
  *dv = s->view;
  dv->memory = KVI_MEMORY_DEVICE;
  dv->k = (char *)*dk + ((char *)s->view.k - (char *)s->host_k);
  dv->v = (char *)*dvv + ((char *)s->view.v - (char *)s->host_v);
}
#endif

/* Reads a fact back from a store into a fresh contiguous host buffer of dtype dt. */
static void read_host(const fixture *f, const kvi_store *st, uint64_t tenant, uint64_t id, int32_t T, kvi_dtype dt,
                      void **k, void **v) {
  size_t n = (size_t)f->L * T * f->H * f->D, es = kvi_dtype_size(dt);
  *k = malloc(n * es);
  *v = malloc(n * es);
  memset(*k, 0xA5, n * es); /* poison: every element must be written */
  memset(*v, 0xA5, n * es);
  kvi_kv_view out;
  kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, dt, f->L, T, f->H, f->D, *k, *v);
  CHECK_OK(kvi_store_read(st, tenant, id, &out, NULL));
}

static void assert_same_fact(const fixture *f, uint64_t tenant, uint64_t id, int32_t T, kvi_dtype dt) {
  void *gk, *gv, *ck, *cv;
  read_host(f, f->gpu, tenant, id, T, dt, &gk, &gv);
  read_host(f, f->cpu, tenant, id, T, dt, &ck, &cv);
  size_t bytes = (size_t)f->L * T * f->H * f->D * kvi_dtype_size(dt);
  assert_memory_equal(gk, ck, bytes);
  assert_memory_equal(gv, cv, bytes);
  free(gk);
  free(gv);
  free(ck);
  free(cv);
}

/* ---------------------------------------------------------------- tests */

static void test_backend_choice(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
  kvi_store_stats s = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(f->gpu, &s));
  assert_int_equal(s.backend, KVI_BACKEND_CUDA);
  assert_int_equal(s.device, 0);
  /* AUTO takes the GPU when one answers; -1 means the current device */
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.budget_bytes = 4u << 20;
  kvi_store *a = NULL;
  CHECK_OK(kvi_store_create(&a, f->model, &so));
  CHECK_OK(kvi_store_stats_get(a, &s));
  assert_int_equal(s.backend, KVI_BACKEND_CUDA);
#ifdef KVI_HAVE_CUDA
  int cur = -1;
  CUDA_OK(cudaGetDevice(&cur));
  assert_int_equal(s.device, cur);
#endif
  kvi_store_destroy(a);
  /* an ordinal past the last device */
  so.backend = KVI_BACKEND_CUDA;
  so.device = g_devices;
  a = (kvi_store *)0x1;
  assert_int_equal(kvi_store_create(&a, f->model, &so), KVI_ERR_NO_DEVICE);
  assert_ptr_equal(a, (kvi_store *)0x1);
  /* 4-bit stores on both backends: host puts and reads of a CUDA store
   * (quantized and dequantized on the CPU through the staging pages) and
   * device ones (the store kernels) equal the CPU store's bit for bit */
  so.device = -1;
  so.dtype = KVI_DTYPE_Q4;
  so.page_tokens = 64;
  kvi_store *q[2] = {NULL, NULL};
  so.backend = KVI_BACKEND_CUDA;
  CHECK_OK(kvi_store_create(&q[0], f->model, &so));
  so.backend = KVI_BACKEND_CPU;
  CHECK_OK(kvi_store_create(&q[1], f->model, &so));
  const int32_t T = 70, L = 3, H = 4, D = 128;
  const size_t n = (size_t)L * T * H * D;
  float *k = malloc(n * 4), *v = malloc(n * 4), *r = malloc(6 * n * 4);
  assert_non_null(k);
  assert_non_null(v);
  assert_non_null(r);
  for (size_t i = 0; i < n; i++) k[i] = (float)((int)(i * 2654435761u % 2001) - 1000) / 97.0f, v[i] = (float)(i % 37) / 11.0f;
  kvi_kv_view kv, out;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, v);
  for (int i = 0; i < 2; i++) {
    CHECK_OK(kvi_store_put(q[i], 1, 2, &kv, NULL, NULL));
    kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, r + 2 * n * (size_t)i,
                           r + 2 * n * (size_t)i + n);
    CHECK_OK(kvi_store_read(q[i], 1, 2, &out, NULL));
  }
  assert_int_equal(memcmp(r, r + 2 * n, 2 * n * 4), 0);
#ifdef KVI_HAVE_CUDA
  float *dk;
  CUDA_OK(cudaMalloc((void **)&dk, n * 8));
  CUDA_OK(cudaMemcpy(dk, k, n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk + n, v, n * 4, cudaMemcpyHostToDevice));
  kvi_kv_view_contiguous(&out, KVI_MEMORY_DEVICE, KVI_DTYPE_FP32, L, T, H, D, dk, dk + n);
  CHECK_OK(kvi_store_put(q[0], 1, 3, &out, NULL, NULL)); /* from device memory */
  CHECK_OK(kvi_store_read(q[0], 1, 3, &out, NULL));      /* into device memory */
  CUDA_OK(cudaMemcpy(r + 4 * n, dk, n * 8, cudaMemcpyDeviceToHost));
  assert_int_equal(memcmp(r, r + 4 * n, 2 * n * 4), 0);
  cudaFree(dk);
#endif
  free(k);
  free(v);
  free(r);
  kvi_store_destroy(q[0]);
  kvi_store_destroy(q[1]);
}

/* Host sources of every dtype, strided, into both stores; reads of every dtype agree bit for bit. */
static void test_host_put_matches_cpu(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
  const kvi_dtype dts[] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16};
  const int32_t lens[] = {1, 7, 16, 33, 200};
  uint64_t id = 1;
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 5; j++, id++) {
      strided s;
      strided_make(&s, f, lens[j], dts[i], j % 2 ? 8 : 0, j % 3 ? 0 : 16, j);
      CHECK_OK(kvi_store_put(f->gpu, 5, id, &s.view, NULL, NULL));
      CHECK_OK(kvi_store_put(f->cpu, 5, id, &s.view, NULL, NULL));
      for (int r = 0; r < 3; r++) assert_same_fact(f, 5, id, lens[j], dts[r]);
      strided_free(&s);
    }
  kvi_store_stats a = KVI_STORE_STATS_INIT, b = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(f->gpu, &a));
  CHECK_OK(kvi_store_stats_get(f->cpu, &b));
  assert_int_equal(a.pages_used, b.pages_used);
  assert_int_equal(a.bytes_payload, b.bytes_payload);
  assert_int_equal(a.facts, 15);
}

/* Device sources (aligned and misaligned, strided) through the kernels equal the CPU path. */
static void test_device_put_and_read(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  const kvi_dtype dts[] = {KVI_DTYPE_FP32, KVI_DTYPE_FP16, KVI_DTYPE_BF16};
  const int32_t lens[] = {1, 16, 45, 300};
  uint64_t id = 100;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreate(&stream));
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 4; j++, id++) {
      strided s;
      /* j odd: one-element offset and padded heads break 16-byte alignment */
      strided_make(&s, f, lens[j], dts[i], j % 2 ? 3 : 0, j == 2 ? 8 : 0, j % 2);
      kvi_kv_view dv;
      void *dk, *dvv;
      to_device(&s, &dv, &dk, &dvv);
      CHECK_OK(kvi_store_put(f->gpu, 9, id, &dv, NULL, (struct CUstream_st *)stream));
      CHECK_OK(kvi_store_put(f->cpu, 9, id, &s.view, NULL, NULL));
      CUDA_OK(cudaStreamSynchronize(stream));
      for (int r = 0; r < 3; r++) assert_same_fact(f, 9, id, lens[j], dts[r]);

      /* read into a strided device destination; the bytes between rows stay untouched */
      size_t es = kvi_dtype_size(dts[i]), bytes = s.elems * es;
      CUDA_OK(cudaMemset(dk, 0x5A, bytes));
      CUDA_OK(cudaMemset(dvv, 0x5A, bytes));
      CHECK_OK(kvi_store_read(f->gpu, 9, id, &dv, (struct CUstream_st *)stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      unsigned char *gk = malloc(bytes), *gv = malloc(bytes), *ck = malloc(bytes), *cv = malloc(bytes);
      CUDA_OK(cudaMemcpy(gk, dk, bytes, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemcpy(gv, dvv, bytes, cudaMemcpyDeviceToHost));
      memset(ck, 0x5A, bytes);
      memset(cv, 0x5A, bytes);
      kvi_kv_view hv = s.view;
      hv.k = ck + ((char *)s.view.k - (char *)s.host_k);
      hv.v = cv + ((char *)s.view.v - (char *)s.host_v);
      CHECK_OK(kvi_store_read(f->cpu, 9, id, &hv, NULL));
      assert_memory_equal(gk, ck, bytes);
      assert_memory_equal(gv, cv, bytes);
      free(gk);
      free(gv);
      free(ck);
      free(cv);
      CUDA_OK(cudaFree(dk));
      CUDA_OK(cudaFree(dvv));
      strided_free(&s);
    }
  CUDA_OK(cudaStreamDestroy(stream));
#endif
}

/* A fact larger than one launch (256 pages) and than the staging buffer. */
static void test_large_fact(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  const int32_t T = 16 * 300 + 5;
  strided s;
  strided_make(&s, f, T, KVI_DTYPE_BF16, 0, 0, 0);
  CHECK_OK(kvi_store_put(f->gpu, 1, 1, &s.view, NULL, NULL)); /* host path */
  CHECK_OK(kvi_store_put(f->cpu, 1, 1, &s.view, NULL, NULL));
  assert_same_fact(f, 1, 1, T, KVI_DTYPE_BF16);
  kvi_kv_view dv;
  void *dk, *dvv;
  to_device(&s, &dv, &dk, &dvv);
  CHECK_OK(kvi_store_put(f->gpu, 1, 2, &dv, NULL, NULL)); /* kernel path, two launches */
  CHECK_OK(kvi_store_put(f->cpu, 1, 2, &s.view, NULL, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  assert_same_fact(f, 1, 2, T, KVI_DTYPE_FP32);
  CUDA_OK(cudaFree(dk));
  CUDA_OK(cudaFree(dvv));
  strided_free(&s);
#endif
}

static void test_memory_kind_errors(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  strided s;
  strided_make(&s, f, 8, KVI_DTYPE_BF16, 0, 0, 0);
  kvi_kv_view dv;
  void *dk, *dvv;
  to_device(&s, &dv, &dk, &dvv);
  kvi_store_stats before = KVI_STORE_STATS_INIT, after = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(f->gpu, &before));

  kvi_kv_view bad = dv;
  bad.memory = KVI_MEMORY_HOST; /* device pointers declared as host */
  assert_int_equal(kvi_store_put(f->gpu, 1, 1, &bad, NULL, NULL), KVI_ERR_MEMORY_KIND);
  assert_non_null(strstr(kvi_last_error(), "device memory"));
  assert_int_equal(kvi_store_put(f->cpu, 1, 1, &bad, NULL, NULL), KVI_ERR_MEMORY_KIND);
  bad = s.view;
  bad.memory = KVI_MEMORY_DEVICE; /* host pointers declared as device */
  assert_int_equal(kvi_store_put(f->gpu, 1, 1, &bad, NULL, NULL), KVI_ERR_MEMORY_KIND);
  assert_non_null(strstr(kvi_last_error(), "host memory"));
  assert_int_equal(kvi_store_put(f->cpu, 1, 1, &dv, NULL, NULL), KVI_ERR_MEMORY_KIND);
  bad = dv;
  bad.v = s.view.v; /* only V is wrong */
  assert_int_equal(kvi_store_put(f->gpu, 1, 1, &bad, NULL, NULL), KVI_ERR_MEMORY_KIND);
  assert_non_null(strstr(kvi_last_error(), "kv->v"));

  CHECK_OK(kvi_store_stats_get(f->gpu, &after));
  assert_int_equal(after.facts, before.facts);
  assert_int_equal(after.pages_used, before.pages_used);

  /* reads check the destination the same way */
  CHECK_OK(kvi_store_put(f->gpu, 1, 1, &dv, NULL, NULL));
  bad = dv;
  bad.memory = KVI_MEMORY_HOST;
  assert_int_equal(kvi_store_read(f->gpu, 1, 1, &bad, NULL), KVI_ERR_MEMORY_KIND);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaFree(dk));
  CUDA_OK(cudaFree(dvv));
  strided_free(&s);
#endif
}

static void test_capacity_and_replace(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(f->gpu, &st));
  const int32_t page = st.page_tokens;
  const int32_t T = (int32_t)(st.pages_total - 1) * page; /* all but one page */
  strided a, b;
  strided_make(&a, f, T, KVI_DTYPE_FP32, 0, 0, 0);
  strided_make(&b, f, 2 * page, KVI_DTYPE_FP32, 0, 0, 0);
  CHECK_OK(kvi_store_put(f->gpu, 3, 1, &a.view, NULL, NULL));
  CHECK_OK(kvi_store_put(f->cpu, 3, 1, &a.view, NULL, NULL));
  assert_int_equal(kvi_store_put(f->gpu, 3, 2, &b.view, NULL, NULL), KVI_ERR_CAPACITY);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.flags = KVI_PUT_REPLACE; /* needs room for both copies */
  assert_int_equal(kvi_store_put(f->gpu, 3, 1, &b.view, &po, NULL), KVI_ERR_CAPACITY);
  assert_same_fact(f, 3, 1, T, KVI_DTYPE_FP32); /* unchanged */
  CHECK_OK(kvi_store_remove(f->gpu, 3, 1));
  CHECK_OK(kvi_store_remove(f->cpu, 3, 1));
  CHECK_OK(kvi_store_put(f->gpu, 3, 1, &b.view, &po, NULL)); /* replace of an absent key is a put */
  CHECK_OK(kvi_store_put(f->cpu, 3, 1, &b.view, &po, NULL));
  assert_same_fact(f, 3, 1, 2 * page, KVI_DTYPE_FP32);
  CHECK_OK(kvi_store_stats_get(f->gpu, &st));
  assert_int_equal(st.pages_used, 2);
  strided_free(&a);
  strided_free(&b);
}

static void test_device_embedding(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  float e[96], back[96];
  for (int i = 0; i < 96; i++) e[i] = rndf();
  void *de;
  CUDA_OK(cudaMalloc(&de, sizeof e));
  CUDA_OK(cudaMemcpy(de, e, sizeof e, cudaMemcpyHostToDevice));
  strided s;
  strided_make(&s, f, 4, KVI_DTYPE_BF16, 0, 0, 0);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = de;
  po.embedding_memory = KVI_MEMORY_DEVICE;
  CHECK_OK(kvi_store_put(f->gpu, 1, 1, &s.view, &po, NULL));
  CHECK_OK(kvi_store_get_embedding(f->gpu, 1, 1, back));
  assert_memory_equal(e, back, sizeof e);
  po.embedding_memory = KVI_MEMORY_HOST; /* wrong declaration */
  assert_int_equal(kvi_store_put(f->gpu, 1, 2, &s.view, &po, NULL), KVI_ERR_MEMORY_KIND);
  /* NaN coming from device memory is caught too */
  float nan_e[96];
  memcpy(nan_e, e, sizeof e);
  nan_e[50] = 0.0f / 0.0f;
  CUDA_OK(cudaMemcpy(de, nan_e, sizeof e, cudaMemcpyHostToDevice));
  po.embedding_memory = KVI_MEMORY_DEVICE;
  assert_int_equal(kvi_store_put(f->gpu, 1, 3, &s.view, &po, NULL), KVI_ERR_INVALID_ARGUMENT);
  size_t n = 99;
  CHECK_OK(kvi_store_count(f->gpu, 1, &n));
  assert_int_equal(n, 1);
  CUDA_OK(cudaFree(de));
  strided_free(&s);
#endif
}

#ifdef KVI_HAVE_CUDA
#define ASSERT_ON_DEVICE_0()                                                                                   \
  do {                                                                                                         \
    int dev_ = -1;                                                                                             \
    CUDA_OK(cudaGetDevice(&dev_));                                                                             \
    assert_int_equal(dev_, 0);                                                                                 \
  } while (0)
#endif

/* A store on device 1 used while device 0 is current (machines with two
 * devices): each call does its work on the store's device (a kernel on the
 * wrong one could not reach the store's pages) and gives device 0 back.
 * Facts, embeddings and search results are the CPU store's. */
static void test_other_device(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  if (g_devices < 2) skip();
  CUDA_OK(cudaSetDevice(0));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.dtype = KVI_DTYPE_BF16;
  so.page_tokens = 16;
  so.budget_bytes = 8u << 20;
  so.host_budget_bytes = 8u << 20; /* tiered: prefetch has work to do */
  so.embedding_dim = 96;
  so.backend = KVI_BACKEND_CUDA;
  so.device = 1;
  kvi_store *s1 = NULL;
  CHECK_OK(kvi_store_create(&s1, f->model, &so));
  ASSERT_ON_DEVICE_0();
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(s1, &st));
  assert_int_equal(st.device, 1);
  float e[96], back[96], ref[96];
  for (int i = 0; i < 96; i++) e[i] = rndf();
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = e;
  strided a;
  strided_make(&a, f, 20, KVI_DTYPE_BF16, 3, 5, 7);
  CHECK_OK(kvi_store_put(s1, 1, 1, &a.view, &po, NULL)); /* from the host */
  ASSERT_ON_DEVICE_0();
  CHECK_OK(kvi_store_put(f->cpu, 1, 1, &a.view, &po, NULL));
  kvi_kv_view dv;
  void *dk, *dvv, *rk, *rv;
  const size_t n = (size_t)f->L * 20 * f->H * f->D, bytes = n * sizeof(uint16_t);
  CUDA_OK(cudaSetDevice(1));
  to_device(&a, &dv, &dk, &dvv);
  CUDA_OK(cudaMalloc(&rk, bytes));
  CUDA_OK(cudaMalloc(&rv, bytes));
  CUDA_OK(cudaSetDevice(0));
  float e2[96]; /* fact 2 scores half of fact 1's for the query e */
  for (int i = 0; i < 96; i++) e2[i] = 0.5f * e[i];
  po.embedding = e2;
  CHECK_OK(kvi_store_put(s1, 1, 2, &dv, &po, NULL)); /* from device 1's memory */
  ASSERT_ON_DEVICE_0();
  CHECK_OK(kvi_store_put(f->cpu, 1, 2, &a.view, &po, NULL));
  CHECK_OK(kvi_store_prefetch(s1, 1, NULL, 0, NULL));
  ASSERT_ON_DEVICE_0();
  for (uint64_t id = 1; id <= 2; id++) { /* into host memory */
    void *gk, *gv, *ck, *cv;
    read_host(f, s1, 1, id, 20, KVI_DTYPE_BF16, &gk, &gv);
    ASSERT_ON_DEVICE_0();
    read_host(f, f->cpu, 1, id, 20, KVI_DTYPE_BF16, &ck, &cv);
    assert_memory_equal(gk, ck, bytes);
    assert_memory_equal(gv, cv, bytes);
    free(gk), free(gv), free(ck), free(cv);
  }
  kvi_kv_view out; /* into device 1's memory */
  kvi_kv_view_contiguous(&out, KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, f->L, 20, f->H, f->D, rk, rv);
  CHECK_OK(kvi_store_read(s1, 1, 2, &out, NULL));
  ASSERT_ON_DEVICE_0();
  {
    void *ck, *cv, *gk = malloc(bytes), *gv = malloc(bytes);
    read_host(f, f->cpu, 1, 2, 20, KVI_DTYPE_BF16, &ck, &cv);
    CUDA_OK(cudaSetDevice(1));
    CUDA_OK(cudaMemcpy(gk, rk, bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(gv, rv, bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaSetDevice(0));
    assert_memory_equal(gk, ck, bytes);
    assert_memory_equal(gv, cv, bytes);
    free(gk), free(gv), free(ck), free(cv);
  }
  CHECK_OK(kvi_store_get_embedding(s1, 1, 2, back));
  ASSERT_ON_DEVICE_0();
  CHECK_OK(kvi_store_get_embedding(f->cpu, 1, 2, ref));
  assert_memory_equal(back, ref, sizeof back);
  const uint64_t tenants[1] = {1};
  uint64_t ids[2], cids[2];
  float scores[2], cscores[2];
  int32_t count = -1, ccount = -1;
  CHECK_OK(kvi_store_search(s1, e, 1, 96, tenants, 2, ids, scores, &count, NULL, NULL));
  ASSERT_ON_DEVICE_0();
  CHECK_OK(kvi_store_search(f->cpu, e, 1, 96, tenants, 2, cids, cscores, &ccount, NULL, NULL));
  assert_int_equal(count, 2);
  assert_int_equal(ccount, 2);
  assert_int_equal(cids[0], 1);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(ids[i], cids[i]);
    assert_true(fabsf(scores[i] - cscores[i]) <= 1e-4f * (1.0f + fabsf(cscores[i])));
  }
  int64_t bad = -1;
  CHECK_OK(kvi_store_async_errors(s1, &bad));
  assert_int_equal(bad, 0);
  CHECK_OK(kvi_store_remove(s1, 1, 1));
  ASSERT_ON_DEVICE_0();
  size_t left = 0;
  CHECK_OK(kvi_store_count(s1, 1, &left));
  assert_int_equal(left, 1);
  kvi_store_destroy(s1);
  ASSERT_ON_DEVICE_0();
  CUDA_OK(cudaSetDevice(1));
  CUDA_OK(cudaFree(dk));
  CUDA_OK(cudaFree(dvv));
  CUDA_OK(cudaFree(rk));
  CUDA_OK(cudaFree(rv));
  CUDA_OK(cudaSetDevice(0));
  strided_free(&a);
#endif
}

/* The caller's current device is the same before and after every call. */
static void test_current_device_kept(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  int before = -1, after = -2;
  CUDA_OK(cudaGetDevice(&before));
  strided s;
  strided_make(&s, f, 5, KVI_DTYPE_FP16, 0, 0, 0);
  CHECK_OK(kvi_store_put(f->gpu, 1, 1, &s.view, NULL, NULL));
  CUDA_OK(cudaGetDevice(&after));
  assert_int_equal(before, after);
  strided_free(&s);
#endif
}

typedef struct worker {
  fixture *f;
  int index;
  int failures;
} worker;

static void *thread_main(void *arg) {
  worker *w = arg;
  const fixture *f = w->f;
  for (int i = 0; i < 40; i++) {
    int32_t T = 1 + (i * 7 + w->index) % 40;
    size_t n = (size_t)f->L * T * f->H * f->D;
    uint16_t *k = malloc(n * 2), *v = malloc(n * 2), *k2 = malloc(n * 2), *v2 = malloc(n * 2);
    for (size_t j = 0; j < n; j++) {
      k[j] = (uint16_t)(0x3c00 + ((j * 31 + (size_t)i + (size_t)w->index * 1000) & 0x3ff)); /* finite halves */
      v[j] = (uint16_t)(0x4000 + ((j * 17 + (size_t)i) & 0x3ff));
    }
    kvi_kv_view in, out;
    kvi_kv_view_contiguous(&in, KVI_MEMORY_HOST, KVI_DTYPE_FP16, f->L, T, f->H, f->D, k, v);
    kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP16, f->L, T, f->H, f->D, k2, v2);
    uint64_t id = (uint64_t)w->index * 1000 + (uint64_t)i;
    if (kvi_store_put(f->gpu, 77, id, &in, NULL, NULL) != KVI_OK ||
        kvi_store_read(f->gpu, 77, id, &out, NULL) != KVI_OK || memcmp(k, k2, n * 2) || memcmp(v, v2, n * 2))
      w->failures++;
    if (i % 2 == 0 && kvi_store_remove(f->gpu, 77, id) != KVI_OK) w->failures++;
    free(k);
    free(v);
    free(k2);
    free(v2);
  }
  return NULL;
}

static void test_threads(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
  enum { N = 6 };
  pthread_t th[N];
  worker w[N];
  for (int i = 0; i < N; i++) {
    w[i] = (worker){f, i, 0};
    assert_int_equal(pthread_create(&th[i], NULL, thread_main, &w[i]), 0);
  }
  for (int i = 0; i < N; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(w[i].failures, 0);
  }
  size_t n = 0;
  CHECK_OK(kvi_store_count(f->gpu, 77, &n));
  assert_int_equal(n, N * 20);
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(f->gpu, &st));
  uint64_t pages = 0;
  for (int t = 0; t < N; t++)
    for (int i = 1; i < 40; i += 2) pages += (uint64_t)((1 + (i * 7 + t) % 40) + st.page_tokens - 1) / st.page_tokens;
  assert_int_equal(st.pages_used, pages);
}

#ifdef KVI_HAVE_CUDA
/* Reads fact (tenant, id) from stores a and b in dtype dt; bit-identical. */
static void assert_same_in(const fixture *f, const kvi_store *a, const kvi_store *b, uint64_t tenant, uint64_t id,
                           int32_t T, kvi_dtype dt) {
  void *ak, *av, *bk, *bv;
  read_host(f, a, tenant, id, T, dt, &ak, &av);
  read_host(f, b, tenant, id, T, dt, &bk, &bv);
  const size_t bytes = (size_t)f->L * T * f->H * f->D * kvi_dtype_size(dt);
  assert_memory_equal(ak, bk, bytes);
  assert_memory_equal(av, bv, bytes);
  free(ak);
  free(av);
  free(bk);
  free(bv);
}
#endif

/* Store files of a CUDA store: journaled puts from device memory on a stream
 * the test never synchronizes (the journal waits for it), host puts, a
 * removal, then a save right after a device put; both files load into a CUDA
 * and a CPU store that read back bit for bit what the CPU reference holds. */
static void test_persist(void **state) {
  fixture *f = *state;
  (void)f; /* unused where CUDA is not built */
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  char dir[] = "/tmp/kvi-gpu-persist-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char jpath[64], spath[64];
  snprintf(jpath, sizeof jpath, "%s/journal.kvi", dir);
  snprintf(spath, sizeof spath, "%s/snapshot.kvi", dir);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK_OK(kvi_store_journal_open(f->gpu, jpath, 0));
  const int32_t lens[] = {1, 16, 45, 300, 33, 7};
  void *dbuf[12];
  int nd = 0;
  for (int j = 0; j < 6; j++) {
    strided s;
    strided_make(&s, f, lens[j], KVI_DTYPE_FP32, j % 2 ? 3 : 0, 0, j % 2);
    if (j % 2 == 0) {
      kvi_kv_view dv;
      to_device(&s, &dv, &dbuf[nd], &dbuf[nd + 1]);
      nd += 2;
      CHECK_OK(kvi_store_put(f->gpu, 4, (uint64_t)j, &dv, NULL, (struct CUstream_st *)stream));
    } else {
      CHECK_OK(kvi_store_put(f->gpu, 4, (uint64_t)j, &s.view, NULL, NULL));
    }
    CHECK_OK(kvi_store_put(f->cpu, 4, (uint64_t)j, &s.view, NULL, NULL));
    strided_free(&s);
  }
  CHECK_OK(kvi_store_remove(f->gpu, 4, 1));
  CHECK_OK(kvi_store_remove(f->cpu, 4, 1));
  CHECK_OK(kvi_store_journal_close(f->gpu));
  {
    /* a device put not yet complete when the save starts: the save waits for it */
    strided s;
    strided_make(&s, f, 500, KVI_DTYPE_FP32, 0, 0, 0);
    kvi_kv_view dv;
    to_device(&s, &dv, &dbuf[nd], &dbuf[nd + 1]);
    nd += 2;
    CHECK_OK(kvi_store_put(f->gpu, 5, 1, &dv, NULL, (struct CUstream_st *)stream));
    CHECK_OK(kvi_store_put(f->cpu, 5, 1, &s.view, NULL, NULL));
    CHECK_OK(kvi_store_save(f->gpu, spath, NULL));
    strided_free(&s);
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  for (int i = 0; i < nd; i++) CUDA_OK(cudaFree(dbuf[i]));
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(f->gpu, &st));
  for (int file = 0; file < 2; file++)
    for (int be = 0; be < 2; be++) {
      kvi_store_options so = KVI_STORE_OPTIONS_INIT;
      so.backend = be ? KVI_BACKEND_CUDA : KVI_BACKEND_CPU;
      so.device = 0;
      so.dtype = st.dtype;
      so.page_tokens = st.page_tokens + 3;
      so.budget_bytes = st.bytes_reserved * 2;
      kvi_store *l = NULL;
      CHECK_OK(kvi_store_load(&l, f->model, &so, file ? spath : jpath, NULL));
      for (int j = 0; j < 6; j++) {
        int32_t T = -1;
        if (j == 1) {
          assert_int_equal(kvi_store_fact_tokens(l, 4, 1, &T), KVI_ERR_NOT_FOUND);
          continue;
        }
        CHECK_OK(kvi_store_fact_tokens(l, 4, (uint64_t)j, &T));
        assert_int_equal(T, lens[j]);
        assert_same_in(f, l, f->cpu, 4, (uint64_t)j, T, st.dtype);
      }
      size_t n = 0;
      CHECK_OK(kvi_store_count(l, 5, &n));
      assert_int_equal(n, (size_t)file);
      if (file) assert_same_in(f, l, f->cpu, 5, 1, 500, st.dtype);
      kvi_store_destroy(l);
    }
  CUDA_OK(cudaStreamDestroy(stream));
  unlink(jpath);
  unlink(spath);
  rmdir(dir);
#endif
}

int main(void) {
  if (kvi_cuda_device_count(&g_devices) != KVI_OK) g_devices = 0;
  if (g_devices == 0) fprintf(stderr, "gpu suite: no CUDA device (%s); every test skips\n", kvi_last_error());
  const struct CMUnitTest bf16_tests[] = {
      cmocka_unit_test_setup_teardown(test_backend_choice, setup_bf16, teardown),
      cmocka_unit_test_setup_teardown(test_host_put_matches_cpu, setup_bf16, teardown),
      cmocka_unit_test_setup_teardown(test_device_put_and_read, setup_bf16, teardown),
      cmocka_unit_test_setup_teardown(test_large_fact, setup_bf16, teardown),
      cmocka_unit_test_setup_teardown(test_memory_kind_errors, setup_bf16, teardown),
      cmocka_unit_test_setup_teardown(test_host_put_matches_cpu, setup_fp16_odd, teardown),
      cmocka_unit_test_setup_teardown(test_device_put_and_read, setup_fp16_odd, teardown),
      cmocka_unit_test_setup_teardown(test_host_put_matches_cpu, setup_fp32, teardown),
      cmocka_unit_test_setup_teardown(test_device_put_and_read, setup_fp32, teardown),
      cmocka_unit_test_setup_teardown(test_capacity_and_replace, setup_fp32, teardown),
      cmocka_unit_test_setup_teardown(test_device_embedding, setup_emb, teardown),
      cmocka_unit_test_setup_teardown(test_current_device_kept, setup_fp16_odd, teardown),
      cmocka_unit_test_setup_teardown(test_other_device, setup_emb, teardown),
      cmocka_unit_test_setup_teardown(test_threads, setup_fp16_odd, teardown),
      cmocka_unit_test_setup_teardown(test_persist, setup_bf16, teardown),
      cmocka_unit_test_setup_teardown(test_persist, setup_fp16_odd, teardown),
  };
  int failed = cmocka_run_group_tests_name("gpu", bf16_tests, NULL, NULL);
  if (failed) return 1;
  return g_devices == 0 ? 77 : 0;
}
