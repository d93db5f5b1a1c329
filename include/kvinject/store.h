/*
 * libkvinject — the fact store (kvi_store).
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * A store keeps facts keyed by (tenant, fact id). A fact is T tokens of
 * pre-RoPE K and V for every layer and every local KV head of the model it
 * was created for, plus an optional embedding. Tenants are namespaces: no
 * call made for tenant A reads, lists or counts tenant B's facts.
 *
 * Memory. A store reserves its whole budget once, at creation, and cuts it
 * into pages of a fixed number of tokens (page_tokens). A fact occupies
 * ceil(T / page_tokens) pages anywhere in the pool, so puts and removes never
 * allocate or free page memory and the budget never fragments: a put fails
 * with KVI_ERR_CAPACITY only when fewer pages are free than it needs. The
 * layout of a page is internal; read facts back with kvi_store_read.
 * Embeddings are kept apart from the pages, outside the budget: one
 * contiguous matrix per tenant (device memory on a CUDA store) that grows by
 * doubling, so that search reads it in one pass (kvinject/search.h,
 * kvi_store_stats.bytes_embeddings).
 *
 * Backends. A CPU store keeps its pages in host memory and only accepts host
 * buffers. A CUDA store keeps them in device memory of its device and accepts
 * host or device buffers. The handle is bound to its device at creation; the
 * library switches the calling thread's current device only for the duration
 * of a call and restores it before returning.
 *
 * Streams. Calls on a CUDA store that read or write device buffers enqueue
 * their copy on the stream given as last argument (NULL: the default stream)
 * and return once it is enqueued. The caller keeps device source buffers
 * valid and unchanged until the stream has passed the copy, and orders work
 * on other streams that reads a fact after the stream that wrote it. Calls
 * with a host buffer return only after the data has been copied (the host
 * buffer may be reused at once). A CPU store ignores the stream.
 *
 * Removing or replacing a fact is stream-ordered: pages that device work
 * already enqueued (an injection, a read into device memory, a put from
 * device memory) still reads or writes return to the pool only once that
 * work has completed; a later put that needs them waits for it. A remove
 * made when every such operation of the store has completed returns the
 * pages at once (kvi_store_stats.pages_used says when they are counted).
 *
 * Tiers. A CUDA store created with host_budget_bytes > 0 keeps a second
 * pool of pages in pinned (page-locked, mapped) host memory. A fact's pages
 * are all on one tier. Placement:
 *   - kvi_store_put puts a new fact on the device when the device pool has
 *     room for all of it, else on the host; it demotes nothing (host-memory
 *     sources then need no device copy at all). It fails with
 *     KVI_ERR_CAPACITY only when neither tier has room for the fact.
 *   - kvi_encode (kvinject/inject.h) captures into device pages; when the
 *     device pool is short it first demotes least-recently-injected facts.
 *   - kvi_inject brings the call's host-resident facts up before its kernel
 *     reads them (kvi_inject_options.host_pages = KVI_HOST_PAGES_PROMOTE, the
 *     default): one cudaMemcpyAsync per run of consecutive pages on the
 *     store's copy stream, after demoting, if the device pool is short, the
 *     least-recently-injected device facts that the call does not use; an
 *     event then orders the injection after the copies. Facts injected (and
 *     facts put or captured onto the device) become the most recently used.
 *     Demoting needs free host pages; when the call's facts cannot all be on
 *     the device at once, or the host has no room for what must move down,
 *     the call fails with KVI_ERR_CAPACITY and moves and writes nothing.
 *     With KVI_HOST_PAGES_READ_MAPPED the kernel reads host pages in place
 *     over the bus instead, moving nothing.
 *   - kvi_store_prefetch starts moving facts up ahead of an injection.
 * Moves are stream-ordered like frees: a device page is overwritten only
 * after every earlier device operation on the store's pages has completed,
 * and every later call that reads a moved fact (inject, read, save) is
 * ordered after the move. Tiers change no result: an injection reads the
 * same bytes from either tier.
 *
 * Disk tier. A store created with kvi_store_options.disk_dir (CPU or CUDA,
 * with or without a host tier) keeps every fact of a tenant in that tenant's
 * file, "<disk_dir>/<tenant as 16 lowercase hex digits>.kvi", a store file
 * of kvinject/persist.h's format holding that tenant's facts only
 * (docs/store-format.md), and its memory tiers become a cache of the files:
 *   - Written through. kvi_store_put (and put_scatter), kvi_store_remove(_ex)
 *     and kvi_encode append their records to the tenant's file and flush
 *     them (fdatasync) before they return KVI_OK, as a journal does: one
 *     entry per call and tenant, all or nothing; a crash loses nothing
 *     acknowledged and a torn final entry is ignored (the next writer cuts it
 *     off). A failed append or flush fails the call, which changes nothing in
 *     memory (a call over several tenants takes back what it appended to the
 *     others). Files are mode 0600. Once the bytes of a file's superseded
 *     records pass those of its live ones, the next write of the tenant first
 *     rewrites the file (a temporary renamed over it, as kvi_store_save).
 *   - Memory as a cache. When a put, capture, read back or promotion needs
 *     pages and the pool is short, the least recently used facts that no call
 *     is reading are dropped from memory (a tiered store's host tier first):
 *     their pages go back to the pool and the facts stay stored, "on disk".
 *     Every call that reads a fact's K and V (kvi_inject, kvi_inject_batched
 *     with host fact ids, kvi_retrieve_inject, kvi_store_read, kvi_store_save)
 *     reads a fact that is on disk back first, synchronously: its record read
 *     and its checksum checked, into pages (a tiered store's host tier, then
 *     promoted as usual; a CUDA store without one through pinned staging).
 *     A checksum covers an entry (one call's records of a tenant), so a read
 *     back reads its fact's whole entry; reads back under way at once share
 *     one read of an entry (a prefetch of the facts one kvi_encode call
 *     captured reads that entry once).
 *     A call whose facts do not fit in memory at once fails with
 *     KVI_ERR_CAPACITY. A disk-tier store keeps no device directory: fact ids
 *     in device memory (kvi_inject_batched) are KVI_ERR_UNSUPPORTED, and
 *     kvi_retrieve_inject looks facts up on the host (as on a tiered store).
 *     Embeddings, token ids and contexts stay in memory for every fact.
 *   - Leases. A store writes a tenant only while it holds the tenant's
 *     lease, the file "<tenant>.lease" beside it (owner name and wall-clock
 *     expiry, read and written under flock(LOCK_EX) on it). The first write
 *     takes it when it is free, expired or this store's, for
 *     disk_lease_ms; a write renews it when less than half is left. Another
 *     owner's live lease fails the write with KVI_ERR_LEASED (the message
 *     names the owner and the milliseconds left), changing nothing. Taking a
 *     lease that another owner had, or for a tenant whose file changed (size,
 *     mtime or inode) since this store last read or wrote it, first reads the
 *     tenant again from its file: a user who moves to another replica finds
 *     all their facts there. kvi_store_tenant_release gives a lease up;
 *     kvi_store_destroy gives up the store's. Replicas' clocks must agree to
 *     well within disk_lease_ms. On NFS, flock is emulated with byte-range
 *     locks (NFSv4: lock state held by the server; NFSv3: needs lockd) and
 *     close-to-open consistency is what makes a file's changes visible to
 *     another client: use NFSv4 and leases of seconds, not milliseconds.
 *   - Loading. Any store may read any tenant's file, without its lease:
 *     kvi_store_prefetch(store, tenant, NULL, 0, stream) of a tenant the
 *     store does not have, or whose file changed since the store read it
 *     while the store holds no lease on it, indexes the tenant from its file
 *     (facts on disk), then reads back as many of its facts as fit in memory
 *     (most recently written first). This is the one way a store learns of
 *     tenants written by others; a store also reads a tenant's file when it
 *     first writes it.
 *   - Errors. A directory that is missing or cannot be written fails
 *     kvi_store_create with KVI_ERR_IO naming it. A write that would pass
 *     disk_budget_bytes is KVI_ERR_CAPACITY ("the disk tier is full"); a
 *     full file system (ENOSPC, EDQUOT, EFBIG) is KVI_ERR_IO naming the file
 *     and the system's error; either way the call changes nothing and the
 *     stored facts stay usable. A damaged tenant file (anything but a torn
 *     final entry) is KVI_ERR_CORRUPT for calls on that tenant only.
 *   - Descriptors. A store keeps at most 256 tenant files open (and one
 *     descriptor per lease file only while it reads or writes it): past that
 *     it closes the least recently used one and reopens a file when the
 *     tenant is used again, so a store of any number of tenants stays within
 *     the process's descriptor limit. A file that another replica replaced
 *     while it was closed is read anew before this store writes the tenant;
 *     a read back of a fact from it is KVI_ERR_IO until
 *     kvi_store_prefetch(store, tenant, NULL, 0, ...) indexes it again.
 *   - Threads. Writes, and the reads back of a call that needs a fact,
 *     happen under the store's lock (other calls on the store wait for
 *     them). kvi_store_prefetch's reads are asynchronous: it takes each
 *     fact's pages under the lock and queues the read on a thread the store
 *     starts at its first such prefetch; the thread reads the file without
 *     the lock, so calls on facts in memory go on meanwhile, then publishes
 *     the fact under the lock (a CUDA store's: the next call that needs the
 *     fact, the next prefetch, or kvi_store_prefetch_wait). A call that needs a fact being read waits
 *     for that read instead of reading it again; a call short of memory
 *     waits for the reads in flight, whose pages it may then reclaim. Until
 *     published a fact counts as on disk (kvi_store_fact_tier,
 *     facts_on_disk_only). kvi_store_destroy stops the thread.
 *   - Not with: a communicator (KVI_ERR_UNSUPPORTED), kvi_store_load
 *     (KVI_ERR_UNSUPPORTED: create the store and prefetch its tenants).
 *     kvi_store_fact_tier says where a fact is, kvi_store_list_on_disk which
 *     of a tenant's are on disk only; kvi_store_stats counts the facts on
 *     disk only, file bytes, reads, writes and drops.
 *
 * fp8 storage (kvi_store_options.dtype = KVI_DTYPE_FP8_E4M3) about halves
 * the bytes of bf16. Every page keeps, beside its e4m3 elements, one fp32
 * scale per (layer, K/V, head) for that page's tokens: a group is one head's
 * tokens of one page (at most page_tokens of them; a fact's last page only
 * the fact's tokens), finer than a scale per fact. Keys also keep one fp16
 * offset m per channel of each (layer, head) and page, over the same tokens:
 * a key channel with a large bias (LLM keys have them: Qwen2.5-1.5B's layer
 * 0 channel 63 is about 358 with a standard deviation of 1) is stored as its
 * variation around m, not as its magnitude. Writing a group
 * (kvi_store_put from an fp32/fp16/bf16 view, kvi_encode), x in fp32 (after
 * conversion from the view's dtype or, for kvi_encode, after un-rotation
 * and the cache's own fp8 scale):
 *   m     = keys: with lo the channel's smallest finite value rounded
 *           down and hi its largest rounded up to fp16 (saturated to
 *           +-65504): when the channel lies on one side of zero in a band
 *           narrower than its distance from zero (0 < lo and hi - lo < lo,
 *           or hi < 0 and hi - lo < -hi; hi - lo in fp32), the midpoint
 *           (lo + hi) * 0.5 in fp32 rounded to the nearest fp16 (ties to
 *           even), so every |x - m| is at most about half of |x|; else (a
 *           channel around zero keeps e4m3's relative precision near zero;
 *           no finite value) 0. Values: none;
 *   amax  = the largest |x - m| (values |x|) over the group's finite values,
 *           x - m one fp32 subtraction;
 *   scale = max(amax / 448, 2^-126), one fp32 division;
 *   byte  = e4m3((x - m) / scale) (values e4m3(x / scale)), one fp32
 *           subtraction then one fp32 division, rounded to nearest even;
 *           as amax maps to 448, only infinities saturate.
 * Reading (kvi_store_read, kvi_inject): value = fmaf(e4m3, scale, m) in
 * fp32, one rounding (values e4m3 * scale), then (inject) rotation in fp32
 * and conversion to the cache's dtype, in the same fused kernel. The CPU
 * and CUDA backends produce the same bytes, scales and offsets for the same
 * input (a capture only where the rotation itself is bit-exact: an engine
 * cos/sin table). Error: at most 2^-4 of |x - m| (values |x|) for |x - m|
 * within 2^-6 * scale .. amax (e4m3's normal range), plus the fp32
 * roundings of x - m and of the value (a few 2^-24 of |x| + |m|); smaller
 * ones are kept in steps of 2^-9 * scale. So a banded channel's (a bias
 * channel's) key error is bounded by 2^-4 of its group's largest |x - m|
 * (m within half the channel's range, plus an fp16 step or two, of every
 * value), no longer by 2^-4 of its largest |x|; other channels' errors are
 * as without offsets. A group of zeros is exact (values keep the sign of zero,
 * keys read back +0). Non-finite input is accepted, not rejected (device
 * sources and captures could only report it late): NaN stays NaN;
 * +-infinity is stored as the code +-448 (keys read back
 * fmaf(+-448, scale, m)); both are left out of m and amax.
 * Bytes: a page holds its elements (layers x 2 x heads x page_tokens x
 * head_size bytes), then the scales (layers x 2 x heads x 4), then the key
 * offsets (layers x heads x head_size x 2), each part 16-byte aligned;
 * kvi_store_stats.page_bytes includes them, and bytes_payload counts them
 * for every page used. Per token and head, against bf16's 4 x head_size
 * bytes (K and V), that is 1/2 + 1/(2 x page_tokens) of bf16 plus the
 * scales: 16-token pages (the default) 0.53 x bf16, 64-token pages 0.51 x.
 * Store files keep elements, scales and offsets as they are, so a loaded
 * fp8 store equals the saved one bit for bit (kvinject/persist.h; files
 * before format version 4 have no offsets: their keys read back as before,
 * e4m3 * scale). page_tokens trades the error against the scales' and
 * offsets' bytes; 16 (the default) keeps relative K error within a few
 * percent on LLM-shaped data (tests/bench/fp8_error.c; BENCHMARKS.md).
 *
 * 4-bit storage (kvi_store_options.dtype = KVI_DTYPE_Q4) keeps every
 * element as a 4-bit code, two a byte, with an fp16 scale s and an fp16
 * minimum m per group, grouped as KV caches
 * quantize best: keys per channel (a group is one channel of one head and
 * layer over a page's tokens, at most page_tokens of them: keys' outlier
 * channels get their own range), values per token (a group is one token's
 * head vector, head_size channels). A fact's last page groups only the
 * fact's tokens; every group lies in one page, so pages stay independent.
 * Writing a group (kvi_store_put from an fp32/fp16/bf16 view, kvi_encode):
 *   m = its smallest finite value rounded down to fp16, M = its largest
 *       rounded up (both saturated to +-65504; none finite: m = M = 0);
 *   s = (M - m) / 15 in fp32 rounded up to fp16, raised by fp16 steps while
 *       fmaf(15, s, m) < M;
 *   code = rint((x - m) / s) in fp32 (nearest even), clamped to 0..15
 *       (s = 0: 0); NaN is code 0, +inf 15, -inf 0.
 * Reading (kvi_store_read, kvi_inject): value = fmaf(code, s, m) in fp32,
 * then (inject) rotation in fp32 and conversion to the cache's dtype (fp32,
 * fp16, bf16, fp8 with its scale), in the same pass. Error: for every finite
 * x of a group within fp16's range, |x - value| <= s / 2 (plus fp32
 * rounding: a few 2^-24 of |x| + |m| + |M|), s being at most one fp16 step
 * above (M - m) / 15; a group of equal values that fp16 holds is exact
 * (-0 reads back as +0); values beyond +-65504 read back as +-65504 at
 * most; NaN reads back as m. Bytes: a page holds its codes (layers x 2 x
 * heads x page_tokens x head_size / 2 bytes), then 4 bytes per key channel
 * and per value token of each layer and head (layers x heads x (head_size +
 * page_tokens) x 4), each part 16-byte aligned. Per token and head, against
 * bf16's 4 x head_size bytes (K and V), that is 1/4 + 1/page_tokens +
 * 1/head_size of bf16: head size 128 with 64-token pages: (64 + 64 + 4 x
 * 128 / 64 + 4) / 512 = 140 / 512 = 0.273 x bf16; 32-token pages 0.289 x,
 * 16-token pages (the default) 0.320 x, 128-token pages 0.266 x. Larger
 * pages also widen the key groups (the error grows with a channel's range
 * over more tokens) and round facts up to more tokens; 64 is a fair
 * choice for 4-bit stores. kvi_dtype_size(KVI_DTYPE_Q4) is 0;
 * kvi_store_stats.page_bytes has a page's bytes. Store files keep codes
 * and scales as they are (a loaded 4-bit store equals the saved one bit for
 * bit; files load only into a 4-bit store of the same page_tokens). A
 * model whose head size is odd cannot have a 4-bit store
 * (KVI_ERR_UNSUPPORTED). Both backends do everything above with the same
 * arithmetic (lib/base/q4.h, compiled for host and device): a CUDA store's
 * puts and reads of host views quantize on the CPU through the staging
 * pages, of device views in a kernel, with the same bytes as a CPU store;
 * injection and capture run in the fused kernel (with an engine cos/sin
 * table, the same bits as the CPU); kvi_inject_deviation reads the same
 * values on both. Measured on LLM-shaped data (tests/bench/fp8_error.c,
 * BENCHMARKS.md): relative error K 3-8.5% (4-token pages to one page per
 * fact), V 10%, against fp8's 2-2.6%; 2-bit codes, simulated there, cost
 * 4-5x more and are not offered.
 *
 * Thread rules: every function below may be called from several threads at
 * once on the same store, except kvi_store_destroy, which must not overlap
 * any other call on it. Calls are serialized by a lock in the store.
 *
 * Failed calls change nothing: a put that fails leaves any existing fact with
 * that key as it was, a remove that fails removes nothing.
 *
 * Token ids (experimental). A fact may keep the token ids (int32) its K and V
 * were computed from: given to kvi_store_put (kvi_put_options.token_ids) or
 * kvi_encode (kvi_capture.token_ids), kept in host memory on every backend,
 * replaced with the fact (KVI_PUT_REPLACE), freed with it, written to store
 * files and journals (kvinject/persist.h), and checked by injections that ask
 * for it (kvi_inject_request.expect_token_ids). With them the store keeps
 * their hash: FNV-1a 64 over the ids' bytes as little-endian int32 (offset
 * basis 0xcbf29ce484222325, prime 0x100000001b3; each id contributes its 4
 * bytes, least significant first), so that a client computes the same value.
 * A fact without token ids has hash 0.
 *
 * Context and stale facts (experimental). A fact's K and V may have been
 * computed with other facts of its tenant in context (an encoding that puts
 * a user's earlier facts before each new one): their information then lives
 * on in its K and V. A fact may record those facts' ids, its context: given
 * to kvi_store_put (kvi_put_options.context_ids) or kvi_encode
 * (kvi_capture.context_ids, kvi_encode_batch.context_ids), kept in host
 * memory on every backend, replaced with the fact (KVI_PUT_REPLACE), freed
 * with it, written to store files and journals (kvinject/persist.h), and
 * read back by kvi_store_fact_context. Each context id must name a fact of
 * the same tenant that is stored when the call is made, or that the same
 * call stores before it (an earlier capture or item of the call), and not
 * the fact itself: else the call fails and stores nothing.
 * Removing a fact makes stale, so that forgetting holds by construction,
 * every fact of its tenant whose context names it, and then every fact
 * whose context names a stale fact, until none is left (kvi_store_remove;
 * kvi_store_remove_ex with KVI_REMOVE_KEEP_DEPENDENTS removes the fact
 * alone). A fact stored with a stale fact in its context is stale from the
 * start. A stale fact stays stored and readable (kvi_store_read), but every
 * call that reads K and V for serving (kvi_inject, kvi_inject_batched,
 * kvi_retrieve_inject) refuses it with KVI_ERR_STALE and writes nothing;
 * calls that take fact ids in device memory, and retrieval (whose search
 * may pick any fact), refuse a tenant that has stale facts. A stale fact
 * becomes fresh only when it is put again (KVI_PUT_REPLACE, or a capture
 * with KVI_PUT_REPLACE) with a context free of stale facts; kvi_store_stale
 * lists a tenant's stale facts, the ones to encode again (or remove).
 * Replacing a fact does not make the facts that name it stale: a caller that
 * supersedes a fact's content removes it first. The stale flag is written
 * to store files and journals: a reloaded store refuses the same facts.
 */
