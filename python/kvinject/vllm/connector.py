"""KVInjectConnector: libkvinject as a vLLM KV connector (v1 API; vLLM 0.23 with
CUDA and vLLM 0.32's CPU build).

Enable it with::

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model, kv_transfer_config=KVTransferConfig(
        kv_connector="KVInjectConnector", kv_connector_module_path="kvinject.vllm.connector",
        kv_role="kv_both", kv_connector_extra_config={"store_budget_mb": 256}))

Requests say what they want through ``kv_transfer_params["kvinject"]``
(kvinject.vllm.prompt: the parameters, and helpers that build them with the
prompt). Scheduler side (one per engine): parses and checks each request's
parameters when it arrives, gives every request that injects a cache salt of
its own where vLLM's prefix cache is on (so it can never hand its blocks, which
hold KV a plain prefill would not compute, to another request), claims the injected
prefix as externally computed (less what vLLM's prefix cache already has), and
tells the workers, per step, which blocks to fill and which spans to capture.
Worker side (one per tensor-parallel rank): one store per worker holding this
rank's KV heads; derives the cache layout from the tensors register_kv_caches
receives and the attention backend (kvinject.vllm.layout); per step, the
removals, one kvi_inject for all requests (or one per layer when
``layerwise``), and after the forward one kvi_encode for all captures.

After each step the workers' results per request come back to the scheduler
(vLLM's worker metadata: kvinject.vllm.results), which returns each finished
request's outcome as its ``kv_transfer_params`` (``{"kvinject": {...}}``), and
their statistics go to vLLM's log and Prometheus metrics (kvinject.vllm.stats).

This module is the class vLLM loads; it hands each call to its role:
kvinject.vllm.scheduler (KVInjectScheduler), kvinject.vllm.worker
(KVInjectWorker), with kvinject.vllm.metadata (what the scheduler sends the
workers each step), kvinject.vllm.results (what they send back),
kvinject.vllm.stats (statistics and metrics), kvinject.vllm.config (the
settings) and kvinject.vllm._compat (the only module that reads vLLM's
internals). The roles import no vLLM.

A request whose parameters are wrong, or whose facts cannot be injected
(unknown fact, another tenant's fact, a span whose length is not the fact's),
fails alone: its blocks are reported as failed loads and vLLM finishes it
with finish reason "error" (kv_load_failure_policy "fail", the default); the
message is logged and, with ``events_path``, written to the event file. The
other requests of the step are injected and served.

Settings (all optional) come from kv_connector_extra_config, over
``KVINJECT_CONNECTOR_<KEY>`` environment variables, over the ``connector:``
section of the YAML file ``KVINJECT_CONFIG_FILE`` names (kvinject.settings,
kvinject.vllm.config; docs/guide/configuration.md):

- ``store_budget_mb`` (256): the store's reserved memory per worker.
- ``store_dtype`` ("fp32"; "bf16", "fp16", "fp8_e4m3"): how facts are kept.
  fp32 makes capture + injection at the same positions reproduce vLLM's own
  cache (bit for bit in practice for bf16 caches).
- ``page_tokens`` (16): store page size.
- ``embedding_dim`` (0): embeddings kept with captured facts.
- ``store_path``: a store file: loaded at start when it exists (its model,
  RoPE, dtype and embedding_dim must match), and kept as the store's journal,
  so every captured fact is in the file before its request's step ends
  (with tensor parallelism, one file per rank: ``<store_path>.rank<r>``).
- ``layerwise`` (False): inject layer by layer in wait_for_layer_load. vLLM
  then captures only piecewise CUDA graphs (attention runs outside them, where
  the hook is called); the default, all layers in start_load_kv before the
  forward, works with vLLM's full CUDA graphs too.
- ``time_device`` (False): with a CUDA store, time each step's injection on the
  GPU (CUDA events on vLLM's stream, read at the end of the step) and write
  ``device_us`` (the injection; layer 0's with ``layerwise``) and
  ``step_device_us`` (from the injection's start to the end of the step's
  forward) to the ``inject`` event. Costs one
  wait for the step's GPU work in wait_for_save; for measurements.
- ``events_path``: append JSON lines (per-step timing, captures, errors) to
  ``<events_path>.worker<rank>.jsonl`` and ``<events_path>.scheduler.jsonl``.
- ``rope``: kvi_rope_spec fields overriding the mapping of the model's config
  (kvinject.hf.kvi_rope_fields), e.g. ``{"theta": 10000.0}``.
- ``disk_dir``, ``disk_budget_bytes``, ``disk_owner``, ``disk_lease_ms``: the
  store's disk tier (one file per tenant, shared by replicas; memory a cache of
  it; not with ``store_path``); ``hybrid`` (True), ``disk_read_mb_s`` (0:
  measured), ``prefill_tokens_s`` (5000): the hybrid plan of facts only on disk
  (awaited, or prefilled as text and prefetched: kvinject.vllm.scheduler).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from ..store import Store
from . import _compat
from .config import KVInjectConfig, requires_piecewise
from .metadata import CaptureJob, FailJob, InjectJob, KVInjectMetadata, RemoveJob
from .results import KVInjectWorkerMeta
from .scheduler import KVInjectScheduler
from .stats import KVInjectPromMetrics, KVInjectStats, copy_data
from .worker import KVInjectWorker

__all__ = ["CaptureJob", "FailJob", "InjectJob", "KVInjectConnector", "KVInjectMetadata", "KVInjectStats",
           "KVInjectWorkerMeta", "RemoveJob"]


class KVInjectConnector(KVConnectorBase_V1):
    """libkvinject's vLLM connector (see the module docstring): the scheduler
    role's calls go to ``connector_scheduler``, the worker role's to
    ``connector_worker`` (the other is None)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = KVInjectConfig.from_vllm_config(vllm_config)
        self.connector_scheduler: Optional[KVInjectScheduler] = None
        self.connector_worker: Optional[KVInjectWorker] = None
        if role == KVConnectorRole.SCHEDULER:
            # without vLLM's prefix cache no block is shared: requests need no salt
            cache = getattr(vllm_config, "cache_config", None)
            self.connector_scheduler = KVInjectScheduler(
                config, prefix_caching=bool(getattr(cache, "enable_prefix_caching", True)))
        else:
            self.connector_worker = KVInjectWorker(vllm_config, config)
            # vLLM asks has_connector_metadata around every attention layer of every
            # step run outside a full CUDA graph: the worker's check, one call, not two
            self.has_connector_metadata = self.connector_worker.layers_pending

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """Layer-by-layer injection runs in wait_for_layer_load, a host call at each
        attention layer: vLLM must keep attention out of its CUDA graphs (piecewise
        graphs), or replays would skip it. Injection before the forward needs nothing."""
        return requires_piecewise(extra_config)

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> KVInjectStats:
        """The workers' statistics from their data (in vLLM's API-server process)."""
        return KVInjectStats(data=copy_data(data))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """The connector's Prometheus metrics (kvinject.vllm.stats.METRICS)."""
        return KVInjectPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_kv_connector_stats(self) -> Optional[KVInjectStats]:
        """The worker's statistics since the last call (None: nothing new, or the scheduler)."""
        if self.connector_worker is None:
            return None
        return self.connector_worker.get_kv_connector_stats()

    # ============================================================ scheduler

    def on_new_request(self, request) -> None:
        self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVInjectMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        return self.connector_scheduler.request_finished(request, block_ids)

    # =============================================================== worker

    def register_kv_caches(self, kv_caches: Dict[str, Any]):
        self.connector_worker.register_kv_caches(kv_caches)

    @property
    def store(self) -> Optional[Store]:
        """This worker's store (after register_kv_caches)."""
        return self.connector_worker.store

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """vLLM's first worker call of a step that carries the step's metadata; its
        first model runner makes it before it prepares the step's inputs (its second,
        right before start_load_kv). The step starts here, so that its injection can run
        on the GPU while the host prepares the forward rather than in front of it. Nothing
        here is about preemption: a preempted request's blocks hold nothing the
        connector must save."""
        if self.connector_worker is not None:
            self.connector_worker.start_load_kv(kv_connector_metadata, hook="handle_preemptions")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Starts the step, unless handle_preemptions did."""
        self.connector_worker.start_load_kv(_compat.bound_metadata(self))

    def has_connector_metadata(self) -> bool:
        """Whether vLLM calls wait_for_layer_load and save_kv_layer around each
        attention layer of this step (the wrapper vLLM puts around attention
        asks this, and nothing else does): only while a layer-by-layer injection
        is pending. Every other step skips the two calls per layer; start_load_kv
        and wait_for_save read the bound metadata themselves
        (_compat.bound_metadata)."""
        return self.connector_worker is not None and self.connector_worker.layers_pending()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        self.connector_worker.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self):
        self.connector_worker.wait_for_save(_compat.bound_metadata(self))

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> Optional[KVInjectWorkerMeta]:
        return self.connector_worker.build_connector_worker_meta()

    def shutdown(self):
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
