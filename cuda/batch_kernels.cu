/*
 * Batched injection with fact ids in device memory: the ids are turned into
 * their tenants' rows here; the retrieve-plan kernel (transfer_kernels.cu)
 * then plans the injection from the rows, as it does for a search's results.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdint.h>

#include "gpu/kernels.h"
#include "kvinject/search.h"

namespace {

constexpr int LK_THREADS = 256;

/* One CTA per request, one warp per fact id: the warp scans the tenant's row
 * ids 32 at a time and stops at the first match (a tenant holds an id once). */
__global__ void __launch_bounds__(LK_THREADS) lookup_kernel(const kvi__idlookup_args a) {
  const kvi__idreq q = a.reqs[blockIdx.x];
  const int lane = (int)(threadIdx.x & 31), warp = (int)(threadIdx.x >> 5), warps = LK_THREADS / 32;
  int32_t *rows = a.rows + (int64_t)blockIdx.x * a.k;
  for (int f = warp; f < q.nf; f += warps) {
    const uint64_t id = a.fact_ids[q.f0 + f];
    int32_t row = -1;
    if (id != KVI_SEARCH_NO_ID && q.ids)
      for (int32_t r0 = 0; r0 < q.nrows; r0 += 32) {
        const int32_t r = r0 + lane;
        const unsigned hit = __ballot_sync(0xffffffffu, r < q.nrows && q.ids[r] == id);
        if (hit) {
          row = r0 + __ffs(hit) - 1;
          break;
        }
      }
    if (lane == 0) {
      rows[f] = row;
      if (row < 0 && id != KVI_SEARCH_NO_ID) atomicAdd(a.skipped, 1ull);
    }
  }
  if (threadIdx.x == 0) a.counts[blockIdx.x] = q.nf;
}

} // namespace

extern "C" int kvi__cuda_lookup_ids(const kvi__idlookup_args *a, struct CUstream_st *stream) {
  if (a->n == 0) return 0;
  lookup_kernel<<<(unsigned)a->n, LK_THREADS, 0, (cudaStream_t)stream>>>(*a);
  return (int)cudaGetLastError();
}
