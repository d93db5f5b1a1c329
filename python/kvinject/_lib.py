"""Loading libkvinject.so and declaring its C API for ctypes.

Library lookup, first match wins (LOOKUP_ORDER, and kvinject/__init__.py's docstring):
  1. the environment variable KVINJECT_LIBRARY: the library file, or a Meson
     build directory (its lib/libkvinject.so.0 is loaded). An explicit choice:
     it loads or the import fails, nothing else is tried;
  2. KVINJECT_BUILD (deprecated, warns): a build directory, as 1;
  3. the library bundled in the wheel: kvinject/_libs/libkvinject.so.0;
  4. the build tree of the repository this package sits in
     (<repo>/build/lib/libkvinject.so.0, the README's build directory), when
     the package is imported from <repo>/python;
  5. pkg-config: libkvinject.so.0 in `pkg-config --variable=libdir kvinject`
     (an installed libkvinject whose kvinject.pc pkg-config finds, e.g. under
     PKG_CONFIG_PATH);
  6. ctypes.util.find_library("kvinject") (the linker cache, e.g. an
     installed /usr/local/lib/libkvinject.so after ldconfig);
  7. "libkvinject.so.0" through the dynamic loader (LD_LIBRARY_PATH, rpath).

Every struct below mirrors the C struct of the same name field for field;
python/tests/test_abi.py compares sizes and offsets with a C program compiled
against the headers.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import warnings
from ctypes import (POINTER, c_char_p, c_double, c_float, c_int, c_int32, c_int64, c_size_t, c_uint,
                    c_uint32, c_uint64, c_void_p)
from typing import Optional

from .errors import make_error

c_enum = c_int  # every kvi_ enum is an int-sized C enum

# ABI this binding is written for: soname libkvinject.so.0, version 0.x.
ABI_MAJOR = 0


class ModelOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_layers", c_int32),
        ("num_kv_heads", c_int32),
        ("head_size", c_int32),
        ("tp_rank", c_int32),
        ("tp_size", c_int32),
    ]


class ModelInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_layers", c_int32),
        ("num_kv_heads", c_int32),
        ("head_size", c_int32),
        ("tp_rank", c_int32),
        ("tp_size", c_int32),
        ("local_head_first", c_int32),
        ("local_heads", c_int32),
        ("head_replicas", c_int32),
    ]


class RopeSpecC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("style", c_enum),
        ("rotary_dim", c_int32),
        ("theta", c_double),
        ("scaling", c_enum),
        ("original_max_position", c_int32),
        ("factor", c_double),
        ("low_freq_factor", c_double),
        ("high_freq_factor", c_double),
        ("beta_fast", c_double),
        ("beta_slow", c_double),
        ("attention_factor", c_double),
        ("yarn_truncate", c_int32),
        ("table_dtype", c_enum),
        ("cos_sin_table", c_void_p),
        ("table_positions", c_int32),
    ]


class KVViewC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("memory", c_enum),
        ("dtype", c_enum),
        ("num_layers", c_int32),
        ("num_tokens", c_int32),
        ("num_heads", c_int32),
        ("head_size", c_int32),
        ("layer_stride", c_int64),
        ("token_stride", c_int64),
        ("head_stride", c_int64),
        ("k", c_void_p),
        ("v", c_void_p),
    ]


class StoreOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("backend", c_enum),
        ("device", c_int32),
        ("dtype", c_enum),
        ("page_tokens", c_int32),
        ("budget_bytes", c_uint64),
        ("embedding_dim", c_int32),
        ("embedding_dtype", c_enum),
        ("metric", c_enum),
        ("comm", c_void_p),
        ("embedding_placement", c_enum),
        ("host_budget_bytes", c_uint64),
        ("disk_dir", c_char_p),
        ("disk_budget_bytes", c_uint64),
        ("disk_owner", c_char_p),
        ("disk_lease_ms", c_int32),
    ]


class PutOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("flags", c_uint32),
        ("embedding", c_void_p),
        ("embedding_dtype", c_enum),
        ("embedding_memory", c_enum),
        ("token_ids", c_void_p),  # experimental
        ("context_ids", c_void_p),  # experimental
        ("num_context_ids", c_int32),
    ]


class StoreStatsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("backend", c_enum),
        ("device", c_int32),
        ("dtype", c_enum),
        ("page_tokens", c_int32),
        ("embedding_dim", c_int32),
        ("page_bytes", c_uint64),
        ("pages_total", c_uint64),
        ("pages_used", c_uint64),
        ("bytes_reserved", c_uint64),
        ("bytes_used", c_uint64),
        ("bytes_payload", c_uint64),
        ("facts", c_uint64),
        ("tenants", c_uint64),
        ("bytes_embeddings", c_uint64),
        ("pages_host_total", c_uint64),
        ("pages_host_used", c_uint64),
        ("promotions", c_uint64),
        ("demotions", c_uint64),
        ("facts_stale", c_uint64),  # experimental
        ("facts_on_disk_only", c_uint64),
        ("disk_bytes", c_uint64),
        ("disk_reads", c_uint64),
        ("disk_read_bytes", c_uint64),
        ("disk_writes", c_uint64),
        ("disk_write_bytes", c_uint64),
        ("drops_to_disk", c_uint64),
    ]


class SearchOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("query_dtype", c_enum),
        ("query_memory", c_enum),
        ("out_memory", c_enum),
        ("workspace_bytes", c_uint64),
    ]


class CacheLayoutC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("memory", c_enum),
        ("dtype", c_enum),
        ("num_layers", c_int32),
        ("num_heads", c_int32),
        ("head_size", c_int32),
        ("block_size", c_int32),
        ("num_blocks", c_int64),
        ("block_stride", c_int64),
        ("token_stride", c_int64),
        ("head_stride", c_int64),
        ("layer_stride", c_int64),
        ("v_offset", c_int64),
        ("k_layers", c_void_p),
        ("v_layers", c_void_p),
        ("k_base", c_void_p),
        ("v_base", c_void_p),
        ("scale_mode", c_enum),
        ("k_scales", c_void_p),
        ("v_scales", c_void_p),
        ("dim_stride", c_int64),
        ("v_block_stride", c_int64),
        ("v_token_stride", c_int64),
        ("v_head_stride", c_int64),
        ("v_dim_stride", c_int64),
    ]


class TransferOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("max_tokens_per_call", c_int32),
        ("max_requests_per_call", c_int32),
        ("max_table_entries_per_call", c_int32),
    ]


class InjectRequestC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tenant", c_uint64),
        ("fact_ids", c_void_p),
        ("num_facts", c_int32),
        ("block_table", c_void_p),
        ("block_table_len", c_int32),
        ("block_table_memory", c_enum),
        ("first_slot", c_int64),
        ("positions", c_void_p),
        ("start_position", c_int32),
        ("num_positions", c_int32),
        ("expect_token_ids", c_void_p),  # experimental
        ("num_expect_token_ids", c_int64),  # experimental
    ]


class InjectBatchC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_requests", c_int32),
        ("tenant", c_uint64),
        ("tenants", c_void_p),
        ("fact_ids", c_void_p),
        ("fact_ids_memory", c_enum),
        ("fact_offsets", c_void_p),
        ("block_tables", c_void_p),
        ("block_tables_memory", c_enum),
        ("block_table_stride", c_int64),
        ("block_table_len", c_int32),
        ("block_table_offsets", c_void_p),
        ("first_slots", c_void_p),
        ("position_bits", c_int32),
        ("start_positions", c_void_p),
        ("positions", c_void_p),
        ("num_positions", c_int64),
        ("index_memory", c_enum),
        ("out_tokens", c_void_p),
        ("expect_token_ids", c_void_p),  # experimental
        ("expect_token_offsets", c_void_p),
    ]


class EncodeBatchC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("num_captures", c_int32),
        ("tenant", c_uint64),
        ("tenants", c_void_p),
        ("fact_ids", c_void_p),
        ("num_tokens", c_void_p),
        ("block_tables", c_void_p),
        ("block_table_stride", c_int64),
        ("block_table_len", c_int32),
        ("block_table_offsets", c_void_p),
        ("first_slots", c_void_p),
        ("position_bits", c_int32),
        ("start_positions", c_void_p),
        ("positions", c_void_p),
        ("num_positions", c_int64),
        ("flags", c_uint32),
        ("embeddings", c_void_p),
        ("embedding_dtype", c_enum),
        ("embedding_memory", c_enum),
        ("embedding_stride", c_int64),
        ("token_ids", c_void_p),  # experimental
        ("context_ids", c_void_p),  # experimental
        ("context_offsets", c_void_p),
    ]


class InjectOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("layer_begin", c_int32),
        ("layer_end", c_int32),
        ("host_pages", c_enum),
    ]


class RecomputeOptionsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("fraction", ctypes.c_double),
        ("per_fact", c_int32),
        ("boundary", c_int32),
    ]


class CaptureC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tenant", c_uint64),
        ("fact_id", c_uint64),
        ("block_table", c_void_p),
        ("block_table_len", c_int32),
        ("first_slot", c_int64),
        ("num_tokens", c_int32),
        ("positions", c_void_p),
        ("start_position", c_int32),
        ("flags", c_uint32),
        ("embedding", c_void_p),
        ("embedding_dtype", c_enum),
        ("embedding_memory", c_enum),
        ("token_ids", c_void_p),  # experimental
        ("context_ids", c_void_p),  # experimental
        ("num_context_ids", c_int32),
    ]


class RetrieveRequestC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tenant", c_uint64),
        ("block_table", c_void_p),
        ("block_table_len", c_int32),
        ("block_table_memory", c_enum),
        ("first_slot", c_int64),
        ("start_position", c_int32),
        ("flags", c_uint32),
    ]


class ScatterItemC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tenant", c_uint64),
        ("fact_id", c_uint64),
        ("full", c_void_p),
        ("opts", c_void_p),
    ]


class GatherItemC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("tenant", c_uint64),
        ("fact_id", c_uint64),
        ("full", c_void_p),
    ]


class SaveOptionsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("flags", c_uint32),
        ("tenant", c_uint64),
    ]


class LoadOptionsC(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("flags", c_uint32),
    ]


# ctypes struct -> the C name (for messages and the ABI test)
STRUCTS = {
    "kvi_model_options": ModelOptions,
    "kvi_model_info": ModelInfo,
    "kvi_rope_spec": RopeSpecC,
    "kvi_kv_view": KVViewC,
    "kvi_store_options": StoreOptions,
    "kvi_put_options": PutOptions,
    "kvi_store_stats": StoreStatsC,
    "kvi_search_options": SearchOptions,
    "kvi_cache_layout": CacheLayoutC,
    "kvi_transfer_options": TransferOptions,
    "kvi_inject_request": InjectRequestC,
    "kvi_inject_options": InjectOptions,
    "kvi_inject_batch": InjectBatchC,
    "kvi_encode_batch": EncodeBatchC,
    "kvi_recompute_options": RecomputeOptionsC,
    "kvi_capture": CaptureC,
    "kvi_retrieve_request": RetrieveRequestC,
    "kvi_scatter_item": ScatterItemC,
    "kvi_gather_item": GatherItemC,
    "kvi_save_options": SaveOptionsC,
    "kvi_load_options": LoadOptionsC,
}

P = c_void_p
_PROTOTYPES = {
    # common.h
    "kvi_status_string": (c_char_p, [c_int]),
    "kvi_last_error": (c_char_p, []),
    "kvi_version_number": (c_uint, []),
    "kvi_version_string": (c_char_p, []),
    "kvi_features": (c_uint, []),
    "kvi_cuda_device_count": (c_int, [POINTER(c_int)]),
    "kvi_dtype_size": (c_size_t, [c_int]),
    # model.h
    "kvi_model_options_init": (c_int, [P, c_size_t]),
    "kvi_model_create": (c_int, [POINTER(c_void_p), P]),
    "kvi_model_destroy": (None, [P]),
    "kvi_model_info_get": (c_int, [P, P]),
    "kvi_rope_spec_init": (c_int, [P, c_size_t]),
    "kvi_model_set_rope": (c_int, [P, c_int32, P]),
    "kvi_model_get_rope": (c_int, [P, c_int32, P]),
    "kvi_model_rope_cos_sin": (c_int, [P, c_int32, c_int32, c_int32, POINTER(c_float), POINTER(c_float)]),
    # store.h
    "kvi_kv_view_init": (c_int, [P, c_size_t]),
    "kvi_kv_view_contiguous": (None, [P, c_int, c_int, c_int32, c_int32, c_int32, c_int32, P, P]),
    "kvi_store_options_init": (c_int, [P, c_size_t]),
    "kvi_store_create": (c_int, [POINTER(c_void_p), P, P]),
    "kvi_store_destroy": (None, [P]),
    "kvi_put_options_init": (c_int, [P, c_size_t]),
    "kvi_store_put": (c_int, [P, c_uint64, c_uint64, P, P, P]),
    "kvi_store_read": (c_int, [P, c_uint64, c_uint64, P, P]),
    "kvi_store_fact_tokens": (c_int, [P, c_uint64, c_uint64, POINTER(c_int32)]),
    "kvi_store_fact_token_ids": (c_int, [P, c_uint64, c_uint64, P, c_int32, POINTER(c_int32), POINTER(c_uint64)]),
    "kvi_store_get_embedding": (c_int, [P, c_uint64, c_uint64, P]),
    "kvi_store_remove": (c_int, [P, c_uint64, c_uint64]),
    "kvi_store_remove_ex": (c_int, [P, c_uint64, c_uint64, c_uint32]),
    "kvi_store_fact_context": (c_int, [P, c_uint64, c_uint64, P, c_int32, POINTER(c_int32), POINTER(c_int32)]),
    "kvi_store_stale": (c_int, [P, c_uint64, P, c_size_t, POINTER(c_size_t)]),
    "kvi_store_prefetch": (c_int, [P, c_uint64, P, c_int32, P]),
    "kvi_store_prefetch_wait": (c_int, [P]),
    "kvi_store_count": (c_int, [P, c_uint64, POINTER(c_size_t)]),
    "kvi_store_list": (c_int, [P, c_uint64, P, c_size_t, POINTER(c_size_t)]),
    "kvi_store_stats_get": (c_int, [P, P]),
    "kvi_store_fact_tier": (c_int, [P, c_uint64, c_uint64, POINTER(c_int32)]),
    "kvi_store_disk_changes": (c_int, [P, P, c_size_t, POINTER(c_size_t)]),
    "kvi_store_list_on_disk": (c_int, [P, c_uint64, P, c_size_t, POINTER(c_size_t)]),
    "kvi_store_tenant_release": (c_int, [P, c_uint64]),
    # search.h
    "kvi_search_options_init": (c_int, [P, c_size_t]),
    "kvi_store_search": (c_int, [P, P, c_int32, c_int32, P, c_int32, P, P, P, P, P]),
    "kvi_store_async_errors": (c_int, [P, POINTER(c_int64)]),
    # cache.h
    "kvi_cache_layout_init": (c_int, [P, c_size_t]),
    "kvi_cache_layout_preset": (c_int, [P, c_int, c_int, c_int32, c_int32, c_int32, c_int32, c_int64, P, P, P]),
    # inject.h
    "kvi_transfer_options_init": (c_int, [P, c_size_t]),
    "kvi_injector_create": (c_int, [POINTER(c_void_p), P, P, P]),
    "kvi_injector_destroy": (None, [P]),
    "kvi_inject_request_init": (c_int, [P, c_size_t]),
    "kvi_inject_options_init": (c_int, [P, c_size_t]),
    "kvi_inject": (c_int, [P, P, c_int32, P, P]),
    "kvi_inject_batch_init": (c_int, [P, c_size_t]),
    "kvi_inject_batched": (c_int, [P, P, P, P]),
    "kvi_encode_batch_init": (c_int, [P, c_size_t]),
    "kvi_encode_batched": (c_int, [P, P, P]),
    "kvi_inject_plan": (c_int, [P, c_uint64, P, c_int32, POINTER(c_int64)]),
    "kvi_injector_async_errors": (c_int, [P, POINTER(c_int64)]),
    # recompute.h
    "kvi_inject_deviation": (c_int, [P, P, c_int32, c_int32, P, c_int64, c_enum, P]),
    "kvi_recompute_options_init": (c_int, [P, c_size_t]),
    "kvi_recompute_select": (c_int, [P, P, c_int32, P, P, c_int64, POINTER(c_int64)]),
    "kvi_encoder_create": (c_int, [POINTER(c_void_p), P, P, P]),
    "kvi_encoder_destroy": (None, [P]),
    "kvi_capture_init": (c_int, [P, c_size_t]),
    "kvi_encode": (c_int, [P, P, c_int32, P]),
    "kvi_retrieve_request_init": (c_int, [P, c_size_t]),
    "kvi_retrieve_inject": (c_int, [P, P, c_int32, c_int32, P, c_int32, P, P, P, P, P]),
    # comm.h
    "kvi_comm_create_nccl": (c_int, [POINTER(c_void_p), P]),
    "kvi_comm_group_create": (c_int, [POINTER(c_void_p), c_int32]),
    "kvi_comm_group_destroy": (None, [P]),
    "kvi_comm_create_local": (c_int, [POINTER(c_void_p), P, c_int32]),
    "kvi_comm_destroy": (None, [P]),
    "kvi_comm_rank": (c_int, [P, POINTER(c_int32), POINTER(c_int32)]),
    "kvi_comm_async_errors": (c_int, [P, POINTER(c_int64)]),
    "kvi_store_embedding_rank": (c_int32, [c_uint64, c_uint64, c_int32]),
    "kvi_store_put_scatter": (c_int, [P, c_int32, P, c_int32, P]),
    "kvi_store_gather": (c_int, [P, c_int32, P, c_int32, P]),
    "kvi_store_check_agreement": (c_int, [P]),
    # persist.h
    "kvi_save_options_init": (c_int, [P, c_size_t]),
    "kvi_store_save": (c_int, [P, c_char_p, P]),
    "kvi_load_options_init": (c_int, [P, c_size_t]),
    "kvi_store_load": (c_int, [POINTER(c_void_p), P, P, c_char_p, P]),
    "kvi_store_journal_open": (c_int, [P, c_char_p, c_uint32]),
    "kvi_store_journal_close": (c_int, [P]),
}

# the _init function of each struct that has one
_INIT_FUNCTIONS = {
    ModelOptions: "kvi_model_options_init",
    RopeSpecC: "kvi_rope_spec_init",
    KVViewC: "kvi_kv_view_init",
    StoreOptions: "kvi_store_options_init",
    PutOptions: "kvi_put_options_init",
    SearchOptions: "kvi_search_options_init",
    CacheLayoutC: "kvi_cache_layout_init",
    TransferOptions: "kvi_transfer_options_init",
    InjectRequestC: "kvi_inject_request_init",
    InjectOptions: "kvi_inject_options_init",
    InjectBatchC: "kvi_inject_batch_init",
    EncodeBatchC: "kvi_encode_batch_init",
    RecomputeOptionsC: "kvi_recompute_options_init",
    CaptureC: "kvi_capture_init",
    RetrieveRequestC: "kvi_retrieve_request_init",
    SaveOptionsC: "kvi_save_options_init",
    LoadOptionsC: "kvi_load_options_init",
}


SONAME = "libkvinject.so.0"

LOOKUP_ORDER = ("KVINJECT_LIBRARY", "KVINJECT_BUILD", "the wheel's bundled library", "the repository's build tree",
                "pkg-config", 'ctypes.util.find_library("kvinject")', "the dynamic loader")


def _in_build_dir(path: str) -> str:
    """A library file as given, or a build directory's lib/libkvinject.so.0."""
    return os.path.join(path, "lib", SONAME) if os.path.isdir(path) else path


