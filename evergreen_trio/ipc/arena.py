"""A first-fit allocator over one shared-memory segment (sans-IO).

Regions are 64-byte aligned and separated by a 64-byte guard, so an offset the server
sends (including the end offset of a zero-length buffer) always names exactly one
region when it comes back in ``free_data``. Lowest-address-first reuse keeps the
touched pages hot.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable

from evergreen_trio.ipc.errors import LimitExceededError, SharedMemoryError

ALIGN = 64


def _round(size: int) -> int:
    return (size + ALIGN - 1) // ALIGN * ALIGN


def window_extent(body_lengths: Iterable[int], window: int) -> int:
    """Bytes from offset 0 that ``window`` live regions of these bodies can reach (first fit, lowest first)."""
    return sum(heapq.nlargest(window, (Arena.footprint(length) for length in body_lengths)))


def past_room(body_lengths: Iterable[int], room: int) -> tuple[list[int], int]:
    """The lengths that do not fit in ``room`` bytes filled first come, first served (aligned), and the room left."""
    past = []
    for length in body_lengths:
        if length + ALIGN <= room:
            room -= length + ALIGN
        else:
            past.append(length)
    return past, room


class Arena:
    """Allocate and free regions of a segment of ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // ALIGN * ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)]
        self._used: dict[int, int] = {}

    @staticmethod
    def footprint(size: int) -> int:
        """Bytes a region of ``size`` occupies: rounded up, plus the guard."""
        return _round(size) + ALIGN

    def allocate(self, size: int) -> int | None:
        """Offset of a new region of ``size`` bytes, or ``None`` until something is freed."""
        need = self.footprint(size)
        if need > self.capacity:
            raise LimitExceededError(f"shared memory: a body of {size} bytes exceeds the {self.capacity}-byte segment")
        for i, (start, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, length - need)
                self._used[start] = need
                return start
        return None

    def free(self, offset: int) -> None:
        """Return a region; neighbouring free extents are merged."""
        need = self._used.pop(offset, None)
        if need is None:
            raise SharedMemoryError(f"shared memory: expected the offset of a live region, got {offset}")
        i = bisect.bisect(self._free, (offset, need))
        self._free.insert(i, (offset, need))
        if i + 1 < len(self._free) and offset + need == self._free[i + 1][0]:
            self._free[i] = (offset, need + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            prev = self._free[i - 1]
            self._free[i - 1] = (prev[0], prev[1] + self._free.pop(i)[1])

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    def regions(self) -> dict[int, int]:
        """Live regions as offset -> footprint."""
        return dict(self._used)
