"""The memory service: users' facts, their placement on the replicas, captures
and chats. The HTTP layer (kvinject.serve.app) calls :class:`Service`.

Placement: a user is owned by one live replica (ring.owner). Before a user's
facts are injected or extended there, the replica must hold exactly the
user's facts at the user's current version (db.Placement "clean", same
version, same replica epoch); otherwise the gateway captures the user's whole
memory there first (the header and every fact, replace=true). Every
operation on a user runs under the user's lock, so captures and chats of one
user never interleave (a streamed chat holds it until the replica's first
event: its facts are injected by then).

Shared disk (``shared_disk``: the replicas' connectors share one ``disk_dir``,
their stores' disk tier): every capture and removal is written through to the
user's tenant file there, and carries ``release`` so that no replica keeps the
user's write lease after the gateway's request. A user whose memory at its
current version is clean on some replica (any epoch: the file outlives
restarts) and who is routed to another replica (its owner went down, the ring
changed) is not captured again: the new replica is asked to prefetch the user
(the connector reads the tenant file, anew when another replica changed it,
in the background; a chat meanwhile is prefilled as text by the connector's
hybrid policy, and an injection waits for the prefetch) and the placement
there becomes clean. A failed injection distrusts the file: every placement of
the user becomes unknown, and the next use captures the user again.

After idle: a chat after ``idle_prefetch_s`` without one from the user asks the
user's replica to prefetch the user's memory (the ``prefetch`` parameter on
the chat's own request: the connector starts it after the chat's injection),
as ``POST /v1/memory/{user}/prefetch`` does with a request of its own.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import capture as cap
from . import ring
from .chat import ApiError, ChatRequest, ChunkWriter, bad, completion_to_chat
from .config import GatewayConfig
from .db import Database, Fact, User
from .layout import Layout
from .metrics import Metrics
from .replicas import Replica, ReplicaDown, Replicas

log = logging.getLogger("kvinject.serve")


class EmbedQueue:
    """The embedder's calls, one at a time on its thread. Texts that arrive while a
    call runs wait, and then go together in the next call (up to ``limit`` texts; a
    caller's texts are never split): under load the queries of many chats cost one
    call rather than one each (on the 2-core VM, all-MiniLM-L6-v2 embeds one query
    in 11.5 ms, 16 in 37 ms). A call that fails fails each of its callers."""

    def __init__(self, embedder, pool: ThreadPoolExecutor, limit: int = 64):
        self.embedder, self.pool, self.limit = embedder, pool, limit
        self.waiting: Deque[Tuple[List[str], asyncio.Future]] = collections.deque()
        self.busy = False

    async def embed(self, texts: Sequence[str]) -> np.ndarray:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.waiting.append((list(texts), fut))
        if not self.busy:
            self.busy = True
            loop.create_task(self._run())
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self.waiting:
                take, n = [], 0
                while self.waiting and (not take or n + len(self.waiting[0][0]) <= self.limit):
                    take.append(self.waiting.popleft())
                    n += len(take[-1][0])
                texts = [x for t, _ in take for x in t]
                try:
                    out = await loop.run_in_executor(self.pool, self.embedder.embed, texts)
                    if len(out) != len(texts):
                        raise ValueError("%d embeddings for %d texts" % (len(out), len(texts)))
                except Exception as e:
                    for _, f in take:
                        if not f.done():   # a caller that went away is skipped
                            f.set_exception(e)
                    continue
                i = 0
                for t, f in take:
                    if not f.done():
                        f.set_result(out[i:i + len(t)])
                    i += len(t)
        finally:
            self.busy = False


class Service:
    def __init__(self, cfg: GatewayConfig, db: Database, layout: Layout, embedder, metrics: Metrics):
        self.cfg, self.db, self.layout, self.embedder, self.m = cfg, db, layout, embedder, metrics
        self.replicas = Replicas(cfg.replicas, health_interval=cfg.health_interval,
                                 request_timeout=cfg.request_timeout, on_change=self._replica_changed)
        self._locks: Dict[int, asyncio.Lock] = {}
        self._embed_pool = ThreadPoolExecutor(1, thread_name_prefix="kvinject-embed")
        self._embedq = EmbedQueue(embedder, self._embed_pool)
        self.model_name = cfg.served_model_name or ""
        self._last_chat: Dict[int, float] = {}   # user -> time.monotonic() of its last chat

    # ----------------------------------------------------------- lifecycle

    async def start(self) -> None:
        if self.db.meta("layout") != self.layout.hash:
            if self.db.meta("layout") is not None:
                log.warning("the prompt layout changed (system prompt, heading or tokenizer): every user's "
                            "memory will be captured again before its next use")
            self.db.mark_all_unknown()
            self.db.set_meta("layout", self.layout.hash)
        self._gauges()
        await self.replicas.check_all()
        if not self.model_name:
            self.model_name = next((r.model_id for r in self.replicas.all.values() if r.model_id), "") or \
                self.cfg.model
        self.replicas.start()

    async def close(self) -> None:
        await self.replicas.close()
        self._embed_pool.shutdown(wait=False)

    async def _replica_changed(self, rep: Replica, old_epoch: str) -> None:
        self.m.replica_up.labels(rep.url).set(1 if rep.up else 0)
        if rep.up:
            asyncio.get_running_loop().create_task(self._remove_deleted(rep))

    def lock(self, uid: int) -> asyncio.Lock:
        lk = self._locks.get(uid)
        if lk is None:
            lk = self._locks[uid] = asyncio.Lock()
        return lk

    # -------------------------------------------------------------- pieces

    async def embed(self, texts: Sequence[str], what: str) -> np.ndarray:
        t0 = time.perf_counter()
        try:
            out = await self._embedq.embed(texts)
        except Exception as e:
            raise ApiError(502, "the embedder failed: %s: %s" % (type(e).__name__, e), "server_error",
                           "embedder_failed")
        self.m.embedding_seconds.labels(what).observe(time.perf_counter() - t0)
        return out

    def owner(self, uid: int) -> Replica:
        live = self.replicas.live()
        if not live:
            raise ApiError(503, "no replica is answering (%s)" % ", ".join(
                "%s: %s" % (r.url, r.last_error or "not checked yet") for r in self.replicas.all.values()),
                "server_error", "no_replica")
        return self.replicas.all[ring.owner(live, uid)]

    def budget(self, rep: Replica) -> int:
        if self.cfg.capture_tokens:
            return self.cfg.capture_tokens
        return max((rep.max_model_len or 2048) - 8, 64)

    def clean(self, u: User, rep: Replica) -> bool:
        p = self.db.placement(u.id, rep.url)
        return p is not None and p.state == "clean" and p.version == u.version and p.epoch == rep.epoch

    def _set_clean(self, uid: int, rep: Replica) -> None:
        u = self.db.user_by_id(uid)
        if u is not None:
            self.db.set_placement(uid, rep.url, "clean", u.version, rep.epoch)

    def _set_unknown(self, uid: int, rep: Replica) -> None:
        self.db.set_placement(uid, rep.url, "unknown")

    def _distrust(self, uid: int, rep: Replica) -> None:
        """The user's memory on rep is not what the database says: unknown there, and
        with a shared disk everywhere (the replicas read the same file)."""
        self._set_unknown(uid, rep)
        if self.cfg.shared_disk:
            for p in self.db.placements(user=uid, state="clean"):
                self.db.set_placement(uid, p.replica, "unknown")

    def _writes(self, body: Dict[str, Any]) -> Dict[str, Any]:
        """A capture or removal body; with a shared disk it gives the tenant's lease up after its writes."""
        if self.cfg.shared_disk:
            body["kv_transfer_params"]["kvinject"]["release"] = True
        return body

    async def _send(self, rep: Replica, body: Dict[str, Any], kind: str) -> Tuple[int, Any]:
        try:
            status, resp = await self.replicas.complete(rep.url, body)
        except ReplicaDown:
            self.m.replica_requests.labels(rep.url, kind, "down").inc()
            raise
        self.m.replica_requests.labels(rep.url, kind, str(status)).inc()
        return status, resp

    async def run_captures(self, rep: Replica, reqs: List[cap.CaptureRequest], kind: str) -> int:
        """Sends capture requests in order; raises ApiError(502) on the first
        that fails. Returns the facts captured."""
        n = 0
        for r in reqs:
            self.m.captures.labels(kind).inc()
            try:
                status, resp = await self._send(rep, self._writes(r.body), "capture")
            except ReplicaDown:
                self.m.capture_failures.labels(kind).inc()
                raise
            inj = r.body["kv_transfer_params"]["kvinject"].get("inject")
            err, oc = cap.check(status, resp, asked=r.asked, injected=len(inj) if inj else -1)
            if err:
                self.m.capture_failures.labels(kind).inc()
                raise ApiError(502, "capture on %s failed: %s" % (rep.url, err), "server_error", "capture_failed")
            if oc is None:
                log.debug("replica %s reports no capture outcome: capture of %s taken as done", rep.url, r.asked)
            n += len(r.asked)
            self.m.captured_facts.inc(len(r.asked))
        return n

    async def remove(self, rep: Replica, tenant: int, fids, keep_dependents: bool = False) -> Optional[str]:
        """Asks the replica to remove facts (a list, or "all"); an error text or None.
        keep_dependents: the facts captured after them there keep their KV (else the
        replica's store makes them stale: see delete_fact)."""
        r = cap.removal(tenant, fids, self.layout.header[0], keep_dependents=keep_dependents)
        try:
            status, resp = await self._send(rep, self._writes(r.body), "remove")
        except ReplicaDown as e:
            self.m.removals.labels("down").inc()
            return str(e)
        err, _ = cap.check(status, resp)
        self.m.removals.labels("failed" if err else "ok").inc()
        return err

    async def full_capture(self, u: User, rep: Replica) -> int:
        """The user's whole memory on rep: in one request (or more when it does
        not fit), every fact of the user there removed, then the header and
        every fact captured."""
        facts = self.db.facts(u.id)
        self._set_unknown(u.id, rep)
        n = 0
        if facts:
            try:
                reqs = cap.plan(u.id, self.layout.header, [(f.fid, f.tokens) for f in facts], header_held=False,
                                replace=True, budget=self.budget(rep), remove="all")
            except cap.PlanError as e:
                raise ApiError(502, "capture failed: %s" % e, "server_error", "capture_failed")
            n = await self.run_captures(rep, reqs, "full")
        else:
            err = await self.remove(rep, u.id, "all")
            if err:
                raise ApiError(502, "removing the facts of %s on %s failed: %s" % (u.name, rep.url, err),
                               "server_error", "remove_failed")
        self._set_clean(u.id, rep)
        log.info("user %s (%d facts) captured on %s", u.name, len(facts), rep.url)
        return n

    async def prefetch(self, rep: Replica, tenant: int, why: str) -> Optional[str]:
        """Asks the replica to prefetch every fact of the tenant (in the background
        there); an error text or None."""
        r = cap.prefetch(tenant, self.layout.header[0])
        try:
            status, resp = await self._send(rep, r.body, "prefetch")
        except ReplicaDown as e:
            self.m.prefetches.labels(why, "down").inc()
            return str(e)
        err, _ = cap.check(status, resp)
        self.m.prefetches.labels(why, "failed" if err else "ok").inc()
        return err

    def shared_current(self, u: User) -> bool:
        """Shared disk: whether some replica wrote the user's memory at its current
        version to the shared tenant file (a clean placement of that version)."""
        return self.cfg.shared_disk and any(p.version == u.version
                                            for p in self.db.placements(user=u.id, state="clean"))

    async def from_shared(self, u: User, rep: Replica) -> bool:
        """Shared disk: rep loads the user's memory from the shared tenant file
        (a prefetch) instead of capturing it; True when it was asked to."""
        if not self.shared_current(u):
            return False
        err = await self.prefetch(rep, u.id, "shared")
        if err is not None:
            log.warning("user %s: prefetch from the shared disk on %s failed (%s): capturing it", u.name,
                        rep.url, err)
            return False
        self._set_clean(u.id, rep)
        log.info("user %s loaded from the shared disk on %s", u.name, rep.url)
        return True

    async def ensure(self, u: User, rep: Replica) -> str:
        """The user's memory on rep: "clean" (there already), "shared" (loaded from the
        shared disk) or "captured"."""
        if self.clean(u, rep):
            return "clean"
        if await self.from_shared(u, rep):
            return "shared"
        await self.full_capture(u, rep)
        return "captured"

    def _back_from_idle(self, uid: int) -> bool:
        """Notes a chat of the user; True when it is the user's first (the first chat, or
        the first after idle_prefetch_s without one)."""
        now = time.monotonic()
        last = self._last_chat.get(uid)
        self._last_chat[uid] = now
        idle = self.cfg.idle_prefetch_s
        return idle > 0 and (last is None or now - last >= idle)

    async def prefetch_user(self, name: str) -> Dict[str, Any]:
        """POST /v1/memory/{user}/prefetch: the user's memory made ready on its
        replica: prefetched there when it holds it, else loaded from the shared
        disk or captured."""
        u = self.user_or_404(name)
        async with self.lock(u.id):
            u = self.db.user_by_id(u.id)
            if u is None:
                raise ApiError(404, "unknown user %r" % name, "not_found_error", "unknown_user", "user")
            rep = self.owner(u.id)
            try:
                how = await self.ensure(u, rep)
            except ReplicaDown as e:
                raise ApiError(502, "prefetch failed: %s" % e, "server_error", "replica_down")
            if how == "clean":
                err = await self.prefetch(rep, u.id, "explicit")
                if err is not None:
                    raise ApiError(502, "prefetch on %s failed: %s" % (rep.url, err), "server_error",
                                   "prefetch_failed")
                how = "prefetched"
            self._last_chat[u.id] = time.monotonic()
        return {"user": name, "replica": rep.url, "memories": len(self.db.facts(u.id)), "done": how}

    async def _remove_deleted(self, rep: Replica) -> None:
        for p in self.db.placements(rep.url, "deleted"):
            err = await self.remove(rep, p.user, "all")
            if err is None:
                self.db.drop_placement(p.user, rep.url)

    # ------------------------------------------------------------ memories

    def fact_tokens(self, texts: Sequence[Any], param: str) -> List[List[int]]:
        if len(texts) > self.cfg.max_facts_per_add:
            raise bad("%d memories in one request; at most %d" % (len(texts), self.cfg.max_facts_per_add), param)
        out = []
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise bad("%s[%d] must be a string" % (param, i), param)
            t = t.strip()
            if not t:
                raise bad("%s[%d] is empty" % (param, i), param)
            toks = self.layout.fact_tokens(t)
            if len(toks) > self.cfg.max_fact_tokens:
                raise bad("%s[%d] has %d tokens; a memory may have at most %d" % (
                    param, i, len(toks), self.cfg.max_fact_tokens), param, "fact_too_long")
            out.append(toks)
        return out

    async def add(self, name: str, texts: List[str], param: str) -> Dict[str, Any]:
        texts = [t if not isinstance(t, str) else t.strip() for t in texts]
        toks = self.fact_tokens(texts, param)
        if not texts:
            raise bad("no memories to add", param)
        embs = await self.embed(texts, "facts")
        u = self.db.ensure_user(name)
        async with self.lock(u.id):
            for attempt in (1, 2):
                rep = self.owner(u.id)
                u = self.db.user_by_id(u.id)
                before = self.db.facts(u.id)
                was_clean = self.clean(u, rep) or await self.from_shared(u, rep)
                new = self.db.add_facts(u.id, list(zip(texts, toks, embs)))
                try:
                    if was_clean:
                        reqs = cap.plan(u.id, self.layout.header, [(f.fid, f.tokens) for f in new],
                                        context=[(f.fid, f.tokens) for f in before], budget=self.budget(rep))
                        await self.run_captures(rep, reqs, "add")
                        self._set_clean(u.id, rep)
                    else:
                        await self.full_capture(self.db.user_by_id(u.id), rep)
                    break
                except (ApiError, cap.PlanError, ReplicaDown) as e:
                    # the add did not happen: its facts leave the database again
                    for f in new:
                        self.db.delete_fact(f.id)
                    self._set_unknown(u.id, rep)
                    if isinstance(e, ReplicaDown) and attempt == 1:
                        continue            # the user's next owner
                    if isinstance(e, ReplicaDown):
                        raise ApiError(502, "capture failed: %s" % e, "server_error", "replica_down")
                    if isinstance(e, cap.PlanError):
                        raise ApiError(502, "capture failed: %s" % e, "server_error", "capture_failed")
                    raise
        self._gauges()
        return {"user": name, "replica": rep.url, "results": [f.public(name) for f in new]}

    def user_or_404(self, name: str) -> User:
        u = self.db.user(name)
        if u is None:
            raise ApiError(404, "unknown user %r" % name, "not_found_error", "unknown_user", "user")
        return u

    def list(self, name: str) -> Dict[str, Any]:
        u = self.user_or_404(name)
        rep = self.owner(u.id) if self.replicas.live() else None
        return {"user": name, "tenant": u.id, "replica": rep.url if rep else None,
                "results": [f.public(name) for f in self.db.facts(u.id)]}

    def _search(self, u: User, q: np.ndarray, k: int, min_score: Optional[float]) -> List[Tuple[Fact, float]]:
        t0 = time.perf_counter()
        fids, ids, mat = self.db.embeddings(u.id)
        out: List[Tuple[int, float]] = []
        if len(fids) and k > 0:
            scores = mat @ q.astype(np.float32)
            order = np.argsort(-scores, kind="stable")[:k]
            out = [(int(fids[i]), float(scores[i])) for i in order
                   if min_score is None or scores[i] >= min_score]
        self.m.retrieval_seconds.observe(time.perf_counter() - t0)
        byfid = {f.fid: f for f in self.db.facts_by_fid(u.id, [f for f, _ in out])}
        return [(byfid[f], s) for f, s in out if f in byfid]

    async def search(self, name: str, query: str, k: int, min_score: Optional[float]) -> Dict[str, Any]:
        u = self.user_or_404(name)
        q = (await self.embed([query], "query"))[0]
        got = self._search(u, q, k, min_score)
        return {"user": name, "results": [dict(f.public(name), score=s) for f, s in got]}

    async def delete_fact(self, fact_id: int, reencode: bool = True, user: Optional[str] = None) -> Dict[str, Any]:
        """Forgets a memory; with ``user``, only one of that user's (else 404)."""
        f = self.db.fact(fact_id)
        if f is None:
            raise ApiError(404, "unknown memory id %d" % fact_id, "not_found_error", "unknown_memory")
        u = self.db.user_by_id(f.user)
        async with self.lock(u.id):
            f = self.db.fact(fact_id)
            u = self.db.user_by_id(f.user) if f is not None else None
            if u is None or (user is not None and u.name != user):
                raise ApiError(404, "unknown memory id %d" % fact_id, "not_found_error", "unknown_memory")
            live = self.replicas.live()
            rep = self.replicas.all[ring.owner(live, u.id)] if live else None
            was_clean = rep is not None and self.clean(u, rep)
            facts = self.db.facts(u.id)
            self.db.delete_fact(fact_id)       # forgotten first: whatever happens next, it is never injected again
            before = [x for x in facts if x.fid < f.fid]
            later = [x for x in facts if x.fid > f.fid]
            out = {"deleted": fact_id, "user": u.name, "fact_id": f.fid, "reencoded": [], "replica": None,
                   "removed_from": []}
            # every other replica that may hold it is told to remove it (best effort: it is
            # never injected again either way, and a full capture there removes it)
            for url in live:
                r = self.replicas.all[url]
                if (r is not rep or not was_clean) and self.db.placement(u.id, url) is not None:
                    err = await self.remove(r, u.id, [f.fid])
                    if err is None:
                        out["removed_from"].append(url)
                    else:
                        log.warning("removing fact %d of %s on %s: %s", f.fid, u.name, url, err)
                        if r is rep:
                            self._set_unknown(u.id, rep)
            if rep is not None and was_clean:
                # the owner: the fact removed and the later ones re-encoded, in one request
                out["replica"] = rep.url
                try:
                    if reencode and later:
                        reqs = cap.plan(u.id, self.layout.header, [(x.fid, x.tokens) for x in later],
                                        context=[(x.fid, x.tokens) for x in before], replace=True,
                                        budget=self.budget(rep), remove=[f.fid])
                        await self.run_captures(rep, reqs, "reencode")
                        out["reencoded"] = [x.id for x in later]
                    else:
                        # reencode=false: the later facts keep their KV, computed with this one in
                        # context (the caller's choice); with reencode and no later fact there is none
                        err = await self.remove(rep, u.id, [f.fid], keep_dependents=not reencode)
                        if err:
                            raise ApiError(502, err, "server_error", "remove_failed")
                    out["removed_from"].append(rep.url)
                    self._set_clean(u.id, rep)
                except (ApiError, cap.PlanError, ReplicaDown) as e:
                    self._set_unknown(u.id, rep)
                    msg = e.message if isinstance(e, ApiError) else str(e)
                    raise ApiError(502, "memory %d was deleted, but removing it from %s or re-encoding the later "
                                   "memories failed (the user's memory there will be captured again before its "
                                   "next use): %s" % (fact_id, rep.url, msg), "server_error", "capture_failed")
        self._gauges()
        return out

    async def delete_user(self, name: str) -> Dict[str, Any]:
        u = self.user_or_404(name)
        async with self.lock(u.id):
            n = len(self.db.facts(u.id))
            self.db.delete_user(u.id)
            removed = []
            for p in self.db.placements(state="deleted"):
                if p.user != u.id:
                    continue
                r = self.replicas.all.get(p.replica)
                if r is not None and r.up:
                    if await self.remove(r, u.id, "all") is None:
                        self.db.drop_placement(u.id, r.url)
                        removed.append(r.url)
        self._locks.pop(u.id, None)
        self._gauges()
        return {"deleted_user": name, "deleted": n, "removed_from": removed}

    def _gauges(self) -> None:
        self.m.facts.set(self.db.count_facts())
        self.m.users.set(len(self.db.users()))

    # ---------------------------------------------------------------- chat

    async def prepare_chat(self, req: ChatRequest):
        """(user or None, retrieved [(fact, score)], tail ids)."""
        try:
            tail, query = self.layout.tail(req.messages)
        except ValueError as e:
            raise bad("messages: %s" % e, "messages")
        except Exception as e:  # a template that refuses the conversation (roles out of order, ...)
            raise bad("the chat template refused the messages: %s" % e, "messages")
        u = self.db.user(req.user)
        got: List[Tuple[Fact, float]] = []
        if u is not None and req.memory and req.k > 0 and self.db.embeddings(u.id)[0].size:
            q = (await self.embed([query], "query"))[0]
            got = self._search(u, q, req.k, req.min_score)
            got.sort(key=lambda fs: fs[0].fid)        # the order they were said
        return u, got, tail

    def _memory_field(self, got, rep: Replica) -> Dict[str, Any]:
        n = len(self.layout.header) + sum(len(f.tokens) for f, _ in got) if got else 0
        return {"facts": [{"id": f.id, "fact_id": f.fid, "text": f.text, "score": s, "tokens": len(f.tokens)}
                          for f, s in got], "injected_tokens": n, "replica": rep.url}

    def _body(self, req: ChatRequest, u: Optional[User], got, tail) -> Dict[str, Any]:
        ids = self.layout.prompt([f.tokens for f, _ in got], tail)
        body = dict(req.upstream, prompt=ids, return_token_ids=True)
        if req.logprobs:
            body["return_tokens_as_token_ids"] = True
        if got:
            spans = [[0, 0, len(self.layout.header)]]
            pos = len(self.layout.header)
            for f, _ in got:
                spans.append([f.fid, pos, len(f.tokens)])
                pos += len(f.tokens)
            body["kv_transfer_params"] = {"kvinject": {"tenant": u.id, "inject": spans}}
        return body

    def _check_length(self, rep: Replica, body: Dict[str, Any], req: ChatRequest) -> None:
        n = len(body["prompt"])
        mem = sum(s[2] for s in body.get("kv_transfer_params", {}).get("kvinject", {}).get("inject", []))
        if rep.max_model_len and n + (req.max_tokens or 1) > rep.max_model_len:
            raise bad("the prompt has %d tokens (%d of them the memory) and max_tokens is %d: more than the "
                      "replica's max_model_len %d" % (n, mem, req.max_tokens or 1, rep.max_model_len),
                      "messages", "context_length_exceeded")

    async def chat(self, req: ChatRequest):
        """A chat.completion dict, or (for stream=true) an async iterator of
        chat.completion.chunk dicts whose first item is ready."""
        u, got, tail = await self.prepare_chat(req)
        uid = u.id if u is not None else None
        lock = self.lock(uid) if uid is not None else asyncio.Lock()
        await lock.acquire()
        try:
            if u is not None:
                u = self.db.user_by_id(u.id)
                if u is None:       # deleted meanwhile
                    got = []
                else:               # facts deleted meanwhile are not injected
                    got = [(f, sc) for f, sc in got if self.db.fact(f.id) is not None]
            body = self._body(req, u, got, tail)
            route = uid if uid is not None else zlib.crc32(req.user.encode())
            rep = self.owner(route)
            self._check_length(rep, body, req)
            after_idle = u is not None and self._back_from_idle(u.id) and self.clean(u, rep)
            if after_idle:
                # the user is back: the chat itself asks the replica to move the user's memory up
                # (the connector starts the prefetch after the chat's own injection: the chat
                # waits neither for the reads nor for a request of its own)
                kv = body.setdefault("kv_transfer_params", {}).setdefault("kvinject", {"tenant": u.id})
                kv["prefetch"] = True
            attempt = 0
            while True:
                attempt += 1
                try:
                    if got:
                        await self.ensure(u, rep)
                    if req.stream:
                        res = await self._stream(rep, body, req, got)
                    else:
                        res = await self._complete(rep, body, req, got)
                except ReplicaDown:
                    if attempt > 2:
                        raise ApiError(502, "the replicas stopped answering", "server_error", "replica_down")
                    self.m.chat_retries.labels("replica_down").inc()
                    rep = self.owner(route)
                    continue
                if isinstance(res, str):          # the injection failed
                    if not got or attempt >= 2:
                        raise ApiError(502, "chat failed on %s: %s" % (rep.url, res), "server_error",
                                       "injection_failed" if got else "replica_failed")
                    log.warning("chat of %s on %s failed (%s): capturing its memory again", u.name, rep.url, res)
                    self.m.chat_retries.labels("injection_failed").inc()
                    self._distrust(u.id, rep)
                    continue
                break
            if after_idle:
                self.m.prefetches.labels("idle", "ok").inc()
        finally:
            # a stream's first event is there: the replica has injected the facts (they are in
            # its engine's cache), so the user's other chats and memory writes need not wait
            # for the rest of the answer
            lock.release()
        return res

    async def _complete(self, rep: Replica, body, req: ChatRequest, got):
        t = time.perf_counter()
        status, resp = await self._send(rep, body, "chat")
        req.replica_s = time.perf_counter() - t
        if status == 200:
            oc = cap.outcome(resp)
            if got and oc is not None and oc.get("errors"):
                return "the connector reported: %s" % "; ".join(map(str, oc["errors"]))
            self.m.injected_facts.inc(len(got))
            mem = self._memory_field(got, rep)
            self.m.injected_tokens.inc(mem["injected_tokens"])
            return completion_to_chat(resp, req, self.model_name, mem, self.layout.decode_token)
        if status >= 500:
            err, _ = cap.check(status, resp)
            return err
        msg = resp.get("error", {}).get("message") if isinstance(resp, dict) and isinstance(resp.get("error"), dict) \
            else str(resp)[:500]
        raise ApiError(status if 400 <= status < 500 else 502, "the replica refused the request: %s" % msg,
                       "invalid_request_error" if 400 <= status < 500 else "server_error", "replica_refused")

    async def _stream(self, rep: Replica, body, req: ChatRequest, got):
        if req.include_usage:
            body = dict(body, stream_options={"include_usage": True})
        t = time.perf_counter()
        up = await self.replicas.stream(rep.url, body)
        self.m.replica_requests.labels(rep.url, "chat", str(up.status)).inc()
        if up.status != 200:
            text = await up.body()
            if up.status >= 500:
                return "vLLM answered HTTP %d: %s" % (up.status, text[:300])
            raise ApiError(up.status, "the replica refused the request: %s" % text[:500], "invalid_request_error",
                           "replica_refused")
        events = up.events()
        first = None
        async for ev in events:
            if "error" in ev:
                await up.close()
                e = ev["error"]
                return "vLLM's stream ended with an error: %s" % (e.get("message") if isinstance(e, dict) else e)
            if ev.get("choices") or ev.get("usage") is not None:
                first = ev
                break
        req.replica_s = time.perf_counter() - t
        self.m.injected_facts.inc(len(got))
        mem = self._memory_field(got, rep)
        self.m.injected_tokens.inc(mem["injected_tokens"])
        w = ChunkWriter(req, self.model_name, mem, self.layout.decode_token)

        async def gen():
            if first is not None:
                for c in w.convert(first):
                    yield c
            async for ev in events:
                if "error" in ev:
                    yield {"error": ev["error"]}
                    return
                for c in w.convert(ev):
                    yield c
        return gen()
