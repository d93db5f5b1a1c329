/*
 * libkvinject against real llama.cpp on Gemma 3 270M (iSWA: full-attention
 * and sliding-window layers in two KV caches), f16 KV, flash attention, CPU.
 * llama.cpp's sequence state holds two sections; each is parsed, laid out
 * for a model of its own layers, captured and injected back into a copy of
 * the state whose data was zeroed (keys as captured: bit copies). The
 * rebuilt state must equal llama.cpp's byte for byte and decode the next
 * tokens bit-identically; a model of the other section's layers is refused.
 * Exits 77 when KVI_GEMMA3_GGUF names no model.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>
#include <llama.h>

static int failures;
#define CHECK(cond, ...)                                                                                        \
  do {                                                                                                          \
    if (!(cond)) {                                                                                              \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                           \
      fprintf(stderr, __VA_ARGS__);                                                                             \
      fprintf(stderr, " (%s)\n", kvi_last_error());                                                             \
      failures++;                                                                                               \
    }                                                                                                           \
  } while (0)
#define OK(call)                                                                                                \
  do {                                                                                                          \
    kvi_status st_ = (call);                                                                                    \
    if (st_) {                                                                                                  \
      fprintf(stderr, "FATAL %s:%d: %s: %s\n", __FILE__, __LINE__, #call, kvi_last_error());                    \
      exit(1);                                                                                                  \
    }                                                                                                           \
  } while (0)

static void quiet(enum ggml_log_level level, const char *text, void *user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static struct llama_context *ctx;
static int32_t n_vocab;

static void decode(const llama_token *t, int32_t n, int32_t pos0, float *logits) {
  struct llama_batch b = llama_batch_init(n, 0, 1);
  for (int32_t i = 0; i < n; i++) {
    b.token[i] = t[i];
    b.pos[i] = pos0 + i;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = 0;
    b.logits[i] = i == n - 1;
  }
  b.n_tokens = n;
  if (llama_decode(ctx, b)) {
    fprintf(stderr, "FATAL: llama_decode failed\n");
    exit(1);
  }
  if (logits) memcpy(logits, llama_get_logits_ith(ctx, n - 1), (size_t)n_vocab * sizeof *logits);
  llama_batch_free(b);
}

static kvi_model *section_model(const kvi_llama_section *s, int32_t heads) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = s->num_layers;
  mo.num_kv_heads = heads;
  mo.head_size = s->k_row_elements / heads;
  kvi_model *m;
  OK(kvi_model_create(&m, &mo));
  kvi_rope_spec none = KVI_ROPE_SPEC_INIT;
  none.style = KVI_ROPE_NONE; /* keys moved as they are: position 0 both ways */
  OK(kvi_model_set_rope(m, -1, &none));
  return m;
}

