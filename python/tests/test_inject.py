"""Injection into CPU caches of several engine layouts, compared with a float64
RoPE written in this test suite (kvi_testutil.RefRope: NeoX and GPT-J, partial
rotary, llama3 scaling, per-layer overrides). Caches are poisoned first: every
element the injection should not write must keep its poison bits. The caches
are indexed with the engines' own shapes, never with the library's strides."""
from __future__ import annotations

import array
import sys

import pytest

from kvi_testutil import (FakeTensor, RefRope, bits_of, case, empty, encode, f32_bits, fp8_e4m3_value, rand_values,
                          rng, unit_roundoff)
import kvinject as kvi
from kvinject import DType, RopeScaling, RopeStyle

POISON = {DType.FP32: f32_bits(-1234.5), DType.FP16: 0xDEAD, DType.BF16: 0xDEAD, DType.FP8_E4M3: 0xA5}
L, H, D = 3, 2, 16

LLAMA3 = dict(style=RopeStyle.NEOX, rotary_dim=12, theta=500000.0, scaling=RopeScaling.LLAMA3, factor=8.0,
              low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
GPTJ_LAYER = dict(style=RopeStyle.GPTJ, theta=10000.0)


class Facts:
    """A store with three facts of tenant 1 and their pre-RoPE values here, [l][t][h][d]."""

    def __init__(self, test, store_dtype=DType.BF16, seed=1, ropes=None):
        self.model = kvi.Model(L, H, D)
        ropes = ropes or {-1: LLAMA3, 1: GPTJ_LAYER}
        for layer, spec in ropes.items():
            self.model.set_rope(layer=layer, **spec)
        self.ref = [RefRope(D, **ropes.get(layer, ropes[-1])) for layer in range(L)]
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=store_dtype, page_tokens=4)
        test.closing.append(self.store)
        r = rng(seed)
        self.k, self.v = {}, {}
        for fid, T in ((10, 5), (11, 9), (12, 3)):
            kv = rand_values(r, L * T * H * D), rand_values(r, L * T * H * D)  # bf16-exact: stored exactly
            self.store.put(1, fid, encode(kv[0], DType.FP32), encode(kv[1], DType.FP32))
            self.k[fid] = [[[kv[0][((l * T + t) * H + h) * D:((l * T + t) * H + h + 1) * D] for h in range(H)]
                            for t in range(T)] for l in range(L)]
            self.v[fid] = [[[kv[1][((l * T + t) * H + h) * D:((l * T + t) * H + h + 1) * D] for h in range(H)]
                            for t in range(T)] for l in range(L)]

    def tokens(self, fid):
        return len(self.k[fid][0])


