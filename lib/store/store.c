/*
 * kvi_store: facts keyed by (tenant, fact id), stored in fixed-size pages
 * cut from memory reserved once at creation.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Page ids are global 32-bit indices into the store's page pools: the
 * first pool (device memory for a CUDA store, host memory for a CPU store)
 * holds ids [0, pool.npages); a CUDA store with a host budget has a second,
 * pinned and mapped host pool with the ids after them. A fact's pages are
 * all in one pool; moving it between tiers is copying its pages and swapping
 * its ids (the tier section below). Facts never change in place, so a fact
 * promoted from the host keeps its host pages as a clean copy, and demoting
 * it again is only a swap back.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "kvi_build_config.h"
#include "store/store.h"

#define STORE_STATS_V1 offsetof(kvi_store_stats, pages_host_total) /* the fields before the host tier came first */

/* Pinned staging for host-memory puts and reads on a CUDA store. */
#define STAGING_TARGET_BYTES (8u << 20)

/* ------------------------------------------------------------------------ */
/* small helpers                                                            */
/* ------------------------------------------------------------------------ */

int kvi__store_device(const kvi_store *s) { return s && s->backend == KVI_BACKEND_CUDA ? s->device : -1; }

void kvi__store_lock(const kvi_store *s) { pthread_mutex_lock((pthread_mutex_t *)&s->lock); }
void kvi__store_unlock(const kvi_store *s) { pthread_mutex_unlock((pthread_mutex_t *)&s->lock); }


/* ------------------------------------------------------------------------ */
/* CPU copies between a dense view and pages (the reference)                 */
/* ------------------------------------------------------------------------ */

/* Copies tokens [tok0, tok0 + ntok) (tok0 on a page boundary) between the
 * view and the pages whose addresses are pages[0..]. An fp8 store quantizes
 * each (page, layer, plane, head) group with its own scale (kernels.h);
 * `raw` (persist.c) moves e4m3 bytes as they are, with the pages' scales
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
#define PR(t) (pages[t0 / P] + (size_t)((int64_t)grp * P + (t)) * D * pe)
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

static bool move_outstanding(const kvi_store *s);

/* raw: see cpu_copy (host views only). */
static kvi_status copy_fact(const kvi_store *s, const kvi_kv_view *v, const uint32_t *pages,
                            int32_t tokens, bool to_pages, float *raw, struct CUstream_st *stream, const char *fn) {
  const bool host_tier = s->backend == KVI_BACKEND_CUDA && page_on_host_tier(s, pages[0]);
  if (host_tier && v->memory == KVI_MEMORY_HOST && !to_pages && move_outstanding(s)) {
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

/* ------------------------------------------------------------------------ */
/* creation                                                                  */
/* ------------------------------------------------------------------------ */

static kvi_status resolve_backend(kvi_store *s, const kvi_store_options *o, const char *fn);

int kvi__store_options_device(const kvi_store_options *o, const char *fn) {
  kvi_store s;
  s.backend = KVI_BACKEND_CPU;
  s.device = -1;
  return resolve_backend(&s, o, fn) == KVI_OK && s.backend == KVI_BACKEND_CUDA ? s.device : -1;
}

static kvi_status resolve_backend(kvi_store *s, const kvi_store_options *o, const char *fn) {
  const bool built = KVI_BUILT_CUDA != 0; /* not kvi_features(): that opens cuBLASLt and NCCL */
  switch (o->backend) {
  case KVI_BACKEND_CPU:
    s->backend = KVI_BACKEND_CPU;
    s->device = -1;
    return KVI_OK;
  case KVI_BACKEND_AUTO:
  case KVI_BACKEND_CUDA: break;
  default:
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->backend is %d, not a kvi_backend", (int)o->backend);
  }
  const int count = kvi__cuda_count();
  if (o->backend == KVI_BACKEND_AUTO && count == 0) {
    s->backend = KVI_BACKEND_CPU;
    s->device = -1;
    return KVI_OK;
  }
  if (!built) return kvi__fail(KVI_ERR_NOT_BUILT, fn, "KVI_BACKEND_CUDA asked for, but libkvinject was built without CUDA");
  if (count == 0) return kvi__fail(KVI_ERR_NO_DEVICE, fn, "KVI_BACKEND_CUDA asked for, but no CUDA device or driver answers");
  int dev = o->device;
  if (dev < -1 || dev >= count)
    return kvi__fail(o->backend == KVI_BACKEND_CUDA ? KVI_ERR_NO_DEVICE : KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->device is %d, this machine has CUDA devices 0..%d (-1: current)", dev, count - 1);
  if (dev == -1) {
    kvi_status st = kvi__cuda_current_device(&dev, fn);
    if (st) return st;
  }
  s->backend = KVI_BACKEND_CUDA;
  s->device = dev;
  return KVI_OK;
}

/* device_ok: the device is current (else its memory is left, the host's freed). */
static void release_memory(kvi_store *s, bool device_ok) {
  if (s->backend == KVI_BACKEND_CUDA) {
    if (device_ok) {
      if (s->copy_stream) kvi__cuda_sync(s->copy_stream, "kvi_store_destroy"); /* tier moves */
      kvi__cuda_free(s->pool.dev.base);
      kvi__cuda_host_free(s->pool.host.base);
      kvi__cuda_event_destroy(s->tier.prefetch_ev);
      kvi__ring_destroy(&s->staging, "kvi_store_destroy");
      kvi__cuda_stream_destroy(s->copy_stream);
      kvi__events_destroy(&s->track);
      if (s->emb.stream) kvi__cuda_sync(s->emb.stream, "kvi_store_destroy");
      kvi__ring_destroy(&s->emb.stage, "kvi_store_destroy");
      kvi__cuda_event_destroy(s->emb.ready);
      kvi__cuda_stream_destroy(s->emb.stream);
    }
  } else {
    free(s->pool.dev.base);
  }
  free(s->deferred_page);
  free(s->deferred_tag);
  s->deferred_page = NULL;
  s->deferred_tag = NULL;
  memset(&s->track, 0, sizeof s->track);
  s->pool.dev.base = NULL;
  s->pool.host.base = NULL;
  s->pool.host_dev = NULL;
  s->tier.prefetch_ev = NULL;
  memset(&s->staging, 0, sizeof s->staging);
  s->copy_stream = NULL;
  memset(&s->emb.stage, 0, sizeof s->emb.stage);
  s->emb.ready = NULL;
  s->emb.stream = NULL;
}

static kvi_status reserve_memory(kvi_store *s, const char *fn) {
  const uint64_t bytes = (uint64_t)s->pool.dev.npages * s->page_bytes;
  if (s->backend == KVI_BACKEND_CPU) {
    void *p = NULL;
    if (bytes > SIZE_MAX || posix_memalign(&p, 256, (size_t)bytes) != 0)
      return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "reserving %llu bytes of host memory for %u pages",
                       (unsigned long long)bytes, s->pool.dev.npages);
    s->pool.dev.base = p;
    return KVI_OK;
  }
  s->staging_pages = (uint32_t)(STAGING_TARGET_BYTES / s->page_bytes);
  if (s->staging_pages < 1) s->staging_pages = 1;
  if (s->staging_pages > KVI__LAUNCH_PAGES) s->staging_pages = KVI__LAUNCH_PAGES;
  if (s->staging_pages > s->pool.dev.npages) s->staging_pages = s->pool.dev.npages;
  kvi_status st = kvi__cuda_malloc((void **)&s->pool.dev.base, (size_t)bytes, fn);
  if (st == KVI_OK)
    st = kvi__ring_init(&s->staging, 1, (size_t)s->staging_pages * s->page_bytes, 0, fn);
  if (st == KVI_OK) st = kvi__cuda_stream_create(&s->copy_stream, fn);
  if (st == KVI_OK) st = kvi__events_init(&s->track, KVI__TRACK_EVENTS, fn);
  if (st == KVI_OK && s->emb_dim > 0) st = kvi__cuda_stream_create(&s->emb.stream, fn);
  if (st == KVI_OK && s->emb_dim > 0) st = kvi__ring_init(&s->emb.stage, 1, 0, KVI__RING_GROW, fn);
  if (st == KVI_OK && s->emb_dim > 0) st = kvi__cuda_event_create(&s->emb.ready, fn);
  const uint64_t hbytes = (uint64_t)s->pool.host.npages * s->page_bytes;
  if (st == KVI_OK && s->pool.host.npages > 0) {
    if (hbytes > SIZE_MAX) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "%llu bytes of host pages", (unsigned long long)hbytes);
    if (st == KVI_OK)
      st = kvi__cuda_host_alloc_mapped((void **)&s->pool.host.base, (void **)&s->pool.host_dev, (size_t)hbytes, fn);
    if (st == KVI_OK) st = kvi__cuda_event_create(&s->tier.prefetch_ev, fn);
    if (st == KVI_OK && ((uintptr_t)s->pool.host.base % 16 || (uintptr_t)s->pool.host_dev % 16))
      st = kvi__fail(KVI_ERR_INTERNAL, fn, "pinned host pages are not 16-byte aligned");
    if (st == KVI_ERR_OUT_OF_MEMORY)
      kvi__fail(st, fn, "reserving %llu bytes of pinned host memory for %u host-tier pages",
                (unsigned long long)hbytes, s->pool.host.npages);
  }
  if (st == KVI_OK) {
    const size_t all = (size_t)s->pool.dev.npages + s->pool.host.npages;
    s->deferred_page = malloc(all * sizeof *s->deferred_page);
    s->deferred_tag = malloc(all * sizeof *s->deferred_tag);
    if (!s->deferred_page || !s->deferred_tag)
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the deferred-free list for %u pages", s->pool.dev.npages);
  }
  if (st != KVI_OK) {
    if (st == KVI_ERR_OUT_OF_MEMORY && !s->pool.host.base && s->pool.dev.base == NULL)
      kvi__fail(st, fn, "reserving %llu bytes of device memory on device %d for %u pages",
                (unsigned long long)bytes, s->device, s->pool.dev.npages);
    release_memory(s, true);
  }
  return st;
}

/* A store's page layout, from its options: checked, then computed. */
typedef struct page_layout {
  uint64_t page_elems, page_bytes, scale_off;
  uint64_t npages, hpages;
  bool fp8;
} page_layout;

/* kvi_store_options' checks that need no backend; the page layout. */
static kvi_status check_options(const kvi_store_options *o, const kvi__geom *g, page_layout *pl, const char *fn) {
  if (o->dtype == KVI_DTYPE_FP8_E5M2)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "fp8 e5m2 fact storage is not supported; use KVI_DTYPE_FP8_E4M3");
  if (!kvi__dtype_is_float(o->dtype) && o->dtype != KVI_DTYPE_FP8_E4M3)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->dtype is %d, expected KVI_DTYPE_BF16, FP16, FP32 or FP8_E4M3",
                     (int)o->dtype);
  if (o->page_tokens < 1 || o->page_tokens > 4096)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->page_tokens is %d, expected 1..4096", (int)o->page_tokens);
  if (o->embedding_dim < 0 || o->embedding_dim > 65536)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->embedding_dim is %d, expected 0..65536", (int)o->embedding_dim);
  if (!kvi__dtype_is_float(o->embedding_dtype))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->embedding_dtype is %d, expected KVI_DTYPE_FP32, FP16 or BF16",
                     (int)o->embedding_dtype);
  if (o->metric != KVI_METRIC_INNER_PRODUCT && o->metric != KVI_METRIC_COSINE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->metric is %d, expected KVI_METRIC_INNER_PRODUCT (0) or KVI_METRIC_COSINE (1)", (int)o->metric);
  /* page_elems = L * 2 * H * P * D; each factor is bounded, the product fits in 64 bits */
  pl->page_elems = (uint64_t)g->num_layers * 2u * (uint64_t)g->local_heads * (uint64_t)o->page_tokens *
                   (uint64_t)g->head_size;
  /* fp8: the e4m3 bytes, then one fp32 scale per (layer, plane, head), each
   * part 16-byte aligned so every page keeps the kernels' vector alignment */
  pl->fp8 = o->dtype == KVI_DTYPE_FP8_E4M3;
  pl->scale_off = pl->fp8 ? (pl->page_elems + 15u) & ~(uint64_t)15u : 0;
  pl->page_bytes =
      pl->fp8 ? pl->scale_off + (((uint64_t)g->num_layers * 2u * (uint64_t)g->local_heads * 4u + 15u) & ~(uint64_t)15u)
              : pl->page_elems * kvi__dtype_size(o->dtype);
  if (o->budget_bytes < pl->page_bytes)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->budget_bytes is %llu, smaller than one page (%llu bytes: %d tokens x %d layers x 2 x "
                     "%d heads x %d x %zu bytes%s)",
                     (unsigned long long)o->budget_bytes, (unsigned long long)pl->page_bytes, (int)o->page_tokens,
                     (int)g->num_layers, (int)g->local_heads, (int)g->head_size, kvi__dtype_size(o->dtype),
                     pl->fp8 ? ", then the scales" : "");
  pl->npages = o->budget_bytes / pl->page_bytes;
  if (pl->npages >= UINT32_MAX)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->budget_bytes gives %llu pages, more than 2^32 - 1; use larger pages",
                     (unsigned long long)pl->npages);
  pl->hpages = o->host_budget_bytes / pl->page_bytes;
  return KVI_OK;
}

