/*
 * Communicators: NCCL, and an in-process group whose ranks are threads.
 * SPDX-License-Identifier: Apache-2.0
 *
 * The in-process transport is a rendezvous: in every operation each rank
 * publishes what it offers in its slot of the group, all ranks meet at a
 * barrier, each copies what it needs out of the others' buffers, and all
 * meet again before any buffer is reused. Operations are matched by order,
 * as NCCL's are, so ranks must call them in the same order.
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tp/tp.h"
#include "kvi_build_config.h"

#ifdef KVI_HAVE_NCCL
#include <cuda_runtime_api.h>
#include <nccl.h>


/* libnccl.so.<major of the header>, opened by the first kvi__comm_nccl_device:
 * every other NCCL call is made on a communicator it created. */
#define NCCL_FUNCS(X)                                                                                              \
  X(ncclGetLastError) X(ncclGetErrorString) X(ncclCommUserRank) X(ncclCommCount) X(ncclCommCuDevice)               \
  X(ncclCommGetAsyncError) X(ncclAllGather) X(ncclBroadcast) X(ncclGroupStart) X(ncclGroupEnd) X(ncclSend)         \
  X(ncclRecv)
KVI__DYNLIB(nccl, "libnccl.so." KVI__STR(NCCL_MAJOR), "NCCL", NCCL_FUNCS)
#define ncclGetLastError KVI__DYNFN(nccl, ncclGetLastError)
#define ncclGetErrorString KVI__DYNFN(nccl, ncclGetErrorString)
#define ncclCommUserRank KVI__DYNFN(nccl, ncclCommUserRank)
#define ncclCommCount KVI__DYNFN(nccl, ncclCommCount)
#define ncclCommCuDevice KVI__DYNFN(nccl, ncclCommCuDevice)
#define ncclCommGetAsyncError KVI__DYNFN(nccl, ncclCommGetAsyncError)
#define ncclAllGather KVI__DYNFN(nccl, ncclAllGather)
#define ncclBroadcast KVI__DYNFN(nccl, ncclBroadcast)
#define ncclGroupStart KVI__DYNFN(nccl, ncclGroupStart)
#define ncclGroupEnd KVI__DYNFN(nccl, ncclGroupEnd)
#define ncclSend KVI__DYNFN(nccl, ncclSend)
#define ncclRecv KVI__DYNFN(nccl, ncclRecv)

bool kvi__nccl_usable(void) { return kvi__dynlib_usable(&nccl_lib); }
#else
bool kvi__nccl_usable(void) { return false; }
#endif

/* ------------------------------------------------------------------------ */
/* the in-process group                                                     */
/* ------------------------------------------------------------------------ */

typedef struct slot {
  const void *send; /* allgather / bcast source */
  const kvi__p2p *ops;
  int32_t nops;
} slot;

struct kvi_comm_group {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int32_t size;
  int32_t arrived;
  uint64_t generation;
  bool *taken; /* rank has a live communicator */
  slot *slots;
};

static void barrier(kvi_comm_group *g) {
  pthread_mutex_lock(&g->mu);
  const uint64_t gen = g->generation;
  if (++g->arrived == g->size) {
    g->arrived = 0;
    g->generation++;
    pthread_cond_broadcast(&g->cv);
  } else {
    while (g->generation == gen) pthread_cond_wait(&g->cv, &g->mu);
  }
  pthread_mutex_unlock(&g->mu);
}

kvi_status kvi__comm_group_create(kvi_comm_group **out, int32_t size, const char *fn) {
  if (!out) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "out is NULL");
  if (size < 1 || size > 1024) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "size is %d, expected 1..1024", (int)size);
  kvi_comm_group *g = calloc(1, sizeof *g);
  if (g) {
    g->taken = calloc((size_t)size, sizeof *g->taken);
    g->slots = calloc((size_t)size, sizeof *g->slots);
  }
  if (!g || !g->taken || !g->slots) {
    if (g) free(g->taken);
    if (g) free(g->slots);
    free(g);
    return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a group of %d ranks", (int)size);
  }
  pthread_mutex_init(&g->mu, NULL);
  pthread_cond_init(&g->cv, NULL);
  g->size = size;
  *out = g;
  return KVI_OK;
}

void kvi__comm_group_destroy(kvi_comm_group *g) {
  if (!g) return;
  pthread_mutex_destroy(&g->mu);
  pthread_cond_destroy(&g->cv);
  free(g->taken);
  free(g->slots);
  free(g);
}

