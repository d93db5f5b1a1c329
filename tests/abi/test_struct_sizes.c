/*
 * Size-versioned structs seen from a program built against another version
 * of the headers (kvinject/common.h, "Size-versioned structs"):
 *
 * - every kvi_x_init(ptr, size) with an older, smaller size (and a larger,
 *   newer one) writes no byte past `size` (a canary behind the struct stays
 *   untouched), sets struct_size to `size`, fills the library's defaults and
 *   zeroes what lies past the fields it knows; a size below the first
 *   version, or NULL, is refused with nothing written;
 * - kvi_kv_view_contiguous and kvi_cache_layout_preset write only the
 *   struct's first version;
 * - every call that reads a caller's struct reads no byte past its
 *   struct_size (the struct is placed against a PROT_NONE page: a read past
 *   it faults), accepts the first version (fields past it take their
 *   defaults), refuses a smaller struct_size, one over KVI_STRUCT_SIZE_MAX
 *   and non-zero bytes past the fields it knows with KVI_ERR_STRUCT_SIZE;
 * - every call that fills an output struct writes no byte past struct_size.
 *
 * The first-version sizes below are those that kvinject/common.h documents.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <kvinject.h>

#define CANARY 0xa5
#define SLACK 64

#define assert_status(expr, want)                                                                             \
  do {                                                                                                        \
    const kvi_status got_ = (expr), want_ = (want);                                                           \
    if (got_ != want_) {                                                                                      \
      print_error("%s:%d: %s returned %d (%s), expected %d\n  kvi_last_error: %s\n", __FILE__, __LINE__, #expr, \
                  (int)got_, kvi_status_string(got_), (int)want_, kvi_last_error());                           \
      fail();                                                                                                 \
    }                                                                                                         \
  } while (0)
#define assert_ok(expr) assert_status((expr), KVI_OK)

/* ------------------------------------------------------------------------ */
/* structs against a guard page                                             */
/* ------------------------------------------------------------------------ */

/* n copies of the first `size` bytes of `s` (zero past sizeof, struct_size =
 * size), back to back, ending exactly where a PROT_NONE page begins. */
