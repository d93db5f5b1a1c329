"""What the gateway tests (test_gateway.py, test_gateway_replicas.py) share:
starting and stopping ``python -m kvinject.serve`` in front of ``vllm serve``
replicas (servers.py), JSON and SSE requests, the users' facts, and the
reference: plain vLLM (/v1/completions of the same token ids, no
kv_transfer_params) for the prompt the gateway builds, with the facts as text.

Standard library and httpx (vLLM's environment has it).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import httpx

import common as C
from servers import free_port, start_vllm_serve

SYSTEM_PROMPT = "You are a helpful assistant."
HEADING = "What the user told you before:"
EMBEDDER = os.environ.get("KVI_EMBEDDER", os.path.join(os.path.dirname(C.MODEL), "all-MiniLM-L6-v2"))
MAX_TOKENS = 10
TOP = 5
# the CPU attention's reduction order independent of the batch, as the engine tests run it
REPLICA_ENV = {"VLLM_CPU_ATTN_SPLIT_KV": "0"}

TOPICS = ["favourite fruit", "home town", "favourite sport", "car", "pet's name", "favourite colour", "job",
          "favourite book", "best friend", "favourite drink", "favourite season", "favourite film",
          "first school", "favourite dish", "musical instrument", "favourite holiday place", "phone brand",
          "favourite flower", "morning habit", "favourite board game"]
VALUES = {
    "alice": ["mango", "Lisbon", "tennis", "a red Fiat", "Tom", "green", "nurse", "Dune", "Maria", "mint tea",
              "autumn", "Amelie", "Escola Azul", "bacalhau", "the cello", "the Azores", "Nokia", "tulips",
              "a cold shower", "chess"],
    "bruno": ["kiwi", "Oslo", "skiing", "a blue Volvo", "Rex", "orange", "carpenter", "Solaris", "Lars", "coffee",
              "winter", "Heat", "Nordby School", "salmon", "the drums", "Lofoten", "Sony", "roses", "a long run",
              "Catan"],
    "chen": ["lychee", "Kyoto", "table tennis", "a white Honda", "Kiwi", "purple", "engineer", "Ivanhoe", "Mei",
             "green tea", "spring", "Spirited Away", "Hill Academy", "ramen", "the flute", "Hokkaido", "Sharp",
             "orchids", "yoga", "go"],
}


def require_embedder():
    """Skips the module (77) without the embedder .ci/install-vllm unpacks."""
    if not os.path.isfile(os.path.join(EMBEDDER, "modules.json")):
        import pytest
        pytest.skip("no embedder at %s (.ci/install-vllm unpacks all-MiniLM-L6-v2 there)" % EMBEDDER,
                    allow_module_level=True)


def facts_of(name: str, n: int = 20) -> List[str]:
    return ["My %s is %s." % (t, v) for t, v in zip(TOPICS[:n], VALUES[name][:n])]


def start_replica(work_dir: str, name: str, port: Optional[int] = None, wait: bool = True):
    """vllm serve with the connector (fp32 store, its own store file kept across restarts)."""
    return start_vllm_serve(C.MODEL, port, {"store_dtype": "fp32", "store_budget_mb": 64,
                                            "store_path": os.path.join(work_dir, name + ".kvi")},
                            log_path=os.path.join(work_dir, name + ".log"), env=REPLICA_ENV, wait=wait,
                            timeout=400)


class Gateway:
    """``python -m kvinject.serve`` in a process group of its own."""

    def __init__(self, replicas: Sequence[str], db: str, log_path: str, port: Optional[int] = None,
                 extra: Sequence[str] = ()):
        self.port = port or free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        self.log_path = log_path
        argv = [sys.executable, "-m", "kvinject.serve", "--model", C.MODEL, "--db", db, "--port", str(self.port),
                "--embedder", EMBEDDER, "--system-prompt", SYSTEM_PROMPT, "--memory-heading", HEADING,
                "--health-interval", "0.5"] + [a for r in replicas for a in ("--replica", r)] + list(extra)
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        self.client = httpx.Client(timeout=300)

    def wait(self, timeout: float = 180, up: int = 1) -> float:
        """Until /health says ``up`` replicas answer."""
        t0 = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError("the gateway exited with %s; its log ends:\n%s" % (self.process.returncode,
                                                                                      self.log_text()[-4000:]))
            try:
                r = self.client.get(self.url + "/health", timeout=5)
                if sum(1 for x in r.json()["replicas"] if x["up"]) >= up:
                    return time.monotonic() - t0
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() - t0 > timeout:
                raise RuntimeError("the gateway did not answer in %.0f s; its log ends:\n%s"
                                   % (timeout, self.log_text()[-4000:]))
            time.sleep(0.5)

    def log_text(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def req(self, method: str, path: str, body: Any = None, raw: Optional[bytes] = None, **kw):
        """(status, JSON answer)."""
        if raw is not None:
            r = self.client.request(method, self.url + path, content=raw,
                                    headers={"Content-Type": "application/json"}, **kw)
        else:
            r = self.client.request(method, self.url + path, json=body, **kw)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def ok(self, method: str, path: str, body: Any = None, **kw):
        status, out = self.req(method, path, body, **kw)
        assert status == 200, "%s %s: HTTP %d: %s" % (method, path, status, out)
        return out

    def chat(self, user: str, question: str, k: Optional[int] = None, **kw) -> Dict[str, Any]:
        body = chat_body(user, question, k, **kw)
        return self.ok("POST", "/v1/chat/completions", body)

    def stream(self, body: Dict[str, Any]) -> List[Dict[str, Any]]:
        out = []
        with self.client.stream("POST", self.url + "/v1/chat/completions", json=dict(body, stream=True)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: ") and line[6:] != "[DONE]":
                    out.append(json.loads(line[6:]))
        return out

    def metrics(self) -> str:
        return self.client.get(self.url + "/metrics").text

    def stop(self) -> Optional[int]:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.client.close()
        return self.process.returncode


def chat_body(user: str, question: str, k: Optional[int] = None, **kw) -> Dict[str, Any]:
    body = {"model": "m", "user": user, "messages": [{"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True, "top_logprobs": TOP,
            "return_token_ids": True}
    if k is not None:
        body["memory"] = {"k": k}
    body.update(kw)
    return body


def layout():
    from kvinject.serve.layout import Layout
    return Layout(C.MODEL, SYSTEM_PROMPT, HEADING)


def reference(srv, lay, fact_texts: Sequence[str], question: str) -> Dict[str, Any]:
    """Plain vLLM on the replica: /v1/completions of [header | facts as text |
    chat tail] in token ids, no kv_transfer_params, greedy, logprobs."""
    tail, _ = lay.tail([{"role": "user", "content": question}])
    ids = lay.prompt([lay.fact_tokens(t) for t in fact_texts], tail)
    out = srv.post("/v1/completions", {"model": srv.model, "prompt": ids, "max_tokens": MAX_TOKENS,
                                       "temperature": 0.0, "logprobs": TOP, "return_tokens_as_token_ids": True,
                                       "return_token_ids": True})
    c = out["choices"][0]
    lp = c["logprobs"]
    steps = []
    for tok, l, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        tops = {int(t.split(":")[1]): v for t, v in top.items()}
        steps.append((int(tok.split(":")[1]), l, dict(sorted(tops.items(), key=lambda kv: -kv[1])[:TOP])))
    return {"tokens": c["token_ids"], "steps": steps, "text": c["text"], "prompt": ids}


def answer(chat: Dict[str, Any]) -> Dict[str, Any]:
    c = chat["choices"][0]
    steps = [(e["token_id"], e["logprob"], {t["token_id"]: t["logprob"] for t in e["top_logprobs"]})
             for e in c["logprobs"]["content"]]
    return {"tokens": c["token_ids"], "steps": steps, "text": c["message"]["content"]}


def same(ref: Dict[str, Any], got: Dict[str, Any]) -> Optional[str]:
    """None when the tokens, their logprobs and the top logprobs agree (the
    top lists on the ids both hold: ties at the list's end may pick others)."""
    if ref["tokens"] != got["tokens"]:
        return "tokens %s vs plain %s" % (got["tokens"], ref["tokens"])
    for i, ((t1, l1, top1), (t2, l2, top2)) in enumerate(zip(ref["steps"], got["steps"])):
        if t1 != t2 or l1 != l2:
            return "step %d: logprob %r vs plain %r" % (i, l2, l1)
        common = set(top1) & set(top2)
        if len(common) < TOP - 1 or any(top1[t] != top2[t] for t in common):
            return "step %d: top logprobs %s vs plain %s" % (i, top2, top1)
    return None
