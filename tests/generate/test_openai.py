"""The OpenAI wire, sans-IO: settings, request bodies, status mapping, the stream parser (fuzzed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio import StatusCode
from evergreen_trio.generate import (
    BackendConfigError,
    BackendSettings,
    PromptPart,
    ResponseTooLargeError,
    SSEError,
    StreamFormatError,
    StreamParser,
    UpstreamStatusError,
    request_body,
    status_code,
)
from evergreen_trio.generate.errors import BackendError
from evergreen_trio.generate.openai import error_message
from evergreen_trio.sim import SimConfig
from evergreen_trio.sim.api import SSE_DONE, parse_request, sse, stream_chunk, usage_chunk
from evergreen_trio.sim.model import Usage

SETTINGS = BackendSettings("http://127.0.0.1:8080", "sim-model", max_tokens=5)
CHAT = BackendSettings("http://127.0.0.1:8080/v1", "sim-model", api="chat", max_tokens=None, include_usage=False)


def test_urls() -> None:
    assert SETTINGS.endpoint == "http://127.0.0.1:8080/v1/completions"
    assert CHAT.endpoint == "http://127.0.0.1:8080/v1/chat/completions"
    assert BackendSettings("https://api.example.com/openai/v1/", "m").endpoint == (
        "https://api.example.com/openai/v1/completions"
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"url": "127.0.0.1:8080"}, "url: expected http"),
        ({"url": "ftp://host"}, "url: expected http"),
        ({"url": "http://host:99999"}, "url: expected a port"),
        ({"url": "http://host/v1?x=1"}, "url: expected http"),
        ({"model": ""}, "model: expected a model name"),
        ({"api": "responses"}, "api: expected one of completions, chat"),
        ({"max_tokens": 0}, "max_tokens: expected >= 1 or None"),
        ({"served_by_header": ""}, "served_by_header"),
        ({"read_timeout_s": 0}, "read_timeout_s: expected a finite number"),
        ({"total_timeout_s": float("inf")}, "total_timeout_s: expected a finite number"),
        ({"max_response_bytes": 0}, "max_response_bytes: expected >= 1"),
    ],
)
def test_settings_are_validated(fields: dict[str, object], message: str) -> None:
    with pytest.raises(BackendConfigError, match=message):
        BackendSettings(**{"url": "http://h", "model": "m", **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize("key", ["sk-hidden\n", "sk-hidden\r\nx-forged: 1", "sk-hid\x00den", "sk-hiddén", ""])
def test_an_api_key_that_is_no_header_token_is_refused_without_echoing_it(key: str) -> None:
    with pytest.raises(BackendConfigError, match="api_key: expected printable ASCII") as caught:
        BackendSettings("http://h", "m", api_key=key)
    assert "hid" not in str(caught.value)


def test_the_api_key_stays_out_of_repr() -> None:
    assert "secret" not in repr(BackendSettings("http://h", "m", api_key="secret"))


PARTS = [PromptPart("", "Write a summary of this video: "), PromptPart("assistant", " F1."),
         PromptPart("", "Who's"), PromptPart("user", " winning?")]


def test_request_bodies_are_what_the_simulator_accepts() -> None:
    body = request_body(SETTINGS, PARTS)
    assert body == {"model": "sim-model", "stream": True, "max_tokens": 5, "stream_options": {"include_usage": True},
                    "prompt": "Write a summary of this video:  F1.Who's winning?"}
    parsed = parse_request("/v1/completions", json.dumps(body).encode(), SimConfig())
    assert parsed.stream and parsed.include_usage and parsed.max_tokens == 5
    chat = request_body(CHAT, PARTS)
    assert chat == {"model": "sim-model", "stream": True, "messages": [
        {"role": "user", "content": "Write a summary of this video: "},
        {"role": "assistant", "content": " F1."},
        {"role": "user", "content": "Who's winning?"},
    ]}
    assert parse_request("/v1/chat/completions", json.dumps(chat).encode(), SimConfig()).chat
    assert request_body(CHAT, [])["messages"] == [{"role": "user", "content": ""}]


@pytest.mark.parametrize(
    ("http_status", "code"),
    [(429, StatusCode.RESOURCE_EXHAUSTED), (503, StatusCode.UNAVAILABLE), (502, StatusCode.UNAVAILABLE),
     (504, StatusCode.UNAVAILABLE), (408, StatusCode.DEADLINE_EXCEEDED), (400, StatusCode.INVALID_ARGUMENT),
     (413, StatusCode.INVALID_ARGUMENT), (422, StatusCode.INVALID_ARGUMENT), (401, StatusCode.FAILED_PRECONDITION),
     (403, StatusCode.FAILED_PRECONDITION), (404, StatusCode.FAILED_PRECONDITION),
     (409, StatusCode.FAILED_PRECONDITION), (500, StatusCode.INTERNAL), (501, StatusCode.INTERNAL)],
)
def test_status_mapping(http_status: int, code: StatusCode) -> None:
    assert status_code(http_status) == code


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "model not found", "code": 404}}', "model not found"),
        (b'{"error": "plain string"}', "plain string"),
        (b'{"detail": "fastapi says"}', "fastapi says"),
        (b"not json\x00\x1b[31m", "not json  [31m"),
        (b"", "(empty body)"),
        (b"x" * 1000, "x" * 300 + "..."),
        (b"[1, 2]", "[1, 2]"),
    ],
)
def test_error_messages(body: bytes, message: str) -> None:
    assert error_message(body) == message


def sim_stream(chat: bool, tokens: list[str]) -> bytes:
    """A stream exactly as the simulator frames it (its own sans-IO functions)."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    settings = CHAT if chat else SETTINGS
    request = parse_request(path, json.dumps(request_body(settings, PARTS)).encode(), SimConfig())
    frames = b"".join(sse(stream_chunk(request, "id", 0, token, first=index == 0, last=index == len(tokens) - 1))
                      for index, token in enumerate(tokens))
    frames += sse(usage_chunk(request, "id", 0, Usage(prompt_tokens=12, completion_tokens=len(tokens),
                                                             cached_tokens=4)))
    return frames + SSE_DONE


