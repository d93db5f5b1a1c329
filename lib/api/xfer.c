/*
 * Entry points of the xfer part: cache layouts, injectors and encoders
 * (inject, capture, retrieve and inject, batched calls), the recompute plan,
 * and llama.cpp states (kvinject/cache.h, inject.h, recompute.h, llama.h).
 * Injectors and encoders run on their store's device; the calls that only
 * read host state (kvi_inject_plan, kvi_injector_async_errors), the
 * layouts, the recompute plan and the llama.cpp states touch no device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"
#include "xfer/xfer.h"

/* ---- cache layouts (kvinject/cache.h) ------------------------------------ */

KVI_API kvi_status kvi_cache_layout_init(kvi_cache_layout *layout, size_t size) {
  static const kvi_cache_layout d = KVI_CACHE_LAYOUT_INIT;
  return kvi__init_struct(layout, size, &d, sizeof d, KVI__CACHE_LAYOUT_V1, "kvi_cache_layout_init");
}

KVI_API kvi_status kvi_cache_layout_preset(kvi_cache_layout *out, kvi_cache_preset preset, kvi_dtype dtype,
                                           int32_t num_layers, int32_t num_heads, int32_t head_size,
                                           int32_t block_size, int64_t num_blocks, void *const *k_layers,
                                           void *const *v_layers, void *base) {
  return kvi__cache_layout_preset(out, preset, dtype, num_layers, num_heads, head_size, block_size, num_blocks,
                                  k_layers, v_layers, base, "kvi_cache_layout_preset");
}

/* ---- injectors and encoders (kvinject/inject.h) --------------------------- */

KVI_API kvi_status kvi_transfer_options_init(kvi_transfer_options *opts, size_t size) {
  static const kvi_transfer_options d = KVI_TRANSFER_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__TRANSFER_OPTIONS_V1, "kvi_transfer_options_init");
}

KVI_API kvi_status kvi_inject_request_init(kvi_inject_request *req, size_t size) {
  static const kvi_inject_request d = KVI_INJECT_REQUEST_INIT;
  return kvi__init_struct(req, size, &d, sizeof d, KVI__INJECT_REQUEST_V1, "kvi_inject_request_init");
}

KVI_API kvi_status kvi_inject_options_init(kvi_inject_options *opts, size_t size) {
  static const kvi_inject_options d = KVI_INJECT_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__INJECT_OPTIONS_V1, "kvi_inject_options_init");
}

KVI_API kvi_status kvi_capture_init(kvi_capture *cap, size_t size) {
  static const kvi_capture d = KVI_CAPTURE_INIT;
  return kvi__init_struct(cap, size, &d, sizeof d, KVI__CAPTURE_V1, "kvi_capture_init");
}

KVI_API kvi_status kvi_encode_batch_init(kvi_encode_batch *batch, size_t size) {
  static const kvi_encode_batch d = KVI_ENCODE_BATCH_INIT;
  return kvi__init_struct(batch, size, &d, sizeof d, KVI__ENCODE_BATCH_V1, "kvi_encode_batch_init");
}

KVI_API kvi_status kvi_retrieve_request_init(kvi_retrieve_request *req, size_t size) {
  static const kvi_retrieve_request d = KVI_RETRIEVE_REQUEST_INIT;
  return kvi__init_struct(req, size, &d, sizeof d, KVI__RETRIEVE_REQUEST_V1, "kvi_retrieve_request_init");
}

KVI_API kvi_status kvi_inject_batch_init(kvi_inject_batch *batch, size_t size) {
  static const kvi_inject_batch d = KVI_INJECT_BATCH_INIT;
  return kvi__init_struct(batch, size, &d, sizeof d, KVI__INJECT_BATCH_V1, "kvi_inject_batch_init");
}

KVI_API kvi_status kvi_injector_create(kvi_injector **out, kvi_store *store, const kvi_cache_layout *layout,
                                       const kvi_transfer_options *opts) {
  static const char fn[] = "kvi_injector_create";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__injector_create(out, store, layout, opts, fn));
  return st;
}

KVI_API void kvi_injector_destroy(kvi_injector *injector) {
  if (!injector) return;
  bool ok;
  KVI__API_DESTROY(kvi__injector_device(injector), "kvi_injector_destroy", ok, kvi__injector_destroy(injector, ok));
}

KVI_API kvi_status kvi_encoder_create(kvi_encoder **out, kvi_store *store, const kvi_cache_layout *layout,
                                      const kvi_transfer_options *opts) {
  static const char fn[] = "kvi_encoder_create";
  kvi_status st;
  KVI__API_ON(st, kvi__store_device(store), fn, kvi__encoder_create(out, store, layout, opts, fn));
  return st;
}

KVI_API void kvi_encoder_destroy(kvi_encoder *encoder) {
  if (!encoder) return;
  bool ok;
  KVI__API_DESTROY(kvi__encoder_device(encoder), "kvi_encoder_destroy", ok, kvi__encoder_destroy(encoder, ok));
}

KVI_API kvi_status kvi_inject(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                              const kvi_inject_options *opts, struct CUstream_st *stream) {
  static const char fn[] = "kvi_inject";
  kvi_status st;
  KVI__API_ON(st, kvi__injector_device(injector), fn, kvi__inject(injector, reqs, num_requests, opts, stream, fn));
  return st;
}

KVI_API kvi_status kvi_inject_deviation(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                                        int32_t layer, float *out_scores, int64_t num_scores, kvi_memory out_memory,
                                        struct CUstream_st *stream) {
  static const char fn[] = "kvi_inject_deviation";
  if (!injector)
    return kvi__inject_deviation(injector, reqs, num_requests, layer, out_scores, num_scores, out_memory, stream, fn);
  kvi_status st;
  KVI__API_ON(st, kvi__injector_device(injector), fn,
              kvi__inject_deviation(injector, reqs, num_requests, layer, out_scores, num_scores, out_memory, stream,
                                    fn));
  return st;
}

