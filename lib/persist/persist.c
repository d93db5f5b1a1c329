/*
 * Durable stores: snapshot files, the journal (an append log in the same
 * file), and the loader.
 * SPDX-License-Identifier: Apache-2.0
 *
 * The byte layout is in docs/store-format.md. In short: a
 * header with its own CRC32C, then entries, each a 48-byte header (with its
 * CRC) and a body (with its CRC): the snapshot's FACTS entries, one END
 * entry, then the log's FACTS entries, one per journaled call. Entries are
 * numbered (seq) and carry the file's random id, so an entry from another
 * file or out of order is caught.
 *
 * Everything goes through the store's own calls (its transactions and
 * kvi__store_remove to load) or through store.c's read of a fact's pages
 * into a host view, so this file does not depend on the page layout or on
 * where pages live.
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
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "persist/persist.h"
#include "store/store.h"
#include "tp/tp.h"

typedef struct kvi__journal kvi__journal;

/* ------------------------------------------------------------------------ */
/* The format                                                                */
/* ------------------------------------------------------------------------ */

static const unsigned char FILE_MAGIC[8] = {'K', 'V', 'I', 'S', 'T', 'O', 'R', 'E'};

enum {
  FORMAT_VERSION = 1,
  HDR_FIXED = 88,  /* file header before the RoPE entries */
  ROPE_BYTES = 88, /* one layer's RoPE */
  ENTRY_HDR = 48,
  REC_HDR = 32,
  END_BODY = 24,
  KIND_FACTS = 1,
  KIND_END = 2,
  OP_PUT = 1,
  OP_REMOVE = 2,
  MAX_LAYERS = 65536,
};
#define ENDIAN_MARK 0x01020304u
#define ENTRY_MAGIC 0x4549564Bu /* "KVIE" */
#define HDR_BYTES(L) ((uint64_t)HDR_FIXED + (uint64_t)ROPE_BYTES * (uint64_t)(L) + 4u)
#define WRITE_BUF (1u << 20)
#define SCAN_CHUNK (1u << 20)

/* The fuzz target checks everything but the checksums, so that mutated
 * files reach the parser's deeper checks. */
#ifdef KVI_FUZZING
#define CRC_OK(stored, computed) ((void)(stored), (void)(computed), true)
#else
#define CRC_OK(stored, computed) ((stored) == (computed))
#endif

static void put32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8), p[2] = (unsigned char)(v >> 16), p[3] = (unsigned char)(v >> 24);
}
static void put64(unsigned char *p, uint64_t v) {
  put32(p, (uint32_t)v);
  put32(p + 4, (uint32_t)(v >> 32));
}
static void putf64(unsigned char *p, double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  put64(p, u);
}
static uint32_t get32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const unsigned char *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }
static double getf64(const unsigned char *p) {
  const uint64_t u = get64(p);
  double d;
  memcpy(&d, &u, 8);
  return d;
}

