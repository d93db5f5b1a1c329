/*
 * Store files: the loader (kvi_store_load). It checks the header against
 * the model and the options, then every entry and record before it applies
 * them to a new store through the store's own calls.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Torn tails. A journaled call writes its entry and flushes it before it
 * returns, under the store's lock, so at most the last entry of a file can
 * be incomplete after a crash. The loader accepts a damaged entry as a torn
 * tail only when nothing valid follows it: a bad body that ends exactly at the
 * end of the file, or a bad entry header after which no valid entry header
 * can be found. Anything else is corruption and refuses the file.
 */
#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "persist/internal.h"
#include "tp/tp.h"

#define SCAN_CHUNK (1u << 20)

kvi_status kvi__persist_corrupt(const loader *ld, uint64_t off, const char *fmt, ...) {
  char msg[320];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return kvi__fail(KVI_ERR_CORRUPT, ld->fn, "%s: offset %llu: %s", ld->path, (unsigned long long)off, msg);
}

kvi_status kvi__persist_rd(const loader *ld, uint64_t off, void *buf, size_t n) {
  unsigned char *p = buf;
  while (n > 0) {
    const ssize_t r = pread(ld->fd, p, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return kvi__persist_io_fail(ld->fn, errno, "reading", ld->path);
    if (r == 0)
      return kvi__fail(KVI_ERR_IO, ld->fn, "reading %s: the file became shorter while it was read", ld->path);
    p += r, off += (uint64_t)r, n -= (size_t)r;
  }
  return KVI_OK;
}

typedef struct entry {
  uint32_t kind, count, body_crc;
  uint64_t seq, body;
} entry;

/* Decodes the entry header at `off`. Returns false with *why set when it is
 * not a well-formed header of the expected entry (damage); *hard means the
 * header checksum held, so the damage is not a torn write. */
static bool entry_ok(const loader *ld, const unsigned char *h, uint64_t off, uint64_t want_seq, entry *e, char *why,
                     size_t why_len, bool *hard) {
  *hard = false;
  if (get32(h) != ENTRY_MAGIC) {
    snprintf(why, why_len, "no entry magic");
    return false;
  }
  const uint32_t crc = kvi__crc32c(0, h, 44);
  if (!CRC_OK(get32(h + 44), crc)) {
    snprintf(why, why_len, "entry header checksum mismatch (stored 0x%08x, computed 0x%08x)", get32(h + 44), crc);
    return false;
  }
  *hard = true;
  e->kind = get32(h + 4);
  e->seq = get64(h + 16);
  e->body = get64(h + 24);
  e->count = get32(h + 32);
  e->body_crc = get32(h + 40);
  const uint64_t room = ld->size - off - ENTRY_HDR;
  if (get64(h + 8) != ld->file_id) snprintf(why, why_len, "entry of another file (id 0x%016llx)", (unsigned long long)get64(h + 8));
  else if (e->seq != want_seq)
    snprintf(why, why_len, "entry number %llu where %llu was expected", (unsigned long long)e->seq,
             (unsigned long long)want_seq);
  else if (e->kind != KIND_FACTS && e->kind != KIND_END) snprintf(why, why_len, "unknown entry kind %u", e->kind);
  else if (get32(h + 36) != 0) snprintf(why, why_len, "unknown entry flags 0x%x", get32(h + 36));
  else if (e->kind == KIND_END && (e->body != END_BODY || e->count != 0))
    snprintf(why, why_len, "end entry of %llu bytes and %u records", (unsigned long long)e->body, e->count);
  else if (e->kind == KIND_FACTS && (e->count == 0 || e->count > e->body / REC_HDR))
    snprintf(why, why_len, "%u records in a %llu-byte entry", e->count, (unsigned long long)e->body);
  else if (e->body > room) {
    /* a complete header whose body runs past the end: torn, when it is the last entry */
    *hard = false;
    snprintf(why, why_len, "entry body of %llu bytes, %llu bytes left in the file", (unsigned long long)e->body,
             (unsigned long long)room);
  } else {
    return true;
  }
  return false;
}

/* A damaged entry at `off` in the log: a torn tail if no entry header of this
 * file with a later number follows it anywhere; else corruption. */
static kvi_status check_tail(const loader *ld, uint64_t off, uint64_t want_seq, const char *why) {
  unsigned char *buf = malloc(SCAN_CHUNK + ENTRY_HDR);
  if (!buf) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating a scan buffer");
  kvi_status st = KVI_OK;
  for (uint64_t at = off + 1; at + ENTRY_HDR <= ld->size && st == KVI_OK; at += SCAN_CHUNK) {
    const uint64_t left = ld->size - at;
    const size_t n = (size_t)(left < SCAN_CHUNK + ENTRY_HDR - 1 ? left : SCAN_CHUNK + ENTRY_HDR - 1);
    if ((st = kvi__persist_rd(ld, at, buf, n))) break;
    for (size_t i = 0; i + ENTRY_HDR <= n && i < SCAN_CHUNK; i++) {
      const unsigned char *h = buf + i;
      if (get32(h) != ENTRY_MAGIC || get64(h + 8) != ld->file_id || get64(h + 16) < want_seq) continue;
      if (!CRC_OK(get32(h + 44), kvi__crc32c(0, h, 44))) continue;
      st = kvi__persist_corrupt(ld, off, "damaged entry (%s), followed by a valid entry at offset %llu", why,
                   (unsigned long long)(at + i));
      break;
    }
  }
  free(buf);
  return st;
}

typedef struct rec {
  uint32_t op;
  bool ids; /* the payload ends with the fact's token ids (then its context, with ctx) */
  bool ctx; /* the payload ends with the fact's context section */
  bool keep; /* a removal that made nothing stale */
  int32_t nctx;
  bool stale;
  const unsigned char *ctx_ids; /* nctx u64 ids */
  int32_t tokens;
  uint64_t tenant, id, payload;
  uint64_t off; /* the record's offset in the file */
  const unsigned char *data;
} rec;

/* A PUT record's scales: fp8 scales are what kvi__fp8_scale can give,
 * 2^-126 .. FLT_MAX / 448, and (version 4 on) its key offsets finite fp16;
 * q4 words what kvi__q4_params can give: a finite scale >= 0 (fp16 bits
 * below the sign) and a finite minimum. */
static kvi_status check_scales(const loader *ld, const rec *r, uint64_t off) {
  const uint64_t npages = ld->P > 0 ? ((uint64_t)r->tokens + (uint64_t)ld->P - 1u) / (uint64_t)ld->P : 0u;
  const unsigned char *sc = r->data + (size_t)ld->E * 4u + (size_t)r->tokens * (size_t)ld->token_bytes;
  const bool fp8 = ld->dtype == KVI_DTYPE_FP8_E4M3;
  const uint64_t nsc = fp8 ? (uint64_t)ld->L * 2u * (uint64_t)ld->H : ld->page_scale / 4u; /* per page */
  const uint64_t noff = fp8 && ld->version >= FORMAT_VERSION_FP8_OFFSETS ? (uint64_t)ld->L * ld->H * ld->D : 0u;
  for (uint64_t p = 0; p < npages; p++) {
    const unsigned char *pg = sc + (size_t)(p * ld->page_scale);
    for (uint64_t i = 0; i < nsc; i++) {
      float x;
      uint32_t w;
      memcpy(&x, pg + 4 * (size_t)i, 4);
      memcpy(&w, pg + 4 * (size_t)i, 4);
      if (fp8 ? !(x >= KVI__FP8_SCALE_MIN && x <= FLT_MAX / KVI__FP8_STORE_MAX)
              : (w & 0xffffu) > 0x7bffu || ((w >> 16) & 0x7fffu) > 0x7bffu)
        return kvi__persist_corrupt(ld, off, "%s scale %llu of fact %llu is %s 0x%08x", kvi__dtype_name(ld->dtype),
                                    (unsigned long long)(p * nsc + i), (unsigned long long)r->id, "out of range:",
                                    (unsigned)w);
    }
    const unsigned char *ko = pg + (size_t)nsc * 4u; /* the key offsets follow the scales */
    for (uint64_t i = 0; i < noff; i++) {
      const unsigned h = (unsigned)ko[2 * i] | (unsigned)ko[2 * i + 1] << 8;
      if ((h & 0x7fffu) > 0x7bffu)
        return kvi__persist_corrupt(ld, off, "fp8 key offset %llu of fact %llu is not finite: 0x%04x",
                                    (unsigned long long)(p * noff + i), (unsigned long long)r->id, h);
    }
  }
  return KVI_OK;
}

/* Decodes and checks the record at body[*at]; advances *at. */
static kvi_status next_record(const loader *ld, const unsigned char *body, uint64_t len, uint64_t *at, uint64_t eoff,
                              rec *r) {
  const uint64_t off = eoff + ENTRY_HDR + *at;
  r->off = off;
  if (len - *at < REC_HDR) return kvi__persist_corrupt(ld, off, "record header past the end of its entry");
  const unsigned char *p = body + *at;
  r->op = get32(p);
  const uint32_t put_bits = ld->version >= 3 ? REC_TOKEN_IDS | REC_CONTEXT : ld->version >= 2 ? REC_TOKEN_IDS : 0u;
  r->ids = r->ctx = r->keep = false;
  r->nctx = 0;
  r->stale = false;
  r->ctx_ids = NULL;
  if ((r->op & 0xffffu) == OP_PUT && !(r->op & ~(0xffffu | put_bits))) { /* else an unknown type below */
    r->ids = (r->op & REC_TOKEN_IDS) != 0;
    r->ctx = (r->op & REC_CONTEXT) != 0;
    r->op = OP_PUT;
  } else if (ld->version >= 3 && r->op == (OP_REMOVE | REC_KEEP_DEPENDENTS)) {
    r->keep = true;
    r->op = OP_REMOVE;
  }
  r->tokens = (int32_t)get32(p + 4);
  r->tenant = get64(p + 8);
  r->id = get64(p + 16);
  r->payload = get64(p + 24);
  r->data = p + REC_HDR;
  const uint64_t room = len - *at - REC_HDR;
  if (r->op == OP_REMOVE) {
    if (r->tokens != 0 || r->payload != 0)
      return kvi__persist_corrupt(ld, off, "removal record with %d tokens and %llu payload bytes", (int)r->tokens,
                     (unsigned long long)r->payload);
    *at += REC_HDR;
    return KVI_OK;
  }
  if (r->op != OP_PUT) return kvi__persist_corrupt(ld, off, "unknown record type %u", r->op);
  uint64_t want, groups; /* the scales' bytes, bounded before scale_bytes multiplies */
  if (r->tokens < 1 || __builtin_mul_overflow((uint64_t)r->tokens, ld->token_bytes, &want) ||
      __builtin_add_overflow(want, (uint64_t)ld->E * 4u, &want) ||
      __builtin_mul_overflow((uint64_t)r->tokens, ld->page_scale, &groups) ||
      __builtin_add_overflow(want, scale_bytes((uint64_t)r->tokens, ld->P, ld->page_scale), &want) ||
      __builtin_add_overflow(want, r->ids ? (uint64_t)r->tokens * 4u : 0u, &want))
    return kvi__persist_corrupt(ld, off, "fact record with %d tokens", (int)r->tokens);
  if (r->ctx) { /* the context section's count and flag, then its ids */
    if (want > room || room - want < 8u) return kvi__persist_corrupt(ld, off, "context section past the end of its entry");
    const uint32_t nc = get32(r->data + want), stale = get32(r->data + want + 4);
    if (nc < 1 || nc > (uint32_t)INT32_MAX || stale > 1u)
      return kvi__persist_corrupt(ld, off, "context section of %u ids with stale flag %u", nc, stale);
    r->nctx = (int32_t)nc;
    r->stale = stale != 0;
    r->ctx_ids = r->data + want + 8;
    want += 8u + 8u * (uint64_t)nc; /* nc < 2^31: cannot wrap after a bound by room below */
  }
  if (r->payload != want)
    return kvi__persist_corrupt(ld, off, "fact record of %d tokens with %llu payload bytes; the geometry needs %llu", (int)r->tokens,
                   (unsigned long long)r->payload, (unsigned long long)want);
  if (r->payload > room || pad8(r->payload) > room)
    return kvi__persist_corrupt(ld, off, "fact record of %llu bytes past the end of its entry", (unsigned long long)r->payload);
  for (uint64_t i = r->payload; i < pad8(r->payload); i++)
    if (r->data[i]) return kvi__persist_corrupt(ld, off, "non-zero padding after a fact record");
  for (int32_t i = 0; i < ld->E; i++) {
    float x;
    memcpy(&x, r->data + 4 * (size_t)i, 4);
    if (!isfinite(x)) return kvi__persist_corrupt(ld, off, "embedding[%d] of fact %llu is %g", (int)i, (unsigned long long)r->id, (double)x);
  }
  const kvi_status st = check_scales(ld, r, off);
  if (st) return st;
  *at += REC_HDR + pad8(r->payload);
  return KVI_OK;
}

/* A PUT record's parts as a host view of the store's dtype (k: its K
 * plane) and copies of what needs alignment or decoding: the embedding (emb,
 * E floats), the scales (quantized), the token ids and the context; NULL for
 * the parts the record lacks. Frees them all with rec_parts_free. */
typedef struct rec_parts {
  kvi_kv_view v;
  float *emb;
  unsigned char *scales;
  int32_t *ids;
  uint64_t *ctx;
} rec_parts;

static void rec_parts_free(rec_parts *p) {
  free(p->emb);
  free(p->scales);
  free(p->ids);
  free(p->ctx);
}

/* The page scales of an fp8 fact of `tokens` tokens from a file before
 * version 4 (scales alone) as this version keeps them (spage bytes a page):
 * the scales, then every key offset -0 (KVI__FP8_OFFSET_LEGACY:
 * fmaf(e4m3, scale, -0) is e4m3 * scale, the values these files held). */
static void legacy_fp8_scales(const loader *ld, unsigned char *out, const unsigned char *in, int32_t tokens,
                              uint64_t spage) {
  const uint64_t npages = ((uint64_t)tokens + (uint64_t)ld->P - 1u) / (uint64_t)ld->P;
  const uint64_t rel = ld->page_scale, noff = (uint64_t)ld->L * ld->H * ld->D;
  for (uint64_t p = 0; p < npages; p++) {
    unsigned char *o = out + (size_t)(p * spage);
    memcpy(o, in + (size_t)(p * ld->page_scale), (size_t)ld->page_scale);
    for (uint64_t i = 0; i < noff; i++) {
      const uint16_t h = KVI__FP8_OFFSET_LEGACY;
      memcpy(o + rel + 2 * (size_t)i, &h, 2);
    }
  }
}

static kvi_status rec_parts_get(const loader *ld, const rec *r, rec_parts *p) {
  memset(p, 0, sizeof *p);
  const unsigned char *k = r->data + (size_t)ld->E * 4u;
  const size_t plane = (size_t)r->tokens * (size_t)(ld->token_bytes / 2u);
  kvi__kv_view_contiguous(&p->v, KVI_MEMORY_HOST, ld->dtype, ld->L, r->tokens, ld->H, ld->D, (void *)k,
                          (void *)(k + plane));
  const size_t eb = (size_t)ld->E * 4u, sb = (size_t)scale_bytes((uint64_t)r->tokens, ld->P, ld->page_scale);
  /* fp8 pages of files before version 4 get the store's page scales: theirs, then key offsets of -0 */
  const uint64_t spage = ld->P > 0 ? kvi__page_scale_bytes(ld->dtype, ld->L, ld->H, ld->D, ld->P) : 0u;
  const size_t ssb = (size_t)scale_bytes((uint64_t)r->tokens, ld->P, spage);
  p->emb = ld->E ? malloc(eb) : NULL;
  p->scales = ld->P > 0 ? malloc(ssb) : NULL;
  p->ids = r->ids ? malloc((size_t)r->tokens * sizeof *p->ids) : NULL;
  p->ctx = r->nctx > 0 ? malloc((size_t)r->nctx * sizeof *p->ctx) : NULL;
  if ((ld->E && !p->emb) || (ld->P > 0 && !p->scales) || (r->ids && !p->ids) || (r->nctx > 0 && !p->ctx)) {
    rec_parts_free(p);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating %zu bytes", eb + sb + (size_t)r->tokens * 4u);
  }
  if (p->emb) memcpy(p->emb, r->data, eb);
  if (p->scales && spage == ld->page_scale) memcpy(p->scales, k + 2 * plane, sb); /* stored elements and scales as they were */
  else if (p->scales) legacy_fp8_scales(ld, p->scales, k + 2 * plane, r->tokens, spage);
  for (int32_t i = 0; p->ids && i < r->tokens; i++) p->ids[i] = (int32_t)get32(k + 2 * plane + sb + 4 * (size_t)i);
  for (int32_t i = 0; i < r->nctx; i++) p->ctx[i] = get64(r->ctx_ids + 8 * (size_t)i);
  return KVI_OK;
}

/* The checked form of a record's view (for a quantized store, checked as a
 * 2-byte view, a larger extent, then given its dtype back). */
static kvi_status rec_view(const kvi_store *s, const rec_parts *p, kvi_kv_view *v, const char *fn) {
  kvi_kv_view w = p->v;
  if (p->scales) w.dtype = KVI_DTYPE_BF16;
  kvi_status st = kvi__view_check(v, &w, &s->geom, false, fn);
  v->dtype = p->v.dtype;
  return st;
}

/* Stores one fact of a file (host view v: for a quantized store, the
 * stored elements with the pages' scales, kept as they are; emb: the embedding as it was
 * kept, or NULL) through a transaction of its own. */
static kvi_status load_fact(kvi_store *s, uint64_t tenant, uint64_t id, const kvi_kv_view *kv, const void *scales,
                            const float *emb, const int32_t *ids, const uint64_t *ctx, int32_t nctx, bool stale,
                            const char *fn) {
  kvi_kv_view v;
  const rec_parts rp = {*kv, NULL, (unsigned char *)scales, NULL, NULL};
  kvi_status st = rec_view(s, &rp, &v, fn);
  if (st) return st;
  float *e = NULL;
  if (emb && (st = kvi__store_kept_embedding(s, emb, &e, fn))) return st;
  if (!emb && s->emb_dim > 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the store keeps %d-element embeddings and the embedding is NULL",
                     (int)s->emb_dim);
  kvi__store_lock(s);
  kvi__txn t;
  st = kvi__txn_begin(&t, s, 1, KVI__PLACE_ANY, NULL, NULL, fn);
  if (st == KVI_OK) st = kvi__txn_add(&t, tenant, id, v.num_tokens, 0, e);
  else free(e);
  if (st == KVI_OK) st = kvi__txn_token_ids(&t, ids);
  if (st == KVI_OK) st = kvi__txn_context(&t, ctx, nctx, stale ? 1 : 0); /* as the file has it */
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  if (st == KVI_OK) st = kvi__store_write_pages(s, kvi__txn_pages(&t, 0), &v, scales, NULL, fn);
  st = st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
  kvi__store_unlock(s);
  return st;
}

/* A journal appends records of this version: an older file's header is
 * rewritten as this version's (what it holds reads the same), flushed. */
static kvi_status upgrade_header(const loader *ld) {
  const size_t hb = (size_t)HDR_BYTES(ld->L);
  unsigned char *h = malloc(hb);
  if (!h) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating a %zu-byte header", hb);
  kvi_status st = kvi__persist_rd(ld, 0, h, hb);
  if (st == KVI_OK) {
    put32(h + 8, FORMAT_VERSION);
    put32(h + hb - 4, kvi__crc32c(0, h, hb - 4));
    if (kvi__persist_pwrite_all(ld->fd, h, hb, 0) != 0 || fsync(ld->fd) != 0)
      st = kvi__persist_io_fail(ld->fn, errno, "rewriting the header of", ld->path);
  }
  free(h);
  return st;
}

/* A disk tier's tenant file, read by kvi__persist_index_tenant (the store's
 * lock held): each PUT record becomes a fact on disk only, its record's
 * offsets kept; removals apply as kvi_store_remove_ex's. */
static kvi_status index_apply(const loader *ld, const rec *r, bool in_log, uint64_t eoff) {
  kvi_store *s = ld->s;
  const char *fn = ld->fn;
  if (r->tenant != ld->tenant)
    return kvi__persist_corrupt(ld, eoff, "a record of tenant %llu in the file of tenant %llu", (unsigned long long)r->tenant,
                   (unsigned long long)ld->tenant);
  const bool exists = kvi__store_find(s, r->tenant, r->id) != NULL;
  if (r->op == OP_REMOVE) {
    if (!in_log) return kvi__persist_corrupt(ld, eoff, "a removal record inside the snapshot");
    if (!exists)
      return kvi__persist_corrupt(ld, eoff, "removal of fact %llu of tenant %llu, which is not stored", (unsigned long long)r->id,
                     (unsigned long long)r->tenant);
    return kvi__store_unindex(s, r->tenant, r->id, r->keep ? KVI_REMOVE_KEEP_DEPENDENTS : 0u, fn);
  }
  if (exists && !in_log)
    return kvi__persist_corrupt(ld, eoff, "fact %llu of tenant %llu appears twice in the snapshot", (unsigned long long)r->id,
                   (unsigned long long)r->tenant);
  kvi_status st;
  if (exists && (st = kvi__store_unindex(s, r->tenant, r->id, KVI_REMOVE_KEEP_DEPENDENTS, fn))) return st;
  rec_parts p;
  if ((st = rec_parts_get(ld, r, &p))) return st;
  float *e = NULL;
  if (p.emb && (st = kvi__store_kept_embedding(s, p.emb, &e, fn))) {
    rec_parts_free(&p);
    return st;
  }
  kvi__txn t;
  st = kvi__txn_begin(&t, s, 1, KVI__PLACE_DISK, NULL, NULL, fn);
  if (st == KVI_OK) st = kvi__txn_add(&t, r->tenant, r->id, r->tokens, 0, e);
  else free(e);
  if (st == KVI_OK) st = kvi__txn_token_ids(&t, p.ids);
  if (st == KVI_OK) st = kvi__txn_context(&t, p.ctx, r->nctx, r->stale ? 1 : 0);
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  st = st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
  rec_parts_free(&p);
  fact *f = st == KVI_OK ? kvi__store_find(s, r->tenant, r->id) : NULL;
  if (f) f->disk_entry = eoff, f->disk_rec = r->off;
  return st;
}

/* Applies one checked record to the new store. */
static kvi_status apply(const loader *ld, const rec *r, bool in_log, uint64_t eoff) {
  if (ld->index_only) return index_apply(ld, r, in_log, eoff);
  const bool exists = kvi__store_find(ld->s, r->tenant, r->id) != NULL; /* the store is not shared yet */
  kvi_status st;
  if (r->op == OP_REMOVE) {
    if (!in_log) return kvi__persist_corrupt(ld, eoff, "a removal record inside the snapshot");
    if (!exists)
      return kvi__persist_corrupt(ld, eoff, "removal of fact %llu of tenant %llu, which is not stored", (unsigned long long)r->id,
                     (unsigned long long)r->tenant);
    return kvi__store_remove(ld->s, r->tenant, r->id, r->keep ? KVI_REMOVE_KEEP_DEPENDENTS : 0u, ld->fn);
  }
  if (exists) {
    if (!in_log)
      return kvi__persist_corrupt(ld, eoff, "fact %llu of tenant %llu appears twice in the snapshot", (unsigned long long)r->id,
                     (unsigned long long)r->tenant);
    /* a replacement: room for one copy */
    if ((st = kvi__store_remove(ld->s, r->tenant, r->id, KVI_REMOVE_KEEP_DEPENDENTS, ld->fn))) return st;
  }
  rec_parts p; /* the embedding copied to aligned memory, as the scales */
  if ((st = rec_parts_get(ld, r, &p))) return st;
  st = load_fact(ld->s, r->tenant, r->id, &p.v, p.scales, p.emb, p.ids, p.ctx, r->nctx, r->stale, ld->fn);
  rec_parts_free(&p);
  if (st) {
    char msg[400];
    snprintf(msg, sizeof msg, "%s", kvi__last_error());
    return kvi__fail(st, ld->fn, "%s: loading fact %llu of tenant %llu (%d tokens): %s%s", ld->path,
                     (unsigned long long)r->id, (unsigned long long)r->tenant, (int)r->tokens, msg,
                     st == KVI_ERR_CAPACITY ? "; give the store a larger opts->budget_bytes" : "");
  }
  return KVI_OK;
}

/* Reads every entry into ld->s; *valid_end receives the end of the last
 * complete entry (the file size unless a torn tail was ignored), *seq the
 * number of the next entry. */
static kvi_status read_entries(loader *ld, uint64_t start, uint64_t *valid_end, uint64_t *next_seq) {
  uint64_t pos = start, seq = 0, facts = 0, payload_total = 0;
  uint32_t chain = 0;
  bool in_log = false;
  kvi_status st = KVI_OK;
  unsigned char *body = NULL;
  for (;;) {
    if (pos == ld->size) {
      if (!in_log) st = kvi__persist_corrupt(ld, pos, "the file ends before the snapshot's end entry (truncated)");
      break;
    }
    unsigned char h[ENTRY_HDR];
    entry e;
    char why[160];
    bool hard = false, ok = false;
    if (ld->size - pos < ENTRY_HDR) {
      snprintf(why, sizeof why, "%llu bytes left, an entry header needs %d", (unsigned long long)(ld->size - pos),
               ENTRY_HDR);
    } else {
      if ((st = kvi__persist_rd(ld, pos, h, ENTRY_HDR))) break;
      ok = entry_ok(ld, h, pos, seq, &e, why, sizeof why, &hard);
    }
    if (!ok) {
      /* in the log, a torn final entry is ignored (check_tail leaves st KVI_OK) */
      if (!in_log || hard) st = kvi__persist_corrupt(ld, pos, "%s%s", why, in_log ? "" : " (inside the snapshot)");
      else st = check_tail(ld, pos, seq, why);
      break;
    }
    free(body);
    body = malloc(e.body ? (size_t)e.body : 1);
    if (!body) {
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating a %llu-byte entry", (unsigned long long)e.body);
      break;
    }
    if ((st = kvi__persist_rd(ld, pos + ENTRY_HDR, body, (size_t)e.body))) break;
    const uint32_t crc = kvi__crc32c(0, body, (size_t)e.body);
    if (!CRC_OK(e.body_crc, crc)) {
      if (in_log && pos + ENTRY_HDR + e.body == ld->size) break; /* torn final entry */
      st = kvi__persist_corrupt(ld, pos, "entry %llu: body checksum mismatch (stored 0x%08x, computed 0x%08x)%s",
                   (unsigned long long)e.seq, e.body_crc, crc, in_log ? "" : " (inside the snapshot)");
      break;
    }
    if (e.kind == KIND_END) {
      if (in_log) {
        st = kvi__persist_corrupt(ld, pos, "a second end entry");
        break;
      }
      if (get64(body) != facts || get64(body + 8) != payload_total || !CRC_OK(get32(body + 16), chain) ||
          get32(body + 20) != 0) {
        st = kvi__persist_corrupt(ld, pos, "the end entry counts %llu facts of %llu bytes; the snapshot has %llu of %llu",
                     (unsigned long long)get64(body), (unsigned long long)get64(body + 8), (unsigned long long)facts,
                     (unsigned long long)payload_total);
        break;
      }
      in_log = true;
    } else {
      /* check every record of the entry before applying any: an entry is all or nothing */
      rec r;
      uint64_t at = 0;
      for (uint32_t i = 0; i < e.count && st == KVI_OK; i++) st = next_record(ld, body, e.body, &at, pos, &r);
      if (st == KVI_OK && at != e.body)
        st = kvi__persist_corrupt(ld, pos, "entry %llu has %llu bytes after its %u records", (unsigned long long)e.seq,
                     (unsigned long long)(e.body - at), e.count);
      at = 0;
      for (uint32_t i = 0; i < e.count && st == KVI_OK; i++) {
        next_record(ld, body, e.body, &at, pos, &r);
        if (!in_log) facts++, payload_total += r.payload;
        st = apply(ld, &r, in_log, pos);
      }
      if (st) break;
      if (!in_log) {
        unsigned char c4[4];
        put32(c4, e.body_crc);
        chain = kvi__crc32c(chain, c4, 4);
      }
    }
    pos += ENTRY_HDR + e.body;
    seq++;
  }
  free(body);
  *valid_end = pos;
  *next_seq = seq;
  return st;
}

kvi_status kvi__store_load(kvi_store **out, const kvi_model *model, const kvi_store_options *opts, const char *path,
                           const kvi_load_options *load_opts, const char *fn) {
  if (!out || !model || !opts)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !out ? "out" : !model ? "model" : "opts");
  kvi_status st = kvi__persist_check_path(path, fn);
  if (st) return st;
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  if (load_opts && (st = kvi__read_struct(&lo, sizeof lo, load_opts, KVI__LOAD_OPTIONS_V1, fn, "load_opts"))) return st;
  if (lo.flags & ~KVI_LOAD_JOURNAL)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "load_opts->flags has unknown bits 0x%x", lo.flags & ~KVI_LOAD_JOURNAL);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  if ((st = kvi__read_struct(&so, sizeof so, opts, KVI__STORE_OPTIONS_V1, fn, "opts"))) return st;
  if (kvi__dtype_size(so.dtype) == 0 && so.dtype != KVI_DTYPE_Q4)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->dtype is %d, not a kvi_dtype", (int)so.dtype);
  const bool journal = (lo.flags & KVI_LOAD_JOURNAL) != 0;
  if (so.disk_dir)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn,
                     "opts->disk_dir: kvi_store_load makes no disk tier; create the store with it (kvi_store_create): "
                     "its tenants are read from their files in that directory");

  loader ld;
  memset(&ld, 0, sizeof ld);
  ld.fn = fn;
  ld.path = path;
  ld.fd = open(path, (journal ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NONBLOCK);
  if (ld.fd < 0) {
    if (errno == ENOENT) return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no file %s", path);
    return kvi__persist_io_fail(fn, errno, "opening", path);
  }
  kvi__journal *j = NULL;
  char *jpath = NULL;
  struct stat sb;
  if (fstat(ld.fd, &sb) != 0) {
    st = kvi__persist_io_fail(fn, errno, "reading the size of", path);
    goto fail;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = kvi__fail(KVI_ERR_IO, fn, "%s is not a regular file", path);
    goto fail;
  }
  if (journal && flock(ld.fd, LOCK_EX | LOCK_NB) != 0) {
    st = errno == EWOULDBLOCK ? kvi__fail(KVI_ERR_IO, fn, "%s is the journal of an open store (in this process or another)", path)
                              : kvi__persist_io_fail(fn, errno, "locking", path);
    goto fail;
  }
  ld.size = (uint64_t)sb.st_size;
  if (journal) { /* allocated first: nothing can fail once the file is cut */
    j = calloc(1, sizeof *j);
    jpath = strdup(path);
    if (!j || !jpath) {
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a journal");
      goto fail;
    }
  }
  if ((st = kvi__persist_read_header(&ld, model, &so))) goto fail;
  ld.L = model->geom.num_layers;
  ld.H = model->geom.local_heads;
  ld.D = model->geom.head_size;
  ld.E = so.embedding_dim;
  ld.dtype = so.dtype;
  ld.page_scale = file_page_scale(so.dtype, ld.L, ld.H, ld.D, so.page_tokens, ld.version);
  if (journal && so.dtype == KVI_DTYPE_FP8_E4M3 && ld.version < FORMAT_VERSION_FP8_OFFSETS) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, fn,
                   "%s: an fp8 store file of format version %u (pages without key offsets) takes no appends; "
                   "load it without a journal and save it again (format version %d) to append to it",
                   path, ld.version, FORMAT_VERSION);
    goto fail;
  }
  ld.P = ld.page_scale ? so.page_tokens : 0;
  ld.token_bytes = kvi__dtype_bytes(so.dtype, 2u * (uint64_t)ld.L * (uint64_t)ld.H * (uint64_t)ld.D);
  if ((st = kvi__shard_store_create(&ld.s, model, opts, fn))) goto fail;
  uint64_t valid_end = 0, next_seq = 0;
  if ((st = read_entries(&ld, HDR_BYTES(ld.L), &valid_end, &next_seq))) goto fail;
  if (journal && ld.version < FORMAT_VERSION && (st = upgrade_header(&ld))) goto fail;
  if (journal) {
    if (valid_end < ld.size && (ftruncate(ld.fd, (off_t)valid_end) != 0 || fsync(ld.fd) != 0)) {
      st = kvi__persist_io_fail(fn, errno, "cutting the torn final entry off", path);
      goto fail;
    }
    j->fd = ld.fd;
    kvi__persist_journal_bind(j, jpath);
    j->file_id = ld.file_id;
    j->seq = next_seq;
    j->end = valid_end;
    j->dev = sb.st_dev;
    j->ino = sb.st_ino;
    kvi__persist_journal_set(ld.s, j); /* nobody else has the store yet */
  } else {
    close(ld.fd);
  }
  *out = ld.s;
  return KVI_OK;
