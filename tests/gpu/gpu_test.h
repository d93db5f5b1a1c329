/*
 * Helpers shared by the gpu suite's binaries: status checks, a small random
 * generator (define GPU_TEST_SEED before including to pick a stream), and an
 * engine's cos/sin table.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_GPU_TEST_H
#define KVI_GPU_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include <kvinject.h>

#ifdef KVI_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

#define CHECK_OK(call)                                                                                          \
  do {                                                                                                          \
    kvi_status st_ = (call);                                                                                    \
    if (st_ != KVI_OK) fail_msg("%s -> %d (%s): %s", #call, (int)st_, kvi_status_string(st_), kvi_last_error()); \
  } while (0)

#ifdef KVI_HAVE_CUDA
#define CUDA_OK(call)                                                                                           \
  do {                                                                                                          \
    cudaError_t e_ = (call);                                                                                    \
    if (e_ != cudaSuccess) fail_msg("%s -> %s", #call, cudaGetErrorString(e_));                                 \
  } while (0)
#endif

#ifndef GPU_TEST_SEED
#define GPU_TEST_SEED 0x9e3779b97f4a7c15ull
#endif

static uint64_t g_rng = GPU_TEST_SEED;

static inline uint64_t rnd(void) { /* xorshift64 */
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return g_rng;
}

/* uniform in [-2, 2), never all zeros */
static inline float rndf(void) { return (float)((double)(rnd() >> 11) * 0x1p-53 * 4.0 - 2.0); }

/* x[0..n): integers uniform in [lo, hi] */
static inline void rand_ints(float *x, size_t n, int lo, int hi) {
  for (size_t i = 0; i < n; i++) x[i] = (float)(lo + (int)(rnd() % (uint64_t)(hi - lo + 1)));
}

/* An fp32 cos/sin table of npos rows for rotary_dim rot from theta (a row:
 * the pairs' cos, then their sin), as an engine hands it over; malloc'd. */
static inline float *rope_table_f32(int32_t npos, int32_t rot, double theta) {
  float *t = malloc((size_t)npos * rot * sizeof(float));
  for (int32_t p = 0; p < npos; p++)
    for (int32_t i = 0; i < rot / 2; i++) {
      const double a = p * pow(theta, -2.0 * i / rot);
      t[p * rot + i] = (float)cos(a);
      t[p * rot + rot / 2 + i] = (float)sin(a);
    }
  return t;
}

#endif /* KVI_GPU_TEST_H */
