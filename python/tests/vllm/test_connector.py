"""The connector on the real vLLM engine (CPU build) with a real model
(SmolLM2-135M-Instruct), against plain vLLM without the connector.

    launch.py test_connector.py [--layerwise] [--keep DIR]

First plain vLLM (baseline.py, a process of its own) prefills every full
prompt; then one engine with the connector (the module's fixture) serves, in
order:

 exact      facts captured by the connector from vLLM's own prefill of the full
            prompt, served by injection: greedy tokens and the top-20 logprobs
            of every step equal plain vLLM's (bit for bit), num_cached_tokens =
            the injected tokens;
 tenants    8 requests of 4 tenants (same fact ids, other contents) in one
            batch: each equals plain vLLM on its own full prompt, and the step
            injected all 8 with one kvi_inject;
 controls   zeros and wrong RoPE (keys 7 positions off) change the output;
            facts computed by Hugging Face transformers (another engine) are
            reported and must beat zeros;
 shifted    facts captured in other conversations at other positions: token
            agreement and first-token KL against re-prefill (reported; must
            beat zeros);
 isolation  an injected request's blocks (zeros) are never reused by a plain
            request of the same tokens, nor by another tenant, in either
            direction; a control shows the prefix cache does reuse plain blocks;
 bad        unknown fact, another tenant's fact, a span longer than its fact,
            facts filling the prompt, malformed parameters: each fails alone
            (finish reason "error", a logged message) in a batch with a good
            request, which is served; the engine serves after;
 overhead   the connector's host time per step for 1 and 64 injected requests.

The tests run in this order on the one engine; each phase is a fixture, so
a test asks for the phases it depends on. With --layerwise the connector
injects layer by layer and only the plain, capture, exact and tenants tests
run (and the count of layers injected per step); the others skip.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import pytest

import common as C


def fix(rec):
    rec["logprobs"] = [{int(k): v for k, v in s.items()} for s in rec["logprobs"]]
    return rec


def same(ref, rec):
    """Identical greedy tokens and, at every step, identical top-20 logprobs."""
    return rec["tokens"] == ref["tokens"] and rec["logprobs"] == ref["logprobs"]


def diff(ref, rec):
    lr, lt = C.chosen_logprobs(ref), C.chosen_logprobs(rec)
    d = max((abs(a - b) for a, b in zip(lr, lt)), default=float("nan"))
    return "tokens %s vs %s, max |dlogprob| %.3g" % (rec["tokens"], ref["tokens"], d)


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def layerwise(request):
    return request.config.getoption("--layerwise")


@pytest.fixture(scope="module")
def full(layerwise):
    """The tests that --layerwise leaves out (first in their arguments: it skips
    them before the engine serves their phase)."""
    if layerwise:
        pytest.skip("--layerwise runs only the plain, capture, exact and tenants checks")


@pytest.fixture(scope="module")
def baseline(work_dir, scenario):
    """Plain vLLM's outputs of every full prompt (baseline.py, a process of its own,
    before this module's engine starts)."""
    t0 = time.time()
    base_json = os.path.join(work_dir, "baseline.json")
    r = subprocess.run([sys.executable, os.path.join(C.HERE, "baseline.py"), base_json])
    assert r.returncode == 0, "baseline.py exited %d" % r.returncode
    base = C.load_json(base_json)
    for name, ids in scenario.baseline_prompts().items():
        assert base["prompts"][name] == ids, "the baseline saw other prompts (%s)" % name
    C.log("baseline %.0f s" % (time.time() - t0))
    return types.SimpleNamespace(ref={k: fix(v) for k, v in base["outputs"].items()},
                                 ref8=[fix(v) for v in base["batch8"]])


@pytest.fixture(scope="module")
def engine(baseline, work_dir, scenario, layerwise):
    """The engine with the connector, its store file holding the controls'
    facts (hf_facts: transformers' facts, wrong RoPE, zeros)."""
    import hf_facts
    store_path = os.path.join(work_dir, "facts.kvi")
    if os.path.exists(store_path):
        os.remove(store_path)
    hf_facts.make_store_file(store_path, scenario)
    return C.Engine(os.path.join(work_dir, "events"), store_dtype="fp32", store_budget_mb=256,
                    store_path=store_path, layerwise=layerwise)


def facts_of(sc, t):
    return list(zip([C.HEADER_ID] + C.FACT_IDS, [sc.header] + sc.facts[t]))


def claim_of(sc):
    return len(sc.header) + sum(len(f) for f in sc.facts[1])


# -------------------------------------------------------- plain and captures

def test_a_plain_request_with_the_connector_loaded_equals_plain_vllm(engine, baseline, scenario):
    rec = engine.run([scenario.full_prompt(1, 0)])[0]
    assert same(baseline.ref["t1_q0"], rec), diff(baseline.ref["t1_q0"], rec)


