/*
 * unit-store-errors: every way kvi_store_put and kvi_store_read can fail,
 * and the promise that a failed call changes nothing (no stats, no stored
 * bytes, no destination byte).
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#define L 3
#define H 4 /* tp 2, rank 1: 2 local heads */
#define LH 2
#define D 6
#define P 4
#define PAGES 8
#define FACT_T 6 /* fact (1, 10): 2 pages */

typedef struct fixture {
  kvi_model *m;
  kvi_store *s;
  rng r;
  kvbuf fact;         /* bf16 source of fact (1, 10); the store is bf16, so bit-exact */
  kvbuf good;         /* a valid fp32 source of 5 tokens for new facts */
  kvi_store_stats snap;
  kvi_store *aux;     /* a second store a test may create; freed by teardown */
} fixture;

static uint64_t page_bytes(void) { return (uint64_t)P * L * 2 * LH * D * 2; }

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  assert_non_null(f);
  rng_seed(&f->r, "fixture");
  f->m = make_model(L, H, D, 1, 2);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, P, page_bytes() * PAGES);
  assert_ok(kvi_store_create(&f->s, f->m, &o));
  kvbuf_make(&f->fact, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, FACT_T, LH, D);
  kvbuf_fill(&f->fact, &f->r);
  assert_ok(kvi_store_put(f->s, 1, 10, &f->fact.v, NULL, NULL));
  kvbuf_make(&f->good, LAYOUT_PADDED, KVI_DTYPE_FP32, L, 5, LH, D);
  kvbuf_fill(&f->good, &f->r);
  f->snap = store_stats(f->s);
  assert_int_equal(f->snap.pages_used, 2);
  assert_int_equal(f->snap.facts, 1);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  kvi_store_destroy(f->aux);
  kvi_store_destroy(f->s);
  kvi_model_destroy(f->m);
  kvbuf_free(&f->fact);
  kvbuf_free(&f->good);
  free(f);
  return 0;
}

static void assert_stats_equal(const kvi_store_stats *a, const kvi_store_stats *b) {
  assert_int_equal(a->backend, b->backend);
  assert_int_equal(a->device, b->device);
  assert_int_equal(a->dtype, b->dtype);
  assert_int_equal(a->page_tokens, b->page_tokens);
  assert_int_equal(a->embedding_dim, b->embedding_dim);
  assert_int_equal(a->page_bytes, b->page_bytes);
  assert_int_equal(a->pages_total, b->pages_total);
  assert_int_equal(a->pages_used, b->pages_used);
  assert_int_equal(a->bytes_reserved, b->bytes_reserved);
  assert_int_equal(a->bytes_used, b->bytes_used);
  assert_int_equal(a->bytes_payload, b->bytes_payload);
  assert_int_equal(a->facts, b->facts);
  assert_int_equal(a->tenants, b->tenants);
}

/* Fact (1, 10) holds f->fact's bytes. */
static void assert_fact_intact(fixture *f) {
  kvbuf out;
  kvbuf_make(&out, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, FACT_T, LH, D);
  assert_ok(kvi_store_read(f->s, 1, 10, &out.v, NULL));
  assert_memory_equal(out.mem, f->fact.mem, out.bytes);
  kvbuf_free(&out);
  int32_t t = 0;
  assert_ok(kvi_store_fact_tokens(f->s, 1, 10, &t));
  assert_int_equal(t, FACT_T);
}

/* Nothing changed since the fixture (or the last snapshot). */
static void assert_unchanged(fixture *f) {
  const kvi_store_stats now = store_stats(f->s);
  assert_stats_equal(&now, &f->snap);
  assert_fact_intact(f);
  int32_t t = -5;
  assert_status(kvi_store_fact_tokens(f->s, 1, 11, &t), KVI_ERR_NOT_FOUND);
  assert_int_equal(t, -5);
  size_t n = 0;
  assert_ok(kvi_store_count(f->s, 1, &n));
  assert_int_equal(n, now.facts);
}

/* The message of the last failed put/read, saved before assert_unchanged's
 * own (failing) lookups replace it. */
