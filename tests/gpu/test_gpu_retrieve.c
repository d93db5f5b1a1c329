/*
 * gpu suite: kvi_retrieve_inject on a CUDA store compared with the CPU store
 * (the reference) holding the same facts. Embeddings and queries are small
 * integers, so every score is exact on both backends and ties fall to the
 * lower fact id on both: the retrieved ids, counts and token counts must be
 * equal, and the caches (poisoned first, so that an unwritten element or one
 * written out of place shows up) equal byte for byte where the RoPE is a
 * cos/sin table, within one unit of bf16 where each backend computes its own
 * cos/sin. Independently of the CPU, the device path must equal the CUDA
 * store's own kvi_store_search + kvi_inject into a second device cache byte
 * for byte. Covers host and device queries, outputs and block tables, the
 * best-last order, tenants without facts, the tenant directories under
 * removes, replaces and a longer fact (a re-strided directory), the block
 * table reserve (k facts of the tenant's longest size) with failed calls
 * writing nothing, and a tiered store (the host path).
 * Every test skips, and the binary exits 77, where no CUDA device answers
 * (or the library has no cuBLASLt), so the list of tests is the same on
 * every machine.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#define GPU_TEST_SEED 0x13198a2e03707344ull
#include "gpu_test.h"

static int g_devices;
static bool g_retrieve; /* a device and cuBLASLt */

#define REQUIRE_GPU()                                                                                              \
  do {                                                                                                             \
    if (!g_retrieve) skip();                                                                                       \
  } while (0)

#ifdef KVI_HAVE_CUDA

/* Model, store and cache geometry. A fact has 1..40 tokens (1 to 3 pages);
 * the directory tests add facts of up to 56 and one of 70 tokens (5 pages).
 * Block tables of TBL blocks take k = 64 facts of 70 tokens from any
 * first_slot below 48; NQ tables of TBL blocks fit the cache disjointly. */
enum {
  L = 2,
  H = 2,
  D = 16,
  P = 16, /* page tokens */
  BS = 16,
  NB = 2048,
  DIM = 32,
  NQ = 5,
  TBL = 400,
  MAXK = 64,
  NPOS = 8192, /* rows of the cos/sin table */
  MAXF = 512,
  LONG = 70
};

static const uint16_t POISON = 0x7f7f; /* bf16 3.39e38: no value written here comes near it */

typedef struct cfg {
  kvi_dtype store_dtype, emb_dtype;
  kvi_cache_preset preset;
  bool table_rope;        /* a cos/sin table (same values on both backends: exact) or Llama 3 */
  uint64_t host_budget;   /* > 0: a tiered CUDA store (the host path) */
} cfg;

typedef struct fact_rec {
  uint64_t tenant, id;
  int32_t tokens;
  bool live;
} fact_rec;

typedef struct world {
  cfg c;
  kvi_model *model;
  kvi_store *cpu, *gpu;
  kvi_injector *hi, *di, *dref; /* CPU cache; device cache; second device cache for search + inject */
  size_t cache_elems;           /* bf16 elements of all layers */
  uint16_t *host, *dev, *dev2;  /* one allocation of L per-layer tensors each */
  float *table;
  fact_rec f[MAXF];
  int nf;
  uint64_t next_id;
  int32_t tables[NQ][TBL]; /* host block tables; dtab holds the same on the device */
  int32_t *dtab;
  cudaStream_t st;
} world;

/* ---------------------------------------------------------------- facts */

static int32_t rand_len(int32_t lo, int32_t hi) { return lo + (int32_t)(rnd() % (uint64_t)(hi - lo + 1)); }

static fact_rec *find_fact(world *w, uint64_t tenant, uint64_t id) {
  for (int i = 0; i < w->nf; i++)
    if (w->f[i].live && w->f[i].tenant == tenant && w->f[i].id == id) return &w->f[i];
  return NULL;
}

static int32_t live_count(const world *w, uint64_t tenant) {
  int32_t n = 0;
  for (int i = 0; i < w->nf; i++) n += w->f[i].live && w->f[i].tenant == tenant;
  return n;
}

static int32_t live_longest(const world *w, uint64_t tenant) {
  int32_t m = 0;
  for (int i = 0; i < w->nf; i++)
    if (w->f[i].live && w->f[i].tenant == tenant && w->f[i].tokens > m) m = w->f[i].tokens;
  return m;
}

/* Puts the same fact (random K, V and integer embedding) into both stores. */
static void put_both(world *w, uint64_t tenant, uint64_t id, int32_t T, uint32_t flags) {
  const size_t n = (size_t)L * T * H * D;
  float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v), e[DIM];
  for (size_t i = 0; i < n; i++) k[i] = rndf(), v[i] = rndf();
  rand_ints(e, DIM, -4, 4);
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, v);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = e;
  po.flags = flags;
  CHECK_OK(kvi_store_put(w->cpu, tenant, id, &kv, &po, NULL));
  CHECK_OK(kvi_store_put(w->gpu, tenant, id, &kv, &po, NULL));
  free(k);
  free(v);
  fact_rec *r = find_fact(w, tenant, id);
  if (r) {
    assert_true(flags & KVI_PUT_REPLACE);
    r->tokens = T;
    return;
  }
  assert_true(w->nf < MAXF);
  w->f[w->nf++] = (fact_rec){tenant, id, T, true};
}

static uint64_t new_fact(world *w, uint64_t tenant, int32_t T) {
  const uint64_t id = w->next_id;
  w->next_id += 7; /* ids are not dense */
  put_both(w, tenant, id, T, 0);
  return id;
}

static void remove_both(world *w, fact_rec *r) {
  CHECK_OK(kvi_store_remove(w->cpu, r->tenant, r->id));
  CHECK_OK(kvi_store_remove(w->gpu, r->tenant, r->id));
  r->live = false;
}

/* ---------------------------------------------------------------- world */

static void set_rope(world *w) {
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  if (w->c.table_rope) {
    w->table = rope_table_f32(NPOS, D, 1e6);
    r.cos_sin_table = w->table;
    r.table_positions = NPOS;
  } else {
    r.theta = 500000;
    r.scaling = KVI_ROPE_SCALING_LLAMA3;
    r.factor = 8;
  }
  CHECK_OK(kvi_model_set_rope(w->model, -1, &r));
}

static kvi_injector *make_injector(world *w, kvi_store *s, uint16_t *base, kvi_memory mem) {
  void *layers[L];
  for (int l = 0; l < L; l++) layers[l] = base + (size_t)l * (w->cache_elems / L);
  kvi_cache_layout cl;
  CHECK_OK(kvi_cache_layout_preset(&cl, w->c.preset, KVI_DTYPE_BF16, L, H, D, BS, NB, layers, NULL, NULL));
  cl.memory = mem;
  kvi_injector *inj = NULL;
  CHECK_OK(kvi_injector_create(&inj, s, &cl, NULL));
  return inj;
}

/* Tenants 1 (90 facts), 2 (45), 3 (5), 4 (had 3, all removed); 77 never
 * seen. */
