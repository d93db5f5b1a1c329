"""The vLLM connector's scheduler role (kvinject.vllm.scheduler) without vLLM:
fakes of vLLM's Request (with its private block hasher, the salt in the first
block's hash as vLLM 0.23 and 0.32 put it), of the blocks and of the
SchedulerOutput drive get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta and request_finished; the tests check the tokens
claimed, the salts and block hashes, the metadata each step sends the workers
and the event file. Also kv_connector_extra_config's parsing
(kvinject.vllm.config), and that none of these modules imports vLLM.

Needs only the library (pytest runs it: tests/vllm/launch.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
import types

import pytest

from kvinject.vllm import Keep, capture_prompt, memory_prompt, prefetch_prompt, remove_prompt
from kvinject.vllm import _compat
from kvinject.vllm.config import KNOWN, KVInjectConfig, requires_piecewise
from kvinject.vllm.metadata import CaptureJob, FailJob, InjectJob, KVInjectMetadata, PrefetchJob
from kvinject.vllm.prompt import PARAMS_KEY, parse_params
from kvinject.vllm.results import KVInjectWorkerMeta
from kvinject.vllm.scheduler import KVInjectScheduler

BS = 4


# --------------------------------------------------------------- vLLM fakes

def chain_hasher(request):
    """vLLM's block hasher, in small: the hashes (bytes) of the full blocks not
    hashed yet, each over its parent's hash and its tokens, the cache salt in
    the first block's."""
    out = []
    parent = request.block_hashes[-1] if request.block_hashes else None
    ids = request.prompt_token_ids
    for i in range(len(request.block_hashes), len(ids) // BS):
        extra = (request.cache_salt,) if i == 0 and request.cache_salt else ()
        parent = hashlib.sha256(repr((parent, tuple(ids[i * BS:(i + 1) * BS]), extra)).encode()).digest()
        out.append(parent)
    return out


class FakeRequest:
    """The attributes of vllm.v1.request.Request the scheduler role reads (and
    _compat salts)."""

    def __init__(self, rid, prompt_token_ids, kv_transfer_params=None, hasher=chain_hasher):
        self.request_id = rid
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.kv_transfer_params = kv_transfer_params
        self.cache_salt = None
        self.block_hashes = []
        self._block_hasher = hasher
        if hasher is not None:
            self.block_hashes = hasher(self)

    def update_block_hashes(self):
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))


def request(rid, mp=None, ids=None, **kw):
    """A request of a MemoryPrompt (its tokens and kvinject parameters), or of plain token ids."""
    if mp is not None:
        return FakeRequest(rid, mp.prompt_token_ids, mp.kv_transfer_params, **kw)
    return FakeRequest(rid, ids, None, **kw)


class FakeBlocks:
    def __init__(self, *ids):
        self.ids = list(ids)

    def get_block_ids(self):
        return (list(self.ids),)


def new_req(rid, blocks, computed):
    return types.SimpleNamespace(req_id=rid, block_ids=(list(blocks),), num_computed_tokens=computed)


def cached_reqs(*reqs, resumed=()):
    """CachedRequestData of (req_id, new blocks or None, num_computed_tokens) triples."""
    return types.SimpleNamespace(req_ids=[r[0] for r in reqs],
                                 new_block_ids=[(list(r[1]),) if r[1] is not None else None for r in reqs],
                                 num_computed_tokens=[r[2] for r in reqs], resumed_req_ids=set(resumed))


def output(new=(), cached=None, scheduled=None):
    return types.SimpleNamespace(scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or cached_reqs(),
                                 num_scheduled_tokens=dict(scheduled or {}))


# ------------------------------------------------------------------ fixtures

@pytest.fixture
def sched():
    return KVInjectScheduler(KVInjectConfig.from_extra({}, BS))


@pytest.fixture
def mp():
    # facts of 3, 5 and 2 tokens (10 claimed), then a 3-token question
    return memory_prompt(9, [(1, [11, 12, 13]), (2, [21, 22, 23, 24, 25]), (3, [31, 32])], [41, 42, 43])


