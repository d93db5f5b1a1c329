/*
 * libkvinject — the transport seam under tensor-parallel stores (comm.c) and
 * the sharding logic over it (create.c, scatter.c, gather.c, agreement.c,
 * search.c, over helpers.c, op.c and tp/internal.h).
 * SPDX-License-Identifier: Apache-2.0
 *
 * A communicator moves bytes between the ranks of one group. The sharding
 * code is written once against the operations below; comm.c implements them
 * over NCCL (device buffers, enqueued on a stream) and over an in-process
 * group of threads (host buffers, memcpy, synchronous).
 */
#ifndef KVI_TP_H
#define KVI_TP_H

#include "gpu/gpu.h"
#include "kvinject/comm.h"

typedef enum kvi__comm_kind { KVI__COMM_LOCAL = 1, KVI__COMM_NCCL = 2 } kvi__comm_kind;

struct kvi_comm {
  kvi__comm_kind kind;
  int32_t rank, size;
  kvi_memory memory;     /* where data buffers live: HOST (local) or DEVICE (NCCL) */
  int device;            /* NCCL: the communicator's device; -1 otherwise */
  kvi_comm_group *group; /* local */
  struct ncclComm *nccl; /* NCCL, borrowed */
  struct CUstream_st *stream; /* NCCL: control exchanges */
  void *scratch;         /* NCCL: device buffer for control exchanges */
  size_t scratch_bytes;
};

/* One side of a point-to-point transfer. */
typedef struct kvi__p2p {
  int32_t peer;
  bool send;
  void *buf; /* comm->memory; a send's is only read */
  size_t bytes;
} kvi__p2p;

/* Every rank contributes `bytes` from send; recv (size * bytes) receives
 * them in rank order. Buffers in comm->memory; NCCL enqueues on stream.
 * In-process transport only: a NULL send contributes bytes of all ones (a
 * rank that could not build its part still takes part; a status field then
 * reads as -1), a NULL recv takes part without receiving. */
kvi_status kvi__comm_allgather(kvi_comm *c, const void *send, void *recv, size_t bytes, struct CUstream_st *stream,
                               const char *fn);

/* A group of sends and receives, matched in order per pair of ranks.
 * Buffers in comm->memory; NCCL enqueues on stream. */
kvi_status kvi__comm_p2p(kvi_comm *c, const kvi__p2p *ops, int32_t n, struct CUstream_st *stream, const char *fn);

/* Synchronous all-gather of small host buffers (control data); NULL send
 * and recv as for kvi__comm_allgather, on every transport. */
kvi_status kvi__comm_allgather_host(kvi_comm *c, const void *send, void *recv, size_t bytes, const char *fn);

/* Synchronous broadcast of a host buffer from root. */
kvi_status kvi__comm_bcast_host(kvi_comm *c, void *buf, size_t bytes, int32_t root, const char *fn);

/* Whether libnccl loads (comm.c; false without NCCL in the build). */
bool kvi__nccl_usable(void);

/* The internal twins of kvinject/comm.h's functions (lib/api/tp.c holds the
 * entry points): the same parameters, plus the public name for messages. */

/* kvi_comm_group_create. */
kvi_status kvi__comm_group_create(kvi_comm_group **out, int32_t size, const char *fn);
/* kvi_comm_group_destroy. */
void kvi__comm_group_destroy(kvi_comm_group *g);
/* kvi_comm_create_local. */
kvi_status kvi__comm_create_local(kvi_comm **out, kvi_comm_group *g, int32_t rank, const char *fn);
/* kvi_comm_create_nccl; runs on the communicator's device (kvi__comm_nccl_device). */
kvi_status kvi__comm_create_nccl(kvi_comm **out, struct ncclComm *nccl, const char *fn);
/* The device of the NCCL communicator kvi_comm_create_nccl wraps, into
 * *device: kvi_comm_create_nccl's checks and queries (its errors), and no
 * device work. */
kvi_status kvi__comm_nccl_device(kvi_comm **out, struct ncclComm *nccl, int *device, const char *fn);
/* kvi_comm_destroy (device_ok false: the device could not be made current;
 * an NCCL communicator's stream and scratch buffer are then left). */
void kvi__comm_destroy(kvi_comm *c, bool device_ok);
/* kvi_comm_rank. */
kvi_status kvi__comm_rank(const kvi_comm *c, int32_t *out_rank, int32_t *out_size, const char *fn);
/* kvi_comm_async_errors. */
kvi_status kvi__comm_async_errors(kvi_comm *c, int64_t *out_count, const char *fn);
/* The communicator's CUDA device (NCCL), or -1 for an in-process one (and NULL). */
int kvi__comm_device(const kvi_comm *c);

/* The twins of kvinject/comm.h's store functions (create.c, scatter.c,
 * gather.c, agreement.c). Every one runs on the store's device; a store
 * with an NCCL communicator is on the communicator's device (checked by
 * kvi__shard_store_create). */

/* kvi_store_create (with or without a communicator; it calls store.c's
 * kvi__store_create for this rank's store). */
kvi_status kvi__shard_store_create(kvi_store **out, const kvi_model *model, const kvi_store_options *opts,
                                   const char *fn);
/* The device kvi__shard_store_create runs on: an NCCL communicator's (the
 * ranks' agreement runs there, and a store on another device fails the
 * create), else the device the options put the store on; -1 for a CPU
 * store and for options that the create refuses (it then reports why). No
 * device work. */
int kvi__shard_store_device(const kvi_store_options *opts, const char *fn);
/* kvi_store_put_scatter. */
kvi_status kvi__store_put_scatter(kvi_store *store, int32_t root, const kvi_scatter_item *items, int32_t num_items,
                                  struct CUstream_st *stream, const char *fn);
/* kvi_store_gather. */
kvi_status kvi__store_gather(kvi_store *store, int32_t root, const kvi_gather_item *items, int32_t num_items,
                             struct CUstream_st *stream, const char *fn);
/* kvi_store_check_agreement. */
kvi_status kvi__store_check_agreement(kvi_store *store, const char *fn);

#endif /* KVI_TP_H */