static bool host_little_endian(void) {
  const uint32_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

static uint64_t pad8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

/* FNV-1a, 64 bits: identifies an engine cos/sin table in the header. */
static uint64_t fnv64(const void *data, size_t n) {
  const unsigned char *p = data;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

/* One layer's RoPE as it is written: only what changes the rotation, so that
 * two specs that rotate alike compare equal (a table's formula fields, the
 * factors a scaling does not use, are zero). */
static void rope_entry(unsigned char *e, const kvi__rope *r, uint64_t table_hash) {
  memset(e, 0, ROPE_BYTES);
  put32(e, (uint32_t)r->style);
  if (r->style == KVI_ROPE_NONE) return;
  const kvi_rope_spec *s = &r->spec;
  put32(e + 4, (uint32_t)r->rotary_dim);
  putf64(e + 64, (double)s->attention_factor);
  if (r->table) {
    put32(e + 76, (uint32_t)r->table->positions);
    put64(e + 80, table_hash);
    return;
  }
  put32(e + 8, (uint32_t)s->scaling);
  putf64(e + 16, s->theta);
  switch (s->scaling) {
  case KVI_ROPE_SCALING_NONE: break;
  case KVI_ROPE_SCALING_LINEAR:
  case KVI_ROPE_SCALING_NTK: putf64(e + 24, s->factor); break;
  case KVI_ROPE_SCALING_LLAMA3:
    put32(e + 12, (uint32_t)s->original_max_position);
    putf64(e + 24, s->factor);
    putf64(e + 32, s->low_freq_factor);
    putf64(e + 40, s->high_freq_factor);
    break;
  case KVI_ROPE_SCALING_YARN:
    put32(e + 12, (uint32_t)s->original_max_position);
    putf64(e + 24, s->factor);
    putf64(e + 48, s->beta_fast);
    putf64(e + 56, s->beta_slow);
    put32(e + 72, (uint32_t)s->yarn_truncate);
    break;
  }
}

/* Fills n_layers RoPE entries (tables shared by layers are hashed once). */
static void rope_entries(unsigned char *out, const kvi__rope *rope, int32_t n_layers) {
  const kvi__table *last = NULL;
  uint64_t hash = 0;
  for (int32_t l = 0; l < n_layers; l++) {
    const kvi__table *t = rope[l].table;
    if (t && t != last) {
      hash = fnv64(t->data, (size_t)t->positions * (size_t)t->rotary_dim * sizeof(float));
      last = t;
    }
    rope_entry(out + (size_t)l * ROPE_BYTES, &rope[l], t ? hash : 0);
  }
}

/* The file header for a store: HDR_BYTES(L) bytes, CRC included. */
static unsigned char *make_header(const kvi_store *s, uint64_t file_id, size_t *out_len) {
  const kvi__geom *g = &s->geom;
  const size_t len = (size_t)HDR_BYTES(g->num_layers);
  unsigned char *h = calloc(1, len);
  if (!h) return NULL;
  memcpy(h, FILE_MAGIC, 8);
  put32(h + 8, FORMAT_VERSION);
  put32(h + 12, ENDIAN_MARK);
  put32(h + 16, (uint32_t)len);
  put32(h + 20, 0); /* flags */
  put64(h + 24, file_id);
  const int32_t geom[8] = {g->num_layers, g->num_kv_heads, g->head_size,  g->tp_rank,
                           g->tp_size,    g->head_first,   g->local_heads, g->head_replicas};
  for (int i = 0; i < 8; i++) put32(h + 32 + 4 * i, (uint32_t)geom[i]);
  put32(h + 64, (uint32_t)s->dtype);
  put32(h + 68, (uint32_t)s->emb_dim);
  put32(h + 72, (uint32_t)s->emb.dtype); /* how the store keeps embeddings (payloads are fp32, exact) */
  put32(h + 76, (uint32_t)s->emb.metric);
  put32(h + 80, ROPE_BYTES);
  put32(h + 84, s->fp8 ? (uint32_t)s->P : 0u); /* fp8: scales are per page of P tokens */
  rope_entries(h + HDR_FIXED, s->rope, g->num_layers);
  put32(h + len - 4, kvi__crc32c(0, h, len - 4));
  *out_len = len;
  return h;
}

static void entry_header(unsigned char *h, uint32_t kind, uint64_t file_id, uint64_t seq, uint64_t body_bytes,
                         uint32_t count, uint32_t body_crc) {
  put32(h, ENTRY_MAGIC);
  put32(h + 4, kind);
  put64(h + 8, file_id);
  put64(h + 16, seq);
  put64(h + 24, body_bytes);
  put32(h + 32, count);
  put32(h + 36, 0);
  put32(h + 40, body_crc);
  put32(h + 44, kvi__crc32c(0, h, 44));
}

/* Bytes of one token's K and V for every layer and local head. */
static uint64_t token_bytes(const kvi_store *s) {
  return 2u * (uint64_t)s->geom.num_layers * (uint64_t)s->geom.local_heads * (uint64_t)s->geom.head_size *
         kvi__dtype_size(s->dtype);
}

/* fp8 stores: bytes of the scales of a fact of `tokens` tokens (one fp32 per
 * page, layer, K/V and head); 0 for other dtypes. */
static uint64_t scale_bytes(uint64_t tokens, int32_t P, int32_t L, int32_t H) {
  return P > 0 ? (tokens + (uint64_t)P - 1u) / (uint64_t)P * 2u * (uint64_t)L * (uint64_t)H * 4u : 0u;
}

/* A stored fact's record payload: embedding, then K, then V, then (fp8) the scales. */
static uint64_t put_payload(const kvi_store *s, int32_t tokens) {
  return (uint64_t)s->emb_dim * 4u + (uint64_t)tokens * token_bytes(s) +
         scale_bytes((uint64_t)tokens, s->fp8 ? s->P : 0, s->geom.num_layers, s->geom.local_heads);
}

static uint64_t put_record_bytes(const kvi_store *s, int32_t tokens) { return REC_HDR + pad8(put_payload(s, tokens)); }

/* Writes a PUT record for a fact whose data is in `pages` (store lock held). */
static kvi_status fill_put(const kvi_store *s, unsigned char *rec, uint64_t tenant, uint64_t id, int32_t tokens,
                           const uint32_t *pages, const float *emb, const char *fn) {
  const uint64_t payload = put_payload(s, tokens);
  memset(rec, 0, (size_t)(REC_HDR + pad8(payload)));
  put32(rec, OP_PUT);
  put32(rec + 4, (uint32_t)tokens);
  put64(rec + 8, tenant);
  put64(rec + 16, id);
  put64(rec + 24, payload);
  unsigned char *p = rec + REC_HDR;
  if (s->emb_dim > 0) memcpy(p, emb, (size_t)s->emb_dim * sizeof(float));
  p += (size_t)s->emb_dim * sizeof(float);
  const kvi__geom *g = &s->geom;
  const size_t plane = (size_t)tokens * (size_t)(token_bytes(s) / 2u);
  kvi_kv_view v;
  kvi__kv_view_contiguous(&v, KVI_MEMORY_HOST, s->dtype, g->num_layers, tokens, g->local_heads, g->head_size, p,
                         p + plane);
  if (!s->fp8) return kvi__store_read_pages(s, pages, tokens, &v, NULL, fn);
  const size_t sb = (size_t)scale_bytes((uint64_t)tokens, s->P, g->num_layers, g->local_heads);
  float *scales = malloc(sb);
  if (!scales) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes of scales", sb);
  const kvi_status st = kvi__store_read_pages(s, pages, tokens, &v, scales, fn);
  if (st == KVI_OK) memcpy(p + 2 * plane, scales, sb); /* after V; not float-aligned in general */
  free(scales);
  return st;
}

/* ------------------------------------------------------------------------ */
/* Files                                                                     */
/* ------------------------------------------------------------------------ */

static kvi_status io_fail(const char *fn, int err, const char *what, const char *path) {
  return kvi__fail(KVI_ERR_IO, fn, "%s %s: %s", what, path, strerror(err));
}

static kvi_status write_all(int fd, const void *data, size_t n, const char *path, const char *fn) {
  const unsigned char *p = data;
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return io_fail(fn, w < 0 ? errno : ENOSPC, "writing", path);
    p += w;
    n -= (size_t)w;
  }
  return KVI_OK;
}

static int pwrite_all(int fd, const void *data, size_t n, uint64_t off) {
  const unsigned char *p = data;
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, n, (off_t)off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = ENOSPC;
      return -1;
    }
    p += w, off += (uint64_t)w, n -= (size_t)w;
  }
  return 0;
}

