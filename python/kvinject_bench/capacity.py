#!/usr/bin/env python3
"""The capacity model: how many users' facts a node keeps on each tier, what
keeping them saves against re-prefilling their text, and what a request pays
when most users live below the GPU (docs/capacity.md explains every formula).

Everything is computed from INPUTS: measured figures (each names the
BENCHMARKS.md section it comes from) and assumptions (the node, prices, the
workload), both overridable with a JSON file of the same shape:

    python3 -m kvinject_bench.capacity --markdown            # the tables of docs/capacity.md
    python3 -m kvinject_bench.capacity --inputs mine.json --markdown
    python3 -m kvinject_bench.capacity --json                # every computed figure
    python3 -m kvinject_bench.capacity --plot users.png      # needs matplotlib

A file overrides single keys: {"node": {"disk_read_gbps": 12.5}} changes the
disk rate only; its values are reported as "inputs file". Standard library
only (matplotlib for --plot, imported then).
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys

GB = 1e9
B_S = "BENCHMARKS.md, "

# Every input, with where its default comes from (SOURCES, same keys).
INPUTS = {
    "models": {
        # Llama-3.1-8B and -70B geometry; params in billions; tp: GPUs one replica spans.
        "llama-8b": {"layers": 32, "kv_heads": 8, "head_size": 128, "params_b": 8.03, "tp": 1},
        "llama-70b": {"layers": 80, "kv_heads": 8, "head_size": 128, "params_b": 70.6, "tp": 8},
    },
    # store layouts compared: dtype (bf16, fp8 or q4) and page_tokens
    "layouts": [["bf16", 16], ["fp8", 16], ["q4", 16], ["q4", 32], ["q4", 64]],
    "workload": {
        "facts_per_user": 200,
        "tokens_per_fact": 20,
        "k": 50,                   # facts injected per request
        "requests_per_visit": 4, # a visit loads the user once, then R - 1 requests find the user up
        "zipf_s": [0.8, 1.0, 1.2],
        "spill_factor": 10,        # users at 10x what the GPU tier holds
    },
    "node": {
        "gpus": 8,
        "gpu_mem_gb": 141,             # H200
        "gpu_gb_for_facts": 40,        # per GPU, after weights, the engine's own KV and activations
        "host_gb_for_facts": 1536,     # of 2 TB of host RAM, pinned for the host tier
        "disk_tb_for_facts": 27,       # of 30 TB of NVMe
        "disk_read_gbps": 25.0,        # the node's NVMe sequential read (4 drives striped)
        "disk_latency_ms": 0.1,        # per request: first byte from the drives
    },
    "measured": {
        # vLLM 0.23, Llama-3.1-8B shape, re-prefill of k = 50 facts, 64 concurrent:
        # 33.5 req/s x 1264 prompt tokens on one H200
        "prefill_tokens_per_gpu_s_8b": 33.5 * 1264,
        # device injection, 1 request x 50 facts of 24 tokens (1,200 tokens, 150 MiB of bf16
        # K and V), queued device time on one H100: bf16 store 0.119 ms, 4-bit store (the
        # vectorized kernels) 0.125 ms; rate in bf16 bytes of the injected tokens per second
        "inject_gbps_bf16": 150 * 2**20 / 0.119e-3 / GB,
        "inject_gbps_q4": 150 * 2**20 / 0.125e-3 / GB,
        # fp8 store with per-channel key offsets, 8-element vectors, the same case on one
        # H100 (8841400): 0.136 ms
        "inject_gbps_fp8": 150 * 2**20 / 0.136e-3 / GB,
        # the pinned-host tier, 50 facts promoted and injected per call (16-token pages, H200)
        "host_gbps": 47.1,
    },
    "assumed": {
        # prefill rate of models without a measurement: the 8B rate x 8.03 / params_b
        # (prefill FLOPs grow with the parameters), per GPU, TP scaling perfectly
        "gpu_hour_usd": 3.50,       # one H200, rented
        "host_gb_hour_usd": 0.0002, # server DRAM bought and powered over 3 years
        "disk_gb_hour_usd": 0.000005,  # datacentre NVMe over 3 years
    },
    # Tier hit rates per Zipf s from tests/bench/bench_capacity (fractions of facts found on
    # the device / host / disk-only), e.g. {"1.0": {"device": 0.9, "host": 0.05, "disk": 0.05}};
    # empty: the model's own popularity-ordered placement is used.
    "trace": {},
}

SOURCES = {
    "models": "assumption (published geometry: Llama-3.1-8B and -70B)",
    "layouts": "assumption (the layouts compared)",
    "workload": "assumption (the workload of issue 31)",
    "node": "assumption (an 8x H200 node: 141 GB a GPU, 2 TB RAM, 30 TB NVMe)",
    "measured.prefill_tokens_per_gpu_s_8b": "measured: " + B_S + "\"vLLM 0.23 on the H200 with the connector\" "
    "(re-prefill, k = 50, 64 concurrent: 33.5 req/s x 1264 tokens)",
    "measured.inject_gbps_bf16": "measured: " + B_S + "\"4-bit storage\" (bf16 store, inject 1 x 50, 0.119 ms, H100)",
    "measured.inject_gbps_q4": "measured: " + B_S + "\"4-bit storage\" (4-bit store, vectorized kernels, inject "
    "1 x 50, 0.125 ms, H100)",
    "measured.inject_gbps_fp8": "measured: " + B_S + "\"fp8 pages on 8-element vectors\" (fp8 store "
    "with key offsets, inject 1 x 50, 0.136 ms, H100)",
    "measured.host_gbps": "measured: " + B_S + "\"Injecting facts from the pinned-host tier\" (promote, 16-token pages)",
    "assumed": "assumption",
    "trace": "measured: tests/bench/bench_capacity (when given)",
}

DTYPES = ("bf16", "fp8", "q4")
TIERS = ("device", "host", "disk")


# ------------------------------------------------------------------ inputs

def merge(base, over):
    """base with over's keys replacing (dicts merged key by key; lists and values replaced)."""
    out = copy.deepcopy(base)
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(out.get(key), dict) and key != "trace":
            out[key] = merge(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


def load_inputs(path=None):
    """INPUTS, with a JSON file's keys over them; returns (inputs, the file's top-level keys)."""
    if not path:
        return copy.deepcopy(INPUTS), {}
    with open(path, encoding="utf-8") as f:
        over = json.load(f)
    return merge(INPUTS, over), over


# ------------------------------------------------------------------ bytes

def align16(n):
    return (n + 15) // 16 * 16


def page_bytes(m, dtype, P):
    """A store page's bytes (lib/store/store.c, kvi_store_stats.page_bytes): elements, then
    scales (fp8: then the fp16 key offsets, one per key channel of each layer and head, as
    lib/base/fp8.h's kvi__fp8_page_meta), each part 16-byte aligned."""
    L, H, D = m["layers"], m["kv_heads"], m["head_size"]
    elems = L * 2 * H * P * D
    if dtype == "bf16":
        return elems * 2
    if dtype == "fp8":
        return align16(elems) + align16(L * 2 * H * 4) + align16(L * H * D * 2)
    if dtype == "q4":
        return align16((elems + 1) // 2) + align16(L * H * (D + P) * 4)
    raise ValueError("dtype %r: bf16, fp8 or q4" % dtype)


def bf16_token_bytes(m):
    return m["layers"] * m["kv_heads"] * m["head_size"] * 2 * 2


def fact_bytes(m, dtype, P, T):
    """(memory, disk) bytes of a T-token fact: memory rounds up to whole pages; a file keeps
    the T tokens' elements and the scales of the pages they span (docs/store-format.md; fp8:
    each page's scales and key offsets back to back, unpadded, as lib/base/fp8.h's
    kvi__fp8_meta_bytes)."""
    pages = -(-T // P)
    mem = pages * page_bytes(m, dtype, P)
    per_elem = {"bf16": 2.0, "fp8": 1.0, "q4": 0.5}[dtype]
    elems = T * bf16_token_bytes(m) / 2 * per_elem
    scales = {"bf16": 0,
              "fp8": m["layers"] * 2 * m["kv_heads"] * 4 + m["layers"] * m["kv_heads"] * m["head_size"] * 2,
              "q4": m["layers"] * m["kv_heads"] * (m["head_size"] + P) * 4}[dtype]
    return mem, int(elems) + pages * scales


def user_bytes(inp, m, dtype, P):
    w = inp["workload"]
    mem, disk = fact_bytes(m, dtype, P, w["tokens_per_fact"])
    return w["facts_per_user"] * mem, w["facts_per_user"] * disk


def tier_bytes(inp):
    """Bytes a node gives facts on each tier."""
    n = inp["node"]
    return {"device": n["gpus"] * n["gpu_gb_for_facts"] * GB, "host": n["host_gb_for_facts"] * GB,
            "disk": n["disk_tb_for_facts"] * 1e12}


def users_per_node(inp, m, dtype, P):
    """Users each tier holds alone (whole users: all their facts)."""
    mem, disk = user_bytes(inp, m, dtype, P)
    cap = tier_bytes(inp)
    return {"device": int(cap["device"] // mem), "host": int(cap["host"] // mem), "disk": int(cap["disk"] // disk)}


# ------------------------------------------------------------------ time

def prefill_rate(inp, m):
    """Prefill tokens per GPU-second (measured for 8B; scaled by parameters otherwise)."""
    r8 = inp["measured"]["prefill_tokens_per_gpu_s_8b"]
    return r8 * 8.03 / m["params_b"]


def inject_gbps(inp, dtype):
    meas = inp["measured"]
    if dtype == "q4":
        return meas["inject_gbps_q4"]
    if dtype == "fp8":
        return meas["inject_gbps_fp8"]
    return meas["inject_gbps_bf16"]


def request_cost(inp, m, dtype, P):
    """Per request of k facts: tokens, bytes read from each tier, the load time from each
    tier, the re-prefill time and GPU-seconds, and the hybrid split's time (seconds)."""
    w, node = inp["workload"], inp["node"]
    k, T = w["k"], w["tokens_per_fact"]
    tokens = k * T
    mem, disk = fact_bytes(m, dtype, P, T)
    t_inject = tokens * bf16_token_bytes(m) / (inject_gbps(inp, dtype) * GB) / m["tp"]
    t_host = k * mem / (inp["measured"]["host_gbps"] * GB * m["tp"]) + t_inject
    t_disk = node["disk_latency_ms"] * 1e-3 + k * disk / (node["disk_read_gbps"] * GB) + t_host
    rate = prefill_rate(inp, m)
    t_prefill = tokens / (rate * m["tp"])
    # hybrid: load a fraction f of the facts from disk while the GPU prefills the rest's
    # text; both end together at f = t_prefill / (t_disk + t_prefill)
    f = t_prefill / (t_disk + t_prefill)
    t_hybrid = t_disk * t_prefill / (t_disk + t_prefill)
    return {
        "tokens": tokens, "bytes_mem": k * mem, "bytes_disk": k * disk,
        "t_device": t_inject, "t_host": t_host, "t_disk": t_disk,
        "t_prefill": t_prefill, "t_hybrid": t_hybrid, "hybrid_disk_fraction": f,
        "gpu_s_prefill": tokens / rate, "gpu_s_inject": t_inject * m["tp"],
        "disk_tokens_per_s": tokens / t_disk, "prefill_tokens_per_s": rate * m["tp"],
    }


def break_even(inp, m, dtype, P):
    """Requests per user-hour above which keeping a user's facts on a tier costs less than
    the GPU time re-prefilling them would: storage USD per user-hour / USD saved per request."""
    a, node = inp["assumed"], inp["node"]
    rc = request_cost(inp, m, dtype, P)
    usd_per_gpu_s = a["gpu_hour_usd"] / 3600.0
    saved = (rc["gpu_s_prefill"] - rc["gpu_s_inject"]) * usd_per_gpu_s
    mem, disk = user_bytes(inp, m, dtype, P)
    gb_hour = {"device": a["gpu_hour_usd"] / node["gpu_mem_gb"], "host": a["host_gb_hour_usd"],
               "disk": a["disk_gb_hour_usd"]}
    store_usd = {"device": mem / GB * gb_hour["device"], "host": mem / GB * gb_hour["host"],
                 "disk": disk / GB * gb_hour["disk"]}
    return {"usd_saved_per_request": saved, "usd_per_user_hour": store_usd,
            "requests_per_hour": {t: (store_usd[t] / saved if saved > 0 else math.inf) for t in TIERS}}


# ------------------------------------------------------------------ popularity

def harmonic(n, s, exact_upto=20000):
    """sum_{i=1..n} i^-s: exact up to exact_upto, Euler-Maclaurin beyond."""
    n = int(n)
    m = min(n, exact_upto)
    h = math.fsum(i ** -s for i in range(1, m + 1))
    if n > m:
        integral = math.log(n / m) if s == 1 else (n ** (1 - s) - m ** (1 - s)) / (1 - s)
        h += integral + (n ** -s - m ** -s) / 2 - s / 12 * (n ** (-s - 1) - m ** (-s - 1))
    return h


def zipf_top(n, N, s):
    """Share of a Zipf(s) population of N users' picks that go to the n most popular."""
    n = max(0, min(int(n), int(N)))
    return harmonic(n, s) / harmonic(N, s) if n else 0.0


def placement_hits(N, n_dev, n_host, s, R):
    """Per-request tier shares when the n_dev most popular users sit on the device, the next
    n_host on the host, the rest on disk, and a visit of R requests loads its user once
    (the first request pays the tier, the next R - 1 find it on the device)."""
    dev = zipf_top(n_dev, N, s)
    host = zipf_top(n_dev + n_host, N, s) - dev
    disk = 1.0 - dev - host
    first = 1.0 / R
    return {"device": 1.0 - first + first * dev, "host": first * host, "disk": first * disk}


def spill(inp, m, dtype, P, s):
    """spill_factor x the users the GPU tier holds: tier shares (the trace's for s where
    given, else placement_hits), expected load time per request, and the same with disk
    requests served by the hybrid split or by re-prefill when that is faster."""
    w = inp["workload"]
    up = users_per_node(inp, m, dtype, P)
    N = max(1, up["device"]) * w["spill_factor"]
    n_host = min(up["host"], N - up["device"])
    trace = inp.get("trace", {}).get("%.1f" % s) or inp.get("trace", {}).get(str(s))
    hits = trace or placement_hits(N, up["device"], n_host, s, w["requests_per_visit"])
    rc = request_cost(inp, m, dtype, P)
    load = sum(hits[t] * rc["t_" + t] for t in TIERS)
    best_disk = min(rc["t_disk"], rc["t_prefill"], rc["t_hybrid"])
    load_hybrid = hits["device"] * rc["t_device"] + hits["host"] * rc["t_host"] + hits["disk"] * best_disk
    prefill_all = rc["t_prefill"]
    return {"users": N, "hits": hits, "from_trace": bool(trace), "t_load": load, "t_load_hybrid": load_hybrid,
            "t_prefill": prefill_all,
            "disk_bound_requests_per_s": (inp["node"]["disk_read_gbps"] * GB / rc["bytes_disk"]) / max(hits["disk"], 1e-12)}


# ------------------------------------------------------------------ output

def fmt_bytes(n):
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return "%.2f %s" % (n / div, unit)
    return "%d B" % n


def fmt_ms(t):
    return "%.3f" % (t * 1e3) if t < 0.01 else "%.2f" % (t * 1e3)


def fmt_rate(x):
    if x == math.inf:
        return "never"
    if x >= 100:
        return "{:,.0f}".format(x)
    return "%.3g" % x


def source_of(key, over):
    top, _, sub = key.partition(".")
    if top in over and (not sub or not isinstance(over[top], dict) or sub in over[top]):
        return "inputs file"
    return SOURCES.get(key) or SOURCES.get(top, "assumption")


def inputs_table(inp, over):
    rows = ["| input | value | source |", "| --- | --- | --- |"]
    for sec in ("node", "workload"):
        for key, val in inp[sec].items():
            rows.append("| %s.%s | %s | %s |" % (sec, key, val, source_of(sec, over)))
    for sec in ("measured", "assumed"):
        for key, val in inp[sec].items():
            shown = "%.4g" % val if isinstance(val, float) else ("as bf16" if val is None else val)
            rows.append("| %s.%s | %s | %s |" % (sec, key, shown, source_of(sec + "." + key, over)))
    rows.append("| trace | %s | %s |" % ("given for s = " + ", ".join(sorted(inp["trace"])) if inp["trace"]
                                         else "none: popularity-ordered placement",
                                         source_of("trace", over)))
    return "\n".join(rows)


def markdown(inp, over=None):
    over = over or {}
    out = []
    out.append("Inputs (`python -m kvinject_bench.capacity --inputs FILE` overrides any):\n")
    out.append(inputs_table(inp, over))
    out.append("\n### Bytes per token and per user\n")
    out.append("| model | dtype | page tokens | bytes/token (pages) | of bf16 | fact in memory | fact on disk "
               "| user in memory | user on disk |")
    out.append("| --- | --- | --: | --: | --: | --: | --: | --: | --: |")
    w = inp["workload"]
    for name, m in inp["models"].items():
        for dtype, P in inp["layouts"]:
            pb = page_bytes(m, dtype, P)
            fm, fd = fact_bytes(m, dtype, P, w["tokens_per_fact"])
            um, ud = user_bytes(inp, m, dtype, P)
            out.append("| %s | %s | %d | %s | %.3f | %s | %s | %s | %s |" % (
                name, dtype, P, "{:,.0f}".format(pb / P), pb / P / bf16_token_bytes(m), fmt_bytes(fm), fmt_bytes(fd),
                fmt_bytes(um), fmt_bytes(ud)))
    cap = tier_bytes(inp)
    out.append("\n### Users per node\n")
    out.append("Each tier alone, whole users of %d facts x %d tokens; the node gives facts %s of GPU memory, "
               "%s of host memory and %s of disk.\n" % (w["facts_per_user"], w["tokens_per_fact"],
                                                       fmt_bytes(cap["device"]), fmt_bytes(cap["host"]),
                                                       fmt_bytes(cap["disk"])))
    out.append("| model | dtype | page tokens | device | host | disk |")
    out.append("| --- | --- | --: | --: | --: | --: |")
    for name, m in inp["models"].items():
        for dtype, P in inp["layouts"]:
            up = users_per_node(inp, m, dtype, P)
            out.append("| %s | %s | %d | %s | %s | %s |" % (name, dtype, P, *("{:,}".format(up[t]) for t in TIERS)))
    out.append("\n### One request: load against re-prefill, and the break-even\n")
    out.append("k = %d facts (%d tokens). Load ms per tier; prefill ms on the replica's GPUs; hybrid: disk read "
               "and prefill of the rest at once. Break-even: requests per user-hour above which keeping the "
               "user on that tier costs less than the GPU time re-prefilling would.\n" % (w["k"], w["k"] * w["tokens_per_fact"]))
    out.append("| model | dtype | P | device ms | host ms | disk ms | prefill ms | hybrid ms | disk tok/s | "
               "prefill tok/s | GPU-s saved | break-even/h device | host | disk |")
    out.append("| --- | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for name, m in inp["models"].items():
        for dtype, P in inp["layouts"]:
            rc = request_cost(inp, m, dtype, P)
            be = break_even(inp, m, dtype, P)["requests_per_hour"]
            out.append("| %s | %s | %d | %s | %s | %s | %s | %s | %s | %s | %.4f | %s | %s | %s |" % (
                name, dtype, P, fmt_ms(rc["t_device"]), fmt_ms(rc["t_host"]), fmt_ms(rc["t_disk"]),
                fmt_ms(rc["t_prefill"]), fmt_ms(rc["t_hybrid"]), "{:,.0f}".format(rc["disk_tokens_per_s"]),
                "{:,.0f}".format(rc["prefill_tokens_per_s"]), rc["gpu_s_prefill"] - rc["gpu_s_inject"],
                fmt_rate(be["device"]), fmt_rate(be["host"]), fmt_rate(be["disk"])))
    out.append("\n### %dx the users the GPU tier holds\n" % w["spill_factor"])
    out.append("Tier shares per request (%s), expected load ms per request, the same with disk requests served "
               "the fastest way (load, hybrid or re-prefill), re-prefilling every request, and the requests/s "
               "the disk sustains.\n" % ("the trace run's where given, else popularity-ordered placement with "
                                         "visits of %d requests" % w["requests_per_visit"]))
    out.append("| model | dtype | P | s | users | device | host | disk | load ms | best ms | prefill ms | disk-bound req/s |")
    out.append("| --- | --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |")
    for name, m in inp["models"].items():
        for dtype, P in inp["layouts"]:
            for s in w["zipf_s"]:
                sp = spill(inp, m, dtype, P, s)
                h = sp["hits"]
                out.append("| %s | %s | %d | %.1f%s | %s | %.1f%% | %.1f%% | %.1f%% | %s | %s | %s | %s |" % (
                    name, dtype, P, s, " (trace)" if sp["from_trace"] else "", "{:,}".format(sp["users"]),
                    100 * h["device"], 100 * h["host"], 100 * h["disk"], fmt_ms(sp["t_load"]),
                    fmt_ms(sp["t_load_hybrid"]), fmt_ms(sp["t_prefill"]), "{:,.0f}".format(sp["disk_bound_requests_per_s"])))
    return "\n".join(out) + "\n"


def everything(inp):
    out = {"tier_bytes": tier_bytes(inp), "models": {}}
    for name, m in inp["models"].items():
        rows = out["models"][name] = []
        for dtype, P in inp["layouts"]:
            rows.append({"dtype": dtype, "page_tokens": P, "page_bytes": page_bytes(m, dtype, P),
                         "fact_bytes": fact_bytes(m, dtype, P, inp["workload"]["tokens_per_fact"]),
                         "user_bytes": user_bytes(inp, m, dtype, P), "users_per_node": users_per_node(inp, m, dtype, P),
                         "request": request_cost(inp, m, dtype, P), "break_even": break_even(inp, m, dtype, P),
                         "spill": {str(s): spill(inp, m, dtype, P, s) for s in inp["workload"]["zipf_s"]}})
    return out


def plot(inp, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(1, len(inp["models"]), figsize=(6 * len(inp["models"]), 4), squeeze=False)
    for ax, (name, m) in zip(axes[0], inp["models"].items()):
        labels = ["%s/%d" % (d, P) for d, P in inp["layouts"]]
        for i, tier in enumerate(TIERS):
            vals = [users_per_node(inp, m, d, P)[tier] for d, P in inp["layouts"]]
            ax.bar([x + 0.27 * (i - 1) for x in range(len(labels))], vals, 0.27, label=tier)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels)
        ax.set_yscale("log")
        ax.set_title("%s: users per node" % name)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inputs", help="JSON file of inputs over the defaults")
    ap.add_argument("--markdown", action="store_true", help="print docs/capacity.md's tables")
    ap.add_argument("--json", action="store_true", help="print every computed figure as JSON")
    ap.add_argument("--plot", metavar="PNG", help="bar chart of users per node (matplotlib)")
    args = ap.parse_args(argv)
    inp, over = load_inputs(args.inputs)
    if args.json:
        json.dump(everything(inp), sys.stdout, indent=1, default=str)
        print()
    if args.plot:
        return plot(inp, args.plot)
    if args.markdown or not args.json:
        sys.stdout.write(markdown(inp, over))
    return 0


if __name__ == "__main__":
    sys.exit(main())
