/*
 * The llama suite's harness: a llama.cpp context on the model named by
 * KVI_SMOLLM2_GGUF, token decoding, sequence states in and out, and the
 * libkvinject model, store and state layouts that match it.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_LLAMA_HARNESS_H
#define KVI_LLAMA_HARNESS_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>
#include <llama.h>

static int h_failures;

#define CHECK(cond, ...)                                                                   \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                      \
      fprintf(stderr, __VA_ARGS__);                                                        \
      fprintf(stderr, "\n");                                                               \
      h_failures++;                                                                        \
    }                                                                                      \
  } while (0)

#define KVI_OK_OR_DIE(call)                                                                \
  do {                                                                                     \
    kvi_status st_ = (call);                                                               \
    if (st_ != KVI_OK) {                                                                   \
      fprintf(stderr, "FATAL %s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #call, (int)st_,  \
              kvi_last_error());                                                           \
      exit(1);                                                                             \
    }                                                                                      \
  } while (0)

static void h_quiet_log(enum ggml_log_level level, const char *text, void *user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

typedef struct h_engine {
  struct llama_model *model;
  struct llama_context *ctx;
  const struct llama_vocab *vocab;
  int32_t n_vocab, n_layer, n_head_kv, head_size, n_rot;
  float freq_base;
  enum llama_rope_type rope_type;
} h_engine;

/* The model from KVI_SMOLLM2_GGUF; exits 77 (skip) when it is not there. */
static struct llama_model *h_load_model(void) {
  const char *path = getenv("KVI_SMOLLM2_GGUF");
  FILE *f = path && *path ? fopen(path, "rb") : NULL;
  if (!f) {
    printf("SKIP: KVI_SMOLLM2_GGUF does not name a readable GGUF (.ci/install-llama prints it)\n");
    exit(77);
  }
  fclose(f);
  llama_log_set(h_quiet_log, NULL);
  llama_backend_init();
  struct llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  struct llama_model *m = llama_model_load_from_file(path, mp);
  if (!m) {
    fprintf(stderr, "FATAL: llama.cpp cannot load %s\n", path);
    exit(1);
  }
  return m;
}

static int32_t h_meta_int(const struct llama_model *m, const char *key, int32_t dflt) {
  char buf[64];
  return llama_model_meta_val_str(m, key, buf, sizeof buf) > 0 ? (int32_t)atol(buf) : dflt;
}

/* A context: flash attention on (v_trans 0) or off (v_trans 1), f16 KV, one
 * unified stream, two sequences. */
static void h_open(h_engine *e, struct llama_model *m, int flash, enum ggml_type kv_type) {
  memset(e, 0, sizeof *e);
  e->model = m;
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 1024;
  cp.n_batch = 512;
  cp.n_ubatch = 512;
  cp.n_seq_max = 2;
  cp.n_threads = cp.n_threads_batch = 2;
  cp.flash_attn_type = flash ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  cp.type_k = cp.type_v = kv_type;
  cp.kv_unified = true;
  cp.no_perf = true;
  e->ctx = llama_init_from_model(m, cp);
  if (!e->ctx) {
    fprintf(stderr, "FATAL: llama_init_from_model failed\n");
    exit(1);
  }
  e->vocab = llama_model_get_vocab(m);
  e->n_vocab = llama_vocab_n_tokens(e->vocab);
  e->n_layer = llama_model_n_layer(m);
  e->n_head_kv = llama_model_n_head_kv(m);
  e->head_size = llama_model_n_embd(m) / llama_model_n_head(m);
  e->n_rot = h_meta_int(m, "llama.rope.dimension_count", e->head_size);
  char buf[64];
  e->freq_base = llama_model_meta_val_str(m, "llama.rope.freq_base", buf, sizeof buf) > 0 ? (float)atof(buf) : 10000.0f;
  e->rope_type = llama_model_rope_type(m);
}

static void h_close(h_engine *e) {
  llama_free(e->ctx);
  e->ctx = NULL;
}

static int32_t h_tokenize(const h_engine *e, const char *text, llama_token *out, int32_t cap) {
  int32_t n = llama_tokenize(e->vocab, text, (int32_t)strlen(text), out, cap, false, false);
  if (n < 0) {
    fprintf(stderr, "FATAL: %d tokens do not fit in %d\n", -n, cap);
    exit(1);
  }
  return n;
}

/* Decodes tokens at positions pos0.. of seq `seq`; logits of the last token
 * into logits (n_vocab floats) when not NULL. */
static void h_decode(h_engine *e, const llama_token *toks, int32_t n, int32_t pos0, int32_t seq, float *logits) {
  struct llama_batch b = llama_batch_init(n, 0, 1);
  for (int32_t i = 0; i < n; i++) {
    b.token[i] = toks[i];
    b.pos[i] = pos0 + i;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = i == n - 1;
  }
  b.n_tokens = n;
  if (llama_decode(e->ctx, b) != 0) {
    fprintf(stderr, "FATAL: llama_decode failed\n");
    exit(1);
  }
  if (logits) memcpy(logits, llama_get_logits_ith(e->ctx, n - 1), (size_t)e->n_vocab * sizeof(float));
  llama_batch_free(b);
}

/* seq's state, malloc'd; *size its bytes. */
static uint8_t *h_get_state(h_engine *e, int32_t seq, size_t *size) {
  size_t n = llama_state_seq_get_size(e->ctx, seq);
  uint8_t *p = malloc(n);
  size_t got = llama_state_seq_get_data(e->ctx, p, n, seq);
  if (!p || got != n) {
    fprintf(stderr, "FATAL: llama_state_seq_get_data gave %zu of %zu bytes\n", got, n);
    exit(1);
  }
  *size = n;
  return p;
}

