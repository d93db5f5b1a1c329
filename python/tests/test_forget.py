#!/usr/bin/env python3
"""Deletes that forget, on a real model (SmolLM2-135M-Instruct, transformers, CPU,
fp32): facts captured with the notes encoding ([header | f1 | f2 | ...], each
fact after the header and the facts said before it) keep those facts as their
context (Capture.context_ids); removing fact j makes every later fact stale
(Store.stale), injections refuse them (StaleFactError) with the cache
unchanged, and after the later facts are encoded again (a prefill of the
header and the remaining facts, captured with replace=True):

- byte for byte, no stored fact's K and V equals K and V computed with fact j
  in context (the later facts as first captured), nor fact j's own;
- byte for byte, the re-encoded facts equal a fresh notes encoding of the
  remaining facts into a store of their own;
- none is stale, and injecting the remaining facts behind nothing gives the
  question's logits of a full prefill of [header | remaining facts | question]
  (relative error <= 1e-4).

A removal with keep_dependents=True makes nothing stale. Runs in the
environment .ci/install-vllm builds: ``python3 python/tests/vllm/launch.py
../test_forget.py``; skips (77) without torch, transformers or the model
(KVI_VLLM_MODEL).
"""
from __future__ import annotations

import os
import sys

import pytest

try:
    import torch
    import transformers
except ImportError as e:  # pragma: no cover
    if __name__ == "__main__":
        print("skipped: %s (test_forget needs torch and transformers)" % e)
        sys.exit(77)
    pytest.skip("test_forget needs torch and transformers: %s" % e, allow_module_level=True)

import kvi_testutil  # noqa: E402
import kvinject as kvi  # noqa: E402
from kvinject import hf as khf  # noqa: E402

TENANT = 5
HEADER_ID = 0
HEADER = "<|im_start|>system\nYou answer from the notes below.<|im_end|>\n<|im_start|>user\nNotes: "
FACTS = [" Anna lives in Oslo and works at the harbour office.", " Ben's cat is called Pixel.",
         " The ferry to the island leaves at 7:40 from pier 3.", " Carla plays the cello on Thursdays.",
         " The museum is closed on Mondays.", " Dev's bike is red with a bent wheel."]
