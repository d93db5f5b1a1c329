"""Turning tensors, buffers and Python sequences into what the C API takes:
a data pointer, a shape and element strides, an element type, and where the
memory is (host or a CUDA device).

Accepted array objects:
- torch tensors, or anything with the same attributes: ``data_ptr()``,
  ``shape``, ``stride()``, ``dtype`` and ``device`` (``.type`` "cpu" or
  "cuda", ``.index``). torch is never imported: the tensor is read through
  these attributes, its dtype by name ("torch.bfloat16", ...).
- host buffers: ctypes arrays, bytearray, array.array, memoryview, bytes
  (read-only: inputs only) and anything with the buffer protocol (numpy
  arrays included). They must be C-contiguous; the element type comes from
  the buffer's format ("f" fp32, "e" fp16, integers by width), or from an
  explicit ``dtype`` for raw 16-bit or byte buffers (bf16 has no buffer
  format).
- objects with ``__cuda_array_interface__`` (CuPy, Numba): only as the
  integer index arrays of the batched calls (:func:`index_array`).
Streams: None (the default stream), an int handle (cudaStream_t), or an
object with ``cuda_stream`` (torch.cuda.Stream) or ``ptr`` (cupy).
"""
from __future__ import annotations

import array as _array
import struct as _struct
import ctypes
import operator
from typing import Optional, Sequence, Tuple

from .enums import DType, Memory

# array.array type codes of the C integer types int_array fills, where the sizes agree
_TYPECODE = {c: t for c, t in ((ctypes.c_int32, "i"), (ctypes.c_int64, "q"), (ctypes.c_uint64, "Q"))
             if _array.array(t).itemsize == ctypes.sizeof(c)}

# element kinds: names for every type the API reads or writes
_ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "f8e4m3": 1, "f8e5m2": 1, "f64": 8,
             "i8": 1, "u8": 1, "i16": 2, "u16": 2, "i32": 4, "u32": 4, "i64": 8, "u64": 8}

_KVI_TO_KIND = {DType.FP32: "f32", DType.FP16: "f16", DType.BF16: "bf16",
                DType.FP8_E4M3: "f8e4m3", DType.FP8_E5M2: "f8e5m2"}
_KIND_TO_KVI = {v: k for k, v in _KVI_TO_KIND.items()}

_TORCH_DTYPES = {
    "torch.float32": "f32", "torch.float": "f32", "torch.float16": "f16", "torch.half": "f16",
    "torch.bfloat16": "bf16", "torch.float8_e4m3fn": "f8e4m3", "torch.float8_e5m2": "f8e5m2",
    "torch.float64": "f64", "torch.double": "f64",
    "torch.int8": "i8", "torch.uint8": "u8", "torch.int16": "i16", "torch.uint16": "u16",
    "torch.int32": "i32", "torch.int": "i32", "torch.uint32": "u32",
    "torch.int64": "i64", "torch.long": "i64", "torch.uint64": "u64",
}

_CTYPES_KINDS = {
    ctypes.c_float: "f32", ctypes.c_double: "f64",
    ctypes.c_int8: "i8", ctypes.c_uint8: "u8", ctypes.c_int16: "i16", ctypes.c_uint16: "u16",
    ctypes.c_int32: "i32", ctypes.c_uint32: "u32", ctypes.c_int64: "i64", ctypes.c_uint64: "u64",
    ctypes.c_char: "u8", ctypes.c_byte: "i8", ctypes.c_ubyte: "u8",
}

# kinds a raw container may be read as (same width, no numeric meaning of its own)
_RAW = {"u8", "i8", "u16", "i16"}


def dtype_kind(dtype) -> str:
    """The element kind of a DType (or an int value of one)."""
    try:
        return _KVI_TO_KIND[DType(dtype)]
    except (ValueError, KeyError):
        raise ValueError("%r is not a kvinject.DType" % (dtype,)) from None


