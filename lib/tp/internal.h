/*
 * libkvinject — what the files of tensor-parallel stores share (private to
 * lib/tp/: only its sharding files include it): the small helpers
 * (helpers.c), the setup a scatter and a gather share (op.c) and the
 * collective search that creation registers (search.c).
 * SPDX-License-Identifier: Apache-2.0
 *
 * Tensor-parallel stores (see kvinject/comm.h) are written once over the
 * transport seam of tp/tp.h: data buffers live where the communicator moves
 * them (host memory for the in-process transport, device memory for NCCL).
 *
 * Every collective here follows one pattern: each rank does its local part,
 * then the ranks exchange their statuses and proceed only if all succeeded.
 * A rank that failed still joins every exchange, so no rank waits forever,
 * and the store is changed only after the last exchange said yes.
 */
#ifndef KVI_TP_INTERNAL_H
#define KVI_TP_INTERNAL_H

#include "store/store.h"
#include "tp/tp.h"

/* ---- small helpers (helpers.c) ------------------------------------------ */

/* FNV-1a, 64 bits, continued from h. */
uint64_t kvi__shard_fnv(uint64_t h, const void *p, size_t n);
/* Waits for the caller's stream before a control exchange (NCCL). */
kvi_status kvi__shard_drain(kvi_comm *c, struct CUstream_st *stream, const char *fn);
/* The ranks' statuses combined: KVI_OK when every rank reported KVI_OK. */
kvi_status kvi__shard_combine(kvi_comm *c, kvi_status local, struct CUstream_st *stream, const char *fn);
/* Buffers in the communicator's memory. */
kvi_status kvi__shard_buf_alloc(kvi_comm *c, void **p, size_t bytes, struct CUstream_st *stream, const char *fn);
void kvi__shard_buf_free(kvi_comm *c, void *p, struct CUstream_st *stream, const char *fn);
/* Copies L x T x H rows between two strided (bytes) layouts. */
kvi_status kvi__shard_copy_rows(void *dst, const int64_t dst_stride[3], const void *src, const int64_t src_stride[3],
                                int32_t L, int32_t T, int32_t H, int64_t row_bytes, kvi_memory memory,
                                struct CUstream_st *stream, const char *fn);
/* A contiguous [L][T][H][D] view. */
kvi_kv_view kvi__shard_packed_view(kvi_memory m, kvi_dtype t, int32_t L, int32_t T, int32_t H, int32_t D, void *k,
                                   void *v);
/* Byte strides of a view. */
void kvi__shard_strides_of(const kvi_kv_view *v, int64_t s[3]);

/* ---- what a scatter and a gather share (op.c) --------------------------- */

typedef struct op_rec { /* what every rank says before a scatter or gather */
  int32_t status, root, n, pad;
  uint64_t digest; /* of the (tenant, fact id) list */
} op_rec;

/* Exchanges op records; checks that the ranks agree on root and facts. */
kvi_status kvi__shard_exchange_op(kvi_comm *c, op_rec *me, struct CUstream_st *stream, const char *fn);
/* The geometry of a full-head view: every KV head. */
kvi__geom kvi__shard_full_geom(const kvi_store *s);
/* Items are read through their struct_size (arrays step by items[0]'s). */
static inline const void *item_at(const void *items, size_t stride, int32_t i) {
  return (const char *)items + stride * (size_t)i;
}
/* A digest of the items' (tenant, fact id) list. */
uint64_t kvi__shard_keys_digest(const void *items, size_t stride, int32_t n);
/* Bytes of a fact's slice for rank r (K and V), packed [2][L][T][h][D]. */
size_t kvi__shard_slice_bytes(const kvi__geom *g, int32_t r, int32_t T, size_t esz);
/* Copies heads [first, first + h) between a full view and a packed slice. */
kvi_status kvi__shard_pack(const kvi_kv_view *full, void *packed, int32_t first, int32_t h, bool to_full,
                           kvi_memory mem, struct CUstream_st *stream, const char *fn);

/* A scatter or a gather in progress: what the two share. Items are
 * kvi_scatter_item or kvi_gather_item (read through stride). */
typedef struct shard_op {
  kvi_store *store;
  kvi_comm *c;
  const void *items;
  size_t stride;
  int32_t root, n;
  bool is_root;
  kvi_kv_view *v; /* root: the full views, checked */
  /* the transfer: each rank's slices, all facts, in one buffer per peer */
  void **bufs;
  kvi__p2p *ops;
  int32_t nops;
  struct CUstream_st *stream;
  const char *fn;
} shard_op;

/* Checks a scatter's or gather's arguments and starts op (this rank alone). */
kvi_status kvi__shard_op_begin(shard_op *op, kvi_store *store, int32_t root, const void *items, int32_t n, size_t known,
                               struct CUstream_st *stream, const char *fn);
/* The transfer lists: a buffer and an op per rank. */
kvi_status kvi__shard_op_lists(shard_op *op);
/* Rank r's buffer, room for its slices of every fact. */
kvi_status kvi__shard_op_alloc(shard_op *op, int32_t r, const void *tok, const void *dt, size_t step, size_t *total);
/* The transfer of rank r's buffer. */
void kvi__shard_op_push(shard_op *op, int32_t r, size_t total, bool send);
/* The transfer, joined by every rank only if every rank could prepare it. */
kvi_status kvi__shard_op_transfer(shard_op *op, kvi_status st);
void kvi__shard_op_end(shard_op *op);
/* Heads [first, first + h) of a full view. */
kvi_kv_view kvi__shard_heads_of(const kvi_kv_view *v, int32_t first, int32_t h);
/* A packed slice of T tokens and h heads at base (b bytes, K then V). */
kvi_kv_view kvi__shard_slice_view(const shard_op *op, kvi_dtype dt, int32_t T, int32_t h, char *base, size_t b);

/* ---- sharded retrieval (search.c) --------------------------------------- */

/* The collective search of a store with sharded embeddings (the store's
 * search.collective, set at creation). */
kvi_status kvi__shard_search(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn);

#endif /* KVI_TP_INTERNAL_H */
