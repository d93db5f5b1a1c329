/*
 * bench_inject — injection and capture throughput against the device's copy
 * rate, measured in the same run.
 *
 * Llama-3.1-8B geometry (32 layers, 8 KV heads, head size 128, llama3 RoPE),
 * bf16 store -> bf16 vLLM FlashAttention cache with blocks of 16 tokens,
 * facts of 24 tokens. For each case: the median time of the call (CUDA
 * events around kvi_inject / kvi_encode, so the plan upload is included),
 * the bytes it must move (every K and V element read once and written once),
 * their rate, and the time of a device-to-device cudaMemcpy of the same
 * bytes (the ceiling). Inputs rotate among sets larger than the L2 cache so
 * that repeated runs do not measure the cache. Each injection case runs in
 * three forms: kvi_inject (a struct per request), kvi_inject_batched from
 * host arrays (CSR fact ids, a 2-D block table) and kvi_inject_batched with
 * the fact ids and the block table in device memory (looked up and planned
 * on the device; the store keeps 64-element embeddings for that).
 * KVI_BENCH_STORE_DTYPE=fp8 or q4 keeps the facts in that store dtype instead
 * (fp8: 16-token pages; q4: 64-token pages); the cache stays bf16 and "MiB
 * moved" still counts bf16 bytes on both sides.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _POSIX_C_SOURCE 200809L
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include <kvinject.h>

#include "bench.h"

enum { L = 32, H = 8, D = 128, BS = 16, FACT_T = 24, POOL = 1024, ITERS = 60, EMB = 64 };
static const size_t TOKEN_BYTES = (size_t)L * H * D * 2 * 2; /* K and V, bf16 */

/* Median time of a device-to-device copy of `bytes`, rotating over a buffer
 * of `span` bytes. */
static float copy_ms(char *src, char *dst, size_t bytes, size_t span, cudaEvent_t e0, cudaEvent_t e1) {
  float t[ITERS];
  size_t sets = span / bytes < 1 ? 1 : span / bytes;
  for (int i = -bench_warm; i < bench_iters; i++) {
    size_t off = (size_t)((i + bench_warm) % (int)sets) * bytes;
    CU(cudaEventRecord(e0, 0));
    CU(cudaMemcpyAsync(dst + off, src + off, bytes, cudaMemcpyDeviceToDevice, 0));
    CU(cudaEventRecord(e1, 0));
    CU(cudaEventSynchronize(e1));
    if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
  }
  return median(t, bench_iters);
}

/* The busy work a queued call waits behind: a 2 GiB device-to-device copy
 * (about 1 ms), longer than any call's host work here, so that the call's
 * validation, planning and launch overlap it as they do in an engine whose
 * GPU is still running the previous step. */
static char *busy_src, *busy_dst;
static void busy(void) { CU(cudaMemcpyAsync(busy_dst, busy_src, (size_t)2 << 30, cudaMemcpyDeviceToDevice, 0)); }

static void row(const char *what, int requests, int k, float ms, float hms, float qms, float cms) {
  const double tokens = (double)requests * k * FACT_T, bytes = tokens * TOKEN_BYTES * 2; /* read + write */
  printf("| %-8s | %4d | %4d | %8.0f | %9.1f | %8.3f | %8.3f | %9.3f | %8.3f | %7.1f%% | %9.1f%% |\n", what, requests, k,
         tokens, bytes / 1048576.0, ms, hms, qms, cms, 100.0 * cms / ms, 100.0 * cms / qms);
}