/* The directory part of a path (a fresh string; "." for a bare name) and
 * where its last component starts. */
static char *path_dir(const char *path, const char **base) {
  const char *slash = strrchr(path, '/');
  if (base) *base = slash ? slash + 1 : path;
  return slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
}

/* Flushes the directory holding `path`, so that a rename in it is durable. */
static kvi_status fsync_dir(const char *path, const char *fn) {
  char *dir = path_dir(path, NULL);
  if (!dir) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "copying a path");
  kvi_status st = KVI_OK;
  const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) st = io_fail(fn, errno, "opening the directory", dir);
  else if (fsync(fd) != 0) st = io_fail(fn, errno, "flushing the directory", dir);
  if (fd >= 0) close(fd);
  free(dir);
  return st;
}

/* A random id for a new file, so that entries of another file never pass. */
static uint64_t new_file_id(void) {
  static _Atomic uint64_t counter;
  uint64_t id = 0;
  if (getrandom(&id, sizeof id, GRND_NONBLOCK) != (ssize_t)sizeof id) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    id = ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16) ^
         (atomic_fetch_add(&counter, 1) * 0x9e3779b97f4a7c15ull);
  }
  return id ? id : 1;
}

/* Buffered sequential writes. */
typedef struct writer {
  int fd;
  const char *path;
  unsigned char *buf;
  size_t len;
} writer;

static kvi_status w_flush(writer *w, const char *fn) {
  const kvi_status st = write_all(w->fd, w->buf, w->len, w->path, fn);
  w->len = 0;
  return st;
}

static kvi_status w_put(writer *w, const void *data, size_t n, const char *fn) {
  if (w->len + n > WRITE_BUF) {
    kvi_status st = w_flush(w, fn);
    if (st) return st;
  }
  if (n >= WRITE_BUF) return write_all(w->fd, data, n, w->path, fn);
  memcpy(w->buf + w->len, data, n);
  w->len += n;
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* Snapshots                                                                 */
/* ------------------------------------------------------------------------ */

static int cmp_fact(const void *a, const void *b) {
  const fact *x = *(const fact *const *)a, *y = *(const fact *const *)b;
  if (x->tenant_id != y->tenant_id) return x->tenant_id < y->tenant_id ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

/* Writes the header, one FACTS entry per fact (sorted by tenant and id) and
 * the END entry. The store's lock is held. */
static kvi_status write_snapshot(const kvi_store *s, writer *w, uint64_t file_id, bool one, uint64_t tenant,
                                 uint64_t *out_seq, const char *fn) {
  size_t hlen;
  unsigned char *hdr = make_header(s, file_id, &hlen);
  if (!hdr) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a file header");
  kvi_status st = w_put(w, hdr, hlen, fn);
  free(hdr);
  if (st) return st;

  size_t n = 0;
  const size_t nall = kvi__store_fact_count(s);
  const fact **facts = malloc((nall ? nall : 1) * sizeof *facts);
  float *emb = malloc((size_t)(s->emb_dim ? s->emb_dim : 1) * sizeof *emb);
  if (!facts || !emb) {
    free(facts);
    free(emb);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "listing %zu facts", nall);
  }
  size_t pos = 0;
  for (const fact *f; (f = kvi__store_next_fact(s, &pos));)
    if (!one || f->tenant_id == tenant) facts[n++] = f;
  qsort(facts, n, sizeof *facts, cmp_fact);

  uint64_t seq = 0, payload_total = 0;
  uint32_t chain = 0;
  unsigned char *buf = NULL;
  size_t cap = 0;
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    const fact *f = facts[i];
    const uint64_t body = put_record_bytes(s, f->tokens);
    if (ENTRY_HDR + body > cap) {
      unsigned char *nb = realloc(buf, (size_t)(ENTRY_HDR + body));
      if (!nb) {
        st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %llu bytes for fact %llu of tenant %llu",
                       (unsigned long long)body, (unsigned long long)f->id, (unsigned long long)f->tenant_id);
        break;
      }
      buf = nb;
      cap = (size_t)(ENTRY_HDR + body);
    }
    if (s->emb_dim > 0 && (st = kvi__store_fact_embedding(s, f, emb, fn))) break;
    st = fill_put(s, buf + ENTRY_HDR, f->tenant_id, f->id, f->tokens, f->pages, emb, fn);
    if (st) break;
    const uint32_t crc = kvi__crc32c(0, buf + ENTRY_HDR, (size_t)body);
    entry_header(buf, KIND_FACTS, file_id, seq++, body, 1, crc);
    st = w_put(w, buf, (size_t)(ENTRY_HDR + body), fn);
    unsigned char c4[4];
    put32(c4, crc);
    chain = kvi__crc32c(chain, c4, 4);
    payload_total += put_payload(s, f->tokens);
  }
  free(buf);
  free(facts);
  free(emb);
  if (st) return st;

  unsigned char end[ENTRY_HDR + END_BODY];
  put64(end + ENTRY_HDR, (uint64_t)n);
  put64(end + ENTRY_HDR + 8, payload_total);
  put32(end + ENTRY_HDR + 16, chain);
  put32(end + ENTRY_HDR + 20, 0);
  entry_header(end, KIND_END, file_id, seq++, END_BODY, 0, kvi__crc32c(0, end + ENTRY_HDR, END_BODY));
  if ((st = w_put(w, end, sizeof end, fn))) return st;
  *out_seq = seq;
  return w_flush(w, fn);
}

