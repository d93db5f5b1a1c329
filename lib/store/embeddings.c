/*
 * The store's embeddings: the embedding state (struct kvi__store_emb, which
 * this file alone changes), a caller's embedding read and checked, and the
 * tenants' matrices, with their ids and directories: grown, written through
 * the staging ring, rows moved and freed, read back.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "store/store_impl.h"

/* ---- the embedding state -------------------------------------------------- */

void kvi__emb_setup(kvi_store *s, const kvi_store_options *o, bool host_tier) {
  s->emb.dtype = o->embedding_dtype;
  s->emb.metric = o->metric;
  s->emb.ld = o->embedding_dim;
  if (s->backend == KVI_BACKEND_CUDA) { /* rows start on 16-byte boundaries: vector loads, GEMM alignment */
    const int32_t per16 = (int32_t)(16 / kvi__dtype_size(o->embedding_dtype));
    s->emb.ld = (o->embedding_dim + per16 - 1) / per16 * per16;
  }
  /* a multiple of 16 on a CUDA store */
  s->emb.stage_row_bytes = (size_t)s->emb.ld * kvi__dtype_size(o->embedding_dtype);
  /* a tiered store moves facts between pools: its page ids are the host's to know */
  s->emb.dir_on = s->backend == KVI_BACKEND_CUDA && s->emb_dim > 0 && !host_tier;
}

kvi_status kvi__emb_init(kvi_store *s, const char *fn) {
  kvi_status st = kvi__cuda_stream_create(&s->emb.stream, fn);
  if (st == KVI_OK) st = kvi__ring_init(&s->emb.stage, 1, 0, KVI__RING_GROW, fn);
  if (st == KVI_OK) st = kvi__cuda_event_create(&s->emb.ready, fn);
  return st;
}

void kvi__emb_release(kvi_store *s, bool device_ok) {
  if (s->backend == KVI_BACKEND_CUDA && device_ok) {
    if (s->emb.stream) kvi__cuda_sync(s->emb.stream, "kvi_store_destroy");
    kvi__ring_destroy(&s->emb.stage, "kvi_store_destroy");
    kvi__cuda_event_destroy(s->emb.ready);
    kvi__cuda_stream_destroy(s->emb.stream);
  }
  memset(&s->emb.stage, 0, sizeof s->emb.stage);
  s->emb.ready = NULL;
  s->emb.stream = NULL;
}

/* ---- the caller's embedding ------------------------------------------------ */

/* Reads and checks an embedding into a fresh host fp32 array. */
static kvi_status read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                 kvi_metric metric, struct CUstream_st *stream, float **out, const char *fn) {
  *out = NULL;
  if (!embedding) {
    if (s->emb_dim > 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store keeps %d-element embeddings and the embedding is NULL",
                       (int)s->emb_dim);
    return KVI_OK;
  }
  if (s->emb_dim == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "an embedding is given but the store was created with embedding_dim 0");
  if (!kvi__dtype_is_float(dtype))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding_dtype is %d, expected FP32, FP16 or BF16", (int)dtype);
  if (memory != KVI_MEMORY_HOST && memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding_memory is %d, expected KVI_MEMORY_HOST or DEVICE",
                     (int)memory);
  kvi_status st = kvi__check_memory(embedding, memory, s->backend == KVI_BACKEND_CUDA, s->device, fn, "embedding");
  if (st) return st;
  const size_t n = (size_t)s->emb_dim, bytes = n * kvi__dtype_size(dtype);
  float *e = malloc(n * sizeof *e);
  void *raw = memory == KVI_MEMORY_DEVICE ? malloc(bytes) : NULL;
  if (!e || (memory == KVI_MEMORY_DEVICE && !raw)) {
    free(e);
    free(raw);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %zu-element embedding", n);
  }
  const void *src = embedding;
  if (raw) {
    /* ordered after the caller's work on `stream`, which may have produced it */
    st = kvi__cuda_d2h(raw, embedding, bytes, stream, fn);
    if (st == KVI_OK) st = kvi__cuda_sync(stream, fn);
    src = raw;
  }
  if (st == KVI_OK) {
    kvi__convert(e, KVI_DTYPE_FP32, src, dtype, (int64_t)n);
    for (size_t i = 0; i < n && st == KVI_OK; i++)
      if (!isfinite(e[i]))
        st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding[%zu] is %g; embeddings must be finite", i, (double)e[i]);
    const int64_t bad =
        st == KVI_OK ? kvi__emb_prepare(e, s->emb_dim, s->emb.dtype, metric) : -1;
    if (bad >= 0)
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "embedding[%lld] is %g, too large for the store's %s embeddings",
                     (long long)bad, (double)kvi__load(src, dtype, bad), kvi__dtype_name(s->emb.dtype));
  }
  free(raw);
  if (st) {
    free(e);
    return st;
  }
  *out = e;
  return KVI_OK;
}

