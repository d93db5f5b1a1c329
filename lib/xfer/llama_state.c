/*
 * llama.cpp's sequence state (kvinject/llama.h): parse and validate, the
 * cache layout of its cells, positions, a fresh state's metadata, and
 * llama.cpp's RoPE table.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "xfer/xfer.h"

#define INFO_V1 sizeof(kvi_llama_state_info)

/* Bytes of one cell record with one seq id: i32 pos, u32 n_seq_id, i32 seq id. */
#define CELL_BYTES 12u
/* Bytes of a layer's header before its data: i32 type + u64 row bytes, or
 * (transposed V) i32 type + u32 element bytes + u32 row elements. */
#define LAYER_HEADER_BYTES 12u
#define MAX_STREAMS 65536u
#define MAX_LAYERS 65536u

static int32_t ggml_type_of(kvi_dtype t) {
  switch (t) {
  case KVI_DTYPE_FP32: return KVI_LLAMA_GGML_F32;
  case KVI_DTYPE_FP16: return KVI_LLAMA_GGML_F16;
  case KVI_DTYPE_BF16: return KVI_LLAMA_GGML_BF16;
  default: return -1;
  }
}

static kvi_dtype dtype_of(int32_t ggml) {
  switch (ggml) {
  case KVI_LLAMA_GGML_F32: return KVI_DTYPE_FP32;
  case KVI_LLAMA_GGML_F16: return KVI_DTYPE_FP16;
  case KVI_LLAMA_GGML_BF16: return KVI_DTYPE_BF16;
  default: return (kvi_dtype)0;
  }
}

/* ---- reading ------------------------------------------------------------- */

typedef struct reader {
  const uint8_t *p;
  size_t size, off;
  const char *fn;
} reader;

static size_t left(const reader *r) { return r->size - r->off; }

static kvi_status need(const reader *r, uint64_t bytes, const char *what) {
  if (bytes > left(r))
    return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: %s needs %llu bytes, the state has %zu left", r->off, what,
                     (unsigned long long)bytes, left(r));
  return KVI_OK;
}

static kvi_status rd32(reader *r, uint32_t *v, const char *what) {
  kvi_status st = need(r, 4, what);
  if (st) return st;
  memcpy(v, r->p + r->off, 4);
  r->off += 4;
  return KVI_OK;
}

static kvi_status rd64(reader *r, uint64_t *v, const char *what) {
  kvi_status st = need(r, 8, what);
  if (st) return st;
  memcpy(v, r->p + r->off, 8);
  r->off += 8;
  return KVI_OK;
}

/* One layer's header and data. K and non-transposed V: i32 type, u64 row
 * bytes, cells rows. Transposed V: i32 type, u32 element bytes, u32 row
 * elements, cells x row elements. Sets *dtype and *row (elements). */
static kvi_status read_layer(reader *r, uint32_t cells, bool trans, const char *which, uint32_t layer, kvi_dtype *dtype,
                             uint64_t *row) {
  const size_t at = r->off;
  uint32_t type;
  kvi_status st = rd32(r, &type, "a layer's ggml type");
  if (st) return st;
  const kvi_dtype t = dtype_of((int32_t)type);
  if (!t)
    return kvi__fail(KVI_ERR_UNSUPPORTED, r->fn,
                     "offset %zu: layer %u %s has ggml type %d; supported are f32 (0), f16 (1) and bf16 (30)", at,
                     (unsigned)layer, which, (int)(int32_t)type);
  const uint64_t es = kvi__dtype_size(t);
  uint64_t elems;
  if (!trans) {
    uint64_t bytes;
    if ((st = rd64(r, &bytes, "a layer's row bytes"))) return st;
    if (bytes == 0 || bytes % es)
      return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: layer %u %s rows are %llu bytes, not a whole number of %s",
                       at + 4, (unsigned)layer, which, (unsigned long long)bytes, kvi__dtype_name(t));
    elems = bytes / es;
  } else {
    uint32_t el, n;
    if ((st = rd32(r, &el, "an element size")) || (st = rd32(r, &n, "a row's elements"))) return st;
    if (el != es)
      return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: layer %u %s says %u-byte elements for %s", at + 4,
                       (unsigned)layer, which, (unsigned)el, kvi__dtype_name(t));
    if (n == 0)
      return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: layer %u %s has 0 elements per row", at + 8,
                       (unsigned)layer, which);
    elems = n;
  }
  if (elems > INT32_MAX)
    return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: layer %u %s has %llu elements per cell", at,
                     (unsigned)layer, which, (unsigned long long)elems);
  uint64_t data;
  if (__builtin_mul_overflow(elems * es, (uint64_t)cells, &data) || data > left(r))
    return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: layer %u %s data (%u cells x %llu bytes) runs past the state",
                     r->off, (unsigned)layer, which, (unsigned)cells, (unsigned long long)(elems * es));
  r->off += (size_t)data;
  *dtype = t;
  *row = elems;
  return KVI_OK;
}

