"""The host time of one connector-shaped injection, piece by piece, outside vLLM:
a CUDA store of an 8B-shaped model (32 layers, 8 KV heads of 128, bf16), vLLM
FlashAttention cache tensors, one request of a 16-token header and 50 facts of
10-20 tokens with the prompt's token ids (the connector worker's call), timed
with perf_counter over many calls: Injector.inject as the worker calls it, and
its parts (the request array, the option struct, the current stream, the C call
alone). Run on the GPU machine with KVINJECT_LIBRARY set:

    python3 tests/gpu/inject_host.py [--reps 3000]
"""
import argparse
import ctypes
import random
import statistics
import time

import torch

import kvinject as kvi
from kvinject import DType
from kvinject._lib import InjectOptions, lib
from kvinject.transfer import _request_array


def timed(f, reps):
    for _ in range(100):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e6)
        if len(ts) % 64 == 0:
            torch.cuda.synchronize()
    return statistics.median(ts), sorted(ts)[int(0.9 * len(ts))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3000)
    args = ap.parse_args()
    L, H, D, BS, NB = 32, 8, 128, 16, 256
    m = kvi.Model(L, H, D)
    m.set_rope(layer=-1, style=kvi.RopeStyle.NEOX, theta=500000.0)
    st = kvi.Store(m, 512 << 20, backend=kvi.Backend.CUDA, dtype=DType.BF16, page_tokens=16)
    rnd = random.Random(1)
    lens = [16] + [rnd.randint(10, 20) for _ in range(50)]
    ids = []
    for f, n in enumerate(lens):
        k = torch.randn(L, n, H, D, dtype=torch.float32)
        tok = [rnd.randrange(50000) for _ in range(n)]
        st.put(7, f, k, k, token_ids=tok)
        ids += tok
    caches = [torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    inj = kvi.Injector(st, kvi.CacheLayout.vllm(caches))
    blocks = list(range(-(-len(ids) // BS)))
    facts = list(range(len(lens)))

    def worker_call():  # as KVInjectWorker._inject builds and makes it
        req = kvi.InjectRequest(7, list(facts), list(blocks), first_slot=0, start_position=0,
                                expect_token_ids=list(ids))
        inj.inject([req], stream=torch.cuda.current_stream())

    req = kvi.InjectRequest(7, facts, blocks, first_slot=0, start_position=0, expect_token_ids=ids)
    arr, n, keep = _request_array([req])
    o = lib().new(InjectOptions)
    h = inj.handle
    s = torch.cuda.current_stream().cuda_stream
    rows = [
        ("Injector.inject as the worker calls it", worker_call),
        ("Injector.inject, no expected ids", lambda: inj.inject([kvi.InjectRequest(7, facts, blocks)],
                                                               stream=torch.cuda.current_stream())),
        ("_request_array", lambda: _request_array([req])),
        ("lib().new(InjectOptions)", lambda: lib().new(InjectOptions)),
        ("torch.cuda.current_stream()", torch.cuda.current_stream),
        ("kvi_inject C call (GIL kept)", lambda: lib().call("kvi_inject", h, arr, n, ctypes.byref(o), s,
                                                            keep_gil=True)),
        ("kvi_inject C call (GIL released)", lambda: lib().call("kvi_inject", h, arr, n, ctypes.byref(o), s)),
        ("kvi_inject_plan", lambda: inj.plan(7, facts)),
    ]
    print("| %d tokens, %d facts | median µs | p90 µs |" % (len(ids), len(lens)))
    print("|---|--:|--:|")
    for name, f in rows:
        med, p90 = timed(f, args.reps)
        print("| %s | %.1f | %.1f |" % (name, med, p90))


if __name__ == "__main__":
    main()
