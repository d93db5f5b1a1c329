/*
 * Facts in and out of the store's index (commit and unlink), the put of
 * views (one write transaction) and the removal of a fact.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "store/store_impl.h"

static void unlink_fact(kvi_store *s, fact *f) {
  if (f->loading) (void)kvi__disk_settle(s, f, false, "kvi_store_remove"); /* its read back is dropped */
  tenant *t = f->owner;
  if (f->prev) f->prev->next = f->next;
  else t->head = f->next;
  if (f->next) f->next->prev = f->prev;
  if (s->emb_dim > 0) kvi__emb_remove(s, t, f);
  t->count--;
  if (f->stale) t->stale--, s->index.stale--;
  if (!f->pages) t->on_disk--, s->index.on_disk--, kvi__disk_note(s, t);
  if (t->count == 0 && t->pending == 0) { /* a replace keeps the tenant: its new fact is pending */
    kvi__map_del(&s->index.tenants, t->id, 0);
    kvi__emb_free(s, t, true);
    free(t);
  }
  kvi__map_del(&s->index.facts, f->tenant_id, f->id);
  kvi__tier_lru_remove(s, f);
  if (f->pages) {
    kvi__pool_release(s, f->pages, f->npages);
    s->index.pages_stored -= f->npages;
  }
  if (f->hpages) kvi__pool_release(s, f->hpages, f->npages);
  s->index.tokens_stored -= (uint64_t)f->tokens;
}