kvi_status kvi__store_read_embedding(const kvi_store *s, const void *embedding, kvi_dtype dtype, kvi_memory memory,
                                     struct CUstream_st *stream, float **out, const char *fn) {
  return read_embedding(s, embedding, dtype, memory, s->emb.metric, stream, out, fn);
}

kvi_status kvi__store_kept_embedding(const kvi_store *s, const float *embedding, float **out, const char *fn) {
  /* the inner product's preparation only rounds, which changes nothing kept */
  return read_embedding(s, embedding, KVI_DTYPE_FP32, KVI_MEMORY_HOST, KVI_METRIC_INNER_PRODUCT, NULL, out, fn);
}

int64_t kvi__emb_prepare(float *x, int32_t n, kvi_dtype t, kvi_metric metric) {
  if (metric == KVI_METRIC_COSINE) {
    double ss = 0.0;
    for (int32_t i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
    if (ss > 0.0) {
      const double inv = 1.0 / sqrt(ss);
      for (int32_t i = 0; i < n; i++) x[i] = (float)((double)x[i] * inv);
    }
  }
  for (int32_t i = 0; i < n; i++) {
    if (t == KVI_DTYPE_FP16) x[i] = kvi__f16_to_f32(kvi__f32_to_f16(x[i]));
    else if (t == KVI_DTYPE_BF16) x[i] = kvi__bf16_to_f32(kvi__f32_to_bf16(x[i]));
    if (!isfinite(x[i])) return i;
  }
  return -1;
}

/* ---- embedding matrices --------------------------------------------------- */

static const char emb_fn[] = "kvi_store (device embeddings)";

static size_t row_bytes(const kvi_store *s) { return (size_t)s->emb.ld * kvi__dtype_size(s->emb.dtype); }

/* Keeps the first failure to change device embeddings: later searches report it. */
static void emb_latch(kvi_store *s, kvi_status st) {
  if (st == KVI_OK || s->emb.err != KVI_OK) return;
  s->emb.err = st;
  snprintf(s->emb.err_msg, sizeof s->emb.err_msg, "%s", kvi__last_error());
}

/* The latched failure of an earlier change, reported for fn. */
static kvi_status emb_failed(const kvi_store *s, const char *fn) {
  return kvi__fail(s->emb.err, fn, "an earlier change to the store's device embeddings failed: %s", s->emb.err_msg);
}

kvi_status kvi__emb_latched(const kvi_store *s, const char *fn) { return s->emb.err ? emb_failed(s, fn) : KVI_OK; }

kvi_status kvi__emb_read_begin(kvi_store *s, struct CUstream_st *stream, const char *fn) {
  if (s->emb.err) return emb_failed(s, fn);
  return s->emb.ready_recorded ? kvi__cuda_stream_wait(stream, s->emb.ready, fn) : KVI_OK;
}

kvi_status kvi__emb_read_end(kvi_store *s, struct CUevent_st *done, const char *fn) {
  return kvi__cuda_stream_wait(s->emb.stream, done, fn);
}

/* Enqueued changes become visible to readers enqueued from now on. */
static kvi_status emb_publish(kvi_store *s) {
  kvi_status st = kvi__cuda_event_record(s->emb.ready, s->emb.stream, emb_fn);
  if (st == KVI_OK) s->emb.ready_recorded = true;
  return st;
}

/* Device bytes of a tenant's matrix, ids and directory per row. */
static uint64_t row_cost(const kvi_store *s, const tenant *t) {
  if (s->backend != KVI_BACKEND_CUDA) return row_bytes(s);
  return row_bytes(s) + sizeof(uint64_t) + (uint64_t)t->dir_stride * sizeof(uint32_t);
}

void kvi__emb_free(kvi_store *s, tenant *t, bool device_ok) {
  if (s->backend == KVI_BACKEND_CUDA && (t->emb || t->ids || t->dir)) {
    if (device_ok) { /* stream-ordered: after every search that was enqueued before (emb.stream waits for them) */
      kvi__emb_flush(s);
      emb_latch(s, kvi__cuda_free_async(t->emb, s->emb.stream, emb_fn));
      emb_latch(s, kvi__cuda_free_async(t->ids, s->emb.stream, emb_fn));
      emb_latch(s, kvi__cuda_free_async(t->dir, s->emb.stream, emb_fn));
    }
  } else {
    free(t->emb);
  }
  s->emb.bytes -= (uint64_t)t->cap * row_cost(s, t);
  free(t->rows);
  t->emb = NULL;
  t->ids = NULL;
  t->dir = NULL;
  t->dir_stride = 0;
  t->rows = NULL;
  t->cap = 0;
}

/* Device matrix of `cap` rows and directory rows of `stride` words: new
 * allocations, the live rows copied over, the old ones freed, all on
 * emb.stream. */
static kvi_status emb_grow_device(kvi_store *s, tenant *t, size_t cap, int32_t stride, const char *fn) {
  kvi__emb_flush(s);
  const bool same = cap == t->cap; /* only the directory's rows grow */
  if (stride < t->dir_stride) stride = t->dir_stride;
  const size_t rb = row_bytes(s), odb = (size_t)t->dir_stride * sizeof(uint32_t);
  const size_t db = same && stride == t->dir_stride ? 0 : (size_t)stride * sizeof(uint32_t); /* 0: no new directory */
  void *e = NULL, *ids = NULL, *dir = NULL;
  kvi_status st = KVI_OK;
  if (!same) st = kvi__cuda_malloc_async(&e, cap * rb, s->emb.stream, fn);
  if (st == KVI_OK && !same) st = kvi__cuda_malloc_async(&ids, cap * sizeof(uint64_t), s->emb.stream, fn);
  if (st == KVI_OK && db) st = kvi__cuda_malloc_async(&dir, cap * db, s->emb.stream, fn);
  if (st == KVI_OK && !same && t->nrows > 0) st = kvi__cuda_d2d(e, t->emb, t->nrows * rb, s->emb.stream, fn);
  if (st == KVI_OK && !same && t->nrows > 0)
    st = kvi__cuda_d2d(ids, t->ids, t->nrows * sizeof(uint64_t), s->emb.stream, fn);
  if (st == KVI_OK && db && odb && t->nrows > 0)
    st = kvi__cuda_copy2d(dir, db, t->dir, odb, odb, t->nrows, s->emb.stream, fn);
  if (st != KVI_OK) {
    if (st == KVI_ERR_OUT_OF_MEMORY)
      kvi__fail(st, fn, "growing tenant %llu's embeddings to %zu rows (%zu bytes of device memory)",
                (unsigned long long)t->id, cap, cap * (rb + sizeof(uint64_t) + db));
    kvi_status st2 = kvi__cuda_free_async(e, s->emb.stream, fn);
    if (st2 == KVI_OK) st2 = kvi__cuda_free_async(ids, s->emb.stream, fn);
    if (st2 == KVI_OK) st2 = kvi__cuda_free_async(dir, s->emb.stream, fn);
    emb_latch(s, st2);
    return st;
  }
  if (!same) st = kvi__cuda_free_async(t->emb, s->emb.stream, fn);
  if (st == KVI_OK && !same) st = kvi__cuda_free_async(t->ids, s->emb.stream, fn);
  if (st == KVI_OK && db) st = kvi__cuda_free_async(t->dir, s->emb.stream, fn);
  if (st == KVI_OK) st = emb_publish(s);
  emb_latch(s, st); /* the new arrays hold the rows either way */
  if (!same) t->emb = e, t->ids = ids;
  if (db) t->dir = dir, t->dir_stride = stride;
  return KVI_OK;
}

/* Room for `need` rows, and directory rows of `stride` words (emb.dir_on). */
static kvi_status emb_grow(kvi_store *s, tenant *t, size_t need, int32_t stride, const char *fn) {
  size_t cap = t->cap ? t->cap : 16;
  while (cap < need) cap *= 2;
  const size_t rb = row_bytes(s);
  const uint64_t cost0 = (uint64_t)t->cap * row_cost(s, t);
  fact **rows = realloc(t->rows, cap * sizeof *rows); /* a larger array changes nothing else */
  if (!rows) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu embedding rows", cap);
  t->rows = rows;
  if (s->backend == KVI_BACKEND_CUDA) {
    kvi_status st = emb_grow_device(s, t, cap, stride, fn);
    if (st) return st;
  } else {
    if (cap * rb / rb != cap) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "%zu embedding rows overflow", cap);
    void *e = realloc(t->emb, cap * rb);
    if (!e)
      return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "growing tenant %llu's embeddings to %zu rows (%zu bytes)",
                       (unsigned long long)t->id, cap, cap * rb);
    t->emb = e;
  }
  t->cap = cap;
  s->emb.bytes += (uint64_t)cap * row_cost(s, t) - cost0;
  return KVI_OK;
}

