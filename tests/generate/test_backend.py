"""GENERATE through a real HTTP upstream: the simulator (a vLLM-like server) and a scripted one.

Every test runs a real Evergreen server and client over gRPC; the upstream is a real HTTP server.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
from generate_helpers import BUSY, SERVED_BY, aborted, fill, generate, run_scripted_upstream

from evergreen_trio import StatusCode, blob, inner, text
from evergreen_trio.generate import BackendSettings, served_by
from evergreen_trio.sim import SimConfig, run_sim

FAST = SimConfig(decode_ms_per_token=1.0, prefill_us_per_token=1.0)


@pytest.fixture
async def sim(nursery: trio.Nursery) -> AsyncIterator[str]:
    port = await nursery.start(run_sim, FAST)
    yield f"http://127.0.0.1:{port}"
    nursery.cancel_scope.cancel()


@pytest.fixture
async def scripted(nursery: trio.Nursery) -> AsyncIterator[str]:
    port = await nursery.start(run_scripted_upstream)
    yield f"http://127.0.0.1:{port}/v1"
    nursery.cancel_scope.cancel()


async def direct(url: str, path: str, body: dict[str, object]) -> str:
    """The simulator's non-streaming answer to the same request (its text is deterministic per prompt)."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        response = await client.post(path, json={**body, "model": "sim-model"})
    response.raise_for_status()
    choice = response.json()["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


async def test_tokens_stream_from_the_simulator_one_fragment_each(sim: str) -> None:
    settings = BackendSettings(sim, "sim-model", max_tokens=7)
    prompt = inner(text("Write a summary of this video: "), blob(b"\x00\x00 not text", mimetype="video/mp4"),
                   text("Be brief."), id="prompt_1")
    [answer] = await generate(settings, prompt)
    # The video is skipped: the upstream saw only the text chunks, concatenated.
    assert answer.text == await direct(sim, "/v1/completions",
                                       {"prompt": "Write a summary of this video: Be brief.", "max_tokens": 7})
    assert len(answer.pieces) == 7 and all(answer.pieces)
    assert answer.metadata is not None and answer.metadata.mimetype == "text/plain"
    assert answer.metadata.role == "assistant"
    assert served_by(answer.metadata) == sim.removeprefix("http://")


async def test_the_second_turn_reuses_the_first_by_id(sim: str) -> None:
    settings = BackendSettings(sim, "sim-model", max_tokens=4)
    first, second = await generate(settings, second_turn="Who's winning?")
    expected = "Write a summary of this video: " + first.text + "Who's winning?"
    assert second.text == await direct(sim, "/v1/completions", {"prompt": expected, "max_tokens": 4})


async def test_chat_sends_one_message_per_role(sim: str) -> None:
    settings = BackendSettings(sim + "/v1/", "sim-model", api="chat", max_tokens=3)
    first, second = await generate(settings, second_turn="Who's winning?")
    messages = [
        {"role": "user", "content": "Write a summary of this video: "},
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Who's winning?"},
    ]
    assert second.text == await direct(sim, "/v1/chat/completions", {"messages": messages, "max_tokens": 3})


async def test_a_response_of_no_tokens_still_names_its_server(scripted: str) -> None:
    [answer] = await generate(BackendSettings(scripted, "empty"))
    assert answer.text == ""
    assert answer.metadata is not None and served_by(answer.metadata) == SERVED_BY


async def test_odd_splits_crlf_and_comments_are_read(scripted: str) -> None:
    [answer] = await generate(BackendSettings(scripted, "any"))
    assert answer.pieces == [b"Ayrton", b" Senna."]
    assert answer.metadata is not None and served_by(answer.metadata) == SERVED_BY


@pytest.mark.parametrize(
    ("model", "code", "message"),
    [
        ("status-429", StatusCode.RESOURCE_EXHAUSTED, "HTTP 429: scripted 429"),
        ("status-503", StatusCode.UNAVAILABLE, "HTTP 503: scripted 503"),
        ("status-502", StatusCode.UNAVAILABLE, "HTTP 502"),
        ("status-504", StatusCode.UNAVAILABLE, "HTTP 504"),
        ("status-400", StatusCode.INVALID_ARGUMENT, "HTTP 400: scripted 400"),
        ("status-413", StatusCode.INVALID_ARGUMENT, "HTTP 413"),
        ("status-401", StatusCode.FAILED_PRECONDITION, "HTTP 401"),
        ("status-404", StatusCode.FAILED_PRECONDITION, "HTTP 404"),
        ("status-408", StatusCode.DEADLINE_EXCEEDED, "HTTP 408"),
        ("status-500", StatusCode.INTERNAL, "HTTP 500"),
        ("plain-429", StatusCode.RESOURCE_EXHAUSTED, "HTTP 429: upstream says no"),
        ("json", StatusCode.INTERNAL, "expected content-type text/event-stream, got 'application/json'"),
        ("garbage", StatusCode.INTERNAL, "expected a JSON object or [DONE]"),
        ("bad-utf8", StatusCode.INTERNAL, "expected UTF-8"),
        ("deep", StatusCode.INTERNAL, "expected a data event of JSON nested less deeply in the stream, got '[[["),
        ("surrogate", StatusCode.INTERNAL, "expected token text without lone surrogates in the stream, got "
         "'\\ud800'"),
        ("gzip", StatusCode.INTERNAL, "expected no content-encoding (identity), got 'gzip'"),
        ("deep-503", StatusCode.UNAVAILABLE, 'HTTP 503: {"error": [[['),
        ("truncated", StatusCode.UNAVAILABLE, "closed the stream before data: [DONE]"),
        ("stream-error", StatusCode.UNAVAILABLE, "upstream failed in the stream (HTTP 503): scripted overload"),
    ],
)
async def test_upstream_failures_abort_with_a_clear_status(
    scripted: str, model: str, code: StatusCode, message: str
) -> None:
    error = await aborted(BackendSettings(scripted, model))
    assert error.code == code
    assert message in error.message and "action GENERATE" in error.message


async def test_a_compressed_error_body_is_read_raw_not_inflated(scripted: str) -> None:
    error = await aborted(BackendSettings(scripted, "gzip-503"))
    assert error.code == StatusCode.UNAVAILABLE and "HTTP 503: " in error.message
    assert "xxxxxxxx" not in error.message  # the gzip bytes, not what they inflate to


async def test_the_done_line_escapes_what_the_upstream_chose(scripted: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="evergreen_trio.generate")
    [answer] = await generate(BackendSettings(scripted, "forged-log"))
    assert answer.text == "ok"
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generate.done")]
    assert "\n" not in line
    assert "prompt_tokens=1\\nFORGED cached_tokens=2 completion_tokens=- finish_reason=stop\\nFORGED line" in line


async def test_an_unparsable_response_logs_a_short_line(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """h11 quotes a bad chunk header whole (up to 100 kB, 400 kB as a repr): the line keeps 300 chars of it."""
    async def bad_chunk(stream: trio.SocketStream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                request += await stream.receive_some(65536)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                  b"transfer-encoding: chunked\r\n\r\n" + b"\x01" * 90_000 + b"\r\n")

    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    nursery.start_soon(trio.serve_listeners, bad_chunk, [listener])
    caplog.set_level(logging.WARNING, logger="evergreen_trio.generate")
    error = await aborted(BackendSettings(f"http://127.0.0.1:{listener.socket.getsockname()[1]}", "m"))
    assert error.code == StatusCode.UNAVAILABLE and "RemoteProtocolError: illegal chunk header" in error.message
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generate.failed")]
    assert len(line) < 2000 and "..." in line


async def test_a_long_content_type_logs_a_short_line(scripted: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="evergreen_trio.generate")
    error = await aborted(BackendSettings(scripted, "long-content-type"))
    assert error.code == StatusCode.INTERNAL and "got 'application/xxx" in error.message
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("generate.failed")]
    assert len(line) < 2000 and "xxx..." in line


async def test_silence_past_the_read_timeout_is_deadline_exceeded(scripted: str) -> None:
    error = await aborted(BackendSettings(scripted, "hang", read_timeout_s=0.2))
    assert error.code == StatusCode.DEADLINE_EXCEEDED
    assert "sent nothing for 0.2s" in error.message


async def test_a_stream_past_the_total_timeout_is_deadline_exceeded(scripted: str) -> None:
    error = await aborted(BackendSettings(scripted, "hang", total_timeout_s=0.2))
    assert error.code == StatusCode.DEADLINE_EXCEEDED
    assert "did not finish within 0.2s" in error.message


async def test_nothing_listening_is_unavailable() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    error = await aborted(BackendSettings(f"http://127.0.0.1:{port}", "sim-model"))
    assert error.code == StatusCode.UNAVAILABLE
    assert "ConnectError" in error.message


async def test_a_response_over_max_response_bytes_is_resource_exhausted(sim: str) -> None:
    error = await aborted(BackendSettings(sim, "sim-model", max_tokens=64, max_response_bytes=2000))
    assert error.code == StatusCode.RESOURCE_EXHAUSTED
    assert "at most 2000 bytes" in error.message


async def test_a_prompt_over_max_prompt_bytes_is_resource_exhausted(sim: str) -> None:
    error = await aborted(BackendSettings(sim, "sim-model", max_prompt_bytes=10))
    assert error.code == StatusCode.RESOURCE_EXHAUSTED
    assert "at most 10 bytes of prompt text" in error.message


async def test_the_simulators_own_errors_map_too(sim: str) -> None:
    error = await aborted(BackendSettings(sim, "no-such-model"))
    assert error.code == StatusCode.FAILED_PRECONDITION and "HTTP 404" in error.message
    error = await aborted(BackendSettings(sim, "sim-model", max_tokens=100_000))  # past --max-model-len
    assert error.code == StatusCode.INVALID_ARGUMENT and "HTTP 400" in error.message


async def test_a_full_simulator_queue_is_unavailable(nursery: trio.Nursery) -> None:
    endpoint = f"127.0.0.1:{await nursery.start(run_sim, BUSY)}"
    async with httpx.AsyncClient(timeout=300) as client:
        await fill(nursery, client, endpoint)
        error = await aborted(BackendSettings(f"http://{endpoint}", "sim-model"))
        nursery.cancel_scope.cancel()
    assert error.code == StatusCode.UNAVAILABLE
    assert "HTTP 503: waiting queue is full" in error.message
