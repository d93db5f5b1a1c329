/*
 * unit-store-facts: remove, count, list, fact_tokens and stats; tenant
 * isolation; page accounting and reuse after fragmentation.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#define L 2
#define H 2
#define D 4
#define P 5
#define PAGES 40

static uint64_t page_bytes_for(int32_t p, kvi_dtype dt) { return (uint64_t)p * L * 2 * H * D * kvi_dtype_size(dt); }

static int setup(void **state) {
  store_fixture *f = store_fixture_new(L, H, D, 0, 1);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP16, P, page_bytes_for(P, KVI_DTYPE_FP16) * PAGES);
  assert_ok(kvi_store_create(&f->s, f->m, &o));
  *state = f;
  return 0;
}

/* Puts a fact of T tokens whose fp32 data is derived from `tag`. */
static void put_tagged(kvi_store *s, uint64_t tenant, uint64_t id, int32_t T, uint64_t tag, kvi_status want) {
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, H, D);
  kvbuf_fill_tag(&b, tag);
  assert_status(kvi_store_put(s, tenant, id, &b.v, NULL, NULL), want);
  kvbuf_free(&b);
}

/* Reads (tenant, id) and checks it holds the data of `tag` as the store's
 * dtype rounds it. */
static void check_tagged(const kvi_store *s, kvi_dtype store_dt, uint64_t tenant, uint64_t id, int32_t T,
                         uint64_t tag) {
  kvbuf want, got;
  kvbuf_make(&want, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, H, D);
  kvbuf_fill_tag(&want, tag);
  for (int64_t i = 0; i < want.elems; i++) ((float *)want.mem)[i] = ref_round(((float *)want.mem)[i], store_dt);
  kvbuf_make(&got, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, T, H, D);
  assert_ok(kvi_store_read(s, tenant, id, &got.v, NULL));
  if (memcmp(want.mem, got.mem, want.bytes) != 0)
    fail_msg("fact (%llu, %llu) of %d tokens does not hold the data it was given", (unsigned long long)tenant,
             (unsigned long long)id, T);
  kvbuf_free(&want);
  kvbuf_free(&got);
}

static int cmp_u64(const void *a, const void *b) {
  const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

static size_t count_of(const kvi_store *s, uint64_t tenant) {
  size_t n = (size_t)-1;
  assert_ok(kvi_store_count(s, tenant, &n));
  return n;
}

/* ------------------------------------------------------------------------ */

static void test_tenant_isolation(void **state) {
  store_fixture *f = *state;
  const uint64_t A = 7, B = 8;
  /* the same fact id under two tenants: two facts */
  put_tagged(f->s, A, 1, 3, 0xA1, KVI_OK);
  put_tagged(f->s, B, 1, 7, 0xB1, KVI_OK);
  for (uint64_t id = 100; id < 105; id++) put_tagged(f->s, A, id, 1, id, KVI_OK);
  check_tagged(f->s, KVI_DTYPE_FP16, A, 1, 3, 0xA1);
  check_tagged(f->s, KVI_DTYPE_FP16, B, 1, 7, 0xB1);
  assert_int_equal(count_of(f->s, A), 6);
  assert_int_equal(count_of(f->s, B), 1);
  assert_int_equal(count_of(f->s, 9), 0);
  kvi_store_stats st = store_stats(f->s);
  assert_int_equal(st.facts, 7);
  assert_int_equal(st.tenants, 2);

  uint64_t ids[8];
  size_t total = 0;
  assert_ok(kvi_store_list(f->s, B, ids, 8, &total));
  assert_int_equal(total, 1);
  assert_int_equal(ids[0], 1);

  /* B cannot see, read, size, or remove A's facts */
  int32_t t = -1;
  assert_status(kvi_store_fact_tokens(f->s, B, 100, &t), KVI_ERR_NOT_FOUND);
  assert_int_equal(t, -1);
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 1, H, D);
  assert_status(kvi_store_read(f->s, B, 100, &b.v, NULL), KVI_ERR_NOT_FOUND);
  kvbuf_free(&b);
  assert_status(kvi_store_remove(f->s, B, 100), KVI_ERR_NOT_FOUND);
  assert_int_equal(count_of(f->s, A), 6);
  assert_ok(kvi_store_fact_tokens(f->s, A, 100, &t));
  assert_int_equal(t, 1);

  /* replacing B's fact 1 does not touch A's */
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.flags = KVI_PUT_REPLACE;
  kvbuf nb;
  kvbuf_make(&nb, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 2, H, D);
  kvbuf_fill_tag(&nb, 0xB2);
  assert_ok(kvi_store_put(f->s, B, 1, &nb.v, &o, NULL));
  kvbuf_free(&nb);
  check_tagged(f->s, KVI_DTYPE_FP16, A, 1, 3, 0xA1);
  check_tagged(f->s, KVI_DTYPE_FP16, B, 1, 2, 0xB2);

  /* removing A's fact 1 leaves B's */
  assert_ok(kvi_store_remove(f->s, A, 1));
  check_tagged(f->s, KVI_DTYPE_FP16, B, 1, 2, 0xB2);
  assert_status(kvi_store_fact_tokens(f->s, A, 1, &t), KVI_ERR_NOT_FOUND);

  /* a tenant with no facts left is no longer counted */
  for (uint64_t id = 100; id < 105; id++) assert_ok(kvi_store_remove(f->s, A, id));
  st = store_stats(f->s);
  assert_int_equal(st.tenants, 1);
  assert_int_equal(st.facts, 1);
  assert_int_equal(count_of(f->s, A), 0);
  assert_ok(kvi_store_list(f->s, A, ids, 8, &total));
  assert_int_equal(total, 0);
  /* and comes back when it stores again */
  put_tagged(f->s, A, 1, 1, 0xA3, KVI_OK);
  assert_int_equal(store_stats(f->s).tenants, 2);
}

