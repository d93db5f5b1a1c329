#!/usr/bin/env python3
"""Parity of libkvinject's capture + injection with Hugging Face transformers.

For tiny random-weight models of four RoPE families (Llama with llama3
scaling, Qwen2 with theta 1e6 and GQA, GPT-NeoX with partial rotary, GPT-J
with interleaved partial rotary), in fp32 and bf16:

1. exact: full prefill of [prefix | fact_1 .. fact_k | question] against:
   each fact prefilled by HF after its exact preceding text, its range of
   HF's cache (post-RoPE keys) captured with kvi_encode (keys un-rotated at
   the positions they were written with) into a kvinject Store; a
   StaticCache holding the prefix's KV; kvi_inject of all facts behind it
   (keys rotated at their destination positions); a prefill of only the
   question over that cache. The question's logits must match.
2. shifted: the same, but each fact is captured from a prefill that ran at
   other positions (position ids offset by a different amount per fact, so
   slots and positions differ too): Chunked RoPE must re-rotate the keys to
   their final positions. A negative control runs this with a deliberately
   wrong RoPE mapping, which must fail, so the check has teeth.
3. quality (--quality, fp32): independent encoding, each fact prefilled after
   only the w tokens before it (w = 0: alone, at position 0): KL divergence
   and top-1 agreement of the question's next-token distribution against a
   full prefill, for k facts; a markdown table. Random-weight models: the
   numbers say how far the KV moves, not what a trained model would answer.

Criteria (exit 1 when one fails):
- fp32: max |difference| / max |reference| <= --fp32-tol (1e-4) for the
  logits of every question token and for the injected K and V against the
  full prefill's own cache; the config's RoPE mapped to kvi_rope_spec gives
  the model's own cos/sin (positions 0..511) to 1e-4; the wrong-mapping
  control is caught.
- bf16: the greedy next token is identical on --prompts (>= 20) random
  prompts for both variants, and the injected K and V are within
  --bf16-kv-tol (2^-4; a wrong RoPE gives ~1) of the prefill's; the max
  relative logit error is reported. A prompt whose reference top two logits
  are within two bf16 ulps (a tie that rounding decides) is left out,
  reported, and another is drawn. A bf16 model whose own RoPE table differs
  from the config's formula (HF's GPT-J builds it from bf16-rounded
  frequencies under a bf16 default dtype) is given its own table
  (kvi_rope_spec.cos_sin_table), as an engine integration would.
Exit 77 (skipped) when torch or transformers is missing.

    python3 -m kvinject_bench.hf_parity --device cuda
    python3 -m kvinject_bench.hf_parity --device cpu --quick
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from kvinject_bench import common

TENANT = 7


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None,
                    help="cuda or cpu (default: cuda when torch and the library both have it)")
    ap.add_argument("--quick", action="store_true", help="fewer quality prompts and cells (CPU smoke run)")
    ap.add_argument("--models", default="llama,qwen2,gpt_neox,gptj")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=20, help="bf16 prompts per model (>= 20 for the criterion)")
    ap.add_argument("--fp32-tol", type=float, default=1e-4)
    ap.add_argument("--bf16-kv-tol", type=float, default=2.0 ** -4,
                    help="bf16: max |injected - prefill| / max |prefill| of K and V (a wrong RoPE gives ~1)")
    ap.add_argument("--quality", dest="quality", action="store_true", default=True,
                    help="run the independent-encoding quality table (default)")
    ap.add_argument("--no-quality", dest="quality", action="store_false")
    ap.add_argument("--quality-models", default=None, help="models of the quality table (default: --models)")
    ap.add_argument("--ks", default="5,10,20,50")
    ap.add_argument("--windows", default="0,16,64")
    ap.add_argument("--quality-prompts", type=int, default=None, help="prompts per cell (default 16, quick 4)")
    ap.add_argument("--fact-tokens", type=int, default=24, help="fact length of the quality table")
    ap.add_argument("--quality-store", default="model", choices=["model", "fp32", "bf16", "fp16", "fp8"],
                    help="storage dtype of the quality table's stores (default: the model's dtype); fp8 = e4m3 "
                         "with per-page scales")
    ap.add_argument("--attn", default="sdpa", help="attention implementation (falls back to eager)")
    ap.add_argument("--seed", type=int, default=1234)
    a = ap.parse_args(argv)
    if a.quality_prompts is None:
        a.quality_prompts = 4 if a.quick else 16
    return a


# -------------------------------------------------------------------- prompts

def random_prompt(gen, vocab, prefix, fact_lens, question, torch):
    """Random token ids: [prefix | facts | question] and the facts' start slots."""
    n = prefix + sum(fact_lens) + question
    ids = torch.randint(0, vocab, (1, n), generator=gen)
    starts, s = [], prefix
    for t in fact_lens:
        starts.append(s)
        s += t
    return ids, starts