/* The host tier's checks, once the backend is known. */
static kvi_status check_host_tier(const kvi_store *s, const kvi_store_options *o, const page_layout *pl,
                                  const char *fn) {
  if (o->host_budget_bytes > 0 && s->backend == KVI_BACKEND_CPU)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->host_budget_bytes is %llu, but a CPU store has a single tier (host memory): pass 0",
                     (unsigned long long)o->host_budget_bytes);
  if (o->host_budget_bytes > 0 && pl->hpages == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->host_budget_bytes is %llu, smaller than one page (%llu bytes)",
                     (unsigned long long)o->host_budget_bytes, (unsigned long long)pl->page_bytes);
  if (pl->npages + pl->hpages >= UINT32_MAX)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->budget_bytes and host_budget_bytes give %llu pages, more than 2^32 - 1; use larger pages",
                     (unsigned long long)(pl->npages + pl->hpages));
  return KVI_OK;
}

/* The fields the options and the layout decide. */
static void set_fields(kvi_store *s, const kvi_store_options *o, const kvi__geom *g, const page_layout *pl) {
  s->geom = *g;
  s->dtype = o->dtype;
  s->P = o->page_tokens;
  s->emb_dim = o->embedding_dim;
  s->emb.dtype = o->embedding_dtype;
  s->emb.metric = o->metric;
  s->emb.ld = o->embedding_dim;
  if (s->backend == KVI_BACKEND_CUDA) { /* rows start on 16-byte boundaries: vector loads, GEMM alignment */
    const int32_t per16 = (int32_t)(16 / kvi__dtype_size(o->embedding_dtype));
    s->emb.ld = (o->embedding_dim + per16 - 1) / per16 * per16;
  }
  s->emb.stage_row_bytes = (size_t)s->emb.ld * kvi__dtype_size(o->embedding_dtype); /* a multiple of 16 on a CUDA store */
  s->page_elems = pl->page_elems;
  s->page_bytes = pl->page_bytes;
  s->fp8 = pl->fp8;
  s->scale_off = pl->scale_off;
  s->pool.dev.tier = s->backend == KVI_BACKEND_CUDA ? TIER_DEVICE : TIER_HOST;
  s->pool.dev.npages = (uint32_t)pl->npages;
  s->pool.dev.nfree = (uint32_t)pl->npages;
  s->pool.host.tier = TIER_HOST;
  s->pool.host.npages = (uint32_t)pl->hpages;
  s->pool.host.nfree = (uint32_t)pl->hpages;
  /* a tiered store moves facts between pools: its page ids are the host's to know */
  s->emb.dir_on = s->backend == KVI_BACKEND_CUDA && s->emb_dim > 0 && pl->hpages == 0;
  s->shard.size = 1;
}

/* The free stacks, full (each pops its lowest page id first). */
static kvi_status make_free_stacks(kvi_store *s, const char *fn) {
  const uint32_t npages = s->pool.dev.npages, hpages = s->pool.host.npages;
  s->pool.dev.free = malloc((size_t)npages * sizeof *s->pool.dev.free);
  s->pool.host.free = hpages ? malloc((size_t)hpages * sizeof *s->pool.host.free) : NULL;
  if (!s->pool.dev.free || (hpages && !s->pool.host.free))
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the page table for %llu pages", (unsigned long long)npages);
  for (uint32_t i = 0; i < npages; i++) s->pool.dev.free[i] = npages - 1 - i; /* pops 0, 1, 2, ... */
  for (uint32_t i = 0; i < hpages; i++) s->pool.host.free[i] = npages + hpages - 1 - i;
  return KVI_OK;
}

kvi_status kvi__store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts,
                             const char *fn) {
  const kvi_store_options o = *opts;
  const kvi__geom *g = &model->geom;
  page_layout pl = {0, 0, 0, 0, 0, false};
  kvi_status st = check_options(&o, g, &pl, fn);
  if (st) return st;
  kvi_store *s = calloc(1, sizeof *s);
  if (!s) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the store");
  if ((st = resolve_backend(s, &o, fn)) || (st = check_host_tier(s, &o, &pl, fn))) {
    free(s);
    return st;
  }
  set_fields(s, &o, g, &pl);
  s->rope = calloc((size_t)g->num_layers, sizeof *s->rope);
  if (!s->rope) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating RoPE tables");
    goto fail;
  }
  for (int32_t l = 0; l < g->num_layers; l++) {
    if ((st = kvi__rope_copy(&s->rope[l], &model->rope[l], fn))) {
      while (l-- > 0) kvi__rope_release(&s->rope[l]);
      goto fail;
    }
  }
  /* the page memory first: an impossible budget fails before anything large is built */
  if ((st = reserve_memory(s, fn))) goto fail_rope;
  if ((st = make_free_stacks(s, fn))) {
    release_memory(s, true);
    goto fail_rope;
  }
  if (pthread_mutex_init(&s->lock, NULL) != 0) {
    release_memory(s, true);
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "initializing the store's lock");
    goto fail_rope;
  }
  *out = s;
  return KVI_OK;
fail_rope:
  for (int32_t l = 0; l < g->num_layers; l++) kvi__rope_release(&s->rope[l]);
fail:
  free(s->pool.dev.free);
  free(s->pool.host.free);
  free(s->rope);
  free(s);
  return st;
}

static void free_fact(fact *f) {
  free(f->pages);
  free(f->hpages);
  free(f);
}

static void emb_free(kvi_store *s, tenant *t, bool device_ok);
static void emb_flush(kvi_store *s);

void kvi__store_destroy(kvi_store *store, bool device_ok) {
  if (!store) return;
  if (store->search.release) store->search.release(store, device_ok);
  for (size_t i = 0; i < store->index.facts.cap; i++)
    if (store->index.facts.slots[i].val) free_fact(store->index.facts.slots[i].val);
  for (size_t i = 0; i < store->index.tenants.cap; i++) {
    tenant *t = store->index.tenants.slots[i].val;
    if (t) emb_free(store, t, device_ok);
    free(t);
  }
  kvi__map_free(&store->index.facts);
  kvi__map_free(&store->index.tenants);
  release_memory(store, device_ok);
  pthread_mutex_destroy(&store->lock);
  free(store->pool.dev.free);
  free(store->pool.host.free);
  for (int32_t l = 0; l < store->geom.num_layers; l++) kvi__rope_release(&store->rope[l]);
  free(store->rope);
  if (store->journal.ops) store->journal.ops->release(store->journal.ctx);
  free(store);
}

/* ------------------------------------------------------------------------ */
/* put / remove                                                              */
/* ------------------------------------------------------------------------ */

/* Reads and checks an embedding into a fresh host fp32 array. */
static kvi_status read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                 kvi_metric metric, struct CUstream_st *stream, float **out, const char *fn) {
  *out = NULL;
  if (!embedding) {
    if (s->emb_dim > 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store keeps %d-element embeddings and the embedding is NULL",
                       (int)s->emb_dim);
    return KVI_OK;
  }
  if (s->emb_dim == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "an embedding is given but the store was created with embedding_dim 0");
  if (!kvi__dtype_is_float(dtype))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding_dtype is %d, expected FP32, FP16 or BF16", (int)dtype);
  if (memory != KVI_MEMORY_HOST && memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding_memory is %d, expected KVI_MEMORY_HOST or DEVICE",
                     (int)memory);
  kvi_status st = kvi__check_memory(embedding, memory, s->backend == KVI_BACKEND_CUDA, s->device, fn, "embedding");
  if (st) return st;
  const size_t n = (size_t)s->emb_dim, bytes = n * kvi__dtype_size(dtype);
  float *e = malloc(n * sizeof *e);
  void *raw = memory == KVI_MEMORY_DEVICE ? malloc(bytes) : NULL;
  if (!e || (memory == KVI_MEMORY_DEVICE && !raw)) {
    free(e);
    free(raw);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %zu-element embedding", n);
  }
  const void *src = embedding;
  if (raw) {
    /* ordered after the caller's work on `stream`, which may have produced it */
    st = kvi__cuda_d2h(raw, embedding, bytes, stream, fn);
    if (st == KVI_OK) st = kvi__cuda_sync(stream, fn);
    src = raw;
  }
  if (st == KVI_OK) {
    kvi__convert(e, KVI_DTYPE_FP32, src, dtype, (int64_t)n);
    for (size_t i = 0; i < n && st == KVI_OK; i++)
      if (!isfinite(e[i]))
        st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding[%zu] is %g; embeddings must be finite", i, (double)e[i]);
    const int64_t bad =
        st == KVI_OK ? kvi__emb_prepare(e, s->emb_dim, s->emb.dtype, metric) : -1;
    if (bad >= 0)
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding[%lld] is %g, too large for the store's %s embeddings",
                     (long long)bad, (double)kvi__load(src, dtype, bad), kvi__dtype_name(s->emb.dtype));
  }
  free(raw);
  if (st) {
    free(e);
    return st;
  }
  *out = e;
  return KVI_OK;
}

