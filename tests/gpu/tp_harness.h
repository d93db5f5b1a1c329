/*
 * One process per GPU for the tensor-parallel GPU test and benchmark: the
 * parent forks before touching CUDA (a forked CUDA context is unusable),
 * rank 0 makes NCCL's unique id and passes it to the others through pipes,
 * and every rank builds its NCCL communicator on its own device.
 * SPDX-License-Identifier: Apache-2.0
 */
#ifndef KVI_TP_HARNESS_H
#define KVI_TP_HARNESS_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <kvinject.h>

typedef struct tp_rank {
  int rank, size;
  ncclComm_t nccl;
  kvi_comm *comm;
} tp_rank;

typedef int (*tp_fn)(tp_rank *r, void *arg);

/* CUDA devices, counted in a child so that this process stays CUDA-free. */
static int tp_device_count(void) {
  pid_t p = fork();
  if (p == 0) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
    _exit(n > 100 ? 100 : n);
  }
  int status = 0;
  if (p < 0 || waitpid(p, &status, 0) < 0 || !WIFEXITED(status)) return 0;
  return WEXITSTATUS(status);
}

static int tp_child(int rank, int size, int fds[][2], tp_fn fn, void *arg) {
  ncclUniqueId id;
  if (rank == 0) {
    if (ncclGetUniqueId(&id) != ncclSuccess) return 90;
    for (int r = 1; r < size; r++)
      if (write(fds[r][1], &id, sizeof id) != (ssize_t)sizeof id) return 91;
  } else if (read(fds[rank][0], &id, sizeof id) != (ssize_t)sizeof id) {
    return 92;
  }
  if (cudaSetDevice(rank) != cudaSuccess) return 93;
  tp_rank r = {rank, size, NULL, NULL};
  ncclResult_t nr = ncclCommInitRank(&r.nccl, size, id, rank);
  if (nr != ncclSuccess) {
    fprintf(stderr, "rank %d: ncclCommInitRank: %s\n", rank, ncclGetErrorString(nr));
    return 94;
  }
  if (kvi_comm_create_nccl(&r.comm, r.nccl) != KVI_OK) {
    fprintf(stderr, "rank %d: kvi_comm_create_nccl: %s\n", rank, kvi_last_error());
    return 95;
  }
  const int rc = fn(&r, arg);
  kvi_comm_destroy(r.comm);
  ncclCommDestroy(r.nccl);
  return rc;
}

/* Runs fn on `size` ranks, one process and GPU each; 0 when every rank
 * returned 0. */
static int tp_run(int size, tp_fn fn, void *arg) {
  int fds[8][2];
  pid_t pids[8];
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < size; r++)
    if (pipe(fds[r]) != 0) return 1;
  for (int r = 0; r < size; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      const int rc = tp_child(r, size, fds, fn, arg);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
  }
  int bad = 0;
  for (int r = 0; r < size; r++) {
    int status = 0;
    waitpid(pids[r], &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      fprintf(stderr, "tp %d: rank %d ended with %s %d\n", size, r, WIFEXITED(status) ? "status" : "signal",
              WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
      bad = 1;
    }
  }
  for (int r = 0; r < size; r++) {
    close(fds[r][0]);
    close(fds[r][1]);
  }
  return bad;
}

#endif /* KVI_TP_HARNESS_H */
