"""The connector behind vLLM's OpenAI server (``python -m
vllm.entrypoints.openai.api_server``, CPU build, SmolLM2-135M-Instruct):
each request's outcome in its ``/v1/completions`` response
(``kv_transfer_params["kvinject"]``), removal requests, the startup line and
errors in the server's log, the connector's Prometheus metrics on
``/metrics``, and a bad setting refused at start.

    launch.py test_server.py [--keep DIR]

One server with the connector (``kv_load_failure_policy: "recompute"``, an
fp32 store file) serves, in order, over HTTP on 127.0.0.1 (a free port):

 capture    tenant 1's header and 3 facts captured from vLLM's prefill, with
            2 output tokens (max_tokens = min_tokens = 2): the ids are listed,
            nothing pending; with 1 output token (tenant 2) the outcome is
            pending and lists nothing yet (the facts are stored all the same);
 inject     tenant 1's and tenant 2's facts injected: the facts and tokens;
 capture a fact that exists (no replace): the library's message in errors;
 remove     a list (one id absent: not listed), then "all" of tenant 2;
 recompute  a request injecting a removed fact and capturing a span: vLLM
            recomputes it, the outcome carries the worker's message, no
            injected facts, and the capture after the removed fact's text is
            refused (its context names the removed fact: kvinject/store.h,
            "Context and stale facts"), with the library's message;
            and a request with bad parameters (recomputed: served plainly),
            its message in errors;
 metrics    /metrics holds every kvinject: metric with the counts of the
            requests above;
 log        the startup line (store budget, dtype, file, facts, tenants), the
            connector's statistics in vLLM's periodic log line, and the failed
            request's error with its request id.

Then a second server start with ``store_budget_mb: 0`` must exit with the
setting's message in its output and never listen. (vLLM 0.32 constructs the
connector after loading the weights; on CUDA with full graphs the settings are
checked earlier, while vLLM builds its configuration.)
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.error
import urllib.request

import pytest

import common as C

START_TIMEOUT = 420  # seconds for the server to listen (2 busy cores)
BAD_START_TIMEOUT = 300
STORE_BUDGET_MB = 64


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """vLLM's OpenAI server in a process group of its own, its output in ``log_path``."""

    def __init__(self, log_path, extra, policy="fail"):
        self.port = free_port()
        self.base = "http://127.0.0.1:%d" % self.port
        self.log_path = log_path
        ktc = {"kv_connector": "KVInjectConnector", "kv_connector_module_path": "kvinject.vllm.connector",
               "kv_role": "kv_both", "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}
        e = C.ENGINE
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", C.MODEL,
               "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager", "--enable-prefix-caching",
               "--max-model-len", str(e["max_model_len"]), "--block-size", str(e["block_size"]),
               "--dtype", e["dtype"], "--seed", str(e["seed"]), "--max-num-seqs", "8",
               "--kv-transfer-config", json.dumps(ktc)]
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # common's, for the offline engines
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env["VLLM_LOGGING_COLOR"] = "0"
        env.setdefault("VLLM_LOG_STATS_INTERVAL", "2")  # vLLM's periodic log line, ours with it
        self.log = open(log_path, "w")
        self.t0 = time.time()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def text(self):
        with open(self.log_path) as f:
            return f.read()

    def wait_ready(self, timeout):
        """True once /health answers; False when the process exits first."""
        while time.time() - self.t0 < timeout:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
                    if r.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        raise AssertionError("the server did not listen within %d s; its log ends:\n%s"
                             % (timeout, self.text()[-4000:]))

    def wait_exit(self, timeout):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError("the server did not exit within %d s; its log ends:\n%s"
                                 % (timeout, self.text()[-4000:]))

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()

    def post(self, path, body, timeout=120):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get(self, path, timeout=30):
        with urllib.request.urlopen(self.base + path, timeout=timeout) as r:
            return r.read().decode()

    def complete(self, mp, tokens=2):
        """POST /v1/completions of a MemoryPrompt (greedy, ``tokens`` output
        tokens exactly); returns (response, outcome)."""
        body = {"model": C.MODEL, "prompt": mp.prompt_token_ids, "max_tokens": tokens, "min_tokens": tokens,
                "temperature": 0.0, "kv_transfer_params": mp.kv_transfer_params}
        resp = self.post("/v1/completions", body)
        return resp, (resp.get("kv_transfer_params") or {}).get("kvinject")


