/*
 * libkvinject — the interface between the C core and the CUDA kernels in
 * cuda/. Plain C; included by both.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_KERNELS_H
#define KVI_KERNELS_H

#include <stdint.h>

#include "base/fp8.h"
#include "kvinject/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Pages handled by one launch; the list travels by value in the kernel's
 * parameters (1 KiB), so a launch needs no device-side table. */
#define KVI__LAUNCH_PAGES 256

/*
 * Page layout (internal, shared by the CPU and CUDA paths): a page of P
 * tokens holds, for layer l, plane kv (0 = K, 1 = V), local head h, token
 * t < P and element d < D, the element at offset
 *   (((l * 2 + kv) * H + h) * P + t) * D + d
 * so each (layer, plane, head) is one contiguous run of P * D elements.
 */
typedef struct kvi__copy_args {
  /* dense view */
  const void *vk; /* K base (const for puts; written through for reads) */
  const void *vv; /* V base */
  int32_t view_dtype;
  int64_t layer_stride, token_stride, head_stride;
  int32_t L, H, D;
  /* pages */
  void *pool;         /* base of the page pool */
  int32_t page_dtype; /* storage dtype */
  int32_t P;          /* tokens per page */
  int64_t page_elems; /* page stride in elements: L * 2 * H * P * D (fp8: page bytes) */
  int64_t scale_off;  /* fp8 stores: byte offset of the scales in a page (the key offsets follow
                         at kvi__fp8_offsets_rel), else 0 */
  /* this launch: `count` pages covering tokens [token_first, token_first + num_tokens) */
  int32_t count;
  int32_t token_first;
  int32_t num_tokens;
  uint32_t pages[KVI__LAUNCH_PAGES];
} kvi__copy_args;

/* Dense view -> pages (put) and pages -> dense view (read), converting
 * dtypes with round to nearest even. Enqueue on `stream`; return the launch
 * status (0 or a cudaError_t value). */
int kvi__cuda_view_to_pages(const kvi__copy_args *a, struct CUstream_st *stream);
int kvi__cuda_pages_to_view(const kvi__copy_args *a, struct CUstream_st *stream);

/* ---- injection and capture (cuda/transfer_kernels.cu) ------------------- */

/* Per layer, in device memory. */
typedef struct kvi__xlayer {
  char *k, *v;           /* the cache's K and V base addresses for this layer */
  const float *inv_freq; /* rot/2 frequencies, or NULL with a table */
  const float *table;    /* cos/sin table [positions][rot], or NULL */
  int32_t style;         /* kvi_rope_style */
  int32_t rot;           /* rotary_dim (0 for KVI_ROPE_NONE) */
  float attn;            /* attention factor (formula mode) */
  int32_t rope_id;       /* layers with equal RoPE share an id (the first such layer) */
} kvi__xlayer;

/* A run of at most seg_tokens tokens of one fact page, landing at
 * consecutive sequence indices of one request. */
typedef struct kvi__xseg {
  int64_t seq0;   /* sequence index of the first token */
  uint32_t page;  /* store page id */
  int32_t req;    /* request (or capture) index */
  int32_t pos0;   /* explicit: index of the first token's position in positions[]; else the position itself */
  uint16_t tok0;  /* first token within the page */
  uint16_t ntok;  /* tokens in the run */
  int32_t explicit_pos; /* 1: positions[pos0 + j]; 0: consecutive from pos0 */
} kvi__xseg;

typedef struct kvi__xreq {
  const int32_t *table; /* block ids in device memory, or NULL: they are in the plan at table_off */
  int64_t table_off;    /* byte offset of a host table copied into the plan */
  int32_t table_len;
  int32_t first_block;  /* entry 0 is sequence block first_block */
} kvi__xreq;

/* Plans up to this many bytes travel inside the kernel's parameters (no
 * upload, no staging slot); larger ones are uploaded. */
#define KVI__INLINE_PLAN 12288

