#!/usr/bin/env python3
"""The Python binding's injection calls against the C benchmark's, in one run.

Runs tests/bench/bench_inject (its path is the first argument) and takes its
rows (kvi_inject, kvi_inject_batched from host arrays and with device fact
ids, and the device-to-device copy of the same bytes: the ceiling), then
times the same cases through kvinject in this process, the same way (CUDA
events around the call on an idle GPU, median of 60 calls after 5 warm-ups,
fresh fact ids every call; the arrays are built before the clock starts, as
an engine has them): Injector.inject with InjectRequest objects (the
per-request form), Injector.inject_batch with CPU tensors and with CUDA
tensors. Then a search -> inject chain with device fact ids: Store.search
into device tensors and inject_batch of its ids, queued behind a 2 GiB copy:
the host time of both calls against the copy's time shows whether the host
waited for the device. Geometry as bench_inject: Llama-3.1-8B (32 layers, 8
KV heads of 128, llama3 RoPE), bf16 store and vLLM FlashAttention cache
(blocks of 16), facts of 24 tokens. Needs torch with CUDA (exit 77 without).

SPDX-License-Identifier: Apache-2.0
"""
import os
import re
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    print("torch is not installed: no Python benchmark")
    sys.exit(77)
if not torch.cuda.is_available():
    print("torch sees no CUDA device: no Python benchmark")
    sys.exit(77)
import kvinject as kvi

L, H, D, BS, FACT_T, POOL, EMB = 32, 8, 128, 16, 24, 1024, 64
WARM, ITERS = 5, int(os.environ.get("KVI_BENCH_ITERS", "60") or 60)
CASES = [(1, 5), (1, 10), (1, 20), (1, 50), (64, 50)]
dev = torch.device("cuda", 0)


def c_rows(binary):
    """bench_inject's injection rows: {(form, reqs, k): (call ms, host ms, copy ms)}."""
    out = subprocess.run([binary], capture_output=True, text=True, timeout=600)
    sys.stdout.write(out.stdout)  # bench_inject's own table
    sys.stdout.flush()
    if out.returncode != 0:
        raise SystemExit("bench_inject failed (rc %d): %s" % (out.returncode, out.stderr[-2000:]))
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 9 and cells[0] in ("inject", "batched", "dev ids") and re.match(r"^\d+$", cells[1]):
            rows[(cells[0], int(cells[1]), int(cells[2]))] = (float(cells[5]), float(cells[6]), float(cells[8]))
    return rows, out.stdout