/* Clears the context and sets seq 0 from state; returns what set_data read. */
static size_t h_set_state(h_engine *e, const uint8_t *state, size_t size) {
  llama_memory_clear(llama_get_memory(e->ctx), true);
  return llama_state_seq_set_data(e->ctx, state, size, 0);
}

/* The libkvinject model of the engine: its geometry and RoPE (llama.cpp's
 * own cos/sin values from kvi_llama_rope_table, with its pair order). */
static kvi_model *h_kvi_model(const h_engine *e, int32_t positions) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = e->n_layer;
  mo.num_kv_heads = e->n_head_kv;
  mo.head_size = e->head_size;
  kvi_model *m;
  KVI_OK_OR_DIE(kvi_model_create(&m, &mo));
  float *table = malloc((size_t)positions * (size_t)e->n_rot * sizeof(float));
  KVI_OK_OR_DIE(kvi_llama_rope_table(table, positions, e->n_rot, e->freq_base, 1.0f));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = e->rope_type == LLAMA_ROPE_TYPE_NEOX ? KVI_ROPE_NEOX : KVI_ROPE_GPTJ;
  rs.rotary_dim = e->n_rot;
  rs.cos_sin_table = table;
  rs.table_positions = positions;
  KVI_OK_OR_DIE(kvi_model_set_rope(m, -1, &rs));
  free(table);
  return m;
}

static kvi_store *h_store(const kvi_model *m, kvi_dtype dtype) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = dtype;
  so.budget_bytes = 64ull << 20;
  kvi_store *s;
  KVI_OK_OR_DIE(kvi_store_create(&s, m, &so));
  return s;
}

/* Captures cells [first, first + n) of a state as (tenant, id). positions
 * NULL: the cells' own positions (keys stored pre-RoPE); else as given. */
static void h_capture(kvi_store *s, uint8_t *state, size_t size, const kvi_model *m, uint64_t tenant, uint64_t id,
                      int32_t first, int32_t n, const int32_t *positions) {
  kvi_cache_layout cl;
  KVI_OK_OR_DIE(kvi_llama_state_layout(state, size, 0, m, KVI_MEMORY_HOST, &cl));
  kvi_encoder *enc;
  KVI_OK_OR_DIE(kvi_encoder_create(&enc, s, &cl, NULL));
  int32_t *pos = malloc((size_t)n * sizeof *pos);
  if (positions)
    memcpy(pos, positions, (size_t)n * sizeof *pos);
  else
    KVI_OK_OR_DIE(kvi_llama_state_positions(state, size, 0, first, n, pos));
  const int32_t table[1] = {0};
  kvi_capture c = KVI_CAPTURE_INIT;
  c.tenant = tenant;
  c.fact_id = id;
  c.block_table = table;
  c.block_table_len = 1;
  c.first_slot = first;
  c.num_tokens = n;
  c.positions = pos;
  KVI_OK_OR_DIE(kvi_encode(enc, &c, 1, NULL));
  kvi_encoder_destroy(enc);
  free(pos);
}

/* A fresh state of n cells at positions 0..n-1 for seq 0; *size. */
static uint8_t *h_fresh_state_v(const kvi_model *m, int32_t n, kvi_dtype dtype, int v_trans, size_t *size) {
  kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
  sp.num_cells = n;
  sp.dtype = dtype;
  sp.v_trans = v_trans;
  KVI_OK_OR_DIE(kvi_llama_state_size(m, &sp, size));
  uint8_t *p = calloc(1, *size);
  KVI_OK_OR_DIE(kvi_llama_state_write_header(p, *size, m, &sp));
  return p;
}

static uint8_t *h_fresh_state(const kvi_model *m, int32_t n, kvi_dtype dtype, size_t *size) {
  return h_fresh_state_v(m, n, dtype, 0, size);
}

/* Injects facts ids[0..k) of tenant consecutively from cell first_cell;
 * positions NULL: start_position + i; returns the status. */
static kvi_status h_inject(kvi_store *s, uint8_t *state, size_t size, const kvi_model *m, uint64_t tenant,
                           const uint64_t *ids, int32_t k, int32_t first_cell, const int32_t *positions,
                           int32_t start_position) {
  kvi_cache_layout cl;
  KVI_OK_OR_DIE(kvi_llama_state_layout(state, size, 0, m, KVI_MEMORY_HOST, &cl));
  kvi_injector *inj;
  KVI_OK_OR_DIE(kvi_injector_create(&inj, s, &cl, NULL));
  const int32_t table[1] = {0};
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = tenant;
  rq.fact_ids = ids;
  rq.num_facts = k;
  rq.block_table = table;
  rq.block_table_len = 1;
  rq.first_slot = first_cell;
  rq.positions = positions;
  rq.start_position = start_position;
  kvi_status st = kvi_inject(inj, &rq, 1, NULL, NULL);
  kvi_injector_destroy(inj);
  return st;
}

static double h_max_diff(const float *a, const float *b, int32_t n) {
  double m = 0;
  for (int32_t i = 0; i < n; i++) {
    double d = fabs((double)a[i] - (double)b[i]);
    if (d > m || d != d) m = d != d ? INFINITY : d;
  }
  return m;
}

static int32_t h_argmax(const float *a, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; i++)
    if (a[i] > a[best]) best = i;
  return best;
}

#endif /* KVI_LLAMA_HARNESS_H */
