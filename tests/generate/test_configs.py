"""GENERATE's ``Action.configs``: mapped onto the OpenAI request (seen by a real HTTP upstream), and
refused with INVALID_ARGUMENT naming the key when a type or range is wrong."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from generate_helpers import run_scripted_upstream
from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.wrappers_pb2 import StringValue
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio import Server, SessionAbortedError, StatusCode, connect, text
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.generate import BackendSettings, GenerateConfigError, GenerateParams, open_backend
from evergreen_trio.generate.params import generate_config, parse_configs


@pytest.fixture
async def scripted(nursery: trio.Nursery) -> AsyncIterator[str]:
    port = await nursery.start(run_scripted_upstream)
    yield f"http://127.0.0.1:{port}"


async def _run(server: Server, action: str, configs: list[AnyProto], *, output: str = "response") -> str:
    answer, error = "", None
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        try:
            async with connect(f"127.0.0.1:{port}") as session:
                inputs = {"prompt" if action == "GENERATE" else "input": text("one two three four five six")}
                call = await session.run(action, inputs, [output], configs=configs)
                answer = await call[output].read_text()
        except SessionAbortedError as aborted:  # raised plainly here, not in the server nursery's group
            error = aborted
        nursery.cancel_scope.cancel()
    if error is not None:
        raise error
    return answer


async def _backend_request(url: str, configs: list[AnyProto], **settings: Any) -> dict[str, Any]:
    server = Server()
    async with open_backend(BackendSettings(url, "echo-request", **settings)) as backend:
        register_builtin_actions(server, generate_handler=backend.generate)
        answer: dict[str, Any] = json.loads(await _run(server, "GENERATE", configs))
        return answer


async def test_configs_map_onto_the_openai_request(scripted: str) -> None:
    configs = [generate_config(max_tokens=7, temperature=0.25), generate_config(top_p=0.5, stop=["\n", "END"], seed=42)]
    sent = await _backend_request(scripted, configs)
    assert sent == {
        "model": "echo-request", "stream": True, "stream_options": {"include_usage": True},
        "max_tokens": 7, "temperature": 0.25, "top_p": 0.5, "stop": ["\n", "END"], "seed": 42,
    }


async def test_without_configs_the_servers_settings_stand(scripted: str) -> None:
    sent = await _backend_request(scripted, [], max_tokens=33)
    assert sent == {"model": "echo-request", "stream": True, "stream_options": {"include_usage": True},
                    "max_tokens": 33}
    assert (await _backend_request(scripted, [generate_config(stop="x")], max_tokens=33))["stop"] == ["x"]


@pytest.mark.parametrize(
    ("configs", "match"),
    [
        ([generate_config(max_tokens=0)], r"config 'max_tokens': expected an integer in 1..1000000, got 0.0"),
        ([generate_config(max_tokens=2.5)], r"config 'max_tokens': expected an integer"),
        ([generate_config(max_tokens="9")], r"config 'max_tokens': expected a finite number, got string"),
        ([generate_config(temperature=2.5)], r"config 'temperature': expected a number in 0 .. 2, got 2.5"),
        ([generate_config(temperature=True)], r"config 'temperature': expected a finite number, got bool"),
        ([generate_config(top_p=0)], r"config 'top_p': expected a number in > 0 .. 1"),
        ([generate_config(stop=["a"] * 5)], r"config 'stop': expected a string or a list of 1..4 strings"),
        ([generate_config(stop=[""])], r"config 'stop': expected non-empty strings"),
        ([generate_config(stop=[3])], r"config 'stop': expected non-empty strings .*got the number 3.0"),
        ([generate_config(seed=2.0**60)], r"config 'seed': expected an integer"),
        ([generate_config(top_k=5)], r"config 'top_k': unknown key"),
        ([generate_config(seed=1), generate_config(seed=2)], r"config 'seed': given twice"),
    ],
)
async def test_bad_configs_abort_naming_the_key(scripted: str, configs: list[AnyProto], match: str) -> None:
    with pytest.raises(SessionAbortedError, match=match) as caught:
        await _backend_request(scripted, configs)
    assert caught.value.code == StatusCode.INVALID_ARGUMENT


async def test_another_config_type_is_refused() -> None:
    other = AnyProto()
    other.Pack(StringValue(value="x"))
    server = Server()
    register_builtin_actions(server)
    with pytest.raises(SessionAbortedError, match=r"config of type 'type.googleapis.com/google.protobuf.StringValue'"):
        await _run(server, "GENERATE", [other])
    with pytest.raises(SessionAbortedError, match="ECHO takes no configs") as caught:
        await _run(server, "ECHO", [generate_config(seed=1)], output="output")
    assert caught.value.code == StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("value", [b"\xff\xff", b"\x0a\x03\x0a\x01\xff"], ids=["corrupt", "bad UTF-8"])
async def test_a_struct_that_does_not_parse_is_invalid_argument_naming_it(value: bytes) -> None:
    """The peer's bytes inside the Any: Unpack raises DecodeError for them (it used to leave the handler:
    INTERNAL, and a traceback in the server's log)."""
    corrupt = AnyProto(type_url="type.googleapis.com/google.protobuf.Struct", value=value)
    with pytest.raises(GenerateConfigError, match="expected a valid Struct"):
        parse_configs([corrupt], where="action GENERATE")
    server = Server()
    register_builtin_actions(server)
    with pytest.raises(SessionAbortedError, match="expected a valid Struct") as caught:
        await _run(server, "GENERATE", [corrupt])
    assert caught.value.code == StatusCode.INVALID_ARGUMENT


async def test_the_toy_generator_reads_max_tokens() -> None:
    server = Server()
    register_builtin_actions(server)
    full = await _run(server, "GENERATE", [])
    short = await _run(server, "GENERATE", [generate_config(max_tokens=3)])
    assert full.startswith(short) and len(short.split()) == 3 < len(full.split())


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=True) | st.integers(-(2**60), 2**60) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
)


@pytest.mark.fuzz
@given(st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "stop", "seed", "other"]),
                       JSON_VALUES, max_size=5))
def test_fuzz_configs_parse_or_name_the_key(settings: dict[str, Any]) -> None:
    try:
        params = parse_configs([generate_config(**settings)], where="action GENERATE")
    except GenerateConfigError as error:
        assert error.code == StatusCode.INVALID_ARGUMENT
        assert any(f"config {key!r}" in error.message for key in settings)
        return
    assert isinstance(params, GenerateParams)
    for key, value in params.openai_fields().items():
        assert key in settings and (not isinstance(value, float) or math.isfinite(value))
