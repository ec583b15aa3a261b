"""A new shared-memory server starts with warm segments: its first fetches run like later ones."""

from __future__ import annotations

import resource

import numpy as np
import pyarrow as pa
import trio

from evergreen_trio.ipc import Catalog, ServeOptions, fetch, serve
from evergreen_trio.ipc.arena import Arena
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.transports.shm import SegmentPool

GUARD_S = 30
MiB = 1 << 20


def test_catalog_window_extent_is_the_largest_streams_window() -> None:
    catalog = Catalog()
    assert catalog.window_extent(4) == 0
    catalog.add_table("small", pa.table({"a": np.ones(1000)}), max_chunksize=100)
    catalog.add_table("big", pa.table({"a": np.ones(2**16)}), max_chunksize=2**14)  # four 128 KiB bodies
    assert catalog.window_extent(2) == 2 * Arena.footprint(2**17)
    assert catalog.window_extent(16) == 4 * Arena.footprint(2**17)


def test_segment_pool_warms_its_idle_segments() -> None:
    pool = SegmentPool(8 * MiB, keep=2, most=4)
    try:
        pool.warm(0)
        first = pool.take()  # nothing warmed: a fresh, untouched segment
        assert first is not None and first.touched == 0
        pool.give_back(first, clean=True)
        pool.warm(MiB)  # tops the idle list up to keep, prefaulted
        segments = [pool.take(), pool.take()]
        assert sorted(segment.touched for segment in segments if segment is not None) == [0, MiB]
        for segment in segments:
            assert segment is not None
            pool.give_back(segment, clean=True)
    finally:
        pool.close()


async def test_a_new_servers_first_fetches_take_no_page_faults(nursery: trio.Nursery) -> None:
    """Back-to-back fetches (the next connection accepted before the last is released) each find a
    warm segment, so the server's copies take no first-touch faults from the very first fetch
    (bodies copied per stream; published ones are copied once, by the first fetch)."""
    rows = 4 * 2**20
    table = pa.table({"a": np.arange(rows, dtype=np.float64), "b": np.ones(rows)})
    catalog = Catalog()
    catalog.add_table("t", table, max_chunksize=2**18)  # 4 MiB bodies, 1,024 pages each
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=4), publish=False)
    uri = await nursery.start(serve, "shm://", catalog, options)
    with trio.fail_after(GUARD_S):
        for _ in range(2):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            got = 0
            async with fetch(str(uri), "t") as stream:
                async for batch in stream:
                    got += batch.num_rows
                    del batch
                await stream.flush_frees()
            assert got == rows
            # A first touch of the 64 MiB would be 16,384 faults; the rest of the process (pytest,
            # an xdist worker's IO thread) takes a few hundred.
            assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1024
    nursery.cancel_scope.cancel()
