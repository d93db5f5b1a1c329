/*
 * gpu suite: the disk tier of CUDA stores (kvinject/store.h, "Disk tier"),
 * without and with a host tier, for bf16, fp8 and 4-bit storage, compared
 * bit for bit with a CPU store given the same puts: facts put from host and
 * device views through a device budget of a few pages are dropped to disk
 * and read back (reads, injections, prefetches), captures are written
 * through to the tenant's file, fact tiers agree with the stats, errors
 * leave the store usable, a tiered store drops its host-tier facts
 * least recently used first, and a capture larger than the staging writes
 * through whole. Every test skips, and the binary exits 77,
 * where no CUDA device answers.
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE /* mkdtemp */
#include <dirent.h>
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

#include "gpu_test.h"

static int g_devices;

#ifdef KVI_HAVE_CUDA

enum { L = 2, H = 2, D = 64, P = 16, BS = 16, NB = 64, NF = 20, DEV_PAGES = 6, HOST_PAGES = 12 };

/* A CUDA store with a disk tier in a fresh directory (a device budget of
 * DEV_PAGES pages, and HOST_PAGES pages of host tier when `host`) and a
 * memory-only CPU store, the reference; layers without RoPE, so that
 * injections and captures copy. */
typedef struct env {
  char dir[64];
  kvi_model *m;
  kvi_store *gpu, *cpu;
  kvi_dtype dt;
  bool host;
  uint64_t page_bytes;
} env;

static kvi_store_stats stats_of(const kvi_store *s) {
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  CHECK_OK(kvi_store_stats_get(s, &st));
  return st;
}

/* A store on the environment's model: CPU (memory only, or on e->dir when
 * owner is not NULL) or the CUDA one with the tiny budgets (on e->dir);
 * owner: its name in leases. */
static kvi_store *env_store(const env *e, kvi_backend b, const char *owner) {
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = b;
  so.device = b == KVI_BACKEND_CUDA ? 0 : -1;
  so.dtype = e->dt;
  so.page_tokens = P;
  so.budget_bytes = b == KVI_BACKEND_CUDA ? DEV_PAGES * e->page_bytes : 64u << 20;
  so.host_budget_bytes = b == KVI_BACKEND_CUDA && e->host ? HOST_PAGES * e->page_bytes : 0;
  so.disk_dir = owner ? e->dir : NULL;
  so.disk_owner = owner;
  kvi_store *s = NULL;
  CHECK_OK(kvi_store_create(&s, e->m, &so));
  return s;
}

static void env_make(env *e, kvi_dtype dt, bool host) {
  memset(e, 0, sizeof *e);
  snprintf(e->dir, sizeof e->dir, "/tmp/kvi-gpu-disk-XXXXXX");
  assert_non_null(mkdtemp(e->dir));
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L;
  mo.num_kv_heads = H;
  mo.head_size = D;
  CHECK_OK(kvi_model_create(&e->m, &mo));
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.style = KVI_ROPE_NONE;
  CHECK_OK(kvi_model_set_rope(e->m, -1, &r));
  e->dt = dt;
  e->host = host;
  e->cpu = env_store(e, KVI_BACKEND_CPU, NULL);
  e->page_bytes = stats_of(e->cpu).page_bytes;
  e->gpu = env_store(e, KVI_BACKEND_CUDA, "gpu");
}

static void env_free(env *e) {
  kvi_store_destroy(e->gpu);
  kvi_store_destroy(e->cpu);
  kvi_model_destroy(e->m);
  DIR *d = opendir(e->dir);
  if (d) {
    struct dirent *de;
    char p[400];
    while ((de = readdir(d)))
      if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
        snprintf(p, sizeof p, "%s/%s", e->dir, de->d_name);
        unlink(p);
      }
    closedir(d);
  }
  rmdir(e->dir);
}

static int32_t tokens_of(uint64_t id) { return 5 + (int32_t)(id * 7 % 28); } /* 5..32: one or two pages */

/* Puts fact `id` of `tenant` with T tokens of random fp32 values into both
 * stores: from a host view into the CPU store, and into the CUDA store from
 * the same host view (device false) or a device copy of it. */
