/*
 * bench_search — kvi_store_search against the device's copy rate and a plain
 * torch baseline (matmul + topk) on the same data, measured in the same run.
 *
 * Data: fp16 embeddings of 1024 elements, element (row r, column c) =
 * kvi_bench_value(r, c) below, a hash mapped to a multiple of 2^-10 in
 * [-1, 1) (exact in fp16); tests/bench/torch_search.py computes the same
 * formula. Queries are rows 2^30 + i. Facts have a tiny KV (1 layer, 1 head,
 * head size 8, pages of 1 token) so that a million fit.
 *
 * Cases:
 * - one tenant of 1,000,000 facts, k = 50, batches of 1, 16 and 256 queries;
 * - 100 tenants of 10,000 facts, k = 50: one query of one tenant per call
 *   (rotating over the tenants, so the 20 MiB of a tenant are not in L2),
 *   and one call with a query for each of the 100 tenants.
 * For each: the median time of the call (CUDA events around kvi_store_search
 * with device queries and device results, host planning included) over 60
 * calls after 5 warm-ups; queries/s; the embedding bytes the call must read;
 * the time of a device-to-device cudaMemcpy of those bytes in the same run,
 * and half of it, the time to read them once at the measured copy rate
 * (the copy reads and writes every byte); call time / read time.
 * Results of one call per case are checked on the host (sorted, and the
 * scores of the returned facts recomputed).
 *
 * Retrieve-and-inject (kvi_retrieve_inject, k = 50, one query per tenant of
 * 10,000 facts, 1 and 16 queries a call, device queries, outputs and block
 * tables) against the host round trip it replaces: kvi_store_search into
 * host memory, then kvi_inject of the winners, in the same run.
 *
 * Environment: KVI_BENCH_ITERS (timed calls per case), KVI_BENCH_SCALE=n
 * (1/n of the big tenant and no small tenants) and KVI_BENCH_SMALL=n (only
 * the small tenants' cases, over n of them), the last two for profiling.
 *
 * argv[1] (optional): the path of torch_search.py, run after the C cases
 * with `python3`; its numbers are printed beside ours.
 * KVI_BENCH_SCALE=n (profiling): 1/n of the big tenant, no small tenants.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime_api.h>

#include <kvinject.h>

#include "bench.h"

enum { DIM = 1024, K = 50, BIG = 1000000, TENANTS = 100, PER_TENANT = 10000, ITERS = 60, MAXQ = 256 };
#define QUERY_ROW0 (1u << 30)

/* The data: must match value() in torch_search.py. */
static uint32_t kvi_bench_hash(uint32_t r, uint32_t c) {
  uint32_t h = (r * 2654435761u) ^ (c * 2246822519u);
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  h *= 3266489917u;
  h ^= h >> 16;
  return h;
}

static float kvi_bench_value(uint32_t r, uint32_t c) { return (float)((int)(kvi_bench_hash(r, c) % 2048u) - 1024) / 1024.0f; }

static cudaEvent_t e0, e1;
static cudaStream_t stream;

/* Median time of a device-to-device copy of `bytes`. */
static float copy_ms(size_t bytes) {
  char *a, *b;
  CU(cudaMalloc((void **)&a, bytes));
  CU(cudaMalloc((void **)&b, bytes));
  CU(cudaMemset(a, 1, bytes));
  float t[ITERS];
  for (int i = -bench_warm; i < bench_iters; i++) {
    CU(cudaEventRecord(e0, stream));
    CU(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream));
    CU(cudaEventRecord(e1, stream));
    CU(cudaEventSynchronize(e1));
    if (i >= 0) CU(cudaEventElapsedTime(&t[i], e0, e1));
  }
  CU(cudaFree(a));
  CU(cudaFree(b));
  return median(t, bench_iters);
}

typedef uint16_t half_bits;

static half_bits to_half(float x) { /* exact here: the values are multiples of 2^-10 in [-1, 1) */
  __extension__ _Float16 h = (_Float16)x;
  half_bits b;
  memcpy(&b, &h, 2);
  return b;
}

