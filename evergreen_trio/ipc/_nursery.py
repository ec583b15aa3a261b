"""A nursery for context managers whose background tasks never fail on their own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def open_quiet_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery that lets the block's own single error out as itself, not in a group.

    The tasks started here (UCX progress, pumps) end only by cancellation or hand their
    errors on, so a group holds the caller's error: callers then see the typed error
    they would see without this nursery.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
