/*
 * Tensor-parallel stores: agreement at creation, put from a full-head
 * source (scatter), gather to one rank, agreement of the fact sets, and
 * sharded retrieval (see kvinject/comm.h). Written once over the transport
 * seam of tp/tp.h: data buffers live where the communicator moves
 * them (host memory for the in-process transport, device memory for NCCL).
 * SPDX-License-Identifier: Apache-2.0
 *
 * Every collective here follows one pattern: each rank does its local part,
 * then the ranks exchange their statuses and proceed only if all succeeded.
 * A rank that failed still joins every exchange, so no rank waits forever,
 * and the store is changed only after the last exchange said yes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "search/search.h"
#include "store/store.h"
#include "tp/tp.h"

static kvi_status shard_search(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                               const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                               int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                               struct CUstream_st *stream, const char *fn);

/* ------------------------------------------------------------------------ */
/* small helpers                                                            */
/* ------------------------------------------------------------------------ */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* Before a control exchange on an NCCL communicator: the caller's stream
 * has no NCCL work left running, so that two NCCL operations of one
 * communicator never run at once on two streams. */
static kvi_status drain(kvi_comm *c, struct CUstream_st *stream, const char *fn) {
  if (c->memory != KVI_MEMORY_DEVICE) return KVI_OK;
  return kvi__cuda_sync(stream, fn);
}

/* After every rank reported `local`: KVI_OK when all did, else this rank's
 * own error, or KVI_ERR_PEER naming the first rank that failed. `stream`
 * (NCCL) is drained first. */
static kvi_status combine(kvi_comm *c, kvi_status local, struct CUstream_st *stream, const char *fn) {
  const kvi_status sd = drain(c, stream, fn);
  if (local == KVI_OK) local = sd;
  int32_t *all = malloc((size_t)c->size * sizeof *all);
  const int32_t mine = (int32_t)local;
  if (!all) { /* still take part, or the others wait forever */
    kvi__comm_allgather_host(c, &mine, NULL, sizeof mine, fn);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d statuses", (int)c->size);
  }
  kvi_status st = kvi__comm_allgather_host(c, &mine, all, sizeof mine, fn);
  if (st == KVI_OK && local != KVI_OK) st = local;
  for (int32_t r = 0; st == KVI_OK && r < c->size; r++)
    if (all[r] != KVI_OK)
      st = kvi__fail(KVI_ERR_PEER, fn, "rank %d failed: %s", (int)r, kvi__status_string((kvi_status)all[r]));
  free(all);
  return st == KVI_OK ? KVI_OK : (local != KVI_OK ? local : st);
}

/* Buffers in the communicator's memory. */
static kvi_status buf_alloc(kvi_comm *c, void **p, size_t bytes, struct CUstream_st *stream, const char *fn) {
  *p = NULL;
  if (c->memory == KVI_MEMORY_DEVICE) return kvi__cuda_malloc_async(p, bytes ? bytes : 16, stream, fn);
  *p = malloc(bytes ? bytes : 16);
  return *p ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", bytes);
}

static void buf_free(kvi_comm *c, void *p, struct CUstream_st *stream, const char *fn) {
  if (c->memory == KVI_MEMORY_DEVICE) {
    if (p) kvi__cuda_free_async(p, stream, fn);
  } else {
    free(p);
  }
}

/* Copies L x T x H rows of row_bytes between two strided (bytes) layouts in
 * `memory` (device: enqueued on stream). */
static kvi_status copy_rows(void *dst, const int64_t dst_stride[3], const void *src, const int64_t src_stride[3],
                            int32_t L, int32_t T, int32_t H, int64_t row_bytes, kvi_memory memory,
                            struct CUstream_st *stream, const char *fn) {
#ifdef KVI_HAVE_CUDA
  if (memory == KVI_MEMORY_DEVICE) {
    const kvi__rows_args a = {dst, src, {dst_stride[0], dst_stride[1], dst_stride[2]},
                              {src_stride[0], src_stride[1], src_stride[2]}, L, T, H, row_bytes};
    const int e = kvi__cuda_copy_rows(&a, stream);
    return e ? kvi__cuda_error(e, fn, "the row-copy kernel") : KVI_OK;
  }
#else
  (void)stream;
  if (memory == KVI_MEMORY_DEVICE) return kvi__fail(KVI_ERR_NOT_BUILT, fn, "no CUDA in this build");
#endif
  for (int32_t l = 0; l < L; l++)
    for (int32_t t = 0; t < T; t++)
      for (int32_t h = 0; h < H; h++)
        memcpy((char *)dst + l * dst_stride[0] + t * dst_stride[1] + h * dst_stride[2],
               (const char *)src + l * src_stride[0] + t * src_stride[1] + h * src_stride[2], (size_t)row_bytes);
  return KVI_OK;
}

/* A contiguous [L][T][H][D] view of `elem`-byte elements at base. */
static kvi_kv_view packed_view(kvi_memory m, kvi_dtype t, int32_t L, int32_t T, int32_t H, int32_t D, void *k,
                               void *v) {
  kvi_kv_view w;
  kvi__kv_view_contiguous(&w, m, t, L, T, H, D, k, v);
  return w;
}

/* Byte strides of a view. */
static void strides_of(const kvi_kv_view *v, int64_t s[3]) {
  const int64_t e = (int64_t)kvi__dtype_size(v->dtype);
  s[0] = v->layer_stride * e;
  s[1] = v->token_stride * e;
  s[2] = v->head_stride * e;
}