static void *guarded(const void *s, size_t known, size_t size, int n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = size * (size_t)n;
  const size_t pages = (bytes + page - 1) / page + 1;
  unsigned char *base = mmap(NULL, pages * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(base != MAP_FAILED);
  assert_int_equal(mprotect(base + (pages - 1) * page, page, PROT_NONE), 0);
  unsigned char *p = base + (pages - 1) * page - bytes;
  for (int i = 0; i < n; i++) {
    unsigned char *e = p + (size_t)i * size;
    memset(e, 0, size);
    memcpy(e, s, size < known ? size : known);
    memcpy(e, &size, sizeof size);
  }
  return p;
}

static void unguard(void *p, size_t size, int n) {
  const size_t page = (size_t)sysconf(_SC_PAGESIZE), bytes = size * (size_t)n;
  const size_t pages = (bytes + page - 1) / page + 1;
  unsigned char *end = (unsigned char *)p + bytes; /* the guard page */
  munmap(end - (pages - 1) * page, pages * page);
}

/* One reading call: gets the placed struct (n elements); returns its status. */
typedef kvi_status (*reader)(const void *placed, void *ctx);

/*
 * Runs `call` with the struct `s` (sizeof `known`, first version `v1`) at
 * struct_size = known and (when smaller) v1, both against the guard (OK),
 * below v1 (KVI_ERR_STRUCT_SIZE), and past known with a zero tail (OK) and a
 * non-zero one (KVI_ERR_STRUCT_SIZE).
 */
static void check_reader(const char *what, const void *s, size_t known, size_t v1, int n, reader call, void *ctx) {
  size_t ok_sizes[4] = {known, v1, known + 16, KVI_STRUCT_SIZE_MAX};
  for (int i = 0; i < 4; i++) {
    if (i == 1 && v1 == known) continue;
    void *p = guarded(s, known, ok_sizes[i], n);
    kvi_status st = call(p, ctx);
    if (st != KVI_OK) {
      print_error("%s with struct_size %zu: %d (%s)\n", what, ok_sizes[i], (int)st, kvi_last_error());
      fail();
    }
    unguard(p, ok_sizes[i], n);
  }
  const size_t small = v1 - 4;
  void *p = guarded(s, known, small, n);
  kvi_status st = call(p, ctx);
  if (st != KVI_ERR_STRUCT_SIZE) {
    print_error("%s with struct_size %zu (< %zu): %d, expected KVI_ERR_STRUCT_SIZE\n", what, small, v1, (int)st);
    fail();
  }
  unguard(p, small, n);
  /* the cap: past it nothing is read, even zeros */
  const size_t huge = (size_t)KVI_STRUCT_SIZE_MAX + 8;
  p = guarded(s, known, huge, n);
  st = call(p, ctx);
  if (st != KVI_ERR_STRUCT_SIZE) {
    print_error("%s with struct_size %zu (> KVI_STRUCT_SIZE_MAX): %d, expected KVI_ERR_STRUCT_SIZE\n", what, huge,
                (int)st);
    fail();
  }
  unguard(p, huge, n);
  p = guarded(s, known, known + 16, n);
  for (int i = 0; i < n; i++) ((unsigned char *)p)[(size_t)i * (known + 16) + known + 3] = 1;
  st = call(p, ctx);
  if (st != KVI_ERR_STRUCT_SIZE) {
    print_error("%s with a non-zero byte past the %zu known: %d, expected KVI_ERR_STRUCT_SIZE\n", what, known, (int)st);
    fail();
  }
  unguard(p, known + 16, n);
}

/* One output call: fills the struct at `out`. */
typedef kvi_status (*writer)(void *out, void *ctx);

/* An output struct of struct_size v1 - 4 is refused untouched; of v1, known
 * and known + 16 it is written no further than min(struct_size, known). */
static void check_writer(const char *what, size_t known, size_t v1, writer call, void *ctx) {
  const size_t sizes[5] = {v1 - 4, v1, known, known + 16, (size_t)KVI_STRUCT_SIZE_MAX + 8};
  for (int i = 0; i < 5; i++) {
    const size_t size = sizes[i], bytes = size + SLACK;
    unsigned char *b = malloc(bytes);
    assert_non_null(b);
    memset(b, CANARY, bytes);
    memcpy(b, &size, sizeof size);
    kvi_status st = call(b, ctx);
    const bool refused = i == 0 || i == 4; /* below the first version, above the cap */
    if (st != (refused ? KVI_ERR_STRUCT_SIZE : KVI_OK)) {
      print_error("%s with struct_size %zu: %d (%s)\n", what, size, (int)st, kvi_last_error());
      fail();
    }
    size_t got;
    memcpy(&got, b, sizeof got);
    assert_int_equal(got, size);
    const size_t from = refused ? sizeof size : size < known ? size : known;
    for (size_t j = from; j < bytes; j++)
      if (b[j] != CANARY) {
        print_error("%s with struct_size %zu wrote byte %zu\n", what, size, j);
        fail();
      }
    free(b);
  }
}

/* ------------------------------------------------------------------------ */
/* the initializers                                                         */
/* ------------------------------------------------------------------------ */

typedef kvi_status (*init_fn)(void *p, size_t size);
#define WRAP(name, T)                                                                \
  static kvi_status w_##name(void *p, size_t size) { return kvi_##name##_init((T *)p, size); }
WRAP(model_options, kvi_model_options)
WRAP(rope_spec, kvi_rope_spec)
WRAP(kv_view, kvi_kv_view)
WRAP(store_options, kvi_store_options)
WRAP(put_options, kvi_put_options)
WRAP(search_options, kvi_search_options)
WRAP(cache_layout, kvi_cache_layout)
WRAP(transfer_options, kvi_transfer_options)
WRAP(inject_request, kvi_inject_request)
WRAP(inject_options, kvi_inject_options)
WRAP(inject_batch, kvi_inject_batch)
WRAP(encode_batch, kvi_encode_batch)
WRAP(retrieve_request, kvi_retrieve_request)
WRAP(capture, kvi_capture)
WRAP(save_options, kvi_save_options)
WRAP(load_options, kvi_load_options)
WRAP(recompute_options, kvi_recompute_options)

typedef struct init_case {
  const char *name;
  init_fn fn;
  size_t known, v1;
  const void *macro; /* the _INIT macro's value */
} init_case;

static const kvi_model_options m_mo = KVI_MODEL_OPTIONS_INIT;
static const kvi_rope_spec m_rs = KVI_ROPE_SPEC_INIT;
static const kvi_kv_view m_kv = KVI_KV_VIEW_INIT;
static const kvi_store_options m_so = KVI_STORE_OPTIONS_INIT;
static const kvi_put_options m_po = KVI_PUT_OPTIONS_INIT;
static const kvi_search_options m_sr = KVI_SEARCH_OPTIONS_INIT;
static const kvi_cache_layout m_cl = KVI_CACHE_LAYOUT_INIT;
static const kvi_transfer_options m_to = KVI_TRANSFER_OPTIONS_INIT;
static const kvi_inject_request m_ir = KVI_INJECT_REQUEST_INIT;
static const kvi_inject_options m_io = KVI_INJECT_OPTIONS_INIT;
static const kvi_inject_batch m_ib = KVI_INJECT_BATCH_INIT;
static const kvi_encode_batch m_eb = KVI_ENCODE_BATCH_INIT;
static const kvi_retrieve_request m_rr = KVI_RETRIEVE_REQUEST_INIT;
static const kvi_capture m_cp = KVI_CAPTURE_INIT;
static const kvi_save_options m_sv = KVI_SAVE_OPTIONS_INIT;
static const kvi_load_options m_lo = KVI_LOAD_OPTIONS_INIT;
static const kvi_recompute_options m_ro = KVI_RECOMPUTE_OPTIONS_INIT;

#define CASE(name, T, v1, macro) {#name, w_##name, sizeof(T), v1, &macro}
static const init_case init_cases[] = {
    CASE(model_options, kvi_model_options, sizeof(kvi_model_options), m_mo),
    CASE(rope_spec, kvi_rope_spec, sizeof(kvi_rope_spec), m_rs),
    CASE(kv_view, kvi_kv_view, sizeof(kvi_kv_view), m_kv),
    CASE(store_options, kvi_store_options, offsetof(kvi_store_options, comm), m_so),
    CASE(put_options, kvi_put_options, offsetof(kvi_put_options, token_ids), m_po),
    CASE(search_options, kvi_search_options, sizeof(kvi_search_options), m_sr),
    CASE(cache_layout, kvi_cache_layout, offsetof(kvi_cache_layout, dim_stride), m_cl),
    CASE(transfer_options, kvi_transfer_options, sizeof(kvi_transfer_options), m_to),
    CASE(inject_request, kvi_inject_request, offsetof(kvi_inject_request, num_positions), m_ir),
    CASE(inject_options, kvi_inject_options, offsetof(kvi_inject_options, host_pages), m_io),
    CASE(inject_batch, kvi_inject_batch, offsetof(kvi_inject_batch, expect_token_ids), m_ib),
    CASE(encode_batch, kvi_encode_batch, offsetof(kvi_encode_batch, token_ids), m_eb),
    CASE(retrieve_request, kvi_retrieve_request, sizeof(kvi_retrieve_request), m_rr),
    CASE(capture, kvi_capture, offsetof(kvi_capture, token_ids), m_cp),
    CASE(save_options, kvi_save_options, sizeof(kvi_save_options), m_sv),
    CASE(load_options, kvi_load_options, sizeof(kvi_load_options), m_lo),
    CASE(recompute_options, kvi_recompute_options, sizeof(kvi_recompute_options), m_ro),
};
#define NUM_INIT_CASES (sizeof init_cases / sizeof init_cases[0])

/* The bytes of a macro-initialized struct that belong to fields (padding
 * excluded): found by initializing twice over different fill bytes. */
static void field_mask(const init_case *c, unsigned char *mask) {
  unsigned char *a = malloc(c->known), *b = malloc(c->known);
  memset(a, 0x00, c->known);
  memset(b, 0xff, c->known);
  assert_ok(c->fn(a, c->known));
  assert_ok(c->fn(b, c->known));
  for (size_t j = 0; j < c->known; j++) mask[j] = a[j] == b[j];
  free(a);
  free(b);
}

static void test_init_sizes(void **state) {
  (void)state;
  for (size_t ci = 0; ci < NUM_INIT_CASES; ci++) {
    const init_case *c = &init_cases[ci];
    unsigned char mask[4096];
    assert_true(c->known <= sizeof mask);
    field_mask(c, mask);
    /* older (first version), exact, newer (larger), and refused sizes */
    const size_t sizes[] = {c->v1, c->known, c->known + 24, c->v1 - 1, sizeof(size_t), 0};
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
      const size_t size = sizes[si], bytes = size + SLACK;
      unsigned char *b = malloc(bytes);
      assert_non_null(b);
      memset(b, CANARY, bytes);
      kvi_status st = c->fn(b, size);
      if (size < c->v1) {
        if (st != KVI_ERR_STRUCT_SIZE) {
          print_error("kvi_%s_init(size %zu < first version %zu): %d\n", c->name, size, c->v1, (int)st);
          fail();
        }
        for (size_t j = 0; j < bytes; j++)
          if (b[j] != CANARY) {
            print_error("kvi_%s_init(size %zu) refused but wrote byte %zu\n", c->name, size, j);
            fail();
          }
        free(b);
        continue;
      }
      if (st != KVI_OK) {
        print_error("kvi_%s_init(size %zu): %d (%s)\n", c->name, size, (int)st, kvi_last_error());
        fail();
      }
      size_t got;
      memcpy(&got, b, sizeof got);
      assert_int_equal(got, size);
      for (size_t j = sizeof(size_t); j < bytes; j++) {
        unsigned char want;
        if (j >= size) want = CANARY;                  /* behind the caller's struct: untouched */
        else if (j >= c->known) want = 0;              /* fields this library does not know */
        else if (!mask[j]) continue;                   /* padding */
        else want = ((const unsigned char *)c->macro)[j]; /* the _INIT macro's value */
        if (b[j] != want) {
          print_error("kvi_%s_init(size %zu): byte %zu is 0x%02x, expected 0x%02x\n", c->name, size, j, b[j], want);
          fail();
        }
      }
      free(b);
    }
    assert_status(c->fn(NULL, c->known), KVI_ERR_INVALID_ARGUMENT);
    /* past the cap: refused, nothing written */
    unsigned char one[64];
    memset(one, CANARY, sizeof one);
    assert_status(c->fn(one, (size_t)KVI_STRUCT_SIZE_MAX + 1), KVI_ERR_STRUCT_SIZE);
    for (size_t j = 0; j < sizeof one; j++) assert_int_equal(one[j], CANARY);
  }
}

