"""``vllmgrpc-parser``: llm-d-router's parsers/vllmgrpc/vllmgrpc_test.go ported, the wire shapes
of its messages, gRPC requests and responses through the picker, and fuzzing."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.message import Message
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._proto.vllm import vllm_engine_pb2 as pb
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.vllmgrpc import EMBED, GENERATE, VLLM_GRPC, VLLM_GRPC_RESPONSES
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.request import Api, InferenceRequest
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_ids
from evergreen_trio.picker.usage import Usage
from tests.picker.test_parser_vertexai import frame
from tests.picker.test_parsers import forwarded_body, parsers_config, picker_with, send
from tests.picker.test_processor import lb_metadata, response_body, response_headers, status

GENERATE_PATH, EMBED_PATH = "/" + GENERATE, "/" + EMBED


def parse(message: Message | bytes, path: str = GENERATE_PATH) -> InferenceRequest:
    body = message if isinstance(message, bytes) else frame(message.SerializeToString())
    return VLLM_GRPC.parse(path, {":path": path}, body)


def test_the_messages_have_the_reference_field_numbers() -> None:
    """Field numbers and types are the wire: pinned against llm-d-router's vllm_engine.proto."""
    def fields(message: type[Message]) -> dict[str, tuple[int, int]]:
        return {f.name: (f.number, f.type) for f in message.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    assert fields(pb.GenerateRequest) == {"request_id": (1, 9), "tokenized": (2, 11), "text": (3, 9),
                                          "sampling_params": (4, 11), "stream": (5, 8), "mm_inputs": (7, 11)}
    assert fields(pb.TokenizedInput) == {"original_text": (1, 9), "input_ids": (2, 13)}
    assert fields(pb.EmbedRequest) == {"request_id": (1, 9), "tokenized": (2, 11)}
    assert fields(pb.GenerateStreamChunk) == {"token_ids": (1, 13), "prompt_tokens": (2, 13),
                                              "completion_tokens": (3, 13), "cached_tokens": (4, 13)}
    assert fields(pb.GenerateComplete) == {"output_ids": (1, 13), "finish_reason": (2, 9), "prompt_tokens": (3, 13),
                                           "completion_tokens": (4, 13), "cached_tokens": (5, 13)}
    assert fields(pb.EmbedResponse) == {"embedding": (1, 2), "prompt_tokens": (2, 13), "embedding_dim": (3, 13)}
    assert fields(pb.SamplingParams)["max_tokens"] == (8, 13) and len(fields(pb.SamplingParams)) == 27
    proto = (Path(__file__).parents[2] / "proto" / "vllm" / "vllm_engine.proto").read_text()
    assert "reserved 1;" in proto


@pytest.mark.parametrize(("message", "path", "prompt", "ids", "stream", "api"), [
    (pb.GenerateRequest(text="Hello world"), GENERATE_PATH, "Hello world", None, False, Api.COMPLETIONS),
    (pb.GenerateRequest(tokenized=pb.TokenizedInput(original_text="Tokenized hello", input_ids=[11, 12, 13])),
     GENERATE_PATH, "", [11, 12, 13], False, Api.COMPLETIONS),
    (pb.GenerateRequest(tokenized=pb.TokenizedInput(original_text="Describe image", input_ids=[101, 102, 103]),
                        mm_inputs=pb.MultimodalInputs(mm_placeholders=[pb.PlaceholderRange(offset=1, length=2)],
                                                      mm_hashes=["hash-a", "hash-b"])),
     GENERATE_PATH, "", [101, 102, 103], False, Api.COMPLETIONS),
    (pb.GenerateRequest(text="Hello world", stream=True), GENERATE_PATH, "Hello world", None, True, Api.COMPLETIONS),
    (pb.EmbedRequest(tokenized=pb.TokenizedInput(original_text="Embed this", input_ids=[4, 5, 6])), EMBED_PATH, "",
     [4, 5, 6], False, Api.EMBEDDINGS),
    (pb.GenerateRequest(tokenized=pb.TokenizedInput()), GENERATE_PATH, "", [], False, Api.COMPLETIONS),
])
def test_parse_request(message: Message, path: str, prompt: str, ids: list[int] | None, stream: bool,
                       api: Api) -> None:
    request = parse(message, path)
    assert (request.prompt, request.token_ids, request.stream, request.api, request.model) == (
        prompt, ids, stream, api, "")
    assert request.prompt_bytes == len(prompt) and not request.rewritable and not request.skip_response
    assert request.response is VLLM_GRPC_RESPONSES


def test_another_method_is_forwarded_without_its_response_but_still_needs_a_frame() -> None:
    request = parse(pb.GenerateRequest(text="hello"), "/unsupported/path")
    assert request.skip_response and request.token_ids is None and request.prompt == ""
    assert parse(pb.GenerateRequest(text="hello"), GENERATE_PATH + "?q").skip_response  # the :path as sent
    with pytest.raises(RequestError, match="invalid or unsupported gRPC payload"):
        parse(b"\x00\x00\x00", "/unsupported/path")


@pytest.mark.parametrize(("body", "path", "message"), [
    (b"\x00\x00\x00", GENERATE_PATH, "invalid or unsupported gRPC payload"),
    (b"\x01\x00\x00\x00\x00", GENERATE_PATH, "invalid or unsupported gRPC payload"),
    (b"\x00\x00\x00\x00\x05ab", GENERATE_PATH, "invalid or unsupported gRPC payload"),
    (frame(b""), GENERATE_PATH, "not supported request inputType"),
    (frame(b""), EMBED_PATH, "missing tokenized input in EmbedRequest"),
    (frame(b"\xff"), GENERATE_PATH, "unmarshaling GenerateRequest"),
    (frame(b"\xff"), EMBED_PATH, "unmarshaling EmbedRequest"),
    (frame(b"\x1a\x01\xff"), GENERATE_PATH, "unmarshaling GenerateRequest"),  # a text not UTF-8
    (frame(pb.GenerateRequest(text="x", sampling_params=pb.SamplingParams(stop=["a"])).SerializeToString()
           .replace(b"\x52\x01a", b"\x52\x01\xff")), GENERATE_PATH, "unmarshaling GenerateRequest"),
])
def test_parse_request_errors(body: bytes, path: str, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(body, path)
    assert caught.value.status == 400 and message in caught.value.message


@pytest.mark.parametrize(("message", "cap"), [
    (pb.GenerateRequest(text="hello", sampling_params=pb.SamplingParams(max_tokens=256)), 256),
    (pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=[1, 2, 3]),
                        sampling_params=pb.SamplingParams(max_tokens=128)), 128),
    (pb.GenerateRequest(text="hello"), None),
    (pb.GenerateRequest(text="hello", sampling_params=pb.SamplingParams()), None),
    (pb.GenerateRequest(text="hello", sampling_params=pb.SamplingParams(max_tokens=0)), 0),
])
def test_max_output_tokens(message: Message, cap: int | None) -> None:
    assert parse(message).output_cap == cap


