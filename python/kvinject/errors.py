"""Exceptions: one class per kvi_status, all derived from KviError.

Every failing C call raises the class of its status, carrying the status, the
C function's name and the library's message (kvi_last_error()), which names
what was wrong and the offending value. Some classes also derive from the
built-in exception a Python caller would expect (ValueError, LookupError,
MemoryError), so ``except ValueError`` catches a bad argument whether the
binding or the library found it.
"""
from __future__ import annotations

import re
from typing import Optional

from .enums import Status


class KviError(Exception):
    """A libkvinject call failed.

    Attributes: ``status`` (a :class:`Status`, or the raw int for a value this
    binding does not know), ``function`` (the C function, or ``None`` when the
    binding itself refused the call), ``message`` (the library's message in
    Python terms: :func:`python_message`) and ``c_message``
    (``kvi_last_error()`` as the library wrote it).
    """

    def __init__(self, status: "Status | int", message: str, function: Optional[str] = None):
        try:
            status = Status(status)
        except ValueError:
            pass
        self.status = status
        self.c_message = message
        self.message = python_message(message)
        self.function = function
        name = status.name if isinstance(status, Status) else str(status)
        super().__init__("%s (%s)" % (self.message or "no message", name))


class InvalidArgumentError(KviError, ValueError):
    """KVI_ERR_INVALID_ARGUMENT: a NULL pointer, a value out of range, an unknown enum value."""


class StructSizeError(KviError):
    """KVI_ERR_STRUCT_SIZE: a struct_size the library does not accept."""


class OutOfMemoryError(KviError, MemoryError):
    """KVI_ERR_OUT_OF_MEMORY: a host allocation or the store's reservation failed."""


class CapacityError(KviError):
    """KVI_ERR_CAPACITY: too few free pages in the store (or past the transfer limits)."""


class ExistsError(KviError):
    """KVI_ERR_EXISTS: the (tenant, fact id) is stored and replace was not asked for."""


class NotFoundError(KviError, LookupError):
    """KVI_ERR_NOT_FOUND: no fact with that (tenant, fact id)."""


class MismatchError(KviError, ValueError):
    """KVI_ERR_MISMATCH: a shape or element type differs from the handle's."""


class MemoryKindError(KviError, ValueError):
    """KVI_ERR_MEMORY_KIND: host memory where device memory is needed, or the reverse."""


class NotBuiltError(KviError):
    """KVI_ERR_NOT_BUILT: the library was built without a component the call needs."""


class NoDeviceError(KviError):
    """KVI_ERR_NO_DEVICE: CUDA was asked for but no usable device answers."""


class CudaError(KviError):
    """KVI_ERR_CUDA: a CUDA runtime (or cuBLASLt) call failed."""


class UnsupportedError(KviError):
    """KVI_ERR_UNSUPPORTED: a valid request this version does not implement."""


class InternalError(KviError):
    """KVI_ERR_INTERNAL: a bug in the library; please report it with the message."""


class CorruptError(KviError):
    """KVI_ERR_CORRUPT: a store file that is truncated, damaged or not a store file."""


class IncompatibleError(KviError):
    """KVI_ERR_INCOMPATIBLE: a valid store file made for another model, slice or format."""


class IOError_(KviError, OSError):
    """KVI_ERR_IO: a file system call failed."""


class PeerError(KviError):
    """KVI_ERR_PEER: a collective call failed on another rank; nothing changed here."""


class TokenMismatchError(KviError, ValueError):
    """KVI_ERR_TOKEN_MISMATCH: a checked injection found a fact whose stored token ids are not the
    prompt's at its slots (or a fact stored without token ids); nothing was written."""


class StaleFactError(KviError):
    """KVI_ERR_STALE: an injection or retrieval named a stale fact, one whose K and V were computed
    with a fact in context that has since been removed (:meth:`kvinject.Store.stale` lists them;
    put or capture them again with ``replace=True``, or remove them); nothing was written."""


class LeasedError(KviError):
    """KVI_ERR_LEASED: a write (put, remove, encode) of a tenant of a store with a disk tier whose
    ownership lease another replica sharing the directory holds; the message names the owner and
    the milliseconds left. Nothing was written. The lease ends when the owner calls
    :meth:`kvinject.Store.tenant_release` (or closes), or runs out after its ``disk_lease_ms``."""


class StaleLayoutError(ValueError):
    """The binding's own check: a layout made from a Hugging Face cache object whose
    tensors the cache has since replaced (see :meth:`kvinject.CacheLayout.check`).
    Not a library status: nothing was called."""


_BY_STATUS = {
    Status.ERR_INVALID_ARGUMENT: InvalidArgumentError,
    Status.ERR_STRUCT_SIZE: StructSizeError,
    Status.ERR_OUT_OF_MEMORY: OutOfMemoryError,
    Status.ERR_CAPACITY: CapacityError,
    Status.ERR_EXISTS: ExistsError,
    Status.ERR_NOT_FOUND: NotFoundError,
    Status.ERR_MISMATCH: MismatchError,
    Status.ERR_MEMORY_KIND: MemoryKindError,
    Status.ERR_NOT_BUILT: NotBuiltError,
    Status.ERR_NO_DEVICE: NoDeviceError,
    Status.ERR_CUDA: CudaError,
    Status.ERR_UNSUPPORTED: UnsupportedError,
    Status.ERR_INTERNAL: InternalError,
    Status.ERR_CORRUPT: CorruptError,
    Status.ERR_INCOMPATIBLE: IncompatibleError,
    Status.ERR_IO: IOError_,
    Status.ERR_PEER: PeerError,
    Status.ERR_TOKEN_MISMATCH: TokenMismatchError,
    Status.ERR_STALE: StaleFactError,
    Status.ERR_LEASED: LeasedError,
}


