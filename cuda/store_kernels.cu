/*
 * libkvinject — store copy kernels: dense K/V view <-> fact pages.
 * SPDX-License-Identifier: Apache-2.0
 *
 * Memory traffic: each element is read once and written once, so a launch
 * moves tokens * L * 2 * H * D * (sizeof(src) + sizeof(dst)) bytes; the bound
 * is the device copy rate. Each thread moves one 8-element vector of one
 * (layer, plane, head, token) row; consecutive threads walk d, then tokens,
 * so page writes (contiguous per layer/plane/head) coalesce. When every row
 * start is 16-byte aligned the vector moves as 16-byte loads and stores.
 */
#include <cuda_runtime.h>

#include "base/q4.h"
#include "gpu/kernels.h"
#include "vec.cuh"

namespace {

constexpr int VEC = 8;

using kvi::convert;
using kvi::Vec;

/* VEC elements of T, moved as 16-byte words when every row start is aligned
 * (Vec<T, VEC> is 16-byte aligned: 16 or 32 bytes), else element by element
 * up to the row's end. */
template <typename T, bool ALIGNED> __device__ inline void load_vec(Vec<T, VEC> &r, const T *p, int n) {
  if (ALIGNED) kvi::ld<T, VEC>(r, p);
  else kvi::ld_n<T, VEC>(r, p, n);
}

template <typename T, bool ALIGNED> __device__ inline void store_vec(T *p, const Vec<T, VEC> &r, int n) {
  if (ALIGNED) kvi::st_raw<T, VEC>(p, r);
  else kvi::st_n<T, VEC>(p, r, n);
}

/* TO_PAGES: view -> pages; otherwise pages -> view. V is the view's element
 * type, G the page's. */
template <typename V, typename G, bool TO_PAGES, bool ALIGNED>
__global__ void copy_kernel(const kvi__copy_args a) {
  const int nvec = (a.D + VEC - 1) / VEC;
  const int64_t total = (int64_t)a.L * 2 * a.H * a.num_tokens * nvec;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i;
    const int dv = (int)(r % nvec);
    r /= nvec;
    const int t = (int)(r % a.num_tokens); /* token within this launch */
    r /= a.num_tokens;
    const int h = (int)(r % a.H);
    r /= a.H;
    const int kv = (int)(r % 2);
    const int l = (int)(r / 2);
    const int d0 = dv * VEC;
    const int n = min(VEC, a.D - d0);

    const int tok = a.token_first + t;                  /* token within the fact */
    const int pi = t / a.P;                             /* launches start on a page boundary */
    const int tp = tok % a.P;
    G *page = static_cast<G *>(a.pool) + (int64_t)a.pages[pi] * a.page_elems;
    G *g = page + ((((int64_t)l * 2 + kv) * a.H + h) * a.P + tp) * a.D + d0;
    const V *vbase = static_cast<const V *>(kv ? a.vv : a.vk);
    V *v = const_cast<V *>(vbase) + (int64_t)l * a.layer_stride + (int64_t)tok * a.token_stride +
           (int64_t)h * a.head_stride + d0;

    if (TO_PAGES) {
      Vec<V, VEC> in;
      Vec<G, VEC> out;
      load_vec<V, ALIGNED>(in, v, n);
#pragma unroll
      for (int e = 0; e < VEC; e++) out.v[e] = convert<V, G>(in.v[e]);
      store_vec<G, ALIGNED>(g, out, n);
    } else {
      Vec<G, VEC> in;
      Vec<V, VEC> out;
      load_vec<G, ALIGNED>(in, g, n);
#pragma unroll
      for (int e = 0; e < VEC; e++) out.v[e] = convert<G, V>(in.v[e]);
      store_vec<V, ALIGNED>(v, out, n);
    }
  }
}

