"""The openai parser reads a body into the request type its path names, as llm-d-router's does
(parsers/openai ``extractRequestBody``): its test table, the Go types' edges, any JSON, and the
400 through a real Envoy."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from conftest import Ports
from hypothesis import given
from hypothesis import strategies as st
from picker_fakes import FakeModelServer, Gateway

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.parsers.openai import OPENAI
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.request import Api, InferenceRequest, api_for_path, request_type
from evergreen_trio.picker.scheduler import PoolSnapshot

HELLO = [{"role": "user", "content": "hello"}]
CHAT = "/v1/chat/completions"


def parse(path: str, body: dict[str, Any]) -> InferenceRequest:
    return OPENAI.parse(path, {}, json.dumps(body).encode())


def refusal(path: str, body: dict[str, Any]) -> str:
    with pytest.raises(RequestError) as refused:
        parse(path, body)
    assert refused.value.status == 400
    return refused.value.message


# openai_test.go's TestParseRequest cases that fail (all but "nil body", a nil body being no JSON)
@pytest.mark.parametrize(("path", "body", "says"), [
    ("/v1/completions", {"prompt": []}, "invalid completions request: must have prompt field"),
    ("/v1/completions", {"prompt": 123}, "invalid completions request: must have prompt field"),
    (CHAT, {"messages": "invalid"}, "invalid chat completions request: must have valid messages field"),
    ("/v1/completions", {}, "invalid completions request: must have prompt field"),
    (CHAT, {"messages": []}, "invalid chat completions request: must have valid messages field"),
    (CHAT, {"messages": [{"role": 123, "content": "hello"}]}, "must have valid messages field"),
    (CHAT, {"messages": [{"role": "user", "content": 123}]}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "tools": "invalid"}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "documents": "invalid"}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "chat_template": 123}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "return_assistant_tokens_mask": "invalid"}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "continue_final_message": "invalid"}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "add_generation_prompt": "invalid"}, "must have valid messages field"),
    (CHAT, {"messages": HELLO, "chat_template_kwargs": "invalid"}, "must have valid messages field"),
    ("/v1/responses", {}, "invalid responses request: must have input field"),
    ("/v1/embeddings", {}, "invalid embeddings request: must have input field"),
    ("/v1/embeddings", {"input": None}, "invalid embeddings request: must have input field"),
    ("/v1/images/generations", {"size": "512x512"}, "invalid images generations request: must have prompt field"),
    ("/v1/images/generations", {"prompt": ""}, "invalid images generations request: must have prompt field"),
])
def test_the_references_refused_bodies(path: str, body: dict[str, Any], says: str) -> None:
    assert says in refusal(path, {"model": "test", **body})


# ... and the cases it takes
@pytest.mark.parametrize(("path", "body", "prompt"), [
    ("/v1/completions", {"prompt": "hello"}, "hello"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "ab"),
    ("/v1/completions", {"prompt": [""]}, ""),
    ("/v1/completions", {"prompt": [1, 2, 3.0, 4294967295]}, ""),
    (CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}, *HELLO]},
     "assistantuserhello"),
    ("/v1/chat/completions/render", {"messages": HELLO}, "userhello"),
    ("/v1/chat/completions/render/", {"messages": HELLO}, "userhello"),
    ("/v1/completions/render", {"prompt": "p"}, "p"),
    (CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}},
        {"type": "input_audio", "input_audio": {"data": "x", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "v"}}]}]}, None),
    (CHAT, {"messages": HELLO, "tools": [{"type": "function"}], "documents": [{}], "chat_template": "t",
            "return_assistant_tokens_mask": True, "continue_final_message": False, "add_generation_prompt": True,
            "chat_template_kwargs": {"k": 1}, "cache_salt": "s"}, "userhello"),
    ("/v1/responses", {"input": "hi", "instructions": 5, "tools": "any"}, "hi"),
    ("/v1/responses", {"input": ""}, ""),
    ("/v1/conversations", {"items": [{"type": "message", "role": "user", "content": [1]}], "metadata": {}}, None),
    ("/v1/embeddings", {"input": ["a"]}, "a"),
    ("/v1/embeddings", {"input": [7]}, ""),
    ("/openai/v1/images/generations", {"prompt": "a dragon", "n": 2, "num_inference_steps": 30, "seed": 1.5}, None),
])
def test_the_references_taken_bodies(path: str, body: dict[str, Any], prompt: str | None) -> None:
    request = parse(path, {"model": "test", **body})
    assert request.model == "test"
    if prompt is not None:
        assert request.prompt == prompt


@pytest.mark.parametrize(("path", "api"), [
    ("/v1/chat/completions/render", Api.CHAT), ("/v1/completions/render", Api.COMPLETIONS),
    ("/v1/projects/p/locations/l/endpoints/e/chat/completions", Api.CHAT), (" /v1/embeddings/ ", Api.EMBEDDINGS),
    ("/v1/conversations", Api.OTHER), ("/v1/images/generations", Api.OTHER), ("/v1/models", Api.COMPLETIONS),
])
def test_paths_are_typed_as_the_references_determine_api_type(path: str, api: Api) -> None:
    assert api_for_path(path) is api


def test_the_type_is_the_first_suffix_in_the_references_order() -> None:
    assert request_type("/v1/responses/conversations")[0] == "conversations"
    assert request_type("/v1/chat/completions")[0] == "chat/completions"
    assert request_type("/v1/chat/completions/render")[0] == "chat/completions"


@pytest.mark.parametrize("prompt", [
    [1, "a"], ["a", 1], [1.5], [-1], [2**32], [True], [None], [[1, 2]], [{}], None, {"text": "x"}, True,
])
@pytest.mark.parametrize(("path", "field"), [("/v1/completions", "prompt"), ("/v1/embeddings", "input")])
def test_a_prompt_is_a_string_or_an_array_of_strings_or_of_uint32s(prompt: object, path: str, field: str) -> None:
    message = refusal(path, {"model": "m", field: prompt})
    assert "must have" in message


@pytest.mark.parametrize("value", [1.0, 1e2, 2**63, "2", True])
@pytest.mark.parametrize("field", ["n", "num_inference_steps"])
def test_an_images_count_is_an_int64_literal(value: object, field: str) -> None:
    message = refusal("/v1/images/generations", {"model": "m", "prompt": "p", field: value})
    assert field in message and "int64" in message


@pytest.mark.parametrize("salt", [7, True, ["a"], {"k": "v"}, 1.5])
@pytest.mark.parametrize(("path", "body"), [
    (CHAT, {"messages": HELLO}), ("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"}),
    ("/v1/conversations", {"items": [{}]}), ("/v1/embeddings", {"input": "x"}),
])
def test_a_non_string_cache_salt_is_a_400_naming_it(salt: object, path: str, body: dict[str, Any]) -> None:
    assert "cache_salt" in refusal(path, {"model": "m", **body, "cache_salt": salt})


def test_images_have_no_cache_salt_and_null_is_no_salt() -> None:
    assert parse("/v1/images/generations", {"model": "m", "prompt": "x", "cache_salt": 7}).model == "m"
    assert parse(CHAT, {"model": "m", "messages": HELLO, "cache_salt": None}).model == "m"


def test_member_names_match_as_gos_decoder_matches_them() -> None:
    """Case-insensitively, with the Kelvin sign folding into K: a mistyped field refuses the body
    under any spelling, and a chat's messages may be spelled ``Messages``."""
    assert parse(CHAT, {"model": "m", "Messages": HELLO}).model == "m"
    assert "cache_salt" in refusal(CHAT, {"model": "m", "messages": HELLO, "CACHE_SALT": 1})
    assert "chat_template_kwargs" in refusal(CHAT, {"model": "m", "messages": HELLO, "chat_template_\u212awargs": 1})