def _usage(*messages: Message | bytes) -> Usage:
    reader = VLLM_GRPC_RESPONSES.reader(sse=False, rewrite=None, max_bytes=10_000)
    for message in messages:
        reader.feed(message if isinstance(message, bytes) else frame(message.SerializeToString()))
    reader.finish()
    return reader.usage


@pytest.mark.parametrize(("message", "usage"), [
    (pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[1, 2, 3], prompt_tokens=10, completion_tokens=5,
                                                      cached_tokens=2)), Usage(10, 5, 2)),
    (pb.GenerateResponse(complete=pb.GenerateComplete(finish_reason="stop", prompt_tokens=20, completion_tokens=15,
                                                      cached_tokens=5)), Usage(20, 15, 5)),
    (pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[4])), Usage()),
    (pb.GenerateResponse(), Usage()),
    (pb.EmbedResponse(prompt_tokens=10, embedding=[1.0, 2.0], embedding_dim=2), Usage(10, None, None)),
    (pb.GenerateResponse(complete=pb.GenerateComplete(prompt_tokens=20, completion_tokens=15)), Usage(20, 15, 0)),
    (b"\x00\x00\x00", Usage()),
    (frame(b"\xff"), Usage()),
])
def test_response_usage(message: Message | bytes, usage: Usage) -> None:
    assert _usage(message) == usage


def test_a_streamed_response_merges_its_chunks() -> None:
    """Every message counts (the reference reads the first of each chunk); a 0 is no count."""
    chunks = [pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[1], prompt_tokens=7, completion_tokens=1)),
              pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[2], completion_tokens=2)),
              pb.GenerateResponse(complete=pb.GenerateComplete(prompt_tokens=7, completion_tokens=3, cached_tokens=4))]
    assert _usage(*chunks) == Usage(7, 3, 4) and not VLLM_GRPC_RESPONSES.rewrites


