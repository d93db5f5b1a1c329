/*
 * Tensor-parallel stores: gather to one rank (kvi_store_gather). Each head
 * is sent by the first rank holding it; root unpacks into its full views.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "tp/internal.h"

/* The first rank holding each of rank r's heads sends them (replicas do not). */
static bool first_holder(const kvi__geom *g, int32_t r) { return r % g->head_replicas == 0; }

/* A gather in progress (kvi_store_gather). */
typedef struct gather {
  shard_op op;
  int32_t *tok; /* [2n]: my facts' token counts, then (root) the views' dtypes */
  int32_t *rt;  /* [2n]: root's, as it broadcast them */
} gather;

/* Every rank's token counts of the facts; root checks its full views. */
static kvi_status gather_read(gather *ga) {
  shard_op *op = &ga->op;
  kvi_store *store = op->store;
  const char *fn = op->fn;
  const kvi__geom fg = kvi__shard_full_geom(store);
  const bool cuda_store = store->backend == KVI_BACKEND_CUDA;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    const kvi_gather_item *it = item_at(op->items, op->stride, i);
    kvi_kv_view *v = &op->v[i];
    st = kvi__store_fact_tokens(store, it->tenant, it->fact_id, &ga->tok[i], fn);
    if (st || !op->is_root) continue;
    if (!it->full) st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "items[%d].full is NULL on the root rank", (int)i);
    else st = kvi__view_check(v, it->full, &fg, true, fn);
    if (st == KVI_OK) st = kvi__check_memory(v->k, v->memory, cuda_store, store->device, fn, "full->k");
    if (st == KVI_OK) st = kvi__check_memory(v->v, v->memory, cuda_store, store->device, fn, "full->v");
    if (st == KVI_OK && ga->tok[i] != v->num_tokens)
      st = kvi__fail(KVI_ERR_MISMATCH, fn, "items[%d].full->num_tokens is %d, the fact has %d tokens", (int)i,
                     (int)v->num_tokens, (int)ga->tok[i]);
    if (st == KVI_OK) ga->tok[op->n + i] = (int32_t)v->dtype;
  }
  return st;
}

/* Root's token counts and dtypes to every rank, which compares its own. */
static kvi_status gather_agree(gather *ga) {
  const shard_op *op = &ga->op;
  const int32_t n = op->n;
  int32_t *rt = ga->rt = malloc((size_t)(n ? n : 1) * 2 * sizeof *rt);
  if (rt && op->is_root) memcpy(rt, ga->tok, (size_t)n * 2 * sizeof *rt);
  int32_t dummy[2];
  kvi_status st = kvi__comm_bcast_host(op->c, rt ? rt : dummy, rt ? (size_t)n * 2 * sizeof *rt : sizeof dummy, op->root,
                                       op->fn);
  if (st == KVI_OK && !rt) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, op->fn, "allocating %d counts", (int)n);
  for (int32_t i = 0; i < n && st == KVI_OK; i++)
    if (ga->tok[i] != rt[i])
      st = kvi__fail(KVI_ERR_MISMATCH, op->fn, "fact %d of the list has %d tokens on rank %d and %d on root rank %d",
                     (int)i, (int)ga->tok[i], (int)op->c->rank, (int)rt[i], (int)op->root);
  return st;
}

/* Rank r's buffer (r's slices, read from the store on r; room for them on
 * root) and its transfer op. */
static kvi_status gather_buffer(gather *ga, int32_t r, int32_t h) {
  shard_op *op = &ga->op;
  const kvi__geom *g = &op->store->geom;
  const int32_t n = op->n, *rt = ga->rt;
  size_t total;
  kvi_status st = kvi__shard_op_alloc(op, r, rt, rt + n, sizeof *rt, &total);
  if (st) return st;
  size_t at = 0;
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi_dtype dt = (kvi_dtype)rt[n + i];
    const size_t b = kvi__shard_slice_bytes(g, r, rt[i], kvi__dtype_size(dt));
    if (!op->is_root) { /* read my slice, packed, in root's dtype */
      const kvi_gather_item *it = item_at(op->items, op->stride, i);
      const kvi_kv_view w = kvi__shard_slice_view(op, dt, rt[i], h, (char *)op->bufs[r] + at, b);
      st = kvi__store_read(op->store, it->tenant, it->fact_id, &w, op->stream, op->fn);
    }
    at += b;
  }
  kvi__shard_op_push(op, r, total, !op->is_root);
  return st;
}

