"""The vLLM connector's worker role (kvinject.vllm.worker) without vLLM: a fake
VllmConfig (its static forward context holding a CPU_ATTN layer of the vec
ISA) and fake KV caches in vLLM's CPU layout (one [num_blocks, heads,
block_size, 2 * head_size] container per layer, all views of one array:
numpy, and torch CPU tensors where torch is installed), driven through
register_kv_caches, start_load_kv, wait_for_layer_load, wait_for_save,
get_block_ids_with_load_errors and get_finished with the metadata the
scheduler role sends; build_connector_worker_meta and get_kv_connector_stats
give back what each step did (per request, and counted).

What lands in the cache is compared with the library's own CPU reference (the
same facts injected by kvi_inject into a plain contiguous cache at the same
positions), token by token, read out of vLLM's container as its kernels read
it; everything else in the cache must be untouched. A request that cannot be
injected or captured fails alone. Captures are checked against the facts they
came from (the keys un-rotated).

Needs the library and numpy (pytest runs it: tests/vllm/launch.py).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
import types

import pytest

np = pytest.importorskip("numpy")

import kvinject as kvi  # noqa: E402
from kvinject.vllm import _compat  # noqa: E402
from kvinject.vllm.config import KVInjectConfig  # noqa: E402
from kvinject.vllm.metadata import CaptureJob, FailJob, InjectJob, KVInjectMetadata, PrefetchJob, RemoveJob  # noqa: E402
from kvinject.vllm.worker import KVInjectWorker  # noqa: E402

L, H, D, BS, NB = 2, 2, 16, 16, 6
THETA = 10000.0


def layer_name(i):
    return "model.layers.%d.self_attn.attn" % i


# --------------------------------------------------------------- vLLM fakes

def fake_vllm_config(extra):
    hf = types.SimpleNamespace(model_type="llama", num_hidden_layers=L, num_attention_heads=2 * H,
                               num_key_value_heads=H, head_dim=D, hidden_size=2 * H * D, rope_theta=THETA,
                               max_position_embeddings=4096)
    attn = types.SimpleNamespace(attn_backend=types.SimpleNamespace(get_name=lambda: "CPU_ATTN"), isa="vec",
                                 head_size=D)
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(kv_connector_extra_config=extra),
        cache_config=types.SimpleNamespace(block_size=BS, cache_dtype="auto"),
        model_config=types.SimpleNamespace(hf_config=hf, dtype="float32"),
        compilation_config=types.SimpleNamespace(static_forward_context={layer_name(i): attn for i in range(L)}))


class Arrays:
    """The cache's array library: numpy, or torch CPU tensors (read through numpy views)."""

    def __init__(self, name):
        self.name = name
        self.torch = pytest.importorskip("torch") if name == "torch" else None

    def nan_cache(self, heads):
        shape = (L, NB, heads, BS, 2 * D)
        if self.torch is not None:
            return self.torch.full(shape, float("nan"), dtype=self.torch.float32)
        return np.full(shape, np.nan, dtype=np.float32)

    def numpy(self, a):
        return a.numpy() if self.torch is not None else a


@pytest.fixture(params=["numpy", "torch"])
def arrays(request):
    return Arrays(request.param)


