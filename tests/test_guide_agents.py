"""docs/agents.md, and testing.md's "Your own server in the fixtures", run as a reader would follow them.

Blocks run in order in one folder: a block whose first line is ``# NAME.EXT`` (``# myagent.py``,
``# pytest.ini``) is written to that file; any other ``python`` block runs as a script and must exit 0; each line of
a ``sh`` block runs under bash and must exit 0, except that a line ending in ``&`` starts in
the background and is waited for until it prints its first line. At the end each background
process gets SIGTERM and must exit 0. The doc's ports are swapped for free ones.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOC_PORTS = ("50051", "50052")
GUIDES = {
    "agents": (ROOT / "docs" / "agents.md", None),
    "testing-your-server": (ROOT / "docs" / "testing.md", "Your own server in the fixtures"),
}


def blocks(doc: Path, section: str | None) -> list[tuple[str, str]]:
    text = doc.read_text()
    if section is not None:
        text = next(part for part in re.split(r"^## ", text, flags=re.M) if part.startswith(section))
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


@pytest.mark.parametrize("guide", sorted(GUIDES))
def test_the_guide_runs_as_written(guide: str, tmp_path: Path) -> None:
    doc, section = GUIDES[guide]
    ports = {port: free_port() for port in DOC_PORTS}
    pattern = re.compile(r"(?<![\d.])(" + "|".join(DOC_PORTS) + r")(?!\d)")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    background: list[tuple[str, subprocess.Popen[bytes]]] = []
    ran = 0
    try:
        for lang, code in blocks(doc, section):
            code = pattern.sub(lambda m: ports[m.group(1)], code)
            named = re.match(r"# ([\w./-]+\.\w+)\n", code)
            if named:
                (tmp_path / named.group(1)).write_text(code)
            elif lang == "python":
                done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                                      text=True, timeout=120, check=False)
                assert done.returncode == 0, f"{code}\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
            elif lang == "sh":
                for line in (ln.strip() for ln in code.splitlines() if ln.strip()):
                    if line.endswith("&"):
                        background.append((line, _start(line[:-1], tmp_path, env)))
                        continue
                    done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                                          text=True, timeout=300, check=False)
                    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}{done.stderr[-2000:]}"
            else:
                continue
            ran += 1
    finally:
        statuses = [(line, _stop(process)) for line, process in reversed(background)]
    assert ran >= 3
    for line, status in statuses:
        assert status == 0, f"{line!r} exited {status} on SIGTERM"


def _start(line: str, cwd: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(shlex.split(line), cwd=cwd, env=env, stdout=subprocess.PIPE)
    assert process.stdout is not None
    first = process.stdout.readline()
    assert first, f"{line!r} exited ({process.wait()}) before it was ready"
    return process


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()
    return process.returncode