struct kvi__journal {
  int fd;
  char *path;
  uint64_t file_id;
  uint64_t seq; /* of the next entry */
  uint64_t end; /* file size: where the next entry goes */
  dev_t dev;
  ino_t ino;
  int dir_fd;      /* the directory holding it (O_PATH), -1 if it could not be opened */
  const char *base; /* its name in that directory (inside path) */
  bool failed; /* a flush failed: the file's state is unknown */
};

static void journal_free(kvi__journal *j) {
  if (!j) return;
  close(j->fd); /* releases the flock */
  if (j->dir_fd >= 0) close(j->dir_fd);
  free(j->path);
  free(j);
}

static kvi_status journal_put(void *ctx, const kvi__txn *t);
static kvi_status journal_remove(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, const char *fn);
static void journal_release(void *ctx) { journal_free(ctx); }

/* The store's journal hooks (store/store.h), registered with a journal. */
static const kvi__journal_ops journal_ops = {journal_put, journal_remove, journal_release};

/* The store's journal, or NULL (the lock held, or the store not shared yet). */
static kvi__journal *journal_of(const kvi_store *s) { return s->journal.ops == &journal_ops ? s->journal.ctx : NULL; }

/* Makes j (or none) the store's journal; returns the one it had. */
static kvi__journal *journal_set(kvi_store *s, kvi__journal *j) {
  kvi__journal *old = journal_of(s);
  s->journal.ops = j ? &journal_ops : NULL;
  s->journal.ctx = j;
  return old;
}

/* Completes a journal that owns `path` (a copy) and whose fd is open on the
 * file at that path (dev, ino): remembers the directory, so that a file
 * unlinked or replaced behind the journal's back is noticed (journal_usable)
 * however the process's working directory changes. */
static void journal_bind(kvi__journal *j, char *path) {
  j->path = path;
  char *dir = path_dir(path, &j->base);
  j->dir_fd = dir ? open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC) : -1;
  free(dir);
}

/* Refuses `path` when the file there is locked as a store's journal (in this
 * process or another), unless it is `own`. */
static kvi_status check_not_journal(const char *path, const kvi__journal *own, const char *fn) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return KVI_OK; /* absent; other problems show at the rename */
  struct stat sb;
  kvi_status st = KVI_OK;
  if (own && fstat(fd, &sb) == 0 && sb.st_dev == own->dev && sb.st_ino == own->ino) {
    /* the store's own journal: rewriting it is compaction */
  } else if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      st = kvi__fail(KVI_ERR_IO, fn,
                     "%s is the journal of an open store (in this process or another); close that journal "
                     "(kvi_store_journal_close) or, for this store's own journal, use kvi_store_journal_open",
                     path);
  } else {
    flock(fd, LOCK_UN);
  }
  close(fd);
  return st;
}

typedef struct snapfile {
  int fd; /* open and locked (keep), else -1 */
  uint64_t file_id, seq, end;
  dev_t dev;
  ino_t ino;
} snapfile;

#define TMP_TAG ".tmp."
#define TMP_HEX 16 /* a temporary's name is "<path>.tmp." and 16 random hex digits */

/* Creates "<path>.tmp.<16 random hex digits>" with O_EXCL | O_NOFOLLOW
 * (never an existing file or a symlink planted at the name), mode 0600
 * whatever the umask, and locks it (flock) while it is written: an unlocked
 * temporary of this path is one a save that died left behind
 * (remove_stale_temporaries). Returns the fd, or -1 with the error set. */
