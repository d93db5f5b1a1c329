/*
 * libkvinject against real llama.cpp on SmolLM2-135M-Instruct (f16 KV cache,
 * flash attention, CPU): sequence states captured from and injected into,
 * logits compared with llama.cpp's own.
 *
 *   exact-context   [header | facts] captured from llama.cpp's state and
 *                   injected into a fresh state at the same positions: the
 *                   question's logits equal llama.cpp continuing its own state
 *                   (bit for bit with keys stored as captured, "relative to
 *                   0"; with keys stored pre-RoPE the measured difference is
 *                   printed and bounded)
 *   k-shift         a fact prefilled alone at positions 0.. and injected at p
 *                   after a header, against llama.cpp's llama_memory_seq_add
 *                   of the same cells (K bytes compared, differences explained,
 *                   logits compared)
 *   negative        zeroed facts, facts rotated at wrong positions: logits differ
 *   tenants         a fact id of one tenant is not another's; each tenant's
 *                   facts give their own logits
 *   formats         states llama.cpp made with other settings, and damaged
 *                   states: clear errors; every state the library writes is
 *                   accepted by llama_state_seq_set_data
 *
 * Exits 77 when KVI_SMOLLM2_GGUF names no model.
 * SPDX-License-Identifier: Apache-2.0
 */
#include "harness.h"

#include <ggml.h>

#define HEADER "You are a helpful assistant. You remember what the user told you in earlier conversations."
#define QUESTION " Question: what is the name of my cat, and where do I live? Answer:"
static const char *facts[] = {
    " The user's cat is called Miso and she is three years old.",
    " The user lives in Lisbon, in a flat near the river.",
    " The user works as a nurse and prefers night shifts.",
};
#define NF 3

typedef struct seqs {
  llama_token header[128], fact[NF][64], question[64];
  int32_t n_header, n_fact[NF], n_question, n_all;
} seqs;

static void tokenize_all(const h_engine *e, seqs *s) {
  s->n_header = h_tokenize(e, HEADER, s->header, 128);
  s->n_all = s->n_header;
  for (int i = 0; i < NF; i++) s->n_all += s->n_fact[i] = h_tokenize(e, facts[i], s->fact[i], 64);
  s->n_question = h_tokenize(e, QUESTION, s->question, 64);
}

/* Prefills [header | facts] in seq 0 of a cleared context. */
static void prefill_context(h_engine *e, const seqs *s) {
  llama_memory_clear(llama_get_memory(e->ctx), true);
  h_decode(e, s->header, s->n_header, 0, 0, NULL);
  int32_t pos = s->n_header;
  for (int i = 0; i < NF; i++) {
    h_decode(e, s->fact[i], s->n_fact[i], pos, 0, NULL);
    pos += s->n_fact[i];
  }
}

/* Sets state into seq 0 (checking llama.cpp takes all of it) and decodes the
 * question after its n cells. */
static void answer_from(h_engine *e, const seqs *s, const uint8_t *state, size_t size, int32_t n, float *logits) {
  size_t got = h_set_state(e, state, size);
  CHECK(got == size, "llama_state_seq_set_data read %zu of %zu bytes", got, size);
  h_decode(e, s->question, s->n_question, n, 0, logits);
}

/* KL(p_ref || p_got) of the softmaxed logits, in nats. */
static double kl(const float *ref, const float *got, int32_t n) {
  double mr = ref[0], mg = got[0], zr = 0, zg = 0, k = 0;
  for (int32_t i = 1; i < n; i++) mr = ref[i] > mr ? ref[i] : mr, mg = got[i] > mg ? got[i] : mg;
  for (int32_t i = 0; i < n; i++) zr += exp(ref[i] - mr), zg += exp(got[i] - mg);
  for (int32_t i = 0; i < n; i++) {
    const double lr = ref[i] - mr - log(zr), lg = got[i] - mg - log(zg);
    k += exp(lr) * (lr - lg);
  }
  return k;
}

/* Adjacent fp16 values (one unit in the last place apart), or equal. */
static int within_ulp(ggml_fp16_t a, ggml_fp16_t b) {
  if (a == b) return 1;
  if ((a ^ b) & 0x8000) return ((a | b) & 0x7fff) == 1 && ((a & 0x7fff) <= 1) && ((b & 0x7fff) <= 1);
  return abs((int)(a & 0x7fff) - (int)(b & 0x7fff)) == 1;
}

