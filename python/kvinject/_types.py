"""Types of the array and stream arguments (for annotations and type checkers;
nothing here is checked at run time: kvinject/_buffers.py reads the objects).

- :class:`TensorLike`: what the binding reads of a torch tensor (data_ptr(),
  shape, stride(), dtype, device), so torch tensors and look-alikes match
  without torch being imported;
- ArrayLike: a tensor or a host buffer (ctypes array, bytes, bytearray,
  memoryview, array.array; numpy arrays are accepted at run time through the
  buffer protocol, which typing cannot name before Python 3.12);
- IntArrayLike / FloatArrayLike: also a Python sequence of ints / floats
  (ids, block tables, positions / embeddings, queries);
- StreamLike: None (the default stream), an int cudaStream_t, or an object
  with ``cuda_stream`` (torch.cuda.Stream).
"""
from __future__ import annotations

import array
import ctypes
from typing import Any, Sequence, Tuple, Union

try:
    from typing import Protocol, runtime_checkable
except ImportError:  # Python < 3.8 is not supported; keep the module importable
    Protocol = object  # type: ignore

    def runtime_checkable(cls):  # type: ignore
        return cls


@runtime_checkable
class TensorLike(Protocol):
    """A torch tensor, as the binding reads it."""

    @property
    def shape(self) -> Any: ...

    @property
    def dtype(self) -> Any: ...

    @property
    def device(self) -> Any: ...

    def data_ptr(self) -> int: ...

    def stride(self) -> Tuple[int, ...]: ...


@runtime_checkable
class CudaStreamLike(Protocol):
    """A CUDA stream object (torch.cuda.Stream): its handle in ``cuda_stream``."""

    @property
    def cuda_stream(self) -> int: ...


ArrayLike = Union[TensorLike, bytes, bytearray, memoryview, array.array, ctypes.Array]
IntArrayLike = Union[ArrayLike, Sequence[int]]
FloatArrayLike = Union[ArrayLike, Sequence[float]]
StreamLike = Union[None, int, CudaStreamLike]
