/*
 * fp8_error — the error of fp8 e4m3 and 4-bit fact storage on K/V shaped like
 * an LLM's, and what the scale granularity buys. CPU only; prints a Markdown
 * table.
 *
 * Data (Llama-3.1-8B geometry: 32 layers, 8 KV heads, head size 128; facts of
 * 24 tokens; fixed seed): pre-RoPE keys have per-channel magnitudes — a
 * log-normal spread across channels, and 4 outlier channels per head 10-50x
 * the median (the pattern reported for LLM keys, which is why keys quantize
 * worse than values) — times per-token noise; the first token of each fact
 * is a large-norm "sink" token (4x). Values are Gaussian with a per-head
 * scale and rare (1/64) per-token outliers of 8x. The second table adds
 * bias channels to the keys, as Qwen2.5-1.5B has them (layer 0, channel 63:
 * mean about 358, standard deviation 1.06): in every (layer, head) one
 * channel of mean 358 and standard deviation 1.06 and two of means drawn in
 * +-(10 .. 60), standard deviation 1. fp8 keys keep one offset per channel
 * and page (kvinject/store.h, "fp8 storage"), which takes such a bias out.
 *
 * For each layout the facts are put into a CPU store and read back as fp32:
 *   bf16            reference: bf16 storage
 *   fp8, P tokens   one scale per (page of P tokens, layer, K/V, head): the
 *                   library's granularity at page_tokens = P
 *   fp8, per fact   page_tokens >= the fact: one scale per (fact, layer,
 *                   K/V, head), the coarsest choice
 *   q4, P tokens    KVI_DTYPE_Q4: keys per channel over a page of P tokens,
 *                   values per token (kvinject/store.h, "4-bit storage")
 *   sim Kb/Vb ...   no store: the same grouping and rounding computed here in
 *                   float64 with b-bit codes (2^b - 1 steps between a group's
 *                   minimum and maximum; scales and minima kept exact), to
 *                   show what 2 bits for keys or values cost, and value
 *                   groups narrower than a head (vG: G channels); KiB/fact
 *                   counts codes and 4 bytes (fp16 scale and minimum) per
 *                   group as a store would
 * and the relative Frobenius error ||x - x'|| / ||x|| is reported for K and
 * V over everything, and the worst over (fact, layer, head); for K also
 * against the keys' variation, ||x - x'|| / ||x - c|| with c each channel's
 * mean over the fact (what attention logits see of a bias is constant over
 * the keys: the variation is what matters), and on the bias channels the
 * RMS error over their standard deviation and the largest |x - x'|. The
 * third table drops the outlier channels and the sink token, so that the
 * 358 channel alone sets its head's range (as in Qwen2.5-1.5B's layer 0).
 *
 * SPDX-License-Identifier: Apache-2.0
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <kvinject.h>

enum { L = 32, H = 8, D = 128, T = 24, FACTS = 16 };

static uint64_t g_s = 0x2545f4914f6cdd1dull;
static double unif(void) { /* xorshift64*, (0, 1) */
  g_s ^= g_s >> 12, g_s ^= g_s << 25, g_s ^= g_s >> 27;
  return ((double)((g_s * 0x2545f4914f6cdd1dull) >> 11) + 0.5) * 0x1p-53;
}
static double gauss(void) { return sqrt(-2.0 * log(unif())) * cos(6.283185307179586 * unif()); }

#define IDX(l, t, h, d) ((((size_t)(l) * T + (t)) * H + (h)) * D + (d))

static int g_bias; /* 1: keys with bias channels (the second table); 2: and without outlier channels (the third) */
/* The bias channels' own draws (xorshift64*, [0, 1)), so that the first
 * table's data stay those of the tables before it had bias channels. */
static uint64_t g_b = 0x9e3779b97f4a7c15ull;
static double bunif(void) {
  g_b ^= g_b >> 12, g_b ^= g_b << 25, g_b ^= g_b >> 27;
  return (double)((g_b * 0x2545f4914f6cdd1dull) >> 11) * 0x1p-53;
}

