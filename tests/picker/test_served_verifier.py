"""``destination-endpoint-served-verifier`` (a conformance-test plugin in llm-d-router): its own
test table, any metadata value as an invariant, the ext_proc stream's response headers (buffered,
streamed and held), the command's bad input, and a started picker driven by grpcio as Envoy."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import grpc
import pytest
import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from test_processor import make_picker, request_body, request_headers, response_body, response_headers, set_headers

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES, Category
from evergreen_trio.picker.processor import ExtProcStream
from evergreen_trio.picker.served_verifier import (
    INVALID_VALUE,
    MAX_VALUE_CHARS,
    MISSING_KEY,
    MISSING_NAMESPACE,
    SERVED_ENDPOINT_HEADER,
    SERVED_KEY,
    served_verdict,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import PROCESS, headers_message, serve_fake_engine, wait_routable

HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
VERIFIER = HEAD + "plugins: [{type: destination-endpoint-served-verifier}, {type: queue-scorer}]\n"


def _text(value: str) -> struct_pb2.Value:
    return struct_pb2.Value(string_value=value)


# -- llm-d-router's test (destination_endpoint_served_verifier_test.go) ----------------------------


@pytest.mark.parametrize(("lb", "expected"), [
    ({SERVED_KEY: _text("10.0.0.1:8080")}, "10.0.0.1:8080"),  # the endpoint is reported
    (None, MISSING_NAMESPACE),  # missing lb metadata, and nil metadata
    ({"some-other-key": _text("some-value")}, MISSING_KEY),
])
def test_the_references_cases(lb: dict[str, struct_pb2.Value] | None, expected: str) -> None:
    assert served_verdict(lb) == expected


def test_a_value_that_is_no_string_or_no_header_value() -> None:
    listed = struct_pb2.Value(list_value=struct_pb2.ListValue(values=[_text("10.0.0.1:8080")]))
    assert served_verdict({SERVED_KEY: listed}) == MISSING_KEY  # the reference's .(string) fails too
    assert served_verdict({SERVED_KEY: struct_pb2.Value(number_value=1)}) == MISSING_KEY
    assert served_verdict({SERVED_KEY: _text("")}) == ""  # a string, as the reference copies it
    for bad in ("10.0.0.1:80\r\nx-evil: 1", "caf\u00e9:80", "a\x00b", "x" * (MAX_VALUE_CHARS + 1)):
        assert served_verdict({SERVED_KEY: _text(bad)}) == INVALID_VALUE
    assert served_verdict({SERVED_KEY: _text("x" * MAX_VALUE_CHARS)}) == "x" * MAX_VALUE_CHARS


@given(st.text(max_size=2000))
def test_any_string_is_copied_or_refused_and_the_header_value_is_always_visible_ascii(value: str) -> None:
    verdict = served_verdict({SERVED_KEY: _text(value)})
    assert verdict in (value, INVALID_VALUE)
    assert all(" " <= c <= "~" for c in verdict) and len(verdict) <= MAX_VALUE_CHARS


def test_the_type_is_an_implemented_beta_response_plugin_without_parameters() -> None:
    kind = "destination-endpoint-served-verifier"
    assert kind not in ALPHA_TYPES
    assert PLUGIN_TYPES[kind].category is Category.RESPONSE_PROCESSOR
    with pytest.raises(ConfigError) as caught:
        make_picker(HEAD + "plugins: [{type: destination-endpoint-served-verifier, parameters: {header: x}}]\n")
    assert caught.value.field == "EndpointPickerConfig.plugins[0].parameters.header"


# -- the ext_proc stream ------------------------------------------------------------------------


def _routed(extra: str = VERIFIER, **modes: int) -> ExtProcStream:
    stream = make_picker(extra).new_stream()
    stream.on_message(request_headers(**modes))
    stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "p"}).encode()))
    return stream


def _response_header(reply: ep.ProcessingResponse) -> str | None:
    return set_headers(reply.response_headers.response.header_mutation).get(SERVED_ENDPOINT_HEADER)


def test_the_response_carries_the_served_endpoint_or_why_not() -> None:
    (reply,) = _routed().on_message(response_headers(served="10.0.0.2:8000"))
    assert _response_header(reply) == "10.0.0.2:8000"
    (reply,) = _routed().on_message(response_headers())
    assert _response_header(reply) == MISSING_NAMESPACE
    (reply,) = _routed("").on_message(response_headers(served="10.0.0.2:8000"))  # not declared
    assert _response_header(reply) is None


def test_a_held_json_response_gets_the_header_when_released() -> None:
    """A rewritten JSON body is held to its end (FULL_DUPLEX): the header rides on the released head."""
    stream = make_picker(VERIFIER).new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(b'{"model":"food-review","prompt":"p"}'))
    assert stream.on_message(response_headers(served="10.0.0.1:8000")) == []
    head, *_ = stream.on_message(response_body(b'{"model":"food-review-v1"}', end=True))
    assert _response_header(head) == "10.0.0.1:8000"


def test_the_stream_stays_open_for_the_response_even_when_responses_are_not_observed() -> None:
    unobserved = "extProc: {observeResponses: false}\n"
    assert _routed(unobserved).finished
    stream = _routed(unobserved + VERIFIER)
    assert not stream.finished
    (reply,) = stream.on_message(response_headers(served="10.0.0.3:8000", end=True))
    assert _response_header(reply) == "10.0.0.3:8000" and stream.finished


# -- the command --------------------------------------------------------------------------------


def test_a_parameter_is_one_line_and_exit_2_from_the_command() -> None:
    text = HEAD + "plugins: [{type: destination-endpoint-served-verifier, parameters: {strict: true}}]\n"
    result = run_cli(["--pool-name", "p", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "EndpointPickerConfig.plugins[0].parameters.strict: expected a destination-endpoint-served-verifier " \
           "parameter (none)" in line, line


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


def conformance_exchange(port: int, served: str) -> list[ep.ProcessingResponse]:
    """A buffered request, then the response headers with Envoy's served-endpoint metadata (blocking)."""
    body = ep.ProcessingRequest(request_body=ep.HttpBody(body=b'{"model":"m","prompt":"p"}', end_of_stream=True))
    head = response_headers(served=served, end=True)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        return list(call(iter([headers_message(), body, head]), timeout=10))


async def test_a_started_picker_returns_the_served_endpoint(nursery: trio.Nursery, tmp_path: Path) -> None:
    engine = f"127.0.0.1:{await nursery.start(serve_fake_engine)}"
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: conformance, endpoints: ['{engine}']}}\n" + VERIFIER)
    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        await wait_routable(picker.grpc)
        *_, reply = await trio.to_thread.run_sync(conformance_exchange, picker.grpc, engine)
    assert _response_header(reply) == engine
