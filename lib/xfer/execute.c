/*
 * Running a plan: the CPU reference of the transfer and deviation kernels,
 * and on a CUDA store the kernels' arguments, the plan's upload and the
 * launches (cuda/transfer_kernels.cu).
 * SPDX-License-Identifier: Apache-2.0
 */
#include <stddef.h>
#include <string.h>

#include "xfer/transfer.h"

/* n elements of a row whose elements lie `stride` elements apart, as fp32
 * (fp8: times scale). */
static void load_row(float *dst, const char *src, kvi_dtype t, int32_t n, int64_t stride, float scale) {
  char g[1024 * 4];
  const size_t es = kvi__dtype_size(t);
  if (stride != 1) { /* gathered into a contiguous row first */
    for (int32_t i = 0; i < n; i++) memcpy(g + (size_t)i * es, src + (size_t)(i * stride) * es, es);
    src = g;
  }
  if (t == KVI_DTYPE_FP8_E4M3 || t == KVI_DTYPE_FP8_E5M2) {
    for (int32_t i = 0; i < n; i++) dst[i] = kvi__fp8_to_f32((uint8_t)src[i], t) * scale;
  } else {
    kvi__convert(dst, KVI_DTYPE_FP32, src, t, n);
  }
}

static void store_row(char *dst, kvi_dtype t, int64_t stride, float *src, int32_t n, float scale) {
  char g[1024 * 4];
  char *out = stride == 1 ? dst : g; /* scattered from a contiguous row after */
  if (t == KVI_DTYPE_FP8_E4M3 || t == KVI_DTYPE_FP8_E5M2) {
    for (int32_t i = 0; i < n; i++) ((uint8_t *)out)[i] = kvi__f32_to_fp8(src[i] / scale, t);
  } else {
    kvi__convert(out, t, src, KVI_DTYPE_FP32, n);
  }
  const size_t es = kvi__dtype_size(t);
  if (stride != 1)
    for (int32_t i = 0; i < n; i++) memcpy(dst + (size_t)(i * stride) * es, g + (size_t)i * es, es);
}

/* A stored row of the page at `page`: its D elements as fp32 (q4: decoded
 * with its groups' words; fp8: with its group's scale `scale` and, keys,
 * its channels' offsets). */
static void load_page_row(float *dst, const kvi_store *s, const char *page, int32_t l, int kv, int32_t h, int32_t tok,
                          int32_t n, float scale) {
  const char *pr = page + kvi__dtype_bytes(s->dtype, (uint64_t)kvi__page_row_off(s, l, kv, h, tok));
  const int32_t L = s->geom.num_layers, H = s->geom.local_heads, D = s->geom.head_size;
  if (s->q4) {
    const uint32_t *w = (const uint32_t *)(page + s->scale_off);
    if (kv == 0) kvi__q4_unpack_row(dst, (const uint8_t *)pr, n, w + (size_t)(l * H + h) * (size_t)D, 1);
    else kvi__q4_unpack_row(dst, (const uint8_t *)pr, n, w + (size_t)L * H * D + (size_t)(l * H + h) * s->P + tok, 0);
    return;
  }
  if (s->fp8) {
    float m[1024];
    if (kv == 0) kvi__fp8_offsets_f32(m, page_key_offsets(s, page) + (size_t)(l * H + h) * (size_t)D, n);
    kvi__fp8_dequantize(dst, (const uint8_t *)pr, kv == 0 ? m : NULL, n, scale);
    return;
  }
  load_row(dst, pr, s->dtype, n, 1, scale);
}

/* A capture into an fp8 page, the phases done once per page (kernels.h,
 * KVI__FP8_PH_*) for layers [lb, le): empty amax slots and key bounds,
 * the key offsets from the bounds, or the scales from the slots. */
