/*
 * unit-threads: one store used from 8 threads at once (puts, reads, replaces,
 * removes, queries, per-thread last error), and a randomized model check of
 * put / replace / remove / read against an in-test model of the store.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Worker threads never call cmocka assertions (they longjmp); they record
 * the first failure in their own message buffer and the main thread fails
 * the test with it.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "unit.h"

#define L 2
#define H 2
#define D 4
#define P 4
#define ELEMS_PER_TOKEN (L * H * D) /* per plane */
#define MAX_T 9

#define NTHREADS 8
#define ITERS 150
#define SHARED_TENANT 7u
#define HOT_ID 999999999u /* a key of the shared tenant every thread replaces */
#define HOT_T 5

static uint64_t page_bytes(void) { return (uint64_t)P * L * 2 * H * D * 4; }

/* Contiguous fp32 K then V for T tokens; element 0 of K carries the tag. */
static void fill(float *buf, int32_t T, uint64_t tag) {
  const int64_t n = 2 * (int64_t)T * ELEMS_PER_TOKEN;
  for (int64_t i = 0; i < n; i++) buf[i] = tag_value(tag, i);
  buf[0] = (float)(tag & 0xffffff);
}

static void view_of(kvi_kv_view *v, float *buf, int32_t T) {
  kvi_kv_view_contiguous(v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, buf, buf + (int64_t)T * ELEMS_PER_TOKEN);
}

typedef struct worker {
  kvi_store *s;
  int idx;
  uint64_t seed;
  pthread_barrier_t *bar;
  atomic_int *stop_readers;
  char err[512];
  /* survivors, for the final check */
  int32_t own_T[ITERS];
  uint64_t own_tag[ITERS];
  bool own_live[ITERS];
  int32_t shared_T[ITERS];
  bool shared_live[ITERS];
} worker;

#define WFAIL(w, ...)                                                                                           \
  do {                                                                                                        \
    if (!(w)->err[0]) {                                                                                       \
      int n_ = snprintf((w)->err, sizeof (w)->err, "thread %d line %d: ", (w)->idx, __LINE__);                \
      snprintf((w)->err + n_, sizeof (w)->err - (size_t)n_, __VA_ARGS__);                                     \
    }                                                                                                         \
    return NULL;                                                                                              \
  } while (0)