static void put_both(const env *e, uint64_t tenant, uint64_t id, int32_t T, bool device) {
  const size_t n = (size_t)L * T * H * D;
  float *k = malloc(2 * n * sizeof *k);
  assert_non_null(k);
  for (size_t i = 0; i < 2 * n; i++) k[i] = rndf();
  kvi_kv_view hv;
  kvi_kv_view_contiguous(&hv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, k, k + n);
  CHECK_OK(kvi_store_put(e->cpu, tenant, id, &hv, NULL, NULL));
  if (!device) {
    CHECK_OK(kvi_store_put(e->gpu, tenant, id, &hv, NULL, NULL));
  } else {
    float *d;
    CUDA_OK(cudaMalloc((void **)&d, 2 * n * sizeof *d));
    CUDA_OK(cudaMemcpy(d, k, 2 * n * sizeof *d, cudaMemcpyHostToDevice));
    CUDA_OK(cudaDeviceSynchronize());
    kvi_kv_view dv;
    kvi_kv_view_contiguous(&dv, KVI_MEMORY_DEVICE, KVI_DTYPE_FP32, L, T, H, D, d, d + n);
    CHECK_OK(kvi_store_put(e->gpu, tenant, id, &dv, NULL, NULL));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaFree(d));
  }
  free(k);
}

/* Fact (tenant, id) of store a reads (into host memory, fp32) as from store b. */
static void expect_same_fact(const kvi_store *a, const kvi_store *b, uint64_t tenant, uint64_t id) {
  int32_t T = 0, Tb = 0;
  CHECK_OK(kvi_store_fact_tokens(a, tenant, id, &T));
  CHECK_OK(kvi_store_fact_tokens(b, tenant, id, &Tb));
  assert_int_equal(T, Tb);
  const size_t n = (size_t)L * T * H * D;
  float *x = malloc(2 * n * sizeof *x), *y = malloc(2 * n * sizeof *y);
  memset(x, 0xA5, 2 * n * sizeof *x); /* poison: every element must be written */
  memset(y, 0x5A, 2 * n * sizeof *y);
  kvi_kv_view vx, vy;
  kvi_kv_view_contiguous(&vx, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, x, x + n);
  kvi_kv_view_contiguous(&vy, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, y, y + n);
  CHECK_OK(kvi_store_read(a, tenant, id, &vx, NULL));
  CHECK_OK(kvi_store_read(b, tenant, id, &vy, NULL));
  if (memcmp(x, y, 2 * n * sizeof *x))
    fail_msg("fact %llu/%llu reads differently", (unsigned long long)tenant, (unsigned long long)id);
  free(x);
  free(y);
}

static int32_t tier_of(const kvi_store *s, uint64_t tenant, uint64_t id) {
  int32_t t = -1;
  CHECK_OK(kvi_store_fact_tier(s, tenant, id, &t));
  return t;
}

/* The tiers kvi_store_fact_tier reports for the facts of tenants 1 and 2
 * agree with the stats: the facts on disk counted, the device-tier and
 * host-tier facts' pages in use (at least: pages whose frees wait for device
 * work, clean host copies of device-tier facts), no host-tier fact without
 * a host tier. Returns how many facts are on disk. */
static uint64_t check_tiers(const env *e) {
  uint64_t disk = 0, dev_pages = 0, host_pages = 0;
  for (uint64_t tenant = 1; tenant <= 2; tenant++) {
    uint64_t ids[NF];
    size_t total = 0;
    CHECK_OK(kvi_store_list(e->gpu, tenant, ids, NF, &total));
    assert_true(total <= NF);
    for (size_t i = 0; i < total; i++) {
      int32_t T = 0;
      CHECK_OK(kvi_store_fact_tokens(e->gpu, tenant, ids[i], &T));
      const uint64_t pages = (uint64_t)(T + P - 1) / P;
      switch (tier_of(e->gpu, tenant, ids[i])) {
      case KVI_TIER_DISK: disk++; break;
      case KVI_TIER_DEVICE: dev_pages += pages; break;
      case KVI_TIER_HOST:
        if (!e->host) fail_msg("fact %llu is on a host tier the store lacks", (unsigned long long)ids[i]);
        host_pages += pages;
        break;
      default: fail_msg("fact %llu: no such tier", (unsigned long long)ids[i]);
      }
    }
  }
  const kvi_store_stats st = stats_of(e->gpu);
  assert_int_equal(st.facts_on_disk_only, disk);
  assert_int_equal(st.pages_host_total, e->host ? HOST_PAGES : 0);
  assert_int_equal(st.pages_total - st.pages_host_total, DEV_PAGES);
  assert_true(st.pages_used - st.pages_host_used >= dev_pages);
  assert_true(st.pages_host_used >= host_pages);
  return disk;
}