template <typename V, typename G, bool TO_PAGES>
int launch3(const kvi__copy_args *a, cudaStream_t s) {
  const int nvec = (a->D + VEC - 1) / VEC;
  const int64_t total = (int64_t)a->L * 2 * a->H * a->num_tokens * nvec;
  const int threads = 256;
  int64_t blocks = (total + threads - 1) / threads;
  if (blocks > 65535) blocks = 65535; /* grid-stride beyond this */
  /* 16-byte moves need every row start aligned: bases, strides and D. */
  const uintptr_t vb = (uintptr_t)a->vk | (uintptr_t)a->vv;
  const bool aligned = a->D % VEC == 0 && vb % 16 == 0 && (uintptr_t)a->pool % 16 == 0 &&
                       (a->layer_stride * (int64_t)sizeof(V)) % 16 == 0 &&
                       (a->token_stride * (int64_t)sizeof(V)) % 16 == 0 &&
                       (a->head_stride * (int64_t)sizeof(V)) % 16 == 0;
  if (aligned)
    copy_kernel<V, G, TO_PAGES, true><<<(unsigned)blocks, threads, 0, s>>>(*a);
  else
    copy_kernel<V, G, TO_PAGES, false><<<(unsigned)blocks, threads, 0, s>>>(*a);
  return (int)cudaGetLastError();
}

/* fp8 stores: a CTA per (page, layer, plane, head) group, the unit a scale
 * covers. Put: for keys, each channel's bounds (a thread per channel over
 * the group's tokens) and its offset (base/fp8.h), kept in shared memory;
 * amax over the group's |x - m| (values |x|: m none), the scale, then the
 * e4m3 bytes (further reads, from L2); read: fmaf(e4m3, scale, m) (values
 * e4m3 * scale). The offsets, the scale and the rounding are
 * lib/base/convert.c's (base/fp8.h), operation for operation, so the bytes
 * equal the CPU's. Not the injector's hot path: scalar accesses, coalesced
 * along d. */
template <typename V, bool TO_PAGES>
__global__ void __launch_bounds__(256) fp8_kernel(const kvi__copy_args a) {
  __shared__ float s_red[8];
  __shared__ float s_m[1024]; /* keys: the channels' offsets (head_size <= 1024) */
  const int groups = a.L * 2 * a.H;
  const int64_t total = (int64_t)a.count * groups;
  for (int64_t u = blockIdx.x; u < total; u += gridDim.x) { /* uniform over the CTA */
    const int pi = (int)(u / groups), grp = (int)(u % groups);
    const int h = grp % a.H, kv = (grp / a.H) % 2, l = grp / (2 * a.H);
    const int t0 = pi * a.P; /* first token of the page, within this launch */
    const int n = min(a.P, a.num_tokens - t0), m = n * a.D;
    uint8_t *page = static_cast<uint8_t *>(a.pool) + (int64_t)a.pages[pi] * a.page_elems;
    uint8_t *g = page + (int64_t)grp * a.P * a.D;
    float *scale = reinterpret_cast<float *>(page + a.scale_off) + grp;
    uint16_t *ko = reinterpret_cast<uint16_t *>(page + a.scale_off + kvi__fp8_offsets_rel(a.L, a.H)) +
                   ((int64_t)l * a.H + h) * a.D; /* keys: the channels' offsets */
    V *vb = const_cast<V *>(static_cast<const V *>(kv ? a.vv : a.vk)) + (int64_t)l * a.layer_stride +
            (int64_t)(a.token_first + t0) * a.token_stride + (int64_t)h * a.head_stride;
    if (TO_PAGES) {
      if (kv == 0) { /* keys: each channel's offset from its finite values' bounds */
        for (int d = threadIdx.x; d < a.D; d += blockDim.x) {
          float mn = INFINITY, mx = -INFINITY;
          for (int t = 0; t < n; t++) {
            const float x = kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + d]);
            if (x - x == 0.0f) mn = fminf(mn, x), mx = fmaxf(mx, x); /* finite only */
          }
          const uint16_t off = kvi__fp8_offset_of(kvi__q4_bounds(mn, mx));
          ko[d] = off;
          s_m[d] = kvi::fp8_offset(off);
        }
        __syncthreads();
      }
      float amax = 0.0f;
      for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int t = i / a.D, d = i - t * a.D;
        const float x = kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + d]);
        amax = kv ? kvi::fp8_amax(amax, x) : fmaxf(amax, kvi__fp8_key_mag(x, s_m[d])); /* finite only */
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      if ((threadIdx.x & 31) == 0) s_red[threadIdx.x >> 5] = amax;
      __syncthreads();
      amax = s_red[0];
      for (int w = 1; w < (int)(blockDim.x >> 5); w++) amax = fmaxf(amax, s_red[w]);
      const float sc = kvi::fp8_scale(amax);
      for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int t = i / a.D, d = i - t * a.D;
        const float x = kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + d]);
        g[i] = kv ? kvi::fp8_quantize(x, sc) : kvi::fp8_quantize_key(x, s_m[d], sc);
      }
      if (threadIdx.x == 0) *scale = sc;
      __syncthreads(); /* s_red and s_m are reused by the next group */
    } else {
      const float sc = *scale;
      if (kv == 0) {
        for (int d = threadIdx.x; d < a.D; d += blockDim.x) s_m[d] = kvi::fp8_offset(ko[d]);
        __syncthreads();
      }
      for (int i = threadIdx.x; i < m; i += blockDim.x) {
        const int t = i / a.D, d = i - t * a.D;
        vb[(int64_t)t * a.token_stride + d] =
            kvi::cvt<V>::from(kv ? kvi::fp8_dequantize(g[i], sc) : kvi::fp8_dequantize_key(g[i], sc, s_m[d]));
      }
      if (kv == 0) __syncthreads(); /* s_m is reused by the next group */
    }
  }
}

