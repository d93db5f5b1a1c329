/*
 * Injector and encoder: moving facts between the store's pages and an
 * engine's paged cache, rotating keys at their destination positions
 * (inject) or un-rotating them at their source positions (capture).
 * SPDX-License-Identifier: Apache-2.0
 *
 * A call is planned on the host under the store's lock: every request or
 * capture is validated, facts are looked up, and the work is cut into
 * segments (runs of at most seg_tokens tokens of one page). The CPU backend
 * executes the segments here (the reference); the CUDA backend runs one fused
 * kernel (cuda/transfer_kernels.cu; a capture call, once per CAPTURE_CHUNK
 * captures, every capture checked first) that finds the plan (segments, positions,
 * host block tables) in its parameters when it is small (up to
 * KVI__INLINE_PLAN bytes, the common single-request case: no upload) and
 * otherwise uploads it in one copy from a pinned staging slot.
 */
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "search/search.h"
#include "store/store.h"
#include "xfer/xfer.h"

#define SLOTS 2
/* Captures per kernel launch of a large kvi_encode call; every chunk's plan
 * lies in the call's one staging slot. Chunks of 512 let the device start
 * while the host planned the rest, but on the H200 3,200 captures took
 * longer in 7 launches (6.81 ms) than in one (6.55 ms): the host's planning
 * is no longer the bottleneck, so a call is one launch up to this size. */
#define CAPTURE_CHUNK 65536

/* What an injector and an encoder share. */
typedef struct xfer {
  kvi_store *store;
  kvi__cache cache;
  pthread_mutex_t lock;
  kvi_transfer_options lim;
  bool cuda;
  bool vec_ok;     /* the 8-element vector path is valid for this layout */
  bool vec16_ok;   /* fp8 stores: 16-element vectors (16-byte page loads) are valid too */
  int32_t max_pos; /* positions must be below this for every rotated layer */
  int32_t seg_tokens; /* longest segment: bounds the kernel's shared memory */
  int32_t half_max;   /* largest rotary_dim / 2 over the layers */
  int32_t sms;        /* multiprocessors of the store's device */
  /* CUDA */
  char *dev_tables; /* xlayer[L] | k_scale[L*H] | v_scale[L*H] | inv_freq... | tables... */
  kvi__xlayer *d_layers;
  float *d_kscale, *d_vscale;
  kvi__ring ring; /* SLOTS staging slots (pinned host and device buffers), each guarded by the last launch that read it */
  struct CUevent_st *up[SLOTS]; /* slot i's: recorded after its device buffer's upload (on up_stream) */
  struct CUstream_st *up_stream; /* plan uploads (see upload()) */
  size_t slot_bytes;
  kvi__async_count skipped; /* tokens and ids the kernels skipped */
  struct CUevent_st *emb_read; /* recorded after a device-planned batch's reads of the store's rows */
  uint64_t small[KVI__INLINE_PLAN / 8]; /* host buffer of plans that travel in the kernel parameters */
} xfer;

struct kvi_injector {
  xfer x;
};
struct kvi_encoder {
  xfer x;
};

/* ------------------------------------------------------------------------ */
/* creation                                                                  */
/* ------------------------------------------------------------------------ */

static size_t align_up(size_t n) { return (n + 15) & ~(size_t)15; }

/* Byte layout of one staging slot for the limits, plus the alignment padding
 * of a capture call's chunk plans (at most 4 x 15 bytes and a 16-byte start
 * per chunk). */
static size_t slot_size(const kvi_transfer_options *o) {
  return align_up((size_t)o->max_tokens_per_call * sizeof(kvi__xseg)) +
         align_up((size_t)o->max_requests_per_call * sizeof(kvi__xreq)) +
         align_up((size_t)o->max_tokens_per_call * sizeof(int32_t)) +
         align_up((size_t)o->max_table_entries_per_call * sizeof(int32_t)) +
         ((size_t)o->max_requests_per_call / CAPTURE_CHUNK + 1) * 80;
}

/* device_ok: the store's device is current (else its memory is left). */
static void xfer_release(xfer *x, bool device_ok) {
  if (x->cuda && device_ok) {
    if (x->up_stream) kvi__cuda_sync(x->up_stream, "kvi_injector_destroy"); /* uploads of failed launches */
    kvi__ring_destroy(&x->ring, "kvi_injector_destroy");
    for (int i = 0; i < SLOTS; i++) kvi__cuda_event_destroy(x->up[i]);
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
  *o_k = align_up((size_t)L * sizeof(kvi__xlayer));
  *o_v = *o_k + align_up((size_t)L * H * sizeof(float));
  const size_t o_f = *o_v + align_up((size_t)L * H * sizeof(float)), o_t = o_f + align_up(nfreq * sizeof(float)),
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

/* fp8 stores read 16 e4m3 bytes (16 elements) per load: D % 16 == 0, rotated
 * widths in multiples of 32, and every cache row start 16-byte aligned
 * (16 cache elements are at least 16 bytes). */
static bool vector16_ok(const xfer *x) {
  const kvi__cache *c = &x->cache;
  if (!x->store->fp8 || !x->vec_ok || c->D % 16) return false;
  for (int32_t l = 0; l < c->L; l++) {
    const kvi__rope *r = &x->store->rope[l];
    if (r->style != KVI_ROPE_NONE && r->rotary_dim % 32) return false;
  }
  const int64_t es = (int64_t)kvi__dtype_size(c->dtype);
  if (!plane_aligned(&c->ks, es, 16) || !plane_aligned(&c->vs, es, 16)) return false;
  for (int32_t l = 0; l < c->L; l++)
    if ((uintptr_t)c->k[l] % 16 || (uintptr_t)c->v[l] % 16) return false;
  return true;
}

/* Whether V's block, token or head stride differs from K's (the kernel then
 * keeps V's per-token offsets too). */
static bool xfer_split_v(const xfer *x) {
  const kvi__strides *k = &x->cache.ks, *v = &x->cache.vs;
  return k->block != v->block || k->token != v->token || k->head != v->head;
}

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
  x->vec16_ok = vector16_ok(x);
  x->half_max = 0;
  for (int32_t l = 0; l < store->geom.num_layers; l++)
    if (store->rope[l].style != KVI_ROPE_NONE && store->rope[l].rotary_dim / 2 > x->half_max)
      x->half_max = store->rope[l].rotary_dim / 2;
  /* segments of a power of two tokens, at most 64, whose cos/sin and slot
   * offsets fit in 24 KiB of shared memory (eight CTAs per SM) */
  x->seg_tokens = 64;
  while (x->seg_tokens > 1 && KVI__XFER_SMEM(x->seg_tokens, x->half_max, xfer_split_v(x)) > 24576) x->seg_tokens /= 2;
  if (x->seg_tokens > store->P) x->seg_tokens = store->P;
  if (pthread_mutex_init(&x->lock, NULL) != 0) {
    kvi__cache_release(&x->cache);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "initializing a lock");
  }
  if (!x->cuda) return KVI_OK;
  x->slot_bytes = slot_size(&o);
  st = kvi__cuda_sm_count(store->device, &x->sms, fn);
  if (st == KVI_OK) st = upload_tables(x, fn);
  if (st == KVI_OK) st = kvi__ring_init(&x->ring, SLOTS, x->slot_bytes, KVI__RING_DEVICE, fn);
  for (int i = 0; i < SLOTS && st == KVI_OK; i++) st = kvi__cuda_event_create(&x->up[i], fn);
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

/* ------------------------------------------------------------------------ */
/* planning                                                                  */
/* ------------------------------------------------------------------------ */

/* A request or capture, normalized. */
typedef struct job {
  const int32_t *table; /* host or device */
  int32_t table_len;
  bool table_on_host;
  int64_t first_slot;
  int64_t tokens;
  const void *positions; /* host or NULL: int32, or int64 with pos64 */
  bool pos64;
  bool kind_checked; /* the table's memory kind was checked for the whole call */
  int64_t start_position;
} job;

/* Position t of a job's explicit positions. */
static inline int64_t job_pos(const job *j, int64_t t) {
  return j->pos64 ? ((const int64_t *)j->positions)[t] : ((const int32_t *)j->positions)[t];
}

/* The plan of one call (or of one chunk of a call's captures): host arrays,
 * laid out as they are uploaded. */
typedef struct plan {
  kvi__xseg *segs;
  kvi__xreq *reqs;
  int32_t *positions;
  int32_t *tables; /* host block-table slices */
  int32_t nsegs, nreqs, ntok, ntables;
  char *buf;  /* holds all of it: malloc'd (CPU), x->small (inline) or a staging slot's pinned buffer */
  kvi__ring_slot *sl; /* the staging slot, or NULL */
  size_t off; /* where buf lies in the slot (a chunk's plan shares the call's slot) */
  size_t o_reqs, o_pos, o_tab, o_ext, bytes; /* o_ext: the caller's own area, after the tables */
  bool uploaded; /* the caller copied it to the slot's device buffer already */
} plan;

/* Segments a fact of `npages` pages can need, at most. */
static int64_t segs_for(const xfer *x, int64_t npages) {
  return npages * ((x->store->P + x->seg_tokens - 1) / x->seg_tokens);
}

/* Checks a job's sequence range, block ids and positions. */
static kvi_status check_job(const xfer *x, const job *j, int32_t index, const char *what, const char *fn) {
  const kvi__cache *c = &x->cache;
  if (j->tokens == 0) return KVI_OK;
  if (j->first_slot < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: first_slot is %lld", what, (int)index, (long long)j->first_slot);
  if (!j->table) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: block_table is NULL", what, (int)index);
  if (j->table_len < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: block_table_len is %d", what, (int)index, (int)j->table_len);
  if (j->tokens > INT64_MAX - j->first_slot) /* first_slot + tokens would wrap */
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: first_slot %lld + %lld tokens passes the largest sequence index",
                     what, (int)index, (long long)j->first_slot, (long long)j->tokens);
  const int64_t last = j->first_slot + j->tokens - 1;
  if (last / c->BS >= j->table_len)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "%s %d: sequence slots %lld..%lld need %lld blocks of %d, the block table has %d", what, (int)index,
                     (long long)j->first_slot, (long long)last, (long long)(last / c->BS + 1), (int)c->BS,
                     (int)j->table_len);
  if (j->table_on_host)
    for (int64_t b = j->first_slot / c->BS; b <= last / c->BS; b++)
      if (j->table[b] < 0 || j->table[b] >= c->NB)
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: block_table[%lld] is %d, the cache has blocks 0..%lld",
                         what, (int)index, (long long)b, (int)j->table[b], (long long)c->NB - 1);
  if (j->positions) {
    for (int64_t t = 0; t < j->tokens; t++)
      if (job_pos(j, t) < 0 || job_pos(j, t) >= x->max_pos)
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: positions[%lld] is %lld, expected 0..%d", what, (int)index,
                         (long long)t, (long long)job_pos(j, t), (int)x->max_pos - 1);
  } else if (j->start_position < 0 || j->start_position > x->max_pos - j->tokens) {
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s %d: positions %lld..%lld are outside 0..%d", what, (int)index,
                     (long long)j->start_position, (long long)j->start_position + j->tokens - 1, (int)x->max_pos - 1);
  }
  return KVI_OK;
}


/* KVI_ERR_CAPACITY when a call is larger than the transfer options allow
 * (counted for the whole call, however it is launched). */
static kvi_status check_limits(const xfer *x, int32_t nreqs, int64_t ntok, int64_t ntables, const char *fn) {
  if (ntok > x->lim.max_tokens_per_call || nreqs > x->lim.max_requests_per_call ||
      ntables > x->lim.max_table_entries_per_call)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "the call moves %lld tokens for %d requests with %lld host block-table entries; the transfer "
                     "options allow %d, %d and %d",
                     (long long)ntok, (int)nreqs, (long long)ntables, (int)x->lim.max_tokens_per_call,
                     (int)x->lim.max_requests_per_call, (int)x->lim.max_table_entries_per_call);
  return KVI_OK;
}

/* Sets a plan's offsets and size (bytes) for the given counts; no buffer yet. */
static void plan_layout(plan *p, int64_t nsegs, int32_t nreqs, int64_t ntok, int64_t npos, int64_t ntables) {
  memset(p, 0, sizeof *p);
  if (nsegs > ntok) nsegs = ntok; /* every segment has a token */
  p->o_reqs = align_up((size_t)nsegs * sizeof(kvi__xseg));
  p->o_pos = p->o_reqs + align_up((size_t)nreqs * sizeof(kvi__xreq));
  p->o_tab = p->o_pos + align_up((size_t)npos * sizeof(int32_t));
  p->bytes = p->o_tab + (size_t)ntables * sizeof(int32_t);
}

