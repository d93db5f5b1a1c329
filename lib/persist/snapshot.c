/*
 * Store files: snapshots. A snapshot is written to a temporary file beside
 * its path, flushed and renamed over it (kvi_store_save, and
 * kvi_store_journal_open, which keeps the new file as its journal).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "persist/internal.h"

static int cmp_fact(const void *a, const void *b) {
  const fact *x = *(const fact *const *)a, *y = *(const fact *const *)b;
  if (x->tenant_id != y->tenant_id) return x->tenant_id < y->tenant_id ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

/* Writes the header, one FACTS entry per fact (sorted by tenant and id) and
 * the END entry. The store's lock is held. */
static kvi_status write_snapshot(const kvi_store *s, writer *w, uint64_t file_id, bool one, uint64_t tenant,
                                 uint64_t *out_seq, snapoffs *offs, const char *fn) {
  size_t hlen;
  unsigned char *hdr = kvi__persist_make_header(s, file_id, &hlen);
  if (!hdr) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a file header");
  kvi_status st = kvi__persist_w_put(w, hdr, hlen, fn);
  free(hdr);
  if (st) return st;

  size_t n = 0;
  /* one tenant: its own list (a disk tier writes a tenant's file at a time; a walk of the
   * whole store per file made N tenants cost N^2 facts) */
  const struct tenant *t1 = one ? kvi__store_tenant(s, tenant) : NULL;
  const size_t nall = one ? (t1 ? t1->count : 0) : kvi__store_fact_count(s);
  const fact **facts = malloc((nall ? nall : 1) * sizeof *facts);
  float *emb = malloc((size_t)(s->emb_dim ? s->emb_dim : 1) * sizeof *emb);
  if (!facts || !emb) {
    free(facts);
    free(emb);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "listing %zu facts", nall);
  }
  size_t pos = 0;
  if (one)
    for (const fact *f = t1 ? t1->head : NULL; f && n < nall; f = f->next) facts[n++] = f;
  else
    for (const fact *f; (f = kvi__store_next_fact(s, &pos));) facts[n++] = f;
  qsort(facts, n, sizeof *facts, cmp_fact);

  uint64_t seq = 0, payload_total = 0, fpos = hlen;
  uint32_t chain = 0;
  uint64_t *entry_off = offs ? malloc((n ? n : 1) * sizeof *entry_off) : NULL;
  if (offs && !entry_off) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "listing %zu facts", n);
  unsigned char *buf = NULL;
  size_t cap = 0;
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    const fact *f = facts[i];
    const uint64_t body = put_record_bytes(s, f->tokens, f->token_ids != NULL, f->ncontext);
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
    if (!f->pages) { /* on disk only (disk tier): its record as its tenant's file holds it */
      st = kvi__persist_disk_record(s, f, buf + ENTRY_HDR, fn);
    } else {
      if (s->emb_dim > 0 && (st = kvi__store_fact_embedding(s, f, emb, fn))) break;
      st = kvi__persist_fill_put(s, buf + ENTRY_HDR, f->tenant_id, f->id, f->tokens, f->pages, emb, f->token_ids,
                                 f->context, f->ncontext, f->stale, fn);
    }
    if (st) break;
    if (entry_off) entry_off[i] = fpos;
    fpos += ENTRY_HDR + body;
    const uint32_t crc = kvi__crc32c(0, buf + ENTRY_HDR, (size_t)body);
    kvi__persist_entry_header(buf, KIND_FACTS, file_id, seq++, body, 1, crc);
    st = kvi__persist_w_put(w, buf, (size_t)(ENTRY_HDR + body), fn);
    unsigned char c4[4];
    put32(c4, crc);
    chain = kvi__crc32c(chain, c4, 4);
    payload_total += put_payload(s, f->tokens, f->token_ids != NULL, f->ncontext);
  }
  free(buf);
  free(emb);
  if (st == KVI_OK && offs) { /* the caller's: where each fact's entry is */
    offs->facts = facts;
    offs->entry = entry_off;
    offs->n = n;
  } else {
    free(facts);
    free(entry_off);
  }
  if (st) return st;

  unsigned char end[ENTRY_HDR + END_BODY];
  put64(end + ENTRY_HDR, (uint64_t)n);
  put64(end + ENTRY_HDR + 8, payload_total);
  put32(end + ENTRY_HDR + 16, chain);
  put32(end + ENTRY_HDR + 20, 0);
  kvi__persist_entry_header(end, KIND_END, file_id, seq++, END_BODY, 0, kvi__crc32c(0, end + ENTRY_HDR, END_BODY));
  if (st == KVI_OK) st = kvi__persist_w_put(w, end, sizeof end, fn);
  if (st == KVI_OK) st = kvi__persist_w_flush(w, fn);
  if (st == KVI_OK) *out_seq = seq;
  else if (offs) kvi__persist_snapoffs_free(offs);
  return st;
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

/* Writes a snapshot to a temporary file beside `path`
 * (kvi__persist_create_temporary), flushes it, renames it over `path`,
 * and flushes the directory (stale temporaries are the caller's). keep: the
 * file stays open and locked as a journal (*out). On error before the
 * rename the temporary file is removed and `path` is untouched. The store's
 * lock is held. */
void kvi__persist_snapoffs_free(snapoffs *o) {
  free(o->facts);
  free(o->entry);
  memset(o, 0, sizeof *o);
}

kvi_status kvi__persist_snapshot_file(const kvi_store *s, const char *path, bool one, uint64_t tenant, bool keep,
                                      const kvi__journal *own, snapfile *out, snapoffs *offs, const char *fn) {
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
  const int fd = kvi__persist_create_temporary(path, tmp, tlen, fn);
  if (fd < 0) {
    st = KVI_ERR_IO;
    goto out;
  }
  const uint64_t file_id = kvi__persist_new_file_id();
  writer w = {fd, tmp, wbuf, 0};
  uint64_t seq = 0;
  if ((st = write_snapshot(s, &w, file_id, one, tenant, &seq, offs, fn))) goto fail;
  if (fsync(fd) != 0) {
    st = kvi__persist_io_fail(fn, errno, "flushing", tmp);
    goto fail;
  }
  struct stat sb;
  if (fstat(fd, &sb) != 0) {
    st = kvi__persist_io_fail(fn, errno, "reading the size of", tmp);
    goto fail;
  }
  if (rename(tmp, path) != 0) {
    const int e = errno;
    st = kvi__fail(KVI_ERR_IO, fn, "renaming %s to %s: %s", tmp, path, strerror(e));
    goto fail;
  }
  /* from here on `path` is the new, complete file */
  if ((st = kvi__persist_fsync_dir(path, fn))) {
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
  goto out;
fail:
  close(fd);
  unlink(tmp);
  if (offs) kvi__persist_snapoffs_free(offs);
out:
  free(tmp);
  free(wbuf);
  return st;
}

kvi_status kvi__store_save(const kvi_store *store, const char *path, const kvi_save_options *opts, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_status st = kvi__persist_check_path(path, fn);
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
  if (st == KVI_OK)
    st = kvi__persist_snapshot_file(s, path, (o.flags & KVI_SAVE_ONE_TENANT) != 0, o.tenant, false, NULL, &sf, NULL,
                                    fn);
  kvi__store_unlock(s);
  if (st == KVI_OK) kvi__persist_remove_stale_temporaries(path);
  return st;
}