/* Staging of one fact's embedding row (kernels.h, kvi__emb_rows_args): its
 * entry, the row, and with emb.dir_on its directory row; each a multiple of
 * 16. */
static size_t stage_fact_bytes(const kvi_store *s, int32_t tokens) {
  size_t b = sizeof(kvi__row_entry) + s->emb.stage_row_bytes;
  if (s->emb.dir_on) b += ((size_t)(1 + pages_for(s, tokens)) * sizeof(uint32_t) + 15) & ~(size_t)15;
  return b;
}

_Static_assert(sizeof(kvi__row_entry) % 16 == 0, "staged rows stay 16-byte aligned");

/* The slot's bytes staged since it was acquired: entries from its start, rows from its end. */
static size_t stage_in_use(const kvi_store *s) {
  return (size_t)s->emb.stage_ent * sizeof(kvi__row_entry) + s->emb.stage_top;
}

/* Promises `bytes` of the pinned staging ring to the current call. */
static kvi_status stage_reserve(kvi_store *s, size_t bytes, const char *fn) {
  if (stage_in_use(s) + s->emb.stage_reserved + bytes <= s->emb.stage_cap) {
    s->emb.stage_reserved += bytes;
    return KVI_OK;
  }
  const size_t want = s->emb.stage_reserved + bytes;
  size_t cap = s->emb.stage_cap;
  if (want > cap) {
    if (want > UINT32_MAX / 2)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%zu bytes of embedding staging in one call (at most %u)", want,
                       UINT32_MAX / 2);
    cap = (size_t)1 << 20;
    if (cap < 2 * want) cap = 2 * want; /* more than twice the old slot: the ring grows to exactly this */
  }
  kvi__emb_flush(s); /* nothing is staged between calls; if it were, it would go first */
  kvi__ring_slot *sl;
  /* waits for the launches that read the slot; grows it */
  kvi_status st = kvi__ring_acquire(&s->emb.stage, cap, NULL, &sl, fn);
  if (st) return st;
  s->emb.stage_ent = s->emb.stage_sent = 0;
  s->emb.stage_top = 0;
  s->emb.stage_cap = cap;
  s->emb.stage_reserved += bytes;
  return KVI_OK;
}

