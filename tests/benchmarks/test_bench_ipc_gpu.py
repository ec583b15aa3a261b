"""`python -m benchmarks ipc_gpu` and `python -m benchmarks.ipc_first_fetch` without a GPU: each says why
it skips, exits 0 and writes nothing."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: the area would run")
def test_gpu_area_skips_with_its_reason_where_there_is_no_cupy(tmp_path: Path) -> None:
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks", "ipc_gpu", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "skipped: CuPy is not installed" in done.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed: it would run")
def test_first_fetch_tool_skips_with_its_reason_where_there_is_no_cupy() -> None:
    done = subprocess.run([sys.executable, "-m", "benchmarks.ipc_first_fetch"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ipc_first_fetch: skipped: CuPy is not installed"), done.stdout
