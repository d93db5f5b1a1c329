/*
 * Store files: the format's writing side, a file header (its RoPE entries
 * included), entry headers and a fact's PUT record read from its pages.
 * The layout is in docs/store-format.md; the constants and byte codecs in
 * persist/internal.h; load.c reads and checks what these write.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "persist/internal.h"

/* FNV-1a, 64 bits: identifies an engine cos/sin table in the header. */
static uint64_t fnv64(const void *data, size_t n) {
  const unsigned char *p = data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/* One layer's RoPE as it is written: only what changes the rotation, so that
 * two specs that rotate alike compare equal (a table's formula fields, the
 * factors a scaling does not use, are zero). */
static void rope_entry(unsigned char *e, const kvi__rope *r, uint64_t table_hash) {
  memset(e, 0, ROPE_BYTES);
  put32(e, (uint32_t)r->style);
  if (r->style == KVI_ROPE_NONE) return;
  const kvi_rope_spec *s = &r->spec;
  put32(e + 4, (uint32_t)r->rotary_dim);
  putf64(e + 64, (double)s->attention_factor);
  if (r->table) {
    put32(e + 76, (uint32_t)r->table->positions);
    put64(e + 80, table_hash);
    return;
  }
  put32(e + 8, (uint32_t)s->scaling);
  putf64(e + 16, s->theta);
  switch (s->scaling) {
  case KVI_ROPE_SCALING_NONE: break;
  case KVI_ROPE_SCALING_LINEAR:
  case KVI_ROPE_SCALING_NTK: putf64(e + 24, s->factor); break;
  case KVI_ROPE_SCALING_LLAMA3:
    put32(e + 12, (uint32_t)s->original_max_position);
    putf64(e + 24, s->factor);
    putf64(e + 32, s->low_freq_factor);
    putf64(e + 40, s->high_freq_factor);
    break;
  case KVI_ROPE_SCALING_YARN:
    put32(e + 12, (uint32_t)s->original_max_position);
    putf64(e + 24, s->factor);
    putf64(e + 48, s->beta_fast);
    putf64(e + 56, s->beta_slow);
    put32(e + 72, (uint32_t)s->yarn_truncate);
    break;
  }
}

/* Fills n_layers RoPE entries (tables shared by layers are hashed once). */
void kvi__persist_rope_entries(unsigned char *out, const kvi__rope *rope, int32_t n_layers) {
  const kvi__table *last = NULL;
  uint64_t hash = 0;
  for (int32_t l = 0; l < n_layers; l++) {
    const kvi__table *t = rope[l].table;
    if (t && t != last) {
      hash = fnv64(t->data, (size_t)t->positions * (size_t)t->rotary_dim * sizeof(float));
      last = t;
    }
    rope_entry(out + (size_t)l * ROPE_BYTES, &rope[l], t ? hash : 0);
  }
}

/* The file header for a store: HDR_BYTES(L) bytes, CRC included. */
unsigned char *kvi__persist_make_header(const kvi_store *s, uint64_t file_id, size_t *out_len) {
  const kvi__geom *g = &s->geom;
  const size_t len = (size_t)HDR_BYTES(g->num_layers);
  unsigned char *h = calloc(1, len);
  if (!h) return NULL;
  memcpy(h, FILE_MAGIC, 8);
  put32(h + 8, FORMAT_VERSION);
  put32(h + 12, ENDIAN_MARK);
  put32(h + 16, (uint32_t)len);
  put32(h + 20, 0); /* flags */
  put64(h + 24, file_id);
  const int32_t geom[8] = {g->num_layers, g->num_kv_heads, g->head_size,  g->tp_rank,
                           g->tp_size,    g->head_first,   g->local_heads, g->head_replicas};
  for (int i = 0; i < 8; i++) put32(h + 32 + 4 * i, (uint32_t)geom[i]);
  put32(h + 64, (uint32_t)s->dtype);
  put32(h + 68, (uint32_t)s->emb_dim);
  put32(h + 72, (uint32_t)s->emb.dtype); /* how the store keeps embeddings (payloads are fp32, exact) */
  put32(h + 76, (uint32_t)s->emb.metric);
  put32(h + 80, ROPE_BYTES);
  put32(h + 84, s->scale_bytes ? (uint32_t)s->P : 0u); /* fp8, q4: scales are per page of P tokens */
  kvi__persist_rope_entries(h + HDR_FIXED, s->rope, g->num_layers);
  put32(h + len - 4, kvi__crc32c(0, h, len - 4));
  *out_len = len;
  return h;
}

void kvi__persist_entry_header(unsigned char *h, uint32_t kind, uint64_t file_id, uint64_t seq, uint64_t body_bytes,
                               uint32_t count, uint32_t body_crc) {
  put32(h, ENTRY_MAGIC);
  put32(h + 4, kind);
  put64(h + 8, file_id);
  put64(h + 16, seq);
  put64(h + 24, body_bytes);
  put32(h + 32, count);
  put32(h + 36, 0);
  put32(h + 40, body_crc);
  put32(h + 44, kvi__crc32c(0, h, 44));
}

/* Writes a PUT record for a fact whose data is in `pages` (store lock held). */
kvi_status kvi__persist_fill_put(const kvi_store *s, unsigned char *rec, uint64_t tenant, uint64_t id, int32_t tokens,
                                 const uint32_t *pages, const float *emb, const int32_t *ids, const uint64_t *ctx,
                                 int32_t nctx, bool stale, const char *fn) {
  const uint64_t payload = put_payload(s, tokens, ids != NULL, nctx);
  memset(rec, 0, (size_t)(REC_HDR + pad8(payload)));
  put32(rec, OP_PUT | (ids ? REC_TOKEN_IDS : 0u) | (nctx > 0 ? REC_CONTEXT : 0u));
  put32(rec + 4, (uint32_t)tokens);
  put64(rec + 8, tenant);
  put64(rec + 16, id);
  put64(rec + 24, payload);
  unsigned char *p = rec + REC_HDR;
  if (s->emb_dim > 0) memcpy(p, emb, (size_t)s->emb_dim * sizeof(float));
  p += (size_t)s->emb_dim * sizeof(float);
  const kvi__geom *g = &s->geom;
  const size_t plane = (size_t)tokens * (size_t)(token_bytes(s) / 2u);
  kvi_kv_view v;
  kvi__kv_view_contiguous(&v, KVI_MEMORY_HOST, s->dtype, g->num_layers, tokens, g->local_heads, g->head_size, p,
                         p + plane);
  const size_t sb = (size_t)scale_bytes((uint64_t)tokens, s->scale_bytes ? s->P : 0, s->scale_bytes);
  for (int32_t i = 0; ids && i < tokens; i++) put32(p + 2 * plane + sb + 4 * (size_t)i, (uint32_t)ids[i]);
  if (nctx > 0) {
    unsigned char *c = p + 2 * plane + sb + (ids ? 4 * (size_t)tokens : 0);
    put32(c, (uint32_t)nctx);
    put32(c + 4, stale ? 1u : 0u);
    for (int32_t i = 0; i < nctx; i++) put64(c + 8 + 8 * (size_t)i, ctx[i]);
  }
  if (!sb) return kvi__store_read_pages(s, pages, tokens, &v, NULL, fn);
  unsigned char *scales = malloc(sb);
  if (!scales) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes of scales", sb);
  const kvi_status st = kvi__store_read_pages(s, pages, tokens, &v, scales, fn);
  if (st == KVI_OK) memcpy(p + 2 * plane, scales, sb); /* after V; not float-aligned in general */
  free(scales);
  return st;
}