/* Points a laid-out plan's arrays into buf. */
static void plan_place(plan *p, char *buf) {
  p->buf = buf;
  p->segs = (kvi__xseg *)p->buf;
  p->reqs = (kvi__xreq *)(p->buf + p->o_reqs);
  p->positions = (int32_t *)(p->buf + p->o_pos);
  p->tables = (int32_t *)(p->buf + p->o_tab);
}

/* Finds a laid-out plan of `bytes` bytes a buffer: on the host for the CPU,
 * in the kernel parameters when small (`inline_ok`), else in a staging slot. */
static kvi_status plan_buffer(plan *p, xfer *x, size_t bytes, bool inline_ok, const char *fn) {
  if (!x->cuda) {
    char *buf = malloc(bytes ? bytes : 1);
    if (!buf) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %zu-byte plan", bytes);
    plan_place(p, buf);
  } else if (inline_ok && bytes <= KVI__INLINE_PLAN) {
    plan_place(p, (char *)x->small);
  } else {
    kvi_status st = kvi__ring_acquire(&x->ring, bytes, NULL, &p->sl, fn); /* x->lock: one call at a time */
    if (st) return st;
    plan_place(p, p->sl->host);
  }
  return KVI_OK;
}

/* Sizes the plan, with `ext` bytes of the caller's own at o_ext, and finds
 * it a buffer (plan_buffer). */
static kvi_status plan_alloc(plan *p, xfer *x, int64_t nsegs, int32_t nreqs, int64_t ntok, int64_t npos,
                             int64_t ntables, size_t ext, const char *fn) {
  kvi_status st = check_limits(x, nreqs, ntok, ntables, fn);
  if (st) {
    memset(p, 0, sizeof *p);
    return st;
  }
  plan_layout(p, nsegs, nreqs, ntok, npos, ntables);
  if (ext) { /* the caller's area, after the tables: the plan cannot travel inline */
    p->o_ext = align_up(p->bytes);
    p->bytes = p->o_ext + ext;
    if (x->cuda && p->bytes > x->slot_bytes) /* the limits size the slots; an area on top may not fit */
      return kvi__fail(KVI_ERR_CAPACITY, fn, "the call's plan needs %zu bytes; the transfer options' limits allow %zu",
                       p->bytes, x->slot_bytes);
  }
  return plan_buffer(p, x, p->bytes, !ext, fn);
}

static void plan_free(const xfer *x, plan *p) {
  if (!x->cuda) free(p->buf);
}

/* Adds a job's request entry: host block tables are copied into the plan
 * (the slice the job touches, found by its offset wherever the plan lives),
 * device tables referenced. Returns the request index. */
static int32_t plan_request(plan *p, const xfer *x, const job *j) {
  const int32_t BS = x->cache.BS;
  const int32_t r = p->nreqs++;
  kvi__xreq *rq = &p->reqs[r];
  if (j->tokens > 0 && j->table_on_host) {
    const int64_t b0 = j->first_slot / BS, b1 = (j->first_slot + j->tokens - 1) / BS;
    memcpy(&p->tables[p->ntables], j->table + b0, (size_t)(b1 - b0 + 1) * sizeof(int32_t));
    rq->table = NULL;
    rq->table_off = (int64_t)(p->o_tab + (size_t)p->ntables * sizeof(int32_t));
    rq->first_block = (int32_t)b0;
    rq->table_len = (int32_t)(b1 - b0 + 1);
    p->ntables += (int32_t)(b1 - b0 + 1);
  } else {
    rq->table = j->table;
    rq->table_off = 0;
    rq->first_block = 0;
    rq->table_len = j->table_len;
  }
  return r;
}

/* Adds `tokens` tokens held in `pages` (from the first page's start) landing
 * at sequence indices seq0.. of request r, with their positions, in
 * segments that neither cross a page nor exceed seg_tokens. */
static void plan_run(plan *p, const xfer *x, int32_t r, int64_t seq0, int64_t tokens, const void *positions, bool pos64,
                     int32_t start_position, const uint32_t *pages) {
  const int32_t P = x->store->P, pos0 = positions ? p->ntok : start_position;
  if (positions && pos64) /* checked below max_pos: they fit */
    for (int64_t t = 0; t < tokens; t++) p->positions[p->ntok++] = (int32_t)((const int64_t *)positions)[t];
  else if (positions) /* consecutive positions need no array */
    for (int64_t t = 0; t < tokens; t++) p->positions[p->ntok++] = ((const int32_t *)positions)[t];
  for (int64_t t = 0; t < tokens;) {
    const int32_t in_page = (int32_t)(t % P);
    int64_t n = tokens - t;
    if (n > P - in_page) n = P - in_page;
    if (n > x->seg_tokens) n = x->seg_tokens;
    kvi__xseg *sg = &p->segs[p->nsegs++];
    sg->seq0 = seq0 + t;
    sg->page = pages[t / P];
    sg->req = r;
    sg->pos0 = pos0 + (int32_t)t;
    sg->explicit_pos = positions != NULL;
    sg->tok0 = (uint16_t)in_page;
    sg->ntok = (uint16_t)n;
    t += n;
  }
}

/* tests/internal's view of plans (xfer/xfer.h): a plan over the
 * view's arrays, and back. */
static plan plan_of_view(const kvi__plan_view *v) {
  plan p;
  memset(&p, 0, sizeof p);
  p.segs = v->segs;
  p.reqs = v->reqs;
  p.positions = v->positions;
  p.tables = v->tables;
  p.buf = (char *)v->buf;
  p.o_tab = v->tables && v->buf ? (size_t)((const char *)v->tables - v->buf) : 0;
  p.nsegs = v->nsegs, p.nreqs = v->nreqs, p.ntok = v->ntok, p.ntables = v->ntables;
  return p;
}

static void view_of_plan(kvi__plan_view *v, const plan *p) {
  v->segs = p->segs;
  v->reqs = p->reqs;
  v->positions = p->positions;
  v->tables = p->tables;
  v->buf = p->buf;
  v->ext = p->buf && p->o_ext ? p->buf + p->o_ext : NULL;
  v->nsegs = p->nsegs, v->nreqs = p->nreqs, v->ntok = p->ntok, v->ntables = p->ntables;
}

int32_t kvi__plan_request_into(const kvi_injector *injector, kvi__plan_view *v, const int32_t *table,
                               int32_t table_len, bool table_on_host, int64_t first_slot, int64_t tokens) {
  plan p = plan_of_view(v);
  job j;
  memset(&j, 0, sizeof j);
  j.table = table;
  j.table_len = table_len;
  j.table_on_host = table_on_host;
  j.first_slot = first_slot;
  j.tokens = tokens;
  const int32_t r = plan_request(&p, &injector->x, &j);
  view_of_plan(v, &p);
  return r;
}

void kvi__plan_run_into(const kvi_injector *injector, kvi__plan_view *v, int32_t r, int64_t seq0, int64_t tokens,
                        const void *positions, bool pos64, int32_t start_position, const uint32_t *pages) {
  plan p = plan_of_view(v);
  plan_run(&p, &injector->x, r, seq0, tokens, positions, pos64, start_position, pages);
  view_of_plan(v, &p);
}

int64_t kvi__plan_segs_for(const kvi_injector *injector, int64_t npages) { return segs_for(&injector->x, npages); }

/* ------------------------------------------------------------------------ */
/* execution                                                                 */
/* ------------------------------------------------------------------------ */

/* n elements of a row whose elements lie `stride` elements apart, as fp32
 * (fp8: times scale). */
static void load_row(float *dst, const char *src, kvi_dtype t, int32_t n, int64_t stride, float scale) {
  char g[1024 * 4];
  const size_t es = kvi__dtype_size(t);
  if (stride != 1) { /* gathered into a contiguous row first */
    for (int32_t i = 0; i < n; i++) memcpy(g + (size_t)i * es, src + (size_t)(i * stride) * es, es);
    src = g;
  }
  if (t == KVI_DTYPE_FP8_E4M3 || t == KVI_DTYPE_FP8_E5M2) {
    for (int32_t i = 0; i < n; i++) dst[i] = kvi__fp8_to_f32((uint8_t)src[i], t) * scale;
  } else {
    kvi__convert(dst, KVI_DTYPE_FP32, src, t, n);
  }
}

static void store_row(char *dst, kvi_dtype t, int64_t stride, float *src, int32_t n, float scale) {
  char g[1024 * 4];
  char *out = stride == 1 ? dst : g; /* scattered from a contiguous row after */
  if (t == KVI_DTYPE_FP8_E4M3 || t == KVI_DTYPE_FP8_E5M2) {
    for (int32_t i = 0; i < n; i++) ((uint8_t *)out)[i] = kvi__f32_to_fp8(src[i] / scale, t);
  } else {
    kvi__convert(out, t, src, KVI_DTYPE_FP32, n);
  }
  const size_t es = kvi__dtype_size(t);
  if (stride != 1)
    for (int32_t i = 0; i < n; i++) memcpy(dst + (size_t)(i * stride) * es, g + (size_t)i * es, es);
}

/* n elements of es bytes each, `ds` / `ss` elements apart, copied as they are. */
static void copy_row(char *dst, int64_t ds, const char *src, int64_t ss, int32_t n, size_t es) {
  if (ds == 1 && ss == 1) {
    memcpy(dst, src, (size_t)n * es);
    return;
  }
  for (int32_t i = 0; i < n; i++) memcpy(dst + (size_t)(i * ds) * es, src + (size_t)(i * ss) * es, es);
}

/* The CPU reference of the fused kernel, one phase of it (kernels.h,
 * kvi__xfer_args.phase): a capture into an fp8 store runs phases 0 (zero
 * each page's amax slots), 1 (fold the un-rotated values' largest finite
 * magnitude into them), 2 (write e4m3(x / scale), the scale derived from the
 * slot) and 3 (turn the slots into scales), as the kernel does; everything
 * else is phase 2 alone. */
static void cpu_transfer(const xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, int phase) {
  const kvi_store *s = x->store;
  const kvi__cache *c = &x->cache;
  const int32_t H = c->H, D = c->D, P = s->P;
  const size_t pe = kvi__dtype_size(s->dtype), ce = kvi__dtype_size(c->dtype);
  /* equal dtypes without scales (neither is fp8): what is not rotated moves
   * bit for bit (as in the kernel), only the rotated columns are converted */
  const bool raw = s->dtype == c->dtype && !s->fp8;
  float row[1024];
  for (int32_t i = 0; i < p->nsegs; i++) {
    const kvi__xseg *sg = &p->segs[i];
    const kvi__xreq *rq = &p->reqs[sg->req];
    const int32_t *table = rq->table ? rq->table : (const int32_t *)(p->buf + rq->table_off);
    const char *page = page_addr(s, sg->page);
    float *slots = s->fp8 ? page_scales(s, sg->page) : NULL;
    if (phase == 0 || phase == 3) { /* once per page: its first segment starts at token 0 */
      if (sg->tok0 == 0)
        for (int32_t g = lb * 2 * H; g < le * 2 * H; g++) slots[g] = phase == 0 ? 0.0f : kvi__fp8_scale(slots[g]);
      continue;
    }
    for (int32_t l = lb; l < le; l++)
      for (int32_t j = 0; j < sg->ntok; j++) {
        const int64_t seq = sg->seq0 + j;
        const int32_t block = table[seq / c->BS - rq->first_block];
        const int64_t t = seq % c->BS;
        const int32_t pos = sg->explicit_pos ? p->positions[sg->pos0 + j] : sg->pos0 + j;
        for (int kv = 0; kv < 2; kv++)
          for (int32_t h = 0; h < H; h++) {
            const kvi__strides *cs = kv ? &c->vs : &c->ks;
            char *pr = (char *)page + (size_t)((((int64_t)l * 2 + kv) * H + h) * P + sg->tok0 + j) * D * pe;
            char *cr = (kv ? c->v[l] : c->k[l]) + (size_t)(block * cs->block + t * cs->token + h * cs->head) * ce;
            const int64_t cd = cs->dim; /* the cache row's element stride */
            const float scale = (kv ? c->v_scale : c->k_scale)[l * H + h];
            float *slot = slots ? slots + (l * 2 + kv) * H + h : NULL;
            const int32_t rot = kv || s->rope[l].style == KVI_ROPE_NONE ? 0 : s->rope[l].rotary_dim;
            const int32_t n = raw ? rot : D; /* columns converted (rotation touches [0, rot) only) */
            if (inject) {
              load_row(row, pr, s->dtype, n, 1, slot ? *slot : 1.0f);
              if (kv == 0) kvi__rope_rotate(&s->rope[l], row, pos, false);
              store_row(cr, c->dtype, cd, row, n, scale);
              if (raw) copy_row(cr + (size_t)(rot * cd) * ce, cd, pr + (size_t)rot * pe, 1, D - rot, pe);
            } else {
              load_row(row, cr, c->dtype, n, cd, scale);
              if (kv == 0) kvi__rope_rotate(&s->rope[l], row, pos, true);
              if (phase == 1)
                *slot = kvi__fp8_amax(*slot, row, n);
              else
                store_row(pr, s->dtype, 1, row, n, slot ? kvi__fp8_scale(*slot) : 1.0f);
              if (raw) copy_row(pr + (size_t)rot * pe, 1, cr + (size_t)(rot * cd) * ce, cd, D - rot, ce);
            }
          }
      }
  }
}

