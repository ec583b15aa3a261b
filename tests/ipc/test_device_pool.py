"""Growing the device pool ahead of a stream's bodies: the policy (sans-IO) and its CuPy glue.

The glue runs here against a model of CuPy's caching pool (free bytes, driver calls counted);
``tests/ipc/test_gpu.py`` runs it on CuPy's real pool on a GPU host.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.ipc.device_pool import DEFAULT_GROWTH_CAP, POOL_ROUNDING, PoolGrowth, growing_allocator
from evergreen_trio.ipc.gpu import cupy_memory

MiB = 1 << 20


def replay(growth: PoolGrowth, sizes: list[int]) -> tuple[list[int], list[int]]:
    """Allocate ``sizes`` from a pool that keeps every reserved byte; the growths and the spare after each.

    An allocation the free bytes cannot hold and no growth was made for is its own driver call.
    """
    free, growths, spares = 0, [], []
    for nbytes in sizes:
        grown = growth.grow_by(nbytes, free)
        if grown:
            free += grown
            assert free >= nbytes, "after a growth the allocation fits"
        if nbytes <= free:
            free -= nbytes
        growths.append(grown)
        spares.append(free)
    return growths, spares


sizes = st.lists(st.integers(0, 256 * MiB), max_size=80)
caps = st.sampled_from([0, 1, MiB, 64 * MiB, DEFAULT_GROWTH_CAP])


@given(sizes, caps)
def test_the_pool_grows_only_when_its_free_bytes_cannot_hold_the_allocation(sizes: list[int], cap: int) -> None:
    growth, free = PoolGrowth(cap), 0
    for nbytes in sizes:
        grown = growth.grow_by(nbytes, free)
        assert (grown > 0) == (nbytes > free and cap > 0)
        assert grown == 0 or nbytes <= grown <= max(nbytes, cap)
        free = free + grown - nbytes if grown or nbytes <= free else free


@given(sizes, caps)
def test_the_spare_is_bounded_by_the_largest_body_or_what_was_allocated_or_the_cap(sizes: list[int], cap: int) -> None:
    _, spares = replay(PoolGrowth(cap), sizes)
    for k, spare in enumerate(spares):
        assert spare <= max(max(sizes[: k + 1]), min(sum(sizes[: k + 1]), cap))


@given(st.integers(1, 512), st.integers(1, 64 * MiB))
def test_equal_bodies_under_the_cap_take_a_logarithmic_number_of_growths(count: int, size: int) -> None:
    growths, _ = replay(PoolGrowth(count * size), [size] * count)
    assert sum(1 for g in growths if g) <= math.ceil(math.log2(count)) + 1


def test_a_first_fetch_of_64_bodies_of_64_mib_grows_eight_times_not_64() -> None:
    """The case measured on the H200 (docs/ipc.md): 4 GiB in 64 MiB bodies, the default cap."""
    growths, spares = replay(PoolGrowth(), [64 * MiB] * 64)
    assert [g >> 20 for g in growths if g] == [64, 64, 128, 256, 512, 1024, 1024, 1024]
    assert spares[-1] == 0
    assert replay(PoolGrowth(0), [64 * MiB] * 64) == ([0] * 64, [0] * 64)


def test_a_negative_cap_is_refused_before_cuda_is_touched() -> None:
    with pytest.raises(ValueError, match="growth cap"):
        PoolGrowth(-1)
    with pytest.raises(ValueError, match="growth cap"):
        cupy_memory(growth_cap=-1)


class ModelPool:
    """CuPy's caching pool as far as the glue sees it: a dropped block's bytes stay free in the pool."""

    def __init__(self, device_bytes: int) -> None:
        self.device_bytes = device_bytes
        self.free = 0
        self.driver_calls = 0

    def free_bytes(self) -> int:
        return self.free

    def malloc(self, nbytes: int) -> Any:
        nbytes = -(-nbytes // POOL_ROUNDING) * POOL_ROUNDING
        if nbytes > self.free:
            if nbytes - self.free > self.device_bytes:
                raise MemoryError(f"out of memory allocating {nbytes} bytes")
            self.driver_calls += 1
            self.device_bytes -= nbytes - self.free
            self.free = nbytes
        self.free -= nbytes
        pool = self

        class Block:
            def __del__(self) -> None:
                pool.free += nbytes

        return Block()


def model_cupy() -> Any:
    return SimpleNamespace(
        uint8="uint8",
        ndarray=lambda shape, dtype, memptr: SimpleNamespace(shape=shape, dtype=dtype, memptr=memptr),
        cuda=SimpleNamespace(memory=SimpleNamespace(OutOfMemoryError=MemoryError)),
    )


def test_the_glue_cuts_the_bodies_from_the_reserved_blocks() -> None:
    pool = ModelPool(device_bytes=1 << 40)
    allocate = growing_allocator(model_cupy(), pool, PoolGrowth())
    bodies = [allocate(MiB + 1) for _ in range(64)]  # rounded to the pool's 512 bytes
    assert pool.driver_calls == 7
    assert all(body.shape == (MiB + 1,) and body.dtype == "uint8" for body in bodies)
    assert allocate(0).shape == (0,)


def test_a_growth_the_device_has_no_room_for_is_skipped_and_the_body_still_allocated() -> None:
    pool = ModelPool(device_bytes=3 * MiB)
    allocate = growing_allocator(model_cupy(), pool, PoolGrowth())
    bodies = [allocate(MiB) for _ in range(3)]  # the third body's 2 MiB growth does not fit
    assert len(bodies) == 3 and pool.driver_calls == 3 and pool.device_bytes == 0
    with pytest.raises(MemoryError):
        allocate(MiB)
