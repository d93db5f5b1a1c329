/*
 * The disk tier (kvinject/store.h, "Disk tier"): one store file per tenant
 * in the store's directory, "<tenant as 16 hex digits>.kvi", written through
 * (each write appends its records and flushes them before it returns, as a
 * journal does: the same format, the same crash rules), and a lease file
 * beside it, "<tenant>.lease", naming the replica that may write the tenant.
 * The store calls this file through its hooks (store/store.h,
 * kvi__disk_ops), its lock held; the records are written and read with the
 * journal's and the loader's code (journal.c, load.c, format.c).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "persist/internal.h"

#define OWNER_MAX 200  /* bytes of a replica's name */
#define LEASE_MS_DEFAULT 30000

/* One tenant the store has read or written. */
typedef struct dtenant {
  uint64_t id;
  kvi__journal j;       /* its file: path, fd (-1 when not open), file id, next entry, end */
  uint64_t live, dead;  /* bytes of its live records; of records and removals superseded since written */
  int64_t lease_until;  /* wall-clock ms until which this store holds its lease; 0: not held */
  bool seen;            /* the file's identity below is what this store last read or wrote */
  bool rw;              /* j.fd is open for writing too */
  struct dtenant *prev, *next; /* while j.fd is open: the list of open files, most recently used first */
  dev_t dev;
  ino_t ino;
  off_t size;
  struct timespec mtime;
} dtenant;

typedef struct kvi__disk {
  char *dir, *owner;
  uint64_t budget;
  int32_t lease_ms;
  kvi__map tenants; /* (tenant, 0) -> dtenant */
  struct dtenant *mru, *lru; /* the tenants whose files are open, most recently used first */
  size_t nopen;              /* how many; at most OPEN_MAX */
  fact_entry *last;          /* the entry the last read back was of, while a read holds it */
} kvi__disk;

/* Tenant files a store keeps open at once (each write and read reopens a
 * closed one): a store of many tenants stays far below the descriptor limit. */
#define OPEN_MAX 256

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char *tenant_path(const kvi__disk *d, uint64_t tenant, const char *ext) {
  const size_t n = strlen(d->dir) + 32;
  char *p = malloc(n);
  if (p) snprintf(p, n, "%s/%016llx%s", d->dir, (unsigned long long)tenant, ext);
  return p;
}

