/*
 * gpu suite: injection and capture through the CUDA backend compared with
 * the CPU backend (the reference) on the same facts, layouts, dtypes and
 * RoPE variants. Caches are poisoned first, so an unwritten element (or one
 * written out of place) shows up. Skips, and exits 77, with no device.
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE /* mkdtemp */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#define GPU_TEST_SEED 0x243f6a8885a308d3ull
#include "gpu_test.h"

static int g_devices;

#ifdef KVI_HAVE_CUDA

/* One scenario: a model, a CPU and a CUDA store holding the same facts, and
 * the same cache layout in host and device memory. */
typedef struct scen {
  int32_t L, H, D, BS, NB, T, nfacts;
  kvi_dtype store_dtype, cache_dtype;
  kvi_cache_preset preset;
  int rope; /* 0 llama3 NeoX, 1 GPT-J partial + NoPE layer, 2 cos/sin table, 3 YaRN partial (scalar path) */
  kvi_scale_mode scales;
} scen;

/* Hand-made layouts (not presets), as scen.preset values. */
enum {
  GPU_TRANSPOSED_V = 101, /* per layer K [cells][H][D] and V [H][D][cells] tensors, cells = NB * BS (llama.cpp's
                             state with flash attention off): V token stride 1, V dim stride cells */
  GPU_MIXED_PLANES = 102  /* per layer K [NB][BS][H][D] and V [NB][H][BS][D]: contiguous head vectors, V's own
                             token and head strides (the vector paths with V's own offsets) */
};

typedef struct world {
  scen sc;
  kvi_model *model;
  kvi_store *cpu, *gpu;
  size_t layer_bytes; /* bytes of one per-layer tensor (or the pool) */
  int ntensors;       /* tensors: per layer (1 or 2 each) or 1 pool */
  void *host[64], *dev[64];
  kvi_cache_layout hl, dl;
  float kscale[256], vscale[256];
  float *table;
} world;

static void set_rope(world *w) {
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  switch (w->sc.rope) {
  case 0:
    r.theta = 500000;
    r.scaling = KVI_ROPE_SCALING_LLAMA3;
    r.factor = 8;
    CHECK_OK(kvi_model_set_rope(w->model, -1, &r));
    break;
  case 1:
    r.style = KVI_ROPE_GPTJ;
    r.rotary_dim = w->sc.D / 2;
    CHECK_OK(kvi_model_set_rope(w->model, -1, &r));
    r.style = KVI_ROPE_NONE;
    CHECK_OK(kvi_model_set_rope(w->model, 1, &r));
    break;
  case 2: {
    const int32_t rot = w->sc.D, npos = 4096;
    w->table = rope_table_f32(npos, rot, 1e6);
    r.cos_sin_table = w->table;
    r.table_positions = npos;
    CHECK_OK(kvi_model_set_rope(w->model, -1, &r));
    break;
  }
  case 3:
    r.scaling = KVI_ROPE_SCALING_YARN;
    r.factor = 4;
    r.original_max_position = 2048;
    r.rotary_dim = w->sc.D - 8;
    CHECK_OK(kvi_model_set_rope(w->model, -1, &r));
    break;
  }
}

/* Tier tests: the CUDA store's device budget (0: 64 MiB) and host budget. */
static uint64_t g_dev_budget, g_host_budget;
static int32_t g_emb_dim; /* make_world: stores keeping embeddings of this size (0: none) */

static void custom_layout(kvi_cache_layout *l, const scen *sc, void *const *k, void *const *v) {
  const int64_t H = sc->H, D = sc->D, BS = sc->BS, cells = (int64_t)sc->NB * BS;
  kvi_cache_layout_init(l, sizeof *l);
  l->dtype = sc->cache_dtype;
  l->num_layers = sc->L, l->num_heads = sc->H, l->head_size = sc->D, l->block_size = sc->BS, l->num_blocks = sc->NB;
  l->k_layers = k, l->v_layers = v;
  l->block_stride = BS * H * D, l->token_stride = H * D, l->head_stride = D; /* K [NB][BS][H][D] */
  if ((int)sc->preset == GPU_TRANSPOSED_V) {
    l->v_block_stride = BS, l->v_token_stride = 1, l->v_head_stride = D * cells, l->v_dim_stride = cells;
  } else {
    l->v_token_stride = D, l->v_head_stride = BS * D; /* V [NB][H][BS][D] */
  }
}

static void make_world(world *w, const scen *sc) {
  memset(w, 0, sizeof *w);
  w->sc = *sc;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = sc->L;
  mo.num_kv_heads = sc->H;
  mo.head_size = sc->D;
  CHECK_OK(kvi_model_create(&w->model, &mo));
  set_rope(w);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.dtype = sc->store_dtype;
  /* fp8 stores: pages of 64 tokens, so that a page is several capture
   * segments (CTAs) whose amax meets in the page's scale slots */
  so.page_tokens = sc->store_dtype == KVI_DTYPE_FP8_E4M3 || sc->store_dtype == KVI_DTYPE_Q4 ? 64 : 16;
  so.budget_bytes = 64u << 20;
  so.embedding_dim = g_emb_dim;
  so.backend = KVI_BACKEND_CPU;
  CHECK_OK(kvi_store_create(&w->cpu, w->model, &so));
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  if (g_dev_budget) so.budget_bytes = g_dev_budget;
  so.host_budget_bytes = g_host_budget;
  CHECK_OK(kvi_store_create(&w->gpu, w->model, &so));
  /* facts: same host data into both stores */
  for (int32_t f = 0; f < sc->nfacts; f++) {
    const int32_t T = sc->T + f % 3;
    size_t n = (size_t)sc->L * T * sc->H * sc->D;
    float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v);
    for (size_t i = 0; i < n; i++) k[i] = rndf(), v[i] = rndf();
    kvi_kv_view kv;
    kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc->L, T, sc->H, sc->D, k, v);
    CHECK_OK(kvi_store_put(w->cpu, 1, 100 + (uint64_t)f, &kv, NULL, NULL));
    CHECK_OK(kvi_store_put(w->gpu, 1, 100 + (uint64_t)f, &kv, NULL, NULL));
    free(k);
    free(v);
  }
  /* cache tensors, poisoned with 0xFF bytes (NaN in every float type) */
  const size_t es = kvi_dtype_size(sc->cache_dtype);
  const size_t HBD = (size_t)sc->H * sc->BS * sc->D * (size_t)sc->NB;
  const bool custom = (int)sc->preset >= GPU_TRANSPOSED_V;
  bool pool = sc->preset == KVI_CACHE_TRTLLM,
       separate = sc->preset == KVI_CACHE_SGLANG || sc->preset == KVI_CACHE_HF_CONTIGUOUS || custom;
  w->layer_bytes = pool ? HBD * 2 * sc->L * es : separate ? HBD * es : HBD * 2 * es;
  w->ntensors = pool ? 1 : separate ? 2 * sc->L : sc->L;
  for (int i = 0; i < w->ntensors; i++) {
    w->host[i] = malloc(w->layer_bytes);
    memset(w->host[i], 0xFF, w->layer_bytes);
    CUDA_OK(cudaMalloc(&w->dev[i], w->layer_bytes));
    CUDA_OK(cudaMemset(w->dev[i], 0xFF, w->layer_bytes));
  }
  void *const *hk = w->host, *const *dk = w->dev;
  void *const *hv = separate ? w->host + sc->L : NULL, *const *dv = separate ? w->dev + sc->L : NULL;
  if (custom) {
    custom_layout(&w->hl, sc, hk, hv);
    custom_layout(&w->dl, sc, dk, dv);
  } else {
    CHECK_OK(kvi_cache_layout_preset(&w->hl, sc->preset, sc->cache_dtype, sc->L, sc->H, sc->D, sc->BS, sc->NB,
                                     pool ? NULL : hk, hv, pool ? w->host[0] : NULL));
    CHECK_OK(kvi_cache_layout_preset(&w->dl, sc->preset, sc->cache_dtype, sc->L, sc->H, sc->D, sc->BS, sc->NB,
                                     pool ? NULL : dk, dv, pool ? w->dev[0] : NULL));
  }
  w->hl.memory = KVI_MEMORY_HOST;
  w->dl.memory = KVI_MEMORY_DEVICE;
  if (sc->scales != KVI_SCALE_NONE) {
    for (int i = 0; i < sc->L * sc->H; i++) w->kscale[i] = 0.01f + 0.003f * i, w->vscale[i] = 0.02f + 0.001f * i;
    w->hl.scale_mode = w->dl.scale_mode = sc->scales;
    w->hl.k_scales = w->dl.k_scales = w->kscale;
    w->hl.v_scales = w->dl.v_scales = w->vscale;
  }
}

static void free_world(world *w) {
  kvi_store_destroy(w->cpu);
  kvi_store_destroy(w->gpu);
  kvi_model_destroy(w->model);
  for (int i = 0; i < w->ntensors; i++) {
    free(w->host[i]);
    cudaFree(w->dev[i]);
  }
  free(w->table);
}

/* Compares the device cache with the host one: bytes equal, or (exact=false)
 * floats within rel_tol (NaN poison must match exactly). Returns mismatches. */