/* K or V of every layer: one dtype, one row size. */
static kvi_status read_plane(reader *r, uint32_t cells, uint32_t layers, bool trans, const char *which,
                             kvi_dtype *dtype, uint64_t *row, uint64_t *first_data, uint64_t *layer_bytes) {
  kvi_status st;
  for (uint32_t l = 0; l < layers; l++) {
    const size_t start = r->off;
    kvi_dtype t = (kvi_dtype)0;
    uint64_t n = 0;
    if ((st = read_layer(r, cells, trans, which, l, &t, &n))) return st;
    if (l == 0) {
      *dtype = t;
      *row = n;
      *first_data = start + LAYER_HEADER_BYTES;
      *layer_bytes = r->off - start;
    } else if (t != *dtype || n != *row) {
      return kvi__fail(KVI_ERR_UNSUPPORTED, r->fn,
                       "offset %zu: layer %u %s is %s x %llu per cell, layer 0 %s x %llu; one type and row size for all "
                       "layers is supported",
                       start, (unsigned)l, which, kvi__dtype_name(t), (unsigned long long)n, kvi__dtype_name(*dtype),
                       (unsigned long long)*row);
    }
  }
  return KVI_OK;
}

static kvi_status read_section(reader *r, int32_t seq_id, int32_t index, kvi_llama_section *sec) {
  memset(sec, 0, sizeof *sec);
  sec->stream = -1;
  const size_t at = r->off;
  uint32_t n_stream;
  kvi_status st = rd32(r, &n_stream, "the stream count");
  if (st) return st;
  if (n_stream < 1 || n_stream > MAX_STREAMS)
    return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: section %d has %u streams, expected 1..%u", at, (int)index,
                     (unsigned)n_stream, MAX_STREAMS);
  sec->num_streams = (int32_t)n_stream;
  for (uint32_t s = 0; s < n_stream; s++) {
    const size_t cat = r->off;
    uint32_t cells;
    if ((st = rd32(r, &cells, "a stream's cell count"))) return st;
    if (cells == 0) continue;
    if (sec->stream >= 0)
      return kvi__fail(KVI_ERR_UNSUPPORTED, r->fn,
                       "offset %zu: streams %d and %u of section %d both hold cells; one stream per sequence is supported",
                       cat, (int)sec->stream, (unsigned)s, (int)index);
    if (cells > INT32_MAX || (uint64_t)cells * CELL_BYTES > left(r))
      return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: %u cells do not fit in the %zu bytes left", cat,
                       (unsigned)cells, left(r));
    sec->stream = (int32_t)s;
    sec->num_cells = (int32_t)cells;
    sec->cells_offset = r->off;
    for (uint32_t c = 0; c < cells; c++) {
      const uint8_t *rec = r->p + r->off;
      uint32_t n_seq;
      int32_t seq;
      memcpy(&n_seq, rec + 4, 4);
      memcpy(&seq, rec + 8, 4);
      if (n_seq != 1)
        return kvi__fail(KVI_ERR_UNSUPPORTED, r->fn,
                         "offset %zu: cell %u has %u seq ids; a sequence's state has 1 per cell (llama.cpp refuses "
                         "others in set_data)",
                         r->off + 4, (unsigned)c, (unsigned)n_seq);
      if (seq != seq_id)
        return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: cell %u belongs to seq %d, the state is seq %d's",
                         r->off + 8, (unsigned)c, (int)seq, (int)seq_id);
      r->off += CELL_BYTES;
    }
    uint32_t v_trans, layers;
    const size_t vat = r->off;
    if ((st = rd32(r, &v_trans, "v_trans")) || (st = rd32(r, &layers, "the layer count"))) return st;
    if (v_trans > 1)
      return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: v_trans is %u, expected 0 or 1", vat, (unsigned)v_trans);
    if (layers < 1 || layers > MAX_LAYERS)
      return kvi__fail(KVI_ERR_CORRUPT, r->fn, "offset %zu: %u layers, expected 1..%u", vat + 4, (unsigned)layers,
                       MAX_LAYERS);
    sec->v_trans = (int32_t)v_trans;
    sec->num_layers = (int32_t)layers;
    kvi_dtype kt = (kvi_dtype)0, vt = (kvi_dtype)0;
    uint64_t krow = 0, vrow = 0, kfirst = 0, vfirst = 0, klb = 0, vlb = 0;
    if ((st = read_plane(r, cells, layers, false, "K", &kt, &krow, &kfirst, &klb)) ||
        (st = read_plane(r, cells, layers, v_trans, "V", &vt, &vrow, &vfirst, &vlb)))
      return st;
    if (kt != vt || krow != vrow)
      return kvi__fail(KVI_ERR_UNSUPPORTED, r->fn,
                       "section %d: K is %s x %llu per cell, V %s x %llu; K and V of one type and size are supported",
                       (int)index, kvi__dtype_name(kt), (unsigned long long)krow, kvi__dtype_name(vt),
                       (unsigned long long)vrow);
    sec->dtype = kt;
    sec->k_row_elements = (int32_t)krow;
    sec->v_row_elements = (int32_t)vrow;
    sec->k_offset = kfirst;
    sec->v_offset = vfirst;
    sec->layer_bytes = klb; /* equal to vlb: same header size, type and elements */
    (void)vlb;
  }
  sec->end_offset = r->off;
  return KVI_OK;
}

