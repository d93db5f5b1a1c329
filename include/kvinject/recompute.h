/*
 * libkvinject — selective recompute of injected facts: deviation scores and
 * the plan of tokens an engine prefills again.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * A fact's stored KV was computed without the other facts of a request, so
 * its tokens never attended to them. An engine can repair that by computing
 * some of the injected tokens again, with the whole injected context in view
 * (their new KV overwrites the injected KV at their slots). Which tokens:
 *
 *  1. inject the facts (kvi_inject);
 *  2. compute layers 0..layer of all injected tokens fresh, over the injected
 *     context, writing their KV into the cache at the same slots (the engine's
 *     own prefill of those layers);
 *  3. kvi_inject_deviation: for the same requests, one score per injected
 *     token: how far the cache's fresh KV at `layer` lies from the store's;
 *  4. kvi_recompute_select: from the scores, the tokens to compute again
 *     (the most deviating ones, plus the first tokens of every fact, where
 *     the missing cross-fact attention weighs most);
 *  5. the engine prefills the chosen tokens through every layer at their
 *     slots and positions, each attending to every cache slot at a position
 *     up to its own. Layers 0..layer of the other tokens keep the fresh KV of
 *     step 2 (layer 0's KV depends on the tokens alone, not on the context,
 *     so score at a layer >= 1).
 *
 * Token indices. A call's injected tokens are numbered in request order, and
 * within a request in the order kvi_inject writes them: its facts in order,
 * each fact's tokens in order. Token i of a request lands at sequence index
 * first_slot + i, at position positions[i] (or start_position + i).
 */
#ifndef KVINJECT_RECOMPUTE_H
#define KVINJECT_RECOMPUTE_H

#include "kvinject/common.h"
#include "kvinject/inject.h"

/* Experimental (common.h, "Stability"): declared only with
 * KVI_ENABLE_EXPERIMENTAL defined before the include: recompute has shown
 * no gain over the notes encoding yet (BENCHMARKS.md), so its interface may
 * still change. */
#ifdef KVI_ENABLE_EXPERIMENTAL

#ifdef __cplusplus
extern "C" {
#endif

/*
 * One deviation score per token the requests would inject (kvi_inject with
 * the same reqs), at one layer, into out_scores[0..T) with T the tokens of
 * all requests (kvi_inject_plan, summed), in the order of "Token indices"
 * above. For token t, whose slot holds K_c, V_c (the cache's values at layer
 * `layer`, as fp32; fp8 caches times their scale) and whose fact holds the
 * pre-RoPE key K_s and value V_s (fp8 and 4-bit stores dequantized):
 *
 *   score[t] = sum over the layer's KV heads h and elements d of
 *              (K_c[h][d] - rot(K_s)[h][d])^2 + (V_c[h][d] - V_s[h][d])^2
 *
 * with rot(K_s) the stored key rotated at the token's position in fp32, as
 * kvi_inject computes it before converting it to the cache's dtype. Right
 * after kvi_inject of the same requests the score is the conversion error
 * alone (0 where the cache is fp32). Non-finite values give a non-finite
 * score. The CPU backend accumulates in double, the CUDA one in fp32 (a tree
 * per token); they agree to a relative 1e-5 or so.
 *
 * layer: 0 <= layer < the model's layers. num_scores: entries out_scores
 * holds (>= T). out_memory: KVI_MEMORY_HOST, or KVI_MEMORY_DEVICE on a CUDA
 * store (on the store's device; written by a kernel on `stream`, no host
 * synchronization). Host out_scores on a CUDA store: the call waits for the
 * kernel before it returns. Nothing in the cache is written.
 * Requests are checked as kvi_inject checks them; the cache is read, never
 * written. A device block table naming a block outside the cache: that
 * token's score is NaN and it is counted by kvi_injector_async_errors.
 * Host-tier facts are read as kvi_inject reads them with default options
 * (promoted to the device first).
 * A failed call writes nothing to out_scores.
 * Errors: those of kvi_inject (the same checks), and KVI_ERR_INVALID_ARGUMENT
 * (layer out of range, NULL out_scores with tokens to score, num_scores below
 * T, out_memory not HOST or DEVICE), KVI_ERR_MEMORY_KIND (out_scores not the
 * memory out_memory says, device memory on a CPU store).
 * Thread rules: as kvi_inject.
 */
KVI_EXPERIMENTAL kvi_status kvi_inject_deviation(kvi_injector *injector, const kvi_inject_request *reqs, int32_t num_requests,
                                        int32_t layer, float *out_scores, int64_t num_scores, kvi_memory out_memory,
                                        struct CUstream_st *stream);

/* What kvi_recompute_select chooses. */
typedef struct kvi_recompute_options {
  size_t struct_size; /* sizeof(kvi_recompute_options) */
  double fraction;    /* in [0, 1]: the share of tokens chosen by score, beyond
                         the boundary tokens; default 0 */
  int32_t per_fact;   /* 0 (default): the best-scored tokens of all facts together;
                         1: of each fact on its own */
  int32_t boundary;   /* >= 0: the first `boundary` tokens of every fact are chosen
                         (all of a shorter fact); default 0 */
} kvi_recompute_options;

#define KVI_RECOMPUTE_OPTIONS_INIT {sizeof(kvi_recompute_options), 0.0, 0, 0}

/* Fills *opts with KVI_RECOMPUTE_OPTIONS_INIT for a struct of `size` bytes (pass sizeof *opts):
 * see "Size-versioned structs" in kvinject/common.h. */
KVI_EXPERIMENTAL kvi_status kvi_recompute_options_init(kvi_recompute_options *opts, size_t size);

/*
 * The plan of tokens to compute again, from one request's deviation scores.
 * fact_tokens: host memory, num_facts token counts (>= 0), in injection
 * order; the request's T tokens are their sum. scores: host memory, T scores
 * (kvi_inject_deviation's, or any others; larger = more in need).
 * Chosen: first, every fact's first min(boundary, its tokens) tokens; then,
 * among the tokens not chosen yet, the m best-scored, where
 *   m = floor(fraction * T + 0.5)          (per_fact 0), or, per fact f,
 *   m_f = floor(fraction * tokens_f + 0.5) (per_fact 1),
 * capped at the tokens left. Best: larger score first, NaN above every number
 * (a token that cannot be compared is recomputed), equal scores the lower
 * index first.
 * out_index: host memory of `capacity` entries: the chosen token indices,
 * ascending, without repeats; *out_count (host) their number.
 * Both written only on success.
 * Errors: KVI_ERR_INVALID_ARGUMENT (NULL pointers where entries are needed,
 * num_facts < 0, a negative token count, T past INT32_MAX, fraction outside
 * [0, 1] or NaN, per_fact not 0 or 1, boundary < 0), KVI_ERR_STRUCT_SIZE,
 * KVI_ERR_CAPACITY (capacity below the chosen count: pass capacity T to
 * never meet it), KVI_ERR_OUT_OF_MEMORY.
 * Thread rules: none (a pure function).
 */
KVI_EXPERIMENTAL kvi_status kvi_recompute_select(const float *scores, const int32_t *fact_tokens, int32_t num_facts,
                                        const kvi_recompute_options *opts, int32_t *out_index, int64_t capacity,
                                        int64_t *out_count);

#ifdef __cplusplus
}
#endif

#endif /* KVI_ENABLE_EXPERIMENTAL */

#endif /* KVINJECT_RECOMPUTE_H */