typedef struct bench {
  kvi_store *store;
  half_bits *dq;   /* MAXQ queries */
  uint64_t *dids;  /* MAXQ x K */
  float *dscores;
  int32_t *dcounts;
} bench;

/* Median time of one call with nq queries; `tenant_of(i, iter)` picks each query's tenant. */
/* Median time of one call with nq queries (and in *host_ms the median time
 * until it returned); `tenant_of(i, iter)` picks each query's tenant. */
static float time_search(bench *b, int32_t nq, uint64_t (*tenant_of)(int32_t, int), int iters, float *host_ms) {
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  o.query_dtype = KVI_DTYPE_FP16;
  o.query_memory = KVI_MEMORY_DEVICE;
  o.out_memory = KVI_MEMORY_DEVICE;
  static float t[ITERS], th[ITERS];
  uint64_t tenants[MAXQ];
  for (int it = -bench_warm; it < iters; it++) {
    for (int32_t i = 0; i < nq; i++) tenants[i] = tenant_of(i, it + bench_warm);
    CU(cudaEventRecord(e0, stream));
    const double h0 = now_ms();
    CK(kvi_store_search(b->store, b->dq, nq, DIM, tenants, K, b->dids, b->dscores, b->dcounts, &o,
                        (struct CUstream_st *)stream));
    const double h1 = now_ms();
    CU(cudaEventRecord(e1, stream));
    CU(cudaEventSynchronize(e1));
    if (it >= 0) CU(cudaEventElapsedTime(&t[it], e0, e1));
    if (it >= 0) th[it] = (float)(h1 - h0);
  }
  *host_ms = median(th, iters);
  return median(t, iters);
}

/* Checks the last call's results for query i of tenant `tenant` whose facts
 * are rows row0 + id: sorted, counts right, scores as recomputed here. */
static int verify(bench *b, int32_t nq, uint64_t (*tenant_of)(int32_t, int), int it, uint32_t (*row_of)(uint64_t, uint64_t)) {
  uint64_t *ids = malloc((size_t)nq * K * sizeof *ids);
  float *sc = malloc((size_t)nq * K * sizeof *sc);
  int32_t *cnt = malloc((size_t)nq * sizeof *cnt);
  CU(cudaMemcpy(ids, b->dids, (size_t)nq * K * sizeof *ids, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(sc, b->dscores, (size_t)nq * K * sizeof *sc, cudaMemcpyDeviceToHost));
  CU(cudaMemcpy(cnt, b->dcounts, (size_t)nq * sizeof *cnt, cudaMemcpyDeviceToHost));
  int bad = 0;
  for (int32_t i = 0; i < nq && !bad; i++) {
    if (cnt[i] != K) bad = 1;
    for (int j = 0; j < K && !bad; j++) {
      double s = 0, mag = 0;
      const uint32_t row = row_of(tenant_of(i, it), ids[(size_t)i * K + j]);
      for (uint32_t c = 0; c < DIM; c++) {
        const double x = kvi_bench_value(QUERY_ROW0 + (uint32_t)i, c) * (double)kvi_bench_value(row, c);
        s += x;
        mag += fabs(x);
      }
      if (fabs(s - sc[(size_t)i * K + j]) > 1e-4 * mag + 1e-6) bad = 2;
      if (j > 0 && sc[(size_t)i * K + j - 1] < sc[(size_t)i * K + j]) bad = 3;
    }
  }
  free(ids);
  free(sc);
  free(cnt);
  return bad;
}

static uint64_t one_tenant(int32_t i, int it) { (void)i, (void)it; return 0; }
static int n_tenants = TENANTS; /* KVI_BENCH_SMALL=n: n */
static uint64_t rotating_tenant(int32_t i, int it) { (void)i; return 1 + (uint64_t)(it % n_tenants); }
static uint64_t tenant_per_query(int32_t i, int it) { (void)it; return 1 + (uint64_t)(i % n_tenants); }
static uint32_t row_big(uint64_t tenant, uint64_t id) { (void)tenant; return (uint32_t)id; }
static uint32_t row_small(uint64_t tenant, uint64_t id) { return (uint32_t)(BIG + (tenant - 1) * PER_TENANT + id); }

static void put_rows(kvi_store *s, uint64_t tenant, uint32_t row0, uint32_t n, void *dkv) {
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_DEVICE, KVI_DTYPE_FP16, 1, 1, 1, 8, dkv, (half_bits *)dkv + 8);
  half_bits emb[DIM];
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = emb;
  po.embedding_dtype = KVI_DTYPE_FP16;
  for (uint32_t i = 0; i < n; i++) {
    for (uint32_t c = 0; c < DIM; c++) emb[c] = to_half(kvi_bench_value(row0 + i, c));
    CK(kvi_store_put(s, tenant, i, &kv, &po, (struct CUstream_st *)stream));
  }
}