# ------------------------------------------------------------ inject + score

class Run:
    """One model in one dtype on one device, with what its checks share."""

    def __init__(self, name, model, dtype_name, device, torch, kvi):
        self.name, self.model, self.dtype_name, self.device = name, model, dtype_name, device
        self.torch, self.kvi = torch, kvi
        self.config = model.config
        self.vocab = model.config.vocab_size
        self.stream = common.kvi_stream(device)
        self.backend = common.kvi_backend(device)
        self.dtype = model.dtype
        # the RoPE the library applies: the config's mapping, unless the model
        # computes something else (HF's GPT-J built under a bf16 default dtype
        # makes its sin/cos table from bf16-rounded frequencies): then the
        # model's own table, as an engine integration would pass it
        self.rope_fields = common.kvi_rope_fields(self.config)
        self.mapping_err = common.rope_mapping_error(model, common.kvi_model_for(self.config))
        self.rope_source = "config"
        if self.mapping_err > 1e-3:
            table = common.engine_rope_table(model, self.config.max_position_embeddings)
            self.rope_fields = dict(style=self.rope_fields["style"], rotary_dim=table.shape[1],
                                    cos_sin_table=table)
            self.rope_source = "engine table"

    def store(self, rope_fields=None, store_dtype=None):
        km = common.kvi_model_for(self.config, rope_fields if rope_fields is not None else self.rope_fields)
        sd = store_dtype if store_dtype is not None else getattr(self, "quality_store", None)
        sd = sd if sd is not None else common.kvi_dtype(self.dtype)
        return self.kvi.Store(km, 32 << 20, backend=self.backend, dtype=sd)

    def forward(self, ids, **kw):
        return self.model(ids.to(self.device), **kw)

    def capture(self, store, ids, fact_range, fact_id, offset=0, batch_rows=None):
        """Prefills ids (HF, default DynamicCache; position ids shifted by `offset`)
        and captures slots fact_range of row 0 as fact_id. batch_rows: capture
        several rows of a batched prefill instead: a list of (row, slot,
        tokens, fact_id)."""
        torch, kvi = self.torch, self.kvi
        kw = {}
        if offset:
            pos = torch.arange(offset, offset + ids.shape[1]).unsqueeze(0).expand(ids.shape[0], -1)
            kw["position_ids"] = pos.to(self.device)
        out = self.forward(ids, use_cache=True, **kw)
        keys, values = common.cache_tensors(out.past_key_values)
        enc = kvi.Encoder(store, kvi.CacheLayout.hf(keys, values))
        if batch_rows is None:
            a, b = fact_range
            caps = [kvi.Capture(TENANT, fact_id, block_table=[0], num_tokens=b - a, first_slot=a,
                                start_position=a + offset)]
        else:
            caps = [kvi.Capture(TENANT, fid, block_table=[row], num_tokens=t, first_slot=slot,
                                start_position=slot + offset) for row, slot, t, fid in batch_rows]
        enc.encode(caps, stream=self.stream)
        common.sync(self.device)  # the cache tensors may go when `out` does
        return out

    def injected_logits(self, store, ids, prefix, fact_ids, question, last_only=False, with_kv=False):
        """StaticCache with the prefix prefilled by HF, the facts injected behind it,
        then a prefill of the question only: its logits (fp64, CPU)."""
        torch, kvi = self.torch, self.kvi
        inj_tokens = ids.shape[1] - prefix - question
        cache = common.static_cache(self.model, ids.shape[1])
        self.forward(ids[:, :prefix], past_key_values=cache, use_cache=True)
        # the facts at the cache's length (slots and positions prefix..), its length set past them
        from kvinject.hf import StaticCacheInjector
        inj = StaticCacheInjector(store, cache)
        n = inj.inject(TENANT, fact_ids, stream=self.stream)
        if n != inj_tokens or inj.length != prefix + inj_tokens:
            raise RuntimeError("injected %d tokens, cache length %d; expected %d, %d"
                               % (n, inj.length, inj_tokens, prefix + inj_tokens))
        keys, values = common.cache_tensors(cache)
        out = self.forward(ids[:, prefix + inj_tokens:], past_key_values=cache, use_cache=True)
        common.sync(self.device)
        lg = out.logits[0]
        if last_only:
            lg = lg[-1:]
        if with_kv:  # what the injector wrote, for the KV-level comparison
            end = prefix + inj_tokens
            return lg.double().cpu(), ([x[0, :, prefix:end] for x in keys], [x[0, :, prefix:end] for x in values])
        return lg.double().cpu()

    def full_logits(self, ids, question, use_cache=False):
        out = self.forward(ids, use_cache=use_cache)
        return out.logits[0, -question:].double().cpu(), out