kvi_status kvi__store_read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                     struct CUstream_st *stream, float **out, const char *fn) {
  return read_embedding(s, embedding, dtype, memory, s->emb.metric, stream, out, fn);
}

kvi_status kvi__store_kept_embedding(const kvi_store *s, const float *embedding, float **out, const char *fn) {
  /* the inner product's preparation only rounds, which changes nothing kept */
  return read_embedding(s, embedding, KVI_DTYPE_FP32, KVI_MEMORY_HOST, KVI_METRIC_INNER_PRODUCT, NULL, out, fn);
}

int64_t kvi__emb_prepare(float *x, int32_t n, kvi_dtype t, kvi_metric metric) {
  if (metric == KVI_METRIC_COSINE) {
    double ss = 0.0;
    for (int32_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    if (ss > 0.0) {
      const double inv = 1.0 / sqrt(ss);
      for (int32_t i = 0; i < n; i++) x[i] = (float)((double)x[i] * inv);
    }
  }
  for (int32_t i = 0; i < n; i++) {
    if (t == KVI_DTYPE_FP16) x[i] = kvi__f16_to_f32(kvi__f32_to_f16(x[i]));
    else if (t == KVI_DTYPE_BF16) x[i] = kvi__bf16_to_f32(kvi__f32_to_bf16(x[i]));
    if (!isfinite(x[i])) return i;
  }
  return -1;
}

/* ---- embedding matrices --------------------------------------------------- */

static const char emb_fn[] = "kvi_store (device embeddings)";

static size_t row_bytes(const kvi_store *s) { return (size_t)s->emb.ld * kvi__dtype_size(s->emb.dtype); }

/* Keeps the first failure to change device embeddings: later searches report it. */
static void emb_latch(kvi_store *s, kvi_status st) {
  if (st == KVI_OK || s->emb.err != KVI_OK) return;
  s->emb.err = st;
  snprintf(s->emb.err_msg, sizeof s->emb.err_msg, "%s", kvi__last_error());
}

/* The latched failure of an earlier change, reported for fn. */
static kvi_status emb_failed(const kvi_store *s, const char *fn) {
  return kvi__fail(s->emb.err, fn, "an earlier change to the store's device embeddings failed: %s", s->emb.err_msg);
}

kvi_status kvi__emb_read_begin(kvi_store *s, struct CUstream_st *stream, const char *fn) {
  if (s->emb.err) return emb_failed(s, fn);
  return s->emb.ready_recorded ? kvi__cuda_stream_wait(stream, s->emb.ready, fn) : KVI_OK;
}

kvi_status kvi__emb_read_end(kvi_store *s, struct CUevent_st *done, const char *fn) {
  return kvi__cuda_stream_wait(s->emb.stream, done, fn);
}

/* Enqueued changes become visible to readers enqueued from now on. */
static kvi_status emb_publish(kvi_store *s) {
  kvi_status st = kvi__cuda_event_record(s->emb.ready, s->emb.stream, emb_fn);
  if (st == KVI_OK) s->emb.ready_recorded = true;
  return st;
}

/* Device bytes of a tenant's matrix, ids and directory per row. */
static uint64_t row_cost(const kvi_store *s, const tenant *t) {
  if (s->backend != KVI_BACKEND_CUDA) return row_bytes(s);
  return row_bytes(s) + sizeof(uint64_t) + (uint64_t)t->dir_stride * sizeof(uint32_t);
}

/* device_ok: the device is current (else a CUDA store's matrices are left). */
static void emb_free(kvi_store *s, tenant *t, bool device_ok) {
  if (s->backend == KVI_BACKEND_CUDA && (t->emb || t->ids || t->dir)) {
    if (device_ok) { /* stream-ordered: after every search that was enqueued before (emb.stream waits for them) */
      emb_flush(s);
      emb_latch(s, kvi__cuda_free_async(t->emb, s->emb.stream, emb_fn));
      emb_latch(s, kvi__cuda_free_async(t->ids, s->emb.stream, emb_fn));
      emb_latch(s, kvi__cuda_free_async(t->dir, s->emb.stream, emb_fn));
    }
  } else {
    free(t->emb);
  }
  s->emb.bytes -= (uint64_t)t->cap * row_cost(s, t);
  free(t->rows);
  t->emb = NULL;
  t->ids = NULL;
  t->dir = NULL;
  t->dir_stride = 0;
  t->rows = NULL;
  t->cap = 0;
}

/* Device matrix of `cap` rows and directory rows of `stride` words: new
 * allocations, the live rows copied over, the old ones freed, all on
 * emb.stream. */
static kvi_status emb_grow_device(kvi_store *s, tenant *t, size_t cap, int32_t stride, const char *fn) {
  emb_flush(s);
  const bool same = cap == t->cap; /* only the directory's rows grow */
  if (stride < t->dir_stride) stride = t->dir_stride;
  const size_t rb = row_bytes(s), odb = (size_t)t->dir_stride * sizeof(uint32_t);
  const size_t db = same && stride == t->dir_stride ? 0 : (size_t)stride * sizeof(uint32_t); /* 0: no new directory */
  void *e = NULL, *ids = NULL, *dir = NULL;
  kvi_status st = KVI_OK;
  if (!same) st = kvi__cuda_malloc_async(&e, cap * rb, s->emb.stream, fn);
  if (st == KVI_OK && !same) st = kvi__cuda_malloc_async(&ids, cap * sizeof(uint64_t), s->emb.stream, fn);
  if (st == KVI_OK && db) st = kvi__cuda_malloc_async(&dir, cap * db, s->emb.stream, fn);
  if (st == KVI_OK && !same && t->nrows > 0) st = kvi__cuda_d2d(e, t->emb, t->nrows * rb, s->emb.stream, fn);
  if (st == KVI_OK && !same && t->nrows > 0)
    st = kvi__cuda_d2d(ids, t->ids, t->nrows * sizeof(uint64_t), s->emb.stream, fn);
  if (st == KVI_OK && db && odb && t->nrows > 0) st = kvi__cuda_copy2d(dir, db, t->dir, odb, odb, t->nrows, s->emb.stream, fn);
  if (st != KVI_OK) {
    if (st == KVI_ERR_OUT_OF_MEMORY)
      kvi__fail(st, fn, "growing tenant %llu's embeddings to %zu rows (%zu bytes of device memory)",
                (unsigned long long)t->id, cap, cap * (rb + sizeof(uint64_t) + db));
    kvi_status st2 = kvi__cuda_free_async(e, s->emb.stream, fn);
    if (st2 == KVI_OK) st2 = kvi__cuda_free_async(ids, s->emb.stream, fn);
    if (st2 == KVI_OK) st2 = kvi__cuda_free_async(dir, s->emb.stream, fn);
    emb_latch(s, st2);
    return st;
  }
  if (!same) st = kvi__cuda_free_async(t->emb, s->emb.stream, fn);
  if (st == KVI_OK && !same) st = kvi__cuda_free_async(t->ids, s->emb.stream, fn);
  if (st == KVI_OK && db) st = kvi__cuda_free_async(t->dir, s->emb.stream, fn);
  if (st == KVI_OK) st = emb_publish(s);
  emb_latch(s, st); /* the new arrays hold the rows either way */
  if (!same) t->emb = e, t->ids = ids;
  if (db) t->dir = dir, t->dir_stride = stride;
  return KVI_OK;
}

/* Room for `need` rows, and directory rows of `stride` words (emb.dir_on). */
static kvi_status emb_grow(kvi_store *s, tenant *t, size_t need, int32_t stride, const char *fn) {
  size_t cap = t->cap ? t->cap : 16;
  while (cap < need) cap *= 2;
  const size_t rb = row_bytes(s);
  const uint64_t cost0 = (uint64_t)t->cap * row_cost(s, t);
  fact **rows = realloc(t->rows, cap * sizeof *rows); /* a larger array changes nothing else */
  if (!rows) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu embedding rows", cap);
  t->rows = rows;
  if (s->backend == KVI_BACKEND_CUDA) {
    kvi_status st = emb_grow_device(s, t, cap, stride, fn);
    if (st) return st;
  } else {
    if (cap * rb / rb != cap) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "%zu embedding rows overflow", cap);
    void *e = realloc(t->emb, cap * rb);
    if (!e)
      return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "growing tenant %llu's embeddings to %zu rows (%zu bytes)",
                       (unsigned long long)t->id, cap, cap * rb);
    t->emb = e;
  }
  t->cap = cap;
  s->emb.bytes += (uint64_t)cap * row_cost(s, t) - cost0;
  return KVI_OK;
}

/* Staging of one fact's embedding row (kernels.h, kvi__emb_rows_args): its
 * entry, the row, and with emb.dir_on its directory row; each a multiple of 16. */
static size_t stage_fact_bytes(const kvi_store *s, int32_t tokens) {
  size_t b = sizeof(kvi__row_entry) + s->emb.stage_row_bytes;
  if (s->emb.dir_on) b += ((size_t)(1 + pages_for(s, tokens)) * sizeof(uint32_t) + 15) & ~(size_t)15;
  return b;
}

_Static_assert(sizeof(kvi__row_entry) % 16 == 0, "staged rows stay 16-byte aligned");

/* The slot's bytes staged since it was acquired: entries from its start, rows from its end. */
static size_t stage_in_use(const kvi_store *s) { return (size_t)s->emb.stage_ent * sizeof(kvi__row_entry) + s->emb.stage_top; }

/* Promises `bytes` of the pinned staging ring to the current call. */
static kvi_status stage_reserve(kvi_store *s, size_t bytes, const char *fn) {
  if (stage_in_use(s) + s->emb.stage_reserved + bytes <= s->emb.stage_cap) {
    s->emb.stage_reserved += bytes;
    return KVI_OK;
  }
  const size_t want = s->emb.stage_reserved + bytes;
  size_t cap = s->emb.stage_cap;
  if (want > cap) {
    if (want > UINT32_MAX / 2)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%zu bytes of embedding staging in one call (at most %u)", want,
                       UINT32_MAX / 2);
    cap = (size_t)1 << 20;
    if (cap < 2 * want) cap = 2 * want; /* more than twice the old slot: the ring grows to exactly this */
  }
  emb_flush(s); /* nothing is staged between calls; if it were, it would go first */
  kvi__ring_slot *sl;
  /* waits for the launches that read the slot; grows it */
  kvi_status st = kvi__ring_acquire(&s->emb.stage, cap, NULL, &sl, fn);
  if (st) return st;
  s->emb.stage_ent = s->emb.stage_sent = 0;
  s->emb.stage_top = 0;
  s->emb.stage_cap = cap;
  s->emb.stage_reserved += bytes;
  return KVI_OK;
}

/* Makes room for `n` more embedding rows in tenant_id's matrix (and, on a
 * CUDA store, their staging; with emb.dir_on, directory rows for facts of
 * up to `tokens` tokens), creating the tenant without facts if it is new.
 * No-op for a store without embeddings. A transaction that then fails calls
 * unreserve_rows for each of those tenants, so that no empty tenant stays
 * behind. The room that was made stays (as a hash map's). */
