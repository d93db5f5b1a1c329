/*
 * libkvinject — retrieval kernels: query preparation, the scan (scores of a
 * few queries against a tenant's embedding rows), top-k selection and the
 * results. The GEMM for larger batches is cuBLASLt's (lib/gpu/cuda_rt.c).
 * SPDX-License-Identifier: Apache-2.0
 *
 * Memory traffic and bounds:
 * - scan: reads each row of a tile once (rows x ld x element bytes) and
 *   writes qn fp32 scores per row, so with qn <= KVI__SCAN_MAX_Q it is bound
 *   by the device's read bandwidth. A warp owns 4 rows at a time and reads
 *   them as 16-byte vectors, two vectors per row in flight per lane (8
 *   loads); the queries sit in shared memory as fp32, laid out so that a
 *   warp's float4 reads are conflict-free, and each query value is reused
 *   for 4 rows. fp32 accumulation (fmaf), then a warp reduction.
 * - selection: a CTA per run of scores (or of candidate pairs) finds, on
 *   a sample of the run (every 8th input, when that is >= 8k inputs and
 *   k <= 128), the
 *   range, a histogram of it and the bin holding the sample's k-th best;
 *   then it reads the whole run once, gathers the inputs from that bin up
 *   (about 8k of them on real scores) and sorts only those. Inputs the
 *   histogram cannot split (ties over the whole run, infinities) take an
 *   exact running-threshold loop instead.
 * - prep and emit touch num_queries x dim and num_queries x k elements.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "vec.cuh"
#include "gpu/kernels.h"
#include "kvinject/search.h"

namespace {

using kvi::cvt;

constexpr int THREADS = 256;
constexpr int WARPS = THREADS / 32;
constexpr int ROWS = 4;     /* rows a scan warp handles at once; WARPS * ROWS == KVI__SCAN_ROWS */
constexpr int SEL_N = 2048; /* pairs a selection CTA holds: k <= 1024 kept + candidates */
constexpr int SEL_R = 1024; /* inputs read per round: 4 per thread */
constexpr int SEL_BINS = 1024; /* histogram bins of the selection's fast path */
constexpr int ILP = 8;         /* loads a selection thread keeps in flight */
constexpr int ILP4 = 4;        /* 16-byte loads, where the scores allow them */
constexpr int STEP = 8;        /* the fast path samples one input in STEP of a long run */
static_assert(WARPS * ROWS == KVI__SCAN_ROWS, "scan rows per CTA step");
static_assert(SEL_N - KVI_SEARCH_MAX_K >= SEL_R, "a round always fits the candidate buffer");

typedef unsigned long long u64;
typedef unsigned int u32;

/* ---------------------------------------------------------------- prep */

/* One CTA per slot: query perm[slot] -> row `slot` of q, scaled (cosine) and
 * rounded exactly as kvi__emb_prepare does on the host (double sum of
 * squares, x * (1 / sqrt(sum)) in double, rounded to fp32 then to S). A query
 * with a NaN or infinity, or a value that overflows S, becomes zeros, is
 * marked invalid and counted. */
template <typename R, typename S> __global__ void __launch_bounds__(THREADS) prep_kernel(const kvi__search_args a) {
  __shared__ double part[WARPS];
  const int slot = blockIdx.x;
  const R *src = static_cast<const R *>(a.raw) + (int64_t)a.perm[slot] * a.dim;
  S *dst = static_cast<S *>(a.q) + (int64_t)slot * a.ld;
  bool bad = false;
  double ss = 0.0;
  for (int i = threadIdx.x; i < a.dim; i += THREADS) {
    const float x = cvt<R>::to(src[i]);
    bad |= !isfinite(x);
    ss += (double)x * (double)x; /* exact product: contraction cannot change it */
  }
  bad = __syncthreads_or(bad);
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  double sum = 0.0;
  for (int w = 0; w < WARPS; w++) sum += part[w];
  const double inv = a.cosine && sum > 0.0 ? 1.0 / sqrt(sum) : 1.0;
  if (!bad) { /* uniform */
    for (int i = threadIdx.x; i < a.ld; i += THREADS) {
      float v = 0.0f;
      if (i < a.dim) {
        const float x = cvt<R>::to(src[i]);
        v = a.cosine ? (float)((double)x * inv) : x;
      }
      const S r = cvt<S>::from(v);
      bad |= !isfinite(cvt<S>::to(r));
      dst[i] = r;
    }
    bad = __syncthreads_or(bad);
  }
  if (bad) {
    for (int i = threadIdx.x; i < a.ld; i += THREADS) dst[i] = cvt<S>::from(0.0f);
    /* device scope, as the injector's counter: a system-scoped atomic on
     * mapped host memory is not allowed everywhere (memcheck refuses it on
     * the H200); the host reads the counter after synchronizing */
    if (threadIdx.x == 0) atomicAdd(a.bad, 1ull);
  }
  if (threadIdx.x == 0) a.valid[slot] = bad ? 0 : 1;
}

