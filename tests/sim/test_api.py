"""Request parsing and response shapes, sans-IO; the body parser is fuzzed."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.sim import api
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.errors import SimConfigError, SimRequestError
from evergreen_trio.sim.model import Usage

CONFIG = SimConfig(lora_adapters=("food-review",))


def parse(body: object, path: str = api.COMPLETIONS) -> api.ParsedRequest:
    return api.parse_request(path, json.dumps(body).encode(), CONFIG)


def test_completion_defaults() -> None:
    request = parse({"model": "sim-model", "prompt": "hi"})
    assert request == api.ParsedRequest(False, "sim-model", "hi", CONFIG.default_max_tokens, False, False, None)


def test_chat_with_adapter_and_usage_option() -> None:
    request = parse(
        {"model": "food-review", "messages": [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
         "max_completion_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
        api.CHAT_COMPLETIONS,
    )
    assert request.lora == "food-review" and request.chat and request.stream and request.include_usage
    assert request.prompt == "system: be brief\nuser: hi\nassistant: "
    assert request.max_tokens == 3


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": "x"}, 400, "'model' must be a string"),
        ({"model": "nope", "prompt": "x"}, 404, "`nope` does not exist"),
        ({"model": "sim-model"}, 400, "'prompt' must be a string"),
        ({"model": "sim-model", "prompt": "x", "max_tokens": 0}, 400, "'max_tokens' must be an integer >= 1"),
        ({"model": "sim-model", "prompt": "x", "max_tokens": True}, 400, "'max_tokens' must be an integer"),
        ({"model": "sim-model", "prompt": "x", "n": 2}, 400, "only 'n': 1"),
        ({"model": "sim-model", "prompt": "x", "stream": "yes"}, 400, "'stream' must be a boolean"),
        ({"model": "sim-model", "prompt": "x", "stream_options": []}, 400, "'stream_options' must be an object"),
        ([1, 2], 400, "must be a JSON object, got list"),
    ],
)
def test_bad_bodies_name_the_problem(body: object, status: int, message: str) -> None:
    with pytest.raises(SimRequestError, match=message) as error:
        parse(body)
    assert error.value.status == status


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\].role"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "image"}]}], r"messages\[0\].content\[0\]"),
    ],
)
def test_bad_chat_messages(messages: object, message: str) -> None:
    with pytest.raises(SimRequestError, match=message):
        parse({"model": "sim-model", "messages": messages}, api.CHAT_COMPLETIONS)


def test_not_json_is_a_clear_400() -> None:
    for body in (b"{bad", b"\xff\xfe", b"", b"[" * 100_000):
        with pytest.raises(SimRequestError, match="request body must be a JSON object") as error:
            api.parse_request(api.COMPLETIONS, body, CONFIG)
        assert error.value.status == 400


@pytest.mark.fuzz
@given(st.binary(max_size=2048))
def test_fuzz_arbitrary_bytes_give_a_typed_error(body: bytes) -> None:
    try:
        api.parse_request(api.CHAT_COMPLETIONS, body, CONFIG)
    except SimRequestError as error:
        assert error.status in (400, 404)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["sim-model", "food-review", "other"]) | json_values,
        "prompt": st.text(max_size=30) | json_values,
        "messages": st.lists(st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values})),
        "max_tokens": json_values, "max_completion_tokens": json_values, "n": json_values,
        "stream": json_values, "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}),
    },
)


@pytest.mark.fuzz
@given(request_like, st.sampled_from([api.COMPLETIONS, api.CHAT_COMPLETIONS]))
def test_fuzz_json_shaped_bodies_parse_or_give_a_typed_error(body: dict[str, object], path: str) -> None:
    try:
        request = api.parse_request(path, json.dumps(body).encode(), CONFIG)
    except SimRequestError as error:
        assert error.status in (400, 404) and error.message
    else:
        assert request.max_tokens >= 1 and isinstance(request.prompt, str)


def test_stream_chunks_and_usage_shapes() -> None:
    request = parse({"model": "sim-model", "messages": [{"role": "user", "content": "x"}], "stream": True,
                     "stream_options": {"include_usage": True}}, api.CHAT_COMPLETIONS)
    first = api.stream_chunk(request, "id", 1, "a", first=True, last=False)
    last = api.stream_chunk(request, "id", 1, "b", first=False, last=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"] is None
    usage = api.usage_chunk(request, "id", 1, Usage(5, 2, 0))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7
    assert api.sse("[DONE]") == b"data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        ({"max_batch": 0}, "max_batch must be an integer >= 1"),
        ({"kv_blocks": 1.5}, "kv_blocks must be an integer"),
        ({"decode_ms_per_token": -1}, "decode_ms_per_token must be a number >= 0"),
        ({"time_scale": 0}, "time_scale must be a number > 0"),
        ({"lora_adapters": ("sim-model",)}, "distinct"),
        ({"lora_adapters": ("a",), "max_loras": 0}, "max_loras must be >= 1"),
        ({"default_max_tokens": 9000}, "default_max_tokens must be < max_model_len"),
    ],
)
def test_bad_config_names_the_knob(knobs: dict[str, object], message: str) -> None:
    with pytest.raises(SimConfigError, match=message):
        SimConfig(**knobs)  # type: ignore[arg-type]
