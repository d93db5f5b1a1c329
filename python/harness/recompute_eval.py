#!/usr/bin/env python3
"""Selective recompute of injected facts (kvinject.hf.recompute) on a real instruct
model: first-token KL divergence from a re-prefill of [header | facts |
question], and the time to first token of re-prefill, plain injection and
injection + recompute.

    python3 recompute_eval.py MODEL_DIR [--device cpu|cuda] [--facts 20] [--cases 8]
        [--dtype float32|bfloat16] [--configs NAME,...] [--ttft-reps 10]

Facts are short sentences about made-up people, each encoded alone (prefilled
at positions 0.., captured pre-RoPE); a case injects k of them behind a chat
header and asks about one. Configurations: ``inject`` (plain), ``full`` (every
token recomputed: equals re-prefill), ``blend-R`` (layers 0..1 fresh, then the
R% most deviating tokens at layer 1; ``blendpf-R``: R% of each fact), ``boundary-B`` (the first B tokens of
each fact), ``blend-R+b-B`` (both). Prints a markdown table: mean KL(re-prefill
|| config) of the first answer token, top-1 agreement with re-prefill, the
share of fact tokens recomputed, the share of a re-prefill's layer-token work,
and (--ttft-reps) the median TTFT in ms.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import hf_common as C  # noqa: E402

TENANT = 1
NAMES = ["Avery", "Blake", "Casey", "Devon", "Emery", "Finley", "Gray", "Harper", "Indy", "Jordan", "Kai", "Logan",
         "Morgan", "Noel", "Oakley", "Parker", "Quinn", "Reese", "Sage", "Tatum", "Umber", "Vale", "Wren", "Yael"]
CITIES = ["Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Accra", "Lima", "Riga", "Dakar", "Seoul", "Cusco", "Minsk",
          "Tunis", "Porto", "Turin", "Cairo", "Delhi", "Kyiv", "Baku", "Doha", "Nice", "Bern", "Fez", "Goa"]
OBJECTS = ["violin", "kayak", "telescope", "bonsai", "chessboard", "drone", "lantern", "compass", "typewriter",
           "harp", "microscope", "sundial"]

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


def make_cases(tok, k, n, seed=0):
    rng = random.Random(seed)
    cases = []
    for c in range(n):
        people = rng.sample(NAMES, k) if k <= len(NAMES) else [NAMES[i % len(NAMES)] + str(i) for i in range(k)]
        facts = ["%s lives in %s and owns a %s. " % (p, rng.choice(CITIES), rng.choice(OBJECTS)) for p in people]
        target = rng.randrange(k)
        header = "<|im_start|>system\nYou answer from the notes below.<|im_end|>\n<|im_start|>user\nNotes: "
        question = "\nIn which city does %s live?<|im_end|>\n<|im_start|>assistant\n%s lives in" % (
            people[target], people[target])
        cases.append(dict(header=tok(header)["input_ids"],
                          facts=[tok(f, add_special_tokens=False)["input_ids"] for f in facts],
                          question=tok(question, add_special_tokens=False)["input_ids"]))
    return cases


class Harness:
    def __init__(self, model_dir, device, dtype, kvi, torch):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        self.torch, self.kvi, self.device = torch, kvi, device
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        self.model = self.model.to(device).eval()
        self.config = self.model.config
        self.stream = C.kvi_stream(device)
        km = C.kvi_model_for(self.config)
        self.store = kvi.Store(km, 256 << 20, backend=C.kvi_backend(device), dtype=C.kvi_dtype(self.model.dtype))
        self.next_id = 1
        self.ids = {}

    def fact_id(self, toks):
        """Encodes a fact alone (once per distinct token sequence); its id."""
        key = tuple(toks)
        if key in self.ids:
            return self.ids[key]
        torch, kvi = self.torch, self.kvi
        ids = torch.tensor([toks], device=self.device)
        out = self.model(ids, use_cache=True)
        keys, values = C.cache_tensors(out.past_key_values)
        enc = kvi.Encoder(self.store, kvi.CacheLayout.hf(keys, values))
        fid = self.next_id
        self.next_id += 1
        enc.encode(kvi.Capture(TENANT, fid, block_table=[0], num_tokens=len(toks), start_position=0),
                   stream=self.stream)
        C.sync(self.device)
        self.ids[key] = fid
        return fid

    def reprefill(self, case):
        """Logits of the first answer token after a prefill of everything."""
        torch = self.torch
        allf = [t for f in case["facts"] for t in f]
        ids = torch.tensor([case["header"] + allf + case["question"]], device=self.device)
        return self.model(ids, use_cache=False).logits[0, -1].double().cpu()

    def injected(self, case, layer, frac, boundary, per_fact=False):
        """Logits after header prefill, injection, recompute (layer -1 and no boundary:
        none) and the question's prefill; and the plan."""
        torch, kvi = self.torch, self.kvi
        from kvinject.hf.recompute import recompute
        hdr, q = case["header"], case["question"]
        fids = [self.fact_id(f) for f in case["facts"]]
        allf = [t for f in case["facts"] for t in f]
        n = len(hdr) + len(allf) + len(q)
        cache = C.static_cache(self.model, n)
        self.model(torch.tensor([hdr], device=self.device), past_key_values=cache, use_cache=True)
        keys, values = C.cache_tensors(cache)
        inj = kvi.Injector(self.store, kvi.CacheLayout.hf(keys, values))
        req = kvi.InjectRequest(TENANT, fids, block_table=[0], first_slot=len(hdr), start_position=len(hdr))
        inj.inject(req, stream=self.stream)
        plan = None
        if layer >= 0 or boundary > 0:
            plan = recompute(self.model, cache, inj, req, allf, score_layer=layer, fraction=frac,
                             boundary=boundary, per_fact=per_fact, fact_tokens=[len(f) for f in case["facts"]],
                             stream=self.stream)
        C.set_cache_length(cache, len(hdr) + len(allf))
        out = self.model(torch.tensor([q], device=self.device), past_key_values=cache, use_cache=True)
        C.sync(self.device)
        return out.logits[0, -1].double().cpu(), plan, len(allf)