kvi_status kvi__emb_reserve_rows(kvi_store *s, uint64_t tenant_id, size_t n, int32_t tokens, const char *fn) {
  if (s->emb_dim == 0 || n == 0) return KVI_OK;
  if (s->emb.err) return emb_failed(s, fn);
  tenant *t = kvi__map_get(&s->index.tenants, tenant_id, 0);
  kvi_status st;
  if (!t) {
    if ((st = kvi__map_reserve(&s->index.tenants, 1, fn))) return st;
    if (!(t = calloc(1, sizeof *t))) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a tenant");
    t->id = tenant_id;
    kvi__map_put(&s->index.tenants, tenant_id, 0, t); /* empty until commit; kvi__emb_unreserve_rows drops it */
  }
  /* a directory row: the token count, then the page ids */
  const int32_t stride = s->emb.dir_on ? 1 + (int32_t)pages_for(s, tokens) : 0;
  if ((t->nrows + t->pending + n > t->cap || stride > t->dir_stride) &&
      (st = emb_grow(s, t, t->nrows + t->pending + n, stride, fn)))
    return st;
  if (s->backend == KVI_BACKEND_CUDA && (st = stage_reserve(s, n * stage_fact_bytes(s, tokens), fn))) return st;
  t->pending += n;
  return KVI_OK;
}

