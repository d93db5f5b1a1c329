"""kvinject.recompute (selective recompute of injected facts) on the real
SmolLM2-135M-Instruct in transformers, fp32, against a re-prefill of
[header | facts | question]:

- every token recomputed (layers 0..1 fresh, then all tokens) gives the
  re-prefill's logits (fp32 rounding), and so does a boundary covering every
  fact (all tokens through every layer from their embeddings);
- recompute with nothing chosen and no fresh layers leaves plain injection's
  logits bit for bit;
- the library's deviation scores, after layer 0 is computed fresh, are ~0
  (layer 0's K and V depend on the token alone: the scores check the store's
  rotation at the request's positions against the model's), and at layer 1
  they are not;
- recomputing 30% of the tokens brings the first answer token closer to the
  re-prefill than plain injection (KL summed over the cases).

    launch.py test_recompute.py [--device cpu|cuda]

Run by launch.py in the vLLM environment (its torch and transformers, the
converted model in KVI_VLLM_MODEL).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import kvinject as kvi
from kvinject.hf import testing as R
from kvinject.hf.recompute import recompute

failures = []


def check(name, ok, detail=""):
    print("%s %s%s" % ("PASS" if ok else "FAIL", name, (": " + detail) if detail else ""), flush=True)
    if not ok:
        failures.append(name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    h = R.RecomputeHarness(os.environ["KVI_VLLM_MODEL"], args.device, torch.float32, kvi, torch)
    cases = R.make_cases(h.tok, 4, 2, seed=3)
    kl_inject = kl_blend = 0.0
    for ci, c in enumerate(cases):
        ref = h.reprefill(c)
        scale = float(ref.abs().max())
        full, plan, T = h.injected(c, 1, 1.0, 0)
        err = float((full - ref).abs().max())
        check("case %d: all tokens recomputed = re-prefill" % ci, err <= 1e-4 * scale and len(plan.chosen) == T,
              "max |logit diff| %.3g (logits up to %.3g), %d of %d tokens" % (err, scale, len(plan.chosen), T))
        bnd, plan, _ = h.injected(c, -1, 0.0, 1000)
        err = float((bnd - ref).abs().max())
        check("case %d: a boundary covering every fact = re-prefill" % ci, err <= 1e-4 * scale,
              "max |logit diff| %.3g" % err)
        plain, _, _ = h.injected(c, -1, 0.0, 0)
        none = nothing_recomputed(h, c)
        check("case %d: nothing recomputed = plain injection, bit for bit" % ci, torch.equal(none, plain))
        s0, s1, mag = deviation_scores(h, c)
        check("case %d: deviation at layer 0 after a fresh layer 0 is ~0" % ci, max(s0) <= 1e-8 * mag,
              "largest %.3g, |K|^2 + |V|^2 of a token up to %.3g" % (max(s0), mag))
        check("case %d: deviation at layer 1 after fresh layers 0..1 is not" % ci, max(s1) > 1e-4 * mag,
              "largest %.3g" % max(s1))
        blend, plan, _ = h.injected(c, 1, 0.3, 0)
        kl_inject += R.kl(ref, plain)
        kl_blend += R.kl(ref, blend)
    check("recomputing 30% of the tokens is closer to re-prefill than plain injection", kl_blend < kl_inject,
          "KL summed over the cases: %.4f recompute, %.4f injection" % (kl_blend, kl_inject))
    print("%d failure(s)" % len(failures))
    return 1 if failures else 0


def _injected_cache(h, c):
    hdr = c["header"]
    fids = [h.fact_id(f) for f in c["facts"]]
    allf = [t for f in c["facts"] for t in f]
    cache = R.static_cache(h.model, len(hdr) + len(allf) + len(c["question"]))
    h.model(torch.tensor([hdr], device=h.device), past_key_values=cache, use_cache=True)
    keys, values = R.cache_tensors(cache)
    inj = kvi.Injector(h.store, kvi.CacheLayout.hf(keys, values))
    req = kvi.InjectRequest(R.TENANT, fids, block_table=[0], first_slot=len(hdr), start_position=len(hdr))
    inj.inject(req, stream=h.stream)
    return cache, inj, req, allf


def nothing_recomputed(h, c):
    cache, inj, req, allf = _injected_cache(h, c)
    plan = recompute(h.model, cache, inj, req, allf, score_layer=-1, fraction=0.0, boundary=0)
    assert plan.chosen == []
    R.set_cache_length(cache, req.first_slot + len(allf))
    out = h.model(torch.tensor([c["question"]], device=h.device), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].double().cpu()


def deviation_scores(h, c):
    """Scores at layer 0 after layer 0 fresh, at layer 1 after layers 0..1 fresh,
    and the largest |K|^2 + |V|^2 of a fact token at layer 1."""
    out = []
    for layer in (0, 1):
        cache, inj, req, allf = _injected_cache(h, c)
        plan = recompute(h.model, cache, inj, req, allf, score_layer=layer, fraction=0.0)
        out.append(plan.scores)
    keys, values = R.cache_tensors(cache)
    s0, n = req.first_slot, len(allf)
    mag = float((keys[1][0, :, s0:s0 + n].double() ** 2).sum((0, 2)).max() +
                (values[1][0, :, s0:s0 + n].double() ** 2).sum((0, 2)).max())
    return out[0], out[1], mag


if __name__ == "__main__":
    sys.exit(main())