/* ---------------------------------------------------------------- scan */

using kvi::unpack; /* vec.cuh: a 16-byte word of a row as fp32 */

/* acc[r][q] += row r's vector v . query q's vector v */
template <typename S, int QB>
__device__ inline void accumulate(float (&acc)[ROWS][QB], const uint4 (&w)[ROWS], const float4 *qs, int nvec, int v,
                                  int qn) {
  constexpr int EPV = 16 / (int)sizeof(S), H = EPV / 4;
  float x[ROWS][EPV];
#pragma unroll
  for (int r = 0; r < ROWS; r++) unpack<S>::to(w[r], x[r]);
#pragma unroll
  for (int q = 0; q < QB; q++) {
    if (q < qn) {
#pragma unroll
      for (int h = 0; h < H; h++) {
        const float4 y = qs[(q * H + h) * nvec + v];
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
          acc[r][q] = fmaf(x[r][4 * h + 0], y.x, acc[r][q]);
          acc[r][q] = fmaf(x[r][4 * h + 1], y.y, acc[r][q]);
          acc[r][q] = fmaf(x[r][4 * h + 2], y.z, acc[r][q]);
          acc[r][q] = fmaf(x[r][4 * h + 3], y.w, acc[r][q]);
        }
      }
    }
  }
}

/* One CTA per kvi__sblock: scores of its tile's qn (<= QB) queries against
 * rows [r0, r0 + nr) of the tile. Rows are ld elements, ld * sizeof(S) a
 * multiple of 16 bytes (padding is zero in rows and queries). */
template <typename S, int QB> __global__ void __launch_bounds__(THREADS) scan_kernel(const kvi__search_args a) {
  extern __shared__ float4 qs[]; /* element j of vector v of query q: qs[(q * H + j / 4) * nvec + v], lane j % 4 */
  constexpr int EPV = 16 / (int)sizeof(S), H = EPV / 4;
  const kvi__sblock b = a.blocks[blockIdx.x];
  const kvi__stile t = a.tiles[b.tile];
  const int nvec = a.ld / EPV, qn = t.qn;
  float *qf = reinterpret_cast<float *>(qs);
  const S *qsrc = static_cast<const S *>(a.q) + (int64_t)t.q0 * a.ld;
  for (int i = threadIdx.x; i < qn * a.ld; i += THREADS) {
    const int q = i / a.ld, e = i - q * a.ld, v = e / EPV, j = e - v * EPV;
    qf[((q * H + j / 4) * nvec + v) * 4 + (j & 3)] = cvt<S>::to(qsrc[i]);
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, end = b.r0 + b.nr;
  const S *mat = static_cast<const S *>(t.mat);
  for (int r0 = b.r0 + warp * ROWS; r0 < end; r0 += WARPS * ROWS) {
    const uint4 *row[ROWS];
    bool ok[ROWS];
    float acc[ROWS][QB];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
      ok[r] = r0 + r < end;
      row[r] = reinterpret_cast<const uint4 *>(mat + (int64_t)(ok[r] ? r0 + r : r0) * a.ld);
#pragma unroll
      for (int q = 0; q < QB; q++) acc[r][q] = 0.0f;
    }
    int v = lane;
    for (; v + 32 < nvec; v += 64) { /* two vectors of each row in flight */
      uint4 w0[ROWS], w1[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; r++) {
        w0[r] = ok[r] ? __ldg(row[r] + v) : make_uint4(0u, 0u, 0u, 0u);
        w1[r] = ok[r] ? __ldg(row[r] + v + 32) : make_uint4(0u, 0u, 0u, 0u);
      }
      accumulate<S, QB>(acc, w0, qs, nvec, v, qn);
      accumulate<S, QB>(acc, w1, qs, nvec, v + 32, qn);
    }
    if (v < nvec) {
      uint4 w0[ROWS];
#pragma unroll
      for (int r = 0; r < ROWS; r++) w0[r] = ok[r] ? __ldg(row[r] + v) : make_uint4(0u, 0u, 0u, 0u);
      accumulate<S, QB>(acc, w0, qs, nvec, v, qn);
    }
#pragma unroll
    for (int r = 0; r < ROWS; r++)
#pragma unroll
      for (int q = 0; q < QB; q++) {
        float s = acc[r][q];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0 && ok[r] && q < qn) a.scores[t.off + (int64_t)q * t.sld + r0 + r] = s;
      }
  }
}