static kvi_status parse(const void *state, size_t size, kvi_llama_state_info *info, const char *fn) {
  if (!state) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "state is NULL");
  memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
  reader r = {(const uint8_t *)state, size, 0, fn};
  uint32_t magic, seq;
  kvi_status st;
  if ((st = rd32(&r, &magic, "the magic"))) return st;
  if (magic != KVI_LLAMA_STATE_MAGIC)
    return kvi__fail(KVI_ERR_CORRUPT, fn, "offset 0: magic 0x%08x is not a llama.cpp sequence state's (0x%08x)",
                     (unsigned)magic, KVI_LLAMA_STATE_MAGIC);
  if ((st = rd32(&r, &seq, "the seq id"))) return st;
  if ((int32_t)seq < 0)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn,
                     "offset 4: seq id %d: a state of every sequence (seq -1) is not a single sequence's state",
                     (int)(int32_t)seq);
  info->seq_id = (int32_t)seq;
  do {
    if (info->num_sections == KVI_LLAMA_MAX_SECTIONS)
      return kvi__fail(KVI_ERR_CORRUPT, fn, "offset %zu: %zu bytes follow the state's %d KV cache sections", r.off,
                       left(&r), KVI_LLAMA_MAX_SECTIONS);
    const size_t at = r.off;
    if ((st = read_section(&r, info->seq_id, info->num_sections, &info->sections[info->num_sections]))) {
      if (info->num_sections == 0) return st;
      /* bytes after a whole first section: a second cache (iSWA) or garbage */
      char why[256];
      snprintf(why, sizeof why, "%s", kvi__last_error());
      return kvi__fail(KVI_ERR_CORRUPT, fn, "offset %zu: the %zu bytes after section 0 are not a second KV cache section (%s)",
                       at, size - at, why);
    }
    info->num_sections++;
  } while (left(&r) > 0);
  info->size = r.off;
  return KVI_OK;
}

