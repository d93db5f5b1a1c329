"""kvinject.serve's pure parts, without vLLM, FastAPI or a model: rendezvous
hashing, capture planning and outcome checks, chat request checks, settings.
(The gateway on real servers: tests/vllm/test_gateway*.py.)"""
from __future__ import annotations

import os

import pytest

from kvinject.serve import capture as cap
from kvinject.serve import chat, config, ring
from kvinject.vllm.prompt import parse_params


# ------------------------------------------------------------------ ring

def test_ring_owner_is_stable_and_moves_only_the_leaving_replicas_users():
    reps = ["http://r%d:8000" % i for i in range(4)]
    owners = {u: ring.owner(reps, u) for u in range(1, 2001)}
    counts = {r: sum(1 for o in owners.values() if o == r) for r in reps}
    assert all(350 < c < 650 for c in counts.values()), counts
    left = [r for r in reps if r != reps[1]]
    for u, o in owners.items():
        new = ring.owner(left, u)
        if o != reps[1]:
            assert new == o
        else:
            assert new == ring.ranked(reps, u)[1]
    assert ring.owner(reversed(reps), 7) == ring.owner(reps, 7)
    assert ring.owner([], 1) is None


# --------------------------------------------------------------- capture

HEADER = [1, 2, 3]


def facts(n, size=4, start=1):
    return [(start + i, [100 * (start + i) + j for j in range(size)]) for i in range(n)]


def test_plan_full_capture_in_one_prompt():
    fs = facts(3)
    reqs = cap.plan(9, HEADER, fs, header_held=False, replace=True, budget=100)
    assert len(reqs) == 1
    b = reqs[0].body
    p = b["kv_transfer_params"]["kvinject"]
    assert b["prompt"] == HEADER + [t for _, ts in fs for t in ts]
    assert "inject" not in p and p["tenant"] == 9
    assert [(c["fact_id"], c["start"], c["length"], c.get("replace")) for c in p["capture"]] == \
        [(0, 0, 3, True), (1, 3, 4, True), (2, 7, 4, True), (3, 11, 4, True)]
    assert reqs[0].asked == [0, 1, 2, 3]
    assert b["max_tokens"] == b["min_tokens"] == 2
    parse_params(p, len(b["prompt"]))      # the connector accepts it


def test_plan_incremental_injects_header_and_earlier_facts():
    before, new = facts(2), facts(2, start=3)
    reqs = cap.plan(5, HEADER, new, context=before, budget=100)
    assert len(reqs) == 1
    p = reqs[0].body["kv_transfer_params"]["kvinject"]
    assert p["inject"] == [[0, 0, 3], [1, 3, 4], [2, 7, 4]]
    assert [(c["fact_id"], c["start"]) for c in p["capture"]] == [(3, 11), (4, 15)]
    assert not any(c.get("replace") for c in p["capture"])
    spec = parse_params(p, len(reqs[0].body["prompt"]))
    assert spec.claim_end == 11 and spec.capture_end == 19


def test_plan_cuts_long_captures_and_keeps_recent_context_within_half_the_budget():
    fs = facts(10, size=10)
    reqs = cap.plan(1, HEADER, fs, header_held=False, replace=True, budget=40)
    assert [r.asked for r in reqs][0] == [0, 1, 2, 3]
    assert sum(len(r.asked) for r in reqs) == 11
    for r in reqs:
        assert r.tokens <= 40
        parse_params(r.body["kv_transfer_params"]["kvinject"], r.tokens)
    second = reqs[1].body["kv_transfer_params"]["kvinject"]
    # header 3 + one 10-token fact fit in 20: the latest captured fact is the context
    assert second["inject"] == [[0, 0, 3], [3, 3, 10]]
    with pytest.raises(cap.PlanError):
        cap.plan(1, HEADER, facts(1, size=50), budget=40)