/* A vLLM flash-attention fp32 cache of NB blocks of BS slots per layer, in
 * host memory (for the CPU store) and device memory (for the CUDA one),
 * poisoned alike. */
typedef struct caches {
  size_t layer_bytes;
  void *host[L], *dev[L];
  kvi_cache_layout hl, dl;
  int32_t table[NB];
} caches;

static void caches_make(caches *c) {
  c->layer_bytes = (size_t)2 * NB * BS * H * D * sizeof(float);
  for (int l = 0; l < L; l++) {
    c->host[l] = malloc(c->layer_bytes);
    memset(c->host[l], 0xFF, c->layer_bytes);
    CUDA_OK(cudaMalloc(&c->dev[l], c->layer_bytes));
    CUDA_OK(cudaMemset(c->dev[l], 0xFF, c->layer_bytes));
  }
  CHECK_OK(kvi_cache_layout_preset(&c->hl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, BS, NB, c->host, NULL,
                                   NULL));
  CHECK_OK(kvi_cache_layout_preset(&c->dl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, BS, NB, c->dev, NULL,
                                   NULL));
  c->hl.memory = KVI_MEMORY_HOST;
  c->dl.memory = KVI_MEMORY_DEVICE;
  for (int b = 0; b < NB; b++) c->table[b] = (b * 37) % NB;
}

/* Both caches get the same random values, finite and exact in bf16 (a
 * bf16 capture is then the same on both backends whatever their rounding). */
static void caches_fill(caches *c) {
  const size_t n = c->layer_bytes / sizeof(float);
  for (int l = 0; l < L; l++) {
    uint32_t *u = c->host[l];
    for (size_t i = 0; i < n; i++) {
      const float x = rndf();
      memcpy(&u[i], &x, sizeof x);
      u[i] &= 0xffff0000u;
    }
    CUDA_OK(cudaMemcpy(c->dev[l], c->host[l], c->layer_bytes, cudaMemcpyHostToDevice));
  }
  CUDA_OK(cudaDeviceSynchronize());
}

static void caches_free(caches *c) {
  for (int l = 0; l < L; l++) {
    free(c->host[l]);
    cudaFree(c->dev[l]);
  }
}

static void expect_same_caches(const caches *c) {
  CUDA_OK(cudaDeviceSynchronize());
  unsigned char *d = malloc(c->layer_bytes);
  for (int l = 0; l < L; l++) {
    CUDA_OK(cudaMemcpy(d, c->dev[l], c->layer_bytes, cudaMemcpyDeviceToHost));
    if (memcmp(d, c->host[l], c->layer_bytes)) fail_msg("layer %d of the device cache differs from the host one", l);
  }
  free(d);
}

static kvi_inject_request req(const caches *c, uint64_t tenant, const uint64_t *ids, int32_t n, int64_t slot) {
  kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
  q.tenant = tenant;
  q.fact_ids = ids;
  q.num_facts = n;
  q.block_table = c->table;
  q.block_table_len = NB;
  q.first_slot = slot;
  q.start_position = (int32_t)slot + 3;
  return q;
}

/* Injects the same request from the CUDA store into the device cache and
 * from the CPU store into the host cache, and compares them. */
static void inject_both(const env *e, caches *c, kvi_store *gpu, const uint64_t *ids, int32_t n, int64_t slot) {
  kvi_injector *hi, *di;
  CHECK_OK(kvi_injector_create(&hi, e->cpu, &c->hl, NULL));
  CHECK_OK(kvi_injector_create(&di, gpu, &c->dl, NULL));
  const kvi_inject_request q = req(c, 1, ids, n, slot);
  CHECK_OK(kvi_inject(hi, &q, 1, NULL, NULL));
  CHECK_OK(kvi_inject(di, &q, 1, NULL, NULL));
  expect_same_caches(c);
  kvi_injector_destroy(hi);
  kvi_injector_destroy(di);
}

