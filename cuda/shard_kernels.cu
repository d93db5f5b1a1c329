/*
 * Kernels of tensor-parallel stores: packing head slices for the transfers
 * of put_scatter and gather, and the merge of a sharded search's
 * candidates (see lib/tp/search.c; its merge_host is the reference).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "gpu/kernels.h"
#include "kvinject/search.h"

/* One thread per vector of V bytes of a row; rows are (l, t, h). */
template <typename V>
__global__ void copy_rows_kernel(kvi__rows_args a) {
  const int64_t per_row = a.row_bytes / (int64_t)sizeof(V);
  const int64_t rows = (int64_t)a.L * a.T * a.H;
  const int64_t total = rows * per_row;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / per_row, e = i % per_row;
    const int64_t h = row % a.H, t = (row / a.H) % a.T, l = row / ((int64_t)a.H * a.T);
    const V *src = (const V *)((const char *)a.src + l * a.src_stride[0] + t * a.src_stride[1] + h * a.src_stride[2]);
    V *dst = (V *)((char *)a.dst + l * a.dst_stride[0] + t * a.dst_stride[1] + h * a.dst_stride[2]);
    dst[e] = src[e];
  }
}

static bool aligned(const kvi__rows_args *a, int64_t n) {
  int64_t x = (int64_t)(uintptr_t)a->dst | (int64_t)(uintptr_t)a->src | a->row_bytes;
  for (int i = 0; i < 3; i++) x |= a->dst_stride[i] | a->src_stride[i];
  return x % n == 0;
}

extern "C" int kvi__cuda_copy_rows(const kvi__rows_args *a, struct CUstream_st *stream) {
  const int64_t rows = (int64_t)a->L * a->T * a->H;
  if (rows == 0 || a->row_bytes == 0) return 0;
  const int vec = aligned(a, 16) ? 16 : aligned(a, 4) ? 4 : aligned(a, 2) ? 2 : 1;
  const int64_t total = rows * (a->row_bytes / vec);
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  const unsigned grid = (unsigned)(blocks < 65535 * 8 ? blocks : 65535 * 8);
  switch (vec) {
  case 16: copy_rows_kernel<uint4><<<grid, threads, 0, stream>>>(*a); break;
  case 4: copy_rows_kernel<uint32_t><<<grid, threads, 0, stream>>>(*a); break;
  case 2: copy_rows_kernel<uint16_t><<<grid, threads, 0, stream>>>(*a); break;
  default: copy_rows_kernel<uint8_t><<<grid, threads, 0, stream>>>(*a); break;
  }
  return (int)cudaGetLastError();
}

__device__ static float key(float s) { return isnan(s) ? -INFINITY : s; }

__device__ static bool before(float sa, uint64_t ia, float sb, uint64_t ib) {
  sa = key(sa);
  sb = key(sb);
  return sa > sb || (sa == sb && ia < ib);
}

/* One CTA per query: each candidate finds its place by binary search in the
 * other ranks' sorted lists and writes itself there if it is in the top k. */
__global__ void merge_kernel(kvi__merge_args a) {
  const int q = blockIdx.x;
  const int64_t n = (int64_t)a.nq * a.k;
  const size_t hb = sizeof(kvi__shard_hdr);
  __shared__ int32_t s_fail;
  __shared__ int64_t s_total;
  if (threadIdx.x == 0) {
    int32_t fail = 0;
    int64_t total = 0;
    for (int r = 0; r < a.size; r++) {
      const kvi__shard_hdr *h = (const kvi__shard_hdr *)(a.blocks + r * a.block_bytes);
      if (h->status != 0) fail = -1;
      else if (!fail && (h->digest != a.digest || h->nq != a.nq || h->k != a.k)) fail = -2;
      if (!fail) total += ((const int32_t *)(a.blocks + r * a.block_bytes + hb + n * 12))[q];
    }
    s_fail = fail;
    s_total = total;
  }
  for (int j = threadIdx.x; j < a.k; j += blockDim.x) {
    a.out_ids[(int64_t)q * a.k + j] = KVI_SEARCH_NO_ID;
    a.out_scores[(int64_t)q * a.k + j] = -INFINITY;
  }
  __syncthreads();
  if (s_fail) {
    if (threadIdx.x == 0) a.out_counts[q] = s_fail;
    return;
  }
  for (int r = 0; r < a.size; r++) {
    const char *b = a.blocks + r * a.block_bytes + hb;
    const uint64_t *ids = (const uint64_t *)b + (int64_t)q * a.k;
    const float *sc = (const float *)(b + n * 8) + (int64_t)q * a.k;
    const int32_t cnt = ((const int32_t *)(b + n * 12))[q];
    for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
      int64_t pos = j;
      for (int o = 0; o < a.size; o++) {
        if (o == r) continue;
        const char *ob = a.blocks + o * a.block_bytes + hb;
        const uint64_t *oid = (const uint64_t *)ob + (int64_t)q * a.k;
        const float *osc = (const float *)(ob + n * 8) + (int64_t)q * a.k;
        int32_t lo = 0, hi = ((const int32_t *)(ob + n * 12))[q];
        while (lo < hi) {
          const int32_t mid = (lo + hi) / 2;
          if (before(osc[mid], oid[mid], sc[j], ids[j])) lo = mid + 1;
          else hi = mid;
        }
        pos += lo;
      }
      if (pos < a.k) {
        a.out_ids[(int64_t)q * a.k + pos] = ids[j];
        a.out_scores[(int64_t)q * a.k + pos] = sc[j];
      }
    }
  }
  if (threadIdx.x == 0) a.out_counts[q] = (int32_t)(s_total < a.k ? s_total : a.k);
}

extern "C" int kvi__cuda_shard_merge(const kvi__merge_args *a, struct CUstream_st *stream) {
  if (a->nq == 0) return 0;
  merge_kernel<<<a->nq, 256, 0, stream>>>(*a);
  return (int)cudaGetLastError();
}
