/*
 * Store files: the journal, an append log after a store's snapshot in the
 * same file. Opening one writes a snapshot (snapshot.c) and keeps the file
 * open and locked; the store's hooks then append one entry per journaled
 * call and flush it before the call returns, under the store's lock, so
 * that at most the last entry of a file can be incomplete after a crash.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "persist/internal.h"

static void journal_free(kvi__journal *j) {
  if (!j) return;
  close(j->fd); /* releases the flock */
  if (j->dir_fd >= 0) close(j->dir_fd);
  free(j->path);
  free(j);
}

static kvi_status journal_put(void *ctx, const kvi__txn *t);
static kvi_status journal_remove(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags,
                                 const char *fn);
static void journal_release(void *ctx) { journal_free(ctx); }

/* The store's journal hooks (store/store.h), registered with a journal. */
static const kvi__journal_ops journal_ops = {journal_put, journal_remove, journal_release};

/* The store's journal, or NULL (the lock held, or the store not shared yet). */
static kvi__journal *journal_of(const kvi_store *s) { return s->journal.ops == &journal_ops ? s->journal.ctx : NULL; }

/* Makes j (or none) the store's journal; returns the one it had. */
kvi__journal *kvi__persist_journal_set(kvi_store *s, kvi__journal *j) {
  kvi__journal *old = journal_of(s);
  s->journal.ops = j ? &journal_ops : NULL;
  s->journal.ctx = j;
  return old;
}

/* Completes a journal that owns `path` (a copy) and whose fd is open on the
 * file at that path (dev, ino): remembers the directory, so that a file
 * unlinked or replaced behind the journal's back is noticed (journal_usable)
 * however the process's working directory changes. */
void kvi__persist_journal_bind(kvi__journal *j, char *path) {
  j->path = path;
  char *dir = kvi__persist_path_dir(path, &j->base);
  j->dir_fd = dir ? open(dir, O_PATH | O_DIRECTORY | O_CLOEXEC) : -1;
  free(dir);
}

kvi_status kvi__store_journal_open(kvi_store *store, const char *path, uint32_t flags, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_status st = kvi__persist_check_path(path, fn);
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
  if (st == KVI_OK) st = kvi__persist_snapshot_file(store, path, false, 0, true, journal_of(store), &sf, NULL, fn);
  if (st == KVI_OK) kvi__persist_remove_stale_temporaries(path);
  kvi__journal *old = NULL;
  if (st == KVI_OK) {
    j->fd = sf.fd;
    kvi__persist_journal_bind(j, copy);
    j->file_id = sf.file_id;
    j->seq = sf.seq;
    j->end = sf.end;
    j->dev = sf.dev;
    j->ino = sf.ino;
    old = kvi__persist_journal_set(store, j);
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
  kvi__journal *j = kvi__persist_journal_set(store, NULL);
  kvi__store_unlock(store);
  journal_free(j);
  return KVI_OK;
}

/* ------------------------------------------------------------------------ */
/* Journal appends (the store's lock is held)                                */
/* ------------------------------------------------------------------------ */

/* Completes the entry at `entry` (header space, then body_bytes of records),
 * writes it at the end of the journal and flushes it. */
kvi_status kvi__persist_journal_append(kvi__journal *j, unsigned char *entry, uint64_t body_bytes, uint32_t count,
                                      const char *fn) {
  kvi__persist_entry_header(entry, KIND_FACTS, j->file_id, j->seq, body_bytes, count,
                            kvi__crc32c(0, entry + ENTRY_HDR, (size_t)body_bytes));
  const size_t total = (size_t)(ENTRY_HDR + body_bytes);
  if (kvi__persist_pwrite_all(j->fd, entry, total, j->end) != 0) {
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
kvi_status kvi__persist_journal_usable(const kvi__journal *j, const char *fn) {
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
  if ((st = kvi__persist_journal_usable(j, fn))) return st;
  uint64_t body = 0;
  for (int32_t i = 0; i < n; i++)
    body += put_record_bytes(s, t->facts[i].tokens, t->facts[i].ids != NULL, t->facts[i].nctx);
  unsigned char *entry = ENTRY_HDR + body <= SIZE_MAX ? malloc((size_t)(ENTRY_HDR + body)) : NULL;
  if (!entry)
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %llu-byte journal entry",
                     (unsigned long long)(ENTRY_HDR + body));
  unsigned char *rec = entry + ENTRY_HDR;
  for (int32_t i = 0; i < n && st == KVI_OK; i++) {
    const kvi__txn_fact *x = &t->facts[i];
    st = kvi__persist_fill_put(s, rec, x->tenant, x->id, x->tokens, kvi__txn_pages(t, i), x->emb, x->ids, x->ctx,
                               x->nctx, x->stale, fn);
    rec += put_record_bytes(s, x->tokens, x->ids != NULL, x->nctx);
  }
  if (st == KVI_OK) st = kvi__persist_journal_append(j, entry, body, (uint32_t)n, fn);
  free(entry);
  return st;
}

/* The journal's remove hook. */
static kvi_status journal_remove(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags,
                                 const char *fn) {
  (void)s;
  kvi__journal *j = ctx;
  kvi_status st = kvi__persist_journal_usable(j, fn);
  return st ? st : kvi__persist_journal_remove(j, tenant, id, flags, fn);
}

kvi_status kvi__persist_journal_remove(kvi__journal *j, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn) {
  unsigned char entry[ENTRY_HDR + REC_HDR];
  unsigned char *rec = entry + ENTRY_HDR;
  memset(rec, 0, REC_HDR);
  put32(rec, OP_REMOVE | ((flags & KVI_REMOVE_KEEP_DEPENDENTS) ? REC_KEEP_DEPENDENTS : 0u));
  put64(rec + 8, tenant);
  put64(rec + 16, id);
  return kvi__persist_journal_append(j, entry, REC_HDR, 1, fn);
}
