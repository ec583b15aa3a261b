"""The grpclib bridge's own housekeeping."""

from __future__ import annotations

import asyncio

import trio
import trio_asyncio

from evergreen_trio._grpc.bridge import _open_loop


async def test_cancelled_timers_do_not_pile_up_in_the_loop() -> None:
    """grpclib starts a timer per request with a deadline and cancels it when the request ends;
    trio-asyncio alone would keep each one until it is due."""

    async def start_and_cancel(count: int) -> int:
        loop = asyncio.get_running_loop()
        for _ in range(count):
            loop.call_later(3600, lambda: None).cancel()
            await asyncio.sleep(0)
        return len(loop._timers)  # type: ignore[attr-defined]

    async with _open_loop():
        left = await trio_asyncio.aio_as_trio(start_and_cancel)(5_000)
    assert left < 1_000
    await trio.lowlevel.checkpoint()
