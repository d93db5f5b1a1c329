/*
 * libkvinject — optional shared libraries (cuBLASLt, NCCL) opened on first
 * use instead of being linked, so that libkvinject.so loads where they are
 * absent.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_DYNLIB_H
#define KVI_DYNLIB_H

#include <pthread.h>

#include "base/base.h"

/*
 * A library and the functions taken from it: `table` receives their
 * addresses in the order of `names` (NULL-terminated). `once` calls
 * kvi__dynlib_open on this descriptor; pthread_once runs it at most once per
 * process. Define one with KVI__DYNLIB below.
 */
typedef struct kvi__dynlib {
  const char *soname; /* "libnccl.so.2" */
  const char *what;   /* "NCCL" */
  const char *const *names;
  void **table;
  pthread_once_t once_flag;
  void (*once)(void);
  kvi_status status;  /* valid after the first kvi__dynlib_get / _usable */
  char error[384];
} kvi__dynlib;

/* What `once` calls: dlopen, then dlsym of every name. */
void kvi__dynlib_open(kvi__dynlib *d);

/* Opens the library on the first call (thread-safe); KVI_OK when it and
 * every function loaded, else KVI_ERR_NOT_BUILT with a message naming the
 * library and dlerror()'s text, recorded for `fn`. */
kvi_status kvi__dynlib_get(kvi__dynlib *d, const char *fn);

/* Whether the library loads (opening it if not tried yet); records no error. */
bool kvi__dynlib_usable(kvi__dynlib *d);

/*
 * KVI__DYNLIB(p, soname, what, FUNCS) defines the descriptor `p##_lib` for
 * the functions FUNCS(X) lists (X(name) each), and KVI__DYNFN(p, name) is the
 * loaded function, typed as the header declares it. A file then routes its
 * calls through the table with one line per function,
 *   #define ncclSend KVI__DYNFN(nccl, ncclSend)
 * (a macro is not expanded inside itself, so the name in the expansion is
 * the header's declaration) and calls the functions by their own names after
 * p##_lib has loaded.
 */
#define KVI__DYNLIB_INDEX(f) KVI__DYN_I_##f,
#define KVI__DYNLIB_NAME(f) #f,
#define KVI__DYNLIB(p, soname, what, FUNCS)                                                                \
  enum { FUNCS(KVI__DYNLIB_INDEX) p##_nfuncs };                                                            \
  static const char *const p##_names[] = {FUNCS(KVI__DYNLIB_NAME) NULL};                                   \
  static void *p##_table[p##_nfuncs];                                                                      \
  static void p##_once(void);                                                                              \
  static kvi__dynlib p##_lib = {soname, what, p##_names, p##_table, PTHREAD_ONCE_INIT, p##_once, KVI_OK, ""}; \
  static void p##_once(void) { kvi__dynlib_open(&p##_lib); }
#define KVI__DYNFN(p, f) ((__typeof__(&f))p##_table[KVI__DYN_I_##f])

#define KVI__STR_(x) #x
#define KVI__STR(x) KVI__STR_(x)

#endif /* KVI_DYNLIB_H */