kvi_status kvi__comm_create_local(kvi_comm **out, kvi_comm_group *g, int32_t rank, const char *fn) {
  if (!out || !g) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !out ? "out" : "group");
  if (rank < 0 || rank >= g->size)
    return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "rank is %d, the group has %d ranks", (int)rank, (int)g->size);
  kvi_comm *c = calloc(1, sizeof *c);
  if (!c) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a communicator");
  pthread_mutex_lock(&g->mu);
  const bool taken = g->taken[rank];
  g->taken[rank] = true;
  pthread_mutex_unlock(&g->mu);
  if (taken) {
    free(c);
    return kvi__fail(KVI_ERR_EXISTS, fn, "rank %d of the group already has a communicator", (int)rank);
  }
  c->kind = KVI__COMM_LOCAL;
  c->rank = rank;
  c->size = g->size;
  c->memory = KVI_MEMORY_HOST;
  c->device = -1;
  c->group = g;
  *out = c;
  return KVI_OK;
}

static kvi_status local_allgather(kvi_comm *c, const void *send, void *recv, size_t bytes) {
  kvi_comm_group *g = c->group;
  g->slots[c->rank].send = send;
  barrier(g);
  for (int32_t r = 0; recv && bytes && r < c->size; r++) {
    char *dst = (char *)recv + (size_t)r * bytes;
    if (g->slots[r].send) memcpy(dst, g->slots[r].send, bytes);
    else memset(dst, 0xff, bytes); /* a rank that had nothing to send */
  }
  barrier(g);
  return KVI_OK;
}

static kvi_status local_bcast(kvi_comm *c, void *buf, size_t bytes, int32_t root) {
  kvi_comm_group *g = c->group;
  g->slots[c->rank].send = buf;
  barrier(g);
  if (c->rank != root && bytes) memcpy(buf, g->slots[root].send, bytes);
  barrier(g);
  return KVI_OK;
}

/* The n-th send from `from` to `to`, or NULL. */
static const kvi__p2p *nth_send(const slot *s, int32_t to, int32_t n) {
  for (int32_t i = 0; i < s->nops; i++)
    if (s->ops[i].send && s->ops[i].peer == to && n-- == 0) return &s->ops[i];
  return NULL;
}

static kvi_status local_p2p(kvi_comm *c, const kvi__p2p *ops, int32_t n, const char *fn) {
  kvi_comm_group *g = c->group;
  g->slots[c->rank].ops = ops;
  g->slots[c->rank].nops = n;
  barrier(g);
  kvi_status st = KVI_OK;
  int32_t *seen = calloc((size_t)c->size, sizeof *seen);
  for (int32_t i = 0; i < n && seen; i++) {
    if (ops[i].send) continue;
    const kvi__p2p *s = nth_send(&g->slots[ops[i].peer], c->rank, seen[ops[i].peer]++);
    if (!s || s->bytes != ops[i].bytes) { /* a bug in the caller: the ranks planned different transfers */
      st = kvi__fail(KVI_ERR_INTERNAL, fn, "rank %d expects %zu bytes from rank %d, which sends %zu", (int)c->rank,
                     ops[i].bytes, (int)ops[i].peer, s ? s->bytes : 0);
      continue;
    }
    if (s->bytes) memcpy(ops[i].buf, s->buf, s->bytes);
  }
  if (!seen) st = kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating %d counters", (int)c->size);
  free(seen);
  barrier(g); /* even on error: the others must not wait forever */
  return st;
}

/* ------------------------------------------------------------------------ */
/* NCCL                                                                     */
/* ------------------------------------------------------------------------ */

#ifdef KVI_HAVE_NCCL
static kvi_status nccl_fail(ncclResult_t r, struct ncclComm *nc, const char *fn, const char *call) {
  const char *last = nc ? ncclGetLastError(nc) : NULL;
  return kvi__fail(KVI_ERR_CUDA, fn, "%s failed: %s%s%s", call, ncclGetErrorString(r), last && *last ? ": " : "",
                   last ? last : "");
}

