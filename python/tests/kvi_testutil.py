"""Shared helpers of the Python binding's tests. Nothing here calls the library:
conversions, the RoPE reference and the fake tensors are written from their
definitions, so the tests compare the library with an independent reference.

- fp16 / bf16 / fp32 rounding (round to nearest even) and decoding, from the
  IEEE formats (struct's 'e' and 'f' codes, bf16 from fp32 bits);
- RoPE inverse frequencies of every scaling, written from Hugging Face
  transformers' modeling_rope_utils (default, linear, llama3, YaRN, fixed
  NTK), and the NeoX / GPT-J rotation, in float64;
- FakeTensor: an object with torch's data_ptr()/shape/stride()/dtype/device
  over a ctypes buffer, so the tensor code paths run without torch;
- case(): names the case of a loop in its failures.

Random data: every test seeds its own random.Random; KVI_TEST_SEED overrides.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
import math
import os
import random
import struct
import sys

_here = os.path.dirname(os.path.abspath(__file__))
if "kvinject" not in sys.modules:
    try:
        import kvinject  # noqa: F401  (PYTHONPATH set by Meson)
    except ImportError:
        sys.path.insert(0, os.path.dirname(_here))  # python/ of the repository

import kvinject as kvi  # noqa: E402
from kvinject import DType  # noqa: E402


@contextlib.contextmanager
def case(*name, **params):
    """A block of a loop over cases: a failure inside names the case (its name
    and parameters), and the test stops there."""
    try:
        yield
    except AssertionError as e:
        what = ", ".join([str(n) for n in name] + ["%s=%s" % kv for kv in params.items()])
        raise AssertionError("[%s] %s" % (what, e)) from e


# how the suite runs pytest (Meson, and a module run as a script): quiet, skip
# reasons shown, no .pytest_cache written into the source tree
PYTEST_ARGS = ["-q", "-rs", "-p", "no:cacheprovider"]


def run_pytest(path: str, names=()) -> int:
    """Runs the test module at ``path`` with pytest (what a module's __main__ does):
    every test, or those named (``TestClass``, ``TestClass.test_name`` or
    ``TestClass::test_name``). Returns pytest's exit status (77 when every test
    skipped: conftest.py)."""
    import pytest
    ids = [path + "::" + n.replace(".", "::") for n in names] or [path]
    return pytest.main(PYTEST_ARGS + ids)


def rng(test_seed: int) -> random.Random:
    seed = int(os.environ.get("KVI_TEST_SEED", test_seed))
    return random.Random(seed)


# --------------------------------------------------------------- conversions
def f32(x: float) -> float:
    """x rounded to fp32 (nearest even)."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def f16_bits(x: float) -> int:
    """fp16 bits of x (x is first rounded to fp32, as the library converts through fp32)."""
    return struct.unpack("<H", struct.pack("<e", f32(x)))[0]


def f16_value(bits: int) -> float:
    return struct.unpack("<e", struct.pack("<H", bits))[0]


def bf16_bits(x: float) -> int:
    """bf16 bits of x: fp32 bits rounded to the upper 16 with ties to even (finite x)."""
    b = f32_bits(x)
    b += 0x7FFF + ((b >> 16) & 1)
    return (b >> 16) & 0xFFFF


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def round_to(x: float, dtype: DType) -> float:
    """x rounded to dtype (through fp32), as a float."""
    if dtype == DType.FP32:
        return f32(x)
    if dtype == DType.FP16:
        return f16_value(f16_bits(x))
    if dtype == DType.BF16:
        return bf16_value(bf16_bits(x))
    raise ValueError(dtype)


def unit_roundoff(dtype: DType) -> float:
    return {DType.FP32: 2.0 ** -24, DType.FP16: 2.0 ** -11, DType.BF16: 2.0 ** -8}[dtype]


def encode(values, dtype: DType):
    """A host buffer of values in dtype: array('f') for fp32, array('H') of bits otherwise."""
    if dtype == DType.FP32:
        return array.array("f", values)
    conv = f16_bits if dtype == DType.FP16 else bf16_bits
    return array.array("H", [conv(v) for v in values])


def decode(buf, dtype: DType):
    """The values of a buffer made by encode (or written by the library)."""
    if dtype == DType.FP32:
        return [float(v) for v in buf]
    conv = f16_value if dtype == DType.FP16 else bf16_value
    return [conv(b) for b in buf]