@pytest.fixture(scope="module")
def captured(engine, scenario):
    """Every tenant's header and facts captured from vLLM's own prefill, in one batch."""
    from kvinject.vllm import Keep, capture_prompt
    sc = scenario
    caps = [capture_prompt(t, [Keep(C.HEADER_ID, sc.header)] + [Keep(f, s) for f, s in zip(C.FACT_IDS, sc.facts[t])]
                           + [sc.questions[0]]) for t in C.TENANT_FACTS]
    engine.run(caps, n=1)
    return engine.worker_events("capture")


def test_captures_16_facts_of_4_tenants_are_stored_by_one_kvi_encode(captured):
    assert captured and captured[-1]["captures"] == 16 and captured[-1]["stored"] == 16, captured[-1:]


# ------------------------------------------------------------ (1) exact context

@pytest.fixture(scope="module")
def exact(engine, captured, scenario):
    from kvinject.vllm import memory_prompt
    mp = memory_prompt(1, facts_of(scenario, 1), scenario.questions[0])
    assert mp.prompt_token_ids == scenario.full_prompt(1, 0)
    rec = engine.run([mp])[0]
    C.log("  exact: %r" % rec["text"])
    return rec


def test_exact_injected_facts_give_plain_vllms_greedy_tokens_and_logprobs(exact, baseline):
    assert same(baseline.ref["t1_q0"], exact), diff(baseline.ref["t1_q0"], exact)


def test_exact_vllm_reports_the_injected_tokens_as_cached(exact, scenario):
    assert exact["cached"] == claim_of(scenario), "num_cached_tokens %s, claimed %d" % (exact["cached"],
                                                                                       claim_of(scenario))


# --------------------------------------------- (4) 8 requests of 4 tenants

@pytest.fixture(scope="module")
def tenants(engine, captured, scenario):
    from kvinject.vllm import memory_prompt
    n_inject = len(engine.worker_events("inject"))
    batch = scenario.batch8()
    recs = engine.run([memory_prompt(t, facts_of(scenario, t), scenario.questions[q]) for t, q in batch])
    for (t, q), r in zip(batch, recs):
        C.log("  tenant %d q%d: %r" % (t, q, r["text"]))
    return types.SimpleNamespace(batch=batch, recs=recs, injects=engine.worker_events("inject")[n_inject:])


def test_tenants_8_requests_in_one_batch_each_equal_plain_vllms_batch_of_their_full_prompts(tenants, baseline):
    bad = ["t%d_q%d (%s)" % (t, q, diff(r8, r)) for (t, q), r8, r in zip(tenants.batch, baseline.ref8, tenants.recs)
           if not same(r8, r)]
    assert not bad, "; ".join(bad)


def test_tenants_one_kvi_inject_for_the_8_requests(tenants):
    inj = tenants.injects
    assert inj and inj[0]["requests"] == 8, "inject steps %s" % [(e["requests"], e["facts"]) for e in inj]


def test_tenants_the_injection_starts_before_vllm_prepares_the_steps_inputs(tenants):
    # vLLM's first worker call of the step (handle_preemptions, which this vLLM's model runner makes
    # before it prepares the inputs) started it; start_load_kv found it started
    assert tenants.injects and all(e["hook"] == "handle_preemptions" for e in tenants.injects), tenants.injects


def test_tenants_answers_differ_between_tenants(tenants):
    assert len({tuple(r["tokens"]) for r in tenants.recs}) >= 4


def test_layerwise_every_layer_injected_as_vllm_reached_it(engine, tenants, layerwise):
    if not layerwise:
        pytest.skip("only with --layerwise")
    lw = engine.worker_events("inject_layers")
    assert lw and all(e["layers"] == 30 for e in lw), "30 layers per step expected: %s" % lw[-2:]


# ------------------------------- (3) negative controls, another engine's facts

@pytest.fixture(scope="module")
def controls(engine, baseline, scenario):
    from kvinject.vllm import memory_prompt
    zero, wrong, hf = engine.run([memory_prompt(tn, facts_of(scenario, 1), scenario.questions[0])
                                  for tn in (C.ZERO_TENANT, C.WRONG_ROPE_TENANT, C.HF_TENANT)])
    r0 = baseline.ref["t1_q0"]
    kl = lambda x: C.top_kl(r0["logprobs"][0], x["logprobs"][0])  # noqa: E731
    C.log("  transformers' facts injected: %d/%d leading tokens agree, first-token KL %.3g (zeros %.3g)"
          % (C.agreement(r0, hf), len(r0["tokens"]), kl(hf), kl(zero)))
    return types.SimpleNamespace(zero=zero, wrong=wrong, hf=hf, r0=r0, kl=kl)


