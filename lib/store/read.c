/*
 * The store's reads and queries: a fact's pages into a view, its tokens,
 * the tenants' counts and lists, the statistics.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "store/store_impl.h"

#define STORE_STATS_V1 offsetof(kvi_store_stats, pages_host_total) /* the fields before the host tier came first */

kvi_status kvi__store_read(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, const kvi_kv_view *dst,
                           struct CUstream_st *stream, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_kv_view v;
  kvi_status st = kvi__view_check(&v, dst, &store->geom, true, fn);
  if (st) return st;
  if ((st = kvi__store_view_memory(store, &v, fn, "dst->k", "dst->v"))) return st;
  kvi__store_lock(store);
  fact *f = kvi__map_get(&store->index.facts, tenant_id, fact_id);
  if (!f) st = kvi__store_not_found(fn, tenant_id, fact_id);
  else if (f->tokens != v.num_tokens)
    st = kvi__fail(KVI_ERR_MISMATCH, fn, "dst->num_tokens is %d, the fact has %d tokens", (int)v.num_tokens,
                   (int)f->tokens);
  else if (!f->pages) { /* on disk only: read back first, as every reader (kvi__store_lease) */
    f->pins++;
    st = kvi__disk_resident((kvi_store *)store, &f, 1, fn);
    f->pins--;
  }
  else if (store->backend == KVI_BACKEND_CUDA && v.memory == KVI_MEMORY_DEVICE)
    st = kvi__tier_order_moves((kvi_store *)store, stream, fn); /* a move may still write them */
  if (st == KVI_OK && f)
    st = kvi__copy_fact(store, &v, f->pages, f->tokens, false, NULL, stream, fn);
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
  return f ? KVI_OK : kvi__store_not_found(fn, tenant_id, fact_id);
}

kvi_status kvi__store_fact_token_ids(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, int32_t *out_ids,
                                     int32_t capacity, int32_t *out_num, uint64_t *out_hash, const char *fn) {
  if (!store || !out_num)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_num" : "store");
  if (capacity < 0 || (capacity > 0 && !out_ids))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, capacity < 0 ? "capacity is %d" : "out_ids is NULL with capacity %d",
                     (int)capacity);
  kvi__store_lock(store);
  const fact *f = kvi__map_get(&store->index.facts, tenant_id, fact_id);
  const int32_t n = f && f->token_ids ? f->tokens : 0;
  kvi_status st = KVI_OK;
  if (!f) {
    st = kvi__store_not_found(fn, tenant_id, fact_id);
  } else if (n > capacity) {
    st = kvi__fail(KVI_ERR_CAPACITY, fn, "fact %llu of tenant %llu has %d token ids, out_ids holds %d",
                   (unsigned long long)fact_id, (unsigned long long)tenant_id, (int)n, (int)capacity);
  } else {
    if (n > 0) memcpy(out_ids, f->token_ids, (size_t)n * sizeof *out_ids);
    *out_num = n;
    if (out_hash) *out_hash = f->token_hash;
  }
  kvi__store_unlock(store);
  return st;
}

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

enum list_which { LIST_ALL, LIST_STALE, LIST_ON_DISK };

static bool listed(const fact *f, enum list_which which) {
  return which == LIST_ALL || (which == LIST_STALE ? f->stale : !f->pages);
}

/* The ids of a tenant's facts (all, the stale ones, those only on disk),
 * ascending: kvi_store_list, kvi_store_stale, kvi_store_list_on_disk. */
static kvi_status list_ids(const kvi_store *store, uint64_t tenant_id, enum list_which which, uint64_t *ids,
                           size_t capacity, size_t *out_total, const char *fn) {
  if (!store || !out_total)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_total" : "store");
  if (capacity > 0 && !ids) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "ids is NULL and capacity is %zu", capacity);
  kvi_status st = KVI_OK;
  kvi__store_lock(store);
  const tenant *t = kvi__map_get(&store->index.tenants, tenant_id, 0);
  const size_t n = !t ? 0 : which == LIST_ALL ? t->count : which == LIST_STALE ? t->stale : t->on_disk;
  if (capacity > 0 && n > 0) {
    uint64_t *all = malloc(n * sizeof *all);
    if (!all) {
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu ids", n);
    } else {
      size_t i = 0;
      for (const fact *f = t->head; f && i < n; f = f->next)
        if (listed(f, which)) all[i++] = f->id;
      qsort(all, n, sizeof *all, cmp_u64);
      memcpy(ids, all, (capacity < n ? capacity : n) * sizeof *ids);
      free(all);
    }
  }
  kvi__store_unlock(store);
  if (st == KVI_OK) *out_total = n;
  return st;
}

