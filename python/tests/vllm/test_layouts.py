"""kvinject.vllm.layout.derive_layout against torch tensors shaped as vLLM's
backends shape them, without vLLM: for each backend layout, a fact is injected
through the derived layout and read back by indexing the tensors the way the
backend reads them (the reference: float64 rotation in torch), everything else
in the cache must be untouched, and a capture (kvi_encode) through the same
layout gives the fact back. Unsupported layouts must be refused.

    launch.py test_layouts.py [--device cpu|cuda]

On the CPU (CI) the stores are CPU stores over host tensors; with --device
cuda (a CUDA build of libkvinject and a GPU) they are CUDA stores over device
tensors, the library's CUDA backend through torch (without them every test
skips).
"""
from __future__ import annotations

import pytest
import torch

import kvinject as kvi
from kvinject.vllm.layout import LayoutError, derive_layout

L, H, D, BS, NB = 2, 2, 16, 16, 6
THETA = 10000.0


# --------------------------------------------------------------- layouts
# each: make(dtype, device) -> (per-layer tensors, backend, isa, kv(tensor, block, t) -> (K[H, D], V[H, D]) views)

def flash_attn(hnd):
    def make(dtype, dev):
        if hnd:  # physical [2, NB, H, BS, D], logical [2, NB, BS, H, D]
            ts = [torch.empty(2, NB, H, BS, D, dtype=dtype, device=dev).permute(0, 1, 3, 2, 4) for _ in range(L)]
        else:
            ts = [torch.empty(2, NB, BS, H, D, dtype=dtype, device=dev) for _ in range(L)]
        return ts, "FLASH_ATTN", None, lambda c, b, t: (c[0, b, t], c[1, b, t])
    return make


def flashinfer(hnd, backend="FLASHINFER"):
    def make(dtype, dev):
        if hnd:  # physical [NB, 2, H, BS, D]
            ts = [torch.empty(NB, 2, H, BS, D, dtype=dtype, device=dev).permute(0, 1, 3, 2, 4) for _ in range(L)]
        else:
            ts = [torch.empty(NB, 2, BS, H, D, dtype=dtype, device=dev) for _ in range(L)]
        return ts, backend, None, lambda c, b, t: (c[b, 0, t], c[b, 1, t])
    return make


def packed(hnd):
    def make(dtype, dev):
        if hnd:  # [NB, H, BS, 2D]
            ts = [torch.empty(NB, H, BS, 2 * D, dtype=dtype, device=dev) for _ in range(L)]
            return ts, "FLASH_ATTN", None, lambda c, b, t: (c[b, :, t, :D], c[b, :, t, D:])
        ts = [torch.empty(NB, BS, H, 2 * D, dtype=dtype, device=dev) for _ in range(L)]
        return ts, "FLASH_ATTN", None, lambda c, b, t: (c[b, t, :, :D], c[b, t, :, D:])
    return make


def cpu_attn(dtype, dev):
    # [NB, H, BS, 2D] container; per (block, head): K [D][BS] (token fastest), then V [BS][D]
    ts = [torch.empty(NB, H, BS, 2 * D, dtype=dtype, device=dev) for _ in range(L)]

    def kv(c, b, t):
        region = c[b].reshape(H, 2 * D * BS)
        k = region[:, :D * BS].reshape(H, D, BS)[:, :, t]
        v = region[:, D * BS:].reshape(H, BS, D)[:, t, :]
        return k, v
    return ts, "CPU_ATTN", "vec", kv


LAYOUTS = {
    "FLASH_ATTN [2, NB, BS, H, D]": flash_attn(False),
    "FLASH_ATTN HND [2, NB, H, BS, D] (permuted view)": flash_attn(True),
    "FLASHINFER [NB, 2, BS, H, D]": flashinfer(False),
    "FLASHINFER HND (permuted view)": flashinfer(True),
    "TRITON_ATTN [NB, 2, BS, H, D]": flashinfer(False, "TRITON_ATTN"),
    "packed K|V [NB, BS, H, 2D]": packed(False),
    "packed K|V HND [NB, H, BS, 2D]": packed(True),
    "CPU_ATTN vec [NB, H, BS, 2D] container": cpu_attn,
}


def rope64(x, positions):
    """NeoX rotation of [T, H, D] at positions, float64."""
    half = D // 2
    inv = THETA ** (-torch.arange(0, half, dtype=torch.float64) * 2.0 / D)
    ang = torch.tensor(positions, dtype=torch.float64)[:, None] * inv[None, :]
    c, s = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    a, b = x[..., :half].double(), x[..., half:].double()
    return torch.cat([a * c - b * s, b * c + a * s], -1)


