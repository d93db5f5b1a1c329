"""The kvi_cache_layout of a vLLM KV cache, derived from the tensors
``register_kv_caches`` receives and the attention backend that uses them.

vLLM hands a connector one tensor per attention layer. Their shapes are
containers whose meaning depends on the backend (and, on the CPU, on the
kernel ISA), so the layout is derived from both, never guessed from the shape
alone:

================================  =====================================  =================================
backend (``get_name()``)           tensor per layer (logical shape)       layout
================================  =====================================  =================================
``CPU_ATTN``, ISA vec / vec16      ``[NB, H, BS, 2*D]`` container         per (block, head): K ``[D][BS]``
                                                                          then V ``[BS][D]`` (preset
                                                                          ``VLLM_CPU``)
``CPU_ATTN``, ISA amx (and others) tile-packed                            refused (:class:`LayoutError`)
``FLASH_ATTN`` (older vLLM)        ``[2, NB, BS, H, D]``                  K = [0], V = [1]; strides read
                                                                          from the tensor (NHD or HND)
``FLASHINFER``, ``TRITON_ATTN``,   ``[NB, 2, BS, H, D]``                  blocks first; strides from the
``FLASH_ATTN`` (vLLM 0.23)                                                 tensor
any GPU backend, packed K|V        ``[NB, BS, H, 2*D]`` or                K = ``[..., :D]``, V =
(vLLM >= 0.33)                     ``[NB, H, BS, 2*D]``                   ``[..., D:]``; strides from the
                                                                          tensor
================================  =====================================  =================================

A 4-D GPU cache is read as packed K|V; which of its two middle dimensions
holds the heads is decided by ``num_kv_heads`` (and ``block_size`` when
given), and a shape where both readings fit is refused. Tensors are read
through their attributes (torch is not imported here). Everything else is
refused with :class:`LayoutError` naming what was seen.
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional, Sequence, Tuple

from .. import _buffers
from ..cache import CacheLayout

GPU_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
CPU_BACKEND = "CPU_ATTN"
CPU_ISAS = ("vec", "vec16")  # the ISAs whose cache layout is VLLM_CPU


class LayoutError(ValueError):
    """A vLLM cache this connector cannot describe (an unsupported backend, ISA,
    shape or dtype)."""


_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")


def layer_index(name: str) -> int:
    """The layer number in a vLLM attention layer name (``model.layers.7.self_attn.attn`` -> 7)."""
    m = _LAYER_RE.search(name)
    if m is None:
        m = re.search(r"\.(\d+)\.", name)
    if m is None:
        raise LayoutError("cannot find a layer number in the attention layer name %r" % name)
    return int(m.group(1))


def ordered_layers(kv_caches: Dict[str, object]) -> Tuple[List[str], List[object]]:
    """register_kv_caches' dict as (names, tensors) in layer order; the layer numbers
    must be 0..L-1, each once."""
    items = sorted(((layer_index(n), n, t) for n, t in kv_caches.items()), key=lambda x: x[0])
    idx = [i for i, _, _ in items]
    if idx != list(range(len(items))):
        raise LayoutError("attention layers numbered %s; expected 0..%d once each (models with "
                          "non-attention layers or shared caches are not supported)" % (idx, len(items) - 1))
    return [n for _, n, _ in items], [t for _, _, t in items]


def derive_layout(tensors: Sequence, backend: str, *, num_kv_heads: int, head_size: int,
                  block_size: Optional[int] = None, isa: Optional[str] = None) -> CacheLayout:
    """The CacheLayout of vLLM cache tensors (one per layer, in layer order).

    backend: the attention backend's ``get_name()``; isa: the CPU backend's kernel
    ISA (``layer.isa``); num_kv_heads: the heads this rank's cache holds; head_size;
    block_size: vLLM's (checked when given). Raises :class:`LayoutError`."""
    tensors = list(tensors)
    if not tensors:
        raise LayoutError("no cache tensors")
    arrays = [_buffers.as_array(t, "kv_caches[%d]" % i, writable=True) for i, t in enumerate(tensors)]
    first = arrays[0]
    for i, a in enumerate(arrays):
        if (a.shape, a.strides, a.kind, a.memory, a.device) != (first.shape, first.strides, first.kind,
                                                              first.memory, first.device):
            raise LayoutError("cache tensor %d differs from tensor 0 (shape %s vs %s, strides %s vs %s, %s vs %s): "
                              "one layout needs one geometry" % (i, a.shape, first.shape, a.strides, first.strides,
                                                                 a.kind, first.kind))
    if first.kind not in ("f32", "f16", "bf16"):
        raise LayoutError("cache dtype %s: only fp32, fp16 and bf16 caches are supported (fp8 KV caches "
                          "need their scales, which this connector does not read yet)" % first.kind)
    shape, st = tuple(first.shape), tuple(first.strides)
    H, D = num_kv_heads, head_size
    what = "%s cache %s (strides %s)" % (backend, _buffers.shape_str(shape), st)

    if backend == CPU_BACKEND:
        if isa is None:
            raise LayoutError("%s: the kernel ISA is unknown (pass isa=, the attention layer's .isa); its "
                              "block layout depends on it" % what)
        if isa not in CPU_ISAS:
            raise LayoutError("%s with the %r kernel ISA: its block layout is not supported (supported ISAs: %s; "
                              "amx packs tiles, and vLLM picks it for bf16 models on CPUs with AMX: a float16 or "
                              "float32 model runs the vec kernels)" % (what, isa, ", ".join(CPU_ISAS)))
        if len(shape) != 4 or shape[1] != H or shape[3] != 2 * D:
            raise LayoutError("%s: expected [num_blocks, %d, block_size, %d]" % (what, H, 2 * D))
        _check_block_size(shape[2], block_size, what)
        try:
            return CacheLayout.vllm_cpu(tensors)
        except ValueError as e:
            raise LayoutError("%s: %s" % (what, e)) from None

    if backend not in GPU_BACKENDS:
        raise LayoutError("%s: attention backend %r is not supported (supported: %s, %s)"
                          % (what, backend, CPU_BACKEND, ", ".join(GPU_BACKENDS)))
    if len(shape) == 5:
        if shape[0] == 2 and shape[1] != 2:
            kv_first = True
        elif shape[1] == 2 and shape[0] != 2:
            kv_first = False
        elif shape[0] == 2 and shape[1] == 2:
            raise LayoutError("%s: 2 blocks and a K/V dimension of 2: cannot tell [2, NB, ...] from [NB, 2, ...]"
                              % what)
        else:
            raise LayoutError("%s: a 5-D cache must be [2, NB, BS, H, D] or [NB, 2, BS, H, D]" % what)
        if shape[3] != H or shape[4] != D:
            raise LayoutError("%s: expected %d heads of %d in dimensions 3 and 4" % (what, H, D))
        _check_block_size(shape[2], block_size, what)
        return CacheLayout.vllm(tensors, kv_first=kv_first)
    if len(shape) == 4:
        NB, a, b, C = shape
        if C != 2 * D:
            raise LayoutError("%s: a 4-D cache is packed K|V and needs a last dimension of 2 * head_size = %d"
                              % (what, 2 * D))
        nhd = b == H and (block_size is None or a == block_size)  # [NB, BS, H, 2D]
        hnd = a == H and (block_size is None or b == block_size)  # [NB, H, BS, 2D]
        if nhd and hnd:
            raise LayoutError("%s: block size and heads are both %d: cannot tell [NB, BS, H, 2D] from "
                              "[NB, H, BS, 2D]; pass block_size" % (what, H))
        if not (nhd or hnd):
            raise LayoutError("%s: expected [NB, BS, %d, %d] or [NB, %d, BS, %d]" % (what, H, 2 * D, H, 2 * D))
        BS = a if nhd else b
        tok, head = (st[1], st[2]) if nhd else (st[2], st[1])
        if st[3] != 1:
            raise LayoutError("%s: the packed dimension must be contiguous" % what)
        return CacheLayout(memory=first.memory, dtype=_buffers.kind_dtype(first.kind, "cache"),
                           num_layers=len(arrays), num_heads=H, head_size=D, block_size=BS, num_blocks=NB,
                           block_stride=st[0], token_stride=tok, head_stride=head, v_offset=D,
                           k_layers=[x.ptr for x in arrays], keep=arrays)
    raise LayoutError("%s: expected a 5-D [2, NB, BS, H, D] / [NB, 2, BS, H, D] or a 4-D packed cache" % what)


def _check_block_size(got: int, want: Optional[int], what: str) -> None:
    if want is not None and got != want:
        raise LayoutError("%s: block size %d, but vLLM's is %d" % (what, got, want))
