#!/usr/bin/env python3
"""The recall benchmark (recall.py) with selective recompute configurations
(kvinject.hf.recompute): every Context-Window Encoding configuration w<N>-<store>
it runs, also followed by recompute of part of the injected fact tokens.

    python3 -m kvinject_bench.recall_recompute [--recompute blend-5,blend-10,...] RECALL ARGUMENTS...

A recompute configuration (names as in recompute_eval.py): ``blend-R`` computes
layers 0..1 of every fact token fresh over the injected context, scores the
tokens at layer 1 (kvi_inject_deviation) and runs the R% most deviating through
the remaining layers; ``boundary-B`` (``b-B`` after a ``+``) runs every fact's
first B tokens through all layers; ``blend-R+b-B`` both. Its rows are named
``w<N>-<store>+<config>``. After the tables, one line per configuration gives
the share of fact tokens it recomputed and of a re-prefill's layer-token work.
"""
from __future__ import annotations

import argparse
import sys

from kvinject_bench import common
from kvinject_bench import recall
from kvinject_bench.recompute_eval import parse_config

DEFAULT = "boundary-4,blend-5,blend-10,blend-15,blend-30,blend-10+b-2"


class Recompute:
    """A recall method: a Window method's injection, then recompute."""

    def __init__(self, base, config):
        self.base, self.config = base, config
        self.layer, self.fraction, self.boundary, self.per_fact = parse_config(config)
        self.name = "%s+%s" % (base.name, config)
        self.sibling = None
        self.chosen = self.tokens = 0
        self.work = 0.0

    def setup(self, bench):
        if not hasattr(self.base, "st"):
            self.base.setup(bench)

    def fill(self, bench, cell, cache):
        from kvinject.hf.recompute import recompute
        kvi = bench.kvi
        self.base.fill(bench, cell, cache)
        if not cell.facts:
            return
        keys, values = common.cache_tensors(cache)
        inj = kvi.Injector(self.base.st, kvi.CacheLayout.hf(keys, values))
        req = kvi.InjectRequest(cell.facts[0].tenant, [f.fact_id for f in cell.facts], block_table=[0],
                                first_slot=cell.header_len, start_position=cell.header_len)
        ids = cell.ids[cell.header_len:cell.question_start]
        plan = recompute(bench.model, cache, inj, req, ids, score_layer=self.layer, fraction=self.fraction,
                         boundary=self.boundary, per_fact=self.per_fact, fact_tokens=[f.tokens for f in cell.facts],
                         stream=bench.stream)
        common.sync(bench.device)
        L = bench.model.config.num_hidden_layers
        fresh = self.layer + 1 if self.layer >= 0 else 0
        self.chosen += len(plan.chosen)
        self.tokens += plan.tokens
        self.work += fresh * plan.tokens + len(plan.chosen) * (L - fresh)
        self.L = L


def main(argv=None):
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--recompute", default=DEFAULT)
    ap.add_argument("--recompute-on", default=None, help="the encodings (e.g. w0,a0,n4) whose rows get "
                    "recompute rows (default: every one of --windows)")
    mine, rest = ap.parse_known_args(argv)
    args = recall.parse_args(rest)
    if not args.model:
        print("error: no --model (and no KVI_VLLM_MODEL)", file=sys.stderr)
        return 2
    methods = recall.make_methods(args)
    extra = []
    for m in methods:
        on = mine.recompute_on.split(",") if mine.recompute_on else None
        if isinstance(m, recall.Window) and (on is None or recall.window_name(m.w, m.anchor) in on):
            extra += [Recompute(m, c) for c in mine.recompute.split(",") if c]
    ok = recall.run(args, methods + extra)
    for m in extra:
        if m.tokens:
            print("- %s: %.1f%% of the fact tokens recomputed, %.1f%% of a re-prefill's layer-token work"
                  % (m.name, 100.0 * m.chosen / m.tokens, 100.0 * m.work / (m.L * m.tokens)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
