/*
 * libkvinject — 4-bit pages in the fused injection / capture kernel
 * (transfer_kernels.cu includes this inside its anonymous namespace, after
 * the context, the rotation and the cache vector helpers it uses).
 * SPDX-License-Identifier: Apache-2.0
 */
/* ---- 4-bit pages (base/q4.h) ------------------------------------------------
 *
 * Injection's thread mapping. A layer's elements are cut into chunks of W consecutive
 * columns of one (plane, head) — W = 8 (one 32-bit word of codes) when the
 * host allows vectors (E 8: D % 8 == 0, rotated widths multiples of 16,
 * contiguous and aligned cache rows), else W = 2 (one byte of codes) — and
 * the segment's tokens into slices of Q4Item::TS (16). An item is (slice, head, chunk)
 * of K (inject: then the same of V), numbered chunk fastest, then head, then
 * slice; thread t takes items t, t + THREADS, ... So a thread's columns stay
 * fixed while it walks its slice's tokens: it loads its key channels' words
 * (s, m) once per item into registers (their codes' groups are the
 * channels), a value token's word once per token (its row is the group), and
 * a warp covers whole head rows of one token (consecutive bytes in both the
 * page and the cache). Within an item the tokens go in batches of BT whose
 * loads are all issued before any is used.
 *
 * Rotation. An element of K's rotated columns [0, 2 half) needs its pair's
 * other element (NeoX: d +- half, GPT-J: d ^ 1). GPT-J pairs lie inside a
 * chunk (d0 and W even). NeoX partners form the chunk at d0 +- half: with
 * W = 8 that is one more word of codes (half % 8 == 0, so a chunk is all
 * first or all second elements of its pairs), with W = 2 two nibbles, each
 * partner found on its own (half may be odd). Each element is rotated on
 * its own with the pair's arithmetic for that element (q4_rot): the same
 * operations, in the same order, as rotate() and the CPU reference. A chunk
 * never straddles 2 half (it is even, and a multiple of 16 with W = 8).
 *
 * Capture maps keys otherwise (q4_capture_keys): a thread owns a unit
 * (head, chunk) for all the segment's tokens (a slice of them when there
 * are fewer units than threads, merged through shared memory), so a key
 * channel's bounds are reduced to fp32 (min, max) in registers, no atomics.
 * A page that one segment covers (the plan's usual case: facts no longer
 * than a segment) is captured whole in one launch, phase 1: the channels'
 * parameter words, then the codes (the keys read again, from L1 or L2),
 * then the values; the host launches phase 1 alone when every page of a
 * plan is such a page. A page split over segments takes the phases
 * (kvi__xfer_args.phase): 0 empty bounds, 1 each segment's bounds folded
 * into the channels' words with one compare-and-swap per channel (folding
 * commutes, and folding a group's min and max gives the word folding all
 * of it gives: kvi__q4_bounds), 2 the key codes from the parameters the
 * merged bounds give and the values, 3 the parameter words. Values go a
 * row per group of G lanes of a warp (G the power of two >= the row's
 * chunks, at most 32), min and max reduced with shuffles, then the row's
 * word and codes. min and max are exact, so every order gives the CPU's
 * bounds; the rest is base/q4.h's arithmetic. */

/* A word's (scale, minimum) as floats: fp16 -> fp32 is exact (NaN payloads
 * aside, which any fmaf with them makes the canonical NaN anyway). (The
 * helpers are templates so that the other pairs' units, which leave them
 * unused, do not warn.) */
template <int = 0> __device__ inline float2 q4_sm(uint32_t w) {
  __half2 h;
  memcpy(&h, &w, 4);
  return __half22float2(h); /* .x: the low half (scale), .y: the high half (minimum) */
}

/* Code i of a word of codes, decoded: fmaf(code, s, m) as kvi__q4_value. */
template <int = 0> __device__ inline float q4_val(uint32_t codes, int i, float2 sm) {
  const float c = __fsub_rn(__uint_as_float(0x4b000000u | ((codes >> (4 * i)) & 15u)), 8388608.0f); /* exact */
  return __fmaf_rn(c, sm.x, sm.y);
}

/* The nibble of element e. */
template <int = 0> __device__ inline uint32_t q4_nib(const uint8_t *pg, int64_t e) {
  return (uint32_t)(pg[e >> 1] >> (4 * (unsigned)(e & 1))) & 15u;
}