#define WCHECK(w, expr, want)                                                                                   \
  do {                                                                                                        \
    const kvi_status s_ = (expr);                                                                             \
    if (s_ != (want)) WFAIL(w, "%s returned %d, expected %d: %s", #expr, (int)s_, (int)(want), kvi_last_error()); \
  } while (0)

static uint64_t own_tenant(int idx) { return 100u + (uint64_t)idx; }
static uint64_t shared_id(int idx, int i) { return (uint64_t)idx * 1000000u + (uint64_t)i; }
static uint64_t mk_tag(int idx, int i, int version) { return ((uint64_t)idx << 16) | ((uint64_t)i << 2) | (uint64_t)version; }

/* Reads (tenant, id) and compares with the data of `tag`; 0 on success. */
static int read_check(kvi_store *s, uint64_t tenant, uint64_t id, int32_t T, uint64_t tag, char *err, size_t errlen) {
  float want[2 * MAX_T * ELEMS_PER_TOKEN], got[2 * MAX_T * ELEMS_PER_TOKEN];
  fill(want, T, tag);
  memset(got, 0, sizeof got);
  kvi_kv_view v;
  view_of(&v, got, T);
  const kvi_status st = kvi_store_read(s, tenant, id, &v, NULL);
  if (st != KVI_OK) {
    snprintf(err, errlen, "read (%llu, %llu): %d %s", (unsigned long long)tenant, (unsigned long long)id, (int)st,
             kvi_last_error());
    return 1;
  }
  if (memcmp(want, got, 2 * (size_t)T * ELEMS_PER_TOKEN * sizeof(float)) != 0) {
    snprintf(err, errlen, "read (%llu, %llu): wrong data", (unsigned long long)tenant, (unsigned long long)id);
    return 1;
  }
  return 0;
}

static void *work(void *arg) {
  worker *w = arg;
  rng r = {w->seed};
  float buf[2 * MAX_T * ELEMS_PER_TOKEN];
  kvi_kv_view v;
  char msg[256];
  const uint64_t own = own_tenant(w->idx);
  size_t own_count = 0;
  kvi_put_options rep = KVI_PUT_OPTIONS_INIT;
  rep.flags = KVI_PUT_REPLACE;
  pthread_barrier_wait(w->bar);

  for (int i = 0; i < ITERS; i++) {
    /* own tenant: put, read back */
    int32_t T = (int32_t)rng_range(&r, 1, MAX_T);
    uint64_t tag = mk_tag(w->idx, i, 0);
    fill(buf, T, tag);
    view_of(&v, buf, T);
    WCHECK(w, kvi_store_put(w->s, own, (uint64_t)i, &v, NULL, NULL), KVI_OK);
    WCHECK(w, kvi_store_put(w->s, own, (uint64_t)i, &v, NULL, NULL), KVI_ERR_EXISTS);
    own_count++;
    w->own_T[i] = T, w->own_tag[i] = tag, w->own_live[i] = true;
    if (read_check(w->s, own, (uint64_t)i, T, tag, msg, sizeof msg)) WFAIL(w, "%s", msg);

    /* shared tenant, this thread's id range */
    const int32_t T2 = (int32_t)rng_range(&r, 1, MAX_T);
    fill(buf, T2, mk_tag(w->idx, i, 3));
    view_of(&v, buf, T2);
    WCHECK(w, kvi_store_put(w->s, SHARED_TENANT, shared_id(w->idx, i), &v, NULL, NULL), KVI_OK);
    w->shared_T[i] = T2, w->shared_live[i] = true;

    /* the hot key: every thread replaces it; a read sees one whole version */
    fill(buf, HOT_T, mk_tag(w->idx, i, 2));
    view_of(&v, buf, HOT_T);
    WCHECK(w, kvi_store_put(w->s, SHARED_TENANT, HOT_ID, &v, &rep, NULL), KVI_OK);
    {
      float got[2 * HOT_T * ELEMS_PER_TOKEN], want[2 * HOT_T * ELEMS_PER_TOKEN];
      view_of(&v, got, HOT_T);
      WCHECK(w, kvi_store_read(w->s, SHARED_TENANT, HOT_ID, &v, NULL), KVI_OK);
      const uint64_t seen = (uint64_t)got[0];
      fill(want, HOT_T, seen);
      if ((seen & 3u) != 2u || memcmp(got, want, sizeof got) != 0)
        WFAIL(w, "the hot fact is not one whole version (tag field %llu)", (unsigned long long)seen);
    }

    /* replace an earlier own fact with a new size */
    if (i % 5 == 4) {
      const int j = i - 2;
      if (w->own_live[j]) {
        T = (int32_t)rng_range(&r, 1, MAX_T);
        tag = mk_tag(w->idx, j, 1);
        fill(buf, T, tag);
        view_of(&v, buf, T);
        WCHECK(w, kvi_store_put(w->s, own, (uint64_t)j, &v, &rep, NULL), KVI_OK);
        w->own_T[j] = T, w->own_tag[j] = tag;
        int32_t t = 0;
        WCHECK(w, kvi_store_fact_tokens(w->s, own, (uint64_t)j, &t), KVI_OK);
        if (t != T) WFAIL(w, "fact_tokens %d after replace, expected %d", t, T);
      }
    }
    /* removes */
    if (i % 2 == 1) {
      WCHECK(w, kvi_store_remove(w->s, own, (uint64_t)(i - 1)), KVI_OK);
      WCHECK(w, kvi_store_remove(w->s, own, (uint64_t)(i - 1)), KVI_ERR_NOT_FOUND);
      w->own_live[i - 1] = false;
      own_count--;
    }
    if (i % 3 == 0) {
      WCHECK(w, kvi_store_remove(w->s, SHARED_TENANT, shared_id(w->idx, i)), KVI_OK);
      w->shared_live[i] = false;
    }
    /* queries on the own tenant are exact: no other thread touches it */
    size_t n = 0;
    WCHECK(w, kvi_store_count(w->s, own, &n), KVI_OK);
    if (n != own_count) WFAIL(w, "count %zu, expected %zu", n, own_count);
    uint64_t ids[ITERS];
    size_t total = 0;
    WCHECK(w, kvi_store_list(w->s, own, ids, ITERS, &total), KVI_OK);
    if (total != own_count) WFAIL(w, "list total %zu, expected %zu", total, own_count);
    for (size_t k = 1; k < total; k++)
      if (ids[k - 1] >= ids[k]) WFAIL(w, "list not ascending");
    for (size_t k = 0; k < total; k++)
      if (ids[k] >= ITERS || !w->own_live[ids[k]]) WFAIL(w, "list has id %llu", (unsigned long long)ids[k]);
    /* the shared tenant changes under us: its list is still sorted */
    uint64_t sids[64];
    WCHECK(w, kvi_store_list(w->s, SHARED_TENANT, sids, 64, &total), KVI_OK);
    for (size_t k = 1; k < (total < 64 ? total : 64); k++)
      if (sids[k - 1] >= sids[k]) WFAIL(w, "shared list not ascending");
    /* stats are a consistent snapshot */
    kvi_store_stats st = KVI_STORE_STATS_INIT;
    WCHECK(w, kvi_store_stats_get(w->s, &st), KVI_OK);
    if (st.pages_used > st.pages_total || st.bytes_used != st.pages_used * st.page_bytes ||
        st.bytes_payload > st.bytes_used || st.facts > st.pages_used)
      WFAIL(w, "inconsistent stats: pages %llu/%llu facts %llu", (unsigned long long)st.pages_used,
            (unsigned long long)st.pages_total, (unsigned long long)st.facts);
    /* the last error is this thread's, whatever the others fail with */
    const uint64_t missing = 9000000000ull + (uint64_t)w->idx * 100000u + (uint64_t)i;
    WCHECK(w, kvi_store_remove(w->s, own, missing), KVI_ERR_NOT_FOUND);
    char num[32];
    snprintf(num, sizeof num, "%llu", (unsigned long long)missing);
    if (!strstr(kvi_last_error(), num) || !strstr(kvi_last_error(), "kvi_store_remove"))
      WFAIL(w, "kvi_last_error() is \"%s\", expected it to name fact %s", kvi_last_error(), num);
  }
  /* every own survivor still holds its data */
  for (int i = 0; i < ITERS; i++)
    if (w->own_live[i] && read_check(w->s, own, (uint64_t)i, w->own_T[i], w->own_tag[i], msg, sizeof msg))
      WFAIL(w, "%s", msg);
  return NULL;
}

/* Readers that only query, racing the writers. */
static void *reader(void *arg) {
  worker *w = arg;
  pthread_barrier_wait(w->bar);
  while (!atomic_load(w->stop_readers)) {
    float got[2 * HOT_T * ELEMS_PER_TOKEN], want[2 * HOT_T * ELEMS_PER_TOKEN];
    kvi_kv_view v;
    view_of(&v, got, HOT_T);
    const kvi_status st = kvi_store_read(w->s, SHARED_TENANT, HOT_ID, &v, NULL);
    if (st == KVI_ERR_NOT_FOUND) continue; /* not written yet */
    if (st != KVI_OK) WFAIL(w, "reader: %d %s", (int)st, kvi_last_error());
    const uint64_t seen = (uint64_t)got[0];
    fill(want, HOT_T, seen);
    if (memcmp(got, want, sizeof got) != 0) WFAIL(w, "reader saw a torn hot fact (tag %llu)", (unsigned long long)seen);
    size_t n;
    WCHECK(w, kvi_store_count(w->s, SHARED_TENANT, &n), KVI_OK);
  }
  return NULL;
}

static void test_concurrent_store(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, H, D, 0, 1);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, page_bytes() * 8192);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  kvi_model_destroy(m);

  enum { NREADERS = 2 };
  pthread_barrier_t bar;
  assert_int_equal(pthread_barrier_init(&bar, NULL, NTHREADS + NREADERS), 0);
  atomic_int stop = 0;
  worker *w = calloc(NTHREADS + NREADERS, sizeof *w);
  assert_non_null(w);
  pthread_t th[NTHREADS + NREADERS];
  for (int i = 0; i < NTHREADS + NREADERS; i++) {
    w[i].s = s;
    w[i].idx = i;
    w[i].seed = rng_next(&r);
    w[i].bar = &bar;
    w[i].stop_readers = &stop;
    assert_int_equal(pthread_create(&th[i], NULL, i < NTHREADS ? work : reader, &w[i]), 0);
  }
  for (int i = 0; i < NTHREADS; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
  atomic_store(&stop, 1);
  for (int i = NTHREADS; i < NTHREADS + NREADERS; i++) assert_int_equal(pthread_join(th[i], NULL), 0);
  pthread_barrier_destroy(&bar);
  for (int i = 0; i < NTHREADS + NREADERS; i++)
    if (w[i].err[0]) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", w[i].err);
      free(w);
      kvi_store_destroy(s);
      fail_msg("%s", msg);
    }

  /* the final state is the sum of what each thread left */
  uint64_t facts = 1 /* hot */, pages = div_up(HOT_T, P), tokens = HOT_T;
  size_t shared = 1;
  for (int t = 0; t < NTHREADS; t++) {
    size_t own = 0;
    for (int i = 0; i < ITERS; i++) {
      if (w[t].own_live[i]) {
        own++;
        pages += div_up((uint64_t)w[t].own_T[i], P);
        tokens += (uint64_t)w[t].own_T[i];
        char msg[256];
        if (read_check(s, own_tenant(t), (uint64_t)i, w[t].own_T[i], w[t].own_tag[i], msg, sizeof msg))
          fail_msg("%s", msg);
      }
      if (w[t].shared_live[i]) {
        shared++;
        pages += div_up((uint64_t)w[t].shared_T[i], P);
        tokens += (uint64_t)w[t].shared_T[i];
        char msg[256];
        if (read_check(s, SHARED_TENANT, shared_id(t, i), w[t].shared_T[i], mk_tag(t, i, 3), msg, sizeof msg))
          fail_msg("%s", msg);
      }
    }
    size_t n = 0;
    assert_ok(kvi_store_count(s, own_tenant(t), &n));
    assert_int_equal(n, own);
    facts += own;
  }
  facts += shared - 1;
  size_t n = 0;
  assert_ok(kvi_store_count(s, SHARED_TENANT, &n));
  assert_int_equal(n, shared);
  const kvi_store_stats st = store_stats(s);
  assert_int_equal(st.facts, facts);
  assert_int_equal(st.pages_used, pages);
  assert_int_equal(st.bytes_payload, tokens * (page_bytes() / P));
  assert_int_equal(st.tenants, NTHREADS + 1);
  free(w);
  kvi_store_destroy(s);
}

