"""CI: the built wheel, installed with no extras into a fresh venv, works as a user types it.

Run with that venv's python: ``--version`` agrees with ``evergreen_trio.__version__`` and the
wheel's version, ``evergreen-trio serve`` answers an ECHO session from ``connect``, and a part
whose extra is missing (the picker, IPC) fails in one line naming the extra. pytest (installed
beside the wheel) runs a test with our plugin (entry point ``evergreen_trio``) loaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

import evergreen_trio
from evergreen_trio import connect, inner, text

SCRIPT = Path(sys.executable).with_name("evergreen-trio")


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"wheel smoke: FAILED: {what}")
    print(f"wheel smoke: ok: {what}")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=60, check=False)


async def echo(port: int) -> str:
    async with connect(f"127.0.0.1:{port}", timeout=30) as session:
        call = await session.run("ECHO", {"input": inner(text("hello "), text("wheel"))}, ["output"])
        return await call["output"].read_text()


def main() -> None:
    version = importlib.metadata.version("evergreen-trio")
    done = run("--version")
    check(done.returncode == 0 and done.stdout.strip() == f"evergreen-trio {version}", f"--version says {version}")
    check(evergreen_trio.__version__ == version, "evergreen_trio.__version__ agrees")
    for extra in ("yaml", "pyarrow", "numpy", "hypothesis", "grpc", "httpx"):
        check(importlib.util.find_spec(extra) is None, f"the core install has no {extra}")

    server = subprocess.Popen([str(SCRIPT), "serve", "--port", "0"], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        check(line.startswith("evergreen-trio serving on 127.0.0.1:"), f"serve starts: {line.strip()!r}")
        port = int(line.split(":")[-1].split()[0])
        check(trio.run(echo, port) == "hello wheel", "connect + ECHO round trip")
    finally:
        server.send_signal(signal.SIGTERM)
        check(server.wait(timeout=60) == 0, "serve stops on SIGTERM with status 0")

    done = run("picker", "--config", os.devnull)
    check(done.returncode == 2 and "pip install 'evergreen-trio[picker]'" in done.stderr
          and len(done.stderr.strip().splitlines()) == 1, f"picker without its extra: {done.stderr.strip()!r}")
    done = subprocess.run([sys.executable, "-c", "import evergreen_trio.ipc"], capture_output=True, text=True,
                          check=False)
    check(done.returncode == 1 and "MissingExtraError" in done.stderr and "evergreen-trio[ipc]" in done.stderr,
          "import evergreen_trio.ipc names the ipc extra")

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "test_plain.py").write_text("def test_plain():\n    assert True\n")
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", folder],
                              capture_output=True, text=True, timeout=120, check=False)
    check(done.returncode == 0 and "1 passed" in done.stdout, "pytest runs with our plugin autoloaded")


if __name__ == "__main__":
    main()