def rel_err(got, ref):
    return ((got - ref).abs().max() / ref.abs().max()).item()


# ---------------------------------------------------------------- parity 1+2

WRONG_ROPE = {  # the negative control: one field of the mapping deliberately wrong
    "llama": ("no llama3 scaling", dict(scaling=0)),
    "qwen2": ("theta 1e4 instead of 1e6", dict(theta=10000.0)),
    "gpt_neox": ("full rotary instead of partial", dict(rotary_dim=0)),
    "gptj": ("NeoX pairs instead of GPT-J", dict(style=1)),
}


def parity_case(run, gen, variant, rope_fields=None, lens=(9, 20, 17, 24), prefix=13, question=8):
    """One prompt through one variant: (reference logits, injected logits)."""
    torch = run.torch
    lens = list(lens)
    ids, starts = random_prompt(gen, run.vocab, prefix, lens, question, torch)
    ref, out = run.full_logits(ids, question, use_cache=True)
    ref_k, ref_v = common.cache_tensors(out.past_key_values)
    ref_k = [x[0, :, prefix:prefix + sum(lens)].clone() for x in ref_k]
    ref_v = [x[0, :, prefix:prefix + sum(lens)].clone() for x in ref_v]
    del out
    store = run.store(rope_fields)
    ids_dev = ids.to(run.device)
    fact_ids = []
    for i, (s, t) in enumerate(zip(starts, lens)):
        fid = 100 + i
        if variant == "exact":
            run.capture(store, ids_dev[:, :s + t], (s, s + t), fid)
        else:
            # the same text, written at positions shifted by a per-fact offset
            off = int(torch.randint(17, 400, (1,), generator=gen))
            run.capture(store, ids_dev[:, :s + t], (s, s + t), fid, offset=off)
        fact_ids.append(fid)
    got, (k, v) = run.injected_logits(store, ids_dev, prefix, fact_ids, question, with_kv=True)
    store.close()
    return ref, got, kv_err(k, ref_k), kv_err(v, ref_v)


def kv_err(got, ref):
    """max over layers of max |got - ref| / max |ref| (the injected KV against the
    full prefill's own cache, over the facts' slots)."""
    return max(float((g.double() - r.double()).abs().max() / r.double().abs().max()) for g, r in zip(got, ref))