/* ------------------------------------------------------------------------ */
/* randomized model check                                                   */
/* ------------------------------------------------------------------------ */

#define MC_TENANTS 3
#define MC_IDS 12
#define MC_PAGES 30
#define MC_P 3
#define MC_MAX_T 10
#define MC_OPS 10000

typedef struct entry {
  bool live;
  int32_t T;
  uint64_t tag;
} entry;

/* The fact's data as the fp16 store keeps it, read back as fp32. */
static void mc_expected(float *out, int32_t T, uint64_t tag) {
  fill(out, T, tag);
  for (int64_t i = 0; i < 2 * (int64_t)T * ELEMS_PER_TOKEN; i++) out[i] = ref_round(out[i], KVI_DTYPE_FP16);
}

static void mc_check_fact(kvi_store *s, uint64_t tenant, uint64_t id, const entry *e, int op) {
  float got[2 * MC_MAX_T * ELEMS_PER_TOKEN], want[2 * MC_MAX_T * ELEMS_PER_TOKEN];
  kvi_kv_view v;
  memset(got, 0, sizeof got);
  view_of(&v, got, e->T);
  assert_ok(kvi_store_read(s, tenant, id, &v, NULL));
  mc_expected(want, e->T, e->tag);
  if (memcmp(got, want, 2 * (size_t)e->T * ELEMS_PER_TOKEN * sizeof(float)) != 0)
    fail_msg("op %d: fact (%llu, %llu) does not hold what was last stored", op, (unsigned long long)tenant,
             (unsigned long long)id);
}

