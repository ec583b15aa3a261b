"""request-attribute-reporter (llm-d-router's requestcontrol/requestattributereporter): its
parameters, the reference's plugin_test.go tables, the metadata on the ext_proc stream's last
response reply (JSON, SSE, buffered, trailers), hostile bodies, and the command over a real socket."""

from __future__ import annotations

import json
import logging
import math
import random
import sys
from pathlib import Path

import grpc
import pytest
import trio
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health
from test_processor import request_body, request_headers, response_body, response_headers

from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics, render_metrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import ALPHA_TYPES
from evergreen_trio.picker.processor import ExtProcStream, Picker
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage

pytest.importorskip("cel_expr_python", reason="needs cel-expr-python (extra picker): "
                    "pip install 'evergreen-trio[picker]'")

from evergreen_trio.picker.attribute_reporter import (
    AttributeReporter,
    ReporterParams,
    report,
    usage_variable,
)

Mode = processing_mode_pb2.ProcessingMode
HEAD = "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
COST = "x-gateway-inference-request-cost"
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# Responses are observed only for a plugin that needs them (here, the reporter).
EXT_PROC = "extProc: {observeResponses: false}\n"


def _picker(plugins: str, plain: str = EXT_PROC) -> Picker:
    config = parse_config("pool: {endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}\n" + plain + HEAD + plugins)
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    return Picker(config, snapshot, rng=random.Random(6))


def reporter_yaml(expression: str, condition: str = "", *, name: str = COST, namespace: str = "",
                  plugin: str = "cost") -> str:
    key = {"name": name, **({"namespace": namespace} if namespace else {})}
    attribute = {"key": key, "expression": expression, **({"condition": condition} if condition else {})}
    entry = {"name": plugin, "type": "request-attribute-reporter", "parameters": {"attributes": [attribute]}}
    return "- " + json.dumps(entry) + "\n"


def reporters(*entries: str) -> tuple[AttributeReporter, ...]:
    return _picker("plugins:\n- {type: queue-scorer}\n" + "".join(entries)).reporters


def one(expression: str, condition: str = "", **key: str) -> tuple[AttributeReporter, ...]:
    return reporters(reporter_yaml(expression, condition, **key))


def load_error(parameters: str) -> str:
    with pytest.raises(ConfigError) as error:
        _picker(f"plugins:\n- {{type: request-attribute-reporter, parameters: {parameters}}}\n")
    message = str(error.value)
    assert "\n" not in message
    return message


# -- parameters (TestPluginCreation) ------------------------------------------------------------


def test_defaults_and_a_custom_namespace() -> None:
    (default,) = one("usage.prompt_tokens")
    assert default.params == ReporterParams("envoy.lb", COST, "usage.prompt_tokens")
    (custom,) = one("usage.prompt_tokens", "has(usage.prompt_tokens)", namespace="custom-ns")
    assert custom.params == ReporterParams("custom-ns", COST, "usage.prompt_tokens", "has(usage.prompt_tokens)")
    assert custom.name == "cost"


def test_it_is_beta_and_may_sit_in_a_profile_where_it_does_nothing() -> None:
    assert "request-attribute-reporter" not in ALPHA_TYPES  # StabilityBeta in the reference's runner
    profiles = "schedulingProfiles:\n- name: default\n  plugins: [{pluginRef: queue-scorer}, {pluginRef: cost}]\n"
    picker = _picker("plugins:\n- {type: queue-scorer}\n" + reporter_yaml("usage.completion_tokens") + profiles)
    assert picker.config.epp is not None
    (profile,) = picker.config.epp.scheduler["profiles"]
    assert [s.plugin.type for s in profile.scorers] == ["queue-scorer"] and not profile.filters