/* Compares cells [0, n) of two f16 states (same geometry): how many K and V
 * values differ, whether all are within one ulp; with fix, copies theirs
 * into ours where they differ. */
typedef struct cmp {
  long k_diff, v_diff, total, far; /* far: more than one ulp apart */
  double max_abs;                  /* the largest difference of a value */
} cmp;

static cmp compare_states(uint8_t *ours, size_t osz, const uint8_t *theirs, size_t tsz, int32_t n, int fix) {
  kvi_llama_state_info a = KVI_LLAMA_STATE_INFO_INIT, b = KVI_LLAMA_STATE_INFO_INIT;
  KVI_OK_OR_DIE(kvi_llama_state_parse(ours, osz, &a));
  KVI_OK_OR_DIE(kvi_llama_state_parse(theirs, tsz, &b));
  const kvi_llama_section *sa = &a.sections[0], *sb = &b.sections[0];
  cmp c = {0, 0, 0, 0, 0.0};
  const size_t row = (size_t)sa->k_row_elements;
  for (int32_t l = 0; l < sa->num_layers; l++)
    for (int plane = 0; plane < 2; plane++) {
      ggml_fp16_t *x = (ggml_fp16_t *)(ours + (plane ? sa->v_offset : sa->k_offset) + (size_t)l * sa->layer_bytes);
      const ggml_fp16_t *y =
          (const ggml_fp16_t *)(theirs + (plane ? sb->v_offset : sb->k_offset) + (size_t)l * sb->layer_bytes);
      for (size_t i = 0; i < (size_t)n * row; i++) {
        c.total++;
        if (x[i] == y[i]) continue;
        if (plane) c.v_diff++;
        else c.k_diff++;
        c.far += !within_ulp(x[i], y[i]);
        const double d = fabs((double)ggml_fp16_to_fp32(x[i]) - (double)ggml_fp16_to_fp32(y[i]));
        c.max_abs = d > c.max_abs ? d : c.max_abs;
        if (fix) x[i] = y[i];
      }
    }
  return c;
}

/* ---- exact context ------------------------------------------------------ */

