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
import signal
import subprocess
import sys
import time

import trio

from benchmarks.security_session import many_sessions
from evergreen_trio._grpc.bridge import _open_loop
from evergreen_trio.serving.signals import with_stop_deadline

GRACE_S = 2
MARGIN_S = 10.0
"""After the drain grace: the final statuses' and grpclib's close deadlines (5 s each at most), and a slow machine."""


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


async def test_sigterm_stops_the_server_after_a_flood_of_silent_sessions() -> None:
    """``serve`` (a subprocess) after 5 connections x 100 silent sessions, which end together at the
    first-message deadline: SIGTERM stops it within ``--drain-grace`` plus the close deadlines, each
    time (the hang came once in about 10 benchmark runs; see the test above for its cause)."""
    for _ in range(3):
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", "--first-message-timeout", "1",
             "--max-sessions-per-peer", "10000", "--drain-grace", str(GRACE_S)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert process.stdout is not None
            line = b""
            with trio.fail_after(30):
                while b"\n" not in line:
                    line += await process.stdout.receive_some(1)
            port = int(line.split()[-1].rsplit(b":", 1)[1])
            with trio.fail_after(60):  # a hang guard
                observed = await many_sessions(port, 5)
            assert observed == "500/500 sessions ended, grpc-status 4", observed
            start = time.monotonic()
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(GRACE_S + MARGIN_S):
                await process.wait()
            assert process.returncode == 0, f"still running {time.monotonic() - start:.1f} s after SIGTERM"
        finally:
            process.kill()
            await process.wait()


async def _drained() -> int:
    return 0


def test_a_stop_that_outlives_the_stop_deadline_ends_the_process() -> None:
    """After the drain, a shutdown step that cannot be cancelled (here a shielded sleep; in the hang, a
    wait on a dead asyncio loop) is cut short by ``exit_now(1)`` at the deadline; a stop in time is not."""
    exits: list[int] = []

    async def stuck() -> None:
        await with_stop_deadline(_drained, 0.2, exits.append)()
        with trio.CancelScope(shield=True):
            await trio.sleep(1)  # five deadlines

    async def stops() -> None:
        await with_stop_deadline(_drained, 5, exits.append)()

    trio.run(stuck)
    assert exits == [1]
    exits.clear()
    trio.run(stops)
    assert exits == []
