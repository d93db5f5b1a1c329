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

/* The fuzz target checks everything but the checksums, so that mutated
 * files reach the parser's deeper checks. */
#ifdef KVI_FUZZING
#define CRC_OK(stored, computed) ((void)(stored), (void)(computed), true)
#else
#define CRC_OK(stored, computed) ((stored) == (computed))
#endif

typedef struct loader {
  const char *fn, *path;
  int fd;
  uint64_t size;
  uint64_t file_id;
  kvi_store *s;
  int32_t L, H, D, E;
  kvi_dtype dtype;
  int32_t P; /* quantized (fp8, q4) files: tokens per page of scales, else 0 */
  uint64_t page_scale; /* quantized files: bytes of a page's scales */
  uint64_t token_bytes;
  uint32_t version; /* the file's format version */
} loader;

static kvi_status corrupt(const loader *ld, uint64_t off, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kvi_status corrupt(const loader *ld, uint64_t off, const char *fmt, ...) {
  char msg[320];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return kvi__fail(KVI_ERR_CORRUPT, ld->fn, "%s: offset %llu: %s", ld->path, (unsigned long long)off, msg);
}

static kvi_status rd(const loader *ld, uint64_t off, void *buf, size_t n) {
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

static const char *const rope_fields[] = {
    "style",     "rotary_dim", "scaling",          "original_max_position", "theta",      "factor",
    "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "yarn_truncate",
    "table_positions", "cos_sin_table (hash)"};
static const int rope_offsets[] = {0, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 76, 80};

static kvi_status rope_mismatch(const loader *ld, int32_t layer, const unsigned char *file, const unsigned char *model) {
  for (int i = 0; i < 14; i++) {
    const int off = rope_offsets[i], size = i < 4 || i == 11 || i == 12 ? 4 : 8;
    if (memcmp(file + off, model + off, (size_t)size) == 0) continue;
    char a[64], b[64];
    if (size == 4) {
      snprintf(a, sizeof a, "%d", (int)get32(file + off));
      snprintf(b, sizeof b, "%d", (int)get32(model + off));
    } else if (i == 13) {
      snprintf(a, sizeof a, "0x%016llx", (unsigned long long)get64(file + off));
      snprintf(b, sizeof b, "0x%016llx", (unsigned long long)get64(model + off));
    } else {
      snprintf(a, sizeof a, "%.17g", getf64(file + off));
      snprintf(b, sizeof b, "%.17g", getf64(model + off));
    }
    return kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: layer %d RoPE %s is %s in the file, %s in the model", ld->path,
                     (int)layer, rope_fields[i], a, b);
  }
  return kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: layer %d RoPE differs from the model's", ld->path, (int)layer);
}

/* Reads and checks the header against the model and the store options. */
static kvi_status read_header(loader *ld, const kvi_model *model, const kvi_store_options *o) {
  unsigned char fixed[HDR_FIXED];
  if (ld->size < HDR_BYTES(1))
    return corrupt(ld, 0, "the file is %llu bytes, shorter than a store file header (%llu)",
                   (unsigned long long)ld->size, (unsigned long long)HDR_BYTES(1));
  kvi_status st = rd(ld, 0, fixed, sizeof fixed);
  if (st) return st;
  if (memcmp(fixed, FILE_MAGIC, 8) != 0) return corrupt(ld, 0, "not a libkvinject store file (no KVISTORE magic)");
  const uint64_t hb = get32(fixed + 16);
  if (hb < HDR_BYTES(1) || hb > HDR_BYTES(MAX_LAYERS) || hb > ld->size)
    return corrupt(ld, 16, "header size %llu is impossible (file size %llu)", (unsigned long long)hb,
                   (unsigned long long)ld->size);
  unsigned char *h = malloc((size_t)hb);
  if (!h) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating a %llu-byte header", (unsigned long long)hb);
  if ((st = rd(ld, 0, h, (size_t)hb))) goto out;
  const uint32_t crc = kvi__crc32c(0, h, (size_t)hb - 4);
  if (!CRC_OK(get32(h + hb - 4), crc)) {
    st = corrupt(ld, hb - 4, "header checksum mismatch (stored 0x%08x, computed 0x%08x)", get32(h + hb - 4), crc);
    goto out;
  }
  ld->version = get32(h + 8);
  if (ld->version < FORMAT_VERSION_MIN || ld->version > FORMAT_VERSION) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: format version %u; this library reads versions %d to %d",
                   ld->path, ld->version, FORMAT_VERSION_MIN, FORMAT_VERSION);
    goto out;
  }
  if (get32(h + 12) != ENDIAN_MARK) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: written with another byte order (mark 0x%08x)", ld->path,
                   get32(h + 12));
    goto out;
  }
  const int32_t L = (int32_t)get32(h + 32);
  const uint32_t scale_P = get32(h + 84); /* page_tokens of a quantized file, else 0 */
  const bool quant_file = get32(h + 64) == (uint32_t)KVI_DTYPE_FP8_E4M3 || get32(h + 64) == (uint32_t)KVI_DTYPE_Q4;
  if (L < 1 || L > MAX_LAYERS || hb != HDR_BYTES(L) || get32(h + 80) != ROPE_BYTES ||
      (quant_file ? scale_P < 1 || scale_P > 4096 : scale_P != 0)) {
    st = corrupt(ld, 32, "inconsistent header (%d layers, %llu header bytes)", (int)L, (unsigned long long)hb);
    goto out;
  }
  if (get32(h + 20) != 0) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: unknown header flags 0x%x", ld->path, get32(h + 20));
    goto out;
  }
  ld->file_id = get64(h + 24);

  const kvi__geom *g = &model->geom;
  static const char *const names[8] = {"num_layers", "num_kv_heads", "head_size",   "tp_rank",
                                       "tp_size",    "local_head_first", "local_heads", "head_replicas"};
  const int32_t want[8] = {g->num_layers, g->num_kv_heads, g->head_size,  g->tp_rank,
                           g->tp_size,    g->head_first,   g->local_heads, g->head_replicas};
  for (int i = 0; i < 8; i++) {
    const int32_t have = (int32_t)get32(h + 32 + 4 * i);
    if (have != want[i]) {
      st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: the file was made for %s %d, the model has %d%s", ld->path,
                     names[i], (int)have, (int)want[i],
                     i >= 3 ? " (a store file holds one tensor-parallel rank's heads)" : "");
      goto out;
    }
  }
  const kvi_dtype dt = (kvi_dtype)get32(h + 64);
  if (dt != o->dtype) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: the file holds %s facts, opts->dtype is %s", ld->path,
                   kvi__dtype_name(dt), kvi__dtype_name(o->dtype));
    goto out;
  }
  if (quant_file && scale_P != (uint32_t)o->page_tokens) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn,
                   "%s: the file's %s facts have scales per page of %u tokens, opts->page_tokens is %d", ld->path, kvi__dtype_name(dt),
                   scale_P, (int)o->page_tokens);
    goto out;
  }
  const int32_t E = (int32_t)get32(h + 68);
  if (E != o->embedding_dim) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: the file's embeddings have %d elements, opts->embedding_dim is %d",
                   ld->path, (int)E, (int)o->embedding_dim);
    goto out;
  }
  if (E > 0 && (get32(h + 72) != (uint32_t)o->embedding_dtype || get32(h + 76) != (uint32_t)o->metric)) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn,
                   "%s: the file's embeddings are kept as dtype %u with metric %u, opts asks for dtype %u with metric %u",
                   ld->path, get32(h + 72), get32(h + 76), (unsigned)o->embedding_dtype, (unsigned)o->metric);
    goto out;
  }
  unsigned char *mine = malloc((size_t)L * ROPE_BYTES);
  if (!mine) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating RoPE entries");
    goto out;
  }
  kvi__persist_rope_entries(mine, model->rope, L);
  for (int32_t l = 0; l < L && st == KVI_OK; l++)
    if (memcmp(h + HDR_FIXED + (size_t)l * ROPE_BYTES, mine + (size_t)l * ROPE_BYTES, ROPE_BYTES) != 0)
      st = rope_mismatch(ld, l, h + HDR_FIXED + (size_t)l * ROPE_BYTES, mine + (size_t)l * ROPE_BYTES);
  free(mine);