/* kvi_kv_view_contiguous and kvi_cache_layout_preset write the first version. */
static void test_fillers(void **state) {
  (void)state;
  float k[4], v[4];
  unsigned char b[sizeof(kvi_kv_view) + SLACK];
  memset(b, CANARY, sizeof b);
  kvi_kv_view_contiguous((kvi_kv_view *)(void *)b, KVI_MEMORY_HOST, KVI_DTYPE_FP32, 1, 1, 1, 4, k, v);
  kvi_kv_view view;
  memcpy(&view, b, sizeof view);
  assert_int_equal(view.struct_size, sizeof view);
  assert_int_equal(view.head_size, 4);
  for (size_t j = sizeof view; j < sizeof b; j++) assert_int_equal(b[j], CANARY);
  unsigned char c[sizeof(kvi_cache_layout) + SLACK];
  memset(c, CANARY, sizeof c);
  void *layers[1] = {k};
  assert_ok(kvi_cache_layout_preset((kvi_cache_layout *)(void *)c, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, 1, 1, 2,
                                    1, 1, layers, NULL, NULL));
  kvi_cache_layout cl;
  memcpy(&cl, c, sizeof cl);
  const size_t v1 = offsetof(kvi_cache_layout, dim_stride);
  assert_int_equal(cl.struct_size, v1);
  assert_int_equal(cl.head_size, 2);
  for (size_t j = v1; j < sizeof c; j++) assert_int_equal(c[j], CANARY);
  /* a preset that needs the per-plane strides writes the version that has them */
  memset(c, CANARY, sizeof c);
  assert_ok(kvi_cache_layout_preset((kvi_cache_layout *)(void *)c, KVI_CACHE_VLLM_CPU, KVI_DTYPE_FP32, 1, 1, 2, 1, 1,
                                    layers, NULL, NULL));
  memcpy(&cl, c, sizeof cl);
  assert_int_equal(cl.struct_size, sizeof cl);
  assert_int_equal(cl.v_dim_stride, 1);
  for (size_t j = sizeof cl; j < sizeof c; j++) assert_int_equal(c[j], CANARY);
}