static void make_world(world *w, const cfg *c) {
  memset(w, 0, sizeof *w);
  w->c = *c;
  w->next_id = 1000;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L;
  mo.num_kv_heads = H;
  mo.head_size = D;
  CHECK_OK(kvi_model_create(&w->model, &mo));
  set_rope(w);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.dtype = c->store_dtype;
  so.page_tokens = P;
  so.budget_bytes = 32u << 20;
  so.embedding_dim = DIM;
  so.embedding_dtype = c->emb_dtype;
  so.metric = KVI_METRIC_INNER_PRODUCT;
  so.backend = KVI_BACKEND_CPU;
  CHECK_OK(kvi_store_create(&w->cpu, w->model, &so));
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  if (c->host_budget) { /* a device tier of 160 pages: later puts go to the host tier */
    so.budget_bytes = 160ull * L * 2 * H * D * P * kvi_dtype_size(c->store_dtype);
    so.host_budget_bytes = c->host_budget;
  }
  CHECK_OK(kvi_store_create(&w->gpu, w->model, &so));
  CUDA_OK(cudaStreamCreateWithFlags(&w->st, cudaStreamNonBlocking));

  w->cache_elems = (size_t)L * 2 * NB * BS * H * D;
  const size_t bytes = w->cache_elems * sizeof(uint16_t);
  w->host = malloc(bytes);
  CUDA_OK(cudaMalloc((void **)&w->dev, bytes));
  CUDA_OK(cudaMalloc((void **)&w->dev2, bytes));
  CUDA_OK(cudaMalloc((void **)&w->dtab, sizeof w->tables));
  w->hi = make_injector(w, w->cpu, w->host, KVI_MEMORY_HOST);
  w->di = make_injector(w, w->gpu, w->dev, KVI_MEMORY_DEVICE);
  w->dref = make_injector(w, w->gpu, w->dev2, KVI_MEMORY_DEVICE);

  for (int i = 0; i < 140; i++) new_fact(w, i < 90 ? 1 : i < 135 ? 2 : 3, rand_len(1, 40));
  for (int i = 0; i < 3; i++) new_fact(w, 4, rand_len(1, 40));
  for (int i = 0; i < w->nf; i++)
    if (w->f[i].tenant == 4) remove_both(w, &w->f[i]);
}

static void free_world(world *w) {
  CUDA_OK(cudaStreamSynchronize(w->st));
  kvi_injector_destroy(w->hi);
  kvi_injector_destroy(w->di);
  kvi_injector_destroy(w->dref);
  kvi_store_destroy(w->cpu);
  kvi_store_destroy(w->gpu);
  kvi_model_destroy(w->model);
  free(w->host);
  cudaFree(w->dev);
  cudaFree(w->dev2);
  cudaFree(w->dtab);
  cudaStreamDestroy(w->st);
  free(w->table);
}

static void poison(world *w) {
  CUDA_OK(cudaStreamSynchronize(w->st));
  for (size_t i = 0; i < w->cache_elems; i++) w->host[i] = POISON;
  CUDA_OK(cudaMemset(w->dev, 0x7f, w->cache_elems * sizeof(uint16_t)));
  CUDA_OK(cudaMemset(w->dev2, 0x7f, w->cache_elems * sizeof(uint16_t)));
  CUDA_OK(cudaDeviceSynchronize());
}

static uint16_t *fetch(const world *w, const uint16_t *dev) {
  uint16_t *h = malloc(w->cache_elems * sizeof *h);
  CUDA_OK(cudaMemcpy(h, dev, w->cache_elems * sizeof *h, cudaMemcpyDeviceToHost));
  return h;
}

/* Elements of a that differ from b: any bit (exact) or more than one unit
 * of bf16 (the poison must match exactly either way). */
static size_t cache_diff(const world *w, const uint16_t *a, const uint16_t *b, bool exact) {
  size_t bad = 0;
  for (size_t i = 0; i < w->cache_elems; i++) {
    if (a[i] == b[i]) continue;
    if (!exact && a[i] != POISON && b[i] != POISON && ((a[i] ^ b[i]) & 0x8000) == 0 && abs((int)a[i] - (int)b[i]) == 1)
      continue;
    bad++;
  }
  return bad;
}

static size_t cache_written(const world *w, const uint16_t *a) {
  size_t n = 0;
  for (size_t i = 0; i < w->cache_elems; i++) n += a[i] != POISON;
  return n;
}

/* ---------------------------------------------------------------- calls */

typedef struct outs {
  uint64_t ids[NQ * MAXK];
  int32_t counts[NQ], tokens[NQ];
} outs;

static void outs_poison(outs *o) { memset(o, 0x5a, sizeof *o); }

static bool outs_untouched(const outs *o) {
  const unsigned char *p = (const unsigned char *)o;
  for (size_t i = 0; i < sizeof *o; i++)
    if (p[i] != 0x5a) return false;
  return true;
}

