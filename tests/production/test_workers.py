"""`serve --workers 2`: sessions land on both workers, a killed worker comes back, SIGTERM drains all."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import trio
from ops_helpers import held_echo, scrape, serve, wait_health

from evergreen_trio import connect, text
from evergreen_trio.serving.signals import STOP_DEADLINE_SECONDS
from evergreen_trio.serving.workers import Backoff

HANG_GUARD = 90
SESSIONS = 16  # each on its own connection: all on one worker by chance has odds of 2 in 65,536


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


async def _live_workers(metrics_url: str) -> set[str]:
    samples = await scrape(metrics_url)
    return {dict(labels)["pid"] for (name, labels), _ in samples.items() if name == "evergreen_sessions_active"}


async def test_sessions_land_on_both_workers_and_a_killed_worker_comes_back() -> None:
    result: list[str] = []
    opened, release = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with serve("--workers", "2", "--metrics-port", "0", "--drain-grace", "30", lines=3) as server:
            pids = server.worker_pids()
            assert len(pids) == 2
            assert server.lines[1].startswith("evergreen-trio workers: 2 (pids ")
            assert sorted(map(int, server.lines[1].rstrip(")").split()[-2:])) == pids
            async with trio.open_nursery() as nursery:
                for _ in range(SESSIONS):
                    nursery.start_soon(held_echo, server.address, opened, release, result)
                for _ in range(SESSIONS):
                    await opened.acquire()
                samples = await scrape(server.metrics_url)
                active = {dict(labels)["pid"]: v for (name, labels), v in samples.items()
                          if name == "evergreen_sessions_active"}
                assert set(active) == {str(pid) for pid in pids}
                assert sum(active.values()) == SESSIONS
                assert all(count > 0 for count in active.values()), active
                release.set()
            assert result == ["OK"] * SESSIONS
            samples = await scrape(server.metrics_url)
            assert samples[("evergreen_sessions_ended_total", (("code", "OK"),))] == SESSIONS

            victim = pids[0]
            os.kill(victim, signal.SIGKILL)
            # Back once its metrics appear (it has built its server) and the dead one's are gone.
            with trio.fail_after(30):
                while len(live := await _live_workers(server.metrics_url)) != 2 or str(victim) in live:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            assert str(pids[1]) in live
            await wait_health(server.address, "SERVING")
            for _ in range(4):
                async with connect(server.address) as session:
                    call = await session.run("ECHO", {"input": text("still here")}, ["output"])
                    assert await call["output"].read_text() == "still here"
            assert sorted(server.worker_pids()) == sorted(map(int, live))

            workers = server.worker_pids()
            server.signal(signal.SIGTERM)
            assert await server.process.wait() == 0
    assert not any(_alive(pid) for pid in workers)


async def test_sigterm_lets_every_worker_drain_its_sessions() -> None:
    result: list[str] = []
    opened, release = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with serve("--workers", "2", "--drain-grace", "30", lines=2) as server:
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(held_echo, server.address, opened, release, result)
                for _ in range(4):
                    await opened.acquire()
                server.signal(signal.SIGTERM)
                await wait_health(server.address, "NOT_SERVING")
                assert server.process.returncode is None
                release.set()
            assert await server.process.wait() == 0
    assert result == ["OK"] * 4


async def test_ctrl_c_in_a_terminal_lets_every_worker_drain_its_sessions() -> None:
    """Ctrl-C sends SIGINT to the whole foreground process group: the workers, sharing the
    supervisor's, got it too, then the supervisor's SIGTERM, and took the second signal for "stop
    now": every open session ended UNAVAILABLE at once instead of draining."""
    result: list[str] = []
    opened, release = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with serve("--workers", "2", "--drain-grace", "30", lines=2, own_group=True) as server:
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(held_echo, server.address, opened, release, result)
                for _ in range(4):
                    await opened.acquire()
                os.killpg(server.process.pid, signal.SIGINT)
                await trio.sleep(1)  # a cut drain ends the sessions, then the supervisor, within milliseconds
                assert server.process.returncode is None
                await wait_health(server.address, "NOT_SERVING")
                release.set()
            assert await server.process.wait() == 0
    assert result == ["OK"] * 4


async def test_a_second_sigterm_ends_a_drain_that_a_frozen_worker_holds() -> None:
    """The second signal only re-sent SIGTERM, which a frozen worker never handles: the supervisor
    waited out --drain-grace plus 15 s (45 s by default) before it killed it."""
    with trio.fail_after(HANG_GUARD):
        async with serve("--workers", "2", "--drain-grace", "60", "--worker-heartbeat-timeout", "600",
                         lines=2) as server:
            victim = server.worker_pids()[0]
            os.kill(victim, signal.SIGSTOP)
            try:
                server.signal(signal.SIGTERM)
                await trio.sleep(0.5)
                server.signal(signal.SIGTERM)
                with trio.fail_after(STOP_DEADLINE_SECONDS + 10):
                    await server.process.wait()
            finally:
                if _alive(victim):
                    os.kill(victim, signal.SIGKILL)
    assert not _alive(victim)


def test_a_taken_port_or_bad_arguments_fail_before_any_worker_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", str(port),
                               "--workers", "2"], capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", "--workers", "2",
                           "--generate-backend", "http://127.0.0.1:1", "--model", "m",
                           "--api-key-env", "EVERGREEN_NO_SUCH_VAR"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 2
    assert "EVERGREEN_NO_SUCH_VAR" in done.stderr


@pytest.mark.parametrize(("failures", "expected"), [(1, 0.5), (2, 1.0), (3, 2.0), (20, 30.0)])
def test_restart_backoff_doubles_up_to_a_ceiling(failures: int, expected: float) -> None:
    assert Backoff().delay(failures) == expected


async def test_a_frozen_worker_is_replaced_and_new_connections_are_served() -> None:
    """Issue 22, item 5: a SIGSTOPped worker sends no heartbeat; the supervisor kills it and starts
    another, and from then on every new connection is served (a frozen one hung probes 12 s)."""
    with trio.fail_after(HANG_GUARD):
        async with serve("--workers", "2", "--worker-heartbeat-timeout", "1", lines=2) as server:
            pids = server.worker_pids()
            victim = pids[0]
            os.kill(victim, signal.SIGSTOP)
            try:
                with trio.fail_after(30):
                    # Reaped by the supervisor, not only a zombie: a killed process's group leader shows
                    # Z while its other threads still exit holding the fds, its listener among them, and a
                    # connection the kernel hands that listener then is reset.
                    while victim in server.worker_pids():  # noqa: ASYNC110 - no event for another process's death
                        await trio.sleep(0.05)
            finally:
                if _alive(victim):
                    os.kill(victim, signal.SIGKILL)
            await wait_health(server.address, "SERVING")
            for _ in range(8):  # each a new connection: the kernel spreads them over both listeners
                with trio.fail_after(10):
                    async with connect(server.address) as session:
                        call = await session.run("ECHO", {"input": text("served")}, ["output"])
                        assert await call["output"].read_text() == "served"
            with trio.fail_after(30):
                while len(server.worker_pids()) != 2 or victim in server.worker_pids():  # noqa: ASYNC110
                    await trio.sleep(0.05)
