/*
 * Store files: the loader's reading of a file header, checked against the
 * model and the store options it is loaded with (load.c, and the disk
 * tier's tenant files through it).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "persist/internal.h"

static const char *const rope_fields[] = {
    "style",     "rotary_dim", "scaling",          "original_max_position", "theta",      "factor",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "yarn_truncate",
    "table_positions", "cos_sin_table (hash)"};
static const int rope_offsets[] = {0, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 76, 80};

static kvi_status rope_mismatch(const loader *ld, int32_t layer, const unsigned char *file, const unsigned char *model) {
  for (int i = 0; i < 14; i++) {
    const int off = rope_offsets[i], size = i < 4 || i == 11 || i == 12 ? 4 : 8;
    if (memcmp(file + off, model + off, (size_t)size) == 0) continue;
    char a[64], b[64];
    if (size == 4) {
      snprintf(a, sizeof a, "%d", (int)get32(file + off));
      snprintf(b, sizeof b, "%d", (int)get32(model + off));
    } else if (i == 13) {
      snprintf(a, sizeof a, "0x%016llx", (unsigned long long)get64(file + off));
      snprintf(b, sizeof b, "0x%016llx", (unsigned long long)get64(model + off));
    } else {
      snprintf(a, sizeof a, "%.17g", getf64(file + off));
      snprintf(b, sizeof b, "%.17g", getf64(model + off));
    }
    return kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: layer %d RoPE %s is %s in the file, %s in the model", ld->path,
                     (int)layer, rope_fields[i], a, b);
  }
  return kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: layer %d RoPE differs from the model's", ld->path, (int)layer);
}

/* Reads and checks the header against the model and the store options. */
kvi_status kvi__persist_read_header(loader *ld, const kvi_model *model, const kvi_store_options *o) {
  unsigned char fixed[HDR_FIXED];
  if (ld->size < HDR_BYTES(1))
    return kvi__persist_corrupt(ld, 0, "the file is %llu bytes, shorter than a store file header (%llu)",
                   (unsigned long long)ld->size, (unsigned long long)HDR_BYTES(1));
  kvi_status st = kvi__persist_rd(ld, 0, fixed, sizeof fixed);
  if (st) return st;
  if (memcmp(fixed, FILE_MAGIC, 8) != 0) return kvi__persist_corrupt(ld, 0, "not a libkvinject store file (no KVISTORE magic)");
  const uint64_t hb = get32(fixed + 16);
  if (hb < HDR_BYTES(1) || hb > HDR_BYTES(MAX_LAYERS) || hb > ld->size)
    return kvi__persist_corrupt(ld, 16, "header size %llu is impossible (file size %llu)", (unsigned long long)hb,
                   (unsigned long long)ld->size);
  unsigned char *h = malloc((size_t)hb);
  if (!h) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating a %llu-byte header", (unsigned long long)hb);
  if ((st = kvi__persist_rd(ld, 0, h, (size_t)hb))) goto out;
  const uint32_t crc = kvi__crc32c(0, h, (size_t)hb - 4);
  if (!CRC_OK(get32(h + hb - 4), crc)) {
    st = kvi__persist_corrupt(ld, hb - 4, "header checksum mismatch (stored 0x%08x, computed 0x%08x)", get32(h + hb - 4), crc);
    goto out;
  }
  ld->version = get32(h + 8);
  if (ld->version < FORMAT_VERSION_MIN || ld->version > FORMAT_VERSION) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: format version %u; this library reads versions %d to %d",
                   ld->path, ld->version, FORMAT_VERSION_MIN, FORMAT_VERSION);
    goto out;
  }
  if (get32(h + 12) != ENDIAN_MARK) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: written with another byte order (mark 0x%08x)", ld->path,
                   get32(h + 12));
    goto out;
  }
  const int32_t L = (int32_t)get32(h + 32);
  const uint32_t scale_P = get32(h + 84); /* page_tokens of a quantized file, else 0 */
  const bool quant_file = get32(h + 64) == (uint32_t)KVI_DTYPE_FP8_E4M3 || get32(h + 64) == (uint32_t)KVI_DTYPE_Q4;
  if (L < 1 || L > MAX_LAYERS || hb != HDR_BYTES(L) || get32(h + 80) != ROPE_BYTES ||
      (quant_file ? scale_P < 1 || scale_P > 4096 : scale_P != 0)) {
    st = kvi__persist_corrupt(ld, 32, "inconsistent header (%d layers, %llu header bytes)", (int)L, (unsigned long long)hb);
    goto out;
  }
  if (get32(h + 20) != 0) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: unknown header flags 0x%x", ld->path, get32(h + 20));
    goto out;
  }
  ld->file_id = get64(h + 24);

  const kvi__geom *g = &model->geom;
  static const char *const names[8] = {"num_layers", "num_kv_heads", "head_size",   "tp_rank",
                                       "tp_size",    "local_head_first", "local_heads", "head_replicas"};
  const int32_t want[8] = {g->num_layers, g->num_kv_heads, g->head_size,  g->tp_rank,
                           g->tp_size,    g->head_first,   g->local_heads, g->head_replicas};
  for (int i = 0; i < 8; i++) {
    const int32_t have = (int32_t)get32(h + 32 + 4 * i);
    if (have != want[i]) {
      st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: the file was made for %s %d, the model has %d%s", ld->path,
                     names[i], (int)have, (int)want[i],
                     i >= 3 ? " (a store file holds one tensor-parallel rank's heads)" : "");
      goto out;
    }
  }
  const kvi_dtype dt = (kvi_dtype)get32(h + 64);
  if (dt != o->dtype) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: the file holds %s facts, opts->dtype is %s", ld->path,
                   kvi__dtype_name(dt), kvi__dtype_name(o->dtype));
    goto out;
  }
  if (quant_file && scale_P != (uint32_t)o->page_tokens) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn,
                   "%s: the file's %s facts have scales per page of %u tokens, opts->page_tokens is %d", ld->path, kvi__dtype_name(dt),
                   scale_P, (int)o->page_tokens);
    goto out;
  }
  const int32_t E = (int32_t)get32(h + 68);
  if (E != o->embedding_dim) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: the file's embeddings have %d elements, opts->embedding_dim is %d",
                   ld->path, (int)E, (int)o->embedding_dim);
    goto out;
  }
  if (E > 0 && (get32(h + 72) != (uint32_t)o->embedding_dtype || get32(h + 76) != (uint32_t)o->metric)) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn,
                   "%s: the file's embeddings are kept as dtype %u with metric %u, opts asks for dtype %u with metric %u",
                   ld->path, get32(h + 72), get32(h + 76), (unsigned)o->embedding_dtype, (unsigned)o->metric);
    goto out;
  }
  unsigned char *mine = malloc((size_t)L * ROPE_BYTES);
  if (!mine) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating RoPE entries");
    goto out;
  }
  kvi__persist_rope_entries(mine, model->rope, L);
  for (int32_t l = 0; l < L && st == KVI_OK; l++)
    if (memcmp(h + HDR_FIXED + (size_t)l * ROPE_BYTES, mine + (size_t)l * ROPE_BYTES, ROPE_BYTES) != 0)
      st = rope_mismatch(ld, l, h + HDR_FIXED + (size_t)l * ROPE_BYTES, mine + (size_t)l * ROPE_BYTES);
  free(mine);
out:
  free(h);
  return st;
}
