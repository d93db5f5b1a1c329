/*
 * The store's write transaction (store.h: kvi__txn_*): every change that
 * adds facts, all or nothing.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "store/store_impl.h"

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
  if (t->place != KVI__PLACE_DISK) t->npages += x->npages; /* on disk: none taken */
  kvi_status st = kvi__map_reserve(&s->index.facts, (size_t)t->n, fn);
  if (st == KVI_OK) st = kvi__map_reserve(&s->index.tenants, (size_t)t->n, fn);
  if (st) return st;
  t->nrows = t->n; /* unreserved on abort, even if this fails part way */
  return kvi__emb_reserve_rows(s, tenant_id, emb ? 1 : 0, tokens, fn);
}

kvi_status kvi__txn_token_ids(kvi__txn *t, const int32_t *ids) {
  if (!ids) return KVI_OK;
  if (!t->facts || t->n < 1 || t->facts[t->n - 1].ids)
    return kvi__fail(KVI_ERR_INTERNAL, t->fn, "token ids given to a transaction without a fact for them");
  kvi__txn_fact *x = &t->facts[t->n - 1];
  x->ids = malloc((size_t)x->tokens * sizeof *x->ids);
  if (!x->ids) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, t->fn, "allocating %d token ids", (int)x->tokens);
  memcpy(x->ids, ids, (size_t)x->tokens * sizeof *x->ids);
  return KVI_OK;
}

kvi_status kvi__txn_context(kvi__txn *t, const uint64_t *ids, int32_t n, int stale) {
  if (!ids || n <= 0) return KVI_OK;
  if (!t->facts || t->n < 1 || t->facts[t->n - 1].ctx)
    return kvi__fail(KVI_ERR_INTERNAL, t->fn, "context ids given to a transaction without a fact for them");
  kvi__txn_fact *x = &t->facts[t->n - 1];
  const int32_t me = t->n - 1;
  bool is_stale = stale > 0;
  for (int32_t k = 0; stale < 0 && k < n; k++) {
    const uint64_t c = ids[k];
    if (c == x->id)
      return t->item ? kvi__fail(KVI_ERR_INVALID_ARGUMENT, t->fn, "%s %d: fact %llu of tenant %llu names itself in its context",
                                 t->item, (int)me, (unsigned long long)x->id, (unsigned long long)x->tenant)
                     : kvi__fail(KVI_ERR_INVALID_ARGUMENT, t->fn, "fact %llu of tenant %llu names itself in its context",
                                 (unsigned long long)x->id, (unsigned long long)x->tenant);
    int32_t i = me; /* the latest earlier fact of the transaction with that key */
    while (i-- > 0)
      if (t->facts[i].id == c && t->facts[i].tenant == x->tenant) break;
    if (i >= 0) {
      is_stale = is_stale || t->facts[i].stale;
      continue;
    }
    const fact *g = kvi__store_find(t->s, x->tenant, c);
    if (!g)
      return t->item ? kvi__fail(KVI_ERR_NOT_FOUND, t->fn,
                                 "%s %d: context id %d (%llu) of fact %llu names no fact of tenant %llu", t->item,
                                 (int)me, (int)k, (unsigned long long)c, (unsigned long long)x->id,
                                 (unsigned long long)x->tenant)
                     : kvi__fail(KVI_ERR_NOT_FOUND, t->fn, "context id %d (%llu) of fact %llu names no fact of tenant %llu",
                                 (int)k, (unsigned long long)c, (unsigned long long)x->id,
                                 (unsigned long long)x->tenant);
    is_stale = is_stale || g->stale;
  }
  x->ctx = malloc((size_t)n * sizeof *x->ctx);
  if (!x->ctx) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, t->fn, "allocating %d context ids", (int)n);
  memcpy(x->ctx, ids, (size_t)n * sizeof *x->ctx);
  x->nctx = n;
  x->stale = is_stale;
  return KVI_OK;
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
  if (t->place == KVI__PLACE_DISK) return KVI_OK;
  if (t->place == KVI__PLACE_DEVICE && s->backend == KVI_BACKEND_CUDA && s->pool.host.npages > 0) {
    /* the device tier, demoting least-recently-used facts if it is short */
    if ((st = kvi__pool_room(s, &s->pool.dev, 0, fn))) return st;
    st = kvi__tier_move(s, NULL, 0, t->npages, t->pages, t->stream, fn);
    if (st == KVI_OK) t->moved = true, t->ntaken = t->npages;
    return st;
  }
  if (t->place == KVI__PLACE_DEVICE) {
    if ((st = kvi__pool_device_room(s, t->npages, fn))) return st;
    for (int32_t i = 0; i < t->n; i++) t->facts[i].into = &s->pool.dev;
    kvi__pool_take(&s->pool.dev, t->pages, t->npages);
    t->ntaken = t->npages;
    return KVI_OK;
  }
  for (int32_t i = 0; i < t->n; i++) { /* each fact where kvi__tier_put_room finds room */
    kvi__txn_fact *x = &t->facts[i];
    if ((st = kvi__tier_put_room(s, x->npages, &x->into, fn))) return st;
    kvi__pool_take(x->into, t->pages + x->first, x->npages);
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
    const bool disk = t->place == KVI__PLACE_DISK; /* a fact on disk only has no pages */
    x->f = calloc(1, sizeof *x->f);
    x->pages = disk ? NULL : malloc((x->npages ? x->npages : 1) * sizeof *x->pages);
    if (spare) x->fresh = calloc(1, sizeof *x->fresh);
    if (!x->f || (!disk && !x->pages) || (spare && !x->fresh))
      return kvi__fail(KVI_ERR_OUT_OF_MEMORY, t->fn, "allocating fact metadata");
    if (!disk) memcpy(x->pages, t->pages + x->first, x->npages * sizeof *x->pages);
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
    free(t->facts[i].ids);
    free(t->facts[i].ctx);
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
      if (x->first < t->ntaken) kvi__pool_untake(x->into, t->pages + x->first, x->npages);
    }
  } else if (t->pages) { /* after the device work already tracked */
    kvi__pool_release(s, t->pages, t->ntaken);
  }
  for (int32_t i = 0; i < t->nrows; i++) kvi__emb_unreserve_rows(s, t->facts[i].tenant);
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
  const bool hooks = t->place != KVI__PLACE_DISK; /* facts read from a tenant's file are written nowhere */
  if (st == KVI_OK && hooks && s->disk.ops) st = s->disk.ops->put(s->disk.ctx, t); /* durable before it is visible */
  if (st == KVI_OK && hooks && s->journal.ops) st = s->journal.ops->put(s->journal.ctx, t);
  if (st) return kvi__txn_abort(t, st);
  for (int32_t i = 0; i < t->n; i++) {
    kvi__txn_fact *x = &t->facts[i];
    x->f->token_ids = x->ids; /* f's now: kvi__fact_commit sets its other fields */
    x->f->token_hash = x->ids ? kvi__token_hash(x->ids, x->tokens) : 0;
    x->ids = NULL;
    x->f->context = x->ctx;
    x->f->ncontext = x->nctx;
    x->f->stale = x->stale;
    x->ctx = NULL;
    kvi__fact_commit(s, x->f, x->pages, x->npages, x->fresh, &x->emb, x->tenant, x->id, x->tokens);
    x->f = NULL, x->pages = NULL, x->fresh = NULL; /* the store's now */
  }
  if (s->emb_dim > 0 && s->backend == KVI_BACKEND_CUDA) kvi__emb_flush(s); /* the facts' rows, in one launch */
  txn_end(t);
  return KVI_OK;
}