/* ------------------------------------------------------------------------ */
/* creation                                                                 */
/* ------------------------------------------------------------------------ */

typedef struct agree_rec {
  int32_t status, rank, tp_rank, tp_size;
  int32_t layers, kv_heads, head_size, dtype;
  int32_t page_tokens, emb_dim, emb_dtype, metric;
  int32_t placement, pad;
  uint64_t rope;
} agree_rec;

static uint64_t rope_digest(const kvi_model *m) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t l = 0; l < m->geom.num_layers; l++) {
    const kvi__rope *r = &m->rope[l];
    const int32_t head[2] = {(int32_t)r->style, r->rotary_dim};
    h = fnv(h, head, sizeof head);
    if (r->style == KVI_ROPE_NONE) continue;
    h = fnv(h, &r->attn, sizeof r->attn);
    if (r->inv_freq) h = fnv(h, r->inv_freq, (size_t)(r->rotary_dim / 2) * sizeof(float));
    if (r->table)
      h = fnv(h, r->table->data, (size_t)r->table->positions * (size_t)r->table->rotary_dim * sizeof(float));
  }
  return h;
}

/* The collective part of kvi_store_create with a communicator. s is the
 * store this rank made (NULL when local is an error). Checks that the ranks
 * agree; on success sets s's comm fields. Returns the combined status; the
 * caller destroys s when it is not KVI_OK. This is where a store and its
 * communicator meet: an NCCL communicator's store must be on its device,
 * so every later call of the store, run on the store's device by its entry
 * point, has the communicator's device current for the exchanges. */
static kvi_status shard_create(kvi_store *s, const kvi_model *model, const kvi_store_options *o, kvi_status local,
                               const char *fn) {
  kvi_comm *c = o->comm;
  const kvi__geom *g = model ? &model->geom : NULL;
  if (local == KVI_OK) {
    if (g->tp_size != c->size || g->tp_rank != c->rank)
      local = kvi__fail(KVI_ERR_MISMATCH, fn,
                        "the model is rank %d of tp %d, the communicator rank %d of %d ranks", (int)g->tp_rank,
                        (int)g->tp_size, (int)c->rank, (int)c->size);
    else if (c->kind == KVI__COMM_LOCAL && s->backend != KVI_BACKEND_CPU)
      local = kvi__fail(KVI_ERR_MISMATCH, fn, "an in-process communicator carries host memory: use it with CPU stores");
    else if (c->kind == KVI__COMM_NCCL && (s->backend != KVI_BACKEND_CUDA || s->device != c->device))
      local = kvi__fail(KVI_ERR_MISMATCH, fn, "the NCCL communicator is on device %d; the store is %s %d", c->device,
                        s->backend == KVI_BACKEND_CUDA ? "on device" : "a CPU store, device", (int)s->device);
  }
  agree_rec me = {(int32_t)local, c->rank, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  if (g) {
    me.tp_rank = g->tp_rank;
    me.tp_size = g->tp_size;
    me.layers = g->num_layers;
    me.kv_heads = g->num_kv_heads;
    me.head_size = g->head_size;
    me.rope = rope_digest(model);
  }
  me.dtype = (int32_t)o->dtype;
  me.page_tokens = o->page_tokens;
  me.emb_dim = o->embedding_dim;
  me.emb_dtype = (int32_t)o->embedding_dtype;
  me.metric = (int32_t)o->metric;
  me.placement = (int32_t)o->embedding_placement;
  agree_rec *all = calloc((size_t)c->size, sizeof *all);
  if (!all) me.status = KVI_ERR_OUT_OF_MEMORY;
  kvi_status st = kvi__comm_allgather_host(c, &me, all, sizeof me, fn); /* NULL: taking part only */
  if (!all) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d records", (int)c->size);
  if (st == KVI_OK && local != KVI_OK) st = local;
  for (int32_t r = 0; st == KVI_OK && r < c->size; r++)
    if (all[r].status != KVI_OK)
      st = kvi__fail(KVI_ERR_PEER, fn, "rank %d failed to create its store: %s", (int)r,
                     kvi__status_string((kvi_status)all[r].status));
  static const struct {
    const char *name;
    size_t off;
  } fields[] = {
      {"tp_size", offsetof(agree_rec, tp_size)},           {"num_layers", offsetof(agree_rec, layers)},
      {"num_kv_heads", offsetof(agree_rec, kv_heads)},     {"head_size", offsetof(agree_rec, head_size)},
      {"dtype", offsetof(agree_rec, dtype)},               {"page_tokens", offsetof(agree_rec, page_tokens)},
      {"embedding_dim", offsetof(agree_rec, emb_dim)},     {"embedding_dtype", offsetof(agree_rec, emb_dtype)},
      {"metric", offsetof(agree_rec, metric)},             {"embedding_placement", offsetof(agree_rec, placement)},
  };
  for (int32_t r = 1; st == KVI_OK && r < c->size; r++) {
    for (size_t f = 0; st == KVI_OK && f < sizeof fields / sizeof fields[0]; f++) {
      int32_t a, b;
      memcpy(&a, (const char *)&all[0] + fields[f].off, sizeof a);
      memcpy(&b, (const char *)&all[r] + fields[f].off, sizeof b);
      if (a != b)
        st = kvi__fail(KVI_ERR_MISMATCH, fn, "the ranks disagree on %s: %d on rank 0, %d on rank %d", fields[f].name,
                       (int)a, (int)b, (int)r);
    }
    if (st == KVI_OK && all[r].rope != all[0].rope)
      st = kvi__fail(KVI_ERR_MISMATCH, fn, "the ranks disagree on the RoPE of some layer (rank 0 and rank %d)", (int)r);
    if (st == KVI_OK && all[r].tp_rank != r)
      st = kvi__fail(KVI_ERR_MISMATCH, fn, "communicator rank %d holds model tp_rank %d", (int)r, (int)all[r].tp_rank);
  }
  free(all);
  if (st == KVI_OK) {
    s->shard.comm = c;
    s->shard.rank = c->rank;
    s->shard.size = c->size;
    s->shard.emb_sharded = o->embedding_placement == KVI_EMBEDDINGS_SHARDED && o->embedding_dim > 0;
    if (s->shard.emb_sharded) s->search.collective = shard_search;
  }
  return st;
}

int kvi__shard_store_device(const kvi_store_options *opts, const char *fn) {
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  if (!opts || kvi__read_struct(&o, sizeof o, opts, KVI__STORE_OPTIONS_V1, fn, "opts")) return -1;
  const int comm_device = o.comm ? kvi__comm_device(o.comm) : -1;
  return comm_device >= 0 ? comm_device : kvi__store_options_device(&o, fn);
}

/* Here rather than in store.c: a store with a communicator is made by the
 * ranks together, and the store knows nothing of them. */
kvi_status kvi__shard_store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts,
                                   const char *fn) {
  if (!out || !opts) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !out ? "out" : "opts");
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  kvi_status st = kvi__read_struct(&o, sizeof o, opts, KVI__STORE_OPTIONS_V1, fn, "opts");
  if (st) return st;
  kvi_store *s = NULL;
  if (!model) st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "model is NULL");
  else if (o.embedding_placement != KVI_EMBEDDINGS_REPLICATED && o.embedding_placement != KVI_EMBEDDINGS_SHARDED)
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                   "opts->embedding_placement is %d, expected KVI_EMBEDDINGS_REPLICATED (0) or SHARDED (1)",
                   (int)o.embedding_placement);
  else if (o.embedding_placement == KVI_EMBEDDINGS_SHARDED && !o.comm)
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->embedding_placement is SHARDED but opts->comm is NULL");
  else st = kvi__store_create(&s, model, &o, fn);
  if (o.comm) { /* collective: every rank takes part, whatever happened here */
    st = shard_create(s, model, &o, st, fn);
    if (st && s) {
      kvi__store_destroy(s, true);
      s = NULL;
    }
  }
  if (st == KVI_OK) *out = s;
  return st;
}


