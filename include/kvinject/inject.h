/*
 * libkvinject — the Chunked-RoPE encoder (kvi_encoder: capture facts from an
 * engine's paged cache) and the block-table injector (kvi_injector: write
 * stored facts into it).
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * Both are bound at creation to a store (its backend, device, model and RoPE)
 * and to one engine cache (kvi_cache_layout). The store must outlive them.
 *
 * Sequences and slots. An engine sequence is addressed through its block
 * table (int32 block ids): sequence index s is block block_table[s / BS],
 * token s % BS. Positions are the RoPE positions of tokens (often, but not
 * always, equal to s).
 *
 * Validation. Everything checkable on the host is checked before anything is
 * written: unknown fact ids (a fact of another tenant is unknown), sequence
 * ranges past a block table, block ids outside the cache (host block
 * tables), negative positions or positions past a cos/sin table. A call that
 * fails this way writes nothing. Block tables in device memory are checked
 * by the kernel: a token whose block id is out of range is skipped (never
 * written out of bounds) and counted; read the count with
 * kvi_injector_async_errors. Requests must not write the same cache slot
 * twice in one call (the result is then unspecified, never out of bounds).
 *
 * Streams. Calls enqueue their work on `stream` (a CUDA handle; NULL: the
 * default stream; a CPU handle ignores it and has finished on return) and
 * return once it is enqueued. Host arrays passed to a call (fact ids,
 * positions, host block tables) may be reused as soon as it returns. A fact
 * removed or replaced while an injection that reads it is in flight keeps
 * its pages until that work has completed.
 *
 * Thread rules: one injector or encoder may be used from several threads at
 * once; calls on it are serialized by its lock (and the store's).
 */
#ifndef KVINJECT_INJECT_H
#define KVINJECT_INJECT_H

#include "kvinject/cache.h"
#include "kvinject/common.h"
#include "kvinject/search.h"
#include "kvinject/store.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvi_injector kvi_injector;
typedef struct kvi_encoder kvi_encoder;

/* Sizing of the per-call descriptor buffers; a call larger than this fails
 * with KVI_ERR_CAPACITY (nothing written). */
typedef struct kvi_transfer_options {
  size_t struct_size;         /* sizeof(kvi_transfer_options) */
  int32_t max_tokens_per_call; /* tokens moved by one call, all requests; default 1 << 20 */
  int32_t max_requests_per_call; /* requests (or captures) per call; default 4096 */
  int32_t max_table_entries_per_call; /* host block-table entries uploaded per call; default 1 << 20 */
} kvi_transfer_options;

#define KVI_TRANSFER_OPTIONS_INIT {sizeof(kvi_transfer_options), 1 << 20, 4096, 1 << 20}

/* Fills *opts with KVI_TRANSFER_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_transfer_options_init(kvi_transfer_options *opts, size_t size);

/* ------------------------------------------------------------------------ */
/* Injector                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * Creates an injector writing `store`'s facts into the cache `layout`
 * describes (host memory; copied). The cache must be in the store's memory:
 * device memory of the store's device for a CUDA store, host memory for a CPU
 * store. opts: host memory or NULL for defaults.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, layout fields out of range, a
 * layout whose extent overflows, one in which two elements of a layer share
 * an address (blocks, tokens or heads of K or V overlapping, or K
 * overlapping V; packed K|V layouts interleave and pass), missing base
 * pointers or scales),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_MISMATCH (layers, heads or head size differ
 * from the store's model), KVI_ERR_MEMORY_KIND, KVI_ERR_OUT_OF_MEMORY,
 * KVI_ERR_CUDA, KVI_ERR_UNSUPPORTED (layout->dtype KVI_DTYPE_Q4: a store
 * dtype only).
 */
KVI_API kvi_status kvi_injector_create(kvi_injector **out, kvi_store *store, const kvi_cache_layout *layout,
                                       const kvi_transfer_options *opts);

/* Frees the injector. NULL is a no-op. Its enqueued work must be complete. */
KVI_API void kvi_injector_destroy(kvi_injector *injector);

/* One request of an injection: its facts, in order, land consecutively in
 * its sequence from first_slot on. */