def claim(sched, req, computed=0, blocks=(), scheduled=None):
    """vLLM's calls for a request it schedules for the first time: the claim, the
    allocation and the step's metadata."""
    n, is_async = sched.get_num_new_matched_tokens(req, computed)
    assert is_async is False
    sched.update_state_after_alloc(req, FakeBlocks(*blocks), n)
    rest = req.num_prompt_tokens - computed - n
    meta = sched.build_connector_meta(output([new_req(req.request_id, blocks, computed + n)],
                                             scheduled={req.request_id: rest if scheduled is None else scheduled}))
    return n, meta


# ------------------------------------------------------------------- claims

def test_a_request_without_kvinject_parameters_is_left_alone(sched):
    r = request("p", ids=list(range(10)))
    hashes = list(r.block_hashes)
    sched.on_new_request(r)
    assert r.cache_salt is None and r.block_hashes == hashes
    n, meta = claim(sched, r, blocks=[0, 1, 2])
    assert n == 0
    assert (meta.injects, meta.captures, meta.failures) == ([], [], [])


def test_the_injected_prefix_is_claimed_and_its_facts_sent_with_the_blocks(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[7, 8, 9, 5])
    assert n == 10
    (job,) = meta.injects
    assert isinstance(job, InjectJob)
    assert (job.req_id, job.tenant, job.facts, job.block_ids) == ("r", 9, [(1, 0, 3), (2, 3, 5), (3, 8, 2)],
                                                                  [7, 8, 9, 5])
    assert meta.captures == [] and meta.failures == []
    # the next step (decode) sends nothing for it, and nothing more is claimed
    nxt = sched.build_connector_meta(output(cached=cached_reqs(("r", None, 13)), scheduled={"r": 1}))
    assert nxt.injects == []
    assert sched.get_num_new_matched_tokens(r, 13) == (0, False)


def test_the_prompts_token_ids_at_the_spans_go_with_the_job(sched, mp):
    # whatever the prompt's form, the ids vLLM tokenized are what the worker
    # checks the stored facts against; here one id of fact 2's span is altered
    ids = list(mp.prompt_token_ids)
    ids[4] = 99
    r = FakeRequest("r", ids, mp.kv_transfer_params)
    sched.on_new_request(r)
    _, meta = claim(sched, r, computed=4, blocks=[7, 8, 9, 5])
    (job,) = meta.injects
    assert job.facts == [(2, 3, 5), (3, 8, 2)]
    assert job.expect_token_ids == [21, 99, 23, 24, 25, 31, 32]


def test_a_capture_carries_the_prompts_token_ids_of_its_span(sched):
    cp = capture_prompt(9, [[1, 2, 3], Keep(5, [4, 5, 6, 7, 8], embedding=None), [9], Keep(6, [10, 11])])
    r = request("c", cp)
    sched.on_new_request(r)
    _, meta = claim(sched, r, blocks=[3, 4])
    (job,) = meta.captures
    assert job.token_ids == [[4, 5, 6, 7, 8], [10, 11]]
    assert job.contexts == [[], [5]]  # the second after the first: its context in the store


