/*
 * libkvinject — the fused injection / capture kernel.
 * SPDX-License-Identifier: Apache-2.0
 *
 * One launch moves every request's facts for a range of layers: a CTA per
 * (segment, layer), a segment being a run of at most P tokens of one fact
 * page. For each of its tokens and heads the CTA reads the stored K and V
 * rows and writes them to the cache slot the request's block table names
 * (injection), rotating K at the token's position; or the reverse
 * (capture), un-rotating K.
 *
 * Memory traffic: every K and V element is read once and written once, so a
 * launch moves tokens * layers * heads * D * 2 * (sizeof(page) + sizeof(cache))
 * bytes: the bound is the device copy rate. Cos/sin depend on (token, pair)
 * only, so a thread owns a (token, vector of pairs) unit and loops over heads
 * with its cos/sin in registers. Rows are moved as 8-element vectors (16-byte
 * accesses for 16-bit types) when the host has checked alignment; otherwise
 * element by element. Rotation uses explicit _rn intrinsics so it is never
 * contracted into FMAs: with an engine's cos/sin table the result is bit for
 * bit the CPU reference's.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include "convert.cuh"
#include "kernels.h"

namespace {

using kvi::cvt;
using kvi::fp8e4;
using kvi::fp8e5;
using kvi::is_fp8;

/* E elements of T moved in the widest aligned accesses. */
template <typename T, int E> __device__ inline void load(float *out, const T *p) {
  constexpr int B = E * (int)sizeof(T);
  if constexpr (E > 1 && B % 16 == 0) {
    T tmp[E];
#pragma unroll
    for (int i = 0; i < B / 16; i++) reinterpret_cast<uint4 *>(tmp)[i] = reinterpret_cast<const uint4 *>(p)[i];
#pragma unroll
    for (int i = 0; i < E; i++) out[i] = cvt<T>::to(tmp[i]);
  } else if constexpr (E > 1 && B == 8) {
    T tmp[E];
    *reinterpret_cast<uint2 *>(tmp) = *reinterpret_cast<const uint2 *>(p);
#pragma unroll
    for (int i = 0; i < E; i++) out[i] = cvt<T>::to(tmp[i]);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) out[i] = cvt<T>::to(p[i]);
  }
}

template <typename T, int E> __device__ inline void store(T *p, const float *in) {
  constexpr int B = E * (int)sizeof(T);
  T tmp[E];
#pragma unroll
  for (int i = 0; i < E; i++) tmp[i] = cvt<T>::from(in[i]);
  if constexpr (E > 1 && B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; i++) reinterpret_cast<uint4 *>(p)[i] = reinterpret_cast<const uint4 *>(tmp)[i];
  } else if constexpr (E > 1 && B == 8) {
    *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<const uint2 *>(tmp);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) p[i] = tmp[i];
  }
}

/* Cache element offset of sequence index s, or -1 when its block id is
 * outside the cache (host-checked tables never are; device tables may be). */
__device__ inline int64_t slot_offset(const kvi__xfer_args &a, const kvi__xreq &rq, int64_t s) {
  const int64_t bi = s / a.BS - rq.first_block;
  if (bi < 0 || bi >= rq.table_len) return -1;
  const int32_t b = rq.table[bi];
  if (b < 0 || b >= a.NB) return -1;
  return (int64_t)b * a.block_stride + (s % a.BS) * a.token_stride;
}

__device__ inline void cos_sin(const kvi__xlayer &ly, int pos, int i, float &c, float &s) {
  if (ly.table) {
    const float *row = ly.table + (int64_t)pos * ly.rot;
    c = row[i];
    s = row[(ly.rot >> 1) + i];
  } else {
    const float ang = __fmul_rn((float)pos, ly.inv_freq[i]);
    float sn, cs;
    sincosf(ang, &sn, &cs);
    c = __fmul_rn(cs, ly.attn);
    s = __fmul_rn(sn, ly.attn);
  }
}

