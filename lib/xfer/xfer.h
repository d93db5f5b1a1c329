/*
 * libkvinject — the xfer part (lib/xfer/): the resolved form of a cache
 * layout (cache.c), injectors and encoders (injector.c, plan.c, execute.c,
 * inject.c, encode.c, retrieve.c, batched.c, whose shared insides are in
 * transfer.h), the recompute plan (recompute.c) and llama.cpp states
 * (llama_state.c): the internal twins of their entry points (lib/api/xfer.c),
 * and the injector's host planning that tests/internal reaches.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_XFER_H
#define KVI_XFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/gpu.h"
#include "gpu/kernels.h"
#include "kvinject/inject.h"
#include "kvinject/llama.h"
#include "kvinject/recompute.h"
#include "store/store.h"

/* ---- the entry points' internal twins --------------------------------------
 * Each kvi__<name> is kvi_<name> (kvinject/inject.h, cache.h, recompute.h,
 * llama.h) with the public name `fn` its errors are reported under; the
 * entry point has made the handle's device current (lib/api/api.h). */

/* First-version sizes of the public structs (their *_init and readers). */
#define KVI__TRANSFER_OPTIONS_V1 sizeof(kvi_transfer_options)
#define KVI__INJECT_REQUEST_V1 offsetof(kvi_inject_request, num_positions) /* the first layout */
#define KVI__INJECT_OPTIONS_V1 offsetof(kvi_inject_options, host_pages) /* the fields before the host tier came first */
#define KVI__CAPTURE_V1 offsetof(kvi_capture, token_ids) /* before the token ids */
#define KVI__ENCODE_BATCH_V1 offsetof(kvi_encode_batch, token_ids) /* before the token ids */
#define KVI__RETRIEVE_REQUEST_V1 sizeof(kvi_retrieve_request)
#define KVI__INJECT_BATCH_V1 offsetof(kvi_inject_batch, expect_token_ids) /* before the token ids */
#define KVI__CACHE_LAYOUT_V1 offsetof(kvi_cache_layout, dim_stride) /* before the per-plane strides */
#define KVI__RECOMPUTE_OPTIONS_V1 sizeof(kvi_recompute_options)
#define KVI__LLAMA_STATE_SPEC_V1 sizeof(kvi_llama_state_spec)

/* The CUDA device of an injector's / encoder's store, or -1 for a CPU store (and NULL). */
int kvi__injector_device(const kvi_injector *injector);
int kvi__encoder_device(const kvi_encoder *encoder);

/* kvi_injector_create / kvi_encoder_create. */
kvi_status kvi__injector_create(kvi_injector **out, kvi_store *store, const kvi_cache_layout *layout,
                                const kvi_transfer_options *opts, const char *fn);
kvi_status kvi__encoder_create(kvi_encoder **out, kvi_store *store, const kvi_cache_layout *layout,
                               const kvi_transfer_options *opts, const char *fn);
/* kvi_injector_destroy / kvi_encoder_destroy; device_ok false: the store's
 * device could not be made current, so only host memory is freed. */
void kvi__injector_destroy(kvi_injector *injector, bool device_ok);
void kvi__encoder_destroy(kvi_encoder *encoder, bool device_ok);
/* kvi_inject. */
kvi_status kvi__inject(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                       const kvi_inject_options *opts, struct CUstream_st *stream, const char *fn);
/* kvi_inject_deviation. */
kvi_status kvi__inject_deviation(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                                 int32_t layer, float *out_scores, int64_t num_scores, kvi_memory out_memory,
                                 struct CUstream_st *stream, const char *fn);
/* kvi_inject_plan (host only: no device). */
kvi_status kvi__inject_plan(const kvi_injector *injector, uint64_t tenant, const uint64_t *fact_ids, int32_t num_facts,
                            int64_t *out_tokens, const char *fn);
/* kvi_injector_async_errors (host only: no device). */
kvi_status kvi__injector_async_errors(kvi_injector *injector, int64_t *out_count, const char *fn);
/* kvi_encode. */
kvi_status kvi__encode(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures, struct CUstream_st *stream,
                       const char *fn);
