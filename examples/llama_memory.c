/*
 * llama_memory — long-term memory for a llama.cpp assistant with libkvinject.
 *
 * A conversation goes turn by turn. After each turn the program prefills the
 * turn behind a window of what preceded it and captures the turn's KV cells
 * from llama.cpp's sequence state as a fact (Context-Window Encoding: keys
 * un-rotated at the positions they had), with an embedding of its words.
 * Then each question retrieves the best facts (kvi_store_search), injects
 * them behind the system header into a fresh sequence state (keys rotated at
 * their new positions), hands it to llama.cpp (llama_state_seq_set_data) and
 * decodes only the question; the same question is also answered by
 * re-prefilling [header | the same facts' text | question]. Both answers are
 * printed side by side with their times to first token and the distance of
 * their first-token distributions.
 *
 *   llama_memory [model.gguf]   (default: $KVI_SMOLLM2_GGUF)
 *
 * llama.cpp runs on the CPU with flash attention (V rows not transposed) and
 * an f16 KV cache; the fact store is a CPU store. Exits 1 on any error.
 * SPDX-License-Identifier: Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <kvinject.h>
#include <llama.h>

#define EMB 256       /* embedding: hashed bag of words */
#define WINDOW 24     /* context-window tokens before a turn */
#define TOP_K 2       /* facts per question */
#define GEN 12        /* tokens generated per answer */
#define MAX_TOK 512

static const char *header = "<|im_start|>system\nYou are a helpful assistant with a memory of earlier "
                            "conversations with the user.<|im_end|>\n";
static const char *turns[] = {
    "<|im_start|>user\nMy sister Ana moved to Porto last spring.<|im_end|>\n",
    "<|im_start|>user\nI adopted a grey cat and named her Miso.<|im_end|>\n",
    "<|im_start|>user\nI work night shifts as a nurse at the city hospital.<|im_end|>\n",
    "<|im_start|>user\nMy favourite food is mushroom risotto.<|im_end|>\n",
    "<|im_start|>user\nI am learning to play the cello on weekends.<|im_end|>\n",
    "<|im_start|>user\nMy car is a red Fiat from 2009.<|im_end|>\n",
};
#define NT ((int)(sizeof turns / sizeof turns[0]))
static const char *questions[] = {
    "<|im_start|>user\nWhat is my cat called?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhere does my sister live?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat instrument am I learning?<|im_end|>\n<|im_start|>assistant\n",
};
#define NQ ((int)(sizeof questions / sizeof questions[0]))

static void die_kvi(kvi_status st, const char *what) {
  if (st == KVI_OK) return;
  fprintf(stderr, "llama_memory: %s: %s (%s)\n", what, kvi_status_string(st), kvi_last_error());
  exit(1);
}

static void die(const char *what) {
  fprintf(stderr, "llama_memory: %s\n", what);
  exit(1);
}

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

typedef struct engine {
  struct llama_model *model;
  struct llama_context *ctx;
  const struct llama_vocab *vocab;
  int32_t n_vocab;
} engine;

static int32_t tokenize(const engine *e, const char *text, llama_token *out, int32_t cap) {
  int32_t n = llama_tokenize(e->vocab, text, (int32_t)strlen(text), out, cap, false, true);
  if (n < 0) die("text too long");
  return n;
}

/* Decodes toks at pos0.. in seq 0; the last token's logits. */
static const float *decode(engine *e, const llama_token *toks, int32_t n, int32_t pos0) {
  struct llama_batch b = llama_batch_init(n, 0, 1);
  for (int32_t i = 0; i < n; i++) {
    b.token[i] = toks[i];
    b.pos[i] = pos0 + i;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = 0;
    b.logits[i] = i == n - 1;
  }
  b.n_tokens = n;
  if (llama_decode(e->ctx, b) != 0) die("llama_decode failed");
  llama_batch_free(b);
  return llama_get_logits_ith(e->ctx, n - 1);
}

static int32_t argmax(const float *x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; i++)
    if (x[i] > x[best]) best = i;
  return best;
}

/* Greedy continuation from first logits at position pos: text into out. */
static void generate(engine *e, const float *logits, int32_t pos, char *out, size_t cap) {
  size_t len = 0;
  out[0] = 0;
  for (int i = 0; i < GEN; i++) {
    llama_token t = argmax(logits, e->n_vocab);
    if (llama_vocab_is_eog(e->vocab, t)) break;
    char piece[64];
    int n = llama_token_to_piece(e->vocab, t, piece, sizeof piece, 0, false);
    for (int j = 0; j < n && len + 1 < cap; j++) out[len++] = piece[j] == '\n' ? ' ' : piece[j];
    out[len] = 0;
    logits = decode(e, &t, 1, pos++);
  }
}

