"""The connector's worker role (one per tensor-parallel rank): one store per
worker holding this rank's KV heads; the cache layout derived from the tensors
register_kv_caches receives and the attention backend (kvinject.vllm.layout);
per step, the removals first, then one kvi_inject for all requests (or one
per layer when ``layerwise``), and after the forward one kvi_encode for all
captures. The step starts at vLLM's first worker call that carries its
metadata, handle_preemptions: vLLM's first model runner (vLLM 0.32's CPU
build, and vLLM 0.23 with VLLM_USE_V2_MODEL_RUNNER=0) makes it before it
prepares the step's inputs, so the injection is on the stream while the host
builds the forward, not in front of it; its second (vLLM 0.23's for Llama
models) right before start_load_kv, where it changes nothing.

A request whose facts cannot be injected (unknown fact, another tenant's
fact, a span whose length is not the fact's) fails alone: its blocks are
reported as failed loads (get_block_ids_with_load_errors), the message is
logged and written to the event file, and the other requests of the step are
injected. Its captures of that step are not taken (they would read KV that
is not the prompt's); the scheduler takes them again if vLLM recomputes it.

After each step the worker tells the scheduler what it did per request
(``build_connector_worker_meta``: kvinject.vllm.results) and vLLM's metrics
what happened (``get_kv_connector_stats``: kvinject.vllm.stats).

With ``disk_dir`` the store has a disk tier (kvinject/store.h, "Disk tier"):
its memory is a cache of one file per tenant, which replicas may share. The
worker then also reports which facts of the tenants it has touched are only
on disk (when that changed), the bytes a rank reads back per token, and the
read rate its injections measure (bytes read back / the injection's time), for
the scheduler's hybrid plan (kvinject.vllm.scheduler). Prefetches (the
scheduler's, and requests' ``prefetch`` parameter) run on a thread of the
worker's, one after another, after the step's injections were started: the
step does not wait for them (a whole-tenant prefetch indexes the tenant from
its file synchronously; the library reads facts back on its own I/O thread).
An injection of a tenant whose whole-tenant prefetch is still running waits
for it (that prefetch may read the file anew, when another replica changed
it); one of named facts does not hold injections up: the library waits for
the read of a fact it is reading back, and injects the resident ones at once.

No vLLM import here: what the worker needs of vLLM's internals (the attention
backend, the tensor-parallel rank) comes through kvinject.vllm._compat.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from ..enums import Backend, Memory
from ..errors import KviError, NotFoundError, StaleFactError, TokenMismatchError
from ..store import Store
from ..transfer import Capture, Encoder, InjectRequest, Injector
from . import _compat
from .config import KVInjectConfig
from .events import Events
from .layout import derive_layout, ordered_layers
from .metadata import InjectJob, KVInjectMetadata, PrefetchJob, RemoveJob
from .results import KVInjectWorkerMeta, RequestResult
from .retrieval import STORE_DTYPES, store_model
from .stats import KVInjectStats, StatsRecorder

logger = _compat.init_logger(__name__)


class SpanLengthError(ValueError):
    """A span of the prompt whose length is not its fact's."""


def failure_reason(e: Exception) -> str:
    """The ``reason`` label of a failed injection (kvinject.vllm.stats.REASONS)."""
    if isinstance(e, NotFoundError):
        return "not_found"
    if isinstance(e, TokenMismatchError):
        return "token_mismatch"
    if isinstance(e, StaleFactError):
        return "stale"
    if isinstance(e, SpanLengthError):
        return "length"
    return "other"


def raw_stream_getter(device: int):
    """A function returning the raw handle (an int) of torch's current CUDA stream on
    ``device``: torch's accessor of it, the one its compiled code calls
    (``torch._C._cuda_getCurrentRawStream``), where this torch has it, else the
    handle of ``torch.cuda.current_stream(device)``, which builds a Stream object at
    each call (some 30 µs of host time in an H100 engine's step, 2026-12-07)."""
    import torch
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(device)
    return lambda: torch.cuda.current_stream(device).cuda_stream