@pytest.mark.parametrize("chat", [False, True])
def test_the_simulators_stream_parses_byte_by_byte(chat: bool) -> None:
    parser = StreamParser(CHAT if chat else SETTINGS, where="test")
    stream = sim_stream(chat, ["Ayrton", " Senna", "."]) + b"data: after done is not read\n\n"
    deltas = [delta for index in range(len(stream)) for delta in parser.feed(stream[index : index + 1])]
    assert deltas == ["Ayrton", " Senna", "."]
    assert parser.done and parser.finish_reason == "length"
    assert parser.usage is not None and parser.usage["prompt_tokens_details"] == {"cached_tokens": 4}


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"data: {]\n\n", StreamFormatError, "expected a JSON object or \\[DONE\\]"),
        (b"data: [1]\n\n", StreamFormatError, "expected a JSON object in each data event"),
        (b'data: {"choices": 3}\n\n', StreamFormatError, "expected 'choices' to be a list"),
        (b'data: {"choices": [7]}\n\n', StreamFormatError, "expected each choice to be an object"),
        (b'data: {"choices": [{"text": 7}]}\n\n', StreamFormatError, "expected the token text to be a string"),
        (b'data: {"error": {"message": "boom", "code": 429}}\n\n', UpstreamStatusError, "HTTP 429\\): boom"),
        (b'data: {"error": "no code"}\n\n', UpstreamStatusError, "HTTP 500\\): no code"),
        (b"data: \xff\n\n", SSEError, "^test: expected UTF-8"),
        (b'data: {"choices": [{"text": "\\udc80"}]}\n\n', StreamFormatError, "expected token text without lone"),
        (b"data: " + b"x" * 100, ResponseTooLargeError, "at most 64 bytes"),
    ],
)
def test_broken_streams_are_typed_errors(data: bytes, error: type[BackendError], message: str) -> None:
    settings = BackendSettings("http://h", "m", max_line_bytes=64)
    with pytest.raises(error, match=message):
        StreamParser(settings, where="test").feed(data)


def test_the_response_size_limit() -> None:
    parser = StreamParser(BackendSettings("http://h", "m", max_response_bytes=100), where="test")
    parser.feed(b"data: " + b" " * 90)
    with pytest.raises(ResponseTooLargeError, match="test: expected a response of at most 100 bytes"):
        parser.feed(b"0123456789")


def test_chat_deltas_without_content_are_skipped() -> None:
    parser = StreamParser(CHAT, where="test")
    stream = (b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n\n'
              b'data: {"choices": [{"index": 1, "delta": {"content": "other choice"}}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
    assert parser.feed(stream) == ["hi"]
    with pytest.raises(StreamFormatError, match="'delta' to be an object"):
        parser.feed(b'data: {"choices": [{"delta": "x"}]}\n\n')


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "text", "delta", "content", "error", "usage", "index", "finish_reason", "code",
                         "message"]), inner, max_size=4),
    max_leaves=12,
)


@pytest.mark.fuzz
@given(st.lists(json_values, max_size=4), st.booleans())
def test_arbitrary_json_chunks_give_deltas_or_a_typed_error(chunks: list[object], chat: bool) -> None:
    parser = StreamParser(CHAT if chat else SETTINGS, where="fuzz")
    stream = b"".join(sse(json.dumps(chunk)) for chunk in chunks) + SSE_DONE
    try:
        deltas = parser.feed(stream)
    except BackendError:
        return
    assert parser.done and all(isinstance(delta, str) and delta for delta in deltas)


@pytest.mark.fuzz
@given(st.binary(max_size=2000), st.booleans())
def test_arbitrary_bytes_give_deltas_or_a_typed_error(data: bytes, chat: bool) -> None:
    parser = StreamParser(CHAT if chat else SETTINGS, where="fuzz")
    try:
        for delta in parser.feed(data):
            assert isinstance(delta, str) and delta
    except BackendError:
        pass
