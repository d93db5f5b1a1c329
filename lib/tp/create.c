/*
 * Tensor-parallel stores: creation. A store with a communicator is made by
 * the ranks together: each makes its own, then they check that they agree
 * (kvi_store_create with opts->comm).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "tp/internal.h"

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
    h = kvi__shard_fnv(h, head, sizeof head);
    if (r->style == KVI_ROPE_NONE) continue;
    h = kvi__shard_fnv(h, &r->attn, sizeof r->attn);
    if (r->inv_freq) h = kvi__shard_fnv(h, r->inv_freq, (size_t)(r->rotary_dim / 2) * sizeof(float));
    if (r->table)
      h = kvi__shard_fnv(h, r->table->data, (size_t)r->table->positions * (size_t)r->table->rotary_dim * sizeof(float));
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
    if (s->shard.emb_sharded) s->search.collective = kvi__shard_search;
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