static void test_model_check(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, __func__);
  kvi_model *m = make_model(L, H, D, 0, 1);
  const uint64_t pb = (uint64_t)MC_P * L * 2 * H * D * 2;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP16, MC_P, pb * MC_PAGES);
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, m, &o));
  kvi_model_destroy(m);

  entry model[MC_TENANTS][MC_IDS];
  memset(model, 0, sizeof model);
  uint64_t used = 0, next_tag = 1;
  float buf[2 * MC_MAX_T * ELEMS_PER_TOKEN];
  kvi_put_options rep = KVI_PUT_OPTIONS_INIT;
  rep.flags = KVI_PUT_REPLACE;

  for (int op = 0; op < MC_OPS; op++) {
    const uint64_t tenant = (uint64_t)rng_range(&r, 0, MC_TENANTS - 1);
    const uint64_t id = (uint64_t)rng_range(&r, 0, MC_IDS - 1);
    entry *e = &model[tenant][id];
    const int kind = (int)rng_range(&r, 0, 99);
    if (kind < 55) { /* put, with or without replace */
      const bool replace = kind >= 35;
      const int32_t T = (int32_t)rng_range(&r, 1, MC_MAX_T);
      const uint64_t need = div_up((uint64_t)T, MC_P);
      const uint64_t tag = next_tag++;
      fill(buf, T, tag);
      kvi_kv_view v;
      view_of(&v, buf, T);
      kvi_status want = KVI_OK;
      if (e->live && !replace) want = KVI_ERR_EXISTS;
      else if (used + need > MC_PAGES) want = KVI_ERR_CAPACITY; /* old pages still held */
      const kvi_status got = kvi_store_put(s, tenant, id, &v, replace ? &rep : NULL, NULL);
      if (got != want)
        fail_msg("op %d: put (%llu, %llu) T=%d replace=%d with %llu/%d pages used: got %d, expected %d (%s)", op,
                 (unsigned long long)tenant, (unsigned long long)id, T, replace, (unsigned long long)used, MC_PAGES,
                 (int)got, (int)want, kvi_last_error());
      if (want == KVI_OK) {
        if (e->live) used -= div_up((uint64_t)e->T, MC_P);
        used += need;
        e->live = true;
        e->T = T;
        e->tag = tag;
      }
    } else if (kind < 80) { /* remove */
      const kvi_status want = e->live ? KVI_OK : KVI_ERR_NOT_FOUND;
      assert_status(kvi_store_remove(s, tenant, id), want);
      if (e->live) used -= div_up((uint64_t)e->T, MC_P);
      e->live = false;
    } else { /* read, sometimes with the wrong token count */
      if (!e->live) {
        kvi_kv_view v;
        view_of(&v, buf, 1);
        assert_status(kvi_store_read(s, tenant, id, &v, NULL), KVI_ERR_NOT_FOUND);
        int32_t t = 0;
        assert_status(kvi_store_fact_tokens(s, tenant, id, &t), KVI_ERR_NOT_FOUND);
      } else if (kind < 85) {
        kvi_kv_view v;
        const int32_t wrong = e->T == MC_MAX_T ? e->T - 1 : e->T + 1;
        view_of(&v, buf, wrong);
        assert_status(kvi_store_read(s, tenant, id, &v, NULL), KVI_ERR_MISMATCH);
      } else {
        mc_check_fact(s, tenant, id, e, op);
      }
    }
    /* the store's accounting follows the model after every op */
    const kvi_store_stats st = store_stats(s);
    uint64_t facts = 0, tenants = 0, tokens = 0;
    for (int t = 0; t < MC_TENANTS; t++) {
      uint64_t n = 0;
      for (int i = 0; i < MC_IDS; i++)
        if (model[t][i].live) n++, tokens += (uint64_t)model[t][i].T;
      facts += n;
      tenants += n > 0;
    }
    if (st.pages_used != used || st.facts != facts || st.tenants != tenants ||
        st.bytes_payload != tokens * (pb / MC_P))
      fail_msg("op %d: stats pages %llu facts %llu tenants %llu payload %llu, model %llu %llu %llu %llu", op,
               (unsigned long long)st.pages_used, (unsigned long long)st.facts, (unsigned long long)st.tenants,
               (unsigned long long)st.bytes_payload, (unsigned long long)used, (unsigned long long)facts,
               (unsigned long long)tenants, (unsigned long long)(tokens * (pb / MC_P)));
    if (op % 100 == 99)
      for (uint64_t t = 0; t < MC_TENANTS; t++) {
        uint64_t ids[MC_IDS];
        size_t total = 0, k = 0;
        assert_ok(kvi_store_list(s, t, ids, MC_IDS, &total));
        for (uint64_t i = 0; i < MC_IDS; i++)
          if (model[t][i].live) {
            assert_true(k < total);
            assert_int_equal(ids[k], i);
            k++;
          }
        assert_int_equal(total, k);
      }
  }
  /* every fact's bytes at the end; every dead key absent */
  for (uint64_t t = 0; t < MC_TENANTS; t++)
    for (uint64_t i = 0; i < MC_IDS; i++) {
      const entry *e = &model[t][i];
      if (e->live) {
        mc_check_fact(s, t, i, e, MC_OPS);
        int32_t tk = 0;
        assert_ok(kvi_store_fact_tokens(s, t, i, &tk));
        assert_int_equal(tk, e->T);
      } else {
        int32_t tk = 0;
        assert_status(kvi_store_fact_tokens(s, t, i, &tk), KVI_ERR_NOT_FOUND);
      }
    }
  kvi_store_destroy(s);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_concurrent_store),
      cmocka_unit_test(test_model_check),
  };
  return cmocka_run_group_tests_name("unit-threads", tests, NULL, NULL);
}