def _pkg_config_libdir() -> Optional[str]:
    exe = shutil.which("pkg-config")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, "--variable=libdir", "kvinject"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, universal_newlines=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (r.stdout.strip() or None) if r.returncode == 0 else None


def _candidates():
    """(how, path) in LOOKUP_ORDER."""
    env = os.environ.get("KVINJECT_LIBRARY")
    if env:
        # an explicit choice is never second-guessed: it loads or the import fails
        yield "KVINJECT_LIBRARY", _in_build_dir(env)
        return
    build = os.environ.get("KVINJECT_BUILD")
    if build:
        warnings.warn("kvinject: KVINJECT_BUILD is deprecated; set KVINJECT_LIBRARY to the build directory "
                      "(or the library file) instead", FutureWarning, stacklevel=4)
        yield "KVINJECT_BUILD", _in_build_dir(build)
        return
    here = os.path.dirname(os.path.abspath(__file__))
    bundled = os.path.join(here, "_libs", SONAME)
    if os.path.exists(bundled):
        yield "the wheel's bundled library", bundled
    repo = os.path.dirname(os.path.dirname(here))
    if os.path.isfile(os.path.join(repo, "meson.build")):
        for name in (SONAME, "libkvinject.so"):
            path = os.path.join(repo, "build", "lib", name)
            if os.path.exists(path):
                yield "the repository's build tree", path
                break
    libdir = _pkg_config_libdir()
    if libdir and os.path.exists(os.path.join(libdir, SONAME)):
        yield "pkg-config", os.path.join(libdir, SONAME)
    found = ctypes.util.find_library("kvinject")
    if found:
        yield 'ctypes.util.find_library("kvinject")', found
    yield "the dynamic loader", SONAME


