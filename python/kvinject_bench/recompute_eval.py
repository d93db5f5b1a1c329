#!/usr/bin/env python3
"""Selective recompute of injected facts (kvinject.hf.recompute) on a real instruct
model: first-token KL divergence from a re-prefill of [header | facts |
question], and the time to first token of re-prefill, plain injection and
injection + recompute.

    python3 -m kvinject_bench.recompute_eval MODEL_DIR [--device cpu|cuda] [--facts 20] [--cases 8]
        [--dtype float32|bfloat16] [--configs NAME,...] [--ttft-reps 10]

Facts are short sentences about made-up people, each encoded alone (prefilled
at positions 0.., captured pre-RoPE); a case injects k of them behind a chat
header and asks about one (kvinject.hf.testing's make_cases and
RecomputeHarness). Configurations: ``inject`` (plain), ``full`` (every token
recomputed: equals re-prefill), ``blend-R`` (layers 0..1 fresh, then the R% most
deviating tokens at layer 1; ``blendpf-R``: R% of each fact), ``boundary-B``
(the first B tokens of each fact), ``blend-R+b-B`` (both). Prints a markdown
table: mean KL(re-prefill || config) of the first answer token, top-1 agreement
with re-prefill, the share of fact tokens recomputed, the share of a
re-prefill's layer-token work, and (--ttft-reps) the median TTFT in ms.
"""
from __future__ import annotations

import argparse
import os
import sys

from kvinject_bench import common

DEFAULT_CONFIGS = ["inject", "boundary-4", "blend-5", "blend-10", "blend-15", "blend-30", "blend-10+b-2", "full"]


def parse_config(name):
    """(score_layer, fraction, boundary, per_fact) of a configuration name."""
    if name == "inject":
        return -1, 0.0, 0, False
    if name == "full":
        return 1, 1.0, 0, False
    frac, b, layer, per_fact = 0.0, 0, -1, False
    for part in name.split("+"):
        kind, _, val = part.partition("-")
        if kind in ("blend", "blendpf"):
            frac, layer, per_fact = float(val) / 100.0, 1, kind == "blendpf"
        elif kind in ("boundary", "b"):
            b = int(val)
        else:
            raise ValueError("unknown configuration %r" % name)
    return layer, frac, b, per_fact


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--facts", type=int, default=20)
    ap.add_argument("--cases", type=int, default=8)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    ap.add_argument("--ttft-reps", type=int, default=0, help="time each configuration this many times per case")
    args = ap.parse_args(argv)
    torch, _ = common.need_torch_transformers()
    kvi = common.need_kvinject()
    device = common.pick_device(args.device, torch, kvi)
    common.kvi_backend(device)  # exits 2 for a cuda run without a CUDA build
    from kvinject.hf.testing import RecomputeHarness, kl, make_cases
    torch.set_grad_enabled(False)
    h = RecomputeHarness(args.model_dir, device, getattr(torch, args.dtype), kvi, torch)
    L = h.config.num_hidden_layers
    common.banner("Selective recompute of injected facts: %s, k = %d facts, %d cases" % (
        os.path.basename(args.model_dir.rstrip("/")), args.facts, args.cases), device, args)
    cases = make_cases(h.tok, args.facts, args.cases)
    refs = [h.reprefill(c) for c in cases]
    rows = []
    timer_rows = {}
    for name in args.configs.split(","):
        layer, frac, b, pf = parse_config(name)
        kls, agree, share, work = [], 0, [], []
        for c, ref in zip(cases, refs):
            lg, plan, T = h.injected(c, layer, frac, b, pf)
            kls.append(kl(ref, lg))
            agree += int(lg.argmax() == ref.argmax())
            chosen = len(plan.chosen) if plan else 0
            share.append(chosen / T)
            fresh = (layer + 1) if layer >= 0 else 0
            work.append((fresh * T + chosen * (L - fresh)) / (L * T))
        row = [name, common.fmt(sum(kls) / len(kls), ".4f"), "%d/%d" % (agree, len(cases)),
               "%.1f%%" % (100 * sum(share) / len(share)), "%.1f%%" % (100 * sum(work) / len(work))]
        if args.ttft_reps:
            row.append(common.fmt(ttft(h, cases, layer, frac, b, pf, args.ttft_reps), ".2f"))
        rows.append(row)
        print("| " + " | ".join(row) + " |", flush=True)
    if args.ttft_reps:
        rows.append(["re-prefill", "0", "%d/%d" % (len(cases), len(cases)), "100%", "100%",
                     common.fmt(ttft_reprefill(h, cases, args.ttft_reps), ".2f")])
    header = ["config", "mean KL(re-prefill || config)", "top-1 = re-prefill", "fact tokens recomputed",
              "layer-token work vs re-prefill"] + (["TTFT ms (median)"] if args.ttft_reps else [])
    print()
    print(common.table(header, rows))
    return 0


def ttft(h, cases, layer, frac, b, pf, reps):
    """Median ms from the header's cache being ready to the first answer token's
    logits: injection, recompute, question prefill (facts encoded beforehand)."""
    times = []
    for c in cases:
        h.injected(c, layer, frac, b, pf)  # warm up, facts encoded
        for _ in range(reps):
            t = common.Timer(h.device)
            t.mark()
            h.injected(c, layer, frac, b, pf)
            t.mark()
            times.append(t.marks()[-1])
    return common.median(times)


def ttft_reprefill(h, cases, reps):
    times = []
    for c in cases:
        h.reprefill(c)
        for _ in range(reps):
            t = common.Timer(h.device)
            t.mark()
            h.reprefill(c)
            t.mark()
            times.append(t.marks()[-1])
    return common.median(times)


if __name__ == "__main__":
    sys.exit(main())
