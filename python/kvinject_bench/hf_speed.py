#!/usr/bin/env python3
"""Time to first token with Hugging Face transformers: re-prefill against
libkvinject (search + inject + question prefill) and against the paper's
torch composition, on a Llama-3.1-8B-shaped bf16 model with random weights.

Per request: a 32-token header (its KV already in the cache, as a prefix
cache would hold it), k retrieved facts of 24 tokens, a 32-token question.

- re-prefill: what retrieval-and-paste memory does: prefill
  [header | facts | question] (the facts' ids come from the same search).
- libkvinject: kvi_store_search over the tenant's fact embeddings (1,000
  facts, random embeddings), kvi_inject of the k facts into a preallocated
  StaticCache behind the header, then a prefill of only the question.
- paper (torch): InferScale's composition: a torch matmul + topk search,
  then per layer torch.cat of the facts' stored pre-RoPE K and V (one tensor
  per fact and layer), rotation with torch (bf16 cos/sin tables from the
  model's rotary module), index assignment into the same StaticCache, then
  the same question prefill.

TTFT is from the request's arrival to its first token's id on the device
(CUDA events, medians over --runs after --warmup), for k = 0, 5, 10, 20, 50;
the stages are timed separately too, so fixed overhead (Python, the launches
of the HF forward) is visible. Batched throughput: --batches concurrent
requests at k = 50 as one batched search, one injection and one batched
forward (requests/s). Output: markdown tables for BENCHMARKS.md.

    python3 -m kvinject_bench.hf_speed --device cuda          # the H200 run
    python3 -m kvinject_bench.hf_speed --device cpu --quick   # smoke run, tiny model
"""
from __future__ import annotations

import argparse
import sys
import time

from kvinject_bench import common

TENANT = 11


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None,
                    help="cuda or cpu (default: cuda when torch and the library both have it)")
    ap.add_argument("--quick", action="store_true", help="fewer runs and batches")
    ap.add_argument("--model", choices=["llama8b", "tiny"], default=None,
                    help="llama8b: Llama-3.1-8B shape (default on cuda); tiny: 2 layers (default on cpu)")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--ks", default="0,5,10,20,50")
    ap.add_argument("--fact-tokens", type=int, default=24)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--header", type=int, default=32)
    ap.add_argument("--facts", type=int, default=1000, help="facts in the tenant's store")
    ap.add_argument("--embedding-dim", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=None, help="timed runs per point (default 20, quick 5)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 3, quick 2)")
    ap.add_argument("--batches", default=None, help="concurrent requests at k = 50 (default 1,16,64; quick 1,16)")
    ap.add_argument("--batch-runs", type=int, default=None, help="timed runs per batch size (default 5, quick 2)")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    a.runs = a.runs if a.runs is not None else (5 if a.quick else 20)
    a.warmup = a.warmup if a.warmup is not None else (2 if a.quick else 3)
    a.batch_runs = a.batch_runs if a.batch_runs is not None else (2 if a.quick else 5)
    if a.batches is None:
        a.batches = "1,16" if a.quick else "1,16,64"
    return a


def llama8b_config(layers=None):
    import transformers as tf
    kw = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers or 32,
              num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
              rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
    return tf.LlamaConfig, kw


def tiny_config(layers=None):
    import transformers as tf
    kw = dict(vocab_size=4096, hidden_size=256, intermediate_size=896, num_hidden_layers=layers or 2,
              num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=16384,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192})
    return tf.LlamaConfig, kw