typedef struct kvi_inject_request {
  size_t struct_size;            /* sizeof(kvi_inject_request) */
  uint64_t tenant;
  const uint64_t *fact_ids;      /* host memory, num_facts ids of `tenant` */
  int32_t num_facts;             /* >= 0 (0: the request writes nothing) */
  const int32_t *block_table;    /* the sequence's block ids, block_table_memory */
  int32_t block_table_len;       /* entries in block_table */
  kvi_memory block_table_memory; /* HOST or DEVICE (default HOST) */
  int64_t first_slot;            /* sequence index of the first injected token, >= 0 */
  const int32_t *positions;      /* host memory: one RoPE position per injected
                                    token, or NULL: start_position + i */
  int32_t start_position;        /* >= 0 */
  int32_t num_positions;         /* entries in positions: checked against the
                                    request's injected tokens (the sum of its facts'
                                    tokens, kvi_inject_plan) when > 0; 0 (default)
                                    trusts positions to hold one per token. Must be
                                    0 when positions is NULL. */
  /* Experimental (common.h, "Stability"): host memory, the prompt's token ids
   * at this request's injected slots, one per injected token in the order
   * kvi_inject writes them (its facts in order, each fact's tokens in order);
   * or NULL (default): unchecked. Each fact's stored token ids
   * (kvinject/store.h, "Token ids") must equal its part of them: a fact whose
   * ids differ, or that was stored without ids, is KVI_ERR_TOKEN_MISMATCH
   * (checked on the host with the other checks: nothing is written). */
  const int32_t *expect_token_ids;
  /* Experimental: entries in expect_token_ids, checked against the request's
   * injected tokens (the sum of its facts' tokens, kvi_inject_plan) when > 0:
   * a count that differs is KVI_ERR_INVALID_ARGUMENT, and the library reads
   * no further than it. 0 (default) trusts expect_token_ids to hold one id
   * per token. Must be >= 0, and 0 when expect_token_ids is NULL. */
  int64_t num_expect_token_ids;
} kvi_inject_request;

#define KVI_INJECT_REQUEST_INIT {sizeof(kvi_inject_request), 0, NULL, 0, NULL, 0, KVI_MEMORY_HOST, 0, NULL, 0, 0, NULL, 0}

/* Fills *req with KVI_INJECT_REQUEST_INIT for a struct of `size` bytes (pass sizeof *req):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_inject_request_init(kvi_inject_request *req, size_t size);

/* How kvi_inject reads facts that are on a store's host tier
 * (kvi_inject_options.host_pages; kvinject/store.h, Tiers). */
typedef enum kvi_host_pages {
  /* move them to the device first (batched copies on the store's copy
   * stream, demoting least-recently-injected facts if needed), then inject */
  KVI_HOST_PAGES_PROMOTE = 0,
  /* the kernel reads them in place from mapped pinned memory over the bus;
   * nothing moves (for facts used once; BENCHMARKS.md compares the two) */
  KVI_HOST_PAGES_READ_MAPPED = 1
} kvi_host_pages;

typedef struct kvi_inject_options {
  size_t struct_size;  /* sizeof(kvi_inject_options) */
  int32_t layer_begin; /* write layers [layer_begin, layer_end); default 0 */
  int32_t layer_end;   /* 0 (default) = all layers */
  kvi_host_pages host_pages; /* default KVI_HOST_PAGES_PROMOTE; ignored without a host tier */
} kvi_inject_options;

#define KVI_INJECT_OPTIONS_INIT {sizeof(kvi_inject_options), 0, 0, KVI_HOST_PAGES_PROMOTE}

