/*
 * libkvinject — what the persist part's files share (private to lib/persist/:
 * only its .c files include it): the format's constants and byte codecs
 * (format.c writes with them, load.c reads), the file helpers (file.c), the
 * snapshot writer (snapshot.c) and the journal's state (journal.c).
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
 * kvi__store_remove to load) or through the store's read of a fact's pages (store/copy.c)
 * into a host view, so this part does not depend on the page layout or on
 * where pages live.
 */
#ifndef KVI_PERSIST_INTERNAL_H
#define KVI_PERSIST_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/types.h>

#include "persist/persist.h"
#include "store/store.h"

typedef struct kvi__journal kvi__journal;

/* ---- the format (format.c) ---------------------------------------------- */

static const unsigned char FILE_MAGIC[8] = {'K', 'V', 'I', 'S', 'T', 'O', 'R', 'E'};

enum {
  FORMAT_VERSION = 4,     /* written; 1 (facts without token ids), 2 (without contexts) and 3 (fp8
                             pages without key offsets) are read too */
  FORMAT_VERSION_FP8_OFFSETS = 4, /* the first whose fp8 pages keep key offsets (base/fp8.h) */
  FORMAT_VERSION_MIN = 1,
  HDR_FIXED = 88,  /* file header before the RoPE entries */
  ROPE_BYTES = 88, /* one layer's RoPE */
  ENTRY_HDR = 48,
  REC_HDR = 32,
  END_BODY = 24,
  KIND_FACTS = 1,
  KIND_END = 2,
  OP_PUT = 1,
  OP_REMOVE = 2,
  REC_TOKEN_IDS = 0x10000, /* version 2: a PUT record's type word has it when its payload ends with the token ids */
  REC_CONTEXT = 0x20000,   /* version 3: a PUT record's type word has it when its payload ends with the context */
  REC_KEEP_DEPENDENTS = 0x40000, /* version 3: a REMOVE record's, for a removal that made nothing stale */
  MAX_LAYERS = 65536,
};
#define ENDIAN_MARK 0x01020304u
#define ENTRY_MAGIC 0x4549564Bu /* "KVIE" */
#define HDR_BYTES(L) ((uint64_t)HDR_FIXED + (uint64_t)ROPE_BYTES * (uint64_t)(L) + 4u)
#define WRITE_BUF (1u << 20)