/* Per (layer, head, channel): key magnitude with and without the outliers,
 * bias channels' mean and standard deviation (0: not a bias channel). */
static double g_chan[L][H][D], g_base[L][H][D], g_bias_mean[L][H][D], g_bias_std[L][H][D], g_vsc[L][H];

static void make_fact(float *k, float *v) {
  static int init;
  if (!init) { /* per-channel key magnitudes and biases, fixed across facts as in a model */
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++) {
        for (int d = 0; d < D; d++) g_chan[l][h][d] = g_base[l][h][d] = exp(0.5 * gauss());
        for (int o = 0; o < 4; o++) g_chan[l][h][(int)(unif() * D)] *= 10.0 + 40.0 * unif();
        g_vsc[l][h] = 0.3 * exp(0.5 * gauss());
        const int b0 = 63 % D; /* Qwen2.5-1.5B's layer 0 channel 63: 358, std 1.06 */
        g_bias_mean[l][h][b0] = 358.0, g_bias_std[l][h][b0] = 1.06;
        for (int o = 0; o < 2; o++) {
          const int d = (b0 + 1 + (int)(bunif() * (D - 1))) % D;
          g_bias_mean[l][h][d] = (bunif() < 0.5 ? -1.0 : 1.0) * (10.0 + 50.0 * bunif()), g_bias_std[l][h][d] = 1.0;
        }
      }
    init = 1;
  }
  for (int l = 0; l < L; l++)
    for (int t = 0; t < T; t++)
      for (int h = 0; h < H; h++) {
        const double sink = t == 0 && g_bias < 2 ? 4.0 : 1.0, vout = unif() < 1.0 / 64 ? 8.0 : 1.0;
        for (int d = 0; d < D; d++) {
          const double g = gauss(), bs = g_bias ? g_bias_std[l][h][d] : 0.0;
          k[IDX(l, t, h, d)] = (float)(bs > 0 ? g_bias_mean[l][h][d] + bs * g
                                              : sink * (g_bias == 2 ? g_base : g_chan)[l][h][d] * g);
          v[IDX(l, t, h, d)] = (float)(vout * g_vsc[l][h] * gauss());
        }
      }
}

static int run(kvi_model *m, kvi_dtype dt, int32_t P, float *const *ks, float *const *vs, float *rk, float *rv,
               const char *name) {
  kvi_store_options o = KVI_STORE_OPTIONS_INIT;
  o.backend = KVI_BACKEND_CPU;
  o.dtype = dt;
  o.page_tokens = P;
  o.budget_bytes = 2048ull << 20;
  kvi_store *s;
  if (kvi_store_create(&s, m, &o) != KVI_OK) {
    fprintf(stderr, "%s\n", kvi_last_error());
    return 1;
  }
  double num[2] = {0, 0}, den[2] = {0, 0}, worst[2] = {0, 0}, cden = 0, bsq = 0, bn = 0, bmax = 0;
  for (int f = 0; f < FACTS; f++) {
    kvi_kv_view v;
    kvi_kv_view_contiguous(&v, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, ks[f], vs[f]);
    kvi_kv_view r;
    kvi_kv_view_contiguous(&r, KVI_MEMORY_HOST, KVI_DTYPE_FP32, L, T, H, D, rk, rv);
    if (kvi_store_put(s, 0, (uint64_t)f, &v, NULL, NULL) || kvi_store_read(s, 0, (uint64_t)f, &r, NULL)) {
      fprintf(stderr, "%s\n", kvi_last_error());
      return 1;
    }
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++)
        for (int kv = 0; kv < 2; kv++) {
          const float *x = kv ? vs[f] : ks[f], *y = kv ? rv : rk;
          double n = 0, dd = 0;
          for (int t = 0; t < T; t++)
            for (int d = 0; d < D; d++) {
              const double e = (double)y[IDX(l, t, h, d)] - x[IDX(l, t, h, d)];
              n += e * e, dd += (double)x[IDX(l, t, h, d)] * x[IDX(l, t, h, d)];
            }
          num[kv] += n, den[kv] += dd;
          if (sqrt(n / dd) > worst[kv]) worst[kv] = sqrt(n / dd);
          for (int d = 0; kv == 0 && d < D; d++) { /* K: against the channel's variation over the fact */
            double c = 0;
            for (int t = 0; t < T; t++) c += x[IDX(l, t, h, d)];
            c /= T;
            for (int t = 0; t < T; t++) {
              const double xc = x[IDX(l, t, h, d)] - c, e = fabs((double)y[IDX(l, t, h, d)] - x[IDX(l, t, h, d)]);
              cden += xc * xc;
              if (g_bias && g_bias_std[l][h][d] > 0) { /* a bias channel: its error against its std */
                bsq += (e / g_bias_std[l][h][d]) * (e / g_bias_std[l][h][d]), bn += 1;
                if (e > bmax) bmax = e;
              }
            }
          }
        }
  }
  kvi_store_stats st = KVI_STORE_STATS_INIT;
  kvi_store_stats_get(s, &st);
  char b1[16] = "", b2[16] = "";
  if (bn > 0) snprintf(b1, sizeof b1, "%.4f", sqrt(bsq / bn)), snprintf(b2, sizeof b2, "%.4f", bmax);
  printf("| %-19s | %10.5f | %10.5f | %10.5f | %10s | %10s | %10.5f | %10.5f | %9.1f |\n", name, sqrt(num[0] / den[0]),
         worst[0], sqrt(num[0] / cden), b1, b2, sqrt(num[1] / den[1]), worst[1], (double)st.bytes_used / FACTS / 1024.0);
  kvi_store_destroy(s);
  return 0;
}

