"""Model geometry, tensor-parallel slices, and the RoPE of every scaling against a
float64 reference written from Hugging Face's formulas (kvi_testutil.RefRope)."""
from __future__ import annotations

import array
import math
import sys

import pytest

from kvi_testutil import RefRope, case, encode, f32, rng
import kvinject as kvi
from kvinject import RopeScaling, RopeStyle


class TestGeometry:
    def test_tp_slices(self):
        # tp <= H: rank r holds [r*H/tp, (r+1)*H/tp); tp > H: head r // (tp/H), on tp/H ranks
        for H, tp in ((8, 1), (8, 2), (8, 8), (2, 8), (4, 16)):
            for r in range(tp):
                with case(H=H, tp=tp, rank=r):
                    m = kvi.Model(3, H, 64, tp_rank=r, tp_size=tp)
                    if tp <= H:
                        first, n, rep = r * H // tp, H // tp, 1
                    else:
                        first, n, rep = r // (tp // H), 1, tp // H
                    i = m.info()
                    assert (i.num_layers, i.num_kv_heads, i.head_size, i.tp_rank, i.tp_size) == \
                           (3, H, 64, r, tp)
                    assert (m.local_head_first, m.local_heads, m.head_replicas) == (first, n, rep)
                    m.close()

    def test_bad_geometry(self):
        for args in ((0, 1, 8), (1, 0, 8), (1, 1, 0), (1, 1, 2000)):
            with pytest.raises(kvi.InvalidArgumentError):
                kvi.Model(*args)
        with pytest.raises(kvi.InvalidArgumentError):
            kvi.Model(1, 6, 8, tp_rank=0, tp_size=4)  # neither divides the other
        with pytest.raises(kvi.InvalidArgumentError):
            kvi.Model(1, 8, 8, tp_rank=2, tp_size=2)