static void fp8_page_phase(const kvi_store *s, char *page, int32_t lb, int32_t le, int phase) {
  const int32_t H = s->geom.local_heads, D = s->geom.head_size;
  float *slots = (float *)(page + s->scale_off);
  uint16_t *off = page_key_offsets(s, page);
  for (int32_t l = lb; l < le; l++) {
    uint16_t *hi = kvi__fp8_capture_hi(page, l, H, s->P, D), *lo = off + (size_t)l * H * D;
    for (int32_t g = l * 2 * H; g < (l + 1) * 2 * H; g++)
      if (phase == KVI__FP8_PH_EMPTY) slots[g] = 0.0f;
      else if (phase == KVI__FP8_PH_SCALES) slots[g] = kvi__fp8_scale(slots[g]);
    for (int32_t i = 0; i < H * D; i++)
      if (phase == KVI__FP8_PH_EMPTY) lo[i] = KVI__FP8_LO_EMPTY, hi[i] = KVI__FP8_HI_EMPTY;
      else if (phase == KVI__FP8_PH_OFFSETS) lo[i] = kvi__fp8_offset_of((uint32_t)lo[i] | (uint32_t)hi[i] << 16);
  }
}

/* A capture into an fp8 page, one row (un-rotated, fp32) of plane kv, head
 * h, layer l, in a per-segment phase: fold the keys' bounds or the values'
 * amax (KVI__FP8_PH_BOUNDS), the keys' amax (KVI__FP8_PH_AMAX), or write
 * the row's bytes (KVI__FP8_PH_WRITE). */
static void fp8_capture_row(const kvi_store *s, char *page, char *pr, int32_t l, int kv, int32_t h, const float *row,
                            float *slot, int phase) {
  const int32_t H = s->geom.local_heads, D = s->geom.head_size;
  uint16_t *lo = page_key_offsets(s, page) + (size_t)(l * H + h) * (size_t)D;
  float m[1024];
  if (phase == KVI__FP8_PH_BOUNDS) {
    uint16_t *hi = kvi__fp8_capture_hi(page, l, H, s->P, D) + (size_t)h * (size_t)D;
    if (kv) *slot = kvi__fp8_amax(*slot, row, NULL, D);
    for (int32_t d = 0; kv == 0 && d < D; d++) {
      lo[d] = kvi__fp8_fold_half(lo[d], row[d], 1);
      hi[d] = kvi__fp8_fold_half(hi[d], row[d], 0);
    }
    return;
  }
  if (kv == 0) kvi__fp8_offsets_f32(m, lo, D);
  if (phase == KVI__FP8_PH_AMAX && kv == 0) *slot = kvi__fp8_amax(*slot, row, m, D);
  if (phase == KVI__FP8_PH_WRITE) kvi__fp8_quantize((uint8_t *)pr, row, kv == 0 ? m : NULL, D, kvi__fp8_scale(*slot));
}

/* n elements of es bytes each, `ds` / `ss` elements apart, copied as they are. */
static void copy_row(char *dst, int64_t ds, const char *src, int64_t ss, int32_t n, size_t es) {
  if (ds == 1 && ss == 1) {
    memcpy(dst, src, (size_t)n * es);
    return;
  }
  for (int32_t i = 0; i < n; i++) memcpy(dst + (size_t)(i * ds) * es, src + (size_t)(i * ss) * es, es);
}

/* The CPU reference of the fused kernel, one phase of it (kernels.h,
 * kvi__xfer_args.phase): a capture into an fp8 store runs the six phases
 * KVI__FP8_PH_* (empty slots and key bounds; fold keys' bounds and values'
 * amax; key offsets; keys' amax of |x - offset|; bytes; scales), as the
 * kernel does; a capture into a q4 store phases 0 to 3 with each key
 * channel's bounds in its word (base/q4.h: 0 empty bounds, 1 fold, 2 codes
 * from the parameters the bounds give, values' words and codes from their
 * row, 3 the parameter words); everything else is phase 2 alone. */
