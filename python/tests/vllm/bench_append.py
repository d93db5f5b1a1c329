"""What adding one fact to a user who already has N costs, three ways, on one
real ``vllm serve`` replica (the connector loaded, vLLM's prefix caching on):

- ``gateway``: ``POST /v1/memories`` of one fact through ``python -m
  kvinject.serve`` (the notes encoding: the replica injects the header and the
  N earlier facts from its store and prefills only the new fact);
- ``prefix cache``: plain vLLM, ``/v1/completions`` of the notes encoding's
  prompt [header | fact 1 .. fact N+1] as token ids (what a notes encoding
  without the store prefills), where vLLM's own prefix cache holds the
  previous add's prompt;
- ``no reuse``: the same prompt with a fresh ``cache_salt``, so that nothing
  is reused: a full prefill.

For each add it reads the replica's Prometheus counters before and after
(vllm:prompt_tokens, vllm:prefix_cache_hits, kvinject:tokens_injected) and
reports the prompt's tokens, the tokens taken from the store, from vLLM's
prefix cache and prefilled (the rest), and the wall time of the request.

    python3 launch.py bench_append.py [--facts 40] [--out DIR]

Writes DIR/append.md (a table per N and the totals) and DIR/append.json, and
DIR/append.png (prefilled tokens per add against N) when matplotlib is there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import uuid

METRICS = {"prompt": "vllm:prompt_tokens_total", "hits": "vllm:prefix_cache_hits_total",
           "queries": "vllm:prefix_cache_queries_total", "injected": "kvinject:tokens_injected_total",
           "vllm_ms": "vllm:e2e_request_latency_seconds_sum", "inject_ms": "kvinject:inject_seconds_sum"}
GATEWAY_METRICS = {"embed_ms": "kvinject_gateway_embedding_seconds_sum"}


def scrape(url: str, metrics=METRICS) -> dict:
    import httpx
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for key, name in metrics.items():
        total = 0.0
        for m in re.finditer(r"^%s(\{[^}]*\})? ([0-9.eE+-]+)$" % re.escape(name), text, re.M):
            total += float(m.group(2))
        out[key] = total
    return out


def delta(a: dict, b: dict) -> dict:
    return {k: (round(1e3 * (b[k] - a[k]), 2) if k.endswith("_ms") else int(round(b[k] - a[k]))) for k in a}


def facts(n: int):
    import gateway_common as G
    # 20 topics x users' values, repeated with an index past 20: distinct texts
    names = sorted(G.VALUES)
    out = []
    for i in range(n):
        name = names[(i // 20) % len(names)]
        out.append("My %s is %s (note %d)." % (G.TOPICS[i % 20], G.VALUES[name][i % 20], i + 1))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--facts", type=int, default=40, help="facts added one at a time (N = 0 .. facts-1)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plot", metavar="DIR", help="only write DIR/append.md and append.png from DIR/append.json")
    args = ap.parse_args(argv)
    if args.plot:
        with open(os.path.join(args.plot, "append.json")) as f:
            report(json.load(f), args.plot)
        return 0
    os.makedirs(args.out, exist_ok=True)
    import httpx
    import gateway_common as G
    G.require_embedder = lambda: None
    texts = facts(args.facts)
    work = tempfile.mkdtemp(prefix="kvi-append-")
    rep = G.start_replica(work, "r0")
    gw = None
    rows = []
    try:
        gw = G.Gateway([rep.url],
                       os.path.join(work, "gw.db"), os.path.join(work, "gw.log"))
        gw.wait()
        url = rep.url
        lay = G.layout()
        tail, _ = lay.tail([{"role": "user", "content": "x"}])
        body_common = {"model": rep.model, "max_tokens": 2, "min_tokens": 2, "temperature": 0.0}
        for n, text in enumerate(texts):
            row = {"n": n}
            # gateway: one add of one fact
            m0, g0 = scrape(url), scrape(gw.url, GATEWAY_METRICS)
            t0 = time.perf_counter()
            gw.ok("POST", "/v1/memories", {"user": "append-bench", "facts": [text]})
            row["gateway_s"] = time.perf_counter() - t0
            row["gateway"] = dict(delta(m0, scrape(url)), **delta(g0, scrape(gw.url, GATEWAY_METRICS)))
            ids = lay.prompt([lay.fact_tokens(t) for t in texts[:n + 1]], [])
            for mode, salt in (("prefix", None), ("fresh", uuid.uuid4().hex)):
                body = dict(body_common, prompt=ids)
                if salt:
                    body["cache_salt"] = salt
                m0 = scrape(url)
                t0 = time.perf_counter()
                r = httpx.post(url + "/v1/completions", json=body, timeout=300)
                r.raise_for_status()
                row[mode + "_s"] = time.perf_counter() - t0
                row[mode] = delta(m0, scrape(url))
            row["fact_tokens"] = len(lay.fact_tokens(text))
            row["prompt_tokens"] = len(ids)
            rows.append(row)
            print("N=%d %s" % (n, json.dumps(row)), flush=True)
    finally:
        if gw is not None:
            gw.stop()
        rep.stop()

    with open(os.path.join(args.out, "append.json"), "w") as f:
        json.dump(rows, f, indent=1)
    report(rows, args.out)
    return 0


def prefilled(d):
    return d["prompt"] - d["hits"] - d["injected"]


def report(rows, out):
    """append.md from the rows, and append.png where matplotlib is."""
    med = lambda xs: sorted(xs)[len(xs) // 2]
    lines = ["| N earlier facts | new fact tokens | notes prompt tokens | gateway: from store / prefix cache / "
             "prefilled | plain vLLM, prefix cache: reused / prefilled | plain vLLM, no reuse: prefilled | "
             "gateway ms (embedding / vLLM request / injection) | prefix-cache ms | no-reuse ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        g, p, f = r["gateway"], r["prefix"], r["fresh"]
        lines.append("| %d | %d | %d | %d / %d / %d | %d / %d | %d | %.0f (%.0f / %.0f / %.1f) | %.0f | %.0f |" % (
            r["n"], r["fact_tokens"], r["prompt_tokens"], g["injected"], g["hits"], prefilled(g),
            p["hits"], prefilled(p), prefilled(f), 1e3 * r["gateway_s"], g.get("embed_ms", 0), g["vllm_ms"],
            g["inject_ms"], 1e3 * r["prefix_s"], 1e3 * r["fresh_s"]))
    tot = {m: sum(prefilled(r[m]) for r in rows) for m in ("gateway", "prefix", "fresh")}
    facts_tok = sum(r["fact_tokens"] for r in rows)
    lines.append("")
    lines.append("Prefilled tokens over all %d adds (%d fact tokens): gateway %d, plain vLLM with its prefix "
                 "cache %d, without reuse %d. Median wall time of an add: gateway %.0f ms (its vLLM request "
                 "%.0f ms), plain vLLM with its prefix cache %.0f ms, without reuse %.0f ms." % (
                     len(rows), facts_tok, tot["gateway"], tot["prefix"], tot["fresh"],
                     1e3 * med([r["gateway_s"] for r in rows]), med([r["gateway"]["vllm_ms"] for r in rows]),
                     1e3 * med([r["prefix_s"] for r in rows]), 1e3 * med([r["fresh_s"] for r in rows])))
    md = "\n".join(lines) + "\n"
    with open(os.path.join(out, "append.md"), "w") as f:
        f.write(md)
    print(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib here: no plot (python3 bench_append.py --plot %s with one that has it)" % out)
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ns = [r["n"] for r in rows]
    for m, label in (("fresh", "plain vLLM, no reuse"), ("prefix", "plain vLLM, prefix cache"),
                     ("gateway", "gateway (earlier facts injected)")):
        ax.plot(ns, [prefilled(r[m]) for r in rows], marker=".", label=label)
    ax.set_xlabel("facts the user already has (N)")
    ax.set_ylabel("tokens prefilled to add one fact")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "append.png"), dpi=120)


if __name__ == "__main__":
    sys.exit(main())
