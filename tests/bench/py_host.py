#!/usr/bin/env python3
"""The Python binding's host cost of an injection call on the CPU backend, the
geometry of bench_host.c (1 layer, 1 head of 16 without RoPE, facts of 1 token,
pages of 1; 64 requests of k = 1, 5, 50 facts from 4,096): Injector.inject with
InjectRequest objects against Injector.inject_batch from array.array buffers and,
where torch is installed, from CPU tensors. Median of 200 calls after 20, the
arrays built before the clock starts. Compare with bench_host's kvi_inject_batched
column (the C call alone) for the binding's overhead per call.

SPDX-License-Identifier: Apache-2.0
"""
import array
import statistics
import time

import kvinject as kvi

R, FACTS, BS, ROUNDS, WARM = 64, 4096, 16, 200, 20
try:
    import torch
except ImportError:
    torch = None


def main():
    model = kvi.Model(1, 1, 16)
    model.set_rope(style=kvi.RopeStyle.NONE)
    store = kvi.Store(model, FACTS * 128 + (1 << 20), backend=kvi.Backend.CPU, dtype=kvi.DType.BF16, page_tokens=1)
    zero = array.array("H", [0] * 16)
    for f in range(FACTS):
        store.put(1, f, zero, zero, dtype=kvi.DType.BF16, num_tokens=1)
    per = (50 + BS - 1) // BS
    nb = R * per
    cache = array.array("H", [0] * (nb * BS * 16 * 2))
    inj = kvi.Injector(store, kvi.CacheLayout.vllm([cache], kv_first=False, shape=(nb, 2, BS, 1, 16),
                                                   dtype=kvi.DType.BF16))
    table = [(b * 37) % nb for b in range(nb)]
    print("| k  | inject (InjectRequest lists) us | inject_batch (array.array) us | inject_batch (CPU tensors) us |")
    print("|----|--------------------------------|-------------------------------|-------------------------------|")
    for k in (1, 5, 50):
        def forms(i):
            ids = [((i + WARM) * 977 + r * 50 + f) % FACTS for r in range(R) for f in range(k)]
            reqs = [kvi.InjectRequest(1, ids[r * k:(r + 1) * k], table[r * per:(r + 1) * per], start_position=100 + r)
                    for r in range(R)]
            a_ids, a_tab = array.array("q", ids), array.array("i", table)
            a_off, a_st = array.array("i", range(0, (R + 1) * k, k)), array.array("i", range(100, 100 + R))
            mv_tab = memoryview(a_tab).cast("B").cast("i", (R, per))
            out = [lambda: inj.inject(reqs),
                   lambda: inj.inject_batch(a_ids, mv_tab, fact_offsets=a_off, tenant=1, start_positions=a_st)]
            if torch is not None:
                t_ids, t_tab = torch.tensor(ids, dtype=torch.int64), torch.tensor(table, dtype=torch.int32).view(R, per)
                t_off, t_st = torch.tensor(list(a_off), dtype=torch.int32), torch.tensor(list(a_st), dtype=torch.int32)
                out.append(lambda: inj.inject_batch(t_ids, t_tab, fact_offsets=t_off, tenant=1, start_positions=t_st))
            return out

        times = None
        for i in range(-WARM, ROUNDS):
            calls = forms(i)
            if times is None:
                times = [[] for _ in calls]
            for j, c in enumerate(calls):
                t0 = time.perf_counter()
                c()
                t1 = time.perf_counter()
                if i >= 0:
                    times[j].append((t1 - t0) * 1e6)
        med = [statistics.median(t) for t in times] + [float("nan")] * (3 - len(times))
        print("| %2d | %30.1f | %29.1f | %29.1f |" % (k, med[0], med[1], med[2]))
    print("\n%d requests per call; torch %s." % (R, torch.__version__ if torch else "not installed (no tensor column)"))


if __name__ == "__main__":
    main()
