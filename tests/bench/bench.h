/*
 * What the benchmark programs share: checks that stop the program on a
 * library or CUDA error, and the median of a set of timings.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_BENCH_H
#define KVI_BENCH_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include <kvinject.h>

#define CK(call)                                                                                    \
  do {                                                                                              \
    kvi_status st_ = (call);                                                                        \
    if (st_ != KVI_OK) {                                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, kvi_last_error());               \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)
#define CU(call)                                                                                    \
  do {                                                                                              \
    cudaError_t e_ = (call);                                                                        \
    if (e_ != cudaSuccess) {                                                                        \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));         \
      exit(1);                                                                                      \
    }                                                                                               \
  } while (0)

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

#endif /* KVI_BENCH_H */