def timed(call, busy=None):
    """(device ms from an event before the call to one after it, host ms of the call), medians."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t, th = [], []
    for i in range(-WARM, ITERS):
        prep = call(i)
        if busy:
            busy()
        e0.record()
        h0 = time.perf_counter()
        prep()
        h1 = time.perf_counter()
        e1.record()
        e1.synchronize()
        if i >= 0:
            t.append(e0.elapsed_time(e1))
            th.append((h1 - h0) * 1e3)
    return statistics.median(t), statistics.median(th)


def main():
    if len(sys.argv) < 2:
        raise SystemExit("usage: py_inject.py PATH/TO/bench_inject")
    crow, _ = c_rows(sys.argv[1])
    print("device: %s, libkvinject %s (Python binding)" % (torch.cuda.get_device_name(0), kvi.version()))
    model = kvi.Model(L, H, D)
    model.set_rope(theta=500000.0, scaling=kvi.RopeScaling.LLAMA3, factor=8.0)
    token_bytes = L * H * D * 2 * 2
    store = kvi.Store(model, 2 * POOL * 32 * token_bytes, backend=kvi.Backend.CUDA, device=0, dtype=kvi.DType.BF16,
                      embedding_dim=EMB)
    g = torch.Generator(device="cpu").manual_seed(1)
    kk = torch.randn(L, FACT_T, H, D, generator=g).to(dev, torch.bfloat16)
    vv = torch.randn(L, FACT_T, H, D, generator=g).to(dev, torch.bfloat16)
    embs = torch.randn(POOL, EMB, generator=g).to(dev)
    for f in range(POOL):
        store.put(1, f, kk, vv, embedding=embs[f])
    torch.cuda.synchronize()
    max_tokens = 64 * 50 * FACT_T
    NB = max_tokens // BS + 64
    caches = [torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    inj = kvi.Injector(store, kvi.CacheLayout.vllm(caches))
    TW = NB // 64
    table = torch.tensor([(b * 7919) % NB for b in range(NB)], dtype=torch.int32)
    src = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)

    def busy():
        dst.copy_(src)

    def batch_arrays(i, R, k):
        ids = torch.tensor([((i + WARM) * 131 + r * 50 + f) % POOL for r in range(R) for f in range(k)],
                           dtype=torch.int64)
        rows = torch.stack([table[((r + i + WARM) % 64) * TW:((r + i + WARM) % 64 + 1) * TW] for r in range(R)])
        offs = torch.arange(0, (R + 1) * k, k, dtype=torch.int32)
        starts = torch.full((R,), 100, dtype=torch.int32)
        return ids, rows, offs, starts

    py = {}
    for R, k in CASES:
        def lists(i, R=R, k=k):
            ids, rows, _, _ = batch_arrays(i, R, k)
            reqs = [kvi.InjectRequest(1, ids[r * k:(r + 1) * k].tolist(), rows[r].tolist(), start_position=100)
                    for r in range(R)]
            return lambda: inj.inject(reqs)

        def cpu_tensors(i, R=R, k=k):
            ids, rows, offs, starts = batch_arrays(i, R, k)
            return lambda: inj.inject_batch(ids, rows, fact_offsets=offs, tenant=1, start_positions=starts)

        def cuda_tensors(i, R=R, k=k):
            ids, rows, offs, starts = batch_arrays(i, R, k)
            d_ids, d_rows, out = ids.to(dev), rows.to(dev), torch.empty(R, dtype=torch.int32, device=dev)
            torch.cuda.synchronize()
            return lambda: inj.inject_batch(d_ids, d_rows, fact_offsets=offs, tenant=1, start_positions=starts,
                                            out_tokens=out)

        persistent = {}

        def cpu_persistent(i, R=R, k=k):
            # an engine's persistent CPU buffers: new contents each call, the same tensors
            new = batch_arrays(i, R, k)
            if not persistent:
                persistent["t"] = tuple(t.clone() for t in new)
            ids, rows, offs, starts = persistent["t"]
            for d, s_ in zip(persistent["t"], new):
                d.copy_(s_)
            return lambda: inj.inject_batch(ids, rows, fact_offsets=offs, tenant=1, start_positions=starts)

        py[(R, k)] = [timed(f) for f in (lists, cpu_tensors, cuda_tensors, cpu_persistent)]

    print()
    print("| reqs |  k | C inject | C batched | C dev ids | Py lists | Py CPU tensors | Py CUDA tensors "
          "| Py persistent CPU tensors | copy ms | CPU tensors - C batched | persistent - C batched "
          "| CUDA tensors - C dev ids |")
    print("|------|----|----------|-----------|-----------|----------|----------------|-----------------"
          "|---------------------------|---------|-------------------------|------------------------"
          "|--------------------------|")
    for R, k in CASES:
        ci, cb, cd = (crow.get((f, R, k), (float("nan"),) * 3) for f in ("inject", "batched", "dev ids"))
        (pl, _), (pc, _), (pd, _), (pp, _) = py[(R, k)]
        print("| %4d | %2d | %8.3f | %9.3f | %9.3f | %8.3f | %14.3f | %15.3f | %25.3f | %7.3f | %+9.3f ms (%+5.1f%%) "
              "| %+8.3f ms (%+5.1f%%) | %+10.3f ms (%+5.1f%%) |"
              % (R, k, ci[0], cb[0], cd[0], pl, pc, pd, pp, ci[2], pc - cb[0], 100 * (pc - cb[0]) / cb[0],
                 pp - cb[0], 100 * (pp - cb[0]) / cb[0], pd - cd[0], 100 * (pd - cd[0]) / cd[0]))
    print("\nms: CUDA events around the call on an idle GPU (host work on the clock), medians; C columns from "
          "bench_inject in this run, copy ms its device-to-device copy of the same bytes.")
    print("Python host ms per call (the time to return): " + ", ".join(
        "%dx%d: lists %.3f, CPU tensors %.3f, CUDA tensors %.3f, persistent CPU tensors %.3f"
        % (R, k, py[(R, k)][0][1], py[(R, k)][1][1], py[(R, k)][2][1], py[(R, k)][3][1]) for R, k in CASES))

    # search -> inject with device ids, no host round trip
    print("\n| chain: search -> inject_batch | nq |  k | host ms (both calls) | device ms | busy copy ms | waited |")
    print("|-------------------------------|----|----|----------------------|-----------|--------------|--------|")
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for nq, k in ((1, 5), (8, 16), (64, 50)):
        q = torch.randn(nq, EMB, generator=g).to(dev)
        o_ids = torch.empty(nq, k, dtype=torch.int64, device=dev)
        o_sc = torch.empty(nq, k, dtype=torch.float32, device=dev)
        o_ct = torch.empty(nq, dtype=torch.int32, device=dev)
        o_tok = torch.empty(nq, dtype=torch.int32, device=dev)
        d_rows = torch.stack([table[r * TW:(r + 1) * TW] for r in range(nq)]).to(dev)
        starts = torch.full((nq,), 100, dtype=torch.int32)
        th, td, tb = [], [], []
        for i in range(-WARM, ITERS):
            b0, b1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            b0.record()
            busy()
            b1.record()
            e0.record()
            h0 = time.perf_counter()
            store.search(q, 1, k, out=(o_ids, o_sc, o_ct))
            inj.inject_batch(o_ids, d_rows, tenant=1, start_positions=starts, out_tokens=o_tok)
            h1 = time.perf_counter()
            e1.record()
            e1.synchronize()
            if i >= 0:
                th.append((h1 - h0) * 1e3)
                td.append(e0.elapsed_time(e1))
                tb.append(b0.elapsed_time(b1))
        want = int(o_ct.sum().item()) * FACT_T
        got = int(o_tok.sum().item())
        if got != want:
            raise SystemExit("chain nq=%d k=%d: %d tokens injected, the search found %d" % (nq, k, got, want))
        h, d, b = statistics.median(th), statistics.median(td), statistics.median(tb)
        print("| %-29s | %2d | %2d | %20.3f | %9.3f | %12.3f | %6s |" % ("device ids, device outputs", nq, k, h, d, b,
                                                                           "yes" if h > 0.5 * b else "no"))
    print("\nThe chain is queued behind a copy of 2 GiB ('busy copy ms'): 'waited' says whether the host time of the "
          "two calls reached half of it (a host synchronization would make it at least the copy's time).")
    skipped = inj.async_errors()
    if skipped:
        raise SystemExit("the injector skipped %d tokens or ids" % skipped)


if __name__ == "__main__":
    main()
