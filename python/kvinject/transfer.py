"""The injector and the encoder (kvinject/inject.h)."""
from __future__ import annotations

import ctypes
import dataclasses
from typing import Any, List, Optional, Sequence, Tuple, Union

from ._types import ArrayLike, FloatArrayLike, IntArrayLike, StreamLike
from . import _buffers
from ._buffers import NoKey, index_array, tensor_key
from ._lib import (CaptureC, EncodeBatchC, InjectBatchC, InjectOptions, InjectRequestC, RecomputeOptionsC,
                   RetrieveRequestC, SearchOptions,
                   TransferOptions, assign, fit, lib)
from ._handle import Handle
from .cache import CacheLayout
from .enums import PUT_REPLACE, SEARCH_MAX_K, Backend, DType, Memory
from .store import Store, _check_embedding, _query_array


@dataclasses.dataclass
class InjectRequest:
    """kvi_inject_request: a request's facts, in order, land consecutively in its
    sequence from ``first_slot`` on.

    fact_ids: ints (or a host uint64/int64 buffer). block_table: the sequence's
    int32 block ids: a sequence of ints, a host buffer, or an int32 tensor on
    the CPU or on the store's CUDA device (checked by the kernel: see
    :meth:`Injector.async_errors`). positions: one RoPE position per injected
    token (host), or None for start_position + i. expect_token_ids
    (experimental): the prompt's token ids at the injected slots, one per
    injected token (int32: ints, a host buffer or a CPU tensor); a fact whose
    stored token ids differ, or that has none, raises
    :class:`~kvinject.TokenMismatchError` and nothing is written. None: unchecked.
    """

    tenant: int
    fact_ids: IntArrayLike
    block_table: IntArrayLike
    first_slot: int = 0
    positions: Optional[IntArrayLike] = None
    start_position: int = 0
    expect_token_ids: Optional[IntArrayLike] = None


@dataclasses.dataclass
class RetrieveRequest:
    """kvi_retrieve_request: where one query's retrieved facts go (see
    :meth:`Injector.retrieve_inject`). best_last: KVI_RETRIEVE_BEST_LAST."""

    tenant: int
    block_table: IntArrayLike
    first_slot: int = 0
    start_position: int = 0
    best_last: bool = False


@dataclasses.dataclass
class Capture:
    """kvi_capture: one fact to capture: ``num_tokens`` tokens of a sequence from
    ``first_slot`` on, whose keys the engine wrote rotated at ``positions``
    (None: start_position + i). block_table: host int32 (ints, a buffer or a
    CPU tensor). embedding: as :meth:`Store.put`. token_ids (experimental):
    the captured slots' token ids, ``num_tokens`` int32, kept with the fact
    (:meth:`Store.fact_token_ids`); None: none. context_ids (experimental):
    the ids of the tenant's facts whose K and V were in context when the
    captured slots were computed (each stored, or captured earlier in the
    same call), as :meth:`Store.put`'s; None: none."""

    tenant: int
    fact_id: int
    block_table: IntArrayLike
    num_tokens: int
    first_slot: int = 0
    positions: Optional[IntArrayLike] = None
    start_position: int = 0
    replace: bool = False
    embedding: Optional[FloatArrayLike] = None
    embedding_dtype: Optional[DType] = None
    token_ids: Optional[IntArrayLike] = None
    context_ids: Optional[IntArrayLike] = None


def _batch_indices(b, n: int, noun: str, block_tables, block_table_offsets, tenants, tenant, first_slots,
                   start_positions, positions, has_tokens) -> Tuple[list, list]:
    """The fields both batched calls take alike (CSR block-table offsets, tenants,
    first slots, positions) into struct b for n entries; returns the arrays read
    (the caller keeps them alive through the C call) and the bounds of the host
    CSR offsets (:func:`_buffers.csr_bounds`). block_tables: the resolved table
    the offsets index; has_tokens(): whether the call has tokens (None: unknown),
    asked only of an empty positions array."""
    made, bounds = [], []
    if block_table_offsets is not None:
        bo = index_array(block_table_offsets, ("i32",), "block_table_offsets")
        if bo.numel != n + 1:
            raise ValueError("block_table_offsets has %d entries for %d %s" % (bo.numel, n, noun))
        bd = _buffers.csr_bounds(bo, "block_table_offsets", block_tables.numel, "block_tables")
        if bd is not None:
            bounds.append(bd)
        b.block_table_offsets = bo.ptr
        made.append(bo)
    if tenants is not None:
        tn = index_array(tenants, ("u64", "i64"), "tenants")
        if tn.numel != n:
            raise ValueError("tenants has %d entries for %d %s" % (tn.numel, n, noun))
        b.tenants = tn.ptr
        made.append(tn)
    else:
        b.tenant = fit(tenant, ctypes.c_uint64, "tenant")
    if first_slots is not None:
        fs = index_array(first_slots, ("i64",), "first_slots")
        if fs.numel != n:
            raise ValueError("first_slots has %d entries for %d %s" % (fs.numel, n, noun))
        b.first_slots = fs.ptr
        made.append(fs)
    if start_positions is not None and positions is not None:
        raise ValueError("give start_positions or positions, not both")
    if start_positions is not None:
        sp = index_array(start_positions, ("i32", "i64"), "start_positions")
        if sp.numel != n:
            raise ValueError("start_positions has %d entries for %d %s" % (sp.numel, n, noun))
        b.start_positions, b.position_bits = sp.ptr, 64 if sp.kind == "i64" else 32
        made.append(sp)
    if positions is not None:
        ps = index_array(positions, ("i32", "i64"), "positions")
        if ps.numel > 0:
            b.positions, b.position_bits = ps.ptr, 64 if ps.kind == "i64" else 32
            b.num_positions = fit(ps.numel, ctypes.c_int64, "positions")
        elif has_tokens() is not False:
            # num_positions 0 would have the library trust positions to hold one per token
            raise ValueError("positions is empty; the %s have tokens: give one position per token, or None" % noun)
        made.append(ps)
    return made, bounds


