"""The memory gateway (python -m kvinject.serve) in front of one ``vllm serve``
replica with the connector (fp32 store, a store file), both real processes on
127.0.0.1 started and stopped here.

    launch.py test_gateway.py [--keep DIR]

- 3 users add 20 memories each through the API (facts, then messages, then
  smaller adds: captures after what the replica holds);
- exact context: chats whose memory holds all of a user's facts (k = 8 of
  the first 8, k = 20 of 20) give plain vLLM's greedy tokens and logprobs
  (a /v1/completions of the same token ids, the facts as text, no
  kv_transfer_params), the ``memory`` field listing the facts injected;
- a stream gives the same text; k = 3 injects 3 facts in the order said;
- no user ever sees another's facts (chats' memory fields, search, list);
- bad requests get their 4xx with a message and never reach vLLM;
- /metrics counts the requests, captures and chats;
- a chat whose injection fails (the user's facts removed on the replica
  behind the gateway's back) is captured again and retried: the same answer;
- an OpenAI-compatible /v1/embeddings URL as the embedder (a stand-in server
  here) serves adds and searches;
- a capture the connector fails (a fact of that id already there) is a 502
  with its message, the add undone, the memory captured again on next use;
- deleting a memory re-encodes the later ones: a chat with the remaining 19
  equals plain vLLM with those 19 as text (and without re-encoding it does
  not: the control); in the replica's store file no fact is stale and none
  names the deleted one in its context (without re-encoding the later ones
  still do, kept by keep_dependents); deleting a user forgets every memory.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import common as C
import gateway_common as G

G.require_embedder()

USERS = ["alice", "bruno", "chen"]
QUESTION = "What is my favourite sport?"


@pytest.fixture(scope="module")
def replica(work_dir):
    t0 = time.time()
    srv = G.start_replica(work_dir, "replica")
    C.log("replica up in %.0f s" % (time.time() - t0))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def gateway(replica, work_dir):
    gw = G.Gateway([replica.url], os.path.join(work_dir, "gateway.db"), os.path.join(work_dir, "gateway.log"))
    C.log("gateway up in %.1f s" % gw.wait())
    yield gw
    gw.stop()
    C.log("gateway log (end):\n" + gw.log_text()[-1500:])


@pytest.fixture(scope="module")
def lay():
    return G.layout()


def ref_check(replica, lay, gw_chat, texts, question=QUESTION):
    ref = G.reference(replica, lay, texts, question)
    return G.same(ref, G.answer(gw_chat)), ref


@pytest.fixture(scope="module")
def added(gateway, replica, lay):
    """Every user's 20 facts, added in 4 requests each; alice's chat with her
    first 8 (all she has then) checked against plain vLLM on the way."""
    out = {u: [] for u in USERS}
    t0 = time.time()
    for u in USERS:
        fs = G.facts_of(u)
        r = gateway.ok("POST", "/v1/memories", {"user": u, "facts": fs[:8]})
        out[u] += r["results"]
    early = gateway.chat("alice", QUESTION, k=8)
    early_diff, _ = ref_check(replica, lay, early, G.facts_of("alice")[:8])
    for u in USERS:
        fs = G.facts_of(u)
        msgs = []
        for f in fs[8:14]:
            msgs += [{"role": "user", "content": f}, {"role": "assistant", "content": "Noted."}]
        out[u] += gateway.ok("POST", "/v1/memories", {"user": u, "messages": msgs})["results"]
        out[u] += gateway.ok("POST", "/v1/memories", {"user": u, "facts": fs[14:17]})["results"]
        out[u] += gateway.ok("POST", "/v1/memories", {"user": u, "facts": fs[17:]})["results"]
    C.log("60 memories added in %.1f s (12 requests)" % (time.time() - t0))
    return {"ids": out, "early": early, "early_diff": early_diff}


def test_memories_are_stored_in_order_per_user(gateway, added):
    seen = set()
    for u in USERS:
        got = gateway.ok("GET", "/v1/memories?user=" + u)["results"]
        assert [m["text"] for m in got] == G.facts_of(u)
        assert [m["fact_id"] for m in got] == list(range(1, 21))
        assert [m["id"] for m in got] == [m["id"] for m in added["ids"][u]]
        assert all(m["user"] == u for m in got)
        seen |= {m["id"] for m in got}
    assert len(seen) == 60


def test_exact_first_8_facts_equal_plain_vllm(added):
    assert added["early_diff"] is None, added["early_diff"]
    mem = added["early"]["memory"]
    assert [f["fact_id"] for f in mem["facts"]] == list(range(1, 9))


@pytest.fixture(scope="module")
def exact(gateway, replica, lay, added):
    out = {}
    for u in USERS:
        chat = gateway.chat(u, QUESTION, k=20)
        diff, ref = ref_check(replica, lay, chat, G.facts_of(u))
        C.log("  %s: %r (plain: %r)" % (u, chat["choices"][0]["message"]["content"], ref["text"]))
        out[u] = (chat, diff, ref)
    return out


@pytest.mark.parametrize("user", USERS)
def test_exact_all_20_facts_equal_plain_vllm(exact, user):
    chat, diff, _ = exact[user]
    assert diff is None, diff


@pytest.mark.parametrize("user", USERS)
def test_exact_memory_field_lists_the_injected_facts(exact, added, lay, user):
    mem = exact[user][0]["memory"]
    assert [f["id"] for f in mem["facts"]] == [m["id"] for m in added["ids"][user]]
    assert [f["text"] for f in mem["facts"]] == G.facts_of(user)
    assert mem["injected_tokens"] == len(lay.header) + sum(len(lay.fact_tokens(t)) for t in G.facts_of(user))
    assert exact[user][0]["object"] == "chat.completion"


def test_answers_differ_between_users(exact):
    # (this small model may answer all three alike: the logprobs differ)
    steps = {u: tuple(e["logprob"] for e in exact[u][0]["choices"][0]["logprobs"]["content"]) for u in USERS}
    assert len(set(steps.values())) == 3


def test_stream_gives_the_same_text_and_memory(gateway, exact):
    chunks = gateway.stream(G.chat_body("bruno", QUESTION, 20))
    text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c.get("choices", []))
    assert text == exact["bruno"][0]["choices"][0]["message"]["content"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["memory"]["facts"] == exact["bruno"][0]["memory"]["facts"]
    toks = [t for c in chunks for ch in c.get("choices", []) for t in (ch.get("token_ids") or [])]
    assert toks == exact["bruno"][0]["choices"][0]["token_ids"]


def test_k3_injects_3_facts_in_the_order_said(gateway, added):
    chat = gateway.chat("chen", "Which instrument do I play?", k=3)
    mem = chat["memory"]
    fids = [f["fact_id"] for f in mem["facts"]]
    assert len(fids) == 3 and fids == sorted(fids)
    assert mem["injected_tokens"] > 0
    assert "My musical instrument is the flute." in [f["text"] for f in mem["facts"]]
    search = gateway.ok("POST", "/v1/memories/search", {"user": "chen", "query": "Which instrument do I play?",
                                                        "k": 3})["results"]
    assert sorted(r["id"] for r in search) == sorted(f["id"] for f in mem["facts"])


def test_no_user_sees_another_users_facts(gateway, added, exact):
    own = {u: {m["id"] for m in added["ids"][u]} for u in USERS}
    for u in USERS:
        assert {f["id"] for f in exact[u][0]["memory"]["facts"]} <= own[u]
        for other in USERS:
            for q in G.VALUES[other][:6]:
                res = gateway.ok("POST", "/v1/memories/search", {"user": u, "query": q, "k": 5})["results"]
                assert {r["id"] for r in res} <= own[u], (u, q, res)
                assert all(r["user"] == u for r in res)
            chat = gateway.chat(u, "Tell me about %s." % G.VALUES[other][1], k=4, max_tokens=2)
            assert {f["id"] for f in chat["memory"]["facts"]} <= own[u]


def replica_requests(gateway) -> float:
    return sum(float(v) for v in re.findall(r"^kvinject_gateway_replica_requests_total\{[^}]*\} (\S+)$",
                                            gateway.metrics(), re.M))


BAD = [
    # (what, method, path, body or raw bytes, status, message part)
    ("no user", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "user"),
    ("user not a string", "POST", "/v1/chat/completions",
     {"user": 7, "messages": [{"role": "user", "content": "hi"}]}, 400, "user"),
    ("negative k", "POST", "/v1/chat/completions", G.chat_body("alice", "hi", -1), 400, "memory.k"),
    ("k too large", "POST", "/v1/chat/completions", G.chat_body("alice", "hi", 1001), 400, "memory.k"),
    ("k a string", "POST", "/v1/chat/completions", G.chat_body("alice", "hi", "3"), 400, "memory.k"),
    ("k a float", "POST", "/v1/chat/completions", G.chat_body("alice", "hi", 2.5), 400, "memory.k"),
    ("min_score a string", "POST", "/v1/chat/completions",
     dict(G.chat_body("alice", "hi"), memory={"k": 2, "min_score": "high"}), 400, "min_score"),
    ("memory a number", "POST", "/v1/chat/completions", dict(G.chat_body("alice", "hi"), memory=3), 400, "memory"),
    ("no messages", "POST", "/v1/chat/completions", {"user": "alice", "messages": []}, 400, "messages"),
    ("prompt too long", "POST", "/v1/chat/completions", G.chat_body("alice", "hello " * 1100, 20), 400,
     "max_model_len"),
    ("bad JSON", "POST", "/v1/chat/completions", b"{\"user\": ", 400, "JSON"),
    ("body too large", "POST", "/v1/memories", b"{\"user\": \"alice\", \"facts\": [\"" + b"a" * (1 << 20) + b"\"]}",
     413, "bytes"),
    ("empty fact", "POST", "/v1/memories", {"user": "alice", "facts": ["  "]}, 400, "empty"),
    ("fact too long", "POST", "/v1/memories", {"user": "alice", "facts": ["word " * 300]}, 400, "at most 256"),
    ("too many facts", "POST", "/v1/memories", {"user": "alice", "facts": ["x"] * 1001}, 400, "at most 1000"),
    ("facts not a list", "POST", "/v1/memories", {"user": "alice", "facts": "x"}, 400, "facts"),
    ("no facts", "POST", "/v1/memories", {"user": "alice", "facts": []}, 400, "no memories"),
    ("add without user", "POST", "/v1/memories", {"facts": ["x"]}, 400, "user"),
    ("list without user", "GET", "/v1/memories", None, 400, "user"),
    ("list of an unknown user", "GET", "/v1/memories?user=zoe", None, 404, "unknown user"),
    ("search of an unknown user", "POST", "/v1/memories/search", {"user": "zoe", "query": "x"}, 404, "unknown user"),
    ("search with a bad k", "POST", "/v1/memories/search", {"user": "alice", "query": "x", "k": -2}, 400, "k"),
    ("search without a query", "POST", "/v1/memories/search", {"user": "alice"}, 400, "query"),
    ("delete an unknown memory", "DELETE", "/v1/memories/999999", None, 404, "unknown memory"),
    ("delete a bad memory id", "DELETE", "/v1/memories/abc", None, 400, "memory id"),
    ("delete an unknown user", "DELETE", "/v1/memories?user=zoe", None, 404, "unknown user"),
    ("unknown route", "GET", "/v1/nothing", None, 404, ""),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_is_refused_before_vllm(gateway, added, case):
    what, method, path, body, status, part = case
    before = replica_requests(gateway)
    if isinstance(body, bytes):
        got, out = gateway.req(method, path, raw=body)
    else:
        got, out = gateway.req(method, path, body)
    assert got == status, "%s: HTTP %d %s" % (what, got, out)
    assert isinstance(out, dict) and isinstance(out.get("error"), dict), out
    msg = out["error"]["message"]
    assert msg and part.lower() in msg.lower(), msg
    assert "type" in out["error"] and "code" in out["error"]
    assert replica_requests(gateway) == before, "%s reached the replica" % what


def test_chat_of_a_user_without_memories_is_plain(gateway):
    chat = gateway.chat("nobody", QUESTION, k=5)
    assert chat["memory"]["facts"] == [] and chat["memory"]["injected_tokens"] == 0
    chat = gateway.chat("alice", QUESTION, memory=False)
    assert chat["memory"]["facts"] == []


def test_metrics_count_requests_captures_and_chats(gateway, exact):
    text = gateway.metrics()

    def val(name, **labels):
        total = 0.0
        for m in re.finditer(r"^%s(?:\{([^}]*)\})? (\S+)$" % re.escape(name), text, re.M):
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        return total

    assert val("kvinject_gateway_requests_total", route="/v1/memories", method="POST", status="200") >= 12
    assert val("kvinject_gateway_requests_total", route="/v1/chat/completions", status="200") >= 4
    assert val("kvinject_gateway_requests_total", route="/v1/chat/completions", status="400") >= 9
    assert val("kvinject_gateway_captures_total") >= 12
    assert val("kvinject_gateway_captured_facts_total") >= 60
    assert val("kvinject_gateway_capture_failures_total") == 0
    assert val("kvinject_gateway_injected_facts_total") >= 68
    assert val("kvinject_gateway_replica_up") == 1
    assert val("kvinject_gateway_chat_seconds_count") >= 4
    assert val("kvinject_gateway_retrieval_seconds_count") >= 4
    assert val("kvinject_gateway_embedding_seconds_count", what="query") >= 4
    assert val("kvinject_gateway_facts") == 60


def test_failed_injection_is_captured_again_and_retried(gateway, replica, exact):
    """bruno's facts removed on the replica behind the gateway's back: the
    chat's injection fails, the gateway captures bruno's memory again and the
    retry answers as before."""
    tenant = gateway.ok("GET", "/v1/memories?user=bruno")["tenant"]
    out = replica.post("/v1/completions", {"model": replica.model, "prompt": [1], "max_tokens": 2, "min_tokens": 2,
                                           "kv_transfer_params": {"kvinject": {"tenant": tenant, "remove": "all"}}})
    assert len(out["kv_transfer_params"]["kvinject"]["removed"]) == 21, out["kv_transfer_params"]
    chat = gateway.chat("bruno", QUESTION, k=20)
    diff = G.same(G.answer(exact["bruno"][0]), G.answer(chat))
    assert diff is None, diff
    m = re.search(r'^kvinject_gateway_chat_retries_total\{why="injection_failed"\} (\S+)$', gateway.metrics(), re.M)
    assert m and float(m.group(1)) == 1, "no retry counted"


def test_failed_capture_is_a_502_and_the_add_is_undone(gateway, replica, lay, exact):
    """A fact with the id of chen's next one put on the replica behind the
    gateway's back: the add's capture (replace false) fails, the gateway answers
    502 with the connector's message and forgets the add; chen's next chat
    captures the memory again (removing the stray fact) and answers as before."""
    from kvinject.vllm import Keep, capture_prompt
    tenant = gateway.ok("GET", "/v1/memories?user=chen")["tenant"]
    stray = capture_prompt(tenant, [lay.header, Keep(21, lay.fact_tokens("I hate the flute."))])
    out = replica.post("/v1/completions", {"model": replica.model, "prompt": stray.prompt_token_ids, "max_tokens": 2,
                                           "min_tokens": 2, "kv_transfer_params": stray.kv_transfer_params})
    assert out["kv_transfer_params"]["kvinject"]["captured"] == [21]
    status, err = gateway.req("POST", "/v1/memories", {"user": "chen", "facts": ["I have a new bike."]})
    assert status == 502, (status, err)
    assert "capture" in err["error"]["message"] and "21" in err["error"]["message"], err
    listed = gateway.ok("GET", "/v1/memories?user=chen")["results"]
    assert [m["text"] for m in listed] == G.facts_of("chen")
    chat = gateway.chat("chen", QUESTION, k=20)
    diff = G.same(G.answer(exact["chen"][0]), G.answer(chat))
    assert diff is None, diff


def replica_store(work_dir, fact_ids):
    """The replica's store file loaded on the CPU, and the tenants whose facts are the
    header (0) and ``fact_ids`` (users' fact ids are alike: several may match)."""
    import transformers
    import kvinject as kvi
    from kvinject.hf.config import store_model
    model = store_model(transformers.AutoConfig.from_pretrained(C.MODEL))
    store = kvi.Store.load(model, os.path.join(work_dir, "replica.kvi"), 256 << 20, backend=kvi.Backend.CPU,
                           dtype=kvi.DType.FP32)
    found = [t for t in range(1, 64) if store.list(t) == sorted([0] + list(fact_ids))]
    assert found, "no tenant of the replica's store holds facts %s" % sorted(fact_ids)
    return store, found


def test_delete_reencodes_the_later_facts(gateway, replica, lay, added, work_dir):
    victim = added["ids"]["alice"][4]        # fact 5
    r = gateway.ok("DELETE", "/v1/memories/%d" % victim["id"])
    assert r["deleted"] == victim["id"] and r["fact_id"] == 5
    assert r["reencoded"] == [m["id"] for m in added["ids"]["alice"][5:]]
    assert r["removed_from"] == [replica.url]
    left = gateway.ok("GET", "/v1/memories?user=alice")["results"]
    assert victim["id"] not in {m["id"] for m in left} and len(left) == 19
    # the replica's store (the connector's contexts): no fact is stale, none was computed after fact 5
    store, tenants = replica_store(work_dir, [m["fact_id"] for m in left])
    assert any(all(5 not in store.fact_context(t, m["fact_id"])[0] for m in left) for t in tenants)  # alice's
    for t in tenants:
        assert store.stale(t) == []
        for m in left:
            ctx, stale = store.fact_context(t, m["fact_id"])
            assert not stale and 0 in ctx and ctx == sorted(ctx), (m, ctx)
    store.close()
    texts = [t for i, t in enumerate(G.facts_of("alice")) if i != 4]
    chat = gateway.chat("alice", QUESTION, k=20)
    assert [f["text"] for f in chat["memory"]["facts"]] == texts
    diff, _ = ref_check(replica, lay, chat, texts)
    assert diff is None, diff
    status, _ = gateway.req("DELETE", "/v1/memories/%d" % victim["id"])
    assert status == 404


def test_delete_without_reencoding_differs_from_plain_control(gateway, replica, lay, added, work_dir):
    victim = added["ids"]["bruno"][4]
    r = gateway.ok("DELETE", "/v1/memories/%d?reencode=false" % victim["id"])
    assert r["reencoded"] == []
    # removed with keep_dependents: the later facts keep their KV, computed after fact 5, and are not stale
    left = gateway.ok("GET", "/v1/memories?user=bruno")["results"]
    store, tenants = replica_store(work_dir, [m["fact_id"] for m in left])  # alice's and bruno's
    assert all(store.stale(t) == [] for t in tenants)
    assert any(5 in store.fact_context(t, m["fact_id"])[0] for t in tenants for m in left)  # bruno's 6..8
    store.close()
    texts = [t for i, t in enumerate(G.facts_of("bruno")) if i != 4]
    chat = gateway.chat("bruno", QUESTION, k=20)
    diff, _ = ref_check(replica, lay, chat, texts)
    assert diff is not None, "later facts encoded with the deleted one in context gave plain vLLM's logprobs"


def gateway_replica_url(gateway):
    return gateway.ok("GET", "/health")["replicas"][0]["url"]


def test_delete_user_forgets_everything(gateway, added):
    r = gateway.ok("DELETE", "/v1/memories?user=chen")
    assert r["deleted"] == 20 and r["removed_from"] == [gateway_replica_url(gateway)]
    status, out = gateway.req("GET", "/v1/memories?user=chen")
    assert status == 404, out
    chat = gateway.chat("chen", "Which instrument do I play?", k=5)
    assert chat["memory"]["facts"] == []
    for mid in (m["id"] for m in added["ids"]["chen"]):
        assert gateway.req("GET", "/v1/memories/%d" % mid)[0] == 404


class _Embeddings(BaseHTTPRequestHandler):
    """A stand-in /v1/embeddings: bags of hashed lower-case words, 64 values."""
    seen = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Embeddings.seen.append((self.path, body.get("model"), len(body["input"])))
        data = []
        for i, text in enumerate(body["input"]):
            v = [0.0] * 64
            for w in re.findall(r"[a-z]+", text.lower()):
                v[hashlib.sha256(w.encode()).digest()[0] % 64] += 1.0
            data.append({"object": "embedding", "index": i, "embedding": v})
        out = json.dumps({"object": "list", "data": data, "model": body.get("model")}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


def test_an_embeddings_url_as_the_embedder(replica, work_dir, added):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Embeddings)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    gw = G.Gateway([replica.url], os.path.join(work_dir, "gateway-http.db"), os.path.join(work_dir, "gateway-http.log"),
                   extra=["--embedder", "http://127.0.0.1:%d" % srv.server_address[1], "--embedder-model", "bow"])
    try:
        gw.wait()
        gw.ok("POST", "/v1/memories", {"user": "dora", "facts": ["My cat sleeps on the sofa.", "I drive a truck.",
                                                                 "Lunch is at noon."]})
        res = gw.ok("POST", "/v1/memories/search", {"user": "dora", "query": "where does the cat sleep", "k": 1})
        assert [r["text"] for r in res["results"]] == ["My cat sleeps on the sofa."]
        chat = gw.chat("dora", "What do I drive? A truck?", k=1, max_tokens=2)
        assert [f["text"] for f in chat["memory"]["facts"]] == ["I drive a truck."]
        assert chat["memory"]["injected_tokens"] > 0
        assert ("/v1/embeddings", "bow", 3) in _Embeddings.seen
    finally:
        gw.stop()
        srv.shutdown()
