"""Errors: each kvi_status raises its own exception class, carrying the status, the
C function and kvi_last_error(); failed calls change nothing; the binding's own
checks raise TypeError / ValueError before calling the library."""
from __future__ import annotations

import array
import sys

import pytest

from kvi_testutil import FakeTensor, encode, rand_values, rng
import kvinject as kvi


class TestMapping:
    def test_every_status_has_its_class(self):
        expected = {
            kvi.Status.ERR_INVALID_ARGUMENT: kvi.InvalidArgumentError, kvi.Status.ERR_STRUCT_SIZE: kvi.StructSizeError,
            kvi.Status.ERR_OUT_OF_MEMORY: kvi.OutOfMemoryError, kvi.Status.ERR_CAPACITY: kvi.CapacityError,
            kvi.Status.ERR_EXISTS: kvi.ExistsError, kvi.Status.ERR_NOT_FOUND: kvi.NotFoundError,
            kvi.Status.ERR_MISMATCH: kvi.MismatchError, kvi.Status.ERR_MEMORY_KIND: kvi.MemoryKindError,
            kvi.Status.ERR_NOT_BUILT: kvi.NotBuiltError, kvi.Status.ERR_NO_DEVICE: kvi.NoDeviceError,
            kvi.Status.ERR_CUDA: kvi.CudaError, kvi.Status.ERR_UNSUPPORTED: kvi.UnsupportedError,
            kvi.Status.ERR_INTERNAL: kvi.InternalError, kvi.Status.ERR_CORRUPT: kvi.CorruptError,
            kvi.Status.ERR_INCOMPATIBLE: kvi.IncompatibleError, kvi.Status.ERR_IO: kvi.IOError_,
            kvi.Status.ERR_PEER: kvi.PeerError, kvi.Status.ERR_TOKEN_MISMATCH: kvi.TokenMismatchError,
            kvi.Status.ERR_STALE: kvi.StaleFactError, kvi.Status.ERR_LEASED: kvi.LeasedError,
        }
        assert set(expected) == set(kvi.Status) - {kvi.Status.OK}
        classes = set()
        for st, cls in expected.items():
            assert kvi.error_class(st) is cls
            assert issubclass(cls, kvi.KviError)
            e = cls(st, "msg", "kvi_fn")
            assert (e.status, e.message, e.function) == (st, "msg", "kvi_fn")
            classes.add(cls)
        assert len(classes) == len(expected), "two statuses share a class"
        assert kvi.error_class(-999) is kvi.KviError
        assert issubclass(kvi.InvalidArgumentError, ValueError)
        assert issubclass(kvi.NotFoundError, LookupError)
        assert issubclass(kvi.OutOfMemoryError, MemoryError)

    def test_status_strings_come_from_the_library(self):
        assert kvi.status_string(kvi.Status.OK) == "success"
        assert kvi.status_string(kvi.Status.ERR_NOT_FOUND) == "fact not found"
        assert kvi.status_string(-999) == "unknown status"