static kvi_status reserve_rows(kvi_store *s, uint64_t tenant_id, size_t n, int32_t tokens, const char *fn) {
  if (s->emb_dim == 0 || n == 0) return KVI_OK;
  if (s->emb.err) return emb_failed(s, fn);
  tenant *t = kvi__map_get(&s->index.tenants, tenant_id, 0);
  kvi_status st;
  if (!t) {
    if ((st = kvi__map_reserve(&s->index.tenants, 1, fn))) return st;
    if (!(t = calloc(1, sizeof *t))) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a tenant");
    t->id = tenant_id;
    kvi__map_put(&s->index.tenants, tenant_id, 0, t); /* empty until commit; unreserve_rows drops it */
  }
  /* a directory row: the token count, then the page ids */
  const int32_t stride = s->emb.dir_on ? 1 + (int32_t)pages_for(s, tokens) : 0;
  if ((t->nrows + t->pending + n > t->cap || stride > t->dir_stride) &&
      (st = emb_grow(s, t, t->nrows + t->pending + n, stride, fn)))
    return st;
  if (s->backend == KVI_BACKEND_CUDA && (st = stage_reserve(s, n * stage_fact_bytes(s, tokens), fn))) return st;
  t->pending += n;
  return KVI_OK;
}

static void unreserve_rows(kvi_store *s, uint64_t tenant_id) {
  if (s->emb_dim == 0) return;
  s->emb.stage_reserved = 0;
  tenant *t = kvi__map_get(&s->index.tenants, tenant_id, 0);
  if (!t) return;
  t->pending = 0;
  if (t->count == 0) {
    kvi__map_del(&s->index.tenants, tenant_id, 0);
    emb_free(s, t, true);
    free(t);
  }
}

/* Enqueues the rows staged since the last flush (one launch reads them in
 * place), then the slot's event and emb.ready. Every other change to a
 * device matrix flushes first, so that emb.stream keeps the order of the
 * changes. */
static void emb_flush(kvi_store *s) {
  if (s->emb.stage_sent == s->emb.stage_ent) return;
  kvi__ring_slot *sl = &s->emb.stage.slot[0];
  kvi__emb_rows_args a;
  a.entries = (const kvi__row_entry *)sl->host + s->emb.stage_sent;
  a.src = sl->host;
  a.n = (int32_t)(s->emb.stage_ent - s->emb.stage_sent);
  s->emb.stage_sent = s->emb.stage_ent;
#ifdef KVI_HAVE_CUDA
  const int err = kvi__cuda_emb_rows_set(&a, s->emb.stream);
  kvi_status st = err ? kvi__cuda_error(err, emb_fn, "embedding rows kernel launch") : KVI_OK;
#else
  (void)a;
  kvi_status st = kvi__fail(KVI_ERR_NOT_BUILT, emb_fn, "libkvinject was built without CUDA");
#endif
  if (st == KVI_OK) st = kvi__ring_record(sl, s->emb.stream, emb_fn); /* the slot's reuse waits */
  if (st == KVI_OK) st = emb_publish(s);
  emb_latch(s, st);
}

/* Stages f's row r of t on a CUDA store: the embedding e, its id and (emb.dir_on)
 * its directory row, written by the next emb_flush. */
static void emb_stage_row(kvi_store *s, tenant *t, const fact *f, size_t r, const float *e) {
  const size_t need = stage_fact_bytes(s, f->tokens), rb = row_bytes(s);
  s->emb.stage_reserved = s->emb.stage_reserved > need ? s->emb.stage_reserved - need : 0;
  if (stage_in_use(s) + need > s->emb.stage_cap) { /* reserve_rows was not called: a bug */
    emb_latch(s, kvi__fail(KVI_ERR_INTERNAL, emb_fn, "fact %llu committed without reserved staging",
                           (unsigned long long)f->id));
    return;
  }
  kvi__ring_slot *sl = &s->emb.stage.slot[0];
  kvi__row_entry *en = (kvi__row_entry *)sl->host + s->emb.stage_ent++;
  s->emb.stage_top += need - sizeof *en;
  char *row = sl->host + s->emb.stage_cap - s->emb.stage_top;
  memset(row, 0, rb); /* the padding elements */
  kvi__convert(row, s->emb.dtype, e, KVI_DTYPE_FP32, s->emb_dim);
  en->emb = (char *)t->emb + r * rb;
  en->ids = t->ids + r;
  en->id = f->id;
  en->emb_src = (uint32_t)(row - sl->host);
  en->emb_bytes = (uint32_t)rb;
  en->dir = NULL;
  en->dir_src = en->dir_words = 0;
  if (s->emb.dir_on) { /* the token count, then the page ids */
    uint32_t *w = (uint32_t *)(row + rb);
    w[0] = (uint32_t)f->tokens;
    memcpy(w + 1, f->pages, (size_t)f->npages * sizeof *w);
    en->dir = t->dir + r * (size_t)t->dir_stride;
    en->dir_src = (uint32_t)((char *)w - sl->host);
    en->dir_words = 1 + f->npages;
  }
}

/* Writes f's embedding e (fp32, already what the store keeps) as row
 * `reuse` (the row of the fact f replaces) or, for SIZE_MAX, as a new row
 * t->nrows. */
static void emb_append(kvi_store *s, tenant *t, fact *f, const float *e, size_t reuse) {
  if (t->pending == 0 || (reuse == SIZE_MAX && t->nrows >= t->cap)) { /* reserve_rows was not called: a bug */
    f->row = SIZE_MAX;
    emb_latch(s, kvi__fail(KVI_ERR_INTERNAL, emb_fn, "fact %llu committed without a reserved embedding row",
                           (unsigned long long)f->id));
    return;
  }
  t->pending--;
  const size_t r = reuse != SIZE_MAX ? reuse : t->nrows++, rb = row_bytes(s);
  t->rows[r] = f;
  f->row = r;
  if (s->backend == KVI_BACKEND_CPU) kvi__convert((char *)t->emb + r * rb, s->emb.dtype, e, KVI_DTYPE_FP32, s->emb_dim);
  else emb_stage_row(s, t, f, r, e);
}

/* Moves the last row into f's place. */
static void emb_remove(kvi_store *s, tenant *t, fact *f) {
  const size_t r = f->row;
  if (r == SIZE_MAX) return; /* a fact without a row: its embedding is held by another rank */
  const size_t last = --t->nrows;
  if (r != last) {
    const size_t rb = row_bytes(s);
    fact *m = t->rows[last];
    t->rows[r] = m;
    m->row = r;
    if (s->backend == KVI_BACKEND_CPU) {
      memcpy((char *)t->emb + r * rb, (char *)t->emb + last * rb, rb);
    } else {
      emb_flush(s); /* the last row may be staged */
      kvi_status st = kvi__cuda_d2d((char *)t->emb + r * rb, (char *)t->emb + last * rb, rb, s->emb.stream, emb_fn);
      if (st == KVI_OK) st = kvi__cuda_d2d(t->ids + r, t->ids + last, sizeof(uint64_t), s->emb.stream, emb_fn);
      if (st == KVI_OK && t->dir)
        st = kvi__cuda_d2d(t->dir + r * (size_t)t->dir_stride, t->dir + last * (size_t)t->dir_stride,
                           (size_t)t->dir_stride * sizeof(uint32_t), s->emb.stream, emb_fn);
      if (st == KVI_OK) st = emb_publish(s);
      emb_latch(s, st);
    }
  }
  t->rows[last] = NULL;
}

/* k_name, v_name: the pointers' names in messages ("kv->k", "kv->v") */
static kvi_status check_view_memory(const kvi_store *s, const kvi_kv_view *v, const char *fn, const char *k_name,
                                    const char *v_name) {
  const bool cuda = s->backend == KVI_BACKEND_CUDA;
  kvi_status st = kvi__check_memory(v->k, v->memory, cuda, s->device, fn, k_name);
  return st ? st : kvi__check_memory(v->v, v->memory, cuda, s->device, fn, v_name);
}

/* ---- deferred frees ------------------------------------------------------ */

static kvi_status not_found_(const char *fn, uint64_t tenant_id, uint64_t fact_id) {
  return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no fact %llu for tenant %llu", (unsigned long long)fact_id,
                   (unsigned long long)tenant_id);
}

static pool *pool_of(kvi_store *s, uint32_t page) { return page_on_host_tier(s, page) ? &s->pool.host : &s->pool.dev; }

/* Pages of pool p that wait for in-flight work. */
static uint32_t deferred_in(const kvi_store *s, const pool *p) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < s->ndeferred; i++) n += (p == &s->pool.host) == page_on_host_tier(s, s->deferred_page[i]);
  return n;
}

/* Advances track.done past completed events and frees the deferred pages
 * that were only waiting for them. `wait`: block for every outstanding event. */
static kvi_status reap(kvi_store *s, bool wait, const char *fn) {
  kvi_status st = KVI_OK;
  if (wait) st = kvi__events_retire(&s->track, true, fn);
  else st = kvi__events_retire(&s->track, false, fn); /* queries events only */
  if (st) return st;
  uint32_t keep = 0;
  for (uint32_t i = 0; i < s->ndeferred; i++) {
    if (s->deferred_tag[i] <= s->track.done) {
      pool *p = pool_of(s, s->deferred_page[i]);
      p->free[p->nfree++] = s->deferred_page[i];
    } else {
      s->deferred_page[keep] = s->deferred_page[i];
      s->deferred_tag[keep++] = s->deferred_tag[i];
    }
  }
  s->ndeferred = keep;
  return KVI_OK;
}

kvi_status kvi__store_track(kvi_store *s, struct CUstream_st *stream, const char *fn) {
  if (s->backend != KVI_BACKEND_CUDA) return KVI_OK;
  /* all KVI__TRACK_EVENTS in flight: waits for the oldest */
  return kvi__events_record(&s->track, stream, NULL, fn);
}

static void release_pages(kvi_store *s, const uint32_t *pages, uint32_t n) {
  const bool defer = s->backend == KVI_BACKEND_CUDA && s->track.done < s->track.next;
  for (uint32_t i = 0; i < n; i++) {
    if (defer) {
      s->deferred_page[s->ndeferred] = pages[i];
      s->deferred_tag[s->ndeferred++] = s->track.next;
    } else {
      pool *p = pool_of(s, pages[i]);
      p->free[p->nfree++] = pages[i];
    }
  }
}

/* Takes n pages off the top of p's free stack (p->nfree >= n), in pop order. */
static void pool_take(pool *p, uint32_t *out, uint32_t n) {
  for (uint32_t j = 0; j < n; j++) out[j] = p->free[--p->nfree];
}

/* Undoes pool_take exactly: the stack is as it was before. */
static void pool_untake(pool *p, const uint32_t *pages, uint32_t n) {
  for (uint32_t j = n; j-- > 0;) p->free[p->nfree++] = pages[j];
}

/* Frees what completed work allows in pool p, and waits for in-flight work
 * when the pages it holds would give p `need` free pages. */
static kvi_status pool_room(kvi_store *s, pool *p, uint64_t need, const char *fn) {
  kvi_status st = KVI_OK;
  if (s->ndeferred > 0) st = reap(s, false, fn); /* cheap: queries events */
  if (st == KVI_OK && p->nfree < need && p->nfree + deferred_in(s, p) >= need) st = reap(s, true, fn);
  return st;
}

