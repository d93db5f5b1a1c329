"""The memory gateway in front of two ``vllm serve`` replicas (each with the
connector and a store file of its own), real processes on 127.0.0.1.

    launch.py test_gateway_replicas.py [--keep DIR]

- users are split between the replicas by rendezvous hashing of their id,
  each always served by its owner; exact-context chats equal plain vLLM;
- a replica that hangs (SIGSTOP) leaves the ring: its users move to the
  other, where their memory is captured again, and their answers are
  unchanged (tokens and logprobs); a fact added meanwhile goes there too;
- when it answers again (SIGCONT, the same epoch) its users come back: the
  one whose facts changed is captured again, the others are not;
- a replica that is stopped: its users move on their next chat (the
  connection error), answers unchanged;
- the gateway and both replicas restart (same database, same store files):
  every memory is still listed and every chat injects, with the same answers.
"""
from __future__ import annotations

import os
import re
import signal
import time

import pytest

import common as C
import gateway_common as G
from kvinject.serve import ring
from servers import free_port

G.require_embedder()

NAMES = ["alice", "bruno", "chen"]
N_FACTS = 5
QUESTION = "What is my job?"


def facts_for(i: int):
    """User i's facts: topics and values of the three base users, rotated so
    that every user's are their own."""
    base = NAMES[i % 3]
    out = []
    for j in range(N_FACTS):
        t = G.TOPICS[(i + 3 * j) % len(G.TOPICS)]
        v = G.VALUES[base][(i + 3 * j) % len(G.TOPICS)]
        out.append("My %s is %s (note %d)." % (t, v, i))
    return out


class Cluster:
    def __init__(self, work_dir):
        self.work_dir = work_dir
        self.ports = {"a": free_port(), "b": free_port()}
        self.srv = {}
        self.gw = None
        self.db = os.path.join(work_dir, "gateway.db")

    def url(self, name):
        return "http://127.0.0.1:%d" % self.ports[name]

    def start_replicas(self, names=("a", "b")):
        t0 = time.time()
        for n in names:
            self.srv[n] = G.start_replica(self.work_dir, "replica-" + n, self.ports[n], wait=False)
        for n in names:
            self.srv[n].wait_healthy(400)
        C.log("replicas %s up in %.0f s" % (",".join(names), time.time() - t0))

    def start_gateway(self, up=2):
        self.gw = G.Gateway([self.url("a"), self.url("b")], self.db, os.path.join(self.work_dir, "gateway.log"))
        C.log("gateway up in %.1f s" % self.gw.wait(up=up))

    def stop_all(self):
        if self.gw is not None:
            self.gw.stop()
            self.gw = None
        for s in self.srv.values():
            try:
                os.killpg(s.process.pid, signal.SIGCONT)
            except OSError:
                pass
            s.stop()

    def replica_of(self, url):
        return next(s for n, s in self.srv.items() if self.url(n) == url)

    def wait_state(self, name, up, timeout=60):
        t0 = time.time()
        while time.time() - t0 < timeout:
            reps = self.gw.ok("GET", "/health") if up else self.gw.req("GET", "/health")[1]
            if any(r["url"] == self.url(name) and r["up"] == up for r in reps["replicas"]):
                return time.time() - t0
            time.sleep(0.3)
        raise AssertionError("the gateway never saw replica %s %s" % (name, "up" if up else "down"))


@pytest.fixture(scope="module")
def cluster(work_dir):
    c = Cluster(work_dir)
    try:
        c.start_replicas()
        c.start_gateway()
        yield c
    finally:
        c.stop_all()
        if c.gw is None and os.path.exists(os.path.join(work_dir, "gateway.log")):
            with open(os.path.join(work_dir, "gateway.log"), "rb") as f:
                C.log("gateway log (end):\n" + f.read().decode("utf-8", "replace")[-2000:])


@pytest.fixture(scope="module")
def lay():
    return G.layout()


@pytest.fixture(scope="module")
def users(cluster):
    """Users added until each replica owns at least 2 (at most 12): name ->
    {facts, owner, tenant}."""
    out = {}
    owned = {cluster.url("a"): 0, cluster.url("b"): 0}
    for i in range(12):
        name = "user%d" % i
        r = cluster.gw.ok("POST", "/v1/memories", {"user": name, "facts": facts_for(i)})
        info = cluster.gw.ok("GET", "/v1/memories?user=" + name)
        out[name] = {"i": i, "facts": facts_for(i), "owner": r["replica"], "tenant": info["tenant"]}
        owned[r["replica"]] += 1
        if i >= 3 and min(owned.values()) >= 2:
            break
    C.log("owners: %s" % {n: u["owner"][-5:] for n, u in out.items()})
    return out


def chat(cluster, name, k=N_FACTS):
    return cluster.gw.chat(name, QUESTION, k=k)


def same_answer(a, b):
    return G.same(G.answer(a), G.answer(b))


@pytest.fixture(scope="module")
def before(cluster, users, lay):
    """Every user's exact-context chat, and plain vLLM's on its owner."""
    out = {}
    for name, u in users.items():
        c = chat(cluster, name)
        ref = G.reference(cluster.replica_of(u["owner"]), lay, u["facts"], QUESTION)
        out[name] = (c, G.same(ref, G.answer(c)))
    return out


