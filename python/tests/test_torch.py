"""The binding with real torch tensors. Skips (pytest.skip) without torch;
the CUDA class also skips without a CUDA device, a CUDA build of the library,
or (search) cuBLASLt. KVINJECT_REQUIRE_CUDA=1 turns those skips into failures
(for the GPU machine, where they must run).

CPU: permuted tensor views through put/read, Hugging Face [batch, heads, seq,
dim] caches (also a transformers DynamicCache, compared with transformers' own
LlamaRotaryEmbedding + apply_rotary_pos_emb where transformers is installed),
search with tensor queries.
CUDA: device stores fed with device tensors on a torch stream, HF-layout caches
on the device with host and device block tables, against the same float64
reference and bit for bit against the CPU backend with an engine cos/sin
table; that work really goes on the given stream; skipped tokens of device
block tables; search with device queries and outputs; capture on the device.

Reference RoPE here: HF's formula (x * cos + rotate_half(x) * sin) in float64
with llama3 inverse frequencies written from modeling_rope_utils.
"""
from __future__ import annotations

import math
import os
import sys
import time

import pytest

from kvi_testutil import case
import kvinject as kvi
from kvinject import DType

try:
    import torch
except ImportError:  # the suite still runs; these tests skip
    torch = None

L, H, D = 4, 2, 64
B, S = 3, 48
ROPE = dict(style=kvi.RopeStyle.NEOX, theta=500000.0, scaling=kvi.RopeScaling.LLAMA3, factor=8.0,
            low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
FACTS = {10: 5, 11: 17, 12: 3}
UNIT = {DType.FP32: 2.0 ** -24, DType.FP16: 2.0 ** -11, DType.BF16: 2.0 ** -8}


def skip_or_fail(why):
    """Skip with `why`; with KVINJECT_REQUIRE_CUDA=1 (the GPU machine) fail instead,
    so a run that should exercise the device cannot pass by skipping."""
    if os.environ.get("KVINJECT_REQUIRE_CUDA") == "1":
        raise AssertionError("KVINJECT_REQUIRE_CUDA=1, but " + why)
    pytest.skip(why)


def cuda_ready():
    """None when CUDA tests can run, else why not."""
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if not kvi.features() & kvi.FEATURE_CUDA:
        return "libkvinject was built without CUDA"
    if kvi.cuda_device_count() < 1:
        return "libkvinject sees no CUDA device"
    return None


# ------------------------------------------------------------------ reference
def llama3_inv_freq(dim=D, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
    """HF _compute_llama3_parameters, float64."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    wavelen = 2 * math.pi / inv
    lo_wl, hi_wl = orig / low, orig / high
    scaled = torch.where(wavelen > lo_wl, inv / factor, inv)
    smooth = (orig / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < hi_wl) & ~(wavelen > lo_wl)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x, positions, inv):
    """x: [T, H, D] float64; positions: T ints. HF NeoX rotation and the per-element
    bound on the library's difference from it (see kvi_testutil.RefRope.tol)."""
    p = torch.tensor(positions, dtype=torch.float64)[:, None, None]
    ang = p * torch.cat((inv, inv))[None, None, :]
    y = x * torch.cos(ang) + rotate_half(x) * torch.sin(ang)
    rin = x.abs() + rotate_half(x).abs()
    tol = rin * (p * torch.cat((inv, inv)) * 2.0 ** -22 + 4e-6)
    return y, tol


def random_facts(gen):
    """fid -> (k, v) of [L, T, H, D] float64, bf16-exact values."""
    out = {}
    for fid, T in FACTS.items():
        k = torch.randn(L, H, T, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
        v = torch.randn(L, H, T, D, generator=gen).to(torch.bfloat16).transpose(1, 2)
        out[fid] = (k, v)  # non-contiguous [L, T, H, D] views of [L, H, T, D] storage
    return out


REQUESTS = [  # (fact ids, batch row, first slot, positions or None, start position)
    ([11, 10], 2, 4, None, 100),
    ([12], 0, 40, [7, 500, 9000], 0),
]


def expected_hf(facts, requests, dtype, poison):
    """Expected HF caches (float64 values, tolerances, written mask) [L][B, H, S, D]."""
    inv = llama3_inv_freq()
    exp_k = torch.full((L, B, H, S, D), float(poison), dtype=torch.float64)
    exp_v = exp_k.clone()
    tol = torch.zeros_like(exp_k)
    written = torch.zeros((L, B, H, S, D), dtype=torch.bool)
    for fids, row, first, positions, start in requests:
        i = 0
        for fid in fids:
            k, v = facts[fid]
            T = k.shape[1]
            pos = positions[i:i + T] if positions is not None else list(range(start + i, start + i + T))
            for l in range(L):
                y, t = rope_ref(k[l].double(), pos, inv)  # [T, H, D]
                exp_k[l, row, :, first + i:first + i + T] = y.transpose(0, 1)
                tol[l, row, :, first + i:first + i + T] = t.transpose(0, 1)
                exp_v[l, row, :, first + i:first + i + T] = v[l].double().transpose(0, 1)
                written[l, row, :, first + i:first + i + T] = True
            i += T
    tol += 2 * UNIT[dtype] * exp_k.abs()
    return exp_k, exp_v, tol, written


class TorchCase:
    @pytest.fixture(autouse=True)
    def _closing(self, closing):
        self.closing = closing

    def model(self, rope=None):
        m = kvi.Model(L, H, D)
        m.set_rope(**(rope or ROPE))
        self.closing.append(m)
        return m

    def hf_cache(self, dtype, device, poison=-7.0):
        tdt = {DType.FP32: torch.float32, DType.FP16: torch.float16, DType.BF16: torch.bfloat16}[dtype]
        keys = [torch.full((B, H, S, D), poison, dtype=tdt, device=device) for _ in range(L)]
        values = [torch.full((B, H, S, D), poison, dtype=tdt, device=device) for _ in range(L)]
        return keys, values

    def inject_requests(self, inj, requests, stream=None, device_tables=False, device=None):
        reqs = []
        for fids, row, first, positions, start in requests:
            table = torch.tensor([row], dtype=torch.int32, device=device if device_tables else "cpu")
            reqs.append(kvi.InjectRequest(1, fids, table, first_slot=first, positions=positions,
                                          start_position=start))
        if device_tables:
            torch.cuda.synchronize()  # the tables were copied on the current stream, not on `stream`
        inj.inject(reqs, stream=stream)

    def assert_hf(self, keys, values, facts, requests, dtype, poison=-7.0):
        exp_k, exp_v, tol, written = expected_hf(facts, requests, dtype, poison)
        got_k = torch.stack([k.double().cpu() for k in keys])
        got_v = torch.stack([v.double().cpu() for v in values])
        assert bool(written.any())
        bad = (got_k - exp_k).abs() > tol
        assert not bool(bad.any()), "K differs from the reference at %d elements, first %s: %r vs %r" \
               % (int(bad.sum()), bad.nonzero()[0].tolist() if bad.any() else None,
                  got_k[bad][:3].tolist(), exp_k[bad][:3].tolist())
        assert torch.equal(got_v, exp_v), "V differs from the reference"
        assert torch.equal(got_k[~written], exp_k[~written]), "elements outside the facts were written"


class TestTorchCPU(TorchCase):
    @pytest.fixture(autouse=True, scope="class")
    def _torch(self):
        if torch is None:
            skip_or_fail("torch is not installed")

    @pytest.fixture(autouse=True)
    def _setup(self, _torch):
        self.gen = torch.Generator().manual_seed(1234)

    def store(self, **kw):
        kw.setdefault("backend", kvi.Backend.CPU)
        kw.setdefault("dtype", DType.BF16)
        s = kvi.Store(self.model(), 1 << 22, **kw)
        self.closing.append(s)
        return s

    def test_put_read_views(self):
        s = self.store()
        facts = random_facts(self.gen)
        for fid, (k, v) in facts.items():
            assert not k.is_contiguous()
            s.put(1, fid, k, v)
        for fid, (k, v) in facts.items():
            ok = torch.empty(k.shape, dtype=torch.float32)
            ov = torch.empty(k.shape, dtype=torch.float32)
            s.read(1, fid, ok, ov)
            assert torch.equal(ok, k.float()) and torch.equal(ov, v.float())
            # into a bf16 transposed view of a [L, H, T, D] tensor
            dst = torch.zeros(L, H, k.shape[1], D, dtype=torch.bfloat16)
            dst_v = torch.zeros_like(dst)
            s.read(1, fid, dst.transpose(1, 2), dst_v.transpose(1, 2))
            assert torch.equal(dst.transpose(1, 2), k) and torch.equal(dst_v.transpose(1, 2), v)
        with pytest.raises(TypeError):
            s.put(1, 99, facts[10][0].double(), facts[10][1].double())  # fp64 is not a storage input
        with pytest.raises(ValueError):
            s.put(1, 99, facts[10][0][..., ::2], facts[10][1][..., ::2])  # head vectors not contiguous

    def test_hf_inject(self):
        for dtype in (DType.FP32, DType.BF16):
            with case(cache=dtype.name):
                s = self.store()
                facts = random_facts(self.gen)
                for fid, (k, v) in facts.items():
                    s.put(1, fid, k, v)
                keys, values = self.hf_cache(dtype, "cpu")
                layout = kvi.CacheLayout.hf(keys, values)
                assert (layout.num_blocks, layout.block_size, layout.dtype) == (B, S, dtype)
                inj = kvi.Injector(s, layout)
                self.inject_requests(inj, REQUESTS)
                self.assert_hf(keys, values, facts, REQUESTS, dtype)

    def test_transformers_dynamic_cache_parity(self):
        try:
            from transformers import DynamicCache, LlamaConfig
            from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
        except ImportError as e:
            skip_or_fail("transformers is not installed (%s)" % e)
        cfg = LlamaConfig(hidden_size=H * D * 2, num_attention_heads=2 * H, num_key_value_heads=H, head_dim=D,
                          num_hidden_layers=L, vocab_size=128, max_position_embeddings=131072,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 8192})
        rotary = LlamaRotaryEmbedding(cfg)
        cache = DynamicCache()
        for l in range(L):
            cache.update(torch.full((B, H, S, D), -7.0), torch.full((B, H, S, D), -7.0), l)
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        s = self.store()
        facts = random_facts(self.gen)
        for fid, (k, v) in facts.items():
            s.put(1, fid, k, v)
        inj = kvi.Injector(s, kvi.CacheLayout.hf(keys, values))
        self.inject_requests(inj, REQUESTS)
        inv = llama3_inv_freq()
        for fids, row, first, positions, start in REQUESTS:
            i = 0
            for fid in fids:
                k, _ = facts[fid]
                T = k.shape[1]
                pos = positions[i:i + T] if positions is not None else list(range(start + i, start + i + T))
                cos, sin = rotary(torch.zeros(1, T, D), torch.tensor([pos]))
                for l in range(L):
                    x = k[l].float().transpose(0, 1)[None]  # [1, H, T, D] as HF holds keys
                    _, hf = apply_rotary_pos_emb(x, x, cos, sin)
                    got = cache.layers[l].keys[row, :, first + i:first + i + T]
                    _, tol = rope_ref(k[l].double(), pos, inv)
                    # HF's own fp32 frequencies and products differ from the exact rotation by
                    # about as much as the library's: twice the library's bound
                    bound = 2 * tol.transpose(0, 1) + 2.0 ** -22 * hf[0].double().abs()
                    diff = (got.double() - hf[0].double()).abs()
                    assert not bool((diff > bound).any()), \
                           "layer %d fact %d: max difference from transformers %g" % (l, fid, diff.max())
                i += T

    def test_search_with_tensor_queries(self):
        s = self.store(embedding_dim=16, metric=kvi.Metric.COSINE)
        kv = torch.ones(L, 1, H, D)
        emb = torch.randn(20, 16, generator=self.gen)
        for i in range(20):
            s.put(3, 100 + i, kv, kv, embedding=emb[i])
        q = torch.randn(4, 16, generator=self.gen)
        base = s.search(q.tolist(), 3, 6)
        res = s.search(q, 3, 6)
        assert (list(res.ids), list(res.scores)) == (list(base.ids), list(base.scores))
        bf = q.to(torch.bfloat16)  # a bf16 tensor is read as bf16
        res, want = s.search(bf, 3, 6), s.search(bf.float().tolist(), 3, 6)
        assert (list(res.ids), list(res.scores)) == (list(want.ids), list(want.scores))
        ids = torch.empty(4, 6, dtype=torch.int64)
        scores = torch.empty(4, 6)
        counts = torch.empty(4, dtype=torch.int32)
        s.search(q, 3, 6, out=(ids, scores, counts))
        assert ids.flatten().tolist() == list(base.ids)
        assert scores.flatten().tolist() == list(base.scores)
        with pytest.raises(ValueError):  # a transposed (non-contiguous) query matrix
            s.search(q.t(), 3, 6)


class TestTorchCUDA(TorchCase):
    @pytest.fixture(autouse=True, scope="class")
    def _cuda(self):
        why = cuda_ready()
        if why:
            skip_or_fail(why)

    @pytest.fixture(autouse=True)
    def _setup(self, _cuda):
        self.gen = torch.Generator().manual_seed(99)
        self.dev = torch.device("cuda", torch.cuda.current_device())

    def stores(self, **kw):
        m = self.model(kw.pop("rope", None))
        out = []
        for backend in (kvi.Backend.CUDA, kvi.Backend.CPU):
            s = kvi.Store(m, 1 << 25, backend=backend, dtype=kw.get("dtype", DType.BF16),
                          device=self.dev.index if backend == kvi.Backend.CUDA else None,
                          **{k: v for k, v in kw.items() if k != "dtype"})
            self.closing.append(s)
            out.append(s)
        assert out[0].backend == kvi.Backend.CUDA
        assert out[0].device == self.dev.index
        return out

    def test_put_read_device_tensors_on_a_stream(self):
        cs, _ = self.stores()
        facts = random_facts(self.gen)
        dev = {fid: (k.to(self.dev), v.to(self.dev)) for fid, (k, v) in facts.items()}
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        for fid, (k, v) in dev.items():
            assert not k.is_contiguous()
            cs.put(1, fid, k, v, stream=s)
        outs = {}
        for fid, (k, _) in dev.items():
            with torch.cuda.stream(s):
                ok = torch.empty(k.shape, dtype=torch.float32, device=self.dev)
                ov = torch.empty(k.shape, dtype=torch.float32, device=self.dev)
            cs.read(1, fid, ok, ov, stream=s)
            outs[fid] = (ok, ov)
        s.synchronize()
        for fid, (k, v) in facts.items():
            assert torch.equal(outs[fid][0].cpu(), k.float())
            assert torch.equal(outs[fid][1].cpu(), v.float())
            # host tensors as source and destination of a CUDA store
            hk = torch.empty(k.shape, dtype=torch.bfloat16)
            hv = torch.empty(k.shape, dtype=torch.bfloat16).pin_memory()
            cs.read(1, fid, hk, hv)
            assert torch.equal(hk, k) and torch.equal(hv, v)
        cs.put(2, 1, facts[10][0], facts[10][1])  # host tensors into a CUDA store
        assert cs.fact_tokens(2, 1) == FACTS[10]

    def test_hf_inject_host_and_device_tables(self):
        for device_tables in (False, True):
            for dtype in (DType.BF16, DType.FP16, DType.FP32):
                with case(device_tables=device_tables, cache=dtype.name):
                    cs, _ = self.stores()
                    facts = random_facts(self.gen)
                    for fid, (k, v) in facts.items():
                        cs.put(1, fid, k.to(self.dev), v.to(self.dev))
                    keys, values = self.hf_cache(dtype, self.dev)
                    torch.cuda.synchronize()
                    layout = kvi.CacheLayout.hf(keys, values)
                    assert layout.memory == kvi.Memory.DEVICE
                    inj = kvi.Injector(cs, layout)
                    s = torch.cuda.Stream()
                    self.inject_requests(inj, REQUESTS, stream=s, device_tables=device_tables, device=self.dev)
                    s.synchronize()
                    assert inj.async_errors() == 0
                    self.assert_hf(keys, values, facts, REQUESTS, dtype)

    def test_engine_table_bit_parity_with_cpu(self):
        inv = llama3_inv_freq()
        ang = torch.arange(10000, dtype=torch.float64)[:, None] * inv[None, :]
        table = torch.cat((torch.cos(ang), torch.sin(ang)), dim=1).float()  # [positions, D]: cos half, sin half
        rope = dict(style=kvi.RopeStyle.NEOX, cos_sin_table=table)
        cs, hs = self.stores(rope=rope)
        facts = random_facts(self.gen)
        for fid, (k, v) in facts.items():
            cs.put(1, fid, k.to(self.dev), v.to(self.dev))
            hs.put(1, fid, k, v)
        dk, dv = self.hf_cache(DType.BF16, self.dev)
        hk, hv = self.hf_cache(DType.BF16, "cpu")
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        dinj = kvi.Injector(cs, kvi.CacheLayout.hf(dk, dv))  # kept alive until the stream has passed
        hinj = kvi.Injector(hs, kvi.CacheLayout.hf(hk, hv))
        self.inject_requests(dinj, REQUESTS, stream=s)
        self.inject_requests(hinj, REQUESTS)
        s.synchronize()
        for l in range(L):
            assert torch.equal(dk[l].cpu(), hk[l]), "layer %d K: CUDA and CPU differ" % l
            assert torch.equal(dv[l].cpu(), hv[l]), "layer %d V: CUDA and CPU differ" % l
        self.assert_hf(hk, hv, facts, REQUESTS, DType.BF16)

    def test_work_goes_on_the_given_stream(self):
        if not hasattr(torch.cuda, "_sleep"):
            skip_or_fail("torch.cuda._sleep is not available")
        cs, _ = self.stores()
        facts = random_facts(self.gen)
        for fid, (k, v) in facts.items():
            cs.put(1, fid, k.to(self.dev), v.to(self.dev))
        keys, values = self.hf_cache(DType.BF16, self.dev)
        inj = kvi.Injector(cs, kvi.CacheLayout.hf(keys, values))
        torch.cuda.synchronize()
        s = torch.cuda.Stream()  # non-blocking: the default stream does not wait for it
        with torch.cuda.stream(s):
            torch.cuda._sleep(int(3e9))  # > 1 s of GPU clock
        t0 = time.monotonic()
        self.inject_requests(inj, REQUESTS, stream=s)
        enqueue_s = time.monotonic() - t0
        before = keys[2].clone()  # on the default stream: runs now, not after s
        torch.cuda.current_stream().synchronize()
        assert not s.query(), "the stream finished its 1 s sleep already (enqueue took %.3f s)" % enqueue_s
        assert bool((before == -7.0).all()), \
               "the cache changed before the stream passed the injection: it did not go on the stream"
        s.synchronize()
        self.assert_hf(keys, values, facts, REQUESTS, DType.BF16)

    def test_device_block_table_out_of_range_is_counted(self):
        cs, _ = self.stores()
        facts = random_facts(self.gen)
        for fid, (k, v) in facts.items():
            cs.put(1, fid, k.to(self.dev), v.to(self.dev))
        keys, values = self.hf_cache(DType.BF16, self.dev)
        inj = kvi.Injector(cs, kvi.CacheLayout.hf(keys, values))
        torch.cuda.synchronize()
        table = torch.tensor([B + 5], dtype=torch.int32, device=self.dev)  # no such batch row
        inj.inject(kvi.InjectRequest(1, [11], table, first_slot=0))
        torch.cuda.synchronize()
        assert inj.async_errors() == FACTS[11]  # counted once per token
        assert inj.async_errors() == 0  # read and cleared
        for k in keys:
            assert bool((k == -7.0).all())

    def test_search_device_queries_and_outputs(self):
        if not kvi.features() & kvi.FEATURE_CUBLASLT:
            skip_or_fail("libkvinject was built without cuBLASLt")
        cs, hs = self.stores(embedding_dim=64, embedding_dtype=DType.FP16, metric=kvi.Metric.COSINE)
        kv = torch.ones(L, 1, H, D)
        emb = torch.randn(300, 64, generator=self.gen)
        for i in range(300):
            for st in (cs, hs):
                st.put(1 + i % 3, 1000 + i, kv, kv, embedding=emb[i])
        for nq in (4, 40):  # the scan kernel and the GEMM path
            q = torch.randn(nq, 64, generator=self.gen)
            tenants = [1 + i % 3 for i in range(nq)]
            ref = hs.search(q, tenants, 10)
            got = cs.search(q.to(self.dev), tenants, 10)  # device queries, host results
            s = torch.cuda.Stream()
            ids = torch.empty(nq, 10, dtype=torch.int64, device=self.dev)
            scores = torch.empty(nq, 10, device=self.dev)
            counts = torch.empty(nq, dtype=torch.int32, device=self.dev)
            with torch.cuda.stream(s):
                qd = q.to(self.dev)
            cs.search(qd, tenants, 10, out=(ids, scores, counts), stream=s)
            s.synchronize()
            assert counts.tolist() == list(ref.counts)
            for i in range(nq):
                for res_ids, res_scores in ((got.ids[i * 10:(i + 1) * 10], got.scores[i * 10:(i + 1) * 10]),
                                            (ids[i].tolist(), scores[i].tolist())):
                    for j in range(10):
                        rid, rs = ref.ids[i * 10 + j], ref.scores[i * 10 + j]
                        # fp32 accumulation on the device: scores within 1e-4 of the CPU's exact
                        # ones; ids may trade places only between that close scores
                        assert abs(res_scores[j]-rs) < 1e-4
                        if res_ids[j] % (1 << 64) != rid:
                            assert abs(res_scores[j]-ref.scores[i * 10 + j]) < 2e-4
        assert cs.async_errors() == 0

    def test_retrieve_inject_on_device(self):
        """kvi_retrieve_inject's device path (a CUDA store without a host tier): the same
        ids, tokens and cache bytes as the CPU store's, with an engine cos/sin table
        (bit parity) and integer embeddings (exact scores, ties broken by id on both)."""
        if not kvi.features() & kvi.FEATURE_CUBLASLT:
            skip_or_fail("libkvinject was built without cuBLASLt")
        inv = llama3_inv_freq()
        ang = torch.arange(10000, dtype=torch.float64)[:, None] * inv[None, :]
        table = torch.cat((torch.cos(ang), torch.sin(ang)), dim=1).float()
        cs, hs = self.stores(rope=dict(style=kvi.RopeStyle.NEOX, cos_sin_table=table), embedding_dim=16,
                             embedding_dtype=DType.FP16)
        facts = random_facts(self.gen)
        emb = torch.randint(-4, 5, (len(facts), 16), generator=self.gen).float()
        for i, (fid, (k, v)) in enumerate(facts.items()):
            cs.put(1, fid, k.to(self.dev), v.to(self.dev), embedding=emb[i])
            hs.put(1, fid, k, v, embedding=emb[i])
        q = torch.randint(-3, 4, (2, 16), generator=self.gen).float()
        dk, dv = self.hf_cache(DType.BF16, self.dev)
        hk, hv = self.hf_cache(DType.BF16, "cpu")
        dtables = [torch.tensor([r], dtype=torch.int32, device=self.dev) for r in (2, 0)]
        htables = [torch.tensor([r], dtype=torch.int32) for r in (2, 0)]
        torch.cuda.synchronize()
        dinj = kvi.Injector(cs, kvi.CacheLayout.hf(dk, dv))
        hinj = kvi.Injector(hs, kvi.CacheLayout.hf(hk, hv))

        def requests(tables):  # 2 facts of up to 17 tokens each fit from slots 4 and 1 of 48
            return [kvi.RetrieveRequest(1, tables[0], first_slot=4, start_position=100),
                    kvi.RetrieveRequest(1, tables[1], first_slot=1, start_position=7, best_last=True)]

        got = dinj.retrieve_inject(q.to(self.dev), requests(dtables), 2)
        want = hinj.retrieve_inject(q, requests(htables), 2)
        assert got == want
        assert all(len(ids) == 2 and tokens > 0 for ids, tokens in got)
        torch.cuda.synchronize()
        for l in range(L):
            assert torch.equal(dk[l].cpu(), hk[l]), "layer %d K: CUDA and CPU differ" % l
            assert torch.equal(dv[l].cpu(), hv[l]), "layer %d V: CUDA and CPU differ" % l
        assert not bool((hk[0] == -7.0).all()), "nothing was injected"
        # device outputs on a stream: no host synchronization in the call; the same again
        ids = torch.full((2, 2), 7, dtype=torch.int64, device=self.dev)
        counts = torch.full((2,), -1, dtype=torch.int32, device=self.dev)
        tokens = torch.full((2,), -1, dtype=torch.int32, device=self.dev)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            qd = q.to(self.dev)
        dinj.retrieve_inject(qd, requests(dtables), 2, out=(ids, counts, tokens), stream=s)
        s.synchronize()
        assert [(ids[i, :int(counts[i])].tolist(), int(tokens[i])) for i in range(2)] == want
        for l in range(L):
            assert torch.equal(dk[l].cpu(), hk[l]), "layer %d K: CUDA and CPU differ" % l
        assert dinj.async_errors() == 0

    def test_encode_on_device(self):
        cs, hs = self.stores()
        inv = llama3_inv_freq()
        pre_k = torch.randn(L, B, H, S, D, generator=self.gen).to(torch.bfloat16).double()
        pre_v = torch.randn(L, B, H, S, D, generator=self.gen).to(torch.bfloat16)
        positions = [3 * s + 5 for s in range(S)]
        rot, rot_tol = torch.empty_like(pre_k), torch.empty_like(pre_k)
        for l in range(L):
            for b in range(B):
                y, t = rope_ref(pre_k[l, b].transpose(0, 1), positions, inv)
                rot[l, b], rot_tol[l, b] = y.transpose(0, 1), t.transpose(0, 1)
        keys = [rot[l].float().to(self.dev) for l in range(L)]  # an fp32 cache the engine wrote
        values = [pre_v[l].float().to(self.dev) for l in range(L)]
        torch.cuda.synchronize()
        enc = kvi.Encoder(cs, kvi.CacheLayout.hf(keys, values))
        s = torch.cuda.Stream()
        enc.encode([kvi.Capture(1, 7, [1], num_tokens=9, first_slot=10, positions=positions[10:19]),
                    kvi.Capture(1, 8, [2], num_tokens=4, first_slot=0, positions=positions[0:4])], stream=s)
        s.synchronize()
        for fid, row, first, n in ((7, 1, 10, 9), (8, 2, 0, 4)):
            k = torch.empty(L, n, H, D)
            v = torch.empty(L, n, H, D)
            cs.read(1, fid, k, v)
            want = pre_k[:, row, :, first:first + n].transpose(1, 2)
            tol = rot_tol[:, row, :, first:first + n].transpose(1, 2)
            # the un-rotation is within the pair's bound `tol` of the original (the fp32 cache's
            # rounding included), then bf16 storage rounds: half a unit of bf16
            err = (k.double() - want).abs() - (2.0 ** -8 * want.abs() + 2 * tol + 1e-30)
            assert not bool((err > 0).any()), \
                   "fact %d: max error %g" % (fid, float((k.double() - want).abs().max()))
            assert torch.equal(v, pre_v[:, row, :, first:first + n].transpose(1, 2).float())

    def test_memory_kinds(self):
        cs, hs = self.stores()
        keys, values = self.hf_cache(DType.BF16, "cpu")
        with pytest.raises(kvi.MemoryKindError):  # a host cache for a CUDA store
            kvi.Injector(cs, kvi.CacheLayout.hf(keys, values))
        dk, dv = self.hf_cache(DType.BF16, self.dev)
        with pytest.raises(kvi.MemoryKindError):  # a device cache for a CPU store
            kvi.Injector(hs, kvi.CacheLayout.hf(dk, dv))
        k = torch.ones(L, 2, H, D, device=self.dev)
        with pytest.raises(kvi.MemoryKindError):
            hs.put(1, 1, k, k)
        assert hs.count(1) == 0


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))


def test_the_connectors_raw_stream_is_torchs_current_stream():
    # kvinject.vllm.worker.raw_stream_getter gives the library the stream vLLM's
    # forward runs on: torch's current stream, also inside a `with torch.cuda.stream`
    why = cuda_ready()
    if why:
        skip_or_fail(why)
    from kvinject.vllm.worker import raw_stream_getter
    dev = torch.cuda.current_device()
    get = raw_stream_getter(dev)
    assert get() == torch.cuda.current_stream(dev).cuda_stream
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        assert get() == s.cuda_stream
    assert get() == torch.cuda.current_stream(dev).cuda_stream