/* Makes `need` pages of the first pool free, or fails with KVI_ERR_CAPACITY. */
static kvi_status device_room(kvi_store *s, uint32_t need, const char *fn) {
  kvi_status st = pool_room(s, &s->pool.dev, need, fn);
  if (st) return st;
  if (s->pool.dev.nfree < need)
    return kvi__fail(KVI_ERR_CAPACITY, fn, "%u pages of %d tokens are needed; %u of %u pages are free", need,
                     (int)s->P, s->pool.dev.nfree, s->pool.dev.npages);
  return KVI_OK;
}


/* ---- tiers ------------------------------------------------------------------ */

static void lru_remove(kvi_store *s, fact *f) {
  if (!f->in_lru) return;
  if (f->lru_prev) f->lru_prev->lru_next = f->lru_next;
  else s->tier.lru_head = f->lru_next;
  if (f->lru_next) f->lru_next->lru_prev = f->lru_prev;
  else s->tier.lru_tail = f->lru_prev;
  f->lru_prev = f->lru_next = NULL;
  f->in_lru = false;
}

void kvi__store_touch(kvi_store *s, fact *f) {
  if (s->pool.host.npages == 0 || fact_on_host(s, f)) return;
  lru_remove(s, f);
  f->lru_prev = NULL;
  f->lru_next = s->tier.lru_head;
  if (s->tier.lru_head) s->tier.lru_head->lru_prev = f;
  else s->tier.lru_tail = f;
  s->tier.lru_head = f;
  f->in_lru = true;
}

/* Whether the last tier move may still be running (its number is still in
 * the tracker: kvi__events_record retires the oldest before reusing one). */
static bool move_outstanding(const kvi_store *s) {
  return s->tier.move_pending && kvi__events_pending(&s->track, s->tier.move_seq);
}

/* Makes `stream` wait for the last tier move if it may not have completed
 * (no-op otherwise, and on stores without a host tier). */
static kvi_status order_moves(kvi_store *s, struct CUstream_st *stream, const char *fn) {
  if (s->pool.host.npages == 0 || !move_outstanding(s)) return KVI_OK;
  return kvi__events_order(&s->track, s->tier.move_seq, stream, fn);
}

/* Makes `on` wait for every tracked device operation that may still run. */
static kvi_status wait_tracked(kvi_store *s, struct CUstream_st *on, const char *fn) {
  return kvi__events_order_all(&s->track, on, fn);
}

/* Makes `need` host-tier pages free if it can: completed work first, then
 * the clean host copies of device-tier facts (most recently used first:
 * they are the last to be demoted), except those of pinned facts.
 * Leaves the shortage, if any, to the caller, having dropped nothing. */
static kvi_status host_room(kvi_store *s, uint64_t need, const char *fn) {
  kvi_status st = pool_room(s, &s->pool.host, need, fn);
  if (st || s->pool.host.nfree >= need) return st;
  uint64_t have = (uint64_t)s->pool.host.nfree + deferred_in(s, &s->pool.host), drop = 0;
  for (fact *f = s->tier.lru_head; f && have + drop < need; f = f->lru_next)
    if (f->hpages && !f->pins) drop += f->npages;
  if (have + drop < need) return KVI_OK;
  for (fact *f = s->tier.lru_head; f && have < need; f = f->lru_next)
    if (f->hpages && !f->pins) {
      release_pages(s, f->hpages, f->npages); /* after any copy still reading them */
      have += f->npages;
      free(f->hpages);
      f->hpages = NULL;
    }
  return pool_room(s, &s->pool.host, need, fn);
}

/* Enqueues, on the copy stream, the copy of a fact of `tokens` tokens from
 * pages src to pages dst (the other tier): runs of consecutive whole pages
 * as one copy each; a last page that is only partly used as one pitched
 * copy of its used rows (each (layer, K/V, head) run holds P rows of D
 * elements, the first `used` of which are the fact's), and on an fp8 store
 * its scales. No copy is smaller than a page's used bytes. */
static kvi_status copy_tier(kvi_store *s, const uint32_t *dst, const uint32_t *src, uint32_t n, int32_t tokens,
                            const char *fn) {
  const uint32_t used = (uint32_t)(tokens - (int32_t)(n - 1) * s->P);
  const uint32_t whole = used == (uint32_t)s->P ? n : n - 1;
  kvi_status st = KVI_OK;
  for (uint32_t i = 0; i < whole && st == KVI_OK;) {
    uint32_t run = 1;
    while (i + run < whole && dst[i + run] == dst[i] + run && src[i + run] == src[i] + run) run++;
    st = kvi__cuda_copy(page_addr(s, dst[i]), page_addr(s, src[i]), (size_t)run * s->page_bytes, s->copy_stream, fn);
    i += run;
  }
  if (st == KVI_OK && whole < n) {
    const size_t row = (size_t)s->geom.head_size * kvi__dtype_size(s->dtype), pitch = (size_t)s->P * row;
    char *d = page_addr(s, dst[n - 1]);
    const char *from = page_addr(s, src[n - 1]);
    st = kvi__cuda_copy2d(d, pitch, from, pitch, used * row, (size_t)s->geom.num_layers * 2u * (size_t)s->geom.local_heads,
                          s->copy_stream, fn);
    if (st == KVI_OK && s->fp8)
      st = kvi__cuda_copy(d + s->scale_off, from + s->scale_off, (size_t)(s->page_bytes - s->scale_off), s->copy_stream,
                          fn);
  }
  return st;
}

uint64_t kvi__store_evictable(const kvi_store *s) {
  uint64_t n = 0;
  for (const fact *f = s->tier.lru_tail; f; f = f->lru_prev)
    if (!f->pins) n += f->npages;
  return n;
}

size_t kvi__store_victims(const kvi_store *s, uint64_t need, fact **out) {
  uint64_t got = 0;
  size_t n = 0;
  for (fact *f = s->tier.lru_tail; f && s->pool.dev.nfree + got < need; f = f->lru_prev)
    if (!f->pins) {
      got += f->npages;
      if (out) out[n] = f;
      n++;
    }
  return n;
}

/* Moves the `nup` host-tier facts up[] to the device and takes `extra` more
 * device pages for the caller (written into extra_pages, off the free stack:
 * the caller commits them to facts or gives them back with release_pages),
 * demoting least-recently-used device facts that are not pinned when the
 * device pool is short. Copies run on the copy stream after every tracked
 * device operation; `stream` then waits for them. KVI_ERR_CAPACITY, with
 * nothing changed, when the device cannot hold them besides the pinned
 * facts or the host has no room for the demoted ones. Device is current. */
static kvi_status tier_move(kvi_store *s, fact *const *up, size_t nup, uint32_t extra, uint32_t *extra_pages,
                            struct CUstream_st *stream, const char *fn) {
  uint64_t need = extra;
  for (size_t i = 0; i < nup; i++) need += up[i]->npages;
  if (need == 0) return KVI_OK;
  kvi_status st = pool_room(s, &s->pool.dev, need, fn);
  if (st) return st;
  /* victims: device-tier facts the call does not use, least recently used first */
  const uint64_t evictable = kvi__store_evictable(s);
  if (s->pool.dev.nfree + evictable < need)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "%llu pages must be on the device at once; the device tier has %u pages: %u free, %llu held by "
                     "facts that may move down, %u waiting for in-flight work, the rest held by the facts of this call",
                     (unsigned long long)need, s->pool.dev.npages, s->pool.dev.nfree, (unsigned long long)evictable,
                     deferred_in(s, &s->pool.dev));
  const size_t nvict = kvi__store_victims(s, need, NULL);
  fact **vict = malloc((nvict ? nvict : 1) * sizeof *vict);
  uint64_t got = 0, down = 0; /* the victims' pages, those without a clean host copy */
  if (vict) kvi__store_victims(s, need, vict);
  for (size_t i = 0; vict && i < nvict; i++) {
    got += vict[i]->npages;
    if (!vict[i]->hpages) down += vict[i]->npages;
  }
  uint32_t *avail = malloc((size_t)(got ? got : 1) * sizeof *avail);
  uint32_t *hdst = malloc((size_t)(down ? down : 1) * sizeof *hdst);
  uint32_t **newp = calloc(nup ? nup : 1, sizeof *newp);
  if (!vict || !avail || !hdst || !newp) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a tier move");
  for (size_t i = 0; i < nup && st == KVI_OK; i++)
    if (!(newp[i] = malloc(up[i]->npages * sizeof **newp)))
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a tier move");
  size_t nv = 0;
  for (; st == KVI_OK && nv < nvict; nv++) vict[nv]->pins++; /* host_room keeps their clean copies */
  if (st == KVI_OK && down > 0) {
    st = host_room(s, down, fn);
    if (st == KVI_OK && s->pool.host.nfree < down)
      st = kvi__fail(KVI_ERR_CAPACITY, fn,
                     "making room on the device means moving %llu pages to the host tier, which has %u of %u pages "
                     "free (%u waiting for in-flight work)",
                     (unsigned long long)down, s->pool.host.nfree, s->pool.host.npages, deferred_in(s, &s->pool.host));
  }
  /* device pages for the call: the free stack's top, then the victims' */
  const uint32_t nf = s->pool.dev.nfree < need ? s->pool.dev.nfree : (uint32_t)need;
#define DEVP(k) ((k) < nf ? s->pool.dev.free[s->pool.dev.nfree - 1 - (k)] : avail[(k) - nf])
  for (uint64_t j = 0; j < down && st == KVI_OK; j++) hdst[j] = s->pool.host.free[s->pool.host.nfree - 1 - j];
  if (st == KVI_OK) st = wait_tracked(s, s->copy_stream, fn);
  uint64_t a = 0, hj = 0;
  for (size_t i = 0; i < nvict && st == KVI_OK; i++) { /* down first: the copies up may overwrite these pages */
    fact *f = vict[i];
    memcpy(avail + a, f->pages, f->npages * sizeof *avail);
    a += f->npages;
    if (!f->hpages) {
      st = copy_tier(s, hdst + hj, f->pages, f->npages, f->tokens, fn);
      hj += f->npages;
    }
  }
  uint64_t k = 0;
  for (size_t i = 0; i < nup && st == KVI_OK; i++) {
    for (uint32_t q = 0; q < up[i]->npages; q++) newp[i][q] = DEVP(k + q);
    k += up[i]->npages;
    st = copy_tier(s, newp[i], up[i]->pages, up[i]->npages, up[i]->tokens, fn);
  }
  for (uint32_t q = 0; q < extra && st == KVI_OK; q++) extra_pages[q] = DEVP(k + q);