class Rig:
    """A registered worker over a NaN-filled cache, and what the tests read back."""

    def __init__(self, arrays, monkeypatch, tmp_path, extra=None, tp=(0, 1)):
        monkeypatch.setattr(_compat, "tensor_parallel", lambda: tp)
        self.events_path = str(tmp_path / "ev")
        self.extra = dict({"store_budget_mb": 8, "events_path": self.events_path}, **(extra or {}))
        self.cfg = KVInjectConfig.from_extra(self.extra, BS)
        self.worker = KVInjectWorker(fake_vllm_config(self.extra), self.cfg)
        self.tp_rank, self.heads = tp[0], H // tp[1]
        self.cache = arrays.nan_cache(self.heads)
        self.np = arrays.numpy(self.cache)
        # vLLM's dict need not be in layer order
        self.worker.register_kv_caches({layer_name(i): self.cache[i] for i in reversed(range(L))})
        self.store = self.worker.store
        self.rng = np.random.default_rng(7)
        self.facts = {}

    def put(self, tenant, fid, n, **kw):
        k = self.rng.standard_normal((L, n, self.heads, D)).astype(np.float32)
        v = self.rng.standard_normal((L, n, self.heads, D)).astype(np.float32)
        self.store.put(tenant, fid, k, v, **kw)
        self.facts[(tenant, fid)] = (k, v)
        return k, v

    def kv(self, layer, block, t):
        """K and V ([heads, D]) of a token as vLLM's CPU kernels read them: per (block,
        head) K as [D][BS], then V as [BS][D]."""
        region = self.np[layer, block].reshape(self.heads, 2 * D * BS)
        k = region[:, :D * BS].reshape(self.heads, D, BS)[:, :, t]
        v = region[:, D * BS:].reshape(self.heads, BS, D)[:, t, :]
        return k, v

    def reference(self, tenant, fact_ids, first):
        """The library's CPU injection of the facts into a plain [1, heads, slots, D]
        cache per layer from slot ``first`` on: {slot: (K, V) of [L, heads, D]}."""
        n = first + sum(self.store.fact_tokens(tenant, f) for f in fact_ids)
        keys = [np.full((1, self.heads, n, D), np.nan, dtype=np.float32) for _ in range(L)]
        vals = [np.full((1, self.heads, n, D), np.nan, dtype=np.float32) for _ in range(L)]
        inj = kvi.Injector(self.store, kvi.CacheLayout.hf(keys, vals))
        inj.inject(kvi.InjectRequest(tenant, list(fact_ids), [0], first_slot=first, start_position=first))
        inj.close()
        return {s: (np.stack([k[0, :, s] for k in keys]), np.stack([v[0, :, s] for v in vals]))
                for s in range(first, n)}

    def check_written(self, tenant, fact_ids, first, blocks, layers=range(L)):
        """The cache holds the reference's K and V at every slot the facts fill;
        returns the (layer, block, token) cells checked."""
        ref = self.reference(tenant, fact_ids, first)
        cells = set()
        for s, (rk, rv) in ref.items():
            b, t = blocks[s // BS], s % BS
            for layer in layers:
                k, v = self.kv(layer, b, t)
                assert np.array_equal(k, rk[layer]), "K of slot %d, layer %d" % (s, layer)
                assert np.array_equal(v, rv[layer]), "V of slot %d, layer %d" % (s, layer)
                cells.add((layer, b, t))
        return cells

    def untouched_except(self, cells):
        """Every cache cell (layer, block, token) not in ``cells`` still holds NaN."""
        for layer in range(L):
            for b in range(NB):
                for t in range(BS):
                    if (layer, b, t) not in cells:
                        k, v = self.kv(layer, b, t)
                        assert np.isnan(k).all() and np.isnan(v).all(), "cell %s changed" % ((layer, b, t),)

    def events(self, kind=None):
        self.worker._events.flush()  # the records queued since the worker's last flush
        with open(self.events_path + ".worker%d.jsonl" % self.tp_rank) as f:
            recs = [json.loads(line) for line in f]
        return [e for e in recs if kind is None or e["event"] == kind]


@pytest.fixture
def rig(arrays, monkeypatch, tmp_path):
    r = Rig(arrays, monkeypatch, tmp_path)
    yield r
    r.worker.shutdown()


def meta(injects=(), captures=(), failures=()):
    return KVInjectMetadata(list(injects), list(captures), list(failures))


# ------------------------------------------------------------------ register

def test_register_derives_vllms_cpu_layout_and_makes_a_cpu_store(rig):
    (rec,) = rig.events("register")
    assert (rec["backend"], rec["isa"], rec["layers"], rec["local_heads"], rec["head_size"]) == \
        ("CPU_ATTN", "vec", L, H, D)
    assert (rec["block_size"], rec["num_blocks"], rec["dtype"], rec["tp_rank"], rec["tp_size"]) == \
        (BS, NB, "FP32", 0, 1)
    s = rig.store
    assert (s.num_layers, s.num_heads, s.head_size, s.embedding_dim) == (L, H, D, 0)
    assert rig.worker.get_finished({"a", "b"}) == (None, None)
    rig.untouched_except(set())


# ------------------------------------------------------------------ injection

def test_a_steps_requests_land_in_their_blocks_as_the_library_writes_them(rig):
    rig.put(1, 1, 5)
    rig.put(1, 2, 20)
    rig.put(2, 1, 7)  # another tenant, the same fact id
    # tenant 1's two facts from slot 0 over blocks 4 and 1; tenant 2's fact after
    # a local prefix hit of 3 tokens, in blocks 2 and 5
    m = meta([InjectJob("a", 1, [(1, 0, 5), (2, 5, 20)], [4, 1]), InjectJob("b", 2, [(1, 3, 7)], [2, 5])])
    rig.worker.start_load_kv(m)
    cells = rig.check_written(1, [1, 2], 0, [4, 1]) | rig.check_written(2, [1], 3, [2, 5])
    rig.untouched_except(cells)
    assert not rig.worker.layers_pending()  # all layers written: vLLM's per-layer hooks are skipped
    assert rig.worker.get_block_ids_with_load_errors() == set()
    # the step's record is written when the step ends (after vLLM enqueued the forward)
    assert rig.events("inject") == []
    rig.worker.wait_for_save(m)
    (rec,) = rig.events("inject")
    assert (rec["requests"], rec["facts"], rec["tokens"], rec["layerwise"], rec["step"]) == (2, 3, 32, False, 1)
    # the same metadata is gone with the step: a step without it writes nothing more
    rig.worker.start_load_kv(None)
    assert len(rig.events("inject")) == 1


def test_a_step_started_early_is_not_started_again_by_start_load_kv(rig):
    # the connector starts a step from handle_preemptions (vLLM's first call of the step,
    # before it prepares the inputs), then vLLM's start_load_kv binds the same metadata
    rig.put(1, 1, 5)
    m = meta([InjectJob("a", 1, [(1, 0, 5)], [4])])
    rig.worker.start_load_kv(m, hook="handle_preemptions")
    cells = rig.check_written(1, [1], 0, [4])
    rig.worker.start_load_kv(m)
    rig.untouched_except(cells)
    rig.worker.wait_for_save(m)
    assert [(r["step"], r["hook"]) for r in rig.events("inject")] == [(1, "handle_preemptions")]
    assert rig.worker.build_connector_worker_meta().results["a"].injected_facts == 1
    assert rig.worker.get_kv_connector_stats().data["ranks"]["0"]["facts_injected"] == 1  # counted once
    # a vLLM without the early call: start_load_kv starts the next step
    m2 = meta([InjectJob("b", 1, [(1, 0, 5)], [3])])
    rig.worker.start_load_kv(m2)
    rig.worker.wait_for_save(m2)
    assert [(r["step"], r["hook"]) for r in rig.events("inject")] == [(1, "handle_preemptions"),
                                                                       (2, "start_load_kv")]


def test_a_step_without_wait_for_save_still_writes_its_record(rig):
    # vLLM's no-forward path calls start_load_kv but not wait_for_save: the record
    # comes out with the next step's start, or at shutdown
    rig.put(1, 1, 5)
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [4])]))
    assert rig.events("inject") == []
    rig.worker.start_load_kv(None)
    assert [r["requests"] for r in rig.events("inject")] == [1]
    rig.worker.start_load_kv(meta([InjectJob("b", 1, [(1, 0, 5)], [3])]))
    rig.worker.shutdown()
    assert [r["step"] for r in rig.events("inject")] == [1, 2]


