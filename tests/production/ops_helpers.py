"""Helpers for the production tests: `serve` as a user runs it, a grpcio health client, a scraper."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from evergreen_trio import NodeRef, SessionAbortedError, connect
from evergreen_trio.testing.wire import health_status

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]




async def health(address: str, service: str = "") -> str:
    return await trio.to_thread.run_sync(health_status, address, service)


async def wait_health(address: str, expected: str, service: str = "") -> None:
    with trio.fail_after(30):
        while await health(address, service) != expected:  # noqa: ASYNC110 - polling a peer
            await trio.sleep(0.05)


async def scrape(url: str) -> Samples:
    """Every sample an exporter serves, keyed by (name, sorted labels)."""
    async with httpx.AsyncClient(timeout=10) as client:
        response = await client.get(url)
    assert response.status_code == 200, response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class ServeProcess:
    """``evergreen-trio serve`` in a child process and the lines it printed at start."""

    process: trio.Process
    lines: list[str]
    stderr: bytearray = field(default_factory=bytearray)

    @property
    def address(self) -> str:
        return self.lines[0].split()[3]

    @property
    def metrics_url(self) -> str:
        (line,) = [line for line in self.lines if line.startswith("evergreen-trio metrics on ")]
        return line.split()[-1]

    def worker_pids(self) -> list[int]:
        """The supervisor's children, from /proc (Linux): any of its threads may have forked them."""
        pids: list[int] = []
        for children in Path(f"/proc/{self.process.pid}/task").glob("*/children"):
            with contextlib.suppress(FileNotFoundError):  # a thread that just exited
                pids += [int(p) for p in children.read_text().split()]
        return sorted(pids)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)


@asynccontextmanager
async def serve(*args: str, lines: int = 1, start_timeout: float = 60.0,
                own_group: bool = False) -> AsyncIterator[ServeProcess]:
    """Run ``python -m evergreen_trio.cli serve --port 0 ARGS...`` and wait for its first ``lines``
    lines; at exit SIGTERM it (a second SIGTERM ends a drain) and wait. ``own_group``: in a process
    group of its own, as a shell runs a foreground job (``os.killpg`` is then a terminal's Ctrl-C)."""
    command = [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", *args]
    process = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                               process_group=0 if own_group else None)
    try:
        assert process.stdout is not None
        data = b""
        with trio.fail_after(start_timeout):
            while data.count(b"\n") < lines:
                chunk = await process.stdout.receive_some(4096)
                assert chunk, f"serve exited ({await process.wait()}) after printing {data!r}"
                data += chunk
        yield ServeProcess(process, data.decode().splitlines())
    finally:
        with trio.CancelScope(shield=True):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(5):
                    await process.wait()
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                with trio.move_on_after(30):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def held_echo(address: str, opened: trio.Semaphore, release: trio.Event, result: list[str]) -> None:
    """A session whose ECHO waits for the rest of its input until ``release``; appends "OK" with
    the echoed text checked, or the status name it was aborted with."""
    try:
        async with connect(address) as session:
            leaf = session.open_leaf()
            call = await session.run("ECHO", {"input": NodeRef(leaf.id)}, ["output"])
            await leaf.write("first half, ")
            chunk = await call["output"].__aiter__().__anext__()
            pieces = chunk.__aiter__()
            first = await pieces.__anext__()  # echoed: the server runs the session
            opened.release()
            await release.wait()
            await leaf.write("second half", last=True)
            assert first + b"".join([piece async for piece in pieces]) == b"first half, second half"
        result.append("OK")
    except SessionAbortedError as aborted:
        result.append(aborted.code.name)


def free_port() -> int:
    """A port free now, for Envoy's static config (Envoy reports no port it picked itself)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port