#ifndef KVINJECT_STORE_H
#define KVINJECT_STORE_H

#include "kvinject/common.h"
#include "kvinject/model.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvi_store kvi_store;

/* ------------------------------------------------------------------------ */
/* Dense K/V buffers                                                        */
/* ------------------------------------------------------------------------ */

/*
 * A dense K/V buffer with shape [num_layers][num_tokens][num_heads][head_size]
 * for K and the same for V. Element (l, t, h, d) of K is at
 *   k + (l * layer_stride + t * token_stride + h * head_stride + d) * elem_size
 * and likewise for V with the same strides: head vectors are contiguous.
 * Strides are in elements and >= 0. This covers the usual engine buffers:
 * a per-layer [T, H, D] tensor stacked over layers, [L, T, H*D], K and V
 * halves of one [T, 2, H, D] buffer (v = k + H*D), and so on.
 *
 * Used as a source (kvi_store_put) it may alias itself (a stride of 0
 * repeats data); used as a destination (kvi_store_read) no two elements
 * may share an address.
 */
typedef struct kvi_kv_view {
  size_t struct_size;  /* sizeof(kvi_kv_view) */
  kvi_memory memory;   /* where k and v point (required) */
  kvi_dtype dtype;     /* FP32, FP16 or BF16 (required) */
  int32_t num_layers;  /* must equal the model's layers */
  int32_t num_tokens;  /* >= 1 */
  int32_t num_heads;   /* must equal the model's local heads */
  int32_t head_size;   /* must equal the model's head size */
  int64_t layer_stride;
  int64_t token_stride;
  int64_t head_stride;
  void *k;             /* K data; read-only when used as a source */
  void *v;             /* V data; read-only when used as a source */
} kvi_kv_view;

