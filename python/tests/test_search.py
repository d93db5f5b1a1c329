"""Search against a brute-force ranking computed here in float64 (math.fsum of the
products of the embeddings and queries as the store keeps them, rounded by this
file's own conversions), ties by fact id, every query form and output form."""
from __future__ import annotations

import array
import math
import sys

import pytest

from kvi_testutil import FakeTensor, case, encode, f32, rng, round_to
import kvinject as kvi
from kvinject import DType

FLOATS = (DType.FP32, DType.FP16, DType.BF16)


class SearchCase:
    @pytest.fixture(autouse=True)
    def _closing(self, closing):
        self.closing = closing

    def make(self, dim, **kw):
        model = kvi.Model(1, 1, 4)
        kw.setdefault("backend", kvi.Backend.CPU)
        store = kvi.Store(model, 1 << 20, dtype=DType.FP32, page_tokens=1, embedding_dim=dim, **kw)
        self.closing.append(store)
        self.kv = array.array("f", [0.5] * 4)
        return store

    def fill(self, store, r, tenants, per_tenant, dim, gen=None):
        """Random facts; returns {tenant: {fact_id: embedding}} of the values put."""
        facts = {}
        for t in tenants:
            facts[t] = {}
            ids = r.sample(range(1, 10 * per_tenant), per_tenant)
            for fid in ids:
                e = gen() if gen else [f32(r.uniform(-1, 1)) for _ in range(dim)]
                store.put(t, fid, self.kv, self.kv, embedding=e)
                facts[t][fid] = e
        return facts

    @staticmethod
    def kept(e, edt, cosine):
        if cosine:
            n = math.sqrt(math.fsum(x * x for x in e))
            e = [x / n for x in e] if n else list(e)
        return [round_to(x, edt) for x in e]

    def reference(self, facts, q, edt, cosine):
        """{fact_id: (exact score, bound on the library's difference from it)}."""
        qk = self.kept(q, edt, cosine)
        out = {}
        u = {DType.FP32: 2.0 ** -24, DType.FP16: 2.0 ** -11, DType.BF16: 2.0 ** -8}[edt]
        for fid, e in facts.items():
            ek = self.kept(e, edt, cosine)
            prods = [a * b for a, b in zip(qk, ek)]
            s = math.fsum(prods)
            mag = math.fsum(abs(p) for p in prods)
            # fp32 rounding of the score, double summation; for cosine the library may round
            # the scaled values directly from double (not through fp32): one unit of edt each
            tol = 2.0 ** -23 * abs(s) + 1e-12 * mag + (4 * u * mag if cosine and edt != DType.FP32 else 0.0)
            out[fid] = (s, tol)
        return out

    def check(self, res_row, count, ref, k):
        n = min(k, len(ref))
        assert count == n
        ids = [i for i, _ in res_row]
        assert len(set(ids)) == len(ids), "duplicate ids"
        assert set(ids) <= set(ref), "ids of another tenant: %s" % (set(ids) - set(ref))
        expected = sorted(ref, key=lambda f: (-ref[f][0], f))[:n]
        for pos, (fid, score) in enumerate(res_row):
            s, tol = ref[fid]
            assert abs(score - s) <= tol, "fact %d: score %r, reference %r" % (fid, score, s)
            if fid != expected[pos]:
                se, tole = ref[expected[pos]]
                assert abs(s - se) <= tol + tole, \
                       "rank %d: fact %d (%r) where the reference has %d (%r)" % (pos, fid, s,
                                                                                  expected[pos], se)
        for a, b in zip(res_row, res_row[1:]):
            assert a[1] > b[1] or (a[1] == b[1] and a[0] < b[0]), "order %r then %r" % (a, b)


class TestRanking(SearchCase):
    def run_metric(self, cosine, edt, seed):
        r = rng(seed)
        dim = 32
        store = self.make(dim, embedding_dtype=edt, metric=kvi.Metric.COSINE if cosine else kvi.Metric.INNER_PRODUCT)
        facts = self.fill(store, r, (1, 2, 3), 40, dim)
        queries = [[f32(r.uniform(-1, 1)) for _ in range(dim)] for _ in range(7)]
        tenants = [1, 2, 3, 1, 2, 3, 99]
        for k in (1, 10, 64):
            res = store.search(queries, tenants, k)
            assert len(res) == 7
            for i, (q, t) in enumerate(zip(queries, tenants)):
                ref = self.reference(facts.get(t, {}), q, edt, cosine)
                self.check(res[i], res.counts[i], ref, k)
                row_ids = res.ids[i * k:(i + 1) * k]
                row_scores = res.scores[i * k:(i + 1) * k]
                for j in range(res.counts[i], k):  # padding
                    assert row_ids[j] == kvi.SEARCH_NO_ID
                    assert row_scores[j] == float("-inf")

    def test_inner_product(self):
        for edt in FLOATS:
            with case(embedding_dtype=edt.name):
                self.run_metric(False, edt, 10 + int(edt))

    def test_cosine(self):
        for edt in FLOATS:
            with case(embedding_dtype=edt.name):
                self.run_metric(True, edt, 20 + int(edt))

    def test_exact_ties_rank_by_id(self):
        r = rng(30)
        dim = 6
        store = self.make(dim)
        pool = [[float(r.randint(-2, 2)) for _ in range(dim)] for _ in range(4)]
        facts = self.fill(store, r, (5,), 30, dim, gen=lambda: list(r.choice(pool)))
        q = [1.0, -2.0, 0.0, 3.0, 1.0, -1.0]
        res = store.search([q], 5, 30)
        expected = sorted(facts[5], key=lambda f: (-math.fsum(a * b for a, b in zip(q, facts[5][f])), f))
        assert [i for i, _ in res[0]] == expected
        assert [s for _, s in res[0]] == [math.fsum(a * b for a, b in zip(q, facts[5][f])) for f in expected]

    def test_removed_facts_and_isolation(self):
        r = rng(31)
        dim = 8
        store = self.make(dim)
        facts = self.fill(store, r, (1, 2), 10, dim)
        gone = sorted(facts[1])[:4]
        for fid in gone:
            store.remove(1, fid)
            del facts[1][fid]
        q = [f32(r.uniform(-1, 1)) for _ in range(dim)]
        res = store.search([q, q], [1, 2], 20)
        assert list(res.counts) == [6, 10]
        self.check(res[0], 6, self.reference(facts[1], q, DType.FP32, False), 20)
        self.check(res[1], 10, self.reference(facts[2], q, DType.FP32, False), 20)
        assert store.search([q], 3, 5)[0] == []


