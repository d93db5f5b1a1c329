"""Facts' token ids (experimental): Store.put(token_ids=...), captures' token_ids,
Store.fact_token_ids with the documented FNV-1a 64 hash, checked injections
(InjectRequest.expect_token_ids, inject_batch's expect_token_ids) raising
TokenMismatchError with nothing written, and store files keeping the ids."""
from __future__ import annotations

import array
import os
import struct
import tempfile

import pytest

from kvi_testutil import empty, rand_values, rng
import kvinject as kvi
from kvinject import DType

L, H, D = 2, 2, 8
B, S = 2, 16
OFFS = array.array("i", [0, 1, 2])  # CSR block tables: one block (a batch row) per request


def fnv1a64(ids):
    h = 0xCBF29CE484222325
    for b in struct.pack("<%di" % len(ids), *ids):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class TestTokens:
    @pytest.fixture(autouse=True)
    def _setup(self, closing):
        self.model = kvi.Model(L, H, D)
        self.model.set_rope(layer=-1, style=kvi.RopeStyle.NEOX, theta=10000.0)
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=4)
        closing.append(self.store)
        r = rng(7)
        self.kv = {}
        for fid, n in ((1, 5), (2, 3), (3, 4)):
            k = array.array("f", rand_values(r, L * n * H * D))
            v = array.array("f", rand_values(r, L * n * H * D))
            self.kv[fid] = (k, v)
        self.ids = {1: [1000 + 7 * i for i in range(5)], 2: [-5, 0, 2**31 - 1]}
        self.store.put(1, 1, *self.kv[1], token_ids=self.ids[1])
        self.store.put(1, 2, *self.kv[2], token_ids=array.array("i", self.ids[2]))
        self.store.put(1, 3, *self.kv[3])
        self.keys = [empty(B * H * S * D, DType.FP32) for _ in range(L)]
        self.values = [empty(B * H * S * D, DType.FP32) for _ in range(L)]
        self.inj = kvi.Injector(self.store, kvi.CacheLayout.hf(self.keys, self.values, shape=(B, H, S, D)))
        closing.append(self.inj)

    def cache(self):
        return b"".join(bytes(x) for x in self.keys + self.values)

    def test_put_and_read_back(self):
        assert self.store.fact_token_ids(1, 1) == (self.ids[1], fnv1a64(self.ids[1]))
        assert self.store.fact_token_ids(1, 2) == (self.ids[2], fnv1a64(self.ids[2]))
        assert self.store.fact_token_ids(1, 3) == ([], 0)
        with pytest.raises(kvi.NotFoundError):
            self.store.fact_token_ids(1, 99)
        with pytest.raises(ValueError):
            self.store.put(1, 4, *self.kv[1], token_ids=[1, 2])  # 2 ids for 5 tokens
        self.store.put(1, 1, *self.kv[1], token_ids=[5, 4, 3, 2, 1], replace=True)
        assert self.store.fact_token_ids(1, 1)[0] == [5, 4, 3, 2, 1]

    def test_checked_inject(self):
        want = self.ids[1] + self.ids[2]
        self.inj.inject(kvi.InjectRequest(1, [1, 2], [0], first_slot=2, expect_token_ids=want))
        before = self.cache()
        for at in (0, 4, 5, 7):
            bad = list(want)
            bad[at] ^= 1
            with pytest.raises(kvi.TokenMismatchError) as cm:
                self.inj.inject(kvi.InjectRequest(1, [1, 2], [1], first_slot=2, expect_token_ids=bad))
            assert "sequence slot %d" % (2 + at) in cm.value.message
            assert cm.value.status == kvi.Status.ERR_TOKEN_MISMATCH
            assert self.cache() == before
        with pytest.raises(kvi.TokenMismatchError, match="no stored token ids"):
            self.inj.inject(kvi.InjectRequest(1, [3], [1], expect_token_ids=[0, 0, 0, 0]))
        # one id per injected token: the count goes with the ids (num_expect_token_ids) and the
        # library checks it, reading no further
        for n in (4, 6):
            ids = (self.ids[1] + [0])[:n]
            with pytest.raises(kvi.InvalidArgumentError, match="%d expected token ids" % n):
                self.inj.inject(kvi.InjectRequest(1, [1], [1], expect_token_ids=ids))
        with pytest.raises(ValueError, match="expect_token_ids is empty"):
            self.inj.inject(kvi.InjectRequest(1, [1], [1], expect_token_ids=[]))
        assert self.cache() == before

    def test_inject_batch_checked(self):
        tok = self.ids[1] + self.ids[2] + self.ids[2]
        self.inj.inject_batch([1, 2, 2], [0, 1], fact_offsets=array.array("i", [0, 2, 3]), block_table_offsets=OFFS, tenant=1,
                              expect_token_ids=tok, expect_token_offsets=[0, 8, 11])
        before = self.cache()
        tok[9] ^= 1
        with pytest.raises(kvi.TokenMismatchError, match=r"requests\[1\]: fact 2 of tenant 1: its token 1"):
            self.inj.inject_batch([1, 2, 2], [0, 1], fact_offsets=array.array("i", [0, 2, 3]), block_table_offsets=OFFS, tenant=1,
                                  expect_token_ids=tok, expect_token_offsets=[0, 8, 11])
        assert self.cache() == before
        with pytest.raises(ValueError):
            self.inj.inject_batch([1, 2, 2], [0, 1], fact_offsets=array.array("i", [0, 2, 3]), block_table_offsets=OFFS, tenant=1,
                                  expect_token_ids=tok, expect_token_offsets=[0, 8])

    def test_capture_keeps_ids(self, closing):
        enc = kvi.Encoder(self.store, kvi.CacheLayout.hf(self.keys, self.values, shape=(B, H, S, D)))
        closing.append(enc)
        self.inj.inject(kvi.InjectRequest(1, [1], [0]))
        enc.encode(kvi.Capture(1, 11, [0], 5, token_ids=self.ids[1]))
        assert self.store.fact_token_ids(1, 11)[0] == self.ids[1]
        with pytest.raises(ValueError):
            enc.encode(kvi.Capture(1, 12, [0], 5, token_ids=[1]))
        enc.encode_batch([21, 22], array.array("i", [2, 3]), [0, 0], block_table_offsets=OFFS, tenant=1,
                         token_ids=[7, 8, 9, 10, 11])
        assert self.store.fact_token_ids(1, 21)[0] == [7, 8]
        assert self.store.fact_token_ids(1, 22)[0] == [9, 10, 11]

    def test_files_keep_ids(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.kvi")
            self.store.save(path)
            other = kvi.Store.load(self.model, path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32,
                                   page_tokens=4)
            try:
                assert other.fact_token_ids(1, 1) == (self.ids[1], fnv1a64(self.ids[1]))
                assert other.fact_token_ids(1, 3) == ([], 0)
            finally:
                other.close()