static int create_temporary(const char *path, char *tmp, size_t tlen, const char *fn) {
  for (int attempt = 0; attempt < 64; attempt++) {
    snprintf(tmp, tlen, "%s" TMP_TAG "%016llx", path, (unsigned long long)new_file_id());
    const int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) {
      io_fail(fn, errno, "creating", tmp);
      return -1;
    }
    struct stat a, b;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fchmod(fd, 0600) != 0 || fstat(fd, &a) != 0) {
      io_fail(fn, errno, "locking", tmp);
      close(fd);
      unlink(tmp);
      return -1;
    }
    /* another save's cleanup may have taken it for stale before the lock */
    if (lstat(tmp, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return fd;
    close(fd);
  }
  kvi__fail(KVI_ERR_IO, fn, "creating a temporary file beside %s: 64 random names were taken", path);
  return -1;
}

/* Removes the temporaries of `path` (its name, ".tmp." and 16 hex digits)
 * that are regular files of this user that nobody holds locked: left by a
 * save or journal open that died. Best effort; symlinks are never followed
 * or removed. */
static void remove_stale_temporaries(const char *path) {
  const char *base;
  char *dir = path_dir(path, &base);
  const int dfd = dir ? open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC) : -1;
  free(dir);
  DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
  if (!d) {
    if (dfd >= 0) close(dfd);
    return;
  }
  const size_t bl = strlen(base), tl = strlen(TMP_TAG);
  struct dirent *e;
  while ((e = readdir(d))) {
    const char *n = e->d_name;
    if (strlen(n) != bl + tl + TMP_HEX || strncmp(n, base, bl) != 0 || strncmp(n + bl, TMP_TAG, tl) != 0) continue;
    if (strspn(n + bl + tl, "0123456789abcdef") != TMP_HEX) continue;
    const int fd = openat(dfd, n, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) continue;
    struct stat a, b;
    if (fstat(fd, &a) == 0 && S_ISREG(a.st_mode) && a.st_uid == geteuid() && flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        fstatat(dfd, n, &b, AT_SYMLINK_NOFOLLOW) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
      unlinkat(dfd, n, 0);
    close(fd); /* releases the lock */
  }
  closedir(d);
}

/* Writes a snapshot to a temporary file beside `path` (create_temporary),
 * flushes it, renames it over `path`, flushes the directory and removes
 * stale temporaries of `path`. keep: the file stays open and locked as a
 * journal (*out). On error before the rename the temporary file is removed
 * and `path` is untouched. The store's lock is held. */
static kvi_status snapshot_file(const kvi_store *s, const char *path, bool one, uint64_t tenant, bool keep,
                                const kvi__journal *own, snapfile *out, const char *fn) {
  kvi_status st = check_not_journal(path, own, fn);
  if (st) return st;
  const size_t tlen = strlen(path) + 64;
  char *tmp = malloc(tlen);
  unsigned char *wbuf = malloc(WRITE_BUF);
  if (!tmp || !wbuf) {
    free(tmp);
    free(wbuf);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a write buffer");
  }
  const int fd = create_temporary(path, tmp, tlen, fn);
  if (fd < 0) {
    st = KVI_ERR_IO;
    goto out;
  }
  const uint64_t file_id = new_file_id();
  writer w = {fd, tmp, wbuf, 0};
  uint64_t seq = 0;
  if ((st = write_snapshot(s, &w, file_id, one, tenant, &seq, fn))) goto fail;
  if (fsync(fd) != 0) {
    st = io_fail(fn, errno, "flushing", tmp);
    goto fail;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    st = io_fail(fn, errno, "reading the size of", tmp);
    goto fail;
  }
  if (rename(tmp, path) != 0) {
    const int e = errno;
    st = kvi__fail(KVI_ERR_IO, fn, "renaming %s to %s: %s", tmp, path, strerror(e));
    goto fail;
  }
  /* from here on `path` is the new, complete file */
  if ((st = fsync_dir(path, fn))) {
    close(fd);
    goto out;
  }
  out->fd = -1;
  out->file_id = file_id;
  out->seq = seq;
  out->end = (uint64_t)sb.st_size;
  out->dev = sb.st_dev;
  out->ino = sb.st_ino;
  if (keep) out->fd = fd;
  else close(fd);
  remove_stale_temporaries(path);
  goto out;
fail:
  close(fd);
  unlink(tmp);
out:
  free(tmp);
  free(wbuf);
  return st;
}

static kvi_status check_path(const char *path, const char *fn) {
  if (!path) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "path is NULL");
  if (!*path) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "path is empty");
  if (!host_little_endian())
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "store files are defined for little-endian hosts only");
  return KVI_OK;
}

kvi_status kvi__store_save(const kvi_store *store, const char *path, const kvi_save_options *opts, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_status st = check_path(path, fn);
  if (st) return st;
  kvi_save_options o = KVI_SAVE_OPTIONS_INIT;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__SAVE_OPTIONS_V1, fn, "opts"))) return st;
  if (o.flags & ~KVI_SAVE_ONE_TENANT)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->flags has unknown bits 0x%x", o.flags & ~KVI_SAVE_ONE_TENANT);
  if (store->shard.emb_sharded)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "saving a store whose embeddings are sharded across ranks is not supported "
                                              "in this version");
  kvi_store *s = (kvi_store *)store; /* waiting for device work retires deferred pages */
  kvi__store_lock(s);
  st = kvi__store_wait_device(s, fn);
  snapfile sf;
  /* no `own` journal: saving over this store's own journal would orphan it */
  if (st == KVI_OK) st = snapshot_file(s, path, (o.flags & KVI_SAVE_ONE_TENANT) != 0, o.tenant, false, NULL, &sf, fn);
  kvi__store_unlock(s);
  return st;
}