static void test_exact_context(h_engine *e, const seqs *s, const kvi_model *m) {
  float *ref = malloc((size_t)e->n_vocab * sizeof(float)), *got = malloc((size_t)e->n_vocab * sizeof(float));
  prefill_context(e, s);
  size_t sz;
  uint8_t *st = h_get_state(e, 0, &sz);
  h_decode(e, s->question, s->n_question, s->n_all, 0, ref);

  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  KVI_OK_OR_DIE(kvi_llama_state_parse(st, sz, &info));
  const kvi_llama_section *sec = &info.sections[0];
  const int v_trans = sec->v_trans;
  CHECK(info.num_sections == 1 && info.size == sz && sec->num_cells == s->n_all &&
            sec->num_layers == e->n_layer &&
            sec->k_row_elements == e->n_head_kv * e->head_size,
        "parsed %d sections, %d cells, v_trans %d, %d layers, dtype %d, rows %d", info.num_sections, sec->num_cells,
        sec->v_trans, sec->num_layers, (int)sec->dtype, sec->k_row_elements);
  int32_t pos[256];
  KVI_OK_OR_DIE(kvi_llama_state_positions(st, sz, 0, 0, s->n_all, pos));
  for (int32_t i = 0; i < s->n_all; i++) CHECK(pos[i] == i, "cell %d at position %d", i, pos[i]);

  /* The two ways of storing captured keys: as captured (rotation by 0 both
   * ways: bit copies), and pre-RoPE (un-rotated at the cells' positions,
   * fp32 store, rotated again at the same positions). */
  /* (other cache dtypes: the bit-copy mode; fp16 value comparisons below) */
  const kvi_dtype dt = sec->dtype;
  for (int mode = 0; mode < (dt == KVI_DTYPE_FP16 ? 2 : 1); mode++) {
    const int relative = mode == 0;
    kvi_store *store = h_store(m, relative ? dt : KVI_DTYPE_FP32);
    static const int32_t zeros[256];
    uint64_t ids[1 + NF];
    int32_t first = 0;
    for (int i = 0; i <= NF; i++) {
      const int32_t n = i == 0 ? s->n_header : s->n_fact[i - 1];
      ids[i] = 100 + (uint64_t)i;
      h_capture(store, st, sz, m, 7, ids[i], first, n, relative ? zeros : NULL);
      first += n;
    }
    size_t fsz;
    uint8_t *fresh = h_fresh_state_v(m, s->n_all, dt, v_trans, &fsz);
    CHECK(fsz == sz, "a fresh state of %d cells is %zu bytes, llama.cpp's %zu", s->n_all, fsz, sz);
    KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 7, ids, 1 + NF, 0, relative ? zeros : NULL, 0));
    CHECK(memcmp(fresh, st, 16 + 12 * (size_t)s->n_all) == 0, "the fresh state's header and cells differ from llama.cpp's");
    const int same_bytes = fsz == sz && memcmp(fresh, st, sz) == 0;
    answer_from(e, s, fresh, fsz, s->n_all, got);
    const int same = memcmp(ref, got, (size_t)e->n_vocab * sizeof(float)) == 0;
    const char *setting = v_trans ? "V transposed (no flash attention)" : "flash attention";
    const char *dts = dt == KVI_DTYPE_FP16 ? "f16" : dt == KVI_DTYPE_BF16 ? "bf16" : "f32";
    if (relative) {
      /* rotations by 0 both ways: bit copies, whatever the dtype */
      printf("exact-context, %s, %s cache, keys as captured: the rebuilt state is %s; logits %s\n", setting, dts,
             same_bytes ? "byte-identical to llama.cpp's" : "DIFFERENT from llama.cpp's",
             same ? "bit-identical" : "differ");
      CHECK(same_bytes && same, "the rebuilt state or its logits differ");
    } else {
      const cmp c = compare_states(fresh, fsz, st, sz, s->n_all, 0);
      printf("exact-context, %s, %s cache, keys pre-RoPE (fp32 store): %ld K and %ld V of %ld values differ from "
             "llama.cpp's state (%ld by more than one ulp, by %.2g at most); logits %s (max |diff| %.3g, KL %.3g nats), "
             "argmax %d vs %d\n",
             setting, dts, c.k_diff, c.v_diff, c.total, c.far, c.max_abs, same ? "bit-identical" : "differ",
             h_max_diff(ref, got, e->n_vocab), kl(ref, got, e->n_vocab), h_argmax(got, e->n_vocab),
             h_argmax(ref, e->n_vocab));
      CHECK(c.v_diff == 0 && c.max_abs < 1e-2, "%ld V values differ, K values by up to %g", c.v_diff, c.max_abs);
      CHECK(kl(ref, got, e->n_vocab) < 1e-3, "KL %g", kl(ref, got, e->n_vocab));
      CHECK(h_argmax(got, e->n_vocab) == h_argmax(ref, e->n_vocab), "argmax changed");
    }
    free(fresh);
    kvi_store_destroy(store);
  }
  free(st);
  free(ref);
  free(got);
}

/* ---- K-shift -------------------------------------------------------------- */