/* Fills *opts with KVI_INJECT_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_inject_options_init(kvi_inject_options *opts, size_t size);

/*
 * Writes every request's facts into the cache: keys rotated at their
 * destination positions (fp32 math), values copied, both converted to the
 * cache dtype (fp8: divided by the cache's scale, saturated). Where the
 * store's dtype is the cache's and neither has scales, the values and the
 * key columns past rotary_dim are copied bit for bit (NaN payloads kept),
 * on both backends. An fp8 store's
 * elements are first dequantized with their page's scales (kvinject/store.h),
 * in the same kernel; a 4-bit store's (KVI_DTYPE_Q4) with their groups'
 * scales and minima, in the same pass. On a CUDA
 * store one fused kernel launch covers all requests, facts, layers and heads.
 * reqs: host array of num_requests requests, all with the same struct_size
 * (the library steps through the array by it). opts: NULL for all layers; a
 * layer range lets an engine write layer l+1 while it computes layer l.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL, num_requests < 0, a request field
 * out of range, a bad layer range, a position out of range, a sequence
 * range past its block table or first_slot + tokens past INT64_MAX, a host
 * block-table entry outside the cache, a layer of the store's model whose
 * RoPE was never set (kvinject/model.h; even with num_requests 0)),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_NOT_FOUND (a fact id unknown for the
 * request's tenant), KVI_ERR_MEMORY_KIND, KVI_ERR_CAPACITY (past the
 * transfer options; or, on a store with a host tier, the call's facts cannot
 * all be on the device at once, or the host tier has no room for the facts
 * that would have to move down: nothing moved, nothing written), KVI_ERR_CUDA,
 * KVI_ERR_TOKEN_MISMATCH (expect_token_ids given and a fact's stored token
 * ids differ from them, or the fact has none; the message names the tenant,
 * the fact, the first differing token's index in the fact, its sequence slot
 * and both ids), KVI_ERR_STALE (a stale fact, kvinject/store.h "Context and
 * stale facts"; the message names the tenant and the fact).
 * Host-tier facts (kvinject/store.h, Tiers): see kvi_inject_options.host_pages;
 * the copies that bring them up run on the store's copy stream and `stream`
 * waits for them with an event, so the call still returns once enqueued.
 */
KVI_API kvi_status kvi_inject(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                              const kvi_inject_options *opts, struct CUstream_st *stream);

/* ------------------------------------------------------------------------ */
/* Batched injection                                                        */
/* ------------------------------------------------------------------------ */

/*
 * A whole injection as flat arrays, the form an engine's batch already has
 * (no struct per request). Request r (r < num_requests):
 * - tenant: tenants[r], or `tenant` for every request when tenants is NULL;
 * - facts: fact_ids[fact_offsets[r] .. fact_offsets[r + 1]), in order (CSR:
 *   fact_offsets holds num_requests + 1 non-decreasing entries >= 0);
 * - block table, one of two forms:
 *   block_table_stride > 0: a 2-D array (vLLM's block_table tensor): row r
 *     is block_tables + r * block_table_stride, block_table_len entries
 *     (0 <= block_table_len <= block_table_stride); block_table_offsets NULL;
 *     with num_requests > 1, (num_requests - 1) * block_table_stride +
 *     block_table_len entries must span at most PTRDIFF_MAX bytes (a
 *     stride past that would wrap a row's address);
 *   block_table_stride == 0: CSR pages (FlashInfer's kv_indices and
 *     kv_indptr): block_tables[block_table_offsets[r] ..
 *     block_table_offsets[r + 1]) (num_requests + 1 non-decreasing entries
 *     >= 0); block_table_len 0;
 * - first_slots[r] (int64; NULL: 0): the sequence index of its first token;
 * - positions: with positions NULL, start_positions[r] + i for its i-th
 *   injected token (start_positions NULL: 0); else positions holds one per
 *   injected token of the call, request 0's first, then request 1's and so
 *   on (vLLM's flat positions tensor), and start_positions must be NULL.
 *   position_bits says whether start_positions and positions hold int32
 *   (32, the default) or int64 (64) entries; either way every position must
 *   be below the RoPE's table (a position past INT32_MAX is out of range).
 * Memory: fact_ids in fact_ids_memory, block_tables in block_tables_memory
 * (HOST or DEVICE); fact_offsets, block_table_offsets, first_slots,
 * start_positions, positions and tenants in index_memory (default HOST).
 * DEVICE index arrays are copied to the host first: the call then waits for
 * `stream` (a host synchronization), and a DEVICE positions array needs
 * num_positions > 0. out_tokens: NULL, or num_requests int32 entries in
 * fact_ids_memory, written with the tokens each request injected (the
 * engine's sequence grows by this).
 *
 * Device fact ids (fact_ids_memory DEVICE), e.g. kvi_store_search's device
 * out_ids as they are (a 2-D [num_queries][k] array is CSR with
 * fact_offsets[r] = r * k): on a CUDA store where kvi_retrieve_inject runs
 * on the device (no host tier, embeddings not sharded), the ids are looked up
 * on the device and the injection is planned there by the kernel that plans
 * kvi_retrieve_inject's: with host index arrays and out_tokens in device
 * memory the call enqueues everything on `stream` and returns without any
 * host synchronization. The host checks each request's reserve as
 * kvi_retrieve_inject does: its block table (and positions) must have room,
 * from first_slot on, for (fact_offsets[r + 1] - fact_offsets[r]) facts of
 * the longest size its tenant has held since it last had no facts. Per-token
 * positions are not supported with device fact ids (KVI_ERR_UNSUPPORTED);
 * start positions are. On the device, an entry of KVI_SEARCH_NO_ID (the
 * padding of a search's rows) is skipped without a count; an id the tenant
 * does not hold is skipped and counted (one per id) by
 * kvi_injector_async_errors; the request's other facts still land back to
 * back. A request whose tenant holds no facts injects nothing (uncounted). Other stores: device fact ids are KVI_ERR_UNSUPPORTED (CUDA) or
 * KVI_ERR_MEMORY_KIND (CPU).
 */