typedef struct kvi__xfer_args {
  /* store pages: ids below host_first at pool, the rest (a tiered store's
   * host tier, read in place) at host_pool + (id - host_first) pages */
  void *pool;
  void *host_pool;
  uint32_t host_first;
  int64_t page_elems; /* page stride in elements (fp8, q4 stores: page bytes) */
  int64_t scale_off;  /* fp8, q4 stores: byte offset of the scales in a page (fp8: the key
                         offsets follow at kvi__fp8_offsets_rel) */
  int32_t page_dtype;
  int32_t P;
  int32_t L, H, D;
  /* cache */
  int32_t cache_dtype;
  int32_t BS;
  int64_t NB;
  int64_t block_stride, token_stride, head_stride, dim_stride; /* K's */
  int64_t v_block_stride, v_token_stride, v_head_stride, v_dim_stride;
  int32_t split_v; /* V's block, token or head stride differs from K's: V has its own
                      per-token offsets. Dim strides other than 1 take vec 1. */
  const kvi__xlayer *layers;
  const float *k_scale; /* L * H */
  const float *v_scale;
  /* work: the plan is xseg[nsegs] at 0, xreq[] at o_reqs, int32 positions[]
   * at o_pos, host block tables after; in inline_plan when inline_bytes > 0,
   * else at plan_dev */
  const char *plan_dev;
  int64_t o_reqs, o_pos;
  int32_t inline_bytes;
  int32_t nsegs;
  int32_t layer_begin, layer_end;
  int32_t layers_per_cta; /* grid.y covers [layer_begin, layer_end) in chunks of this many */
  int32_t seg_tokens;     /* no segment is longer */
  int32_t half_max;       /* largest rot/2 over the layers */
  int32_t inject;         /* 1: pages -> cache (rotate); 0: cache -> pages (un-rotate) */
  int32_t vec;            /* 8: vectors of that many elements (host checked
                             alignment), else 1 */
  int32_t phase;          /* capture into an fp8 store, six launches (KVI__FP8_PH_*):
                             0 empty the pages' amax slots and key bounds
                             (base/fp8.h), 1 fold the keys' bounds (32-bit
                             compare-and-swap) and the values' amax (atomicMax),
                             2 turn the bounds into the key offsets, 3 fold the
                             keys' amax of |x - offset|, 4 write e4m3 bytes, 5
                             turn amax into scales; into a 4-bit store four: 0
                             empty bounds, 1 fold them, 2 write codes, 3 the
                             parameter words (base/q4.h; a page one segment
                             covers is captured whole in phase 1, and a plan of
                             such pages is phase 1 alone); else 2 */
  unsigned long long *skipped; /* device-visible counter of skipped tokens */
  int32_t pdl;                 /* 1: launched as a programmatic dependent of the kernel
                                  before it on the stream (the retrieve plan, compute
                                  capability 9.0 on): its CTAs wait for that kernel's
                                  completion and memory before anything else */
  uint64_t inline_plan[KVI__INLINE_PLAN / 8];
} kvi__xfer_args;

/* The phases of a capture into an fp8 store (kvi__xfer_args.phase). */
enum {
  KVI__FP8_PH_EMPTY = 0,   /* per page: amax slots 0, key bounds empty */
  KVI__FP8_PH_BOUNDS = 1,  /* per segment: keys' bounds, values' amax */
  KVI__FP8_PH_OFFSETS = 2, /* per page: the key offsets from the bounds */
  KVI__FP8_PH_AMAX = 3,    /* per segment: keys' amax of |x - offset| */
  KVI__FP8_PH_WRITE = 4,   /* per segment: the e4m3 bytes */
  KVI__FP8_PH_SCALES = 5,  /* per page: amax slots into scales */
  KVI__FP8_PHASES = 6
};

/* Bytes of shared memory a launch needs: cos/sin of seg_tokens x half_max
 * pairs, then per-token cache offsets (K's; V's too with split_v) and
 * positions. */
#define KVI__XFER_SMEM(seg_tokens, half_max, split_v) \
  ((size_t)(seg_tokens) * ((size_t)(half_max) * 8u + 12u + ((split_v) ? 8u : 0u)))

/* One launch: grid (nsegs, layer chunks). Returns a cudaError_t. */
int kvi__cuda_transfer(const kvi__xfer_args *a, struct CUstream_st *stream);

/* ---- deviation scores (cuda/deviation_kernels.cu) ------------------------ */

/* kvi_inject_deviation: the injection plan of `x` (uploaded: plan_dev),
 * scored at layer x.layer_begin (layer_end = layer_begin + 1). A CTA per
 * segment; segment i's scores go to out[seg_out[i]...], one per token. */
typedef struct kvi__dev_args {
  kvi__xfer_args x;
  const int64_t *seg_out; /* device */
  float *out;             /* device */
} kvi__dev_args;

/* One launch (none without segments). Returns a cudaError_t. */
int kvi__cuda_deviation(const kvi__dev_args *a, struct CUstream_st *stream);

/* ---- retrieve-and-inject on the device (cuda/transfer_kernels.cu) ------- */

/* A tenant's directory (CUDA stores without a host tier): row r of its
 * embedding matrix is the fact whose token count is dir[r * stride] and
 * whose page ids follow, one word each. */