/* Retrieve-and-inject: median call time of the device path and of the host
 * round trip, nq queries of tenants 1 + (i + iter) % TENANTS. */
typedef struct rbench {
  kvi_injector *inj;
  int32_t *dtables; /* nq x RB_BLOCKS block ids (device) */
  int32_t *htables; /* the same on the host */
  int32_t *dcounts, *dtokens;
} rbench;
enum { RB_BLOCKS = 64, RB_BS = 16 };

static float time_retrieve(bench *b, rbench *r, int32_t nq, bool device, float *host_ms) {
  kvi_search_options o = KVI_SEARCH_OPTIONS_INIT;
  o.query_dtype = KVI_DTYPE_FP16;
  o.query_memory = KVI_MEMORY_DEVICE;
  static float t[ITERS], th[ITERS];
  kvi_retrieve_request rq[MAXQ];
  kvi_inject_request ir[MAXQ];
  uint64_t tenants[MAXQ], ids[MAXQ * K];
  float scores[MAXQ * K];
  int32_t counts[MAXQ];
  for (int it = -bench_warm; it < bench_iters; it++) {
    for (int32_t i = 0; i < nq; i++) {
      tenants[i] = 1 + (uint64_t)((i + it + bench_warm) % n_tenants);
      kvi_retrieve_request_init(&rq[i], sizeof rq[i]);
      rq[i].tenant = tenants[i];
      rq[i].block_table = r->dtables + (size_t)i * RB_BLOCKS;
      rq[i].block_table_len = RB_BLOCKS;
      rq[i].block_table_memory = KVI_MEMORY_DEVICE;
      rq[i].first_slot = 3;
      rq[i].start_position = 100;
    }
    CU(cudaEventRecord(e0, stream));
    const double h0 = now_ms();
    if (device) {
      o.out_memory = KVI_MEMORY_DEVICE;
      CK(kvi_retrieve_inject(r->inj, b->dq, nq, DIM, rq, K, &o, b->dids, r->dcounts, r->dtokens,
                             (struct CUstream_st *)stream));
    } else { /* what an engine does without it: results to the host, then inject */
      o.out_memory = KVI_MEMORY_HOST;
      CK(kvi_store_search(b->store, b->dq, nq, DIM, tenants, K, ids, scores, counts, &o, (struct CUstream_st *)stream));
      for (int32_t i = 0; i < nq; i++) {
        kvi_inject_request_init(&ir[i], sizeof ir[i]);
        ir[i].tenant = tenants[i];
        ir[i].fact_ids = ids + (size_t)i * K;
        ir[i].num_facts = counts[i];
        ir[i].block_table = rq[i].block_table;
        ir[i].block_table_len = RB_BLOCKS;
        ir[i].block_table_memory = KVI_MEMORY_DEVICE;
        ir[i].first_slot = 3;
        ir[i].start_position = 100;
      }
      CK(kvi_inject(r->inj, ir, nq, NULL, (struct CUstream_st *)stream));
    }
    const double h1 = now_ms();
    CU(cudaEventRecord(e1, stream));
    CU(cudaEventSynchronize(e1));
    if (it >= 0) CU(cudaEventElapsedTime(&t[it], e0, e1));
    if (it >= 0) th[it] = (float)(h1 - h0);
  }
  *host_ms = median(th, bench_iters);
  return median(t, bench_iters);
}