def empty(n: int, dtype: DType, fill_bits: int = 0):
    """n elements of dtype whose bit patterns are fill_bits (a poison value)."""
    if dtype == DType.FP32:
        a = array.array("I", [fill_bits] * n)
        return array.array("f", a.tobytes())
    return array.array("H", [fill_bits & 0xFFFF] * n)


def bits_of(buf) -> bytes:
    return bytes(memoryview(buf).cast("B"))


def rand_bf16_exact(r: random.Random, lo_exp: int = -3, hi_exp: int = 2) -> float:
    """A random value exactly representable in bf16 (so also in fp16 and fp32 within range)."""
    m = r.randrange(128)
    e = r.randint(lo_exp, hi_exp)
    v = math.ldexp(1.0 + m / 128.0, e)
    return -v if r.random() < 0.5 else v


def rand_values(r: random.Random, n: int, exact: bool = True):
    if exact:
        return [rand_bf16_exact(r) for _ in range(n)]
    return [f32(r.uniform(-4.0, 4.0)) for _ in range(n)]


# --------------------------------------------------------------------- RoPE
class RefRope:
    """One layer's RoPE in float64, from Hugging Face's formulas (modeling_rope_utils)."""

    def __init__(self, head_size: int, style=kvi.RopeStyle.NEOX, rotary_dim: int = 0, theta: float = 10000.0,
                 scaling=kvi.RopeScaling.NONE, factor: float = 1.0, original_max_position: int = 8192,
                 low_freq_factor: float = 1.0, high_freq_factor: float = 4.0, beta_fast: float = 32.0,
                 beta_slow: float = 1.0, attention_factor: float = 0.0, yarn_truncate: int = 1):
        self.style = style
        self.rot = rotary_dim or head_size
        dim = self.rot
        half = dim // 2
        self.attn = 1.0
        if style == kvi.RopeStyle.NONE:
            self.inv = []
            return
        base = theta
        if scaling == kvi.RopeScaling.NTK:
            base = theta * factor ** (dim / (dim - 2))
        inv = [1.0 / (base ** ((2 * i) / dim)) for i in range(half)]
        if scaling == kvi.RopeScaling.LINEAR:
            inv = [f / factor for f in inv]
        elif scaling == kvi.RopeScaling.LLAMA3:
            # HF _compute_llama3_parameters
            low_wavelen = original_max_position / low_freq_factor
            high_wavelen = original_max_position / high_freq_factor
            out = []
            for f in inv:
                wavelen = 2 * math.pi / f
                llama = f / factor if wavelen > low_wavelen else f
                if not (wavelen < high_wavelen) and not (wavelen > low_wavelen):
                    smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                    llama = (1 - smooth) * llama / factor + smooth * llama
                out.append(llama)
            inv = out
        elif scaling == kvi.RopeScaling.YARN:
            # HF _compute_yarn_parameters
            def corr_dim(rotations):
                return (dim * math.log(original_max_position / (rotations * 2 * math.pi))) / (2 * math.log(theta))

            low, high = corr_dim(beta_fast), corr_dim(beta_slow)
            if yarn_truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            out = []
            for i in range(half):
                pos_freq = theta ** ((2 * i) / dim)
                extrap, interp = 1.0 / pos_freq, 1.0 / (factor * pos_freq)
                ramp = min(max((i - low) / (high - low), 0.0), 1.0)
                ef = 1 - ramp
                out.append(interp * (1 - ef) + extrap * ef)
            inv = out
            self.attn = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0
        if attention_factor:
            self.attn = attention_factor
        self.inv = inv

    def cos_sin(self, pos: int, i: int):
        a = pos * self.inv[i]
        return self.attn * math.cos(a), self.attn * math.sin(a)

    def cs_tol(self, pos: int, i: int) -> float:
        """Bound on the library's fp32 cos/sin error: its angle is fp32(fp32(pos) *
        fp32(inv)), off by at most pos*inv*2^-23 (with slack: 2^-22); then fp32
        rounding of cos, sin and the attention factor."""
        return abs(self.attn) * (pos * abs(self.inv[i]) * 2.0 ** -22 + 1e-6)

    def pairs(self):
        half = self.rot // 2
        for i in range(half):
            if self.style == kvi.RopeStyle.NEOX:
                yield i, i, i + half
            else:
                yield i, 2 * i, 2 * i + 1

    def rotate(self, x, pos: int):
        """x (a list of head_size floats) rotated at pos, float64."""
        y = [float(v) for v in x]
        if self.style == kvi.RopeStyle.NONE:
            return y
        for i, a, b in self.pairs():
            c, s = self.cos_sin(pos, i)
            y[a] = x[a] * c - x[b] * s
            y[b] = x[b] * c + x[a] * s
        return y

    def unrotate(self, y, pos: int):
        """The inverse of rotate (R^T / (c^2 + s^2))."""
        x = [float(v) for v in y]
        if self.style == kvi.RopeStyle.NONE:
            return x
        for i, a, b in self.pairs():
            c, s = self.cos_sin(pos, i)
            n = c * c + s * s
            x[a] = (y[a] * c + y[b] * s) / n
            x[b] = (y[b] * c - y[a] * s) / n
        return x

    def tol(self, x, pos: int):
        """Per-element bound on |library rotation - rotate(x, pos)| before rounding to the
        destination: the input pair's magnitude times the cos/sin bound, plus fp32
        products and sum (4e-6 relative covers them)."""
        t = [0.0] * len(x)
        if self.style == kvi.RopeStyle.NONE:
            return t
        for i, a, b in self.pairs():
            rin = abs(x[a]) + abs(x[b])
            e = abs(self.attn) * rin * (pos * abs(self.inv[i]) * 2.0 ** -22 + 4e-6)
            t[a] = t[b] = e
        return t


