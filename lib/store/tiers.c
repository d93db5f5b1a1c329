/*
 * The tiers of a tiered CUDA store: the LRU list, tier moves (copies on the
 * copy stream, then the facts' page ids swapped), where a put goes,
 * prefetch, and the readers' leases that pin facts on the device.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "store/store_impl.h"

void kvi__tier_lru_remove(kvi_store *s, fact *f) {
  if (!f->in_lru) return;
  const int q = f->lru_list;
  if (f->lru_prev) f->lru_prev->lru_next = f->lru_next;
  else s->tier.lru_head[q] = f->lru_next;
  if (f->lru_next) f->lru_next->lru_prev = f->lru_prev;
  else s->tier.lru_tail[q] = f->lru_prev;
  f->lru_prev = f->lru_next = NULL;
  f->in_lru = false;
}

/* Whether the store keeps LRU lists (a tiered or disk-tier store): one per
 * tier, of the facts with pages there. Demotions and drops choose their
 * victims from a list's tail, so each tier gives up its least recently used
 * facts first, and finding them walks only that tier's victims. */
static bool lru_on(const kvi_store *s) { return s->pool.host.npages > 0 || s->disk.ops; }

/* f to the front of its tier's list (moved there from the other tier's when
 * its pages moved: a demoted fact is the host tier's most recent). */
void kvi__store_touch(kvi_store *s, fact *f) {
  if (!lru_on(s) || !f->pages) return;
  kvi__tier_lru_remove(s, f);
  const int q = fact_on_host(s, f) ? 1 : 0;
  f->lru_list = (uint8_t)q;
  f->lru_prev = NULL;
  f->lru_next = s->tier.lru_head[q];
  if (s->tier.lru_head[q]) s->tier.lru_head[q]->lru_prev = f;
  else s->tier.lru_tail[q] = f;
  s->tier.lru_head[q] = f;
  f->in_lru = true;
}

bool kvi__tier_move_outstanding(const kvi_store *s) {
  return s->tier.move_pending && kvi__events_pending(&s->track, s->tier.move_seq);
}

kvi_status kvi__tier_order_moves(kvi_store *s, struct CUstream_st *stream, const char *fn) {
  if (s->pool.host.npages == 0 || !kvi__tier_move_outstanding(s)) return KVI_OK;
  return kvi__events_order(&s->track, s->tier.move_seq, stream, fn);
}

/* Makes `on` wait for every tracked device operation that may still run. */
static kvi_status wait_tracked(kvi_store *s, struct CUstream_st *on, const char *fn) {
  return kvi__events_order_all(&s->track, on, fn);
}

/* Makes `need` host-tier pages free if it can: completed work first, then
 * the clean host copies of device-tier facts (most recently used first:
 * they are the last to be demoted), except those of pinned facts, then
 * (disk tier) host-tier facts dropped to disk. Without a disk tier it
 * leaves the shortage, if any, to the caller, having dropped nothing. */
static kvi_status host_room_copies(kvi_store *s, uint64_t need, const char *fn);
static kvi_status host_room(kvi_store *s, uint64_t need, const char *fn) {
  kvi_status st = host_room_copies(s, need, fn);
  if (st == KVI_OK && s->pool.host.nfree < need && s->disk.ops) st = kvi__disk_room(s, &s->pool.host, need, fn);
  return st;
}

static kvi_status host_room_copies(kvi_store *s, uint64_t need, const char *fn) {
  kvi_status st = kvi__pool_room(s, &s->pool.host, need, fn);
  if (st || s->pool.host.nfree >= need) return st;
  uint64_t have = (uint64_t)s->pool.host.nfree + kvi__pool_deferred(s, &s->pool.host), drop = 0;
  for (fact *f = s->tier.lru_head[0]; f && have + drop < need; f = f->lru_next)
    if (f->hpages && !f->pins) drop += f->npages;
  if (have + drop < need) return KVI_OK;
  for (fact *f = s->tier.lru_head[0]; f && have < need; f = f->lru_next)
    if (f->hpages && !f->pins) {
      kvi__pool_release(s, f->hpages, f->npages); /* after any copy still reading them */
      have += f->npages;
      free(f->hpages);
      f->hpages = NULL;
    }
  return kvi__pool_room(s, &s->pool.host, need, fn);
}

/* ---- the disk tier's drops and reads back --------------------------------- */

/* Drops f's pages (and a clean host copy): f stays indexed, on disk only. */
static void drop_to_disk(kvi_store *s, fact *f) {
  kvi__tier_lru_remove(s, f);
  kvi__pool_release(s, f->pages, f->npages); /* after device work still reading them */
  if (f->hpages) kvi__pool_release(s, f->hpages, f->npages);
  free(f->pages);
  free(f->hpages);
  f->pages = f->hpages = NULL;
  s->index.pages_stored -= f->npages;
  f->owner->on_disk++, s->index.on_disk++;
  kvi__disk_note(s, f->owner);
  s->disk.drops++;
}

