/*
 * Helpers shared by the gpu suite's binaries: status checks, a small random
 * generator (define GPU_TEST_SEED before including to pick a stream), an
 * engine's cos/sin table, and a fact's stored bytes compared between two
 * stores (through a snapshot of its tenant).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_GPU_TEST_H
#define KVI_GPU_TEST_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* ---- stored bytes ------------------------------------------------------- */

static inline uint64_t gpu_le(const unsigned char *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* The payload of the PUT record of fact (tenant, id) in a snapshot of its
 * tenant (kvi_store_save; docs/store-format.md): the fact's stored bytes as
 * the pages keep them (malloc'd, *len bytes). */
static inline unsigned char *stored_record(const kvi_store *s, uint64_t tenant, uint64_t id, size_t *len) {
  static int serial;
  char path[96];
  snprintf(path, sizeof path, "/tmp/kvi-gpu-bytes-%ld-%d", (long)getpid(), serial++);
  kvi_save_options so = KVI_SAVE_OPTIONS_INIT;
  so.flags = KVI_SAVE_ONE_TENANT;
  so.tenant = tenant;
  CHECK_OK(kvi_store_save(s, path, &so));
  FILE *f = fopen(path, "rb");
  if (!f) fail_msg("reopening %s", path);
  fseek(f, 0, SEEK_END);
  const size_t n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(n ? n : 1);
  if (!b || fread(b, 1, n, f) != n) fail_msg("reading %s", path);
  fclose(f);
  unlink(path);
  for (size_t at = (size_t)gpu_le(b + 16, 4); at + 48 <= n;) { /* entries */
    const size_t body = (size_t)gpu_le(b + at + 24, 8), count = (size_t)gpu_le(b + at + 32, 4);
    size_t r = at + 48;
    for (size_t c = 0; c < count && r + 32 <= n; c++) { /* records */
      const size_t payload = (size_t)gpu_le(b + r + 24, 8);
      if ((gpu_le(b + r, 4) & 0xffffu) == 1 && gpu_le(b + r + 8, 8) == tenant && gpu_le(b + r + 16, 8) == id) {
        unsigned char *out = malloc(payload ? payload : 1);
        if (!out) fail_msg("allocating %zu bytes", payload);
        memcpy(out, b + r + 32, payload);
        free(b);
        *len = payload;
        return out;
      }
      r += 32 + ((payload + 7) & ~(size_t)7);
    }
    at += 48 + body;
  }
  free(b);
  fail_msg("no record of fact %llu/%llu in the snapshot", (unsigned long long)tenant, (unsigned long long)id);
  return NULL;
}

/* Fact (tenant, id) keeps the same stored bytes in stores a and b (a store
 * of dtype dt, L layers, H heads of D, P-token pages, E-element
 * embeddings): its elements (e4m3 bytes, 4-bit codes), then each page's
 * scales and, fp8, its key offsets (kvinject/store.h, "fp8 storage"), its
 * token ids and context; the first difference is named. */
static inline void expect_same_bytes(const kvi_store *a, const kvi_store *b, uint64_t tenant, uint64_t id, kvi_dtype dt,
                                     int32_t L, int32_t H, int32_t D, int32_t P, int32_t E) {
  size_t na = 0, nb = 0;
  unsigned char *x = stored_record(a, tenant, id, &na), *y = stored_record(b, tenant, id, &nb);
  const unsigned long long t = (unsigned long long)tenant, f = (unsigned long long)id;
  if (na != nb) fail_msg("fact %llu/%llu: %zu stored bytes against %zu", t, f, na, nb);
  int32_t T = 0;
  CHECK_OK(kvi_store_fact_tokens(a, tenant, id, &T));
  const size_t lhd = (size_t)L * H * D, el = (size_t)E * 4 + (dt == KVI_DTYPE_Q4 ? (size_t)T * lhd : 2 * (size_t)T * lhd);
  const size_t sc = dt == KVI_DTYPE_Q4 ? (size_t)L * H * (D + P) * 4 : (size_t)L * 2 * H * 4;
  const size_t page = sc + (dt == KVI_DTYPE_FP8_E4M3 ? lhd * 2 : 0), pages = (size_t)(T + P - 1) / (size_t)P;
  for (size_t i = 0; i < na; i++) {
    if (x[i] == y[i]) continue;
    if (i < (size_t)E * 4) fail_msg("fact %llu/%llu: embedding byte %zu differs", t, f, i);
    if (i < el) fail_msg("fact %llu/%llu: element byte %zu differs (0x%02x, 0x%02x)", t, f, i - (size_t)E * 4, x[i], y[i]);
    const size_t q = i - el, p = q / page, r = q % page;
    if (p < pages && r < sc) fail_msg("fact %llu/%llu: page %zu's scales differ (byte %zu)", t, f, p, r);
    if (p < pages) fail_msg("fact %llu/%llu: page %zu's key offset %zu differs", t, f, p, (r - sc) / 2);
    fail_msg("fact %llu/%llu: the token ids or context differ", t, f);
  }
  free(x);
  free(y);
}

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