/* The CPU reference of the deviation kernel (kvi_inject_deviation): per
 * token of the plan, in plan order, the sum over heads of the squared K
 * differences (the cache's against the stored key rotated at the token's
 * position) and V differences at one layer, accumulated in double. */
static void cpu_deviation(const xfer *x, const plan *p, int32_t l, float *out) {
  const kvi_store *s = x->store;
  const kvi__cache *c = &x->cache;
  const int32_t H = c->H, D = c->D, P = s->P;
  const size_t pe = kvi__dtype_size(s->dtype), ce = kvi__dtype_size(c->dtype);
  float row[1024], got[1024];
  int64_t o = 0;
  for (int32_t i = 0; i < p->nsegs; i++) {
    const kvi__xseg *sg = &p->segs[i];
    const kvi__xreq *rq = &p->reqs[sg->req];
    const int32_t *table = rq->table ? rq->table : (const int32_t *)(p->buf + rq->table_off);
    const char *page = page_addr(s, sg->page);
    const float *slots = s->fp8 ? page_scales(s, sg->page) : NULL;
    for (int32_t j = 0; j < sg->ntok; j++) {
      const int64_t seq = sg->seq0 + j;
      const int32_t block = table[seq / c->BS - rq->first_block];
      const int64_t t = seq % c->BS;
      const int32_t pos = sg->explicit_pos ? p->positions[sg->pos0 + j] : sg->pos0 + j;
      double sum = 0.0;
      for (int kv = 0; kv < 2; kv++)
        for (int32_t h = 0; h < H; h++) {
          const kvi__strides *cs = kv ? &c->vs : &c->ks;
          const char *pr = page + (size_t)((((int64_t)l * 2 + kv) * H + h) * P + sg->tok0 + j) * D * pe;
          const char *cr = (kv ? c->v[l] : c->k[l]) + (size_t)(block * cs->block + t * cs->token + h * cs->head) * ce;
          load_row(row, pr, s->dtype, D, 1, slots ? slots[(l * 2 + kv) * H + h] : 1.0f);
          if (kv == 0) kvi__rope_rotate(&s->rope[l], row, pos, false);
          load_row(got, cr, c->dtype, D, cs->dim, (kv ? c->v_scale : c->k_scale)[l * H + h]);
          for (int32_t d = 0; d < D; d++) {
            const double e = (double)got[d] - (double)row[d];
            sum += e * e;
          }
        }
      out[o++] = (float)sum;
    }
  }
}

static kvi_status launch(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                         const char *fn);

/* Runs a plan: here (CPU) or in one kernel launch (CUDA). */
static kvi_status execute(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                          const char *fn) {
  if (!x->cuda) {
    if (!inject && x->store->fp8)
      for (int phase = 0; phase < 4; phase++) cpu_transfer(x, p, lb, le, false, phase);
    else
      cpu_transfer(x, p, lb, le, inject, 2);
    return KVI_OK;
  }
  return launch(x, p, lb, le, inject, stream, fn);
}

/* Layers per CTA: enough (segment, layer) pairs per CTA to amortize its
 * prologue, while leaving about 128 CTAs per SM so the tail stays short. */
int32_t kvi__layers_per_cta(int32_t sms, int32_t nsegs, int32_t nl) {
  const int64_t target = (int64_t)(sms > 0 ? sms : 132) * 128;
  int64_t per = (int64_t)nsegs * nl / target;
  if (per < 1) per = 1;
  if (per > nl) per = nl;
  const int64_t chunks = (nl + per - 1) / per;
  return (int32_t)((nl + chunks - 1) / chunks);
}

/* Uploads a plan from its slot on the injector's own stream and orders
 * `stream` after the copy: the upload then overlaps whatever `stream` still
 * runs before the call (an engine's previous step) instead of queueing
 * behind it. The slot's device buffer is free: acquiring the slot waited
 * for the last launch that read it. */
static kvi_status upload(xfer *x, const plan *p, struct CUstream_st *stream, const char *fn) {
  struct CUevent_st *up = x->up[p->sl - x->ring.slot];
  kvi_status st = kvi__cuda_h2d(p->sl->dev + p->off, p->buf, p->bytes, x->up_stream, fn);
  if (st == KVI_OK) st = kvi__cuda_event_record(up, x->up_stream, fn);
  if (st == KVI_OK) st = kvi__cuda_stream_wait(stream, up, fn);
  return st;
}

/* The kernel variant's vector width (kvi__xfer_args.vec). */
static int32_t xfer_vec(const xfer *x) { return x->vec16_ok ? 16 : x->vec_ok ? 8 : 1; }

/* The kernel arguments of a plan, its plan uploaded (or inlined) first. */
static kvi_status xfer_args(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, kvi__xfer_args *out,
                            struct CUstream_st *stream, const char *fn) {
  const kvi_store *s = x->store;
  kvi_status st;
  kvi__xfer_args *a = out;
  memset(a, 0, offsetof(kvi__xfer_args, inline_plan));
  if (p->sl) {
    if (!p->uploaded && (st = upload(x, p, stream, fn))) return st;
    a->plan_dev = p->sl->dev + p->off;
  } else {
    memcpy(a->inline_plan, p->buf, p->bytes);
    a->inline_bytes = (int32_t)(p->bytes ? p->bytes : 1);
  }
  a->pool = s->pool.dev.base;
  a->host_pool = s->pool.host_dev; /* KVI_HOST_PAGES_READ_MAPPED: host-tier pages read in place */
  a->host_first = s->pool.dev.npages;
  a->page_elems = page_stride_elems(s);
  a->scale_off = (int64_t)s->scale_off;
  a->page_dtype = (int32_t)s->dtype;
  a->P = s->P;
  a->L = x->cache.L;
  a->H = x->cache.H;
  a->D = x->cache.D;
  a->cache_dtype = (int32_t)x->cache.dtype;
  a->BS = x->cache.BS;
  a->NB = x->cache.NB;
  a->block_stride = x->cache.ks.block;
  a->token_stride = x->cache.ks.token;
  a->head_stride = x->cache.ks.head;
  a->dim_stride = x->cache.ks.dim;
  a->v_block_stride = x->cache.vs.block;
  a->v_token_stride = x->cache.vs.token;
  a->v_head_stride = x->cache.vs.head;
  a->v_dim_stride = x->cache.vs.dim;
  a->split_v = xfer_split_v(x);
  a->layers = x->d_layers;
  a->k_scale = x->d_kscale;
  a->v_scale = x->d_vscale;
  a->o_reqs = (int64_t)p->o_reqs;
  a->o_pos = (int64_t)p->o_pos;
  a->nsegs = p->nsegs;
  a->layer_begin = lb;
  a->layer_end = le;
  a->layers_per_cta = kvi__layers_per_cta(x->sms, p->nsegs, le - lb);
  a->seg_tokens = x->seg_tokens;
  a->half_max = x->half_max;
  a->inject = inject;
  a->vec = xfer_vec(x);
  a->skipped = x->skipped.dev;
  return KVI_OK;
}

/* The staging slot's bookkeeping after a launch that reads it, and the
 * store's in-flight tracking. */
static kvi_status launched(xfer *x, const plan *p, struct CUstream_st *stream, const char *fn) {
  kvi_status st;
  if (p->sl && (st = kvi__ring_record(p->sl, stream, fn))) return st;
  return kvi__store_track(x->store, stream, fn);
}

static kvi_status launch(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                         const char *fn) {
  kvi__xfer_args a;
  kvi_status st = xfer_args(x, p, lb, le, inject, &a, stream, fn);
  if (st) return st;
#ifdef KVI_HAVE_CUDA
  const bool phased = !inject && x->store->fp8;
  /* a capture into an fp8 store is four launches (kernels.h: phase), the rest one */
  for (int phase = phased ? 0 : 2; phase <= (phased ? 3 : 2); phase++) {
    a.phase = phase;
    /* the launcher returns (and so clears) the launch error: report that value */
    const int launch_err = kvi__cuda_transfer(&a, stream);
    if (launch_err) return kvi__cuda_error(launch_err, fn, inject ? "injection kernel launch" : "capture kernel launch");
  }
#endif
  return launched(x, p, stream, fn);
}

/* What kvi_inject_deviation asks of an injection's plan: scores at `layer`
 * into `out` (host or device memory), nothing written to the cache. */
typedef struct deviation {
  int32_t layer;
  float *out;
  int64_t num_scores; /* entries out holds */
  bool out_on_device;
} deviation;

/* The plan's caller area for a deviation on a CUDA store: each segment's
 * first score index (int64), then, for host output, room for the scores. */
static size_t deviation_ext(const xfer *x, const deviation *dv, int64_t nsegs, int64_t ntok) {
  if (!dv || !x->cuda) return 0;
  return align_up((size_t)nsegs * sizeof(int64_t)) + (dv->out_on_device ? 0 : (size_t)ntok * sizeof(float));
}

/* Scores a plan (kvi_inject_deviation): here (CPU) or in one kernel launch
 * (CUDA; host output copied back after it, the stream synchronized). */
static kvi_status run_deviation(xfer *x, plan *p, const deviation *dv, struct CUstream_st *stream, const char *fn) {
  if (!x->cuda) {
    cpu_deviation(x, p, dv->layer, dv->out);
    return KVI_OK;
  }
  int64_t *seg_out = (int64_t *)(p->buf + p->o_ext);
  int64_t o = 0;
  for (int32_t i = 0; i < p->nsegs; i++) {
    seg_out[i] = o;
    o += p->segs[i].ntok;
  }
  const size_t o_scores = p->o_ext + align_up((size_t)p->nsegs * sizeof(int64_t));
  kvi__dev_args a;
  kvi_status st;
  if ((st = xfer_args(x, p, dv->layer, dv->layer + 1, true, &a.x, stream, fn))) goto out;
  a.seg_out = (const int64_t *)(a.x.plan_dev + p->o_ext);
  a.out = dv->out_on_device ? dv->out : (float *)(a.x.plan_dev + o_scores);
#ifdef KVI_HAVE_CUDA
  const int launch_err = kvi__cuda_deviation(&a, stream);
  if (launch_err) {
    st = kvi__cuda_error(launch_err, fn, "deviation kernel launch");
    goto out;
  }
#endif
  if ((st = launched(x, p, stream, fn))) goto out;
  if (!dv->out_on_device && o > 0) { /* through the slot's pinned buffer, so a failure leaves out untouched */
    if ((st = kvi__cuda_d2h(p->buf + o_scores, a.out, (size_t)o * sizeof(float), stream, fn))) goto out;
    if ((st = kvi__cuda_sync(stream, fn))) goto out;
    memcpy(dv->out, p->buf + o_scores, (size_t)o * sizeof(float));
  }
out:
  return st;
}

/* ------------------------------------------------------------------------ */
/* inject                                                                    */
/* ------------------------------------------------------------------------ */

/* Every layer's RoPE must have been set (a spec, or KVI_ROPE_NONE): a layer
 * left as the model was created would inject or capture keys unrotated. */
static kvi_status check_rope_set(const xfer *x, const char *fn) {
  for (int32_t l = 0; l < x->store->geom.num_layers; l++)
    if (x->store->rope[l].unset)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "layer %d's RoPE was never set: give it a spec, or KVI_ROPE_NONE for a layer without rotary "
                       "embedding, with kvi_model_set_rope before creating the store",
                       (int)l);
  return KVI_OK;
}

static void lock_both(xfer *x) {
  pthread_mutex_lock(&x->lock);
  kvi__store_lock(x->store);
}

static void unlock_both(xfer *x) {
  kvi__store_unlock(x->store);
  pthread_mutex_unlock(&x->lock);
}

/* A request's block-table memory kind: host or device, device only on a
 * CUDA store. */
static kvi_status check_table_kind(const xfer *x, kvi_memory memory, int32_t r, const char *fn) {
  if (memory != KVI_MEMORY_HOST && memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: block_table_memory is %d", (int)r, (int)memory);
  if (memory == KVI_MEMORY_DEVICE && !x->cuda)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "request %d: a CPU store reads host block tables only", (int)r);
  return KVI_OK;
}