/* Fresh scattered, disjoint block tables (host and device copies). */
static void shuffle_tables(world *w) {
  static int32_t perm[NB];
  for (int32_t i = 0; i < NB; i++) perm[i] = i;
  for (int32_t i = NB - 1; i > 0; i--) {
    const int32_t j = (int32_t)(rnd() % (uint64_t)(i + 1)), t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  for (int r = 0; r < NQ; r++) memcpy(w->tables[r], perm + r * TBL, TBL * sizeof(int32_t));
  CUDA_OK(cudaMemcpy(w->dtab, w->tables, sizeof w->tables, cudaMemcpyHostToDevice));
  CUDA_OK(cudaDeviceSynchronize()); /* the pageable copy has landed (test_gpu_store.c, to_device) */
}

/* NQ requests over tenants {1, 2, 3, 4, 77} in a random order; first slots
 * off block boundaries; request 0's table in host memory, request 1's on the
 * device, the rest either. hreq: the CPU's (host tables only); greq: the
 * CUDA store's. */
static void make_requests(world *w, kvi_retrieve_request *hreq, kvi_retrieve_request *greq) {
  uint64_t tn[NQ] = {1, 2, 3, 4, 77};
  for (int i = NQ - 1; i > 0; i--) {
    const int j = (int)(rnd() % (uint64_t)(i + 1));
    const uint64_t t = tn[i];
    tn[i] = tn[j], tn[j] = t;
  }
  shuffle_tables(w);
  for (int i = 0; i < NQ; i++) {
    kvi_retrieve_request_init(&hreq[i], sizeof hreq[i]);
    hreq[i].tenant = tn[i];
    hreq[i].block_table = w->tables[i];
    hreq[i].block_table_len = TBL;
    hreq[i].first_slot = 16 * (int64_t)(rnd() % 3) + 1 + (int64_t)(rnd() % 15);
    hreq[i].start_position = (int32_t)(rnd() % 3000);
    hreq[i].flags = rnd() % 2 ? KVI_RETRIEVE_BEST_LAST : 0;
    greq[i] = hreq[i];
    const bool dev = i == 1 || (i > 1 && rnd() % 2);
    if (dev) {
      greq[i].block_table = w->dtab + (size_t)i * TBL;
      greq[i].block_table_memory = KVI_MEMORY_DEVICE;
    }
  }
}

/* Blocks a request needs for n facts of `longest` tokens from first_slot. */
static int32_t blocks_for(int64_t first_slot, int32_t n, int32_t longest) {
  return (int32_t)((first_slot + (int64_t)n * longest - 1) / BS + 1);
}

static void make_queries(float *q, bool zero_first) {
  rand_ints(q, (size_t)NQ * DIM, -3, 3);
  if (zero_first) memset(q, 0, DIM * sizeof *q); /* every score 0: the order is by fact id */
}

static kvi_status cpu_retrieve(world *w, const float *q, const kvi_retrieve_request *hreq, int32_t k, outs *o) {
  outs_poison(o);
  return kvi_retrieve_inject(w->hi, q, NQ, DIM, hreq, k, NULL, o->ids, o->counts, o->tokens, NULL);
}

/* The CUDA injector's call with queries in qm and outputs in om (copied
 * back into o, whatever the status: a failed call must leave them as they
 * were). */
static kvi_status gpu_retrieve(world *w, const float *q, const kvi_retrieve_request *greq, int32_t k, kvi_memory qm,
                               kvi_memory om, outs *o) {
  outs_poison(o);
  kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
  so.query_memory = qm;
  so.out_memory = om;
  float *dq = NULL;
  uint64_t *di = NULL;
  int32_t *dc = NULL, *dt = NULL;
  if (qm == KVI_MEMORY_DEVICE) {
    CUDA_OK(cudaMalloc((void **)&dq, (size_t)NQ * DIM * sizeof(float)));
    CUDA_OK(cudaMemcpy(dq, q, (size_t)NQ * DIM * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize()); /* the pageable copy has landed (test_gpu_store.c, to_device) */
  }
  if (om == KVI_MEMORY_DEVICE) {
    CUDA_OK(cudaMalloc((void **)&di, sizeof o->ids));
    CUDA_OK(cudaMalloc((void **)&dc, sizeof o->counts));
    CUDA_OK(cudaMalloc((void **)&dt, sizeof o->tokens));
    CUDA_OK(cudaMemset(di, 0x5a, sizeof o->ids));
    CUDA_OK(cudaMemset(dc, 0x5a, sizeof o->counts));
    CUDA_OK(cudaMemset(dt, 0x5a, sizeof o->tokens));
    CUDA_OK(cudaDeviceSynchronize());
  }
  const kvi_status st = kvi_retrieve_inject(w->di, dq ? (const void *)dq : (const void *)q, NQ, DIM, greq, k, &so,
                                            di ? di : o->ids, dc ? dc : o->counts, dt ? dt : o->tokens,
                                            (struct CUstream_st *)w->st);
  CUDA_OK(cudaStreamSynchronize(w->st));
  if (om == KVI_MEMORY_DEVICE) {
    /* only the first k ids of each row: the buffer is laid out for k */
    CUDA_OK(cudaMemcpy(o->ids, di, (size_t)NQ * k * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o->counts, dc, sizeof o->counts, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(o->tokens, dt, sizeof o->tokens, cudaMemcpyDeviceToHost));
  }
  cudaFree(dq);
  cudaFree(di);
  cudaFree(dc);
  cudaFree(dt);
  return st;
}

/* The same through the CUDA store's kvi_store_search and kvi_inject into the
 * second device cache. */
static void gpu_search_inject(world *w, const float *q, const kvi_retrieve_request *greq, int32_t k, outs *o) {
  outs_poison(o);
  uint64_t tenants[NQ];
  static float sc[NQ * MAXK];
  static uint64_t order[NQ][MAXK];
  for (int i = 0; i < NQ; i++) tenants[i] = greq[i].tenant;
  CHECK_OK(kvi_store_search(w->gpu, q, NQ, DIM, tenants, k, o->ids, sc, o->counts, NULL, (struct CUstream_st *)w->st));
  kvi_inject_request ir[NQ];
  for (int i = 0; i < NQ; i++) {
    const int32_t n = o->counts[i];
    for (int32_t j = 0; j < n; j++)
      order[i][j] = o->ids[i * k + ((greq[i].flags & KVI_RETRIEVE_BEST_LAST) ? n - 1 - j : j)];
    int64_t t = 0;
    if (n) CHECK_OK(kvi_inject_plan(w->dref, greq[i].tenant, order[i], n, &t));
    o->tokens[i] = (int32_t)t;
    kvi_inject_request_init(&ir[i], sizeof ir[i]);
    ir[i].tenant = greq[i].tenant;
    ir[i].fact_ids = order[i];
    ir[i].num_facts = n;
    ir[i].block_table = greq[i].block_table;
    ir[i].block_table_len = greq[i].block_table_len;
    ir[i].block_table_memory = greq[i].block_table_memory;
    ir[i].first_slot = greq[i].first_slot;
    ir[i].start_position = greq[i].start_position;
  }
  CHECK_OK(kvi_inject(w->dref, ir, NQ, NULL, (struct CUstream_st *)w->st));
  CUDA_OK(cudaStreamSynchronize(w->st));
}

static void expect_no_async_errors(world *w) {
  int64_t skipped = -1;
  CHECK_OK(kvi_injector_async_errors(w->di, &skipped));
  assert_int_equal(skipped, 0);
  CHECK_OK(kvi_injector_async_errors(w->dref, &skipped));
  assert_int_equal(skipped, 0);
}

/* One call on both backends (and the search + inject reference), on
 * poisoned caches; everything compared. */
static void compare_call(world *w, const float *q, const kvi_retrieve_request *hreq, const kvi_retrieve_request *greq,
                         int32_t k, kvi_memory qm, kvi_memory om, const char *what) {
  assert_true(k <= MAXK);
  poison(w);
  outs c, g, r;
  CHECK_OK(cpu_retrieve(w, q, hreq, k, &c));
  CHECK_OK(gpu_retrieve(w, q, greq, k, qm, om, &g));
  gpu_search_inject(w, q, greq, k, &r);
  expect_no_async_errors(w);

  int64_t total = 0;
  for (int i = 0; i < NQ; i++) {
    const uint64_t t = hreq[i].tenant;
    const int32_t live = live_count(w, t), want = live < k ? live : k;
    if (c.counts[i] != want || g.counts[i] != want || r.counts[i] != want)
      fail_msg("%s: query %d (tenant %llu): counts CPU %d, GPU %d, GPU search %d; expected %d", what, i,
               (unsigned long long)t, (int)c.counts[i], (int)g.counts[i], (int)r.counts[i], (int)want);
    int64_t tok = 0;
    for (int32_t j = 0; j < k; j++) {
      const size_t x = (size_t)i * k + j;
      if (c.ids[x] != g.ids[x] || r.ids[x] != g.ids[x])
        fail_msg("%s: query %d rank %d: CPU fact %llu, GPU fact %llu, GPU search fact %llu", what, i, (int)j,
                 (unsigned long long)c.ids[x], (unsigned long long)g.ids[x], (unsigned long long)r.ids[x]);
      if (j >= want) {
        if (g.ids[x] != KVI_SEARCH_NO_ID)
          fail_msg("%s: query %d rank %d past the count is not KVI_SEARCH_NO_ID", what, i, (int)j);
        continue;
      }
      const fact_rec *f = find_fact(w, t, g.ids[x]);
      if (!f) fail_msg("%s: query %d rank %d: fact %llu is no live fact of tenant %llu", what, i, (int)j,
                       (unsigned long long)g.ids[x], (unsigned long long)t);
      tok += f->tokens;
    }
    if (c.tokens[i] != tok || g.tokens[i] != tok || r.tokens[i] != tok)
      fail_msg("%s: query %d: tokens CPU %d, GPU %d, GPU search + plan %d; its facts have %lld", what, i,
               (int)c.tokens[i], (int)g.tokens[i], (int)r.tokens[i], (long long)tok);
    total += tok;
  }
  uint16_t *d = fetch(w, w->dev), *d2 = fetch(w, w->dev2);
  size_t bad = cache_diff(w, d, w->host, w->c.table_rope);
  if (bad) fail_msg("%s: the device cache differs from the CPU's in %zu elements", what, bad);
  bad = cache_diff(w, d, d2, true);
  if (bad) fail_msg("%s: the device cache differs from search + inject's in %zu elements", what, bad);
  /* every injected token's K and V, all layers and heads, and nothing else */
  const size_t want_written = (size_t)total * L * H * D * 2;
  assert_true(total > 0);
  if (cache_written(w, d) != want_written || cache_written(w, w->host) != want_written)
    fail_msg("%s: %zu elements written on the device, %zu on the CPU; %zu expected", what, cache_written(w, d),
             cache_written(w, w->host), want_written);
  free(d);
  free(d2);
}

/* A round with fresh requests and queries. */
static void retrieve_round(world *w, int32_t k, kvi_memory qm, kvi_memory om, bool zero_query, const char *what) {
  kvi_retrieve_request hreq[NQ], greq[NQ];
  float q[NQ * DIM];
  make_requests(w, hreq, greq);
  make_queries(q, zero_query);
  char label[160];
  snprintf(label, sizeof label, "%s, k %d, queries %s, outputs %s", what, (int)k,
           qm == KVI_MEMORY_DEVICE ? "device" : "host", om == KVI_MEMORY_DEVICE ? "device" : "host");
  compare_call(w, q, hreq, greq, k, qm, om, label);
}

static const cfg cfg_bf16 = {KVI_DTYPE_BF16, KVI_DTYPE_FP16, KVI_CACHE_VLLM_FLASH_ATTN, true, 0};
static const cfg cfg_fp32 = {KVI_DTYPE_FP32, KVI_DTYPE_FP32, KVI_CACHE_VLLM_FLASHINFER_HND, false, 0};
static const cfg cfg_tier = {KVI_DTYPE_BF16, KVI_DTYPE_FP16, KVI_CACHE_VLLM_FLASH_ATTN, true, 8u << 20};

#endif /* KVI_HAVE_CUDA */

/* ---------------------------------------------------------------- tests */

static int setup(void **state) {
  (void)state;
  g_rng = GPU_TEST_SEED; /* each test sees the same stream, whichever run first */
  return 0;
}

/* bf16 store, a cos/sin table: the device path equals the CPU byte for byte,
 * k = 1, 7, 32 and 64 (above tenant 3's five facts and tenant 2's 45), host
 * queries and outputs, a query whose scores all tie. */
static void test_bf16_exact(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  world w;
  make_world(&w, &cfg_bf16);
  const int32_t ks[] = {1, 7, 32, 64};
  for (int i = 0; i < 4; i++) retrieve_round(&w, ks[i], KVI_MEMORY_HOST, KVI_MEMORY_HOST, i == 1, "bf16 table");
  free_world(&w);
#endif
}

/* fp32 store, fp32 embeddings, Llama 3 RoPE, the FlashInfer HND layout:
 * within a unit of bf16 of the CPU (each computes its own cos/sin), equal to
 * search + inject on the device. */
static void test_fp32_llama3(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  world w;
  make_world(&w, &cfg_fp32);
  const int32_t ks[] = {1, 7, 32};
  for (int i = 0; i < 3; i++) retrieve_round(&w, ks[i], KVI_MEMORY_HOST, KVI_MEMORY_HOST, i == 2, "fp32 llama3");
  free_world(&w);
#endif
}

/* Device outputs (the call returns once enqueued), device queries, both. */
static void test_device_memory(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  world w;
  make_world(&w, &cfg_bf16);
  retrieve_round(&w, 7, KVI_MEMORY_HOST, KVI_MEMORY_DEVICE, false, "bf16 table");
  retrieve_round(&w, 32, KVI_MEMORY_DEVICE, KVI_MEMORY_DEVICE, true, "bf16 table");
  retrieve_round(&w, 1, KVI_MEMORY_DEVICE, KVI_MEMORY_HOST, false, "bf16 table");
  retrieve_round(&w, 64, KVI_MEMORY_HOST, KVI_MEMORY_DEVICE, false, "bf16 table");
  free_world(&w);
#endif
}

/* The tenant directories follow the store: random removes (rows move),
 * replaces with other lengths (up to 4 pages: a wider directory), new facts,
 * a tenant emptied, then a 70-token fact (5 pages) in tenants 1 and 2; a
 * retrieve after each batch equals the CPU's. */
static void test_directory_maintenance(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  world w;
  make_world(&w, &cfg_bf16);
  retrieve_round(&w, 32, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "before changes");
  const int32_t ks[] = {7, 32, 64};
  for (int batch = 0; batch < 3; batch++) {
    for (int op = 0; op < 40; op++) {
      const uint64_t tenant = 1 + rnd() % 3;
      const int32_t n = live_count(&w, tenant);
      const int pick = n ? (int)(rnd() % (uint64_t)n) : -1;
      fact_rec *f = NULL;
      for (int i = 0, seen = 0; i < w.nf && pick >= 0; i++)
        if (w.f[i].live && w.f[i].tenant == tenant && seen++ == pick) f = &w.f[i];
      const int kind = (int)(rnd() % 3);
      if (f && kind == 0)
        remove_both(&w, f);
      else if (f && kind == 1)
        put_both(&w, tenant, f->id, rand_len(1, 56), KVI_PUT_REPLACE);
      else
        new_fact(&w, tenant, rand_len(1, 40));
    }
    char what[64];
    snprintf(what, sizeof what, "after %d batches of changes", batch + 1);
    retrieve_round(&w, ks[batch], KVI_MEMORY_HOST, batch == 1 ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST, false, what);
  }
  /* tenant 3 emptied, then one fact again */
  for (int i = 0; i < w.nf; i++)
    if (w.f[i].live && w.f[i].tenant == 3) remove_both(&w, &w.f[i]);
  retrieve_round(&w, 7, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "tenant 3 emptied");
  new_fact(&w, 3, rand_len(1, 40));
  /* longer than any before: 5 pages, the directories re-stride */
  const uint64_t long_t1 = new_fact(&w, 1, LONG), long_t2 = new_fact(&w, 2, LONG);
  retrieve_round(&w, 64, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "70-token facts");
  retrieve_round(&w, 32, KVI_MEMORY_DEVICE, KVI_MEMORY_DEVICE, true, "70-token facts");
  /* the long fact of tenant 2 replaced by a short one, tenant 1's removed:
   * rows move in a 6-word directory */
  put_both(&w, 2, long_t2, 3, KVI_PUT_REPLACE);
  remove_both(&w, find_fact(&w, 1, long_t1));
  for (int i = 0; i < 10; i++) new_fact(&w, 1 + rnd() % 2, rand_len(1, 40));
  retrieve_round(&w, 32, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "after the long facts went");
  retrieve_round(&w, 7, KVI_MEMORY_HOST, KVI_MEMORY_DEVICE, false, "after the long facts went");
  free_world(&w);
#endif
}

#ifdef KVI_HAVE_CUDA
/* Both backends refuse the call (host and device outputs): nothing written
 * to either cache (compared with copies taken before), outputs untouched. */
static void expect_refused(world *w, const float *q, const kvi_retrieve_request *hreq, const kvi_retrieve_request *greq,
                           int32_t k, const char *what) {
  CUDA_OK(cudaStreamSynchronize(w->st));
  uint16_t *before = fetch(w, w->dev), *hbefore = malloc(w->cache_elems * sizeof *hbefore);
  memcpy(hbefore, w->host, w->cache_elems * sizeof *hbefore);
  outs o;
  kvi_status st = cpu_retrieve(w, q, hreq, k, &o);
  if (st != KVI_ERR_INVALID_ARGUMENT)
    fail_msg("%s: the CPU store returned %d (%s)", what, (int)st, kvi_status_string(st));
  assert_true(outs_untouched(&o));
  for (int om = 0; om < 2; om++) {
    st = gpu_retrieve(w, q, greq, k, KVI_MEMORY_HOST, om ? KVI_MEMORY_DEVICE : KVI_MEMORY_HOST, &o);
    if (st != KVI_ERR_INVALID_ARGUMENT)
      fail_msg("%s (%s outputs): the CUDA store returned %d (%s): %s", what, om ? "device" : "host", (int)st,
               kvi_status_string(st), kvi_last_error());
    if (!outs_untouched(&o))
      fail_msg("%s (%s outputs): outputs written by a failed call", what, om ? "device" : "host");
  }
  uint16_t *after = fetch(w, w->dev);
  if (memcmp(before, after, w->cache_elems * sizeof *after)) fail_msg("%s: the device cache changed", what);
  if (memcmp(hbefore, w->host, w->cache_elems * sizeof *hbefore)) fail_msg("%s: the CPU cache changed", what);
  free(before);
  free(after);
  free(hbefore);
}
#endif

/* The reserve: min(k, facts) x the tenant's longest fact from first_slot.
 * One block short fails on both backends (host or device table, the other
 * requests valid), nothing written; exactly enough succeeds and equals the
 * CPU. The longest is the longest the tenant has held: removing its long
 * fact does not shrink the reserve. A request with no facts needs no
 * table. */
static void test_short_table(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  world w;
  make_world(&w, &cfg_bf16);
  const uint64_t long_t2 = new_fact(&w, 2, LONG);
  retrieve_round(&w, 7, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "before the failures"); /* the caches hold something */
  kvi_retrieve_request hreq[NQ], greq[NQ];
  float q[NQ * DIM];
  make_requests(&w, hreq, greq);
  make_queries(q, false);
  int t2 = -1, t77 = -1, t1 = -1;
  for (int i = 0; i < NQ; i++) {
    if (hreq[i].tenant == 2) t2 = i;
    if (hreq[i].tenant == 77) t77 = i;
    if (hreq[i].tenant == 1) t1 = i;
  }
  const int32_t ks[] = {7, 1};
  for (int ki = 0; ki < 2; ki++) {
    const int32_t k = ks[ki];
    const int32_t need = blocks_for(hreq[t2].first_slot, k, LONG);
    assert_true(need <= TBL);
    for (int dev = 0; dev < 2; dev++) { /* tenant 2's table on the host, then on the device */
      kvi_retrieve_request g2 = greq[t2];
      if (dev) {
        greq[t2].block_table = w.dtab + (size_t)t2 * TBL;
        greq[t2].block_table_memory = KVI_MEMORY_DEVICE;
      } else {
        greq[t2].block_table = w.tables[t2];
        greq[t2].block_table_memory = KVI_MEMORY_HOST;
      }
      hreq[t2].block_table_len = greq[t2].block_table_len = need - 1;
      char what[96];
      snprintf(what, sizeof what, "k %d, tenant 2's %s table one block short", (int)k, dev ? "device" : "host");
      expect_refused(&w, q, hreq, greq, k, what);
      greq[t2] = g2;
    }
    /* exactly enough; the unknown tenant with an empty table */
    hreq[t2].block_table_len = greq[t2].block_table_len = need;
    hreq[t77].block_table_len = greq[t77].block_table_len = 0;
    char what[96];
    snprintf(what, sizeof what, "k %d, tables exactly long enough", (int)k);
    compare_call(&w, q, hreq, greq, k, KVI_MEMORY_HOST, KVI_MEMORY_HOST, what);
    hreq[t2].block_table_len = greq[t2].block_table_len = TBL;
    hreq[t77].block_table_len = greq[t77].block_table_len = TBL;
  }
  /* tenant 1: the reserve is k x 40 at most, a table for k x (its longest) works */
  {
    const int32_t k = 32;
    const int32_t need = blocks_for(hreq[t1].first_slot, k, live_longest(&w, 1));
    hreq[t1].block_table_len = greq[t1].block_table_len = need - 1;
    expect_refused(&w, q, hreq, greq, k, "k 32, tenant 1's table one block short");
    hreq[t1].block_table_len = greq[t1].block_table_len = need;
    /* tenant 2 keeps a full table (32 x 70 tokens) */
    compare_call(&w, q, hreq, greq, k, KVI_MEMORY_HOST, KVI_MEMORY_HOST, "k 32, tenant 1's table exactly long enough");
    hreq[t1].block_table_len = greq[t1].block_table_len = TBL;
  }
  /* tenant 2's long fact removed: its reserve is still k x 70 */
  remove_both(&w, find_fact(&w, 2, long_t2));
  {
    const int32_t k = 7, now = live_longest(&w, 2);
    const int32_t enough_now = blocks_for(hreq[t2].first_slot, k, now), need = blocks_for(hreq[t2].first_slot, k, LONG);
    assert_true(enough_now < need);
    hreq[t2].block_table_len = greq[t2].block_table_len = enough_now;
    expect_refused(&w, q, hreq, greq, k, "k 7, tenant 2's table sized for its current longest fact");
    hreq[t2].block_table_len = greq[t2].block_table_len = need;
    compare_call(&w, q, hreq, greq, k, KVI_MEMORY_HOST, KVI_MEMORY_HOST, "k 7, after the long fact went");
  }
  free_world(&w);
#endif
}

/* A tiered CUDA store (the host path: search, then kvi_inject, promoting
 * host-tier facts) equals the CPU with host outputs, host or device
 * queries; device outputs are KVI_ERR_MEMORY_KIND with nothing written. */
static void test_tiered(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  world w;
  make_world(&w, &cfg_tier);
  kvi_store_stats s = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(w.gpu, &s));
  assert_true(s.pages_host_total > 0);
  assert_true(s.pages_host_used > 0); /* some facts live on the host tier */
  retrieve_round(&w, 1, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "tiered");
  retrieve_round(&w, 7, KVI_MEMORY_DEVICE, KVI_MEMORY_HOST, true, "tiered");
  retrieve_round(&w, 7, KVI_MEMORY_HOST, KVI_MEMORY_HOST, false, "tiered");
  CHECK_OK(kvi_store_stats_get(w.gpu, &s));
  assert_true(s.promotions > 0);
  /* device outputs: refused */
  kvi_retrieve_request hreq[NQ], greq[NQ];
  float q[NQ * DIM];
  make_requests(&w, hreq, greq);
  make_queries(q, false);
  uint16_t *before = fetch(&w, w.dev);
  outs o;
  const kvi_status st = gpu_retrieve(&w, q, greq, 7, KVI_MEMORY_HOST, KVI_MEMORY_DEVICE, &o);
  if (st != KVI_ERR_MEMORY_KIND)
    fail_msg("tiered store, device outputs: %d (%s): %s", (int)st, kvi_status_string(st), kvi_last_error());
  assert_true(outs_untouched(&o));
  uint16_t *after = fetch(&w, w.dev);
  assert_memory_equal(before, after, w.cache_elems * sizeof *after);
  free(before);
  free(after);
  expect_no_async_errors(&w);
  free_world(&w);
#endif
}

/* kvi_inject_batched with device fact ids (looked up and planned on the
 * device) against the same batch with host ids: byte for byte the same
 * device cache, and the CPU store's (a cos/sin table: exact). Rows of KP ids
 * padded with KVI_SEARCH_NO_ID (skipped, uncounted), an id the tenant does
 * not hold (skipped, counted by kvi_injector_async_errors), tenants without
 * facts; then the search -> inject chain: kvi_store_search into device
 * outputs and kvi_inject_batched of its ids, equal to kvi_retrieve_inject;
 * and the refusals (per-token positions, a tiered store). */
static void test_batched_device_ids(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  enum { KP = 12 };
  world w;
  make_world(&w, &cfg_bf16);
  kvi_retrieve_request hreq[NQ], greq[NQ];
  for (int round = 0; round < 3; round++) {
    make_requests(&w, hreq, greq);
    poison(&w);
    /* each request: up to KP - 2 live facts of its tenant (repeats allowed), NO_ID padding, one unknown id */
    static uint64_t pad[NQ * KP], hid[NQ * KP];
    int32_t poff[NQ + 1], hoff[NQ + 1], starts[NQ], want_tokens[NQ];
    int64_t first[NQ];
    int64_t unknown = 0;
    poff[0] = hoff[0] = 0;
    int32_t nh = 0;
    for (int r = 0; r < NQ; r++) {
      const uint64_t t = hreq[r].tenant;
      const int32_t live = live_count(&w, t);
      int32_t n = live ? (int32_t)(rnd() % (KP - 1)) : 0, j = 0;
      want_tokens[r] = 0;
      for (int32_t f = 0; f < n; f++) {
        int32_t pick = (int32_t)(rnd() % (uint64_t)live), seen = -1;
        for (int i = 0; i < w.nf; i++)
          if (w.f[i].live && w.f[i].tenant == t && ++seen == pick) {
            pad[r * KP + j++] = w.f[i].id;
            hid[nh++] = w.f[i].id;
            want_tokens[r] += w.f[i].tokens;
            break;
          }
        if (f == 1) pad[r * KP + j++] = KVI_SEARCH_NO_ID; /* a gap inside the row */
      }
      if (live && round == 1 && r % 2 == 0) pad[r * KP + j++] = 999999999, unknown++; /* not the tenant's */
      while (j < KP) pad[r * KP + j++] = KVI_SEARCH_NO_ID;
      poff[r + 1] = (r + 1) * KP;
      hoff[r + 1] = nh;
      first[r] = hreq[r].first_slot;
      starts[r] = hreq[r].start_position;
    }
    uint64_t tn[NQ];
    for (int r = 0; r < NQ; r++) tn[r] = hreq[r].tenant;
    uint64_t *d_ids;
    int32_t *d_tok;
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof pad));
    CUDA_OK(cudaMalloc((void **)&d_tok, NQ * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(d_ids, pad, sizeof pad, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemset(d_tok, 0x5a, NQ * sizeof(int32_t)));
    CUDA_OK(cudaDeviceSynchronize());
    kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
    b.num_requests = NQ, b.tenants = tn, b.first_slots = first, b.start_positions = starts;
    b.block_tables = w.dtab, b.block_tables_memory = KVI_MEMORY_DEVICE, b.block_table_stride = TBL,
    b.block_table_len = TBL;
    kvi_inject_batch dv = b, hb = b;
    dv.fact_ids = d_ids, dv.fact_ids_memory = KVI_MEMORY_DEVICE, dv.fact_offsets = poff, dv.out_tokens = d_tok;
    CHECK_OK(kvi_inject_batched(w.di, &dv, NULL, (struct CUstream_st *)w.st));
    hb.fact_ids = hid, hb.fact_offsets = hoff;
    CHECK_OK(kvi_inject_batched(w.dref, &hb, NULL, (struct CUstream_st *)w.st));
    kvi_inject_batch cb = hb; /* the CPU store: host tables */
    cb.block_tables = &w.tables[0][0], cb.block_tables_memory = KVI_MEMORY_HOST;
    int32_t ctok[NQ];
    cb.out_tokens = ctok;
    CHECK_OK(kvi_inject_batched(w.hi, &cb, NULL, NULL));
    CUDA_OK(cudaStreamSynchronize(w.st));
    int32_t got_tok[NQ];
    CUDA_OK(cudaMemcpy(got_tok, d_tok, sizeof got_tok, cudaMemcpyDeviceToHost));
    for (int r = 0; r < NQ; r++) {
      if (got_tok[r] != want_tokens[r] || ctok[r] != want_tokens[r])
        fail_msg("round %d request %d: %d tokens on the device, %d on the CPU, want %d", round, r, got_tok[r], ctok[r],
                 want_tokens[r]);
    }
    uint16_t *a = fetch(&w, w.dev), *bb = fetch(&w, w.dev2);
    size_t bad = cache_diff(&w, a, bb, true), badc = cache_diff(&w, a, w.host, true);
    if (bad || badc || cache_written(&w, a) == 0)
      fail_msg("round %d: device ids differ from host ids in %zu elements, from the CPU in %zu (%zu written)", round,
               bad, badc, cache_written(&w, a));
    free(a);
    free(bb);
    int64_t skipped = -1, sref = -1;
    CHECK_OK(kvi_injector_async_errors(w.di, &skipped));
    CHECK_OK(kvi_injector_async_errors(w.dref, &sref));
    if (skipped != unknown || sref != 0)
      fail_msg("round %d: %lld skipped with device ids (want %lld), %lld with host ids", round, (long long)skipped,
               (long long)unknown, (long long)sref);
    /* per-token positions with device ids: refused, nothing written */
    int32_t pos[4] = {0, 1, 2, 3};
    kvi_inject_batch bad_b = dv;
    bad_b.start_positions = NULL, bad_b.positions = pos;
    uint16_t *before = fetch(&w, w.dev);
    assert_int_equal(kvi_inject_batched(w.di, &bad_b, NULL, (struct CUstream_st *)w.st), KVI_ERR_UNSUPPORTED);
    /* too small a reserve: a 1-block table for request 0 */
    bad_b = dv;
    bad_b.block_table_len = 1;
    const kvi_status st = kvi_inject_batched(w.di, &bad_b, NULL, (struct CUstream_st *)w.st);
    CUDA_OK(cudaStreamSynchronize(w.st));
    uint16_t *after = fetch(&w, w.dev);
    assert_memory_equal(before, after, w.cache_elems * sizeof *after);
    free(before);
    free(after);
    bool any = false;
    for (int r = 0; r < NQ; r++) any = any || (poff[r + 1] > poff[r] && live_count(&w, tn[r]) > 0);
    if (any && st != KVI_ERR_INVALID_ARGUMENT)
      fail_msg("round %d: a 1-block reserve gave %d (%s)", round, (int)st, kvi_status_string(st));
    cudaFree(d_ids);
    cudaFree(d_tok);
  }

  /* search -> inject with device ids: the same cache as kvi_retrieve_inject */
  for (int round = 0; round < 2; round++) {
    const int32_t k = round ? 32 : 7;
    make_requests(&w, hreq, greq);
    for (int r = 0; r < NQ; r++) greq[r].flags = 0, greq[r].block_table = w.dtab + (size_t)r * TBL,
                                 greq[r].block_table_memory = KVI_MEMORY_DEVICE;
    poison(&w);
    float q[NQ * DIM];
    make_queries(q, false);
    float *dq;
    uint64_t *di;
    float *dsc;
    int32_t *dc, *dt, *dt2;
    uint64_t *ri;
    int32_t *rc;
    CUDA_OK(cudaMalloc((void **)&dq, sizeof q));
    CUDA_OK(cudaMalloc((void **)&di, (size_t)NQ * k * sizeof(uint64_t)));
    CUDA_OK(cudaMalloc((void **)&ri, (size_t)NQ * k * sizeof(uint64_t)));
    CUDA_OK(cudaMalloc((void **)&dsc, (size_t)NQ * k * sizeof(float)));
    CUDA_OK(cudaMalloc((void **)&dc, NQ * sizeof(int32_t)));
    CUDA_OK(cudaMalloc((void **)&rc, NQ * sizeof(int32_t)));
    CUDA_OK(cudaMalloc((void **)&dt, NQ * sizeof(int32_t)));
    CUDA_OK(cudaMalloc((void **)&dt2, NQ * sizeof(int32_t)));
    CUDA_OK(cudaMemcpy(dq, q, sizeof q, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
    uint64_t tn[NQ];
    int32_t offs[NQ + 1], starts[NQ];
    int64_t first[NQ];
    for (int r = 0; r < NQ; r++)
      tn[r] = greq[r].tenant, offs[r] = r * k, starts[r] = greq[r].start_position, first[r] = greq[r].first_slot;
    offs[NQ] = NQ * k;
    kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
    so.query_memory = so.out_memory = KVI_MEMORY_DEVICE;
    CHECK_OK(kvi_store_search(w.gpu, dq, NQ, DIM, tn, k, di, dsc, dc, &so, (struct CUstream_st *)w.st));
    kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
    b.num_requests = NQ, b.tenants = tn, b.fact_ids = di, b.fact_ids_memory = KVI_MEMORY_DEVICE, b.fact_offsets = offs;
    b.block_tables = w.dtab, b.block_tables_memory = KVI_MEMORY_DEVICE, b.block_table_stride = TBL,
    b.block_table_len = TBL, b.first_slots = first, b.start_positions = starts, b.out_tokens = dt;
    CHECK_OK(kvi_inject_batched(w.di, &b, NULL, (struct CUstream_st *)w.st));
    kvi_injector *ri_inj = w.dref;
    CHECK_OK(kvi_retrieve_inject(ri_inj, dq, NQ, DIM, greq, k, &so, ri, rc, dt2, (struct CUstream_st *)w.st));
    CUDA_OK(cudaStreamSynchronize(w.st));
    int32_t t1[NQ], t2[NQ];
    CUDA_OK(cudaMemcpy(t1, dt, sizeof t1, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(t2, dt2, sizeof t2, cudaMemcpyDeviceToHost));
    assert_memory_equal(t1, t2, sizeof t1);
    uint16_t *a = fetch(&w, w.dev), *bb = fetch(&w, w.dev2);
    const size_t bad = cache_diff(&w, a, bb, true);
    if (bad) fail_msg("search -> inject k %d: %zu elements differ from kvi_retrieve_inject", (int)k, bad);
    free(a);
    free(bb);
    cudaFree(dq), cudaFree(di), cudaFree(ri), cudaFree(dsc), cudaFree(dc), cudaFree(rc), cudaFree(dt), cudaFree(dt2);
  }
  expect_no_async_errors(&w);
  free_world(&w);

  /* a tiered store: device ids refused */
  make_world(&w, &cfg_tier);
  uint64_t *d_ids;
  CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(uint64_t)));
  CUDA_OK(cudaMemset(d_ids, 0xff, sizeof(uint64_t)));
  const int32_t off[2] = {0, 1};
  kvi_inject_batch tb = KVI_INJECT_BATCH_INIT;
  tb.num_requests = 1, tb.tenant = 1, tb.fact_ids = d_ids, tb.fact_ids_memory = KVI_MEMORY_DEVICE, tb.fact_offsets = off;
  tb.block_tables = w.dtab, tb.block_tables_memory = KVI_MEMORY_DEVICE, tb.block_table_stride = TBL,
  tb.block_table_len = TBL;
  assert_int_equal(kvi_inject_batched(w.di, &tb, NULL, (struct CUstream_st *)w.st), KVI_ERR_UNSUPPORTED);
  cudaFree(d_ids);
  free_world(&w);
#endif
}

/* Device fact ids at the planner's edges, against host ids into a second
 * cache (byte for byte): a tenant of WT facts (more rows than one pass of
 * the lookup's loads), a request of 300 ids (more than one chunk of the
 * lookup's hash table) with repeats, NO_ID gaps and ids the tenant does not
 * hold, then the same ids spread over WN requests (a plan too large for the
 * kernel's parameters: uploaded) and over 2 (inline). */
static void test_device_ids_wide(void **state) {
  (void)state;
  REQUIRE_GPU();
#ifdef KVI_HAVE_CUDA
  enum { WT = 1300, WK = 300, WN = 160, WTBL = 64, WNB = WN * WTBL, WFT = 3 };
  kvi_model *model;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  CHECK_OK(kvi_model_create(&model, &mo));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.theta = 10000;
  CHECK_OK(kvi_model_set_rope(model, -1, &rs));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA, so.device = 0, so.page_tokens = P, so.embedding_dim = DIM;
  so.budget_bytes = (uint64_t)(WT + 16) * L * 2 * H * D * P * 2;
  kvi_store *s;
  CHECK_OK(kvi_store_create(&s, model, &so));
  static uint64_t ids[WT];
  static int32_t ntok[WT];
  for (int f = 0; f < WT; f++) {
    ids[f] = 50000 + 3 * (uint64_t)f;
    ntok[f] = rand_len(1, WFT);
    const size_t n = (size_t)L * ntok[f] * H * D;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v), e[DIM];
    for (size_t i = 0; i < n; i++) k[i] = rndf(), v[i] = rndf();
    rand_ints(e, DIM, -4, 4);
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, ntok[f], H, D, k, v);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.embedding = e;
    CHECK_OK(kvi_store_put(s, 9, ids[f], &kv, &po, NULL));
    free(k);
    free(v);
  }
  const size_t elems = (size_t)L * 2 * WNB * BS * H * D, bytes = elems * sizeof(uint16_t);
  uint16_t *dcache[2];
  kvi_injector *inj[2];
  for (int c = 0; c < 2; c++) {
    CUDA_OK(cudaMalloc((void **)&dcache[c], bytes));
    void *layers[L];
    for (int l = 0; l < L; l++) layers[l] = dcache[c] + (size_t)l * (elems / L);
    kvi_cache_layout cl;
    CHECK_OK(kvi_cache_layout_preset(&cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_BF16, L, H, D, BS, WNB, layers, NULL,
                                     NULL));
    cl.memory = KVI_MEMORY_DEVICE;
    CHECK_OK(kvi_injector_create(&inj[c], s, &cl, NULL));
  }
  static int32_t tab[WN * WTBL];
  for (int i = 0; i < WN * WTBL; i++) tab[i] = (int32_t)((i * 7919) % WNB); /* a permutation: 7919 is prime */
  int32_t *dtab;
  CUDA_OK(cudaMalloc((void **)&dtab, sizeof tab));
  CUDA_OK(cudaMemcpy(dtab, tab, sizeof tab, cudaMemcpyHostToDevice));
  /* the 300 ids: tenant rows (repeats allowed), every 37th NO_ID, every 53rd not the tenant's */
  static uint64_t want[WK], host_ids[WK];
  int64_t unknown = 0;
  for (int i = 0; i < WK; i++) {
    if (i % 37 == 5) want[i] = KVI_SEARCH_NO_ID;
    else if (i % 53 == 7) want[i] = 1 + (uint64_t)i, unknown++;
    else want[i] = ids[rnd() % WT];
  }
  want[11] = want[12] = ids[WT - 1]; /* the last row, twice */
  int32_t nh = 0; /* the host ids: the same facts in the same order, without the gaps */
  for (int i = 0; i < WK; i++)
    if (want[i] != KVI_SEARCH_NO_ID && !(i % 53 == 7)) host_ids[nh++] = want[i];
  uint64_t *dids;
  CUDA_OK(cudaMalloc((void **)&dids, sizeof want));
  CUDA_OK(cudaMemcpy(dids, want, sizeof want, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int splits[3] = {1, WN, 2}; /* requests the 300 ids are spread over */
  for (int sp = 0; sp < 3; sp++) {
    const int nreq = splits[sp];
    static int32_t doff[WN + 1], hoff[WN + 1], starts[WN];
    static int64_t first[WN];
    int32_t h = 0;
    for (int r = 0; r <= nreq; r++) {
      doff[r] = (int32_t)((int64_t)WK * r / nreq);
      if (r == 0) {
        hoff[0] = 0;
        continue;
      }
      for (int i = doff[r - 1]; i < doff[r]; i++) h += want[i] != KVI_SEARCH_NO_ID && !(i % 53 == 7);
      hoff[r] = h;
      first[r - 1] = r % 5, starts[r - 1] = 100 * r + 3;
    }
    for (int c = 0; c < 2; c++) CUDA_OK(cudaMemset(dcache[c], 0x7f, bytes));
    CUDA_OK(cudaDeviceSynchronize());
    kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
    b.num_requests = nreq, b.tenant = 9, b.first_slots = first, b.start_positions = starts;
    b.block_tables = dtab, b.block_tables_memory = KVI_MEMORY_DEVICE, b.block_table_stride = WTBL,
    b.block_table_len = WTBL;
    kvi_inject_batch dv = b, hb = b;
    dv.fact_ids = dids, dv.fact_ids_memory = KVI_MEMORY_DEVICE, dv.fact_offsets = doff;
    hb.fact_ids = host_ids, hb.fact_offsets = hoff;
    CHECK_OK(kvi_inject_batched(inj[0], &dv, NULL, (struct CUstream_st *)st));
    CHECK_OK(kvi_inject_batched(inj[1], &hb, NULL, (struct CUstream_st *)st));
    CUDA_OK(cudaStreamSynchronize(st));
    uint16_t *a = malloc(bytes), *bb = malloc(bytes);
    CUDA_OK(cudaMemcpy(a, dcache[0], bytes, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(bb, dcache[1], bytes, cudaMemcpyDeviceToHost));
    size_t bad = 0, written = 0;
    for (size_t i = 0; i < elems; i++) bad += a[i] != bb[i], written += a[i] != 0x7f7f;
    int64_t skipped = -1, sref = -1;
    CHECK_OK(kvi_injector_async_errors(inj[0], &skipped));
    CHECK_OK(kvi_injector_async_errors(inj[1], &sref));
    if (bad || written == 0 || skipped != unknown || sref != 0)
      fail_msg("%d requests: %zu of %zu written elements differ from host ids; %lld skipped (want %lld), %lld with "
               "host ids", nreq, bad, written, (long long)skipped, (long long)unknown, (long long)sref);
    free(a);
    free(bb);
  }
  cudaStreamDestroy(st);
  cudaFree(dids);
  cudaFree(dtab);
  for (int c = 0; c < 2; c++) {
    kvi_injector_destroy(inj[c]);
    cudaFree(dcache[c]);
  }
  kvi_store_destroy(s);
  kvi_model_destroy(model);
#endif
}

int main(void) {
  if (kvi_cuda_device_count(&g_devices) != KVI_OK) g_devices = 0;
  g_retrieve = g_devices > 0 && (kvi_features() & KVI_FEATURE_CUBLASLT);
  if (!g_retrieve)
    fprintf(stderr, "gpu-retrieve suite: no CUDA device or no cuBLASLt in this build (%s); every test skips\n",
            kvi_last_error());
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_bf16_exact, setup),
      cmocka_unit_test_setup(test_fp32_llama3, setup),
      cmocka_unit_test_setup(test_device_memory, setup),
      cmocka_unit_test_setup(test_directory_maintenance, setup),
      cmocka_unit_test_setup(test_short_table, setup),
      cmocka_unit_test_setup(test_tiered, setup),
      cmocka_unit_test_setup(test_batched_device_ids, setup),
      cmocka_unit_test_setup(test_device_ids_wide, setup),
  };
  int failed = cmocka_run_group_tests_name("gpu-retrieve", tests, NULL, NULL);
  if (failed) return 1;
  return g_retrieve ? 0 : 77;
}
