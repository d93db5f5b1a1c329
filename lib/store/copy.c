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

/* A page's scales between the page and r, where they lie as files keep them
 * (s->scale_bytes): fp8 the scales then the key offsets back to back (the
 * page pads the scales to 16 bytes), q4 the words as they are. */
static void raw_scales(const kvi_store *s, char *page, unsigned char *r, bool to_pages) {
  const size_t sc = s->fp8 ? (size_t)s->geom.num_layers * 2u * (size_t)s->geom.local_heads * 4u : (size_t)s->scale_bytes;
  char *at[2] = {page + s->scale_off, (char *)page_key_offsets(s, page)};
  const size_t n[2] = {sc, (size_t)s->scale_bytes - sc}, off[2] = {0, sc};
  for (int i = 0; i < 2; i++)
    if (to_pages) memcpy(at[i], r + off[i], n[i]);
    else memcpy(r + off[i], at[i], n[i]);
}

/* Copies tokens [tok0, tok0 + ntok) (tok0 on a page boundary) between the
 * view and the pages whose addresses are pages[0..]. A quantized store
 * quantizes each group with its own scale: fp8 a (page, layer, plane, head)
 * group, keys with their channels' offsets (base/fp8.h), q4 a key channel or a value token of a page's head
 * (base/q4.h). `raw` (persist) moves stored elements as they are (a view of
 * the store's dtype; q4: strides in 4-bit elements), with each page's
 * scales, s->scale_bytes of them, at raw + (fact page index) * scale_bytes. */
