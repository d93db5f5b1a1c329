/*
 * libkvinject — the transport seam under tensor-parallel stores (comm.c) and
 * the sharding logic over it (shard.c).
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

#endif /* KVI_TP_H */