def metric_values(text):
    """{(name, frozenset(labels)): value} of the kvinject: samples of a /metrics page."""
    out = {}
    for line in text.splitlines():
        m = re.match(r'^(kvinject:[a-z_]+)(?:\{(.*)\})? (\S+)$', line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def sample(values, name, **labels):
    """The sum of a metric's samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in values.items() if n == name and want <= set(ls))


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def server(work_dir):
    store_path = os.path.join(work_dir, "server.kvi")
    if os.path.exists(store_path):
        os.remove(store_path)
    s = Server(os.path.join(work_dir, "server.log"),
               {"store_dtype": "fp32", "store_budget_mb": STORE_BUDGET_MB, "store_path": store_path},
               policy="recompute")
    s.store_path = store_path
    try:
        assert s.wait_ready(START_TIMEOUT), "the server exited (%s); its log ends:\n%s" % (s.proc.returncode,
                                                                                            s.text()[-4000:])
        C.log("server with the connector up in %.0f s on port %d" % (time.time() - s.t0, s.port))
        yield s
    finally:
        s.stop()


def facts_of(sc, t):
    return list(zip([C.HEADER_ID] + C.FACT_IDS, [sc.header] + sc.facts[t]))


@pytest.fixture(scope="module")
def served(server, scenario):
    """Every request of the scenario, in order: {name: (response, outcome)}."""
    from kvinject.vllm import Keep, capture_prompt, memory_prompt, remove_prompt
    sc, out = scenario, {}
    ids = [C.HEADER_ID] + C.FACT_IDS
    keep = lambda t: [Keep(f, s) for f, s in zip(ids, [sc.header] + sc.facts[t])] + [sc.questions[0]]  # noqa: E731
    out["capture"] = server.complete(capture_prompt(1, keep(1)))
    out["capture_1_token"] = server.complete(capture_prompt(2, keep(2)), tokens=1)
    out["inject"] = server.complete(memory_prompt(1, facts_of(sc, 1), sc.questions[1]))
    out["inject_2"] = server.complete(memory_prompt(2, facts_of(sc, 2), sc.questions[1]))
    out["capture_again"] = server.complete(capture_prompt(1, [sc.header, Keep(C.FACT_IDS[0], sc.facts[1][0]),
                                                              sc.questions[0]]))
    out["remove"] = server.complete(remove_prompt(1, [C.FACT_IDS[2], 999], sc.header[0]))
    out["remove_all"] = server.complete(remove_prompt(2, "all", sc.header[0]))
    # fact 3 of tenant 1 is gone: the injection fails, vLLM recomputes the prompt
    rec = memory_prompt(1, facts_of(sc, 1), sc.questions[0])
    qstart = len(rec.prompt_token_ids) - len(sc.questions[0])
    rec.params["capture"] = [{"fact_id": 50, "start": qstart, "length": 3}]
    server.recompute_capture_ids = rec.prompt_token_ids[qstart:qstart + 3]
    out["recompute"] = server.complete(rec)
    bad = memory_prompt(1, facts_of(sc, 1), sc.questions[0])
    bad.params["inject"][1][1] += 1  # not back to back
    out["bad"] = server.complete(bad)
    for name, (resp, outcome) in out.items():
        C.log("  %s: %r -> %s" % (name, resp["choices"][0]["text"], json.dumps(outcome)))
    return types.SimpleNamespace(out=out, claim=len(sc.header) + sum(len(f) for f in sc.facts[1]),
                                 claim2=len(sc.header) + sum(len(f) for f in sc.facts[2]))


def outcome(served, name):
    resp, oc = served.out[name]
    assert oc is not None, "no kv_transfer_params.kvinject in %s" % json.dumps(resp)[:2000]
    return oc


# ------------------------------------------------------------------ outcomes

def test_capture_with_two_output_tokens_lists_the_stored_facts(served):
    assert outcome(served, "capture") == {"tenant": 1, "injected_facts": 0, "injected_tokens": 0,
                                          "captured": [C.HEADER_ID] + C.FACT_IDS, "removed": [], "errors": [],
                                          "pending": False}


def test_capture_with_one_output_token_is_pending_but_stored(served):
    oc = outcome(served, "capture_1_token")
    assert (oc["pending"], oc["captured"], oc["errors"]) == (True, [], [])
    # stored all the same: tenant 2's facts inject
    assert outcome(served, "inject_2")["injected_facts"] == 4


def test_inject_reports_the_facts_and_tokens(served):
    assert outcome(served, "inject") == {"tenant": 1, "injected_facts": 4, "injected_tokens": served.claim,
                                         "captured": [], "removed": [], "errors": [], "pending": False}
    assert outcome(served, "inject_2")["injected_tokens"] == served.claim2


def test_a_failing_capture_is_reported_in_errors(served):
    oc = outcome(served, "capture_again")
    assert oc["captured"] == [] and oc["pending"] is False, oc
    (msg,) = oc["errors"]
    assert msg.startswith("capture of fact %d (tenant 1) failed: " % C.FACT_IDS[0]), msg


def test_remove_lists_the_facts_removed(served):
    assert outcome(served, "remove") == {"tenant": 1, "injected_facts": 0, "injected_tokens": 0, "captured": [],
                                         "removed": [C.FACT_IDS[2]], "errors": [], "pending": False}
    assert outcome(served, "remove_all")["removed"] == sorted([C.HEADER_ID] + C.FACT_IDS)


def test_a_failed_injection_recomputed_reports_the_message_and_its_capture(served, server):
    resp, oc = served.out["recompute"]
    assert resp["choices"][0]["finish_reason"] == "length" and len(resp["choices"][0]["text"]) > 0
    assert (oc["injected_facts"], oc["injected_tokens"], oc["pending"]) == (0, 0, False), oc
    msg, cap = oc["errors"]
    assert "%d" % C.FACT_IDS[2] in msg and "tenant 1" in msg, msg
    # the recomputed prefill holds the removed fact's text: the capture after it is not kept
    assert cap.startswith("capture of fact 50 (tenant 1) failed: ") and "(%d) of fact 50 names no fact of tenant 1" \
        % C.FACT_IDS[2] in cap, cap
    assert oc["captured"] == [], oc


def test_bad_parameters_are_reported_in_errors(served):
    resp, oc = served.out["bad"]
    assert oc["tenant"] == 1 and oc["injected_facts"] == 0
    assert any("back to back" in m for m in oc["errors"]), oc


# ------------------------------------------------------------------- metrics

@pytest.fixture(scope="module")
def metrics(server, served):
    """/metrics once the counts of the scenario are in (the stats of the last
    step reach the server's loggers after its response)."""
    deadline = time.time() + 30
    while True:
        vals = metric_values(server.get("/metrics"))
        done = (sample(vals, "kvinject:captures_failed_total") >= 2
                and sample(vals, "kvinject:failures_total", reason="parse") >= 1)
        if done or time.time() > deadline:
            return vals
        time.sleep(0.5)


EXPECTED_METRICS = ["kvinject:requests_injected_total", "kvinject:facts_injected_total",
                    "kvinject:tokens_injected_total", "kvinject:failures_total", "kvinject:captures_stored_total",
                    "kvinject:captures_failed_total", "kvinject:facts_removed_total",
                    "kvinject:inject_seconds_count", "kvinject:inject_seconds_sum", "kvinject:inject_seconds_bucket",
                    "kvinject:store_bytes_used", "kvinject:store_facts", "kvinject:store_tenants"]


@pytest.mark.parametrize("name", EXPECTED_METRICS)
def test_metrics_every_kvinject_metric_is_exported(metrics, name):
    assert any(n == name for n, _ in metrics), sorted({n for n, _ in metrics})


def test_metrics_count_the_requests(metrics, served):
    v = lambda name, **kw: sample(metrics, name, **kw)  # noqa: E731
    assert v("kvinject:requests_injected_total") == 2
    assert v("kvinject:facts_injected_total") == 8
    assert v("kvinject:tokens_injected_total") == served.claim + served.claim2
    assert v("kvinject:captures_stored_total") == 4 + 4  # two tenants' header and facts
    assert v("kvinject:captures_failed_total") == 2     # a fact that exists; one after a removed fact
    assert v("kvinject:facts_removed_total") == 1 + 4
    assert v("kvinject:failures_total", reason="capture") == 2
    assert v("kvinject:failures_total", reason="not_found") == 1
    assert v("kvinject:failures_total", reason="parse") == 1
    assert v("kvinject:inject_seconds_count") == 2 and v("kvinject:inject_seconds_sum") > 0


def test_metrics_the_store_gauges(metrics):
    # left: tenant 1's header and facts 1, 2
    assert sample(metrics, "kvinject:store_facts") == 3
    assert sample(metrics, "kvinject:store_tenants") == 1
    assert 0 < sample(metrics, "kvinject:store_bytes_used") <= STORE_BUDGET_MB << 20


# ----------------------------------------------------------------------- log

def test_log_the_startup_line(server):
    text = server.text()
    m = re.search(r"kvinject: store budget %d MiB, dtype fp32, store file %s \(new\): 0 facts of 0 tenants; "
                  % (STORE_BUDGET_MB, re.escape(server.store_path)), text)
    assert m, [line for line in text.splitlines() if "kvinject" in line][:10]


def test_log_the_periodic_stats_line(server, served):
    # vLLM's LoggingStatLogger logs the connector's reduced stats with its own line
    deadline = time.time() + 20
    while True:
        lines = [line for line in server.text().splitlines() if "KV Transfer metrics: " in line]
        if lines or time.time() > deadline:
            break
        time.sleep(1)
    assert lines and all("requests_injected=" in line and "inject_ms_mean=" in line for line in lines), lines
    assert any("store_facts=" in line for line in lines), lines  # in the intervals where the store changed
    C.log("  " + lines[0].split("KV Transfer metrics: ", 1)[1])


def test_log_errors_name_the_request(server, served):
    text = server.text()
    fails = [line for line in text.splitlines() if re.search(r"ERROR .*kvinject: request \S+ fails: ", line)]
    assert any("tenant 1" in line and str(C.FACT_IDS[2]) in line for line in fails), fails
    assert re.search(r"ERROR .*kvinject: request \S+: capture of fact %d \(tenant 1\) failed" % C.FACT_IDS[0], text)


# ----------------------------------------------------------- a bad setting

def test_a_bad_setting_stops_the_server_with_its_message(server, served, metrics, work_dir):
    server.stop()  # one server at a time on two cores
    bad = Server(os.path.join(work_dir, "bad.log"), {"store_budget_mb": 0})
    try:
        assert bad.wait_ready(BAD_START_TIMEOUT) is False, "the server listened with store_budget_mb 0"
        rc = bad.wait_exit(60)
        C.log("  the bad server exited %s after %.0f s" % (rc, time.time() - bad.t0))
        text = bad.text()
        assert rc != 0
        assert "store_budget_mb (from kv_connector_extra_config) = 0 is out of range (1..1048576)" in text, \
            text[-4000:]
    finally:
        bad.stop()