static void cpu_transfer(const xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, int phase) {
  const kvi_store *s = x->store;
  const kvi__cache *c = &x->cache;
  const int32_t H = c->H, D = c->D;
  const size_t pe = kvi__dtype_size(s->dtype), ce = kvi__dtype_size(c->dtype);
  /* equal dtypes without scales (neither is fp8): what is not rotated moves
   * bit for bit (as in the kernel), only the rotated columns are converted */
  const bool raw = s->dtype == c->dtype && !s->fp8;
  float row[1024];
  const int32_t L = s->geom.num_layers, P = s->P;
  uint32_t w[1024];
  for (int32_t i = 0; i < p->nsegs; i++) {
    const kvi__xseg *sg = &p->segs[i];
    const kvi__xreq *rq = &p->reqs[sg->req];
    const int32_t *table = rq->table ? rq->table : (const int32_t *)(p->buf + rq->table_off);
    const char *page = page_addr(s, sg->page);
    float *slots = s->fp8 ? page_scales(s, sg->page) : NULL;
    uint32_t *words = s->q4 ? (uint32_t *)(page + s->scale_off) : NULL; /* base/q4.h */
    if (!inject && s->fp8 &&
        (phase == KVI__FP8_PH_EMPTY || phase == KVI__FP8_PH_OFFSETS || phase == KVI__FP8_PH_SCALES)) {
      if (sg->tok0 == 0) fp8_page_phase(s, (char *)page, lb, le, phase); /* once per page: its first segment */
      continue;
    }
    if (!inject && s->q4 && (phase == 0 || phase == 3)) { /* once per page: its first segment starts at token 0 */
      if (sg->tok0 == 0) /* q4: keys' bounds, then their words; values' words zero until written */
        for (int32_t g = lb * H; g < le * H; g++) {
          for (int32_t d = 0; d < D; d++)
            words[g * D + d] = phase == 0 ? KVI__Q4_BOUNDS_EMPTY : kvi__q4_params(words[g * D + d]);
          for (int32_t t = 0; phase == 0 && t < P; t++) words[(int64_t)L * H * D + g * P + t] = 0u;
        }
      continue;
    }
    for (int32_t l = lb; l < le; l++)
      for (int32_t j = 0; j < sg->ntok; j++) {
        const int64_t seq = sg->seq0 + j;
        const int32_t block = table[seq / c->BS - rq->first_block];
        const int64_t t = seq % c->BS;
        const int32_t pos = sg->explicit_pos ? p->positions[sg->pos0 + j] : sg->pos0 + j;
        for (int kv = 0; kv < 2; kv++)
          for (int32_t h = 0; h < H; h++) {
            const kvi__strides *cs = kv ? &c->vs : &c->ks;
            char *pr = (char *)page + kvi__dtype_bytes(s->dtype, (uint64_t)kvi__page_row_off(s, l, kv, h, sg->tok0 + j));
            char *cr = (kv ? c->v[l] : c->k[l]) + (size_t)(block * cs->block + t * cs->token + h * cs->head) * ce;
            const int64_t cd = cs->dim; /* the cache row's element stride */
            const float scale = (kv ? c->v_scale : c->k_scale)[l * H + h];
            float *slot = slots ? slots + (l * 2 + kv) * H + h : NULL;
            const int32_t rot = kv || s->rope[l].style == KVI_ROPE_NONE ? 0 : s->rope[l].rotary_dim;
            const int32_t n = raw ? rot : D; /* columns converted (rotation touches [0, rot) only) */
            if (inject) {
              load_page_row(row, s, page, l, kv, h, sg->tok0 + j, n, slot ? *slot : 1.0f);
              if (kv == 0) kvi__rope_rotate(&s->rope[l], row, pos, false);
              store_row(cr, c->dtype, cd, row, n, scale);
              if (raw) copy_row(cr + (size_t)(rot * cd) * ce, cd, pr + (size_t)rot * pe, 1, D - rot, pe);
              continue;
            }
            load_row(row, cr, c->dtype, n, cd, scale);
            if (kv == 0) kvi__rope_rotate(&s->rope[l], row, pos, true);
            if (words && kv == 0) { /* q4 keys: a group per channel over the page's tokens */
              uint32_t *kw = words + (size_t)(l * H + h) * (size_t)D;
              if (phase == 1)
                for (int32_t d = 0; d < D; d++) kw[d] = kvi__q4_fold(kw[d], row[d]);
              else {
                for (int32_t d = 0; d < D; d++) w[d] = kvi__q4_params(kw[d]);
                kvi__q4_pack_row((uint8_t *)pr, row, D, w, 1);
              }
            } else if (words) { /* q4 values: a group per token */
              uint32_t *vw = words + (size_t)L * H * D + (size_t)(l * H + h) * (size_t)P + (size_t)(sg->tok0 + j);
              if (phase == 2) {
                *vw = kvi__q4_params(kvi__q4_fold_row(KVI__Q4_BOUNDS_EMPTY, row, D));
                kvi__q4_pack_row((uint8_t *)pr, row, D, vw, 0);
              }
            } else if (slot)
              fp8_capture_row(s, (char *)page, pr, l, kv, h, row, slot, phase);
            else
              store_row(pr, s->dtype, 1, row, n, 1.0f);
            if (raw) copy_row(pr + (size_t)rot * pe, 1, cr + (size_t)(rot * cd) * ce, cd, D - rot, ce);
          }
      }
  }
}