/* Up to `max` ids of facts [0, NF) of tenant 1 that are on disk only. */
static int32_t disk_ids(const env *e, uint64_t *out, int32_t max) {
  int32_t n = 0;
  for (uint64_t id = 0; id < NF && n < max; id++)
    if (tier_of(e->gpu, 1, id) == KVI_TIER_DISK) out[n++] = id;
  return n;
}

static void run_disk(kvi_dtype dt, bool host) {
  env e;
  env_make(&e, dt, host);
  /* puts from host and device views, through a device budget of 6 pages */
  for (uint64_t id = 0; id < NF; id++) put_both(&e, 1, id, tokens_of(id), id % 2 == 1);
  kvi_store_stats st = stats_of(e.gpu);
  assert_int_equal(st.facts, NF);
  assert_true(st.drops_to_disk > 0);
  assert_true(st.disk_writes >= NF);
  assert_true(check_tiers(&e) > 0);
  /* every fact reads back as the CPU store has it (those on disk read back,
   * dropping others), twice */
  for (int round = 0; round < 2; round++)
    for (uint64_t id = 0; id < NF; id++) expect_same_fact(e.gpu, e.cpu, 1, id);
  /* and keeps the same bytes (the device puts through the quantizing kernel: fp8 codes, scales
   * and key offsets, q4 codes and words) */
  for (uint64_t id = 0; id < NF; id++) expect_same_bytes(e.gpu, e.cpu, 1, id, dt, L, H, D, P, 0);
  assert_true(stats_of(e.gpu).disk_reads > 0);
  check_tiers(&e);

  /* injections of facts on disk only */
  caches c;
  caches_make(&c);
  uint64_t ids[NF];
  int32_t n = disk_ids(&e, ids, 2);
  assert_int_equal(n, 2);
  inject_both(&e, &c, e.gpu, ids, n, 3);
  check_tiers(&e);

  /* captures write through: the tenant's file loads into a CPU store (a
   * second store on the directory) with the bytes the CUDA store reads */
  caches_fill(&c);
  kvi_capture cap[2];
  for (int i = 0; i < 2; i++) {
    kvi_capture_init(&cap[i], sizeof cap[i]);
    cap[i].tenant = 2;
    cap[i].fact_id = (uint64_t)i;
    cap[i].block_table = c.table;
    cap[i].block_table_len = NB;
    cap[i].first_slot = 3 + 17 * i;
    cap[i].num_tokens = 17 + 9 * i;
    cap[i].start_position = 6 + 17 * i;
  }
  kvi_encoder *de, *he;
  CHECK_OK(kvi_encoder_create(&de, e.gpu, &c.dl, NULL));
  CHECK_OK(kvi_encoder_create(&he, e.cpu, &c.hl, NULL));
  CHECK_OK(kvi_encode(de, cap, 2, NULL));
  CHECK_OK(kvi_encode(he, cap, 2, NULL));
  kvi_encoder_destroy(de);
  kvi_encoder_destroy(he);
  kvi_store *loaded = env_store(&e, KVI_BACKEND_CPU, "loaded");
  CHECK_OK(kvi_store_prefetch(loaded, 2, NULL, 0, NULL));
  size_t count = 0;
  CHECK_OK(kvi_store_count(loaded, 2, &count));
  assert_int_equal(count, 2);
  for (uint64_t id = 0; id < 2; id++) {
    expect_same_fact(e.gpu, loaded, 2, id);
    if (dt == KVI_DTYPE_BF16) expect_same_fact(e.gpu, e.cpu, 2, id); /* captures agree across backends */
  }
  kvi_store_destroy(loaded);

  /* asynchronous prefetch: named facts on disk (the I/O thread reads them,
   * the next call publishes them), then injected */
  n = disk_ids(&e, ids, 2);
  assert_int_equal(n, 2);
  CHECK_OK(kvi_store_prefetch(e.gpu, 1, ids, n, NULL));
  inject_both(&e, &c, e.gpu, ids, n, 70);
  check_tiers(&e);
  /* and a whole tenant, by a second CUDA store on the directory that does
   * not have it yet */
  kvi_store *other = env_store(&e, KVI_BACKEND_CUDA, "other");
  CHECK_OK(kvi_store_prefetch(other, 1, NULL, 0, NULL));
  CHECK_OK(kvi_store_count(other, 1, &count));
  assert_int_equal(count, NF);
  /* the prefetch publishes the reads it settles to take their pages back
   * (memory holds a few of the facts), the wait the rest it started */
  const uint64_t queued = stats_of(other).facts_on_disk_only;
  CHECK_OK(kvi_store_prefetch_wait(other));
  const uint64_t on_disk = stats_of(other).facts_on_disk_only;
  assert_true(on_disk <= queued);
  uint64_t disk_tier = 0;
  for (uint64_t id = 0; id < NF; id++) disk_tier += tier_of(other, 1, id) == KVI_TIER_DISK;
  assert_int_equal(disk_tier, on_disk);
  const uint64_t last[2] = {NF - 1, 0};
  inject_both(&e, &c, other, last, 2, 140);
  for (uint64_t id = 0; id < NF; id++) expect_same_fact(other, e.cpu, 1, id);
  kvi_store_destroy(other);
  /* a CUDA store's I/O thread publishes nothing: with room for every fact,
   * all of them count as on disk after the prefetch, with no reader having
   * asked for one, until kvi_store_prefetch_wait publishes them all */
  {
    kvi_store_options so = KVI_STORE_OPTIONS_INIT;
    so.backend = KVI_BACKEND_CUDA, so.device = 0, so.dtype = e.dt, so.page_tokens = P;
    so.budget_bytes = 4 * NF * e.page_bytes;
    so.disk_dir = e.dir, so.disk_owner = "roomy";
    kvi_store *roomy = NULL;
    CHECK_OK(kvi_store_create(&roomy, e.m, &so));
    CHECK_OK(kvi_store_prefetch(roomy, 1, NULL, 0, NULL));
    assert_int_equal(stats_of(roomy).facts_on_disk_only, NF);
    CHECK_OK(kvi_store_prefetch_wait(roomy));
    assert_int_equal(stats_of(roomy).facts_on_disk_only, 0);
    for (uint64_t id = 0; id < NF; id++) {
      assert_int_equal(tier_of(roomy, 1, id), KVI_TIER_DEVICE);
      expect_same_fact(roomy, e.cpu, 1, id);
    }
    kvi_store_destroy(roomy);
  }

  /* errors leave the store usable: facts that cannot be on the device at
   * once, unknown facts, a fact larger than memory */
  for (uint64_t id = 0; id < NF; id++) ids[id] = id;
  kvi_injector *di;
  CHECK_OK(kvi_injector_create(&di, e.gpu, &c.dl, NULL));
  const kvi_inject_request all = req(&c, 1, ids, NF, 200);
  assert_int_equal(kvi_inject(di, &all, 1, NULL, NULL), KVI_ERR_CAPACITY);
  kvi_injector_destroy(di);
  const uint64_t unknown = 999;
  assert_int_equal(kvi_store_prefetch(e.gpu, 1, &unknown, 1, NULL), KVI_ERR_NOT_FOUND);
  int32_t T = 0;
  assert_int_equal(kvi_store_fact_tokens(e.gpu, 1, unknown, &T), KVI_ERR_NOT_FOUND);
  {
    const int32_t big = (HOST_PAGES + DEV_PAGES + 1) * P;
    const size_t nb = (size_t)L * big * H * D;
    float *k = calloc(2 * nb, sizeof *k);
    kvi_kv_view hv;
    kvi_kv_view_contiguous(&hv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, big, H, D, k, k + nb);
    assert_int_not_equal(kvi_store_put(e.gpu, 1, 500, &hv, NULL, NULL), KVI_OK);
    assert_int_equal(kvi_store_fact_tokens(e.gpu, 1, 500, &T), KVI_ERR_NOT_FOUND);
    free(k);
  }
  st = stats_of(e.gpu);
  assert_int_equal(st.facts, NF + 2);
  check_tiers(&e);
  for (uint64_t id = 0; id < NF; id++) expect_same_fact(e.gpu, e.cpu, 1, id);
  n = disk_ids(&e, ids, 2);
  assert_int_equal(n, 2);
  inject_both(&e, &c, e.gpu, ids, n, 300);
  caches_free(&c);
  env_free(&e);
}

