/*
 * unit-hardening: hostile use of the public API. Caller values at the edges
 * of their types (sums and products that would wrap), races between calls
 * the headers allow to run at once, the file system working against a save
 * or a journal, and half-configured handles. Each case asserts a clear
 * status, a message, and that nothing was written or lost.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "unit.h"

#define L 2
#define H 2
#define D 8
#define E 4
#define BS 4
#define NB 16
#define T0 5 /* tokens of the facts put by make_fx */

typedef struct fx {
  kvi_model *m;
  kvi_store *s;
  float cache[L][2][NB * BS * H * D]; /* vLLM FlashAttention, per layer [2, NB, BS, H, D] */
  void *layers[L];
  kvi_cache_layout lay;
} fx;

static kvi_rope_spec rope_of_style(kvi_rope_style style) {
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.style = style;
  return r;
}

/* One T0-token fact of fp32 values derived from `tag`, with an embedding. */
static kvi_status put_fact_flags(kvi_store *s, uint64_t tenant, uint64_t id, uint64_t tag, uint32_t flags) {
  float kv[2 * L * T0 * H * D], e[E];
  for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) kv[i] = tag_value(tag, (int64_t)i);
  for (int i = 0; i < E; i++) e[i] = (float)(i + 1) / (float)(1 + (tag % 7));
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T0, H, D, kv, kv + L * T0 * H * D);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.embedding = e;
  po.flags = flags;
  return kvi_store_put(s, tenant, id, &v, &po, NULL);
}

static kvi_status put_fact(kvi_store *s, uint64_t tenant, uint64_t id, uint64_t tag) {
  return put_fact_flags(s, tenant, id, tag, 0);
}

/* A CPU fp32 store with embeddings, RoPE `style` on every layer (UNSET:
 * none set), facts 1 and 2 of tenant 1, and a host cache filled with a
 * pattern. */
static fx *make_fx(kvi_rope_style style) {
  fx *f = calloc(1, sizeof *f);
  assert_non_null(f);
  f->m = make_model(L, H, D, 0, 1);
  if (style != KVI_ROPE_UNSET) {
    const kvi_rope_spec r = rope_of_style(style);
    assert_ok(kvi_model_set_rope(f->m, -1, &r));
  }
  kvi_store_options so = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 20);
  so.embedding_dim = E;
  assert_ok(kvi_store_create(&f->s, f->m, &so));
  assert_ok(put_fact(f->s, 1, 1, 11));
  assert_ok(put_fact(f->s, 1, 2, 12));
  float *c = &f->cache[0][0][0];
  for (size_t i = 0; i < sizeof f->cache / sizeof(float); i++) c[i] = (float)(i % 97) - 48.0f;
  for (int l = 0; l < L; l++) f->layers[l] = f->cache[l];
  assert_ok(kvi_cache_layout_preset(&f->lay, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, BS, NB, f->layers,
                                    NULL, NULL));
  f->lay.memory = KVI_MEMORY_HOST;
  return f;
}

static void free_fx(fx *f) {
  kvi_store_destroy(f->s);
  kvi_model_destroy(f->m);
  free(f);
}

/* The cache still holds make_fx's pattern. */
static void assert_cache_untouched(const fx *f) {
  const float *c = &f->cache[0][0][0];
  for (size_t i = 0; i < sizeof f->cache / sizeof(float); i++)
    if (c[i] != (float)(i % 97) - 48.0f) fail_msg("cache element %zu was written: %g", i, (double)c[i]);
}

static size_t count_of(const kvi_store *s, uint64_t tenant) {
  size_t n = 99;
  assert_ok(kvi_store_count(s, tenant, &n));
  return n;
}

/* ------------------------------------------------------------------------ */
/* sums of caller values that would wrap                                    */
/* ------------------------------------------------------------------------ */

/* first_slot near INT64_MAX: first_slot + tokens - 1 wraps negative, which
 * passed the block-table check and reached memcpy with a negative count. */