def test_the_type_is_checked_and_a_missing_model_left_to_the_picker() -> None:
    """The reference refuses the body for its type; a body without a model is parsed (its director
    answers 400 unless a rewrite header names the target: ``test_a_missing_model_needs_a_rewrite``)."""
    assert "messages" in refusal(CHAT, {})
    assert parse(CHAT, {"messages": HELLO}).model == ""


def test_a_missing_model_needs_a_rewrite_header_to_route() -> None:
    config = parse_config("pool: {name: t, endpoints: ['10.0.0.1:8000']}")  # no models: any rewrite target
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    snapshot.update("10.0.0.1:8000", EndpointMetrics())
    picker = Picker(config, snapshot)
    body = json.dumps({"messages": HELLO}).encode()
    with pytest.raises(RequestError, match="model not found in request body") as refused:
        picker.route(CHAT, {}, body, None)
    assert refused.value.status == 400
    route = picker.route(CHAT, {"x-gateway-model-name-rewrite": "chosen"}, body, None)
    assert route.body is not None and json.loads(route.body) == {"messages": HELLO, "model": "chosen"}


@pytest.mark.parametrize("depth", [60, 5000])
def test_deep_content_is_one_400_or_413(depth: int) -> None:
    blocks = b'[{"type":"text","content":' * depth + b'"x"' + b"}]" * depth
    body = b'{"model":"m","messages":[{"role":"user","content":' + blocks + b"}]}"
    try:
        request = OPENAI.parse(CHAT, {}, body)
    except RequestError as refused:
        assert refused.status in (400, 413)
    else:
        assert request.prompt.endswith("x")