def test_a_local_prefix_hit_is_not_claimed_and_its_facts_not_written(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    # vLLM's prefix cache has the first block (4 tokens): 6 more are claimed
    n, meta = claim(sched, r, computed=4, blocks=[7, 8, 9, 5])
    assert n == 6
    (job,) = meta.injects
    # fact 1 (tokens 0..2) lies in the cached block; fact 2 (3..7) straddles it and is written whole
    assert job.facts == [(2, 3, 5), (3, 8, 2)]
    # all of the prefix cached: nothing claimed, nothing injected
    r2 = request("r2", mp)
    sched.on_new_request(r2)
    n2, meta2 = claim(sched, r2, computed=12, blocks=[1, 2, 3, 4])
    assert n2 == 0 and meta2.injects == []


def test_a_request_resumed_after_preemption_is_injected_again_into_its_new_blocks(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    claim(sched, r, blocks=[7, 8, 9, 5])
    # grows by a block, then is preempted and resumed on other blocks
    grown = sched.build_connector_meta(output(cached=cached_reqs(("r", [6], 13)), scheduled={"r": 1}))
    assert grown.injects == []
    assert sched.get_num_new_matched_tokens(r, 0) == (10, False)
    sched.update_state_after_alloc(r, FakeBlocks(3, 2, 1, 0), 10)
    meta = sched.build_connector_meta(output(cached=cached_reqs(("r", [3, 2, 1, 0], 10), resumed=["r"]),
                                             scheduled={"r": 4}))
    (job,) = meta.injects
    assert job.block_ids == [3, 2, 1, 0]  # the resumed request's blocks replace the old ones
    assert job.facts == [(1, 0, 3), (2, 3, 5), (3, 8, 2)]


def test_requests_of_other_connectors_or_finished_ones_are_ignored(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    assert sched.request_finished(r, [7, 8])[0] is False
    assert sched.request_finished(r, [7, 8]) == (False, None)  # forgotten
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = sched.build_connector_meta(output([new_req("r", [7, 8, 9], 10), new_req("other", [1], 0)],
                                             scheduled={"r": 3, "other": 2}))
    assert (meta.injects, meta.captures, meta.failures) == ([], [], [])
    sched.request_finished(request("never-seen", ids=[1, 2]), [])  # nothing to forget: no error


# -------------------------------------------------------------------- salts

def test_an_injecting_request_gets_a_salt_of_its_own_and_its_blocks_new_hashes(sched, mp):
    plain = request("p", ids=mp.prompt_token_ids)
    a, b = request("a", mp), request("b", mp)
    assert a.block_hashes == plain.block_hashes and len(plain.block_hashes) == 3  # same tokens, no salt yet
    sched.on_new_request(a)
    sched.on_new_request(b)
    assert a.cache_salt and b.cache_salt and a.cache_salt != b.cache_salt
    assert a.cache_salt == sched.salt("a")
    assert len(a.block_hashes) == len(plain.block_hashes)
    assert not set(a.block_hashes) & set(plain.block_hashes)
    assert not set(a.block_hashes) & set(b.block_hashes)
    # two engines never give the same request id the same salt
    other = KVInjectScheduler(KVInjectConfig.from_extra({}, BS))
    assert other.salt("a") != sched.salt("a")


def test_a_salted_block_hash_is_the_hash_xor_the_salts_digest_of_its_length():
    salt = "kvinject:nonce:r1"
    for width in (32, 16, 8):  # vLLM's sha256 hashes, and shorter ones
        hashes = [hashlib.sha256(b"%d" % i).digest()[:width] for i in range(40)]
        tag = hashlib.shake_256(salt.encode()).digest(width)
        want = [bytes(a ^ b for a, b in zip(h, tag)) for h in hashes]
        assert _compat.salted_block_hashes(hashes, salt) == want
        assert _compat.salted_block_hashes(hashes, salt + "x") != want  # another salt, other names
    mixed = [b"\x01" * 32, b"", b"\x02" * 16]
    tag = hashlib.shake_256(salt.encode()).digest(32)
    assert _compat.salted_block_hashes(mixed, salt) == [bytes(a ^ b for a, b in zip(h, tag)) for h in mixed]


def test_without_the_prefix_cache_no_request_is_salted(mp):
    # nothing shares blocks, so the block hashes are left as vLLM made them
    sched = KVInjectScheduler(KVInjectConfig.from_extra({}, BS), prefix_caching=False)
    r = request("a", mp)
    hashes = list(r.block_hashes)
    sched.on_new_request(r)
    assert r.cache_salt is None and r.block_hashes == hashes
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    assert n == 10  # the facts are still claimed


def test_a_capture_only_request_shares_blocks_as_a_plain_one(sched):
    cp = capture_prompt(9, [[1, 2, 3], Keep(5, [4, 5, 6, 7, 8]), [9]])
    r = request("c", cp)
    hashes = list(r.block_hashes)
    sched.on_new_request(r)
    assert r.cache_salt is None and r.block_hashes == hashes  # its KV is vLLM's own prefill


def test_a_request_vllm_hashed_without_a_block_hasher_is_refused(sched, mp):
    r = request("r", mp, hasher=None)
    r.block_hashes = [1, 2]  # hashed some other way: the salt could not reach them
    with pytest.raises(RuntimeError, match="without a _block_hasher"):
        sched.on_new_request(r)
    unhashed = request("u", mp, hasher=None)  # no prefix caching: nothing to redo
    sched.on_new_request(unhashed)
    assert unhashed.cache_salt == sched.salt("u") and unhashed.block_hashes == []


# ----------------------------------------------------------------- captures

def test_a_capture_is_sent_once_its_whole_span_is_prefilled_over_chunked_steps(sched):
    cp = capture_prompt(9, [[1, 2, 3], Keep(5, [4, 5, 6, 7, 8], embedding=None), [9]])
    r = request("c", cp)
    sched.on_new_request(r)
    n, m1 = claim(sched, r, blocks=[3, 4], scheduled=6)
    assert n == 0 and m1.captures == []  # tokens 0..5 computed; the span ends at 8
    m2 = sched.build_connector_meta(output(cached=cached_reqs(("c", [6], 6)), scheduled={"c": 3}))
    (job,) = m2.captures
    assert isinstance(job, CaptureJob)
    assert (job.req_id, job.tenant, job.captures, job.block_ids) == ("c", 9, [(5, 3, 5, None, False)], [3, 4, 6])
    m3 = sched.build_connector_meta(output(cached=cached_reqs(("c", None, 9)), scheduled={"c": 1}))
    assert m3.captures == []  # once


def test_a_capture_carries_its_embedding_and_replace_flag():
    s = KVInjectScheduler(KVInjectConfig.from_extra({"embedding_dim": 2}, BS))
    cp = capture_prompt(4, [Keep(8, [1, 2, 3], embedding=[0.5, 1]), [9], Keep(9, [4], replace=True, embedding=[1, 0])])
    r = request("c", cp)
    s.on_new_request(r)
    _, meta = claim(s, r, blocks=[0, 1])
    (job,) = meta.captures
    assert job.captures == [(8, 0, 3, [0.5, 1.0], False), (9, 4, 1, [1.0, 0.0], True)]


def test_one_request_injects_and_captures_in_the_same_step(sched):
    mp = memory_prompt(3, [(1, [1, 2, 3, 4])], [5, 6, 7])
    mp.params["capture"] = [{"fact_id": 2, "start": 4, "length": 2}]
    r = request("x", mp)
    sched.on_new_request(r)
    assert r.cache_salt  # it injects
    n, meta = claim(sched, r, blocks=[5, 6])
    assert n == 4
    assert [j.facts for j in meta.injects] == [[(1, 0, 4)]]
    assert [j.captures for j in meta.captures] == [[(2, 4, 2, None, False)]]


# ----------------------------------------------------------------- failures

@pytest.mark.parametrize("params, message", [
    ({"inject": [[1, 0, 2]]}, "need a tenant"),
    ({"tenant": 9, "inject": [[1, 1, 2]]}, "back to back"),
    ({"tenant": 9, "inject": [[1, 0, 3]]}, "at least one prompt token"),
    ({"tenant": 9}, "ask for nothing"),
    ({"tenant": 9, "inject": [[1, 0, 2]], "extra": 1}, "unknown kvinject parameters"),
    ({"tenant": 9, "capture": [{"fact_id": 1, "start": 0, "length": 1, "embedding": [1.0]}]}, "keeps none"),
    ("tenant 9", "must be a dict"),
])
def test_a_bad_request_claims_one_token_and_is_sent_as_a_failure_with_its_block(sched, params, message):
    r = FakeRequest("x", [11, 12, 41], {PARAMS_KEY: params})
    sched.on_new_request(r)
    assert r.cache_salt == sched.salt("x")  # its block is its own
    n, meta = claim(sched, r, blocks=[2])
    assert n == 1
    (f,) = meta.failures
    assert isinstance(f, FailJob)
    assert (f.req_id, f.block_ids) == ("x", [2])
    assert message in f.message
    assert meta.injects == [] and meta.captures == []
    # later steps do not send it again
    assert sched.build_connector_meta(output(cached=cached_reqs(("x", None, 3)), scheduled={"x": 1})).failures == []


def test_a_bad_request_of_one_token_claims_nothing(sched):
    r = FakeRequest("x", [11], {PARAMS_KEY: {"inject": [[1, 0, 1]]}})
    sched.on_new_request(r)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)  # vLLM must compute one token itself
    r2 = FakeRequest("y", [11, 12], {PARAMS_KEY: {"inject": [[1, 0, 1]]}})
    sched.on_new_request(r2)
    assert sched.get_num_new_matched_tokens(r2, 1) == (0, False)


def test_bad_and_good_requests_of_one_step_are_sent_apart(sched, mp):
    good, bad = request("g", mp), FakeRequest("b", [1, 2, 3], {PARAMS_KEY: {"tenant": -1, "inject": [[1, 0, 1]]}})
    for r in (good, bad):
        sched.on_new_request(r)
        sched.update_state_after_alloc(r, None, sched.get_num_new_matched_tokens(r, 0)[0])
    meta = sched.build_connector_meta(output([new_req("g", [4, 5, 6], 10), new_req("b", [7], 1)],
                                             scheduled={"g": 3, "b": 2}))
    assert [j.req_id for j in meta.injects] == ["g"]
    assert [(f.req_id, f.block_ids) for f in meta.failures] == [("b", [7])]
    assert "tenant = -1 is out of range" in meta.failures[0].message


# ------------------------------------------------------------ metadata, events

def test_the_metadata_survives_pickling(sched, mp):
    # vLLM sends it from the scheduler's process to the workers'
    r = request("r", mp)
    sched.on_new_request(r)
    _, meta = claim(sched, r, blocks=[7, 8, 9])
    back = pickle.loads(pickle.dumps(meta))
    assert isinstance(back, KVInjectMetadata) and back == meta


def test_the_event_file_records_the_steps_and_the_errors(tmp_path, mp):
    s = KVInjectScheduler(KVInjectConfig.from_extra({"events_path": str(tmp_path / "ev")}, BS))
    r = request("r", mp)
    bad = FakeRequest("b", [1, 2], {PARAMS_KEY: {"inject": []}})
    s.on_new_request(r)
    s.on_new_request(bad)
    claim(s, r, blocks=[1, 2, 3])
    s.build_connector_meta(output())  # nothing to send: no record
    # the records are queued; they are in the file once the step's output comes
    # back (vLLM's update_connector_output flushes them)
    s.update_connector_output(None)
    with open(tmp_path / "ev.scheduler.jsonl") as f:
        recs = [json.loads(line) for line in f]
    assert [e["event"] for e in recs] == ["request_error", "schedule"]
    assert recs[0]["req_id"] == "b" and "need a tenant" in recs[0]["message"]
    assert (recs[1]["injects"], recs[1]["captures"], recs[1]["failures"]) == (1, 0, 0)
    assert recs[1]["host_us"] >= 0 and "t" in recs[1]


def test_events_are_serialized_at_flush_not_at_write_and_in_order(tmp_path, monkeypatch):
    import threading
    from kvinject.vllm import events as ev_mod
    threads = set()
    real = ev_mod.json.dumps

    def dumps(obj, **kw):
        threads.add(threading.current_thread().name)
        return real(obj, **kw)
    monkeypatch.setattr(ev_mod.json, "dumps", dumps)
    path = tmp_path / "e.jsonl"
    ev = ev_mod.Events(str(path))
    assert ev.enabled and not ev_mod.Events(None).enabled
    ev.write(event="a", n=1)
    ev.write(event="b", obj=object())  # not JSON: written as its str, the writer goes on

    def many(tag):
        for i in range(200):
            ev.write(event=tag, i=i)
    ts = [threading.Thread(target=many, args=("t%d" % j,)) for j in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not threads and not path.read_text()   # write() serializes nothing
    ev.flush()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert threads == {threading.current_thread().name}
    assert [r["event"] for r in recs[:2]] == ["a", "b"] and recs[0]["n"] == 1 and "t" in recs[0]
    for j in range(3):  # every thread's records, each in its order
        assert [r["i"] for r in recs if r["event"] == "t%d" % j] == list(range(200))
    ev.write(event="last")
    ev.close()
    assert json.loads(path.read_text().splitlines()[-1])["event"] == "last"
    ev.write(event="after close")  # goes nowhere, raises nothing
    assert "after close" not in path.read_text()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_writes_its_own_events(tmp_path):
    # a forked child starts its event file over (a lock a parent's thread held at
    # the fork would never be let go): its events still reach the file, and the
    # records the parent had queued are written once, by the parent
    import warnings
    from kvinject.vllm.events import Events
    path = tmp_path / "e.jsonl"
    ev = Events(str(path))
    ev.write(event="parent")
    ev.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ev.write(event="child")
            ev.flush()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    ev.write(event="parent again")
    ev.close()
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["parent", "child",
                                                                                     "parent again"]


def test_an_event_file_that_fails_loses_lines_not_the_engine(tmp_path):
    from kvinject.vllm.events import Events
    ev = Events(str(tmp_path / "e.jsonl"))
    ev.f.close()  # every write now raises ValueError in the writer
    ev.write(event="x")
    ev.flush()
    ev.write(event="y")
    ev.flush()


def test_an_event_file_starts_no_thread(tmp_path):
    # a flush at the end of a step must not wait for another thread to wake and
    # write (a thread switch cost about 0.1 ms a request on a 2-core VM): the
    # records are written by the flushing thread
    import threading
    from kvinject.vllm.events import Events
    before = threading.active_count()
    path = tmp_path / "e.jsonl"
    ev = Events(str(path))
    for i in range(3):
        ev.write(event="r", i=i)
    assert threading.active_count() == before and not path.read_text()
    ev.flush()
    assert [json.loads(line)["i"] for line in path.read_text().splitlines()] == [0, 1, 2]
    ev.write(event="r", i=3)
    ev.close()
    assert [json.loads(line)["i"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]


# ------------------------------------------------------------------- config

def test_settings_default_and_parse():
    c = KVInjectConfig.from_extra(None, 16)
    assert (c.block_size, c.store_budget_mb, c.store_dtype, c.page_tokens, c.embedding_dim) == (16, 256, "fp32", 16, 0)
    assert (c.store_path, c.layerwise, c.time_device, c.events_path, c.rope) == (None, False, False, None, None)
    c = KVInjectConfig.from_extra({"store_budget_mb": 64, "embedding_dim": 8, "layerwise": True, "rope": {"theta": 1e4},
                                   "store_dtype": "bf16", "store_path": "/x", "time_device": True}, 32, environ={})
    assert (c.store_budget_mb, c.embedding_dim, c.layerwise, c.rope, c.store_dtype, c.store_path, c.time_device) == \
        (64, 8, True, {"theta": 1e4}, "bf16", "/x", True)
    vc = types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=None),
                               cache_config=types.SimpleNamespace(block_size=128))
    assert KVInjectConfig.from_vllm_config(vc, environ={}) == KVInjectConfig(block_size=128)


def test_unknown_settings_are_refused_with_their_names():
    with pytest.raises(ValueError, match=r"unknown key\(s\) time_devices in kv_connector_extra_config \(known: "):
        KVInjectConfig.from_extra({"time_devices": True, "layerwise": True}, 16)
    KVInjectConfig.from_extra({k: None for k in ("events_path", "rope", "store_path")}, 16)
    assert "layerwise" in KNOWN and "store_dtype" in KNOWN


def test_layerwise_injection_asks_for_piecewise_cuda_graphs():
    assert requires_piecewise({"layerwise": True}) is True
    assert requires_piecewise({"layerwise": False}) is False
    assert requires_piecewise({}) is False
    assert requires_piecewise(None) is False


# --------------------------------------------------------------- no vLLM here

def test_the_roles_import_no_vllm():
    code = ("import sys, kvinject.vllm, kvinject.vllm.scheduler, kvinject.vllm.worker, kvinject.vllm.metadata, "
            "kvinject.vllm.config, kvinject.vllm._compat\n"
            "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') or m == 'torch')\n"
            "print(bad)\n"
            "sys.exit(1 if bad else 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr


# ------------------------------------------------------------ hybrid serving

def hybrid_sched(tmp_path, **extra):
    return KVInjectScheduler(KVInjectConfig.from_extra(dict({"disk_dir": str(tmp_path)}, **extra), BS))


def report(sched, disk_facts, bytes_per_token=1e6, read_bytes_s=0.0):
    """The workers' metadata of a step that says which facts are only on disk."""
    wm = KVInjectWorkerMeta(disk_facts=disk_facts, bytes_per_token=bytes_per_token, disk_read_bytes_s=read_bytes_s)
    sched.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=wm))


def test_hybrid_a_cold_tenant_is_prefilled_as_text_and_prefetched_whole(tmp_path, mp):
    sched = hybrid_sched(tmp_path)
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[0, 1, 2, 3])
    assert n == 0 and meta.injects == []  # vLLM prefills all 13 tokens
    assert meta.prefetches == [PrefetchJob("r", 9, None)]
    assert meta.hybrid == {"text": 3}
    # sent once: the next step has neither
    nxt = sched.build_connector_meta(output(cached=cached_reqs(("r", None, 13)), scheduled={"r": 1}))
    assert nxt.prefetches == [] and nxt.hybrid == {}


