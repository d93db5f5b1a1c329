/*
 * Writes the seed corpus of fuzz_load into the directory argv[1]: valid
 * files of the fuzz target's geometry made with the public API (an empty
 * store, a snapshot, a snapshot with a journal of puts, replacements and
 * removals, and that journal with a torn final entry).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "fuzz_common.h"

#define OK(call)                                                                     \
  do {                                                                               \
    if ((call) != KVI_OK) {                                                          \
      fprintf(stderr, "fuzz_seeds: %s: %s\n", #call, kvi_last_error());              \
      exit(1);                                                                       \
    }                                                                                \
  } while (0)

static void put(kvi_store *s, uint64_t tenant, uint64_t id, int32_t tokens, uint32_t flags) {
  enum { MAXT = 9 };
  static uint16_t kv[2 * FZ_LAYERS * MAXT * FZ_KV_HEADS * FZ_HEAD];
  const size_t half = (size_t)FZ_LAYERS * (size_t)tokens * FZ_KV_HEADS * FZ_HEAD;
  for (size_t i = 0; i < 2 * half; i++) kv[i] = (uint16_t)(0x3c00u + (i * 37u + id) % 0x400u);
  const float emb[FZ_EMB] = {(float)id, 0.25f, -(float)tenant};
  kvi_kv_view v;
  kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_BF16, FZ_LAYERS, tokens, FZ_KV_HEADS, FZ_HEAD, kv, kv + half);
  kvi_put_options po = KVI_PUT_OPTIONS_INIT;
  po.flags = flags;
  po.embedding = emb;
  OK(kvi_store_put(s, tenant, id, &v, &po, NULL));
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  kvi_model *m = fz_model();
  const kvi_store_options so = fz_store_options();
  char p[4096];
  kvi_store *s = NULL;
  OK(kvi_store_create(&s, m, &so));
  snprintf(p, sizeof p, "%s/empty.kvi", argv[1]);
  OK(kvi_store_save(s, p, NULL));
  put(s, 1, 10, 3, 0);
  put(s, 1, 11, 5, 0);
  put(s, 2, 10, 1, 0);
  put(s, 0xffffffffffffffffull, 3, 9, 0);
  snprintf(p, sizeof p, "%s/snapshot.kvi", argv[1]);
  OK(kvi_store_save(s, p, NULL));
  snprintf(p, sizeof p, "%s/journal.kvi", argv[1]);
  OK(kvi_store_journal_open(s, p, 0));
  put(s, 2, 11, 2, 0);
  put(s, 1, 10, 4, KVI_PUT_REPLACE);
  OK(kvi_store_remove(s, 1, 11));
  put(s, 3, 1, 6, 0);
  OK(kvi_store_remove(s, 2, 10));
  OK(kvi_store_journal_close(s));
  /* the same journal with its last entry cut short */
  FILE *in = fopen(p, "rb");
  if (!in) return 1;
  static unsigned char buf[1 << 16];
  const size_t n = fread(buf, 1, sizeof buf, in);
  fclose(in);
  snprintf(p, sizeof p, "%s/torn.kvi", argv[1]);
  FILE *out = fopen(p, "wb");
  if (!out || fwrite(buf, 1, n - 30, out) != n - 30 || fclose(out) != 0) return 1;
  kvi_store_destroy(s);
  kvi_model_destroy(m);
  printf("fuzz_seeds: 4 seeds in %s (journal %zu bytes)\n", argv[1], n);
  return 0;
}