/* b-bit codes over [lo, hi] in float64: the value a code gives back. */
static double sim_q(double x, double lo, double hi, int bits) {
  const double steps = (double)((1 << bits) - 1), sc = (hi - lo) / steps;
  if (sc == 0.0) return lo;
  double q = rint((x - lo) / sc);
  q = q < 0 ? 0 : q > steps ? steps : q;
  return lo + q * sc;
}

/* sim rows: K b_k bits per channel over P-token pages, V b_v bits per token
 * in groups of vg channels. */
static void sim(int bk, int bv, int32_t P, int vg, float *const *ks, float *const *vs, const char *name) {
  double num[2] = {0, 0}, den[2] = {0, 0}, worst[2] = {0, 0};
  for (int f = 0; f < FACTS; f++)
    for (int l = 0; l < L; l++)
      for (int h = 0; h < H; h++) {
        double n[2] = {0, 0}, dd[2] = {0, 0};
        for (int t0 = 0; t0 < T; t0 += P) {
          const int nt = T - t0 < P ? T - t0 : P;
          for (int d = 0; d < D; d++) { /* K: channel d over the page */
            double lo = INFINITY, hi = -INFINITY;
            for (int t = t0; t < t0 + nt; t++) lo = fmin(lo, ks[f][IDX(l, t, h, d)]), hi = fmax(hi, ks[f][IDX(l, t, h, d)]);
            for (int t = t0; t < t0 + nt; t++) {
              const double x = ks[f][IDX(l, t, h, d)], e = sim_q(x, lo, hi, bk) - x;
              n[0] += e * e, dd[0] += x * x;
            }
          }
        }
        for (int t = 0; t < T; t++) /* V: groups of vg channels of a token */
          for (int d0 = 0; d0 < D; d0 += vg) {
            double lo = INFINITY, hi = -INFINITY;
            for (int d = d0; d < d0 + vg; d++) lo = fmin(lo, vs[f][IDX(l, t, h, d)]), hi = fmax(hi, vs[f][IDX(l, t, h, d)]);
            for (int d = d0; d < d0 + vg; d++) {
              const double x = vs[f][IDX(l, t, h, d)], e = sim_q(x, lo, hi, bv) - x;
              n[1] += e * e, dd[1] += x * x;
            }
          }
        for (int kv = 0; kv < 2; kv++) {
          num[kv] += n[kv], den[kv] += dd[kv];
          if (sqrt(n[kv] / dd[kv]) > worst[kv]) worst[kv] = sqrt(n[kv] / dd[kv]);
        }
      }
  const double pages = (double)((T + P - 1) / P);
  const double bytes = pages * (double)L * H * ((double)P * D * (bk + bv) / 8.0 + 4.0 * D + 4.0 * P * (D / vg));
  printf("| %-19s | %10.5f | %10.5f | %10s | %10s | %10s | %10.5f | %10.5f | %9.1f |\n", name, sqrt(num[0] / den[0]),
         worst[0], "", "", "", sqrt(num[1] / den[1]), worst[1], bytes / 1024.0);
}

