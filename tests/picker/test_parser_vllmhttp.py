"""``vllmhttp-parser``, vLLM's native ``/inference/v1/generate``: llm-d-router's vllmhttp_test.go
ported, a token prompt through the picker, and fuzzing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.registry import request_path
from evergreen_trio.picker.parsers.vllmhttp import VLLM_HTTP
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.request import InferenceRequest
from evergreen_trio.picker.token_estimate import TokenizedPrompt, pack_ids
from evergreen_trio.picker.usage import OPENAI_RESPONSES, Usage
from tests.picker.test_parsers import forwarded_body, parsers_config, picker_with, send
from tests.picker.test_processor import lb_metadata, response_body, response_headers, status

VLLM = {":path": "/inference/v1/generate"}


def parse(body: object, headers: Mapping[str, str] = VLLM) -> InferenceRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return VLLM_HTTP.parse(request_path(headers), headers, raw)


@pytest.mark.parametrize(("body", "ids", "stream", "cap"), [
    ({"token_ids": [1, 2, 3]}, [1, 2, 3], False, None),
    ({"token_ids": [10, 20, 30], "cache_salt": "abc123"}, [10, 20, 30], False, None),
    ({"token_ids": [1, 2, 3], "sampling_params": {"temperature": 0.8, "max_tokens": 128}, "stream": True},
     [1, 2, 3], True, 128),
    ({"token_ids": [151644, 872, 198, 3838], "features": {
        "mm_hashes": {"image": ["abc123hash", "def456hash"]},
        "mm_placeholders": {"image": [{"offset": 1, "length": 3}, {"offset": 4, "length": 3}]}}},
     [151644, 872, 198, 3838], False, None),
    ({"token_ids": [1.0, 2e0, None, 4294967295]}, [1, 2, 0, 4294967295], False, None),  # float64 ids; null is 0
])
def test_vllm_generate(body: dict[str, Any], ids: list[int], stream: bool, cap: int | None) -> None:
    request = parse(body, VLLM)
    assert (request.token_ids, request.stream, request.output_cap, request.model) == (ids, stream, cap, "")
    assert request.body == body and request.rewritable and request.prompt == ""
    assert request.response is OPENAI_RESPONSES and not request.skip_response
    assert parse(body, {"x-original-path": "/inference/v1/generate"}).token_ids == ids


@pytest.mark.parametrize(("body", "headers", "message"), [
    ({"sampling_params": {"temperature": 0.8}}, VLLM, "must have non-empty token_ids field"),
    ({"token_ids": []}, VLLM, "must have non-empty token_ids field"),
    (b'{"token_ids":[1,2,-1]}', VLLM, "token_ids[2]: invalid value"),
    (b'{"token_ids":[1.5]}', VLLM, "token_ids[0]: invalid value"),
    (b'{"token_ids":[4294967296]}', VLLM, "token_ids[0]: invalid value"),
    (b'{"token_ids":["1"]}', VLLM, "invalid generate request"),
    (b'{"token_ids":[1],"cache_salt":1}', VLLM, "invalid generate request"),
    (b'{"token_ids":[1],"features":{"mm_hashes":{"image":[1]}}}', VLLM, "invalid generate request"),
    (b'{"token_ids":[1],"features":{"mm_placeholders":{"image":[{"offset":1.5}]}}}', VLLM, "invalid generate"),
    (b'{"token_ids":[1],"x":1e999}', VLLM, "not valid JSON"),
    ({"prompt": "hello world"}, {":path": "/v1/completions"}, "unsupported path"),
])
def test_vllm_errors(body: object, headers: Mapping[str, str], message: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse(body, headers)
    assert caught.value.status == 400 and message in caught.value.message


@pytest.mark.parametrize(("sampling", "cap"), [({"max_tokens": 128}, 128), (None, None), ({"temperature": 0.8}, None),
                                               ({"max_tokens": 1.5}, None), ([128], None)])
def test_vllm_max_output_tokens(sampling: object, cap: int | None) -> None:
    body = {"token_ids": [1, 2, 3], **({"sampling_params": sampling} if sampling is not None else {})}
    assert parse(body, VLLM).output_cap == cap


def test_vllm_claims() -> None:
    assert VLLM_HTTP.paths == ("inference/v1/generate",)


def test_vllm_generate_through_the_picker_rewrites_the_model_and_hashes_the_tokens() -> None:
    picker = picker_with(parsers_config("vllmhttp-parser", "openai-parser"))
    ids = list(range(1000, 1200))
    body = json.dumps({"model": "food-review", "token_ids": ids}).encode()
    stream, replies = send(picker, "/inference/v1/generate", body)
    assert lb_metadata(replies[0])
    assert json.loads(forwarded_body(replies)) == {"model": "food-review-v1", "token_ids": ids}
    block, most = picker.scheduler.prefix_geometry()
    hashes = block_hashes("food-review-v1", TokenizedPrompt((pack_ids(ids),)), block, most)
    assert stream.route is not None and stream.route.hashes == hashes and len(hashes) == 4  # 3 x 64 and the tail
    stream.on_message(response_headers())
    stream.on_message(response_body(b'{"model":"food-review-v1","usage":{"prompt_tokens":200,"completion_tokens":5}}'))
    assert stream.report.usage == Usage(200, 5, None)
    # No model and no rewrite header: the reference's director refuses it.
    _, replies = send(picker, "/inference/v1/generate", b'{"token_ids":[1]}')
    assert status(replies) == 400


def test_token_prompts_count_their_tokens() -> None:
    request = parse({"token_ids": list(range(10))}, VLLM)
    assert request.prompt_size(4) == 40 and request.token_ids == list(range(10))


_value = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 2**33) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["max_tokens", "image", "offset", "length", "mm_hashes", "mm_placeholders"]), inner,
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
@given(st.sampled_from(["token_ids", "sampling_params", "features", "cache_salt", "stream", "model"]), _value)
def test_fuzz_mutated_bodies(field: str, value: object) -> None:
    body = {"model": "m", "token_ids": [1, 2], "sampling_params": {"max_tokens": 3},
            "features": {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 0}]}}, field: value}
    try:
        request = parse(body)
    except RequestError as exc:
        assert exc.status == 400
    else:
        assert request.token_ids and all(0 <= i < 2**32 for i in request.token_ids)
        assert request.output_cap is None or request.output_cap >= 0
