"""The memory gateway's prefetch after idle and shared-disk moves (kvinject.serve.memory)
without vLLM: the Service with a real database and fakes of the layout, the embedder
and the replicas. Each fake replica keeps what its connector's store would hold per
tenant, over one "shared disk" of tenant files: captures and removals write through
to the file, ``prefetch`` reads the file into the replica's memory, ``release`` is
noted; an injection of a fact the replica's memory lacks fails as the connector's
does (a tenant the replica never saw is prefilled as text, as the hybrid policy
does). The tests check which requests reach which replica.

Needs numpy, httpx, prometheus_client and fastapi (tests/vllm/launch.py runs it in
the vLLM environment).
"""
from __future__ import annotations

import asyncio
import time

import pytest

np = pytest.importorskip("numpy")
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")

from kvinject.serve.chat import ApiError, parse_chat  # noqa: E402
from kvinject.serve.config import GatewayConfig  # noqa: E402
from kvinject.serve.db import Database  # noqa: E402
from kvinject.serve.memory import Service  # noqa: E402
from kvinject.serve.metrics import Metrics  # noqa: E402
from kvinject.serve import ring  # noqa: E402

HEADER = [1, 2, 3]


class FakeLayout:
    header = HEADER
    hash = "fake"

    def fact_tokens(self, text):
        return [100 + (ord(c) % 50) for c in text[:6]]

    def tail(self, messages):
        return [7, 8], messages[-1]["content"]

    def prompt(self, facts, tail):
        return HEADER + [t for f in facts for t in f] + list(tail)

    def decode_token(self, tid):
        return str(tid)


class FakeEmbedder:
    def embed(self, texts):
        return np.array([[1.0, 0.5, 0.25, 0.125]] * len(texts), dtype=np.float32)


class FakeReplicas:
    """The replicas' connectors: per replica its store's memory {tenant: set of fact ids},
    over one shared disk {tenant: set of fact ids}."""

    def __init__(self, urls, shared=True):
        self.disk = {}
        self.memory = {u: {} for u in urls}
        self.sent = []  # (url, kind, params)
        self.shared = shared

    def kind(self, p, body):
        if p.get("prefetch") and len(body["prompt"]) == 1:   # a request of its own (a chat may carry it too)
            return "prefetch"
        if p.get("capture"):
            return "capture"
        if p.get("remove") is not None:
            return "remove"
        return "chat"

    async def complete(self, url, body):
        p = body.get("kv_transfer_params", {}).get("kvinject", {})
        self.sent.append((url, self.kind(p, body), p))
        mem = self.memory[url]
        out = {"tenant": p.get("tenant"), "injected_facts": 0, "injected_tokens": 0, "captured": [], "removed": [],
               "errors": [], "pending": False}
        if p:
            t = p["tenant"]
            if p.get("prefetch") and self.shared:
                mem[t] = set(self.disk.get(t, ()))
            if p.get("remove") is not None:
                ids = set(mem.get(t, ())) if p["remove"] == "all" else set(p["remove"])
                out["removed"] = sorted(ids & mem.get(t, set()))
                mem.setdefault(t, set()).difference_update(ids)
                if self.shared:
                    self.disk.setdefault(t, set()).difference_update(ids)
            inject = [s[0] for s in p.get("inject") or []]
            if inject and t in mem:  # a tenant never seen is prefilled as text
                missing = [f for f in inject if f not in mem[t]]
                if missing:
                    out["errors"].append("Store.fact_tokens: no fact %d for tenant %d" % (missing[0], t))
            out["injected_facts"] = len(inject)
            for c in p.get("capture") or []:
                mem.setdefault(t, set()).add(c["fact_id"])
                if self.shared:
                    self.disk.setdefault(t, set()).add(c["fact_id"])
                out["captured"].append(c["fact_id"])
        return 200, {"id": "cmpl-1", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1},
                     "kv_transfer_params": {"kvinject": out}}

    def kinds(self, url=None):
        return [k for u, k, _ in self.sent if url is None or u == url]


A, B = "http://a:1", "http://b:1"