/* W codes from element e (W == 8: e % 8 == 0, a 4-byte word; W == 2: e even, a byte). */
template <int W> __device__ inline uint32_t q4_ld(const uint8_t *pg, int64_t e) {
  if constexpr (W == 8) return *reinterpret_cast<const uint32_t *>(pg + (e >> 1));
  else return pg[e >> 1];
}
template <int W> __device__ inline void q4_st(uint8_t *pg, int64_t e, uint32_t c) {
  if constexpr (W == 8) *reinterpret_cast<uint32_t *>(pg + (e >> 1)) = c;
  else pg[e >> 1] = (uint8_t)c;
}

/* W consecutive words (W == 8: 32-byte aligned) as (s, m). */
template <int W> __device__ inline void q4_words(float2 *sm, const uint32_t *w) {
  if constexpr (W == 8) {
    const uint4 a = reinterpret_cast<const uint4 *>(w)[0], b = reinterpret_cast<const uint4 *>(w)[1];
    sm[0] = q4_sm(a.x), sm[1] = q4_sm(a.y), sm[2] = q4_sm(a.z), sm[3] = q4_sm(a.w);
    sm[4] = q4_sm(b.x), sm[5] = q4_sm(b.y), sm[6] = q4_sm(b.z), sm[7] = q4_sm(b.w);
  } else {
#pragma unroll
    for (int i = 0; i < W; i++) sm[i] = q4_sm(w[i]);
  }
}

/* Cache elements of a chunk (E == W: one vector; else W elements ds apart). */
template <typename C, int E, int W> __device__ inline void q4_ld_cache(Vec<C, W> &r, const C *p, int64_t ds) {
  if constexpr (E == W) ld<C, W>(r, p);
  else
#pragma unroll
    for (int i = 0; i < W; i++) r.v[i] = p[i * ds];
}
template <typename C, int E, int W> __device__ inline void q4_st_cache(C *p, int64_t ds, const float *v) {
  if constexpr (E == W) st<C, W>(p, v);
  else
#pragma unroll
    for (int i = 0; i < W; i++) st<C, 1>(p + i * ds, v + i);
}

/* Element own of a pair rotated forward (inject) or back (capture) with its
 * pair's other element p: rotate()'s operations for that element. */
template <bool FORWARD> __device__ inline float q4_rot(float own, float p, float2 cs, bool first) {
  const float t = __fmul_rn(own, cs.x), u = __fmul_rn(p, cs.y);
  return FORWARD == first ? __fsub_rn(t, u) : __fadd_rn(t, u);
}

/* A K chunk's place in the rotation (columns d0 .. d0 + W): whether it is
 * rotated (d0 < 2 half), and of its element i whether it is the first of its
 * pair, the pair (cos/sin column) and the partner's column. With W == 8 or
 * 16 (the vector paths: half % W == 0) a NeoX chunk is all first or all
 * second elements, so its pairs and partners are consecutive: they follow
 * from element 0's. */
template <int W, bool NEOX> struct Q4Pairs {
  unsigned d0, half;
  bool on;
  __device__ Q4Pairs(unsigned d, unsigned hf) : d0(d), half(hf), on(d < 2 * hf) {}
  __device__ bool first(int i) const {
    if constexpr (NEOX) return (W % 8 == 0 ? d0 : d0 + i) < half;
    else return (i & 1) == 0; /* d0 even */
  }
  __device__ unsigned k(int i) const {
    const unsigned d = d0 + i;
    if constexpr (NEOX) return first(i) ? d : d - half;
    else return d >> 1;
  }
  __device__ unsigned p(int i) const {
    const unsigned d = d0 + i;
    if constexpr (NEOX) return first(i) ? d + half : d - half;
    else return d ^ 1;
  }
};

/* The NeoX partners' codes of a chunk in row e0 (element offset of column 0). */
template <int W, bool NEOX>
__device__ inline uint32_t q4_partner_codes(const Q4Pairs<W, NEOX> &g, const uint8_t *pg, int64_t e0) {
  if constexpr (W == 8) return q4_ld<8>(pg, e0 + g.p(0)); /* p(i) == p(0) + i */
  else return q4_nib(pg, e0 + g.p(0)) | q4_nib(pg, e0 + g.p(1)) << 4;
}

