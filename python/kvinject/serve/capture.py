"""Capture requests of the notes encoding, planned and checked.

A user's memory on a replica is fact 0 (the memory header) and the user's
facts, each captured by the connector after the header and the facts said
before it ([header | f1 | f2 | ...], the layout of a chat's memory prompt).
:func:`plan` cuts a capture into /v1/completions bodies that fit a replica's
context: each body injects what the replica already holds as context (the
header and every fact before the first new one when they and the new facts
fit the budget, else the latest of them up to half the budget) and captures
new facts after it, as many as fit. :func:`check` reads the
connector's outcome of a capture request.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from ..vllm.prompt import PARAMS_KEY, RESULT_TOKENS, Keep, capture_prompt, prefetch_prompt, remove_prompt

FactToks = Tuple[int, Sequence[int]]  # (fact id, token ids)
HEADER_ID = 0
# max_tokens = min_tokens = 2: the connector's outcome is complete when the request finishes
CAPTURE_MAX_TOKENS = RESULT_TOKENS


@dataclasses.dataclass
class CaptureRequest:
    body: Dict[str, Any]          # the /v1/completions body (no model)
    asked: List[int]              # fact ids it captures
    injected: List[int]           # fact ids it injects as context

    @property
    def params(self) -> Dict[str, Any]:
        return self.body["kv_transfer_params"][PARAMS_KEY]

    @property
    def tokens(self) -> int:
        return len(self.body["prompt"])


class PlanError(ValueError):
    pass


def plan(tenant: int, header: Sequence[int], new: Sequence[FactToks], *, context: Sequence[FactToks] = (),
         header_held: bool = True, replace: bool = False, budget: int,
         remove: Union[None, str, Sequence[int]] = None) -> List[CaptureRequest]:
    """The capture requests that put ``new`` facts (in the order said) on a
    replica. context: the facts before the first new one that the replica
    already holds (in order); header_held: whether it holds the header (else
    the first request captures it too, and holds no context). replace: the
    new facts replace facts of the same ids (re-encoding, full captures).
    budget: the most prompt tokens of a request. remove: fact ids (or "all")
    the first request removes before its captures (the connector removes
    first); "all" needs header_held False (nothing injected)."""
    if remove == "all" and header_held:
        raise PlanError('remove "all" with injected context')
    header = list(header)
    ctx: List[FactToks] = list(context) if header_held else []
    out: List[CaptureRequest] = []
    i = 0
    new = list(new)
    while i < len(new):
        segs: List[Any] = []
        inject: List[List[int]] = []
        injected: List[int] = []
        if header_held:
            segs.append(header)
            inject.append([HEADER_ID, 0, len(header)])
            pos = len(header)
            # every held fact when they and the rest of the new ones fit (each new fact
            # is then captured after exactly what a memory prompt puts before it);
            # else the latest held facts, up to half the budget
            held = sum(len(t) for _, t in ctx)
            rest = sum(len(t) for _, t in new[i:])
            room = held if pos + held + rest <= budget else budget // 2 - pos
            chosen: List[FactToks] = []
            for fid, toks in reversed(ctx):
                if len(toks) > room:
                    break
                chosen.insert(0, (fid, toks))
                room -= len(toks)
            for fid, toks in chosen:
                segs.append(list(toks))
                inject.append([int(fid), pos, len(toks)])
                injected.append(int(fid))
                pos += len(toks)
        else:
            segs.append(Keep(HEADER_ID, header, replace=True))
            pos = len(header)
        asked: List[int] = [] if header_held else [HEADER_ID]
        first = i
        while i < len(new):
            fid, toks = new[i]
            if pos + len(toks) > budget and i > first:
                break
            if pos + len(toks) > budget:
                raise PlanError("fact %d (%d tokens) does not fit a capture of %d tokens after the header "
                                "(%d tokens)" % (fid, len(toks), budget, len(header)))
            segs.append(Keep(int(fid), list(toks), replace=replace))
            asked.append(int(fid))
            pos += len(toks)
            i += 1
        mp = capture_prompt(tenant, segs)
        params = dict(mp.params)
        if inject:
            params["inject"] = inject
        if remove is not None and not out:
            params["remove"] = remove if remove == "all" else [int(x) for x in remove]
        body = {"prompt": list(mp.prompt_token_ids), "max_tokens": CAPTURE_MAX_TOKENS,
                "min_tokens": CAPTURE_MAX_TOKENS, "temperature": 0.0,
                "kv_transfer_params": {PARAMS_KEY: params}}
        out.append(CaptureRequest(body, asked, injected))
        ctx += [(fid, toks) for fid, toks in new[first:i]]
        header_held = True
    return out


def removal(tenant: int, fids: Union[str, Sequence[int]], token_id: int, *,
            keep_dependents: bool = False) -> CaptureRequest:
    """A request that only removes facts (a list of ids, or "all"); keep_dependents:
    the facts captured after them keep their KV (the connector makes them stale
    otherwise, and refuses to inject them until they are captured again)."""
    mp = remove_prompt(tenant, fids if fids == "all" else [int(f) for f in fids], token_id,
                       keep_dependents=keep_dependents)
    body = {"prompt": list(mp.prompt_token_ids), "max_tokens": CAPTURE_MAX_TOKENS,
            "min_tokens": CAPTURE_MAX_TOKENS, "temperature": 0.0, "kv_transfer_params": {PARAMS_KEY: mp.params}}
    return CaptureRequest(body, [], [])


def prefetch(tenant: int, token_id: int) -> CaptureRequest:
    """A request that asks the replica's connector to prefetch every fact of the
    tenant (from its disk tier, or the tenant file another replica wrote) in the
    background; it returns once the request is served, not when the facts are up."""
    mp = prefetch_prompt(tenant, token_id)
    body = {"prompt": list(mp.prompt_token_ids), "max_tokens": 1, "temperature": 0.0,
            "kv_transfer_params": {PARAMS_KEY: mp.params}}
    return CaptureRequest(body, [], [])


def outcome(resp: Any) -> Optional[Dict[str, Any]]:
    """The connector's outcome in a /v1/completions answer (None when the
    replica's connector reports none)."""
    if not isinstance(resp, dict):
        return None
    ktp = resp.get("kv_transfer_params")
    if not isinstance(ktp, dict):
        return None
    out = ktp.get(PARAMS_KEY)
    return out if isinstance(out, dict) else None


