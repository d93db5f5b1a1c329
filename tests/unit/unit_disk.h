/*
 * Helpers shared by the disk-tier suites (unit-disk, internal-disk-read): a
 * fixture of a temporary directory and a model (RoPE theta 10000), and one
 * kvi_encode call's three captures from a host cache, which the disk tier
 * writes as one entry of the tenant's file.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_UNIT_DISK_H
#define KVI_UNIT_DISK_H

#include <dirent.h>
#include <unistd.h>

#include "unit.h"

typedef struct disk_fx {
  char dir[512];
  kvi_model *m;
  int32_t L, H, D;
} disk_fx;

/* A fresh directory under $TMPDIR (or /tmp) named kvi-<tag>-XXXXXX, and a
 * model of L layers, H heads of D; NULL when either cannot be made. */
static inline disk_fx *disk_fx_new(const char *tag, int32_t L, int32_t H, int32_t D) {
  disk_fx *f = calloc(1, sizeof *f);
  if (!f) return NULL;
  const char *tmp = getenv("TMPDIR");
  snprintf(f->dir, sizeof f->dir, "%s/kvi-%s-XXXXXX", tmp && *tmp ? tmp : "/tmp", tag);
  kvi_rope_spec r = KVI_ROPE_SPEC_INIT;
  r.theta = 10000.0;
  if (!mkdtemp(f->dir) || !(f->m = make_model(L, H, D, 0, 1)) || kvi_model_set_rope(f->m, -1, &r) != KVI_OK) {
    kvi_model_destroy(f->m);
    free(f);
    return NULL;
  }
  f->L = L, f->H = H, f->D = D;
  return f;
}

/* Removes the directory (its files first, made writable again) and the model. */
static inline void disk_fx_free(disk_fx *f) {
  chmod(f->dir, 0700);
  DIR *d = opendir(f->dir);
  if (d) {
    struct dirent *e;
    char p[800];
    while ((e = readdir(d)))
      if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
        snprintf(p, sizeof p, "%s/%s", f->dir, e->d_name);
        unlink(p);
      }
    closedir(d);
  }
  rmdir(f->dir);
  kvi_model_destroy(f->m);
  free(f);
}

/* encode3's cache: 8 blocks of 4 tokens, random fp32 values seeded by `seed` (malloc'd). */
static inline float *encode3_cache(const disk_fx *f, const char *seed) {
  const size_t elems = (size_t)8 * f->L * 2 * f->H * 4 * f->D;
  float *pool = malloc(elems * sizeof *pool);
  assert_non_null(pool);
  rng r;
  rng_seed(&r, seed);
  for (size_t i = 0; i < elems; i++) pool[i] = rand_float(&r);
  return pool;
}

/* Facts 10, 11, 12 of tenant 5 (2, 3 and 4 tokens, at positions 0, 17, 34)
 * captured from encode3_cache's blocks by one kvi_encode call. */
static inline void encode3(const disk_fx *f, kvi_store *s, float *pool) {
  kvi_cache_layout cl;
  assert_ok(kvi_cache_layout_preset(&cl, KVI_CACHE_TRTLLM, KVI_DTYPE_FP32, f->L, f->H, f->D, 4, 8, NULL, NULL, pool));
  cl.memory = KVI_MEMORY_HOST;
  kvi_encoder *enc = NULL;
  assert_ok(kvi_encoder_create(&enc, s, &cl, NULL));
  const int32_t table[] = {3, 1, 6, 0};
  kvi_capture caps[3];
  for (int i = 0; i < 3; i++) {
    kvi_capture_init(&caps[i], sizeof caps[i]);
    caps[i].tenant = 5;
    caps[i].fact_id = 10 + (uint64_t)i;
    caps[i].block_table = table;
    caps[i].block_table_len = 4;
    caps[i].first_slot = 3 * i + 1;
    caps[i].num_tokens = 2 + i;
    caps[i].start_position = 17 * i;
  }
  assert_ok(kvi_encode(enc, caps, 3, NULL));
  kvi_encoder_destroy(enc);
}

#endif /* KVI_UNIT_DISK_H */
