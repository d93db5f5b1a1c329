"""OpenAI's chat API on vLLM's completions API: requests checked and turned
into /v1/completions bodies, answers turned into chat.completion objects and
chat.completion.chunk events. No FastAPI here.
"""
from __future__ import annotations

import dataclasses
import math
import time
import uuid
from typing import Any, Callable, Dict, List, Optional


class ApiError(Exception):
    """An error answered with an OpenAI-style body {"error": {message, type, code}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}


def bad(message: str, param: Optional[str] = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)


ROLES = ("system", "developer", "user", "assistant", "tool")

# passed to /v1/completions as they are (checked by vLLM, whose 4xx comes back as it is)
PASS = ("temperature", "top_p", "stop", "seed", "n", "presence_penalty", "frequency_penalty", "top_k",
        "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "logit_bias")


@dataclasses.dataclass
class ChatRequest:
    user: str
    messages: List[Dict[str, Any]]
    k: int
    min_score: Optional[float]
    memory: bool
    stream: bool
    include_usage: bool
    max_tokens: Optional[int]
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    tokens_as_ids: bool
    upstream: Dict[str, Any]     # sampling fields for /v1/completions
    model: Optional[str]
    # seconds the answering replica took to its first event (stream) or whole
    # answer: set by the attempt that answered (the gateway's overhead is the rest)
    replica_s: float = 0.0


def _int(v, name, lo, hi) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad("%s must be an integer, got %s" % (name, _show(v)), name)
    if not lo <= v <= hi:
        raise bad("%s = %d is out of range [%d, %d]" % (name, v, lo, hi), name)
    return v


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def parse_user(v, name="user") -> str:
    if v is None or v == "":
        raise bad("%s is required: the name of the memory's owner" % name, name, "missing_user")
    if not isinstance(v, str):
        raise bad("%s must be a string, got %s" % (name, _show(v)), name)
    if len(v) > 256:
        raise bad("%s is longer than 256 characters" % name, name)
    return v


def parse_chat(body: Any, default_k: int, max_k: int) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    user = parse_user(body.get("user"))
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages must be a non-empty list", "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad("messages[%d] must be an object with a role (%s)" % (i, ", ".join(ROLES)), "messages")
        c = m.get("content")
        if not (isinstance(c, str) or isinstance(c, list) or (c is None and m["role"] == "assistant")):
            raise bad("messages[%d].content must be a string or a list of text parts" % i, "messages")
    if not any(m["role"] == "user" for m in msgs):
        raise bad("messages hold no user message", "messages")
    mem = body.get("memory", True)
    k, min_score, use = default_k, None, True
    if mem is False or mem is None:
        use, k = False, 0
    elif mem is True:
        pass
    elif isinstance(mem, dict):
        unknown = set(mem) - {"k", "min_score"}
        if unknown:
            raise bad("memory: unknown keys %s (known: k, min_score)" % sorted(unknown), "memory")
        if "k" in mem:
            k = _int(mem["k"], "memory.k", 0, max_k)
        if mem.get("min_score") is not None:
            ms = mem["min_score"]
            if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms):
                raise bad("memory.min_score must be a number, got %s" % _show(ms), "memory.min_score")
            min_score = float(ms)
    else:
        raise bad("memory must be an object {k, min_score} or false", "memory")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    so = body.get("stream_options") or {}
    include_usage = bool(isinstance(so, dict) and so.get("include_usage"))
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        mt = _int(mt, "max_tokens", 1, 1 << 30)
    lp = body.get("logprobs", False)
    if lp is None:
        lp = False
    if not isinstance(lp, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    tlp = body.get("top_logprobs")
    tlp = 0 if tlp is None else _int(tlp, "top_logprobs", 0, 20)
    if tlp and not lp:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if body.get("n") is not None:
        _int(body["n"], "n", 1, 16)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    up = {k: body[k] for k in PASS if body.get(k) is not None}
    if mt is not None:
        up["max_tokens"] = mt
    if lp:
        up["logprobs"] = tlp
    return ChatRequest(user, msgs, k, min_score, use, stream, include_usage, mt, lp, tlp,
                       bool(body.get("return_token_ids")), bool(body.get("return_tokens_as_token_ids")), up, model)


# ------------------------------------------------------------------ answers

def _tid(tok: str) -> int:
    return int(tok.split(":", 1)[1])


def _logprob_entry(tok: str, lp: float, decode: Callable[[int], str], as_ids: bool) -> Dict[str, Any]:
    tid = _tid(tok)
    text = tok if as_ids else decode(tid)
    return {"token": text, "token_id": tid, "logprob": max(lp, -9999.0) if lp is not None else -9999.0,
            "bytes": list(decode(tid).encode("utf-8"))}


def chat_logprobs(lp: Optional[Dict[str, Any]], top: int, decode, as_ids: bool) -> Optional[Dict[str, Any]]:
    """completions logprobs (tokens as "token_id:N") -> chat logprobs {"content": [...]}."""
    if not lp:
        return None
    content = []
    for i, tok in enumerate(lp.get("tokens") or []):
        e = _logprob_entry(tok, lp["token_logprobs"][i], decode, as_ids)
        tops = (lp.get("top_logprobs") or [None] * (i + 1))[i] or {}
        ranked = sorted(tops.items(), key=lambda kv: -kv[1])[:top]
        e["top_logprobs"] = [_logprob_entry(t, v, decode, as_ids) for t, v in ranked]
        content.append(e)
    return {"content": content}


def chat_id(upstream_id: Optional[str]) -> str:
    base = (upstream_id or "").split("-", 1)[-1] or uuid.uuid4().hex
    return "chatcmpl-" + base


def completion_to_chat(resp: Dict[str, Any], req: ChatRequest, model: str, memory: Dict[str, Any],
                       decode) -> Dict[str, Any]:
    choices = []
    for c in resp.get("choices") or []:
        ch = {"index": c.get("index", 0), "message": {"role": "assistant", "content": c.get("text", "")},
              "logprobs": chat_logprobs(c.get("logprobs"), req.top_logprobs, decode, req.tokens_as_ids)
              if req.logprobs else None,
              "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
        if req.return_token_ids:
            ch["token_ids"] = c.get("token_ids")
        choices.append(ch)
    return {"id": chat_id(resp.get("id")), "object": "chat.completion", "created": resp.get("created",
                                                                                          int(time.time())),
            "model": model, "choices": choices, "usage": resp.get("usage"), "memory": memory}


class ChunkWriter:
    """completion stream events -> chat.completion.chunk events."""

    def __init__(self, req: ChatRequest, model: str, memory: Dict[str, Any], decode):
        self.req, self.model, self.memory, self.decode = req, model, memory, decode
        self.id = "chatcmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.started: set = set()

    def _chunk(self, choices, **extra) -> Dict[str, Any]:
        d = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
             "choices": choices}
        d.update(extra)
        return d

    def convert(self, ev: Dict[str, Any]) -> List[Dict[str, Any]]:
        out = []
        for c in ev.get("choices") or []:
            i = c.get("index", 0)
            if i not in self.started:
                self.started.add(i)
                first = self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                if len(self.started) == 1:
                    first["memory"] = self.memory
                out.append(first)
            ch = {"index": i, "delta": {"content": c.get("text", "")},
                  "logprobs": chat_logprobs(c.get("logprobs"), self.req.top_logprobs, self.decode,
                                            self.req.tokens_as_ids) if self.req.logprobs else None,
                  "finish_reason": c.get("finish_reason")}
            if c.get("stop_reason") is not None:
                ch["stop_reason"] = c.get("stop_reason")
            if self.req.return_token_ids:
                ch["token_ids"] = c.get("token_ids")
            out.append(self._chunk([ch]))
        if not ev.get("choices") and ev.get("usage") is not None:
            out.append(self._chunk([], usage=ev["usage"]))
        return out