@pytest.fixture
def gateway(tmp_path):
    made = []

    def make(shared_disk=True, idle_prefetch_s=300.0, urls=(A, B)):
        cfg = GatewayConfig(model="m", replicas=list(urls), db=str(tmp_path / ("g%d.db" % len(made))),
                            shared_disk=shared_disk, idle_prefetch_s=idle_prefetch_s)
        svc = Service(cfg, Database(cfg.db), FakeLayout(), FakeEmbedder(), Metrics())
        fake = FakeReplicas(urls, shared=shared_disk)
        for r in svc.replicas.all.values():
            r.up, r.epoch, r.model_id, r.max_model_len = True, "e1", "m", 4096
        svc.replicas.complete = fake.complete
        made.append(svc)
        return svc, fake
    yield make
    for svc in made:
        asyncio.run(svc.replicas.client.aclose())
        svc.db.close()


def run(coro):
    return asyncio.run(coro)


async def chat(svc, user, q="what?"):
    return await svc.chat(parse_chat({"user": user, "messages": [{"role": "user", "content": q}]}, 5, 1000))


def metric(svc, name, **labels):
    return svc.m.registry.get_sample_value("kvinject_gateway_" + name, labels) or 0


def owner_of(svc, user):
    return ring.owner(svc.replicas.live(), svc.db.user(user).id)


def add(svc, user, *facts):
    return run(svc.add(user, list(facts), "facts"))


def test_a_users_first_chat_after_idle_asks_the_users_replica_to_prefetch(gateway):
    svc, fake = gateway(idle_prefetch_s=100.0)
    add(svc, "ann", "likes tea", "has a cat")
    own = owner_of(svc, "ann")
    tenant = svc.db.user("ann").id
    fake.sent.clear()
    res = run(chat(svc, "ann"))
    assert [f["fact_id"] for f in res["memory"]["facts"]] == [1, 2]
    # one request: the chat carries the prefetch (no request of its own to wait for)
    (url, kind, params), = fake.sent
    assert kind == "chat" and url == own
    assert params["tenant"] == tenant and params["prefetch"] is True and [s[0] for s in params["inject"]] == [0, 1, 2]
    assert metric(svc, "prefetches_total", why="idle", status="ok") == 1

    def prefetching():
        return [p.get("prefetch", False) for _, _, p in fake.sent]
    run(chat(svc, "ann"))  # not idle: no prefetch
    assert prefetching() == [True, False]
    svc._last_chat[tenant] -= 101  # idle for longer than idle_prefetch_s: back from idle
    run(chat(svc, "ann"))
    assert prefetching() == [True, False, True]
    # a user without memories has nothing to prefetch; idle_prefetch_s 0 never prefetches
    run(chat(svc, "nobody"))
    assert prefetching() == [True, False, True, False]
    # memory off: the prefetch after idle still goes, with the chat's request alone
    svc._last_chat[tenant] -= 101
    run(svc.chat(parse_chat({"user": "ann", "memory": False, "messages": [{"role": "user", "content": "q"}]},
                            5, 1000)))
    assert fake.sent[-1][2] == {"tenant": tenant, "prefetch": True}
    assert metric(svc, "prefetches_total", why="idle", status="ok") == 3
    svc2, fake2 = gateway(idle_prefetch_s=0.0)
    add(svc2, "ann", "likes tea")
    run(chat(svc2, "ann"))
    assert not any(p.get("prefetch") for _, _, p in fake2.sent)


def test_explicit_prefetch_of_a_user(gateway):
    svc, fake = gateway()
    add(svc, "bo", "plays chess")
    fake.sent.clear()
    out = run(svc.prefetch_user("bo"))
    assert out == {"user": "bo", "replica": owner_of(svc, "bo"), "memories": 1, "done": "prefetched"}
    assert fake.kinds() == ["prefetch"]
    assert metric(svc, "prefetches_total", why="explicit", status="ok") == 1
    with pytest.raises(ApiError) as e:
        run(svc.prefetch_user("nobody"))
    assert e.value.status == 404
    # through the HTTP route
    from fastapi.testclient import TestClient
    from kvinject.serve.app import create_app
    client = TestClient(create_app(svc))  # no lifespan: the fake replicas stay as they are
    r = client.post("/v1/memory/bo/prefetch")
    assert r.status_code == 200 and r.json()["done"] == "prefetched"
    assert client.post("/v1/memory/nobody/prefetch").status_code == 404
    assert fake.kinds() == ["prefetch", "prefetch"]


def test_writes_release_the_lease_with_a_shared_disk(gateway):
    svc, fake = gateway()
    add(svc, "cy", "owns a boat")
    (cap_params,) = [p for _, k, p in fake.sent if k == "capture"]
    assert cap_params["release"] is True
    svc2, fake2 = gateway(shared_disk=False)
    add(svc2, "cy", "owns a boat")
    assert all("release" not in p for _, _, p in fake2.sent)


