/*
 * libkvinject — the fused injection / capture kernel.
 * SPDX-License-Identifier: Apache-2.0
 *
 * One launch moves every request's facts for a range of layers. A CTA owns
 * one segment (a run of at most seg_tokens tokens of one fact page, landing
 * at consecutive sequence slots of one request) for a chunk of consecutive
 * layers. For each token and head it reads the stored K and V rows and
 * writes them to the cache slot the request's block table names
 * (injection), rotating K at the token's position; or the reverse
 * (capture), un-rotating K.
 *
 * Memory traffic: every K and V element is read once and written once, so a
 * launch moves tokens * layers * heads * D * 2 * (sizeof(page) +
 * sizeof(cache)) bytes: the bound is the device copy rate. What keeps the
 * kernel at it:
 *  - the per-CTA prologue (segment -> request -> block table -> slot
 *    offsets, positions, cos/sin) is a chain of dependent loads; it runs once
 *    per CTA and is amortized over its chunk of layers (the host sizes the
 *    chunks so the grid still has many CTAs per SM);
 *  - cos/sin depend on (token, pair) only: they are computed once per CTA
 *    (again only when a layer's RoPE differs) into shared memory, not per
 *    head and layer;
 *  - every thread issues all loads of a batch (8 16-byte vectors) before
 *    it converts or stores anything, so each SM keeps enough bytes in flight
 *    to cover DRAM latency;
 *  - small plans travel in the kernel parameters, so a call costs one launch
 *    and no upload.
 * Rotation uses explicit _rn intrinsics so it is never contracted into FMAs:
 * with an engine's cos/sin table the result is bit for bit the CPU
 * reference's.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "convert.cuh"
#include "kernels.h"

namespace {

using kvi::cvt;
using kvi::fp8e4;
using kvi::fp8e5;
using kvi::is_fp8;

/* E raw elements of T, loaded and stored in the widest aligned accesses. */
template <typename T, int E> struct alignas(E * sizeof(T) >= 16 ? 16 : E * sizeof(T) >= 8 ? 8 : sizeof(T)) Vec {
  T v[E];
};

template <typename T, int E> __device__ inline void ld(Vec<T, E> &r, const T *p) {
  constexpr int B = E * (int)sizeof(T);
  if constexpr (E > 1 && B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; i++) reinterpret_cast<uint4 *>(r.v)[i] = reinterpret_cast<const uint4 *>(p)[i];
  } else if constexpr (E > 1 && B == 8) {
    *reinterpret_cast<uint2 *>(r.v) = *reinterpret_cast<const uint2 *>(p);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) r.v[i] = p[i];
  }
}

template <typename T, int E> __device__ inline void stv(T *p, const float *in) {
  constexpr int B = E * (int)sizeof(T);
  Vec<T, E> r;
#pragma unroll
  for (int i = 0; i < E; i++) r.v[i] = cvt<T>::from(in[i]);
  if constexpr (E > 1 && B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; i++) reinterpret_cast<uint4 *>(p)[i] = reinterpret_cast<const uint4 *>(r.v)[i];
  } else if constexpr (E > 1 && B == 8) {
    *reinterpret_cast<uint2 *>(p) = *reinterpret_cast<const uint2 *>(r.v);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) p[i] = r.v[i];
  }
}

template <typename T, int E> __device__ inline void to_f32(float *x, const Vec<T, E> &r) {
#pragma unroll
  for (int i = 0; i < E; i++) x[i] = cvt<T>::to(r.v[i]);
}

/* fp8 caches hold value / scale (the divide convention). */
template <typename C> __device__ inline void scale_for_cache(float *x, int n, float scale) {
  if constexpr (is_fp8<C>::value)
    for (int i = 0; i < n; i++) x[i] = __fdiv_rn(x[i], scale);
}

template <typename C> __device__ inline void scale_from_cache(float *x, int n, float scale) {
  if constexpr (is_fp8<C>::value)
    for (int i = 0; i < n; i++) x[i] = __fmul_rn(x[i], scale);
}

/* Cos/sin of pair i at position pos, attention factor included. */
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

/* Rotates the E pairs held in x[0..2E): NeoX pairs (x[k], x[E+k]), GPT-J
 * pairs (x[2k], x[2k+1]); forward or inverse, in the CPU reference's order.
 * NEOX is a template parameter so every index is a compile-time constant
 * and x stays in registers. */
