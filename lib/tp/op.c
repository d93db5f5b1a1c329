/*
 * Tensor-parallel stores: what a scatter and a gather share, the exchange
 * of what every rank passes, the items read through their struct_size,
 * slices packed per rank and the shard_op that holds the transfer.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "tp/internal.h"

/* Exchanges op records; checks that none failed and that the ranks agree
 * on root and on the list of facts. */
kvi_status kvi__shard_exchange_op(kvi_comm *c, op_rec *me, struct CUstream_st *stream, const char *fn) {
  const kvi_status sd = kvi__shard_drain(c, stream, fn);
  if (me->status == KVI_OK) me->status = (int32_t)sd;
  op_rec *all = calloc((size_t)c->size, sizeof *all);
  if (!all) { /* take part anyway */
    me->status = KVI_ERR_OUT_OF_MEMORY;
    kvi__comm_allgather_host(c, me, NULL, sizeof *me, fn);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d records", (int)c->size);
  }
  kvi_status st = kvi__comm_allgather_host(c, me, all, sizeof *me, fn);
  if (st == KVI_OK && me->status != KVI_OK) st = (kvi_status)me->status;
  for (int32_t r = 0; st == KVI_OK && r < c->size; r++) {
    if (all[r].status != KVI_OK)
      st = kvi__fail(KVI_ERR_PEER, fn, "rank %d failed: %s", (int)r, kvi__status_string((kvi_status)all[r].status));
    else if (all[r].n != me->n || all[r].digest != me->digest || all[r].root != me->root)
      st = kvi__fail(KVI_ERR_MISMATCH, fn,
                     "the ranks disagree: rank %d passes %d facts (list digest %016llx) with root %d, rank %d passes "
                     "%d (%016llx) with root %d",
                     (int)c->rank, (int)me->n, (unsigned long long)me->digest, (int)me->root, (int)r, (int)all[r].n,
                     (unsigned long long)all[r].digest, (int)all[r].root);
  }
  free(all);
  return st;
}

static kvi_status check_collective(const kvi_store *s, int32_t root, const void *items, int32_t n, const char *fn) {
  if (!s) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  if (!s->shard.comm) return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "the store was created without a communicator");
  if (root < 0 || root >= s->shard.size)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "root is %d, the communicator has %d ranks", (int)root,
                     (int)s->shard.size);
  if (n < 0 || n > (1 << 20)) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_items is %d, expected 0..2^20", (int)n);
  if (n > 0 && !items) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "items is NULL");
  return KVI_OK;
}

/* The geometry of a full-head view: every KV head. */
kvi__geom kvi__shard_full_geom(const kvi_store *s) {
  kvi__geom g = s->geom;
  g.local_heads = g.num_kv_heads;
  g.head_first = 0;
  return g;
}

/* The stride of an item array: items[0].struct_size, at least `known` (items
 * have no older layout); every item must have that struct_size and zeros
 * past the `known` bytes (kvi__struct_array_read). Items are then read in
 * place, at that stride. */
static kvi_status item_stride(const void *items, int32_t n, size_t known, size_t *stride, const char *fn) {
  kvi__struct_array a;
  kvi_status st = kvi__struct_array_open(&a, items, n, known, fn, "items");
  _Static_assert(sizeof(kvi_scatter_item) <= 64 && sizeof(kvi_gather_item) <= 64, "item_stride's scratch copy");
  unsigned char local[64];
  for (int32_t i = 0; i < n && st == KVI_OK; i++) st = kvi__struct_array_read(&a, i, local, known, known, fn);
  *stride = a.stride;
  return st;
}

uint64_t kvi__shard_keys_digest(const void *items, size_t stride, int32_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t i = 0; i < n; i++) {
    uint64_t k[2];
    memcpy(k, (const char *)item_at(items, stride, i) + sizeof(size_t), sizeof k); /* tenant, fact_id */
    h = kvi__shard_fnv(h, k, sizeof k);
  }
  return h;
}

/* Bytes of fact i's slice for rank r (K and V), packed [2][L][T][h][D]. */
size_t kvi__shard_slice_bytes(const kvi__geom *g, int32_t r, int32_t T, size_t esz) {
  int32_t first, h;
  kvi__geom_rank_heads(g, r, &first, &h);
  return 2 * (size_t)g->num_layers * (size_t)T * (size_t)h * (size_t)g->head_size * esz;
}

/* Copies fact slices between full views and packed buffers: K, then V,
 * heads [first, first + h) of the full view. to_full: packed -> full. */
