/*
 * kvinject/llama.h against hand-built llama.cpp sequence states: the bytes
 * are assembled here word by word from the format's description (not by the
 * library), then parsed, laid out, injected into and captured from.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

/* ---- a tiny byte writer for hand-built states ---------------------------- */

typedef struct buf {
  uint8_t *p;
  size_t n, cap;
} buf;

static void b_put(buf *b, const void *x, size_t n) {
  if (b->n + n > b->cap) {
    b->cap = (b->n + n) * 2 + 64;
    b->p = realloc(b->p, b->cap);
    assert_non_null(b->p);
  }
  memcpy(b->p + b->n, x, n);
  b->n += n;
}
static void b_u32(buf *b, uint32_t v) { b_put(b, &v, 4); }
static void b_u64(buf *b, uint64_t v) { b_put(b, &v, 8); }

/* Geometry of the hand-built states: L layers, H heads of D, f16 or f32. */
enum { L = 3, H = 2, D = 8, ROW = H * D };

typedef struct hand {
  int cells, v_trans, streams, stream, ggml_type, es;
  int32_t seq;
  const int32_t *pos; /* NULL: 0.. */
} hand;

/* Element value of (plane, layer, cell, e) in a hand-built state's data,
 * small integers, exactly representable in every dtype. */
static float val(int plane, int l, int c, int e) { return (float)(plane * 64 + l * 16 + c * 2 + e % 7) - 50.0f; }

static void put_val(buf *b, int es, float x) {
  if (es == 4) {
    b_put(b, &x, 4);
  } else {
    _Float16 h = (_Float16)x;
    b_put(b, &h, 2);
  }
}

/* One section as llama.cpp writes it. */
static void hand_section(buf *b, const hand *h) {
  b_u32(b, (uint32_t)h->streams);
  for (int s = 0; s < h->streams; s++) {
    if (s != h->stream) {
      b_u32(b, 0);
      continue;
    }
    b_u32(b, (uint32_t)h->cells);
    for (int c = 0; c < h->cells; c++) {
      b_u32(b, (uint32_t)(h->pos ? h->pos[c] : c));
      b_u32(b, 1);
      b_u32(b, (uint32_t)h->seq);
    }
    b_u32(b, (uint32_t)h->v_trans);
    b_u32(b, L);
    for (int l = 0; l < L; l++) {
      b_u32(b, (uint32_t)h->ggml_type);
      b_u64(b, (uint64_t)ROW * (uint64_t)h->es);
      for (int c = 0; c < h->cells; c++)
        for (int e = 0; e < ROW; e++) put_val(b, h->es, val(0, l, c, e));
    }
    for (int l = 0; l < L; l++) {
      b_u32(b, (uint32_t)h->ggml_type);
      if (!h->v_trans) {
        b_u64(b, (uint64_t)ROW * (uint64_t)h->es);
        for (int c = 0; c < h->cells; c++)
          for (int e = 0; e < ROW; e++) put_val(b, h->es, val(1, l, c, e));
      } else {
        b_u32(b, (uint32_t)h->es);
        b_u32(b, ROW);
        for (int e = 0; e < ROW; e++)
          for (int c = 0; c < h->cells; c++) put_val(b, h->es, val(1, l, c, e));
      }
    }
  }
}

static buf hand_state(const hand *h, int sections) {
  buf b = {NULL, 0, 0};
  b_u32(&b, 0xaf143cd8u);
  b_u32(&b, (uint32_t)h->seq);
  for (int i = 0; i < sections; i++) hand_section(&b, h);
  return b;
}

static hand hand_default(void) {
  hand h = {5, 0, 1, 0, 1, 2, 0, NULL};
  return h;
}

static kvi_model *llama_model_of(int32_t tp_size, int32_t tp_rank, kvi_rope_style style) {
  const kvi_model_options mo = model_options(L, H, D, tp_rank, tp_size);
  kvi_model *m;
  assert_ok(kvi_model_create(&m, &mo));
  kvi_rope_spec rs = KVI_ROPE_SPEC_INIT;
  rs.style = style;
  rs.theta = 10000.0;
  assert_ok(kvi_model_set_rope(m, -1, &rs));
  return m;
}

