"""Hostile inputs to the binding: arrays of the wrong element type, not contiguous,
too small or too large; ids, offsets, strides, counts and k out of range; every
integer argument one past its C type's limits (int32, int64, uint64: min - 1 and
max + 1). Each refused call must raise, and change nothing: the store (counts, ids,
stats, every fact's K, V, tokens and embedding read back) and the cache (its
bytes) are compared before and after every call.

Plain Python objects always (lists, array.array, memoryview, bytes, ctypes arrays,
fakes of torch tensors); numpy arrays and torch CPU tensors where they import (in
the vLLM environment: python-hostile_venv), their cases skipped otherwise.
"""
from __future__ import annotations

import array
import ctypes
import math
import re
import sys

import pytest

from kvi_testutil import FakeTensor, case
import kvinject as kvi
from kvinject import CachePreset, DType, Memory, RopeStyle

try:
    import numpy as np
except ImportError:
    np = None
try:
    import torch
except ImportError:
    torch = None

L, H, D, E = 2, 2, 8, 4
NB, BS = 8, 4
FACTS = {(1, 10): 3, (1, 11): 5, (2, 20): 2}  # (tenant, fact id): tokens
CACHE = 2 * NB * BS * H * D  # vLLM [2, NB, BS, H, D], per layer
POISON = -3.25

LIMITS = {"i32": (-(1 << 31), (1 << 31) - 1), "i64": (-(1 << 63), (1 << 63) - 1), "u64": (0, (1 << 64) - 1)}


def outside(kind):
    """The two integers just outside a C type: min - 1 and max + 1."""
    lo, hi = LIMITS[kind]
    return lo - 1, hi + 1


class World:
    """A CPU store with three facts (and embeddings), a vLLM cache of host buffers
    filled with a poison value, an injector and an encoder on it."""

    def __init__(self, closing):
        self.model = kvi.Model(L, H, D)
        self.model.set_rope(style=RopeStyle.NEOX, theta=10000.0)
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=DType.FP32, page_tokens=4,
                               embedding_dim=E)
        closing.append(self.store)
        for (t, f), T in FACTS.items():
            k = array.array("f", [((t * 31 + f * 7 + i) % 97) / 8.0 for i in range(L * T * H * D)])
            self.store.put(t, f, k, array.array("f", [-x for x in k]), embedding=[float(f), 1.0, 0.5, -1.0])
        self.caches = [array.array("f", [POISON] * CACHE) for _ in range(L)]
        self.layout = kvi.CacheLayout.vllm(self.caches, shape=(2, NB, BS, H, D))
        self.inj = kvi.Injector(self.store, self.layout)
        self.enc = kvi.Encoder(self.store, self.layout)
        closing += [self.inj, self.enc]

    def snapshot(self, extra=()):
        facts = {}
        for t in (1, 2, 3):
            for f in self.store.list(t):
                k, v = self.store.read(t, f)
                facts[(t, f)] = (bytes(k), bytes(v), self.store.fact_tokens(t, f),
                                 bytes(self.store.get_embedding(t, f)))
        return (self.store.stats(), [self.store.count(t) for t in (1, 2, 3, (1 << 64) - 1)], facts,
                [bytes(c) for c in self.caches], [bytes(memoryview(b).cast("B")) for b in extra])

    def refused(self, exc, call, match=None, extra=()):
        """call() raises exc (its message matching ``match``) and changes neither the
        store nor the cache (nor the buffers in ``extra``). Returns the exception."""
        before = self.snapshot(extra)
        try:
            call()
        except exc as e:
            err = e
        else:
            raise AssertionError("no %s raised" % (exc.__name__ if isinstance(exc, type) else exc,))
        assert match is None or re.search(match, str(err)), "%r does not match %r" % (str(err), match)
        assert self.snapshot(extra) == before, "the refused call changed the store or the cache"
        return err

    def pristine(self):
        return all(x == POISON for c in self.caches for x in c)


@pytest.fixture
def w(closing):
    return World(closing)


# --------------------------------------------------------------- array kinds
_CTYPES = {"i": ctypes.c_int32, "q": ctypes.c_int64, "Q": ctypes.c_uint64, "h": ctypes.c_int16,
           "f": ctypes.c_float, "B": ctypes.c_uint8}
_NUMPY = {"i": "int32", "q": "int64", "Q": "uint64", "h": "int16", "f": "float32", "B": "uint8", "?": "bool"}
_TORCH = {"i": "int32", "q": "int64", "h": "int16", "f": "float32", "B": "uint8", "?": "bool"}
_FAKE = {"i": "torch.int32", "q": "torch.int64", "h": "torch.int16", "f": "torch.float32", "B": "torch.uint8"}
KINDS = ["list", "array", "ctypes", "fake", "numpy", "torch"]


def need(kind):
    if kind == "numpy" and np is None:
        pytest.skip("numpy is not importable")
    if kind == "torch" and torch is None:
        pytest.skip("torch is not importable")


def make(kind, values, code="i"):
    """values as an array of one kind: 'list' (always int elements), 'array'
    (array.array), 'ctypes', 'fake' (a FakeTensor), 'numpy', 'torch'."""
    values = list(values)
    if kind == "list":
        return values
    if kind == "array":
        return array.array(code, values)
    if kind == "ctypes":
        return (_CTYPES[code] * len(values))(*values)
    if kind == "fake":
        return FakeTensor(array.array(code, values or [0]), (len(values),), dtype=_FAKE[code])
    if kind == "numpy":
        return np.array(values, dtype=_NUMPY[code])
    if kind == "torch":
        return torch.tensor(values, dtype=getattr(torch, _TORCH[code]))
    raise ValueError(kind)


def strided(kind, values, code="i"):
    """values at every other element of a buffer twice as long (not contiguous)."""
    padded = [x for v in values for x in (v, 99)]
    if kind == "memoryview":
        return memoryview(array.array(code, padded))[::2]
    if kind == "fake":
        return FakeTensor(array.array(code, padded), (len(values),), (2,), dtype=_FAKE[code])
    if kind == "numpy":
        return np.array(padded, dtype=_NUMPY[code])[::2]
    if kind == "torch":
        return torch.tensor(padded, dtype=getattr(torch, _TORCH[code]))[::2]
    raise ValueError(kind)


# A valid batch: request 0 injects facts 11 and 10 (8 tokens) into blocks 1 and 3.
def batch(w, **kw):
    args = dict(fact_ids=[11, 10], block_tables=[1, 3], fact_offsets=[0, 2], block_table_offsets=[0, 2], tenant=1)
    args.update(kw)
    return lambda: w.inj.inject_batch(args.pop("fact_ids"), args.pop("block_tables"), **args)


