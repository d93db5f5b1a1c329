/*
 * unit-tokens: facts' token ids (kvinject/store.h, "Token ids"): kept by
 * puts and captures, replaced and freed with their fact, read back with
 * their hash, and checked by injections that give expect_token_ids
 * (KVI_ERR_TOKEN_MISMATCH, nothing written).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <unistd.h>

#include "unit.h"

#include "ref64.h"
#include "rope_catalogue.h"

enum { TL = 2, TH = 2, TD = 16, TBS = 4, TNB = 16, TP = 4 };

typedef struct tenv {
  kvi_model *m;
  kvi_store *s;
  ecache c;
  kvi_injector *inj;
  kvi_encoder *enc;
  rfact f1, f2, f3;             /* tenant 1: facts 1 (5 tokens), 2 (3 tokens), 3 (4 tokens, no ids) */
  int32_t ids1[5], ids2[3];
  int32_t table[TNB];
  rng r;
} tenv;

/* The documented hash: FNV-1a 64 over the ids as little-endian int32. */
static uint64_t token_hash(const int32_t *ids, int32_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t i = 0; i < n; i++) {
    unsigned char b[4];
    const uint32_t v = (uint32_t)ids[i];
    b[0] = (unsigned char)v, b[1] = (unsigned char)(v >> 8), b[2] = (unsigned char)(v >> 16),
    b[3] = (unsigned char)(v >> 24);
    for (int k = 0; k < 4; k++) h = (h ^ b[k]) * 0x100000001b3ull;
  }
  return h;
}

static void put_ids(kvi_store *s, const rfact *f, const int32_t *ids, uint32_t flags) {
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, f->L, f->T, f->H, f->D, f->k, f->v);
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.flags = flags;
  o.token_ids = ids;
  assert_ok(kvi_store_put(s, f->tenant, f->id, &v, &o, NULL));
}

static void expect_ids(const kvi_store *s, uint64_t tenant, uint64_t id, const int32_t *want, int32_t n) {
  int32_t got[64], num = -1;
  uint64_t hash = 1;
  assert_ok(kvi_store_fact_token_ids(s, tenant, id, got, 64, &num, &hash));
  assert_int_equal(num, n);
  assert_true(hash == (n ? token_hash(want, n) : 0));
  if (n) assert_memory_equal(got, want, (size_t)n * sizeof *want);
}

static int tenv_setup(void **state) {
  tenv *e = calloc(1, sizeof *e);
  assert_non_null(e);
  rng_seed(&e->r, "unit-tokens");
  e->m = make_model(TL, TH, TD, 0, 1);
  const kvi_rope_spec sp = rope(KVI_ROPE_NEOX, 0, 10000.0);
  for (int l = 0; l < TL; l++) assert_ok(kvi_model_set_rope(e->m, l, &sp));
  const uint64_t page_bytes = (uint64_t)TP * TL * 2 * TH * TD * 4;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, TP, page_bytes * 64);
  assert_ok(kvi_store_create(&e->s, e->m, &o));
  ec_make(&e->c, KVI_CACHE_VLLM_PACKED, KVI_DTYPE_FP16, TL, TH, TD, TBS, TNB, KVI_SCALE_NONE, &e->r);
  assert_ok(kvi_injector_create(&e->inj, e->s, &e->c.lay, NULL));
  assert_ok(kvi_encoder_create(&e->enc, e->s, &e->c.lay, NULL));
  rfact_make(&e->f1, &e->r, 1, 1, TL, 5, TH, TD, -3, 3);
  rfact_make(&e->f2, &e->r, 1, 2, TL, 3, TH, TD, -3, 3);
  rfact_make(&e->f3, &e->r, 1, 3, TL, 4, TH, TD, -3, 3);
  for (int i = 0; i < 5; i++) e->ids1[i] = 1000 + 7 * i;
  const int32_t i2[3] = {-5, 0, 0x7fffffff};
  memcpy(e->ids2, i2, sizeof i2);
  put_ids(e->s, &e->f1, e->ids1, 0);
  put_ids(e->s, &e->f2, e->ids2, 0);
  put_ids(e->s, &e->f3, NULL, 0);
  for (int i = 0; i < TNB; i++) e->table[i] = TNB - 1 - i;
  *state = e;
  return 0;
}