/* ---------------------------------------------------------------- selection */

/* The order of results: higher score first, then smaller id. */
__device__ inline bool better(float as, u64 ai, float bs, u64 bi) { return as > bs || (as == bs && ai < bi); }

/* Sorts the first m pairs best first (m <= SEL_N; pairs from m on are
 * sentinels), keeps the best k, and sets the threshold to the k-th. */
template <bool R>
__device__ void sort_trim(float *ss, u64 *si, u32 *sr, int m, int k, int *ncand, int *have_thr, float *thr_s,
                          u64 *thr_i) {
  int M = 2;
  while (M < m) M <<= 1;
  for (int size = 2; size <= M; size <<= 1)
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int p = threadIdx.x; p < M / 2; p += THREADS) {
        const int i = 2 * p - (p & (stride - 1)), j = i + stride;
        const float as = ss[i], bs = ss[j];
        const u64 ai = si[i], bi = si[j];
        const bool swap = (i & size) == 0 ? better(bs, bi, as, ai) : better(as, ai, bs, bi);
        if (swap) {
          ss[i] = bs, ss[j] = as;
          si[i] = bi, si[j] = ai;
          if constexpr (R) {
            const u32 t = sr[i];
            sr[i] = sr[j], sr[j] = t;
          }
        }
      }
      __syncthreads();
    }
  for (int i = k + threadIdx.x; i < M; i += THREADS) {
    ss[i] = -INFINITY;
    si[i] = ~0ull;
    if constexpr (R) sr[i] = ~0u;
  }
  if (threadIdx.x == 0) {
    *ncand = 0;
    *thr_s = ss[k - 1];
    *thr_i = si[k - 1];
    *have_thr = !(ss[k - 1] == -INFINITY && si[k - 1] == ~0ull);
  }
  __syncthreads();
}

/* Input idx of a selection: its score (NaN as -infinity) and, when asked, its id. */
__device__ inline float sel_score(const kvi__search_args &a, const kvi__sel &sel, int64_t idx) {
  float s;
  if (sel.ids) s = __ldg(a.scores + sel.a + idx);
  else s = __ldg(a.ps + (idx < sel.na ? sel.a + idx : sel.b + (idx - sel.na)));
  return s != s ? -INFINITY : s;
}
__device__ inline u64 sel_id(const kvi__search_args &a, const kvi__sel &sel, int64_t idx) {
  if (sel.ids) return __ldg(reinterpret_cast<const unsigned long long *>(sel.ids) + idx);
  return __ldg(reinterpret_cast<const unsigned long long *>(a.pi) + (idx < sel.na ? sel.a + idx : sel.b + (idx - sel.na)));
}
__device__ inline u32 sel_row(const kvi__search_args &a, const kvi__sel &sel, int64_t idx) {
  if (sel.ids) return (u32)sel.row0 + (u32)idx;
  return __ldg(a.pr + (idx < sel.na ? sel.a + idx : sel.b + (idx - sel.na)));
}

/* A selection's best n (sorted, at the front of the buffer): as pairs at
 * dst, or, for a query's final selection, as its results (kvi__emit's
 * job: count, ids, scores and rows, sentinels past n, nothing for a query
 * found invalid). */