/* ------------------------------------------------------------------------ */
/* the readers and writers                                                  */
/* ------------------------------------------------------------------------ */

enum { L = 2, H = 2, D = 8, T = 3, BS = 4, NB = 8, DIM = 4 };

typedef struct fixture {
  kvi_model *model;
  kvi_store *store;
  kvi_injector *inj;
  kvi_encoder *enc;
  float cache[L][2][NB][BS][H][D];
  void *layers[L];
  kvi_cache_layout cl;
  float k[L][T][H][D], v[L][T][H][D], emb[DIM], q[DIM];
  kvi_kv_view kv;
  kvi_put_options po;
  int32_t table[2];
  uint64_t next_id, fact_ids[2];
  char path[64];
  kvi_store_options so;
} fixture;

static fixture F;

static int setup(void **state) {
  (void)state;
  memset(&F, 0, sizeof F);
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = KVI_ROPE_NONE;
  if (kvi_model_create(&F.model, &mo) || kvi_model_set_rope(F.model, -1, &rs)) return -1;
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU, so.dtype = KVI_DTYPE_FP32, so.page_tokens = 4, so.budget_bytes = 1 << 20;
  so.embedding_dim = DIM;
  F.so = so;
  if (kvi_store_create(&F.store, F.model, &so)) return -1;
  for (int l = 0; l < L; l++) F.layers[l] = F.cache[l];
  if (kvi_cache_layout_preset(&F.cl, KVI_CACHE_VLLM_FLASH_ATTN, KVI_DTYPE_FP32, L, H, D, BS, NB, F.layers, NULL, NULL))
    return -1;
  F.cl.memory = KVI_MEMORY_HOST;
  if (kvi_injector_create(&F.inj, F.store, &F.cl, NULL) || kvi_encoder_create(&F.enc, F.store, &F.cl, NULL)) return -1;
  for (int i = 0; i < L * T * H * D; i++) (&F.k[0][0][0][0])[i] = (float)i, (&F.v[0][0][0][0])[i] = (float)-i;
  for (int i = 0; i < DIM; i++) F.emb[i] = F.q[i] = (float)(i + 1);
  kvi_kv_view_contiguous(&F.kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, F.k, F.v);
  kvi_put_options_init(&F.po, sizeof F.po);
  F.po.embedding = F.emb;
  F.next_id = 100;
  F.fact_ids[0] = 1, F.fact_ids[1] = 2;
  if (kvi_store_put(F.store, 7, 1, &F.kv, &F.po, NULL) || kvi_store_put(F.store, 7, 2, &F.kv, &F.po, NULL)) return -1;
  F.table[0] = 0, F.table[1] = 1;
  snprintf(F.path, sizeof F.path, "/tmp/kvi-struct-sizes-%d.kvs", (int)getpid());
  return kvi_store_save(F.store, F.path, NULL) ? -1 : 0;
}

