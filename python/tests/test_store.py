"""Store round trips with fp32/fp16/bf16 buffers (every storage, input and output
type, against Python's own round-to-nearest-even conversions), strided sources,
accounting, listing, tenants and embeddings."""
from __future__ import annotations

import array
import ctypes
import math
import sys

import pytest

from kvi_testutil import FakeTensor, bits_of, case, encode, f32, rand_values, rng, round_to
import kvinject as kvi
from kvinject import DType

FLOATS = (DType.FP32, DType.FP16, DType.BF16)


class StoreCase:
    L, H, D = 3, 2, 8

    @pytest.fixture(autouse=True)
    def _closing(self, closing):
        self.closing = closing

    def make(self, **kw):
        kw.setdefault("backend", kvi.Backend.CPU)
        model = kvi.Model(self.L, self.H, self.D)
        store = kvi.Store(model, kw.pop("budget", 1 << 20), **kw)
        model.close()  # the store copied what it needs
        self.closing.append(store)
        return store

    def n(self, tokens):
        return self.L * tokens * self.H * self.D


class TestRoundTrip(StoreCase):
    def test_every_dtype_combination(self):
        r = rng(1)
        T = 5
        # fp32 values with full mantissas: every conversion rounds
        values_k = rand_values(r, self.n(T), exact=False)
        values_v = rand_values(r, self.n(T), exact=False)
        for sdt in FLOATS:
            store = self.make(dtype=sdt)
            for idt in FLOATS:
                k, v = encode(values_k, idt), encode(values_v, idt)
                fid = int(idt)
                store.put(7, fid, k, v, dtype=idt if idt != DType.FP32 else None)
                for odt in FLOATS:
                    with case(store=sdt.name, input=idt.name, output=odt.name):
                        rk, rv = store.read(7, fid, dtype=odt)
                        for got, vals in ((rk, values_k), (rv, values_v)):
                            # input dtype -> storage dtype -> output dtype, each rounding to nearest even
                            want = [round_to(round_to(round_to(x, idt), sdt), odt) for x in vals]
                            assert bits_of(got) == bits_of(encode(want, odt))

    def test_read_into_given_buffers_and_ctypes(self):
        r = rng(2)
        store = self.make(dtype=DType.FP32)
        vals = rand_values(r, self.n(4))
        store.put(1, 1, (ctypes.c_float * len(vals))(*vals), array.array("f", vals))
        k = (ctypes.c_float * len(vals))()
        v = bytearray(4 * len(vals))
        out = store.read(1, 1, k, memoryview(v).cast("f"))
        assert out[0] is k
        assert list(k) == vals
        assert list(memoryview(v).cast("f")) == vals
        with pytest.raises(kvi.MismatchError):
            store.read(1, 1, (ctypes.c_float * self.n(3))(), (ctypes.c_float * self.n(3))())  # 3 tokens, fact has 4

    def test_strided_sources_and_destinations(self):
        """A [T, L, H, 2, D] buffer (K and V interleaved per head) seen as the
        [L, T, H, D] views of K and V: layer stride H*2*D, token stride L*H*2*D,
        head stride 2*D, v = k + D. The test indexes the buffer by its own shape."""
        r = rng(3)
        T, L, H, D = 6, self.L, self.H, self.D
        buf = array.array("f", rand_values(r, T * L * H * 2 * D))
        store = self.make(dtype=DType.FP32)
        base = FakeTensor(buf, (T * L * H * 2 * D,))
        k = FakeTensor(buf, (L, T, H, D), (H * 2 * D, L * H * 2 * D, 2 * D, 1))
        v = FakeTensor(buf, (L, T, H, D), (H * 2 * D, L * H * 2 * D, 2 * D, 1), offset=D)
        del base
        store.put(2, 9, k, v)
        rk, rv = store.read(2, 9)

        def at(t, l, h, kv, d):
            return buf[(((t * L + l) * H + h) * 2 + kv) * D + d]

        for l in range(L):
            for t in range(T):
                for h in range(H):
                    for d in range(D):
                        i = ((l * T + t) * H + h) * D + d
                        assert rk[i] == at(t, l, h, 0, d)
                        assert rv[i] == at(t, l, h, 1, d)
        # and read back into the same strided layout of a fresh buffer
        out = array.array("f", [0.0] * len(buf))
        ko = FakeTensor(out, (L, T, H, D), (H * 2 * D, L * H * 2 * D, 2 * D, 1))
        vo = FakeTensor(out, (L, T, H, D), (H * 2 * D, L * H * 2 * D, 2 * D, 1), offset=D)
        store.read(2, 9, ko, vo)
        assert list(out) == list(buf)

    def test_kvview(self):
        r = rng(4)
        store = self.make(dtype=DType.BF16)
        T = 3
        vals = rand_values(r, 2 * self.n(T))
        buf = encode(vals, DType.BF16)
        from kvinject._buffers import as_array
        a = as_array(buf, "buf")
        half = self.n(T) * 2  # bytes of K
        view = kvi.KVView(kvi.Memory.HOST, DType.BF16, self.L, T, self.H, self.D, T * self.H * self.D,
                          self.H * self.D, self.D, a.ptr, a.ptr + half, keep=a)
        store.put(1, 2, view)
        rk, rv = store.read(1, 2)
        assert list(rk) == vals[:self.n(T)]
        assert list(rv) == vals[self.n(T):]

    def test_shape_checks(self):
        store = self.make(dtype=DType.FP32)
        buf = array.array("f", [0.0] * self.n(2))
        with pytest.raises(ValueError):  # 3-D tensor
            t = FakeTensor(buf, (self.L, 2, self.H * self.D))
            store.put(1, 1, t, t)
        with pytest.raises(ValueError):  # K and V strides differ
            store.put(1, 1, FakeTensor(buf, (self.L, 2, self.H, self.D)),
                      FakeTensor(buf, (self.L, 2, self.H, self.D), (2 * self.H * self.D, self.H * self.D, 1, self.H)))
        with pytest.raises(ValueError):  # head vectors not contiguous
            t = FakeTensor(buf, (self.L, 2, self.H, self.D), (2 * self.H * self.D, self.H * self.D, 1, self.H))
            store.put(1, 1, t, t)
        with pytest.raises(kvi.MismatchError):  # 4 layers for a 3-layer model
            t = FakeTensor(array.array("f", [0.0] * (4 * self.H * self.D)), (4, 1, self.H, self.D))
            store.put(1, 1, t, t)
        assert store.count(1) == 0