kvi_status kvi__shard_pack(const kvi_kv_view *full, void *packed, int32_t first, int32_t h, bool to_full,
                           kvi_memory mem, struct CUstream_st *stream, const char *fn) {
  const size_t esz = kvi__dtype_size(full->dtype);
  const int32_t L = full->num_layers, T = full->num_tokens, D = full->head_size;
  const size_t plane = (size_t)L * T * h * D * esz;
  const int64_t ps[3] = {(int64_t)T * h * D * (int64_t)esz, (int64_t)h * D * (int64_t)esz, (int64_t)D * (int64_t)esz};
  int64_t fs[3];
  kvi__shard_strides_of(full, fs);
  kvi_status st = KVI_OK;
  for (int kv = 0; kv < 2 && st == KVI_OK; kv++) {
    char *f = (char *)(kv ? full->v : full->k) + (int64_t)first * fs[2];
    char *p = (char *)packed + kv * plane;
    st = to_full ? kvi__shard_copy_rows(f, fs, p, ps, L, T, h, (int64_t)D * (int64_t)esz, mem, stream, fn)
                 : kvi__shard_copy_rows(p, ps, f, fs, L, T, h, (int64_t)D * (int64_t)esz, mem, stream, fn);
  }
  return st;
}

/* Checks the arguments of a scatter or gather (item size `known`) and
 * starts op; op->v is NULL when it could not be allocated. A failure here
 * is this rank's alone: it returns before any exchange. */
kvi_status kvi__shard_op_begin(shard_op *op, kvi_store *store, int32_t root, const void *items, int32_t n, size_t known,
                               struct CUstream_st *stream, const char *fn) {
  memset(op, 0, sizeof *op);
  kvi_status st = check_collective(store, root, items, n, fn);
  if (st || (st = item_stride(items, n, known, &op->stride, fn))) return st;
  op->store = store;
  op->c = store->shard.comm;
  op->items = items;
  op->root = root;
  op->n = n;
  op->is_root = op->c->rank == root;
  op->stream = stream;
  op->fn = fn;
  op->v = calloc((size_t)(n ? n : 1), sizeof *op->v);
  return KVI_OK;
}

/* The transfer lists: a buffer and an op per rank. */
kvi_status kvi__shard_op_lists(shard_op *op) {
  op->bufs = calloc((size_t)op->c->size, sizeof *op->bufs);
  op->ops = calloc((size_t)op->c->size, sizeof *op->ops);
  return op->bufs && op->ops ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, op->fn, "allocating transfer lists");
}

/* Rank r's buffer, room for its slices of every fact, into op->bufs[r];
 * *total its bytes. Fact i has the int32 token count at tok + i * step and
 * the int32 dtype at dt + i * step (bytes). */
kvi_status kvi__shard_op_alloc(shard_op *op, int32_t r, const void *tok, const void *dt, size_t step, size_t *total) {
  const kvi__geom *g = &op->store->geom;
  *total = 0;
  for (int32_t i = 0; i < op->n; i++) {
    int32_t T, t;
    memcpy(&T, (const char *)tok + (size_t)i * step, sizeof T);
    memcpy(&t, (const char *)dt + (size_t)i * step, sizeof t);
    if (__builtin_add_overflow(*total, kvi__shard_slice_bytes(g, r, T, kvi__dtype_size((kvi_dtype)t)), total))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, op->fn, "the items' slices for rank %d pass 2^64 bytes", (int)r);
  }
  return kvi__shard_buf_alloc(op->c, &op->bufs[r], *total, op->stream, op->fn);
}

/* The transfer of rank r's buffer: between root and r (on root), between
 * this rank and root (on the others); `send` says which side this is. */
void kvi__shard_op_push(shard_op *op, int32_t r, size_t total, bool send) {
  op->ops[op->nops++] = (kvi__p2p){op->is_root ? r : op->root, send, op->bufs[r], total};
}

/* Every rank joins the transfer only if every rank could prepare it
 * (st: this rank's preparation). */
kvi_status kvi__shard_op_transfer(shard_op *op, kvi_status st) {
  kvi_comm *c = op->c;
  st = kvi__shard_combine(c, st, op->stream, op->fn);
  if (st == KVI_OK)
    st = kvi__shard_combine(c, kvi__comm_p2p(c, op->ops, op->nops, op->stream, op->fn), op->stream, op->fn);
  return st;
}

void kvi__shard_op_end(shard_op *op) {
  for (int32_t r = 0; op->bufs && r < op->c->size; r++) kvi__shard_buf_free(op->c, op->bufs[r], op->stream, op->fn);
  free(op->ops);
  free(op->bufs);
  free(op->v);
}

/* Heads [first, first + h) of a full view. */
kvi_kv_view kvi__shard_heads_of(const kvi_kv_view *v, int32_t first, int32_t h) {
  kvi_kv_view w = *v;
  w.num_heads = h;
  const size_t o = (size_t)first * (size_t)v->head_stride * kvi__dtype_size(v->dtype);
  w.k = (char *)v->k + o;
  w.v = (char *)v->v + o;
  return w;
}

/* A packed slice of T tokens and h heads at base (b bytes, K then V). */
kvi_kv_view kvi__shard_slice_view(const shard_op *op, kvi_dtype dt, int32_t T, int32_t h, char *base, size_t b) {
  const kvi__geom *g = &op->store->geom;
  return kvi__shard_packed_view(op->c->memory, dt, g->num_layers, T, h, g->head_size, base, base + b / 2);
}