template <bool R>
__device__ void put_results(const kvi__search_args &a, const kvi__sel &sel, const float *ss, const u64 *si,
                            const u32 *sr, int n) {
  if (sel.out < 0) {
    for (int i = threadIdx.x; i < n; i += THREADS) {
      a.ps[sel.dst + i] = ss[i];
      a.pi[sel.dst + i] = si[i];
      if constexpr (R) a.pr[sel.dst + i] = sr[i];
    }
    return;
  }
  if (!a.valid[sel.dst / a.k]) n = 0;
  const int64_t o = (int64_t)sel.out * a.k;
  for (int j = threadIdx.x; j < a.k; j += THREADS) {
    a.out_ids[o + j] = j < n ? si[j] : ~0ull;
    a.out_scores[o + j] = j < n ? ss[j] : -INFINITY;
    if constexpr (R)
      if (a.out_rows) a.out_rows[o + j] = j < n ? (int32_t)sr[j] : -1;
  }
  if (threadIdx.x == 0) a.out_counts[sel.out] = n;
}

/* Histogram bin of a finite score: monotone non-decreasing in s. */
__device__ inline int bin_of(float s, float lo, float scale) {
  const float f = (s - lo) * scale;
  if (!(f > 0.0f)) return 0; /* also NaN, from an overflowing range */
  return f >= (float)(SEL_BINS - 1) ? SEL_BINS - 1 : (int)f;
}

/* The selection buffer emptied: every pair a sentinel. */
template <bool R> __device__ __forceinline__ void sel_clear(float *ss, u64 *si, u32 *sr) {
  for (int i = threadIdx.x; i < SEL_N; i += THREADS) {
    ss[i] = -INFINITY;
    si[i] = ~0ull;
    if constexpr (R) sr[i] = ~0u;
  }
}

/* The fast path's sample of a run of `total` inputs: w = 1 << lw inputs in
 * every w * step, nsamp sample slots (some past the end). */
struct sample {
  int64_t step, w, nsamp;
  int lw;
};

/* w inputs in every w * STEP when that gives at least 8k inputs and about
 * k * STEP gathered inputs fit the buffer twice over, else all inputs. A
 * long run is sampled in whole 128-byte lines (w = 32), so the sampled
 * passes read 1/STEP of its bytes; a short one (up to 32 KiB) in single
 * inputs (w = 1): the sample then touches every line, and pass 3 finds the
 * run in L1 (sampling whole lines was slower for short runs and faster for
 * long ones; BENCHMARKS.md, retrieval). */
__device__ __forceinline__ sample sample_of(int64_t total, int k) {
  sample sp;
  sp.step = total / STEP >= 8 * k && 2 * STEP * k <= SEL_N ? STEP : 1;
  sp.lw = total > 8192 ? 5 : 0; /* log2 w */
  sp.w = 1 << sp.lw;
  sp.nsamp = (total + sp.w * sp.step - 1) / (sp.w * sp.step) * sp.w;
  return sp;
}

/* The ILP sample inputs of this thread at slot base + u * THREADS (NaN as
 * -infinity, slots past the end as -infinity): ILP independent loads in
 * flight, the loop is latency-bound otherwise. */
__device__ __forceinline__ void sample_load(const kvi__search_args &a, const kvi__sel &sel, const sample &sp,
                                            int64_t total, int64_t base, float (&v)[ILP]) {
#pragma unroll
  for (int u = 0; u < ILP; u++) {
    const int64_t sm = base + (int64_t)u * THREADS, idx = (sm >> sp.lw << sp.lw) * sp.step + (sm & (sp.w - 1));
    v[u] = sm < sp.nsamp && idx < total ? sel_score(a, sel, idx) : -INFINITY;
  }
}