#define KVI_KV_VIEW_INIT {sizeof(kvi_kv_view), KVI_ENUM_ZERO(kvi_memory), KVI_ENUM_ZERO(kvi_dtype), 0, 0, 0, 0, 0, 0, 0, NULL, NULL}

/* Fills *view with KVI_KV_VIEW_INIT for a struct of `size` bytes (pass sizeof *view):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_kv_view_init(kvi_kv_view *view, size_t size);

/*
 * Fills *view for contiguous buffers of shape [layers][tokens][heads][head_size]
 * (row-major): layer_stride = tokens*heads*head_size, token_stride =
 * heads*head_size, head_stride = head_size. Checks nothing beyond view != NULL;
 * the call that uses the view checks the rest. Writes the struct's first
 * version (every field above) and sets struct_size to its size, in this
 * version and every later one: fields appended later keep their defaults.
 */
KVI_API void kvi_kv_view_contiguous(kvi_kv_view *view, kvi_memory memory, kvi_dtype dtype,
                                    int32_t num_layers, int32_t num_tokens, int32_t num_heads,
                                    int32_t head_size, void *k, void *v);

/* ------------------------------------------------------------------------ */
/* Creation                                                                 */
/* ------------------------------------------------------------------------ */

/* How a store scores a query against its fact embeddings
 * (kvi_store_options.metric; see kvinject/search.h). */
