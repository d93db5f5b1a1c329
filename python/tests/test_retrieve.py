"""Injector.retrieve_inject (kvi_retrieve_inject, CPU store): the same cache bytes and
ids as Store.search followed by Injector.inject of the winners, in both orders."""
from __future__ import annotations

import array
import sys

import pytest

from kvi_testutil import f32, rng
import kvinject as kvi
from kvinject import DType

L, H, D, E, BS, NB = 2, 2, 8, 8, 4, 32


class TestRetrieve:
    @pytest.fixture(autouse=True)
    def _setup(self, closing):
        self.closing = closing
        r = rng(77)
        self.model = kvi.Model(L, H, D)
        self.model.set_rope(style=kvi.RopeStyle.NONE)  # the expected cache is an unrotated copy
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=4,
                               embedding_dim=E)
        self.closing.append(self.store)
        for i in range(20):
            T = r.randint(1, 4)
            n = L * T * H * D
            k = array.array("f", [f32(r.uniform(-2, 2)) for _ in range(n)])
            v = array.array("f", [f32(r.uniform(-2, 2)) for _ in range(n)])
            self.store.put(1 + i % 2, 100 + i, k, v, embedding=[f32(r.uniform(-1, 1)) for _ in range(E)])
        self.q = [[f32(r.uniform(-1, 1)) for _ in range(E)] for _ in range(2)]

    def injector(self):
        cache = [array.array("f", bytes(4 * NB * 2 * BS * H * D)) for _ in range(L)]
        layout = kvi.CacheLayout.preset(kvi.CachePreset.VLLM_FLASHINFER, DType.FP32, L, H, D, BS, NB,
                                        k_layers=cache, memory=kvi.Memory.HOST)
        return kvi.Injector(self.store, layout), cache

    def test_equals_search_then_inject(self):
        for best_last in (False, True):
            inj_a, cache_a = self.injector()
            inj_b, cache_b = self.injector()
            tables = [list(range(0, 16)), list(range(16, 32))]
            reqs = [kvi.RetrieveRequest(1, tables[0], first_slot=1, start_position=3, best_last=best_last),
                    kvi.RetrieveRequest(2, tables[1], start_position=50, best_last=best_last)]
            got = inj_a.retrieve_inject(self.q, reqs, 6)
            res = self.store.search(self.q, [1, 2], 6)
            want = []
            for i, rr in enumerate(reqs):
                ids = [f for f, _ in res[i]]
                order = list(reversed(ids)) if best_last else ids
                inj_b.inject(kvi.InjectRequest(rr.tenant, order, rr.block_table, first_slot=rr.first_slot,
                                               start_position=rr.start_position))
                want.append((ids, inj_b.plan(rr.tenant, ids)))
            assert got == want
            assert [bytes(c) for c in cache_a] == [bytes(c) for c in cache_b]
            assert any(x != 0 for x in cache_a[0])
            inj_a.close()
            inj_b.close()

    def test_out_buffers(self):
        # the same call with caller-owned host outputs fills them with what the default returns
        tables = [list(range(0, 16)), list(range(16, 32))]
        reqs = [kvi.RetrieveRequest(1, tables[0], first_slot=1, start_position=3),
                kvi.RetrieveRequest(2, tables[1], start_position=50, best_last=True)]
        inj_a, cache_a = self.injector()
        inj_b, cache_b = self.injector()
        self.closing.append(inj_a)
        self.closing.append(inj_b)
        want = inj_a.retrieve_inject(self.q, reqs, 12)  # more than a tenant's 10 facts
        ids, counts, tokens = array.array("Q", [7] * 24), array.array("i", [-1, -1]), array.array("i", [-1, -1])
        assert inj_b.retrieve_inject(self.q, reqs, 12, out=(ids, counts, tokens))[0] is ids
        assert list(counts) == [10, 10]
        assert [(list(ids[i * 12:i * 12 + counts[i]]), tokens[i]) for i in range(2)] == want
        assert [ids[i * 12 + j] for i in range(2) for j in (10, 11)] == [kvi.SEARCH_NO_ID] * 4
        assert [bytes(c) for c in cache_a] == [bytes(c) for c in cache_b]
        with pytest.raises(ValueError):  # room for one query only
            inj_b.retrieve_inject(self.q, reqs, 12, out=(array.array("Q", [0] * 12), counts, tokens))

    def test_errors(self):
        inj, _ = self.injector()
        self.closing.append(inj)
        with pytest.raises(ValueError):
            inj.retrieve_inject(self.q, [kvi.RetrieveRequest(1, [0])], 2)  # 2 queries, 1 request
        with pytest.raises(kvi.InvalidArgumentError):  # 6 facts of up to 4 tokens need more than 4 slots
            inj.retrieve_inject(self.q[:1], [kvi.RetrieveRequest(1, [0])], 6)


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
