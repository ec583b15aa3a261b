"""Every ``python`` block in README.md and docs/*.md runs, as a reader would paste it.

A block is a script (run in a fresh interpreter in an empty folder; it must exit 0), or, when
its first line names a test file (``# test_x.py``), a test file run by pytest with our plugin.
docs/production.md has its own runner (tests/production/test_docs_examples.py: its blocks start
servers from the shell). A block needing an extra that is not installed skips, naming it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "production.md")]
TIMEOUT_S = 240
EXTRA_OF = {"evergreen_trio.avp": "avp", "evergreen_trio.ipc": "ipc", "evergreen_trio.arrow_refs": "ipc",
            "evergreen_trio.sim": "sim", "evergreen_trio.generate": "generate", "evergreen_trio.picker": "picker",
            "evergreen_trio.testing": "testing", "pyarrow": "ipc"}


def _blocks() -> list[object]:
    params: list[object] = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            marks = [pytest.mark.envoy] if "run_envoy" in match.group(1) else []
            params.append(pytest.param(match.group(1), id=f"{doc.name}:{line}", marks=marks))
    return params


def _missing_extra(code: str) -> str | None:
    for module, extra in EXTRA_OF.items():
        if re.search(rf"^\s*(from|import) {re.escape(module)}\b", code, re.M):
            try:
                __import__(module)
            except ImportError:
                return extra
    return None


def test_the_docs_have_python_blocks() -> None:
    assert len(_blocks()) >= 8


@pytest.mark.parametrize("code", _blocks())
def test_the_block_runs(code: str, tmp_path: Path) -> None:
    extra = _missing_extra(code)
    if extra is not None:
        pytest.skip(f"needs the {extra!r} extra")
    first = code.splitlines()[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    named = re.fullmatch(r"# (test_\w+\.py)", first.strip())
    if named:
        (tmp_path / named.group(1)).write_text(code, encoding="utf-8")
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "trio", named.group(1),
                "-o", "trio_mode=true"]
    else:
        (tmp_path / "block.py").write_text(code, encoding="utf-8")
        argv = [sys.executable, "block.py"]
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                            check=False, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
