/*
 * libkvinject — write precomputed per-fact KV caches into an LLM engine's
 * paged KV cache.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * An assistant with long-term memory retrieves the k facts relevant to a
 * question. Instead of pasting them into the prompt and prefilling them on
 * every request, an engine that embeds libkvinject computes each fact's KV
 * cache once, keeps it in a fact store (keys before rotary embedding), and
 * splices the stored KV into its own paged KV cache at serving time, rotated
 * at the positions where it lands.
 *
 * This is the umbrella header; it includes every public header:
 *   kvinject/common.h  status codes, errors, version, features, dtypes
 *   kvinject/model.h   model geometry and RoPE spec (kvi_model)
 *   kvinject/store.h   the fact store (kvi_store)
 *   kvinject/search.h  retrieval: top-k facts per query (kvi_store_search)
 *   kvinject/cache.h   an engine's paged KV cache layout (kvi_cache_layout)
 *   kvinject/inject.h  the encoder (kvi_encoder) and injector (kvi_injector)
 *   kvinject/recompute.h  which injected tokens to recompute (kvi_recompute_select)
 *   kvinject/persist.h store files: save, load, journal
 *   kvinject/comm.h    communicators and tensor-parallel stores (kvi_comm)
 *   kvinject/llama.h   llama.cpp's sequence state as a cache to inject into and capture from
 *
 * Conventions (they hold for every function unless it says otherwise):
 * - Functions return kvi_status; 0 is success. A failed call changes nothing.
 *   kvi_last_error() tells what was wrong.
 * - Handles are opaque; kvi_x_create(&out, ...) gives the caller a handle it
 *   frees with kvi_x_destroy(), which accepts NULL.
 * - Options structs start with struct_size; initialize them with their
 *   KVI_X_OPTIONS_INIT macro or kvi_x_options_init(). The library reads only
 *   the bytes the caller's struct has and rejects set bytes beyond the fields
 *   it knows. Fields are only ever appended.
 * - Every pointer parameter says whether it is host or device memory. Device
 *   work takes the CUDA stream last and returns once the work is enqueued.
 * - Only symbols declared with KVI_API are exported; the ABI changes only with
 *   the soname. C99 and C++ compatible.
 */
#ifndef KVINJECT_H
#define KVINJECT_H

#include "kvinject/common.h"
#include "kvinject/model.h"
#include "kvinject/store.h"
#include "kvinject/search.h"
#include "kvinject/cache.h"
#include "kvinject/inject.h"
#include "kvinject/recompute.h"
#include "kvinject/persist.h"
#include "kvinject/comm.h"
#include "kvinject/llama.h"

#endif /* KVINJECT_H */
