"""The vLLM connector's results and outcomes without vLLM: what the workers
send back each step (kvinject.vllm.results, combined over tensor-parallel
ranks as vLLM's KVOutputAggregator does with ``aggregate``), the outcome the
scheduler role returns from request_finished, removal requests, the scheduler
after a failed injection that vLLM recomputes, the connector's statistics and
Prometheus metrics (kvinject.vllm.stats) and its settings (kvinject.vllm.config
over kvinject.settings). The scheduler is driven as in
test_vllm_scheduler_unit.py (its fakes of vLLM's objects).

Needs only the library; the metrics test needs prometheus_client (vLLM's
environment has it). pytest runs it through tests/vllm/launch.py.
"""
from __future__ import annotations

import logging
import types

import pytest

from kvinject.vllm import Keep, _compat, capture_prompt, memory_prompt, remove_prompt
from kvinject.vllm.config import FIELDS, KVInjectConfig, requires_piecewise
from kvinject.vllm.prompt import PARAMS_KEY
from kvinject.vllm.results import KVInjectWorkerMeta, Outcome, RequestResult
from kvinject.vllm.scheduler import KVInjectScheduler
from kvinject.vllm.stats import COUNTERS, DECISIONS, REASONS, KVInjectPromMetrics, KVInjectStats, StatsRecorder, combine_ranks
from test_vllm_scheduler_unit import BS, FakeRequest, cached_reqs, claim, output, request

ENV = {}  # the settings' environment: none


@pytest.fixture
def sched():
    return KVInjectScheduler(KVInjectConfig.from_extra({}, BS, environ=ENV))


@pytest.fixture
def mp():
    return memory_prompt(9, [(1, [11, 12, 13]), (2, [21, 22, 23, 24, 25])], [41, 42, 43])


def step_output(results, ranks=1):
    """vLLM's KVConnectorOutput of a step, with the workers' combined metadata."""
    return types.SimpleNamespace(kv_connector_worker_meta=KVInjectWorkerMeta(results, ranks))


def finished(sched, r, status="FINISHED_LENGTH_CAPPED"):
    r.status = types.SimpleNamespace(name=status)
    delay, params = sched.request_finished(r, [])
    assert delay is False
    return params[PARAMS_KEY] if params is not None else None


# ------------------------------------------------------------------ outcomes

def test_an_injected_request_reports_its_facts_once_the_workers_results_are_in(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    claim(sched, r, blocks=[7, 8, 9])
    sched.update_connector_output(step_output({"r": RequestResult(injected_facts=2, injected_tokens=8)}))
    assert finished(sched, r) == {"tenant": 9, "injected_facts": 2, "injected_tokens": 8, "captured": [],
                                  "removed": [], "errors": [], "pending": False}


def test_a_request_finishing_in_the_step_of_its_jobs_is_pending(sched, mp):
    # vLLM frees a request that finished in a step before it hands the step's
    # worker results to update_connector_output: one output token is too few
    r = request("r", mp)
    sched.on_new_request(r)
    claim(sched, r, blocks=[7, 8, 9])
    out = finished(sched, r)
    assert out["pending"] is True and out["injected_facts"] == 0 and out["errors"] == []
    # the late results are dropped (the request is gone)
    sched.update_connector_output(step_output({"r": RequestResult(injected_facts=2, injected_tokens=8)}))


def test_a_capture_with_two_output_tokens_lists_the_stored_facts(sched):
    cp = capture_prompt(4, [Keep(10, [1, 2, 3]), [9], Keep(11, [4, 5])])
    r = request("c", cp)
    sched.on_new_request(r)
    _, m = claim(sched, r, blocks=[0, 1])
    assert [j.req_id for j in m.captures] == ["c"]
    sched.update_connector_output(step_output({"c": RequestResult(captured={10: 1, 11: 1})}))
    # the decode step: no jobs, nothing outstanding
    assert sched.build_connector_meta(output(cached=cached_reqs(("c", None, 6)), scheduled={"c": 1})).captures == []
    assert finished(sched, r) == {"tenant": 4, "injected_facts": 0, "injected_tokens": 0, "captured": [10, 11],
                                  "removed": [], "errors": [], "pending": False}


def test_a_failed_capture_is_an_error_and_not_listed(sched):
    cp = capture_prompt(4, [Keep(10, [1, 2, 3]), Keep(11, [4, 5]), [9]])
    r = request("c", cp)
    sched.on_new_request(r)
    claim(sched, r, blocks=[0, 1])
    msg = "capture of fact 10 (tenant 4) failed: fact exists"
    sched.update_connector_output(step_output({"c": RequestResult(captured={11: 1}, errors=[msg])}))
    out = finished(sched, r)
    assert (out["captured"], out["errors"], out["pending"]) == ([11], [msg], False)


def test_bad_parameters_are_in_the_outcome_with_the_tenant_when_it_is_valid(sched):
    r = FakeRequest("x", [11, 12, 41], {PARAMS_KEY: {"tenant": 3, "inject": [[1, 1, 2]]}})
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[2])
    assert n == 1 and len(meta.failures) == 1
    out = finished(sched, r, "FINISHED_ERROR")
    assert out["tenant"] == 3 and out["pending"] is True
    assert len(out["errors"]) == 1 and "back to back" in out["errors"][0]
    bad = FakeRequest("y", [1, 2], {PARAMS_KEY: {"tenant": -4, "inject": [[1, 0, 1]]}})
    sched.on_new_request(bad)
    assert finished(sched, bad)["tenant"] is None