template <typename V, bool TO_PAGES> int launch_fp8(const kvi__copy_args *a, cudaStream_t s) {
  int64_t blocks = (int64_t)a->count * a->L * 2 * a->H;
  if (blocks > 65535) blocks = 65535; /* grid-stride beyond this */
  fp8_kernel<V, TO_PAGES><<<(unsigned)blocks, 256, 0, s>>>(*a);
  return (int)cudaGetLastError();
}

/* 4-bit stores (base/q4.h): a CTA per (page, layer, plane, head) as for fp8.
 * Put: keys a byte column (two channels) per thread, their bounds folded
 * over the page's tokens, then their words and codes; values a token per
 * thread, its row's bounds, word and codes (words of tokens past the fact
 * zero). Read: an element per thread. The arithmetic is base/q4.h's, so the
 * pages equal the CPU's byte for byte. */
template <typename V, bool TO_PAGES>
__global__ void __launch_bounds__(256) q4_kernel(const kvi__copy_args a) {
  const int groups = a.L * 2 * a.H;
  const int64_t total = (int64_t)a.count * groups;
  for (int64_t u = blockIdx.x; u < total; u += gridDim.x) { /* uniform over the CTA */
    const int pi = (int)(u / groups), grp = (int)(u % groups);
    const int h = grp % a.H, kv = (grp / a.H) % 2, l = grp / (2 * a.H);
    const int t0 = pi * a.P, n = min(a.P, a.num_tokens - t0), D = a.D;
    uint8_t *page = static_cast<uint8_t *>(a.pool) + (int64_t)a.pages[pi] * a.page_elems;
    uint8_t *g = page + (int64_t)grp * a.P * D / 2;
    uint32_t *words = reinterpret_cast<uint32_t *>(page + a.scale_off);
    uint32_t *kw = words + ((int64_t)l * a.H + h) * D, *vw = words + (int64_t)a.L * a.H * D + ((int64_t)l * a.H + h) * a.P;
    V *vb = const_cast<V *>(static_cast<const V *>(kv ? a.vv : a.vk)) + (int64_t)l * a.layer_stride +
            (int64_t)(a.token_first + t0) * a.token_stride + (int64_t)h * a.head_stride;
    if (!TO_PAGES) {
      for (int i = threadIdx.x; i < n * D; i += blockDim.x) {
        const int t = i / D, d = i - t * D;
        vb[(int64_t)t * a.token_stride + d] = kvi::cvt<V>::from(kvi__q4_decode(g, i, kv ? vw[t] : kw[d]));
      }
    } else if (kv == 0) {
      for (int b = threadIdx.x; b < D / 2; b += blockDim.x) {
        uint32_t b0 = KVI__Q4_BOUNDS_EMPTY, b1 = KVI__Q4_BOUNDS_EMPTY;
        for (int t = 0; t < n; t++) {
          b0 = kvi__q4_fold(b0, kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + 2 * b]));
          b1 = kvi__q4_fold(b1, kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + 2 * b + 1]));
        }
        const uint32_t w0 = kvi__q4_params(b0), w1 = kvi__q4_params(b1);
        kw[2 * b] = w0, kw[2 * b + 1] = w1;
        for (int t = 0; t < n; t++) {
          const float x0 = kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + 2 * b]);
          const float x1 = kvi::cvt<V>::to(vb[(int64_t)t * a.token_stride + 2 * b + 1]);
          g[(int64_t)t * D / 2 + b] = (uint8_t)(kvi__q4_code(x0, w0) | kvi__q4_code(x1, w1) << 4);
        }
      }
    } else {
      for (int t = threadIdx.x; t < a.P; t += blockDim.x) {
        if (t >= n) {
          vw[t] = 0u;
          continue;
        }
        const V *row = vb + (int64_t)t * a.token_stride;
        uint32_t bounds = KVI__Q4_BOUNDS_EMPTY;
        for (int d = 0; d < D; d++) bounds = kvi__q4_fold(bounds, kvi::cvt<V>::to(row[d]));
        const uint32_t w = kvi__q4_params(bounds);
        vw[t] = w;
        for (int d = 0; d < D; d += 2)
          g[(int64_t)t * D / 2 + d / 2] =
              (uint8_t)(kvi__q4_code(kvi::cvt<V>::to(row[d]), w) | kvi__q4_code(kvi::cvt<V>::to(row[d + 1]), w) << 4);
      }
    }
  }
}

