/*
 * The plan of tokens to recompute (kvinject/recompute.h): boundary tokens of
 * every fact, then the best-scored of the rest. kvi_inject_deviation, which
 * scores them, lives with the injector (inject.c).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "xfer/xfer.h"

/* Whether token a ranks before token b: larger score, NaN above numbers,
 * then the lower index. */
static bool ranks_before(const float *sc, int32_t a, int32_t b) {
  const bool na = isnan(sc[a]), nb = isnan(sc[b]);
  if (na != nb) return na;
  if (!na && sc[a] != sc[b]) return sc[a] > sc[b];
  return a < b;
}

/* Sorts idx[0..n) by rank (merge sort through tmp: stable, n log n). */
static void sort_by_rank(int32_t *idx, int32_t *tmp, int64_t n, const float *sc) {
  for (int64_t w = 1; w < n; w *= 2) {
    for (int64_t lo = 0; lo < n; lo += 2 * w) {
      const int64_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
      int64_t i = lo, j = mid, k = lo;
      while (i < mid && j < hi) tmp[k++] = ranks_before(sc, idx[j], idx[i]) ? idx[j++] : idx[i++];
      while (i < mid) tmp[k++] = idx[i++];
      while (j < hi) tmp[k++] = idx[j++];
    }
    memcpy(idx, tmp, (size_t)n * sizeof *idx);
  }
}

/* floor(fraction * n + 0.5), the share of n tokens chosen by score. */
static int64_t share(double fraction, int64_t n) { return (int64_t)floor(fraction * (double)n + 0.5); }

/* Marks the m best-ranked unmarked tokens among [t0, t1); idx, tmp: scratch. */
static void mark_best(uint8_t *mark, const float *sc, int64_t t0, int64_t t1, int64_t m, int32_t *idx, int32_t *tmp) {
  int64_t n = 0;
  for (int64_t t = t0; t < t1; t++)
    if (!mark[t]) idx[n++] = (int32_t)t;
  if (m > n) m = n;
  if (m <= 0) return;
  sort_by_rank(idx, tmp, n, sc);
  for (int64_t i = 0; i < m; i++) mark[idx[i]] = 1;
}

kvi_status kvi__recompute_select(const float *scores, const int32_t *fact_tokens, int32_t num_facts,
                                 const kvi_recompute_options *opts, int32_t *out_index, int64_t capacity,
                                 int64_t *out_count, const char *fn) {
  kvi_recompute_options o = KVI_RECOMPUTE_OPTIONS_INIT;
  kvi_status st;
  if (opts && (st = kvi__read_struct(&o, sizeof o, opts, KVI__RECOMPUTE_OPTIONS_V1, fn, "opts"))) return st;
  if (!out_count) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_count is NULL");
  if (num_facts < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "num_facts is %d", (int)num_facts);
  if (num_facts > 0 && !fact_tokens) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "fact_tokens is NULL");
  if (!(o.fraction >= 0.0 && o.fraction <= 1.0))
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "fraction is %g, expected 0..1", o.fraction);
  if (o.per_fact != 0 && o.per_fact != 1)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "per_fact is %d, expected 0 or 1", (int)o.per_fact);
  if (o.boundary < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "boundary is %d", (int)o.boundary);
  int64_t T = 0;
  for (int32_t f = 0; f < num_facts; f++) {
    if (fact_tokens[f] < 0)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "fact_tokens[%d] is %d", (int)f, (int)fact_tokens[f]);
    T += fact_tokens[f];
    if (T > INT32_MAX)
      return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "the facts have more than %d tokens", (int)INT32_MAX);
  }
  if (T > 0 && !scores) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "scores is NULL");
  if (capacity < 0) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "capacity is %lld", (long long)capacity);
  uint8_t *mark = calloc((size_t)(T ? T : 1), 1);
  int32_t *idx = malloc((size_t)(T ? T : 1) * sizeof *idx), *tmp = malloc((size_t)(T ? T : 1) * sizeof *tmp);
  if (!mark || !idx || !tmp) {
    st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating the marks of %lld tokens", (long long)T);
    goto out;
  }
  int64_t t0 = 0;
  for (int32_t f = 0; f < num_facts; t0 += fact_tokens[f++])
    for (int64_t t = 0; t < o.boundary && t < fact_tokens[f]; t++) mark[t0 + t] = 1;
  if (o.per_fact) {
    t0 = 0;
    for (int32_t f = 0; f < num_facts; t0 += fact_tokens[f++])
      mark_best(mark, scores, t0, t0 + fact_tokens[f], share(o.fraction, fact_tokens[f]), idx, tmp);
  } else {
    mark_best(mark, scores, 0, T, share(o.fraction, T), idx, tmp);
  }
  int64_t n = 0;
  for (int64_t t = 0; t < T; t++) n += mark[t];
  if (n > capacity) {
    st = kvi__fail(KVI_ERR_CAPACITY, fn, "%lld tokens are chosen, out_index holds %lld", (long long)n,
                   (long long)capacity);
    goto out;
  }
  if (n > 0 && !out_index) {
    st = kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out_index is NULL");
    goto out;
  }
  for (int64_t t = 0, k = 0; t < T; t++)
    if (mark[t]) out_index[k++] = (int32_t)t;
  *out_count = n;
  st = KVI_OK;
out:
  free(tmp);
  free(idx);
  free(mark);
  return st;
}