#define NCCL_CHECK(call, nc, fn)                                      \
  do {                                                                \
    ncclResult_t r_ = (call);                                         \
    if (r_ != ncclSuccess) return nccl_fail(r_, (nc), (fn), #call);   \
  } while (0)

static kvi_status scratch_reserve(kvi_comm *c, size_t bytes, const char *fn) {
  if (bytes <= c->scratch_bytes) return KVI_OK;
  size_t cap = c->scratch_bytes ? c->scratch_bytes : 4096;
  while (cap < bytes) cap *= 2;
  void *p = NULL;
  kvi_status st = kvi__cuda_sync(c->stream, fn); /* the old buffer is idle */
  if (st == KVI_OK) st = kvi__cuda_malloc(&p, cap, fn);
  if (st) return st;
  kvi__cuda_free(c->scratch);
  c->scratch = p;
  c->scratch_bytes = cap;
  return KVI_OK;
}

/* Runs a control exchange on the comm's own stream and waits for it. The
 * comm's device is current: control exchanges run inside the calls of a
 * store, whose entry point made the store's device current, and a store
 * with an NCCL communicator is on the communicator's device (checked when
 * the ranks create it, create.c's shard_create); kvi_store_create itself
 * makes the communicator's device current (kvi__shard_store_device). */
static kvi_status nccl_control(kvi_comm *c, const void *send, void *recv, size_t bytes, int32_t root,
                               const char *fn) {
  const bool gather = root < 0;
  const size_t total = gather ? bytes * (size_t)c->size : bytes;
  kvi_status st = scratch_reserve(c, bytes + total, fn);
  if (st) return st;
  char *in = c->scratch, *res = (char *)c->scratch + bytes;
  if (send) st = kvi__cuda_h2d(in, send, bytes, c->stream, fn);
  else if (cudaMemsetAsync(in, 0xff, bytes, (cudaStream_t)c->stream) != cudaSuccess) /* nothing to send: all ones */
    st = kvi__cuda_error((int)cudaGetLastError(), fn, "cudaMemsetAsync");
  if (st) return st;
  ncclResult_t r = gather ? ncclAllGather(in, res, bytes, ncclUint8, c->nccl, c->stream)
                          : ncclBroadcast(in, res, bytes, ncclUint8, root, c->nccl, c->stream);
  if (r != ncclSuccess) return nccl_fail(r, c->nccl, fn, gather ? "ncclAllGather" : "ncclBroadcast");
  if (recv && (st = kvi__cuda_d2h(recv, res, total, c->stream, fn))) return st;
  return kvi__cuda_sync(c->stream, fn);
}
#endif

/* The checks of kvi_comm_create_nccl and its queries of the communicator. */
static kvi_status nccl_query(kvi_comm **out, struct ncclComm *nccl, int *rank, int *size, int *dev, const char *fn) {
  if (!out || !nccl) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "%s is NULL", !out ? "out" : "nccl");
#ifndef KVI_HAVE_NCCL
  (void)rank, (void)size, (void)dev;
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "this build of libkvinject has no NCCL (kvi_features())");
#else
  kvi_status lst = kvi__dynlib_get(&nccl_lib, fn);
  if (lst) return lst;
  NCCL_CHECK(ncclCommUserRank(nccl, rank), nccl, fn);
  NCCL_CHECK(ncclCommCount(nccl, size), nccl, fn);
  NCCL_CHECK(ncclCommCuDevice(nccl, dev), nccl, fn);
  return KVI_OK;
#endif
}

kvi_status kvi__comm_nccl_device(kvi_comm **out, struct ncclComm *nccl, int *device, const char *fn) {
  int rank = 0, size = 0;
  *device = -1;
  return nccl_query(out, nccl, &rank, &size, device, fn);
}

kvi_status kvi__comm_create_nccl(kvi_comm **out, struct ncclComm *nccl, const char *fn) {
  int rank = 0, size = 0, dev = 0;
  kvi_status st = nccl_query(out, nccl, &rank, &size, &dev, fn);
  if (st) return st;
#ifdef KVI_HAVE_NCCL
  kvi_comm *c = calloc(1, sizeof *c);
  if (!c) return kvi__fail(KVI_ERR_OUT_OF_MEMORY, fn, "allocating a communicator");
  c->kind = KVI__COMM_NCCL;
  c->rank = rank;
  c->size = size;
  c->memory = KVI_MEMORY_DEVICE;
  c->device = dev;
  c->nccl = nccl;
  if ((st = kvi__cuda_stream_create(&c->stream, fn))) {
    free(c);
    return st;
  }
  *out = c;
#endif
  return KVI_OK;
}

