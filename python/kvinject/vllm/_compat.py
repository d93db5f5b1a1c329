"""What the connector reads of vLLM beyond its connector API: private
attributes and internals, and whatever differs between the versions it
supports (vLLM 0.23 with CUDA, vLLM 0.32's CPU build). This is the only module
of kvinject.vllm that touches them; the scheduler and worker roles call these
functions and run without vLLM (their unit tests give them fakes).

vLLM is imported here only inside the functions that need it, and only where
the engine has loaded it already (the connector's module imports vLLM's base
class before the roles), so importing the roles never imports vLLM.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from .layout import CPU_BACKEND, LayoutError

_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def init_logger(name: str):
    """vLLM's logger for the name where vLLM is loaded, else the logging module's."""
    if "vllm" in sys.modules:
        try:
            from vllm.logger import init_logger as vllm_logger
            return vllm_logger(name)
        except Exception:  # pragma: no cover
            pass
    return logging.getLogger(name)


def _metadata_base() -> type:
    # vLLM's KVConnectorMetadata (an empty ABC vLLM never checks against) when the
    # connector's module has loaded it; object for the roles alone
    base = sys.modules.get(_BASE_MODULE)
    return getattr(base, "KVConnectorMetadata", object) if base is not None else object


#: the base class of the connector's metadata (kvinject.vllm.metadata)
KVConnectorMetadata = _metadata_base()


# ------------------------------------------------------------------ scheduler

def set_cache_salt(request, salt: str) -> None:
    """Gives a vLLM Request the cache salt ``salt`` and hashes its blocks again,
    so that vLLM's prefix cache can match them only with requests of the same
    salt. vLLM 0.23 and 0.32 hash a request's blocks when it is made, through
    the request's private ``_block_hasher``, with the salt in the first block's
    hash; a request hashed some other way cannot be salted here (RuntimeError)."""
    request.cache_salt = salt
    if getattr(request, "_block_hasher", None) is not None:
        request.block_hashes = []
        request.update_block_hashes()
    elif request.block_hashes:  # hashed some other way: the salt would not reach them
        raise RuntimeError("kvinject: this vLLM's requests hash their blocks without a _block_hasher; "
                           "the connector cannot salt them, and vLLM's prefix cache would share injected "
                           "blocks (vLLM 0.23 and 0.32 are supported)")


@dataclass
class Scheduled:
    """One request of a scheduler step (SchedulerOutput), in the terms of the
    connector: ``block_ids`` are the blocks (of KV cache group 0) the step gives
    it, None for none; ``first`` says they are all of the request's blocks (a
    new request, or one resumed after preemption), else they follow those it
    had."""

    req_id: str
    block_ids: Optional[List[int]]
    first: bool
    num_computed_tokens: int
    num_scheduled_tokens: int


def scheduled_requests(scheduler_output) -> List[Scheduled]:
    """The requests of a SchedulerOutput, new ones first, then the cached ones
    (vLLM's CachedRequestData: parallel lists, and ``resumed_req_ids``, the set
    of those resumed from preemption)."""
    sched = scheduler_output.num_scheduled_tokens
    out = []
    for nr in scheduler_output.scheduled_new_reqs:
        out.append(Scheduled(nr.req_id, list(nr.block_ids[0]), True, nr.num_computed_tokens,
                             sched.get(nr.req_id, 0)))
    cached = scheduler_output.scheduled_cached_reqs
    for i, rid in enumerate(cached.req_ids):
        new = cached.new_block_ids[i]
        out.append(Scheduled(rid, list(new[0]) if new is not None else None, rid in cached.resumed_req_ids,
                             cached.num_computed_tokens[i], sched.get(rid, 0)))
    return out


# --------------------------------------------------------------------- worker

def bound_metadata(connector) -> Any:
    """The metadata vLLM bound to the connector for this step (through the base
    class's private accessor), or None."""
    if not connector.has_connector_metadata():
        return None
    return connector._get_connector_metadata()


def attention_backend(vllm_config, layer_name: str, block_size: int) -> Tuple[str, Optional[str]]:
    """(backend name, kernel ISA or None) of the attention layer ``layer_name``,
    from vLLM's static forward context. The CPU backend's ISA decides its cache
    layout: the layer's ``isa`` where it has one, else what vLLM's private
    ``_get_attn_isa`` picks for the model (vLLM 0.32)."""
    ctx = vllm_config.compilation_config.static_forward_context
    layer = ctx.get(layer_name)
    if layer is None or not hasattr(layer, "attn_backend"):
        raise LayoutError("kvinject: no attention layer %r in vLLM's forward context" % layer_name)
    backend = layer.attn_backend.get_name()
    isa = getattr(layer, "isa", None)
    if backend == CPU_BACKEND and isa is None:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(vllm_config.model_config.dtype, block_size, layer.head_size,
                            vllm_config.cache_config.cache_dtype)
    return backend, isa


def tensor_parallel() -> Tuple[int, int]:
    """(rank, size) of this worker in vLLM's tensor-parallel group."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