static float u2f_(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static float f16_to_f32_(uint16_t b) {
  __extension__ _Float16 h;
  memcpy(&h, &b, 2);
  return (float)h;
}

static size_t compare_caches(const world *w, bool exact, double rel_tol, double *worst) {
  size_t bad = 0;
  *worst = 0;
  unsigned char *d = malloc(w->layer_bytes);
  for (int i = 0; i < w->ntensors; i++) {
    CUDA_OK(cudaMemcpy(d, w->dev[i], w->layer_bytes, cudaMemcpyDeviceToHost));
    const unsigned char *h = w->host[i];
    const kvi_dtype t = w->sc.cache_dtype;
    const size_t es = kvi_dtype_size(t), n = w->layer_bytes / es;
    for (size_t e = 0; e < n; e++) {
      if (!memcmp(d + e * es, h + e * es, es)) continue;
      if (exact || t == KVI_DTYPE_FP8_E4M3 || t == KVI_DTYPE_FP8_E5M2) {
        /* fp8: one step of the 8-bit grid is the only allowed difference */
        if (!exact && abs((int)d[e] - (int)h[e]) == 1 && ((d[e] ^ h[e]) & 0x80) == 0) continue;
        bad++;
        continue;
      }
      double a, b;
      if (t == KVI_DTYPE_FP32) {
        float x, y;
        memcpy(&x, d + e * 4, 4);
        memcpy(&y, h + e * 4, 4);
        a = x, b = y;
      } else { /* 16-bit: one unit in the last place, or the fp32 rotation's error */
        uint16_t x, y;
        memcpy(&x, d + e * 2, 2);
        memcpy(&y, h + e * 2, 2);
        if (abs((int)x - (int)y) == 1 && ((x ^ y) & 0x8000) == 0) continue;
        /* Both backends rotate in fp32 and round once; their cos/sin differ
         * by an ulp or two, so before rounding the results differ by at most
         * ~1e-6 (|x|, |y| < 2). Near zero (x cos - y sin cancelling) that is
         * several 16-bit ulps: allow it, plus the two roundings' half ulps. */
        const float fx = t == KVI_DTYPE_BF16 ? u2f_((uint32_t)x << 16) : f16_to_f32_(x);
        const float fy = t == KVI_DTYPE_BF16 ? u2f_((uint32_t)y << 16) : f16_to_f32_(y);
        const double ulp = fabs((double)fy) * (t == KVI_DTYPE_BF16 ? 0x1p-7 : 0x1p-10);
        if (!exact && isfinite(fx) && isfinite(fy) && fabs((double)fx - fy) <= 2e-6 + ulp) {
          static int shown;
          if (shown++ < 3)
            fprintf(stderr, "  within the fp32 rotation's error: tensor %d element %zu, device %a, host %a\n", i, e,
                    (double)fx, (double)fy);
          continue;
        }
        if (bad < 5)
          fprintf(stderr, "  tensor %d element %zu: device %a (0x%04x), host %a (0x%04x)\n", i, e, (double)fx, x,
                  (double)fy, y);
        bad++;
        continue;
      }
      if (isnan(a) || isnan(b)) {
        bad++;
        continue;
      }
      /* fp32 cos/sin differ by an ulp or two (GPU sincosf, CPU double), and
       * x cos - y sin can cancel: bound the error by the inputs' size (|x|,
       * |y| < 2 here, scaled by fp8-free caches only) */
      double r = fabs(a - b) / fmax(fabs(b), 1e-3);
      if (r > *worst) *worst = r;
      if (fabs(a - b) > rel_tol * fabs(b) + 8 * rel_tol) bad++;
    }
  }
  free(d);
  return bad;
}

/* fp8 and 4-bit stores: a put from device memory (the quantizing kernel)
 * and reads into device memory (the dequantizing one) equal the CPU store's
 * bit for bit: same key offsets, amax and fp32 scale, same e4m3 bytes (keys
 * carry a channel of bias 300, which the offsets take out); same bounds,
 * fp16 words and codes. */
static void check_device_copies(const world *w) {
  const scen *sc = &w->sc;
  const int32_t T = 2 * sc->T + 5; /* pages of 64 tokens: a partial one */
  const size_t n = (size_t)sc->L * T * sc->H * sc->D;
  float *k = malloc(n * sizeof *k), *v = malloc(n * sizeof *v), *a = malloc(2 * n * 4), *b = malloc(2 * n * 4);
  for (size_t i = 0; i < n; i++)
    k[i] = rndf() * (i % 13 == 5 ? 37.0f : 1.0f) + (i % (size_t)sc->D == 3 ? 300.0f : 0.0f), v[i] = rndf();
  k[7] = 0x1p-140f; /* a subnormal among normals */
  for (size_t i = 0; i < (size_t)sc->D * 64; i++) v[n - 1 - i] = 0.0f; /* a zero group or more */
  float *dk, *dv, *dout;
  CUDA_OK(cudaMalloc((void **)&dk, n * 4));
  CUDA_OK(cudaMalloc((void **)&dv, n * 4));
  CUDA_OK(cudaMalloc((void **)&dout, 2 * n * 4));
  CUDA_OK(cudaMemcpy(dk, k, n * 4, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv, v, n * 4, cudaMemcpyHostToDevice));
  kvi_kv_view hv, dvw;
  kvi_kv_view_contiguous(&hv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc->L, T, sc->H, sc->D, k, v);
  kvi_kv_view_contiguous(&dvw, KVI_MEMORY_DEVICE, KVI_DTYPE_FP32, sc->L, T, sc->H, sc->D, dk, dv);
  CHECK_OK(kvi_store_put(w->cpu, 3, 1, &hv, NULL, NULL));
  CHECK_OK(kvi_store_put(w->gpu, 3, 1, &dvw, NULL, NULL));
  /* the same bytes: e4m3 bytes, scales and key offsets (q4: codes and words) */
  expect_same_bytes(w->cpu, w->gpu, 3, 1, sc->store_dtype, sc->L, sc->H, sc->D, 64, g_emb_dim);
  kvi_kv_view ra, rb;
  kvi_kv_view_contiguous(&ra, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc->L, T, sc->H, sc->D, a, a + n);
  kvi_kv_view_contiguous(&rb, KVI_MEMORY_DEVICE, KVI_DTYPE_FP32, sc->L, T, sc->H, sc->D, dout, dout + n);
  CHECK_OK(kvi_store_read(w->cpu, 3, 1, &ra, NULL));
  CHECK_OK(kvi_store_read(w->gpu, 3, 1, &rb, NULL));
  CUDA_OK(cudaMemcpy(b, dout, 2 * n * 4, cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < 2 * n; i++) bad += memcmp(&a[i], &b[i], 4) != 0;
  if (bad) fail_msg("quantized store: device put + device read differ from the CPU store in %zu of %zu elements", bad, 2 * n);
  /* and a host read of the device-put fact (staging path) */
  kvi_kv_view_contiguous(&rb, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc->L, T, sc->H, sc->D, b, b + n);
  CHECK_OK(kvi_store_read(w->gpu, 3, 1, &rb, NULL));
  if (memcmp(a, b, 2 * n * 4)) fail_msg("quantized store: host read of a device put differs from the CPU store");
  CHECK_OK(kvi_store_remove(w->cpu, 3, 1));
  CHECK_OK(kvi_store_remove(w->gpu, 3, 1));
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  free(k);
  free(v);
  free(a);
  free(b);
}

/* Injects the same batch into both caches and compares. */
static void run_inject(const scen *sc) {
  world w;
  make_world(&w, sc);
  if (sc->store_dtype == KVI_DTYPE_FP8_E4M3 || sc->store_dtype == KVI_DTYPE_Q4) check_device_copies(&w);
  kvi_injector *hi, *di;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  /* three requests: shuffled block tables, first slots mid-block, explicit
   * and default positions; one with a device block table */
  enum { R = 3 };
  enum { TL = 512 };
  static int32_t tables[R][TL];
  int32_t *dtable;
  /* each request owns a third of the blocks, visited in descending order */
  const int32_t third = sc->NB / 3;
  for (int r = 0; r < R; r++)
    for (int b = 0; b < TL; b++) tables[r][b] = r * third + (third - 1 - b % third);
  CUDA_OK(cudaMalloc((void **)&dtable, sizeof tables[2]));
  CUDA_OK(cudaMemcpy(dtable, tables[2], sizeof tables[2], cudaMemcpyHostToDevice));
  uint64_t ids[R][8];
  int32_t nf[R] = {sc->nfacts < 5 ? sc->nfacts : 5, 2, sc->nfacts < 3 ? sc->nfacts : 3};
  for (int r = 0; r < R; r++)
    for (int f = 0; f < nf[r]; f++) ids[r][f] = 100 + (uint64_t)((f * 3 + r) % sc->nfacts);
  int32_t positions[4096];
  for (int i = 0; i < 4096; i++) positions[i] = 7 + 3 * i;
  kvi_inject_request hq[R], dq[R];
  for (int r = 0; r < R; r++) {
    kvi_inject_request_init(&hq[r], sizeof hq[r]);
    hq[r].tenant = 1;
    hq[r].fact_ids = ids[r];
    hq[r].num_facts = nf[r];
    hq[r].block_table = tables[r];
    hq[r].block_table_len = TL;
    hq[r].first_slot = 5 + r;
    hq[r].start_position = 40 * r;
    if (r == 1) hq[r].positions = positions;
    dq[r] = hq[r];
  }
  dq[2].block_table = dtable;
  dq[2].block_table_memory = KVI_MEMORY_DEVICE;
  CHECK_OK(kvi_inject(hi, hq, R, NULL, NULL));
  CHECK_OK(kvi_inject(di, dq, R, NULL, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  int64_t skipped = -1;
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  assert_int_equal(skipped, 0);
  double worst;
  const bool exact = sc->rope == 2; /* same cos/sin: bit for bit */
  size_t bad = compare_caches(&w, exact, 2e-6, &worst);
  if (bad) fail_msg("inject: %zu elements differ (worst relative %.3g)", bad, worst);
  if (sc->store_dtype == KVI_DTYPE_Q4) { /* 4-bit stores: the deviation kernel reads them as the CPU does */
    static float hs[8192], ds[8192];
    int64_t ntok = 0;
    for (int r = 0; r < R; r++)
      for (int f = 0; f < nf[r]; f++) ntok += sc->T + (int32_t)((ids[r][f] - 100) % 3);
    assert_true(ntok <= 8192);
    for (int l = 0; l < sc->L; l++) {
      CHECK_OK(kvi_inject_deviation(hi, hq, R, l, hs, 8192, KVI_MEMORY_HOST, NULL));
      CHECK_OK(kvi_inject_deviation(di, dq, R, l, ds, 8192, KVI_MEMORY_HOST, NULL));
      for (int64_t i = 0; i < ntok; i++)
        if (!(fabs((double)hs[i] - ds[i]) <= 1e-3 * fabs((double)hs[i]) + 1e-6))
          fail_msg("q4 deviation, layer %d token %lld: CPU %g, CUDA %g", l, (long long)i, (double)hs[i], (double)ds[i]);
    }
  }

  /* capture back: both stores capture the same range from their caches */
  kvi_encoder *he, *de;
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  kvi_capture c = KVI_CAPTURE_INIT;
  c.tenant = 2;
  c.fact_id = 1;
  c.block_table = tables[1];
  c.block_table_len = TL;
  c.first_slot = hq[1].first_slot;
  c.num_tokens = (int32_t)(2 * sc->T);
  c.positions = positions;
  CHECK_OK(kvi_encode(he, &c, 1, NULL));
  CHECK_OK(kvi_encode(de, &c, 1, NULL));
  size_t n = (size_t)sc->L * c.num_tokens * sc->H * sc->D;
  float *a = malloc(n * 8), *b = malloc(n * 8);
  kvi_kv_view va, vb;
  kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc->L, c.num_tokens, sc->H, sc->D, a, a + n);
  kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc->L, c.num_tokens, sc->H, sc->D, b, b + n);
  CUDA_OK(cudaDeviceSynchronize());
  CHECK_OK(kvi_store_read(w.cpu, 2, 1, &va, NULL));
  CHECK_OK(kvi_store_read(w.gpu, 2, 1, &vb, NULL));
  /* with the same cos/sin the captures are the same bytes (fp8: codes, scales, key offsets) */
  if (exact && (sc->store_dtype == KVI_DTYPE_FP8_E4M3 || sc->store_dtype == KVI_DTYPE_Q4))
    expect_same_bytes(w.cpu, w.gpu, 2, 1, sc->store_dtype, sc->L, sc->H, sc->D, 64, g_emb_dim);
  size_t cbad = 0;
  for (size_t i = 0; i < 2 * n; i++) {
    /* one unit of the store dtype or of the cache dtype (the injection
     * comparison above allows caches to differ by one unit), or fp32
     * rounding of the rotation */
    const double store_unit = sc->store_dtype == KVI_DTYPE_FP32         ? 1e-5
                              : sc->store_dtype == KVI_DTYPE_FP8_E4M3 ? 1.0 / 8 /* one e4m3 step */
                                                                      : 1.0 / 64;
    if (sc->store_dtype == KVI_DTYPE_Q4) { /* the same bits with the same cos/sin, else one code step */
      if (!(exact ? memcmp(&a[i], &b[i], 4) == 0 : fabs(a[i] - b[i]) <= 0.4)) cbad++;
      continue;
    }
    const double cache_unit = sc->cache_dtype == KVI_DTYPE_BF16   ? 1.0 / 64
                              : sc->cache_dtype == KVI_DTYPE_FP16 ? 1.0 / 512
                                                                  : 1e-5;
    double tol = fmax(store_unit, cache_unit) * fmax(fabs(a[i]), 1e-2);
    if (!(fabs(a[i] - b[i]) <= tol) && !(exact && a[i] == b[i])) cbad++;
  }
  /* fp8 caches: a one-step rounding difference in the cache becomes a whole
   * fp8 step after capture; allow it on a small fraction of elements */
  const bool fp8 = sc->cache_dtype == KVI_DTYPE_FP8_E4M3 || sc->cache_dtype == KVI_DTYPE_FP8_E5M2;
  if (fp8 ? cbad * 100 > 2 * n : cbad != 0) fail_msg("capture: %zu of %zu elements differ", cbad, 2 * n);
  free(a);
  free(b);
  kvi_encoder_destroy(he);
  kvi_encoder_destroy(de);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  cudaFree(dtable);
  free_world(&w);
}
#endif

#define SCEN(name, ...)                                                                                         \
  static void name(void **state) {                                                                              \
    (void)state;                                                                                                \
    if (g_devices == 0) skip();                                                                                 \
    SCEN_BODY(__VA_ARGS__)                                                                                      \
  }
#ifdef KVI_HAVE_CUDA
#define SCEN_BODY(...)                                                                                          \
  const scen sc = {__VA_ARGS__};                                                                                \
  run_inject(&sc);
#else
#define SCEN_BODY(...)
#endif

/*            L  H  D    BS NB   T  n  store            cache              preset                         rope scales */
SCEN(t_fa_bf16, 4, 4, 128, 16, 256, 24, 6, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 0, KVI_SCALE_NONE)
SCEN(t_fi_hnd_fp16, 3, 2, 128, 16, 128, 20, 5, KVI_DTYPE_FP16, KVI_DTYPE_FP16, KVI_CACHE_VLLM_FLASHINFER_HND, 1, KVI_SCALE_NONE)
SCEN(t_packed_fp32, 2, 2, 64, 32, 64, 17, 4, KVI_DTYPE_FP32, KVI_DTYPE_FP32, KVI_CACHE_VLLM_PACKED, 0, KVI_SCALE_NONE)
SCEN(t_table_exact, 2, 4, 128, 16, 128, 24, 5, KVI_DTYPE_FP32, KVI_DTYPE_FP32, KVI_CACHE_VLLM_FLASH_ATTN_HND, 2, KVI_SCALE_NONE)
SCEN(t_table_bf16, 2, 2, 128, 16, 128, 24, 5, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_PACKED_HND, 2, KVI_SCALE_NONE)
SCEN(t_trtllm_fp8, 3, 2, 128, 32, 64, 24, 5, KVI_DTYPE_BF16, KVI_DTYPE_FP8_E4M3, KVI_CACHE_TRTLLM, 0, KVI_SCALE_PER_HEAD)
SCEN(t_sglang_e5m2, 2, 2, 64, 1, 2048, 12, 4, KVI_DTYPE_FP16, KVI_DTYPE_FP8_E5M2, KVI_CACHE_SGLANG, 1, KVI_SCALE_PER_TENSOR)
SCEN(t_hf_scalar, 2, 3, 40, 512, 4, 9, 4, KVI_DTYPE_FP32, KVI_DTYPE_BF16, KVI_CACHE_HF_CONTIGUOUS, 3, KVI_SCALE_NONE)
SCEN(t_fi_yarn_vec, 2, 2, 128, 16, 128, 24, 4, KVI_DTYPE_BF16, KVI_DTYPE_FP32, KVI_CACHE_VLLM_FLASHINFER, 3, KVI_SCALE_NONE)
/* fp8 stores: exact with a cos/sin table (16-byte e4m3 loads, pages of several segments), an fp8 cache with
 * its own scales, 8-element vectors (D 80: rotated width not a multiple of 32), the scalar path */
SCEN(t_fp8s_table, 2, 4, 128, 16, 128, 24, 5, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN_HND, 2, KVI_SCALE_NONE)
SCEN(t_fp8s_fp8cache, 3, 2, 128, 32, 64, 24, 5, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_FP8_E4M3, KVI_CACHE_TRTLLM, 2, KVI_SCALE_PER_HEAD)
SCEN(t_fp8s_vec8, 2, 2, 80, 16, 128, 20, 4, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_FP16, KVI_CACHE_VLLM_FLASHINFER, 0, KVI_SCALE_NONE)
SCEN(t_fp8s_scalar, 2, 3, 40, 512, 4, 9, 4, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_BF16, KVI_CACHE_HF_CONTIGUOUS, 3, KVI_SCALE_NONE)
/* head vectors that are not contiguous (the element-wise path) and V planes with their own strides:
 * vLLM's CPU layout, a transposed V, and NHD K with HND V (vector paths with V's own offsets) */
SCEN(t_vllm_cpu_bf16, 3, 2, 128, 16, 128, 24, 5, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_CPU, 0, KVI_SCALE_NONE)
SCEN(t_vllm_cpu_table, 2, 4, 64, 16, 128, 20, 4, KVI_DTYPE_FP32, KVI_DTYPE_FP32, KVI_CACHE_VLLM_CPU, 2, KVI_SCALE_NONE)
SCEN(t_vllm_cpu_fp8, 3, 2, 128, 32, 64, 24, 5, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_FP8_E4M3, KVI_CACHE_VLLM_CPU, 1, KVI_SCALE_PER_HEAD)
SCEN(t_vt_fp16_table, 2, 2, 128, 16, 128, 24, 5, KVI_DTYPE_FP16, KVI_DTYPE_FP16, (kvi_cache_preset)GPU_TRANSPOSED_V, 2, KVI_SCALE_NONE)
SCEN(t_vt_e5m2_gptj, 3, 2, 64, 1, 2048, 12, 4, KVI_DTYPE_BF16, KVI_DTYPE_FP8_E5M2, (kvi_cache_preset)GPU_TRANSPOSED_V, 1, KVI_SCALE_PER_TENSOR)
SCEN(t_mixed_bf16, 4, 4, 128, 16, 256, 24, 6, KVI_DTYPE_BF16, KVI_DTYPE_BF16, (kvi_cache_preset)GPU_MIXED_PLANES, 0, KVI_SCALE_NONE)
SCEN(t_mixed_fp8s, 2, 4, 128, 16, 128, 24, 5, KVI_DTYPE_FP8_E4M3, KVI_DTYPE_BF16, (kvi_cache_preset)GPU_MIXED_PLANES, 2, KVI_SCALE_NONE)
/* 4-bit stores (CPU-quantized host puts): the kernel's element-wise dequantize-rotate-convert */
SCEN(t_q4_table, 2, 4, 128, 16, 128, 24, 5, KVI_DTYPE_Q4, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2, KVI_SCALE_NONE)
SCEN(t_q4_hnd_fp16, 3, 2, 128, 16, 128, 70, 5, KVI_DTYPE_Q4, KVI_DTYPE_FP16, KVI_CACHE_VLLM_FLASHINFER_HND, 2, KVI_SCALE_NONE)
SCEN(t_q4_fp32_gptj, 2, 2, 64, 32, 64, 17, 4, KVI_DTYPE_Q4, KVI_DTYPE_FP32, KVI_CACHE_VLLM_PACKED, 1, KVI_SCALE_NONE)
SCEN(t_q4_fp8cache, 3, 2, 128, 32, 64, 24, 5, KVI_DTYPE_Q4, KVI_DTYPE_FP8_E4M3, KVI_CACHE_TRTLLM, 2, KVI_SCALE_PER_HEAD)
SCEN(t_q4_e5m2_vt, 2, 3, 40, 16, 64, 9, 4, KVI_DTYPE_Q4, KVI_DTYPE_FP8_E5M2, (kvi_cache_preset)GPU_TRANSPOSED_V, 3, KVI_SCALE_PER_TENSOR)
SCEN(t_q4_mixed, 2, 4, 128, 16, 128, 24, 5, KVI_DTYPE_Q4, KVI_DTYPE_BF16, (kvi_cache_preset)GPU_MIXED_PLANES, 2, KVI_SCALE_NONE)
/* head size 64: 64-token segments, so each captured page is one segment (captured whole in phase 1), bit for bit */
SCEN(t_q4_table_sole, 2, 4, 64, 16, 128, 24, 5, KVI_DTYPE_Q4, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2, KVI_SCALE_NONE)
/* capture's key units (head, 8-column chunk) as many as the threads (Llama's 8 x 128: one a thread, no
 * slices), pages of one segment (32 tokens); twice as many (two a thread), pages of two segments */
SCEN(t_q4_sole_h8, 2, 8, 128, 16, 128, 16, 5, KVI_DTYPE_Q4, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2, KVI_SCALE_NONE)
SCEN(t_q4_split_h16, 2, 16, 128, 16, 128, 24, 4, KVI_DTYPE_Q4, KVI_DTYPE_FP16, KVI_CACHE_VLLM_FLASHINFER_HND, 2, KVI_SCALE_NONE)

#ifdef KVI_HAVE_CUDA
/* A device block table naming blocks outside the cache: those tokens are
 * skipped and counted, nothing is written out of bounds. */
static void t_bad_device_table(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  const scen sc = {2, 2, 64, 16, 32, 16, 2, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 0, KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  kvi_injector *di;
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  int32_t table[4] = {3, 1000, -5, 7}, *dtable;
  CUDA_OK(cudaMalloc((void **)&dtable, sizeof table));
  CUDA_OK(cudaMemcpy(dtable, table, sizeof table, cudaMemcpyHostToDevice));
  uint64_t ids[2] = {100, 101};
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = 1;
  rq.fact_ids = ids;
  rq.num_facts = 2;
  rq.block_table = dtable;
  rq.block_table_len = 4;
  rq.block_table_memory = KVI_MEMORY_DEVICE;
  rq.first_slot = 8; /* 16 + 17 tokens: 8 in block 3, 16 in block 1000 (bad), 9 in block -5 (bad) */
  CHECK_OK(kvi_inject(di, &rq, 1, NULL, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  int64_t skipped = 0;
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  assert_int_equal(skipped, 25);
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  assert_int_equal(skipped, 0); /* read and cleared */
  /* only the second half of block 3 was written */
  unsigned char *d = malloc(w.layer_bytes);
  CUDA_OK(cudaMemcpy(d, w.dev[0], w.layer_bytes, cudaMemcpyDeviceToHost));
  const size_t tok = (size_t)sc.H * sc.D * 2, blk = tok * sc.BS;
  size_t written = 0;
  for (size_t i = 0; i < w.layer_bytes / 2; i += 2) /* K plane */
    if (d[i] != 0xFF || d[i + 1] != 0xFF) written++;
  assert_int_equal(written, 8 * (tok / 2));
  for (size_t i = 3 * blk + 8 * tok; i < 4 * blk; i += 2) assert_false(d[i] == 0xFF && d[i + 1] == 0xFF);
  free(d);
  cudaFree(dtable);
  kvi_injector_destroy(di);
  free_world(&w);
}

/* Block tables declared in the wrong memory: a device pointer given as a
 * host table (the library would read it on the host) and a host pointer
 * given as a device table are refused before anything is written. */
static void t_table_memory_kind(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  const scen sc = {2, 2, 64, 16, 32, 16, 2, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 0, KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  kvi_injector *di;
  kvi_encoder *de;
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  int32_t table[4] = {3, 1, 2, 7}, *dtable;
  CUDA_OK(cudaMalloc((void **)&dtable, sizeof table));
  CUDA_OK(cudaMemcpy(dtable, table, sizeof table, cudaMemcpyHostToDevice));
  uint64_t ids[2] = {100, 101};
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = 1;
  rq.fact_ids = ids;
  rq.num_facts = 2;
  rq.block_table = dtable;
  rq.block_table_len = 4;
  rq.block_table_memory = KVI_MEMORY_HOST;
  assert_int_equal(kvi_inject(di, &rq, 1, NULL, NULL), KVI_ERR_MEMORY_KIND);
  rq.block_table = table;
  rq.block_table_memory = KVI_MEMORY_DEVICE;
  assert_int_equal(kvi_inject(di, &rq, 1, NULL, NULL), KVI_ERR_MEMORY_KIND);
  kvi_capture cap = KVI_CAPTURE_INIT;
  cap.tenant = 9;
  cap.fact_id = 1;
  cap.block_table = dtable;
  cap.block_table_len = 4;
  cap.num_tokens = 5;
  assert_int_equal(kvi_encode(de, &cap, 1, NULL), KVI_ERR_MEMORY_KIND);
  size_t n = 1;
  CHECK_OK(kvi_store_count(w.gpu, 9, &n));
  assert_int_equal(n, 0);
  /* the cache was not touched */
  unsigned char *d = malloc(w.layer_bytes);
  CUDA_OK(cudaMemcpy(d, w.dev[0], w.layer_bytes, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < w.layer_bytes; i++) assert_int_equal(d[i], 0xFF);
  free(d);
  cudaFree(dtable);
  kvi_encoder_destroy(de);
  kvi_injector_destroy(di);
  free_world(&w);
}

/* The stream is held by a host callback until released: an injection is in
 * flight for certain, so a removed fact's pages must not return to the pool. */
static volatile int g_release;
static void CUDART_CB hold(void *arg) {
  (void)arg;
  while (!g_release) {
  }
}

static void t_deferred_free(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  const scen sc = {2, 2, 64, 16, 64, 32, 3, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 0, KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  kvi_injector *di;
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  g_release = 0;
  CUDA_OK(cudaLaunchHostFunc(s, hold, NULL));
  int32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  uint64_t ids[1] = {100};
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = 1;
  rq.fact_ids = ids;
  rq.num_facts = 1;
  rq.block_table = table;
  rq.block_table_len = 8;
  kvi_store_stats before = KVI_STORE_STATS_INIT, after = KVI_STORE_STATS_INIT;
  kvi_status st1 = kvi_inject(di, &rq, 1, NULL, (struct CUstream_st *)s);
  kvi_status st2 = kvi_store_stats_get(w.gpu, &before);
  kvi_status st3 = kvi_store_remove(w.gpu, 1, 100);
  kvi_status st4 = kvi_store_stats_get(w.gpu, &after);
  const uint64_t used_in_flight = after.pages_used;
  g_release = 1; /* never leave the stream held, whatever failed */
  CHECK_OK(st1);
  CHECK_OK(st2);
  CHECK_OK(st3);
  CHECK_OK(st4);
  assert_int_equal(after.facts, before.facts - 1);
  assert_int_equal(used_in_flight, before.pages_used); /* deferred: the kernel had not run */
  CUDA_OK(cudaStreamSynchronize(s));
  /* the cache holds fact 100 as the CPU computes it */
  kvi_injector *hi;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_inject(hi, &rq, 1, NULL, NULL));
  double worst;
  assert_int_equal(compare_caches(&w, false, 2e-6, &worst), 0);
  /* a put reaps the deferred pages */
  float k[2 * 2 * 64 * 2] = {1.0f}, v[2 * 2 * 64 * 2] = {2.0f};
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 2, 2, 2, 64, k, v);
  CHECK_OK(kvi_store_put(w.gpu, 1, 999, &kv, NULL, NULL));
  CHECK_OK(kvi_store_stats_get(w.gpu, &after));
  assert_int_equal(after.pages_used, before.pages_used - 2 + 1);
  cudaStreamDestroy(s);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  free_world(&w);
}

/* The injector's staging ring (lib/gpu/gpu_ring.c): plans too large for the
 * kernel parameters go through its two pinned slots, each reused only once
 * the last launch that read it has completed. Call 0 is held on its stream
 * (a host function spins until another thread releases it 0.3 s later)
 * while call 1 takes the second slot and call 2 must wait for the first;
 * calls 3..5 cycle the ring over three streams. Every call writes its own
 * blocks with its own positions, so a slot overwritten before its kernel
 * read it leaves some call's blocks unwritten (poison) or wrong: the device
 * cache must equal the CPU's bit for bit (a cos/sin table: exact). */
enum { RING_CALLS = 6, RING_REQS = 4, RING_BLOCKS = 64 };

static void *release_later(void *arg) {
  (void)arg;
  usleep(300000);
  g_release = 1;
  return NULL;
}

static void t_staging_ring(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  const scen sc = {2, 2, 64, 16, RING_CALLS * RING_REQS * RING_BLOCKS + 16, 24, 40,
                   KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2, KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  kvi_injector *hi, *di;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  static int32_t tables[RING_CALLS][RING_REQS][RING_BLOCKS];
  static int32_t pos[RING_CALLS][RING_REQS][RING_BLOCKS * 16];
  static uint64_t ids[RING_CALLS][RING_REQS][40];
  static kvi_inject_request rq[RING_CALLS][RING_REQS];
  for (int c = 0; c < RING_CALLS; c++)
    for (int r = 0; r < RING_REQS; r++) {
      const int32_t base = (c * RING_REQS + r) * RING_BLOCKS;
      for (int b = 0; b < RING_BLOCKS; b++) tables[c][r][b] = base + (RING_BLOCKS - 1 - b); /* descending */
      for (int i = 0; i < RING_BLOCKS * 16; i++) pos[c][r][i] = (7 + 13 * c + 5 * r + 3 * i) % 4000;
      for (int f = 0; f < 40; f++) ids[c][r][f] = 100 + (uint64_t)((f + 7 * c + r) % 40);
      kvi_inject_request_init(&rq[c][r], sizeof rq[c][r]);
      rq[c][r].tenant = 1;
      rq[c][r].fact_ids = ids[c][r];
      rq[c][r].num_facts = 40; /* about 1,000 tokens: the positions alone exceed KVI__INLINE_PLAN */
      rq[c][r].block_table = tables[c][r];
      rq[c][r].block_table_len = RING_BLOCKS;
      rq[c][r].first_slot = 3;
      rq[c][r].positions = pos[c][r];
    }
  for (int c = 0; c < RING_CALLS; c++) CHECK_OK(kvi_inject(hi, rq[c], RING_REQS, NULL, NULL));
  cudaStream_t s[3];
  for (int i = 0; i < 3; i++) CUDA_OK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
  g_release = 0;
  CUDA_OK(cudaLaunchHostFunc(s[0], hold, NULL));
  kvi_status st[RING_CALLS];
  st[0] = kvi_inject(di, rq[0], RING_REQS, NULL, (struct CUstream_st *)s[0]);
  pthread_t th;
  const bool threaded = pthread_create(&th, NULL, release_later, NULL) == 0;
  if (!threaded) g_release = 1; /* never leave the stream held */
  for (int c = 1; c < RING_CALLS; c++) st[c] = kvi_inject(di, rq[c], RING_REQS, NULL, (struct CUstream_st *)s[c % 3]);
  if (threaded) pthread_join(th, NULL);
  g_release = 1;
  assert_true(threaded);
  for (int c = 0; c < RING_CALLS; c++) CHECK_OK(st[c]);
  CUDA_OK(cudaDeviceSynchronize());
  int64_t skipped = -1;
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  assert_int_equal(skipped, 0);
  double worst;
  const size_t bad = compare_caches(&w, true, 0, &worst);
  if (bad) fail_msg("staging ring: %zu cache elements differ from the CPU injector's", bad);
  for (int i = 0; i < 3; i++) cudaStreamDestroy(s[i]);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  free_world(&w);
}

/* A capture call of more than KVI__CAPTURE_CHUNK (65,536, lib/xfer/transfer.h)
 * captures: its two chunk plans share one staging slot, whose event moves to
 * the second chunk's launch. The stream is held (as above) while two more
 * calls follow, each plan too large for the kernel parameters: the third
 * takes the first call's slot again and must wait for its second chunk, or
 * its upload (on the injector's own stream, not ordered after the held one)
 * would replace that chunk's plan before the kernel read it. A sample of
 * every call's facts (the first call's last, the second chunk's only one,
 * included) must be found and match the CPU encoder's. */
enum { CHUNK_CAPS = 65537, SMALL_CAPS = 2000 };

static void check_captured(const world *w, uint64_t tenant, int32_t n, int32_t step) {
  float a[2 * 8], b[2 * 8];
  kvi_kv_view va, vb;
  kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, 8, a, a + 8);
  kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, 8, b, b + 8);
  size_t bad = 0;
  for (int32_t i = 0; i < n; i = i + step < n || i == n - 1 ? i + step : n - 1) {
    CHECK_OK(kvi_store_read(w->cpu, tenant, (uint64_t)i, &va, NULL));
    CHECK_OK(kvi_store_read(w->gpu, tenant, (uint64_t)i, &vb, NULL));
    for (int e = 0; e < 16; e++) /* one bf16 unit: the fp32 un-rotation may round apart */
      bad += !(fabsf(a[e] - b[e]) <= fabsf(a[e]) * 0x1p-7f + 1e-6f);
  }
  if (bad) fail_msg("capture chunks: %zu elements of tenant %llu differ from the CPU encoder's", bad,
                    (unsigned long long)tenant);
}

/* The same bf16 values of rndf() in the host and device caches of a bf16 world. */
static void fill_bf16(world *w) {
  for (int i = 0; i < w->ntensors; i++) {
    uint16_t *h = w->host[i];
    for (size_t k = 0; k < w->layer_bytes / 2; k++) {
      const float f = rndf();
      uint32_t u;
      memcpy(&u, &f, 4);
      h[k] = (uint16_t)(u >> 16);
    }
    CUDA_OK(cudaMemcpy(w->dev[i], w->host[i], w->layer_bytes, cudaMemcpyHostToDevice));
  }
}

static void t_capture_chunks(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  const scen sc = {1, 1, 8, 16, (CHUNK_CAPS + 2 * SMALL_CAPS) / 16 + 16, 16, 0,
                   KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2, KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  fill_bf16(&w);
  CUDA_OK(cudaDeviceSynchronize());
  kvi_transfer_options to = KVI_TRANSFER_OPTIONS_INIT;
  to.max_requests_per_call = CHUNK_CAPS;
  kvi_encoder *he, *de;
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, &to));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, &to));
  int32_t *table = malloc((size_t)sc.NB * sizeof *table);
  for (int32_t b = 0; b < sc.NB; b++) table[b] = sc.NB - 1 - b;
  kvi_capture *caps[3];
  const int32_t ncaps[3] = {CHUNK_CAPS, SMALL_CAPS, SMALL_CAPS};
  int64_t slot0 = 0;
  for (int c = 0; c < 3; c++) {
    caps[c] = malloc((size_t)ncaps[c] * sizeof *caps[c]);
    for (int32_t i = 0; i < ncaps[c]; i++) {
      kvi_capture_init(&caps[c][i], sizeof caps[c][i]);
      caps[c][i].tenant = 2 + (uint64_t)c;
      caps[c][i].fact_id = (uint64_t)i;
      caps[c][i].block_table = table;
      caps[c][i].block_table_len = sc.NB;
      caps[c][i].first_slot = slot0 + i;
      caps[c][i].num_tokens = 1;
      caps[c][i].start_position = (int32_t)((7 * (slot0 + i) + c) % 4000);
    }
    slot0 += ncaps[c];
    CHECK_OK(kvi_encode(he, caps[c], ncaps[c], NULL));
  }
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  g_release = 0;
  CUDA_OK(cudaLaunchHostFunc(s, hold, NULL));
  kvi_status st[3];
  st[0] = kvi_encode(de, caps[0], ncaps[0], (struct CUstream_st *)s);
  pthread_t th;
  const bool threaded = pthread_create(&th, NULL, release_later, NULL) == 0;
  if (!threaded) g_release = 1;
  for (int c = 1; c < 3; c++) st[c] = kvi_encode(de, caps[c], ncaps[c], (struct CUstream_st *)s);
  if (threaded) pthread_join(th, NULL);
  g_release = 1;
  assert_true(threaded);
  for (int c = 0; c < 3; c++) CHECK_OK(st[c]);
  CUDA_OK(cudaStreamSynchronize(s));
  check_captured(&w, 2, CHUNK_CAPS, 97);
  check_captured(&w, 3, SMALL_CAPS, 7);
  check_captured(&w, 4, SMALL_CAPS, 7);
  cudaStreamDestroy(s);
  for (int c = 0; c < 3; c++) free(caps[c]);
  free(table);
  kvi_encoder_destroy(he);
  kvi_encoder_destroy(de);
  free_world(&w);
}

/* kvi_encode on a journaled CUDA store, on a stream the test does not
 * synchronize: the journal waits for the capture kernel before it reads the
 * pages, so the file, loaded into a CPU store, holds the captured facts bit
 * for bit; an encode the journal refuses after the launch gives its pages
 * back at once. */
static void t_journal_encode(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  const scen sc = {2, 2, 64, 16, 64, 16, 2, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 0, KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  for (int i = 0; i < w.ntensors; i++) {
    uint16_t *h = w.host[i];
    for (size_t k = 0; k < w.layer_bytes / 2; k++) {
      uint16_t b = (uint16_t)rnd();
      if (((b >> 7) & 0xff) == 0xff) b &= 0xbfff;
      h[k] = b;
    }
    CUDA_OK(cudaMemcpy(w.dev[i], w.host[i], w.layer_bytes, cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaDeviceSynchronize()); /* the pageable copy has landed (test_gpu_store.c, to_device) */
  char dir[] = "/tmp/kvi-gpu-journal-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/journal.kvi", dir);
  CHECK_OK(kvi_store_journal_open(w.gpu, path, 0));
  kvi_encoder *de;
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int32_t table[64];
  for (int i = 0; i < 64; i++) table[i] = (i * 7) % 64;
  kvi_capture caps[3];
  for (int i = 0; i < 3; i++) {
    kvi_capture_init(&caps[i], sizeof caps[i]);
    caps[i].tenant = 3;
    caps[i].fact_id = 1 + (uint64_t)i;
    caps[i].block_table = table;
    caps[i].block_table_len = 64;
    caps[i].first_slot = 300 * i + 5;
    caps[i].num_tokens = 290;
    caps[i].start_position = 1000 * i;
  }
  /* the journal refuses (its file moved away behind its back) after the
   * kernel was launched: the encode fails having changed nothing, its pages
   * back on the free stack at once (the transaction waits for the kernel) */
  kvi_store_stats before = KVI_STORE_STATS_INIT, after = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(w.gpu, &before));
  char moved[80];
  snprintf(moved, sizeof moved, "%s/moved.kvi", dir);
  assert_int_equal(rename(path, moved), 0);
  assert_int_equal(kvi_encode(de, caps, 3, (struct CUstream_st *)s), KVI_ERR_IO);
  CHECK_OK(kvi_store_stats_get(w.gpu, &after));
  assert_int_equal(after.pages_used, before.pages_used);
  assert_int_equal(after.facts, before.facts);
  assert_int_equal(after.tenants, before.tenants);
  assert_int_equal(rename(moved, path), 0); /* the same file again: the journal takes appends */
  CHECK_OK(kvi_encode(de, caps, 3, (struct CUstream_st *)s));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = sc.store_dtype;
  so.budget_bytes = 64u << 20;
  kvi_store *l = NULL;
  CHECK_OK(kvi_store_load(&l, w.model, &so, path, NULL));
  CUDA_OK(cudaStreamSynchronize(s));
  const int32_t T = 290;
  const size_t n = (size_t)sc.L * T * sc.H * sc.D;
  uint16_t *a = malloc(n * 4), *b = malloc(n * 4);
  for (int i = 0; i < 3; i++) {
    kvi_kv_view va, vb;
    kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_BF16, sc.L, T, sc.H, sc.D, a, a + n);
    kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_BF16, sc.L, T, sc.H, sc.D, b, b + n);
    CHECK_OK(kvi_store_read(w.gpu, 3, caps[i].fact_id, &va, NULL));
    CHECK_OK(kvi_store_read(l, 3, caps[i].fact_id, &vb, NULL));
    assert_memory_equal(a, b, n * 4);
  }
  size_t count = 0;
  CHECK_OK(kvi_store_count(l, 1, &count));
  assert_int_equal(count, (size_t)sc.nfacts);
  free(a);
  free(b);
  kvi_store_destroy(l);
  kvi_encoder_destroy(de);
  CUDA_OK(cudaStreamDestroy(s));
  unlink(path);
  rmdir(dir);
  free_world(&w);
}

/* ---- the pinned-host tier ------------------------------------------------ */

/* L 2, H 2, D 64, bf16, 16-token pages: a page is 16 KiB. The device tier
 * holds 6 pages (three facts of 20..22 tokens, two pages each), the host the
 * rest. RoPE from a cos/sin table: injection is bit for bit the CPU's. */
static const scen tier_sc = {2, 2, 64, 16, 256, 20, 12, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2,
                             KVI_SCALE_NONE};
enum { TIER_PAGE = 2 * 2 * 2 * 16 * 64 * 2, TIER_TL = 256 };

static void tier_world(world *w) {
  g_dev_budget = 6 * TIER_PAGE;
  g_host_budget = 64u << 20;
  make_world(w, &tier_sc);
  g_dev_budget = g_host_budget = 0;
}

static int32_t g_tier_table[TIER_TL];

/* A request of n facts at sequence slots from `slot` (blocks of the shared table). */
static kvi_inject_request tier_req(const uint64_t *ids, int32_t n, int64_t slot) {
  for (int b = 0; b < TIER_TL; b++) g_tier_table[b] = (b * 37) % TIER_TL;
  kvi_inject_request r = KVI_INJECT_REQUEST_INIT;
  r.tenant = 1;
  r.fact_ids = ids;
  r.num_facts = n;
  r.block_table = g_tier_table;
  r.block_table_len = TIER_TL;
  r.first_slot = slot;
  r.start_position = (int32_t)slot + 3;
  return r;
}

static kvi_store_stats tier_stats(const kvi_store *s) {
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(s, &st));
  return st;
}

