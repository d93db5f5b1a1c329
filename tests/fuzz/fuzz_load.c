/*
 * libFuzzer target for kvi_store_load: the input is a store file. It is
 * written to a memfd and loaded through /proc/self/fd, the way a file on
 * disk is (pread, fstat, flock, ftruncate). Built with -DKVI_FUZZING, the
 * library skips its checksum comparisons so that mutated inputs reach the
 * structural checks behind them; everything else is the production loader.
 *
 * Properties checked (abort() on violation, which libFuzzer reports):
 * - the load never crashes, leaks or reads out of bounds (ASan, UBSan);
 * - it fails only with KVI_ERR_CORRUPT, KVI_ERR_INCOMPATIBLE or
 *   KVI_ERR_CAPACITY, and then gives no store;
 * - inputs of odd size are loaded with KVI_LOAD_JOURNAL: a fact appended
 *   to the journal afterwards must load again, with the same fact count.
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* memfd_create */
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz_common.h"

static kvi_model *model;

static void check(int ok, const char *what) {
  if (!ok) {
    fprintf(stderr, "fuzz_load: property violated: %s (%s)\n", what, kvi_last_error());
    abort();
  }
}

static uint64_t facts_of(const kvi_store *s) {
  kvi_store_stats ss = KVI_STORE_STATS_INIT;
  check(kvi_store_stats_get(s, &ss) == KVI_OK, "stats");
  return ss.facts;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!model) model = fz_model();
  const int fd = memfd_create("kvi-fuzz", MFD_CLOEXEC);
  check(fd >= 0, "memfd_create");
  for (size_t done = 0; done < size;) {
    const ssize_t w = write(fd, data + done, size - done);
    check(w > 0, "write");
    done += (size_t)w;
  }
  char path[64];
  snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
  const kvi_store_options so = fz_store_options();
  kvi_load_options lo = KVI_LOAD_OPTIONS_INIT;
  lo.flags = (size & 1u) ? KVI_LOAD_JOURNAL : 0u;
  kvi_store *s = NULL;
  const kvi_status st = kvi_store_load(&s, model, &so, path, &lo);
  if (st != KVI_OK) {
    check(st == KVI_ERR_CORRUPT || st == KVI_ERR_INCOMPATIBLE || st == KVI_ERR_CAPACITY, "an expected status");
    check(s == NULL, "no store on error");
  } else if (lo.flags & KVI_LOAD_JOURNAL) {
    /* append a fact; the file must load again and hold it */
    uint16_t kv[2 * FZ_LAYERS * 1 * FZ_KV_HEADS * FZ_HEAD];
    for (size_t i = 0; i < sizeof kv / sizeof kv[0]; i++) kv[i] = (uint16_t)(0x3f80u + i);
    const float emb[FZ_EMB] = {1.0f, -2.0f, 0.5f};
    kvi_kv_view v;
    kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_BF16, FZ_LAYERS, 1, FZ_KV_HEADS, FZ_HEAD, kv,
                           kv + sizeof kv / sizeof kv[0] / 2);
    kvi_put_options po = KVI_PUT_OPTIONS_INIT;
    po.flags = KVI_PUT_REPLACE;
    po.embedding = emb;
    const kvi_status ps = kvi_store_put(s, 7, 7, &v, &po, NULL);
    check(ps == KVI_OK || ps == KVI_ERR_CAPACITY, "journaled put");
    const uint64_t n = facts_of(s);
    kvi_store_destroy(s); /* closes the journal */
    s = NULL;
    lo.flags = 0;
    check(kvi_store_load(&s, model, &so, path, &lo) == KVI_OK, "reload after an append");
    check(facts_of(s) == n, "same facts after reload");
    int32_t tokens = 0;
    if (ps == KVI_OK) check(kvi_store_fact_tokens(s, 7, 7, &tokens) == KVI_OK && tokens == 1, "appended fact");
  } else {
    (void)facts_of(s);
  }
  kvi_store_destroy(s);
  close(fd);
  return 0;
}