class TestInjectBatch:
    def test_the_valid_batch_injects(self, w):
        out = array.array("i", [-1])
        batch(w, out_tokens=out)()
        assert out[0] == 8 and not w.pristine()

    @pytest.mark.parametrize("kind", KINDS)
    def test_offsets_outside_their_arrays(self, w, kind):
        need(kind)
        cases = [
            (dict(fact_offsets=[0, 3]), r"fact_offsets\[1\] is 3, past the end of fact_ids \(2 entries\)"),
            (dict(fact_offsets=[1, 3]), r"fact_offsets\[1\] is 3, past the end of fact_ids"),
            (dict(fact_offsets=[0, (1 << 31) - 1]), r"fact_offsets\[1\] is 2147483647, past the end"),
            (dict(fact_offsets=[1 << 30, (1 << 30) + 2]), r"fact_offsets\[1\] is 1073741826, past the end"),
            (dict(block_table_offsets=[0, 3]), r"block_table_offsets\[1\] is 3, past the end of block_tables"),
            (dict(block_table_offsets=[2, 4]), r"block_table_offsets\[1\] is 4, past the end of block_tables"),
            (dict(block_table_offsets=[0, (1 << 31) - 1]), r"block_table_offsets\[1\] is 2147483647"),
            (dict(fact_offsets=[-1, 2]), r"fact_offsets\[0\] is -1"),
            (dict(fact_offsets=[-(1 << 31), 2]), r"fact_offsets\[0\] is -2147483648"),
            (dict(block_table_offsets=[-2, 2]), r"block_table_offsets\[0\] is -2"),
            # decreasing in the middle: the library's check (before it reads through them)
            (dict(fact_offsets=[0, 2, 1], block_table_offsets=[0, 1, 2]), r"fact_offsets\[2\] is 1, below"),
            (dict(fact_offsets=[0, 1, 2], block_table_offsets=[0, 2, 1]), r"block_table_offsets\[2\] is 1, below"),
        ]
        for kw, match in cases:
            with case(kind, **kw):
                kw = {k: make(kind, v) for k, v in kw.items()}
                w.refused(ValueError, batch(w, **kw), match)
        assert w.pristine()

    @pytest.mark.parametrize("kind", ["array", "ctypes", "fake", "numpy", "torch"])
    def test_elements_of_the_wrong_type(self, w, kind):
        need(kind)
        for name, values, code in (("fact_offsets", [0, 2], "q"), ("fact_offsets", [0, 2], "h"),
                                   ("fact_offsets", [0, 2], "f"), ("block_table_offsets", [0, 2], "q"),
                                   ("block_tables", [1, 3], "q"), ("block_tables", [1, 3], "B"),
                                   ("fact_ids", [11, 10], "i"), ("fact_ids", [11, 10], "f"),
                                   ("tenants", [1], "i"), ("first_slots", [0], "i"), ("start_positions", [0], "h"),
                                   ("positions", list(range(8)), "f"), ("out_tokens", [0], "q")):
            with case(kind, name, code):
                w.refused(TypeError, batch(w, **{name: make(kind, values, code)}))
        if kind in ("numpy", "torch"):
            w.refused(TypeError, batch(w, fact_offsets=make(kind, [False, True], "?")))
        assert w.pristine()

    def test_python_objects_that_are_not_int_arrays(self, w):
        for name, value in (("fact_offsets", [0, 2.5]), ("fact_offsets", ["0", "2"]), ("fact_offsets", 2),
                            ("block_tables", [1, None]), ("block_table_offsets", object()),
                            ("fact_ids", [11.0, 10]), ("tenants", [1.5]), ("first_slots", ["0"]),
                            ("fact_offsets", bytes(8)), ("block_tables", bytearray(8)),
                            ("fact_offsets", array.array("d", [0, 2]))):
            with case(name, value):
                w.refused(TypeError, batch(w, **{name: value}))
        with pytest.raises(TypeError):
            w.inj.inject_batch([11], [1, 3], fact_offsets=[0, 1], block_table_offsets=[0, 2], tenant=1.0)
        assert w.pristine()

    @pytest.mark.parametrize("kind", ["memoryview", "fake", "numpy", "torch"])
    def test_arrays_that_are_not_contiguous(self, w, kind):
        need(kind)
        for name, values, code in (("fact_offsets", [0, 2], "i"), ("block_table_offsets", [0, 2], "i"),
                                   ("block_tables", [1, 3], "i"), ("fact_ids", [11, 10], "q"),
                                   ("out_tokens", [0, 0], "i") if kind != "memoryview" else ("fact_ids", [11, 10], "Q"),
                                   ("positions", list(range(8)), "q")):
            with case(kind, name):
                w.refused(ValueError, batch(w, **{name: strided(kind, values, code)}), "contiguous")
        assert w.pristine()

    def test_two_d_tables_whose_rows_overlap_or_are_not_rows(self, w):
        buf = array.array("i", [1, 3, 5, 7])
        for table, match in ((FakeTensor(buf, (2, 2), (0, 1), dtype="torch.int32"), "rows 0 entries apart overlap"),
                             (FakeTensor(buf, (2, 2), (1, 1), dtype="torch.int32"), "rows 1 entries apart overlap"),
                             (FakeTensor(buf, (2, 2), (1, 2), dtype="torch.int32"), "rows of a 2-D table")):
            with case(table.stride()):
                w.refused(ValueError, lambda: w.inj.inject_batch([11, 10], table, fact_offsets=[0, 1, 2], tenant=1),
                          match)
        if torch is not None:
            t = torch.tensor([1, 3], dtype=torch.int32).expand(2, 2)  # a broadcast: both rows at one address
            w.refused(ValueError, lambda: w.inj.inject_batch([11, 10], t, fact_offsets=[0, 1, 2], tenant=1),
                      "overlap")
        if np is not None:
            t = np.broadcast_to(np.array([1, 3], dtype=np.int32), (2, 2))
            w.refused(ValueError, lambda: w.inj.inject_batch([11, 10], t, fact_offsets=[0, 1, 2], tenant=1))
        ids2d = FakeTensor(array.array("q", [11, 10, 0, 0]), (2, 1), (2, 1), dtype="torch.int64")
        w.refused(ValueError, lambda: w.inj.inject_batch(ids2d, [[1], [3]], tenant=1))  # ids rows apart
        assert w.pristine()

    @pytest.mark.parametrize("kind", ["list", "array", "numpy", "torch"])
    def test_arrays_of_the_wrong_length(self, w, kind):
        need(kind)
        m = lambda v, code="i": make(kind, v, code)  # noqa: E731
        cases = [
            (dict(fact_offsets=m([])), ValueError, "num_requests \\+ 1 entries"),
            (dict(block_table_offsets=m([0])), ValueError, "block_table_offsets has 1 entries for 1 requests"),
            (dict(block_table_offsets=m([0, 1, 2])), ValueError, "block_table_offsets has 3 entries"),
            (dict(tenants=m([1, 1], "q")), ValueError, "tenants has 2 entries"),
            (dict(tenants=m([], "q")), ValueError, "tenants has 0 entries"),
            (dict(first_slots=m([0, 0], "q")), ValueError, "first_slots has 2 entries"),
            (dict(start_positions=m([])), ValueError, "start_positions has 0 entries"),
            (dict(start_positions=m([0, 0], "q")), ValueError, "start_positions has 2 entries"),
            (dict(positions=m([])), ValueError, "positions is empty"),
            (dict(positions=m(range(7))), kvi.InvalidArgumentError, "positions has 7 values"),
            (dict(positions=m(range(9), "q")), kvi.InvalidArgumentError, "positions has 9 values"),
            (dict(out_tokens=m([])), ValueError, "out_tokens holds 0 entries for 1 requests"),
            (dict(fact_offsets=m([0, 1, 2])), ValueError, "block_table_offsets has 2 entries for 2 requests"),
        ]
        for kw, exc, match in cases:
            with case(kind, **{k: str(v) for k, v in kw.items()}):
                w.refused(exc, batch(w, **kw), match)
        # a 2-D table of the wrong number of rows
        w.refused(ValueError, lambda: w.inj.inject_batch([11, 10], memoryview(array.array("i", [1, 3, 5, 7])).cast(
            "B").cast("i", (2, 2)), fact_offsets=[0, 2], tenant=1), "2 rows for 1 requests")
        assert w.pristine()

    def test_empty_positions_of_a_call_without_facts(self, w):
        """An empty positions array is refused when the call has facts (the C struct's
        count 0 would make the library trust it to hold one per token), and harmless
        when it has none."""
        w.inj.inject_batch([11, 10], [1, 3], fact_offsets=[2, 2], block_table_offsets=[0, 2], tenant=1,
                           positions=array.array("i"))
        w.inj.inject([kvi.InjectRequest(1, [], [1], positions=[])])
        assert w.pristine()
        w.refused(ValueError, lambda: w.inj.inject(kvi.InjectRequest(1, [10], [1], positions=[])),
                  r"requests\[0\].positions is empty")
        w.refused(ValueError, lambda: w.enc.encode_batch([50], [2], [1], block_table_offsets=[0, 1], tenant=1,
                                                         positions=[], embeddings=[0.0] * E), "positions is empty")

    def test_ids_blocks_slots_and_positions_out_of_range(self, w):
        big = (1 << 63) - 1
        cases = [
            (dict(block_tables=[1, -1]), kvi.InvalidArgumentError),
            (dict(block_tables=[1, NB]), kvi.InvalidArgumentError),
            (dict(block_tables=[(1 << 31) - 1, 1]), kvi.InvalidArgumentError),
            (dict(block_tables=[-(1 << 31), 1]), kvi.InvalidArgumentError),
            (dict(first_slots=array.array("q", [-1])), kvi.InvalidArgumentError),
            (dict(first_slots=array.array("q", [1])), kvi.InvalidArgumentError),  # 9 slots in 2 blocks
            (dict(first_slots=array.array("q", [big])), kvi.InvalidArgumentError),
            (dict(first_slots=array.array("q", [-big - 1])), kvi.InvalidArgumentError),
            (dict(start_positions=[-1]), kvi.InvalidArgumentError),
            (dict(start_positions=[(1 << 31) - 1]), kvi.InvalidArgumentError),
            (dict(start_positions=array.array("q", [1 << 40])), kvi.InvalidArgumentError),
            (dict(start_positions=array.array("q", [-(1 << 63)])), kvi.InvalidArgumentError),
            (dict(positions=[0, 1, 2, 3, 4, 5, 6, -1]), kvi.InvalidArgumentError),
            (dict(positions=array.array("q", [0] * 7 + [1 << 32])), kvi.InvalidArgumentError),
            (dict(positions=[(1 << 31) - 1] * 8), kvi.InvalidArgumentError),
            (dict(fact_ids=[11, (1 << 64) - 1]), kvi.NotFoundError),
            (dict(fact_ids=array.array("q", [11, -1])), kvi.NotFoundError),  # int64 -1 is id 2**64 - 1
            (dict(tenant=(1 << 64) - 1), kvi.NotFoundError),
            (dict(tenant=3), kvi.NotFoundError),
            (dict(tenants=[2]), kvi.NotFoundError),
            (dict(layer_begin=-1), kvi.InvalidArgumentError),
            (dict(layer_end=L + 1), kvi.InvalidArgumentError),
            (dict(layer_begin=2, layer_end=1), kvi.InvalidArgumentError),
            (dict(layer_begin=(1 << 31) - 1), kvi.InvalidArgumentError),
        ]
        for kw, exc in cases:
            with case(**kw):
                out = array.array("i", [-7])
                w.refused(exc, batch(w, out_tokens=out, **kw))
                assert out[0] == -7
        assert w.pristine()

    def test_integers_outside_their_types(self, w):
        for name, kind, call in (
                ("tenant", "u64", lambda v: batch(w, tenant=v)),
                ("tenants[0]", "u64", lambda v: batch(w, tenants=[v])),
                ("fact_ids[1]", "u64", lambda v: batch(w, fact_ids=[11, v])),
                ("fact_offsets[1]", "i32", lambda v: batch(w, fact_offsets=[0, v])),
                ("block_tables[0]", "i32", lambda v: batch(w, block_tables=[v, 3])),
                ("block_table_offsets[1]", "i32", lambda v: batch(w, block_table_offsets=[0, v])),
                ("first_slots[0]", "i64", lambda v: batch(w, first_slots=[v])),
                ("start_positions[0]", "i32", lambda v: batch(w, start_positions=[v])),
                ("positions[7]", "i32", lambda v: batch(w, positions=[0] * 7 + [v])),
                ("layer_begin", "i32", lambda v: batch(w, layer_begin=v)),
                ("layer_end", "i32", lambda v: batch(w, layer_end=v))):
            for v in outside(kind):
                with case(name, v):
                    w.refused(OverflowError, call(v))
        assert w.pristine()

    def test_device_arrays_on_a_cpu_store(self, w):
        """Arrays that claim CUDA memory: the library refuses device memory on a CPU
        store (MemoryKindError) before reading any; out_tokens must be in fact_ids'
        memory and the index arrays all in one (the binding's checks). The binding
        reads no device offsets (that would need a host synchronization): device
        offsets past the end of their array are not the binding's to catch."""
        def dev(values, code="i", dtype="torch.int32"):
            return FakeTensor(array.array(code, values), (len(values),), dtype=dtype, device="cuda")

        w.refused(kvi.MemoryKindError, batch(w, fact_ids=dev([11, 10], "q", "torch.int64")))
        w.refused(kvi.MemoryKindError, batch(w, block_tables=dev([1, 3])))
        w.refused(kvi.MemoryKindError, batch(w, fact_offsets=dev([0, 2]), block_table_offsets=dev([0, 2])))
        w.refused(kvi.MemoryKindError, batch(w, fact_offsets=dev([0, 1 << 30]), block_table_offsets=dev([0, 2])))
        w.refused(ValueError, batch(w, fact_offsets=dev([0, 2])), "all be host or all device")
        w.refused(ValueError, batch(w, out_tokens=dev([0])), "out_tokens must be in the memory of fact_ids")
        w.refused(ValueError, batch(w, fact_ids=dev([11, 10], "q", "torch.int64"), fact_offsets=[0, 3]),
                  r"fact_offsets\[1\] is 3, past the end of fact_ids")  # host offsets of device ids: checked
        w.refused(ValueError, batch(w, block_tables=dev([1, 3]), block_table_offsets=[0, 5]),
                  r"block_table_offsets\[1\] is 5, past the end of block_tables")
        assert w.pristine()

    @pytest.mark.parametrize("kind", ["fake", "torch"])
    def test_reused_tensors_are_read_again(self, w, kind):
        """A call with the tensors of the previous one reuses its struct; offsets
        changed in place are checked again."""
        need(kind)

        class Tensor(FakeTensor):
            is_cuda = False

        def t(values, code):
            if kind == "torch":
                return torch.tensor(values, dtype=getattr(torch, _TORCH[code]))
            return Tensor(array.array(code, values), (len(values),), dtype=_FAKE[code])

        ids, table, offs, indptr = t([11, 10], "q"), t([1, 3], "i"), t([0, 2], "i"), t([0, 2], "i")

        def call():
            w.inj.inject_batch(ids, table, fact_offsets=offs, block_table_offsets=indptr, tenant=1)

        call()
        assert w.inj._batch_last is not None
        for arr, i, v, match in ((offs, 1, 3, r"fact_offsets\[1\] is 3, past the end"),
                                 (offs, 0, -1, r"fact_offsets\[0\] is -1"),
                                 (indptr, 1, 1 << 30, r"block_table_offsets\[1\] is 1073741824, past the end")):
            with case(i, v):
                buf = arr if kind == "torch" else arr.storage
                old = int(buf[i])
                buf[i] = v
                w.refused(ValueError, call, match)
                buf[i] = old
        call()  # as before: accepted