int main(void) {
  bench_runs(ITERS);
  if (!bench_device("bench_inject")) return 77;

  kvi_model *model = bench_llama_model(L, H, D);

  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  so.budget_bytes = (uint64_t)(2 * POOL + 4 * 64 * 50) * 16 * TOKEN_BYTES; /* pages: pool + capture churn */
  const char *sdt = getenv("KVI_BENCH_STORE_DTYPE");
  const bool q4 = sdt && !strcmp(sdt, "q4");
  if (sdt && !strcmp(sdt, "fp8")) so.dtype = KVI_DTYPE_FP8_E4M3;
  /* q4: a 64-token page a fact, 0.3x a bf16 token's bytes with its scale words (0.273x at head size 128) */
  if (q4) so.dtype = KVI_DTYPE_Q4, so.page_tokens = 64, so.budget_bytes = so.budget_bytes / 16 * 64 * 3 / 10;
  if (sdt && !q4 && strcmp(sdt, "fp8") && strcmp(sdt, "bf16")) {
    fprintf(stderr, "KVI_BENCH_STORE_DTYPE is %s: bf16, fp8 or q4\n", sdt);
    return 1;
  }
  printf("store dtype %s\n\n", sdt ? sdt : "bf16");
  so.embedding_dim = EMB; /* device directories: kvi_inject_batched's device fact ids */
  kvi_store *store;
  CK(kvi_store_create(&store, model, &so));

  /* facts: random bf16 from a device buffer */
  const size_t fact_elems = (size_t)L * FACT_T * H * D;
  uint16_t *hbuf = malloc(fact_elems * 2 * sizeof *hbuf);
  for (size_t i = 0; i < fact_elems * 2; i++) hbuf[i] = (uint16_t)(0x3c00 + (rand() & 0x3ff)) ^ (rand() & 0x8000);
  void *dsrc;
  CU(cudaMalloc(&dsrc, fact_elems * 2 * 2));
  CU(cudaMemcpy(dsrc, hbuf, fact_elems * 2 * 2, cudaMemcpyHostToDevice));
  for (int f = 0; f < POOL; f++) {
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, L, FACT_T, H, D, dsrc, (uint16_t *)dsrc + fact_elems);
    float emb[EMB];
    for (int e = 0; e < EMB; e++) emb[e] = (float)((f * 31 + e * 7) % 97) - 48.0f;
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = emb;
    CK(kvi_store_put(store, 1, (uint64_t)f, &kv, &po, NULL));
  }
  CU(cudaDeviceSynchronize());

  /* the cache: one [2, NB, BS, H, D] tensor per layer, room for 64 x 50 facts */
  const int64_t max_tokens = 64 * 50 * FACT_T, NB = max_tokens / BS + 64;
  const size_t layer_bytes = (size_t)2 * NB * BS * H * D * 2;
  void *layers[L];
  for (int l = 0; l < L; l++) {
    CU(cudaMalloc(&layers[l], layer_bytes));
    CU(cudaMemset(layers[l], 0, layer_bytes));
  }
  kvi_cache_layout cl;
  CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = KVI_MEMORY_DEVICE;
  kvi_injector *inj;
  kvi_encoder *enc;
  CK(kvi_injector_create(&inj, store, &cl, NULL));
  CK(kvi_encoder_create(&enc, store, &cl, NULL));

  /* copy baseline buffers: 2 GiB, well past the 60 MB L2 */
  const size_t span = (size_t)64 * 50 * FACT_T * TOKEN_BYTES; /* the largest case, 9.4 GiB */
  char *csrc, *cdst;
  CU(cudaMalloc((void **)&csrc, span));
  CU(cudaMalloc((void **)&cdst, span));
  CU(cudaMemset(csrc, 1, span));
  cudaEvent_t e0, e1;
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));

  int32_t *table = malloc((size_t)NB * sizeof *table);
  for (int64_t b = 0; b < NB; b++) table[b] = (int32_t)((b * 7919) % NB); /* scattered blocks */
  static uint64_t ids[64][50];
  static kvi_inject_request reqs[64];
  /* the batched forms: CSR offsets, a 2-D table [64][NB / 64], start positions; device copies */
  const int32_t TW = (int32_t)(NB / 64);
  static int32_t offs[65], tab2d[64 * 4096];
  static int32_t starts[64];
  if (TW > 4096) return 1;
  uint64_t *d_ids;
  int32_t *d_tab, *d_tokens;
  CU(cudaMalloc((void **)&d_ids, sizeof ids));
  CU(cudaMalloc((void **)&d_tab, (size_t)64 * TW * sizeof(int32_t)));
  CU(cudaMalloc((void **)&d_tokens, 64 * sizeof(int32_t)));
  cudaStream_t st0 = 0;

  busy_src = csrc;
  busy_dst = cdst + span - ((size_t)2 << 30);
  printf("| case     | reqs |    k |   tokens | MiB moved | call ms  |  host ms | queued ms | copy ms  | of copy | queued of |\n");
  printf("|----------|------|------|----------|-----------|----------|----------|-----------|----------|---------|-----------|\n");
  const int ks[] = {5, 10, 20, 50};
  static const char *forms[3] = {"inject", "batched", "dev ids"};
  for (int c = 0; c < 15; c++) {
    const int form = c % 3, R = c / 3 < 4 ? 1 : 64, k = c / 3 < 4 ? ks[c / 3] : 50;
    float t[ITERS], th[ITERS], tq[ITERS];
    for (int i = -bench_warm; i < bench_iters; i++) {
      /* fresh facts and destinations every iteration */
      for (int r = 0; r < R; r++) {
        kvi_inject_request_init(&reqs[r], sizeof reqs[r]);
        for (int f = 0; f < k; f++) ids[r][f] = (uint64_t)((i + bench_warm) * 131 + r * 50 + f) % POOL;
        reqs[r].tenant = 1;
        reqs[r].fact_ids = ids[r];
        reqs[r].num_facts = k;
        /* each request its own slice of blocks, moving every iteration */
        reqs[r].block_table = table + (int64_t)((r + i + bench_warm) % 64) * (NB / 64);
        reqs[r].block_table_len = (int32_t)(NB / 64);
        reqs[r].first_slot = 0;
        reqs[r].start_position = 100;
        offs[r] = r * k;
        memcpy(tab2d + (size_t)r * TW, reqs[r].block_table, (size_t)TW * sizeof(int32_t));
        starts[r] = 100;
      }
      offs[R] = R * k;
      kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
      b.num_requests = R, b.tenant = 1, b.fact_ids = &ids[0][0], b.fact_offsets = offs;
      b.block_tables = tab2d, b.block_table_stride = TW, b.block_table_len = TW, b.start_positions = starts;
      /* CSR ids: rows of k back to back (only k = 50 has R > 1, and needs no move) */
      for (int r = 0; r < R && k < 50; r++) memmove(&ids[0][0] + r * k, ids[r], (size_t)k * sizeof(uint64_t));
      if (form == 2) { /* the ids and the table on the device, as a search and the engine leave them */
        CU(cudaMemcpy(d_ids, &ids[0][0], (size_t)R * k * sizeof(uint64_t), cudaMemcpyHostToDevice));
        CU(cudaMemcpy(d_tab, tab2d, (size_t)R * TW * sizeof(int32_t), cudaMemcpyHostToDevice));
        b.fact_ids = d_ids, b.fact_ids_memory = KVI_MEMORY_DEVICE;
        b.block_tables = d_tab, b.block_tables_memory = KVI_MEMORY_DEVICE;
        b.out_tokens = d_tokens;
      }
      for (int q = 0; q < 2; q++) { /* on an idle GPU, then queued behind busy() */
        if (q) busy();
        CU(cudaEventRecord(e0, 0));
        const double h0 = now_ms();
        if (form == 0)
          CK(kvi_inject(inj, reqs, R, NULL, NULL));
        else
          CK(kvi_inject_batched(inj, &b, NULL, st0));
        const double h1 = now_ms();
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        if (i >= 0) CU(cudaEventElapsedTime(q ? &tq[i] : &t[i], e0, e1));
        if (i >= 0 && !q) th[i] = (float)(h1 - h0);
      }
    }
    const size_t bytes = (size_t)R * k * FACT_T * TOKEN_BYTES;
    row(forms[form], R, k, median(t, bench_iters), median(th, bench_iters), median(tq, bench_iters), copy_ms(csrc, cdst, bytes, span, e0, e1));
  }

  static kvi_capture caps[64 * 50];
  static const float cap_emb[EMB]; /* the store keeps embeddings: every capture carries one */
  for (int c = 0; c < 5; c++) {
    const int n = c < 4 ? ks[c] : 64 * 50;
    float t[ITERS], th[ITERS], tq[ITERS];
    for (int i = -bench_warm; i < bench_iters; i++) {
      for (int f = 0; f < n; f++) {
        kvi_capture_init(&caps[f], sizeof caps[f]);
        caps[f].tenant = 2;
        caps[f].fact_id = (uint64_t)f;
        caps[f].flags = KVI_PUT_REPLACE;
        caps[f].block_table = table;
        caps[f].block_table_len = (int32_t)NB;
        caps[f].first_slot = (int64_t)f * FACT_T + (int64_t)((i + bench_warm) % 4) * 7;
        caps[f].num_tokens = FACT_T;
        caps[f].start_position = 100 + f * FACT_T;
        caps[f].embedding = cap_emb;
      }
      for (int q = 0; q < 2; q++) { /* on an idle GPU, then queued behind busy() (replacing the facts) */
        if (q) busy();
        CU(cudaEventRecord(e0, 0));
        const double h0 = now_ms();
        CK(kvi_encode(enc, caps, n, NULL));
        const double h1 = now_ms();
        CU(cudaEventRecord(e1, 0));
        CU(cudaEventSynchronize(e1));
        if (i >= 0) CU(cudaEventElapsedTime(q ? &tq[i] : &t[i], e0, e1));
        if (i >= 0 && !q) th[i] = (float)(h1 - h0);
      }
    }
    const size_t bytes = (size_t)n * FACT_T * TOKEN_BYTES;
    row("capture", 1, n, median(t, bench_iters), median(th, bench_iters), median(tq, bench_iters), copy_ms(csrc, cdst, bytes, span, e0, e1));
  }

  printf("\nMiB moved counts bytes read + written. 'call ms': the call on an idle GPU, from an event recorded\n"
         "before it to one after it, so its host work (validation, planning, launch; 'host ms' is the time the\n"
         "call took to return) is on the clock. 'queued ms': the same call queued behind a 2 GiB copy that its\n"
         "host work overlaps, as in an engine whose GPU is busy with the previous step: the device time (plan\n"
         "upload and kernel). 'of copy' and 'queued of': copy time of the same bytes / call or queued time.\n");
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  kvi_store_destroy(store);
  kvi_model_destroy(model);
  for (int l = 0; l < L; l++) cudaFree(layers[l]);
  cudaFree(csrc);
  cudaFree(cdst);
  cudaFree(dsrc);
  free(table);
  free(hbuf);
  cudaFree(d_ids);
  cudaFree(d_tab);
  cudaFree(d_tokens);
  return 0;
}