static inline void put32(unsigned char *p, uint32_t v) {
  p[0] = (unsigned char)v, p[1] = (unsigned char)(v >> 8), p[2] = (unsigned char)(v >> 16), p[3] = (unsigned char)(v >> 24);
}
static inline void put64(unsigned char *p, uint64_t v) {
  put32(p, (uint32_t)v);
  put32(p + 4, (uint32_t)(v >> 32));
}
static inline void putf64(unsigned char *p, double d) {
  uint64_t u;
  memcpy(&u, &d, 8);
  put64(p, u);
}
static inline uint32_t get32(const unsigned char *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t get64(const unsigned char *p) { return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32; }
static inline double getf64(const unsigned char *p) {
  const uint64_t u = get64(p);
  double d;
  memcpy(&d, &u, 8);
  return d;
}

static inline uint64_t pad8(uint64_t n) { return (n + 7u) & ~(uint64_t)7u; }

/* Bytes of one token's K and V for every layer and local head. */
static inline uint64_t token_bytes(const kvi_store *s) {
  return kvi__dtype_bytes(s->dtype,
                          2u * (uint64_t)s->geom.num_layers * (uint64_t)s->geom.local_heads * (uint64_t)s->geom.head_size);
}

/* Quantized stores: bytes of the scales of a fact of `tokens` tokens (each
 * of its pages' scales as the page keeps them, page_scale of them: fp8 one
 * fp32 per layer, K/V and head; q4 base/q4.h's words); 0 for other dtypes
 * (P = 0). */
static inline uint64_t scale_bytes(uint64_t tokens, int32_t P, uint64_t page_scale) {
  return P > 0 ? (tokens + (uint64_t)P - 1u) / (uint64_t)P * page_scale : 0u;
}

/* Bytes of a page's scales in a file of format `version`: the store's
 * (kvi__page_scale_bytes), but fp8 pages of files before version 4 keep
 * their scales alone, no key offsets. */
static inline uint64_t file_page_scale(kvi_dtype dtype, int32_t L, int32_t H, int32_t D, int32_t P, uint32_t version) {
  if (dtype == KVI_DTYPE_FP8_E4M3 && version < FORMAT_VERSION_FP8_OFFSETS) return (uint64_t)L * 2u * (uint64_t)H * 4u;
  return kvi__page_scale_bytes(dtype, L, H, D, P);
}

/* The context section of a fact with nctx > 0 context ids: their count
 * (u32), its stale flag (u32: 0 or 1), the ids (u64); 0 bytes without. */
static inline uint64_t context_bytes(int32_t nctx) { return nctx > 0 ? 8u + 8u * (uint64_t)nctx : 0u; }

/* A stored fact's record payload: embedding, then K, then V, then
 * (quantized stores) the scales, then (ids: a fact with token ids) its token
 * ids as int32, then (nctx > 0) its context section. */
static inline uint64_t put_payload(const kvi_store *s, int32_t tokens, bool ids, int32_t nctx) {
  return (uint64_t)s->emb_dim * 4u + (uint64_t)tokens * token_bytes(s) +
         scale_bytes((uint64_t)tokens, s->scale_bytes ? s->P : 0, s->scale_bytes) + (ids ? (uint64_t)tokens * 4u : 0u) +
         context_bytes(nctx);
}

static inline uint64_t put_record_bytes(const kvi_store *s, int32_t tokens, bool ids, int32_t nctx) {
  return REC_HDR + pad8(put_payload(s, tokens, ids, nctx));
}

/* The RoPE entries of a file header for n_layers layers (format.c). */
void kvi__persist_rope_entries(unsigned char *out, const kvi__rope *rope, int32_t n_layers);
/* A store's file header, HDR_BYTES(L) bytes with its CRC (malloc'd; NULL
 * when out of memory). */
unsigned char *kvi__persist_make_header(const kvi_store *s, uint64_t file_id, size_t *out_len);
/* An entry header (ENTRY_HDR bytes) with its CRC. */
void kvi__persist_entry_header(unsigned char *h, uint32_t kind, uint64_t file_id, uint64_t seq, uint64_t body_bytes,
                               uint32_t count, uint32_t body_crc);
/* A PUT record (put_record_bytes) of a fact whose data is in `pages`, with
 * its token ids (NULL: none) and its context (nctx ids, stale flag; 0: none). */
kvi_status kvi__persist_fill_put(const kvi_store *s, unsigned char *rec, uint64_t tenant, uint64_t id, int32_t tokens,
                                 const uint32_t *pages, const float *emb, const int32_t *ids, const uint64_t *ctx,
                                 int32_t nctx, bool stale, const char *fn);

/* ---- files (file.c) ----------------------------------------------------- */

/* KVI_ERR_IO with "<what> <path>: <strerror(err)>". */
kvi_status kvi__persist_io_fail(const char *fn, int err, const char *what, const char *path);
/* pwrite of all n bytes at off; 0, or -1 with errno set. */
int kvi__persist_pwrite_all(int fd, const void *data, size_t n, uint64_t off);
/* The directory part of a path (a fresh string) and where its last
 * component starts. */
char *kvi__persist_path_dir(const char *path, const char **base);
/* Flushes the directory holding `path`. */
kvi_status kvi__persist_fsync_dir(const char *path, const char *fn);
/* A random id for a new file. */
uint64_t kvi__persist_new_file_id(void);
/* Refuses a NULL or empty path, and big-endian hosts. */
kvi_status kvi__persist_check_path(const char *path, const char *fn);

/* Buffered sequential writes. */
typedef struct writer {
  int fd;
  const char *path;
  unsigned char *buf;
  size_t len;
} writer;

kvi_status kvi__persist_w_flush(writer *w, const char *fn);
kvi_status kvi__persist_w_put(writer *w, const void *data, size_t n, const char *fn);

/* A locked temporary file beside `path`, its name into tmp; the fd or -1. */
int kvi__persist_create_temporary(const char *path, char *tmp, size_t tlen, const char *fn);
/* Removes the temporaries of `path` that a save which died left (a scan of
 * its directory). */
void kvi__persist_remove_stale_temporaries(const char *path);
/* The same for every file of directory `dir`, in one scan (a disk tier's
 * directory, when the store opens it). */
void kvi__persist_remove_stale_temporaries_in(const char *dir);

/* ---- snapshots (snapshot.c) --------------------------------------------- */

typedef struct snapfile {
  int fd; /* open and locked (keep), else -1 */
  uint64_t file_id, seq, end;
  dev_t dev;
  ino_t ino;
} snapfile;

/* Where a snapshot wrote each fact's entry (offs: facts[i]'s at entry[i]),
 * for a disk tier's rewritten tenant file. */
typedef struct snapoffs {
  const fact **facts;
  uint64_t *entry;
  size_t n;
} snapoffs;
void kvi__persist_snapoffs_free(snapoffs *o);

/* Writes the store's facts (one: only `tenant`'s) as a new file at `path`;
 * keep: *out's fd stays open and locked, for a journal; offs (or NULL):
 * receives where each fact's entry went (freed on error). Facts on disk only
 * (disk tier) are copied from their tenant's file. Stale temporaries are
 * the caller's: a save or journal sweeps beside its file, a disk tier its
 * directory once when the store opens it (a scan per tenant file would cost
 * N tenants N^2 directory entries). The store's lock is held. */
kvi_status kvi__persist_snapshot_file(const kvi_store *s, const char *path, bool one, uint64_t tenant, bool keep,
                                      const kvi__journal *own, snapfile *out, snapoffs *offs, const char *fn);

/* ---- the journal (journal.c) -------------------------------------------- */

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

/* Completes the entry at `entry` (header space, then body_bytes of records),
 * writes it at the end of j's file and flushes it (a failed write is cut
 * back off; a failed flush marks j failed). */
kvi_status kvi__persist_journal_append(kvi__journal *j, unsigned char *entry, uint64_t body_bytes, uint32_t count,
                                      const char *fn);
/* Appends one REMOVE record (KVI_REMOVE_* flags) for fact `id` of `tenant`
 * to j, as kvi__persist_journal_append (the caller has checked that j is
 * usable). */
kvi_status kvi__persist_journal_remove(kvi__journal *j, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn);
/* KVI_ERR_IO when j failed to flush, or its file is no longer the one at
 * its path. */
kvi_status kvi__persist_journal_usable(const kvi__journal *j, const char *fn);
/* Makes j (or none) the store's journal; returns the one it had. */
kvi__journal *kvi__persist_journal_set(kvi_store *s, kvi__journal *j);
/* Gives j its path (a copy it now owns) and opens the directory holding it. */
void kvi__persist_journal_bind(kvi__journal *j, char *path);

/* ---- the loader (load.c; header.c reads the file header) ----------------- */

/* The fuzz target checks everything but the checksums, so that mutated
 * files reach the parser's deeper checks. */
#ifdef KVI_FUZZING
#define CRC_OK(stored, computed) ((void)(stored), (void)(computed), true)
#else
#define CRC_OK(stored, computed) ((stored) == (computed))
#endif

/* A file being read. */
typedef struct loader {
  const char *fn, *path;
  int fd;
  uint64_t size;
  uint64_t file_id;
  kvi_store *s;
  int32_t L, H, D, E;
  kvi_dtype dtype;
  int32_t P; /* quantized (fp8, q4) files: tokens per page of scales, else 0 */
  uint64_t page_scale; /* quantized files: bytes of a page's scales as the file keeps them
                          (file_page_scale) */
  uint64_t token_bytes;
  uint32_t version; /* the file's format version */
  bool index_only;  /* a disk tier's tenant file: facts indexed on disk only (index_apply) */
  uint64_t tenant;  /* with index_only: the file's tenant */
} loader;

/* KVI_ERR_CORRUPT naming the file and the offset. */
kvi_status kvi__persist_corrupt(const loader *ld, uint64_t off, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Reads n bytes at off (KVI_ERR_IO when the file is shorter). */
kvi_status kvi__persist_rd(const loader *ld, uint64_t off, void *buf, size_t n);
/* Reads and checks the header against the model and the store options;
 * sets ld->version and ld->file_id. */
kvi_status kvi__persist_read_header(loader *ld, const kvi_model *model, const kvi_store_options *o);

/* ---- the disk tier (disk.c, and load.c's readers of tenant files) ------- */

/* Indexes the tenant file open at fd (the store's configuration checked in
 * its header) into s, its facts on disk only; the store's lock is held and
 * the tenant is not in the store. *valid_end: the end of its last complete
 * entry (a torn final entry is left out), *next_seq the next entry's
 * number. */
kvi_status kvi__persist_index_tenant(kvi_store *s, uint64_t tenant, int fd, const char *path, uint64_t *file_id,
                                     uint64_t *valid_end, uint64_t *next_seq, const char *fn);
/* One entry of a tenant file, read and checked once for all the reads of
 * its facts that overlap (an encode call's captures are one entry: a
 * prefetch of them reads it once, not once a fact). refs, and the disk
 * tier's pointer to it (*slot), change under the store's lock; mu orders
 * the read, which may run without that lock and holds mu while it reads:
 * whoever holds the store's lock must not wait for mu (it would wait out the
 * whole read, and every call of the store with it); `failed` says, without
 * mu, that a finished read failed (a later read of the entry reads again). */
typedef struct fact_entry {
  pthread_mutex_t mu;
  int refs;
  bool done;                /* under mu: body, or st and msg, are final */
  _Atomic bool failed;      /* done, and st is not KVI_OK (set under mu, read without it) */
  struct fact_entry **slot; /* the disk tier's pointer to the entry it read last, cleared when this goes */
  dev_t dev;                /* the file (st_dev, st_ino) and the entry's offset in it */
  ino_t ino;
  uint64_t off;
  unsigned char *body;      /* the entry's body, its checksum checked */
  uint64_t body_len;
  kvi_status st;            /* of the read, with its message */
  char msg[512];
} fact_entry;

/* A read of one fact's record back from its tenant file: what it needs,
 * taken under the store's lock (fd, path: owned by whoever made it; the
 * entry shared, one reference), then kvi__persist_fact_io_read, which
 * touches no state of the store but its geometry (so it may run without the
 * lock, on another thread), then kvi__persist_fact_io_decode under the
 * lock. */
typedef struct fact_io {
  int fd;
  char *path;
  uint64_t entry, rec; /* the fact's entry and record offsets */
  uint64_t tenant, id;
  int32_t tokens;
  fact_entry *e;       /* its entry; e->off == entry */
  const unsigned char *body; /* e->body once read (not owned) */
  uint64_t body_len, bytes;  /* bytes: what this read took from the file (0 when another read of the entry did) */
  kvi_status st;       /* of the read, with its message */
  char msg[512];
} fact_io;
/* Reads the fact's entry (its checksum checked), unless a read of the same
 * entry did: io->body; sets io->st and io->msg; adds the bytes read to
 * io->bytes. */
kvi_status kvi__persist_fact_io_read(const kvi_store *s, fact_io *io, const char *fn);
/* The read's failure (for fn), or its record decoded: into `pages` (raw
 * NULL), or as the record's bytes (put_record_bytes) into raw, its stale
 * flag as `stale`. */
kvi_status kvi__persist_fact_io_decode(const kvi_store *s, const fact_io *io, bool stale, const uint32_t *pages,
                                       unsigned char *raw, const char *fn);
/* A fact on disk only: its record's bytes (put_record_bytes) into rec, read
 * from its tenant's file (a snapshot of it). */
kvi_status kvi__persist_disk_record(const kvi_store *s, const fact *f, unsigned char *rec, const char *fn);

#endif /* KVI_PERSIST_INTERNAL_H */