static kvi_status oom(const char *fn) { return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the disk tier's state"); }

/* The tenant's record (made when absent); NULL when out of memory. */
static dtenant *dt_get(kvi__disk *d, uint64_t tenant, const char *fn) {
  dtenant *dt = kvi__map_get(&d->tenants, tenant, 0);
  if (dt) return dt;
  dt = calloc(1, sizeof *dt);
  char *path = tenant_path(d, tenant, ".kvi");
  if (!dt || !path || kvi__map_reserve(&d->tenants, 1, fn) != KVI_OK) {
    free(dt);
    free(path);
    oom(fn);
    return NULL;
  }
  dt->id = tenant;
  dt->j.fd = -1;
  kvi__persist_journal_bind(&dt->j, path);
  if (dt->j.dir_fd >= 0) close(dt->j.dir_fd); /* one descriptor less per tenant: journal_usable stats the path */
  dt->j.dir_fd = -1;
  kvi__map_put(&d->tenants, tenant, 0, dt);
  return dt;
}

static void open_unlink(kvi__disk *d, dtenant *dt) {
  if (dt->prev) dt->prev->next = dt->next;
  else d->mru = dt->next;
  if (dt->next) dt->next->prev = dt->prev;
  else d->lru = dt->prev;
  dt->prev = dt->next = NULL;
}

static void open_link(kvi__disk *d, dtenant *dt) {
  dt->prev = NULL;
  dt->next = d->mru;
  if (d->mru) d->mru->prev = dt;
  else d->lru = dt;
  d->mru = dt;
}

/* Makes dt, whose file is open (in the list), the most recently used. */
static void open_touch(kvi__disk *d, dtenant *dt) {
  if (d->mru == dt) return;
  open_unlink(d, dt);
  open_link(d, dt);
}

static void dt_close(kvi__disk *d, dtenant *dt) {
  if (dt->j.fd < 0) return;
  close(dt->j.fd);
  dt->j.fd = -1;
  open_unlink(d, dt);
  d->nopen--;
}

/* Counts fd, just opened on dt's file, as dt's (rw: for writing too), and
 * closes the least recently used tenant's file while more than OPEN_MAX are
 * open (never dt's: it is the most recent). */
static void dt_opened(kvi__disk *d, dtenant *dt, int fd, bool rw) {
  dt->j.fd = fd;
  dt->rw = rw;
  d->nopen++;
  open_link(d, dt);
  while (d->nopen > OPEN_MAX && d->lru != dt) dt_close(d, d->lru);
}

/* dt's file open (for writing too: rw) as this store left it, reopened if
 * it was closed: KVI_OK; *changed when the file at the path is another one
 * (replaced since: its records' offsets are not the index's), nothing open.
 * A tenant without a file yet: KVI_OK, nothing open. */
static kvi_status dt_reopen(kvi__disk *d, dtenant *dt, bool rw, bool *changed, const char *fn) {
  *changed = false;
  if (dt->j.fd >= 0 && (dt->rw || !rw)) {
    open_touch(d, dt);
    return KVI_OK;
  }
  dt_close(d, dt);
  if (dt->j.file_id == 0) return KVI_OK;
  bool w = true;
  int fd = open(dt->j.path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && (errno == EACCES || errno == EROFS) && !rw)
    w = false, fd = open(dt->j.path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return errno == ENOENT ? (*changed = true, KVI_OK) : kvi__persist_io_fail(fn, errno, "opening the tenant file", dt->j.path);
  struct stat sb;
  if (fstat(fd, &sb) != 0 || sb.st_dev != dt->j.dev || sb.st_ino != dt->j.ino) {
    close(fd);
    *changed = true;
    return KVI_OK;
  }
  dt_opened(d, dt, fd, w);
  return KVI_OK;
}

/* Remembers the identity of the file as this store leaves it. */
static void dt_remember(dtenant *dt) {
  struct stat sb;
  dt->seen = dt->j.fd >= 0 && fstat(dt->j.fd, &sb) == 0;
  if (!dt->seen) return;
  dt->dev = sb.st_dev, dt->ino = sb.st_ino, dt->size = sb.st_size, dt->mtime = sb.st_mtim;
}

/* Whether the file at the tenant's path is not the one this store last
 * read or wrote (size, mtime, inode), or exists unseen. */
static bool dt_changed(const dtenant *dt) {
  struct stat sb;
  if (stat(dt->j.path, &sb) != 0) return dt->seen;
  return !dt->seen || sb.st_dev != dt->dev || sb.st_ino != dt->ino || sb.st_size != dt->size ||
         sb.st_mtim.tv_sec != dt->mtime.tv_sec || sb.st_mtim.tv_nsec != dt->mtime.tv_nsec;
}

/* Bytes of a stored fact's record. */
static uint64_t rec_bytes(const kvi_store *s, const fact *f) {
  return put_record_bytes(s, f->tokens, f->token_ids != NULL, f->ncontext);
}

static void set_end(kvi_store *s, dtenant *dt, uint64_t end) {
  s->disk.bytes = s->disk.bytes - dt->j.end + end;
  dt->j.end = end;
}

/* ---- leases --------------------------------------------------------------- */

/* Reads, under flock(LOCK_EX) on the lease file, its owner and expiry, and
 * writes it: take, this store for lease_ms from now (KVI_ERR_LEASED, nothing
 * written, when another owner's lease is live; *other: the lease was not
 * this store's); else (release) no owner, when it is this store's. */
static kvi_status lease_rmw(kvi__disk *d, dtenant *dt, bool take, int64_t now, bool *other, const char *fn) {
  char *path = tenant_path(d, dt->id, ".lease");
  if (!path) return oom(fn);
  kvi_status st = KVI_OK;
  const int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 || flock(fd, LOCK_EX) != 0) {
    st = kvi__persist_io_fail(fn, errno, fd < 0 ? "opening the lease file" : "locking the lease file", path);
    if (fd >= 0) close(fd);
    free(path);
    return st;
  }
  char buf[512], owner[OWNER_MAX + 1] = "";
  long long exp = 0;
  const ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  buf[n > 0 ? n : 0] = '\0';
  const char *o = strstr(buf, "owner=");
  if (o) {
    o += 6;
    const size_t len = strcspn(o, "\n");
    memcpy(owner, o, len < OWNER_MAX ? len : OWNER_MAX);
    owner[len < OWNER_MAX ? len : OWNER_MAX] = '\0';
  }
  const char *e = strstr(buf, "expiry_ms=");
  if (e) exp = strtoll(e + 10, NULL, 10);
  const bool mine = strcmp(owner, d->owner) == 0;
  if (take && owner[0] && !mine && exp > now) {
    st = kvi__fail(KVI_ERR_LEASED, fn, "tenant %llu is leased by \"%s\" for %lld more ms (%s)",
                   (unsigned long long)dt->id, owner, exp - now, path);
  } else if (take || mine) {
    char out[OWNER_MAX + 64];
    const long long until = take ? (long long)(now + d->lease_ms) : 0;
    const int len = snprintf(out, sizeof out, "owner=%s\nexpiry_ms=%lld\n", take ? d->owner : "", until);
    if (kvi__persist_pwrite_all(fd, out, (size_t)len, 0) != 0 || ftruncate(fd, len) != 0)
      st = kvi__persist_io_fail(fn, errno, "writing the lease file", path);
    if (st == KVI_OK && take) {
      *other = !mine;
      dt->lease_until = now + d->lease_ms;
    }
  }
  if (!take) dt->lease_until = 0;
  close(fd); /* releases the flock */
  free(path);
  return st;
}

/* ---- reading a tenant's file ------------------------------------------------ */

/* Forgets the tenant and indexes it again from its file (no file: no facts).
 * write: the store holds the lease: a torn final entry is cut off. */
static kvi_status reload(kvi__disk *d, kvi_store *s, dtenant *dt, bool write, const char *fn) {
  kvi__store_forget_tenant(s, dt->id);
  dt_close(d, dt);
  dt->live = dt->dead = 0;
  dt->j.failed = false;
  set_end(s, dt, 0);
  bool rw = true;
  int fd = open(dt->j.path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0 && (errno == EACCES || errno == EROFS) && !write)
    rw = false, fd = open(dt->j.path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    dt->seen = false;
    if (errno == ENOENT) return KVI_OK;
    return kvi__persist_io_fail(fn, errno, "opening the tenant file", dt->j.path);
  }
  struct stat sb;
  uint64_t file_id = 0, end = 0, seq = 0;
  kvi_status st = fstat(fd, &sb) == 0 ? KVI_OK : kvi__persist_io_fail(fn, errno, "reading the size of", dt->j.path);
  if (st == KVI_OK) st = kvi__persist_index_tenant(s, dt->id, fd, dt->j.path, &file_id, &end, &seq, fn);
  if (st == KVI_OK && write && end < (uint64_t)sb.st_size && (ftruncate(fd, (off_t)end) != 0 || fdatasync(fd) != 0))
    st = kvi__persist_io_fail(fn, errno, "cutting the torn final entry off", dt->j.path);
  if (st) {
    kvi__store_forget_tenant(s, dt->id); /* what was indexed before the failure */
    close(fd);
    dt->seen = false;
    return st;
  }
  dt_opened(d, dt, fd, rw);
  dt->j.file_id = file_id;
  dt->j.seq = seq;
  dt->j.dev = sb.st_dev;
  dt->j.ino = sb.st_ino;
  set_end(s, dt, end);
  s->disk.read_bytes += (uint64_t)sb.st_size;
  const tenant *t = kvi__store_tenant(s, dt->id);
  size_t nfacts = 0;
  for (const fact *f = t ? t->head : NULL; f; f = f->next, nfacts++) dt->live += rec_bytes(s, f);
  const uint64_t overhead = HDR_BYTES(s->geom.num_layers) + ENTRY_HDR + END_BODY + ENTRY_HDR * (uint64_t)nfacts;
  dt->dead = end > overhead + dt->live ? end - overhead - dt->live : 0;
  dt_remember(dt);
  return KVI_OK;
}

/* Writes the tenant's file anew (tmp + rename, as kvi_store_save): every
 * fact of the tenant, those on disk only copied from the old file; then the
 * facts' record offsets point into the new one. */
static kvi_status rewrite(kvi__disk *d, kvi_store *s, dtenant *dt, const char *fn) {
  snapfile sf;
  snapoffs offs = {0};
  kvi_status st = kvi__persist_snapshot_file(s, dt->j.path, true, dt->id, false, NULL, &sf, &offs, fn);
  if (st) return st;
  const int fd = open(dt->j.path, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    st = kvi__persist_io_fail(fn, errno, "opening the tenant file", dt->j.path);
    kvi__persist_snapoffs_free(&offs);
    return st;
  }
  for (size_t i = 0; i < offs.n; i++) {
    fact *f = (fact *)offs.facts[i];
    f->disk_entry = offs.entry[i];
    f->disk_rec = offs.entry[i] + ENTRY_HDR;
  }
  kvi__persist_snapoffs_free(&offs);
  dt_close(d, dt);
  dt_opened(d, dt, fd, true);
  dt->j.file_id = sf.file_id;
  dt->j.seq = sf.seq;
  dt->j.dev = sf.dev;
  dt->j.ino = sf.ino;
  dt->j.failed = false;
  set_end(s, dt, sf.end);
  dt->dead = 0;
  s->disk.writes++;
  s->disk.write_bytes += sf.end;
  dt_remember(dt);
  return KVI_OK;
}

/* ---- the store's hooks ------------------------------------------------------ */

static kvi_status disk_claim(void *ctx, kvi_store *s, uint64_t tenant, const char *fn) {
  kvi__disk *d = ctx;
  dtenant *dt = dt_get(d, tenant, fn);
  if (!dt) return KVI_ERR_OUT_OF_MEMORY;
  const int64_t now = now_ms();
  kvi_status st = KVI_OK;
  if (dt->lease_until - now <= d->lease_ms / 2) { /* take it, or renew it */
    bool other = false;
    if ((st = lease_rmw(d, dt, true, now, &other, fn))) return st;
    if (other || dt_changed(dt) || dt->j.failed) st = reload(d, s, dt, true, fn);
  } else if (dt->j.failed) {
    st = reload(d, s, dt, true, fn); /* a flush failed: what the file holds now is the truth */
  }
  if (st) return st;
  bool changed = false;
  if ((st = dt_reopen(d, dt, true, &changed, fn))) return st;
  if (changed && (st = reload(d, s, dt, true, fn))) return st; /* replaced while closed: its records are the truth */
  if (dt->j.fd < 0 || dt->dead > dt->live) st = rewrite(d, s, dt, fn); /* a new file, or compaction */
  return st;
}

static kvi_status disk_open(void *ctx, kvi_store *s, uint64_t tenant, const char *fn) {
  kvi__disk *d = ctx;
  dtenant *dt = kvi__map_get(&d->tenants, tenant, 0);
  if (dt && dt->lease_until > now_ms()) return KVI_OK; /* this store writes it: memory has it all */
  const bool have = kvi__store_tenant(s, tenant) != NULL;
  if (!dt) {
    char *path = tenant_path(d, tenant, ".kvi");
    if (!path) return oom(fn);
    const bool exists = access(path, F_OK) == 0;
    free(path);
    if (!exists) return KVI_OK; /* nothing to read */
    if (!(dt = dt_get(d, tenant, fn))) return KVI_ERR_OUT_OF_MEMORY;
  }
  if (have && !dt_changed(dt)) return KVI_OK;
  return reload(d, s, dt, false, fn);
}

/* The facts of the transaction's tenant `tn`, from index `from` on, as one
 * entry appended to its file. */
static kvi_status put_tenant(kvi__disk *d, const kvi__txn *t, int32_t from, dtenant *dt, const char *fn) {
  kvi_store *s = t->s;
  const uint64_t tn = t->facts[from].tenant;
  uint64_t body = 0;
  uint32_t count = 0;
  for (int32_t i = from; i < t->n; i++)
    if (t->facts[i].tenant == tn) body += put_record_bytes(s, t->facts[i].tokens, t->facts[i].ids != NULL, t->facts[i].nctx), count++;
  if (d->budget && s->disk.bytes + ENTRY_HDR + body > d->budget)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "the disk tier is full: writing %llu bytes to %s would pass opts->disk_budget_bytes (%llu bytes, "
                     "%llu in use); nothing was written",
                     (unsigned long long)(ENTRY_HDR + body), dt->j.path, (unsigned long long)d->budget,
                     (unsigned long long)s->disk.bytes);
  unsigned char *entry = ENTRY_HDR + body <= SIZE_MAX ? malloc((size_t)(ENTRY_HDR + body)) : NULL;
  if (!entry)
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a %llu-byte entry", (unsigned long long)(ENTRY_HDR + body));
  kvi_status st = KVI_OK;
  uint64_t at = ENTRY_HDR;
  for (int32_t i = from; i < t->n && st == KVI_OK; i++) {
    const kvi__txn_fact *x = &t->facts[i];
    if (x->tenant != tn) continue;
    st = kvi__persist_fill_put(s, entry + at, x->tenant, x->id, x->tokens, kvi__txn_pages(t, i), x->emb, x->ids, x->ctx,
                               x->nctx, x->stale, fn);
    x->f->disk_entry = dt->j.end;
    x->f->disk_rec = dt->j.end + at;
    at += put_record_bytes(s, x->tokens, x->ids != NULL, x->nctx);
  }
  const uint64_t old_end = dt->j.end;
  if (st == KVI_OK) st = kvi__persist_journal_append(&dt->j, entry, body, count, fn);
  free(entry);
  if (st) return st;
  s->disk.bytes += dt->j.end - old_end;
  s->disk.writes++;
  s->disk.write_bytes += dt->j.end - old_end;
  return KVI_OK;
}