class TestRaised:
    @pytest.fixture(autouse=True)
    def _setup(self):
        self.model = kvi.Model(2, 2, 8)
        self.store = kvi.Store(self.model, 4096 * 4, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32, page_tokens=4)
        # one page: 2 layers x 2 planes x 2 heads x 4 tokens x 8 x 4 bytes = 512 bytes -> 32 pages
        self.r = rng(11)
        yield
        self.store.close()
        self.model.close()

    def kv(self, tokens):
        n = 2 * tokens * 2 * 8
        return encode(rand_values(self.r, n), kvi.DType.FP32), encode(rand_values(self.r, n), kvi.DType.FP32)

    def test_invalid_argument_carries_the_message(self):
        with pytest.raises(kvi.InvalidArgumentError) as cm:
            kvi.Model(0, 2, 8)
        e = cm.value
        assert e.status == kvi.Status.ERR_INVALID_ARGUMENT
        assert e.function == "kvi_model_create"
        assert e.c_message == kvi.last_error()
        assert e.message == kvi.last_error().replace("kvi_model_create", "Model")
        assert "num_layers" in e.message
        assert e.message in str(e)
        assert isinstance(e, ValueError)

    def test_not_found(self):
        for call in (lambda: self.store.remove(1, 99), lambda: self.store.read(1, 99),
                     lambda: self.store.fact_tokens(1, 99)):
            with pytest.raises(kvi.NotFoundError) as cm:
                call()
            assert cm.value.status == kvi.Status.ERR_NOT_FOUND
            assert "99" in cm.value.message

    def test_exists_and_nothing_changes(self):
        k, v = self.kv(3)
        self.store.put(1, 5, k, v)
        k2, v2 = self.kv(3)
        with pytest.raises(kvi.ExistsError):
            self.store.put(1, 5, k2, v2)
        rk, rv = self.store.read(1, 5)
        assert list(rk) == list(k)
        self.store.put(1, 5, k2, v2, replace=True)
        rk, rv = self.store.read(1, 5)
        assert list(rk) == list(k2)

    def test_capacity_and_nothing_changes(self):
        before = self.store.stats()
        k, v = self.kv(4 * 40)  # 40 pages, the store has 32
        with pytest.raises(kvi.CapacityError):
            self.store.put(1, 1, k, v)
        after = self.store.stats()
        assert (after.facts, after.pages_used) == (before.facts, before.pages_used)
        assert self.store.count(1) == 0

    def test_mismatch(self):
        k, v = self.kv(2)
        from kvinject._buffers import as_array
        a, b = as_array(k, "k"), as_array(v, "v")
        view = kvi.KVView(kvi.Memory.HOST, kvi.DType.FP32, num_layers=2, num_tokens=2, num_heads=1, head_size=8,
                          layer_stride=2 * 2 * 8, token_stride=2 * 8, head_stride=8, k=a.ptr, v=b.ptr, keep=(a, b))
        with pytest.raises(kvi.MismatchError) as cm:
            self.store.put(1, 1, view)  # 1 head, the model holds 2
        assert "heads" in cm.value.message

    def test_memory_kind_device_tensor_to_cpu_store(self):
        n = 2 * 3 * 2 * 8
        buf = array.array("f", [1.0] * n)
        k = FakeTensor(buf, (2, 3, 2, 8), device="cuda")
        v = FakeTensor(buf, (2, 3, 2, 8), device="cuda")
        with pytest.raises(kvi.MemoryKindError) as cm:
            self.store.put(1, 1, k, v)
        assert cm.value.function == "kvi_store_put"
        assert self.store.count(1) == 0

    def test_cuda_backend_without_a_device(self):
        has_cuda = bool(kvi.features() & kvi.FEATURE_CUDA)
        if has_cuda and kvi.cuda_device_count() > 0:
            pytest.skip("a CUDA device answers here")
        expected = kvi.NoDeviceError if has_cuda else kvi.NotBuiltError
        with pytest.raises(expected) as cm:
            kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CUDA)
        assert cm.value.function == "kvi_store_create"

    def test_binding_checks(self):
        k, v = self.kv(2)
        with pytest.raises(TypeError):
            self.store.put(1, 1, k, [1, 2, 3])  # a list is no buffer
        with pytest.raises(ValueError):
            self.store.put(1, 1, k, v[:-1])  # different element counts
        with pytest.raises(ValueError):
            self.store.put(1, 1, k[:-1], v[:-1])  # not a whole number of tokens
        with pytest.raises(TypeError):
            self.store.put(1, 1, bytes(len(k) * 4), v)  # bytes read as u8 elements, v fp32
        with pytest.raises(TypeError):
            self.store.read(1, 1, bytes(16), bytes(16))  # read-only outputs
        with pytest.raises(TypeError):
            self.store.put(1, 1, k, v, stream="s")
        with pytest.raises(ValueError):
            kvi.Model(1, 1, 8).set_rope(cos_sin_table=[0.5] * 7)  # 7 values, rows of 8
        assert self.store.count(1) == 0

    def test_closed_handles(self):
        m = kvi.Model(1, 1, 8)
        m.close()
        m.close()
        with pytest.raises(ValueError):
            m.set_rope()
        s = kvi.Store(self.model, 1 << 16, backend=kvi.Backend.CPU)
        s.close()
        with pytest.raises(ValueError):
            s.count(1)


