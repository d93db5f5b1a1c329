"""``vllm serve`` with the connector: the OpenAI-compatible server of vLLM's CPU
build, started as a user starts it (``<venv>/bin/vllm serve MODEL --kv-transfer-config
JSON``, servers.py), serving /v1/completions requests whose ``kv_transfer_params``
capture facts and inject them (docs/guide/quickstart.md does the same with curl).

- /health answers, and /v1/models names the model;
- a capture request ([header | fact | question], the header and the fact kept)
  is served; the same prompt with the header and the fact injected from the store
  gets the capture request's greedy text, with the injected tokens reported
  as cached (usage.prompt_tokens_details.cached_tokens);
- a request naming an unknown fact fails alone (HTTP 500 or finish reason
  "error", as vLLM reports a failed KV load) and the server serves after it;
- stop() ends the server's process group.

Run through launch.py (the vLLM virtual environment); skips (77) without it.
"""
from __future__ import annotations

import os

import pytest

import common as C
from servers import CPU_ARGS, start_vllm_serve

TENANT = 7
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(work_dir):
    log = os.path.join(work_dir, "vllm-serve.log")
    # the CPU attention's reduction order independent of the batch, as the engine tests run it
    srv = start_vllm_serve(C.MODEL, None, {"store_budget_mb": 64, "store_dtype": "fp32"},
                           CPU_ARGS + ["--enable-prompt-tokens-details"], log_path=log,
                           env={"VLLM_CPU_ATTN_SPLIT_KV": "0"}, timeout=240)
    yield srv
    status = srv.stop()
    C.log("vllm serve stopped (status %s)" % status)
    assert not srv.running()


def completion(srv, prompt, params=None, **kw):
    body = {"model": srv.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    if params is not None:
        body["kv_transfer_params"] = {"kvinject": params}
    body.update(kw)
    return srv.request("POST", "/v1/completions", body)


def test_health_and_models(server):
    status, _ = server.request("GET", "/health")
    assert status == 200
    models = server.get("/v1/models")
    assert [m["id"] for m in models["data"]] == [C.MODEL], models


def test_capture_then_inject(server, scenario):
    sc = scenario
    header, fact, question = sc.header, sc.facts[1][2], sc.questions[0]
    prompt = header + fact + question
    capture = {"tenant": TENANT, "capture": [{"fact_id": C.HEADER_ID, "start": 0, "length": len(header)},
                                             {"fact_id": 1, "start": len(header), "length": len(fact)}]}
    status, cap = completion(server, prompt, capture)
    assert status == 200, cap
    assert cap["choices"][0]["finish_reason"] in ("length", "stop"), cap
    C.log("capture request:", cap["choices"][0]["text"][:60].replace("\n", " "), cap["usage"])

    inject = {"tenant": TENANT, "inject": [[C.HEADER_ID, 0, len(header)], [1, len(header), len(fact)]]}
    status, inj = completion(server, prompt, inject)
    assert status == 200, inj
    choice = inj["choices"][0]
    assert choice["finish_reason"] in ("length", "stop"), inj
    assert choice["text"] == cap["choices"][0]["text"], (choice["text"], cap["choices"][0]["text"])
    C.log("inject request:", choice["text"][:60].replace("\n", " "), inj["usage"])
    # the injected tokens are reported as cached (--enable-prompt-tokens-details); the capture had none
    assert inj["usage"]["prompt_tokens_details"]["cached_tokens"] == len(header) + len(fact), inj["usage"]
    assert cap["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, cap["usage"]
    # the connector's log lines are in the server's log
    assert "KVInjectConnector" in server.log_text()


def test_unknown_fact_fails_alone(server, scenario):
    sc = scenario
    prompt = sc.header + sc.questions[1]
    status, out = completion(server, prompt, {"tenant": TENANT, "inject": [[12345, 0, len(sc.header)]]})
    C.log("unknown fact: HTTP %d %s" % (status, str(out)[:300]))
    assert status != 200 or out["choices"][0]["finish_reason"] == "error", out
    # and the server goes on serving
    status, ok = completion(server, sc.full_prompt(2, 1))
    assert status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop"), ok


def test_text_and_chat_prompts_whose_tokens_differ_are_refused(server):
    """The newcomer's case: a fact captured from its own token ids, then asked
    for with a text prompt and with a chat prompt that vLLM tokenizes itself.
    The fact ends in a space, which alone is a token of its own and before a
    word merges into it: the prompt's ids at the fact's span differ from the
    stored ones, and the request is refused (vLLM's HTTP 500 for a failed KV
    load, the library's mismatch message in the log), never served with the
    fact's KV on other tokens."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(C.MODEL)
    tenant = 31
    fact_text, question = "The user's cat is called Tom. ", "What is my cat called?"
    fact = tok(fact_text, add_special_tokens=False).input_ids
    asked = tok(fact_text + question, add_special_tokens=False).input_ids
    assert asked[:len(fact)] != fact, "the premise: the text tokenizes otherwise at the fact's span"
    status, cap = completion(server, fact + tok(question, add_special_tokens=False).input_ids,
                             {"tenant": tenant, "capture": [{"fact_id": 1, "start": 0, "length": len(fact)}]},
                             max_tokens=2, min_tokens=2)
    assert status == 200, cap
    outcome = (cap.get("kv_transfer_params") or {}).get("kvinject") or {}
    assert outcome.get("captured") == [1] and not outcome.get("errors"), cap
    # the same fact asked for by token ids is served (the ids agree)
    status, ok = completion(server, fact + tok(question, add_special_tokens=False).input_ids,
                            {"tenant": tenant, "inject": [[1, 0, len(fact)]]})
    assert status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop"), ok
    inject = {"kvinject": {"tenant": tenant, "inject": [[1, 0, len(fact)]]}}
    # a text prompt: vLLM tokenizes it, the span's ids differ
    status, text = server.request("POST", "/v1/completions", {
        "model": server.model, "prompt": fact_text + question, "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "kv_transfer_params": inject})
    C.log("text prompt: HTTP %d %s" % (status, str(text)[:200]))
    assert status != 200 or text["choices"][0]["finish_reason"] == "error", text
    # a chat prompt: the chat template's tokens lie where the fact would go
    status, chat = server.request("POST", "/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": fact_text + question}],
        "max_tokens": MAX_TOKENS, "temperature": 0.0, "kv_transfer_params": inject})
    C.log("chat prompt: HTTP %d %s" % (status, str(chat)[:200]))
    assert status != 200 or chat["choices"][0]["finish_reason"] == "error", chat
    # the library's message names the tenant and the fact, in vLLM's log
    log = server.log_text()
    assert log.count("fact 1 of tenant %d: its token" % tenant) >= 2, log[-3000:]


if __name__ == "__main__":
    import sys
    from launch import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
