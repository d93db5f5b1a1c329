"""The array and stream adapter (kvinject._buffers): what each kind of object
resolves to (pointer, shape, element strides, element type, memory), checked
against ctypes' own addresses and the objects' own shapes."""
from __future__ import annotations

import array
import ctypes
import sys

import pytest

from kvi_testutil import FakeStream, FakeTensor, case
import kvinject as kvi
from kvinject import DType, Memory
from kvinject import _buffers as B


class TestArrays:
    def test_ctypes_array(self):
        a = (ctypes.c_float * 12)()
        r = B.as_array(a, "x")
        assert (r.ptr, r.shape, r.strides, r.kind, r.memory, r.nbytes) == \
               (ctypes.addressof(a), (12,), (1,), "f32", Memory.HOST, 48)
        nested = ((ctypes.c_uint16 * 4) * 3)()
        r = B.as_array(nested, "x", dtype=DType.BF16)
        assert (r.ptr, r.kind, r.numel) == (ctypes.addressof(nested), "bf16", 12)

    def test_buffer_protocol(self):
        ba = bytearray(64)
        r = B.as_array(memoryview(ba).cast("f", (2, 8)), "x")
        assert (r.shape, r.strides, r.kind) == ((2, 8), (8, 1), "f32")
        assert r.ptr == ctypes.addressof((ctypes.c_char * 64).from_buffer(ba))
        r = B.as_array(array.array("f", [1.0, 2.0]), "x")
        assert ctypes.c_float.from_address(r.ptr + 4).value == 2.0
        r = B.as_array(array.array("H", [1, 2]), "x", dtype=DType.FP16)
        assert r.kind == "f16"
        r = B.as_array(ba, "x", dtype=DType.BF16)  # bytes read as 32 bf16
        assert (r.kind, r.numel, r.shape) == ("bf16", 32, (32,))
        with pytest.raises(TypeError):
            B.as_array(array.array("f", [1.0]), "x", dtype=DType.BF16)  # fp32 is not bf16
        with pytest.raises(TypeError):
            B.as_array(array.array("d", [1.0]), "x", dtype=DType.FP32)
        with pytest.raises(ValueError):
            B.as_array(memoryview(ba).cast("f", (4, 4))[::2], "x")  # not contiguous

    def test_numpy_arrays(self):
        try:
            import numpy as np
        except ImportError:
            pytest.skip("numpy is not installed")
        a = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
        r = B.as_array(a, "x")
        assert (r.kind, r.shape, r.strides, r.ptr) == ("f16", (2, 3, 4), (12, 4, 1), a.ctypes.data)
        assert B.as_array(np.zeros(3, dtype=np.int32), "x").kind == "i32"
        with pytest.raises(ValueError):
            B.as_array(a[:, ::2], "x")

    def test_read_only_buffers_are_inputs_only(self):
        data = array.array("f", [1.5, 2.5]).tobytes()
        r = B.as_array(data, "x", dtype=DType.FP32)
        assert ctypes.c_float.from_address(r.ptr).value == 1.5  # a private copy
        with pytest.raises(TypeError):
            B.as_array(data, "x", writable=True)

    def test_tensor_attributes(self):
        buf = array.array("f", [0.0] * 60)
        t = FakeTensor(buf, (3, 4, 5), (20, 1, 4), offset=2)
        r = B.as_array(t, "x")
        assert (r.shape, r.strides, r.kind, r.memory, r.device, r.is_tensor) == \
               ((3, 4, 5), (20, 1, 4), "f32", Memory.HOST, -1, True)
        assert r.ptr == t.data_ptr()
        assert r.nbytes == (1 + 2 * 20 + 3 * 1 + 4 * 4) * 4
        names = {"torch.float32": "f32", "torch.float16": "f16", "torch.bfloat16": "bf16",
                 "torch.float8_e4m3fn": "f8e4m3", "torch.int32": "i32", "torch.int64": "i64", "torch.uint8": "u8"}
        for name, kind in names.items():
            assert B.as_array(FakeTensor(buf, (2,), dtype=name), "x").kind == kind
        c = B.as_array(FakeTensor(buf, (2,), device="cuda", index=3), "x")
        assert (c.memory, c.device) == (Memory.DEVICE, 3)
        with pytest.raises(ValueError):
            B.as_array(FakeTensor(buf, (2,), device="mps"), "x")
        with pytest.raises(TypeError):
            B.as_array(FakeTensor(buf, (2,), dtype="torch.complex64"), "x")
        u8 = B.as_array(FakeTensor(buf, (2,), dtype="torch.uint8"), "x", dtype=DType.FP8_E5M2)
        assert u8.kind == "f8e5m2"
        with pytest.raises(TypeError):  # a uint8 tensor is not a bf16 tensor
            B.as_array(FakeTensor(buf, (4,), dtype="torch.uint8"), "x", dtype=DType.BF16)

    def test_int_arrays(self):
        r = B.int_array([1, 2, 3], ctypes.c_int32, "x")
        assert list((ctypes.c_int32 * 3).from_address(r.ptr)) == [1, 2, 3]
        with pytest.raises(OverflowError):
            B.int_array([1 << 31], ctypes.c_int32, "x")
        with pytest.raises(OverflowError):
            B.int_array([-1], ctypes.c_uint64, "x")
        with pytest.raises(TypeError):
            B.int_array([1.5], ctypes.c_int32, "x")
        with pytest.raises(TypeError):
            B.int_array(array.array("q", [1]), ctypes.c_int32, "x")  # int64 for an int32 table
        with pytest.raises(ValueError):
            B.int_array(FakeTensor(array.array("i", [0]), (1,), dtype="torch.int32", device="cuda"),
                        ctypes.c_int32, "x")
        d = B.int_array(FakeTensor(array.array("i", [0]), (1,), dtype="torch.int32", device="cuda"), ctypes.c_int32,
                        "x", allow_device=True)
        assert d.memory == Memory.DEVICE
        with pytest.raises(ValueError):  # a strided int tensor
            B.int_array(FakeTensor(array.array("i", [0] * 4), (2,), (2,), dtype="torch.int32"), ctypes.c_int32, "x")
        r = B.int_array(array.array("q", [5, 6]), ctypes.c_uint64, "x")  # int64 ids pass as uint64
        assert r.numel == 2

    def test_int_arrays_of_long_lists(self):
        # the packed path (lists of plain ints) and the element-wise one agree, and
        # the element-wise one still names what is wrong
        big = list(range(-5000, 5000))
        r = B.int_array(big, ctypes.c_int32, "x")
        assert r.numel == len(big) and list((ctypes.c_int32 * len(big)).from_address(r.ptr)) == big
        u = [(1 << 64) - 1, 0, 1 << 40]
        r = B.int_array(u, ctypes.c_uint64, "x")
        assert list((ctypes.c_uint64 * 3).from_address(r.ptr)) == u
        r = B.int_array([-(1 << 63), (1 << 63) - 1], ctypes.c_int64, "x")
        assert list((ctypes.c_int64 * 2).from_address(r.ptr)) == [-(1 << 63), (1 << 63) - 1]
        with pytest.raises(OverflowError, match=r"x\[2\]"):
            B.int_array([0, 1, 1 << 31], ctypes.c_int32, "x")
        with pytest.raises(TypeError, match=r"x\[2\]"):
            B.int_array([0, 1, "2"], ctypes.c_int32, "x")
        for n in (3, 64, 1232):  # below and from the length that packs through struct
            for bad, err in ((1 << 31, OverflowError), ("2", TypeError), (1.5, TypeError)):
                seq = list(range(n))
                seq[n - 2] = bad
                with pytest.raises(err, match=r"x\[%d\]" % (n - 2)):
                    B.int_array(seq, ctypes.c_int32, "x")
            seq = list(range(n))
            seq[1] = -1
            with pytest.raises(OverflowError, match=r"x\[1\]"):
                B.int_array(seq, ctypes.c_uint64, "x")
            seq[1] = _Index(7)  # what has __index__ packs as its value
            r = B.int_array(seq, ctypes.c_uint64, "x")
            assert list((ctypes.c_uint64 * n).from_address(r.ptr))[:3] == [0, 7, 2]
        r = B.int_array([], ctypes.c_int32, "x")
        assert r.numel == 0

    def test_streams(self):
        assert B.stream_handle(None) is None
        assert B.stream_handle(0) is None
        assert B.stream_handle(0x1234) == 0x1234
        assert B.stream_handle(FakeStream(0xABC)) == 0xABC
        assert B.stream_handle(ctypes.c_void_p(77)) == 77
        for bad in (True, "stream", 1.5):
            with pytest.raises(TypeError):
                B.stream_handle(bad)

    def test_struct_fields_refuse_wrapping(self):
        with pytest.raises(OverflowError):
            kvi.Store(kvi.Model(1, 1, 8), 1 << 20, page_tokens=(1 << 32) + 16)
        with pytest.raises(OverflowError):
            kvi.Model(1 << 32, 1, 8)
        with pytest.raises(OverflowError):
            kvi.Model(1, 1, 8).rope_cos_sin(0, 1 << 31, 0)
        with pytest.raises(TypeError):
            kvi.Model(1.0, 1, 8)


