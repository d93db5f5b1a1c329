/*
 * Store files: the file helpers, I/O errors, whole writes, directories and
 * their flushes, random file ids, buffered writes, and the temporaries a
 * snapshot is written to before it is renamed into place.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "persist/internal.h"

kvi_status kvi__persist_io_fail(const char *fn, int err, const char *what, const char *path) {
  return kvi__fail(KVI_ERR_IO, fn, "%s %s: %s", what, path, strerror(err));
}

static kvi_status write_all(int fd, const void *data, size_t n, const char *path, const char *fn) {
  const unsigned char *p = data;
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return kvi__persist_io_fail(fn, w < 0 ? errno : ENOSPC, "writing", path);
    p += w;
    n -= (size_t)w;
  }
  return KVI_OK;
}

int kvi__persist_pwrite_all(int fd, const void *data, size_t n, uint64_t off) {
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
char *kvi__persist_path_dir(const char *path, const char **base) {
  const char *slash = strrchr(path, '/');
  if (base) *base = slash ? slash + 1 : path;
  return slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
}

/* Flushes the directory holding `path`, so that a rename in it is durable. */
kvi_status kvi__persist_fsync_dir(const char *path, const char *fn) {
  char *dir = kvi__persist_path_dir(path, NULL);
  if (!dir) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "copying a path");
  kvi_status st = KVI_OK;
  const int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) st = kvi__persist_io_fail(fn, errno, "opening the directory", dir);
  else if (fsync(fd) != 0) st = kvi__persist_io_fail(fn, errno, "flushing the directory", dir);
  if (fd >= 0) close(fd);
  free(dir);
  return st;
}

/* A random id for a new file, so that entries of another file never pass. */
uint64_t kvi__persist_new_file_id(void) {
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

kvi_status kvi__persist_w_flush(writer *w, const char *fn) {
  const kvi_status st = write_all(w->fd, w->buf, w->len, w->path, fn);
  w->len = 0;
  return st;
}

kvi_status kvi__persist_w_put(writer *w, const void *data, size_t n, const char *fn) {
  if (w->len + n > WRITE_BUF) {
    kvi_status st = kvi__persist_w_flush(w, fn);
    if (st) return st;
  }
  if (n >= WRITE_BUF) return write_all(w->fd, data, n, w->path, fn);
  memcpy(w->buf + w->len, data, n);
  w->len += n;
  return KVI_OK;
}

static bool host_little_endian(void) {
  const uint32_t one = 1;
  unsigned char b;
  memcpy(&b, &one, 1);
  return b == 1;
}

kvi_status kvi__persist_check_path(const char *path, const char *fn) {
  if (!path) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "path is NULL");
  if (!*path) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "path is empty");
  if (!host_little_endian())
    return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "store files are defined for little-endian hosts only");
  return KVI_OK;
}

#define TMP_TAG ".tmp."
#define TMP_HEX 16 /* a temporary's name is "<path>.tmp." and 16 random hex digits */

/* Creates "<path>.tmp.<16 random hex digits>" with O_EXCL | O_NOFOLLOW
 * (never an existing file or a symlink planted at the name), mode 0600
 * whatever the umask, and locks it (flock) while it is written: an unlocked
 * temporary of this path is one a save that died left behind
 * (kvi__persist_remove_stale_temporaries). Returns the fd, or -1 with the
 * error set. */
int kvi__persist_create_temporary(const char *path, char *tmp, size_t tlen, const char *fn) {
  for (int attempt = 0; attempt < 64; attempt++) {
    snprintf(tmp, tlen, "%s" TMP_TAG "%016llx", path, (unsigned long long)kvi__persist_new_file_id());
    const int fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) continue;
    if (fd < 0) {
      kvi__persist_io_fail(fn, errno, "creating", tmp);
      return -1;
    }
    struct stat a, b;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fchmod(fd, 0600) != 0 || fstat(fd, &a) != 0) {
      kvi__persist_io_fail(fn, errno, "locking", tmp);
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

/* Removes, in directory `dir`, the temporaries of the file named `base` (its
 * name, ".tmp." and 16 hex digits; base NULL: of any file) that are regular
 * files of this user that nobody holds locked: left by a save or journal
 * open that died. Best effort; symlinks are never followed or removed. */
static void sweep(const char *dir, const char *base) {
  const int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
  if (!d) {
    if (dfd >= 0) close(dfd);
    return;
  }
  const size_t tl = strlen(TMP_TAG);
  struct dirent *e;
  while ((e = readdir(d))) {
    const char *n = e->d_name;
    const size_t nl = strlen(n);
    if (nl <= tl + TMP_HEX || strncmp(n + nl - TMP_HEX - tl, TMP_TAG, tl) != 0) continue;
    if (base && (nl != strlen(base) + tl + TMP_HEX || strncmp(n, base, strlen(base)) != 0)) continue;
    if (strspn(n + nl - TMP_HEX, "0123456789abcdef") != TMP_HEX) continue;
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

void kvi__persist_remove_stale_temporaries(const char *path) {
  const char *base;
  char *dir = kvi__persist_path_dir(path, &base);
  if (dir) sweep(dir, base);
  free(dir);
}

void kvi__persist_remove_stale_temporaries_in(const char *dir) { sweep(dir, NULL); }