/* An item's coordinates (see the mapping above). */
struct Q4Item {
  enum : unsigned { TS = 16 }; /* tokens per item */
  unsigned kv, h, d0, j0, j1;
};
template <int = 0>
__device__ inline Q4Item q4_item(unsigned it, unsigned nk, unsigned units, unsigned nch, unsigned W, unsigned ntok) {
  Q4Item q;
  q.kv = it >= nk ? 1u : 0u;
  const unsigned r = it - q.kv * nk, sl = r / units, un = r - sl * units;
  q.h = un / nch;
  q.d0 = (un - q.h * nch) * W;
  q.j0 = sl * Q4Item::TS;
  q.j1 = min(q.j0 + Q4Item::TS, ntok);
  return q;
}

/* One layer injected from a 4-bit page: K's items, then V's. */
template <typename C, int E, bool NEOX>
__device__ inline void q4_inject(const Ctx &x, const kvi__xfer_args &a, const uint8_t *pg, int l, unsigned rot, C *kc,
                                 C *vc, const float *ks, const float *vs, const int64_t *s_coff, unsigned tok0) {
  constexpr int W = E == 1 ? 2 : E, BT = 8;
  const uint32_t *words = reinterpret_cast<const uint32_t *>(pg + a.scale_off);
  const unsigned H = x.H, D = x.D, half = rot >> 1, nch = D / W, units = H * nch;
  const unsigned nk = units * ((x.ntok + Q4Item::TS - 1) / Q4Item::TS);
  for (unsigned it = threadIdx.x; it < 2 * nk; it += THREADS) {
    const Q4Item q = q4_item(it, nk, units, nch, W, x.ntok);
    const Q4Pairs<W, NEOX> pr(q.d0, q.kv ? 0u : half);
    const uint32_t *kw = words + (int64_t)(l * H + q.h) * D;                                 /* [d] */
    const uint32_t *vw = words + (int64_t)a.L * H * D + (int64_t)(l * H + q.h) * a.P + tok0; /* [token] */
    const int64_t *coff = q.kv && a.split_v ? s_coff + a.seg_tokens : s_coff;
    const int64_t e0 = x.page_row0 + (int64_t)(q.kv * H + q.h) * x.page_head; /* the head's row of token 0 */
    const int64_t ds = q.kv ? a.v_dim_stride : a.dim_stride;
    C *cb = (q.kv ? vc : kc) + q.h * (q.kv ? a.v_head_stride : a.head_stride) + (int64_t)q.d0 * ds;
    const float sc = is_fp8<C>::value ? (q.kv ? vs : ks)[q.h] : 1.0f;
    float2 ow[W], pw[W]; /* K: the chunk's and (NeoX) its partners' words */
    if (!q.kv) {
      q4_words<W>(ow, kw + q.d0);
      if (NEOX && pr.on) {
        if constexpr (W == 8) q4_words<W>(pw, kw + pr.p(0));
        else
#pragma unroll
          for (int i = 0; i < W; i++) pw[i] = q4_sm(kw[pr.p(i)]);
      }
    }
    for (unsigned jb = q.j0; jb < q.j1; jb += BT) {
      uint32_t oc[BT], pc[BT];
      float2 tw[BT]; /* V: the token's word */
#pragma unroll
      for (int b = 0; b < BT; b++) {
        const unsigned j = jb + b;
        oc[b] = pc[b] = 0u;
        tw[b] = make_float2(0.0f, 0.0f);
        if (j >= q.j1 || coff[j] < 0) continue;
        const int64_t e = e0 + (int64_t)j * D;
        oc[b] = q4_ld<W>(pg, e + q.d0);
        if (q.kv) tw[b] = q4_sm(vw[j]);
        else if (NEOX && pr.on) pc[b] = q4_partner_codes(pr, pg, e);
      }
#pragma unroll
      for (int b = 0; b < BT; b++) {
        const unsigned j = jb + b;
        if (j >= q.j1) continue;
        const int64_t co = coff[j];
        if (co < 0) continue;
        float u[W], v[W];
#pragma unroll
        for (int i = 0; i < W; i++) u[i] = v[i] = q4_val(oc[b], i, q.kv ? tw[b] : ow[i]);
        if (pr.on) {
          const float2 *cs = x.cs + j * x.HM;
#pragma unroll
          for (int i = 0; i < W; i++)
            v[i] = q4_rot<true>(u[i], NEOX ? q4_val(pc[b], i, pw[i]) : u[i ^ 1], cs[pr.k(i)], pr.first(i));
        }
        scale_for_cache<C>(v, W, sc);
        q4_st_cache<C, E, W>(cb + co, ds, v);
      }
    }
  }
}