template <typename C, int E> __device__ inline void scale_for_cache(float *x, int n, float scale) {
  if constexpr (is_fp8<C>::value)
    for (int i = 0; i < n; i++) x[i] = __fdiv_rn(x[i], scale);
}

template <typename C, int E> __device__ inline void scale_from_cache(float *x, int n, float scale) {
  if constexpr (is_fp8<C>::value)
    for (int i = 0; i < n; i++) x[i] = __fmul_rn(x[i], scale);
}

/* Rotates the E pairs held in x[0..2E): NeoX pairs (x[k], x[E+k]), GPT-J
 * pairs (x[2k], x[2k+1]); forward or inverse, in the CPU reference's order.
 * NEOX is a template parameter so every index is a compile-time constant
 * and x stays in registers. */
template <int E, bool NEOX> __device__ inline void rotate(float *x, const float *c, const float *s, bool forward) {
#pragma unroll
  for (int k = 0; k < E; k++) {
    const int ia = NEOX ? k : 2 * k, ib = NEOX ? E + k : 2 * k + 1;
    const float xa = x[ia], xb = x[ib];
    if (forward) {
      x[ia] = __fsub_rn(__fmul_rn(xa, c[k]), __fmul_rn(xb, s[k]));
      x[ib] = __fadd_rn(__fmul_rn(xb, c[k]), __fmul_rn(xa, s[k]));
    } else { /* c and s arrive pre-divided by cos^2 + sin^2 (see unrotate_cs) */
      x[ia] = __fadd_rn(__fmul_rn(xa, c[k]), __fmul_rn(xb, s[k]));
      x[ib] = __fsub_rn(__fmul_rn(xb, c[k]), __fmul_rn(xa, s[k]));
    }
  }
}

/* One rotated unit (E pairs at da/db) of one token for every head, BATCH
 * heads at a time with all loads before any store. */
template <typename G, typename C, int E, bool INJECT, bool NEOX, int BATCH>
__device__ inline void rotated_unit(G *prow, C *crow, int64_t page_head, int64_t head_stride, unsigned H, unsigned da,
                                    unsigned db, const float *c, const float *s, const float *ks) {
  for (unsigned h0 = 0; h0 < H; h0 += BATCH) {
    float x[BATCH][2 * E];
#pragma unroll
    for (int b = 0; b < BATCH; b++) {
      const unsigned h = h0 + b;
      if (h < H) {
        if (INJECT) {
          load<G, E>(x[b], prow + h * page_head + da);
          load<G, E>(x[b] + E, prow + h * page_head + db);
        } else {
          load<C, E>(x[b], crow + h * head_stride + da);
          load<C, E>(x[b] + E, crow + h * head_stride + db);
        }
      }
    }
#pragma unroll
    for (int b = 0; b < BATCH; b++) {
      const unsigned h = h0 + b;
      if (h < H) {
        if (INJECT) {
          rotate<E, NEOX>(x[b], c, s, true);
          scale_for_cache<C, E>(x[b], 2 * E, ks[h]);
          store<C, E>(crow + h * head_stride + da, x[b]);
          store<C, E>(crow + h * head_stride + db, x[b] + E);
        } else {
          scale_from_cache<C, E>(x[b], 2 * E, ks[h]);
          rotate<E, NEOX>(x[b], c, s, false);
          store<G, E>(prow + h * page_head + da, x[b]);
          store<G, E>(prow + h * page_head + db, x[b] + E);
        }
      }
    }
  }
}

/* Moves one vector of E elements between a page and the cache, with the
 * fp8 scale, in the given direction. */
template <typename G, typename C, int E, bool INJECT>
__device__ inline void move_vec(G *pg, C *cv, float scale) {
  float x[E];
  if (INJECT) {
    load<G, E>(x, pg);
    scale_for_cache<C, E>(x, E, scale);
    store<C, E>(cv, x);
  } else {
    load<C, E>(x, cv);
    scale_from_cache<C, E>(x, E, scale);
    store<G, E>(pg, x);
  }
}