class _Index:
    def __init__(self, v):
        self.v = v

    def __index__(self):
        return self.v


class TestTypes:
    """The package is typed: py.typed ships with it, every public signature's
    annotations resolve (no dangling names), and the array and stream types
    describe what the binding accepts."""

    def test_py_typed(self):
        import os
        assert os.path.isfile(os.path.join(os.path.dirname(kvi.__file__), "py.typed"))

    def test_annotations_resolve(self):
        import inspect
        import typing
        import kvinject.hf
        checked = 0
        for mod in (kvi, kvinject.hf):
            for name in dir(mod):
                obj = getattr(mod, name)
                if not inspect.isclass(obj) and not inspect.isfunction(obj):
                    continue
                if getattr(obj, "__module__", "").split(".")[0] != "kvinject":
                    continue
                members = [obj] if inspect.isfunction(obj) else \
                    [m for n, m in vars(obj).items() if inspect.isfunction(m) or isinstance(m, classmethod)]
                for m in members:
                    f = m.__func__ if isinstance(m, classmethod) else m
                    with case(function=f.__qualname__):
                        typing.get_type_hints(f, globalns=vars(inspect.getmodule(f)))
                        checked += 1
        assert checked > 50
        hints = typing.get_type_hints(kvi.Store.put, globalns=vars(inspect.getmodule(kvi.Store.put)))
        assert hints["stream"] == kvi.StreamLike
        assert typing.get_type_hints(kvi.InjectRequest)["block_table"] == kvi.IntArrayLike

    def test_protocols_match_what_is_accepted(self):
        t = FakeTensor((ctypes.c_float * 6)(), (2, 3))
        assert isinstance(t, kvi.TensorLike)
        assert not isinstance(array.array("f", [1.0]), kvi.TensorLike)
        assert isinstance(FakeStream(5), kvi.CudaStreamLike)


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
