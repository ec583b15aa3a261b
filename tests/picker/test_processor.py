"""The ext_proc stream state machine, sans-IO: both body modes, errors, destination modes, rewrite."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker import telemetry as telemetry_module
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ExtProcError
from evergreen_trio.picker.processor import DESTINATION, FALLBACK, SCORES, Picker, StreamReport
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.telemetry import PickerMetrics
from evergreen_trio.picker.usage import Usage

Mode = processing_mode_pb2.ProcessingMode
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def make_picker(extra: str = "", metrics: Sequence[EndpointMetrics | None] = (None, None, None)) -> Picker:
    config = parse_config(f"""
pool: {{name: t, endpoints: ['{A}', '{B}', '{C}']}}
models:
  - {{name: food-review, targetModels: [{{name: food-review-v1, weight: 1}}]}}
  - {{name: plain}}
  - {{name: batch, criticality: Sheddable}}
{extra}
""")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    defaults = [EndpointMetrics(waiting=0), EndpointMetrics(waiting=4), EndpointMetrics(waiting=8)]
    for endpoint, given_metrics, default in zip(config.pool.endpoints, metrics, defaults, strict=True):
        snapshot.update(endpoint.address, given_metrics or default)
    return Picker(config, snapshot, rng=random.Random(3))


def request_headers(
    path: str = "/v1/completions", *, method: str = "POST", end: bool = False, extra: Sequence[tuple[str, str]] = (),
    request_mode: int = Mode.FULL_DUPLEX_STREAMED, response_mode: int = Mode.FULL_DUPLEX_STREAMED,
    subset: struct_pb2.Value | None = None,
) -> ep.ProcessingRequest:
    headers = [(":path", path), (":method", method), *extra]
    message = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers]), end_of_stream=end),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode))
    if subset is not None:
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields[
            "x-gateway-destination-endpoint-subset"].CopyFrom(subset)
    return message


def request_body(data: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=end))


def response_headers(content_type: str = "application/json", served: str | None = None,
                     end: bool = False) -> ep.ProcessingRequest:
    message = ep.ProcessingRequest(response_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()),
                                            base_pb2.HeaderValue(key=":status", raw_value=b"200")]),
        end_of_stream=end))
    if served is not None:
        message.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"].string_value = served
    return message


def response_body(data: bytes, end: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=end))


def set_headers(mutation: ep.HeaderMutation) -> dict[str, str]:
    return {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}


def lb_metadata(response: ep.ProcessingResponse) -> dict[str, str]:
    return {k: v.string_value for k, v in response.dynamic_metadata.fields["envoy.lb"].struct_value.fields.items()}


def status(responses: Sequence[ep.ProcessingResponse]) -> int:
    assert len(responses) == 1 and responses[0].HasField("immediate_response")
    return int(responses[0].immediate_response.status.code)


def test_duplex_holds_headers_then_sends_decision_and_chunks() -> None:
    stream = make_picker().new_stream()
    body = json.dumps({"model": "food-review", "prompt": "x" * 150_000}).encode()
    assert stream.on_message(request_headers(extra=[("content-length", str(len(body))),
                                                    (DESTINATION, C), ("x-gateway-inference-objective", "o")])) == []
    assert stream.on_message(request_body(body[:1000], end=False)) == []
    out = stream.on_message(request_body(body[1000:], end=True))
    head, chunks = out[0], out[1:]
    common = head.request_headers.response
    assert common.clear_route_cache
    headers = set_headers(common.header_mutation)
    assert headers[DESTINATION] == A == lb_metadata(head)[DESTINATION]
    assert list(common.header_mutation.remove_headers) == ["x-gateway-inference-objective"]
    sent = b"".join(c.request_body.response.body_mutation.streamed_response.body for c in chunks)
    assert json.loads(sent) == {"model": "food-review-v1", "prompt": "x" * 150_000}
    assert int(headers["content-length"]) == len(sent)
    assert all(len(c.request_body.response.body_mutation.streamed_response.body) <= 62_000 for c in chunks)
    assert [c.request_body.response.body_mutation.streamed_response.end_of_stream for c in chunks] == [
        False] * (len(chunks) - 1) + [True]


def test_buffered_answers_headers_then_routes_on_the_body() -> None:
    stream = make_picker().new_stream()
    (first,) = stream.on_message(request_headers(request_mode=Mode.BUFFERED, response_mode=Mode.BUFFERED))
    assert first.HasField("request_headers") and not first.request_headers.response.HasField("header_mutation")
    (decision,) = stream.on_message(request_body(b'{"model":"food-review","prompt":"p"}'))
    common = decision.request_body.response
    assert set_headers(common.header_mutation)[DESTINATION] == A == lb_metadata(decision)[DESTINATION]
    assert json.loads(common.body_mutation.body)["model"] == "food-review-v1"
    assert common.clear_route_cache


def test_headers_only_request_is_picked_at_once() -> None:
    stream = make_picker().new_stream()
    (decision,) = stream.on_message(request_headers("/v1/models", method="GET", end=True))
    assert set_headers(decision.request_headers.response.header_mutation)[DESTINATION] == A


@pytest.mark.parametrize(("body", "code"), [
    (b"{oops", 400), (b'{"prompt":"p"}', 400), (b'{"model":"unknown","prompt":"p"}', 404),
])
def test_bad_requests_get_immediate_responses(body: bytes, code: int) -> None:
    for mode in (Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED):
        stream = make_picker().new_stream()
        stream.on_message(request_headers(request_mode=mode))
        responses = stream.on_message(request_body(body))
        assert status(responses) == code
        error = json.loads(responses[0].immediate_response.body)["error"]
        assert error["code"] == code and error["message"]


def test_429_for_sheddable_under_saturation_503_when_nothing_ready() -> None:
    saturated = [EndpointMetrics(waiting=10, kv_usage=0.9)] * 3
    picker = make_picker(metrics=saturated)
    telemetry = PickerMetrics("pool")
    stream = picker.new_stream()
    stream.on_message(request_headers())
    assert status(stream.on_message(request_body(b'{"model":"batch","prompt":"p"}'))) == 429
    assert stream.report.error == 429 and not stream.report.routed
    telemetry.record(stream.report, 0.01)
    stream = picker.new_stream()
    stream.on_message(request_headers())
    assert stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))[0].HasField("request_headers")
    for address in (A, B, C):
        picker.snapshot.mark_failed(address)
    stream = picker.new_stream()
    stream.on_message(request_headers())
    assert status(stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))) == 503
    telemetry.record(stream.report, 0.01)
    errors = {(s.labels["model_name"], s.labels["error_code"]): s.value
              for s in telemetry.errors.collect()[0].samples if s.name.endswith("_total")}
    assert errors == {("batch", "InferencePoolResourceExhausted"): 1.0, ("plain", "ServiceUnavailable"): 1.0}


def test_metric_series_map_is_capped_and_counts_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(telemetry_module, "MAX_CACHED_SERIES", 3)
    telemetry = PickerMetrics("pool")
    served = [f"10.0.0.{i}:8000" for i in range(5)]
    for _ in range(2):
        for address in served:
            telemetry.record(StreamReport(served=[address]), 0.01)
            assert len(telemetry._series) <= 3
    counts = {s.labels["endpoint"]: s.value for s in telemetry.served.collect()[0].samples if s.name.endswith("_total")}
    assert counts == dict.fromkeys(served, 2.0)


def test_objective_header_overrides_model_criticality() -> None:
    picker = make_picker("objectives: [{name: low, priority: -1}]",
                         metrics=[EndpointMetrics(waiting=10, kv_usage=0.9)] * 3)
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=[("x-gateway-inference-objective", "low")]))
    assert status(stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))) == 429


@pytest.mark.parametrize("subset", [
    struct_pb2.Value(list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value=C)])),
    struct_pb2.Value(string_value=f"{C}, 10.9.9.9:1"),
])
def test_subset_hint(subset: struct_pb2.Value) -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers(subset=subset))
    (head, *_) = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    assert lb_metadata(head)[DESTINATION] == C


def with_ext_proc(picker: Picker, **changes: object) -> Picker:
    config = dataclasses.replace(picker.config, ext_proc=dataclasses.replace(picker.config.ext_proc, **changes))
    return Picker(config, picker.snapshot, rng=random.Random(3))


def test_a_disabled_subset_filter_ignores_the_hint() -> None:
    """``--disable-endpoint-subset-filter``: the hint names C, the least loaded endpoint (A) is picked."""
    stream = with_ext_proc(make_picker(), honor_subset_hint=False).new_stream()
    hint = struct_pb2.Value(list_value=struct_pb2.ListValue(values=[struct_pb2.Value(string_value=C)]))
    stream.on_message(request_headers(subset=hint))
    (head, *_) = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    assert lb_metadata(head)[DESTINATION] == A


def test_endpoint_scores_are_emitted_only_when_asked() -> None:
    """``--emit-endpoint-scores``: every candidate's score under ``envoy.lb`` (the reference's key), the
    destination the best of them; nothing more without the flag."""
    stream = with_ext_proc(make_picker(), emit_endpoint_scores=True).new_stream()
    stream.on_message(request_headers())
    (head, *_) = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    lb = head.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    scores = {address: value.number_value for address, value in lb[SCORES].struct_value.fields.items()}
    assert set(scores) == {A, B, C} and scores[A] > scores[B] > scores[C]
    assert lb[DESTINATION].string_value == max(scores, key=scores.__getitem__)
    stream = make_picker().new_stream()
    stream.on_message(request_headers())
    (head, *_) = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    assert SCORES not in head.dynamic_metadata.fields["envoy.lb"].struct_value.fields


def test_empty_subset_is_503() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers(subset=struct_pb2.Value(list_value=struct_pb2.ListValue())))
    assert status(stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))) == 503


def test_fallback_and_list_destination_modes() -> None:
    stream = make_picker("extProc: {destinationMode: fallback}").new_stream()
    stream.on_message(request_headers())
    (head, *_) = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    assert lb_metadata(head) == {DESTINATION: A, FALLBACK: B}
    assert set_headers(head.request_headers.response.header_mutation)[DESTINATION] == A
    stream = make_picker("extProc: {destinationMode: list}").new_stream()
    stream.on_message(request_headers())
    (head, *_) = stream.on_message(request_body(b'{"model":"plain","prompt":"p"}'))
    assert lb_metadata(head) == {DESTINATION: f"{A},{B},{C}"}
    assert set_headers(head.request_headers.response.header_mutation)[DESTINATION] == f"{A},{B},{C}"


def test_served_endpoint_is_recorded_and_teaches_the_prefix_index() -> None:
    picker = make_picker()
    stream = picker.new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "q" * 640}).encode()))
    stream.on_message(response_headers(served=B))
    assert stream.report.served == [B]
    # 160 tokens: two blocks of 64 and the tail
    assert picker.scheduler.prefix.size(A) == 3 and picker.scheduler.prefix.size(B) == 3


def test_duplex_sse_response_rewritten_line_by_line_with_usage() -> None:
    picker = make_picker()
    stream = picker.new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(b'{"model":"food-review","stream":true,"prompt":"p"}'))
    (head,) = stream.on_message(response_headers("text/event-stream"))
    assert head.HasField("response_headers")
    sse = (b'data: {"model":"food-review-v1","usage":{"prompt_tokens":2,"completion_tokens":3}}\n\n'
           b"data: [DONE]\n\n")
    first = stream.on_message(response_body(sse[:30], end=False))
    assert first == []
    rest = stream.on_message(response_body(sse[30:], end=True))
    sent = b"".join(r.response_body.response.body_mutation.streamed_response.body for r in rest)
    assert b'"model":"food-review"' in sent and b"food-review-v1" not in sent
    assert rest[-1].response_body.response.body_mutation.streamed_response.end_of_stream
    assert stream.report.usage == Usage(prompt_tokens=2, completion_tokens=3)
    telemetry = PickerMetrics("pool")
    telemetry.record(stream.report, 0.3)
    tokens = {s.labels["kind"]: s.value for s in telemetry.tokens.collect()[0].samples if s.name.endswith("_total")}
    assert tokens == {"prompt": 2.0, "completion": 3.0}
    ntpot = {s.name: s.value for s in telemetry.ntpot.collect()[0].samples}
    assert ntpot["llm_d_epp_request_ntpot_seconds_sum"] == pytest.approx(0.1)


def test_duplex_json_response_held_until_end_then_content_length_fixed() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(b'{"model":"food-review","prompt":"p"}'))
    assert stream.on_message(response_headers()) == []
    assert stream.on_message(response_body(b'{"model":"food-', end=False)) == []
    head, *chunks = stream.on_message(response_body(b'review-v1","x":1}', end=True))
    body = b"".join(c.response_body.response.body_mutation.streamed_response.body for c in chunks)
    assert json.loads(body) == {"model": "food-review", "x": 1}
    assert set_headers(head.response_headers.response.header_mutation)["content-length"] == str(len(body))


def test_buffered_json_response_rewritten() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers(request_mode=Mode.BUFFERED, response_mode=Mode.BUFFERED))
    stream.on_message(request_body(b'{"model":"food-review","prompt":"p"}'))
    assert stream.on_message(response_headers())[0].HasField("response_headers")
    (out,) = stream.on_message(response_body(b'{"model":"food-review-v1"}'))
    assert json.loads(out.response_body.response.body_mutation.body) == {"model": "food-review"}


def test_duplex_with_trailers_ends_body_without_end_of_stream() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers())
    assert stream.on_message(request_body(b'{"model":"plain","prompt":"p"}', end=False)) == []
    out = stream.on_message(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
    assert out[0].HasField("request_headers") and out[-1].HasField("request_trailers")
    assert not out[1].request_body.response.body_mutation.streamed_response.end_of_stream


def test_request_body_limit_is_413() -> None:
    stream = make_picker("extProc: {maxRequestBodyBytes: 100}").new_stream()
    stream.on_message(request_headers())
    assert stream.on_message(request_body(b"x" * 60, end=False)) == []
    assert status(stream.on_message(request_body(b"x" * 60, end=False))) == 413


@pytest.mark.parametrize("messages", [
    [request_body(b"{}")],
    [request_headers(), request_headers()],
    [ep.ProcessingRequest()],
    [response_body(b"x")],
    [request_headers(request_mode=Mode.STREAMED)],
])
def test_protocol_violations_are_ext_proc_errors(messages: list[ep.ProcessingRequest]) -> None:
    stream = make_picker().new_stream()
    with pytest.raises(ExtProcError):
        for message in messages:
            stream.on_message(message)


_modes = st.sampled_from([Mode.NONE, Mode.BUFFERED, Mode.FULL_DUPLEX_STREAMED, Mode.STREAMED])
_bodies = st.binary(max_size=80) | st.sampled_from(
    [b'{"model":"food-review","prompt":"hello"}', b'{"model":"batch"}', b'{"model":"plain","stream":true}'])
_messages = st.one_of(
    st.builds(lambda path, end, rm, sm: request_headers(path, end=end, request_mode=rm, response_mode=sm),
              st.sampled_from(["/v1/completions", "/v1/chat/completions", "/x"]), st.booleans(), _modes, _modes),
    st.builds(request_body, _bodies, st.booleans()),
    st.builds(response_headers, st.sampled_from(["application/json", "text/event-stream"]),
              st.none() | st.sampled_from([A, "junk"]), st.booleans()),
    st.builds(response_body, st.binary(max_size=80) | st.just(b'data: {"model":"food-review-v1"}\n'), st.booleans()),
    st.just(ep.ProcessingRequest(request_trailers=ep.HttpTrailers())),
    st.just(ep.ProcessingRequest(response_trailers=ep.HttpTrailers())),
)


@pytest.mark.fuzz
@given(st.lists(_messages, max_size=8))
def test_fuzz_message_sequences_only_raise_ext_proc_errors(messages: list[ep.ProcessingRequest]) -> None:
    stream = make_picker().new_stream()
    try:
        for message in messages:
            for response in stream.on_message(message):
                assert isinstance(response, ep.ProcessingResponse)
                if response.HasField("request_headers") and response.request_headers.response.HasField(
                        "header_mutation") and response.HasField("dynamic_metadata"):
                    header = set_headers(response.request_headers.response.header_mutation)[DESTINATION]
                    assert header == lb_metadata(response)[DESTINATION]
    except ExtProcError:
        pass
    stream.on_end()


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=120), max_size=5))
def test_fuzz_wire_bytes_only_raise_ext_proc_errors(frames: list[bytes]) -> None:
    stream = make_picker().new_stream()
    try:
        for frame in frames:
            try:
                message = ep.ProcessingRequest.FromString(frame)
            except DecodeError:
                continue
            stream.on_message(message)
    except ExtProcError:
        pass


@pytest.mark.parametrize("request_mode", [Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED])
def test_stream_finishes_once_routed_unless_responses_are_observed_or_rewritten(request_mode: int) -> None:
    def finished_after_routing(extra: str, model: str) -> bool:
        stream = make_picker(extra).new_stream()
        stream.on_message(request_headers(request_mode=request_mode))
        assert not stream.finished
        stream.on_message(request_body(json.dumps({"model": model, "prompt": "p"}).encode()))
        return stream.finished

    assert finished_after_routing("extProc: {observeResponses: false}", "plain")
    assert not finished_after_routing("extProc: {observeResponses: false}", "food-review")  # rewrite back
    assert not finished_after_routing("", "plain")


@pytest.mark.parametrize("response_mode", [Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED])
def test_observed_stream_finishes_at_the_response_end(response_mode: int) -> None:
    # Envoy resets an ext_proc stream left open after the response: the picker ends it itself,
    # with the usage read, so the wire never sees one reset per request.
    stream = make_picker().new_stream()
    stream.on_message(request_headers(response_mode=response_mode))
    stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "p"}).encode()))
    stream.on_message(response_headers())
    assert not stream.finished
    body = b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}'
    if response_mode == Mode.FULL_DUPLEX_STREAMED:
        stream.on_message(response_body(body[:10], end=False))
        assert not stream.finished
        stream.on_message(response_body(body[10:]))
    else:
        stream.on_message(response_body(body))
    assert stream.finished
    assert stream.report.usage is not None and stream.report.usage.completion_tokens == 2


def test_a_pass_through_body_ended_by_trailers_has_its_usage_read() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers())
    stream.on_message(request_body(json.dumps({"model": "plain", "prompt": "p"}).encode()))
    stream.on_message(response_headers())
    stream.on_message(response_body(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 2}}', end=False))
    stream.on_message(ep.ProcessingRequest(response_trailers=ep.HttpTrailers()))
    assert stream.finished and stream.report.usage == Usage(3, 2)


def test_immediate_response_finishes_the_stream() -> None:
    stream = make_picker().new_stream()
    stream.on_message(request_headers())
    assert status(stream.on_message(request_body(b"not json"))) == 400
    assert stream.finished