/* Whether f may be dropped from pool p now: it has a copy on disk, no lease
 * pins it, and its pages are in p. */
static bool droppable(const kvi_store *s, const fact *f, const pool *p) {
  return f->pages && f->disk_entry && !f->pins && (p == &s->pool.host) == fact_on_host(s, f);
}

/* The facts to drop from pool p for `need` free pages, least recently used
 * first (from the tail of p's tier's list); with drop false only counted.
 * Returns the pages they free (stopping at `want`). */
static uint64_t drop_candidates(kvi_store *s, pool *p, uint64_t want, bool drop) {
  uint64_t got = 0;
  for (fact *f = s->tier.lru_tail[p == &s->pool.host ? 1 : 0], *prev; f && got < want; f = prev) {
    prev = f->lru_prev;
    if (!droppable(s, f, p)) continue;
    got += f->npages;
    if (drop) drop_to_disk(s, f);
  }
  return got;
}

/* Makes `need` pages of pool p free, dropping facts to disk when it must
 * (nothing dropped when that cannot make enough). */
kvi_status kvi__disk_room(kvi_store *s, pool *p, uint64_t need, const char *fn) {
  kvi_status st = kvi__pool_room(s, p, need, fn);
  if (st || p->nfree >= need || !s->disk.ops) return st;
  uint64_t have = (uint64_t)p->nfree + kvi__pool_deferred(s, p);
  if (s->disk.jobs && have + drop_candidates(s, p, need - have, false) < need) {
    kvi__disk_settle_all(s, fn); /* reads back in flight hold pages: finished, their facts may drop */
    have = (uint64_t)p->nfree + kvi__pool_deferred(s, p);
  }
  if (have + drop_candidates(s, p, need - have, false) < need)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "%llu pages of %d tokens are needed in %s; %u of %u are free, the rest held by facts this call "
                     "uses or waiting for in-flight work",
                     (unsigned long long)need, (int)s->P,
                     p == &s->pool.host ? "the host tier" : s->backend == KVI_BACKEND_CUDA ? "the device tier" : "memory",
                     p->nfree, p->npages);
  drop_candidates(s, p, need - have, true);
  return kvi__pool_room(s, p, need, fn);
}

void kvi__disk_note(kvi_store *s, tenant *t) {
  if (!s->disk.ops || t->disk_changed || s->disk.changed_all) return;
  if (s->disk.nchanged == s->disk.cchanged) {
    const size_t cap = s->disk.cchanged ? 2 * s->disk.cchanged : 64;
    uint64_t *p = realloc(s->disk.changed, cap * sizeof *p);
    if (!p) { /* nothing lost: the next kvi_store_disk_changes lists every tenant */
      s->disk.changed_all = true;
      return;
    }
    s->disk.changed = p, s->disk.cchanged = cap;
  }
  s->disk.changed[s->disk.nchanged++] = t->id;
  t->disk_changed = true;
}

kvi_status kvi__store_disk_changes(kvi_store *store, uint64_t *tenants, size_t capacity, size_t *count,
                                   const char *fn) {
  if (!store || !count)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !store ? "store" : "count");
  if (capacity > 0 && !tenants) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "tenants is NULL and capacity is %zu", capacity);
  kvi__store_lock(store);
  kvi_status st = KVI_OK;
  if (store->disk.changed_all) { /* every tenant, once */
    const kvi__map *m = &store->index.tenants;
    uint64_t *all = malloc((m->len ? m->len : 1) * sizeof *all);
    if (!all) {
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu tenant ids", m->len);
    } else {
      size_t n = 0;
      for (size_t i = 0; i < m->cap; i++) {
        tenant *t = m->slots[i].val;
        if (!t) continue;
        all[n++] = t->id;
        t->disk_changed = true;
      }
      free(store->disk.changed);
      store->disk.changed = all, store->disk.nchanged = n, store->disk.cchanged = m->len ? m->len : 1;
      store->disk.changed_all = false;
    }
  }
  if (st == KVI_OK) {
    const size_t n = store->disk.nchanged < capacity ? store->disk.nchanged : capacity;
    for (size_t i = 0; i < n; i++) {
      tenants[i] = store->disk.changed[i];
      tenant *t = kvi__store_tenant(store, tenants[i]);
      if (t) t->disk_changed = false;
    }
    memmove(store->disk.changed, store->disk.changed + n, (store->disk.nchanged - n) * sizeof *store->disk.changed);
    store->disk.nchanged -= n;
    *count = n;
  }
  kvi__store_unlock(store);
  return st;
}

