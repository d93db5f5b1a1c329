/*
 * The store the layout and recompute unit tests share: a model of L layers
 * with mixed RoPE (layer 0 none, layer 1 NeoX, layer 2 GPT-J partial with
 * linear scaling), tensor-parallel rank 1 of 2 (H local heads of HT), a CPU
 * fp32 store of P-token pages holding three random facts and their float64
 * RoPE references. The including file defines L, HT, H, D and P first.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_TESTS_MIXED_STORE_H
#define KVI_TESTS_MIXED_STORE_H

#include "ref64.h"
#include "rope_catalogue.h"

typedef struct fixture {
  kvi_model *m;
  kvi_store *s;
  kvi_rope_spec spec[L];
  ref_rope rr[L];
  rfact a, b, c; /* tenant 7: a (5 tokens), b (7); tenant 9: c (3) */
  rng r;
} fixture;

static int mixed_store_setup(void **state, const char *seed) {
  fixture *f = calloc(1, sizeof *f);
  assert_non_null(f);
  rng_seed(&f->r, seed);
  f->m = make_model(L, HT, D, 1, 2);
  /* layer 0 NoPE (K bit-exact), layer 1 NeoX, layer 2 GPT-J partial with linear scaling */
  f->spec[0] = rope(KVI_ROPE_NONE, 0, 0.0);
  f->spec[1] = rope(KVI_ROPE_NEOX, 0, 10000.0);
  f->spec[2] = rope(KVI_ROPE_GPTJ, 8, 1e6);
  f->spec[2].scaling = KVI_ROPE_SCALING_LINEAR;
  f->spec[2].factor = 2.0;
  for (int l = 0; l < L; l++) {
    assert_ok(kvi_model_set_rope(f->m, l, &f->spec[l]));
    ref_rope_init(&f->rr[l], &f->spec[l], D);
  }
  const uint64_t page_bytes = (uint64_t)P * L * 2 * H * D * 4;
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, P, 16 * page_bytes);
  assert_ok(kvi_store_create(&f->s, f->m, &o));
  /* magnitudes below 8: rotated below 11.3, below 226 after the smallest fp8 scale (0.05) */
  rfact_make(&f->a, &f->r, 7, 1, L, 5, H, D, -4, 2);
  rfact_make(&f->b, &f->r, 7, 2, L, 7, H, D, -4, 2);
  rfact_make(&f->c, &f->r, 9, 1, L, 3, H, D, -4, 2);
  rfact_put(f->s, &f->a, 0);
  rfact_put(f->s, &f->b, 0);
  rfact_put(f->s, &f->c, 0);
  *state = f;
  return 0;
}

static int mixed_store_teardown(void **state) {
  fixture *f = *state;
  for (int l = 0; l < L; l++) ref_rope_free(&f->rr[l]);
  rfact_free(&f->a);
  rfact_free(&f->b);
  rfact_free(&f->c);
  kvi_store_destroy(f->s);
  kvi_model_destroy(f->m);
  free(f);
  return 0;
}

#endif
