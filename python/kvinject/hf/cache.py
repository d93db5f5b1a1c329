"""Reading and setting a transformers cache object: its per-layer tensors
(:func:`cache_tensors`) and a StaticCache's length (:func:`set_cache_length`).
"""
from __future__ import annotations

from typing import Any, List, Tuple


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
    cache; :class:`StaticCacheInjector` can allocate them first)."""
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


def _as_int(n) -> int:
    return int(n.item()) if hasattr(n, "item") else int(n)


def set_cache_length(cache, n: int) -> None:
    """Tells a transformers 5.x StaticCache (allocated) that its first n slots hold
    valid KV: every layer's length is set to n, so the next forward writes at
    slot n, takes positions n, n+1, ... and attends to slots 0..n-1. Checked
    against get_seq_length: a transformers version that keeps the length
    elsewhere raises RuntimeError instead of running on a wrong length.
    :class:`StaticCacheInjector` calls it after every injection."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError("set_cache_length: %s has no cache layer objects (transformers 5.x)" % type(cache).__name__)
    for i, l in enumerate(layers):
        cl = getattr(l, "cumulative_length", None)
        if hasattr(cl, "fill_"):  # a tensor: in place (its address may be captured by a graph)
            cl.fill_(n)
        elif isinstance(cl, int):
            l.cumulative_length = n
        else:
            raise RuntimeError("set_cache_length: layer %d (%s) keeps no cumulative_length: unsupported "
                               "transformers version" % (i, type(l).__name__))
    got = _as_int(cache.get_seq_length())
    if got != n:
        raise RuntimeError("set_cache_length(%d) left get_seq_length() at %d: unsupported transformers version"
                           % (n, got))

