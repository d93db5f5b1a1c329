/*
 * Tensor-parallel stores: the small helpers, the ranks' statuses combined,
 * buffers in the communicator's memory, row copies and views.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "gpu/kernels.h"
#include "tp/internal.h"

uint64_t kvi__shard_fnv(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* Before a control exchange on an NCCL communicator: the caller's stream
 * has no NCCL work left running, so that two NCCL operations of one
 * communicator never run at once on two streams. */
kvi_status kvi__shard_drain(kvi_comm *c, struct CUstream_st *stream, const char *fn) {
  if (c->memory != KVI_MEMORY_DEVICE) return KVI_OK;
  return kvi__cuda_sync(stream, fn);
}

/* After every rank reported `local`: KVI_OK when all did, else this rank's
 * own error, or KVI_ERR_PEER naming the first rank that failed. `stream`
 * (NCCL) is drained first. */
kvi_status kvi__shard_combine(kvi_comm *c, kvi_status local, struct CUstream_st *stream, const char *fn) {
  const kvi_status sd = kvi__shard_drain(c, stream, fn);
  if (local == KVI_OK) local = sd;
  int32_t *all = malloc((size_t)c->size * sizeof *all);
  const int32_t mine = (int32_t)local;
  if (!all) { /* still take part, or the others wait forever */
    kvi__comm_allgather_host(c, &mine, NULL, sizeof mine, fn);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d statuses", (int)c->size);
  }
  kvi_status st = kvi__comm_allgather_host(c, &mine, all, sizeof mine, fn);
  if (st == KVI_OK && local != KVI_OK) st = local;
  for (int32_t r = 0; st == KVI_OK && r < c->size; r++)
    if (all[r] != KVI_OK)
      st = kvi__fail(KVI_ERR_PEER, fn, "rank %d failed: %s", (int)r, kvi__status_string((kvi_status)all[r]));
  free(all);
  return st == KVI_OK ? KVI_OK : (local != KVI_OK ? local : st);
}

/* Buffers in the communicator's memory. */
kvi_status kvi__shard_buf_alloc(kvi_comm *c, void **p, size_t bytes, struct CUstream_st *stream, const char *fn) {
  *p = NULL;
  if (c->memory == KVI_MEMORY_DEVICE) return kvi__cuda_malloc_async(p, bytes ? bytes : 16, stream, fn);
  *p = malloc(bytes ? bytes : 16);
  return *p ? KVI_OK : kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %zu bytes", bytes);
}

void kvi__shard_buf_free(kvi_comm *c, void *p, struct CUstream_st *stream, const char *fn) {
  if (c->memory == KVI_MEMORY_DEVICE) {
    if (p) kvi__cuda_free_async(p, stream, fn);
  } else {
    free(p);
  }
}

/* Copies L x T x H rows of row_bytes between two strided (bytes) layouts in
 * `memory` (device: enqueued on stream). */
kvi_status kvi__shard_copy_rows(void *dst, const int64_t dst_stride[3], const void *src, const int64_t src_stride[3],
                                int32_t L, int32_t T, int32_t H, int64_t row_bytes, kvi_memory memory,
                                struct CUstream_st *stream, const char *fn) {
#ifdef KVI_HAVE_CUDA
  if (memory == KVI_MEMORY_DEVICE) {
    const kvi__rows_args a = {dst, src, {dst_stride[0], dst_stride[1], dst_stride[2]},
                              {src_stride[0], src_stride[1], src_stride[2]}, L, T, H, row_bytes};
    const int e = kvi__cuda_copy_rows(&a, stream);
    return e ? kvi__cuda_error(e, fn, "the row-copy kernel") : KVI_OK;
  }
#else
  (void)stream;
  if (memory == KVI_MEMORY_DEVICE) return kvi__fail(KVI_ERR_NOT_BUILT, fn, "no CUDA in this build");
#endif
  for (int32_t l = 0; l < L; l++)
    for (int32_t t = 0; t < T; t++)
      for (int32_t h = 0; h < H; h++)
        memcpy((char *)dst + l * dst_stride[0] + t * dst_stride[1] + h * dst_stride[2],
               (const char *)src + l * src_stride[0] + t * src_stride[1] + h * src_stride[2], (size_t)row_bytes);
  return KVI_OK;
}

/* A contiguous [L][T][H][D] view of `elem`-byte elements at base. */
kvi_kv_view kvi__shard_packed_view(kvi_memory m, kvi_dtype t, int32_t L, int32_t T, int32_t H, int32_t D, void *k,
                                   void *v) {
  kvi_kv_view w;
  kvi__kv_view_contiguous(&w, m, t, L, T, H, D, k, v);
  return w;
}

/* Byte strides of a view. */
void kvi__shard_strides_of(const kvi_kv_view *v, int64_t s[3]) {
  const int64_t e = (int64_t)kvi__dtype_size(v->dtype);
  s[0] = v->layer_stride * e;
  s[1] = v->token_stride * e;
  s[2] = v->head_stride * e;
}
