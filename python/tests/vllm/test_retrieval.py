"""Requests whose facts are found by a query embedding and k (kvinject.vllm.MemoryIndex)
and served by the connector on the real vLLM engine (SmolLM2-135M-Instruct).

The connector keeps embeddings (embedding_dim) and journals its store to a file;
the test, as the client, opens that file with MemoryIndex while the worker holds
it, searches it, builds the prompts and submits them. Embeddings are a bag of
hashed words (deterministic), so the expected winners and the scores can be
computed independently here in float64.

Run through launch.py (the vLLM virtual environment); skips (77) without it.
One engine (the module's fixture) serves the tests in order: tenant 1's facts
captured, the index opened on the store file, each question's retrieval and
service, then tenant 2's facts captured and found after a refresh.
"""
from __future__ import annotations

import math
import os
import re
import zlib

import pytest

import common as C

DIM = 64


def embed(text):
    """Unit-length bag of words hashed into DIM buckets (float64)."""
    v = [0.0] * DIM
    for w in re.findall(r"[a-z]+", text.lower()):
        v[zlib.crc32(w.encode()) % DIM] += 1.0
    n = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / n for x in v]


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


@pytest.fixture(scope="module")
def engine(work_dir):
    return C.Engine(os.path.join(work_dir, "events"), store_dtype="fp32", store_budget_mb=64,
                    store_path=os.path.join(work_dir, "facts.kvi"), embedding_dim=DIM)


def capture(engine, sc, t):
    """The notes encoding: every fact after the header and the facts before it, one prompt."""
    from kvinject.vllm import Keep, notes_capture_prompts
    hdr = Keep(C.HEADER_ID, sc.header, embedding=embed(C.HEADER))
    facts = [Keep(f, s, embedding=embed(text)) for f, s, text in zip(C.FACT_IDS, sc.facts[t], C.TENANT_FACTS[t])]
    engine.run(notes_capture_prompts(t, hdr, facts, tail=sc.questions[0]), n=1)


@pytest.fixture(scope="module")
def refs(engine, scenario):
    """Tenant 1's facts captured; plain vLLM's outputs of its full prompts (the same engine)."""
    capture(engine, scenario, 1)
    return [engine.run([scenario.full_prompt(1, q)])[0] for q in range(len(C.QUESTIONS))]


@pytest.fixture(scope="module")
def index(refs, work_dir):
    from transformers import AutoConfig
    from kvinject.vllm import MemoryIndex
    idx = MemoryIndex(AutoConfig.from_pretrained(C.MODEL), os.path.join(work_dir, "facts.kvi"), embedding_dim=DIM)
    yield idx
    idx.close()


def want_of(q):
    """float64 reference: the facts of tenant 1 by score for question q, the header left out."""
    query = embed(C.QUESTIONS[q])
    return sorted(((dot(query, embed(f)), fid) for fid, f in zip(C.FACT_IDS, C.TENANT_FACTS[1])),
                  key=lambda x: (-x[0], x[1]))


def test_the_index_opens_the_store_file_the_worker_journals_to(index):
    assert index.store is not None and index.store.count(1) == 4, \
        "count %s" % (index.store.count(1) if index.store else None)


QS = range(len(C.QUESTIONS))


@pytest.mark.parametrize("q", QS)
def test_the_search_ranks_the_facts_as_the_float64_reference(index, scenario, q):
    tokens = dict(zip(C.FACT_IDS, scenario.facts[1]))
    want = want_of(q)
    got = index.retrieve(1, embed(C.QUESTIONS[q]), 3, exclude=[C.HEADER_ID])
    assert [g[0] for g in got] == [w[1] for w in want] and all(abs(g[2] - w[0]) < 1e-6 for g, w in zip(got, want)) \
        and all(g[1] == len(tokens[g[0]]) for g in got), "got %s, want %s" % (got, want)