#define DISK_TEST(name, dt, host)                                                                                 \
  static void name(void **state) {                                                                              \
    (void)state;                                                                                                \
    if (g_devices == 0) skip();                                                                                 \
    run_disk(dt, host);                                                                                         \
  }
DISK_TEST(t_disk_bf16, KVI_DTYPE_BF16, false)
DISK_TEST(t_disk_fp8, KVI_DTYPE_FP8_E4M3, false)
DISK_TEST(t_disk_q4, KVI_DTYPE_Q4, false)
DISK_TEST(t_disk_bf16_host, KVI_DTYPE_BF16, true)
DISK_TEST(t_disk_fp8_host, KVI_DTYPE_FP8_E4M3, true)
DISK_TEST(t_disk_q4_host, KVI_DTYPE_Q4, true)

/* A tiered store drops its host-tier facts least recently used first: facts
 * of one page fill the device tier (0..5) and the host tier (6..17); puts
 * drop the oldest host-tier facts; a fact read back from disk (onto the host
 * tier) becomes the most recent. */
static void t_disk_host_lru(void **state) {
  (void)state;
  if (g_devices == 0) skip();
  enum { FULL = DEV_PAGES + HOST_PAGES, LAST = FULL + 4 }; /* facts [0, LAST] */
  env e;
  env_make(&e, KVI_DTYPE_BF16, true);
  for (uint64_t id = 0; id < LAST; id++) put_both(&e, 1, id, 10, id % 2 == 1);
  for (uint64_t id = 0; id < LAST; id++) { /* the last four puts dropped the first four host-tier facts */
    const int32_t want = id < DEV_PAGES ? KVI_TIER_DEVICE : id < DEV_PAGES + 4 ? KVI_TIER_DISK : KVI_TIER_HOST;
    if (tier_of(e.gpu, 1, id) != want)
      fail_msg("after the puts, fact %llu is on tier %d, not %d", (unsigned long long)id, (int)tier_of(e.gpu, 1, id),
               (int)want);
  }
  expect_same_fact(e.gpu, e.cpu, 1, DEV_PAGES);     /* read back: drops fact DEV_PAGES + 4 */
  expect_same_fact(e.gpu, e.cpu, 1, DEV_PAGES + 1); /* drops DEV_PAGES + 5 */
  put_both(&e, 1, LAST, 10, false);                 /* drops DEV_PAGES + 6 */
  for (uint64_t id = 0; id <= LAST; id++) {
    const int32_t want = id < DEV_PAGES                            ? KVI_TIER_DEVICE
                         : id < DEV_PAGES + 2                      ? KVI_TIER_HOST
                         : id < DEV_PAGES + 7                      ? KVI_TIER_DISK
                                                                   : KVI_TIER_HOST;
    if (tier_of(e.gpu, 1, id) != want)
      fail_msg("fact %llu is on tier %d, not %d", (unsigned long long)id, (int)tier_of(e.gpu, 1, id), (int)want);
  }
  const kvi_store_stats st = stats_of(e.gpu);
  assert_int_equal(st.facts_on_disk_only, 5);
  assert_int_equal(st.pages_host_used, HOST_PAGES);
  assert_int_equal(st.pages_used - st.pages_host_used, DEV_PAGES);
  for (uint64_t id = 0; id <= LAST; id++) expect_same_fact(e.gpu, e.cpu, 1, id);
  env_free(&e);
}