constexpr int THREADS = 128;
constexpr int BATCH = 4;   /* independent V vectors a thread keeps in flight */
constexpr int BATCH_K = 2; /* heads per K batch: 2 x 2 vectors, fewer registers */

template <typename G, typename C, int E, bool INJECT>
__global__ void __launch_bounds__(THREADS) xfer_kernel(const kvi__xfer_args a) {
  /* per-token cache offsets (-1: skipped) and positions, computed once */
  extern __shared__ int64_t s_coff[];
  int32_t *s_pos = reinterpret_cast<int32_t *>(s_coff + a.P);
  const kvi__xseg sg = a.segs[blockIdx.x];
  const int l = a.layer_begin + (int)blockIdx.y;
  const kvi__xlayer ly = a.layers[l];
  const unsigned H = (unsigned)a.H, D = (unsigned)a.D, P = (unsigned)a.P, ntok = sg.ntok;
  if (threadIdx.x < ntok) {
    const kvi__xreq rq = a.reqs[sg.req];
    const int64_t c = slot_offset(a, rq, sg.seq0 + threadIdx.x);
    s_coff[threadIdx.x] = c;
    s_pos[threadIdx.x] = a.positions[sg.pos0 + threadIdx.x];
    if (c < 0 && blockIdx.y == 0) atomicAdd(a.skipped, 1ull);
  }
  for (unsigned j = threadIdx.x + THREADS; j < ntok; j += THREADS) { /* pages longer than a block */
    const kvi__xreq rq = a.reqs[sg.req];
    const int64_t c = slot_offset(a, rq, sg.seq0 + j);
    s_coff[j] = c;
    s_pos[j] = a.positions[sg.pos0 + j];
    if (c < 0 && blockIdx.y == 0) atomicAdd(a.skipped, 1ull);
  }
  __syncthreads();

  G *page = static_cast<G *>(a.pool) + (int64_t)sg.page * a.page_elems;
  const unsigned rot = ly.style ? (unsigned)ly.rot : 0u, half = rot >> 1;
  const bool neox = ly.style == 1;
  const unsigned nrot = half / E, npass = (D - rot) / E, nunit = nrot + npass;
  const float *ks = a.k_scale + l * (int)H, *vs = a.v_scale + l * (int)H;
  const int64_t page_head = (int64_t)P * D; /* page elements between heads */
  C *kbase = reinterpret_cast<C *>(ly.k), *vbase = reinterpret_cast<C *>(ly.v);

  /* K: a thread owns a (token, unit), keeps its cos/sin in registers and
   * walks the heads BATCH at a time, all loads before any store */
  for (unsigned it = threadIdx.x; it < ntok * nunit; it += THREADS) {
    const unsigned j = it / nunit, u = it - j * nunit;
    const int64_t coff = s_coff[j];
    if (coff < 0) continue;
    C *crow = kbase + coff;
    G *prow = page + ((int64_t)(l * 2) * H * P + sg.tok0 + j) * D;
    if (u < nrot) {
      const unsigned i0 = u * E;
      float c[E], s[E];
#pragma unroll
      for (int k = 0; k < E; k++) {
        cos_sin(ly, s_pos[j], (int)i0 + k, c[k], s[k]);
        if (!INJECT) { /* the inverse of a rotation scaled by m is R^T / m^2: one division per pair, not per head */
          const float r = __fdiv_rn(1.0f, __fadd_rn(__fmul_rn(c[k], c[k]), __fmul_rn(s[k], s[k])));
          c[k] = __fmul_rn(c[k], r);
          s[k] = __fmul_rn(s[k], r);
        }
      }
      const unsigned da = neox ? i0 : 2 * i0, db = neox ? i0 + half : 2 * i0 + E;
      if (neox)
        rotated_unit<G, C, E, INJECT, true, BATCH_K>(prow, crow, page_head, a.head_stride, H, da, db, c, s, ks);
      else
        rotated_unit<G, C, E, INJECT, false, BATCH_K>(prow, crow, page_head, a.head_stride, H, da, db, c, s, ks);
    } else {
      const unsigned d = rot + (u - nrot) * E;
      for (unsigned h = 0; h < H; h++)
        move_vec<G, C, E, INJECT>(prow + h * page_head + d, crow + h * a.head_stride + d, ks[h]);
    }
  }

  /* V: a plain converting copy, BATCH vectors in flight per thread */
  const unsigned nv = D / E, per_tok = H * nv, n = ntok * per_tok;
  for (unsigned base = threadIdx.x; base < n; base += THREADS * BATCH) {
    float x[BATCH][E];
    G *pg[BATCH];
    C *cv[BATCH];
    float sc[BATCH];
#pragma unroll
    for (int b = 0; b < BATCH; b++) {
      const unsigned it = base + b * THREADS;
      pg[b] = nullptr;
      if (it >= n) continue;
      const unsigned j = it / per_tok, r = it - j * per_tok, h = r / nv, d = (r - h * nv) * E;
      const int64_t coff = s_coff[j];
      if (coff < 0) continue;
      pg[b] = page + (((int64_t)(l * 2 + 1) * H + h) * P + sg.tok0 + j) * D + d;
      cv[b] = vbase + coff + h * a.head_stride + d;
      sc[b] = vs[h];
      if (INJECT)
        load<G, E>(x[b], pg[b]);
      else
        load<C, E>(x[b], cv[b]);
    }
#pragma unroll
    for (int b = 0; b < BATCH; b++) {
      if (!pg[b]) continue;
      if (INJECT) {
        scale_for_cache<C, E>(x[b], E, sc[b]);
        store<C, E>(cv[b], x[b]);
      } else {
        scale_from_cache<C, E>(x[b], E, sc[b]);
        store<G, E>(pg[b], x[b]);
      }
    }
  }
}