typedef struct kvi_inject_batch {
  size_t struct_size;                 /* sizeof(kvi_inject_batch) */
  int32_t num_requests;               /* >= 0 */
  uint64_t tenant;                    /* every request's tenant when tenants is NULL */
  const uint64_t *tenants;            /* index_memory: num_requests tenants, or NULL */
  const uint64_t *fact_ids;           /* fact_ids_memory, indexed by fact_offsets as they are: request r's
                                         facts start at fact_ids + fact_offsets[r] (not at an offset
                                         relative to fact_offsets[0]) */
  kvi_memory fact_ids_memory;         /* HOST or DEVICE (default HOST) */
  const int32_t *fact_offsets;        /* index_memory: num_requests + 1 entries */
  const int32_t *block_tables;        /* block_tables_memory: the 2-D array or the CSR pages */
  kvi_memory block_tables_memory;     /* HOST or DEVICE (default HOST) */
  int64_t block_table_stride;         /* > 0: 2-D row stride in entries; 0: CSR */
  int32_t block_table_len;            /* 2-D: entries per row */
  const int32_t *block_table_offsets; /* index_memory: CSR: num_requests + 1 entries */
  const int64_t *first_slots;         /* index_memory: num_requests, or NULL: all 0 */
  int32_t position_bits;              /* 32 (default) or 64 */
  const void *start_positions;        /* index_memory: num_requests, or NULL: all 0 */
  const void *positions;              /* index_memory: one per injected token, or NULL */
  int64_t num_positions;              /* entries in positions: checked against the call's
                                         tokens when > 0; 0 trusts positions to hold one per
                                         token (host positions only). 0 without positions. */
  kvi_memory index_memory;            /* HOST or DEVICE (default HOST) */
  int32_t *out_tokens;                /* fact_ids_memory: num_requests, or NULL */
  /* Experimental (common.h, "Stability"): host memory, request r's expected
   * token ids (as kvi_inject_request.expect_token_ids) at
   * expect_token_ids + expect_token_offsets[r], its count
   * expect_token_offsets[r + 1] - expect_token_offsets[r], which must equal
   * the tokens it injects (CSR: num_requests + 1 non-decreasing entries
   * >= 0); or NULL (default, and expect_token_offsets NULL): unchecked.
   * With device fact ids (fact_ids_memory DEVICE) the host does not know the
   * facts: a non-NULL expect_token_ids is KVI_ERR_INVALID_ARGUMENT. */
  const int32_t *expect_token_ids;
  const int64_t *expect_token_offsets;
} kvi_inject_batch;

#define KVI_INJECT_BATCH_INIT                                                                                   \
  {sizeof(kvi_inject_batch), 0, 0, NULL, NULL, KVI_MEMORY_HOST, NULL, NULL, KVI_MEMORY_HOST, 0, 0, NULL, NULL, \
   32, NULL, NULL, 0, KVI_MEMORY_HOST, NULL, NULL, NULL}