def kl(p_logits, q_logits):
    import torch
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((lp.exp() * (lp - lq)).sum())


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
    torch, _ = C.need_torch_transformers()
    kvi = C.need_kvinject()
    device = C.pick_device(args.device, torch, kvi)
    torch.set_grad_enabled(False)
    h = Harness(args.model_dir, device, getattr(torch, args.dtype), kvi, torch)
    L = h.config.num_hidden_layers
    C.banner("Selective recompute of injected facts: %s, k = %d facts, %d cases" % (
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
        row = [name, C.fmt(sum(kls) / len(kls), ".4f"), "%d/%d" % (agree, len(cases)),
               "%.1f%%" % (100 * sum(share) / len(share)), "%.1f%%" % (100 * sum(work) / len(work))]
        if args.ttft_reps:
            row.append(C.fmt(ttft(h, cases, layer, frac, b, pf, args.ttft_reps), ".2f"))
        rows.append(row)
        print("| " + " | ".join(row) + " |", flush=True)
    if args.ttft_reps:
        rows.append(["re-prefill", "0", "%d/%d" % (len(cases), len(cases)), "100%", "100%",
                     C.fmt(ttft_reprefill(h, cases, args.ttft_reps), ".2f")])
    header = ["config", "mean KL(re-prefill || config)", "top-1 = re-prefill", "fact tokens recomputed",
              "layer-token work vs re-prefill"] + (["TTFT ms (median)"] if args.ttft_reps else [])
    print()
    print(C.table(header, rows))
    return 0


def ttft(h, cases, layer, frac, b, pf, reps):
    """Median ms from the header's cache being ready to the first answer token's
    logits: injection, recompute, question prefill (facts encoded beforehand)."""
    times = []
    for c in cases:
        h.injected(c, layer, frac, b, pf)  # warm up, facts encoded
        for _ in range(reps):
            t = C.Timer(h.device)
            t.mark()
            h.injected(c, layer, frac, b, pf)
            t.mark()
            times.append(t.marks()[-1])
    return C.median(times)


def ttft_reprefill(h, cases, reps):
    times = []
    for c in cases:
        h.reprefill(c)
        for _ in range(reps):
            t = C.Timer(h.device)
            t.mark()
            h.reprefill(c)
            t.mark()
            times.append(t.marks()[-1])
    return C.median(times)


if __name__ == "__main__":
    sys.exit(main())