static int tenv_teardown(void **state) {
  tenv *e = *state;
  kvi_encoder_destroy(e->enc);
  kvi_injector_destroy(e->inj);
  kvi_store_destroy(e->s);
  kvi_model_destroy(e->m);
  ec_free(&e->c);
  rfact_free(&e->f1);
  rfact_free(&e->f2);
  rfact_free(&e->f3);
  free(e);
  return 0;
}

static void test_put_read_back(void **state) {
  tenv *e = *state;
  expect_ids(e->s, 1, 1, e->ids1, 5);
  expect_ids(e->s, 1, 2, e->ids2, 3);
  expect_ids(e->s, 1, 3, NULL, 0);
  /* the FNV-1a 64 of no bytes is the offset basis; of one id 0 the documented steps */
  assert_true(token_hash(NULL, 0) == 0xcbf29ce484222325ull);
  /* errors write nothing */
  int32_t out[4] = {9, 9, 9, 9}, num = 77;
  uint64_t hash = 77;
  assert_status(kvi_store_fact_token_ids(e->s, 1, 1, out, 4, &num, &hash), KVI_ERR_CAPACITY);
  assert_last_error_has("kvi_store_fact_token_ids", "5 token ids");
  assert_true(out[0] == 9 && num == 77 && hash == 77);
  assert_status(kvi_store_fact_token_ids(e->s, 1, 99, out, 4, &num, &hash), KVI_ERR_NOT_FOUND);
  assert_status(kvi_store_fact_token_ids(e->s, 2, 1, out, 4, &num, &hash), KVI_ERR_NOT_FOUND); /* other tenant */
  assert_status(kvi_store_fact_token_ids(NULL, 1, 1, out, 4, &num, &hash), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_token_ids(e->s, 1, 1, out, 4, NULL, &hash), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_token_ids(e->s, 1, 1, NULL, 4, &num, &hash), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_store_fact_token_ids(e->s, 1, 1, out, -1, &num, &hash), KVI_ERR_INVALID_ARGUMENT);
  assert_true(num == 77 && hash == 77);
  /* capacity 0 is enough for a fact without ids; the hash is optional */
  assert_ok(kvi_store_fact_token_ids(e->s, 1, 3, NULL, 0, &num, NULL));
  assert_int_equal(num, 0);
}

static void test_replace_and_remove(void **state) {
  tenv *e = *state;
  /* replace with other ids, then without, then with again; remove frees them (valgrind) */
  rfact g;
  rfact_make(&g, &e->r, 5, 1, TL, 2, TH, TD, -3, 3);
  const int32_t a[2] = {1, 2}, b[2] = {3, 4};
  put_ids(e->s, &g, a, 0);
  expect_ids(e->s, 5, 1, a, 2);
  put_ids(e->s, &g, b, KVI_PUT_REPLACE);
  expect_ids(e->s, 5, 1, b, 2);
  put_ids(e->s, &g, NULL, KVI_PUT_REPLACE);
  expect_ids(e->s, 5, 1, NULL, 0);
  put_ids(e->s, &g, a, KVI_PUT_REPLACE);
  expect_ids(e->s, 5, 1, a, 2);
  /* a refused put keeps the old ids */
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, g.L, g.T, g.H, g.D, g.k, g.v);
  kvi_put_options o = KVI_PUT_OPTIONS_INIT;
  o.token_ids = b;
  assert_status(kvi_store_put(e->s, 5, 1, &v, &o, NULL), KVI_ERR_EXISTS);
  expect_ids(e->s, 5, 1, a, 2);
  assert_ok(kvi_store_remove(e->s, 5, 1));
  int32_t num;
  assert_status(kvi_store_fact_token_ids(e->s, 5, 1, NULL, 0, &num, NULL), KVI_ERR_NOT_FOUND);
  /* a fact left in the store at destroy frees its ids too (teardown) */
  put_ids(e->s, &g, b, 0);
  rfact_free(&g);
}

