/*
 * libFuzzer target: llama.cpp sequence states (kvinject/llama.h) from
 * arbitrary bytes. Every input must be parsed or refused without a crash, a
 * leak or undefined behaviour, and for every accepted state:
 *  - each cell's position reads back, and none past the last cell;
 *  - a single-section state is what kvi_llama_state_write_header writes for
 *    its metadata: the same size, and writing the header over a copy of the
 *    input leaves every byte as it was;
 *  - its layout, for a model of its geometry, makes an injector and an
 *    encoder, and capturing every cell and injecting it back (no RoPE: bit
 *    copies) leaves the state unchanged.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvinject.h>

#define REQUIRE(cond)                                                                  \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      fprintf(stderr, "fuzz_llama: %s:%d: %s (%s)\n", __FILE__, __LINE__, #cond,       \
              kvi_last_error());                                                       \
      abort();                                                                         \
    }                                                                                  \
  } while (0)

static void round_trip(uint8_t *st, size_t size, const kvi_llama_state_info *info) {
  const kvi_llama_section *s = &info->sections[0];
  /* a model of the section's geometry: one head of the whole row when it fits */
  if (s->num_cells == 0 || s->num_cells > 64 || s->num_layers > 8 || s->k_row_elements > 1024) return;
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = s->num_layers;
  mo.num_kv_heads = 1;
  mo.head_size = s->k_row_elements;
  kvi_model *m;
  REQUIRE(kvi_model_create(&m, &mo) == KVI_OK);
  kvi_rope_spec none = KVI_ROPE_SPEC_INIT;
  none.style = KVI_ROPE_NONE;
  REQUIRE(kvi_model_set_rope(m, -1, &none) == KVI_OK);
  int32_t *pos = malloc((size_t)s->num_cells * sizeof *pos);
  REQUIRE(pos);
  REQUIRE(kvi_llama_state_positions(st, size, 0, 0, s->num_cells, pos) == KVI_OK);
  REQUIRE(kvi_llama_state_positions(st, size, 0, 1, s->num_cells, pos) == KVI_ERR_INVALID_ARGUMENT);

  if (info->num_sections == 1) {
    int negative = 0;
    for (int32_t i = 0; i < s->num_cells; i++) negative |= pos[i] < 0;
    kvi_llama_state_spec sp = KVI_LLAMA_STATE_SPEC_INIT;
    sp.seq_id = info->seq_id;
    sp.num_streams = s->num_streams;
    sp.stream = s->stream;
    sp.num_cells = s->num_cells;
    sp.positions = pos;
    sp.v_trans = s->v_trans;
    sp.dtype = s->dtype;
    size_t want;
    REQUIRE(kvi_llama_state_size(m, &sp, &want) == KVI_OK);
    REQUIRE(want == size);
    uint8_t *copy = malloc(size);
    REQUIRE(copy);
    memcpy(copy, st, size);
    const kvi_status ws = kvi_llama_state_write_header(copy, size, m, &sp);
    REQUIRE(negative ? ws == KVI_ERR_INVALID_ARGUMENT : ws == KVI_OK);
    REQUIRE(memcmp(copy, st, size) == 0);
    free(copy);
  }

  /* capture every cell, inject it back: bit copies */
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  so.backend = KVI_BACKEND_CPU;
  so.dtype = s->dtype;
  so.budget_bytes = 4u << 20;
  kvi_store *store;
  if (kvi_store_create(&store, m, &so) == KVI_OK) {
    kvi_cache_layout cl;
    REQUIRE(kvi_llama_state_layout(st, size, 0, m, KVI_MEMORY_HOST, &cl) == KVI_OK);
    kvi_encoder *enc;
    kvi_injector *inj;
    REQUIRE(kvi_encoder_create(&enc, store, &cl, NULL) == KVI_OK);
    REQUIRE(kvi_injector_create(&inj, store, &cl, NULL) == KVI_OK);
    uint8_t *before = malloc(size);
    REQUIRE(before);
    memcpy(before, st, size);
    const int32_t table[1] = {0};
    kvi_capture c = KVI_CAPTURE_INIT;
    c.tenant = 1;
    c.fact_id = 1;
    c.block_table = table;
    c.block_table_len = 1;
    c.num_tokens = s->num_cells;
    if (kvi_encode(enc, &c, 1, NULL) == KVI_OK) {
      const uint64_t id = 1;
      kvi_inject_request rq = KVI_INJECT_REQUEST_INIT;
      rq.tenant = 1;
      rq.fact_ids = &id;
      rq.num_facts = 1;
      rq.block_table = table;
      rq.block_table_len = 1;
      REQUIRE(kvi_inject(inj, &rq, 1, NULL, NULL) == KVI_OK);
      REQUIRE(memcmp(before, st, size) == 0);
    }
    free(before);
    kvi_injector_destroy(inj);
    kvi_encoder_destroy(enc);
    kvi_store_destroy(store);
  }
  free(pos);
  kvi_model_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* an aligned copy of exactly `size` bytes: ASan sees any read past it */
  uint8_t *st = malloc(size ? size : 1);
  if (!st) return 0;
  memcpy(st, data, size);
  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  const kvi_status ps = kvi_llama_state_parse(st, size, &info);
  if (ps == KVI_OK) {
    REQUIRE(info.size == size && info.num_sections >= 1 && info.num_sections <= KVI_LLAMA_MAX_SECTIONS);
    round_trip(st, size, &info);
  } else {
    REQUIRE(ps == KVI_ERR_CORRUPT || ps == KVI_ERR_UNSUPPORTED);
    REQUIRE(kvi_last_error()[0] != '\0');
  }
  free(st);
  return 0;
}