/* Every fact of tenant 1 reads back from the tiered store as from the CPU
 * store: host views (the CPU reads host-tier pages; staging for device ones)
 * and device views (the copy kernel, through the mapped address for host-tier
 * pages). */
static void tier_check_reads_except(const world *w, uint64_t except, bool device_reads) {
  const int32_t Tmax = tier_sc.T + 2;
  const size_t n = (size_t)tier_sc.L * Tmax * tier_sc.H * tier_sc.D;
  uint16_t *a = malloc(n * 4), *b = malloc(n * 4), *d;
  CUDA_OK(cudaMalloc((void **)&d, n * 4));
  for (int f = 0; f < tier_sc.nfacts; f++) {
    if (100 + (uint64_t)f == except) continue;
    const int32_t T = tier_sc.T + f % 3;
    const size_t m = (size_t)tier_sc.L * T * tier_sc.H * tier_sc.D;
    kvi_kv_view va, vb, vd;
    kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_BF16, tier_sc.L, T, tier_sc.H, tier_sc.D, a, a + m);
    kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_BF16, tier_sc.L, T, tier_sc.H, tier_sc.D, b, b + m);
    kvi_kv_view_contiguous(&vd, KVI_MEMORY_DEVICE, KVI_DTYPE_BF16, tier_sc.L, T, tier_sc.H, tier_sc.D, d, d + m);
    CHECK_OK(kvi_store_read(w->cpu, 1, 100 + (uint64_t)f, &va, NULL));
    CHECK_OK(kvi_store_read(w->gpu, 1, 100 + (uint64_t)f, &vb, NULL));
    if (memcmp(a, b, m * 4)) fail_msg("fact %d: host read from the tiered store differs", f);
    if (!device_reads) continue;
    memset(b, 0, m * 4);
    CHECK_OK(kvi_store_read(w->gpu, 1, 100 + (uint64_t)f, &vd, NULL));
    CUDA_OK(cudaMemcpy(b, d, m * 4, cudaMemcpyDeviceToHost));
    if (memcmp(a, b, m * 4)) fail_msg("fact %d: device read from the tiered store differs", f);
  }
  cudaFree(d);
  free(a);
  free(b);
}

