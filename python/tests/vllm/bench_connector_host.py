"""The connector's host work per injected request outside the library call,
with vLLM's own objects: what a memory request costs the engine's CPU on top
of a request vLLM's prefix cache serves.

Scheduler side (the engine core's process): vLLM's ``Request`` with its block
hasher (sha256, block size 16) made first and not timed, then the connector's
calls in vLLM's order: ``on_new_request`` (the parameters parsed and checked,
the cache salt), ``get_num_new_matched_tokens`` and ``update_state_after_alloc``
(the claim), ``build_connector_meta`` (the step's inject job),
``update_connector_output`` and ``request_finished`` (the worker's result, the
outcome). Statistics (the API server's process): the worker's statistics of
the injecting step (``get_kv_connector_stats``), rebuilt as vLLM's log line
does (``build_kv_connector_stats``, ``aggregate``) and recorded in Prometheus
(``observe``). One request at a time, the fixed shape of
``tests/gpu/vllm_bench.py`` (32-token header, facts of 24 tokens, 32-token
question): k facts and the header injected.

    python3 launch.py bench_connector_host.py [--k 0,5,10,20,50] [--reps 2000] [--out DIR]
                                              [--events PATH]

--events PATH gives the connector an event file (``events_path``), as
``tests/gpu/vllm_bench.py``'s engines have unless --no-events: each step's
records are queued and written at the flushes (``update_connector_output``,
``request_finished``); without it the connector runs as a production engine does.

Prints a table of medians (µs per request) and writes DIR/host.md when --out
is given. The worker's side (the library call and the job's arrays) is
measured by the connector's own events in ``vllm_bench.py``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import types

BS = 16
HEADER, FACT, QUESTION = 32, 24, 32
PHASES = ("on_new_request", "claim", "build_connector_meta", "result + finished", "statistics")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", default="0,5,10,20,50")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--events", default=None, metavar="PATH", help="the connector's events_path")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import prometheus_client as prom
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from kvinject.vllm import memory_prompt
    from kvinject.vllm.connector import KVInjectConnector
    from kvinject.vllm.results import KVInjectWorkerMeta, RequestResult
    from kvinject.vllm.stats import KVInjectPromMetrics, StatsRecorder

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    ktc = types.SimpleNamespace(kv_connector_extra_config={"events_path": args.events} if args.events else {},
                                is_kv_producer=True)
    vc = types.SimpleNamespace(kv_transfer_config=ktc, cache_config=types.SimpleNamespace(block_size=BS,
                                                                                         enable_prefix_caching=True))
    conn = KVInjectConnector(vc, KVConnectorRole.SCHEDULER, None)
    reg = prom.CollectorRegistry()

    def bound(cls):
        return lambda **kw: cls(registry=reg, **{k: v for k, v in kw.items() if k != "multiprocess_mode"})

    prom_metrics = KVInjectPromMetrics(vc, {prom.Gauge: bound(prom.Gauge), prom.Counter: bound(prom.Counter),
                                            prom.Histogram: bound(prom.Histogram)}, ["model_name", "engine"],
                                       {0: ["m", "0"]})
    rec = StatsRecorder(0)
    accumulated = None

    def one(mp, rid):
        nonlocal accumulated
        req = Request(request_id=rid, prompt_token_ids=list(mp.prompt_token_ids),
                      sampling_params=mp.sampling_params(max_tokens=1), pooling_params=None, block_hasher=hasher)
        n_blocks = -(-len(mp.prompt_token_ids) // BS)
        sched_out = types.SimpleNamespace(
            scheduled_new_reqs=[types.SimpleNamespace(req_id=rid, block_ids=(list(range(n_blocks)),),
                                                      num_computed_tokens=0)],
            scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                        num_computed_tokens=[]),
            num_scheduled_tokens={rid: QUESTION})
        t = [time.perf_counter()]
        conn.on_new_request(req)
        t.append(time.perf_counter())
        n, _ = conn.get_num_new_matched_tokens(req, 0)
        conn.update_state_after_alloc(req, None, n)
        t.append(time.perf_counter())
        meta = conn.build_connector_meta(sched_out)
        t.append(time.perf_counter())
        (job,) = meta.injects
        res = RequestResult(injected_facts=len(job.facts), injected_tokens=sum(f[2] for f in job.facts))
        conn.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=KVInjectWorkerMeta({rid: res})))
        _, params = conn.request_finished(req, job.block_ids)
        t.append(time.perf_counter())
        # the worker's statistics of the step, as vLLM's loggers take them
        rec.add("requests_injected")
        rec.add("facts_injected", len(job.facts))
        rec.add("tokens_injected", res.injected_tokens)
        rec.inject_step(int(rid.split("-")[-1]), 2e-4)
        data = rec.take().data
        stats = KVInjectConnector.build_kv_connector_stats(data)
        accumulated = stats if accumulated is None else accumulated.aggregate(stats)
        prom_metrics.observe(data, 0)
        t.append(time.perf_counter())
        assert params["kvinject"]["injected_facts"] == len(job.facts), params
        return [(t[i + 1] - t[i]) * 1e6 for i in range(5)]

    rows = []
    for k in [int(x) for x in args.k.split(",")]:
        header = list(range(1000, 1000 + HEADER))
        facts = [(0, header)] + [(i + 1, list(range(2000 + FACT * i, 2000 + FACT * (i + 1)))) for i in range(k)]
        mp = memory_prompt(7, facts, list(range(500, 500 + QUESTION)))
        for i in range(200):  # warm-up
            one(mp, "w%d-%d" % (k, i))
            accumulated = None
        times = [one(mp, "r%d-%d" % (k, i)) for i in range(args.reps)]
        med = [statistics.median(col) for col in zip(*times)]
        total = statistics.median(sum(r) for r in times)
        rows.append((k, len(mp.prompt_token_ids), med, total))
        print("k=%d done" % k, file=sys.stderr)
    lines = ["| k | prompt tokens | " + " | ".join(PHASES) + " | total |",
             "|--:|--:|" + "--:|" * (len(PHASES) + 1)]
    for k, n, med, total in rows:
        lines.append("| %d | %d | %s | %.1f |" % (k, n, " | ".join("%.1f" % m for m in med), total))
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
