/*
 * internal-search-plan: the CUDA search's host plan (search_plan.c,
 * kvi__search_plan_build) executed by a host interpreter of what
 * kernels.h says each tile, scan block, selection and emit does, in double
 * precision, and compared with a brute-force top k per query. Besides the
 * results, the interpreter checks what the kernels rely on: every (query,
 * tenant row) scored and selected exactly once, tiles of a round disjoint
 * inside the score area, a round's scores and candidates within the area
 * (unless it is one tile), scan blocks covering their tiles, no selection
 * writing what another of its launch reads or writes, every query's result
 * written exactly once. Built on CPU stores: no GPU needed.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "unit.h"

#include "search/search.h"

#define DIM 12
#define NT 5

/* tenants 1..4 with these many facts; tenant 5 has none */
static const int32_t tenant_rows[NT] = {9000, 4100, 37, 1, 0};

typedef struct world {
  kvi_model *m;
  kvi_store *s;
  double *q; /* [nq][DIM] */
} world;

static void make_world(world *w, rng *r) {
  w->m = make_model(1, 1, 4, 0, 1);
  size_t facts = 0;
  for (int t = 0; t < NT; t++) facts += (size_t)tenant_rows[t];
  kvi_store_options o = cpu_store_options(KVI_DTYPE_FP32, 1, (uint64_t)(facts + 8) * 1 * 2 * 1 * 4 * 4);
  o.embedding_dim = DIM;
  assert_ok(kvi_store_create(&w->s, w->m, &o));
  kvbuf b;
  kvbuf_make(&b, LAYOUT_CONTIG, KVI_DTYPE_FP32, 1, 1, 1, 4);
  for (int t = 0; t < NT; t++)
    for (int32_t i = 0; i < tenant_rows[t]; i++) {
      float e[DIM];
      for (int d = 0; d < DIM; d++) e[d] = rand_float(r);
      kvi_put_options po = KVI_PUT_OPTIONS_INIT;
      po.embedding = e;
      /* ids not in row order: a tenant's rows are its facts in put order */
      assert_ok(kvi_store_put(w->s, (uint64_t)t + 1, (uint64_t)i * 7919u % 100003u, &b.v, &po, NULL));
    }
  kvbuf_free(&b);
}

static void free_world(world *w) {
  kvi_store_destroy(w->s);
  kvi_model_destroy(w->m);
}

typedef struct pair {
  double score;
  uint64_t id;
  int32_t row;
} pair;

static int cmp_pair(const void *a, const void *b) {
  const pair *x = a, *y = b;
  if (x->score != y->score) return x->score > y->score ? -1 : 1;
  return (x->id > y->id) - (x->id < y->id);
}

static const tenant *tenant_of(const kvi_store *s, uint64_t id) { return kvi__store_tenant(s, id); }

static double score_row(const world *w, int32_t query, const tenant *t, int32_t row) {
  const float *e = (const float *)t->emb + (size_t)row * w->s->emb.ld;
  double acc = 0;
  for (int d = 0; d < DIM; d++) acc += w->q[(size_t)query * DIM + d] * (double)e[d];
  return acc;
}

/* A range [lo, hi) a selection reads or writes in one launch. */
typedef struct span {
  int64_t lo, hi;
  size_t who;
  bool write;
} span;

static int cmp_span(const void *a, const void *b) {
  const span *x = a, *y = b;
  return (x->lo > y->lo) - (x->lo < y->lo);
}

/* No write overlaps another selection's read or write (its own read of a
 * range it writes, dst == a, is allowed). */
static void check_launch(span *sp, size_t n, const char *what) {
  qsort(sp, n, sizeof *sp, cmp_span);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n && sp[j].lo < sp[i].hi; j++)
      if ((sp[i].write || sp[j].write) && sp[i].who != sp[j].who && sp[i].hi > sp[i].lo && sp[j].hi > sp[j].lo)
        fail_msg("%s: selection %zu %s [%lld, %lld) and selection %zu %s [%lld, %lld) overlap", what, sp[i].who,
                 sp[i].write ? "writes" : "reads", (long long)sp[i].lo, (long long)sp[i].hi, sp[j].who,
                 sp[j].write ? "writes" : "reads", (long long)sp[j].lo, (long long)sp[j].hi);
}

