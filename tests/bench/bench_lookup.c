/*
 * bench_lookup — the host time of resolving fact ids, the part of a
 * kvi_inject call's planning that grows with the store. CPU only (the
 * lookups are the same code for both backends); prints a Markdown table.
 *
 * A store of N facts (1 token of 1 head of size 8 each: the KV size does
 * not enter a lookup) answers kvi_inject_plan for 64 lists of 50 ids drawn
 * at random (the 64 x 50 injection of bench_inject); median of 60 rounds
 * after 5, each round new ids. With 1,024 facts every lookup hits the
 * cache; with a million, nearly each misses it twice (the hash slot, then
 * the fact).
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BENCH_CPU_ONLY
#include "bench.h"

enum { LISTS = 64, K = 50, ROUNDS = 60, WARM = 5 };

static uint64_t rnd(uint64_t *s) { /* xorshift64* */
  *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
  return *s * 2685821657736338717ull;
}

static void run(int32_t n) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = 1, mo.num_kv_heads = 1, mo.head_size = 8;
  kvi_model *model;
  CK(kvi_model_create(&model, &mo));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.page_tokens = 1;
  so.budget_bytes = (uint64_t)n * 64 + (1u << 20);
  kvi_store *store;
  CK(kvi_store_create(&store, model, &so));
  static uint16_t k[8], v[8];
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_BF16, 1, 1, 1, 8, k, v);
  for (int32_t f = 0; f < n; f++) CK(kvi_store_put(store, 1, (uint64_t)f * 0x9e3779b97f4a7c15ull, &kv, NULL, NULL));
  static uint16_t cache[2 * 16 * 8];
  void *layers[1] = {cache};
  kvi_cache_layout cl;
  CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, 1, 1, 8, 16, 1, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_HOST;
  kvi_injector *inj;
  CK(kvi_injector_create(&inj, store, &cl, NULL));
  static uint64_t ids[LISTS * K];
  float t[ROUNDS];
  uint64_t s = 88172645463325252ull;
  for (int r = -WARM; r < ROUNDS; r++) {
    for (int i = 0; i < LISTS * K; i++) ids[i] = (rnd(&s) % (uint64_t)n) * 0x9e3779b97f4a7c15ull;
    int64_t total = 0;
    const double t0 = now_ms();
    for (int l = 0; l < LISTS; l++) {
      int64_t tok;
      CK(kvi_inject_plan(inj, 1, ids + l * K, K, &tok));
      total += tok;
    }
    const double t1 = now_ms();
    if (total != LISTS * K) {
      fprintf(stderr, "planned %lld tokens, expected %d\n", (long long)total, LISTS * K);
      exit(1);
    }
    if (r >= 0) t[r] = (float)(t1 - t0);
  }
  const float ms = median(t, ROUNDS);
  printf("| %9d | %5d | %8.3f | %7.1f |\n", (int)n, LISTS * K, ms, ms * 1e6 / (LISTS * K));
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);
  kvi_model_destroy(model);
}

int main(void) {
  printf("| facts     | ids   | ms       | ns / id |\n|----------:|------:|---------:|--------:|\n");
  run(1024);
  run(1000000);
  return 0;
}