def test_claims() -> None:
    assert VLLM_GRPC.paths == ("vllm.grpc.engine.VllmEngine/Generate", "vllm.grpc.engine.VllmEngine/Embed")


# -- through the picker -----------------------------------------------------------------------------


def test_a_tokenized_generate_is_routed_by_its_tokens_and_its_usage_read() -> None:
    picker = picker_with(parsers_config("vllmgrpc-parser"))
    ids = list(range(500, 564))
    body = frame(pb.GenerateRequest(tokenized=pb.TokenizedInput(input_ids=ids), stream=True,
                                    sampling_params=pb.SamplingParams(max_tokens=9)).SerializeToString())
    stream, replies = send(picker, GENERATE_PATH, body, [("content-type", "application/grpc")])
    assert lb_metadata(replies[0]) and forwarded_body(replies) == body
    block, most = picker.scheduler.prefix_geometry()
    hashes = block_hashes("", TokenizedPrompt((pack_ids(ids),)), block, most)
    assert stream.route is not None and stream.route.hashes == hashes and len(hashes) == 1
    assert stream.report.client_model == "" and stream.report.target_model == ""
    stream.on_message(response_headers("application/grpc"))
    reply = b"".join(frame(m.SerializeToString()) for m in (
        pb.GenerateResponse(chunk=pb.GenerateStreamChunk(token_ids=[1], prompt_tokens=64, completion_tokens=1)),
        pb.GenerateResponse(complete=pb.GenerateComplete(prompt_tokens=64, completion_tokens=9, cached_tokens=0))))
    sent = stream.on_message(response_body(reply[:11], end=False)) + stream.on_message(response_body(reply[11:]))
    assert b"".join(r.response_body.response.body_mutation.streamed_response.body for r in sent) == reply
    assert stream.report.usage == Usage(64, 9, 0)


def test_grpc_errors_and_other_methods_through_the_picker() -> None:
    picker = picker_with(parsers_config("vllmgrpc-parser"))
    _, replies = send(picker, GENERATE_PATH, b"\x00\x00")
    assert status(replies) == 400
    stream, replies = send(picker, EMBED_PATH, frame(pb.EmbedRequest(tokenized=pb.TokenizedInput(
        input_ids=[1, 2])).SerializeToString()))
    assert lb_metadata(replies[0]) and not stream.finished
    _, replies = send(picker, "/vllm.grpc.engine.VllmEngine/HealthCheck", frame(b""))
    assert status(replies) == 400  # no listed parser claims it (and there is no fallback)


# -- fuzzing ---------------------------------------------------------------------------------------------


@pytest.mark.fuzz
@given(st.binary(max_size=200), st.sampled_from([GENERATE_PATH, EMBED_PATH, "/other"]), st.booleans())
def test_fuzz_arbitrary_bytes(data: bytes, path: str, framed: bool) -> None:
    try:
        request = parse(frame(data) if framed else data, path)
    except RequestError as exc:
        assert exc.status == 400
    else:
        assert request.token_ids is None or all(0 <= i < 2**32 for i in request.token_ids)


@pytest.mark.fuzz
@given(st.integers(0, 200), st.binary(min_size=1, max_size=4), st.sampled_from([GENERATE_PATH, EMBED_PATH]))
def test_fuzz_mutated_messages(at: int, junk: bytes, path: str) -> None:
    valid = pb.GenerateRequest(request_id="r", tokenized=pb.TokenizedInput(original_text="t", input_ids=[1, 300]),
                               sampling_params=pb.SamplingParams(max_tokens=5, stop=["x"], logit_bias={1: 0.5}),
                               mm_inputs=pb.MultimodalInputs(mm_hashes=["h"], flat_keys={"a": "b"}))
    payload = bytearray(valid.SerializeToString())
    payload[at % len(payload): at % len(payload) + len(junk)] = junk
    try:
        parse(frame(bytes(payload)), path)
    except RequestError as exc:
        assert exc.status == 400


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=30), max_size=6))
def test_fuzz_response_bytes(chunks: list[bytes]) -> None:
    reader = VLLM_GRPC_RESPONSES.reader(sse=False, rewrite=None, max_bytes=100)
    for chunk in chunks:
        reader.feed(chunk)
    reader.finish()
    assert all(n is None or n >= 0 for n in (reader.usage.prompt_tokens, reader.usage.completion_tokens))