@pytest.mark.parametrize(("parameters", "field", "expected"), [
    ("{}", "parameters.attributes", "exactly one attribute, got '0 attributes'"),
    ("{attributes: []}", "parameters.attributes", "exactly one attribute"),
    ("{attributes: {key: {name: a}}}", "parameters.attributes", "a list"),
    ("{attributes: [{key: {name: a}, expression: '1'}, {key: {name: b}, expression: '1'}]}", "parameters.attributes",
     "got '2 attributes'"),
    ("{attributes: [{expression: usage.prompt_tokens}]}", "attributes[0].key.name", "a non-empty metadata key name"),
    ("{attributes: [{key: {namespace: ns}, expression: '1'}]}", "attributes[0].key.name", "non-empty"),
    ("{attributes: [{key: {name: a}}]}", "attributes[0].expression", "expected a CEL expression, got ''"),
    ("{attributes: [{key: {name: a}, expression: 7}]}", "attributes[0].expression", "a string"),
    ("{attributes: [{key: {name: a}, expression: 'usage.prompt_tokens + -'}]}", "attributes[0].expression",
     "Syntax error"),
    ("{attributes: [{key: {name: a}, expression: usage.prompt_tokens, condition: 'usage.prompt_tokens > '}]}",
     "attributes[0].condition", "Syntax error"),
    ("{attributes: [{key: {name: a}, expression: 'foo.bar'}]}", "attributes[0].expression",
     "undeclared reference to 'foo.bar'"),
    ("{attributes: [{key: {name: a}, expression: \"1 + 'a'\"}]}", "attributes[0].expression",
     "found no matching overload for '_+_' applied to '(int, string)'"),
    ("{attributes: [{key: {name: a}, expression: '1', value: 2}]}", "attributes[0].value",
     "(condition, expression, key)"),
    ("{attributes: [{key: {name: a, ns: x}, expression: '1'}]}", "attributes[0].key.ns", "a key parameter"),
    ("{attribute: []}", "parameters.attribute", "a request-attribute-reporter parameter (attributes)"),
])
def test_bad_parameters_name_the_field(parameters: str, field: str, expected: str) -> None:
    message = load_error(parameters)
    assert field in message and expected in message, message


def test_a_missing_cel_library_is_one_line_naming_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cel_expr_python", None)
    message = load_error("{attributes: [{key: {name: a}, expression: '1'}]}")
    assert "cel-expr-python" in message and "missing: cel_expr_python" in message
    assert "EndpointPickerConfig.plugins[0].parameters.attributes[0].expression" in message


# -- values (TestValueReporting) ------------------------------------------------------------------

GUARDED = "(has(usage.prompt_tokens) ? usage.prompt_tokens : 0) + (has(usage.completion_tokens) ? " \
          "usage.completion_tokens : 0)"


