/*
 * Tensor-parallel stores: put from a full-head source (kvi_store_put_scatter).
 * Root checks and packs every rank's heads, each rank puts its own, and a
 * gate commits on every rank or on none.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "tp/internal.h"

typedef struct comm_gate {
  kvi__gate gate;
  kvi_comm *comm;
  struct CUstream_st *stream;
  const char *fn;
} comm_gate;

static kvi_status comm_decide(kvi__gate *g, kvi_status local) {
  comm_gate *cg = (comm_gate *)g;
  return kvi__shard_combine(cg->comm, local, cg->stream, cg->fn);
}

/* What root tells the others about each fact of a scatter. */
typedef struct item_rec {
  int32_t tokens, dtype;
  uint32_t flags, has_emb, has_ids;
} item_rec;

/* A scatter in progress (kvi_store_put_scatter). */
typedef struct scatter {
  shard_op op;
  int32_t E;
  /* the block root broadcasts: [n records][n embeddings] */
  char *info;
  size_t info_bytes;
  item_rec *rec;
  float *embs;
  /* the facts' token ids, back to back (those with has_ids), broadcast after the block */
  const int32_t **ids_src; /* root: where item i's ids are */
  int32_t *ids;
  int64_t nids;
  size_t *mine_off; /* where my slice of fact i arrives */
  void *host_pack;
} scatter;

/* Root: kvi_store_put's checks on every full view, into the block. */
static kvi_status scatter_read(scatter *sc) {
  shard_op *op = &sc->op;
  kvi_store *store = op->store;
  const kvi__geom fg = kvi__shard_full_geom(store);
  const char *fn = op->fn;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    const kvi_scatter_item *it = item_at(op->items, op->stride, i);
    kvi_put_options o;
    float *emb = NULL;
    if (!it->full) st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "items[%d].full is NULL on the root rank", (int)i);
    else st = kvi__view_check(&op->v[i], it->full, &fg, false, fn);
    if (st == KVI_OK) st = kvi__store_put_args(store, &op->v[i], it->opts, &o, &emb, op->stream, fn);
    if (st == KVI_OK && o.num_context_ids > 0)
      st = kvi__fail(KVI_ERR_UNSUPPORTED, fn, "items[%d].opts->context_ids: a scattered put keeps no context", (int)i);
    if (st) {
      free(emb);
      break;
    }
    const item_rec r = {op->v[i].num_tokens, (int32_t)op->v[i].dtype, o.flags, emb != NULL, o.token_ids != NULL};
    sc->rec[i] = r;
    sc->ids_src[i] = o.token_ids;
    if (emb) memcpy(sc->embs + (size_t)i * sc->E, emb, (size_t)sc->E * sizeof(float));
    free(emb);
  }
  return st;
}

/* Every rank gets root's token ids: their count is known from the block, so
 * when any fact has them, the ranks allocate, agree that they could, and
 * root broadcasts them. */
static kvi_status scatter_ids(scatter *sc) {
  shard_op *op = &sc->op;
  for (int32_t i = 0; i < op->n; i++)
    if (sc->rec[i].has_ids) sc->nids += sc->rec[i].tokens;
  if (sc->nids == 0) return KVI_OK;
  kvi_status st = (sc->ids = malloc((size_t)sc->nids * sizeof *sc->ids))
                      ? KVI_OK
                      : kvi__fail(KVI_ERR_OUT_OF_MEMORY, op->fn, "allocating %lld token ids", (long long)sc->nids);
  if ((st = kvi__shard_combine(op->c, st, op->stream, op->fn))) return st;
  int64_t at = 0;
  for (int32_t i = 0; op->is_root && i < op->n; i++)
    if (sc->rec[i].has_ids) {
      memcpy(sc->ids + at, sc->ids_src[i], (size_t)sc->rec[i].tokens * sizeof *sc->ids);
      at += sc->rec[i].tokens;
    }
  return kvi__comm_bcast_host(op->c, sc->ids, (size_t)sc->nids * sizeof *sc->ids, op->root, op->fn);
}

/* Rank r's buffer (root: packed from the full views; the others: room for
 * their slices) and its transfer op. */
static kvi_status scatter_buffer(scatter *sc, int32_t r) {
  shard_op *op = &sc->op;
  const kvi__geom *g = &op->store->geom;
  kvi_comm *c = op->c;
  const char *fn = op->fn;
  const item_rec *rec = sc->rec;
  size_t total;
  kvi_status st = kvi__shard_op_alloc(op, r, &rec[0].tokens, &rec[0].dtype, sizeof *rec, &total);
  if (st) return st;
  size_t at = 0;
  int32_t first, h;
  kvi__geom_rank_heads(g, r, &first, &h);
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    const size_t b = kvi__shard_slice_bytes(g, r, rec[i].tokens, kvi__dtype_size((kvi_dtype)rec[i].dtype));
    if (r == c->rank) sc->mine_off[i] = at;
    char *dst = (char *)op->bufs[r] + at;
    if (op->is_root && op->v[i].memory == c->memory) {
      st = kvi__shard_pack(&op->v[i], dst, first, h, false, c->memory, op->stream, fn);
    } else if (op->is_root) { /* a host source for device transfers: pack on the host, then one copy up */
      void *p = realloc(sc->host_pack, b);
      if (!p) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", b);
      sc->host_pack = p;
      st = kvi__shard_pack(&op->v[i], p, first, h, false, KVI_MEMORY_HOST, NULL, fn);
      if (st == KVI_OK) st = kvi__cuda_h2d(dst, p, b, op->stream, fn);
      if (st == KVI_OK) st = kvi__cuda_sync(op->stream, fn); /* host_pack is reused */
    }
    at += b;
  }
  if (st == KVI_OK) kvi__shard_op_push(op, r, total, op->is_root);
  return st;
}