static char saved_error[512];

#define assert_saved_error_has(fn, needle)                                                          \
  do {                                                                                             \
    if (!strstr(saved_error, (fn)) || !strstr(saved_error, (needle)))                              \
      fail_msg("kvi_last_error() was \"%s\", expected it to contain \"%s\" and \"%s\"", saved_error, \
               (fn), (needle));                                                                    \
  } while (0)

/* A put of `v` as new fact (1, 11) that must fail with `want`. */
static void put_fails(fixture *f, const kvi_kv_view *v, const kvi_put_options *o, kvi_status want) {
  assert_status(kvi_store_put(f->s, 1, 11, v, o, NULL), want);
  snprintf(saved_error, sizeof saved_error, "%s", kvi_last_error());
  assert_true(strlen(saved_error) > 0);
  assert_unchanged(f);
}

/* ------------------------------------------------------------------------ */
/* put                                                                      */
/* ------------------------------------------------------------------------ */

static void test_put_null_arguments(void **state) {
  fixture *f = *state;
  assert_status(kvi_store_put(NULL, 1, 11, &f->good.v, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_unchanged(f);
  put_fails(f, NULL, NULL, KVI_ERR_INVALID_ARGUMENT);
  kvi_kv_view v = f->good.v;
  v.k = NULL;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v = f->good.v;
  v.v = NULL;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  /* the control: the same view is fine */
  assert_ok(kvi_store_put(f->s, 1, 11, &f->good.v, NULL, NULL));
}

static void test_put_struct_sizes(void **state) {
  fixture *f = *state;
  kvi_kv_view v = f->good.v;
  v.struct_size = sizeof v - 8;
  put_fails(f, &v, NULL, KVI_ERR_STRUCT_SIZE);
  v.struct_size = 0;
  put_fails(f, &v, NULL, KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_kv_view v;
    unsigned char later[16];
  } big;
  memset(&big, 0, sizeof big);
  big.v = f->good.v;
  big.v.struct_size = sizeof big;
  big.later[9] = 3;
  put_fails(f, &big.v, NULL, KVI_ERR_STRUCT_SIZE);

  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.struct_size = offsetof(kvi_put_options, token_ids) - 4; /* short of the first version */
  put_fails(f, &f->good.v, &o, KVI_ERR_STRUCT_SIZE);
  struct {
    kvi_put_options o;
    unsigned char later[16];
  } bigo;
  memset(&bigo, 0, sizeof bigo);
  bigo.o = (kvi_put_options)KVI_PUT_OPTIONS_INIT;
  bigo.o.struct_size = sizeof bigo;
  bigo.later[15] = 1;
  put_fails(f, &f->good.v, &bigo.o, KVI_ERR_STRUCT_SIZE);
  bigo.later[15] = 0;
  assert_ok(kvi_store_put(f->s, 1, 11, &f->good.v, &bigo.o, NULL));
}

static void test_put_memory_field(void **state) {
  fixture *f = *state;
  kvi_kv_view v = f->good.v;
  v.memory = (kvi_memory)0;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v.memory = (kvi_memory)3;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v.memory = KVI_MEMORY_DEVICE; /* a CPU store reaches host memory only */
  put_fails(f, &v, NULL, KVI_ERR_MEMORY_KIND);
  assert_saved_error_has("kvi_store_put", "device");
}

static void test_put_dtypes(void **state) {
  fixture *f = *state;
  kvi_kv_view v = f->good.v;
  v.dtype = KVI_DTYPE_FP8_E4M3;
  put_fails(f, &v, NULL, KVI_ERR_MISMATCH);
  v.dtype = KVI_DTYPE_FP8_E5M2;
  put_fails(f, &v, NULL, KVI_ERR_MISMATCH);
  v.dtype = (kvi_dtype)0;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v.dtype = (kvi_dtype)99;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  assert_saved_error_has("kvi_store_put", "99");
}

static void test_put_token_count(void **state) {
  fixture *f = *state;
  const int32_t bad[] = {0, -1, INT32_MIN};
  for (size_t i = 0; i < 3; i++) {
    kvi_kv_view v = f->good.v;
    v.num_tokens = bad[i];
    put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
    char num[16];
    snprintf(num, sizeof num, "%d", (int)bad[i]);
    assert_saved_error_has("kvi_store_put", num);
  }
}

static void test_put_shape_mismatch(void **state) {
  fixture *f = *state;
  struct {
    int32_t layers, heads, head_size;
    const char *value;
  } bad[] = {
      {L + 1, LH, D, "4"}, {L - 1, LH, D, "2"}, {L, H, D, "4"},      /* all heads instead of the local ones */
      {L, 1, D, "1"},      {L, LH, D + 1, "7"}, {L, LH, D - 1, "5"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kvi_kv_view v = f->good.v;
    v.num_layers = bad[i].layers;
    v.num_heads = bad[i].heads;
    v.head_size = bad[i].head_size;
    put_fails(f, &v, NULL, KVI_ERR_MISMATCH);
    assert_saved_error_has("kvi_store_put", bad[i].value);
  }
}

static void test_put_bad_strides(void **state) {
  fixture *f = *state;
  kvi_kv_view v = f->good.v;
  v.layer_stride = -1;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v = f->good.v;
  v.token_stride = -(int64_t)LH * D;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v = f->good.v;
  v.head_stride = INT64_MIN;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);

  /* extents whose byte offsets overflow 64 bits */
  v = f->good.v;
  v.layer_stride = INT64_MAX / 2; /* 2 * that + the rest overflows */
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v = f->good.v;
  v.token_stride = (int64_t)1 << 59; /* fits in elements, not in fp32 bytes */
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v = f->good.v;
  v.head_stride = INT64_MAX;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  v = f->good.v;
  v.layer_stride = INT64_MAX / 3;
  v.token_stride = INT64_MAX / 5;
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
  /* the last element sits exactly at offset INT64_MAX: its end does not fit */
  v = f->good.v;
  v.token_stride = 0;
  v.head_stride = 0;
  v.layer_stride = (INT64_MAX - (D - 1)) / (L - 1);
  assert_true((L - 1) * v.layer_stride + (D - 1) == INT64_MAX);
  put_fails(f, &v, NULL, KVI_ERR_INVALID_ARGUMENT);
}

/* glibc's MALLOC_PERTURB_ (which meson sets) fills every malloc'd byte: a
 * library that allocates per-page bookkeeping before it checks the page count
 * would then touch gigabytes here. Off for the huge-count puts only. */
static void perturb_off(void) {
#if defined(__GLIBC__) && defined(M_PERTURB)
  mallopt(M_PERTURB, 0);
#endif
}

static void perturb_restore(void) {
#if defined(__GLIBC__) && defined(M_PERTURB)
  const char *e = getenv("MALLOC_PERTURB_");
  if (e) mallopt(M_PERTURB, atoi(e));
#endif
}

/* A broadcast source can declare any token count: 2^31 - 1 tokens need
 * ceil((2^31 - 1) / page_tokens) pages, far more than the store has. */
static void test_put_huge_token_count(void **state) {
  fixture *f = *state;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_BF16, 4096, page_bytes() / P * 4096 * 2);
  assert_ok(kvi_store_create(&f->aux, f->m, &o));
  kvi_store *s = f->aux;
  kvi_kv_view v = f->good.v;
  v.token_stride = 0;
  const int32_t counts[] = {INT32_MAX, INT32_MAX - 4095, 3 * 4096 + 1};
  for (size_t i = 0; i < 3; i++) {
    v.num_tokens = counts[i];
    perturb_off();
    const kvi_status st = kvi_store_put(s, 1, 1, &v, NULL, NULL);
    perturb_restore();
    snprintf(saved_error, sizeof saved_error, "%s", kvi_last_error());
    assert_status(st, KVI_ERR_CAPACITY);
    char num[32];
    snprintf(num, sizeof num, "%lld", (long long)(((int64_t)counts[i] + 4095) / 4096)); /* 524288, 524287, 4 */
    assert_saved_error_has("kvi_store_put", num);
    assert_int_equal(store_stats(s).pages_used, 0);
    assert_int_equal(store_stats(s).facts, 0);
  }
}

static void test_put_unknown_flags(void **state) {
  fixture *f = *state;
  const uint32_t bad[] = {0x2u, 0x80000000u, 0xffffffffu, KVI_PUT_REPLACE | 0x10u};
  for (size_t i = 0; i < 4; i++) {
    kvi_put_options o = KVI_PUT_OPTIONS_INIT;
    o.flags = bad[i];
    put_fails(f, &f->good.v, &o, KVI_ERR_INVALID_ARGUMENT);
    /* also as a replacement of the existing fact */
    assert_status(kvi_store_put(f->s, 1, 10, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_unchanged(f);
  }
}

static void test_put_exists_and_replace(void **state) {
  fixture *f = *state;
  const uint64_t bpt = page_bytes() / P;
  /* same key, no flag */
  assert_status(kvi_store_put(f->s, 1, 10, &f->good.v, NULL, NULL), KVI_ERR_EXISTS);
  assert_last_error_has("kvi_store_put", "10");
  assert_unchanged(f);
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  assert_status(kvi_store_put(f->s, 1, 10, &f->fact.v, &o, NULL), KVI_ERR_EXISTS);
  assert_unchanged(f);

  /* replace with more tokens: 9 tokens = 3 pages */
  o.flags = KVI_PUT_REPLACE;
  kvbuf nine;
  kvbuf_make(&nine, LAYOUT_TOKEN_MAJOR, KVI_DTYPE_BF16, L, 9, LH, D);
  kvbuf_fill(&nine, &f->r);
  assert_ok(kvi_store_put(f->s, 1, 10, &nine.v, &o, NULL));
  kvi_store_stats st = store_stats(f->s);
  assert_int_equal(st.facts, 1);
  assert_int_equal(st.tenants, 1);
  assert_int_equal(st.pages_used, 3);
  assert_int_equal(st.bytes_used, 3 * page_bytes());
  assert_int_equal(st.bytes_payload, 9 * bpt);
  int32_t t = 0;
  assert_ok(kvi_store_fact_tokens(f->s, 1, 10, &t));
  assert_int_equal(t, 9);
  kvbuf out;
  kvbuf_make(&out, LAYOUT_TOKEN_MAJOR, KVI_DTYPE_BF16, L, 9, LH, D);
  assert_ok(kvi_store_read(f->s, 1, 10, &out.v, NULL));
  assert_memory_equal(out.mem, nine.mem, out.bytes);
  kvbuf_free(&out);
  /* the old token count no longer reads */
  kvbuf old;
  kvbuf_make(&old, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, FACT_T, LH, D);
  assert_status(kvi_store_read(f->s, 1, 10, &old.v, NULL), KVI_ERR_MISMATCH);
  kvbuf_free(&old);

  /* replace with fewer: 1 token = 1 page */
  kvbuf one;
  kvbuf_make(&one, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, 1, LH, D);
  kvbuf_fill(&one, &f->r);
  assert_ok(kvi_store_put(f->s, 1, 10, &one.v, &o, NULL));
  st = store_stats(f->s);
  assert_int_equal(st.pages_used, 1);
  assert_int_equal(st.bytes_payload, bpt);
  assert_int_equal(st.facts, 1);
  kvbuf_make(&out, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, 1, LH, D);
  assert_ok(kvi_store_read(f->s, 1, 10, &out.v, NULL));
  assert_memory_equal(out.mem, one.mem, out.bytes);
  kvbuf_free(&out);

  /* REPLACE on an absent key stores it */
  assert_ok(kvi_store_put(f->s, 1, 12, &one.v, &o, NULL));
  assert_int_equal(store_stats(f->s).facts, 2);
  assert_int_equal(store_stats(f->s).pages_used, 2);
  kvbuf_free(&nine);
  kvbuf_free(&one);
}

/* A replacement that fails for any reason leaves the old fact as it was. */
static void test_put_failed_replace_keeps_old(void **state) {
  fixture *f = *state;
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.flags = KVI_PUT_REPLACE;
  kvi_kv_view v = f->good.v;
  v.num_heads = H;
  assert_status(kvi_store_put(f->s, 1, 10, &v, &o, NULL), KVI_ERR_MISMATCH);
  assert_unchanged(f);
  v = f->good.v;
  v.memory = KVI_MEMORY_DEVICE;
  assert_status(kvi_store_put(f->s, 1, 10, &v, &o, NULL), KVI_ERR_MEMORY_KIND);
  assert_unchanged(f);
  v = f->good.v;
  v.num_tokens = 0;
  assert_status(kvi_store_put(f->s, 1, 10, &v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_unchanged(f);
  float emb[3] = {1, 2, 3};
  o.embedding = emb; /* the store keeps no embeddings */
  assert_status(kvi_store_put(f->s, 1, 10, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_unchanged(f);
}

static void test_put_capacity(void **state) {
  fixture *f = *state;
  /* (1, 11): 24 tokens = 6 pages; with (1, 10)'s 2 the store is full */
  kvbuf big;
  kvbuf_make(&big, LAYOUT_HEAD_MAJOR, KVI_DTYPE_FP16, L, 6 * P, LH, D);
  kvbuf_fill(&big, &f->r);
  assert_ok(kvi_store_put(f->s, 1, 11, &big.v, NULL, NULL));
  kvi_store_stats full = store_stats(f->s);
  assert_int_equal(full.pages_used, PAGES);
  assert_int_equal(full.bytes_used, full.bytes_reserved);

  kvbuf one;
  kvbuf_make(&one, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 1, LH, D);
  kvbuf_fill(&one, &f->r);
  assert_status(kvi_store_put(f->s, 2, 1, &one.v, NULL, NULL), KVI_ERR_CAPACITY);
  assert_last_error_has("kvi_store_put", "pages");
  kvi_store_stats now = store_stats(f->s);
  assert_stats_equal(&now, &full);
  size_t n = 9;
  assert_ok(kvi_store_count(f->s, 2, &n));
  assert_int_equal(n, 0);

  /* a replacement is written before the old copy is freed: it needs room
   * for both, even when it is smaller than the fact it replaces */
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.flags = KVI_PUT_REPLACE;
  assert_status(kvi_store_put(f->s, 1, 10, &one.v, &o, NULL), KVI_ERR_CAPACITY);
  now = store_stats(f->s);
  assert_stats_equal(&now, &full);
  assert_fact_intact(f);

  /* free 6 pages; replacing (1, 10) by 6 pages fits now, 7 pages does not */
  assert_ok(kvi_store_remove(f->s, 1, 11));
  assert_int_equal(store_stats(f->s).pages_used, 2);
  kvbuf seven;
  kvbuf_make(&seven, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 6 * P + 1, LH, D);
  kvbuf_fill(&seven, &f->r);
  assert_status(kvi_store_put(f->s, 1, 10, &seven.v, &o, NULL), KVI_ERR_CAPACITY);
  assert_int_equal(store_stats(f->s).pages_used, 2);
  assert_fact_intact(f);
  assert_ok(kvi_store_put(f->s, 1, 10, &big.v, &o, NULL));
  now = store_stats(f->s);
  assert_int_equal(now.pages_used, 6);
  assert_int_equal(now.facts, 1);
  /* a new fact of exactly the free pages fits */
  kvbuf two;
  kvbuf_make(&two, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 2 * P, LH, D);
  kvbuf_fill(&two, &f->r);
  assert_ok(kvi_store_put(f->s, 3, 3, &two.v, NULL, NULL));
  assert_int_equal(store_stats(f->s).pages_used, PAGES);
  assert_status(kvi_store_put(f->s, 3, 4, &one.v, NULL, NULL), KVI_ERR_CAPACITY);
  kvbuf_free(&big);
  kvbuf_free(&one);
  kvbuf_free(&seven);
  kvbuf_free(&two);
}

/* ------------------------------------------------------------------------ */
/* embeddings                                                               */
/* ------------------------------------------------------------------------ */

#define EMB 5

static void test_put_embeddings(void **state) {
  fixture *f = *state;
  kvi_store_options so = cpu_store_options(KVI_DTYPE_BF16, P, page_bytes() * 8);
  so.embedding_dim = EMB;
  assert_ok(kvi_store_create(&f->aux, f->m, &so));
  kvi_store *s = f->aux;

  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  /* missing */
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  /* not finite */
  const float bad_vals[] = {NAN, INFINITY, -INFINITY};
  for (size_t i = 0; i < 3; i++) {
    float e[EMB] = {0.5f, -1.0f, 2.0f, 3.0f, 4.0f};
    e[(i + 2) % EMB] = bad_vals[i];
    o.embedding = e;
    assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_store_put", "embedding");
  }
  uint16_t h16[EMB] = {0x3c00, 0x7c00, 0x4000, 0x4200, 0x4400}; /* fp16 inf */
  o.embedding = h16;
  o.embedding_dtype = KVI_DTYPE_FP16;
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  uint16_t b16[EMB] = {0x3f80, 0x4000, 0x7fc0, 0x4040, 0x4080}; /* bf16 NaN */
  o.embedding = b16;
  o.embedding_dtype = KVI_DTYPE_BF16;
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  float ok[EMB] = {0.25f, -1.5f, 1e30f, -7e-20f, 3.0f};
  o.embedding = ok;
  o.embedding_dtype = (kvi_dtype)0;
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  o.embedding_dtype = KVI_DTYPE_FP32;
  o.embedding_memory = (kvi_memory)0;
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  o.embedding_memory = KVI_MEMORY_DEVICE;
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_MEMORY_KIND);
  o.embedding_memory = KVI_MEMORY_HOST;
  kvi_store_stats st = store_stats(s);
  assert_int_equal(st.facts, 0);
  assert_int_equal(st.pages_used, 0);

  /* fp32 kept as is */
  assert_ok(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL));
  float out[EMB + 1];
  out[EMB] = 12345.0f;
  assert_ok(kvi_store_get_embedding(s, 1, 1, out));
  assert_memory_equal(out, ok, sizeof ok);
  assert_true(out[EMB] == 12345.0f);

  /* fp16 and bf16 converted exactly to fp32 */
  uint16_t e16[EMB], eb[EMB];
  for (int i = 0; i < EMB; i++) e16[i] = (uint16_t)rand_bits(&f->r, KVI_DTYPE_FP16);
  for (int i = 0; i < EMB; i++) eb[i] = (uint16_t)rand_bits(&f->r, KVI_DTYPE_BF16);
  e16[0] = 0x0001; /* subnormal */
  e16[1] = 0x7bff; /* 65504 */
  o.embedding = e16;
  o.embedding_dtype = KVI_DTYPE_FP16;
  assert_ok(kvi_store_put(s, 1, 2, &f->good.v, &o, NULL));
  o.embedding = eb;
  o.embedding_dtype = KVI_DTYPE_BF16;
  assert_ok(kvi_store_put(s, 2, 2, &f->good.v, &o, NULL));
  assert_ok(kvi_store_get_embedding(s, 1, 2, out));
  for (int i = 0; i < EMB; i++) assert_int_equal(f2u(out[i]), f2u(ref_f16_to_f32(e16[i])));
  assert_true(out[0] == 0x1p-24f);
  assert_true(out[1] == 65504.0f);
  assert_ok(kvi_store_get_embedding(s, 2, 2, out));
  for (int i = 0; i < EMB; i++) assert_int_equal(f2u(out[i]), f2u(ref_bf16_to_f32(eb[i])));

  /* a failed replace keeps the old embedding; a good one changes it */
  float nan_e[EMB] = {1, 2, NAN, 4, 5};
  o.embedding = nan_e;
  o.embedding_dtype = KVI_DTYPE_FP32;
  o.flags = KVI_PUT_REPLACE;
  assert_status(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_ok(kvi_store_get_embedding(s, 1, 1, out));
  assert_memory_equal(out, ok, sizeof ok);
  float other[EMB] = {9, 8, 7, 6, 5};
  o.embedding = other;
  assert_ok(kvi_store_put(s, 1, 1, &f->good.v, &o, NULL));
  assert_ok(kvi_store_get_embedding(s, 1, 1, out));
  assert_memory_equal(out, other, sizeof other);

  /* unknown fact, tenant isolation, NULLs */
  for (int i = 0; i < EMB; i++) out[i] = -3.0f;
  assert_status(kvi_store_get_embedding(s, 1, 99, out), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_get_embedding(s, 3, 1, out), KVI_ERR_NOT_FOUND);
  for (int i = 0; i < EMB; i++) assert_true(out[i] == -3.0f);
  assert_status(kvi_store_get_embedding(s, 1, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_get_embedding(NULL, 1, 1, out), KVI_ERR_INVALID_ARGUMENT);
  st = store_stats(s);
  assert_int_equal(st.facts, 3);
  assert_int_equal(st.embedding_dim, EMB);

  /* the fixture's store keeps none: get_embedding is an argument error and
   * a put carrying one is refused */
  assert_status(kvi_store_get_embedding(f->s, 1, 10, out), KVI_ERR_INVALID_ARGUMENT);
  o = (kvi_put_options)KVI_PUT_OPTIONS_INIT;
  o.embedding = ok;
  put_fails(f, &f->good.v, &o, KVI_ERR_INVALID_ARGUMENT);
}

/* ------------------------------------------------------------------------ */
/* read                                                                     */
/* ------------------------------------------------------------------------ */

/* A read into `v` (pointing into b's poisoned memory) that must fail with
 * `want` without writing a byte. */
static void read_fails(fixture *f, uint64_t tenant, uint64_t id, const kvi_kv_view *v, const kvbuf *b,
                       kvi_status want, const char *what) {
  const kvi_status got = kvi_store_read(f->s, tenant, id, v, NULL);
  snprintf(saved_error, sizeof saved_error, "%s", kvi_last_error());
  if (got != want)
    fail_msg("%s: kvi_store_read returned %d (%s), expected %d (%s); kvi_last_error: %s", what, (int)got,
             kvi_status_string(got), (int)want, kvi_status_string(want), kvi_last_error());
  for (size_t i = 0; i < b->bytes; i++)
    if (b->mem[i] != 0xA5) fail_msg("%s: the failed read wrote byte %zu of the destination", what, i);
  assert_unchanged(f);
}

static void test_read_not_found_and_mismatch(void **state) {
  fixture *f = *state;
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, FACT_T, LH, D);
  read_fails(f, 1, 11, &b.v, &b, KVI_ERR_NOT_FOUND, "unknown fact id");
  assert_saved_error_has("kvi_store_read", "11");
  read_fails(f, 2, 10, &b.v, &b, KVI_ERR_NOT_FOUND, "another tenant's id");
  read_fails(f, 0, 10, &b.v, &b, KVI_ERR_NOT_FOUND, "tenant 0");
  kvi_kv_view v = b.v;
  v.num_tokens = FACT_T - 1;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MISMATCH, "one token too few");
  assert_saved_error_has("kvi_store_read", "6");
  v.num_tokens = 1;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MISMATCH, "one token");
  kvbuf big;
  kvbuf_make(&big, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, FACT_T + 1, LH, D);
  read_fails(f, 1, 10, &big.v, &big, KVI_ERR_MISMATCH, "one token too many");
  v = b.v;
  v.num_heads = H;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MISMATCH, "all heads instead of local");
  v = b.v;
  v.num_layers = 1;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MISMATCH, "layers");
  v = b.v;
  v.head_size = 3;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MISMATCH, "head size");
  v = b.v;
  v.dtype = KVI_DTYPE_FP8_E4M3;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MISMATCH, "fp8 destination");
  kvbuf_free(&b);
  kvbuf_free(&big);
}