class TestRope:
    D = 64

    def check_against_reference(self, spec_fields, positions=(0, 1, 7, 100, 4095, 70000), layer=0, model=None):
        m = model or kvi.Model(2, 1, self.D)
        if model is None:
            m.set_rope(**spec_fields)
        ref = RefRope(self.D, **spec_fields)
        for pos in positions:
            for i in range(ref.rot // 2):
                c, s = m.rope_cos_sin(layer, pos, i)
                rc, rs = ref.cos_sin(pos, i)
                tol = ref.cs_tol(pos, i)
                assert abs(c - rc) <= tol, "cos pos %d pair %d: %r vs %r" % (pos, i, c, rc)
                assert abs(s - rs) <= tol, "sin pos %d pair %d: %r vs %r" % (pos, i, s, rs)
        return m

    def test_default(self):
        self.check_against_reference(dict(theta=10000.0))

    def test_partial_rotary_gptj(self):
        m = self.check_against_reference(dict(style=RopeStyle.GPTJ, rotary_dim=24, theta=10000.0))
        with pytest.raises(kvi.InvalidArgumentError):
            m.rope_cos_sin(0, 3, 12)  # pair past rotary_dim / 2

    def test_linear(self):
        self.check_against_reference(dict(scaling=RopeScaling.LINEAR, factor=4.0, theta=10000.0))

    def test_llama3(self):
        # Llama 3.1: theta 500000, factor 8, low 1, high 4, original 8192
        self.check_against_reference(dict(scaling=RopeScaling.LLAMA3, theta=500000.0, factor=8.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192))
        # a band where all three llama3 regions occur
        ref = RefRope(self.D, scaling=RopeScaling.LLAMA3, theta=500000.0, factor=8.0, original_max_position=8192)
        wl = [2 * math.pi / (1.0 / 500000.0 ** (2 * i / self.D)) for i in range(self.D // 2)]
        assert any(w < 8192 / 4 for w in wl) and any(w > 8192 for w in wl) \
               and any(8192 / 4 <= w <= 8192 for w in wl)
        assert len(ref.inv) == self.D // 2

    def test_yarn(self):
        for truncate in (1, 0):
            with case(truncate=truncate):
                self.check_against_reference(dict(scaling=RopeScaling.YARN, theta=150000.0, factor=32.0,
                                                  original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
                                                  yarn_truncate=truncate))
        # an explicit attention factor replaces YaRN's 0.1 ln(factor) + 1
        self.check_against_reference(dict(scaling=RopeScaling.YARN, theta=10000.0, factor=4.0,
                                          attention_factor=1.25, beta_fast=16.0, beta_slow=2.0))

    def test_ntk(self):
        self.check_against_reference(dict(scaling=RopeScaling.NTK, factor=2.0, theta=10000.0))

    def test_per_layer_overrides(self):
        m = kvi.Model(3, 1, self.D)
        m.set_rope(theta=10000.0)
        m.set_rope(layer=1, style=RopeStyle.NONE)
        m.set_rope(layer=2, theta=1e6, style=RopeStyle.GPTJ)
        self.check_against_reference(dict(theta=10000.0), layer=0, model=m)
        self.check_against_reference(dict(theta=1e6, style=RopeStyle.GPTJ), layer=2, model=m)
        assert m.get_rope(1).style == RopeStyle.NONE
        with pytest.raises(kvi.InvalidArgumentError):
            m.rope_cos_sin(1, 0, 0)  # a NoPE layer
        with pytest.raises(kvi.InvalidArgumentError):
            m.set_rope(layer=3)

    def test_get_rope_round_trip(self):
        m = kvi.Model(2, 1, self.D)
        spec = kvi.RopeSpec(style=RopeStyle.GPTJ, rotary_dim=32, theta=12345.5, scaling=RopeScaling.YARN,
                            original_max_position=2048, factor=3.5, low_freq_factor=1.5, high_freq_factor=6.0,
                            beta_fast=24.0, beta_slow=2.5, attention_factor=1.125, yarn_truncate=0)
        m.set_rope(spec, layer=1)
        got = m.get_rope(1)
        for f in ("style", "rotary_dim", "theta", "scaling", "original_max_position", "factor", "low_freq_factor",
                  "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "yarn_truncate"):
            assert getattr(got, f) == getattr(spec, f), f
        assert got.cos_sin_table is None
        # resolved values: rotary_dim 0 -> head size, YaRN's attention factor
        m.set_rope(layer=0, scaling=RopeScaling.YARN, factor=4.0)
        got = m.get_rope(0)
        assert got.rotary_dim == self.D
        assert round(abs(got.attention_factor - (0.1 * math.log(4.0) + 1.0)), 12) == 0

    def test_invalid_specs_change_nothing(self):
        m = kvi.Model(1, 1, self.D)
        m.set_rope(theta=5000.0)
        for bad in (dict(rotary_dim=7), dict(theta=-1.0), dict(scaling=RopeScaling.LLAMA3, low_freq_factor=4.0,
                                                               high_freq_factor=2.0),
                    dict(theta=float("nan")), dict(scaling=RopeScaling.LINEAR, factor=0.0)):
            with pytest.raises(kvi.InvalidArgumentError):
                m.set_rope(**bad)
        assert m.get_rope(0).theta == 5000.0
        with pytest.raises(ValueError):
            m.set_rope(scaling=99)  # not a RopeScaling

    def test_cos_sin_table(self):
        r = rng(3)
        rot, positions = 16, 40
        values = [f32(r.uniform(-1, 1)) for _ in range(rot * positions)]
        for dtype, table in ((kvi.DType.FP32, values), (kvi.DType.FP16, encode(values, kvi.DType.FP16)),
                             (kvi.DType.BF16, encode(values, kvi.DType.BF16))):
            with case(dtype=dtype.name):
                m = kvi.Model(1, 1, 32)
                kw = {} if dtype == kvi.DType.FP32 else {"table_dtype": dtype}
                m.set_rope(style=RopeStyle.NEOX, rotary_dim=rot, cos_sin_table=table, **kw)
                from kvi_testutil import decode
                expect = values if dtype == kvi.DType.FP32 else decode(table, dtype)
                for pos in (0, 17, positions - 1):
                    for i in range(rot // 2):
                        c, s = m.rope_cos_sin(0, pos, i)
                        assert c == expect[pos * rot + i]
                        assert s == expect[pos * rot + rot // 2 + i]
                with pytest.raises(kvi.InvalidArgumentError):
                    m.rope_cos_sin(0, positions, 0)  # past the table
                got = m.get_rope(0)
                assert got.table_positions == positions
                assert list(got.cos_sin_table) == [f32(x) for x in expect]
        with pytest.raises(TypeError):
            kvi.Model(1, 1, 32).set_rope(rotary_dim=rot, cos_sin_table=array.array("H", [0] * rot))  # bf16 or fp16?


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
