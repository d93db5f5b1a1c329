/*
 * The device planner: one launch turns each request's tenant rows (a
 * search's results, or device fact ids looked up here) into the segments of
 * one injection launch (transfer_kernels.cu), without the host seeing the
 * rows. kernels.h (kvi__rplan_args) states the contract.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <limits.h>
#include <stdint.h>

#include "gpu/kernels.h"
#include "kvinject/search.h"

namespace {

constexpr int RP_THREADS = 256;
/* A request's ids are looked up RP_THREADS at a time through a hash table of
 * twice as many slots (linear probing, at most half full). */
constexpr unsigned RP_SLOTS = 2 * RP_THREADS;
constexpr unsigned long long EMPTY = KVI_SEARCH_NO_ID;
/* Rows a thread loads before it probes them: loads in flight per thread. */
constexpr int RP_UNROLL = 4;

/* A pointer into the launch's blob is read from the parameters: the copy to
 * blob_dst is not ordered before other CTAs' reads. */
template <typename T> __device__ const T *from_blob(const kvi__rplan_args &a, const T *p) {
  const char *c = reinterpret_cast<const char *>(p);
  if (a.blob_bytes > 0 && c >= a.blob_dst && c < a.blob_dst + a.blob_bytes)
    return reinterpret_cast<const T *>(reinterpret_cast<const char *>(a.blob) + (c - a.blob_dst));
  return p;
}

__device__ unsigned slot_of(unsigned long long id) {
  return (unsigned)((id * 0x9E3779B97F4A7C15ull) >> 55) & (RP_SLOTS - 1); /* the top 9 bits */
}

/* rows[f] for each of the request's ids (kvi__rplan_args: look). The
 * tenant's ids are read once per RP_THREADS of the request's ids, every
 * thread its own rows, RP_UNROLL loads at a time; a match keeps the lowest
 * row (a tenant holds an id once). All threads of the CTA call it. */
__device__ void lookup(const kvi__rplan_args &a, const kvi__idreq &lq, int32_t *rows) {
  __shared__ unsigned long long key[RP_SLOTS];
  __shared__ int32_t val[RP_SLOTS];
  __shared__ int32_t best[RP_THREADS];
  const int tid = (int)threadIdx.x;
  for (int c0 = 0; c0 < lq.nf; c0 += RP_THREADS) {
    const int nc = min(RP_THREADS, lq.nf - c0);
    for (unsigned i = threadIdx.x; i < RP_SLOTS; i += RP_THREADS) key[i] = EMPTY;
    best[tid] = INT_MAX;
    __syncthreads();
    unsigned long long mine = EMPTY;
    if (tid < nc) {
      mine = a.fact_ids[lq.f0 + c0 + tid];
      if (mine != EMPTY && lq.ids)
        for (unsigned s = slot_of(mine);; s = (s + 1) & (RP_SLOTS - 1))
          if (atomicCAS(&key[s], EMPTY, mine) == EMPTY) {
            val[s] = tid;
            break;
          }
    }
    __syncthreads();
    for (int32_t r0 = 0; r0 < lq.nrows; r0 += RP_UNROLL * RP_THREADS) {
      unsigned long long id[RP_UNROLL];
#pragma unroll
      for (int u = 0; u < RP_UNROLL; u++) {
        const int32_t r = r0 + u * RP_THREADS + tid;
        id[u] = r < lq.nrows ? lq.ids[r] : EMPTY;
      }
#pragma unroll
      for (int u = 0; u < RP_UNROLL; u++)
        if (id[u] != EMPTY)
          for (unsigned s = slot_of(id[u]); key[s] != EMPTY; s = (s + 1) & (RP_SLOTS - 1))
            if (key[s] == id[u]) atomicMin(&best[val[s]], r0 + u * RP_THREADS + tid);
    }
    __syncthreads();
    if (tid < nc) {
      const int32_t row = best[tid] == INT_MAX ? -1 : best[tid];
      rows[c0 + tid] = row;
      if (row < 0 && mine != EMPTY) atomicAdd(a.skipped, 1ull);
    }
    __syncthreads(); /* the table is emptied for the next ids; the rows are seen by the whole CTA */
  }
}

/* One CTA per query. Thread j places the query's j-th fact in injection
 * order; a block-wide scan gives its first token. */