def test_without_an_events_file_a_step_builds_no_record(arrays, monkeypatch, tmp_path):
    # the step's record is built only for an events file: without one the hot path
    # skips it (and the injection still lands)
    r = Rig(arrays, monkeypatch, tmp_path, extra={"events_path": None})
    try:
        assert not r.worker._events.enabled
        r.put(1, 1, 5)
        m = meta([InjectJob("a", 1, [(1, 0, 5)], [4])])
        r.worker.start_load_kv(m)
        assert r.worker._step_record is None and r.worker._timing is None
        r.check_written(1, [1], 0, [4])
        r.worker.wait_for_save(m)
        assert not os.path.exists(r.events_path + ".worker0.jsonl")
    finally:
        r.worker.shutdown()
    # with one, the step leaves its record to write
    (tmp_path / "with").mkdir()
    r = Rig(arrays, monkeypatch, tmp_path / "with")
    try:
        r.put(1, 1, 5)
        r.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [4])]))
        assert r.worker._step_record is not None
    finally:
        r.worker.shutdown()


def test_failures_are_isolated_per_request(rig):
    rig.put(1, 1, 5)
    rig.put(1, 2, 20)
    good = InjectJob("good", 1, [(1, 0, 5), (2, 5, 20)], [0, 1])
    bad = [
        InjectJob("unknown", 1, [(1, 0, 5), (77, 5, 3)], [2]),          # no fact 77
        InjectJob("tenant", 3, [(1, 0, 5)], [3]),                       # another tenant's fact
        InjectJob("length", 1, [(1, 0, 6)], [4]),                       # a span longer than the fact
        InjectJob("blocks", 1, [(1, 0, 5), (2, 5, 20)], [5]),           # 25 tokens, one block
        InjectJob("range", 1, [(1, 0, 5)], [NB + 3]),                   # a block the cache does not have
    ]
    fail = FailJob("params", "kvinject parameters need a tenant", [5])  # the scheduler's
    rig.worker.start_load_kv(meta([bad[0], good] + bad[1:], failures=[fail]))
    assert rig.worker.get_block_ids_with_load_errors() == {2, 3, 4, 5, NB + 3}
    assert rig.worker.get_block_ids_with_load_errors() == set()  # reported once
    rig.untouched_except(rig.check_written(1, [1, 2], 0, [0, 1]))
    errors = {e["req_id"]: e["message"] for e in rig.events("request_error")}
    assert set(errors) == {"unknown", "tenant", "length", "blocks", "range", "params"}
    assert "77" in errors["unknown"]
    assert "fact 1 of tenant 1 has 5 tokens; the prompt's span for it at token 0 has 6" in errors["length"]
    assert "the facts end at token 25; the request has 1 blocks of 16" in errors["blocks"]
    assert errors["params"] == "kvinject parameters need a tenant"
    # the next step injects again
    rig.worker.start_load_kv(meta([InjectJob("later", 1, [(1, 0, 5)], [2])]))
    assert rig.worker.get_block_ids_with_load_errors() == set()
    rig.check_written(1, [1], 0, [2])


def test_a_fact_whose_stored_token_ids_differ_from_the_prompts_fails_its_request_alone(rig):
    rig.put(1, 1, 3, token_ids=[11, 12, 13])
    rig.put(1, 2, 2, token_ids=[21, 22])
    rig.put(1, 3, 2)  # stored without token ids
    rig.put(1, 4, 20, token_ids=list(range(100, 120)))
    good = InjectJob("good", 1, [(1, 0, 3), (2, 3, 2)], [0], [11, 12, 13, 21, 22])
    bad = [
        InjectJob("differs", 1, [(1, 0, 3), (2, 3, 2)], [1], [11, 12, 13, 21, 99]),  # the last token
        InjectJob("none", 1, [(3, 0, 2)], [2], [1, 2]),                               # no ids stored
        InjectJob("count", 1, [(1, 0, 3)], [3], [11, 12]),                           # too few ids
        # jobs with ids are checked by the library alone: these fail there, not in the worker
        InjectJob("span", 1, [(1, 0, 4)], [4], [11, 12, 13, 21]),                    # a span past its fact
        InjectJob("unknown", 1, [(1, 0, 3), (77, 3, 2)], [5], [11, 12, 13, 1, 2]),   # no fact 77
        InjectJob("range", 1, [(1, 0, 3)], [NB + 3], [11, 12, 13]),                  # a block not in the cache
        InjectJob("blocks", 1, [(4, 0, 20)], [6], list(range(100, 120))),             # 20 tokens, one block
    ]
    rig.worker.start_load_kv(meta([bad[0], good] + bad[1:]))
    assert rig.worker.get_block_ids_with_load_errors() == {1, 2, 3, 4, 5, 6, NB + 3}
    rig.untouched_except(rig.check_written(1, [1, 2], 0, [0]))
    errors = {e["req_id"]: e["message"] for e in rig.events("request_error")}
    assert set(errors) == {"differs", "none", "count", "span", "unknown", "range", "blocks"}
    assert "the facts end at token 20; the request has 1 blocks of 16" in errors["blocks"]
    assert "fact 1 of tenant 1 has 3 tokens; the prompt's span for it at token 0 has 4" in errors["span"]
    assert "77" in errors["unknown"]
    assert "fact 2 of tenant 1: its token 1 (sequence slot 4) is 99 in expect_token_ids, 22 stored" in errors["differs"]
    assert "has no stored token ids" in errors["none"]
    # unchecked jobs (no expected ids) inject as before
    rig.worker.start_load_kv(meta([InjectJob("unchecked", 1, [(3, 0, 2)], [2])]))
    assert rig.worker.get_block_ids_with_load_errors() == set()