void kvi__fact_commit(kvi_store *s, fact *f, uint32_t *pages, uint32_t need, tenant *fresh, float **emb,
                      uint64_t tenant_id, uint64_t fact_id, int32_t tokens) {
  fact *old = kvi__store_find(s, tenant_id, fact_id);
  size_t reuse = SIZE_MAX; /* the replaced fact's embedding row, which f takes over in place */
  if (old) {
    if (s->emb_dim > 0 && *emb && old->row != SIZE_MAX) {
      reuse = old->row;
      old->row = SIZE_MAX; /* unlink_fact moves no row */
    }
    unlink_fact(s, old);
    kvi__fact_free(old);
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
      kvi__emb_append(s, t, f, *emb, reuse);
    } else { /* checked, and kept by another rank: give back the row reserved for it */
      kvi__emb_skip_row(s, t, tokens);
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
  if (f->stale) t->stale++, s->index.stale++;
  f->hpages = NULL;
  f->in_lru = false;
  f->pins = 0;
  kvi__store_touch(s, f); /* a new fact counts as used */
  kvi__map_put(&s->index.facts, tenant_id, fact_id, f);
  s->index.tokens_stored += (uint64_t)tokens;
  if (pages) s->index.pages_stored += need;
  else t->on_disk++, s->index.on_disk++, kvi__disk_note(s, t); /* indexed from its tenant's file */
}

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

kvi_status kvi__store_put_views(kvi_store *store, kvi__put_item *items, int32_t n, struct CUstream_st *stream,
                                kvi__gate *gate, const char *fn) {
  if (n < 1) return gate ? gate->decide(gate, KVI_OK) : KVI_OK;
  kvi_status st = check_items(store, items, n, fn);
  kvi__store_lock(store);
  for (int32_t i = 0; i < n && st == KVI_OK; i++) /* before any lookup: a claim may re-read the tenant */
    if (i == 0 || items[i].tenant != items[i - 1].tenant) st = kvi__disk_claim(store, items[i].tenant, fn);
  kvi__txn t;
  if (st == KVI_OK) st = kvi__txn_begin(&t, store, n, KVI__PLACE_ANY, gate, stream, fn);
  else kvi__txn_begin(&t, store, 0, KVI__PLACE_ANY, gate, stream, fn);
  int32_t added = 0;
  for (; added < n && st == KVI_OK; added++) {
    st = kvi__txn_add(&t, items[added].tenant, items[added].id, items[added].v->num_tokens, items[added].flags,
                      items[added].emb);
    items[added].emb = NULL; /* the transaction's */
    if (st == KVI_OK) st = kvi__txn_token_ids(&t, items[added].ids);
    if (st == KVI_OK) st = kvi__txn_context(&t, items[added].ctx, items[added].nctx, -1);
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
  if ((st = kvi__store_view_memory(store, v, fn, "kv->k", "kv->v"))) return st;
  if (o->token_ids && (st = kvi__check_memory(o->token_ids, KVI_MEMORY_HOST, store->backend == KVI_BACKEND_CUDA,
                                              store->device, fn, "opts->token_ids")))
    return st;
  if (o->num_context_ids < 0 || (o->num_context_ids > 0 && !o->context_ids))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, o->num_context_ids < 0 ? "opts->num_context_ids is %d"
                                                                          : "opts->context_ids is NULL with num_context_ids %d",
                     (int)o->num_context_ids);
  if (o->context_ids && o->num_context_ids > 0 &&
      (st = kvi__check_memory(o->context_ids, KVI_MEMORY_HOST, store->backend == KVI_BACKEND_CUDA, store->device, fn,
                              "opts->context_ids")))
    return st;
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
  kvi__put_item it = {tenant_id, fact_id, &v, o.flags, emb, o.token_ids, o.context_ids, o.num_context_ids};
  return kvi__store_put_views(store, &it, 1, stream, NULL, fn);
}

/* Makes stale the facts of `tenant_id` whose context names `removed` or a
 * stale fact, until none is left (a fixed point: each pass goes over the
 * tenant's fresh facts once). */
static void mark_dependents(kvi_store *s, uint64_t tenant_id, uint64_t removed) {
  tenant *t = kvi__store_tenant(s, tenant_id);
  for (bool changed = t != NULL; changed;) {
    changed = false;
    for (fact *f = t->head; f; f = f->next) {
      if (f->stale) continue;
      for (int32_t k = 0; k < f->ncontext; k++) {
        const fact *g = f->context[k] == removed ? NULL : kvi__store_find(s, tenant_id, f->context[k]);
        if (f->context[k] == removed || (g && g->stale)) {
          f->stale = true;
          t->stale++, s->index.stale++;
          changed = true;
          break;
        }
      }
    }
  }
}

kvi_status kvi__store_remove(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, uint32_t flags, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  if (flags & ~KVI_REMOVE_KEEP_DEPENDENTS)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "flags has unknown bits 0x%x", flags & ~KVI_REMOVE_KEEP_DEPENDENTS);
  kvi__store_lock(store);
  kvi_status st = kvi__disk_claim(store, tenant_id, fn);
  fact *f = st == KVI_OK ? kvi__store_find(store, tenant_id, fact_id) : NULL;
  if (f && store->disk.ops) st = store->disk.ops->remove(store->disk.ctx, store, tenant_id, fact_id, flags, fn);
  if (f && st == KVI_OK && store->journal.ops)
    st = store->journal.ops->remove(store->journal.ctx, store, tenant_id, fact_id, flags, fn);
  if (f && st == KVI_OK) st = kvi__store_unindex(store, tenant_id, fact_id, flags, fn);
  kvi__store_unlock(store);
  if (st) return st;
  if (!f) return kvi__store_not_found(fn, tenant_id, fact_id);
  return KVI_OK;
}

kvi_status kvi__store_unindex(kvi_store *store, uint64_t tenant_id, uint64_t fact_id, uint32_t flags, const char *fn) {
  fact *f = kvi__store_find(store, tenant_id, fact_id);
  if (!f) return kvi__store_not_found(fn, tenant_id, fact_id);
  unlink_fact(store, f);
  if (!(flags & KVI_REMOVE_KEEP_DEPENDENTS)) mark_dependents(store, tenant_id, fact_id);
  /* its pages wait for the device work tracked so far (kvi__pool_release);
   * when that has completed they go back now, not at the next put's
   * kvi__pool_room: a query of the tracker's events, which waits for
   * nothing and cannot fail */
  if (store->ndeferred > 0) (void)kvi__pool_reap(store, false, fn);
  kvi__fact_free(f);
  return KVI_OK;
}

void kvi__store_forget_tenant(kvi_store *s, uint64_t tenant_id) {
  for (tenant *t; (t = kvi__store_tenant(s, tenant_id)) && t->head;) {
    fact *f = t->head;
    unlink_fact(s, f); /* frees t with its last fact */
    kvi__fact_free(f);
  }
}
