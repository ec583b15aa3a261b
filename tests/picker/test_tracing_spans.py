"""``--tracing``'s settings and spans, sans-IO: the ``OTEL_*`` environment as llm-d-router reads it,
and the spans of streams driven by hand (finished spans read from the span buffer)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import assume, given
from hypothesis import strategies as st
from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
from test_processor import make_picker, request_body, request_headers, set_headers
from test_token_producer import FIXTURES, IMAGE, _chat
from test_token_producer import _picker as _epd_picker

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.processor import Picker
from evergreen_trio.picker.routing_headers import ENCODERS_HEADER, PREFILL_HEADER
from evergreen_trio.picker.runtime import ext_proc_method, picker_metrics
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.tracing import (
    MAX_TRACED_ENDPOINT_SCORES,
    RequestTrace,
    SpanBuffer,
    Tracing,
    new_exporter,
    new_tracing,
)
from evergreen_trio.picker.tracing_env import MAX_QUEUE_SIZE, OTLP_TRANSPORT_ENV, TracingSettings, tracing_settings

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


# -- the environment -------------------------------------------------------------------------------


def test_the_defaults_are_the_references() -> None:
    assert tracing_settings({}) == TracingSettings(exporter="console", ratio=0.1, local_collector=True)


@pytest.mark.parametrize(("env", "ratio", "notes"), [
    ({"OTEL_TRACES_SAMPLER_ARG": "1"}, 1.0, 0),
    ({"OTEL_TRACES_SAMPLER_ARG": "0.25"}, 0.25, 0),
    ({"OTEL_TRACES_SAMPLER_ARG": "half"}, 0.1, 0),  # the reference: a bad argument is 0.1, silently
    ({"OTEL_TRACES_SAMPLER_ARG": "nan"}, 0.1, 0),
    ({"OTEL_TRACES_SAMPLER_ARG": "7"}, 1.0, 0),  # Go's TraceIDRatioBased: 1 and above sample all
    ({"OTEL_TRACES_SAMPLER_ARG": "-2"}, 0.0, 0),
    ({"OTEL_TRACES_SAMPLER": "always_on", "OTEL_TRACES_SAMPLER_ARG": "1"}, 0.1, 1),  # unsupported: 0.1, one line
])
def test_the_sampler_as_the_reference_reads_it(env: dict[str, str], ratio: float, notes: int) -> None:
    settings = tracing_settings(env)
    assert (settings.ratio, len(settings.notes)) == (ratio, notes)


@pytest.mark.parametrize(("value", "exporter"), [("otlp", "otlp"), ("console", "console"), ("none", "console"),
                                                 ("zipkin", "console"), ("OTLP", "console")])
def test_only_otlp_leaves_the_console_exporter_as_the_reference(value: str, exporter: str) -> None:
    assert tracing_settings({"OTEL_TRACES_EXPORTER": value}).exporter == exporter


@pytest.mark.parametrize("name", ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_INSECURE",
                                  "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE"])
def test_any_transport_variable_turns_the_loopback_fallback_off(name: str) -> None:
    assert not tracing_settings({name: ""}).local_collector
    assert tracing_settings({"OTEL_EXPORTER_OTLP_HEADERS": "a=b"}).local_collector


def test_timeouts_and_delays_are_milliseconds_and_bad_ones_are_defaults_with_a_note() -> None:
    settings = tracing_settings({"OTEL_EXPORTER_OTLP_TIMEOUT": "2500", "OTEL_BSP_SCHEDULE_DELAY": "200",
                                 "OTEL_BSP_EXPORT_TIMEOUT": "0", "OTEL_BSP_MAX_QUEUE_SIZE": "1e12",
                                 "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "x"})
    assert (settings.otlp_timeout_s, settings.delay_s, settings.export_timeout_s) == (2.5, 0.2, 30.0)
    assert (settings.queue_size, settings.batch_size) == (MAX_QUEUE_SIZE, 512)
    assert len(settings.notes) == 3
    assert tracing_settings({"OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "3000"}
                            ).otlp_timeout_s == 3.0
    assert tracing_settings({"OTEL_BSP_MAX_QUEUE_SIZE": "10"}).batch_size == 10  # a batch is at most the queue


NAMES = st.sampled_from(["OTEL_TRACES_EXPORTER", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
                         "OTEL_EXPORTER_OTLP_TIMEOUT", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
                         "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT"])


@given(st.dictionaries(NAMES, st.text(max_size=80)))
def test_any_environment_gives_usable_settings(env: dict[str, str]) -> None:
    settings = tracing_settings(env)
    assert 0.0 <= settings.ratio <= 1.0
    assert 1 <= settings.batch_size <= settings.queue_size <= MAX_QUEUE_SIZE
    assert all(0 < s <= 600 for s in (settings.otlp_timeout_s, settings.delay_s, settings.export_timeout_s))
    assert all(len(note) < 300 for note in settings.notes)


# -- spans -----------------------------------------------------------------------------------------


def traced(ratio: str = "1") -> tuple[Picker, Tracing]:
    picker = make_picker()
    picker.tracing = new_tracing(tracing_settings({"OTEL_TRACES_SAMPLER_ARG": ratio}), InMemorySpanExporter())
    return picker, picker.tracing


def run(picker: Picker, headers: Sequence[tuple[str, str]] = (), model: str = "plain") -> ep.ProcessingResponse:
    """One request through the gRPC shell's stream (which ends its request span), then its end:
    the reply to its request headers."""
    stream = ext_proc_method(picker, picker_metrics(picker.config)).new_processor()
    assert stream.on_message(request_headers(extra=headers)) == []
    replies = stream.on_message(request_body(json.dumps({"model": model, "prompt": "hi"}).encode()))
    stream.on_end()
    return replies[0]


def finished(tracing: Tracing) -> dict[str, ReadableSpan]:
    return {span.name: span for span in tracing.buffer.spans}


def test_a_routed_request_is_the_references_span_tree_under_the_clients_traceparent() -> None:
    picker, tracing = traced()
    reply = run(picker, [("traceparent", TRACEPARENT), ("x-request-id", "r-7")])
    spans = finished(tracing)
    request, orchestration = spans["gateway.request"], spans["gateway.request_orchestration"]
    assert request.context is not None and request.parent is not None and orchestration.context is not None
    assert (f"{request.context.trace_id:032x}", f"{request.parent.span_id:016x}") == (TRACE_ID, PARENT_ID)
    assert request.parent.is_remote and request.kind is orchestration.kind is SpanKind.SERVER
    span_id = f"{request.context.span_id:016x}"
    assert set_headers(reply.request_headers.response.header_mutation)["traceparent"] == f"00-{TRACE_ID}-{span_id}-01"
    assert dict(orchestration.attributes or {}) == {"target_model": "plain", "request_prio": 0}

    def parent(name: str) -> str:
        context = spans[name].parent
        assert context is not None
        return next(s.name for s in spans.values() if s.context is not None and s.context.span_id == context.span_id)

    scorers = [name for name in spans if name.startswith("llm_d.epp.scorer.")]
    assert parent("gateway.request_orchestration") == "gateway.request"
    assert parent("run_scheduler_profile") == "gateway.request_orchestration"
    assert {parent(name) for name in ("filter_endpoints", "llm_d.epp.scoring", "pick_endpoints")} == {
        "run_scheduler_profile"}
    assert scorers and {parent(name) for name in scorers} == {"llm_d.epp.scoring"}
    assert all(spans[name].kind is SpanKind.INTERNAL for name in ("run_scheduler_profile", *scorers))
    assert spans["run_scheduler_profile"].attributes == {"llm_d.epp.scheduling.profile.name": "default"}
    assert dict(spans["filter_endpoints"].attributes or {}) == {
        "llm_d.epp.filter.candidate_endpoints": 3, "llm_d.epp.filter.filtered_endpoints": 3,
        "gen_ai.request.model": "plain", "gen_ai.request.id": "r-7"}
    scorer = spans["llm_d.epp.scorer.queue-scorer"].attributes or {}
    assert (scorer["llm_d.epp.scorer.type"], scorer["llm_d.epp.scorer.endpoints_scored"]) == ("queue-scorer", 3)
    assert {"llm_d.epp.scorer.weight", "llm_d.epp.scorer.score.max", "llm_d.epp.scorer.score.avg"} <= set(scorer)
    pick = spans["pick_endpoints"].attributes or {}
    scores = list(pick["llm_d.epp.picker.top_scores"])  # type: ignore[arg-type]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3 <= MAX_TRACED_ENDPOINT_SCORES
    assert all(span.status.status_code is StatusCode.UNSET for span in spans.values())


def test_an_answer_of_the_pickers_own_ends_both_spans_in_error() -> None:
    picker, tracing = traced()
    reply = run(picker, model="no-such-model")
    assert reply.immediate_response.status.code == 404
    spans = finished(tracing)
    assert set(spans) == {"gateway.request", "gateway.request_orchestration"}  # no scheduling
    orchestration = spans["gateway.request_orchestration"].status
    assert orchestration.status_code is StatusCode.ERROR and "no-such-model" in (orchestration.description or "")
    assert (spans["gateway.request"].status.status_code, spans["gateway.request"].status.description) == (
        StatusCode.ERROR, "404")


def test_a_protocol_violation_ends_the_request_span_with_its_error() -> None:
    picker, tracing = traced()
    stream = ext_proc_method(picker, picker_metrics(picker.config)).new_processor()
    stream.on_message(request_headers())
    with pytest.raises(Exception, match="second"):
        stream.on_message(request_headers())
    (span,) = tracing.buffer.spans
    assert span.status.status_code is StatusCode.ERROR and "second" in (span.status.description or "")


def test_an_unsampled_request_records_nothing_and_still_carries_its_context() -> None:
    picker, tracing = traced(ratio="0")
    reply = run(picker)
    assert not tracing.buffer.spans
    traceparent = set_headers(reply.request_headers.response.header_mutation)["traceparent"]
    assert not int(traceparent[-2:], 16) & 1  # not sampled
    reply = run(picker, [("traceparent", TRACEPARENT)])  # a sampled parent is followed at any ratio
    assert "gateway.request" in finished(tracing) and len(finished(tracing)) > 2


@pytest.mark.parametrize("traceparent", [
    "garbage",
    f"ff-{TRACE_ID}-{PARENT_ID}-01",  # version ff is invalid
    f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
    f"00-{TRACE_ID}-{'0' * 16}-01",
    f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",
    f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 has nothing after the flags
    f"01-{TRACE_ID}-{PARENT_ID}-01-" + "x" * 600,  # longer than the SDK's 512
])
def test_a_malformed_traceparent_is_a_new_root(traceparent: str, caplog: pytest.LogCaptureFixture) -> None:
    picker, tracing = traced()
    with caplog.at_level(logging.DEBUG):
        run(picker, [("traceparent", traceparent)])
    request = finished(tracing)["gateway.request"]
    assert request.parent is None and request.context is not None and f"{request.context.trace_id:032x}" != TRACE_ID
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_huge_or_malformed_tracestate_and_baggage_cost_no_log_line(caplog: pytest.LogCaptureFixture) -> None:
    picker, _ = traced()
    hostile = [("traceparent", TRACEPARENT), ("tracestate", "k=" + "v" * 10_000), ("baggage", "a=1," * 5000)]
    malformed = [("traceparent", TRACEPARENT), ("tracestate", "\x00bad,=,"), ("baggage", "no-equals,\u00e9=1")]
    with caplog.at_level(logging.DEBUG):
        first = run(picker, hostile)
        second = run(picker, malformed)
    for reply in (first, second):
        sent = set_headers(reply.request_headers.response.header_mutation)
        assert TRACE_ID in sent["traceparent"] and "tracestate" not in sent and "baggage" not in sent
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@given(st.dictionaries(st.sampled_from(["traceparent", "tracestate", "baggage"]), st.text(max_size=700)))
def test_any_trace_headers_give_a_span_and_a_traceparent_upstream(headers: dict[str, str]) -> None:
    tracing = new_tracing(TracingSettings(ratio=1.0), InMemorySpanExporter())
    trace = tracing.request(headers)
    sent = trace.routed(make_picker().new_stream().report)
    assert len(sent["traceparent"]) == 55
    assert all(len(value) <= 8192 for value in sent.values())


@given(trace_id=st.integers(1, 2**128 - 1), ratio=st.floats(0.0, 1.0))
def test_a_new_root_is_sampled_flagged_and_sent_upstream_as_the_sdk_does_it(trace_id: int, ratio: float) -> None:
    # Tracing.request makes an unsampled root itself; the SDK's start_span and propagators, on the
    # same trace id, are the model: the same decision, flags, state and traceparent (but its span id).
    fast, model = (new_tracing(TracingSettings(ratio=ratio), InMemorySpanExporter()) for _ in range(2))
    fast.ids.preset = trace_id  # the id the next root draws
    trace = fast.request({})
    model.ids.preset = trace_id
    sdk = model.handlers.start_span("gateway.request", Context(), SpanKind.SERVER)
    ours, theirs = trace.span.get_span_context(), sdk.get_span_context()
    assert trace.span.is_recording() == sdk.is_recording()
    assert (ours.trace_id, ours.trace_flags, ours.trace_state, ours.is_remote) == (
        theirs.trace_id, theirs.trace_flags, theirs.trace_state, theirs.is_remote)
    sent = trace.routed(make_picker().new_stream().report)
    expected: dict[str, str] = {}
    model.propagator.inject(expected, set_span_in_context(trace.span))
    assert sent == expected and sent["traceparent"].split("-")[1] == f"{trace_id:032x}"


_HEX = "0123456789abcdef"


@given(trace_id=st.text(_HEX, min_size=32, max_size=32), span_id=st.text(_HEX, min_size=16, max_size=16),
       flags=st.sampled_from(["00", "01", "02", "03", "ff"]),
       state=st.sampled_from([None, "vendor=abc", "a=1,b=2", "bad state!", ""]),
       baggage=st.sampled_from([None, "user=42", "k=v,x=y", "=broken"]))
def test_a_span_under_a_traceparent_is_made_and_sent_upstream_as_the_sdk_does_it(
        trace_id: str, span_id: str, flags: str, state: str | None, baggage: str | None) -> None:
    # Under an unsampled parent Tracing.request makes the span itself; the SDK's start_span under the
    # same extracted context is the model (RequestTrace without the fast path).
    assume(int(trace_id, 16) and int(span_id, 16))  # else no parent: a new root, on a random id each
    headers = {"traceparent": f"00-{trace_id}-{span_id}-{flags}"}
    headers |= {"tracestate": state} if state is not None else {}
    headers |= {"baggage": baggage} if baggage is not None else {}
    tracing = new_tracing(TracingSettings(ratio=0.5), InMemorySpanExporter())
    trace, sdk = tracing.request(headers), RequestTrace(tracing, tracing.extract(headers))
    ours, theirs = trace.span.get_span_context(), sdk.span.get_span_context()
    assert trace.span.is_recording() == sdk.span.is_recording()
    assert (ours.trace_id, ours.trace_flags, ours.trace_state, ours.is_remote) == (
        theirs.trace_id, theirs.trace_flags, theirs.trace_state, theirs.is_remote)
    report = make_picker().new_stream().report
    sent, expected = trace.routed(report), sdk.routed(report)
    assert sent.keys() == expected.keys()
    assert {k: v for k, v in sent.items() if k != "traceparent"} == {
        k: v for k, v in expected.items() if k != "traceparent"}
    fields, model_fields = sent["traceparent"].split("-"), expected["traceparent"].split("-")
    assert fields[:2] + fields[3:] == model_fields[:2] + model_fields[3:]  # all but the new span's id


def test_an_unsampled_root_costs_no_sdk_span(monkeypatch: pytest.MonkeyPatch) -> None:
    # Most requests under the reference's 0.1 ratio: the SDK's start_span and propagators cost
    # about 60 Python calls each (python -m benchmarks.picker_calls routing --tracing 0).
    tracing = new_tracing(TracingSettings(ratio=0.0), InMemorySpanExporter())
    monkeypatch.setattr(tracing.handlers, "start_span", None)
    monkeypatch.setattr(tracing.propagator, "inject", None)
    trace = tracing.request({"x-request-id": "r1"})
    trace.orchestrate()
    assert trace.scheduling() is None and not trace.span.is_recording()
    sent = trace.routed(make_picker().new_stream().report)
    assert list(sent) == ["traceparent"] and sent["traceparent"].endswith("-02")  # random id, not sampled
    trace.end(make_picker().new_stream().report)
    assert not tracing.buffer.spans


def test_a_span_under_an_unsampled_parent_costs_no_sdk_span(monkeypatch: pytest.MonkeyPatch) -> None:
    tracing = new_tracing(TracingSettings(ratio=1.0), InMemorySpanExporter())  # the parent decides, not the ratio
    monkeypatch.setattr(tracing.handlers, "start_span", None)
    unsampled = f"00-{TRACE_ID}-{PARENT_ID}-00"
    trace = tracing.request({"traceparent": unsampled, "tracestate": "vendor=abc", "baggage": "user=42"})
    assert not trace.span.is_recording()
    sent = trace.routed(make_picker().new_stream().report)
    assert sent["traceparent"].startswith(f"00-{TRACE_ID}-") and sent["traceparent"].endswith("-00")
    assert sent["traceparent"] != unsampled and (sent["tracestate"], sent["baggage"]) == ("vendor=abc", "user=42")


def test_valid_tracestate_and_baggage_go_upstream() -> None:
    picker, _ = traced()
    reply = run(picker, [("traceparent", TRACEPARENT), ("tracestate", "vendor=abc"), ("baggage", "user=42")])
    sent = set_headers(reply.request_headers.response.header_mutation)
    assert (sent["tracestate"], sent["baggage"]) == ("vendor=abc", "user=42")


def test_without_tracing_a_stream_has_no_trace_and_the_reply_no_traceparent() -> None:
    picker = make_picker()
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=[("traceparent", TRACEPARENT)]))
    reply = stream.on_message(request_body(b'{"model": "plain", "prompt": "hi"}'))[0]
    assert stream.trace is None and picker.scheduler.tracing is None
    assert "traceparent" not in set_headers(reply.request_headers.response.header_mutation)


# -- the span buffer -------------------------------------------------------------------------------


def test_a_full_buffer_drops_and_counts_with_one_warning_an_episode(caplog: pytest.LogCaptureFixture) -> None:
    tracing = new_tracing(TracingSettings(ratio=1.0, queue_size=2, batch_size=2), InMemorySpanExporter())
    buffer: SpanBuffer = tracing.buffer
    batches: list[int] = []
    buffer.on_batch = lambda: batches.append(len(buffer.spans))

    def spans(count: int) -> None:
        for _ in range(count):
            tracing.handlers.start_span("s").end()

    with caplog.at_level(logging.INFO, logger="evergreen_trio.picker.tracing"):
        spans(5)
        assert (len(buffer.spans), buffer.dropped, batches) == (2, 3, [2])
        assert len(buffer.take(1)) == 1  # room again: the episode ends with its count
        spans(3)
        assert buffer.dropped == 5
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "tracing_spans_dropping" in line] == [lines[0], lines[2]]
    assert "picker.tracing_spans_dropped count=3" in lines[1]


# -- the disaggregation handler's spans ------------------------------------------------------------


def test_e_p_d_has_a_pick_disagg_profile_span_per_stage_and_prepare_disaggregation() -> None:
    picker = _epd_picker((FIXTURES / "sim-e-p-d-epp-config.yaml").read_text())
    picker.tracing = new_tracing(TracingSettings(ratio=1.0), InMemorySpanExporter())
    buffer = picker.tracing.buffer
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/chat/completions", extra=[("traceparent", TRACEPARENT)]))
    chat = {"model": "m", **_chat({"type": "text", "text": "describe"}, IMAGE)}
    headers = set_headers(stream.on_message(request_body(json.dumps(chat).encode()))[0]
                          .request_headers.response.header_mutation)
    decisions = [(span.attributes or {})["llm_d.epp.profile_handler.decision"] for span in buffer.spans
                 if span.name == "pick_disagg_profile"]
    assert decisions == ["run_decode", "run_encode", "run_prefill", "complete_encode-prefill-decode"]
    profiles = [(span.attributes or {})["llm_d.epp.scheduling.profile.name"] for span in buffer.spans
                if span.name == "run_scheduler_profile"]
    assert profiles == ["decode", "encode", "prefill"]
    (prepared,) = [span for span in buffer.spans if span.name == "prepare_disaggregation"]
    attributes = prepared.attributes or {}
    host, port = headers[PREFILL_HEADER].rsplit(":", 1)
    assert (attributes["llm_d.epp.pd.prefill_pod_address"], attributes["llm_d.epp.pd.prefill_pod_port"]) == (
        host, port)
    assert attributes["llm_d.epp.encode.endpoints"] == headers[ENCODERS_HEADER]
    assert attributes["llm_d.epp.pd.disaggregation_used"] and attributes["llm_d.epp.encode.disaggregation_used"]
    buffer.spans.clear()
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/chat/completions", extra=[("traceparent", TRACEPARENT)]))
    stream.on_message(request_body(json.dumps({"model": "m", **_chat({"type": "text", "text": "hi"})}).encode()))
    spans = [(span.name, dict(span.attributes or {})) for span in buffer.spans if span.name != "run_scheduler_profile"
             and span.name.startswith(("pick_disagg", "prepare"))]
    assert [attributes.get("llm_d.epp.profile_handler.decision") for _, attributes in spans] == [
        "run_decode", "complete_decode-only", None]
    assert spans[-1][1]["llm_d.epp.pd.reason"] == "no_prefill_profile_result"
    assert spans[-1][1]["llm_d.epp.encode.reason"] == "no_encode_profile_result"


def test_the_precise_prefix_cache_has_its_producer_and_scorer_spans() -> None:
    config = parse_config("""
