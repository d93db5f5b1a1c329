"""The connector on the real vLLM engine (CPU build) with a real model
(SmolLM2-135M-Instruct), against plain vLLM without the connector.

    launch.py test_connector.py [--keep DIR]

First plain vLLM (baseline.py, a process of its own) prefills every full
prompt; then one engine with the connector serves, in order:

 exact      facts captured by the connector from vLLM's own prefill of the full
            prompt, served by injection: greedy tokens and the top-20 logprobs
            of every step equal plain vLLM's (bit for bit), num_cached_tokens =
            the injected tokens;
 tenants    8 requests of 4 tenants (same fact ids, other contents) in one
            batch: each equals plain vLLM on its own full prompt, and the step
            injected all 8 with one kvi_inject;
 controls   zeros and wrong RoPE (keys 7 positions off) change the output;
            facts computed by Hugging Face transformers (another engine) are
            reported and must beat zeros;
 shifted    facts captured in other conversations at other positions: token
            agreement and first-token KL against re-prefill (reported; must
            beat zeros);
 isolation  an injected request's blocks (zeros) are never reused by a plain
            request of the same tokens, nor by another tenant, in either
            direction; a control shows the prefix cache does reuse plain blocks;
 bad        unknown fact, another tenant's fact, a span longer than its fact,
            facts filling the prompt, malformed parameters: each fails alone
            (finish reason "error", a logged message) in a batch with a good
            request, which is served; the engine serves after;
 overhead   the connector's host time per step for 1 and 64 injected requests.
Exit 0 when every check passes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import common as C

failures = []


def check(name, ok, detail=""):
    C.log("%s %s%s" % ("PASS" if ok else "FAIL", name, (": " + detail) if detail else ""))
    if not ok:
        failures.append(name)


def fix(rec):
    rec["logprobs"] = [{int(k): v for k, v in s.items()} for s in rec["logprobs"]]
    return rec


def same(ref, rec):
    """Identical greedy tokens and, at every step, identical top-20 logprobs."""
    return rec["tokens"] == ref["tokens"] and rec["logprobs"] == ref["logprobs"]


def diff(ref, rec):
    lr, lt = C.chosen_logprobs(ref), C.chosen_logprobs(rec)
    d = max((abs(a - b) for a, b in zip(lr, lt)), default=float("nan"))
    return "tokens %s vs %s, max |dlogprob| %.3g" % (rec["tokens"], ref["tokens"], d)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="keep the work directory (baseline, events, store file) here")
    ap.add_argument("--layerwise", action="store_true",
                    help="the connector injects layer by layer; only the capture, exact and tenants checks")
    args = ap.parse_args(argv)
    work = args.keep or tempfile.mkdtemp(prefix="kvi-vllm-")
    os.makedirs(work, exist_ok=True)
    t_start = time.time()

    base_json = os.path.join(work, "baseline.json")
    r = subprocess.run([sys.executable, os.path.join(C.HERE, "baseline.py"), base_json])
    if r.returncode != 0:
        C.log("FAIL baseline.py exited %d" % r.returncode)
        return 1
    base = C.load_json(base_json)
    ref = {k: fix(v) for k, v in base["outputs"].items()}
    ref8 = [fix(v) for v in base["batch8"]]
    t_base = time.time() - t_start

    import vllm
    from transformers import AutoTokenizer
    import hf_facts
    from kvinject.vllm import Keep, capture_prompt, kv_transfer_config, memory_prompt

    tok = AutoTokenizer.from_pretrained(C.MODEL)
    sc = C.Scenario(tok)
    for name, ids in sc.baseline_prompts().items():
        assert base["prompts"][name] == ids, "the baseline saw other prompts (%s)" % name
    store_path = os.path.join(work, "facts.kvi")
    if os.path.exists(store_path):
        os.remove(store_path)
    hf_facts.make_store_file(store_path, sc)
    ev_path = os.path.join(work, "events")
    for suffix in (".worker0.jsonl", ".scheduler.jsonl"):
        if os.path.exists(ev_path + suffix):
            os.remove(ev_path + suffix)
    ktc = kv_transfer_config(store_dtype="fp32", store_budget_mb=256, store_path=store_path, events_path=ev_path,
                             layerwise=args.layerwise)
    t0 = time.time()
    llm = vllm.LLM(enable_prefix_caching=True, kv_transfer_config=ktc, **C.ENGINE)
    C.log("engine with the connector up in %.0f s" % (time.time() - t0))
    worker_events = lambda: C.events(ev_path + ".worker0.jsonl")  # noqa: E731

    def run(prompts, n=C.MAX_TOKENS):
        return C.generate(llm, vllm, prompts, n)

    facts = lambda t: list(zip([C.HEADER_ID] + C.FACT_IDS, [sc.header] + sc.facts[t]))  # noqa: E731
    claim = len(sc.header) + sum(len(f) for f in sc.facts[1])

    # ---- plain requests through the connector's engine equal plain vLLM
    recs = run([sc.full_prompt(1, 0)])
    check("plain request with the connector loaded equals plain vLLM", same(ref["t1_q0"], recs[0]),
          diff(ref["t1_q0"], recs[0]))

    # ---- capture: every tenant's header and facts from vLLM's own prefill, one batch
    caps = [capture_prompt(t, [Keep(C.HEADER_ID, sc.header)] + [Keep(f, s) for f, s in zip(C.FACT_IDS, sc.facts[t])]
                           + [sc.questions[0]]) for t in C.TENANT_FACTS]
    run(caps, n=1)
    ev = [e for e in worker_events() if e["event"] == "capture"]
    check("captures: 16 facts of 4 tenants stored by one kvi_encode",
          bool(ev) and ev[-1]["captures"] == 16 and ev[-1]["stored"] == 16, str(ev[-1:]))

    # ---- (1) exact context
    mp = memory_prompt(1, facts(1), sc.questions[0])
    assert mp.prompt_token_ids == sc.full_prompt(1, 0)
    rec = run([mp])[0]
    check("exact: injected facts give plain vLLM's greedy tokens and logprobs", same(ref["t1_q0"], rec),
          diff(ref["t1_q0"], rec))
    check("exact: vLLM reports the injected tokens as cached (%d)" % claim, rec["cached"] == claim,
          "num_cached_tokens %s" % rec["cached"])
    C.log("  exact: %r" % rec["text"])

    # ---- (4) 8 requests of 4 tenants in one batch
    n_inject = len([e for e in worker_events() if e["event"] == "inject"])
    batch = sc.batch8()
    recs = run([memory_prompt(t, facts(t), sc.questions[q]) for t, q in batch])
    bad = ["t%d_q%d (%s)" % (t, q, diff(r8, r_)) for (t, q), r8, r_ in zip(batch, ref8, recs) if not same(r8, r_)]
    check("tenants: 8 requests of 4 tenants in one batch each equal plain vLLM's batch of their full prompts",
          not bad, "; ".join(bad))
    inj = [e for e in worker_events() if e["event"] == "inject"][n_inject:]
    check("tenants: one kvi_inject for the 8 requests", bool(inj) and inj[0]["requests"] == 8,
          "inject steps %s" % [(e["requests"], e["facts"]) for e in inj])
    check("tenants: answers differ between tenants", len({tuple(r_["tokens"]) for r_ in recs}) >= 4)
    for (t, q), r_ in zip(batch, recs):
        C.log("  tenant %d q%d: %r" % (t, q, r_["text"]))
    if args.layerwise:
        lw = [e for e in worker_events() if e["event"] == "inject_layers"]
        check("layerwise: every layer injected as vLLM reached it (30 per step)",
              bool(lw) and all(e["layers"] == 30 for e in lw), str(lw[-2:]))
        return finish(args, work, t_start, t_base)

    # ---- (3) negative controls and another engine's facts
    recs = run([memory_prompt(tn, facts(1), sc.questions[0])
                for tn in (C.ZERO_TENANT, C.WRONG_ROPE_TENANT, C.HF_TENANT)])
    zero, wrong, hf = recs
    r0 = ref["t1_q0"]
    kl = lambda x: C.top_kl(r0["logprobs"][0], x["logprobs"][0])  # noqa: E731
    check("controls: zeros change the output", not same(r0, zero), "KL %.3g, %s" % (kl(zero), zero["text"]))
    check("controls: wrong RoPE changes the output", not same(r0, wrong), "KL %.3g, %s" % (kl(wrong), wrong["text"]))
    check("controls: zeros cost more than wrong RoPE (first-token KL)", kl(zero) > kl(wrong),
          "%.3g vs %.3g" % (kl(zero), kl(wrong)))
    C.log("  transformers' facts injected: %d/%d leading tokens agree, first-token KL %.3g (zeros %.3g)"
          % (C.agreement(r0, hf), len(r0["tokens"]), kl(hf), kl(zero)))
    check("controls: transformers' facts beat zeros", kl(hf) < kl(zero), "%.3g vs %.3g" % (kl(hf), kl(zero)))

    # ---- (2) shifted: tenant 5's facts (tenant 1's text) said in other conversations
    convs = []
    for i, conv in enumerate(sc.shifted):
        segs = [Keep(C.HEADER_ID, sc.header)] if i == 0 else [sc.header]
        for s in conv:
            segs.append(Keep(C.FACT_IDS[s[0] - 1], sc.facts[1][s[0] - 1]) if isinstance(s, tuple) else s)
        convs.append(capture_prompt(5, segs))
    run(convs, n=1)
    shifted = run([memory_prompt(5, facts(1), sc.questions[q]) for q in range(len(C.QUESTIONS))])
    for q, r_ in enumerate(shifted):
        rr = ref["t1_q%d" % q]
        C.log("  shifted q%d: %d/%d leading tokens agree with re-prefill, first-token KL %.3g: %r"
              % (q, C.agreement(rr, r_), len(rr["tokens"]), C.top_kl(rr["logprobs"][0], r_["logprobs"][0]),
                 r_["text"]))
    check("shifted: beats zeros (first-token KL)", kl(shifted[0]) < kl(zero), "%.3g vs %.3g"
          % (kl(shifted[0]), kl(zero)))

    # ---- (5) prefix-cache isolation (prompt whose blocks nobody has computed yet)
    iso_ids = sc.iso_prompt()
    iso_facts = list(zip([C.HEADER_ID] + C.ISO_IDS, [sc.header] + sc.iso_facts))
    iso_claim = sum(len(s) for _, s in iso_facts)
    full_blocks = (len(iso_ids) // C.BLOCK_SIZE) * C.BLOCK_SIZE
    riso = ref["iso"]
    z1 = run([memory_prompt(C.ZERO_TENANT, iso_facts, sc.iso_question)])[0]
    check("isolation: zeros injected (and cached as %d tokens)" % iso_claim,
          z1["cached"] == iso_claim and not same(riso, z1), "cached %s" % z1["cached"])
    p1 = run([iso_ids])[0]
    check("isolation: a plain request of the same tokens gets none of those blocks",
          p1["cached"] == 0 and same(riso, p1), "cached %s, %s" % (p1["cached"], diff(riso, p1)))
    p2 = run([iso_ids])[0]
    check("isolation control: the prefix cache does reuse plain blocks (%d tokens)" % full_blocks,
          p2["cached"] == full_blocks and same(riso, p2), "cached %s" % p2["cached"])
    run([capture_prompt(7, [Keep(C.HEADER_ID, sc.header)] + [Keep(f, s) for f, s in zip(C.ISO_IDS, sc.iso_facts)]
                        + [sc.iso_question])], n=1)
    t7 = run([memory_prompt(7, iso_facts, sc.iso_question)])[0]
    check("isolation: another tenant's injection is its own (exact facts: plain vLLM's output)",
          same(riso, t7) and t7["cached"] == iso_claim, "cached %s, %s" % (t7["cached"], diff(riso, t7)))
    z2 = run([memory_prompt(C.ZERO_TENANT, iso_facts, sc.iso_question)])[0]
    check("isolation: the zeros tenant again gets its own zeros, not the cached plain or tenant-7 blocks",
          same(z1, z2) and z2["cached"] == iso_claim, "cached %s, %s" % (z2["cached"], diff(z1, z2)))

    # ---- (6) bad requests, in one batch with a good one
    good = memory_prompt(2, facts(2), sc.questions[1])
    unknown = memory_prompt(1, [(C.HEADER_ID, sc.header), (12345, sc.facts[1][0])], sc.questions[0])
    other = memory_prompt(3, [(C.HEADER_ID, sc.header), (C.ISO_IDS[0], sc.iso_facts[0])], sc.questions[0])
    longer = memory_prompt(1, [(C.HEADER_ID, sc.header), (C.FACT_IDS[0], sc.facts[1][0] + [tok.eos_token_id])],
                           sc.questions[0])
    filled = memory_prompt(1, facts(1), [0])
    filled.params["inject"].append([C.FACT_IDS[0], len(filled.prompt_token_ids) - 1, 1])
    malformed = memory_prompt(1, facts(1), sc.questions[0])
    del malformed.params["tenant"]
    n_err = len([e for e in worker_events() if e["event"] == "request_error"])
    recs = run([good, unknown, other, longer, filled, malformed])
    check("bad: the good request of the batch is served exactly", same(ref["t2_q1"], recs[0]),
          diff(ref["t2_q1"], recs[0]))
    names = ["unknown fact", "another tenant's fact", "span longer than its fact", "facts fill the prompt",
             "no tenant"]
    for name, r_ in zip(names, recs[1:]):
        check("bad: %s fails that request" % name, r_["finish"] == "error" and not r_["tokens"],
              "finish %r, %d tokens" % (r_["finish"], len(r_["tokens"])))
    msgs = [e["message"] for e in worker_events() if e["event"] == "request_error"][n_err:]
    msgs += [e["message"] for e in C.events(ev_path + ".scheduler.jsonl") if e["event"] == "request_error"]
    for m in msgs:
        C.log("  error: %s" % m)
    for want in ("12345", "tokens", "need a tenant", "at least one prompt token"):
        check("bad: a message names %r" % want, any(want in m for m in msgs))
    after = run([memory_prompt(1, facts(1), sc.questions[1])])[0]
    check("bad: the engine serves after them", same(ref["t1_q1"], after), diff(ref["t1_q1"], after))

    # ---- overhead: host time of the connector per step, 1 and 64 requests
    for n in (1, 64):
        k = len([e for e in worker_events() if e["event"] == "inject"])
        run([memory_prompt(1 + i % 4, facts(1 + i % 4), sc.questions[i % 2]) for i in range(n)], n=1)
        inj = [e for e in worker_events() if e["event"] == "inject"][k:]
        sched = [e for e in C.events(ev_path + ".scheduler.jsonl") if e["event"] == "schedule"]
        big = max(inj, key=lambda e: e["requests"]) if inj else None
        if big:
            C.log("  overhead, %d requests in the step (%d facts, %d tokens): worker host %.0f us "
                  "(checks %.0f us, kvi_inject %.0f us); scheduler build_connector_meta %.0f us"
                  % (big["requests"], big["facts"], big["tokens"], big["host_us"], big["check_us"], big["kvi_us"],
                     max(sched, key=lambda e: e["injects"])["host_us"] if sched else float("nan")))
        check("overhead: %d requests injected in one step" % n, bool(big) and big["requests"] == n,
              str([e["requests"] for e in inj]))

    return finish(args, work, t_start, t_base)


def finish(args, work, t_start, t_base):
    C.log("baseline %.0f s, total %.0f s" % (t_base, time.time() - t_start))
    C.log("%d checks failed: %s" % (len(failures), ", ".join(failures)) if failures else "all checks passed")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
