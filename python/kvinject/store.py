"""The fact store (kvinject/store.h) and retrieval (kvinject/search.h)."""
from __future__ import annotations

import array
import ctypes
import dataclasses
import os
import weakref
from typing import Any, List, Optional, Sequence, Tuple, Union

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]

from ._types import ArrayLike, FloatArrayLike, IntArrayLike, StreamLike
from . import _buffers
from ._buffers import Array
from ._handle import Handle
from ._lib import (GatherItemC, KVViewC, LoadOptionsC, PutOptions, SaveOptionsC, ScatterItemC, SearchOptions, StoreOptions, StoreStatsC, assign,
                   fit, lib)

U64 = ctypes.c_uint64
from .enums import (LOAD_JOURNAL, PUT_REPLACE, REMOVE_KEEP_DEPENDENTS, SAVE_ONE_TENANT, SEARCH_MAX_K, SEARCH_NO_ID, Backend, DType,
                    EmbeddingPlacement, Memory, Metric, Tier)
from .errors import CapacityError
from .model import Model


@dataclasses.dataclass
class KVView:
    """kvi_kv_view with raw pointers, for buffers the array forms do not cover.

    Element (l, t, h, d) of K is at ``k + (l*layer_stride + t*token_stride +
    h*head_stride + d) * elem_size``, V likewise with the same strides. ``keep``
    holds objects that must stay alive while the view is used.
    """

    memory: Memory
    dtype: DType
    num_layers: int
    num_tokens: int
    num_heads: int
    head_size: int
    layer_stride: int
    token_stride: int
    head_stride: int
    k: int
    v: int
    keep: Any = None

    def to_c(self) -> KVViewC:
        c = lib().new(KVViewC)
        c.memory, c.dtype = int(self.memory), int(self.dtype)
        assign(c, num_layers=self.num_layers, num_tokens=self.num_tokens, num_heads=self.num_heads,
               head_size=self.head_size, layer_stride=self.layer_stride, token_stride=self.token_stride,
               head_stride=self.head_stride, k=self.k, v=self.v)
        return c


@dataclasses.dataclass(frozen=True)
class StoreStats:
    """kvi_store_stats."""

    backend: Backend
    device: int
    dtype: DType
    page_tokens: int
    embedding_dim: int
    page_bytes: int
    pages_total: int
    pages_used: int
    bytes_reserved: int
    bytes_used: int
    bytes_payload: int
    facts: int
    tenants: int
    bytes_embeddings: int
    pages_host_total: int
    pages_host_used: int
    promotions: int
    demotions: int
    facts_stale: int = 0  # experimental
    # the disk tier (0 without one; kvinject/store.h, "Disk tier")
    facts_on_disk_only: int = 0  #: facts (counted in facts) in no memory tier now, only in their tenant's file
    disk_bytes: int = 0  #: bytes of the tenant files the store wrote or read
    disk_reads: int = 0  #: facts read back from tenant files since creation
    disk_read_bytes: int = 0  #: bytes read for them (whole entries)
    disk_writes: int = 0  #: entries appended to tenant files (and files rewritten)
    disk_write_bytes: int = 0  #: bytes written for them
    drops_to_disk: int = 0  #: facts dropped from memory (kept on disk) since creation


class SearchResults:
    """Host results of :meth:`Store.search`: ``ids`` (array('Q')), ``scores``
    (array('f')) and ``counts`` (array('i')), row-major [num_queries, k].
    ``results[i]`` is query i's list of (fact_id, score), best first."""

    def __init__(self, ids, scores, counts, k: int):
        self.ids, self.scores, self.counts, self.k = ids, scores, counts, k

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, i: int) -> List[Tuple[int, float]]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        base = i * self.k
        return [(self.ids[base + j], self.scores[base + j]) for j in range(self.counts[i])]

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __repr__(self):
        return "SearchResults(%r)" % [self[i] for i in range(len(self))]


def _alloc(kind: DType, n: int):
    """A zeroed host buffer of n elements: array('f') for fp32, array('H') (raw bits)
    for fp16 and bf16."""
    if DType(kind) == DType.FP32:
        return array.array("f", bytes(4 * n))
    if DType(kind) in (DType.FP16, DType.BF16):
        return array.array("H", bytes(2 * n))
    raise ValueError("cannot allocate %s host arrays; pass output buffers" % DType(kind).name)


def _query_array(queries, dim: int, query_dtype: Optional[DType] = None):
    """Queries as :meth:`Store.search` takes them -> (array, dtype, num_queries, dim)."""
    if _buffers.is_tensor(queries) or _buffers._has_buffer(queries):
        q, qdt = _buffers.float_array(queries, "queries", dtype=query_dtype)
        if q.is_tensor or len(q.shape) > 1:
            if len(q.shape) not in (1, 2):
                raise ValueError("queries has shape %s; expected [num_queries, dim] or [dim]"
                                 % _buffers.shape_str(q.shape))
            dim = q.shape[-1]
            nq = q.shape[0] if len(q.shape) == 2 else 1
        elif dim <= 0:
            nq = 0 if q.numel == 0 else 1
            dim = q.numel
        elif q.numel % dim:
            raise ValueError("queries has %d values, not a whole number of rows of embedding_dim %d" % (q.numel, dim))
        else:
            nq = q.numel // dim
    else:
        rows = [list(r) for r in queries] if not _is_flat(queries) else [list(queries)]
        nq = len(rows)
        if nq:
            dim = len(rows[0])
            if any(len(r) != dim for r in rows):
                raise ValueError("queries: rows of different lengths")
        q, qdt = _buffers.float_array([x for r in rows for x in r], "queries")
    return q, qdt, nq, dim