class TestEncodeBatch:
    def capture(self, w, **kw):
        args = dict(fact_ids=[50], num_tokens=[6], block_tables=[1, 3], block_table_offsets=[0, 2], tenant=1,
                    embeddings=[0.0, 1.0, 0.0, 0.0])
        args.update(kw)
        return lambda: w.enc.encode_batch(args.pop("fact_ids"), args.pop("num_tokens"), args.pop("block_tables"),
                                          **args)

    def test_the_valid_capture_stores(self, w):
        self.capture(w)()
        assert w.store.fact_tokens(1, 50) == 6

    @pytest.mark.parametrize("kind", KINDS)
    def test_refused_captures(self, w, kind):
        need(kind)
        m = lambda v, code="i": make(kind, v, code)  # noqa: E731
        cases = [
            (dict(block_table_offsets=m([0, 3])), ValueError, r"block_table_offsets\[1\] is 3, past the end"),
            (dict(block_table_offsets=m([0, (1 << 31) - 1])), ValueError, "past the end of block_tables"),
            (dict(block_table_offsets=m([-1, 2])), ValueError, r"block_table_offsets\[0\] is -1"),
            (dict(block_table_offsets=m([0])), ValueError, "block_table_offsets has 1 entries"),
            (dict(num_tokens=m([6, 6])), ValueError, "num_tokens has 2 entries for 1 captures"),
            (dict(num_tokens=m([0])), kvi.InvalidArgumentError, "num_tokens is 0"),
            (dict(num_tokens=m([-1])), kvi.InvalidArgumentError, None),
            (dict(num_tokens=m([(1 << 31) - 1])), kvi.InvalidArgumentError, None),
            (dict(num_tokens=m([9])), kvi.InvalidArgumentError, None),  # 9 tokens in 2 blocks of 4
            (dict(block_tables=m([1, NB])), kvi.InvalidArgumentError, None),
            (dict(block_tables=m([-1, 1])), kvi.InvalidArgumentError, None),
            (dict(first_slots=m([-1], "q")), kvi.InvalidArgumentError, None),
            (dict(first_slots=m([(1 << 63) - 1], "q")), kvi.InvalidArgumentError, None),
            (dict(start_positions=m([-1])), kvi.InvalidArgumentError, None),
            (dict(positions=m(range(5))), kvi.InvalidArgumentError, None),
            (dict(positions=m([])), ValueError, "positions is empty"),
            (dict(positions=m([0, 1, 2, 3, 4, -1])), kvi.InvalidArgumentError, None),
            (dict(positions=m([0, 1, 2, 3, 4, 1 << 40], "q")),
             OverflowError if kind == "list" else kvi.InvalidArgumentError, None),  # a list is sent as int32
            (dict(fact_ids=m([10], "q")), kvi.ExistsError, None),
            (dict(embeddings=[0.0] * (E - 1)), ValueError, "embeddings"),
            (dict(embeddings=None), kvi.InvalidArgumentError, None),  # the store keeps embeddings
            (dict(tenants=m([1, 2], "q")), ValueError, "tenants has 2 entries"),
        ]
        for kw, exc, match in cases:
            with case(kind, **{k: str(v) for k, v in kw.items()}):
                w.refused(exc, self.capture(w, **kw), match)

    def test_wrong_types_and_memory(self, w):
        dev = FakeTensor(array.array("i", [1, 3]), (2,), dtype="torch.int32", device="cuda")
        for kw, exc in ((dict(fact_ids=array.array("i", [50])), TypeError),
                        (dict(num_tokens=array.array("q", [6])), TypeError),
                        (dict(block_tables=array.array("h", [1, 3])), TypeError),
                        (dict(embeddings=array.array("i", [0] * E)), TypeError),
                        (dict(embeddings=bytes(4 * E)), TypeError),
                        (dict(block_tables=dev), ValueError),
                        (dict(block_tables=strided("fake", [1, 3])), ValueError),
                        (dict(block_table_offsets=strided("memoryview", [0, 2])), ValueError)):
            with case(**{k: type(v).__name__ for k, v in kw.items()}):
                w.refused(exc, self.capture(w, **kw))
        for name, kind in (("tenant", "u64"), ("fact_ids", "u64"), ("num_tokens", "i32"), ("first_slots", "i64"),
                           ("start_positions", "i32"), ("block_table_offsets", "i32")):
            for v in outside(kind):
                with case(name, v):
                    value = v if name == "tenant" else [v] if name != "block_table_offsets" else [0, v]
                    w.refused(OverflowError, self.capture(w, **{name: value}))