/* Runs one plan and checks it (see the top of the file). */
static void run_plan(world *w, const uint64_t *tenants, int32_t nq, int32_t k, uint64_t area, int sms) {
  kvi_store *s = w->s;
  kvi__search_plan p;
  kvi__store_lock(s);
  assert_ok(kvi__search_plan_build(s, &p, tenants, nq, k, area, sms, "test"));
  kvi__store_unlock(s);

  /* perm: a permutation, queries grouped by tenant */
  bool *seen = calloc((size_t)nq, sizeof *seen);
  for (int32_t i = 0; i < nq; i++) {
    assert_true(p.perm[i] >= 0 && p.perm[i] < nq && !seen[p.perm[i]]);
    seen[p.perm[i]] = true;
    if (i > 0) assert_true(tenants[p.perm[i - 1]] <= tenants[p.perm[i]]);
  }
  free(seen);

  const size_t npairs = (size_t)nq * k + p.cand_pairs;
  pair *pairs = malloc((npairs + 1) * sizeof *pairs);
  bool *pset = calloc(npairs + 1, sizeof *pset);
  double *area_f = malloc((p.score_floats + 1) * sizeof *area_f);
  bool *aset = calloc(p.score_floats + 1, sizeof *aset);
  pair *res = calloc((size_t)nq * k, sizeof *res);
  int32_t *res_n = calloc((size_t)nq, sizeof *res_n), *res_w = calloc((size_t)nq, sizeof *res_w);
  /* (slot, row) selections: per slot, a count per tenant row */
  int32_t **hit = calloc((size_t)nq, sizeof *hit);
  for (int32_t j = 0; j < nq; j++) {
    const tenant *t = tenant_of(s, tenants[p.perm[j]]);
    hit[j] = calloc(t ? t->nrows + 1 : 1, sizeof **hit);
  }
  size_t most = 1; /* the most pairs one selection reads */
  for (size_t si = 0; si < p.nsels; si++)
    if ((size_t)p.sels[si].na + (size_t)p.sels[si].nb > most) most = (size_t)p.sels[si].na + (size_t)p.sels[si].nb;
  pair *tmp = malloc(most * sizeof *tmp);
  assert_true(pairs && pset && area_f && aset && res && res_n && res_w && hit && tmp);

  size_t tiles_seen = 0;
  for (size_t ri = 0; ri < p.nrounds; ri++) {
    const kvi__pround *r = &p.rounds[ri];
    assert_int_equal(r->t0, tiles_seen);
    assert_true(r->t1 > r->t0 && r->t1 <= p.ntiles);
    tiles_seen = r->t1;
    memset(aset, 0, (p.score_floats + 1) * sizeof *aset);
    /* tiles: scored, disjoint, inside the area; the round within `area` */
    uint64_t bytes = 0;
    for (size_t ti = r->t0; ti < r->t1; ti++) {
      const kvi__ptile *pt = &p.tiles[ti];
      const tenant *t = tenant_of(s, tenants[p.perm[pt->d.q0]]);
      assert_non_null(t);
      assert_true(pt->d.qn >= 1 && pt->d.nf >= 1 && pt->d.sld >= pt->d.nf && pt->d.q0 + pt->d.qn <= nq);
      assert_true(pt->row0 >= 0 && (size_t)pt->row0 + pt->d.nf <= t->nrows);
      assert_ptr_equal(pt->d.mat, (const char *)t->emb + (size_t)pt->row0 * s->emb.ld * sizeof(float));
      assert_true((size_t)pt->d.off + (size_t)pt->d.qn * pt->d.sld <= p.score_floats);
      for (int32_t j = 0; j < pt->d.qn; j++) {
        assert_int_equal(tenants[p.perm[pt->d.q0 + j]], tenants[p.perm[pt->d.q0]]); /* one tenant per tile */
        for (int32_t i = 0; i < pt->d.nf; i++) {
          const size_t at = (size_t)pt->d.off + (size_t)j * pt->d.sld + (size_t)i;
          if (aset[at]) fail_msg("round %zu: tiles overlap at score %zu", ri, at);
          aset[at] = true;
          area_f[at] = score_row(w, p.perm[pt->d.q0 + j], t, pt->row0 + i);
        }
      }
      uint64_t cands = 0;
      for (int32_t f0 = 0; f0 < pt->d.nf; f0 += pt->seg) {
        const int32_t len = pt->d.nf - f0 < pt->seg ? pt->d.nf - f0 : pt->seg;
        cands += (uint64_t)(len < k ? len : k);
      }
      bytes += (uint64_t)pt->d.qn * ((uint64_t)pt->d.sld * 4 + cands * 12);
    }
    if (r->t1 - r->t0 > 1 && bytes > area)
      fail_msg("round %zu of %zu tiles takes %llu bytes of a %llu-byte area", ri, (size_t)(r->t1 - r->t0),
               (unsigned long long)bytes, (unsigned long long)area);
    /* scan blocks: each scan tile's rows exactly once, in this round's tiles */
    for (size_t ti = r->t0; ti < r->t1; ti++) {
      const kvi__ptile *pt = &p.tiles[ti];
      int32_t *cov = calloc((size_t)pt->d.nf, sizeof *cov);
      for (size_t bi = r->b0; bi < r->b1; bi++) {
        const kvi__sblock *b = &p.blocks[bi];
        assert_true((size_t)b->tile >= r->t0 && (size_t)b->tile < r->t1);
        assert_false(p.tiles[b->tile].gemm);
        if ((size_t)b->tile != ti) continue;
        assert_true(b->r0 >= 0 && b->nr >= 1 && b->r0 + b->nr <= pt->d.nf);
        for (int32_t i = b->r0; i < b->r0 + b->nr; i++) cov[i]++;
      }
      for (int32_t i = 0; i < pt->d.nf; i++) assert_int_equal(cov[i], pt->gemm ? 0 : 1);
      if (!pt->gemm) assert_true(pt->d.qn <= r->qmax);
      free(cov);
    }
    /* stage 1, then stage 2: one launch each */
    for (int stage = 1; stage <= 2; stage++) {
      const size_t s0 = stage == 1 ? r->s0 : r->s1, s1 = stage == 1 ? r->s1 : r->s2;
      assert_true(s0 <= s1 && s1 <= p.nsels);
      span *sp = malloc((3 * (s1 - s0) + 1) * sizeof *sp);
      size_t nsp = 0;
      for (size_t si = s0; si < s1; si++) {
        const kvi__sel *sl = &p.sels[si];
        int32_t n = 0;
        if (stage == 1) {
          /* its tile and query slot, from where it reads */
          size_t ti = r->t0;
          while (ti < r->t1 && !(sl->a >= p.tiles[ti].d.off &&
                                 sl->a < p.tiles[ti].d.off + (int64_t)p.tiles[ti].d.qn * p.tiles[ti].d.sld))
            ti++;
          assert_true(ti < r->t1);
          const kvi__ptile *pt = &p.tiles[ti];
          const int32_t j = (int32_t)((sl->a - pt->d.off) / pt->d.sld), f0 = (int32_t)((sl->a - pt->d.off) % pt->d.sld);
          const int32_t slot = pt->d.q0 + j;
          const tenant *t = tenant_of(s, tenants[p.perm[slot]]);
          assert_int_equal(sl->na, 0);
          assert_int_equal(sl->row0, pt->row0 + f0);
          assert_true(sl->nb >= 1 && f0 + sl->nb <= pt->d.nf);
          for (int32_t i = 0; i < sl->nb; i++) {
            assert_true(aset[sl->a + i]);
            hit[slot][sl->row0 + i]++;
            pair e = {area_f[sl->a + i], t->rows[sl->row0 + i]->id, sl->row0 + i};
            tmp[n++] = e;
          }
        } else {
          assert_true(sl->a >= 0 && sl->b >= 0 && (size_t)(sl->a + sl->na) <= npairs && (size_t)(sl->b + sl->nb) <= npairs);
          for (int32_t i = 0; i < sl->na; i++) assert_true(pset[sl->a + i]), tmp[n++] = pairs[sl->a + i];
          for (int32_t i = 0; i < sl->nb; i++) assert_true(pset[sl->b + i]), tmp[n++] = pairs[sl->b + i];
          span ra = {sl->a, sl->a + sl->na, si, false}, rb = {sl->b, sl->b + sl->nb, si, false};
          sp[nsp++] = ra;
          sp[nsp++] = rb;
        }
        qsort(tmp, (size_t)n, sizeof *tmp, cmp_pair);
        const int32_t keep = n < k ? n : k;
        if (sl->out >= 0) { /* the query's results */
          assert_true(sl->out < nq);
          res_w[sl->out]++;
          res_n[sl->out] = keep;
          memcpy(res + (size_t)sl->out * k, tmp, (size_t)keep * sizeof *tmp);
        } else {
          assert_true(sl->dst >= 0 && (size_t)(sl->dst + keep) <= npairs);
          span wd = {sl->dst, sl->dst + keep, si, true};
          sp[nsp++] = wd;
        }
      }
      check_launch(sp, nsp, stage == 1 ? "stage 1" : "stage 2");
      /* the launch's writes land after all its reads */
      for (size_t si = s0; si < s1; si++) {
        const kvi__sel *sl = &p.sels[si];
        if (sl->out >= 0) continue;
        int32_t n = 0;
        if (stage == 1) {
          size_t ti = r->t0;
          while (!(sl->a >= p.tiles[ti].d.off &&
                   sl->a < p.tiles[ti].d.off + (int64_t)p.tiles[ti].d.qn * p.tiles[ti].d.sld))
            ti++;
          const kvi__ptile *pt = &p.tiles[ti];
          const tenant *t = tenant_of(s, tenants[p.perm[pt->d.q0 + (sl->a - pt->d.off) / pt->d.sld]]);
          for (int32_t i = 0; i < sl->nb; i++) {
            pair e = {area_f[sl->a + i], t->rows[sl->row0 + i]->id, sl->row0 + i};
            tmp[n++] = e;
          }
        } else {
          for (int32_t i = 0; i < sl->na; i++) tmp[n++] = pairs[sl->a + i];
          for (int32_t i = 0; i < sl->nb; i++) tmp[n++] = pairs[sl->b + i];
        }
        qsort(tmp, (size_t)n, sizeof *tmp, cmp_pair);
        const int32_t keep = n < k ? n : k;
        for (int32_t i = 0; i < keep; i++) pairs[sl->dst + i] = tmp[i], pset[sl->dst + i] = true;
      }
      free(sp);
    }
  }
  assert_int_equal(tiles_seen, p.ntiles);
  for (size_t e = 0; e < p.nemits; e++) {
    const kvi__emit *em = &p.emits[e];
    assert_true(em->out >= 0 && em->out < nq && em->n >= 0 && em->n <= k);
    for (int32_t i = 0; i < em->n; i++) assert_true(pset[em->src + i]);
    res_w[em->out]++;
    res_n[em->out] = em->n;
    memcpy(res + (size_t)em->out * k, pairs + em->src, (size_t)em->n * sizeof *pairs);
  }

  /* every query: results once, equal to the brute-force top k */
  for (int32_t slot = 0; slot < nq; slot++) {
    const int32_t q = p.perm[slot];
    const tenant *t = tenant_of(s, tenants[q]);
    const int32_t rows = t ? (int32_t)t->nrows : 0;
    for (int32_t i = 0; i < rows; i++)
      if (hit[slot][i] != 1) fail_msg("query %d: tenant row %d selected %d times", q, i, hit[slot][i]);
    if (res_w[q] != 1) fail_msg("query %d: results written %d times", q, res_w[q]);
    pair *all = malloc(((size_t)rows + 1) * sizeof *all);
    for (int32_t i = 0; i < rows; i++) {
      pair e = {score_row(w, q, t, i), t->rows[i]->id, i};
      all[i] = e;
    }
    qsort(all, (size_t)rows, sizeof *all, cmp_pair);
    const int32_t want = rows < k ? rows : k;
    if (res_n[q] != want) fail_msg("query %d (tenant %llu, %d rows): %d results, expected %d", q,
                                   (unsigned long long)tenants[q], rows, res_n[q], want);
    for (int32_t i = 0; i < want; i++)
      if (res[(size_t)q * k + i].id != all[i].id)
        fail_msg("query %d: result %d is fact %llu, expected %llu", q, i, (unsigned long long)res[(size_t)q * k + i].id,
                 (unsigned long long)all[i].id);
    free(all);
  }

  for (int32_t j = 0; j < nq; j++) free(hit[j]);
  free(hit);
  free(tmp);
  free(pairs);
  free(pset);
  free(area_f);
  free(aset);
  free(res);
  free(res_n);
  free(res_w);
  kvi__search_plan_free(&p);
  kvi__search_plan_free(&p); /* an emptied plan frees again harmlessly (search_cuda.c frees a failed build's twice) */
}