typedef enum kvi_metric {
  /* score = sum over i of q[i] * e[i] */
  KVI_METRIC_INNER_PRODUCT = 0,
  /* embeddings are scaled to unit length when they are put, queries when
   * they are searched; the score is then their inner product. A vector of
   * zeros stays zero (it scores 0 against everything). */
  KVI_METRIC_COSINE = 1
} kvi_metric;

/* Where a tensor-parallel store keeps fact embeddings
 * (kvi_store_options.embedding_placement; see kvinject/comm.h). */
typedef enum kvi_embedding_placement {
  KVI_EMBEDDINGS_REPLICATED = 0, /* every rank keeps every embedding; search is rank-local */
  KVI_EMBEDDINGS_SHARDED = 1     /* each embedding on one rank; search is collective */
} kvi_embedding_placement;

struct kvi_comm; /* kvinject/comm.h */

typedef struct kvi_store_options {
  size_t struct_size;     /* sizeof(kvi_store_options) */
  kvi_backend backend;    /* default KVI_BACKEND_AUTO */
  int32_t device;         /* CUDA ordinal; -1 (default) = the calling thread's
                             current device. Ignored by the CPU backend. */
  kvi_dtype dtype;        /* storage type: BF16 (default), FP16, FP32, FP8_E4M3
                             (scaled per page, layer, K/V and head: see above)
                             or Q4 (4-bit: "4-bit storage" above);
                             FP8_E5M2 is KVI_ERR_UNSUPPORTED */
  int32_t page_tokens;    /* tokens per page, 1..4096, default 16 */
  uint64_t budget_bytes;  /* memory to reserve for pages (required, >= one page);
                             rounded down to whole pages */
  int32_t embedding_dim;  /* elements per fact embedding, 0..65536; 0 (default)
                             = the store keeps no embeddings */
  kvi_dtype embedding_dtype; /* how embeddings are kept: FP32 (default), FP16 or
                                BF16. Each value is rounded to nearest even when
                                it is put; search scores the rounded values. */
  kvi_metric metric;      /* KVI_METRIC_INNER_PRODUCT (default) or KVI_METRIC_COSINE */
  struct kvi_comm *comm;  /* NULL (default), or the tensor-parallel group's
                             communicator: creation becomes collective
                             (kvinject/comm.h). Borrowed: it must outlive the store. */
  kvi_embedding_placement embedding_placement; /* with comm: REPLICATED (default) or SHARDED */
  uint64_t host_budget_bytes; /* CUDA stores: pinned host memory to reserve for a second
                                 tier of pages (see "Tiers" above), rounded down to
                                 whole pages; 0 (default) = device pages only. A CPU
                                 store (also one chosen by KVI_BACKEND_AUTO) takes
                                 only 0: anything else is KVI_ERR_INVALID_ARGUMENT. */
  /* The disk tier (see "Disk tier" below). */
  const char *disk_dir;       /* host memory, a NUL-terminated path of an existing,
                                 writable directory that keeps one file per tenant;
                                 copied. NULL (default): no disk tier. */
  uint64_t disk_budget_bytes; /* bytes of tenant files this store may hold in
                                 disk_dir (the files it wrote or read); 0 (default):
                                 no limit but the file system's */
  const char *disk_owner;     /* host memory, this replica's name in leases (at most
                                 200 bytes, no newline); copied. NULL (default):
                                 "<hostname>:<pid>" */
  int32_t disk_lease_ms;      /* length of a tenant's ownership lease, 1..2^31-1 ms;
                                 0 or the default: 30000 */
} kvi_store_options;

