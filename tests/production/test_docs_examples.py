"""docs/production.md's examples, run as a reader would paste them, one section at a time.

In each ``## `` section, in order: a ``sh`` block's lines are commands (``\\`` continues a line);
a line ending in ``&`` starts in the background (an ``evergreen-trio`` one is waited for until it
prints its first line), any other runs under bash and must exit 0. A ``python`` block runs as a
script and must exit 0. Other blocks (``text``, ``yaml``) are not run. The doc's ports are swapped
for free ones. A ``serve`` line using an option this build lacks (the TLS, auth and server-limit
options come from another branch) skips the rest of its section, saying which. At the end of a
section every background process gets SIGTERM, and an ``evergreen-trio`` one must exit 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio
from ops_helpers import free_port

from evergreen_trio.cli import build_parser

ROOT = Path(__file__).parents[2]
DOC = ROOT / "docs" / "production.md"
DOC_PORTS = ("50051", "50052", "9100", "8443", "9901")
SECTION_GUARD = 240


@dataclass(frozen=True)
class Block:
    lang: str
    code: str


def sections() -> dict[str, list[Block]]:
    found: dict[str, list[Block]] = {}
    for part in re.split(r"^## ", DOC.read_text(), flags=re.M)[1:]:
        title, _, body = part.partition("\n")
        blocks = re.findall(r"^```(\w*)\n(.*?)^```", body, re.M | re.S)
        found[title.strip()] = [Block(lang, code) for lang, code in blocks]
    return found


SECTIONS = sections()


def serve_options() -> set[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return set(subparsers.choices["serve"]._option_string_actions)


def commands(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _params() -> list[object]:
    params: list[object] = []
    for title, blocks in SECTIONS.items():
        if not any(b.lang in ("sh", "python") for b in blocks):
            continue
        needs_envoy = any(re.search(r"^envoy ", b.code, re.M) for b in blocks if b.lang == "sh")
        params.append(pytest.param(title, marks=[pytest.mark.envoy] if needs_envoy else [], id=title))
    return params


def test_the_doc_has_runnable_examples_for_every_topic() -> None:
    for topic in ("TLS", "Credentials", "Health", "Metrics", "Limits", "Graceful drain", "Every core: workers",
                  "Many machines: Envoy in front", "Kubernetes"):
        assert any(b.lang in ("sh", "python") for b in SECTIONS[topic]), topic


@pytest.mark.parametrize("title", _params())
def test_section_examples_run(title: str, tmp_path: Path) -> None:
    # Run here, skipped out here: pytest-trio drops the reason of a skip raised inside trio.run.
    skipped = trio.run(run_section, title, tmp_path)
    if skipped:
        pytest.skip(skipped)


async def run_section(title: str, tmp_path: Path) -> str:
    """Run section ``title``'s examples; return why the rest was skipped ("" when nothing was)."""
    ports = {port: str(free_port()) for port in DOC_PORTS}
    pattern = re.compile(r"(?<![\d.])(" + "|".join(DOC_PORTS) + r")(?!\d)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    options = serve_options()
    background: list[tuple[str, trio.Process]] = []
    skipped = ""
    try:
        with trio.fail_after(SECTION_GUARD):
            for block in SECTIONS[title]:
                if block.lang not in ("sh", "python") or skipped:
                    continue
                code = pattern.sub(lambda m: ports[m.group(1)], block.code)
                if block.lang == "python":
                    done = await trio.run_process([sys.executable, "-c", code], cwd=tmp_path, env=env,
                                                  capture_stdout=True, capture_stderr=True, check=False)
                    assert done.returncode == 0, f"python block failed:\n{code}\n{done.stderr.decode()[-3000:]}"
                    continue
                for line in commands(code):
                    missing = sorted(set(re.findall(r"(?<=\s)--[a-z][-a-z]*", line)) - options)
                    if line.startswith("evergreen-trio serve") and missing:
                        skipped = f"{title}: needs serve {' '.join(missing)} (not in this build)"
                        break
                    if line.endswith("&"):
                        background.append((line, await _start(line[:-1], tmp_path, env)))
                        continue
                    done = await trio.run_process(["bash", "-c", line], cwd=tmp_path, env=env, capture_stdout=True,
                                                  capture_stderr=True, check=False)
                    assert done.returncode == 0, f"{line!r} exited {done.returncode}: {done.stderr.decode()[-3000:]}"
    finally:
        with trio.CancelScope(shield=True):
            statuses = [(line, await _stop(process)) for line, process in reversed(background)]
    for line, status in statuses:
        if line.startswith("evergreen-trio"):
            assert status == 0, f"{line!r} exited {status} on SIGTERM"
    return skipped


async def _start(line: str, cwd: Path, env: dict[str, str]) -> trio.Process:
    evergreen = line.startswith("evergreen-trio")
    process = await trio.lowlevel.open_process(shlex.split(line), cwd=cwd, env=env,
                                               stdout=subprocess.PIPE if evergreen else subprocess.DEVNULL)
    if evergreen:
        assert process.stdout is not None
        first = b""
        with trio.fail_after(60):
            while not first.endswith(b"\n"):
                data = await process.stdout.receive_some(1)
                assert data, f"{line!r} exited ({await process.wait()}) before it was ready"
                first += data
    return process


async def _stop(process: trio.Process) -> int:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(60):
            await process.wait()
        if process.returncode is None:
            process.kill()
    return await process.wait()