/* The CPU reference of the deviation kernel (kvi_inject_deviation): per
 * token of the plan, in plan order, the sum over heads of the squared K
 * differences (the cache's against the stored key rotated at the token's
 * position) and V differences at one layer, accumulated in double. */
static void cpu_deviation(const xfer *x, const plan *p, int32_t l, float *out) {
  const kvi_store *s = x->store;
  const kvi__cache *c = &x->cache;
  const int32_t H = c->H, D = c->D;
  const size_t ce = kvi__dtype_size(c->dtype);
  float row[1024], got[1024];
  int64_t o = 0;
  for (int32_t i = 0; i < p->nsegs; i++) {
    const kvi__xseg *sg = &p->segs[i];
    const kvi__xreq *rq = &p->reqs[sg->req];
    const int32_t *table = rq->table ? rq->table : (const int32_t *)(p->buf + rq->table_off);
    const char *page = page_addr(s, sg->page);
    const float *slots = s->fp8 ? page_scales(s, sg->page) : NULL;
    for (int32_t j = 0; j < sg->ntok; j++) {
      const int64_t seq = sg->seq0 + j;
      const int32_t block = table[seq / c->BS - rq->first_block];
      const int64_t t = seq % c->BS;
      const int32_t pos = sg->explicit_pos ? p->positions[sg->pos0 + j] : sg->pos0 + j;
      double sum = 0.0;
      for (int kv = 0; kv < 2; kv++)
        for (int32_t h = 0; h < H; h++) {
          const kvi__strides *cs = kv ? &c->vs : &c->ks;
          const char *cr = (kv ? c->v[l] : c->k[l]) + (size_t)(block * cs->block + t * cs->token + h * cs->head) * ce;
          load_page_row(row, s, page, l, kv, h, sg->tok0 + j, D, slots ? slots[(l * 2 + kv) * H + h] : 1.0f);
          if (kv == 0) kvi__rope_rotate(&s->rope[l], row, pos, false);
          load_row(got, cr, c->dtype, D, cs->dim, (kv ? c->v_scale : c->k_scale)[l * H + h]);
          for (int32_t d = 0; d < D; d++) {
            const double e = (double)got[d] - (double)row[d];
            sum += e * e;
          }
        }
      out[o++] = (float)sum;
    }
  }
}

/* Runs a plan: here (CPU) or in one kernel launch (CUDA). */
kvi_status kvi__execute(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                        const char *fn) {
  if (!x->cuda) {
    if (!inject && (x->store->fp8 || x->store->q4))
      for (int phase = 0; phase < (x->store->fp8 ? KVI__FP8_PHASES : 4); phase++) cpu_transfer(x, p, lb, le, false, phase);
    else
      cpu_transfer(x, p, lb, le, inject, 2);
    return KVI_OK;
  }
  return kvi__launch(x, p, lb, le, inject, stream, fn);
}

/* Layers per CTA: enough (segment, layer) pairs per CTA to amortize its
 * prologue, while leaving about 128 CTAs per SM so the tail stays short. */
