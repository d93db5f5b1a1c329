"""The memory gateway with ``--shared-disk true`` in front of two ``vllm serve``
replicas whose connectors share one ``disk_dir`` (docs/guide/serve.md, "Shared disk
and prefetch after idle"), real processes on 127.0.0.1.

    launch.py test_gateway_shared_disk.py [--keep DIR]

- users are added and chat on their owners: plain vLLM's tokens and logprobs;
- replica a hangs (SIGSTOP): its users move to b, which is asked to prefetch them
  from the shared tenant files instead of capturing them (no full capture); their
  first chat there (a cold tenant: prefilled as text) and the next (injected) answer
  as before;
- a memory added for a moved user is captured on b at once: a's writes gave the
  tenant's lease up (``release``), though a still holds its process;
- a resumes: the user comes back, a reads the changed tenant file anew (a prefetch,
  no capture), and the chat holds the added memory with plain vLLM's answer.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

import common as C
import gateway_common as G
from servers import free_port, start_vllm_serve

G.require_embedder()

NAMES = ["alice", "bruno", "chen"]
N_FACTS = 4
QUESTION = "What is my job?"
ADDED = "My job is astronaut trainer."


def facts_for(i: int):
    base = NAMES[i % 3]
    return ["My %s is %s (note %d)." % (G.TOPICS[(i + 3 * j) % 20], G.VALUES[base][(i + 3 * j) % 20], i)
            for j in range(N_FACTS)]


def metric(gw, name, **labels):
    """A sample of the gateway's /metrics (the exposition lists labels sorted by name)."""
    want = ",".join('%s="%s"' % kv for kv in sorted(labels.items()))
    pat = r"^%s\{%s\} (\S+)$" % (re.escape(name), re.escape(want)) if labels else r"^%s (\S+)$" % re.escape(name)
    m = re.search(pat, gw.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def cluster(work_dir):
    disk = os.path.join(work_dir, "disk")
    os.makedirs(disk)
    ports = {"a": free_port(), "b": free_port()}
    url = {n: "http://127.0.0.1:%d" % p for n, p in ports.items()}
    srv, gw = {}, None
    try:
        for n in ("a", "b"):
            srv[n] = start_vllm_serve(C.MODEL, ports[n], {"store_dtype": "fp32", "store_budget_mb": 64,
                                                          "disk_dir": disk, "disk_owner": "replica-" + n},
                                      log_path=os.path.join(work_dir, "replica-%s.log" % n), env=G.REPLICA_ENV,
                                      wait=False)
        for s in srv.values():
            s.wait_healthy(400)
        gw = G.Gateway([url["a"], url["b"]], os.path.join(work_dir, "gateway.db"),
                       os.path.join(work_dir, "gateway.log"), extra=["--shared-disk", "true"])
        gw.wait(up=2)
        yield {"srv": srv, "gw": gw, "url": url, "disk": disk}
    finally:
        if gw is not None:
            gw.stop()
        for s in srv.values():
            try:
                os.killpg(s.process.pid, signal.SIGCONT)
            except OSError:
                pass
            s.stop()


def wait_state(gw, u, up, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        reps = gw.req("GET", "/health")[1]
        if isinstance(reps, dict) and any(r["url"] == u and r["up"] == up for r in reps["replicas"]):
            return
        time.sleep(0.3)
    raise AssertionError("the gateway never saw %s %s" % (u, "up" if up else "down"))


def test_a_moved_user_is_loaded_from_the_shared_disk_and_answers_as_plain_vllm(cluster):
    gw, srv, url = cluster["gw"], cluster["srv"], cluster["url"]
    lay = G.layout()
    users = {}
    for i in range(12):  # until replica a owns a user
        name = "user%d" % i
        r = gw.ok("POST", "/v1/memories", {"user": name, "facts": facts_for(i)})
        users[name] = r["replica"]
        if r["replica"] == url["a"]:
            break
    moved = name
    assert users[moved] == url["a"]
    tenant = gw.ok("GET", "/v1/memories?user=" + moved)["tenant"]
    assert os.path.exists(os.path.join(cluster["disk"], "%016x.kvi" % tenant))
    ref = G.reference(srv["a"], lay, facts_for(int(moved[4:])), QUESTION)
    c = gw.chat(moved, QUESTION, k=N_FACTS)
    assert c["memory"]["replica"] == url["a"] and G.same(ref, G.answer(c)) is None
    full0 = metric(gw, "kvinject_gateway_captures_total", kind="full")

    os.killpg(srv["a"].process.pid, signal.SIGSTOP)
    wait_state(gw, url["a"], False)
    for n in (1, 2):  # cold on b (text), then injected from b's memory
        c = gw.chat(moved, QUESTION, k=N_FACTS)
        assert c["memory"]["replica"] == url["b"]
        diff = G.same(ref, G.answer(c))
        assert diff is None, "chat %d on b: %s" % (n, diff)
    lines = [ln for ln in gw.metrics().splitlines() if ln.startswith(("kvinject_gateway_prefetches_total",
                                                                      "kvinject_gateway_captures_total"))]
    assert metric(gw, "kvinject_gateway_prefetches_total", why="shared", status="ok") == 1, lines
    assert metric(gw, "kvinject_gateway_captures_total", kind="full") == full0, lines  # nothing captured again

    # a still holds its process (stopped), but gave the tenant's lease up after its captures
    added = gw.ok("POST", "/v1/memories", {"user": moved, "facts": [ADDED]})
    assert added["replica"] == url["b"]

    os.killpg(srv["a"].process.pid, signal.SIGCONT)
    wait_state(gw, url["a"], True)
    facts = facts_for(int(moved[4:])) + [ADDED]
    c = gw.chat(moved, QUESTION, k=N_FACTS + 1)
    assert c["memory"]["replica"] == url["a"] and [f["text"] for f in c["memory"]["facts"]] == facts
    diff = G.same(G.reference(srv["a"], lay, facts, QUESTION), G.answer(c))
    assert diff is None, "back on a: %s" % diff
    assert metric(gw, "kvinject_gateway_prefetches_total", why="shared", status="ok") == 2
    assert metric(gw, "kvinject_gateway_captures_total", kind="full") == full0
