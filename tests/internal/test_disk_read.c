/*
 * internal-disk-read: the disk tier's reads back of one tenant-file entry
 * (an encode call's captures) while the store's I/O thread is inside the
 * read of that entry. The read is held inside it by wrapping the tier's
 * read hook: the wrapper takes the entry's lock, as the real read does for
 * as long as it reads, and keeps it until the test lets go. Meanwhile a
 * prefetch of the entry's other facts, and every other call of the store,
 * must return: they run under the store's lock, and waiting there for the
 * entry's lock held every call of the store for the whole read (a vLLM
 * worker's step waited ~200 ms for the prefetch of a 157 MiB entry).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>

#include "unit_disk.h"

#include "persist/internal.h" /* fact_io, fact_entry */
#include "store/store.h"

enum { L = 2, H = 2, D = 8, P = 4 };

static int fx_setup(void **state) {
  *state = disk_fx_new("diskread", L, H, D);
  return *state ? 0 : -1;
}

static int fx_teardown(void **state) {
  disk_fx_free(*state);
  return 0;
}

/* ---- the held read -------------------------------------------------------- */

static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool hold;    /* the next read waits inside the entry's lock */
  bool holding; /* a read is waiting there */
  bool go;      /* it may go on */
  const kvi__disk_ops *real;
} g = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, false, false, false, NULL};

static kvi__disk_ops held_ops;

static void held_read(const kvi_store *s, void *io, const char *fn) {
  pthread_mutex_lock(&g.mu);
  const bool hold = g.hold;
  g.hold = false;
  pthread_mutex_unlock(&g.mu);
  if (hold) {
    fact_entry *fe = ((fact_io *)io)->e;
    pthread_mutex_lock(&fe->mu); /* as the real read holds it while it reads */
    pthread_mutex_lock(&g.mu);
    g.holding = true;
    pthread_cond_broadcast(&g.cv);
    while (!g.go) pthread_cond_wait(&g.cv, &g.mu);
    pthread_mutex_unlock(&g.mu);
    pthread_mutex_unlock(&fe->mu);
  }
  g.real->read(s, io, fn);
}

/* Waits up to `seconds` for *flag under g.mu; its value then. */
static bool wait_flag(const bool *flag, int seconds) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += seconds;
  pthread_mutex_lock(&g.mu);
  while (!*flag && pthread_cond_timedwait(&g.cv, &g.mu, &until) == 0) {
  }
  const bool v = *flag;
  pthread_mutex_unlock(&g.mu);
  return v;
}

static void let_go(void) {
  pthread_mutex_lock(&g.mu);
  g.go = true;
  pthread_cond_broadcast(&g.cv);
  pthread_mutex_unlock(&g.mu);
}

/* ---- a second caller -------------------------------------------------------- */

typedef struct caller {
  kvi_store *s;
  const uint64_t *ids;
  int32_t n;
  kvi_status st;
  int32_t tier; /* of fact 99 (resident: the prefetches drop 96..98), asked after the prefetch */
  bool done;
} caller;

static void *prefetch_then_ask(void *arg) {
  caller *c = arg;
  c->st = kvi_store_prefetch(c->s, 5, c->ids, c->n, NULL);
  if (c->st == KVI_OK) c->st = kvi_store_fact_tier(c->s, 5, 99, &c->tier);
  pthread_mutex_lock(&g.mu);
  c->done = true;
  pthread_cond_broadcast(&g.cv);
  pthread_mutex_unlock(&g.mu);
  return NULL;
}

static kvi_status put_one(kvi_store *s, uint64_t id, uint64_t tag) {
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, L, 4, H, D);
  kvbuf_fill_tag(&b, tag);
  const kvi_status st = kvi_store_put(s, 5, id, &b.v, NULL, NULL);
  kvbuf_free(&b);
  return st;
}

static int32_t tier_of(const kvi_store *s, uint64_t id) {
  int32_t t = -1;
  assert_ok(kvi_store_fact_tier(s, 5, id, &t));
  return t;
}