/* ------------------------------------------------------------------------ */
/* put from a full-head source                                              */
/* ------------------------------------------------------------------------ */

typedef struct op_rec { /* what every rank says before a scatter or gather */
  int32_t status, root, n, pad;
  uint64_t digest; /* of the (tenant, fact id) list */
} op_rec;

/* Exchanges op records; checks that none failed and that the ranks agree
 * on root and on the list of facts. */
static kvi_status exchange_op(kvi_comm *c, op_rec *me, struct CUstream_st *stream, const char *fn) {
  const kvi_status sd = drain(c, stream, fn);
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

typedef struct comm_gate {
  kvi__gate gate;
  kvi_comm *comm;
  struct CUstream_st *stream;
  const char *fn;
} comm_gate;

static kvi_status comm_decide(kvi__gate *g, kvi_status local) {
  comm_gate *cg = (comm_gate *)g;
  return combine(cg->comm, local, cg->stream, cg->fn);
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
static kvi__geom full_geom(const kvi_store *s) {
  kvi__geom g = s->geom;
  g.local_heads = g.num_kv_heads;
  g.head_first = 0;
  return g;
}

/* Items are read through their struct_size (arrays step by items[0]'s). */
static const void *item_at(const void *items, size_t stride, int32_t i) { return (const char *)items + stride * (size_t)i; }

/* The stride of an item array: items[0].struct_size, at least `known`; every
 * item must have that struct_size and zeros past the `known` bytes. */
static kvi_status item_stride(const void *items, int32_t n, size_t known, size_t *stride, const char *fn) {
  *stride = known;
  if (n > 0) memcpy(stride, items, sizeof *stride);
  if (*stride < known)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "items[0].struct_size is %zu, expected %zu", *stride, known);
  _Static_assert(sizeof(kvi_scatter_item) <= 64 && sizeof(kvi_gather_item) <= 64, "item_stride's scratch copy");
  unsigned char local[64];
  for (int32_t i = 0; i < n && *stride > known; i++) {
    const void *it = item_at(items, *stride, i);
    size_t sz;
    memcpy(&sz, it, sizeof sz);
    if (sz != *stride)
      return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "items[%d].struct_size is %zu, items[0]'s %zu", (int)i, sz, *stride);
    kvi_status st = kvi__read_struct(local, known, it, known, fn, "items[i]");
    if (st) return st;
  }
  return KVI_OK;
}

static uint64_t keys_digest(const void *items, size_t stride, int32_t n) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t i = 0; i < n; i++) {
    uint64_t k[2];
    memcpy(k, (const char *)item_at(items, stride, i) + sizeof(size_t), sizeof k); /* tenant, fact_id */
    h = fnv(h, k, sizeof k);
  }
  return h;
}