class TestForms(SearchCase):
    def test_query_forms_agree(self):
        r = rng(40)
        dim = 8
        store = self.make(dim)
        self.fill(store, r, (1,), 12, dim)
        # values exact in fp16 and bf16, so every form is the same query
        qs = [[float(r.randint(-8, 8)) / 4 for _ in range(dim)] for _ in range(3)]
        flat = [x for q in qs for x in q]
        base = store.search(qs, 1, 5)
        forms = {
            "flat array": (array.array("f", flat), {}),
            "2-D memoryview": (memoryview(bytearray(array.array("f", flat).tobytes())).cast("f", (3, dim)), {}),
            "tensor": (FakeTensor(array.array("f", flat), (3, dim)), {}),
            "fp16 buffer": (encode(flat, DType.FP16), {"query_dtype": DType.FP16}),
            "bf16 tensor": (FakeTensor(encode(flat, DType.BF16), (3, dim), dtype="torch.bfloat16"), {}),
        }
        for name, (q, kw) in forms.items():
            with case(form=name):
                res = store.search(q, [1, 1, 1], 5, **kw)
                assert list(res.ids) == list(base.ids)
                assert list(res.scores) == list(base.scores)
        one = store.search(qs[1], 1, 5)  # a single flat vector is one query
        assert one[0] == base[1]

    def test_output_buffers(self):
        r = rng(41)
        dim = 8
        store = self.make(dim)
        self.fill(store, r, (1, 2), 6, dim)
        qs = [[f32(r.uniform(-1, 1)) for _ in range(dim)] for _ in range(2)]
        base = store.search(qs, [1, 2], 8)
        ids, scores, counts = array.array("Q", [0] * 16), array.array("f", [0.0] * 16), array.array("i", [0] * 2)
        out = store.search(qs, [1, 2], 8, out=(ids, scores, counts))
        assert out[0] is ids
        assert (list(ids), list(scores), list(counts)) == \
               (list(base.ids), list(base.scores), list(base.counts))
        # torch-style int64 ids: KVI_SEARCH_NO_ID reads as -1
        i64 = array.array("q", [0] * 16)
        store.search(qs, [1, 2], 8, out=(FakeTensor(i64, (2, 8), dtype="torch.int64"), scores, counts))
        assert list(i64[6:8]) == [-1, -1]
        assert [x & (2 ** 64 - 1) for x in i64] == list(base.ids)
        with pytest.raises(ValueError):
            store.search(qs, [1, 2], 8, out=(array.array("Q", [0] * 15), scores, counts))

    def test_errors(self):
        dim = 4
        store = self.make(dim)
        store.put(1, 1, self.kv, self.kv, embedding=[1, 0, 0, 0])
        q = [[1.0, 0.0, 0.0, 0.0]]
        for k in (0, kvi.SEARCH_MAX_K + 1):
            with pytest.raises(kvi.InvalidArgumentError):
                store.search(q, 1, k)
        assert len(store.search(q, 1, kvi.SEARCH_MAX_K)[0]) == 1
        with pytest.raises(kvi.MismatchError):
            store.search([[1.0, 0.0, 0.0]], 1, 1)
        with pytest.raises(kvi.InvalidArgumentError) as cm:
            store.search([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, float("nan")]], 1, 1)
        assert "queries[1][3]" in cm.value.message
        with pytest.raises(ValueError):
            store.search(q, [1, 2], 1)  # two tenants, one query
        with pytest.raises(ValueError):
            store.search([[1.0, 2.0], [1.0]], 1, 1)  # ragged
        with pytest.raises(kvi.MemoryKindError):
            store.search(FakeTensor(array.array("f", [1.0] * 4), (1, 4), device="cuda"), 1, 1)
        plain = kvi.Store(kvi.Model(1, 1, 4), 1 << 16, backend=kvi.Backend.CPU)
        self.closing.append(plain)
        with pytest.raises(kvi.InvalidArgumentError):
            plain.search(q, 1, 1)
        assert len(store.search([], [], 3)) == 0


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