def test_hybrid_facts_in_memory_are_injected(tmp_path, mp):
    sched = hybrid_sched(tmp_path)
    report(sched, {9: []})
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[0, 1, 2, 3])
    assert n == 10 and meta.injects[0].facts == [(1, 0, 3), (2, 3, 5), (3, 8, 2)]
    assert meta.prefetches == [] and meta.hybrid == {"inject": 3, "await": 0, "text": 0}


def test_hybrid_a_disk_only_fact_is_awaited_when_reading_it_is_faster_than_prefill(tmp_path, mp):
    # fact 2: 5 tokens of 1 MB each; prefill at 5000 tokens/s takes 1 ms; reading 5 MB at 10 GB/s 0.5 ms
    sched = hybrid_sched(tmp_path, disk_read_mb_s=10000.0, prefill_tokens_s=5000.0)
    report(sched, {9: [2, 77]})
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[0, 1, 2, 3])
    assert n == 10 and meta.injects[0].facts == [(1, 0, 3), (2, 3, 5), (3, 8, 2)]
    assert meta.hybrid == {"inject": 2, "await": 1, "text": 0} and meta.prefetches == []


def test_hybrid_a_slow_disk_only_fact_and_everything_after_it_are_prefilled_as_text(tmp_path, mp):
    # reading 5 MB at 1000 MB/s takes 5 ms, more than the 1 ms of prefilling 5 tokens
    sched = hybrid_sched(tmp_path, disk_read_mb_s=1000.0, prefill_tokens_s=5000.0)
    report(sched, {9: [2, 3]})
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[0, 1, 2, 3])
    assert n == 3  # fact 1 only: vLLM prefills tokens 3..12
    (job,) = meta.injects
    assert job.facts == [(1, 0, 3)] and job.expect_token_ids == [11, 12, 13]
    assert meta.hybrid == {"inject": 1, "await": 0, "text": 2}
    assert meta.prefetches == [PrefetchJob("r", 9, [2, 3])]  # the disk-only facts not injected
    assert sched.get_num_new_matched_tokens(r, 3) == (0, False)  # the plan holds