/* Pass 1: the sample's range above -infinity, [*lo, *hi] in every thread. */
__device__ __forceinline__ void sample_range(const kvi__search_args &a, const kvi__sel &sel, const sample &sp,
                                             int64_t total, float *red_lo, float *red_hi, float *out_lo,
                                             float *out_hi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t base = threadIdx.x; base < sp.nsamp; base += THREADS * ILP) {
    float v[ILP];
    sample_load(a, sel, sp, total, base, v);
#pragma unroll
    for (int u = 0; u < ILP; u++)
      if (v[u] > -INFINITY) lo = fminf(lo, v[u]), hi = fmaxf(hi, v[u]);
  }
  for (int o = 16; o > 0; o >>= 1) {
    lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
    hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
  }
  if (lane == 0) red_lo[warp] = lo, red_hi[warp] = hi;
  __syncthreads();
  lo = red_lo[0], hi = red_hi[0];
  for (int w = 1; w < WARPS; w++) lo = fminf(lo, red_lo[w]), hi = fmaxf(hi, red_hi[w]);
  *out_lo = lo, *out_hi = hi;
}

/* Pass 2: the sample's histogram over [lo, ...) in bins of 1 / scale.
 * Returns (in every thread) whether the sample holds a +infinity, which
 * ends the fast path. */
__device__ __forceinline__ bool sample_histogram(const kvi__search_args &a, const kvi__sel &sel, const sample &sp,
                                                 int64_t total, float lo, float scale, int *hist) {
  bool inf = false;
  for (int64_t base = threadIdx.x; base < sp.nsamp; base += THREADS * ILP) {
    float v[ILP];
    sample_load(a, sel, sp, total, base, v);
#pragma unroll
    for (int u = 0; u < ILP; u++) {
      if (isfinite(v[u])) atomicAdd(&hist[bin_of(v[u], lo, scale)], 1);
      else inf |= v[u] > 0.0f;
    }
  }
  return __syncthreads_or(inf);
}

/* Warp 0: the highest bin whose bins up hold k sampled inputs, into *cut
 * (left -1 when, every input sampled, those bins hold more than the buffer). */
__device__ __forceinline__ void find_cut(const int *hist, int k, int64_t step, int *cut) {
  const int lane = threadIdx.x & 31;
  constexpr int PER = SEL_BINS / 32; /* lane l sums bins [l * PER, l * PER + PER); the cut from the top */
  int mine = 0;
  for (int j = 0; j < PER; j++) mine += hist[lane * PER + j];
  int above = 0; /* sampled inputs in the bins of lanes > lane */
  for (int l = 31; l > 0; l--) {
    const int v = __shfl_sync(0xffffffffu, mine, l);
    if (l > lane) above += v;
  }
  if (above < k && above + mine >= k) { /* the lane whose bins hold the k-th */
    int c = above, j = PER - 1;
    for (; j >= 0; j--) {
      c += hist[lane * PER + j];
      if (c >= k) break;
    }
    /* with every input sampled, c inputs are gathered: skip a gather that cannot fit */
    *cut = step == 1 && c > SEL_N ? -1 : lane * PER + j;
  }
}

/* Pass 3: gathers every input of bins >= b into (ss, si as the input
 * index), counting past the buffer in *ncand. Returns (in every thread)
 * whether the run holds a +infinity. */
__device__ __forceinline__ bool gather(const kvi__search_args &a, const kvi__sel &sel, int64_t total, float lo,
                                       float scale, int b, float *ss, u64 *si, int *ncand) {
  bool inf3 = false;
  auto take = [&](float s, int64_t idx) {
    if (isfinite(s)) {
      if (bin_of(s, lo, scale) >= b) {
        const int pos = atomicAdd(ncand, 1);
        if (pos < SEL_N) { /* the input index for now: ids and rows are loaded below, all at once */
          ss[pos] = s;
          si[pos] = (u64)idx;
        }
      }
    } else {
      inf3 |= s > 0.0f; /* NaN counts as -infinity, as sel_score has it */
    }
  };
  int64_t done = 0;
  if (sel.ids && (sel.a & 3) == 0) { /* stage 1: contiguous, 16-byte aligned scores, 4 a load */
    const float4 *v4 = reinterpret_cast<const float4 *>(a.scores + sel.a);
    const int64_t n4 = total >> 2;
    for (int64_t base = threadIdx.x; base < n4; base += THREADS * ILP4) {
      float4 v[ILP4];
#pragma unroll
      for (int u = 0; u < ILP4; u++) {
        const int64_t i4 = base + (int64_t)u * THREADS;
        v[u] = i4 < n4 ? __ldg(v4 + i4) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      }
#pragma unroll
      for (int u = 0; u < ILP4; u++) {
        const int64_t idx = (base + (int64_t)u * THREADS) * 4;
        take(v[u].x, idx);
        take(v[u].y, idx + 1);
        take(v[u].z, idx + 2);
        take(v[u].w, idx + 3);
      }
    }
    done = n4 * 4;
  }
  for (int64_t base = done + threadIdx.x; base < total; base += THREADS * ILP) {
    float v[ILP];
#pragma unroll
    for (int u = 0; u < ILP; u++) {
      const int64_t idx = base + (int64_t)u * THREADS;
      v[u] = idx < total ? sel_score(a, sel, idx) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < ILP; u++) take(v[u], base + (int64_t)u * THREADS);
  }
  return __syncthreads_or(inf3);
}