@pytest.mark.parametrize("constant", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("prompt", ["hi", "x" * 10_000])  # msgspec's path, then the member walk's
def test_nan_and_infinities_are_a_400_as_gos_decoder_refuses_them(constant: float, prompt: str) -> None:
    # Python's json.dumps writes a float NaN as NaN (a client's bug): not JSON, and Go refuses it.
    body = json.dumps({"model": "m", "prompt": prompt, "temperature": constant}).encode()
    assert b"NaN" in body or b"Infinity" in body
    with pytest.raises(RequestError) as refused:
        OPENAI.parse("/v1/completions", {}, body)
    assert refused.value.status == 400
    assert OPENAI.parse("/v1/completions", {}, body.replace(b"-Infinity", b"1").replace(b"Infinity", b"1")
                        .replace(b"NaN", b"1")).prompt == prompt


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(max_size=4), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=12)
_FIELDS = st.sampled_from(["messages", "prompt", "input", "items", "role", "content", "tools", "cache_salt", "n",
                           "text", "image_url", "url", "tool_calls", "metadata", "chat_template_kwargs"])


@given(path=st.sampled_from([CHAT, "/v1/completions", "/v1/responses", "/v1/conversations", "/v1/embeddings",
                             "/v1/images/generations", "/v1/chat/completions/render"]),
       body=st.dictionaries(_FIELDS, _JSON | st.lists(st.dictionaries(_FIELDS, _JSON, max_size=4), max_size=3),
                            max_size=4))
def test_any_json_object_is_taken_or_one_400(path: str, body: dict[str, Any]) -> None:
    try:
        parse(path, {**body, "model": "m"})
    except RequestError as exc:
        assert exc.status == 400 and "\n" not in exc.message
        return
    field = {"chat/completions": "messages", "completions": "prompt", "responses": "input",
             "conversations": "items", "embeddings": "input", "images/generations": "prompt"}[request_type(path)[0]]
    assert body.get(field) is not None  # a taken body holds what its type requires


@pytest.mark.envoy
async def test_a_chat_without_messages_is_a_400_through_envoy(
    nursery: trio.Nursery, ports: Ports, backends: list[FakeModelServer], duplex_gateway: Gateway
) -> None:
    from test_envoy_e2e import config_text, post, start_picker

    await start_picker(nursery, ports, config_text(ports.pool))
    refused = await post(duplex_gateway, CHAT, {"model": "food-review", "messages": []})
    assert refused.status_code == 400, refused.text
    assert "must have valid messages field" in refused.json()["error"]["message"]
    async with httpx.AsyncClient(timeout=30) as client:
        salted = await client.post(duplex_gateway.url(CHAT), content=json.dumps(
            {"model": "food-review", "messages": HELLO, "cache_salt": 7}))
        not_json = await client.post(duplex_gateway.url(CHAT), content=json.dumps(
            {"model": "food-review", "messages": HELLO, "temperature": float("nan")}))
    assert salted.status_code == 400 and "cache_salt" in salted.json()["error"]["message"]
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert not any(s.requests for s in backends)
    taken = await post(duplex_gateway, CHAT, {"model": "food-review", "messages": HELLO})
    assert taken.status_code == 200, taken.text
