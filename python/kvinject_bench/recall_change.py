#!/usr/bin/env python3
"""Facts that change, on the recall benchmark's users (recall.py): does a fact
that was superseded or deleted after later facts were encoded leak through
those later facts' KV?

With the notes encoding every fact's KV is computed after the facts said
before it (nall: all of them; n4: the four before it), so the KV of fact
j + 1, j + 2, ... was computed while fact j stood in the context. When fact j
later changes, the store keeps the later facts' KV as it was. For each target
(a fact j with a question of its own, single gold, with --k facts said after
it), three scenarios, each a prompt [header | facts | question] laid out in
the order said:

- kept: facts j .. j + k (the control: the old value is the right answer);
- superseded: facts j + 1 .. j + k, then a new fact, fact j's sentence with a
  new value (same kind, not among the user's facts), encoded as the notes
  encoding appends a fact (after the header and the user's remaining facts:
  fact j left out, the new one last);
- deleted: facts j + 1 .. j + k (fact j removed from the store).

Configurations: reprefill (the same prompt as text: nothing of fact j left),
and the notes encoding (nall, n4; fp32 store) of the facts as they were
encoded before the change. Reported per scenario and configuration: the
fraction of greedy answers containing the old value (the leak; right only in
"kept") and, for superseded, the new value; the log-probability of the old
value as the answer (teacher forced), with paired bootstrap 95% intervals of
the differences against reprefill.

    python3 -m kvinject_bench.recall_change --model DIR [--device cuda] [--users 50] [--targets-per-user 4] [--k 20]
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

from kvinject_bench import common
from kvinject_bench import recall
from kvinject_bench import recall_data

NEW_FACT = 1 << 20  # + question id: a superseding fact's id (a user's own facts are numbered from 0)
SCENARIOS = ("kept", "superseded", "deleted")


def targets(users, per_user, k, seed):
    """(user, question, new value) for up to per_user facts per user that one
    question asks about alone and that have k facts said after them."""
    by_kind = {}
    for u in users:
        for q in u.questions:
            by_kind.setdefault(q.kind, set()).add(q.answer)
    out = []
    for u in users:
        rng = random.Random("%d/change/%d" % (seed, u.uid))
        said = " ".join(f.text for f in u.facts)
        qs = [q for q in u.questions if len(q.gold) == 1 and not q.referring and q.gold[0] + k < len(u.facts)
              and u.facts[q.gold[0]].text.count(q.answer) == 1]
        for q in rng.sample(qs, min(per_user, len(qs))):
            pool = sorted(v for v in by_kind[q.kind]
                          if v != q.answer and not re.search(r"(?<!\w)%s(?!\w)" % re.escape(v), said))
            if pool:
                out.append((u, q, rng.choice(pool)))
    return out


def run(args):
    torch, transformers = common.need_torch_transformers()
    kvi = common.need_kvinject()
    device = common.pick_device(args.device, torch, kvi)
    torch.set_float32_matmul_precision("highest")
    torch.set_grad_enabled(False)
    args.batch_tokens = args.batch_tokens or (16384 if device.startswith("cuda") else 2048)
    t0 = time.time()
    model, tok = recall.load_model(args.model, getattr(torch, args.dtype), device, args.attn, torch)
    users = recall_data.generate(args.seed, args.users)
    corpus = recall.Corpus(tok, users)
    tg = targets(users, args.targets_per_user, args.k, args.seed)
    prior, done = recall.resume_records(args)
    bench = recall.Bench(args, torch, kvi, model, tok, corpus, device)
    methods = [recall.Reprefill()] + [recall.Window(recall.parse_window(w)[0], "fp32", recall.parse_window(w)[1])
                                      for w in args.encodings.split(",")]
    for m in methods:
        m.setup(bench)
    recall.log("%d users, %d targets; encoded (%.1fs)" % (len(users), len(tg), time.time() - t0))
    records = list(prior)
    for n, (u, q, new) in enumerate(tg):
        if q.qid in done:
            continue
        if args.time_limit and time.time() - recall.T0 > args.time_limit:
            recall.log("time limit: stopped after %d of %d targets" % (n, len(tg)))
            break
        j = q.gold[0]
        old = q.answer
        new_text = u.facts[j].text.replace(old, new)
        nid = NEW_FACT + q.qid  # one superseding fact per target
        corpus.fact_ids[(u.uid, nid)] = corpus.enc(" " + new_text)
        # the superseding fact as the notes encoding appends it: after the
        # header and the user's remaining facts (window w: the w before it)
        rest = [f.index for f in u.facts if f.index != j]
        from kvinject.vllm.prompt import Keep, notes_capture_prompts
        keeps = [Keep(i, corpus.fact_ids[(u.uid, i)]) for i in rest] + [Keep(nid, corpus.fact_ids[(u.uid, nid)])]
        for m in methods[1:]:
            ctx = keeps if m.w is None else keeps[-(m.w + 1):]
            p = notes_capture_prompts(u.uid, list(corpus.header), ctx, window=None)[0]
            cp = [c for c in p.params["capture"] if c["fact_id"] == nid][0]
            bench.encode_units(bench.window_stores(m.w, m.anchor),
                               [(p.prompt_token_ids, [(u.uid, nid, cp["start"], cp["length"])])])
        probe = recall_data.Question(q.qid, u.uid, q.text, old, [j], q.kind, False)
        after = list(range(j + 1, j + 1 + args.k))
        for sc, sel in (("kept", [j] + after), ("superseded", after + [nid]), ("deleted", after)):
            for rec in recall.run_cell(bench, recall.make_cell(corpus, probe, sel), methods):
                rec.pop("tokens", None)
                records.append(dict(rec, scenario=sc, old=old, new=new, user=u.uid, fact=j,
                                    has_new=recall.contains(rec["answer"], new)))
        done.add(q.qid)
        if len(done) % 10 == 0:
            recall.log("%d targets" % len(done))
            if args.json:  # a checkpoint: a run killed later resumes from here
                recall.write_json(args.json, dict(args=vars(args), records=records))
    md = report(args, records, len(done), len(tg), bench, torch, transformers, kvi)
    print(md, flush=True)
    if args.json:
        recall.write_json(args.json, dict(args=vars(args), records=records))
    if args.md:
        with open(args.md, "w") as f:
            f.write(md)
    bench.close()
    return True


def report(args, records, n_done, n_all, bench, torch, transformers, kvi):
    by = {}
    for r in records:
        by.setdefault((r["scenario"], r["method"]), {})[r["qid"]] = r
    rows = []
    pct = lambda t: "%.1f%% (%.1f–%.1f)" % tuple(100 * x for x in t)  # noqa: E731
    pp = lambda d: "%+.1f pp (%+.1f, %+.1f)" % tuple(100 * x for x in d)  # noqa: E731
    for sc in SCENARIOS:
        ref = by.get((sc, "reprefill"), {})
        for m in sorted({m for s, m in by if s == sc}, key=lambda m: (m != "reprefill", m)):
            recs = by[(sc, m)]
            qs = sorted(recs)
            n = len(qs)
            leak = [float(recs[q]["contains"]) for q in qs]
            lp = [recs[q]["gold_logprob"] for q in qs]
            line = [sc, m, n, pct(recall.wilson(sum(leak), n)),
                    pct(recall.wilson(sum(recs[q]["has_new"] for q in qs), n)) if sc == "superseded" else "–",
                    "%.3f" % (sum(lp) / n)]
            pq = [q for q in qs if q in ref]
            if m != "reprefill" and pq:
                line += [pp(recall.paired_bootstrap([float(recs[q]["contains"]) for q in pq],
                                                    [float(ref[q]["contains"]) for q in pq], args.bootstrap)),
                         "%+.3f (%+.3f, %+.3f)" % recall.paired_bootstrap([recs[q]["gold_logprob"] for q in pq],
                                                                          [ref[q]["gold_logprob"] for q in pq],
                                                                          args.bootstrap)]
            else:
                line += ["–", "–"]
            rows.append(line)
    dev = torch.cuda.get_device_name() if bench.device.startswith("cuda") else \
        "CPU (%d threads)" % torch.get_num_threads()
    title = ["## Facts that change on %s%s" % (os.path.basename(args.model.rstrip("/")),
                                               " (%s)" % args.label if args.label else ""), "",
             "- device: %s; torch %s, transformers %s; libkvinject %s; model %s" % (
                 dev, torch.__version__, transformers.__version__, kvi.version(), args.dtype),
             "- %d users (seed %d), targets done: %d of %d (%s); k = %d facts said after the target; "
             "encodings %s (fp32 store)" % (args.users, args.seed, n_done, n_all,
                                            "complete" if n_done == n_all else "incomplete: run again with --resume",
                                            args.k, args.encodings), ""]
    hdr = ["scenario", "configuration", "n", "old value in the answer (95% CI)", "new value in the answer",
           "log-prob of the old value", "Δ old value in the answer vs reprefill (95% CI)",
           "Δ log-prob of the old value vs reprefill (95% CI)"]
    return "\n".join(title) + "\n" + common.table(hdr, rows) + "\n"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVI_VLLM_MODEL"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--targets-per-user", type=int, default=4)
    ap.add_argument("--k", type=int, default=20, help="facts said after the target in each prompt")
    ap.add_argument("--encodings", default="nall,n4", help="notes encodings (recall.py's window names)")
    ap.add_argument("--max-new", type=int, default=10)
    ap.add_argument("--embed-layer", type=int, default=0)
    ap.add_argument("--batch-tokens", type=int, default=None)
    ap.add_argument("--bootstrap", type=int, default=2000)
    ap.add_argument("--json", default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--md", default=None)
    ap.add_argument("--label", default="")
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--check", action="store_true", help="accepted for run_recall.sh; no checks here")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # the recall harness's arguments that Bench and --resume read
    args.stores, args.embedder, args.windows, args.order = "fp32", "mean", args.encodings, "said"
    if not args.model:
        print("error: no --model (and no KVI_VLLM_MODEL)", file=sys.stderr)
        return 2
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main())