static void test_read_bad_arguments(void **state) {
  fixture *f = *state;
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP16, L, FACT_T, LH, D);
  assert_status(kvi_store_read(NULL, 1, 10, &b.v, NULL), KVI_ERR_INVALID_ARGUMENT);
  read_fails(f, 1, 10, NULL, &b, KVI_ERR_INVALID_ARGUMENT, "NULL dst");
  kvi_kv_view v = b.v;
  v.struct_size = sizeof v - 8;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_STRUCT_SIZE, "struct_size");
  v = b.v;
  v.memory = (kvi_memory)0;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "memory 0");
  v.memory = KVI_MEMORY_DEVICE;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_MEMORY_KIND, "device memory on a CPU store");
  v = b.v;
  v.dtype = (kvi_dtype)0;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "dtype 0");
  v = b.v;
  v.k = NULL;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "k NULL");
  v = b.v;
  v.v = NULL;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "v NULL");
  v = b.v;
  v.head_stride = -D;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "negative stride");
  v = b.v;
  v.layer_stride = INT64_MAX / 2;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "overflowing extent");
  kvbuf_free(&b);
}

/* A destination must not write one address twice. */
static void test_read_overlapping_destination(void **state) {
  fixture *f = *state;
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, FACT_T, LH, D);
  kvi_kv_view v = b.v;
  v.head_stride = D - 1;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "head_stride < head_size");
  v = b.v;
  v.head_stride = 0;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "head_stride 0");
  v = b.v;
  v.token_stride = 0;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "token_stride 0, 6 tokens");
  v = b.v;
  v.layer_stride = 0;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "layer_stride 0, 3 layers");
  v = b.v;
  v.token_stride = D; /* token t+1 is head 1 of token t */
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "token_stride == head_stride");
  v = b.v;
  v.layer_stride = (int64_t)(FACT_T - 1) * LH * D; /* last token of layer l is first of l+1 */
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "layers overlap by one token");
  kvbuf_free(&b);
}