/* ---- parse ------------------------------------------------------------------ */

static void test_parse_hand_built(void **state) {
  (void)state;
  const int32_t pos[5] = {7, 8, 9, 20, 21};
  for (int variant = 0; variant < 4; variant++) {
    hand h = hand_default();
    h.pos = pos;
    h.seq = 3;
    h.v_trans = variant & 1;
    if (variant & 2) h.ggml_type = 0, h.es = 4;
    if (variant == 3) h.streams = 4, h.stream = 2;
    buf b = hand_state(&h, 1);
    kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
    assert_ok(kvi_llama_state_parse(b.p, b.n, &info));
    const kvi_llama_section *s = &info.sections[0];
    assert_int_equal(info.seq_id, 3);
    assert_int_equal(info.num_sections, 1);
    assert_int_equal(info.size, b.n);
    assert_int_equal(s->num_streams, h.streams);
    assert_int_equal(s->stream, h.stream);
    assert_int_equal(s->num_cells, 5);
    assert_int_equal(s->v_trans, h.v_trans);
    assert_int_equal(s->num_layers, L);
    assert_int_equal(s->dtype, h.es == 4 ? KVI_DTYPE_FP32 : KVI_DTYPE_FP16);
    assert_int_equal(s->k_row_elements, ROW);
    assert_int_equal(s->v_row_elements, ROW);
    /* offsets, from the format: 12 + 4 per stream before ours + 4 */
    const uint64_t cells = 12 + 4 * (uint64_t)h.stream + 4;
    assert_int_equal(s->cells_offset, cells);
    assert_int_equal(s->k_offset, cells + 5 * 12 + 8 + 12);
    assert_int_equal(s->layer_bytes, 12 + 5 * ROW * h.es);
    assert_int_equal(s->v_offset, s->k_offset + L * s->layer_bytes);
    assert_int_equal(s->end_offset, b.n);
    int32_t got[5];
    assert_ok(kvi_llama_state_positions(b.p, b.n, 0, 1, 3, got));
    assert_memory_equal(got, pos + 1, 3 * sizeof(int32_t));
    assert_status(kvi_llama_state_positions(b.p, b.n, 0, 3, 3, got), KVI_ERR_INVALID_ARGUMENT);
    assert_status(kvi_llama_state_positions(b.p, b.n, 1, 0, 1, got), KVI_ERR_INVALID_ARGUMENT);
    /* the first K value of layer 1, cell 2 where the layout says */
    const uint8_t *k = b.p + s->k_offset + s->layer_bytes + (size_t)2 * ROW * h.es;
    float x;
    if (h.es == 4) memcpy(&x, k, 4);
    else {
      _Float16 y;
      memcpy(&y, k, 2);
      x = (float)y;
    }
    assert_true(x == val(0, 1, 2, 0));
    free(b.p);
  }
}