out:
  free(h);
  return st;
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
    if ((st = rd(ld, at, buf, n))) break;
    for (size_t i = 0; i + ENTRY_HDR <= n && i < SCAN_CHUNK; i++) {
      const unsigned char *h = buf + i;
      if (get32(h) != ENTRY_MAGIC || get64(h + 8) != ld->file_id || get64(h + 16) < want_seq) continue;
      if (!CRC_OK(get32(h + 44), kvi__crc32c(0, h, 44))) continue;
      st = corrupt(ld, off, "damaged entry (%s), followed by a valid entry at offset %llu", why,
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
  const unsigned char *data;
} rec;

/* Decodes and checks the record at body[*at]; advances *at. */
static kvi_status next_record(const loader *ld, const unsigned char *body, uint64_t len, uint64_t *at, uint64_t eoff,
                              rec *r) {
  const uint64_t off = eoff + ENTRY_HDR + *at;
  if (len - *at < REC_HDR) return corrupt(ld, off, "record header past the end of its entry");
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
      return corrupt(ld, off, "removal record with %d tokens and %llu payload bytes", (int)r->tokens,
                     (unsigned long long)r->payload);
    *at += REC_HDR;
    return KVI_OK;
  }
  if (r->op != OP_PUT) return corrupt(ld, off, "unknown record type %u", r->op);
  uint64_t want, groups; /* the scales' bytes, bounded before scale_bytes multiplies */
  if (r->tokens < 1 || __builtin_mul_overflow((uint64_t)r->tokens, ld->token_bytes, &want) ||
      __builtin_add_overflow(want, (uint64_t)ld->E * 4u, &want) ||
      __builtin_mul_overflow((uint64_t)r->tokens, ld->page_scale, &groups) ||
      __builtin_add_overflow(want, scale_bytes((uint64_t)r->tokens, ld->P, ld->page_scale), &want) ||
      __builtin_add_overflow(want, r->ids ? (uint64_t)r->tokens * 4u : 0u, &want))
    return corrupt(ld, off, "fact record with %d tokens", (int)r->tokens);
  if (r->ctx) { /* the context section's count and flag, then its ids */
    if (want > room || room - want < 8u) return corrupt(ld, off, "context section past the end of its entry");
    const uint32_t nc = get32(r->data + want), stale = get32(r->data + want + 4);
    if (nc < 1 || nc > (uint32_t)INT32_MAX || stale > 1u)
      return corrupt(ld, off, "context section of %u ids with stale flag %u", nc, stale);
    r->nctx = (int32_t)nc;
    r->stale = stale != 0;
    r->ctx_ids = r->data + want + 8;
    want += 8u + 8u * (uint64_t)nc; /* nc < 2^31: cannot wrap after a bound by room below */
  }
  if (r->payload != want)
    return corrupt(ld, off, "fact record of %d tokens with %llu payload bytes; the geometry needs %llu", (int)r->tokens,
                   (unsigned long long)r->payload, (unsigned long long)want);
  if (r->payload > room || pad8(r->payload) > room)
    return corrupt(ld, off, "fact record of %llu bytes past the end of its entry", (unsigned long long)r->payload);
  for (uint64_t i = r->payload; i < pad8(r->payload); i++)
    if (r->data[i]) return corrupt(ld, off, "non-zero padding after a fact record");
  for (int32_t i = 0; i < ld->E; i++) {
    float x;
    memcpy(&x, r->data + 4 * (size_t)i, 4);
    if (!isfinite(x)) return corrupt(ld, off, "embedding[%d] of fact %llu is %g", (int)i, (unsigned long long)r->id, (double)x);
  }
  /* fp8 scales are what kvi__fp8_scale can give: 2^-126 .. FLT_MAX / 448;
   * q4 words what kvi__q4_params can give: a finite scale >= 0 (fp16 bits
   * below the sign) and a finite minimum */
  const uint64_t nsc = scale_bytes((uint64_t)r->tokens, ld->P, ld->page_scale) / 4u;
  const unsigned char *sc = r->data + (size_t)ld->E * 4u + (size_t)r->tokens * (size_t)ld->token_bytes;
  for (uint64_t i = 0; i < nsc; i++) {
    float x;
    uint32_t w;
    memcpy(&x, sc + 4 * (size_t)i, 4);
    memcpy(&w, sc + 4 * (size_t)i, 4);
    if (ld->dtype == KVI_DTYPE_Q4 ? (w & 0xffffu) > 0x7bffu || ((w >> 16) & 0x7fffu) > 0x7bffu
                                  : !(x >= KVI__FP8_SCALE_MIN && x <= FLT_MAX / KVI__FP8_STORE_MAX))
      return corrupt(ld, off, "%s scale %llu of fact %llu is %s 0x%08x", kvi__dtype_name(ld->dtype),
                     (unsigned long long)i, (unsigned long long)r->id, "out of range:", (unsigned)w);
  }
  *at += REC_HDR + pad8(r->payload);
  return KVI_OK;
}

