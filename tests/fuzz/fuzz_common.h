/*
 * The model and store options the loader's fuzz target and its seed
 * generator share: a file made by one must be compatible with the other.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_FUZZ_COMMON_H
#define KVI_FUZZ_COMMON_H

#include <stdio.h>
#include <stdlib.h>

#include <kvinject.h>

enum { FZ_LAYERS = 2, FZ_KV_HEADS = 2, FZ_HEAD = 4, FZ_PAGE = 4, FZ_EMB = 3 };

/* 2 layers, 2 KV heads of 4: NeoX with YaRN on layer 0, NoPE on layer 1. */
static kvi_model *fz_model(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = FZ_LAYERS;
  mo.num_kv_heads = FZ_KV_HEADS;
  mo.head_size = FZ_HEAD;
  kvi_model *m = NULL;
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.scaling = KVI_ROPE_SCALING_YARN;
  r.factor = 4.0;
  if (kvi_model_create(&m, &mo) != KVI_OK || kvi_model_set_rope(m, 0, &r) != KVI_OK) {
    fprintf(stderr, "fz_model: %s\n", kvi_last_error());
    abort();
  }
  return m;
}

/* A CPU bf16 store of 64 KiB (256 pages of 4 tokens), 3-element embeddings. */
static kvi_store_options fz_store_options(void) {
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  o.backend = KVI_BACKEND_CPU;
  o.dtype = KVI_DTYPE_BF16;
  o.page_tokens = FZ_PAGE;
  o.budget_bytes = 64u * 1024u;
  o.embedding_dim = FZ_EMB;
  return o;
}

#endif /* KVI_FUZZ_COMMON_H */