def _two_d_table(bt, n: int, what: str) -> Tuple[int, int]:
    """A 2-D block table's (row stride, entries per row) for the C struct: rows that
    overlap (a stride below the row's length: a broadcast tensor) are refused, as
    the C struct's stride is the distance rows are apart."""
    if n > 1 and bt.row_stride < bt.cols:
        raise ValueError("%s: rows %d entries apart overlap rows of %d entries" % (what, bt.row_stride, bt.cols))
    stride = bt.row_stride if n > 1 else bt.cols
    return fit(max(stride, bt.cols, 1), ctypes.c_int64, what), fit(bt.cols, ctypes.c_int32, what)


def _request_array(requests):
    """kvi_inject_request structs of InjectRequests, and what must stay alive while
    the C call reads them. A request's expect_token_ids go with their count
    (num_expect_token_ids), which the library checks against the facts' tokens."""
    if isinstance(requests, InjectRequest):
        requests = [requests]
    requests = list(requests)
    L = lib()
    arr = (InjectRequestC * max(len(requests), 1))()
    keep: List[Any] = []
    for i, r in enumerate(requests):
        if not isinstance(r, InjectRequest):
            raise TypeError("requests[%d]: expected a kvinject.InjectRequest, got %s" % (i, type(r).__name__))
        c = L.new(InjectRequestC)
        assign(c, tenant=r.tenant)
        ids = _buffers.int_array(r.fact_ids, ctypes.c_uint64, "requests[%d].fact_ids" % i)
        assign(c, fact_ids=ids.ptr, num_facts=ids.numel)
        bt = _buffers.int_array(r.block_table, ctypes.c_int32, "requests[%d].block_table" % i,
                                allow_device=True)
        assign(c, block_table=bt.ptr, block_table_len=bt.numel, block_table_memory=int(bt.memory),
               first_slot=r.first_slot, start_position=r.start_position)
        if r.positions is not None:
            pos = _buffers.int_array(r.positions, ctypes.c_int32, "requests[%d].positions" % i)
            # the library checks the count against the request's tokens; a count of
            # 0 would have it trust positions to hold one per token
            if pos.numel > 0:
                c.positions = pos.ptr
                c.num_positions = fit(pos.numel, ctypes.c_int32, "requests[%d].positions" % i)
            elif ids.numel > 0:
                raise ValueError("requests[%d].positions is empty; give one position per token, or None" % i)
            keep.append(pos)
        if r.expect_token_ids is not None:
            et = _buffers.int_array(r.expect_token_ids, ctypes.c_int32, "requests[%d].expect_token_ids" % i)
            if et.numel == 0 and ids.numel > 0:
                # a count of 0 would have the library trust the array to hold one id per token
                raise ValueError("requests[%d].expect_token_ids is empty; give one id per token, or None" % i)
            c.expect_token_ids = et.ptr
            c.num_expect_token_ids = et.numel
            keep.append(et)
        keep += [ids, bt]
        arr[i] = c
    return arr, len(requests), keep


