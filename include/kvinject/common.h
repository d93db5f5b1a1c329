/*
 * libkvinject — common definitions: export macro, status codes, errors,
 * version and feature queries, element types, memory kinds and backends.
 *
 * SPDX-License-Identifier: Apache-2.0
 *
 * Include <kvinject.h> rather than this file.
 */
#ifndef KVINJECT_COMMON_H
#define KVINJECT_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "kvinject/version.h"

#if defined(__GNUC__) || defined(__clang__)
#define KVI_API __attribute__((visibility("default")))
#else
#define KVI_API
#endif

/*
 * Stability. Everything these headers declare is stable from 0.1.0 (its
 * signature, struct fields, enum values and behaviour change only with the
 * soname), except declarations marked KVI_EXPERIMENTAL: those may change or
 * go in any minor release, and are declared only where the program defines
 * KVI_ENABLE_EXPERIMENTAL before including <kvinject.h>, as zstd's
 * ZSTD_STATIC_LINKING_ONLY fences its experimental section. KVI_DEPRECATED
 * marks a declaration that still works but will leave with the next soname;
 * its message names the replacement.
 */
#define KVI_EXPERIMENTAL KVI_API
#if defined(__cplusplus) && __cplusplus >= 201402L
#define KVI_DEPRECATED(msg) [[deprecated(msg)]]
#elif defined(__GNUC__) || defined(__clang__)
#define KVI_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define KVI_DEPRECATED(msg)
#endif

/* Whether these headers are at least version major.minor.patch, for code
 * that must build against several versions:
 *   #if KVI_VERSION_AT_LEAST(0, 2, 0) ... #endif
 * (kvi_version_number() tells the library loaded at run time). */
#define KVI_VERSION_AT_LEAST(major, minor, patch) \
  (KVI_VERSION_NUMBER >= ((major) * 10000 + (minor) * 100 + (patch)))

/* The largest struct_size of any size-versioned struct (see "Size-versioned
 * structs" below): a larger one is KVI_ERR_STRUCT_SIZE, so that a garbage
 * struct_size never makes the library read far past a caller's struct. */
#define KVI_STRUCT_SIZE_MAX 4096

/* An enum value of 0 in an _INIT macro, valid in C and in C++ without an
 * old-style cast. */
#ifdef __cplusplus
#define KVI_ENUM_ZERO(type) type()
#else
#define KVI_ENUM_ZERO(type) ((type)0)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* A CUDA stream, as `cudaStream_t` / `CUstream`. Declared here so that this
 * header needs no CUDA header; pass a `cudaStream_t` as it is, or NULL for the
 * default stream. Backends that do not use streams ignore it. */
struct CUstream_st;

/* ------------------------------------------------------------------------ */
/* Status codes                                                             */
/* ------------------------------------------------------------------------ */

/*
 * Every call that can fail returns a kvi_status. 0 is success; errors are
 * negative. The values are part of the ABI: they are never renumbered and a
 * value is never reused for another meaning. New codes are appended.
 *
 * Unless a function says otherwise, a call that returns an error has changed
 * nothing: no handle state, no stored fact, no output parameter.
 */
