"""Pooled receive buffers: page-touched host memory reused once pyarrow lets go of it.

First-touch page faults cost more than the transport on this machine, so bodies are
received into recycled buffers. A buffer handed out is wrapped in a ``pyarrow`` foreign
buffer whose base is a lease; when the last array built on it is released, the lease
returns the memory to the pool.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pyarrow as pa

_MIN_CLASS = 4096
_LARGE = 1 << 20


def size_class(nbytes: int) -> int:
    """Power of two below 1 MiB, whole MiB above (8 MiB bodies waste nothing)."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    if nbytes < _LARGE:
        return 1 << (nbytes - 1).bit_length()
    return (nbytes + _LARGE - 1) // _LARGE * _LARGE


class _Lease:
    __slots__ = ("array", "pool")

    def __init__(self, pool: BufferPool, array: npt.NDArray[np.uint8]) -> None:
        self.pool = pool
        self.array = array

    def __del__(self) -> None:
        self.pool._give_back(self.array)


class BufferPool:
    """Reusable receive buffers, keeping at most ``max_bytes`` idle."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[npt.NDArray[np.uint8]]] = {}
        self.idle_bytes = 0
        self.allocated = 0

    def acquire(self, nbytes: int) -> tuple[pa.Buffer, memoryview]:
        """A pyarrow buffer of ``nbytes`` and a writable view of the same memory."""
        cls = size_class(nbytes)
        bucket = self._idle.get(cls)
        if bucket:
            array = bucket.pop()
            self.idle_bytes -= cls
        else:
            array = np.empty(cls, np.uint8)
            self.allocated += 1
        buffer = pa.foreign_buffer(array.ctypes.data, nbytes, base=_Lease(self, array))
        return buffer, array.data[:nbytes]

    def _give_back(self, array: npt.NDArray[np.uint8]) -> None:
        if self.idle_bytes + array.nbytes <= self.max_bytes:
            self._idle.setdefault(array.nbytes, []).append(array)
            self.idle_bytes += array.nbytes

    def clear(self) -> None:
        """Drop every idle buffer (leased ones return to the pool as usual)."""
        self._idle.clear()
        self.idle_bytes = 0