/* The ids (and rows) of the m gathered inputs in place of their indexes, ILP
 * loads in flight per thread. Loading them inside the gather made a warp
 * wait for one dependent load per input it took, which dominated the
 * selection of a 10,000-fact tenant. */
template <bool R>
__device__ __forceinline__ void load_ids(const kvi__search_args &a, const kvi__sel &sel, int m, u64 *si, u32 *sr) {
  for (int base = threadIdx.x; base < m; base += THREADS * ILP) {
    u64 id[ILP];
    u32 row[ILP];
#pragma unroll
    for (int u = 0; u < ILP; u++) {
      const int i = base + u * THREADS;
      if (i < m) {
        id[u] = sel_id(a, sel, (int64_t)si[i]);
        if constexpr (R) row[u] = sel_row(a, sel, (int64_t)si[i]);
      }
    }
#pragma unroll
    for (int u = 0; u < ILP; u++) {
      const int i = base + u * THREADS;
      if (i < m) {
        si[i] = id[u];
        if constexpr (R) sr[i] = row[u];
      }
    }
  }
  __syncthreads();
}

/* A selection's shared state (select_kernel's __shared__ arrays). */
template <bool R> struct sel_shared {
  float *ss;
  u64 *si;
  u32 *sr;
  int *hist, *ncand, *have_thr, *cut;
  float *thr_s, *red_lo, *red_hi;
  u64 *thr_i;
};

/* The fast path (select_kernel): passes 1 to 3 and the sort of the
 * gathered inputs. Returns (uniformly) true when it wrote the results;
 * false leaves the buffer empty for the general path. */
template <bool R>
__device__ __forceinline__ bool select_fast(const kvi__search_args &a, const kvi__sel &sel, int64_t total, int k,
                                            const sel_shared<R> &sh) {
  const sample sp = sample_of(total, k);
  float lo, hi;
  sample_range(a, sel, sp, total, sh.red_lo, sh.red_hi, &lo, &hi);
  if (!(total > k && isfinite(lo) && isfinite(hi) && hi > lo)) return false; /* uniform */
  const float scale = (float)SEL_BINS / (hi - lo); /* 0 if the range overflows: one bin */
  if (sample_histogram(a, sel, sp, total, lo, scale, sh.hist)) return false; /* uniform */
  if (threadIdx.x >> 5 == 0) find_cut(sh.hist, k, sp.step, sh.cut);
  __syncthreads();
  if (*sh.cut < 0) return false; /* uniform */
  const bool inf3 = gather(a, sel, total, lo, scale, *sh.cut, sh.ss, sh.si, sh.ncand);
  const int m = *sh.ncand;
  if (!inf3 && m <= SEL_N) { /* uniform */
    load_ids<R>(a, sel, m, sh.si, sh.sr);
    sort_trim<R>(sh.ss, sh.si, sh.sr, m, k, sh.ncand, sh.have_thr, sh.thr_s, sh.thr_i);
    put_results<R>(a, sel, sh.ss, sh.si, sh.sr, total < k ? (int)total : k);
    return true;
  }
  /* too many (or a +infinity outside the sample): start over on the general path */
  __syncthreads(); /* everyone has read ncand */
  sel_clear<R>(sh.ss, sh.si, sh.sr);
  if (threadIdx.x == 0) *sh.ncand = 0;
  __syncthreads();
  return false;
}