static void tier_check_reads(const world *w) { tier_check_reads_except(w, 0, true); }

/* Puts fill the device, then the host; injections that need promotion and
 * demotion write what the CPU store's injection writes, bit for bit; a call
 * whose facts cannot all be on the device fails and changes nothing; the
 * mapped-read mode moves nothing; reads and a save see both tiers. */
static void t_tier_inject(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  world w;
  tier_world(&w);
  kvi_store_stats s0 = tier_stats(w.gpu);
  assert_int_equal(s0.pages_total - s0.pages_host_total, 6);
  assert_true(s0.pages_host_total >= 1000);
  assert_int_equal(s0.pages_used - s0.pages_host_used, 6); /* facts 100..102 */
  assert_int_equal(s0.pages_host_used, 18);                /* facts 103..111 */
  assert_int_equal(s0.promotions, 0);
  assert_int_equal(s0.demotions, 0);
  kvi_injector *hi, *di;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  /* rounds: a mix (100 stays, 101 and 102 go down), all on the host, two
   * requests sharing a fact, a repeat of the first */
  static const uint64_t r1[] = {105, 100, 111}, r2[] = {103, 104, 106}, r3a[] = {107}, r3b[] = {108, 107},
                        r4[] = {105, 100, 111};
  kvi_inject_request q[2];
  int64_t slot = 0;
#define ROUND(...)                                                                                              \
  do {                                                                                                          \
    const kvi_inject_request rr[] = {__VA_ARGS__};                                                              \
    const int32_t nr = (int32_t)(sizeof rr / sizeof rr[0]);                                                     \
    memcpy(q, rr, sizeof rr);                                                                                   \
    CHECK_OK(kvi_inject(hi, q, nr, NULL, NULL));                                                                \
    CHECK_OK(kvi_inject(di, q, nr, NULL, NULL));                                                                \
    CUDA_OK(cudaDeviceSynchronize());                                                                           \
    double worst_;                                                                                              \
    assert_int_equal(compare_caches(&w, true, 0, &worst_), 0);                                                  \
    kvi_store_stats st_ = tier_stats(w.gpu);                                                                    \
    assert_true(st_.pages_used - st_.pages_host_used <= 6);                                                     \
  } while (0)
  ROUND(tier_req(r1, 3, slot));
  kvi_store_stats s1 = tier_stats(w.gpu);
  assert_int_equal(s1.promotions, 2);
  assert_int_equal(s1.demotions, 2);
  slot += 100;
  ROUND(tier_req(r2, 3, slot));
  kvi_store_stats s2 = tier_stats(w.gpu);
  assert_int_equal(s2.promotions, 5);
  assert_int_equal(s2.demotions, 5);
  slot += 100;
  ROUND(tier_req(r3a, 1, slot), tier_req(r3b, 2, slot + 30));
  kvi_store_stats s3 = tier_stats(w.gpu);
  assert_int_equal(s3.promotions, 7); /* 107 once */
  slot += 100;
  ROUND(tier_req(r4, 3, slot));
  slot += 100;
  /* four facts (eight pages) cannot be on a six-page device at once */
  static const uint64_t big[] = {101, 102, 109, 110};
  const kvi_store_stats sb = tier_stats(w.gpu);
  q[0] = tier_req(big, 4, slot);
  assert_int_equal(kvi_inject(di, q, 1, NULL, NULL), KVI_ERR_CAPACITY);
  CUDA_OK(cudaDeviceSynchronize());
  const kvi_store_stats sa = tier_stats(w.gpu);
  assert_int_equal(sa.promotions, sb.promotions);
  assert_int_equal(sa.demotions, sb.demotions);
  assert_int_equal(sa.pages_used, sb.pages_used);
  double worst;
  assert_int_equal(compare_caches(&w, true, 0, &worst), 0); /* nothing written */
  /* mapped reads: host-tier facts injected in place, nothing moves */
  static const uint64_t rm[] = {101, 109, 110, 102};
  kvi_inject_options io = KVI_INJECT_OPTIONS_INIT;
  io.host_pages = KVI_HOST_PAGES_READ_MAPPED;
  q[0] = tier_req(rm, 4, slot);
  CHECK_OK(kvi_inject(hi, q, 1, NULL, NULL));
  CHECK_OK(kvi_inject(di, q, 1, &io, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  assert_int_equal(compare_caches(&w, true, 0, &worst), 0);
  const kvi_store_stats sm = tier_stats(w.gpu);
  assert_int_equal(sm.promotions, sa.promotions);
  assert_int_equal(sm.demotions, sa.demotions);
  io.host_pages = (kvi_host_pages)7;
  assert_int_equal(kvi_inject(di, q, 1, &io, NULL), KVI_ERR_INVALID_ARGUMENT);
  tier_check_reads(&w);
  /* a save reads pages from both tiers; loaded into a CPU store it equals the CPU store */
  char dir[] = "/tmp/kvi-gpu-tier-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/tier.kvi", dir);
  CHECK_OK(kvi_store_save(w.gpu, path, NULL));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.budget_bytes = 64u << 20;
  kvi_store *l = NULL;
  CHECK_OK(kvi_store_load(&l, w.model, &so, path, NULL));
  kvi_store *keep = w.gpu;
  w.gpu = l; /* compares w.gpu with w.cpu: the loaded store now (host reads only) */
  tier_check_reads_except(&w, 0, false);
  w.gpu = keep;
  kvi_store_destroy(l);
  unlink(path);
  rmdir(dir);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  free_world(&w);
#undef ROUND
}

/* An injection in flight (its stream held by a host callback) reads facts
 * that the next call, on another stream, demotes and whose device pages it
 * reuses for promotions; one of them is also removed meanwhile. The
 * demotion's copies must wait for the held injection: once released, both
 * caches equal the CPU's. */
static void t_tier_inflight(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  world w;
  tier_world(&w);
  kvi_injector *hi, *di;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  cudaStream_t s1, s2;
  CUDA_OK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  static const uint64_t a[] = {100, 104}, b[] = {105, 106};
  kvi_inject_request qa = tier_req(a, 2, 0), qb = tier_req(b, 2, 64);
  CHECK_OK(kvi_inject(hi, &qa, 1, NULL, NULL));
  CHECK_OK(kvi_inject(hi, &qb, 1, NULL, NULL));
  g_release = 0;
  CUDA_OK(cudaLaunchHostFunc(s1, hold, NULL));
  /* a: 104 comes up (101, least recently used of the others, goes down); held on s1 */
  kvi_status st1 = kvi_inject(di, &qa, 1, NULL, (struct CUstream_st *)s1);
  kvi_status st2 = kvi_store_remove(w.gpu, 1, 104); /* in flight: its pages wait */
  /* b: 105 and 106 come up; 102 and 100 (read by the held call) go down */
  kvi_status st3 = kvi_inject(di, &qb, 1, NULL, (struct CUstream_st *)s2);
  kvi_store_stats mid = KVI_STORE_STATS_INIT;
  kvi_status st4 = kvi_store_stats_get(w.gpu, &mid);
  g_release = 1; /* never leave the stream held, whatever failed */
  CHECK_OK(st1);
  CHECK_OK(st2);
  CHECK_OK(st3);
  CHECK_OK(st4);
  CUDA_OK(cudaStreamSynchronize(s1));
  CUDA_OK(cudaStreamSynchronize(s2));
  double worst;
  assert_int_equal(compare_caches(&w, true, 0, &worst), 0);
  assert_int_equal(mid.promotions, 3);
  assert_true(mid.demotions >= 2);
  CHECK_OK(kvi_store_remove(w.cpu, 1, 104));
  tier_check_reads_except(&w, 104, true);
  cudaStreamDestroy(s1);
  cudaStreamDestroy(s2);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  free_world(&w);
}

/* Prefetch then inject: the facts are up before the call, which moves
 * nothing more; NULL prefetches what fits of the tenant; errors. */
static void t_tier_prefetch(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  world w;
  tier_world(&w);
  kvi_injector *hi, *di;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  static const uint64_t ids[] = {109, 103, 110};
  CHECK_OK(kvi_store_prefetch(w.gpu, 1, ids, 3, (struct CUstream_st *)s));
  const kvi_store_stats p = tier_stats(w.gpu);
  assert_int_equal(p.promotions, 3);
  assert_int_equal(p.demotions, 3);
  kvi_inject_request q = tier_req(ids, 3, 0);
  CHECK_OK(kvi_inject(hi, &q, 1, NULL, NULL));
  CHECK_OK(kvi_inject(di, &q, 1, NULL, (struct CUstream_st *)s)); /* waits for the copies on the GPU */
  CUDA_OK(cudaStreamSynchronize(s));
  double worst;
  assert_int_equal(compare_caches(&w, true, 0, &worst), 0);
  const kvi_store_stats p2 = tier_stats(w.gpu);
  assert_int_equal(p2.promotions, 3);
  /* too many to fit: the prefix that fits (three facts of the four) comes up */
  static const uint64_t many[] = {100, 101, 102, 111};
  CHECK_OK(kvi_store_prefetch(w.gpu, 1, many, 4, NULL));
  const kvi_store_stats p3 = tier_stats(w.gpu);
  assert_int_equal(p3.promotions, 3 + 3);
  CHECK_OK(kvi_store_prefetch(w.gpu, 1, NULL, 0, NULL));
  CHECK_OK(kvi_store_prefetch(w.gpu, 9, NULL, 0, NULL)); /* a tenant without facts */
  static const uint64_t unknown[] = {100, 4242};
  assert_int_equal(kvi_store_prefetch(w.gpu, 1, unknown, 2, NULL), KVI_ERR_NOT_FOUND);
  assert_int_equal(kvi_store_prefetch(w.gpu, 1, NULL, 2, NULL), KVI_ERR_INVALID_ARGUMENT);
  CUDA_OK(cudaDeviceSynchronize());
  tier_check_reads(&w);
  cudaStreamDestroy(s);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  free_world(&w);
}

/* kvi_encode into a tiered store whose device tier is full demotes facts to
 * make room; the captured facts equal the CPU store's captures. */
static void t_tier_encode(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  world w;
  tier_world(&w);
  kvi_injector *hi, *di;
  kvi_encoder *he, *de;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  static const uint64_t ids[] = {103, 104, 105, 106, 107};
  kvi_inject_request q = tier_req(ids, 5, 0); /* five facts: not at once: */
  assert_int_equal(kvi_inject(di, &q, 1, NULL, NULL), KVI_ERR_CAPACITY);
  q.num_facts = 3;
  CHECK_OK(kvi_inject(hi, &q, 1, NULL, NULL));
  CHECK_OK(kvi_inject(di, &q, 1, NULL, NULL));
  kvi_capture c[2];
  for (int i = 0; i < 2; i++) {
    kvi_capture_init(&c[i], sizeof c[i]);
    c[i].tenant = 2;
    c[i].fact_id = (uint64_t)i;
    c[i].block_table = g_tier_table;
    c[i].block_table_len = TIER_TL;
    c[i].first_slot = 21 * i;
    c[i].num_tokens = 21;
    c[i].start_position = 3 + 21 * i;
  }
  const kvi_store_stats e0 = tier_stats(w.gpu);
  CHECK_OK(kvi_encode(he, c, 2, NULL));
  CHECK_OK(kvi_encode(de, c, 2, NULL));
  CUDA_OK(cudaDeviceSynchronize()); /* host reads go through the store's copy stream: the capture first */
  const kvi_store_stats e1 = tier_stats(w.gpu);
  assert_int_equal(e1.demotions, e0.demotions + 2); /* four pages made free */
  assert_int_equal(e1.pages_used - e1.pages_host_used, 6);
  const size_t n = (size_t)tier_sc.L * 21 * tier_sc.H * tier_sc.D;
  uint16_t *a = malloc(n * 4), *b = malloc(n * 4);
  for (int i = 0; i < 2; i++) {
    kvi_kv_view va, vb;
    kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_BF16, tier_sc.L, 21, tier_sc.H, tier_sc.D, a, a + n);
    kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_BF16, tier_sc.L, 21, tier_sc.H, tier_sc.D, b, b + n);
    CHECK_OK(kvi_store_read(w.cpu, 2, (uint64_t)i, &va, NULL));
    CHECK_OK(kvi_store_read(w.gpu, 2, (uint64_t)i, &vb, NULL));
    if (memcmp(a, b, n * 4)) fail_msg("capture %d differs from the CPU store's", i);
  }
  free(a);
  free(b);
  tier_check_reads(&w);
  kvi_encoder_destroy(he);
  kvi_encoder_destroy(de);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  free_world(&w);
}
/* The caller's current device, checked after each call of t_caller_device. */
static void expect_device(int want, const char *after) {
  int cur = -1;
  CUDA_OK(cudaGetDevice(&cur));
  if (cur != want) {
    cudaSetDevice(0); /* for the tests after this one */
    fail_msg("after %s the current device is %d, the caller's was %d", after, cur, want);
  }
}

