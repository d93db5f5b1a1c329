#!/usr/bin/env python3
"""The torch baseline of bench_search.c: the same embeddings and queries
(value(r, c) below is kvi_bench_value in bench_search.c), scored with a plain
fp16 matmul and torch.topk, timed the same way (CUDA events, median of 60
calls after 5 warm-ups). Prints one machine-readable line per case:
    TORCH <case>|<facts>|<queries>|<ms>
and a readable table. Exits 77 without torch or a CUDA device.

SPDX-License-Identifier: Apache-2.0
"""
import sys

try:
    import torch
except ImportError:
    print("torch is not installed: no baseline")
    sys.exit(77)
if not torch.cuda.is_available():
    print("torch sees no CUDA device: no baseline")
    sys.exit(77)

DIM, K, BIG, TENANTS, PER, WARM, ITERS = 1024, 50, 1_000_000, 100, 10_000, 5, 60
QUERY_ROW0 = 1 << 30
M32 = 0xFFFFFFFF
dev = torch.device("cuda", 0)


def hash32(r, c):
    """kvi_bench_hash on int64 tensors: products wrap mod 2^64, the low 32 bits are kept."""
    h = ((r * 2654435761) & M32) ^ ((c * 2246822519) & M32)
    h ^= h >> 15
    h = (h * 2246822519) & M32
    h ^= h >> 13
    h = (h * 3266489917) & M32
    h ^= h >> 16
    return h


def matrix(row0, n):
    """Rows row0 .. row0 + n - 1 as an [n, DIM] fp16 tensor (values exact in fp16)."""
    out = torch.empty(n, DIM, dtype=torch.float16, device=dev)
    c = torch.arange(DIM, dtype=torch.int64, device=dev)[None, :]
    for s in range(0, n, 65536):
        e = min(n, s + 65536)
        r = torch.arange(row0 + s, row0 + e, dtype=torch.int64, device=dev)[:, None]
        out[s:e] = (((hash32(r, c) % 2048) - 1024).to(torch.float32) / 1024.0).to(torch.float16)
    return out


def median_ms(fn):
    ts = []
    for i in range(-WARM, ITERS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i + WARM)
        b.record()
        b.synchronize()
        if i >= 0:
            ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def main():
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}")
    E = matrix(0, BIG)
    S = matrix(BIG, TENANTS * PER)
    Q = matrix(QUERY_ROW0, 256)
    torch.cuda.synchronize()
    rows = []
    for b in (1, 16, 256):
        q = Q[:b]
        rows.append(("1 tenant", BIG, b, median_ms(lambda i: torch.topk(q @ E.T, K, dim=1))))
    q1 = Q[:1]
    rows.append(("1 of 100 tenants", PER, 1,
                 median_ms(lambda i: torch.topk(q1 @ S[(i % TENANTS) * PER:(i % TENANTS + 1) * PER].T, K, dim=1))))
    S3 = S.view(TENANTS, PER, DIM)
    Qb = Q[:TENANTS].view(TENANTS, 1, DIM)
    rows.append(("100 tenants", TENANTS * PER, TENANTS,
                 median_ms(lambda i: torch.topk(torch.bmm(Qb, S3.transpose(1, 2)), K, dim=2))))
    # the same data as bench_search.c: compare with its "query 0: best fact" line
    v, ix = torch.topk(Q[:1] @ E.T, 1, dim=1)
    print(f"query 0: best fact {int(ix[0, 0])} score {float(v[0, 0]):.4f} (fp16 scores)")
    print("| case             |     facts | queries | torch ms | queries/s |")
    for name, facts, queries, ms in rows:
        print(f"| {name:16} | {facts:9d} | {queries:7d} | {ms:8.3f} | {queries / (ms * 1e-3):9.0f} |")
    for name, facts, queries, ms in rows:
        print(f"TORCH {name}|{facts}|{queries}|{ms:.6f}")


if __name__ == "__main__":
    main()