def test_a_job_with_no_facts_left_writes_nothing(rig):
    rig.worker.start_load_kv(meta([InjectJob("cached", 1, [], [0, 1])]))
    assert rig.events("inject") == [] and rig.worker.get_block_ids_with_load_errors() == set()
    rig.untouched_except(set())


def test_no_metadata_means_nothing_to_do(rig):
    rig.put(1, 1, 5)
    for m in (None, object()):
        rig.worker.start_load_kv(m)
        rig.worker.wait_for_save(m)
    rig.worker.save_kv_layer(layer_name(0), rig.cache[0], None)
    assert [e["event"] for e in rig.events()] == ["register"]
    rig.untouched_except(set())


@pytest.fixture
def layerwise_rig(arrays, monkeypatch, tmp_path):
    r = Rig(arrays, monkeypatch, tmp_path, extra={"layerwise": True})
    yield r
    r.worker.shutdown()


def test_layerwise_injection_writes_each_layer_when_vllm_reaches_it(layerwise_rig):
    rig = layerwise_rig
    rig.put(1, 1, 5)
    rig.put(1, 2, 20)
    m = meta([InjectJob("a", 1, [(1, 0, 5), (2, 5, 20)], [3, 0]), InjectJob("bad", 1, [(9, 0, 4)], [1])])
    rig.worker.start_load_kv(m)
    assert rig.worker.get_block_ids_with_load_errors() == {1}
    assert rig.worker.layers_pending()  # vLLM must call wait_for_layer_load at each layer
    layer0 = rig.check_written(1, [1, 2], 0, [3, 0], layers=[0])
    rig.untouched_except(layer0)  # layer 1 not yet
    rig.worker.wait_for_layer_load(layer_name(0))  # done before the forward
    rig.worker.wait_for_layer_load("model.layers.7.self_attn.attn")  # not a layer of this cache
    rig.untouched_except(layer0)
    rig.worker.wait_for_layer_load(layer_name(1))
    rig.untouched_except(rig.check_written(1, [1, 2], 0, [3, 0]))
    rig.worker.wait_for_save(m)
    assert not rig.worker.layers_pending()
    (rec,) = rig.events("inject_layers")
    assert (rec["layers"], rec["requests"], rec["step"]) == (L, 1, 1)
    assert rig.events("inject")[0]["layerwise"] is True
    # counted once every layer is in: "a" injected, "bad" failed
    res = rig.worker.build_connector_worker_meta().results
    assert (res["a"].injected_facts, res["a"].injected_tokens, res["bad"].inject_failed) == (2, 25, True)
    data = rig.worker.get_kv_connector_stats().data["ranks"]["0"]
    assert (data["requests_injected"], data["facts_injected"], len(data["inject_steps"])) == (1, 2, 1)


# ------------------------------------------------------------------- capture

def captured(rig, tenant, fid):
    n = rig.store.fact_tokens(tenant, fid)
    k = np.empty((L, n, rig.heads, D), dtype=np.float32)
    v = np.empty((L, n, rig.heads, D), dtype=np.float32)
    rig.store.read(tenant, fid, k, v)
    return k, v


def test_a_capture_stores_the_prefilled_span_with_its_keys_unrotated(rig):
    k1, v1 = rig.put(1, 1, 5)
    k2, v2 = rig.put(1, 2, 20)
    # the prompt's KV, as vLLM would have computed it: injected at slots 2..26
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 2, 5), (2, 7, 20)], [5, 0])]))
    cap = CaptureJob("c", 4, [(10, 2, 5, None, False), (11, 7, 20, None, False)], [5, 0])
    rig.worker.wait_for_save(meta(captures=[cap]))
    for fid, (k, v) in ((10, (k1, v1)), (11, (k2, v2))):
        ck, cv = captured(rig, 4, fid)
        assert np.array_equal(cv, v)  # V is not rotated
        assert np.abs(ck - k).max() <= 1e-5 * max(1.0, float(np.abs(k).max()))
    (rec,) = rig.events("capture")
    assert (rec["captures"], rec["stored"], rec["tokens"]) == (2, 2, 25)


def test_a_capture_keeps_the_prompts_token_ids_of_its_span(rig):
    rig.put(1, 1, 5)
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [3])]))
    ids = [[7, 8, 9], [10, 11]]
    cap = CaptureJob("c", 4, [(20, 0, 3, None, False), (21, 3, 2, None, False)], [3], ids)
    rig.worker.wait_for_save(meta(captures=[cap]))
    assert rig.store.fact_token_ids(4, 20)[0] == [7, 8, 9]
    assert rig.store.fact_token_ids(4, 21)[0] == [10, 11]


def test_captures_keep_their_context_and_removal_makes_them_stale(rig):
    rig.put(1, 1, 5)
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [3])]))
    rig.put(4, 1, 2)  # the injected fact, as tenant 4's
    # listed out of prompt order: the worker captures 20 (slots 0..2) before 21, which names it
    cap = CaptureJob("c", 4, [(21, 3, 2, None, False), (20, 0, 3, None, False)], [3], None, [[1, 20], [1]])
    rig.worker.wait_for_save(meta(captures=[cap]))
    assert rig.store.fact_context(4, 20) == ([1], False)
    assert rig.store.fact_context(4, 21) == ([1, 20], False)
    m = KVInjectMetadata(removes=[RemoveJob("rm", 4, [1])])
    rig.worker.start_load_kv(m)
    rig.worker.wait_for_save(m)
    assert rig.store.stale(4) == [20, 21]
    # a stale fact fails its request, counted as "stale"
    rig.worker.get_kv_connector_stats()
    rig.worker.start_load_kv(meta([InjectJob("s", 4, [(21, 0, 2)], [3])]))
    assert rig.worker.build_connector_worker_meta().results["s"].inject_failed
    assert rig.worker.get_kv_connector_stats().data["ranks"]["0"]["failures"] == {"stale": 1}
    # keep_dependents: removed alone
    m = KVInjectMetadata(removes=[RemoveJob("k", 4, [20], True)])
    rig.worker.start_load_kv(m)
    rig.worker.wait_for_save(m)
    assert rig.store.stale(4) == [21] and rig.store.list(4) == [21]