def test_an_error_finish_without_a_message_says_so(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    claim(sched, r, blocks=[7, 8, 9])
    out = finished(sched, r, "FINISHED_ERROR")  # kv_load_failure_policy "fail": freed before the results
    assert out["pending"] is True and "vLLM finished the request with an error" in out["errors"][0]


def test_plain_requests_get_no_outcome(sched):
    r = request("p", ids=[1, 2, 3])
    sched.on_new_request(r)
    claim(sched, r, blocks=[0])
    assert finished(sched, r) is None


def test_a_vllm_without_the_worker_metadata_channel_leaves_outcomes_pending(sched, mp):
    r = request("r", mp)
    sched.on_new_request(r)
    claim(sched, r, blocks=[7, 8, 9])
    sched.update_connector_output(types.SimpleNamespace())  # a KVConnectorOutput without kv_connector_worker_meta
    sched.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=object()))  # another connector's
    sched.build_connector_meta(output(cached=cached_reqs(("r", None, 11)), scheduled={"r": 1}))
    assert finished(sched, r)["pending"] is True


# ------------------------------------------------------------------ removal

def test_a_remove_request_is_sent_once_claims_nothing_and_reports_the_removed_ids(sched):
    rp = remove_prompt(6, [4, 5, 6], 17)
    r = request("rm", rp)
    sched.on_new_request(r)
    assert r.cache_salt is None  # nothing injected: its block is a plain one
    n, meta = claim(sched, r, blocks=[3])
    assert n == 0 and meta.injects == [] and meta.captures == []
    (job,) = meta.removes
    assert (job.req_id, job.tenant, job.fact_ids) == ("rm", 6, [4, 5, 6])
    sched.update_connector_output(step_output({"rm": RequestResult(removed=[4, 6])}))  # 5 was not there
    again = sched.build_connector_meta(output(cached=cached_reqs(("rm", None, 1), resumed=["rm"]), scheduled={"rm": 1}))
    assert again.removes == []
    assert finished(sched, r) == {"tenant": 6, "injected_facts": 0, "injected_tokens": 0, "captured": [],
                                  "removed": [4, 6], "errors": [], "pending": False}


def test_remove_all_and_a_capture_go_in_the_same_step(sched):
    cp = capture_prompt(6, [Keep(1, [1, 2]), [3]])
    cp.params["remove"] = "all"
    r = request("x", cp)
    sched.on_new_request(r)
    _, meta = claim(sched, r, blocks=[0])
    assert [(j.tenant, j.fact_ids) for j in meta.removes] == [(6, None)]
    assert [j.captures[0][0] for j in meta.captures] == [1]


# --------------------------------------------- a failed injection, recomputed

