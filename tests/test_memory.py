"""evergreen_trio._memory: joins into advised huge pages equal plain joins, and never write past the end."""

from __future__ import annotations

import ctypes

import pytest

from evergreen_trio._memory import HUGE_MIN, advise_huge, joined


@pytest.mark.parametrize("total", [0, 10, HUGE_MIN - 1, HUGE_MIN, 3 * HUGE_MIN + 12345])
def test_joined_equals_bytes_join(total: int) -> None:
    head = bytes(range(256)) * 4
    body = bytearray(b"\xab" * max(0, total - len(head) - 7))
    parts = [head, memoryview(body), b"tail!!!"]
    expected = b"".join(parts)
    got = joined(parts, len(expected))
    assert isinstance(got, bytes)
    assert got == expected


def test_joined_rejects_a_wrong_total() -> None:
    parts = [b"x" * HUGE_MIN, b"y"]
    with pytest.raises(ValueError):
        joined(parts, HUGE_MIN + 2)
    with pytest.raises(ValueError):
        joined(parts, HUGE_MIN)


def test_advise_huge_ignores_small_and_unaligned_regions() -> None:
    data = bytearray(HUGE_MIN + 100)
    address = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    advise_huge(address, 10)  # below HUGE_MIN: nothing to do
    advise_huge(address + 1, len(data) - 1)  # unaligned start: rounded inward, no error
