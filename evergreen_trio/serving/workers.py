"""``evergreen-trio serve --workers N``: N server processes on one port, supervised from Trio.

Each worker is an ordinary ``serve`` process listening with SO_REUSEPORT, so the kernel spreads
new connections across them (a session stays on the connection, hence on the worker, that
opened it). The supervisor holds the port with a bound, non-listening SO_REUSEPORT socket, so
``--port 0`` resolves once and a restarted worker gets the same port back. A worker that exits
while the supervisor runs is logged and restarted after a backoff that doubles while it keeps
failing (a crash loop costs little); a stopping supervisor sends every worker SIGTERM (each
drains) and SIGKILLs the ones still running after ``stop_timeout``.

A worker also beats: once its first line is out, it writes a byte to the same pipe every
``HEARTBEAT_INTERVAL`` seconds from its Trio loop. A worker silent for ``heartbeat_timeout``
(frozen by SIGSTOP, a deadlock, a loop that never yields) is SIGKILLed and restarted like one
that exited, so it stops taking its share of new connections.

Workers record metrics into prometheus_client's multiprocess files in a directory the
supervisor owns, and the supervisor serves their sum; a worker watches the supervisor's pid and
drains if it disappears, so no worker outlives it.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from evergreen_trio.errors import EvergreenTrioError
from evergreen_trio.serving.signals import STOP_DEADLINE_SECONDS

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
MAX_READY_LINE = 4096
"""The first line a worker prints (``evergreen-trio serving on ...``) is cut off past this."""

MAX_WORKERS = 1024
"""The most workers one supervisor runs: each is a whole server process, started one after another."""

HEARTBEAT_INTERVAL = 1.0
"""Seconds between a worker's heartbeats (one byte on its stdout, after its ready line); a fifth of
the timeout when that is shorter."""

HEARTBEAT_TIMEOUT = 10.0
"""Seconds without a heartbeat after which the supervisor takes a worker for hung and replaces it."""


class WorkerError(EvergreenTrioError):
    """A worker did not start: it exited, or printed no ready line in time (the message says which)."""


@dataclass(frozen=True)
class Backoff:
    """Restart delays: ``initial`` doubling per consecutive failure up to ``maximum``; a worker
    that ran ``stable_after`` seconds resets the count."""

    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 60.0

    def delay(self, failures: int) -> float:
        """The wait before restarting a worker that failed ``failures`` times in a row (>= 1)."""
        return float(min(self.maximum, self.initial * 2 ** max(0, failures - 1)))


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket that holds ``host:port`` (0: a free port) for
    the workers; it takes no connections itself. Raises OSError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def multiprocess_registry(directory: str) -> CollectorRegistry:
    """A registry that renders the sum of the metrics the workers wrote under ``directory``."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    return registry


