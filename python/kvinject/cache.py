"""Engine cache layouts (kvinject/cache.h).

A :class:`CacheLayout` wraps a kvi_cache_layout and keeps alive every object it
points into (the cache tensors or buffers, the per-layer pointer arrays, the
fp8 scales). Ways to make one:

- :meth:`CacheLayout.hf`: Hugging Face per-layer key and value tensors of
  [batch, heads, seq, head_size] (DynamicCache/StaticCache layers), or the
  cache object itself (then the layout checks, before each injector or
  encoder call, that the cache still holds those tensors: see
  :meth:`CacheLayout.check`); strides are read from the tensors, so a
  permuted or sliced view works too. Block ids are batch rows; a request's
  block table is ``[row]``. :class:`kvinject.hf.StaticCacheInjector` wraps
  a StaticCache: slots, the cache's length and fresh layouts.
- :meth:`CacheLayout.vllm`: vLLM per-layer cache tensors, [2, NB, BS, H, D]
  (FlashAttention, kv-first) or [NB, 2, BS, H, D] (FlashInfer/Triton,
  blocks-first); strides from the tensors, so the HND variants (a stride
  permutation of the same logical shape) come out right by themselves.
- :meth:`CacheLayout.sglang`: SGLang per-layer k_buffer/v_buffer [slots, H, D].
- :meth:`CacheLayout.vllm_cpu`: vLLM's CPU attention cache, per layer one
  [NB, H, BS, 2 * D] container tensor (K as [D, BS], then V as [BS, D], per
  block and head: the KVI_CACHE_VLLM_CPU preset).
- :meth:`CacheLayout.preset`: kvi_cache_layout_preset with explicit sizes, for
  buffers without a shape and for the pool presets (TensorRT-LLM).
- ``CacheLayout(...)``: every field by hand (pointers as ints), including a K
  dim stride and V's own block/token/head/dim strides (0, STRIDE_SAME: K's).

Layouts read from tensors take their strides as they are, the last one
(between dims) included.
"""
from __future__ import annotations

import ctypes
from typing import Any, List, Optional, Sequence, Tuple, Union

from ._types import ArrayLike, FloatArrayLike
from . import _buffers
from ._lib import CacheLayoutC, assign, fit, lib
from .enums import CachePreset, DType, Memory, ScaleMode
from .errors import StaleLayoutError


