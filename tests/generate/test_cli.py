"""`evergreen-trio serve --generate-backend URL --model NAME`: options, and a real server process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
import trio

from evergreen_trio import connect, inner, text
from evergreen_trio.cli import build_parser
from evergreen_trio.generate import BackendConfigError, BackendSettings, served_by
from evergreen_trio.serving.server_cli import backend_from_args
from evergreen_trio.sim import SimConfig, run_sim
from evergreen_trio.testing.subprocess_server import serve_command


def parse(*argv: str) -> BackendSettings | None:
    return backend_from_args(build_parser().parse_args(["serve", *argv]))


def test_without_a_backend_generate_is_the_toy() -> None:
    assert parse() is None


def test_the_options_make_backend_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UPSTREAM_KEY", "sk-test")
    settings = parse("--generate-backend", "http://gw:8080", "--model", "llama", "--generate-api", "chat",
                     "--max-tokens", "0", "--api-key-env", "UPSTREAM_KEY", "--no-usage", "--read-timeout", "2.5",
                     "--max-response-bytes", "1000")
    assert settings == BackendSettings("http://gw:8080", "llama", api="chat", max_tokens=None, api_key="sk-test",
                                       include_usage=False, read_timeout_s=2.5, max_response_bytes=1000)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama"], "--model needs --generate-backend"),
        (["--generate-backend", "http://gw"], "--generate-backend needs --model"),
        (["--generate-backend", "gw:8080", "--model", "m"], "url: expected http"),
        (["--generate-backend", "http://gw", "--model", "m", "--api-key-env", "NO_SUCH_VARIABLE_SET"],
         "NO_SUCH_VARIABLE_SET to be set"),
    ],
)
def test_bad_options_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(BackendConfigError, match=message):
        parse(*argv)


def test_the_command_exits_2_on_bad_options() -> None:
    result = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "serve", "--model", "m"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "--model needs --generate-backend" in result.stderr


@pytest.fixture
async def sim(nursery: trio.Nursery) -> AsyncIterator[str]:
    yield f"127.0.0.1:{await nursery.start(run_sim, SimConfig(decode_ms_per_token=1.0))}"
    nursery.cancel_scope.cancel()


async def test_a_served_generate_streams_from_the_backend(sim: str) -> None:
    backend = ("--generate-backend", f"http://{sim}", "--model", "sim-model", "--max-tokens", "3")
    async with serve_command(*backend) as line:
        assert f"(GENERATE -> http://{sim}/v1/completions model sim-model)" in line
        port = line.split(" (")[0].rsplit(":", 1)[1]
        async with connect(f"127.0.0.1:{port}") as session:
            call = await session.run("GENERATE", {"prompt": inner(text("Hello"))}, ["response"])
            chunks = [(chunk.metadata, await chunk.read()) async for chunk in call["response"]]
        [(metadata, data)] = chunks
        assert served_by(metadata) == sim and len(data.split()) == 3
