"""`evergreen-trio conformance`: every rule holds on our server; a broken ECHO is caught and
reported with a shrunk counterexample."""

from __future__ import annotations

import io
from contextlib import redirect_stdout

import trio

from evergreen_trio import Server
from evergreen_trio.cli import main
from evergreen_trio.nursery_session import ActionContext
from evergreen_trio.testing.conformance import RULES, run_conformance
from evergreen_trio.testing.subprocess_server import ServerProcess


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["--log-level", "WARNING", "conformance", *argv])
    return code, out.getvalue()


def test_every_rule_holds_on_our_server_with_strict_codes(small_server: ServerProcess) -> None:
    code, report = _cli(small_server.address, "--examples", "8", "--strict-codes", "--derandomize")
    assert code == 0, report
    assert report.count("PASS") == len(RULES), report
    assert f"{len(RULES)} rules: {len(RULES)} hold, 0 fail" in report


def test_output_reuse_holds_on_our_server_over_many_schedules(small_server: ServerProcess) -> None:
    """Once a race (a child output read before its first fragment after the client half-closed)."""
    code, report = _cli(small_server.address, "--examples", "40", "--rule", "output-reuse", "--rule", "stateful")
    assert code == 0, report


def test_an_unreachable_server_fails_every_rule() -> None:
    out = io.StringIO()
    results = run_conformance("127.0.0.1:1", examples=1, timeout=2, out=out)
    assert results and not any(r.holds for r in results)
    assert "does not serve" in out.getvalue()


async def _reversed_echo(ctx: ActionContext) -> None:
    """ECHO with its chunks in reverse order: wrong whenever the input has two different chunks."""
    chunks = await ctx.input("input").read_chunks()
    output = ctx.output("output")
    for metadata, data in reversed(chunks):
        leaf = await output.child()
        await leaf.write(data, metadata=metadata, last=True)


async def test_a_broken_echo_fails_with_a_shrunk_counterexample() -> None:
    server = Server()
    server.add_action("ECHO", _reversed_echo, inputs=["input"], outputs=["output"])
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        code, report = await trio.to_thread.run_sync(
            _cli, f"127.0.0.1:{port}", "--examples", "30", "--rule", "round-trip", "--derandomize"
        )
        nursery.cancel_scope.cancel()
    assert code == 1, report
    assert "FAIL  round-trip" in report and "1 rules: 0 hold, 1 fail" in report
    assert "shrunk counterexample:" in report and "Act(ECHO" in report
    # Shrunk to the smallest failing flattening: two different chunks.
    assert "flattens to 2 chunks" in report, report