@pytest.fixture(scope="module")
def device(request):
    """(torch device, library backend) of --device."""
    dev = request.config.getoption("--device")
    if dev == "cuda":
        if not (torch.cuda.is_available() and kvi.features() & kvi.FEATURE_CUDA and kvi.cuda_device_count() > 0):
            pytest.skip("--device cuda needs torch with a GPU and a CUDA build of libkvinject (%s)"
                        % kvi.library_path())
        return dev, kvi.Backend.CUDA
    return dev, kvi.Backend.CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout(name, dtype, device):
    """A fact injected through the derived layout lands where the backend reads
    it, rotated at its positions; nothing else changes; a capture gives it back."""
    dev, backend_kind = device
    make = LAYOUTS[name]
    torch.manual_seed(0)
    tensors, backend, isa, kv = make(dtype, dev)
    for t in tensors:
        t.copy_(torch.full(t.shape, float("nan")) if dtype == torch.float32 else torch.full(t.shape, -7.0))
    before = [t.clone() for t in tensors]
    lay = derive_layout(tensors, backend, num_kv_heads=H, head_size=D, block_size=BS, isa=isa)
    lay_dtype = {torch.float32: kvi.DType.FP32, torch.bfloat16: kvi.DType.BF16}[dtype]
    assert (lay.dtype, lay.num_blocks, lay.block_size, lay.num_heads) == (lay_dtype, NB, BS, H), repr(lay)
    model = kvi.Model(L, H, D)
    model.set_rope(style=kvi.RopeStyle.NEOX, theta=THETA)
    store = kvi.Store(model, 8 << 20, backend=backend_kind, dtype=kvi.DType.FP32)
    T = 21  # spans two blocks, from inside the first
    k = torch.randn(L, T, H, D)
    v = torch.randn(L, T, H, D)
    store.put(1, 5, k, v)
    inj = kvi.Injector(store, lay)
    table = [4, 1, 3]
    first = 7
    positions = [100 + 3 * i for i in range(T)]
    stream = torch.cuda.current_stream() if dev != "cpu" else None
    inj.inject(kvi.InjectRequest(1, [5], table, first_slot=first, positions=positions), stream=stream)
    if dev != "cpu":
        torch.cuda.synchronize()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    worst = 0.0
    touched = [torch.zeros(t.shape, dtype=torch.bool, device=dev) for t in tensors]
    marks = [torch.zeros(t.shape, dtype=torch.float32, device=dev) for t in tensors]
    for layer in range(L):
        want_k = rope64(k[layer], positions)
        for i in range(T):
            s = first + i
            b, t = table[s // BS], s % BS
            gk, gv = kv(tensors[layer], b, t)
            worst = max(worst,
                        (gk.double().cpu() - want_k[i]).abs().max().item() / max(1.0, want_k[i].abs().max().item()),
                        (gv.double().cpu() - v[layer, i].double()).abs().max().item())
            mk, mv = kv(marks[layer], b, t)
            mk.fill_(1.0)
            mv.fill_(1.0)
        touched[layer] = marks[layer] > 0
    assert worst <= tol, "K rotated at its positions and V where the backend reads them: max error %.3g" % worst
    untouched = all(torch.equal(torch.nan_to_num(a[~m], nan=123.0), torch.nan_to_num(b_[~m], nan=123.0))
                    for a, b_, m in zip(tensors, before, touched))
    assert untouched, "something else in the cache changed"
    enc = kvi.Encoder(store, lay)
    enc.encode(kvi.Capture(1, 6, table, T, first_slot=first, positions=positions), stream=stream)
    if dev != "cpu":
        torch.cuda.synchronize()
    rk = torch.empty(L, T, H, D)
    rv = torch.empty(L, T, H, D)
    store.read(1, 6, rk, rv)
    err = max((rk - k).abs().max().item(), (rv - v).abs().max().item())
    assert err <= 4 * tol, "captured back through the layout: max error %.3g" % err
    enc.close()
    inj.close()
    store.close()
    model.close()


_t = [torch.empty(NB, H, BS, 2 * D, dtype=torch.bfloat16)]
REFUSALS = {
    "CPU_ATTN with the amx ISA": lambda: derive_layout(_t, "CPU_ATTN", num_kv_heads=H, head_size=D, isa="amx"),
    "CPU_ATTN without an ISA": lambda: derive_layout(_t, "CPU_ATTN", num_kv_heads=H, head_size=D),
    "an unknown backend": lambda: derive_layout(_t, "FLEX_ATTENTION", num_kv_heads=H, head_size=D),
    "an fp8 cache": lambda: derive_layout([torch.empty(2, NB, BS, H, D, dtype=torch.uint8)], "FLASH_ATTN",
                                          num_kv_heads=H, head_size=D),
    "a 3-D cache": lambda: derive_layout([torch.empty(NB, BS, H * D)], "FLASH_ATTN", num_kv_heads=H, head_size=D),
    "packed, heads = block size, no block size": lambda: derive_layout(
        [torch.empty(NB, H, H, 2 * D)], "FLASHINFER", num_kv_heads=H, head_size=D),
    "a block size other than vLLM's": lambda: derive_layout(
        [torch.empty(2, NB, BS, H, D)], "FLASH_ATTN", num_kv_heads=H, head_size=D, block_size=2 * BS),
    "layers of different shapes": lambda: derive_layout(
        [torch.empty(2, NB, BS, H, D), torch.empty(2, NB + 1, BS, H, D)], "FLASH_ATTN", num_kv_heads=H,
        head_size=D),
    "other head counts": lambda: derive_layout([torch.empty(2, NB, BS, H, D)], "FLASH_ATTN", num_kv_heads=H + 1,
                                               head_size=D),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_refused(name, device):
    with pytest.raises(LayoutError) as e:
        REFUSALS[name]()
    print("refused: %s: %s" % (name, str(e.value)[:140]))