class TestFacts(StoreCase):
    def test_accounting_list_count_remove(self):
        r = rng(5)
        P = 4
        store = self.make(dtype=DType.FP16, page_tokens=P)
        st = store.stats()
        page_bytes = self.L * 2 * self.H * P * self.D * 2
        assert (st.backend, st.device, st.dtype, st.page_tokens, st.page_bytes) == \
               (kvi.Backend.CPU, -1, DType.FP16, P, page_bytes)
        assert st.pages_total == (1 << 20) // page_bytes
        facts = {(1, 30): 5, (1, 2): 4, (1, 17): 1, (2, 2): 9, (3, 1): 8}
        for (tenant, fid), T in facts.items():
            k = encode(rand_values(r, self.n(T)), DType.FP32)
            store.put(tenant, fid, k, k)
        pages = sum(-(-T // P) for T in facts.values())
        tokens = sum(facts.values())
        st = store.stats()
        assert (st.facts, st.tenants, st.pages_used) == (5, 3, pages)
        assert st.bytes_used == pages * page_bytes
        assert st.bytes_payload == tokens * self.L * 2 * self.H * self.D * 2
        assert store.list(1) == [2, 17, 30]
        assert store.list(2) == [2]
        assert store.list(99) == []
        assert [store.count(t) for t in (1, 2, 3, 99)] == [3, 1, 1, 0]
        assert store.fact_tokens(2, 2) == 9
        assert store.fact_tokens(1, 2) == 4
        store.remove(1, 17)
        with pytest.raises(kvi.NotFoundError):
            store.remove(1, 17)
        with pytest.raises(kvi.NotFoundError):
            store.read(2, 17)  # tenant 2 never had fact 17
        assert store.list(1) == [2, 30]
        st = store.stats()
        assert (st.facts, st.pages_used) == (4, pages - 1)

    def test_large_list(self):
        store = self.make(dtype=DType.FP32, page_tokens=1)
        ids = [(i * 7919) % 1000 + 1 for i in range(300)]
        k = array.array("f", [0.5] * self.n(1))
        for i in ids:
            store.put(4, i, k, k)
        assert store.list(4) == sorted(set(ids))

    def test_big_ids_and_tenants(self):
        store = self.make(dtype=DType.FP32)
        k = array.array("f", [0.25] * self.n(1))
        top = (1 << 64) - 2
        store.put(top, top, k, k)
        assert store.list(top) == [top]
        with pytest.raises(OverflowError):
            store.put(1 << 64, 1, k, k)


class TestEmbeddings(StoreCase):
    def test_inner_product_storage_rounding(self):
        r = rng(6)
        dim = 12
        for edt in FLOATS:
            with case(embedding_dtype=edt.name):
                store = self.make(dtype=DType.FP32, embedding_dim=dim, embedding_dtype=edt)
                k = array.array("f", [1.0] * self.n(1))
                e = [f32(r.uniform(-3, 3)) for _ in range(dim)]
                store.put(1, 1, k, k, embedding=e)
                assert list(store.get_embedding(1, 1)) == [round_to(x, edt) for x in e]
                # an fp16 and a bf16 buffer as the embedding
                store.put(1, 2, k, k, embedding=encode(e, DType.FP16), embedding_dtype=DType.FP16)
                assert list(store.get_embedding(1, 2)) == [round_to(round_to(x, DType.FP16), edt) for x in e]
                store.put(1, 3, k, k, embedding=encode(e, DType.BF16), embedding_dtype=DType.BF16)
                assert list(store.get_embedding(1, 3)) == [round_to(round_to(x, DType.BF16), edt) for x in e]

    def test_cosine_normalizes(self):
        r = rng(7)
        dim = 20
        for edt in FLOATS:
            with case(embedding_dtype=edt.name):
                store = self.make(dtype=DType.FP32, embedding_dim=dim, embedding_dtype=edt, metric=kvi.Metric.COSINE)
                k = array.array("f", [1.0] * self.n(1))
                e = [f32(r.uniform(-3, 3)) for _ in range(dim)]
                store.put(1, 1, k, k, embedding=e)
                norm = math.sqrt(math.fsum(x * x for x in e))
                got = store.get_embedding(1, 1)
                u = {DType.FP32: 2.0 ** -24, DType.FP16: 2.0 ** -11, DType.BF16: 2.0 ** -8}[edt]
                for g, x in zip(got, e):
                    assert abs(g - x / norm) <= 2 * u * abs(x / norm) + 1e-30
                # a zero vector stays zero
                store.put(1, 2, k, k, embedding=[0.0] * dim)
                assert list(store.get_embedding(1, 2)) == [0.0] * dim

    def test_embedding_errors(self):
        store = self.make(dtype=DType.FP32, embedding_dim=4)
        k = array.array("f", [1.0] * self.n(1))
        with pytest.raises(kvi.InvalidArgumentError):
            store.put(1, 1, k, k)  # missing
        with pytest.raises(kvi.InvalidArgumentError) as cm:
            store.put(1, 1, k, k, embedding=[1.0, float("inf"), 0.0, 0.0])
        assert "embedding" in cm.value.message
        with pytest.raises(ValueError):
            store.put(1, 1, k, k, embedding=[1.0, 2.0])  # 2 values, dim 4
        assert store.count(1) == 0
        plain = self.make(dtype=DType.FP32)
        with pytest.raises(kvi.InvalidArgumentError):
            plain.put(1, 1, k, k, embedding=[1.0])  # a store without embeddings
        with pytest.raises(kvi.InvalidArgumentError):
            plain.get_embedding(1, 1)


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
