"""`evergreen-trio picker` as a subprocess, the way a user (or the Helm chart) starts it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio

from evergreen_trio.testing.wire import health_status

ROOT = Path(__file__).parents[2]
PICKER = [sys.executable, "-m", "evergreen_trio.cli", "picker"]
EPHEMERAL_PORTS = ["--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0"]


@dataclass
class RunningPicker:
    process: trio.Process
    grpc: int
    health: int
    metrics: int
    tls: bool


def cli_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KUBECONFIG", None)
    env.update(extra or {})
    return env


def run_cli(
    args: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run a command that should exit on its own (bad input)."""
    return subprocess.run([*PICKER, *args], env=cli_env(env), capture_output=True, text=True, timeout=timeout,
                          check=False)


@asynccontextmanager
async def picker_process(args: Sequence[str], env: Mapping[str, str] | None = None,
                         stderr: IO[bytes] | None = None) -> AsyncIterator[RunningPicker]:
    """Start the picker, wait for its 'grpc ... health ... metrics ...' line, stop it with SIGTERM
    (its stderr: ours, or ``stderr``).

    Unless ``args`` set ``--drain-timeout``, it is 0s: a cluster-mode picker would serve on for
    30 s after the SIGTERM, which only the drain tests wait for."""
    if not any(arg.startswith("--drain-timeout") for arg in args):
        args = [*args, "--drain-timeout=0s"]
    process = await trio.lowlevel.open_process([*PICKER, *args], env=cli_env(env), stdout=subprocess.PIPE,
                                               stderr=stderr)
    assert process.stdout is not None
    try:
        buffer = b""
        with trio.fail_after(60):
            while b"\n" not in buffer:
                chunk = await process.stdout.receive_some(4096)
                if not chunk:
                    raise RuntimeError(f"picker exited with {await process.wait()} before serving")
                buffer += chunk
        words = buffer.split(b"\n", 1)[0].decode().split()
        grpc = int(words[words.index("grpc") + 1].rsplit(":", 1)[1])
        yield RunningPicker(process, grpc, int(words[words.index("health") + 1]),
                            int(words[words.index("metrics") + 1]), words[words.index("tls") + 1] == "on")
    finally:
        process.terminate()
        with trio.move_on_after(10):
            await process.wait()
        process.kill()
        await process.wait()


async def wait_health(host: str, port: int, service: str, want: str = "SERVING", timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while await trio.to_thread.run_sync(health, host, port, service) != want:  # noqa: ASYNC110 (a peer's state)
            await trio.sleep(0.1)


def health(host: str, port: int, service: str) -> str:
    """The picker's gRPC health answer for ``service`` at ``host:port``, asked with grpcio."""
    return health_status(f"{host}:{port}", service, timeout=5)