/* The general path (select_kernel): rounds of SEL_R inputs, each adding
 * those better than the running k-th to the buffer, sorted and trimmed when
 * the next round might not fit; then the results. */
template <bool R>
__device__ __forceinline__ void select_general(const kvi__search_args &a, const kvi__sel &sel, int64_t total, int k,
                                               const sel_shared<R> &sh) {
  for (int64_t base = 0; base < total; base += SEL_R) {
    const bool ht = *sh.have_thr;
    const float ts = *sh.thr_s;
    const u64 ti = *sh.thr_i;
#pragma unroll
    for (int j = 0; j < SEL_R / THREADS; j++) {
      const int64_t idx = base + j * THREADS + threadIdx.x;
      if (idx >= total) continue;
      const float s = sel_score(a, sel, idx);
      if (sel.ids && ht && s < ts) continue;
      const u64 id = sel_id(a, sel, idx);
      if (!ht || better(s, id, ts, ti)) {
        const int pos = k + atomicAdd(sh.ncand, 1);
        sh.ss[pos] = s;
        sh.si[pos] = id;
        if constexpr (R) sh.sr[pos] = sel_row(a, sel, idx);
      }
    }
    __syncthreads();
    const int nc = *sh.ncand;
    __syncthreads(); /* every thread has read ncand before the next round changes it */
    if (nc > SEL_N - k - SEL_R) sort_trim<R>(sh.ss, sh.si, sh.sr, k + nc, k, sh.ncand, sh.have_thr, sh.thr_s, sh.thr_i);
  }
  if (*sh.ncand > 0) sort_trim<R>(sh.ss, sh.si, sh.sr, k + *sh.ncand, k, sh.ncand, sh.have_thr, sh.thr_s, sh.thr_i);
  put_results<R>(a, sel, sh.ss, sh.si, sh.sr, total < k ? (int)total : k);
}

/* One CTA per kvi__sel.
 *
 * Fast path (finite scores spread over a range, as real similarities are):
 * a sample of the inputs (one in STEP of a long run, in whole lines when
 * it is longer than 32 KiB; else all of them) gives a range and a histogram of SEL_BINS equal bins over it (inputs
 * outside it fall in the end bins), and the highest bin b such that the
 * sample's bins >= b hold at least k inputs. Bins are monotone in the score
 * and the sample is part of the run, so an input in a bin below b has k
 * inputs strictly better and is not in the top k: the inputs of bins >= b
 * (about k * STEP) are gathered and sorted. One full read of the run, and
 * a small sort, whatever its length.
 *
 * General path (fewer than k sampled inputs above -infinity, any +infinity,
 * a sample all equal, or more than SEL_N inputs gathered): the
 * running-threshold loop, exact for any input.
 *
 * The steps are __forceinline__ helpers, so the kernel stays one body (the
 * same registers, no stack, the shared arrays reached as shared memory):
 * keep them so, a called step would pass its state through local memory. */
template <bool R> __global__ void __launch_bounds__(THREADS) select_kernel(const kvi__search_args a) {
  __shared__ float ss[SEL_N];
  __shared__ u64 si[SEL_N];
  __shared__ u32 sr[R ? SEL_N : 1]; /* R: each pair's tenant row */
  __shared__ int hist[SEL_BINS];
  __shared__ int ncand, have_thr, cut;
  __shared__ float thr_s, red_lo[WARPS], red_hi[WARPS];
  __shared__ u64 thr_i;
  const sel_shared<R> sh = {ss, si, sr, hist, &ncand, &have_thr, &cut, &thr_s, red_lo, red_hi, &thr_i};
  const kvi__sel sel = a.sels[blockIdx.x];
  const int k = a.k;
  const int64_t total = (int64_t)sel.na + sel.nb;
  sel_clear<R>(ss, si, sr);
  for (int i = threadIdx.x; i < SEL_BINS; i += THREADS) hist[i] = 0;
  if (threadIdx.x == 0) ncand = 0, have_thr = 0, cut = -1;
  if (select_fast<R>(a, sel, total, k, sh)) return;
  select_general<R>(a, sel, total, k, sh);
}