/* A request's job: a host table is read here, so it must not be device
 * memory (the driver tells, in about a microsecond), nor a device table host
 * memory; then check_job. */
static kvi_status check_request_job(const xfer *x, const job *j, int32_t r, const char *fn) {
  kvi_status st = KVI_OK;
  if (j->tokens > 0 && j->table && x->cuda && !j->kind_checked)
    st = kvi__check_memory(j->table, j->table_on_host ? KVI_MEMORY_HOST : KVI_MEMORY_DEVICE, true, x->store->device, fn,
                           j->table_on_host ? "a host block table" : "a device block table");
  return st ? st : check_job(x, j, r, "request", fn);
}

/* Host block-table entries a job copies into its plan (plan_request). */
static int64_t host_table_entries(const xfer *x, const job *j) {
  if (j->tokens == 0 || !j->table_on_host) return 0;
  return (j->first_slot + j->tokens - 1) / x->cache.BS - j->first_slot / x->cache.BS + 1;
}

/* A request of an injection, as both forms of the call give it (kvi_inject's
 * structs, kvi_inject_batched's arrays): its tenant and facts, and its job
 * (table, first slot, positions; tokens still 0). num_positions: the
 * per-request form's check (0: none). */
typedef struct ireq {
  uint64_t tenant;
  const uint64_t *fact_ids;
  int32_t num_facts;
  int64_t num_positions;
  job j;
} ireq;

/* Looks request r's facts up and sums their tokens and pages (store
 * locked); the job is checked later (check_request_job). */
static kvi_status inject_job(const xfer *x, const ireq *rq, int32_t r, job *j, int64_t *npages, fact **found,
                             const char *fn) {
  *j = rq->j;
  j->tokens = 0;
  *npages = 0;
  if (rq->num_facts < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: num_facts is %d", (int)r, (int)rq->num_facts);
  if (rq->num_facts > 0 && !rq->fact_ids)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: fact_ids is NULL", (int)r);
  kvi__store_find_many(x->store, &rq->tenant, 0, rq->fact_ids, (size_t)rq->num_facts, found);
  for (int32_t f = 0; f < rq->num_facts; f++) {
    const fact *ft = found[f];
    if (!ft)
      return kvi__fail(KVI_ERR_NOT_FOUND, fn, "request %d: no fact %llu for tenant %llu", (int)r,
                       (unsigned long long)rq->fact_ids[f], (unsigned long long)rq->tenant);
    __builtin_prefetch(ft->pages); /* read when the plan is written */
    j->tokens += ft->tokens;
    *npages += ft->npages;
  }
  if (rq->num_positions < 0 || (rq->num_positions > 0 && !rq->j.positions))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: num_positions is %lld with positions %s", (int)r,
                     (long long)rq->num_positions, rq->j.positions ? "given" : "NULL");
  if (rq->num_positions > 0 && rq->num_positions != j->tokens)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "request %d: num_positions is %lld, its facts have %lld tokens (one position per token)", (int)r,
                     (long long)rq->num_positions, (long long)j->tokens);
  return KVI_OK;
}

/* a + b for counts >= 0, saturating: a sum past the transfer limits stays past them */
static int64_t sat_add(int64_t a, int64_t b) { return a > INT64_MAX - b ? INT64_MAX : a + b; }

/* Positions given for the whole call (kvi_inject_batched): one per token,
 * request after request; NULL pointer: none. */
typedef struct flat_pos {
  const void *p;
  bool pos64;
  int64_t n; /* entries to check against the call's tokens; 0: trusted */
} flat_pos;

/* The injection of both forms of the call (rq: the requests, their tables'
 * kinds checked), both locks held: kvi_inject, kvi_inject_batched, and
 * kvi_retrieve_inject's host path, which holds them from its search on; and
 * kvi_inject_deviation (dv not NULL: the plan is scored, nothing written).
 * out_tokens: NULL, or host memory for each request's tokens (written on
 * success). */
static kvi_status inject_locked(xfer *x, const ireq *rq, int32_t num_requests, const flat_pos *fp, int32_t lb,
                                int32_t le, kvi_host_pages host_pages, const deviation *dv, int32_t *out_tokens,
                                struct CUstream_st *stream,
                                const char *fn) {
  int64_t nfacts = 0;
  for (int32_t r = 0; r < num_requests; r++)
    if (rq[r].num_facts > 0) nfacts += rq[r].num_facts;
  job *jobs = malloc((size_t)num_requests * sizeof *jobs);
  int64_t *npages = malloc((size_t)num_requests * sizeof *npages);
  /* the facts each request names, looked up once */
  fact **found = malloc((size_t)(nfacts ? nfacts : 1) * sizeof *found);
  kvi_status st = KVI_OK;
  if (!jobs || !npages || !found) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests of %lld facts", (int)num_requests,
                   (long long)nfacts);
    goto out;
  }
  int64_t ntok = 0, npos = 0, ntables = 0, first = 0, nsegs = 0;
  for (int32_t r = 0; r < num_requests; r++) {
    if ((st = inject_job(x, &rq[r], r, &jobs[r], &npages[r], found + first, fn))) goto out;
    first += rq[r].num_facts;
    ntok = sat_add(ntok, jobs[r].tokens);
  }
  if (fp && fp->p && fp->n > 0 && fp->n != ntok) {
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_positions is %lld, the call's facts have %lld tokens",
                   (long long)fp->n, (long long)ntok);
    goto out;
  }
  int64_t at = 0; /* the call's tokens before request r */
  for (int32_t r = 0; r < num_requests; r++) {
    job *j = &jobs[r];
    if (fp && fp->p) {
      j->positions = (const char *)fp->p + (size_t)at * (fp->pos64 ? 8 : 4);
      j->pos64 = fp->pos64;
    }
    at += j->tokens;
    if ((st = check_request_job(x, j, r, fn))) goto out;
    if (j->positions) npos = sat_add(npos, j->tokens);
    nsegs = sat_add(nsegs, segs_for(x, npages[r]));
    ntables = sat_add(ntables, host_table_entries(x, j));
  }
  if (dv && dv->num_scores < ntok) {
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_scores %s %lld scores, the requests inject %lld tokens",
                   dv->out ? "holds" : "is NULL:", (long long)dv->num_scores, (long long)ntok);
    goto out;
  }
  plan p;
  if ((st = plan_alloc(&p, x, nsegs, num_requests, ntok, npos, ntables, deviation_ext(x, dv, nsegs, ntok), fn)))
    goto out;
  /* a tiered store keeps the call's facts on their tier (promoting, moves
   * those on the host to the device) until the work is enqueued */
  if (x->cuda &&
      (st = kvi__store_lease(x->store, found, (size_t)nfacts, host_pages == KVI_HOST_PAGES_PROMOTE, stream, fn))) {
    plan_free(x, &p);
    goto out;
  }
  first = 0;
  for (int32_t r = 0; r < num_requests; r++) {
    const job *j = &jobs[r];
    const int32_t ri = plan_request(&p, x, j);
    int64_t done = 0; /* facts land back to back */
    for (int32_t f = 0; f < rq[r].num_facts; f++) {
      const fact *ft = found[first++];
      const void *pos = j->positions ? (const char *)j->positions + done * (j->pos64 ? 8 : 4) : NULL;
      plan_run(&p, x, ri, j->first_slot + done, ft->tokens, pos, j->pos64, (int32_t)(j->start_position + done),
               ft->pages);
      done += ft->tokens;
    }
  }
  st = dv ? run_deviation(x, &p, dv, stream, fn) : execute(x, &p, lb, le, true, stream, fn);
  plan_free(x, &p);
  if (x->cuda) kvi__store_unlease(x->store, found, (size_t)nfacts, st == KVI_OK); /* used: the first named the most recent */
  if (st == KVI_OK && out_tokens)
    for (int32_t r = 0; r < num_requests; r++) out_tokens[r] = (int32_t)jobs[r].tokens;
out:
  free(found);
  free(npages);
  free(jobs);
  return st;
}

/* kvi_inject_options read and checked into [*lb, *le) and *hp. */
static kvi_status read_inject_options(const xfer *x, const kvi_inject_options *opts, int32_t *lb, int32_t *le,
                                      kvi_host_pages *hp, const char *fn) {
  kvi_inject_options o = KVI_INJECT_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__INJECT_OPTIONS_V1, fn, "opts"))) return st;
  const int32_t L = x->cache.L;
  *lb = o.layer_begin;
  *le = o.layer_end ? o.layer_end : L;
  *hp = o.host_pages;
  if (*lb < 0 || *le > L || *lb >= *le)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer range [%d, %d) is not within [0, %d)", (int)*lb, (int)*le,
                     (int)L);
  if (o.host_pages != KVI_HOST_PAGES_PROMOTE && o.host_pages != KVI_HOST_PAGES_READ_MAPPED)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "opts->host_pages is %d, expected KVI_HOST_PAGES_PROMOTE (0) or KVI_HOST_PAGES_READ_MAPPED (1)",
                     (int)o.host_pages);
  return check_rope_set(x, fn);
}

/* A kvi_inject_request (full-size copy) as the call's request. */
static kvi_status request_of(const xfer *x, const kvi_inject_request *q, int32_t r, ireq *out, const char *fn) {
  kvi_status st = check_table_kind(x, q->block_table_memory, r, fn);
  if (st) return st;
  memset(out, 0, sizeof *out);
  out->tenant = q->tenant;
  out->fact_ids = q->fact_ids;
  out->num_facts = q->num_facts;
  out->num_positions = q->num_positions;
  out->j.table = q->block_table;
  out->j.table_len = q->block_table_len;
  out->j.table_on_host = q->block_table_memory == KVI_MEMORY_HOST;
  out->j.first_slot = q->first_slot;
  out->j.positions = q->positions;
  out->j.start_position = q->start_position;
  return KVI_OK;
}

/* A call's requests (each read by its struct_size, which all must share)
 * as the call's requests, into *out (malloc'd; num_requests > 0). */
static kvi_status read_requests(const xfer *x, const kvi_inject_request *reqs, int32_t num_requests, ireq **out,
                                const char *fn) {
  size_t rsize;
  memcpy(&rsize, reqs, sizeof rsize);
  ireq *rq = malloc((size_t)num_requests * sizeof *rq);
  if (!rq) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)num_requests);
  kvi_status st = KVI_OK;
  for (int32_t r = 0; r < num_requests && st == KVI_OK; r++) {
    const char *src = (const char *)reqs + (size_t)r * rsize;
    size_t sz;
    memcpy(&sz, src, sizeof sz);
    if (sz != rsize) {
      st = kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "reqs[%d].struct_size is %zu, reqs[0]'s is %zu; they must be equal", (int)r,
                     sz, rsize);
      break;
    }
    kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
    if ((st = kvi__read_struct(&q, sizeof q, src, KVI__INJECT_REQUEST_V1, fn, "reqs[i]")) == KVI_OK)
      st = request_of(x, &q, r, &rq[r], fn);
  }
  if (st) {
    free(rq);
    return st;
  }
  *out = rq;
  return KVI_OK;
}

kvi_status kvi__inject(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                       const kvi_inject_options *opts, struct CUstream_st *stream, const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (num_requests < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_requests is %d", (int)num_requests);
  if (num_requests > 0 && !reqs) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "reqs is NULL");
  xfer *x = &injector->x;
  int32_t lb, le;
  kvi_host_pages hp;
  kvi_status st = read_inject_options(x, opts, &lb, &le, &hp, fn);
  if (st || num_requests == 0) return st;
  ireq *rq;
  if ((st = read_requests(x, reqs, num_requests, &rq, fn))) return st;
  lock_both(x);
  st = inject_locked(x, rq, num_requests, NULL, lb, le, hp, NULL, NULL, stream, fn);
  unlock_both(x);
  free(rq);
  return st;
}

kvi_status kvi__inject_deviation(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                                 int32_t layer, float *out_scores, int64_t num_scores, kvi_memory out_memory,
                                 struct CUstream_st *stream, const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (num_requests < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_requests is %d", (int)num_requests);
  if (num_requests > 0 && !reqs) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "reqs is NULL");
  xfer *x = &injector->x;
  if (layer < 0 || layer >= x->cache.L)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "layer is %d, the model has layers 0..%d", (int)layer,
                     (int)x->cache.L - 1);
  if (num_scores < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_scores is %lld", (long long)num_scores);
  if (out_memory != KVI_MEMORY_HOST && out_memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_memory is %d, expected KVI_MEMORY_HOST or KVI_MEMORY_DEVICE",
                     (int)out_memory);
  if (out_memory == KVI_MEMORY_DEVICE && !x->cuda)
    return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "a CPU store writes host out_scores only");
  kvi_status st;
  if ((st = check_rope_set(x, fn))) return st;
  if (num_requests == 0) return KVI_OK;
  if (out_scores && x->cuda && (st = kvi__check_memory(out_scores, out_memory, true, x->store->device, fn, "out_scores")))
    return st;
  ireq *rq;
  if ((st = read_requests(x, reqs, num_requests, &rq, fn))) return st;
  /* NULL out_scores is refused once the call is known to have tokens (num_scores then falls short) */
  deviation dv = {layer, out_scores, out_scores ? num_scores : 0, out_memory == KVI_MEMORY_DEVICE};
  lock_both(x);
  st = inject_locked(x, rq, num_requests, NULL, 0, x->cache.L, KVI_HOST_PAGES_PROMOTE, &dv, NULL, stream, fn);
  unlock_both(x);
  free(rq);
  return st;
}

