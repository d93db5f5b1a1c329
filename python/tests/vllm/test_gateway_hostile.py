"""The memory gateway (python -m kvinject.serve) against a hostile client:
one ``vllm serve`` replica with the connector and the gateway, started once
for the module, everything through HTTP.

    launch.py test_gateway_hostile.py [--keep DIR]

After every test the gateway and the replica still answer /health (nothing
crashed), and:

- oversized bodies (with a Content-Length, and chunked without one) are 413
  and store nothing; deeply nested JSON, non-object JSON, invalid UTF-8,
  lone surrogates and a wrong type in every field of the memory, search and
  chat requests are 400 with a message, and bad memory ids are 400;
- an add over --max-facts-per-add (here 200) is 400 and stores nothing; one
  at the limit stores all of its facts; one with a bad fact among many
  stores none;
- another user's memory ids: a GET or DELETE claiming another user (?user=)
  is 404 and deletes nothing; search and chats as one user never return or
  inject another's facts; names that look like SQL are only names;
- concurrent adds, deletes and chats of one user (20 operations): every
  operation succeeds, the memory listed afterwards is the model (seeded +
  acknowledged adds - acknowledged deletes), no chat injects a fact whose
  delete was acknowledged before the chat was sent or a fact never
  acknowledged, and a final exact-context chat equals plain vLLM with the
  remaining facts as text;
- the replica SIGKILLed while an add of 200 facts is being captured: the add
  is answered 5xx (never 200) and stores nothing; after a new replica comes
  up on the same port and store file, every acknowledged memory is listed and
  chats inject exactly (the gateway captures again);
- a client that hangs up mid-add (all or nothing) or mid-stream leaves the
  user's lock free: the next add and a chat are answered, the chat the same
  as another user's with the same memory added by a client that waited.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import random
import re
import signal
import threading
import time

import httpx
import pytest

import common as C
import gateway_common as G
from servers import start_vllm_serve

G.require_embedder()

MAX_FACTS = 200


def start_replica(work_dir, port=None):
    # a larger store than gateway_common's: 200 facts of one add, plus the other users
    return start_vllm_serve(C.MODEL, port, {"store_dtype": "fp32", "store_budget_mb": 512,
                                            "store_path": os.path.join(work_dir, "replica.kvi")},
                            log_path=os.path.join(work_dir, "replica.log"), env=G.REPLICA_ENV, timeout=400)


@pytest.fixture(scope="module")
def rep(work_dir):
    """{"srv": the replica now} (test_replica_killed_mid_capture replaces it)."""
    t0 = time.time()
    holder = {"srv": start_replica(work_dir)}
    C.log("replica up in %.0f s" % (time.time() - t0))
    yield holder
    holder["srv"].stop()


@pytest.fixture(scope="module")
def gateway(rep, work_dir):
    gw = G.Gateway([rep["srv"].url], os.path.join(work_dir, "gateway.db"), os.path.join(work_dir, "gateway.log"),
                   extra=["--max-facts-per-add", str(MAX_FACTS)])
    C.log("gateway up in %.1f s" % gw.wait())
    yield gw
    gw.stop()
    log = gw.log_text()
    C.log("gateway log (end):\n" + log[-1500:])


@pytest.fixture(scope="module")
def lay():
    return G.layout()


@pytest.fixture(autouse=True)
def still_alive(gateway, rep):
    yield
    assert gateway.process.poll() is None, "the gateway exited: %s" % gateway.log_text()[-3000:]
    assert rep["srv"].running(), "the replica exited: %s" % rep["srv"].log_text(3000)
    st, h = gateway.req("GET", "/health")
    assert st == 200 and h["status"] == "ok", (st, h)
    assert rep["srv"].request("GET", "/health")[0] == 200
    assert "Traceback" not in gateway.log_text(), gateway.log_text()[-4000:]


def is_error(status, out, want=400):
    assert status == want, (status, out)
    assert isinstance(out, dict) and isinstance(out.get("error"), dict), out
    msg = out["error"].get("message")
    assert isinstance(msg, str) and msg and "internal error" not in msg, out
    return msg


def unknown_user(gateway, name):
    st, out = gateway.req("GET", "/v1/memories", params={"user": name})
    return st == 404


# ------------------------------------------------------------------ bodies


def test_oversized_bodies_are_413_and_store_nothing(gateway):
    big = json.dumps({"user": "big", "facts": ["x" * (1 << 20)]}).encode()
    is_error(*gateway.req("POST", "/v1/memories", raw=big), want=413)
    big_chat = json.dumps(G.chat_body("big", "y" * (1 << 20))).encode()
    is_error(*gateway.req("POST", "/v1/chat/completions", raw=big_chat), want=413)

    # chunked, no Content-Length: the limit is counted as the body comes
    def chunks():
        yield b'{"user": "big", "facts": ["'
        for _ in range(24):
            yield b"z" * 65536
        yield b'"]}'
    r = gateway.client.post(gateway.url + "/v1/memories", content=chunks(),
                            headers={"Content-Type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 413, (r.status_code, r.text[:300])
    assert unknown_user(gateway, "big")
    # a body just under the limit with a fact over --max-fact-tokens: 400, nothing stored
    is_error(*gateway.req("POST", "/v1/memories", {"user": "big", "facts": ["word " * 2000]}))
    assert unknown_user(gateway, "big")


def test_malformed_json_is_400(gateway):
    deep = b"[" * 100000 + b"]" * 100000
    deep_obj = b'{"user": "deep", "facts": ' + deep + b"}"
    deep_dict = b'{"a":' * 50000 + b"1" + b"}" * 50000
    bodies = [deep, deep_obj, deep_dict, b"", b"   ", b"{", b'{"user": "x", "facts": ["a"]', b"\xff\xfe{}",
              b'{"user": "x", "facts": ["\xc3\x28"]}', b"[]", b"[1, 2]", b'"a string"', b"42", b"null", b"true",
              b'{"user": "\\ud800", "facts": ["a"]}', b'{"user": "x", "facts": ["\\udc00 lone"]}',
              b'{"user": "x", "query": "\\ud800", "k": 1}', b'{"user": "x", "query": "q", "k": NaN}',
              b'{"user": "x", "query": "q", "k": Infinity}']
    for path in ("/v1/memories", "/v1/memories/search", "/v1/chat/completions"):
        for b in bodies:
            st, out = gateway.req("POST", path, raw=b)
            assert st == 400, (path, b[:60], st, out)
            is_error(st, out)
    chat_sur = json.dumps(G.chat_body("x", "hi"))[:-1].encode() + b', "user": "\\udbff"}'
    is_error(*gateway.req("POST", "/v1/chat/completions", raw=chat_sur))
    msg_sur = json.dumps(G.chat_body("x", "PLACEHOLDER")).replace("PLACEHOLDER", "\\ud83d").encode()
    is_error(*gateway.req("POST", "/v1/chat/completions", raw=msg_sur))
    for name in ("deep", "x"):
        assert unknown_user(gateway, name)


def wrong_types():
    """(path, body) pairs, each with one field of a wrong type or value."""
    add, search = "/v1/memories", "/v1/memories/search"
    chat = "/v1/chat/completions"
    out = []
    for u in (None, "", 5, 1.5, True, ["alice"], {"n": "alice"}, "u" * 300):
        out += [(add, {"user": u, "facts": ["a"]}), (search, {"user": u, "query": "q"}),
                (chat, G.chat_body(u, "hi"))]
    for f in ("a fact", {"0": "a"}, 5, None, True, [], [1], [""], ["   "], [None], [["a"]], [{"text": "a"}], [True]):
        out.append((add, {"user": "wt", "facts": f}))
    for m in ("hi", {"role": "user"}, 5, [], [1], ["hi"], [{"role": 1, "content": "a"}], [{"content": "a"}],
              [{"role": "user", "content": 5}], [{"role": "user", "content": None}],
              [{"role": "user", "content": ["a"]}],
              [{"role": "assistant", "content": "no user message here"}]):
        out.append((add, {"user": "wt", "messages": m}))
    out += [(add, {"user": "wt"}), (add, {"user": "wt", "facts": ["a"], "messages": []})]
    for q in (None, "", "  ", 5, ["q"], {"q": 1}):
        out.append((search, {"user": "wt", "query": q}))
    for k in ("3", 3.5, True, -1, 10 ** 7, None, [3], 1e300):
        out.append((search, {"user": "wt", "query": "q", "k": k}))
    for ms in ("x", True, [1], {"a": 1}):
        out.append((search, {"user": "wt", "query": "q", "min_score": ms}))
    for m in (None, "hi", 5, [], [1], [{"role": "bad", "content": "a"}], [{"role": "user", "content": 5}],
              [{"role": "user"}], [{"role": "assistant", "content": "hi"}], [{"role": ["user"], "content": "a"}]):
        b = G.chat_body("wt", "hi")
        b["messages"] = m
        out.append((chat, b))
    for key, vals in (("memory", ["yes", 1, 0.5, [], {"k": "3"}, {"k": -1}, {"k": 10 ** 7}, {"k": True},
                                  {"zz": 1}, {"min_score": "x"}, {"min_score": [1]}]),
                      ("stream", ["yes", 1, "true"]), ("max_tokens", ["5", 0, -3, 1.5, True, [5]]),
                      ("max_completion_tokens", ["5", 0]), ("logprobs", ["yes", 1, [True]]),
                      ("top_logprobs", [50, "3", -1, 2.5]), ("n", ["2", 100, 0, True]), ("model", [5, ["m"], {}]),
                      ("temperature", ["hot", [1]]), ("seed", ["s"]), ("top_p", ["all"]),
                      ("stop", [5, {"a": 1}])):
        for v in vals:
            b = G.chat_body("wt", "hi")
            b[key] = v
            if key == "top_logprobs":
                b["logprobs"] = True
            out.append((chat, b))
    b = G.chat_body("wt", "hi", logprobs=False)
    out.append((chat, b))           # top_logprobs without logprobs
    b = G.chat_body("wt", "hi", max_tokens=5000)
    out.append((chat, b))           # over max_model_len
    return out


def test_wrong_types_in_every_field_are_400(gateway):
    seen = 0
    for path, body in wrong_types():
        st, out = gateway.req("POST", path, body)
        assert 400 <= st < 500 and st != 404, (path, body, st, out)
        is_error(st, out, st)
        seen += 1
    assert seen > 100
    assert unknown_user(gateway, "wt")
    # memory ids and query parameters
    for mid in ("abc", "-1", "1.5", "\u00b2", "\u0661", "99999999999999999999", "1e3", "%20", "0x1"):
        for method in ("GET", "DELETE"):
            st, out = gateway.req(method, "/v1/memories/" + mid)
            assert st in (400, 404), (method, mid, st, out)
            is_error(st, out, st)
    is_error(*gateway.req("DELETE", "/v1/memories/1", params={"reencode": "maybe"}))
    for params in ({}, {"user": ""}):
        is_error(*gateway.req("GET", "/v1/memories", params=params))
        is_error(*gateway.req("DELETE", "/v1/memories", params=params))


# ------------------------------------------------------------ many facts


def test_over_the_facts_limit_is_400_and_at_the_limit_all_stored(gateway):
    facts = ["Note %d: the code is %d." % (i, 1000 + i) for i in range(MAX_FACTS + 1)]
    msg = is_error(*gateway.req("POST", "/v1/memories", {"user": "many", "facts": facts}))
    assert str(MAX_FACTS) in msg
    assert unknown_user(gateway, "many")
    msgs = [{"role": "user", "content": f} for f in facts]
    is_error(*gateway.req("POST", "/v1/memories", {"user": "many", "messages": msgs}))
    assert unknown_user(gateway, "many")
    bad = list(facts[:MAX_FACTS])
    bad[150] = 150
    is_error(*gateway.req("POST", "/v1/memories", {"user": "many", "facts": bad}))
    bad[150] = ""
    is_error(*gateway.req("POST", "/v1/memories", {"user": "many", "facts": bad}))
    assert unknown_user(gateway, "many")
    t0 = time.time()
    got = gateway.ok("POST", "/v1/memories", {"user": "many", "facts": facts[:MAX_FACTS]})
    C.log("an add of %d facts in %.1f s" % (MAX_FACTS, time.time() - t0))
    assert [m["text"] for m in got["results"]] == facts[:MAX_FACTS]
    listed = gateway.ok("GET", "/v1/memories?user=many")["results"]
    assert [m["id"] for m in listed] == [m["id"] for m in got["results"]]
    assert [m["fact_id"] for m in listed] == list(range(1, MAX_FACTS + 1))
    ch = gateway.chat("many", "What is the code of note 17?", k=5)
    assert len(ch["memory"]["facts"]) == 5
    assert {f["id"] for f in ch["memory"]["facts"]} <= {m["id"] for m in listed}


# ------------------------------------------------------ other users' ids


def test_another_users_ids_neither_read_nor_deleted_nor_injected(gateway):
    a = gateway.ok("POST", "/v1/memories", {"user": "ann", "facts": G.facts_of("alice", 4)})["results"]
    b = gateway.ok("POST", "/v1/memories", {"user": "ben", "facts": G.facts_of("bruno", 4)})["results"]
    a_ids, b_ids = {m["id"] for m in a}, {m["id"] for m in b}
    for m in b:
        # claiming ann: not found, nothing deleted
        is_error(*gateway.req("GET", "/v1/memories/%d" % m["id"], params={"user": "ann"}), want=404)
        is_error(*gateway.req("DELETE", "/v1/memories/%d" % m["id"], params={"user": "ann"}), want=404)
        is_error(*gateway.req("DELETE", "/v1/memories/%d" % m["id"], params={"user": "ann", "reencode": "false"}),
                 want=404)
        assert gateway.ok("GET", "/v1/memories/%d" % m["id"], params={"user": "ben"})["user"] == "ben"
    assert [m["id"] for m in gateway.ok("GET", "/v1/memories?user=ben")["results"]] == [m["id"] for m in b]
    for q in G.facts_of("bruno", 4) + ["kiwi Oslo skiing Volvo"]:
        res = gateway.ok("POST", "/v1/memories/search", {"user": "ann", "query": q, "k": 1000})["results"]
        assert {r["id"] for r in res} <= a_ids and all(r["user"] == "ann" for r in res)
    for q in ("What is my favourite fruit? Is it kiwi?", "Tell me about Oslo and skiing."):
        mem = gateway.chat("ann", q, k=20)["memory"]
        assert {f["id"] for f in mem["facts"]} == a_ids, mem
    # names that are SQL, patterns, or another name with a twist are only names
    for name in ("ann' OR '1'='1", "%", "ann%", "_nn", "ANN", "ann ", " ann", "ann\x00", "ann\u200b"):
        assert unknown_user(gateway, name), name
        res = gateway.req("POST", "/v1/memories/search", {"user": name, "query": "fruit", "k": 10})
        assert res[0] == 404, (name, res)
        mem = gateway.chat(name, "What is my favourite fruit?", k=20)["memory"]
        assert mem["facts"] == [], (name, mem)
    # ann deletes her own by id, with and without claiming herself: ben's are untouched
    gateway.ok("DELETE", "/v1/memories/%d" % a[0]["id"], params={"user": "ann"})
    gateway.ok("DELETE", "/v1/memories/%d" % a[1]["id"])
    assert [m["id"] for m in gateway.ok("GET", "/v1/memories?user=ben")["results"]] == [m["id"] for m in b]
    assert [m["id"] for m in gateway.ok("GET", "/v1/memories?user=ann")["results"]] == [m["id"] for m in a[2:]]
    assert b_ids.isdisjoint(a_ids)


# ------------------------------------------------------------ concurrency


def test_concurrent_adds_deletes_and_chats_of_one_user(gateway, rep, lay):
    seeded = gateway.ok("POST", "/v1/memories", {"user": "conc", "facts": G.facts_of("chen", 8)})["results"]
    seed_ids = [m["id"] for m in seeded]
    extra = ["My neighbour's %s is %s." % (t, v) for t, v in zip(G.TOPICS[:6], G.VALUES["bruno"][:6])]
    questions = ["What is my favourite fruit?", "Where is my home town?", "What sport do I like?",
                 "What car do I drive?", "What is my pet called?", "What colour do I like?", "What is my job?",
                 "What book do I like?", "Who is my best friend?"]
    ops = [("add", t) for t in extra] + [("delete", i) for i in seed_ids[:5]] + [("chat", q) for q in questions]
    random.Random(7).shuffle(ops)
    lock = threading.Lock()
    record = []
    local = threading.local()

    def client():
        if not hasattr(local, "c"):
            local.c = httpx.Client(timeout=300)
        return local.c

    def run(i, op):
        time.sleep(0.05 * i)
        kind, arg = op
        if kind == "add":
            req = ("POST", "/v1/memories", {"user": "conc", "facts": [arg]})
        elif kind == "delete":
            req = ("DELETE", "/v1/memories/%d" % arg, None)
        else:
            req = ("POST", "/v1/chat/completions", G.chat_body("conc", arg, k=20))
        t_send = time.monotonic()
        r = client().request(req[0], gateway.url + req[1], json=req[2])
        t_ack = time.monotonic()
        with lock:
            record.append({"kind": kind, "arg": arg, "send": t_send, "ack": t_ack, "status": r.status_code,
                           "out": r.json()})

    t0 = time.time()
    with cf.ThreadPoolExecutor(8) as ex:
        for f in [ex.submit(run, i, op) for i, op in enumerate(ops)]:
            f.result()
    C.log("%d concurrent operations in %.1f s" % (len(ops), time.time() - t0))
    bad = [r for r in record if r["status"] != 200]
    assert not bad, bad
    added = {r["out"]["results"][0]["id"]: r for r in record if r["kind"] == "add"}
    deleted = {r["arg"]: r for r in record if r["kind"] == "delete"}
    model = (set(seed_ids) | set(added)) - set(deleted)
    listed = gateway.ok("GET", "/v1/memories?user=conc")["results"]
    assert {m["id"] for m in listed} == model
    assert [m["fact_id"] for m in listed] == sorted(m["fact_id"] for m in listed)
    texts = {m["id"]: m["text"] for m in seeded}
    texts.update({i: r["arg"] for i, r in added.items()})
    for r in record:
        if r["kind"] != "chat":
            continue
        ids = [f["id"] for f in r["out"]["memory"]["facts"]]
        assert set(ids) <= set(seed_ids) | set(added), r["out"]["memory"]
        gone = {i for i, d in deleted.items() if d["ack"] < r["send"]}
        assert not gone & set(ids), ("a chat injected a memory deleted before it was sent", ids, gone)
        assert all(f["text"] == texts[f["id"]] for f in r["out"]["memory"]["facts"])
        fids = [f["fact_id"] for f in r["out"]["memory"]["facts"]]
        assert fids == sorted(fids)
    C.log("the chats injected %s memories (in the order sent)" % [len(r["out"]["memory"]["facts"]) for r in
                                                                sorted(record, key=lambda r: r["send"])
                                                                if r["kind"] == "chat"])
    # the final exact-context chat: all remaining facts, against plain vLLM with them as text
    question = "What is my favourite fruit?"
    final = gateway.chat("conc", question, k=20)
    assert [f["id"] for f in final["memory"]["facts"]] == [m["id"] for m in listed]
    ref = G.reference(rep["srv"], lay, [m["text"] for m in listed], question)
    diff = G.same(ref, G.answer(final))
    assert diff is None, diff


# --------------------------------------------------- clients that go away


def test_clients_that_hang_up(gateway, rep, lay):
    """A client that hangs up mid-add and one that hangs up mid-stream: the
    add is all or nothing, the user's lock is released (the next add and chat
    are answered), and the chat equals another user's with the same memory
    added by a client that waited for its answers."""
    facts = ["Quitter note %d: the locker code is %d." % (i, 300 + i) for i in range(40)]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(gateway.url + "/v1/memories", json={"user": "quitter", "facts": facts}, timeout=0.5)
    n, stable, t0 = -1, 0, time.monotonic()
    while stable < 6 and time.monotonic() - t0 < 120:      # the add finishes (or not) in the background
        time.sleep(0.5)
        st, out = gateway.req("GET", "/v1/memories", params={"user": "quitter"})
        m = len(out["results"]) if st == 200 else 0
        stable, n = (stable + 1, m) if m == n else (0, m)
    assert n in (0, len(facts)), "a hung-up add stored %d of its %d facts" % (n, len(facts))
    C.log("an add whose client hung up stored %d of %d facts" % (n, len(facts)))
    # a stream the client drops after its first event
    body = G.chat_body("quitter", "Tell me a long story about my lockers.", k=40, max_tokens=100, ignore_eos=True)
    with gateway.client.stream("POST", gateway.url + "/v1/chat/completions", json=dict(body, stream=True)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    t1 = time.monotonic()
    # the dropped stream's request ends on the replica (vLLM aborts it when the gateway closes
    # its upstream): the next capture runs alone, as the exact comparison below needs (bf16
    # kernels on the CPU give other last bits in a batch with another request)
    while time.monotonic() - t1 < 60:
        st, text = rep["srv"].request("GET", "/metrics")
        running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", str(text), re.M)
        if running is None or float(running.group(1)) == 0:
            break
        time.sleep(0.1)
    C.log("the dropped stream ran on the replica %.1f s more" % (time.monotonic() - t1))
    t1 = time.monotonic()
    more = gateway.ok("POST", "/v1/memories", {"user": "quitter", "facts": ["My locker is number 12."]})["results"]
    C.log("the next add of the user answered %.1f s after its stream was dropped" % (time.monotonic() - t1))
    listed = gateway.ok("GET", "/v1/memories?user=quitter")["results"]
    assert listed[-1]["id"] == more[0]["id"] and len(listed) == n + 1
    question = "What is my locker number?"
    ch = gateway.chat("quitter", question, k=60)
    assert [f["id"] for f in ch["memory"]["facts"]] == [m["id"] for m in listed]
    # the same memory added by a client that waits for its answers
    texts = [m["text"] for m in listed]
    gateway.ok("POST", "/v1/memories", {"user": "steady", "facts": texts[:-1]})
    gateway.ok("POST", "/v1/memories", {"user": "steady", "facts": texts[-1:]})
    steady = gateway.chat("steady", question, k=60)
    assert len(steady["memory"]["facts"]) == len(texts)
    diff = G.same(G.answer(steady), G.answer(ch))
    assert diff is None, ("the memory a hung-up client left answers otherwise", diff)
    plain = G.same(G.reference(rep["srv"], lay, texts, question), G.answer(ch))
    C.log("%d memories (%d tokens) against plain vLLM: %s" % (len(texts), ch["memory"]["injected_tokens"],
                                                              plain or "the same"))
    # the last fact was added after the other 40 (past half the replica's context): captured
    # after all of them, its KV is what a plain prefill computes, so the chat is plain vLLM's
    assert plain is None, ("%d memories added in two adds answer otherwise than plain vLLM" % len(texts), plain)


# ------------------------------------------------------- a replica killed


def captures(gateway):
    return sum(float(v) for v in re.findall(r"^\w*captures_total\{[^}]*\} (\S+)$", gateway.metrics(), re.M))


def test_replica_killed_mid_capture(gateway, rep, lay, work_dir):
    kept = gateway.ok("POST", "/v1/memories", {"user": "victim", "facts": G.facts_of("alice", 5)})["results"]
    before = {u: [m["id"] for m in gateway.ok("GET", "/v1/memories?user=" + u)["results"]]
              for u in ("victim", "many", "ann", "ben", "conc", "quitter")}
    facts = ["Victim note %d: the door code is %d." % (i, 5000 + i) for i in range(MAX_FACTS)]
    n0 = captures(gateway)
    res = {}

    def add():
        try:
            res["r"] = gateway.req("POST", "/v1/memories", {"user": "victim", "facts": facts})
        except Exception as e:  # noqa: BLE001 - recorded, checked below
            res["e"] = e
    th = threading.Thread(target=add)
    th.start()
    t0 = time.monotonic()
    while captures(gateway) == n0 and time.monotonic() - t0 < 60 and th.is_alive():
        time.sleep(0.02)
    assert captures(gateway) > n0, "the add sent no capture"
    time.sleep(0.2)
    old = rep["srv"]
    os.killpg(old.process.pid, signal.SIGKILL)
    C.log("replica killed %.2f s after the add was sent" % (time.monotonic() - t0))
    th.join(120)
    assert not th.is_alive()
    assert "e" not in res, res
    st, out = res["r"]
    assert st >= 500, ("an add whose capture was killed was acknowledged", st, str(out)[:300])
    C.log("the add was answered %d: %s" % (st, out["error"]["message"][:200]))
    is_error(st, out, st)
    old.stop()
    # the gateway answers without its replica: no replica (503) on /health, the memory listed
    st, h = gateway.req("GET", "/health")
    assert st == 503 and h["status"] == "no_replica", (st, h)
    for u, ids in before.items():
        assert [m["id"] for m in gateway.ok("GET", "/v1/memories?user=" + u)["results"]] == ids, u
    st, out = gateway.req("POST", "/v1/chat/completions", G.chat_body("victim", "What is my job?", k=20))
    assert st in (502, 503), (st, out)
    # a new replica on the same port and store file
    t1 = time.time()
    rep["srv"] = start_replica(work_dir, old.port)
    gateway.wait(up=1)
    C.log("replica restarted in %.0f s" % (time.time() - t1))
    for u, ids in before.items():
        assert [m["id"] for m in gateway.ok("GET", "/v1/memories?user=" + u)["results"]] == ids, u
    question = "What is my favourite sport?"
    for u, texts in (("victim", G.facts_of("alice", 5)),):
        ch = gateway.chat(u, question, k=20)
        assert [f["id"] for f in ch["memory"]["facts"]] == [m["id"] for m in kept]
        diff = G.same(G.reference(rep["srv"], lay, texts, question), G.answer(ch))
        assert diff is None, diff
    conc = gateway.ok("GET", "/v1/memories?user=conc")["results"]
    ch = gateway.chat("conc", question, k=20)
    diff = G.same(G.reference(rep["srv"], lay, [m["text"] for m in conc], question), G.answer(ch))
    assert diff is None, diff
    # and an add after the restart is captured after the others
    more = gateway.ok("POST", "/v1/memories", {"user": "victim", "facts": ["My lucky number is 7."]})["results"]
    ch = gateway.chat("victim", question, k=20)
    assert [f["id"] for f in ch["memory"]["facts"]] == [m["id"] for m in kept + more]
    diff = G.same(G.reference(rep["srv"], lay, G.facts_of("alice", 5) + ["My lucky number is 7."], question),
                  G.answer(ch))
    assert diff is None, diff