fail:
  if (ld.s) kvi__store_destroy(ld.s, true);
  close(ld.fd);
  free(j);
  free(jpath);
  return st;
}

/* ------------------------------------------------------------------------ */
/* The disk tier's tenant files (persist/disk.c)                             */
/* ------------------------------------------------------------------------ */

/* A loader of a file that a store with this configuration wrote: the
 * header read and checked against the store's own geometry and options. */
static kvi_status tenant_loader(loader *ld, const kvi_store *s, int fd, const char *path, const char *fn) {
  memset(ld, 0, sizeof *ld);
  ld->fn = fn;
  ld->path = path;
  ld->fd = fd;
  struct stat sb;
  if (fstat(fd, &sb) != 0) return kvi__persist_io_fail(fn, errno, "reading the size of", path);
  ld->size = (uint64_t)sb.st_size;
  const kvi_model m = {s->geom, s->rope};
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  o.dtype = s->dtype;
  o.page_tokens = s->P;
  o.embedding_dim = s->emb_dim;
  o.embedding_dtype = s->emb.dtype;
  o.metric = s->emb.metric;
  kvi_status st = kvi__persist_read_header(ld, &m, &o);
  if (st) return st;
  ld->L = s->geom.num_layers;
  ld->H = s->geom.local_heads;
  ld->D = s->geom.head_size;
  ld->E = s->emb_dim;
  ld->dtype = s->dtype;
  ld->page_scale = s->scale_bytes;
  ld->P = s->scale_bytes ? s->P : 0;
  ld->token_bytes = token_bytes(s);
  if (s->fp8 && ld->version < FORMAT_VERSION_FP8_OFFSETS) /* the disk tier appends this version's records */
    return kvi__fail(KVI_ERR_INCOMPATIBLE, fn,
                     "%s: an fp8 tenant file of format version %u (pages without key offsets); this library's "
                     "disk tier keeps version %d files",
                     path, ld->version, FORMAT_VERSION);
  return KVI_OK;
}