/* While the I/O thread is inside the read of an entry (fact 10's), a
 * prefetch of the entry's other facts returns, and so do other calls; the
 * three facts then come back from that one read. */
static void test_prefetch_beside_entry_read(void **state) {
  disk_fx *f = *state;
  float *pool = encode3_cache(f, __func__);
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, 1u << 20);
  kvi_store *probe = NULL;
  assert_ok(kvi_store_create(&probe, f->m, &o));
  const uint64_t page = store_stats(probe).page_bytes;
  kvi_store_destroy(probe);
  o = cpu_store_options(KVI_DTYPE_FP32, P, 4 * page);
  o.disk_dir = f->dir;
  kvi_store *s = NULL;
  assert_ok(kvi_store_create(&s, f->m, &o));
  encode3(f, s, pool); /* facts 10, 11, 12 of tenant 5, one entry: a page each */
  for (uint64_t id = 96; id < 100; id++) assert_ok(put_one(s, id, id)); /* 10..12 drop to disk */
  for (uint64_t id = 10; id < 13; id++) assert_int_equal(tier_of(s, id), KVI_TIER_DISK);
  const kvi_store_stats before = store_stats(s);

  g.real = s->disk.ops;
  held_ops = *s->disk.ops;
  held_ops.read = held_read;
  g.hold = true, g.holding = false, g.go = false;
  s->disk.ops = &held_ops;

  const uint64_t first[] = {10}, rest[] = {11, 12};
  assert_ok(kvi_store_prefetch(s, 5, first, 1, NULL));
  const bool holding = wait_flag(&g.holding, 20); /* the I/O thread is inside fact 10's read */
  caller c = {s, rest, 2, KVI_OK, -1, false};
  pthread_t t;
  const bool started = holding && pthread_create(&t, NULL, prefetch_then_ask, &c) == 0;
  const bool returned = started && wait_flag(&c.done, 10);
  let_go(); /* before any assertion: nothing stays blocked */
  if (started) pthread_join(t, NULL);
  assert_true(holding);
  assert_true(started);
  assert_true(returned); /* before: blocked on the entry's lock until the read ended */
  assert_ok(c.st);
  assert_int_equal(c.tier, KVI_TIER_HOST);

  assert_ok(kvi_store_prefetch_wait(s));
  s->disk.ops = g.real;
  const kvi_store_stats after = store_stats(s);
  for (uint64_t id = 10; id < 13; id++) assert_int_not_equal(tier_of(s, id), KVI_TIER_DISK);
  assert_int_equal(after.disk_reads - before.disk_reads, 3);
  /* one read of the entry for the three facts (as unit-disk's test_entry_read_once) */
  kvi_store_options ro = cpu_store_options(KVI_DTYPE_FP32, P, 64 * page);
  kvi_store *ref = NULL;
  assert_ok(kvi_store_create(&ref, f->m, &ro));
  encode3(f, ref, pool);
  for (uint64_t id = 10; id < 13; id++) {
    int32_t T = 0;
    assert_ok(kvi_store_fact_tokens(ref, 5, id, &T));
    const size_t n = (size_t)2 * L * T * H * D;
    float *a = malloc(n * sizeof *a), *b = malloc(n * sizeof *b);
    kvi_kv_view va, vb;
    kvi_kv_view_contiguous(&va, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, a, a + n / 2);
    kvi_kv_view_contiguous(&vb, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, b, b + n / 2);
    assert_ok(kvi_store_read(s, 5, id, &va, NULL));
    assert_ok(kvi_store_read(ref, 5, id, &vb, NULL));
    assert_memory_equal(a, b, n * sizeof *a);
    free(a);
    free(b);
  }
  assert_int_equal(store_stats(s).disk_reads, after.disk_reads); /* all three were resident */
  kvi_store_destroy(ref);
  kvi_store_destroy(s);
  free(pool);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_prefetch_beside_entry_read, fx_setup, fx_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