def recompute_select(scores, fact_tokens, *, fraction: float = 0.0, per_fact: bool = False,
                     boundary: int = 0) -> List[int]:
    """kvi_recompute_select (kvinject/recompute.h): the ascending token indices to
    compute again: every fact's first ``boundary`` tokens, then the best-scored
    floor(fraction * T + 0.5) of the rest (of each fact with ``per_fact``). scores:
    host float32 buffer/tensor or a sequence of floats, one per token; fact_tokens:
    token counts, in injection order."""
    tok = _buffers.int_array(fact_tokens, ctypes.c_int32, "fact_tokens")
    counts = (ctypes.c_int32 * max(tok.numel, 1)).from_address(tok.ptr) if tok.numel else []
    T = sum(int(c) for c in counts[:tok.numel])
    sc, _ = _buffers.float_array(scores, "scores", dtype=DType.FP32, allow_device=False)
    total = sc.numel
    if total < T:
        raise ValueError("%d scores for %d tokens" % (total, T))
    L = lib()
    o = L.new(RecomputeOptionsC)
    o.fraction, o.per_fact = float(fraction), 1 if per_fact else 0
    o.boundary = fit(boundary, ctypes.c_int32, "boundary")
    out = (ctypes.c_int32 * max(T, 1))()
    n = ctypes.c_int64()
    L.call("kvi_recompute_select", sc.c_ptr(), tok.c_ptr(), fit(tok.numel, ctypes.c_int32, "num_facts"), ctypes.byref(o),
           out, fit(T, ctypes.c_int64, "fact_tokens"), ctypes.byref(n))
    del sc, tok
    return list(out[:n.value])


def _transfer_options(max_tokens_per_call, max_requests_per_call, max_table_entries_per_call):
    o = lib().new(TransferOptions)
    if max_tokens_per_call is not None:
        assign(o, max_tokens_per_call=max_tokens_per_call)
    if max_requests_per_call is not None:
        assign(o, max_requests_per_call=max_requests_per_call)
    if max_table_entries_per_call is not None:
        assign(o, max_table_entries_per_call=max_table_entries_per_call)
    return o


class _Transfer(Handle):
    _create = ""

    def __init__(self, store: Store, layout: CacheLayout, *, max_tokens_per_call: Optional[int] = None,
                 max_requests_per_call: Optional[int] = None, max_table_entries_per_call: Optional[int] = None):
        if not isinstance(layout, CacheLayout):
            raise TypeError("layout: expected a kvinject.CacheLayout, got %s" % type(layout).__name__)
        o = _transfer_options(max_tokens_per_call, max_requests_per_call, max_table_entries_per_call)
        h = ctypes.c_void_p()
        lib().call(self._create, ctypes.byref(h), store.handle, ctypes.byref(layout.c), ctypes.byref(o))
        self._h = h
        # the C handle needs the store, and the cache memory the layout points into
        self.store = store
        self.layout = layout
        store._add_dependent(self)

    def _enqueues_only(self) -> bool:
        """Whether an injection's C call only enqueues device work (a CUDA store without
        a disk tier): it then keeps the GIL (kvinject._lib: _GIL_TWINS), which a call
        that does the copy itself (a CPU store) or may read from disk releases."""
        return self.store.backend == Backend.CUDA and not self.store.has_disk_tier

    @property
    def handle(self) -> ctypes.c_void_p:
        """The C pointer; ValueError once closed, StaleLayoutError for a stale layout
        (:meth:`CacheLayout.check`)."""
        h = super().handle
        self.layout.check()
        return h



