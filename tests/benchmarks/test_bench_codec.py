"""`python -m benchmarks codec --quick` as a user types it: it runs and writes the JSON it promises.

No timing is asserted; the JSON goes to a temporary folder so the committed results stay as measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

pytest.importorskip("betterproto2_compiler", reason="the codec benchmark needs the bench extra (betterproto2-compiler)")
pytest.importorskip("grpc_tools", reason="the codec benchmark needs the bench extra (grpcio-tools)")
pytest.importorskip("envoy.service.ext_proc.v3", reason="the codec benchmark needs the picker extra (xds-protos)")


def test_quick_codec_benchmark_writes_both_libraries_per_case(tmp_path: Path) -> None:
    env = {**os.environ, "BENCH_RESULTS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "benchmarks", "codec", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "## Codec" in done.stdout
    result = json.loads((tmp_path / "codec.json").read_text())
    assert result["area"] == "codec" and result["quick"] is True
    assert set(result["libraries"]) == {"protobuf", "betterproto2", "betterproto2-compiler"}
    cases = {row["case"].split(" ", 1)[1] for row in result["rows"]}
    assert any(case.startswith("evergreen:") for case in cases) and any(case.startswith("ext_proc:") for case in cases)
    assert {row["case"].split(" ", 1)[0] for row in result["rows"]} == {"encode", "decode"}
    assert len(result["rows"]) == 2 * len(cases)
    for row in result["rows"]:
        assert row["unit"] == "us" and row["value"] > 0 and row["ratio"] > 0
        assert row["extra"]["betterproto2_us"] > 0 and row["extra"]["bytes"] > 0
