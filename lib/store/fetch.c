/*
 * The disk tier's reads back (kvinject/store.h, "Disk tier"): a fact that
 * is on disk only gets pages and its record read into them, at once for a
 * reader (kvi__disk_resident) or by the store's I/O thread for
 * kvi_store_prefetch (kvi__disk_start). One mechanism: both take the pages
 * under the store's lock, read through the disk hooks' prep and read, and
 * publish under the lock (publish_job). A reader that needs a fact the
 * thread is reading waits for that read rather than reading twice.
 *
 * Locks: the store's lock, then qm (s->disk.jobs and the jobs' states); the
 * thread reads holding neither, and takes the store's lock before qm to
 * publish. Only a CPU store's thread publishes (a CUDA store's publication
 * copies to the device, whose context only the entry points make current):
 * a CUDA store's finished reads are published by the next call that needs
 * the fact, or by kvi_store_prefetch (kvi__disk_drain).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>

#include "store/store_impl.h"

enum { JOB_QUEUED, JOB_READING, JOB_READ };

typedef struct kvi__disk_job {
  fact *f;
  uint32_t *pages; /* f->npages pages of `from`, taken off its free stack */
  pool *from;
  void *io;        /* the disk hooks' read */
  int state;
  struct kvi__disk_job *next;
} kvi__disk_job;

/* Where a read back goes: a tiered store's host tier (promotion moves it
 * on), else the first pool. */
static pool *fetch_pool(kvi_store *s) { return s->pool.host.npages > 0 ? &s->pool.host : &s->pool.dev; }

/* Pages for f in its pool, dropping others to disk when short. */
static kvi_status take_pages(kvi_store *s, fact *f, uint32_t **out, const char *fn) {
  pool *p = fetch_pool(s);
  kvi_status st = kvi__disk_room(s, p, f->npages, fn);
  if (st) return st;
  *out = malloc((f->npages ? f->npages : 1) * sizeof **out);
  if (!*out) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %u page ids", f->npages);
  kvi__pool_take(p, *out, f->npages);
  return KVI_OK;
}

/* Ends a read back, the store's lock held, the job out of every list: keep
 * and a successful read, f gets the pages; else they go back. Frees the job. */
static kvi_status publish_job(kvi_store *s, kvi__disk_job *j, bool keep, const char *fn) {
  fact *f = j->f;
  kvi_status st = keep ? s->disk.ops->publish(s->disk.ctx, s, f, j->io, j->pages, fn) : KVI_OK;
  if (f->loading == j) f->loading = NULL;
  if (keep && st == KVI_OK) {
    f->pages = j->pages;
    f->owner->on_disk--, s->index.on_disk--;
    kvi__disk_note(s, f->owner);
    s->index.pages_stored += f->npages;
    kvi__store_touch(s, f);
  } else {
    kvi__pool_release(s, j->pages, f->npages); /* nothing else has them */
    free(j->pages);
  }
  s->disk.ops->discard(j->io);
  free(j);
  return st;
}

/* Takes j off the job list (qm held). */
static void unlist(kvi_store *s, kvi__disk_job *j) {
  for (kvi__disk_job **at = &s->disk.jobs; *at; at = &(*at)->next)
    if (*at == j) {
      *at = j->next;
      return;
    }
}

kvi_status kvi__disk_settle(kvi_store *s, fact *f, bool keep, const char *fn) {
  kvi__disk_job *j = f->loading;
  if (!j) return KVI_OK;
  pthread_mutex_lock(&s->disk.qm);
  while (j->state == JOB_READING) pthread_cond_wait(&s->disk.qcv, &s->disk.qm);
  const bool queued = j->state == JOB_QUEUED;
  unlist(s, j); /* the thread no longer sees it */
  pthread_mutex_unlock(&s->disk.qm);
  if (queued && keep) s->disk.ops->read(s, j->io, fn); /* not started: read here, once */
  return publish_job(s, j, keep, fn);
}

