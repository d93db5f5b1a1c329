/*
 * kvi_store: facts keyed by (tenant, fact id), stored in fixed-size pages
 * cut from memory reserved once at creation.
 * SPDX-License-Identifier: Apache-2.0
 *
 * This file creates and destroys a store. Its other files (store_impl.h
 * lists what they share): copy.c, the copies between views and pages;
 * embeddings.c, the embedding state and the tenants' matrices; pools.c, the
 * page pools and deferred frees; tiers.c, tier moves, prefetch and leases;
 * txn.c, the write transaction; put.c, facts in and out of the index, put
 * and remove; read.c, reads and queries.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "kvi_build_config.h"
#include "store/store_impl.h"

/* Pinned staging for host-memory puts and reads on a CUDA store. */
#define STAGING_TARGET_BYTES (8u << 20)

/* ------------------------------------------------------------------------ */
/* small helpers                                                            */
/* ------------------------------------------------------------------------ */

int kvi__store_device(const kvi_store *s) { return s && s->backend == KVI_BACKEND_CUDA ? s->device : -1; }

void kvi__store_lock(const kvi_store *s) { pthread_mutex_lock((pthread_mutex_t *)&s->lock); }
void kvi__store_unlock(const kvi_store *s) { pthread_mutex_unlock((pthread_mutex_t *)&s->lock); }

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
    }
  } else {
    free(s->pool.dev.base);
  }
  kvi__emb_release(s, device_ok);
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
  if (st == KVI_OK && s->emb_dim > 0) st = kvi__emb_init(s, fn);
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
  uint64_t page_elems, page_bytes, scale_off, scale_bytes;
  uint64_t npages, hpages;
  bool fp8, q4;
} page_layout;

/* kvi_store_options' checks that need no backend; the page layout. */
static kvi_status check_options(const kvi_store_options *o, const kvi__geom *g, page_layout *pl, const char *fn) {
  if (o->dtype == KVI_DTYPE_FP8_E5M2)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "fp8 e5m2 fact storage is not supported; use KVI_DTYPE_FP8_E4M3");
  if (!kvi__dtype_is_float(o->dtype) && o->dtype != KVI_DTYPE_FP8_E4M3 && o->dtype != KVI_DTYPE_Q4)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->dtype is %d, expected KVI_DTYPE_BF16, FP16, FP32, FP8_E4M3 or Q4", (int)o->dtype);
  if (o->dtype == KVI_DTYPE_Q4 && g->head_size % 2)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn,
                     "4-bit storage packs two elements a byte: the model's head size (%d) must be even",
                     (int)g->head_size);
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
  /* quantized stores: the elements (fp8: e4m3 bytes; q4: two codes a byte),
   * then the scales (fp8: one fp32 per (layer, plane, head), then one fp16
   * offset per key channel of each (layer, head): base/fp8.h; q4: one word
   * per key channel and per value token of each (layer, head): base/q4.h),
   * each part 16-byte aligned so every page keeps the kernels' vector
   * alignment */
  pl->fp8 = o->dtype == KVI_DTYPE_FP8_E4M3;
  pl->q4 = o->dtype == KVI_DTYPE_Q4;
  pl->scale_bytes = kvi__page_scale_bytes(o->dtype, g->num_layers, g->local_heads, g->head_size, o->page_tokens);
  const uint64_t elem_bytes = kvi__dtype_bytes(o->dtype, pl->page_elems);
  pl->scale_off = pl->scale_bytes ? (elem_bytes + 15u) & ~(uint64_t)15u : 0;
  const uint64_t meta = pl->fp8 ? kvi__fp8_page_meta(g->num_layers, g->local_heads, g->head_size)
                                : (pl->scale_bytes + 15u) & ~(uint64_t)15u;
  pl->page_bytes = pl->scale_bytes ? pl->scale_off + meta : elem_bytes;
  if (o->budget_bytes < pl->page_bytes)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->budget_bytes is %llu, smaller than one page (%llu bytes: %d tokens x %d layers x 2 x "
                     "%d heads x %d x %s bytes%s)",
                     (unsigned long long)o->budget_bytes, (unsigned long long)pl->page_bytes, (int)o->page_tokens,
                     (int)g->num_layers, (int)g->local_heads, (int)g->head_size,
                     pl->q4 ? "1/2" : o->dtype == KVI_DTYPE_FP32 ? "4" : pl->fp8 ? "1" : "2",
                     pl->scale_bytes ? ", then the scales" : "");
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
  /* a disk-tier store's facts change pages when dropped and read back: no
   * device directory of page ids (as a tiered store's) */
  kvi__emb_setup(s, o, pl->hpages > 0 || o->disk_dir != NULL);
  s->page_elems = pl->page_elems;
  s->page_bytes = pl->page_bytes;
  s->fp8 = pl->fp8;
  s->q4 = pl->q4;
  s->scale_off = pl->scale_off;
  s->scale_bytes = pl->scale_bytes;
  s->pool.dev.tier = s->backend == KVI_BACKEND_CUDA ? TIER_DEVICE : TIER_HOST;
  s->pool.dev.npages = (uint32_t)pl->npages;
  s->pool.dev.nfree = (uint32_t)pl->npages;
  s->pool.host.tier = TIER_HOST;
  s->pool.host.npages = (uint32_t)pl->hpages;
  s->pool.host.nfree = (uint32_t)pl->hpages;
  s->shard.size = 1;
}

kvi_status kvi__store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts,
                             const char *fn) {
  const kvi_store_options o = *opts;
  const kvi__geom *g = &model->geom;
  page_layout pl;
  memset(&pl, 0, sizeof pl);
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
  if ((st = kvi__pool_make_stacks(s, fn))) {
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

void kvi__store_destroy(kvi_store *store, bool device_ok) {
  if (!store) return;
  if (store->search.release) store->search.release(store, device_ok);
  kvi__disk_stop(store); /* before the facts its jobs read go */
  for (size_t i = 0; i < store->index.facts.cap; i++)
    if (store->index.facts.slots[i].val) kvi__fact_free(store->index.facts.slots[i].val);
  for (size_t i = 0; i < store->index.tenants.cap; i++) {
    tenant *t = store->index.tenants.slots[i].val;
    if (t) kvi__emb_free(store, t, device_ok);
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
  if (store->disk.ops) store->disk.ops->release(store->disk.ctx);
  free(store->disk.changed);
  free(store);
}
