/*
 * Tensor-parallel stores: sharded retrieval. A store whose embeddings are
 * sharded searches every rank's rows: each rank searches its own, the
 * ranks all-gather their candidates and merge them (on the host, or with
 * cuda/shard_kernels.cu's kernel for NCCL).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "search/search.h"
#include "tp/internal.h"

/* A rank's block: header, then its nq x k ids, scores and nq counts. */
static size_t block_bytes(int32_t nq, int32_t k) {
  const size_t n = (size_t)nq * (size_t)k;
  const size_t b = sizeof(kvi__shard_hdr) + n * 8 + n * 4 + (size_t)nq * 4;
  return (b + 15) / 16 * 16;
}

static uint64_t query_digest(const uint64_t *tenants, int32_t nq, int32_t k) {
  uint64_t h = kvi__shard_fnv(0xcbf29ce484222325ull, &k, sizeof k);
  h = kvi__shard_fnv(h, &nq, sizeof nq);
  return kvi__shard_fnv(h, tenants, (size_t)nq * sizeof *tenants);
}

/* The CPU merge (the reference for the kernel): candidate j of rank r lands
 * at j plus the number of candidates of every other rank that rank before it
 * (score descending, NaN as -infinity, then id ascending; ids are distinct
 * across ranks, as each fact's embedding is on one rank). */
static float key(float s) { return isnan(s) ? -INFINITY : s; }

static bool before(float sa, uint64_t ia, float sb, uint64_t ib) {
  sa = key(sa);
  sb = key(sb);
  return sa > sb || (sa == sb && ia < ib);
}

static void merge_host(const char *blocks, size_t bb, int32_t size, int32_t nq, int32_t k, uint64_t *out_ids,
                       float *out_scores, int32_t *out_counts) {
  const size_t n = (size_t)nq * (size_t)k;
  for (int32_t q = 0; q < nq; q++) {
    int64_t total = 0;
    for (int32_t j = 0; j < k; j++) {
      out_ids[(size_t)q * k + j] = KVI_SEARCH_NO_ID;
      out_scores[(size_t)q * k + j] = -INFINITY;
    }
    for (int32_t r = 0; r < size; r++) {
      const char *b = blocks + (size_t)r * bb + sizeof(kvi__shard_hdr);
      const uint64_t *ids = (const uint64_t *)b + (size_t)q * k;
      const float *sc = (const float *)(b + n * 8) + (size_t)q * k;
      const int32_t cnt = ((const int32_t *)(b + n * 12))[q];
      total += cnt;
      for (int32_t j = 0; j < cnt; j++) {
        int64_t pos = j;
        for (int32_t o = 0; o < size; o++) {
          if (o == r) continue;
          const char *ob = blocks + (size_t)o * bb + sizeof(kvi__shard_hdr);
          const uint64_t *oid = (const uint64_t *)ob + (size_t)q * k;
          const float *osc = (const float *)(ob + n * 8) + (size_t)q * k;
          int32_t lo = 0, hi = ((const int32_t *)(ob + n * 12))[q];
          while (lo < hi) { /* candidates of o that rank before (sc[j], ids[j]) */
            const int32_t mid = (lo + hi) / 2;
            if (before(osc[mid], oid[mid], sc[j], ids[j])) lo = mid + 1;
            else hi = mid;
          }
          pos += lo;
        }
        if (pos < k) {
          out_ids[(size_t)q * k + pos] = ids[j];
          out_scores[(size_t)q * k + pos] = sc[j];
        }
      }
    }
    out_counts[q] = total < k ? (int32_t)total : k;
  }
}

/* The collective search of a store with sharded embeddings, registered on
 * the store as its search.collective (locked: as kvi__search_local). */
