"""`evergreen-trio conformance`: every rule holds on our server; a broken ECHO is caught and
reported with a shrunk counterexample."""

from __future__ import annotations

import io
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest
import trio
import trustme

from evergreen_trio import Server
from evergreen_trio.cli import main
from evergreen_trio.nursery_session import ActionContext
from evergreen_trio.testing.conformance import RULES, run_conformance
from evergreen_trio.testing.model import ActionUnderTest
from evergreen_trio.testing.subprocess_server import ServerProcess, serve_command
from evergreen_trio.testing.wire import UnreachableError


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


def test_an_unreachable_server_is_said_plainly() -> None:
    with pytest.raises(UnreachableError, match=r"nothing answers in plaintext at 127\.0\.0\.1:1 within 2 s"):
        run_conformance("127.0.0.1:1", examples=1, timeout=2, out=io.StringIO())


def test_a_server_without_echo_fails_every_rule(evergreen_server_process: ServerProcess) -> None:
    out = io.StringIO()
    upper = ActionUnderTest("UPPER", ("input",), ("output",), lambda inputs: {"output": inputs["input"]})
    results = run_conformance(evergreen_server_process.address, examples=1, out=out, action=upper)
    assert results and not any(r.holds for r in results)
    assert "does not serve a one-leaf UPPER session" in out.getvalue() and "unknown action" in out.getvalue()
    assert "after the abort" not in out.getvalue()  # the first session of all: nothing was aborted


async def test_conformance_over_tls_with_a_token_as_a_user_types_it(tmp_path: Path) -> None:
    """``serve`` with TLS and a token file, checked by ``conformance --tls-ca --header``; without
    the token every session is refused, and the report says so."""
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "server.pem")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    (tmp_path / "tokens").write_text("conformance-token\n")
    serve_args = ("--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"),
                  "--auth-token-file", str(tmp_path / "tokens"))
    async with serve_command(*serve_args) as line:
        address = line.split()[-1]
        check = [sys.executable, "-m", "evergreen_trio.cli", "conformance", address,
                 "--tls-ca", str(tmp_path / "ca.pem"),
                 "--examples", "3", "--rule", "round-trip", "--rule", "abort-cycle", "--derandomize"]
        allowed = await trio.run_process([*check, "--header", "Authorization: Bearer conformance-token"],
                                         capture_stdout=True, capture_stderr=True, check=False)
        assert allowed.returncode == 0, allowed.stdout.decode() + allowed.stderr.decode()
        refused = await trio.run_process(check, capture_stdout=True, capture_stderr=True, check=False)
        assert refused.returncode == 1
        assert b"UNAUTHENTICATED" in refused.stdout, refused.stdout.decode()
        plaintext = await trio.run_process([*check[:5], "--timeout", "2"], capture_stdout=True, capture_stderr=True,
                                           check=False)
        assert plaintext.returncode == 1
        assert b"nothing answers in plaintext" in plaintext.stderr or b"UNAVAILABLE" in plaintext.stdout


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


class _Garbage(grpc.GenericRpcHandler):  # type: ignore[misc]
    """Every method answers one message that is no SessionMessage."""

    def service(self, details: object) -> object:
        return grpc.stream_stream_rpc_method_handler(lambda requests, context: iter([b"\xff\xff\xff\xff"]))


def test_a_server_answering_garbage_is_reported_without_a_traceback() -> None:
    """grpcio logs a reply it cannot parse with its traceback, which landed on stderr beside the report."""
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((_Garbage(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "conformance", f"127.0.0.1:{port}",
                               "--examples", "1", "--timeout", "5"], capture_output=True, text=True, timeout=60)
    finally:
        server.stop(None)
    assert done.returncode == 1
    assert "INTERNAL" in done.stdout, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
