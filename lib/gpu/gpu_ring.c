/*
 * libkvinject — the GPU plumbing every CUDA handle shares: an event tracker
 * (numbered events recorded in turn), a pinned staging ring whose slots are
 * guarded by the tracker's events, and a mapped async-error counter.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Users: the store tracks its device operations (deferred frees, tier moves)
 * with a tracker of KVI__TRACK_EVENTS; every ring slot has a tracker of one
 * event. The store's host copies (one slot), its
 * embedding rows put from the host (one growing slot), the search's uploads
 * (four growing slots, held across the wait for host results) and the
 * injector's plans (two fixed slots with device buffers) are staging rings;
 * the injector's skipped tokens and the search's bad queries are async
 * counters.
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu.h"

/* ---- event tracker ---------------------------------------------------------- */

kvi_status kvi__events_init(kvi__events *t, uint32_t n, const char *fn) {
  memset(t, 0, sizeof *t);
  t->ev = calloc(n, sizeof *t->ev);
  if (!t->ev) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %u events", n);
  t->n = n;
  for (uint32_t i = 0; i < n; i++) {
    kvi_status st = kvi__cuda_event_create(&t->ev[i], fn);
    if (st) {
      kvi__events_destroy(t);
      return st;
    }
  }
  return KVI_OK;
}

void kvi__events_destroy(kvi__events *t) {
  for (uint32_t i = 0; t->ev && i < t->n; i++) kvi__cuda_event_destroy(t->ev[i]);
  free(t->ev);
  memset(t, 0, sizeof *t);
}

kvi_status kvi__events_record(kvi__events *t, struct CUstream_st *s, uint64_t *seq, const char *fn) {
  kvi_status st;
  if (t->next - t->done == t->n) { /* every event in flight: wait for the oldest */
    if ((st = kvi__cuda_event_sync(t->ev[t->done % t->n], fn))) return st;
    t->done++;
  }
  if ((st = kvi__cuda_event_record(t->ev[t->next % t->n], s, fn))) return st;
  if (seq) *seq = t->next;
  t->next++;
  return KVI_OK;
}

kvi_status kvi__events_retire(kvi__events *t, bool wait, const char *fn) {
  while (t->done < t->next) {
    struct CUevent_st *e = t->ev[t->done % t->n];
    if (wait) {
      kvi_status st = kvi__cuda_event_sync(e, fn);
      if (st) return st;
    } else if (!kvi__cuda_event_done(e)) {
      break;
    }
    t->done++;
  }
  return KVI_OK;
}

bool kvi__events_pending(const kvi__events *t, uint64_t q) {
  return q >= t->done && q < t->next && !kvi__cuda_event_done(t->ev[q % t->n]);
}

kvi_status kvi__events_sync(kvi__events *t, uint64_t q, const char *fn) {
  if (q >= t->done && q < t->next) {
    kvi_status st = kvi__cuda_event_sync(t->ev[q % t->n], fn);
    if (st) return st;
  }
  return kvi__events_retire(t, false, fn);
}

kvi_status kvi__events_order(const kvi__events *t, uint64_t q, struct CUstream_st *on, const char *fn) {
  if (!kvi__events_pending(t, q)) return KVI_OK;
  return kvi__cuda_stream_wait(on, t->ev[q % t->n], fn);
}

kvi_status kvi__events_order_all(const kvi__events *t, struct CUstream_st *on, const char *fn) {
  for (uint64_t q = t->done; q < t->next; q++) {
    kvi_status st = kvi__events_order(t, q, on, fn);
    if (st) return st;
  }
  return KVI_OK;
}

/* ---- pinned staging ring ------------------------------------------------------ */

/* Gives slot sl fresh memory of `bytes` (its old memory is not in use). */
static kvi_status slot_alloc(kvi__ring *r, kvi__ring_slot *sl, size_t bytes, const char *fn) {
  char *h = NULL, *d = NULL;
  kvi_status st = kvi__cuda_host_alloc((void **)&h, bytes, fn);
  if (st == KVI_OK && (r->flags & KVI__RING_DEVICE) && (st = kvi__cuda_malloc((void **)&d, bytes, fn)))
    kvi__cuda_host_free(h);
  if (st) return st;
  kvi__cuda_host_free(sl->host);
  kvi__cuda_free(sl->dev);
  sl->host = h;
  sl->dev = d;
  sl->bytes = bytes;
  return KVI_OK;
}