def test_hybrid_the_measured_read_rate_decides_when_none_is_set(tmp_path, mp):
    sched = hybrid_sched(tmp_path)  # disk_read_mb_s 0: measured
    report(sched, {9: [2]}, read_bytes_s=1e6)  # 1 MB/s: 5 s for fact 2
    r1 = request("r1", mp)
    sched.on_new_request(r1)
    assert claim(sched, r1, blocks=[0, 1, 2, 3])[0] == 3
    report(sched, {}, read_bytes_s=1e12)  # a later, fast measurement; tenant 9's facts as before
    r2 = request("r2", mp)
    sched.on_new_request(r2)
    n, meta = claim(sched, r2, blocks=[4, 5, 6, 7])
    assert n == 10 and meta.hybrid == {"inject": 2, "await": 1, "text": 0}


def test_without_a_disk_tier_every_fact_is_injected_whatever_is_reported(sched, mp):
    report(sched, {9: [1, 2, 3]}, read_bytes_s=1.0)
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[0, 1, 2, 3])
    assert n == 10 and meta.prefetches == [] and meta.hybrid == {}


def test_hybrid_is_off_when_the_setting_says_so(tmp_path, mp):
    sched = hybrid_sched(tmp_path, hybrid=False)
    r = request("r", mp)
    sched.on_new_request(r)
    assert claim(sched, r, blocks=[0, 1, 2, 3])[0] == 10  # a cold tenant, injected all the same