static void test_first_slot_overflow(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NEOX);
  kvi_injector *inj = NULL;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  assert_ok(kvi_encoder_create(&enc, f->s, &f->lay, NULL));
  const int32_t table[4] = {0, 1, 2, 3};
  const uint64_t ids[2] = {1, 2};
  const int64_t slots[] = {INT64_MAX, INT64_MAX - 1, INT64_MAX - 2 * T0 + 2, INT64_MAX - 2 * T0 + 1,
                           INT64_MAX / 2, (int64_t)1 << 62};
  for (size_t i = 0; i < sizeof slots / sizeof slots[0]; i++) {
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = 1, rq.fact_ids = ids, rq.num_facts = 2;
    rq.block_table = table, rq.block_table_len = 4;
    rq.first_slot = slots[i];
    assert_status(kvi_inject(inj, &rq, 1, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_inject", "request 0");

    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = 1, c.fact_id = 50, c.block_table = table, c.block_table_len = 4;
    c.first_slot = slots[i], c.num_tokens = T0;
    assert_status(kvi_encode(enc, &c, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_encode", "capture 0");

    kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
    rr.tenant = 1, rr.block_table = table, rr.block_table_len = 4, rr.first_slot = slots[i];
    const float q[E] = {1, 2, 3, 4};
    uint64_t out_ids[2] = {7, 7};
    int32_t counts[1] = {-7}, tokens[1] = {-7};
    assert_status(kvi_retrieve_inject(inj, q, 1, E, &rr, 2, NULL, out_ids, counts, tokens, NULL),
                  KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_retrieve_inject", "request 0");
    assert_true(out_ids[0] == 7 && counts[0] == -7 && tokens[0] == -7);
  }
  assert_cache_untouched(f);
  assert_int_equal(count_of(f->s, 1), 2);
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  free_fx(f);
}

/* kvi_inject_batched's start positions are int64: one near INT64_MAX failed
 * the position check, whose message computed start + tokens - 1 in int64
 * (a signed overflow; it printed a negative end). The message gives the
 * range as it is, its end past INT64_MAX. */
static void test_batched_start_overflow(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NEOX);
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  const int32_t table[4] = {0, 1, 2, 3};
  const uint64_t ids[2] = {1, 2}; /* 2 * T0 = 10 tokens */
  const int32_t off[2] = {0, 2};
  int32_t out[1] = {-7};
  const struct {
    int64_t start;
    const char *range;
  } cases[] = {
      {INT64_MAX, "positions 9223372036854775807..9223372036854775816 are"},
      {INT64_MAX - 1, "positions 9223372036854775806..9223372036854775815 are"},
      {INT64_MAX - 8, "positions 9223372036854775799..9223372036854775808 are"},
      {INT64_MAX - 9, "positions 9223372036854775798..9223372036854775807 are"},
      {INT64_MIN, "positions -9223372036854775808..-9223372036854775799 are"},
      {-1, "positions -1..8 are"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
    b.num_requests = 1, b.tenant = 1, b.fact_ids = ids, b.fact_offsets = off, b.out_tokens = out;
    b.block_tables = table, b.block_table_stride = 4, b.block_table_len = 4;
    b.position_bits = 64, b.start_positions = &cases[i].start;
    assert_status(kvi_inject_batched(inj, &b, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_inject_batched", cases[i].range);
    assert_last_error_has("kvi_inject_batched", "request 0");
  }
  assert_int_equal(out[0], -7);
  assert_cache_untouched(f);
  kvi_injector_destroy(inj);
  free_fx(f);
}

/* The batched calls' row strides: rows - 1 strides plus a row must be
 * addressable. A block_table_stride of 2^62 int32 entries is 2^64 bytes:
 * row 1's address wrapped onto row 0's, and the call used request 0's
 * blocks for request 1 (an embedding_stride of 2^62 fp32 values, capture
 * 0's embedding for capture 1). Refused, naming the field and its value,
 * with nothing written; one row is read whatever the stride. */
static void test_batch_row_stride_overflow(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NEOX);
  kvi_injector *inj = NULL;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  assert_ok(kvi_encoder_create(&enc, f->s, &f->lay, NULL));
  const int32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const uint64_t ids[2] = {1, 2};
  const int32_t off[3] = {0, 1, 2};
  int32_t out[2] = {-7, -7};
  const struct {
    int64_t stride;
    const char *value;
  } bad[] = {
      {(int64_t)1 << 62, "block_table_stride is 4611686018427387904"}, /* wrapped onto row 0 */
      {INT64_MAX, "block_table_stride is 9223372036854775807"},        /* (rows - 1) * stride + len wraps int64 */
      {(int64_t)1 << 61, "block_table_stride is 2305843009213693952"}, /* 2^63 bytes and more */
  };
  kvi_inject_batch ib = KVI_INJECT_BATCH_INIT;
  ib.num_requests = 2, ib.tenant = 1, ib.fact_ids = ids, ib.fact_offsets = off, ib.out_tokens = out;
  ib.block_tables = table, ib.block_table_len = 4;
  const uint64_t cids[2] = {50, 51};
  const int32_t ntok[2] = {T0, T0};
  float emb[2 * E] = {1, 2, 3, 4, 4, 3, 2, 1};
  kvi_encode_batch eb = KVI_ENCODE_BATCH_INIT;
  eb.num_captures = 2, eb.tenant = 3, eb.fact_ids = cids, eb.num_tokens = ntok;
  eb.block_tables = table, eb.block_table_len = 4;
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ib.block_table_stride = bad[i].stride;
    assert_status(kvi_inject_batched(inj, &ib, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_inject_batched", bad[i].value);
    eb.block_table_stride = bad[i].stride;
    assert_status(kvi_encode_batched(enc, &eb, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_encode_batched", bad[i].value);
  }
  eb.block_table_stride = 4, eb.embeddings = emb;
  const int64_t ebad[] = {(int64_t)1 << 62, INT64_MAX, (int64_t)1 << 61};
  for (size_t i = 0; i < sizeof ebad / sizeof ebad[0]; i++) {
    eb.embedding_stride = ebad[i];
    assert_status(kvi_encode_batched(enc, &eb, NULL), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_encode_batched", "embedding_stride is");
  }
  assert_last_error_has("kvi_encode_batched", "2305843009213693952");
  assert_true(out[0] == -7 && out[1] == -7);
  assert_cache_untouched(f);
  assert_int_equal(count_of(f->s, 3), 0);
  /* one row: the stride is never applied */
  ib.num_requests = 1, ib.block_table_stride = (int64_t)1 << 62;
  assert_ok(kvi_inject_batched(inj, &ib, NULL, NULL));
  assert_int_equal(out[0], T0);
  eb.num_captures = 1, eb.block_table_stride = INT64_MAX, eb.embedding_stride = INT64_MAX;
  assert_ok(kvi_encode_batched(enc, &eb, NULL));
  assert_int_equal(count_of(f->s, 3), 1);
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  free_fx(f);
}

/* kvi_encode_batched with int64 positions narrowed a position for every
 * token the captures claimed (allocating and reading the sum of num_tokens)
 * before kvi_encode checked the captures: 65,536 captures of INT32_MAX
 * tokens each (1.4e14 positions) failed with KVI_ERR_OUT_OF_MEMORY, and a
 * sum that could be allocated was read far past the caller's positions. The
 * captures (counts, ids, tables) are checked first: their error, at once. */
static void test_encode_batched_captures_first(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NEOX);
  kvi_encoder *enc = NULL;
  assert_ok(kvi_encoder_create(&enc, f->s, &f->lay, NULL));
  enum { NC = 65536 };
  uint64_t *ids = malloc(NC * sizeof *ids);
  int32_t *ntok = malloc(NC * sizeof *ntok), *tables = malloc(NC * 4 * sizeof *tables);
  assert_true(ids && ntok && tables);
  for (int i = 0; i < NC; i++) {
    ids[i] = 100 + (uint64_t)i, ntok[i] = INT32_MAX;
    for (int k = 0; k < 4; k++) tables[4 * i + k] = k;
  }
  const int64_t pos[2 * T0] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
  kvi_encode_batch eb = KVI_ENCODE_BATCH_INIT;
  eb.num_captures = NC, eb.tenant = 3, eb.fact_ids = ids, eb.num_tokens = ntok;
  eb.block_tables = tables, eb.block_table_stride = 4, eb.block_table_len = 4;
  eb.position_bits = 64, eb.positions = pos; /* num_positions 0: not checked against the sum */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  /* tables: capture 0's 4 blocks of 4 hold 16 of its tokens */
  assert_status(kvi_encode_batched(enc, &eb, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_encode_batched", "capture 0: sequence slots 0..2147483646");
  /* counts */
  ntok[0] = 0;
  assert_status(kvi_encode_batched(enc, &eb, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_encode_batched", "capture 0: num_tokens is 0");
  /* ids: captures 0 and 1 valid, 1 repeating 0 */
  ntok[0] = ntok[1] = T0, ids[1] = ids[0];
  assert_status(kvi_encode_batched(enc, &eb, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_encode_batched", "capture 1 repeats fact 100");
  clock_gettime(CLOCK_MONOTONIC, &t1);
  const double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  if (s > 10.0) fail_msg("three refused calls took %.1f s", s);
  assert_int_equal(count_of(f->s, 3), 0);
  /* the first two alone are valid: their positions are read and stored */
  const float emb[2 * E] = {1, 2, 3, 4, 4, 3, 2, 1};
  eb.num_captures = 2, ids[1] = 101, eb.embeddings = emb;
  assert_ok(kvi_encode_batched(enc, &eb, NULL));
  assert_int_equal(count_of(f->s, 3), 2);
  free(ids);
  free(ntok);
  free(tables);
  kvi_encoder_destroy(enc);
  free_fx(f);
}

/* ------------------------------------------------------------------------ */
/* races the headers allow                                                  */
/* ------------------------------------------------------------------------ */

/* A directory for files that are written and flushed many times: tmpfs when
 * there is one (fsync costs nothing there). */
static void scratch_dir(char *out, size_t n) {
  struct stat sb;
  snprintf(out, n, "%s/kvi-hardening-XXXXXX", stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) ? "/dev/shm" : "/tmp");
  assert_non_null(mkdtemp(out));
}

static void remove_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  char p[512];
  while ((e = readdir(d)))
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
      snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
      unlink(p);
    }
  closedir(d);
  rmdir(dir);
}

typedef struct racer {
  kvi_store *s;
  const char *path;
  atomic_int *stop;
  int rounds;
  int failures;
  char err[256];
  atomic_int *started; /* putters that have made their first put (the toggler waits for both) */
} racer;

#define PUT_IDS 4 /* the facts of tenant 5 the putters replace, round robin */

static void *journal_toggler(void *arg) {
  racer *r = arg;
  while (atomic_load(r->started) < 2) sched_yield(); /* the opens race puts, not an idle store */
  for (int i = 0; i < r->rounds; i++) {
    kvi_status st = kvi_store_journal_open(r->s, r->path, 0);
    if (st == KVI_OK) st = kvi_store_journal_close(r->s);
    if (st != KVI_OK) {
      if (!r->err[0]) snprintf(r->err, sizeof r->err, "journal round %d: status %d, %s; ", i, (int)st, kvi_last_error());
      r->failures++;
    }
  }
  atomic_store(r->stop, 1);
  return NULL;
}

/* Replaces facts 0 .. PUT_IDS - 1 of tenant 5 in turn until the toggler is
 * done, and each of them at least once whenever it is done. */
static void *putter(void *arg) {
  racer *r = arg;
  for (uint64_t i = 0; i < PUT_IDS || !atomic_load(r->stop); i++) {
    const kvi_status st = put_fact_flags(r->s, 5, i % PUT_IDS, i, KVI_PUT_REPLACE);
    if (st != KVI_OK) {
      if (!r->err[0]) snprintf(r->err, sizeof r->err, "put %llu: status %d, %s; ", (unsigned long long)i, (int)st, kvi_last_error());
      r->failures++;
    }
    if (i == 0) atomic_fetch_add(r->started, 1);
    r->rounds++;
  }
  return NULL;
}

/* kvi_store_put decided whether to make journal records from store->journal
 * read before it took the lock: a journal opened in between was appended
 * through a NULL record array. Two threads putting, one opening and closing
 * the journal while both put. (The opens start once both putters have put:
 * a toggler that ran its 400 rounds before a putter was scheduled left the
 * putters fewer than PUT_IDS puts, and the count below short.) */
static void test_put_races_journal_open(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NONE);
  char dir[64], path[96];
  scratch_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/journal.kvi", dir);
  atomic_int stop = 0, started = 0;
  racer tog = {f->s, path, &stop, 400, 0, "", &started}, p1 = {f->s, NULL, &stop, 0, 0, "", &started}, p2 = p1;
  pthread_t a, b, c;
  assert_int_equal(pthread_create(&b, NULL, putter, &p1), 0);
  assert_int_equal(pthread_create(&c, NULL, putter, &p2), 0);
  assert_int_equal(pthread_create(&a, NULL, journal_toggler, &tog), 0);
  pthread_join(a, NULL);
  pthread_join(b, NULL);
  pthread_join(c, NULL);
  print_message("    %d journal opens, %d + %d puts\n", tog.rounds, p1.rounds, p2.rounds);
  if (tog.failures || p1.failures || p2.failures)
    fail_msg("%d journal, %d + %d put failures: %s%s%s", tog.failures, p1.failures, p2.failures, tog.err, p1.err, p2.err);
  assert_int_equal(count_of(f->s, 5), PUT_IDS);
  remove_dir(dir);
  free_fx(f);
}

typedef struct retriever {
  kvi_injector *inj;
  atomic_int *stop;
  int calls, failures;
  char err[256];
} retriever;

static void *retrieve_loop(void *arg) {
  retriever *r = arg;
  const int32_t table[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  const float q[E] = {1, -1, 2, 0.5f};
  while (!atomic_load(r->stop)) {
    kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
    rr.tenant = 1, rr.block_table = table, rr.block_table_len = 8;
    uint64_t ids[5];
    int32_t counts[1], tokens[1];
    const kvi_status st = kvi_retrieve_inject(r->inj, q, 1, E, &rr, 5, NULL, ids, counts, tokens, NULL);
    if (st != KVI_OK || counts[0] < 1 || tokens[0] != counts[0] * T0) {
      if (!r->err[0])
        snprintf(r->err, sizeof r->err, "call %d: status %d, %s; ", r->calls, (int)st, st ? kvi_last_error() : "bad counts");
      r->failures++;
    }
    r->calls++;
  }
  return NULL;
}

/* Removes and puts again facts first and first + 1 of tenant 1, r->rounds
 * times or for 1.5 s (under valgrind), whichever ends first. */
static void *remove_loop(void *arg) {
  racer *r = arg;
  const uint64_t first = r->path ? 4 : 2; /* two removers, two facts each */
  const double until = now_s() + 1.5;
  const int want = r->rounds;
  r->rounds = 0;
  for (int i = 0; i < want && now_s() < until; i++, r->rounds++) {
    const uint64_t id = first + (uint64_t)(i & 1);
    if (kvi_store_remove(r->s, 1, id) != KVI_OK || put_fact(r->s, 1, id, (uint64_t)i) != KVI_OK) {
      if (!r->err[0]) snprintf(r->err, sizeof r->err, "remover: %s", kvi_last_error());
      r->failures++;
    }
  }
  atomic_fetch_add(r->stop, 1);
  return NULL;
}

/* kvi_retrieve_inject on the host path searched, planned and injected under
 * separate holds of the store's lock: a fact the search returned could be
 * removed before the injection, which then failed with KVI_ERR_NOT_FOUND.
 * The header says both locks are held for the call. */
static void test_retrieve_atomic_host(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NONE);
  for (uint64_t id = 3; id <= 5; id++) assert_ok(put_fact(f->s, 1, id, 10 + id)); /* fact 1 stays, 2..5 churn */
  kvi_injector *inj = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  atomic_int stop = 0;
  retriever a = {inj, &stop, 0, 0, ""}, b = a;
  racer r1 = {f->s, NULL, &stop, 200000, 0, "", NULL}, r2 = r1;
  r2.path = "second"; /* its facts are 4 and 5 */
  atomic_int removers_done = 0;
  r1.stop = r2.stop = &removers_done;
  pthread_t ta, tb, t1, t2;
  assert_int_equal(pthread_create(&t1, NULL, remove_loop, &r1), 0);
  assert_int_equal(pthread_create(&t2, NULL, remove_loop, &r2), 0);
  assert_int_equal(pthread_create(&ta, NULL, retrieve_loop, &a), 0);
  assert_int_equal(pthread_create(&tb, NULL, retrieve_loop, &b), 0);
  pthread_join(t1, NULL);
  pthread_join(t2, NULL);
  atomic_store(&stop, 1);
  pthread_join(ta, NULL);
  pthread_join(tb, NULL);
  print_message("    %d + %d retrieve-and-inject calls beside %d + %d removes\n", a.calls, b.calls, r1.rounds, r2.rounds);
  if (r1.failures || r2.failures) fail_msg("%s%s", r1.err, r2.err);
  if (a.failures || b.failures)
    fail_msg("%d + %d of %d calls failed; first: %s%s", a.failures, b.failures, a.calls + b.calls, a.err, b.err);
  kvi_injector_destroy(inj);
  free_fx(f);
}

/* ------------------------------------------------------------------------ */
/* the file system working against saves and journals                       */
/* ------------------------------------------------------------------------ */

static size_t dir_entries(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  assert_non_null(d);
  size_t n = 0;
  struct dirent *e;
  while ((e = readdir(d))) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
  closedir(d);
  return n;
}

static void write_file(const char *path, const char *text) {
  FILE *fp = fopen(path, "w");
  assert_non_null(fp);
  fputs(text, fp);
  fclose(fp);
}

static bool file_is(const char *path, const char *text) {
  char buf[256] = {0};
  FILE *fp = fopen(path, "r");
  if (!fp) return false;
  const size_t n = fread(buf, 1, sizeof buf - 1, fp);
  fclose(fp);
  return n == strlen(text) && memcmp(buf, text, n) == 0;
}

/* The temporary file of a save was opened with O_CREAT | O_TRUNC at a name
 * anyone could predict ("<path>.tmp.<pid>.<n>"): a symlink planted there
 * had the save truncate and overwrite its target, and the rename then put
 * the symlink at the path. Now: an unpredictable name, O_EXCL | O_NOFOLLOW,
 * mode 0600, and stale temporaries of the same path are removed. */
static void test_save_temporary_file(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NONE);
  char dir[64], path[128], victim[128], name[192];
  scratch_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/store.kvi", dir);
  snprintf(victim, sizeof victim, "%s/victim", dir);
  write_file(victim, "precious");
  for (int n = 0; n < 64; n++) { /* every name the old scheme would use first */
    snprintf(name, sizeof name, "%s.tmp.%ld.%d", path, (long)getpid(), n);
    assert_int_equal(symlink(victim, name), 0);
  }
  const mode_t old_mask = umask(0); /* the mode must not depend on the umask */
  for (int round = 0; round < 3; round++) assert_ok(kvi_store_save(f->s, path, NULL));
  umask(old_mask);
  assert_true(file_is(victim, "precious"));
  struct stat sb;
  assert_int_equal(lstat(path, &sb), 0);
  assert_true(S_ISREG(sb.st_mode));
  assert_int_equal(sb.st_mode & 07777, 0600);
  assert_int_equal(sb.st_uid, geteuid());
  /* the planted symlinks are not ours to remove, and were not followed */
  assert_int_equal(dir_entries(dir, "store.kvi.tmp."), 64);
  for (int n = 0; n < 64; n++) {
    snprintf(name, sizeof name, "%s.tmp.%ld.%d", path, (long)getpid(), n);
    unlink(name);
  }
  /* a stale temporary of this path (a save that died) is cleaned up; one a
   * save in progress holds (locked) stays, as do other paths' */
  snprintf(name, sizeof name, "%s.tmp.0123456789abcdef", path);
  write_file(name, "stale");
  char held[192], other[192];
  snprintf(held, sizeof held, "%s.tmp.fedcba9876543210", path);
  write_file(held, "in progress");
  const int hfd = open(held, O_RDONLY);
  assert_true(hfd >= 0);
  assert_int_equal(flock(hfd, LOCK_EX), 0);
  snprintf(other, sizeof other, "%s/other.kvi.tmp.0123456789abcdef", dir);
  write_file(other, "someone else's");
  assert_ok(kvi_store_save(f->s, path, NULL));
  assert_int_equal(access(name, F_OK), -1);
  assert_true(file_is(held, "in progress"));
  assert_true(file_is(other, "someone else's"));
  close(hfd);
  unlink(held);
  unlink(other);
  /* the journal's file is made the same way */
  assert_ok(kvi_store_journal_open(f->s, path, 0));
  assert_ok(put_fact(f->s, 2, 1, 3));
  assert_ok(kvi_store_journal_close(f->s));
  assert_int_equal(lstat(path, &sb), 0);
  assert_int_equal(sb.st_mode & 07777, 0600);
  assert_int_equal(dir_entries(dir, "store.kvi.tmp."), 0);
  kvi_store *back = NULL;
  kvi_store_options so = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 20);
  so.embedding_dim = E;
  assert_ok(kvi_store_load(&back, f->m, &so, path, NULL));
  assert_int_equal(count_of(back, 1), 2);
  assert_int_equal(count_of(back, 2), 1);
  kvi_store_destroy(back);
  remove_dir(dir);
  free_fx(f);
}

/* A journal whose file was unlinked or replaced: appends would go to a file
 * no load will ever read. The next journaled call fails with KVI_ERR_IO and
 * changes nothing; reopening the journal writes a fresh file. */
static void test_journal_file_replaced(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NONE);
  kvi_encoder *enc = NULL;
  assert_ok(kvi_encoder_create(&enc, f->s, &f->lay, NULL));
  char dir[64], path[128], other[128];
  scratch_dir(dir, sizeof dir);
  snprintf(path, sizeof path, "%s/journal.kvi", dir);
  snprintf(other, sizeof other, "%s/other", dir);
  for (int how = 0; how < 2; how++) {
    assert_ok(kvi_store_journal_open(f->s, path, 0));
    assert_ok(put_fact(f->s, 3, 1, 1));
    if (how == 0) {
      assert_int_equal(unlink(path), 0);
    } else {
      write_file(other, "not a journal");
      assert_int_equal(rename(other, path), 0);
    }
    assert_status(put_fact(f->s, 3, 2, 2), KVI_ERR_IO);
    assert_last_error_has("kvi_store_put", path);
    assert_status(kvi_store_remove(f->s, 3, 1), KVI_ERR_IO);
    assert_last_error_has("kvi_store_remove", "journal");
    const int32_t table[2] = {0, 1};
    kvi_capture c = KVI_CAPTURE_INIT;
    const float emb[E] = {1, 0, 0, 0};
    c.tenant = 3, c.fact_id = 9, c.block_table = table, c.block_table_len = 2, c.num_tokens = 3, c.embedding = emb;
    assert_status(kvi_encode(enc, &c, 1, NULL), KVI_ERR_IO);
    assert_int_equal(count_of(f->s, 3), 1);
    if (how == 1) assert_true(file_is(path, "not a journal"));
    /* a fresh journal at the path works again, and holds everything */
    assert_ok(kvi_store_journal_open(f->s, path, 0));
    assert_ok(put_fact(f->s, 3, 2, 2));
    assert_ok(kvi_store_remove(f->s, 3, 2));
    assert_ok(kvi_store_journal_close(f->s));
    kvi_store *back = NULL;
    kvi_store_options so = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 20);
    so.embedding_dim = E;
    assert_ok(kvi_store_load(&back, f->m, &so, path, NULL));
    assert_int_equal(count_of(back, 3), 1);
    assert_int_equal(count_of(back, 1), 2);
    kvi_store_destroy(back);
    assert_ok(kvi_store_remove(f->s, 3, 1));
  }
  kvi_encoder_destroy(enc);
  remove_dir(dir);
  free_fx(f);
}

/* ------------------------------------------------------------------------ */
/* half-configured handles and bad tables                                   */
/* ------------------------------------------------------------------------ */

/* A model whose RoPE was never set injected unrotated keys and returned
 * KVI_OK. Every layer must be given a spec or KVI_ROPE_NONE. */
static void test_rope_unset_refused(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_UNSET);
  kvi_injector *inj = NULL;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  assert_ok(kvi_encoder_create(&enc, f->s, &f->lay, NULL));
  const int32_t table[4] = {0, 1, 2, 3};
  const uint64_t ids[1] = {1};
  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = 1, rq.fact_ids = ids, rq.num_facts = 1, rq.block_table = table, rq.block_table_len = 4;
  assert_status(kvi_inject(inj, &rq, 1, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_inject", "layer 0's RoPE was never set");
  kvi_capture c = KVI_CAPTURE_INIT;
  c.tenant = 1, c.fact_id = 50, c.block_table = table, c.block_table_len = 4, c.num_tokens = 3;
  assert_status(kvi_encode(enc, &c, 1, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_encode", "layer 0's RoPE was never set");
  kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
  rr.tenant = 1, rr.block_table = table, rr.block_table_len = 4;
  const float q[E] = {1, 2, 3, 4};
  uint64_t out_ids[1];
  int32_t counts[1], tokens[1];
  assert_status(kvi_retrieve_inject(inj, q, 1, E, &rr, 1, NULL, out_ids, counts, tokens, NULL),
                KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_retrieve_inject", "RoPE was never set");
  assert_cache_untouched(f);
  assert_int_equal(count_of(f->s, 1), 2);
  kvi_encoder_destroy(enc);
  kvi_injector_destroy(inj);
  kvi_store_destroy(f->s);

  /* one layer left unset is named; the store copies the model as it is */
  const kvi_rope_spec neox = rope_of_style(KVI_ROPE_NEOX);
  assert_ok(kvi_model_set_rope(f->m, 0, &neox));
  kvi_rope_spec got = KVI_ROPE_SPEC_INIT;
  assert_ok(kvi_model_get_rope(f->m, 1, &got));
  assert_int_equal(got.style, KVI_ROPE_UNSET);
  kvi_store_options so = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 20);
  so.embedding_dim = E;
  assert_ok(kvi_store_create(&f->s, f->m, &so));
  assert_ok(put_fact(f->s, 1, 1, 11));
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  assert_status(kvi_inject(inj, &rq, 1, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_inject", "layer 1's RoPE was never set");
  assert_cache_untouched(f);
  kvi_injector_destroy(inj);
  kvi_store_destroy(f->s);
  /* explicitly NONE: allowed, and the keys land as stored */
  const kvi_rope_spec none = rope_of_style(KVI_ROPE_NONE);
  assert_ok(kvi_model_set_rope(f->m, 1, &none));
  assert_ok(kvi_store_create(&f->s, f->m, &so));
  assert_ok(put_fact(f->s, 1, 1, 11));
  assert_ok(kvi_injector_create(&inj, f->s, &f->lay, NULL));
  assert_ok(kvi_inject(inj, &rq, 1, NULL, NULL));
  /* layer 1's K of token 0, head 0 is the fact's K (layer 1, token 0, head 0) */
  for (int d = 0; d < D; d++)
    assert_true(f->cache[1][0][d] == tag_value(11, (int64_t)(1 * T0 * H * D + d)));
  kvi_injector_destroy(inj);
  free_fx(f);
}

/* An engine cos/sin table holding a NaN or an infinity rotated keys into
 * NaN; it is refused, naming the element, and the layer keeps its RoPE. */
static void test_table_not_finite(void **state) {
  (void)state;
  kvi_model *m = make_model(L, H, D, 0, 1);
  enum { POS = 6 };
  float table[POS * D];
  for (int i = 0; i < POS * D; i++) table[i] = (float)(i % 5) / 5.0f;
  const float bad[3] = {NAN, INFINITY, -INFINITY};
  for (int b = 0; b < 3; b++) {
    table[3 * D + 5] = bad[b];
    kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
    r.cos_sin_table = table;
    r.table_positions = POS;
    assert_status(kvi_model_set_rope(m, -1, &r), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_model_set_rope", "cos_sin_table[3][5]");
    /* fp16 and bf16 tables too */
    uint16_t h16[POS * D];
    for (int i = 0; i < POS * D; i++) h16[i] = ref_f32_to_f16(table[i]);
    r.cos_sin_table = h16, r.table_dtype = KVI_DTYPE_FP16;
    assert_status(kvi_model_set_rope(m, 1, &r), KVI_ERR_INVALID_ARGUMENT);
    for (int i = 0; i < POS * D; i++) h16[i] = ref_f32_to_bf16(table[i]);
    r.table_dtype = KVI_DTYPE_BF16;
    assert_status(kvi_model_set_rope(m, 1, &r), KVI_ERR_INVALID_ARGUMENT);
    kvi_rope_spec got = KVI_ROPE_SPEC_INIT;
    assert_ok(kvi_model_get_rope(m, 1, &got));
    assert_int_equal(got.style, KVI_ROPE_UNSET);
  }
  table[3 * D + 5] = 0.25f; /* finite again: accepted */
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.cos_sin_table = table;
  r.table_positions = POS;
  assert_ok(kvi_model_set_rope(m, -1, &r));
  kvi_model_destroy(m);
}

/* Cache layouts whose K and V, or whose heads, share addresses: an
 * injection would write one element twice (and a capture read a mixture). */
static void test_layout_overlap_refused(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NONE);
  kvi_injector *inj = NULL;
  /* every preset is accepted */
  static float pool[2 * L * NB * BS * H * D * 2];
  void *kl[L], *vl[L];
  for (int l = 0; l < L; l++) kl[l] = pool + (size_t)l * 2 * NB * BS * H * D, vl[l] = pool + sizeof pool / sizeof(float) / 2 + (size_t)l * NB * BS * H * D;
  for (int p = KVI_CACHE_VLLM_FLASH_ATTN; p <= KVI_CACHE_HF_CONTIGUOUS; p++) {
    kvi_cache_layout cl;
    assert_ok(kvi_cache_layout_preset(&cl, (kvi_cache_preset)p, KVI_DTYPE_FP32, L, H, D, BS, NB, kl, vl, pool));
    cl.memory = KVI_MEMORY_HOST;
    if (kvi_injector_create(&inj, f->s, &cl, NULL) != KVI_OK) fail_msg("preset %d: %s", p, kvi_last_error());
    kvi_injector_destroy(inj);
  }
  struct {
    const char *what, *needle;
    int64_t block_stride, token_stride, head_stride, v_offset;
  } bad[] = {
      {"V at K", "overlap", BS * H * D, H * D, D, 0},
      {"V inside K", "overlap", BS * H * D, H * D, D, 3 * D},
      {"V not element-aligned inside K", "overlap", -1, 0, 0, 0}, /* set below */
      {"heads overlapping", "overlap", BS * H * D, H * D, D - 1, NB * BS * H * D},
      {"heads sharing a row", "overlap", BS * H * D, H * D, 0, NB * BS * H * D},
      {"tokens overlapping heads", "overlap", BS * H * D, D, D, NB * BS * H * D},
      {"blocks overlapping", "overlap", H * D, H * D, D, NB * BS * H * D},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kvi_cache_layout cl = f->lay;
    if (bad[i].block_stride < 0) { /* V half an element past K */
      void *vp[L];
      for (int l = 0; l < L; l++) vp[l] = (char *)f->layers[l] + 2;
      cl.v_layers = vp;
      assert_status(kvi_injector_create(&inj, f->s, &cl, NULL), KVI_ERR_INVALID_ARGUMENT);
      assert_last_error_has("kvi_injector_create", bad[i].needle);
      continue;
    }
    cl.block_stride = bad[i].block_stride, cl.token_stride = bad[i].token_stride;
    cl.head_stride = bad[i].head_stride, cl.v_offset = bad[i].v_offset;
    kvi_status st = kvi_injector_create(&inj, f->s, &cl, NULL);
    if (st != KVI_ERR_INVALID_ARGUMENT) fail_msg("%s: status %d, expected INVALID_ARGUMENT", bad[i].what, (int)st);
    assert_last_error_has("kvi_injector_create", bad[i].needle);
    kvi_encoder *enc = NULL;
    assert_status(kvi_encoder_create(&enc, f->s, &cl, NULL), KVI_ERR_INVALID_ARGUMENT);
  }
  free_fx(f);
}

/* kvi_store_search with 0 queries: options, dim and k are checked as for any
 * call; then KVI_OK with nothing read or written (NULL arrays allowed). */
static void test_search_zero_queries(void **state) {
  (void)state;
  fx *f = make_fx(KVI_ROPE_NONE);
  assert_ok(kvi_store_search(f->s, NULL, 0, E, NULL, 3, NULL, NULL, NULL, NULL, NULL));
  uint64_t ids[1] = {42};
  float scores[1] = {4.2f};
  int32_t counts[1] = {42};
  assert_ok(kvi_store_search(f->s, NULL, 0, E, NULL, 1, ids, scores, counts, NULL, NULL));
  assert_true(ids[0] == 42 && scores[0] == 4.2f && counts[0] == 42);
  assert_status(kvi_store_search(f->s, NULL, 0, E + 1, NULL, 3, NULL, NULL, NULL, NULL, NULL), KVI_ERR_MISMATCH);
  assert_status(kvi_store_search(f->s, NULL, 0, E, NULL, 0, NULL, NULL, NULL, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
  so.workspace_bytes = 1;
  assert_status(kvi_store_search(f->s, NULL, 0, E, NULL, 3, NULL, NULL, NULL, &so, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_search(f->s, NULL, -1, E, NULL, 3, NULL, NULL, NULL, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  /* a store without embeddings refuses every search, 0 queries too */
  kvi_store *plain = NULL;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, 4, 1u << 16);
  assert_ok(kvi_store_create(&plain, f->m, &o));
  assert_status(kvi_store_search(plain, NULL, 0, E, NULL, 3, NULL, NULL, NULL, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_store_search", "no embeddings");
  kvi_store_destroy(plain);
  free_fx(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      /* first: the temporary-file test plants the names a save would have used first */
      cmocka_unit_test(test_save_temporary_file),   cmocka_unit_test(test_first_slot_overflow),
      cmocka_unit_test(test_put_races_journal_open), cmocka_unit_test(test_retrieve_atomic_host),
      cmocka_unit_test(test_journal_file_replaced),
      cmocka_unit_test(test_rope_unset_refused),    cmocka_unit_test(test_table_not_finite),
      cmocka_unit_test(test_layout_overlap_refused), cmocka_unit_test(test_search_zero_queries),
      cmocka_unit_test(test_batched_start_overflow), cmocka_unit_test(test_batch_row_stride_overflow),
      cmocka_unit_test(test_encode_batched_captures_first),
  };
  const char *only = getenv("KVI_TEST_FILTER"); /* e.g. KVI_TEST_FILTER=test_retrieve_atomic_host */
  if (only && *only) cmocka_set_test_filter(only);
  return cmocka_run_group_tests_name("unit-hardening", tests, NULL, NULL);
}