/* kvi_encode_batched. */
kvi_status kvi__encode_batched(kvi_encoder *encoder, const kvi_encode_batch *batch, struct CUstream_st *stream,
                               const char *fn);
/* kvi_retrieve_inject. */
kvi_status kvi__retrieve_inject(kvi_injector *injector, const void *queries, int32_t num_queries, int32_t dim,
                                const kvi_retrieve_request *reqs, int32_t k, const kvi_search_options *opts,
                                uint64_t *out_ids, int32_t *out_counts, int32_t *out_tokens, struct CUstream_st *stream,
                                const char *fn);
/* kvi_inject_batched. */
kvi_status kvi__inject_batched(kvi_injector *injector, const kvi_inject_batch *batch, const kvi_inject_options *opts,
                               struct CUstream_st *stream, const char *fn);
/* kvi_cache_layout_preset (cache.c). */
kvi_status kvi__cache_layout_preset(kvi_cache_layout *out, kvi_cache_preset preset, kvi_dtype dtype, int32_t num_layers,
                                    int32_t num_heads, int32_t head_size, int32_t block_size, int64_t num_blocks,
                                    void *const *k_layers, void *const *v_layers, void *base, const char *fn);
/* kvi_recompute_select (recompute.c). */
kvi_status kvi__recompute_select(const float *scores, const int32_t *fact_tokens, int32_t num_facts,
                                 const kvi_recompute_options *opts, int32_t *out_index, int64_t capacity,
                                 int64_t *out_count, const char *fn);
/* kvi_llama_state_parse, _layout, _positions, _size, _write_header and
 * kvi_llama_rope_table (llama_state.c). */
kvi_status kvi__llama_state_parse(const void *state, size_t size, kvi_llama_state_info *out, const char *fn);
kvi_status kvi__llama_state_layout(void *state, size_t size, int32_t section, const kvi_model *model, kvi_memory memory,
                                   kvi_cache_layout *out, const char *fn);
kvi_status kvi__llama_state_positions(const void *state, size_t size, int32_t section, int32_t first_cell,
                                      int32_t num_cells, int32_t *out, const char *fn);
kvi_status kvi__llama_state_size(const kvi_model *model, const kvi_llama_state_spec *spec, size_t *out_size,
                                 const char *fn);
kvi_status kvi__llama_state_write_header(void *state, size_t size, const kvi_model *model,
                                         const kvi_llama_state_spec *spec, const char *fn);
kvi_status kvi__llama_rope_table(float *out, int32_t positions, int32_t rotary_dim, float freq_base, float freq_scale,
                                 const char *fn);

/* ---- cache layouts (cache.c) ------------------------------------------------ */

/* One plane's strides, in elements (defaults applied). */
typedef struct kvi__strides {
  int64_t block, token, head, dim;
} kvi__strides;

typedef struct kvi__cache {
  kvi_dtype dtype;
  kvi_memory memory;
  int32_t L, H, D, BS;
  int64_t NB;
  kvi__strides ks, vs;      /* K's and V's */
  char **k, **v;            /* per layer base addresses (bytes) */
  float *k_scale, *v_scale; /* L * H, 1.0 without scales */
} kvi__cache;

kvi_status kvi__cache_resolve(kvi__cache *c, const kvi_cache_layout *layout, const kvi__geom *g, bool cuda, int device,
                              const char *fn);
void kvi__cache_release(kvi__cache *c);

/* ---- the injector (injector.c, plan.c, execute.c, retrieve.c) -------------- */

/* The transfer kernel's layers per CTA (kvi__xfer_args.layers_per_cta) for
 * a launch of nsegs >= 1 segments over nl >= 1 layers on a device of `sms`
 * multiprocessors (<= 0: unknown, taken as 132): enough (segment, layer)
 * pairs per CTA to amortize its prologue, while leaving about 128 CTAs per
 * SM so the tail stays short; the nl layers are cut into
 * ceil(nl / result) chunks of nearly equal size. In 1..nl. */
int32_t kvi__layers_per_cta(int32_t sms, int32_t nsegs, int32_t nl);