static void test_k_shift(h_engine *e, const seqs *s, const kvi_model *m) {
  float *ref = malloc((size_t)e->n_vocab * sizeof(float)), *got = malloc((size_t)e->n_vocab * sizeof(float));
  struct llama_memory_i *mem = llama_get_memory(e->ctx);
  const int32_t H = s->n_header, F = s->n_fact[0], N = H + F, p = H;

  /* llama.cpp: header in seq 0, the fact alone in seq 1 at 0..F-1, shifted by
   * p (its K-shift), moved into seq 0, then the question. */
  llama_memory_clear(mem, true);
  h_decode(e, s->header, H, 0, 0, NULL);
  h_decode(e, s->fact[0], F, 0, 1, NULL);
  size_t hs, fs;
  uint8_t *hstate = h_get_state(e, 0, &hs), *fstate = h_get_state(e, 1, &fs);
  llama_memory_seq_add(mem, 1, 0, F, p);
  llama_memory_seq_cp(mem, 1, 0, -1, -1);
  llama_memory_seq_rm(mem, 1, -1, -1);
  h_decode(e, s->question, s->n_question, N, 0, ref);
  size_t ss;
  uint8_t *shifted = h_get_state(e, 0, &ss); /* N + question cells, K-shift applied */

  kvi_llama_state_info fi = KVI_LLAMA_STATE_INFO_INIT, si = KVI_LLAMA_STATE_INFO_INIT;
  KVI_OK_OR_DIE(kvi_llama_state_parse(fstate, fs, &fi));
  KVI_OK_OR_DIE(kvi_llama_state_parse(shifted, ss, &si));
  const int32_t row = e->n_head_kv * e->head_size;
  float *table = malloc((size_t)(p + 1) * (size_t)e->n_rot * sizeof(float));
  KVI_OK_OR_DIE(kvi_llama_rope_table(table, p + 1, e->n_rot, e->freq_base, 1.0f));
  const float *cs = table + (size_t)p * (size_t)e->n_rot;

  for (int mode = 0; mode < 2; mode++) {
    const int relative = mode == 0;
    kvi_store *store = h_store(m, relative ? KVI_DTYPE_FP16 : KVI_DTYPE_FP32);
    static const int32_t zeros[256];
    int32_t at_p[256];
    for (int i = 0; i < 256; i++) at_p[i] = p;
    h_capture(store, hstate, hs, m, 1, 1, 0, H, relative ? zeros : NULL);
    h_capture(store, fstate, fs, m, 1, 2, 0, F, relative ? zeros : NULL);
    size_t fsz;
    uint8_t *fresh = h_fresh_state(m, N, KVI_DTYPE_FP16, &fsz);
    const uint64_t hid = 1, fid = 2;
    KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 1, &hid, 1, 0, relative ? zeros : NULL, 0));
    /* relative: every key rotated by p, as llama.cpp's shift does; pre-RoPE:
     * un-rotated at i when captured, rotated at p + i now */
    KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 1, &fid, 1, H, relative ? at_p : NULL, p));

    /* Where the fact's keys differ from llama.cpp's shifted ones: is
     * llama.cpp's value the same rotation with a fused multiply-add? */
    long explained = 0, kd = 0;
    kvi_llama_state_info oi = KVI_LLAMA_STATE_INFO_INIT;
    KVI_OK_OR_DIE(kvi_llama_state_parse(fresh, fsz, &oi));
    for (int32_t l = 0; l < e->n_layer; l++) {
      const ggml_fp16_t *o16 =
          (const ggml_fp16_t *)(fresh + oi.sections[0].k_offset + (size_t)l * oi.sections[0].layer_bytes) +
          (size_t)H * row;
      const ggml_fp16_t *t16 =
          (const ggml_fp16_t *)(shifted + si.sections[0].k_offset + (size_t)l * si.sections[0].layer_bytes) +
          (size_t)H * row;
      const ggml_fp16_t *x16 =
          (const ggml_fp16_t *)(fstate + fi.sections[0].k_offset + (size_t)l * fi.sections[0].layer_bytes);
      for (int32_t t = 0; t < F; t++)
        for (int32_t j = 0; j < row; j += 2)
          for (int q = 0; q < 2; q++) {
            const size_t o = (size_t)t * row + j;
            if (o16[o + q] == t16[o + q]) continue;
            kd++;
            const int32_t i = (j % e->head_size) / 2;
            const float c = cs[i], sn = cs[e->n_rot / 2 + i];
            const float x0 = ggml_fp16_to_fp32(x16[o]), x1 = ggml_fp16_to_fp32(x16[o + 1]);
            const float fused = q == 0 ? fmaf(x0, c, -(x1 * sn)) : fmaf(x0, sn, x1 * c);
            explained += ggml_fp32_to_fp16(fused) == t16[o + q];
          }
    }
    const cmp c = compare_states(fresh, fsz, shifted, ss, N, 0);
    answer_from(e, s, fresh, fsz, N, got);
    const int same = memcmp(ref, got, (size_t)e->n_vocab * sizeof(float)) == 0;
    const double d = h_max_diff(ref, got, e->n_vocab), k = kl(ref, got, e->n_vocab);
    /* the same state with llama.cpp's values where they differ */
    compare_states(fresh, fsz, shifted, ss, N, 1);
    float *fixed = malloc((size_t)e->n_vocab * sizeof(float));
    answer_from(e, s, fresh, fsz, N, fixed);
    const int fixed_same = memcmp(ref, fixed, (size_t)e->n_vocab * sizeof(float)) == 0;
    free(fixed);
    char why[160] = "";
    if (relative)
      snprintf(why, sizeof why, " (%ld in the fact, %ld of them where llama.cpp's fused multiply-add rounds the other way)",
               kd, explained);
    printf("k-shift, keys %s: %ld K%s and %ld V of %ld values differ from llama.cpp's shifted cache, %ld by more than one fp16 ulp, by %.2g at "
           "most; logits "
           "%s (max |diff| %.3g, KL %.3g nats), argmax %d vs %d; with llama.cpp's values there: %s\n",
           relative ? "as captured at 0, rotated by p" : "pre-RoPE, rotated at p + i", c.k_diff, why, c.v_diff, c.total, c.far, c.max_abs, same ? "bit-identical" : "differ", d, k, h_argmax(got, e->n_vocab),
           h_argmax(ref, e->n_vocab), fixed_same ? "bit-identical" : "still different");
    CHECK(c.v_diff == 0 && c.max_abs < 1e-2, "%ld V values differ, K values by up to %g", c.v_diff, c.max_abs);
    if (relative) {
      /* one rotation, llama.cpp's angles: only the fused product's rounding */
      CHECK(kd == explained && c.k_diff == kd && c.far == 0,
            "%ld K values differ for another reason than a fused product's rounding", c.k_diff - explained);
      CHECK(k < 1e-3, "KL %g", k);
    }
    CHECK(fixed_same, "the logits differ where the states are equal");
    CHECK(h_argmax(got, e->n_vocab) == h_argmax(ref, e->n_vocab), "argmax changed");
    free(fresh);
    kvi_store_destroy(store);
  }
  free(table);
  free(hstate);
  free(fstate);
  free(shifted);
  free(ref);
  free(got);
}