/* kvi_inject_plan's sum, the store's lock held; *out_tokens written on success. */
static kvi_status plan_tokens(const kvi_store *s, uint64_t tenant, const uint64_t *fact_ids, int32_t num_facts,
                              int64_t *out_tokens, const char *fn) {
  int64_t total = 0;
  for (int32_t f0 = 0; f0 < num_facts; f0 += 64) { /* looked up 64 at a time */
    fact *found[64];
    const int32_t n = num_facts - f0 < 64 ? num_facts - f0 : 64;
    kvi__store_find_many(s, &tenant, 0, fact_ids + f0, (size_t)n, found);
    for (int32_t f = 0; f < n; f++) {
      if (!found[f])
        return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no fact %llu for tenant %llu", (unsigned long long)fact_ids[f0 + f],
                         (unsigned long long)tenant);
      total += found[f]->tokens;
    }
  }
  *out_tokens = total;
  return KVI_OK;
}

kvi_status kvi__inject_plan(const kvi_injector *injector, uint64_t tenant, const uint64_t *fact_ids, int32_t num_facts,
                            int64_t *out_tokens, const char *fn) {
  if (!injector || !out_tokens || (num_facts > 0 && !fact_ids) || num_facts < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s", !injector ? "injector is NULL" : !out_tokens ? "out_tokens is NULL"
                                                         : num_facts < 0 ? "num_facts is negative" : "fact_ids is NULL");
  const kvi_store *s = injector->x.store;
  kvi__store_lock(s);
  const kvi_status st = plan_tokens(s, tenant, fact_ids, num_facts, out_tokens, fn);
  kvi__store_unlock(s);
  return st;
}

kvi_status kvi__injector_async_errors(kvi_injector *injector, int64_t *out_skipped, const char *fn) {
  if (!injector || !out_skipped)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", injector ? "out_skipped" : "injector");
  xfer *x = &injector->x;
  pthread_mutex_lock(&x->lock);
  *out_skipped = kvi__async_count_take(&x->skipped);
  pthread_mutex_unlock(&x->lock);
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* encode                                                                    */
/* ------------------------------------------------------------------------ */

/* A capture, as read and checked (its embedding owned until the
 * transaction takes it). */
typedef struct cap_state {
  kvi_capture c;
  float *emb;
  uint32_t need;
  uint32_t first; /* its pages are pg[first, first + need) of the call */
} cap_state;

static void free_caps(cap_state *cs, int32_t n) {
  for (int32_t i = 0; i < n; i++) free(cs[i].emb);
  free(cs);
}

/* A capture's job (the transfer's view of it). */
static void capture_job(const kvi_capture *c, job *j) {
  memset(j, 0, sizeof *j);
  j->table = c->block_table;
  j->table_len = c->block_table_len;
  j->table_on_host = true;
  j->first_slot = c->first_slot;
  j->tokens = c->num_tokens;
  j->positions = c->positions;
  j->start_position = c->start_position;
}

/* The plan sizes of a run of captures (kvi_encode's chunks). */
typedef struct chunk_size {
  int64_t nsegs;
  int64_t ntok, npos, ntables;
} chunk_size;

/* The captures of a call, read and checked (everything checkable without
 * the store's lock); cs[0, nread) need freeing. */
typedef struct cap_read {
  cap_state *cs;
  int32_t nread, nchunks;
  chunk_size *csz; /* per chunk of CAPTURE_CHUNK captures */
  int64_t ntok, ntables;
  uint32_t need_total;
} cap_read;

/* Whether (tenant, id) a sorts before b. */
static bool key_less(const kvi_capture *a, const kvi_capture *b) {
  return a->tenant != b->tenant ? a->tenant < b->tenant : a->fact_id < b->fact_id;
}

static kvi_status read_captures(xfer *x, const kvi_capture *caps, int32_t num_captures, struct CUstream_st *stream,
                                cap_read *r, const char *fn) {
  const kvi_store *s = x->store;
  memset(r, 0, sizeof *r);
  r->nchunks = (num_captures + CAPTURE_CHUNK - 1) / CAPTURE_CHUNK;
  /* cs is filled as the captures are read (zeroing it all up front costs
   * more than the rest of a capture's checks) */
  cap_state *cs = r->cs = malloc((size_t)num_captures * sizeof *cs);
  chunk_size *csz = r->csz = calloc((size_t)r->nchunks, sizeof *csz);
  kvi_status st = cs && csz ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d captures", (int)num_captures);
  /* Duplicates: keys in increasing order (the usual batch, ids counting up)
   * have none, which a comparison with the previous key shows; the first
   * key out of order moves the check to a hash set of the keys so far. */
  kvi__map seen = {0};
  bool ordered = true;
  size_t csize;
  memcpy(&csize, caps, sizeof csize);
  int64_t ntok = 0, ntables = 0;
  uint32_t need_total = 0;
  const int32_t *checked_table = NULL;
  for (int32_t i = 0; i < num_captures && st == KVI_OK; i++) {
    const char *src = (const char *)caps + (size_t)i * csize;
    size_t sz;
    memcpy(&sz, src, sizeof sz);
    if (sz != csize) {
      st = kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "caps[%d].struct_size is %zu, caps[0]'s is %zu", (int)i, sz, csize);
      break;
    }
    const cap_state blank = {KVI_CAPTURE_INIT, NULL, 0, 0};
    cs[r->nread++] = blank;
    if ((st = kvi__read_struct(&cs[i].c, sizeof cs[i].c, src, KVI__CAPTURE_V1, fn, "caps[i]"))) break;
    const kvi_capture *c = &cs[i].c;
    if (c->flags & ~KVI_PUT_REPLACE) {
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d: unknown flag bits 0x%x", (int)i, c->flags & ~KVI_PUT_REPLACE);
      break;
    }
    if (c->num_tokens < 1) {
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d: num_tokens is %d; a fact has at least one token", (int)i,
                     (int)c->num_tokens);
      break;
    }
    if (ordered && i > 0 && !key_less(&cs[i - 1].c, c)) {
      ordered = false;
      if ((st = kvi__map_reserve(&seen, (size_t)num_captures, fn))) break;
      for (int32_t k = 0; k < i; k++) kvi__map_put(&seen, cs[k].c.tenant, cs[k].c.fact_id, (void *)1);
    }
    if (!ordered) {
      if (kvi__map_get(&seen, c->tenant, c->fact_id)) {
        st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d repeats fact %llu of tenant %llu", (int)i,
                       (unsigned long long)c->fact_id, (unsigned long long)c->tenant);
        break;
      }
      kvi__map_put(&seen, c->tenant, c->fact_id, (void *)1);
    }
    /* the table is read here, so it must be host memory; captures of one
     * batched prefill share it, and asking the driver costs a microsecond */
    if (c->block_table != checked_table) {
      if ((st = kvi__check_memory(c->block_table, KVI_MEMORY_HOST, x->cuda, s->device, fn, "a capture's block table")))
        break;
      checked_table = c->block_table;
    }
    job j;
    capture_job(c, &j);
    if ((st = check_job(x, &j, i, "capture", fn))) break;
    if ((st = kvi__store_read_embedding(s, c->embedding, c->embedding_dtype, c->embedding_memory, stream, &cs[i].emb,
                                        fn)))
      break;
    cs[i].need = pages_for(s, c->num_tokens);
    cs[i].first = need_total;
    const int64_t tables = (c->first_slot + c->num_tokens - 1) / x->cache.BS - c->first_slot / x->cache.BS + 1;
    chunk_size *z = &csz[i / CAPTURE_CHUNK];
    z->nsegs += segs_for(x, cs[i].need);
    z->ntok += c->num_tokens;
    if (c->positions) z->npos += c->num_tokens;
    z->ntables += tables;
    ntok += c->num_tokens;
    need_total += cs[i].need;
    ntables += tables;
  }
  kvi__map_free(&seen);
  r->ntok = ntok;
  r->ntables = ntables;
  r->need_total = need_total;
  /* the limits before anything is reserved: need_total <= ntok, so within
   * them it cannot have wrapped */
  if (st == KVI_OK) st = check_limits(x, num_captures, ntok, ntables, fn);
  return st;
}

/* Plans and runs the captures in chunks of `per`, each its own plan inside
 * one buffer (one staging slot on a CUDA store), so that the device starts
 * on the first chunk while the host plans the rest. *launched: whether any
 * device work was enqueued (it may then still be writing pg's pages). */
static kvi_status run_captures(xfer *x, const cap_state *cs, int32_t n, const uint32_t *pg, const chunk_size *sz,
                               int32_t per, struct CUstream_st *stream, bool *launched, const char *fn) {
  const int32_t nchunks = (n + per - 1) / per;
  plan *cp = malloc((size_t)nchunks * sizeof *cp);
  if (!cp) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d plans", (int)nchunks);
  size_t total = 0;
  for (int32_t k = 0; k < nchunks; k++) {
    const int32_t nreq = k == nchunks - 1 ? n - k * per : per;
    plan_layout(&cp[k], sz[k].nsegs, nreq, sz[k].ntok, sz[k].npos, sz[k].ntables);
    cp[k].off = total;
    total += align_up(cp[k].bytes);
  }
  plan whole; /* the buffer of them all */
  memset(&whole, 0, sizeof whole);
  kvi_status st = plan_buffer(&whole, x, total, nchunks == 1, fn);
  if (st == KVI_OK && whole.sl && total > x->slot_bytes) /* slot_size counts the padding: cannot happen */
    st = kvi__fail(KVI_ERR_INTERNAL, fn, "a %zu-byte capture plan in a %zu-byte staging slot", total, x->slot_bytes);
  for (int32_t k = 0; k < nchunks && st == KVI_OK; k++) {
    plan *p = &cp[k];
    plan_place(p, whole.buf + p->off);
    p->sl = whole.sl;
    const int32_t i1 = k == nchunks - 1 ? n : (k + 1) * per;
    for (int32_t i = k * per; i < i1; i++) {
      job j;
      capture_job(&cs[i].c, &j);
      const int32_t ri = plan_request(p, x, &j);
      plan_run(p, x, ri, j.first_slot, j.tokens, j.positions, false, (int32_t)j.start_position, pg + cs[i].first);
    }
    st = execute(x, p, 0, x->cache.L, false, stream, fn);
    *launched = *launched || (st == KVI_OK && x->cuda);
  }
  plan_free(x, &whole);
  free(cp);
  return st;
}

/* The captures' transaction, both locks held: their pages on the device
 * tier (a tiered store demotes least-recently-used facts if the device is
 * short), the kernels writing them, then the commit. */
static kvi_status encode_locked(xfer *x, cap_read *r, int32_t num_captures, struct CUstream_st *stream,
                                const char *fn) {
  cap_state *cs = r->cs;
  kvi__txn t;
  kvi_status st = kvi__txn_begin(&t, x->store, num_captures, KVI__PLACE_DEVICE, NULL, stream, fn);
  t.item = "capture";
  for (int32_t i = 0; i < num_captures && st == KVI_OK; i++) {
    st = kvi__txn_add(&t, cs[i].c.tenant, cs[i].c.fact_id, cs[i].c.num_tokens, cs[i].c.flags, cs[i].emb);
    cs[i].emb = NULL; /* the transaction's */
  }
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  bool launched = false;
  if (st == KVI_OK) {
    /* one chunk when the whole plan travels in the kernel parameters */
    chunk_size all = {0, r->ntok, 0, r->ntables};
    for (int32_t k = 0; k < r->nchunks; k++) all.nsegs += r->csz[k].nsegs, all.npos += r->csz[k].npos;
    plan one;
    plan_layout(&one, all.nsegs, num_captures, all.ntok, all.npos, all.ntables);
    const bool single = r->nchunks == 1 || (x->cuda && one.bytes <= KVI__INLINE_PLAN);
    st = run_captures(x, cs, num_captures, t.pages, single ? &all : r->csz, single ? num_captures : CAPTURE_CHUNK,
                      stream, &launched, fn);
  }
  if (launched) kvi__txn_wrote(&t);
  if (st == KVI_OK) st = kvi__txn_prepare(&t); /* the facts' records, allocated while the device works */
  return st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
}

