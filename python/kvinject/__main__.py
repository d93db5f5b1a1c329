"""``python -m kvinject``: which libkvinject the package loaded, how it was
found, its version and build features. ``--check`` also runs a small round
trip on a CPU store (a fact put, read back and injected into a host cache).
Without a library it prints one line saying how to get one and exits 1."""
import argparse
import sys

import kvinject as kvi


def check() -> None:
    """A fact put into a CPU store, read back exactly, and injected into a host
    cache in Hugging Face's layout: its values (V is not rotated) land in place."""
    import array
    m = kvi.Model(2, 2, 8)
    m.set_rope(theta=10000.0)
    s = kvi.Store(m, 1 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32)
    n = 2 * 3 * 2 * 8  # layers x tokens x heads x head size
    k = array.array("f", [float(i % 7) for i in range(n)])
    v = array.array("f", [i / 8.0 for i in range(n)])
    s.put(1, 5, k, v, num_tokens=3)
    k2, v2 = s.read(1, 5)
    if list(k2) != list(k) or list(v2) != list(v):
        raise SystemExit("kvinject: check failed: the fact read back differs from the one put")
    ck = [array.array("f", bytes(4 * 2 * 8 * 8)) for _ in range(2)]
    cv = [array.array("f", bytes(4 * 2 * 8 * 8)) for _ in range(2)]
    inj = kvi.Injector(s, kvi.CacheLayout.hf(ck, cv, shape=(1, 2, 8, 8)))
    inj.inject(kvi.InjectRequest(1, [5], block_table=[0], first_slot=2, start_position=2))
    for layer in range(2):
        for head in range(2):
            for t in range(3):
                at = (head * 8 + 2 + t) * 8
                want = ((layer * 3 + t) * 2 + head) * 8
                if list(cv[layer][at:at + 8]) != list(v[want:want + 8]):
                    raise SystemExit("kvinject: check failed: injected values differ (layer %d, head %d, "
                                     "token %d)" % (layer, head, t))
    print("check: a CPU store's put, read and injection: ok")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvinject", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="also run a small round trip on a CPU store")
    args = ap.parse_args(argv)
    feats = [name for bit, name in ((kvi.FEATURE_CUDA, "cuda"), (kvi.FEATURE_CUBLASLT, "cublaslt"),
                                    (kvi.FEATURE_NCCL, "nccl")) if kvi.features() & bit]
    print("kvinject %s (package %s)" % (kvi.__version__, kvi.__file__))
    print("libkvinject %s: %s (found by %s)" % (kvi.version(), kvi.library_path(), kvi.library_found_by()))
    print("features: %s" % (" ".join(feats) or "none (CPU only)"))
    if args.check:
        check()
    return 0


if __name__ == "__main__":
    sys.exit(main())
