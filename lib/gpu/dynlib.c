/*
 * Optional shared libraries opened on first use (see gpu.h).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "gpu/gpu.h"

void kvi__dynlib_open(kvi__dynlib *d) {
  d->status = KVI_ERR_NOT_BUILT;
  void *h = dlopen(d->soname, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *e = dlerror();
    snprintf(d->error, sizeof d->error, "%s is needed and could not be loaded: dlopen(\"%s\"): %s", d->what,
             d->soname, e ? e : "unknown error");
    return;
  }
  for (size_t i = 0; d->names[i]; i++) {
    dlerror();
    void *sym = dlsym(h, d->names[i]);
    const char *e = dlerror();
    if (!sym || e) {
      snprintf(d->error, sizeof d->error, "%s (%s) lacks %s: %s", d->what, d->soname, d->names[i],
               e ? e : "NULL symbol");
      dlclose(h);
      return;
    }
    d->table[i] = sym; /* POSIX: a void * holds a function's address */
  }
  d->status = KVI_OK; /* the handle stays open for the life of the process */
}

kvi_status kvi__dynlib_get(kvi__dynlib *d, const char *fn) {
  pthread_once(&d->once_flag, d->once);
  if (d->status != KVI_OK) return kvi__fail(d->status, fn, "%s", d->error);
  return KVI_OK;
}

bool kvi__dynlib_usable(kvi__dynlib *d) {
  pthread_once(&d->once_flag, d->once);
  return d->status == KVI_OK;
}