def moved(svc, user):
    """Takes the user's owner down; returns (old owner, new owner)."""
    old = owner_of(svc, user)
    svc.replicas.all[old].up = False
    return old, owner_of(svc, user)


def test_a_moved_user_loads_from_the_shared_disk_instead_of_being_captured(gateway):
    svc, fake = gateway()
    add(svc, "dee", "likes jazz", "lives in Oslo")
    tenant = svc.db.user("dee").id
    old, new = moved(svc, "dee")
    assert new != old
    fake.sent.clear()
    res = run(chat(svc, "dee"))
    assert res["memory"]["replica"] == new and len(res["memory"]["facts"]) == 2
    assert fake.kinds(new) == ["prefetch", "chat"]  # no capture: the tenant file has the memory
    assert fake.memory[new][tenant] == {0, 1, 2}
    assert metric(svc, "prefetches_total", why="shared", status="ok") == 1
    assert svc.clean(svc.db.user("dee"), svc.replicas.all[new])
    # a memory added on the new owner, then the old one comes back: it reads the file anew
    add(svc, "dee", "has a dog")
    assert fake.kinds(new)[-1] == "capture"
    svc.replicas.all[old].up = True
    fake.sent.clear()
    res = run(chat(svc, "dee"))
    assert res["memory"]["replica"] == old and len(res["memory"]["facts"]) == 3
    assert fake.kinds(old) == ["prefetch", "chat"]
    assert metric(svc, "chat_retries_total", why="injection_failed") == 0


def test_without_a_shared_disk_a_moved_user_is_captured_again(gateway):
    svc, fake = gateway(shared_disk=False)
    add(svc, "eve", "likes jazz")
    old, new = moved(svc, "eve")
    fake.sent.clear()
    run(chat(svc, "eve"))
    assert fake.kinds(new) == ["capture", "chat"]


def test_a_failed_injection_distrusts_the_shared_file(gateway):
    svc, fake = gateway()
    add(svc, "fay", "likes jazz", "plays golf")
    tenant = svc.db.user("fay").id
    old, new = moved(svc, "fay")
    fake.disk[tenant] = set()  # the shared file lost the memory
    fake.memory[new][tenant] = set()  # and the new replica knows the tenant (so it injects, and fails)
    fake.sent.clear()
    res = run(chat(svc, "fay"))
    assert len(res["memory"]["facts"]) == 2
    # loaded from the file, the injection failed, every placement distrusted, captured again
    assert fake.kinds(new) == ["prefetch", "chat", "capture", "chat"]
    assert metric(svc, "chat_retries_total", why="injection_failed") == 1
    assert not svc.clean(svc.db.user("fay"), svc.replicas.all[old])


class SlowStream:
    """A replica's stream whose first event comes after ``delay`` seconds."""

    status = 200

    def __init__(self, delay):
        self.delay = delay

    async def events(self):
        await asyncio.sleep(self.delay)
        yield {"choices": [{"index": 0, "text": "ok", "finish_reason": None}]}
        await asyncio.sleep(self.delay)   # a later token: not the replica's time to first byte
        yield {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}]}

    async def close(self):
        pass


def test_overhead_is_the_chats_time_less_the_replicas(gateway):
    """kvinject_gateway_overhead_seconds: a chat's time to its answer (or, streamed, to its
    first chunk) less the answering replica's, through the real app. The replica takes
    80 ms (to its first event when streamed, and 80 ms more to its next); the gateway's
    own part is what is left, well below that (no prefetch after idle here: a waited-for
    prefetch request would be the gateway's)."""
    httpx = pytest.importorskip("httpx")
    from kvinject.serve.app import create_app
    svc, fake = gateway(idle_prefetch_s=0.0)
    add(svc, "ann", "likes tea", "has a cat")
    delay = 0.08
    inner = fake.complete

    async def slow_complete(url, body):
        await asyncio.sleep(delay)
        return await inner(url, body)

    async def slow_stream(url, body):
        await inner(url, body)
        return SlowStream(delay)

    svc.replicas.complete, svc.replicas.stream = slow_complete, slow_stream

    async def go():
        tr = httpx.ASGITransport(app=create_app(svc))
        async with httpx.AsyncClient(transport=tr, base_url="http://gw") as c:
            msg = {"user": "ann", "messages": [{"role": "user", "content": "what?"}]}
            t = time.perf_counter()
            r = await c.post("/v1/chat/completions", json=msg)
            plain_s = time.perf_counter() - t
            assert r.status_code == 200, r.text
            r = await c.post("/v1/chat/completions", json=dict(msg, stream=True))
            assert r.status_code == 200 and "[DONE]" in r.text, r.text
        return plain_s

    plain_s = run(go())
    for stream in ("false", "true"):
        assert metric(svc, "overhead_seconds_count", stream=stream) == 1
        over = metric(svc, "overhead_seconds_sum", stream=stream)
        total = metric(svc, "chat_seconds_sum", stream=stream)
        assert 0 <= over < delay / 2, (stream, over)
        # the replica's part is all of its answer (non-streamed), its first event alone (streamed)
        assert total - over >= (delay if stream == "false" else 2 * delay) - 0.005, (stream, total, over)
    assert plain_s >= delay