def check_mapping(run, args, results):
    """The config's RoPE mapped to kvi_rope_spec against the model's own cos/sin
    (kvi_model_rope_cos_sin vs the model's rotary module or table, positions
    0..511, every pair). fp32 models must match to fp32 angle rounding; a
    bf16 model may differ (reported, and then its own table is used)."""
    e = run.mapping_err
    if run.dtype_name == "fp32":
        passed = e <= 1e-4
        verdict = "PASS" if passed else "FAIL"
    else:
        passed = True
        verdict = "info"
    detail = "max |cos/sin difference| %.2e; the library uses %s" % (e, run.rope_source)
    if run.rope_source != "config":
        detail += " (the model's table is not the config's formula in %s)" % run.dtype_name
    results.append((run.name, run.dtype_name, "RoPE mapping", detail, verdict))
    return passed


def check_fp32(run, args, gen, results):
    ok = check_mapping(run, args, results)
    for variant in ("exact", "shifted"):
        e = ke = ve = 0.0
        for _ in range(3):
            ref, got, kerr, verr = parity_case(run, gen, variant)
            e, ke, ve = max(e, rel_err(got, ref)), max(ke, kerr), max(ve, verr)
        passed = max(e, ke, ve) <= args.fp32_tol
        ok &= passed
        results.append((run.name, "fp32", variant, "rel err: logits %.2e (all question tokens), injected K %.2e, "
                        "V %.2e (3 prompts)" % (e, ke, ve), "PASS" if passed else "FAIL"))
    # negative control: a wrong RoPE mapping must be caught by the shifted variant
    what, wrong = WRONG_ROPE[run.name]
    fields = dict(common.kvi_rope_fields(run.config))  # (fp32: equal to run.rope_fields, checked above)
    fields.update(wrong)
    ref, got, kerr, _ = parity_case(run, gen, "shifted", rope_fields=fields)
    e = rel_err(got, ref)
    caught = e > 10 * args.fp32_tol and kerr > 10 * args.fp32_tol
    ok &= caught
    results.append((run.name, "fp32", "control: " + what, "rel err: logits %.2e, K %.2e (both must exceed %.0e)"
                    % (e, kerr, 10 * args.fp32_tol), "caught" if caught else "NOT CAUGHT"))
    return ok


def bf16_tie(logits):
    """Whether the reference's top two logits are a tie at bf16 resolution: the
    logits are bf16 numbers, and a gap of at most two units in the last place of
    the largest magnitude is decided by rounding, not by the model."""
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    ulp = 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)
    return gap <= 2 * ulp, gap


def check_bf16(run, args, gen, results):
    """Greedy next token on --prompts random prompts whose reference top-1 is
    decided (not a bf16 tie, see bf16_tie); ties are drawn again (at most as many
    extra prompts) and reported."""
    ok = check_mapping(run, args, results)
    for variant in ("exact", "shifted"):
        same, decided, worst, flips, ties, tie_same = 0, 0, 0.0, [], 0, 0
        drawn, ke, ve = 0, 0.0, 0.0
        while decided < args.prompts and drawn < 2 * args.prompts:
            drawn += 1
            ref, got, kerr, verr = parity_case(run, gen, variant)
            ke, ve = max(ke, kerr), max(ve, verr)
            r, g = ref[-1], got[-1]
            worst = max(worst, rel_err(got, ref))
            match = int(r.argmax()) == int(g.argmax())
            tie, gap = bf16_tie(r)
            if tie:
                ties += 1
                tie_same += match
                continue
            decided += 1
            if match:
                same += 1
            else:
                flips.append("prompt %d: ref top-2 gap %.3g" % (drawn, gap))
        # the injected KV itself: K is rounded to bf16 twice (stored pre-RoPE, then
        # rotated into the cache) where the prefill rounds once: a few bf16 ulps
        kv_ok = ke <= args.bf16_kv_tol and ve <= args.bf16_kv_tol
        passed = same == decided and decided >= max(args.prompts, 20) and kv_ok
        ok &= passed
        detail = "greedy token identical %d/%d, max rel err: logits %.2e, injected K %.2e, V %.2e" % (
            same, decided, worst, ke, ve)
        if ties:
            detail += "; %d bf16 ties of the reference's top two left out (%d of them identical too)" % (
                ties, tie_same)
        if flips:
            detail += " (" + "; ".join(flips) + ")"
        results.append((run.name, "bf16", variant, detail, "PASS" if passed else "FAIL"))
    return ok