def check(status: int, resp: Any, asked: Sequence[int] = (), injected: int = -1) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """(error message or None, outcome) of a request that captures ``asked``
    (and injects ``injected`` facts when >= 0). A removal is not checked
    against its ids: a fact that was not there is skipped, not an error."""
    if status != 200:
        text = resp.get("error", {}).get("message") if isinstance(resp, dict) and isinstance(
            resp.get("error"), dict) else str(resp)[:500]
        return ("vLLM answered HTTP %d (%s): the connector failed the request; the replica's log has its "
                "message" % (status, text)), None
    oc = outcome(resp)
    if oc is None:
        return None, None
    errs = [str(e) for e in (oc.get("errors") or [])]
    if errs:
        return "the connector reported: %s" % "; ".join(errs), oc
    if oc.get("pending"):
        return "the connector's outcome was not reported before the request finished (pending)", oc
    if asked:
        got = {int(x) for x in oc.get("captured") or []}
        missing = sorted(set(int(a) for a in asked) - got)
        if missing:
            return "the connector captured %d of %d facts (missing fact ids %s)" % (
                len(set(asked)) - len(missing), len(set(asked)), missing[:20]), oc
    if injected >= 0 and "injected_facts" in oc and int(oc["injected_facts"]) != injected:
        return "the connector injected %s of %d facts" % (oc["injected_facts"], injected), oc
    return None, oc