int32_t kvi__layers_per_cta(int32_t sms, int32_t nsegs, int32_t nl) {
  const int64_t target = (int64_t)(sms > 0 ? sms : 132) * 128;
  int64_t per = (int64_t)nsegs * nl / target;
  if (per < 1) per = 1;
  if (per > nl) per = nl;
  const int64_t chunks = (nl + per - 1) / per;
  return (int32_t)((nl + chunks - 1) / chunks);
}

/* Uploads a plan from its slot on the injector's own stream and orders
 * `stream` after the copy: the upload then overlaps whatever `stream` still
 * runs before the call (an engine's previous step) instead of queueing
 * behind it. The slot's device buffer is free: acquiring the slot waited
 * for the last launch that read it. */
static kvi_status upload(xfer *x, const plan *p, struct CUstream_st *stream, const char *fn) {
  struct CUevent_st *up = x->up[p->sl - x->ring.slot];
  kvi_status st = kvi__cuda_h2d(p->sl->dev + p->off, p->buf, p->bytes, x->up_stream, fn);
  if (st == KVI_OK) st = kvi__cuda_event_record(up, x->up_stream, fn);
  if (st == KVI_OK) st = kvi__cuda_stream_wait(stream, up, fn);
  return st;
}

/* The kernel arguments of a plan, its plan uploaded (or inlined) first. */
static kvi_status xfer_args(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, kvi__xfer_args *out,
                            struct CUstream_st *stream, const char *fn) {
  const kvi_store *s = x->store;
  kvi_status st;
  kvi__xfer_args *a = out;
  memset(a, 0, offsetof(kvi__xfer_args, inline_plan));
  if (p->sl) {
    if (!p->uploaded && (st = upload(x, p, stream, fn))) return st;
    a->plan_dev = p->sl->dev + p->off;
  } else {
    memcpy(a->inline_plan, p->buf, p->bytes);
    a->inline_bytes = (int32_t)(p->bytes ? p->bytes : 1);
  }
  a->pool = kvi__pool_dev_base(s);
  a->host_pool = kvi__pool_host_mapped(s); /* KVI_HOST_PAGES_READ_MAPPED: host-tier pages read in place */
  a->host_first = kvi__pool_host_first(s);
  a->page_elems = page_stride_elems(s);
  a->scale_off = (int64_t)s->scale_off;
  a->page_dtype = (int32_t)s->dtype;
  a->P = s->P;
  a->L = x->cache.L;
  a->H = x->cache.H;
  a->D = x->cache.D;
  a->cache_dtype = (int32_t)x->cache.dtype;
  a->BS = x->cache.BS;
  a->NB = x->cache.NB;
  a->block_stride = x->cache.ks.block;
  a->token_stride = x->cache.ks.token;
  a->head_stride = x->cache.ks.head;
  a->dim_stride = x->cache.ks.dim;
  a->v_block_stride = x->cache.vs.block;
  a->v_token_stride = x->cache.vs.token;
  a->v_head_stride = x->cache.vs.head;
  a->v_dim_stride = x->cache.vs.dim;
  a->split_v = kvi__xfer_split_v(x);
  a->layers = x->d_layers;
  a->k_scale = x->d_kscale;
  a->v_scale = x->d_vscale;
  a->o_reqs = (int64_t)p->o_reqs;
  a->o_pos = (int64_t)p->o_pos;
  a->nsegs = p->nsegs;
  a->layer_begin = lb;
  a->layer_end = le;
  a->layers_per_cta = kvi__layers_per_cta(x->sms, p->nsegs, le - lb);
  a->seg_tokens = x->seg_tokens;
  a->half_max = x->half_max;
  a->inject = inject;
  a->vec = kvi__xfer_vec(x);
  a->skipped = x->skipped.dev;
  a->pdl = p->after_plan_kernel && x->pdl;
  return KVI_OK;
}

/* The staging slot's bookkeeping after a launch that reads it, and the
 * store's in-flight tracking. */
static kvi_status launched(xfer *x, const plan *p, struct CUstream_st *stream, const char *fn) {
  kvi_status st;
  if (p->sl && (st = kvi__ring_record(p->sl, stream, fn))) return st;
  return kvi__store_track(x->store, stream, fn);
}