/* Fills *batch with KVI_INJECT_BATCH_INIT for a struct of `size` bytes (pass sizeof *batch):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_inject_batch_init(kvi_inject_batch *batch, size_t size);

/*
 * kvi_inject for a batch given as flat arrays (kvi_inject_batch): the same
 * result, bit for bit, as kvi_inject with one kvi_inject_request per request
 * (kvi_inject is this call's per-request form: both go through one planner
 * and one kernel launch). opts: as for kvi_inject (host memory or NULL).
 * Host arrays may be reused once the call returns; device arrays (and
 * out_tokens) must stay valid until the stream has passed the call.
 * Validation: everything in host memory is checked before anything is
 * written, as in kvi_inject (unknown host fact ids, sequence ranges past a
 * block table, host block ids outside the cache, positions out of range,
 * offsets that decrease, are negative or, for CSR block tables, give a
 * request fewer entries than its tokens need); a failed call writes nothing
 * (not the cache, not out_tokens). Device block-table entries outside the
 * cache are skipped and counted by kvi_injector_async_errors, as in
 * kvi_inject; device fact ids: see kvi_inject_batch.
 * CUDA graphs: a call must not be captured into a CUDA graph: its plan (and
 * the device path's lookup table) is staged through pinned buffers that
 * later calls reuse, and taking a staging buffer may wait for an event.
 * Thread rules: as kvi_inject (the injector's and the store's locks).
 * Errors: those of kvi_inject; KVI_ERR_INVALID_ARGUMENT (NULL batch, a
 * required array NULL, position_bits not 32 or 64, start_positions and
 * positions both given, num_positions not equal to the call's tokens, an
 * unknown memory kind, too small a reserve, a block_table_stride whose rows
 * pass PTRDIFF_MAX bytes), KVI_ERR_STRUCT_SIZE,
 * KVI_ERR_MEMORY_KIND (an array not in the memory declared, device memory on
 * a CPU store), KVI_ERR_UNSUPPORTED (device fact ids with per-token
 * positions, or on a store whose kvi_retrieve_inject runs on the host),
 * KVI_ERR_STALE (a stale fact; with device fact ids, which the host cannot
 * read, any request whose tenant has a stale fact).
 */
KVI_API kvi_status kvi_inject_batched(kvi_injector *injector, const kvi_inject_batch *batch,
                                      const kvi_inject_options *opts, struct CUstream_st *stream);

/* How many tokens the facts need, in total, into *out_tokens (host memory):
 * call before allocating blocks. Errors: KVI_ERR_INVALID_ARGUMENT,
 * KVI_ERR_NOT_FOUND (nothing written to *out_tokens). */
KVI_API kvi_status kvi_inject_plan(const kvi_injector *injector, uint64_t tenant, const uint64_t *fact_ids,
                                   int32_t num_facts, int64_t *out_tokens);

/* ------------------------------------------------------------------------ */
/* Retrieve and inject                                                      */
/* ------------------------------------------------------------------------ */

/* kvi_retrieve_request.flags */
#define KVI_RETRIEVE_BEST_LAST 0x1u /* inject the best fact last (next to what
                                       follows), not first */

/* Where one query's retrieved facts go. */
typedef struct kvi_retrieve_request {
  size_t struct_size;            /* sizeof(kvi_retrieve_request) */
  uint64_t tenant;               /* the tenant searched, and whose facts are injected */
  const int32_t *block_table;    /* the sequence's block ids, block_table_memory; it
                                    must cover first_slot + the injected tokens */
  int32_t block_table_len;
  kvi_memory block_table_memory; /* HOST or DEVICE (default HOST) */
  int64_t first_slot;            /* sequence index of the first injected token */
  int32_t start_position;        /* RoPE position of that token; the rest follow */
  uint32_t flags;                /* KVI_RETRIEVE_* bits, default 0 */
} kvi_retrieve_request;

#define KVI_RETRIEVE_REQUEST_INIT {sizeof(kvi_retrieve_request), 0, NULL, 0, KVI_MEMORY_HOST, 0, 0, 0u}

