/*
 * Injectors and encoders as handles: creation (the cache layout resolved,
 * the per-layer tables a CUDA store uploads once, the transfer kernel's
 * variant and segment length, the staging slots) and destruction, the
 * handle's locks, and what the entry points and tests/internal read of a
 * handle.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/transfer.h"

/* Byte layout of one staging slot for the limits, plus the alignment padding
 * of a capture call's chunk plans (at most 4 x 15 bytes and a 16-byte start
 * per chunk). */
static size_t slot_size(const kvi_transfer_options *o) {
  return kvi__align_up((size_t)o->max_tokens_per_call * sizeof(kvi__xseg)) +
         kvi__align_up((size_t)o->max_requests_per_call * sizeof(kvi__xreq)) +
         kvi__align_up((size_t)o->max_tokens_per_call * sizeof(int32_t)) +
         kvi__align_up((size_t)o->max_table_entries_per_call * sizeof(int32_t)) +
         ((size_t)o->max_requests_per_call / KVI__CAPTURE_CHUNK + 1) * 80;
}

/* device_ok: the store's device is current (else its memory is left). */
static void xfer_release(xfer *x, bool device_ok) {
  if (x->cuda && device_ok) {
    if (x->up_stream) kvi__cuda_sync(x->up_stream, "kvi_injector_destroy"); /* uploads of failed launches */
    kvi__ring_destroy(&x->ring, "kvi_injector_destroy");
    for (int i = 0; i < KVI__XFER_SLOTS; i++) kvi__cuda_event_destroy(x->up[i]);
    kvi__cuda_stream_destroy(x->up_stream);
    kvi__cuda_event_destroy(x->emb_read);
    kvi__cuda_free(x->dev_tables);
    kvi__async_count_destroy(&x->skipped);
  }
  kvi__cache_release(&x->cache);
  pthread_mutex_destroy(&x->lock);
}

/* Whether two layers rotate identically (the kernel then keeps its cos/sin). */
static bool same_rope(const kvi__rope *a, const kvi__rope *b) {
  if (a->style != b->style || a->rotary_dim != b->rotary_dim || a->attn != b->attn || a->table != b->table) return false;
  if (a->style == KVI_ROPE_NONE || a->table) return true;
  return memcmp(a->inv_freq, b->inv_freq, (size_t)(a->rotary_dim / 2) * sizeof(float)) == 0;
}

size_t kvi__layer_tables(const kvi_store *s, const kvi__cache *c, char *host, char *dev, size_t *o_k, size_t *o_v) {
  const int32_t L = c->L, H = c->H;
  size_t nfreq = 0, ntab = 0;
  for (int32_t l = 0; l < L; l++) {
    const kvi__rope *r = &s->rope[l];
    if (r->style == KVI_ROPE_NONE) continue;
    if (r->table) {
      bool seen = false; /* layers share tables: upload each once */
      for (int32_t m = 0; m < l && !seen; m++) seen = s->rope[m].table == r->table;
      if (!seen) ntab += (size_t)r->table->positions * (size_t)r->rotary_dim;
    } else {
      nfreq += (size_t)(r->rotary_dim / 2);
    }
  }
  const size_t o_layers = 0;
  *o_k = kvi__align_up((size_t)L * sizeof(kvi__xlayer));
  *o_v = *o_k + kvi__align_up((size_t)L * H * sizeof(float));
  const size_t o_f = *o_v + kvi__align_up((size_t)L * H * sizeof(float)),
               o_t = o_f + kvi__align_up(nfreq * sizeof(float)),
               total = o_t + ntab * sizeof(float);
  if (!host) return total;
  kvi__xlayer *ly = (kvi__xlayer *)(host + o_layers);
  memcpy(host + *o_k, c->k_scale, (size_t)L * H * sizeof(float));
  memcpy(host + *o_v, c->v_scale, (size_t)L * H * sizeof(float));
  size_t fo = 0, to = 0;
  for (int32_t l = 0; l < L; l++) {
    const kvi__rope *r = &s->rope[l];
    memset(&ly[l], 0, sizeof ly[l]);
    ly[l].k = c->k[l];
    ly[l].v = c->v[l];
    ly[l].style = (int32_t)r->style;
    ly[l].rot = r->style == KVI_ROPE_NONE ? 0 : r->rotary_dim;
    ly[l].attn = r->attn;
    ly[l].rope_id = l;
    for (int32_t m = 0; m < l; m++)
      if (same_rope(r, &s->rope[m])) {
        ly[l].rope_id = m;
        break;
      }
    if (r->style == KVI_ROPE_NONE) continue;
    if (r->table) {
      int32_t m = 0;
      while (m < l && s->rope[m].table != r->table) m++;
      if (m < l) {
        ly[l].table = ly[m].table;
      } else {
        size_t n = (size_t)r->table->positions * (size_t)r->rotary_dim;
        memcpy(host + o_t + to * sizeof(float), r->table->data, n * sizeof(float));
        ly[l].table = (const float *)(dev + o_t + to * sizeof(float));
        to += n;
      }
    } else {
      memcpy(host + o_f + fo * sizeof(float), r->inv_freq, (size_t)(r->rotary_dim / 2) * sizeof(float));
      ly[l].inv_freq = (const float *)(dev + o_f + fo * sizeof(float));
      fo += (size_t)(r->rotary_dim / 2);
    }
  }
  return total;
}