class Store(Handle):
    """kvi_store: facts keyed by (tenant, fact id), each T tokens of pre-RoPE K and V
    for every layer and local head, plus an optional embedding.

    ``Store(model, budget_bytes, backend=..., device=..., dtype=..., page_tokens=...,
    embedding_dim=..., embedding_dtype=..., metric=..., host_budget_bytes=...)``; options left None take
    the library's defaults (KVI_STORE_OPTIONS_INIT: AUTO backend, the current
    device, BF16 storage, 16-token pages, no embeddings, FP32 embeddings, inner
    product). ``dtype=DType.FP8_E4M3`` keeps K and V as e4m3 with a scale per
    (page, layer, K/V, head), keys also with an fp16 offset per channel of each page
    (kvinject/store.h, "fp8 storage"): about half the bytes of bf16; ``dtype=DType.Q4`` keeps 4-bit codes with fp16 scales and minima, keys per channel over a
    page's tokens, values per token: 1/4 + 1/page_tokens + 1/head_size of bf16
    (kvinject/store.h, "4-bit storage"); puts and reads still take
    fp32/fp16/bf16 tensors. ``host_budget_bytes`` (CUDA stores) adds a tier of pinned
    host pages (kvinject/store.h, Tiers; :meth:`prefetch`). Every method may be called from several threads at once (the C
    store has a lock); close() must not overlap them.

    The disk tier (kvinject/store.h, "Disk tier"): ``disk_dir`` (str, bytes or
    os.PathLike; an existing, writable directory) keeps one file per tenant,
    ``<disk_dir>/<tenant hex>.kvi``, written through on every put, remove and
    Encoder.encode; the memory tiers (``budget_bytes``, ``host_budget_bytes``)
    become an LRU cache of those files: facts that do not fit are dropped from
    memory and read back when used (an injection reads them back synchronously;
    :meth:`prefetch` moves a tenant up ahead of use, and loads a tenant that
    another store sharing the directory wrote). :meth:`fact_tier` says where a
    fact is now (:class:`~kvinject.Tier`). ``disk_budget_bytes``: the bytes of
    tenant files this store may hold (0, the default: no limit but the file
    system's). Stores of several processes (replicas) may share one directory:
    a write of a tenant takes that tenant's ownership lease for
    ``disk_lease_ms`` (default 30000), named ``disk_owner`` (default
    "<hostname>:<pid>"); a write while another store holds it raises
    :class:`~kvinject.LeasedError`. :meth:`tenant_release` gives a lease up at once.
    """

    _destroy = "kvi_store_destroy"

    def __init__(self, model: Model, budget_bytes: int, *, backend: Optional[Backend] = None,
                 device: Optional[int] = None, dtype: Optional[DType] = None, page_tokens: Optional[int] = None,
                 embedding_dim: Optional[int] = None, embedding_dtype: Optional[DType] = None,
                 metric: Optional[Metric] = None, host_budget_bytes: Optional[int] = None, comm=None,
                 embedding_placement: Optional[EmbeddingPlacement] = None, disk_dir: Optional[PathLike] = None,
                 disk_budget_bytes: int = 0, disk_owner: Optional[str] = None, disk_lease_ms: Optional[int] = None):
        o = _store_options(budget_bytes, backend, device, dtype, page_tokens, embedding_dim, embedding_dtype,
                           metric, host_budget_bytes, comm, embedding_placement, disk_dir, disk_budget_bytes,
                           disk_owner, disk_lease_ms)
        h = ctypes.c_void_p()
        lib().call("kvi_store_create", ctypes.byref(h), model.handle, ctypes.byref(o))
        self._adopt(h, model, comm)
        self.has_disk_tier = disk_dir is not None

    def _adopt(self, h, model: Model, comm) -> None:
        self._h = h
        #: whether its calls may read facts back from disk (injections then release the GIL)
        self.has_disk_tier = False
        self._dependents = weakref.WeakSet()
        self.comm = comm  # the C store borrows it: it must stay alive
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.num_heads = model.local_heads
        self.head_size = model.head_size
        st = self.stats()
        self.backend, self.device, self.dtype = st.backend, st.device, st.dtype
        self.page_tokens, self.embedding_dim = st.page_tokens, st.embedding_dim

    @classmethod
    def load(cls, model: Model, path: PathLike, budget_bytes: int, *, journal: bool = False,
             **options) -> "Store":
        """kvi_store_load: a new store (options as for ``Store(model, budget_bytes, ...)``)
        filled with the facts of the store file ``path`` (str, bytes or os.PathLike),
        one :meth:`save` wrote or a journal. The model's geometry, tp slice and every
        layer's RoPE, and the options' dtype and embedding_dim, must equal the
        file's; backend, device, page_tokens and budget_bytes are free (the budget must
        hold the facts; an fp8 file loads only with its page_tokens). journal:
        KVI_LOAD_JOURNAL, keep the file as the new store's journal (see
        :meth:`journal_open`). Raises NotFoundError (no file), CorruptError (not a
        store file, truncated, a checksum mismatch), IncompatibleError (another
        geometry, RoPE, dtype or embedding size: the message names the field and both
        values), CapacityError (the facts do not fit budget_bytes), IOError_."""
        comm = options.get("comm")
        o = _store_options(budget_bytes, **options)
        lo = lib().new(LoadOptionsC)
        lo.flags = LOAD_JOURNAL if journal else 0
        h = ctypes.c_void_p()
        lib().call("kvi_store_load", ctypes.byref(h), model.handle, ctypes.byref(o), _path(path), ctypes.byref(lo))
        self = cls.__new__(cls)
        self._adopt(h, model, comm)
        return self

    def save(self, path: PathLike, *, tenant: Optional[int] = None) -> None:
        """kvi_store_save: writes a snapshot of every fact (or one tenant's) to ``path``
        (str, bytes or os.PathLike) atomically: a temporary file beside it, renamed over
        it and flushed, so a reader sees the old file or the new one. On an error
        ``path`` is as it was and the temporary file is removed (IOError_ naming the
        call and the system error; also when ``path`` is an open store's journal),
        except when only the final directory flush failed: the new file is then in
        place. A tenant with no facts gives a valid file with no facts."""
        so = lib().new(SaveOptionsC)
        if tenant is not None:
            so.flags = SAVE_ONE_TENANT
            assign(so, tenant=tenant)
        lib().call("kvi_store_save", self.handle, _path(path), ctypes.byref(so))

    def journal_open(self, path: PathLike) -> None:
        """kvi_store_journal_open: makes the store durable in ``path``: writes a snapshot
        (as :meth:`save`), then keeps the file open and locked as the journal. From then
        on every successful put, remove and Encoder.encode on the store is in the file
        before the call returns (an encode's captures as one all-or-nothing group); a
        change that cannot be written fails with IOError_ and changes nothing. Opening
        again switches to another file, or compacts the same one. :meth:`load` with
        ``journal=True`` continues a journal. IOError_ also when ``path`` is another
        store's journal; on error the previous journal, if any, stays."""
        lib().call("kvi_store_journal_open", self.handle, _path(path), 0)

    def journal_close(self) -> None:
        """kvi_store_journal_close: stops journaling (later changes are not written); the
        file stays a valid store file holding every acknowledged change. A store
        without a journal is left as it is; :meth:`close` closes the journal too."""
        lib().call("kvi_store_journal_close", self.handle)

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Frees the store; injectors and encoders made from it are closed first
        (the C store must outlive them). Work enqueued on streams that touches the
        store must be complete. Idempotent."""
        if getattr(self, "_h", None):
            for d in list(self._dependents):
                d.close()
        super().close()

    def _add_dependent(self, obj) -> None:
        self._dependents.add(obj)

    # ---------------------------------------------------------------- views
    def _view(self, k, v, what: str, *, writable: bool, dtype, num_tokens: Optional[int], heads: Optional[int] = None):
        if isinstance(k, KVView):
            if v is not None:
                raise TypeError("%s: pass either a KVView or k and v arrays" % what)
            return k.to_c(), k.keep
        if k is None or v is None:
            raise TypeError("%s: both k and v are needed" % what)
        a = _buffers.as_array(k, what + " k", writable=writable, dtype=dtype)
        b = _buffers.as_array(v, what + " v", writable=writable, dtype=dtype)
        if a.kind != b.kind:
            raise TypeError("%s: k is %s and v is %s; they must have the same dtype" % (what, a.kind, b.kind))
        if (a.memory, a.device) != (b.memory, b.device):
            raise ValueError("%s: k and v are on different devices" % what)
        kvi_dtype = _buffers.kind_dtype(a.kind, what)
        L, H, D = self.num_layers, self.num_heads if heads is None else heads, self.head_size
        if len(a.shape) == 4 or a.is_tensor:
            if len(a.shape) != 4:
                raise ValueError("%s: k has shape %s; expected [layers, tokens, heads, head_size] (4 dims)"
                                 % (what, _buffers.shape_str(a.shape)))
            if a.shape != b.shape:
                raise ValueError("%s: k has shape %s and v %s; they must be equal"
                                 % (what, _buffers.shape_str(a.shape), _buffers.shape_str(b.shape)))
            if a.strides != b.strides:
                raise ValueError("%s: k has strides %s and v %s; a view has one set of strides for both"
                                 % (what, a.strides, b.strides))
            if a.strides[3] != 1 and a.shape[3] != 1:
                raise ValueError("%s: head vectors must be contiguous (the last stride is %d, not 1)"
                                 % (what, a.strides[3]))
            shape, strides = a.shape, a.strides
            if num_tokens is not None and num_tokens != shape[1]:
                raise ValueError("%s: num_tokens is %d but the arrays hold %d tokens" % (what, num_tokens, shape[1]))
        else:
            n = a.numel
            if b.numel != n:
                raise ValueError("%s: k has %d elements and v %d; they must be equal" % (what, n, b.numel))
            per_token = L * H * D
            if num_tokens is None:
                if n % per_token or n == 0:
                    raise ValueError("%s: %d elements is not a whole number of tokens of %d layers x %d heads "
                                     "x %d (pass num_tokens, or [L, T, H, D] arrays)" % (what, n, L, H, D))
                num_tokens = n // per_token
            elif num_tokens * per_token > n:
                raise ValueError("%s: %d tokens need %d elements, the buffers hold %d"
                                 % (what, num_tokens, num_tokens * per_token, n))
            shape = (L, num_tokens, H, D)
            strides = (num_tokens * H * D, H * D, D, 1)
        c = lib().new(KVViewC)
        c.memory, c.dtype = int(a.memory), int(kvi_dtype)
        assign(c, num_layers=shape[0], num_tokens=shape[1], num_heads=shape[2], head_size=shape[3],
               layer_stride=strides[0], token_stride=strides[1], head_stride=strides[2], k=a.ptr, v=b.ptr)
        return c, (a, b)

    # ---------------------------------------------------------------- facts
    def put(self, tenant: int, fact_id: int, k: Union[ArrayLike, KVView], v: Optional[ArrayLike] = None, *,
            embedding: Optional[FloatArrayLike] = None, embedding_dtype: Optional[DType] = None,
            replace: bool = False, dtype: Optional[DType] = None, num_tokens: Optional[int] = None,
            stream: StreamLike = None, token_ids: Optional[IntArrayLike] = None,
            context_ids: Optional[IntArrayLike] = None) -> None:
        """kvi_store_put: stores a fact's pre-RoPE K and V.

        k, v: tensors of shape [layers, tokens, heads, head_size] (any strides
        with contiguous head vectors; the same strides for both), or host
        buffers holding that shape contiguously (the token count is inferred,
        or ``num_tokens``), or ``k`` a :class:`KVView` and ``v`` omitted.
        ``dtype`` names the element type of raw buffers (bf16 in a uint16
        buffer). embedding: required when the store keeps embeddings: a
        sequence of floats, or a buffer/tensor (host or device) of fp32, fp16
        or bf16. replace: KVI_PUT_REPLACE. stream: see :func:`stream` rules
        (None = the default stream). token_ids (experimental): the fact's token
        ids, one int32 per token (ints, a host buffer or a CPU tensor), kept with
        it (:meth:`fact_token_ids`); None: none. context_ids (experimental): the
        ids of the tenant's facts that were in context when k and v were
        computed (each stored; not fact_id): removing one of them makes this
        fact stale (:meth:`stale`); None: none.
        """
        view, keep = self._view(k, v, "put", writable=False, dtype=dtype, num_tokens=num_tokens)
        L = lib()
        po = L.new(PutOptions)
        po.flags = PUT_REPLACE if replace else 0
        emb = None
        if embedding is not None:
            emb, edt = _buffers.float_array(embedding, "embedding", dtype=embedding_dtype)
            _check_embedding(emb, self.embedding_dim, "embedding")
            po.embedding = emb.ptr
            po.embedding_dtype = int(edt)
            po.embedding_memory = int(emb.memory)
        tk = None
        if token_ids is not None:
            tk = _buffers.int_array(token_ids, ctypes.c_int32, "token_ids")
            if tk.numel != view.num_tokens:
                raise ValueError("token_ids has %d ids for %d tokens" % (tk.numel, view.num_tokens))
            po.token_ids = tk.ptr
        ctx = None
        if context_ids is not None:
            ctx = _buffers.int_array(context_ids, ctypes.c_uint64, "context_ids")
            po.context_ids = ctx.ptr
            po.num_context_ids = fit(ctx.numel, ctypes.c_int32, "len(context_ids)")
        L.call("kvi_store_put", self.handle, fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id"),
               ctypes.byref(view), ctypes.byref(po), _buffers.stream_handle(stream))
        del keep, emb, tk, ctx

    def read(self, tenant: int, fact_id: int, k: Union[ArrayLike, KVView, None] = None, v: Optional[ArrayLike] = None,
             *, dtype: Optional[DType] = None, stream: StreamLike = None):
        """kvi_store_read: copies a fact's K and V into k and v (tensors or writable
        buffers shaped as for :meth:`put`, or a KVView as k) and returns (k, v).
        Without outputs it allocates host arrays of [layers, tokens, heads,
        head_size] elements, flat: array('f') for fp32 (the default dtype),
        array('H') holding the raw bits for fp16/bf16."""
        if k is None and v is None:
            dtype = DType.FP32 if dtype is None else DType(dtype)
            t = self.fact_tokens(tenant, fact_id)
            n = self.num_layers * t * self.num_heads * self.head_size
            k, v = _alloc(dtype, n), _alloc(dtype, n)
        view, keep = self._view(k, v, "read", writable=True, dtype=dtype, num_tokens=None)
        lib().call("kvi_store_read", self.handle, fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id"),
                   ctypes.byref(view), _buffers.stream_handle(stream))
        del keep
        return k, v

    # ------------------------------------------------- tensor parallelism
    def put_scatter(self, root: int, items: Sequence, *, stream: StreamLike = None) -> None:
        """kvi_store_put_scatter (collective, kvinject/comm.h): every rank passes the
        same (tenant, fact_id) list; on ``root`` each item is (tenant, fact_id, k, v)
        or (tenant, fact_id, k, v, embedding) or (tenant, fact_id, k, v, embedding,
        token_ids) (embedding None without embeddings; token_ids experimental: one
        int32 per token, kept by every rank) with every KV head ([layers, tokens,
        num_kv_heads, head_size]); elsewhere (tenant, fact_id). Each rank keeps its
        heads. All items or none."""
        L = lib()
        arr = (ScatterItemC * max(len(items), 1))()
        views, opts, keep = [], [], []
        for i, it in enumerate(items):
            c = L.new(ScatterItemC)
            assign(c, tenant=it[0], fact_id=it[1])
            if len(it) > 2:
                view, kp = self._view(it[2], it[3], "put_scatter", writable=False, dtype=None, num_tokens=None,
                                      heads=self.num_kv_heads)
                views.append(view)
                keep.append(kp)
                c.full = ctypes.cast(ctypes.pointer(view), ctypes.c_void_p)
                emb_given = len(it) > 4 and it[4] is not None
                ids_given = len(it) > 5 and it[5] is not None
                if emb_given or ids_given:
                    po = L.new(PutOptions)
                    if emb_given:
                        emb, edt = _buffers.float_array(it[4], "items[%d] embedding" % i)
                        _check_embedding(emb, self.embedding_dim, "embedding")
                        po.embedding, po.embedding_dtype, po.embedding_memory = emb.ptr, int(edt), int(emb.memory)
                        keep.append(emb)
                    if ids_given:
                        tk = _buffers.int_array(it[5], ctypes.c_int32, "items[%d] token_ids" % i)
                        if tk.numel != view.num_tokens:
                            raise ValueError("items[%d]: %d token ids for %d tokens" % (i, tk.numel, view.num_tokens))
                        po.token_ids = tk.ptr
                        keep.append(tk)
                    opts.append(po)
                    c.opts = ctypes.cast(ctypes.pointer(po), ctypes.c_void_p)
            arr[i] = c
        L.call("kvi_store_put_scatter", self.handle, fit(root, ctypes.c_int32, "root"), arr,
               fit(len(items), ctypes.c_int32, "items"),
               _buffers.stream_handle(stream))
        del views, opts, keep

    def gather(self, root: int, items: Sequence, *, dtype: Optional[DType] = None, stream: StreamLike = None) -> list:
        """kvi_store_gather (collective): every rank passes the same (tenant, fact_id)
        list; returns, on ``root``, one (k, v) pair per item with every KV head (flat
        host arrays as :meth:`read` allocates, fp32 by default), and on the other ranks
        an empty list."""
        L = lib()
        dtype = DType.FP32 if dtype is None else DType(dtype)
        is_root = self.comm is not None and self.comm.rank == root
        arr = (GatherItemC * max(len(items), 1))()
        views, out = [], []
        for i, (tenant, fact_id) in enumerate(items):
            c = L.new(GatherItemC)
            assign(c, tenant=tenant, fact_id=fact_id)
            if is_root:
                n = self.num_layers * self.fact_tokens(tenant, fact_id) * self.num_kv_heads * self.head_size
                k, v = _alloc(dtype, n), _alloc(dtype, n)
                view, _ = self._view(k, v, "gather", writable=True, dtype=dtype, num_tokens=None,
                                     heads=self.num_kv_heads)
                views.append(view)
                out.append((k, v))
                c.full = ctypes.cast(ctypes.pointer(view), ctypes.c_void_p)
            arr[i] = c
        L.call("kvi_store_gather", self.handle, fit(root, ctypes.c_int32, "root"), arr,
               fit(len(items), ctypes.c_int32, "items"),
               _buffers.stream_handle(stream))
        del views
        return out

    def check_agreement(self) -> None:
        """kvi_store_check_agreement (collective): raises MismatchError when the ranks
        hold different facts."""
        lib().call("kvi_store_check_agreement", self.handle)

    def fact_token_ids(self, tenant: int, fact_id: int) -> Tuple[List[int], int]:
        """kvi_store_fact_token_ids (experimental): the fact's token ids and their hash
        (FNV-1a 64 over the ids as little-endian int32); ([], 0) for a fact stored
        without token ids."""
        t, f = fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id")
        cap = self.fact_tokens(tenant, fact_id)
        buf = (ctypes.c_int32 * max(cap, 1))()
        n, h = ctypes.c_int32(), ctypes.c_uint64()
        lib().call("kvi_store_fact_token_ids", self.handle, t, f, buf, cap, ctypes.byref(n), ctypes.byref(h))
        return list(buf[:n.value]), h.value

    def fact_tokens(self, tenant: int, fact_id: int) -> int:
        """kvi_store_fact_tokens."""
        n = ctypes.c_int32()
        lib().call("kvi_store_fact_tokens", self.handle, fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id"),
                   ctypes.byref(n))
        return n.value

    def get_embedding(self, tenant: int, fact_id: int) -> "array.array":
        """kvi_store_get_embedding: the embedding as kept (scaled for cosine, rounded to
        embedding_dtype), as array('f') of embedding_dim values."""
        n = max(self.embedding_dim, 1)
        out = (ctypes.c_float * n)()
        lib().call("kvi_store_get_embedding", self.handle, fit(tenant, U64, "tenant"),
                   fit(fact_id, U64, "fact_id"), out)
        return array.array("f", out[:self.embedding_dim])

    def remove(self, tenant: int, fact_id: int, *, keep_dependents: bool = False) -> None:
        """kvi_store_remove: removes the fact and makes stale the tenant's facts
        computed with it in context, transitively (see :meth:`stale`).
        keep_dependents (experimental; kvi_store_remove_ex with
        KVI_REMOVE_KEEP_DEPENDENTS): remove the fact alone."""
        t, f = fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id")
        if keep_dependents:
            lib().call("kvi_store_remove_ex", self.handle, t, f, REMOVE_KEEP_DEPENDENTS)
        else:
            lib().call("kvi_store_remove", self.handle, t, f)

    def fact_context(self, tenant: int, fact_id: int) -> Tuple[List[int], bool]:
        """kvi_store_fact_context (experimental): the fact's context ids, in the
        order given, and whether it is stale."""
        t, f = fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id")
        n, st = ctypes.c_int32(), ctypes.c_int32()
        cap, buf = 0, None
        while True:
            try:
                lib().call("kvi_store_fact_context", self.handle, t, f, buf, cap, ctypes.byref(n), ctypes.byref(st))
                return (list(buf[:n.value]) if buf is not None else []), bool(st.value)
            except CapacityError:
                cap = n.value  # the fact may be replaced by another thread in between
                buf = (ctypes.c_uint64 * max(cap, 1))()

    def stale(self, tenant: int) -> List[int]:
        """kvi_store_stale (experimental): the tenant's stale facts, ascending: those
        computed with a fact in context that has since been removed. Injections and
        retrievals refuse them (:class:`StaleFactError`); put or capture them again
        with ``replace=True`` (and a context of fresh facts) or remove them."""
        return self._ids("kvi_store_stale", tenant)

    def list_on_disk(self, tenant: int) -> List[int]:
        """kvi_store_list_on_disk: the tenant's facts that are only on disk (what
        :meth:`fact_tier` reports as :attr:`Tier.DISK`), ascending, in one call; [] without
        a disk tier."""
        return self._ids("kvi_store_list_on_disk", tenant)

    def _ids(self, fn: str, tenant: int) -> List[int]:
        """A listing call's ids (kvi_store_list, _stale, _list_on_disk), sized by its total."""
        total = ctypes.c_size_t()
        cap = 0
        buf = None
        while True:
            lib().call(fn, self.handle, fit(tenant, U64, "tenant"), buf, cap, ctypes.byref(total))
            if total.value <= cap:
                return list(buf[:total.value]) if buf is not None else []
            cap = total.value + 16  # facts may be added by other threads in between
            buf = (ctypes.c_uint64 * cap)()

    def prefetch(self, tenant: int, fact_ids: Optional[IntArrayLike] = None, stream: StreamLike = None) -> None:
        """kvi_store_prefetch: start moving the facts (all of the tenant's for None) to the
        device tier; returns without waiting. A no-op for a store without a host tier or a
        disk tier. With a disk tier, the facts that are only on disk start to be read back
        (as many as fit, in order) on the store's I/O thread; for None, a tenant the store
        does not have, or whose file another store changed, is first indexed from its file
        (synchronously; this is how a store learns of a tenant another replica wrote), then
        as many of its facts as fit start to be read back, most recently written first. A
        call that needs a fact being read waits for it; :meth:`fact_tier` says DISK until
        the read is published (:meth:`prefetch_wait`)."""
        if fact_ids is None:
            lib().call("kvi_store_prefetch", self.handle, fit(tenant, U64, "tenant"), None, 0,
                       _buffers.stream_handle(stream))
            return
        ids = _buffers.int_array(fact_ids, ctypes.c_uint64, "fact_ids")
        lib().call("kvi_store_prefetch", self.handle, fit(tenant, U64, "tenant"), ids.c_ptr(),
                   fit(ids.numel, ctypes.c_int32, "count"), _buffers.stream_handle(stream))

    def prefetch_wait(self) -> None:
        """kvi_store_prefetch_wait: waits until every read back :meth:`prefetch` started has
        ended and publishes those the I/O thread finished, so that :meth:`fact_tier` and
        :meth:`stats` see the facts in memory (a CUDA store's reads are otherwise published
        only by the next call that needs them). Other threads' calls go on meanwhile (the
        store's lock is not held while the thread reads); ctypes lets go of the GIL."""
        lib().call("kvi_store_prefetch_wait", self.handle)

    def fact_tier(self, tenant: int, fact_id: int) -> Tier:
        """kvi_store_fact_tier: where the fact's K and V are now: :attr:`Tier.DEVICE`,
        :attr:`Tier.HOST` (a CPU store's resident facts) or :attr:`Tier.DISK` (only in the
        tenant's file of the disk tier; an injection reads it back). No device work, no
        file I/O; the answer may change at once under calls on other threads.
        Raises NotFoundError for an unknown fact."""
        t = ctypes.c_int32()
        lib().call("kvi_store_fact_tier", self.handle, fit(tenant, U64, "tenant"), fit(fact_id, U64, "fact_id"),
                   ctypes.byref(t))
        return Tier(t.value)

    def disk_changes(self) -> List[int]:
        """kvi_store_disk_changes, drained: the tenants whose disk-only facts changed
        (a fact dropped to disk, read back, indexed from its file, or removed while on
        disk) since they were last taken, oldest change first, each once; [] without a
        disk tier. The store keeps one list: the callers share it."""
        out: List[int] = []
        buf = (ctypes.c_uint64 * 256)()
        n = ctypes.c_size_t()
        while True:
            lib().call("kvi_store_disk_changes", self.handle, buf, len(buf), ctypes.byref(n))
            out.extend(buf[:n.value])
            if n.value < len(buf):
                return out

    def tenant_release(self, tenant: int) -> None:
        """kvi_store_tenant_release: gives up this store's ownership lease of ``tenant``
        (see the disk tier in the class docstring), so that another store sharing
        ``disk_dir`` may write the tenant at once. The tenant's facts stay readable
        here; the next write here takes the lease again (re-reading the file if another
        store changed it). A tenant whose lease this store does not hold, or a store
        without a disk tier: nothing is done. Raises IOError_ when the lease file could
        not be written (the lease then runs out by itself)."""
        lib().call("kvi_store_tenant_release", self.handle, fit(tenant, U64, "tenant"))

    def count(self, tenant: int) -> int:
        """kvi_store_count: facts of a tenant (0 for one never seen)."""
        n = ctypes.c_size_t()
        lib().call("kvi_store_count", self.handle, fit(tenant, U64, "tenant"), ctypes.byref(n))
        return n.value

    def list(self, tenant: int) -> List[int]:
        """kvi_store_list: the tenant's fact ids, ascending."""
        return self._ids("kvi_store_list", tenant)

    def stats(self) -> StoreStats:
        """kvi_store_stats_get."""
        s = lib().new(StoreStatsC)
        lib().call("kvi_store_stats_get", self.handle, ctypes.byref(s))
        vals = {f: getattr(s, f) for f, _ in StoreStatsC._fields_[1:]}
        vals["backend"] = Backend(vals["backend"])
        vals["dtype"] = DType(vals["dtype"])
        return StoreStats(**vals)

    # --------------------------------------------------------------- search
    def search(self, queries: FloatArrayLike, tenants: Union[int, IntArrayLike], k: int, *,
               query_dtype: Optional[DType] = None, out: Optional[Tuple[ArrayLike, ArrayLike, ArrayLike]] = None,
               workspace_bytes: Optional[int] = None, stream: StreamLike = None):
        """kvi_store_search: the top-k facts of each query's tenant.

        queries: a sequence of query vectors (sequences of floats, sent as
        fp32), or a tensor/buffer of [num_queries, dim] (or [dim] for one
        query; a flat buffer is cut into rows of the store's embedding_dim) in
        host or device memory, fp32, fp16 or bf16 (``query_dtype`` for a raw
        uint16 buffer). tenants: one tenant for every query, or one per query.
        out: None returns :class:`SearchResults` (host memory); or a tuple
        (ids, scores, counts) of tensors/buffers of [num_queries, k] uint64 or
        int64, [num_queries, k] fp32 and [num_queries] int32, all host or all
        device memory, which the search fills (device outputs are written on
        ``stream``; read them after it) and which are returned.
        """
        k = fit(k, ctypes.c_int32, "k")
        q, qdt, nq, dim = _query_array(queries, self.embedding_dim, query_dtype)
        if isinstance(tenants, int):
            t = _buffers.int_array([tenants] * nq, ctypes.c_uint64, "tenants")
        else:
            t = _buffers.int_array(tenants, ctypes.c_uint64, "tenants")
            if t.numel != nq:
                raise ValueError("%d tenants for %d queries" % (t.numel, nq))
        L = lib()
        so = L.new(SearchOptions)
        so.query_dtype = int(qdt)
        so.query_memory = int(q.memory)
        if workspace_bytes is not None:
            assign(so, workspace_bytes=workspace_bytes)
        if out is None:
            # a k the library refuses gets no nq x k allocation first
            n = max(nq * k, 1) if 0 < k <= SEARCH_MAX_K else 1
            ids, scores, counts = (ctypes.c_uint64 * n)(), (ctypes.c_float * n)(), (ctypes.c_int32 * max(nq, 1))()
            ptrs = (ids, scores, counts)
            so.out_memory = int(Memory.HOST)
        else:
            oi, os_, oc = out
            a_ids = _buffers.int_array(oi, ctypes.c_uint64, "out ids", allow_device=True, writable=True)
            a_sc = _buffers.as_array(os_, "out scores", writable=True, dtype=DType.FP32)
            if not _buffers.contiguous(a_sc):
                raise ValueError("out scores must be contiguous")
            a_ct = _buffers.int_array(oc, ctypes.c_int32, "out counts", allow_device=True, writable=True)
            mems = {(a.memory, a.device) for a in (a_ids, a_sc, a_ct)}
            if len(mems) != 1:
                raise ValueError("search outputs must all be host memory or all on one device")
            if k > 0 and (a_ids.numel < nq * k or a_sc.numel < nq * k or a_ct.numel < nq):
                raise ValueError("search outputs hold %d ids, %d scores, %d counts; %d queries x k %d need "
                                 "%d, %d, %d" % (a_ids.numel, a_sc.numel, a_ct.numel, nq, k, nq * k, nq * k, nq))
            ptrs = (a_ids.c_ptr(), a_sc.c_ptr(), a_ct.c_ptr())
            so.out_memory = int(a_ids.memory)
        i32 = ctypes.c_int32
        L.call("kvi_store_search", self.handle, q.c_ptr(), fit(nq, i32, "num_queries"), fit(dim, i32, "dim"),
               t.c_ptr(), fit(k, i32, "k"), ptrs[0], ptrs[1], ptrs[2],
               ctypes.byref(so), _buffers.stream_handle(stream))
        if out is not None:
            return out
        return SearchResults(array.array("Q", ids[:nq * k]), array.array("f", scores[:nq * k]),
                             array.array("i", counts[:nq]), k)

    def async_errors(self) -> int:
        """kvi_store_async_errors: device queries that searches found non-finite since
        the last call; raises the store's latched failure (a change to its device
        embeddings that could not be enqueued) if there is one."""
        n = ctypes.c_int64()
        lib().call("kvi_store_async_errors", self.handle, ctypes.byref(n))
        return n.value

    def __repr__(self):
        if not getattr(self, "_h", None):
            return "Store(closed)"
        return "Store(%s, device %d, %s, %d-token pages, embedding_dim %d)" % (
            self.backend.name, self.device, self.dtype.name, self.page_tokens, self.embedding_dim)


