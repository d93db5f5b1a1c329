"""``vllm serve`` with the connector's disk tier and hybrid serving (docs/guide/vllm.md,
"The disk tier and hybrid serving"): a replica whose store's memory (12 MiB: 17 pages of
SmolLM2-135M's fp32 K and V) holds about one user's memory (14 pages: a header and 12
facts), over a directory of tenant files.

1. Replica 1 (a fast disk: every disk-only fact is awaited): tenants A and B capture
   [header | 12 facts | question] (a plain prefill: the reference answer); B's capture
   drops most of A's facts to the disk; A's memory injected from the store, read back from
   its file, gives the reference's tokens.
2. Replica 2 on the same directory (a restarted or other replica; a slow disk: every
   disk-only fact is prefilled as text): A is a cold tenant, its request is prefilled as
   text (nothing injected) with the reference's tokens, and the whole tenant is prefetched
   from its file; a later request injects all 13 facts from memory, again with the
   reference's tokens.

The scheduler's event file records each request's decisions (inject, await, text).
Run through launch.py (the vLLM virtual environment); skips (77) without it.
"""
from __future__ import annotations

import json
import os
import time

import common as C
from servers import CPU_ARGS, start_vllm_serve

A, B = 21, 22
MAX_TOKENS = 8
FACT_IDS = list(range(1, 13))


def facts(sc):
    return [f for t in sorted(sc.facts) for f in sc.facts[t]]


def prompt_and_spans(sc):
    ids = list(sc.header)
    spans = [[C.HEADER_ID, 0, len(sc.header)]]
    for fid, f in zip(FACT_IDS, facts(sc)):
        spans.append([fid, len(ids), len(f)])
        ids += f
    return ids + sc.questions[0], spans


def start(work_dir, name, disk, **hybrid):
    cfg = dict({"store_budget_mb": 12, "store_dtype": "fp32", "disk_dir": disk,
                "events_path": os.path.join(work_dir, name), "disk_owner": name}, **hybrid)
    return start_vllm_serve(C.MODEL, None, cfg, CPU_ARGS, log_path=os.path.join(work_dir, name + ".log"),
                            env={"VLLM_CPU_ATTN_SPLIT_KV": "0"}, timeout=300)


def completion(srv, prompt, params):
    body = {"model": srv.model, "prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": 2, "temperature": 0.0,
            "return_token_ids": True, "kv_transfer_params": {"kvinject": params}}
    status, out = srv.request("POST", "/v1/completions", body)
    assert status == 200, out
    oc = out["kv_transfer_params"]["kvinject"]
    assert oc["errors"] == [] and not oc["pending"], oc
    return out["choices"][0]["token_ids"], out["choices"][0]["text"], oc


def decisions(work_dir, name):
    """The hybrid decisions of the scheduler's steps, in order."""
    with open(os.path.join(work_dir, name + ".scheduler.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    return [r["hybrid"] for r in recs if r.get("event") == "schedule" and r.get("hybrid")]


def test_a_store_over_its_disk_tier_and_a_cold_replica_answer_as_plain_prefill(work_dir, scenario):
    sc = scenario
    prompt, spans = prompt_and_spans(sc)
    disk = os.path.join(work_dir, "disk")
    os.makedirs(disk)
    capture = [{"fact_id": f, "start": a, "length": n} for f, a, n in spans]
    inject = {"tenant": A, "inject": spans}

    srv = start(work_dir, "r1", disk, disk_read_mb_s=1e7, prefill_tokens_s=1.0)
    try:
        ref, text, oc = completion(srv, prompt, {"tenant": A, "capture": capture})
        assert sorted(oc["captured"]) == sorted(f for f, _, _ in spans)
        C.log("reference (plain prefill):", repr(text))
        got, _, oc = completion(srv, prompt, {"tenant": B, "capture": capture})
        assert got == ref and len(oc["captured"]) == 13
        for t in (A, B):
            assert os.path.getsize(os.path.join(disk, "%016x.kvi" % t)) > 0
        got, _, oc = completion(srv, prompt, inject)
        assert got == ref, (got, ref)
        assert (oc["injected_facts"], oc["injected_tokens"]) == (13, spans[-1][1] + spans[-1][2])
        last = decisions(work_dir, "r1")[-1]
        C.log("replica 1, A injected:", last)
        assert last["await"] > 0 and last["text"] == 0 and last["inject"] + last["await"] == 13
    finally:
        srv.stop()

    srv = start(work_dir, "r2", disk, disk_read_mb_s=1e-6, prefill_tokens_s=1e9)
    try:
        got, _, oc = completion(srv, prompt, inject)
        assert got == ref and oc["injected_facts"] == 0
        assert decisions(work_dir, "r2")[-1] == {"text": 13}
        # the whole tenant was prefetched from A's file in the background: soon all injected
        for _ in range(20):
            got, _, oc = completion(srv, prompt, inject)
            assert got == ref, (got, ref)
            if oc["injected_facts"] == 13:
                break
            time.sleep(0.5)
        assert oc["injected_facts"] == 13, oc
        assert decisions(work_dir, "r2")[-1] == {"inject": 13, "await": 0, "text": 0}
    finally:
        srv.stop()
