/*
 * A small open-addressing hash map keyed by two 64-bit integers.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>

#include "base/base.h"

static inline uint64_t mix(uint64_t x) { /* splitmix64 finalizer */
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

static inline size_t home(const kvi__map *m, uint64_t k1, uint64_t k2) {
  return (size_t)(mix(k1 ^ mix(k2 + 0x9e3779b97f4a7c15ull)) & (m->cap - 1));
}

static void *probe(const kvi__map *m, size_t i, uint64_t k1, uint64_t k2) {
  for (;; i = (i + 1) & (m->cap - 1)) {
    const kvi__map_slot *s = &m->slots[i];
    if (!s->val) return NULL;
    if (s->k1 == k1 && s->k2 == k2) return s->val;
  }
}

void *kvi__map_get(const kvi__map *m, uint64_t k1, uint64_t k2) {
  return m->cap ? probe(m, home(m, k1, k2), k1, k2) : NULL;
}

/* Lookups of a large map miss the cache nearly every time, each on a slot
 * and then on the value: GET_MANY_GROUP keys' home slots are prefetched one
 * group ahead of the probes, and each value found is prefetched for the
 * caller, so that the misses overlap instead of following each other
 * (faster than prefetching each key a fixed distance ahead of its probe:
 * tests/bench/bench_lookup.c). */
#define GET_MANY_GROUP 16

void kvi__map_get_many(const kvi__map *m, const uint64_t *k1, size_t k1_step, const uint64_t *k2, size_t n,
                       void **out) {
  enum { G = GET_MANY_GROUP };
  if (n == 1) { /* no misses to overlap: the group's bookkeeping would only add to the lookup */
    out[0] = kvi__map_get(m, k1[0], k2[0]);
    return;
  }
  if (!m->cap) {
    for (size_t i = 0; i < n; i++) out[i] = NULL;
    return;
  }
  size_t h[2][G]; /* home slots of the group being probed and of the next */
  for (size_t i = 0; i < G && i < n; i++) __builtin_prefetch(&m->slots[h[0][i] = home(m, k1[i * k1_step], k2[i])]);
  for (size_t g = 0, b = 0; g < n; g += G, b ^= 1) {
    for (size_t i = g + G; i < g + 2 * G && i < n; i++)
      __builtin_prefetch(&m->slots[h[b ^ 1][i - g - G] = home(m, k1[i * k1_step], k2[i])]);
    for (size_t i = g; i < g + G && i < n; i++)
      if ((out[i] = probe(m, h[b][i - g], k1[i * k1_step], k2[i]))) __builtin_prefetch(out[i]);
  }
}

static void insert(kvi__map *m, uint64_t k1, uint64_t k2, void *val) {
  size_t i = home(m, k1, k2);
  while (m->slots[i].val) i = (i + 1) & (m->cap - 1);
  m->slots[i].k1 = k1;
  m->slots[i].k2 = k2;
  m->slots[i].val = val;
}

kvi_status kvi__map_reserve(kvi__map *m, size_t extra, const char *fn) {
  size_t need = m->len + extra;
  if (need * 2 <= m->cap) return KVI_OK; /* load factor <= 1/2 */
  size_t cap = m->cap ? m->cap : 16;
  while (need * 2 > cap) cap *= 2;
  kvi__map_slot *slots = calloc(cap, sizeof *slots);
  if (!slots) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "growing a hash table to %zu slots", cap);
  kvi__map old = *m;
  m->slots = slots;
  m->cap = cap;
  for (size_t i = 0; i < old.cap; i++)
    if (old.slots[i].val) insert(m, old.slots[i].k1, old.slots[i].k2, old.slots[i].val);
  free(old.slots);
  return KVI_OK;
}

void kvi__map_put(kvi__map *m, uint64_t k1, uint64_t k2, void *val) {
  insert(m, k1, k2, val);
  m->len++;
}

void *kvi__map_del(kvi__map *m, uint64_t k1, uint64_t k2) {
  if (!m->cap) return NULL;
  size_t mask = m->cap - 1, i = home(m, k1, k2);
  for (;; i = (i + 1) & mask) {
    if (!m->slots[i].val) return NULL;
    if (m->slots[i].k1 == k1 && m->slots[i].k2 == k2) break;
  }
  void *val = m->slots[i].val;
  /* Backward-shift: move later entries of the probe run into the hole when
   * their home slot does not lie cyclically in (hole, j]. */
  size_t hole = i;
  for (size_t j = (i + 1) & mask; m->slots[j].val; j = (j + 1) & mask) {
    size_t h = home(m, m->slots[j].k1, m->slots[j].k2);
    bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
    if (!stays) {
      m->slots[hole] = m->slots[j];
      hole = j;
    }
  }
  m->slots[hole].val = NULL;
  m->len--;
  return val;
}

void kvi__map_free(kvi__map *m) {
  free(m->slots);
  m->slots = NULL;
  m->cap = m->len = 0;
}
