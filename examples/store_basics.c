/*
 * store_basics — the first program to read: a model, a fact store, facts in
 * and out, and the store's numbers.
 *
 * An engine would put each fact's pre-RoPE K and V straight from its prefill
 * buffers; here the "prefill" is random numbers standing in for them. The
 * store takes the GPU when one answers and the CPU otherwise: the same binary
 * runs on both.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include <kvinject.h>

#define CHECK(call)                                                                      \
  do {                                                                                   \
    kvi_status st_ = (call);                                                             \
    if (st_ != KVI_OK) {                                                                 \
      fprintf(stderr, "%s failed: %s: %s\n", #call, kvi_status_string(st_), kvi_last_error()); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

/* A small Llama-like geometry: 4 layers, 8 KV heads of 64, one GPU. */
enum { LAYERS = 4, KV_HEADS = 8, HEAD = 64, EMB = 32 };

static float frand(unsigned *s) {
  *s = *s * 1664525u + 1013904223u;
  return (float)(*s >> 8) / (float)(1u << 24) - 0.5f;
}

int main(void) {
  printf("libkvinject %s (features:%s%s%s)\n", kvi_version_string(),
         kvi_features() & KVI_FEATURE_CUDA ? " cuda" : "", kvi_features() & KVI_FEATURE_CUBLASLT ? " cublaslt" : "",
         kvi_features() & KVI_FEATURE_NCCL ? " nccl" : "");

  /* 1. The model: geometry and RoPE, shared by every handle made from it. */
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = LAYERS;
  mo.num_kv_heads = KV_HEADS;
  mo.head_size = HEAD;
  kvi_model *model;
  CHECK(kvi_model_create(&model, &mo));
  kvi_rope_spec rope = KVI_ROPE_SPEC_INIT; /* NeoX pairing, theta 10000 */
  rope.theta = 500000.0;
  CHECK(kvi_model_set_rope(model, -1, &rope));

  /* 2. The store: 64 MiB reserved once, bf16, pages of 16 tokens, with embeddings. */
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.budget_bytes = 64u << 20;
  so.embedding_dim = EMB;
  kvi_store *store;
  CHECK(kvi_store_create(&store, model, &so));
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK(kvi_store_stats_get(store, &st));
  printf("store on %s: %llu pages of %d tokens (%llu bytes each), %.1f MiB reserved\n",
         st.backend == KVI_BACKEND_CUDA ? "CUDA" : "CPU", (unsigned long long)st.pages_total, st.page_tokens,
         (unsigned long long)st.page_bytes, st.bytes_reserved / 1048576.0);

  /* 3. Put three facts for user 7 and one for user 8, from fp32 host buffers
   *    laid out [layer][token][head][dim]; the store converts them to bf16. */
  const int tokens[] = {24, 9, 40, 17};
  const uint64_t tenant[] = {7, 7, 7, 8};
  unsigned seed = 1;
  float *keep_k = NULL, *keep_v = NULL;
  for (int f = 0; f < 4; f++) {
    size_t n = (size_t)LAYERS * tokens[f] * KV_HEADS * HEAD;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v), emb[EMB];
    for (size_t i = 0; i < n; i++) {
      k[i] = frand(&seed);
      v[i] = frand(&seed);
    }
    for (int i = 0; i < EMB; i++) emb[i] = frand(&seed);
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, LAYERS, tokens[f], KV_HEADS, HEAD, k, v);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = emb;
    CHECK(kvi_store_put(store, tenant[f], 100 + (uint64_t)f, &kv, &po, NULL));
    if (f == 0) {
      keep_k = k;
      keep_v = v;
    } else {
      free(k);
      free(v);
    }
  }

  /* 4. Read fact 100 back in fp32 and compare with what went in (bf16 storage:
   *    relative error under 2^-8). */
  size_t n = (size_t)LAYERS * tokens[0] * KV_HEADS * HEAD;
  float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
  kvi_kv_view out;
  kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, LAYERS, tokens[0], KV_HEADS, HEAD, k, v);
  CHECK(kvi_store_read(store, 7, 100, &out, NULL));
  double worst = 0.0;
  for (size_t i = 0; i < n; i++) {
    double ek = fabs(k[i] - keep_k[i]) / fmax(fabs(keep_k[i]), 1e-30);
    double ev = fabs(v[i] - keep_v[i]) / fmax(fabs(keep_v[i]), 1e-30);
    worst = fmax(worst, fmax(ek, ev));
  }
  printf("fact 100 read back: %d tokens, max relative error %.2e (bf16 bound %.2e)\n", tokens[0], worst,
         1.0 / 256);

  /* 5. Tenants are namespaces: list user 7's facts; user 8 sees only its own. */
  uint64_t ids[8];
  size_t total;
  CHECK(kvi_store_list(store, 7, ids, 8, &total));
  printf("tenant 7 has %zu facts:", total);
  for (size_t i = 0; i < total; i++) {
    int32_t t;
    CHECK(kvi_store_fact_tokens(store, 7, ids[i], &t));
    printf(" %llu (%d tokens)", (unsigned long long)ids[i], t);
  }
  printf("\n");
  int32_t t;
  kvi_status s = kvi_store_fact_tokens(store, 8, 100, &t);
  printf("tenant 8 asking for fact 100: %s\n", kvi_status_string(s));

  /* 6. Remove one fact: its pages go back to the pool. */
  CHECK(kvi_store_remove(store, 7, 101));
  CHECK(kvi_store_stats_get(store, &st));
  printf("stats: %llu facts, %llu tenants, %llu/%llu pages used, %llu payload bytes in %llu used bytes\n",
         (unsigned long long)st.facts, (unsigned long long)st.tenants, (unsigned long long)st.pages_used,
         (unsigned long long)st.pages_total, (unsigned long long)st.bytes_payload, (unsigned long long)st.bytes_used);

  free(k);
  free(v);
  free(keep_k);
  free(keep_v);
  kvi_store_destroy(store);
  kvi_model_destroy(model);
  return worst <= 1.0 / 256 ? 0 : 1;
}