def test_controls_zeros_change_the_output(full, controls):
    c = controls
    assert not same(c.r0, c.zero), "KL %.3g, %s" % (c.kl(c.zero), c.zero["text"])


def test_controls_wrong_rope_changes_the_output(full, controls):
    c = controls
    assert not same(c.r0, c.wrong), "KL %.3g, %s" % (c.kl(c.wrong), c.wrong["text"])


def test_controls_zeros_cost_more_than_wrong_rope(full, controls):
    c = controls
    assert c.kl(c.zero) > c.kl(c.wrong), "first-token KL %.3g vs %.3g" % (c.kl(c.zero), c.kl(c.wrong))


def test_controls_transformers_facts_beat_zeros(full, controls):
    c = controls
    assert c.kl(c.hf) < c.kl(c.zero), "first-token KL %.3g vs %.3g" % (c.kl(c.hf), c.kl(c.zero))


# ------------ (2) shifted: tenant 5's facts (tenant 1's text) said in other conversations

def test_shifted_facts_beat_zeros(full, engine, baseline, scenario, controls):
    from kvinject.vllm import Keep, capture_prompt, memory_prompt
    sc = scenario
    convs = []
    for i, conv in enumerate(sc.shifted):
        segs = [Keep(C.HEADER_ID, sc.header)] if i == 0 else [sc.header]
        for s in conv:
            segs.append(Keep(C.FACT_IDS[s[0] - 1], sc.facts[1][s[0] - 1]) if isinstance(s, tuple) else s)
        convs.append(capture_prompt(5, segs))
    engine.run(convs, n=1)
    shifted = engine.run([memory_prompt(5, facts_of(sc, 1), sc.questions[q]) for q in range(len(C.QUESTIONS))])
    for q, r in enumerate(shifted):
        rr = baseline.ref["t1_q%d" % q]
        C.log("  shifted q%d: %d/%d leading tokens agree with re-prefill, first-token KL %.3g: %r"
              % (q, C.agreement(rr, r), len(rr["tokens"]), C.top_kl(rr["logprobs"][0], r["logprobs"][0]), r["text"]))
    kl = controls.kl
    assert kl(shifted[0]) < kl(controls.zero), "first-token KL %.3g vs %.3g" % (kl(shifted[0]), kl(controls.zero))


# ------------- (5) prefix-cache isolation (a prompt whose blocks nobody has computed yet)

