/*
 * Tensor-parallel stores on several GPUs of one host, one process per GPU
 * (tests/gpu/tp_harness.h): the cost of what moves between ranks, against
 * NCCL's own bandwidth measured in the same run.
 *
 * - put_scatter: 50 facts of 24 tokens, Llama-3.1-8B geometry (32 layers,
 *   8 KV heads, head size 128), bf16, from a device source on rank 0; each
 *   other rank receives its heads. Baseline: ncclSend/ncclRecv of the same
 *   slices (one message per fact and rank, as put_scatter sends them).
 * - gather: the same facts joined back on rank 0. Baseline: the same
 *   messages in the other direction.
 * - sharded search vs replicated: 1,000,000 facts x 1024-dim fp16 in one
 *   tenant, k = 50, batch 1 and 16. Sharded: each rank scores its share and
 *   the candidates meet in one all-gather; replicated: each rank scores every
 *   fact alone. Baseline: ncclAllGather of the candidate bytes alone.
 * Rank 0 prints the table. Needs >= 2 GPUs; prints why and exits 0 otherwise.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "../gpu/tp_harness.h"
#include "bench.h"

enum { L = 32, H = 8, D = 128, T = 24, NF = 50, ITERS = 10, WARM = 2, DIM = 1024, K = 50, BIG = 1000000 };

/* All ranks line up: a one-element all-reduce, then the stream drained. */
static void barrier(tp_rank *r, cudaStream_t st, float *scratch) {
  if (ncclAllReduce(scratch, scratch, 1, ncclFloat, ncclSum, r->nccl, st) != ncclSuccess) exit(3);
  CU(cudaStreamSynchronize(st));
}

static kvi_model *model(int layers, int heads, int d, tp_rank *r) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = layers;
  mo.num_kv_heads = heads;
  mo.head_size = d;
  mo.tp_rank = r->rank;
  mo.tp_size = r->size;
  kvi_model *m = NULL;
  CK(kvi_model_create(&m, &mo));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  CK(kvi_model_set_rope(m, -1, &rs));
  return m;
}

static kvi_store *store(kvi_model *m, tp_rank *r, uint64_t budget, int page_tokens, int emb_dim,
                        kvi_embedding_placement pl) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = r->rank;
  so.dtype = KVI_DTYPE_BF16;
  so.page_tokens = page_tokens;
  so.budget_bytes = budget;
  so.embedding_dim = emb_dim;
  so.embedding_dtype = KVI_DTYPE_FP16;
  so.comm = r->comm;
  so.embedding_placement = pl;
  kvi_store *s = NULL;
  CK(kvi_store_create(&s, m, &so));
  return s;
}

/* Median wall time of `iters` rounds of fn, ranks lined up before each. */
typedef void (*round_fn)(tp_rank *r, cudaStream_t st, void *arg);
static float timed(tp_rank *r, cudaStream_t st, float *scratch, round_fn fn, void *arg) {
  float t[ITERS];
  for (int i = -WARM; i < ITERS; i++) {
    barrier(r, st, scratch);
    const double t0 = now_ms();
    fn(r, st, arg);
    CU(cudaStreamSynchronize(st));
    if (i >= 0) t[i] = (float)(now_ms() - t0);
  }
  return median(t, ITERS);
}

typedef struct kv_ctx {
  kvi_store *s;
  void *full;     /* rank 0: NF facts, [2][L][T][H][D] bf16 each, device */
  void *msg;      /* NF x (size - 1) slices, device, for the NCCL baseline */
  size_t fact_bytes, slice_bytes;
} kv_ctx;

static kvi_kv_view full_view(const kv_ctx *c, int f) {
  kvi_kv_view v;
  char *base = (char *)c->full + (size_t)f * c->fact_bytes;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, L, T, H, D, base, base + c->fact_bytes / 2);
  return v;
}