/* A group's walk over its R value rows in q4_capture_values (lane lg of G,
 * chunks c = lg, lg + G, ... of W columns): each chunk's R loads issued
 * before any is used, then each row that is on (cr[q]: its cache row)
 * converted to fp32 and taken from the cache's scale (sc[q]), handed to
 * use(q, c, f). The bounds pass and the codes pass both walk so. */
template <typename C, int E, int W, int R, typename F>
__device__ inline void q4_value_chunks(const kvi__xfer_args &a, const C *const *cr, const bool *on, const float *sc,
                                       unsigned lg, unsigned G, unsigned nch, F &&use) {
  for (unsigned c = lg; c < nch; c += G) {
    Vec<C, W> t[R];
#pragma unroll
    for (int q = 0; q < R; q++)
      if (on[q]) q4_ld_cache<C, E, W>(t[q], cr[q] + (int64_t)c * W * a.v_dim_stride, a.v_dim_stride);
#pragma unroll
    for (int q = 0; q < R; q++) {
      if (!on[q]) continue;
      float f[W];
      to_f32<C, W>(f, t[q]);
      scale_from_cache<C>(f, W, sc[q]);
      use(q, c, f);
    }
  }
}

/* Capture into a 4-bit page: the values, a row per group of G lanes, R rows
 * a group in flight (64 bytes a lane); a skipped token's word is zero. */
template <typename C, int E>
__device__ inline void q4_capture_values(const Ctx &x, const kvi__xfer_args &a, uint8_t *pg, int l, const C *vc,
                                         const float *vs, const int64_t *s_coff, unsigned tok0) {
  /* (the element-wise path, E 1, keeps 2: its loads are single elements anyway) */
  constexpr int W = E == 1 ? 2 : E, R0 = E == 1 ? 2 : 64 / (W * (int)sizeof(C)), R = R0 < 2 ? 2 : R0 > 4 ? 4 : R0;
  uint32_t *vw = reinterpret_cast<uint32_t *>(pg + a.scale_off) + (int64_t)a.L * x.H * x.D +
                 (int64_t)l * x.H * a.P + tok0; /* [head][token] */
  const int64_t *coff = a.split_v ? s_coff + a.seg_tokens : s_coff;
  const unsigned nch = x.D / W, rows = x.H * x.ntok;
  unsigned G = 1;
  while (G < nch && G < 32) G <<= 1;
  const unsigned lane = threadIdx.x & 31, lg = lane & (G - 1), rpw = 32 / G, step = (THREADS / 32) * rpw * R;
  /* (warp-uniform: every lane reaches the shuffles) */
  for (unsigned r0 = (threadIdx.x >> 5) * rpw * R + lane / G; r0 - lane / G < rows; r0 += step) {
    const C *cr[R];
    unsigned h[R], j[R];
    bool in[R], on[R];
    float mn[R], mx[R], sc[R];
#pragma unroll
    for (int q = 0; q < R; q++) {
      const unsigned r = r0 + q * rpw;
      h[q] = r < rows ? r / x.ntok : 0u;
      j[q] = r < rows ? r - h[q] * x.ntok : 0u;
      in[q] = r < rows;
      const int64_t co = in[q] ? coff[j[q]] : -1;
      on[q] = co >= 0;
      cr[q] = vc + (on[q] ? co : 0) + h[q] * a.v_head_stride;
      sc[q] = is_fp8<C>::value ? vs[h[q]] : 1.0f;
      mn[q] = INFINITY, mx[q] = -INFINITY;
    }
    q4_value_chunks<C, E, W, R>(a, cr, on, sc, lg, G, nch, [&](int q, unsigned, const float *f) {
#pragma unroll
      for (int i = 0; i < W; i++)
        if (f[i] - f[i] == 0.0f) mn[q] = fminf(mn[q], f[i]), mx[q] = fmaxf(mx[q], f[i]); /* finite only */
    });
#pragma unroll
    for (int q = 0; q < R; q++)
      for (unsigned o = G >> 1; o; o >>= 1) {
        mn[q] = fminf(mn[q], __shfl_xor_sync(0xffffffffu, mn[q], o));
        mx[q] = fmaxf(mx[q], __shfl_xor_sync(0xffffffffu, mx[q], o));
      }
    float2 sm[R];
    float rc[R];
#pragma unroll
    for (int q = 0; q < R; q++) {
      const uint32_t w = on[q] ? kvi__q4_params(kvi__q4_bounds(mn[q], mx[q])) : 0u;
      if (lg == 0 && in[q]) vw[(int64_t)h[q] * a.P + j[q]] = w;
      sm[q] = q4_sm(w);
      rc[q] = kvi__q4_rcp(sm[q].x);
    }
    /* the codes (the row again, from L1) */
    q4_value_chunks<C, E, W, R>(a, cr, on, sc, lg, G, nch, [&](int q, unsigned c, const float *f) {
      uint32_t codes = 0u;
#pragma unroll
      for (int i = 0; i < W; i++) codes |= kvi__q4_code_rcp(f[i], sm[q].x, sm[q].y, rc[q]) << (4 * i);
      q4_st<W>(pg, x.page_row0 + (int64_t)(x.H + h[q]) * x.page_head + (int64_t)j[q] * x.D + c * W, codes);
    });
  }
}