kvi_status kvi__ring_init(kvi__ring *r, int n, size_t bytes, unsigned flags, const char *fn) {
  memset(r, 0, sizeof *r);
  r->slot = calloc((size_t)n, sizeof *r->slot);
  if (!r->slot) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d staging slots", n);
  r->n = n;
  r->flags = flags;
  if (pthread_cond_init(&r->cond, NULL) != 0) {
    kvi__ring_destroy(r, fn);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "initializing a condition variable");
  }
  r->has_cond = true;
  kvi_status st = KVI_OK;
  for (int i = 0; i < n && st == KVI_OK; i++) {
    st = kvi__events_init(&r->slot[i].ev, 1, fn);
    if (st == KVI_OK && bytes > 0) st = slot_alloc(r, &r->slot[i], bytes, fn);
  }
  if (st) kvi__ring_destroy(r, fn);
  return st;
}

void kvi__ring_destroy(kvi__ring *r, const char *fn) {
  for (int i = 0; r->slot && i < r->n; i++) {
    kvi__ring_slot *sl = &r->slot[i];
    if (sl->ev.ev) kvi__events_retire(&sl->ev, true, fn); /* its copies or launches */
    kvi__cuda_host_free(sl->host);
    kvi__cuda_free(sl->dev);
    kvi__events_destroy(&sl->ev);
  }
  if (r->has_cond) pthread_cond_destroy(&r->cond);
  free(r->slot);
  memset(r, 0, sizeof *r);
}

kvi_status kvi__ring_acquire(kvi__ring *r, size_t bytes, pthread_mutex_t *lock, kvi__ring_slot **out,
                             const char *fn) {
  kvi__ring_slot *sl = NULL;
  for (;;) {
    for (int i = 0; i < r->n && !sl; i++) {
      kvi__ring_slot *c = &r->slot[(r->next + i) % r->n];
      if (!c->held) {
        sl = c;
        r->next = (int)((c - r->slot) + 1) % r->n;
      }
    }
    if (sl) break;
    if (!lock) return kvi__fail(KVI_ERR_INTERNAL, fn, "every staging slot is held");
    pthread_cond_wait(&r->cond, lock);
  }
  kvi_status st = kvi__events_retire(&sl->ev, true, fn); /* its last copy or launch */
  if (st) return st;
  if (sl->bytes < bytes) {
    if (!(r->flags & KVI__RING_GROW))
      return kvi__fail(KVI_ERR_INTERNAL, fn, "%zu bytes asked of a %zu-byte staging slot", bytes, sl->bytes);
    if ((st = slot_alloc(r, sl, bytes > 2 * sl->bytes ? bytes : 2 * sl->bytes, fn))) return st;
  }
  if (lock) sl->held = true;
  *out = sl;
  return KVI_OK;
}

kvi_status kvi__ring_record(kvi__ring_slot *sl, struct CUstream_st *s, const char *fn) {
  if (sl->ev.next > sl->ev.done) /* recorded since the acquire: the event moves to the later point */
    return kvi__cuda_event_record(sl->ev.ev[0], s, fn);
  return kvi__events_record(&sl->ev, s, NULL, fn);
}

kvi_status kvi__ring_wait(kvi__ring_slot *sl, const char *fn) { return kvi__events_retire(&sl->ev, true, fn); }

void kvi__ring_release(kvi__ring *r, kvi__ring_slot *sl) {
  sl->held = false;
  pthread_cond_broadcast(&r->cond);
}

/* ---- mapped async-error counter ------------------------------------------------ */

kvi_status kvi__async_count_init(kvi__async_count *c, const char *fn) {
  memset(c, 0, sizeof *c);
  kvi_status st = kvi__cuda_host_alloc_mapped((void **)&c->host, (void **)&c->dev, 64, fn);
  if (st) {
    memset(c, 0, sizeof *c);
    return st;
  }
  *c->host = 0;
  return KVI_OK;
}

void kvi__async_count_destroy(kvi__async_count *c) {
  kvi__cuda_host_free(c->host);
  memset(c, 0, sizeof *c);
}

int64_t kvi__async_count_take(kvi__async_count *c) {
  if (!c->host) return 0;
  const unsigned long long now = *(volatile unsigned long long *)c->host;
  const int64_t d = (int64_t)(now - c->taken);
  c->taken = now;
  return d;
}
