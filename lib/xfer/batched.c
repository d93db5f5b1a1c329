/*
 * The batched forms of the calls, flat arrays in place of one struct per
 * request: kvi_encode_batched (its captures built and passed to
 * kvi__encode_captures) and kvi_inject_batched (its requests passed to
 * kvi__inject_locked, or with device fact ids looked up and planned on the
 * device). The row strides of their 2-D arrays are checked first.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "xfer/transfer.h"

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

/* Refuses a row stride (elements of es bytes) under which `rows` rows of
 * `len` elements pass the largest object (PTRDIFF_MAX bytes): row r is at
 * base + r * stride elements, and a product that wraps lands anywhere (a
 * block_table_stride of 2^62 int32 entries put row 1 on row 0). Past this
 * check (rows - 1) * stride * es, and so every row's offset in bytes, fits
 * in size_t. One row reads no stride. */
static kvi_status check_rows(int32_t rows, int64_t stride, int64_t len, size_t es, const char *field, const char *fn) {
  int64_t last, bytes;
  if (rows > 1 && (__builtin_mul_overflow((int64_t)rows - 1, stride, &last) || __builtin_add_overflow(last, len, &last) ||
                   __builtin_mul_overflow(last, (int64_t)es, &bytes) || (uint64_t)bytes > (uint64_t)PTRDIFF_MAX))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "batch->%s is %lld: %d rows of %lld elements of %zu bytes at that stride pass the largest object "
                     "(PTRDIFF_MAX bytes)",
                     field, (long long)stride, (int)rows, (long long)len, es);
  return KVI_OK;
}

/* The checks both batched calls make of their positions and block-table
 * form (`rows` tables). */
static kvi_status check_batch_form(int32_t position_bits, const void *positions, const void *start_positions,
                                   int64_t num_positions, int64_t stride, int32_t len, const int32_t *offsets,
                                   int32_t rows, const char *fn) {
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
  return stride > 0 ? check_rows(rows, stride, len, sizeof(int32_t), "block_table_stride", fn) : KVI_OK;
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
                              b.block_table_len, b.block_table_offsets, n, fn)))
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
  if (!b.context_ids != !b.context_offsets)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->%s is NULL and batch->%s is not (give both or neither)",
                     b.context_ids ? "context_offsets" : "context_ids", b.context_ids ? "context_ids" : "context_offsets");
  if (x->cuda && b.context_ids &&
      ((st = kvi__check_memory(b.context_ids, KVI_MEMORY_HOST, true, x->store->device, fn, "context_ids")) ||
       (st = kvi__check_memory(b.context_offsets, KVI_MEMORY_HOST, true, x->store->device, fn, "context_offsets"))))
    return st;
  if (b.context_offsets && (st = check_offsets(b.context_offsets, n, "batch->context_offsets", fn))) return st;
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
  if (b.embeddings && (st = check_rows(n, erow, x->store->emb_dim, es, "embedding_stride", fn))) return st;
  kvi_capture *caps = malloc((size_t)n * sizeof *caps);
  if (!caps) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d captures", (int)n);
  /* int64 positions stay where they are: kvi__encode_captures checks them
   * (one past INT32_MAX is out of range) after the captures, and narrows
   * them as it plans */
  const bool pos64 = b.positions && b.position_bits == 64;
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
      c->positions = pos64 ? (const int32_t *)(const void *)((const int64_t *)b.positions + at)
                           : (const int32_t *)b.positions + at;
    } else if (b.start_positions) {
      const int64_t sp = b.position_bits == 64 ? ((const int64_t *)b.start_positions)[i]
                                               : ((const int32_t *)b.start_positions)[i];
      if (sp < 0 || sp > INT32_MAX)
        st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capture %d: start position %lld is outside 0..%d", (int)i,
                       (long long)sp, (int)x->max_pos - 1);
      c->start_position = (int32_t)sp;
    }
    c->token_ids = b.token_ids ? b.token_ids + at : NULL;
    if (b.context_ids) {
      c->context_ids = b.context_ids + b.context_offsets[i];
      c->num_context_ids = b.context_offsets[i + 1] - b.context_offsets[i];
    }
    if (c->num_tokens > 0) at += c->num_tokens;
    c->flags = b.flags;
    if (b.embeddings) {
      c->embedding = (const char *)b.embeddings + (size_t)i * (size_t)erow * es;
      c->embedding_dtype = b.embedding_dtype;
      c->embedding_memory = b.embedding_memory;
    }
  }
  if (st == KVI_OK) st = kvi__encode_captures(encoder, caps, n, pos64, stream, fn);
  free(caps);
  return st;
}

