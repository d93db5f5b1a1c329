"""Capture (kvi_encode) from a CPU Hugging Face cache: keys written rotated at
positions P by this test's float64 RoPE are stored un-rotated (compared with the
original pre-RoPE keys), then injected at positions Q (compared with the
reference rotation at Q). All-or-nothing and replace semantics, embeddings."""
from __future__ import annotations

import array
import sys

import pytest

from kvi_testutil import FakeTensor, RefRope, bits_of, case, empty, encode, rand_values, rng, round_to, unit_roundoff
import kvinject as kvi
from kvinject import DType, RopeScaling, RopeStyle

L, H, D = 3, 2, 16
B, S = 2, 32
ROPES = {-1: dict(style=RopeStyle.GPTJ, theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0,
                  original_max_position=8192), 2: dict(style=RopeStyle.NONE)}


class TestEncode:
    @pytest.fixture(autouse=True)
    def _setup(self, closing):
        self.model = kvi.Model(L, H, D)
        for layer, spec in ROPES.items():
            self.model.set_rope(layer=layer, **spec)
        self.ref = [RefRope(D, **ROPES.get(l, ROPES[-1])) for l in range(L)]
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=4,
                               embedding_dim=4)
        closing.append(self.store)

    def prefill(self, dtype, r, rows):
        """An HF cache of `dtype` with every (row, seq) token written as an engine would:
        keys rotated at pos[row][s]. Returns buffers, layout, and the pre-RoPE keys
        and values [row][s][l][h] -> D floats."""
        n = B * H * S * D
        keys = [empty(n, dtype) for _ in range(L)]
        values = [empty(n, dtype) for _ in range(L)]
        pre_k, pre_v = {}, {}
        for row, positions in rows.items():
            for s, p in enumerate(positions):
                for l in range(L):
                    for h in range(H):
                        x, v = rand_values(r, D), rand_values(r, D)
                        pre_k[(row, s, l, h)], pre_v[(row, s, l, h)] = x, v
                        y = self.ref[l].rotate(x, p)
                        at = ((row * H + h) * S + s) * D
                        for d in range(D):
                            keys[l][at + d] = encode([y[d]], dtype)[0]
                            values[l][at + d] = encode([v[d]], dtype)[0]
        lay = kvi.CacheLayout.hf(keys, values, shape=(B, H, S, D), dtype=None if dtype == DType.FP32 else dtype)
        return keys, values, lay, pre_k, pre_v

    def check_captured(self, fid, row, first, n, positions, pre_k, pre_v, cache_dtype):
        rk, rv = self.store.read(1, fid)
        T = self.store.fact_tokens(1, fid)
        assert T == n
        u = unit_roundoff(cache_dtype)
        for t in range(n):
            p = positions[t]
            for l in range(L):
                for h in range(H):
                    x, v = pre_k[(row, first + t, l, h)], pre_v[(row, first + t, l, h)]
                    y = self.ref[l].rotate(x, p)
                    tol = self.ref[l].tol(x, p)
                    at = ((l * T + t) * H + h) * D
                    for d in range(D):
                        # the cache held y rounded to its dtype: that error passes through the inverse
                        bound = 2 * tol[d] + 4 * u * max(abs(y[d]), max(abs(c) for c in y)) + 1e-30
                        assert abs(rk[at + d] - x[d]) <= bound, \
                               "fact %d token %d layer %d head %d dim %d" % (fid, t, l, h, d)
                        assert rv[at + d] == round_to(v[d], cache_dtype)
        return rk

    def test_capture_then_inject(self):
        for cdt in (DType.FP32, DType.BF16):
            with case(cache=cdt.name):
                r = rng(50 + int(cdt))
                pos0 = [3 * s + 11 for s in range(S)]  # positions are not sequence indices
                keys, values, lay, pre_k, pre_v = self.prefill(cdt, r, {0: list(range(S)), 1: pos0})
                enc = kvi.Encoder(self.store, lay)
                # context-window encoding: only the fact's range of each prefill
                emb = [0.5, -1.0, 2.0, 0.25]
                fid_a, fid_b = 50 + 10 * int(cdt), 51 + 10 * int(cdt)
                enc.encode([kvi.Capture(1, fid_a, [0], num_tokens=7, first_slot=6, start_position=6, embedding=emb),
                            kvi.Capture(1, fid_b, [1], num_tokens=9, first_slot=20, positions=pos0[20:29],
                                        embedding=encode(emb, DType.BF16), embedding_dtype=DType.BF16)])
                assert list(self.store.get_embedding(1, fid_a)) == emb
                self.check_captured(fid_a, 0, 6, 7, list(range(6, 13)), pre_k, pre_v, cdt)
                rk = self.check_captured(fid_b, 1, 20, 9, pos0[20:29], pre_k, pre_v, cdt)
                # inject the captured fact into a fresh fp32 cache at other positions
                k2 = [empty(B * H * S * D, DType.FP32) for _ in range(L)]
                v2 = [empty(B * H * S * D, DType.FP32) for _ in range(L)]
                inj = kvi.Injector(self.store, kvi.CacheLayout.hf(k2, v2, shape=(B, H, S, D)))
                q = [900 + 7 * t for t in range(9)]
                inj.inject(kvi.InjectRequest(1, [fid_b], [1], first_slot=2, positions=q))
                for t in range(9):
                    for l in range(L):
                        for h in range(H):
                            at = ((l * 9 + t) * H + h) * D
                            x = list(rk[at:at + D])
                            want, tol = self.ref[l].rotate(x, q[t]), self.ref[l].tol(x, q[t])
                            c = ((1 * H + h) * S + 2 + t) * D
                            for d in range(D):
                                assert abs(k2[l][c + d] - want[d]) <= tol[d] + 2.0 ** -23 * abs(want[d])
                inj.close()
                enc.close()

    def test_all_or_nothing_and_replace(self):
        r = rng(60)
        keys, values, lay, pre_k, pre_v = self.prefill(DType.FP32, r, {0: list(range(S)), 1: list(range(S))})
        enc = kvi.Encoder(self.store, lay)
        emb = [1.0, 0.0, 0.0, 0.0]
        good = kvi.Capture(1, 1, [0], num_tokens=4, embedding=emb)
        before = self.store.stats()
        for bad, exc in ((kvi.Capture(1, 2, [B], num_tokens=4, embedding=emb), kvi.InvalidArgumentError),
                         (kvi.Capture(1, 1, [1], num_tokens=4, embedding=emb), kvi.InvalidArgumentError),  # repeat
                         (kvi.Capture(1, 2, [1], num_tokens=0, embedding=emb), kvi.InvalidArgumentError),
                         (kvi.Capture(1, 2, [1], num_tokens=S + 1, embedding=emb), kvi.InvalidArgumentError),
                         (kvi.Capture(1, 2, [1], num_tokens=4), kvi.InvalidArgumentError)):  # no embedding
            with pytest.raises(exc):
                enc.encode([good, bad])
            after = self.store.stats()
            assert (after.facts, after.pages_used) == (before.facts, before.pages_used)
        with pytest.raises(ValueError):  # fewer positions than tokens, refused by the binding
            enc.encode(kvi.Capture(1, 2, [0], num_tokens=4, positions=[1, 2], embedding=emb))
        with pytest.raises(ValueError):  # capture block tables are host memory
            enc.encode(kvi.Capture(1, 2, FakeTensor(array.array("i", [0]), (1,), dtype="torch.int32",
                                                    device="cuda"), num_tokens=4, embedding=emb))
        enc.encode(good)
        first = bits_of(self.store.read(1, 1)[0])
        with pytest.raises(kvi.ExistsError):
            enc.encode(kvi.Capture(1, 1, [1], num_tokens=4, embedding=emb))
        assert bits_of(self.store.read(1, 1)[0]) == first
        enc.encode(kvi.Capture(1, 1, [1], num_tokens=5, embedding=emb, replace=True))
        assert self.store.fact_tokens(1, 1) == 5
        assert bits_of(self.store.read(1, 1)[0])[:64] != first[:64]
        enc.encode([])  # nothing to do