/* What root tells the others about each fact of a scatter. */
typedef struct item_rec {
  int32_t tokens, dtype;
  uint32_t flags, has_emb;
} item_rec;

/* Bytes of fact i's slice for rank r (K and V), packed [2][L][T][h][D]. */
static size_t slice_bytes(const kvi__geom *g, int32_t r, int32_t T, size_t esz) {
  int32_t first, h;
  kvi__geom_rank_heads(g, r, &first, &h);
  return 2 * (size_t)g->num_layers * (size_t)T * (size_t)h * (size_t)g->head_size * esz;
}

/* Copies fact slices between full views and packed buffers: K, then V,
 * heads [first, first + h) of the full view. to_full: packed -> full. */
static kvi_status pack(const kvi_kv_view *full, void *packed, int32_t first, int32_t h, bool to_full, kvi_memory mem,
                       struct CUstream_st *stream, const char *fn) {
  const size_t esz = kvi__dtype_size(full->dtype);
  const int32_t L = full->num_layers, T = full->num_tokens, D = full->head_size;
  const size_t plane = (size_t)L * T * h * D * esz;
  const int64_t ps[3] = {(int64_t)T * h * D * (int64_t)esz, (int64_t)h * D * (int64_t)esz, (int64_t)D * (int64_t)esz};
  int64_t fs[3];
  strides_of(full, fs);
  kvi_status st = KVI_OK;
  for (int kv = 0; kv < 2 && st == KVI_OK; kv++) {
    char *f = (char *)(kv ? full->v : full->k) + (int64_t)first * fs[2];
    char *p = (char *)packed + kv * plane;
    st = to_full ? copy_rows(f, fs, p, ps, L, T, h, (int64_t)D * (int64_t)esz, mem, stream, fn)
                 : copy_rows(p, ps, f, fs, L, T, h, (int64_t)D * (int64_t)esz, mem, stream, fn);
  }
  return st;
}

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

/* Checks the arguments of a scatter or gather (item size `known`) and
 * starts op; op->v is NULL when it could not be allocated. A failure here
 * is this rank's alone: it returns before any exchange. */
static kvi_status op_begin(shard_op *op, kvi_store *store, int32_t root, const void *items, int32_t n, size_t known,
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
static kvi_status op_lists(shard_op *op) {
  op->bufs = calloc((size_t)op->c->size, sizeof *op->bufs);
  op->ops = calloc((size_t)op->c->size, sizeof *op->ops);
  return op->bufs && op->ops ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, op->fn, "allocating transfer lists");
}

/* Rank r's buffer, room for its slices of every fact, into op->bufs[r];
 * *total its bytes. Fact i has the int32 token count at tok + i * step and
 * the int32 dtype at dt + i * step (bytes). */
static kvi_status op_alloc(shard_op *op, int32_t r, const void *tok, const void *dt, size_t step, size_t *total) {
  const kvi__geom *g = &op->store->geom;
  *total = 0;
  for (int32_t i = 0; i < op->n; i++) {
    int32_t T, t;
    memcpy(&T, (const char *)tok + (size_t)i * step, sizeof T);
    memcpy(&t, (const char *)dt + (size_t)i * step, sizeof t);
    if (__builtin_add_overflow(*total, slice_bytes(g, r, T, kvi__dtype_size((kvi_dtype)t)), total))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, op->fn, "the items' slices for rank %d pass 2^64 bytes", (int)r);
  }
  return buf_alloc(op->c, &op->bufs[r], *total, op->stream, op->fn);
}

/* The transfer of rank r's buffer: between root and r (on root), between
 * this rank and root (on the others); `send` says which side this is. */
static void op_push(shard_op *op, int32_t r, size_t total, bool send) {
  op->ops[op->nops++] = (kvi__p2p){op->is_root ? r : op->root, send, op->bufs[r], total};
}

/* Every rank joins the transfer only if every rank could prepare it
 * (st: this rank's preparation). */
static kvi_status op_transfer(shard_op *op, kvi_status st) {
  kvi_comm *c = op->c;
  st = combine(c, st, op->stream, op->fn);
  if (st == KVI_OK) st = combine(c, kvi__comm_p2p(c, op->ops, op->nops, op->stream, op->fn), op->stream, op->fn);
  return st;
}

static void op_end(shard_op *op) {
  for (int32_t r = 0; op->bufs && r < op->c->size; r++) buf_free(op->c, op->bufs[r], op->stream, op->fn);
  free(op->ops);
  free(op->bufs);
  free(op->v);
}

/* Heads [first, first + h) of a full view. */
static kvi_kv_view heads_of(const kvi_kv_view *v, int32_t first, int32_t h) {
  kvi_kv_view w = *v;
  w.num_heads = h;
  const size_t o = (size_t)first * (size_t)v->head_stride * kvi__dtype_size(v->dtype);
  w.k = (char *)v->k + o;
  w.v = (char *)v->v + o;
  return w;
}

/* A packed slice of T tokens and h heads at base (b bytes, K then V). */
static kvi_kv_view slice_view(const shard_op *op, kvi_dtype dt, int32_t T, int32_t h, char *base, size_t b) {
  const kvi__geom *g = &op->store->geom;
  return packed_view(op->c->memory, dt, g->num_layers, T, h, g->head_size, base, base + b / 2);
}