template <typename G, typename C, int E> int launch4(const kvi__xfer_args *a, cudaStream_t s) {
  const dim3 grid((unsigned)a->nsegs, (unsigned)(a->layer_end - a->layer_begin));
  const size_t smem = (size_t)a->P * (sizeof(int64_t) + sizeof(int32_t));
  if (a->inject)
    xfer_kernel<G, C, E, true><<<grid, THREADS, smem, s>>>(*a);
  else
    xfer_kernel<G, C, E, false><<<grid, THREADS, smem, s>>>(*a);
  return (int)cudaGetLastError();
}

template <typename G, typename C> int launch3(const kvi__xfer_args *a, cudaStream_t s) {
  return a->vec == 8 ? launch4<G, C, 8>(a, s) : launch4<G, C, 1>(a, s);
}

template <typename G> int launch2(const kvi__xfer_args *a, cudaStream_t s) {
  switch (a->cache_dtype) {
  case KVI_DTYPE_FP32: return launch3<G, float>(a, s);
  case KVI_DTYPE_FP16: return launch3<G, __half>(a, s);
  case KVI_DTYPE_BF16: return launch3<G, __nv_bfloat16>(a, s);
  case KVI_DTYPE_FP8_E4M3: return launch3<G, fp8e4>(a, s);
  case KVI_DTYPE_FP8_E5M2: return launch3<G, fp8e5>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}

} // namespace

extern "C" int kvi__cuda_transfer(const kvi__xfer_args *a, struct CUstream_st *stream) {
  if (a->nsegs == 0 || a->layer_end <= a->layer_begin) return 0;
  cudaStream_t s = (cudaStream_t)stream;
  switch (a->page_dtype) {
  case KVI_DTYPE_FP32: return launch2<float>(a, s);
  case KVI_DTYPE_FP16: return launch2<__half>(a, s);
  case KVI_DTYPE_BF16: return launch2<__nv_bfloat16>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}