def test_after_a_failed_injection_vllm_recomputes_the_captures_are_retaken_and_nothing_is_injected_again(sched):
    mp = memory_prompt(3, [(1, [1, 2, 3, 4])], [5, 6, 7])
    mp.params["capture"] = [{"fact_id": 2, "start": 4, "length": 2}]
    r = request("x", mp)
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[5, 6])
    assert n == 4 and len(meta.injects) == 1 and len(meta.captures) == 1
    msg = "fact 1 of tenant 3: not found"
    # the worker failed the injection and skipped the request's capture of that step
    sched.update_connector_output(step_output({"x": RequestResult(inject_failed=True, errors=[msg], skipped=[2])}))
    # kv_load_failure_policy "recompute": vLLM prefills the whole prompt from token 0
    m2 = sched.build_connector_meta(output(cached=cached_reqs(("x", None, 0)), scheduled={"x": 7}))
    assert m2.injects == []
    (cap,) = m2.captures
    assert cap.captures == [(2, 4, 2, None, False)] and cap.token_ids == [[5, 6]]
    sched.update_connector_output(step_output({"x": RequestResult(captured={2: 1})}))
    # preempted and resumed later: no claim, no injection
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, None, 0)
    m3 = sched.build_connector_meta(output(cached=cached_reqs(("x", [1, 2], 0), resumed=["x"]), scheduled={"x": 7}))
    assert m3.injects == [] and m3.captures == []
    assert finished(sched, r) == {"tenant": 3, "injected_facts": 0, "injected_tokens": 0, "captured": [2],
                                  "removed": [], "errors": [msg], "pending": False}


def test_a_bad_request_sends_its_failure_once(sched):
    r = FakeRequest("x", [11, 12, 41], {PARAMS_KEY: {"tenant": 3}})
    sched.on_new_request(r)
    n, meta = claim(sched, r, blocks=[2])
    assert n == 1 and len(meta.failures) == 1
    # recomputed (policy "recompute") and later resumed: the failure is not sent again
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    m = sched.build_connector_meta(output(cached=cached_reqs(("x", [3], 0), resumed=["x"]), scheduled={"x": 3}))
    assert m.failures == []


# ------------------------------------------------- tensor-parallel results

def test_ranks_results_combine_a_capture_counts_when_every_rank_stored_it():
    r0 = KVInjectWorkerMeta({"a": RequestResult(injected_facts=3, injected_tokens=30, captured={7: 1, 8: 1},
                                                removed=[1]),
                             "b": RequestResult(captured={9: 1})})
    r1 = KVInjectWorkerMeta({"a": RequestResult(injected_facts=3, injected_tokens=30, captured={7: 1},
                                                errors=["capture of fact 8 (tenant 1) failed: no room"],
                                                removed=[1, 2]),
                             "b": RequestResult(captured={9: 1})})
    both = r0.aggregate(r1)
    assert both.ranks == 2
    a = both.results["a"]
    assert (a.injected_facts, a.injected_tokens, a.captured, a.removed) == (3, 30, {7: 2, 8: 1}, [1, 2])
    assert a.errors == ["capture of fact 8 (tenant 1) failed: no room"]
    out = Outcome(1)
    out.outstanding = 1
    out.add(a, both.ranks)
    assert out.to_params() == {"tenant": 1, "injected_facts": 3, "injected_tokens": 30, "captured": [7],
                               "removed": [1, 2], "errors": ["capture of fact 8 (tenant 1) failed: no room"],
                               "pending": False}