/* Stores one fact of a file (host view v: for a quantized store, the
 * stored elements with the pages' scales, kept as they are; emb: the embedding as it was
 * kept, or NULL) through a transaction of its own. */
static kvi_status load_fact(kvi_store *s, uint64_t tenant, uint64_t id, const kvi_kv_view *kv, const void *scales,
                            const float *emb, const int32_t *ids, const uint64_t *ctx, int32_t nctx, bool stale,
                            const char *fn) {
  kvi_kv_view v, w = *kv;
  if (scales) w.dtype = KVI_DTYPE_BF16; /* checked as a 2-byte view (a larger extent), then given its dtype back */
  kvi_status st = kvi__view_check(&v, &w, &s->geom, false, fn);
  if (st) return st;
  v.dtype = kv->dtype;
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
  kvi_status st = rd(ld, 0, h, hb);
  if (st == KVI_OK) {
    put32(h + 8, FORMAT_VERSION);
    put32(h + hb - 4, kvi__crc32c(0, h, hb - 4));
    if (kvi__persist_pwrite_all(ld->fd, h, hb, 0) != 0 || fsync(ld->fd) != 0)
      st = kvi__persist_io_fail(ld->fn, errno, "rewriting the header of", ld->path);
  }
  free(h);
  return st;
}