static int teardown(void **state) {
  (void)state;
  kvi_encoder_destroy(F.enc);
  kvi_injector_destroy(F.inj);
  kvi_store_destroy(F.store);
  kvi_model_destroy(F.model);
  unlink(F.path);
  return 0;
}

static kvi_status r_model_options(const void *p, void *ctx) {
  (void)ctx;
  kvi_model *m = NULL;
  kvi_status st = kvi_model_create(&m, p);
  kvi_model_destroy(m);
  return st;
}
static kvi_status r_rope_spec(const void *p, void *ctx) {
  kvi_model *m = NULL;
  kvi_status st = kvi_model_create(&m, ctx);
  if (st == KVI_OK) st = kvi_model_set_rope(m, -1, p);
  kvi_model_destroy(m);
  return st;
}
static kvi_status r_store_options(const void *p, void *ctx) {
  (void)ctx;
  kvi_store *s = NULL;
  kvi_status st = kvi_store_create(&s, F.model, p);
  kvi_store_destroy(s);
  return st;
}
static kvi_status r_load_store_options(const void *p, void *ctx) {
  (void)ctx;
  kvi_store *s = NULL;
  kvi_status st = kvi_store_load(&s, F.model, p, F.path, NULL);
  kvi_store_destroy(s);
  return st;
}
static kvi_status r_load_options(const void *p, void *ctx) {
  (void)ctx;
  kvi_store *s = NULL;
  kvi_status st = kvi_store_load(&s, F.model, &F.so, F.path, p);
  kvi_store_destroy(s);
  return st;
}
static kvi_status r_save_options(const void *p, void *ctx) {
  (void)ctx;
  return kvi_store_save(F.store, F.path, p);
}
static kvi_status r_put_view(const void *p, void *ctx) {
  (void)ctx;
  return kvi_store_put(F.store, 7, F.next_id++, p, &F.po, NULL);
}
static kvi_status r_read_view(const void *p, void *ctx) {
  (void)ctx;
  return kvi_store_read(F.store, 7, 1, p, NULL);
}
static kvi_status r_put_options(const void *p, void *ctx) {
  (void)ctx;
  return kvi_store_put(F.store, 7, F.next_id++, &F.kv, p, NULL);
}
static kvi_status r_search_options(const void *p, void *ctx) {
  (void)ctx;
  uint64_t tenant = 7, ids[2];
  float scores[2];
  int32_t counts[1];
  return kvi_store_search(F.store, F.q, 1, DIM, &tenant, 2, ids, scores, counts, p, NULL);
}
static kvi_status r_cache_layout(const void *p, void *ctx) {
  (void)ctx;
  kvi_injector *inj = NULL;
  kvi_status st = kvi_injector_create(&inj, F.store, p, NULL);
  kvi_injector_destroy(inj);
  kvi_encoder *enc = NULL;
  if (st == KVI_OK) st = kvi_encoder_create(&enc, F.store, p, NULL);
  kvi_encoder_destroy(enc);
  return st;
}
static kvi_status r_transfer_options(const void *p, void *ctx) {
  (void)ctx;
  kvi_injector *inj = NULL;
  kvi_status st = kvi_injector_create(&inj, F.store, &F.cl, p);
  kvi_injector_destroy(inj);
  return st;
}
static kvi_status r_inject_request(const void *p, void *ctx) { /* two requests, stepped by struct_size */
  (void)ctx;
  return kvi_inject(F.inj, p, 2, NULL, NULL);
}
static kvi_status r_deviation_request(const void *p, void *ctx) { /* two requests, stepped by struct_size */
  (void)ctx;
  float sc[4 * T];
  return kvi_inject_deviation(F.inj, p, 2, 0, sc, 4 * T, KVI_MEMORY_HOST, NULL);
}
static kvi_status r_recompute_options(const void *p, void *ctx) {
  (void)ctx;
  const float sc[4] = {1, 3, 2, 0};
  const int32_t tok[2] = {2, 2};
  int32_t idx[4];
  int64_t n;
  return kvi_recompute_select(sc, tok, 2, p, idx, 4, &n);
}
static kvi_status r_inject_options(const void *p, void *ctx) {
  kvi_inject_request *rq = ctx;
  return kvi_inject(F.inj, rq, 1, p, NULL);
}
static kvi_status r_inject_batch(const void *p, void *ctx) {
  (void)ctx;
  return kvi_inject_batched(F.inj, p, NULL, NULL);
}
static uint64_t eb_id; /* the batch's one fact id: a new one each call */
static kvi_status r_encode_batch(const void *p, void *ctx) {
  (void)ctx;
  eb_id = F.next_id++;
  return kvi_encode_batched(F.enc, p, NULL);
}
static kvi_status r_capture(const void *p, void *ctx) {
  (void)ctx;
  /* each call captures a new id: the placed struct's fact_id is patched in place */
  uint64_t id = F.next_id++;
  memcpy((char *)(uintptr_t)p + offsetof(kvi_capture, fact_id), &id, sizeof id);
  return kvi_encode(F.enc, p, 1, NULL);
}
static kvi_status r_retrieve_request(const void *p, void *ctx) {
  (void)ctx;
  uint64_t ids[1];
  int32_t counts[1], tokens[1];
  return kvi_retrieve_inject(F.inj, F.q, 1, DIM, p, 1, NULL, ids, counts, tokens, NULL);
}
static kvi_status r_retrieve_search_options(const void *p, void *ctx) {
  kvi_retrieve_request *rr = ctx;
  uint64_t ids[1];
  int32_t counts[1], tokens[1];
  return kvi_retrieve_inject(F.inj, F.q, 1, DIM, rr, 1, p, ids, counts, tokens, NULL);
}

