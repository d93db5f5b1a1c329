"""The binding's ctypes declarations against the C headers: every public struct's
size and field offsets, enum sizes and constant values, as a C program compiled
against the headers prints them (struct_layout.c; Meson passes its path in
KVINJECT_STRUCT_LAYOUT). Also library lookup and the init-function path."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from kvi_testutil import case
import kvinject as kvi
from kvinject import _lib

HERE = os.path.dirname(os.path.abspath(__file__))


def _layout_program():
    path = os.environ.get("KVINJECT_STRUCT_LAYOUT")
    if path:
        return path
    repo = os.path.dirname(os.path.dirname(HERE))
    guess = os.path.join(repo, "build", "python", "kvi_struct_layout")
    return guess if os.path.exists(guess) else None


class CLayout:
    def __init__(self, text: str):
        self.sizes, self.fields, self.consts, self.enum_sizes = {}, {}, {}, {}
        self.version = None
        for line in text.splitlines():
            w = line.split()
            if w[0] == "size":
                self.sizes[w[1]] = int(w[2])
            elif w[0] == "field":
                self.fields.setdefault(w[1], []).append((w[2], int(w[3]), int(w[4])))
            elif w[0] == "const":
                self.consts[w[1]] = int(w[2])
            elif w[0] == "enumsize":
                self.enum_sizes[w[1]] = int(w[2])
            elif w[0] == "version":
                self.version = w[1]


class TestStructs:
    @pytest.fixture(autouse=True, scope="class")
    def _layout(self, request):
        prog = _layout_program()
        if not prog:
            pytest.skip("KVINJECT_STRUCT_LAYOUT is not set and no build/python/kvi_struct_layout "
                        "exists (Meson sets it: meson test --suite python)")
        out = subprocess.run([prog], check=True, stdout=subprocess.PIPE, universal_newlines=True).stdout
        request.cls.c = CLayout(out)

    def test_every_struct_matches_c(self):
        assert sorted(self.c.sizes) == sorted(_lib.STRUCTS), \
               "the C program and the binding list different structs"
        for name, cls in _lib.STRUCTS.items():
            with case(struct=name):
                assert ctypes.sizeof(cls) == self.c.sizes[name], "sizeof(%s)" % name
                py = [(f, getattr(cls, f).offset, getattr(cls, f).size) for f, _ in cls._fields_]
                assert py == self.c.fields[name], "fields of %s (name, offset, size)" % name
                assert cls._fields_[0][0] == "struct_size"

    def test_enums_are_int_sized(self):
        assert self.c.enum_sizes
        for name, size in self.c.enum_sizes.items():
            assert size == ctypes.sizeof(_lib.c_enum), name

    def test_constants(self):
        groups = [("KVI_ERR_", kvi.Status, "ERR_"), ("KVI_DTYPE_", kvi.DType, ""), ("KVI_MEMORY_", kvi.Memory, ""),
                  ("KVI_BACKEND_", kvi.Backend, ""), ("KVI_ROPE_SCALING_", kvi.RopeScaling, ""),
                  ("KVI_METRIC_", kvi.Metric, ""), ("KVI_SCALE_", kvi.ScaleMode, ""),
                  ("KVI_CACHE_", kvi.CachePreset, ""), ("KVI_EMBEDDINGS_", kvi.EmbeddingPlacement, ""),
                  ("KVI_TIER_", kvi.Tier, "")]
        seen = set()
        for prefix, enum, pyprefix in groups:
            members = {m.name: m.value for m in enum}
            if enum is kvi.Status:
                assert self.c.consts["KVI_OK"] == kvi.Status.OK
                seen.add("KVI_OK")
                members.pop("OK")
            cnames = {n[len(prefix):]: v for n, v in self.c.consts.items() if n.startswith(prefix)}
            assert {pyprefix + k: v for k, v in cnames.items()} == members, enum.__name__
            seen.update(prefix + k for k in cnames)
        styles = {n[len("KVI_ROPE_"):]: v for n, v in self.c.consts.items()
                  if n.startswith("KVI_ROPE_") and not n.startswith("KVI_ROPE_SCALING_")}
        assert styles == {m.name: m.value for m in kvi.RopeStyle}
        seen.update("KVI_ROPE_" + k for k in styles)
        singles = {"KVI_FEATURE_CUDA": kvi.FEATURE_CUDA, "KVI_FEATURE_CUBLASLT": kvi.FEATURE_CUBLASLT,
                   "KVI_FEATURE_NCCL": kvi.FEATURE_NCCL, "KVI_PUT_REPLACE": kvi.PUT_REPLACE,
                   "KVI_REMOVE_KEEP_DEPENDENTS": kvi.REMOVE_KEEP_DEPENDENTS,
                   "KVI_SEARCH_MAX_K": kvi.SEARCH_MAX_K, "KVI_SEARCH_NO_ID": kvi.SEARCH_NO_ID,
                   "KVI_SEARCH_DEFAULT_WORKSPACE": kvi.SEARCH_DEFAULT_WORKSPACE,
                   "KVI_RETRIEVE_BEST_LAST": kvi.RETRIEVE_BEST_LAST, "KVI_SAVE_ONE_TENANT": kvi.SAVE_ONE_TENANT,
                   "KVI_LOAD_JOURNAL": kvi.LOAD_JOURNAL, "KVI_STRIDE_SAME": kvi.STRIDE_SAME}
        for n, v in singles.items():
            assert self.c.consts[n] == v, n
        seen.update(singles)
        seen.add("KVI_VERSION_NUMBER")
        assert sorted(set(self.c.consts) - seen) == [], "C constants the binding does not mirror"

    def test_runtime_version_is_the_headers(self):
        assert kvi.version() == self.c.version
        assert kvi.version_number() == self.c.consts["KVI_VERSION_NUMBER"]


class TestInitPath:
    def test_structs_take_the_libraries_init_values(self):
        L = _lib.lib()
        o = L.new(_lib.StoreOptions)
        assert o.struct_size == ctypes.sizeof(_lib.StoreOptions)
        # KVI_STORE_OPTIONS_INIT (include/kvinject/store.h)
        assert (o.backend, o.device, o.dtype, o.page_tokens, o.budget_bytes, o.embedding_dim,
                o.embedding_dtype, o.metric) == \
               (kvi.Backend.AUTO, -1, kvi.DType.BF16, 16, 0, 0, kvi.DType.FP32, kvi.Metric.INNER_PRODUCT)
        assert (o.disk_dir, o.disk_budget_bytes, o.disk_owner, o.disk_lease_ms) == (None, 0, None, 30000)
        r = L.new(_lib.RopeSpecC)
        assert (r.style, r.theta, r.original_max_position, r.high_freq_factor, r.beta_fast, r.yarn_truncate,
                r.table_dtype) == (kvi.RopeStyle.NEOX, 10000.0, 8192, 4.0, 32.0, 1, kvi.DType.FP32)
        t = L.new(_lib.TransferOptions)
        assert (t.max_tokens_per_call, t.max_requests_per_call, t.max_table_entries_per_call) == \
               (1 << 20, 4096, 1 << 20)
        s = L.new(_lib.SearchOptions)
        assert (s.query_dtype, s.query_memory, s.out_memory, s.workspace_bytes) == \
               (kvi.DType.FP32, kvi.Memory.HOST, kvi.Memory.HOST, 64 << 20)
        for cls in _lib.STRUCTS.values():
            assert L.new(cls).struct_size == ctypes.sizeof(cls), cls.__name__

    def test_each_new_struct_is_a_fresh_copy_of_the_init_values(self):
        # new() copies a struct the init function filled once: changing one struct
        # must not reach the next, and every copy must hold the init values
        L = _lib.lib()
        for cls, fn in _lib._INIT_FUNCTIONS.items():
            ref = cls()
            L.call(fn, ctypes.byref(ref), ctypes.sizeof(cls))
            a = L.new(cls)
            assert bytes(a) == bytes(ref), cls.__name__
            ctypes.memset(ctypes.addressof(a), 0x5A, ctypes.sizeof(cls))
            b = L.new(cls)
            assert bytes(b) == bytes(ref) and ctypes.addressof(b) != ctypes.addressof(a), cls.__name__
        o = L.new(_lib.InjectOptions)
        o.layer_begin = 3
        assert L.new(_lib.InjectOptions).layer_begin == 0

    def test_init_writes_no_more_than_the_size_given(self):
        L = _lib.lib()
        for cls, fn in _lib._INIT_FUNCTIONS.items():
            name, full = cls.__name__, ctypes.sizeof(cls)
            buf = ctypes.create_string_buffer(b"\xa5" * (full + 64), full + 64)
            # an older caller's struct, one byte short of this library's: refused,
            # except where that is still the first version; never written past
            small = full - 8
            st = getattr(L, fn)(buf, small)
            assert st in (0, kvi.Status.ERR_STRUCT_SIZE), name
            assert buf.raw[small:] == b"\xa5" * (full + 64 - small), name
            if st == 0:
                assert ctypes.c_size_t.from_buffer(buf).value == small, name
            # a newer caller's larger struct: the bytes past this library's fields are zeroed
            assert getattr(L, fn)(buf, full + 16) == 0, name
            assert ctypes.c_size_t.from_buffer(buf).value == full + 16, name
            assert buf.raw[full:full + 16] == bytes(16), name
            assert buf.raw[full + 16:] == b"\xa5" * 48, name
            assert getattr(L, fn)(None, full) == kvi.Status.ERR_INVALID_ARGUMENT, name

    def test_struct_size_errors_map(self):
        L = _lib.lib()
        m = kvi.Model(1, 1, 8)
        o = L.new(_lib.StoreOptions)
        o.budget_bytes = 1 << 20
        o.struct_size = 4  # smaller than the first version
        h = ctypes.c_void_p()
        with pytest.raises(kvi.StructSizeError) as cm:
            L.call("kvi_store_create", ctypes.byref(h), m.handle, ctypes.byref(o))
        assert cm.value.status == kvi.Status.ERR_STRUCT_SIZE
        assert "struct_size" in cm.value.message
        # a larger struct with a non-zero byte past the known fields
        big = ctypes.create_string_buffer(ctypes.sizeof(o) + 8)
        o.struct_size = ctypes.sizeof(o) + 8
        ctypes.memmove(big, ctypes.addressof(o), ctypes.sizeof(o))
        big[ctypes.sizeof(o) + 3] = b"\x01"
        with pytest.raises(kvi.StructSizeError):
            L.call("kvi_store_create", ctypes.byref(h), m.handle, big)
        assert not h.value


class TestLibraryLookup:
    def _run(self, env_lib):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE)] + sys.path)
        if env_lib is None:
            env.pop("KVINJECT_LIBRARY", None)
        else:
            env["KVINJECT_LIBRARY"] = env_lib
        return subprocess.run([sys.executable, "-c", "import kvinject; print(kvinject.library_path())"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)

    def test_env_var_is_used(self):
        path = kvi.library_path()
        r = self._run(os.path.abspath(path) if os.path.exists(path) else path)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == (os.path.abspath(path) if os.path.exists(path) else path)

    def test_env_var_that_does_not_load_fails_clearly(self):
        r = self._run("/nonexistent/libkvinject.so")
        assert r.returncode != 0
        assert "ImportError" in r.stderr
        assert "KVINJECT_LIBRARY" in r.stderr
        assert "/nonexistent/libkvinject.so" in r.stderr

    def test_library_that_is_not_libkvinject(self):
        libc = ctypes.util.find_library("c")
        if not libc:
            pytest.skip("no libc to load")
        r = self._run(libc)
        assert r.returncode != 0
        assert "does not export kvi_" in r.stderr


if __name__ == "__main__":
    from kvi_testutil import run_pytest
    sys.exit(run_pytest(__file__, sys.argv[1:]))