static kvi_inject_request req(const tenv *e, const uint64_t *ids, int32_t n, int64_t first_slot,
                              const int32_t *expect) {
  kvi_inject_request q;
  kvi_inject_request_init(&q, sizeof q);
  q.tenant = 1, q.fact_ids = ids, q.num_facts = n, q.block_table = e->table, q.block_table_len = TNB;
  q.first_slot = first_slot, q.start_position = 3;
  q.expect_token_ids = expect;
  return q;
}

/* A refused injection: the status, its message, and not a byte of the cache written. */
#define REFUSED(e, q, want, needle)                                                         \
  do {                                                                                      \
    const uint64_t before_ = ec_hash(&(e)->c);                                              \
    assert_status(kvi_inject((e)->inj, &(q), 1, NULL, NULL), (want));                       \
    assert_last_error_has("kvi_inject", (needle));                                          \
    assert_true(ec_hash(&(e)->c) == before_);                                               \
  } while (0)

/* The prompt's ids at facts 1 and 2 injected back to back: fact 1's 5, fact 2's 3. */
static void ids_of_1_2(const tenv *e, int32_t want[8]) {
  memcpy(want, e->ids1, sizeof e->ids1);
  memcpy(want + 5, e->ids2, sizeof e->ids2);
}

static void test_checked_inject(void **state) {
  tenv *e = *state;
  const uint64_t ids[2] = {1, 2};
  int32_t want[8];
  ids_of_1_2(e, want);
  /* the right ids: the same bytes as an unchecked injection */
  unsigned char *keep[2 * EC_MAXL];
  for (int i = 0; i < e->c.nbuf; i++) {
    keep[i] = malloc(e->c.bytes[i]);
    assert_non_null(keep[i]);
    memcpy(keep[i], e->c.buf[i], e->c.bytes[i]);
  }
  kvi_inject_request q = req(e, ids, 2, 6, NULL);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  const uint64_t plain = ec_hash(&e->c);
  for (int i = 0; i < e->c.nbuf; i++) memcpy(e->c.buf[i], keep[i], e->c.bytes[i]);
  assert_true(ec_hash(&e->c) != plain);
  q = req(e, ids, 2, 6, want);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  assert_true(ec_hash(&e->c) == plain);
  for (int i = 0; i < e->c.nbuf; i++) free(keep[i]);
  /* one id differs: first token of the first fact, last of the first, first and last of the second */
  const struct {
    int at;
    const char *needle;
  } cases[] = {{0, "fact 1 of tenant 1: its token 0 (sequence slot 6) is 1001 in expect_token_ids, 1000 stored"},
               {4, "fact 1 of tenant 1: its token 4 (sequence slot 10) is 1029"},
               {5, "fact 2 of tenant 1: its token 0 (sequence slot 11) is -6 in expect_token_ids, -5 stored"},
               {7, "fact 2 of tenant 1: its token 2 (sequence slot 13)"}};
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int32_t bad[8];
    memcpy(bad, want, sizeof bad);
    bad[cases[c].at] ^= 1;
    q = req(e, ids, 2, 6, bad);
    REFUSED(e, q, KVI_ERR_TOKEN_MISMATCH, cases[c].needle);
  }
  /* a fact stored without ids cannot be checked */
  const uint64_t ids3[2] = {1, 3};
  int32_t w3[9] = {0};
  memcpy(w3, e->ids1, sizeof e->ids1);
  q = req(e, ids3, 2, 0, w3);
  REFUSED(e, q, KVI_ERR_TOKEN_MISMATCH, "fact 3 of tenant 1 has no stored token ids");
  /* unchecked, it injects as before */
  q = req(e, ids3, 2, 0, NULL);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  /* a second request refused refuses the whole call */
  int32_t bad[8];
  memcpy(bad, want, sizeof bad);
  bad[6] = 12345;
  kvi_inject_request two[2] = {req(e, ids, 2, 20, want), req(e, ids, 2, 40, bad)};
  const uint64_t before = ec_hash(&e->c);
  assert_status(kvi_inject(e->inj, two, 2, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  assert_last_error_has("kvi_inject", "request 1: fact 2 of tenant 1: its token 1 (sequence slot 46)");
  assert_true(ec_hash(&e->c) == before);
  /* a struct of the first version (before num_positions) has no expect_token_ids: unchecked */
  two[1].struct_size = offsetof(kvi_inject_request, num_positions);
  assert_ok(kvi_inject(e->inj, &two[1], 1, NULL, NULL));
}

/* num_expect_token_ids: the count of expect_token_ids, checked against the
 * facts' tokens; the library reads no further than it (a short array in its
 * own allocation: the sanitizer build sees a read past it). */
static void test_counted_expect(void **state) {
  tenv *e = *state;
  const uint64_t ids[2] = {1, 2};
  int32_t want[8];
  ids_of_1_2(e, want);
  kvi_inject_request q = req(e, ids, 2, 6, want);
  q.num_expect_token_ids = 8;
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  int32_t *seven = malloc(7 * sizeof *seven); /* one id short */
  assert_non_null(seven);
  memcpy(seven, want, 7 * sizeof *seven);
  q = req(e, ids, 2, 6, seven);
  q.num_expect_token_ids = 7;
  REFUSED(e, q, KVI_ERR_INVALID_ARGUMENT, "request 0: 7 expected token ids, its facts have more tokens");
  free(seven);
  q = req(e, ids, 2, 6, want);
  q.num_expect_token_ids = 9;
  REFUSED(e, q, KVI_ERR_INVALID_ARGUMENT, "request 0: 9 expected token ids, its facts have 8 tokens");
  q.num_expect_token_ids = -1;
  REFUSED(e, q, KVI_ERR_INVALID_ARGUMENT, "request 0: num_expect_token_ids is -1 with expect_token_ids given");
  q = req(e, ids, 2, 6, NULL);
  q.num_expect_token_ids = 8;
  REFUSED(e, q, KVI_ERR_INVALID_ARGUMENT, "num_expect_token_ids is 8 with expect_token_ids NULL");
  /* a mismatch is still found with the count given */
  int32_t bad[8];
  memcpy(bad, want, sizeof bad);
  bad[7] ^= 1;
  q = req(e, ids, 2, 6, bad);
  q.num_expect_token_ids = 8;
  REFUSED(e, q, KVI_ERR_TOKEN_MISMATCH, "fact 2 of tenant 1: its token 2 (sequence slot 13)");
  /* a struct from before the count: the ids are trusted to hold one per token, as before */
  q = req(e, ids, 2, 6, want);
  q.num_expect_token_ids = 7; /* past the struct: not read */
  q.struct_size = offsetof(kvi_inject_request, num_expect_token_ids);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
}

static void test_capture_keeps_ids(void **state) {
  tenv *e = *state;
  /* capture fact 1's injected slots back as fact 11, with its ids; and as 12 without */
  const uint64_t ids[1] = {1};
  kvi_inject_request q = req(e, ids, 1, 8, e->ids1);
  assert_ok(kvi_inject(e->inj, &q, 1, NULL, NULL));
  kvi_capture c[2];
  for (int i = 0; i < 2; i++) {
    kvi_capture_init(&c[i], sizeof c[i]);
    c[i].tenant = 1, c[i].fact_id = 11 + (uint64_t)i, c[i].block_table = e->table, c[i].block_table_len = TNB;
    c[i].first_slot = 8, c[i].num_tokens = 5, c[i].start_position = 3;
  }
  c[0].token_ids = e->ids1;
  assert_ok(kvi_encode(e->enc, c, 2, NULL));
  expect_ids(e->s, 1, 11, e->ids1, 5);
  expect_ids(e->s, 1, 12, NULL, 0);
  /* a refused capture call keeps nothing, ids included */
  c[0].fact_id = 13, c[1].fact_id = 11; /* 11 exists */
  assert_status(kvi_encode(e->enc, c, 2, NULL), KVI_ERR_EXISTS);
  int32_t num;
  assert_status(kvi_store_fact_token_ids(e->s, 1, 13, NULL, 0, &num, NULL), KVI_ERR_NOT_FOUND);
  /* replace by capture replaces the ids */
  const int32_t other[5] = {5, 4, 3, 2, 1};
  c[0].fact_id = 11, c[0].flags = KVI_PUT_REPLACE, c[0].token_ids = other;
  assert_ok(kvi_encode(e->enc, c, 1, NULL));
  expect_ids(e->s, 1, 11, other, 5);
  /* the batched form: capture i's ids at its first token's offset */
  const uint64_t fids[2] = {21, 22};
  const int32_t ntok[2] = {2, 3}, tok[5] = {70, 71, 72, 73, 74};
  const int64_t first[2] = {8, 10};
  int32_t tables[2 * TNB];
  memcpy(tables, e->table, sizeof e->table);
  memcpy(tables + TNB, e->table, sizeof e->table);
  kvi_encode_batch b = KVI_ENCODE_BATCH_INIT;
  b.num_captures = 2, b.tenant = 1, b.fact_ids = fids, b.num_tokens = ntok, b.block_tables = tables;
  b.block_table_stride = TNB, b.block_table_len = TNB, b.first_slots = first, b.token_ids = tok;
  assert_ok(kvi_encode_batched(e->enc, &b, NULL));
  expect_ids(e->s, 1, 21, tok, 2);
  expect_ids(e->s, 1, 22, tok + 2, 3);
}

static void test_batched_inject_checked(void **state) {
  tenv *e = *state;
  const uint64_t fids[3] = {1, 2, 2};
  const int32_t foff[3] = {0, 2, 3};
  int32_t tok[11];
  memcpy(tok, e->ids1, sizeof e->ids1);
  memcpy(tok + 5, e->ids2, sizeof e->ids2);
  memcpy(tok + 8, e->ids2, sizeof e->ids2);
  int64_t toff[3] = {0, 8, 11};
  kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
  b.num_requests = 2, b.tenant = 1, b.fact_ids = fids, b.fact_offsets = foff, b.block_tables = e->table;
  b.block_table_stride = 0, b.block_table_len = 0;
  const int32_t boff[3] = {0, TNB / 2, TNB};
  b.block_table_offsets = boff;
  b.expect_token_ids = tok, b.expect_token_offsets = toff;
  assert_ok(kvi_inject_batched(e->inj, &b, NULL, NULL));
  const uint64_t before = ec_hash(&e->c);
  tok[9] = 1; /* request 1's fact 2, token 1 (stored: 0) */
  assert_status(kvi_inject_batched(e->inj, &b, NULL, NULL), KVI_ERR_TOKEN_MISMATCH);
  assert_last_error_has("kvi_inject_batched", "request 1: fact 2 of tenant 1: its token 1 (sequence slot 1)");
  assert_true(ec_hash(&e->c) == before);
  tok[9] = 0;
  /* counts that are not the requests' tokens, offsets that decrease, offsets missing */
  toff[1] = 7;
  assert_status(kvi_inject_batched(e->inj, &b, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  toff[1] = 9;
  assert_status(kvi_inject_batched(e->inj, &b, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  toff[1] = 12;
  assert_status(kvi_inject_batched(e->inj, &b, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_inject_batched", "expect_token_offsets[2] is 11, below [1] = 12");
  toff[1] = 8;
  b.expect_token_offsets = NULL;
  assert_status(kvi_inject_batched(e->inj, &b, NULL, NULL), KVI_ERR_INVALID_ARGUMENT);
  assert_true(ec_hash(&e->c) == before);
  /* device fact ids cannot be checked on the host: refused before anything else on a CPU store too */
  b.expect_token_offsets = toff;
  b.fact_ids_memory = KVI_MEMORY_DEVICE;
  assert_status(kvi_inject_batched(e->inj, &b, NULL, NULL), KVI_ERR_MEMORY_KIND);
}

/* ------------------------------------------------------------------------ */
/* store files and journals                                                 */
/* ------------------------------------------------------------------------ */

/* CRC32C, bit by bit (not lib/base/crc32c.c's slicing) */
static uint32_t ref_crc32c(const unsigned char *p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
  }
  return ~c;
}

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*n);
  assert_non_null(b);
  assert_int_equal(fread(b, 1, *n, f), *n);
  fclose(f);
  return b;
}

static void spit(const char *path, const unsigned char *b, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(b, 1, n, f), n);
  fclose(f);
}

static uint32_t le32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* Rewrites a file's header as format version `v` (docs/store-format.md: the
 * version at offset 8, the header's size at 16, its CRC32C in its last 4 bytes). */
static void set_version(const char *path, uint32_t v) {
  size_t n;
  unsigned char *b = slurp(path, &n);
  const uint32_t hb = le32(b + 16);
  for (int i = 0; i < 4; i++) b[8 + i] = (unsigned char)(v >> (8 * i));
  const uint32_t crc = ref_crc32c(b, hb - 4);
  for (int i = 0; i < 4; i++) b[hb - 4 + i] = (unsigned char)(crc >> (8 * i));
  spit(path, b, n);
  free(b);
}

static kvi_store *load_file(const tenv *e, const char *path, uint32_t flags, kvi_status want) {
  const uint64_t page_bytes = (uint64_t)TP * TL * 2 * TH * TD * 4;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, TP, page_bytes * 64);
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  lo.flags = flags;
  kvi_store *s = NULL;
  assert_status(kvi_store_load(&s, e->m, &o, path, &lo), want);
  return s;
}

static void test_files_keep_ids(void **state) {
  tenv *e = *state;
  char dir[] = "/tmp/kvi-tokens-XXXXXX", snap[64], jour[64];
  assert_non_null(mkdtemp(dir));
  snprintf(snap, sizeof snap, "%s/snap", dir);
  snprintf(jour, sizeof jour, "%s/jour", dir);
  /* a snapshot */
  assert_ok(kvi_store_save(e->s, snap, NULL));
  size_t n;
  unsigned char *b = slurp(snap, &n);
  assert_int_equal(le32(b + 8), 4);
  free(b);
  kvi_store *s = load_file(e, snap, 0, KVI_OK);
  expect_ids(s, 1, 1, e->ids1, 5);
  expect_ids(s, 1, 2, e->ids2, 3);
  expect_ids(s, 1, 3, NULL, 0);
  kvi_store_destroy(s);
  /* the journal: a put, a replacement with other ids, one without, a removal */
  assert_ok(kvi_store_journal_open(e->s, jour, 0));
  rfact g;
  rfact_make(&g, &e->r, 1, 4, TL, 2, TH, TD, -3, 3);
  const int32_t a[2] = {44, 45}, other[5] = {9, 8, 7, 6, 5};
  put_ids(e->s, &g, a, 0);
  put_ids(e->s, &e->f1, other, KVI_PUT_REPLACE);
  put_ids(e->s, &e->f2, NULL, KVI_PUT_REPLACE);
  assert_ok(kvi_store_remove(e->s, 1, 3));
  assert_ok(kvi_store_journal_close(e->s));
  s = load_file(e, jour, 0, KVI_OK);
  expect_ids(s, 1, 1, other, 5);
  expect_ids(s, 1, 2, NULL, 0);
  expect_ids(s, 1, 4, a, 2);
  int32_t num;
  assert_status(kvi_store_fact_token_ids(s, 1, 3, NULL, 0, &num, NULL), KVI_ERR_NOT_FOUND);
  kvi_store_destroy(s);
  /* a damaged id in the snapshot is corruption (the body's CRC covers it) */
  b = slurp(snap, &n);
  const uint32_t hb = le32(b + 16);
  /* the first entry is fact 1 of tenant 1 (sorted); its ids end its payload */
  const size_t rec = hb + 48, payload = le32(b + rec + 24);
  assert_int_equal(le32(b + rec), 0x10001u); /* PUT with token ids */
  assert_int_equal(le32(b + rec + 32 + payload - 20), (uint32_t)e->ids1[0]);
  b[rec + 32 + payload - 20] ^= 1;
  spit(jour, b, n);
  load_file(e, jour, 0, KVI_ERR_CORRUPT);
  /* version 1 has no token ids: a flagged record there is corruption too */
  b[rec + 32 + payload - 20] ^= 1;
  spit(jour, b, n);
  set_version(jour, 1);
  load_file(e, jour, 0, KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_store_load", "unknown record type 65537");
  set_version(jour, 5);
  load_file(e, jour, 0, KVI_ERR_INCOMPATIBLE);
  free(b);
  rfact_free(&g);
  unlink(snap);
  unlink(jour);
  rmdir(dir);
}

static void test_version_1_files_load(void **state) {
  tenv *e = *state;
  char dir[] = "/tmp/kvi-tokens-XXXXXX", path[64];
  assert_non_null(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/old", dir);
  /* a version-1 file: facts without ids, which version 2 writes as version 1 did */
  assert_ok(kvi_store_remove(e->s, 1, 1));
  assert_ok(kvi_store_remove(e->s, 1, 2));
  rfact g;
  rfact_make(&g, &e->r, 2, 8, TL, 6, TH, TD, -3, 3);
  put_ids(e->s, &g, NULL, 0);
  assert_ok(kvi_store_save(e->s, path, NULL));
  set_version(path, 1);
  kvi_store *s = load_file(e, path, 0, KVI_OK);
  expect_ids(s, 1, 3, NULL, 0);
  expect_ids(s, 2, 8, NULL, 0);
  rfact h;
  rfact_read(s, 2, 8, TL, TH, TD, &h);
  assert_memory_equal(h.k, g.k, (size_t)TL * 6 * TH * TD * sizeof(float));
  rfact_free(&h);
  kvi_store_destroy(s);
  /* journaling into it makes it a file of the current version (4), whose records may carry ids */
  s = load_file(e, path, KVI_LOAD_JOURNAL, KVI_OK);
  const int32_t ids[6] = {1, 2, 3, 4, 5, 6};
  put_ids(s, &g, ids, KVI_PUT_REPLACE);
  kvi_store_destroy(s);
  size_t n;
  unsigned char *b = slurp(path, &n);
  assert_int_equal(le32(b + 8), 4);
  free(b);
  s = load_file(e, path, 0, KVI_OK);
  expect_ids(s, 2, 8, ids, 6);
  expect_ids(s, 1, 3, NULL, 0);
  kvi_store_destroy(s);
  rfact_free(&g);
  unlink(path);
  rmdir(dir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_put_read_back, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_replace_and_remove, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_checked_inject, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_counted_expect, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_capture_keeps_ids, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_batched_inject_checked, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_files_keep_ids, tenv_setup, tenv_teardown),
      cmocka_unit_test_setup_teardown(test_version_1_files_load, tenv_setup, tenv_teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