/* K and V of a destination must not share addresses either. */
static void test_read_k_v_alias(void **state) {
  fixture *f = *state;
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, FACT_T, LH, D);
  kvi_kv_view v = b.v;
  v.v = v.k;
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "dst->v == dst->k");
  v.v = (uint16_t *)v.k + D; /* V starts at K's second head */
  read_fails(f, 1, 10, &v, &b, KVI_ERR_INVALID_ARGUMENT, "dst->v inside dst->k");
  kvbuf_free(&b);
}

/* Stride rules only bind for dimensions of extent > 1. */
static void test_read_zero_stride_single_token(void **state) {
  fixture *f = *state;
  kvbuf one;
  kvbuf_make(&one, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, 1, LH, D);
  kvbuf_fill(&one, &f->r);
  assert_ok(kvi_store_put(f->s, 4, 4, &one.v, NULL, NULL));
  kvbuf out;
  kvbuf_make(&out, LAYOUT_CONTIG, KVI_DTYPE_BF16, L, 1, LH, D);
  kvi_kv_view v = out.v;
  v.token_stride = 0;
  assert_ok(kvi_store_read(f->s, 4, 4, &v, NULL));
  assert_memory_equal(out.mem, one.mem, out.bytes);
  kvbuf_free(&one);
  kvbuf_free(&out);
}

int main(void) {
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, teardown)
  const struct CMUnitTest tests[] = {
      T(test_put_null_arguments),
      T(test_put_struct_sizes),
      T(test_put_memory_field),
      T(test_put_dtypes),
      T(test_put_token_count),
      T(test_put_shape_mismatch),
      T(test_put_bad_strides),
      T(test_put_huge_token_count),
      T(test_put_unknown_flags),
      T(test_put_exists_and_replace),
      T(test_put_failed_replace_keeps_old),
      T(test_put_capacity),
      T(test_put_embeddings),
      T(test_read_not_found_and_mismatch),
      T(test_read_bad_arguments),
      T(test_read_overlapping_destination),
      T(test_read_k_v_alias),
      T(test_read_zero_stride_single_token),
  };
#undef T
  return cmocka_run_group_tests_name("unit-store-errors", tests, NULL, NULL);
}