/* Every injector and encoder entry point runs on its store's device and
 * gives the caller's current device back. With two or more devices the
 * caller stands on the last one while the store and the caches live on
 * device 0 (work run on the caller's device fails or goes astray); the
 * caches and captures still equal the CPU store's. */
static void t_caller_device(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  static const scen sc = {2, 2, 64, 16, 64, 20, 4, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 0,
                          KVI_SCALE_NONE};
  world w;
  make_world(&w, &sc);
  const int other = g_devices - 1;
  enum { TL = 16 };
  static int32_t tables[4][TL]; /* requests 0, 1 and captures 0, 1: blocks of their own */
  for (int r = 0; r < 4; r++)
    for (int b = 0; b < TL; b++) tables[r][b] = r * TL + (TL - 1 - b);
  static const uint64_t ids[] = {100, 102, 101, 103};
  kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
  q.tenant = 1, q.fact_ids = ids, q.num_facts = 2, q.block_table = tables[0], q.block_table_len = TL;
  q.first_slot = 3, q.start_position = 11;
  const int32_t offs[2] = {2, 4};
  const int64_t slot1 = 5;
  const int32_t start1 = 40;
  kvi_inject_batch ib = KVI_INJECT_BATCH_INIT;
  ib.num_requests = 1, ib.tenant = 1, ib.fact_ids = ids, ib.fact_offsets = offs, ib.block_tables = tables[1];
  ib.block_table_stride = TL, ib.block_table_len = TL, ib.first_slots = &slot1, ib.start_positions = &start1;
  kvi_capture c = KVI_CAPTURE_INIT;
  c.tenant = 2, c.fact_id = 1, c.block_table = tables[0], c.block_table_len = TL, c.first_slot = 3;
  c.num_tokens = 2 * sc.T, c.start_position = 11;
  const uint64_t cid = 2;
  const int32_t ctok = sc.T;
  kvi_encode_batch eb = KVI_ENCODE_BATCH_INIT;
  eb.num_captures = 1, eb.tenant = 2, eb.fact_ids = &cid, eb.num_tokens = &ctok, eb.block_tables = tables[1];
  eb.block_table_stride = TL, eb.block_table_len = TL, eb.first_slots = &slot1, eb.start_positions = &start1;
  float dev_scores[64], cpu_scores[64];
  int64_t plan = 0, skipped = -1;
  kvi_injector *hi, *di;
  kvi_encoder *he, *de;
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_inject(hi, &q, 1, NULL, NULL));
  CHECK_OK(kvi_inject_batched(hi, &ib, NULL, NULL));
  CHECK_OK(kvi_inject_deviation(hi, &q, 1, 1, cpu_scores, 64, KVI_MEMORY_HOST, NULL));
  CHECK_OK(kvi_encode(he, &c, 1, NULL));
  CHECK_OK(kvi_encode_batched(he, &eb, NULL));
  CUDA_OK(cudaSetDevice(other));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  expect_device(other, "kvi_injector_create");
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  expect_device(other, "kvi_encoder_create");
  CHECK_OK(kvi_inject(di, &q, 1, NULL, NULL));
  expect_device(other, "kvi_inject");
  CHECK_OK(kvi_inject_batched(di, &ib, NULL, NULL));
  expect_device(other, "kvi_inject_batched");
  CHECK_OK(kvi_inject_deviation(di, &q, 1, 1, dev_scores, 64, KVI_MEMORY_HOST, NULL));
  expect_device(other, "kvi_inject_deviation");
  CHECK_OK(kvi_inject_plan(di, 1, ids, 2, &plan));
  expect_device(other, "kvi_inject_plan");
  CHECK_OK(kvi_encode(de, &c, 1, NULL));
  expect_device(other, "kvi_encode");
  CHECK_OK(kvi_encode_batched(de, &eb, NULL));
  expect_device(other, "kvi_encode_batched");
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  expect_device(other, "kvi_injector_async_errors");
  kvi_encoder_destroy(de);
  expect_device(other, "kvi_encoder_destroy");
  kvi_injector_destroy(di);
  expect_device(other, "kvi_injector_destroy");
  CUDA_OK(cudaSetDevice(0));
  CUDA_OK(cudaDeviceSynchronize());
  assert_int_equal(skipped, 0);
  assert_int_equal(plan, 2 * sc.T + 2); /* facts 100 and 102: T and T + 2 tokens */
  double worst;
  const size_t bad = compare_caches(&w, false, 2e-6, &worst);
  if (bad) fail_msg("caller on device %d: %zu cache elements differ from the CPU store's", other, bad);
  const int64_t ntok = plan;
  for (int64_t t = 0; t < ntok; t++)
    if (!(fabs((double)dev_scores[t] - cpu_scores[t]) <= 2e-4 * fabs((double)cpu_scores[t]) + 1e-3))
      fail_msg("deviation token %lld: CUDA %.9g, CPU %.9g", (long long)t, (double)dev_scores[t],
               (double)cpu_scores[t]);
  const size_t n = (size_t)sc.L * 2 * sc.T * sc.H * sc.D;
  float *a = malloc(n * 8), *b = malloc(n * 8);
  for (int f = 1; f <= 2; f++) {
    const int32_t T = f == 1 ? 2 * sc.T : sc.T;
    const size_t m = (size_t)sc.L * T * sc.H * sc.D;
    kvi_kv_view va, vb;
    kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc.L, T, sc.H, sc.D, a, a + m);
    kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc.L, T, sc.H, sc.D, b, b + m);
    CHECK_OK(kvi_store_read(w.cpu, 2, (uint64_t)f, &va, NULL));
    CHECK_OK(kvi_store_read(w.gpu, 2, (uint64_t)f, &vb, NULL));
    for (size_t i = 0; i < 2 * m; i++)
      if (!(fabs(a[i] - b[i]) <= fmax(fabs(a[i]), 1e-2) / 64))
        fail_msg("capture %d element %zu: CUDA %a, CPU %a", f, i, (double)b[i], (double)a[i]);
  }
  free(a);
  free(b);
  kvi_encoder_destroy(he);
  kvi_injector_destroy(hi);
  free_world(&w);
}