/* Uploads per-layer tables: cache bases, scales, RoPE frequencies and tables. */
static kvi_status upload_tables(xfer *x, const char *fn) {
  size_t o_k, o_v;
  const size_t total = kvi__layer_tables(x->store, &x->cache, NULL, NULL, &o_k, &o_v);
  char *host = malloc(total);
  if (!host) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes of layer tables", total);
  kvi_status st = kvi__cuda_malloc((void **)&x->dev_tables, total, fn);
  if (st) {
    free(host);
    return st;
  }
  kvi__layer_tables(x->store, &x->cache, host, x->dev_tables, &o_k, &o_v);
  st = kvi__cuda_h2d(x->dev_tables, host, total, NULL, fn);
  if (st == KVI_OK) st = kvi__cuda_sync(NULL, fn);
  free(host);
  x->d_layers = (kvi__xlayer *)x->dev_tables;
  x->d_kscale = (float *)(x->dev_tables + o_k);
  x->d_vscale = (float *)(x->dev_tables + o_v);
  return st;
}

/* Whether a plane's block, token and head strides are multiples of `al`
 * bytes and its dim stride is 1 (the vector paths read contiguous head
 * vectors). */
static bool plane_aligned(const kvi__strides *p, int64_t es, int64_t al) {
  return p->dim == 1 && (p->block * es) % al == 0 && (p->token * es) % al == 0 && (p->head * es) % al == 0;
}

/* The vector path needs D % 8 == 0, rotated widths in multiples of 16,
 * contiguous head vectors, and every cache row start aligned to min(16, 8 *
 * element size) bytes. */
static bool vector_ok(const xfer *x) {
  const kvi__cache *c = &x->cache;
  if (c->D % 8) return false;
  for (int32_t l = 0; l < c->L; l++) {
    const kvi__rope *r = &x->store->rope[l];
    if (r->style != KVI_ROPE_NONE && r->rotary_dim % 16) return false;
  }
  const size_t es = kvi__dtype_size(c->dtype), al = 8 * es < 16 ? 8 * es : 16;
  if (!plane_aligned(&c->ks, (int64_t)es, (int64_t)al) || !plane_aligned(&c->vs, (int64_t)es, (int64_t)al)) return false;
  for (int32_t l = 0; l < c->L; l++)
    if ((uintptr_t)c->k[l] % al || (uintptr_t)c->v[l] % al) return false;
  return true;
}

/* Whether V's block, token or head stride differs from K's (the kernel then
 * keeps V's per-token offsets too). */
bool kvi__xfer_split_v(const xfer *x) {
  const kvi__strides *k = &x->cache.ks, *v = &x->cache.vs;
  return k->block != v->block || k->token != v->token || k->head != v->head;
}

/* The kernel variant's vector width (kvi__xfer_args.vec). */
int32_t kvi__xfer_vec(const xfer *x) { return x->vec_ok ? 8 : 1; }

