/*
 * libkvinject — the injector's and encoder's insides (lib/xfer/), shared by
 * the files that move facts between the store's pages and an engine's paged
 * cache, rotating keys at their destination positions (inject) or
 * un-rotating them at their source positions (capture):
 *   injector.c  the handles: creation, destruction, their locks, what is read of them
 *   plan.c      jobs (requests and captures, normalized and checked) and plans
 *   execute.c   running a plan: the CPU reference, the kernels' arguments and launches
 *   inject.c    kvi_inject, kvi_inject_deviation, kvi_inject_plan
 *   encode.c    kvi_encode
 *   retrieve.c  kvi_retrieve_inject, and the plans the device completes
 *   batched.c   kvi_encode_batched, kvi_inject_batched
 * SPDX-License-Identifier: Apache-2.0
 *
 * A call is planned on the host under the store's lock: every request or
 * capture is validated, facts are looked up, and the work is cut into
 * segments (runs of at most seg_tokens tokens of one page). The CPU backend
 * executes the segments on the host (the reference); the CUDA backend runs
 * one fused kernel (cuda/transfer_kernels.cu; a capture call, once per
 * KVI__CAPTURE_CHUNK captures, every capture checked first) that finds the
 * plan (segments, positions, host block tables) in its parameters when it is
 * small (up to KVI__INLINE_PLAN bytes, the common single-request case: no
 * upload) and otherwise uploads it in one copy from a pinned staging slot.
 */
#ifndef KVI_XFER_TRANSFER_H
#define KVI_XFER_TRANSFER_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gpu/kernels.h"
#include "store/store.h"
#include "xfer/xfer.h"

#define KVI__XFER_SLOTS 2 /* staging slots of an injector or encoder (xfer.ring) */
/* Captures per kernel launch of a large kvi_encode call; every chunk's plan
 * lies in the call's one staging slot. Small chunks would let the device
 * start while the host planned the rest, but the host's planning is no
 * longer the bottleneck and one launch was faster (BENCHMARKS.md, capture),
 * so a call is one launch up to this size. */
#define KVI__CAPTURE_CHUNK 65536

/* What an injector and an encoder share. */
typedef struct xfer {
  kvi_store *store;
  kvi__cache cache;
  pthread_mutex_t lock;
  kvi_transfer_options lim;
  bool cuda;
  bool vec_ok;     /* the 8-element vector path is valid for this layout */
  int32_t max_pos; /* positions must be below this for every rotated layer */
  int32_t seg_tokens; /* longest segment: bounds the kernel's shared memory */
  int32_t half_max;   /* largest rotary_dim / 2 over the layers */
  int32_t sms;        /* multiprocessors of the store's device */
  bool pdl;           /* the device has programmatic dependent launch (compute capability 9.0 on) */
  /* CUDA */
  char *dev_tables; /* xlayer[L] | k_scale[L*H] | v_scale[L*H] | inv_freq... | tables... */
  kvi__xlayer *d_layers;
  float *d_kscale, *d_vscale;
  /* KVI__XFER_SLOTS staging slots (pinned host and device buffers), each guarded by the last launch that read it */
  kvi__ring ring;
  struct CUevent_st *up[KVI__XFER_SLOTS]; /* slot i's: recorded after its device buffer's upload (on up_stream) */
  struct CUstream_st *up_stream; /* plan uploads (see upload() in execute.c) */
  size_t slot_bytes;
  kvi__async_count skipped; /* tokens and ids the kernels skipped */
  struct CUevent_st *emb_read; /* recorded after a device-planned batch's reads of the store's rows */
  uint64_t small[KVI__INLINE_PLAN / 8]; /* host buffer of plans that travel in the kernel parameters */
} xfer;

struct kvi_injector {
  xfer x;
};
struct kvi_encoder {
  xfer x;
};

/* n rounded up to a multiple of 16 bytes (the plans' and tables' alignment). */
static inline size_t kvi__align_up(size_t n) { return (n + 15) & ~(size_t)15; }

/* a + b for counts >= 0, saturating: a sum past the transfer limits stays past them */
static inline int64_t kvi__sat_add(int64_t a, int64_t b) { return a > INT64_MAX - b ? INT64_MAX : a + b; }

/* A request or capture, normalized. */
typedef struct job {
  const int32_t *table; /* host or device */
  int32_t table_len;
  bool table_on_host;
  int64_t first_slot;
  int64_t tokens;
  const void *positions; /* host or NULL: int32, or int64 with pos64 */
  bool pos64;
  bool kind_checked; /* the table's memory kind was checked for the whole call */
  int64_t start_position;
} job;

/* The plan of one call (or of one chunk of a call's captures): host arrays,
 * laid out as they are uploaded. */