typedef struct tp_ctx {
  kvi_store *store;
  uint64_t next;
} tp_ctx;
static kvi_status r_scatter_item(const void *p, void *ctx) {
  tp_ctx *c = ctx;
  uint64_t id = c->next++;
  memcpy((char *)(uintptr_t)p + offsetof(kvi_scatter_item, fact_id), &id, sizeof id);
  return kvi_store_put_scatter(c->store, 0, p, 1, NULL);
}
static kvi_status r_gather_item(const void *p, void *ctx) {
  tp_ctx *c = ctx;
  return kvi_store_gather(c->store, 0, p, 1, NULL);
}

static void test_readers(void **state) {
  (void)state;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  check_reader("kvi_model_create(opts)", &mo, sizeof mo, sizeof mo, 1, r_model_options, NULL);
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  check_reader("kvi_model_set_rope(spec)", &rs, sizeof rs, sizeof rs, 1, r_rope_spec, &mo);
  check_reader("kvi_store_create(opts)", &F.so, sizeof F.so, offsetof(kvi_store_options, comm), 1, r_store_options,
               NULL);
  check_reader("kvi_store_load(opts)", &F.so, sizeof F.so, offsetof(kvi_store_options, comm), 1,
               r_load_store_options, NULL);
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  check_reader("kvi_store_load(load_opts)", &lo, sizeof lo, sizeof lo, 1, r_load_options, NULL);
  kvi_save_options sv = KVI_SAVE_OPTIONS_INIT;
  check_reader("kvi_store_save(opts)", &sv, sizeof sv, sizeof sv, 1, r_save_options, NULL);
  check_reader("kvi_store_put(kv)", &F.kv, sizeof F.kv, sizeof F.kv, 1, r_put_view, NULL);
  check_reader("kvi_store_read(dst)", &F.kv, sizeof F.kv, sizeof F.kv, 1, r_read_view, NULL);
  check_reader("kvi_store_put(opts)", &F.po, sizeof F.po, offsetof(kvi_put_options, token_ids), 1, r_put_options, NULL);
  kvi_search_options sr = KVI_SEARCH_OPTIONS_INIT;
  check_reader("kvi_store_search(opts)", &sr, sizeof sr, sizeof sr, 1, r_search_options, NULL);
  check_reader("kvi_injector_create/kvi_encoder_create(layout)", &F.cl, sizeof F.cl, offsetof(kvi_cache_layout, dim_stride), 1, r_cache_layout,
               NULL);
  kvi_transfer_options to = KVI_TRANSFER_OPTIONS_INIT;
  check_reader("kvi_injector_create(opts)", &to, sizeof to, sizeof to, 1, r_transfer_options, NULL);

  kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
  rq.tenant = 7, rq.fact_ids = F.fact_ids, rq.num_facts = 2;
  rq.block_table = F.table, rq.block_table_len = 2, rq.start_position = 0;
  check_reader("kvi_inject(reqs)", &rq, sizeof rq, offsetof(kvi_inject_request, num_positions), 2, r_inject_request,
               NULL);
  check_reader("kvi_inject_deviation(reqs)", &rq, sizeof rq, offsetof(kvi_inject_request, num_positions), 2,
               r_deviation_request, NULL);
  kvi_recompute_options ro = KVI_RECOMPUTE_OPTIONS_INIT;
  ro.fraction = 0.5, ro.boundary = 1;
  check_reader("kvi_recompute_select(opts)", &ro, sizeof ro, sizeof ro, 1, r_recompute_options, NULL);
  kvi_inject_options io = KVI_INJECT_OPTIONS_INIT;
  check_reader("kvi_inject(opts)", &io, sizeof io, offsetof(kvi_inject_options, host_pages), 1, r_inject_options, &rq);
  static const int32_t ib_off[2] = {0, 2};
  kvi_inject_batch ib = KVI_INJECT_BATCH_INIT;
  ib.num_requests = 1, ib.tenant = 7, ib.fact_ids = F.fact_ids, ib.fact_offsets = ib_off;
  ib.block_tables = F.table, ib.block_table_stride = 2, ib.block_table_len = 2;
  check_reader("kvi_inject_batched(batch)", &ib, sizeof ib, offsetof(kvi_inject_batch, expect_token_ids), 1, r_inject_batch, NULL);

  kvi_capture cp = KVI_CAPTURE_INIT;
  cp.tenant = 8, cp.block_table = F.table, cp.block_table_len = 2, cp.num_tokens = T, cp.embedding = F.emb;
  check_reader("kvi_encode(caps)", &cp, sizeof cp, offsetof(kvi_capture, token_ids), 1, r_capture, NULL);
  static const int32_t eb_tokens[1] = {T};
  kvi_encode_batch eb = KVI_ENCODE_BATCH_INIT;
  eb.num_captures = 1, eb.tenant = 8, eb.fact_ids = &eb_id, eb.num_tokens = eb_tokens;
  eb.block_tables = F.table, eb.block_table_stride = 2, eb.block_table_len = 2, eb.embeddings = F.emb;
  check_reader("kvi_encode_batched(batch)", &eb, sizeof eb, offsetof(kvi_encode_batch, token_ids), 1, r_encode_batch, NULL);

  kvi_retrieve_request rr = KVI_RETRIEVE_REQUEST_INIT;
  rr.tenant = 7, rr.block_table = F.table, rr.block_table_len = 2;
  check_reader("kvi_retrieve_inject(reqs)", &rr, sizeof rr, sizeof rr, 1, r_retrieve_request, NULL);
  check_reader("kvi_retrieve_inject(opts)", &sr, sizeof sr, sizeof sr, 1, r_retrieve_search_options, &rr);

  /* collective calls on a one-rank in-process group */
  kvi_comm_group *g;
  kvi_comm *comm;
  assert_ok(kvi_comm_group_create(&g, 1));
  assert_ok(kvi_comm_create_local(&comm, g, 0));
  kvi_store_options so = F.so;
  so.comm = comm;
  tp_ctx c = {NULL, 1};
  assert_ok(kvi_store_create(&c.store, F.model, &so));
  kvi_scatter_item si = KVI_SCATTER_ITEM_INIT;
  si.tenant = 7, si.full = &F.kv, si.opts = &F.po;
  check_reader("kvi_store_put_scatter(items)", &si, sizeof si, sizeof si, 1, r_scatter_item, &c);
  kvi_gather_item gi = KVI_GATHER_ITEM_INIT;
  kvi_kv_view out = F.kv;
  float ok[L][T][H][D], ov[L][T][H][D];
  out.k = ok, out.v = ov;
  gi.tenant = 7, gi.fact_id = 1, gi.full = &out;
  check_reader("kvi_store_gather(items)", &gi, sizeof gi, sizeof gi, 1, r_gather_item, &c);
  kvi_store_destroy(c.store);
  kvi_comm_destroy(comm);
  kvi_comm_group_destroy(g);
}

static kvi_status w_model_info(void *out, void *ctx) {
  (void)ctx;
  return kvi_model_info_get(F.model, out);
}
static kvi_status w_store_stats(void *out, void *ctx) {
  (void)ctx;
  return kvi_store_stats_get(F.store, out);
}
static kvi_status w_get_rope(void *out, void *ctx) {
  (void)ctx;
  return kvi_model_get_rope(F.model, 0, out);
}

static void test_writers(void **state) {
  (void)state;
  check_writer("kvi_model_info_get", sizeof(kvi_model_info), sizeof(kvi_model_info), w_model_info, NULL);
  check_writer("kvi_store_stats_get", sizeof(kvi_store_stats), offsetof(kvi_store_stats, pages_host_total),
               w_store_stats, NULL);
  check_writer("kvi_model_get_rope", sizeof(kvi_rope_spec), sizeof(kvi_rope_spec), w_get_rope, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_init_sizes),
      cmocka_unit_test(test_fillers),
      cmocka_unit_test(test_readers),
      cmocka_unit_test(test_writers),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
