"""Injection into a transformers StaticCache (:class:`StaticCacheInjector`):
appends facts at the cache's length, checks they fit, sets the cache's length
after them, and re-reads the layout when the cache's tensors move.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

from .._types import IntArrayLike, StreamLike
from ..cache import CacheLayout
from ..enums import Backend
from ..errors import StaleLayoutError
from ..store import Store
from ..transfer import InjectRequest, Injector
from .cache import _as_int, is_hf_cache, set_cache_length


class StaticCacheInjector:
    """Injects a :class:`kvinject.Store`'s facts into a transformers (5.x)
    ``StaticCache``, whose tensors are preallocated for ``max_cache_len`` slots.

    ``StaticCacheInjector(store, cache, *, dtype=None, device=None, batch_size=1,
    **transfer_options)``. :meth:`inject` writes facts at the cache's current
    length (its next free slot, position = slot unless ``start_position`` is
    given), after checking that they fit, and then sets the cache's length past
    them, so the next forward through the cache attends to them and continues
    at the right slot and position. :meth:`set_length` moves the length by hand
    (e.g. back to a prefilled header, to inject other facts behind it).

    The injector (:attr:`injector`) and its layout are made on first use and
    made again whenever the cache's tensors have moved (layers allocated
    again, moved to another device): every call sees the cache's current
    tensors. Layers not yet allocated (no forward has run) are allocated with
    ``early_initialization`` from ``batch_size``, ``dtype`` and ``device`` and
    the store's geometry; without dtype and device that is a ValueError.

    A DynamicCache is refused (TypeError): its tensors hold exactly its length,
    with no slot to inject into, and every forward reallocates them; sliding
    window layers too (NotImplementedError): their slots are a ring.
    ``transfer_options``: as :class:`kvinject.Injector`. Keep this object (it
    keeps the injectors) until the stream has passed the work. An injector of
    moved tensors is freed when they move (a CUDA store's after synchronizing the
    stream of the last injection, where it is an object with ``synchronize()``,
    such as a torch.cuda.Stream; with a raw handle or the default stream it is
    kept until :meth:`close`).
    """

    def __init__(self, store: Store, cache: Any, *, dtype: Any = None, device: Any = None, batch_size: int = 1,
                 **transfer_options: Optional[int]):
        layers = getattr(cache, "layers", None)
        if layers is None or not is_hf_cache(cache):
            raise TypeError("cache: expected a transformers 5.x StaticCache (cache layer objects), got %s"
                            % type(cache).__name__)
        for i, l in enumerate(layers):
            if getattr(l, "max_cache_len", None) is None or not hasattr(l, "cumulative_length"):
                raise TypeError("cache: layer %d is a %s, not a static layer: a %s holds exactly its length "
                                "(no slot to inject into) and reallocates its tensors at every forward; use a "
                                "StaticCache" % (i, type(l).__name__, type(cache).__name__))
            if getattr(l, "is_sliding", False):
                raise NotImplementedError("cache: layer %d is a sliding-window layer (%s), whose slots are a ring; "
                                          "injection needs full-attention static layers" % (i, type(l).__name__))
        if len(layers) != store.num_layers:
            raise ValueError("cache: %d layers, the store's model has %d" % (len(layers), store.num_layers))
        self.store = store
        self.cache = cache
        self._alloc = (batch_size, dtype, device)
        self._options = transfer_options
        self._injector = None
        self._retired: List[Any] = []  # injectors of moved tensors whose work may still be in flight
        self._last_stream = None

    # -------------------------------------------------------------- geometry
    @property
    def capacity(self) -> int:
        """Slots per sequence: the cache's max_cache_len."""
        return int(self.cache.layers[0].max_cache_len)

    @property
    def allocated(self) -> bool:
        return all(getattr(l, "is_initialized", True) for l in self.cache.layers) and \
            all(getattr(l, "keys", None) is not None for l in self.cache.layers)

    @property
    def batch_size(self) -> int:
        self._allocate()
        return int(self.cache.layers[0].keys.shape[0])

    @property
    def length(self) -> int:
        """The cache's length (get_seq_length): slots holding valid KV, the next free slot."""
        return _as_int(self.cache.get_seq_length()) if self.allocated else 0

    def set_length(self, n: int) -> None:
        """Sets the cache's length to n (0..capacity): :func:`set_cache_length`."""
        import operator
        n = operator.index(n)
        if not 0 <= n <= self.capacity:
            raise ValueError("set_length: n = %d, expected 0..%d (the cache's max_cache_len)" % (n, self.capacity))
        self._allocate()
        set_cache_length(self.cache, n)

    def _allocate(self) -> None:
        if self.allocated:
            return
        batch_size, dtype, device = self._alloc
        if dtype is None or device is None:
            raise ValueError("the StaticCache's layers are not allocated yet (transformers allocates them at the "
                             "first forward): run a forward through the cache first, or pass dtype= and device= "
                             "to StaticCacheInjector")
        self.cache.early_initialization(batch_size, self.store.num_heads, self.store.head_size, dtype, device)

    # -------------------------------------------------------------- injector
    @property
    def injector(self):
        """The :class:`kvinject.Injector` on the cache's current tensors (made again
        when they moved)."""
        self._allocate()
        if self._injector is not None:
            try:
                self._injector.layout.check()
                return self._injector
            except StaleLayoutError:
                self._retire(self._injector)
                self._injector = None
        self._injector = Injector(self.store, CacheLayout.hf(self.cache), **self._options)
        return self._injector

    def _retire(self, inj) -> None:
        """An injector of tensors the cache no longer holds: freed now when its work is
        complete (a CPU store works synchronously; else the stream of the last
        injection is synchronized, when it can be), else kept until :meth:`close`
        (it also keeps the old tensors alive)."""
        stream = self._last_stream
        if self.store.backend != Backend.CPU:
            if not hasattr(stream, "synchronize"):
                self._retired.append(inj)
                return
            stream.synchronize()
        inj.close()

    @property
    def layout(self) -> CacheLayout:
        """The current layout (see :attr:`injector`)."""
        return self.injector.layout

    def plan(self, tenant: int, fact_ids: IntArrayLike) -> int:
        """Tokens the facts take (kvi_inject_plan)."""
        return self.injector.plan(tenant, fact_ids)

    def inject(self, tenant: int, fact_ids: IntArrayLike, *, rows: Optional[Sequence[int]] = None,
               start_position: Optional[int] = None, positions: Optional[IntArrayLike] = None,
               stream: StreamLike = None) -> int:
        """Writes the facts, in order, into each batch row of ``rows`` (None: every
        row) from the cache's length on, then sets the length past them. Returns
        the tokens injected. start_position: RoPE position of the first token
        (default: its slot, as a prefill would have it); positions: one per token
        instead. A forward after an injection at other positions than the slots
        must pass its own position_ids. Nothing is written, and the length is
        unchanged, when the facts do not fit or a call fails."""
        rows = list(range(self.batch_size)) if rows is None else list(rows)
        return self.inject_rows(tenant, [fact_ids] * len(rows), rows=rows, start_position=start_position,
                                positions=positions, stream=stream)

    def inject_rows(self, tenant: int, fact_ids_per_row: Sequence[IntArrayLike], *, rows: Optional[Sequence[int]] = None,
                    start_position: Optional[int] = None, positions: Optional[IntArrayLike] = None,
                    stream: StreamLike = None) -> int:
        """As :meth:`inject`, each row its own facts: ``fact_ids_per_row[i]`` into batch
        row ``rows[i]`` (rows default 0, 1, ...). The cache has one length for all
        rows, so every row's facts must have the same number of tokens."""
        inj = self.injector
        per_row = [list(ids) if not hasattr(ids, "data_ptr") else ids for ids in fact_ids_per_row]
        rows = list(range(len(per_row))) if rows is None else list(rows)
        if len(rows) != len(per_row):
            raise ValueError("inject_rows: %d rows for %d fact lists" % (len(rows), len(per_row)))
        B = self.batch_size
        for r in rows:
            if not 0 <= r < B:
                raise ValueError("rows: row %d, the cache has batch rows 0..%d" % (r, B - 1))
        if len(set(rows)) != len(rows):
            raise ValueError("rows: %s names a row twice" % (rows,))
        tokens = [inj.plan(tenant, ids) for ids in per_row]
        if len(set(tokens)) > 1:
            raise ValueError("inject_rows: the rows' facts have %s tokens; the cache has one length for every "
                             "row, so they must be equal" % tokens)
        n = tokens[0] if tokens else 0
        start = self.length
        if start + n > self.capacity:
            raise ValueError("inject: %d tokens from slot %d pass the cache's max_cache_len %d"
                             % (n, start, self.capacity))
        if n == 0:
            return 0
        pos0 = start if start_position is None and positions is None else (start_position or 0)
        inj.inject([InjectRequest(tenant, ids, block_table=[r], first_slot=start, start_position=pos0,
                                  positions=positions) for r, ids in zip(rows, per_row)], stream=stream)
        self._last_stream = stream
        self.set_length(start + n)
        return n

    def close(self) -> None:
        """Frees the injectors (their work on a stream must be complete)."""
        for inj in self._retired + ([self._injector] if self._injector is not None else []):
            inj.close()
        self._retired, self._injector = [], None