/* All NF facts in one call (batch = 0), or one call per fact (batch = 1). */
static void scatter_facts(tp_rank *r, cudaStream_t st, kv_ctx *c, int one_by_one) {
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.flags = KVI_PUT_REPLACE;
  kvi_kv_view v[NF];
  kvi_scatter_item it[NF];
  for (int f = 0; f < NF; f++) {
    v[f] = full_view(c, f);
    kvi_scatter_item x = {sizeof(kvi_scatter_item), 1, (uint64_t)f, r->rank == 0 ? &v[f] : NULL, &po};
    it[f] = x;
  }
  if (one_by_one)
    for (int f = 0; f < NF; f++) CK(kvi_store_put_scatter(c->s, 0, &it[f], 1, (struct CUstream_st *)st));
  else
    CK(kvi_store_put_scatter(c->s, 0, it, NF, (struct CUstream_st *)st));
}

static void gather_facts(tp_rank *r, cudaStream_t st, kv_ctx *c, int one_by_one) {
  kvi_kv_view v[NF];
  kvi_gather_item it[NF];
  for (int f = 0; f < NF; f++) {
    v[f] = full_view(c, f);
    kvi_gather_item x = {sizeof(kvi_gather_item), 1, (uint64_t)f, r->rank == 0 ? &v[f] : NULL};
    it[f] = x;
  }
  if (one_by_one)
    for (int f = 0; f < NF; f++) CK(kvi_store_gather(c->s, 0, &it[f], 1, (struct CUstream_st *)st));
  else
    CK(kvi_store_gather(c->s, 0, it, NF, (struct CUstream_st *)st));
}
static void do_scatter(tp_rank *r, cudaStream_t st, void *arg) { scatter_facts(r, st, arg, 0); }
static void do_scatter1(tp_rank *r, cudaStream_t st, void *arg) { scatter_facts(r, st, arg, 1); }
static void do_gather(tp_rank *r, cudaStream_t st, void *arg) { gather_facts(r, st, arg, 0); }
static void do_gather1(tp_rank *r, cudaStream_t st, void *arg) { gather_facts(r, st, arg, 1); }

/* NCCL alone: the messages put_scatter (to_root 0) or gather (1) exchange. */
static void nccl_messages(tp_rank *r, cudaStream_t st, void *arg, int to_root) {
  kv_ctx *c = arg;
  for (int f = 0; f < NF; f++) {
    if (ncclGroupStart() != ncclSuccess) exit(3);
    for (int p = 1; p < r->size; p++) {
      char *buf = (char *)c->msg + ((size_t)f * (r->size - 1) + (p - 1)) * c->slice_bytes;
      const bool send = (r->rank == 0) != (to_root != 0);
      if (r->rank == 0) {
        if ((send ? ncclSend(buf, c->slice_bytes, ncclUint8, p, r->nccl, st)
                  : ncclRecv(buf, c->slice_bytes, ncclUint8, p, r->nccl, st)) != ncclSuccess)
          exit(3);
      } else if (r->rank == p) {
        if ((send ? ncclSend(buf, c->slice_bytes, ncclUint8, 0, r->nccl, st)
                  : ncclRecv(buf, c->slice_bytes, ncclUint8, 0, r->nccl, st)) != ncclSuccess)
          exit(3);
      }
    }
    if (ncclGroupEnd() != ncclSuccess) exit(3);
  }
}
static void do_send(tp_rank *r, cudaStream_t st, void *arg) { nccl_messages(r, st, arg, 0); }
static void do_recv(tp_rank *r, cudaStream_t st, void *arg) { nccl_messages(r, st, arg, 1); }

typedef struct search_ctx {
  kvi_store *s;
  float *q;
  int nq;
  uint64_t *ids;
  float *scores;
  int32_t *counts;
  void *ag_send, *ag_recv;
  size_t ag_bytes;
} search_ctx;

static void do_search(tp_rank *r, cudaStream_t st, void *arg) {
  (void)r;
  search_ctx *c = arg;
  uint64_t tenants[16] = {0};
  kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
  so.query_memory = KVI_MEMORY_DEVICE;
  so.out_memory = KVI_MEMORY_DEVICE;
  CK(kvi_store_search(c->s, c->q, c->nq, DIM, tenants, K, c->ids, c->scores, c->counts, &so,
                      (struct CUstream_st *)st));
}

