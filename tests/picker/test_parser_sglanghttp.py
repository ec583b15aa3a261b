"""``sglanghttp-parser``, SGLang's native ``/generate``: llm-d-router's sglanghttp_test.go ported,
a request through the picker, and fuzzing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.registry import request_path
from evergreen_trio.picker.parsers.sglanghttp import SGLANG_HTTP, SGLANG_RESPONSES
from evergreen_trio.picker.request import InferenceRequest
from evergreen_trio.picker.usage import Usage
from tests.picker.test_parsers import forwarded_body, parsers_config, picker_with, send
from tests.picker.test_processor import lb_metadata, response_body, response_headers, status

SGLANG = {":path": "/generate"}


def parse(body: object, headers: Mapping[str, str] = SGLANG) -> InferenceRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return SGLANG_HTTP.parse(request_path(headers), headers, raw)


@pytest.mark.parametrize(("body", "ids", "stream", "cap"), [
    ({"input_ids": [1, 2, 3]}, [1, 2, 3], False, None),
    ({"input_ids": [10, 20], "extra_key": "salt-abc"}, [10, 20], False, None),
    ({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 256}}, [1, 2, 3], False, 256),
    ({"input_ids": [1, 2, 3], "stream": True}, [1, 2, 3], True, None),
    ({"text": "ignored by the parser", "input_ids": [7, 8]}, [7, 8], False, None),
    ({"input_ids": [7, None], "sampling_params": {"MAX_NEW_TOKENS": 5}}, [7, 0], False, 5),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, [1], False, None),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2.0}}, [1], False, None),
    ({"input_ids": [1], "sampling_params": ["x"]}, [1], False, None),
])
def test_sglang_generate(body: dict[str, Any], ids: list[int], stream: bool, cap: int | None) -> None:
    raw = json.dumps(body).encode()
    request = parse(raw, SGLANG)
    assert (request.token_ids, request.stream, request.output_cap, request.model) == (ids, stream, cap, "")
    assert not request.rewritable and request.response is SGLANG_RESPONSES
    assert parse(raw, {"x-original-path": "/generate"}).token_ids == ids


def test_sglang_has_no_map_decode_so_a_number_beyond_float64_passes() -> None:
    assert parse(b'{"input_ids":[1],"x":1e999}', SGLANG).token_ids == [1]


@pytest.mark.parametrize(("body", "message"), [
    (b'{"input_ids":[1,2],"extra_key":["tenant-a","tenant-b"]}', "extra_key must be a string"),
    (b'{"sampling_params":{"temperature":0.8}}', "input_ids must be provided"),
    (b'{"input_ids":[]}', "input_ids cannot be empty"),
    (b'{"input_ids":[1,2,-1]}', "input_ids must be an array of uint32 integers"),
    (b'{"input_ids":[1,2.5]}', "input_ids must be an array of uint32 integers"),
    (b'{"input_ids":[4294967296]}', "input_ids must be an array of uint32 integers"),
    (b'{"input_embeds":[[0.1,0.2]]}', "input_ids must be provided"),
    (b'{"text":"hello"}', "input_ids must be provided"),
    (b'{"input_ids":[[1,2],[3,4]]}', "input_ids must be an array of uint32 integers"),
    (b'{"input_ids":null}', "input_ids must be provided"),
    (b'{"input_ids":[1],"stream":"yes"}', "invalid generate request"),
])
def test_sglang_errors(body: bytes, message: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(body, SGLANG)
    assert caught.value.status == 400 and message in caught.value.message


@pytest.mark.parametrize("path", ["/v1/completions", "/regenerate", "/health_generate", "/vertex_generate",
                                  "/inference/v1/generate", "/prefix/generate"])
def test_sglang_reads_only_slash_generate(path: str) -> None:
    with pytest.raises(RequestError, match="unsupported path"):
        parse(b'{"input_ids":[1]}', {":path": path})
    assert parse(b'{"input_ids":[1]}', {":path": " /generate/ "}).token_ids == [1]


def _sglang_usage(body: bytes, sse: bool) -> Usage:
    reader = SGLANG_RESPONSES.reader(sse=sse, rewrite=None, max_bytes=10_000)
    reader.feed(body)
    reader.finish()
    return reader.usage


@pytest.mark.parametrize(("body", "sse", "usage"), [
    (b'{"text":"hello","meta_info":{"prompt_tokens":10,"completion_tokens":5}}', False, Usage(10, 5, None)),
    (b'{"text":"hi","output_ids":[1,2],"meta_info":{"id":"req-1","prompt_tokens":8,"completion_tokens":3,'
     b'"cached_tokens":2}}', False, Usage(8, 3, 2)),
    (b'data: {"text":"he","meta_info":{"prompt_tokens":10,"completion_tokens":2}}\n\n'
     b'data: {"text":"hello","meta_info":{"prompt_tokens":10,"completion_tokens":5,"finish_reason":{"type":"stop"}}}'
     b'\n\ndata: [DONE]\n\n', True, Usage(10, 5, None)),
    (b'data: {"text":"he","meta_info":{"prompt_tokens":10,"completion_tokens":2}}\n\n', True, Usage()),
    (b'event: generation\ndata: {"text":"hello","meta_info":{"prompt_tokens":10,"completion_tokens":5,'
     b'"finish_reason":{"type":"stop"}}}\n\n', True, Usage(10, 5, None)),
    (b"data: [DONE]\n\n", True, Usage()),
    (b"", False, Usage()),
    (b'{"text":"","meta_info":{"prompt_tokens":0,"completion_tokens":0}}', False, Usage(0, 0, None)),
    (b'{"meta_info":', False, Usage()),
    (b'{"meta_info":{"prompt_tokens":"10"}}', False, Usage()),
    (b'[{"meta_info":{"prompt_tokens":1}}]', False, Usage()),
])
def test_sglang_response_usage(body: bytes, sse: bool, usage: Usage) -> None:
    assert _sglang_usage(body, sse) == usage


def test_sglang_claims() -> None:
    assert SGLANG_HTTP.paths == ("generate",)


def test_sglang_generate_through_the_picker_forwards_the_body_as_received() -> None:
    picker = picker_with(parsers_config("sglanghttp-parser", "vllmhttp-parser"))
    body = b'{"input_ids": [5, 6, 7], "model": "food-review"}'
    stream, replies = send(picker, "/generate", body)
    assert lb_metadata(replies[0]) and forwarded_body(replies) == body
    assert stream.report.client_model == "" and stream.route is not None and stream.route.target_model is None
    stream.on_message(response_headers())
    stream.on_message(response_body(b'{"text":"x","meta_info":{"prompt_tokens":3,"completion_tokens":1}}'))
    assert stream.report.usage == Usage(3, 1, None)
    _, replies = send(picker, "/prefix/generate", body)  # sglang claims it, then refuses it
    assert status(replies) == 400
    _, replies = send(picker, "/inference/v1/generate", b'{"model":"plain","token_ids":[1]}')  # the longer claim
    assert lb_metadata(replies[0])


_value = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**33) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["max_new_tokens", "x"]), inner,
                                                                max_size=3),
    max_leaves=8)


@pytest.mark.fuzz
@given(st.binary(max_size=300))
def test_fuzz_arbitrary_bytes(body: bytes) -> None:
    try:
        parse(body)
    except RequestError as exc:
        assert exc.status == 400


@pytest.mark.fuzz
@given(st.sampled_from(["input_ids", "sampling_params", "extra_key", "stream", "model"]), _value)
def test_fuzz_mutated_bodies(field: str, value: object) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, field: value}
    try:
        request = parse(body)
    except RequestError as exc:
        assert exc.status == 400
    else:
        assert request.token_ids and all(0 <= i < 2**32 for i in request.token_ids)
        assert request.output_cap is None or request.output_cap >= 0


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=40) | st.just(b"data: "), max_size=5), st.booleans())
def test_fuzz_response_usage(chunks: list[bytes], sse: bool) -> None:
    reader = SGLANG_RESPONSES.reader(sse=sse, rewrite=None, max_bytes=200)
    try:
        for chunk in chunks:
            reader.feed(chunk)
        reader.finish()
    except RequestError as exc:
        assert exc.status == 502
    assert isinstance(reader.usage, Usage)