/* Root: rank r's slices, arrived in its buffer, into the full views. */
static kvi_status gather_unpack(gather *ga, int32_t r, void **host_tmp) {
  const shard_op *op = &ga->op;
  const kvi__geom *g = &op->store->geom;
  kvi_comm *c = op->c;
  int32_t first, h;
  kvi__geom_rank_heads(g, r, &first, &h);
  size_t at = 0;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    kvi_kv_view *v = &op->v[i];
    const size_t b = kvi__shard_slice_bytes(g, r, ga->rt[i], kvi__dtype_size(v->dtype));
    const char *src = (const char *)op->bufs[r] + at;
    if (v->memory == c->memory) {
      st = kvi__shard_pack(v, (void *)src, first, h, true, c->memory, op->stream, op->fn);
    } else { /* device transfers into a host `full`: one copy down, unpack on the host */
      void *p = realloc(*host_tmp, b);
      if (!p) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, op->fn, "allocating %zu bytes", b);
      *host_tmp = p;
      st = kvi__cuda_d2h(p, src, b, op->stream, op->fn);
      if (st == KVI_OK) st = kvi__cuda_sync(op->stream, op->fn);
      if (st == KVI_OK) st = kvi__shard_pack(v, p, first, h, true, KVI_MEMORY_HOST, NULL, op->fn);
    }
    at += b;
  }
  return st;
}

/* Root: its own heads, read straight into the full views. */
static kvi_status gather_own(gather *ga, int32_t root_first, int32_t root_h) {
  const shard_op *op = &ga->op;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; st == KVI_OK && i < op->n; i++) {
    const kvi_gather_item *it = item_at(op->items, op->stride, i);
    const kvi_kv_view w = kvi__shard_heads_of(&op->v[i], root_first, root_h);
    st = kvi__store_read(op->store, it->tenant, it->fact_id, &w, op->stream, op->fn);
  }
  return st;
}

kvi_status kvi__store_gather(kvi_store *store, int32_t root, const kvi_gather_item *items, int32_t num_items,
                             struct CUstream_st *stream, const char *fn) {
  gather ga;
  memset(&ga, 0, sizeof ga);
  shard_op *op = &ga.op;
  kvi_status st = kvi__shard_op_begin(op, store, root, items, num_items, sizeof *items, stream, fn);
  if (st) return st;
  kvi_comm *c = op->c;
  const kvi__geom *g = &store->geom;
  const int32_t n = num_items;
  ga.tok = calloc((size_t)(n ? n : 1) * 2, sizeof *ga.tok);
  if (!op->v || !ga.tok) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d items", (int)n);
  if (st == KVI_OK) st = gather_read(&ga);
  op_rec me = {(int32_t)st, root, n, 0, st ? 0 : kvi__shard_keys_digest(items, op->stride, n)};
  if ((st = kvi__shard_exchange_op(c, &me, stream, fn)) == KVI_OK)
    st = kvi__shard_combine(c, gather_agree(&ga), stream, fn);

  if (st == KVI_OK && n > 0) {
    st = kvi__shard_op_lists(op);
    int32_t root_first, root_h;
    kvi__geom_rank_heads(g, root, &root_first, &root_h);
    for (int32_t r = 0; st == KVI_OK && r < c->size; r++) {
      if (r == root || (!op->is_root && r != c->rank) || !first_holder(g, r)) continue;
      int32_t first, h;
      kvi__geom_rank_heads(g, r, &first, &h);
      if (first != root_first) st = gather_buffer(&ga, r, h); /* else root holds these heads itself */
    }
    if (st == KVI_OK && op->is_root) st = gather_own(&ga, root_first, root_h);
    st = kvi__shard_op_transfer(op, st);
    void *host_tmp = NULL;
    for (int32_t r = 0; st == KVI_OK && op->is_root && r < c->size; r++)
      if (op->bufs[r]) st = gather_unpack(&ga, r, &host_tmp);
    free(host_tmp);
  }
  kvi__shard_op_end(op);
  free(ga.tok);
  free(ga.rt);
  return st;
}
