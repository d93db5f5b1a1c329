"""kvinject.hf.recompute (selective recompute of injected facts) on the real
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
converted model in KVI_VLLM_MODEL). The cases are computed once (the module's
fixture ``runs``); each test checks one property of one case.
"""
from __future__ import annotations

import os

import pytest
import torch

import kvinject as kvi
from kvinject.hf import testing as R
from kvinject.hf.recompute import recompute

N_CASES = 2


@pytest.fixture(scope="module")
def harness(request):
    torch.set_grad_enabled(False)
    return R.RecomputeHarness(os.environ["KVI_VLLM_MODEL"], request.config.getoption("--device"), torch.float32, kvi, torch)


@pytest.fixture(scope="module")
def runs(harness):
    """Per case: the re-prefill's logits and what each configuration gives."""
    h = harness
    cases = R.make_cases(h.tok, 4, N_CASES, seed=3)
    out = []
    for c in cases:
        o = {"ref": h.reprefill(c)}
        o["scale"] = float(o["ref"].abs().max())
        o["full"], plan, o["T"] = h.injected(c, 1, 1.0, 0)
        o["chosen"] = len(plan.chosen)
        o["bnd"], _, _ = h.injected(c, -1, 0.0, 1000)
        o["plain"], _, _ = h.injected(c, -1, 0.0, 0)
        o["none"] = nothing_recomputed(h, c)
        o["s0"], o["s1"], o["mag"] = deviation_scores(h, c)
        o["blend"], _, _ = h.injected(c, 1, 0.3, 0)
        out.append(o)
    return out


@pytest.mark.parametrize("ci", range(N_CASES))
def test_all_tokens_recomputed_equal_re_prefill(runs, ci):
    o = runs[ci]
    err = float((o["full"] - o["ref"]).abs().max())
    assert err <= 1e-4 * o["scale"] and o["chosen"] == o["T"], \
        "max |logit diff| %.3g (logits up to %.3g), %d of %d tokens" % (err, o["scale"], o["chosen"], o["T"])


@pytest.mark.parametrize("ci", range(N_CASES))
def test_a_boundary_covering_every_fact_equals_re_prefill(runs, ci):
    o = runs[ci]
    err = float((o["bnd"] - o["ref"]).abs().max())
    assert err <= 1e-4 * o["scale"], "max |logit diff| %.3g" % err


@pytest.mark.parametrize("ci", range(N_CASES))
def test_nothing_recomputed_equals_plain_injection_bit_for_bit(runs, ci):
    assert torch.equal(runs[ci]["none"], runs[ci]["plain"])


@pytest.mark.parametrize("ci", range(N_CASES))
def test_deviation_at_layer_0_after_a_fresh_layer_0_is_about_0(runs, ci):
    o = runs[ci]
    assert max(o["s0"]) <= 1e-8 * o["mag"], "largest %.3g, |K|^2 + |V|^2 of a token up to %.3g" % (max(o["s0"]),
                                                                                                  o["mag"])


@pytest.mark.parametrize("ci", range(N_CASES))
def test_deviation_at_layer_1_after_fresh_layers_0_1_is_not(runs, ci):
    o = runs[ci]
    assert max(o["s1"]) > 1e-4 * o["mag"], "largest %.3g" % max(o["s1"])


def test_recomputing_30_percent_of_the_tokens_is_closer_to_re_prefill_than_plain_injection(runs):
    kl_inject = sum(R.kl(o["ref"], o["plain"]) for o in runs)
    kl_blend = sum(R.kl(o["ref"], o["blend"]) for o in runs)
    assert kl_blend < kl_inject, "KL summed over the cases: %.4f recompute, %.4f injection" % (kl_blend, kl_inject)


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