template <int E, bool NEOX, bool FORWARD> __device__ inline void rotate(float *x, const float2 *cs) {
#pragma unroll
  for (int k = 0; k < E; k++) {
    const int ia = NEOX ? k : 2 * k, ib = NEOX ? E + k : 2 * k + 1;
    const float xa = x[ia], xb = x[ib], c = cs[k].x, s = cs[k].y;
    if (FORWARD) {
      x[ia] = __fsub_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));
      x[ib] = __fadd_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
    } else { /* cos/sin arrive pre-divided by cos^2 + sin^2 (see fill_cos_sin) */
      x[ia] = __fadd_rn(__fmul_rn(xa, c), __fmul_rn(xb, s));
      x[ib] = __fsub_rn(__fmul_rn(xb, c), __fmul_rn(xa, s));
    }
  }
}

constexpr int THREADS = 128;
constexpr int NSTAGE = KVI__XFER_STAGES;
constexpr int STAGE_BYTES = KVI__XFER_STAGE_BYTES;

/* Asynchronous global -> shared copies (sm_80+): they hold no registers
 * while in flight, which is what lets a few CTAs per SM keep the DRAM
 * pipe full. */
template <int GR> __device__ inline void cp_async(void *smem, const void *g) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  if constexpr (GR == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(g));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(g), "n"(GR));
}
__device__ inline void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ inline void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

/* A CTA's view of its work: segment, layer chunk, and where a stage's rows
 * come from and go to. A stage is (layer, plane, group of heads): its rows,
 * [head][token][D] in the source's dtype, fit STAGE_BYTES. */
struct Work {
  const kvi__xfer_args *a;
  const int64_t *coff; /* per token: cache element offset, -1 = skipped */
  const float2 *cs;    /* [token][half_max] cos/sin of the current RoPE */
  char *buf;           /* NSTAGE stage buffers */
  unsigned ntok, H, D, HM, hs, ngroups, nstages;
  int l0;
  uint32_t page;
  unsigned tok0;
};

struct Stage {
  int l;          /* layer */
  int kv;         /* plane: 0 = K, 1 = V */
  unsigned h0, nh; /* heads [h0, h0 + nh) */
};

__device__ inline Stage stage_of(const Work &w, unsigned s) {
  Stage st;
  const unsigned per_layer = 2 * w.ngroups, li = s / per_layer, r = s - li * per_layer;
  st.l = w.l0 + (int)li;
  st.kv = (int)(r / w.ngroups);
  st.h0 = (r - (unsigned)st.kv * w.ngroups) * w.hs;
  st.nh = min(w.hs, w.H - st.h0);
  return st;
}

template <typename G> __device__ inline G *page_row(const Work &w, const Stage &st, unsigned h, unsigned j) {
  const kvi__xfer_args &a = *w.a;
  return static_cast<G *>(a.pool) + (int64_t)w.page * a.page_elems +
         ((((int64_t)st.l * 2 + st.kv) * a.H + h) * a.P + w.tok0 + j) * a.D;
}

template <typename C> __device__ inline C *cache_row(const Work &w, const Stage &st, unsigned h, unsigned j) {
  const kvi__xlayer &ly = w.a->layers[st.l];
  return reinterpret_cast<C *>(st.kv ? ly.v : ly.k) + w.coff[j] + h * w.a->head_stride;
}

/* Issues the copies of stage s into its buffer: GR-byte asynchronous
 * chunks, or (GR == 0, layouts without 16-byte alignment) plain element
 * copies. Skipped tokens of a capture have no source and are not read. */
template <typename G, typename C, int GR, bool INJECT> __device__ inline void fill(const Work &w, unsigned s) {
  using S = typename std::conditional<INJECT, G, C>::type;
  if (s >= w.nstages) return;
  const Stage st = stage_of(w, s);
  S *dst = reinterpret_cast<S *>(w.buf + (size_t)(s % NSTAGE) * STAGE_BYTES);
  constexpr int EPC = GR ? GR / (int)sizeof(S) : 1; /* elements per chunk */
  const unsigned cpr = w.D / EPC, n = st.nh * w.ntok * cpr;
  for (unsigned it = threadIdx.x; it < n; it += THREADS) {
    const unsigned row = it / cpr, c = it - row * cpr, h = st.h0 + row / w.ntok, j = row % w.ntok;
    const S *src;
    if constexpr (INJECT) {
      src = page_row<G>(w, st, h, j);
    } else {
      if (w.coff[j] < 0) continue;
      src = cache_row<C>(w, st, h, j);
    }
    if constexpr (GR > 0)
      cp_async<GR>(dst + (size_t)row * w.D + c * EPC, src + c * EPC);
    else
      dst[(size_t)row * w.D + c] = src[c];
  }
}

/* Writes stage s from its buffer: K's rotated part as units of E pairs
 * (two vectors), everything else (K's pass-through tail, all of V) as
 * converting vector copies. */