#define KVI_STORE_OPTIONS_INIT                                                                                   \
  {sizeof(kvi_store_options), KVI_BACKEND_AUTO, -1, KVI_DTYPE_BF16, 16, 0, 0, KVI_DTYPE_FP32, KVI_METRIC_INNER_PRODUCT, \
   NULL, KVI_EMBEDDINGS_REPLICATED, 0, NULL, 0, NULL, 30000}

/* Fills *opts with KVI_STORE_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_store_options_init(kvi_store_options *opts, size_t size);

/*
 * Creates a store for `model` (host memory; the store copies the geometry and
 * RoPE specs it needs, so the model may be destroyed afterwards) and reserves
 * opts->budget_bytes of page memory: device memory for a CUDA store (plus a
 * pinned host staging buffer of a few MiB for host-memory puts and reads, and
 * opts->host_budget_bytes of pinned, mapped host memory for the host tier),
 * host memory for a CPU store.
 * out: host memory; receives the store, owned by the caller (kvi_store_destroy).
 * opts: host memory, required (the budget has no default).
 * Backend choice: KVI_BACKEND_AUTO takes CUDA when the library has it and a
 * device answers, else the CPU; KVI_BACKEND_CUDA fails rather than falling
 * back.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, a field out of range, a budget
 * smaller than one page), KVI_ERR_STRUCT_SIZE, KVI_ERR_NOT_BUILT (CUDA asked
 * for, not built), KVI_ERR_NO_DEVICE, KVI_ERR_OUT_OF_MEMORY (the budget or
 * the host budget could not be reserved), KVI_ERR_CUDA. host_budget_bytes
 * other than 0 on a CPU store, or smaller than one page, is
 * KVI_ERR_INVALID_ARGUMENT.
 */
KVI_API kvi_status kvi_store_create(kvi_store **out, const kvi_model *model,
                                    const kvi_store_options *opts);

/* Frees the store and all its memory. NULL is a no-op. Work enqueued on
 * streams that reads or writes the store must be complete. */
KVI_API void kvi_store_destroy(kvi_store *store);

/* ------------------------------------------------------------------------ */
/* Facts                                                                    */
/* ------------------------------------------------------------------------ */

/* kvi_put_options.flags */
#define KVI_PUT_REPLACE 0x1u /* replace an existing (tenant, fact id) */

typedef struct kvi_put_options {
  size_t struct_size;          /* sizeof(kvi_put_options) */
  uint32_t flags;              /* KVI_PUT_* bits, default 0 */
  const void *embedding;       /* embedding_dim elements; required when the
                                  store keeps embeddings, else must be NULL */
  kvi_dtype embedding_dtype;   /* FP32 (default), FP16 or BF16 */
  kvi_memory embedding_memory; /* default KVI_MEMORY_HOST */
  /* Experimental (common.h, "Stability"): host memory, the fact's token ids,
   * kv->num_tokens of them, kept by the store with their hash (see "Token
   * ids" below); or NULL (default): a fact without token ids. */
  const int32_t *token_ids;
  /* Experimental: host memory, the fact's context (see "Context and stale
   * facts" below), num_context_ids fact ids of the same tenant; or NULL with
   * num_context_ids 0 (default): none. */
  const uint64_t *context_ids;
  int32_t num_context_ids; /* >= 0 */
} kvi_put_options;

#define KVI_PUT_OPTIONS_INIT {sizeof(kvi_put_options), 0u, NULL, KVI_DTYPE_FP32, KVI_MEMORY_HOST, NULL, NULL, 0}