def test_plan_injects_all_the_context_when_it_fits_with_the_new_facts():
    """An add after many facts: every earlier fact is the new ones' context
    (exact notes encoding) while header, context and new facts fit the budget,
    even past half of it; past the budget, the latest facts up to half of it."""
    before, new = facts(40, size=10), facts(2, start=41, size=10)
    reqs = cap.plan(2, HEADER, new, context=before, budget=3 + 420)
    assert len(reqs) == 1
    p = reqs[0].body["kv_transfer_params"]["kvinject"]
    assert [f for f, _, _ in p["inject"]] == list(range(41))
    assert [(c["fact_id"], c["start"]) for c in p["capture"]] == [(41, 403), (42, 413)]
    assert reqs[0].tokens == 423
    reqs = cap.plan(2, HEADER, new, context=before, budget=3 + 419)    # one token short
    p = reqs[0].body["kv_transfer_params"]["kvinject"]
    assert [f for f, _, _ in p["inject"]] == [0] + list(range(21, 41))     # 3 + 20 * 10 <= 422 // 2
    assert sum(len(r.asked) for r in reqs) == 2


def test_check_reads_the_connectors_outcome():
    ok = {"kv_transfer_params": {"kvinject": {"tenant": 1, "captured": [1, 2], "errors": [], "pending": False}}}
    assert cap.check(200, ok, asked=[1, 2])[0] is None
    err, _ = cap.check(200, ok, asked=[1, 2, 3])
    assert "missing fact ids [3]" in err
    bad = {"kv_transfer_params": {"kvinject": {"captured": [], "errors": ["fact 1 exists"]}}}
    assert "fact 1 exists" in cap.check(200, bad, asked=[1])[0]
    pend = {"kv_transfer_params": {"kvinject": {"captured": [1], "errors": [], "pending": True}}}
    assert "pending" in cap.check(200, pend, asked=[1])[0]
    assert "HTTP 500" in cap.check(500, {"error": {"message": "Internal server error"}}, asked=[1])[0]
    assert cap.check(200, {"kv_transfer_params": None}, asked=[1]) == (None, None)   # no outcome reported
    rm = {"kv_transfer_params": {"kvinject": {"removed": [], "errors": []}}}
    assert cap.check(200, rm)[0] is None            # a fact that was not there is skipped
    inj = {"kv_transfer_params": {"kvinject": {"injected_facts": 2, "captured": [3], "errors": []}}}
    assert cap.check(200, inj, asked=[3], injected=2)[0] is None
    assert "injected 2 of 3" in cap.check(200, inj, asked=[3], injected=3)[0]


def test_plan_removes_first_in_the_first_request_only():
    reqs = cap.plan(4, HEADER, facts(10, size=10), header_held=False, replace=True, budget=40, remove="all")
    assert reqs[0].params["remove"] == "all" and all("remove" not in r.params for r in reqs[1:])
    for r in reqs:
        parse_params(r.params, r.tokens)
    reqs = cap.plan(4, HEADER, facts(2, start=6), context=facts(4), replace=True, budget=100, remove=[5])
    assert reqs[0].params["remove"] == [5] and reqs[0].params["inject"][-1][0] == 4
    spec = parse_params(reqs[0].params, reqs[0].tokens)
    assert spec.remove == [5]
    with pytest.raises(cap.PlanError):
        cap.plan(4, HEADER, facts(1), remove="all", budget=100)      # "all" with injected context
    r = cap.removal(4, "all", 1)
    assert r.body["prompt"] == [1] and r.params == {"tenant": 4, "remove": "all"}
    assert r.body["max_tokens"] == r.body["min_tokens"] == 2
    parse_params(r.params, 1)
    # a DELETE with reencode=false: the later facts keep their KV (the library's opt-out)
    r = cap.removal(4, [5], 1, keep_dependents=True)
    assert r.params == {"tenant": 4, "remove": [5], "keep_dependents": True}
    assert parse_params(r.params, 1).keep_dependents
    # the re-encoding request: each later fact's context is the header, the facts before the
    # deleted one and the later facts captured before it
    reqs = cap.plan(4, HEADER, facts(3, start=6), context=facts(4), replace=True, budget=1000, remove=[5])
    spec = parse_params(reqs[0].params, reqs[0].tokens)
    assert [spec.context_of(c) for c in spec.capture] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 6],
                                                          [0, 1, 2, 3, 4, 6, 7]]