@pytest.mark.parametrize(("expression", "condition", "usage", "reported"), [
    ("usage.prompt_tokens", "", Usage(15), 15.0),  # request usage expression
    ("usage.prompt_tokens", "has(usage.prompt_tokens)", Usage(0), None),  # zero value
    ("usage.prompt_tokens", "usage.completion_tokens > 0", Usage(10), None),  # condition not met
    ("usage.prompt_tokens", "usage.prompt_tokens", Usage(10), None),  # condition not a bool
    ("'not a number'", "", Usage(10), None),
    ("usage.non_existent_field", "", Usage(10), None),  # runtime error: no such key
    (GUARDED, "", Usage(), None),  # fields missing with has() guards: 0
    (GUARDED, "", Usage(None, 25), 25.0),  # partial usage with has() guards
    # The README's and the integration test's expressions.
    ("usage.prompt_tokens + usage.completion_tokens", "has(usage.prompt_tokens) && has(usage.completion_tokens)",
     Usage(32, 10), 42.0),
    ("usage.completion_tokens", "has(usage.completion_tokens)", Usage(32, 10, None, 42), 10.0),
    # Struct numbers are doubles: no double + int overload; int() or a double literal work.
    ("usage.prompt_tokens + 1", "", Usage(5), None),
    ("int(usage.prompt_tokens) + 1", "", Usage(5), 6.0),
    ("usage.prompt_tokens + 1.0", "", Usage(5), 6.0),
    ("usage.prompt_tokens / 2.0", "", Usage(15), 7.0),  # a double truncated toward zero
    ("-usage.prompt_tokens / 2.0", "", Usage(15), -7.0),
    ("-int(usage.prompt_tokens)", "", Usage(1), None),  # -1: the reference's error value
    ("-int(usage.prompt_tokens)", "", Usage(5), -5.0),
    ("uint(usage.prompt_tokens)", "", Usage(5), None),  # uint64 is neither of the reference's types
    ("usage.prompt_tokens > 1.0", "", Usage(5), None),  # a bool is no number
    ("usage.prompt_tokens / 0.0", "", Usage(5), None),  # +Inf: outside int64
    ("0.0 / 0.0", "", Usage(), None),  # NaN
    ("1e19", "", Usage(), None),
    ("9223372036854775807", "", Usage(), 9223372036854775807.0),
    ("9223372036854775807 + 1", "", Usage(), None),  # overflow is an evaluation error
    ("usage.total_tokens", "", Usage(32, 10, None, 50), 50.0),  # a total reported with both counts
    ("usage.total_tokens", "", Usage(32, 10), 42.0),  # else prompt + completion
    ("usage.prompt_tokens_details.cached_tokens", "has(usage.prompt_tokens_details)", Usage(32, 10, 8), 8.0),
    ("usage.prompt_tokens_details.cached_tokens", "has(usage.prompt_tokens_details)", Usage(32, 10), None),
    ("usage.prompt_tokens_details.cached_tokens", "", Usage(32, 10), None),  # no such key
    ("7", "true", Usage(), 7.0),  # no usage at all still evaluates, as the reference's zero Usage
])
def test_value_reporting(expression: str, condition: str, usage: Usage, reported: float | None) -> None:
    got = report(one(expression, condition), usage)
    assert got == ({"envoy.lb": {COST: reported}} if reported is not None else {})


def test_several_plugins_share_a_struct_and_a_later_key_wins() -> None:
    plugins = reporters(reporter_yaml("usage.prompt_tokens", name="prompt", plugin="p"),
                        reporter_yaml("usage.completion_tokens", name="completion", plugin="c"),
                        reporter_yaml("usage.completion_tokens", name="completion", namespace="billing", plugin="b"),
                        reporter_yaml("usage.total_tokens", name="prompt", plugin="t"))
    assert [r.name for r in plugins] == ["p", "c", "b", "t"]
    assert report(plugins, Usage(3, 4)) == {"envoy.lb": {"prompt": 7.0, "completion": 4.0},
                                            "billing": {"completion": 4.0}}


def test_usage_is_the_reference_usage_struct() -> None:
    assert usage_variable(Usage()) == {"prompt_tokens": 0.0, "completion_tokens": 0.0, "total_tokens": 0.0}
    assert usage_variable(Usage(1, 2, 3, 4)) == {"prompt_tokens": 1.0, "completion_tokens": 2.0, "total_tokens": 4.0,
                                                 "prompt_tokens_details": {"cached_tokens": 3.0}}
    assert usage_variable(Usage(2**63)) is None and usage_variable(Usage(1, 2**62, None, 2**63)) is None
    assert usage_variable(Usage(2**62, 2**62)) is None  # their derived total is no int64


def test_each_reason_warns_once_then_logs_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    (bad,) = one("usage.nope")
    caplog.set_level(logging.DEBUG, logger="evergreen_trio.picker.attribute_reporter")
    variable = usage_variable(Usage(1))
    for _ in range(3):
        assert bad.value(variable) is None
    levels = [r.levelno for r in caplog.records if "attribute_not_reported" in r.message]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "reason=expression-error" in caplog.records[0].message and "nope" in caplog.records[0].message
    assert bad.value(None) is None  # another reason warns again
    assert caplog.records[-1].levelno == logging.WARNING and "count-out-of-range" in caplog.records[-1].message


# -- the ext_proc stream --------------------------------------------------------------------------

CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
# The reference's integration test bodies (test/integration/epp/request_attribute_reporter*_test.go).
JSON_BODY = (b'{"choices":[{"finish_reason":"stop","index":0,"logprobs":null,"message":{"content":"Hello! How can I '
             b'help you today?","role":"assistant"}}],"created":1773675992,"id":"chatcmpl-63a9","model":"modelName",'
             b'"object":"chat.completion","usage":{"completion_tokens":10,"prompt_tokens":32,"total_tokens":42}}')
