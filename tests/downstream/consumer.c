/*
 * A downstream C program, built against the installed libkvinject with
 * nothing but `pkg-config --cflags --libs kvinject` (see check-install.sh).
 * It stores a fact in a CPU store, reads it back and compares.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <kvinject.h>

#include <stdio.h>
#include <string.h>

#ifndef EXPECTED_VERSION
#error "build with -DEXPECTED_VERSION=\"<pkg-config --modversion kvinject>\""
#endif

#define CHECK(call)                                                                              \
  do {                                                                                           \
    kvi_status st_ = (call);                                                                     \
    if (st_ != KVI_OK) {                                                                         \
      fprintf(stderr, "consumer.c:%d: %s: %s: %s\n", __LINE__, #call, kvi_status_string(st_), \
              kvi_last_error());                                                                 \
      return 1;                                                                                  \
    }                                                                                            \
  } while (0)

enum { LAYERS = 3, HEADS = 2, DIM = 4, TOKENS = 5, N = LAYERS * TOKENS * HEADS * DIM };

int main(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  kvi_kv_view src, dst;
  kvi_model *model = NULL;
  kvi_store *store = NULL;
  static float k[N], v[N], k2[N], v2[N];
  int32_t tokens = 0;
  size_t count = 0;
  int i;

  if (strcmp(kvi_version_string(), EXPECTED_VERSION) != 0 || strcmp(KVI_VERSION_STRING, EXPECTED_VERSION) != 0) {
    fprintf(stderr, "version: library %s, header %s, pkg-config %s\n", kvi_version_string(), KVI_VERSION_STRING,
            EXPECTED_VERSION);
    return 1;
  }

  mo.num_layers = LAYERS;
  mo.num_kv_heads = HEADS;
  mo.head_size = DIM;
  CHECK(kvi_model_create(&model, &mo));
  so.backend = KVI_BACKEND_CPU;
  so.dtype = KVI_DTYPE_FP32;
  so.budget_bytes = 1u << 16;
  CHECK(kvi_store_create(&store, model, &so));
  kvi_model_destroy(model);

  for (i = 0; i < N; i++) {
    k[i] = (float)i / 8.0f;
    v[i] = -(float)i;
  }
  kvi_kv_view_contiguous(&src, KVI_MEMORY_HOST, KVI_DTYPE_FP32, LAYERS, TOKENS, HEADS, DIM, k, v);
  kvi_kv_view_contiguous(&dst, KVI_MEMORY_HOST, KVI_DTYPE_FP32, LAYERS, TOKENS, HEADS, DIM, k2, v2);
  CHECK(kvi_store_put(store, 1, 1001, &src, NULL, NULL));
  CHECK(kvi_store_fact_tokens(store, 1, 1001, &tokens));
  CHECK(kvi_store_count(store, 1, &count));
  CHECK(kvi_store_read(store, 1, 1001, &dst, NULL));
  if (tokens != TOKENS || count != 1 || memcmp(k, k2, sizeof k) != 0 || memcmp(v, v2, sizeof v) != 0) {
    fprintf(stderr, "consumer.c: the fact read back differs (tokens %d, count %zu)\n", (int)tokens, count);
    return 1;
  }
  kvi_store_destroy(store);
  printf("C consumer: libkvinject %s (features 0x%x): put and read back %d tokens\n", kvi_version_string(),
         kvi_features(), (int)tokens);
  return 0;
}
