"""The diagnosis tools run as a developer types them: `python -m benchmarks.ipc_trace`, `...session_passes`,
`...session_calls`, `...kv_block_keys`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)


@pytest.mark.ucx
@pytest.mark.parametrize("kept", [False, True])
def test_ipc_trace_times_each_fetch_from_both_ends(kept: bool, tmp_path: Path) -> None:
    done = run("benchmarks.ipc_trace", "--memory", "host", "--total-mib", "16", "--body-mib", "4", "--runs", "2",
               "--out", str(tmp_path), *(["--kept"] if kept else []))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "summary-host.json").read_text())
    assert len(rows) == 2 and all(row["bodies"] == 4 for row in rows)
    # A connection per fetch shows its set-up in each fetch; a kept one only before the first.
    assert all(row["handshake_ms"] is not None for row in rows) != kept
    assert "| fetch | wall_ms |" in done.stdout


def test_ipc_trace_refuses_an_unknown_memory_with_one_line() -> None:
    done = run("benchmarks.ipc_trace", "--memory", "tpu")
    assert done.returncode == 2 and "invalid choice: 'tpu'" in done.stderr


def test_session_passes_maps_one_session() -> None:
    done = run("benchmarks.session_passes")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "caller: the session is closed" in done.stdout
    assert "StartSession" in done.stdout and "sends" in done.stdout and "reads" in done.stdout
    assert done.stdout.rstrip().endswith("task steps")


def test_session_calls_counts_each_setup() -> None:
    done = run("benchmarks.session_calls", "--rounds", "20")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "| setup | python_calls | c_calls | task_steps | passes | cpu_us | p50_us |"
    rows = {line.split(" | ")[0].strip("| "): [float(cell) for cell in line.strip(" |").split(" | ")[1:]]
            for line in lines[2:]}
    assert set(rows) == {"wire", "memory", "shells"}
    # The session layer costs calls above its transport; in memory, no gRPC task takes a step.
    assert rows["wire"][0] > rows["shells"][0] and rows["memory"][2] < rows["wire"][2]


def test_session_calls_refuses_an_unknown_setup_with_one_line() -> None:
    done = run("benchmarks.session_calls", "sockets")
    assert done.returncode == 2 and "unknown setup 'sockets'" in done.stderr


def test_kv_block_keys_times_each_block_size() -> None:
    done = run("benchmarks.kv_block_keys", "--tokens", "256", "--runs", "1", "--number", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["cbor-fnv block 16", "cbor-fnv block 64"]
    assert all(line.endswith("ms a novel 256-token prompt") for line in lines)


def test_kv_block_keys_refuses_a_bad_size_with_one_line() -> None:
    done = run("benchmarks.kv_block_keys", "--block-sizes", "0")
    assert done.returncode == 2 and "every block size must be at least 1" in done.stderr
