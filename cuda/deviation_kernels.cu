/*
 * libkvinject — deviation scores of injected tokens (kvi_inject_deviation).
 * SPDX-License-Identifier: Apache-2.0
 *
 * The injection plan (kernels.h: kvi__xseg, kvi__xreq, positions, host block
 * tables) drives a read-only pass over one layer: a CTA per segment, and for
 * each of its tokens the threads split the 2 * H * D elements, each
 * computing the stored element as kvi_inject would write it (fp8, keys with
 * their channels' offsets, and 4-bit
 * pages dequantized, keys rotated at the token's position in fp32) and the squared
 * difference from the cache's element (fp8 caches times their scale); a
 * block reduction gives the token's score. One layer of a call's tokens is
 * little work next to the engine's prefill of that layer, so the kernel
 * favours being simple over the fused injection kernel's tricks.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>

#include "base/q4.h"
#include "gpu/kernels.h"
#include "rope.cuh"
#include "vec.cuh"
#include "kvinject/model.h"

namespace {

using kvi::cvt;
using kvi::fp8e4;
using kvi::fp8e5;

constexpr int THREADS = 128;

using kvi::elem_size;
using kvi::load; /* vec.cuh */
using kvi::cos_sin; /* rope.cuh */

__global__ void __launch_bounds__(THREADS) deviation_kernel(const __grid_constant__ kvi__dev_args a) {
  const kvi__xfer_args &x = a.x;
  const char *plan = x.plan_dev;
  const kvi__xseg sg = reinterpret_cast<const kvi__xseg *>(plan)[blockIdx.x];
  if (sg.ntok == 0) return;
  const kvi__xreq rq = reinterpret_cast<const kvi__xreq *>(plan + x.o_reqs)[sg.req];
  const int32_t *table = rq.table ? rq.table : reinterpret_cast<const int32_t *>(plan + rq.table_off);
  const int l = x.layer_begin, H = x.H, D = x.D, n = 2 * H * D;
  const kvi__xlayer ly = x.layers[l];
  const int64_t pes = elem_size(x.page_dtype);
  const char *page = sg.page < x.host_first
                         ? static_cast<const char *>(x.pool) + (int64_t)sg.page * x.page_elems * pes
                         : static_cast<const char *>(x.host_pool) + (int64_t)(sg.page - x.host_first) * x.page_elems * pes;
  const bool fp8_page = x.page_dtype == KVI_DTYPE_FP8_E4M3;
  const bool fp8_cache = x.cache_dtype == KVI_DTYPE_FP8_E4M3 || x.cache_dtype == KVI_DTYPE_FP8_E5M2;
  const float *gs = fp8_page ? reinterpret_cast<const float *>(page + x.scale_off) : nullptr;
  /* fp8 pages: the key offsets, [layer][head][D] (base/fp8.h) */
  const uint16_t *ko = fp8_page ? reinterpret_cast<const uint16_t *>(page + x.scale_off + kvi__fp8_offsets_rel(x.L, x.H))
                                : nullptr;
  /* 4-bit pages: key channels' words, then value tokens' (base/q4.h) */
  const uint32_t *qw = x.page_dtype == KVI_DTYPE_Q4 ? reinterpret_cast<const uint32_t *>(page + x.scale_off) : nullptr;
  __shared__ float part[THREADS / 32];
  for (unsigned j = 0; j < sg.ntok; j++) {
    const int64_t s = sg.seq0 + j, bi = s / x.BS - rq.first_block;
    int64_t ck = -1, cv = -1; /* block ids outside the cache (only device tables can have them): NaN, counted */
    if (bi >= 0 && bi < rq.table_len) {
      const int32_t b = table[bi];
      if (b >= 0 && b < x.NB) {
        ck = (int64_t)b * x.block_stride + (s % x.BS) * x.token_stride;
        cv = (int64_t)b * x.v_block_stride + (s % x.BS) * x.v_token_stride;
      }
    }
    const int pos = sg.explicit_pos ? reinterpret_cast<const int32_t *>(plan + x.o_pos)[sg.pos0 + j] : sg.pos0 + (int)j;
    float acc = 0.0f;
    if (ck >= 0)
      for (int e = (int)threadIdx.x; e < n; e += THREADS) {
        const int kv = e / (H * D), h = (e / D) % H, d = e % D;
        const int64_t row = ((((int64_t)l * 2 + kv) * H + h) * x.P + sg.tok0 + j) * D;
        const float ps = gs ? gs[(l * 2 + kv) * H + h] : 1.0f;
        const uint32_t *kw = qw ? qw + ((int64_t)l * H + h) * D : nullptr;
        const uint32_t vword = qw && kv ? qw[(int64_t)x.L * H * D + ((int64_t)l * H + h) * x.P + sg.tok0 + j] : 0u;
        /* the stored element dd of this row, dequantized */
        auto stored = [&](int dd) -> float {
          if (qw) return kvi__q4_decode(reinterpret_cast<const uint8_t *>(page), row + dd, kv ? vword : kw[dd]);
          if (ko && kv == 0) /* fmaf(e4m3, scale, m), as kvi__fp8_value */
            return kvi__fp8_value(load(page, x.page_dtype, row + dd), ps, __half2float(__ushort_as_half(ko[((int64_t)l * H + h) * D + dd])));
          return __fmul_rn(load(page, x.page_dtype, row + dd), ps);
        };
        float want = stored(d);
        if (kv == 0 && d < ly.rot) {
          const int half = ly.rot >> 1;
          const bool neox = ly.style == KVI_ROPE_NEOX;
          const bool first = neox ? d < half : (d & 1) == 0;
          const int i = neox ? (first ? d : d - half) : d >> 1;
          const int other = neox ? (first ? d + half : d - half) : (first ? d + 1 : d - 1);
          const float xo = stored(other);
          const float2 c = cos_sin(ly, pos, i);
          want = first ? __fsub_rn(__fmul_rn(want, c.x), __fmul_rn(xo, c.y))
                       : __fadd_rn(__fmul_rn(want, c.x), __fmul_rn(xo, c.y));
        }
        const int64_t off = kv ? cv + h * x.v_head_stride + d * x.v_dim_stride
                               : ck + h * x.head_stride + d * x.dim_stride;
        float got = load(kv ? ly.v : ly.k, x.cache_dtype, off);
        if (fp8_cache) got = __fmul_rn(got, (kv ? x.v_scale : x.k_scale)[l * H + h]);
        const float df = __fsub_rn(got, want);
        acc = __fmaf_rn(df, df, acc);
      }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
      float total = 0.0f;
      for (int w = 0; w < THREADS / 32; w++) total += part[w];
      a.out[a.seg_out[blockIdx.x] + j] = ck >= 0 ? total : NAN;
      if (ck < 0) atomicAdd(x.skipped, 1ull);
    }
    __syncthreads();
  }
}

} // namespace

extern "C" int kvi__cuda_deviation(const kvi__dev_args *a, struct CUstream_st *stream) {
  if (a->x.nsegs == 0) return 0;
  deviation_kernel<<<(unsigned)a->x.nsegs, THREADS, 0, (cudaStream_t)stream>>>(*a);
  return (int)cudaGetLastError();
}