/* Folds N words in place: word i becomes want(i, current word), one
 * compare-and-swap per word, all in flight at once; a word that moved
 * meanwhile goes round again. want must be a fold (want(i, want(i, w)) ==
 * want(i, w), and folds of other threads commute with it). */
template <int N, typename F> __device__ inline void fold_words(uint32_t *w, F want) {
  uint32_t cur[N];
  unsigned todo = 0u;
#pragma unroll
  for (int i = 0; i < N; i++) cur[i] = __ldcg(w + i), todo |= 1u << i;
  while (todo) {
    uint32_t seen[N];
#pragma unroll
    for (int i = 0; i < N; i++) {
      seen[i] = cur[i];
      if (!(todo >> i & 1u)) continue;
      const uint32_t nw = want(i, cur[i]);
      if (nw == cur[i]) todo &= ~(1u << i);
      else cur[i] = atomicCAS(w + i, seen[i], nw);
    }
#pragma unroll
    for (int i = 0; i < N; i++)
      if ((todo >> i & 1u) && cur[i] == seen[i]) todo &= ~(1u << i); /* swapped */
  }
}

/* Shared memory where a unit's slices merge their bounds (key_bounds): one
 * array whatever the rotation style. */
template <int W> __device__ inline float2 *key_red() {
  __shared__ float2 red[W * THREADS];
  return red;
}

/* The keys of one unit (head h, chunk d0: W channels) over the segment's
 * tokens [j0, j1), read from the cache as the injection writes them (fp8
 * caches times their scale, un-rotated): their finite values' fp32 bounds
 * folded into mn, mx (BOUNDS), or their codes written with the channels'
 * (s, m) in sm and 1 / s in rc. Tokens go in batches of BT whose loads are all issued before
 * any is used (vectors: 128 bytes a thread in flight). */
template <typename C, int E, bool NEOX, bool BOUNDS>
__device__ inline void key_rows(const Ctx &x, const kvi__xfer_args &a, uint8_t *pg, unsigned half, const C *kc,
                                   float sc, const int64_t *s_coff, unsigned h, unsigned d0, unsigned j0, unsigned j1,
                                   float *mn, float *mx, const float2 *sm, const float *rc) {
  constexpr int W = E == 1 ? 2 : E;
  constexpr int BT0 = E == 1 ? 4 : 128 / (W * (int)sizeof(C) * (NEOX ? 2 : 1)), BT = BT0 < 2 ? 2 : BT0 > 8 ? 8 : BT0;
  const Q4Pairs<W, NEOX> pr(d0, half);
  const int64_t e0 = x.page_row0 + (int64_t)h * x.page_head + d0, ds = a.dim_stride;
  const C *hb = kc + h * a.head_stride; /* the head's row (plus a token's offset) */
  for (unsigned jb = j0; jb < j1; jb += BT) {
    Vec<C, W> o[BT], p[BT];
#pragma unroll
    for (int b = 0; b < BT; b++) {
      const unsigned j = jb + b;
      if (j >= j1 || s_coff[j] < 0) continue;
      const C *cr = hb + s_coff[j];
      q4_ld_cache<C, E, W>(o[b], cr + (int64_t)d0 * ds, ds);
      if (NEOX && pr.on) {
        if constexpr (W % 8 == 0) ld<C, W>(p[b], cr + pr.p(0)); /* p(i) == p(0) + i; ds == 1 */
        else
#pragma unroll
          for (int i = 0; i < W; i++) p[b].v[i] = cr[pr.p(i) * ds];
      }
    }
#pragma unroll
    for (int b = 0; b < BT; b++) {
      const unsigned j = jb + b;
      if (j >= j1 || s_coff[j] < 0) continue;
      float u[W], v[W];
      to_f32<C, W>(u, o[b]);
      scale_from_cache<C>(u, W, sc);
#pragma unroll
      for (int i = 0; i < W; i++) v[i] = u[i];
      if (pr.on) {
        float pv[W];
        if (NEOX) {
          to_f32<C, W>(pv, p[b]);
          scale_from_cache<C>(pv, W, sc);
        }
        const float2 *cs = x.cs + j * x.HM;
#pragma unroll
        for (int i = 0; i < W; i++) v[i] = q4_rot<false>(u[i], NEOX ? pv[i] : u[i ^ 1], cs[pr.k(i)], pr.first(i));
      }
      if constexpr (BOUNDS) {
#pragma unroll
        for (int i = 0; i < W; i++)
          if (v[i] - v[i] == 0.0f) mn[i] = fminf(mn[i], v[i]), mx[i] = fmaxf(mx[i], v[i]); /* finite only */
      } else {
        uint32_t codes = 0u;
#pragma unroll
        for (int i = 0; i < W; i++) codes |= kvi__q4_code_rcp(v[i], sm[i].x, sm[i].y, rc[i]) << (4 * i);
        q4_st<W>(pg, e0 + (int64_t)j * x.D, codes);
      }
    }
  }
}