kvi_status kvi__store_journal_open(kvi_store *store, const char *path, uint32_t flags, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_status st = check_path(path, fn);
  if (st) return st;
  if (flags) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "flags is 0x%x; no flags are defined (pass 0)", flags);
  if (store->shard.comm)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "a store with a communicator cannot take an append log in this version");
  kvi__journal *j = calloc(1, sizeof *j);
  char *copy = strdup(path);
  if (!j || !copy) {
    free(j);
    free(copy);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a journal");
  }
  kvi__store_lock(store);
  st = kvi__store_wait_device(store, fn);
  snapfile sf;
  if (st == KVI_OK) st = snapshot_file(store, path, false, 0, true, journal_of(store), &sf, fn);
  kvi__journal *old = NULL;
  if (st == KVI_OK) {
    j->fd = sf.fd;
    journal_bind(j, copy);
    j->file_id = sf.file_id;
    j->seq = sf.seq;
    j->end = sf.end;
    j->dev = sf.dev;
    j->ino = sf.ino;
    old = journal_set(store, j);
  }
  kvi__store_unlock(store);
  if (st) {
    free(j);
    free(copy);
    return st;
  }
  journal_free(old);
  return KVI_OK;
}

kvi_status kvi__store_journal_close(kvi_store *store, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi__store_lock(store);
  kvi__journal *j = journal_set(store, NULL);
  kvi__store_unlock(store);
  journal_free(j);
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* Journal appends (the store's lock is held)                                */
/* ------------------------------------------------------------------------ */

/* Completes the entry at `entry` (header space, then body_bytes of records),
 * writes it at the end of the journal and flushes it. */
static kvi_status journal_append(kvi__journal *j, unsigned char *entry, uint64_t body_bytes, uint32_t count,
                                 const char *fn) {
  entry_header(entry, KIND_FACTS, j->file_id, j->seq, body_bytes, count,
               kvi__crc32c(0, entry + ENTRY_HDR, (size_t)body_bytes));
  const size_t total = (size_t)(ENTRY_HDR + body_bytes);
  if (pwrite_all(j->fd, entry, total, j->end) != 0) {
    const int e = errno;
    /* take the partial entry back; if that fails too, the file's end is unknown */
    if (ftruncate(j->fd, (off_t)j->end) != 0 || fdatasync(j->fd) != 0) j->failed = true;
    return kvi__fail(KVI_ERR_IO, fn, "appending %zu bytes to the journal %s: %s%s", total, j->path, strerror(e),
                     j->failed ? "; the journal refuses further changes until kvi_store_journal_open" : "");
  }
  if (fdatasync(j->fd) != 0) {
    const int e = errno;
    j->failed = true; /* after a failed flush the page cache cannot be trusted (the change may or may not be on disk) */
    if (ftruncate(j->fd, (off_t)j->end) == 0) (void)fdatasync(j->fd);
    return kvi__fail(KVI_ERR_IO, fn,
                     "flushing the journal %s: %s; the journal refuses further changes until kvi_store_journal_open",
                     j->path, strerror(e));
  }
  j->end += total;
  j->seq++;
  return KVI_OK;
}

/* A journaled call appends only to a journal whose flushes all succeeded and
 * whose file is still the one at its path (appends to a file unlinked or
 * replaced since would be durable nowhere a load looks). */
static kvi_status journal_usable(const kvi__journal *j, const char *fn) {
  if (j->failed)
    return kvi__fail(KVI_ERR_IO, fn,
                     "the journal %s failed to flush earlier; reopen it with kvi_store_journal_open (nothing changed)",
                     j->path);
  struct stat sb;
  const int r = j->dir_fd >= 0 ? fstatat(j->dir_fd, j->base, &sb, 0) : stat(j->path, &sb);
  if (r != 0 || sb.st_dev != j->dev || sb.st_ino != j->ino)
    return kvi__fail(KVI_ERR_IO, fn,
                     "the journal %s was %s since it was opened: changes appended to it would be lost; reopen it with "
                     "kvi_store_journal_open (nothing changed)",
                     j->path, r != 0 ? "removed" : "replaced by another file");
  return KVI_OK;
}

/* The journal's put hook: the transaction's facts as one all-or-nothing
 * entry, flushed. It runs inside a call that writes the store, whose entry
 * point made the store's device current. */
static kvi_status journal_put(void *ctx, const kvi__txn *t) {
  kvi__journal *j = ctx;
  kvi_store *s = t->s;
  const char *fn = t->fn;
  const int32_t n = t->n;
  kvi_status st = KVI_OK;
  if (t->device_work && s->backend == KVI_BACKEND_CUDA && (st = kvi__cuda_sync(t->stream, fn)))
    return st; /* the pages are complete once the stream has passed */
  if ((st = journal_usable(j, fn))) return st;
  uint64_t body = 0;
  for (int32_t i = 0; i < n; i++) body += put_record_bytes(s, t->facts[i].tokens);
  unsigned char *entry = ENTRY_HDR + body <= SIZE_MAX ? malloc((size_t)(ENTRY_HDR + body)) : NULL;
  if (!entry)
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %llu-byte journal entry",
                     (unsigned long long)(ENTRY_HDR + body));
  unsigned char *rec = entry + ENTRY_HDR;
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi__txn_fact *x = &t->facts[i];
    st = fill_put(s, rec, x->tenant, x->id, x->tokens, kvi__txn_pages(t, i), x->emb, fn);
    rec += put_record_bytes(s, x->tokens);
  }
  if (st == KVI_OK) st = journal_append(j, entry, body, (uint32_t)n, fn);
  free(entry);
  return st;
}