kvi_status kvi__persist_index_tenant(kvi_store *s, uint64_t tenant, int fd, const char *path, uint64_t *file_id,
                                     uint64_t *valid_end, uint64_t *next_seq, const char *fn) {
  loader ld;
  kvi_status st = tenant_loader(&ld, s, fd, path, fn);
  if (st) return st;
  ld.s = s;
  ld.index_only = true;
  ld.tenant = tenant;
  if ((st = read_entries(&ld, HDR_BYTES(ld.L), valid_end, next_seq))) return st;
  *file_id = ld.file_id;
  return KVI_OK;
}

/* Reads and checks the entry at fe->off into fe (body, or st and msg). */
static void read_entry(const kvi_store *s, const fact_io *io, fact_entry *fe, const char *fn) {
  loader ld;
  kvi_status st = tenant_loader(&ld, s, io->fd, io->path, fn);
  const uint64_t eoff = fe->off;
  unsigned char h[ENTRY_HDR];
  entry e;
  char why[160];
  bool hard;
  if (st == KVI_OK && (eoff < HDR_BYTES(ld.L) || eoff + ENTRY_HDR > ld.size))
    st = kvi__persist_corrupt(&ld, eoff, "fact %llu of tenant %llu: its entry is past the end of the file (%llu bytes)",
                              (unsigned long long)io->id, (unsigned long long)io->tenant, (unsigned long long)ld.size);
  if (st == KVI_OK) st = kvi__persist_rd(&ld, eoff, h, ENTRY_HDR);
  if (st == KVI_OK && (!entry_ok(&ld, h, eoff, get64(h + 16), &e, why, sizeof why, &hard) || e.kind != KIND_FACTS))
    st = kvi__persist_corrupt(&ld, eoff, "fact %llu of tenant %llu: %s", (unsigned long long)io->id,
                              (unsigned long long)io->tenant, e.kind != KIND_FACTS ? "not a facts entry" : why);
  if (st == KVI_OK && !(fe->body = malloc(e.body ? (size_t)e.body : 1)))
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %llu-byte entry", (unsigned long long)e.body);
  if (st == KVI_OK) st = kvi__persist_rd(&ld, eoff + ENTRY_HDR, fe->body, (size_t)e.body);
  if (st == KVI_OK) {
    fe->body_len = e.body;
    const uint32_t crc = kvi__crc32c(0, fe->body, (size_t)e.body);
    if (!CRC_OK(e.body_crc, crc))
      st = kvi__persist_corrupt(&ld, eoff, "fact %llu of tenant %llu: body checksum mismatch (stored 0x%08x, computed 0x%08x)",
                                (unsigned long long)io->id, (unsigned long long)io->tenant, e.body_crc, crc);
  }
  fe->st = st;
  if (st) snprintf(fe->msg, sizeof fe->msg, "%s", kvi__last_error());
}