typedef enum kvi_status {
  KVI_OK = 0,
  /* A NULL pointer, a value out of range, an unknown enum value or flag. */
  KVI_ERR_INVALID_ARGUMENT = -1,
  /* An options/view/output struct whose struct_size is smaller than the first
   * published version of it, or that has non-zero bytes past the fields this
   * version of the library knows. */
  KVI_ERR_STRUCT_SIZE = -2,
  /* A host allocation failed, or the memory a store reserves at creation
   * could not be reserved. */
  KVI_ERR_OUT_OF_MEMORY = -3,
  /* The store's reserved memory has too few free pages for the request. */
  KVI_ERR_CAPACITY = -4,
  /* The (tenant, fact id) is already stored and no replace flag was given. */
  KVI_ERR_EXISTS = -5,
  /* No fact with that (tenant, fact id); for kvi_store_load, no file at the
   * path. */
  KVI_ERR_NOT_FOUND = -6,
  /* A buffer's shape (layers, heads, head size) or element type does not
   * match what the handle was created for. */
  KVI_ERR_MISMATCH = -7,
  /* A pointer declared as host memory is device memory or the reverse, or
   * device memory on another device than the handle's, or memory the
   * chosen backend cannot reach (device memory given to a CPU store). */
  KVI_ERR_MEMORY_KIND = -8,
  /* The call needs a component (CUDA, cuBLASLt, NCCL) that this build of the
   * library does not contain, or whose shared library (libcublasLt.so.N,
   * libnccl.so.N, opened on first use) does not load here; kvi_last_error()
   * then names the library and the loader's message. See kvi_features(). */
  KVI_ERR_NOT_BUILT = -9,
  /* CUDA was asked for, the library has it, but no usable device answers
   * (no driver, no device, or the ordinal is out of range). */
  KVI_ERR_NO_DEVICE = -10,
  /* A CUDA runtime call failed; kvi_last_error() names the call and the
   * CUDA error. */
  KVI_ERR_CUDA = -11,
  /* A valid request that this version does not implement. */
  KVI_ERR_UNSUPPORTED = -12,
  /* A bug in the library: please report it with kvi_last_error(). */
  KVI_ERR_INTERNAL = -13,
  /* A store file that is not one, is truncated, fails a checksum or is
   * inconsistent (kvi_store_load); kvi_last_error() names the offset and the
   * check. Nothing was loaded. */
  KVI_ERR_CORRUPT = -14,
  /* A valid store file made for another model geometry, tensor-parallel
   * slice, RoPE, storage dtype or embedding size than the one given, or
   * written in a format version or byte order this library does not read. */
  KVI_ERR_INCOMPATIBLE = -15,
  /* A file system call failed (open, write, fsync, rename, ...), or a file is
   * in use as another store's journal; kvi_last_error() names the call, the
   * path and the system's error. */
  KVI_ERR_IO = -16,
  /* A collective call (kvinject/comm.h) failed on another rank of the
   * communicator; this rank changed nothing. The failing rank returned the
   * cause. */
  KVI_ERR_PEER = -17,
  /* An injection that checks token ids (kvi_inject_request.expect_token_ids,
   * experimental) found a fact whose stored token ids differ from the
   * prompt's at its slots, or a fact stored without token ids;
   * kvi_last_error() names the tenant, the fact and the first differing
   * position. Nothing was written. */
  KVI_ERR_TOKEN_MISMATCH = -18,
  /* A call that reads facts' K and V for serving (kvi_inject,
   * kvi_inject_batched, kvi_retrieve_inject) named a stale fact: one whose
   * K and V were computed with a fact in context that has since been removed
   * (kvinject/store.h, "Context and stale facts"); kvi_last_error() names
   * the tenant and the fact. Nothing was written. */
  KVI_ERR_STALE = -19,
  /* A write (put, remove, encode) of a tenant of a store with a disk tier
   * (kvinject/store.h, "Disk tier") whose ownership lease another replica
   * holds; kvi_last_error() names the owner and the milliseconds left.
   * Nothing was written. */
  KVI_ERR_LEASED = -20
} kvi_status;

/* Static English text for a status ("invalid argument", ...). Never NULL;
 * unknown values give "unknown status". Thread-safe. */
KVI_API const char *kvi_status_string(kvi_status status);

/*
 * The message of the last call that failed on the calling thread, naming what
 * was wrong and the offending value (for example "kvi_store_put: kv->num_heads
 * is 4, the store holds 8 local heads"). Never NULL: "" when no call on this
 * thread has failed. Successful calls do not clear it. The text stays valid
 * until the next failing call on the same thread.
 */
KVI_API const char *kvi_last_error(void);

/* ------------------------------------------------------------------------ */
/* Asynchronous errors                                                      */
/* ------------------------------------------------------------------------ */

/*
 * Device work is enqueued and the call returns; what the device finds
 * afterwards comes back through one query per handle that runs device work,
 * all of one shape: kvi_injector_async_errors (kvinject/inject.h),
 * kvi_store_async_errors (kvinject/search.h), kvi_comm_async_errors
 * (kvinject/comm.h):
 *
 *   kvi_status kvi_<handle>_async_errors(kvi_<handle> *handle, int64_t *out_count);
 *
 * - Returns the handle's latched failure: KVI_OK, or the status of device
 *   work that failed after its call had returned, with its message in
 *   kvi_last_error(). A latched failure does not clear (a dead CUDA context,
 *   a broken NCCL communicator): the handle is then good only for its
 *   destroy. KVI_ERR_INVALID_ARGUMENT is a NULL handle (nothing written).
 * - *out_count (host memory; NULL to skip it) is the number of inputs that
 *   only the device could check, found wrong and skipped since the previous
 *   query of this handle (reading clears); each query says what it counts.
 *   Written whatever the return value.
 * - Never waits for the device: synchronize the streams of the calls of
 *   interest first to see all of their work. Thread-safe.
 */

/* ------------------------------------------------------------------------ */
/* Size-versioned structs                                                   */
/* ------------------------------------------------------------------------ */