void kvi__emb_unreserve_rows(kvi_store *s, uint64_t tenant_id) {
  if (s->emb_dim == 0) return;
  s->emb.stage_reserved = 0;
  tenant *t = kvi__map_get(&s->index.tenants, tenant_id, 0);
  if (!t) return;
  t->pending = 0;
  if (t->count == 0) {
    kvi__map_del(&s->index.tenants, tenant_id, 0);
    kvi__emb_free(s, t, true);
    free(t);
  }
}

void kvi__emb_flush(kvi_store *s) {
  if (s->emb.stage_sent == s->emb.stage_ent) return;
  kvi__ring_slot *sl = &s->emb.stage.slot[0];
  kvi__emb_rows_args a;
  a.entries = (const kvi__row_entry *)sl->host + s->emb.stage_sent;
  a.src = sl->host;
  a.n = (int32_t)(s->emb.stage_ent - s->emb.stage_sent);
  s->emb.stage_sent = s->emb.stage_ent;
#ifdef KVI_HAVE_CUDA
  const int err = kvi__cuda_emb_rows_set(&a, s->emb.stream);
  kvi_status st = err ? kvi__cuda_error(err, emb_fn, "embedding rows kernel launch") : KVI_OK;
#else
  (void)a;
  kvi_status st = kvi__fail(KVI_ERR_NOT_BUILT, emb_fn, "libkvinject was built without CUDA");
#endif
  if (st == KVI_OK) st = kvi__ring_record(sl, s->emb.stream, emb_fn); /* the slot's reuse waits */
  if (st == KVI_OK) st = emb_publish(s);
  emb_latch(s, st);
}

/* Stages f's row r of t on a CUDA store: the embedding e, its id and
 * (emb.dir_on) its directory row, written by the next kvi__emb_flush. */