def build(cls, kw, device, attn, torch):
    """The model in bf16 without a slow CPU initialization: built on the meta
    device (no memory, no init), materialized on the target device, parameters
    filled with small normal values there (norm weights 1: random but finite),
    the rotary module's fp32 buffers rebuilt from the config. If meta
    construction fails, it is built under the device context instead."""
    from transformers import AutoModelForCausalLM
    config = cls(**common.fix_legacy_config(cls, kw))
    t0 = time.time()

    def construct(dev):
        with torch.device(dev):
            try:
                return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
            except (ValueError, ImportError):
                return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="eager")

    try:
        model = construct("meta").to_empty(device=device)
        how = "meta, materialized on %s" % device
        for name, m in list(model.named_modules()):
            if name.endswith("rotary_emb"):  # non-persistent fp32 buffers: recompute them
                fresh = type(m)(config=m.config)
                for bname, buf in fresh.named_buffers(recurse=False):
                    getattr(m, bname).copy_(buf.to(device))
                if hasattr(fresh, "attention_scaling"):
                    m.attention_scaling = fresh.attention_scaling
    except Exception as e:  # noqa: BLE001 — any failure: the plain way
        print("meta construction failed (%s: %s); building on %s" % (type(e).__name__, e, device))
        model = construct(device)
        how = "on %s" % device
    # never .to(dtype): it would round inv_freq to bf16
    model = model.to(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(1.0) if "norm" in name else p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=gen)
    common.sync(device)
    common.check_rope_buffers(model)
    n = sum(p.numel() for p in model.parameters())
    print("model: %s, %.2fB parameters, bf16, %s attention, built (%s) in %.1f s" % (
        type(model).__name__, n / 1e9, model.config._attn_implementation, how, time.time() - t0), flush=True)
    return model