# ------------------------------------------------------------------ chat

def body(**kw):
    b = {"user": "u", "messages": [{"role": "user", "content": "hi"}]}
    b.update(kw)
    return b


def test_parse_chat_defaults_and_passthrough():
    r = chat.parse_chat(body(temperature=0, max_tokens=7, logprobs=True, top_logprobs=3, seed=1), 5, 1000)
    assert (r.k, r.min_score, r.memory, r.stream) == (5, None, True, False)
    assert r.upstream == {"temperature": 0, "seed": 1, "max_tokens": 7, "logprobs": 3}
    assert chat.parse_chat(body(memory=False), 5, 1000).k == 0
    r = chat.parse_chat(body(memory={"k": 0, "min_score": 0.5}), 5, 1000)
    assert (r.k, r.min_score) == (0, 0.5)


@pytest.mark.parametrize("b, part", [
    ({"messages": [{"role": "user", "content": "x"}]}, "user is required"),
    (body(user=""), "user is required"),
    (body(user=["u"]), "string"),
    (body(messages=[]), "non-empty"),
    (body(messages=[{"role": "wizard", "content": "x"}]), "role"),
    (body(messages=[{"role": "assistant", "content": "x"}]), "no user message"),
    (body(memory={"k": -1}), "out of range"),
    (body(memory={"k": 1001}), "out of range"),
    (body(memory={"k": "2"}), "integer"),
    (body(memory={"k": True}), "integer"),
    (body(memory={"k": 1.5}), "integer"),
    (body(memory={"min_score": "x"}), "number"),
    (body(memory={"min_score": float("nan")}), "number"),
    (body(memory={"kk": 1}), "unknown keys"),
    (body(memory=3), "memory must be"),
    (body(stream="yes"), "boolean"),
    (body(max_tokens=0), "max_tokens"),
    (body(top_logprobs=3), "needs logprobs"),
    (body(logprobs=True, top_logprobs=21), "top_logprobs"),
    ([1, 2], "JSON object"),
])
def test_parse_chat_refuses(b, part):
    with pytest.raises(chat.ApiError) as e:
        chat.parse_chat(b, 5, 1000)
    assert e.value.status == 400 and part in e.value.message
    assert set(e.value.body()["error"]) >= {"message", "type", "code"}


def test_chat_logprobs_from_token_id_strings():
    lp = {"tokens": ["token_id:5"], "token_logprobs": [-0.5],
          "top_logprobs": [{"token_id:5": -0.5, "token_id:7": -1.0, "token_id:9": -3.0}]}
    out = chat.chat_logprobs(lp, 2, lambda t: "<%d>" % t, False)["content"][0]
    assert (out["token"], out["token_id"], out["logprob"]) == ("<5>", 5, -0.5)
    assert [t["token_id"] for t in out["top_logprobs"]] == [5, 7]


# -------------------------------------------------------------- settings

