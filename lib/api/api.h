/*
 * libkvinject — the api part (lib/api/): the library's public entry points.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Every KVI_API function is defined in a file of this folder, and nowhere
 * else. An entry point finds its handle's device (the part's kvi__*_device
 * accessor: a device number, or -1 for a CPU handle and for NULL, which the
 * internal function then refuses with its own message), makes it current once
 * with KVI__API_ON before any other work, calls its part's internal
 * function, and gives the caller's device back on every path out. Nothing
 * below lib/api/ changes the current device: the parts run on whatever
 * device their entry point made current, and a part never calls a public
 * function (tests/layers/check_layers.py checks all three rules).
 */
#ifndef KVI_API_PART_H
#define KVI_API_PART_H

#include "gpu/gpu.h"

/* One entry point's hold on a device. */
typedef struct kvi__api_dev {
  kvi__devguard guard;
  bool entered;
} kvi__api_dev;

/* Makes `device` current (a no-op for device < 0, a CPU handle); the
 * caller's device is kept in *d for kvi__api_leave. Fails with KVI_ERR_CUDA
 * and the runtime's message when the device cannot be made current. */
kvi_status kvi__api_enter(kvi__api_dev *d, int device, const char *fn);
/* Gives the caller's device back; a no-op after a failed or no-op enter. */
void kvi__api_leave(kvi__api_dev *d);

/* st = call, run with `device` current (an expression of type kvi_status);
 * when the device cannot be made current, st is that failure and `call`
 * does not run. */
#define KVI__API_ON(st, device, fn, call)                                                                  \
  do {                                                                                                     \
    kvi__api_dev api_dev_;                                                                                 \
    (st) = kvi__api_enter(&api_dev_, (device), (fn));                                                      \
    if ((st) == KVI_OK) (st) = (call);                                                                     \
    kvi__api_leave(&api_dev_);                                                                             \
  } while (0)

/* A destroy: `call` (a void expression) runs whatever happens; `ok` (a
 * bool variable) says whether the device was made current, so that the
 * part frees device memory only then (a lost device keeps its memory). */
#define KVI__API_DESTROY(device, fn, ok, call)                                                             \
  do {                                                                                                     \
    kvi__api_dev api_dev_;                                                                                 \
    (ok) = kvi__api_enter(&api_dev_, (device), (fn)) == KVI_OK;                                            \
    call;                                                                                                  \
    kvi__api_leave(&api_dev_);                                                                             \
  } while (0)

#endif