static void test_search_plans(void **state) {
  (void)state;
  rng r;
  rng_seed(&r, "test_search_plans");
  world w;
  make_world(&w, &r);
  static const int32_t nqs[] = {1, 3, 9, 40, 300};
  static const int32_t ks[] = {1, 5, 64, 1024};
  static const uint64_t areas[] = {1u << 16, 1u << 18, 1u << 20, 64u << 20};
  static const int smss[] = {1, 132};
  w.q = malloc((size_t)300 * DIM * sizeof *w.q);
  uint64_t *tenants = malloc(300 * sizeof *tenants);
  int runs = 0, multi_round = 0, gemm = 0, deferred = 0, running = 0;
  for (size_t a = 0; a < 5; a++)
    for (size_t b = 0; b < 4; b++)
      for (size_t c = 0; c < 4; c++) {
        const int32_t nq = nqs[a], k = ks[b];
        const uint64_t area = areas[c];
        for (int32_t i = 0; i < nq * DIM; i++) w.q[i] = (double)rand_float(&r);
        /* mostly one tenant per call (many queries of one tenant make GEMM
         * tiles), else a mix, with the tenant without facts and one unknown */
        for (int32_t i = 0; i < nq; i++)
          tenants[i] = (a + b) % 2 ? 1 + (uint64_t)((i * 7 + (int32_t)c) % 2) : (uint64_t)rng_range(&r, 1, NT + 1);
        run_plan(&w, tenants, nq, k, area, smss[(a + c) % 2]);
        kvi__search_plan p;
        assert_ok(kvi__search_plan_build(w.s, &p, tenants, nq, k, area, 132, "test"));
        multi_round += p.nrounds > 1;
        gemm += p.any_gemm;
        deferred += p.nrounds > 1 && p.cand_pairs > 0 && p.sels[p.nsels - 1].b >= (int64_t)nq * k;
        bool merges_running = false; /* a stage 2 into a top k that an earlier round began */
        for (size_t i = 0; i < p.nsels; i++) merges_running |= p.sels[i].na > 0;
        running += merges_running;
        kvi__search_plan_free(&p);
        runs++;
      }
  /* the sweep reaches the plan's shapes: several rounds, GEMM tiles */
  print_message("    %d plans: %d of several rounds, %d with GEMM tiles, %d deferred merges, %d merging every round\n", runs,
                multi_round, gemm, deferred, running);
  /* both merge steps (round_deferred, round_merges) are reached */
  assert_true(multi_round > 0 && gemm > 0 && deferred > 0 && running > 0);
  free(tenants);
  free(w.q);
  free_world(&w);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_search_plans),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