/*
 * Every public struct begins with `size_t struct_size`; later versions only
 * append fields. Each struct has a first version: the fields its 0.1.0
 * header declares, except those that also accept an earlier, shorter layout:
 * kvi_store_options (the fields before comm), kvi_inject_request (before
 * num_positions), kvi_inject_options (before host_pages), kvi_cache_layout
 * (before dim_stride), kvi_store_stats (before pages_host_total), and the
 * structs that gained token ids: kvi_put_options, kvi_capture,
 * kvi_encode_batch and kvi_inject_batch (the fields before token_ids or
 * expect_token_ids).
 *
 * Input structs (options, views, requests, layouts): set struct_size to
 * sizeof the struct as the caller's header declares it, through the _INIT
 * macro or kvi_x_init(ptr, sizeof *ptr). The library reads only the first
 * struct_size bytes; fields past them take their defaults. A struct_size
 * smaller than the first version, larger than KVI_STRUCT_SIZE_MAX, or with
 * non-zero bytes past the fields this library knows, is KVI_ERR_STRUCT_SIZE.
 * Arrays of structs are stepped through by the first element's struct_size,
 * which every element must share (another is KVI_ERR_STRUCT_SIZE, naming
 * the element).
 *
 * Output structs (kvi_model_info, kvi_store_stats, kvi_model_get_rope's
 * spec): set struct_size (the _INIT macro, at most KVI_STRUCT_SIZE_MAX); the
 * library writes only the first min(struct_size, its own size) bytes.
 *
 * kvi_x_init(ptr, size) fills a struct of `size` bytes with the _INIT
 * defaults: it writes the first min(size, the library's size) bytes, zeroes
 * bytes past the fields the library knows (up to size), sets struct_size to
 * size, and never writes past size, so a program built against an older,
 * smaller struct is safe with a newer library. Returns KVI_OK, or (writing
 * nothing) KVI_ERR_INVALID_ARGUMENT for a NULL ptr and KVI_ERR_STRUCT_SIZE for
 * a size smaller than the first version or larger than KVI_STRUCT_SIZE_MAX.
 * Thread-safe.
 */

/* ------------------------------------------------------------------------ */
/* Version and features                                                     */
/* ------------------------------------------------------------------------ */

/* KVI_VERSION_NUMBER of the library loaded at run time
 * (major * 10000 + minor * 100 + patch). */
KVI_API unsigned kvi_version_number(void);

/* KVI_VERSION_STRING of the library loaded at run time, e.g. "0.1.0". */
KVI_API const char *kvi_version_string(void);

/* Bits returned by kvi_features(): what this build of the library contains. */
#define KVI_FEATURE_CUDA 0x1u     /* CUDA backend (kernels for KVI_CUDA_ARCHS) */
#define KVI_FEATURE_CUBLASLT 0x2u /* cuBLASLt-based retrieval */
#define KVI_FEATURE_NCCL 0x4u     /* NCCL communicators for tensor parallelism */

/* The KVI_FEATURE_* bits this build contains and can use here. cuBLASLt and
 * NCCL are not linked: the library opens libcublasLt.so.N and libnccl.so.N
 * (N the major version of the headers it was built with) on first use, and
 * reports their bit only when built in and the library loads (the first call
 * of kvi_features tries to open them, once per process). CUDA also needs a
 * driver and a device at run time (kvi_cuda_device_count). Thread-safe. */
KVI_API unsigned kvi_features(void);

/*
 * Number of CUDA devices usable by this library.
 * out_count: host memory, receives the count; 0 when there is no driver or no
 *            device (that is not an error: the CPU backend still works).
 * Returns KVI_ERR_NOT_BUILT (and sets *out_count to 0) when the library was
 * built without CUDA, KVI_ERR_INVALID_ARGUMENT when out_count is NULL.
 * Thread-safe.
 */
KVI_API kvi_status kvi_cuda_device_count(int *out_count);

/* ------------------------------------------------------------------------ */
/* Element types, memory kinds, backends                                    */
/* ------------------------------------------------------------------------ */

/* Element types. 0 is deliberately not a type, so an unset field is caught. */
typedef enum kvi_dtype {
  KVI_DTYPE_FP32 = 1,
  KVI_DTYPE_FP16 = 2,     /* IEEE binary16 */
  KVI_DTYPE_BF16 = 3,     /* bfloat16 */
  KVI_DTYPE_FP8_E4M3 = 4, /* OCP e4m3fn (max 448); caches, and stores (scaled:
                             kvinject/store.h), never dense K/V views */
  KVI_DTYPE_FP8_E5M2 = 5, /* OCP e5m2; caches only */
  KVI_DTYPE_Q4 = 6        /* group-wise 4-bit codes with fp16 scales and minima:
                             stores only (kvinject/store.h, "4-bit storage"),
                             never caches or dense K/V views */
} kvi_dtype;

/* Bytes per element of a dtype; 0 for a value that is not a kvi_dtype, and
 * for KVI_DTYPE_Q4 (half a byte per element plus its groups' scales:
 * kvi_store_stats.page_bytes gives a page's bytes). */
KVI_API size_t kvi_dtype_size(kvi_dtype dtype);

/* Where a pointer points. 0 is deliberately not a kind: every buffer the
 * caller passes must say where it lives. */
typedef enum kvi_memory {
  KVI_MEMORY_HOST = 1,  /* ordinary or pinned host memory */
  KVI_MEMORY_DEVICE = 2 /* device memory of the handle's CUDA device (managed
                           memory also qualifies) */
} kvi_memory;

/* Which implementation a handle uses; chosen once, at creation. */
typedef enum kvi_backend {
  /* CUDA if the library has it and a device answers, else the CPU. */
  KVI_BACKEND_AUTO = 0,
  /* Plain C on the host: the reference implementation. */
  KVI_BACKEND_CPU = 1,
  /* CUDA on a given device ordinal. */
  KVI_BACKEND_CUDA = 2
} kvi_backend;

#ifdef __cplusplus
}
#endif

#endif /* KVINJECT_COMMON_H */