#undef DEVP
  const bool enqueued = st == KVI_OK && (nvict > 0 || nup > 0);
  if (enqueued) st = kvi__store_track(s, s->copy_stream, fn);
  if (st == KVI_OK && enqueued) {
    s->tier.move_seq = s->track.next - 1;
    s->tier.move_pending = true;
    if (stream != s->copy_stream) st = kvi__events_order(&s->track, s->tier.move_seq, stream, fn);
  } else if (st != KVI_OK) { /* nothing swapped; the pages written stay free once the copies are over */
    kvi__cuda_sync(s->copy_stream, fn);
    for (size_t i = 0; i < nv; i++) vict[i]->pins--;
    for (size_t i = 0; i < nup; i++) free(newp ? newp[i] : NULL);
    free(newp);
    free(vict);
    free(avail);
    free(hdst);
    return st;
  }
  /* commit: the copies are enqueued and tracked (a failed stream wait is
   * reported, but the facts have moved) */
  s->pool.dev.nfree -= nf;
  s->pool.host.nfree -= (uint32_t)down;
  hj = 0;
  for (size_t i = 0; i < nvict; i++) {
    fact *f = vict[i];
    if (f->hpages) {
      free(f->pages);
      f->pages = f->hpages;
      f->hpages = NULL;
    } else {
      memcpy(f->pages, hdst + hj, f->npages * sizeof *hdst);
      hj += f->npages;
    }
    lru_remove(s, f);
    f->pins--;
    s->tier.demotions++;
  }
  for (size_t i = 0; i < nup; i++) {
    fact *f = up[i];
    f->hpages = f->pages; /* the clean copy stays */
    f->pages = newp[i];
    kvi__store_touch(s, f);
    s->tier.promotions++;
  }
  if (got > need - nf) release_pages(s, avail + (need - nf), (uint32_t)(got - (need - nf))); /* after the copies */
  if (st != KVI_OK && extra > 0) release_pages(s, extra_pages, extra); /* the caller fails: not taken */
  free(newp);
  free(vict);
  free(avail);
  free(hdst);
  return st;
}

/* Where a put of `need` pages goes: the device tier when it has room, else
 * the host tier; waiting for in-flight work only when nothing is free now. */
static kvi_status put_room(kvi_store *s, uint32_t need, pool **into, const char *fn) {
  kvi_status st = KVI_OK;
  if (s->ndeferred > 0 && (st = reap(s, false, fn))) return st;
  *into = &s->pool.dev;
  if (s->pool.dev.nfree >= need) return KVI_OK;
  *into = &s->pool.host;
  if (s->pool.host.npages > 0 && s->pool.host.nfree >= need) return KVI_OK;
  *into = &s->pool.dev;
  if ((st = pool_room(s, &s->pool.dev, need, fn)) || s->pool.dev.nfree >= need) return st;
  if (s->pool.host.npages > 0) {
    *into = &s->pool.host;
    if ((st = host_room(s, need, fn)) || s->pool.host.nfree >= need) return st;
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "%u pages of %d tokens are needed; the device tier has %u of %u pages free, the host tier %u of %u",
                     need, (int)s->P, s->pool.dev.nfree, s->pool.dev.npages, s->pool.host.nfree, s->pool.host.npages);
  }
  return kvi__fail(KVI_ERR_CAPACITY, fn, "%u pages of %d tokens are needed; %u of %u pages are free", need, (int)s->P,
                   s->pool.dev.nfree, s->pool.dev.npages);
}

kvi_status kvi__store_prefetch(kvi_store *store, uint64_t tenant_id, const uint64_t *fact_ids, int32_t count,
                               struct CUstream_st *stream, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  if (count < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "count is %d", (int)count);
  if (count > 0 && !fact_ids) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "fact_ids is NULL and count is %d", (int)count);
  kvi_status st = KVI_OK;
  kvi__store_lock(store);
  const tenant *t = kvi__map_get(&store->index.tenants, tenant_id, 0);
  const size_t n = fact_ids ? (size_t)count : t ? t->count : 0;
  fact **list = malloc((n ? 2 * n : 1) * sizeof *list), **up = list ? list + n : NULL; /* up: the facts to move */
  if (!list) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu fact references", n);
  size_t m = 0;
  if (st == KVI_OK && fact_ids) {
    kvi__map_get_many(&store->index.facts, &tenant_id, 0, fact_ids, n, (void **)list);
    for (; m < n && st == KVI_OK; m++)
      if (!list[m]) st = not_found_(fn, tenant_id, fact_ids[m]);
  } else if (st == KVI_OK && t) {
    for (fact *f = t->head; f; f = f->next) list[m++] = f;
  }
  if (st == KVI_OK && store->pool.host.npages > 0 && m > 0) {
    for (size_t i = 0; i < m; i++) list[i]->pins++; /* none of them moves down */
    /* the longest prefix that fits beside the facts it must not move down */
    uint64_t room = (uint64_t)store->pool.dev.nfree + deferred_in(store, &store->pool.dev) + kvi__store_evictable(store),
             need = 0;
    for (size_t i = m; i-- > 0;) /* named facts already on the device become the most recent, the first first */
      kvi__store_touch(store, list[i]);
    size_t nup = 0;
    for (size_t i = 0; i < m; i++) {
      if (!fact_on_host(store, list[i])) continue;
      if (need + list[i]->npages > room) break;
      need += list[i]->npages;
      up[nup++] = list[i];
    }
    if (nup > 0) {
      st = kvi__cuda_event_record(store->tier.prefetch_ev, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_stream_wait(store->copy_stream, store->tier.prefetch_ev, fn);
      if (st == KVI_OK) st = tier_move(store, up, nup, 0, NULL, store->copy_stream, fn);
    }
    for (size_t i = 0; i < m; i++) list[i]->pins--;
  }
  kvi__store_unlock(store);
  free(list);
  return st;
}

/* ---- leases ---------------------------------------------------------------- */

kvi_status kvi__store_lease(kvi_store *s, fact *const *facts, size_t n, bool promote, struct CUstream_st *stream,
                            const char *fn) {
  if (s->pool.host.npages == 0) return KVI_OK;
  fact **up = promote ? malloc((n ? n : 1) * sizeof *up) : NULL;
  if (promote && !up) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu fact references", n);
  size_t nup = 0;
  for (size_t i = 0; i < n; i++) /* each once */
    if (facts[i]->pins++ == 0 && promote && fact_on_host(s, facts[i])) up[nup++] = facts[i];
  kvi_status st = KVI_OK;
  if (s->backend == KVI_BACKEND_CUDA) {
    st = order_moves(s, stream, fn);
    if (st == KVI_OK && nup > 0) st = tier_move(s, up, nup, 0, NULL, stream, fn);
  }
  free(up);
  if (st) kvi__store_unlease(s, facts, n, false);
  return st;
}

void kvi__store_unlease(kvi_store *s, fact *const *facts, size_t n, bool used) {
  if (s->pool.host.npages == 0) return;
  for (size_t i = n; i-- > 0;) { /* the first named ends the most recent */
    facts[i]->pins--;
    if (used) kvi__store_touch(s, facts[i]);
  }
}

/* ---- put / remove --------------------------------------------------------- */

static void unlink_fact(kvi_store *s, fact *f) {
  tenant *t = f->owner;
  if (f->prev) f->prev->next = f->next;
  else t->head = f->next;
  if (f->next) f->next->prev = f->prev;
  if (s->emb_dim > 0) emb_remove(s, t, f);
  t->count--;
  if (t->count == 0 && t->pending == 0) { /* a replace keeps the tenant: its new fact is pending */
    kvi__map_del(&s->index.tenants, t->id, 0);
    emb_free(s, t, true);
    free(t);
  }
  kvi__map_del(&s->index.facts, f->tenant_id, f->id);
  lru_remove(s, f);
  release_pages(s, f->pages, f->npages);
  if (f->hpages) release_pages(s, f->hpages, f->npages);
  s->index.tokens_stored -= (uint64_t)f->tokens;
  s->index.pages_stored -= f->npages;
}

/* Inserts a fact whose `need` pages (off their free stack) hold its data,
 * replacing any fact with the same key. Takes ownership of f, pages and
 * fresh (a spare tenant record, or NULL when the tenant is in the store);
 * copies *emb into the tenant's matrix and frees it. Cannot fail: the
 * transaction has reserved everything. */
static void commit_fact(kvi_store *s, fact *f, uint32_t *pages, uint32_t need, tenant *fresh, float **emb,
                        uint64_t tenant_id, uint64_t fact_id, int32_t tokens) {
  fact *old = kvi__store_find(s, tenant_id, fact_id);
  size_t reuse = SIZE_MAX; /* the replaced fact's embedding row, which f takes over in place */
  if (old) {
    if (s->emb_dim > 0 && *emb && old->row != SIZE_MAX) {
      reuse = old->row;
      old->row = SIZE_MAX; /* unlink_fact moves no row */
    }
    unlink_fact(s, old);
    free_fact(old);
  }
  tenant *t = kvi__map_get(&s->index.tenants, tenant_id, 0);
  if (!t) {
    t = fresh;
    memset(t, 0, sizeof *t);
    t->id = tenant_id;
    kvi__map_put(&s->index.tenants, tenant_id, 0, t);
  } else {
    free(fresh);
  }
  if (tokens > t->max_tokens) t->max_tokens = tokens;
  f->tenant_id = tenant_id;
  f->id = fact_id;
  f->tokens = tokens;
  f->npages = need;
  f->pages = pages;
  f->row = SIZE_MAX;
  if (s->emb_dim > 0 && *emb) {
    if (reuse != SIZE_MAX || !s->shard.emb_sharded || kvi__emb_rank(tenant_id, fact_id, s->shard.size) == s->shard.rank) {
      emb_append(s, t, f, *emb, reuse);
    } else { /* checked, and kept by another rank: give back the row reserved for it */
      t->pending--;
      const size_t b = s->backend == KVI_BACKEND_CUDA ? stage_fact_bytes(s, tokens) : 0;
      s->emb.stage_reserved = s->emb.stage_reserved > b ? s->emb.stage_reserved - b : 0;
    }
  }
  free(*emb);
  *emb = NULL;
  f->owner = t;
  f->prev = NULL;
  f->next = t->head;
  if (t->head) t->head->prev = f;
  t->head = f;
  t->count++;
  f->hpages = NULL;
  f->in_lru = false;
  f->pins = 0;
  kvi__store_touch(s, f); /* a new device-tier fact counts as used */
  kvi__map_put(&s->index.facts, tenant_id, fact_id, f);
  s->index.tokens_stored += (uint64_t)tokens;
  s->index.pages_stored += need;
}

/* ---- the write transaction ------------------------------------------------ */

kvi_status kvi__txn_begin(kvi__txn *t, kvi_store *s, int32_t cap, kvi__place place, kvi__gate *gate,
                          struct CUstream_st *stream, const char *fn) {
  memset(t, 0, sizeof *t);
  t->s = s;
  t->place = place;
  t->gate = gate;
  t->stream = stream;
  t->fn = fn;
  t->cap = cap > 0 ? cap : 0;
  t->facts = calloc(cap > 0 ? (size_t)cap : 1, sizeof *t->facts);
  if (!t->facts) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %d-fact transaction", (int)cap);
  return KVI_OK;
}