/* KL(p || q) of two logit vectors, nats. */
static double kl(const float *p, const float *q, int32_t n) {
  double mp = p[argmax(p, n)], mq = q[argmax(q, n)], zp = 0, zq = 0, k = 0;
  for (int32_t i = 0; i < n; i++) zp += exp(p[i] - mp), zq += exp(q[i] - mq);
  for (int32_t i = 0; i < n; i++) {
    const double lp = p[i] - mp - log(zp), lq = q[i] - mq - log(zq);
    k += exp(lp) * (lp - lq);
  }
  return k;
}

/* A simple embedding: lowercase words hashed into EMB buckets (the store
 * normalizes for cosine). Chat-template tokens and short words are skipped. */
static void embed(const char *text, float *v) {
  memset(v, 0, EMB * sizeof *v);
  static const char *skip[] = {"im_start", "im_end", "user", "assistant", "system", "what", "where", "does", "the", "and", "my", "is", "am", "a", "i", "to", "at", "as", "from", "her", NULL};
  char w[32];
  size_t n = 0;
  for (const char *c = text;; c++) {
    if (isalnum((unsigned char)*c) || *c == '_') {
      if (n + 1 < sizeof w) w[n++] = (char)tolower((unsigned char)*c);
      continue;
    }
    w[n] = 0;
    int skipped = n < 3;
    for (int i = 0; skip[i] && !skipped; i++) skipped = strcmp(w, skip[i]) == 0;
    if (!skipped) {
      uint32_t h = 2166136261u;
      for (size_t i = 0; i < n && i < 5; i++) h = (h ^ (uint8_t)w[i]) * 16777619u; /* a 5-letter stem */
      v[h % EMB] += 1.0f;
    }
    n = 0;
    if (!*c) break;
  }
}

