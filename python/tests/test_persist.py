"""Store files through the binding (kvinject/persist.h): save and load round trips,
one tenant, the journal, and the errors of a missing file and another RoPE."""
from __future__ import annotations

import os
import sys

import pytest

from kvi_testutil import rand_values, rng
import kvinject as kvi
from kvinject import DType


class TestPersist:
    L, H, D = 2, 2, 8

    @pytest.fixture(autouse=True)
    def _setup(self, tmp_path, closing):
        self.closing = closing
        self.dir = str(tmp_path)
        self.path = os.path.join(self.dir, "facts.kvi")

    def model(self, theta=10000.0):
        m = kvi.Model(self.L, self.H, self.D)
        m.set_rope(theta=theta)
        self.closing.append(m)
        return m

    def store(self, model, **kw):
        s = kvi.Store(model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, **kw)
        self.closing.append(s)
        return s

    def fact(self, seed, tokens=3):
        import array
        r = rng(seed)
        n = self.L * tokens * self.H * self.D
        return array.array("f", rand_values(r, n)), array.array("f", rand_values(r, n))

    def test_save_load_round_trip_and_one_tenant(self):
        m = self.model()
        s = self.store(m)
        facts = {(1, 10): self.fact(1), (1, 11): self.fact(2, 5), (2, 10): self.fact(3)}
        for (t, f), (k, v) in facts.items():
            s.put(t, f, k, v)
        s.save(self.path)
        t = kvi.Store.load(m, self.path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32)
        self.closing.append(t)
        assert (t.list(1), t.list(2)) == ([10, 11], [10])
        for (tn, f), (k, v) in facts.items():
            rk, rv = t.read(tn, f)
            assert (list(rk), list(rv)) == (list(k), list(v))
        one = os.path.join(self.dir, "one.kvi")
        s.save(one, tenant=2)
        u = kvi.Store.load(m, one, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32)
        self.closing.append(u)
        assert (u.list(1), u.list(2)) == ([], [10])

    def test_journal_keeps_later_puts(self):
        m = self.model()
        s = self.store(m)
        s.journal_open(self.path)
        k, v = self.fact(4)
        s.put(3, 30, k, v)
        s.journal_close()
        s.put(3, 31, k, v)  # after the close: not in the file
        t = kvi.Store.load(m, self.path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, journal=True)
        self.closing.append(t)
        assert t.list(3) == [30]
        t.put(3, 32, k, v)  # journaled by the load
        t.close()
        w = kvi.Store.load(m, self.path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32)
        self.closing.append(w)
        assert w.list(3) == [30, 32]

    def test_journal_records_remove_and_encode_and_takes_path_objects(self):
        import array
        import pathlib
        m = self.model()
        s = self.store(m)
        path = pathlib.Path(self.path)
        k, v = self.fact(5, tokens=4)
        s.put(4, 40, k, v)
        s.put(4, 41, k, v)
        s.journal_open(path)
        s.remove(4, 40)
        # an encode is journaled too: capture 4 slots of a host cache [1, H, 8, D]
        cache = [array.array("f", rand_values(rng(6), self.H * 8 * self.D)) for _ in range(2 * self.L)]
        enc = kvi.Encoder(s, kvi.CacheLayout.hf(cache[:self.L], cache[self.L:], shape=(1, self.H, 8, self.D)))
        enc.encode(kvi.Capture(4, 42, block_table=[0], num_tokens=4, first_slot=2, start_position=2))
        want = s.read(4, 42)
        enc.close()
        s.close()  # closes the journal
        t = kvi.Store.load(m, path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32)
        self.closing.append(t)
        assert t.list(4) == [41, 42]
        got = t.read(4, 42)
        assert (list(got[0]), list(got[1])) == (list(want[0]), list(want[1]))
        # a damaged file is refused, naming the problem
        data = path.read_bytes()
        bad = pathlib.Path(self.dir, "bad.kvi")
        bad.write_bytes(data[:len(data) // 2] + bytes(8))
        with pytest.raises(kvi.CorruptError) as cm:
            kvi.Store.load(m, bad, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32)
        assert cm.value.message.startswith("Store.load: "), cm.value.message

    def test_errors(self):
        m = self.model()
        with pytest.raises(kvi.NotFoundError):
            kvi.Store.load(m, self.path, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32)
        self.store(m).save(self.path)
        with pytest.raises(kvi.IncompatibleError) as e:
            kvi.Store.load(self.model(theta=500000.0), self.path, 1 << 20, backend=kvi.Backend.CPU,
                           dtype=DType.FP32)
        assert "rope" in e.value.message.lower()
        with pytest.raises(ValueError):
            self.store(m).save("")


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
