"""Requests whose facts are found by a query embedding and k (kvinject.vllm.MemoryIndex)
and served by the connector on the real vLLM engine (SmolLM2-135M-Instruct).

The connector keeps embeddings (embedding_dim) and journals its store to a file;
the test, as the client, opens that file with MemoryIndex while the worker holds
it, searches it, builds the prompts and submits them. Embeddings are a bag of
hashed words (deterministic), so the expected winners and the scores can be
computed independently here in float64.

Run through launch.py (the vLLM virtual environment); skips (77) without it.
"""
from __future__ import annotations

import math
import os
import re
import shutil
import sys
import tempfile
import time
import zlib

import common as C

DIM = 64
failures = []


def check(name, ok, detail=""):
    C.log("%s %s%s" % ("ok  " if ok else "FAIL", name, (": " + detail) if detail and not ok else ""))
    if not ok:
        failures.append(name)


def embed(text):
    """Unit-length bag of words hashed into DIM buckets (float64)."""
    v = [0.0] * DIM
    for w in re.findall(r"[a-z]+", text.lower()):
        v[zlib.crc32(w.encode()) % DIM] += 1.0
    n = math.sqrt(sum(x * x for x in v)) or 1.0
    return [x / n for x in v]


def dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def main():
    work = tempfile.mkdtemp(prefix="kvi-vllm-retrieval-")
    t_start = time.time()
    import vllm
    from transformers import AutoConfig, AutoTokenizer
    from kvinject.errors import KviError
    from kvinject.vllm import Keep, MemoryIndex, kv_transfer_config, notes_capture_prompts

    tok = AutoTokenizer.from_pretrained(C.MODEL)
    sc = C.Scenario(tok)
    store_path = os.path.join(work, "facts.kvi")
    ev_path = os.path.join(work, "events")
    ktc = kv_transfer_config(store_dtype="fp32", store_budget_mb=64, store_path=store_path, events_path=ev_path,
                             embedding_dim=DIM)
    llm = vllm.LLM(enable_prefix_caching=True, kv_transfer_config=ktc, **C.ENGINE)
    C.log("engine with the connector up in %.0f s" % (time.time() - t_start))

    def run(prompts, n=C.MAX_TOKENS):
        return C.generate(llm, vllm, prompts, n)

    def capture(t):  # the notes encoding: every fact after the header and the facts before it, one prompt
        hdr = Keep(C.HEADER_ID, sc.header, embedding=embed(C.HEADER))
        facts = [Keep(f, s, embedding=embed(text)) for f, s, text in zip(C.FACT_IDS, sc.facts[t], C.TENANT_FACTS[t])]
        run(notes_capture_prompts(t, hdr, facts, tail=sc.questions[0]), n=1)

    capture(1)
    refs = [run([sc.full_prompt(1, q)])[0] for q in range(len(C.QUESTIONS))]

    index = MemoryIndex(AutoConfig.from_pretrained(C.MODEL), store_path, embedding_dim=DIM)
    check("the index opens the store file the worker journals to", index.store is not None
          and index.store.count(1) == 4, "count %s" % (index.store.count(1) if index.store else None))
    tokens = dict(zip(C.FACT_IDS, sc.facts[1]))
    for q, text in enumerate(C.QUESTIONS):
        query = embed(text)
        # float64 reference: the facts of tenant 1 by score, the header left out
        want = sorted(((dot(query, embed(f)), fid) for fid, f in zip(C.FACT_IDS, C.TENANT_FACTS[1])),
                      key=lambda x: (-x[0], x[1]))
        got = index.retrieve(1, query, 3, exclude=[C.HEADER_ID])
        check("q%d: the search ranks the facts as the float64 reference" % q,
              [g[0] for g in got] == [w[1] for w in want]
              and all(abs(g[2] - w[0]) < 1e-6 for g, w in zip(got, want))
              and all(g[1] == len(tokens[g[0]]) for g in got),
              "got %s, want %s" % (got, want))
        # k = 3 in the conversation's order: the prompt is the full prompt, served exactly
        mp = index.memory_prompt(1, query, 3, sc.questions[q], header=(C.HEADER_ID, sc.header), tokens=tokens,
                                 order="id")
        check("q%d: retrieved facts in id order rebuild the full prompt" % q,
              mp.prompt_token_ids == sc.full_prompt(1, q))
        rec = run([mp])[0]
        claim = len(sc.full_prompt(1, q)) - len(sc.questions[q])
        check("q%d: served with the retrieved facts injected: plain vLLM's tokens and logprobs" % q,
              rec["tokens"] == refs[q]["tokens"] and rec["logprobs"] == refs[q]["logprobs"]
              and rec["cached"] == claim,
              "cached %s of %d, %d/%d tokens agree" % (rec["cached"], claim, C.agreement(refs[q], rec),
                                                      len(refs[q]["tokens"])))
        # k = 1, filler tokens: the best fact alone behind the header
        mp1 = index.memory_prompt(1, query, 1, sc.questions[q], header=(C.HEADER_ID, sc.header),
                                  filler_token=tok.eos_token_id)
        best = want[0][1]
        rec1 = run([mp1])[0]
        check("q%d: k = 1 injects the best fact (%d) and is served" % (q, best),
              [r[0] for r in mp1.retrieved] == [best] and rec1["finish"] != "error"
              and rec1["cached"] == len(sc.header) + len(tokens[best]),
              "retrieved %s, finish %s, cached %s" % (mp1.retrieved, rec1["finish"], rec1["cached"]))
        C.log("  q%d k=1 (fact %d): %r; k=3: %r" % (q, best, rec1["text"], rec["text"]))

    # facts captured after the index was opened are found once it refreshes
    before = index.retrieve(2, embed(C.QUESTIONS[1]), 1, exclude=[C.HEADER_ID])
    capture(2)
    changed = index.refresh()
    after = index.retrieve(2, embed(C.QUESTIONS[1]), 1, exclude=[C.HEADER_ID])
    check("refresh: tenant 2's facts, captured later, are found after refresh",
          before == [] and changed and [a[0] for a in after] == [2], "before %s, after %s" % (before, after))
    check("refresh: an unchanged file is not reloaded", index.refresh() is False)

    # bad input
    try:
        index.retrieve(1, embed("x")[:DIM - 1], 1)
        check("a query of the wrong size is refused", False)
    except (KviError, ValueError) as e:
        check("a query of the wrong size is refused", True)
        C.log("  error: %s" % e)
    for name, fn in (("k < 0", lambda: index.retrieve(1, embed("x"), -1)),
                     ("an unknown order", lambda: index.memory_prompt(1, embed("x"), 1, [1], order="score")),
                     ("embedding_dim 0", lambda: MemoryIndex(AutoConfig.from_pretrained(C.MODEL), store_path,
                                                             embedding_dim=0))):
        try:
            fn()
            check("%s is refused" % name, False)
        except ValueError:
            check("%s is refused" % name, True)
    check("a tenant without facts retrieves nothing", index.retrieve(4242, embed("x"), 5) == [])
    index.close()

    C.log("total %.0f s" % (time.time() - t_start))
    C.log("%d checks failed: %s" % (len(failures), ", ".join(failures)) if failures else "all checks passed")
    shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