def _store_options(budget_bytes, backend=None, device=None, dtype=None, page_tokens=None, embedding_dim=None,
                   embedding_dtype=None, metric=None, host_budget_bytes=None, comm=None, embedding_placement=None,
                   disk_dir=None, disk_budget_bytes=0, disk_owner=None, disk_lease_ms=None):
    """kvi_store_options from Store's keyword arguments (None: the library's default)."""
    o = lib().new(StoreOptions)
    assign(o, budget_bytes=budget_bytes)
    if backend is not None:
        o.backend = int(Backend(backend))
    if device is not None:
        assign(o, device=device)
    if dtype is not None:
        o.dtype = int(DType(dtype))
    if page_tokens is not None:
        assign(o, page_tokens=page_tokens)
    if embedding_dim is not None:
        assign(o, embedding_dim=embedding_dim)
    if embedding_dtype is not None:
        o.embedding_dtype = int(DType(embedding_dtype))
    if metric is not None:
        o.metric = int(Metric(metric))
    if host_budget_bytes is not None:
        assign(o, host_budget_bytes=host_budget_bytes)
    if comm is not None:
        o.comm = comm.handle
    if embedding_placement is not None:
        o.embedding_placement = int(EmbeddingPlacement(embedding_placement))
    if disk_dir is not None:
        o.disk_dir = _path(disk_dir)  # the struct keeps the bytes alive; the C store copies them
    assign(o, disk_budget_bytes=disk_budget_bytes or 0)
    if disk_owner is not None:
        owner = disk_owner.encode() if isinstance(disk_owner, str) else bytes(disk_owner)
        if b"\0" in owner:
            raise ValueError("disk_owner: expected a name without NUL bytes, got %r" % (disk_owner,))
        o.disk_owner = owner
    if disk_lease_ms is not None:
        assign(o, disk_lease_ms=disk_lease_ms)
    return o


def _path(path) -> bytes:
    p = os.fsencode(path)
    if not p or b"\0" in p:
        raise ValueError("path: expected a non-empty path without NUL bytes, got %r" % (path,))
    return p


def _check_embedding(emb: Array, dim: int, what: str) -> None:
    # the C call reads embedding_dim values; a store without embeddings rejects one itself
    if dim > 0 and emb.numel != dim:
        raise ValueError("%s has %d values; the store's embedding_dim is %d" % (what, emb.numel, dim))


def _is_flat(seq) -> bool:
    """Whether a Python sequence is one vector of numbers rather than a list of rows."""
    for x in seq:
        return isinstance(x, (int, float))
    return False


NO_ID = SEARCH_NO_ID
