/*
 * The store the layout and recompute unit tests share: a model of L layers
 * with mixed RoPE (layer 0 none, layer 1 NeoX, layer 2 GPT-J partial with
 * linear scaling), tensor-parallel rank 1 of 2 (H local heads of HT), a CPU
 * fp32 store of P-token pages holding three random facts and their float64
 * RoPE references; the two requests the suites inject those facts with; the
 * cache dtype and scale mode of a case. The including file defines L, HT, H,
 * D and P first.
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

/* The two requests: tenant 7, facts a then b at shuffled explicit
 * positions; tenant 9, fact c from a start position. Their block tables are
 * a shuffle of the cache's block ids (request 0 takes the first, request 1
 * the next), each `extra` entries longer than its slots need. */
typedef struct mixed_requests {
  kvi_inject_request rq[2];
  int32_t *perm; /* owned: rq[0]'s block table, then rq[1]'s */
  int32_t pos0[32];
  int32_t start1, len0, len1;
  uint64_t ids0[2], ids1[1];
  int64_t fs0, fs1;
} mixed_requests;

static void mixed_requests_make(mixed_requests *q, fixture *f, const ecache *c, int64_t fs0, int64_t fs1,
                                int32_t extra) {
  q->perm = malloc((size_t)c->NB * sizeof *q->perm);
  assert_non_null(q->perm);
  rand_perm(&f->r, q->perm, (int32_t)c->NB);
  const int32_t T0 = f->a.T + f->b.T, T1 = f->c.T;
  q->fs0 = fs0, q->fs1 = fs1;
  q->len0 = (int32_t)((fs0 + T0 - 1) / c->BS + 1) + extra;
  q->len1 = (int32_t)((fs1 + T1 - 1) / c->BS + 1) + extra;
  assert_true(q->len0 + q->len1 <= c->NB);
  rand_positions(&f->r, q->pos0, T0, 0, 6000, true);
  q->start1 = (int32_t)rng_range(&f->r, 0, 7000);
  q->ids0[0] = f->a.id, q->ids0[1] = f->b.id, q->ids1[0] = f->c.id;
  kvi_inject_request_init(&q->rq[0], sizeof q->rq[0]);
  kvi_inject_request_init(&q->rq[1], sizeof q->rq[1]);
  q->rq[0].tenant = 7, q->rq[0].fact_ids = q->ids0, q->rq[0].num_facts = 2, q->rq[0].block_table = q->perm;
  q->rq[0].block_table_len = q->len0, q->rq[0].first_slot = fs0, q->rq[0].positions = q->pos0;
  q->rq[1].tenant = 9, q->rq[1].fact_ids = q->ids1, q->rq[1].num_facts = 1, q->rq[1].block_table = q->perm + q->len0;
  q->rq[1].block_table_len = q->len1, q->rq[1].first_slot = fs1, q->rq[1].start_position = q->start1;
}

/* A case's cache dtype and scale mode. */
typedef struct dcase {
  kvi_dtype dt;
  kvi_scale_mode sm;
} dcase;

#endif