/* Fills *req with KVI_RETRIEVE_REQUEST_INIT for a struct of `size` bytes (pass sizeof *req):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_retrieve_request_init(kvi_retrieve_request *req, size_t size);

/*
 * Searches and injects in one call: for each query i, the top
 * min(k, facts of reqs[i].tenant) facts of that tenant (as kvi_store_search
 * ranks them) are injected, in rank order (best first, or best last with
 * KVI_RETRIEVE_BEST_LAST), consecutively from reqs[i].first_slot at
 * consecutive positions from reqs[i].start_position, as kvi_inject would.
 * queries, num_queries, dim, k, opts: as for kvi_store_search on the
 *   injector's store (opts->query_memory and out_memory apply).
 * reqs: host memory, num_queries requests (stepped through by reqs[0]'s
 *   struct_size, which every request must share); block tables in host or
 *   device memory (block_table_memory), as kvi_inject reads them.
 * out_ids: num_queries x k: query i's facts in score order (the search's
 *   row, KVI_SEARCH_NO_ID past the count); out_counts: facts injected per
 *   query; out_tokens: tokens injected per query (the engine's sequence grows
 *   by this). All three in opts->out_memory.
 * The reserve: each request's block table (and the positions) must have
 *   room, from first_slot on, for min(k, facts of the tenant) facts of the
 *   longest size the tenant has held since it last had no facts (removes do
 *   not lower it); a request without that room fails the call with
 *   KVI_ERR_INVALID_ARGUMENT before anything runs (a tenant without facts
 *   needs no table). Positions and the injector's max_tokens_per_call are
 *   checked against the reserve too. The winners' actual tokens are
 *   reported in out_tokens.
 * On a CUDA store without a host tier and without sharded embeddings the
 *   whole call runs on the device, enqueued on `stream` with no host
 *   synchronization: the search, a kernel that plans the injection from its
 *   results, and one injection launch (the same kernel as kvi_inject). With
 *   host outputs the call waits for its results, as kvi_store_search does.
 *   Device block-table entries outside the cache are skipped and counted by
 *   kvi_injector_async_errors, as in kvi_inject.
 * Elsewhere (CPU stores, CUDA stores with a host tier or with sharded
 *   embeddings, where the call is collective like kvi_store_search) the
 *   results come to the host and kvi_inject runs on them; there
 *   opts->out_memory must be KVI_MEMORY_HOST (else KVI_ERR_MEMORY_KIND).
 * Failed calls write nothing (neither the cache nor the outputs).
 * Thread safety: as kvi_inject and kvi_store_search. On every path the
 *   injector's and the store's locks are held from the reserve check through
 *   the search to the injection, so a put or remove by another thread comes
 *   entirely before or after (on the host path a CUDA store then waits for
 *   its search's results under the store's lock).
 * Errors: those of kvi_store_search and kvi_inject; KVI_ERR_INVALID_ARGUMENT
 * (NULL injector, reqs or output, unknown flags, too small a reserve),
 * KVI_ERR_STRUCT_SIZE, KVI_ERR_MEMORY_KIND, KVI_ERR_CAPACITY (the reserves
 * exceed the injector's transfer limits), KVI_ERR_STALE (a query's tenant has
 * a stale fact, which the search could pick: nothing searched or written);
 * an unset RoPE layer as kvi_inject.
 */
KVI_API kvi_status kvi_retrieve_inject(kvi_injector *injector, const void *queries, int32_t num_queries, int32_t dim,
                                       const kvi_retrieve_request *reqs, int32_t k, const kvi_search_options *opts,
                                       uint64_t *out_ids, int32_t *out_counts, int32_t *out_tokens,
                                       struct CUstream_st *stream);

/*
 * The injector's asynchronous errors ("Asynchronous errors" in
 * kvinject/common.h):
 * - Latched: none; an injector returns KVI_OK (a device fault surfaces as
 *   KVI_ERR_CUDA from the call that finds it).
 * - Counted: tokens skipped because a device block table named a block
 *   outside the cache, plus one per device fact id of kvi_inject_batched
 *   that its tenant does not hold; nothing else is written for them. Always
 *   0 for an injector on a CPU store, which rejects such input when called.
 * Threads: thread-safe (it takes the injector's lock).
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL injector).
 */
KVI_API kvi_status kvi_injector_async_errors(kvi_injector *injector, int64_t *out_count);

/* ------------------------------------------------------------------------ */
/* Encoder                                                                  */
/* ------------------------------------------------------------------------ */

/* Creates an encoder capturing facts from the cache `layout` describes into
 * `store`. Arguments and errors as kvi_injector_create. */
KVI_API kvi_status kvi_encoder_create(kvi_encoder **out, kvi_store *store, const kvi_cache_layout *layout,
                                      const kvi_transfer_options *opts);

/* Frees the encoder. NULL is a no-op. Its enqueued work must be complete. */
KVI_API void kvi_encoder_destroy(kvi_encoder *encoder);

/* One fact to capture: num_tokens tokens of a sequence, from first_slot on,
 * whose keys the engine wrote rotated at `positions`. Capturing only the
 * fact's range of a [context window | fact] prefill is Context-Window
 * Encoding. */