/* ---- negative controls and tenants ---------------------------------------- */

static void test_controls(h_engine *e, const seqs *s, const kvi_model *m) {
  float *ref = malloc((size_t)e->n_vocab * sizeof(float)), *got = malloc((size_t)e->n_vocab * sizeof(float));
  float *other = malloc((size_t)e->n_vocab * sizeof(float));
  prefill_context(e, s);
  size_t sz;
  uint8_t *st = h_get_state(e, 0, &sz);
  h_decode(e, s->question, s->n_question, s->n_all, 0, ref);

  kvi_store *store = h_store(m, KVI_DTYPE_FP32);
  /* tenant 1: header and facts as llama.cpp computed them; tenant 2: the same
   * ids holding the facts in reverse order */
  uint64_t ids[1 + NF];
  int32_t first = 0, firsts[1 + NF], lens[1 + NF];
  for (int i = 0; i <= NF; i++) {
    lens[i] = i == 0 ? s->n_header : s->n_fact[i - 1];
    firsts[i] = first;
    ids[i] = 10 + (uint64_t)i;
    h_capture(store, st, sz, m, 1, ids[i], first, lens[i], NULL);
    first += lens[i];
  }
  h_capture(store, st, sz, m, 2, ids[0], firsts[0], lens[0], NULL);
  for (int i = 1; i <= NF; i++) h_capture(store, st, sz, m, 2, ids[i], firsts[NF + 1 - i], lens[NF + 1 - i], NULL);

  size_t fsz;
  uint8_t *fresh = h_fresh_state(m, s->n_all, KVI_DTYPE_FP16, &fsz);
  KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 1, ids, 1 + NF, 0, NULL, 0));
  answer_from(e, s, fresh, fsz, s->n_all, got);
  const double d_ok = kl(ref, got, e->n_vocab);

  /* zeros in the facts' cells */
  free(fresh);
  fresh = h_fresh_state(m, s->n_all, KVI_DTYPE_FP16, &fsz);
  KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 1, ids, 1, 0, NULL, 0));
  answer_from(e, s, fresh, fsz, s->n_all, other);
  const double d_zero = kl(ref, other, e->n_vocab);
  free(fresh);

  /* facts rotated at positions 40 past their cells */
  fresh = h_fresh_state(m, s->n_all, KVI_DTYPE_FP16, &fsz);
  KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 1, ids, 1, 0, NULL, 0));
  KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 1, ids + 1, NF, s->n_header, NULL, s->n_header + 40));
  answer_from(e, s, fresh, fsz, s->n_all, other);
  const double d_pos = kl(ref, other, e->n_vocab);
  free(fresh);

  /* tenant 2's facts (another order): its own answer, not tenant 1's */
  fresh = h_fresh_state(m, s->n_all, KVI_DTYPE_FP16, &fsz);
  int32_t p2[256];
  int32_t k = 0;
  for (int i = 0; i <= NF; i++) {
    const int src = i == 0 ? 0 : NF + 1 - i;
    for (int32_t t = 0; t < lens[src]; t++, k++) p2[k] = k;
  }
  KVI_OK_OR_DIE(h_inject(store, fresh, fsz, m, 2, ids, 1 + NF, 0, p2, 0));
  answer_from(e, s, fresh, fsz, s->n_all, other);
  const double d_tenant = kl(ref, other, e->n_vocab);
  free(fresh);

  /* an id tenant 2 does not have */
  const uint64_t foreign = 999;
  h_capture(store, st, sz, m, 1, foreign, 0, 4, NULL);
  fresh = h_fresh_state(m, s->n_all, KVI_DTYPE_FP16, &fsz);
  uint8_t *copy = malloc(fsz);
  memcpy(copy, fresh, fsz);
  const kvi_status nf = h_inject(store, fresh, fsz, m, 2, &foreign, 1, 0, NULL, 0);
  CHECK(nf == KVI_ERR_NOT_FOUND, "tenant 2 injecting tenant 1's fact: status %d", (int)nf);
  CHECK(memcmp(copy, fresh, fsz) == 0, "a failed injection wrote into the state");
  free(copy);
  free(fresh);

  printf("controls: injected %.3g; zeroed facts %.3g; facts at wrong positions %.3g; the other tenant's facts %.3g "
         "(KL in nats from llama.cpp's own state's next-token distribution)\n",
         d_ok, d_zero, d_pos, d_tenant);
  CHECK(d_ok < 1e-3, "the injected state is %g nats away", d_ok);
  CHECK(d_zero > 100 * d_ok + 1e-2, "zeroed facts are only %g nats away", d_zero);
  CHECK(d_pos > 100 * d_ok + 1e-2, "facts at wrong positions are only %g nats away", d_pos);
  CHECK(d_tenant > 100 * d_ok + 1e-2, "tenant 2's facts are only %g nats away", d_tenant);
  kvi_store_destroy(store);
  free(st);
  free(ref);
  free(got);
  free(other);
}

