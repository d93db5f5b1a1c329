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
its own (so vLLM's prefix cache can never hand its blocks, which hold KV a
plain prefill would not compute, to another request), claims the injected
prefix as externally computed (less what vLLM's prefix cache already has), and
tells the workers, per step, which blocks to fill and which spans to capture.
Worker side (one per tensor-parallel rank): one store per worker holding this
rank's KV heads; derives the cache layout from the tensors register_kv_caches
receives and the attention backend (kvinject.vllm.layout); per step, one
kvi_inject for all requests (or one per layer when ``layerwise``), and after
the forward one kvi_encode for all captures.

A request whose parameters are wrong, or whose facts cannot be injected
(unknown fact, another tenant's fact, a span whose length is not the fact's),
fails alone: its blocks are reported as failed loads and vLLM finishes it
with finish reason "error" (kv_load_failure_policy "fail", the default); the
message is logged and, with ``events_path``, written to the event file. The
other requests of the step are injected and served.

kv_connector_extra_config (all optional):

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
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from ..enums import Backend
from ..errors import KviError
from ..store import Store
from ..transfer import Capture, Encoder, InjectRequest, Injector
from .layout import CPU_BACKEND, LayoutError, derive_layout, ordered_layers
from .prompt import PARAMS_KEY, RequestSpec, parse_params
from .retrieval import STORE_DTYPES, store_model

try:
    from vllm.logger import init_logger
    logger = init_logger(__name__)
except Exception:  # pragma: no cover
    logger = logging.getLogger(__name__)



# ------------------------------------------------------------------ metadata

@dataclass
class InjectJob:
    req_id: str
    tenant: int
    facts: List[Tuple[int, int, int]]  # (fact_id, start, length), the ones to write
    block_ids: List[int]


@dataclass
class CaptureJob:
    req_id: str
    tenant: int
    captures: List[Tuple[int, int, int, Optional[List[float]], bool]]  # (fact_id, start, length, emb, replace)
    block_ids: List[int]


@dataclass
class FailJob:
    req_id: str
    message: str
    block_ids: List[int]


@dataclass
class KVInjectMetadata(KVConnectorMetadata):
    injects: List[InjectJob] = field(default_factory=list)
    captures: List[CaptureJob] = field(default_factory=list)
    failures: List[FailJob] = field(default_factory=list)


@dataclass
class _ReqState:
    spec: Optional[RequestSpec]
    error: Optional[str]
    external: int = 0                      # tokens claimed at the last allocation
    block_ids: List[int] = field(default_factory=list)
    capture_pending: bool = False


class _Events:
    """JSON lines to a file (or nothing)."""

    def __init__(self, path: Optional[str]):
        self.f = open(path, "a", buffering=1) if path else None

    def write(self, **rec) -> None:
        if self.f is not None:
            rec["t"] = time.time()
            self.f.write(json.dumps(rec) + "\n")


def _extra(vllm_config) -> Dict[str, Any]:
    ktc = vllm_config.kv_transfer_config
    return dict(getattr(ktc, "kv_connector_extra_config", None) or {})


class KVInjectConnector(KVConnectorBase_V1):
    """libkvinject's vLLM connector (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._cfg = _extra(vllm_config)
        known = {"store_budget_mb", "store_dtype", "page_tokens", "embedding_dim", "layerwise", "events_path",
                 "rope", "store_path", "time_device"}
        unknown = set(self._cfg) - known
        if unknown:
            raise ValueError("kvinject connector: unknown kv_connector_extra_config keys %s (known: %s)"
                             % (sorted(unknown), ", ".join(sorted(known))))
        self._embedding_dim = int(self._cfg.get("embedding_dim", 0))
        self._block_size = vllm_config.cache_config.block_size
        events = self._cfg.get("events_path")
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: Dict[str, _ReqState] = {}
            self._nonce = uuid.uuid4().hex  # salts are unique to this engine and request
            self._events = _Events(events + ".scheduler.jsonl" if events else None)
        else:
            self._store: Optional[Store] = None
            self._injector: Optional[Injector] = None
            self._encoder: Optional[Encoder] = None
            self._layer_index: Dict[str, int] = {}
            self._failed_blocks: Set[int] = set()
            self._pending: List[Tuple[InjectJob, InjectRequest]] = []
            self._layerwise = bool(self._cfg.get("layerwise", False))
            self._time_device = bool(self._cfg.get("time_device", False))
            self._timing: Optional[Tuple[Any, Any, Dict[str, Any]]] = None  # (start, end event, inject record)
            self._events_path = events
            self._events = _Events(None)
            self._step = 0
            self._layers_done = 0

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: Dict[str, Any]) -> bool:
        """Layer-by-layer injection runs in wait_for_layer_load, a host call at each
        attention layer: vLLM must keep attention out of its CUDA graphs (piecewise
        graphs), or replays would skip it. Injection before the forward needs nothing."""
        return bool((extra_config or {}).get("layerwise", False))

    # ============================================================ scheduler

    def on_new_request(self, request) -> None:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return
        try:
            spec, error = parse_params(params, request.num_prompt_tokens, self._embedding_dim), None
        except ValueError as e:
            spec, error = None, str(e)
            logger.error("kvinject: request %s fails: %s", request.request_id, error)
            self._events.write(event="request_error", req_id=request.request_id, message=error)
        if error is not None or spec.inject:
            # blocks holding injected KV (or none valid) are reachable by this
            # request alone: a salt no other request has, block hashes redone
            request.cache_salt = "kvinject:%s:%s" % (self._nonce, request.request_id)
            if getattr(request, "_block_hasher", None) is not None:
                request.block_hashes = []
                request.update_block_hashes()
            elif request.block_hashes:  # hashed some other way: the salt would not reach them
                raise RuntimeError("kvinject: this vLLM's requests hash their blocks without a _block_hasher; "
                                   "the connector cannot salt them, and vLLM's prefix cache would share injected "
                                   "blocks (vLLM 0.23 and 0.32 are supported)")
        self._reqs[request.request_id] = _ReqState(spec, error, capture_pending=bool(spec and spec.capture))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None:
            return 0, False
        if st.error is not None:
            # one claimed token gives the request a block the worker reports as
            # failed, which makes vLLM finish it with an error
            return (1 if num_computed_tokens == 0 and request.num_prompt_tokens > 1 else 0), False
        end = st.spec.claim_end
        return max(end - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is not None:
            st.external = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVInjectMetadata:
        t0 = time.perf_counter()
        meta = KVInjectMetadata()
        progressed = []
        for nr in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            progressed.append((nr.req_id, st, nr.num_computed_tokens, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new = cached.new_block_ids[i]
            resumed = rid in cached.resumed_req_ids
            if resumed:
                st.block_ids = list(new[0]) if new is not None else []
            elif new is not None:
                st.block_ids += list(new[0])
            progressed.append((rid, st, cached.num_computed_tokens[i], resumed))
        for rid, st, computed, first in progressed:
            if st.error is not None:
                if first:
                    meta.failures.append(FailJob(rid, st.error, list(st.block_ids)))
                continue
            spec = st.spec
            if first and st.external > 0:
                local = computed - st.external
                facts = [(s.fact_id, s.start, s.length) for s in spec.inject if s.start + s.length > local]
                meta.injects.append(InjectJob(rid, spec.tenant, facts, list(st.block_ids)))
                st.external = 0
            done = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            if st.capture_pending and done >= spec.capture_end:
                meta.captures.append(CaptureJob(rid, spec.tenant,
                                                [(c.fact_id, c.start, c.length, c.embedding, c.replace)
                                                 for c in spec.capture], list(st.block_ids)))
                st.capture_pending = False
        if meta.injects or meta.captures or meta.failures:
            self._events.write(event="schedule", injects=len(meta.injects), captures=len(meta.captures),
                               failures=len(meta.failures), host_us=(time.perf_counter() - t0) * 1e6)
        return meta

    def request_finished(self, request, block_ids):
        self._reqs.pop(request.request_id, None)
        return False, None

    # =============================================================== worker

    def register_kv_caches(self, kv_caches: Dict[str, Any]):
        vc = self._vllm_config
        names, tensors = ordered_layers(kv_caches)
        self._layer_index = {n: i for i, n in enumerate(names)}
        ctx = vc.compilation_config.static_forward_context
        layer = ctx.get(names[0])
        if layer is None or not hasattr(layer, "attn_backend"):
            raise LayoutError("kvinject: no attention layer %r in vLLM's forward context" % names[0])
        backend = layer.attn_backend.get_name()
        isa = getattr(layer, "isa", None)
        if backend == CPU_BACKEND and isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
            isa = _get_attn_isa(vc.model_config.dtype, self._block_size, layer.head_size,
                                vc.cache_config.cache_dtype)
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        model = store_model(vc.model_config.hf_config, self._cfg.get("rope"), num_layers=len(names),
                            tp_rank=tp_rank, tp_size=tp_size)  # RoPE always explicit, every layer
        layout = derive_layout(tensors, backend, num_kv_heads=model.local_heads, head_size=model.head_size,
                               block_size=self._block_size, isa=isa)
        first = tensors[0]
        on_cpu = first.device.type == "cpu"
        dtype = STORE_DTYPES[self._cfg.get("store_dtype", "fp32")]
        opts = dict(backend=Backend.CPU if on_cpu else Backend.CUDA, device=None if on_cpu else first.device.index,
                    dtype=dtype, page_tokens=int(self._cfg.get("page_tokens", 16)),
                    embedding_dim=self._embedding_dim or None)
        budget = int(self._cfg.get("store_budget_mb", 256)) << 20
        path = self._cfg.get("store_path")
        if path and tp_size > 1:
            path = "%s.rank%d" % (path, tp_rank)
        if path and os.path.exists(path):
            self._store = Store.load(model, path, budget, journal=True, **opts)
        else:
            self._store = Store(model, budget, **opts)
            if path:
                self._store.journal_open(path)
        model.close()
        self._injector = Injector(self._store, layout)
        self._encoder = Encoder(self._store, layout)
        self._on_cpu = on_cpu
        if self._events_path:
            self._events = _Events("%s.worker%d.jsonl" % (self._events_path, tp_rank))
        self._events.write(event="register", backend=backend, isa=isa, layers=len(names),
                           local_heads=model.local_heads, head_size=model.head_size, block_size=layout.block_size,
                           num_blocks=layout.num_blocks, dtype=layout.dtype.name, tp_rank=tp_rank, tp_size=tp_size)
        logger.info("kvinject: %s cache (%s) of %d layers x %d heads x %d, %d blocks of %d; store %s",
                    backend, isa or "-", len(names), model.local_heads, model.head_size, layout.num_blocks,
                    layout.block_size, self._store)

    @property
    def store(self) -> Store:
        """This worker's store (after register_kv_caches)."""
        return self._store

    def _stream(self):
        if self._on_cpu:
            return None
        import torch
        return torch.cuda.current_stream()

    def _fail(self, job_id: str, message: str, block_ids: List[int]) -> None:
        logger.error("kvinject: request %s fails: %s", job_id, message)
        self._events.write(event="request_error", req_id=job_id, message=message, step=self._step)
        self._failed_blocks.update(block_ids)

    def _check(self, job: InjectJob) -> None:
        """Why a job cannot be injected (raises KviError / ValueError), on the host."""
        for fid, start, length in job.facts:
            n = self._store.fact_tokens(job.tenant, fid)  # NotFoundError: unknown for this tenant
            if n != length:
                raise ValueError("fact %d of tenant %d has %d tokens; the prompt's span for it at token %d "
                                 "has %d" % (fid, job.tenant, n, start, length))
        end = job.facts[-1][1] + job.facts[-1][2] if job.facts else 0
        if end > len(job.block_ids) * self._block_size:
            raise ValueError("the facts end at token %d; the request has %d blocks of %d"
                             % (end, len(job.block_ids), self._block_size))

    def _request(self, job: InjectJob) -> InjectRequest:
        first = job.facts[0][1]
        return InjectRequest(job.tenant, [f[0] for f in job.facts], job.block_ids, first_slot=first,
                             start_position=first)

    def _inject(self, jobs: List[Tuple[InjectJob, InjectRequest]], layer_begin=0, layer_end=0):
        """One kvi_inject for all jobs; on failure, the failing jobs are found and
        failed, and the others injected. Returns (jobs injected, kvi seconds)."""
        t = time.perf_counter()
        try:
            self._injector.inject([r for _, r in jobs], layer_begin=layer_begin, layer_end=layer_end,
                                  stream=self._stream())
            return jobs, time.perf_counter() - t
        except KviError:
            pass
        good = []
        for job, req in jobs:
            try:
                self._check(job)
                self._injector.inject(req, layer_begin=layer_begin, layer_end=layer_end, stream=self._stream())
                good.append((job, req))
            except (KviError, ValueError) as e:
                self._fail(job.req_id, str(e), job.block_ids)
        return good, time.perf_counter() - t

    def start_load_kv(self, forward_context, **kwargs) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVInjectMetadata):
            return
        self._step += 1
        t0 = time.perf_counter()
        for f in meta.failures:
            self._fail(f.req_id, f.message, f.block_ids)
        jobs = []
        for job in meta.injects:
            if not job.facts:
                continue
            try:
                self._check(job)
            except (KviError, ValueError) as e:
                self._fail(job.req_id, str(e), job.block_ids)
                continue
            jobs.append((job, self._request(job)))
        if not jobs:
            return
        t1 = time.perf_counter()
        timing = self._time_device and not self._on_cpu
        if timing:
            import torch
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._stream())
        if self._layerwise:
            # layer 0 now, with every check; the rest as vLLM reaches them
            self._pending, kvi_s = self._inject(jobs, 0, 1)
            self._layers_done = 1
        else:
            self._pending = []
            jobs, kvi_s = self._inject(jobs)
        t2 = time.perf_counter()
        rec = dict(event="inject", step=self._step, requests=len(jobs), facts=sum(len(j.facts) for j, _ in jobs),
                   tokens=sum(l for j, _ in jobs for _, _, l in j.facts), layerwise=self._layerwise,
                   check_us=(t1 - t0) * 1e6, kvi_us=kvi_s * 1e6, host_us=(t2 - t0) * 1e6)
        if timing:
            end.record(self._stream())
            self._timing = (start, end, rec)  # written when the step ends (wait_for_save)
        else:
            self._events.write(**rec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._pending:
            return
        i = self._layer_index.get(layer_name)
        if i is None or i == 0:
            return
        self._pending, _ = self._inject(self._pending, i, i + 1)
        self._layers_done += 1

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self):
        if self._pending:
            self._events.write(event="inject_layers", step=self._step, layers=self._layers_done,
                               requests=len(self._pending))
        self._pending = []
        if self._timing is not None:
            # the forward is queued behind the injection on this stream: an event
            # now ends the step's device work (layerwise: device_us is layer 0's
            # injection; the others lie inside the forward)
            import torch
            start, end, rec = self._timing
            self._timing = None
            done = torch.cuda.Event(enable_timing=True)
            done.record(self._stream())
            done.synchronize()
            rec.update(device_us=start.elapsed_time(end) * 1e3, step_device_us=start.elapsed_time(done) * 1e3)
            self._events.write(**rec)
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVInjectMetadata) or not meta.captures:
            return
        t0 = time.perf_counter()
        caps, owner = [], []
        for job in meta.captures:
            for fid, start, length, emb, replace in job.captures:
                caps.append(Capture(job.tenant, fid, job.block_ids, length, first_slot=start, start_position=start,
                                    replace=replace, embedding=emb))
                owner.append(job.req_id)
        stream = self._stream()
        try:
            self._encoder.encode(caps, stream=stream)
            stored = len(caps)
        except KviError:
            # all-or-nothing: store the ones that can be, report the others
            stored = 0
            for c, rid in zip(caps, owner):
                try:
                    self._encoder.encode(c, stream=stream)
                    stored += 1
                except KviError as e:
                    logger.error("kvinject: request %s: capture of fact %d (tenant %d) failed: %s",
                                 rid, c.fact_id, c.tenant, e)
                    self._events.write(event="capture_error", req_id=rid, fact_id=c.fact_id, tenant=c.tenant,
                                       message=str(e), step=self._step)
        if stream is not None:
            stream.synchronize()
        self._events.write(event="capture", step=self._step, captures=len(caps), stored=stored,
                           tokens=sum(c.num_tokens for c in caps), host_us=(time.perf_counter() - t0) * 1e6)

    def get_block_ids_with_load_errors(self) -> Set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self):
        if getattr(self, "_store", None) is not None:
            self._store.close()
            self._store = None