static kvi_status disk_put(void *ctx, const kvi__txn *t) {
  kvi__disk *d = ctx;
  kvi_store *s = t->s;
  const char *fn = t->fn;
  kvi_status st = KVI_OK;
  if (t->device_work && s->backend == KVI_BACKEND_CUDA && (st = kvi__cuda_sync(t->stream, fn)))
    return st; /* the pages are complete once the stream has passed */
  dtenant **done = malloc((t->n ? (size_t)t->n : 1) * sizeof *done);
  uint64_t *ends = malloc((t->n ? (size_t)t->n : 1) * 2 * sizeof *ends);
  if (!done || !ends) st = oom(fn);
  int32_t ndone = 0;
  for (int32_t i = 0; i < t->n && st == KVI_OK; i++) {
    bool first = true; /* each tenant once, at its first fact */
    for (int32_t k = 0; k < i && first; k++) first = t->facts[k].tenant != t->facts[i].tenant;
    if (!first) continue;
    dtenant *dt = kvi__map_get(&d->tenants, t->facts[i].tenant, 0);
    bool changed = false;
    if (dt && (st = dt_reopen(d, dt, true, &changed, fn))) break;
    if (!dt || dt->j.fd < 0 || changed) {
      st = kvi__fail(KVI_ERR_IO, fn, "tenant %llu: its file %s was replaced or is not open for writing; nothing was written",
                     (unsigned long long)t->facts[i].tenant, dt ? dt->j.path : "(none)");
      break;
    }
    if ((st = kvi__persist_journal_usable(&dt->j, fn))) break;
    ends[2 * ndone] = dt->j.end, ends[2 * ndone + 1] = dt->j.seq;
    done[ndone] = dt;
    if ((st = put_tenant(d, t, i, dt, fn))) break;
    ndone++;
  }
  if (st) { /* the call fails: the tenants written before take their entries back */
    for (int32_t k = 0; k < ndone; k++) {
      dtenant *dt = done[k];
      bool changed = false;
      if (dt_reopen(d, dt, true, &changed, fn) != KVI_OK || changed || dt->j.fd < 0 ||
          ftruncate(dt->j.fd, (off_t)ends[2 * k]) != 0 || fdatasync(dt->j.fd) != 0)
        dt->j.failed = true;
      set_end(s, dt, ends[2 * k]);
      dt->j.seq = ends[2 * k + 1];
      dt_remember(dt);
    }
  } else {
    for (int32_t i = 0; i < t->n; i++) {
      dtenant *dt = kvi__map_get(&d->tenants, t->facts[i].tenant, 0);
      const fact *old = kvi__store_find(s, t->facts[i].tenant, t->facts[i].id); /* replaced: its record is dead */
      dt->live += put_record_bytes(s, t->facts[i].tokens, t->facts[i].ids != NULL, t->facts[i].nctx);
      if (old) dt->live -= rec_bytes(s, old), dt->dead += rec_bytes(s, old);
    }
    for (int32_t k = 0; k < ndone; k++) dt_remember(done[k]);
  }
  free(done);
  free(ends);
  return st;
}

