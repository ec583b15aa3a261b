"""The session server's asyncio loop keeps running whatever its clock does between two readings, and
a stopping server exits (issue 22: about 1 benchmark run in 10 left a server that ignored SIGTERM,
its listener closed and ~50 connections in CLOSE-WAIT).

The cause: the loop step read the clock twice, once to see whether the next timer was due and once
for how long to wait for it; a timer falling due in between made the wait negative, ``ValueError``
ended the loop task, and every shielded shutdown step then waited on a loop that no longer ran. Many
timers due together (5,000 silent sessions expiring in the same 100 ms) made it likely.
"""

from __future__ import annotations

import itertools

import trio

from evergreen_trio._grpc.bridge import _open_loop


async def test_the_loop_survives_timers_falling_due_between_two_readings_of_its_clock() -> None:
    """Each reading of the loop's clock is 1 ms later than the one before: with timers 1.3 ms apart
    some fall due between the step's check and its wait (before the fix, one did within a few)."""
    fired: list[int] = []
    all_fired = trio.Event()
    timers = 300

    def fire(number: int) -> None:
        fired.append(number)
        if len(fired) == timers:
            all_fired.set()

    async with _open_loop() as loop:
        real, readings = loop.time, itertools.count()
        loop.time = lambda: real() + next(readings) * 0.001  # type: ignore[method-assign]
        for number in range(timers):
            loop.call_later(0.0005 + number * 0.0013, fire, number)
        with trio.fail_after(30):  # a hang guard
            await all_fired.wait()
    assert sorted(fired) == list(range(timers))