def test_settings_flags_env_and_checks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    emb = tmp_path / "emb"
    emb.mkdir()
    (emb / "modules.json").write_text("[]")
    base = ["--model", str(model), "--db", str(tmp_path / "g.db"), "--embedder", str(emb)]
    cfg = config.load(base + ["--replica", "http://a:1/", "--replica", "http://b:2"], environ={})
    assert cfg.replicas == ["http://a:1", "http://b:2"] and cfg.port == 8000 and cfg.default_k == 5
    env = {"KVINJECT_GATEWAY_REPLICA": "http://c:3", "KVINJECT_GATEWAY_DEFAULT_K": "7",
           "KVINJECT_GATEWAY_PORT": "9000"}
    cfg = config.load(base + ["--port", "9100"], environ=env)
    assert cfg.replicas == ["http://c:3"] and cfg.default_k == 7 and cfg.port == 9100   # flag > env
    with pytest.raises(ValueError, match="replica"):
        config.load(base, environ={})
    with pytest.raises(ValueError, match="KVINJECT_GATEWAY_PORT"):
        config.load(base + ["--replica", "http://a:1"], environ={"KVINJECT_GATEWAY_PORT": "x"})
    with pytest.raises(ValueError, match="range"):
        config.load(base + ["--replica", "http://a:1", "--default-k", "-1"], environ={})
    with pytest.raises(ValueError, match="KVINJECT_GATEWAY_NONSENSE"):
        config.load(base + ["--replica", "http://a:1"], environ={"KVINJECT_GATEWAY_NONSENSE": "1"})
    with pytest.raises(SystemExit):
        config.load(base + ["--replica", "http://a:1", "--port", "x"], environ={})
    with pytest.raises(ValueError, match="base URL"):
        config.load(base + ["--replica", "a:1"], environ={})
    with pytest.raises(ValueError, match="twice"):
        config.load(base + ["--replica", "http://a:1", "--replica", "http://a:1/"], environ={})
    with pytest.raises(ValueError, match="not a directory"):
        config.load(["--model", str(tmp_path / "none"), "--db", "x.db", "--replica", "http://a:1"], environ={})
    with pytest.raises(ValueError, match="modules.json"):
        config.load(base[:4] + ["--replica", "http://a:1", "--embedder", str(tmp_path)], environ={})
    assert config.load(base[:4] + ["--replica", "http://a:1", "--embedder", "http://e:1"],
                       environ={}).embedder_is_url
    # the disk tier's settings: a boolean flag parsed as the environment's are
    cfg = config.load(base + ["--replica", "http://a:1"], environ={})
    assert (cfg.shared_disk, cfg.idle_prefetch_s) == (False, 300.0)
    cfg = config.load(base + ["--replica", "http://a:1", "--shared-disk", "true", "--idle-prefetch-s", "0"],
                      environ={})
    assert (cfg.shared_disk, cfg.idle_prefetch_s) == (True, 0.0)
    assert config.load(base + ["--replica", "http://a:1", "--shared-disk", "no"],
                       environ={"KVINJECT_GATEWAY_SHARED_DISK": "1"}).shared_disk is False   # flag > env
    assert config.load(base + ["--replica", "http://a:1"], environ={"KVINJECT_GATEWAY_SHARED_DISK": "yes"}).shared_disk
    with pytest.raises(ValueError, match="shared_disk"):
        config.load(base + ["--replica", "http://a:1", "--shared-disk", "maybe"], environ={})


def test_settings_file(tmp_path):
    pytest.importorskip("yaml")
    model = tmp_path / "m"
    model.mkdir()
    f = tmp_path / "kvi.yaml"
    f.write_text("gateway:\n  replica: http://f:1\n  default_k: 9\n  model: %s\n  db: %s\n  embedder: http://e:1\n"
                 % (model, tmp_path / "g.db"))
    cfg = config.load([], environ={"KVINJECT_CONFIG_FILE": str(f), "KVINJECT_GATEWAY_DEFAULT_K": "4"})
    assert cfg.replicas == ["http://f:1"] and cfg.default_k == 4    # env > file
    f.write_text("gateway:\n  nonsense: 1\n")
    with pytest.raises(ValueError, match="nonsense"):
        config.load([], environ={"KVINJECT_CONFIG_FILE": str(f)})


def test_the_package_imports_no_web_framework():
    import sys
    import kvinject.serve  # noqa: F401
    assert "fastapi" not in sys.modules or os.environ.get("KVI_ALLOW_FASTAPI")
