/*
 * What the benchmark programs share: checks that stop the program on a
 * library or CUDA error, a monotonic clock, and the median of a set of
 * timings. A CPU-only program defines BENCH_CPU_ONLY first (no CUDA header,
 * CU or device).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_BENCH_H
#define KVI_BENCH_H

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef BENCH_CPU_ONLY
#include <cuda_runtime_api.h>
#endif

#include <kvinject.h>

#define CK(call)                                                                                    \
  do {                                                                                              \
    kvi_status st_ = (call);                                                                        \
    if (st_ != KVI_OK) {                                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, kvi_last_error());               \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)
#ifndef BENCH_CPU_ONLY
#define CU(call)                                                                                    \
  do {                                                                                              \
    cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess) {                                                                        \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));         \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)
#endif

/* CLOCK_MONOTONIC in milliseconds. */
static inline double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static int bench_cmp_f(const void *a, const void *b) {
  const float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* Sorts v and returns its median. */
static inline float median(float *v, int n) {
  qsort(v, (size_t)n, sizeof *v, bench_cmp_f);
  return v[n / 2];
}

/* Timed calls per case (and warm-ups before them): `full` (and 5), or
 * KVI_BENCH_ITERS (and 1) for a quick run under a profiler. */
static int bench_iters = 0, bench_warm = 5;
static inline void bench_runs(int full) {
  const char *e = getenv("KVI_BENCH_ITERS");
  const int n = e ? atoi(e) : 0;
  bench_iters = n > 0 && n < full ? n : full;
  bench_warm = n > 0 && n < full ? 1 : 5;
}

#ifndef BENCH_CPU_ONLY
/* Prints the device banner; false (after saying why) when no CUDA device
 * answers, and the program should exit 77 (Meson's skip). */
static inline int bench_device(const char *prog) {
  int ndev = 0;
  if (kvi_cuda_device_count(&ndev) != KVI_OK || ndev == 0) {
    fprintf(stderr, "%s: no CUDA device\n", prog);
    return 0;
  }
  struct cudaDeviceProp prop;
  CU(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, libkvinject %s\n\n", prop.name, kvi_version_string());
  return 1;
}
#endif

/* A model of layers x heads x head_size with Llama-3.1-8B's RoPE (theta
 * 500,000, llama3 scaling, factor 8) on every layer. */
static inline kvi_model *bench_llama_model(int32_t layers, int32_t heads, int32_t head_size) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = layers;
  mo.num_kv_heads = heads;
  mo.head_size = head_size;
  kvi_model *model;
  CK(kvi_model_create(&model, &mo));
  kvi_rope_spec rope = KVI_ROPE_SPEC_INIT;
  rope.theta = 500000;
  rope.scaling = KVI_ROPE_SCALING_LLAMA3;
  rope.factor = 8;
  CK(kvi_model_set_rope(model, -1, &rope));
  return model;
}

#endif /* KVI_BENCH_H */
