"""Tensor-parallel stores from Python (kvinject.comm): ranks are threads with an
in-process group and CPU stores. Slices are cut here from the full facts with
kvinject/model.h's head rule written out; search results are compared with one
unsharded store holding every head and every embedding."""
from __future__ import annotations

import array
import threading
import sys

import pytest

from kvi_testutil import f32, rng
import kvinject as kvi
from kvinject import DType

L, H, D, E = 2, 4, 8, 16


def heads(tp, r):
    return (r * (H // tp), H // tp) if tp <= H else (r // (tp // H), 1)


def run_ranks(tp, fn):
    """Runs fn(comm) on tp threads; returns each rank's result or raises its error."""
    group = kvi.CommGroup(tp)
    out, errs = [None] * tp, [None] * tp

    def body(r):
        try:
            with kvi.Comm.local(group, r) as c:
                out[r] = fn(c)
        except BaseException as e:  # reported on the main thread
            errs[r] = e

    ts = [threading.Thread(target=body, args=(r,)) for r in range(tp)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    group.close()
    for e in errs:
        if e is not None:
            raise e
    return out


class TestTP:
    @pytest.fixture(autouse=True)
    def _setup(self, closing):
        self.closing = closing
        r = rng(2026)
        self.facts = {}
        for i in range(12):
            T = r.randint(1, 5)
            n = L * T * H * D
            k = array.array("f", [f32(r.uniform(-3, 3)) for _ in range(n)])
            v = array.array("f", [f32(r.uniform(-3, 3)) for _ in range(n)])
            e = [f32(r.uniform(-1, 1)) for _ in range(E)]
            self.facts[i] = (T, k, v, e)

    def slice(self, i, first, count):
        T, k, v, _ = self.facts[i]
        out = []
        for src in (k, v):
            a = array.array("f")
            for l in range(L):
                for t in range(T):
                    base = ((l * T + t) * H + first) * D
                    a.extend(src[base:base + count * D])
            out.append(a)
        return out

    def store(self, comm, tp, rank, placement=None):
        m = kvi.Model(L, H, D, tp_rank=rank, tp_size=tp)
        return kvi.Store(m, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=2, embedding_dim=E,
                         comm=comm, embedding_placement=placement)

    def test_scatter_gather_and_sharded_search(self):
        ref = self.store(None, 1, 0)
        self.closing.append(ref)
        for i, (T, k, v, e) in self.facts.items():
            ref.put(5, i, k, v, embedding=e)
        q = [f32(x / 7.0) for x in range(-8, 8)]
        want = list(ref.search([q, [-x for x in q]], 5, 6))
        assert [len(r) for r in want] == [6, 6]
        for tp in (2, 4):
            def rank_fn(c):
                s = self.store(c, tp, c.rank, kvi.EmbeddingPlacement.SHARDED)
                try:
                    # the even facts with token ids (experimental): every rank keeps root's
                    ids = {i: [100 * i + t for t in range(self.facts[i][0])] if i % 2 == 0 else None
                           for i in self.facts}
                    items = [(5, i, self.facts[i][1], self.facts[i][2], self.facts[i][3], ids[i]) if c.rank == 1
                             else (5, i) for i in self.facts]
                    s.put_scatter(1, items)
                    first, count = heads(tp, c.rank)
                    for i in self.facts:
                        k, v = s.read(5, i)
                        assert (k, v) == tuple(self.slice(i, first, count)), "tp %d rank %d fact %d" % (tp, c.rank, i)
                        assert s.fact_token_ids(5, i)[0] == (ids[i] or []), "tp %d rank %d fact %d" % (tp, c.rank, i)
                    s.check_agreement()
                    got = list(s.search([q, [-x for x in q]], 5, 6))
                    back = s.gather(0, [(5, i) for i in self.facts])
                    return got, back
                finally:
                    s.close()
            res = run_ranks(tp, rank_fn)
            for r, (got, back) in enumerate(res):
                assert got == want, "tp %d rank %d: sharded search differs from the unsharded store" % (tp, r)
                if r == 0:
                    for (k, v), i in zip(back, self.facts):
                        assert (k, v) == (self.facts[i][1], self.facts[i][2]), "gathered fact %d" % i
                else:
                    assert back == []

    def test_failure_on_one_rank(self):
        def rank_fn(c):
            s = self.store(c, 2, c.rank)
            try:
                if c.rank == 1:  # only rank 1 has fact 3 already
                    k, v = self.slice(3, 2, 2)
                    s.put(5, 3, k, v, embedding=self.facts[3][3])
                items = [(5, i, self.facts[i][1], self.facts[i][2], self.facts[i][3]) if c.rank == 0 else (5, i)
                         for i in (2, 3)]
                with pytest.raises(kvi.ExistsError if c.rank == 1 else kvi.PeerError):
                    s.put_scatter(0, items)
                return s.stats().facts
            finally:
                s.close()
        assert run_ranks(2, rank_fn) == [0, 1]  # nothing was added anywhere

    def test_embedding_rank_and_errors(self):
        assert kvi.embedding_rank(7, 123456789, 8) == 7  # fixed forever (tests/unit/test_tp.c)
        assert kvi.embedding_rank(1, 2, 0) is None
        with pytest.raises(kvi.InvalidArgumentError):
            kvi.CommGroup(0)
        g = kvi.CommGroup(2)
        c = kvi.Comm.local(g, 0)
        with pytest.raises(kvi.ExistsError):
            kvi.Comm.local(g, 0)
        assert (c.rank, c.size) == (0, 2)
        assert c.async_errors() == 0
        c.close()
        g.close()
        m = kvi.Model(L, H, D)
        with pytest.raises(kvi.InvalidArgumentError):  # sharded embeddings need a communicator
            kvi.Store(m, 1 << 20, backend=kvi.Backend.CPU, embedding_dim=E,
                      embedding_placement=kvi.EmbeddingPlacement.SHARDED)
        s = kvi.Store(m, 1 << 20, backend=kvi.Backend.CPU)
        self.closing.append(s)
        with pytest.raises(kvi.UnsupportedError):
            s.check_agreement()


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