kvi_status kvi__llama_state_parse(const void *state, size_t size, kvi_llama_state_info *out, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  if (out->struct_size < INFO_V1)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "out->struct_size is %zu, expected >= %zu", out->struct_size, INFO_V1);
  kvi_llama_state_info info;
  kvi_status st = parse(state, size, &info, fn);
  if (st) return st;
  return kvi__write_struct(out, &info, sizeof info, INFO_V1, fn, "out");
}

static kvi_status section_of(const void *state, size_t size, int32_t section, kvi_llama_section *out, const char *fn) {
  kvi_llama_state_info info;
  kvi_status st = parse(state, size, &info, fn);
  if (st) return st;
  if (section < 0 || section >= info.num_sections)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "section %d: the state has %d", (int)section, (int)info.num_sections);
  *out = info.sections[section];
  return KVI_OK;
}

kvi_status kvi__llama_state_layout(void *state, size_t size, int32_t section, const kvi_model *model, kvi_memory memory,
                                   kvi_cache_layout *out, const char *fn) {
  if (!model || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "model and out must not be NULL");
  if (memory != KVI_MEMORY_HOST && memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "memory is %d: KVI_MEMORY_HOST or KVI_MEMORY_DEVICE", (int)memory);
  kvi_llama_section sec;
  kvi_status st = section_of(state, size, section, &sec, fn);
  if (st) return st;
  if (sec.num_cells == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "section %d holds no cells", (int)section);
  const kvi__geom *g = &model->geom;
  const int64_t full_row = (int64_t)g->num_kv_heads * g->head_size;
  if (sec.num_layers != g->num_layers || sec.k_row_elements != full_row)
    return kvi__fail(KVI_ERR_MISMATCH, fn,
                     "section %d has %d layers of %d K/V elements per cell; the model has %d layers of %d KV heads x %d "
                     "= %lld",
                     (int)section, (int)sec.num_layers, (int)sec.k_row_elements, (int)g->num_layers,
                     (int)g->num_kv_heads, (int)g->head_size, (long long)full_row);
  const size_t es = kvi__dtype_size(sec.dtype);
  if ((uintptr_t)state % es)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "state %p is not aligned to its %zu-byte elements", state, es);
  /* Offsets and layer_bytes are multiples of 4 (all headers are 4-byte
   * words; rows are whole elements), hence of es. A rank of a tensor-parallel
   * model addresses its heads' slice of every row (of every V column group
   * when V is transposed). */
  const uint64_t cells = (uint64_t)sec.num_cells;
  const uint64_t head0 = (uint64_t)g->head_first * (uint64_t)g->head_size * es;
  kvi_cache_layout l = KVI_CACHE_LAYOUT_INIT;
  l.memory = memory;
  l.dtype = sec.dtype;
  l.num_layers = sec.num_layers;
  l.num_heads = g->local_heads;
  l.head_size = g->head_size;
  l.block_size = sec.num_cells;
  l.num_blocks = 1;
  l.block_stride = (int64_t)sec.num_cells * full_row;
  l.token_stride = full_row;
  l.head_stride = g->head_size;
  l.layer_stride = (int64_t)(sec.layer_bytes / es);
  l.k_base = (char *)state + sec.k_offset + head0;
  l.v_base = (char *)state + sec.v_offset + (sec.v_trans ? head0 * cells : head0);
  if (sec.v_trans) { /* V element-major: [heads x head size][cells] */
    l.v_block_stride = (int64_t)cells * full_row;
    l.v_token_stride = 1;
    l.v_head_stride = (int64_t)cells * g->head_size;
    l.v_dim_stride = (int64_t)cells;
  }
  *out = l;
  return KVI_OK;
}