@pytest.fixture(scope="module")
def isolation(engine, baseline, scenario):
    from kvinject.vllm import Keep, capture_prompt, memory_prompt
    sc = scenario
    iso_ids = sc.iso_prompt()
    iso_facts = list(zip([C.HEADER_ID] + C.ISO_IDS, [sc.header] + sc.iso_facts))
    o = types.SimpleNamespace(riso=baseline.ref["iso"], claim=sum(len(s) for _, s in iso_facts),
                              full_blocks=(len(iso_ids) // C.BLOCK_SIZE) * C.BLOCK_SIZE)
    o.z1 = engine.run([memory_prompt(C.ZERO_TENANT, iso_facts, sc.iso_question)])[0]
    o.p1 = engine.run([iso_ids])[0]
    o.p2 = engine.run([iso_ids])[0]
    engine.run([capture_prompt(7, [Keep(C.HEADER_ID, sc.header)] + [Keep(f, s) for f, s in zip(C.ISO_IDS, sc.iso_facts)]
                               + [sc.iso_question])], n=1)
    o.t7 = engine.run([memory_prompt(7, iso_facts, sc.iso_question)])[0]
    o.z2 = engine.run([memory_prompt(C.ZERO_TENANT, iso_facts, sc.iso_question)])[0]
    return o


def test_isolation_zeros_injected_and_cached(full, isolation):
    o = isolation
    assert o.z1["cached"] == o.claim and not same(o.riso, o.z1), "cached %s of %d" % (o.z1["cached"], o.claim)


def test_isolation_a_plain_request_of_the_same_tokens_gets_none_of_those_blocks(full, isolation):
    o = isolation
    assert o.p1["cached"] == 0 and same(o.riso, o.p1), "cached %s, %s" % (o.p1["cached"], diff(o.riso, o.p1))


def test_isolation_control_the_prefix_cache_does_reuse_plain_blocks(full, isolation):
    o = isolation
    assert o.p2["cached"] == o.full_blocks and same(o.riso, o.p2), "cached %s of %d" % (o.p2["cached"],
                                                                                       o.full_blocks)


def test_isolation_another_tenants_injection_is_its_own(full, isolation):
    # exact facts: plain vLLM's output
    o = isolation
    assert same(o.riso, o.t7) and o.t7["cached"] == o.claim, "cached %s, %s" % (o.t7["cached"], diff(o.riso, o.t7))


def test_isolation_the_zeros_tenant_again_gets_its_own_zeros(full, isolation):
    # not the cached plain or tenant-7 blocks
    o = isolation
    assert same(o.z1, o.z2) and o.z2["cached"] == o.claim, "cached %s, %s" % (o.z2["cached"], diff(o.z1, o.z2))


# ------------------------------------ (6) bad requests, in one batch with a good one

BAD = ["unknown fact", "another tenant's fact", "span longer than its fact", "facts fill the prompt", "no tenant",
       "tokens other than the fact's"]


@pytest.fixture(scope="module")
def bad(engine, scenario, tokenizer, isolation):
    from kvinject.vllm import memory_prompt
    sc = scenario
    good = memory_prompt(2, facts_of(sc, 2), sc.questions[1])
    unknown = memory_prompt(1, [(C.HEADER_ID, sc.header), (12345, sc.facts[1][0])], sc.questions[0])
    other = memory_prompt(3, [(C.HEADER_ID, sc.header), (C.ISO_IDS[0], sc.iso_facts[0])], sc.questions[0])
    longer = memory_prompt(1, [(C.HEADER_ID, sc.header), (C.FACT_IDS[0], sc.facts[1][0] + [tokenizer.eos_token_id])],
                           sc.questions[0])
    filled = memory_prompt(1, facts_of(sc, 1), [0])
    filled.params["inject"].append([C.FACT_IDS[0], len(filled.prompt_token_ids) - 1, 1])
    malformed = memory_prompt(1, facts_of(sc, 1), sc.questions[0])
    del malformed.params["tenant"]
    # the prompt a text or chat request tokenizes differently: one id of a
    # fact's span is not the fact's; never served with the fact's KV
    retok = memory_prompt(1, facts_of(sc, 1), sc.questions[0])
    span = retok.params["inject"][1]
    retok.prompt_token_ids[span[1] + span[2] - 1] = tokenizer.eos_token_id
    n_err = len(engine.worker_events("request_error"))
    recs = engine.run([good, unknown, other, longer, filled, malformed, retok])
    msgs = [e["message"] for e in engine.worker_events("request_error")[n_err:]]
    msgs += [e["message"] for e in engine.scheduler_events("request_error")]
    for m in msgs:
        C.log("  error: %s" % m)
    return types.SimpleNamespace(good=recs[0], bad=dict(zip(BAD, recs[1:])), messages=msgs)


def test_bad_the_good_request_of_the_batch_is_served_exactly(full, bad, baseline):
    assert same(baseline.ref["t2_q1"], bad.good), diff(baseline.ref["t2_q1"], bad.good)


@pytest.mark.parametrize("name", BAD)
def test_bad_request_fails_alone(full, bad, name):
    r = bad.bad[name]
    assert r["finish"] == "error" and not r["tokens"], "finish %r, %d tokens" % (r["finish"], len(r["tokens"]))


@pytest.mark.parametrize("want", ["12345", "tokens", "need a tenant", "at least one prompt token",
                                  "in expect_token_ids"])
def test_bad_a_message_names_the_problem(full, bad, want):
    assert any(want in m for m in bad.messages), bad.messages


def test_bad_the_engine_serves_after_them(full, engine, bad, baseline, scenario):
    from kvinject.vllm import memory_prompt
    after = engine.run([memory_prompt(1, facts_of(scenario, 1), scenario.questions[1])])[0]
    assert same(baseline.ref["t1_q1"], after), diff(baseline.ref["t1_q1"], after)


# ---------------- overhead: host time of the connector per step, 1 and 64 requests

@pytest.mark.parametrize("n", [1, 64])
def test_overhead_requests_injected_in_one_step(full, engine, scenario, n):
    from kvinject.vllm import memory_prompt
    k = len(engine.worker_events("inject"))
    engine.run([memory_prompt(1 + i % 4, facts_of(scenario, 1 + i % 4), scenario.questions[i % 2]) for i in range(n)],
               n=1)
    inj = engine.worker_events("inject")[k:]
    sched = engine.scheduler_events("schedule")
    big = max(inj, key=lambda e: e["requests"]) if inj else None
    if big:
        C.log("  overhead, %d requests in the step (%d facts, %d tokens): worker host %.0f us "
              "(checks %.0f us, kvi_inject %.0f us); scheduler build_connector_meta %.0f us"
              % (big["requests"], big["facts"], big["tokens"], big["host_us"], big["check_us"], big["kvi_us"],
                 max(sched, key=lambda e: e["injects"])["host_us"] if sched else float("nan")))
    assert big and big["requests"] == n, [e["requests"] for e in inj]