static kvi_status disk_remove(void *ctx, kvi_store *s, uint64_t tenant, uint64_t id, uint32_t flags, const char *fn) {
  kvi__disk *d = ctx;
  dtenant *dt = kvi__map_get(&d->tenants, tenant, 0);
  const fact *f = kvi__store_find(s, tenant, id);
  bool changed = false;
  kvi_status st = dt && f ? dt_reopen(d, dt, true, &changed, fn) : KVI_OK;
  if (st) return st;
  if (!dt || dt->j.fd < 0 || !f || changed)
    return kvi__fail(KVI_ERR_IO, fn, "tenant %llu: its file was replaced or is not open for writing; nothing was removed",
                     (unsigned long long)tenant);
  st = kvi__persist_journal_usable(&dt->j, fn);
  if (st) return st;
  if (d->budget && s->disk.bytes + ENTRY_HDR + REC_HDR > d->budget)
    return kvi__fail(KVI_ERR_CAPACITY, fn,
                     "the disk tier is full: recording the removal in %s would pass opts->disk_budget_bytes (%llu "
                     "bytes); nothing was removed",
                     dt->j.path, (unsigned long long)d->budget);
  const uint64_t old_end = dt->j.end;
  if ((st = kvi__persist_journal_remove(&dt->j, tenant, id, flags, fn))) return st;
  s->disk.bytes += dt->j.end - old_end;
  s->disk.writes++;
  s->disk.write_bytes += dt->j.end - old_end;
  dt->live -= rec_bytes(s, f);
  dt->dead += rec_bytes(s, f) + ENTRY_HDR + REC_HDR;
  dt_remember(dt);
  return KVI_OK;
}

