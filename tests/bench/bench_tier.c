/*
 * bench_tier — injecting facts that live in a store's pinned-host tier,
 * against the pinned host-to-device copy rate measured in the same run.
 *
 * Llama-3.1-8B geometry (32 layers, 8 KV heads, head size 128, llama3 RoPE),
 * bf16 store, k = 50 facts of 24 tokens (150 MiB of K and V) injected into a
 * bf16 vLLM FlashAttention cache. The device tier holds exactly one set of
 * 50 facts; two disjoint sets alternate, so every timed call finds its 50
 * facts on the host and the other set on the device: it demotes the other
 * set (a swap back to its clean host copy, no copy) and promotes its own
 * (one cudaMemcpyAsync per run of whole pages, a pitched copy of each last
 * page's used rows), then injects. Cases:
 *   - promote: kvi_inject with KVI_HOST_PAGES_PROMOTE (the default);
 *   - mapped: kvi_inject with KVI_HOST_PAGES_READ_MAPPED, a third set that
 *     stays on the host, read by the kernel in place over the bus;
 *   - device: the same call with the facts already on the device (reference).
 * "H2D ms" is one cudaMemcpyAsync of the same 150 MiB from pinned host
 * memory to the device in the same run (the ceiling); "of H2D" = H2D ms /
 * call ms. Median of ITERS calls after WARM, CUDA events around the call.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include <kvinject.h>

#include "bench.h"

enum { L = 32, H = 8, D = 128, BS = 16, T = 24, K = 50, WARM = 4, ITERS = 40 };
static const size_t TOKEN_BYTES = (size_t)L * H * D * 2 * 2; /* K and V, bf16 */

static void row(const char *what, int P, float ms, float hms, float h2d, const kvi_store_stats *st) {
  const double bytes = (double)K * T * TOKEN_BYTES;
  printf("| %-8s | %2d | %2d | %6.1f | %7.3f | %7.3f | %6.1f | %7.3f | %6.1f%% | %10llu | %9llu |\n", what, P, K,
         bytes / 1048576.0, ms, hms, bytes / (ms * 1e-3) / 1e9, h2d, 100.0 * h2d / ms,
         (unsigned long long)st->promotions, (unsigned long long)st->demotions);
}

static void run(int P, kvi_model *model, const uint16_t *hk, void *const *layers, int64_t NB, const int32_t *table,
                float h2d) {
  const int per_fact = (T + P - 1) / P;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  so.page_tokens = P;
  const uint64_t page = (uint64_t)P * TOKEN_BYTES;
  so.budget_bytes = (uint64_t)K * per_fact * page;           /* one set */
  so.host_budget_bytes = (uint64_t)4 * K * per_fact * page; /* three sets, and room to spare */
  kvi_store *store;
  CK(kvi_store_create(&store, model, &so));
  /* sets: A = 0..49 (put first: the device), B = 50..99 and C = 100..149 (the host) */
  const size_t fe = (size_t)L * T * H * D;
  for (int f = 0; f < 3 * K; f++) {
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_BF16, L, T, H, D, (void *)(hk + (size_t)(f % 7) * 64),
                           (void *)(hk + fe + (size_t)(f % 5) * 64));
    CK(kvi_store_put(store, 1, (uint64_t)f, &kv, NULL, NULL));
  }
  kvi_cache_layout cl;
  CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_DEVICE;
  kvi_injector *inj;
  CK(kvi_injector_create(&inj, store, &cl, NULL));
  cudaEvent_t e0, e1;
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));
  uint64_t ids[K];
  for (int c = 0; c < 3; c++) {
    kvi_inject_options io = KVI_INJECT_OPTIONS_INIT;
    if (c == 1) io.host_pages = KVI_HOST_PAGES_READ_MAPPED;
    float t[ITERS], th[ITERS];
    for (int i = -WARM; i < ITERS; i++) {
      /* promote: B, A, B, ... (each on the host when asked for); mapped: C; device: A twice per step */
      const int set = c == 0 ? ((i + WARM) % 2 == 0 ? 1 : 0) : c == 1 ? 2 : 0;
      for (int f = 0; f < K; f++) ids[f] = (uint64_t)(set * K + f);
      kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
      rq.tenant = 1;
      rq.fact_ids = ids;
      rq.num_facts = K;
      rq.block_table = table + (i + WARM) % 8 * 8;
      rq.block_table_len = (int32_t)(NB - 64);
      rq.start_position = 100;
      if (c == 2) CK(kvi_inject(inj, &rq, 1, NULL, NULL)); /* up, if it was not */
      CU(cudaDeviceSynchronize());
      CU(cudaEventRecord(e0, 0));
      const double h0 = now_ms();
      CK(kvi_inject(inj, &rq, 1, &io, NULL));
      const double h1 = now_ms();
      CU(cudaEventRecord(e1, 0));
      CU(cudaEventSynchronize(e1));
      if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
      if (i >= 0) th[i] = (float)(h1 - h0);
    }
    kvi_store_stats st = KVI_STORE_STATS_INIT;
    CK(kvi_store_stats_get(store, &st));
    row(c == 0 ? "promote" : c == 1 ? "mapped" : "device", P, median(t, ITERS), median(th, ITERS), h2d, &st);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);
}

