/*
 * The CPU search (the reference): each query is prepared as a stored
 * embedding is (kvi__emb_prepare), every row of its tenant is scored in
 * double and rounded once to fp32, and a bounded heap keeps the best k by
 * (score descending, id ascending).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdlib.h>

#include "search/search_impl.h"

static bool better(float as, uint64_t ai, float bs, uint64_t bi) { return as > bs || (as == bs && ai < bi); }

/* A heap of at most cap (score, id) pairs with the worst at the root. */
typedef struct heap {
  float *s;
  uint64_t *id;
  int32_t n, cap;
} heap;

static void heap_swap(heap *h, int32_t a, int32_t b) {
  float s = h->s[a];
  uint64_t id = h->id[a];
  h->s[a] = h->s[b], h->id[a] = h->id[b];
  h->s[b] = s, h->id[b] = id;
}

static void heap_down(heap *h, int32_t i) {
  for (;;) {
    int32_t w = i;
    const int32_t l = 2 * i + 1, r = l + 1;
    if (l < h->n && better(h->s[w], h->id[w], h->s[l], h->id[l])) w = l;
    if (r < h->n && better(h->s[w], h->id[w], h->s[r], h->id[r])) w = r;
    if (w == i) return;
    heap_swap(h, i, w);
    i = w;
  }
}

static void heap_offer(heap *h, float s, uint64_t id) {
  if (h->n < h->cap) {
    int32_t i = h->n++;
    h->s[i] = s, h->id[i] = id;
    while (i > 0 && better(h->s[(i - 1) / 2], h->id[(i - 1) / 2], h->s[i], h->id[i])) {
      heap_swap(h, i, (i - 1) / 2);
      i = (i - 1) / 2;
    }
  } else if (h->cap > 0 && better(s, id, h->s[0], h->id[0])) {
    h->s[0] = s, h->id[0] = id;
    heap_down(h, 0);
  }
}

kvi_status kvi__search_cpu(kvi_store *s, const void *queries, kvi_dtype qt, int32_t nq, const uint64_t *tenants,
                           int32_t k, uint64_t *out_ids, float *out_scores, int32_t *out_counts, bool locked,
                           const char *fn) {
  const int32_t dim = s->emb_dim;
  const size_t rb = (size_t)s->emb.ld * kvi__dtype_size(s->emb.dtype);
  float *q = malloc((size_t)nq * dim * sizeof *q), *row = malloc((size_t)dim * sizeof *row);
  heap h = {malloc((size_t)k * sizeof(float)), malloc((size_t)k * sizeof(uint64_t)), 0, 0};
  kvi_status st = KVI_OK;
  if (!q || !row || !h.s || !h.id) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d prepared queries", (int)nq);
    goto out;
  }
  for (int32_t i = 0; i < nq; i++) {
    float *qi = q + (size_t)i * dim;
    kvi__convert(qi, KVI_DTYPE_FP32, (const char *)queries + (size_t)i * dim * kvi__dtype_size(qt), qt, dim);
    if (kvi__emb_prepare(qi, dim, s->emb.dtype, s->emb.metric) >= 0) {
      st = kvi__fail(KVI_ERR_INTERNAL, fn, "query %d passed the checks but does not fit the store's embeddings", (int)i);
      goto out;
    }
  }
  /* nothing can fail from here on */
  if (!locked) kvi__store_lock(s);
  for (int32_t i = 0; i < nq; i++) {
    const float *qi = q + (size_t)i * dim;
    const tenant *t = kvi__store_tenant(s, tenants[i]);
    const size_t n = t ? t->nrows : 0;
    h.n = 0;
    h.cap = n < (size_t)k ? (int32_t)n : k;
    for (size_t r = 0; r < n; r++) {
      kvi__convert(row, KVI_DTYPE_FP32, (const char *)t->emb + r * rb, s->emb.dtype, dim);
      double d = 0.0;
      for (int32_t e = 0; e < dim; e++) d += (double)qi[e] * (double)row[e];
      float sc = (float)d;
      if (sc != sc) sc = -INFINITY;
      heap_offer(&h, sc, t->rows[r]->id);
    }
    const int32_t cnt = h.n;
    while (h.n > 0) { /* the worst goes last */
      heap_swap(&h, 0, --h.n);
      heap_down(&h, 0);
    }
    for (int32_t j = 0; j < k; j++) {
      out_ids[(size_t)i * k + j] = j < cnt ? h.id[j] : KVI_SEARCH_NO_ID;
      out_scores[(size_t)i * k + j] = j < cnt ? h.s[j] : -INFINITY;
    }
    out_counts[i] = cnt;
  }
  if (!locked) kvi__store_unlock(s);
out:
  free(q);
  free(row);
  free(h.s);
  free(h.id);
  return st;
}
