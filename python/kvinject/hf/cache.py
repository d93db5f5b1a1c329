"""Reading and setting a transformers cache object: its per-layer tensors
(:func:`cache_tensors`) and a StaticCache's length (:func:`set_cache_length`).

:func:`is_hf_cache` and :func:`cache_tensors` are kvinject.cache's, which
``CacheLayout.hf(cache)`` reads a cache object with (the core never imports
this package); they are here too, beside what sets a cache's length.
"""
from __future__ import annotations

from ..cache import cache_tensors, is_hf_cache

__all__ = ["cache_tensors", "is_hf_cache", "set_cache_length"]


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

