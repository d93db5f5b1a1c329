/*
 * The store's page pools and their deferred frees.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Page ids are global 32-bit indices into the store's page pools: the
 * first pool (device memory for a CUDA store, host memory for a CPU store)
 * holds ids [0, pool.npages); a CUDA store with a host budget has a second,
 * pinned and mapped host pool with the ids after them. A fact's pages are
 * all in one pool; moving it between tiers is copying its pages and swapping
 * its ids (tiers.c). Facts never change in place, so a fact promoted from
 * the host keeps its host pages as a clean copy, and demoting it again is
 * only a swap back.
 */
#include <stdlib.h>

#include "gpu/kernels.h"
#include "store/store_impl.h"

kvi_status kvi__pool_make_stacks(kvi_store *s, const char *fn) {
  const uint32_t npages = s->pool.dev.npages, hpages = s->pool.host.npages;
  s->pool.dev.free = malloc((size_t)npages * sizeof *s->pool.dev.free);
  s->pool.host.free = hpages ? malloc((size_t)hpages * sizeof *s->pool.host.free) : NULL;
  if (!s->pool.dev.free || (hpages && !s->pool.host.free))
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the page table for %llu pages", (unsigned long long)npages);
  for (uint32_t i = 0; i < npages; i++) s->pool.dev.free[i] = npages - 1 - i; /* pops 0, 1, 2, ... */
  for (uint32_t i = 0; i < hpages; i++) s->pool.host.free[i] = npages + hpages - 1 - i;
  return KVI_OK;
}

static pool *pool_of(kvi_store *s, uint32_t page) { return page_on_host_tier(s, page) ? &s->pool.host : &s->pool.dev; }

uint32_t kvi__pool_deferred(const kvi_store *s, const pool *p) {
  uint32_t n = 0;
  for (uint32_t i = 0; i < s->ndeferred; i++) n += (p == &s->pool.host) == page_on_host_tier(s, s->deferred_page[i]);
  return n;
}

kvi_status kvi__pool_reap(kvi_store *s, bool wait, const char *fn) {
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

void kvi__pool_release(kvi_store *s, const uint32_t *pages, uint32_t n) {
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

void kvi__pool_take(pool *p, uint32_t *out, uint32_t n) {
  for (uint32_t j = 0; j < n; j++) out[j] = p->free[--p->nfree];
}

void kvi__pool_untake(pool *p, const uint32_t *pages, uint32_t n) {
  for (uint32_t j = n; j-- > 0;) p->free[p->nfree++] = pages[j];
}

kvi_status kvi__pool_room(kvi_store *s, pool *p, uint64_t need, const char *fn) {
  kvi_status st = KVI_OK;
  if (s->ndeferred > 0) st = kvi__pool_reap(s, false, fn); /* cheap: queries events */
  if (st == KVI_OK && p->nfree < need && p->nfree + kvi__pool_deferred(s, p) >= need) st = kvi__pool_reap(s, true, fn);
  return st;
}

kvi_status kvi__pool_device_room(kvi_store *s, uint32_t need, const char *fn) {
  if (s->disk.ops) return kvi__disk_room(s, &s->pool.dev, need, fn); /* drops facts to disk when short */
  kvi_status st = kvi__pool_room(s, &s->pool.dev, need, fn);
  if (st) return st;
  if (s->pool.dev.nfree < need)
    return kvi__fail(KVI_ERR_CAPACITY, fn, "%u pages of %d tokens are needed; %u of %u pages are free", need,
                     (int)s->P, s->pool.dev.nfree, s->pool.dev.npages);
  return KVI_OK;
}

kvi_status kvi__store_wait_device(kvi_store *s, const char *fn) { return kvi__pool_reap(s, true, fn); }