/* A scatter in progress (kvi_store_put_scatter). */
typedef struct scatter {
  shard_op op;
  int32_t E;
  /* the block root broadcasts: [n records][n embeddings] */
  char *info;
  size_t info_bytes;
  item_rec *rec;
  float *embs;
  size_t *mine_off; /* where my slice of fact i arrives */
  void *host_pack;
} scatter;

/* Root: kvi_store_put's checks on every full view, into the block. */
static kvi_status scatter_read(scatter *sc) {
  shard_op *op = &sc->op;
  kvi_store *store = op->store;
  const kvi__geom fg = full_geom(store);
  const char *fn = op->fn;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    const kvi_scatter_item *it = item_at(op->items, op->stride, i);
    kvi_put_options o;
    float *emb = NULL;
    if (it->struct_size != op->stride)
      st = kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "items[%d].struct_size is %zu, items[0]'s %zu", (int)i, it->struct_size,
                     op->stride);
    else if (!it->full) st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "items[%d].full is NULL on the root rank", (int)i);
    else st = kvi__view_check(&op->v[i], it->full, &fg, false, fn);
    if (st == KVI_OK) st = kvi__store_put_args(store, &op->v[i], it->opts, &o, &emb, op->stream, fn);
    if (st) break;
    const item_rec r = {op->v[i].num_tokens, (int32_t)op->v[i].dtype, o.flags, emb != NULL};
    sc->rec[i] = r;
    if (emb) memcpy(sc->embs + (size_t)i * sc->E, emb, (size_t)sc->E * sizeof(float));
    free(emb);
  }
  return st;
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
  kvi_status st = op_alloc(op, r, &rec[0].tokens, &rec[0].dtype, sizeof *rec, &total);
  if (st) return st;
  size_t at = 0;
  int32_t first, h;
  kvi__geom_rank_heads(g, r, &first, &h);
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    const size_t b = slice_bytes(g, r, rec[i].tokens, kvi__dtype_size((kvi_dtype)rec[i].dtype));
    if (r == c->rank) sc->mine_off[i] = at;
    char *dst = (char *)op->bufs[r] + at;
    if (op->is_root && op->v[i].memory == c->memory) {
      st = pack(&op->v[i], dst, first, h, false, c->memory, op->stream, fn);
    } else if (op->is_root) { /* a host source for device transfers: pack on the host, then one copy up */
      void *p = realloc(sc->host_pack, b);
      if (!p) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", b);
      sc->host_pack = p;
      st = pack(&op->v[i], p, first, h, false, KVI_MEMORY_HOST, NULL, fn);
      if (st == KVI_OK) st = kvi__cuda_h2d(dst, p, b, op->stream, fn);
      if (st == KVI_OK) st = kvi__cuda_sync(op->stream, fn); /* host_pack is reused */
    }
    at += b;
  }
  if (st == KVI_OK) op_push(op, r, total, op->is_root);
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
  kvi_kv_view *mine = calloc((size_t)n, sizeof *mine);
  kvi__put_item *put = calloc((size_t)n, sizeof *put);
  kvi_status st = mine && put ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d views", (int)n);
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi_dtype dt = (kvi_dtype)sc->rec[i].dtype;
    const int32_t T = sc->rec[i].tokens;
    if (op->is_root)
      mine[i] = heads_of(&op->v[i], first, h);
    else
      mine[i] = slice_view(op, dt, T, h, (char *)op->bufs[c->rank] + sc->mine_off[i],
                           slice_bytes(g, c->rank, T, kvi__dtype_size(dt)));
    float *emb = NULL;
    if (sc->rec[i].has_emb) {
      if (!(emb = malloc((size_t)E * sizeof *emb))) {
        st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating an embedding");
        break;
      }
      memcpy(emb, sc->embs + (size_t)i * E, (size_t)E * sizeof *emb);
    }
    const kvi_scatter_item *it = item_at(op->items, op->stride, i);
    const kvi__put_item p = {it->tenant, it->fact_id, &mine[i], sc->rec[i].flags, emb};
    put[i] = p;
  }
  comm_gate gate = {{comm_decide}, c, op->stream, fn};
  if (st == KVI_OK) {
    st = kvi__store_put_views(op->store, put, n, op->stream, &gate.gate, fn);
  } else { /* still decide with the others */
    for (int32_t i = 0; put && i < n; i++) free(put[i].emb);
    combine(c, st, op->stream, fn);
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
  kvi_status st = op_begin(op, store, root, items, num_items, sizeof *items, stream, fn);
  if (st) return st;
  kvi_comm *c = op->c;
  const int32_t n = num_items;
  sc.E = store->emb_dim;
  sc.info_bytes = (size_t)n * sizeof(item_rec) + (size_t)n * (size_t)sc.E * sizeof(float);
  sc.info = calloc(sc.info_bytes ? sc.info_bytes : 1, 1);
  if (!op->v || !sc.info) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d items", (int)n);
  sc.rec = (item_rec *)sc.info;
  sc.embs = sc.info ? (float *)(sc.info + (size_t)n * sizeof(item_rec)) : NULL;
  if (st == KVI_OK && op->is_root) st = scatter_read(&sc);
  op_rec me = {(int32_t)st, root, n, 0, st ? 0 : keys_digest(items, op->stride, n)};
  if ((st = exchange_op(c, &me, stream, fn)) == KVI_OK && n > 0) /* every rank knows n: all skip alike */
    st = kvi__comm_bcast_host(c, sc.info, sc.info_bytes, root, fn);

  /* root packs and sends; each other rank receives its own */
  if (st == KVI_OK && n > 0) {
    sc.mine_off = calloc((size_t)n, sizeof *sc.mine_off);
    st = op_lists(op);
    if (st == KVI_OK && !sc.mine_off) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating transfer lists");
    for (int32_t r = 0; st == KVI_OK && r < c->size; r++)
      if (r != root && (op->is_root || r == c->rank)) st = scatter_buffer(&sc, r);
    st = op_transfer(op, st);
    if (st == KVI_OK) st = scatter_put(&sc);
  }
  op_end(op);
  free(sc.host_pack);
  free(sc.mine_off);
  free(sc.info);
  return st;
}

