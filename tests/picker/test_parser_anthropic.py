"""``anthropic-parser``: llm-d-router's parsers/anthropic/anthropic_test.go ported, the field
types its struct decode enforces, a stream through the picker, and fuzzing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.anthropic import ANTHROPIC, ANTHROPIC_RESPONSES
from evergreen_trio.picker.parsers.registry import request_path
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.request import InferenceRequest
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage
from tests.picker.test_parsers import forwarded_body, parsers_config, picker_with, send
from tests.picker.test_processor import lb_metadata, response_body, response_headers, status

MESSAGES = {":path": "/v1/messages"}
HELLO = [{"role": "user", "content": "Hello"}]


def parse(body: object, headers: Mapping[str, str] = MESSAGES) -> InferenceRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return ANTHROPIC.parse(request_path(headers), headers, raw)


CASES: list[tuple[str, dict[str, Any], str]] = [
    ("simple text messages", {"messages": [{"role": "user", "content": "Hello, Claude"}]}, "userHello, Claude"),
    ("structured content blocks",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "Describe this image"}]}]},
     "userDescribe this image"),
    ("system prompt as string", {"system": "You are a helpful assistant.", "messages": HELLO},
     "You are a helpful assistant.userHello"),
    ("system prompt as content blocks",
     {"system": [{"type": "text", "text": "You are a helpful assistant."}], "messages": HELLO},
     "You are a helpful assistant.userHello"),
    ("message with image content", {"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
        {"type": "text", "text": "What is in this image?"}]}]}, "userWhat is in this image?"),
    ("request with tools", {"tools": [{"name": "get_weather", "description": "Get the weather"}],
                            "messages": [{"role": "user", "content": "What's the weather?"}]},
     "userWhat's the weather?"),
    ("request with cache_salt", {"cache_salt": "test-salt-123", "messages": HELLO}, "userHello"),
]


@pytest.mark.parametrize(("name", "fields", "prompt"), CASES, ids=[c[0] for c in CASES])
def test_parse_request(name: str, fields: dict[str, Any], prompt: str) -> None:
    body = {"model": "claude-sonnet-4-6", "max_tokens": 1024, **fields}
    request = parse(body)
    assert (request.model, request.stream, request.output_cap, request.prompt) == (
        "claude-sonnet-4-6", False, 1024, prompt)
    assert request.body == body and request.rewritable and not request.skip_response
    assert request.prompt_bytes == len(prompt.encode()) and request.response is ANTHROPIC_RESPONSES


def test_stream_flag_and_path_from_x_original_path() -> None:
    body = {"model": "claude-sonnet-4-6", "max_tokens": 1024, "stream": True, "messages": HELLO}
    assert parse(body).stream
    assert parse(body, {"x-original-path": "/v1/messages"}).model == "claude-sonnet-4-6"


@pytest.mark.parametrize(("body", "headers"), [
    ({"model": "m", "max_tokens": 1024, "messages": []}, MESSAGES),  # empty messages array
    ({"model": "m", "max_tokens": 1024}, MESSAGES),  # missing messages field
    (b"null", MESSAGES),  # nil body
    ({"model": "m", "max_tokens": 1024, "messages": HELLO}, {":path": "/v1/chat/completions"}),  # unsupported path
    ({"model": "m", "max_tokens": 1024, "messages": HELLO}, {}),  # no path header: /v1/completions
    ({"model": "m", "messages": HELLO}, {":path": "/v1/messages/"}),  # the registry trims the slash, not the parser
])
def test_parse_request_errors(body: object, headers: Mapping[str, str]) -> None:
    with pytest.raises(RequestError) as caught:
        parse(body, headers)
    assert caught.value.status == 400


@pytest.mark.parametrize("body", [
    b'{"model":"test-model","system":"You are a helpful assistant.","messages":[{"role":"user","content":"Hello"}]}',
    b"", b"not-json", b"{}"])
def test_count_tokens_is_forwarded_as_received_without_its_response(body: bytes) -> None:
    for headers in ({":path": "/v1/messages/count_tokens"}, {"x-original-path": "/v1/messages/count_tokens"}):
        request = parse(body, headers)
        assert request.skip_response and not request.rewritable and request.model == "" and request.prompt == ""


@pytest.mark.parametrize(("body", "cap"), [({"max_tokens": 1024}, 1024), ({}, None), ({"max_tokens": 10.0}, 10),
                                            ({"max_tokens": -1}, None), ({"max_tokens": "9"}, None)])
def test_max_output_tokens(body: dict[str, Any], cap: int | None) -> None:
    assert parse({"model": "claude-sonnet-4-6", "messages": HELLO, **body}).output_cap == cap


def test_tool_blocks_parse_and_their_text_is_the_prompt() -> None:
    body = b"""{
        "model": "claude-sonnet-4-6", "max_tokens": 1024,
        "tools": [{"name": "get_weather", "description": "Get the weather",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Weather in Zurich?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "need the tool"},
                {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Zurich"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01",
                 "content": [{"type": "text", "text": "Sunny"}]}]}]}"""
    assert parse(body).prompt == "userWeather in Zurich?assistantuserSunny"


@pytest.mark.parametrize("fields", [
    {"messages": "Hello"}, {"messages": [{"role": 1, "content": "x"}]}, {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": "a-url"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": 3}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, "text"]}]},
    {"messages": HELLO, "system": 1}, {"messages": HELLO, "system": {"type": "text"}},
    {"messages": HELLO, "tools": [{"name": 1}]}, {"messages": HELLO, "tools": [{"strict": "yes"}]},
    {"messages": HELLO, "cache_salt": 7}, {"messages": HELLO, "CACHE_SALT": []},
])
def test_a_field_of_the_wrong_type_is_400(fields: dict[str, Any]) -> None:
    with pytest.raises(RequestError) as caught:
        parse({"model": "m", **fields})
    assert caught.value.status == 400 and "messages request" in caught.value.message


@pytest.mark.parametrize("depth", [50, 300, 2000])
def test_deeply_nested_content_is_read_or_refused(depth: int) -> None:
    content = '[{"type":"tool_result","content":' * depth + '"x"' + "}]" * depth
    body = ('{"model":"m","messages":[{"role":"user","content":' + content + "}]}").encode()
    try:
        assert parse(body).prompt == "userx"
    except RequestError as exc:
        assert exc.status == 400 and depth > 50


def test_what_go_accepts() -> None:
    """Null leaves a zero value, fields match case-insensitively, unknown fields and any JSON in
    ``input``/``input_schema`` pass; the map keeps ``model`` and ``stream`` exact."""
    request = parse({"Model": "ignored", "model": "m", "Messages": [{"role": "user", "content": None}, None],
                     "STREAM": True, "system": None, "tools": None, "extra": {"any": [1]},
                     "x": [{"role": "user", "content": [{"type": "tool_use", "input": [1, "two"]}]}]})
    assert (request.model, request.stream, request.prompt) == ("m", False, "user")


def test_response_usage() -> None:
    def usage(body: bytes, sse: bool = False) -> Usage:
        reader = ANTHROPIC_RESPONSES.reader(sse=sse, rewrite=None, max_bytes=10_000)
        reader.feed(body)
        reader.finish()
        return reader.usage

    message = b'{"id":"msg_123","type":"message","role":"assistant","content":[{"type":"text","text":"Hello"}],'
    assert usage(message + b'"usage":{"input_tokens":25,"output_tokens":15}}') == Usage(25, 15, None)
    assert usage(message + b'"usage":{"input_tokens":100,"output_tokens":50,"cache_read_input_tokens":80}}') == Usage(
        100, 50, 80)
    for nothing in (b'{"id":"msg_123","type":"message"}', b"{malformed", b""):
        assert usage(nothing) == Usage()
    start = b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_123",' \
            b'"usage":{"input_tokens":25}}}\n'
    delta = b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},' \
            b'"usage":{"output_tokens":15}}\n'
    text = b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta",' \
           b'"text":"usage"}}\n'
    assert usage(start, sse=True) == Usage(25, None, None)
    assert usage(delta, sse=True) == Usage(None, 15, None)
    assert usage(start + b"\n" + text + b"\n" + delta, sse=True) == Usage(25, 15, None)
    cached = b'data: {"type":"message_start","message":{"usage":{"input_tokens":100,"cache_read_input_tokens":80}}}\n'
    assert usage(cached + b'data: {"type":"message_delta","usage":{"output_tokens":50}}\n', sse=True) == Usage(
        100, 50, 80)
    for nothing in (text, b'event: message_stop\ndata: {"type":"message_stop"}\n'):
        assert usage(nothing, sse=True) == Usage()


def test_claims() -> None:
    assert ANTHROPIC.paths == ("messages", "messages/count_tokens")


# -- through the picker ---------------------------------------------------------------------------


def test_a_messages_request_is_routed_rewritten_and_its_usage_read() -> None:
    picker = picker_with(parsers_config("anthropic-parser"))
    body = json.dumps({"model": "food-review", "max_tokens": 64, "messages": HELLO}).encode()
    stream, replies = send(picker, "/v1/messages", body)
    assert lb_metadata(replies[0])[DESTINATION] == "10.0.0.1:8000"
    assert json.loads(forwarded_body(replies)) == {"model": "food-review-v1", "max_tokens": 64, "messages": HELLO}
    assert (stream.report.client_model, stream.report.target_model) == ("food-review", "food-review-v1")
    stream.on_message(response_headers("text/event-stream"))
    events = (b'data: {"type":"message_start","message":{"model":"food-review-v1","usage":{"input_tokens":7}}}\n\n'
              b'data: {"type":"message_delta","usage":{"output_tokens":3}}\n\n')
    sent = stream.on_message(response_body(events))
    out = b"".join(r.response_body.response.body_mutation.streamed_response.body for r in sent)
    assert b'"model":"food-review"' in out and b"food-review-v1" not in out
    assert stream.report.usage == Usage(7, 3, None)


def test_count_tokens_is_routed_and_the_stream_ends() -> None:
    stream, replies = send(picker_with(), "/v1/messages/count_tokens", b'{"model":"food-review","messages":[]}')
    assert lb_metadata(replies[0])[DESTINATION] == "10.0.0.1:8000"
    assert forwarded_body(replies) == b'{"model":"food-review","messages":[]}' and stream.finished


def test_a_model_is_needed_unless_the_rewrite_header_names_one() -> None:
    body = json.dumps({"messages": HELLO}).encode()
    _, replies = send(picker_with(), "/v1/messages", body)
    assert status(replies) == 400
    assert json.loads(replies[0].immediate_response.body)["error"]["message"] == "model not found in request body"
    # With no models configured, the header's target is written into the body, as the reference does.
    config = parse_config("pool: {endpoints: ['10.0.0.1:8000']}\n")
    picker = Picker(config, PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0))
    picker.snapshot.update("10.0.0.1:8000", EndpointMetrics())
    stream, replies = send(picker, "/v1/messages", body, [("x-gateway-model-name-rewrite", "claude-x")])
    assert json.loads(forwarded_body(replies)) == {"messages": HELLO, "model": "claude-x"}
    assert (stream.report.client_model, stream.report.target_model) == ("", "claude-x")


# -- fuzzing ----------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["type", "text", "content", "role", "source", "input", "name", "messages", "system"]),
        inner, max_size=3), max_leaves=10)


@pytest.mark.fuzz
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(body: bytes) -> None:
    try:
        parse(body)
    except RequestError as exc:
        assert exc.status == 400


@pytest.mark.fuzz
@given(st.sampled_from(["messages", "system", "tools", "cache_salt", "max_tokens", "model", "stream"]), _json,
       st.integers(0, 3))
def test_fuzz_mutated_bodies(field: str, value: object, where: int) -> None:
    body: dict[str, Any] = {"model": "m", "max_tokens": 5, "system": "s", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "tool_result", "content": "y"}]}]}
    if where == 0:
        body[field] = value
    elif where == 1:
        body["messages"][0][field] = value
    else:
        body["messages"][0]["content"][where - 2][field] = value
    try:
        request = parse(body)
    except RequestError as exc:
        assert exc.status == 400
    else:
        assert isinstance(request.prompt, str) and request.prompt_bytes == len(request.prompt.encode())


_event = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10) | st.floats(allow_nan=False) | st.sampled_from(
        ["message_start", "message_delta", "x"]),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(
        ["type", "message", "usage", "input_tokens", "output_tokens", "cache_read_input_tokens", "model"]),
        inner, max_size=4), max_leaves=10)


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=40) | _event.map(lambda d: b"data: " + json.dumps(d).encode() + b"\n"),
                max_size=5), st.booleans())
def test_fuzz_response_usage(chunks: list[bytes], sse: bool) -> None:
    reader = ANTHROPIC_RESPONSES.reader(sse=sse, rewrite=("t", "c"), max_bytes=300)
    try:
        for chunk in chunks:
            reader.feed(chunk)
        reader.finish()
    except RequestError as exc:
        assert exc.status == 502
    assert all(n is None or n >= 0 for n in (reader.usage.prompt_tokens, reader.usage.completion_tokens,
                                              reader.usage.cached_tokens))