static void emb_stage_row(kvi_store *s, tenant *t, const fact *f, size_t r, const float *e) {
  const size_t need = stage_fact_bytes(s, f->tokens), rb = row_bytes(s);
  s->emb.stage_reserved = s->emb.stage_reserved > need ? s->emb.stage_reserved - need : 0;
  if (stage_in_use(s) + need > s->emb.stage_cap) { /* rows were not reserved: a bug */
    emb_latch(s, kvi__fail(KVI_ERR_INTERNAL, emb_fn, "fact %llu committed without reserved staging",
                           (unsigned long long)f->id));
    return;
  }
  kvi__ring_slot *sl = &s->emb.stage.slot[0];
  kvi__row_entry *en = (kvi__row_entry *)sl->host + s->emb.stage_ent++;
  s->emb.stage_top += need - sizeof *en;
  char *row = sl->host + s->emb.stage_cap - s->emb.stage_top;
  memset(row, 0, rb); /* the padding elements */
  kvi__convert(row, s->emb.dtype, e, KVI_DTYPE_FP32, s->emb_dim);
  en->emb = (char *)t->emb + r * rb;
  en->ids = t->ids + r;
  en->id = f->id;
  en->emb_src = (uint32_t)(row - sl->host);
  en->emb_bytes = (uint32_t)rb;
  en->dir = NULL;
  en->dir_src = en->dir_words = 0;
  if (s->emb.dir_on) { /* the token count, then the page ids */
    uint32_t *w = (uint32_t *)(row + rb);
    w[0] = (uint32_t)f->tokens;
    memcpy(w + 1, f->pages, (size_t)f->npages * sizeof *w);
    en->dir = t->dir + r * (size_t)t->dir_stride;
    en->dir_src = (uint32_t)((char *)w - sl->host);
    en->dir_words = 1 + f->npages;
  }
}

void kvi__emb_append(kvi_store *s, tenant *t, fact *f, const float *e, size_t reuse) {
  if (t->pending == 0 || (reuse == SIZE_MAX && t->nrows >= t->cap)) { /* rows were not reserved: a bug */
    f->row = SIZE_MAX;
    emb_latch(s, kvi__fail(KVI_ERR_INTERNAL, emb_fn, "fact %llu committed without a reserved embedding row",
                           (unsigned long long)f->id));
    return;
  }
  t->pending--;
  const size_t r = reuse != SIZE_MAX ? reuse : t->nrows++, rb = row_bytes(s);
  t->rows[r] = f;
  f->row = r;
  if (s->backend == KVI_BACKEND_CPU) kvi__convert((char *)t->emb + r * rb, s->emb.dtype, e, KVI_DTYPE_FP32, s->emb_dim);
  else emb_stage_row(s, t, f, r, e);
}

void kvi__emb_skip_row(kvi_store *s, tenant *t, int32_t tokens) {
  t->pending--;
  const size_t b = s->backend == KVI_BACKEND_CUDA ? stage_fact_bytes(s, tokens) : 0;
  s->emb.stage_reserved = s->emb.stage_reserved > b ? s->emb.stage_reserved - b : 0;
}

void kvi__emb_remove(kvi_store *s, tenant *t, fact *f) {
  const size_t r = f->row;
  if (r == SIZE_MAX) return; /* a fact without a row: its embedding is held by another rank */
  const size_t last = --t->nrows;
  if (r != last) {
    const size_t rb = row_bytes(s);
    fact *m = t->rows[last];
    t->rows[r] = m;
    m->row = r;
    if (s->backend == KVI_BACKEND_CPU) {
      memcpy((char *)t->emb + r * rb, (char *)t->emb + last * rb, rb);
    } else {
      kvi__emb_flush(s); /* the last row may be staged */
      kvi_status st = kvi__cuda_d2d((char *)t->emb + r * rb, (char *)t->emb + last * rb, rb, s->emb.stream, emb_fn);
      if (st == KVI_OK) st = kvi__cuda_d2d(t->ids + r, t->ids + last, sizeof(uint64_t), s->emb.stream, emb_fn);
      if (st == KVI_OK && t->dir)
        st = kvi__cuda_d2d(t->dir + r * (size_t)t->dir_stride, t->dir + last * (size_t)t->dir_stride,
                           (size_t)t->dir_stride * sizeof(uint32_t), s->emb.stream, emb_fn);
      if (st == KVI_OK) st = emb_publish(s);
      emb_latch(s, st);
    }
  }
  t->rows[last] = NULL;
}