class Bench:
    def __init__(self, args, torch, kvi, model, device):
        self.args, self.torch, self.kvi, self.model, self.device = args, torch, kvi, model, device
        self.config = model.config
        self.L = self.config.num_hidden_layers
        self.H = common.kv_heads_of(self.config)
        self.D = common.head_dim_of(self.config)
        self.T = args.fact_tokens
        self.stream = common.kvi_stream(device)
        self.gen = torch.Generator(device="cpu").manual_seed(args.seed)
        V = self.config.vocab_size
        self.header_ids = torch.randint(0, V, (1, args.header), generator=self.gen).to(device)
        self.question_ids = torch.randint(0, V, (1, args.question), generator=self.gen).to(device)
        self.fact_token_ids = torch.randint(0, V, (args.facts, self.T), generator=self.gen).to(device)
        self._fill_stores()
        self._rope_tables()

    # ---------------------------------------------------------------- setup
    def _fill_stores(self):
        """The same facts twice: in a kvinject Store (pages, one tenant, with
        embeddings) and as the paper keeps them (a [2, T, H, D] tensor per fact
        and layer; here views of one pool)."""
        torch, kvi, a = self.torch, self.kvi, self.args
        t0 = time.time()
        g = torch.Generator(device=self.device).manual_seed(1)
        # [facts, layers, K/V, T, H, D], pre-RoPE K and V of small magnitude
        self.pool = torch.empty((a.facts, self.L, 2, self.T, self.H, self.D), dtype=torch.bfloat16,
                                device=self.device)
        self.pool.normal_(0.0, 0.5, generator=g)
        self.emb = torch.randn((a.facts, a.embedding_dim), generator=g, device=self.device)
        km = common.kvi_model_for(self.config)
        per_token = self.L * self.H * self.D * 2 * 2
        page = 16
        budget = a.facts * (-(-self.T // page) * page) * per_token + (64 << 20)
        self.store = kvi.Store(km, budget, backend=common.kvi_backend(self.device), dtype=kvi.DType.BF16,
                               page_tokens=page, embedding_dim=a.embedding_dim)
        for f in range(a.facts):
            self.store.put(TENANT, f, self.pool[f, :, 0], self.pool[f, :, 1], embedding=self.emb[f],
                           stream=self.stream)
        common.sync(self.device)
        # the paper's store: one tensor per fact per layer
        self.paper_store = {f: [self.pool[f, l] for l in range(self.L)] for f in range(a.facts)}
        self.kv_bytes_per_token = per_token
        print("stores: %d facts of %d tokens (%.2f GiB of KV each way) in %.1f s" % (
            a.facts, self.T, a.facts * self.T * per_token / 2 ** 30, time.time() - t0), flush=True)

    def _rope_tables(self):
        """cos/sin for every position, from the model's own rotary module, cast to
        bf16 (what InferScale does)."""
        torch = self.torch
        rot = self.model.model.rotary_emb
        n = self.args.header + 64 * self.T + self.args.question + 64
        pos = torch.arange(n, device=self.device).unsqueeze(0)
        dummy = torch.zeros((1, n, self.D), dtype=torch.bfloat16, device=self.device)
        cos, sin = rot(dummy, pos)
        self.cos, self.sin = cos[0].to(torch.bfloat16), sin[0].to(torch.bfloat16)  # [n, D]

    def cache(self, batch, k):
        """A StaticCache for `batch` requests of k facts, the header prefilled in every
        row (done once: what an engine's prefix cache holds), with the layout an
        injector writes into."""
        a = self.args
        cache = common.static_cache(self.model, a.header + k * self.T + a.question)
        self.model(self.header_ids.expand(batch, -1), past_key_values=cache, use_cache=True)
        keys, values = common.cache_tensors(cache)
        inj = self.kvi.Injector(self.store, self.kvi.CacheLayout.hf(keys, values))
        common.sync(self.device)
        return cache, inj

    # -------------------------------------------------------------- methods
    def queries(self, batch):
        return self.torch.randn((batch, self.args.embedding_dim), generator=None, device=self.device)

    def first_token(self, out):
        return out.logits[:, -1].argmax(-1)

    def reprefill(self, q, k, timer):
        """Search (the library's, so every method pastes the same facts), then a
        prefill of [header | facts | question] for each request."""
        torch = self.torch
        timer.mark()
        ids = self.search(q, k)
        timer.mark()
        if k:
            facts = self.fact_token_ids[torch.tensor(ids, device=self.device)].reshape(len(ids), -1)
        else:
            facts = self.fact_token_ids[:0].reshape(len(ids), 0)
        B = len(ids)
        prompt = torch.cat([self.header_ids.expand(B, -1), facts, self.question_ids.expand(B, -1)], 1)
        timer.mark()
        out = self.model(prompt, use_cache=True, logits_to_keep=1)
        tok = self.first_token(out)
        timer.mark()
        return tok

    def search(self, q, k):
        if k == 0:
            return [[] for _ in range(q.shape[0])]
        res = self.store.search(q, TENANT, k, stream=self.stream)
        return [[f for f, _ in reversed(r)] for r in res]  # best fact last, next to the question

    def kvinject(self, q, k, cache, inj, timer):
        a, kvi = self.args, self.kvi
        timer.mark()
        ids = self.search(q, k)
        timer.mark()
        if k:
            inj.inject([kvi.InjectRequest(TENANT, r, block_table=[b], first_slot=a.header, start_position=a.header)
                        for b, r in enumerate(ids)], stream=self.stream)
        timer.mark()
        return self.question(cache, k, len(ids), timer)

    def question(self, cache, k, B, timer):
        common.set_cache_length(cache, self.args.header + k * self.T)
        out = self.model(self.question_ids.expand(B, -1), past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = self.first_token(out)
        timer.mark()
        return tok

    def paper(self, q, k, cache, timer):
        torch, a = self.torch, self.args
        timer.mark()
        if k:
            scores = q @ self.emb.T
            top = scores.topk(k, dim=1).indices.flip(1).tolist()  # best last; .tolist() synchronizes
        else:
            top = [[] for _ in range(q.shape[0])]
        timer.mark()
        if k:
            keys, values = common.cache_tensors(cache)
            h, M = a.header, k * self.T
            cos, sin = self.cos[h:h + M, None, :], self.sin[h:h + M, None, :]
            half = self.D // 2
            for b, r in enumerate(top):
                for l in range(self.L):
                    chunks = [self.paper_store[f][l] for f in r]
                    kk = torch.cat([c[0] for c in chunks], 0)  # [M, H, D] pre-RoPE
                    vv = torch.cat([c[1] for c in chunks], 0)
                    rot = torch.cat((-kk[..., half:], kk[..., :half]), -1)
                    kk = kk * cos + rot * sin
                    keys[l][b, :, h:h + M] = kk.transpose(0, 1)
                    values[l][b, :, h:h + M] = vv.transpose(0, 1)
        timer.mark()
        return self.question(cache, k, len(top), timer)

    # ------------------------------------------------------------- checking
    def cross_check(self, k=5):
        """The libkvinject path and the paper's torch path must write the same KV
        for the same facts (V bit for bit; K to bf16 rounding: torch rotates in
        bf16 with bf16 cos/sin, the library in fp32)."""
        torch, a = self.torch, self.args
        q = self.queries(1)
        c1, inj = self.cache(1, k)
        c2, _ = self.cache(1, k)
        t = common.Timer(self.device)
        self.kvinject(q, k, c1, inj, t)
        self.paper(q, k, c2, t)
        k1, v1 = common.cache_tensors(c1)
        k2, v2 = common.cache_tensors(c2)
        h, M = a.header, k * self.T
        kd = max(float((x[:, :, h:h + M].float() - y[:, :, h:h + M].float()).abs().max()) for x, y in zip(k1, k2))
        km = max(float(x[:, :, h:h + M].float().abs().max()) for x in k1)
        vsame = all(torch.equal(x[:, :, h:h + M], y[:, :, h:h + M]) for x, y in zip(v1, v2))
        ok = vsame and kd <= 2 ** -6 * km
        print("cross-check (k = %d): V identical: %s; K max |diff| %.3g of max |K| %.3g: %s" % (
            k, vsame, kd, km, "ok" if ok else "MISMATCH"), flush=True)
        merr = common.rope_mapping_error(self.model, common.kvi_model_for(self.config))
        print("RoPE: the library's spec from the config against the model's rotary module: max |cos/sin "
              "difference| %.2e: %s" % (merr, "ok" if merr <= 1e-4 else "MISMATCH"), flush=True)
        return ok and merr <= 1e-4

    # -------------------------------------------------------------- running
    def measure(self, fn, runs, warmup):
        """Medians of each stage (ms) over `runs` timed calls after `warmup`."""
        stages = None
        for i in range(warmup + runs):
            t = common.Timer(self.device)
            fn(t)
            m = t.marks()
            if i >= warmup:
                d = [b - a for a, b in zip(m, m[1:])]
                stages = [[] for _ in d] if stages is None else stages
                for j, x in enumerate(d):
                    stages[j].append(x)
        return [common.median(s) for s in stages]


def main(argv=None):
    args = parse_args(argv)
    torch, transformers = common.need_torch_transformers()
    kvi = common.need_kvinject()
    device = common.pick_device(args.device, torch, kvi)
    if args.model is None:
        args.model = "llama8b" if device.startswith("cuda") else "tiny"
    torch.set_grad_enabled(False)
    t_start = time.time()
    common.banner("Time to first token with Hugging Face transformers", device, args)
    cls, kw = (llama8b_config if args.model == "llama8b" else tiny_config)(args.layers)
    model = build(cls, kw, device, args.attn, torch)
    b = Bench(args, torch, kvi, model, device)
    ok = b.cross_check()
    ks = [int(x) for x in args.ks.split(",")]

    # ---- TTFT at batch 1
    ttft = {}
    stages = {}
    for k in ks:
        cache, inj = b.cache(1, k)
        cache2, _ = b.cache(1, k)
        q = b.queries(1)
        s_re = b.measure(lambda t: b.reprefill(q, k, t), args.runs, args.warmup)
        s_kv = b.measure(lambda t: b.kvinject(q, k, cache, inj, t), args.runs, args.warmup)
        s_pp = b.measure(lambda t: b.paper(q, k, cache2, t), args.runs, args.warmup)
        # re-prefill's search is the library's (same facts); TTFT counts it too
        stages[k] = {"re-prefill": s_re, "libkvinject": s_kv, "paper (torch)": s_pp}
        ttft[k] = {m: sum(s) for m, s in stages[k].items()}
        print("k = %2d: TTFT ms re-prefill %.2f, libkvinject %.2f, paper %.2f" % (
            k, ttft[k]["re-prefill"], ttft[k]["libkvinject"], ttft[k]["paper (torch)"]), flush=True)
        del cache, cache2, inj
    methods = ["re-prefill", "libkvinject", "paper (torch)"]

    # ---- batched throughput at k = 50
    kmax = 50 if 50 in ks else max(ks)
    thr = {}
    for B in [int(x) for x in args.batches.split(",")]:
        cache, inj = b.cache(B, kmax)
        cache2, _ = b.cache(B, kmax)
        q = b.queries(B)
        res = {}
        for m, fn in (("re-prefill", lambda t: b.reprefill(q, kmax, t)),
                      ("libkvinject", lambda t: b.kvinject(q, kmax, cache, inj, t)),
                      ("paper (torch)", lambda t: b.paper(q, kmax, cache2, t))):
            s = b.measure(fn, args.batch_runs, 1)
            res[m] = sum(s)
        thr[B] = res
        print("batch %d at k = %d: ms per batch %s" % (B, kmax, {m: round(v, 2) for m, v in res.items()}), flush=True)
        del cache, cache2, inj
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    # ---- tables
    a = args
    print()
    print("### TTFT, batch 1 (ms, median of %d runs after %d warm-up)\n" % (a.runs, a.warmup))
    print("Header %d tokens (its KV in the cache already), facts of %d tokens, question %d tokens; one tenant "
          "with %d facts, %d-dim embeddings. TTFT = search + (paste | inject | compose) + prefill + argmax.\n"
          % (a.header, a.fact_tokens, a.question, a.facts, a.embedding_dim))
    rows = []
    for k in ks:
        t = ttft[k]
        red = 1 - t["libkvinject"] / t["re-prefill"]
        rows.append([k, a.header + k * a.fact_tokens + a.question, "%.2f" % t["re-prefill"],
                     "%.2f" % t["libkvinject"], "%.2f" % t["paper (torch)"], "%.0f%%" % (100 * red)])
    print(common.table(["k", "prompt tokens", "re-prefill", "libkvinject", "paper (torch)",
                   "libkvinject TTFT reduction"], rows))
    print()
    print("### Stages, batch 1 (ms, medians)\n")
    rows = []
    for k in ks:
        s = stages[k]
        re_, kv, pp = s["re-prefill"], s["libkvinject"], s["paper (torch)"]
        inj_bytes = 2 * k * a.fact_tokens * b.kv_bytes_per_token  # read from the store + write to the cache
        rows.append([k, "re-prefill", "%.3f" % re_[0], "%.3f (paste ids)" % re_[1], "%.2f" % re_[2],
                     "%.2f" % sum(re_)])
        rate = " (%.3g GB/s)" % (inj_bytes / kv[1] / 1e6) if k and kv[1] > 0 else ""
        rows.append([k, "libkvinject", "%.3f" % kv[0], "%.3f%s" % (kv[1], rate), "%.2f" % kv[2], "%.2f" % sum(kv)])
        rows.append([k, "paper (torch)", "%.3f" % pp[0], "%.3f" % pp[1], "%.2f" % pp[2], "%.2f" % sum(pp)])
    print(common.table(["k", "method", "search", "inject / compose", "prefill + first token", "TTFT"], rows))
    print()
    print("### Summary\n")
    rows = []
    for m in methods:
        sl = common.slope(ks, [ttft[k][m] for k in ks])
        rows.append([m, "%.3f" % sl, "%.2f" % ttft[kmax][m],
                     "%.2fx" % (ttft[kmax]["re-prefill"] / ttft[kmax][m])])
    print(common.table(["method", "marginal TTFT per fact (ms, least squares over k)", "TTFT at k = %d (ms)" % kmax,
                   "speed-up over re-prefill"], rows))
    red = 1 - ttft[kmax]["libkvinject"] / ttft[kmax]["re-prefill"]
    kv = stages[kmax]["libkvinject"]
    print("\nTTFT reduction at k = %d: %.0f%% (libkvinject), %.0f%% (paper). Of libkvinject's %.2f ms, search "
          "%.3f, inject %.3f and the question's prefill %.2f: the HF forward of %d tokens is the floor." % (
              kmax, 100 * red, 100 * (1 - ttft[kmax]["paper (torch)"] / ttft[kmax]["re-prefill"]),
              sum(kv), kv[0], kv[1], kv[2], a.question))
    print()
    print("### Batched throughput at k = %d (requests/s; one batched search, injection and forward per batch; "
          "median of %d)\n" % (kmax, a.batch_runs))
    rows = []
    for B, res in thr.items():
        rows.append([B] + ["%.1f (%.1f ms)" % (B / (res[m] / 1e3), res[m]) for m in methods])
    print(common.table(["concurrent requests"] + methods, rows))
    print("\nspeed: %s (%.0f s)" % ("ok" if ok else "CROSS-CHECK FAILED", time.time() - t_start))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