static void do_allgather(tp_rank *r, cudaStream_t st, void *arg) {
  search_ctx *c = arg;
  if (ncclAllGather(c->ag_send, c->ag_recv, c->ag_bytes, ncclUint8, r->nccl, st) != ncclSuccess) exit(3);
}

static float hashf(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (float)((double)(x >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static int bench(tp_rank *r, void *arg) {
  (void)arg;
  cudaStream_t st;
  CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  float *scratch;
  CU(cudaMalloc((void **)&scratch, 256));
  CU(cudaMemset(scratch, 0, 256));
  const bool lead = r->rank == 0;
  if (lead) {
    int dev;
    struct cudaDeviceProp p;
    CU(cudaGetDevice(&dev));
    CU(cudaGetDeviceProperties(&p, dev));
    printf("device: %s x %d, NCCL %d.%d.%d, one process per GPU\n", p.name, r->size, NCCL_MAJOR, NCCL_MINOR,
           NCCL_PATCH);
  }

  /* ---- scatter and gather of KV ---- */
  kvi_model *m = model(L, H, D, r);
  kv_ctx kc = {store(m, r, 1ull << 30, 16, 0, KVI_EMBEDDINGS_REPLICATED), NULL, NULL, 0, 0};
  kc.fact_bytes = (size_t)2 * L * T * H * D * 2;
  kc.slice_bytes = kc.fact_bytes / (size_t)r->size;
  CU(cudaMalloc(&kc.full, kc.fact_bytes * NF));
  CU(cudaMemset(kc.full, 0x3c, kc.fact_bytes * NF)); /* bf16 0x3c3c: finite values */
  CU(cudaMalloc(&kc.msg, kc.slice_bytes * NF * (size_t)(r->size - 1) + 16));
  const float send_ms = timed(r, st, scratch, do_send, &kc);
  const float scatter_ms = timed(r, st, scratch, do_scatter, &kc);
  const float scatter1_ms = timed(r, st, scratch, do_scatter1, &kc);
  const float recv_ms = timed(r, st, scratch, do_recv, &kc);
  const float gather_ms = timed(r, st, scratch, do_gather, &kc);
  const float gather1_ms = timed(r, st, scratch, do_gather1, &kc);
  const double moved = (double)kc.slice_bytes * NF * (r->size - 1);
  if (lead) {
    printf("\n| operation (tp %d, %d facts x %d tokens, bf16) | MiB between ranks | call ms | GB/s | NCCL alone ms | "
           "GB/s | of NCCL |\n|---|---:|---:|---:|---:|---:|---:|\n",
           r->size, NF, T);
    const struct {
      const char *name;
      float ms, nccl;
    } rows[4] = {{"put_scatter from rank 0, one call for all 50", scatter_ms, send_ms},
                 {"put_scatter from rank 0, one call per fact", scatter1_ms, send_ms},
                 {"gather to rank 0, one call for all 50", gather_ms, recv_ms},
                 {"gather to rank 0, one call per fact", gather1_ms, recv_ms}};
    for (int i = 0; i < 4; i++)
      printf("| %s | %.1f | %.3f | %.1f | %.3f | %.1f | %.1f%% |\n", rows[i].name, moved / 1048576.0, rows[i].ms,
             moved / rows[i].ms / 1e6, rows[i].nccl, moved / rows[i].nccl / 1e6, 100.0 * rows[i].nccl / rows[i].ms);
    printf("(NCCL alone: the same messages, ncclSend/ncclRecv, one group per fact.)\n");
  }
  cudaFree(kc.full);
  cudaFree(kc.msg);
  kvi_store_destroy(kc.s);
  kvi_model_destroy(m);

  /* ---- sharded vs replicated search ---- */
  kvi_model *ms = model(1, r->size, 8, r);
  /* one-token facts of one layer and one local head: 32-byte pages, so 1M facts take 32 MiB */
  kvi_store *sh = store(ms, r, 64u << 20, 1, DIM, KVI_EMBEDDINGS_SHARDED);
  kvi_store *rep = store(ms, r, 64u << 20, 1, DIM, KVI_EMBEDDINGS_REPLICATED);
  void *dkv;
  CU(cudaMalloc(&dkv, 64));
  CU(cudaMemset(dkv, 0, 64));
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, 1, 1, 1, 8, dkv, (char *)dkv + 16);
  float *emb = malloc(DIM * sizeof *emb);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = emb;
  const double t0 = now_ms();
  for (uint32_t i = 0; i < BIG; i++) {
    for (int c = 0; c < DIM; c++) emb[c] = hashf((uint64_t)i * DIM + (uint64_t)c);
    CK(kvi_store_put(sh, 0, i, &kv, &po, (struct CUstream_st *)st));
    CK(kvi_store_put(rep, 0, i, &kv, &po, (struct CUstream_st *)st));
  }
  CU(cudaStreamSynchronize(st));
  if (lead) printf("\n(put %d facts into both stores on every rank in %.1f s)\n", BIG, (now_ms() - t0) / 1e3);
  size_t held = 0;
  {
    kvi_store_stats ss = KVI_STORE_STATS_INIT;
    CK(kvi_store_stats_get(sh, &ss));
    held = (size_t)ss.bytes_embeddings;
  }
  search_ctx sc = {NULL, NULL, 0, NULL, NULL, NULL, NULL, NULL, 0};
  CU(cudaMalloc((void **)&sc.q, 16 * DIM * sizeof(float)));
  float *hq = malloc(16 * DIM * sizeof *hq);
  for (int i = 0; i < 16 * DIM; i++) hq[i] = hashf(0x51ed27ull + (uint64_t)i);
  CU(cudaMemcpy(sc.q, hq, 16 * DIM * sizeof *hq, cudaMemcpyHostToDevice));
  CU(cudaMalloc((void **)&sc.ids, 16 * K * 8));
  CU(cudaMalloc((void **)&sc.scores, 16 * K * 4));
  CU(cudaMalloc((void **)&sc.counts, 16 * 4));
  if (lead)
    printf("\n| search (%d facts x %d fp16, k %d, tp %d) | queries | sharded ms | replicated ms | sharded/replicated | "
           "all-gather alone ms | embedding MiB per rank (sharded) |\n|---|---:|---:|---:|---:|---:|---:|\n",
           BIG, DIM, K, r->size);
  const int batches[2] = {1, 16};
  for (int b = 0; b < 2; b++) {
    sc.nq = batches[b];
    sc.s = sh;
    const float t_sh = timed(r, st, scratch, do_search, &sc);
    sc.s = rep;
    const float t_rep = timed(r, st, scratch, do_search, &sc);
    sc.ag_bytes = (size_t)sc.nq * K * 12 + (size_t)sc.nq * 4 + 32;
    CU(cudaMalloc(&sc.ag_send, sc.ag_bytes));
    CU(cudaMalloc(&sc.ag_recv, sc.ag_bytes * (size_t)r->size));
    const float t_ag = timed(r, st, scratch, do_allgather, &sc);
    cudaFree(sc.ag_send);
    cudaFree(sc.ag_recv);
    if (lead)
      printf("| one tenant | %d | %.3f | %.3f | %.2f | %.3f | %.0f |\n", sc.nq, t_sh, t_rep, t_sh / t_rep, t_ag,
             held / 1048576.0);
  }
  if (lead) printf("(times: median wall time of %d calls on rank 0, ranks lined up before each; the replicated store "
                   "holds %d rows per rank)\n", ITERS, BIG);
  free(emb);
  free(hq);
  cudaFree(sc.q);
  cudaFree(sc.ids);
  cudaFree(sc.scores);
  cudaFree(sc.counts);
  cudaFree(dkv);
  kvi_store_destroy(sh);
  kvi_store_destroy(rep);
  kvi_model_destroy(ms);
  cudaFree(scratch);
  cudaStreamDestroy(st);
  return 0;
}

int main(void) {
  const int n = tp_device_count();
  if (n < 2) {
    printf("bench_tp: %d CUDA device(s); the tensor-parallel benchmark needs at least 2\n", n);
    return 0;
  }
  int bad = 0;
  for (int tp = 2; tp <= n && tp <= 8; tp *= 2) bad |= tp_run(tp, bench, NULL);
  return bad;
}