/* A thread's unit in a layer's key capture (q4_capture_keys,
 * fp8_key_bounds): units are (head, chunk of W channels), numbered chunk
 * fastest; a unit's channels are its thread's for the whole segment, so
 * their bounds stay in registers while the thread walks the tokens (no
 * atomics within a segment). With fewer units than threads, S = THREADS /
 * units threads share a unit, each a slice s of the tokens [j0, j1). The
 * threads walk items it = it0 + threadIdx.x for it0 = 0, THREADS, ... below
 * units * S (one round when S > 1). */
struct KeyUnit {
  unsigned units, S, s, un, h, d0, j0, j1;
  bool mine;
};
template <int W> __device__ inline KeyUnit key_unit(const Ctx &x, unsigned it) {
  KeyUnit u;
  const unsigned nch = x.D / W;
  u.units = x.H * nch;
  u.S = u.units < THREADS ? THREADS / u.units : 1u;
  const unsigned ts = (x.ntok + u.S - 1) / u.S;
  u.s = it / u.units;
  u.un = it - u.s * u.units;
  u.h = u.un / nch;
  u.d0 = (u.un - u.h * nch) * W;
  u.j0 = min(u.s * ts, x.ntok);
  u.j1 = min(u.j0 + ts, x.ntok);
  u.mine = it < u.units * u.S;
  return u;
}

/* The finite bounds (mn > mx: none) of the keys of the thread's unit over
 * the whole segment: its slice's, merged with the unit's other slices
 * through shared memory when S > 1 (min and max are exact: any order gives
 * the same bounds). Every thread of the CTA calls it (S > 1 synchronizes);
 * sc: the cache's scale of the unit's head (fp8 caches). */
template <typename C, int E, bool NEOX>
__device__ inline void key_bounds(const Ctx &x, const kvi__xfer_args &a, unsigned rot, const C *kc, float sc,
                                  const int64_t *s_coff, const KeyUnit &u, float *mn, float *mx) {
  constexpr int W = E == 1 ? 2 : E;
#pragma unroll
  for (int i = 0; i < W; i++) mn[i] = INFINITY, mx[i] = -INFINITY;
  if (u.mine)
    key_rows<C, E, NEOX, true>(x, a, nullptr, rot >> 1, kc, sc, s_coff, u.h, u.d0, u.j0, u.j1, mn, mx, nullptr,
                               nullptr);
  if (u.S == 1) return;
  float2 *red = key_red<W>(); /* [channel][thread] (min, max) */
  __syncthreads();            /* the previous layer's readers are done */
#pragma unroll
  for (int i = 0; i < W; i++) red[i * THREADS + threadIdx.x] = make_float2(mn[i], mx[i]);
  __syncthreads();
  if (!u.mine) return;
  for (unsigned q = 0; q < u.S; q++)
#pragma unroll
    for (int i = 0; i < W; i++) {
      const float2 r = red[i * THREADS + q * u.units + u.un];
      mn[i] = fminf(mn[i], r.x), mx[i] = fmaxf(mx[i], r.y);
    }
}