/* Fills *opts with KVI_PUT_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_put_options_init(kvi_put_options *opts, size_t size);

/*
 * Stores a fact: kv->num_tokens tokens of pre-RoPE K and V for every layer and
 * local head, converted to the store's dtype (round to nearest even; an fp8
 * store quantizes each page's heads with their own scale, a 4-bit store its
 * key channels and value tokens, see above), and the
 * embedding: converted to fp32, scaled to unit length for KVI_METRIC_COSINE
 * (in double precision), then rounded to the store's embedding_dtype. It is
 * searchable (kvi_store_search) as soon as this returns.
 * kv:   the source (host memory struct; kv->k/kv->v in kv->memory). Its
 *       num_layers, num_heads and head_size must equal the model's layers,
 *       local heads and head size. dtype FP32, FP16 or BF16.
 * opts: host memory, or NULL for KVI_PUT_OPTIONS_INIT.
 * stream: used by a CUDA store for a device source (see Streams above).
 * The fact is visible to every other call as soon as this returns.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, num_tokens < 1, negative strides, a
 * view whose extent overflows, unknown flags, an embedding containing NaN or
 * infinity or a value too large for the store's embedding_dtype, an embedding
 * given to a store without embeddings or missing from one with,
 * num_context_ids < 0, context_ids NULL with num_context_ids > 0, a context id
 * equal to fact_id),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_MISMATCH (layers, heads, head size,
 * or an FP8 or Q4 dtype; a value that is no kvi_dtype is KVI_ERR_INVALID_ARGUMENT),
 * KVI_ERR_MEMORY_KIND (device memory declared as
 * host or the reverse, where detectable; device memory given to a CPU store;
 * memory of another device), KVI_ERR_NOT_FOUND (a context id that names no
 * stored fact of the tenant), KVI_ERR_EXISTS (key present, no
 * KVI_PUT_REPLACE), KVI_ERR_CAPACITY (not enough free pages; with
 * KVI_PUT_REPLACE the new copy is written before the old one is freed, so it
 * needs room for both), KVI_ERR_OUT_OF_MEMORY (including the tenant's
 * embedding matrix that could not grow), KVI_ERR_CUDA.
 */
KVI_API kvi_status kvi_store_put(kvi_store *store, uint64_t tenant, uint64_t fact_id,
                                 const kvi_kv_view *kv, const kvi_put_options *opts,
                                 struct CUstream_st *stream);

/*
 * Copies a stored fact's K and V into `dst`, converted to dst->dtype (FP32,
 * FP16 or BF16; an fp8 store's values are e4m3 * scale in fp32, a 4-bit
 * store's fmaf(code, scale, minimum) in fp32, then rounded to dst->dtype).
 * dst->num_tokens must equal the fact's token count and its other
 * dimensions the model's. A device destination (CUDA store only) is
 * written on `stream`; a host destination is written before the call returns.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, strides that overlap),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_NOT_FOUND, KVI_ERR_MISMATCH,
 * KVI_ERR_MEMORY_KIND, KVI_ERR_CUDA.
 */
KVI_API kvi_status kvi_store_read(const kvi_store *store, uint64_t tenant, uint64_t fact_id,
                                  const kvi_kv_view *dst, struct CUstream_st *stream);

/* A fact's token count into *out_tokens (host memory).
 * Errors: KVI_ERR_INVALID_ARGUMENT, KVI_ERR_NOT_FOUND. */
KVI_API kvi_status kvi_store_fact_tokens(const kvi_store *store, uint64_t tenant,
                                         uint64_t fact_id, int32_t *out_tokens);

#ifdef KVI_ENABLE_EXPERIMENTAL
/*
 * A fact's token ids (see "Token ids" above): writes them to out_ids (host
 * memory, capacity entries; may be NULL when capacity is 0), their count to
 * *out_num and their hash to *out_hash (host memory; out_hash may be NULL).
 * A fact stored without token ids gives *out_num 0 and hash 0. A fact with
 * them has one per token: size out_ids with kvi_store_fact_tokens.
 * Errors (nothing written): KVI_ERR_INVALID_ARGUMENT (NULL store or out_num,
 * capacity < 0, out_ids NULL with capacity > 0), KVI_ERR_NOT_FOUND,
 * KVI_ERR_CAPACITY (capacity smaller than the fact's count of ids).
 */
KVI_EXPERIMENTAL kvi_status kvi_store_fact_token_ids(const kvi_store *store, uint64_t tenant, uint64_t fact_id,
                                                     int32_t *out_ids, int32_t capacity, int32_t *out_num,
                                                     uint64_t *out_hash);
#endif

/* A fact's embedding as the store keeps it (scaled for KVI_METRIC_COSINE and
 * rounded to embedding_dtype), converted exactly to fp32, into out (host
 * memory, embedding_dim floats). On a CUDA store this waits for the store's
 * pending changes to its device embeddings, which are ordered after searches
 * already enqueued. Errors: KVI_ERR_INVALID_ARGUMENT (NULL, or the store keeps
 * no embeddings), KVI_ERR_NOT_FOUND, KVI_ERR_CUDA. */
KVI_API kvi_status kvi_store_get_embedding(const kvi_store *store, uint64_t tenant,
                                           uint64_t fact_id, float *out);

/* Removes a fact and returns its pages to the pool: at once, or on a CUDA
 * store with device work of the store still in flight, once that work has
 * completed (see the note on in-flight work above). It waits for nothing.
 * The facts of the tenant whose context names it become stale, and those
 * that name a stale fact, transitively (see "Context and stale facts").
 * Errors: KVI_ERR_INVALID_ARGUMENT, KVI_ERR_NOT_FOUND. */
KVI_API kvi_status kvi_store_remove(kvi_store *store, uint64_t tenant, uint64_t fact_id);

#ifdef KVI_ENABLE_EXPERIMENTAL
/* kvi_store_remove_ex flags */
#define KVI_REMOVE_KEEP_DEPENDENTS 0x1u /* remove the fact alone: no fact becomes stale */

/*
 * kvi_store_remove with flags: 0 is kvi_store_remove; KVI_REMOVE_KEEP_DEPENDENTS
 * removes the fact and leaves every other fact as it was (the caller takes on
 * that facts computed with it in context keep its information).
 * Thread rules: as kvi_store_remove. Errors (nothing removed, nothing made
 * stale): KVI_ERR_INVALID_ARGUMENT (NULL store, unknown flag bits),
 * KVI_ERR_NOT_FOUND, and the journal's errors (kvinject/persist.h).
 */
KVI_EXPERIMENTAL kvi_status kvi_store_remove_ex(kvi_store *store, uint64_t tenant, uint64_t fact_id, uint32_t flags);

/*
 * A fact's context (see "Context and stale facts"): writes its context ids,
 * in the order they were given, to out_ids (host memory, capacity entries;
 * may be NULL when capacity is 0), their count to *out_num and, when
 * out_stale is not NULL, 1 to *out_stale for a stale fact, else 0 (host
 * memory). Call with capacity 0 to size out_ids (*out_num is written, the
 * call fails with KVI_ERR_CAPACITY when the fact has ids). No device work.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store or out_num, capacity < 0,
 * out_ids NULL with capacity > 0), KVI_ERR_NOT_FOUND (nothing written),
 * KVI_ERR_CAPACITY (capacity smaller than the count: only *out_num and
 * *out_stale written).
 */