class TestEncodeBatch(TestEncode):
    """Encoder.encode_batch (kvi_encode_batched) stores what Encoder.encode stores."""

    def test_matches_per_capture_form(self):
        r = rng(70)
        pos1 = [5 * s + 2 for s in range(S)]
        keys, values, lay, pre_k, pre_v = self.prefill(DType.FP32, r, {0: list(range(S)), 1: pos1})
        enc = kvi.Encoder(self.store, lay)
        embs = [[0.5, -1.0, 2.0, 0.25], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 0.0]]
        spec = [(0, 3, 6, list(range(3, 9))), (1, 10, 9, pos1[10:19]), (0, 20, 4, list(range(20, 24)))]
        enc.encode([kvi.Capture(1, 100 + i, [row], num_tokens=n, first_slot=first, positions=pos, embedding=embs[i])
                    for i, (row, first, n, pos) in enumerate(spec)])
        flat_emb = array.array("f", [x for e in embs for x in e])
        flat_pos = [p for _, _, _, pos in spec for p in pos]
        for form, code in (("2-D", "i"), ("CSR", "q")):
            with case(form=form):
                base = 200 if form == "2-D" else 300
                ids = array.array("q", [base + i for i in range(3)])
                if form == "2-D":
                    tab = array.array("i", [row for row, _, _, _ in spec])
                    kw = dict(block_tables=memoryview(tab).cast("B").cast("i", (3, 1)))
                else:
                    kw = dict(block_tables=[row for row, _, _, _ in spec], block_table_offsets=[0, 1, 2, 3])
                enc.encode_batch(ids, array.array("i", [n for _, _, n, _ in spec]), tenant=1,
                                 first_slots=array.array("q", [f for _, f, _, _ in spec]),
                                 positions=array.array(code, flat_pos), embeddings=flat_emb, **kw)
                for i in range(3):
                    assert bits_of(self.store.read(1, base + i)[0]) == bits_of(self.store.read(1, 100 + i)[0])
                    assert bits_of(self.store.read(1, base + i)[1]) == bits_of(self.store.read(1, 100 + i)[1])
                    assert list(self.store.get_embedding(1, base + i)) == embs[i]
        before = self.store.stats()
        with pytest.raises(kvi.InvalidArgumentError):  # 19 positions for 18 tokens
            enc.encode_batch([400, 401, 402], [6, 9, 4], [0, 1, 0], block_table_offsets=[0, 1, 2, 3], tenant=1,
                             positions=flat_pos + [1], embeddings=flat_emb)
        with pytest.raises(kvi.InvalidArgumentError):  # a repeated id
            enc.encode_batch([400, 400], [2, 2], [0, 1], block_table_offsets=[0, 1, 2], tenant=1,
                             embeddings=flat_emb)
        after = self.store.stats()
        assert (after.facts, after.pages_used) == (before.facts, before.pages_used)
        enc.close()

    def test_block_table_offsets_past_the_table(self):
        """CSR block-table offsets whose last entry passes the end of block_tables are
        refused, naming the argument (the entries behind a short view were read as
        block ids; far past the end, a crash): nothing is stored."""
        keys, values, lay, _, _ = self.prefill(DType.FP32, rng(71), {0: list(range(S))})
        enc = kvi.Encoder(self.store, lay)
        rows = array.array("i", [0, 1])
        before = (self.store.stats(), self.store.list(1))
        for table, offsets, message in ((memoryview(rows)[:1], [0, 2], "block_table_offsets[1] is 2, past the end of "
                                         "block_tables (1 entries)"),
                                        (rows, [0, 1 << 30], "block_table_offsets[1] is 1073741824"),
                                        (rows, [-3, 1], "block_table_offsets[0] is -3")):
            with case(offsets=offsets):
                with pytest.raises(ValueError) as e:
                    enc.encode_batch([500], [40], table, block_table_offsets=offsets, tenant=1,
                                     embeddings=[0.0, 0.0, 1.0, 0.0])
                assert message in str(e.value)
                assert not isinstance(e.value, kvi.KviError)
                assert (self.store.stats(), self.store.list(1)) == before
        enc.close()


class TestLifetimes:
    def test_store_close_closes_its_injectors(self):
        m = kvi.Model(1, 1, 8)
        s = kvi.Store(m, 1 << 16, backend=kvi.Backend.CPU)
        k = [empty(8 * 4, DType.FP32)]
        inj = kvi.Injector(s, kvi.CacheLayout.hf(k, [empty(8 * 4, DType.FP32)], shape=(1, 1, 4, 8)))
        enc = kvi.Encoder(s, inj.layout)
        s.close()
        with pytest.raises(ValueError):
            inj.plan(1, [1])
        with pytest.raises(ValueError):
            enc.encode([])
        inj.close()
        enc.close()


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