/* kvi_encode; kvi__encode_batched passes its captures through here, under its own fn. */
kvi_status kvi__encode(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures, struct CUstream_st *stream,
                       const char *fn) {
  if (!encoder) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "encoder is NULL");
  if (num_captures < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_captures is %d", (int)num_captures);
  if (num_captures > 0 && !caps) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "caps is NULL");
  xfer *x = &encoder->x;
  kvi_status st = check_rope_set(x, fn);
  if (st || num_captures == 0) return st;
  cap_read r;
  st = read_captures(x, caps, num_captures, stream, &r, fn);
  if (st == KVI_OK) {
    lock_both(x);
    st = encode_locked(x, &r, num_captures, stream, fn);
    unlock_both(x);
  }
  free(r.csz);
  if (r.cs) free_caps(r.cs, r.nread);
  return st;
}

static kvi_status check_offsets(const int32_t *off, int32_t n, const char *what, const char *fn);

/* The checks both batched calls make of their positions and block-table form. */
static kvi_status check_batch_form(int32_t position_bits, const void *positions, const void *start_positions,
                                   int64_t num_positions, int64_t stride, int32_t len, const int32_t *offsets,
                                   const char *fn) {
  if (position_bits != 32 && position_bits != 64)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->position_bits is %d, expected 32 or 64", (int)position_bits);
  if (positions && start_positions)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch gives both positions and start_positions");
  if (num_positions < 0 || (num_positions > 0 && !positions))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->num_positions is %lld with positions %s",
                     (long long)num_positions, positions ? "given" : "NULL");
  if (stride < 0 || (stride > 0 && offsets) || (stride > 0 && (len < 0 || len > stride)) || (stride == 0 && len != 0))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "batch->block_table_stride %lld with block_table_len %d and block_table_offsets %s: expected a "
                     "stride > 0 with 0 <= len <= stride and no offsets (2-D), or stride 0, len 0 and offsets (CSR)",
                     (long long)stride, (int)len, offsets ? "given" : "NULL");
  return KVI_OK;
}

kvi_status kvi__encode_batched(kvi_encoder *encoder, const kvi_encode_batch *batch, struct CUstream_st *stream,
                               const char *fn) {
  if (!encoder) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "encoder is NULL");
  if (!batch) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch is NULL");
  const xfer *x = &encoder->x;
  kvi_encode_batch b = KVI_ENCODE_BATCH_INIT;
  kvi_status st;
  if ((st = kvi__read_struct(&b, sizeof b, batch, KVI__ENCODE_BATCH_V1, fn, "batch"))) return st;
  const int32_t n = b.num_captures;
  if (n < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->num_captures is %d", (int)n);
  if ((st = check_batch_form(b.position_bits, b.positions, b.start_positions, b.num_positions, b.block_table_stride,
                              b.block_table_len, b.block_table_offsets, fn)))
    return st;
  if (b.embedding_stride < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->embedding_stride is %lld", (long long)b.embedding_stride);
  if (n == 0) return kvi__encode(encoder, NULL, 0, stream, fn);
  if (!b.fact_ids || !b.num_tokens || !b.block_tables || (b.block_table_stride == 0 && !b.block_table_offsets))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->%s is NULL",
                     !b.fact_ids ? "fact_ids" : !b.num_tokens ? "num_tokens" : !b.block_tables ? "block_tables"
                                                                                  : "block_table_offsets");
  if (b.block_table_stride == 0 && (st = check_offsets(b.block_table_offsets, n, "batch->block_table_offsets", fn)))
    return st;
  if (x->cuda) { /* read here: host memory (each array once) */
    const void *ptr[7] = {b.fact_ids, b.num_tokens, b.block_tables, b.block_table_offsets, b.first_slots, b.tenants,
                          b.start_positions ? b.start_positions : b.positions};
    const char *what[7] = {"fact_ids", "num_tokens", "block_tables", "block_table_offsets", "first_slots", "tenants",
                           "positions"};
    for (int i = 0; i < 7; i++)
      if (ptr[i] && (st = kvi__check_memory(ptr[i], KVI_MEMORY_HOST, true, x->store->device, fn, what[i]))) return st;
  }
  int64_t ntok = 0;
  for (int32_t i = 0; i < n; i++)
    if (b.num_tokens[i] > 0) ntok += b.num_tokens[i];
  if (b.num_positions > 0 && b.num_positions != ntok)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->num_positions is %lld, the captures have %lld tokens",
                     (long long)b.num_positions, (long long)ntok);
  const size_t es = b.embeddings ? kvi__dtype_size(b.embedding_dtype) : 0;
  if (b.embeddings && es == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->embedding_dtype is %d", (int)b.embedding_dtype);
  const int64_t erow = b.embedding_stride ? b.embedding_stride : x->store->emb_dim;
  kvi_capture *caps = malloc((size_t)n * sizeof *caps);
  int32_t *pos32 = b.positions && b.position_bits == 64 ? malloc((size_t)(ntok ? ntok : 1) * sizeof *pos32) : NULL;
  if (!caps || (b.positions && b.position_bits == 64 && !pos32)) {
    free(caps);
    free(pos32);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d captures", (int)n);
  }
  /* int64 positions narrowed for the captures: one past INT32_MAX is out of range (refused here) */
  for (int64_t t = 0; pos32 && t < ntok && st == KVI_OK; t++) {
    const int64_t v = ((const int64_t *)b.positions)[t];
    if (v < 0 || v >= x->max_pos)
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "positions[%lld] is %lld, expected 0..%d", (long long)t,
                     (long long)v, (int)x->max_pos - 1);
    else
      pos32[t] = (int32_t)v;
  }
  int64_t at = 0;
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    kvi_capture *c = &caps[i];
    const kvi_capture d = KVI_CAPTURE_INIT;
    *c = d;
    c->tenant = b.tenants ? b.tenants[i] : b.tenant;
    c->fact_id = b.fact_ids[i];
    if (b.block_table_stride > 0) {
      c->block_table = b.block_tables + (size_t)i * (size_t)b.block_table_stride;
      c->block_table_len = b.block_table_len;
    } else {
      c->block_table = b.block_tables + b.block_table_offsets[i];
      c->block_table_len = b.block_table_offsets[i + 1] - b.block_table_offsets[i];
    }
    c->first_slot = b.first_slots ? b.first_slots[i] : 0;
    c->num_tokens = b.num_tokens[i];
    if (b.positions) {
      c->positions = pos32 ? pos32 + at : (const int32_t *)b.positions + at;
    } else if (b.start_positions) {
      const int64_t sp = b.position_bits == 64 ? ((const int64_t *)b.start_positions)[i]
                                               : ((const int32_t *)b.start_positions)[i];
      if (sp < 0 || sp > INT32_MAX)
        st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d: start position %lld is outside 0..%d", (int)i,
                       (long long)sp, (int)x->max_pos - 1);
      c->start_position = (int32_t)sp;
    }
    if (c->num_tokens > 0) at += c->num_tokens;
    c->flags = b.flags;
    if (b.embeddings) {
      c->embedding = (const char *)b.embeddings + (size_t)i * (size_t)erow * es;
      c->embedding_dtype = b.embedding_dtype;
      c->embedding_memory = b.embedding_memory;
    }
  }
  if (st == KVI_OK) st = kvi__encode(encoder, caps, n, stream, fn);
  free(caps);
  free(pos32);
  return st;
}

/* ------------------------------------------------------------------------ */
/* retrieve and inject                                                       */
/* ------------------------------------------------------------------------ */

/* A request as the job its reserve makes of it. */
static void retrieve_job(const kvi_retrieve_request *rq, int64_t tokens, job *j) {
  memset(j, 0, sizeof *j);
  j->table = rq->block_table;
  j->table_len = rq->block_table_len;
  j->table_on_host = rq->block_table_memory == KVI_MEMORY_HOST;
  j->first_slot = rq->first_slot;
  j->tokens = tokens;
  j->start_position = rq->start_position;
}

/* Checks request i's reserve (store locked): what the query may inject is
 * at most k of its tenant's facts, each no longer than the longest fact the
 * tenant has held, and its block table and positions must take that many
 * tokens. Counted over facts, not embedding rows: the same on every rank of
 * a store with sharded embeddings, so the ranks of a collective call decide
 * alike. *t: the tenant (NULL when unknown); *nres: facts reserved. */
static kvi_status check_reserve(const xfer *x, const kvi_retrieve_request *rq, int32_t i, int32_t k, job *j,
                                const tenant **t, int32_t *nres, const char *fn) {
  *t = kvi__store_tenant(x->store, rq->tenant);
  const size_t n = *t ? (*t)->count : 0;
  *nres = n < (size_t)k ? (int32_t)n : k;
  kvi_status st = check_table_kind(x, rq->block_table_memory, i, fn);
  if (st) return st;
  retrieve_job(rq, (int64_t)*nres * (*t ? (*t)->max_tokens : 0), j);
  return check_request_job(x, j, i, fn);
}

/* The host path (CPU stores, and CUDA stores with a host tier or sharded
 * embeddings): the search into host memory, then the injection of its
 * results, which checks everything again before writing; both locks held
 * from the reserve check to the injection, so no put or remove comes in
 * between. Arguments read and checked. */
static kvi_status retrieve_on_host(kvi_injector *injector, const void *queries, int32_t nq, int32_t dim,
                                   const kvi_retrieve_request *rq, const uint64_t *tenants, int32_t k,
                                   const kvi_search_options *opts, uint64_t *out_ids, int32_t *out_counts,
                                   int32_t *out_tokens, struct CUstream_st *stream) {
  static const char fn[] = "kvi_retrieve_inject";
  xfer *x = &injector->x;
  kvi_store *s = x->store;
  (void)dim;
  const size_t n = (size_t)nq;
  ireq *ir = malloc(n * sizeof *ir);
  uint64_t *ids = malloc(n * (size_t)k * sizeof *ids), *order = malloc(n * (size_t)k * sizeof *order);
  float *scores = malloc(n * (size_t)k * sizeof *scores);
  int32_t *counts = malloc(n * sizeof *counts), *tokens = malloc(n * sizeof *tokens);
  kvi_status st = ir && ids && order && scores && counts && tokens
                      ? KVI_OK
                      : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests of %d facts", (int)nq, (int)k);
  /* the same contract as the device path: room for k facts of the tenant's
   * longest size, and the reserves within the transfer limits */
  int64_t ntok = 0, ntables = 0;
  lock_both(x);
  for (int32_t i = 0; i < nq && st == KVI_OK; i++) {
    job j;
    const tenant *t;
    int32_t nres;
    if ((st = check_reserve(x, &rq[i], i, k, &j, &t, &nres, fn))) break;
    ntok = sat_add(ntok, j.tokens);
    ntables = sat_add(ntables, host_table_entries(x, &j));
  }
  if (st == KVI_OK) st = check_limits(x, nq, ntok, ntables, fn);
  if (st == KVI_OK)
    st = kvi__search_all(s, queries, opts->query_dtype, opts->query_memory, nq, tenants, k, ids, scores, counts,
                         KVI_MEMORY_HOST, opts->workspace_bytes, true, stream, fn);
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    uint64_t *o = order + i * (size_t)k;
    for (int32_t j = 0; j < counts[i]; j++)
      o[j] = ids[i * (size_t)k + (size_t)((rq[i].flags & KVI_RETRIEVE_BEST_LAST) ? counts[i] - 1 - j : j)];
    int64_t t = 0;
    if (counts[i] > 0 && (st = plan_tokens(s, rq[i].tenant, o, counts[i], &t, fn))) break;
    if (t > INT32_MAX) st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "query %zu's facts have %lld tokens", i, (long long)t);
    tokens[i] = (int32_t)t;
    kvi_inject_request q = KVI_INJECT_REQUEST_INIT;
    q.tenant = rq[i].tenant;
    q.fact_ids = o;
    q.num_facts = counts[i];
    q.block_table = rq[i].block_table;
    q.block_table_len = rq[i].block_table_len;
    q.block_table_memory = rq[i].block_table_memory;
    q.first_slot = rq[i].first_slot;
    q.start_position = rq[i].start_position;
    st = request_of(x, &q, (int32_t)i, &ir[i], fn);
  }
  if (st == KVI_OK) st = inject_locked(x, ir, nq, NULL, 0, x->cache.L, KVI_HOST_PAGES_PROMOTE, NULL, NULL, stream, fn);
  unlock_both(x);
  if (st == KVI_OK) {
    memcpy(out_ids, ids, n * (size_t)k * sizeof *ids);
    memcpy(out_counts, counts, n * sizeof *counts);
    memcpy(out_tokens, tokens, n * sizeof *tokens);
  }
  free(ir);
  free(ids);
  free(order);
  free(scores);
  free(counts);
  free(tokens);
  return st;
}

