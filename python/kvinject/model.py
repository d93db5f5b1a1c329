"""Model geometry and RoPE (kvinject/model.h)."""
from __future__ import annotations

import array
import ctypes
import dataclasses
from typing import Optional, Tuple

from ._types import FloatArrayLike
from . import _buffers
from ._handle import Handle
from ._lib import ModelInfo, ModelOptions, RopeSpecC, assign, fit, lib
from .enums import DType, RopeScaling, RopeStyle


@dataclasses.dataclass
class RopeSpec:
    """kvi_rope_spec: one layer's RoPE. Defaults are the C KVI_ROPE_SPEC_INIT values.

    ``cos_sin_table``: the engine's own table, rows of rotary_dim/2 cosines then
    rotary_dim/2 sines per position: a host buffer or CPU tensor (fp32, fp16 or
    bf16; ``table_dtype`` for a raw uint16 buffer) or a sequence of floats (sent
    as fp32). ``table_positions`` defaults to the number of rows it holds.
    From :meth:`Model.get_rope` it is the model's fp32 copy, an ``array('f')``.
    """

    style: RopeStyle = RopeStyle.NEOX
    rotary_dim: int = 0
    theta: float = 10000.0
    scaling: RopeScaling = RopeScaling.NONE
    original_max_position: int = 8192
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 0.0
    yarn_truncate: int = 1
    table_dtype: Optional[DType] = None
    cos_sin_table: Optional[FloatArrayLike] = None
    table_positions: Optional[int] = None


_SCALAR_FIELDS = ("rotary_dim", "theta", "original_max_position", "factor", "low_freq_factor",
                  "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "yarn_truncate")


@dataclasses.dataclass(frozen=True)
class ModelInfoData:
    """kvi_model_info: what a model resolves to."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int
    tp_size: int
    local_head_first: int
    local_heads: int
    head_replicas: int


class Model(Handle):
    """kvi_model: the attention KV geometry of one model as this process sees it.

    ``Model(num_layers, num_kv_heads, head_size, tp_rank=0, tp_size=1)``. Every
    layer starts with its RoPE unset (RopeStyle.UNSET; injection and capture refuse it):
    call :meth:`set_rope` with a spec or ``style=RopeStyle.NONE``. Stores
    copy what they need, so a model may be closed after creating them.
    Thread rules as in C: reads from many threads; set_rope alone.
    """

    _destroy = "kvi_model_destroy"

    def __init__(self, num_layers: int, num_kv_heads: int, head_size: int, tp_rank: int = 0, tp_size: int = 1):
        L = lib()
        o = L.new(ModelOptions)
        assign(o, num_layers=num_layers, num_kv_heads=num_kv_heads, head_size=head_size, tp_rank=tp_rank,
               tp_size=tp_size)
        h = ctypes.c_void_p()
        L.call("kvi_model_create", ctypes.byref(h), ctypes.byref(o))
        self._h = h
        self._info = self._read_info()


    def _read_info(self) -> ModelInfoData:
        i = lib().new(ModelInfo)
        lib().call("kvi_model_info_get", self.handle, ctypes.byref(i))
        return ModelInfoData(*(getattr(i, f) for f, _ in ModelInfo._fields_[1:]))

    def info(self) -> ModelInfoData:
        """kvi_model_info_get."""
        return self._read_info()

    num_layers = property(lambda self: self._info.num_layers)
    num_kv_heads = property(lambda self: self._info.num_kv_heads)
    head_size = property(lambda self: self._info.head_size)
    tp_rank = property(lambda self: self._info.tp_rank)
    tp_size = property(lambda self: self._info.tp_size)
    local_head_first = property(lambda self: self._info.local_head_first)
    local_heads = property(lambda self: self._info.local_heads)
    head_replicas = property(lambda self: self._info.head_replicas)

    def set_rope(self, spec: Optional[RopeSpec] = None, layer: int = -1, **fields) -> None:
        """kvi_model_set_rope for one layer, or every layer (layer=-1, the default).

        Pass a :class:`RopeSpec`, keyword fields of one (``style=RopeStyle.GPTJ,
        theta=5e5, scaling=RopeScaling.LLAMA3, factor=8, ...``) applied over the
        defaults or over ``spec``, or ``style=RopeStyle.NONE`` for a NoPE layer.
        """
        if spec is None:
            spec = RopeSpec()
        spec = dataclasses.replace(spec, **fields)
        L = lib()
        s = L.new(RopeSpecC)
        s.style = int(RopeStyle(spec.style))
        s.scaling = int(RopeScaling(spec.scaling))
        assign(s, **{f: getattr(spec, f) for f in _SCALAR_FIELDS})
        keep = None
        if spec.cos_sin_table is not None:
            a, dt = _buffers.float_array(spec.cos_sin_table, "cos_sin_table", dtype=spec.table_dtype,
                                         allow_device=False)
            rot = spec.rotary_dim or self.head_size
            positions = spec.table_positions
            if positions is None:
                if rot <= 0 or a.numel % rot:
                    raise ValueError("cos_sin_table has %d values, not a whole number of rows of rotary_dim %d"
                                     % (a.numel, rot))
                positions = a.numel // rot
            elif positions * rot > a.numel:
                raise ValueError("cos_sin_table has %d values; table_positions %d x rotary_dim %d needs %d"
                                 % (a.numel, positions, rot, positions * rot))
            s.table_dtype = int(dt)
            s.cos_sin_table = a.ptr
            assign(s, table_positions=positions)
            keep = a
        elif spec.table_dtype is not None:
            s.table_dtype = int(DType(spec.table_dtype))
        L.call("kvi_model_set_rope", self.handle, fit(layer, ctypes.c_int32, "layer"), ctypes.byref(s))
        del keep

    def get_rope(self, layer: int) -> RopeSpec:
        """kvi_model_get_rope: a layer's resolved spec (rotary_dim never 0 for a rotated
        layer; attention_factor the one applied; a table as an fp32 array copy)."""
        L = lib()
        s = L.new(RopeSpecC)
        L.call("kvi_model_get_rope", self.handle, fit(layer, ctypes.c_int32, "layer"), ctypes.byref(s))
        out = RopeSpec(style=RopeStyle(s.style), scaling=RopeScaling(s.scaling),
                       table_dtype=DType(s.table_dtype))
        for f in _SCALAR_FIELDS:
            setattr(out, f, getattr(s, f))
        if s.cos_sin_table:
            n = s.table_positions * s.rotary_dim
            out.cos_sin_table = array.array("f", (ctypes.c_float * n).from_address(s.cos_sin_table))
            out.table_positions = s.table_positions
        else:
            out.table_positions = s.table_positions
        return out

    def rope_cos_sin(self, layer: int, pos: int, pair: int) -> Tuple[float, float]:
        """kvi_model_rope_cos_sin: (cos, sin) the model applies to pair ``pair`` of layer
        ``layer`` at position ``pos``, attention factor included (fp32 values)."""
        c, s = ctypes.c_float(), ctypes.c_float()
        i32 = ctypes.c_int32
        lib().call("kvi_model_rope_cos_sin", self.handle, fit(layer, i32, "layer"), fit(pos, i32, "pos"),
                   fit(pair, i32, "pair"), ctypes.byref(c), ctypes.byref(s))
        return c.value, s.value

    def __repr__(self):
        i = self._info
        return "Model(layers=%d, kv_heads=%d, head_size=%d, tp=%d/%d, local heads %d..%d)" % (
            i.num_layers, i.num_kv_heads, i.head_size, i.tp_rank, i.tp_size, i.local_head_first,
            i.local_head_first + i.local_heads - 1)