/* Reads fact f back now (not loading; pinned by the caller). */
static kvi_status fetch_now(kvi_store *s, fact *f, const char *fn) {
  kvi__disk_job j = {f, NULL, fetch_pool(s), NULL, JOB_READ, NULL};
  kvi_status st = take_pages(s, f, &j.pages, fn);
  if (st) return st;
  if ((st = s->disk.ops->prep(s->disk.ctx, s, f, &j.io, fn))) {
    kvi__pool_untake(j.from, j.pages, f->npages);
    free(j.pages);
    return st;
  }
  s->disk.ops->read(s, j.io, fn);
  kvi__disk_job *h = malloc(sizeof *h); /* publish_job frees its job */
  if (!h) {
    s->disk.ops->discard(j.io);
    kvi__pool_untake(j.from, j.pages, f->npages);
    free(j.pages);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a read");
  }
  *h = j;
  return publish_job(s, h, true, fn);
}

kvi_status kvi__disk_resident(kvi_store *s, fact *const *facts, size_t n, const char *fn) {
  if (!s->disk.ops) return KVI_OK;
  kvi_status st = KVI_OK;
  for (size_t i = 0; i < n && st == KVI_OK; i++) {
    fact *f = facts[i];
    if (f->loading) st = kvi__disk_settle(s, f, true, fn); /* waits for the thread's read */
    if (st == KVI_OK && !f->pages) st = fetch_now(s, f, fn);
  }
  return st;
}

/* The I/O thread: reads the oldest queued job without any lock; a CPU
 * store's thread then publishes it under the store's lock. */
static void *io_thread(void *arg) {
  kvi_store *s = arg;
  static const char fn[] = "kvi_store_prefetch";
  const bool publish = s->backend != KVI_BACKEND_CUDA;
  pthread_mutex_lock(&s->disk.qm);
  for (;;) {
    kvi__disk_job *j = s->disk.jobs;
    while (j && j->state != JOB_QUEUED) j = j->next;
    if (s->disk.stop) break;
    if (!j) {
      pthread_cond_wait(&s->disk.qcv, &s->disk.qm);
      continue;
    }
    j->state = JOB_READING;
    pthread_mutex_unlock(&s->disk.qm);
    s->disk.ops->read(s, j->io, fn);
    pthread_mutex_lock(&s->disk.qm);
    j->state = JOB_READ;
    pthread_cond_broadcast(&s->disk.qcv);
    if (!publish) continue;
    pthread_mutex_unlock(&s->disk.qm);
    kvi__store_lock(s);
    pthread_mutex_lock(&s->disk.qm);
    bool listed = false; /* a reader may have published it meanwhile (and freed it) */
    for (kvi__disk_job *k = s->disk.jobs; k && !listed; k = k->next) listed = k == j && k->state == JOB_READ;
    if (listed) unlist(s, j);
    pthread_mutex_unlock(&s->disk.qm);
    if (listed) (void)publish_job(s, j, true, fn); /* a failed read leaves the fact on disk */
    kvi__store_unlock(s);
    pthread_mutex_lock(&s->disk.qm);
  }
  pthread_mutex_unlock(&s->disk.qm);
  return NULL;
}

kvi_status kvi__disk_start(kvi_store *s, fact *f, const char *fn) {
  if (!s->disk.thread_on) {
    if (pthread_mutex_init(&s->disk.qm, NULL) != 0) return fetch_now(s, f, fn);
    if (pthread_cond_init(&s->disk.qcv, NULL) != 0) {
      pthread_mutex_destroy(&s->disk.qm);
      return fetch_now(s, f, fn);
    }
    s->disk.stop = false;
    if (pthread_create(&s->disk.thread, NULL, io_thread, s) != 0) {
      pthread_cond_destroy(&s->disk.qcv);
      pthread_mutex_destroy(&s->disk.qm);
      return fetch_now(s, f, fn); /* no thread: read at once */
    }
    s->disk.thread_on = true;
  }
  kvi__disk_job *j = calloc(1, sizeof *j);
  if (!j) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a read");
  j->f = f;
  j->from = fetch_pool(s);
  kvi_status st = take_pages(s, f, &j->pages, fn);
  if (st == KVI_OK && (st = s->disk.ops->prep(s->disk.ctx, s, f, &j->io, fn))) {
    kvi__pool_untake(j->from, j->pages, f->npages);
    free(j->pages);
  }
  if (st) {
    free(j);
    return st;
  }
  f->loading = j;
  pthread_mutex_lock(&s->disk.qm);
  kvi__disk_job **at = &s->disk.jobs;
  while (*at) at = &(*at)->next;
  *at = j; /* oldest first */
  pthread_cond_broadcast(&s->disk.qcv);
  pthread_mutex_unlock(&s->disk.qm);
  return KVI_OK;
}