/* ---- formats -------------------------------------------------------------- */

static void expect(kvi_status got, kvi_status want, const char *what) {
  CHECK(got == want, "%s: status %d (%s), expected %d", what, (int)got, kvi_last_error(), (int)want);
  if (got == want) printf("formats: %s -> %s\n", what, kvi_last_error());
}

static void test_formats(struct llama_model *lm, const seqs *s, const kvi_model *m) {
  h_engine e;
  size_t sz;
  uint8_t *st;
  kvi_llama_state_info info = KVI_LLAMA_STATE_INFO_INIT;
  kvi_cache_layout cl;
  /* f32 and bf16 caches: parsed with their dtype; a fresh state is accepted */
  const enum ggml_type types[2] = {GGML_TYPE_F32, GGML_TYPE_BF16};
  const kvi_dtype dts[2] = {KVI_DTYPE_FP32, KVI_DTYPE_BF16};
  for (int i = 0; i < 2; i++) {
    h_open(&e, lm, 1, types[i]);
    prefill_context(&e, s);
    st = h_get_state(&e, 0, &sz);
    KVI_OK_OR_DIE(kvi_llama_state_parse(st, sz, &info));
    CHECK(info.sections[0].dtype == dts[i], "dtype %d, expected %d", (int)info.sections[0].dtype, (int)dts[i]);
    size_t fsz;
    uint8_t *fresh = h_fresh_state(m, s->n_all, dts[i], &fsz);
    CHECK(fsz == sz, "fresh %s state %zu bytes, llama.cpp's %zu", i ? "bf16" : "f32", fsz, sz);
    CHECK(llama_state_seq_set_data(e.ctx, fresh, fsz, 0) == fsz, "llama.cpp refused a fresh state");
    free(fresh);
    free(st);
    h_close(&e);
  }

  /* a quantized cache (q8_0) is refused clearly */
  h_open(&e, lm, 1, GGML_TYPE_Q8_0);
  prefill_context(&e, s);
  st = h_get_state(&e, 0, &sz);
  expect(kvi_llama_state_parse(st, sz, &info), KVI_ERR_UNSUPPORTED, "q8_0 cache");
  free(st);
  h_close(&e);

  /* damaged f16 states */
  h_open(&e, lm, 1, GGML_TYPE_F16);
  prefill_context(&e, s);
  st = h_get_state(&e, 0, &sz);
  uint8_t *bad = malloc(sz + 4);
  memcpy(bad, st, sz);
  bad[0] ^= 1;
  expect(kvi_llama_state_parse(bad, sz, &info), KVI_ERR_CORRUPT, "wrong magic");
  bad[0] ^= 1;
  expect(kvi_llama_state_parse(bad, sz - 1, &info), KVI_ERR_CORRUPT, "truncated by one byte");
  memset(bad + sz, 0, 4);
  expect(kvi_llama_state_parse(bad, sz + 4, &info), KVI_ERR_CORRUPT, "four trailing zero bytes");
  {
    /* layer count one less: the data no longer adds up */
    const size_t at = 16 + 12 * (size_t)s->n_all + 4; /* magic, seq, streams, cells; cells; v_trans */
    uint32_t L;
    memcpy(&L, bad + at, 4);
    L--;
    memcpy(bad + at, &L, 4);
    expect(kvi_llama_state_parse(bad, sz, &info), KVI_ERR_CORRUPT, "layer count 29 in a 30-layer state");
    memcpy(bad, st, sz);
    /* the row size of layer 3's K doubled */
    const size_t k3 = at + 4 + 3 * (12 + (size_t)s->n_all * (size_t)e.n_head_kv * e.head_size * 2) + 4;
    uint64_t rb;
    memcpy(&rb, bad + k3, 8);
    rb *= 2;
    memcpy(bad + k3, &rb, 8);
    expect(kvi_llama_state_parse(bad, sz, &info), KVI_ERR_UNSUPPORTED, "layer 3 K rows of twice the size");
    memcpy(bad, st, sz);
  }
  /* a model of another geometry */
  {
    kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
    mo.num_layers = e.n_layer - 1;
    mo.num_kv_heads = e.n_head_kv;
    mo.head_size = e.head_size;
    kvi_model *wrong;
    KVI_OK_OR_DIE(kvi_model_create(&wrong, &mo));
    expect(kvi_llama_state_layout(st, sz, 0, wrong, KVI_MEMORY_HOST, &cl), KVI_ERR_MISMATCH, "a 29-layer model");
    kvi_model_destroy(wrong);
    mo.num_layers = e.n_layer;
    mo.num_kv_heads = e.n_head_kv * 2;
    KVI_OK_OR_DIE(kvi_model_create(&wrong, &mo));
    expect(kvi_llama_state_layout(st, sz, 0, wrong, KVI_MEMORY_HOST, &cl), KVI_ERR_MISMATCH, "a model of 6 KV heads");
    kvi_model_destroy(wrong);
  }
  /* a fresh state for a model with another layer count is refused by llama.cpp:
   * the library's size and header agree with llama.cpp only for its geometry */
  free(bad);
  free(st);
  h_close(&e);
}