/* One query of a retrieve-and-inject call. */
typedef struct kvi__rquery {
  const uint32_t *dir;  /* its tenant's directory (device), or NULL: no facts */
  int64_t first_slot;   /* sequence index of the first injected token */
  int64_t cap;          /* tokens its block table holds from first_slot on */
  int32_t stride;       /* words per directory row */
  int32_t spf;          /* segments reserved per fact */
  int32_t nres;         /* facts reserved: the search finds at most this many */
  int32_t seg0;         /* its first segment: nres * spf of them */
  int32_t start_position;
  int32_t best_last;    /* 1: inject the best fact last */
} kvi__rquery;

/* One request's fact ids to look up in its tenant's row ids
 * (kvi_inject_batched with device fact ids). */
typedef struct kvi__idreq {
  const uint64_t *ids; /* the tenant's row ids (device; row r is fact ids[r]), or NULL: no facts */
  int64_t f0;          /* its first id's index in fact_ids */
  int32_t nf;          /* its ids */
  int32_t nrows;       /* rows of ids */
} kvi__idreq;

/* Host-built bytes that travel inside the plan kernel's parameters, no
 * upload, when they fit (kvi__rplan_args.blob). */
#define KVI__RPLAN_INLINE 8192

/* Writes the injection plan's segments from the search's results: one CTA
 * per query; a query's facts land back to back in rank order. Unused
 * segments get ntok 0. A query whose winners need more than `cap` tokens
 * injects nothing (count 0, its tokens added to *skipped).
 *
 * With `look` (device fact ids), each CTA first finds its request's rows:
 * rows[q * k + f] = the row of fact_ids[look[q].f0 + f] in look[q].ids, -1
 * for KVI_SEARCH_NO_ID (not counted) and for an id its tenant does not hold
 * (one added to *skipped); the query's count is then its nres. The CTA scans
 * the tenant's ids once (every thread a row at a time) against a hash table
 * of the request's ids in shared memory.
 *
 * With blob_bytes > 0 the launch first writes blob[0, blob_bytes) to
 * blob_dst (device, 8-aligned), the plan's host-built part (its requests,
 * tables, queries and lookups); `queries` and `look` may point into it and
 * are then read from the parameters. Its first instruction lets a
 * dependent launch (kvi__xfer_args.pdl) start. */
typedef struct kvi__rplan_args {
  const kvi__rquery *queries; /* device */
  int32_t nq, k, P, seg_tokens;
  int32_t *rows;              /* nq x k tenant rows (device): the search's output, or written here with look */
  const int32_t *counts;      /* nq facts found (device); unused with look */
  kvi__xseg *segs;            /* the plan's segments (device) */
  int32_t *out_counts;        /* nq facts injected (device) */
  int32_t *out_tokens;        /* nq tokens injected (device) */
  unsigned long long *skipped;
  const kvi__idreq *look;     /* nq lookups (device), or NULL */
  const uint64_t *fact_ids;   /* device */
  char *blob_dst;
  int32_t blob_bytes;
  uint64_t blob[KVI__RPLAN_INLINE / 8];
} kvi__rplan_args;

int kvi__cuda_retrieve_plan(const kvi__rplan_args *a, struct CUstream_st *stream);

/* The embedding rows, ids and directory rows of one commit, written by one
 * launch from pinned host memory the device reads in place (unified
 * addressing): for each of the n entries e, e.emb_bytes bytes (a multiple
 * of 16) from src + e.emb_src to e.emb, *e.ids = e.id, and e.dir_words
 * words from src + e.dir_src to e.dir (none when e.dir is NULL). Offsets
 * are multiples of 16. */
typedef struct kvi__row_entry {
  void *emb;
  uint64_t *ids;
  uint32_t *dir;
  uint64_t id;
  uint32_t emb_src, emb_bytes, dir_src, dir_words;
} kvi__row_entry;

typedef struct kvi__emb_rows_args {
  const kvi__row_entry *entries; /* n entries (pinned host) */
  const char *src;               /* the staging the offsets count from (pinned host) */
  int32_t n;
} kvi__emb_rows_args;

int kvi__cuda_emb_rows_set(const kvi__emb_rows_args *a, struct CUstream_st *stream);

/* ---- retrieval (cuda/search_kernels.cu, built with cuBLASLt) ------------- */

/* Queries per scan tile, and the shared memory their fp32 copy may take. */
#define KVI__SCAN_MAX_Q 8
#define KVI__SCAN_SMEM (48 * 1024)
/* Rows one scan CTA handles are a multiple of this (8 warps x 4 rows). */
#define KVI__SCAN_ROWS 32

/* A score tile: the scores of workspace query slots [q0, q0 + qn) against
 * rows [0, nf) of `mat` (device memory, ld elements a row), at
 * scores[off + j * sld + i] for query q0 + j and row i. */
typedef struct kvi__stile {
  const void *mat;
  int64_t off;
  int32_t q0, qn;
  int32_t nf, sld;
} kvi__stile;