/* kvi_encode with embeddings on a CUDA store that keeps a device directory:
 * a commit's rows go to the device in one launch at its end, and a fact that
 * a capture of a call replaces moves the tenant's last row, which an earlier
 * capture of the same call may have just staged. After each call every
 * fact's kept embedding equals the CPU store's (the device matrix rows), and
 * a search of its tenant with it finds the same ids with the same scores on
 * both stores (the device id rows). */
static void t_encode_embeddings(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  enum { DIM = 24, NCALL = 3, MAXC = 12, K = 16 };
  const scen sc = {1, 1, 8, 16, 64, 16, 0, KVI_DTYPE_BF16, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2, KVI_SCALE_NONE};
  world w;
  g_emb_dim = DIM;
  make_world(&w, &sc);
  g_emb_dim = 0;
  fill_bf16(&w);
  kvi_encoder *he, *de;
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  int32_t table[64];
  for (int32_t b = 0; b < 64; b++) table[b] = (b * 5) % 64;
  /* (tenant, fact id, replace) per capture of each call; tenants 9 and 10 are checked, fact ids < 16 */
  static const int32_t calls[NCALL][MAXC][3] = {
      {{9, 0, 0}, {9, 1, 0}, {9, 2, 0}, {9, 3, 0}, {9, 4, 0}, {9, 5, 0}, {-1, 0, 0}},
      {{9, 6, 0}, {9, 2, 1}, {9, 7, 0}, {10, 0, 0}, {10, 1, 0}, {9, 0, 1}, {10, 2, 0}, {9, 8, 0}, {9, 5, 1},
       {-1, 0, 0}},
      {{10, 3, 0}, {10, 0, 1}, {9, 9, 0}, {9, 3, 1}, {11, 0, 0}, {10, 4, 0}, {9, 6, 1}, {-1, 0, 0}},
  };
  static float emb[NCALL][MAXC][DIM];
  bool have[2][16] = {{false}};
  for (int c = 0; c < NCALL; c++) {
    kvi_capture caps[MAXC];
    int32_t n = 0;
    for (; n < MAXC && calls[c][n][0] >= 0; n++) {
      kvi_capture_init(&caps[n], sizeof caps[n]);
      caps[n].tenant = (uint64_t)calls[c][n][0];
      caps[n].fact_id = (uint64_t)calls[c][n][1];
      caps[n].flags = calls[c][n][2] ? KVI_PUT_REPLACE : 0;
      caps[n].block_table = table;
      caps[n].block_table_len = 64;
      caps[n].first_slot = 16 * (c * MAXC + n) % 768;
      caps[n].num_tokens = 1 + (c + 7 * n) % 20; /* directory rows of 2 and 3 words */
      caps[n].start_position = 3 * n + c;
      for (int e = 0; e < DIM; e++) emb[c][n][e] = rndf();
      caps[n].embedding = emb[c][n];
      if (calls[c][n][0] < 11) have[calls[c][n][0] - 9][calls[c][n][1]] = true;
    }
    CHECK_OK(kvi_encode(he, caps, n, NULL));
    CHECK_OK(kvi_encode(de, caps, n, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    for (int t = 0; t < 2; t++)
      for (int id = 0; id < 16; id++) {
        if (!have[t][id]) continue;
        const uint64_t tenant = 9 + (uint64_t)t;
        float a[DIM], b[DIM];
        CHECK_OK(kvi_store_get_embedding(w.cpu, tenant, (uint64_t)id, a));
        CHECK_OK(kvi_store_get_embedding(w.gpu, tenant, (uint64_t)id, b));
        if (memcmp(a, b, sizeof a) != 0)
          fail_msg("call %d: tenant %d fact %d: the device row differs from the CPU store's", c, 9 + t, id);
        uint64_t ci[K], gi[K];
        float cs[K], gs[K];
        int32_t cn = -1, gn = -2;
        CHECK_OK(kvi_store_search(w.cpu, a, 1, DIM, &tenant, K, ci, cs, &cn, NULL, NULL));
        CHECK_OK(kvi_store_search(w.gpu, a, 1, DIM, &tenant, K, gi, gs, &gn, NULL, NULL));
        assert_int_equal(cn, gn);
        for (int32_t r = 0; r < cn; r++)
          if (ci[r] != gi[r] || fabsf(cs[r] - gs[r]) > 1e-4f * (1.0f + fabsf(cs[r])))
            fail_msg("call %d: tenant %d, query of fact %d: result %d is %llu (%g) on the device, %llu (%g) on the CPU",
                     c, 9 + t, id, (int)r, (unsigned long long)gi[r], (double)gs[r], (unsigned long long)ci[r],
                     (double)cs[r]);
      }
  }
  kvi_store_stats hs = KVI_STORE_STATS_INIT, ds = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(w.cpu, &hs));
  CHECK_OK(kvi_store_stats_get(w.gpu, &ds));
  assert_int_equal(hs.facts, ds.facts);
  assert_int_equal(hs.bytes_payload, ds.bytes_payload);
  kvi_encoder_destroy(he);
  kvi_encoder_destroy(de);
  free_world(&w);
}
/* Token ids on a CUDA store (store.h, "Token ids"), against the CPU store:
 * captures (kvi_encode, kvi_encode_batched) and puts keep them; checked
 * injections (kvi_inject, kvi_inject_batched) write exactly what unchecked
 * ones write when the ids agree, and nothing (device cache byte for byte)
 * with KVI_ERR_TOKEN_MISMATCH when one differs or a fact has none. */
static void expect_token_ids_equal(const world *w, uint64_t tenant, uint64_t id, const int32_t *want, int32_t n) {
  int32_t a[64], b[64], na = -1, nb = -2;
  uint64_t ha = 1, hb = 2;
  CHECK_OK(kvi_store_fact_token_ids(w->cpu, tenant, id, a, 64, &na, &ha));
  CHECK_OK(kvi_store_fact_token_ids(w->gpu, tenant, id, b, 64, &nb, &hb));
  assert_int_equal(na, n);
  assert_int_equal(nb, n);
  assert_true(ha == hb);
  assert_true((n == 0) == (hb == 0));
  if (n) {
    assert_memory_equal(a, want, (size_t)n * sizeof *a);
    assert_memory_equal(b, want, (size_t)n * sizeof *b);
  }
}

static void expect_device_unchanged(const world *w, unsigned char *const *before, const char *what) {
  unsigned char *d = malloc(w->layer_bytes);
  for (int i = 0; i < w->ntensors; i++) {
    CUDA_OK(cudaMemcpy(d, w->dev[i], w->layer_bytes, cudaMemcpyDeviceToHost));
    if (memcmp(d, before[i], w->layer_bytes) != 0) fail_msg("%s: the device cache changed", what);
  }
  free(d);
}

static void t_token_ids(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  enum { NB = 64, T1 = 12, T2 = 7, T3 = 5, T4 = 9 };
  const scen sc = {2, 2, 64, 16, NB, 16, 0, KVI_DTYPE_FP32, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2,
                   KVI_SCALE_NONE};
  world w;
  static const float embv[4] = {0.5f, -1.0f, 2.0f, 0.25f}; /* embeddings: the device-id lookup needs them */
  g_emb_dim = 4;
  make_world(&w, &sc);
  g_emb_dim = 0;
  fill_bf16(&w);
  kvi_encoder *he, *de;
  kvi_injector *hi, *di;
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  int32_t table[NB];
  for (int32_t b = 0; b < NB; b++) table[b] = (b * 7) % NB;
  int32_t ids1[T1], ids2[T2], ids4[T4], ids5[T3];
  for (int i = 0; i < T1; i++) ids1[i] = 1000 + 13 * i;
  for (int i = 0; i < T2; i++) ids2[i] = i % 2 ? -i : 0x7fffffff - i;
  for (int i = 0; i < T4; i++) ids4[i] = 49000 + i;
  for (int i = 0; i < T3; i++) ids5[i] = 77 * i;
  /* tenant 3: facts 1, 2 captured with ids, 3 without (kvi_encode); 5 by kvi_encode_batched */
  kvi_capture caps[3];
  const int32_t ntok[3] = {T1, T2, T3};
  const int32_t *cid[3] = {ids1, ids2, NULL};
  for (int c = 0; c < 3; c++) {
    kvi_capture_init(&caps[c], sizeof caps[c]);
    caps[c].tenant = 3;
    caps[c].fact_id = 1 + (uint64_t)c;
    caps[c].block_table = table;
    caps[c].block_table_len = NB;
    caps[c].first_slot = 40 * c + 3;
    caps[c].num_tokens = ntok[c];
    caps[c].start_position = 40 * c + 3;
    caps[c].token_ids = cid[c];
    caps[c].embedding = embv;
  }
  CHECK_OK(kvi_encode(he, caps, 3, NULL));
  CHECK_OK(kvi_encode(de, caps, 3, NULL));
  kvi_encode_batch eb = KVI_ENCODE_BATCH_INIT;
  const uint64_t btenant = 3, bfact = 5;
  const int32_t boff[2] = {0, NB};
  const int64_t bslot = 200;
  const int32_t bnum = T3, bstart = 200;
  eb.num_captures = 1;
  eb.tenants = &btenant;
  eb.fact_ids = &bfact;
  eb.block_tables = table;
  eb.block_table_offsets = boff;
  eb.first_slots = &bslot;
  eb.num_tokens = &bnum;
  eb.start_positions = &bstart;
  eb.token_ids = ids5;
  eb.embeddings = embv;
  CHECK_OK(kvi_encode_batched(he, &eb, NULL));
  CHECK_OK(kvi_encode_batched(de, &eb, NULL));
  /* fact 4: a put with ids, the same host data into both stores */
  const size_t n4 = (size_t)sc.L * T4 * sc.H * sc.D;
  float *k4 = malloc(n4 * sizeof *k4), *v4 = malloc(n4 * sizeof *v4);
  for (size_t i = 0; i < n4; i++) k4[i] = rndf(), v4[i] = rndf();
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc.L, T4, sc.H, sc.D, k4, v4);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.token_ids = ids4;
  po.embedding = embv;
  CHECK_OK(kvi_store_put(w.cpu, 3, 4, &kv, &po, NULL));
  CHECK_OK(kvi_store_put(w.gpu, 3, 4, &kv, &po, NULL));
  free(k4);
  free(v4);
  CUDA_OK(cudaDeviceSynchronize());
  expect_token_ids_equal(&w, 3, 1, ids1, T1);
  expect_token_ids_equal(&w, 3, 2, ids2, T2);
  expect_token_ids_equal(&w, 3, 3, NULL, 0);
  expect_token_ids_equal(&w, 3, 4, ids4, T4);
  expect_token_ids_equal(&w, 3, 5, ids5, T3);

  /* checked injection of facts 4, 1, 2 behind slot 500 of another table: both
   * stores; the caches must then agree as the unchecked path's do */
  int32_t table2[NB];
  for (int32_t b = 0; b < NB; b++) table2[b] = NB - 1 - b;
  const uint64_t fids[3] = {4, 1, 2};
  int32_t expect[T4 + T1 + T2];
  memcpy(expect, ids4, sizeof ids4);
  memcpy(expect + T4, ids1, sizeof ids1);
  memcpy(expect + T4 + T1, ids2, sizeof ids2);
  kvi_inject_request rq;
  kvi_inject_request_init(&rq, sizeof rq);
  rq.tenant = 3;
  rq.fact_ids = fids;
  rq.num_facts = 3;
  rq.block_table = table2;
  rq.block_table_len = NB;
  rq.first_slot = 500;
  rq.start_position = 500;
  rq.expect_token_ids = expect;
  CHECK_OK(kvi_inject(hi, &rq, 1, NULL, NULL));
  CHECK_OK(kvi_inject(di, &rq, 1, NULL, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  double worst;
  size_t bad = compare_caches(&w, true, 0, &worst);
  if (bad) fail_msg("checked inject: %zu elements differ from the CPU store's", bad);

  /* snapshots of the device cache: every refused call below must leave it as it is */
  unsigned char *before[64];
  for (int i = 0; i < w.ntensors; i++) {
    before[i] = malloc(w.layer_bytes);
    CUDA_OK(cudaMemcpy(before[i], w.dev[i], w.layer_bytes, cudaMemcpyDeviceToHost));
  }
  /* one id differs inside fact 1 (its token 5): refused on both, naming it */
  expect[T4 + 5] += 1;
  rq.first_slot = rq.start_position = 700;
  assert_int_equal(kvi_inject(hi, &rq, 1, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  assert_int_equal(kvi_inject(di, &rq, 1, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  const char *msg = kvi_last_error();
  if (!strstr(msg, "fact 1 of tenant 3") || !strstr(msg, "token 5"))
    fail_msg("the mismatch message does not name the fact and token: %s", msg);
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a refused kvi_inject");
  expect[T4 + 5] -= 1;
  /* a fact without stored ids (fact 3) under a check: refused too */
  const uint64_t fid3 = 3;
  int32_t any3[T2] = {0};
  rq.fact_ids = &fid3;
  rq.num_facts = 1;
  rq.expect_token_ids = any3;
  assert_int_equal(kvi_inject(di, &rq, 1, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a checked kvi_inject of a fact without ids");

  /* kvi_inject_batched: two requests (facts {5}, {4, 2}), checked; then the
   * same with one id of the second request changed: nothing written */
  const uint64_t bf[3] = {5, 4, 2};
  const int32_t foff[3] = {0, 1, 3};
  int32_t btab[2 * NB];
  for (int32_t b = 0; b < NB; b++) btab[b] = b, btab[NB + b] = NB - 1 - b;
  const int64_t slots[2] = {300, 900};
  const int32_t starts[2] = {300, 900};
  int32_t bexp[T3 + T4 + T2];
  memcpy(bexp, ids5, sizeof ids5);
  memcpy(bexp + T3, ids4, sizeof ids4);
  memcpy(bexp + T3 + T4, ids2, sizeof ids2);
  const int64_t eoff[3] = {0, T3, T3 + T4 + T2};
  kvi_inject_batch ib = KVI_INJECT_BATCH_INIT;
  ib.num_requests = 2;
  ib.tenant = 3;
  ib.fact_ids = bf;
  ib.fact_offsets = foff;
  ib.block_tables = btab;
  ib.block_table_stride = NB;
  ib.block_table_len = NB;
  ib.first_slots = slots;
  ib.start_positions = starts;
  ib.expect_token_ids = bexp;
  ib.expect_token_offsets = eoff;
  bexp[T3 + T4 + T2 - 1] ^= 1; /* the last token of fact 2 */
  assert_int_equal(kvi_inject_batched(hi, &ib, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  assert_int_equal(kvi_inject_batched(di, &ib, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a refused kvi_inject_batched");
  bexp[T3 + T4 + T2 - 1] ^= 1;
  CHECK_OK(kvi_inject_batched(hi, &ib, NULL, NULL));
  CHECK_OK(kvi_inject_batched(di, &ib, NULL, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  bad = compare_caches(&w, true, 0, &worst);
  if (bad) fail_msg("checked kvi_inject_batched: %zu elements differ from the CPU store's", bad);
  /* device fact ids cannot be checked on the host: refused, nothing written */
  uint64_t *dfids;
  CUDA_OK(cudaMalloc((void **)&dfids, sizeof bf));
  CUDA_OK(cudaMemcpy(dfids, bf, sizeof bf, cudaMemcpyHostToDevice));
  for (int i = 0; i < w.ntensors; i++)
    CUDA_OK(cudaMemcpy(before[i], w.dev[i], w.layer_bytes, cudaMemcpyDeviceToHost));
  ib.fact_ids = dfids;
  ib.fact_ids_memory = KVI_MEMORY_DEVICE;
  assert_int_equal(kvi_inject_batched(di, &ib, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a checked kvi_inject_batched with device fact ids");
  int64_t skipped = -1;
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  assert_int_equal(skipped, 0);
  cudaFree(dfids);
  for (int i = 0; i < w.ntensors; i++) free(before[i]);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  kvi_encoder_destroy(he);
  kvi_encoder_destroy(de);
  free_world(&w);
}

/* Contexts and stale facts on a CUDA store (store.h, "Context and stale
 * facts"), against the CPU store: captures and puts keep their context; a
 * removal makes the facts after it stale on both; kvi_inject,
 * kvi_inject_batched (host and device fact ids) and kvi_retrieve_inject
 * refuse with KVI_ERR_STALE and leave the device cache byte for byte; a
 * saved and loaded CUDA store refuses the same facts; captured again, the
 * facts inject as the CPU store's do. */
static void expect_stale_both(const world *w, uint64_t tenant, const uint64_t *want, size_t n) {
  uint64_t a[16], b[16];
  size_t na = 99, nb = 98;
  CHECK_OK(kvi_store_stale(w->cpu, tenant, a, 16, &na));
  CHECK_OK(kvi_store_stale(w->gpu, tenant, b, 16, &nb));
  assert_int_equal(na, n);
  assert_int_equal(nb, n);
  if (n) {
    assert_memory_equal(a, want, n * sizeof *a);
    assert_memory_equal(b, want, n * sizeof *b);
  }
}

static void expect_refused_stale(kvi_status got, const char *needle) {
  assert_int_equal(got, KVI_ERR_STALE);
  if (!strstr(kvi_last_error(), needle)) fail_msg("the stale message does not say \"%s\": %s", needle, kvi_last_error());
}

static void t_stale(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  enum { NB = 64, T1 = 12, T2 = 7, T3 = 5, T4 = 9 };
  const scen sc = {2, 2, 64, 16, NB, 16, 0, KVI_DTYPE_FP32, KVI_DTYPE_BF16, KVI_CACHE_VLLM_FLASH_ATTN, 2,
                   KVI_SCALE_NONE};
  world w;
  static const float embv[4] = {0.5f, -1.0f, 2.0f, 0.25f}; /* the device paths need a store with embeddings */
  g_emb_dim = 4;
  make_world(&w, &sc);
  g_emb_dim = 0;
  fill_bf16(&w);
  kvi_encoder *he, *de;
  kvi_injector *hi, *di;
  CHECK_OK(kvi_encoder_create(&he, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_encoder_create(&de, w.gpu, &w.dl, NULL));
  CHECK_OK(kvi_injector_create(&hi, w.cpu, &w.hl, NULL));
  CHECK_OK(kvi_injector_create(&di, w.gpu, &w.dl, NULL));
  int32_t table[NB];
  for (int32_t b = 0; b < NB; b++) table[b] = (b * 7) % NB;
  /* tenant 3, the notes encoding's shape: 1; 2 after 1; 3 after 1 and 2 (captured in one call) */
  const uint64_t ctx2[1] = {1}, ctx3[2] = {1, 2}, ctx4[1] = {3};
  const uint64_t *cx[3] = {NULL, ctx2, ctx3};
  const int32_t ncx[3] = {0, 1, 2}, ntok[3] = {T1, T2, T3};
  kvi_capture caps[3];
  int32_t at = 3;
  for (int c = 0; c < 3; c++) {
    kvi_capture_init(&caps[c], sizeof caps[c]);
    caps[c].tenant = 3;
    caps[c].fact_id = 1 + (uint64_t)c;
    caps[c].block_table = table;
    caps[c].block_table_len = NB;
    caps[c].first_slot = at;
    caps[c].num_tokens = ntok[c];
    caps[c].start_position = at;
    caps[c].embedding = embv;
    caps[c].context_ids = cx[c];
    caps[c].num_context_ids = ncx[c];
    at += ntok[c];
  }
  CHECK_OK(kvi_encode(he, caps, 3, NULL));
  CHECK_OK(kvi_encode(de, caps, 3, NULL));
  /* fact 4 after 3: a put from host memory into both */
  const size_t n4 = (size_t)sc.L * T4 * sc.H * sc.D;
  float *k4 = malloc(n4 * sizeof *k4), *v4 = malloc(n4 * sizeof *v4);
  for (size_t i = 0; i < n4; i++) k4[i] = rndf(), v4[i] = rndf();
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, sc.L, T4, sc.H, sc.D, k4, v4);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = embv;
  po.context_ids = ctx4;
  po.num_context_ids = 1;
  CHECK_OK(kvi_store_put(w.cpu, 3, 4, &kv, &po, NULL));
  CHECK_OK(kvi_store_put(w.gpu, 3, 4, &kv, &po, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  uint64_t got[4];
  int32_t n = -1, st = -1;
  CHECK_OK(kvi_store_fact_context(w.gpu, 3, 3, got, 4, &n, &st));
  assert_true(n == 2 && st == 0 && got[0] == 1 && got[1] == 2);
  expect_stale_both(&w, 3, NULL, 0);

  /* removing 2 makes 3 (after it) and 4 (after 3) stale on both */
  CHECK_OK(kvi_store_remove(w.cpu, 3, 2));
  CHECK_OK(kvi_store_remove(w.gpu, 3, 2));
  const uint64_t s34[2] = {3, 4};
  expect_stale_both(&w, 3, s34, 2);
  kvi_store_stats ss = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(w.gpu, &ss));
  assert_int_equal(ss.facts_stale, 2);

  unsigned char *before[64];
  for (int i = 0; i < w.ntensors; i++) {
    before[i] = malloc(w.layer_bytes);
    CUDA_OK(cudaMemcpy(before[i], w.dev[i], w.layer_bytes, cudaMemcpyDeviceToHost));
  }
  int32_t table2[NB];
  for (int32_t b = 0; b < NB; b++) table2[b] = NB - 1 - b;
  const uint64_t fids[2] = {1, 3};
  kvi_inject_request rq;
  kvi_inject_request_init(&rq, sizeof rq);
  rq.tenant = 3, rq.fact_ids = fids, rq.num_facts = 2, rq.block_table = table2, rq.block_table_len = NB;
  rq.first_slot = rq.start_position = 500;
  expect_refused_stale(kvi_inject(hi, &rq, 1, NULL, NULL), "fact 3 of tenant 3 is stale");
  expect_refused_stale(kvi_inject(di, &rq, 1, NULL, NULL), "fact 3 of tenant 3 is stale");
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a kvi_inject of a stale fact");
  /* kvi_inject_batched: host fact ids ({1}, {4}), then the same ids in device memory */
  const uint64_t bf[2] = {1, 4};
  const int32_t foff[3] = {0, 1, 2};
  int32_t btab[2 * NB];
  for (int32_t b = 0; b < NB; b++) btab[b] = b, btab[NB + b] = NB - 1 - b;
  const int64_t slots[2] = {300, 900};
  const int32_t starts[2] = {300, 900};
  kvi_inject_batch ib = KVI_INJECT_BATCH_INIT;
  ib.num_requests = 2, ib.tenant = 3, ib.fact_ids = bf, ib.fact_offsets = foff, ib.block_tables = btab;
  ib.block_table_stride = NB, ib.block_table_len = NB, ib.first_slots = slots, ib.start_positions = starts;
  expect_refused_stale(kvi_inject_batched(hi, &ib, NULL, NULL), "request 1: fact 4 of tenant 3 is stale");
  expect_refused_stale(kvi_inject_batched(di, &ib, NULL, NULL), "request 1: fact 4 of tenant 3 is stale");
  uint64_t *dfids;
  CUDA_OK(cudaMalloc((void **)&dfids, sizeof bf));
  CUDA_OK(cudaMemcpy(dfids, bf, sizeof bf, cudaMemcpyHostToDevice));
  ib.fact_ids = dfids;
  ib.fact_ids_memory = KVI_MEMORY_DEVICE;
  expect_refused_stale(kvi_inject_batched(di, &ib, NULL, NULL), "tenant 3 has 2 stale facts");
  ib.fact_ids = bf;
  ib.fact_ids_memory = KVI_MEMORY_HOST;
  /* retrieval: the search could pick a stale fact */
  kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
  rr.tenant = 3, rr.block_table = table2, rr.block_table_len = NB, rr.first_slot = 700, rr.start_position = 700;
  uint64_t rids[4];
  int32_t rcnt, rtok;
  expect_refused_stale(kvi_retrieve_inject(hi, embv, 1, 4, &rr, 2, NULL, rids, &rcnt, &rtok, NULL),
                       "tenant 3 has 2 stale facts");
  expect_refused_stale(kvi_retrieve_inject(di, embv, 1, 4, &rr, 2, NULL, rids, &rcnt, &rtok, NULL),
                       "tenant 3 has 2 stale facts");
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a batched or retrieving injection of stale facts");
  int64_t skipped = -1;
  CHECK_OK(kvi_injector_async_errors(di, &skipped));
  assert_int_equal(skipped, 0);

  /* a saved CUDA store, loaded into a CUDA store, refuses the same facts */
  char dir[] = "/tmp/kvi-gpu-stale-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char path[64];
  snprintf(path, sizeof path, "%s/stale.kvi", dir);
  CHECK_OK(kvi_store_save(w.gpu, path, NULL));
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA;
  so.device = 0;
  so.dtype = sc.store_dtype; /* the file's dtype (the options' default is bf16) */
  so.budget_bytes = 64u << 20;
  so.embedding_dim = 4;
  kvi_store *l = NULL;
  CHECK_OK(kvi_store_load(&l, w.model, &so, path, NULL));
  size_t nl = 0;
  CHECK_OK(kvi_store_stale(l, 3, got, 4, &nl));
  assert_true(nl == 2 && got[0] == 3 && got[1] == 4);
  kvi_injector *li;
  CHECK_OK(kvi_injector_create(&li, l, &w.dl, NULL));
  assert_int_equal(kvi_inject(li, &rq, 1, NULL, NULL), KVI_ERR_STALE);
  CUDA_OK(cudaDeviceSynchronize());
  expect_device_unchanged(&w, before, "a loaded store's injection of a stale fact");
  kvi_injector_destroy(li);
  kvi_store_destroy(l);
  unlink(path);
  rmdir(dir);

  /* captured again after 1 alone, then 4 put again after 3: fresh, injected as the CPU store's */
  caps[2].flags = KVI_PUT_REPLACE;
  caps[2].context_ids = ctx2;
  caps[2].num_context_ids = 1;
  CHECK_OK(kvi_encode(he, &caps[2], 1, NULL));
  CHECK_OK(kvi_encode(de, &caps[2], 1, NULL));
  expect_stale_both(&w, 3, s34 + 1, 1);
  po.flags = KVI_PUT_REPLACE;
  CHECK_OK(kvi_store_put(w.cpu, 3, 4, &kv, &po, NULL));
  CHECK_OK(kvi_store_put(w.gpu, 3, 4, &kv, &po, NULL));
  expect_stale_both(&w, 3, NULL, 0);
  CHECK_OK(kvi_inject(hi, &rq, 1, NULL, NULL));
  CHECK_OK(kvi_inject(di, &rq, 1, NULL, NULL));
  CHECK_OK(kvi_inject_batched(hi, &ib, NULL, NULL));
  CHECK_OK(kvi_inject_batched(di, &ib, NULL, NULL));
  CUDA_OK(cudaDeviceSynchronize());
  double worst;
  const size_t bad = compare_caches(&w, true, 0, &worst);
  if (bad) fail_msg("fresh facts again: %zu elements differ from the CPU store's", bad);
  /* KVI_REMOVE_KEEP_DEPENDENTS: 1 removed alone on both */
  CHECK_OK(kvi_store_remove_ex(w.cpu, 3, 1, KVI_REMOVE_KEEP_DEPENDENTS));
  CHECK_OK(kvi_store_remove_ex(w.gpu, 3, 1, KVI_REMOVE_KEEP_DEPENDENTS));
  expect_stale_both(&w, 3, NULL, 0);
  free(k4);
  free(v4);
  cudaFree(dfids);
  for (int i = 0; i < w.ntensors; i++) free(before[i]);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
  kvi_encoder_destroy(he);
  kvi_encoder_destroy(de);
  free_world(&w);
}
#else
static void t_tier_inject(void **state) {
  (void)state;
  skip();
}
static void t_tier_inflight(void **state) {
  (void)state;
  skip();
}
static void t_tier_prefetch(void **state) {
  (void)state;
  skip();
}
static void t_tier_encode(void **state) {
  (void)state;
  skip();
}
static void t_table_memory_kind(void **state) {
  (void)state;
  skip();
}
static void t_bad_device_table(void **state) {
  (void)state;
  skip();
}
static void t_journal_encode(void **state) {
  (void)state;
  skip();
}
static void t_deferred_free(void **state) {
  (void)state;
  skip();
}
static void t_staging_ring(void **state) {
  (void)state;
  skip();
}
static void t_capture_chunks(void **state) {
  (void)state;
  skip();
}
static void t_caller_device(void **state) {
  (void)state;
  skip();
}
static void t_encode_embeddings(void **state) {
  (void)state;
  skip();
}
static void t_token_ids(void **state) {
  (void)state;
  skip();
}
static void t_stale(void **state) {
  (void)state;
  skip();
}
#endif

int main(void) {
  if (kvi_cuda_device_count(&g_devices) != KVI_OK) g_devices = 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(t_fa_bf16),       cmocka_unit_test(t_fi_hnd_fp16),  cmocka_unit_test(t_packed_fp32),
      cmocka_unit_test(t_table_exact),   cmocka_unit_test(t_table_bf16),   cmocka_unit_test(t_trtllm_fp8),
      cmocka_unit_test(t_sglang_e5m2),   cmocka_unit_test(t_hf_scalar),    cmocka_unit_test(t_fi_yarn_vec),
      cmocka_unit_test(t_fp8s_table),    cmocka_unit_test(t_fp8s_fp8cache), cmocka_unit_test(t_fp8s_vec8),
      cmocka_unit_test(t_fp8s_scalar),
      cmocka_unit_test(t_vllm_cpu_bf16), cmocka_unit_test(t_vllm_cpu_table), cmocka_unit_test(t_vllm_cpu_fp8),
      cmocka_unit_test(t_vt_fp16_table), cmocka_unit_test(t_vt_e5m2_gptj), cmocka_unit_test(t_mixed_bf16),
      cmocka_unit_test(t_mixed_fp8s),
      cmocka_unit_test(t_q4_table),      cmocka_unit_test(t_q4_hnd_fp16), cmocka_unit_test(t_q4_fp32_gptj),
      cmocka_unit_test(t_q4_fp8cache),   cmocka_unit_test(t_q4_e5m2_vt),  cmocka_unit_test(t_q4_mixed),
      cmocka_unit_test(t_q4_table_sole), cmocka_unit_test(t_q4_sole_h8), cmocka_unit_test(t_q4_split_h16),
      cmocka_unit_test(t_bad_device_table), cmocka_unit_test(t_table_memory_kind), cmocka_unit_test(t_deferred_free),
      cmocka_unit_test(t_staging_ring), cmocka_unit_test(t_capture_chunks),
      cmocka_unit_test(t_journal_encode),
      cmocka_unit_test(t_tier_inject),   cmocka_unit_test(t_tier_inflight), cmocka_unit_test(t_tier_prefetch),
      cmocka_unit_test(t_tier_encode),   cmocka_unit_test(t_caller_device), cmocka_unit_test(t_encode_embeddings),
      cmocka_unit_test(t_token_ids),     cmocka_unit_test(t_stale),
  };
  int failed = cmocka_run_group_tests_name("gpu-transfer", tests, NULL, NULL);
  if (failed) return 1;
  return g_devices == 0 ? 77 : 0;
}