KVI_EXPERIMENTAL kvi_status kvi_store_fact_context(const kvi_store *store, uint64_t tenant, uint64_t fact_id,
                                                   uint64_t *out_ids, int32_t capacity, int32_t *out_num,
                                                   int32_t *out_stale);

/*
 * Lists `tenant`'s stale facts (see "Context and stale facts") in ascending
 * order of id, as kvi_store_list lists its facts: the first min(capacity, n)
 * to ids (host memory; may be NULL when capacity is 0), n to *out_total (host
 * memory); 0 for a tenant the store has never seen. No device work.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store or out_total, ids NULL with
 * capacity > 0), KVI_ERR_OUT_OF_MEMORY.
 */
KVI_EXPERIMENTAL kvi_status kvi_store_stale(const kvi_store *store, uint64_t tenant, uint64_t *ids, size_t capacity,
                                            size_t *out_total);
#endif

/* Number of facts of `tenant` into *out_count (host memory); 0 for a tenant
 * the store has never seen. Errors: KVI_ERR_INVALID_ARGUMENT. */
KVI_API kvi_status kvi_store_count(const kvi_store *store, uint64_t tenant, size_t *out_count);

/*
 * Lists `tenant`'s fact ids in ascending order: writes the first
 * min(capacity, n) of them to ids (host memory; may be NULL when capacity is
 * 0) and n to *out_total (host memory). Call with capacity 0 to size the
 * array; compare *out_total with capacity to see whether the list was cut
 * (facts may be added between two calls by other threads).
 * Errors: KVI_ERR_INVALID_ARGUMENT.
 */
KVI_API kvi_status kvi_store_list(const kvi_store *store, uint64_t tenant, uint64_t *ids,
                                  size_t capacity, size_t *out_total);

/*
 * Starts moving facts of `tenant` to the device tier of a tiered store (see
 * Tiers above) so that a coming kvi_inject finds them there, and returns
 * without waiting for the copies.
 * fact_ids: host memory, count ids; or NULL (count must then be 0) for all
 *   of the tenant's facts. Facts already on the device are only marked as
 *   recently used. Facts not named are demoted, least recently injected
 *   first, when the device pool is short. When the named facts do not all
 *   fit on the device, the longest prefix of the list (of the tenant's facts,
 *   most recently put or captured first, for NULL) that fits is moved.
 * stream: the copies start once the work enqueued on `stream` before this
 *   call has run (NULL: the default stream), on the store's own copy stream;
 *   later calls on any stream that read these facts wait for the copies.
 * A CPU store, or a CUDA store without a host tier, has one memory tier:
 * without a disk tier the call only checks its arguments and returns KVI_OK.
 * Disk tier (see above): the named facts that are on disk start to be read
 * back, as many as fit (in order), on the store's I/O thread (see
 * "Threads" there); with fact_ids NULL, a tenant the store does not have
 * (or whose file changed, when the store holds no lease on it) is first
 * indexed from its file (synchronously: KVI_ERR_CORRUPT, KVI_ERR_IO,
 * KVI_ERR_INCOMPATIBLE for a damaged or foreign file; the tenant is then
 * not in the store), then as many of its facts as fit start to be read
 * back, most recently written first. A read back that fails leaves its fact
 * on disk; the call that needs it then reads it and reports the error.
 * Thread rules: as every store call (serialized by the store's lock).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store, fact_ids NULL with count > 0,
 * count < 0), KVI_ERR_NOT_FOUND (an id unknown for the tenant: nothing
 * moves), KVI_ERR_CAPACITY (the host tier has no room for the facts that
 * would have to move down: nothing moves), KVI_ERR_CUDA.
 */
KVI_API kvi_status kvi_store_prefetch(kvi_store *store, uint64_t tenant, const uint64_t *fact_ids, int32_t count,
                                      struct CUstream_st *stream);

/*
 * Waits until every read back that kvi_store_prefetch started on this store
 * (its disk tier, on the I/O thread) has ended, and publishes those the
 * thread finished: their facts are then in memory, as kvi_store_fact_tier
 * and kvi_store_stats report (a read that failed leaves its fact on disk; the
 * call that needs it reports the error). A CPU store's thread publishes its
 * reads itself, a CUDA store's are otherwise published only by the next call
 * that needs the fact or by kvi_store_prefetch: until then
 * kvi_store_fact_tier reports them KVI_TIER_DISK. The store's lock is not held
 * while the thread reads, so other calls, on other threads, go on meanwhile;
 * reads that other threads start during the wait are waited for too. A store
 * without a disk tier, or with no read under way: returns at once. For a
 * serving engine's background thread: prefetch, wait, then tell the
 * scheduler the facts are in memory.
 * Thread rules: as every store call, except that it waits without the lock.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store), KVI_ERR_CUDA (a finished
 * read could not be copied to the device: that fact stays on disk).
 */
KVI_API kvi_status kvi_store_prefetch_wait(kvi_store *store);

/* Store statistics. An output struct: set struct_size (KVI_STORE_STATS_INIT);
 * the library writes only the first struct_size bytes. */
