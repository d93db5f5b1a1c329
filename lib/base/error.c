/*
 * Status strings, the per-thread last error, and size-versioned structs.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "base/base.h"

static _Thread_local char last_error[512];

const char *kvi__status_string(kvi_status status) {
  switch (status) {
  case KVI_OK: return "success";
  case KVI_ERR_INVALID_ARGUMENT: return "invalid argument";
  case KVI_ERR_STRUCT_SIZE: return "struct size not supported";
  case KVI_ERR_OUT_OF_MEMORY: return "out of memory";
  case KVI_ERR_CAPACITY: return "store capacity exhausted";
  case KVI_ERR_EXISTS: return "fact already exists";
  case KVI_ERR_NOT_FOUND: return "fact not found";
  case KVI_ERR_MISMATCH: return "shape or dtype mismatch";
  case KVI_ERR_MEMORY_KIND: return "wrong kind of memory";
  case KVI_ERR_NOT_BUILT: return "not built into this library";
  case KVI_ERR_NO_DEVICE: return "no usable CUDA device";
  case KVI_ERR_CUDA: return "CUDA error";
  case KVI_ERR_UNSUPPORTED: return "not supported";
  case KVI_ERR_INTERNAL: return "internal error";
  case KVI_ERR_CORRUPT: return "corrupt store file";
  case KVI_ERR_INCOMPATIBLE: return "incompatible store file";
  case KVI_ERR_IO: return "I/O error";
  case KVI_ERR_PEER: return "failed on another rank";
  case KVI_ERR_TOKEN_MISMATCH: return "token ids differ";
  case KVI_ERR_STALE: return "fact is stale";
  case KVI_ERR_LEASED: return "tenant leased by another replica";
  }
  return "unknown status";
}

const char *kvi__last_error(void) { return last_error; }

kvi_status kvi__fail(kvi_status status, const char *fn, const char *fmt, ...) {
  int n = snprintf(last_error, sizeof last_error, "%s: ", fn);
  if (n < 0 || (size_t)n >= sizeof last_error) n = 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
  va_end(ap);
  return status;
}

kvi_status kvi__read_struct(void *local, size_t known, const void *user, size_t min_size,
                            const char *fn, const char *what) {
  size_t size;
  memcpy(&size, user, sizeof size);
  if (size < min_size)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn,
                     "%s->struct_size is %zu, smaller than the first version (%zu bytes); "
                     "initialize it with its _INIT macro",
                     what, size, min_size);
  if (size > KVI__STRUCT_SIZE_MAX)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "%s->struct_size is %zu, more than KVI_STRUCT_SIZE_MAX (%zu)", what,
                     size, KVI__STRUCT_SIZE_MAX);
  if (size > known) {
    const unsigned char *extra = (const unsigned char *)user + known;
    for (size_t i = 0; i < size - known; i++)
      if (extra[i] != 0)
        return kvi__fail(KVI_ERR_STRUCT_SIZE, fn,
                         "%s has struct_size %zu with non-zero byte %zu past the %zu bytes "
                         "this library version knows",
                         what, size, known + i, known);
  }
  memcpy(local, user, size < known ? size : known);
  memcpy(local, &known, sizeof known); /* the local copy is full-size */
  return KVI_OK;
}

kvi_status kvi__struct_array_open(kvi__struct_array *a, const void *elements, int64_t n, size_t min_size,
                                  const char *fn, const char *name) {
  a->base = (const char *)elements;
  a->stride = min_size;
  a->n = n;
  a->name = name;
  if (n <= 0) return KVI_OK;
  memcpy(&a->stride, elements, sizeof a->stride);
  if (a->stride < min_size)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn,
                     "%s[0].struct_size is %zu, smaller than the first version (%zu bytes); "
                     "initialize it with its _INIT macro",
                     name, a->stride, min_size);
  if (a->stride > KVI__STRUCT_SIZE_MAX)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "%s[0].struct_size is %zu, more than KVI_STRUCT_SIZE_MAX (%zu)", name,
                     a->stride, KVI__STRUCT_SIZE_MAX);
  return KVI_OK;
}

kvi_status kvi__struct_array_read(const kvi__struct_array *a, int64_t i, void *local, size_t known, size_t min_size,
                                  const char *fn) {
  const char *src = a->base + (size_t)i * a->stride;
  size_t sz;
  memcpy(&sz, src, sizeof sz);
  if (sz != a->stride)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "%s[%lld].struct_size is %zu, %s[0]'s is %zu; they must be equal",
                     a->name, (long long)i, sz, a->name, a->stride);
  char what[48];
  snprintf(what, sizeof what, "%s[%lld]", a->name, (long long)i);
  return kvi__read_struct(local, known, src, min_size, fn, what);
}

kvi_status kvi__init_struct(void *user, size_t size, const void *defaults, size_t known, size_t min_size,
                           const char *fn) {
  if (!user) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the struct pointer is NULL");
  if (size < min_size)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn,
                     "size is %zu, smaller than the first version of the struct (%zu bytes); pass sizeof *ptr",
                     size, min_size);
  if (size > KVI__STRUCT_SIZE_MAX)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "size is %zu, more than KVI_STRUCT_SIZE_MAX (%zu)", size,
                     KVI__STRUCT_SIZE_MAX);
  size_t n = size < known ? size : known;
  memcpy(user, defaults, n);
  if (size > known) memset((char *)user + known, 0, size - known);
  memcpy(user, &size, sizeof size);
  return KVI_OK;
}

kvi_status kvi__write_struct(void *user, const void *full, size_t known, size_t min_size,
                             const char *fn, const char *what) {
  size_t size;
  memcpy(&size, user, sizeof size);
  if (size < min_size)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn,
                     "%s->struct_size is %zu, smaller than the first version (%zu bytes)", what,
                     size, min_size);
  if (size > KVI__STRUCT_SIZE_MAX)
    return kvi__fail(KVI_ERR_STRUCT_SIZE, fn, "%s->struct_size is %zu, more than KVI_STRUCT_SIZE_MAX (%zu)", what,
                     size, KVI__STRUCT_SIZE_MAX);
  size_t n = size < known ? size : known;
  memcpy((char *)user + sizeof size, (const char *)full + sizeof size, n - sizeof size);
  return KVI_OK;
}