kvi_status kvi__txn_add(kvi__txn *t, uint64_t tenant_id, uint64_t fact_id, int32_t tokens, uint32_t flags, float *emb) {
  kvi_store *s = t->s;
  const char *fn = t->fn;
  if (!t->facts || t->n >= t->cap || t->pages) {
    free(emb);
    return kvi__fail(KVI_ERR_INTERNAL, fn, "a fact added to a transaction that cannot take it");
  }
  const int32_t i = t->n++;
  kvi__txn_fact *x = &t->facts[i];
  x->tenant = tenant_id;
  x->id = fact_id;
  x->tokens = tokens;
  x->flags = flags;
  x->emb = emb;
  x->npages = pages_for(s, tokens);
  x->first = t->npages;
  if (t->npages > UINT32_MAX - x->npages) /* more than both tiers can hold */
    return kvi__fail(KVI_ERR_CAPACITY, fn, "the call's facts need more than 2^32 - 1 pages of %d tokens", (int)s->P);
  t->npages += x->npages;
  kvi_status st = kvi__map_reserve(&s->index.facts, (size_t)t->n, fn);
  if (st == KVI_OK) st = kvi__map_reserve(&s->index.tenants, (size_t)t->n, fn);
  if (st) return st;
  t->nrows = t->n; /* unreserved on abort, even if this fails part way */
  return reserve_rows(s, tenant_id, emb ? 1 : 0, tokens, fn);
}

/* Refuses a key the store holds that was added without KVI_PUT_REPLACE;
 * the keys are looked up 64 at a time (kvi__store_find_many prefetches). */
static kvi_status check_new(const kvi__txn *t) {
  for (int32_t i0 = 0; i0 < t->n; i0 += 64) {
    uint64_t tn[64], id[64];
    int32_t at[64], m = 0;
    const int32_t i1 = t->n - i0 < 64 ? t->n : i0 + 64;
    for (int32_t i = i0; i < i1; i++)
      if (!(t->facts[i].flags & KVI_PUT_REPLACE)) tn[m] = t->facts[i].tenant, id[m] = t->facts[i].id, at[m++] = i;
    fact *old[64];
    kvi__store_find_many(t->s, tn, 1, id, (size_t)m, old);
    for (int32_t k = 0; k < m; k++) {
      if (!old[k]) continue;
      if (t->item)
        return kvi__fail(KVI_ERR_EXISTS, t->fn,
                         "%s %d: fact %llu of tenant %llu is already stored (KVI_PUT_REPLACE replaces it)", t->item,
                         (int)at[k], (unsigned long long)id[k], (unsigned long long)tn[k]);
      return kvi__fail(KVI_ERR_EXISTS, t->fn,
                       "fact %llu of tenant %llu is already stored (pass KVI_PUT_REPLACE to replace it)",
                       (unsigned long long)id[k], (unsigned long long)tn[k]);
    }
  }
  return KVI_OK;
}

kvi_status kvi__txn_take_pages(kvi__txn *t) {
  kvi_store *s = t->s;
  const char *fn = t->fn;
  if (!t->facts || t->pages) return kvi__fail(KVI_ERR_INTERNAL, fn, "pages taken twice in one transaction");
  kvi_status st = check_new(t);
  if (st) return st;
  t->pages = malloc((t->npages ? t->npages : 1) * sizeof *t->pages);
  if (!t->pages) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %u page ids", t->npages);
  if (t->place == KVI__PLACE_DEVICE && s->backend == KVI_BACKEND_CUDA && s->pool.host.npages > 0) {
    /* the device tier, demoting least-recently-used facts if it is short */
    if ((st = pool_room(s, &s->pool.dev, 0, fn))) return st;
    st = tier_move(s, NULL, 0, t->npages, t->pages, t->stream, fn);
    if (st == KVI_OK) t->moved = true, t->ntaken = t->npages;
    return st;
  }
  if (t->place == KVI__PLACE_DEVICE) {
    if ((st = device_room(s, t->npages, fn))) return st;
    for (int32_t i = 0; i < t->n; i++) t->facts[i].into = &s->pool.dev;
    pool_take(&s->pool.dev, t->pages, t->npages);
    t->ntaken = t->npages;
    return KVI_OK;
  }
  for (int32_t i = 0; i < t->n; i++) { /* each fact where put_room finds room */
    kvi__txn_fact *x = &t->facts[i];
    if ((st = put_room(s, x->npages, &x->into, fn))) return st;
    pool_take(x->into, t->pages + x->first, x->npages);
    t->ntaken = x->first + x->npages;
  }
  return KVI_OK;
}

void kvi__txn_wrote(kvi__txn *t) { t->device_work = true; }

kvi_status kvi__txn_prepare(kvi__txn *t) {
  if (t->prepared) return KVI_OK;
  for (int32_t i = 0; i < t->n; i++) {
    kvi__txn_fact *x = &t->facts[i];
    /* a spare tenant only where the tenant differs from the previous fact's
     * (whose commit leaves its tenant in the store) */
    const bool spare = i == 0 || x->tenant != t->facts[i - 1].tenant;
    x->f = calloc(1, sizeof *x->f);
    x->pages = malloc((x->npages ? x->npages : 1) * sizeof *x->pages);
    if (spare) x->fresh = calloc(1, sizeof *x->fresh);
    if (!x->f || !x->pages || (spare && !x->fresh))
      return kvi__fail(KVI_ERR_OUT_OF_MEMORY, t->fn, "allocating fact metadata");
    memcpy(x->pages, t->pages + x->first, x->npages * sizeof *x->pages);
  }
  t->prepared = true;
  return KVI_OK;
}

/* Frees what the transaction still owns. */
static void txn_end(kvi__txn *t) {
  for (int32_t i = 0; t->facts && i < t->n; i++) {
    free(t->facts[i].f);
    free(t->facts[i].pages);
    free(t->facts[i].fresh);
    free(t->facts[i].emb);
  }
  free(t->facts);
  free(t->pages);
  t->facts = NULL;
  t->pages = NULL;
}

kvi_status kvi__txn_abort(kvi__txn *t, kvi_status why) {
  kvi_store *s = t->s;
  if (why == KVI_OK) why = kvi__fail(KVI_ERR_INTERNAL, t->fn, "a transaction aborted without a reason");
  if (t->gate && !t->decided) {
    t->decided = true;
    why = t->gate->decide(t->gate, why); /* every rank takes part, whatever happened here */
  }
  bool exact = !t->moved;
  if (exact && t->device_work && t->ntaken > 0) { /* the device may still be writing them */
    exact = kvi__cuda_sync(t->stream, t->fn) == KVI_OK;
  }
  if (exact && t->pages) { /* back onto their free stacks, as they were */
    for (int32_t i = t->n; i-- > 0;) {
      const kvi__txn_fact *x = &t->facts[i];
      if (x->first < t->ntaken) pool_untake(x->into, t->pages + x->first, x->npages);
    }
  } else if (t->pages) { /* after the device work already tracked */
    release_pages(s, t->pages, t->ntaken);
  }
  for (int32_t i = 0; i < t->nrows; i++) unreserve_rows(s, t->facts[i].tenant);
  txn_end(t);
  return why;
}

kvi_status kvi__txn_commit(kvi__txn *t) {
  kvi_store *s = t->s;
  kvi_status st = t->facts && (t->pages || t->n == 0) ? kvi__txn_prepare(t)
                                                      : kvi__fail(KVI_ERR_INTERNAL, t->fn, "a transaction without pages");
  if (t->gate) { /* every rank decides together, the pages taken and written */
    t->decided = true;
    st = t->gate->decide(t->gate, st);
  }
  if (st == KVI_OK && s->journal.ops) st = s->journal.ops->put(s->journal.ctx, t); /* durable before it is visible */
  if (st) return kvi__txn_abort(t, st);
  for (int32_t i = 0; i < t->n; i++) {
    kvi__txn_fact *x = &t->facts[i];
    commit_fact(s, x->f, x->pages, x->npages, x->fresh, &x->emb, x->tenant, x->id, x->tokens);
    x->f = NULL, x->pages = NULL, x->fresh = NULL; /* the store's now */
  }
  if (s->emb_dim > 0 && s->backend == KVI_BACKEND_CUDA) emb_flush(s); /* the facts' rows, in one launch */
  txn_end(t);
  return KVI_OK;
}

/* ---- put ------------------------------------------------------------------ */

static int cmp_key(const void *a, const void *b) {
  const uint64_t *x = a, *y = b;
  return x[0] != y[0] ? (x[0] > y[0]) - (x[0] < y[0]) : (x[1] > y[1]) - (x[1] < y[1]);
}

/* put_views' checks of the items before the store is locked. */
static kvi_status check_items(const kvi_store *store, const kvi__put_item *items, int32_t n, const char *fn) {
  const uint32_t largest = store->pool.dev.npages > store->pool.host.npages ? store->pool.dev.npages : store->pool.host.npages;
  for (int32_t i = 0; i < n; i++) {
    const uint32_t need = pages_for(store, items[i].v->num_tokens);
    if (need > largest)
      return kvi__fail(KVI_ERR_CAPACITY, fn, "%d tokens need %u pages of %d tokens; the store's largest tier has %u pages",
                       (int)items[i].v->num_tokens, need, (int)store->P, largest);
  }
  if (n < 2) return KVI_OK;
  /* a key twice in one call: which copy wins would be arbitrary */
  uint64_t *keys = malloc((size_t)n * 2 * sizeof *keys);
  if (!keys) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d keys", (int)n);
  for (int32_t i = 0; i < n; i++) keys[2 * i] = items[i].tenant, keys[2 * i + 1] = items[i].id;
  qsort(keys, (size_t)n, 2 * sizeof *keys, cmp_key);
  kvi_status st = KVI_OK;
  for (int32_t i = 1; i < n && st == KVI_OK; i++)
    if (keys[2 * i] == keys[2 * i - 2] && keys[2 * i + 1] == keys[2 * i - 1])
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "fact %llu of tenant %llu appears twice in one call",
                     (unsigned long long)keys[2 * i + 1], (unsigned long long)keys[2 * i]);
  free(keys);
  return st;
}

kvi_status kvi__store_write_pages(kvi_store *s, const uint32_t *pages, const kvi_kv_view *v, const float *scales,
                                  struct CUstream_st *stream, const char *fn) {
  return copy_fact(s, v, pages, v->num_tokens, true, (float *)scales, stream, fn);
}

kvi_status kvi__store_put_views(kvi_store *store, kvi__put_item *items, int32_t n, struct CUstream_st *stream,
                                kvi__gate *gate, const char *fn) {
  if (n < 1) return gate ? gate->decide(gate, KVI_OK) : KVI_OK;
  kvi_status st = check_items(store, items, n, fn);
  kvi__store_lock(store);
  kvi__txn t;
  if (st == KVI_OK) st = kvi__txn_begin(&t, store, n, KVI__PLACE_ANY, gate, stream, fn);
  else kvi__txn_begin(&t, store, 0, KVI__PLACE_ANY, gate, stream, fn);
  int32_t added = 0;
  for (; added < n && st == KVI_OK; added++) {
    st = kvi__txn_add(&t, items[added].tenant, items[added].id, items[added].v->num_tokens, items[added].flags,
                      items[added].emb);
    items[added].emb = NULL; /* the transaction's */
  }
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  bool copied = false;
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi_kv_view *v = items[i].v;
    st = kvi__store_write_pages(store, kvi__txn_pages(&t, i), v, NULL, stream, fn);
    if (st == KVI_OK && store->backend == KVI_BACKEND_CUDA && v->memory == KVI_MEMORY_DEVICE) copied = true;
  }
  if (copied) kvi__txn_wrote(&t);
  if (st == KVI_OK && copied) st = kvi__store_track(store, stream, fn);
  st = st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
  kvi__store_unlock(store);
  for (int32_t i = added; i < n; i++) {
    free(items[i].emb);
    items[i].emb = NULL;
  }
  return st;
}

