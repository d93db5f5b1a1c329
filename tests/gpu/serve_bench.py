#!/usr/bin/env python3
"""Memory requests under load, the way serving engines are compared: ``vllm
serve`` with the kvinject connector (and the memory gateway in front of it),
driven by vLLM's own benchmark client (``vllm.benchmarks.serve.benchmark``:
Poisson arrivals at a request rate, streamed answers, TTFT measured at the
client), at a sweep of request rates, for each of these targets:

  reprefill  ``/v1/completions`` of [chat header | k facts as text | question]
             as token ids, each request with a cache salt of its own: vLLM
             prefills every token (no prefix-cache reuse);
  prefix     the same token ids without a salt: plain vLLM with its prefix
             cache, which reuses whatever prefix an earlier request left
             (the header, a user's leading facts);
  inject     the same token ids with ``kv_transfer_params`` injecting the
             header and the k facts from the connector's store
             (kvinject.vllm.memory_prompt): vLLM prefills the question alone.
             The header and every fact are captured once before timing, from
             vLLM's own prefill of [header | all the user's facts | question]
             (kvinject.vllm.capture_prompt), as tests/gpu/vllm_bench.py does;
  gateway    ``/v1/chat/completions`` through ``python -m kvinject.serve`` with
             ``user`` and ``memory: {"k": k}``: the gateway embeds the
             question, retrieves the user's k best facts, lays the prompt out
             and sends it to the replica with the facts injected; the users'
             facts are added through ``POST /v1/memories`` before timing;
  plain      as reprefill, on a replica started without the connector (a run
             of its own: ``--targets plain`` alone).

Requests. N users (--users), each with F facts (--facts) in Mem0's style
("User's favourite fruit is mango, since a trip to Lisbon."), each fact 10 to
20 tokens of the model's tokenizer; a question about one of the user's facts
("Remind me: what is my favourite fruit?") in the model's chat template, under
the gateway's system prompt and memory heading (kvinject.serve.layout: the
prompt the gateway builds). A request of size k holds the asked fact and k-1
others of the user, drawn at random; the same requests (users, facts,
questions) at a given k for every target, fixed by --seed. Every request asks
for --output-len tokens (ignore_eos), greedy.

The client: vLLM's ``benchmark`` coroutine with ``SampleRequest``s built here
(the prompt, its length, the output length), through vLLM's own OpenAI
request functions, wrapped so that each request's body carries its own fields
(cache salt, ``kv_transfer_params``; the gateway's ``user``, ``memory`` and
``messages``) whatever per-request fields the installed vLLM's SampleRequest
has; ``benchmark`` is called with the arguments its signature takes. vLLM's
readiness check and warm-up are off (--warmup requests go out one at a time
first, with fresh salts).

Per point (target, k, rate): max(--min-prompts, rate x --duration) requests at
Poisson arrivals (--burstiness 1), vLLM's metrics of the run (TTFT mean, p50,
p90, p99; TPOT, end-to-end latency; output tokens/s, requests/s; completed and
failed), and the replica's own TTFT histogram over the run
(``vllm:time_to_first_token_seconds``: its mean and its p50 / p99 interpolated
in the buckets, as Prometheus' histogram_quantile does). At each (target, k)
the rates are tried in increasing order; once a rate's p99 TTFT exceeds
--saturate times the threshold, higher rates are skipped (recorded as such).

The gateway's own added latency, three ways (all in the report):
  vs inject   gateway TTFT p50 / p99 less the inject target's at the same k
              and rate: the same client, the same replica, requests of the
              same shape sent straight to it; what remains is what the gateway
              adds (HTTP hop, embedding, retrieval, layout, streaming relay),
              including the queueing that this causes under load;
  vs replica  gateway TTFT less the replica's own TTFT over the same requests
              (the replica's histogram over the gateway run): exact for the
              mean, the buckets' resolution for p50 / p99 (vLLM's edges are
              20 ms apart from 20 to 100 ms, then 250, 500, 750 ms, 1 s: coarse
              around 200 ms); the replica's TTFT starts at its engine's
              arrival, so its own HTTP front end counts as the gateway's here.
  own         the gateway's kvinject_gateway_overhead_seconds over the run:
              each streamed chat's time to its first chunk less the time the
              gateway waited for the replica's first event (p50 / p99 within
              its buckets, 0.25 ms apart below 1 ms, 1 ms to 5 ms);
  The gateway's own histograms over the run add its mean embedding and
  retrieval time per call (kvinject_gateway_embedding_seconds,
  kvinject_gateway_retrieval_seconds), and the facts it injected per request.

Every point goes into OUT/serve_bench.json as soon as it is measured (a point
already there is skipped: a run cut off, or a sweep split over several
commands by --targets / --k / --rates, goes on where it stopped; --redo
measures again). From the JSON: OUT/serve_bench.md (per target x k x rate:
TTFT p50 / p99, output tokens/s, requests/s; per target x k: the highest rate
whose p99 TTFT is <= --threshold-ms and that completed every request; the
gateway's added latency) and OUT/serve_bench.png (p99 TTFT against request
rate, one line per target, one panel per k) when matplotlib imports.
``--plot OUT`` writes the table and the plot from the JSON alone, with any
interpreter that has matplotlib (vLLM's venv here has none).

Servers. Unless --replica URL (and --gateway URL) name running ones, the
script starts ``vllm serve MODEL`` on 127.0.0.1 (tests' servers.py), with the
connector (``store_dtype`` --store-dtype, ``store_budget_mb`` --store-mb)
unless the run is ``--targets plain``, then the gateway (tests'
gateway_common.py: its system prompt and heading, the embedder at
KVI_EMBEDDER) when a target needs it, and stops both at the end. --device cpu
gives vLLM's CPU settings (servers.CPU_ARGS); --device gpu gives
``--dtype bfloat16 --max-model-len --gpu-memory-utilization --max-num-seqs``
(CUDA graphs and torch.compile as vLLM sets them), with ``--load-format dummy``
when the model directory has no weights; --serve-arg adds options. The
gateway's database and the store start empty at every run (the facts are
added again: seconds). --time-budget S: no point starts that would end past S
seconds of the run (then exit 3: run the same command again to go on).

On the CPU (a smoke test: the figures mean nothing), from the repository root,
the library built without CUDA in build-nocuda::

    KVINJECT_LIBRARY=$PWD/build-nocuda/lib/libkvinject.so \\
      python3 python/tests/vllm/launch.py $PWD/tests/gpu/serve_bench.py \\
      --device cpu --users 8 --facts 20 --k 5,20 --rates 1,2 --min-prompts 20 \\
      --duration 1 --output-len 8 --warmup 2 --store-mb 256 --saturate 1000 \\
      --out /tmp/serve-bench

On the GPU machine (tests/gpu/serve_bench.sh runs it there; its header gives
the expected device time of each call), one call after the other::

    tests/gpu/vllm_gpu.sh pack && tests/gpu/serve_bench.sh pack     # here (network)
    tests/gpu/vllm_gpu.sh stage                      carry [".stage/vllmgpu.00"]
    tests/gpu/vllm_gpu.sh stage                      carry [".stage/vllmgpu.01"]
    VLLM_GPU_DUMMY=1 tests/gpu/vllm_gpu.sh setup     carry [".stage/vllmgpu.02"]
    tests/gpu/serve_bench.sh run --targets reprefill,inject --k 5,10,20,50
                                                     carry [".stage/servebench.00"]
    (the same command again, carry [], while it exits 3: points left)
    tests/gpu/serve_bench.sh run --targets gateway --k 5,10,20,50    carry []
    tests/gpu/serve_bench.sh run --targets plain --k 5,10,20,50      (optional)

then, with the last call's serve_bench.json in DIR here,
``/tmp/mpl/venv/bin/python tests/gpu/serve_bench.py --plot DIR``. Each call
stays under 9 minutes (serve_bench.sh: SERVE_BENCH_TIMEOUT 540 s, points
started only within --time-budget, 60 s less).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import re
import signal
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
VLLM_TESTS = os.path.join(ROOT, "python", "tests", "vllm")

TARGETS = ("reprefill", "prefix", "inject", "gateway", "plain")
LABELS = {"reprefill": "re-prefill", "prefix": "re-prefill, vLLM prefix cache", "inject": "injection",
          "gateway": "gateway (injection)", "plain": "re-prefill, no connector"}
DIRECT_TENANT = 1 << 32   # the inject target's tenants (the gateway numbers its users from 1)
HEADER_FACT = 0           # the header is each tenant's fact 0, as the gateway keeps it
GATEWAY_USER = "bench-%03d"
TTFT_HIST = "vllm:time_to_first_token_seconds"
OVERHEAD_HIST = "kvinject_gateway_overhead_seconds"
HISTOGRAMS = (TTFT_HIST, OVERHEAD_HIST)   # scraped with their buckets
GATEWAY_METRICS = ("kvinject_gateway_injected_facts_total", "kvinject_gateway_embedding_seconds_sum",
                   "kvinject_gateway_embedding_seconds_count", "kvinject_gateway_retrieval_seconds_sum",
                   "kvinject_gateway_retrieval_seconds_count", OVERHEAD_HIST)

# Mem0-style facts: "User's <kind> <subject> is <value><reason>."
KINDS = ["favourite", "least favourite", "childhood favourite"]
SUBJECTS = ["fruit", "city", "sport", "car", "dog breed", "colour", "book", "band", "drink", "season", "film",
            "dish", "instrument", "holiday spot", "phone brand", "flower", "board game", "podcast", "painter",
            "dessert", "video game", "museum", "cheese", "bird", "font"]
VALUES = ["mango", "Lisbon", "tennis", "a red Fiat", "the beagle", "green", "Dune", "Radiohead", "mint tea",
          "autumn", "Amelie", "bacalhau", "the cello", "the Azores", "Nokia", "tulips", "chess", "a history show",
          "Monet", "tiramisu", "Tetris", "the Louvre", "gouda", "the robin", "Helvetica", "kiwi", "Oslo", "skiing",
          "a blue Volvo", "the corgi", "orange", "Solaris", "coffee", "winter", "ramen", "the flute", "Kyoto",
          "Sony", "orchids", "go", "Vermeer", "baklava", "the heron", "Garamond", "Tokyo", "rowing"]
REASONS = ["", "", " these days", ", since a trip with friends", ", because of an old family habit",
           ", after trying it last summer", ", as their sister taught them", ", ever since university"]


def log(*a):
    print("serve_bench:", *a, flush=True)


# ---------------------------------------------------------------- requests

def fact_text(rng, tok, kind, subject):
    """A fact of 10 to 20 tokens (the text alone, as Mem0 stores it)."""
    for _ in range(200):
        text = "User's %s %s is %s%s." % (kind, subject, rng.choice(VALUES), rng.choice(REASONS))
        if 10 <= len(tok.encode(text, add_special_tokens=False)) <= 20:
            return text
    raise SystemExit("serve_bench: no fact of 10-20 tokens for %s %s with this tokenizer" % (kind, subject))


def make_users(tok, n_users, n_facts, seed):
    """[[(topic, text), ...] per user]: n_facts distinct topics each."""
    topics = [(k, s) for k in KINDS for s in SUBJECTS]
    if n_facts > len(topics):
        raise SystemExit("serve_bench: --facts %d: at most %d" % (n_facts, len(topics)))
    rng = random.Random(seed)
    users = []
    for _ in range(n_users):
        mine = rng.sample(topics, n_facts)
        users.append([("%s %s" % t, fact_text(rng, tok, *t)) for t in mine])
    return users


class Requests:
    """The requests of one k, the same for every target: (user, asked fact,
    fact indices in prompt order, question)."""

    def __init__(self, bench, k, n):
        rng = random.Random("%d/%d" % (bench.args.seed, k))
        self.items = []
        for _ in range(n):
            u = rng.randrange(len(bench.users))
            facts = bench.users[u]
            a = rng.randrange(len(facts))
            others = rng.sample([i for i in range(len(facts)) if i != a], k - 1)
            self.items.append((u, a, sorted(others + [a]), "Remind me: what is my %s?" % facts[a][0]))


# ---------------------------------------------------------------- metrics

def scrape(url, names=(TTFT_HIST, "kvinject:captures_stored_total", "kvinject:tokens_injected_total",
                       "vllm:prompt_tokens_total", "vllm:prefix_cache_hits_total")):
    """{name: value} summed over labels, and name_bucket as {le: count}."""
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in names:
        if name in HISTOGRAMS:
            b = {}
            for m in re.finditer(r'^%s_bucket\{([^}]*)\} ([0-9.eE+-]+)$' % re.escape(name), text, re.M):
                le = re.search(r'le="([^"]+)"', m.group(1)).group(1)
                b[le] = b.get(le, 0.0) + float(m.group(2))
            out[name + "_bucket"] = b
            for part in ("_sum", "_count"):
                out[name + part] = sum(float(v) for v in re.findall(
                    r'^%s%s(?:\{[^}]*\})? ([0-9.eE+-]+)$' % (re.escape(name), part), text, re.M))
        else:
            out[name] = sum(float(v) for v in re.findall(
                r'^%s(?:\{[^}]*\})? ([0-9.eE+-]+)$' % re.escape(name), text, re.M))
    return out


def hist_quantile(q, before, after, name=TTFT_HIST):
    """Prometheus' histogram_quantile over the buckets' increase (seconds)."""
    b0, b1 = before.get(name + "_bucket", {}), after.get(name + "_bucket", {})
    les = sorted(b1, key=lambda s: float("inf") if s == "+Inf" else float(s))
    cum = [(float("inf") if le == "+Inf" else float(le), b1[le] - b0.get(le, 0.0)) for le in les]
    if not cum or cum[-1][1] <= 0:
        return None
    rank = q * cum[-1][1]
    lo_edge, lo_count = 0.0, 0.0
    for edge, count in cum:
        if count >= rank:
            if math.isinf(edge):
                return lo_edge
            return lo_edge + (edge - lo_edge) * ((rank - lo_count) / max(count - lo_count, 1e-12))
        lo_edge, lo_count = edge, count
    return lo_edge


def hist_stats(before, after, name):
    """A histogram's increase: its count, mean, p50 and p99 (ms; the quantiles
    interpolated in the buckets), or {} when nothing was observed."""
    n = after[name + "_count"] - before[name + "_count"]
    if n <= 0:
        return {}
    out = {"requests": int(round(n)), "mean_ms": 1e3 * (after[name + "_sum"] - before[name + "_sum"]) / n}
    for q in (0.5, 0.99):
        v = hist_quantile(q, before, after, name)
        out["p%d_ms" % round(q * 100)] = None if v is None else 1e3 * v
    return out


def replica_ttft(before, after):
    out = hist_stats(before, after, TTFT_HIST)
    if not out:
        return {}
    for name, key in (("kvinject:tokens_injected_total", "tokens_injected"),
                      ("vllm:prompt_tokens_total", "prompt_tokens"),
                      ("vllm:prefix_cache_hits_total", "prefix_cache_hits")):
        out[key] = int(round(after.get(name, 0) - before.get(name, 0)))
    return out


# ---------------------------------------------------------------- vLLM's client

# Each request's own body fields (cache salt, kv_transfer_params, the gateway's
# user, memory and messages), by request id (or the prompt object where
# SampleRequest has no request id): vLLM's request functions wrapped to merge
# them into the body, for every vLLM version's SampleRequest (some have no
# per-request fields).
PER_REQUEST = {}


def _with_fields(func):
    async def request(request_func_input, session, pbar=None, **kw):
        rid = getattr(request_func_input, "request_id", None)
        extra = PER_REQUEST.get(rid) if rid else None
        if extra is None:
            extra = PER_REQUEST.get(id(request_func_input.prompt))
        if extra:
            request_func_input = dataclasses.replace(
                request_func_input, extra_body=dict(request_func_input.extra_body or {}, **extra))
        return await func(request_func_input=request_func_input, session=session, pbar=pbar, **kw)
    return request


def benchmark_module():
    """vllm.benchmarks.serve. Where Hugging Face's datasets package is absent
    (the GPU machine's image), a stand-in for it goes into sys.modules first:
    some vLLM versions import it unguarded at the top of
    vllm.benchmarks.datasets, for datasets that this script never loads."""
    import importlib.machinery
    import importlib.util
    import types
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        stub = types.ModuleType("datasets")
        stub.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

        class Dataset:  # noqa: D401 - a name to import, never used
            pass

        def load_dataset(*_a, **_k):
            raise ImportError("Hugging Face's datasets package is not installed")

        stub.Dataset, stub.load_dataset = Dataset, load_dataset
        sys.modules["datasets"] = stub
    from vllm.benchmarks import serve
    return serve


def client_requests(items, output_len):
    """vLLM's SampleRequests of (prompt, prompt tokens, fields) items."""
    benchmark_module()
    from vllm.benchmarks.datasets import SampleRequest
    fields = {f.name for f in dataclasses.fields(SampleRequest)}
    tag = uuid.uuid4().hex[:8]
    out = []
    for i, (prompt, n, extra) in enumerate(items):
        kw = {"prompt": prompt, "prompt_len": n, "expected_output_len": output_len}
        if "request_id" in fields:
            kw["request_id"] = "kvi-%s-%d" % (tag, i)
            PER_REQUEST[kw["request_id"]] = extra
        PER_REQUEST[id(prompt)] = extra
        out.append(SampleRequest(**kw))
    return out


def run_client(chat, base, model_id, tokenizer, reqs, rate, burstiness):
    """vllm.benchmarks.serve.benchmark at one request rate; its result dict."""
    import inspect
    S = benchmark_module()
    funcs = S.ASYNC_REQUEST_FUNCS
    name = "kvinject-openai-chat" if chat else "kvinject-openai"
    if name not in funcs:
        funcs[name] = _with_fields(funcs["openai-chat" if chat else "openai"])
    kw = dict(endpoint_type=name, api_url=base + ("/v1/chat/completions" if chat else "/v1/completions"),
              base_url=base, model_id=model_id, model_name=None, tokenizer=tokenizer, input_requests=reqs,
              logprobs=None, request_rate=rate, burstiness=burstiness, disable_tqdm=True, num_warmups=0,
              profile=False, profile_num_steps=None, selected_percentile_metrics=["ttft", "tpot", "e2el"],
              selected_percentiles=[50.0, 90.0, 99.0], ignore_eos=True, goodput_config_dict={},
              max_concurrency=None, lora_modules=None, extra_headers=None, extra_body=None,
              ready_check_timeout_sec=0)
    params = inspect.signature(S.benchmark).parameters
    if "task_type" in params:
        kw["task_type"] = S.TaskType.GENERATION
    if "endpoint_type" not in params:
        kw["backend"] = kw.pop("endpoint_type")
    missing = [p for p, v in params.items() if v.default is inspect.Parameter.empty and p not in kw]
    if missing:
        raise SystemExit("serve_bench: this vLLM's benchmark() needs %s" % missing)
    return asyncio.run(S.benchmark(**{k: v for k, v in kw.items() if k in params}))


# ---------------------------------------------------------------- the bench

class Bench:
    def __init__(self, args):
        self.args = args
        os.environ.setdefault("KVI_VLLM_MODEL", args.model)
        os.environ["KVI_VLLM_MODEL"] = args.model
        sys.path.insert(0, VLLM_TESTS)
        import gateway_common as G
        from kvinject.serve.layout import Layout
        self.G = G
        self.lay = Layout(args.model, G.SYSTEM_PROMPT, G.HEADING)
        self.tok = self.lay.tokenizer
        self.users = make_users(self.tok, args.users, args.facts, args.seed)
        self.fact_ids = [[self.lay.fact_tokens(t) for _, t in u] for u in self.users]
        self.replica = self.gateway = None
        self.replica_url = args.replica
        self.gateway_url = args.gateway
        self.model_id = None

    # -- servers
    def serve_args(self):
        a = self.args
        if a.device == "cpu":
            from servers import CPU_ARGS
            out = list(CPU_ARGS)
        else:
            out = ["--dtype", "bfloat16", "--max-model-len", str(a.max_model_len), "--gpu-memory-utilization",
                   str(a.gpu_mem), "--max-num-seqs", str(a.max_num_seqs)]
            if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(a.model)):
                out += ["--load-format", "dummy"]
        return out + list(a.serve_arg or [])

    def start(self, plain, need_gateway):
        from servers import start_vllm_serve
        a = self.args
        state = os.path.join(a.out, "state")
        os.makedirs(state, exist_ok=True)
        if self.replica_url is None:
            conn = None if plain else {"store_dtype": a.store_dtype, "store_budget_mb": a.store_mb}
            t0 = time.monotonic()
            self.replica = start_vllm_serve(a.model, None, conn, self.serve_args(),
                                            os.path.join(a.out, "replica%s.log" % ("-plain" if plain else "")),
                                            timeout=a.start_timeout)
            self.replica_url = self.replica.url
            log("vllm serve up at %s in %.0f s (%s)" % (self.replica_url, time.monotonic() - t0,
                                                       "plain" if plain else "connector"))
        import httpx
        self.model_id = httpx.get(self.replica_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        if need_gateway and self.gateway_url is None:
            db = os.path.join(state, "gateway.db")
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(db + suffix):
                    os.remove(db + suffix)
            self.gateway = self.G.Gateway([self.replica_url], db, os.path.join(a.out, "gateway.log"))
            t0 = time.monotonic()
            self.gateway.wait(timeout=a.start_timeout)
            self.gateway_url = self.gateway.url
            log("gateway up at %s in %.0f s" % (self.gateway_url, time.monotonic() - t0))

    def stop(self):
        if self.gateway is not None:
            self.gateway.stop()
        if self.replica is not None:
            self.replica.stop()

    # -- facts
    def add_to_gateway(self):
        import httpx
        t0 = time.monotonic()
        with httpx.Client(timeout=600) as c:
            for u, facts in enumerate(self.users):
                name = GATEWAY_USER % u
                r = c.get(self.gateway_url + "/v1/memories", params={"user": name})
                have = len(r.json().get("results", [])) if r.status_code == 200 else 0
                if have >= len(facts):
                    continue
                r = c.post(self.gateway_url + "/v1/memories", json={"user": name, "facts": [t for _, t in facts]})
                if r.status_code != 200:
                    raise SystemExit("serve_bench: adding %s's facts through the gateway: HTTP %d: %s"
                                     % (name, r.status_code, r.text[:2000]))
        log("gateway: %d users x %d facts added in %.1f s" % (len(self.users), self.args.facts,
                                                              time.monotonic() - t0))

    def capture_direct(self):
        """The inject target's store: header + every fact of each user, captured
        from vLLM's prefill of [header | facts | question] (one request per user)."""
        import httpx
        from kvinject.vllm import prompt as P
        before = scrape(self.replica_url)
        tail, _ = self.lay.tail([{"role": "user", "content": "Remind me of everything."}])
        t0 = time.monotonic()
        with httpx.Client(timeout=600) as c:
            for u, ids in enumerate(self.fact_ids):
                segs = [P.Keep(HEADER_FACT, self.lay.header, replace=True)]
                segs += [P.Keep(i + 1, f, replace=True) for i, f in enumerate(ids)]
                cp = P.capture_prompt(DIRECT_TENANT + u, segs + [tail])
                r = c.post(self.replica_url + "/v1/completions", json={
                    "model": self.model_id, "prompt": cp.prompt_token_ids, "max_tokens": P.RESULT_TOKENS,
                    "min_tokens": P.RESULT_TOKENS, "temperature": 0.0, "kv_transfer_params": cp.kv_transfer_params})
                if r.status_code != 200:
                    raise SystemExit("serve_bench: capture for tenant %d: HTTP %d: %s"
                                     % (DIRECT_TENANT + u, r.status_code, r.text[:2000]))
        stored = int(round(scrape(self.replica_url)["kvinject:captures_stored_total"]
                           - before["kvinject:captures_stored_total"]))
        want = sum(len(f) + 1 for f in self.fact_ids)
        if stored != want:
            raise SystemExit("serve_bench: the captures stored %d facts, expected %d (the replica's log: %s)"
                             % (stored, want, self.replica.log_path if self.replica else "?"))
        log("inject: %d facts (headers included) captured in %.1f s" % (stored, time.monotonic() - t0))

    # -- requests of one target
    def sample_requests(self, target, k, n):
        """[(prompt, prompt tokens, the request body's fields of this request)]:
        token ids for /v1/completions, the question for the gateway's chat."""
        from kvinject.vllm import prompt as P
        out = []
        for u, _, sel, question in Requests(self, k, n).items:
            tail, _ = self.lay.tail([{"role": "user", "content": question}])
            facts = [self.fact_ids[u][i] for i in sel]
            ids = self.lay.prompt(facts, tail)
            extra = {"temperature": 0.0}
            prompt = ids
            if target in ("reprefill", "plain"):
                extra["cache_salt"] = uuid.uuid4().hex
            elif target == "inject":
                mp = P.memory_prompt(DIRECT_TENANT + u, [(HEADER_FACT, self.lay.header)]
                                     + [(i + 1, f) for i, f in zip(sel, facts)], tail)
                assert mp.prompt_token_ids == ids
                extra["kv_transfer_params"] = mp.kv_transfer_params
            elif target == "gateway":
                prompt = question
                extra.update(messages=[{"role": "user", "content": question}], user=GATEWAY_USER % u,
                             memory={"k": k})
            out.append((prompt, len(ids), extra))
        return out

    def base(self, target):
        return self.gateway_url if target == "gateway" else self.replica_url

    def warm(self, target, k):
        """A few requests one at a time before a (target, k) is timed."""
        import httpx
        for prompt, _, extra in self.sample_requests(target, k, self.args.warmup):
            body = dict(extra, model=self.model_id, max_tokens=self.args.output_len, ignore_eos=True)
            if target == "gateway":
                path = "/v1/chat/completions"
            else:
                body["prompt"] = prompt
                path = "/v1/completions"
            if "cache_salt" in body:
                body["cache_salt"] = uuid.uuid4().hex
            resp = httpx.post(self.base(target) + path, json=body, timeout=600)
            if resp.status_code != 200:
                raise SystemExit("serve_bench: %s warm-up: HTTP %d: %s" % (target, resp.status_code,
                                                                           resp.text[:2000]))

    def point(self, target, k, rate):
        a = self.args
        n = a.num_prompts or max(a.min_prompts, int(math.ceil(rate * a.duration)))
        items = self.sample_requests(target, k, n)
        chat = target == "gateway"
        base = self.base(target)
        reqs = client_requests(items, a.output_len)
        before = scrape(self.replica_url)
        gw_before = scrape(self.gateway_url, GATEWAY_METRICS) if chat else None
        t0 = time.time()
        try:
            res = run_client(chat, base, self.model_id, self.tok, reqs, rate, a.burstiness)
        finally:
            PER_REQUEST.clear()
        after = scrape(self.replica_url)
        p = {"target": target, "k": k, "rate": rate, "requests": n, "started": t0,
             "prompt_tokens_mean": sum(x[1] for x in items) / n}
        for key in ("duration", "completed", "failed", "request_throughput", "output_throughput",
                    "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p90_ttft_ms",
                    "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms"):
            p[key] = res.get(key)
        p["ttfts_ms"] = [round(1e3 * x, 3) for x in res.get("ttfts", []) if x]
        errs = [e for e in res.get("errors", []) if e]
        if errs:
            p["first_error"] = errs[0][:1000]
        p["replica_ttft"] = replica_ttft(before, after)
        if chat:
            after_gw = scrape(self.gateway_url, GATEWAY_METRICS)
            p["gateway_overhead"] = hist_stats(gw_before, after_gw, OVERHEAD_HIST)
            d = {m: after_gw[m] - gw_before[m] for m in GATEWAY_METRICS if m != OVERHEAD_HIST}
            p["gateway_facts_per_request"] = d["kvinject_gateway_injected_facts_total"] / n
            for what in ("embedding", "retrieval"):
                c = d["kvinject_gateway_%s_seconds_count" % what]
                p["gateway_%s_ms_mean" % what] = 1e3 * d["kvinject_gateway_%s_seconds_sum" % what] / c if c else None
        return p


# ---------------------------------------------------------------- results

def key_of(target, k, rate):
    return "%s/k%d/r%g" % (target, k, rate)


def done(data, target, k, rate):
    """Measured already (a point skipped as saturated is tried again)."""
    p = data["points"].get(key_of(target, k, rate))
    return p is not None and not p.get("skipped")


def saturated_at(data, target, k, rates, args):
    """The lowest measured rate whose p99 TTFT passed --saturate x the threshold (None: none)."""
    for r in rates:
        p = data["points"].get(key_of(target, k, r))
        if done(data, target, k, r) and (p.get("p99_ttft_ms") or 0) > args.saturate * args.threshold_ms:
            return r
    return None


def to_measure(data, target, k, rates, args):
    """The rates of (target, k) still to measure: not measured, below any saturation."""
    if args.redo:
        return list(rates)
    sat = saturated_at(data, target, k, rates, args)
    return [r for r in rates if not done(data, target, k, r) and (sat is None or r < sat)]


def load(path):
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {"points": {}, "runs": []}


def save(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def ok(p, thr):
    return (not p.get("skipped") and p.get("failed") == 0 and p.get("p99_ttft_ms") is not None
            and p["p99_ttft_ms"] <= thr)


def fmt(v, f="%.1f"):
    return "-" if v is None else f % v


def report(data, out):
    thr = data.get("threshold_ms", 200.0)
    pts = list(data["points"].values())
    order = {t: i for i, t in enumerate(TARGETS)}
    pts.sort(key=lambda p: (order.get(p["target"], 9), p["k"], p["rate"]))
    L = ["## Memory requests under load: vllm serve (%s)" % data.get("setup", {}).get("model", "?"), "",
         "setup: %s" % json.dumps(data.get("setup", {}), sort_keys=True), "",
         "| target | k | rate req/s | prompt tokens | TTFT p50 ms | TTFT p99 ms | output tok/s | req/s | "
         "done / failed | replica TTFT p50 / p99 ms (histogram) |",
         "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for p in pts:
        if p.get("skipped"):
            L.append("| %s | %d | %g | | | skipped: %s | | | | |" % (p["target"], p["k"], p["rate"], p["skipped"]))
            continue
        rt = p.get("replica_ttft") or {}
        # the prompts' length as the replica counted it (the gateway lays its prompts out itself)
        prompt = rt["prompt_tokens"] / rt["requests"] if rt.get("requests") else p["prompt_tokens_mean"]
        L.append("| %s | %d | %g | %.0f | %s | %s | %s | %s | %s / %s | %s / %s |" % (
            p["target"], p["k"], p["rate"], prompt, fmt(p["p50_ttft_ms"]), fmt(p["p99_ttft_ms"]),
            fmt(p["output_throughput"]), fmt(p["request_throughput"], "%.2f"), p["completed"], p["failed"],
            fmt(rt.get("p50_ms")), fmt(rt.get("p99_ms"))))
    L += ["", "Highest request rate with p99 TTFT <= %g ms and every request completed:" % thr, "",
          "| target | k | highest rate req/s | p99 TTFT there ms | rates tried |", "|---|--:|--:|--:|--:|"]
    best = {}
    for p in pts:
        best.setdefault((p["target"], p["k"]), []).append(p)
    for (t, k), ps in sorted(best.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
        good = [p for p in ps if ok(p, thr)]
        top = max(good, key=lambda p: p["rate"]) if good else None
        tried = max([p["rate"] for p in ps if not p.get("skipped")] or [0])
        L.append("| %s | %d | %s | %s | up to %g |" % (
            t, k, ("none" if top is None else "%g%s" % (top["rate"], " (the highest tried)"
                                                      if top["rate"] == tried else "")),
            "-" if top is None else "%.1f" % top["p99_ttft_ms"], tried))
    gw = [p for p in pts if p["target"] == "gateway" and not p.get("skipped")]
    if gw:
        L += ["", "The gateway's added latency (ms): gateway TTFT less the inject target's at the same k and "
              "rate (vs inject), less the replica's own TTFT over the gateway's requests (vs replica: "
              "mean exact, p50 / p99 within the histogram's buckets), and the gateway's own measure "
              "(own: kvinject_gateway_overhead_seconds, each chat's time to its first chunk less the "
              "replica's time to its first event as the gateway waited for it; p50 / p99 within the "
              "buckets)", "",
              "| k | rate | vs inject p50 | vs inject p99 | vs replica mean | vs replica p50 | vs replica p99 | "
              "own mean | own p50 | own p99 | facts injected per request | its embedding / retrieval ms (mean) |",
              "|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
        for p in gw:
            inj = data["points"].get(key_of("inject", p["k"], p["rate"]))
            inj = None if inj is None or inj.get("skipped") else inj
            rt = p.get("replica_ttft") or {}
            own = p.get("gateway_overhead") or {}
            sub = lambda a, b: None if a is None or b is None else a - b  # noqa: E731
            L.append("| %d | %g | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s / %s |" % (
                p["k"], p["rate"], fmt(sub(p["p50_ttft_ms"], inj and inj["p50_ttft_ms"])),
                fmt(sub(p["p99_ttft_ms"], inj and inj["p99_ttft_ms"])), fmt(sub(p["mean_ttft_ms"], rt.get("mean_ms"))),
                fmt(sub(p["p50_ttft_ms"], rt.get("p50_ms"))), fmt(sub(p["p99_ttft_ms"], rt.get("p99_ms"))),
                fmt(own.get("mean_ms"), "%.2f"), fmt(own.get("p50_ms"), "%.2f"), fmt(own.get("p99_ms"), "%.2f"),
                fmt(p.get("gateway_facts_per_request")), fmt(p.get("gateway_embedding_ms_mean")),
                fmt(p.get("gateway_retrieval_ms_mean"), "%.2f")))
    md = "\n".join(L) + "\n"
    with open(os.path.join(out, "serve_bench.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    plot(data, pts, out, thr)


def plot(data, pts, out, thr):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("serve_bench: no matplotlib here: no plot (python3 tests/gpu/serve_bench.py --plot %s with an "
              "interpreter that has it)" % out)
        return
    ks = sorted({p["k"] for p in pts})
    if not ks:
        return
    fig, axes = plt.subplots(1, len(ks), figsize=(4.2 * len(ks), 3.8), squeeze=False, sharey=True)
    for ax, k in zip(axes[0], ks):
        for t in TARGETS:
            ps = sorted((p for p in pts if p["target"] == t and p["k"] == k and not p.get("skipped")
                         and p.get("p99_ttft_ms")), key=lambda p: p["rate"])
            if ps:
                ax.plot([p["rate"] for p in ps], [p["p99_ttft_ms"] for p in ps], marker="o", label=LABELS[t])
        ax.axhline(thr, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log", base=2)
        rs = sorted({p["rate"] for p in pts if p["k"] == k})
        ax.set_xticks(rs)
        ax.set_xticklabels(["%g" % r for r in rs])
        ax.minorticks_off()
        ax.set_yscale("log")
        ax.set_title("k = %d facts" % k)
        ax.set_xlabel("request rate (req/s, Poisson)")
    axes[0][0].set_ylabel("p99 TTFT (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "serve_bench.png")
    fig.savefig(path, dpi=120)
    print("serve_bench: wrote %s" % path)


# ---------------------------------------------------------------- main

def parse_list(s, conv):
    return [conv(x) for x in s.split(",") if x.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="serve_bench.json, .md, .png, logs")
    ap.add_argument("--plot", metavar="DIR", help="only the table and the plot from DIR/serve_bench.json")
    ap.add_argument("--model", default=os.environ.get("KVI_VLLM_MODEL"), help="the model directory")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--targets", default="reprefill,inject,gateway", help="of %s" % ", ".join(TARGETS))
    ap.add_argument("--k", default="5,10,20,50", help="facts per request")
    ap.add_argument("--rates", default="4,8,16,32,64", help="request rates (req/s), increasing")
    ap.add_argument("--duration", type=float, default=8.0, help="seconds of arrivals per point")
    ap.add_argument("--min-prompts", type=int, default=50)
    ap.add_argument("--num-prompts", type=int, default=0, help="requests per point (overrides --duration)")
    ap.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--facts", type=int, default=50, help="facts per user (>= the largest k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3, help="requests one at a time before each (target, k)")
    ap.add_argument("--threshold-ms", type=float, default=200.0, help="the p99 TTFT a sustained rate keeps")
    ap.add_argument("--saturate", type=float, default=5.0,
                    help="skip higher rates once p99 TTFT passes this many times the threshold")
    ap.add_argument("--time-budget", type=float, default=0.0, help="seconds; 0: none")
    ap.add_argument("--redo", action="store_true", help="measure points the JSON already has again")
    ap.add_argument("--replica", help="a running vllm serve (with the connector) instead of starting one")
    ap.add_argument("--gateway", help="a running gateway in front of --replica")
    ap.add_argument("--store-dtype", default="bf16")
    ap.add_argument("--store-mb", type=int, default=12288)
    ap.add_argument("--gpu-mem", type=float, default=0.6)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--serve-arg", action="append", help="one more vllm serve argument (repeat)")
    ap.add_argument("--start-timeout", type=float, default=420.0)
    args = ap.parse_args(argv)
    if args.plot:
        with open(os.path.join(args.plot, "serve_bench.json")) as f:
            report(json.load(f), args.plot)
        return 0
    t_start = time.monotonic()
    # a timeout's SIGTERM stops the servers too (the finally below), not only this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    targets = parse_list(args.targets, str)
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        ap.error("--targets: %s (known: %s)" % (bad, ", ".join(TARGETS)))
    plain = "plain" in targets
    if plain and len(targets) > 1:
        ap.error("--targets plain runs alone (a replica without the connector)")
    ks, rates = parse_list(args.k, int), sorted(parse_list(args.rates, float))
    if max(ks) > args.facts:
        ap.error("--k %d > --facts %d" % (max(ks), args.facts))
    if not args.model:
        ap.error("--model (or KVI_VLLM_MODEL)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "serve_bench.json")
    data = load(path)
    data["threshold_ms"] = args.threshold_ms
    todo = [(t, k, r) for t in targets for k in ks for r in to_measure(data, t, k, rates, args)]
    if not todo:
        log("every point of this sweep is in %s already (--redo to measure again)" % path)
        report(data, args.out)
        return 0

    bench = Bench(args)
    lens = [len(f) for u in bench.fact_ids for f in u]
    setup = {"model": os.path.basename(os.path.normpath(args.model)), "device": args.device,
             "users": args.users, "facts_per_user": args.facts, "fact_tokens_min_max": [min(lens), max(lens)],
             "header_tokens": len(bench.lay.header), "output_len": args.output_len, "burstiness": args.burstiness,
             "duration_s": args.duration, "min_prompts": args.min_prompts, "store_dtype": args.store_dtype,
             "serve_args": bench.serve_args() if not args.replica else "external"}
    data.setdefault("setup", {}).update(setup)
    try:
        import vllm
        data["setup"]["vllm"] = vllm.__version__
    except Exception:  # pragma: no cover
        pass
    log("%d users x %d facts of %d-%d tokens (with the list marker); header %d tokens; %d points to measure"
        % (args.users, args.facts, min(lens), max(lens), len(bench.lay.header), len(todo)))
    rc = 0
    try:
        bench.start(plain, "gateway" in targets)
        if "inject" in targets:
            bench.capture_direct()
        if "gateway" in targets:
            bench.add_to_gateway()
        run = {"targets": targets, "k": ks, "rates": rates, "started": time.time(), "measured": []}
        data["runs"].append(run)
        for t in targets:
            for k in ks:
                pending = [r for r in rates if args.redo or not done(data, t, k, r)]
                if not to_measure(data, t, k, rates, args):
                    continue
                saturated = None if args.redo else saturated_at(data, t, k, rates, args)
                warmed = False
                for r in pending:
                    key = key_of(t, k, r)
                    if saturated is not None and r > saturated:
                        data["points"][key] = {"target": t, "k": k, "rate": r,
                                               "skipped": "saturated at %g req/s" % saturated}
                        save(path, data)
                        continue
                    n = args.num_prompts or max(args.min_prompts, int(math.ceil(r * args.duration)))
                    expect = n / r + 30.0
                    if args.time_budget and time.monotonic() - t_start + expect > args.time_budget:
                        log("time budget: %s and later points left for the next run" % key)
                        rc = max(rc, 3)
                        raise StopIteration
                    if not warmed:
                        bench.warm(t, k)
                        warmed = True
                    p = bench.point(t, k, r)
                    data["points"][key] = p
                    run["measured"].append(key)
                    save(path, data)
                    rt = p["replica_ttft"]
                    log("%s: %d/%d done, TTFT p50 %s / p99 %s ms, %.1f output tok/s, %.2f req/s; the replica: TTFT "
                        "p50 %s ms, %s prompt tokens, %s injected, %s from its prefix cache%s" % (
                            key, p["completed"] or 0, p["requests"], fmt(p["p50_ttft_ms"]), fmt(p["p99_ttft_ms"]),
                            p["output_throughput"] or 0, p["request_throughput"] or 0, fmt(rt.get("p50_ms")),
                            rt.get("prompt_tokens"), rt.get("tokens_injected"), rt.get("prefix_cache_hits"),
                            ("; first error: " + p["first_error"][:300]) if p.get("first_error") else ""))
                    if t in ("inject", "gateway") and p["completed"] and not rt.get("tokens_injected"):
                        log("%s: nothing injected (the replica's log: %s)" % (key, bench.replica.log_path
                                                                               if bench.replica else "?"))
                        rc = max(rc, 1)
                    if p["failed"]:
                        rc = max(rc, 1)
                    if (p.get("p99_ttft_ms") or 0) > args.saturate * args.threshold_ms:
                        saturated = r
    except StopIteration:
        pass
    finally:
        bench.stop()
        save(path, data)
    report(data, args.out)
    log("done in %.0f s" % (time.monotonic() - t_start))
    return rc


if __name__ == "__main__":
    sys.exit(main())