/* ------------------------------------------------------------------------ */
/* gather to one rank                                                       */
/* ------------------------------------------------------------------------ */

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
  const kvi__geom fg = full_geom(store);
  const bool cuda_store = store->backend == KVI_BACKEND_CUDA;
  kvi_status st = KVI_OK;
  for (int32_t i = 0; i < op->n && st == KVI_OK; i++) {
    const kvi_gather_item *it = item_at(op->items, op->stride, i);
    kvi_kv_view *v = &op->v[i];
    if (it->struct_size != op->stride)
      st = kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "items[%d].struct_size is %zu, items[0]'s %zu", (int)i, it->struct_size,
                     op->stride);
    if (st == KVI_OK)
      st = kvi__store_fact_tokens(store, it->tenant, it->fact_id, &ga->tok[i], "kvi_store_fact_tokens");
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
  kvi_status st = op_alloc(op, r, rt, rt + n, sizeof *rt, &total);
  if (st) return st;
  size_t at = 0;
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi_dtype dt = (kvi_dtype)rt[n + i];
    const size_t b = slice_bytes(g, r, rt[i], kvi__dtype_size(dt));
    if (!op->is_root) { /* read my slice, packed, in root's dtype */
      const kvi_gather_item *it = item_at(op->items, op->stride, i);
      const kvi_kv_view w = slice_view(op, dt, rt[i], h, (char *)op->bufs[r] + at, b);
      st = kvi__store_read(op->store, it->tenant, it->fact_id, &w, op->stream, "kvi_store_read");
    }
    at += b;
  }
  op_push(op, r, total, !op->is_root);
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
    const size_t b = slice_bytes(g, r, ga->rt[i], kvi__dtype_size(v->dtype));
    const char *src = (const char *)op->bufs[r] + at;
    if (v->memory == c->memory) {
      st = pack(v, (void *)src, first, h, true, c->memory, op->stream, op->fn);
    } else { /* device transfers into a host `full`: one copy down, unpack on the host */
      void *p = realloc(*host_tmp, b);
      if (!p) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, op->fn, "allocating %zu bytes", b);
      *host_tmp = p;
      st = kvi__cuda_d2h(p, src, b, op->stream, op->fn);
      if (st == KVI_OK) st = kvi__cuda_sync(op->stream, op->fn);
      if (st == KVI_OK) st = pack(v, p, first, h, true, KVI_MEMORY_HOST, NULL, op->fn);
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
    const kvi_kv_view w = heads_of(&op->v[i], root_first, root_h);
    st = kvi__store_read(op->store, it->tenant, it->fact_id, &w, op->stream, "kvi_store_read");
  }
  return st;
}

kvi_status kvi__store_gather(kvi_store *store, int32_t root, const kvi_gather_item *items, int32_t num_items,
                             struct CUstream_st *stream, const char *fn) {
  gather ga;
  memset(&ga, 0, sizeof ga);
  shard_op *op = &ga.op;
  kvi_status st = op_begin(op, store, root, items, num_items, sizeof *items, stream, fn);
  if (st) return st;
  kvi_comm *c = op->c;
  const kvi__geom *g = &store->geom;
  const int32_t n = num_items;
  ga.tok = calloc((size_t)(n ? n : 1) * 2, sizeof *ga.tok);
  if (!op->v || !ga.tok) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d items", (int)n);
  if (st == KVI_OK) st = gather_read(&ga);
  op_rec me = {(int32_t)st, root, n, 0, st ? 0 : keys_digest(items, op->stride, n)};
  if ((st = exchange_op(c, &me, stream, fn)) == KVI_OK) st = combine(c, gather_agree(&ga), stream, fn);

  if (st == KVI_OK && n > 0) {
    st = op_lists(op);
    int32_t root_first, root_h;
    kvi__geom_rank_heads(g, root, &root_first, &root_h);
    for (int32_t r = 0; st == KVI_OK && r < c->size; r++) {
      if (r == root || (!op->is_root && r != c->rank) || !first_holder(g, r)) continue;
      int32_t first, h;
      kvi__geom_rank_heads(g, r, &first, &h);
      if (first != root_first) st = gather_buffer(&ga, r, h); /* else root holds these heads itself */
    }
    if (st == KVI_OK && op->is_root) st = gather_own(&ga, root_first, root_h);
    st = op_transfer(op, st);
    void *host_tmp = NULL;
    for (int32_t r = 0; st == KVI_OK && op->is_root && r < c->size; r++)
      if (op->bufs[r]) st = gather_unpack(&ga, r, &host_tmp);
    free(host_tmp);
  }
  op_end(op);
  free(ga.tok);
  free(ga.rt);
  return st;
}