typedef struct kvi_store_stats {
  size_t struct_size;
  kvi_backend backend;     /* resolved: KVI_BACKEND_CPU or KVI_BACKEND_CUDA */
  int32_t device;          /* CUDA ordinal, -1 for the CPU backend */
  kvi_dtype dtype;         /* storage dtype */
  int32_t page_tokens;
  int32_t embedding_dim;
  uint64_t page_bytes;     /* bytes of one page (K and V, all layers, local heads;
                              fp8, q4: then the page's scales, fp8 then its
                              key offsets, each part rounded up to 16 bytes) */
  uint64_t pages_total;
  uint64_t pages_used;     /* includes (CUDA stores) pages of removed or
                              replaced facts that device work of the store
                              enqueued before (injections, captures, tier
                              moves, puts from and reads into device memory)
                              may still use: they stay counted until a later
                              put, capture, tier move or remove finds that
                              work complete. kvi_store_remove looks at once:
                              with all of it complete, the removed fact's
                              pages (and any others waiting) are free when it
                              returns */
  uint64_t bytes_reserved; /* pages_total * page_bytes */
  uint64_t bytes_used;     /* pages_used * page_bytes */
  uint64_t bytes_payload;  /* tokens stored * bytes per token, plus (fp8, q4)
                              the scales (fp8: and key offsets) of their pages
                              (bytes_used minus the unused tails of last
                              pages) */
  uint64_t facts;
  uint64_t tenants;        /* tenants with at least one fact */
  uint64_t bytes_embeddings; /* memory the embedding matrices hold (device
                                memory for a CUDA store, host for a CPU one):
                                each tenant's rows and fact ids (and, on a
                                CUDA store without a host tier, each fact's
                                token count and page ids for
                                kvi_retrieve_inject), with room to grow;
                                outside budget_bytes */
  /* The pinned-host tier (0 without one). pages_total, pages_used,
   * bytes_reserved and bytes_used above count both tiers; the device tier's
   * share is their difference with these. */
  uint64_t pages_host_total;
  uint64_t pages_host_used; /* includes host pages waiting as pages_used's do */
  uint64_t promotions;      /* facts moved host -> device since creation */
  uint64_t demotions;       /* facts moved device -> host since creation */
  uint64_t facts_stale;     /* experimental: stale facts of every tenant (see
                               "Context and stale facts"), counted in facts */
  /* The disk tier (0 without one; see "Disk tier"). */
  uint64_t facts_on_disk_only; /* facts, counted in facts, whose K and V are in no
                                  memory tier now (only in their tenant's file) */
  uint64_t disk_bytes;         /* bytes of the tenant files the store wrote or read */
  uint64_t disk_reads;         /* facts read back from tenant files since creation */
  uint64_t disk_read_bytes;    /* bytes read for them (whole entries, each once for the reads back that share it) */
  uint64_t disk_writes;        /* entries appended to tenant files (and files rewritten) */
  uint64_t disk_write_bytes;   /* bytes written for them */
  uint64_t drops_to_disk;      /* facts dropped from memory (kept on disk) since creation */
} kvi_store_stats;

#define KVI_STORE_STATS_INIT                                                                                     \
  {sizeof(kvi_store_stats), KVI_BACKEND_AUTO, 0, KVI_ENUM_ZERO(kvi_dtype), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
   0, 0, 0, 0, 0, 0, 0}

/* Fills *out (host memory). Errors: KVI_ERR_INVALID_ARGUMENT, KVI_ERR_STRUCT_SIZE. */
KVI_API kvi_status kvi_store_stats_get(const kvi_store *store, kvi_store_stats *out);

/* ------------------------------------------------------------------------ */
/* Disk tier                                                                */
/* ------------------------------------------------------------------------ */

/* Where a fact's K and V are (kvi_store_fact_tier). A CPU store's pages are
 * host memory: its resident facts are KVI_TIER_HOST. */
typedef enum kvi_tier {
  KVI_TIER_DEVICE = 0, /* device pages of a CUDA store */
  KVI_TIER_HOST = 1,   /* host pages: a CPU store's, or a CUDA store's host tier */
  KVI_TIER_DISK = 2    /* only in its tenant's file (disk tier): read back when used */
} kvi_tier;

/*
 * Where fact `fact_id` of `tenant` is now, into *out_tier (host memory; a
 * kvi_tier value). No device work, no file I/O. The answer may change at
 * once under calls on other threads. A fact being read back counts as on
 * disk until its read is published (kvi_store_prefetch_wait).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store or out_tier), KVI_ERR_NOT_FOUND.
 */
KVI_API kvi_status kvi_store_fact_tier(const kvi_store *store, uint64_t tenant, uint64_t fact_id, int32_t *out_tier);

/*
 * The tenants whose facts that are only on disk (KVI_TIER_DISK) changed
 * since they were last taken: a fact dropped to disk, read back (published),
 * indexed from a tenant file, or removed while on disk. The store keeps one
 * list, oldest change first, each tenant on it once; this call takes the
 * first min(capacity, listed) of them off it into tenants[] (host memory;
 * NULL when capacity is 0) and sets *count (host memory) to that number.
 * Call again while *count == capacity to drain it. A tenant may come back
 * in a later call (it changed again) and one may be listed that has no
 * facts left; a store without a disk tier lists none. Lets an engine keep
 * its view of what is on disk (kvi_store_list_on_disk of the tenants
 * listed) without asking about every tenant after every change.
 * Thread rules: as every store call (the store's lock); the callers of a
 * store share its list. Errors: KVI_ERR_INVALID_ARGUMENT (NULL store or
 * count, NULL tenants with capacity > 0), KVI_ERR_OUT_OF_MEMORY (the list
 * could not be rebuilt after an allocation failed while noting a change:
 * nothing taken, the next call tries again).
 */
KVI_API kvi_status kvi_store_disk_changes(kvi_store *store, uint64_t *tenants, size_t capacity, size_t *count);

/*
 * Lists `tenant`'s facts that are only on disk (kvi_store_fact_tier
 * KVI_TIER_DISK: dropped to its tenant file, indexed from it, or being read
 * back and not yet published) in ascending order, as kvi_store_list does:
 * the first min(capacity, n) ids into ids (host memory; NULL when capacity
 * is 0), n into *out_total (host memory). One call where asking
 * kvi_store_fact_tier of each fact of kvi_store_list took one call a fact
 * (the vLLM worker's report to its scheduler). A store without a disk tier,
 * or a tenant it has never seen: 0. No device work, no file I/O; the answer
 * may change at once under calls on other threads. Thread rules: as every
 * store call. Errors: KVI_ERR_INVALID_ARGUMENT (NULL store or out_total,
 * NULL ids with capacity > 0), KVI_ERR_OUT_OF_MEMORY.
 */
KVI_API kvi_status kvi_store_list_on_disk(const kvi_store *store, uint64_t tenant, uint64_t *ids, size_t capacity,
                                          size_t *out_total);

/*
 * Gives up this store's ownership lease of `tenant` (see "Disk tier"), so
 * that another replica sharing the directory may write the tenant at once.
 * The tenant's facts stay readable here (memory, or read back from its
 * file); the next write of the tenant here takes the lease again (and
 * re-reads the file if another replica changed it). A tenant whose lease
 * the store does not hold, or a store without a disk tier: KVI_OK, nothing
 * done. Thread rules: as every store call.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL store), KVI_ERR_IO (the lease file
 * could not be written: kvi_last_error() names it; the lease then runs out
 * by itself).
 */
KVI_API kvi_status kvi_store_tenant_release(kvi_store *store, uint64_t tenant);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_STORE_H */
