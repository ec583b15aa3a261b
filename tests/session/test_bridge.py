"""The grpclib bridge's own housekeeping."""

from __future__ import annotations

import asyncio
import socket

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


async def test_a_trio_function_called_from_asyncio_runs() -> None:
    """The loop's own step starts it (an I/O task leaves it queued for the loop)."""

    async def from_asyncio() -> str:
        await trio_asyncio.trio_as_aio(trio.sleep)(0)
        return "done"

    async with _open_loop():
        assert await trio_asyncio.aio_as_trio(from_asyncio)() == "done"


async def test_a_timer_set_by_a_read_callback_fires() -> None:
    """An I/O task runs what its callback queued itself; a timer among it must still wake the loop
    (which waits for its earliest timer, none here)."""
    left, right = socket.socketpair()
    fired = trio.Event()
    async with _open_loop() as loop:

        def readable() -> None:
            left.recv(16)
            loop.remove_reader(left)
            loop.call_later(0.01, fired.set)

        loop.add_reader(left, readable)
        right.send(b"x")
        with trio.fail_after(5):
            await fired.wait()
    left.close()
    right.close()