def test_ranks_results_combine_one_ranks_failed_injection_fails_the_request():
    ok = RequestResult(injected_facts=2, injected_tokens=9)
    bad = RequestResult(inject_failed=True, errors=["e"], skipped=[4])
    same_msg = RequestResult(inject_failed=True, errors=["e"])
    c = ok.combine(bad).combine(same_msg)
    assert (c.injected_facts, c.inject_failed, c.errors, c.skipped) == (2, True, ["e"], [4])
    out = Outcome(5)
    assert out.add(c, 3) is True  # the skipped captures are retaken
    assert out.to_params()["injected_facts"] == 0 and out.to_params()["errors"] == ["e"]
    # a rank without an injection this step does not lower the other's
    assert RequestResult().combine(ok).injected_tokens == 9 and ok.combine(RequestResult()).injected_tokens == 9
    # three ranks: vLLM folds them one by one
    m = KVInjectWorkerMeta({"r": RequestResult(captured={1: 1})})
    m = m.aggregate(KVInjectWorkerMeta({"r": RequestResult(captured={1: 1})}))
    m = m.aggregate(KVInjectWorkerMeta({"r": RequestResult(captured={1: 1}), "s": RequestResult()}))
    assert (m.ranks, m.results["r"].captured, set(m.results)) == (3, {1: 3}, {"r", "s"})


# --------------------------------------------------------------- statistics

def rank_stats(rank, **kw):
    rec = StatsRecorder(rank)
    for k, v in kw.items():
        if k == "fail":
            for reason in v:
                rec.failed(reason)
        elif k == "steps":
            for step, s in v:
                rec.inject_step(step, s)
        elif k == "store":
            rec.store(*v)
        elif k == "hybrid":
            for decision, n in v.items():
                rec.hybrid(decision, n)
        else:
            rec.add(k, v)
    return rec.take()


def test_a_recorder_reports_only_when_something_happened():
    rec = StatsRecorder(0)
    assert rec.take() is None
    rec.add("facts_injected", 0)
    assert rec.take() is None
    rec.failed("no such reason")
    st = rec.take()
    assert st.data["ranks"]["0"]["failures"] == {"other": 1}
    assert rec.take() is None


def test_stats_combine_ranks_as_one_engine_and_reduce_for_the_log():
    a = rank_stats(0, requests_injected=2, facts_injected=6, tokens_injected=60, fail=["not_found"],
                   steps=[(1, 0.002), (2, 0.001)], store=(1000, 5, 2))
    b = rank_stats(1, requests_injected=2, facts_injected=6, tokens_injected=60, fail=["not_found", "capture"],
                   steps=[(1, 0.003), (2, 0.0005)], store=(1100, 5, 2))
    a.aggregate(b)
    c = combine_ranks(a.data)
    assert (c["requests_injected"], c["facts_injected"], c["tokens_injected"]) == (2, 6, 60)
    assert c["failures"] == {"capture": 1, "not_found": 1}
    assert c["inject_seconds"] == [0.003, 0.001]  # per step, the slowest rank
    assert c["store"] == {"0": {"bytes_used": 1000, "facts": 5, "tenants": 2},
                          "1": {"bytes_used": 1100, "facts": 5, "tenants": 2}}
    red = a.reduce()
    assert (red["facts_injected"], red["failures"], red["inject_steps"], red["inject_ms_max"]) == (6, 2, 2, 3.0)
    assert (red["store_bytes_used"], red["store_facts"], red["store_tenants"]) == (2100, 5, 2)
    assert all(isinstance(v, (int, float)) for v in red.values())
    # later steps add up; a store snapshot alone is no news for the log
    a.aggregate(rank_stats(0, captures_stored=3))
    assert combine_ranks(a.data)["captures_stored"] == 3
    assert not a.is_empty()
    assert rank_stats(0, store=(1, 1, 1)).is_empty()
    a.reset()
    assert a.is_empty() and a.data == {}


def test_stats_rebuilt_from_data_are_a_copy_that_aggregating_leaves_the_data_alone():
    # vLLM hands the same data to its log line (which aggregates into the stats it
    # rebuilds) and to Prometheus: the rebuilt stats must own every dict and list
    import copy
    from kvinject.vllm.stats import copy_data
    data = rank_stats(0, requests_injected=1, facts_injected=3, fail=["not_found"], steps=[(4, 0.004)],
                      store=(4096, 7, 2), hybrid={"inject": 2}).data
    before = copy.deepcopy(data)
    acc = KVInjectStats(data=copy_data(data))
    acc.aggregate(rank_stats(0, requests_injected=2, fail=["not_found", "capture"], steps=[(5, 0.005)],
                             store=(8192, 9, 3), hybrid={"inject": 1, "text": 4}))
    assert data == before
    r = acc.reduce()
    assert (r["requests_injected"], r["failures"], r["inject_steps"], r["store_bytes_used"]) == (3, 3, 2, 8192)
    assert copy_data(None) == {} and copy_data({}) == {}