def kind_dtype(kind: str, what: str) -> DType:
    try:
        return _KIND_TO_KVI[kind]
    except KeyError:
        raise TypeError("%s has elements of type %s; expected fp32, fp16, bf16 (or fp8 for caches)"
                        % (what, kind)) from None


class Array:
    """A resolved array argument.

    ptr: address; shape, strides: tuples (strides in elements; None where the
    object has none); kind: element kind (see _ITEMSIZE) or None for raw
    bytes; memory: Memory.HOST or DEVICE; device: CUDA ordinal or -1; nbytes:
    bytes from ptr to the end of the object's memory; keep: what must stay
    alive while the pointer is used.
    """

    __slots__ = ("ptr", "shape", "strides", "kind", "memory", "device", "nbytes", "keep", "is_tensor")

    def __init__(self, ptr, shape, strides, kind, memory, device, nbytes, keep, is_tensor):
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.kind = kind
        self.memory = memory
        self.device = device
        self.nbytes = nbytes
        self.keep = keep
        self.is_tensor = is_tensor

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.kind] if self.kind else 1

    @property
    def numel(self) -> int:
        return self.nbytes // self.itemsize

    def c_ptr(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(self.ptr)


_TENSOR_ATTRS = ("data_ptr", "stride", "shape", "dtype", "device")
_TENSOR_TYPES: set = set()  # types that define every one of them (torch.Tensor): no per-object look-ups


def is_tensor(obj) -> bool:
    """Whether obj looks like a torch tensor (the attributes this module reads)."""
    t = type(obj)
    if t in _TENSOR_TYPES:
        return True
    if not all(hasattr(obj, a) for a in _TENSOR_ATTRS):
        return False
    if all(hasattr(t, a) for a in _TENSOR_ATTRS):
        _TENSOR_TYPES.add(t)
    return True


# torch dtypes and layouts by object (torch's are singletons), filled on first
# sight: the per-call path formats no names
_KIND_OF_DTYPE: dict = {}
_STRIDED_LAYOUT: dict = {}
_NO_TYPE = object()


def _by_object(cache: dict, obj, compute):
    """compute(obj), remembered in cache where obj is hashable."""
    try:
        return cache[obj]
    except KeyError:
        value = compute(obj)
        if len(cache) > 256:  # objects that are not singletons (fakes in tests)
            cache.clear()
        cache[obj] = value
        return value
    except TypeError:  # unhashable
        return compute(obj)


def _dtype_kind(dtype) -> Optional[str]:
    return _TORCH_DTYPES.get(str(dtype))


def _strided(layout) -> bool:
    return str(layout) == "torch.strided"


def _tensor(obj, what: str) -> Array:
    dt = obj.dtype
    try:
        kind = _KIND_OF_DTYPE[dt]
    except (KeyError, TypeError):
        kind = _by_object(_KIND_OF_DTYPE, dt, _dtype_kind)
    if kind is None:
        raise TypeError("%s: tensor dtype %s is not supported" % (what, dt))
    if getattr(obj, "is_cpu", False) is True:  # torch: cheaper than its device object
        memory, device = Memory.HOST, -1
    else:
        dev = obj.device
        dtype_name = getattr(dev, "type", _NO_TYPE)
        if dtype_name is _NO_TYPE:
            dtype_name = str(dev)
        if dtype_name == "cuda":
            memory, device = Memory.DEVICE, (dev.index if dev.index is not None else -1)
        elif dtype_name == "cpu":
            memory, device = Memory.HOST, -1
        else:
            raise ValueError("%s: a tensor on device %s; libkvinject takes CPU or CUDA tensors" % (what, dev))
    layout = getattr(obj, "layout", "torch.strided")
    try:
        strided = _STRIDED_LAYOUT[layout]
    except (KeyError, TypeError):
        strided = _by_object(_STRIDED_LAYOUT, layout, _strided)
    if getattr(obj, "is_sparse", False) or not strided:
        raise ValueError("%s: a non-strided (sparse) tensor" % what)
    if type(obj) in _TENSOR_TYPES:  # torch.Tensor: its sizes and strides are ints
        shape, strides = tuple(obj.shape), tuple(obj.stride())
    else:
        shape, strides = tuple(map(int, obj.shape)), tuple(map(int, obj.stride()))
    if strides and min(strides) < 0:
        raise ValueError("%s: negative strides %s" % (what, strides))
    return Array(int(obj.data_ptr()), shape, strides, kind, memory, device, _extent(shape, strides) * _ITEMSIZE[kind],
                 obj, True)


def _extent(shape, strides) -> int:
    """Elements from the first to the last element, both included: 1 + sum((n - 1) * s)."""
    if len(shape) == 1:
        return 1 + (shape[0] - 1) * strides[0] if shape[0] else 0
    if 0 in shape:
        return 0
    return 1 + sum(map(operator.mul, shape, strides)) - sum(strides)


# __cuda_array_interface__ type strings of the integer index arrays
_CAI_KINDS = {"<i4": "i32", "<i8": "i64", "<u8": "u64", "|i4": "i32", "|i8": "i64", "|u8": "u64"}


def _cuda_array(obj, what: str) -> Array:
    """An object with __cuda_array_interface__ (integer elements; its strides, in
    bytes there, as elements). Device memory; the device is not known (-1)."""
    cai = obj.__cuda_array_interface__
    kind = _CAI_KINDS.get(cai["typestr"])
    itemsize = 4 if kind == "i32" else 8
    shape = tuple(cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        st, acc = [], 1
        for n in reversed(shape):
            st.append(acc)
            acc *= n
        strides = tuple(reversed(st))
    else:
        if any(s % itemsize for s in strides):
            raise ValueError("%s: strides %s (bytes) are not whole elements of %d bytes" % (what, tuple(strides),
                                                                                          itemsize))
        strides = tuple(s // itemsize for s in strides)
    if strides and min(strides) < 0:
        raise ValueError("%s: negative strides %s" % (what, strides))
    return Array(int(cai["data"][0]), shape, strides, kind, Memory.DEVICE, -1, _extent(shape, strides) * itemsize,
                 obj, False)


def _format_kind(fmt: str, itemsize: int) -> Optional[str]:
    f = fmt.lstrip("@=<")
    if fmt.startswith(">") or fmt.startswith("!"):
        return None
    if f == "f":
        return "f32"
    if f == "e":
        return "f16"
    if f == "d":
        return "f64"
    if f in ("B", "c"):
        return "u8"
    if len(f) == 1 and f in "bhilqBHILQ":
        signed = f.islower()
        bits = {1: "8", 2: "16", 4: "32", 8: "64"}.get(itemsize)
        if bits:
            return ("i" if signed else "u") + bits
    return None


def _buffer(obj, what: str, writable: bool) -> Array:
    if isinstance(obj, ctypes.Array) or isinstance(obj, ctypes._SimpleCData):
        t = obj._type_ if isinstance(obj, ctypes.Array) else type(obj)
        while isinstance(t, type) and issubclass(t, ctypes.Array):  # nested ctypes arrays
            t = t._type_
        kind = _CTYPES_KINDS.get(t)
        if kind is None:
            raise TypeError("%s: ctypes element type %s is not supported" % (what, getattr(t, "__name__", t)))
        n = ctypes.sizeof(obj)
        return Array(ctypes.addressof(obj), (n // _ITEMSIZE[kind],), (1,), kind, Memory.HOST, -1, n, obj, False)
    try:
        mv = memoryview(obj)
    except TypeError:
        raise TypeError("%s: expected a tensor or a host buffer (ctypes array, bytearray, array.array, "
                        "memoryview), got %s" % (what, type(obj).__name__)) from None
    if not mv.c_contiguous:
        raise ValueError("%s: the buffer is not C-contiguous" % what)
    kind = _format_kind(mv.format, mv.itemsize)
    if kind is None:
        raise TypeError("%s: buffer format %r is not supported" % (what, mv.format))
    shape = tuple(mv.shape) if mv.ndim > 0 else (1,)
    strides = []
    acc = 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    strides = tuple(reversed(strides))
    nbytes = mv.nbytes
    raw = mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv
    if mv.readonly:
        if writable:
            raise TypeError("%s: the buffer is read-only" % what)
        keep = (ctypes.c_char * max(nbytes, 1)).from_buffer_copy(bytes(raw) or b"\0")
    else:
        if nbytes == 0:
            keep = (ctypes.c_char * 1)()
        else:
            keep = (ctypes.c_char * nbytes).from_buffer(raw)
    return Array(ctypes.addressof(keep), shape, strides, kind, Memory.HOST, -1, nbytes, (keep, obj), False)


def as_array(obj, what: str, *, writable: bool = False, dtype=None) -> Array:
    """Resolves a tensor or buffer. With ``dtype`` (a DType), its elements are read
    as that type: the object's own type must be the same, or a raw container of
    the same width (uint8/uint16 buffers, bytes)."""
    a = _tensor(obj, what) if is_tensor(obj) else _buffer(obj, what, writable)
    if dtype is not None:
        want = dtype_kind(dtype)
        if a.kind != want:
            if a.kind in _RAW and a.nbytes % _ITEMSIZE[want] == 0 and \
                    (a.itemsize == _ITEMSIZE[want] or not a.is_tensor):
                if a.itemsize != _ITEMSIZE[want]:  # a byte buffer read as wider elements
                    n = a.nbytes // _ITEMSIZE[want]
                    a.shape, a.strides = (n,), (1,)
                a.kind = want
            else:
                raise TypeError("%s has elements of type %s, not %s" % (what, a.kind, DType(dtype).name))
    return a


def check_host(a: Array, what: str) -> None:
    if a.memory != Memory.HOST:
        raise ValueError("%s must be in host memory (the C API reads it on the host); got a CUDA tensor" % what)


def int_array(values, ctype, what: str, *, allow_device: bool = False, writable: bool = False):
    """A sequence of Python ints, or a buffer/tensor of the matching integer width, as
    an Array of `ctype` elements (int32, int64, uint64). Int64 and uint64 are
    interchangeable (a tensor of fact ids is int64 in torch)."""
    if isinstance(values, Array):  # already resolved
        return values
    want = {ctypes.c_int32: ("i32",), ctypes.c_uint64: ("u64", "i64"),
            ctypes.c_int64: ("i64", "u64")}[ctype]
    if is_tensor(values) or _has_buffer(values):
        a = as_array(values, what, writable=writable)
        if a.kind not in want:
            raise TypeError("%s: elements of type %s; expected %s" % (what, a.kind, want[0]))
        if not allow_device:
            check_host(a, what)
        if not _contiguous(a):
            raise ValueError("%s must be contiguous" % what)
        return a
    try:
        seq = values if type(values) is list else list(values)  # noqa: E721 (a subclass may iterate otherwise)
    except TypeError:
        raise TypeError("%s: expected a sequence of ints, a buffer or a tensor, got %s"
                        % (what, type(values).__name__)) from None
    kind = {ctypes.c_int32: "i32", ctypes.c_uint64: "u64", ctypes.c_int64: "i64"}[ctype]
    if seq and ctype in _TYPECODE:
        # the common case, in C: array.array and struct take what has __index__, as
        # the loop below does, and raise for anything else (then the loop names the
        # element). A long list packs in half the time through struct (a prompt's
        # 1,232 expected token ids: 14 against 31 us), a short one faster directly.
        code = _TYPECODE[ctype]
        try:
            packed = (_array.array(code, _struct.pack("%d%s" % (len(seq), code), *seq)) if len(seq) >= 64
                      else _array.array(code, seq))
        except (OverflowError, TypeError, _struct.error):
            packed = None
        if packed is not None:
            return Array(packed.buffer_info()[0], (len(seq),), (1,), kind, Memory.HOST, -1,
                         len(seq) * ctypes.sizeof(ctype), packed, False)
    arr = (ctype * max(len(seq), 1))()
    for i, v in enumerate(seq):
        if isinstance(v, bool) or not isinstance(v, int):
            try:
                v = int(v.__index__())
            except AttributeError:
                raise TypeError("%s[%d] is %r, not an int" % (what, i, v)) from None
        arr[i] = v
        if arr[i] != v:
            raise OverflowError("%s[%d] = %d does not fit in %s" % (what, i, v, ctype.__name__))
    return Array(ctypes.addressof(arr), (len(seq),), (1,), kind, Memory.HOST, -1,
                 len(seq) * ctypes.sizeof(ctype), arr, False)


def float_array(values, what: str, *, dtype=None, allow_device: bool = True) -> Tuple[Array, DType]:
    """Floats: a sequence of Python numbers (sent as fp32), or a buffer/tensor of
    fp32/fp16/bf16 (bf16 from a uint16 buffer needs dtype=DType.BF16). Returns the
    Array and its DType."""
    if is_tensor(values) or _has_buffer(values):
        a = as_array(values, what, dtype=dtype)
        if not allow_device:
            check_host(a, what)
        if a.is_tensor and not _contiguous(a):
            raise ValueError("%s must be contiguous" % what)
        return a, kind_dtype(a.kind, what)
    if dtype is not None and DType(dtype) != DType.FP32:
        raise TypeError("%s: a Python sequence is sent as fp32; pass a buffer for %s" % (what, DType(dtype).name))
    try:
        seq = [float(x) for x in values]
    except TypeError:
        raise TypeError("%s: expected a sequence of floats, a buffer or a tensor, got %s"
                        % (what, type(values).__name__)) from None
    arr = (ctypes.c_float * max(len(seq), 1))(*seq)
    return Array(ctypes.addressof(arr), (len(seq),), (1,), "f32", Memory.HOST, -1, 4 * len(seq), arr,
                 False), DType.FP32


class IndexArray:
    """An integer array argument of a batched call: address, element kind, count,
    memory, and for 2-D arrays rows, columns and the row stride (elements); keep:
    the resolved array."""

    __slots__ = ("ptr", "kind", "numel", "memory", "rows", "cols", "row_stride", "keep")


_INT_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u64": ctypes.c_uint64}


def index_array(obj, kinds, what: str, *, two_d: bool = False, writable: bool = False) -> IndexArray:
    """A batched call's integer array: a tensor, an object with __cuda_array_interface__,
    a host buffer (numpy, array.array, ctypes) or a sequence of ints (sent as the
    first of ``kinds``). Its elements must be contiguous (with ``two_d``, a 2-D
    array's rows; rows any stride apart) and of one of ``kinds``."""
    if is_tensor(obj):
        a = _tensor(obj, what)
    elif hasattr(obj, "__cuda_array_interface__"):
        a = _cuda_array(obj, what)
    elif _has_buffer(obj):
        a = as_array(obj, what, writable=writable)
    else:
        a = int_array(obj, _INT_CTYPES[kinds[0]], what)
    f = IndexArray()
    f.rows = f.cols = f.row_stride = 0
    shape, strides = a.shape, a.strides
    if two_d and len(shape) == 2:
        if strides[1] != 1 and shape[1] > 1:
            raise ValueError("%s: the rows of a 2-D table must be contiguous" % what)
        f.rows, f.cols, f.row_stride = shape[0], shape[1], strides[0]
        f.numel = f.rows * f.cols
    elif (len(shape) == 1 and (strides[0] == 1 or shape[0] == 1)) or _contiguous(a):
        f.numel = a.nbytes // _ITEMSIZE.get(a.kind, 1)  # contiguous: the extent holds every element
    else:
        raise ValueError("%s must be contiguous" % what)
    if a.kind not in kinds:
        raise TypeError("%s: elements of type %s; expected %s" % (what, a.kind, " or ".join(kinds)))
    f.ptr, f.kind, f.memory, f.keep = a.ptr, a.kind, a.memory, a
    return f


def csr_bounds(f: IndexArray, what: str, length: int, of: str) -> Optional[tuple]:
    """CSR offsets (int32, num_requests + 1 entries, ``f``) that index an array of
    ``length`` entries (``of``), checked where the binding can read them without a
    host synchronization, that is in host memory: the first entry >= 0 and the last
    <= length (ValueError naming the argument). The library checks, before it reads
    through any of them, that the first is >= 0 and that none decreases, so every
    entry then lies in 0..length. Returns what :func:`check_csr` reads again (the
    entries' addresses: a persistent tensor's contents change between calls), or
    None for offsets in device memory, which the library copies to the host and
    checks as above; their last entry against the indexed array's length is the
    caller's to keep (no length reaches the C call)."""
    if f.memory != Memory.HOST or f.numel < 1:
        return None
    b = (f.ptr, f.ptr + 4 * (f.numel - 1), f.numel - 1, length, what, of)
    check_csr(b)
    return b


def csr_span(b: tuple) -> int:
    """The entries CSR offsets checked by :func:`csr_bounds` span: last - first."""
    return ctypes.c_int32.from_address(b[1]).value - ctypes.c_int32.from_address(b[0]).value


def check_csr(b: tuple) -> None:
    """The check of :func:`csr_bounds` on the offsets' current contents."""
    first_at, last_at, last, length, what, of = b
    v = ctypes.c_int32.from_address(first_at).value
    if v < 0:
        raise ValueError("%s[0] is %d; offsets must be >= 0" % (what, v))
    v = ctypes.c_int32.from_address(last_at).value
    if v > length:
        raise ValueError("%s[%d] is %d, past the end of %s (%d entries)" % (what, last, v, of, length))


class NoKey(Exception):
    """:func:`tensor_key` of something that is not a tensor."""


def tensor_key(t):
    """What a batched call's struct takes from a tensor argument (address, shape,
    strides, dtype, device), or None for None; raises NoKey for anything else
    (lists and buffers are converted on every call)."""
    if t is None:
        return None
    if not (hasattr(t, "data_ptr") and hasattr(t, "is_cuda")):
        raise NoKey
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_cuda)


def _has_buffer(obj) -> bool:
    if isinstance(obj, (ctypes.Array, ctypes._SimpleCData)):
        return True
    if isinstance(obj, (list, tuple, range)):
        return False
    try:
        memoryview(obj)
        return True
    except TypeError:
        return False


def _contiguous(a: Array) -> bool:
    acc = 1
    for n, s in zip(reversed(a.shape), reversed(a.strides)):
        if n != 1 and s != acc:
            return False
        acc *= n
    return True


def contiguous(a: Array) -> bool:
    """Whether a resolved array is C-contiguous (size-1 dimensions ignored)."""
    return _contiguous(a)


def stream_handle(stream) -> Optional[int]:
    """A CUDA stream argument as an int handle, or None for the default stream."""
    if stream is None:
        return None
    if isinstance(stream, bool):
        raise TypeError("stream: expected None, an int handle or a stream object, got a bool")
    if isinstance(stream, int):
        return _stream_int(stream, "stream")
    for attr in ("cuda_stream", "ptr"):
        h = getattr(stream, attr, None)
        if isinstance(h, int):
            return _stream_int(h, "stream." + attr)
    if isinstance(stream, ctypes.c_void_p):
        return stream.value
    raise TypeError("stream: expected None, an int (cudaStream_t), a torch.cuda.Stream or an object "
                    "with .cuda_stream, got %s" % type(stream).__name__)


def _stream_int(h: int, what: str) -> Optional[int]:
    # a handle is a pointer: ctypes would wrap one outside 64 bits silently
    if not 0 <= h < 1 << 64:
        raise OverflowError("%s = %d is not a cudaStream_t (a 64-bit pointer)" % (what, h))
    return h or None


def shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"