kvi_status kvi__store_list(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                           size_t *out_total, const char *fn) {
  return list_ids(store, tenant_id, LIST_ALL, ids, capacity, out_total, fn);
}

kvi_status kvi__store_list_on_disk(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                                   size_t *out_total, const char *fn) {
  return list_ids(store, tenant_id, LIST_ON_DISK, ids, capacity, out_total, fn);
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
  s.facts_stale = store->index.stale;
  s.facts_on_disk_only = store->index.on_disk;
  s.disk_bytes = store->disk.bytes;
  s.disk_reads = store->disk.reads;
  s.disk_read_bytes = store->disk.read_bytes;
  s.disk_writes = store->disk.writes;
  s.disk_write_bytes = store->disk.write_bytes;
  s.drops_to_disk = store->disk.drops;
  /* the bytes of stored tokens, plus (quantized stores) the scales of their pages */
  const uint64_t token_bytes = kvi__dtype_bytes(store->dtype, store->page_elems / (uint64_t)store->P);
  s.bytes_payload = store->index.tokens_stored * token_bytes +
                    store->index.pages_stored * (store->page_bytes - (uint64_t)store->P * token_bytes);
  s.bytes_embeddings = store->emb.bytes;
  kvi__store_unlock(store);
  s.bytes_reserved = s.pages_total * s.page_bytes;
  s.bytes_used = s.pages_used * s.page_bytes;
  return kvi__write_struct(out, &s, sizeof s, STORE_STATS_V1, fn, "out");
}

kvi_status kvi__store_fact_context(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, uint64_t *out_ids,
                                   int32_t capacity, int32_t *out_num, int32_t *out_stale, const char *fn) {
  if (!store || !out_num)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_num" : "store");
  if (capacity < 0 || (capacity > 0 && !out_ids))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, capacity < 0 ? "capacity is %d" : "out_ids is NULL with capacity %d",
                     (int)capacity);
  kvi__store_lock(store);
  const fact *f = kvi__map_get(&store->index.facts, tenant_id, fact_id);
  kvi_status st = KVI_OK;
  if (!f) {
    st = kvi__store_not_found(fn, tenant_id, fact_id);
  } else {
    *out_num = f->ncontext;
    if (out_stale) *out_stale = f->stale ? 1 : 0;
    if (f->ncontext > capacity)
      st = kvi__fail(KVI_ERR_CAPACITY, fn, "fact %llu of tenant %llu has %d context ids, out_ids holds %d",
                     (unsigned long long)fact_id, (unsigned long long)tenant_id, (int)f->ncontext, (int)capacity);
    else if (f->ncontext > 0)
      memcpy(out_ids, f->context, (size_t)f->ncontext * sizeof *out_ids);
  }
  kvi__store_unlock(store);
  return st;
}

kvi_status kvi__store_stale(const kvi_store *store, uint64_t tenant_id, uint64_t *ids, size_t capacity,
                            size_t *out_total, const char *fn) {
  return list_ids(store, tenant_id, LIST_STALE, ids, capacity, out_total, fn);
}

kvi_status kvi__store_stale_fail(const fact *f, int32_t r, const char *fn) {
  char at[32] = "";
  if (r >= 0) snprintf(at, sizeof at, "request %d: ", (int)r);
  return kvi__fail(KVI_ERR_STALE, fn,
                   "%sfact %llu of tenant %llu is stale: a fact in its context was removed; encode it again "
                   "(KVI_PUT_REPLACE) or remove it (kvi_store_stale lists them)",
                   at, (unsigned long long)f->id, (unsigned long long)f->tenant_id);
}

kvi_status kvi__store_tenant_fresh(const tenant *t, int32_t r, const char *fn) {
  if (!t || t->stale == 0) return KVI_OK;
  char at[32] = "";
  if (r >= 0) snprintf(at, sizeof at, "request %d: ", (int)r);
  return kvi__fail(KVI_ERR_STALE, fn,
                   "%stenant %llu has %zu stale facts, which this call cannot tell apart from the others (device fact "
                   "ids, or a search); encode them again or remove them (kvi_store_stale lists them)",
                   at, (unsigned long long)t->id, t->stale);
}

kvi_status kvi__store_fact_tier(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, int32_t *out_tier,
                                const char *fn) {
  if (!store || !out_tier) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out_tier" : "store");
  kvi__store_lock(store);
  const fact *f = kvi__map_get(&store->index.facts, tenant_id, fact_id);
  if (f)
    *out_tier = !f->pages                                                   ? KVI_TIER_DISK
                : fact_on_host(store, f) || store->backend != KVI_BACKEND_CUDA ? KVI_TIER_HOST
                                                                             : KVI_TIER_DEVICE;
  kvi__store_unlock(store);
  return f ? KVI_OK : kvi__store_not_found(fn, tenant_id, fact_id);
}
