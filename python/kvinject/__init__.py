"""kvinject: Python binding of libkvinject (ctypes over libkvinject.so).

Stores precomputed KV caches of facts and injects them into an engine's paged
KV cache, keys rotated at their destination positions. The C headers
(include/kvinject/*.h) are the manual; this package mirrors them:

    Model          kvi_model        geometry, tensor-parallel slice, RoPE per layer
    Store          kvi_store        put / read / remove / count / list / stats / search
    CacheLayout    kvi_cache_layout engine caches: hf(), vllm(), sglang(), preset()
    Injector       kvi_injector     inject(InjectRequest...), plan(), retrieve_inject(queries, RetrieveRequest...)
    Encoder        kvi_encoder      encode(Capture...)

Arrays are torch tensors (CPU or CUDA; read through data_ptr(), shape,
stride(), dtype and device, so torch is never imported here) or host buffers
(ctypes arrays, bytearray, array.array, memoryview). Streams are None (the
default stream), an int handle, or a torch.cuda.Stream. Failures raise a
KviError subclass carrying the status and kvi_last_error().

Installing: ``pip install ./python`` (from the repository) or a wheel; the
library itself is built and installed by Meson, or bundled in the wheel. The
library is found at import, first match wins (``python -m kvinject`` says
which):

1. KVINJECT_LIBRARY: the library file, or a Meson build directory (its
   lib/libkvinject.so.0); when set, nothing else is tried;
2. KVINJECT_BUILD: deprecated (warns), a build directory as in 1;
3. the library bundled in the wheel (kvinject/_libs/libkvinject.so.0);
4. the build tree of the repository this package sits in (build/lib), when
   imported from the repository's python/ directory;
5. libkvinject.so.0 in ``pkg-config --variable=libdir kvinject``;
6. ctypes.util.find_library("kvinject") (the linker cache);
7. "libkvinject.so.0" through the dynamic loader (LD_LIBRARY_PATH, rpath).

Hugging Face transformers helpers: :mod:`kvinject.hf` (RoPE and geometry from
a config, an injector for a StaticCache); vLLM: :mod:`kvinject.vllm`.
"""
from __future__ import annotations

from ._lib import lib as _lib_loader
from .cache import CacheLayout
from .comm import Comm, CommGroup, embedding_rank
from .enums import (FEATURE_CUBLASLT, FEATURE_CUDA, FEATURE_NCCL, LOAD_JOURNAL, PUT_REPLACE, REMOVE_KEEP_DEPENDENTS,
                    RETRIEVE_BEST_LAST,
                    SAVE_ONE_TENANT, SEARCH_DEFAULT_WORKSPACE, SEARCH_MAX_K, SEARCH_NO_ID, STRIDE_SAME, Backend,
                    CachePreset, DType, EmbeddingPlacement, Memory, Metric,
                    RopeScaling,
                    RopeStyle, ScaleMode, Status, Tier)
from .errors import (CapacityError, CorruptError, CudaError, ExistsError, IncompatibleError, IOError_, PeerError, InternalError, InvalidArgumentError, KviError, LeasedError,
                     MemoryKindError, MismatchError, NoDeviceError, NotBuiltError, NotFoundError,
                     OutOfMemoryError, StaleFactError, StaleLayoutError, StructSizeError, TokenMismatchError, UnsupportedError,
                     error_class)
from ._types import ArrayLike, CudaStreamLike, FloatArrayLike, IntArrayLike, StreamLike, TensorLike
from .model import Model, ModelInfoData, RopeSpec
from .store import KVView, SearchResults, Store, StoreStats
from .transfer import Capture, Encoder, InjectRequest, Injector, RetrieveRequest, recompute_select


def _run_as_main() -> bool:
    """Whether this import is ``python -m kvinject`` locating its __main__ (Python
    sets sys.argv[0] to "-m" while it imports the package)."""
    import sys
    if sys.argv[:1] != ["-m"]:
        return False
    orig = getattr(sys, "orig_argv", None)  # Python >= 3.10: the -m module's name
    if orig and "-m" in orig[:-1]:
        return orig[orig.index("-m") + 1] == "kvinject"
    return True


try:
    _L = _lib_loader()  # load at import: a missing library is an ImportError naming what was tried
except ImportError as _e:
    if _run_as_main():
        # `python -m kvinject` says what is missing in one line, not a traceback
        raise SystemExit(str(_e)) from None
    raise

__version__ = "0.1.0"


def library_path() -> str:
    """The path (or name) the library was loaded from."""
    return _L.path


def library_found_by() -> str:
    """How the library was found: one of kvinject._lib.LOOKUP_ORDER."""
    return _L.found_by


def version() -> str:
    """kvi_version_string of the loaded library."""
    return _L.kvi_version_string().decode()


def version_number() -> int:
    """kvi_version_number: major * 10000 + minor * 100 + patch."""
    return int(_L.kvi_version_number())


def features() -> int:
    """kvi_features: FEATURE_CUDA | FEATURE_CUBLASLT | FEATURE_NCCL bits of this build."""
    return int(_L.kvi_features())


def cuda_device_count() -> int:
    """kvi_cuda_device_count: usable CUDA devices; 0 without a driver, device or CUDA build."""
    import ctypes
    n = ctypes.c_int()
    st = _L.kvi_cuda_device_count(ctypes.byref(n))
    if st not in (0, Status.ERR_NOT_BUILT):
        _L.check(st, "kvi_cuda_device_count")
    return n.value


def dtype_size(dtype: DType) -> int:
    """kvi_dtype_size: bytes per element (0 for a value that is not a DType)."""
    return int(_L.kvi_dtype_size(int(dtype)))


def status_string(status: int) -> str:
    """kvi_status_string."""
    return _L.kvi_status_string(int(status)).decode()


def last_error() -> str:
    """kvi_last_error: the calling thread's last failure message ("" if none)."""
    return _L.last_error()


__all__ = [
    "ArrayLike", "CudaStreamLike", "FloatArrayLike", "IntArrayLike", "StreamLike", "TensorLike",
    "Backend", "CacheLayout", "CachePreset", "Comm", "CommGroup", "Capture", "CapacityError", "CorruptError", "CudaError", "DType",
    "EmbeddingPlacement", "Encoder", "IOError_", "IncompatibleError", "PeerError",
    "ExistsError", "FEATURE_CUBLASLT", "FEATURE_CUDA", "FEATURE_NCCL", "InjectRequest", "Injector", "RetrieveRequest",
    "InternalError", "InvalidArgumentError", "KVView", "KviError", "Memory", "MemoryKindError", "Metric",
    "MismatchError", "Model", "ModelInfoData", "NoDeviceError", "NotBuiltError", "NotFoundError",
    "LOAD_JOURNAL", "OutOfMemoryError", "PUT_REPLACE", "REMOVE_KEEP_DEPENDENTS", "SAVE_ONE_TENANT", "RETRIEVE_BEST_LAST", "RopeScaling", "RopeSpec",
    "RopeStyle", "SEARCH_DEFAULT_WORKSPACE", "SEARCH_MAX_K", "SEARCH_NO_ID", "STRIDE_SAME", "ScaleMode", "SearchResults",
    "LeasedError", "StaleLayoutError", "Status", "Store", "StoreStats", "Tier",
    "StaleFactError", "StructSizeError", "TokenMismatchError", "UnsupportedError", "cuda_device_count", "dtype_size", "embedding_rank", "error_class", "features",
    "last_error", "library_found_by", "library_path", "recompute_select", "status_string", "version", "version_number",
]