kvi_status kvi__llama_state_positions(const void *state, size_t size, int32_t section, int32_t first_cell,
                                      int32_t num_cells, int32_t *out, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  kvi_llama_section sec;
  kvi_status st = section_of(state, size, section, &sec, fn);
  if (st) return st;
  if (first_cell < 0 || num_cells < 0 || first_cell > sec.num_cells - num_cells)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "cells [%d, %d + %d) are outside section %d's %d cells",
                     (int)first_cell, (int)first_cell, (int)num_cells, (int)section, (int)sec.num_cells);
  const uint8_t *p = (const uint8_t *)state + sec.cells_offset + (size_t)first_cell * CELL_BYTES;
  for (int32_t i = 0; i < num_cells; i++) memcpy(&out[i], p + (size_t)i * CELL_BYTES, 4);
  return KVI_OK;
}

/* ---- writing ------------------------------------------------------------- */

typedef struct plan {
  kvi_llama_state_spec s;
  size_t es, row_bytes, layer_bytes, size;
  int32_t L, row;
} plan;

static kvi_status make_plan(plan *p, const kvi_model *model, const kvi_llama_state_spec *spec, const char *fn) {
  if (!model || !spec) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "model and spec must not be NULL");
  kvi_llama_state_spec s = KVI_LLAMA_STATE_SPEC_INIT;
  kvi_status st = kvi__read_struct(&s, sizeof s, spec, KVI__LLAMA_STATE_SPEC_V1, fn, "spec");
  if (st) return st;
  if (s.seq_id < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->seq_id is %d, expected >= 0", (int)s.seq_id);
  if (s.num_streams < 1 || (uint32_t)s.num_streams > MAX_STREAMS || s.stream < 0 || s.stream >= s.num_streams)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->stream %d of %d streams: expected 0 <= stream < streams <= %u",
                     (int)s.stream, (int)s.num_streams, MAX_STREAMS);
  if (s.num_cells < 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->num_cells is %d, expected >= 1", (int)s.num_cells);
  if (s.v_trans != 0 && s.v_trans != 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->v_trans is %d, expected 0 or 1", (int)s.v_trans);
  if (ggml_type_of(s.dtype) < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->dtype is %d; llama.cpp states hold FP32, FP16 or BF16",
                     (int)s.dtype);
  if (s.start_position < 0 || (s.positions && s.start_position != 0))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->start_position is %d: >= 0, and 0 with positions",
                     (int)s.start_position);
  if (!s.positions && s.num_cells - 1 > INT32_MAX - s.start_position)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "positions from %d for %d cells overflow int32",
                     (int)s.start_position, (int)s.num_cells);
  const kvi__geom *g = &model->geom;
  p->s = s;
  p->L = g->num_layers;
  p->es = kvi__dtype_size(s.dtype);
  p->row = g->num_kv_heads * g->head_size; /* <= 65536 * 1024 */
  size_t data, t;
  p->row_bytes = (size_t)p->row * p->es;
  /* fixed: magic, seq, streams, cell counts, v_trans, layers */
  size_t size = 12 + 4 * (size_t)s.num_streams + 8;
  if (__builtin_mul_overflow(p->row_bytes, (size_t)s.num_cells, &data) ||
      __builtin_add_overflow(data, (size_t)LAYER_HEADER_BYTES, &p->layer_bytes) ||
      __builtin_mul_overflow(p->layer_bytes, (size_t)2 * (size_t)p->L, &t) || __builtin_add_overflow(size, t, &size) ||
      __builtin_add_overflow(size, (size_t)s.num_cells * CELL_BYTES, &size))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "a state of %d cells x %d layers x %zu bytes overflows size_t",
                     (int)s.num_cells, (int)p->L, p->row_bytes);
  p->size = size;
  return KVI_OK;
}