__global__ void __launch_bounds__(RP_THREADS) rplan_kernel(const __grid_constant__ kvi__rplan_args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  /* the injection launched after this one (kvi__xfer_args.pdl) may start; it waits for this grid's end */
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  __shared__ int64_t part[RP_THREADS];
  __shared__ int64_t total;
  if (a.blob_bytes > 0) { /* the plan's host-built part, where the injection reads it */
    uint64_t *dst = reinterpret_cast<uint64_t *>(a.blob_dst);
    for (int i = (int)(blockIdx.x * RP_THREADS + threadIdx.x); i < a.blob_bytes / 8; i += (int)(gridDim.x * RP_THREADS))
      dst[i] = a.blob[i];
  }
  const kvi__rquery q = *from_blob(a, a.queries + blockIdx.x);
  int32_t *my_rows = a.rows + (int64_t)blockIdx.x * a.k;
  int n;
  if (a.look) {
    const kvi__idreq lq = *from_blob(a, a.look + blockIdx.x);
    lookup(a, lq, my_rows);
    n = q.dir ? min(lq.nf, q.nres) : 0;
  } else {
    n = q.dir ? min(a.counts[blockIdx.x], q.nres) : 0;
  }
  kvi__xseg *segs = a.segs + q.seg0;
  /* each thread takes nres / RP_THREADS consecutive facts (in injection order) */
  const int per = (q.nres + RP_THREADS - 1) / RP_THREADS, f0 = (int)threadIdx.x * per;
  int64_t mine = 0;
  for (int f = f0; f < f0 + per && f < n; f++) {
    const int rank = q.best_last ? n - 1 - f : f;
    const int32_t row = my_rows[rank];
    mine += row >= 0 ? (int64_t)q.dir[(int64_t)row * q.stride] : 0;
  }
  part[threadIdx.x] = mine;
  __syncthreads();
  for (int o = 1; o < RP_THREADS; o <<= 1) { /* inclusive scan */
    const int64_t v = threadIdx.x >= (unsigned)o ? part[threadIdx.x - o] : 0;
    __syncthreads();
    part[threadIdx.x] += v;
    __syncthreads();
  }
  if (threadIdx.x == RP_THREADS - 1) total = part[RP_THREADS - 1];
  __syncthreads();
  const bool fits = total <= q.cap;
  int64_t t0 = part[threadIdx.x] - mine; /* tokens before this thread's first fact */
  for (int f = f0; f < f0 + per && f < q.nres; f++) {
    kvi__xseg *fs = segs + (int64_t)f * q.spf;
    int s = 0;
    if (fits && f < n) {
      const int rank = q.best_last ? n - 1 - f : f;
      const int32_t row = my_rows[rank];
      const uint32_t *d = q.dir + (int64_t)row * q.stride;
      const int32_t tokens = row >= 0 ? (int32_t)d[0] : 0;
      for (int32_t t = 0; t < tokens && s < q.spf;) {
        const int32_t in_page = t % a.P;
        int32_t m = tokens - t;
        if (m > a.P - in_page) m = a.P - in_page;
        if (m > a.seg_tokens) m = a.seg_tokens;
        kvi__xseg g;
        g.seq0 = q.first_slot + t0 + t;
        g.page = d[1 + t / a.P];
        g.req = (int32_t)blockIdx.x;
        g.pos0 = q.start_position + (int32_t)(t0 + t);
        g.tok0 = (uint16_t)in_page;
        g.ntok = (uint16_t)m;
        g.explicit_pos = 0;
        fs[s++] = g;
        t += m;
      }
      t0 += tokens;
    }
    for (; s < q.spf; s++) { /* unused: the injection kernel skips them */
      kvi__xseg g = {};
      fs[s] = g;
    }
  }
  if (threadIdx.x == 0) {
    a.out_counts[blockIdx.x] = fits ? n : 0;
    a.out_tokens[blockIdx.x] = fits ? (int32_t)total : 0;
    if (!fits) atomicAdd(a.skipped, (unsigned long long)total);
  }
}

} // namespace

extern "C" int kvi__cuda_retrieve_plan(const kvi__rplan_args *a, struct CUstream_st *stream) {
  if (a->nq == 0) return 0;
  rplan_kernel<<<(unsigned)a->nq, RP_THREADS, 0, (cudaStream_t)stream>>>(*a);
  return (int)cudaGetLastError();
}