template <typename G, typename C, int E, bool INJECT, bool NEOX>
__device__ inline void drain(const Work &w, unsigned s, unsigned rot) {
  using S = typename std::conditional<INJECT, G, C>::type;
  const Stage st = stage_of(w, s);
  const S *buf = reinterpret_cast<const S *>(w.buf + (size_t)(s % NSTAGE) * STAGE_BYTES);
  const kvi__xfer_args &a = *w.a;
  const float *scales = (st.kv ? a.v_scale : a.k_scale) + st.l * a.H;
  const unsigned r0 = st.kv ? 0u : rot, half = r0 >> 1;
  if (r0) {
    const unsigned nrot = half / E, per_row = nrot, n = st.nh * w.ntok * per_row;
    for (unsigned it = threadIdx.x; it < n; it += THREADS) {
      const unsigned row = it / per_row, u = it - row * per_row, j = row % w.ntok, h = st.h0 + row / w.ntok;
      if (w.coff[j] < 0) continue;
      const unsigned da = NEOX ? u * E : 2 * u * E, db = NEOX ? da + half : da + E;
      Vec<S, E> va, vb;
      ld<S, E>(va, buf + (size_t)row * w.D + da);
      ld<S, E>(vb, buf + (size_t)row * w.D + db);
      float v[2 * E];
      to_f32<S, E>(v, va);
      to_f32<S, E>(v + E, vb);
      float2 c[E];
      const float2 *cs = w.cs + j * w.HM + u * E;
#pragma unroll
      for (int k = 0; k < E; k++) c[k] = cs[k];
      const float sc = is_fp8<C>::value ? scales[h] : 1.0f;
      if constexpr (INJECT) {
        rotate<E, NEOX, true>(v, c);
        scale_for_cache<C>(v, 2 * E, sc);
        C *cr = cache_row<C>(w, st, h, j);
        stv<C, E>(cr + da, v);
        stv<C, E>(cr + db, v + E);
      } else {
        scale_from_cache<C>(v, 2 * E, sc);
        rotate<E, NEOX, false>(v, c);
        G *pr = page_row<G>(w, st, h, j);
        stv<G, E>(pr + da, v);
        stv<G, E>(pr + db, v + E);
      }
    }
  }
  const unsigned per_row = (w.D - r0) / E, n = st.nh * w.ntok * per_row;
  for (unsigned it = threadIdx.x; it < n; it += THREADS) {
    const unsigned row = it / per_row, d = r0 + (it - row * per_row) * E, j = row % w.ntok, h = st.h0 + row / w.ntok;
    if (w.coff[j] < 0) continue;
    Vec<S, E> vv;
    ld<S, E>(vv, buf + (size_t)row * w.D + d);
    float f[E];
    to_f32<S, E>(f, vv);
    const float sc = is_fp8<C>::value ? scales[h] : 1.0f;
    if constexpr (INJECT) {
      scale_for_cache<C>(f, E, sc);
      stv<C, E>(cache_row<C>(w, st, h, j) + d, f);
    } else {
      scale_from_cache<C>(f, E, sc);
      stv<G, E>(page_row<G>(w, st, h, j) + d, f);
    }
  }
}