#ifdef KVI_HAVE_CUDA
/* Whether every segment of a capture plan is the only one of its page (it
 * starts at the page's token 0 and the next segment is another page's: a
 * page's segments are consecutive). The kernel captures such a page whole
 * in phase 1 and leaves it alone in phases 0, 2 and 3 (its q4_sole). */
static bool q4_all_sole(const plan *p) {
  for (int32_t i = 0; i < p->nsegs; i++)
    if (p->segs[i].tok0 != 0 || (i + 1 < p->nsegs && p->segs[i + 1].page == p->segs[i].page)) return false;
  return true;
}
#endif

kvi_status kvi__launch(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                       const char *fn) {
  kvi__xfer_args a;
  kvi_status st = xfer_args(x, p, lb, le, inject, &a, stream, fn);
  if (st) return st;
#ifdef KVI_HAVE_CUDA
  const bool phased = !inject && (x->store->fp8 || x->store->q4);
  /* a capture into an fp8 store is six launches, into a 4-bit store four (kernels.h: phase), the
   * rest one; a 4-bit capture whose pages are one segment each is phase 1 alone */
  const bool q4_sole = phased && x->store->q4 && q4_all_sole(p);
  const int last = !phased ? 2 : x->store->fp8 ? KVI__FP8_PHASES - 1 : 3;
  for (int phase = phased ? 0 : 2; phase <= last; phase++) {
    if (q4_sole && phase != 1) continue;
    a.phase = phase;
    /* the launcher returns (and so clears) the launch error: report that value */
    const int launch_err = kvi__cuda_transfer(&a, stream);
    if (launch_err) return kvi__cuda_error(launch_err, fn, inject ? "injection kernel launch" : "capture kernel launch");
  }
#endif
  return launched(x, p, stream, fn);
}

/* The plan's caller area for a deviation on a CUDA store: each segment's
 * first score index (int64), then, for host output, room for the scores. */
size_t kvi__deviation_ext(const xfer *x, const deviation *dv, int64_t nsegs, int64_t ntok) {
  if (!dv || !x->cuda) return 0;
  return kvi__align_up((size_t)nsegs * sizeof(int64_t)) + (dv->out_on_device ? 0 : (size_t)ntok * sizeof(float));
}

/* Scores a plan (kvi_inject_deviation): here (CPU) or in one kernel launch
 * (CUDA; host output copied back after it, the stream synchronized). */
kvi_status kvi__run_deviation(xfer *x, plan *p, const deviation *dv, struct CUstream_st *stream, const char *fn) {
  if (!x->cuda) {
    cpu_deviation(x, p, dv->layer, dv->out);
    return KVI_OK;
  }
  int64_t *seg_out = (int64_t *)(p->buf + p->o_ext);
  int64_t o = 0;
  for (int32_t i = 0; i < p->nsegs; i++) {
    seg_out[i] = o;
    o += p->segs[i].ntok;
  }
  const size_t o_scores = p->o_ext + kvi__align_up((size_t)p->nsegs * sizeof(int64_t));
  kvi__dev_args a;
  kvi_status st;
  if ((st = xfer_args(x, p, dv->layer, dv->layer + 1, true, &a.x, stream, fn))) goto out;
  a.seg_out = (const int64_t *)(a.x.plan_dev + p->o_ext);
  a.out = dv->out_on_device ? dv->out : (float *)(a.x.plan_dev + o_scores);
#ifdef KVI_HAVE_CUDA
  const int launch_err = kvi__cuda_deviation(&a, stream);
  if (launch_err) {
    st = kvi__cuda_error(launch_err, fn, "deviation kernel launch");
    goto out;
  }
#endif
  if ((st = launched(x, p, stream, fn))) goto out;
  if (!dv->out_on_device && o > 0) { /* through the slot's pinned buffer, so a failure leaves out untouched */
    if ((st = kvi__cuda_d2h(p->buf + o_scores, a.out, (size_t)o * sizeof(float), stream, fn))) goto out;
    if ((st = kvi__cuda_sync(stream, fn))) goto out;
    memcpy(dv->out, p->buf + o_scores, (size_t)o * sizeof(float));
  }
out:
  return st;
}