template <typename V, bool TO_PAGES> int launch_q4(const kvi__copy_args *a, cudaStream_t s) {
  int64_t blocks = (int64_t)a->count * a->L * 2 * a->H;
  if (blocks > 65535) blocks = 65535; /* grid-stride beyond this */
  q4_kernel<V, TO_PAGES><<<(unsigned)blocks, 256, 0, s>>>(*a);
  return (int)cudaGetLastError();
}

template <typename V, bool TO_PAGES> int launch2(const kvi__copy_args *a, cudaStream_t s) {
  switch (a->page_dtype) {
  case KVI_DTYPE_FP32: return launch3<V, float, TO_PAGES>(a, s);
  case KVI_DTYPE_FP16: return launch3<V, __half, TO_PAGES>(a, s);
  case KVI_DTYPE_BF16: return launch3<V, __nv_bfloat16, TO_PAGES>(a, s);
  case KVI_DTYPE_FP8_E4M3: return launch_fp8<V, TO_PAGES>(a, s);
  case KVI_DTYPE_Q4: return launch_q4<V, TO_PAGES>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}

template <bool TO_PAGES> int launch(const kvi__copy_args *a, cudaStream_t s) {
  switch (a->view_dtype) {
  case KVI_DTYPE_FP32: return launch2<float, TO_PAGES>(a, s);
  case KVI_DTYPE_FP16: return launch2<__half, TO_PAGES>(a, s);
  case KVI_DTYPE_BF16: return launch2<__nv_bfloat16, TO_PAGES>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}

} // namespace

extern "C" int kvi__cuda_view_to_pages(const kvi__copy_args *a, struct CUstream_st *stream) {
  return launch<true>(a, (cudaStream_t)stream);
}

extern "C" int kvi__cuda_pages_to_view(const kvi__copy_args *a, struct CUstream_st *stream) {
  return launch<false>(a, (cudaStream_t)stream);
}

namespace {

/* One CTA per entry (kernels.h, kvi__emb_rows_args): the row in 16-byte units,
 * the directory words, then the id. */
__global__ void rows_kernel(const __grid_constant__ kvi__emb_rows_args a) {
  for (int32_t i = (int32_t)blockIdx.x; i < a.n; i += (int32_t)gridDim.x) {
    const kvi__row_entry e = a.entries[i];
    const uint4 *row = (const uint4 *)(a.src + e.emb_src);
    for (uint32_t j = threadIdx.x; j < e.emb_bytes / 16; j += blockDim.x) ((uint4 *)e.emb)[j] = row[j];
    const uint32_t *w = (const uint32_t *)(a.src + e.dir_src);
    if (e.dir)
      for (uint32_t j = threadIdx.x; j < e.dir_words; j += blockDim.x) e.dir[j] = w[j];
    if (threadIdx.x == 0) *e.ids = e.id;
  }
}

} // namespace

extern "C" int kvi__cuda_emb_rows_set(const kvi__emb_rows_args *a, struct CUstream_st *stream) {
  if (a->n <= 0) return 0;
  const int blocks = a->n < 4096 ? a->n : 4096;
  rows_kernel<<<blocks, 128, 0, (cudaStream_t)stream>>>(*a);
  return (int)cudaGetLastError();
}