@pytest.mark.parametrize("q", QS)
def test_retrieved_facts_in_said_order_are_served_as_the_full_prompt(index, engine, refs, scenario, q):
    # k = 3 in the conversation's order (the default; "id" names it too): the
    # prompt is the full prompt, served exactly; "rank" lays them out best first
    sc = scenario
    args = (1, embed(C.QUESTIONS[q]), 3, sc.questions[q])
    kw = dict(header=(C.HEADER_ID, sc.header), tokens=dict(zip(C.FACT_IDS, sc.facts[1])))
    mp = index.memory_prompt(*args, **kw)
    assert mp.prompt_token_ids == sc.full_prompt(1, q), "retrieved facts in said order rebuild the full prompt"
    assert index.memory_prompt(*args, order="id", **kw).prompt_token_ids == mp.prompt_token_ids
    ranked = index.memory_prompt(*args, order="rank", **kw)
    best = [w[1] for w in want_of(q)[:3]]
    want = list(sc.header) + [t for fid in best for t in sc.facts[1][C.FACT_IDS.index(fid)]]
    assert ranked.prompt_token_ids[:len(want)] == want and ranked.retrieved == mp.retrieved, "rank order: best first"
    rec = engine.run([mp])[0]
    claim = len(sc.full_prompt(1, q)) - len(sc.questions[q])
    C.log("  q%d k=3: %r" % (q, rec["text"]))
    ref = refs[q]
    assert rec["tokens"] == ref["tokens"] and rec["logprobs"] == ref["logprobs"] and rec["cached"] == claim, \
        "cached %s of %d, %d/%d tokens agree" % (rec["cached"], claim, C.agreement(ref, rec), len(ref["tokens"]))


@pytest.mark.parametrize("q", QS)
def test_k_1_injects_the_best_fact_and_is_served(index, engine, scenario, tokenizer, q):
    # no token table: the best fact alone behind the header, laid out with the
    # ids the store kept at its capture (a filler would be refused by the check)
    sc = scenario
    mp1 = index.memory_prompt(1, embed(C.QUESTIONS[q]), 1, sc.questions[q], header=(C.HEADER_ID, sc.header),
                              filler_token=tokenizer.eos_token_id)
    best = want_of(q)[0][1]
    best_ids = sc.facts[1][C.FACT_IDS.index(best)]
    assert mp1.prompt_token_ids[len(sc.header):len(sc.header) + len(best_ids)] == best_ids
    rec1 = engine.run([mp1])[0]
    C.log("  q%d k=1 (fact %d): %r" % (q, best, rec1["text"]))
    assert [r[0] for r in mp1.retrieved] == [best] and rec1["finish"] != "error" \
        and rec1["cached"] == len(sc.header) + len(sc.facts[1][C.FACT_IDS.index(best)]), \
        "retrieved %s, finish %s, cached %s" % (mp1.retrieved, rec1["finish"], rec1["cached"])


def test_facts_captured_after_the_index_opened_are_found_after_refresh(index, engine, scenario):
    before = index.retrieve(2, embed(C.QUESTIONS[1]), 1, exclude=[C.HEADER_ID])
    capture(engine, scenario, 2)
    changed = index.refresh()
    after = index.retrieve(2, embed(C.QUESTIONS[1]), 1, exclude=[C.HEADER_ID])
    assert before == [] and changed and [a[0] for a in after] == [2], "before %s, after %s" % (before, after)
    assert index.refresh() is False, "an unchanged file is reloaded"


def test_a_query_of_the_wrong_size_is_refused(index):
    from kvinject.errors import KviError
    with pytest.raises((KviError, ValueError)) as e:
        index.retrieve(1, embed("x")[:DIM - 1], 1)
    C.log("  error: %s" % e.value)


@pytest.mark.parametrize("name", ["k < 0", "an unknown order", "embedding_dim 0"])
def test_bad_arguments_are_refused(index, work_dir, name):
    from transformers import AutoConfig
    from kvinject.vllm import MemoryIndex
    fn = {"k < 0": lambda: index.retrieve(1, embed("x"), -1),
          "an unknown order": lambda: index.memory_prompt(1, embed("x"), 1, [1], order="score"),
          "embedding_dim 0": lambda: MemoryIndex(AutoConfig.from_pretrained(C.MODEL),
                                                 os.path.join(work_dir, "facts.kvi"), embedding_dim=0)}[name]
    with pytest.raises(ValueError):
        fn()


def test_a_tenant_without_facts_retrieves_nothing(index):
    assert index.retrieve(4242, embed("x"), 5) == []
