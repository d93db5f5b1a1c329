"""Facts' contexts and stale facts (experimental): Store.put(context_ids=...), captures'
context_ids and encode_batch's contexts, Store.fact_context, Store.remove making the facts
computed with the removed one in context stale (keep_dependents=True: none), Store.stale,
StaleFactError from injections with nothing written, and store files keeping both."""
from __future__ import annotations

import array
import os
import tempfile

import pytest

from kvi_testutil import empty, rand_values, rng
import kvinject as kvi
from kvinject import DType

L, H, D = 2, 2, 8
B, S = 2, 16
OFFS = array.array("i", [0, 1, 2])  # CSR block tables: one block (a batch row) per request


class TestContext:
    @pytest.fixture(autouse=True)
    def _setup(self, closing):
        self.model = kvi.Model(L, H, D)
        self.model.set_rope(layer=-1, style=kvi.RopeStyle.NEOX, theta=10000.0)
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=4)
        closing.append(self.store)
        r = rng(11)
        self.kv = {}
        for fid, n in ((1, 2), (2, 3), (3, 1), (4, 2)):
            self.kv[fid] = (array.array("f", rand_values(r, L * n * H * D)),
                            array.array("f", rand_values(r, L * n * H * D)))
        # the notes encoding's shape: each fact after the earlier ones
        for fid in (1, 2, 3, 4):
            self.store.put(1, fid, *self.kv[fid], context_ids=list(range(1, fid)))
        self.keys = [empty(B * H * S * D, DType.FP32) for _ in range(L)]
        self.values = [empty(B * H * S * D, DType.FP32) for _ in range(L)]
        self.layout = kvi.CacheLayout.hf(self.keys, self.values, shape=(B, H, S, D))
        self.inj = kvi.Injector(self.store, self.layout)
        closing.append(self.inj)

    def cache(self):
        return b"".join(bytes(x) for x in self.keys + self.values)

    def test_context_kept(self):
        assert self.store.fact_context(1, 1) == ([], False)
        assert self.store.fact_context(1, 4) == ([1, 2, 3], False)
        assert self.store.stale(1) == [] and self.store.stale(99) == []
        with pytest.raises(kvi.NotFoundError, match="context id 0 \\(42\\) of fact 5 names no fact of tenant 1"):
            self.store.put(1, 5, *self.kv[1], context_ids=[42])
        with pytest.raises(kvi.InvalidArgumentError, match="names itself"):
            self.store.put(1, 5, *self.kv[1], context_ids=[1, 5])
        with pytest.raises(OverflowError):
            self.store.put(1, 5, *self.kv[1], context_ids=[-1])
        with pytest.raises(TypeError):
            self.store.put(1, 5, *self.kv[1], context_ids=[1.5])
        assert self.store.count(1) == 4
        self.store.put(1, 4, *self.kv[4], context_ids=[2], replace=True)
        assert self.store.fact_context(1, 4) == ([2], False)
        with pytest.raises(kvi.NotFoundError):
            self.store.fact_context(1, 99)

    def test_remove_makes_stale_and_inject_refuses(self):
        self.inj.inject(kvi.InjectRequest(1, [1, 3], [0]))
        self.store.remove(1, 2)
        assert self.store.stale(1) == [3, 4]
        assert self.store.fact_context(1, 3) == ([1, 2], True)
        assert self.store.stats().facts_stale == 2
        before = self.cache()
        with pytest.raises(kvi.StaleFactError, match=r"requests\[0\]: fact 3 of tenant 1 is stale") as cm:
            self.inj.inject(kvi.InjectRequest(1, [1, 3], [1]))
        assert cm.value.status == kvi.Status.ERR_STALE
        assert "Store.stale" in cm.value.message  # the C name given as the binding's
        with pytest.raises(kvi.StaleFactError):
            self.inj.inject_batch([1, 4], [0, 1], fact_offsets=array.array("i", [0, 1, 2]),
                                  block_table_offsets=OFFS, tenant=1)
        assert self.cache() == before
        # put again, in order, with a context of fresh facts: fresh
        self.store.put(1, 3, *self.kv[3], context_ids=[1], replace=True)
        assert self.store.stale(1) == [4]
        self.store.put(1, 4, *self.kv[4], context_ids=[1, 3], replace=True)
        assert self.store.stale(1) == []
        self.inj.inject(kvi.InjectRequest(1, [1, 3, 4], [1]))
        assert self.cache() != before

    def test_keep_dependents(self):
        self.store.remove(1, 2, keep_dependents=True)
        assert self.store.stale(1) == []
        with pytest.raises(kvi.NotFoundError):
            self.store.remove(1, 2, keep_dependents=True)
        self.store.remove(1, 1)
        assert self.store.stale(1) == [3, 4]

    def test_captures_keep_context(self, closing):
        enc = kvi.Encoder(self.store, self.layout)
        closing.append(enc)
        self.inj.inject(kvi.InjectRequest(1, [1, 2], [0]))
        enc.encode([kvi.Capture(1, 11, [0], 2, context_ids=[1]),
                    kvi.Capture(1, 12, [0], 3, first_slot=2, context_ids=[1, 11])])
        assert self.store.fact_context(1, 12) == ([1, 11], False)
        with pytest.raises(kvi.NotFoundError, match=r"captures\[0\]: context id 0 \(14\)"):
            enc.encode([kvi.Capture(1, 13, [0], 2, context_ids=[14]), kvi.Capture(1, 14, [0], 1)])
        assert self.store.count(1) == 6
        enc.encode_batch([21, 22], array.array("i", [2, 3]), [0, 0], block_table_offsets=OFFS, tenant=1,
                         contexts=[[1], None])
        assert self.store.fact_context(1, 21) == ([1], False)
        assert self.store.fact_context(1, 22) == ([], False)
        with pytest.raises(ValueError):
            enc.encode_batch([23], array.array("i", [2]), [0], block_table_offsets=OFFS[:2], tenant=1,
                             contexts=[[1], [2]])
        self.store.remove(1, 1)
        assert self.store.stale(1) == [2, 3, 4, 11, 12, 21]

    def test_files_keep_context(self):
        self.store.remove(1, 3)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.kvi")
            self.store.save(path)
            other = kvi.Store.load(self.model, path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32,
                                   page_tokens=4)
            try:
                assert other.stale(1) == [4]
                assert other.fact_context(1, 4) == ([1, 2, 3], True)
                assert other.fact_context(1, 2) == ([1], False)
            finally:
                other.close()


def test_memory_index_skips_stale_facts(closing):
    from kvinject.vllm.retrieval import MemoryIndex
    model = kvi.Model(L, H, D)
    model.set_rope(layer=-1, style=kvi.RopeStyle.NEOX, theta=10000.0)
    closing.append(model)
    store = kvi.Store(model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=4, embedding_dim=2)
    closing.append(store)
    kv = array.array("f", [0.5] * (L * 2 * H * D))
    for fid in (1, 2, 3):
        store.put(1, fid, kv, kv, embedding=[1.0, 0.1 * fid], context_ids=list(range(1, fid)))
    index = MemoryIndex.__new__(MemoryIndex)  # its store without a file: what retrieve reads
    index._store = store
    assert sorted(f for f, _, _ in index.retrieve(1, [1.0, 0.0], 3)) == [1, 2, 3]
    store.remove(1, 2, keep_dependents=True)
    store.remove(1, 1)  # 3 was computed after 1: stale
    assert store.stale(1) == [3]
    assert index.retrieve(1, [1.0, 0.0], 3) == []