/* ---------------------------------------------------------------- emit */

__global__ void __launch_bounds__(THREADS) emit_kernel(const kvi__search_args a) {
  const kvi__emit e = a.emits[blockIdx.x];
  const int n = a.valid[e.slot] ? e.n : 0;
  uint64_t *ids = a.out_ids + (int64_t)e.out * a.k;
  float *scores = a.out_scores + (int64_t)e.out * a.k;
  for (int j = threadIdx.x; j < a.k; j += THREADS) {
    ids[j] = j < n ? a.pi[e.src + j] : ~0ull;
    scores[j] = j < n ? a.ps[e.src + j] : -INFINITY;
    if (a.out_rows) a.out_rows[(int64_t)e.out * a.k + j] = j < n ? (int32_t)a.pr[e.src + j] : -1;
  }
  if (threadIdx.x == 0) a.out_counts[e.out] = n;
}

/* ---------------------------------------------------------------- launches */

template <typename R, typename S> int prep2(const kvi__search_args *a, cudaStream_t s) {
  prep_kernel<R, S><<<(unsigned)a->nq, THREADS, 0, s>>>(*a);
  return (int)cudaGetLastError();
}

template <typename R> int prep1(const kvi__search_args *a, cudaStream_t s) {
  switch (a->dtype) {
  case KVI_DTYPE_FP32: return prep2<R, float>(a, s);
  case KVI_DTYPE_FP16: return prep2<R, __half>(a, s);
  case KVI_DTYPE_BF16: return prep2<R, __nv_bfloat16>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}

template <typename S, int QB> int scan2(const kvi__search_args *a, cudaStream_t s) {
  const size_t smem = (size_t)a->qmax * a->ld * sizeof(float); /* <= KVI__SCAN_SMEM, checked by the planner */
  scan_kernel<S, QB><<<(unsigned)a->nblocks, THREADS, smem, s>>>(*a);
  return (int)cudaGetLastError();
}

template <typename S> int scan1(const kvi__search_args *a, cudaStream_t s) {
  if (a->qmax <= 1) return scan2<S, 1>(a, s);
  if (a->qmax <= 2) return scan2<S, 2>(a, s);
  if (a->qmax <= 4) return scan2<S, 4>(a, s);
  return scan2<S, KVI__SCAN_MAX_Q>(a, s);
}

} // namespace

extern "C" int kvi__cuda_search_prep(const kvi__search_args *a, struct CUstream_st *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  switch (a->raw_dtype) {
  case KVI_DTYPE_FP32: return prep1<float>(a, s);
  case KVI_DTYPE_FP16: return prep1<__half>(a, s);
  case KVI_DTYPE_BF16: return prep1<__nv_bfloat16>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}

extern "C" int kvi__cuda_search_scan(const kvi__search_args *a, struct CUstream_st *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (a->qmax < 1 || a->qmax > KVI__SCAN_MAX_Q || (size_t)a->qmax * a->ld * sizeof(float) > KVI__SCAN_SMEM)
    return (int)cudaErrorInvalidValue;
  switch (a->dtype) {
  case KVI_DTYPE_FP32: return scan1<float>(a, s);
  case KVI_DTYPE_FP16: return scan1<__half>(a, s);
  case KVI_DTYPE_BF16: return scan1<__nv_bfloat16>(a, s);
  }
  return (int)cudaErrorInvalidValue;
}

extern "C" int kvi__cuda_search_select(const kvi__search_args *a, struct CUstream_st *stream) {
  if (a->k < 1 || a->k > KVI_SEARCH_MAX_K) return (int)cudaErrorInvalidValue;
  if (a->pr)
    select_kernel<true><<<(unsigned)a->nsels, THREADS, 0, (cudaStream_t)stream>>>(*a);
  else
    select_kernel<false><<<(unsigned)a->nsels, THREADS, 0, (cudaStream_t)stream>>>(*a);
  return (int)cudaGetLastError();
}

extern "C" int kvi__cuda_search_emit(const kvi__search_args *a, struct CUstream_st *stream) {
  emit_kernel<<<(unsigned)a->nemits, THREADS, 0, (cudaStream_t)stream>>>(*a);
  return (int)cudaGetLastError();
}
