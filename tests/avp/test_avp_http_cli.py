"""``evergreen-trio avp serve`` as a user types it, good and bad; and the receiver's body decoding fuzzed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evergreen_trio.avp import AVPMetadata, encode
from evergreen_trio.avp.server import AVPApp, AVPServerOptions

COMMAND = [sys.executable, "-m", "evergreen_trio.cli", "avp", "serve"]


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen([*COMMAND, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line.startswith("avp http://"), (line, process.stderr.read() if process.stderr else "")
    return process, line.removeprefix("avp ")


def _stop(process: subprocess.Popen[str]) -> int:
    process.send_signal(signal.SIGINT)
    return process.wait(timeout=30)


def test_serve_with_a_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok-123\n")
    process, url = _start("--port", "0", "--token-file", str(tmp_path / "token"))
    try:
        message = encode(np.ones((2, 3), "<f4"), AVPMetadata(tensor_shape=(2, 3)))
        headers = {"authorization": "Bearer tok-123", "content-type": "application/avp+binary"}
        answer = httpx.post(f"{url}/avp/v2/transmit", content=message, headers=headers, timeout=30)
        assert answer.json() == {"success": True, "payload_type": "HIDDEN_STATE", "dtype": "FLOAT32",
                                 "shape": [2, 3], "bytes": 24}
        refused = httpx.post(f"{url}/avp/v2/transmit", content=message, timeout=30)
        assert refused.status_code == 401
        bad = httpx.post(f"{url}/avp/v2/transmit", content=b"XY" + message[2:], headers=headers, timeout=30)
        assert bad.status_code == 400
        assert bad.json()["message"] == "bad AVP message: magic: expected 4156 ('AV'), got 5859"
        assert httpx.get(f"{url}/health", timeout=30).json() == {"status": "ok"}
    finally:
        assert _stop(process) == 0


def test_bad_input_gets_one_line_and_a_status(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    cases = [
        (["--port", "70000"], 2, "argument --port: expected a port in 0..65535, got '70000'"),
        (["--port", "x"], 2, "argument --port: expected a port in 0..65535, got 'x'"),
        (["--token-file", str(tmp_path / "missing")], 2, "error: argument --token-file: cannot read"),
        (["--token-file", str(tmp_path / "empty")], 2, "expected at least one token"),
        (["--host", "203.0.113.1", "--port", "0"], 1, "error: cannot listen on 203.0.113.1:0"),
    ]
    for args, code, message in cases:
        result = subprocess.run([*COMMAND, *args], capture_output=True, text=True, timeout=60,
                                env=os.environ | {"PYTHONPATH": os.getcwd()})
        assert result.returncode == code, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)


def test_a_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*COMMAND, "--port", str(port)], capture_output=True, text=True, timeout=60,
                                env=os.environ | {"PYTHONPATH": os.getcwd()})
    assert result.returncode == 1 and f"error: cannot listen on 127.0.0.1:{port}" in result.stderr


# ------------------------------------------------------------ fuzzing the receiver through the ASGI app


def _post(app: AVPApp, path: str, body: bytes, pieces: int) -> tuple[int, dict[str, Any]]:
    async def run() -> tuple[int, dict[str, Any]]:
        step = max(1, len(body) // pieces)
        chunks = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
        messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "path": path, "method": "POST", "headers": []}
        await app(scope, receive, send)
        return sent[0]["status"], json.loads(sent[1]["body"])

    return trio.run(run)


GOOD = encode(np.arange(6, dtype="<f4"), AVPMetadata(tensor_shape=(2, 3)), compression="fast")


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(GOOD)
    for _ in range(draw(st.integers(0, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))]) + draw(st.binary(max_size=8))


@pytest.mark.fuzz
@settings(suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.one_of(mutated(), st.binary(max_size=64)), st.integers(1, 5),
       st.sampled_from(["/avp/v2/transmit", "/avp/v2/handshake", "/avp/v2/text"]))
def test_fuzz_the_receiver_answers_200_or_a_one_line_400(body: bytes, pieces: int, path: str) -> None:
    status, document = _post(AVPApp(AVPServerOptions()), path, body, pieces)
    if status == 200:
        assert document["success"] is True
    else:
        assert status == 400 and document["success"] is False and "\n" not in document["message"]