kvi_status kvi__shard_search(kvi_store *s, const void *queries, kvi_dtype qt, kvi_memory qm, int32_t nq,
                             const uint64_t *tenants, int32_t k, uint64_t *out_ids, float *out_scores,
                             int32_t *out_counts, kvi_memory om, uint64_t ws, bool locked,
                             struct CUstream_st *stream, const char *fn) {
  kvi_comm *c = s->shard.comm;
  const size_t bb = block_bytes(nq, k), n = (size_t)nq * (size_t)k;
  const kvi__shard_hdr hdr0 = {0, nq, k, 0, query_digest(tenants, nq, k)};
  kvi_status st = KVI_OK;
  if (c->memory == KVI_MEMORY_HOST) { /* the in-process transport: all on the host */
    char *mine = malloc(bb), *all = malloc(bb * (size_t)c->size);
    if (!mine || !all) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", bb * (size_t)c->size);
    if (st == KVI_OK)
      st = kvi__search_local(s, queries, qt, qm, nq, tenants, k, (uint64_t *)(mine + sizeof hdr0),
                             (float *)(mine + sizeof hdr0 + n * 8), (int32_t *)(mine + sizeof hdr0 + n * 12),
                             KVI_MEMORY_HOST, ws, locked, stream, fn);
    kvi__shard_hdr hdr = hdr0;
    hdr.status = (int32_t)st;
    if (mine) memcpy(mine, &hdr, sizeof hdr);
    /* the block size follows from nq and k, which every rank passes alike; without a
     * block, this rank's reads as all ones to the others: a failed status */
    kvi_status sx = kvi__comm_allgather(c, mine, all, bb, stream, fn);
    if (st == KVI_OK) st = sx;
    for (int32_t r = 0; st == KVI_OK && r < c->size; r++) {
      kvi__shard_hdr h;
      memcpy(&h, all + (size_t)r * bb, sizeof h);
      if (h.status != KVI_OK)
        st = kvi__fail(KVI_ERR_PEER, fn, "rank %d failed its part of the search: %s", (int)r,
                       kvi__status_string((kvi_status)h.status));
      else if (h.digest != hdr0.digest || h.nq != nq || h.k != k)
        st = kvi__fail(KVI_ERR_MISMATCH, fn, "rank %d searched other tenants, query count or k than rank %d", (int)r,
                       (int)c->rank);
    }
    if (st == KVI_OK) merge_host(all, bb, c->size, nq, k, out_ids, out_scores, out_counts);
    free(mine);
    free(all);
    return st;
  }

  /* NCCL: local search, all-gather and merge, all enqueued on `stream` */
  char *mine = NULL, *all = NULL, *tmp = NULL;
  const size_t out_bytes = n * 12 + (size_t)nq * 4 + 16;
  st = kvi__cuda_malloc_async((void **)&mine, bb, stream, fn);
  if (st == KVI_OK) st = kvi__cuda_malloc_async((void **)&all, bb * (size_t)c->size, stream, fn);
  if (st == KVI_OK && om == KVI_MEMORY_HOST) st = kvi__cuda_malloc_async((void **)&tmp, out_bytes, stream, fn);
  if (st == KVI_OK)
    st = kvi__search_local(s, queries, qt, qm, nq, tenants, k, (uint64_t *)(mine + sizeof hdr0),
                           (float *)(mine + sizeof hdr0 + n * 8), (int32_t *)(mine + sizeof hdr0 + n * 12),
                           KVI_MEMORY_DEVICE, ws, locked, stream, fn);
  kvi__shard_hdr hdr = hdr0;
  hdr.status = (int32_t)st;
  if (mine) {
    const kvi_status sh = kvi__cuda_h2d(mine, &hdr, sizeof hdr, stream, fn);
    if (st == KVI_OK) st = sh;
    if (sh == KVI_OK && all) { /* join the exchange whenever the block exists */
      const kvi_status sx = kvi__comm_allgather(c, mine, all, bb, stream, fn);
      if (st == KVI_OK) st = sx;
    }
  }
  int32_t flag = 0;
  if (st == KVI_OK) {
    uint64_t *ids = om == KVI_MEMORY_HOST ? (uint64_t *)tmp : out_ids;
    float *sc = om == KVI_MEMORY_HOST ? (float *)(tmp + n * 8) : out_scores;
    int32_t *cnt = om == KVI_MEMORY_HOST ? (int32_t *)(tmp + n * 12) : out_counts;
    const kvi__merge_args a = {all, (int64_t)bb, c->size, nq, k, hdr0.digest, ids, sc, cnt};
#ifdef KVI_HAVE_CUDA
    const int e = kvi__cuda_shard_merge(&a, stream);
#else
    (void)a;
    const int e = 0;
    st = kvi__fail(KVI_ERR_NOT_BUILT, fn, "no CUDA in this build");
#endif
    if (e) st = kvi__cuda_error(e, fn, "the merge kernel");
    if (st == KVI_OK && om == KVI_MEMORY_HOST) {
      st = kvi__cuda_d2h(out_ids, ids, n * 8, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_d2h(out_scores, sc, n * 4, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_d2h(out_counts, cnt, (size_t)nq * 4, stream, fn);
      if (st == KVI_OK) st = kvi__cuda_sync(stream, fn);
      for (int32_t q = 0; st == KVI_OK && q < nq; q++)
        if (out_counts[q] < 0) flag = out_counts[q];
    }
  }
  kvi__cuda_free_async(mine, stream, fn);
  kvi__cuda_free_async(all, stream, fn);
  kvi__cuda_free_async(tmp, stream, fn);
  if (st == KVI_OK && flag) {
    for (int32_t q = 0; q < nq; q++) out_counts[q] = 0;
    st = kvi__fail(flag == -1 ? KVI_ERR_PEER : KVI_ERR_MISMATCH, fn,
                   flag == -1 ? "another rank failed its part of the search"
                              : "the ranks searched other tenants, query counts or k");
  }
  return st;
}