def test_capture_failures_are_isolated_per_fact(rig):
    rig.put(1, 1, 5)
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [2])]))
    rig.put(4, 10, 3)  # fact 10 of tenant 4 exists: capturing it again without replace fails
    caps = [CaptureJob("x", 4, [(10, 0, 5, None, False)], [2]), CaptureJob("y", 4, [(11, 0, 5, None, False)], [2]),
            CaptureJob("z", 4, [(12, 0, 5, None, True)], [2])]
    rig.worker.wait_for_save(meta(captures=caps))
    assert rig.store.fact_tokens(4, 10) == 3  # left as it was
    assert rig.store.fact_tokens(4, 11) == 5 and rig.store.fact_tokens(4, 12) == 5
    (err,) = rig.events("capture_error")
    assert (err["req_id"], err["fact_id"], err["tenant"]) == ("x", 10, 4)
    (rec,) = rig.events("capture")
    assert (rec["captures"], rec["stored"]) == (3, 2)
    # replace=True takes over an existing fact
    rig.worker.wait_for_save(meta(captures=[CaptureJob("r", 4, [(10, 0, 5, None, True)], [2])]))
    assert rig.store.fact_tokens(4, 10) == 5


def test_a_capture_keeps_its_embedding(arrays, monkeypatch, tmp_path):
    rig = Rig(arrays, monkeypatch, tmp_path, extra={"embedding_dim": 3})
    rig.put(1, 1, 5, embedding=[1.0, 0.0, 0.0])
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [1])]))
    rig.worker.wait_for_save(meta(captures=[CaptureJob("c", 2, [(7, 0, 5, [0.25, 0.5, 1.0], False)], [1])]))
    assert list(rig.store.get_embedding(2, 7)) == [0.25, 0.5, 1.0]
    rig.worker.shutdown()
    assert rig.worker.store is None


# ---------------------------------------------------------------- store file

def test_the_store_file_is_the_journal_and_is_loaded_at_start(arrays, monkeypatch, tmp_path):
    path = str(tmp_path / "facts.kvi")
    rig = Rig(arrays, monkeypatch, tmp_path, extra={"store_path": path})
    assert os.path.exists(path)
    k, v = rig.put(1, 1, 5)
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [0])]))
    rig.worker.wait_for_save(meta(captures=[CaptureJob("c", 2, [(3, 0, 5, None, False)], [0])]))
    rig.worker.shutdown()
    # a new worker (an engine restarted) has the facts of the file
    again = Rig(arrays, monkeypatch, tmp_path, extra={"store_path": path})
    assert again.store.fact_tokens(1, 1) == 5 and again.store.fact_tokens(2, 3) == 5
    ck, cv = captured(again, 1, 1)
    assert np.array_equal(ck, k) and np.array_equal(cv, v)
    again.worker.start_load_kv(meta([InjectJob("b", 1, [(1, 0, 5)], [3])]))
    again.untouched_except(again.check_written(1, [1], 0, [3]))
    again.worker.shutdown()


