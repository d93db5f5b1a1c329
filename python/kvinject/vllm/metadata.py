"""What the scheduler role tells the workers each step (vLLM passes it from
the scheduler's process to every worker's): the facts to remove, the requests
to inject, the spans to capture once they are prefilled, the requests that
fail, the tenants to prefetch and the hybrid policy's decisions (counted). Plain data, picklable. No vLLM import here (its base class comes
through _compat). What the workers send back is kvinject.vllm.results."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from ._compat import KVConnectorMetadata


@dataclass
class InjectJob:
    req_id: str
    tenant: int
    facts: List[Tuple[int, int, int]]  # (fact_id, start, length), the ones to write
    block_ids: List[int]
    # the prompt's token ids at those facts' spans, in order: the worker's
    # injection refuses a fact whose stored ids differ (None: unchecked)
    expect_token_ids: Optional[List[int]] = None


@dataclass
class CaptureJob:
    req_id: str
    tenant: int
    captures: List[Tuple[int, int, int, Optional[List[float]], bool]]  # (fact_id, start, length, emb, replace)
    block_ids: List[int]
    # per capture, the prompt's token ids at its span, kept with the fact (None: none)
    token_ids: Optional[List[List[int]]] = None
    # per capture, the facts whose spans (injected or captured) end before it in
    # the prompt: its context in the store (None: none)
    contexts: Optional[List[List[int]]] = None


@dataclass
class FailJob:
    req_id: str
    message: str
    block_ids: List[int]


@dataclass
class RemoveJob:
    req_id: str
    tenant: int
    fact_ids: Optional[List[int]]  # None: every fact of the tenant
    keep_dependents: bool = False  # remove the facts alone: no fact captured after them becomes stale


@dataclass
class PrefetchJob:
    req_id: str
    tenant: int
    fact_ids: Optional[List[int]]  # None: every fact of the tenant (and its file, written by any replica)


@dataclass
class KVInjectMetadata(KVConnectorMetadata):
    injects: List[InjectJob] = field(default_factory=list)
    captures: List[CaptureJob] = field(default_factory=list)
    failures: List[FailJob] = field(default_factory=list)
    removes: List[RemoveJob] = field(default_factory=list)  # done first, before the step's injections
    # started in the background after the step's injections; no result comes back for them
    prefetches: List[PrefetchJob] = field(default_factory=list)
    # tenants whose disk lease to give up at the end of the step, after its captures; no result comes back
    releases: List[int] = field(default_factory=list)
    # the hybrid policy's decisions of the step's requests, facts per decision (inject, await, text)
    hybrid: Dict[str, int] = field(default_factory=dict)

    def req_ids(self) -> List[str]:
        """The requests this step's jobs are for (each once, in job order)."""
        out = {}
        for j in (*self.removes, *self.failures, *self.injects, *self.captures):
            out.setdefault(j.req_id, None)
        return list(out)
