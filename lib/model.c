/*
 * kvi_model: geometry, tensor-parallel head slice, per-layer RoPE spec.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Sizes of the first published versions of the structs: the minimum accepted. */
#define MODEL_OPTIONS_V1 sizeof(kvi_model_options)
#define MODEL_INFO_V1 sizeof(kvi_model_info)
#define ROPE_SPEC_V1 sizeof(kvi_rope_spec)

KVI_API void kvi_model_options_init(kvi_model_options *opts) {
  if (opts) {
    kvi_model_options d = KVI_MODEL_OPTIONS_INIT;
    *opts = d;
  }
}

KVI_API void kvi_rope_spec_init(kvi_rope_spec *spec) {
  if (spec) {
    kvi_rope_spec d = KVI_ROPE_SPEC_INIT;
    *spec = d;
  }
}

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
  if (tp <= H) {
    if (H % tp != 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "tp_size %d does not divide num_kv_heads %d", (int)tp, (int)H);
    g->local_heads = H / tp;
    g->head_first = r * g->local_heads;
    g->head_replicas = 1;
  } else {
    if (tp % H != 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "num_kv_heads %d does not divide tp_size %d", (int)H, (int)tp);
    g->head_replicas = tp / H;
    g->local_heads = 1;
    g->head_first = r / g->head_replicas;
  }
  return KVI_OK;
}

KVI_API kvi_status kvi_model_create(kvi_model **out, const kvi_model_options *opts) {
  static const char fn[] = "kvi_model_create";
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  if (!opts) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts is NULL (the geometry has no defaults)");
  kvi_model_options o = KVI_MODEL_OPTIONS_INIT;
  kvi_status st = kvi__read_struct(&o, sizeof o, opts, MODEL_OPTIONS_V1, fn, "opts");
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
  for (int32_t l = 0; l < g.num_layers; l++) rope[l].style = KVI_ROPE_NONE;
  m->geom = g;
  m->rope = rope;
  *out = m;
  return KVI_OK;
}

KVI_API void kvi_model_destroy(kvi_model *model) {
  if (!model) return;
  free(model->rope);
  free(model);
}

KVI_API kvi_status kvi_model_info_get(const kvi_model *model, kvi_model_info *out) {
  static const char fn[] = "kvi_model_info_get";
  if (!model || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", model ? "out" : "model");
  const kvi__geom *g = &model->geom;
  kvi_model_info full = {sizeof full,      g->num_layers,  g->num_kv_heads,
                         g->head_size,     g->tp_rank,     g->tp_size,
                         g->head_first,    g->local_heads, g->head_replicas};
  return kvi__write_struct(out, &full, sizeof full, MODEL_INFO_V1, fn, "out");
}

KVI_API kvi_status kvi_model_set_rope(kvi_model *model, int32_t layer, const kvi_rope_spec *spec) {
  static const char fn[] = "kvi_model_set_rope";
  if (!model || !spec) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", model ? "spec" : "model");
  const kvi__geom *g = &model->geom;
  if (layer < -1 || layer >= g->num_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, expected -1 (all) or 0..%d",
                     (int)layer, (int)g->num_layers - 1);
  kvi_rope_spec s = KVI_ROPE_SPEC_INIT;
  kvi_status st = kvi__read_struct(&s, sizeof s, spec, ROPE_SPEC_V1, fn, "spec");
  if (st) return st;
  kvi__rope r = {s.style, 0, 0.0};
  switch (s.style) {
  case KVI_ROPE_NONE: break;
  case KVI_ROPE_NEOX:
  case KVI_ROPE_GPTJ:
    r.rotary_dim = s.rotary_dim ? s.rotary_dim : g->head_size;
    if (r.rotary_dim < 2 || r.rotary_dim > g->head_size || r.rotary_dim % 2)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "rotary_dim is %d, expected an even number in 2..head_size (%d), or 0",
                       (int)s.rotary_dim, (int)g->head_size);
    if (!isfinite(s.theta) || !(s.theta > 0.0))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "theta is %g, expected a finite value > 0", s.theta);
    r.theta = s.theta;
    break;
  default:
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "unknown RoPE style %d", (int)s.style);
  }
  int32_t lo = layer < 0 ? 0 : layer, hi = layer < 0 ? g->num_layers : layer + 1;
  for (int32_t l = lo; l < hi; l++) model->rope[l] = r;
  return KVI_OK;
}

KVI_API kvi_status kvi_model_get_rope(const kvi_model *model, int32_t layer, kvi_rope_spec *out) {
  static const char fn[] = "kvi_model_get_rope";
  if (!model || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", model ? "out" : "model");
  if (layer < 0 || layer >= model->geom.num_layers)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, expected 0..%d", (int)layer,
                     (int)model->geom.num_layers - 1);
  const kvi__rope *r = &model->rope[layer];
  kvi_rope_spec full = {sizeof full, r->style, r->rotary_dim, r->theta};
  return kvi__write_struct(out, &full, sizeof full, ROPE_SPEC_V1, fn, "out");
}
