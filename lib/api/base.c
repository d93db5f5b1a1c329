/*
 * Entry points of the base part: status strings and the last error, element
 * sizes, views, and the model (kvinject/status.h, types.h, model.h). None of
 * them touches a device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"

KVI_API const char *kvi_status_string(kvi_status status) { return kvi__status_string(status); }

KVI_API const char *kvi_last_error(void) { return kvi__last_error(); }

KVI_API size_t kvi_dtype_size(kvi_dtype dtype) { return kvi__dtype_size(dtype); }

KVI_API kvi_status kvi_kv_view_init(kvi_kv_view *view, size_t size) {
  static const kvi_kv_view d = KVI_KV_VIEW_INIT;
  return kvi__init_struct(view, size, &d, sizeof d, KVI__KV_VIEW_V1, "kvi_kv_view_init");
}

KVI_API void kvi_kv_view_contiguous(kvi_kv_view *view, kvi_memory memory, kvi_dtype dtype, int32_t num_layers,
                                    int32_t num_tokens, int32_t num_heads, int32_t head_size, void *k, void *v) {
  kvi__kv_view_contiguous(view, memory, dtype, num_layers, num_tokens, num_heads, head_size, k, v);
}

KVI_API kvi_status kvi_model_options_init(kvi_model_options *opts, size_t size) {
  static const kvi_model_options d = KVI_MODEL_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__MODEL_OPTIONS_V1, "kvi_model_options_init");
}

KVI_API kvi_status kvi_rope_spec_init(kvi_rope_spec *spec, size_t size) {
  static const kvi_rope_spec d = KVI_ROPE_SPEC_INIT;
  return kvi__init_struct(spec, size, &d, sizeof d, KVI__ROPE_SPEC_V1, "kvi_rope_spec_init");
}

KVI_API kvi_status kvi_model_create(kvi_model **out, const kvi_model_options *opts) {
  return kvi__model_create(out, opts, "kvi_model_create");
}

KVI_API void kvi_model_destroy(kvi_model *model) { kvi__model_destroy(model); }

KVI_API kvi_status kvi_model_info_get(const kvi_model *model, kvi_model_info *out) {
  return kvi__model_info_get(model, out, "kvi_model_info_get");
}

KVI_API kvi_status kvi_model_set_rope(kvi_model *model, int32_t layer, const kvi_rope_spec *spec) {
  return kvi__model_set_rope(model, layer, spec, "kvi_model_set_rope");
}

KVI_API kvi_status kvi_model_get_rope(const kvi_model *model, int32_t layer, kvi_rope_spec *out) {
  return kvi__model_get_rope(model, layer, out, "kvi_model_get_rope");
}

KVI_API kvi_status kvi_model_rope_cos_sin(const kvi_model *model, int32_t layer, int32_t pos, int32_t pair,
                                          float *out_cos, float *out_sin) {
  return kvi__model_rope_cos_sin(model, layer, pos, pair, out_cos, out_sin, "kvi_model_rope_cos_sin");
}
