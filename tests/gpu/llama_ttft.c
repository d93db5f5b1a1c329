/*
 * Time to first token with llama.cpp on a GPU: re-prefill of
 * [header | k facts | question] against libkvinject injection of the k
 * facts into a sequence state in pinned, mapped host memory (a CUDA store:
 * the kernel writes the state in place over the bus), handed to llama.cpp
 * with llama_state_seq_set_data, then the question decoded.
 *
 *   llama_ttft MODEL.gguf [reps] [--cpu]
 *
 * (--cpu: a CPU store and an ordinary host buffer, llama.cpp as built; to
 * check the program where no GPU answers.)
 *
 * Header 32 tokens, facts 24 tokens each, question 32 tokens (random token
 * ids: the model is random-weight); k = 0, 5, 10, 20, 50; median of `reps`
 * (default 10) timed runs after two warm-ups. Facts are captured after the
 * header as their context window (Context-Window Encoding). Before timing,
 * a check: the [header | facts] state rebuilt by injection from the
 * engine's own capture (keys stored as captured, injected at the same
 * positions) must give the logits of llama.cpp continuing its own state,
 * bit for bit. Prints one table row per k. Exits 1 on a failure.
 * SPDX-License-Identifier: Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>
#include <kvinject.h>
#include <llama.h>

enum { HDR = 32, FACT = 24, QUES = 32, KMAX = 50, NFACTS = 64 };

static void die(const char *what) {
  fprintf(stderr, "llama_ttft: %s\n", what);
  exit(1);
}
#define KVI(call)                                                                                  \
  do {                                                                                             \
    kvi_status st_ = (call);                                                                       \
    if (st_) {                                                                                     \
      fprintf(stderr, "llama_ttft: %s: %s\n", #call, kvi_last_error());                            \
      exit(1);                                                                                     \
    }                                                                                              \
  } while (0)

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void quiet(enum ggml_log_level level, const char *text, void *user) {
  (void)user;
  if (level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

static struct llama_context *ctx;
static int32_t n_vocab;

static const float *decode(const llama_token *t, int32_t n, int32_t pos0, int32_t seq) {
  struct llama_batch b = llama_batch_init(n, 0, 1);
  for (int32_t i = 0; i < n; i++) {
    b.token[i] = t[i];
    b.pos[i] = pos0 + i;
    b.n_seq_id[i] = 1;
    b.seq_id[i][0] = seq;
    b.logits[i] = i == n - 1;
  }
  b.n_tokens = n;
  if (llama_decode(ctx, b)) die("llama_decode failed");
  llama_batch_free(b);
  return llama_get_logits_ith(ctx, n - 1); /* waits for the GPU */
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int main(int argc, char **argv) {
  if (argc < 2) die("usage: llama_ttft MODEL.gguf [reps] [--cpu]");
  const int reps = argc > 2 ? atoi(argv[2]) : 10;
  const int cpu = argc > 3 && strcmp(argv[3], "--cpu") == 0;
  const kvi_memory mem = cpu ? KVI_MEMORY_HOST : KVI_MEMORY_DEVICE;
  if (reps < 1 || reps > 64) die("reps must be 1..64");
  llama_log_set(quiet, NULL);
  llama_backend_init();
  struct llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 999;
  struct llama_model *model = llama_model_load_from_file(argv[1], mp);
  if (!model) die("cannot load the model");
  struct llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 2048;
  cp.n_batch = cp.n_ubatch = 2048;
  cp.n_seq_max = 1;
  cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_ENABLED;
  cp.type_k = cp.type_v = GGML_TYPE_F16;
  cp.offload_kqv = true;
  cp.no_perf = true;
  ctx = llama_init_from_model(model, cp);
  if (!ctx) die("cannot create a context");
  n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  const int32_t L = llama_model_n_layer(model), HKV = llama_model_n_head_kv(model);
  const int32_t D = llama_model_n_embd(model) / llama_model_n_head(model);
  char meta[64];
  const float base =
      llama_model_meta_val_str(model, "llama.rope.freq_base", meta, sizeof meta) > 0 ? (float)atof(meta) : 1e4f;

  /* libkvinject: the model, llama.cpp's RoPE (NORM pairs, its angles), a CUDA store */
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L;
  mo.num_kv_heads = HKV;
  mo.head_size = D;
  kvi_model *km;
  KVI(kvi_model_create(&km, &mo));
  float *table = malloc((size_t)cp.n_ctx * (size_t)D * sizeof *table);
  KVI(kvi_llama_rope_table(table, (int32_t)cp.n_ctx, D, base, 1.0f));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = KVI_ROPE_GPTJ;
  rs.cos_sin_table = table;
  rs.table_positions = (int32_t)cp.n_ctx;
  KVI(kvi_model_set_rope(km, -1, &rs));
  free(table);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = cpu ? KVI_BACKEND_CPU : KVI_BACKEND_CUDA;
  so.dtype = KVI_DTYPE_FP16;
  so.budget_bytes = 512ull << 20;
  kvi_store *store;
  KVI(kvi_store_create(&store, km, &so));

  /* the state buffer: pinned, mapped (UVA), sized for the largest state */
  kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
  sp.num_cells = HDR + KMAX * FACT;
  sp.dtype = KVI_DTYPE_FP16;
  size_t cap;
  KVI(kvi_llama_state_size(km, &sp, &cap));
  uint8_t *pinned;
  cudaStream_t stream = NULL;
  if (cpu) {
    pinned = malloc(cap);
    if (!pinned) die("out of memory");
  } else {
    if (cudaHostAlloc((void **)&pinned, cap, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess)
      die("cudaHostAlloc failed");
    cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  }

  /* random tokens: header, NFACTS facts, question */
  srand(1);
  llama_token hdr[HDR], facts[NFACTS][FACT], ques[QUES];
  for (int i = 0; i < HDR; i++) hdr[i] = rand() % n_vocab;
  for (int f = 0; f < NFACTS; f++)
    for (int i = 0; i < FACT; i++) facts[f][i] = rand() % n_vocab;
  for (int i = 0; i < QUES; i++) ques[i] = rand() % n_vocab;

  /* capture: each fact prefilled after the header (its window), pre-RoPE */
  const int32_t table0[1] = {0};
  size_t ssz = llama_state_seq_get_size(ctx, 0) + cap, n;
  uint8_t *host = malloc(ssz);
  for (int f = 0; f <= NFACTS; f++) {
    llama_memory_clear(llama_get_memory(ctx), true);
    decode(hdr, HDR, 0, 0);
    if (f < NFACTS) decode(facts[f], FACT, HDR, 0);
    n = llama_state_seq_get_data(ctx, pinned, cap, 0);
    if (!n) die("llama_state_seq_get_data failed");
    kvi_cache_layout cl;
    KVI(kvi_llama_state_layout(pinned, n, 0, km, mem, &cl));
    kvi_encoder *enc;
    KVI(kvi_encoder_create(&enc, store, &cl, NULL));
    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = 1;
    c.fact_id = f < NFACTS ? (uint64_t)f : 1000; /* 1000: the header */
    c.block_table = table0;
    c.block_table_len = 1;
    c.first_slot = f < NFACTS ? HDR : 0;
    c.num_tokens = f < NFACTS ? FACT : HDR;
    c.start_position = (int32_t)c.first_slot;
    KVI(kvi_encode(enc, &c, 1, stream));
    if (stream) cudaStreamSynchronize(stream);
    kvi_encoder_destroy(enc);
  }

  /* check: [header | 5 facts] rebuilt from llama.cpp's own state, keys as
   * captured (rotation by 0), injected at the same cells: bit-identical */
  {
    const int k = 5, cells = HDR + k * FACT;
    llama_memory_clear(llama_get_memory(ctx), true);
    decode(hdr, HDR, 0, 0);
    for (int f = 0; f < k; f++) decode(facts[f], FACT, HDR + f * FACT, 0);
    n = llama_state_seq_get_data(ctx, host, ssz, 0);
    float *ref = malloc((size_t)n_vocab * sizeof *ref), *got = malloc((size_t)n_vocab * sizeof *got);
    memcpy(ref, decode(ques, QUES, cells, 0), (size_t)n_vocab * sizeof *ref);
    memcpy(pinned, host, n);
    kvi_cache_layout cl;
    KVI(kvi_llama_state_layout(pinned, n, 0, km, mem, &cl));
    kvi_encoder *enc;
    KVI(kvi_encoder_create(&enc, store, &cl, NULL));
    int32_t *zeros = calloc((size_t)cells, sizeof *zeros);
    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = 2;
    c.fact_id = 1;
    c.block_table = table0;
    c.block_table_len = 1;
    c.num_tokens = cells;
    c.positions = zeros;
    KVI(kvi_encode(enc, &c, 1, stream));
    if (stream) cudaStreamSynchronize(stream);
    kvi_encoder_destroy(enc);
    sp.num_cells = cells;
    size_t m;
    KVI(kvi_llama_state_size(km, &sp, &m));
    memset(pinned, 0, m);
    KVI(kvi_llama_state_write_header(pinned, cap, km, &sp));
    KVI(kvi_llama_state_layout(pinned, m, 0, km, mem, &cl));
    kvi_injector *inj;
    KVI(kvi_injector_create(&inj, store, &cl, NULL));
    const uint64_t id = 1;
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = 2;
    rq.fact_ids = &id;
    rq.num_facts = 1;
    rq.block_table = table0;
    rq.block_table_len = 1;
    rq.positions = zeros;
    KVI(kvi_inject(inj, &rq, 1, NULL, stream));
    if (stream) cudaStreamSynchronize(stream);
    kvi_injector_destroy(inj);
    const int same_bytes = m == n && memcmp(pinned, host, n) == 0;
    llama_memory_clear(llama_get_memory(ctx), true);
    if (llama_state_seq_set_data(ctx, pinned, m, 0) != m) die("llama.cpp refused the rebuilt state");
    memcpy(got, decode(ques, QUES, cells, 0), (size_t)n_vocab * sizeof *got);
    const int same = memcmp(ref, got, (size_t)n_vocab * sizeof *ref) == 0;
    printf("check: [header | 5 facts] rebuilt by injection from llama.cpp's own capture: state %s, logits %s\n",
           same_bytes ? "byte-identical" : "DIFFERS", same ? "bit-identical" : "DIFFER");
    if (!same || !same_bytes) return 1;
    free(zeros);
    free(ref);
    free(got);
    KVI(kvi_store_remove(store, 2, 1));
  }

  printf("\nllama.cpp %s, f16 KV, flash attention; header %d + k x %d fact tokens + %d-token question; medians "
         "of %d\n",
         cpu ? "(CPU store, host buffer)" : "CUDA (CUDA store, mapped pinned buffer)", HDR, FACT, QUES, reps);
  printf("| k | re-prefill ms | injected TTFT ms | change | inject ms | set_data ms | question ms | state MB |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  const int ks[] = {0, 5, 10, 20, 50};
  for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++) {
    const int k = ks[ki], cells = HDR + k * FACT;
    llama_token *all = malloc((size_t)(cells + QUES) * sizeof *all);
    memcpy(all, hdr, sizeof hdr);
    for (int f = 0; f < k; f++) memcpy(all + HDR + f * FACT, facts[f], sizeof facts[f]);
    memcpy(all + cells, ques, sizeof ques);
    uint64_t ids[KMAX + 1];
    ids[0] = 1000;
    for (int f = 0; f < k; f++) ids[1 + f] = (uint64_t)f;
    double pre[64], tot[64], tin[64], tset[64], tq[64];
    /* per state size: its layout and an injector (made once, as an engine
     * would keep one per buffer shape) */
    size_t m;
    sp.num_cells = cells;
    KVI(kvi_llama_state_size(km, &sp, &m));
    KVI(kvi_llama_state_write_header(pinned, cap, km, &sp));
    kvi_cache_layout cl;
    KVI(kvi_llama_state_layout(pinned, m, 0, km, mem, &cl));
    kvi_injector *inj;
    KVI(kvi_injector_create(&inj, store, &cl, NULL));
    for (int r = -2; r < reps; r++) {
      /* re-prefill */
      llama_memory_clear(llama_get_memory(ctx), true);
      double t0 = now_ms();
      decode(all, cells + QUES, 0, 0);
      const double t_pre = now_ms() - t0;
      /* injection: the state's metadata, the facts, llama.cpp reads it, the question */
      llama_memory_clear(llama_get_memory(ctx), true);
      t0 = now_ms();
      KVI(kvi_llama_state_write_header(pinned, cap, km, &sp));
      kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
      rq.tenant = 1;
      rq.fact_ids = ids;
      rq.num_facts = 1 + k;
      rq.block_table = table0;
      rq.block_table_len = 1;
      KVI(kvi_inject(inj, &rq, 1, NULL, stream));
      if (stream) cudaStreamSynchronize(stream);
      const double t1 = now_ms();
      if (llama_state_seq_set_data(ctx, pinned, m, 0) != m) die("llama.cpp refused an injected state");
      const double t2 = now_ms();
      decode(ques, QUES, cells, 0);
      const double t3 = now_ms();
      if (r >= 0) pre[r] = t_pre, tot[r] = t3 - t0, tin[r] = t1 - t0, tset[r] = t2 - t1, tq[r] = t3 - t2;
    }
    kvi_injector_destroy(inj);
    const double p = median(pre, reps), t = median(tot, reps);
    printf("| %d | %.2f | %.2f | %+.0f%% | %.2f | %.2f | %.2f | %.1f |\n", k, p, t, 100.0 * (t - p) / p,
           median(tin, reps), median(tset, reps), median(tq, reps), m / 1e6);
    free(all);
  }
  if (cpu) {
    free(pinned);
  } else {
    cudaFreeHost(pinned);
    cudaStreamDestroy(stream);
  }
  free(host);
  kvi_store_destroy(store);
  kvi_model_destroy(km);
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