# ------------------------------------------------------------- fake tensors
class FakeDType:
    def __init__(self, name: str):
        self.name = name

    def __str__(self):
        return self.name

    __repr__ = __str__


class FakeDevice:
    def __init__(self, type_: str = "cpu", index=None):
        self.type = type_
        self.index = index

    def __str__(self):
        return self.type if self.index is None else "%s:%d" % (self.type, self.index)


class FakeTensor:
    """torch's tensor attributes over a host buffer (data_ptr, shape, stride, dtype,
    device). ``device="cuda"`` makes it claim device memory, to check what the
    binding tells the library."""

    _ITEM = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2, "torch.int32": 4, "torch.int64": 8,
             "torch.uint8": 1, "torch.float8_e4m3fn": 1, "torch.float64": 8, "torch.uint16": 2, "torch.int16": 2}

    def __init__(self, storage, shape, strides=None, dtype="torch.float32", device="cpu", index=None,
                 offset: int = 0):
        self.storage = storage
        self.shape = tuple(shape)
        if strides is None:
            strides, acc = [], 1
            for n in reversed(self.shape):
                strides.append(acc)
                acc *= n
            strides = tuple(reversed(strides))
        self._strides = tuple(strides)
        self.dtype = FakeDType(dtype)
        self.device = FakeDevice(device, index if index is not None else (0 if device == "cuda" else None))
        self.offset = offset
        if isinstance(storage, int):
            self._base = storage
        else:
            mv = memoryview(storage).cast("B")
            self._keep = (ctypes.c_char * len(mv)).from_buffer(mv)
            self._base = ctypes.addressof(self._keep)

    def data_ptr(self) -> int:
        return self._base + self.offset * self._ITEM[str(self.dtype)]

    def stride(self):
        return self._strides

    def dim(self):
        return len(self.shape)


class FakeStream:
    def __init__(self, handle: int):
        self.cuda_stream = handle


def fp8_e4m3_value(code: int) -> float:
    """OCP e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
    S.1111.111 is NaN; largest finite 448."""
    s = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return s * m / 8.0 * 2.0 ** -6
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


# ------------------------------------------------------------ cache models
class CacheModel:
    """An engine cache as flat per-layer buffers indexed with the engine's own shape:
    `index(layer, kv, block, token, head, dim)` gives (buffer, element index).
    Subclasses describe one layout each; the library is never asked."""

    def __init__(self, dtype: DType, poison_bits: int):
        self.dtype = dtype
        self.poison = poison_bits

    def value(self, buf, i) -> float:
        if self.dtype == DType.FP32:
            return float(buf[i])
        if self.dtype == DType.FP16:
            return f16_value(buf[i])
        if self.dtype == DType.BF16:
            return bf16_value(buf[i])
        if self.dtype == DType.FP8_E4M3:
            return fp8_e4m3_value(buf[i])
        raise ValueError(self.dtype)

    def raw(self, buf, i) -> int:
        if self.dtype == DType.FP32:
            return f32_bits(buf[i])
        return buf[i]