def test_users_are_split_between_the_replicas_by_rendezvous_hashing(cluster, users):
    urls = [cluster.url("a"), cluster.url("b")]
    for name, u in users.items():
        assert u["owner"] == ring.owner(urls, u["tenant"]), name
    assert {u["owner"] for u in users.values()} == set(urls)


def test_each_user_is_served_by_its_owner_with_exact_context(users, before):
    for name, u in users.items():
        c, diff = before[name]
        assert c["memory"]["replica"] == u["owner"], name
        assert [f["text"] for f in c["memory"]["facts"]] == u["facts"]
        assert diff is None, "%s: %s" % (name, diff)


def captures(gw, kind):
    m = re.search(r'^kvinject_gateway_captures_total\{kind="%s"\} (\S+)$' % kind, gw.metrics(), re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def hung(cluster, users, before, lay):
    """Replica a hangs (SIGSTOP): a's users chat on b; one of them adds a fact."""
    a = cluster.url("a")
    os.killpg(cluster.srv["a"].process.pid, signal.SIGSTOP)
    C.log("replica a stopped (SIGSTOP); the gateway saw it down in %.1f s" % cluster.wait_state("a", False))
    moved = [n for n, u in users.items() if u["owner"] == a]
    chats = {n: chat(cluster, n) for n in moved}
    extra_user = moved[0]
    added = cluster.gw.ok("POST", "/v1/memories", {"user": extra_user, "facts": ["My job is astronaut trainer."]})
    return {"moved": moved, "chats": chats, "extra_user": extra_user, "added": added}


def test_hung_replica_users_move_and_answer_the_same(cluster, users, before, hung):
    b = cluster.url("b")
    for n in hung["moved"]:
        c = hung["chats"][n]
        assert c["memory"]["replica"] == b, n
        assert c["memory"]["injected_tokens"] > 0
        diff = same_answer(before[n][0], c)
        assert diff is None, "%s on b: %s" % (n, diff)
    assert hung["added"]["replica"] == b


def test_other_users_stay_where_they_were(cluster, users, before, hung):
    b = cluster.url("b")
    for n, u in users.items():
        if u["owner"] == b:
            c = chat(cluster, n)
            assert c["memory"]["replica"] == b and same_answer(before[n][0], c) is None, n


@pytest.fixture(scope="module")
def resumed(cluster, users, hung, lay):
    """Replica a answers again (SIGCONT: the same epoch): its users come back."""
    full0 = captures(cluster.gw, "full")
    os.killpg(cluster.srv["a"].process.pid, signal.SIGCONT)
    C.log("replica a resumed; the gateway saw it up in %.1f s" % cluster.wait_state("a", True))
    chats = {n: chat(cluster, n, k=N_FACTS + 1) for n in hung["moved"]}
    return {"chats": chats, "full": captures(cluster.gw, "full") - full0}


def test_resumed_replica_takes_its_users_back(cluster, users, before, hung, resumed, lay):
    a = cluster.url("a")
    for n in hung["moved"]:
        c = resumed["chats"][n]
        assert c["memory"]["replica"] == a, n
        facts = users[n]["facts"] + (["My job is astronaut trainer."] if n == hung["extra_user"] else [])
        assert [f["text"] for f in c["memory"]["facts"]] == facts
        ref = G.reference(cluster.srv["a"], lay, facts, QUESTION)
        diff = G.same(ref, G.answer(c))
        assert diff is None, "%s back on a: %s" % (n, diff)


def test_only_the_user_whose_facts_changed_is_captured_again(resumed):
    assert resumed["full"] == 1, "full captures on a's return: %s" % resumed["full"]


@pytest.fixture(scope="module")
def killed(cluster, users, hung, resumed):
    """Replica a is stopped for good: its users move on their next chat."""
    cluster.srv["a"].stop()
    chats = {n: chat(cluster, n, k=N_FACTS + 1) for n in hung["moved"]}
    return chats


def test_stopped_replica_users_move_and_answer_the_same(cluster, hung, resumed, killed):
    b = cluster.url("b")
    for n in hung["moved"]:
        assert killed[n]["memory"]["replica"] == b
        diff = same_answer(resumed["chats"][n], killed[n])
        assert diff is None, "%s: %s" % (n, diff)


@pytest.fixture(scope="module")
def restarted(cluster, users, hung, killed):
    """The gateway and both replicas restart (same database and store files)."""
    cluster.gw.stop()
    cluster.gw = None
    cluster.srv["b"].stop()
    cluster.start_replicas()
    cluster.start_gateway()
    out = {}
    for n in users:
        listed = cluster.gw.ok("GET", "/v1/memories?user=" + n)["results"]
        out[n] = (listed, chat(cluster, n, k=N_FACTS + 1))
    return out


def test_after_restart_every_memory_is_still_there(users, hung, restarted):
    for n, u in users.items():
        texts = u["facts"] + (["My job is astronaut trainer."] if n == hung["extra_user"] else [])
        assert [m["text"] for m in restarted[n][0]] == texts, n


def test_after_restart_every_chat_injects_on_its_owner_with_the_same_answer(cluster, users, before, hung,
                                                                           resumed, restarted):
    for n, u in users.items():
        c = restarted[n][1]
        assert c["memory"]["replica"] == u["owner"], n
        assert c["memory"]["injected_tokens"] > 0
        ref = resumed["chats"][n] if n in hung["moved"] else before[n][0]
        diff = same_answer(ref, c)
        assert diff is None, "%s after the restart: %s" % (n, diff)
