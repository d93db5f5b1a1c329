/*
 * libkvinject — the xfer part (lib/xfer/): the resolved form of a cache
 * layout (cache.c), and the injector's host planning that tests/internal
 * reaches (transfer.c).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_XFER_H
#define KVI_XFER_H

#include <stdbool.h>
#include <stdint.h>

#include "gpu/gpu.h"
#include "gpu/kernels.h"
#include "kvinject/inject.h"
#include "store/store.h"

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

/* ---- the injector (transfer.c) ---------------------------------------------- */

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

/* The injection planner's step for one request (plan_request): appends
 * request v->nreqs, whose job is `tokens` tokens at sequence slots
 * first_slot.. through `table` (table_len entries; host memory when
 * table_on_host); a host table's slice for those slots is copied to
 * v->tables at v->ntables, a device table referenced. Returns the request's
 * index. The arrays must have room. */
int32_t kvi__plan_request_into(const kvi_injector *injector, kvi__plan_view *v, const int32_t *table,
                               int32_t table_len, bool table_on_host, int64_t first_slot, int64_t tokens);

/* The injection planner's step for one fact (plan_run): appends the
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