SSE_CHUNKS = [
    b'data: {"choices":[{"delta":{"content":"Hello! "},"index":0,"finish_reason":null}],"id":"123","created":1,'
    b'"model":"modelName","object":"chat.completion.chunk"}\n',
    b'data: {"choices":[{"delta":{},"index":0,"finish_reason":"stop"}],"id":"123","created":1,"model":"modelName",'
    b'"object":"chat.completion.chunk","usage":{"completion_tokens":10,"prompt_tokens":32,"total_tokens":42}}\n',
    b"data: [DONE]\n",
]
REPORTER = "plugins:\n- {type: queue-scorer}\n" + reporter_yaml("usage.completion_tokens",
                                                                  "has(usage.completion_tokens)")


def routed(picker: Picker, *, response_mode: int = Mode.FULL_DUPLEX_STREAMED) -> ExtProcStream:
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/chat/completions", response_mode=response_mode))
    stream.on_message(request_body(CHAT))
    return stream


def cost(reply: ep.ProcessingResponse) -> float | None:
    """The reported cost; a response reply's metadata must hold nothing else."""
    if reply.HasField("request_headers") or not reply.HasField("dynamic_metadata"):
        return None
    fields = reply.dynamic_metadata.fields
    assert list(fields) == ["envoy.lb"] and list(fields["envoy.lb"].struct_value.fields) == [COST]
    return float(fields["envoy.lb"].struct_value.fields[COST].number_value)


def test_a_json_response_gets_the_metadata_on_its_last_reply() -> None:
    stream = routed(_picker(REPORTER))  # POOL sets observeResponses: false: the reporter keeps the stream
    assert not stream.finished
    (head,) = stream.on_message(response_headers())
    assert not head.HasField("dynamic_metadata")
    assert [cost(r) for r in stream.on_message(response_body(JSON_BODY[:100], end=False))] == [None]
    replies = stream.on_message(response_body(JSON_BODY[100:]))
    assert [cost(r) for r in replies] == [10.0] and stream.finished


def test_a_streamed_response_gets_it_with_the_end_of_stream() -> None:
    stream = routed(_picker(REPORTER))
    stream.on_message(response_headers("text/event-stream"))
    costs = [[cost(r) for r in stream.on_message(response_body(chunk, end=i == 2))]
             for i, chunk in enumerate(SSE_CHUNKS)]
    assert costs == [[None], [None], [10.0]]


def test_a_rewritten_response_and_a_buffered_one() -> None:
    picker = _picker(REPORTER, EXT_PROC + "models: [{name: m, targetModels: [{name: m-v1, weight: 1}]}]\n")
    stream = routed(picker)  # a rewrite back: the JSON body is held until its end
    stream.on_message(response_headers())
    assert stream.on_message(response_body(JSON_BODY[:50], end=False)) == []
    replies = stream.on_message(response_body(JSON_BODY[50:]))
    assert [cost(r) for r in replies] == [None, 10.0]
    buffered = routed(picker, response_mode=Mode.BUFFERED)
    buffered.on_message(response_headers())
    (reply,) = buffered.on_message(response_body(JSON_BODY.replace(b'"modelName"', b'"m-v1"')))
    assert cost(reply) == 10.0 and b'"model":"m"' in reply.response_body.response.body_mutation.body