kvi_status kvi__llama_state_size(const kvi_model *model, const kvi_llama_state_spec *spec, size_t *out_size,
                                 const char *fn) {
  if (!out_size) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_size is NULL");
  plan p;
  kvi_status st = make_plan(&p, model, spec, fn);
  if (st) return st;
  *out_size = p.size;
  return KVI_OK;
}

static uint8_t *put32(uint8_t *w, uint32_t v) {
  memcpy(w, &v, 4);
  return w + 4;
}

kvi_status kvi__llama_state_write_header(void *state, size_t size, const kvi_model *model,
                                         const kvi_llama_state_spec *spec, const char *fn) {
  plan p;
  kvi_status st = make_plan(&p, model, spec, fn);
  if (st) return st;
  if (!state) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "state is NULL");
  if (size < p.size)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the state needs %zu bytes, the buffer has %zu", p.size, size);
  const kvi_llama_state_spec *s = &p.s;
  if (s->positions)
    for (int32_t i = 0; i < s->num_cells; i++)
      if (s->positions[i] < 0)
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "spec->positions[%d] is %d, expected >= 0", (int)i,
                         (int)s->positions[i]);
  uint8_t *w = state;
  w = put32(w, KVI_LLAMA_STATE_MAGIC);
  w = put32(w, (uint32_t)s->seq_id);
  w = put32(w, (uint32_t)s->num_streams);
  for (int32_t k = 0; k < s->num_streams; k++) {
    if (k != s->stream) {
      w = put32(w, 0);
      continue;
    }
    w = put32(w, (uint32_t)s->num_cells);
    for (int32_t i = 0; i < s->num_cells; i++) {
      w = put32(w, (uint32_t)(s->positions ? s->positions[i] : s->start_position + i));
      w = put32(w, 1);
      w = put32(w, (uint32_t)s->seq_id);
    }
    w = put32(w, (uint32_t)s->v_trans);
    w = put32(w, (uint32_t)p.L);
    const uint32_t type = (uint32_t)ggml_type_of(s->dtype);
    for (int plane = 0; plane < 2; plane++)
      for (int32_t l = 0; l < p.L; l++) {
        w = put32(w, type);
        if (plane == 1 && s->v_trans) {
          w = put32(w, (uint32_t)p.es);
          w = put32(w, (uint32_t)p.row);
        } else {
          const uint64_t rb = p.row_bytes;
          memcpy(w, &rb, 8);
          w += 8;
        }
        w += p.layer_bytes - LAYER_HEADER_BYTES; /* the data, left to the caller */
      }
  }
  return KVI_OK;
}

/* ---- RoPE ---------------------------------------------------------------- */

kvi_status kvi__llama_rope_table(float *out, int32_t positions, int32_t rotary_dim, float freq_base, float freq_scale,
                                 const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  if (positions < 1 || rotary_dim < 2 || rotary_dim % 2)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "positions %d must be >= 1, rotary_dim %d even and >= 2",
                     (int)positions, (int)rotary_dim);
  if (!(isfinite(freq_base) && freq_base > 0 && isfinite(freq_scale) && freq_scale > 0))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "freq_base %g and freq_scale %g must be finite and > 0",
                     (double)freq_base, (double)freq_scale);
  const int32_t half = rotary_dim / 2;
  const float theta_scale = powf(freq_base, -2.0f / (float)rotary_dim);
  for (int32_t p = 0; p < positions; p++) {
    float *row = out + (size_t)p * (size_t)rotary_dim;
    float theta = (float)p;
    for (int32_t i = 0; i < half; i++) {
      const float a = freq_scale * theta;
      row[i] = cosf(a);
      row[half + i] = sinf(a);
      theta *= theta_scale;
    }
  }
  return KVI_OK;
}
