"""The vLLM replicas behind the gateway: health, epochs, requests.

Each replica is checked every ``health_interval`` seconds (``GET /health``)
and after any connection error. A replica that answers joins the ring; when it
joins (and every 15th check) its ``/v1/models`` gives the model id and ``max_model_len``; its ``/metrics``
``process_start_time_seconds`` is its *epoch* (a replica whose epoch changed
has restarted, and what it holds is not known). One that stops answering
leaves the ring. ``on_change(replica, old_epoch)`` is called when a replica
comes up or its epoch changes, and when it goes down.

Requests go through one ``httpx.AsyncClient``; a connection error (refused,
reset, timed out on connect) raises :class:`ReplicaDown` and takes the
replica out of the ring at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple

import httpx

log = logging.getLogger("kvinject.serve")
logging.getLogger("httpx").setLevel(logging.WARNING)


class ReplicaDown(Exception):
    """The replica did not answer (connection refused, reset or timed out)."""

    def __init__(self, url: str, why: str):
        super().__init__("replica %s is not answering: %s" % (url, why))
        self.url = url


class Replica:
    def __init__(self, url: str):
        self.url = url
        self.up = False
        self.epoch = ""
        self.model_id: Optional[str] = None
        self.max_model_len = 0
        self.last_error = ""
        self.checked = 0.0
        self.requests = 0
        self.checks = 0

    def info(self) -> Dict[str, Any]:
        return {"url": self.url, "up": self.up, "epoch": self.epoch, "model": self.model_id,
                "max_model_len": self.max_model_len, "last_error": self.last_error or None}


_START = re.compile(r"^process_start_time_seconds\s+(\S+)", re.M)

OnChange = Callable[[Replica, str], Awaitable[None]]


class Replicas:
    def __init__(self, urls: List[str], *, health_interval: float = 2.0, request_timeout: float = 600.0,
                 on_change: Optional[OnChange] = None):
        self.all: Dict[str, Replica] = {u: Replica(u) for u in urls}
        self.interval = health_interval
        self.timeout = request_timeout
        self.on_change = on_change
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0),
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        self._task: Optional[asyncio.Task] = None
        self._locks: Dict[str, asyncio.Lock] = {u: asyncio.Lock() for u in urls}

    # ------------------------------------------------------------ health

    def live(self) -> List[str]:
        return [u for u, r in self.all.items() if r.up]

    async def check(self, url: str) -> bool:
        """One health check of a replica (serialized per replica); True when up."""
        rep = self.all[url]
        async with self._locks[url]:
            was_up, old_epoch = rep.up, rep.epoch
            try:
                r = await self.client.get(url + "/health", timeout=5.0)
                ok = r.status_code == 200
                rep.checks += 1
                if ok and (not was_up or rep.checks % 15 == 0 or not rep.model_id):
                    m = await self.client.get(url + "/v1/models", timeout=10.0)
                    card = m.json()["data"][0]
                    rep.model_id, rep.max_model_len = card["id"], int(card.get("max_model_len") or 0)
                    epoch = ""
                    try:
                        mt = await self.client.get(url + "/metrics", timeout=10.0)
                        g = _START.search(mt.text)
                        epoch = g.group(1) if g else ""
                    except httpx.HTTPError:
                        pass
                    # without a start time, every return after a failure is a new epoch
                    rep.epoch = epoch or (old_epoch if was_up and old_epoch else "anon-" + uuid.uuid4().hex[:12])
                else:
                    rep.last_error = "GET /health answered %d" % r.status_code
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
                ok = False
                rep.last_error = "%s: %s" % (type(e).__name__, e)
            rep.checked = time.time()
            rep.up = ok
            if ok:
                rep.last_error = ""
            changed = (ok != was_up) or (ok and rep.epoch != old_epoch)
        if changed:
            log.info("replica %s is %s (epoch %s)", url, "up" if ok else "down: " + rep.last_error, rep.epoch)
            if self.on_change is not None:
                await self.on_change(rep, old_epoch)
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(u) for u in self.all))

    async def _loop(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # never let the loop die
                log.exception("health check")
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None
        await self.client.aclose()

    async def _down(self, url: str, e: Exception) -> ReplicaDown:
        """A request found the replica not answering: out of the ring at once
        (the next health check takes it back if it answers)."""
        rep = self.all[url]
        rep.last_error = "%s: %s" % (type(e).__name__, e)
        if rep.up:
            rep.up = False
            log.info("replica %s is down: %s", url, rep.last_error)
            if self.on_change is not None:
                await self.on_change(rep, rep.epoch)
        return ReplicaDown(url, rep.last_error)

    # ----------------------------------------------------------- requests

    async def complete(self, url: str, body: Dict[str, Any]) -> Tuple[int, Any]:
        """POST /v1/completions; (status, JSON body or text). Raises ReplicaDown."""
        rep = self.all[url]
        rep.requests += 1
        body = dict(body, model=rep.model_id or body.get("model"))
        try:
            r = await self.client.post(url + "/v1/completions", json=body)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise await self._down(url, e)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    async def stream(self, url: str, body: Dict[str, Any]) -> "UpstreamStream":
        """POST /v1/completions with stream=true; the open stream (its status
        known, its events not read yet). Raises ReplicaDown."""
        rep = self.all[url]
        rep.requests += 1
        body = dict(body, model=rep.model_id or body.get("model"), stream=True)
        req = self.client.build_request("POST", url + "/v1/completions", json=body)
        try:
            resp = await self.client.send(req, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise await self._down(url, e)
        return UpstreamStream(resp)


class UpstreamStream:
    """A replica's SSE answer: ``status``, then :meth:`events` (parsed JSON
    objects, until ``[DONE]``)."""

    def __init__(self, resp: httpx.Response):
        self.resp = resp
        self.status = resp.status_code

    async def body(self) -> str:
        data = await self.resp.aread()
        await self.resp.aclose()
        return data.decode(errors="replace")

    async def events(self) -> AsyncIterator[Dict[str, Any]]:
        try:
            async for line in self.resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                yield json.loads(data)
        finally:
            await self.resp.aclose()

    async def close(self) -> None:
        await self.resp.aclose()
