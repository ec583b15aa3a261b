"""Every command fed bad input, run as a user types it: one line on stderr naming the culprit.

Usage and configuration errors exit 2, runtime failures exit 1, and no traceback is shown
unless ``--log-level debug`` asks for one.
"""

from __future__ import annotations

import importlib.metadata
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

COMMAND = [sys.executable, "-m", "evergreen_trio.cli"]
TIMEOUT_S = 60


def run(*argv: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """``evergreen-trio ARGV...`` with stdin closed, as a user (or a script) runs it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    return subprocess.run([*COMMAND, *argv], capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL, env=env)


def assert_one_line(result: subprocess.CompletedProcess[str], status: int, *culprits: str) -> str:
    """Exit ``status`` and a single ``evergreen-trio ...: error: ...`` line that names every culprit."""
    lines = result.stderr.splitlines()
    assert result.returncode == status, result.stderr
    assert len(lines) == 1, result.stderr
    [line] = lines
    assert line.startswith("evergreen-trio") and ": error: " in line, line
    for culprit in culprits:
        assert culprit in line, line
    return line


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port some other program is listening on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def bad_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text("pool:\n  name: x\n endpoints: []\n")  # line 3, column 2: a dedented key
    return path


@pytest.fixture
def pool_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text("pool: {endpoints: ['127.0.0.1:1']}\n")
    return path


@pytest.mark.parametrize(
    ("argv", "culprits"),
    [
        (["serve", "--port", "70000"], ["--port", "70000", "0..65535"]),
        (["serve", "--port", "http"], ["--port", "'http'"]),
        (["sim", "--port", "-1"], ["--port", "'-1'"]),
        (["picker", "--config", "x.yaml", "--grpc-port", "70000"], ["--grpc-port", "70000"]),
        (["picker", "--config", "x.yaml", "--metrics-port", "65536"], ["--metrics-port", "65536"]),
        (["gateway", "--simulate", "1", "--round-robin-port", "99999"], ["--round-robin-port"]),
        (["gateway-config", "--listener-port", "70000"], ["--listener-port"]),
        (["--log-level", "LOUD", "serve"], ["--log-level", "LOUD"]),
        (["serve", "--log-level", "LOUD"], ["--log-level", "LOUD"]),
        (["ipc", "get", "tcp://127.0.0.1:1?want_data=1", "t", "--out", "/nonexistent/dir/x.arrow"],
         ["--out", "/nonexistent/dir"]),
        (["ipc", "get", "tcp://127.0.0.1:1", "t", "--out", "x.arrow"], ["want_data"]),
        (["ipc", "serve", "/nonexistent/data.arrow"], ["/nonexistent/data.arrow", "No such file"]),
        (["ipc", "serve", "/nonexistent/data.arrow", "--role", "neither"], ["--role", "neither"]),
        (["picker", "--config", "/nonexistent/pool.yaml"], ["/nonexistent/pool.yaml", "No such file"]),
        (["gateway", "--config", "/nonexistent/pool.yaml"], ["/nonexistent/pool.yaml", "No such file"]),
        (["picker"], ["--config"]),
        (["sim", "--max-batch", "0"], ["max_batch", "0"]),
        (["serve", "--model", "m"], ["--model", "--generate-backend"]),
        (["conformance", "127.0.0.1:1", "--examples", "0"], ["--examples"]),
        # Each was taken: 0 and -1 said nothing answers "within -1 s", nan hung, inf raised OverflowError.
        (["conformance", "127.0.0.1:1", "--timeout", "0"], ["--timeout", "got 0"]),
        (["conformance", "127.0.0.1:1", "--timeout=-1"], ["--timeout", "'-1'"]),
        (["conformance", "127.0.0.1:1", "--timeout", "nan"], ["--timeout", "'nan'"]),
        (["conformance", "127.0.0.1:1", "--timeout", "inf"], ["--timeout", "'inf'"]),
        (["conformance", "127.0.0.1:1", "--timeout", "1e300"], ["--timeout", "at most 86400 s", "got 1e+300"]),
        (["conformance", "127.0.0.1"], ["'127.0.0.1'", "host:port"]),
        (["conformance", "127.0.0.1:1", "--header", "no-colon"], ["--header", "'no-colon'"]),
        # A binary header raised TypeError; a newline in a value was blamed on the server (INTERNAL).
        (["conformance", "127.0.0.1:1", "--header", "x-bin: abc"], ["--header", "'x-bin'"]),
        (["conformance", "127.0.0.1:1", "--header", "x: a\nb"], ["--header", "printable ASCII"]),
        (["conformance", "127.0.0.1:1", "--header", "cl\u00e9: x"], ["--header", "'name: value'"]),
        (["conformance", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem"], ["--tls-ca", "/nonexistent/ca.pem"]),
        (["gateway", "--simulate", "99"], ["simulate", "99"]),
        (["gateway", "--simulate", "1", "--listen", "localhost:80"], ["listen", "localhost:80"]),
        (["gateway-config", "-o", "/nonexistent/dir/envoy.json"], ["--output", "/nonexistent/dir/envoy.json"]),
        (["gateway-config", "--queue-wait", "soon"], ["--queue-wait", "soon"]),
        (["gateway-config", "--queue-wait=-5s"], ["--queue-wait", "-5s"]),
        (["launch"], ["launch"]),
        (["serve", "--tls-cert", "c.pem"], ["--tls-cert", "--tls-key"]),
        (["serve", "--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
         ["--tls-cert", "/nonexistent/c.pem", "No such file"]),
        (["serve", "--auth-token-file", "/nonexistent/tokens"], ["--auth-token-file", "/nonexistent/tokens"]),
        (["serve", "--max-sessions", "0"], ["--max-sessions", "'0'"]),
        (["serve", "--max-sessions-per-peer", "0"], ["--max-sessions-per-peer", "'0'"]),
        (["serve", "--max-connections", "many"], ["--max-connections", "'many'"]),
        (["serve", "--idle-timeout", "-1"], ["--idle-timeout", "'-1'"]),
        (["serve", "--first-message-timeout", "0"], ["--first-message-timeout"]),
        (["serve", "--drain-grace", "soon"], ["--drain-grace", "'soon'"]),
        (["serve", "--workers", "0"], ["--workers", "'0'"]),
        (["serve", "--workers", "1025"], ["--workers", "at most 1024", "'1025'"]),
        (["serve", "--workers", "99999999999999999999"], ["--workers", "'99999999999999999999'"]),
        (["serve", "--max-sessions-per-connection", "4294967296"],
         ["--max-sessions-per-connection", "at most 4294967295", "4294967296"]),
        (["serve", "--worker-heartbeat-timeout", "0"], ["--worker-heartbeat-timeout", "0 s"]),
        (["serve", "--worker-heartbeat-timeout", "never"], ["--worker-heartbeat-timeout", "'never'"]),
        (["serve", "--metrics-port", "70000"], ["--metrics-port", "70000"]),
        (["picker", "--pool-name", "p", "--secure-serving", "maybe"], ["--secure-serving", "'maybe'"]),
        (["picker", "--pool-name", "p", "--cert-path", "/nonexistent/dir"], ["--cert-path", "/nonexistent/dir"]),
        (["picker", "--config", "x.yaml", "--pool-name", "p"], ["--pool-name", "--config"]),
        (["picker", "--pool-name", "p", "--config-text",
          "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{type: nope}]"],
         ["nope"]),
        (["picker", "--pool-name", "p", "--config-text",
          "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
          "- {type: approx-prefix-cache-producer, parameters: {blockSizeToken: 16}}"],
         ["plugins[0].parameters.blockSizeToken", "approx-prefix-cache-producer parameter"]),
        (["picker", "--pool-name", "p", "--config-text",
          "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: [{type: queue-scorerr}]"],
         ["plugins[0].type", "queue-scorerr"]),
        (["sim", "--metrics-engine", "tgi"], ["metrics_engine", "tgi"]),
        (["picker", "--pool-name", "p", "--zap-log-level", "loud"], ["--zap-log-level", "'loud'"]),
        (["picker", "--pool-name", "p", "-v", "x"], ["--v", "'x'"]),
        (["picker", "--pool-name", "p", "--log-level", "warn"], ["--log-level", "'warn'"]),
        (["picker", "--pool-name", "p", "--drain-timeout", "soon"], ["--drain-timeout", "'soon'"]),
        (["picker", "--pool-name", "p", "--stop-grace=-1s"], ["--stop-grace", "'-1s'"]),
        (["avp", "serve", "--port", "70000"], ["--port", "70000"]),
        (["avp", "serve", "--token-file", "/nonexistent/token"], ["--token-file", "/nonexistent/token"]),
        (["gateway-config", "--evergreen", "nowhere"], ["--evergreen", "nowhere"]),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv: list[str], culprits: list[str]) -> None:
    assert_one_line(run(*argv), 2, *culprits)


@pytest.mark.parametrize("command", ["picker", "gateway"])
def test_a_yaml_syntax_error_keeps_file_line_and_column(command: str, bad_yaml: Path) -> None:
    assert_one_line(run(command, "--config", str(bad_yaml)), 2, f"{bad_yaml}:3:2:")


@pytest.mark.parametrize("command", ["picker", "gateway"])
def test_a_bad_config_exits_2_and_names_the_field(command: str, tmp_path: Path) -> None:
    path = tmp_path / "pool.yaml"
    path.write_text("pool: {endpoints: [{address: 'nowhere'}]}\n")
    assert_one_line(run(command, "--config", str(path)), 2, "pool.endpoints[0].address", "nowhere")


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "{port}"],
        ["sim", "--port", "{port}"],
        ["picker", "--config", "{pool}", "--grpc-port", "{port}", "--grpc-health-port", "0", "--metrics-port", "0"],
    ],
    ids=["serve", "sim", "picker"],
)
def test_a_port_in_use_is_one_line_and_exit_1(argv: list[str], busy_port: int, pool_yaml: Path) -> None:
    result = run(*[arg.format(port=busy_port, pool=pool_yaml) for arg in argv], "--log-level", "warning")
    assert_one_line(result, 1, str(busy_port), "in use")


@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_a_metrics_port_in_use_is_named(workers: list[str], busy_port: int) -> None:
    """One process said "cannot listen on 127.0.0.1:0" (the session port), workers named no address."""
    result = run("serve", "--port", "0", "--metrics-port", str(busy_port), *workers, "--log-level", "warning")
    assert_one_line(result, 1, f"--metrics-port: cannot listen on 127.0.0.1:{busy_port}", "in use")


def test_a_traceback_only_with_log_level_debug(busy_port: int) -> None:
    assert "Traceback" not in run("serve", "--port", str(busy_port)).stderr
    result = run("--log-level", "debug", "serve", "--port", str(busy_port))
    assert result.returncode == 1
    assert "Traceback" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("evergreen-trio serve: error: cannot listen on")


def test_ipc_get_from_a_server_that_is_gone_is_one_line() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    result = run("ipc", "get", f"tcp://127.0.0.1:{free}?want_data=1", "t", "--out", os.devnull)
    assert_one_line(result, 1, f"127.0.0.1:{free}")


def test_conformance_against_nothing_says_nothing_answers() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    result = run("conformance", f"127.0.0.1:{free}", "--timeout", "2")
    assert_one_line(result, 1, "nothing answers in plaintext", f"127.0.0.1:{free}")


@pytest.fixture
def ipc_server(tmp_path: Path) -> Iterator[str]:
    """``evergreen-trio ipc serve data.arrow`` running; yields its URI."""
    table = pa.table({"n": list(range(10_000))})
    with pa.ipc.new_file(str(tmp_path / "data.arrow"), table.schema) as writer:
        writer.write_table(table)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    with subprocess.Popen([*COMMAND, "ipc", "serve", str(tmp_path / "data.arrow")], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, env=env) as process:
        assert process.stdout is not None
        try:
            yield process.stdout.readline().strip()
        finally:
            process.terminate()
            assert process.wait(timeout=TIMEOUT_S) == 0


def test_ipc_get_an_unknown_ticket_says_the_ticket_is_unknown(ipc_server: str, tmp_path: Path) -> None:
    result = run("ipc", "get", ipc_server, "nope", "--out", str(tmp_path / "x.arrow"))
    assert_one_line(result, 1, "unknown ticket b'nope'")
    assert not (tmp_path / "x.arrow").exists()


def test_ipc_get_shows_no_progress_when_stderr_is_not_a_terminal(ipc_server: str, tmp_path: Path) -> None:
    result = run("ipc", "get", ipc_server, "data.arrow", "--out", str(tmp_path / "x.arrow"))
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"10000 rows -> {tmp_path / 'x.arrow'}\n"


def test_ipc_serve_refuses_a_fifo_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    result = run("ipc", "serve", str(tmp_path / "pipe"), timeout=20)
    assert_one_line(result, 2, "argument file", "pipe", "expected a regular file")


@pytest.mark.parametrize(
    ("content", "reason"),
    [(None, "got a directory"), (b"", "got an empty file"), (b"not arrow at all", "expected Arrow IPC messages")],
)
def test_ipc_serve_names_a_bad_file_once(tmp_path: Path, content: bytes | None, reason: str) -> None:
    """The path was printed twice ("argument file: X: X: expected ...")."""
    path = tmp_path / "data.arrow"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    line = assert_one_line(run("ipc", "serve", str(path), timeout=20), 2, "argument file", reason)
    assert line.count(str(path)) == 1, line


@pytest.mark.parametrize("location", ["nope", "grpc://127.0.0.1:99999", "grpc://[::1:5", "http://127.0.0.1:5"])
def test_ipc_serve_refuses_a_bad_flight_location_before_serving(tmp_path: Path, location: str) -> None:
    table = pa.table({"n": [1, 2, 3]})
    with pa.ipc.new_file(str(tmp_path / "data.arrow"), table.schema) as writer:
        writer.write_table(table)
    result = run("ipc", "serve", str(tmp_path / "data.arrow"), "--flight", location)
    assert_one_line(result, 2, "--flight", repr(location), "grpc://HOST:PORT")
    assert result.stdout == ""  # refused before the data server started


def test_the_global_options_come_before_or_after_the_subcommand(tmp_path: Path) -> None:
    for argv in (["--log-level", "error", "gateway-config"], ["gateway-config", "--log-level", "ERROR"]):
        result = run(*argv, "-o", str(tmp_path / "envoy.json"))
        assert result.returncode == 0 and result.stderr == f"wrote {tmp_path / 'envoy.json'}\n", result.stderr


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0
    assert result.stdout == f"evergreen-trio {importlib.metadata.version('evergreen-trio')}\n"


def test_help_describes_the_tool_and_every_option() -> None:
    top = run("--help").stdout
    assert "serve and consume GenAI wire protocols" in top and "argument parsing" not in top
    assert "--version" in top and "--log-level" in top
    serve = run("serve", "--help").stdout
    assert "address to bind" in serve and "port to bind, 0 for any" in serve


@pytest.mark.parametrize(("argv", "flag", "value"), [
    (["--picker", "nowhere"], "--picker", "nowhere"),
    (["--picker", "10.0.0.1:0"], "--picker", "10.0.0.1:0"),
    (["--pool-endpoint", "10.0.0.1:8000", "--pool-endpoint", "pod-b:8000"], "--pool-endpoint", "pod-b:8000"),
])
def test_gateway_config_address_errors_name_the_flag(argv: list[str], flag: str, value: str) -> None:
    """Before: ``picker_address: ...`` and ``endpoints[1]: ...``, gateway_config's parameters."""
    line = assert_one_line(run("gateway-config", *argv), 2, f"argument {flag}: expected", repr(value))
    assert "picker_address" not in line and "endpoints[" not in line, line