/* A capture of more pages than the store's pinned staging holds (a fact of
 * one page and CAPS - 1 of two: 299 pages, the staging 256) writes through
 * to the tenant's file whole: the file loads into a CPU store with the
 * bytes the CUDA store reads, for bf16, fp8 (its scales and key offsets in
 * each record) and 4-bit. */
static void run_capture_rounds(kvi_dtype dt) {
  enum { CAPS = 150 };
  env e;
  env_make(&e, dt, false);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CUDA, so.device = 0, so.dtype = dt, so.page_tokens = P;
  so.budget_bytes = 2 * CAPS * e.page_bytes + 16 * e.page_bytes;
  so.disk_dir = e.dir, so.disk_owner = "rounds";
  kvi_store *big = NULL;
  CHECK_OK(kvi_store_create(&big, e.m, &so));
  caches c;
  caches_make(&c);
  caches_fill(&c);
  kvi_capture *cap = calloc(CAPS, sizeof *cap);
  assert_non_null(cap);
  for (int i = 0; i < CAPS; i++) { /* overlapping spans of the cache, 9 tokens then 17..32 */
    kvi_capture_init(&cap[i], sizeof cap[i]);
    cap[i].tenant = 3;
    cap[i].fact_id = (uint64_t)i;
    cap[i].block_table = c.table;
    cap[i].block_table_len = NB;
    cap[i].first_slot = (i * 5) % 900;
    cap[i].num_tokens = i == 0 ? 9 : 17 + i % 16;
    cap[i].start_position = (i * 5) % 900;
  }
  kvi_encoder *de;
  CHECK_OK(kvi_encoder_create(&de, big, &c.dl, NULL));
  CHECK_OK(kvi_encode(de, cap, CAPS, NULL));
  kvi_encoder_destroy(de);
  const kvi_store_stats st = stats_of(big);
  assert_int_equal(st.facts, CAPS);
  assert_int_equal(st.pages_used, 2 * CAPS - 1); /* all of them on the device, none dropped */
  kvi_store *loaded = env_store(&e, KVI_BACKEND_CPU, "loaded");
  CHECK_OK(kvi_store_prefetch(loaded, 3, NULL, 0, NULL));
  size_t count = 0;
  CHECK_OK(kvi_store_count(loaded, 3, &count));
  assert_int_equal(count, CAPS);
  for (uint64_t id = 0; id < CAPS; id++) expect_same_fact(big, loaded, 3, id);
  kvi_store_destroy(loaded);
  free(cap);
  caches_free(&c);
  kvi_store_destroy(big);
  env_free(&e);
}