template <typename G, typename C, int E, bool INJECT>
__global__ void __launch_bounds__(THREADS) xfer_kernel(const __grid_constant__ kvi__xfer_args a) {
  using S = typename std::conditional<INJECT, G, C>::type;
  constexpr int GR = E == 8 ? (8 * (int)sizeof(S) < 16 ? 8 * (int)sizeof(S) : 16) : 0;
  extern __shared__ __align__(16) char smem[]; /* stages | cos/sin | offsets | positions */
  const unsigned T = (unsigned)a.seg_tokens, HM = (unsigned)a.half_max;
  float2 *s_cs = reinterpret_cast<float2 *>(smem + NSTAGE * STAGE_BYTES);
  int64_t *s_coff = reinterpret_cast<int64_t *>(s_cs + T * HM);
  int32_t *s_pos = reinterpret_cast<int32_t *>(s_coff + T);

  /* the plan: in the parameters (generic addresses into the constant bank) or uploaded */
  const char *plan = a.inline_bytes ? reinterpret_cast<const char *>(a.inline_plan) : a.plan_dev;
  const kvi__xseg sg = reinterpret_cast<const kvi__xseg *>(plan)[blockIdx.x];
  Work w;
  w.a = &a;
  w.coff = s_coff;
  w.cs = s_cs;
  w.buf = smem;
  w.ntok = sg.ntok;
  w.H = (unsigned)a.H;
  w.D = (unsigned)a.D;
  w.HM = HM;
  w.hs = (unsigned)a.stage_heads;
  w.ngroups = (w.H + w.hs - 1) / w.hs;
  w.l0 = a.layer_begin + (int)blockIdx.y * a.layers_per_cta;
  w.nstages = (unsigned)(min(w.l0 + a.layers_per_cta, a.layer_end) - w.l0) * 2 * w.ngroups;
  w.page = sg.page;
  w.tok0 = sg.tok0;

  /* injection reads pages, whose addresses need nothing else: start the
   * first stages before the dependent loads of the prologue */
  if (INJECT)
    for (int s = 0; s < NSTAGE - 1; s++) {
      fill<G, C, GR, INJECT>(w, (unsigned)s);
      cp_commit();
    }
  for (unsigned j = threadIdx.x; j < w.ntok; j += THREADS) {
    const kvi__xreq rq = reinterpret_cast<const kvi__xreq *>(plan + a.o_reqs)[sg.req];
    const int32_t *table = rq.table ? rq.table : reinterpret_cast<const int32_t *>(plan + rq.table_off);
    const int64_t sq = sg.seq0 + j, bi = sq / a.BS - rq.first_block;
    int64_t c = -1; /* block ids outside the cache (only device tables can have them) are skipped */
    if (bi >= 0 && bi < rq.table_len) {
      const int32_t b = table[bi];
      if (b >= 0 && b < a.NB) c = (int64_t)b * a.block_stride + (sq % a.BS) * a.token_stride;
    }
    s_coff[j] = c;
    s_pos[j] = reinterpret_cast<const int32_t *>(plan + a.o_pos)[sg.pos0 + j];
    if (c < 0 && blockIdx.y == 0) atomicAdd(a.skipped, 1ull);
  }
  __syncthreads();
  if (!INJECT)
    for (int s = 0; s < NSTAGE - 1; s++) {
      fill<G, C, GR, INJECT>(w, (unsigned)s);
      cp_commit();
    }

  int cur = -1; /* rope_id whose cos/sin are in shared memory */
  for (unsigned s = 0; s < w.nstages; s++) {
    fill<G, C, GR, INJECT>(w, s + NSTAGE - 1);
    cp_commit();
    cp_wait<NSTAGE - 1>(); /* this thread's copies of stage s have landed */
    const Stage st = stage_of(w, s);
    const kvi__xlayer &ly = a.layers[st.l];
    const unsigned rot = ly.style ? (unsigned)ly.rot : 0u;
    if (rot && st.kv == 0 && ly.rope_id != cur) { /* (uniform) */
      const unsigned half = rot >> 1;
      for (unsigned i = threadIdx.x; i < w.ntok * half; i += THREADS) {
        const unsigned j = i / half, k = i - j * half;
        float2 c = cos_sin(ly, s_pos[j], (int)k);
        if (!INJECT) { /* the inverse of a rotation scaled by m is R^T / m^2 */
          const float r = __fdiv_rn(1.0f, __fadd_rn(__fmul_rn(c.x, c.x), __fmul_rn(c.y, c.y)));
          c = make_float2(__fmul_rn(c.x, r), __fmul_rn(c.y, r));
        }
        s_cs[j * HM + k] = c;
      }
      cur = ly.rope_id;
    }
    __syncthreads(); /* every thread's copies (and the cos/sin) are visible */
    if (ly.style == 1)
      drain<G, C, E, INJECT, true>(w, s, rot);
    else
      drain<G, C, E, INJECT, false>(w, s, rot);
    __syncthreads(); /* the buffer is free for the fill of the next iteration */
  }
  cp_wait<0>();
}

template <typename G, typename C, int E, bool INJECT> int launch5(const kvi__xfer_args *a, cudaStream_t s) {
  const unsigned chunks = (unsigned)((a->layer_end - a->layer_begin + a->layers_per_cta - 1) / a->layers_per_cta);
  const dim3 grid((unsigned)a->nsegs, chunks);
  const size_t smem = KVI__XFER_SMEM(a->seg_tokens, a->half_max);
  /* more than 48 KiB of shared memory is opt-in, per device */
  static std::atomic<unsigned long long> opted{0};
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return (int)e;
  const unsigned long long bit = 1ull << (dev & 63);
  if (!(opted.load(std::memory_order_relaxed) & bit)) {
    e = cudaFuncSetAttribute(xfer_kernel<G, C, E, INJECT>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)KVI__XFER_SMEM_MAX);
    if (e != cudaSuccess) return (int)e;
    opted.fetch_or(bit, std::memory_order_relaxed);
  }
  xfer_kernel<G, C, E, INJECT><<<grid, THREADS, smem, s>>>(*a);
  return (int)cudaGetLastError();
}

template <typename G, typename C, int E> int launch4(const kvi__xfer_args *a, cudaStream_t s) {
  return a->inject ? launch5<G, C, E, true>(a, s) : launch5<G, C, E, false>(a, s);
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
