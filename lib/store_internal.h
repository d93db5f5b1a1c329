/*
 * libkvinject — the store's insides, shared by store.c and the transfer code
 * (injector and encoder). Callers hold the store's lock.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_STORE_INTERNAL_H
#define KVI_STORE_INTERNAL_H

#include <pthread.h>

#include "internal.h"

#define KVI__TRACK_EVENTS 64 /* device operations tracked for deferred frees */

typedef enum tier { TIER_HOST = 0, TIER_DEVICE = 1 } tier;

typedef struct pool {
  tier tier;
  char *base;
  uint32_t npages;
  uint32_t nfree;
  uint32_t *free; /* stack of free page ids */
} pool;

typedef struct tenant tenant;

typedef struct fact {
  uint64_t tenant_id, id;
  int32_t tokens;
  uint32_t npages;
  uint32_t *pages;
  float *embedding; /* embedding_dim floats or NULL */
  struct fact *prev, *next; /* the tenant's list */
  tenant *owner;
} fact;

struct tenant {
  uint64_t id;
  size_t count;
  fact *head;
};

struct kvi_store {
  pthread_mutex_t lock;
  kvi__geom geom;
  kvi__rope *rope; /* per layer, copied from the model */
  kvi_backend backend;
  int device;
  kvi_dtype dtype;
  int32_t P;
  int32_t emb_dim;
  uint64_t page_bytes;
  uint64_t page_elems;
  pool pool;
  /* CUDA stores: pinned staging and a private stream for host copies */
  char *staging;
  uint32_t staging_pages;
  struct CUstream_st *copy_stream;
  kvi__map facts;   /* (tenant, id) -> fact */
  kvi__map tenants; /* (tenant, 0) -> tenant */
  uint64_t tokens_stored;
  /* Stream-ordered deferred frees (CUDA stores). Device work touching pages
   * records track_ev[seq % N] as event number seq; all events < track_done
   * have completed. A page freed while events < tag were outstanding waits
   * in `deferred` until track_done >= tag. */
  struct CUevent_st *track_ev[KVI__TRACK_EVENTS];
  uint64_t track_next, track_done;
  uint32_t *deferred_page;
  uint64_t *deferred_tag;
  uint32_t ndeferred;
  struct kvi__journal *journal; /* persist.c: the append log, or NULL */
};

static inline char *page_addr(const kvi_store *s, uint32_t page) {
  return s->pool.base + (uint64_t)page * s->page_bytes;
}

static inline uint32_t pages_for(const kvi_store *s, int32_t tokens) {
  return (uint32_t)(((int64_t)tokens + s->P - 1) / s->P);
}

void kvi__store_lock(const kvi_store *s);
void kvi__store_unlock(const kvi_store *s);

/* Looks up a fact; NULL when absent. */
static inline fact *kvi__store_find(const kvi_store *s, uint64_t tenant_id, uint64_t fact_id) {
  return (fact *)kvi__map_get(&s->facts, tenant_id, fact_id);
}

/* Makes `need` pages free, returning deferred pages whose readers have
 * completed (waiting for them if that is what it takes) and room for
 * `new_facts` more facts in the maps. KVI_ERR_CAPACITY when the pool cannot
 * hold them. */
kvi_status kvi__store_reserve(kvi_store *s, uint32_t need, size_t new_facts, const char *fn);

/* Records, on `stream`, the end of device work that reads or writes pages:
 * pages freed from now on wait for it. */
kvi_status kvi__store_track(kvi_store *s, struct CUstream_st *stream, const char *fn);

/* Inserts a fact whose `need` pages hold its data, replacing any fact with
 * the same key. The caller has already taken the pages off the free stack
 * (s->pool.nfree -= need for every fact of the call). Takes ownership of f,
 * pages, fresh and *emb. Cannot fail: call kvi__store_reserve and allocate
 * f, pages and fresh first. */
void kvi__store_commit(kvi_store *s, fact *f, uint32_t *pages, uint32_t need, tenant *fresh, float **emb,
                       uint64_t tenant_id, uint64_t fact_id, int32_t tokens);

/* Reads and checks an embedding into a fresh fp32 array (see kvi_put_options). */
kvi_status kvi__store_read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                     struct CUstream_st *stream, float **out, const char *fn);

#endif /* KVI_STORE_INTERNAL_H */
