"""`make demo` runs the whole stack (simulated servers, picker, Envoy, Evergreen server) and the
spec's two-turn example through it, then stops everything."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import trio

from evergreen_trio.stack.demo import MAX_TOKENS, SIMULATED_SERVERS, run_demo

pytestmark = pytest.mark.envoy


def child_commands() -> list[bytes]:
    """Command lines of this process's children (Envoy is forked from the Trio thread, the main one here)."""
    pids = Path(f"/proc/self/task/{os.getpid()}/children").read_text().split()
    return [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in pids if Path(f"/proc/{pid}").exists()]


async def test_the_demo_runs_both_turns_through_the_gateway(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with trio.fail_after(60):
        await run_demo(tmp_path)
    out = capsys.readouterr().out
    servers = dict(re.findall(r"^  (sim-\d)  http://(\S+)  \(model sim-model\)$", out, re.MULTILINE))
    assert len(servers) == SIMULATED_SERVERS
    answers = re.findall(rf"^(response_[12]) \(served by (sim-\d) at (\S+)\):((?: \S+){{{MAX_TOKENS}}})$", out,
                         re.MULTILINE)
    assert [label for label, *_ in answers] == ["response_1", "response_2"]
    for _, name, address, _ in answers:
        assert servers[name] == address
    assert out.rstrip().endswith("simulated servers stopped")
    assert not [command for command in child_commands() if b"envoy" in command], "an Envoy outlived the demo"