int main(void) {
  const char *path = getenv("KVI_GEMMA3_GGUF");
  FILE *f = path && *path ? fopen(path, "rb") : NULL;
  if (!f) {
    printf("SKIP: KVI_GEMMA3_GGUF does not name a readable GGUF (.ci/install-llama prints it)\n");
    return 77;
  }
  fclose(f);
  llama_log_set(quiet, NULL);
  llama_backend_init();
  struct llama_model *model = llama_model_load_from_file(path, llama_model_default_params());
  if (!model) return fprintf(stderr, "FATAL: cannot load %s\n", path), 1;
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 1024;
  cp.n_batch = cp.n_ubatch = 512;
  cp.n_threads = cp.n_threads_batch = 2;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  cp.type_k = cp.type_v = GGML_TYPE_F16;
  cp.no_perf = true;
  ctx = llama_init_from_model(model, cp);
  if (!ctx) return fprintf(stderr, "FATAL: no context\n"), 1;
  const struct llama_vocab *vocab = llama_model_get_vocab(model);
  n_vocab = llama_vocab_n_tokens(vocab);
  const int32_t heads = llama_model_n_head_kv(model);

  const char *text = "The user's sister Ana moved to Porto last spring, and the user adopted a grey cat named Miso.";
  const char *question = " The cat is called";
  llama_token toks[256], q[32];
  const int32_t n = llama_tokenize(vocab, text, (int32_t)strlen(text), toks, 256, true, false);
  const int32_t nq = llama_tokenize(vocab, question, (int32_t)strlen(question), q, 32, false, false);
  float *ref = malloc((size_t)n_vocab * sizeof *ref), *got = malloc((size_t)n_vocab * sizeof *got);
  decode(toks, n, 0, NULL);
  const size_t size = llama_state_seq_get_size(ctx, 0);
  uint8_t *st = malloc(size), *re = malloc(size);
  CHECK(llama_state_seq_get_data(ctx, st, size, 0) == size, "get_data");
  decode(q, nq, n, ref);

  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  OK(kvi_llama_state_parse(st, size, &info));
  printf("Gemma 3 270M: %d layers, %d KV heads; state of %zu bytes, %d sections:", llama_model_n_layer(model), heads,
         size, info.num_sections);
  for (int s = 0; s < info.num_sections; s++)
    printf(" [%d layers, %d cells, %d per row, %s]", info.sections[s].num_layers, info.sections[s].num_cells,
           info.sections[s].k_row_elements, info.sections[s].v_trans ? "V transposed" : "V per cell");
  printf("\n");
  CHECK(info.num_sections == 2, "%d sections, expected 2 (iSWA)", info.num_sections);
  CHECK(info.num_sections < 2 ||
            info.sections[0].num_layers + info.sections[1].num_layers == llama_model_n_layer(model),
        "section layers do not add up to the model's");

  /* the rebuilt state: llama.cpp's metadata, data zeroed, then refilled by
   * injection section by section */
  memcpy(re, st, size);
  for (int s = 0; s < info.num_sections; s++) {
    const kvi_llama_section *sec = &info.sections[s];
    const size_t first = sec->k_offset - 12, last = sec->end_offset;
    /* zero every layer's data, keep the 12-byte layer headers */
    for (size_t o = first; o < last;) {
      memset(re + o + 12, 0, (size_t)sec->layer_bytes - 12);
      o += (size_t)sec->layer_bytes;
    }
  }
  CHECK(info.num_sections < 1 || memcmp(re, st, size) != 0, "zeroing changed nothing");
  for (int s = 0; s < info.num_sections; s++) {
    const kvi_llama_section *sec = &info.sections[s];
    kvi_model *m = section_model(sec, heads);
    kvi_store_options so = KVI_STORE_OPTIONS_INIT;
    so.backend = KVI_BACKEND_CPU;
    so.dtype = sec->dtype;
    so.budget_bytes = 64u << 20;
    kvi_store *store;
    OK(kvi_store_create(&store, m, &so));
    kvi_cache_layout from, to;
    OK(kvi_llama_state_layout(st, size, s, m, KVI_MEMORY_HOST, &from));
    OK(kvi_llama_state_layout(re, size, s, m, KVI_MEMORY_HOST, &to));
    kvi_encoder *enc;
    kvi_injector *inj;
    OK(kvi_encoder_create(&enc, store, &from, NULL));
    OK(kvi_injector_create(&inj, store, &to, NULL));
    const int32_t table[1] = {0};
    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = 1;
    c.fact_id = (uint64_t)s;
    c.block_table = table;
    c.block_table_len = 1;
    c.num_tokens = sec->num_cells;
    OK(kvi_encode(enc, &c, 1, NULL));
    const uint64_t id = (uint64_t)s;
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = 1;
    rq.fact_ids = &id;
    rq.num_facts = 1;
    rq.block_table = table;
    rq.block_table_len = 1;
    OK(kvi_inject(inj, &rq, 1, NULL, NULL));
    kvi_injector_destroy(inj);
    kvi_encoder_destroy(enc);
    kvi_store_destroy(store);
    /* the other section's model does not fit this section */
    const kvi_llama_section *other = &info.sections[1 - s];
    if (info.num_sections == 2 && other->num_layers != sec->num_layers) {
      kvi_model *wrong = section_model(other, heads);
      kvi_cache_layout cl;
      const kvi_status ws = kvi_llama_state_layout(st, size, s, wrong, KVI_MEMORY_HOST, &cl);
      CHECK(ws == KVI_ERR_MISMATCH, "section %d with a model of %d layers: status %d", s, other->num_layers, (int)ws);
      if (ws == KVI_ERR_MISMATCH) printf("section %d, the other section's model: %s\n", s, kvi_last_error());
      kvi_model_destroy(wrong);
    }
    kvi_model_destroy(m);
  }
  const int same_bytes = memcmp(re, st, size) == 0;
  llama_memory_clear(llama_get_memory(ctx), true);
  CHECK(llama_state_seq_set_data(ctx, re, size, 0) == size, "llama.cpp refused the rebuilt state");
  decode(q, nq, n, got);
  const int same = memcmp(ref, got, (size_t)n_vocab * sizeof *ref) == 0;
  printf("iSWA state rebuilt by capture and injection per section: %s; logits %s\n",
         same_bytes ? "byte-identical to llama.cpp's" : "DIFFERENT", same ? "bit-identical" : "DIFFERENT");
  CHECK(same_bytes && same, "the rebuilt state or its logits differ");
  free(st);
  free(re);
  free(ref);
  free(got);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  if (failures) return fprintf(stderr, "%d checks failed\n", failures), 1;
  printf("all checks passed\n");
  return 0;
}