class Injector(_Transfer):
    """kvi_injector: writes a store's facts into the cache a :class:`CacheLayout`
    describes, keys rotated at their destination positions.

    ``Injector(store, layout, max_tokens_per_call=None, max_requests_per_call=None,
    max_table_entries_per_call=None)``. Keeps the store and the layout (and so
    the cache tensors) alive. Usable from several threads (calls serialize).
    :meth:`inject` and :meth:`inject_batch` keep the GIL on a CUDA store without
    a disk tier (their C call only enqueues device work, and a call that
    released the GIL would wait to take it back behind any other Python thread)
    and release it on a CPU store (the call does the copy) and on a disk-tier
    store (the call may read facts back); :meth:`plan` keeps it on any store
    without a disk tier.
    close() (or garbage collection) frees the C handle, whose enqueued work must
    be complete (kvinject/inject.h): keep the injector until the stream has
    passed it.
    """

    _create, _destroy = "kvi_injector_create", "kvi_injector_destroy"

    def inject(self, requests: Union[InjectRequest, Sequence[InjectRequest]], *, layer_begin: int = 0,
               layer_end: int = 0, stream: StreamLike = None) -> None:
        """kvi_inject: writes every request's facts (one fused launch on a CUDA store).
        layer_begin/layer_end: write layers [begin, end) (end 0 = all). stream:
        None (default stream), an int handle or a torch.cuda.Stream; host arrays
        may be reused when this returns."""
        arr, nreq, keep = _request_array(requests)
        L = lib()
        o = L.new(InjectOptions)
        assign(o, layer_begin=layer_begin, layer_end=layer_end)
        L.call("kvi_inject", self.handle, arr, fit(nreq, ctypes.c_int32, "num_requests"), ctypes.byref(o),
               _buffers.stream_handle(stream), keep_gil=self._enqueues_only())
        del keep

    def inject_batch(self, fact_ids, block_tables, *, fact_offsets=None, tenant: int = 0, tenants=None,
                     block_table_offsets=None, first_slots=None, start_positions=None, positions=None,
                     out_tokens=None, layer_begin: int = 0, layer_end: int = 0, stream=None,
                     expect_token_ids=None, expect_token_offsets=None) -> None:
        """kvi_inject_batched: a whole batch from flat arrays in one call (no struct,
        no loop per request). Arrays: torch tensors, objects with
        __cuda_array_interface__, host buffers (numpy, array.array, ctypes) or
        sequences of ints.

        fact_ids: uint64/int64, CSR by ``fact_offsets`` (int32, num_requests + 1),
        or a 2-D [num_requests, k] array without offsets (row r is request r's,
        e.g. Store.search's device ids: KVI_SEARCH_NO_ID entries are skipped).
        Device fact ids are looked up on the device (see the C header: CUDA stores
        with embeddings and no host tier; start positions only).
        block_tables: int32, a 2-D [num_requests, max_blocks] array (vLLM's
        block_table; rows any stride apart), or 1-D CSR pages with
        ``block_table_offsets`` (FlashInfer's kv_indices / kv_indptr).
        tenants: uint64/int64 per request, or None for ``tenant``. first_slots:
        int64 per request (None: 0). start_positions (per request) or positions
        (one per injected token of the call, request after request): int32 or
        int64. out_tokens: None or int32 per request, in the fact ids' memory,
        filled with the tokens each request injected. Index arrays (offsets,
        tenants, slots, positions) must all be in one kind of memory; device ones
        make the call wait for ``stream``. Host arrays may be reused when this
        returns; device arrays must live until the stream has passed the call.
        A call whose arrays are all torch tensors (or None) with the addresses,
        shapes, strides, dtypes and devices of the previous successful call's
        (an engine's persistent buffers) reuses that call's struct: only the
        tensors' contents are read again. Until a call with other arrays, the
        injector keeps a reference to those tensors.

        Checks before the C call (ValueError naming the argument; TypeError for
        an element type): every array's element type, contiguity and length
        (offsets num_requests + 1, per-request arrays num_requests, positions
        not empty when the call has facts, 2-D tables whose rows do not
        overlap). Offsets in host memory: the first >= 0 and the last at most
        the length of the array they index (fact_ids, block_tables; offsets are
        absolute: request r's facts start at fact_ids[fact_offsets[r]]), read
        again on every call, the reused one included; the library checks that
        none decreases before it reads through them. Offsets in device memory
        are not read here (that would be a host synchronization): the library
        copies them and checks them as host ones, but no length of fact_ids or
        block_tables reaches it, so their last entries are the caller's to keep
        inside those arrays. Device block-table entries outside the cache are
        skipped and counted (:meth:`async_errors`).

        expect_token_ids and expect_token_offsets (experimental; host int32 ids and
        int64 CSR offsets, num_requests + 1): request r's prompt token ids at its
        injected slots, as :class:`InjectRequest`'s expect_token_ids (host fact ids
        only)."""
        # A call with the torch tensors of the previous successful call (the same
        # addresses, shapes, strides, dtypes and devices: an engine's persistent
        # buffers, whose contents change) reuses its struct, which holds nothing
        # else; the library checks the contents as on every call, and the host
        # offsets' ends are checked again here.
        try:
            key = (tensor_key(fact_ids), tensor_key(block_tables), tensor_key(fact_offsets),
                   tensor_key(tenants), tensor_key(block_table_offsets), tensor_key(first_slots),
                   tensor_key(start_positions), tensor_key(positions), tensor_key(out_tokens),
                   tensor_key(expect_token_ids), tensor_key(expect_token_offsets), tenant, layer_begin, layer_end)
        except NoKey:
            key = None
        last = self.__dict__.get("_batch_last")
        if key is not None and last is not None and last[0] == key:
            for bd in last[6]:  # the host offsets' contents are read afresh
                _buffers.check_csr(bd)
            lib().call("kvi_inject_batched", self.handle, last[1], last[2], _buffers.stream_handle(stream),
                       keep_gil=self._enqueues_only())
            return
        ids = index_array(fact_ids, ("u64", "i64"), "fact_ids", two_d=fact_offsets is None)
        b = InjectBatchC.from_buffer_copy(self._batch_template())
        b.fact_ids, b.fact_ids_memory = ids.ptr, int(ids.memory)
        keep = [ids]
        index = []
        bounds = []
        if fact_offsets is None:
            if ids.rows == 0 and ids.cols == 0:
                raise ValueError("fact_ids: give fact_offsets, or a 2-D [num_requests, k] array")
            if ids.row_stride != ids.cols:
                raise ValueError("fact_ids: a 2-D array of fact ids must be contiguous")
            n = ids.rows
            offs = self._row_offsets(n, ids.cols)
            b.fact_offsets = ctypes.addressof(offs)
            keep.append(offs)
            has_tokens = lambda: ids.rows * ids.cols > 0  # noqa: E731
        else:
            fo = index_array(fact_offsets, ("i32",), "fact_offsets")
            n = fo.numel - 1
            if n < 0:
                raise ValueError("fact_offsets: expected num_requests + 1 entries, got none")
            fb = _buffers.csr_bounds(fo, "fact_offsets", ids.numel, "fact_ids")
            if fb is not None:
                bounds.append(fb)
            b.fact_offsets = fo.ptr
            index.append(fo)
            has_tokens = lambda: None if fb is None else _buffers.csr_span(fb) > 0  # noqa: E731
        b.num_requests = fit(n, ctypes.c_int32, "num_requests")
        bt = index_array(block_tables, ("i32",), "block_tables", two_d=block_table_offsets is None)
        b.block_tables, b.block_tables_memory = bt.ptr, int(bt.memory)
        keep.append(bt)
        if block_table_offsets is None:
            if bt.rows == 0 and n > 0:
                raise ValueError("block_tables: give block_table_offsets (CSR), or a 2-D [num_requests, blocks] array")
            if bt.rows != n:
                raise ValueError("block_tables has %d rows for %d requests" % (bt.rows, n))
            b.block_table_stride, b.block_table_len = _two_d_table(bt, n, "block_tables")
        made, more = _batch_indices(b, n, "requests", bt, block_table_offsets, tenants, tenant, first_slots,
                                    start_positions, positions, has_tokens)
        index += made
        bounds += more
        if positions is not None and not b.positions:
            key = None  # positions left out of this call (it has no tokens): not for the next
        if index:
            mem = index[0].memory
            for a in index:
                if a.memory != mem:
                    raise ValueError("the batch's offsets, tenants, first slots and positions must all be host or all "
                                     "device memory")
            b.index_memory = int(mem)
        if out_tokens is not None:
            ot = index_array(out_tokens, ("i32",), "out_tokens", writable=True)
            if ot.numel < n:
                raise ValueError("out_tokens holds %d entries for %d requests" % (ot.numel, n))
            if ot.memory != ids.memory:
                raise ValueError("out_tokens must be in the memory of fact_ids (%s), not %s"
                                 % (Memory(ids.memory).name, Memory(ot.memory).name))
            b.out_tokens = ot.ptr
            keep.append(ot)
        if expect_token_ids is not None or expect_token_offsets is not None:
            if expect_token_ids is None or expect_token_offsets is None:
                raise ValueError("give expect_token_ids with expect_token_offsets")
            et = _buffers.int_array(expect_token_ids, ctypes.c_int32, "expect_token_ids")
            eo = _buffers.int_array(expect_token_offsets, ctypes.c_int64, "expect_token_offsets")
            if eo.numel != n + 1:
                raise ValueError("expect_token_offsets has %d entries for %d requests (num_requests + 1)"
                                 % (eo.numel, n))
            offs = ctypes.cast(eo.ptr, ctypes.POINTER(ctypes.c_int64))
            if n >= 0 and (offs[0] < 0 or offs[n] > et.numel):
                raise ValueError("expect_token_offsets reach %d, expect_token_ids has %d ids" % (offs[n], et.numel))
            b.expect_token_ids, b.expect_token_offsets = et.ptr, eo.ptr
            keep += [et, eo]
        opts = None
        if layer_begin or layer_end:
            opts = lib().new(InjectOptions)
            assign(opts, layer_begin=layer_begin, layer_end=layer_end)
            opts = ctypes.byref(opts)
        lib().call("kvi_inject_batched", self.handle, ctypes.byref(b), opts, _buffers.stream_handle(stream),
                   keep_gil=self._enqueues_only())
        # the struct, its options and what its pointers point into (the row
        # offsets array above is one) stay alive with the key
        self._batch_last = (key, ctypes.byref(b), opts, b, keep, index, bounds) if key is not None else None

    def _row_offsets(self, n: int, k: int):
        """CSR offsets of n rows of k (0, k, 2k, ...), kept for the next call of that shape."""
        cache = self.__dict__.setdefault("_offs_cache", {})
        offs = cache.get((n, k))
        if offs is None:
            if len(cache) > 64:
                cache.clear()
            offs = cache[(n, k)] = (ctypes.c_int32 * (n + 1))(*range(0, (n + 1) * k, k)) if k else \
                (ctypes.c_int32 * (n + 1))()
        return offs

    def _batch_template(self):
        t = getattr(self, "_batch_tmpl", None)
        if t is None:
            t = self._batch_tmpl = lib().new(InjectBatchC)
        return t

    def deviation(self, requests: Union[InjectRequest, Sequence[InjectRequest]], layer: int, *, out=None,
                  stream=None):
        """kvi_inject_deviation (kvinject/recompute.h): one score per token the requests
        would inject, at ``layer``: the squared distance of the cache's K and V there from
        the store's (keys rotated at the requests' positions), summed over heads. out: None
        returns a list of floats (host, the call waits); or a contiguous float32 tensor or
        buffer, host or on the store's device, with at least one entry per token, which
        the call fills (device: on ``stream``, no synchronization) and returns."""
        arr, nreq, keep = _request_array(requests)
        L = lib()
        n = 0
        for r in requests if not isinstance(requests, InjectRequest) else [requests]:
            n += self.plan(r.tenant, r.fact_ids)
        if out is None:
            buf = (ctypes.c_float * max(n, 1))()
            ptr, cap, mem = ctypes.cast(buf, ctypes.c_void_p), n, Memory.HOST
        else:
            a = _buffers.as_array(out, "out", writable=True, dtype=DType.FP32)
            if not _buffers.contiguous(a):
                raise ValueError("out must be contiguous")
            keep.append(a)
            ptr, cap, mem = a.c_ptr(), a.numel, a.memory
        L.call("kvi_inject_deviation", self.handle, arr, fit(nreq, ctypes.c_int32, "num_requests"),
               fit(layer, ctypes.c_int32, "layer"), ptr, cap, int(mem), _buffers.stream_handle(stream))
        del keep
        return list(buf[:n]) if out is None else out

    def retrieve_inject(self, queries: FloatArrayLike, requests: Sequence[RetrieveRequest], k: int, *,
                        query_dtype: Optional[DType] = None,
                        out: Optional[Tuple[ArrayLike, ArrayLike, ArrayLike]] = None, stream: StreamLike = None):
        """kvi_retrieve_inject: searches each query's tenant and injects its top k facts
        (on the device for CUDA stores without a host tier: see the C header). queries:
        as for :meth:`Store.search`; one request per query. out: None returns, per query,
        (fact ids in score order, tokens injected), waiting for the call; or a tuple
        (ids, counts, tokens) of tensors/buffers of [num_queries, k] uint64 or int64,
        [num_queries] int32 and [num_queries] int32, all host or all device memory,
        which the call fills (device outputs on ``stream``, with no host
        synchronization: read them after it) and which are returned."""
        requests = list(requests)
        k = fit(k, ctypes.c_int32, "k")
        q, qdt, nq, dim = _query_array(queries, self.store.embedding_dim, query_dtype)
        if len(requests) != nq:
            raise ValueError("%d requests for %d queries" % (len(requests), nq))
        L = lib()
        arr = (RetrieveRequestC * max(nq, 1))()
        keep: List[Any] = []
        for i, r in enumerate(requests):
            if not isinstance(r, RetrieveRequest):
                raise TypeError("requests[%d]: expected a kvinject.RetrieveRequest, got %s" % (i, type(r).__name__))
            c = L.new(RetrieveRequestC)
            bt = _buffers.int_array(r.block_table, ctypes.c_int32, "requests[%d].block_table" % i, allow_device=True)
            assign(c, tenant=r.tenant, block_table=bt.ptr, block_table_len=bt.numel,
                   block_table_memory=int(bt.memory), first_slot=r.first_slot, start_position=r.start_position,
                   flags=1 if r.best_last else 0)
            keep.append(bt)
            arr[i] = c
        so = L.new(SearchOptions)
        so.query_dtype, so.query_memory = int(qdt), int(q.memory)
        i32 = ctypes.c_int32
        if out is None:
            # a k the library refuses gets no nq x k allocation first
            n = max(nq * k, 1) if 0 < k <= SEARCH_MAX_K else 1
            ids, counts, tokens = (ctypes.c_uint64 * n)(), (i32 * max(nq, 1))(), (i32 * max(nq, 1))()
            ptrs = (ids, counts, tokens)
            so.out_memory = int(Memory.HOST)
        else:
            oi, oc, ot = out
            a_ids = _buffers.int_array(oi, ctypes.c_uint64, "out ids", allow_device=True, writable=True)
            a_ct = _buffers.int_array(oc, i32, "out counts", allow_device=True, writable=True)
            a_tk = _buffers.int_array(ot, i32, "out tokens", allow_device=True, writable=True)
            if len({(a.memory, a.device) for a in (a_ids, a_ct, a_tk)}) != 1:
                raise ValueError("retrieve_inject outputs must all be host memory or all on one device")
            if k > 0 and (a_ids.numel < nq * k or a_ct.numel < nq or a_tk.numel < nq):
                raise ValueError("retrieve_inject outputs hold %d ids, %d counts, %d tokens; %d queries x k %d need "
                                 "%d, %d, %d" % (a_ids.numel, a_ct.numel, a_tk.numel, nq, k, nq * k, nq, nq))
            keep += [a_ids, a_ct, a_tk]
            ptrs = (a_ids.c_ptr(), a_ct.c_ptr(), a_tk.c_ptr())
            so.out_memory = int(a_ids.memory)
        L.call("kvi_retrieve_inject", self.handle, q.c_ptr(), fit(nq, i32, "num_queries"), fit(dim, i32, "dim"), arr,
               k, ctypes.byref(so), ptrs[0], ptrs[1], ptrs[2], _buffers.stream_handle(stream))
        del keep
        if out is not None:
            return out
        return [([ids[i * k + j] for j in range(counts[i])], tokens[i]) for i in range(nq)]

    def plan(self, tenant: int, fact_ids: IntArrayLike) -> int:
        """kvi_inject_plan: tokens the facts need in total (allocate blocks for them first)."""
        ids = _buffers.int_array(fact_ids, ctypes.c_uint64, "fact_ids")
        n = ctypes.c_int64()
        lib().call("kvi_inject_plan", self.handle, fit(tenant, ctypes.c_uint64, "tenant"), ids.c_ptr(),
                   fit(ids.numel, ctypes.c_int32, "num_facts"), ctypes.byref(n), keep_gil=not self.store.has_disk_tier)
        return n.value

    def async_errors(self) -> int:
        """kvi_injector_async_errors: tokens skipped since the last call because a device
        block table named a block outside the cache (synchronize the stream first)."""
        n = ctypes.c_int64()
        lib().call("kvi_injector_async_errors", self.handle, ctypes.byref(n))
        return n.value


