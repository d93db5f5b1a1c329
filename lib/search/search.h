/*
 * libkvinject — the plan of a CUDA search (search.c), built on the host:
 * tiles of the score area, scan blocks, the top-k selections of each round
 * and the final emits (the kernels' view of them is in kernels.h).
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_SEARCH_INTERNAL_H
#define KVI_SEARCH_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/kernels.h"
#include "store/store.h"

typedef struct kvi__ptile {
  kvi__stile d;        /* as uploaded */
  const uint64_t *ids; /* fact id of the tile's row 0 (device) */
  int32_t row0;        /* the tenant row of the tile's row 0 */
  int32_t seg;         /* scores per stage-1 selection */
  bool gemm;
} kvi__ptile;

typedef struct kvi__pround {
  size_t t0, t1, b0, b1, s0, s1, s2; /* tiles, scan blocks, stage-1 sels, stage-2 sels */
  int32_t qmax;                      /* largest qn of its scan tiles */
} kvi__pround;

typedef struct kvi__search_plan {
  int32_t *perm; /* slot -> query */
  kvi__emit *emits; /* nemits of them */
  size_t nemits;
  kvi__ptile *tiles;
  size_t ntiles, ctiles;
  kvi__sblock *blocks;
  size_t nblocks, cblocks;
  kvi__sel *sels;
  size_t nsels, csels;
  kvi__pround *rounds;
  size_t nrounds, crounds;
  size_t score_floats; /* the largest round's */
  size_t cand_pairs;   /* the largest round's stage-1 outputs */
  bool any_gemm;
} kvi__search_plan;

/* Cuts a search of nq queries (tenants[i]: query i's tenant) for the top k
 * into tiles and rounds whose scores and candidates fit `area` bytes (a
 * round of one tile may exceed it), for a device of `sms` multiprocessors.
 * Pure host code: reads the store's tenants (its lock held) and computes
 * device addresses from their matrices without touching them. On failure
 * (KVI_ERR_OUT_OF_MEMORY) *p is left empty. */
kvi_status kvi__search_plan_build(const kvi_store *s, kvi__search_plan *p, const uint64_t *tenants, int32_t nq,
                                  int32_t k, uint64_t area, int sms, const char *fn);
/* Frees a plan's arrays and empties it (freeing an empty plan again is a no-op). */
void kvi__search_plan_free(kvi__search_plan *p);

#endif