void kvi__disk_settle_all(kvi_store *s, const char *fn) {
  while (s->disk.thread_on) {
    pthread_mutex_lock(&s->disk.qm);
    kvi__disk_job *j = s->disk.jobs;
    pthread_mutex_unlock(&s->disk.qm); /* only this lock holder takes jobs off the list */
    if (!j) return;
    (void)kvi__disk_settle(s, j->f, true, fn); /* a failed read leaves its fact on disk */
  }
}

kvi_status kvi__disk_drain(kvi_store *s, const char *fn) {
  if (!s->disk.thread_on) return KVI_OK;
  kvi_status st = KVI_OK;
  for (;;) {
    pthread_mutex_lock(&s->disk.qm);
    kvi__disk_job *j = s->disk.jobs;
    while (j && j->state != JOB_READ) j = j->next;
    if (j) unlist(s, j);
    pthread_mutex_unlock(&s->disk.qm);
    if (!j) return st;
    const kvi_status one = publish_job(s, j, true, fn);
    if (one == KVI_ERR_CUDA && st == KVI_OK) st = one; /* a failed read leaves its fact on disk */
  }
}

kvi_status kvi__disk_wait(kvi_store *s, const char *fn) {
  if (!s->disk.ops) return KVI_OK;
  kvi_status st = KVI_OK;
  for (;;) {
    kvi__store_lock(s);
    if (!s->disk.thread_on) {
      kvi__store_unlock(s);
      return st;
    }
    pthread_mutex_lock(&s->disk.qm);
    kvi__disk_job *j = s->disk.jobs, *done = NULL;
    for (kvi__disk_job *k = j; k && !done; k = k->next) done = k->state == JOB_READ ? k : NULL;
    if (done) unlist(s, done); /* published here (a CPU store's thread may not have come to it yet) */
    pthread_mutex_unlock(&s->disk.qm);
    if (done) {
      const kvi_status one = publish_job(s, done, true, fn); /* a failed read leaves its fact on disk */
      if (one == KVI_ERR_CUDA && st == KVI_OK) st = one;
    }
    kvi__store_unlock(s);
    if (!j) return st;
    if (done) continue;
    /* reads still queued or running: wait for one to end without the store's lock,
     * so that other calls go on meanwhile */
    pthread_mutex_lock(&s->disk.qm);
    bool busy = false;
    for (kvi__disk_job *k = s->disk.jobs; k && !busy; k = k->next) busy = k->state != JOB_READ;
    if (busy) pthread_cond_wait(&s->disk.qcv, &s->disk.qm);
    pthread_mutex_unlock(&s->disk.qm);
  }
}

void kvi__disk_stop(kvi_store *s) {
  if (!s->disk.thread_on) return;
  pthread_mutex_lock(&s->disk.qm);
  s->disk.stop = true;
  pthread_cond_broadcast(&s->disk.qcv);
  pthread_mutex_unlock(&s->disk.qm);
  pthread_join(s->disk.thread, NULL);
  while (s->disk.jobs) { /* the facts go with the store */
    kvi__disk_job *j = s->disk.jobs;
    s->disk.jobs = j->next;
    j->f->loading = NULL;
    s->disk.ops->discard(j->io);
    free(j->pages);
    free(j);
  }
  pthread_cond_destroy(&s->disk.qcv);
  pthread_mutex_destroy(&s->disk.qm);
  s->disk.thread_on = false;
}
