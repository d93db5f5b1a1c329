/*
 * Dense K/V views: initializers and validation.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "base/base.h"


void kvi__kv_view_contiguous(kvi_kv_view *view, kvi_memory memory, kvi_dtype dtype,
                             int32_t num_layers, int32_t num_tokens, int32_t num_heads,
                             int32_t head_size, void *k, void *v) {
  if (!view) return;
  kvi_kv_view l = KVI_KV_VIEW_INIT;
  l.struct_size = KVI__KV_VIEW_V1;
  l.memory = memory;
  l.dtype = dtype;
  l.num_layers = num_layers;
  l.num_tokens = num_tokens;
  l.num_heads = num_heads;
  l.head_size = head_size;
  l.head_stride = head_size;
  l.token_stride = (int64_t)num_heads * head_size;
  l.layer_stride = (int64_t)num_tokens * num_heads * head_size;
  l.k = k;
  l.v = v;
  memcpy(view, &l, KVI__KV_VIEW_V1); /* the first version only: never past an older caller's struct */
}

typedef kvi__dim dim;

static int cmp_dim(const void *a, const void *b) {
  const dim *x = a, *y = b;
  return (x->stride > y->stride) - (x->stride < y->stride);
}

bool kvi__dims_disjoint(kvi__dim *dims, int n) {
  qsort(dims, (size_t)n, sizeof dims[0], cmp_dim);
  int64_t reach = 0; /* largest offset reached by the dimensions so far */
  for (int i = 0; i < n; i++) {
    if (dims[i].extent == 1) continue;
    if (dims[i].stride <= reach) return false;
    reach += (dims[i].extent - 1) * dims[i].stride;
  }
  return true;
}

kvi_status kvi__view_check(kvi_kv_view *out, const kvi_kv_view *user, const kvi__geom *g,
                           bool dst, const char *fn) {
  const char *name = dst ? "dst" : "kv";
  if (!user) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", name);
  kvi_kv_view v = KVI_KV_VIEW_INIT;
  kvi_status st = kvi__read_struct(&v, sizeof v, user, KVI__KV_VIEW_V1, fn, name);
  if (st) return st;
  if (v.memory != KVI_MEMORY_HOST && v.memory != KVI_MEMORY_DEVICE)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "%s->memory is %d: set KVI_MEMORY_HOST or KVI_MEMORY_DEVICE", name, (int)v.memory);
  if (!kvi__dtype_is_float(v.dtype))
    return kvi__fail(v.dtype == KVI_DTYPE_FP8_E4M3 || v.dtype == KVI_DTYPE_FP8_E5M2 || v.dtype == KVI_DTYPE_Q4
                         ? KVI_ERR_MISMATCH
                                                                                  : KVI_ERR_INVALID_ARGUMENT,
                     fn, "%s->dtype is %s (%d); dense K/V buffers are fp32, fp16 or bf16", name,
                     kvi__dtype_name(v.dtype), (int)v.dtype);
  if (!v.k || !v.v) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s->%s is NULL", name, v.k ? "v" : "k");
  if (v.num_tokens < 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s->num_tokens is %d; a fact has at least one token",
                     name, (int)v.num_tokens);
  if (v.num_layers != g->num_layers)
    return kvi__fail(KVI_ERR_MISMATCH, fn, "%s->num_layers is %d, the model has %d layers", name,
                     (int)v.num_layers, (int)g->num_layers);
  if (v.num_heads != g->local_heads)
    return kvi__fail(KVI_ERR_MISMATCH, fn, "%s->num_heads is %d, the model holds %d local KV heads", name,
                     (int)v.num_heads, (int)g->local_heads);
  if (v.head_size != g->head_size)
    return kvi__fail(KVI_ERR_MISMATCH, fn, "%s->head_size is %d, the model's head size is %d", name,
                     (int)v.head_size, (int)g->head_size);
  if (v.layer_stride < 0 || v.token_stride < 0 || v.head_stride < 0)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                     "%s has a negative stride (layer %lld, token %lld, head %lld)", name,
                     (long long)v.layer_stride, (long long)v.token_stride, (long long)v.head_stride);
  /* Largest element offset, with overflow checks: the byte extent must fit. */
  dim d[4] = {{v.num_layers, v.layer_stride},
              {v.num_tokens, v.token_stride},
              {v.num_heads, v.head_stride},
              {v.head_size, 1}};
  int64_t last = 0;
  for (int i = 0; i < 4; i++) {
    int64_t t;
    if (__builtin_mul_overflow(d[i].extent - 1, d[i].stride, &t) || __builtin_add_overflow(last, t, &last))
      goto overflow;
  }
  int64_t bytes;
  if (last == INT64_MAX || __builtin_mul_overflow(last + 1, (int64_t)kvi__dtype_size(v.dtype), &bytes)) goto overflow;
  if (dst) {
    /* Sufficient condition for no two elements sharing an address: ordered by
     * stride, each dimension steps past everything the smaller ones reach.
     * K and V are a fifth dimension of extent 2 whose stride is their
     * distance (interleaved K|V buffers pass; K == V does not). */
    const size_t es = kvi__dtype_size(v.dtype);
    const intptr_t gap = (intptr_t)((const char *)v.v - (const char *)v.k);
    const int64_t agap = gap < 0 ? -(int64_t)gap : (int64_t)gap;
    dim e[5] = {d[0], d[1], d[2], d[3], {2, agap / (int64_t)es}};
    int nd = 5;
    if (agap % (int64_t)es != 0) {
      /* not element-aligned to each other: require disjoint byte ranges */
      if (agap < bytes)
        return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s->k and %s->v overlap and are not element-aligned", name, name);
      nd = 4;
    }
    if (!kvi__dims_disjoint(e, nd))
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn,
                       "%s overlaps itself (layer stride %lld, token %lld, head %lld, head_size %d, v - k = %lld "
                       "elements): a destination must not write one address twice",
                       name, (long long)v.layer_stride, (long long)v.token_stride, (long long)v.head_stride,
                       (int)v.head_size, (long long)(gap / (intptr_t)es));
  }
  *out = v;
  return KVI_OK;
overflow:
  return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s's extent overflows 64-bit byte offsets", name);
}