/* Extreme ids: tenant and fact 0 and UINT64_MAX are ordinary keys. */
static void test_extreme_ids(void **state) {
  store_fixture *f = *state;
  const uint64_t keys[] = {0, 1, UINT64_MAX, UINT64_MAX - 1, (uint64_t)1 << 63};
  for (size_t i = 0; i < 5; i++)
    for (size_t j = 0; j < 5; j++) put_tagged(f->s, keys[i], keys[j], 1, i * 5 + j + 1, KVI_OK);
  assert_int_equal(store_stats(f->s).facts, 25);
  assert_int_equal(store_stats(f->s).tenants, 5);
  for (size_t i = 0; i < 5; i++) {
    for (size_t j = 0; j < 5; j++) check_tagged(f->s, KVI_DTYPE_FP16, keys[i], keys[j], 1, i * 5 + j + 1);
    uint64_t ids[5];
    size_t total = 0;
    assert_ok(kvi_store_list(f->s, keys[i], ids, 5, &total));
    assert_int_equal(total, 5);
    const uint64_t sorted[] = {0, 1, (uint64_t)1 << 63, UINT64_MAX - 1, UINT64_MAX};
    for (size_t j = 0; j < 5; j++) assert_true(ids[j] == sorted[j]);
  }
  assert_ok(kvi_store_remove(f->s, UINT64_MAX, 0));
  assert_status(kvi_store_remove(f->s, UINT64_MAX, 0), KVI_ERR_NOT_FOUND);
  assert_int_equal(count_of(f->s, UINT64_MAX), 4);
  assert_int_equal(count_of(f->s, 0), 5);
}