kvi_status kvi__persist_fact_io_read(const kvi_store *s, fact_io *io, const char *fn) {
  fact_entry *fe = io->e;
  pthread_mutex_lock(&fe->mu);
  if (!fe->done) {
    read_entry(s, io, fe, fn);
    fe->done = true;
    atomic_store_explicit(&fe->failed, fe->st != KVI_OK, memory_order_release);
    if (fe->body_len) io->bytes += ENTRY_HDR + fe->body_len;
  }
  pthread_mutex_unlock(&fe->mu);
  io->body = fe->body;
  io->body_len = fe->body_len;
  io->st = fe->st;
  if (io->st) snprintf(io->msg, sizeof io->msg, "%s", fe->msg);
  return io->st;
}

kvi_status kvi__persist_fact_io_decode(const kvi_store *s, const fact_io *io, bool stale, const uint32_t *pages,
                                       unsigned char *raw, const char *fn) {
  if (io->st) return kvi__fail(io->st, fn, "%s", io->msg); /* the read's failure, perhaps on another thread */
  loader ld;
  memset(&ld, 0, sizeof ld);
  ld.fn = fn, ld.path = io->path, ld.fd = io->fd, ld.version = FORMAT_VERSION;
  ld.L = s->geom.num_layers, ld.H = s->geom.local_heads, ld.D = s->geom.head_size, ld.E = s->emb_dim;
  ld.dtype = s->dtype, ld.page_scale = s->scale_bytes, ld.P = s->scale_bytes ? s->P : 0;
  ld.token_bytes = token_bytes(s);
  const uint64_t eoff = io->entry;
  uint64_t at = io->rec - eoff - ENTRY_HDR;
  if (io->rec < eoff + ENTRY_HDR || at >= io->body_len)
    return kvi__persist_corrupt(&ld, io->rec, "fact %llu: its record is outside its entry", (unsigned long long)io->id);
  const uint64_t start = at;
  rec r;
  kvi_status st = next_record(&ld, io->body, io->body_len, &at, eoff, &r);
  if (st) return st;
  if (r.op != OP_PUT || r.tenant != io->tenant || r.id != io->id || r.tokens != io->tokens)
    return kvi__persist_corrupt(&ld, r.off, "the record of fact %llu of tenant %llu (%d tokens) holds %s of fact %llu of tenant %llu",
                                (unsigned long long)io->id, (unsigned long long)io->tenant, (int)io->tokens,
                                r.op == OP_PUT ? "the data" : "a removal", (unsigned long long)r.id,
                                (unsigned long long)r.tenant);
  if (raw) { /* the record as it is, with the fact's stale flag as it is now */
    memcpy(raw, io->body + start, (size_t)(at - start));
    if (r.ctx) put32(raw + REC_HDR + r.payload - context_bytes(r.nctx) + 4, stale ? 1u : 0u);
    return KVI_OK;
  }
  rec_parts p;
  if ((st = rec_parts_get(&ld, &r, &p))) return st;
  kvi_kv_view v;
  st = rec_view(s, &p, &v, fn);
  if (st == KVI_OK) st = kvi__store_write_pages((kvi_store *)s, pages, &v, p.scales, NULL, fn);
  rec_parts_free(&p);
  return st;
}