/* Capture into a 4-bit page, one layer's keys, unit by unit (KeyUnit),
 * from the unit's bounds (key_bounds):
 *  - sole page (phase 1): the channels' words from the bounds, written
 *    as parameters, and the codes (the tokens read again, from L1 or L2);
 *  - else phase 1: the bounds folded into the channels' words with one
 *    compare-and-swap per channel and segment (the page's other segments
 *    merge into the same words); phase 2: the codes from the parameters
 *    the merged bounds give. */
template <typename C, int E, bool NEOX>
__device__ inline void q4_capture_keys(const Ctx &x, const kvi__xfer_args &a, uint8_t *pg, int l, unsigned rot,
                                       const C *kc, const float *ks, const int64_t *s_coff, bool sole) {
  constexpr int W = E == 1 ? 2 : E;
  uint32_t *words = reinterpret_cast<uint32_t *>(pg + a.scale_off);
  const KeyUnit u0 = key_unit<W>(x, 0);
  for (unsigned it0 = 0; it0 < u0.units * u0.S; it0 += THREADS) {
    const KeyUnit u = key_unit<W>(x, it0 + threadIdx.x);
    uint32_t *kw = words + (int64_t)(l * x.H + u.h) * x.D + u.d0; /* the unit's channels */
    const float sc = is_fp8<C>::value && u.mine ? ks[u.h] : 1.0f;
    float2 sm[W];
    if (a.phase == 2) { /* (not sole) */
      if (!u.mine) continue;
#pragma unroll
      for (int i = 0; i < W; i++) sm[i] = q4_sm(kvi__q4_params(__ldcg(kw + i))); /* bounds merged in L2 */
    } else {
      float mn[W], mx[W];
      key_bounds<C, E, NEOX>(x, a, rot, kc, sc, s_coff, u, mn, mx);
      if (!u.mine) continue;
      if (!sole) { /* phase 1: fold into the channels' words */
        if (u.s == 0)
          fold_words<W>(kw, [&](int i, uint32_t w) { return kvi__q4_fold(kvi__q4_fold(w, mn[i]), mx[i]); });
        continue;
      }
      uint32_t w[W];
#pragma unroll
      for (int i = 0; i < W; i++) {
        w[i] = kvi__q4_params(kvi__q4_bounds(mn[i], mx[i]));
        sm[i] = q4_sm(w[i]);
      }
      if (u.s == 0) {
        if constexpr (W == 8) { /* 32-byte aligned */
          reinterpret_cast<uint4 *>(kw)[0] = make_uint4(w[0], w[1], w[2], w[3]);
          reinterpret_cast<uint4 *>(kw)[1] = make_uint4(w[4], w[5], w[6], w[7]);
        } else
#pragma unroll
          for (int i = 0; i < W; i++) kw[i] = w[i];
      }
    }
    float rc[W];
#pragma unroll
    for (int i = 0; i < W; i++) rc[i] = kvi__q4_rcp(sm[i].x);
    key_rows<C, E, NEOX, false>(x, a, pg, rot >> 1, kc, sc, s_coff, u.h, u.d0, u.j0, u.j1, nullptr, nullptr, sm, rc);
  }
}

/* Capture into an fp8 page, one layer's keys, bounds phase
 * (KVI__FP8_PH_BOUNDS): each unit's bounds (key_bounds) folded into its
 * channels' low halves (the offset slots, x.koff) and high halves (x.khi),
 * two channels' halves per 32-bit compare-and-swap, once per segment
 * (base/fp8.h's kvi__fp8_fold_half: rounding to fp16 is monotone, so the
 * fold of the bounds is the fold of every value). */
template <typename C, int E, bool NEOX>
__device__ inline void fp8_key_bounds(const Ctx &x, const kvi__xfer_args &a, unsigned rot, const C *kc,
                                      const float *ks, const int64_t *s_coff) {
  constexpr int W = E == 1 ? 2 : E; /* even: a unit's halves are whole 32-bit words (D even) */
  const KeyUnit u0 = key_unit<W>(x, 0);
  for (unsigned it0 = 0; it0 < u0.units * u0.S; it0 += THREADS) {
    const KeyUnit u = key_unit<W>(x, it0 + threadIdx.x);
    float mn[W], mx[W];
    key_bounds<C, E, NEOX>(x, a, rot, kc, is_fp8<C>::value && u.mine ? ks[u.h] : 1.0f, s_coff, u, mn, mx);
    if (!u.mine || u.s) continue;
    const int64_t c = (int64_t)u.h * x.D + u.d0;
    fold_words<W / 2>(reinterpret_cast<uint32_t *>(x.koff + c), [&](int i, uint32_t w) {
      return (uint32_t)kvi__fp8_fold_half((uint16_t)w, mn[2 * i], 1) |
             (uint32_t)kvi__fp8_fold_half((uint16_t)(w >> 16), mn[2 * i + 1], 1) << 16;
    });
    fold_words<W / 2>(reinterpret_cast<uint32_t *>(x.khi + c), [&](int i, uint32_t w) {
      return (uint32_t)kvi__fp8_fold_half((uint16_t)w, mx[2 * i], 0) |
             (uint32_t)kvi__fp8_fold_half((uint16_t)(w >> 16), mx[2 * i + 1], 0) << 16;
    });
  }
}

