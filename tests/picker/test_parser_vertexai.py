"""``vertexai-parser``: llm-d-router's parsers/vertexai/vertexai_test.go (and util/grpc_test.go)
ported, the openai-parser checks it applies to the wrapped JSON, gRPC responses through the picker,
and fuzzing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._proto.vertexai import vertexai_pb2 as pb
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.grpc import FrameError, grpc_payload
from evergreen_trio.picker.parsers.vertexai import VERTEX_AI, VERTEX_RESPONSES
from evergreen_trio.picker.request import Api, InferenceRequest
from evergreen_trio.picker.usage import Usage
from tests.picker.test_parsers import forwarded_body, parsers_config, picker_with, send
from tests.picker.test_processor import lb_metadata, response_body, response_headers, status

SERVICE = "/google.cloud.aiplatform.v1beta1.PredictionService/"
CHAT = SERVICE + "ChatCompletions"
STREAM_RAW = SERVICE + "StreamRawPredict"
RAW = SERVICE + "RawPredict"


def frame(payload: bytes, flag: int = 0) -> bytes:
    return bytes([flag]) + len(payload).to_bytes(4, "big") + payload


def wrapped(data: object, path: str = CHAT) -> bytes:
    """A gRPC body of the method at ``path`` whose HttpBody carries ``data`` (JSON unless bytes)."""
    raw = data if isinstance(data, bytes) else json.dumps(data).encode()
    message_type = {CHAT: pb.ChatCompletionsRequest, STREAM_RAW: pb.StreamRawPredictRequest,
                    RAW: pb.RawPredictRequest}[path]
    return frame(message_type(endpoint="projects/p/locations/l/endpoints/e",
                              http_body=pb.HttpBody(data=raw)).SerializeToString())


def parse(body: bytes, path: str = CHAT) -> InferenceRequest:
    return VERTEX_AI.parse(path.split("?", 1)[0], {":path": path, "content-type": "application/grpc"}, body)


@pytest.mark.parametrize(("path", "data", "api", "prompt", "stream"), [
    (CHAT, {"messages": [{"role": "user", "content": "Hello"}], "stream": True}, Api.CHAT, "userHello", True),
    (STREAM_RAW, {"input": "Hello from stream raw predict"}, Api.RESPONSES, "Hello from stream raw predict", False),
    (RAW, {"input": "Hello from raw predict"}, Api.RESPONSES, "Hello from raw predict", False),
])
def test_parse_request(path: str, data: dict[str, Any], api: Api, prompt: str, stream: bool) -> None:
    request = parse(wrapped(data, path), path)
    assert (request.api, request.prompt, request.stream, request.model) == (api, prompt, stream, "")
    assert not request.rewritable and not request.skip_response and request.response is VERTEX_RESPONSES


def test_another_method_is_forwarded_without_its_response() -> None:
    for path in ("/unsupported/path", CHAT + "?x=1"):  # the reference matches the :path as sent
        request = parse(b"", path)
        assert request.skip_response and not request.rewritable and request.model == ""


@pytest.mark.parametrize(("body", "path", "message"), [
    (b"\x00\x00\x00\x00", CHAT, "invalid gRPC frame"),
    (b"\x00\x00\x00\x00\x01\xff", CHAT, "unmarshaling ChatCompletionsRequest"),
    (b"\x00\x00\x00\x00\x01\xff", STREAM_RAW, "unmarshaling StreamRawPredictRequest"),
    (b"\x00\x00\x00\x00\x01\xff", RAW, "unmarshaling RawPredictRequest"),
    (frame(b"", flag=1), CHAT, "compressed gRPC payload is not supported"),
    (b"\x00\x00\x00\x00\x09abc", CHAT, "incomplete gRPC payload"),
    (frame(pb.ChatCompletionsRequest(endpoint="e").SerializeToString()), CHAT,
     "ChatCompletionsRequest has no HttpBody"),
    (frame(b"\x0a\x02\xff\xfe"), CHAT, "unmarshaling ChatCompletionsRequest"),  # an endpoint not UTF-8
    (wrapped(b"{oops"), CHAT, "parsing ChatCompletionsRequest"),
    (wrapped(b""), CHAT, "parsing ChatCompletionsRequest"),
    (wrapped({"messages": []}), CHAT, "must have valid messages field"),
    (wrapped({"messages": [{"role": "user", "content": 5}]}), CHAT, "must have valid messages field"),
    (wrapped({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]}), CHAT,
     "must have valid messages field"),
    (wrapped({"messages": [{"role": "user"}], "chat_template_kwargs": []}), CHAT, "must have valid messages field"),
    (wrapped({"input": None}, RAW), RAW, "must have input field"),
    (wrapped({"instructions": "i"}, STREAM_RAW), STREAM_RAW, "must have input field"),
    (wrapped({"input": "x", "cache_salt": 1}, RAW), RAW, "must have input field"),
    (wrapped(b'{"input": "x", "t": 1e999}', RAW), RAW, "parsing RawPredictRequest"),
])
def test_parse_request_errors(body: bytes, path: str, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(body, path)
    assert caught.value.status == 400 and message in caught.value.message


def test_what_the_wrapped_json_gives() -> None:
    chat = parse(wrapped({"model": "gemini", "max_tokens": 7, "max_completion_tokens": 9, "messages": [
        {"role": "system", "content": [{"type": "text", "text": "be brief"}]}, {"role": "user", "content": None}]}))
    assert (chat.model, chat.output_cap, chat.prompt) == ("gemini", 9, "systembe briefuser")
    raw = parse(wrapped({"input": [{"role": "user", "content": "x"}], "instructions": "i", "max_output_tokens": 3,
                         "max_tokens": 5}, RAW), RAW)
    assert (raw.output_cap, raw.prompt) == (3, "iuserx")
    # Unknown protobuf fields and trailing bytes after the message are ignored, as in Go.
    body = wrapped({"input": "x"}, RAW)
    assert parse(body + b"\x00junk", RAW).prompt == "x"
    assert parse(frame(grpc_payload(body) + b"\x18\x05"), RAW).prompt == "x"


def test_grpc_payload() -> None:
    assert grpc_payload(frame(b"abc")) == b"abc" and grpc_payload(frame(b"abc", flag=2) + b"z") == b"abc"
    for bad in (b"", b"\x00\x00\x00\x00", frame(b"abc")[:-1], frame(b"", flag=1),
                b"\x00\xff\xff\xff\xff"):
        with pytest.raises(FrameError):
            grpc_payload(bad)


def _usage(chunks: list[bytes]) -> Usage:
    reader = VERTEX_RESPONSES.reader(sse=False, rewrite=None, max_bytes=1000)
    for chunk in chunks:
        reader.feed(chunk)
    reader.finish()
    return reader.usage


def test_response_usage() -> None:
    data = b'{"object":"chat.completion","usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}'
    valid = frame(pb.HttpBody(data=data).SerializeToString())
    assert _usage([valid]) == Usage(10, 20, None, 30)
    assert _usage([valid[:3], valid[3:9], valid[9:]]) == Usage(10, 20, None, 30)  # a message split across chunks
    for nothing in ([], [b""], [b"\x00\x00\x00\x00"], [frame(b"\xff")], [frame(pb.HttpBody().SerializeToString())],
                    [frame(valid[5:], flag=1)]):
        assert _usage(nothing) == Usage()
    stream = [frame(pb.HttpBody(data=b'{"usage":{"prompt_tokens":4}}').SerializeToString()),
              frame(pb.HttpBody(data=b'{"usage":{"completion_tokens":6}}').SerializeToString())]
    assert _usage([b"".join(stream)]) == Usage(4, 6, None) and not VERTEX_RESPONSES.rewrites


def test_claims() -> None:
    assert VERTEX_AI.paths == (
        "PredictionService/ChatCompletions", "PredictionService/StreamRawPredict", "PredictionService/RawPredict")


# -- through the picker -------------------------------------------------------------------------------


def test_a_chat_completions_call_is_routed_forwarded_as_sent_and_its_usage_read() -> None:
    picker = picker_with(parsers_config("vertexai-parser"))
    body = wrapped({"model": "food-review", "messages": [{"role": "user", "content": "hi"}]})
    stream, replies = send(picker, CHAT, body, [("content-type", "application/grpc")])
    assert lb_metadata(replies[0]) and forwarded_body(replies) == body
    assert (stream.report.client_model, stream.report.target_model) == ("food-review", "")
    assert stream.route is not None and not stream.route.hashes  # a prompt of 6 bytes fills no block
    stream.on_message(response_headers("application/grpc"))
    reply = frame(pb.HttpBody(data=b'{"model":"food-review","usage":{"prompt_tokens":5,"completion_tokens":2}}')
                  .SerializeToString())
    out = stream.on_message(response_body(reply[:7], end=False)) + stream.on_message(response_body(reply[7:]))
    assert b"".join(r.response_body.response.body_mutation.streamed_response.body for r in out) == reply
    assert stream.report.usage == Usage(5, 2, None)


def test_the_rewrite_header_names_the_target_and_nothing_is_rewritten() -> None:
    picker = picker_with(parsers_config("vertexai-parser"))
    body = wrapped({"model": "food-review", "messages": [{"role": "user", "content": "hi"}]})
    stream, replies = send(picker, CHAT, body, [("x-gateway-model-name-rewrite", "food-review-v1")])
    assert forwarded_body(replies) == body and stream.report.target_model == "food-review-v1"
    (head,) = stream.on_message(response_headers("application/grpc"))
    assert not head.response_headers.response.header_mutation.remove_headers  # no content-length dropped
    _, replies = send(picker, CHAT, wrapped({"model": "unknown", "messages": [{"role": "user", "content": "x"}]}))
    assert status(replies) == 404  # the configured models still say which names are served


def test_another_method_is_routed_and_the_stream_ends() -> None:
    picker = picker_with(parsers_config("vertexai-parser", "passthrough-parser"))
    stream, replies = send(picker, SERVICE + "CountTokens", b"\x00\x00\x00\x00\x00")
    assert lb_metadata(replies[0]) and not stream.finished  # passthrough: not vertex's path
    stream, replies = send(picker, CHAT + "?alt=x", b"\x00\x00\x00\x00\x00")
    assert lb_metadata(replies[0]) and stream.finished


# -- fuzzing ------------------------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["role", "content", "type", "text", "image_url", "url", "messages", "input"]), inner,
        max_size=3), max_leaves=10)


@pytest.mark.fuzz
@given(st.binary(max_size=200), st.sampled_from([CHAT, STREAM_RAW, RAW]), st.booleans())
def test_fuzz_arbitrary_bytes(data: bytes, path: str, framed: bool) -> None:
    try:
        parse(frame(data) if framed else data, path)
    except RequestError as exc:
        assert exc.status == 400


@pytest.mark.fuzz
@given(st.sampled_from(["messages", "input", "instructions", "model", "stream", "max_tokens", "chat_template_kwargs"]),
       _json, st.sampled_from([CHAT, RAW]), st.binary(max_size=8))
def test_fuzz_mutated_bodies(field: str, value: object, path: str, junk: bytes) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}], "input": "y", field: value}
    try:
        request = parse(wrapped(body, path) + junk, path)
    except RequestError as exc:
        assert exc.status == 400
    else:
        assert request.prompt_bytes == len(request.prompt.encode())


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=30), max_size=6))
def test_fuzz_response_bytes(chunks: list[bytes]) -> None:
    assert isinstance(_usage(chunks), Usage)