/* ------------------------------------------------------------------------ */
/* agreement of the fact sets                                               */
/* ------------------------------------------------------------------------ */

kvi_status kvi__store_check_agreement(kvi_store *store, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  if (!store->shard.comm) return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "the store was created without a communicator");
  kvi_comm *c = store->shard.comm;
  /* an order-free digest: sums of two independent hashes of every fact */
  uint64_t me[3] = {0, 0, 0};
  kvi__store_lock(store);
  size_t pos = 0;
  for (const fact *f; (f = kvi__store_next_fact(store, &pos));) {
    const uint64_t x = kvi__mix64(f->tenant_id) ^ kvi__mix64(f->id + 0x9e3779b97f4a7c15ull) ^
                       kvi__mix64((uint64_t)f->tokens << 1 | 1);
    me[0]++;
    me[1] += kvi__mix64(x);
    me[2] += kvi__mix64(x ^ 0x5851f42d4c957f2dull);
  }
  kvi__store_unlock(store);
  uint64_t *all = calloc((size_t)c->size * 3, sizeof *all);
  if (!all) {
    kvi__comm_allgather_host(c, me, NULL, sizeof me, fn);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d digests", (int)c->size);
  }
  kvi_status st = kvi__comm_allgather_host(c, me, all, sizeof me, fn);
  for (int32_t r = 1; st == KVI_OK && r < c->size; r++)
    if (memcmp(all + 3 * r, all, sizeof me) != 0)
      st = kvi__fail(KVI_ERR_MISMATCH, fn,
                     "the ranks hold different facts: rank 0 has %llu, rank %d has %llu%s", (unsigned long long)all[0],
                     (int)r, (unsigned long long)all[3 * r],
                     all[0] == all[3 * r] ? " (same count, different ids or token counts)" : "");
  free(all);
  return st;
}

/* ------------------------------------------------------------------------ */
/* sharded retrieval                                                        */
/* ------------------------------------------------------------------------ */

/* A rank's block: header, then its nq x k ids, scores and nq counts. */
static size_t block_bytes(int32_t nq, int32_t k) {
  const size_t n = (size_t)nq * (size_t)k;
  const size_t b = sizeof(kvi__shard_hdr) + n * 8 + n * 4 + (size_t)nq * 4;
  return (b + 15) / 16 * 16;
}

static uint64_t query_digest(const uint64_t *tenants, int32_t nq, int32_t k) {
  uint64_t h = fnv(0xcbf29ce484222325ull, &k, sizeof k);
  h = fnv(h, &nq, sizeof nq);
  return fnv(h, tenants, (size_t)nq * sizeof *tenants);
}

/* The CPU merge (the reference for the kernel): candidate j of rank r lands
 * at j plus the number of candidates of every other rank that rank before it
 * (score descending, NaN as -infinity, then id ascending; ids are distinct
 * across ranks, as each fact's embedding is on one rank). */
static float key(float s) { return isnan(s) ? -INFINITY : s; }

static bool before(float sa, uint64_t ia, float sb, uint64_t ib) {
  sa = key(sa);
  sb = key(sb);
  return sa > sb || (sa == sb && ia < ib);
}

static void merge_host(const char *blocks, size_t bb, int32_t size, int32_t nq, int32_t k, uint64_t *out_ids,
                       float *out_scores, int32_t *out_counts) {
  const size_t n = (size_t)nq * (size_t)k;
  for (int32_t q = 0; q < nq; q++) {
    int64_t total = 0;
    for (int32_t j = 0; j < k; j++) {
      out_ids[(size_t)q * k + j] = KVI_SEARCH_NO_ID;
      out_scores[(size_t)q * k + j] = -INFINITY;
    }
    for (int32_t r = 0; r < size; r++) {
      const char *b = blocks + (size_t)r * bb + sizeof(kvi__shard_hdr);
      const uint64_t *ids = (const uint64_t *)b + (size_t)q * k;
      const float *sc = (const float *)(b + n * 8) + (size_t)q * k;
      const int32_t cnt = ((const int32_t *)(b + n * 12))[q];
      total += cnt;
      for (int32_t j = 0; j < cnt; j++) {
        int64_t pos = j;
        for (int32_t o = 0; o < size; o++) {
          if (o == r) continue;
          const char *ob = blocks + (size_t)o * bb + sizeof(kvi__shard_hdr);
          const uint64_t *oid = (const uint64_t *)ob + (size_t)q * k;
          const float *osc = (const float *)(ob + n * 8) + (size_t)q * k;
          int32_t lo = 0, hi = ((const int32_t *)(ob + n * 12))[q];
          while (lo < hi) { /* candidates of o that rank before (sc[j], ids[j]) */
            const int32_t mid = (lo + hi) / 2;
            if (before(osc[mid], oid[mid], sc[j], ids[j])) lo = mid + 1;
            else hi = mid;
          }
          pos += lo;
        }
        if (pos < k) {
          out_ids[(size_t)q * k + pos] = ids[j];
          out_scores[(size_t)q * k + pos] = sc[j];
        }
      }
    }
    out_counts[q] = total < k ? (int32_t)total : k;
  }
}

/* The collective search of a store with sharded embeddings, registered on
 * the store as its search.collective (locked: as kvi__search_local). */