#: Functions called with the GIL kept (through ctypes.PyDLL) rather than released: they
#: never wait on I/O nor on a lock a long call may hold, and releasing the GIL costs the
#: caller a wait to take it back whenever another Python thread runs meanwhile (up to
#: sys.getswitchinterval(), 5 ms by default; vLLM's engine core runs its scheduler and
#: its model on two threads). The structs' _init functions and the error and version
#: queries always; kvi_inject, kvi_inject_batched and kvi_inject_plan through their
#: twins (``kvi_inject_gil``, ...; ``call(..., keep_gil=True)``), which the injectors
#: call where the call is short: injections of a CUDA store without a disk tier (they
#: only enqueue device work; a CPU store's do the copy, a disk-tier store's may read
#: back from disk) and plans of any store without a disk tier.
_KEEP_GIL = ("kvi_status_string", "kvi_last_error", "kvi_version_number", "kvi_version_string")
_GIL_TWINS = ("kvi_inject", "kvi_inject_batched", "kvi_inject_plan")


class _Lib:
    """The loaded library: its ctypes functions as attributes, and its path."""

    def __init__(self):
        errors = []
        self.dll = None
        for how, path in _candidates():
            try:
                self.dll = ctypes.CDLL(path)
                self.path = path
                self.found_by = how
                break
            except OSError as e:
                errors.append("%s (%s): %s" % (path, how, e))
        if self.dll is None:
            # one line: `python -m kvinject` prints it alone
            raise ImportError("kvinject: cannot load libkvinject (this package is the Python binding; the library "
                              "is built by Meson). Install the wheel that bundles it (pip install "
                              "kvinject-*-manylinux_*.whl), or build it (meson setup build && meson compile -C "
                              "build) and set KVINJECT_LIBRARY to the build directory or the library file, or "
                              "install it (meson install -C build: pkg-config or the loader then finds it). "
                              "Tried: " + "; ".join(" ".join(e.split()) for e in errors))
        self._templates = {}  # struct type -> its initialized value (new)
        pydll = ctypes.PyDLL(self.path)  # the same library, its calls keeping the GIL
        for name, (restype, argtypes) in _PROTOTYPES.items():
            keep = name in _KEEP_GIL or name.endswith("_init")
            try:
                fn = getattr(pydll if keep else self.dll, name)
            except AttributeError:
                raise ImportError("kvinject: %s (%s) does not export %s: it is not a libkvinject this binding "
                                  "supports" % (self.path, self.found_by, name)) from None
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)
            if name in _GIL_TWINS:
                twin = getattr(pydll, name)
                twin.restype, twin.argtypes = restype, argtypes
                setattr(self, name + "_gil", twin)
        major = self.kvi_version_number() // 10000
        if major != ABI_MAJOR:
            raise ImportError("kvinject: %s is libkvinject %s; this binding supports %d.x"
                              % (self.path, self.kvi_version_string().decode(), ABI_MAJOR))

    def last_error(self) -> str:
        return self.kvi_last_error().decode("utf-8", "replace")

    def check(self, status: int, function: str) -> None:
        """Raises the exception for a failed call's status (reading kvi_last_error at once,
        on the calling thread, where the library keeps it)."""
        if status != 0:
            raise make_error(status, self.last_error(), function)

    def call(self, function: str, *args, keep_gil: bool = False) -> None:
        """Calls a kvi_ function that returns a kvi_status and raises on failure;
        keep_gil: through its twin that keeps the GIL (one of _GIL_TWINS)."""
        st = getattr(self, function + "_gil" if keep_gil else function)(*args)
        if st != 0:
            raise make_error(st, self.last_error(), function)

    def new(self, cls):
        """A struct initialized by the library's own _init function (the _INIT macro's
        values) for this binding's size of it, or with only struct_size set for output
        structs. The library writes no more than that size (a newer library with a
        larger struct fills only the fields this binding knows), and struct_size is the
        binding's own size, which every library version accepts."""
        t = self._templates.get(cls)
        if t is None:
            t = cls()
            fn = _INIT_FUNCTIONS.get(cls)
            if fn is None:
                t.struct_size = ctypes.sizeof(cls)
            else:
                self.call(fn, ctypes.byref(t), ctypes.sizeof(cls))
            self._templates[cls] = t
        # a copy of the library's initialized struct, made once per type: a hot path
        # (an injection per engine step) makes no C call for it
        return cls.from_buffer_copy(t)


def assign(s, **fields) -> None:
    """Sets struct fields, refusing values the C field cannot hold (ctypes would wrap
    them silently: a tenant of 2**64 would become 0)."""
    for name, value in fields.items():
        if value is not None and not isinstance(value, (int, float)):
            try:
                value = value.__index__()
            except AttributeError:
                raise TypeError("%s: expected a number, got %s" % (name, type(value).__name__)) from None
        setattr(s, name, value)
        if isinstance(value, int):
            got = getattr(s, name)
            if (got or 0) != value:
                raise OverflowError("%s = %d does not fit in the C field" % (name, value))


def fit(value, ctype, what: str) -> int:
    """An int argument checked to fit a C integer type (c_int32, c_uint64, ...)."""
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = value.__index__()
        except AttributeError:
            raise TypeError("%s: expected an int, got %s" % (what, type(value).__name__)) from None
    if ctype(value).value != value:
        raise OverflowError("%s = %d does not fit in %s" % (what, value, ctype.__name__))
    return value


_lib: Optional[_Lib] = None


def lib() -> _Lib:
    """The loaded library (loaded at the first call)."""
    global _lib
    if _lib is None:
        _lib = _Lib()
    return _lib