class CountingEmbedder:
    """Embeds text i as a row of its length, slowly, counting calls; "boom" fails its call."""

    def __init__(self, delay=0.05):
        self.delay, self.calls = delay, []

    def embed(self, texts):
        self.calls.append(list(texts))
        time.sleep(self.delay)
        if "boom" in texts:
            raise RuntimeError("the embedder broke")
        return np.array([[float(len(t)), 1.0, 0.0, 0.0] for t in texts], dtype=np.float32)


def test_queries_that_wait_for_the_embedder_go_together(gateway):
    svc, _ = gateway()
    emb = CountingEmbedder()
    svc._embedq.embedder = emb
    texts = ["a" * (i + 1) for i in range(9)]

    async def go():
        # the first call starts at once; the other eight arrive while it runs
        first = asyncio.ensure_future(svc.embed([texts[0]], "query"))
        await asyncio.sleep(0.01)
        rest = [asyncio.ensure_future(svc.embed([t], "query")) for t in texts[1:5]]
        rest.append(asyncio.ensure_future(svc.embed(texts[5:9], "facts")))   # a caller of several texts
        return await first, await asyncio.gather(*rest)

    one, rest = run(go())
    assert emb.calls == [texts[:1], texts[1:9]]
    assert one.shape == (1, 4) and one[0, 0] == 1
    for i, r in enumerate(rest[:4]):
        assert r.shape == (1, 4) and r[0, 0] == i + 2   # each caller gets its own rows
    assert rest[4].shape == (4, 4) and list(rest[4][:, 0]) == [6, 7, 8, 9]


def test_a_failed_embedder_call_fails_its_callers_only(gateway):
    svc, _ = gateway()
    emb = CountingEmbedder()
    svc._embedq.embedder = emb

    async def go():
        first = asyncio.ensure_future(svc.embed(["x"], "query"))
        await asyncio.sleep(0.01)
        bad = [asyncio.ensure_future(svc.embed([t], "query")) for t in ("y", "boom")]
        out = await asyncio.gather(first, *bad, return_exceptions=True)
        return out, await svc.embed(["after"], "query")

    (first, y, boom), after = run(go())
    assert first[0, 0] == 1
    for e in (y, boom):   # one call: both of its callers fail, with the gateway's error
        assert isinstance(e, ApiError) and e.status == 502 and "the embedder broke" in e.message, e
    assert after[0, 0] == 5 and len(emb.calls) == 3


def test_a_streamed_chat_frees_the_user_once_its_first_event_is_there(gateway):
    """The user's lock is held until the replica's first event, not through the answer:
    a second chat of the same user is sent while the first still streams."""
    svc, fake = gateway(idle_prefetch_s=0.0)
    add(svc, "ann", "likes tea")
    inner = fake.complete
    sent = []

    async def slow_stream(url, body):
        sent.append(time.perf_counter())
        await inner(url, body)
        return SlowStream(0.1)

    svc.replicas.stream = slow_stream

    async def one():
        it = await svc.chat(parse_chat({"user": "ann", "stream": True,
                                        "messages": [{"role": "user", "content": "what?"}]}, 5, 1000))
        return [c async for c in it]

    async def go():
        t = time.perf_counter()
        a, b = await asyncio.gather(one(), one())
        return t, a, b

    t, a, b = run(go())
    assert a and b and len(sent) == 2
    # the second was sent after the first's first event (0.1 s), before its end (0.2 s)
    assert 0.09 <= sent[1] - t < 0.19, [x - t for x in sent]
    assert not svc.lock(svc.db.user("ann").id).locked()
