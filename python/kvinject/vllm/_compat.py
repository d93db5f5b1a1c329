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

import hashlib
import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from .layout import CPU_BACKEND, LayoutError

_BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_METRICS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"


def logger_name(name: str) -> str:
    """The name of a connector module's logger: a child of vLLM's "vllm" logger
    (``kvinject.vllm.worker`` -> ``vllm.kvinject.worker``). vLLM 0.32 configures
    only that logger (its handler, format and level, propagate off): a logger
    outside it would reach the root logger, where INFO is not shown."""
    if name.startswith("kvinject.vllm."):
        return "vllm.kvinject." + name[len("kvinject.vllm."):]
    return name if name == "vllm" or name.startswith("vllm.") else "vllm." + name


def init_logger(name: str):
    """The logger of a connector module (``logger_name``): vLLM's init_logger
    where vLLM is loaded, else the logging module's (the same logger)."""
    name = logger_name(name)
    if "vllm" in sys.modules:
        try:
            from vllm.logger import init_logger as vllm_logger
            return vllm_logger(name)
        except Exception:  # pragma: no cover
            pass
    return logging.getLogger(name)


def _vllm_class(module: str, name: str, fallback: type) -> type:
    # vLLM's class where the engine has loaded vLLM's connector base (the
    # connector's module imports it before the roles); ``fallback`` for the
    # roles alone and for vLLM versions without it
    if _BASE_MODULE not in sys.modules:
        return fallback
    try:
        mod = sys.modules.get(module) or importlib.import_module(module)
    except Exception:  # pragma: no cover
        return fallback
    return getattr(mod, name, fallback)


def _metadata_base() -> type:
    # vLLM's KVConnectorMetadata (an empty ABC vLLM never checks against)
    return _vllm_class(_BASE_MODULE, "KVConnectorMetadata", object)


@dataclass
class _Stats:
    """vLLM 0.32's KVConnectorStats, where vLLM is not loaded: its data dict."""

    data: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return self.data


class _PromMetrics:
    """vLLM 0.32's KVConnectorPromMetrics, where vLLM is not loaded: what its
    constructor keeps."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        by_name = {k.__name__: v for k, v in metric_types.items()}  # keyed by prometheus_client's classes
        self._gauge_cls, self._counter_cls = by_name["Gauge"], by_name["Counter"]
        self._histogram_cls = by_name["Histogram"]
        self._kv_transfer_config = getattr(vllm_config, "kv_transfer_config", None)
        self._labelnames = labelnames
        self.per_engine_labelvalues = per_engine_labelvalues


#: the base class of the connector's metadata (kvinject.vllm.metadata)
KVConnectorMetadata = _metadata_base()
#: the base class of what the workers send back each step (kvinject.vllm.results;
#: vLLM 0.32's worker-metadata channel; object where this vLLM has none)
KVConnectorWorkerMetadata = _vllm_class(_BASE_MODULE, "KVConnectorWorkerMetadata", object)
#: the base classes of the connector's statistics and Prometheus metrics (kvinject.vllm.stats)
KVConnectorStats = _vllm_class(_METRICS_MODULE, "KVConnectorStats", _Stats)
KVConnectorPromMetrics = _vllm_class(_METRICS_MODULE, "KVConnectorPromMetrics", _PromMetrics)


def worker_meta(connector_output) -> Any:
    """The workers' combined metadata of a step in vLLM's KVConnectorOutput
    (None: none, or a vLLM without the channel)."""
    return getattr(connector_output, "kv_connector_worker_meta", None)


def finished_with_error(request) -> bool:
    """Whether vLLM finished the request with an error (RequestStatus.FINISHED_ERROR)."""
    return getattr(getattr(request, "status", None), "name", "") == "FINISHED_ERROR"


# ------------------------------------------------------------------ scheduler

def set_cache_salt(request, salt: str) -> None:
    """Gives a vLLM Request the cache salt ``salt``, so that vLLM's prefix cache
    can match its blocks only with requests of the same salt. vLLM 0.23 and 0.32
    hash a request's full blocks when it is made, through the request's private
    ``_block_hasher`` (each hash over its parent's, so each names the whole
    prefix up to its block). Hashing them all again with the salt costs a hash
    of every block's tokens (0.13 ms at 1,232 tokens, bench_connector_host.py);
    the hashes are salted instead (salted_block_hashes). Blocks hashed later (a
    prompt shorter than a block, output tokens) chain on them through vLLM's
    hasher, the salt in the first block's hash as vLLM puts it there. A request
    hashed some other way cannot be salted here (RuntimeError)."""
    request.cache_salt = salt
    if getattr(request, "_block_hasher", None) is not None:
        if request.block_hashes:
            request.block_hashes[:] = salted_block_hashes(request.block_hashes, salt)
    elif request.block_hashes:  # hashed some other way: the salt would not reach them
        raise RuntimeError("kvinject: this vLLM's requests hash their blocks without a _block_hasher; "
                           "the connector cannot salt them, and vLLM's prefix cache would share injected "
                           "blocks (vLLM 0.23 and 0.32 are supported)")


def salted_block_hashes(hashes: List[bytes], salt: str) -> List[bytes]:
    """Each block hash XORed with a digest of ``salt`` of its own length
    (SHAKE-256): a name of the salt and the prefix, as long as vLLM's, that no
    request of another salt has (the salts hold a random nonce of the engine's,
    so a salted hash equals another request's only by a collision of the hash
    function's size). In one big-integer XOR over all the hashes: 13 µs for 79
    blocks on the CI VM, where a SHA-256 of each took 30 µs."""
    blob = b"".join(hashes)
    width = len(hashes[0])
    if not width or len(blob) != width * len(hashes):  # mixed lengths (no vLLM makes them): one at a time
        return [salted_block_hashes([h], salt)[0] if h else h for h in hashes]
    tag = hashlib.shake_256(salt.encode()).digest(width) * len(hashes)
    x = (int.from_bytes(blob, "little") ^ int.from_bytes(tag, "little")).to_bytes(len(blob), "little")
    return [x[i:i + width] for i in range(0, len(x), width)]


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
    """The metadata vLLM bound to the connector for this step (the base class's
    private attribute, which bind_connector_metadata sets and
    clear_connector_metadata empties), or None. Not through
    has_connector_metadata, which the connector answers for vLLM's per-layer
    hooks."""
    return getattr(connector, "_connector_metadata", None)


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
