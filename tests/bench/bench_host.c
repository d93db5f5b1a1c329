/*
 * bench_host — the host cost per request of an injection call on the CPU
 * backend: kvi_inject (a kvi_inject_request built per request, as an engine
 * does each step) against kvi_inject_batched (the engine's flat arrays as
 * they are). The geometry is tiny (1 layer, 1 head of 16 without RoPE,
 * facts of 1 token in pages of 1) so that the copies themselves cost next to nothing and the
 * figures are the validation, lookups and planning. 64 requests of k facts
 * (1, 5, 50) from a store of 4,096 facts; median of 200 calls after 20.
 * Then the host cost of kvi_store_put of such a fact with a 16-element fp32
 * embedding into a tenant the store holds: rounds of 4,096 puts (each
 * round's facts removed after it, untimed), median of 200 rounds after 20.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define BENCH_CPU_ONLY
#include "bench.h"

enum { R = 64, KMAX = 50, FACTS = 4096, ROUNDS = 200, WARM = 20, BS = 16 };

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

/* kvi_store_put of a 1-token fact with an embedding, ns per put. */
static void bench_put(const kvi_model *model, const kvi_kv_view *kv) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.page_tokens = 1;
  so.budget_bytes = (uint64_t)(FACTS + 1) * 128 + (1u << 20);
  so.embedding_dim = 16;
  kvi_store *store;
  CK(kvi_store_create(&store, model, &so));
  static float e[16];
  for (int i = 0; i < 16; i++) e[i] = (float)(i + 1);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = e;
  po.embedding_dtype = KVI_DTYPE_FP32;
  po.embedding_memory = KVI_MEMORY_HOST;
  CK(kvi_store_put(store, 1, UINT64_MAX, kv, &po, NULL)); /* the tenant stays between rounds */
  float t[ROUNDS];
  for (int i = -WARM; i < ROUNDS; i++) {
    const double t0 = now_us();
    for (int32_t f = 0; f < FACTS; f++) CK(kvi_store_put(store, 1, (uint64_t)f, kv, &po, NULL));
    if (i >= 0) t[i] = (float)((now_us() - t0) * 1e3 / FACTS);
    for (int32_t f = 0; f < FACTS; f++) CK(kvi_store_remove(store, 1, (uint64_t)f));
  }
  printf("\nkvi_store_put, CPU backend, a 1-token fact as above with a 16-element fp32 embedding: %.1f ns per put\n",
         median(t, ROUNDS));
  kvi_store_destroy(store);
}

int main(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = 1, mo.num_kv_heads = 1, mo.head_size = 16;
  kvi_model *model;
  CK(kvi_model_create(&model, &mo));
  kvi_rope_spec rope = KVI_ROPE_SPEC_INIT;
  rope.style = KVI_ROPE_NONE; /* no rotation: the copies are a few bytes a token */
  CK(kvi_model_set_rope(model, -1, &rope));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.page_tokens = 1;
  so.budget_bytes = (uint64_t)FACTS * 128 + (1u << 20);
  kvi_store *store;
  CK(kvi_store_create(&store, model, &so));
  static uint16_t k[16], v[16];
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_BF16, 1, 1, 1, 16, k, v);
  for (int32_t f = 0; f < FACTS; f++) CK(kvi_store_put(store, 1, (uint64_t)f, &kv, NULL, NULL));
  /* the cache: R sequences of KMAX tokens, blocks of BS */
  const int32_t per = (KMAX + BS - 1) / BS, NB = R * per;
  uint16_t *cache = calloc((size_t)NB * BS * 16 * 2, sizeof *cache);
  void *layers[1] = {cache};
  kvi_cache_layout cl;
  CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASHINFER, KVI_DTYPE_BF16, 1, 1, 16, BS, NB, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_HOST;
  kvi_injector *inj;
  CK(kvi_injector_create(&inj, store, &cl, NULL));
  static int32_t table[R * 4], offs[R + 1], starts[R];
  static int64_t first[R];
  static uint64_t ids[R * KMAX];
  static kvi_inject_request reqs[R];
  for (int32_t b = 0; b < NB; b++) table[b] = (b * 37) % NB;
  printf("| k  | kvi_inject us/call | us/request | kvi_inject_batched us/call | us/request |\n");
  printf("|----|--------------------|------------|----------------------------|------------|\n");
  const int ks[] = {1, 5, 50};
  for (int c = 0; c < 3; c++) {
    const int kk = ks[c];
    float t[2][ROUNDS];
    for (int i = -WARM; i < ROUNDS; i++) {
      for (int r = 0; r < R; r++) {
        offs[r] = r * kk;
        starts[r] = 100 + r;
        first[r] = 0;
        for (int f = 0; f < kk; f++) ids[r * kk + f] = (uint64_t)((i + WARM) * 977 + r * 50 + f) % FACTS;
      }
      offs[R] = R * kk;
      for (int form = 0; form < 2; form++) {
        const double t0 = now_us();
        if (form == 0) {
          for (int r = 0; r < R; r++) { /* the structs are part of the per-request form's cost */
            kvi_inject_request_init(&reqs[r], sizeof reqs[r]);
            reqs[r].tenant = 1;
            reqs[r].fact_ids = ids + r * kk;
            reqs[r].num_facts = kk;
            reqs[r].block_table = table + r * per;
            reqs[r].block_table_len = per;
            reqs[r].first_slot = first[r];
            reqs[r].start_position = starts[r];
          }
          CK(kvi_inject(inj, reqs, R, NULL, NULL));
        } else {
          kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
          b.num_requests = R, b.tenant = 1, b.fact_ids = ids, b.fact_offsets = offs;
          b.block_tables = table, b.block_table_stride = per, b.block_table_len = per;
          b.first_slots = first, b.start_positions = starts;
          CK(kvi_inject_batched(inj, &b, NULL, NULL));
        }
        if (i >= 0) t[form][i] = (float)(now_us() - t0);
      }
    }
    const float a = median(t[0], ROUNDS), bt = median(t[1], ROUNDS);
    printf("| %2d | %18.1f | %10.3f | %26.1f | %10.3f |\n", kk, a, a / R, bt, bt / R);
  }
  printf("\n%d requests per call, CPU backend, tiny facts (1 token, 1 layer, 1 head of 16, no RoPE): the host work of a call.\n",
         R);
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);
  bench_put(model, &kv);
  kvi_model_destroy(model);
  free(cache);
  return 0;
}
