#!/usr/bin/env python3
"""What releasing the GIL costs a short C call when another Python thread runs: the
binding's kvi_inject_plan (51 facts of a CPU store, 30 layers x 3 heads x 64: host
bookkeeping only, microseconds) through the function that releases the GIL
(ctypes.CDLL) and through its twin that keeps it (``kvi_inject_plan_gil``,
ctypes.PyDLL), alone and beside a thread that runs Python without pause. A call
that released the GIL takes it back only once the other thread gives it up: at
sys.getswitchinterval() (5 ms by default) at the latest. Median and mean of 2,000
calls alone and 300 beside the thread, after 20.

SPDX-License-Identifier: Apache-2.0
"""
import array
import ctypes
import statistics
import sys
import threading
import time

import kvinject as kvi
from kvinject._lib import lib

L, H, D, P, FACTS, TOKENS = 30, 3, 64, 16, 51, 24


def timed(fn, args, reps):
    for _ in range(20):
        fn(*args)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e6, statistics.mean(ts) * 1e6


def main():
    model = kvi.Model(L, H, D)
    model.set_rope(theta=10000.0)
    store = kvi.Store(model, 64 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.BF16, page_tokens=P)
    zero = array.array("H", [0] * (L * TOKENS * H * D))
    for f in range(FACTS):
        store.put(7, f, zero, zero, dtype=kvi.DType.BF16, num_tokens=TOKENS)
    cache = array.array("H", [0] * (2 * 8 * P * H * D))
    inj = kvi.Injector(store, kvi.CacheLayout.vllm([cache] * L, shape=(2, 8, P, H, D), dtype=kvi.DType.BF16))
    ids = (ctypes.c_uint64 * FACTS)(*range(FACTS))
    n = ctypes.c_int64()
    args = (inj.handle, 7, ids, FACTS, ctypes.byref(n))
    L_ = lib()
    print("switch interval %.1f ms; kvi_inject_plan of %d facts (%d tokens)" % (sys.getswitchinterval() * 1e3, FACTS,
                                                                            FACTS * TOKENS))
    print("| call | alone: median / mean us | beside a busy Python thread: median / mean us |")
    print("|---|--:|--:|")
    rows = {name: [timed(getattr(L_, name), args, 2000)] for name in ("kvi_inject_plan", "kvi_inject_plan_gil")}
    stop = threading.Event()

    def busy():
        x = 0
        while not stop.is_set():
            x += 1
    th = threading.Thread(target=busy)
    th.start()
    try:
        for name in rows:
            rows[name].append(timed(getattr(L_, name), args, 300))
    finally:
        stop.set()
        th.join()
    for name, (alone, busy_) in rows.items():
        how = "GIL kept (PyDLL)" if name.endswith("_gil") else "GIL released (CDLL)"
        print("| %s, %s | %.1f / %.1f | %.1f / %.1f |" % (name, how, alone[0], alone[1], busy_[0], busy_[1]))
    assert n.value == FACTS * TOKENS


if __name__ == "__main__":
    main()
