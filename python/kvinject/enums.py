"""Enumerations and constants of the C API (include/kvinject/*.h).

The values are part of the library's ABI: they are never renumbered. The test
suite compares every one with the C headers (python/tests/test_abi.py).
"""
from __future__ import annotations

import enum


class Status(enum.IntEnum):
    """kvi_status: 0 is success, errors are negative."""

    OK = 0
    ERR_INVALID_ARGUMENT = -1
    ERR_STRUCT_SIZE = -2
    ERR_OUT_OF_MEMORY = -3
    ERR_CAPACITY = -4
    ERR_EXISTS = -5
    ERR_NOT_FOUND = -6
    ERR_MISMATCH = -7
    ERR_MEMORY_KIND = -8
    ERR_NOT_BUILT = -9
    ERR_NO_DEVICE = -10
    ERR_CUDA = -11
    ERR_UNSUPPORTED = -12
    ERR_INTERNAL = -13
    ERR_CORRUPT = -14
    ERR_INCOMPATIBLE = -15
    ERR_IO = -16
    ERR_PEER = -17
    ERR_TOKEN_MISMATCH = -18
    ERR_STALE = -19
    ERR_LEASED = -20


class DType(enum.IntEnum):
    """kvi_dtype. 0 is deliberately not a type."""

    FP32 = 1
    FP16 = 2
    BF16 = 3
    FP8_E4M3 = 4
    FP8_E5M2 = 5
    Q4 = 6


class Memory(enum.IntEnum):
    """kvi_memory: where a pointer points."""

    HOST = 1
    DEVICE = 2


class Backend(enum.IntEnum):
    """kvi_backend: which implementation a handle uses."""

    AUTO = 0
    CPU = 1
    CUDA = 2


class RopeStyle(enum.IntEnum):
    """kvi_rope_style: how a layer's keys are rotated (UNSET: never set, a new model's state)."""

    UNSET = -1
    NONE = 0
    NEOX = 1
    GPTJ = 2


class RopeScaling(enum.IntEnum):
    """kvi_rope_scaling: frequency scaling (Hugging Face ``rope_scaling`` types)."""

    NONE = 0
    LINEAR = 1
    LLAMA3 = 2
    YARN = 3
    NTK = 4


class Metric(enum.IntEnum):
    """kvi_metric: how a store scores queries against fact embeddings."""

    INNER_PRODUCT = 0
    COSINE = 1


class ScaleMode(enum.IntEnum):
    """kvi_scale_mode: how fp8 cache scales are given."""

    NONE = 0
    PER_TENSOR = 1
    PER_HEAD = 2


class CachePreset(enum.IntEnum):
    """kvi_cache_preset: engine cache layouts (see include/kvinject/cache.h)."""

    VLLM_FLASH_ATTN = 1
    VLLM_FLASH_ATTN_HND = 2
    VLLM_FLASHINFER = 3
    VLLM_FLASHINFER_HND = 4
    VLLM_PACKED = 5
    VLLM_PACKED_HND = 6
    SGLANG = 7
    TRTLLM = 8
    HF_CONTIGUOUS = 9
    VLLM_CPU = 10


# kvi_cache_layout: a V stride of 0 is K's (KVI_STRIDE_SAME)
STRIDE_SAME = 0

# kvi_features() bits
FEATURE_CUDA = 0x1
FEATURE_CUBLASLT = 0x2
FEATURE_NCCL = 0x4

# kvi_put_options.flags / kvi_capture.flags
PUT_REPLACE = 0x1
REMOVE_KEEP_DEPENDENTS = 0x1  # kvi_store_remove_ex (experimental)
SAVE_ONE_TENANT = 0x1  # kvi_save_options.flags (Store.save(tenant=...))
LOAD_JOURNAL = 0x1  # kvi_load_options.flags (Store.load(journal=True))
#: kvi_retrieve_request.flags: inject the best fact last
RETRIEVE_BEST_LAST = 0x1

# kvinject/search.h
SEARCH_MAX_K = 1024
SEARCH_NO_ID = 0xFFFFFFFFFFFFFFFF
SEARCH_DEFAULT_WORKSPACE = 64 << 20


class Tier(enum.IntEnum):
    """kvi_tier: where a fact's K and V are now (:meth:`kvinject.Store.fact_tier`;
    kvinject/store.h, "Disk tier"). A CPU store's resident facts are HOST."""

    DEVICE = 0  #: device pages of a CUDA store
    HOST = 1  #: host pages: a CPU store's, or a CUDA store's host tier
    DISK = 2  #: only in the tenant's file of the disk tier: read back when used


class EmbeddingPlacement(enum.IntEnum):
    """kvi_embedding_placement (kvinject/store.h, kvinject/comm.h)."""

    REPLICATED = 0
    SHARDED = 1
