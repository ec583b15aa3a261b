"""Our server in a child process, for tests that need real process separation: a client and
server that share no event loop, thread or garbage collector, and a server that can be killed.

``python -m evergreen_trio.testing.subprocess_server [LIMITS_JSON]`` serves the
built-in actions on a free loopback port with the given :class:`~evergreen_trio.SessionLimits` fields and
prints ``port=<n>``; :func:`spawn_server` starts it and yields the address.

It stops on SIGINT or SIGTERM by cancellation (see :mod:`evergreen_trio.serving.signals`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass
from functools import partial

import trio

from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag.limits import SessionLimits
from evergreen_trio.errors import EvergreenTrioError
from evergreen_trio.serving.server import Server
from evergreen_trio.serving.signals import run_until_signal


class ServerProcessError(EvergreenTrioError):
    """The child server did not start."""


@dataclass
class ServerProcess:
    """A server in a child process: the ``Popen`` and the ``host:port`` it listens on."""

    process: subprocess.Popen[str]
    address: str

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.process.pid

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """The child's resident memory (``VmHWM`` for its peak), from /proc."""
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise ServerProcessError(f"no {field} in /proc/{self.pid}/status")


@contextmanager
def spawn_server(
    limits: SessionLimits | None = None, *, start_timeout: float = 60.0
) -> Iterator[ServerProcess]:
    """Start the server in a child process; at exit interrupt it (SIGINT) and wait."""
    args = [sys.executable, "-m", "evergreen_trio.testing.subprocess_server"]
    if limits is not None:
        args.append(json.dumps(asdict(limits)))
    with _child(args, start_timeout) as (process, line):
        if not line.startswith("port="):
            raise ServerProcessError(f"the server process printed {line!r} instead of its port")
        yield ServerProcess(process, f"127.0.0.1:{int(line.removeprefix('port='))}")


@contextmanager
def spawn_app(spec: str, *args: str, start_timeout: float = 60.0) -> Iterator[ServerProcess]:
    """``evergreen-trio serve --app SPEC --port 0 ARGS...`` in a child process (your Server, see
    ``evergreen_trio.serving.app_import.load_app``); at exit interrupt it (SIGINT) and wait."""
    command = [sys.executable, "-m", "evergreen_trio.cli", "serve", "--app", spec, "--port", "0", *args]
    with _child(command, start_timeout) as (process, line):
        found = re.search(r" on (\S+)", line)
        if not line.startswith("evergreen-trio serving") or found is None:
            raise ServerProcessError(f"serve --app {spec} printed {line!r} instead of its address")
        yield ServerProcess(process, found.group(1))


@contextmanager
def _child(command: list[str], start_timeout: float) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``command`` and yield it with its first line; at exit SIGINT it and wait (then kill)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        yield process, process.stdout.readline().strip()
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=start_timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()


@asynccontextmanager
async def serve_command(*args: str, start_timeout: float = 30.0) -> AsyncIterator[str]:
    """Run ``evergreen-trio serve --port 0 ARGS...`` as a child process (Trio) and yield the first
    line it prints (``evergreen-trio serving on HOST:PORT...``); it is terminated at exit."""
    command = [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", *args]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(start_timeout):
            while not line.endswith(b"\n"):
                line += await process.stdout.receive_some(1)
        yield line.decode()
    finally:
        process.terminate()
        await process.wait()


def main(argv: list[str]) -> None:
    limits = SessionLimits(**json.loads(argv[0])) if argv else SessionLimits()
    server = Server(limits=limits)
    register_builtin_actions(server)

    def announce(port: int) -> None:
        print(f"port={port}", flush=True)

    trio.run(partial(run_until_signal, server.serve, "127.0.0.1", 0, started=announce))


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = [
    "ServerProcess",
    "ServerProcessError",
    "serve_command",
    "spawn_app",
    "spawn_server",
]