kvi_status kvi__disk_claim(kvi_store *s, uint64_t tenant, const char *fn) {
  return s->disk.ops ? s->disk.ops->claim(s->disk.ctx, s, tenant, fn) : KVI_OK;
}

/* Enqueues, on the copy stream, the copy of a fact of `tokens` tokens from
 * pages src to pages dst (the other tier): runs of consecutive whole pages
 * as one copy each; a last page that is only partly used as one pitched
 * copy of its used rows (each (layer, K/V, head) run holds P rows of D
 * elements, the first `used` of which are the fact's), and on a quantized store
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
    const size_t row = (size_t)kvi__dtype_bytes(s->dtype, (uint64_t)s->geom.head_size), pitch = (size_t)s->P * row;
    char *d = page_addr(s, dst[n - 1]);
    const char *from = page_addr(s, src[n - 1]);
    st = kvi__cuda_copy2d(d, pitch, from, pitch, used * row, (size_t)s->geom.num_layers * 2u * (size_t)s->geom.local_heads,
                          s->copy_stream, fn);
    if (st == KVI_OK && s->scale_off)
      st = kvi__cuda_copy(d + s->scale_off, from + s->scale_off, (size_t)(s->page_bytes - s->scale_off), s->copy_stream,
                          fn);
  }
  return st;
}

uint64_t kvi__store_evictable(const kvi_store *s, uint64_t cap) {
  uint64_t n = 0;
  for (const fact *f = s->tier.lru_tail[0]; f && n < cap; f = f->lru_prev)
    if (!f->pins) n += f->npages;
  return n;
}

size_t kvi__store_victims(const kvi_store *s, uint64_t need, fact **out) {
  uint64_t got = 0;
  size_t n = 0;
  for (fact *f = s->tier.lru_tail[0]; f && s->pool.dev.nfree + got < need; f = f->lru_prev)
    if (!f->pins) {
      got += f->npages;
      if (out) out[n] = f;
      n++;
    }
  return n;
}

kvi_status kvi__tier_move(kvi_store *s, fact *const *up, size_t nup, uint32_t extra, uint32_t *extra_pages,
                          struct CUstream_st *stream, const char *fn) {
  uint64_t need = extra;
  for (size_t i = 0; i < nup; i++) need += up[i]->npages;
  if (need == 0) return KVI_OK;
  kvi_status st = kvi__pool_room(s, &s->pool.dev, need, fn);
  if (st) return st;
  /* victims: device-tier facts the call does not use, least recently used first */
  const uint64_t evictable = s->pool.dev.nfree < need ? kvi__store_evictable(s, need - s->pool.dev.nfree) : 0;
  if (s->pool.dev.nfree + evictable < need)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "%llu pages must be on the device at once; the device tier has %u pages: %u free, %llu held by "
                     "facts that may move down, %u waiting for in-flight work, the rest held by the facts of this call",
                     (unsigned long long)need, s->pool.dev.npages, s->pool.dev.nfree, (unsigned long long)evictable,
                     kvi__pool_deferred(s, &s->pool.dev));
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
                     (unsigned long long)down, s->pool.host.nfree, s->pool.host.npages,
                     kvi__pool_deferred(s, &s->pool.host));
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
    f->pins--;
    kvi__store_touch(s, f); /* onto the host tier's list, its most recent (victims come least recent first) */
    s->tier.demotions++;
  }
  for (size_t i = 0; i < nup; i++) {
    fact *f = up[i];
    f->hpages = f->pages; /* the clean copy stays */
    f->pages = newp[i];
    kvi__store_touch(s, f);
    s->tier.promotions++;
  }
  if (got > need - nf) kvi__pool_release(s, avail + (need - nf), (uint32_t)(got - (need - nf))); /* after the copies */
  if (st != KVI_OK && extra > 0) kvi__pool_release(s, extra_pages, extra); /* the caller fails: not taken */
  free(newp);
  free(vict);
  free(avail);
  free(hdst);
  return st;
}

