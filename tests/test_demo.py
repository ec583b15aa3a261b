"""`make demo` runs end to end (the spec's two-turn example)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from evergreen_trio.demo import run_demo


async def test_demo_runs_both_turns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with trio.fail_after(60):
        await run_demo(tmp_path)
    out = capsys.readouterr().out
    assert "response_1: You asked" in out and "response_2: You asked" in out
    assert out.rstrip().endswith("server stopped")
