/*
 * The store's copies between a dense view (host or device memory) and a
 * fact's pages: the CPU's (the reference), the CUDA kernels' and the copy
 * stream's through pinned staging.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "store/store_impl.h"

/* ------------------------------------------------------------------------ */
/* CPU copies between a dense view and pages (the reference)                 */
/* ------------------------------------------------------------------------ */

/* Copies tokens [tok0, tok0 + ntok) (tok0 on a page boundary) between the
 * view and the pages whose addresses are pages[0..]. An fp8 store quantizes
 * each (page, layer, plane, head) group with its own scale (kernels.h);
 * `raw` (persist) moves e4m3 bytes as they are, with the pages' scales
 * at raw[(fact page index) * L * 2 * H + ...] (a view of the store's dtype). */
static void cpu_copy(const kvi_store *s, const kvi_kv_view *v, int32_t tok0, int32_t ntok, char *const *pages,
                     bool to_pages, float *raw) {
  const kvi__geom *g = &s->geom;
  const int32_t L = g->num_layers, H = g->local_heads, D = g->head_size, P = s->P;
  const size_t ve = kvi__dtype_size(v->dtype), pe = kvi__dtype_size(s->dtype);
  float row[1024]; /* head_size <= 1024 (model.c) */
  for (int32_t l = 0; l < L; l++)
    for (int kv = 0; kv < 2; kv++) {
      char *base = (char *)(kv ? v->v : v->k);
      for (int32_t h = 0; h < H; h++)
        for (int32_t t0 = 0; t0 < ntok; t0 += P) { /* one page's tokens */
          const int32_t n = ntok - t0 < P ? ntok - t0 : P, grp = (l * 2 + kv) * H + h;
#define VR(t) (base + (size_t)(l * v->layer_stride + (tok0 + t0 + (t)) * v->token_stride + h * v->head_stride) * ve)
#define PR(t) (pages[t0 / P] + (size_t)kvi__page_row_off(s, l, kv, h, t) * pe)
          float *scale = s->fp8 ? (float *)(pages[t0 / P] + s->scale_off) + grp : NULL;
          float *rscale = raw ? raw + ((size_t)(tok0 + t0) / (size_t)P * (size_t)(2 * L * H) + (size_t)grp) : NULL;
          if (!s->fp8 || raw) { /* plain conversion, or e4m3 bytes as they are */
            for (int32_t t = 0; t < n; t++)
              if (to_pages)
                kvi__convert(PR(t), s->dtype, VR(t), v->dtype, D);
              else
                kvi__convert(VR(t), v->dtype, PR(t), s->dtype, D);
            if (raw && to_pages) *scale = *rscale;
            else if (raw) *rscale = *scale;
          } else if (to_pages) {
            float amax = 0.0f;
            for (int32_t t = 0; t < n; t++) {
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              amax = kvi__fp8_amax(amax, row, D);
            }
            *scale = kvi__fp8_scale(amax);
            for (int32_t t = 0; t < n; t++) {
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              kvi__fp8_quantize((uint8_t *)PR(t), row, D, *scale);
            }
          } else {
            for (int32_t t = 0; t < n; t++) {
              kvi__fp8_dequantize(row, (const uint8_t *)PR(t), D, *scale);
              kvi__convert(VR(t), v->dtype, row, KVI_DTYPE_FP32, D);
            }
          }
#undef VR
#undef PR
        }
    }
}

/* ------------------------------------------------------------------------ */
/* CUDA copies                                                               */
/* ------------------------------------------------------------------------ */

/* Device view <-> pages, in launches of KVI__LAUNCH_PAGES pages. Pages of
 * the host tier are reached through their mapped device address. */
static kvi_status cuda_copy_device(const kvi_store *s, const kvi_kv_view *v, const uint32_t *pages,
                                   int32_t tokens, bool to_pages, struct CUstream_st *stream,
                                   const char *fn) {
  const bool host = page_on_host_tier(s, pages[0]);
  const uint32_t first = host ? s->pool.dev.npages : 0;
  kvi__copy_args a;
  memset(&a, 0, sizeof a);
  a.vk = v->k;
  a.vv = v->v;
  a.view_dtype = (int32_t)v->dtype;
  a.layer_stride = v->layer_stride;
  a.token_stride = v->token_stride;
  a.head_stride = v->head_stride;
  a.L = s->geom.num_layers;
  a.H = s->geom.local_heads;
  a.D = s->geom.head_size;
  a.pool = host ? s->pool.host_dev : s->pool.dev.base;
  a.page_dtype = (int32_t)s->dtype;
  a.P = s->P;
  a.page_elems = page_stride_elems(s);
  a.scale_off = (int64_t)s->scale_off;
  const uint32_t npages = pages_for(s, tokens);
  for (uint32_t p0 = 0; p0 < npages; p0 += KVI__LAUNCH_PAGES) {
    const uint32_t n = npages - p0 < KVI__LAUNCH_PAGES ? npages - p0 : KVI__LAUNCH_PAGES;
    a.count = (int32_t)n;
    a.token_first = (int32_t)p0 * s->P;
    a.num_tokens = tokens - a.token_first < (int32_t)n * s->P ? tokens - a.token_first : (int32_t)n * s->P;
    for (uint32_t i = 0; i < n; i++) a.pages[i] = pages[p0 + i] - first;
#ifdef KVI_HAVE_CUDA
    int e = to_pages ? kvi__cuda_view_to_pages(&a, stream) : kvi__cuda_pages_to_view(&a, stream);
    if (e) return kvi__cuda_error(e, fn, to_pages ? "view-to-pages kernel launch" : "pages-to-view kernel launch");
#else
    (void)stream, (void)to_pages;
    return kvi__fail(KVI_ERR_NOT_BUILT, fn, "libkvinject was built without CUDA");
#endif
  }
  return KVI_OK;
}