def test_stats_of_nothing():
    empty = KVInjectStats(data={})
    assert empty.is_empty()
    assert empty.reduce()["requests_injected"] == 0
    assert combine_ranks(None)["inject_seconds"] == []


def test_prometheus_metrics_record_the_combined_ranks_per_engine():
    prom = pytest.importorskip("prometheus_client")
    reg = prom.CollectorRegistry()

    def bound(cls):
        return lambda **kw: cls(registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    types_ = {prom.Gauge: bound(prom.Gauge), prom.Counter: bound(prom.Counter), prom.Histogram: bound(prom.Histogram)}
    vc = types.SimpleNamespace(kv_transfer_config=None)
    m = KVInjectPromMetrics(vc, types_, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    labels = {"model_name": "m", "engine": "0"}
    for reason in REASONS:  # every reason is there from the start
        assert reg.get_sample_value("kvinject:failures_total", dict(labels, reason=reason)) == 0
    for decision in DECISIONS:
        assert reg.get_sample_value("kvinject:hybrid_facts_total", dict(labels, decision=decision)) == 0
    a = rank_stats(0, requests_injected=1, facts_injected=3, tokens_injected=30, captures_stored=2,
                   facts_removed=1, prefetches=1, fail=["token_mismatch"], steps=[(4, 0.004)], store=(4096, 7, 2),
                   hybrid={"inject": 2, "await": 1, "text": 3})
    a.aggregate(rank_stats(1, requests_injected=1, facts_injected=3, tokens_injected=30, captures_stored=2,
                           facts_removed=1, prefetches=1, fail=["token_mismatch"], steps=[(4, 0.006)],
                           store=(4096, 7, 2), hybrid={"inject": 2, "await": 1, "text": 3}))
    m.observe(a.to_dict(), 0)
    m.observe(rank_stats(0, captures_failed=1, fail=["capture"]).to_dict(), 0)
    m.observe(a.to_dict(), 5)  # an engine it was not made for: ignored
    got = {c: reg.get_sample_value("kvinject:%s_total" % c, labels) for c in COUNTERS}
    assert got == {"requests_injected": 1, "facts_injected": 3, "tokens_injected": 30, "captures_stored": 2,
                   "captures_failed": 1, "facts_removed": 1, "prefetches": 1}
    # the ranks decided the same: counted once
    assert {d: reg.get_sample_value("kvinject:hybrid_facts_total", dict(labels, decision=d)) for d in DECISIONS} \
        == {"inject": 2, "await": 1, "text": 3}
    assert reg.get_sample_value("kvinject:failures_total", dict(labels, reason="token_mismatch")) == 1
    assert reg.get_sample_value("kvinject:failures_total", dict(labels, reason="capture")) == 1
    assert reg.get_sample_value("kvinject:inject_seconds_count", labels) == 1
    assert reg.get_sample_value("kvinject:inject_seconds_sum", labels) == pytest.approx(0.006)
    assert reg.get_sample_value("kvinject:store_bytes_used", labels) == 8192  # both ranks' pools
    assert reg.get_sample_value("kvinject:store_facts", labels) == 7
    assert reg.get_sample_value("kvinject:store_tenants", labels) == 2
    # a later snapshot of one rank updates its share
    m.observe(rank_stats(1, store=(0, 0, 0)).to_dict(), 0)
    assert reg.get_sample_value("kvinject:store_bytes_used", labels) == 4096
    assert reg.get_sample_value("kvinject:facts_injected_total", {"model_name": "m", "engine": "1"}) == 0


# ------------------------------------------------------------------ logging

def test_the_connectors_loggers_are_children_of_vllms():
    # vLLM configures only its "vllm" logger: ours must sit under it to be shown
    from kvinject.vllm import scheduler, worker
    assert scheduler.logger.name == "vllm.kvinject.scheduler" and worker.logger.name == "vllm.kvinject.worker"
    assert _compat.logger_name("kvinject.vllm.x") == "vllm.kvinject.x"
    assert _compat.logger_name("vllm.kvinject.x") == "vllm.kvinject.x"
    assert _compat.logger_name("other") == "vllm.other"
    assert isinstance(worker.logger, logging.Logger)


# ------------------------------------------------------------------ settings

def test_the_connectors_settings_come_from_the_environment_and_the_file(tmp_path):
    pytest.importorskip("yaml")
    f = tmp_path / "kvinject.yaml"
    f.write_text("connector:\n  store_budget_mb: 64\n  store_dtype: bf16\n  rope: {theta: 10000.0}\n"
                 "gateway:\n  anything: 1\n")
    env = {"KVINJECT_CONFIG_FILE": str(f), "KVINJECT_CONNECTOR_STORE_BUDGET_MB": "128",
           "KVINJECT_CONNECTOR_LAYERWISE": "yes"}
    c = KVInjectConfig.from_extra({"page_tokens": 32}, 16, environ=env)
    assert (c.store_budget_mb, c.store_dtype, c.page_tokens, c.layerwise, c.rope) == (128, "bf16", 32, True,
                                                                                      {"theta": 10000.0})
    assert KVInjectConfig.from_extra({"store_budget_mb": 8}, 16, environ=env).store_budget_mb == 8
    assert requires_piecewise({}, environ=env) is True
    assert requires_piecewise({"layerwise": False}, environ=env) is False


@pytest.mark.parametrize("extra, words", [
    ({"store_budget_mb": 0}, ["store_budget_mb", "kv_connector_extra_config", "out of range (1..1048576)"]),
    ({"store_budget_mb": "64"}, ["store_budget_mb", "must be an integer"]),
    ({"store_dtype": "int8"}, ["store_dtype", "not one of 'fp32', 'bf16', 'fp16', 'fp8_e4m3'"]),
    ({"page_tokens": 0}, ["page_tokens", "out of range (1..4096)"]),
    ({"page_tokens": 4097}, ["page_tokens", "out of range (1..4096)"]),
    ({"embedding_dim": -1}, ["embedding_dim", "out of range (0..65536)"]),
    ({"embedding_dim": 65537}, ["embedding_dim", "out of range"]),
    ({"store_path": 5}, ["store_path", "must be a string"]),
    ({"events_path": ["x"]}, ["events_path", "must be a string"]),
    ({"layerwise": "yes"}, ["layerwise", "must be a boolean"]),
    ({"time_device": 1}, ["time_device", "must be a boolean"]),
    ({"rope": 10000.0}, ["rope", "must be a mapping"]),
    ({"store_budget": 1}, ["unknown key(s) store_budget in kv_connector_extra_config", "known: disk_budget_bytes, disk_dir"]),
])
def test_every_bad_setting_is_refused_by_name(extra, words):
    with pytest.raises(ValueError) as e:
        KVInjectConfig.from_extra(extra, 16, environ=ENV)
    for w in words:
        assert w in str(e.value), str(e.value)
    with pytest.raises(ValueError):  # before any model loads, where vLLM asks (full CUDA graphs)
        requires_piecewise(extra, environ=ENV)


def test_a_bad_environment_variable_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown variable KVINJECT_CONNECTOR_STORE_BUDGET .section connector"):
        KVInjectConfig.from_extra({}, 16, environ={"KVINJECT_CONNECTOR_STORE_BUDGET": "1"})
    with pytest.raises(ValueError, match="page_tokens .from KVINJECT_CONNECTOR_PAGE_TOKENS. must be an integer"):
        KVInjectConfig.from_extra({}, 16, environ={"KVINJECT_CONNECTOR_PAGE_TOKENS": "sixteen"})


def test_the_store_dtypes_are_the_librarys():
    from kvinject.hf.config import STORE_DTYPES
    (dtype,) = [f for f in FIELDS if f.name == "store_dtype"]
    assert set(dtype.choices) == set(STORE_DTYPES)
    assert {f.name for f in FIELDS} == set(KVInjectConfig.__dataclass_fields__) - {"block_size"}