class CacheLayout:
    """kvi_cache_layout. Fields are readable as attributes (``layout.block_stride``);
    :attr:`c` is the ctypes struct handed to the C API."""

    def __init__(self, *, memory: Memory, dtype: DType, num_layers: int, num_heads: int, head_size: int,
                 block_size: int, num_blocks: int, block_stride: int, token_stride: int, head_stride: int,
                 layer_stride: int = 0, v_offset: int = 0, k_layers: Optional[Sequence] = None,
                 v_layers: Optional[Sequence] = None, k_base=None, v_base=None,
                 scale_mode: ScaleMode = ScaleMode.NONE, k_scales=None, v_scales=None, keep: Any = None,
                 dim_stride: int = 0, v_block_stride: int = 0, v_token_stride: int = 0, v_head_stride: int = 0,
                 v_dim_stride: int = 0):
        c = lib().new(CacheLayoutC)
        self._keep: List[Any] = [keep] if keep is not None else []
        self._given: dict = {}
        c.memory, c.dtype = int(Memory(memory)), int(DType(dtype))
        assign(c, num_layers=num_layers, num_heads=num_heads, head_size=head_size, block_size=block_size,
               num_blocks=num_blocks, block_stride=block_stride, token_stride=token_stride, head_stride=head_stride,
               layer_stride=layer_stride, v_offset=v_offset, dim_stride=dim_stride, v_block_stride=v_block_stride,
               v_token_stride=v_token_stride, v_head_stride=v_head_stride, v_dim_stride=v_dim_stride)
        if k_layers is not None:
            c.k_layers = self._pointer_array(k_layers, "k_layers")
        if v_layers is not None:
            c.v_layers = self._pointer_array(v_layers, "v_layers")
        if k_base is not None:
            c.k_base = self._pointer(k_base, "k_base")
        if v_base is not None:
            c.v_base = self._pointer(v_base, "v_base")
        self.c = c
        self._check_fits()
        self.set_scales(scale_mode, k_scales, v_scales)

    # ------------------------------------------------------------ pointers
    def _resolve(self, obj, what: str) -> Optional[_buffers.Array]:
        """A cache tensor or buffer, resolved (None for an int pointer)."""
        if obj is None or isinstance(obj, int):
            return None
        if isinstance(obj, _buffers.Array):  # resolved by a classmethod
            return obj
        return _buffers.as_array(obj, what, writable=True)

    def _pointer(self, obj, what: str) -> int:
        """The address of a tensor, a buffer or an int pointer; the array is kept
        (alive, and for :meth:`_check_fits`) under ``what``."""
        a = self._resolve(obj, what)
        self._given[what] = a
        if a is None:
            return 0 if obj is None else fit(obj, ctypes.c_uint64, what)
        self._keep.append(a)
        return a.ptr

    def _pointer_array(self, objs: Sequence, what: str) -> int:
        ptrs = [self._pointer(o, "%s[%d]" % (what, i)) for i, o in enumerate(objs)]
        arr = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
        self._keep.append(arr)
        self._given[what] = len(ptrs)
        return ctypes.addressof(arr)

    def _check_fits(self) -> None:
        """Refuses (ValueError) a layout that addresses memory outside the tensors and
        buffers it was made from: for every layer, the largest byte offset of its K and
        of its V plane (cache.h's formulas: blocks, tokens, heads and dims by their
        strides, the layer stride from a base, V's offset from K) must lie inside the
        object the plane's pointer points into; a pointer array must hold one pointer
        per layer (the library reads num_layers of them); and a host layout must not
        point into device memory. Int pointers carry no size: they are the caller's
        to get right. Layouts the injector and encoder refuse anyway (sizes < 1,
        negative strides, an unknown dtype) are left to them."""
        c, given = self.c, self._given
        L = c.num_layers
        for name in ("k_layers", "v_layers"):
            if getattr(c, name) and given.get(name) is not None and given[name] != L:
                raise ValueError("%s has %d pointers; the layout has %d layers" % (name, given[name], L))
        arrays = [a for a in given.values() if isinstance(a, _buffers.Array)]
        if not arrays:
            return
        if c.memory == int(Memory.HOST) and any(a.memory != Memory.HOST for a in arrays):
            raise ValueError("the layout is in host memory but a cache tensor is on a CUDA device")
        es = lib().kvi_dtype_size(c.dtype)
        counts = (c.num_blocks, c.block_size, c.num_heads, c.head_size)
        dim = c.dim_stride or 1
        ks = (c.block_stride, c.token_stride, c.head_stride, dim)
        vs = (c.v_block_stride or ks[0], c.v_token_stride or ks[1], c.v_head_stride or ks[2], c.v_dim_stride or dim)
        if es == 0 or L < 1 or min(counts) < 1 or min(ks + vs + (c.layer_stride, c.v_offset)) < 0:
            return
        # elements from a plane's first to its last, both included
        kext = 1 + sum((n - 1) * st for n, st in zip(counts, ks))
        vext = 1 + sum((n - 1) * st for n, st in zip(counts, vs))

        def fits(name: str, plane: str, layer: int, end: int) -> None:
            a = given.get(name)
            if isinstance(a, _buffers.Array) and end * es > a.nbytes:
                raise ValueError("%s holds %d bytes; the layout's %s of layer %d reaches %d bytes into it (%d blocks "
                                 "of %d tokens x %d heads x %d dims of %d bytes)"
                                 % (name, a.nbytes, plane, layer, end * es, c.num_blocks, c.block_size, c.num_heads,
                                    c.head_size, es))

        for l in range(L):
            k_name, k_at = ("k_layers[%d]" % l, 0) if c.k_layers else ("k_base", l * c.layer_stride)
            if c.k_layers or c.k_base:
                fits(k_name, "K", l, k_at + kext)
            if c.v_layers:
                fits("v_layers[%d]" % l, "V", l, vext)
            elif c.v_base:
                fits("v_base", "V", l, l * c.layer_stride + vext)
            elif c.k_layers or c.k_base:
                fits(k_name, "V", l, k_at + c.v_offset + vext)

    def set_scales(self, mode: ScaleMode, k_scales: Optional[FloatArrayLike] = None,
                   v_scales: Optional[FloatArrayLike] = None) -> "CacheLayout":
        """fp8 scales (divide convention: stored = x / scale): PER_TENSOR takes num_layers
        values, PER_HEAD num_layers * num_heads (layer-major); sequences of floats
        or fp32 host buffers / CPU tensors."""
        self.c.scale_mode = int(ScaleMode(mode))
        for name, vals in (("k_scales", k_scales), ("v_scales", v_scales)):
            if vals is None:
                setattr(self.c, name, None)
                continue
            a, dt = _buffers.float_array(vals, name, allow_device=False)
            if dt != DType.FP32:
                raise TypeError("%s must be fp32" % name)
            need = self.c.num_layers * (self.c.num_heads if mode == ScaleMode.PER_HEAD else 1)
            if a.numel < need:
                raise ValueError("%s has %d values; %s scales of %d layers x %d heads need %d"
                                 % (name, a.numel, ScaleMode(mode).name, self.c.num_layers, self.c.num_heads, need))
            self._keep.append(a)
            setattr(self.c, name, a.ptr)
        return self

    def check(self) -> None:
        """For a layout made from a Hugging Face cache object (``CacheLayout.hf(cache)``):
        raises :class:`kvinject.StaleLayoutError` when the cache no longer holds the
        tensors the layout points into (a DynamicCache reallocates them at every
        forward; a StaticCache when its layers are allocated again or moved).
        Injectors and encoders call it before every call, so a stale layout is
        refused instead of writing into tensors the model no longer reads. A
        no-op for layouts made from tensors or pointers: those keep their tensors
        alive, and the caller keeps them current."""
        src = self.__dict__.get("_source")
        if src is None:
            return
        cache, sig = src
        try:
            now = _signature(*cache_tensors(cache))
        except (RuntimeError, TypeError):
            now = None
        if now != sig:
            raise StaleLayoutError("the layout's %s no longer holds the tensors it was made from (a DynamicCache "
                                   "reallocates them at every forward; a StaticCache when its layers are "
                                   "allocated or moved): make a new layout, or use "
                                   "kvinject.hf.StaticCacheInjector, which does" % type(cache).__name__)

    @property
    def stale(self) -> bool:
        """Whether :meth:`check` would raise."""
        try:
            self.check()
        except StaleLayoutError:
            return True
        return False

    def __getattr__(self, name):
        c = self.__dict__.get("c")
        if c is not None and name in dict(CacheLayoutC._fields_):
            return getattr(c, name)
        raise AttributeError(name)

    @property
    def memory(self) -> Memory:
        return Memory(self.c.memory)

    @property
    def dtype(self) -> DType:
        return DType(self.c.dtype)

    def __repr__(self):
        c = self.c
        v = [c.v_block_stride, c.v_token_stride, c.v_head_stride, c.v_dim_stride]
        return ("CacheLayout(%s %s, %d layers x %d heads x %d, %d blocks of %d, strides block %d token %d head %d "
                "dim %d%s)"
                % (Memory(c.memory).name, DType(c.dtype).name, c.num_layers, c.num_heads, c.head_size,
                   c.num_blocks, c.block_size, c.block_stride, c.token_stride, c.head_stride, c.dim_stride or 1,
                   ", V block %d token %d head %d dim %d" % tuple(v) if any(v) else ""))

    # -------------------------------------------------------------- presets
    @classmethod
    def preset(cls, preset: CachePreset, dtype: DType, num_layers: int, num_heads: int, head_size: int,
               block_size: int, num_blocks: int, *, k_layers: Optional[Sequence] = None,
               v_layers: Optional[Sequence] = None, base=None, memory: Optional[Memory] = None) -> "CacheLayout":
        """kvi_cache_layout_preset. k_layers / v_layers: per-layer tensors, buffers or int
        pointers; base: the pool (TensorRT-LLM). memory: HOST or DEVICE; by default
        taken from the tensors (HOST for plain buffers)."""
        self = cls.__new__(cls)
        self._keep = []
        self._given = {}
        k_layers = None if k_layers is None else [self._resolve(o, "k_layers[%d]" % i) or o
                                                  for i, o in enumerate(k_layers)]
        v_layers = None if v_layers is None else [self._resolve(o, "v_layers[%d]" % i) or o
                                                  for i, o in enumerate(v_layers)]
        base = None if base is None else self._resolve(base, "base") or base
        mems = {o.memory for o in (k_layers or []) + (v_layers or []) + [base]
                if isinstance(o, _buffers.Array)}
        if memory is None:
            if len(mems) > 1:
                raise ValueError("the cache tensors are in host and device memory")
            memory = mems.pop() if mems else None
            if memory is None:
                raise ValueError("pass memory= (the cache is given by int pointers only)")
        c = lib().new(CacheLayoutC)
        kp = self._pointer_array(k_layers, "k_layers") if k_layers is not None else None
        vp = self._pointer_array(v_layers, "v_layers") if v_layers is not None else None
        bp = self._pointer(base, "k_base") if base is not None else None
        i32 = ctypes.c_int32
        lib().call("kvi_cache_layout_preset", ctypes.byref(c), int(CachePreset(preset)), int(DType(dtype)),
                   fit(num_layers, i32, "num_layers"), fit(num_heads, i32, "num_heads"),
                   fit(head_size, i32, "head_size"), fit(block_size, i32, "block_size"),
                   fit(num_blocks, ctypes.c_int64, "num_blocks"), kp, vp, bp)
        c.memory = int(Memory(memory))
        # the preset writes the first struct version that holds its fields; the
        # rest of c keeps its defaults, so the whole struct is valid
        c.struct_size = ctypes.sizeof(c)
        self.c = c
        self._check_fits()
        return self

    @classmethod
    def hf(cls, keys: Union[Sequence[ArrayLike], Any], values: Optional[Sequence[ArrayLike]] = None, *, shape: Optional[Sequence[int]] = None,
           dtype: Optional[DType] = None) -> "CacheLayout":
        """Hugging Face per-layer caches: ``keys[l]`` and ``values[l]`` of
        [batch, heads, seq, head_size] (e.g. ``[layer.keys for layer in cache.layers]``),
        or ``CacheLayout.hf(cache)``: a transformers cache object (DynamicCache,
        StaticCache; 5.x layer objects or 4.x key_cache lists) whose layers
        are allocated, its tensors read now and re-read by :meth:`check` before
        every injector or encoder call (a layout that outlived its tensors
        raises :class:`kvinject.StaleLayoutError`).

        Tensors: shape and strides are read from them; every key and value must
        have the same shape, strides, dtype and device (any strides, the last one
        included). Host buffers (no shape): pass ``shape=(batch, heads, seq,
        head_size)`` and, for raw uint16/uint8 buffers, ``dtype``; they are taken
        as contiguous (the KVI_CACHE_HF_CONTIGUOUS preset). Block ids are batch
        rows (num_blocks = batch, block_size = seq, the capacity)."""
        if values is None:
            if not is_hf_cache(keys):
                raise TypeError("hf: expected a transformers cache object, or keys and values (one tensor per "
                                "layer each); got %s alone" % type(keys).__name__)
            k, v = cache_tensors(keys)
            lay = cls.hf(k, v, shape=shape, dtype=dtype)
            lay._source = (keys, _signature(k, v))
            return lay
        keys, values = list(keys), list(values)
        if not keys or len(keys) != len(values):
            raise ValueError("hf: %d key and %d value tensors; expected one of each per layer (>= 1)"
                             % (len(keys), len(values)))
        arrays = _layer_arrays(keys, values, dtype, "hf")
        first = arrays[0]
        if first.is_tensor or len(first.shape) == 4:
            _same_geometry(arrays, 4, "hf", "[batch, heads, seq, head_size]")
            B, H, S, D = first.shape
            if shape is not None and tuple(shape) != first.shape:
                raise ValueError("hf: shape=%s but the tensors are %s"
                                 % (_buffers.shape_str(shape), _buffers.shape_str(first.shape)))
            st = first.strides
            return cls(memory=first.memory, dtype=_buffers.kind_dtype(first.kind, "hf cache"),
                       num_layers=len(keys), num_heads=H, head_size=D, block_size=S, num_blocks=B,
                       block_stride=st[0], token_stride=st[2], head_stride=st[1], dim_stride=st[3],
                       k_layers=arrays[:len(keys)], v_layers=arrays[len(keys):], keep=arrays)
        if shape is None or len(shape) != 4:
            raise ValueError("hf: host buffers carry no shape; pass shape=(batch, heads, seq, head_size)")
        B, H, S, D = shape
        _check_sizes(arrays, B * H * S * D, "hf")
        lay = cls.preset(CachePreset.HF_CONTIGUOUS, _buffers.kind_dtype(first.kind, "hf cache"), len(keys), H, D,
                         S, B, k_layers=arrays[:len(keys)], v_layers=arrays[len(keys):], memory=first.memory)
        lay._keep.append(arrays)
        return lay

    @classmethod
    def vllm(cls, kv_caches: Sequence[ArrayLike], *, kv_first: bool = True, shape: Optional[Sequence[int]] = None,
             dtype: Optional[DType] = None) -> "CacheLayout":
        """vLLM per-layer cache tensors (``register_kv_caches``' values, in layer order).

        kv_first=True: [2, NB, BS, H, D] (FlashAttention); False: [NB, 2, BS, H,
        D] (FlashInfer, Triton). The shape is the logical one; the HND variants
        differ only in strides, which are read from the tensors. fp8 caches are
        uint8 tensors: pass dtype=DType.FP8_E4M3 (or E5M2) and set scales with
        :meth:`set_scales`. Host buffers: pass ``shape`` (the logical 5-D shape,
        contiguous NHD)."""
        kv_caches = list(kv_caches)
        if not kv_caches:
            raise ValueError("vllm: no cache tensors")
        arrays = [_buffers.as_array(t, "kv_caches[%d]" % i, writable=True, dtype=dtype)
                  for i, t in enumerate(kv_caches)]
        first = arrays[0]
        if first.is_tensor or len(first.shape) == 5:
            _same_geometry(arrays, 5, "vllm", "[2, NB, BS, H, D]" if kv_first else "[NB, 2, BS, H, D]")
            shp, st = first.shape, first.strides
        else:
            if shape is None or len(shape) != 5:
                raise ValueError("vllm: host buffers carry no shape; pass the logical 5-D shape")
            shp = tuple(shape)
            n = 1
            for s in shp:
                n *= s
            _check_sizes(arrays, n, "vllm")
            st, acc = [], 1
            for s in reversed(shp):
                st.append(acc)
                acc *= s
            st = tuple(reversed(st))
        if kv_first:
            two, NB, BS, H, D = shp
            v_off, blk = st[0], st[1]
        else:
            NB, two, BS, H, D = shp
            blk, v_off = st[0], st[1]
        if two != 2:
            raise ValueError("vllm: the K/V dimension has size %d, expected 2 (is kv_first right?)" % two)
        return cls(memory=first.memory, dtype=_buffers.kind_dtype(first.kind, "vllm cache"),
                   num_layers=len(arrays), num_heads=H, head_size=D, block_size=BS, num_blocks=NB,
                   block_stride=blk, token_stride=st[2], head_stride=st[3], dim_stride=st[4], v_offset=v_off,
                   k_layers=arrays, keep=arrays)

    @classmethod
    def sglang(cls, k_buffers: Sequence[ArrayLike], v_buffers: Sequence[ArrayLike], *, page_size: int = 1,
               dtype: Optional[DType] = None) -> "CacheLayout":
        """SGLang MHATokenToKVPool per-layer k_buffer / v_buffer tensors of [slots, H, D].
        Block ids are pages of ``page_size`` slots (1: slot ids)."""
        k_buffers, v_buffers = list(k_buffers), list(v_buffers)
        if not k_buffers or len(k_buffers) != len(v_buffers):
            raise ValueError("sglang: expected one k and one v buffer per layer")
        arrays = _layer_arrays(k_buffers, v_buffers, dtype, "sglang")
        _same_geometry(arrays, 3, "sglang", "[slots, H, D]")
        slots, H, D = arrays[0].shape
        st = arrays[0].strides
        if slots % page_size:
            raise ValueError("sglang: %d slots is not a whole number of pages of %d" % (slots, page_size))
        n = len(k_buffers)
        return cls(memory=arrays[0].memory, dtype=_buffers.kind_dtype(arrays[0].kind, "sglang cache"),
                   num_layers=n, num_heads=H, head_size=D, block_size=page_size, num_blocks=slots // page_size,
                   block_stride=page_size * st[0], token_stride=st[0], head_stride=st[1], dim_stride=st[2],
                   k_layers=arrays[:n], v_layers=arrays[n:], keep=arrays)

    @classmethod
    def vllm_cpu(cls, kv_caches: Sequence[ArrayLike], *, shape: Optional[Sequence[int]] = None,
                 dtype: Optional[DType] = None) -> "CacheLayout":
        """vLLM's CPU attention cache (CPU_ATTN, vec / vec16 ISA): ``register_kv_caches``'
        per-layer tensors of [NB, H, BS, 2 * D], in layer order. The shape is only a
        container: per (block, head) its 2 * D * BS elements hold K as [D, BS]
        (token fastest) followed by V as [BS, D] (the KVI_CACHE_VLLM_CPU preset),
        so each tensor must be contiguous. Host buffers: pass ``shape``."""
        kv_caches = list(kv_caches)
        if not kv_caches:
            raise ValueError("vllm_cpu: no cache tensors")
        arrays = [_buffers.as_array(t, "kv_caches[%d]" % i, writable=True, dtype=dtype)
                  for i, t in enumerate(kv_caches)]
        first = arrays[0]
        if first.is_tensor or len(first.shape) == 4:
            _same_geometry(arrays, 4, "vllm_cpu", "[NB, H, BS, 2 * D]")
            shp = first.shape
            acc, want = 1, []
            for n in reversed(shp):
                want.append(acc)
                acc *= n
            if tuple(reversed(want)) != tuple(first.strides):
                raise ValueError("vllm_cpu: the tensors have strides %s; the CPU cache is a contiguous container "
                                 "%s" % (first.strides, _buffers.shape_str(shp)))
        else:
            if shape is None or len(shape) != 4:
                raise ValueError("vllm_cpu: host buffers carry no shape; pass shape=(NB, H, BS, 2 * D)")
            shp = tuple(shape)
            _check_sizes(arrays, shp[0] * shp[1] * shp[2] * shp[3], "vllm_cpu")
        NB, H, BS, D2 = shp
        if D2 % 2:
            raise ValueError("vllm_cpu: the last dimension is %d, expected 2 * head_size" % D2)
        lay = cls.preset(CachePreset.VLLM_CPU, _buffers.kind_dtype(first.kind, "vllm_cpu cache"), len(arrays), H,
                         D2 // 2, BS, NB, k_layers=arrays, memory=first.memory)
        lay._keep.append(arrays)
        return lay


# ------------------------------------------------- transformers cache objects
# (CacheLayout.hf(cache) reads them; kvinject.hf.cache gives them too)

def is_hf_cache(obj) -> bool:
    """Whether obj looks like a transformers cache (5.x ``layers`` with keys and
    values, or 4.x ``key_cache`` / ``value_cache`` lists)."""
    layers = getattr(obj, "layers", None)
    if layers is not None and not isinstance(obj, (list, tuple)):
        return all(hasattr(l, "keys") and hasattr(l, "values") for l in layers)
    return hasattr(obj, "key_cache") and hasattr(obj, "value_cache")


def cache_tensors(cache) -> Tuple[List[Any], List[Any]]:
    """The per-layer key and value tensors [batch, heads, seq, head_dim] of a
    transformers cache, as lists. RuntimeError while the layers are not
    allocated (transformers allocates them at the first forward through the
    cache; :class:`kvinject.hf.StaticCacheInjector` can allocate them first)."""
    if not is_hf_cache(cache):
        raise TypeError("expected a transformers cache (DynamicCache, StaticCache), got %s" % type(cache).__name__)
    layers = getattr(cache, "layers", None)
    if layers is not None:
        keys = [l.keys for l in layers]
        values = [l.values for l in layers]
    else:  # 4.x
        keys, values = list(cache.key_cache), list(cache.value_cache)
    if not keys or any(getattr(t, "dim", None) is None or t.dim() != 4 for t in keys + values):
        raise RuntimeError("the %s's layers are not allocated (run a forward through it first)"
                           % type(cache).__name__)
    return keys, values


def _signature(keys, values):
    """What identifies the memory of a cache's tensors: data pointer, shape, strides,
    dtype and device of each (a reallocated tensor has another pointer: the layout
    keeps the old one alive, so its address cannot be reused)."""
    return tuple((int(t.data_ptr()), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
                 for t in list(keys) + list(values))


def _layer_arrays(keys, values, dtype, what):
    return ([_buffers.as_array(t, "%s keys[%d]" % (what, i), writable=True, dtype=dtype) for i, t in enumerate(keys)]
            + [_buffers.as_array(t, "%s values[%d]" % (what, i), writable=True, dtype=dtype)
               for i, t in enumerate(values)])


def _same_geometry(arrays, ndim, what, expected):
    first = arrays[0]
    for i, a in enumerate(arrays):
        if len(a.shape) != ndim:
            raise ValueError("%s: tensor %d has shape %s; expected %s"
                             % (what, i, _buffers.shape_str(a.shape), expected))
        if a.shape != first.shape:
            raise ValueError("%s: tensor %d has shape %s, tensor 0 %s; every layer's K and V must have one shape"
                             % (what, i, _buffers.shape_str(a.shape), _buffers.shape_str(first.shape)))
        if a.strides != first.strides:
            raise ValueError("%s: tensor %d has strides %s, tensor 0 %s; a layout has one set of strides"
                             % (what, i, a.strides, first.strides))
        if a.kind != first.kind:
            raise TypeError("%s: tensor %d is %s, tensor 0 %s" % (what, i, a.kind, first.kind))
        if (a.memory, a.device) != (first.memory, first.device):
            raise ValueError("%s: tensor %d is on another device than tensor 0" % (what, i))
    if first.strides[-1] == 0 and first.shape[-1] != 1:
        raise ValueError("%s: the dims of a head vector have stride 0 (a broadcast tensor)" % what)


def _check_sizes(arrays, n, what):
    for i, a in enumerate(arrays):
        if a.numel < n:
            raise ValueError("%s: buffer %d holds %d elements; the shape needs %d" % (what, i, a.numel, n))