static void test_parse_iswa_and_empty(void **state) {
  (void)state;
  hand h = hand_default();
  buf b = hand_state(&h, 2);
  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  assert_ok(kvi_llama_state_parse(b.p, b.n, &info));
  assert_int_equal(info.num_sections, 2);
  assert_int_equal(info.sections[1].cells_offset, info.sections[0].end_offset + 8);
  assert_int_equal(info.sections[1].end_offset, b.n);
  /* a third section is not a llama.cpp state */
  free(b.p);
  b = hand_state(&h, 3);
  assert_status(kvi_llama_state_parse(b.p, b.n, &info), KVI_ERR_CORRUPT);
  assert_last_error_has("kvi_llama_state_parse", "follow the state's 2 KV cache sections");
  free(b.p);
  /* a sequence with no cells: streams of 0 cells only */
  b = (buf){NULL, 0, 0};
  b_u32(&b, 0xaf143cd8u);
  b_u32(&b, 0);
  b_u32(&b, 2);
  b_u32(&b, 0);
  b_u32(&b, 0);
  assert_ok(kvi_llama_state_parse(b.p, b.n, &info));
  assert_int_equal(info.sections[0].num_cells, 0);
  assert_int_equal(info.sections[0].stream, -1);
  kvi_model *m = llama_model_of(1, 0, KVI_ROPE_GPTJ);
  kvi_cache_layout cl;
  assert_status(kvi_llama_state_layout(b.p, b.n, 0, m, KVI_MEMORY_HOST, &cl), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_llama_state_layout", "no cells");
  kvi_model_destroy(m);
  free(b.p);
}

/* Every prefix of a state is refused (never read past the size). */
static void test_parse_truncated(void **state) {
  (void)state;
  hand h = hand_default();
  h.v_trans = 1;
  buf b = hand_state(&h, 1);
  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  for (size_t n = 0; n < b.n; n++) {
    uint8_t *copy = malloc(n ? n : 1); /* exactly n bytes: valgrind sees any overread */
    memcpy(copy, b.p, n);
    assert_status(kvi_llama_state_parse(copy, n, &info), KVI_ERR_CORRUPT);
    free(copy);
  }
  free(b.p);
}

static void patch32(buf *b, size_t at, uint32_t v) { memcpy(b->p + at, &v, 4); }

static void test_parse_refusals(void **state) {
  (void)state;
  const hand h = hand_default();
  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  const size_t cell0 = 16, vtrans = cell0 + 5 * 12, k0 = vtrans + 8;
  struct {
    size_t at;
    uint32_t v;
    kvi_status want;
    const char *needle;
  } cases[] = {
      {0, 0xaf143cd9u, KVI_ERR_CORRUPT, "magic"},
      {4, 0xffffffffu, KVI_ERR_UNSUPPORTED, "seq -1"},
      {8, 0, KVI_ERR_CORRUPT, "0 streams"},
      {12, 0x7fffffff, KVI_ERR_CORRUPT, "cells do not fit"},
      {cell0 + 4, 2, KVI_ERR_UNSUPPORTED, "2 seq ids"},
      {cell0 + 12 + 8, 1, KVI_ERR_CORRUPT, "belongs to seq 1"},
      {vtrans, 2, KVI_ERR_CORRUPT, "v_trans is 2"},
      {vtrans + 4, 0, KVI_ERR_CORRUPT, "0 layers"},
      {vtrans + 4, 2, KVI_ERR_CORRUPT, "not a second KV cache section"},
      {k0, 8, KVI_ERR_UNSUPPORTED, "ggml type 8"},
      {k0, 30, KVI_ERR_UNSUPPORTED, "one type and row size"}, /* layer 0 bf16, layer 1 f16 */
      {k0 + 4, 31, KVI_ERR_CORRUPT, "not a whole number"},
      {k0 + 4, 16, KVI_ERR_UNSUPPORTED, "layer 1 K has ggml type"}, /* half the rows: layer 1 starts in data */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    buf b = hand_state(&h, 1);
    patch32(&b, cases[i].at, cases[i].v);
    assert_status(kvi_llama_state_parse(b.p, b.n, &info), cases[i].want);
    assert_last_error_has("kvi_llama_state_parse", cases[i].needle);
    free(b.p);
  }
  /* two streams with cells */
  {
    hand h2 = hand_default();
    buf b = hand_state(&h2, 1);
    /* rewrite as 2 streams: the same stream twice */
    buf c = {NULL, 0, 0};
    b_put(&c, b.p, 8);
    b_u32(&c, 2);
    b_put(&c, b.p + 12, b.n - 12);
    b_put(&c, b.p + 12, b.n - 12);
    assert_status(kvi_llama_state_parse(c.p, c.n, &info), KVI_ERR_UNSUPPORTED);
    assert_last_error_has("kvi_llama_state_parse", "both hold cells");
    free(b.p);
    free(c.p);
  }
  /* K and V of different types: V of layer 0..2 in f32 */
  {
    hand h2 = hand_default();
    buf b = {NULL, 0, 0};
    b_u32(&b, 0xaf143cd8u);
    b_u32(&b, 0);
    b_u32(&b, 1);
    b_u32(&b, 1);
    b_u32(&b, 0), b_u32(&b, 1), b_u32(&b, 0);
    b_u32(&b, 0), b_u32(&b, L);
    for (int plane = 0; plane < 2; plane++)
      for (int l = 0; l < L; l++) {
        b_u32(&b, plane ? 0 : 1);
        b_u64(&b, ROW * (plane ? 4 : 2));
        for (int e = 0; e < ROW; e++) put_val(&b, plane ? 4 : 2, 1.0f);
      }
    (void)h2;
    assert_status(kvi_llama_state_parse(b.p, b.n, &info), KVI_ERR_UNSUPPORTED);
    assert_last_error_has("kvi_llama_state_parse", "K and V of one type");
    free(b.p);
  }
  assert_status(kvi_llama_state_parse(NULL, 4, &info), KVI_ERR_INVALID_ARGUMENT);
  buf b = hand_state(&h, 1);
  assert_status(kvi_llama_state_parse(b.p, b.n, NULL), KVI_ERR_INVALID_ARGUMENT);
  info.struct_size = 8;
  assert_status(kvi_llama_state_parse(b.p, b.n, &info), KVI_ERR_STRUCT_SIZE);
  free(b.p);
}

/* ---- writing ------------------------------------------------------------------ */

static void test_write_header_matches_hand_built(void **state) {
  (void)state;
  kvi_model *m = llama_model_of(1, 0, KVI_ROPE_GPTJ);
  const int32_t pos[5] = {3, 4, 5, 6, 100};
  for (int variant = 0; variant < 4; variant++) {
    hand h = hand_default();
    h.seq = 2;
    h.pos = pos;
    h.v_trans = variant & 1;
    if (variant & 2) h.streams = 3, h.stream = 1, h.ggml_type = 0, h.es = 4;
    buf b = hand_state(&h, 1);
    kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
    sp.seq_id = 2;
    sp.num_streams = h.streams;
    sp.stream = h.stream;
    sp.num_cells = 5;
    sp.positions = pos;
    sp.v_trans = h.v_trans;
    sp.dtype = h.es == 4 ? KVI_DTYPE_FP32 : KVI_DTYPE_FP16;
    size_t size;
    assert_ok(kvi_llama_state_size(m, &sp, &size));
    assert_int_equal(size, b.n);
    /* written over a copy of the hand-built state, the result is unchanged
     * (the data regions are left as they are; everything else is rewritten) */
    uint8_t *w = malloc(size + 16);
    memcpy(w, b.p, size);
    memset(w + size, 0xee, 16);
    uint8_t *z = calloc(1, size);
    assert_ok(kvi_llama_state_write_header(w, size + 16, m, &sp));
    assert_memory_equal(w, b.p, size);
    for (int i = 0; i < 16; i++) assert_int_equal(w[size + i], 0xee);
    /* over zeros: a state that parses, same metadata */
    assert_ok(kvi_llama_state_write_header(z, size, m, &sp));
    kvi_llama_state_info a = KVI_LLAMA_STATE_INFO_INIT, c = KVI_LLAMA_STATE_INFO_INIT;
    assert_ok(kvi_llama_state_parse(z, size, &a));
    assert_ok(kvi_llama_state_parse(b.p, b.n, &c));
    assert_memory_equal(&a, &c, sizeof a);
    free(w);
    free(z);
    free(b.p);
  }
  /* start_position instead of positions */
  hand h = hand_default();
  buf b = hand_state(&h, 1);
  kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
  sp.num_cells = 5;
  sp.dtype = KVI_DTYPE_FP16;
  uint8_t *w = malloc(b.n);
  memcpy(w, b.p, b.n);
  assert_ok(kvi_llama_state_write_header(w, b.n, m, &sp));
  assert_memory_equal(w, b.p, b.n);
  /* errors write nothing */
  memset(w, 0x77, b.n);
  assert_status(kvi_llama_state_write_header(w, b.n - 1, m, &sp), KVI_ERR_INVALID_ARGUMENT);
  const int32_t bad[5] = {0, 1, -2, 3, 4};
  sp.positions = bad;
  assert_status(kvi_llama_state_write_header(w, b.n, m, &sp), KVI_ERR_INVALID_ARGUMENT);
  assert_last_error_has("kvi_llama_state_write_header", "positions[2] is -2");
  for (size_t i = 0; i < b.n; i++) assert_int_equal(w[i], 0x77);
  sp.positions = NULL;
  size_t size;
  kvi_llama_state_spec e = sp;
  e.dtype = KVI_DTYPE_FP8_E4M3;
  assert_status(kvi_llama_state_size(m, &e, &size), KVI_ERR_INVALID_ARGUMENT);
  e = sp, e.stream = 1;
  assert_status(kvi_llama_state_size(m, &e, &size), KVI_ERR_INVALID_ARGUMENT);
  e = sp, e.seq_id = -1;
  assert_status(kvi_llama_state_size(m, &e, &size), KVI_ERR_INVALID_ARGUMENT);
  e = sp, e.v_trans = 2;
  assert_status(kvi_llama_state_size(m, &e, &size), KVI_ERR_INVALID_ARGUMENT);
  e = sp, e.num_cells = 0;
  assert_status(kvi_llama_state_size(m, &e, &size), KVI_ERR_INVALID_ARGUMENT);
  e = sp, e.start_position = INT32_MAX - 2;
  assert_status(kvi_llama_state_size(m, &e, &size), KVI_ERR_INVALID_ARGUMENT);
  /* a size that overflows: the widest model, the most cells */
  {
    const kvi_model_options mo = model_options(65536, 65536, 1024, 0, 1);
    kvi_model *big;
    assert_ok(kvi_model_create(&big, &mo));
    e = sp, e.num_cells = INT32_MAX, e.dtype = KVI_DTYPE_FP32;
    assert_status(kvi_llama_state_size(big, &e, &size), KVI_ERR_INVALID_ARGUMENT);
    assert_last_error_has("kvi_llama_state_size", "overflows");
    kvi_model_destroy(big);
  }
  free(w);
  free(b.p);
  kvi_model_destroy(m);
}

/* ---- layout: inject and capture through it ---------------------------------- */

static void test_layout_inject_capture(void **state) {
  (void)state;
  /* no rotation: injected values land bit for bit where the format says */
  kvi_model *m = llama_model_of(1, 0, KVI_ROPE_NONE);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = KVI_DTYPE_FP32;
  so.budget_bytes = 1 << 20;
  kvi_store *s;
  assert_ok(kvi_store_create(&s, m, &so));
  /* a fact of 2 tokens: K[l][t][h][d] = 1000 + ..., V = -1000 - ... */
  float k[L][2][ROW], v[L][2][ROW];
  for (int l = 0; l < L; l++)
    for (int t = 0; t < 2; t++)
      for (int e = 0; e < ROW; e++) k[l][t][e] = (float)(1000 + l * 100 + t * 20 + e), v[l][t][e] = -k[l][t][e];
  kvi_kv_view kv = KVI_KV_VIEW_INIT;
  kvi_kv_view_contiguous(&kv, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 2, H, D, k, v);
  assert_ok(kvi_store_put(s, 1, 9, &kv, NULL, NULL));

  for (int variant = 0; variant < 4; variant++) {
    hand h = hand_default();
    if (variant & 1) h.ggml_type = 0, h.es = 4;
    h.v_trans = variant >> 1;
    buf b = hand_state(&h, 1);
    uint8_t *orig = malloc(b.n);
    memcpy(orig, b.p, b.n);
    kvi_cache_layout cl;
    assert_ok(kvi_llama_state_layout(b.p, b.n, 0, m, KVI_MEMORY_HOST, &cl));
    assert_int_equal(cl.num_blocks, 1);
    assert_int_equal(cl.block_size, 5);
    kvi_injector *inj;
    assert_ok(kvi_injector_create(&inj, s, &cl, NULL));
    const int32_t table[1] = {0};
    const uint64_t id = 9;
    kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
    rq.tenant = 1;
    rq.fact_ids = &id;
    rq.num_facts = 1;
    rq.block_table = table;
    rq.block_table_len = 1;
    rq.first_slot = 2; /* cells 2 and 3 */
    rq.start_position = 2;
    assert_ok(kvi_inject(inj, &rq, 1, NULL, NULL));
    /* the expected state: the hand-built one with cells 2, 3 of every layer's
     * K and V replaced, assembled independently */
    kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
    assert_ok(kvi_llama_state_parse(b.p, b.n, &info));
    for (int plane = 0; plane < 2; plane++)
      for (int l = 0; l < L; l++)
        for (int c = 0; c < 5; c++)
          for (int e = 0; e < ROW; e++) {
            const size_t idx = plane && h.v_trans ? (size_t)e * 5 + (size_t)c : (size_t)c * ROW + (size_t)e;
            const size_t off = (plane ? info.sections[0].v_offset : info.sections[0].k_offset) +
                               (size_t)l * info.sections[0].layer_bytes + idx * (size_t)h.es;
            float want = val(plane, l, c, e);
            if (c == 2 || c == 3) want = plane ? v[l][c - 2][e] : k[l][c - 2][e];
            float got;
            if (h.es == 4) memcpy(&got, b.p + off, 4);
            else {
              _Float16 y;
              memcpy(&y, b.p + off, 2);
              got = (float)y;
            }
            if (got != want) {
              print_error("v_trans %d plane %d layer %d cell %d elem %d: %g, expected %g\n", h.v_trans, plane, l, c,
                          e, (double)got, (double)want);
              fail();
            }
          }
    /* headers and cells untouched */
    assert_memory_equal(b.p, orig, info.sections[0].k_offset - 12);
    kvi_injector_destroy(inj);

    /* capture cells 2..3 back: the fact's values */
    kvi_encoder *enc;
    assert_ok(kvi_encoder_create(&enc, s, &cl, NULL));
    kvi_capture cap = KVI_CAPTURE_INIT;
    cap.tenant = 2;
    cap.fact_id = 9;
    cap.block_table = table;
    cap.block_table_len = 1;
    cap.first_slot = 2;
    cap.num_tokens = 2;
    cap.start_position = 2;
    assert_ok(kvi_encode(enc, &cap, 1, NULL));
    float k2[L][2][ROW], v2[L][2][ROW];
    kvi_kv_view out = KVI_KV_VIEW_INIT;
    kvi_kv_view_contiguous(&out, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, 2, H, D, k2, v2);
    assert_ok(kvi_store_read(s, 2, 9, &out, NULL));
    assert_memory_equal(k2, k, sizeof k);
    assert_memory_equal(v2, v, sizeof v);
    assert_ok(kvi_store_remove(s, 2, 9));
    kvi_encoder_destroy(enc);
    free(orig);
    free(b.p);
  }
  kvi_store_destroy(s);
  kvi_model_destroy(m);
}

static void test_layout_checks(void **state) {
  (void)state;
  hand h = hand_default();
  buf b = hand_state(&h, 2);
  kvi_model *m = llama_model_of(1, 0, KVI_ROPE_GPTJ);
  kvi_cache_layout cl;
  assert_ok(kvi_llama_state_layout(b.p, b.n, 1, m, KVI_MEMORY_HOST, &cl));
  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  assert_ok(kvi_llama_state_parse(b.p, b.n, &info));
  assert_ptr_equal(cl.k_base, b.p + info.sections[1].k_offset);
  assert_ptr_equal(cl.v_base, b.p + info.sections[1].v_offset);
  assert_int_equal(cl.layer_stride * 2, info.sections[1].layer_bytes);
  assert_int_equal(cl.token_stride, ROW);
  assert_int_equal(cl.head_stride, D);
  assert_status(kvi_llama_state_layout(b.p, b.n, 2, m, KVI_MEMORY_HOST, &cl), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_state_layout(b.p, b.n, -1, m, KVI_MEMORY_HOST, &cl), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_state_layout(b.p, b.n, 0, m, (kvi_memory)7, &cl), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_state_layout(b.p + 1, b.n - 1, 0, m, KVI_MEMORY_HOST, &cl), KVI_ERR_CORRUPT);
  /* rank 1 of 2: its head's slice of every row */
  kvi_model *r1 = llama_model_of(2, 1, KVI_ROPE_GPTJ);
  assert_ok(kvi_llama_state_layout(b.p, b.n, 0, r1, KVI_MEMORY_HOST, &cl));
  assert_int_equal(cl.num_heads, 1);
  assert_ptr_equal(cl.k_base, b.p + info.sections[0].k_offset + D * 2);
  assert_int_equal(cl.token_stride, ROW);
  kvi_model_destroy(r1);
  /* another geometry */
  const kvi_model_options mo = model_options(L, H, D / 2, 0, 1);
  kvi_model *other;
  assert_ok(kvi_model_create(&other, &mo));
  assert_status(kvi_llama_state_layout(b.p, b.n, 0, other, KVI_MEMORY_HOST, &cl), KVI_ERR_MISMATCH);
  assert_last_error_has("kvi_llama_state_layout", "3 layers of 16 K/V elements");
  kvi_model_destroy(other);
  /* transposed V: V's own strides; rank 1 starts at its head's first column */
  free(b.p);
  h.v_trans = 1;
  b = hand_state(&h, 1);
  assert_ok(kvi_llama_state_parse(b.p, b.n, &info));
  assert_ok(kvi_llama_state_layout(b.p, b.n, 0, m, KVI_MEMORY_HOST, &cl));
  assert_int_equal(cl.token_stride, ROW);
  assert_int_equal(cl.v_token_stride, 1);
  assert_int_equal(cl.v_head_stride, D * 5);
  assert_int_equal(cl.v_dim_stride, 5);
  assert_ptr_equal(cl.v_base, b.p + info.sections[0].v_offset);
  r1 = llama_model_of(2, 1, KVI_ROPE_GPTJ);
  assert_ok(kvi_llama_state_layout(b.p, b.n, 0, r1, KVI_MEMORY_HOST, &cl));
  assert_ptr_equal(cl.v_base, b.p + info.sections[0].v_offset + (size_t)D * 5 * 2);
  kvi_model_destroy(r1);
  free(b.p);
  kvi_model_destroy(m);
}

/* ---- RoPE table --------------------------------------------------------------- */

static void test_rope_table(void **state) {
  (void)state;
  enum { P = 300, R = 64 };
  float *t = malloc((size_t)P * R * sizeof(float));
  assert_ok(kvi_llama_rope_table(t, P, R, 100000.0f, 1.0f));
  /* against float64 math: the angle's fp32 rounding is the only difference
   * (relative 1e-7 per product, over up to 31 products) */
  for (int p = 0; p < P; p++)
    for (int i = 0; i < R / 2; i++) {
      const double a = p * pow(100000.0, -2.0 * i / R);
      const double tol = 4e-6 * (a > 1 ? a : 1) + 1e-7;
      if (fabs(t[p * R + i] - cos(a)) > tol || fabs(t[p * R + R / 2 + i] - sin(a)) > tol) {
        print_error("p %d i %d: %g %g, float64 %g %g\n", p, i, (double)t[p * R + i], (double)t[p * R + R / 2 + i],
                    cos(a), sin(a));
        fail();
      }
    }
  /* row 0 is the identity, exactly */
  for (int i = 0; i < R / 2; i++) assert_true(t[i] == 1.0f && t[R / 2 + i] == 0.0f);
  /* freq_scale halves the angles */
  float *u = malloc((size_t)P * R * sizeof(float));
  assert_ok(kvi_llama_rope_table(u, P, R, 100000.0f, 0.5f));
  for (int i = 0; i < R / 2; i++) assert_true(fabs(u[2 * R + i] - t[1 * R + i]) < 1e-6);
  assert_status(kvi_llama_rope_table(t, 0, R, 1e4f, 1.0f), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_rope_table(t, P, 63, 1e4f, 1.0f), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_rope_table(t, P, R, -1.0f, 1.0f), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_rope_table(t, P, R, 1e4f, NAN), KVI_ERR_INVALID_ARGUMENT);
  assert_status(kvi_llama_rope_table(NULL, P, R, 1e4f, 1.0f), KVI_ERR_INVALID_ARGUMENT);
  free(t);
  free(u);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_hand_built),       cmocka_unit_test(test_parse_iswa_and_empty),
      cmocka_unit_test(test_parse_truncated),        cmocka_unit_test(test_parse_refusals),
      cmocka_unit_test(test_write_header_matches_hand_built), cmocka_unit_test(test_layout_inject_capture),
      cmocka_unit_test(test_layout_checks),          cmocka_unit_test(test_rope_table),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