int main(void) {
  struct llama_model *lm = h_load_model();
  h_engine e;
  h_open(&e, lm, 1, GGML_TYPE_F16);
  seqs s;
  tokenize_all(&e, &s);
  printf("SmolLM2: %d layers, %d KV heads x %d, rope type %d, n_rot %d, freq_base %g; header %d tokens, facts %d, "
         "%d, %d, question %d\n",
         e.n_layer, e.n_head_kv, e.head_size, (int)e.rope_type, e.n_rot, (double)e.freq_base, s.n_header, s.n_fact[0],
         s.n_fact[1], s.n_fact[2], s.n_question);
  kvi_model *m = h_kvi_model(&e, 1024);
  test_exact_context(&e, &s, m);
  test_k_shift(&e, &s, m);
  test_controls(&e, &s, m);
  h_close(&e);
  h_open(&e, lm, 0, GGML_TYPE_F16); /* no flash attention: V transposed in the state */
  test_exact_context(&e, &s, m);
  h_close(&e);
  h_open(&e, lm, 1, GGML_TYPE_BF16);
  test_exact_context(&e, &s, m);
  h_close(&e);
  h_open(&e, lm, 1, GGML_TYPE_F32);
  test_exact_context(&e, &s, m);
  h_close(&e);
  test_formats(lm, &s, m);
  kvi_model_destroy(m);
  llama_model_free(lm);
  llama_backend_free();
  if (h_failures) {
    fprintf(stderr, "%d checks failed\n", h_failures);
    return 1;
  }
  printf("all checks passed\n");
  return 0;
}