static bool memory_valid(kvi_memory m) { return m == KVI_MEMORY_HOST || m == KVI_MEMORY_DEVICE; }

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
      total += kvi__align_up(bytes[i]);
    }
  char *h = st == KVI_OK ? malloc(total ? total : 1) : NULL;
  if (st == KVI_OK && !h) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes of index arrays", total);
  if (st) return st;
  size_t at = 0;
  for (int i = 0; i < 6 && st == KVI_OK; i++)
    if (*arr[i]) {
      st = kvi__cuda_d2h(h + at, *arr[i], bytes[i], stream, fn);
      *arr[i] = h + at;
      at += kvi__align_up(bytes[i]);
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
 * host, both locks held): each request's reserve checked on the host, then
 * on `stream` the retrieve-plan kernel (which looks the ids up) and one
 * injection launch, ordered after the last change to the store's embeddings
 * and before the next. */
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
    if ((st = kvi__store_tenant_fresh(d[r].t, r, fn))) break; /* the ids are on the device: any fact may be named */
    d[r].nres = d[r].t && d[r].t->count > 0 ? q.num_facts : 0;
    d[r].best_last = false;
    d[r].j.tokens = (int64_t)d[r].nres * (d[r].t ? d[r].t->max_tokens : 0);
    if (d[r].j.start_position < 0 || d[r].j.start_position > INT32_MAX)
      st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "request %d: start position %lld is outside 0..%d", (int)r,
                     (long long)d[r].j.start_position, (int)x->max_pos - 1);
    else
      st = kvi__check_request_job(x, &d[r].j, r, fn);
    d[r].start_position = (int32_t)d[r].j.start_position;
  }
  /* after the queries: the id lookups, their rows (n x kmax), counts and tokens */
  const size_t o_look = 0, o_rows = kvi__align_up((size_t)n * sizeof(kvi__idreq)),
               o_counts = o_rows + kvi__align_up((size_t)n * kmax * sizeof(int32_t)),
               o_tokens = o_counts + kvi__align_up((size_t)n * sizeof(int32_t)),
               extra = o_tokens + (size_t)n * sizeof(int32_t);
  plan p;
  memset(&p, 0, sizeof p);
  if (st == KVI_OK) st = kvi__plan_on_device(x, &p, d, n, extra, fn);
  if (st == KVI_OK) {
    const size_t o_mine = p.o_ext + kvi__align_up((size_t)n * sizeof(kvi__rquery));
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
    st = kvi__emb_read_begin(s, stream, fn);
    const bool enqueued = st == KVI_OK;
    if (st == KVI_OK) /* the lookups travel with the plan's host-built part, written on the device after them */
      st = kvi__plan_and_inject(x, &p, o_mine + o_rows, n, kmax, (int32_t *)(dev + o_mine + o_rows),
                                NULL, (const kvi__idreq *)(dev + o_mine + o_look), b->fact_ids,
                                (int32_t *)(dev + o_mine + o_counts),
                                b->out_tokens ? b->out_tokens : (int32_t *)(dev + o_mine + o_tokens), lb, le,
                                stream, fn);
    if (enqueued) { /* later changes to the tenants' rows and directories wait for what was enqueued */
      kvi_status s1 = kvi__cuda_event_record(x->emb_read, stream, fn);
      if (s1 == KVI_OK) s1 = kvi__emb_read_end(s, x->emb_read, fn);
      if (st == KVI_OK) st = s1;
    }
  }
  kvi__plan_free(x, &p);
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
  if ((st = kvi__read_inject_options(x, opts, &lb, &le, &hp, fn))) return st;
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
                              b.block_table_len, b.block_table_offsets, n, fn)))
    return st;
  const bool dev_ids = b.fact_ids_memory == KVI_MEMORY_DEVICE;
  if (dev_ids && (!s->emb.dir_on || s->shard.emb_sharded))
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn,
                     "device fact ids are looked up on the device only on a CUDA store with embeddings, without a "
                     "host tier and without sharded embeddings");
  if (dev_ids && b.positions)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "per-token positions with device fact ids (give start_positions)");
  if (dev_ids && b.expect_token_ids)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "batch->expect_token_ids with device fact ids (unknown on the host)");
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
    kvi__lock_both(x);
    st = batch_on_device(x, &b, lb, le, stream, fn);
    kvi__unlock_both(x);
    goto out;
  }
  if (!(rq = malloc((size_t)n * sizeof *rq))) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d requests", (int)n);
    goto out;
  }
  for (int32_t r = 0; r < n; r++) batch_request(&b, r, &rq[r]);
  if ((st = kvi__batch_expect(x, rq, n, b.expect_token_ids, b.expect_token_offsets, fn))) goto out;
  const flat_pos fp = {b.positions, b.position_bits == 64, b.num_positions};
  kvi__lock_both(x);
  st = kvi__inject_locked(x, rq, n, &fp, lb, le, hp, NULL, b.out_tokens, stream, fn);
  kvi__unlock_both(x);
out:
  free(rq);
  free(keep);
  return st;
}