#define ROUNDS_TEST(name, dt)                                                                                     \
  static void name(void **state) {                                                                              \
    (void)state;                                                                                                \
    if (g_devices == 0) skip();                                                                                 \
    run_capture_rounds(dt);                                                                                     \
  }
ROUNDS_TEST(t_disk_rounds_bf16, KVI_DTYPE_BF16)
ROUNDS_TEST(t_disk_rounds_fp8, KVI_DTYPE_FP8_E4M3)
ROUNDS_TEST(t_disk_rounds_q4, KVI_DTYPE_Q4)

#else /* no CUDA: every test skips */

static void t_skip(void **state) {
  (void)state;
  skip();
}
#define t_disk_bf16 t_skip
#define t_disk_fp8 t_skip
#define t_disk_q4 t_skip
#define t_disk_bf16_host t_skip
#define t_disk_fp8_host t_skip
#define t_disk_q4_host t_skip
#define t_disk_host_lru t_skip
#define t_disk_rounds_bf16 t_skip
#define t_disk_rounds_fp8 t_skip
#define t_disk_rounds_q4 t_skip

#endif

int main(void) {
  (void)g_rng;
  if (kvi_cuda_device_count(&g_devices) != KVI_OK) g_devices = 0;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(t_disk_bf16),      cmocka_unit_test(t_disk_fp8),      cmocka_unit_test(t_disk_q4),
      cmocka_unit_test(t_disk_bf16_host), cmocka_unit_test(t_disk_fp8_host), cmocka_unit_test(t_disk_q4_host),
      cmocka_unit_test(t_disk_host_lru),  cmocka_unit_test(t_disk_rounds_bf16), cmocka_unit_test(t_disk_rounds_fp8),
      cmocka_unit_test(t_disk_rounds_q4),
  };
  int failed = cmocka_run_group_tests_name("gpu-disk", tests, NULL, NULL);
  if (failed) return 1;
  return g_devices == 0 ? 77 : 0;
}