static kvi_status shard_search(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                               const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                               int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                               struct CUstream_st *stream, const char *fn) {
  kvi_comm *c = s->shard.comm;
  const size_t bb = block_bytes(nq, k), n = (size_t)nq * (size_t)k;
  const kvi__shard_hdr hdr0 = {0, nq, k, 0, query_digest(tenants, nq, k)};
  kvi_status st = KVI_OK;
  if (c->memory == KVI_MEMORY_HOST) { /* the in-process transport: all on the host */
    char *mine = malloc(bb), *all = malloc(bb * (size_t)c->size);
    if (!mine || !all) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", bb * (size_t)c->size);
    if (st == KVI_OK)
      st = kvi__search_local(s, queries, qt, qm, nq, tenants, k, (uint64_t *)(mine + sizeof hdr0),
                             (float *)(mine + sizeof hdr0 + n * 8), (int32_t *)(mine + sizeof hdr0 + n * 12),
                             KVI_MEMORY_HOST, ws, locked, stream, fn);
    kvi__shard_hdr hdr = hdr0;
    hdr.status = (int32_t)st;
    if (mine) memcpy(mine, &hdr, sizeof hdr);
    /* the block size follows from nq and k, which every rank passes alike; without a
     * block, this rank's reads as all ones to the others: a failed status */
    kvi_status sx = kvi__comm_allgather(c, mine, all, bb, stream, fn);
    if (st == KVI_OK) st = sx;
    for (int32_t r = 0; st == KVI_OK && r < c->size; r++) {
      kvi__shard_hdr h;
      memcpy(&h, all + (size_t)r * bb, sizeof h);
      if (h.status != KVI_OK)
        st = kvi__fail(KVI_ERR_PEER, fn, "rank %d failed its part of the search: %s", (int)r,
                       kvi__status_string((kvi_status)h.status));
      else if (h.digest != hdr0.digest || h.nq != nq || h.k != k)
        st = kvi__fail(KVI_ERR_MISMATCH, fn, "rank %d searched other tenants, query count or k than rank %d", (int)r,
                       (int)c->rank);
    }
    if (st == KVI_OK) merge_host(all, bb, c->size, nq, k, out_ids, out_scores, out_counts);
    free(mine);
    free(all);
    return st;
  }

  /* NCCL: local search, all-gather and merge, all enqueued on `stream` */
  char *mine = NULL, *all = NULL, *tmp = NULL;
  const size_t out_bytes = n * 12 + (size_t)nq * 4 + 16;
  st = kvi__cuda_malloc_async((void **)&mine, bb, stream, fn);
  if (st == KVI_OK) st = kvi__cuda_malloc_async((void **)&all, bb * (size_t)c->size, stream, fn);
  if (st == KVI_OK && om == KVI_MEMORY_HOST) st = kvi__cuda_malloc_async((void **)&tmp, out_bytes, stream, fn);
  if (st == KVI_OK)
    st = kvi__search_local(s, queries, qt, qm, nq, tenants, k, (uint64_t *)(mine + sizeof hdr0),
                           (float *)(mine + sizeof hdr0 + n * 8), (int32_t *)(mine + sizeof hdr0 + n * 12),
                           KVI_MEMORY_DEVICE, ws, locked, stream, fn);
  kvi__shard_hdr hdr = hdr0;
  hdr.status = (int32_t)st;
  if (mine) {
    const kvi_status sh = kvi__cuda_h2d(mine, &hdr, sizeof hdr, stream, fn);
    if (st == KVI_OK) st = sh;
    if (sh == KVI_OK && all) { /* join the exchange whenever the block exists */
      const kvi_status sx = kvi__comm_allgather(c, mine, all, bb, stream, fn);
      if (st == KVI_OK) st = sx;
    }
  }
  int32_t flag = 0;
  if (st == KVI_OK) {
    uint64_t *ids = om == KVI_MEMORY_HOST ? (uint64_t *)tmp : out_ids;
    float *sc = om == KVI_MEMORY_HOST ? (float *)(tmp + n * 8) : out_scores;
    int32_t *cnt = om == KVI_MEMORY_HOST ? (int32_t *)(tmp + n * 12) : out_counts;
    const kvi__merge_args a = {all, (int64_t)bb, c->size, nq, k, hdr0.digest, ids, sc, cnt};
#ifdef KVI_HAVE_CUDA
    const int e = kvi__cuda_shard_merge(&a, stream);
#else
    (void)a;
    const int e = 0;
    st = kvi__fail(KVI_ERR_NOT_BUILT, fn, "no CUDA in this build");
#endif
    if (e) st = kvi__cuda_error(e, fn, "the merge kernel");
    if (st == KVI_OK && om == KVI_MEMORY_HOST) {
      st = kvi__cuda_d2h(out_ids, ids, n * 8, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_d2h(out_scores, sc, n * 4, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_d2h(out_counts, cnt, (size_t)nq * 4, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_sync(stream, fn);
      for (int32_t q = 0; st == KVI_OK && q < nq; q++)
        if (out_counts[q] < 0) flag = out_counts[q];
    }
  }
  kvi__cuda_free_async(mine, stream, fn);
  kvi__cuda_free_async(all, stream, fn);
  kvi__cuda_free_async(tmp, stream, fn);
  if (st == KVI_OK && flag) {
    for (int32_t q = 0; q < nq; q++) out_counts[q] = 0;
    st = kvi__fail(flag == -1 ? KVI_ERR_PEER : KVI_ERR_MISMATCH, fn,
                   flag == -1 ? "another rank failed its part of the search"
                              : "the ranks searched other tenants, query counts or k");
  }
  return st;
}