/* Host view <-> device pages through the pinned staging buffer, on the
 * store's copy stream; complete when this returns. Runs of consecutive page
 * ids move as one copy. */
static kvi_status cuda_copy_host(const kvi_store *s, const kvi_kv_view *v, const uint32_t *pages,
                                 int32_t tokens, bool to_pages, float *raw, const char *fn) {
  const uint32_t npages = pages_for(s, tokens);
  char *stage[KVI__LAUNCH_PAGES];
  kvi__ring_slot *sl = NULL; /* the ring's bookkeeping changes, not the store */
  kvi_status st = kvi__ring_acquire((kvi__ring *)&s->staging, (size_t)s->staging_pages * s->page_bytes, NULL, &sl, fn);
  for (uint32_t p0 = 0; p0 < npages && st == KVI_OK; p0 += s->staging_pages) {
    const uint32_t n = npages - p0 < s->staging_pages ? npages - p0 : s->staging_pages;
    const int32_t tok0 = (int32_t)p0 * s->P;
    const int32_t ntok = tokens - tok0 < (int32_t)n * s->P ? tokens - tok0 : (int32_t)n * s->P;
    for (uint32_t i = 0; i < n; i++) stage[i] = sl->host + (uint64_t)i * s->page_bytes;
    if (to_pages) cpu_copy(s, v, tok0, ntok, stage, true, raw);
    for (uint32_t i = 0; i < n && st == KVI_OK;) {
      uint32_t run = 1;
      while (i + run < n && pages[p0 + i + run] == pages[p0 + i] + run) run++;
      char *dev = page_addr(s, pages[p0 + i]);
      size_t bytes = (size_t)run * s->page_bytes;
      st = to_pages ? kvi__cuda_h2d(dev, stage[i], bytes, s->copy_stream, fn)
                    : kvi__cuda_d2h(stage[i], dev, bytes, s->copy_stream, fn);
      i += run;
    }
    kvi_status st2 = kvi__ring_record(sl, s->copy_stream, fn); /* staging is reused next round */
    if (st2 == KVI_OK) st2 = kvi__ring_wait(sl, fn);
    if (st == KVI_OK) st = st2;
    if (st == KVI_OK && !to_pages) cpu_copy(s, v, tok0, ntok, stage, false, raw);
  }
  return st;
}

kvi_status kvi__copy_fact(const kvi_store *s, const kvi_kv_view *v, const uint32_t *pages, int32_t tokens,
                          bool to_pages, float *raw, struct CUstream_st *stream, const char *fn) {
  const bool host_tier = s->backend == KVI_BACKEND_CUDA && page_on_host_tier(s, pages[0]);
  if (host_tier && v->memory == KVI_MEMORY_HOST && !to_pages && kvi__tier_move_outstanding(s)) {
    /* a demotion may still be writing these pages */
    kvi_status st = kvi__events_sync((kvi__events *)&s->track, s->tier.move_seq, fn);
    if (st) return st;
  }
  if (s->backend == KVI_BACKEND_CPU || (host_tier && v->memory == KVI_MEMORY_HOST)) {
    /* host pages (a CPU store's, or a free or settled host-tier page): the CPU copies */
    uint32_t npages = pages_for(s, tokens);
    char **addr = malloc(npages * sizeof *addr);
    if (!addr) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %u page addresses", npages);
    for (uint32_t i = 0; i < npages; i++) addr[i] = page_addr(s, pages[i]);
    cpu_copy(s, v, 0, tokens, addr, to_pages, raw);
    free(addr);
    return KVI_OK;
  }
  if (v->memory == KVI_MEMORY_DEVICE) {
    if (raw) return kvi__fail(KVI_ERR_INTERNAL, fn, "raw fp8 copies take host views");
    return cuda_copy_device(s, v, pages, tokens, to_pages, stream, fn);
  }
  return cuda_copy_host(s, v, pages, tokens, to_pages, raw, fn);
}

kvi_status kvi__store_write_pages(kvi_store *s, const uint32_t *pages, const kvi_kv_view *v, const float *scales,
                                  struct CUstream_st *stream, const char *fn) {
  return kvi__copy_fact(s, v, pages, v->num_tokens, true, (float *)scales, stream, fn);
}

kvi_status kvi__store_read_pages(const kvi_store *s, const uint32_t *pages, int32_t tokens, const kvi_kv_view *host,
                                 float *scales, const char *fn) {
  return kvi__copy_fact(s, host, pages, tokens, false, scales, NULL, fn);
}