class TestPythonNames:
    """The library's messages name what the Python caller passed: the method, the
    list argument and its index, keyword arguments, enums; never C fields or
    functions. The raw message stays in c_message."""

    @pytest.fixture(autouse=True)
    def _setup(self):
        self.model = kvi.Model(2, 2, 8)
        self.model.set_rope(theta=10000.0)
        self.store = kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32)
        n = 2 * 5 * 2 * 8
        self.store.put(1, 1, array.array("f", [0.5] * n), array.array("f", [0.25] * n))
        buf = lambda: array.array("f", bytes(4 * 2 * 16 * 8))  # noqa: E731
        self.layout = kvi.CacheLayout.hf([buf(), buf()], [buf(), buf()], shape=(1, 2, 16, 8))
        self.inj = kvi.Injector(self.store, self.layout)
        self.enc = kvi.Encoder(self.store, self.layout)
        yield
        self.inj.close()
        self.enc.close()
        self.store.close()
        self.model.close()

    def message(self, cls, call, starts, *contains):
        with pytest.raises(cls) as cm:
            call()
        e = cm.value
        assert e.c_message == kvi.last_error()
        assert e.message.startswith(starts), e.message
        for c in contains:
            assert c in e.message
        for c_name in ("->", "kvi_", "KVI_", "request 0", "request 1", "capture 0", "num_positions",
                       "block_table_len"):
            assert c_name not in e.message
        assert e.message in str(e)
        return e

    def test_inject_requests(self):
        R = kvi.InjectRequest
        e = self.message(kvi.InvalidArgumentError,
                         lambda: self.inj.inject([R(1, [1], block_table=[0]), R(1, [1], block_table=[7])]),
                         "Injector.inject: requests[1]: block_table[0] is 7")
        assert "request 1: block_table[0] is 7" in e.c_message
        self.message(kvi.InvalidArgumentError, lambda: self.inj.inject(R(1, [1], block_table=[0], positions=[3, 4])),
                     "Injector.inject: requests[0]: positions has 2 values", "5 tokens")
        self.message(kvi.InvalidArgumentError, lambda: self.inj.inject(R(1, [1], block_table=[0], first_slot=-1)),
                     "Injector.inject: requests[0]: first_slot is -1")
        self.message(kvi.NotFoundError, lambda: self.inj.inject(R(1, [1, 9], block_table=[0])),
                     "Injector.inject: requests[0]: no fact 9")
        self.message(kvi.NotFoundError, lambda: self.inj.plan(1, [42]), "Injector.plan: no fact 42")

    def test_encode_captures(self):
        C = kvi.Capture
        self.message(kvi.ExistsError, lambda: self.enc.encode([C(1, 2, block_table=[0], num_tokens=3),
                                                                C(1, 1, block_table=[0], num_tokens=4)]),
                     "Encoder.encode: captures[1]: fact 1 of tenant 1 is already stored", "replace=True")
        assert self.store.count(1) == 1
        self.message(kvi.InvalidArgumentError, lambda: self.enc.encode(C(1, 2, block_table=[0], num_tokens=0)),
                     "Encoder.encode: captures[0]: num_tokens is 0")

    def test_constructors_and_options(self):
        self.message(kvi.InvalidArgumentError, lambda: kvi.Model(2, 0, 8), "Model: num_kv_heads is 0")
        self.message(kvi.InvalidArgumentError, lambda: self.model.set_rope(theta=-1.0), "Model.set_rope: theta is -1")
        self.message(kvi.InvalidArgumentError,
                     lambda: kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CPU, page_tokens=0),
                     "Store: page_tokens is 0")
        self.message(kvi.InvalidArgumentError, lambda: kvi.Store(self.model, 0, backend=kvi.Backend.CPU),
                     "Store: budget_bytes is 0")
        self.message(kvi.MismatchError, lambda: kvi.Injector(self.store, kvi.CacheLayout.hf(
            [array.array("f", bytes(4 * 256))], [array.array("f", bytes(4 * 256))], shape=(1, 2, 16, 8))),
            "Injector: layout has 1 layers")

    def test_store_files(self):
        self.message(kvi.NotFoundError, lambda: kvi.Store.load(self.model, "/nonexistent/facts.kvi", 1 << 20),
                     "Store.load: no file /nonexistent/facts.kvi")
        self.message(kvi.IOError_, lambda: self.store.journal_open("/nonexistent/dir/journal"),
                     "Store.journal_open: ")
        self.message(kvi.IOError_, lambda: self.store.save("/nonexistent/dir/facts.kvi"), "Store.save: ")

    def test_rewrites(self):
        pm = kvi.errors.python_message
        assert pm("kvi_store_search: opts->query_dtype is 9, expected KVI_DTYPE_FP32, FP16 or BF16") == \
               "Store.search: query_dtype is 9, expected DType.FP32, FP16 or BF16"
        assert pm("kvi_store_create: opts->backend is 7, not a kvi_backend") == \
               "Store: backend is 7, not a Backend"
        assert pm("this build of libkvinject has no NCCL (kvi_features())") == \
               "this build of libkvinject has no NCCL (kvinject.features())"
        assert pm("request 12: block_table_len is -1") == "requests[12]: block_table has -1 entries"
        assert pm("layer 0's RoPE was never set: give it a spec, or KVI_ROPE_NONE for a layer without "
                  "rotary embedding, with kvi_model_set_rope before creating the store") == \
               "layer 0's RoPE was never set: give it a spec, or RopeStyle.NONE for a layer without " \
               "rotary embedding, with Model.set_rope before creating the store"
        assert pm("kvi_inject_batched: batch->fact_offsets[2] is 1, below batch->fact_offsets[1] = 2") == \
               "Injector.inject_batch: fact_offsets[2] is 1, below fact_offsets[1] = 2"
        assert pm("kvi_encode_batched: batch->num_positions is 5, the captures have 6 tokens") == \
               "Encoder.encode_batch: positions has 5 values, the captures have 6 tokens"
        assert pm("kvi_unknown_thing: x") == "kvi_unknown_thing: x"  # unknown names are left


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