/* The per-layer tables a CUDA injector uploads once, laid out in one buffer:
 * kvi__xlayer[L] at offset 0 (each layer's cache bases, RoPE style, rotated
 * width, attention factor, rope_id: the first layer whose rotation is the
 * same, and device addresses of its frequencies or table), the cache's K
 * scales [L][H] at *o_k, V scales at *o_v, then every formula layer's
 * rotary_dim/2 frequencies and every distinct engine cos/sin table (a table
 * that layers share is laid out once); all 16-byte aligned. host: the
 * buffer to fill (the returned size), or NULL for the size and offsets
 * only; dev: the device address it will be copied to (the layers' pointers
 * are computed from it, never dereferenced). Pure host code. */
size_t kvi__layer_tables(const kvi_store *s, const kvi__cache *c, char *host, char *dev, size_t *o_k, size_t *o_v);

/* What an injector chose when it was created (these never change): the
 * transfer kernel's vector width (kvi__xfer_args.vec: 16 for fp8 stores
 * whose layout allows 16-byte page loads, 8 where every cache row start is
 * aligned for 8-element vectors, else 1), its longest segment (tokens) and
 * the largest rotary_dim / 2 over the layers. */
int32_t kvi__injector_vec(const kvi_injector *injector);
int32_t kvi__injector_seg_tokens(const kvi_injector *injector);
int32_t kvi__injector_half_max(const kvi_injector *injector);

/* ---- the planners' view for tests/internal -------------------------------
 * A plan's host arrays as the kernels read them (kernels.h): segments,
 * requests, explicit positions (int32), host block-table slices (a
 * request's table_off is a byte offset from buf), and the caller's area
 * (ext: a device-planned call's kvi__rquery[nreqs]). */
typedef struct kvi__plan_view {
  kvi__xseg *segs;
  kvi__xreq *reqs;
  int32_t *positions;
  int32_t *tables; /* inside buf */
  char *buf;
  void *ext;
  int32_t nsegs, nreqs, ntok, ntables;
} kvi__plan_view;

/* The injection planner's step for one request (kvi__plan_request): appends
 * request v->nreqs, whose job is `tokens` tokens at sequence slots
 * first_slot.. through `table` (table_len entries; host memory when
 * table_on_host); a host table's slice for those slots is copied to
 * v->tables at v->ntables, a device table referenced. Returns the request's
 * index. The arrays must have room. */
int32_t kvi__plan_request_into(const kvi_injector *injector, kvi__plan_view *v, const int32_t *table,
                               int32_t table_len, bool table_on_host, int64_t first_slot, int64_t tokens);

/* The injection planner's step for one fact (kvi__plan_run): appends the
 * segments of `tokens` tokens held in `pages` (from the first page's start)
 * landing at sequence slots seq0.. of request r, none crossing a page nor
 * longer than the injector's segment (kvi__injector_seg_tokens), to
 * v->segs at v->nsegs; with explicit `positions` (tokens int32 values, or
 * int64 with pos64) they are appended to v->positions at v->ntok, else the
 * tokens sit at start_position on. The arrays must have room: at most
 * kvi__plan_segs_for(npages) segments for a fact of npages pages. */
void kvi__plan_run_into(const kvi_injector *injector, kvi__plan_view *v, int32_t r, int64_t seq0, int64_t tokens,
                        const void *positions, bool pos64, int32_t start_position, const uint32_t *pages);
int64_t kvi__plan_segs_for(const kvi_injector *injector, int64_t npages);

/* The device path of kvi_retrieve_inject up to its plan (retr_prepare, both
 * locks held as that call holds them): each request's reserve checked, and
 * the plan laid out with nres * spf segments reserved per request (left for
 * the retrieve-plan kernel to fill) and its kvi__rquery in *out's ext.
 * Requests are read as given (struct_size and flags are the caller's
 * checks). *out is written in any case: on failure it must hold no buffer.
 * Free with kvi__plan_view_free. CPU injectors only (their plans are in
 * host memory; their tenants have no directory: dir NULL). */
kvi_status kvi__retrieve_prepare(kvi_injector *injector, const kvi_retrieve_request *reqs, int32_t nq, int32_t k,
                                 kvi__plan_view *out);
void kvi__plan_view_free(kvi_injector *injector, kvi__plan_view *v);

#endif