/* The journal's remove hook. */
static kvi_status journal_remove(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, const char *fn) {
  (void)s;
  kvi__journal *j = ctx;
  kvi_status st = journal_usable(j, fn);
  if (st) return st;
  unsigned char entry[ENTRY_HDR + REC_HDR];
  unsigned char *rec = entry + ENTRY_HDR;
  memset(rec, 0, REC_HDR);
  put32(rec, OP_REMOVE);
  put64(rec + 8, tenant);
  put64(rec + 16, id);
  return journal_append(j, entry, REC_HDR, 1, fn);
}

/* ------------------------------------------------------------------------ */
/* Loading                                                                   */
/* ------------------------------------------------------------------------ */

typedef struct loader {
  const char *fn, *path;
  int fd;
  uint64_t size;
  uint64_t file_id;
  kvi_store *s;
  int32_t L, H, D, E;
  kvi_dtype dtype;
  int32_t P; /* fp8 files: tokens per scale, else 0 */
  uint64_t token_bytes;
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
    if (r < 0) return io_fail(ld->fn, errno, "reading", ld->path);
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
  if (get32(h + 8) != FORMAT_VERSION) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: format version %u; this library reads version %d", ld->path,
                   get32(h + 8), FORMAT_VERSION);
    goto out;
  }
  if (get32(h + 12) != ENDIAN_MARK) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn, "%s: written with another byte order (mark 0x%08x)", ld->path,
                   get32(h + 12));
    goto out;
  }
  const int32_t L = (int32_t)get32(h + 32);
  const uint32_t fp8_P = get32(h + 84); /* page_tokens of an fp8 file, else 0 */
  const bool fp8_file = get32(h + 64) == (uint32_t)KVI_DTYPE_FP8_E4M3;
  if (L < 1 || L > MAX_LAYERS || hb != HDR_BYTES(L) || get32(h + 80) != ROPE_BYTES ||
      (fp8_file ? fp8_P < 1 || fp8_P > 4096 : fp8_P != 0)) {
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
  if (fp8_file && fp8_P != (uint32_t)o->page_tokens) {
    st = kvi__fail(KVI_ERR_INCOMPATIBLE, ld->fn,
                   "%s: the file's fp8 facts have a scale per page of %u tokens, opts->page_tokens is %d", ld->path,
                   fp8_P, (int)o->page_tokens);
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
  rope_entries(mine, model->rope, L);
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
  uint64_t want, groups; /* fp8: the scales' (page, layer, K/V, head) groups, bounded before scale_bytes multiplies */
  if (r->tokens < 1 || __builtin_mul_overflow((uint64_t)r->tokens, ld->token_bytes, &want) ||
      __builtin_add_overflow(want, (uint64_t)ld->E * 4u, &want) ||
      __builtin_mul_overflow((uint64_t)r->tokens, 8u * (uint64_t)ld->L * (uint64_t)ld->H, &groups) ||
      __builtin_add_overflow(want, scale_bytes((uint64_t)r->tokens, ld->P, ld->L, ld->H), &want))
    return corrupt(ld, off, "fact record with %d tokens", (int)r->tokens);
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
  /* fp8 scales are what kvi__fp8_scale can give: 2^-126 .. FLT_MAX / 448 */
  const uint64_t nsc = scale_bytes((uint64_t)r->tokens, ld->P, ld->L, ld->H) / 4u;
  const unsigned char *sc = r->data + (size_t)ld->E * 4u + (size_t)r->tokens * (size_t)ld->token_bytes;
  for (uint64_t i = 0; i < nsc; i++) {
    float x;
    memcpy(&x, sc + 4 * (size_t)i, 4);
    if (!(x >= KVI__FP8_SCALE_MIN && x <= FLT_MAX / KVI__FP8_STORE_MAX))
      return corrupt(ld, off, "fp8 scale %llu of fact %llu is %g", (unsigned long long)i, (unsigned long long)r->id,
                     (double)x);
  }
  *at += REC_HDR + pad8(r->payload);
  return KVI_OK;
}

/* Stores one fact of a file (host view v: for an fp8 store, e4m3 bytes
 * with the pages' scales, kept as they are; emb: the embedding as it was
 * kept, or NULL) through a transaction of its own. */
static kvi_status load_fact(kvi_store *s, uint64_t tenant, uint64_t id, const kvi_kv_view *kv, const float *scales,
                            const float *emb, const char *fn) {
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
  if (st == KVI_OK) st = kvi__txn_take_pages(&t);
  if (st == KVI_OK) st = kvi__store_write_pages(s, kvi__txn_pages(&t, 0), &v, scales, NULL, fn);
  st = st == KVI_OK ? kvi__txn_commit(&t) : kvi__txn_abort(&t, st);
  kvi__store_unlock(s);
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
    return kvi__store_remove(ld->s, r->tenant, r->id, "kvi_store_remove");
  }
  if (exists) {
    if (!in_log)
      return corrupt(ld, eoff, "fact %llu of tenant %llu appears twice in the snapshot", (unsigned long long)r->id,
                     (unsigned long long)r->tenant);
    /* a replacement: room for one copy */
    if ((st = kvi__store_remove(ld->s, r->tenant, r->id, "kvi_store_remove"))) return st;
  }
  const unsigned char *k = r->data + (size_t)ld->E * 4u;
  const size_t plane = (size_t)r->tokens * (size_t)(ld->token_bytes / 2u);
  kvi_kv_view v;
  kvi__kv_view_contiguous(&v, KVI_MEMORY_HOST, ld->dtype, ld->L, r->tokens, ld->H, ld->D, (void *)k, (void *)(k + plane));
  /* the embedding copied to aligned memory, as the fp8 scales */
  const size_t eb = (size_t)ld->E * 4u, sb = ld->P > 0 ? (size_t)scale_bytes((uint64_t)r->tokens, ld->P, ld->L, ld->H) : 0;
  float *emb = ld->E ? malloc(eb) : NULL, *scales = ld->P > 0 ? malloc(sb) : NULL;
  if ((ld->E && !emb) || (ld->P > 0 && !scales)) {
    free(emb);
    free(scales);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, ld->fn, "allocating %zu bytes", eb + sb);
  }
  if (emb) memcpy(emb, r->data, eb);
  if (scales) memcpy(scales, k + 2 * plane, sb); /* fp8: bytes and scales as they were */
  st = load_fact(ld->s, r->tenant, r->id, &v, scales, emb, ld->fn);
  free(emb);
  free(scales);
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
  kvi_status st = check_path(path, fn);
  if (st) return st;
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  if (load_opts && (st = kvi__read_struct(&lo, sizeof lo, load_opts, KVI__LOAD_OPTIONS_V1, fn, "load_opts"))) return st;
  if (lo.flags & ~KVI_LOAD_JOURNAL)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "load_opts->flags has unknown bits 0x%x", lo.flags & ~KVI_LOAD_JOURNAL);
  kvi_store_options so = KVI_STORE_OPTIONS_INIT;
  if ((st = kvi__read_struct(&so, sizeof so, opts, KVI__STORE_OPTIONS_V1, fn, "opts"))) return st;
  if (kvi__dtype_size(so.dtype) == 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->dtype is %d, not a kvi_dtype", (int)so.dtype);
  const bool journal = (lo.flags & KVI_LOAD_JOURNAL) != 0;

  loader ld;
  memset(&ld, 0, sizeof ld);
  ld.fn = fn;
  ld.path = path;
  ld.fd = open(path, (journal ? O_RDWR : O_RDONLY) | O_CLOEXEC | O_NONBLOCK);
  if (ld.fd < 0) {
    if (errno == ENOENT) return kvi__fail(KVI_ERR_NOT_FOUND, fn, "no file %s", path);
    return io_fail(fn, errno, "opening", path);
  }
  kvi__journal *j = NULL;
  char *jpath = NULL;
  struct stat sb;
  if (fstat(ld.fd, &sb) != 0) {
    st = io_fail(fn, errno, "reading the size of", path);
    goto fail;
  }
  if (!S_ISREG(sb.st_mode)) {
    st = kvi__fail(KVI_ERR_IO, fn, "%s is not a regular file", path);
    goto fail;
  }
  if (journal && flock(ld.fd, LOCK_EX | LOCK_NB) != 0) {
    st = errno == EWOULDBLOCK ? kvi__fail(KVI_ERR_IO, fn, "%s is the journal of an open store (in this process or another)", path)
                              : io_fail(fn, errno, "locking", path);
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
  ld.P = so.dtype == KVI_DTYPE_FP8_E4M3 ? so.page_tokens : 0;
  ld.token_bytes = 2u * (uint64_t)ld.L * (uint64_t)ld.H * (uint64_t)ld.D * kvi__dtype_size(so.dtype);
  if ((st = kvi__shard_store_create(&ld.s, model, opts, "kvi_store_create"))) goto fail;
  uint64_t valid_end = 0, next_seq = 0;
  if ((st = read_entries(&ld, HDR_BYTES(ld.L), &valid_end, &next_seq))) goto fail;
  if (journal) {
    if (valid_end < ld.size && (ftruncate(ld.fd, (off_t)valid_end) != 0 || fsync(ld.fd) != 0)) {
      st = io_fail(fn, errno, "cutting the torn final entry off", path);
      goto fail;
    }
    j->fd = ld.fd;
    journal_bind(j, jpath);
    j->file_id = ld.file_id;
    j->seq = next_seq;
    j->end = valid_end;
    j->dev = sb.st_dev;
    j->ino = sb.st_ino;
    journal_set(ld.s, j); /* nobody else has the store yet */
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