# ------------------------------------------------------------------- quality

def quality(run, args, gen):
    """Rows of the independent-encoding table for one model (fp32)."""
    torch = run.torch
    names = {"fp32": "FP32", "bf16": "BF16", "fp16": "FP16", "fp8": "FP8_E4M3"}
    run.quality_store = None if args.quality_store == "model" else getattr(run.kvi.DType, names[args.quality_store])
    ks = [int(x) for x in args.ks.split(",")]
    ws = [int(x) for x in args.windows.split(",")]
    T, question = args.fact_tokens, 16
    prefix = max(ws) + 8  # every window lies inside the prompt
    rows = []
    kv_roundtrip = []  # relative Frobenius error of each fact's K, then V, against fp32 storage
    for k in ks:
        kl = {w: [] for w in ws + ["exact"]}
        agree = {w: 0 for w in ws + ["exact"]}
        for _ in range(args.quality_prompts):
            ids, starts = random_prompt(gen, run.vocab, prefix, [T] * k, question, torch)
            ids_dev = ids.to(run.device)
            ref_all, out = run.full_logits(ids, question, use_cache=True)
            ref = ref_all[-1:]
            p_ref = torch.log_softmax(ref[0], -1)
            cases = {}
            # exact context: all k facts captured from the full prefill's own cache
            store = run.store()
            keys, values = common.cache_tensors(out.past_key_values)
            enc = run.kvi.Encoder(store, run.kvi.CacheLayout.hf(keys, values))
            enc.encode([run.kvi.Capture(TENANT, 1000 + i, block_table=[0], num_tokens=T, first_slot=s,
                                        start_position=s) for i, s in enumerate(starts)], stream=run.stream)
            if run.quality_store is not None and run.quality_store != run.kvi.DType.FP32:
                # the storage's round-trip error on these activations: the same captures into an fp32 store
                ref_store = run.store(store_dtype=run.kvi.DType.FP32)
                enc32 = run.kvi.Encoder(ref_store, run.kvi.CacheLayout.hf(keys, values))
                enc32.encode([run.kvi.Capture(TENANT, 1000 + i, block_table=[0], num_tokens=T, first_slot=s,
                                              start_position=s) for i, s in enumerate(starts)], stream=run.stream)
                common.sync(run.device)
                for i in range(k):
                    for a, b in zip(store.read(TENANT, 1000 + i), ref_store.read(TENANT, 1000 + i)):
                        a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
                        kv_roundtrip.append(float((a - b).norm() / b.norm().clamp_min(1e-30)))
                del enc32
                ref_store.close()
            common.sync(run.device)
            del out, keys, values, enc
            cases["exact"] = run.injected_logits(store, ids_dev, prefix, [1000 + i for i in range(k)], question,
                                                 last_only=True)
            store.close()
            for w in ws:
                # each fact after only its w preceding tokens, from position 0, one batched prefill
                store = run.store()
                rows_ids = torch.stack([ids[0, s - w:s + T] for s in starts])
                run.capture(store, rows_ids.to(run.device), None, None,
                            batch_rows=[(i, w, T, 2000 + i) for i in range(k)])
                cases[w] = run.injected_logits(store, ids_dev, prefix, [2000 + i for i in range(k)], question,
                                               last_only=True)
                store.close()
            for w, lg in cases.items():
                p = torch.log_softmax(lg[0], -1)
                kl[w].append(float((p_ref.exp() * (p_ref - p)).sum()))
                agree[w] += int(int(lg[0].argmax()) == int(ref[0].argmax()))
        n = args.quality_prompts
        row = [run.name, k]
        for w in ws + ["exact"]:
            row.append("%s / %d%%" % (common.fmt(sum(kl[w]) / n, ".2e"), round(100 * agree[w] / n)))
        rows.append(row)
    header = ["model", "k"] + ["w = %d: KL / top-1" % w for w in ws] + ["exact context: KL / top-1"]
    if kv_roundtrip:
        ks_, vs_ = kv_roundtrip[0::2], kv_roundtrip[1::2]
        print("%s: %s storage round trip on the model's own K/V (%d facts): relative error K mean %.3e max %.3e, "
              "V mean %.3e max %.3e" % (run.name, args.quality_store, len(ks_), sum(ks_) / len(ks_), max(ks_),
                                        sum(vs_) / len(vs_), max(vs_)), flush=True)
    return header, rows