typedef struct plan {
  kvi__xseg *segs;
  kvi__xreq *reqs;
  int32_t *positions;
  int32_t *tables; /* host block-table slices */
  int32_t nsegs, nreqs, ntok, ntables;
  char *buf;  /* holds all of it: malloc'd (CPU), x->small (inline) or a staging slot's pinned buffer */
  kvi__ring_slot *sl; /* the staging slot, or NULL */
  size_t off; /* where buf lies in the slot (a chunk's plan shares the call's slot) */
  size_t o_reqs, o_pos, o_tab, o_ext, bytes; /* o_ext: the caller's own area, after the tables */
  bool uploaded; /* the caller copied it to the slot's device buffer already */
  bool after_plan_kernel; /* its segments are the retrieve-plan kernel's, launched just before */
} plan;

/* What kvi_inject_deviation asks of an injection's plan: scores at `layer`
 * into `out` (host or device memory), nothing written to the cache. */
typedef struct deviation {
  int32_t layer;
  float *out;
  int64_t num_scores; /* entries out holds */
  bool out_on_device;
} deviation;

/* A request of an injection, as both forms of the call give it (kvi_inject's
 * structs, kvi_inject_batched's arrays): its tenant and facts, and its job
 * (table, first slot, positions; tokens still 0). num_positions: the
 * per-request form's check (0: none). expect_ids: the prompt's token ids
 * its facts' stored ids must equal (kvi_inject_request.expect_token_ids). */
typedef struct ireq {
  uint64_t tenant;
  const uint64_t *fact_ids;
  int32_t num_facts;
  int64_t num_positions;
  const int32_t *expect_ids; /* host: one token id per injected token, or NULL (unchecked) */
  bool expect_sized;         /* num_expect is expect_ids' count (the batched form); else trusted */
  int64_t num_expect;
  job j;
} ireq;

/* Positions given for the whole call (kvi_inject_batched): one per token,
 * request after request; NULL pointer: none. */
typedef struct flat_pos {
  const void *p;
  bool pos64;
  int64_t n; /* entries to check against the call's tokens; 0: trusted */
} flat_pos;

/* A request planned on the device (kvi_retrieve_inject's device path and
 * kvi_inject_batched's with device fact ids): its reserve job (checked), its
 * tenant (or NULL), the facts reserved, and where they start. */
typedef struct dreq {
  job j;
  const tenant *t;
  int32_t nres;
  int32_t start_position;
  bool best_last;
} dreq;

/* ---- injector.c ----------------------------------------------------------- */

/* Whether V's block, token or head stride differs from K's. */
bool kvi__xfer_split_v(const xfer *x);
/* The kernel variant's vector width (kvi__xfer_args.vec). */
int32_t kvi__xfer_vec(const xfer *x);
/* Refuses a store with a layer whose RoPE was never set. */
kvi_status kvi__check_rope_set(const xfer *x, const char *fn);
/* The handle's lock, then the store's; released in the reverse order. */
void kvi__lock_both(xfer *x);
void kvi__unlock_both(xfer *x);

/* ---- plan.c: jobs --------------------------------------------------------- */

/* Segments a fact of `npages` pages can need, at most. */
int64_t kvi__segs_for(const xfer *x, int64_t npages);
/* A job's sequence range, block ids and positions: kvi__check_job_slots,
 * then kvi__check_job_positions (which reads explicit positions; a call
 * that has many jobs may check every job's slots first). */
kvi_status kvi__check_job(const xfer *x, const job *j, int32_t index, const char *what, const char *fn);
kvi_status kvi__check_job_slots(const xfer *x, const job *j, int32_t index, const char *what, const char *fn);
kvi_status kvi__check_job_positions(const xfer *x, const job *j, int32_t index, const char *what, const char *fn);
/* A request's block-table memory kind. */
kvi_status kvi__check_table_kind(const xfer *x, kvi_memory memory, int32_t r, const char *fn);
/* A request's job: its table's memory, then kvi__check_job. */
kvi_status kvi__check_request_job(const xfer *x, const job *j, int32_t r, const char *fn);
/* Host block-table entries a job copies into its plan. */
int64_t kvi__host_table_entries(const xfer *x, const job *j);
/* KVI_ERR_CAPACITY for a call larger than the transfer options allow. */
kvi_status kvi__check_limits(const xfer *x, int32_t nreqs, int64_t ntok, int64_t ntables, const char *fn);

/* ---- plan.c: plans -------------------------------------------------------- */

/* A plan's offsets and size; its buffer (kvi__plan_buffer) and its arrays in it (kvi__plan_place). */
void kvi__plan_layout(plan *p, int64_t nsegs, int32_t nreqs, int64_t ntok, int64_t npos, int64_t ntables);
void kvi__plan_place(plan *p, char *buf);
kvi_status kvi__plan_buffer(plan *p, xfer *x, size_t bytes, bool inline_ok, const char *fn);
/* The three of them, the limits checked first, with `ext` bytes of the caller's. */
kvi_status kvi__plan_alloc(plan *p, xfer *x, int64_t nsegs, int32_t nreqs, int64_t ntok, int64_t npos,
                           int64_t ntables, size_t ext, const char *fn);