/* ---- reads ------------------------------------------------------------------- */

kvi_status kvi__store_get_embedding(const kvi_store *store, uint64_t tenant_id, uint64_t fact_id, float *out,
                                    const char *fn) {
  if (!store || !out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", store ? "out" : "store");
  if (store->emb_dim == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store was created with embedding_dim 0");
  kvi_store *s = (kvi_store *)store; /* a CUDA store waits on its embedding stream */
  const size_t rb = row_bytes(s);
  void *tmp = s->backend == KVI_BACKEND_CUDA ? malloc(rb) : NULL;
  if (s->backend == KVI_BACKEND_CUDA && !tmp) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", rb);
  kvi_status st = KVI_OK;
  kvi__store_lock(s);
  const fact *f = kvi__map_get(&s->index.facts, tenant_id, fact_id);
  if (!f) {
    st = kvi__store_not_found(fn, tenant_id, fact_id);
  } else if (f->row == SIZE_MAX && s->shard.emb_sharded) {
    st = kvi__fail(KVI_ERR_NOT_FOUND, fn, "the embedding of fact %llu of tenant %llu is kept by rank %d, not this rank (%d)",
                   (unsigned long long)fact_id, (unsigned long long)tenant_id,
                   (int)kvi__emb_rank(tenant_id, fact_id, s->shard.size), (int)s->shard.rank);
  } else if (f->row == SIZE_MAX) {
    st = kvi__fail(KVI_ERR_INTERNAL, fn, "fact %llu has no embedding row", (unsigned long long)fact_id);
  } else if (s->backend == KVI_BACKEND_CPU) {
    kvi__convert(out, KVI_DTYPE_FP32, (const char *)f->owner->emb + f->row * rb, s->emb.dtype, s->emb_dim);
  } else if (s->emb.err) {
    st = emb_failed(s, fn);
  } else {
    st = kvi__cuda_d2h(tmp, (const char *)f->owner->emb + f->row * rb, rb, s->emb.stream, fn);
    if (st == KVI_OK) st = kvi__cuda_sync(s->emb.stream, fn);
    if (st == KVI_OK) kvi__convert(out, KVI_DTYPE_FP32, tmp, s->emb.dtype, s->emb_dim);
  }
  kvi__store_unlock(s);
  free(tmp);
  return st;
}

/* for persist (snapshot.c, journal.c), the lock held: the row as kept, in fp32 (exact) */
kvi_status kvi__store_fact_embedding(const kvi_store *s, const struct fact *f, float *out, const char *fn) {
  const size_t rb = row_bytes(s);
  const char *row = (const char *)f->owner->emb + f->row * rb;
  if (s->backend == KVI_BACKEND_CPU) {
    kvi__convert(out, KVI_DTYPE_FP32, row, s->emb.dtype, s->emb_dim);
    return KVI_OK;
  }
  if (s->emb.err) return emb_failed(s, fn);
  void *tmp = malloc(rb);
  if (!tmp) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", rb);
  kvi_status st = kvi__cuda_d2h(tmp, row, rb, s->emb.stream, fn);
  if (st == KVI_OK) st = kvi__cuda_sync(s->emb.stream, fn);
  if (st == KVI_OK) kvi__convert(out, KVI_DTYPE_FP32, tmp, s->emb.dtype, s->emb_dim);
  free(tmp);
  return st;
}

/* The rank of a tensor-parallel group that keeps a fact's embedding (a
 * store with sharded embeddings): a fixed hash of its key. */
int32_t kvi__emb_rank(uint64_t tenant, uint64_t fact_id, int32_t size) {
  return (int32_t)(kvi__mix64(kvi__mix64(tenant) ^ fact_id) % (uint64_t)size);
}

int32_t kvi__store_embedding_rank(uint64_t tenant, uint64_t fact_id, int32_t tp_size) {
  return tp_size < 1 ? -1 : kvi__emb_rank(tenant, fact_id, tp_size);
}