/* The tenant's file open for reading (it stays open while it is among the
 * OPEN_MAX most recently used). */
static kvi_status open_for_read(kvi__disk *d, dtenant *dt, const char *fn) {
  bool changed = false;
  kvi_status st = dt_reopen(d, dt, false, &changed, fn);
  if (st == KVI_OK && (changed || dt->j.fd < 0))
    st = kvi__fail(KVI_ERR_IO, fn,
                   "tenant %llu: its file %s was replaced by another replica since this store indexed it; "
                   "kvi_store_prefetch(store, tenant, NULL, 0, ...) reads it anew",
                   (unsigned long long)dt->id, dt->j.path);
  return st;
}

/* The entry of a read of f's record (io->fd open, io->entry set): the one
 * the last read was of when it is the same (same file, same offset, not
 * failed), else a new one; a reference either way. */
static kvi_status share_entry(kvi__disk *d, fact_io *io, const char *fn) {
  struct stat sb;
  if (fstat(io->fd, &sb) != 0) return kvi__persist_io_fail(fn, errno, "reading the identity of", io->path);
  fact_entry *fe = d->last;
  /* not fe->mu: the I/O thread holds it for the whole read of the entry, and
   * this runs under the store's lock (a prefetch held every call of the
   * store for the read of a 157 MiB entry). A read of the entry that is
   * still running is shared; one that failed is read again. */
  if (fe && fe->dev == sb.st_dev && fe->ino == sb.st_ino && fe->off == io->entry &&
      !atomic_load_explicit(&fe->failed, memory_order_acquire)) {
    fe->refs++;
    io->e = fe;
    return KVI_OK;
  }
  if (!(fe = calloc(1, sizeof *fe))) return oom(fn);
  atomic_init(&fe->failed, false);
  if (pthread_mutex_init(&fe->mu, NULL) != 0) {
    free(fe);
    return oom(fn);
  }
  fe->refs = 1;
  fe->slot = &d->last;
  fe->dev = sb.st_dev, fe->ino = sb.st_ino, fe->off = io->entry;
  d->last = fe;
  io->e = fe;
  return KVI_OK;
}