QUESTION = " Question: where does the ferry leave from?<|im_end|>\n<|im_start|>assistant\nFrom"
DELETED = 3  # fact ids are 1..len(FACTS), in the order said
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="module")
def lm():
    path = os.environ.get("KVI_VLLM_MODEL", "/var/cache/kvinject/vllm/model/SmolLM2-135M-Instruct")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        pytest.skip("no SmolLM2-135M-Instruct at %s (.ci/install-vllm converts it)" % path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    km = khf.kvi_model_for(model.config)
    yield tok, model, km
    km.close()


def toks(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def new_store(km, closing):
    s = kvi.Store(km, 64 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32)
    closing.append(s)
    return s


def notes_encode(model, store, header, facts, *, replace=False, only=None):
    """The notes encoding of ``facts`` ((fact id, tokens), in order) after ``header``:
    one prefill of [header | f1 | f2 | ...], each span captured as its fact with the
    header and the facts before it as its context (the header too, as fact 0). only:
    the fact ids to capture (None: the header and every fact)."""
    ids, spans, pos = list(header), [(HEADER_ID, 0, len(header))], len(header)
    for fid, t in facts:
        spans.append((fid, pos, len(t)))
        ids += t
        pos += len(t)
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    enc = kvi.Encoder(store, kvi.CacheLayout.hf(out.past_key_values))
    try:
        caps = []
        for i, (fid, a, n) in enumerate(spans):
            if only is None or fid in only:
                caps.append(kvi.Capture(TENANT, fid, block_table=[0], num_tokens=n, first_slot=a, start_position=a,
                                        replace=replace, context_ids=[s[0] for s in spans[:i]]))
        enc.encode(caps)
    finally:
        enc.close()


def kv_bytes(store, fid):
    k, v = store.read(TENANT, fid)
    return bytes(k) + bytes(v)


def question_logits(model, store, closing, header, facts, question):
    """The question's logits after the header and the facts are injected into an empty StaticCache."""
    ids = list(header) + [t for _, f in facts for t in f] + list(question)
    cache = transformers.StaticCache(config=model.config, max_cache_len=len(ids))
    inj = khf.StaticCacheInjector(store, cache, dtype=torch.float32, device="cpu")
    closing.append(inj)
    n = inj.inject(TENANT, [HEADER_ID] + [fid for fid, _ in facts])
    assert n == len(ids) - len(question)
    with torch.no_grad():
        return model(torch.tensor([ids[n:]]), past_key_values=cache, use_cache=True).logits[0]


def test_delete_forgets_by_construction(lm, closing):
    tok, model, km = lm
    header = toks(tok, HEADER)
    facts = [(i + 1, toks(tok, f)) for i, f in enumerate(FACTS)]
    later = [fid for fid, _ in facts if fid > DELETED]
    store = new_store(km, closing)
    notes_encode(model, store, header, facts)
    assert store.fact_context(TENANT, 4) == ([0, 1, 2, 3], False)
    # what was computed with the deleted fact in context, and the deleted fact itself
    tainted = {fid: kv_bytes(store, fid) for fid in later + [DELETED]}

    store.remove(TENANT, DELETED)
    assert store.stale(TENANT) == later
    for fid in later:
        assert store.fact_context(TENANT, fid)[1] is True
    cache = transformers.StaticCache(config=model.config, max_cache_len=512)
    with torch.no_grad():  # allocates the cache's tensors
        model(torch.tensor([header]), past_key_values=cache, use_cache=True)
    inj = khf.StaticCacheInjector(store, cache)
    closing.append(inj)
    before = [t.clone() for ts in khf.cache_tensors(cache) for t in ts]
    with pytest.raises(kvi.StaleFactError, match="fact %d of tenant %d is stale" % (later[0], TENANT)):
        inj.inject(TENANT, [HEADER_ID, 1, later[0]])
    after = [t for ts in khf.cache_tensors(cache) for t in ts]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a refused injection wrote"
    assert inj.length == len(header)

    # encode the later facts again: a prefill of the header and the remaining facts
    remaining = [(fid, t) for fid, t in facts if fid != DELETED]
    notes_encode(model, store, header, remaining, replace=True, only=set(later))
    assert store.stale(TENANT) == []
    assert store.fact_context(TENANT, later[0]) == ([0] + [f for f, _ in remaining if f < later[0]], False)

    # byte for byte: nothing stored is what was computed with the deleted fact in context
    stored = {fid: kv_bytes(store, fid) for fid in store.list(TENANT)}
    assert sorted(stored) == [HEADER_ID] + [f for f, _ in remaining]
    for fid, b in stored.items():
        for gone, t in tainted.items():
            assert b != t, "fact %d's K and V equal fact %d's as computed with fact %d in context" % (
                fid, gone, DELETED)
    # byte for byte: the re-encoded facts are a fresh notes encoding of the remaining facts
    fresh = new_store(km, closing)
    notes_encode(model, fresh, header, remaining)
    for fid in later:
        assert stored[fid] == kv_bytes(fresh, fid), "re-encoded fact %d differs from a fresh encoding" % fid
        assert store.fact_context(TENANT, fid) == fresh.fact_context(TENANT, fid)

    # served: the question after the remaining facts, as a full prefill computes it
    question = toks(tok, QUESTION)
    got = question_logits(model, store, closing, header, remaining, question)
    with torch.no_grad():
        ref = model(torch.tensor([header + [t for _, f in remaining for t in f] + question])).logits[0]
    ref = ref[-len(question):]
    err = ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    assert err < 1e-4, err


def test_keep_dependents_opts_out(lm, closing):
    tok, model, km = lm
    header = toks(tok, HEADER)
    facts = [(i + 1, toks(tok, f)) for i, f in enumerate(FACTS[:4])]
    store = new_store(km, closing)
    notes_encode(model, store, header, facts)
    kept = kv_bytes(store, 4)
    store.remove(TENANT, 2, keep_dependents=True)
    assert store.stale(TENANT) == []
    assert kv_bytes(store, 4) == kept  # computed with fact 2 in context, and kept as it was
    store.remove(TENANT, 1)
    assert store.stale(TENANT) == [3, 4]


if __name__ == "__main__":
    sys.exit(kvi_testutil.run_pytest(__file__, sys.argv[1:]))