# ---------------------------------------------------------------------- main

def main(argv=None):
    args = parse_args(argv)
    torch, transformers = common.need_torch_transformers()
    kvi = common.need_kvinject()
    device = common.pick_device(args.device, torch, kvi)
    if device.startswith("cuda"):
        # fp32 parity means fp32 matmuls: no TF32 anywhere
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(False)
    t_start = time.time()
    common.banner("Parity with Hugging Face transformers", device, args)
    models = args.models.split(",")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    configs = common.tiny_configs(layers=args.layers)
    results, ok = [], True
    quality_tables = []
    for name in models:
        cls, kw, note = configs[name]
        for dn in args.dtypes.split(","):
            t0 = time.time()
            model = common.build_model(cls, kw, dtypes[dn], device, attn=args.attn, seed=args.seed)
            run = Run(name, model, dn, device, torch, kvi)
            gen = torch.Generator().manual_seed(args.seed + sum(map(ord, name + dn)))
            if dn == "fp32":
                good = check_fp32(run, args, gen, results)
            else:
                good = check_bf16(run, args, gen, results)
            ok &= good
            print("%s %s (%s; %s attention; rope %s): %s in %.1fs" % (
                name, dn, note, model.config._attn_implementation,
                {k: (v.name if hasattr(v, "name") else v) for k, v in common.kvi_rope_fields(model.config).items()}
                if run.rope_source == "config" else run.rope_source,
                "ok" if good else "FAILED", time.time() - t0), flush=True)
            qmodels = (args.quality_models or args.models).split(",")
            if dn == "fp32" and args.quality and name in qmodels:
                t0 = time.time()
                quality_tables.append(quality(run, args, torch.Generator().manual_seed(args.seed + 1)))
                print("%s quality table in %.1fs" % (name, time.time() - t0), flush=True)
            del run, model
    print()
    print("### Parity (criteria: fp32 rel. err <= %.0e; bf16 greedy token identical on every prompt)\n"
          % args.fp32_tol)
    print(common.table(["model", "dtype", "check", "result", "verdict"], results))
    if quality_tables:
        ws = args.windows
        print("\n### Independent encoding: quality cost against full prefill\n")
        print("Random-weight models (no trained weights offline): KL(full || injected) in nats of the question's "
              "next-token distribution, mean over %d random prompts, and top-1 agreement; facts of %d tokens, "
              "each encoded after only the w = %s tokens before it (w = 0: alone at position 0); "
              "\"exact context\" captures each fact from the full prefill's own cache. Fact storage: %s.\n"
              % (args.quality_prompts, args.fact_tokens, ws,
                 "the model's dtype" if args.quality_store == "model" else args.quality_store))
        header = quality_tables[0][0]
        print(common.table(header, [r for _, rows in quality_tables for r in rows]))
    print("\nparity: %s (%.0f s)" % ("PASS" if ok else "FAIL", time.time() - t_start))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