/* Drops a read's reference to its entry (the store's lock held). */
static void unshare_entry(fact_entry *fe) {
  if (!fe || --fe->refs > 0) return;
  if (*fe->slot == fe) *fe->slot = NULL;
  pthread_mutex_destroy(&fe->mu);
  free(fe->body);
  free(fe);
}

static void disk_discard(void *vio);

/* A read of f's record: the tenant file's fd duplicated (it stays valid
 * whatever happens to the tenant's state meanwhile), its path copied, its
 * entry shared with the other reads of that entry (share_entry). */
static kvi_status disk_prep(void *ctx, kvi_store *s, const fact *f, void **out, const char *fn) {
  (void)s;
  kvi__disk *d = ctx;
  dtenant *dt = kvi__map_get(&d->tenants, f->tenant_id, 0);
  if (!dt) return kvi__fail(KVI_ERR_INTERNAL, fn, "fact %llu of tenant %llu is on disk, its tenant file unknown",
                            (unsigned long long)f->id, (unsigned long long)f->tenant_id);
  kvi_status st = open_for_read(d, dt, fn);
  if (st) return st;
  fact_io *io = calloc(1, sizeof *io);
  if (!io || !(io->path = strdup(dt->j.path))) {
    free(io);
    return oom(fn);
  }
  if ((io->fd = fcntl(dt->j.fd, F_DUPFD_CLOEXEC, 0)) < 0) {
    st = kvi__persist_io_fail(fn, errno, "duplicating the descriptor of", dt->j.path);
    free(io->path);
    free(io);
    return st;
  }
  io->entry = f->disk_entry, io->rec = f->disk_rec;
  io->tenant = f->tenant_id, io->id = f->id, io->tokens = f->tokens;
  if ((st = share_entry(d, io, fn))) {
    disk_discard(io);
    return st;
  }
  *out = io;
  return KVI_OK;
}