kvi_status kvi__store_put_args(const kvi_store *store, const kvi_kv_view *v, const kvi_put_options *opts,
                               kvi_put_options *o, float **emb, struct CUstream_st *stream, const char *fn) {
  const kvi_put_options d = KVI_PUT_OPTIONS_INIT;
  *o = d;
  *emb = NULL;
  kvi_status st;
  if (opts && (st = kvi__read_struct(o, sizeof *o, opts, KVI__PUT_OPTIONS_V1, fn, "opts"))) return st;
  if (o->flags & ~KVI_PUT_REPLACE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->flags has unknown bits 0x%x", o->flags & ~KVI_PUT_REPLACE);
  if ((st = check_view_memory(store, v, fn, "kv->k", "kv->v"))) return st;
  return kvi__store_read_embedding(store, o->embedding, o->embedding_dtype, o->embedding_memory, stream, emb, fn);
}

kvi_status kvi__store_put(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *kv,
                          const kvi_put_options *opts, struct CUstream_st *stream, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_kv_view v;
  kvi_status st = kvi__view_check(&v, kv, &store->geom, false, fn);
  if (st) return st;
  kvi_put_options o;
  float *emb = NULL;
  if ((st = kvi__store_put_args(store, &v, opts, &o, &emb, stream, fn))) return st;
  kvi__put_item it = {tenant_id, fact_id, &v, o.flags, emb};
  return kvi__store_put_views(store, &it, 1, stream, NULL, fn);
}

kvi_status kvi__store_remove(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi__store_lock(store);
  fact *f = kvi__store_find(store, tenant_id, fact_id);
  const kvi_status st =
      f && store->journal.ops ? store->journal.ops->remove(store->journal.ctx, store, tenant_id, fact_id, fn) : KVI_OK;
  if (f && st == KVI_OK) unlink_fact(store, f);
  kvi__store_unlock(store);
  if (st) return st;
  if (!f)
    return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no fact %llu for tenant %llu", (unsigned long long)fact_id,
                     (unsigned long long)tenant_id);
  free_fact(f);
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* reads and queries                                                         */
/* ------------------------------------------------------------------------ */

static kvi_status not_found(const char *fn, uint64_t tenant_id, uint64_t fact_id) {
  return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no fact %llu for tenant %llu", (unsigned long long)fact_id,
                   (unsigned long long)tenant_id);
}

kvi_status kvi__store_read(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *dst,
                           struct CUstream_st *stream, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_kv_view v;
  kvi_status st = kvi__view_check(&v, dst, &store->geom, true, fn);
  if (st) return st;
  if ((st = check_view_memory(store, &v, fn, "dst->k", "dst->v"))) return st;
  kvi__store_lock(store);
  const fact *f = kvi__map_get(&store->index.facts, tenant_id, fact_id);
  if (!f) st = not_found(fn, tenant_id, fact_id);
  else if (f->tokens != v.num_tokens)
    st = kvi__fail(KVI_ERR_MISMATCH, fn, "dst->num_tokens is %d, the fact has %d tokens", (int)v.num_tokens,
                   (int)f->tokens);
  else if (store->backend == KVI_BACKEND_CUDA && v.memory == KVI_MEMORY_DEVICE)
    st = order_moves((kvi_store *)store, stream, fn); /* a move may still write them */
  if (st == KVI_OK && f)
    st = copy_fact(store, &v, f->pages, f->tokens, false, NULL, stream, fn);
  if (st == KVI_OK && f && store->backend == KVI_BACKEND_CUDA && v.memory == KVI_MEMORY_DEVICE)
    st = kvi__store_track((kvi_store *)store, stream, fn);
  kvi__store_unlock(store);
  return st;
}

kvi_status kvi__store_fact_tokens(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id,
                                  int32_t *out_tokens, const char *fn) {
  if (!store || !out_tokens)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_tokens" : "store");
  kvi__store_lock(store);
  const fact *f = kvi__map_get(&store->index.facts, tenant_id, fact_id);
  if (f) *out_tokens = f->tokens;
  kvi__store_unlock(store);
  return f ? KVI_OK : not_found(fn, tenant_id, fact_id);
}

kvi_status kvi__store_get_embedding(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, float *out,
                                    const char *fn) {
  if (!store || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out" : "store");
  if (store->emb_dim == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store was created with embedding_dim 0");
  kvi_store *s = (kvi_store *)store; /* a CUDA store waits on its embedding stream */
  const size_t rb = row_bytes(s);
  void *tmp = s->backend == KVI_BACKEND_CUDA ? malloc(rb) : NULL;
  if (s->backend == KVI_BACKEND_CUDA && !tmp) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", rb);
  kvi_status st = KVI_OK;
  kvi__store_lock(s);
  const fact *f = kvi__map_get(&s->index.facts, tenant_id, fact_id);
  if (!f) {
    st = not_found(fn, tenant_id, fact_id);
  } else if (f->row == SIZE_MAX && s->shard.emb_sharded) {
    st = kvi__fail(KVI_ERR_NOT_FOUND, fn, "the embedding of fact %llu of tenant %llu is kept by rank %d, not this rank (%d)",
                   (unsigned long long)fact_id, (unsigned long long)tenant_id,
                   (int)kvi__emb_rank(tenant_id, fact_id, s->shard.size), (int)s->shard.rank);
  } else if (f->row == SIZE_MAX) {
    st = kvi__fail(KVI_ERR_INTERNAL, fn, "fact %llu has no embedding row", (unsigned long long)fact_id);
  } else if (s->backend == KVI_BACKEND_CPU) {
    kvi__convert(out, KVI_DTYPE_FP32, (const char *)f->owner->emb + f->row * rb, s->emb.dtype, s->emb_dim);
  } else if (s->emb.err) {
    st = emb_failed(s, fn);
  } else {
    st = kvi__cuda_d2h(tmp, (const char *)f->owner->emb + f->row * rb, rb, s->emb.stream, fn);
    if (st == KVI_OK) st = kvi__cuda_sync(s->emb.stream, fn);
    if (st == KVI_OK) kvi__convert(out, KVI_DTYPE_FP32, tmp, s->emb.dtype, s->emb_dim);
  }
  kvi__store_unlock(s);
  free(tmp);
  return st;
}

/* for persist.c, the lock held: the row as kept, in fp32 (exact) */
kvi_status kvi__store_fact_embedding(const kvi_store *s, const struct fact *f, float *out, const char *fn) {
  const size_t rb = row_bytes(s);
  const char *row = (const char *)f->owner->emb + f->row * rb;
  if (s->backend == KVI_BACKEND_CPU) {
    kvi__convert(out, KVI_DTYPE_FP32, row, s->emb.dtype, s->emb_dim);
    return KVI_OK;
  }
  if (s->emb.err) return emb_failed(s, fn);
  void *tmp = malloc(rb);
  if (!tmp) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", rb);
  kvi_status st = kvi__cuda_d2h(tmp, row, rb, s->emb.stream, fn);
  if (st == KVI_OK) st = kvi__cuda_sync(s->emb.stream, fn);
  if (st == KVI_OK) kvi__convert(out, KVI_DTYPE_FP32, tmp, s->emb.dtype, s->emb_dim);
  free(tmp);
  return st;
}

kvi_status kvi__store_read_pages(const kvi_store *s, const uint32_t *pages, int32_t tokens, const kvi_kv_view *host,
                                 float *scales, const char *fn) {
  return copy_fact(s, host, pages, tokens, false, scales, NULL, fn);
}

kvi_status kvi__store_wait_device(kvi_store *s, const char *fn) { return reap(s, true, fn); }

kvi_status kvi__store_count(const kvi_store *store, uint64_t tenant_id, size_t *out_count, const char *fn) {
  if (!store || !out_count)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_count" : "store");
  kvi__store_lock(store);
  const tenant *t = kvi__map_get(&store->index.tenants, tenant_id, 0);
  *out_count = t ? t->count : 0;
  kvi__store_unlock(store);
  return KVI_OK;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

kvi_status kvi__store_list(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                           size_t *out_total, const char *fn) {
  if (!store || !out_total)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_total" : "store");
  if (capacity > 0 && !ids) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "ids is NULL and capacity is %zu", capacity);
  kvi_status st = KVI_OK;
  kvi__store_lock(store);
  const tenant *t = kvi__map_get(&store->index.tenants, tenant_id, 0);
  const size_t n = t ? t->count : 0;
  if (capacity > 0 && n > 0) {
    uint64_t *all = malloc(n * sizeof *all);
    if (!all) {
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu ids", n);
    } else {
      size_t i = 0;
      for (const fact *f = t->head; f; f = f->next) all[i++] = f->id;
      qsort(all, n, sizeof *all, cmp_u64);
      memcpy(ids, all, (capacity < n ? capacity : n) * sizeof *ids);
      free(all);
    }
  }
  kvi__store_unlock(store);
  if (st == KVI_OK) *out_total = n;
  return st;
}

kvi_status kvi__store_stats_get(const kvi_store *store, kvi_store_stats *out, const char *fn) {
  if (!store || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out" : "store");
  kvi_store_stats s = KVI_STORE_STATS_INIT;
  s.backend = store->backend;
  s.device = store->device;
  s.dtype = store->dtype;
  s.page_tokens = store->P;
  s.embedding_dim = store->emb_dim;
  s.page_bytes = store->page_bytes;
  kvi__store_lock(store);
  s.pages_host_total = store->pool.host.npages;
  s.pages_host_used = store->pool.host.npages - store->pool.host.nfree;
  s.pages_total = store->pool.dev.npages + s.pages_host_total;
  s.pages_used = store->pool.dev.npages - store->pool.dev.nfree + s.pages_host_used;
  s.promotions = store->tier.promotions;
  s.demotions = store->tier.demotions;
  s.facts = store->index.facts.len;
  s.tenants = store->index.tenants.len;
  /* the bytes of stored tokens, plus (fp8) the scales of their pages */
  const uint64_t token_bytes = store->page_elems / (uint64_t)store->P * kvi__dtype_size(store->dtype);
  s.bytes_payload = store->index.tokens_stored * token_bytes +
                    store->index.pages_stored * (store->page_bytes - (uint64_t)store->P * token_bytes);
  s.bytes_embeddings = store->emb.bytes;
  kvi__store_unlock(store);
  s.bytes_reserved = s.pages_total * s.page_bytes;
  s.bytes_used = s.pages_used * s.page_bytes;
  return kvi__write_struct(out, &s, sizeof s, STORE_STATS_V1, fn, "out");
}

/* The rank of a tensor-parallel group that keeps a fact's embedding (a
 * store with sharded embeddings): a fixed hash of its key. */
int32_t kvi__emb_rank(uint64_t tenant, uint64_t fact_id, int32_t size) {
  return (int32_t)(kvi__mix64(kvi__mix64(tenant) ^ fact_id) % (uint64_t)size);
}

int32_t kvi__store_embedding_rank(uint64_t tenant, uint64_t fact_id, int32_t tp_size) {
  return tp_size < 1 ? -1 : kvi__emb_rank(tenant, fact_id, tp_size);
}