async def wait_pid_exit(pid: int, *, poll_s: float = 1.0) -> None:
    """Return once process ``pid`` (not necessarily a child) has exited: a pidfd where Linux has
    one, else polling whether this process was re-parented away from it."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        return
    while os.getppid() == pid:  # noqa: ASYNC110 - no event to wait for without a pidfd
        await trio.sleep(poll_s)


async def heartbeat(ready: trio.Event, interval: float = HEARTBEAT_INTERVAL, fd: int | None = None) -> None:
    """A worker's side: once ``ready`` is set (its ready line is out), write one byte to ``fd`` (default:
    stdout) every ``interval`` seconds, from this Trio loop, so a frozen loop goes silent. Returns when
    the pipe closes.

    A plain write: the supervisor reads every beat, and a pipe holds 64 KiB of them (18 hours).
    """
    await ready.wait()
    fd = sys.stdout.fileno() if fd is None else fd
    while True:
        try:
            os.write(fd, b".")
        except OSError:  # the supervisor is gone (signal_self_when_gone stops this worker)
            return
        await trio.sleep(interval)


async def signal_self_when_gone(pid: int) -> None:
    """SIGTERM this process when ``pid`` (its supervisor) exits, so it drains like on a signal."""
    await wait_pid_exit(pid)
    log.warning("worker.orphaned supervisor_pid=%d", pid)
    os.kill(os.getpid(), signal.SIGTERM)


class Supervisor:
    """Runs ``count`` copies of ``command`` and keeps them running until :meth:`stop`.

    A worker is ready once it prints a line on stdout; after that, the bytes it writes there are
    heartbeats, and one silent for ``heartbeat_timeout`` seconds is killed and restarted.
    ``pids`` lists the running workers' pids by index (None while one restarts); ``hung``
    counts the workers killed for silence.
    """

    def __init__(
        self,
        command: Sequence[str],
        count: int,
        *,
        env: Mapping[str, str] | None = None,
        metrics_dir: str | None = None,
        ready_timeout: float = 60.0,
        stop_timeout: float = 45.0,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        backoff: Backoff = Backoff(),
    ) -> None:
        if not 1 <= count <= MAX_WORKERS:
            raise ValueError(f"expected 1 to {MAX_WORKERS} workers, got {count}")
        self.command = list(command)
        self.env = dict(os.environ if env is None else env)
        self.metrics_dir = metrics_dir
        if metrics_dir is not None:
            self.env[MULTIPROC_ENV] = metrics_dir
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.backoff = backoff
        self.pids: list[int | None] = [None] * count
        self.restarts = 0
        self.hung = 0
        self._processes: list[trio.Process | None] = [None] * count
        self._stopping = False
        self._reaping: set[trio.CancelScope] = set()  # _reap's waits, which a second stop() shortens

    async def run(self, *, task_status: trio.TaskStatus[list[int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker (:class:`WorkerError` if one cannot), report their pids, then keep
        them running until :meth:`stop` and every worker has exited. A :meth:`stop` while they
        start starts no more (the one its SIGTERM ended is no error) and reports those running."""
        async with trio.open_nursery() as nursery:
            for index in range(len(self.pids)):
                if self._stopping:
                    break
                try:
                    process = await self._start(index)
                except WorkerError:
                    if not self._stopping:
                        raise
                    break
                nursery.start_soon(self._keep_running, index, process)
            task_status.started([pid for pid in self.pids if pid is not None])

    @property
    def stopping(self) -> bool:
        """Whether :meth:`stop` has been called."""
        return self._stopping

    def stop(self) -> None:
        """Ask every worker to drain (SIGTERM); a second call asks again, which ends them at once, and
        SIGKILLs those still running ``STOP_DEADLINE_SECONDS`` later (a stuck one ignores the signal)."""
        again = self._stopping
        self._stopping = True
        for process in self._processes:
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
        if again:
            deadline = trio.current_time() + STOP_DEADLINE_SECONDS
            for scope in self._reaping:
                scope.deadline = min(scope.deadline, deadline)

    async def _start(self, index: int) -> trio.Process:
        # A process group of its own: a terminal's Ctrl-C (SIGINT to the foreground group) reaches only
        # the supervisor, whose one SIGTERM drains the worker; the signal twice would cut its drain short.
        process = await trio.lowlevel.open_process(self.command, stdout=subprocess.PIPE, env=self.env,
                                                   process_group=0)
        self._processes[index] = process
        try:
            line = await self._ready_line(process)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._kill(process)
            raise
        self.pids[index] = process.pid
        log.info("workers.started index=%d pid=%d ready=%r", index, process.pid, line)
        if self._stopping:  # stop() ran while this one was starting
            process.send_signal(signal.SIGTERM)
        return process

    async def _ready_line(self, process: trio.Process) -> str:
        assert process.stdout is not None
        line = bytearray()
        with trio.move_on_after(self.ready_timeout):
            while b"\n" not in line and len(line) < MAX_READY_LINE:
                data = await process.stdout.receive_some(MAX_READY_LINE)
                if not data:
                    code = await process.wait()
                    raise WorkerError(f"worker {self.command!r} exited with status {code} before it was ready")
                line += data
            # The pipe stays open: what the worker writes next are heartbeats (_watch reads them).
            return line.split(b"\n", 1)[0].decode("utf-8", "replace")
        raise WorkerError(f"worker {self.command!r} printed no ready line within {self.ready_timeout}s")

    async def _kill(self, process: trio.Process) -> None:
        if process.returncode is None:
            process.kill()
        await process.wait()
        self._forget(process.pid)

    def _forget(self, pid: int) -> None:
        if self.metrics_dir is not None:
            mark_process_dead(pid, self.metrics_dir)  # type: ignore[no-untyped-call]

    async def _keep_running(self, index: int, process: trio.Process) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            try:
                async with trio.open_nursery() as watching:
                    watching.start_soon(self._watch, process)
                    code = await process.wait()
                    watching.cancel_scope.cancel()
            finally:
                if process.returncode is None:  # cancelled: the supervisor is going away
                    with trio.CancelScope(shield=True):
                        process.send_signal(signal.SIGTERM)
                        await self._reap([process])
            self.pids[index] = None
            self._forget(process.pid)
            if self._stopping:
                log.info("workers.stopped index=%d pid=%d status=%d", index, process.pid, code)
                return
            failures = 1 if time.monotonic() - started >= self.backoff.stable_after else failures + 1
            log.warning("workers.died index=%d pid=%d status=%d restart_in_s=%.1f",
                        index, process.pid, code, self.backoff.delay(failures))
            while True:
                await trio.sleep(self.backoff.delay(failures))
                if self._stopping:
                    return
                try:
                    process = await self._start(index)
                    break
                except WorkerError as exc:
                    if self._stopping:  # stopped while it started
                        return
                    failures += 1
                    log.error("workers.restart_failed index=%d error=%s", index, exc)
            self.restarts += 1

    async def _watch(self, process: trio.Process) -> None:
        """Kill ``process`` once it stays silent for ``heartbeat_timeout``: its exit is then handled
        (logged, restarted) like any other. Ends when its stdout closes (it exits)."""
        assert process.stdout is not None
        while True:
            with trio.move_on_after(self.heartbeat_timeout):
                if not await process.stdout.receive_some(MAX_READY_LINE):
                    return
                continue
            if process.returncode is None and not self._stopping:
                self.hung += 1
                log.warning("workers.hung pid=%d silent_s=%s: killed, to be restarted", process.pid,
                            self.heartbeat_timeout)
                process.kill()
            return

    async def shutdown(self) -> None:
        """Drain every worker: :meth:`stop`, then wait for them to exit, SIGKILLing those still
        running after ``stop_timeout``."""
        self.stop()
        await self._reap([p for p in self._processes if p is not None])

    async def _reap(self, processes: Sequence[trio.Process]) -> None:
        """Wait for ``processes``, already asked to stop (once: a second SIGTERM would cut their
        drain short), and SIGKILL those still running after ``stop_timeout``."""
        with trio.move_on_after(self.stop_timeout) as waiting:
            self._reaping.add(waiting)
            try:
                for process in processes:
                    await process.wait()
            finally:
                self._reaping.discard(waiting)
        for process in processes:
            if process.returncode is None:
                log.warning("workers.killed pid=%d after_s=%s", process.pid, self.stop_timeout)
                await self._kill(process)