# C names in the library's messages -> what a Python caller passed or calls
_C_NAMES = {
    "kvi_model_create": "Model", "kvi_model_set_rope": "Model.set_rope", "kvi_model_get_rope": "Model.get_rope",
    "kvi_model_rope_cos_sin": "Model.rope_cos_sin", "kvi_model_info_get": "Model.info",
    "kvi_store_create": "Store", "kvi_store_put": "Store.put", "kvi_store_read": "Store.read",
    "kvi_store_remove": "Store.remove", "kvi_store_fact_tokens": "Store.fact_tokens",
    "kvi_store_remove_ex": "Store.remove", "kvi_store_stale": "Store.stale",
    "kvi_store_fact_context": "Store.fact_context", "kvi_store_fact_tier": "Store.fact_tier",
    "kvi_store_tenant_release": "Store.tenant_release",
    "kvi_store_get_embedding": "Store.get_embedding", "kvi_store_prefetch": "Store.prefetch",
    "kvi_store_prefetch_wait": "Store.prefetch_wait",
    "kvi_store_count": "Store.count", "kvi_store_list": "Store.list", "kvi_store_stats_get": "Store.stats",
    "kvi_store_search": "Store.search", "kvi_store_async_errors": "Store.async_errors",
    "kvi_store_put_scatter": "Store.put_scatter", "kvi_store_gather": "Store.gather",
    "kvi_store_check_agreement": "Store.check_agreement", "kvi_store_save": "Store.save",
    "kvi_store_load": "Store.load", "kvi_store_journal_open": "Store.journal_open",
    "kvi_store_journal_close": "Store.journal_close", "kvi_cache_layout_preset": "CacheLayout.preset",
    "kvi_injector_create": "Injector", "kvi_inject": "Injector.inject", "kvi_inject_plan": "Injector.plan",
    "kvi_inject_batched": "Injector.inject_batch", "kvi_encode_batched": "Encoder.encode_batch",
    "kvi_inject_deviation": "Injector.deviation", "kvi_recompute_select": "kvinject.recompute_select",
    "kvi_injector_async_errors": "Injector.async_errors", "kvi_retrieve_inject": "Injector.retrieve_inject",
    "kvi_encoder_create": "Encoder", "kvi_encode": "Encoder.encode", "kvi_comm_create_local": "Comm.local",
    "kvi_comm_create_nccl": "Comm.nccl", "kvi_comm_group_create": "CommGroup", "kvi_comm_rank": "Comm.rank",
    "kvi_comm_async_errors": "Comm.async_errors", "kvi_features": "kvinject.features",
    "kvi_dtype": "DType", "kvi_backend": "Backend",
}
_ENUM_PREFIXES = {"KVI_DTYPE_": "DType.", "KVI_MEMORY_": "Memory.", "KVI_ROPE_": "RopeStyle.",
                  "KVI_METRIC_": "Metric.", "KVI_BACKEND_": "Backend.", "KVI_EMBEDDINGS_": "EmbeddingPlacement."}
_REWRITES = [
    # per-item prefixes: the list argument of the Python call and the item's index
    (re.compile(r"\brequest (\d+): "), r"requests[\1]: "),
    (re.compile(r"\bcapture (\d+): "), r"captures[\1]: "),
    # counts the binding derives from a Python argument's length
    (re.compile(r"\bblock_table_len is (-?\d+)"), r"block_table has \1 entries"),
    (re.compile(r"\bnum_positions is (-?\d+)"), r"positions has \1 values"),
    (re.compile(r"\bnum_facts is (-?\d+)"), r"fact_ids has \1 ids"),
    # option structs: their fields are keyword arguments or attributes of the same name
    (re.compile(r"\b(?:load_opts|opts|spec|layout|batch)->"), ""),
    (re.compile(r"\bKVI_PUT_REPLACE\b"), "replace=True"),
    (re.compile(r"\bKVI_REMOVE_KEEP_DEPENDENTS\b"), "keep_dependents=True"),
    (re.compile(r"\b(" + "|".join(sorted(_ENUM_PREFIXES, key=len, reverse=True)) + r")([A-Z0-9_]+)"),
     lambda m: _ENUM_PREFIXES[m.group(1)] + m.group(2)),
    (re.compile(r"\b(kvi_[a-z_]+)\b(?:\(\))?"),
     lambda m: _C_NAMES.get(m.group(1), m.group(0)) + ("()" if m.group(0).endswith("()") else "")),
]


def python_message(message: str) -> str:
    """A library message with its C names given as the Python binding's: the C
    function as the method (``kvi_inject`` -> ``Injector.inject``), request and
    capture indices as the list argument (``request 1:`` -> ``requests[1]:``),
    option struct fields as the keyword arguments (``opts->page_tokens`` ->
    ``page_tokens``), counts as the argument they come from
    (``block_table_len is 0`` -> ``block_table has 0 entries``), enum constants
    as the Python enums (``KVI_DTYPE_FP32`` -> ``DType.FP32``)."""
    for rx, rep in _REWRITES:
        message = rx.sub(rep, message)
    return message


def error_class(status: int) -> type:
    """The exception class for a status (KviError for one this binding does not know)."""
    try:
        return _BY_STATUS.get(Status(status), KviError)
    except ValueError:
        return KviError


def make_error(status: int, message: str, function: Optional[str] = None) -> KviError:
    """An exception of the class that matches ``status``."""
    return error_class(status)(status, message, function)