void kvi__plan_free(const xfer *x, plan *p);
/* A job's request entry; returns its index. */
int32_t kvi__plan_request(plan *p, const xfer *x, const job *j);
/* A fact's tokens as segments of request r. */
void kvi__plan_run(plan *p, const xfer *x, int32_t r, int64_t seq0, int64_t tokens, const void *positions,
                   bool pos64, int32_t start_position, const uint32_t *pages);
/* tests/internal's view of a plan (kvi__plan_view). */
void kvi__view_of_plan(kvi__plan_view *v, const plan *p);

/* ---- execute.c ------------------------------------------------------------ */

/* Runs a plan over layers [lb, le): on the host (CPU) or in one launch (CUDA). */
kvi_status kvi__execute(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                        const char *fn);
/* The CUDA launch of a plan (kvi__execute's device half). */
kvi_status kvi__launch(xfer *x, const plan *p, int32_t lb, int32_t le, bool inject, struct CUstream_st *stream,
                       const char *fn);
/* The plan's caller area a deviation needs, and the scoring of a plan. */
size_t kvi__deviation_ext(const xfer *x, const deviation *dv, int64_t nsegs, int64_t ntok);
kvi_status kvi__run_deviation(xfer *x, plan *p, const deviation *dv, struct CUstream_st *stream, const char *fn);

/* ---- inject.c ------------------------------------------------------------- */

/* The injection of rq[num_requests], both locks held. */
kvi_status kvi__inject_locked(xfer *x, const ireq *rq, int32_t num_requests, const flat_pos *fp, int32_t lb, int32_t le,
                              kvi_host_pages host_pages, const deviation *dv, int32_t *out_tokens,
                              struct CUstream_st *stream, const char *fn);
/* kvi_inject_options read and checked. */
kvi_status kvi__read_inject_options(const xfer *x, const kvi_inject_options *opts, int32_t *lb, int32_t *le,
                                    kvi_host_pages *hp, const char *fn);
/* kvi_inject_batch's expected token ids (CSR, host memory; ids NULL: none)
 * given to its requests, the offsets checked. */
kvi_status kvi__batch_expect(const xfer *x, ireq *rq, int32_t n, const int32_t *ids, const int64_t *off,
                             const char *fn);
/* A kvi_inject_request as the call's request. */
kvi_status kvi__request_of(const xfer *x, const kvi_inject_request *q, int32_t r, ireq *out, const char *fn);
/* The tokens of a tenant's facts (kvi_inject_plan's sum), the store's lock held. */
kvi_status kvi__inject_plan_tokens(const kvi_store *s, uint64_t tenant, const uint64_t *fact_ids, int32_t num_facts,
                                   int64_t *out_tokens, const char *fn);

/* ---- encode.c ------------------------------------------------------------- */

/* kvi_encode (kvi__encode), and kvi_encode_batched's captures: with pos64,
 * each capture's positions (when given) point at int64 positions, narrowed
 * as the plan is written. The captures are checked (counts, ids, tables,
 * the limits) before any capture's positions are read. */
kvi_status kvi__encode_captures(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures, bool pos64,
                                struct CUstream_st *stream, const char *fn);

/* ---- retrieve.c ----------------------------------------------------------- */

/* The plan of n device-planned requests (kvi_retrieve_inject's device path,
 * kvi_inject_batched's device fact ids): segments reserved for each
 * request's facts (written on the device), its kvi__rquery at o_ext, and
 * `extra` bytes of the caller's after them (16-aligned, at
 * o_ext + kvi__align_up(n * sizeof(kvi__rquery))). */
kvi_status kvi__plan_on_device(xfer *x, plan *p, const dreq *d, int32_t n, size_t extra, const char *fn);
/* The device work that completes and runs it, on `stream`: the plan's
 * host-built bytes [o_reqs, host_end) reach the slot (inside the plan
 * kernel's parameters when they fit, else an upload), the retrieve-plan
 * kernel turns rows (n x k tenant rows, -1 skipped; device) and counts into
 * the segments, out_counts and out_tokens (device; out_counts may be
 * counts), then one injection launch, a programmatic dependent of the plan
 * kernel where the device has them. With look (n lookups inside the
 * host-built bytes, and the device fact_ids they index) the plan kernel
 * first writes rows itself and counts go unread (kernels.h,
 * kvi__rplan_args). */
kvi_status kvi__plan_and_inject(xfer *x, plan *p, size_t host_end, int32_t n, int32_t k, int32_t *rows,
                                const int32_t *counts, const kvi__idreq *look, const uint64_t *fact_ids,
                                int32_t *out_counts, int32_t *out_tokens, int32_t lb, int32_t le,
                                struct CUstream_st *stream, const char *fn);

#endif