static void test_list(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  enum { N = 30 };
  uint64_t want[N];
  for (int i = 0; i < N; i++) {
    bool dup;
    do {
      want[i] = i == 0 ? 0 : i == 1 ? UINT64_MAX : rng_next(&f->r) >> (rng_next(&f->r) % 64);
      dup = false;
      for (int j = 0; j < i; j++) dup |= want[j] == want[i];
    } while (dup);
  }
  /* stored in a random order */
  for (int i = 0; i < N; i++) put_tagged(f->s, 3, want[(i * 7) % N], 1, (uint64_t)i, KVI_OK);
  put_tagged(f->s, 4, 5, 1, 99, KVI_OK);
  qsort(want, N, sizeof want[0], cmp_u64);

  uint64_t ids[N + 4];
  size_t total = 0;
  for (int i = 0; i < N + 4; i++) ids[i] = 0xDEADBEEFull;
  assert_ok(kvi_store_list(f->s, 3, ids, N + 4, &total));
  assert_int_equal(total, N);
  for (int i = 0; i < N; i++) assert_true(ids[i] == want[i]);
  for (int i = N; i < N + 4; i++) assert_true(ids[i] == 0xDEADBEEFull);

  /* a smaller capacity: the first ones, the total still right */
  for (int i = 0; i < N + 4; i++) ids[i] = 0xDEADBEEFull;
  total = 0;
  assert_ok(kvi_store_list(f->s, 3, ids, 3, &total));
  assert_int_equal(total, N);
  for (int i = 0; i < 3; i++) assert_true(ids[i] == want[i]);
  for (int i = 3; i < N + 4; i++) assert_true(ids[i] == 0xDEADBEEFull);

  /* capacity 0 sizes the array; ids may be NULL then */
  total = 0;
  assert_ok(kvi_store_list(f->s, 3, NULL, 0, &total));
  assert_int_equal(total, N);
  total = 0;
  ids[0] = 0xDEADBEEFull;
  assert_ok(kvi_store_list(f->s, 3, ids, 0, &total));
  assert_int_equal(total, N);
  assert_true(ids[0] == 0xDEADBEEFull);

  /* errors */
  assert_status(kvi_store_list(f->s, 3, ids, 4, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_list(f->s, 3, NULL, 4, &total), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_list(NULL, 3, ids, 4, &total), KVI_ERR_INVALID_ARGUMENT);

  /* unknown tenant */
  total = 77;
  ids[0] = 0xDEADBEEFull;
  assert_ok(kvi_store_list(f->s, 12345, ids, 4, &total));
  assert_int_equal(total, 0);
  assert_true(ids[0] == 0xDEADBEEFull);

  /* after removals */
  for (int i = 0; i < N; i += 2) assert_ok(kvi_store_remove(f->s, 3, want[i]));
  assert_ok(kvi_store_list(f->s, 3, ids, N, &total));
  assert_int_equal(total, N / 2);
  for (int i = 0; i < N / 2; i++) assert_true(ids[i] == want[2 * i + 1]);
  assert_int_equal(count_of(f->s, 3), N / 2);
}

static void test_count_and_fact_tokens(void **state) {
  store_fixture *f = *state;
  size_t n = 5;
  assert_status(kvi_store_count(f->s, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_count(NULL, 1, &n), KVI_ERR_INVALID_ARGUMENT);
  assert_int_equal(n, 5);
  assert_int_equal(count_of(f->s, 1), 0);
  const int32_t Ts[] = {1, P, P + 1, 3 * P, 17};
  for (int i = 0; i < 5; i++) put_tagged(f->s, 1, (uint64_t)i, Ts[i], (uint64_t)i, KVI_OK);
  assert_int_equal(count_of(f->s, 1), 5);
  for (int i = 0; i < 5; i++) {
    int32_t t = 0;
    assert_ok(kvi_store_fact_tokens(f->s, 1, (uint64_t)i, &t));
    assert_int_equal(t, Ts[i]);
  }
  int32_t t = 42;
  assert_status(kvi_store_fact_tokens(f->s, 1, 5, &t), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_fact_tokens(f->s, 1, 0, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_tokens(NULL, 1, 0, &t), KVI_ERR_INVALID_ARGUMENT);
  assert_int_equal(t, 42);
}

static void assert_stats_equal(const kvi_store_stats *a, const kvi_store_stats *b) {
  assert_int_equal(a->pages_used, b->pages_used);
  assert_int_equal(a->pages_total, b->pages_total);
  assert_int_equal(a->bytes_used, b->bytes_used);
  assert_int_equal(a->bytes_payload, b->bytes_payload);
  assert_int_equal(a->facts, b->facts);
  assert_int_equal(a->tenants, b->tenants);
}

static void test_remove(void **state) {
  store_fixture *f = *state;
  put_tagged(f->s, 1, 1, 2 * P + 1, 11, KVI_OK); /* 3 pages */
  put_tagged(f->s, 1, 2, P, 12, KVI_OK);         /* 1 page */
  kvi_store_stats before = store_stats(f->s);
  assert_int_equal(before.pages_used, 4);

  assert_status(kvi_store_remove(f->s, 1, 3), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_remove(f->s, 2, 1), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_remove(NULL, 1, 1), KVI_ERR_INVALID_ARGUMENT);
  kvi_store_stats now = store_stats(f->s);
  assert_stats_equal(&now, &before);

  assert_ok(kvi_store_remove(f->s, 1, 1));
  now = store_stats(f->s);
  assert_int_equal(now.pages_used, 1);
  assert_int_equal(now.facts, 1);
  assert_int_equal(now.bytes_payload, (uint64_t)P * page_bytes_for(1, KVI_DTYPE_FP16));
  assert_status(kvi_store_remove(f->s, 1, 1), KVI_ERR_NOT_FOUND);
  assert_last_error_has("kvi_store_remove", "1");
  check_tagged(f->s, KVI_DTYPE_FP16, 1, 2, P, 12);

  /* the freed pages serve a new put: fill the store, remove, fill again */
  put_tagged(f->s, 2, 1, (PAGES - 1) * P, 21, KVI_OK);
  assert_int_equal(store_stats(f->s).pages_used, PAGES);
  put_tagged(f->s, 2, 2, 1, 22, KVI_ERR_CAPACITY);
  assert_ok(kvi_store_remove(f->s, 1, 2));
  assert_int_equal(store_stats(f->s).pages_used, PAGES - 1);
  put_tagged(f->s, 2, 2, P, 22, KVI_OK);
  assert_int_equal(store_stats(f->s).pages_used, PAGES);
  check_tagged(f->s, KVI_DTYPE_FP16, 2, 1, (PAGES - 1) * P, 21);
  check_tagged(f->s, KVI_DTYPE_FP16, 2, 2, P, 22);
  /* empty again */
  assert_ok(kvi_store_remove(f->s, 2, 1));
  assert_ok(kvi_store_remove(f->s, 2, 2));
  now = store_stats(f->s);
  assert_int_equal(now.pages_used, 0);
  assert_int_equal(now.bytes_used, 0);
  assert_int_equal(now.bytes_payload, 0);
  assert_int_equal(now.facts, 0);
  assert_int_equal(now.tenants, 0);
  put_tagged(f->s, 3, 3, PAGES * P, 33, KVI_OK);
  assert_int_equal(store_stats(f->s).pages_used, PAGES);
  check_tagged(f->s, KVI_DTYPE_FP16, 3, 3, PAGES * P, 33);
}

/* Stats add up for every dtype and page size. */
static void test_stats_accounting(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  const int32_t Ps[] = {5, 16, 1};
  for (int c = 0; c < 3; c++) {
    const kvi_dtype dt = float_dtypes[(c + 1) % 3];
    const int32_t p = Ps[c];
    const uint64_t pb = page_bytes_for(p, dt);
    assert_int_equal(pb, (uint64_t)p * L * 2 * H * D * kvi_dtype_size(dt));
    kvi_store_options o = cpu_store_options(dt, p, pb * 64 + pb - 1);
    kvi_store *s = NULL;
    assert_ok(kvi_store_create(&s, f->m, &o));
    uint64_t pages = 0, tokens = 0, facts = 0;
    for (uint64_t id = 0; id < 12; id++) {
      const int32_t T = (int32_t)rng_range(&f->r, 1, 4 * p);
      put_tagged(s, id % 4, id, T, id, KVI_OK);
      pages += div_up((uint64_t)T, (uint64_t)p);
      tokens += (uint64_t)T;
      facts++;
      const kvi_store_stats st = store_stats(s);
      assert_int_equal(st.dtype, dt);
      assert_int_equal(st.page_tokens, p);
      assert_int_equal(st.page_bytes, pb);
      assert_int_equal(st.pages_total, 64);
      assert_int_equal(st.bytes_reserved, 64 * pb);
      assert_int_equal(st.pages_used, pages);
      assert_int_equal(st.bytes_used, pages * pb);
      assert_int_equal(st.bytes_payload, tokens * (pb / (uint64_t)p));
      assert_int_equal(st.bytes_payload, tokens * L * 2 * H * D * kvi_dtype_size(dt));
      assert_true(st.bytes_payload <= st.bytes_used);
      assert_int_equal(st.facts, facts);
      assert_int_equal(st.tenants, facts < 4 ? facts : 4);
    }
    kvi_store_destroy(s);
  }
}

/* An output struct: larger is written up to the known fields, smaller than
 * the first version is refused untouched. */
static void test_stats_struct_size(void **state) {
  store_fixture *f = *state;
  put_tagged(f->s, 1, 1, 7, 1, KVI_OK);
  struct {
    kvi_store_stats s;
    unsigned char after[24];
  } big;
  memset(&big, 0xCD, sizeof big);
  big.s.struct_size = sizeof big;
  assert_ok(kvi_store_stats_get(f->s, &big.s));
  assert_int_equal(big.s.struct_size, sizeof big);
  assert_int_equal(big.s.pages_used, 2);
  assert_int_equal(big.s.tenants, 1);
  assert_int_equal(big.s.facts, 1);
  for (size_t i = 0; i < sizeof big.after; i++) assert_int_equal(big.after[i], 0xCD);

  kvi_store_stats small, before;
  memset(&small, 0xCD, sizeof small);
  small.struct_size = offsetof(kvi_store_stats, facts);
  memcpy(&before, &small, sizeof small);
  assert_status(kvi_store_stats_get(f->s, &small), KVI_ERR_STRUCT_SIZE);
  assert_memory_equal(&small, &before, sizeof small);

  kvi_store_stats st = KVI_STORE_STATS_INIT;
  assert_status(kvi_store_stats_get(f->s, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_stats_get(NULL, &st), KVI_ERR_INVALID_ARGUMENT);
}

/* Fill with random sizes, free random facts, then one fact needing exactly
 * every free page must fit: pages need not be contiguous. */
static void test_fragmentation(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  enum { MAXF = PAGES + 1 };
  struct {
    uint64_t id;
    int32_t T;
    bool live;
  } facts[MAXF * 4];
  int nf = 0;
  uint64_t next_id = 1;
  for (int round = 0; round < 4; round++) {
    /* fill until a put fails for lack of pages */
    uint64_t used = store_stats(f->s).pages_used;
    for (;;) {
      const int32_t T = (int32_t)rng_range(&f->r, 1, 4 * P);
      const uint64_t need = div_up((uint64_t)T, P);
      if (used + need > PAGES) {
        put_tagged(f->s, 1, next_id, T, next_id, KVI_ERR_CAPACITY);
        break;
      }
      assert_true(nf < (int)(sizeof facts / sizeof facts[0]));
      put_tagged(f->s, 1, next_id, T, next_id, KVI_OK);
      facts[nf].id = next_id++;
      facts[nf].T = T;
      facts[nf].live = true;
      nf++;
      used += need;
      assert_int_equal(store_stats(f->s).pages_used, used);
    }
    /* remove about half, at random */
    for (int i = 0; i < nf; i++)
      if (facts[i].live && (rng_next(&f->r) & 1)) {
        assert_ok(kvi_store_remove(f->s, 1, facts[i].id));
        facts[i].live = false;
        used -= div_up((uint64_t)facts[i].T, P);
      }
    const kvi_store_stats st = store_stats(f->s);
    assert_int_equal(st.pages_used, used);
    const uint64_t free_pages = PAGES - used;
    if (free_pages > 0) {
      /* exactly all free pages, the last one full */
      const uint64_t id = next_id++;
      put_tagged(f->s, 1, id, (int32_t)(free_pages * P), id, KVI_OK);
      assert_int_equal(store_stats(f->s).pages_used, PAGES);
      put_tagged(f->s, 1, next_id, 1, next_id, KVI_ERR_CAPACITY);
      facts[nf].id = id;
      facts[nf].T = (int32_t)(free_pages * P);
      facts[nf].live = true;
      nf++;
      used = PAGES;
    }
    /* every live fact still holds its own data */
    size_t live = 0;
    for (int i = 0; i < nf; i++)
      if (facts[i].live) {
        check_tagged(f->s, KVI_DTYPE_FP16, 1, facts[i].id, facts[i].T, facts[i].id);
        live++;
      }
    assert_int_equal(count_of(f->s, 1), live);
    /* compact the bookkeeping, free a few for the next round */
    int w = 0;
    for (int i = 0; i < nf; i++)
      if (facts[i].live) facts[w++] = facts[i];
    nf = w;
    for (int i = 0; i < nf; i += 3) {
      assert_ok(kvi_store_remove(f->s, 1, facts[i].id));
      facts[i].live = false;
    }
    w = 0;
    for (int i = 0; i < nf; i++)
      if (facts[i].live) facts[w++] = facts[i];
    nf = w;
  }
}

/* Thousands of keys: the index grows and shrinks without losing any. */
static void test_many_keys(void **state) {
  store_fixture *f = *state;
  rng_seed(&f->r, __func__);
  kvi_model *m = make_model(1, 1, 2, 0, 1);
  enum { N = 3000, TENANTS = 5 };
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, 1, (uint64_t)N * 2 * 2 * 4);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  uint64_t *ids = malloc(N * sizeof *ids);
  bool *live = malloc(N * sizeof *live);
  assert_non_null(ids);
  assert_non_null(live);
  float k[2], v[2];
  kvi_kv_view kv;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, 2, k, v);
  for (int i = 0; i < N; i++) {
    ids[i] = (rng_next(&f->r) & ~(uint64_t)0xfff) | (uint64_t)i; /* distinct */
    k[0] = (float)i, k[1] = (float)(ids[i] & 0xffff), v[0] = -(float)i, v[1] = 0.5f;
    assert_ok(kvi_store_put(s, (uint64_t)i % TENANTS, ids[i], &kv, NULL, NULL));
    live[i] = true;
  }
  assert_int_equal(store_stats(s).facts, N);
  for (int i = 0; i < N; i++)
    if (rng_next(&f->r) % 3 != 0) {
      assert_ok(kvi_store_remove(s, (uint64_t)i % TENANTS, ids[i]));
      live[i] = false;
    }
  size_t n_live[TENANTS] = {0};
  for (int i = 0; i < N; i++) {
    float rk[2] = {0, 0}, rv[2] = {0, 0};
    kvi_kv_view out;
    kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, 2, rk, rv);
    if (live[i]) {
      n_live[i % TENANTS]++;
      assert_ok(kvi_store_read(s, (uint64_t)i % TENANTS, ids[i], &out, NULL));
      assert_true(rk[0] == (float)i && rk[1] == (float)(ids[i] & 0xffff) && rv[0] == -(float)i && rv[1] == 0.5f);
    } else {
      assert_status(kvi_store_read(s, (uint64_t)i % TENANTS, ids[i], &out, NULL), KVI_ERR_NOT_FOUND);
    }
  }
  size_t total_live = 0;
  for (int t = 0; t < TENANTS; t++) {
    assert_int_equal(count_of(s, (uint64_t)t), n_live[t]);
    total_live += n_live[t];
  }
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.facts, total_live);
  assert_int_equal(st.pages_used, total_live);
  free(ids);
  free(live);
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

int main(void) {
#define T(fn) cmocka_unit_test_setup_teardown(fn, setup, store_fixture_teardown)
  const struct CMUnitTest tests[] = {
      T(test_tenant_isolation),
      T(test_extreme_ids),
      T(test_list),
      T(test_count_and_fact_tokens),
      T(test_remove),
      T(test_stats_accounting),
      T(test_stats_struct_size),
      T(test_fragmentation),
      T(test_many_keys),
  };
#undef T
  return cmocka_run_group_tests_name("unit-store-facts", tests, NULL, NULL);
}