/* Applies one checked record to the new store. */
static kvi_status apply(const loader *ld, const rec *r, bool in_log, uint64_t eoff) {
  const bool exists = kvi__store_find(ld->s, r->tenant, r->id) != NULL; /* the store is not shared yet */
  kvi_status st;
  if (r->op == OP_REMOVE) {
    if (!in_log) return corrupt(ld, eoff, "a removal record inside the snapshot");
    if (!exists)
      return corrupt(ld, eoff, "removal of fact %llu of tenant %llu, which is not stored", (unsigned long long)r->id,
                     (unsigned long long)r->tenant);
    return kvi__store_remove(ld->s, r->tenant, r->id, r->keep ? KVI_REMOVE_KEEP_DEPENDENTS : 0u, ld->fn);
  }
  if (exists) {
    if (!in_log)
      return corrupt(ld, eoff, "fact %llu of tenant %llu appears twice in the snapshot", (unsigned long long)r->id,
                     (unsigned long long)r->tenant);
    /* a replacement: room for one copy */
    if ((st = kvi__store_remove(ld->s, r->tenant, r->id, KVI_REMOVE_KEEP_DEPENDENTS, ld->fn))) return st;
  }
  const unsigned char *k = r->data + (size_t)ld->E * 4u;
  const size_t plane = (size_t)r->tokens * (size_t)(ld->token_bytes / 2u);
  kvi_kv_view v;
  kvi__kv_view_contiguous(&v, KVI_MEMORY_HOST, ld->dtype, ld->L, r->tokens, ld->H, ld->D, (void *)k, (void *)(k + plane));
  /* the embedding copied to aligned memory, as the scales */
  const size_t eb = (size_t)ld->E * 4u, sb = (size_t)scale_bytes((uint64_t)r->tokens, ld->P, ld->page_scale);
  float *emb = ld->E ? malloc(eb) : NULL;
  unsigned char *scales = ld->P > 0 ? malloc(sb) : NULL;
  int32_t *ids = r->ids ? malloc((size_t)r->tokens * sizeof *ids) : NULL;
  uint64_t *ctx = r->nctx > 0 ? malloc((size_t)r->nctx * sizeof *ctx) : NULL;
  if ((ld->E && !emb) || (ld->P > 0 && !scales) || (r->ids && !ids) || (r->nctx > 0 && !ctx)) {
    free(emb);
    free(scales);
    free(ids);
    free(ctx);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating %zu bytes", eb + sb + (size_t)r->tokens * 4u);
  }
  if (emb) memcpy(emb, r->data, eb);
  if (scales) memcpy(scales, k + 2 * plane, sb); /* stored elements and scales as they were */
  for (int32_t i = 0; ids && i < r->tokens; i++) ids[i] = (int32_t)get32(k + 2 * plane + sb + 4 * (size_t)i);
  for (int32_t i = 0; i < r->nctx; i++) ctx[i] = get64(r->ctx_ids + 8 * (size_t)i);
  st = load_fact(ld->s, r->tenant, r->id, &v, scales, emb, ids, ctx, r->nctx, r->stale, ld->fn);
  free(emb);
  free(scales);
  free(ids);
  free(ctx);
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
      if (!in_log) st = corrupt(ld, pos, "the file ends before the snapshot's end entry (truncated)");
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
      if ((st = rd(ld, pos, h, ENTRY_HDR))) break;
      ok = entry_ok(ld, h, pos, seq, &e, why, sizeof why, &hard);
    }
    if (!ok) {
      /* in the log, a torn final entry is ignored (check_tail leaves st KVI_OK) */
      if (!in_log || hard) st = corrupt(ld, pos, "%s%s", why, in_log ? "" : " (inside the snapshot)");
      else st = check_tail(ld, pos, seq, why);
      break;
    }
    free(body);
    body = malloc(e.body ? (size_t)e.body : 1);
    if (!body) {
      st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating a %llu-byte entry", (unsigned long long)e.body);
      break;
    }
    if ((st = rd(ld, pos + ENTRY_HDR, body, (size_t)e.body))) break;
    const uint32_t crc = kvi__crc32c(0, body, (size_t)e.body);
    if (!CRC_OK(e.body_crc, crc)) {
      if (in_log && pos + ENTRY_HDR + e.body == ld->size) break; /* torn final entry */
      st = corrupt(ld, pos, "entry %llu: body checksum mismatch (stored 0x%08x, computed 0x%08x)%s",
                   (unsigned long long)e.seq, e.body_crc, crc, in_log ? "" : " (inside the snapshot)");
      break;
    }
    if (e.kind == KIND_END) {
      if (in_log) {
        st = corrupt(ld, pos, "a second end entry");
        break;
      }
      if (get64(body) != facts || get64(body + 8) != payload_total || !CRC_OK(get32(body + 16), chain) ||
          get32(body + 20) != 0) {
        st = corrupt(ld, pos, "the end entry counts %llu facts of %llu bytes; the snapshot has %llu of %llu",
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
        st = corrupt(ld, pos, "entry %llu has %llu bytes after its %u records", (unsigned long long)e.seq,
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
  if ((st = read_header(&ld, model, &so))) goto fail;
  ld.L = model->geom.num_layers;
  ld.H = model->geom.local_heads;
  ld.D = model->geom.head_size;
  ld.E = so.embedding_dim;
  ld.dtype = so.dtype;
  ld.page_scale = kvi__page_scale_bytes(so.dtype, ld.L, ld.H, ld.D, so.page_tokens);
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
