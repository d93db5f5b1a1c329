#!/usr/bin/env python3
"""Time to first token and throughput inside vLLM on a GPU: re-prefill against the
kvinject connector. One engine (the connector loaded, vLLM's prefix cache off, CUDA
graphs as vLLM sets them unless --eager) serves both kinds of request:

  re-prefill  [header | k facts | question] as plain tokens: vLLM prefills all of it;
  injected    the same prompt with the header and facts injected from the store
              (kvinject.vllm.memory_prompt): vLLM prefills the question alone.

Before timing, one request captures the header and all facts from vLLM's own
prefill of [header | facts | question] (capture_prompt: each fact's KV computed
after everything before it), so the injected KV is the KV re-prefill computes
(up to the store's dtype) at the same positions.

A request is a 32-token header, k facts of 24 tokens and a 32-token question,
random token ids (the model's weights are random too). Measured:

  TTFT        one request at a time, k in --k; wall time of LLM.generate with
              max_tokens=1 (the first token), --warmup calls first, then --reps
              calls of each kind interleaved; medians;
  throughput  --concurrency requests submitted together at the largest k
              (requests/s = n / wall time of the generate call; median of
              --tput-reps after one warm-up), for each of --tput-tokens;
  connector   from its events (time_device on): host time in start_load_kv per
              injecting step, the injection's device time and the step's device
              time (injection start to end of forward); shares of TTFT and step.

Writes vllm_bench.json and vllm_bench.md into --out; prints the tables.

    python3 tests/gpu/vllm_bench.py --model DIR --out DIR [--dummy] [--eager]

Needs vLLM (with CUDA) and kvinject importable, KVINJECT_LIBRARY pointing at a
CUDA build of libkvinject.
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

TENANT, HEADER_ID = 7, 1000


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def log(*a):
    print(*a, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--k", default="0,5,10,20,50")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tput-tokens", default="1,16", help="output tokens per request in the throughput runs")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tput-reps", type=int, default=3)
    ap.add_argument("--header-tokens", type=int, default=32)
    ap.add_argument("--fact-tokens", type=int, default=24)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--store-dtype", default="bf16")
    ap.add_argument("--store-mb", type=int, default=1024)
    ap.add_argument("--gpu-mem", type=float, default=0.6, help="vLLM gpu_memory_utilization")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs, no torch.compile)")
    ap.add_argument("--dummy", action="store_true", help="load_format='dummy' (the model directory holds a config)")
    ap.add_argument("--no-device-timing", action="store_true")
    args = ap.parse_args()
    ks = [int(x) for x in args.k.split(",")]
    concs = [int(x) for x in args.concurrency.split(",")]
    tput_tokens = [int(x) for x in args.tput_tokens.split(",")]
    kmax = max(ks)
    os.makedirs(args.out, exist_ok=True)
    ev_path = os.path.join(args.out, "events")  # events.worker0.jsonl, events.scheduler.jsonl
    for suffix in (".worker0.jsonl", ".scheduler.jsonl"):
        if os.path.exists(ev_path + suffix):
            os.remove(ev_path + suffix)
    res = {"args": vars(args)}
    t_all = time.time()

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    import kvinject
    import kvinject.vllm as kv

    # no CUDA call in this process before the engine is up (vLLM forks its engine core)
    res["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__,
                       "kvinject": getattr(kvinject, "__version__", None), "gpu": None}
    try:
        import transformers
        res["versions"]["transformers"] = transformers.__version__
    except Exception:  # pragma: no cover
        pass
    log("vllm_bench: vllm %s, torch %s" % (vllm.__version__, torch.__version__))

    extra = dict(store_dtype=args.store_dtype, store_budget_mb=args.store_mb, events_path=ev_path,
                 layerwise=args.layerwise, time_device=not args.no_device_timing)
    engine = dict(model=args.model, dtype="bfloat16", enable_prefix_caching=False, seed=0,
                  gpu_memory_utilization=args.gpu_mem, max_model_len=args.max_model_len,
                  max_num_seqs=max(64, max(concs)), enforce_eager=args.eager,
                  kv_transfer_config=kv.kv_transfer_config(**extra))
    if args.dummy:
        engine["load_format"] = "dummy"
    t0 = time.time()
    llm = LLM(**engine)
    res["engine_start_s"] = time.time() - t0
    try:
        vc = llm.llm_engine.vllm_config
        res["engine"] = {"cudagraph_mode": str(vc.compilation_config.cudagraph_mode),
                         "compilation_mode": str(vc.compilation_config.mode),
                         "block_size": vc.cache_config.block_size,
                         "v2_model_runner": bool(getattr(vc, "use_v2_model_runner", False)),
                         "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens}
    except Exception as e:  # the config's shape differs between versions: report, go on
        res["engine"] = {"error": repr(e)}
    if torch.cuda.is_available():
        res["versions"]["gpu"] = torch.cuda.get_device_name(0)
    log("vllm_bench: engine up in %.0f s: %s" % (res["engine_start_s"], res["engine"]))

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    draw = lambda n: [rng.randrange(100, vocab - 1) for _ in range(n)]  # noqa: E731
    header = draw(args.header_tokens)
    facts = [draw(args.fact_tokens) for _ in range(kmax)]
    questions = [draw(args.question_tokens) for _ in range(max(64, max(concs)) + 8)]
    fact_ids = [HEADER_ID + 1 + i for i in range(kmax)]

    def plain(k, j):
        ids = list(header)
        for f in facts[:k]:
            ids += f
        return {"prompt_token_ids": ids + questions[j]}, SamplingParams(temperature=0.0, max_tokens=1)

    def plain_n(k, j, n_out):
        return plain(k, j)[0], SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)

    def injected(k, j, n_out=1, ignore_eos=False):
        mp = kv.memory_prompt(TENANT, [(HEADER_ID, header)] + list(zip(fact_ids[:k], facts[:k])), questions[j])
        return mp.prompt, mp.sampling_params(temperature=0.0, max_tokens=n_out, ignore_eos=ignore_eos)

    def events():
        out = []
        p = ev_path + ".worker0.jsonl"
        if os.path.exists(p):
            with open(p) as f:
                out = [json.loads(line) for line in f if line.strip()]
        return out

    def gen(reqs):
        t = time.perf_counter()
        outs = llm.generate([r[0] for r in reqs], [r[1] for r in reqs], use_tqdm=False)
        return time.perf_counter() - t, outs

    def check_outputs(outs, what):
        bad = [o for o in outs if o.outputs[0].finish_reason == "error" or not o.outputs[0].token_ids]
        if bad:
            raise SystemExit("vllm_bench: %s: %d requests failed (finish reason %s)"
                             % (what, len(bad), bad[0].outputs[0].finish_reason))

    # ---- capture header + every fact once, from vLLM's own prefill
    cp = kv.capture_prompt(TENANT, [kv.Keep(HEADER_ID, header)] + [kv.Keep(i, f) for i, f in zip(fact_ids, facts)]
                           + [questions[-1]])
    _, outs = gen([(cp.prompt, cp.sampling_params(temperature=0.0, max_tokens=1))])
    check_outputs(outs, "capture")
    cap = [e for e in events() if e["event"] == "capture"]
    if not cap or cap[-1]["stored"] != kmax + 1:
        raise SystemExit("vllm_bench: the capture stored %s facts, expected %d: %s"
                         % (cap[-1]["stored"] if cap else 0, kmax + 1, cap[-1:]))
    reg = [e for e in events() if e["event"] == "register"]
    res["register"] = reg[-1] if reg else None
    log("vllm_bench: captured %d facts (%d tokens) in one request; cache %s" % (
        cap[-1]["stored"], cap[-1]["tokens"], reg[-1] if reg else "?"))

    windows = []  # (label, t0, t1) in time.time(), to assign the connector's events

    def timed(label, reqs):
        a = time.time()
        dt, outs = gen(reqs)
        windows.append((label, a, time.time()))
        check_outputs(outs, label)
        return dt, outs

    # ---- TTFT
    ttft = []
    for k in ks:
        for w in range(args.warmup):
            gen([plain(k, w)])
            gen([injected(k, w)])
        tp, ti, agree = [], [], 0
        for r in range(args.reps):
            j = r % 8
            dt, op = timed("ttft-prefill-%d" % k, [plain(k, j)])
            tp.append(dt)
            dt, oi = timed("ttft-inject-%d" % k, [injected(k, j)])
            ti.append(dt)
            cached = getattr(oi[0], "num_cached_tokens", None)
            agree += int(op[0].outputs[0].token_ids[:1] == oi[0].outputs[0].token_ids[:1])
        row = {"k": k, "prompt_tokens": args.header_tokens + k * args.fact_tokens + args.question_tokens,
               "injected_tokens": args.header_tokens + k * args.fact_tokens, "num_cached_tokens": cached,
               "prefill_ms": med(tp) * 1e3, "inject_ms": med(ti) * 1e3,
               "prefill_ms_all": [x * 1e3 for x in tp], "inject_ms_all": [x * 1e3 for x in ti],
               "first_token_agree": "%d/%d" % (agree, args.reps)}
        row["change"] = row["inject_ms"] / row["prefill_ms"] - 1
        ttft.append(row)
        log("vllm_bench: TTFT k=%d: re-prefill %.2f ms, injected %.2f ms (%+.0f%%), first tokens agree %s, "
            "num_cached_tokens %s" % (k, row["prefill_ms"], row["inject_ms"], row["change"] * 100,
                                      row["first_token_agree"], cached))
    res["ttft"] = ttft

    # ---- throughput at the largest k
    tput = []
    for n_out in tput_tokens:
        for n in concs:
            row = {"k": kmax, "concurrent": n, "output_tokens": n_out}
            for mode in ("prefill", "inject"):
                reqs = [plain_n(kmax, i, n_out) if mode == "prefill" else injected(kmax, i, n_out, True)
                        for i in range(n)]
                gen(reqs)  # warm-up
                ts = [timed("tput-%s-%d-%d" % (mode, n, n_out), reqs)[0] for _ in range(args.tput_reps)]
                row[mode + "_s"] = med(ts)
                row[mode + "_rps"] = n / med(ts)
            row["ratio"] = row["inject_rps"] / row["prefill_rps"]
            tput.append(row)
            log("vllm_bench: throughput k=%d, %d concurrent, %d output tokens: re-prefill %.1f req/s, injected "
                "%.1f req/s (%.2fx)" % (kmax, n, n_out, row["prefill_rps"], row["inject_rps"], row["ratio"]))
    res["throughput"] = tput

    # ---- the connector's share, from its events
    ev = [e for e in events() if e["event"] == "inject"]
    share = {}
    for label, a, b in windows:
        if "inject" not in label:
            continue
        inw = [e for e in ev if a <= e["t"] <= b + 0.05]
        s = share.setdefault(label, {"calls": 0, "wall_s": 0.0, "steps": 0, "host_us": [], "kvi_us": [],
                                     "device_us": [], "step_device_us": [], "requests": []})
        s["calls"] += 1
        s["wall_s"] += b - a
        s["steps"] += len(inw)
        for e in inw:
            for key in ("host_us", "kvi_us", "device_us", "step_device_us", "requests"):
                if key in e:
                    s[key].append(e[key])
    summary = []
    for label, s in share.items():
        summary.append({"run": label, "calls": s["calls"], "inject_steps": s["steps"],
                        "requests_per_step": med(s["requests"]), "host_us": med(s["host_us"]),
                        "kvi_call_us": med(s["kvi_us"]), "device_us": med(s["device_us"]),
                        "step_device_us": med(s["step_device_us"]),
                        "host_share_of_wall": sum(s["host_us"]) * 1e-6 / s["wall_s"] if s["wall_s"] else float("nan"),
                        "device_share_of_step": (sum(s["device_us"]) / sum(s["step_device_us"])
                                                 if s["step_device_us"] else float("nan"))})
    res["connector"] = summary
    sched = []
    p = ev_path + ".scheduler.jsonl"
    if os.path.exists(p):
        with open(p) as f:
            sched = [json.loads(line) for line in f if line.strip()]
    res["scheduler_host_us_median"] = med([e["host_us"] for e in sched if e.get("event") == "schedule"])
    res["total_s"] = time.time() - t_all

    with open(os.path.join(args.out, "vllm_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = report(res)
    with open(os.path.join(args.out, "vllm_bench.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    return 0


def report(res):
    a = res["args"]
    L = ["## vLLM %s: re-prefill vs kvinject connector (%s)" % (res["versions"]["vllm"], res["versions"]["gpu"]), "",
         "engine: %s; start %.0f s; cache %s" % (res.get("engine"), res.get("engine_start_s", 0),
                                                  {k: res["register"][k] for k in ("backend", "block_size", "dtype",
                                                                                   "num_blocks")}
                                                  if res.get("register") else "?"),
         "request: %d-token header, k facts of %d tokens, %d-token question; store %s; median of %d (TTFT), "
         "%d (throughput)" % (a["header_tokens"], a["fact_tokens"], a["question_tokens"], a["store_dtype"], a["reps"],
                              a["tput_reps"]), "",
         "| k | prompt tokens | re-prefill TTFT ms | injected TTFT ms | change | first tokens agree |",
         "|--:|--:|--:|--:|--:|--:|"]
    for r in res["ttft"]:
        L.append("| %d | %d | %.2f | %.2f | %+.0f%% | %s |" % (r["k"], r["prompt_tokens"], r["prefill_ms"],
                                                            r["inject_ms"], r["change"] * 100, r["first_token_agree"]))
    L += ["", "| k | concurrent | output tokens | re-prefill req/s | injected req/s | ratio |", "|--:|--:|--:|--:|--:|--:|"]
    for r in res["throughput"]:
        L.append("| %d | %d | %d | %.1f | %.1f | %.2fx |" % (r["k"], r["concurrent"], r["output_tokens"],
                                                            r["prefill_rps"], r["inject_rps"], r["ratio"]))
    L += ["", "| run | inject steps | req/step | connector host µs | kvi_inject call µs | injection device µs | "
          "step device µs | host share of wall | injection share of step |", "|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for s in res["connector"]:
        L.append("| %s | %d | %g | %.0f | %.0f | %.0f | %.0f | %.1f%% | %.1f%% |" % (
            s["run"], s["inject_steps"], s["requests_per_step"], s["host_us"], s["kvi_call_us"], s["device_us"],
            s["step_device_us"], s["host_share_of_wall"] * 100, s["device_share_of_step"] * 100))
    k50 = [r for r in res["ttft"] if r["k"] == max(x["k"] for x in res["ttft"])][0]
    t64 = [r for r in res["throughput"] if r["output_tokens"] == res["throughput"][0]["output_tokens"]]
    t64 = max(t64, key=lambda r: r["concurrent"])
    L += ["", "targets: TTFT at k = %d %+.0f%% (target <= -85%%): %s; throughput at %d concurrent %.2fx "
          "(target >= 5x): %s; scheduler build_connector_meta median %.0f µs; total %.0f s" % (
              k50["k"], k50["change"] * 100, "met" if k50["change"] <= -0.85 else "NOT met", t64["concurrent"],
              t64["ratio"], "met" if t64["ratio"] >= 5 else "NOT met", res["scheduler_host_us_median"],
              res["total_s"]), ""]
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