static void disk_read(const kvi_store *s, void *io, const char *fn) { (void)kvi__persist_fact_io_read(s, io, fn); }

static kvi_status disk_publish(void *ctx, kvi_store *s, const fact *f, void *vio, const uint32_t *pages,
                               const char *fn) {
  (void)ctx;
  const fact_io *io = vio;
  s->disk.read_bytes += io->bytes;
  const kvi_status st = kvi__persist_fact_io_decode(s, io, f->stale, pages, NULL, fn);
  if (st == KVI_OK) s->disk.reads++;
  return st;
}

static void disk_discard(void *vio) {
  fact_io *io = vio;
  if (!io) return;
  close(io->fd);
  free(io->path);
  unshare_entry(io->e);
  free(io);
}

kvi_status kvi__persist_disk_record(const kvi_store *s, const fact *f, unsigned char *rec, const char *fn) {
  kvi_store *w = (kvi_store *)s; /* its counters, and the tenant's open file */
  void *io = NULL;
  kvi_status st = s->disk.ctx ? disk_prep(s->disk.ctx, w, f, &io, fn)
                              : kvi__fail(KVI_ERR_INTERNAL, fn, "a fact on disk in a store without a disk tier");
  if (st == KVI_OK) {
    disk_read(s, io, fn);
    w->disk.read_bytes += ((fact_io *)io)->bytes;
    st = kvi__persist_fact_io_decode(s, io, f->stale, NULL, rec, fn);
  }
  disk_discard(io);
  return st;
}

static void disk_release(void *ctx) {
  kvi__disk *d = ctx;
  const int64_t now = now_ms();
  for (size_t i = 0; i < d->tenants.cap; i++) {
    dtenant *dt = d->tenants.slots[i].val;
    if (!dt) continue;
    if (dt->lease_until > now) (void)lease_rmw(d, dt, false, now, NULL, "kvi_store_destroy"); /* best effort */
    dt_close(d, dt);
    if (dt->j.dir_fd >= 0) close(dt->j.dir_fd);
    free(dt->j.path);
    free(dt);
  }
  kvi__map_free(&d->tenants);
  free(d->dir);
  free(d->owner);
  free(d);
}