class KVInjectWorker:
    """The worker side of KVInjectConnector (vLLM's worker-side connector calls).
    The metadata of a step is passed in by the connector (None: none bound)."""

    def __init__(self, vllm_config, config: KVInjectConfig):
        self._vllm_config = vllm_config
        self._cfg = config
        self._block_size = config.block_size
        self._store: Optional[Store] = None
        self._injector: Optional[Injector] = None
        self._encoder: Optional[Encoder] = None
        self._on_cpu = True
        self._raw_stream = None  # the current stream's handle (raw_stream_getter), on a GPU
        self._layer_index: Dict[str, int] = {}
        self._failed_blocks: Set[int] = set()
        self._pending: List[Tuple[InjectJob, InjectRequest]] = []
        self._layerwise = config.layerwise
        self._time_device = config.time_device
        self._timing: Optional[Tuple[Any, Any, Dict[str, Any]]] = None  # (start, end event, inject record)
        # the step's inject record, written when the step ends (wait_for_save): after
        # vLLM enqueued the forward, where a GPU's work hides the file write, not before
        self._step_record: Optional[Dict[str, Any]] = None
        self._events = Events(None)
        self._step = 0
        self._started: Optional[KVInjectMetadata] = None  # the metadata whose step start_load_kv started
        self._layers_done = 0
        self._stats = StatsRecorder(0)
        self._results: Dict[str, RequestResult] = {}  # this step's, per request (sent to the scheduler)
        self._failed_reqs: Set[str] = set()           # requests failed in this step
        self._step_jobs: List[InjectJob] = []         # injected in this step
        self._inject_s = 0.0                          # host time of this step's injection
        self._store_changed = False
        # the disk tier: tenants to report, what was reported, the measured read rate
        self._disk = config.disk_dir is not None
        self._touched: Set[int] = set()               # tenants of this step's jobs
        self._reported: Dict[int, List[int]] = {}     # tenant -> disk-only facts last reported
        self._read_bytes_s = 0.0
        self._bytes_per_token = 0.0
        # background prefetches: (tenant, fact ids or None) in; tenants done (or failed: message) out
        self._prefetch_q: "queue.Queue[Optional[Tuple[int, Optional[List[int]]]]]" = queue.Queue()
        self._prefetch_done: "queue.Queue[Tuple[int, Optional[str]]]" = queue.Queue()
        self._prefetch_thread: Optional[threading.Thread] = None
        self._prefetching: Set[int] = set()           # tenants of prefetches started (maybe not done)

    def register_kv_caches(self, kv_caches: Dict[str, Any]) -> None:
        vc, cfg = self._vllm_config, self._cfg
        names, tensors = ordered_layers(kv_caches)
        self._layer_index = {n: i for i, n in enumerate(names)}
        backend, isa = _compat.attention_backend(vc, names[0], self._block_size)
        tp_rank, tp_size = _compat.tensor_parallel()
        model = store_model(vc.model_config.hf_config, cfg.rope, num_layers=len(names),
                            tp_rank=tp_rank, tp_size=tp_size)  # RoPE always explicit, every layer
        layout = derive_layout(tensors, backend, num_kv_heads=model.local_heads, head_size=model.head_size,
                               block_size=self._block_size, isa=isa)
        on_cpu = layout.memory == Memory.HOST
        dtype = STORE_DTYPES[cfg.store_dtype]
        opts = dict(backend=Backend.CPU if on_cpu else Backend.CUDA, device=None if on_cpu else tensors[0].device.index,
                    dtype=dtype, page_tokens=cfg.page_tokens, embedding_dim=cfg.embedding_dim or None)
        if cfg.disk_dir is not None:
            opts.update(disk_dir=cfg.disk_dir, disk_budget_bytes=cfg.disk_budget_bytes, disk_owner=cfg.disk_owner,
                        disk_lease_ms=cfg.disk_lease_ms)
        budget = cfg.store_budget_mb << 20
        path = cfg.store_path
        if path and tp_size > 1:
            path = "%s.rank%d" % (path, tp_rank)
        if path and os.path.exists(path):
            self._store = Store.load(model, path, budget, journal=True, **opts)
            file_text = "store file %s loaded" % path
        else:
            self._store = Store(model, budget, **opts)
            if path:
                self._store.journal_open(path)
            file_text = "store file %s (new)" % path if path else "no store file"
            if cfg.disk_dir is not None:
                file_text = "disk tier %s" % cfg.disk_dir
        model.close()
        self._injector = Injector(self._store, layout)
        self._encoder = Encoder(self._store, layout)
        self._on_cpu = on_cpu
        self._raw_stream = None if on_cpu else raw_stream_getter(tensors[0].device.index)
        if cfg.events_path:
            self._events = Events("%s.worker%d.jsonl" % (cfg.events_path, tp_rank))
        self._events.write(event="register", backend=backend, isa=isa, layers=len(names),
                           local_heads=model.local_heads, head_size=model.head_size, block_size=layout.block_size,
                           num_blocks=layout.num_blocks, dtype=layout.dtype.name, tp_rank=tp_rank, tp_size=tp_size)
        self._events.flush()
        self._stats = StatsRecorder(tp_rank)
        st = self._store.stats()
        self._stats.store(st.bytes_used, st.facts, st.tenants)
        self._bytes_per_token = st.page_bytes / st.page_tokens
        self._prefetch_thread = threading.Thread(target=self._prefetcher, name="kvinject-prefetch", daemon=True)
        self._prefetch_thread.start()
        logger.info("kvinject: store budget %d MiB, dtype %s, %s: %d facts of %d tenants; %s cache (%s) of %d "
                    "layers x %d heads x %d, %d blocks of %d; tensor-parallel rank %d of %d", cfg.store_budget_mb,
                    cfg.store_dtype, file_text, st.facts, st.tenants, backend, isa or "-", len(names),
                    model.local_heads, model.head_size, layout.num_blocks, layout.block_size, tp_rank, tp_size)

    @property
    def store(self) -> Optional[Store]:
        """This worker's store (after register_kv_caches)."""
        return self._store

    def _stream(self):
        if self._on_cpu:
            return None
        import torch
        return torch.cuda.current_stream()

    def _stream_handle(self) -> Optional[int]:
        """The raw handle of the stream vLLM runs the forward on (None on the CPU), for
        the library's calls: what _stream gives, without making a Stream object."""
        return self._raw_stream() if self._raw_stream is not None else None

    def _result(self, req_id: str) -> RequestResult:
        return self._results.setdefault(req_id, RequestResult())

    def _fail(self, job_id: str, message: str, block_ids: List[int], reason: str) -> None:
        logger.error("kvinject: request %s fails: %s", job_id, message)
        self._events.write(event="request_error", req_id=job_id, message=message, reason=reason, step=self._step)
        self._failed_blocks.update(block_ids)
        self._failed_reqs.add(job_id)
        res = self._result(job_id)
        res.inject_failed = True
        if message not in res.errors:
            res.errors.append(message)
        self._stats.failed(reason)

    def _check(self, job: InjectJob) -> None:
        """Why a job cannot be injected (raises KviError / ValueError), on the host."""
        for fid, start, length in job.facts:
            n = self._store.fact_tokens(job.tenant, fid)  # NotFoundError: unknown for this tenant
            if n != length:
                raise SpanLengthError("fact %d of tenant %d has %d tokens; the prompt's span for it at token %d "
                                      "has %d" % (fid, job.tenant, n, start, length))
        end = job.facts[-1][1] + job.facts[-1][2] if job.facts else 0
        if end > len(job.block_ids) * self._block_size:
            raise ValueError("the facts end at token %d; the request has %d blocks of %d"
                             % (end, len(job.block_ids), self._block_size))

    def _request(self, job: InjectJob) -> InjectRequest:
        first = job.facts[0][1]
        return InjectRequest(job.tenant, [f[0] for f in job.facts], job.block_ids, first_slot=first,
                             start_position=first, expect_token_ids=job.expect_token_ids)

    def _inject(self, jobs: List[Tuple[InjectJob, InjectRequest]], layer_begin=0, layer_end=0):
        """One kvi_inject for all jobs; on failure, the failing jobs are found and
        failed, and the others injected. Returns (jobs injected, kvi seconds)."""
        t = time.perf_counter()
        try:
            self._injector.inject([r for _, r in jobs], layer_begin=layer_begin, layer_end=layer_end,
                                  stream=self._stream_handle())
            return jobs, time.perf_counter() - t
        except (KviError, ValueError):  # ValueError: the binding's own checks (expect_token_ids' count)
            pass
        good = []
        for job, req in jobs:
            try:
                self._check(job)
                self._injector.inject(req, layer_begin=layer_begin, layer_end=layer_end, stream=self._stream_handle())
                good.append((job, req))
            except (KviError, ValueError) as e:
                self._fail(job.req_id, str(e), job.block_ids, failure_reason(e))
        return good, time.perf_counter() - t

    def _remove(self, jobs: List[RemoveJob]) -> None:
        """The step's removals: a fact that is not there is skipped (not listed)."""
        for job in jobs:
            res = self._result(job.req_id)
            self._touched.add(job.tenant)
            ids = self._store.list(job.tenant) if job.fact_ids is None else job.fact_ids
            n = 0
            for fid in ids:
                try:
                    self._store.remove(job.tenant, fid, keep_dependents=job.keep_dependents)
                except NotFoundError:
                    continue
                except KviError as e:
                    msg = "removal of fact %d (tenant %d) failed: %s" % (fid, job.tenant, e)
                    logger.error("kvinject: request %s: %s", job.req_id, msg)
                    res.errors.append(msg)
                    self._stats.failed("remove")
                    continue
                res.removed.append(fid)
                n += 1
            self._stats.add("facts_removed", n)
            self._store_changed |= n > 0
            self._events.write(event="remove", req_id=job.req_id, tenant=job.tenant,
                               asked="all" if job.fact_ids is None else len(job.fact_ids), removed=n,
                               step=self._step)

    # ------------------------------------------------------------ the disk tier
    def _prefetcher(self) -> None:
        """The prefetch thread: one Store.prefetch after another (the store's lock
        orders them with the steps' calls; ctypes lets go of the GIL meanwhile)."""
        while True:
            item = self._prefetch_q.get()
            if item is None:
                self._prefetch_q.task_done()
                return
            tenant, ids = item
            t0 = t1 = time.perf_counter()
            err = None
            try:
                self._store.prefetch(tenant, ids)
                t1 = time.perf_counter()
                # done once published: a CUDA store's reads stay "on disk" for the
                # scheduler until a call publishes them
                self._store.prefetch_wait()
            except (KviError, ValueError) as e:
                err = str(e)
            finally:
                self._prefetch_done.put((tenant, err))
                t2 = time.perf_counter()
                self._events.write(event="prefetch_done", tenant=tenant, facts="all" if ids is None else len(ids),
                                   prefetch_us=(t1 - t0) * 1e6, wait_us=(t2 - t1) * 1e6, error=err)
                self._events.flush()   # this thread's: the record is in the file when the prefetch counts done
                self._prefetch_q.task_done()

    def _start_prefetches(self, jobs: List[PrefetchJob]) -> None:
        for job in jobs:
            self._prefetch_q.put((job.tenant, job.fact_ids))
            if job.fact_ids is None:  # only a whole tenant's may read its file anew (_load waits for those)
                self._prefetching.add(job.tenant)
            self._events.write(event="prefetch", req_id=job.req_id, tenant=job.tenant,
                               facts="all" if job.fact_ids is None else len(job.fact_ids), step=self._step)

    def wait_prefetches(self) -> None:
        """Waits until every prefetch started so far is done (tests; shutdown)."""
        if self._prefetch_thread is not None:
            self._prefetch_q.join()

    def _disk_report(self) -> Dict[int, List[int]]:
        """The tenants whose disk-only facts changed since the last report: those the
        step's jobs or finished prefetches touched, and the tenants reported before that
        the store lists as changed (Store.disk_changes: a drop, a read back, a removal),
        each listed once; not every tenant after every change, which cost a C call per
        fact of every tenant ever reported at every step with a drop or a read back."""
        while True:
            try:
                tenant, err = self._prefetch_done.get_nowait()
            except queue.Empty:
                break
            self._touched.add(tenant)
            if err is None:
                self._stats.add("prefetches")
            else:
                logger.error("kvinject: prefetch of tenant %d failed: %s", tenant, err)
                self._stats.failed("prefetch")
        if not self._disk:
            self._touched.clear()
            return {}
        tenants = set(self._touched) | {t for t in self._store.disk_changes() if t in self._reported}
        self._touched.clear()
        out = {}
        for t in sorted(tenants):
            disk = self._store.list_on_disk(t)  # one call a tenant
            if self._reported.get(t) != disk:
                self._reported[t] = out[t] = disk
        return out

    def start_load_kv(self, meta: Optional[KVInjectMetadata], hook: str = "start_load_kv") -> None:
        """Starts the step of ``meta``: its removals, failures and injections (see
        the module docstring). The connector calls it from vLLM's first worker
        call of the step that carries the metadata, handle_preemptions (``hook``,
        written in the step's event record), then from start_load_kv, which finds
        the step started and does nothing; a vLLM without the first call starts
        the step in the second."""
        if meta is not None and meta is self._started:
            return
        self._started = meta
        self._write_step_record()  # a step vLLM ended without wait_for_save (no forward)
        if not isinstance(meta, KVInjectMetadata):
            return
        self._step += 1
        self._failed_reqs, self._step_jobs, self._inject_s = set(), [], 0.0
        for rid in meta.req_ids():  # every request of the step gets a result, if only "done"
            self._result(rid)
        for decision, n in meta.hybrid.items():
            self._stats.hybrid(decision, n)
        try:
            self._load(meta, hook)
        finally:
            self._start_prefetches(meta.prefetches)

    def _load(self, meta: KVInjectMetadata, hook: str) -> None:
        self._remove(meta.removes)
        t0 = time.perf_counter()
        if self._prefetching:
            # an injection of a tenant whose whole-tenant prefetch is running waits for it: that
            # prefetch may read the file anew (another replica changed it), and the injection must see that
            if any(job.facts and job.tenant in self._prefetching for job in meta.injects):
                self.wait_prefetches()
            if self._prefetch_q.unfinished_tasks == 0:
                self._prefetching.clear()
        for f in meta.failures:
            self._fail(f.req_id, f.message, f.block_ids, "parse")
        jobs = []
        for job in meta.injects:
            if not job.facts:
                continue
            self._touched.add(job.tenant)
            if job.expect_token_ids is None:
                # the library checks a job with token ids itself (every fact there, every id
                # equal, their count the facts' tokens, the table long enough); one without
                # them is checked here, a fact at a time (a host call each)
                try:
                    self._check(job)
                except (KviError, ValueError) as e:
                    self._fail(job.req_id, str(e), job.block_ids, failure_reason(e))
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
            before = self._store.stats().disk_read_bytes if self._disk else 0
            jobs, kvi_s = self._inject(jobs)
            if self._disk:
                self._measure_reads(self._store.stats().disk_read_bytes - before, kvi_s)
        t2 = time.perf_counter()
        self._step_jobs = [j for j, _ in jobs]
        self._inject_s = t2 - t0
        if not (timing or self._events.enabled):
            return  # no events file: the step's record would go nowhere
        rec = dict(event="inject", step=self._step, requests=len(jobs), facts=sum(len(j.facts) for j, _ in jobs),
                   tokens=sum(n for j, _ in jobs for _, _, n in j.facts), layerwise=self._layerwise, hook=hook,
                   check_us=(t1 - t0) * 1e6, kvi_us=kvi_s * 1e6, host_us=(t2 - t0) * 1e6)
        if timing:
            end.record(self._stream())
            self._timing = (start, end, rec)  # written when the step ends (wait_for_save)
        else:
            self._step_record = rec

    def _measure_reads(self, nbytes: int, seconds: float) -> None:
        """An injection that read ``nbytes`` back from disk in ``seconds``, averaged with
        the earlier ones: an estimate (all of the injection's time counts, and so do
        the reads the store's I/O thread finished meanwhile for prefetches)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        self._read_bytes_s = rate if self._read_bytes_s == 0 else 0.7 * self._read_bytes_s + 0.3 * rate

    def layers_pending(self) -> bool:
        """Whether this step's injection goes on layer by layer in wait_for_layer_load
        (layerwise, after start_load_kv wrote layer 0)."""
        return bool(self._pending)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._pending:
            return
        i = self._layer_index.get(layer_name)
        if i is None or i == 0:
            return
        t = time.perf_counter()
        self._pending, _ = self._inject(self._pending, i, i + 1)
        self._inject_s += time.perf_counter() - t
        self._layers_done += 1

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def _write_step_record(self) -> None:
        rec, self._step_record = self._step_record, None
        if rec is not None:
            self._events.write(**rec)

    def wait_for_save(self, meta: Optional[KVInjectMetadata]) -> None:
        self._started = None
        self._write_step_record()
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
        self._count_injections()
        if isinstance(meta, KVInjectMetadata) and meta.captures:
            self._capture(meta)
        if isinstance(meta, KVInjectMetadata):
            self._release(meta.releases)
        if self._store_changed:
            st = self._store.stats()
            self._stats.store(st.bytes_used, st.facts, st.tenants)
            self._store_changed = False
        # the step's records in the file before vLLM has its output (the writer
        # thread ran while the forward did: on a GPU this rarely waits)
        self._events.flush()

    def _count_injections(self) -> None:
        """The step's injections, once every layer is done: the requests that did
        not fail are reported injected."""
        jobs, self._step_jobs = self._step_jobs, []
        if not jobs:
            return
        for job in jobs:
            if job.req_id in self._failed_reqs:
                continue
            res = self._result(job.req_id)
            res.injected_facts = len(job.facts)
            res.injected_tokens = sum(n for _, _, n in job.facts)
            self._stats.add("requests_injected")
            self._stats.add("facts_injected", res.injected_facts)
            self._stats.add("tokens_injected", res.injected_tokens)
        self._stats.inject_step(self._step, self._inject_s)

    def _capture(self, meta: KVInjectMetadata) -> None:
        """The step's captures in one kvi_encode (one by one when it fails), but
        none of a request whose injection failed in this step."""
        t0 = time.perf_counter()
        caps, owner, skipped = [], [], 0
        for job in meta.captures:
            self._touched.add(job.tenant)
            if job.req_id in self._failed_reqs:
                self._result(job.req_id).skipped.extend(c[0] for c in job.captures)
                skipped += len(job.captures)
                continue
            # in prompt order: a capture's context names the captures before it, which the call stores first
            order = sorted(range(len(job.captures)), key=lambda i: job.captures[i][1])
            for i in order:
                fid, start, length, emb, replace = job.captures[i]
                caps.append(Capture(job.tenant, fid, job.block_ids, length, first_slot=start, start_position=start,
                                    replace=replace, embedding=emb,
                                    token_ids=job.token_ids[i] if job.token_ids is not None else None,
                                    context_ids=job.contexts[i] if job.contexts is not None else None))
                owner.append(job.req_id)
        stream = self._stream()
        stored = []
        try:
            if caps:
                self._encoder.encode(caps, stream=stream)
            stored = list(zip(caps, owner))
        except KviError:
            # all-or-nothing: store the ones that can be, report the others
            for c, rid in zip(caps, owner):
                try:
                    self._encoder.encode(c, stream=stream)
                    stored.append((c, rid))
                except KviError as e:
                    msg = "capture of fact %d (tenant %d) failed: %s" % (c.fact_id, c.tenant, e)
                    logger.error("kvinject: request %s: %s", rid, msg)
                    self._events.write(event="capture_error", req_id=rid, fact_id=c.fact_id, tenant=c.tenant,
                                       message=str(e), step=self._step)
                    self._result(rid).errors.append(msg)
                    self._stats.add("captures_failed")
                    self._stats.failed("capture")
        if stream is not None:
            stream.synchronize()
        for c, rid in stored:
            self._result(rid).captured[c.fact_id] = 1
        self._stats.add("captures_stored", len(stored))
        self._store_changed |= bool(stored)
        self._events.write(event="capture", step=self._step, captures=len(caps), stored=len(stored),
                           skipped=skipped, tokens=sum(c.num_tokens for c in caps),
                           host_us=(time.perf_counter() - t0) * 1e6)

    def _release(self, tenants: List[int]) -> None:
        """Gives up the disk leases of the step's releases (after its captures)."""
        for t in tenants:
            try:
                self._store.tenant_release(t)
            except KviError as e:  # the lease runs out by itself
                logger.error("kvinject: releasing tenant %d failed: %s", t, e)
                self._stats.failed("other")
            self._events.write(event="release", tenant=t, step=self._step)

    def build_connector_worker_meta(self) -> Optional[KVInjectWorkerMeta]:
        """What this step did per request, and with a disk tier the tenants whose
        disk-only facts changed (None: nothing to say), for the scheduler."""
        disk = self._disk_report() if self._store is not None else {}
        if not self._results and not disk:
            return None
        out = KVInjectWorkerMeta(self._results, disk_facts=disk,
                                 bytes_per_token=self._bytes_per_token if self._disk else 0.0,
                                 disk_read_bytes_s=self._read_bytes_s)
        self._results = {}
        return out

    def get_kv_connector_stats(self) -> Optional[KVInjectStats]:
        """What happened since vLLM last asked (None: nothing)."""
        return self._stats.take()

    def get_finished(self, finished_req_ids: Set[str]) -> Tuple[Optional[Set[str]], Optional[Set[str]]]:
        """Every load and save is done within its step: nothing finishes later."""
        return None, None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self) -> None:
        self._write_step_record()
        if self._prefetch_thread is not None:
            self._prefetch_q.put(None)
            self._prefetch_thread.join()
            self._prefetch_thread = None
        self._events.close()  # after the prefetch thread's last records
        if self._store is not None:
            self._store.close()
            self._store = None