/* The device path: the search's enqueue hook writes the plan's segments
 * from its results and launches the injection, without the host. */
typedef struct retr {
  xfer *x;
  const kvi_retrieve_request *rq;
  const uint64_t *tenants;
  int32_t nq, k;
  plan p;
} retr;

/* A request planned on the device (kvi_retrieve_inject's device path and
 * kvi_inject_batched's with device fact ids): its reserve job (checked), its
 * tenant (or NULL), the facts reserved, and where they start. */
typedef struct dreq {
  job j;
  const tenant *t;
  int32_t nres;
  int32_t start_position;
  bool best_last;
} dreq;

/* The plan of n device-planned requests: segments reserved for each
 * request's facts (filled by the retrieve-plan kernel), its kvi__rquery at
 * o_ext, and `extra` bytes of the caller's after them (16-aligned, at
 * o_ext + align_up(n * sizeof(kvi__rquery))). */
static kvi_status plan_on_device(xfer *x, plan *p, const dreq *d, int32_t n, size_t extra, const char *fn) {
  const kvi_store *s = x->store;
  int32_t *spf = malloc((size_t)n * sizeof *spf);
  if (!spf) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)n);
  int64_t ntok = 0, ntables = 0, nsegs = 0;
  for (int32_t i = 0; i < n; i++) {
    const int32_t longest = d[i].t ? d[i].t->max_tokens : 0;
    /* a fact has at most one segment per token, and per page part */
    spf[i] = (int32_t)segs_for(x, pages_for(s, longest));
    if (spf[i] > longest) spf[i] = longest;
    ntok = sat_add(ntok, d[i].j.tokens);
    nsegs = sat_add(nsegs, (int64_t)d[i].nres * spf[i]);
    ntables = sat_add(ntables, host_table_entries(x, &d[i].j));
  }
  kvi_status st = KVI_OK;
  if (nsegs > ntok) st = kvi__fail(KVI_ERR_INTERNAL, fn, "%lld segments for %lld tokens", (long long)nsegs, (long long)ntok);
  if (st == KVI_OK)
    st = plan_alloc(p, x, nsegs, n, ntok, 0, ntables, align_up((size_t)n * sizeof(kvi__rquery)) + extra, fn);
  if (st == KVI_OK) {
    kvi__rquery *q = (kvi__rquery *)(p->buf + p->o_ext);
    int32_t seg0 = 0;
    for (int32_t i = 0; i < n; i++) {
      const tenant *t = d[i].t;
      plan_request(p, x, &d[i].j);
      memset(&q[i], 0, sizeof q[i]);
      q[i].dir = d[i].nres > 0 ? t->dir : NULL;
      q[i].first_slot = d[i].j.first_slot;
      q[i].cap = d[i].j.tokens;
      q[i].stride = t ? t->dir_stride : 0;
      q[i].spf = spf[i];
      q[i].seg0 = seg0;
      q[i].nres = d[i].nres;
      q[i].start_position = d[i].start_position;
      q[i].best_last = d[i].best_last;
      seg0 += d[i].nres * spf[i];
    }
    p->nsegs = seg0;
  }
  free(spf);
  return st;
}

/* The device work of a device-planned call once its plan is on the device:
 * the retrieve-plan kernel turns rows (n x k tenant rows, -1 skipped) and
 * counts into the plan's segments, out_counts and out_tokens (device;
 * out_counts may be counts), then one injection launch. */
static kvi_status plan_and_inject(xfer *x, plan *p, int32_t n, int32_t k, const int32_t *rows, const int32_t *counts,
                                  int32_t *out_counts, int32_t *out_tokens, int32_t lb, int32_t le,
                                  struct CUstream_st *stream, const char *fn) {
  char *dev = p->sl->dev + p->off;
  kvi__rplan_args a;
  memset(&a, 0, sizeof a);
  a.queries = (const kvi__rquery *)(dev + p->o_ext);
  a.nq = n;
  a.k = k;
  a.P = x->store->P;
  a.seg_tokens = x->seg_tokens;
  a.rows = rows;
  a.counts = counts;
  a.segs = (kvi__xseg *)dev;
  a.out_counts = out_counts;
  a.out_tokens = out_tokens;
  a.skipped = x->skipped.dev;
#ifdef KVI_HAVE_CUDA
  const int err = kvi__cuda_retrieve_plan(&a, stream);
  if (err) return kvi__cuda_error(err, fn, "retrieve plan kernel launch");
#endif
  return launch(x, p, lb, le, true, stream, fn);
}

static kvi_status retr_prepare(void *ctx, const char *fn) {
  retr *r = ctx;
  xfer *x = r->x;
  dreq *d = malloc((size_t)r->nq * sizeof *d);
  kvi_status st = d ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)r->nq);
  for (int32_t i = 0; i < r->nq && st == KVI_OK; i++) {
    st = check_reserve(x, &r->rq[i], i, r->k, &d[i].j, &d[i].t, &d[i].nres, fn);
    d[i].start_position = r->rq[i].start_position;
    d[i].best_last = (r->rq[i].flags & KVI_RETRIEVE_BEST_LAST) != 0;
  }
  if (st == KVI_OK) st = plan_on_device(x, &r->p, d, r->nq, 0, fn);
  free(d);
  return st;
}

kvi_status kvi__retrieve_prepare(kvi_injector *injector, const kvi_retrieve_request *reqs, int32_t nq, int32_t k,
                                 kvi__plan_view *out) {
  xfer *x = &injector->x;
  memset(out, 0, sizeof *out);
  if (x->cuda) /* its plan would take a staging slot, which only a launch gives back in order */
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, "kvi__retrieve_prepare", "a CPU injector's plans only");
  retr r = {x, reqs, NULL, nq, k, {0}};
  lock_both(x);
  const kvi_status st = retr_prepare(&r, "kvi_retrieve_inject");
  unlock_both(x);
  view_of_plan(out, &r.p);
  return st;
}

void kvi__plan_view_free(kvi_injector *injector, kvi__plan_view *v) {
  plan p = plan_of_view(v);
  plan_free(&injector->x, &p);
  memset(v, 0, sizeof *v);
}

static kvi_status retr_enqueue(void *ctx, const int32_t *rows, int32_t *counts, int32_t *tokens,
                               struct CUstream_st *stream, const char *fn) {
  retr *r = ctx;
  plan *p = &r->p;
  kvi_status st = kvi__cuda_h2d(p->sl->dev + p->off, p->buf, p->bytes, stream, fn);
  if (st) return st;
  p->uploaded = true;
  return plan_and_inject(r->x, p, r->nq, r->k, rows, counts, counts, tokens, 0, r->x->cache.L, stream, fn);
}

kvi_status kvi__retrieve_inject(kvi_injector *injector, const void *queries, int32_t num_queries, int32_t dim,
                                const kvi_retrieve_request *reqs, int32_t k, const kvi_search_options *opts,
                                uint64_t *out_ids, int32_t *out_counts, int32_t *out_tokens, struct CUstream_st *stream,
                                const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (num_queries < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_queries is %d", (int)num_queries);
  if (num_queries > 0 && (!reqs || !out_ids || !out_counts || !out_tokens))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL",
                     !reqs ? "reqs" : !out_ids ? "out_ids" : !out_counts ? "out_counts" : "out_tokens");
  xfer *x = &injector->x;
  kvi_store *s = x->store;
  kvi_search_options so = KVI_SEARCH_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&so, sizeof so, opts, KVI__SEARCH_OPTIONS_V1, fn, "opts"))) return st;
  if (k < 1 || k > KVI_SEARCH_MAX_K)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "k is %d, expected 1..%d", (int)k, KVI_SEARCH_MAX_K);
  if ((st = check_rope_set(x, fn))) return st;
  if (num_queries == 0) return KVI_OK;
  size_t rsize;
  memcpy(&rsize, reqs, sizeof rsize);
  const size_t n = (size_t)num_queries;
  kvi_retrieve_request *rq = malloc(n * sizeof *rq);
  uint64_t *tenants = malloc(n * sizeof *tenants);
  st = rq && tenants ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)num_queries);
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    const char *src = (const char *)reqs + i * rsize;
    size_t sz;
    memcpy(&sz, src, sizeof sz);
    if (sz != rsize)
      st = kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "reqs[%zu].struct_size is %zu, reqs[0]'s is %zu; they must be equal", i,
                     sz, rsize);
    else if (!(st = kvi__read_struct(&rq[i], sizeof rq[i], src, KVI__RETRIEVE_REQUEST_V1, fn, "reqs[i]")) &&
             (rq[i].flags & ~KVI_RETRIEVE_BEST_LAST))
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "reqs[%zu].flags has unknown bits 0x%x", i,
                     rq[i].flags & ~KVI_RETRIEVE_BEST_LAST);
    if (st == KVI_OK) tenants[i] = rq[i].tenant;
  }
  if (st == KVI_OK) st = kvi__search_check(s, queries, num_queries, dim, tenants, k, &so, fn);
  if (st == KVI_OK && (!x->cuda || !s->emb.dir_on || s->shard.emb_sharded) && so.out_memory != KVI_MEMORY_HOST)
    st = kvi__fail(so.out_memory == KVI_MEMORY_DEVICE ? KVI_ERR_MEMORY_KIND : KVI_ERR_INVALID_ARGUMENT, fn,
                   "opts->out_memory is %d; %s writes host memory only", (int)so.out_memory,
                   !x->cuda ? "a CPU store" : "a store with a host tier or sharded embeddings");
  const char *what[3] = {"out_ids", "out_counts", "out_tokens"};
  const void *outs[3] = {out_ids, out_counts, out_tokens};
  for (int i = 0; i < 3 && st == KVI_OK; i++)
    st = kvi__check_memory(outs[i], so.out_memory, x->cuda, s->device, fn, what[i]);
  if (st == KVI_OK && x->cuda && s->emb.dir_on && !s->shard.emb_sharded) {
    /* the device path: search, plan and inject enqueued under one hold of both locks */
    retr r = {x, rq, tenants, num_queries, k, {0}};
    const kvi__search_then then = {retr_prepare, retr_enqueue, &r};
    pthread_mutex_lock(&x->lock);
    st = kvi__search_then_run(s, queries, &so, num_queries, tenants, k, out_ids, out_counts, out_tokens, &then, stream,
                              fn);
    plan_free(x, &r.p);
    pthread_mutex_unlock(&x->lock);
  } else if (st == KVI_OK) {
    st = retrieve_on_host(injector, queries, num_queries, dim, rq, tenants, k, &so, out_ids, out_counts, out_tokens,
                          stream);
  }
  free(rq);
  free(tenants);
  return st;
}

/* ------------------------------------------------------------------------ */
/* batched injection                                                         */
/* ------------------------------------------------------------------------ */

static bool memory_valid(kvi_memory m) { return m == KVI_MEMORY_HOST || m == KVI_MEMORY_DEVICE; }

/* Checks that offsets[0..n] are >= 0 and non-decreasing. */
static kvi_status check_offsets(const int32_t *off, int32_t n, const char *what, const char *fn) {
  if (!off) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", what);
  if (off[0] < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s[0] is %d", what, (int)off[0]);
  for (int32_t r = 0; r < n; r++)
    if (off[r + 1] < off[r])
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s[%d] is %d, below %s[%d] = %d", what, (int)r + 1,
                       (int)off[r + 1], what, (int)r, (int)off[r]);
  return KVI_OK;
}

/* The batch's index arrays in host memory: device ones are copied here
 * (one wait on `stream` for all of them); *keep holds the copies. */
