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
 *  - a thread's items follow from its index by a few adds per item (no
 *    division; the store half of a batch replays the walk), see Walk;
 *  - every thread issues all loads of a batch (8 16-byte vectors) before
 *    it converts or stores anything, so each SM keeps enough bytes in flight
 *    to cover DRAM latency;
 *  - small plans travel in the kernel parameters, so a call costs one launch
 *    and no upload.
 * Rotation uses explicit _rn intrinsics so it is never contracted into FMAs:
 * with an engine's cos/sin table the result is bit for bit the CPU
 * reference's.
 */
#include <cuda_runtime.h>

#include <type_traits>

#include "base/q4.h"
#include "gpu/kernels.h"
#include "rope.cuh"
#include "vec.cuh"

namespace {

using kvi::cvt;
using kvi::fp8e4;
using kvi::fp8e5;
using kvi::is_fp8;
using kvi::is_q4;

using kvi::ld;
using kvi::st;
using kvi::st_raw;
using kvi::to_f32;
using kvi::Vec;

/* Folds m into the fp32 amax slot: atomicMax on its bits (non-negative
 * floats order as their bits), once per group of the warp's lanes here
 * that share the slot (on sm_80 and later: their maximum, by the group's
 * first lane). A page's slot is its head's, and capture walks a head's
 * tokens in a row, so a warp's lanes mostly share one: one atomic where
 * each lane's vector took one. */
__device__ inline void slot_max(float *slot, float m) {
  unsigned bits = m > 0.0f ? __float_as_uint(m) : 0u;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned peers = __match_any_sync(__activemask(), (unsigned long long)(uintptr_t)slot);
  bits = __reduce_max_sync(peers, bits);
  if ((threadIdx.x & 31u) != (unsigned)(__ffs(peers) - 1)) return;
#endif
  if (bits) atomicMax(reinterpret_cast<unsigned *>(slot), bits);
}

/* Capture into an fp8 store (kernels.h, KVI__FP8_PH_*): n values of one
 * row. Keys come with their columns' offsets ko (base/fp8.h), values with
 * ko null. The bounds phase folds the values' amax into the slot
 * (slot_max; the keys' bounds are fp8_key_bounds'), the amax phase the
 * keys' amax of |x - m|, the write
 * phase turns v into the quotients to store under the scale the slot's
 * amax gives. Returns whether the caller stores v (the write phase; other
 * page dtypes always). */
template <typename G> __device__ inline bool to_store(float *v, int n, float *slot, int phase, const uint16_t *ko) {
  if constexpr (is_fp8<G>::value) {
    if (phase == KVI__FP8_PH_BOUNDS) {
      slot_max(slot, ko ? 0.0f : kvi::finite_amax(v, n));
      return false;
    }
    if (phase == KVI__FP8_PH_AMAX) {
      float m = 0.0f;
      if (ko)
        for (int i = 0; i < n; i++) m = fmaxf(m, kvi__fp8_key_mag(v[i], kvi::fp8_offset(ko[i])));
      slot_max(slot, m);
      return false;
    }
    const float sc = kvi::fp8_scale(*slot);
    for (int i = 0; i < n; i++)
      v[i] = ko ? kvi__fp8_key_quotient(v[i], kvi::fp8_offset(ko[i]), sc) : __fdiv_rn(v[i], sc);
  }
  return true;
}

/* Injection from an fp8 store: E stored values (as fp32) times the page
 * scale sc, plus (keys) their columns' offsets from ko: base/fp8.h's
 * fmaf(e4m3, scale, m); values e4m3 * scale. */
template <int E> __device__ inline void from_store_fp8(float *v, float sc, const uint16_t *ko) {
  if (ko) {
    float m[E];
    kvi::fp8_offsets<E>(m, ko);
#pragma unroll
    for (int i = 0; i < E; i++) v[i] = kvi__fp8_value(v[i], sc, m[i]);
  } else {
#pragma unroll
    for (int i = 0; i < E; i++) v[i] = __fmul_rn(v[i], sc);
  }
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

using kvi::cos_sin; /* rope.cuh */

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
constexpr int BR = 4; /* rotated units (2 vectors each) a thread keeps in flight */
constexpr int BP = 8; /* plain vectors a thread keeps in flight */

/* What a CTA knows about its segment and current layer. */
struct Ctx {
  const int64_t *coff; /* per token: cache element offset, -1 = skipped */
  const float2 *cs;    /* [token][half_max] cos/sin */
  unsigned ntok, H, D, HM;
  int64_t page_row0;   /* page element offset of (layer, plane 0, head 0, first token) */
  int64_t page_head;   /* page elements between heads: P * D */
  int64_t head_stride; /* cache elements between heads */
  int64_t dim_stride;  /* cache elements between dims: E == 1 only (vectors: 1) */
  float *gs;           /* fp8 stores: the page's scales of this layer, K heads then V heads */
  uint16_t *koff;      /* fp8 stores: the page's key offsets of this layer, [head][D] */
  uint16_t *khi;       /* fp8 stores, capture: the keys' high bound halves, [head][D] (base/fp8.h) */
  int phase;           /* kvi__xfer_args.phase */
  bool heads_inner;    /* the walk's row order (see Walk) */
};

/* Cache element offset of dim d in a head vector: vectors (E > 1) need
 * contiguous ones (the host picks E 1 otherwise), so only the element-wise
 * path multiplies. */
template <int E> __device__ inline int64_t dim_off(const Ctx &x, unsigned d) {
  if constexpr (E == 1) return (int64_t)d * x.dim_stride;
  else return d;
}

/* A thread's walk over the items of one pass. The items are (row, lane),
 * lanes (E-element columns or rotation units of one row) fastest; rows are
 * (head, token) pairs in the order the destination keeps them: heads inside
 * tokens when the destination holds a token's heads side by side (an NHD
 * cache, injecting), else tokens inside heads (the store's pages, and HND
 * caches), so that consecutive items write consecutive bytes. Thread t takes
 * items t, t + THREADS, ...; the step of THREADS items is split once per
 * pass into lanes, inner and outer rows, so that moving to the next item is
 * a few adds and compares (no division, and no coordinates held per item in
 * flight: the store half of a batch replays the walk from the batch's first
 * item). The walk ends when the outer index reaches its count. */
struct Step {
  unsigned nl, ni, no, du, di, dout;
  bool heads_inner;
};
struct Walk {
  unsigned u, i, o; /* lane, inner row index, outer row index */
  __device__ unsigned h(const Step &s) const { return s.heads_inner ? i : o; }
  __device__ unsigned j(const Step &s) const { return s.heads_inner ? o : i; }
};
__device__ inline Step make_step(unsigned nl, unsigned H, unsigned ntok, bool heads_inner) {
  const unsigned drow = THREADS / nl, ni = heads_inner ? H : ntok;
  return Step{nl, ni, heads_inner ? ntok : H, THREADS % nl, drow % ni, drow / ni, heads_inner};
}
__device__ inline Walk walk_start(const Step &s) {
  const unsigned row = threadIdx.x / s.nl;
  return Walk{threadIdx.x % s.nl, row % s.ni, row / s.ni};
}
__device__ inline void advance(Walk &w, const Step &s) {
  w.u += s.du; /* du < nl and di < ni: one carry each */
  unsigned c = w.u >= s.nl ? 1u : 0u;
  w.u -= c * s.nl;
  w.i += s.di + c;
  c = w.i >= s.ni ? 1u : 0u;
  w.i -= c * s.ni;
  w.o += s.dout + c;
}

/* The current item's head, token and lane, then one step on; false when
 * the walk had already ended. */
__device__ inline bool next(Walk &w, const Step &s, unsigned &h, unsigned &j, unsigned &u) {
  h = w.h(s), j = w.j(s), u = w.u;
  const bool in = w.o < s.no;
  advance(w, s);
  return in;
}

/* K's rotated part: a lane is a unit of E pairs of one (head, token), read
 * as two vectors at da and da + off_b. */
template <typename G, typename C, int E, bool INJECT, bool NEOX>
__device__ inline void rotated(const Ctx &x, G *page, C *kc, unsigned half, const float *ks) {
  using S = typename std::conditional<INJECT, G, C>::type; /* source element */
  if (half < E) return; /* (the host picks E so that E divides half) */
  const Step sp = make_step(half / E, x.H, x.ntok, x.heads_inner);
  const unsigned off_b = NEOX ? half : E;
  Walk w = walk_start(sp);
  while (w.o < sp.no) {
    const Walk w0 = w;
    Vec<S, E> va[BR], vb[BR];
    float gsc[BR]; /* fp8 stores: the page scale, loaded with the data */
#pragma unroll
    for (int b = 0; b < BR; b++) {
      unsigned h, j, u;
      if (!next(w, sp, h, j, u)) continue;
      const int64_t coff = x.coff[j];
      if (coff < 0) continue;
      const unsigned da = NEOX ? u * E : 2 * u * E;
      const S *src = INJECT ? (const S *)(page + x.page_row0 + h * x.page_head + (int64_t)j * x.D + da)
                            : (const S *)(kc + coff + h * x.head_stride + dim_off<E>(x, da));
      ld<S, E>(va[b], src);
      ld<S, E>(vb[b], src + (INJECT ? (int64_t)off_b : dim_off<E>(x, off_b)));
      if constexpr (INJECT && is_fp8<G>::value) gsc[b] = x.gs[h];
    }
    w = w0;
#pragma unroll
    for (int b = 0; b < BR; b++) {
      unsigned h, j, u;
      if (!next(w, sp, h, j, u)) continue;
      const int64_t coff = x.coff[j];
      if (coff < 0) continue;
      const unsigned da = NEOX ? u * E : 2 * u * E;
      G *pg = page + x.page_row0 + h * x.page_head + (int64_t)j * x.D + da;
      C *cr = kc + coff + h * x.head_stride + dim_off<E>(x, da);
      const float2 *cs = x.cs + j * x.HM + u * E;
      float2 c[E];
#pragma unroll
      for (int k = 0; k < E; k++) c[k] = cs[k];
      float v[2 * E];
      to_f32<S, E>(v, va[b]);
      to_f32<S, E>(v + E, vb[b]);
      if (INJECT) {
        if constexpr (is_fp8<G>::value) { /* keys: with their columns' offsets */
          from_store_fp8<E>(v, gsc[b], x.koff + h * x.D + da);
          from_store_fp8<E>(v + E, gsc[b], x.koff + h * x.D + da + off_b);
        }
        rotate<E, NEOX, true>(v, c);
        scale_for_cache<C>(v, 2 * E, is_fp8<C>::value ? ks[h] : 1.0f);
        st<C, E>(cr, v);
        st<C, E>(cr + dim_off<E>(x, off_b), v + E);
      } else {
        scale_from_cache<C>(v, 2 * E, is_fp8<C>::value ? ks[h] : 1.0f);
        rotate<E, NEOX, false>(v, c);
        if constexpr (is_fp8<G>::value) { /* keys: the two vectors' columns da.. and da + off_b.. */
          const int64_t c0 = (int64_t)h * x.D + da;
          const bool put = to_store<G>(v, E, x.gs + h, x.phase, x.koff + c0);
          to_store<G>(v + E, E, x.gs + h, x.phase, x.koff + c0 + off_b);
          if (!put) continue;
        }
        st<G, E>(pg, v);
        st<G, E>(pg + off_b, v + E);
      }
    }
  }
}

/* A converting copy of columns [col0, col0 + nl * E) of every (head, token)
 * row of one plane: K's pass-through tail [rot, D) (plane 0) or all of V
 * (plane 1). cscale: the cache's scales of the plane (fp8 caches); gs: the
 * page's scales of the plane, koff (keys; values null) its key offsets,
 * [head][D] (fp8 stores). */
template <typename G, typename C, int E, bool INJECT>
__device__ inline void plain(const Ctx &x, G *page, C *cache, int64_t plane, unsigned col0, unsigned nl,
                             const float *cscale, float *gs, uint16_t *koff) {
  using S = typename std::conditional<INJECT, G, C>::type;
  /* equal dtypes without scales: the bits move as they are (as on the CPU) */
  constexpr bool RAW = std::is_same<G, C>::value && !is_fp8<G>::value;
  if (nl == 0) return;
  const Step sp = make_step(nl, x.H, x.ntok, x.heads_inner);
  Walk w = walk_start(sp);
  while (w.o < sp.no) {
    const Walk w0 = w;
    Vec<S, E> v[BP];
    float sc[BP];  /* fp8 caches: the cache scale */
    float gsc[BP]; /* fp8 stores: the page scale */
#pragma unroll
    for (int b = 0; b < BP; b++) {
      unsigned h, j, u;
      if (!next(w, sp, h, j, u)) continue;
      const int64_t coff = x.coff[j];
      if (coff < 0) continue;
      const unsigned d = col0 + u * E;
      const S *src = INJECT ? (const S *)(page + x.page_row0 + plane + h * x.page_head + (int64_t)j * x.D + d)
                            : (const S *)(cache + coff + h * x.head_stride + dim_off<E>(x, d));
      ld<S, E>(v[b], src);
      if constexpr (is_fp8<C>::value) sc[b] = cscale[h];
      if constexpr (INJECT && is_fp8<G>::value) gsc[b] = gs[h];
    }
    w = w0;
#pragma unroll
    for (int b = 0; b < BP; b++) {
      unsigned h, j, u;
      if (!next(w, sp, h, j, u)) continue;
      const int64_t coff = x.coff[j];
      if (coff < 0) continue;
      const unsigned d = col0 + u * E;
      if constexpr (RAW) {
        if (INJECT)
          st_raw<S, E>(reinterpret_cast<S *>(cache + coff + h * x.head_stride + dim_off<E>(x, d)), v[b]);
        else
          st_raw<S, E>(reinterpret_cast<S *>(page + x.page_row0 + plane + h * x.page_head + (int64_t)j * x.D + d), v[b]);
        continue;
      }
      float f[E];
      to_f32<S, E>(f, v[b]);
      if (INJECT) {
        if constexpr (is_fp8<G>::value) from_store_fp8<E>(f, gsc[b], koff ? koff + h * x.D + d : nullptr);
        scale_for_cache<C>(f, E, is_fp8<C>::value ? sc[b] : 1.0f);
        st<C, E>(cache + coff + h * x.head_stride + dim_off<E>(x, d), f);
      } else {
        scale_from_cache<C>(f, E, is_fp8<C>::value ? sc[b] : 1.0f);
        if (!to_store<G>(f, E, is_fp8<G>::value ? gs + h : nullptr, x.phase, koff ? koff + h * x.D + d : nullptr))
          continue;
        st<G, E>(page + x.page_row0 + plane + h * x.page_head + (int64_t)j * x.D + d, f);
      }
    }
  }
}

/* The phases of a capture into an fp8 page done once per page, by its first
 * segment, for layers l0..l1 (kernels.h, KVI__FP8_PH_*): empty amax slots
 * and key bounds (low halves in the offset slots, high halves at
 * kvi__fp8_capture_hi), the key offsets from the bounds, or the scales from
 * the slots. */
template <typename G>
__device__ inline void fp8_page_phase(const kvi__xfer_args &a, G *page, float *gs, uint16_t *koff, int l0, int l1) {
  for (int i = l0 * 2 * a.H + (int)threadIdx.x; i < l1 * 2 * a.H; i += THREADS)
    if (a.phase == KVI__FP8_PH_EMPTY) gs[i] = 0.0f;
    else if (a.phase == KVI__FP8_PH_SCALES) gs[i] = kvi::fp8_scale(gs[i]);
  if (a.phase == KVI__FP8_PH_SCALES) return;
  const int HD = a.H * a.D;
  for (int i = l0 * HD + (int)threadIdx.x; i < l1 * HD; i += THREADS) {
    const int l = i / HD;
    uint16_t *hi = kvi__fp8_capture_hi(page, l, a.H, a.P, a.D) + (i - l * HD);
    if (a.phase == KVI__FP8_PH_EMPTY) {
      koff[i] = KVI__FP8_LO_EMPTY;
      *hi = KVI__FP8_HI_EMPTY;
    } else {
      koff[i] = kvi__fp8_offset_of((uint32_t)koff[i] | (uint32_t)*hi << 16);
    }
  }
}

#include "q4_pages.cuh" /* 4-bit pages: q4_layer, q4_page_words */

/* Points the context at plane kv (0 K, 1 V): its per-token offsets, head and
 * dim strides (read from the parameters at each use, so nothing more stays
 * live across the layer loop), and the walk's row order: an injection into a
 * cache whose heads of a token lie closer together than its tokens of a head
 * (NHD) walks heads inside tokens; the pages (capture) and HND caches the
 * other way. */
template <bool INJECT>
__device__ inline void set_plane(Ctx &x, const kvi__xfer_args &a, const int64_t *s_coff, int kv) {
  x.coff = kv && a.split_v ? s_coff + a.seg_tokens : s_coff; /* V's offsets follow K's (split_v) */
  x.head_stride = kv ? a.v_head_stride : a.head_stride;
  x.dim_stride = kv ? a.v_dim_stride : a.dim_stride;
  x.heads_inner = INJECT && (kv ? a.v_head_stride < a.v_token_stride : a.head_stride < a.token_stride);
}

/* One layer of a page of fp32, fp16, bf16 or fp8 elements: K (its rotated
 * part, then its pass-through tail), then V; in an fp8 capture's bounds
 * phase the keys go through fp8_key_bounds instead. */
template <typename G, typename C, int E, bool INJECT>
__device__ inline void vec_layer(Ctx &x, const kvi__xfer_args &a, G *page, int style, unsigned rot, C *kc, C *vc,
                                 const float *ks, const float *vs, const int64_t *s_coff) {
  const unsigned half = rot >> 1;
  set_plane<INJECT>(x, a, s_coff, 0);
  bool keys_bounded = false; /* fp8 capture's bounds phase: the keys' bounds per unit */
  if constexpr (is_fp8<G>::value && !INJECT) {
    keys_bounded = a.phase == KVI__FP8_PH_BOUNDS;
    if (keys_bounded && style == 1) fp8_key_bounds<C, E, true>(x, a, rot, kc, ks, s_coff);
    else if (keys_bounded) fp8_key_bounds<C, E, false>(x, a, rot, kc, ks, s_coff);
  }
  if (!keys_bounded) {
    if (rot) {
      if (style == 1)
        rotated<G, C, E, INJECT, true>(x, page, kc, half, ks);
      else
        rotated<G, C, E, INJECT, false>(x, page, kc, half, ks);
    }
    if (rot < x.D) /* K's pass-through tail */
      plain<G, C, E, INJECT>(x, page, kc, 0, rot, (x.D - rot) / E, ks, x.gs, x.koff);
  }
  if constexpr (is_fp8<G>::value && !INJECT)
    if (a.phase == KVI__FP8_PH_AMAX) return; /* the keys' alone: the values' amax came with the bounds */
  set_plane<INJECT>(x, a, s_coff, 1);
  plain<G, C, E, INJECT>(x, page, vc, (int64_t)x.H * x.page_head, 0, x.D / E, vs, x.gs ? x.gs + x.H : nullptr, nullptr);
}

template <typename G, typename C, int E, bool INJECT>
__global__ void __launch_bounds__(THREADS) xfer_kernel(const __grid_constant__ kvi__xfer_args a) {
  extern __shared__ float2 s_cs[]; /* [seg_tokens][half_max], then offsets and positions */
  const unsigned T = (unsigned)a.seg_tokens, HM = (unsigned)a.half_max;
  int64_t *s_coff = reinterpret_cast<int64_t *>(s_cs + T * HM);
  int32_t *s_pos = reinterpret_cast<int32_t *>(s_coff + (a.split_v ? 2 * T : T));

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (a.pdl) asm volatile("griddepcontrol.wait;" ::: "memory"); /* the plan kernel's segments */
#endif
  /* the plan: in the parameters (generic addresses into the constant bank) or uploaded */
  const char *plan = a.inline_bytes ? reinterpret_cast<const char *>(a.inline_plan) : a.plan_dev;
  const kvi__xseg sg = reinterpret_cast<const kvi__xseg *>(plan)[blockIdx.x];
  const unsigned ntok = sg.ntok;
  if (ntok == 0) return; /* a segment retrieve-and-inject reserved and did not need */
  /* a host-tier page (KVI_HOST_PAGES_READ_MAPPED) is read in place through its mapped address */
  G *page = sg.page < a.host_first ? static_cast<G *>(a.pool) + (int64_t)sg.page * a.page_elems
                                   : static_cast<G *>(a.host_pool) + (int64_t)(sg.page - a.host_first) * a.page_elems;
  const int l0 = a.layer_begin + (int)blockIdx.y * a.layers_per_cta;
  const int l1 = min(l0 + a.layers_per_cta, a.layer_end);
  /* capture into a 4-bit page that this segment alone covers (its first,
   * and the plan's next segment, if any, is another page's: a page's
   * segments are consecutive) runs whole in phase 1 (q4_capture) */
  bool q4_sole = false;
  if constexpr (is_q4<G>::value && !INJECT) {
    q4_sole = sg.tok0 == 0 && (blockIdx.x + 1 == (unsigned)a.nsegs ||
                               reinterpret_cast<const kvi__xseg *>(plan)[blockIdx.x + 1].page != sg.page);
    if (a.phase != 1 && q4_sole) return;
    if (a.phase == 0 || a.phase == 3) {
      q4_page_words(a, page, sg, l0, l1);
      return;
    }
  }
  float *gs = nullptr;      /* fp8 stores: the page's scales, [layer][K, V][head] */
  uint16_t *koff = nullptr; /* fp8 stores: the page's key offsets, [layer][head][D] */
  if constexpr (is_fp8<G>::value) {
    gs = reinterpret_cast<float *>(reinterpret_cast<char *>(page) + a.scale_off);
    koff = reinterpret_cast<uint16_t *>(reinterpret_cast<char *>(page) + a.scale_off + kvi__fp8_offsets_rel(a.L, a.H));
    if (!INJECT && (a.phase == KVI__FP8_PH_EMPTY || a.phase == KVI__FP8_PH_OFFSETS || a.phase == KVI__FP8_PH_SCALES)) {
      if (sg.tok0 == 0) fp8_page_phase(a, page, gs, koff, l0, l1); /* a page's, by its first segment */
      return;
    }
  }
  for (unsigned j = threadIdx.x; j < ntok; j += THREADS) {
    const kvi__xreq rq = reinterpret_cast<const kvi__xreq *>(plan + a.o_reqs)[sg.req];
    const int32_t *table = rq.table ? rq.table : reinterpret_cast<const int32_t *>(plan + rq.table_off);
    const int64_t s = sg.seq0 + j, bi = s / a.BS - rq.first_block;
    int64_t c = -1, cv = -1; /* block ids outside the cache (only device tables can have them) are skipped */
    if (bi >= 0 && bi < rq.table_len) {
      const int32_t b = table[bi];
      if (b >= 0 && b < a.NB) {
        c = (int64_t)b * a.block_stride + (s % a.BS) * a.token_stride;
        cv = (int64_t)b * a.v_block_stride + (s % a.BS) * a.v_token_stride;
      }
    }
    s_coff[j] = c;
    if (a.split_v) s_coff[T + j] = cv; /* V's own offsets (set_plane) */
    s_pos[j] = sg.explicit_pos ? reinterpret_cast<const int32_t *>(plan + a.o_pos)[sg.pos0 + j] : sg.pos0 + (int32_t)j;
    if (c < 0 && blockIdx.y == 0) atomicAdd(a.skipped, 1ull);
  }
  __syncthreads();

  Ctx x;
  x.coff = s_coff;
  x.cs = s_cs;
  x.ntok = ntok;
  x.H = (unsigned)a.H;
  x.D = (unsigned)a.D;
  x.HM = HM;
  x.page_head = (int64_t)a.P * a.D;
  x.phase = a.phase;
  int cur = -1; /* rope_id whose cos/sin are in shared memory */
  for (int l = l0; l < l1; l++) {
    const kvi__xlayer ly = a.layers[l];
    const unsigned rot = ly.style ? (unsigned)ly.rot : 0u, half = rot >> 1;
    if (rot && ly.rope_id != cur) {
      if (cur >= 0) __syncthreads(); /* (uniform) everyone is done with the previous table */
      for (unsigned i = threadIdx.x; i < ntok * half; i += THREADS) {
        const unsigned j = i / half, k = i - j * half;
        float2 c = cos_sin(ly, s_pos[j], (int)k);
        if (!INJECT) { /* the inverse of a rotation scaled by m is R^T / m^2 */
          const float r = __fdiv_rn(1.0f, __fadd_rn(__fmul_rn(c.x, c.x), __fmul_rn(c.y, c.y)));
          c = make_float2(__fmul_rn(c.x, r), __fmul_rn(c.y, r));
        }
        s_cs[j * HM + k] = c;
      }
      __syncthreads();
      cur = ly.rope_id;
    }
    x.page_row0 = ((int64_t)l * 2 * a.H * a.P + sg.tok0) * a.D;
    const float *ks = a.k_scale + l * a.H, *vs = a.v_scale + l * a.H;
    x.gs = gs ? gs + l * 2 * a.H : nullptr;
    x.koff = koff ? koff + (int64_t)l * a.H * a.D : nullptr;
    x.khi = koff ? kvi__fp8_capture_hi(page, l, a.H, a.P, a.D) : nullptr;
    C *kc = reinterpret_cast<C *>(ly.k), *vc = reinterpret_cast<C *>(ly.v);
    if constexpr (is_q4<G>::value) {
      q4_layer<C, E, INJECT>(x, a, reinterpret_cast<uint8_t *>(page), l, ly.style, rot, kc, vc, ks, vs, s_coff, sg.tok0,
                             q4_sole);
    } else { /* discarded for 4-bit pages: the vector walk has no 4-bit element type */
      vec_layer<G, C, E, INJECT>(x, a, page, ly.style, rot, kc, vc, ks, vs, s_coff);
    }
  }
}

/* Whether a kernel's code was compiled for compute capability 9.0 or later
 * (its griddepcontrol.wait is there): code JIT-compiled from an older
 * architecture's PTX has none, and must not be launched as a programmatic
 * dependent. Asked once per kernel. */
template <typename G, typename C, int E, bool INJECT> bool waits_for_primary() {
  static int known = -1; /* a benign race: every thread finds the same answer */
  if (known < 0) {
    cudaFuncAttributes fa;
    known = cudaFuncGetAttributes(&fa, xfer_kernel<G, C, E, INJECT>) == cudaSuccess && fa.ptxVersion >= 90;
    (void)cudaGetLastError();
  }
  return known == 1;
}

template <typename G, typename C, int E> int launch4(const kvi__xfer_args *a, cudaStream_t s) {
  const unsigned chunks = (unsigned)((a->layer_end - a->layer_begin + a->layers_per_cta - 1) / a->layers_per_cta);
  const dim3 grid((unsigned)a->nsegs, chunks);
  const size_t smem = KVI__XFER_SMEM(a->seg_tokens, a->half_max, a->split_v);
  if (a->pdl && (a->inject ? waits_for_primary<G, C, E, true>() : waits_for_primary<G, C, E, false>())) {
    /* a programmatic dependent of the plan kernel: its launch overlaps that kernel */
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    const cudaError_t e = a->inject ? cudaLaunchKernelEx(&cfg, xfer_kernel<G, C, E, true>, *a)
                                    : cudaLaunchKernelEx(&cfg, xfer_kernel<G, C, E, false>, *a);
    (void)cudaGetLastError();
    return (int)e;
  }
  if (a->inject)
    xfer_kernel<G, C, E, true><<<grid, THREADS, smem, s>>>(*a);
  else
    xfer_kernel<G, C, E, false><<<grid, THREADS, smem, s>>>(*a);
  return (int)cudaGetLastError();
}

template <typename G, typename C> int launch3(const kvi__xfer_args *a, cudaStream_t s) {
  if constexpr (is_q4<G>::value) { /* chunks of 8 columns (a 32-bit word of codes) or 2 (a byte) */
    return a->vec >= 8 ? launch4<G, C, 8>(a, s) : launch4<G, C, 1>(a, s);
  } else {
    return a->vec == 8 ? launch4<G, C, 8>(a, s) : launch4<G, C, 1>(a, s);
  }
}

} // namespace

/* One (page dtype, cache dtype) pair's kernels. Their 90 instantiations in
 * one translation unit take minutes of nvcc per architecture, so the build
 * (cuda/meson.build) compiles this file once per pair with KVI_XFER_PAGE and
 * KVI_XFER_CACHE naming the two types, which instantiates xfer_launch for that
 * pair only, and once without them for everything below it: the dispatch,
 * which calls the pairs' xfer_launch. */
namespace kvi {
template <typename G, typename C> int xfer_launch(const kvi__xfer_args *a, cudaStream_t s);
#ifdef KVI_XFER_PAGE
template <typename G, typename C> int xfer_launch(const kvi__xfer_args *a, cudaStream_t s) { return launch3<G, C>(a, s); }
template int xfer_launch<KVI_XFER_PAGE, KVI_XFER_CACHE>(const kvi__xfer_args *a, cudaStream_t s);
#endif
} // namespace kvi

#ifndef KVI_XFER_PAGE
namespace {

using kvi::xfer_launch;

template <typename G> int launch2(const kvi__xfer_args *a, cudaStream_t s) {
  switch (a->cache_dtype) {
  case KVI_DTYPE_FP32: return xfer_launch<G, float>(a, s);
  case KVI_DTYPE_FP16: return xfer_launch<G, __half>(a, s);
  case KVI_DTYPE_BF16: return xfer_launch<G, __nv_bfloat16>(a, s);
  case KVI_DTYPE_FP8_E4M3: return xfer_launch<G, fp8e4>(a, s);
  case KVI_DTYPE_FP8_E5M2: return xfer_launch<G, fp8e5>(a, s);
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
  case KVI_DTYPE_FP8_E4M3: return launch2<fp8e4>(a, s);
  case KVI_DTYPE_Q4: return launch2<kvi::q4>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}
#endif /* KVI_XFER_PAGE */