KVI_API kvi_status kvi_inject_plan(const kvi_injector *injector, uint64_t tenant, const uint64_t *fact_ids,
                                   int32_t num_facts, int64_t *out_tokens) {
  return kvi__inject_plan(injector, tenant, fact_ids, num_facts, out_tokens, "kvi_inject_plan");
}

KVI_API kvi_status kvi_injector_async_errors(kvi_injector *injector, int64_t *out_count) {
  return kvi__injector_async_errors(injector, out_count, "kvi_injector_async_errors");
}

KVI_API kvi_status kvi_encode(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures,
                              struct CUstream_st *stream) {
  static const char fn[] = "kvi_encode";
  kvi_status st;
  KVI__API_ON(st, kvi__encoder_device(encoder), fn, kvi__encode(encoder, caps, num_captures, stream, fn));
  return st;
}

KVI_API kvi_status kvi_encode_batched(kvi_encoder *encoder, const kvi_encode_batch *batch, struct CUstream_st *stream) {
  static const char fn[] = "kvi_encode_batched";
  kvi_status st;
  KVI__API_ON(st, kvi__encoder_device(encoder), fn, kvi__encode_batched(encoder, batch, stream, fn));
  return st;
}

KVI_API kvi_status kvi_retrieve_inject(kvi_injector *injector, const void *queries, int32_t num_queries, int32_t dim,
                                       const kvi_retrieve_request *reqs, int32_t k, const kvi_search_options *opts,
                                       uint64_t *out_ids, int32_t *out_counts, int32_t *out_tokens,
                                       struct CUstream_st *stream) {
  static const char fn[] = "kvi_retrieve_inject";
  if (!injector)
    return kvi__retrieve_inject(injector, queries, num_queries, dim, reqs, k, opts, out_ids, out_counts, out_tokens,
                                stream, fn);
  kvi_status st;
  KVI__API_ON(st, kvi__injector_device(injector), fn,
              kvi__retrieve_inject(injector, queries, num_queries, dim, reqs, k, opts, out_ids, out_counts,
                                   out_tokens, stream, fn));
  return st;
}

KVI_API kvi_status kvi_inject_batched(kvi_injector *injector, const kvi_inject_batch *batch,
                                      const kvi_inject_options *opts, struct CUstream_st *stream) {
  static const char fn[] = "kvi_inject_batched";
  kvi_status st;
  KVI__API_ON(st, kvi__injector_device(injector), fn, kvi__inject_batched(injector, batch, opts, stream, fn));
  return st;
}

/* ---- the recompute plan (kvinject/recompute.h) --------------------------- */

KVI_API kvi_status kvi_recompute_options_init(kvi_recompute_options *opts, size_t size) {
  static const kvi_recompute_options d = KVI_RECOMPUTE_OPTIONS_INIT;
  return kvi__init_struct(opts, size, &d, sizeof d, KVI__RECOMPUTE_OPTIONS_V1, "kvi_recompute_options_init");
}

KVI_API kvi_status kvi_recompute_select(const float *scores, const int32_t *fact_tokens, int32_t num_facts,
                                        const kvi_recompute_options *opts, int32_t *out_index, int64_t capacity,
                                        int64_t *out_count) {
  return kvi__recompute_select(scores, fact_tokens, num_facts, opts, out_index, capacity, out_count,
                               "kvi_recompute_select");
}

/* ---- llama.cpp states (kvinject/llama.h) ---------------------------------- */

KVI_API kvi_status kvi_llama_state_spec_init(kvi_llama_state_spec *spec, size_t size) {
  static const kvi_llama_state_spec d = KVI_LLAMA_STATE_SPEC_INIT;
  return kvi__init_struct(spec, size, &d, sizeof d, KVI__LLAMA_STATE_SPEC_V1, "kvi_llama_state_spec_init");
}

KVI_API kvi_status kvi_llama_state_parse(const void *state, size_t size, kvi_llama_state_info *out) {
  return kvi__llama_state_parse(state, size, out, "kvi_llama_state_parse");
}

KVI_API kvi_status kvi_llama_state_layout(void *state, size_t size, int32_t section, const kvi_model *model,
                                          kvi_memory memory, kvi_cache_layout *out) {
  return kvi__llama_state_layout(state, size, section, model, memory, out, "kvi_llama_state_layout");
}

KVI_API kvi_status kvi_llama_state_positions(const void *state, size_t size, int32_t section, int32_t first_cell,
                                             int32_t num_cells, int32_t *out) {
  return kvi__llama_state_positions(state, size, section, first_cell, num_cells, out, "kvi_llama_state_positions");
}

KVI_API kvi_status kvi_llama_state_size(const kvi_model *model, const kvi_llama_state_spec *spec, size_t *out_size) {
  return kvi__llama_state_size(model, spec, out_size, "kvi_llama_state_size");
}

KVI_API kvi_status kvi_llama_state_write_header(void *state, size_t size, const kvi_model *model,
                                                const kvi_llama_state_spec *spec) {
  return kvi__llama_state_write_header(state, size, model, spec, "kvi_llama_state_write_header");
}

KVI_API kvi_status kvi_llama_rope_table(float *out, int32_t positions, int32_t rotary_dim, float freq_base,
                                        float freq_scale) {
  return kvi__llama_rope_table(out, positions, rotary_dim, freq_base, freq_scale, "kvi_llama_rope_table");
}