int main(void) {
  kvi_model_options mo = KVI_MODEL_OPTIONS_INIT;
  mo.num_layers = L, mo.num_kv_heads = H, mo.head_size = D;
  kvi_model *m;
  if (kvi_model_create(&m, &mo) != KVI_OK) return 1;
  const size_t n = (size_t)L * T * H * D;
  float *ks[FACTS], *vs[FACTS], *rk = malloc(n * 4), *rv = malloc(n * 4);
  for (int f = 0; f < FACTS; f++) {
    ks[f] = malloc(n * 4), vs[f] = malloc(n * 4);
    if (!ks[f] || !vs[f]) return 1;
  }
  int bad = 0;
  static const char *const what[3] = {"", ", keys with bias channels (358 +- 1.06, two of +-10..60)",
                                       ", keys with bias channels and no outlier channels or sink"};
  for (g_bias = 0; g_bias < 3; g_bias++) {
    for (int f = 0; f < FACTS; f++) make_fact(ks[f], vs[f]);
    printf("%sfp8 e4m3 and 4-bit storage error, %d facts of %d tokens, %d layers x %d KV heads x %d (relative Frobenius)%s\n\n",
           g_bias ? "\n" : "", FACTS, T, L, H, D, what[g_bias]);
    printf("| storage             | K overall  | K worst head | K/centered | bias ch. RMS/std | bias ch. max | V overall | "
           "V worst head | KiB/fact |\n");
    printf("|---------------------|------------|------------|------------|------------|------------|------------|------------|"
           "-----------|\n");
    bad |= run(m, KVI_DTYPE_BF16, 16, ks, vs, rk, rv, "bf16");
    bad |= run(m, KVI_DTYPE_FP8_E4M3, 4, ks, vs, rk, rv, "fp8, 4-token pages");
    bad |= run(m, KVI_DTYPE_FP8_E4M3, 8, ks, vs, rk, rv, "fp8, 8-token pages");
    bad |= run(m, KVI_DTYPE_FP8_E4M3, 16, ks, vs, rk, rv, "fp8, 16-token pages");
    bad |= run(m, KVI_DTYPE_FP8_E4M3, T, ks, vs, rk, rv, "fp8, per fact");
    bad |= run(m, KVI_DTYPE_Q4, 4, ks, vs, rk, rv, "q4, 4-token pages");
    bad |= run(m, KVI_DTYPE_Q4, 8, ks, vs, rk, rv, "q4, 8-token pages");
    bad |= run(m, KVI_DTYPE_Q4, 16, ks, vs, rk, rv, "q4, 16-token pages");
    bad |= run(m, KVI_DTYPE_Q4, T, ks, vs, rk, rv, "q4, per fact");
    if (g_bias) continue;
    sim(4, 4, T, D, ks, vs, "sim K4/V4");
    sim(4, 4, T, 32, ks, vs, "sim K4/V4 v32");
    sim(4, 2, T, D, ks, vs, "sim K4/V2");
    sim(4, 2, T, 32, ks, vs, "sim K4/V2 v32");
    sim(2, 4, T, D, ks, vs, "sim K2/V4");
    sim(2, 2, T, D, ks, vs, "sim K2/V2");
    sim(2, 2, 8, 32, ks, vs, "sim K2/V2 P8 v32");
  }
  for (int f = 0; f < FACTS; f++) free(ks[f]), free(vs[f]);
  free(rk);
  free(rv);
  kvi_model_destroy(m);
  return bad;
}
