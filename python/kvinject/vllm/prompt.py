"""Request parameters of the vLLM connector (kvinject.vllm.connector) and the
helpers that build them with the prompt's token ids. No vLLM import here.

A request carries its kvinject parameters in vLLM's per-request KV-transfer
parameters, ``SamplingParams(extra_args={"kv_transfer_params": {"kvinject":
{...}}})``::

    {"tenant": 7,                                  # uint64
     "inject": [[fact_id, start, length], ...],    # facts the prompt's prefix holds
     "capture": [{"fact_id": 9, "start": 40, "length": 12,
                  "embedding": [...],              # when the store keeps embeddings
                  "replace": False}, ...],
     "remove": [fact_id, ...],                     # or "all": every fact of the tenant
     "keep_dependents": False,                     # with remove: make no fact stale
     "prefetch": True,                             # move the tenant's facts up the store's tiers
     "release": True}                              # give the tenant's disk lease up after the writes

- ``inject``: spans of the prompt whose KV comes from the store, in order,
  back to back from token 0 (the prefix vLLM is told is already computed);
  ``length`` must equal the stored fact's tokens. At least one prompt token must
  follow the last span (vLLM prefills what follows). A request that injects
  gets a cache salt of its own from the connector: its blocks can never be
  handed to another request by vLLM's prefix cache.
- ``capture``: spans of the prompt to keep as facts of ``tenant`` once vLLM has
  prefilled them (Context-Window Encoding: each span's KV as computed after
  everything before it). Captured keys are un-rotated at their positions.
- ``remove``: facts of ``tenant`` to remove from the store (``"all"``: every
  one), at the start of the first step the request is scheduled in, before
  that step's injections and before the request's captures (so a request may
  remove a fact and capture it anew). A fact that is not there is skipped. A
  request may not remove a fact it injects (nor "all" when it injects).
  Removing a fact makes stale every fact of the tenant captured with it in
  context (kvinject/store.h, "Context and stale facts"): injecting one then
  fails the request until it is captured again (``replace``);
  ``keep_dependents: true`` removes the facts alone.
- ``prefetch``: ``true`` asks the workers to move every fact of ``tenant`` up
  the store's tiers in the background (Store.prefetch: from the disk tier, or
  a tenant file another replica wrote, into memory; from the host tier to the
  device), so that the tenant's next requests find their facts resident. The
  request is not delayed by it (a one-token request that only prefetches:
  :func:`prefetch_prompt`).
- ``release``: ``true`` gives up the store's ownership lease of ``tenant``
  (Store.tenant_release) at the end of the step that stores the request's
  captures (or runs its removal), so that another replica sharing the disk
  tier's directory may write the tenant at once. Without a disk tier it does
  nothing.

With a disk tier (connector setting ``disk_dir``) and ``hybrid`` (the
default), the scheduler plans each injected fact by where the store has it:
a fact in memory is injected; a fact only on disk is awaited (the injection
reads it back) when reading it is predicted faster than prefilling its
tokens, else the prompt is claimed only up to it, vLLM prefills it and every
token after it as text, and the disk-only facts not injected are prefetched.
The text fallback needs prompts whose spans hold the facts' own tokens (as
checked injection does; not :func:`memory_prompt` with filler token counts).

Each capture keeps as its context (Store.fact_context) the facts whose spans,
injected or captured, end before its own in the prompt: removing one of them
makes it stale. Tokens of the prompt that are no span are no fact and are
not named.

What the connector did comes back in the finished request's
``kv_transfer_params["kvinject"]`` (kvinject.vllm.results): a request whose
last jobs ran in the step it finished in (one output token) cannot know their
results yet (``"pending": true``); ask for RESULT_TOKENS output tokens
(``max_tokens`` and ``min_tokens``) to get them.

:func:`memory_prompt` builds [facts | question] and its inject spans;
:func:`capture_prompt` builds a prompt from segments, some to be captured;
:func:`notes_capture_prompts` the capture prompts of the notes encoding;
:func:`remove_prompt` a one-token request that removes facts;
:func:`prefetch_prompt` a one-token request that prefetches a tenant.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

PARAMS_KEY = "kvinject"
#: output tokens (max_tokens and min_tokens) a request asks for to get its results in its outcome
RESULT_TOKENS = 2

Tokens = Sequence[int]


@dataclasses.dataclass
class MemoryPrompt:
    """A prompt and its kvinject parameters. ``prompt`` is what ``LLM.generate``
    takes (``{"prompt_token_ids": [...]}``); ``kv_transfer_params`` goes into
    ``SamplingParams(extra_args={"kv_transfer_params": ...})`` (or use
    :meth:`sampling_params`)."""

    prompt_token_ids: List[int]
    params: Dict[str, Any]
    #: facts a MemoryIndex retrieved for it, best first: (fact id, tokens, score)
    retrieved: List[Tuple[int, int, float]] = dataclasses.field(default_factory=list)

    @property
    def prompt(self) -> Dict[str, Any]:
        return {"prompt_token_ids": list(self.prompt_token_ids)}

    @property
    def kv_transfer_params(self) -> Dict[str, Any]:
        return {PARAMS_KEY: self.params}

    def extra_args(self) -> Dict[str, Any]:
        return {"kv_transfer_params": self.kv_transfer_params}

    def sampling_params(self, **kw):
        """vllm.SamplingParams(**kw) carrying these parameters (imports vLLM)."""
        from vllm import SamplingParams
        extra = dict(kw.pop("extra_args", None) or {})
        extra.update(self.extra_args())
        return SamplingParams(extra_args=extra, **kw)


def _tokens(x, what: str) -> List[int]:
    out = [int(t) for t in x]
    if not out:
        raise ValueError("%s: no tokens" % what)
    return out


def memory_prompt(tenant: int, facts: Sequence[Tuple[int, Union[Tokens, int]]], question: Tokens, *,
                  filler_token: Optional[int] = None) -> MemoryPrompt:
    """[fact 1 | fact 2 | ... | question] with the facts injected from the store.

    facts: (fact_id, token_ids) in prompt order; a header (system prompt, chat
    template opening) is a fact too: capture it once at position 0. token_ids
    are the fact's own tokens (what a plain prefill would read); an int n instead
    puts n copies of ``filler_token`` there (the KV comes from the store either
    way; the tokens are what vLLM's sampler and detokenizer see). question: the
    tokens vLLM prefills (at least one)."""
    ids: List[int] = []
    spans = []
    for i, (fid, toks) in enumerate(facts):
        if isinstance(toks, int):
            if filler_token is None:
                raise ValueError("facts[%d]: a token count needs filler_token" % i)
            if toks < 1:
                raise ValueError("facts[%d]: %d tokens" % (i, toks))
            toks = [filler_token] * toks
        toks = _tokens(toks, "facts[%d]" % i)
        spans.append([int(fid), len(ids), len(toks)])
        ids += toks
    ids += _tokens(question, "question")
    return MemoryPrompt(ids, {"tenant": int(tenant), "inject": spans})


@dataclasses.dataclass
class Keep:
    """A segment of :func:`capture_prompt` to keep as fact ``fact_id``."""

    fact_id: int
    tokens: Tokens
    embedding: Any = None
    replace: bool = False


def capture_prompt(tenant: int, segments: Sequence[Union[Tokens, Keep]]) -> MemoryPrompt:
    """A prompt of segments in order; those given as :class:`Keep` are captured as
    facts of ``tenant`` after vLLM prefills the prompt (each one's KV as computed
    after the segments before it). Plain token lists are context only."""
    ids: List[int] = []
    caps = []
    for i, seg in enumerate(segments):
        if isinstance(seg, Keep):
            toks = _tokens(seg.tokens, "segments[%d]" % i)
            c = {"fact_id": int(seg.fact_id), "start": len(ids), "length": len(toks)}
            if seg.embedding is not None:
                c["embedding"] = [float(x) for x in seg.embedding]
            if seg.replace:
                c["replace"] = True
            caps.append(c)
        else:
            toks = _tokens(seg, "segments[%d]" % i)
        ids += toks
    return MemoryPrompt(ids, {"tenant": int(tenant), "capture": caps})


def notes_capture_prompts(tenant: int, header: Union[Tokens, Keep], facts: Sequence[Keep], *,
                          window: Optional[int] = None, tail: Optional[Tokens] = None) -> List[MemoryPrompt]:
    """Capture prompts of the notes encoding: each fact prefilled after the
    memory prompt's header and the facts said before it, laid out as
    :func:`memory_prompt` lays facts out ([header | fact_1 | fact_2 | ...]).
    Where a prompt's facts are the same as those before a fact here, its KV is
    the prompt's own prefill; elsewhere it comes closer than a fact encoded
    alone or after a window of conversation (BENCHMARKS.md, memory quality).

    header: the tokens before the facts in a memory prompt (system prompt,
    notes heading): context only, or a :class:`Keep` to capture it too (as
    the fact that memory prompts inject at position 0), in the first prompt
    only. facts: :class:`Keep` items in the order the
    user said them. window None: one prompt, every fact after all the facts
    before it (each fact's tokens prefilled once); window N >= 0: one prompt per
    fact, after the N facts before it. tail: tokens after the last kept fact
    (default none; vLLM prefills the whole prompt either way). Returns the
    prompts, each with its capture parameters (``sampling_params``)."""
    keep = header if isinstance(header, Keep) else None
    header = _tokens(keep.tokens if keep else header, "header")
    facts = list(facts)
    for i, f in enumerate(facts):
        if not isinstance(f, Keep):
            raise TypeError("facts[%d]: a Keep (fact_id, tokens), not %s" % (i, type(f).__name__))
    if not facts:
        raise ValueError("facts: none")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError("window: None or an int >= 0, not %r" % (window,))
    end = [list(tail)] if tail else []
    first = [keep] if keep else [header]
    if window is None:
        return [capture_prompt(tenant, first + facts + end)]
    out = []
    for i, f in enumerate(facts):
        ctx = [list(g.tokens) for g in facts[max(0, i - window):i]]
        out.append(capture_prompt(tenant, (first if i == 0 else [header]) + ctx + [f] + end))
    return out


def remove_prompt(tenant: int, fact_ids: Union[str, Sequence[int]], token_id: int, *,
                  keep_dependents: bool = False) -> MemoryPrompt:
    """A request that removes facts of ``tenant`` from the connector's store:
    ``fact_ids`` a list of fact ids, or ``"all"`` for every fact of the tenant.
    Its prompt is the one token ``token_id`` (any token of the model: vLLM needs
    a prompt); its output is of no use. Ask for RESULT_TOKENS output tokens to
    find the ids removed in its outcome. keep_dependents: the facts captured
    with them in context stay as they are (else they become stale)."""
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise ValueError("token_id must be a token id (an int >= 0), got %r" % (token_id,))
    params: Dict[str, Any] = {"tenant": int(tenant), "remove": _remove_list(fact_ids, "fact_ids")}
    if keep_dependents:
        params["keep_dependents"] = True
    return MemoryPrompt([token_id], params)


def prefetch_prompt(tenant: int, token_id: int) -> MemoryPrompt:
    """A request that asks the connector's workers to prefetch every fact of
    ``tenant`` (the ``prefetch`` parameter). Its prompt is the one token
    ``token_id`` (any token of the model); its output is of no use."""
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise ValueError("token_id must be a token id (an int >= 0), got %r" % (token_id,))
    return MemoryPrompt([token_id], {"tenant": int(tenant), "prefetch": True})


# ------------------------------------------------------------------ parsing

@dataclasses.dataclass
class Span:
    fact_id: int
    start: int
    length: int


@dataclasses.dataclass
class CaptureSpec:
    fact_id: int
    start: int
    length: int
    embedding: Optional[List[float]] = None
    replace: bool = False


@dataclasses.dataclass
class RequestSpec:
    """What a request's kvinject parameters ask for, checked against its prompt."""

    tenant: int
    inject: List[Span]
    capture: List[CaptureSpec]
    remove: Optional[List[int]] = None  # fact ids to remove (None: none)
    remove_all: bool = False            # every fact of the tenant
    keep_dependents: bool = False       # the removal makes no fact stale
    prefetch: bool = False              # prefetch every fact of the tenant
    release: bool = False               # give the tenant's disk lease up after the request's writes

    def context_of(self, c: "CaptureSpec") -> List[int]:
        """A capture's context: the facts whose spans (injected, then captured) end
        before it starts, in prompt order, but not its own fact (a span of the same
        fact injected before it, which the capture replaces)."""
        spans = [(s.start, s.fact_id) for s in self.inject if s.start + s.length <= c.start]
        spans += [(d.start, d.fact_id) for d in self.capture if d is not c and d.start + d.length <= c.start]
        return [fid for _, fid in sorted(spans) if fid != c.fact_id]

    @property
    def claim_end(self) -> int:
        """Tokens the injected facts cover (they start at 0)."""
        return self.inject[-1].start + self.inject[-1].length if self.inject else 0

    @property
    def capture_end(self) -> int:
        return max((c.start + c.length for c in self.capture), default=0)


_U64 = (1 << 64) - 1
_MAX_TOKEN = 1 << 31  # the largest start or length of a span


def _uint(v, what: str, lo: int = 0, hi: int = _U64) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError("%s must be an integer, got %r" % (what, v))
    if not lo <= v <= hi:
        raise ValueError("%s = %d is out of range [%d, %d]" % (what, v, lo, hi))
    return v


MAX_REMOVE = 1 << 20  # fact ids one request may name


def _remove_list(v: Any, what: str) -> Union[str, List[int]]:
    """A remove parameter checked: "all", or a non-empty list of distinct fact ids."""
    if v == "all":
        return "all"
    if isinstance(v, (str, bytes, dict)) or not isinstance(v, (list, tuple)):
        raise ValueError('%s must be a list of fact ids or "all", got %r' % (what, v))
    if not v:
        raise ValueError('%s is empty: name the fact ids to remove, or "all"' % what)
    if len(v) > MAX_REMOVE:
        raise ValueError("%s names %d facts; at most %d per request" % (what, len(v), MAX_REMOVE))
    out, seen = [], set()
    for i, f in enumerate(v):
        f = _uint(f, "%s[%d]" % (what, i))
        if f in seen:
            raise ValueError("%s[%d]: fact %d is named twice" % (what, i, f))
        seen.add(f)
        out.append(f)
    return out


def parse_params(params: Any, prompt_len: int, embedding_dim: int = 0) -> RequestSpec:
    """Checks a request's kvinject parameters against its prompt length; raises
    ValueError with a message naming the problem."""
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params[%r] must be a dict, got %s" % (PARAMS_KEY, type(params).__name__))
    unknown = set(params) - {"tenant", "inject", "capture", "remove", "keep_dependents", "prefetch", "release"}
    if unknown:
        raise ValueError("unknown kvinject parameters %s (known: tenant, inject, capture, remove, keep_dependents, "
                         "prefetch, release)" % sorted(unknown))
    if "tenant" not in params:
        raise ValueError("kvinject parameters need a tenant")
    tenant = _uint(params["tenant"], "tenant")
    inject: List[Span] = []
    pos = 0
    for i, s in enumerate(params.get("inject") or []):
        if not isinstance(s, (list, tuple)) or len(s) != 3:
            raise ValueError("inject[%d] must be [fact_id, start, length], got %r" % (i, s))
        fid, start, length = s
        if not (type(fid) is int and type(start) is int and type(length) is int  # noqa: E721 (bool is not)
                and 0 <= fid <= _U64 and 0 <= start <= _MAX_TOKEN and 1 <= length <= _MAX_TOKEN):
            # the message names the first bad value (and takes int subclasses, as _uint does)
            fid, start, length = (_uint(fid, "inject[%d] fact_id" % i),
                                  _uint(start, "inject[%d] start" % i, hi=_MAX_TOKEN),
                                  _uint(length, "inject[%d] length" % i, lo=1, hi=_MAX_TOKEN))
        sp = Span(fid, start, length)
        if sp.start != pos:
            raise ValueError("inject[%d] starts at token %d; injected facts must lie back to back from token 0 "
                             "(expected %d)" % (i, sp.start, pos))
        pos = sp.start + sp.length
        inject.append(sp)
    if inject and pos >= prompt_len:
        raise ValueError("the injected facts cover %d tokens of a %d-token prompt; at least one prompt token "
                         "must follow them (the facts do not fit)" % (pos, prompt_len))
    capture: List[CaptureSpec] = []
    seen = set()
    for i, c in enumerate(params.get("capture") or []):
        if not isinstance(c, dict):
            raise ValueError("capture[%d] must be a dict {fact_id, start, length[, embedding, replace]}" % i)
        extra = set(c) - {"fact_id", "start", "length", "embedding", "replace"}
        if extra:
            raise ValueError("capture[%d]: unknown keys %s" % (i, sorted(extra)))
        cs = CaptureSpec(_uint(c.get("fact_id"), "capture[%d] fact_id" % i),
                         _uint(c.get("start"), "capture[%d] start" % i, hi=_MAX_TOKEN),
                         _uint(c.get("length"), "capture[%d] length" % i, lo=1, hi=_MAX_TOKEN),
                         c.get("embedding"), bool(c.get("replace", False)))
        if cs.start + cs.length > prompt_len:
            raise ValueError("capture[%d] spans tokens %d..%d of a %d-token prompt"
                             % (i, cs.start, cs.start + cs.length - 1, prompt_len))
        if cs.fact_id in seen:
            raise ValueError("capture[%d]: fact %d is captured twice" % (i, cs.fact_id))
        seen.add(cs.fact_id)
        if embedding_dim > 0:
            if cs.embedding is None or len(cs.embedding) != embedding_dim:
                raise ValueError("capture[%d]: the store keeps embeddings of %d values; got %s"
                                 % (i, embedding_dim, "none" if cs.embedding is None else len(cs.embedding)))
            cs.embedding = [float(x) for x in cs.embedding]
        elif cs.embedding is not None:
            raise ValueError("capture[%d]: an embedding, but the store keeps none (embedding_dim 0)" % i)
        capture.append(cs)
    remove = None if params.get("remove") is None else _remove_list(params["remove"], "remove")
    if remove == "all" and inject:
        raise ValueError('remove "all" with inject: the removal runs first, so the injected facts would be gone')
    if remove is not None and remove != "all":
        both = [s.fact_id for s in inject if s.fact_id in set(remove)]
        if both:
            raise ValueError("remove names fact %d, which the request injects (the removal runs first)" % both[0])
    keep = params.get("keep_dependents", False)
    if not isinstance(keep, bool):
        raise ValueError("keep_dependents must be true or false, got %r" % (keep,))
    if keep and remove is None:
        raise ValueError("keep_dependents without remove")
    prefetch, release = params.get("prefetch", False), params.get("release", False)
    for name, v in (("prefetch", prefetch), ("release", release)):
        if not isinstance(v, bool):
            raise ValueError("%s must be true or false, got %r" % (name, v))
    if not inject and not capture and remove is None and not prefetch and not release:
        raise ValueError("kvinject parameters ask for nothing (no inject, capture, remove, prefetch or release)")
    return RequestSpec(tenant, inject, capture, None if remove in (None, "all") else remove, remove == "all", keep,
                       prefetch, release)