/* Each rank puts its slices; the gate commits on every rank or on none. */
static kvi_status scatter_put(scatter *sc) {
  shard_op *op = &sc->op;
  const kvi__geom *g = &op->store->geom;
  kvi_comm *c = op->c;
  const char *fn = op->fn;
  const int32_t n = op->n, E = sc->E;
  int32_t first, h;
  kvi__geom_rank_heads(g, c->rank, &first, &h);
  int64_t ids_at = 0;
  kvi_kv_view *mine = calloc((size_t)n, sizeof *mine);
  kvi__put_item *put = calloc((size_t)n, sizeof *put);
  kvi_status st = mine && put ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d views", (int)n);
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi_dtype dt = (kvi_dtype)sc->rec[i].dtype;
    const int32_t T = sc->rec[i].tokens;
    if (op->is_root)
      mine[i] = kvi__shard_heads_of(&op->v[i], first, h);
    else
      mine[i] = kvi__shard_slice_view(op, dt, T, h, (char *)op->bufs[c->rank] + sc->mine_off[i],
                                      kvi__shard_slice_bytes(g, c->rank, T, kvi__dtype_size(dt)));
    float *emb = NULL;
    if (sc->rec[i].has_emb) {
      if (!(emb = malloc((size_t)E * sizeof *emb))) {
        st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating an embedding");
        break;
      }
      memcpy(emb, sc->embs + (size_t)i * E, (size_t)E * sizeof *emb);
    }
    const kvi_scatter_item *it = item_at(op->items, op->stride, i);
    const kvi__put_item p = {it->tenant, it->fact_id, &mine[i], sc->rec[i].flags, emb,
                             sc->rec[i].has_ids ? sc->ids + ids_at : NULL, NULL, 0};
    if (sc->rec[i].has_ids) ids_at += T;
    put[i] = p;
  }
  comm_gate gate = {{comm_decide}, c, op->stream, fn};
  if (st == KVI_OK) {
    st = kvi__store_put_views(op->store, put, n, op->stream, &gate.gate, fn);
  } else { /* still decide with the others */
    for (int32_t i = 0; put && i < n; i++) free(put[i].emb);
    kvi__shard_combine(c, st, op->stream, fn);
  }
  free(mine);
  free(put);
  return st;
}

kvi_status kvi__store_put_scatter(kvi_store *store, int32_t root, const kvi_scatter_item *items, int32_t num_items,
                                  struct CUstream_st *stream, const char *fn) {
  scatter sc;
  memset(&sc, 0, sizeof sc);
  shard_op *op = &sc.op;
  kvi_status st = kvi__shard_op_begin(op, store, root, items, num_items, sizeof *items, stream, fn);
  if (st) return st;
  kvi_comm *c = op->c;
  const int32_t n = num_items;
  sc.E = store->emb_dim;
  sc.info_bytes = (size_t)n * sizeof(item_rec) + (size_t)n * (size_t)sc.E * sizeof(float);
  sc.info = calloc(sc.info_bytes ? sc.info_bytes : 1, 1);
  if (!op->v || !sc.info) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d items", (int)n);
  sc.rec = (item_rec *)sc.info;
  sc.embs = sc.info ? (float *)(sc.info + (size_t)n * sizeof(item_rec)) : NULL;
  sc.ids_src = calloc(n > 0 ? (size_t)n : 1, sizeof *sc.ids_src);
  if (!sc.ids_src && st == KVI_OK) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d items", (int)n);
  if (st == KVI_OK && op->is_root) st = scatter_read(&sc);
  op_rec me = {(int32_t)st, root, n, 0, st ? 0 : kvi__shard_keys_digest(items, op->stride, n)};
  if ((st = kvi__shard_exchange_op(c, &me, stream, fn)) == KVI_OK && n > 0) /* every rank knows n: all skip alike */
    st = kvi__comm_bcast_host(c, sc.info, sc.info_bytes, root, fn);
  if (st == KVI_OK && n > 0) st = scatter_ids(&sc); /* every rank knows whether any fact has ids */

  /* root packs and sends; each other rank receives its own */
  if (st == KVI_OK && n > 0) {
    sc.mine_off = calloc((size_t)n, sizeof *sc.mine_off);
    st = kvi__shard_op_lists(op);
    if (st == KVI_OK && !sc.mine_off) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating transfer lists");
    for (int32_t r = 0; st == KVI_OK && r < c->size; r++)
      if (r != root && (op->is_root || r == c->rank)) st = scatter_buffer(&sc, r);
    st = kvi__shard_op_transfer(op, st);
    if (st == KVI_OK) st = scatter_put(&sc);
  }
  kvi__shard_op_end(op);
  free(sc.host_pack);
  free(sc.mine_off);
  free(sc.info);
  free(sc.ids_src);
  free(sc.ids);
  return st;
}