typedef struct row {
  const char *name;
  int32_t facts, queries;
  float ms, host_ms, copy_ms;
  double mib;
  int bad;
  float torch_ms;
} row;

int main(int argc, char **argv) {
  bench_runs(ITERS);
  if (!(kvi_features() & KVI_FEATURE_CUBLASLT)) {
    fprintf(stderr, "bench_search: libkvinject was built without cuBLASLt\n");
    return 77;
  }
  if (!bench_device("bench_search")) return 77;
  CU(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CU(cudaEventCreate(&e0));
  CU(cudaEventCreate(&e1));

  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = 1;
  mo.num_kv_heads = 1;
  mo.head_size = 8;
  kvi_model *model;
  CK(kvi_model_create(&model, &mo));
  kvi_rope_spec nope = KVI_ROPE_SPEC_INIT; /* retrieve-and-inject needs every layer's RoPE set */
  nope.style = KVI_ROPE_NONE;
  CK(kvi_model_set_rope(model, -1, &nope));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  so.dtype = KVI_DTYPE_FP16;
  so.page_tokens = 1;
  so.budget_bytes = (uint64_t)(BIG + TENANTS * PER_TENANT + 16) * 2 * 8 * 2;
  so.embedding_dim = DIM;
  so.embedding_dtype = KVI_DTYPE_FP16;
  bench b;
  memset(&b, 0, sizeof b);
  CK(kvi_store_create(&b.store, model, &so));
  void *dkv;
  CU(cudaMalloc(&dkv, 16 * sizeof(half_bits)));
  CU(cudaMemset(dkv, 0, 16 * sizeof(half_bits)));

  const char *scale_env = getenv("KVI_BENCH_SCALE");
  const int scale = scale_env && atoi(scale_env) > 1 ? atoi(scale_env) : 1;
  /* KVI_BENCH_SMALL=n: only the small tenants' cases, over n tenants (for profiling them) */
  const char *small_env = getenv("KVI_BENCH_SMALL");
  const bool small_only = small_env && atoi(small_env) >= 1 && atoi(small_env) <= TENANTS && scale == 1;
  if (small_only) n_tenants = atoi(small_env);
  const int32_t big = small_only ? 0 : BIG / scale;
  fprintf(stderr, "bench_search: putting %d + %d x %d facts...\n", big, scale > 1 ? 0 : TENANTS, PER_TENANT);
  put_rows(b.store, 0, 0, (uint32_t)big, dkv);
  for (int t = 0; t < n_tenants && scale == 1; t++)
    put_rows(b.store, 1 + (uint64_t)t, BIG + (uint32_t)t * PER_TENANT, PER_TENANT, dkv);
  CU(cudaStreamSynchronize(stream));
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CK(kvi_store_stats_get(b.store, &st));
  fprintf(stderr, "bench_search: %llu facts, %.1f MiB of device embeddings\n", (unsigned long long)st.facts,
          st.bytes_embeddings / 1048576.0);

  half_bits *hq = malloc((size_t)MAXQ * DIM * sizeof *hq);
  for (uint32_t i = 0; i < MAXQ; i++)
    for (uint32_t c = 0; c < DIM; c++) hq[(size_t)i * DIM + c] = to_half(kvi_bench_value(QUERY_ROW0 + i, c));
  CU(cudaMalloc((void **)&b.dq, (size_t)MAXQ * DIM * sizeof *hq));
  CU(cudaMemcpy(b.dq, hq, (size_t)MAXQ * DIM * sizeof *hq, cudaMemcpyHostToDevice));
  CU(cudaMalloc((void **)&b.dids, (size_t)MAXQ * K * sizeof(uint64_t)));
  CU(cudaMalloc((void **)&b.dscores, (size_t)MAXQ * K * sizeof(float)));
  CU(cudaMalloc((void **)&b.dcounts, (size_t)MAXQ * sizeof(int32_t)));

  const double row_bytes = DIM * 2.0;
  row rows[6];
  int nrows = 0;
  const int32_t batches[3] = {1, 16, 256};
  const float big_copy = small_only ? 0.0f : copy_ms((size_t)big * DIM * 2);
  for (int i = 0; i < 3 && !small_only; i++) {
    row *r = &rows[nrows++];
    r->name = "1 tenant";
    r->facts = big;
    r->queries = batches[i];
    r->ms = time_search(&b, batches[i], one_tenant, bench_iters, &r->host_ms);
    r->bad = verify(&b, batches[i], one_tenant, bench_iters - 1 + bench_warm, row_big);
    if (i == 0) {
      uint64_t id0;
      float s0;
      CU(cudaMemcpy(&id0, b.dids, sizeof id0, cudaMemcpyDeviceToHost));
      CU(cudaMemcpy(&s0, b.dscores, sizeof s0, cudaMemcpyDeviceToHost));
      printf("query 0: best fact %llu score %.4f\n", (unsigned long long)id0, (double)s0);
    }
    r->mib = big * row_bytes / 1048576.0;
    r->copy_ms = big_copy;
  }
  if (scale > 1) goto report;
  {
    row *r = &rows[nrows++];
    r->name = "1 of 100 tenants";
    r->facts = PER_TENANT;
    r->queries = 1;
    r->ms = time_search(&b, 1, rotating_tenant, bench_iters, &r->host_ms);
    r->bad = verify(&b, 1, rotating_tenant, bench_iters - 1 + bench_warm, row_small);
    r->mib = PER_TENANT * row_bytes / 1048576.0;
    r->copy_ms = copy_ms((size_t)PER_TENANT * DIM * 2);
  }
  {
    row *r = &rows[nrows++];
    r->name = "100 tenants";
    r->facts = n_tenants * PER_TENANT;
    r->queries = n_tenants;
    r->ms = time_search(&b, n_tenants, tenant_per_query, bench_iters, &r->host_ms);
    r->bad = verify(&b, n_tenants, tenant_per_query, 0, row_small);
    r->mib = (double)n_tenants * PER_TENANT * row_bytes / 1048576.0;
    r->copy_ms = copy_ms((size_t)n_tenants * PER_TENANT * DIM * 2);
  }
  {
    /* retrieve-and-inject into a fp16 cache of the facts' geometry */
    rbench r;
    memset(&r, 0, sizeof r);
    const int32_t nb = MAXQ * RB_BLOCKS;
    void *cache;
    CU(cudaMalloc(&cache, (size_t)2 * nb * RB_BS * 8 * 2));
    void *layers[1] = {cache};
    kvi_cache_layout cl;
    CK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP16, 1, 1, 8, RB_BS, nb, layers, NULL, NULL));
    cl.memory = KVI_MEMORY_DEVICE;
    CK(kvi_injector_create(&r.inj, b.store, &cl, NULL));
    r.htables = malloc((size_t)nb * sizeof(int32_t));
    for (int32_t i = 0; i < nb; i++) r.htables[i] = (int32_t)((i * 7919u) % (uint32_t)nb); /* scattered, distinct */
    CU(cudaMalloc((void **)&r.dtables, (size_t)nb * sizeof(int32_t)));
    CU(cudaMemcpy(r.dtables, r.htables, (size_t)nb * sizeof(int32_t), cudaMemcpyHostToDevice));
    CU(cudaMalloc((void **)&r.dcounts, MAXQ * sizeof(int32_t)));
    CU(cudaMalloc((void **)&r.dtokens, MAXQ * sizeof(int32_t)));
    printf("| retrieve+inject, k 50, tenants of 10,000 | queries | device ms | host ms | round trip ms | host ms | "
           "round trip/device |\n|---|--:|--:|--:|--:|--:|--:|\n");
    const int32_t nqs[2] = {1, 16};
    for (int i = 0; i < 2; i++) {
      float hd, hr;
      const float d = time_retrieve(&b, &r, nqs[i], true, &hd), rt = time_retrieve(&b, &r, nqs[i], false, &hr);
      printf("| one query per tenant | %d | %.3f | %.3f | %.3f | %.3f | %.2fx |\n", nqs[i], d, hd, rt, hr, rt / d);
    }
    int64_t skipped = -1;
    CK(kvi_injector_async_errors(r.inj, &skipped));
    printf("(skipped tokens: %lld)\n\n", (long long)skipped);
    kvi_injector_destroy(r.inj);
    CU(cudaFree(cache));
    CU(cudaFree(r.dtables));
    CU(cudaFree(r.dcounts));
    CU(cudaFree(r.dtokens));
    free(r.htables);
  }
