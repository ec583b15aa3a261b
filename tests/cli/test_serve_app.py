"""``evergreen-trio serve --app MODULE:FACTORY`` as a user runs it: their module, in the current
directory, served with TLS, a token file, metrics, health and two workers; a bad ``--app`` is one
line and exit 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import trio
import trustme
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse
from user_app import APP

from evergreen_trio import SessionAbortedError, StatusCode, connect, text
from evergreen_trio.serving.tls import client_context

ROOT = Path(__file__).parents[2]


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "agentapp.py").write_text(APP)
    (tmp_path / "broken.py").write_text("import nonexistent_dependency_xyz\n")
    return tmp_path


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


@asynccontextmanager
async def serve_app(cwd: Path, *args: str) -> AsyncIterator[list[str]]:
    """``serve --app ... --port 0 ARGS`` in ``cwd``; yields its first lines (ready, metrics, workers);
    SIGTERM at exit, which must end it with status 0."""
    command = [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", *args]
    process = await trio.lowlevel.open_process(command, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                                               stderr=subprocess.DEVNULL)
    try:
        assert process.stdout is not None
        wanted = 1 + ("--metrics-port" in args) + ("--workers" in args)
        data = b""
        with trio.fail_after(60):
            while data.count(b"\n") < wanted:
                chunk = await process.stdout.receive_some(4096)
                assert chunk, f"serve exited ({await process.wait()}) before it was ready"
                data += chunk
        yield data.decode().splitlines()
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            status = await process.wait()
    assert status == 0


def address_of(ready_line: str) -> str:
    found = re.search(r" on (\S+)", ready_line)
    assert found, ready_line
    return found.group(1)


async def upper(address: str, **options: object) -> str:
    async with connect(address, timeout=30, **options) as session:  # type: ignore[arg-type]
        call = await session.run("UPPER", {"input": text("served by your app")}, ["output"])
        return await call["output"].read_text()


async def test_serve_app_runs_a_user_module_from_the_current_directory(app_dir: Path) -> None:
    async with serve_app(app_dir, "--app", "agentapp:make_server") as lines:
        assert "(app agentapp:make_server: BOOM, UPPER)" in lines[0]
        address = address_of(lines[0])
        assert await upper(address) == "SERVED BY YOUR APP"
        with pytest.raises(SessionAbortedError) as aborted:  # no ECHO: only the app's actions
            async with connect(address, timeout=30) as session:
                await (await session.run("ECHO", {"input": text("x")}, ["output"]))["output"].read_bytes()
        assert aborted.value.code is StatusCode.UNIMPLEMENTED and "UPPER" in aborted.value.message
        with pytest.raises(SessionAbortedError) as boom:
            async with connect(address, timeout=30) as session:
                await (await session.run("BOOM", {"input": text("x")}, ["output"]))["output"].read_bytes()
        assert "error id" in boom.value.message and "hunter2" not in boom.value.message
    async with serve_app(app_dir, "--app", "agentapp:server", "--send-error-details") as lines:
        with pytest.raises(SessionAbortedError) as boom:
            async with connect(address_of(lines[0]), timeout=30) as session:
                await (await session.run("BOOM", {"input": text("x")}, ["output"]))["output"].read_bytes()
        assert "ValueError: db password is hunter2" in boom.value.message


def grpcio_health(address: str, root: bytes) -> HealthCheckResponse.ServingStatus:
    credentials = grpc.ssl_channel_credentials(root_certificates=root)
    with grpc.secure_channel(address, credentials) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                    request_serializer=HealthCheckRequest.SerializeToString,
                                    response_deserializer=HealthCheckResponse.FromString)
        reply: HealthCheckResponse = check(HealthCheckRequest(service="evergreen.v2.EvergreenService"), timeout=30)
        return reply.status


async def test_every_serve_option_applies_to_the_app(app_dir: Path) -> None:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(app_dir / "cert.pem"))
    cert.private_key_pem.write_to_path(str(app_dir / "key.pem"))
    ca.cert_pem.write_to_path(str(app_dir / "ca.pem"))
    (app_dir / "tokens").write_text("app-token\n")
    args = ["--app", "agentapp:make_server", "--tls-cert", "cert.pem", "--tls-key", "key.pem",
            "--auth-token-file", "tokens", "--metrics-port", "0", "--workers", "2"]
    async with serve_app(app_dir, *args) as lines:
        assert lines[0].startswith("evergreen-trio serving TLS on ")
        address = address_of(lines[0])
        tls = client_context(ca_file=str(app_dir / "ca.pem"))
        token = {"authorization": "Bearer app-token"}
        for _ in range(3):
            assert await upper(address, tls=tls, metadata=token) == "SERVED BY YOUR APP"
        with pytest.raises(SessionAbortedError) as refused:
            await upper(address, tls=tls)
        assert refused.value.code is StatusCode.UNAUTHENTICATED
        status = await trio.to_thread.run_sync(grpcio_health, address, ca.cert_pem.bytes())
        assert status == HealthCheckResponse.SERVING
        metrics_url = next(line.split()[-1] for line in lines if "metrics on" in line)
        body = await trio.to_thread.run_sync(lambda: urllib.request.urlopen(metrics_url, timeout=30).read())
        assert b'evergreen_action_duration_seconds_count{action="UPPER",code="OK"} 3.0' in body


@pytest.mark.parametrize(
    ("app", "culprits"),
    [
        ("agentapp", ["'agentapp'", "MODULE:FACTORY"]),
        ("nowhere.to.be.found:make", ["no module named 'nowhere'"]),
        ("broken:make", ["importing broken failed", "nonexistent_dependency_xyz"]),
        ("agentapp:missing", ["has no attribute 'missing'"]),
        ("agentapp:NOT_A_SERVER", ["expected a Server", "int"]),
        ("agentapp:raising", ["raising() raised RuntimeError: no config file"]),
        ("agentapp:async_factory", ["async_factory() is async"]),
    ],
)
@pytest.mark.parametrize("workers", [[], ["--workers", "2"]], ids=["one", "workers"])
def test_a_bad_app_exits_2_with_one_line(app_dir: Path, app: str, culprits: list[str], workers: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", "--app", app, *workers],
        capture_output=True, text=True, timeout=60, cwd=app_dir, env=_env(), stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith("evergreen-trio serve: error: ") and app in line, line
    for culprit in culprits:
        assert culprit in line, line


def test_an_app_with_the_builtin_backend_options_is_refused(app_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", "--app", "agentapp:server",
         "--generate-backend", "http://127.0.0.1:1/v1", "--model", "m"],
        capture_output=True, text=True, timeout=60, cwd=app_dir, env=_env(), stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2 and "--generate-backend" in result.stderr and "--app" in result.stderr


WORKER_APP = '''
import os, sys, time
from evergreen_trio import Server

def failing() -> Server:  # the supervisor's import succeeds, every worker's fails
    if "--supervised-by" in sys.argv:
        raise RuntimeError("no GPU in this worker")
    return Server()

def slow() -> Server:  # each worker says it started, then takes its time
    if "--supervised-by" in sys.argv:
        open(f"worker-{os.getpid()}", "w").close()
        time.sleep(600)
    return Server()
'''


def test_a_worker_that_fails_at_start_is_named_in_the_supervisors_line(tmp_path: Path) -> None:
    """The supervisor logged ``serve.failed error=Exceptions from Trio nursery (1 sub-exception)``:
    the nursery's group, not the worker and the status it exited with."""
    (tmp_path / "workerapp.py").write_text(WORKER_APP)
    result = subprocess.run(
        [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", "--app", "workerapp:failing",
         "--workers", "2"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_env(), stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 1, result.stderr
    assert "failing() raised RuntimeError: no GPU in this worker" in result.stderr
    [failed] = [line for line in result.stderr.splitlines() if "serve.failed" in line]
    assert "exited with status 2 before it was ready" in failed, failed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _two_workers(tmp_path: Path, source: str, app: str) -> trio.Process:
    """``serve --workers 2 --app APP`` started in ``tmp_path``, with ``source`` as APP's module."""
    (tmp_path / f"{app.partition(':')[0]}.py").write_text(source)
    command = [sys.executable, "-m", "evergreen_trio.cli", "serve", "--port", "0", "--app", app, "--workers", "2"]
    return await trio.lowlevel.open_process(command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE)


async def test_sigterm_while_a_worker_starts_stops_cleanly(tmp_path: Path) -> None:
    """SIGTERM to the supervisor while a worker started: its SIGTERM ended that worker before it was
    ready, which the supervisor took for a failed start: exit 1 and ``serve.failed``."""
    process = await _two_workers(tmp_path, WORKER_APP, "workerapp:slow")
    try:
        with trio.fail_after(60):
            while not (markers := list(await trio.Path(tmp_path).glob("worker-*"))):  # noqa: ASYNC110
                await trio.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.stdout is not None and process.stderr is not None
        with trio.fail_after(30):
            stdout = await process.stdout.receive_some(4096)
            stderr = b"".join([chunk async for chunk in process.stderr])
            status = await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    assert status == 0, stderr.decode()
    assert stdout == b""  # stopped before it served: no ready line
    assert b"serve.failed" not in stderr and b"ERROR" not in stderr, stderr.decode()
    [marker] = markers
    worker = int(marker.name.split("-")[1])
    with trio.fail_after(10):
        while _alive(worker):  # noqa: ASYNC110 - another process's exit
            await trio.sleep(0.05)


CHATTY_APP = '''
import sys, time
from evergreen_trio import Server

print("loading weights...", flush=True)

def make() -> Server:
    if "--supervised-by" in sys.argv:  # a worker takes its time after the print
        time.sleep(3)
    return Server()
'''


async def test_a_worker_that_prints_is_ready_only_once_it_listens(tmp_path: Path) -> None:
    """A line the app printed in a worker was taken for its ready line: the supervisor said it served
    while no worker listened yet, and a connection then was refused."""
    process = await _two_workers(tmp_path, CHATTY_APP, "chattyapp:make")
    try:
        assert process.stdout is not None and process.stderr is not None
        data = b""
        with trio.fail_after(60):
            while b"evergreen-trio serving on" not in data or not data.endswith(b"\n"):
                chunk = await process.stdout.receive_some(4096)
                assert chunk, f"serve exited ({await process.wait()})"
                data += chunk
        ready = next(line for line in data.decode().splitlines() if "serving on" in line)
        host, port = address_of(ready).rsplit(":", 1)
        stream = await trio.open_tcp_stream(host, int(port))  # refused while no worker listens
        await stream.aclose()
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            stderr = b"".join([chunk async for chunk in process.stderr])
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
    assert stderr.count(b"loading weights...") == 2  # each worker's print, on stderr