typedef struct kvi_capture {
  size_t struct_size;          /* sizeof(kvi_capture) */
  uint64_t tenant;
  uint64_t fact_id;
  const int32_t *block_table;  /* host memory: the sequence's block ids */
  int32_t block_table_len;
  int64_t first_slot;          /* sequence index of the fact's first token, >= 0 */
  int32_t num_tokens;          /* >= 1 */
  const int32_t *positions;    /* host memory, num_tokens positions, or NULL: start_position + i */
  int32_t start_position;
  uint32_t flags;              /* KVI_PUT_REPLACE */
  const void *embedding;       /* as in kvi_put_options */
  kvi_dtype embedding_dtype;   /* default FP32 */
  kvi_memory embedding_memory; /* default HOST */
  /* Experimental (common.h, "Stability"): host memory, the captured slots'
   * token ids, num_tokens of them, given by the caller and kept with the
   * fact (kvinject/store.h, "Token ids"); or NULL (default): none. */
  const int32_t *token_ids;
  /* Experimental: host memory, the fact's context, num_context_ids fact ids
   * of the same tenant whose K and V were in context when the captured
   * slots were computed (kvinject/store.h, "Context and stale facts"): each
   * stored, or captured earlier in the same call; or NULL with 0 (default). */
  const uint64_t *context_ids;
  int32_t num_context_ids; /* >= 0 */
} kvi_capture;

#define KVI_CAPTURE_INIT \
  {sizeof(kvi_capture), 0, 0, NULL, 0, 0, 0, NULL, 0, 0u, NULL, KVI_DTYPE_FP32, KVI_MEMORY_HOST, NULL, NULL, 0}

/* Fills *cap with KVI_CAPTURE_INIT for a struct of `size` bytes (pass sizeof *cap):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_capture_init(kvi_capture *cap, size_t size);

/*
 * Captures facts from the cache into the store: reads each fact's tokens
 * through its block table, dequantizes fp8 with the cache's scales,
 * un-rotates keys at the positions they were written with, and stores
 * pre-RoPE K and V in the store's dtype (an fp8 store: quantized with a
 * scale per page, layer, K/V and head from the un-rotated values; on a CUDA
 * store that is four launches: zero the scales, fold amax, write, finish; a
 * 4-bit store: each page's key channels and value tokens quantized from the
 * un-rotated values, giving the codes and scales a put of those values
 * gives (on a CUDA store four launches too: empty the key channels' bounds,
 * fold them, write codes and value words, make the key words); a
 * store and cache of the same dtype without scales: V and the key columns
 * past rotary_dim copied bit for bit). Every
 * capture is checked before any is launched (every capture's count, key
 * and table, and the transfer limits, before any capture's positions and
 * embedding are read); on a CUDA store the captures of a
 * call then go in one fused kernel launch (one per 65,536 captures). They are
 * all-or-nothing: if one fails its checks (or the store lacks pages for all
 * of them), or a launch fails, none is stored. caps: host array, all with the same struct_size.
 * Errors: as kvi_store_put and kvi_inject (KVI_ERR_EXISTS, KVI_ERR_CAPACITY,
 * KVI_ERR_INVALID_ARGUMENT (an unset RoPE layer too), ...); two captures of
 * one call with the same (tenant, fact id) are KVI_ERR_INVALID_ARGUMENT; a
 * context id naming no fact of the tenant that is stored or captured earlier
 * in the call is KVI_ERR_NOT_FOUND.
 */
KVI_API kvi_status kvi_encode(kvi_encoder *encoder, const kvi_capture *caps, int32_t num_captures,
                              struct CUstream_st *stream);

/*
 * A whole capture call as flat arrays (host memory, except the embeddings).
 * Capture i (i < num_captures): fact fact_ids[i] of tenants[i] (or `tenant`),
 * num_tokens[i] tokens (>= 1) of its sequence from first_slots[i] (NULL: 0)
 * on, read through its block table: row i of a 2-D array
 * (block_table_stride > 0, block_table_len entries a row) or CSR pages
 * (stride 0: block_tables[block_table_offsets[i] .. block_table_offsets[i + 1])),
 * as in kvi_inject_batch; positions: start_positions[i] + t (NULL: 0), or
 * positions holding one per captured token, capture 0's first (int32, or
 * int64 with position_bits 64; num_positions > 0 is checked against the sum
 * of num_tokens); flags (KVI_PUT_REPLACE) for every capture; embeddings:
 * NULL, or row i at embeddings + i * embedding_stride elements
 * (embedding_stride 0: the store's embedding_dim) of embedding_dtype in
 * embedding_memory, as kvi_capture's embedding. With num_captures > 1 a
 * 2-D block table's rows, (num_captures - 1) * block_table_stride +
 * block_table_len entries, and the embeddings' rows,
 * (num_captures - 1) * embedding_stride + embedding_dim elements, must each
 * span at most PTRDIFF_MAX bytes.
 */