def test_trailers_end_a_body_and_carry_the_metadata() -> None:
    stream = routed(_picker(REPORTER))
    stream.on_message(response_headers())
    stream.on_message(response_body(JSON_BODY, end=False))
    (trailers,) = stream.on_message(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
    assert trailers.HasField("response_trailers") and cost(trailers) == 10.0
    assert stream.report.usage == Usage(32, 10, None, 42)


def test_no_metadata_without_a_body_its_usage_or_the_plugin() -> None:
    stream = routed(_picker(REPORTER))
    (head,) = stream.on_message(response_headers(end=True))  # no body: no response body plugin runs
    assert not head.HasField("dynamic_metadata")
    no_usage = routed(_picker(REPORTER))
    no_usage.on_message(response_headers())
    assert [cost(r) for r in no_usage.on_message(response_body(b'{"choices":[]}'))] == [None]
    plain = _picker("plugins:\n- {type: queue-scorer}\n")
    assert plain.reporters == () and routed(plain).finished  # observeResponses: false as before
    capped = _picker(REPORTER, "extProc: {observeResponses: false, maxResponseBodyBytes: 64}\n")
    big = routed(capped)  # a JSON body over the cap is passed on untracked: nothing to report
    big.on_message(response_headers())
    big.on_message(response_body(JSON_BODY[:100], end=False))
    assert [cost(r) for r in big.on_message(response_body(JSON_BODY[100:]))] == [None]


# -- hostile bodies --------------------------------------------------------------------------------

_json_usage = st.fixed_dictionaries({}, optional={
    "prompt_tokens": st.integers(-5, 2**70) | st.floats() | st.text(max_size=3) | st.none(),
    "completion_tokens": st.integers(-5, 2**70) | st.floats() | st.booleans(),
    "total_tokens": st.integers(-5, 2**70),
    "prompt_tokens_details": st.fixed_dictionaries({}, optional={"cached_tokens": st.integers(-5, 2**70)}),
    "input_tokens": st.integers(0, 2**64),
})
_documents = st.builds(lambda usage, extra: json.dumps({"usage": usage, **extra}).encode(), _json_usage,
                       st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _mutated(data: bytes, cut: int, flip: int) -> bytes:
    if not data:
        return data
    index = flip % len(data)
    return data[:cut] + data[index:index + 1] + bytes([data[index] ^ 0x5A]) + data[cut + 1:]


_bodies = st.one_of(
    st.binary(max_size=300),
    _documents,
    st.builds(lambda doc: b"data: " + doc + b"\n\ndata: [DONE]\n", _documents),
    st.builds(_mutated, _documents, st.integers(0, 200), st.integers(0, 200)),
    st.builds(_mutated, st.just(JSON_BODY), st.integers(0, 400), st.integers(0, 400)),
)
_EXPRESSIONS = ["usage.completion_tokens", "usage.prompt_tokens + usage.completion_tokens", GUARDED,
                "usage.prompt_tokens_details.cached_tokens", "int(usage.total_tokens) * 3 - 1",
                "usage.prompt_tokens / usage.completion_tokens"]
FUZZ_PICKER = _picker("plugins:\n- {type: queue-scorer}\n" + "".join(
    reporter_yaml(e, name=f"a{i}", plugin=f"r{i}") for i, e in enumerate(_EXPRESSIONS)))


@pytest.mark.fuzz
@given(st.lists(_bodies, min_size=1, max_size=4), st.sampled_from(["application/json", "text/event-stream"]),
       st.sampled_from([Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED]), st.booleans())
def test_fuzz_response_bodies_give_no_metadata_or_valid_metadata(chunks: list[bytes], content_type: str, mode: int,
                                                                  trailers: bool) -> None:
    stream = routed(FUZZ_PICKER, response_mode=mode)
    stream.on_message(response_headers(content_type))
    replies: list[ep.ProcessingResponse] = []
    for i, chunk in enumerate(chunks if mode == Mode.FULL_DUPLEX_STREAMED else chunks[:1]):
        last = i == len(chunks) - 1 or mode == Mode.BUFFERED
        replies += stream.on_message(response_body(chunk, end=last and not trailers))
    if trailers and mode == Mode.FULL_DUPLEX_STREAMED:
        replies += stream.on_message(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
    with_metadata = [r for r in replies if r.HasField("dynamic_metadata")]
    assert len(with_metadata) <= 1 and (not with_metadata or with_metadata[0] is replies[-1])
    for reply in with_metadata:
        (namespace,) = reply.dynamic_metadata.fields
        assert namespace == "envoy.lb"
        for name, value in reply.dynamic_metadata.fields[namespace].struct_value.fields.items():
            number = value.number_value
            assert name in {f"a{i}" for i in range(len(_EXPRESSIONS))} and value.WhichOneof("kind") == "number_value"
            assert math.isfinite(number) and number == int(number) and number not in (0, -1)
            assert -(2**63) <= number <= 2**63


@pytest.mark.fuzz
@given(st.builds(Usage, *(st.none() | st.integers(0, 2**66) for _ in range(4))))
def test_fuzz_usage_counts(usage: Usage) -> None:
    for namespace, values in report(FUZZ_PICKER.reporters, usage).items():
        assert namespace == "envoy.lb"
        assert all(math.isfinite(v) and v == int(v) and v not in (0, -1) for v in values.values())


# -- the command ----------------------------------------------------------------------------------

EPP = HEAD + REPORTER


def test_the_command_refuses_a_bad_expression_and_a_missing_library_in_one_line(tmp_path: Path) -> None:
    bad = EPP.replace("usage.completion_tokens\"", "usage.completion_tokens +\"", 1)
    result = run_cli(["--pool-name", "p", "--config-text", bad])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "plugins[1].parameters.attributes[0].expression: expected a CEL expression that compiles" in result.stderr
    hidden = tmp_path / "cel_expr_python"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('not installed')\n")
    root = str(Path(__file__).parents[2])
    result = run_cli(["--pool-name", "p", "--config-text", EPP], {"PYTHONPATH": f"{tmp_path}:{root}"})
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "cel-expr-python" in result.stderr and "missing: cel_expr_python" in result.stderr


async def serve_engine(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A model server's idle ``/metrics`` (the picker never sends it a request here)."""
    text = render_metrics("vllm", EndpointMetrics()).encode()

    async def handle(request: HttpRequest) -> HttpResponse:
        return HttpResponse(200, [("content-type", "text/plain")], text)

    await serve_http(handle, "127.0.0.1", 0, task_status=task_status)


def exchange(port: int, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    """One ext_proc stream as Envoy sends it in FULL_DUPLEX_STREAMED (blocking: run it in a thread)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                     response_deserializer=ep.ProcessingResponse.FromString)
        return list(call(iter(messages), timeout=10))


def http_headers(pairs: dict[str, str], end: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode())
                                                              for k, v in pairs.items()]), end_of_stream=end)


async def test_over_a_real_socket_json_and_sse(nursery: trio.Nursery, tmp_path: Path) -> None:
    engine = f"127.0.0.1:{await nursery.start(serve_engine)}"
    config = tmp_path / "picker.yaml"
    config.write_text(f"pool: {{name: r, endpoints: ['{engine}']}}\n" + EPP)
    duplex = ep.ProtocolConfiguration(request_body_mode=Mode.FULL_DUPLEX_STREAMED,
                                      response_body_mode=Mode.FULL_DUPLEX_STREAMED)
    request = [
        ep.ProcessingRequest(request_headers=http_headers({":path": "/v1/chat/completions", ":method": "POST"}),
                             protocol_config=duplex),
        ep.ProcessingRequest(request_body=ep.HttpBody(body=CHAT, end_of_stream=True)),
    ]

    def response(content_type: str, chunks: list[bytes]) -> list[ep.ProcessingRequest]:
        head = ep.ProcessingRequest(response_headers=http_headers({":status": "200", "content-type": content_type}))
        return [head, *(ep.ProcessingRequest(response_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
                        for i, c in enumerate(chunks))]

    async with picker_process(["--config", str(config), *EPHEMERAL_PORTS]) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        # ReqHeaders + ReqBody -> 2 replies, RespHeaders -> 1, each body chunk -> 1.
        json_replies = await trio.to_thread.run_sync(
            exchange, picker.grpc, request + response("application/json", [JSON_BODY]))
        sse_replies = await trio.to_thread.run_sync(
            exchange, picker.grpc, request + response("text/event-stream", SSE_CHUNKS))
    assert len(json_replies) == 4 and [cost(r) for r in json_replies] == [None, None, None, 10.0]
    assert json_replies[0].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == engine
    assert len(sse_replies) == 6 and [cost(r) for r in sse_replies[3:]] == [None, None, 10.0]