class Encoder(_Transfer):
    """kvi_encoder: captures facts from the cache a :class:`CacheLayout` describes into
    a store, un-rotating keys at the positions they were written with.
    Arguments as :class:`Injector`."""

    _create, _destroy = "kvi_encoder_create", "kvi_encoder_destroy"

    def encode(self, captures: Union[Capture, Sequence[Capture]], *, stream: StreamLike = None) -> None:
        """kvi_encode: all captures in one launch, all-or-nothing."""
        if isinstance(captures, Capture):
            captures = [captures]
        captures = list(captures)
        L = lib()
        arr = (CaptureC * max(len(captures), 1))()
        keep: List[Any] = []
        for i, cp in enumerate(captures):
            if not isinstance(cp, Capture):
                raise TypeError("captures[%d]: expected a kvinject.Capture, got %s" % (i, type(cp).__name__))
            c = L.new(CaptureC)
            assign(c, tenant=cp.tenant, fact_id=cp.fact_id)
            bt = _buffers.int_array(cp.block_table, ctypes.c_int32, "captures[%d].block_table" % i)
            assign(c, block_table=bt.ptr, block_table_len=bt.numel, first_slot=cp.first_slot,
                   num_tokens=cp.num_tokens, start_position=cp.start_position)
            if cp.positions is not None:
                pos = _buffers.int_array(cp.positions, ctypes.c_int32, "captures[%d].positions" % i)
                if pos.numel < cp.num_tokens:
                    raise ValueError("captures[%d]: %d positions for %d tokens" % (i, pos.numel, cp.num_tokens))
                c.positions = pos.ptr
                keep.append(pos)
            c.flags = PUT_REPLACE if cp.replace else 0
            if cp.embedding is not None:
                emb, edt = _buffers.float_array(cp.embedding, "captures[%d].embedding" % i,
                                                dtype=cp.embedding_dtype)
                _check_embedding(emb, self.store.embedding_dim, "captures[%d].embedding" % i)
                c.embedding, c.embedding_dtype, c.embedding_memory = emb.ptr, int(edt), int(emb.memory)
                keep.append(emb)
            if cp.token_ids is not None:
                tk = _buffers.int_array(cp.token_ids, ctypes.c_int32, "captures[%d].token_ids" % i)
                if tk.numel != cp.num_tokens:
                    raise ValueError("captures[%d]: %d token ids for %d tokens" % (i, tk.numel, cp.num_tokens))
                c.token_ids = tk.ptr
                keep.append(tk)
            if cp.context_ids is not None:
                cx = _buffers.int_array(cp.context_ids, ctypes.c_uint64, "captures[%d].context_ids" % i)
                c.context_ids = cx.ptr
                c.num_context_ids = fit(cx.numel, ctypes.c_int32, "len(captures[%d].context_ids)" % i)
                keep.append(cx)
            keep.append(bt)
            arr[i] = c
        L.call("kvi_encode", self.handle, arr, fit(len(captures), ctypes.c_int32, "num_captures"),
               _buffers.stream_handle(stream))
        del keep

    def encode_batch(self, fact_ids, num_tokens, block_tables, *, tenant: int = 0, tenants=None,
                     block_table_offsets=None, first_slots=None, start_positions=None, positions=None,
                     replace: bool = False, embeddings=None, embedding_dtype: Optional[DType] = None,
                     stream=None, token_ids=None, contexts=None) -> None:
        """kvi_encode_batched: captures from flat host arrays in one call, all-or-nothing
        (as :meth:`encode`). fact_ids: uint64/int64 per capture; num_tokens: int32 per
        capture; block_tables: int32, a 2-D [captures, blocks] array (rows any stride
        apart) or 1-D CSR pages with ``block_table_offsets``; tenants, first_slots
        (int64), start_positions or positions (one per captured token, int32 or int64)
        as :meth:`Injector.inject_batch`. embeddings: None, or a [captures, dim]
        buffer/tensor (host or device) of fp32, fp16 or bf16 with contiguous rows.
        The arrays are checked as :meth:`Injector.inject_batch`'s host arrays
        (block_table_offsets' last entry at most the length of block_tables).
        token_ids (experimental): None, or host int32, one per captured token,
        capture 0's first (as positions), kept with the facts. contexts
        (experimental): None, or one sequence of context ids per capture (None
        for none), as :class:`Capture`'s context_ids."""
        ids = index_array(fact_ids, ("u64", "i64"), "fact_ids")
        n = ids.numel
        nt = index_array(num_tokens, ("i32",), "num_tokens")
        if nt.numel != n:
            raise ValueError("num_tokens has %d entries for %d captures" % (nt.numel, n))
        b = lib().new(EncodeBatchC)
        b.num_captures, b.fact_ids, b.num_tokens = fit(n, ctypes.c_int32, "num_captures"), ids.ptr, nt.ptr
        keep = [ids, nt]
        bt = index_array(block_tables, ("i32",), "block_tables", two_d=block_table_offsets is None)
        keep.append(bt)
        b.block_tables = bt.ptr
        if block_table_offsets is None:
            if bt.rows != n:
                raise ValueError("block_tables: expected a 2-D [%d, blocks] array (or block_table_offsets)" % n)
            b.block_table_stride, b.block_table_len = _two_d_table(bt, n, "block_tables")

        def has_tokens():
            if nt.memory != Memory.HOST:
                return None
            return any(t > 0 for t in (ctypes.c_int32 * max(n, 1)).from_address(nt.ptr)[:n])

        made, _ = _batch_indices(b, n, "captures", bt, block_table_offsets, tenants, tenant, first_slots,
                                 start_positions, positions, has_tokens)
        keep += made
        for a in keep:
            if a.memory != Memory.HOST:
                raise ValueError("encode_batch: the index arrays and block tables must be host memory")
        b.flags = PUT_REPLACE if replace else 0
        if embeddings is not None:
            emb, edt = _buffers.float_array(embeddings, "embeddings", dtype=embedding_dtype)
            dim = self.store.embedding_dim
            if dim == 0 or emb.numel < n * dim:
                raise ValueError("embeddings: %d elements for %d captures of dimension %d" % (emb.numel, n, dim))
            b.embeddings, b.embedding_dtype, b.embedding_memory = emb.ptr, int(edt), int(emb.memory)
            keep.append(emb)
        if token_ids is not None:
            tk = _buffers.int_array(token_ids, ctypes.c_int32, "token_ids")
            counts = ctypes.cast(nt.ptr, ctypes.POINTER(ctypes.c_int32))
            total = sum(max(counts[i], 0) for i in range(n))
            if tk.numel != total:
                raise ValueError("token_ids has %d ids for %d captured tokens" % (tk.numel, total))
            b.token_ids = tk.ptr
            keep.append(tk)
        if contexts is not None:
            contexts = list(contexts)
            if len(contexts) != n:
                raise ValueError("contexts has %d entries for %d captures" % (len(contexts), n))
            flat, offs = [], [0]
            for i, cx in enumerate(contexts):
                flat += [] if cx is None else list(cx)
                offs.append(fit(len(flat), ctypes.c_int32, "the context ids of captures 0..%d" % i))
            ca = _buffers.int_array(flat, ctypes.c_uint64, "contexts")
            co = _buffers.int_array(offs, ctypes.c_int32, "context offsets")
            b.context_ids, b.context_offsets = ca.ptr, co.ptr
            keep += [ca, co]
        lib().call("kvi_encode_batched", self.handle, ctypes.byref(b), _buffers.stream_handle(stream))
        del keep