void kvi__comm_destroy(kvi_comm *c, bool device_ok) {
  if (!c) return;
  if (c->kind == KVI__COMM_LOCAL) {
    pthread_mutex_lock(&c->group->mu);
    c->group->taken[c->rank] = false;
    pthread_mutex_unlock(&c->group->mu);
  }
#ifdef KVI_HAVE_NCCL
  if (c->kind == KVI__COMM_NCCL && device_ok) {
    kvi__cuda_sync(c->stream, "kvi_comm_destroy");
    kvi__cuda_free(c->scratch);
    kvi__cuda_stream_destroy(c->stream);
  }
#else
  (void)device_ok;
#endif
  free(c);
}

kvi_status kvi__comm_rank(const kvi_comm *c, int32_t *out_rank, int32_t *out_size, const char *fn) {
  if (!c) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "comm is NULL");
  if (out_rank) *out_rank = c->rank;
  if (out_size) *out_size = c->size;
  return KVI_OK;
}

kvi_status kvi__comm_async_errors(kvi_comm *c, int64_t *out_count, const char *fn) {
  if (!c) return kvi__fail(KVI_ERR_INVALID_ARGUMENT, fn, "comm is NULL");
  if (out_count) *out_count = 0; /* a communicator skips no input */
#ifdef KVI_HAVE_NCCL
  if (c->kind == KVI__COMM_NCCL) {
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(c->nccl, &async), c->nccl, fn);
    if (async != ncclSuccess) return nccl_fail(async, c->nccl, fn, "the NCCL communicator (asynchronous error)");
  }
#endif
  return KVI_OK;
}

int kvi__comm_device(const kvi_comm *c) { return c && c->kind == KVI__COMM_NCCL ? c->device : -1; }

/* ------------------------------------------------------------------------ */
/* operations                                                               */
/* ------------------------------------------------------------------------ */

kvi_status kvi__comm_allgather(kvi_comm *c, const void *send, void *recv, size_t bytes, struct CUstream_st *stream,
                               const char *fn) {
  if (c->kind == KVI__COMM_LOCAL) return local_allgather(c, send, recv, bytes);
#ifdef KVI_HAVE_NCCL
  NCCL_CHECK(ncclAllGather(send, recv, bytes, ncclUint8, c->nccl, (cudaStream_t)stream), c->nccl, fn);
  return KVI_OK;
#else
  (void)stream;
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "no NCCL in this build");
#endif
}

kvi_status kvi__comm_p2p(kvi_comm *c, const kvi__p2p *ops, int32_t n, struct CUstream_st *stream, const char *fn) {
  if (c->kind == KVI__COMM_LOCAL) return local_p2p(c, ops, n, fn);
#ifdef KVI_HAVE_NCCL
  NCCL_CHECK(ncclGroupStart(), c->nccl, fn);
  ncclResult_t r = ncclSuccess;
  for (int32_t i = 0; i < n && r == ncclSuccess; i++)
    r = ops[i].send ? ncclSend(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, c->nccl, (cudaStream_t)stream)
                    : ncclRecv(ops[i].buf, ops[i].bytes, ncclUint8, ops[i].peer, c->nccl, (cudaStream_t)stream);
  ncclResult_t e = ncclGroupEnd();
  if (r != ncclSuccess) return nccl_fail(r, c->nccl, fn, "ncclSend/ncclRecv");
  if (e != ncclSuccess) return nccl_fail(e, c->nccl, fn, "ncclGroupEnd");
  return KVI_OK;
#else
  (void)stream;
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "no NCCL in this build");
#endif
}

kvi_status kvi__comm_allgather_host(kvi_comm *c, const void *send, void *recv, size_t bytes, const char *fn) {
  if (c->kind == KVI__COMM_LOCAL) return local_allgather(c, send, recv, bytes);
#ifdef KVI_HAVE_NCCL
  return nccl_control(c, send, recv, bytes, -1, fn);
#else
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "no NCCL in this build");
#endif
}

kvi_status kvi__comm_bcast_host(kvi_comm *c, void *buf, size_t bytes, int32_t root, const char *fn) {
  if (c->kind == KVI__COMM_LOCAL) return local_bcast(c, buf, bytes, root);
#ifdef KVI_HAVE_NCCL
  return nccl_control(c, buf, buf, bytes, root, fn);
#else
  return kvi__fail(KVI_ERR_NOT_BUILT, fn, "no NCCL in this build");
#endif
}