class TestRequestsAndCaptures:
    def test_inject_requests(self, w):
        R = kvi.InjectRequest
        big = (1 << 63) - 1
        cases = [
            (R(1, [10], [-1]), kvi.InvalidArgumentError),
            (R(1, [10], [NB]), kvi.InvalidArgumentError),
            (R(1, [10, 11], [1]), kvi.InvalidArgumentError),  # 8 tokens in 1 block
            (R(1, [10], [1], first_slot=-1), kvi.InvalidArgumentError),
            (R(1, [10], [1], first_slot=big), kvi.InvalidArgumentError),
            (R(1, [10], [1], start_position=-1), kvi.InvalidArgumentError),
            (R(1, [10], [1], start_position=(1 << 31) - 1), kvi.InvalidArgumentError),
            (R(1, [10], [1], positions=[0, 1]), kvi.InvalidArgumentError),
            (R(1, [10], [1], positions=[0, 1, -5]), kvi.InvalidArgumentError),
            (R(1, [10], [1], positions=[]), ValueError),
            (R(1, [10, 99], [1, 2]), kvi.NotFoundError),
            (R((1 << 64) - 1, [10], [1]), kvi.NotFoundError),
            (R(1, [10], [1.0]), TypeError),
            (R(1, [10], array.array("q", [1])), TypeError),
            (R(1, array.array("i", [10]), [1]), TypeError),
            (R(1, [10], bytes(4)), TypeError),
            (R(1, [10], strided("memoryview", [1, 2])), ValueError),
            (R(1, [10], strided("fake", [1, 2])), ValueError),
            (R(1, [10], FakeTensor(array.array("i", [1]), (1,), dtype="torch.int32", device="cuda")),
             kvi.MemoryKindError),
            (R(1, [10], [1], positions=FakeTensor(array.array("i", [0, 1, 2]), (3,), dtype="torch.int32",
                                                  device="cuda")), ValueError),
        ]
        for req, exc in cases:
            with case(req):
                w.refused(exc, lambda: w.inj.inject([R(1, [11], [2, 3]), req]))
        w.refused(TypeError, lambda: w.inj.inject([(1, [10], [1])]))
        w.refused(TypeError, lambda: w.inj.inject(R(1, [10], [1]), layer_end=1.5))
        for name, kind in (("tenant", "u64"), ("first_slot", "i64"), ("start_position", "i32")):
            for v in outside(kind):
                with case(name, v):
                    kw = dict(tenant=1, fact_ids=[10], block_table=[1])
                    kw[name] = v
                    w.refused(OverflowError, lambda: w.inj.inject(R(**kw)))
        for v in outside("u64"):
            w.refused(OverflowError, lambda: w.inj.inject(R(1, [10, v], [1, 2])))
        for v in outside("i32"):
            w.refused(OverflowError, lambda: w.inj.inject(R(1, [10], [v])))
            w.refused(OverflowError, lambda: w.inj.inject(R(1, [10], [1], positions=[0, 1, v])))
            w.refused(OverflowError, lambda: w.inj.inject(R(1, [10], [1]), layer_begin=v))
        assert w.pristine()

    def test_captures(self, w):
        C = kvi.Capture
        emb = [0.0, 0.0, 0.0, 1.0]
        cases = [
            (C(1, 60, [1], num_tokens=0, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=-1, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=5, embedding=emb), kvi.InvalidArgumentError),  # 5 tokens in 1 block
            (C(1, 60, [1], num_tokens=(1 << 31) - 1, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [NB], num_tokens=2, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=2, first_slot=-1, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=2, first_slot=(1 << 63) - 1, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=2, positions=[0], embedding=emb), ValueError),
            (C(1, 60, [1], num_tokens=2, positions=[0, -1], embedding=emb), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=2, start_position=-3, embedding=emb), kvi.InvalidArgumentError),
            (C(1, 10, [1], num_tokens=2, embedding=emb), kvi.ExistsError),
            (C(1, 60, [1], num_tokens=2, embedding=emb[:3]), ValueError),
            (C(1, 60, [1], num_tokens=2, embedding=[math.nan] * E), kvi.InvalidArgumentError),
            (C(1, 60, [1], num_tokens=2), kvi.InvalidArgumentError),  # no embedding for a store with them
            (C(1, 60, array.array("q", [1]), num_tokens=2, embedding=emb), TypeError),
            (C(1, 60, [1], num_tokens=2, embedding=array.array("i", [0] * E)), TypeError),
        ]
        for cap, exc in cases:
            with case(cap):
                # the first capture is valid: all-or-nothing
                w.refused(exc, lambda: w.enc.encode([C(1, 61, [2], num_tokens=2, embedding=emb), cap]))
        for name, kind in (("tenant", "u64"), ("fact_id", "u64"), ("num_tokens", "i32"), ("first_slot", "i64"),
                           ("start_position", "i32")):
            for v in outside(kind):
                with case(name, v):
                    kw = dict(tenant=1, fact_id=60, block_table=[1], num_tokens=2, embedding=emb)
                    kw[name] = v
                    w.refused(OverflowError, lambda: w.enc.encode(C(**kw)))