/* Capture into a 4-bit page, one layer: phase 1 (keys' bounds) or 2 (keys'
 * codes, then the values). A page that the CTA's segment alone covers
 * (sole, CTA-uniform) is captured whole in phase 1: its key channels'
 * parameters, its codes and its value tokens' words, the words of the
 * page's tokens past the segment zero (what phase 0 gives other pages);
 * phases 0, 2 and 3 leave it alone. */
template <typename C, int E, bool NEOX>
__device__ inline void q4_capture(const Ctx &x, const kvi__xfer_args &a, uint8_t *pg, int l, unsigned rot, const C *kc,
                                  const C *vc, const float *ks, const float *vs, const int64_t *s_coff, unsigned tok0,
                                  bool sole) {
  q4_capture_keys<C, E, NEOX>(x, a, pg, l, rot, kc, ks, s_coff, sole);
  if (a.phase == 1 && !sole) return;
  q4_capture_values<C, E>(x, a, pg, l, vc, vs, s_coff, tok0);
  if (sole) { /* tok0 == 0 */
    uint32_t *vw = reinterpret_cast<uint32_t *>(pg + a.scale_off) + (int64_t)a.L * x.H * x.D + (int64_t)l * x.H * a.P;
    const unsigned rest = (unsigned)a.P - x.ntok;
    for (unsigned i = threadIdx.x; i < x.H * rest; i += THREADS) {
      const unsigned h = i / rest;
      vw[(int64_t)h * a.P + x.ntok + (i - h * rest)] = 0u;
    }
  }
}

/* Phases 0 and 3 of a capture into a 4-bit page, layers l0..l1, done by the
 * page's first segment: phase 0 empties the key channels' bounds and zeroes
 * the value words, phase 3 turns the bounds into the channels' parameters. */
template <int = 0>
__device__ inline void q4_page_words(const kvi__xfer_args &a, void *page, const kvi__xseg &sg, int l0, int l1) {
  if (sg.tok0 != 0) return;
  uint32_t *w = reinterpret_cast<uint32_t *>(reinterpret_cast<char *>(page) + a.scale_off);
  const int HD = a.H * a.D, HP = a.H * a.P;
  for (int i = l0 * HD + (int)threadIdx.x; i < l1 * HD; i += THREADS)
    w[i] = a.phase == 0 ? KVI__Q4_BOUNDS_EMPTY : kvi__q4_params(w[i]);
  for (int i = l0 * HP + (int)threadIdx.x; a.phase == 0 && i < l1 * HP; i += THREADS) w[(int64_t)a.L * HD + i] = 0u;
}

/* One layer of a 4-bit page: q4_inject, or q4_capture (sole: see there),
 * NeoX or GPT-J pairs as the layer's style says. */
template <typename C, int E, bool INJECT>
__device__ inline void q4_layer(const Ctx &x, const kvi__xfer_args &a, uint8_t *pg, int l, int style, unsigned rot, C *kc,
                                C *vc, const float *ks, const float *vs, const int64_t *s_coff, unsigned tok0, bool sole) {
  if constexpr (INJECT) {
    if (style == 1)
      q4_inject<C, E, true>(x, a, pg, l, rot, kc, vc, ks, vs, s_coff, tok0);
    else
      q4_inject<C, E, false>(x, a, pg, l, rot, kc, vc, ks, vs, s_coff, tok0);
  } else {
    if (style == 1)
      q4_capture<C, E, true>(x, a, pg, l, rot, kc, vc, ks, vs, s_coff, tok0, sole);
    else
      q4_capture<C, E, false>(x, a, pg, l, rot, kc, vc, ks, vs, s_coff, tok0, sole);
  }
}
