"""Errors: each kvi_status raises its own exception class, carrying the status, the
C function and kvi_last_error(); failed calls change nothing; the binding's own
checks raise TypeError / ValueError before calling the library."""
from __future__ import annotations

import array
import unittest

from kvi_testutil import FakeTensor, encode, rand_values, rng
import kvinject as kvi


class TestMapping(unittest.TestCase):
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
            kvi.Status.ERR_PEER: kvi.PeerError,
        }
        self.assertEqual(set(expected), set(kvi.Status) - {kvi.Status.OK})
        classes = set()
        for st, cls in expected.items():
            self.assertIs(kvi.error_class(st), cls)
            self.assertTrue(issubclass(cls, kvi.KviError))
            e = cls(st, "msg", "kvi_fn")
            self.assertEqual((e.status, e.message, e.function), (st, "msg", "kvi_fn"))
            classes.add(cls)
        self.assertEqual(len(classes), len(expected), "two statuses share a class")
        self.assertIs(kvi.error_class(-999), kvi.KviError)
        self.assertTrue(issubclass(kvi.InvalidArgumentError, ValueError))
        self.assertTrue(issubclass(kvi.NotFoundError, LookupError))
        self.assertTrue(issubclass(kvi.OutOfMemoryError, MemoryError))

    def test_status_strings_come_from_the_library(self):
        self.assertEqual(kvi.status_string(kvi.Status.OK), "success")
        self.assertEqual(kvi.status_string(kvi.Status.ERR_NOT_FOUND), "fact not found")
        self.assertEqual(kvi.status_string(-999), "unknown status")


class TestRaised(unittest.TestCase):
    def setUp(self):
        self.model = kvi.Model(2, 2, 8)
        self.store = kvi.Store(self.model, 4096 * 4, backend=kvi.Backend.CPU, dtype=kvi.DType.FP32, page_tokens=4)
        # one page: 2 layers x 2 planes x 2 heads x 4 tokens x 8 x 4 bytes = 512 bytes -> 32 pages
        self.r = rng(11)

    def tearDown(self):
        self.store.close()
        self.model.close()

    def kv(self, tokens):
        n = 2 * tokens * 2 * 8
        return encode(rand_values(self.r, n), kvi.DType.FP32), encode(rand_values(self.r, n), kvi.DType.FP32)

    def test_invalid_argument_carries_the_message(self):
        with self.assertRaises(kvi.InvalidArgumentError) as cm:
            kvi.Model(0, 2, 8)
        e = cm.exception
        self.assertEqual(e.status, kvi.Status.ERR_INVALID_ARGUMENT)
        self.assertEqual(e.function, "kvi_model_create")
        self.assertEqual(e.message, kvi.last_error())
        self.assertIn("num_layers", e.message)
        self.assertIn(e.message, str(e))
        self.assertIsInstance(e, ValueError)

    def test_not_found(self):
        for call in (lambda: self.store.remove(1, 99), lambda: self.store.read(1, 99),
                     lambda: self.store.fact_tokens(1, 99)):
            with self.assertRaises(kvi.NotFoundError) as cm:
                call()
            self.assertEqual(cm.exception.status, kvi.Status.ERR_NOT_FOUND)
            self.assertIn("99", cm.exception.message)

    def test_exists_and_nothing_changes(self):
        k, v = self.kv(3)
        self.store.put(1, 5, k, v)
        k2, v2 = self.kv(3)
        with self.assertRaises(kvi.ExistsError):
            self.store.put(1, 5, k2, v2)
        rk, rv = self.store.read(1, 5)
        self.assertEqual(list(rk), list(k))
        self.store.put(1, 5, k2, v2, replace=True)
        rk, rv = self.store.read(1, 5)
        self.assertEqual(list(rk), list(k2))

    def test_capacity_and_nothing_changes(self):
        before = self.store.stats()
        k, v = self.kv(4 * 40)  # 40 pages, the store has 32
        with self.assertRaises(kvi.CapacityError):
            self.store.put(1, 1, k, v)
        after = self.store.stats()
        self.assertEqual((after.facts, after.pages_used), (before.facts, before.pages_used))
        self.assertEqual(self.store.count(1), 0)

    def test_mismatch(self):
        k, v = self.kv(2)
        from kvinject._buffers import as_array
        a, b = as_array(k, "k"), as_array(v, "v")
        view = kvi.KVView(kvi.Memory.HOST, kvi.DType.FP32, num_layers=2, num_tokens=2, num_heads=1, head_size=8,
                          layer_stride=2 * 2 * 8, token_stride=2 * 8, head_stride=8, k=a.ptr, v=b.ptr, keep=(a, b))
        with self.assertRaises(kvi.MismatchError) as cm:
            self.store.put(1, 1, view)  # 1 head, the model holds 2
        self.assertIn("heads", cm.exception.message)

    def test_memory_kind_device_tensor_to_cpu_store(self):
        n = 2 * 3 * 2 * 8
        buf = array.array("f", [1.0] * n)
        k = FakeTensor(buf, (2, 3, 2, 8), device="cuda")
        v = FakeTensor(buf, (2, 3, 2, 8), device="cuda")
        with self.assertRaises(kvi.MemoryKindError) as cm:
            self.store.put(1, 1, k, v)
        self.assertEqual(cm.exception.function, "kvi_store_put")
        self.assertEqual(self.store.count(1), 0)

    def test_cuda_backend_without_a_device(self):
        has_cuda = bool(kvi.features() & kvi.FEATURE_CUDA)
        if has_cuda and kvi.cuda_device_count() > 0:
            self.skipTest("a CUDA device answers here")
        expected = kvi.NoDeviceError if has_cuda else kvi.NotBuiltError
        with self.assertRaises(expected) as cm:
            kvi.Store(self.model, 1 << 20, backend=kvi.Backend.CUDA)
        self.assertEqual(cm.exception.function, "kvi_store_create")

    def test_binding_checks(self):
        k, v = self.kv(2)
        with self.assertRaises(TypeError):
            self.store.put(1, 1, k, [1, 2, 3])  # a list is no buffer
        with self.assertRaises(ValueError):
            self.store.put(1, 1, k, v[:-1])  # different element counts
        with self.assertRaises(ValueError):
            self.store.put(1, 1, k[:-1], v[:-1])  # not a whole number of tokens
        with self.assertRaises(TypeError):
            self.store.put(1, 1, bytes(len(k) * 4), v)  # bytes read as u8 elements, v fp32
        with self.assertRaises(TypeError):
            self.store.read(1, 1, bytes(16), bytes(16))  # read-only outputs
        with self.assertRaises(TypeError):
            self.store.put(1, 1, k, v, stream="s")
        with self.assertRaises(ValueError):
            kvi.Model(1, 1, 8).set_rope(cos_sin_table=[0.5] * 7)  # 7 values, rows of 8
        self.assertEqual(self.store.count(1), 0)

    def test_closed_handles(self):
        m = kvi.Model(1, 1, 8)
        m.close()
        m.close()
        with self.assertRaises(ValueError):
            m.set_rope()
        s = kvi.Store(self.model, 1 << 16, backend=kvi.Backend.CPU)
        s.close()
        with self.assertRaises(ValueError):
            s.count(1)


if __name__ == "__main__":
    unittest.main()