report:
  for (int i = 0; i < nrows; i++) rows[i].torch_ms = NAN;

  /* the torch baseline, same data, same machine, right after */
  if (argc > 1 && scale == 1) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "python3 '%s' 2>&1", argv[1]);
    fprintf(stderr, "bench_search: running the torch baseline: %s\n", cmd);
    FILE *p = popen(cmd, "r");
    char line[512];
    while (p && fgets(line, sizeof line, p)) {
      int facts, queries;
      float ms;
      char name[64];
      if (sscanf(line, "TORCH %63[^|]|%d|%d|%f", name, &facts, &queries, &ms) == 4) {
        for (int i = 0; i < nrows; i++)
          if (rows[i].facts == facts && rows[i].queries == queries && strcmp(rows[i].name, name) == 0)
            rows[i].torch_ms = ms;
      } else {
        fprintf(stderr, "  torch: %s", line);
      }
    }
    if (p) pclose(p);
  }

  printf("| case             |     facts | queries | k  | call ms | host ms | queries/s | MiB read | copy ms | read ms | call/read "
         "| torch ms | torch/call | check |\n");
  printf("|------------------|----------:|--------:|---:|--------:|--------:|----------:|---------:|--------:|--------:|----------:"
         "|---------:|-----------:|-------|\n");
  for (int i = 0; i < nrows; i++) {
    const row *r = &rows[i];
    printf("| %-16s | %9d | %7d | %2d | %7.3f | %7.3f | %9.0f | %8.1f | %7.3f | %7.3f | %8.2fx | %8.3f | %9.2fx | %s |\n",
           r->name, r->facts, r->queries, K, r->ms, r->host_ms, r->queries / (r->ms * 1e-3), r->mib, r->copy_ms, r->copy_ms / 2,
           r->ms / (r->copy_ms / 2), r->torch_ms, r->torch_ms / r->ms, r->bad ? "FAILED" : "ok");
  }
  printf("\ncopy ms: cudaMemcpy device to device of the bytes the call reads; read ms = copy ms / 2, reading them once\n"
         "at the copy rate (a copy reads and writes each byte); host ms: median time until the call returned (part of\n"
         "call ms: the device waits while the host plans). Targets: 1 tenant batch 1 call/read <= 1.2x;\n"
         "batch 256 >= 100,000 queries/s; one 10,000-fact tenant <= 0.050 ms; torch/call > 1 everywhere.\n");
  int bad = 0;
  for (int i = 0; i < nrows; i++) bad |= rows[i].bad;
  free(hq);
  CU(cudaFree(b.dq));
  CU(cudaFree(b.dids));
  CU(cudaFree(b.dscores));
  CU(cudaFree(b.dcounts));
  CU(cudaFree(dkv));
  kvi_store_destroy(b.store);
  kvi_model_destroy(model);
  return bad ? 1 : 0;
}