def test_a_prefetch_request_sends_one_prefetch_of_the_whole_tenant(sched):
    r = request("p", prefetch_prompt(12, 5))
    sched.on_new_request(r)
    assert r.cache_salt is None  # it injects nothing
    n, meta = claim(sched, r, blocks=[0])
    assert n == 0 and meta.prefetches == [PrefetchJob("p", 12, None)]
    assert meta.req_ids() == []  # no result comes back for a prefetch
    nxt = sched.build_connector_meta(output(cached=cached_reqs(("p", None, 1)), scheduled={"p": 1}))
    assert nxt.prefetches == []
    with pytest.raises(ValueError, match="prefetch must be true or false"):
        parse_params({"tenant": 1, "prefetch": 1}, 4)


def test_a_release_goes_with_the_step_that_stores_the_requests_captures(sched):
    mp = capture_prompt(4, [[1, 2], Keep(9, [3, 4, 5, 6, 7, 8])])
    mp.params["release"] = True
    r = request("c", mp)
    sched.on_new_request(r)
    _, m1 = claim(sched, r, blocks=[0, 1], scheduled=4)  # chunked: the capture's span is not prefilled yet
    assert m1.captures == [] and m1.releases == []
    m2 = sched.build_connector_meta(output(cached=cached_reqs(("c", None, 4)), scheduled={"c": 4}))
    assert [c.req_id for c in m2.captures] == ["c"] and m2.releases == [4]
    m3 = sched.build_connector_meta(output(cached=cached_reqs(("c", None, 8)), scheduled={"c": 1}))
    assert m3.releases == []
    # with a removal alone, in its step
    rr = request("rm", remove_prompt(4, [9], 1))
    rr.kv_transfer_params[PARAMS_KEY]["release"] = True
    sched.on_new_request(rr)
    _, m = claim(sched, rr, blocks=[2])
    assert [j.req_id for j in m.removes] == ["rm"] and m.releases == [4]


def test_hybrid_injects_no_more_than_the_stores_memory_holds_at_once(tmp_path, mp):
    # pages of 4 tokens of 2^18 bytes: 1 MiB holds 4 pages; facts of 3, 5 and 2 tokens take 1, 2 and 1 pages...
    sched = hybrid_sched(tmp_path, store_budget_mb=1, page_tokens=4, disk_read_mb_s=1e7, prefill_tokens_s=1.0)
    report(sched, {9: [2]}, bytes_per_token=1 << 16)
    assert sched.memory_pages() == 4
    r = request("r", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[0, 1, 2, 3])
    assert n == 10 and meta.hybrid == {"inject": 2, "await": 1, "text": 0}  # 4 pages: all fit
    report(sched, {9: [2]}, bytes_per_token=1 << 17)  # ... 2 pages of 2^19 bytes
    r2 = request("r2", mp)
    sched.on_new_request(r2)
    n, meta = claim(sched, r2, blocks=[4, 5, 6, 7])
    assert n == 3 and meta.hybrid == {"inject": 1, "await": 0, "text": 2}
    assert meta.prefetches == [PrefetchJob("r2", 9, [2])]