int main(void) {
  if (!bench_device("bench_tier")) return 77;
  kvi_model *model = bench_llama_model(L, H, D);

  /* fact data: one bf16 K/V pair (sources offset per fact) */
  const size_t fe = (size_t)L * T * H * D;
  uint16_t *hk = malloc((fe * 2 + 1024) * sizeof *hk);
  for (size_t i = 0; i < fe * 2 + 1024; i++) hk[i] = (uint16_t)(0x3c00 + (rand() & 0x3ff)) ^ (rand() & 0x8000);

  /* the cache: room for the 1,200 tokens at 8 offsets, blocks scattered */
  const int64_t NB = (K * T) / BS + 128;
  const size_t layer_bytes = (size_t)2 * NB * BS * H * D * 2;
  void *layers[L];
  for (int l = 0; l < L; l++) {
    CU(cudaMalloc(&layers[l], layer_bytes));
    CU(cudaMemset(layers[l], 0, layer_bytes));
  }
  int32_t *table = malloc((size_t)NB * sizeof *table);
  for (int64_t b = 0; b < NB; b++) table[b] = (int32_t)((b * 7919) % NB);

  /* the ceiling: pinned host -> device, the same bytes, one copy */
  const size_t bytes = (size_t)K * T * TOKEN_BYTES;
  char *pin, *dev;
  CU(cudaHostAlloc((void **)&pin, bytes, cudaHostAllocDefault));
  CU(cudaMalloc((void **)&dev, bytes));
  memset(pin, 1, bytes);
  cudaEvent_t e0, e1;
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));
  float t[ITERS];
  for (int i = -WARM; i < ITERS; i++) {
    CU(cudaEventRecord(e0, 0));
    CU(cudaMemcpyAsync(dev, pin, bytes, cudaMemcpyHostToDevice, 0));
    CU(cudaEventRecord(e1, 0));
    CU(cudaEventSynchronize(e1));
    if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
  }
  const float h2d = median(t, ITERS);
  printf("pinned H2D: %.1f MiB in %.3f ms = %.1f GB/s\n\n", bytes / 1048576.0, h2d, bytes / (h2d * 1e-3) / 1e9);

  printf("| case     |  P |  k |    MiB | call ms | host ms |   GB/s |  H2D ms | of H2D | promotions | demotions |\n");
  printf("|----------|---:|---:|-------:|--------:|--------:|-------:|--------:|-------:|-----------:|----------:|\n");
  run(16, model, hk, layers, NB, table, h2d);
  run(8, model, hk, layers, NB, table, h2d);
  printf("\nMiB: fact bytes (K and V) the call reads from the host; GB/s: those bytes / call time. promote: every\n"
         "call finds its 50 facts on the host and moves them up; mapped: the kernel reads them in place; device:\n"
         "already up. promotions/demotions: the store's counters after the case (cumulative).\n");
  kvi_model_destroy(model);
  for (int l = 0; l < L; l++) cudaFree(layers[l]);
  cudaFreeHost(pin);
  cudaFree(dev);
  free(table);
  free(hk);
  return 0;
}