/* A scan CTA's share of a tile: rows [r0, r0 + nr). */
typedef struct kvi__sblock {
  int32_t tile;
  int32_t r0, nr;
  int32_t pad_;
} kvi__sblock;

/* One top-k selection (a CTA), writing min(k, na + nb) (score, id) pairs
 * sorted (score descending, id ascending) to pairs[dst...]. Stage 1
 * (ids != NULL): the nb scores at scores[a...] of the score area, whose fact
 * ids are ids[0...] and tenant rows row0...; na = 0. Stage 2 (ids == NULL):
 * the na pairs at pairs[a...] and the nb pairs at pairs[b...]; dst may
 * equal a. With pr (kvi__search_args), each pair also carries its row. */
typedef struct kvi__sel {
  const uint64_t *ids;
  int64_t a, b, dst;
  int32_t na, nb;
  int32_t row0;
  int32_t out; /* >= 0: the last selection of query `out` (dst = slot * k): it writes
                  that query's results to the outputs, as kvi__emit would, instead
                  of pairs; -1: pairs */
} kvi__sel;

/* Query `out`'s results: n pairs from pairs[src...] (0 for a tenant without
 * facts), or none if its slot was found invalid (NaN in a device query).
 * Only for queries without a final selection (kvi__sel.out). */
typedef struct kvi__emit {
  int64_t src;
  int32_t n, out, slot, pad_;
} kvi__emit;

typedef struct kvi__search_args {
  int32_t dtype;     /* the store's embedding dtype */
  int32_t dim, ld;   /* elements per embedding, per stored row */
  int32_t k;
  /* prep: raw queries -> q, one CTA per slot */
  const void *raw;   /* [queries][dim] of raw_dtype */
  int32_t raw_dtype;
  int32_t cosine;
  const int32_t *perm; /* slot -> query index */
  int32_t nq;
  void *q;             /* [nq][ld] of dtype, padding zero */
  int32_t *valid;      /* per slot: 1, or 0 for a query with NaN or infinity */
  unsigned long long *bad; /* device-visible counter of invalid queries */
  /* scan */
  const kvi__stile *tiles;
  const kvi__sblock *blocks;
  int32_t nblocks;
  int32_t qmax;        /* largest qn among the launch's tiles */
  float *scores;       /* the score area */
  /* selection */
  const kvi__sel *sels;
  int32_t nsels;
  float *ps;           /* pairs: scores */
  uint64_t *pi;        /* pairs: fact ids */
  uint32_t *pr;        /* pairs: tenant rows, or NULL (not wanted) */
  /* emit */
  const kvi__emit *emits;
  int32_t nemits;
  uint64_t *out_ids;
  float *out_scores;
  int32_t *out_counts;
  int32_t *out_rows;   /* with pr: nq x k tenant rows (-1 past the count) */
} kvi__search_args;

/* Each enqueues one launch on `stream` and returns its cudaError_t. */
int kvi__cuda_search_prep(const kvi__search_args *a, struct CUstream_st *stream);
int kvi__cuda_search_scan(const kvi__search_args *a, struct CUstream_st *stream);
int kvi__cuda_search_select(const kvi__search_args *a, struct CUstream_st *stream);
int kvi__cuda_search_emit(const kvi__search_args *a, struct CUstream_st *stream);

/* ---- tensor-parallel stores (tp/, cuda/shard_kernels.cu) ---------------- */

/* L x T x H rows of row_bytes, between two layouts with byte strides. */
typedef struct kvi__rows_args {
  void *dst;
  const void *src;
  int64_t dst_stride[3], src_stride[3]; /* layer, token, head */
  int32_t L, T, H;
  int64_t row_bytes;
} kvi__rows_args;

int kvi__cuda_copy_rows(const kvi__rows_args *a, struct CUstream_st *stream);

/* The head of each rank's block in a sharded search. */
typedef struct kvi__shard_hdr {
  int32_t status; /* the rank's kvi_status for its part */
  int32_t nq, k, pad_;
  uint64_t digest; /* of k, nq and the tenants */
} kvi__shard_hdr;

/* Merges `size` blocks (header, nq x k ids, nq x k scores, nq counts) into
 * each query's top k. A failed or disagreeing rank makes every count -1
 * (failed) or -2 (disagreed), ids KVI_SEARCH_NO_ID and scores -infinity. */
typedef struct kvi__merge_args {
  const char *blocks;
  int64_t block_bytes;
  int32_t size, nq, k;
  uint64_t digest;
  uint64_t *out_ids;
  float *out_scores;
  int32_t *out_counts;
} kvi__merge_args;

int kvi__cuda_shard_merge(const kvi__merge_args *a, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVI_KERNELS_H */