def test_with_tensor_parallelism_each_rank_has_its_heads_and_its_file(arrays, monkeypatch, tmp_path):
    path = str(tmp_path / "facts.kvi")
    rig = Rig(arrays, monkeypatch, tmp_path, extra={"store_path": path}, tp=(1, 2))
    assert os.path.exists(path + ".rank1") and not os.path.exists(path)
    (rec,) = rig.events("register")
    assert (rec["local_heads"], rec["tp_rank"], rec["tp_size"]) == (H // 2, 1, 2)
    assert rig.store.num_heads == H // 2
    rig.put(1, 1, 5)
    rig.worker.start_load_kv(meta([InjectJob("a", 1, [(1, 0, 5)], [4])]))
    rig.untouched_except(rig.check_written(1, [1], 0, [4]))
    rig.worker.shutdown()


# -------------------------------------------- results, removal, statistics

def test_the_startup_line_names_the_store(arrays, monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="vllm.kvinject.worker")
    rig = Rig(arrays, monkeypatch, tmp_path)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.kvinject.worker"]
    assert line.startswith("kvinject: store budget 8 MiB, dtype fp32, no store file: 0 facts of 0 tenants; "
                           "CPU_ATTN cache (vec) of 2 layers"), line
    path = str(tmp_path / "facts.kvi")
    rig.worker.shutdown()
    rig = Rig(arrays, monkeypatch, tmp_path, extra={"store_path": path, "store_dtype": "bf16"})
    rig.put(1, 1, 5)
    rig.put(2, 1, 3)
    rig.worker.shutdown()
    caplog.clear()
    again = Rig(arrays, monkeypatch, tmp_path, extra={"store_path": path, "store_dtype": "bf16"})
    (line,) = [r.getMessage() for r in caplog.records if r.name == "vllm.kvinject.worker"]
    assert ("dtype bf16, store file %s loaded: 2 facts of 2 tenants" % path) in line, line
    again.worker.shutdown()


def test_each_requests_results_and_the_steps_statistics_go_back(rig):
    rig.put(1, 1, 5)
    rig.put(1, 2, 20)
    assert rig.worker.get_kv_connector_stats() is not None  # the store at start
    m = meta([InjectJob("a", 1, [(1, 0, 5), (2, 5, 20)], [0, 1]), InjectJob("cached", 1, [], [2]),
              InjectJob("u", 1, [(9, 0, 4)], [3])],
             captures=[CaptureJob("c", 4, [(10, 0, 5, None, False)], [0])])
    rig.worker.start_load_kv(m)
    rig.worker.wait_for_save(m)
    res = rig.worker.build_connector_worker_meta()
    assert res.ranks == 1 and set(res.results) == {"a", "cached", "u", "c"}
    a, u, c = res.results["a"], res.results["u"], res.results["c"]
    assert (a.injected_facts, a.injected_tokens, a.inject_failed, a.errors) == (2, 25, False, [])
    assert res.results["cached"].injected_facts is None  # nothing to write: all in vLLM's prefix cache
    assert u.inject_failed and "9" in u.errors[0] and u.injected_facts is None
    assert c.captured == {10: 1} and c.errors == []
    assert rig.worker.build_connector_worker_meta() is None  # reported once; a step without jobs has none
    data = rig.worker.get_kv_connector_stats().data["ranks"]["0"]
    assert (data["requests_injected"], data["facts_injected"], data["tokens_injected"]) == (1, 2, 25)
    assert (data["captures_stored"], data["failures"]) == (1, {"not_found": 1})
    assert [s for s, _ in data["inject_steps"]] == [1] and data["inject_steps"][0][1] > 0
    assert data["store"] == {"bytes_used": rig.store.stats().bytes_used, "facts": 3, "tenants": 2}
    assert rig.worker.get_kv_connector_stats() is None


def test_failure_reasons_are_counted(rig):
    rig.put(1, 1, 5, token_ids=[1, 2, 3, 4, 5])
    rig.put(4, 10, 3)
    m = meta([InjectJob("nf", 1, [(7, 0, 5)], [0]), InjectJob("len", 1, [(1, 0, 4)], [1]),
              InjectJob("tok", 1, [(1, 0, 5)], [2], [1, 2, 3, 4, 9]), InjectJob("blk", 1, [(1, 0, 5)], [NB + 1])],
             captures=[CaptureJob("x", 4, [(10, 0, 5, None, False)], [4])],
             failures=[FailJob("p", "kvinject parameters need a tenant", [5])])
    rig.worker.get_kv_connector_stats()
    rig.worker.start_load_kv(m)
    rig.worker.wait_for_save(m)
    fails = rig.worker.get_kv_connector_stats().data["ranks"]["0"]["failures"]
    assert fails == {"not_found": 1, "length": 1, "token_mismatch": 1, "other": 1, "parse": 1, "capture": 1}
    res = rig.worker.build_connector_worker_meta().results
    assert res["x"].captured == {} and res["x"].errors[0].startswith("capture of fact 10 (tenant 4) failed: ")
    assert res["p"].errors == ["kvinject parameters need a tenant"]


def test_a_request_whose_injection_failed_has_no_captures_taken_in_that_step(rig):
    rig.put(1, 1, 5)
    # "bad" injects an unknown fact and captures in the same step: its blocks
    # hold no valid KV, so its capture is skipped; "good"'s capture is stored
    m = meta([InjectJob("bad", 1, [(9, 0, 5)], [2]), InjectJob("good", 1, [(1, 0, 5)], [3])],
             captures=[CaptureJob("bad", 4, [(20, 0, 5, None, False), (21, 1, 2, None, False)], [2]),
                       CaptureJob("good", 4, [(30, 0, 5, None, False)], [3])])
    rig.worker.start_load_kv(m)
    rig.worker.wait_for_save(m)
    assert rig.store.list(4) == [30]
    res = rig.worker.build_connector_worker_meta().results
    assert res["bad"].skipped == [20, 21] and res["bad"].captured == {} and res["bad"].inject_failed
    assert res["good"].captured == {30: 1}
    (rec,) = rig.events("capture")
    assert (rec["captures"], rec["stored"], rec["skipped"]) == (1, 1, 2)
    assert rig.worker.get_block_ids_with_load_errors() == {2}  # vLLM fails (or recomputes) it


def test_removal_runs_first_skips_missing_facts_and_all_removes_the_tenants(rig):
    for fid in (1, 2, 3):
        rig.put(1, fid, 4)
    rig.put(2, 1, 4)
    used = rig.store.stats().bytes_used
    rig.worker.get_kv_connector_stats()
    # fact 2 removed before the same step's injection of it, which then fails
    m = KVInjectMetadata(injects=[InjectJob("late", 1, [(2, 0, 4)], [0])],
                         removes=[RemoveJob("rm", 1, [2, 7]), RemoveJob("all", 2, None)])
    rig.worker.start_load_kv(m)
    rig.worker.wait_for_save(m)
    assert rig.store.list(1) == [1, 3] and rig.store.list(2) == []
    res = rig.worker.build_connector_worker_meta().results
    assert (res["rm"].removed, res["rm"].errors) == ([2], [])  # 7 was not there: not listed, no error
    assert res["all"].removed == [1]
    assert res["late"].inject_failed
    data = rig.worker.get_kv_connector_stats().data["ranks"]["0"]
    assert data["facts_removed"] == 2 and data["failures"] == {"not_found": 1}
    assert data["store"]["facts"] == 2 and data["store"]["tenants"] == 1 and data["store"]["bytes_used"] < used
    assert [(e["req_id"], e["asked"], e["removed"]) for e in rig.events("remove")] == [("rm", 2, 1), ("all", "all", 1)]


# ------------------------------------------------------------- the disk tier

def disk_rig(arrays, monkeypatch, tmp_path, owner, **extra):
    disk = tmp_path / "disk"
    disk.mkdir(exist_ok=True)
    return Rig(arrays, monkeypatch, tmp_path, dict({"store_budget_mb": 1, "disk_dir": str(disk), "disk_owner": owner},
                                                   **extra))


def disk_only(store, tenant):
    return [f for f in store.list(tenant) if store.fact_tier(tenant, f) == kvi.Tier.DISK]


def test_a_disk_tier_store_injects_facts_read_back_and_reports_what_is_on_disk(arrays, monkeypatch, tmp_path):
    rig = disk_rig(arrays, monkeypatch, tmp_path, "a")
    try:
        st = rig.store.stats()
        per = st.pages_total  # 1 MiB of one-page facts (BS == page_tokens == 16)
        for fid in range(per + 8):
            rig.put(1, fid, BS)
        assert disk_only(rig.store, 1)[:8] == list(range(8))  # the oldest went to disk
        rig.worker.get_kv_connector_stats()
        m = meta([InjectJob("r", 1, [(0, 0, BS), (per + 7, BS, BS)], [2, 4])])  # 0 only on disk
        rig.worker.start_load_kv(m)
        rig.worker.wait_for_save(m)
        cells = rig.check_written(1, [0, per + 7], 0, [2, 4])
        rig.untouched_except(cells)
        assert rig.store.fact_tier(1, 0) == kvi.Tier.HOST  # read back by the injection
        wm = rig.worker.build_connector_worker_meta()
        assert wm.results["r"].injected_facts == 2
        assert wm.disk_facts == {1: disk_only(rig.store, 1)} and 0 not in wm.disk_facts[1]
        assert wm.bytes_per_token == st.page_bytes / st.page_tokens
        assert wm.disk_read_bytes_s > 0  # measured: the injection read fact 0 back
        assert rig.worker.build_connector_worker_meta() is None  # nothing changed since
        # a prefetch of two disk-only facts runs in the background; the next report has them in memory
        down = disk_only(rig.store, 1)[:2]
        m = KVInjectMetadata(prefetches=[PrefetchJob("p", 1, down)], hybrid={"inject": 1, "text": 2})
        rig.worker.start_load_kv(m)
        rig.worker.wait_for_save(m)
        rig.worker.wait_prefetches()  # the library reads them back on its own thread: wait for that too
        deadline = time.monotonic() + 10
        while [rig.store.fact_tier(1, f) for f in down] != [kvi.Tier.HOST] * 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        wm = rig.worker.build_connector_worker_meta()
        assert set(down).isdisjoint(wm.disk_facts[1]) and wm.disk_facts[1] == disk_only(rig.store, 1)
        data = rig.worker.get_kv_connector_stats().data["ranks"]["0"]
        assert data["prefetches"] == 1 and data["hybrid"] == {"inject": 1, "text": 2}
        assert [(e["req_id"], e["tenant"], e["facts"]) for e in rig.events("prefetch")] == [("p", 1, 2)]
    finally:
        rig.worker.shutdown()


def test_a_replica_loads_a_tenant_another_replica_wrote_to_the_shared_directory(arrays, monkeypatch, tmp_path):
    a = disk_rig(arrays, monkeypatch, tmp_path, "replica-a")
    b = disk_rig(arrays, monkeypatch, tmp_path, "replica-b")
    try:
        for fid in (1, 2, 3):
            a.put(5, fid, 6)
        assert b.store.list(5) == []  # not read yet
        m = KVInjectMetadata(prefetches=[PrefetchJob("p", 5, None)])
        b.worker.start_load_kv(m)
        b.worker.wait_for_save(m)
        b.worker.wait_prefetches()
        assert b.store.list(5) == [1, 2, 3]
        for fid in (1, 2, 3):
            k, v = b.store.read(5, fid)
            assert np.array_equal(np.asarray(k).reshape(a.facts[(5, fid)][0].shape), a.facts[(5, fid)][0])
            assert np.array_equal(np.asarray(v).reshape(a.facts[(5, fid)][1].shape), a.facts[(5, fid)][1])
        assert b.worker.build_connector_worker_meta().disk_facts == {5: []}  # all in memory now
        m = meta([InjectJob("r", 5, [(1, 0, 6), (3, 6, 6)], [1])])
        b.worker.start_load_kv(m)
        b.worker.wait_for_save(m)
        b.untouched_except(b.check_written(5, [1, 3], 0, [1]))
        # B may not write the tenant while A holds its lease; once A gives it up, it may
        cap = CaptureJob("c", 5, [(9, 0, 4, None, False)], [1])
        b.worker.start_load_kv(meta(captures=[cap]))
        b.worker.wait_for_save(meta(captures=[cap]))
        res = b.worker.build_connector_worker_meta().results["c"]
        assert res.captured == {} and "ERR_LEASED" in res.errors[0] and "replica-a" in res.errors[0]
        a.worker.shutdown()  # closing the store gives its leases up
        b.worker.start_load_kv(meta(captures=[cap]))
        b.worker.wait_for_save(meta(captures=[cap]))
        assert b.worker.build_connector_worker_meta().results["c"].captured == {9: 1}
        assert b.store.list(5) == [1, 2, 3, 9]
    finally:
        a.worker.shutdown()
        b.worker.shutdown()


def test_the_disk_report_asks_only_about_tenants_whose_disk_facts_changed(arrays, monkeypatch, tmp_path):
    # before, a step with any drop or read back re-listed every tenant ever reported, a C call
    # per fact (7 ms for 40 tenants of 28 facts on the project's VM, at every such step)
    rig = disk_rig(arrays, monkeypatch, tmp_path, "a")
    store = rig.worker._store
    asked = []

    class Spy:
        def __getattr__(self, name):
            return getattr(store, name)

        def list_on_disk(self, tenant):
            asked.append(tenant)
            return store.list_on_disk(tenant)

        def fact_tier(self, tenant, fid):  # one call a tenant now, not one a fact
            raise AssertionError("the report asked fact_tier of fact %d of tenant %d" % (fid, tenant))
    try:
        per = rig.store.stats().pages_total
        for t in (1, 2):
            rig.put(t, 0, BS)
            m = KVInjectMetadata(prefetches=[PrefetchJob("p%d" % t, t, [0])])
            rig.worker.start_load_kv(m)
            rig.worker.wait_for_save(m)
            rig.worker.wait_prefetches()
            rig.worker.build_connector_worker_meta()  # both reported
        rig.worker._store = Spy()
        for fid in range(1, per):  # one more page than memory holds: tenant 1's oldest fact goes down
            rig.put(1, fid, BS)
        assert rig.store.fact_tier(2, 0) != kvi.Tier.DISK
        wm = rig.worker.build_connector_worker_meta()
        assert asked == [1] and set(wm.disk_facts) == {1}  # one call for the tenant
        assert wm.disk_facts[1] == disk_only(rig.store, 1) and wm.disk_facts[1]
        asked.clear()
        assert rig.worker.build_connector_worker_meta() is None and asked == []  # nothing changed since
    finally:
        rig.worker.shutdown()


def test_a_prefetch_of_named_facts_does_not_hold_up_an_injection_of_resident_ones(arrays, monkeypatch, tmp_path):
    # the scheduler prefetches a cold request's disk-only facts; the tenant's next request
    # injects what is resident without waiting for those reads (before, it waited for the
    # whole prefetch: 8 s at k = 50 on an 8B shape, where the prefetch read one entry per fact)
    rig = disk_rig(arrays, monkeypatch, tmp_path, "a")
    store = rig.worker._store
    release, started = threading.Event(), threading.Event()

    class BlockedPrefetch:  # the store, its prefetch held until the test lets it go (10 s at most)
        def __getattr__(self, name):
            return getattr(store, name)

        def prefetch(self, *args):
            started.set()
            release.wait(10)
            store.prefetch(*args)
    try:
        per = rig.store.stats().pages_total
        for fid in range(per + 4):
            rig.put(1, fid, BS)
        down = disk_only(rig.store, 1)[:2]
        rig.worker._store = BlockedPrefetch()
        p = KVInjectMetadata(prefetches=[PrefetchJob("p", 1, down)])
        rig.worker.start_load_kv(p)
        rig.worker.wait_for_save(p)
        assert started.wait(10)
        t = time.monotonic()
        m = meta([InjectJob("r", 1, [(per + 3, 0, BS)], [2])])  # resident
        rig.worker.start_load_kv(m)
        rig.worker.wait_for_save(m)
        assert not release.is_set() and time.monotonic() - t < 5  # done while the prefetch is held
        assert rig.worker.build_connector_worker_meta().results["r"].injected_facts == 1
        rig.untouched_except(rig.check_written(1, [per + 3], 0, [2]))
        release.set()
        rig.worker.wait_prefetches()
        assert [rig.store.fact_tier(1, f) for f in down] == [kvi.Tier.HOST] * 2
        done = rig.events("prefetch_done")
        assert [(e["tenant"], e["facts"], e["error"]) for e in done] == [(1, 2, None)]
        assert done[0]["prefetch_us"] > 0 and done[0]["wait_us"] >= 0
    finally:
        release.set()
        rig.worker.shutdown()


def test_an_injection_waits_for_its_tenants_prefetch_and_a_release_frees_the_lease(arrays, monkeypatch, tmp_path):
    a = disk_rig(arrays, monkeypatch, tmp_path, "replica-a")
    b = disk_rig(arrays, monkeypatch, tmp_path, "replica-b")
    try:
        # A captures fact 9 of tenant 6 and gives the lease up in the same step
        a.put(6, 1, 4)
        a.store.tenant_release(6)
        cap = CaptureJob("c", 6, [(9, 0, 4, None, False)], [2])
        m = KVInjectMetadata(captures=[cap], releases=[6])
        a.worker.start_load_kv(m)
        a.worker.wait_for_save(m)
        assert a.worker.build_connector_worker_meta().results["c"].captured == {9: 1}
        assert [e["tenant"] for e in a.events("release")] == [6]
        b.put(6, 2, 4)  # at once: A holds no lease
        # A's prefetch of the whole tenant reads B's fact from the file; the injection of the same step waits
        store = a.worker._store

        class SlowPrefetch:  # the store, its prefetch slow: the injection must wait for it
            def __getattr__(self, name):
                return getattr(store, name)

            def prefetch(self, *args):
                time.sleep(0.3)
                store.prefetch(*args)
        a.worker._store = SlowPrefetch()
        p = KVInjectMetadata(prefetches=[PrefetchJob("p", 6, None)])
        a.worker.start_load_kv(p)  # an earlier step starts the prefetch
        a.worker.wait_for_save(p)
        m = KVInjectMetadata(injects=[InjectJob("r", 6, [(2, 0, 4)], [3])])
        a.worker.start_load_kv(m)
        a.worker.wait_for_save(m)
        assert a.worker.build_connector_worker_meta().results["r"].injected_facts == 1
        a.untouched_except(a.check_written(6, [2], 0, [3]))
        assert a.store.list(6) == [1, 2, 9]
    finally:
        a.worker.shutdown()
        b.worker.shutdown()


def test_the_raw_stream_getter_asks_torch_for_the_handle(monkeypatch):
    # torch's accessor of the current stream's raw handle where torch has one (no
    # Stream object per step), else the handle of torch.cuda.current_stream
    from kvinject.vllm.worker import raw_stream_getter
    calls = []
    fake_c = types.SimpleNamespace(_cuda_getCurrentRawStream=lambda d: calls.append(d) or 1000 + d)
    fake = types.SimpleNamespace(_C=fake_c, cuda=types.SimpleNamespace(current_stream=None))
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    get = raw_stream_getter(3)
    assert (get(), get()) == (1003, 1003) and calls == [3, 3]
    streams = {2: types.SimpleNamespace(cuda_stream=77)}
    fake = types.SimpleNamespace(_C=types.SimpleNamespace(),
                                 cuda=types.SimpleNamespace(current_stream=lambda d: streams[d]))
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    get = raw_stream_getter(2)
    assert get() == 77
    streams[2] = types.SimpleNamespace(cuda_stream=78)  # the current stream changed: the getter follows
    assert get() == 78
