"""The gateway's HTTP API (FastAPI), served by uvicorn: OpenAI's chat
completions with memory, a Mem0-style memory API, /health and /metrics.
docs/guide/serve.md describes every route.
"""
from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat import ApiError, bad, parse_chat, parse_user
from .memory import Service

log = logging.getLogger("kvinject.serve")


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, refused (400) past ``limit`` bytes or when it
    is not JSON."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise ApiError(413, "the body has %s bytes; at most %d are accepted" % (cl, limit),
                       "invalid_request_error", "body_too_large")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise ApiError(413, "the body is larger than %d bytes" % limit, "invalid_request_error",
                           "body_too_large")
    if not data:
        raise bad("the body is empty; a JSON object is expected", code="invalid_json")
    try:
        body = json.loads(bytes(data))
        # text that cannot be UTF-8 (a lone surrogate from "\ud800") reaches neither SQLite nor the tokenizer
        json.dumps(body, ensure_ascii=False).encode("utf-8")
        return body
    except RecursionError:
        raise bad("the body's JSON is nested too deeply", code="invalid_json")
    except UnicodeEncodeError as e:
        raise bad("the body holds text that is not valid Unicode: %s" % e, code="invalid_json")
    except (ValueError, UnicodeDecodeError) as e:
        raise bad("the body is not valid JSON: %s" % e, code="invalid_json")


def _k(v, max_k: int, name: str = "k") -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad("%s must be an integer, got %r" % (name, v), name)
    if not 0 <= v <= max_k:
        raise bad("%s = %d is out of range [0, %d]" % (name, v, max_k), name)
    return v


def _min_score(v) -> Optional[float]:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad("min_score must be a number, got %r" % (v,), "min_score")
    return float(v)


def create_app(service: Service) -> FastAPI:
    cfg = service.cfg
    m = service.m

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="kvinject memory gateway", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        if e.status >= 500:
            log.warning("%s %s: %d %s", request.method, request.url.path, e.status, e.message)
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        typ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), typ).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, e: Exception):
        log.exception("%s %s", request.method, request.url.path)
        return JSONResponse(ApiError(500, "internal error: %s: %s" % (type(e).__name__, e), "server_error").body(),
                            status_code=500)

    @app.middleware("http")
    async def _count(request: Request, call_next):
        status = 500
        try:
            resp = await call_next(request)
            status = resp.status_code
            return resp
        finally:
            route = request.scope.get("route")
            m.requests.labels(getattr(route, "path", "other"), request.method, str(status)).inc()

    # ------------------------------------------------------------ chat

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        t0 = time.perf_counter()
        body = await read_json(request, cfg.max_body_bytes)
        req = parse_chat(body, cfg.default_k, cfg.max_k)
        res = await service.chat(req)
        if not req.stream:
            t = time.perf_counter() - t0
            m.chat_seconds.labels("false").observe(t)
            m.overhead_seconds.labels("false").observe(max(t - req.replica_s, 0.0))
            return JSONResponse(res)

        async def sse():
            first = True
            try:
                async for chunk in res:
                    data = "data: %s\n\n" % json.dumps(chunk)
                    if first:
                        first = False
                        m.overhead_seconds.labels("true").observe(max(time.perf_counter() - t0 - req.replica_s, 0.0))
                    yield data
                yield "data: [DONE]\n\n"
            finally:
                m.chat_seconds.labels("true").observe(time.perf_counter() - t0)
        return StreamingResponse(sse(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        reps = [r for r in service.replicas.all.values() if r.up]
        mml = max((r.max_model_len for r in reps), default=0)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "kvinject", "max_model_len": mml or None}]}

    # --------------------------------------------------------- memories

    async def read_user_object(request: Request, shape: str):
        """(body, user) of a memory route's JSON object body: 400 when it is
        not an object or has no valid user."""
        body = await read_json(request, cfg.max_body_bytes)
        if not isinstance(body, dict):
            raise bad("the body must be a JSON object %s" % shape)
        return body, parse_user(body.get("user"))

    @app.post("/v1/memories")
    async def add(request: Request):
        body, user = await read_user_object(request, "{user, facts} or {user, messages}")
        if ("facts" in body) == ("messages" in body):
            raise bad("give either facts (a list of texts) or messages (a list of {role, content})")
        if "facts" in body:
            facts = body["facts"]
            if not isinstance(facts, list):
                raise bad("facts must be a list of texts", "facts")
            param = "facts"
        else:
            msgs = body["messages"]
            if not isinstance(msgs, list):
                raise bad("messages must be a list of {role, content}", "messages")
            facts = []
            for i, mm in enumerate(msgs):
                if not isinstance(mm, dict) or not isinstance(mm.get("role"), str):
                    raise bad("messages[%d] must be an object with a role" % i, "messages")
                if mm["role"] == "user":
                    if not isinstance(mm.get("content"), str):
                        raise bad("messages[%d].content must be a string" % i, "messages")
                    facts.append(mm["content"])
            param = "messages"
        if not facts:
            raise bad("no memories to add (an empty list%s)" % (
                "" if param == "facts" else ", or no user message"), param)
        return await service.add(user, facts, param)

    @app.get("/v1/memories")
    async def list_memories(user: Optional[str] = None):
        return service.list(parse_user(user))

    @app.get("/v1/memories/{memory_id}")
    async def get_memory(memory_id: str, user: Optional[str] = None):
        f = service.db.fact(_memory_id(memory_id))
        u = service.db.user_by_id(f.user) if f is not None else None
        if u is None or (user is not None and parse_user(user) != u.name):
            raise ApiError(404, "unknown memory id %s" % memory_id, "not_found_error", "unknown_memory")
        return f.public(u.name)

    @app.post("/v1/memories/search")
    async def search(request: Request):
        body, user = await read_user_object(request, "{user, query, k}")
        q = body.get("query")
        if not isinstance(q, str) or not q.strip():
            raise bad("query must be a non-empty string", "query")
        k = _k(body.get("k", cfg.default_k), cfg.max_k)
        return await service.search(user, q, k, _min_score(body.get("min_score")))

    @app.delete("/v1/memories/{memory_id}")
    async def delete_memory(memory_id: str, reencode: str = "true", user: Optional[str] = None):
        if reencode.lower() not in ("true", "false", "1", "0"):
            raise bad("reencode must be true or false", "reencode")
        return await service.delete_fact(_memory_id(memory_id), reencode.lower() in ("true", "1"),
                                         user=None if user is None else parse_user(user))

    @app.delete("/v1/memories")
    async def delete_user(user: Optional[str] = None):
        return await service.delete_user(parse_user(user))

    @app.post("/v1/memory/{user}/prefetch")
    async def prefetch(user: str):
        return await service.prefetch_user(parse_user(user))

    # ------------------------------------------------------------ status

    @app.get("/health")
    async def health():
        reps = [r.info() for r in service.replicas.all.values()]
        up = sum(1 for r in reps if r["up"])
        return JSONResponse({"status": "ok" if up else "no_replica", "replicas": reps,
                             "users": len(service.db.users()), "memories": service.db.count_facts()},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        for r in service.replicas.all.values():
            m.replica_up.labels(r.url).set(1 if r.up else 0)
        return Response(m.scrape(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _memory_id(s: str) -> int:
    if not (s.isascii() and s.isdigit()) or len(s) > 18:      # "²".isdigit(), but int("²") fails
        raise bad("a memory id is a non-negative integer, got %r" % s, "id")
    return int(s)