def expected_writes(facts, requests, layers=range(L)):
    """{(layer, block, token_in_block, head): (k_ref, k_tol, v_ref)} for a list of
    (fact_ids, block_table, first_slot, positions-or-None, start_position, block_size)."""
    out = {}
    for fids, table, first, positions, start, bs in requests:
        i = 0
        for fid in fids:
            for t in range(facts.tokens(fid)):
                s = first + i
                p = positions[i] if positions is not None else start + i
                blk, tok = table[s // bs], s % bs
                for l in layers:
                    ref = facts.ref[l]
                    for h in range(H):
                        x = facts.k[fid][l][t][h]
                        out[(l, blk, tok, h)] = (ref.rotate(x, p), ref.tol(x, p), facts.v[fid][l][t][h])
                i += 1
    return out


class Torchish(FakeTensor):
    """The attributes the binding reads of a torch tensor, is_cuda included (a call
    whose arrays all have it may reuse the previous call's struct)."""
    is_cuda = False

    def numel(self):
        n = 1
        for x in self.shape:
            n *= x
        return n

    def is_contiguous(self):
        return True

    def stride(self, dim=None):
        return self._strides if dim is None else self._strides[dim]


class InjectCase:
    @pytest.fixture(autouse=True)
    def _closing(self, closing):
        self.closing = closing

    def assert_cache(self, cache_index, dtype, bufs, writes, nblocks, bs, scale=1.0):
        """Every element of every layer/plane: written ones within tolerance of the
        reference rotated at their position, the others still poison."""
        u = unit_roundoff(dtype) if dtype != DType.FP8_E4M3 else 2.0 ** -4
        value = _decoder(dtype)
        written = 0
        for l in range(L):
            for blk in range(nblocks):
                for tok in range(bs):
                    for h in range(H):
                        w = writes.get((l, blk, tok, h))
                        for kv in (0, 1):
                            for d in range(D):
                                buf, i = cache_index(l, kv, blk, tok, h, d)
                                if w is None:
                                    assert _raw(buf, i, dtype) == POISON[dtype], \
                                           "layer %d plane %d block %d token %d head %d dim %d was written" \
                                           % (l, kv, blk, tok, h, d)
                                    continue
                                got = value(buf[i]) * scale
                                if kv == 0:
                                    ref, tol = w[0][d], w[1][d]
                                else:
                                    ref, tol = w[2][d], 0.0
                                bound = tol + 2 * u * abs(ref) + (2.0 ** -9 * scale if dtype == DType.FP8_E4M3 else 0)
                                assert abs(got - ref) <= bound, \
                                       "%s layer %d block %d token %d head %d dim %d: %r, reference %r" \
                                       % ("KV"[kv], l, blk, tok, h, d, got, ref)
                                written += 1
        assert written == 2 * D * len(writes)
        return written


def _decoder(dtype):
    from kvi_testutil import bf16_value, f16_value
    return {DType.FP32: float, DType.FP16: f16_value, DType.BF16: bf16_value, DType.FP8_E4M3: fp8_e4m3_value}[dtype]


def _raw(buf, i, dtype):
    return f32_bits(buf[i]) if dtype == DType.FP32 else buf[i]


def poisoned(n, dtype):
    if dtype == DType.FP8_E4M3:
        return array.array("B", [POISON[dtype]] * n)
    return empty(n, dtype, POISON[dtype])


class TestHuggingFace(InjectCase):
    B, S = 3, 40

    def hf_cache(self, dtype):
        n = self.B * H * self.S * D
        keys = [poisoned(n, dtype) for _ in range(L)]
        values = [poisoned(n, dtype) for _ in range(L)]
        S = self.S

        def index(l, kv, blk, tok, h, d):  # [batch, heads, seq, dim]
            return (keys if kv == 0 else values)[l], ((blk * H + h) * S + tok) * D + d

        return keys, values, index

    REQS = [([11, 10], [2], 3, None, 100), ([12], [0], 30, [7, 500, 9000], 0)]

    def run_requests(self, facts, inj, reqs):
        inj.inject([kvi.InjectRequest(1, f, t, first_slot=fs, positions=p, start_position=sp)
                    for f, t, fs, p, sp in reqs])
        return expected_writes(facts, [(f, t, fs, p, sp, self.S) for f, t, fs, p, sp in reqs])

    def test_every_cache_dtype(self):
        for cdt in (DType.FP32, DType.FP16, DType.BF16):
            with case(cache=cdt.name):
                facts = Facts(self, DType.BF16, seed=int(cdt))
                keys, values, index = self.hf_cache(cdt)
                layout = kvi.CacheLayout.hf(keys, values, shape=(self.B, H, self.S, D),
                                            dtype=None if cdt == DType.FP32 else cdt)
                assert (layout.num_blocks, layout.block_size, layout.dtype) == (self.B, self.S, cdt)
                inj = kvi.Injector(facts.store, layout)
                assert inj.plan(1, [11, 10]) == 14
                writes = self.run_requests(facts, inj, self.REQS)
                self.assert_cache(index, cdt, None, writes, self.B, self.S)

    def test_deviation_and_plan(self):
        """Injector.deviation right after injecting into an fp32 cache: all zero; one
        element moved by 0.5 at layer 2: that token scores 0.25; then the plan."""
        facts = Facts(self, DType.FP32, seed=5)
        keys, values, index = self.hf_cache(DType.FP32)
        inj = kvi.Injector(facts.store, kvi.CacheLayout.hf(keys, values, shape=(self.B, H, self.S, D)))
        reqs = [kvi.InjectRequest(1, f, t, first_slot=fs, positions=p, start_position=sp)
                for f, t, fs, p, sp in self.REQS]
        inj.inject(reqs)
        assert inj.deviation(reqs, 2) == [0.0] * 17
        buf, i = index(2, 1, 0, 30 + 1, 1, 7)  # request 1 (row 0, slot 30): its token 1, V head 1 dim 7
        buf[i] += 0.5
        got = inj.deviation(reqs, 2)
        assert got == [0.0] * 15 + [0.25, 0.0]
        assert inj.deviation(reqs, 1) == [0.0] * 17
        out = array.array("f", [7.0] * 20)
        assert inj.deviation(reqs, 2, out=out) is out
        assert list(out) == [0.0] * 15 + [0.25, 0.0] + [7.0] * 3
        with pytest.raises(kvi.InvalidArgumentError):
            inj.deviation(reqs, 2, out=array.array("f", [0.0] * 16))  # one short
        with pytest.raises(kvi.InvalidArgumentError):
            inj.deviation(reqs, L)
        assert kvi.recompute_select(got, [9, 5, 3], fraction=0.0, boundary=1) == [0, 9, 14]
        assert kvi.recompute_select(got, [9, 5, 3], fraction=0.1, boundary=1) == \
               [0, 1, 9, 14, 15]  # 0.25, then the lowest index of the ties
        assert kvi.recompute_select(array.array("f", got), [9, 5, 3], fraction=1 / 17) == [15]
        with pytest.raises(kvi.InvalidArgumentError):
            kvi.recompute_select(got, [9, 5, 3], fraction=-1.0)
        with pytest.raises(ValueError):
            kvi.recompute_select(got[:3], [9, 5, 3])
        # a boundary past int32 is refused, not wrapped (2**32 + 1 was taken as 1, 2**31 reached the library
        # as -2**31)
        for boundary in (2 ** 32 + 1, 2 ** 31, -2 ** 31 - 1):
            with pytest.raises(OverflowError):
                kvi.recompute_select(got, [9, 5, 3], boundary=boundary)

    def test_gptj_everywhere_and_fp32_store(self):
        facts = Facts(self, DType.FP32, seed=5, ropes={-1: dict(style=RopeStyle.GPTJ, theta=10000.0)})
        keys, values, index = self.hf_cache(DType.FP32)
        inj = kvi.Injector(facts.store, kvi.CacheLayout.hf(keys, values, shape=(self.B, H, self.S, D)))
        writes = self.run_requests(facts, inj, [([10, 12, 11], [1], 0, None, 0)])
        self.assert_cache(index, DType.FP32, None, writes, self.B, self.S)

    def test_permuted_tensor_strides(self):
        """Tensors whose storage is [batch, seq, heads, dim] seen as [batch, heads, seq,
        dim] (a transpose view): the layout must take the tensors' strides."""
        facts = Facts(self, DType.BF16, seed=6)
        n = self.B * self.S * H * D
        kst = [poisoned(n, DType.BF16) for _ in range(L)]
        vst = [poisoned(n, DType.BF16) for _ in range(L)]
        strides = (self.S * H * D, D, H * D, 1)
        keys = [FakeTensor(b, (self.B, H, self.S, D), strides, dtype="torch.bfloat16") for b in kst]
        values = [FakeTensor(b, (self.B, H, self.S, D), strides, dtype="torch.bfloat16") for b in vst]
        layout = kvi.CacheLayout.hf(keys, values)
        assert (layout.block_stride, layout.head_stride, layout.token_stride) == strides[:3]
        inj = kvi.Injector(facts.store, layout)
        writes = self.run_requests(facts, inj, self.REQS)
        S = self.S

        def index(l, kv, blk, tok, h, d):
            return (kst if kv == 0 else vst)[l], ((blk * S + tok) * H + h) * D + d

        self.assert_cache(index, DType.BF16, None, writes, self.B, self.S)

    def test_layer_range(self):
        facts = Facts(self, DType.BF16, seed=7)
        keys, values, index = self.hf_cache(DType.FP32)
        inj = kvi.Injector(facts.store, kvi.CacheLayout.hf(keys, values, shape=(self.B, H, self.S, D)))
        inj.inject(kvi.InjectRequest(1, [12], [1], first_slot=4), layer_begin=1, layer_end=2)
        writes = expected_writes(facts, [([12], [1], 4, None, 0, self.S)], layers=[1])
        self.assert_cache(index, DType.FP32, None, writes, self.B, self.S)

    def test_refused_requests_write_nothing(self):
        facts = Facts(self, DType.BF16, seed=8)
        keys, values, index = self.hf_cache(DType.FP32)
        inj = kvi.Injector(facts.store, kvi.CacheLayout.hf(keys, values, shape=(self.B, H, self.S, D)))
        before = b"".join(bits_of(b) for b in keys + values)
        good = kvi.InjectRequest(1, [10], [0])
        cases = [
            (kvi.NotFoundError, [good, kvi.InjectRequest(1, [10, 77], [1])]),  # unknown fact
            (kvi.NotFoundError, [kvi.InjectRequest(2, [10], [1])]),  # tenant 2 does not have fact 10
            (kvi.InvalidArgumentError, [good, kvi.InjectRequest(1, [10], [self.B])]),  # block outside the cache
            (kvi.InvalidArgumentError, [kvi.InjectRequest(1, [11], [0], first_slot=self.S - 3)]),  # past the table
            (kvi.InvalidArgumentError, [kvi.InjectRequest(1, [10], [0], start_position=-1)]),
            (kvi.InvalidArgumentError, [good]),  # layer range below
        ]
        for i, (exc, reqs) in enumerate(cases):
            with case(case=i):
                kw = dict(layer_begin=2, layer_end=1) if i == len(cases) - 1 else {}
                with pytest.raises(exc):
                    inj.inject(reqs, **kw)
                assert b"".join(bits_of(b) for b in keys + values) == before
        with pytest.raises(ValueError):  # 5 tokens, 4 positions: refused by the library (num_positions)
            inj.inject(kvi.InjectRequest(1, [10], [0], positions=[1, 2, 3, 4]))
        with pytest.raises(kvi.NotFoundError):
            inj.plan(1, [10, 77])
        with pytest.raises(kvi.MemoryKindError):  # a device block table on a CPU store
            inj.inject(kvi.InjectRequest(1, [10], FakeTensor(array.array("i", [0]), (1,), dtype="torch.int32",
                                                                device="cuda")))
        assert b"".join(bits_of(b) for b in keys + values) == before
        inj.inject([])  # nothing to do

    def test_layout_checks(self):
        facts = Facts(self, DType.BF16, seed=9)
        keys, values, _ = self.hf_cache(DType.FP32)
        with pytest.raises(kvi.MismatchError):  # 3 heads in the cache, 2 in the model
            kvi.Injector(facts.store, kvi.CacheLayout.hf(keys, values, shape=(2, 3, self.S, D)))
        with pytest.raises(kvi.MemoryKindError):  # a device cache for a CPU store
            t = [FakeTensor(b, (self.B, H, self.S, D), device="cuda") for b in keys]
            kvi.Injector(facts.store, kvi.CacheLayout.hf(t, t))
        with pytest.raises(ValueError):  # no shape for plain buffers
            kvi.CacheLayout.hf(keys, values)
        with pytest.raises(ValueError):  # buffers smaller than the shape
            kvi.CacheLayout.hf(keys, values, shape=(self.B + 1, H, self.S, D))
        with pytest.raises(ValueError):  # layers of different shapes
            t = [FakeTensor(keys[0], (self.B, H, self.S, D)), FakeTensor(keys[1], (self.B, H, self.S - 1, D))]
            kvi.CacheLayout.hf(t, t)
        with pytest.raises(ValueError):
            kvi.CacheLayout.hf(keys, values[:2], shape=(self.B, H, self.S, D))


    def test_layouts_fit_their_buffers(self):
        """Every way of making a layout from Python objects checks that the layout
        fits them: the last byte of every layer's K and V plane inside the object
        its pointer points into (a preset or a layout by hand over too small a
        buffer was accepted, and an injection wrote past it), one pointer per
        layer, no device memory in a host layout. Exact fits are accepted."""
        facts = Facts(self, DType.FP32, seed=9)
        NB, BS = 4, 4
        n = 2 * NB * BS * H * D  # vLLM [2, NB, BS, H, D]
        P = kvi.CachePreset

        def bufs(count, elems):
            return [array.array("f", bytes(4 * elems)) for _ in range(count)]

        def by_hand(**kw):
            args = dict(memory=kvi.Memory.HOST, dtype=DType.FP32, num_layers=L, num_heads=H, head_size=D,
                        block_size=BS, num_blocks=NB, block_stride=BS * H * D, token_stride=H * D, head_stride=D)
            args.update(kw)
            return kvi.CacheLayout(**args)

        pool = NB * L * 2 * H * BS * D  # TensorRT-LLM [NB, L, 2, H, BS, D]
        fits = [
            lambda e: kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, DType.FP32, L, H, D, BS, NB, k_layers=bufs(L, n + e)),
            lambda e: kvi.CacheLayout.preset(P.VLLM_PACKED_HND, DType.FP32, L, H, D, BS, NB, k_layers=bufs(L, n + e)),
            lambda e: kvi.CacheLayout.preset(P.HF_CONTIGUOUS, DType.FP32, L, H, D, BS, NB, k_layers=bufs(L, n // 2),
                                             v_layers=bufs(L, n // 2 + e)),
            lambda e: kvi.CacheLayout.preset(P.TRTLLM, DType.FP32, L, H, D, BS, NB, base=bufs(1, pool + e)[0]),
            lambda e: kvi.CacheLayout.preset(P.VLLM_CPU, DType.FP32, L, H, D, BS, NB, k_layers=bufs(L, n + e)),
            lambda e: by_hand(k_layers=bufs(L, n // 2 + e), v_layers=bufs(L, n // 2)),
            lambda e: by_hand(k_layers=bufs(L, n + e), v_offset=n // 2),
            lambda e: by_hand(k_base=bufs(1, L * n + e)[0], layer_stride=n, v_offset=n // 2),
            lambda e: by_hand(k_base=bufs(1, L * n // 2)[0], v_base=bufs(1, L * n // 2 + e)[0], layer_stride=n // 2),
            lambda e: by_hand(k_layers=bufs(L, n // 2 + e), v_layers=bufs(L, n // 2), dim_stride=1,
                              v_token_stride=1, v_block_stride=BS, v_head_stride=NB * BS, v_dim_stride=H * NB * BS),
        ]
        for i, make in enumerate(fits):
            with case(i):
                with pytest.raises(ValueError) as e:
                    make(-1)  # one element short
                assert "holds" in str(e.value) and "bytes into it" in str(e.value)
                kvi.Injector(facts.store, make(0)).close()
        with pytest.raises(ValueError, match="k_layers has 1 pointers; the layout has 3 layers"):
            kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, DType.FP32, L, H, D, BS, NB, k_layers=bufs(1, n))
        with pytest.raises(ValueError, match="v_layers has 4 pointers"):
            by_hand(k_layers=bufs(L, n // 2), v_layers=bufs(L + 1, n // 2))
        dev = [FakeTensor(0x10000, (2, NB, BS, H, D), device="cuda") for _ in range(L)]
        with pytest.raises(ValueError, match="host memory but a cache tensor is on a CUDA device"):
            kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, DType.FP32, L, H, D, BS, NB, k_layers=dev,
                                   memory=kvi.Memory.HOST)


class TestVllm(InjectCase):
    NB, BS = 8, 4

    def test_flash_attn_buffers(self):
        """[2, NB, BS, H, D] per layer, a scattered block table crossing blocks."""
        facts = Facts(self, DType.BF16, seed=20)
        NB, BS = self.NB, self.BS
        caches = [poisoned(2 * NB * BS * H * D, DType.BF16) for _ in range(L)]
        layout = kvi.CacheLayout.vllm(caches, shape=(2, NB, BS, H, D), dtype=DType.BF16)
        inj = kvi.Injector(facts.store, layout)
        table = [5, 1, 7, 2]
        inj.inject(kvi.InjectRequest(1, [11, 12], table, first_slot=2, start_position=40))
        writes = expected_writes(facts, [([11, 12], table, 2, None, 40, BS)])

        def index(l, kv, blk, tok, h, d):
            return caches[l], (((kv * NB + blk) * BS + tok) * H + h) * D + d

        self.assert_cache(index, DType.BF16, None, writes, NB, BS)

    def test_flashinfer_hnd_tensor_strides(self):
        """Logical [NB, 2, BS, H, D] with the HND physical order [NB, 2, H, BS, D]."""
        facts = Facts(self, DType.BF16, seed=21)
        NB, BS = self.NB, self.BS
        phys = [poisoned(NB * 2 * H * BS * D, DType.FP16) for _ in range(L)]
        strides = (2 * H * BS * D, H * BS * D, D, BS * D, 1)
        tensors = [FakeTensor(b, (NB, 2, BS, H, D), strides, dtype="torch.float16") for b in phys]
        layout = kvi.CacheLayout.vllm(tensors, kv_first=False)
        assert (layout.v_offset, layout.block_stride) == (H * BS * D, 2 * H * BS * D)
        inj = kvi.Injector(facts.store, layout)
        table = [3, 0, 6, 4, 1]
        pos = list(range(1000, 1000 + 14 * 3, 3))
        inj.inject(kvi.InjectRequest(1, [10, 11], table, first_slot=5, positions=pos))
        writes = expected_writes(facts, [([10, 11], table, 5, pos, 0, BS)])

        def index(l, kv, blk, tok, h, d):
            return phys[l], (((blk * 2 + kv) * H + h) * BS + tok) * D + d

        self.assert_cache(index, DType.FP16, None, writes, NB, BS)

    def test_fp8_per_tensor_scales(self):
        facts = Facts(self, DType.BF16, seed=22)
        NB, BS = self.NB, self.BS
        caches = [poisoned(2 * NB * BS * H * D, DType.FP8_E4M3) for _ in range(L)]
        tensors = [FakeTensor(b, (2, NB, BS, H, D), dtype="torch.uint8") for b in caches]
        layout = kvi.CacheLayout.vllm(tensors, dtype=DType.FP8_E4M3)
        scales = [0.5, 0.25, 2.0]
        layout.set_scales(kvi.ScaleMode.PER_TENSOR, scales, scales)
        inj = kvi.Injector(facts.store, layout)
        table = [6, 2]
        inj.inject(kvi.InjectRequest(1, [10], table, first_slot=1, start_position=3))
        writes = expected_writes(facts, [([10], table, 1, None, 3, BS)])
        for l in range(L):
            sub = {key: w for key, w in writes.items() if key[0] == l}

            def index(ll, kv, blk, tok, h, d, l=l):
                return caches[l], (((kv * NB + blk) * BS + tok) * H + h) * D + d

            # check layer l alone with its scale: other layers' entries are not in `sub`
            self._check_layer(index, sub, l, NB, BS, scales[l])
        with pytest.raises(ValueError):
            layout.set_scales(kvi.ScaleMode.PER_HEAD, scales, scales)  # needs L * H values
        with pytest.raises(kvi.InvalidArgumentError):  # scales for a bf16 cache
            b = [poisoned(2 * NB * BS * H * D, DType.BF16) for _ in range(L)]
            lay = kvi.CacheLayout.vllm(b, shape=(2, NB, BS, H, D), dtype=DType.BF16)
            lay.set_scales(kvi.ScaleMode.PER_TENSOR, scales, scales)
            kvi.Injector(facts.store, lay)

    def _check_layer(self, index, writes, l, NB, BS, scale):
        for blk in range(NB):
            for tok in range(BS):
                for h in range(H):
                    w = writes.get((l, blk, tok, h))
                    for kv in (0, 1):
                        for d in range(D):
                            buf, i = index(l, kv, blk, tok, h, d)
                            if w is None:
                                assert buf[i] == POISON[DType.FP8_E4M3]
                                continue
                            ref, tol = (w[0][d], w[1][d]) if kv == 0 else (w[2][d], 0.0)
                            got = fp8_e4m3_value(buf[i]) * scale
                            assert abs(got - ref) <= tol + 2.0 ** -4 * abs(ref) + 2.0 ** -9 * scale, \
                                   "layer %d %s: %r vs %r" % (l, "KV"[kv], got, ref)


class TestInjectBatch(InjectCase):
    """Injector.inject_batch (kvi_inject_batched): one call from flat arrays, the same
    bytes as the per-request form and the float64 reference, 2-D and CSR tables,
    int32 and int64 positions, buffers, FakeTensors and lists."""

    NB, BS = 16, 4
    # (fact ids, first slot, blocks) per request; request 2 injects nothing
    REQS = [([11, 10], 2, [5, 1, 7, 2, 9]), ([12], 0, [3]), ([], 0, []), ([10, 12, 12], 3, [0, 4, 6, 8])]

    @pytest.fixture(autouse=True)
    def _setup(self, closing):
        self.closing = closing
        self.facts = Facts(self, DType.BF16, seed=30)
        NB, BS = self.NB, self.BS
        self.caches = [poisoned(2 * NB * BS * H * D, DType.BF16) for _ in range(L)]
        self.inj = kvi.Injector(self.facts.store, kvi.CacheLayout.vllm(self.caches, shape=(2, NB, BS, H, D),
                                                                       dtype=DType.BF16))
        self.fresh = [bytes(c) for c in self.caches]

    def reset(self):
        for c, f in zip(self.caches, self.fresh):
            memoryview(c).cast("B")[:] = f

    def snapshot(self):
        return [bytes(c) for c in self.caches]

    def tokens(self, fids):
        return sum(self.facts.tokens(f) for f in fids)

    def test_matches_per_request_form(self):
        NB, BS = self.NB, self.BS
        n = len(self.REQS)
        ids = array.array("Q", [f for r in self.REQS for f in r[0]])
        offs = array.array("i", [0])
        for r in self.REQS:
            offs.append(offs[-1] + len(r[0]))
        first = array.array("q", [r[1] for r in self.REQS])
        width = 6
        t2d = array.array("i", [-3] * (n * width))
        for i, r in enumerate(self.REQS):
            t2d[i * width:i * width + len(r[2])] = array.array("i", r[2])
        csr = array.array("i", [b for r in self.REQS for b in r[2]])
        indptr = array.array("i", [0])
        for r in self.REQS:
            indptr.append(indptr[-1] + len(r[2]))
        starts = [40, 7, 0, 1000]
        per_tok = [[(17 * i + 3 * t) % 4000 for t in range(self.tokens(r[0]))] for i, r in enumerate(self.REQS)]
        flat = [p for ps in per_tok for p in ps]
        for per_token in (False, True):
            self.reset()
            self.inj.inject([kvi.InjectRequest(1, r[0], r[2] or [0], first_slot=r[1],
                                               positions=per_tok[i] if per_token else None,
                                               start_position=0 if per_token else starts[i])
                             for i, r in enumerate(self.REQS)])
            want = self.snapshot()
            writes = expected_writes(self.facts, [(r[0], r[2], r[1], per_tok[i] if per_token else None,
                                                   starts[i], BS) for i, r in enumerate(self.REQS)])

            def index(l, kv, blk, tok, h, d):
                return self.caches[l], (((kv * NB + blk) * BS + tok) * H + h) * D + d

            self.assert_cache(index, DType.BF16, None, writes, NB, BS)
            for form in ("2-D buffer", "2-D FakeTensor", "CSR", "CSR lists"):
                for code in ("i", "q"):
                    with case(per_token=per_token, form=form, positions=code):
                        self.reset()
                        kw = {}
                        if per_token:
                            kw["positions"] = array.array(code, flat)
                        else:
                            kw["start_positions"] = array.array(code, starts)
                        out = array.array("i", [-1] * n)
                        if form == "2-D buffer":
                            tables = memoryview(t2d).cast("B").cast("i", (n, width))
                            self.inj.inject_batch(ids, tables, fact_offsets=offs, tenant=1, first_slots=first,
                                                  out_tokens=out, **kw)
                        elif form == "2-D FakeTensor":  # rows 6 apart, 5 used
                            tables = FakeTensor(t2d, (n, 5), (width, 1), dtype="torch.int32")
                            self.inj.inject_batch(FakeTensor(ids, (len(ids),), dtype="torch.int64"), tables,
                                                  fact_offsets=offs, tenants=array.array("q", [1] * n),
                                                  first_slots=first, out_tokens=out, **kw)
                        elif form == "CSR":
                            self.inj.inject_batch(ids, csr, fact_offsets=offs, block_table_offsets=indptr, tenant=1,
                                                  first_slots=first, out_tokens=out, **kw)
                        else:
                            self.inj.inject_batch(list(ids), list(csr), fact_offsets=list(offs),
                                                  block_table_offsets=list(indptr), tenant=1, first_slots=list(first),
                                                  out_tokens=out, **{k: list(v) for k, v in kw.items()})
                        assert self.snapshot() == want
                        assert list(out) == [self.tokens(r[0]) for r in self.REQS]

    def test_repeated_tensors_reuse_the_call(self):
        """Tensors of the previous successful call (same addresses, shapes, strides,
        dtypes, devices) reuse its struct; their contents are read afresh, so ids
        changed in place inject the new facts, an unknown one is refused with
        nothing written; another dtype or tensor takes the full path."""

        ids_buf = array.array("q", [11, 10])
        ids = Torchish(ids_buf, (2,), dtype="torch.int64")
        offs = Torchish(array.array("i", [0, 2]), (2,), dtype="torch.int32")
        table = Torchish(array.array("i", [5, 1, 7, 2, 9]), (1, 5), dtype="torch.int32")
        first = Torchish(array.array("q", [2]), (1,), dtype="torch.int64")
        starts = Torchish(array.array("i", [3]), (1,), dtype="torch.int32")

        def call():
            self.inj.inject_batch(ids, table, fact_offsets=offs, tenant=1, first_slots=first,
                                  start_positions=starts)

        def per_request(fids):
            self.reset()
            self.inj.inject(kvi.InjectRequest(1, fids, [5, 1, 7, 2, 9], first_slot=2, start_position=3))
            return self.snapshot()

        self.reset()
        call()
        last = self.inj._batch_last
        assert last is not None
        assert self.snapshot() == per_request([11, 10])
        ids_buf[0], ids_buf[1] = 12, 11  # an engine's persistent buffer, new contents
        self.reset()
        call()
        assert self.inj._batch_last is last  # the struct was reused
        assert self.snapshot() == per_request([12, 11])
        ids_buf[0] = 999
        self.reset()
        before = self.snapshot()
        with pytest.raises(kvi.NotFoundError):
            call()
        assert self.snapshot() == before
        assert self.inj._batch_last is last
        # int64 start positions: another dtype, the full path, a new entry
        ids_buf[0] = 10
        starts64 = Torchish(array.array("q", [3]), (1,), dtype="torch.int64")
        self.reset()
        self.inj.inject_batch(ids, table, fact_offsets=offs, tenant=1, first_slots=first, start_positions=starts64)
        assert self.inj._batch_last is not last
        assert self.snapshot() == per_request([10, 11])
        # lists are converted on every call: nothing kept
        self.inj.inject_batch([10], [5, 1, 7], fact_offsets=[0, 1], block_table_offsets=[0, 3], tenant=1)
        assert self.inj._batch_last is None

    def test_two_d_fact_ids(self):
        """A [requests, k] array of ids needs no offsets (a search's rows)."""
        self.reset()
        ids = array.array("Q", [11, 10, 12, 10])
        tables = array.array("i", [5, 1, 7, 2, 3, 0, 4, 6])
        self.inj.inject_batch(memoryview(ids).cast("B").cast("Q", (2, 2)),
                              memoryview(tables).cast("B").cast("i", (2, 4)), tenant=1, start_positions=[9, 90])
        got = self.snapshot()
        self.reset()
        self.inj.inject([kvi.InjectRequest(1, [11, 10], [5, 1, 7, 2], start_position=9),
                         kvi.InjectRequest(1, [12, 10], [3, 0, 4, 6], start_position=90)])
        assert self.snapshot() == got

    def test_offsets_past_their_arrays(self):
        """CSR offsets whose last entry passes the end of fact_ids or of the block
        tables are refused before the call, naming the argument (they were read
        past the arrays: here the entries behind a short view, valid ids and blocks
        that were injected silently; far past the end, a crash). Offsets are
        absolute: a first entry > 0 starts inside the array, as the header says."""
        ids = array.array("Q", [11, 10])
        tab = array.array("i", [5, 1, 7, 2, 9])
        one_id, two_blocks = memoryview(ids)[:1], memoryview(tab)[:2]  # 14 tokens need 4 blocks
        cases = [
            (dict(fact_ids=one_id, fact_offsets=[0, 2], block_table_offsets=[0, 5]),
             "fact_offsets[1] is 2, past the end of fact_ids (1 entries)"),
            (dict(fact_ids=ids, fact_offsets=[0, 2], block_tables=two_blocks, block_table_offsets=[0, 5]),
             "block_table_offsets[1] is 5, past the end of block_tables (2 entries)"),
            (dict(fact_ids=ids, fact_offsets=[1 << 30, (1 << 30) + 1], block_table_offsets=[0, 5]),
             "fact_offsets[1] is 1073741825, past the end of fact_ids (2 entries)"),
            (dict(fact_ids=ids, fact_offsets=[0, 2], block_table_offsets=[1 << 30, (1 << 30) + 4]),
             "block_table_offsets[1] is 1073741828, past the end of block_tables (5 entries)"),
            (dict(fact_ids=ids, fact_offsets=[-1, 1], block_table_offsets=[0, 5]), "fact_offsets[0] is -1"),
        ]
        self.reset()
        before = self.snapshot()
        for kw, message in cases:
            with case(kw=kw):
                kw.setdefault("block_tables", tab)
                out = array.array("i", [-5])
                with pytest.raises(ValueError) as e:
                    self.inj.inject_batch(tenant=1, out_tokens=out, **kw)
                assert message in str(e.value)
                assert not isinstance(e.value, kvi.KviError)  # the binding's check, not the library's
                assert self.snapshot() == before
                assert out[0] == -5
        # absolute offsets: [1, 2] is fact_ids[1] alone
        self.inj.inject_batch(ids, tab, fact_offsets=[1, 2], block_table_offsets=[0, 5], tenant=1)
        got = self.snapshot()
        self.reset()
        self.inj.inject(kvi.InjectRequest(1, [10], [5, 1, 7, 2, 9]))
        assert self.snapshot() == got

    def test_reused_call_checks_offsets_again(self):
        """The reused call of persistent tensors reads their contents afresh: offsets
        changed in place to pass the end of their arrays are refused as on a first call."""
        ids = Torchish(array.array("q", [11, 10]), (2,), dtype="torch.int64")
        offs_buf = array.array("i", [0, 2])
        offs = Torchish(offs_buf, (2,), dtype="torch.int32")
        tab = Torchish(array.array("i", [5, 1, 7, 2, 9]), (5,), dtype="torch.int32")
        indptr_buf = array.array("i", [0, 5])
        indptr = Torchish(indptr_buf, (2,), dtype="torch.int32")
        self.reset()
        self.inj.inject_batch(ids, tab, fact_offsets=offs, block_table_offsets=indptr, tenant=1)
        last = self.inj._batch_last
        assert last is not None
        before = self.snapshot()
        for buf, i, v, message in ((offs_buf, 1, 3, "fact_offsets[1] is 3, past the end of fact_ids"),
                                   (indptr_buf, 1, 6, "block_table_offsets[1] is 6, past the end of block_tables"),
                                   (offs_buf, 0, -1, "fact_offsets[0] is -1")):
            with case(message=message):
                old, buf[i] = buf[i], v
                with pytest.raises(ValueError) as e:
                    self.inj.inject_batch(ids, tab, fact_offsets=offs, block_table_offsets=indptr, tenant=1)
                buf[i] = old
                assert message in str(e.value)
                assert self.inj._batch_last is last
                assert self.snapshot() == before

    def test_refused_batches_write_nothing(self):
        self.reset()
        before = self.snapshot()
        ids, offs, tab = [11, 10], [0, 2], array.array("i", [5, 1, 7, 2, 9])
        table = memoryview(tab).cast("B").cast("i", (1, 5))
        cases = [
            (dict(fact_offsets=[0, 2], tenant=2), kvi.NotFoundError),
            (dict(fact_offsets=[2, 0]), kvi.InvalidArgumentError),
            (dict(fact_offsets=offs, first_slots=[7]), kvi.InvalidArgumentError),  # past the 5 blocks
            (dict(fact_offsets=offs, positions=[1, 2, 3]), kvi.InvalidArgumentError),  # 14 tokens
            (dict(fact_offsets=offs, start_positions=array.array("q", [1 << 40])), kvi.InvalidArgumentError),
        ]
        for kw, exc in cases:
            with case(kw=kw):
                kw.setdefault("tenant", 1)
                out = array.array("i", [-5])
                with pytest.raises(exc):
                    self.inj.inject_batch(ids, table, out_tokens=out, **kw)
                assert self.snapshot() == before
                assert out[0] == -5
        with pytest.raises(ValueError):  # both kinds of positions
            self.inj.inject_batch(ids, table, fact_offsets=offs, positions=[0] * 14, start_positions=[0])
        with pytest.raises(TypeError):  # int64 block ids
            self.inj.inject_batch(ids, array.array("q", [5, 1, 7, 2, 9]), fact_offsets=offs,
                                  block_table_offsets=[0, 5])
        with pytest.raises(ValueError):  # 2 rows for 1 request
            self.inj.inject_batch(ids, memoryview(tab).cast("B")[:16].cast("i", (2, 2)), fact_offsets=offs)
        assert self.snapshot() == before


class TestStridedHeads(InjectCase):
    """Head vectors that are not contiguous and V planes with their own strides."""
    NB, BS = 6, 4

    def test_vllm_cpu_tensors(self):
        """vLLM's CPU cache: [NB, H, BS, 2D] containers, per (block, head) K as [D, BS] then V as [BS, D]."""
        facts = Facts(self, DType.BF16, seed=30)
        NB, BS = self.NB, self.BS
        bufs = [poisoned(NB * H * BS * 2 * D, DType.BF16) for _ in range(L)]
        tensors = [FakeTensor(b, (NB, H, BS, 2 * D), dtype="torch.bfloat16") for b in bufs]
        layout = kvi.CacheLayout.vllm_cpu(tensors)
        assert (layout.token_stride, layout.dim_stride, layout.v_token_stride, layout.v_dim_stride,
                layout.v_offset, layout.head_stride, layout.block_stride) == \
               (1, BS, D, 1, D * BS, 2 * D * BS, H * 2 * D * BS)
        inj = kvi.Injector(facts.store, layout)
        table = [4, 0, 5, 2]
        inj.inject(kvi.InjectRequest(1, [11, 10], table, first_slot=1, start_position=77))
        writes = expected_writes(facts, [([11, 10], table, 1, None, 77, BS)])

        def index(l, kv, blk, tok, h, d):
            region = (blk * H + h) * 2 * D * BS
            return bufs[l], region + (D * BS + tok * D + d if kv else d * BS + tok)

        self.assert_cache(index, DType.BF16, None, writes, NB, BS)
        with pytest.raises(ValueError):  # not the contiguous container
            kvi.CacheLayout.vllm_cpu([FakeTensor(b, (NB, H, BS, 2 * D), (H * BS * 2 * D, 2 * D, H * 2 * D, 1),
                                                 dtype="torch.bfloat16") for b in bufs])

    def test_transposed_v_by_hand(self):
        """llama.cpp-style cells: K [cells][H * D], V [H * D][cells] (token stride 1), token-granular blocks."""
        facts = Facts(self, DType.FP32, seed=31)
        cells = 24
        kb = [poisoned(cells * H * D, DType.FP16) for _ in range(L)]
        vb = [poisoned(cells * H * D, DType.FP16) for _ in range(L)]
        layout = kvi.CacheLayout(memory=kvi.Memory.HOST, dtype=DType.FP16, num_layers=L, num_heads=H, head_size=D,
                                 block_size=1, num_blocks=cells, block_stride=H * D, token_stride=H * D,
                                 head_stride=D, k_layers=kb, v_layers=vb, v_block_stride=1, v_token_stride=1,
                                 v_head_stride=D * cells, v_dim_stride=cells)
        assert "V block 1 token 1 head %d dim %d" % (D * cells, cells) in repr(layout)
        inj = kvi.Injector(facts.store, layout)
        table = list(range(cells))
        pos = [3 * i + 1 for i in range(12)]
        inj.inject(kvi.InjectRequest(1, [12, 11], table, first_slot=7, positions=pos))
        writes = expected_writes(facts, [([12, 11], table, 7, pos, 0, 1)])

        def index(l, kv, blk, tok, h, d):
            return (vb[l], (h * D + d) * cells + blk) if kv else (kb[l], blk * H * D + h * D + d)

        self.assert_cache(index, DType.FP16, None, writes, cells, 1)

    def test_tensor_dim_stride(self):
        """HF tensors [B, H, S, D] viewed over a physical [B, H, D, S] (dims S apart): the last stride is used."""
        facts = Facts(self, DType.BF16, seed=33)
        B, S = 2, 12
        phys = [poisoned(B * H * D * S, DType.FP32) for _ in range(2 * L)]
        st = (H * D * S, D * S, 1, S)
        t = [FakeTensor(b, (B, H, S, D), st) for b in phys]
        layout = kvi.CacheLayout.hf(t[:L], t[L:])
        assert (layout.dim_stride, layout.token_stride) == (S, 1)
        inj = kvi.Injector(facts.store, layout)
        inj.inject(kvi.InjectRequest(1, [10], [1], first_slot=4, start_position=9))
        writes = expected_writes(facts, [([10], [1], 4, None, 9, S)])

        def index(l, kv, blk, tok, h, d):
            return phys[kv * L + l], ((blk * H + h) * D + d) * S + tok

        self.assert_cache(index, DType.FP32, None, writes, B, S)

    def test_overlapping_planes_refused(self):
        facts = Facts(self, DType.BF16, seed=32)
        # one element past the interleaved planes: V at offset 2 stays inside the buffer
        # (the binding refuses a layout past its buffers before the library sees it)
        buf = poisoned(2 * self.NB * H * self.BS * D + 1, DType.BF16)
        def interleaved(v_offset):  # K's dims 2 apart, V v_offset elements after K
            return kvi.CacheLayout(
                memory=kvi.Memory.HOST, dtype=DType.BF16, num_layers=L, num_heads=H, head_size=D,
                block_size=self.BS, num_blocks=self.NB, block_stride=2 * self.BS * H * D, token_stride=2 * H * D,
                head_stride=2 * D, dim_stride=2, v_offset=v_offset, k_layers=[buf] * L)
        with pytest.raises(kvi.InvalidArgumentError) as e:  # V's dims on K's next ones
            kvi.Injector(facts.store, interleaved(2))
        assert "K and V overlap" in str(e.value)
        kvi.Injector(facts.store, interleaved(1)).close()  # V's dims between K's: apart, accepted
        with pytest.raises(kvi.InvalidArgumentError) as e:
            kvi.Injector(facts.store, kvi.CacheLayout(
                memory=kvi.Memory.HOST, dtype=DType.BF16, num_layers=L, num_heads=H, head_size=D,
                block_size=self.BS, num_blocks=self.NB, block_stride=self.BS * H * D, token_stride=H * D,
                head_stride=D, v_dim_stride=-2, k_layers=[buf] * L, v_offset=self.NB * self.BS * H * D))
        assert "v_dim_stride" in str(e.value)


class TestSglang(InjectCase):
    def test_token_granular_memoryview_buffers(self):
        """[slots, H, D] per layer as 3-D memoryviews; page size 1: the block table
        is the slot of each token."""
        facts = Facts(self, DType.BF16, seed=30)
        slots = 32
        kb = [poisoned(slots * H * D, DType.FP32) for _ in range(L)]
        vb = [poisoned(slots * H * D, DType.FP32) for _ in range(L)]
        kviews = [memoryview(b).cast("B").cast("f", (slots, H, D)) for b in kb]
        vviews = [memoryview(b).cast("B").cast("f", (slots, H, D)) for b in vb]
        layout = kvi.CacheLayout.sglang(kviews, vviews)
        inj = kvi.Injector(facts.store, layout)
        r = rng(31)
        table = r.sample(range(slots), 12)
        inj.inject(kvi.InjectRequest(1, [12, 11], table, start_position=17))
        writes = expected_writes(facts, [([12, 11], table, 0, None, 17, 1)])

        def index(l, kv, blk, tok, h, d):
            return (kb if kv == 0 else vb)[l], (blk * H + h) * D + d

        self.assert_cache(index, DType.FP32, None, writes, slots, 1)


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))


class TestGil(InjectCase):
    """Injections of a CUDA store without a disk tier keep the GIL (ctypes.PyDLL): their
    C call only enqueues device work, and a call that released the GIL would wait, when
    it returns, for any other Python thread that took it meanwhile (up to
    sys.getswitchinterval()). A CPU store's injections (the call does the copy) and a
    disk-tier store's (the call may read from disk) release it; kvi_inject_plan keeps it
    on any store without a disk tier. The structs' _init functions and the error queries
    keep it always. (No CUDA here: a CPU store's injector is told it enqueues only.)"""

    NB, BS = 8, 4

    def calls(self, monkeypatch, store, enqueues_only=None):
        from kvinject._lib import lib
        L_ = lib()
        seen = []
        for name in ("kvi_inject", "kvi_inject_gil", "kvi_inject_batched", "kvi_inject_batched_gil", "kvi_inject_plan",
                     "kvi_inject_plan_gil"):
            fn = getattr(L_, name)
            monkeypatch.setattr(L_, name, lambda *a, _fn=fn, _n=name: seen.append(_n) or _fn(*a))
        caches = [poisoned(2 * self.NB * self.BS * H * D, DType.BF16) for _ in range(L)]
        inj = kvi.Injector(store, kvi.CacheLayout.vllm(caches, shape=(2, self.NB, self.BS, H, D), dtype=DType.BF16))
        self.closing.append(inj)
        if enqueues_only is not None:
            monkeypatch.setattr(inj, "_enqueues_only", lambda: enqueues_only)
        inj.inject(kvi.InjectRequest(1, [11], [5, 1, 7], first_slot=0, start_position=0))
        assert inj.plan(1, [11]) == 9
        inj.inject_batch(array.array("Q", [11]), array.array("i", [5, 1, 7]), fact_offsets=array.array("i", [0, 1]),
                         block_table_offsets=array.array("i", [0, 3]), tenant=1)
        return seen, caches

    def test_the_twins_keep_the_gil(self):
        import ctypes
        from kvinject._lib import lib
        L_ = lib()
        keep = ctypes._FUNCFLAG_PYTHONAPI
        for name in ("kvi_inject_gil", "kvi_inject_batched_gil", "kvi_inject_plan_gil", "kvi_inject_request_init",
                     "kvi_last_error"):
            assert getattr(L_, name)._flags_ & keep, name
        for name in ("kvi_inject", "kvi_inject_batched", "kvi_inject_plan", "kvi_store_prefetch", "kvi_encode",
                     "kvi_store_put"):
            assert not getattr(L_, name)._flags_ & keep, name

    def test_which_calls_keep_it(self, monkeypatch, tmp_path):
        facts = Facts(self, DType.BF16, seed=40)
        blank = bytes(poisoned(2 * self.NB * self.BS * H * D, DType.BF16))
        seen, caches = self.calls(monkeypatch, facts.store)  # a CPU store: the injections do the copy
        assert seen == ["kvi_inject", "kvi_inject_plan_gil", "kvi_inject_batched"]
        assert any(bytes(c) != blank for c in caches)
        seen, caches = self.calls(monkeypatch, facts.store, enqueues_only=True)  # as a CUDA store's
        assert seen == ["kvi_inject_gil", "kvi_inject_plan_gil", "kvi_inject_batched_gil"]
        assert any(bytes(c) != blank for c in caches)
        disk = kvi.Store(facts.model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.BF16, page_tokens=4,
                         disk_dir=str(tmp_path))
        self.closing.append(disk)
        T = facts.tokens(11)
        k = [x for l in range(L) for t in range(T) for h in range(H) for x in facts.k[11][l][t][h]]
        v = [x for l in range(L) for t in range(T) for h in range(H) for x in facts.v[11][l][t][h]]
        disk.put(1, 11, encode(k, DType.FP32), encode(v, DType.FP32))
        assert disk.has_disk_tier and not facts.store.has_disk_tier
        seen, _ = self.calls(monkeypatch, disk)
        assert seen == ["kvi_inject", "kvi_inject_plan", "kvi_inject_batched"]