kvi_status kvi__tier_put_room(kvi_store *s, uint32_t need, pool **into, const char *fn) {
  kvi_status st = KVI_OK;
  if (s->ndeferred > 0 && (st = kvi__pool_reap(s, false, fn))) return st;
  *into = &s->pool.dev;
  if (s->pool.dev.nfree >= need) return KVI_OK;
  *into = &s->pool.host;
  if (s->pool.host.npages > 0 && s->pool.host.nfree >= need) return KVI_OK;
  *into = &s->pool.dev;
  if ((st = kvi__pool_room(s, &s->pool.dev, need, fn)) || s->pool.dev.nfree >= need) return st;
  if (s->pool.host.npages > 0) {
    *into = &s->pool.host;
    if ((st = host_room(s, need, fn)) || s->pool.host.nfree >= need) return st;
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "%u pages of %d tokens are needed; the device tier has %u of %u pages free, the host tier %u of %u",
                     need, (int)s->P, s->pool.dev.nfree, s->pool.dev.npages, s->pool.host.nfree, s->pool.host.npages);
  }
  if (s->disk.ops) return kvi__disk_room(s, &s->pool.dev, need, fn);
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
  if (store->disk.ops) st = kvi__disk_drain(store, fn); /* reads the I/O thread finished (CUDA stores) */
  if (st == KVI_OK && store->disk.ops && !fact_ids) st = store->disk.ops->open(store->disk.ctx, store, tenant_id, fn);
  const tenant *t = kvi__map_get(&store->index.tenants, tenant_id, 0);
  const size_t n = fact_ids ? (size_t)count : t ? t->count : 0;
  fact **list = malloc((n ? 2 * n : 1) * sizeof *list), **up = list ? list + n : NULL; /* up: the facts to move */
  if (!list) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu fact references", n);
  size_t m = 0;
  if (st == KVI_OK && fact_ids) {
    kvi__map_get_many(&store->index.facts, &tenant_id, 0, fact_ids, n, (void **)list);
    for (; m < n && st == KVI_OK; m++)
      if (!list[m]) st = kvi__store_not_found(fn, tenant_id, fact_ids[m]);
  } else if (st == KVI_OK && t) {
    for (fact *f = t->head; f; f = f->next) list[m++] = f;
  }
  if (st == KVI_OK && store->disk.ops && m > 0) { /* read back from disk, in order, what fits */
    for (size_t i = 0; i < m; i++) list[i]->pins++; /* none of them is dropped for another */
    for (size_t i = 0; i < m && st == KVI_OK; i++) {
      if (list[i]->pages || list[i]->loading) continue;
      st = kvi__disk_start(store, list[i], fn); /* read by the store's I/O thread */
      if (st == KVI_ERR_CAPACITY) { /* memory is full of facts of this list: the prefix that fits is coming */
        st = KVI_OK;
        break;
      }
    }
    for (size_t i = 0; i < m; i++) list[i]->pins--;
  }
  if (st == KVI_OK && store->pool.host.npages > 0 && m > 0) {
    for (size_t i = 0; i < m; i++) list[i]->pins++; /* none of them moves down */
    /* the longest prefix that fits beside the facts it must not move down */
    uint64_t want = 0, need = 0;
    for (size_t i = 0; i < m; i++)
      if (fact_on_host(store, list[i])) want += list[i]->npages;
    const uint64_t have = (uint64_t)store->pool.dev.nfree + kvi__pool_deferred(store, &store->pool.dev);
    const uint64_t room = have + (have < want ? kvi__store_evictable(store, want - have) : 0);
    for (size_t i = m; i-- > 0;) /* named facts already on the device become the most recent, the first first */
      kvi__store_touch(store, list[i]);
    size_t nup = 0;
    for (size_t i = 0; i < m; i++) {
      if (!fact_on_host(store, list[i])) continue; /* on the device, or on disk (what did not fit) */
      if (need + list[i]->npages > room) break;
      need += list[i]->npages;
      up[nup++] = list[i];
    }
    if (nup > 0) {
      st = kvi__cuda_event_record(store->tier.prefetch_ev, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_stream_wait(store->copy_stream, store->tier.prefetch_ev, fn);
      if (st == KVI_OK) st = kvi__tier_move(store, up, nup, 0, NULL, store->copy_stream, fn);
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
  if (!lru_on(s)) return KVI_OK;
  promote = promote && s->pool.host.npages > 0;
  fact **up = promote ? malloc((n ? n : 1) * sizeof *up) : NULL;
  if (promote && !up) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu fact references", n);
  size_t nup = 0;
  for (size_t i = 0; i < n; i++) /* each once */
    if (facts[i]->pins++ == 0 && promote) up[nup++] = facts[i];
  /* facts on disk only are read back first (onto the host tier of a tiered store) */
  kvi_status st = kvi__disk_resident(s, facts, n, fn);
  size_t k = 0;
  for (size_t i = 0; i < nup; i++)
    if (fact_on_host(s, up[i])) up[k++] = up[i];
  nup = k;
  if (st == KVI_OK && s->backend == KVI_BACKEND_CUDA && s->pool.host.npages > 0) {
    st = kvi__tier_order_moves(s, stream, fn);
    if (st == KVI_OK && nup > 0) st = kvi__tier_move(s, up, nup, 0, NULL, stream, fn);
  }
  free(up);
  if (st) kvi__store_unlease(s, facts, n, false);
  return st;
}

void kvi__store_unlease(kvi_store *s, fact *const *facts, size_t n, bool used) {
  if (!lru_on(s)) return;
  for (size_t i = n; i-- > 0;) { /* the first named ends the most recent */
    facts[i]->pins--;
    if (used) kvi__store_touch(s, facts[i]);
  }
}