static kvi_status xfer_create(xfer *x, kvi_store *store, const kvi_cache_layout *layout,
                              const kvi_transfer_options *opts, const char *fn) {
  memset(x, 0, sizeof *x);
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_transfer_options o = KVI_TRANSFER_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__TRANSFER_OPTIONS_V1, fn, "opts"))) return st;
  if (o.max_tokens_per_call < 1 || o.max_requests_per_call < 1 || o.max_table_entries_per_call < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts limits must be >= 1 (tokens %d, requests %d, table entries %d)",
                     (int)o.max_tokens_per_call, (int)o.max_requests_per_call, (int)o.max_table_entries_per_call);
  x->store = store;
  x->lim = o;
  x->cuda = store->backend == KVI_BACKEND_CUDA;
  if ((st = kvi__cache_resolve(&x->cache, layout, &store->geom, x->cuda, store->device, fn))) return st;
  x->max_pos = INT32_MAX;
  for (int32_t l = 0; l < store->geom.num_layers; l++)
    if (store->rope[l].style != KVI_ROPE_NONE && kvi__rope_max_positions(&store->rope[l]) < x->max_pos)
      x->max_pos = kvi__rope_max_positions(&store->rope[l]);
  x->vec_ok = vector_ok(x);
  x->half_max = 0;
  for (int32_t l = 0; l < store->geom.num_layers; l++)
    if (store->rope[l].style != KVI_ROPE_NONE && store->rope[l].rotary_dim / 2 > x->half_max)
      x->half_max = store->rope[l].rotary_dim / 2;
  /* segments of a power of two tokens, at most 64, whose cos/sin and slot
   * offsets fit in 24 KiB of shared memory (eight CTAs per SM) */
  x->seg_tokens = 64;
  while (x->seg_tokens > 1 && KVI__XFER_SMEM(x->seg_tokens, x->half_max, kvi__xfer_split_v(x)) > 24576)
    x->seg_tokens /= 2;
  if (x->seg_tokens > store->P) x->seg_tokens = store->P;
  if (pthread_mutex_init(&x->lock, NULL) != 0) {
    kvi__cache_release(&x->cache);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "initializing a lock");
  }
  if (!x->cuda) return KVI_OK;
  x->slot_bytes = slot_size(&o);
  st = kvi__cuda_sm_count(store->device, &x->sms, fn);
  int major = 0;
  if (st == KVI_OK) st = kvi__cuda_cc_major(store->device, &major, fn);
  x->pdl = major >= 9;
  if (st == KVI_OK) st = upload_tables(x, fn);
  if (st == KVI_OK) st = kvi__ring_init(&x->ring, KVI__XFER_SLOTS, x->slot_bytes, KVI__RING_DEVICE, fn);
  for (int i = 0; i < KVI__XFER_SLOTS && st == KVI_OK; i++) st = kvi__cuda_event_create(&x->up[i], fn);
  if (st == KVI_OK) st = kvi__cuda_stream_create(&x->up_stream, fn);
  if (st == KVI_OK) st = kvi__cuda_event_create(&x->emb_read, fn);
  if (st == KVI_OK) st = kvi__async_count_init(&x->skipped, fn);
  if (st == KVI_OK) return KVI_OK;
  xfer_release(x, true);
  return st;
}

kvi_status kvi__injector_create(kvi_injector **out, kvi_store *store, const kvi_cache_layout *layout,
                                const kvi_transfer_options *opts, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  kvi_injector *inj = calloc(1, sizeof *inj);
  if (!inj) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the injector");
  kvi_status st = xfer_create(&inj->x, store, layout, opts, fn);
  if (st) {
    free(inj);
    return st;
  }
  *out = inj;
  return KVI_OK;
}

void kvi__injector_destroy(kvi_injector *injector, bool device_ok) {
  if (!injector) return;
  xfer_release(&injector->x, device_ok);
  free(injector);
}

kvi_status kvi__encoder_create(kvi_encoder **out, kvi_store *store, const kvi_cache_layout *layout,
                               const kvi_transfer_options *opts, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  kvi_encoder *enc = calloc(1, sizeof *enc);
  if (!enc) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the encoder");
  kvi_status st = xfer_create(&enc->x, store, layout, opts, fn);
  if (st) {
    free(enc);
    return st;
  }
  *out = enc;
  return KVI_OK;
}

void kvi__encoder_destroy(kvi_encoder *encoder, bool device_ok) {
  if (!encoder) return;
  xfer_release(&encoder->x, device_ok);
  free(encoder);
}

/* Every layer's RoPE must have been set (a spec, or KVI_ROPE_NONE): a layer
 * left as the model was created would inject or capture keys unrotated. */
kvi_status kvi__check_rope_set(const xfer *x, const char *fn) {
  for (int32_t l = 0; l < x->store->geom.num_layers; l++)
    if (x->store->rope[l].unset)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "layer %d's RoPE was never set: give it a spec, or KVI_ROPE_NONE for a layer without rotary "
                       "embedding, with kvi_model_set_rope before creating the store",
                       (int)l);
  return KVI_OK;
}

void kvi__lock_both(xfer *x) {
  pthread_mutex_lock(&x->lock);
  kvi__store_lock(x->store);
}

void kvi__unlock_both(xfer *x) {
  kvi__store_unlock(x->store);
  pthread_mutex_unlock(&x->lock);
}

/* ---- what lib/api and tests/internal read of a handle (xfer/xfer.h) ------ */

int32_t kvi__injector_vec(const kvi_injector *injector) { return kvi__xfer_vec(&injector->x); }
int kvi__injector_device(const kvi_injector *injector) { return injector ? kvi__store_device(injector->x.store) : -1; }
int kvi__encoder_device(const kvi_encoder *encoder) { return encoder ? kvi__store_device(encoder->x.store) : -1; }
int32_t kvi__injector_seg_tokens(const kvi_injector *injector) { return injector->x.seg_tokens; }
int32_t kvi__injector_half_max(const kvi_injector *injector) { return injector->x.half_max; }
