"""What the workers tell the scheduler role after each step, and the outcome
of a request that the scheduler returns when it finishes.

vLLM 0.32's worker-metadata channel carries the results: after each step every
worker's ``build_connector_worker_meta`` returns a :class:`KVInjectWorkerMeta`
(each request of the step's jobs, what was done for it on this rank); vLLM's
KVOutputAggregator combines the ranks' with :meth:`KVInjectWorkerMeta.aggregate`
and hands the result to the scheduler's ``update_connector_output``, in
``Scheduler.update_from_output`` after the step's finished requests have been
freed. A request that finishes in the step its last jobs ran (one output
token) therefore finishes before their results arrive: its outcome says
``pending``. Plain data, picklable. No vLLM import here (the base class comes
through _compat).

The outcome (:meth:`Outcome.to_params`), ``kv_transfer_params["kvinject"]`` of
the request's output::

    {"tenant": 7, "injected_facts": 3, "injected_tokens": 45,
     "captured": [9], "removed": [], "errors": [], "pending": false}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ._compat import KVConnectorWorkerMetadata


def _union(a: List, b: List) -> List:
    out = list(a)
    out += [x for x in b if x not in a]
    return out


def _least(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else (a if b is None else min(a, b))  # None: not done on that rank


@dataclass
class RequestResult:
    """One request's results of one step, on one rank or combined over ranks."""

    injected_facts: Optional[int] = None   # facts written (None: no injection this step)
    injected_tokens: int = 0
    inject_failed: bool = False
    errors: List[str] = field(default_factory=list)
    captured: Dict[int, int] = field(default_factory=dict)  # fact id -> ranks that stored it
    skipped: List[int] = field(default_factory=list)  # captures not taken: the injection failed
    removed: List[int] = field(default_factory=list)

    def combine(self, other: "RequestResult") -> "RequestResult":
        """Both ranks' results: the least injected, any rank's failure and errors,
        the ranks storing each capture counted, removals of either."""
        cap = dict(self.captured)
        for f, n in other.captured.items():
            cap[f] = cap.get(f, 0) + n
        if self.injected_facts is None or other.injected_facts is None:
            tokens = self.injected_tokens if other.injected_facts is None else other.injected_tokens
        else:
            tokens = min(self.injected_tokens, other.injected_tokens)
        return RequestResult(_least(self.injected_facts, other.injected_facts), tokens,
                             self.inject_failed or other.inject_failed, _union(self.errors, other.errors), cap,
                             _union(self.skipped, other.skipped), _union(self.removed, other.removed))


@dataclass
class KVInjectWorkerMeta(KVConnectorWorkerMetadata):
    """A step's results on ``ranks`` tensor-parallel ranks, per request; with a
    disk tier also what the hybrid policy plans with: ``disk_facts`` (tenant ->
    the ids of its facts that are only on disk now, for the tenants whose list
    changed since the worker last said), ``bytes_per_token`` (bytes a rank reads
    back per token of a fact) and ``disk_read_bytes_s`` (the read rate measured
    by the injections that read facts back; 0: not measured)."""

    results: Dict[str, RequestResult] = field(default_factory=dict)
    ranks: int = 1
    disk_facts: Dict[int, List[int]] = field(default_factory=dict)
    bytes_per_token: float = 0.0
    disk_read_bytes_s: float = 0.0

    def aggregate(self, other: "KVInjectWorkerMeta") -> "KVInjectWorkerMeta":
        """The results of both (vLLM combines the ranks' metadata of a step with this):
        a fact is on disk if it is on any rank; the larger bytes per token; the slower
        measured read rate."""
        out = dict(self.results)
        for rid, r in other.results.items():
            out[rid] = out[rid].combine(r) if rid in out else r
        disk = {t: list(ids) for t, ids in self.disk_facts.items()}
        for t, ids in other.disk_facts.items():
            disk[t] = _union(disk.get(t, []), ids)
        rates = [r for r in (self.disk_read_bytes_s, other.disk_read_bytes_s) if r > 0]
        return KVInjectWorkerMeta(out, self.ranks + other.ranks, disk,
                                  max(self.bytes_per_token, other.bytes_per_token), min(rates, default=0.0))


@dataclass
class Outcome:
    """What the connector did for one request, accumulated over its steps."""

    tenant: Optional[int]
    injected_facts: int = 0
    injected_tokens: int = 0
    inject_failed: bool = False
    captured: List[int] = field(default_factory=list)
    removed: List[int] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    outstanding: int = 0  # steps with jobs for it whose results have not come back

    def add_error(self, message: str) -> None:
        if message not in self.errors:
            self.errors.append(message)

    def add(self, r: RequestResult, ranks: int) -> bool:
        """A step's results (over ``ranks`` ranks) for this request; True when
        captures were skipped (its injection failed), so they must be taken again."""
        self.outstanding = max(self.outstanding - 1, 0)
        if r.injected_facts is not None:
            self.injected_facts = max(self.injected_facts, r.injected_facts)
            self.injected_tokens = max(self.injected_tokens, r.injected_tokens)
        self.inject_failed |= r.inject_failed
        for m in r.errors:
            self.add_error(m)
        self.captured += [f for f, n in r.captured.items() if n >= ranks and f not in self.captured]
        self.removed += [f for f in r.removed if f not in self.removed]
        return bool(r.skipped)

    def to_params(self) -> Dict[str, Any]:
        """The outcome as vLLM returns it (``kv_transfer_params["kvinject"]``)."""
        failed = self.inject_failed
        return {"tenant": self.tenant, "injected_facts": 0 if failed else self.injected_facts,
                "injected_tokens": 0 if failed else self.injected_tokens, "captured": list(self.captured),
                "removed": list(self.removed), "errors": list(self.errors), "pending": self.outstanding > 0}