static void cpu_copy(const kvi_store *s, const kvi_kv_view *v, int32_t tok0, int32_t ntok, char *const *pages,
                     bool to_pages, unsigned char *raw) {
  const kvi__geom *g = &s->geom;
  const int32_t L = g->num_layers, H = g->local_heads, D = g->head_size, P = s->P;
  float row[1024], mk[1024]; /* head_size <= 1024 (model.c); mk: fp8 keys' offsets */
  uint32_t b[1024];
  for (int32_t t0 = 0; raw && t0 < ntok; t0 += P)
    raw_scales(s, pages[t0 / P], raw + (size_t)((tok0 + t0) / P) * (size_t)s->scale_bytes, to_pages);
  for (int32_t l = 0; l < L; l++)
    for (int kv = 0; kv < 2; kv++) {
      char *base = (char *)(kv ? v->v : v->k);
      for (int32_t h = 0; h < H; h++)
        for (int32_t t0 = 0; t0 < ntok; t0 += P) { /* one page's tokens */
          const int32_t n = ntok - t0 < P ? ntok - t0 : P, grp = (l * 2 + kv) * H + h;
#define VR(t)                                                                                                       \
  (base + kvi__dtype_bytes(v->dtype,                                                                               \
                           (uint64_t)(l * v->layer_stride + (tok0 + t0 + (t)) * v->token_stride + h * v->head_stride)))
#define PR(t) (pages[t0 / P] + kvi__dtype_bytes(s->dtype, (uint64_t)kvi__page_row_off(s, l, kv, h, t)))
          float *scale = s->fp8 ? (float *)(pages[t0 / P] + s->scale_off) + grp : NULL;
          uint32_t *kw = s->q4 ? (uint32_t *)(pages[t0 / P] + s->scale_off) + (size_t)(l * H + h) * (size_t)D : NULL;
          uint32_t *vw = s->q4 ? (uint32_t *)(pages[t0 / P] + s->scale_off) + (size_t)L * H * D +
                                     (size_t)(l * H + h) * (size_t)P
                               : NULL;
          if (raw && s->q4) { /* codes as they are */
            for (int32_t t = 0; t < n; t++)
              if (to_pages) memcpy(PR(t), VR(t), (size_t)D / 2u);
              else memcpy(VR(t), PR(t), (size_t)D / 2u);
          } else if (!s->scale_off || raw) { /* plain conversion, or e4m3 bytes as they are */
            for (int32_t t = 0; t < n; t++)
              if (to_pages)
                kvi__convert(PR(t), s->dtype, VR(t), v->dtype, D);
              else
                kvi__convert(VR(t), v->dtype, PR(t), s->dtype, D);
          } else if (s->q4 && to_pages && kv == 0) { /* keys: a group per channel over the page's tokens */
            for (int32_t d = 0; d < D; d++) b[d] = KVI__Q4_BOUNDS_EMPTY;
            for (int32_t t = 0; t < n; t++) {
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              for (int32_t d = 0; d < D; d++) b[d] = kvi__q4_fold(b[d], row[d]);
            }
            for (int32_t d = 0; d < D; d++) kw[d] = kvi__q4_params(b[d]);
            for (int32_t t = 0; t < n; t++) {
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              kvi__q4_pack_row((uint8_t *)PR(t), row, D, kw, 1);
            }
          } else if (s->q4 && to_pages) { /* values: a group per token; unused tokens' words zero */
            for (int32_t t = 0; t < P; t++) {
              if (t >= n) {
                vw[t] = 0u;
                continue;
              }
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              vw[t] = kvi__q4_params(kvi__q4_fold_row(KVI__Q4_BOUNDS_EMPTY, row, D));
              kvi__q4_pack_row((uint8_t *)PR(t), row, D, &vw[t], 0);
            }
          } else if (s->q4) {
            for (int32_t t = 0; t < n; t++) {
              kvi__q4_unpack_row(row, (const uint8_t *)PR(t), D, kv ? &vw[t] : kw, kv ? 0 : 1);
              kvi__convert(VR(t), v->dtype, row, KVI_DTYPE_FP32, D);
            }
          } else if (to_pages) { /* fp8: keys' offsets (their channels' bounds), amax, scale, bytes */
            const float *m = kv == 0 ? mk : NULL;
            if (kv == 0) {
              for (int32_t d = 0; d < D; d++) b[d] = KVI__Q4_BOUNDS_EMPTY;
              for (int32_t t = 0; t < n; t++) {
                kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
                for (int32_t d = 0; d < D; d++) b[d] = kvi__q4_fold(b[d], row[d]);
              }
              kvi__fp8_key_offsets(page_key_offsets(s, pages[t0 / P]) + (size_t)(l * H + h) * (size_t)D, mk, b, D);
            }
            float amax = 0.0f;
            for (int32_t t = 0; t < n; t++) {
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              amax = kvi__fp8_amax(amax, row, m, D);
            }
            *scale = kvi__fp8_scale(amax);
            for (int32_t t = 0; t < n; t++) {
              kvi__convert(row, KVI_DTYPE_FP32, VR(t), v->dtype, D);
              kvi__fp8_quantize((uint8_t *)PR(t), row, m, D, *scale);
            }
          } else {
            if (kv == 0) kvi__fp8_offsets_f32(mk, page_key_offsets(s, pages[t0 / P]) + (size_t)(l * H + h) * (size_t)D, D);
            for (int32_t t = 0; t < n; t++) {
              kvi__fp8_dequantize(row, (const uint8_t *)PR(t), kv == 0 ? mk : NULL, D, *scale);
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
                                 int32_t tokens, bool to_pages, unsigned char *raw, const char *fn) {
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
                          bool to_pages, unsigned char *raw, struct CUstream_st *stream, const char *fn) {
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
    if (raw) return kvi__fail(KVI_ERR_INTERNAL, fn, "raw copies of quantized pages take host views");
    return cuda_copy_device(s, v, pages, tokens, to_pages, stream, fn);
  }
  return cuda_copy_host(s, v, pages, tokens, to_pages, raw, fn);
}

kvi_status kvi__store_write_pages(kvi_store *s, const uint32_t *pages, const kvi_kv_view *v, const void *scales,
                                  struct CUstream_st *stream, const char *fn) {
  return kvi__copy_fact(s, v, pages, v->num_tokens, true, (unsigned char *)scales, stream, fn);
}

kvi_status kvi__store_read_pages(const kvi_store *s, const uint32_t *pages, int32_t tokens, const kvi_kv_view *host,
                                 void *scales, const char *fn) {
  return kvi__copy_fact(s, host, pages, tokens, false, (unsigned char *)scales, NULL, fn);
}
