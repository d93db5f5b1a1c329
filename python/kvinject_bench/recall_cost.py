#!/usr/bin/env python3
"""The cost of encoding facts, on the recall benchmark's users (recall.py).

1. Per stored fact, for each encoding (recall.py's window names: 0 alone,
   32 after 32 tokens of its conversation, n4 after the header and the four
   facts said before it, nall after the header and all of them, one prefill
   per user): the tokens prefilled (each capture prompt whole, as a serving
   engine without a prefix cache would prefill it; the header counted in
   every anchored prompt), and the wall time of encoding every user's facts
   into an fp32 store (the harness's batched prefills; anchored encodings
   prefill the header once per batch).
2. Adding one fact to a user who has N (the notes encoding appends: the new
   fact after the header and the N facts before it): prefilling the whole
   capture prompt against prefilling only the new fact's tokens after a
   cached prefix of [header | N facts] (a transformers DynamicCache kept from
   the user's earlier prefill, cropped back after each add); the new fact's
   KV must be the same both ways (max |difference| reported). Median wall
   time over --users users per N.

    python3 -m kvinject_bench.recall_cost --model DIR [--device cuda] [--users 10] [--ns 5,10,20,40]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from kvinject_bench import common
from kvinject_bench import recall
from kvinject_bench import recall_data


def run(args):
    torch, transformers = common.need_torch_transformers()
    kvi = common.need_kvinject()
    device = common.pick_device(args.device, torch, kvi)
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(False)
    args.batch_tokens = args.batch_tokens or (16384 if device.startswith("cuda") else 2048)
    model, tok = recall.load_model(args.model, getattr(torch, args.dtype), device, args.attn, torch)
    users = recall_data.generate(args.seed, args.users)
    corpus = recall.Corpus(tok, users)
    bench = recall.Bench(args, torch, kvi, model, tok, corpus, device)
    bench.search_store = False  # no embeddings computed into w0's store: encoding alone is timed
    sync = lambda: common.sync(device)  # noqa: E731
    n_facts = len(corpus.fact_ids)
    fact_tokens = sum(len(v) for v in corpus.fact_ids.values())
    rows = []
    for spec in args.encodings.split(","):
        w, anchor = recall.parse_window(spec)
        units = bench.window_units(w, anchor)
        sync()
        t0 = time.time()
        bench.window_stores(w, anchor)
        sync()
        dt = time.time() - t0
        pre = sum(len(u[0]) for u in units)
        hdr = len(corpus.header) * len(units) if anchor else 0
        rows.append(dict(encoding=recall.window_name(w, anchor), prompts=len(units), prefilled=pre,
                         beyond_header=(pre - hdr) / fact_tokens,
                         per_fact=pre / n_facts, per_fact_token=pre / fact_tokens, seconds=dt,
                         ms_per_fact=1000 * dt / n_facts))
        recall.log("encoded %s: %d prompts, %d tokens, %.1fs" % (spec, len(units), pre, dt))
    from transformers import DynamicCache
    app = []
    for n in [int(x) for x in args.ns.split(",")]:
        full_t, cached_t, full_tok, cached_tok, diffs = [], [], [], [], []
        for u in users:
            if n >= len(u.facts):
                continue
            ctx = list(corpus.header)
            for i in range(n):
                ctx += corpus.fact_ids[(u.uid, i)]
            new = corpus.fact_ids[(u.uid, n)]
            for rep in range(args.repeats + 1):  # the first of each is a warm-up
                sync()
                t0 = time.time()
                a = bench.forward(ctx + new, use_cache=True, logits_to_keep=1).past_key_values
                sync()
                t_full = time.time() - t0
                prefix = bench.forward(ctx, use_cache=True, logits_to_keep=1).past_key_values
                sync()
                t0 = time.time()
                b = bench.forward(new, past_key_values=prefix, use_cache=True, logits_to_keep=1).past_key_values
                sync()
                t_cached = time.time() - t0
                if rep:
                    full_t.append(t_full)
                    cached_t.append(t_cached)
            ka, va = common.cache_tensors(a)
            kb, vb = common.cache_tensors(b)
            s = len(ctx)
            diffs.append(max(max(float((x[:, :, s:] - y[:, :, s:]).abs().max()) for x, y in zip(ka, kb)),
                             max(float((x[:, :, s:] - y[:, :, s:]).abs().max()) for x, y in zip(va, vb))))
            full_tok.append(len(ctx) + len(new))
            cached_tok.append(len(new))
        if full_t:
            app.append(dict(n=n, users=len(diffs), full_tokens=statistics.mean(full_tok),
                            cached_tokens=statistics.mean(cached_tok), full_ms=1000 * statistics.median(full_t),
                            cached_ms=1000 * statistics.median(cached_t), max_diff=max(diffs)))
            recall.log("append after %d facts: %s" % (n, app[-1]))
    dev = torch.cuda.get_device_name() if device.startswith("cuda") else "CPU (%d threads)" % torch.get_num_threads()
    md = ["## Encoding cost on %s%s" % (os.path.basename(args.model.rstrip("/")),
                                        " (%s)" % args.label if args.label else ""), "",
          "- device: %s; torch %s, transformers %s; libkvinject %s; model %s, %s attention" % (
              dev, torch.__version__, transformers.__version__, kvi.version(), args.dtype,
              model.config._attn_implementation),
          "- %d users (seed %d), %d facts, %d fact tokens (%.1f per fact); the header: %d tokens" % (
              args.users, args.seed, n_facts, fact_tokens, fact_tokens / n_facts, len(corpus.header)), "",
          "### Per stored fact\n",
          common.table(["encoding", "capture prompts", "tokens prefilled", "per fact", "per fact token",
                        "per fact token, header cached", "wall time (s)", "ms per fact"],
                       [[r["encoding"], r["prompts"], r["prefilled"], "%.1f" % r["per_fact"],
                         "%.2f" % r["per_fact_token"], "%.2f" % r["beyond_header"], "%.2f" % r["seconds"],
                         "%.2f" % r["ms_per_fact"]]
                        for r in rows]),
          "\n### Adding one fact to a user with N (notes encoding)\n",
          common.table(["N", "users", "tokens prefilled, whole prompt", "tokens prefilled, cached prefix",
                        "ms, whole prompt (median)", "ms, cached prefix (median)",
                        "max |Δ| of the new fact's KV"],
                       [[a["n"], a["users"], "%.1f" % a["full_tokens"], "%.1f" % a["cached_tokens"],
                         "%.1f" % a["full_ms"], "%.1f" % a["cached_ms"], "%.1e" % a["max_diff"]] for a in app])]
    out = "\n".join(md) + "\n"
    print(out, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), encodings=rows, append=app, device=dev), f)
    if args.md:
        with open(args.md, "w") as f:
            f.write(out)
    bench.close()
    return True


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVI_VLLM_MODEL"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--encodings", default="0,32,n4,nall")
    ap.add_argument("--ns", default="5,10,20,40")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--embed-layer", type=int, default=0)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    ap.add_argument("--label", default="")
    # accepted for tests/gpu/run_recall.sh, which passes them to every harness
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--check", action="store_true")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    args.stores, args.embedder = "fp32", "mean"  # the recall harness's arguments that Bench reads
    if not args.model:
        print("error: no --model (and no KVI_VLLM_MODEL)", file=sys.stderr)
        return 2
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main())
