"""Exceptions: one class per kvi_status, all derived from KviError.

Every failing C call raises the class of its status, carrying the status, the
C function's name and the library's message (kvi_last_error()), which names
what was wrong and the offending value. Some classes also derive from the
built-in exception a Python caller would expect (ValueError, LookupError,
MemoryError), so ``except ValueError`` catches a bad argument whether the
binding or the library found it.
"""
from __future__ import annotations

from typing import Optional

from .enums import Status


class KviError(Exception):
    """A libkvinject call failed.

    Attributes: ``status`` (a :class:`Status`, or the raw int for a value this
    binding does not know), ``function`` (the C function, or ``None`` when the
    binding itself refused the call) and ``message`` (``kvi_last_error()``).
    """

    def __init__(self, status: "Status | int", message: str, function: Optional[str] = None):
        try:
            status = Status(status)
        except ValueError:
            pass
        self.status = status
        self.message = message
        self.function = function
        name = status.name if isinstance(status, Status) else str(status)
        super().__init__("%s (%s)" % (message or "no message", name))


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
}


def error_class(status: int) -> type:
    """The exception class for a status (KviError for one this binding does not know)."""
    try:
        return _BY_STATUS.get(Status(status), KviError)
    except ValueError:
        return KviError


def make_error(status: int, message: str, function: Optional[str] = None) -> KviError:
    """An exception of the class that matches ``status``."""
    return error_class(status)(status, message, function)