pool: {name: demo, endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: token-producer, parameters: {modelName: m}}
- {type: precise-prefix-cache-scorer, parameters: {tokenProcessorConfig: {blockSize: 4}}}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise-prefix-cache-scorer}]
""")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    picker = Picker(config, snapshot)
    picker.tracing = new_tracing(TracingSettings(ratio=1.0), InMemorySpanExporter())
    run(picker, model="m")
    spans = finished(picker.tracing)
    ids = {span.context.span_id: name for name, span in spans.items() if span.context is not None}

    def parent(name: str) -> str:
        context = spans[name].parent
        assert context is not None
        return ids[context.span_id]

    assert parent("produce_precise_prefix_cache") == "gateway.request_orchestration"  # before the profiles
    produced = spans["produce_precise_prefix_cache"].attributes or {}
    assert produced["llm_d.epp.producer.candidate_endpoints"] == 2
    assert produced["llm_d.epp.producer.result"] == "skipped_no_tokens"  # the estimate backend has no token ids
    assert parent("score_prefix_cache") == "llm_d.epp.scorer.precise-prefix-cache-scorer"
    assert spans["score_prefix_cache"].instrumentation_scope is not None
    assert spans["score_prefix_cache"].instrumentation_scope.name == "llm-d-router/pkg/epp/framework/plugins/scheduling"


PREFILL_FIRST = """plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: disagg-profile-handler, parameters: {stageOrder: prefill-first}}
schedulingProfiles:
- {name: prefill, plugins: [{pluginRef: prefill-filter}]}
- {name: decode, plugins: [DECODE_FILTERS]}
"""


@pytest.mark.parametrize(("decode_filter", "decisions"), [
    ("decode-filter", ["run_prefill", "run_decode", "complete_prefill-decode"]),
    ("prefill-filter", ["run_prefill", "run_decode", "complete"]),  # the decode profile keeps no decode pod
])
def test_prefill_first_decisions_and_a_failed_decode(decode_filter: str, decisions: list[str]) -> None:
    filters = f"{{pluginRef: {decode_filter}}}, {{pluginRef: decode-filter}}"
    picker = _epd_picker(PREFILL_FIRST.replace("DECODE_FILTERS", filters))
    picker.tracing = new_tracing(TracingSettings(ratio=1.0), InMemorySpanExporter())
    stream = picker.new_stream()
    stream.on_message(request_headers("/v1/chat/completions", extra=[("traceparent", TRACEPARENT)]))
    stream.on_message(request_body(json.dumps({"model": "m", **_chat({"type": "text", "text": "hi"})}).encode()))
    spans = [span for span in picker.tracing.buffer.spans if span.name == "pick_disagg_profile"]
    assert [(span.attributes or {})["llm_d.epp.profile_handler.decision"] for span in spans] == decisions
    assert (spans[-1].attributes or {}).get("llm_d.epp.profile_handler.decode_failed", False) == (
        decisions[-1] == "complete")


def test_a_stream_that_ends_before_its_routing_decision_ends_its_orchestration_in_error() -> None:
    # As when a request waiting in flow control's queue, for a render or for predictions is abandoned.
    tracing = new_tracing(TracingSettings(ratio=1.0), InMemorySpanExporter())
    trace = tracing.request({"traceparent": TRACEPARENT})
    trace.orchestrate()
    report = make_picker().new_stream().report
    trace.end(report)
    trace.end(report)  # once only
    spans = finished(tracing)
    assert len(tracing.buffer.spans) == 2
    orchestration = spans["gateway.request_orchestration"].status
    assert (orchestration.status_code, orchestration.description) == (
        StatusCode.ERROR, "the stream ended before a routing decision")
    assert spans["gateway.request"].status.status_code is StatusCode.UNSET  # no answer of the picker's


def test_the_otlp_exporter_falls_back_to_a_plaintext_local_collector_only_without_transport_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK's exporter keeps where it sends in private fields: read here, as no public API says.
    for name in OTLP_TRANSPORT_ENV:
        monkeypatch.delenv(name, raising=False)
    local = new_exporter(tracing_settings({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_TIMEOUT": "1500"}))
    assert (local._endpoint, local._insecure, local._timeout) == ("localhost:4317", True, 1.5)  # type: ignore[attr-defined]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://collector.example:4317")
    remote = new_exporter(tracing_settings({"OTEL_TRACES_EXPORTER": "otlp", **os.environ}))
    assert (remote._endpoint, remote._insecure) == ("collector.example:4317", False)  # type: ignore[attr-defined]
    for exporter in (local, remote):
        exporter.shutdown()


@given(st.integers(1, 8), st.lists(st.one_of(st.integers(1, 6), st.just(0)), max_size=30))
def test_the_buffer_never_holds_more_than_its_capacity_and_counts_every_drop(capacity: int, steps: list[int]) -> None:
    """Each step: 0 takes a batch, n ends n spans."""
    tracing = new_tracing(TracingSettings(ratio=1.0, queue_size=capacity, batch_size=capacity), InMemorySpanExporter())
    buffer, ended, taken = tracing.buffer, 0, 0
    for step in steps:
        if step:
            for _ in range(step):
                tracing.handlers.start_span("s").end()
            ended += step
        else:
            taken += len(buffer.take(capacity))
        assert len(buffer.spans) <= capacity
        assert ended == taken + len(buffer.spans) + buffer.dropped