class TestLayouts:
    """Layouts over too small buffers are refused when they are made (an injection
    wrote past them); the buffers are not touched."""

    N = CACHE  # elements of one layer's [2, NB, BS, H, D]

    def buffers(self, kind, count, elems):
        if kind == "array":
            return [array.array("f", [1.5] * elems) for _ in range(count)]
        if kind == "bytearray":
            return [bytearray(4 * elems) for _ in range(count)]
        if kind == "ctypes":
            return [(ctypes.c_float * elems)() for _ in range(count)]
        if kind == "numpy":
            return [np.full(elems, 1.5, dtype=np.float32) for _ in range(count)]
        if kind == "torch":
            return [torch.full((elems,), 1.5, dtype=torch.float32) for _ in range(count)]
        raise ValueError(kind)

    @pytest.mark.parametrize("kind", ["array", "bytearray", "ctypes", "numpy", "torch"])
    def test_presets_over_small_buffers(self, w, kind):
        need(kind)
        N, P = self.N, CachePreset
        pool = NB * L * 2 * H * BS * D
        dt = DType.FP32
        presets = [
            (P.VLLM_FLASH_ATTN, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.VLLM_FLASH_ATTN_HND, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.VLLM_FLASHINFER, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.VLLM_FLASHINFER_HND, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.VLLM_PACKED, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.VLLM_PACKED_HND, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.VLLM_CPU, lambda e: dict(k_layers=self.buffers(kind, L, N + e))),
            (P.SGLANG, lambda e: dict(k_layers=self.buffers(kind, L, N // 2),
                                      v_layers=self.buffers(kind, L, N // 2 + e))),
            (P.HF_CONTIGUOUS, lambda e: dict(k_layers=self.buffers(kind, L, N // 2 + e),
                                             v_layers=self.buffers(kind, L, N // 2))),
            (P.TRTLLM, lambda e: dict(base=self.buffers(kind, 1, pool + e)[0])),
        ]
        for preset, bufs in presets:
            for short in (-1, -(N // 4)):
                with case(preset.name, short):
                    kw = bufs(short)
                    if preset == P.TRTLLM:
                        kw = dict(base=self.buffers(kind, 1, pool + short * L)[0])
                    extra = [b for v in kw.values() for b in (v if isinstance(v, list) else [v])]
                    if kind == "torch":
                        extra = [b.numpy() for b in extra]
                    w.refused(ValueError, lambda: kvi.CacheLayout.preset(preset, dt, L, H, D, BS, NB, **kw),
                              "bytes into it", extra=extra)
            with case(preset.name, "exact"):
                kvi.Injector(w.store, kvi.CacheLayout.preset(preset, dt, L, H, D, BS, NB, **bufs(0))).close()

    def test_presets_of_the_wrong_shape_or_memory(self, w):
        N, P, dt = self.N, CachePreset, DType.FP32
        k = self.buffers("array", L, N)
        for kw, exc, match in (
                (dict(k_layers=k[:1]), ValueError, "k_layers has 1 pointers; the layout has 2 layers"),
                (dict(k_layers=k + k), ValueError, "k_layers has 4 pointers"),
                (dict(k_layers=[bytes(4 * N)] * L), TypeError, "read-only"),
                (dict(k_layers=[FakeTensor(0x1000, (N,), device="cuda")] * L, memory=Memory.HOST), ValueError,
                 "host memory but a cache tensor is on a CUDA device"),
                (dict(k_layers=[FakeTensor(0x1000, (N,), device="cuda"), k[0]]), ValueError, "host and device"),
                (dict(k_layers=[(1 << 64), 0x1000], memory=Memory.HOST), OverflowError, None),
                (dict(k_layers=[-1, 0x1000], memory=Memory.HOST), OverflowError, None)):
            with case(**{n: str(v)[:40] for n, v in kw.items()}):
                w.refused(exc, lambda: kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, dt, L, H, D, BS, NB, **kw), match)
        null = kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, dt, L, H, D, BS, NB, k_layers=[k[0], 0])  # an int: unsized
        w.refused(kvi.InvalidArgumentError, lambda: kvi.Injector(w.store, null), "layer 1 has no K base pointer")
        w.refused(ValueError, lambda: kvi.CacheLayout.preset(P.SGLANG, dt, L, H, D, BS, NB, k_layers=k,
                                                             v_layers=k[:1]), "v_layers has 1 pointers")
        for name, kind in (("num_layers", "i32"), ("num_heads", "i32"), ("head_size", "i32"), ("block_size", "i32"),
                           ("num_blocks", "i64")):
            for v in outside(kind):
                args = dict(num_layers=L, num_heads=H, head_size=D, block_size=BS, num_blocks=NB)
                args[name] = v
                with case(name, v):
                    w.refused(OverflowError, lambda: kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, dt, k_layers=k,
                                                                            **args))

    def test_layouts_by_hand(self, w):
        """Every field of a layout by hand: buffers too small for the strides, counts
        or offsets, pointer arrays of the wrong length, and every integer field one
        past int32 or int64."""
        N = self.N
        kb, vb = self.buffers("array", L, N // 2), self.buffers("array", L, N // 2)

        def hand(**kw):
            args = dict(memory=Memory.HOST, dtype=DType.FP32, num_layers=L, num_heads=H, head_size=D,
                        block_size=BS, num_blocks=NB, block_stride=BS * H * D, token_stride=H * D, head_stride=D,
                        k_layers=kb, v_layers=vb)
            args.update(kw)
            return lambda: kvi.CacheLayout(**args)

        kvi.Injector(w.store, hand()()).close()  # the fitting layout is accepted
        for kw in (dict(num_blocks=NB + 1), dict(block_size=BS + 1), dict(num_heads=H + 1, head_stride=D),
                   dict(block_stride=BS * H * D + 1), dict(block_stride=1 << 40), dict(token_stride=1 << 33),
                   dict(head_stride=(1 << 62)), dict(dim_stride=2), dict(v_block_stride=BS * H * D + 1),
                   dict(v_dim_stride=3), dict(num_blocks=(1 << 63) - 1), dict(v_layers=None, v_offset=1),
                   dict(v_layers=None, v_offset=0, k_layers=self.buffers("array", L, N), v_base=None,
                        v_token_stride=1 << 20),
                   dict(k_layers=None, k_base=self.buffers("array", 1, N // 2)[0], layer_stride=N // 2,
                        v_layers=vb),
                   dict(v_layers=None, v_base=self.buffers("array", 1, N)[0], layer_stride=N // 2 + 1),
                   dict(dtype=DType.FP16, k_layers=self.buffers("array", L, N // 4 - 1), v_layers=vb)):
            with case(**{k: str(v)[:30] for k, v in kw.items()}):
                w.refused(ValueError, hand(**kw), "bytes into it", extra=kb + vb)
        for kw, match in ((dict(k_layers=kb[:1]), "k_layers has 1 pointers"),
                          (dict(v_layers=vb + vb), "v_layers has 4 pointers"),
                          (dict(k_layers=[FakeTensor(0x1000, (N,), device="cuda")] * L), "CUDA device")):
            with case(match):
                w.refused(ValueError, hand(**kw), match)
        for v in outside("i32"):
            for name in ("num_layers", "num_heads", "head_size", "block_size"):
                with case(name, v):
                    w.refused(OverflowError, hand(**{name: v}))
        for v in outside("i64"):
            for name in ("num_blocks", "block_stride", "token_stride", "head_stride", "layer_stride", "v_offset",
                         "dim_stride", "v_block_stride", "v_token_stride", "v_head_stride", "v_dim_stride"):
                with case(name, v):
                    w.refused(OverflowError, hand(**{name: v}))
        for v in outside("u64"):
            w.refused(OverflowError, hand(k_layers=None, k_base=v))
            w.refused(OverflowError, hand(k_layers=[0x1000, v]))
        # negative strides and sizes < 1 are the library's to refuse, when the layout is used
        for kw in (dict(block_stride=-1), dict(v_offset=-4, v_layers=None), dict(num_blocks=0), dict(head_size=-1)):
            with case(**kw):
                w.refused((kvi.InvalidArgumentError, kvi.MismatchError), lambda: kvi.Injector(w.store, hand(**kw)()))
        lay = hand()()
        w.refused(ValueError, lambda: lay.set_scales(kvi.ScaleMode.PER_HEAD, [1.0] * (L * H - 1), [1.0] * L * H))

    @pytest.mark.parametrize("kind", ["numpy", "torch"])
    def test_engine_layouts_from_arrays(self, w, kind):
        """hf/vllm/sglang/vllm_cpu over numpy arrays or torch tensors: strides read from
        them fit by construction; views of the wrong dtype or memory are refused."""
        need(kind)
        if kind == "numpy":
            t = np.zeros((2, NB, BS, H, D), dtype=np.float32)
            kvi.Injector(w.store, kvi.CacheLayout.vllm([t] * L)).close()
            w.refused(TypeError, lambda: kvi.CacheLayout.vllm([np.zeros((2, NB, BS, H, D), dtype=np.int32)] * L))
            w.refused(ValueError, lambda: kvi.CacheLayout.vllm([t[:, ::2]] * L))  # not C-contiguous
            w.refused(ValueError, lambda: kvi.CacheLayout.vllm([np.zeros(10, dtype=np.float32)] * L,
                                                               shape=(2, NB, BS, H, D)), "holds 10 elements")
        else:
            t = torch.zeros((2, NB, BS, H, D))
            kvi.Injector(w.store, kvi.CacheLayout.vllm([t] * L)).close()
            kvi.Injector(w.store, kvi.CacheLayout.vllm([t[:, :, :, :, :]] * L)).close()
            kvi.Injector(w.store, kvi.CacheLayout.hf([t[0].permute(0, 2, 1, 3)] * L,
                                                     [t[1].permute(0, 2, 1, 3)] * L)).close()
            w.refused(TypeError, lambda: kvi.CacheLayout.vllm([t.to(torch.int32)] * L))
            w.refused(ValueError, lambda: kvi.CacheLayout.vllm_cpu([torch.zeros(NB, H, BS, 2 * D)[:, :, ::2]] * L))
            w.refused(ValueError, lambda: kvi.CacheLayout.sglang([torch.zeros(NB * BS, H, D)] * L,
                                                                 [torch.zeros(NB * BS, H, D)] * L, page_size=3))


class TestStoreCalls:
    def test_put_and_read(self, w):
        n = L * 2 * H * D
        k, v = array.array("f", [0.5] * n), array.array("f", [0.5] * n)
        emb = [1.0, 0.0, 0.0, 0.0]
        for call, exc in (
                (lambda: w.store.put(1, 10, k, v, embedding=emb), kvi.ExistsError),
                (lambda: w.store.put(1, 70, k, v[:-1], embedding=emb), ValueError),
                (lambda: w.store.put(1, 70, k, v, embedding=emb, num_tokens=3), ValueError),
                (lambda: w.store.put(1, 70, k, v, embedding=emb, num_tokens=0), kvi.InvalidArgumentError),
                (lambda: w.store.put(1, 70, k, v, embedding=emb, num_tokens=-1), (ValueError, OverflowError)),
                (lambda: w.store.put(1, 70, k, v, embedding=emb[:3]), ValueError),
                (lambda: w.store.put(1, 70, k, v, embedding=[math.inf] * E), kvi.InvalidArgumentError),
                (lambda: w.store.put(1, 70, k, v), kvi.InvalidArgumentError),
                (lambda: w.store.put(1, 70, array.array("i", [0] * n), array.array("i", [0] * n), embedding=emb),
                 TypeError),
                (lambda: w.store.put(1, 70, array.array("f"), array.array("f"), embedding=emb), ValueError),
                (lambda: w.store.put(1, 70, k, v, embedding=emb, dtype=DType.BF16), TypeError),
                (lambda: w.store.put(1, 70, FakeTensor(k, (L, 2, H, D), (2 * H * D, H * D, D, 2)), v, embedding=emb),
                 ValueError),
                (lambda: w.store.put(1, 70, k, v, embedding=emb, stream=-1), OverflowError),
                (lambda: w.store.read(1, 10, array.array("f", [0.0] * n), array.array("f", [0.0] * n)),
                 kvi.MismatchError),
                (lambda: w.store.read(1, 10, bytes(4 * L * 3 * H * D), bytearray(4 * L * 3 * H * D)), TypeError),
                (lambda: w.store.read(1, 99), kvi.NotFoundError),
                (lambda: w.store.remove(3, 10), kvi.NotFoundError),
                (lambda: w.store.fact_tokens(1, (1 << 64) - 1), kvi.NotFoundError)):
            with case(call.__code__.co_firstlineno):
                w.refused(exc, call)
        if np is not None:
            a = np.zeros((L, 4, H, D), dtype=np.float32)[:, ::2]
            w.refused(ValueError, lambda: w.store.put(1, 70, a, a, embedding=emb))
        if torch is not None:
            a = torch.zeros((L, 2, H, 2 * D))[..., ::2]  # head vectors not contiguous
            w.refused(ValueError, lambda: w.store.put(1, 70, a, a, embedding=emb))
            w.refused(TypeError, lambda: w.store.put(1, 70, a.to(torch.int32), a.to(torch.int32), embedding=emb))
        for name, call in (("put tenant", lambda x: w.store.put(x, 70, k, v, embedding=emb)),
                           ("put fact_id", lambda x: w.store.put(1, x, k, v, embedding=emb)),
                           ("read tenant", lambda x: w.store.read(x, 10)),
                           ("read fact_id", lambda x: w.store.read(1, x)),
                           ("remove", lambda x: w.store.remove(1, x)),
                           ("fact_tokens", lambda x: w.store.fact_tokens(x, 10)),
                           ("get_embedding", lambda x: w.store.get_embedding(1, x)),
                           ("count", lambda x: w.store.count(x)),
                           ("list", lambda x: w.store.list(x)),
                           ("prefetch", lambda x: w.store.prefetch(x)),
                           ("prefetch ids", lambda x: w.store.prefetch(1, [10, x])),
                           ("save tenant", lambda x: w.store.save("/nonexistent/x.kvi", tenant=x)),
                           ("embedding_rank", lambda x: kvi.embedding_rank(x, 1, 2))):
            for x in outside("u64"):
                with case(name, x):
                    w.refused(OverflowError, lambda: call(x))

    def test_search(self, w):
        q = [[1.0, 0.0, 0.0, 0.0]]
        ids, scores, counts = array.array("Q", [0] * 4), array.array("f", [0.0] * 4), array.array("i", [0])
        for call, exc in (
                (lambda: w.store.search(q, 1, 0), kvi.InvalidArgumentError),
                (lambda: w.store.search(q, 1, -1), kvi.InvalidArgumentError),
                (lambda: w.store.search(q, 1, kvi.SEARCH_MAX_K + 1), kvi.InvalidArgumentError),
                (lambda: w.store.search(q, 1, (1 << 31) - 1), kvi.InvalidArgumentError),  # no 16 GB of results
                (lambda: w.store.search(q, [1, 2], 2), ValueError),
                (lambda: w.store.search(q, [], 2), ValueError),
                (lambda: w.store.search([[1.0, 0.0, 0.0]], 1, 2), kvi.MismatchError),
                (lambda: w.store.search([[1.0, 0.0], [1.0]], 1, 2), ValueError),
                (lambda: w.store.search(q, 1, 5, out=(ids, scores, counts)), ValueError),
                (lambda: w.store.search(q, 1, 2, out=(ids, array.array("f", [0.0]), counts)), ValueError),
                (lambda: w.store.search(q, 1, 2, out=(ids, scores, array.array("i"))), ValueError),
                (lambda: w.store.search(q, 1, 2, out=(array.array("i", [0] * 4), scores, counts)), TypeError),
                (lambda: w.store.search(q, 1, 2, out=(ids, strided("fake", [0, 0], "f"), counts)), ValueError),
                (lambda: w.store.search(q, 1, 2, out=(bytes(32), scores, counts)), TypeError),
                (lambda: w.store.search(array.array("i", [1, 0, 0, 0]), 1, 2), TypeError),
                (lambda: w.store.search(array.array("f", [1.0, 0.0, 0.0]), 1, 2), ValueError),
                (lambda: w.store.search(q, 1, 2, workspace_bytes=-1), OverflowError)):
            with case(call.__code__.co_firstlineno):
                w.refused(exc, call)
        for v in outside("i32"):
            w.refused(OverflowError, lambda: w.store.search(q, 1, v))
        for v in outside("u64"):
            w.refused(OverflowError, lambda: w.store.search(q, v, 2))
            w.refused(OverflowError, lambda: w.store.search(q, [v], 2))
            w.refused(OverflowError, lambda: w.store.search(q, 1, 2, workspace_bytes=v))

    def test_retrieve_inject(self, w):
        R = kvi.RetrieveRequest
        q = [[1.0, 0.0, 0.0, 0.0]]
        for call, exc in (
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, 3])], (1 << 31) - 1), kvi.InvalidArgumentError),
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, 3])], 0), kvi.InvalidArgumentError),
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, 3]), R(1, [2])], 1), ValueError),
                (lambda: w.inj.retrieve_inject(q, [R(1, [1])], 2), kvi.InvalidArgumentError),  # 8 tokens, 1 block
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, NB])], 2), kvi.InvalidArgumentError),
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, 3], first_slot=-1)], 1), kvi.InvalidArgumentError),
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, 3], start_position=-1)], 1), kvi.InvalidArgumentError),
                (lambda: w.inj.retrieve_inject(q, [(1, [1, 3])], 1), TypeError),
                (lambda: w.inj.retrieve_inject(q, [R(1, [1, 3])], 2, out=(array.array("Q", [0]),
                                                                          array.array("i", [0]),
                                                                          array.array("i", [0]))), ValueError)):
            with case(call.__code__.co_firstlineno):
                w.refused(exc, call)
        for name, kind in (("tenant", "u64"), ("first_slot", "i64"), ("start_position", "i32")):
            for v in outside(kind):
                with case(name, v):
                    kw = dict(tenant=1, block_table=[1, 3])
                    kw[name] = v
                    w.refused(OverflowError, lambda: w.inj.retrieve_inject(q, [R(**kw)], 1))
        for v in outside("i32"):
            w.refused(OverflowError, lambda: w.inj.retrieve_inject(q, [R(1, [1, 3])], v))
            w.refused(OverflowError, lambda: w.inj.retrieve_inject(q, [R(1, [1, v])], 1))
        assert w.pristine()

    def test_plan_deviation_and_recompute(self, w):
        R = kvi.InjectRequest
        for call, exc in (
                (lambda: w.inj.plan(1, [10, 99]), kvi.NotFoundError),
                (lambda: w.inj.plan(1, array.array("i", [10])), TypeError),
                (lambda: w.inj.deviation([R(1, [10], [1])], L), kvi.InvalidArgumentError),
                (lambda: w.inj.deviation([R(1, [10], [1])], -1), kvi.InvalidArgumentError),
                (lambda: w.inj.deviation([R(1, [10], [1])], 0, out=array.array("f", [0.0] * 2)),
                 kvi.InvalidArgumentError),
                (lambda: w.inj.deviation([R(1, [10], [1])], 0, out=array.array("i", [0] * 3)), TypeError),
                (lambda: w.inj.deviation([R(1, [10], [1])], 0, out=strided("fake", [0, 0, 0], "f")), ValueError),
                (lambda: kvi.recompute_select([1.0] * 4, [4], boundary=-1), kvi.InvalidArgumentError),
                (lambda: kvi.recompute_select([1.0] * 4, [4], fraction=math.nan), kvi.InvalidArgumentError),
                (lambda: kvi.recompute_select([1.0] * 4, [4], fraction=1.5), kvi.InvalidArgumentError),
                (lambda: kvi.recompute_select([1.0] * 3, [4]), ValueError),
                (lambda: kvi.recompute_select([1.0] * 4, [(1 << 31) - 1]), ValueError),
                (lambda: kvi.recompute_select([1.0] * 4, [-1, 5]), kvi.InvalidArgumentError),
                (lambda: kvi.recompute_select(array.array("i", [1] * 4), [4]), TypeError),
                (lambda: kvi.recompute_select([1.0] * 4, array.array("q", [4])), TypeError),
                (lambda: kvi.recompute_select(strided("fake", [1.0] * 4, "f"), [4]), ValueError)):
            with case(call.__code__.co_firstlineno):
                w.refused(exc, call)
        if np is not None:
            w.refused(ValueError, lambda: kvi.recompute_select(np.ones(8, dtype=np.float32)[::2], [4]))
        for v in outside("i32"):
            w.refused(OverflowError, lambda: kvi.recompute_select([1.0] * 4, [4], boundary=v))
            w.refused(OverflowError, lambda: kvi.recompute_select([1.0] * 4, [4, v]))
            w.refused(OverflowError, lambda: w.inj.deviation([R(1, [10], [1])], v))
        for v in outside("u64"):
            w.refused(OverflowError, lambda: w.inj.plan(v, [10]))
            w.refused(OverflowError, lambda: w.inj.plan(1, [v]))
        assert kvi.recompute_select([1.0] * 4, [4], boundary=(1 << 31) - 1) == [0, 1, 2, 3]


