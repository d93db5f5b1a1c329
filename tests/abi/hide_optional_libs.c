/*
 * An LD_PRELOAD shim for tests/abi/test_optional_libs.c: dlopen of any
 * libnccl or libcublasLt fails, as on a machine where they are not
 * installed (the loader's own message, for a path that does not exist).
 * Everything else goes to the real dlopen.
 * SPDX-License-Identifier: Apache-2.0
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>

void *dlopen(const char *name, int flags) {
  static void *(*real)(const char *, int);
  if (!real) real = (void *(*)(const char *, int))dlsym(RTLD_NEXT, "dlopen");
  if (name && (strstr(name, "libnccl") || strstr(name, "libcublasLt")))
    return real("/nonexistent/hidden-by-hide_optional_libs.so", flags);
  return real(name, flags);
}
