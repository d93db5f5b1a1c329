/*
 * Tensor-parallel stores: agreement of the fact sets
 * (kvi_store_check_agreement), an order-free digest of every rank's facts.
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdlib.h>
#include <string.h>

#include "tp/internal.h"

kvi_status kvi__store_check_agreement(kvi_store *store, const char *fn) {
  if (!store) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "store is NULL");
  if (!store->shard.comm) return kvi__fail(KVI_ERR_UNSUPPORTED, fn, "the store was created without a communicator");
  kvi_comm *c = store->shard.comm;
  /* an order-free digest: sums of two independent hashes of every fact */
  uint64_t me[3] = {0, 0, 0};
  kvi__store_lock(store);
  size_t pos = 0;
  for (const fact *f; (f = kvi__store_next_fact(store, &pos));) {
    /* the token ids' hash too (0 without ids): ranks must agree on what each fact is */
    const uint64_t x = kvi__mix64(f->tenant_id) ^ kvi__mix64(f->id + 0x9e3779b97f4a7c15ull) ^
                       kvi__mix64((uint64_t)f->tokens << 1 | 1) ^ kvi__mix64(f->token_hash ^ 0xd6e8feb86659fd93ull);
    me[0]++;
    me[1] += kvi__mix64(x);
    me[2] += kvi__mix64(x ^ 0x5851f42d4c957f2dull);
  }
  kvi__store_unlock(store);
  uint64_t *all = calloc((size_t)c->size * 3, sizeof *all);
  if (!all) {
    kvi__comm_allgather_host(c, me, NULL, sizeof me, fn);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d digests", (int)c->size);
  }
  kvi_status st = kvi__comm_allgather_host(c, me, all, sizeof me, fn);
  for (int32_t r = 1; st == KVI_OK && r < c->size; r++)
    if (memcmp(all + 3 * r, all, sizeof me) != 0)
      st = kvi__fail(KVI_ERR_MISMATCH, fn,
                     "the ranks hold different facts: rank 0 has %llu, rank %d has %llu%s", (unsigned long long)all[0],
                     (int)r, (unsigned long long)all[3 * r],
                     all[0] == all[3 * r] ? " (same count, different ids, token counts or token ids)" : "");
  free(all);
  return st;
}
