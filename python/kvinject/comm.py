"""Communicators for tensor-parallel stores (kvinject/comm.h).

A :class:`Comm` is what ``Store(..., comm=...)`` takes. Two kinds:

- :meth:`Comm.local`: rank ``rank`` of an in-process :class:`CommGroup`, for ranks
  that are threads of one process and CPU stores (the ctypes calls release the
  GIL, so the ranks' collective calls run concurrently);
- :meth:`Comm.nccl`: an initialized NCCL communicator given as its ``ncclComm_t``
  pointer value (an int; e.g. ``cupy.cuda.nccl.NcclCommunicator.comm``), for CUDA
  stores. The caller keeps that communicator alive until this one is closed.

Collective store calls (creation with a communicator, ``put_scatter``, ``gather``,
``check_agreement``, search with sharded embeddings) must be made by every rank
in the same order; a failure on one rank raises there and raises
:class:`~kvinject.PeerError` on the others.
"""
from __future__ import annotations

import ctypes
from typing import Optional

from ._handle import Handle
from ._lib import fit, lib


class CommGroup(Handle):
    """kvi_comm_group: ``size`` in-process ranks. Close it after its communicators."""

    _destroy, _what = "kvi_comm_group_destroy", "group"

    def __init__(self, size: int):
        h = ctypes.c_void_p()
        lib().call("kvi_comm_group_create", ctypes.byref(h), fit(size, ctypes.c_int32, "size"))
        self._h, self.size = h, size


class Comm(Handle):
    """kvi_comm. Stores made with it must be closed before it."""

    _destroy, _what = "kvi_comm_destroy", "communicator"

    def __init__(self, handle: ctypes.c_void_p, keep=None):
        self._h, self._keep = handle, keep
        r, n = ctypes.c_int32(), ctypes.c_int32()
        lib().call("kvi_comm_rank", handle, ctypes.byref(r), ctypes.byref(n))
        self.rank, self.size = r.value, n.value

    @classmethod
    def local(cls, group: CommGroup, rank: int) -> "Comm":
        h = ctypes.c_void_p()
        lib().call("kvi_comm_create_local", ctypes.byref(h), group.handle, fit(rank, ctypes.c_int32, "rank"))
        return cls(h, keep=group)

    @classmethod
    def nccl(cls, nccl_comm: int) -> "Comm":
        h = ctypes.c_void_p()
        lib().call("kvi_comm_create_nccl", ctypes.byref(h),
                   ctypes.c_void_p(fit(nccl_comm, ctypes.c_uint64, "nccl_comm")))
        return cls(h)

    def async_errors(self) -> int:
        """kvi_comm_async_errors: raises CudaError when NCCL reports an asynchronous
        error; else 0 (a communicator skips no input), as every handle's query."""
        n = ctypes.c_int64()
        lib().call("kvi_comm_async_errors", self.handle, ctypes.byref(n))
        return n.value


def embedding_rank(tenant: int, fact_id: int, tp_size: int) -> Optional[int]:
    """kvi_store_embedding_rank: the rank that keeps a sharded embedding (None for tp_size < 1)."""
    r = lib().kvi_store_embedding_rank(fit(tenant, ctypes.c_uint64, "tenant"), fit(fact_id, ctypes.c_uint64, "fact_id"),
                                       fit(tp_size, ctypes.c_int32, "tp_size"))
    return None if r < 0 else r