class TestHandlesAndOptions:
    """Constructors and options: every integer one past its C type, sizes the library
    refuses; the store and the cache of the world stay as they were."""

    def test_integers_outside_their_types(self, w):
        P = CachePreset
        k = [array.array("f", [0.0] * CACHE) for _ in range(L)]
        calls = [
            ("Model num_layers", "i32", lambda v: kvi.Model(v, H, D)),
            ("Model num_kv_heads", "i32", lambda v: kvi.Model(L, v, D)),
            ("Model head_size", "i32", lambda v: kvi.Model(L, H, v)),
            ("Model tp_rank", "i32", lambda v: kvi.Model(L, H, D, tp_rank=v)),
            ("Model tp_size", "i32", lambda v: kvi.Model(L, H, D, tp_size=v)),
            ("set_rope layer", "i32", lambda v: w.model.set_rope(layer=v)),
            ("set_rope rotary_dim", "i32", lambda v: w.model.set_rope(rotary_dim=v)),
            ("set_rope original_max_position", "i32", lambda v: w.model.set_rope(original_max_position=v)),
            ("set_rope yarn_truncate", "i32", lambda v: w.model.set_rope(yarn_truncate=v)),
            ("get_rope layer", "i32", lambda v: w.model.get_rope(v)),
            ("rope_cos_sin layer", "i32", lambda v: w.model.rope_cos_sin(v, 0, 0)),
            ("rope_cos_sin pos", "i32", lambda v: w.model.rope_cos_sin(0, v, 0)),
            ("rope_cos_sin pair", "i32", lambda v: w.model.rope_cos_sin(0, 0, v)),
            ("Store budget_bytes", "u64", lambda v: kvi.Store(w.model, v, backend=kvi.Backend.CPU)),
            ("Store host_budget_bytes", "u64", lambda v: kvi.Store(w.model, 1 << 20, host_budget_bytes=v)),
            ("Store device", "i32", lambda v: kvi.Store(w.model, 1 << 20, device=v)),
            ("Store page_tokens", "i32", lambda v: kvi.Store(w.model, 1 << 20, page_tokens=v)),
            ("Store embedding_dim", "i32", lambda v: kvi.Store(w.model, 1 << 20, embedding_dim=v)),
            ("Injector max_tokens_per_call", "i32", lambda v: kvi.Injector(w.store, w.layout, max_tokens_per_call=v)),
            ("Encoder max_requests_per_call", "i32",
             lambda v: kvi.Encoder(w.store, w.layout, max_requests_per_call=v)),
            ("Injector max_table_entries_per_call", "i32",
             lambda v: kvi.Injector(w.store, w.layout, max_table_entries_per_call=v)),
            ("preset block_size", "i32", lambda v: kvi.CacheLayout.preset(P.VLLM_FLASH_ATTN, DType.FP32, L, H, D, v,
                                                                          NB, k_layers=k)),
            ("CommGroup size", "i32", lambda v: kvi.CommGroup(v)),
            ("embedding_rank tp_size", "i32", lambda v: kvi.embedding_rank(1, 1, v)),
            ("Comm.nccl", "u64", lambda v: kvi.Comm.nccl(v)),
            ("gather root", "i32", lambda v: w.store.gather(v, [(1, 10)])),
            ("put_scatter root", "i32", lambda v: w.store.put_scatter(v, [])),
            ("inject stream", "u64", lambda v: w.inj.inject([], stream=v)),
            ("inject_batch stream", "u64", lambda v: batch(w, stream=v)()),
            ("encode stream", "u64", lambda v: w.enc.encode([], stream=v)),
        ]
        if hasattr(kvi, "Comm"):
            group = kvi.CommGroup(1)
            calls.append(("Comm.local rank", "i32", lambda v: kvi.Comm.local(group, v)))
        for name, kind, call in calls:
            for v in outside(kind):
                with case(name, v):
                    w.refused(OverflowError, lambda: call(v))
        rope = w.model.get_rope(0)
        for kw, exc in ((dict(rotary_dim=-4, cos_sin_table=[1.0] * 8), ValueError),
                        (dict(cos_sin_table=[1.0] * (D + 1)), ValueError),
                        (dict(cos_sin_table=[1.0] * D, table_positions=2), ValueError),
                        (dict(cos_sin_table=array.array("i", [1] * D)), TypeError),
                        (dict(rotary_dim=D + 2), kvi.InvalidArgumentError),
                        (dict(layer=L), kvi.InvalidArgumentError)):
            with case(**{n: str(v)[:20] for n, v in kw.items()}):
                w.refused(exc, lambda: w.model.set_rope(**kw))
                assert w.model.get_rope(0) == rope


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