static kvi_status batch_index_on_host(const xfer *x, kvi_inject_batch *b, void **keep, struct CUstream_st *stream,
                                      const char *fn) {
  *keep = NULL;
  if (b->index_memory == KVI_MEMORY_HOST) return KVI_OK;
  const size_t n = (size_t)b->num_requests, w = b->position_bits == 64 ? 8 : 4;
  if (b->positions && b->num_positions == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "device positions need num_positions > 0");
  const void **arr[6] = {(const void **)&b->fact_offsets, (const void **)&b->block_table_offsets,
                         (const void **)&b->first_slots, &b->start_positions, (const void **)&b->tenants, &b->positions};
  const size_t bytes[6] = {(n + 1) * 4, (n + 1) * 4, n * 8, n * w, n * 8, (size_t)b->num_positions * w};
  const char *what[6] = {"fact_offsets", "block_table_offsets", "first_slots", "start_positions", "tenants", "positions"};
  size_t total = 0;
  kvi_status st = KVI_OK;
  for (int i = 0; i < 6 && st == KVI_OK; i++)
    if (*arr[i]) {
      st = kvi__check_memory(*arr[i], KVI_MEMORY_DEVICE, true, x->store->device, fn, what[i]);
      total += align_up(bytes[i]);
    }
  char *h = st == KVI_OK ? malloc(total ? total : 1) : NULL;
  if (st == KVI_OK && !h) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes of index arrays", total);
  if (st) return st;
  size_t at = 0;
  for (int i = 0; i < 6 && st == KVI_OK; i++)
    if (*arr[i]) {
      st = kvi__cuda_d2h(h + at, *arr[i], bytes[i], stream, fn);
      *arr[i] = h + at;
      at += align_up(bytes[i]);
    }
  if (st == KVI_OK) st = kvi__cuda_sync(stream, fn);
  if (st) free(h);
  else *keep = h;
  return st;
}

/* Request r of a batch (index arrays on the host, offsets checked). */
static void batch_request(const kvi_inject_batch *b, int32_t r, ireq *q) {
  memset(q, 0, sizeof *q);
  q->tenant = b->tenants ? b->tenants[r] : b->tenant;
  q->num_facts = b->fact_offsets[r + 1] - b->fact_offsets[r];
  q->fact_ids = b->fact_ids ? b->fact_ids + b->fact_offsets[r] : NULL;
  job *j = &q->j;
  if (b->block_table_stride > 0) {
    j->table = b->block_tables ? b->block_tables + (size_t)r * (size_t)b->block_table_stride : NULL;
    j->table_len = b->block_table_len;
  } else {
    j->table = b->block_tables ? b->block_tables + b->block_table_offsets[r] : NULL;
    j->table_len = b->block_table_offsets[r + 1] - b->block_table_offsets[r];
  }
  j->table_on_host = b->block_tables_memory == KVI_MEMORY_HOST;
  j->kind_checked = true;
  j->first_slot = b->first_slots ? b->first_slots[r] : 0;
  j->start_position = !b->start_positions ? 0
                      : b->position_bits == 64 ? ((const int64_t *)b->start_positions)[r]
                                               : ((const int32_t *)b->start_positions)[r];
}

/* Device fact ids (CUDA store with device directories; index arrays on the
 * host, both locks held): each request's reserve checked on the host, the
 * plan's queries and lookups uploaded, then on `stream`: the id lookup, the
 * retrieve-plan kernel and one injection launch, ordered after the last
 * change to the store's embeddings and before the next. */
static kvi_status batch_on_device(xfer *x, const kvi_inject_batch *b, int32_t lb, int32_t le, struct CUstream_st *stream,
                                  const char *fn) {
  kvi_store *s = x->store;
  const int32_t n = b->num_requests;
  int32_t kmax = 0;
  for (int32_t r = 0; r < n; r++)
    if (b->fact_offsets[r + 1] - b->fact_offsets[r] > kmax) kmax = b->fact_offsets[r + 1] - b->fact_offsets[r];
  if (kmax == 0) kmax = 1;
  dreq *d = malloc((size_t)n * sizeof *d);
  if (!d) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)n);
  kvi_status st = KVI_OK;
  for (int32_t r = 0; r < n && st == KVI_OK; r++) {
    ireq q;
    batch_request(b, r, &q);
    d[r].j = q.j;
    d[r].t = kvi__store_tenant(s, q.tenant);
    d[r].nres = d[r].t && d[r].t->count > 0 ? q.num_facts : 0;
    d[r].best_last = false;
    d[r].j.tokens = (int64_t)d[r].nres * (d[r].t ? d[r].t->max_tokens : 0);
    if (d[r].j.start_position < 0 || d[r].j.start_position > INT32_MAX)
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: start position %lld is outside 0..%d", (int)r,
                     (long long)d[r].j.start_position, (int)x->max_pos - 1);
    else
      st = check_request_job(x, &d[r].j, r, fn);
    d[r].start_position = (int32_t)d[r].j.start_position;
  }
  /* after the queries: the id lookups, their rows (n x kmax), counts and tokens */
  const size_t o_look = 0, o_rows = align_up((size_t)n * sizeof(kvi__idreq)),
               o_counts = o_rows + align_up((size_t)n * kmax * sizeof(int32_t)),
               o_tokens = o_counts + align_up((size_t)n * sizeof(int32_t)),
               extra = o_tokens + (size_t)n * sizeof(int32_t);
  plan p;
  memset(&p, 0, sizeof p);
  if (st == KVI_OK) st = plan_on_device(x, &p, d, n, extra, fn);
  if (st == KVI_OK) {
    const size_t o_mine = p.o_ext + align_up((size_t)n * sizeof(kvi__rquery));
    kvi__idreq *lk = (kvi__idreq *)(p.buf + o_mine + o_look);
    for (int32_t r = 0; r < n; r++) {
      const tenant *t = d[r].t;
      memset(&lk[r], 0, sizeof lk[r]);
      lk[r].ids = d[r].nres > 0 ? t->ids : NULL;
      lk[r].nrows = d[r].nres > 0 ? (int32_t)t->nrows : 0;
      lk[r].f0 = b->fact_offsets[r];
      lk[r].nf = d[r].nres;
    }
    char *dev = p.sl->dev + p.off;
    /* the plan's host tables, queries and lookups (the segments and what follows the lookups are written on the device) */
    st = kvi__cuda_h2d(dev + p.o_reqs, p.buf + p.o_reqs, o_mine + o_rows - p.o_reqs, stream, fn);
    p.uploaded = true;
    if (st == KVI_OK && s->emb.err)
      st = kvi__fail(s->emb.err, fn, "an earlier change to the store's device embeddings failed: %s", s->emb.err_msg);
    if (st == KVI_OK && s->emb.ready_recorded) st = kvi__cuda_stream_wait(stream, s->emb.ready, fn);
    bool enqueued = false;
    int32_t *rows = (int32_t *)(dev + o_mine + o_rows), *counts = (int32_t *)(dev + o_mine + o_counts);
    if (st == KVI_OK) {
      kvi__idlookup_args la;
      memset(&la, 0, sizeof la);
      la.reqs = (const kvi__idreq *)(dev + o_mine + o_look);
      la.n = n;
      la.k = kmax;
      la.fact_ids = b->fact_ids;
      la.rows = rows;
      la.counts = counts;
      la.skipped = x->skipped.dev;
      enqueued = true;
#ifdef KVI_HAVE_CUDA
      const int err = kvi__cuda_lookup_ids(&la, stream);
      if (err) st = kvi__cuda_error(err, fn, "fact id lookup kernel launch");
#endif
    }
    if (st == KVI_OK)
      st = plan_and_inject(x, &p, n, kmax, rows, counts, counts,
                           b->out_tokens ? b->out_tokens : (int32_t *)(dev + o_mine + o_tokens), lb, le, stream, fn);
    if (enqueued) { /* later changes to the tenants' rows and directories wait for what was enqueued */
      kvi_status s1 = kvi__cuda_event_record(x->emb_read, stream, fn);
      if (s1 == KVI_OK) s1 = kvi__cuda_stream_wait(s->emb.stream, x->emb_read, fn);
      if (st == KVI_OK) st = s1;
    }
  }
  plan_free(x, &p);
  free(d);
  return st;
}

kvi_status kvi__inject_batched(kvi_injector *injector, const kvi_inject_batch *batch, const kvi_inject_options *opts,
                               struct CUstream_st *stream, const char *fn) {
  if (!injector) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "injector is NULL");
  if (!batch) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch is NULL");
  xfer *x = &injector->x;
  kvi_store *s = x->store;
  kvi_inject_batch b = KVI_INJECT_BATCH_INIT;
  kvi_status st;
  if ((st = kvi__read_struct(&b, sizeof b, batch, KVI__INJECT_BATCH_V1, fn, "batch"))) return st;
  int32_t lb, le;
  kvi_host_pages hp;
  if ((st = read_inject_options(x, opts, &lb, &le, &hp, fn))) return st;
  const int32_t n = b.num_requests;
  if (n < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->num_requests is %d", (int)n);
  const kvi_memory mems[3] = {b.fact_ids_memory, b.block_tables_memory, b.index_memory};
  const char *mnames[3] = {"fact_ids_memory", "block_tables_memory", "index_memory"};
  for (int i = 0; i < 3; i++) {
    if (!memory_valid(mems[i]))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->%s is %d, expected KVI_MEMORY_HOST or DEVICE", mnames[i],
                       (int)mems[i]);
    if (mems[i] == KVI_MEMORY_DEVICE && !x->cuda)
      return kvi__fail(KVI_ERR_MEMORY_KIND, fn, "batch->%s is DEVICE; a CPU store reads host memory only", mnames[i]);
  }
  if ((st = check_batch_form(b.position_bits, b.positions, b.start_positions, b.num_positions, b.block_table_stride,
                              b.block_table_len, b.block_table_offsets, fn)))
    return st;
  const bool dev_ids = b.fact_ids_memory == KVI_MEMORY_DEVICE;
  if (dev_ids && (!s->emb.dir_on || s->shard.emb_sharded))
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn,
                     "device fact ids are looked up on the device only on a CUDA store with embeddings, without a "
                     "host tier and without sharded embeddings");
  if (dev_ids && b.positions)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "per-token positions with device fact ids (give start_positions)");
  if (n == 0) return KVI_OK;
  if (!b.fact_offsets)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->fact_offsets is NULL");
  if (b.block_table_stride == 0 && !b.block_table_offsets)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->block_table_offsets is NULL (stride 0: CSR block tables)");
  if (x->cuda) { /* each array once (a driver query each); device index arrays: batch_index_on_host */
    const bool hi = b.index_memory == KVI_MEMORY_HOST;
    const void *ptr[9] = {b.fact_ids,
                          b.block_tables,
                          b.out_tokens,
                          hi ? b.fact_offsets : NULL,
                          hi ? b.block_table_offsets : NULL,
                          hi ? b.first_slots : NULL,
                          hi ? b.start_positions : NULL,
                          hi ? b.positions : NULL,
                          hi ? b.tenants : NULL};
    const kvi_memory kind[3] = {b.fact_ids_memory, b.block_tables_memory, b.fact_ids_memory};
    const char *what[9] = {"batch->fact_ids",    "batch->block_tables",    "batch->out_tokens",
                           "batch->fact_offsets", "batch->block_table_offsets", "batch->first_slots",
                           "batch->start_positions", "batch->positions", "batch->tenants"};
    for (int i = 0; i < 9; i++)
      if (ptr[i] && (st = kvi__check_memory(ptr[i], i < 3 ? kind[i] : KVI_MEMORY_HOST, true, s->device, fn, what[i])))
        return st;
  }
  void *keep = NULL;
  if ((st = batch_index_on_host(x, &b, &keep, stream, fn))) return st;
  ireq *rq = NULL;
  if ((st = check_offsets(b.fact_offsets, n, "batch->fact_offsets", fn))) goto out;
  if (b.block_table_stride == 0 && (st = check_offsets(b.block_table_offsets, n, "batch->block_table_offsets", fn)))
    goto out;
  if (b.fact_offsets[n] > b.fact_offsets[0] && !b.fact_ids) {
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->fact_ids is NULL");
    goto out;
  }
  if (dev_ids) {
    lock_both(x);
    st = batch_on_device(x, &b, lb, le, stream, fn);
    unlock_both(x);
    goto out;
  }
  if (!(rq = malloc((size_t)n * sizeof *rq))) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)n);
    goto out;
  }
  for (int32_t r = 0; r < n; r++) batch_request(&b, r, &rq[r]);
  const flat_pos fp = {b.positions, b.position_bits == 64, b.num_positions};
  lock_both(x);
  st = inject_locked(x, rq, n, &fp, lb, le, hp, NULL, b.out_tokens, stream, fn);
  unlock_both(x);
out:
  free(rq);
  free(keep);
  return st;
}

/* ------------------------------------------------------------------------ */
/* what tests/internal reads of an injector (xfer/xfer.h)           */
/* ------------------------------------------------------------------------ */

int32_t kvi__injector_vec(const kvi_injector *injector) { return xfer_vec(&injector->x); }
int kvi__injector_device(const kvi_injector *injector) { return injector ? kvi__store_device(injector->x.store) : -1; }
int kvi__encoder_device(const kvi_encoder *encoder) { return encoder ? kvi__store_device(encoder->x.store) : -1; }
int32_t kvi__injector_seg_tokens(const kvi_injector *injector) { return injector->x.seg_tokens; }
int32_t kvi__injector_half_max(const kvi_injector *injector) { return injector->x.half_max; }
