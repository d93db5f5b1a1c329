/*
 * kvi_model: geometry, tensor-parallel head slice, per-layer RoPE spec.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/base.h"

static kvi_status geom_from_options(kvi__geom *g, const kvi_model_options *o, const char *fn) {
  if (o->num_layers < 1 || o->num_layers > 65536)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_layers is %d, expected 1..65536",
                     (int)o->num_layers);
  if (o->num_kv_heads < 1 || o->num_kv_heads > 65536)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_kv_heads is %d, expected 1..65536",
                     (int)o->num_kv_heads);
  if (o->head_size < 1 || o->head_size > 1024)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "head_size is %d, expected 1..1024",
                     (int)o->head_size);
  if (o->tp_size < 1 || o->tp_size > 65536)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "tp_size is %d, expected 1..65536",
                     (int)o->tp_size);
  if (o->tp_rank < 0 || o->tp_rank >= o->tp_size)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "tp_rank is %d, expected 0..%d",
                     (int)o->tp_rank, (int)o->tp_size - 1);
  int32_t H = o->num_kv_heads, tp = o->tp_size, r = o->tp_rank;
  g->num_layers = o->num_layers;
  g->num_kv_heads = H;
  g->head_size = o->head_size;
  g->tp_rank = r;
  g->tp_size = tp;
  if (tp <= H && H % tp != 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "tp_size %d does not divide num_kv_heads %d", (int)tp, (int)H);
  if (tp > H && tp % H != 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_kv_heads %d does not divide tp_size %d", (int)H, (int)tp);
  g->head_replicas = tp <= H ? 1 : tp / H;
  kvi__geom_rank_heads(g, r, &g->head_first, &g->local_heads);
  return KVI_OK;
}

void kvi__geom_rank_heads(const kvi__geom *g, int32_t rank, int32_t *first, int32_t *count) {
  if (g->tp_size <= g->num_kv_heads) {
    *count = g->num_kv_heads / g->tp_size;
    *first = rank * *count;
  } else {
    *count = 1;
    *first = rank / (g->tp_size / g->num_kv_heads);
  }
}

kvi_status kvi__model_create(kvi_model **out, const kvi_model_options *opts, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  if (!opts) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts is NULL (the geometry has no defaults)");
  kvi_model_options o = KVI_MODEL_OPTIONS_INIT;
  kvi_status st = kvi__read_struct(&o, sizeof o, opts, KVI__MODEL_OPTIONS_V1, fn, "opts");
  if (st) return st;
  kvi__geom g;
  if ((st = geom_from_options(&g, &o, fn))) return st;
  kvi_model *m = calloc(1, sizeof *m);
  kvi__rope *rope = calloc((size_t)g.num_layers, sizeof *rope);
  if (!m || !rope) {
    free(m);
    free(rope);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a model of %d layers", (int)g.num_layers);
  }
  kvi_rope_spec none = KVI_ROPE_SPEC_INIT;
  none.style = KVI_ROPE_NONE;
  for (int32_t l = 0; l < g.num_layers; l++) {
    kvi__rope_resolve(&rope[l], &none, g.head_size, fn);
    rope[l].unset = true; /* rotates as NONE would, but injection and capture refuse it */
  }
  m->geom = g;
  m->rope = rope;
  *out = m;
  return KVI_OK;
}

void kvi__model_destroy(kvi_model *model) {
  if (!model) return;
  for (int32_t l = 0; l < model->geom.num_layers; l++) kvi__rope_release(&model->rope[l]);
  free(model->rope);
  free(model);
}

kvi_status kvi__model_info_get(const kvi_model *model, kvi_model_info *out, const char *fn) {
  if (!model || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", model ? "out" : "model");
  const kvi__geom *g = &model->geom;
  kvi_model_info full = {sizeof full,      g->num_layers,  g->num_kv_heads,
                         g->head_size,     g->tp_rank,     g->tp_size,
                         g->head_first,    g->local_heads, g->head_replicas};
  return kvi__write_struct(out, &full, sizeof full, KVI__MODEL_INFO_V1, fn, "out");
}

kvi_status kvi__model_set_rope(kvi_model *model, int32_t layer, const kvi_rope_spec *spec, const char *fn) {
  if (!model || !spec) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", model ? "spec" : "model");
  const kvi__geom *g = &model->geom;
  if (layer < -1 || layer >= g->num_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, expected -1 (all) or 0..%d",
                     (int)layer, (int)g->num_layers - 1);
  const int32_t lo = layer < 0 ? 0 : layer, hi = layer < 0 ? g->num_layers : layer + 1;
  /* Resolve once, then give each layer its own copy (tables are shared);
   * every allocation happens before any layer changes. */
  kvi__rope r;
  kvi_status st = kvi__rope_resolve(&r, spec, g->head_size, fn);
  if (st) return st;
  kvi__rope *copies = calloc((size_t)(hi - lo), sizeof *copies);
  if (!copies) {
    kvi__rope_release(&r);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating RoPE for %d layers", (int)(hi - lo));
  }
  for (int32_t l = lo; l < hi && st == KVI_OK; l++) st = kvi__rope_copy(&copies[l - lo], &r, fn);
  kvi__rope_release(&r);
  if (st) {
    for (int32_t l = lo; l < hi; l++) kvi__rope_release(&copies[l - lo]);
    free(copies);
    return st;
  }
  for (int32_t l = lo; l < hi; l++) {
    kvi__rope_release(&model->rope[l]);
    model->rope[l] = copies[l - lo];
  }
  free(copies);
  return KVI_OK;
}

kvi_status kvi__model_get_rope(const kvi_model *model, int32_t layer, kvi_rope_spec *out, const char *fn) {
  if (!model || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", model ? "out" : "model");
  if (layer < 0 || layer >= model->geom.num_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, expected 0..%d", (int)layer,
                     (int)model->geom.num_layers - 1);
  const kvi__rope *r = &model->rope[layer];
  kvi_rope_spec full = r->spec;
  full.struct_size = sizeof full;
  if (r->unset) full.style = KVI_ROPE_UNSET;
  if (r->table) {
    full.cos_sin_table = r->table->data;
    full.table_dtype = KVI_DTYPE_FP32;
    full.table_positions = r->table->positions;
  }
  return kvi__write_struct(out, &full, sizeof full, KVI__ROPE_SPEC_V1, fn, "out");
}

kvi_status kvi__model_rope_cos_sin(const kvi_model *model, int32_t layer, int32_t pos, int32_t pair, float *out_cos,
                                   float *out_sin, const char *fn) {
  if (!model || !out_cos || !out_sin)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !model ? "model" : !out_cos ? "out_cos" : "out_sin");
  if (layer < 0 || layer >= model->geom.num_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, expected 0..%d", (int)layer,
                     (int)model->geom.num_layers - 1);
  const kvi__rope *r = &model->rope[layer];
  if (r->style == KVI_ROPE_NONE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer %d has no RoPE%s", (int)layer,
                     r->unset ? " (it was never set: kvi_model_set_rope)" : "");
  if (pair < 0 || pair >= r->rotary_dim / 2)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "pair is %d, expected 0..%d", (int)pair, (int)r->rotary_dim / 2 - 1);
  if (pos < 0 || pos >= kvi__rope_max_positions(r))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "position %d is outside 0..%d", (int)pos,
                     (int)kvi__rope_max_positions(r) - 1);
  kvi__rope_cs(r, pos, pair, out_cos, out_sin);
  return KVI_OK;
}
