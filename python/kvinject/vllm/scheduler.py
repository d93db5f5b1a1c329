"""The connector's scheduler role (one per engine): parses and checks each
request's kvinject parameters when it arrives, gives every request that
injects a cache salt of its own (so vLLM's prefix cache can never hand its
blocks, which hold KV a plain prefill would not compute, to another request),
claims the injected prefix as externally computed (less what vLLM's prefix
cache already has), and tells the workers, per step, which facts to remove,
which blocks to fill and which spans to capture (kvinject.vllm.metadata).

A request whose parameters are wrong claims one token, so that it gets a
block, and goes to the workers as a failure with that block: they report it as
a failed load and vLLM finishes the request with an error.

The workers' results come back each step (``update_connector_output``,
kvinject.vllm.results) and make up the request's outcome, which
``request_finished`` returns to vLLM as the request's ``kv_transfer_params``
(``{"kvinject": {...}}``). A request whose injection failed and that vLLM
recomputes (``kv_load_failure_policy: "recompute"``) is never injected again,
and the captures its failed step skipped are taken from the recomputed prefill.

Hybrid serving (a disk tier, ``disk_dir``, and ``hybrid``): the workers
report after each step which facts of the tenants they touched are only on
disk (kvinject.vllm.results, ``disk_facts``), the bytes a rank reads back per
token and the read rate their injections measured. When a request's claim is
first asked for, its injected facts are planned in prompt order (:meth:`plan`):

- a fact in memory is injected (decision ``inject``);
- a fact only on disk is awaited, the injection reading it back (``await``),
  when its predicted load time (tokens * bytes per token / the read rate:
  ``disk_read_mb_s``, or measured) is below the predicted time to prefill its
  tokens (``prefill_tokens_s``);
- a fact past what the store's memory holds at once (an injection's facts are
  all in memory together: store_budget_mb over the page size the workers
  report) ends the claim as below, wherever it is;
- else the claim ends where that fact starts: vLLM prefills it and everything
  after it as text (``text``, for it and every later fact), and the disk-only
  facts from there on are prefetched in the background so that the next
  request finds them in memory (a prefetch, not a capture of this prefill: it
  writes nothing, needs no lease, and the stored facts keep their context).

A tenant the workers never reported (a cold user: a fresh replica, or one the
user was moved to, whose facts are only in the tenant file) is all text, and
the whole tenant is prefetched (which also loads a tenant file another
replica wrote). So a cold user's first request costs a plain prefill, never a
disk read on the request's path. The decisions are counted
(``kvinject:hybrid_facts{decision=...}``, kvinject.vllm.stats).

No vLLM import here: vLLM's requests and scheduler outputs are read through
their public attributes and kvinject.vllm._compat.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set

from . import _compat
from .config import KVInjectConfig
from .events import Events
from .metadata import CaptureJob, FailJob, InjectJob, KVInjectMetadata, PrefetchJob, RemoveJob
from .prompt import _U64, PARAMS_KEY, RequestSpec, parse_params
from .results import KVInjectWorkerMeta, Outcome

logger = _compat.init_logger(__name__)


@dataclass
class _ReqState:
    spec: Optional[RequestSpec]
    error: Optional[str]
    prompt: List[int] = field(default_factory=list)  # the prompt's token ids up to its last span
    external: int = 0                      # tokens claimed at the last allocation
    block_ids: List[int] = field(default_factory=list)
    capture_pending: bool = False
    outcome: Outcome = field(default_factory=lambda: Outcome(None))
    fail_sent: bool = False      # the failure of bad parameters went to the workers
    remove_sent: bool = False
    inject_failed: bool = False  # never injected again (vLLM recomputes it, or it has failed)
    plan: Optional["Plan"] = None  # the injected facts' plan, made at the first claim
    plan_sent: bool = False      # its prefetch and decisions went to the workers
    prefetch_sent: bool = False  # the request's own prefetch parameter
    release_sent: bool = False


@dataclass
class Plan:
    """How a request's injected facts are served: the first ``inject_count`` facts
    are injected (those only on disk awaited), the rest prefilled as text."""

    inject_count: int
    decisions: Dict[str, int]               # facts per decision: inject, await, text
    prefetch: Optional[PrefetchJob] = None  # what to prefetch for the next request


#: the disk read rate the hybrid policy assumes until the workers measured one (bytes/s)
DEFAULT_DISK_READ_BYTES_S = 1000e6


def _tenant_of(params) -> Optional[int]:
    t = params.get("tenant") if isinstance(params, dict) else None
    return t if isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _U64 else None


class KVInjectScheduler:
    """The scheduler side of KVInjectConnector (vLLM's scheduler-side connector calls)."""

    def __init__(self, config: KVInjectConfig, prefix_caching: bool = True):
        self._cfg = config
        # salts keep vLLM's prefix cache from sharing injected blocks; with the
        # prefix cache off there is nothing to keep apart (and rehashing a
        # request's blocks is a cost on its way to the first token)
        self._salted = prefix_caching
        self._reqs: Dict[str, _ReqState] = {}
        self._nonce = uuid.uuid4().hex  # salts are unique to this engine and request
        self._events = Events(config.events_path + ".scheduler.jsonl" if config.events_path else None)
        # hybrid serving: what the workers reported (see the module docstring)
        self._disk_facts: Dict[int, Set[int]] = {}  # tenant -> its disk-only facts; absent: never reported
        self._bytes_per_token = 0.0
        self._measured_read_bytes_s = 0.0

    def salt(self, req_id: str) -> str:
        """The cache salt of a request that injects (or fails): no other request has it."""
        return "kvinject:%s:%s" % (self._nonce, req_id)

    def on_new_request(self, request) -> None:
        params = (request.kv_transfer_params or {}).get(PARAMS_KEY)
        if params is None:
            return
        try:
            spec, error = parse_params(params, request.num_prompt_tokens, self._cfg.embedding_dim), None
        except ValueError as e:
            spec, error = None, str(e)
            logger.error("kvinject: request %s fails: %s", request.request_id, error)
            self._events.write(event="request_error", req_id=request.request_id, message=error)
        if self._salted and (error is not None or spec.inject):
            # blocks holding injected KV (or none valid) are reachable by this
            # request alone: a salt no other request has, block hashes redone
            _compat.set_cache_salt(request, self.salt(request.request_id))
        # the ids the facts' spans cover, whatever form the prompt came in
        # (token ids, text, chat): injection checks them against the store's
        end = max(spec.claim_end, spec.capture_end) if spec else 0
        prompt = list(request.prompt_token_ids[:end]) if end else []
        st = _ReqState(spec, error, prompt, capture_pending=bool(spec and spec.capture))
        st.outcome.tenant = spec.tenant if spec else _tenant_of(params)
        if error is not None:
            st.outcome.add_error(error)
        self._reqs[request.request_id] = st

    def read_bytes_s(self) -> float:
        """The disk read rate the plan assumes: the setting, else measured, else the default."""
        if self._cfg.disk_read_mb_s > 0:
            return self._cfg.disk_read_mb_s * 1e6
        return self._measured_read_bytes_s or DEFAULT_DISK_READ_BYTES_S

    def memory_pages(self) -> Optional[int]:
        """Pages of a worker's store memory (store_budget_mb over the reported page
        size); None until the workers reported their bytes per token."""
        if self._bytes_per_token <= 0:
            return None
        page_bytes = int(round(self._bytes_per_token * self._cfg.page_tokens))
        return (self._cfg.store_budget_mb << 20) // page_bytes

    def plan(self, spec: RequestSpec, req_id: str = "") -> Plan:
        """The hybrid plan of a request's injected facts (all injected without hybrid serving)."""
        n = len(spec.inject)
        if not self._cfg.hybrid_serving or not n:
            return Plan(n, {})  # every fact injected; nothing counted (no hybrid policy)
        disk = self._disk_facts.get(spec.tenant)
        if disk is None:  # never reported: a cold tenant, all text; load it for the next request
            return Plan(0, {"text": n}, PrefetchJob(req_id, spec.tenant, None))
        decisions = {"inject": 0, "await": 0, "text": 0}
        cut = n
        pt = self._cfg.page_tokens
        capacity = self.memory_pages()
        pages = 0
        for i, f in enumerate(spec.inject):
            pages += -(-f.length // pt)
            if capacity is not None and pages > capacity:
                cut = i  # an injection's facts are all in memory at once: what does not fit is text
                break
            if f.fact_id not in disk:
                decisions["inject"] += 1
                continue
            load_s = f.length * self._bytes_per_token / self.read_bytes_s()
            if load_s < f.length / self._cfg.prefill_tokens_s:
                decisions["await"] += 1
                continue
            cut = i
            break
        decisions["text"] = n - cut
        ids = [f.fact_id for f in spec.inject[cut:] if f.fact_id in disk]
        return Plan(cut, decisions, PrefetchJob(req_id, spec.tenant, ids) if ids else None)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is None:
            return 0, False
        if st.error is not None:
            # one claimed token gives the request a block the worker reports as
            # failed, which makes vLLM finish it with an error (once)
            first = num_computed_tokens == 0 and request.num_prompt_tokens > 1 and not st.fail_sent
            return (1 if first else 0), False
        if st.inject_failed:
            return 0, False
        if st.plan is None:
            st.plan = self.plan(st.spec, request.request_id)
        inject = st.spec.inject[:st.plan.inject_count]
        end = inject[-1].start + inject[-1].length if inject else 0
        return max(end - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        st = self._reqs.get(request.request_id)
        if st is not None:
            st.external = num_external_tokens

    def build_connector_meta(self, scheduler_output) -> KVInjectMetadata:
        t0 = time.perf_counter()
        meta = KVInjectMetadata()
        progressed = []
        for s in _compat.scheduled_requests(scheduler_output):
            st = self._reqs.get(s.req_id)
            if st is None:
                continue
            if s.first:
                st.block_ids = s.block_ids if s.block_ids is not None else []
            elif s.block_ids is not None:
                st.block_ids += s.block_ids
            progressed.append((s, st))
        for s, st in progressed:
            rid, computed = s.req_id, s.num_computed_tokens
            if st.error is not None:
                if s.first and not st.fail_sent:
                    meta.failures.append(FailJob(rid, st.error, list(st.block_ids)))
                    st.fail_sent = True
                continue
            spec = st.spec
            if (spec.remove is not None or spec.remove_all) and not st.remove_sent:
                meta.removes.append(RemoveJob(rid, spec.tenant, None if spec.remove_all else list(spec.remove),
                                              spec.keep_dependents))
                st.remove_sent = True
            if spec.prefetch and not st.prefetch_sent:
                meta.prefetches.append(PrefetchJob(rid, spec.tenant, None))
                st.prefetch_sent = True
            plan = st.plan
            if plan is not None and not st.plan_sent:
                if plan.prefetch is not None:
                    meta.prefetches.append(plan.prefetch)
                for k, n in plan.decisions.items():
                    meta.hybrid[k] = meta.hybrid.get(k, 0) + n
                st.plan_sent = True
            if s.first and st.external > 0:
                local = computed - st.external
                planned = spec.inject[:plan.inject_count] if plan is not None else spec.inject
                facts = [(f.fact_id, f.start, f.length) for f in planned if f.start + f.length > local]
                # the facts lie back to back (parse_params): their ids are one slice of the prompt
                expect = st.prompt[facts[0][1]:facts[-1][1] + facts[-1][2]] if facts else []
                meta.injects.append(InjectJob(rid, spec.tenant, facts, list(st.block_ids), expect))
                st.external = 0
            done = computed + s.num_scheduled_tokens
            if st.capture_pending and done >= spec.capture_end:
                meta.captures.append(CaptureJob(rid, spec.tenant,
                                                [(c.fact_id, c.start, c.length, c.embedding, c.replace)
                                                 for c in spec.capture], list(st.block_ids),
                                                [st.prompt[c.start:c.start + c.length] for c in spec.capture],
                                                [spec.context_of(c) for c in spec.capture]))
                st.capture_pending = False
            if spec.release and not st.release_sent and not st.capture_pending:
                meta.releases.append(spec.tenant)  # after this step's captures and removals
                st.release_sent = True
        for rid in meta.req_ids():  # one result per request and step comes back
            self._reqs[rid].outcome.outstanding += 1
        if (meta.injects or meta.captures or meta.failures or meta.removes or meta.prefetches or meta.releases
                or meta.hybrid):
            self._events.write(event="schedule", injects=len(meta.injects), captures=len(meta.captures),
                               failures=len(meta.failures), removes=len(meta.removes),
                               prefetches=len(meta.prefetches), releases=len(meta.releases),
                               hybrid=dict(meta.hybrid),
                               host_us=(time.perf_counter() - t0) * 1e6)
        return meta

    def update_connector_output(self, connector_output) -> None:
        """The workers' results of a step (vLLM's worker metadata, the ranks'
        combined): each request's outcome. A request whose injection failed is
        never injected again, and the captures its failed step skipped are
        taken again once vLLM has recomputed its prefill."""
        self._events.flush()   # the step's records (queued before its forward) in the file
        meta = _compat.worker_meta(connector_output)
        if not isinstance(meta, KVInjectWorkerMeta):
            return
        for tenant, ids in meta.disk_facts.items():
            self._disk_facts[tenant] = set(ids)
        if meta.bytes_per_token > 0:
            self._bytes_per_token = meta.bytes_per_token
        if meta.disk_read_bytes_s > 0:
            self._measured_read_bytes_s = meta.disk_read_bytes_s
        for rid, res in meta.results.items():
            st = self._reqs.get(rid)
            if st is None:  # finished already (its outcome said "pending")
                continue
            if st.outcome.add(res, meta.ranks) and st.spec is not None and st.spec.capture:
                st.capture_pending = True
            if res.inject_failed and st.spec is not None:
                st.inject_failed, st.external = True, 0

    def request_finished(self, request, block_ids):
        """Forgets the request; its outcome goes into its output's kv_transfer_params."""
        self._events.flush()
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        out = st.outcome
        if _compat.finished_with_error(request) and not out.errors:
            out.add_error("vLLM finished the request with an error before the connector's results arrived "
                          "(a failed injection: its message is in vLLM's log)")
        return False, {PARAMS_KEY: out.to_params()}
