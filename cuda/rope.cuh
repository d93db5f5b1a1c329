/*
 * libkvinject — the rotation angles the kernels share (injection, capture and
 * deviation rotate keys with the same cos/sin, so they agree bit for bit).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_CUDA_ROPE_CUH
#define KVI_CUDA_ROPE_CUH

#include <cuda_runtime.h>

#include "gpu/kernels.h"

namespace kvi {

/* Cos/sin of pair i at position pos, attention factor included: from the
 * layer's table when it has one, else from its inverse frequencies. */
__device__ inline float2 cos_sin(const kvi__xlayer &ly, int pos, int i) {
  if (ly.table) {
    const float *row = ly.table + (int64_t)pos * ly.rot;
    return make_float2(row[i], row[(ly.rot >> 1) + i]);
  }
  const float ang = __fmul_rn((float)pos, ly.inv_freq[i]);
  float sn, cs;
  sincosf(ang, &sn, &cs);
  return make_float2(__fmul_rn(cs, ly.attn), __fmul_rn(sn, ly.attn));
}

} // namespace kvi

#endif