static const kvi__disk_ops disk_ops = {disk_claim,   disk_open, disk_put,     disk_remove,
                                       disk_prep,    disk_read, disk_publish, disk_discard,
                                       disk_release};

/* ---- creation and the entry points' work ------------------------------------ */

kvi_status kvi__disk_attach(kvi_store *s, const kvi_store_options *opts, const char *fn) {
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  kvi_status st = kvi__read_struct(&o, sizeof o, opts, KVI__STORE_OPTIONS_V1, fn, "opts");
  if (st || !o.disk_dir) return st;
  if (!*o.disk_dir) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->disk_dir is empty (NULL: no disk tier)");
  if ((st = kvi__persist_check_path(o.disk_dir, fn))) return st;
  if (o.disk_lease_ms < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->disk_lease_ms is %d", (int)o.disk_lease_ms);
  if (o.disk_owner && (!*o.disk_owner || strlen(o.disk_owner) > OWNER_MAX || strchr(o.disk_owner, '\n')))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "opts->disk_owner must be 1 to %d bytes without a newline",
                     OWNER_MAX);
  if (s->shard.comm)
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "a store with a communicator cannot have a disk tier in this version");
  struct stat sb;
  if (stat(o.disk_dir, &sb) != 0) return kvi__persist_io_fail(fn, errno, "opts->disk_dir: opening the directory", o.disk_dir);
  if (!S_ISDIR(sb.st_mode)) return kvi__fail(KVI_ERR_IO, fn, "opts->disk_dir %s is not a directory", o.disk_dir);
  kvi__disk *d = calloc(1, sizeof *d);
  if (!d || !(d->dir = strdup(o.disk_dir))) {
    free(d);
    return oom(fn);
  }
  /* writable: a file made and removed (access() would trust permission bits) */
  char *probe = tenant_path(d, kvi__persist_new_file_id(), ".probe");
  int fd = probe ? open(probe, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600) : -1;
  if (fd < 0) {
    st = probe ? kvi__fail(KVI_ERR_IO, fn, "opts->disk_dir %s is not writable: creating %s: %s", o.disk_dir, probe,
                           strerror(errno))
               : oom(fn);
  } else {
    close(fd);
    unlink(probe);
    kvi__persist_remove_stale_temporaries_in(o.disk_dir); /* once here, not per tenant file written */
  }
  free(probe);
  if (st == KVI_OK) {
    if (o.disk_owner) {
      d->owner = strdup(o.disk_owner);
    } else {
      char host[256] = "";
      gethostname(host, sizeof host - 1);
      d->owner = malloc(strlen(host) + 32);
      if (d->owner) snprintf(d->owner, strlen(host) + 32, "%s:%ld", host, (long)getpid());
    }
    if (!d->owner) st = oom(fn);
  }
  if (st) {
    free(d->owner);
    free(d->dir);
    free(d);
    return st;
  }
  d->budget = o.disk_budget_bytes;
  d->lease_ms = o.disk_lease_ms > 0 ? o.disk_lease_ms : LEASE_MS_DEFAULT;
  kvi__store_lock(s);
  s->disk.ops = &disk_ops;
  s->disk.ctx = d;
  kvi__store_unlock(s);
  return KVI_OK;
}

kvi_status kvi__store_tenant_release(kvi_store *store, uint64_t tenant, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  kvi_status st = KVI_OK;
  kvi__store_lock(store);
  kvi__disk *d = store->disk.ops == &disk_ops ? store->disk.ctx : NULL;
  dtenant *dt = d ? kvi__map_get(&d->tenants, tenant, 0) : NULL;
  const int64_t now = now_ms();
  if (dt && dt->lease_until > now) st = lease_rmw(d, dt, false, now, NULL, fn);
  if (dt) dt->lease_until = 0;
  kvi__store_unlock(store);
  return st;
}
