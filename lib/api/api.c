/*
 * The entry points' one way onto a handle's device (api.h).
 * SPDX-License-Identifier: Apache-2.0
 */
#include "api/api.h"

kvi_status kvi__api_enter(kvi__api_dev *d, int device, const char *fn) {
  d->entered = false;
  if (device < 0) return KVI_OK;
  kvi_status st = kvi__cuda_enter(device, &d->guard, fn);
  d->entered = st == KVI_OK;
  return st;
}

void kvi__api_leave(kvi__api_dev *d) {
  if (d->entered) kvi__cuda_leave(&d->guard);
  d->entered = false;
}