int main(int argc, char **argv) {
  const char *path = argc > 1 ? argv[1] : getenv("KVI_SMOLLM2_GGUF");
  if (!path || !*path) die("usage: llama_memory model.gguf (or set KVI_SMOLLM2_GGUF)");
  llama_log_set(quiet, NULL);
  llama_backend_init();
  engine e = {0};
  struct llama_model_params mp = llama_model_default_params();
  e.model = llama_model_load_from_file(path, mp);
  if (!e.model) die("cannot load the model");
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 1024;
  cp.n_batch = cp.n_ubatch = 512;
  cp.n_threads = cp.n_threads_batch = 2;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED; /* V rows per cell in the state */
  cp.type_k = cp.type_v = GGML_TYPE_F16;
  cp.no_perf = true;
  e.ctx = llama_init_from_model(e.model, cp);
  if (!e.ctx) die("cannot create a context");
  e.vocab = llama_model_get_vocab(e.model);
  e.n_vocab = llama_vocab_n_tokens(e.vocab);

  /* The model as libkvinject sees it: geometry, and RoPE as llama.cpp applies
   * it (NORM: adjacent pairs; its own cos/sin values). */
  char meta[64];
  const int32_t n_layer = llama_model_n_layer(e.model), n_kv = llama_model_n_head_kv(e.model);
  const int32_t head = llama_model_n_embd(e.model) / llama_model_n_head(e.model);
  const int32_t n_rot =
      llama_model_meta_val_str(e.model, "llama.rope.dimension_count", meta, sizeof meta) > 0 ? atoi(meta) : head;
  const float base =
      llama_model_meta_val_str(e.model, "llama.rope.freq_base", meta, sizeof meta) > 0 ? (float)atof(meta) : 1e4f;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = n_layer;
  mo.num_kv_heads = n_kv;
  mo.head_size = head;
  kvi_model *km;
  die_kvi(kvi_model_create(&km, &mo), "kvi_model_create");
  float *table = malloc((size_t)cp.n_ctx * (size_t)n_rot * sizeof *table);
  die_kvi(kvi_llama_rope_table(table, (int32_t)cp.n_ctx, n_rot, base, 1.0f), "kvi_llama_rope_table");
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = llama_model_rope_type(e.model) == LLAMA_ROPE_TYPE_NEOX ? KVI_ROPE_NEOX : KVI_ROPE_GPTJ;
  rs.rotary_dim = n_rot;
  rs.cos_sin_table = table;
  rs.table_positions = (int32_t)cp.n_ctx;
  die_kvi(kvi_model_set_rope(km, -1, &rs), "kvi_model_set_rope");
  free(table);

  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = KVI_DTYPE_FP32; /* pre-RoPE keys kept in fp32: re-rotation adds no fp16 rounding */
  so.budget_bytes = 64ull << 20;
  so.embedding_dim = EMB;
  so.metric = KVI_METRIC_COSINE;
  kvi_store *store;
  die_kvi(kvi_store_create(&store, km, &so), "kvi_store_create");
  const uint64_t tenant = 1, header_id = 1000;

  /* 1. The conversation: each turn prefilled after its window, captured. */
  llama_token conv[MAX_TOK * 4], toks[MAX_TOK];
  int32_t n_conv = tokenize(&e, header, conv, MAX_TOK);
  const int32_t n_header = n_conv;
  int32_t turn_tokens[NT];
  printf("conversation (%d turns; each captured after a %d-token window):\n", NT, WINDOW);
  double t_capture = 0;
  for (int t = 0; t <= NT; t++) {
    /* t == NT: the header alone, captured at 0.. to start every answer */
    const int32_t n_turn = t < NT ? tokenize(&e, turns[t], toks, MAX_TOK) : 0;
    const int32_t w0 = t == NT ? 0 : n_conv > WINDOW ? n_conv - WINDOW : 0;
    const int32_t n_win = t == NT ? n_header : n_conv - w0;
    llama_memory_clear(llama_get_memory(e.ctx), true);
    decode(&e, t == NT ? conv : conv + w0, n_win, 0);
    if (n_turn) decode(&e, toks, n_turn, n_win);
    const double t0 = now_ms();
    size_t size = llama_state_seq_get_size(e.ctx, 0);
    uint8_t *state = malloc(size);
    if (!state || llama_state_seq_get_data(e.ctx, state, size, 0) != size) die("llama_state_seq_get_data failed");
    kvi_cache_layout cl;
    die_kvi(kvi_llama_state_layout(state, size, 0, km, KVI_MEMORY_HOST, &cl), "kvi_llama_state_layout");
    kvi_encoder *enc;
    die_kvi(kvi_encoder_create(&enc, store, &cl, NULL), "kvi_encoder_create");
    const int32_t first = t == NT ? 0 : n_win, n = t == NT ? n_header : n_turn;
    int32_t *pos = malloc((size_t)n * sizeof *pos);
    die_kvi(kvi_llama_state_positions(state, size, 0, first, n, pos), "kvi_llama_state_positions");
    float emb[EMB];
    embed(t < NT ? turns[t] : header, emb);
    const int32_t table0[1] = {0};
    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = tenant;
    c.fact_id = t == NT ? header_id : (uint64_t)t;
    c.block_table = table0;
    c.block_table_len = 1;
    c.first_slot = first;
    c.num_tokens = n;
    c.positions = pos;
    c.embedding = emb;
    die_kvi(kvi_encode(enc, &c, 1, NULL), "kvi_encode");
    t_capture += now_ms() - t0;
    kvi_encoder_destroy(enc);
    free(pos);
    free(state);
    if (t < NT) {
      printf("  fact %d (%2d tokens): %.*s\n", t, n_turn, (int)strlen(turns[t]) - 28, turns[t] + 17);
      turn_tokens[t] = n_turn;
      memcpy(conv + n_conv, toks, (size_t)n_turn * sizeof *toks);
      n_conv += n_turn;
    }
  }
  /* (the header fact has an embedding too; answers skip it when retrieved) */
  printf("captured %d facts and the header in %.2f ms\n\n", NT, t_capture);

  /* 2. Questions: retrieved facts injected vs re-prefill. */
  float *ref = malloc((size_t)e.n_vocab * sizeof *ref), *inj = malloc((size_t)e.n_vocab * sizeof *inj);
  for (int q = 0; q < NQ; q++) {
    float qe[EMB];
    embed(questions[q], qe);
    uint64_t ids[TOP_K + 1];
    float scores[TOP_K + 1];
    int32_t count;
    kvi_search_options sr = KVI_SEARCH_OPTIONS_INIT;
    die_kvi(kvi_store_search(store, qe, 1, EMB, &tenant, TOP_K + 1, ids, scores, &count, &sr, NULL),
            "kvi_store_search");
    uint64_t facts[TOP_K + 1];
    float fscore[TOP_K + 1];
    int32_t k = 0, n_facts_tok = 0;
    facts[k++] = header_id;
    for (int32_t i = 0; i < count && k <= TOP_K; i++)
      if (ids[i] != header_id && scores[i] > 0.0f) {
        fscore[k] = scores[i];
        facts[k++] = ids[i];
        n_facts_tok += turn_tokens[ids[i]];
      }
    const int32_t n_q = tokenize(&e, questions[q], toks, MAX_TOK);
    const int32_t n_cells = n_header + n_facts_tok;

    /* (a) injection: a fresh state of [header | facts], then the question */
    const double t0 = now_ms();
    kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
    sp.num_cells = n_cells;
    sp.dtype = KVI_DTYPE_FP16;
    size_t size;
    die_kvi(kvi_llama_state_size(km, &sp, &size), "kvi_llama_state_size");
    uint8_t *state = malloc(size);
    die_kvi(kvi_llama_state_write_header(state, size, km, &sp), "kvi_llama_state_write_header");
    kvi_cache_layout cl;
    die_kvi(kvi_llama_state_layout(state, size, 0, km, KVI_MEMORY_HOST, &cl), "kvi_llama_state_layout");
    kvi_injector *ij;
    die_kvi(kvi_injector_create(&ij, store, &cl, NULL), "kvi_injector_create");
    const int32_t table0[1] = {0};
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = tenant;
    rq.fact_ids = facts;
    rq.num_facts = k;
    rq.block_table = table0;
    rq.block_table_len = 1;
    die_kvi(kvi_inject(ij, &rq, 1, NULL, NULL), "kvi_inject");
    kvi_injector_destroy(ij);
    const double t1 = now_ms();
    llama_memory_clear(llama_get_memory(e.ctx), true);
    if (llama_state_seq_set_data(e.ctx, state, size, 0) != size) die("llama_state_seq_set_data refused the state");
    const double t2 = now_ms();
    memcpy(inj, decode(&e, toks, n_q, n_cells), (size_t)e.n_vocab * sizeof *inj);
    const double t_inj = now_ms() - t0;
    char a_inj[256];
    generate(&e, inj, n_cells + n_q, a_inj, sizeof a_inj);
    free(state);

    /* (b) re-prefill of [header | the same facts' text | question] */
    llama_token all[MAX_TOK * 2];
    int32_t n_all = tokenize(&e, header, all, MAX_TOK);
    for (int32_t i = 1; i < k; i++) n_all += tokenize(&e, turns[facts[i]], all + n_all, MAX_TOK);
    memcpy(all + n_all, toks, (size_t)n_q * sizeof *toks);
    n_all += n_q;
    llama_memory_clear(llama_get_memory(e.ctx), true);
    const double t3 = now_ms();
    memcpy(ref, decode(&e, all, n_all, 0), (size_t)e.n_vocab * sizeof *ref);
    const double t_pre = now_ms() - t3;
    char a_pre[256];
    generate(&e, ref, n_all, a_pre, sizeof a_pre);

    printf("Q%d: %.*s\n", q + 1, (int)strlen(questions[q]) - 51, questions[q] + 17);
    printf("  retrieved facts:");
    for (int32_t i = 1; i < k; i++) printf(" %llu (%.2f)", (unsigned long long)facts[i], (double)fscore[i]);
    printf("\n  injected   [%3d cells + %2d question tokens]: %7.2f ms to the first token (inject %.2f, set_data "
           "%.2f, decode %.2f): %s\n",
           n_cells, n_q, t_inj, t1 - t0, t2 - t1, t_inj - (t2 - t0), a_inj);
    printf("  re-prefill [%3d tokens]                    : %7.2f ms to the first token: %s\n", n_all, t_pre, a_pre);
    printf("  first token %s; KL(re-prefill || injected) = %.4f nats\n\n",
           argmax(ref, e.n_vocab) == argmax(inj, e.n_vocab) ? "the same" : "differs", kl(ref, inj, e.n_vocab));
  }
  printf("(facts were encoded after their own conversation window, not after the header they are injected "
         "behind, so the two answers' distributions are close, not equal)\n");
  free(ref);
  free(inj);
  kvi_store_destroy(store);
  kvi_model_destroy(km);
  llama_free(e.ctx);
  llama_model_free(e.model);
  llama_backend_free();
  return 0;
}