typedef struct kvi_encode_batch {
  size_t struct_size;                 /* sizeof(kvi_encode_batch) */
  int32_t num_captures;               /* >= 0 */
  uint64_t tenant;                    /* every capture's tenant when tenants is NULL */
  const uint64_t *tenants;            /* host: num_captures, or NULL */
  const uint64_t *fact_ids;           /* host: num_captures */
  const int32_t *num_tokens;          /* host: num_captures */
  const int32_t *block_tables;        /* host: the 2-D array or the CSR pages */
  int64_t block_table_stride;         /* > 0: 2-D row stride in entries; 0: CSR */
  int32_t block_table_len;            /* 2-D: entries per row */
  const int32_t *block_table_offsets; /* host: CSR: num_captures + 1 entries */
  const int64_t *first_slots;         /* host: num_captures, or NULL: all 0 */
  int32_t position_bits;              /* 32 (default) or 64 */
  const void *start_positions;        /* host: num_captures, or NULL: all 0 */
  const void *positions;              /* host: one per captured token, or NULL */
  int64_t num_positions;              /* > 0: checked against the captures' tokens */
  uint32_t flags;                     /* KVI_PUT_REPLACE, for every capture */
  const void *embeddings;             /* embedding_memory: num_captures rows, or NULL */
  kvi_dtype embedding_dtype;          /* default FP32 */
  kvi_memory embedding_memory;        /* default HOST */
  int64_t embedding_stride;           /* elements between rows; 0: the store's embedding_dim */
  /* Experimental (common.h, "Stability"): host: one token id per captured
   * token, capture 0's first (capture i's at the offset of its first token
   * in the call, as positions), as kvi_capture.token_ids; or NULL: none. */
  const int32_t *token_ids;
  /* Experimental: host: the captures' contexts as CSR, capture i's
   * context_ids[context_offsets[i] .. context_offsets[i + 1]) (offsets
   * num_captures + 1 entries, non-decreasing, from >= 0), as
   * kvi_capture.context_ids; or both NULL (default): none. */
  const uint64_t *context_ids;
  const int32_t *context_offsets;
} kvi_encode_batch;

#define KVI_ENCODE_BATCH_INIT                                                                                 \
  {sizeof(kvi_encode_batch), 0, 0, NULL, NULL, NULL, NULL, 0, 0, NULL, NULL, 32, NULL, NULL, 0, 0u, NULL, \
   KVI_DTYPE_FP32, KVI_MEMORY_HOST, 0, NULL, NULL, NULL}

/* Fills *batch with KVI_ENCODE_BATCH_INIT for a struct of `size` bytes (pass sizeof *batch):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_API kvi_status kvi_encode_batch_init(kvi_encode_batch *batch, size_t size);

/*
 * kvi_encode for a batch given as flat arrays (kvi_encode_batch): the same
 * captures, checks, all-or-nothing result and launches as kvi_encode with one
 * kvi_capture per capture (the arrays become those captures and go through
 * kvi_encode's code). The captures' counts, ids and tables (and the
 * transfer limits) are checked before any of the positions they claim is
 * read: int64 positions are narrowed as the call plans, not copied first.
 * Host arrays may be reused once the call returns.
 * Not to be captured into a CUDA graph (as kvi_inject_batched). Thread
 * rules: as kvi_encode. Errors: those of kvi_encode, with
 * KVI_ERR_INVALID_ARGUMENT for a NULL batch or required array, position_bits
 * not 32 or 64, both kinds of positions, num_positions not the captures'
 * tokens, bad table forms or offsets, a block_table_stride or
 * embedding_stride whose rows pass PTRDIFF_MAX bytes, a position or start
 * position out of range; KVI_ERR_STRUCT_SIZE.
 */
KVI_API kvi_status kvi_encode_batched(kvi_encoder *encoder, const kvi_encode_batch *batch, struct CUstream_st *stream);

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_INJECT_H */
