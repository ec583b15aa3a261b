"""OpenTelemetry tracing of the picker's requests (``--tracing``), as llm-d-router's spans.

Imported only when ``--tracing`` is on (it needs the ``tracing`` extra). :func:`new_tracing` builds
the tracer provider as the reference's ``InitTracing`` does (resource, parent-based ratio sampler,
W3C TraceContext + Baggage propagators); finished spans go to a :class:`SpanBuffer`, which the Trio
task of :mod:`evergreen_trio.picker.tracing_export` empties through the SDK's exporter. No Trio and
no I/O here but the SDK exporter's: :func:`new_exporter` builds it (an OTLP gRPC channel or stdout)
and :meth:`Tracing.export` calls it, which the export task does in a worker thread.

Each ext_proc stream has a :class:`RequestTrace`: ``gateway.request`` (a server span, child of the
client's ``traceparent`` when it carries a valid one) and under it ``gateway.request_orchestration``,
under which the scheduler's spans nest (:class:`Tracing`'s span stack: scheduling runs without a
pause, so one stack serves every stream). The stream's routing reply carries the request span's
context upstream (``traceparent``, ``tracestate``, ``baggage``), as the reference's does.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from evergreen_trio._extras import require_extra

require_extra("tracing", "picker tracing (--tracing)")

from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    get_current_span,
    set_span_in_context,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from evergreen_trio import __version__
from evergreen_trio.errors import ConfigurationError
from evergreen_trio.picker.tracing_env import LOCAL_COLLECTOR, SERVICE_NAME, TracingSettings

if TYPE_CHECKING:
    from evergreen_trio.picker.precise_prefix import PrecisePrefixCache
    from evergreen_trio.picker.processor import StreamReport
    from evergreen_trio.picker.routing_headers import DisaggHeaders
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest

log = logging.getLogger(__name__)

SCHEMA_URL = "https://opentelemetry.io/schemas/1.37.0"
"""The semantic conventions the reference's resource names (``semconv/v1.37.0``)."""
HANDLERS_SCOPE = "llm-d-router/pkg/epp/handlers"
REQUEST_CONTROL_SCOPE = "llm-d-router/pkg/epp/requestcontrol"
SCHEDULING_SCOPE = "llm-d-router/pkg/epp/scheduling"
SCHEDULING_PLUGINS_SCOPE = "llm-d-router/pkg/epp/framework/plugins/scheduling"
REQUEST_CONTROL_PLUGINS_SCOPE = "llm-d-router/pkg/epp/framework/plugins/requestcontrol"
DISAGG_DECISIONS = {(False, False): "decode-only", (False, True): "prefill-decode", (True, False): "encode-decode",
                    (True, True): "encode-prefill-decode"}
"""The disaggregation handler's decision by (encode used, prefill used), as its metric and span name it."""
TRACE_HEADERS = {"traceparent": 512, "tracestate": 8192, "baggage": 8192}
"""The request headers the propagators read, each with the longest value handed to them (the SDK's
own limits: a longer one is dropped here, before the SDK would log the client's text)."""
MAX_TRACED_ENDPOINT_SCORES = 5
"""The highest-scoring endpoints recorded on ``pick_endpoints`` (the reference's bound)."""
REQUEST_ID_HEADER = "x-request-id"
# The SDK's propagators log a warning, with the client's text, for each malformed trace header
# member: a client could fill the log. A malformed header only means a new root span here.
_PEER_INPUT_LOGGERS = ("opentelemetry.trace.span", "opentelemetry.baggage.propagation",
                       "opentelemetry.trace.propagation.tracecontext")
_OTLP_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class SpanBuffer(SpanProcessor):
    """Finished sampled spans, held until the export task takes them (no thread of the SDK's).

    At ``capacity`` a span is dropped and counted: one warning when an episode of drops starts,
    one line with the count when the export task makes room again. ``on_batch`` (set by the export
    task) is called when a full batch is waiting.
    """

    def __init__(self, capacity: int, batch_size: int) -> None:
        self.spans: deque[ReadableSpan] = deque()
        self.capacity, self.batch_size = capacity, batch_size
        self.dropped = 0
        """Spans dropped since the start (the buffer was full)."""
        self.dropping = 0
        """Spans dropped in the current episode (0: none is going on)."""
        self.on_batch: Callable[[], None] | None = None

    def on_start(self, span: object, parent_context: Context | None = None) -> None:
        return None

    def on_end(self, span: ReadableSpan) -> None:
        spans = self.spans
        if len(spans) >= self.capacity:
            if not self.dropping:
                log.warning("picker.tracing_spans_dropping capacity=%d: the exporter is behind, finished spans "
                            "are dropped until it catches up", self.capacity)
            self.dropped += 1
            self.dropping += 1
            return
        spans.append(span)
        if len(spans) == self.batch_size and self.on_batch is not None:
            self.on_batch()

    def take(self, limit: int) -> list[ReadableSpan]:
        """Up to ``limit`` spans, oldest first (this ends an episode of drops)."""
        spans = self.spans
        batch = [spans.popleft() for _ in range(min(limit, len(spans)))]
        if self.dropping and batch:
            log.info("picker.tracing_spans_dropped count=%d", self.dropping)
            self.dropping = 0
        return batch

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class ExporterLog(logging.Filter):
    """Keeps the OTLP exporter's last warning or error instead of logging it: the export task says
    one line per failing episode, with this as the reason (the SDK logs each failed batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.last = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.last = record.getMessage()[:300]
        return False


_UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
_UNSAMPLED_RANDOM = TraceFlags(TraceFlags.DEFAULT | TraceFlags.RANDOM_TRACE_ID)
"""The flags of a span the SDK does not sample, without and with the random-trace-id flag."""


class _PresetIds(RandomIdGenerator):
    """The SDK's random ids, but the trace id :meth:`Tracing.request` drew for a root it found
    sampled: the SDK's sampler then decides on that same id, and samples it too."""

    preset = 0  # 0: none (never a valid trace id)

    def generate_trace_id(self) -> int:
        trace_id, self.preset = self.preset, 0
        return trace_id or super().generate_trace_id()


class Tracing:
    """The tracer provider, its tracers by the reference's scopes, the propagator, the span buffer
    and the scheduler's span stack. ``new_tracing`` builds one from the environment."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter, resource: Resource) -> None:
        self.settings, self.exporter = settings, exporter
        self.buffer = SpanBuffer(settings.queue_size, settings.batch_size)
        self.exporter_log = ExporterLog()
        self.ids = _PresetIds()
        self.ratio = TraceIdRatioBased(settings.ratio)
        self.provider = TracerProvider(sampler=ParentBased(self.ratio), resource=resource, id_generator=self.ids,
                                       shutdown_on_exit=False)
        # An unsampled root's flags, as the SDK sets them for this id generator's trace ids.
        self.unsampled_flags = _UNSAMPLED_RANDOM if self.ids.is_trace_id_random() else _UNSAMPLED
        self.provider.add_span_processor(self.buffer)
        tracer = self.provider.get_tracer
        self.handlers: Tracer = tracer(HANDLERS_SCOPE, __version__)
        self.request_control: Tracer = tracer(REQUEST_CONTROL_SCOPE, __version__)
        self.scheduling: Tracer = tracer(SCHEDULING_SCOPE, __version__)
        self.scheduling_plugins: Tracer = tracer(SCHEDULING_PLUGINS_SCOPE, __version__)
        self.request_control_plugins: Tracer = tracer(REQUEST_CONTROL_PLUGINS_SCOPE, __version__)
        self.propagator = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
        self._base = Context()  # the scheduler's spans' parent: the request's orchestration
        self._stack: list[Span] = []
        self._profiles: list[int] = []  # the stack depth of each open run_scheduler_profile

    def export(self, batch: Sequence[ReadableSpan]) -> bool:
        """Export ``batch`` through the SDK's exporter (blocking: the export task's worker thread runs it)."""
        return self.exporter.export(batch) is SpanExportResult.SUCCESS

    def request(self, headers: Mapping[str, str]) -> RequestTrace:
        """A stream's trace: its ``gateway.request`` span, started now under the request's
        ``traceparent`` (a new root when it has none, or a malformed one).

        A span that will not be sampled (most of them) is made here as the SDK's ``start_span``
        would make it (``test_tracing_spans`` compares the two): that call and the propagators cost
        some 60 Python calls a request for a span that records nothing. Under an unsampled
        ``traceparent`` the parent-based sampler drops it: the parent's trace id, state and random
        flag, a new span id. A new root takes its trace id from the SDK's id generator and the
        ratio's decision on it; a sampled one goes to the SDK with that id. A sampled parent, or
        baggage alone, goes to the SDK."""
        parent = self.extract(headers)
        if parent:
            remote = get_current_span(parent).get_span_context()
            if not remote.is_valid or remote.trace_flags.sampled:
                return RequestTrace(self, parent)
            flags = _UNSAMPLED_RANDOM if remote.trace_flags.random_trace_id else _UNSAMPLED
            return RequestTrace(self, parent, SpanContext(remote.trace_id, self.ids.generate_span_id(), False, flags,
                                                          remote.trace_state))
        trace_id = self.ids.generate_trace_id()
        if trace_id & TraceIdRatioBased.TRACE_ID_LIMIT < self.ratio.bound:
            self.ids.preset = trace_id
            trace = RequestTrace(self, parent)
            self.ids.preset = 0  # taken, unless the SDK made no span: never another root's id
            return trace
        return RequestTrace(self, parent, SpanContext(trace_id, self.ids.generate_span_id(), False,
                                                      self.unsampled_flags))

    def extract(self, headers: Mapping[str, str]) -> Context:
        """The trace context (span context and baggage) of ``headers`` (lower-case names)."""
        carrier = {name: value for name, limit in TRACE_HEADERS.items()
                   if (value := headers.get(name)) is not None and len(value) <= limit}
        return self.propagator.extract(carrier, Context()) if carrier else Context()

    # -- the scheduler's spans (SCHEDULING_SCOPE), nested by the stack ---------------------------------

    def begin_scheduling(self, parent: Span) -> None:
        """The next pick's spans nest under ``parent`` (spans left open by a failed pick end now)."""
        self.end_open_spans()
        self._base = set_span_in_context(parent)

    def end_open_spans(self) -> None:
        while self._stack:
            self._stack.pop().end()
        self._profiles.clear()

    def _push(self, name: str, attributes: Mapping[str, str | int | float | bool], tracer: Tracer | None = None,
              ) -> Span:
        parent = set_span_in_context(self._stack[-1]) if self._stack else self._base
        span = (tracer or self.scheduling).start_span(name, parent, SpanKind.INTERNAL, attributes)
        self._stack.append(span)
        return span

    def _pop(self, attributes: Mapping[str, str | int | float | bool] | None = None) -> None:
        if self._stack:
            span = self._stack.pop()
            if attributes:
                span.set_attributes(attributes)
            span.end()

    def profile_started(self, profile: str, request: PickRequest, candidates: int) -> None:
        """``run_scheduler_profile``, and under it ``filter_endpoints`` (ended by :meth:`filtered`)."""
        self._profiles.append(len(self._stack))
        self._push("run_scheduler_profile", {"llm_d.epp.scheduling.profile.name": profile})
        self._push("filter_endpoints", {"llm_d.epp.filter.candidate_endpoints": candidates,
                                        **request_attributes(request)})

    def filtered(self, kept: int) -> None:
        self._pop({"llm_d.epp.filter.filtered_endpoints": kept})

    def scoring_started(self, request: PickRequest, scorers: int, candidates: int) -> None:
        self._push("llm_d.epp.scoring", {"llm_d.epp.scorer.count": scorers,
                                         "llm_d.epp.scoring.candidate_endpoints": candidates,
                                         **request_attributes(request)})

    def scorer_started(self, request: PickRequest, candidates: int, scorer_type: str = "", scorer: str = "",
                       weight: float = 0.0, *, name: str = "") -> None:
        """``llm_d.epp.scorer.<type>`` (the scheduler's, with the scorer's type, name and weight), or a
        scorer plugin's own span ``name`` (with the request's attributes), ended by :meth:`scorer_ended`."""
        if name:
            self._push(name, {"llm_d.epp.scorer.candidate_endpoints": candidates, **request_attributes(request)},
                       self.scheduling_plugins)
            return
        self._push("llm_d.epp.scorer." + scorer_type, {
            "llm_d.epp.scorer.type": scorer_type, "llm_d.epp.scorer.name": scorer,
            "llm_d.epp.scorer.weight": float(weight), "llm_d.epp.scorer.candidate_endpoints": candidates})

    def scorer_ended(self, scores: Mapping[str, float]) -> None:
        """The scorer's span, with its scores' max, mean and count (no per-endpoint keys)."""
        values = list(scores.values())
        self._pop({"llm_d.epp.scorer.score.max": max(values),
                   "llm_d.epp.scorer.score.avg": sum(values) / len(values),
                   "llm_d.epp.scorer.endpoints_scored": len(values)} if values else None)

    def scoring_ended(self) -> None:
        self._pop()

    def picking(self, request: PickRequest, scores: Mapping[str, float]) -> None:
        """``pick_endpoints`` over the weighted ``scores``, with the best few (ended by :meth:`profile_ended`)."""
        span = self._push("pick_endpoints", {"llm_d.epp.picker.candidate_endpoints": len(scores)})
        if span.is_recording() and scores:
            ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:MAX_TRACED_ENDPOINT_SCORES]
            span.set_attributes({"llm_d.epp.picker.top_endpoints": [name for name, _ in ranked],
                                 "llm_d.epp.picker.top_scores": [score for _, score in ranked],
                                 **request_attributes(request)})

    def profile_ended(self) -> None:
        """End the profile's open spans and ``run_scheduler_profile``."""
        depth = self._profiles.pop() if self._profiles else 0
        while len(self._stack) > depth:
            self._pop()

    # -- plugins' own spans ------------------------------------------------------------------------------

    def produced_precise_prefix(self, request: PickRequest, caches: Iterable[PrecisePrefixCache],
                                candidates: Sequence[EndpointState], now: float) -> None:
        """A ``produce_precise_prefix_cache`` span per precise producer: its lookup of the request's
        blocks (done here, before the profiles, as the reference's producer; the scorers reuse it)."""
        for cache in caches:
            span = self._push("produce_precise_prefix_cache", {
                "llm_d.epp.producer.candidate_endpoints": len(candidates), **request_attributes(request)},
                self.request_control_plugins)
            found = cache.match(request, now)
            if not found.keys:
                span.set_attribute("llm_d.epp.producer.result", "skipped_no_tokens")
            else:
                span.set_attributes({"llm_d.epp.producer.total_blocks": found.total,
                                     "llm_d.epp.producer.max_match_blocks": max(
                                         int(found.matched.get(s.endpoint.address, 0.0)) for s in candidates)})
            self._pop()

    # -- the disaggregation handler's (SCHEDULING_PLUGINS_SCOPE) ---------------------------------------

    def disagg_decision(self, request: PickRequest, decision: str, *, decode_failed: bool = False) -> None:
        """A ``pick_disagg_profile`` span: the handler chose ``decision`` (the reference's handler is
        asked again after each profile; each answer is a span, and skipped stages its attribute's
        earlier values, which the last one overwrites)."""
        attributes: dict[str, str | int | float | bool] = {
            "llm_d.epp.profile_handler.decision": decision, **request_attributes(request)}
        if decode_failed:
            attributes["llm_d.epp.profile_handler.decode_failed"] = True
        self._push("pick_disagg_profile", attributes, self.scheduling_plugins)
        self._pop()

    def disagg_completed(self, request: PickRequest, encode_used: bool, prefill_used: bool) -> None:
        self.disagg_decision(request, "complete_" + DISAGG_DECISIONS[encode_used, prefill_used])

    def prepared_disaggregation(self, request: PickRequest, setter: DisaggHeaders,
                                profiles: Mapping[str, Sequence[str]]) -> None:
        """A ``prepare_disaggregation`` span: whether the P/D and E/PD headers were set, and to what."""
        attributes: dict[str, str | int | float | bool] = dict(request_attributes(request))
        prefill = profiles.get(setter.prefill_profile)
        attributes["llm_d.epp.pd.disaggregation_used"] = bool(prefill)
        if prefill:
            host, _, port = prefill[0].rpartition(":")
            attributes["llm_d.epp.pd.prefill_pod_address"] = host.strip("[]")
            attributes["llm_d.epp.pd.prefill_pod_port"] = port
        else:  # a profile whose filters kept none has no result, as the reference's failed run
            attributes["llm_d.epp.pd.reason"] = "no_prefill_profile_result"
        encoders = profiles.get(setter.encode_profile)
        attributes["llm_d.epp.encode.disaggregation_used"] = bool(encoders)
        if encoders:
            attributes["llm_d.epp.encode.endpoints"] = ",".join(encoders)
        else:
            attributes["llm_d.epp.encode.reason"] = "no_encode_profile_result"
        self._push("prepare_disaggregation", attributes, self.scheduling_plugins)
        self._pop()


def request_attributes(request: PickRequest) -> dict[str, str]:
    """``gen_ai.request.model`` and ``gen_ai.request.id`` (``x-request-id``), those the request has."""
    attributes = {}
    if request.model:
        attributes["gen_ai.request.model"] = request.model
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id:
        attributes["gen_ai.request.id"] = request_id
    return attributes


class RequestTrace:
    """One stream's spans: ``gateway.request`` from its request headers to its end, and
    ``gateway.request_orchestration`` from its admission to its routing decision or answer."""

    __slots__ = ("context", "orchestration", "span", "tracing", "unsampled_root")

    def __init__(self, tracing: Tracing, parent: Context, unsampled: SpanContext | None = None) -> None:
        """``unsampled``: the span's context, when :meth:`Tracing.request` found it unsampled."""
        self.tracing = tracing
        if unsampled is None:
            self.span: Span = tracing.handlers.start_span("gateway.request", parent, SpanKind.SERVER)
        else:
            self.span = NonRecordingSpan(unsampled)
        # A new root (no parent, no baggage) sends its traceparent alone: formatted at routing.
        self.unsampled_root = unsampled if unsampled is not None and not parent else None
        self.context = parent if self.unsampled_root is not None else set_span_in_context(self.span, parent)
        self.orchestration: Span | None = None

    def orchestrate(self) -> None:
        """The request's body is in: ``gateway.request_orchestration`` starts (when the request is
        sampled: a child of an unsampled span never is, under the parent-based sampler)."""
        if self.span.is_recording():
            self.orchestration = self.tracing.request_control.start_span(
                "gateway.request_orchestration", self.context, SpanKind.SERVER)

    def scheduling(self) -> Tracing | None:
        """The scheduler runs now: what records its spans, under the orchestration (None when the
        request is not sampled)."""
        if self.orchestration is None:
            return None
        self.tracing.begin_scheduling(self.orchestration)
        return self.tracing

    def routed(self, report: StreamReport) -> dict[str, str]:
        """The request goes upstream: the orchestration ends; the headers that carry the request
        span's context there (``traceparent``, ``tracestate``, ``baggage``)."""
        root = self.unsampled_root
        if root is not None:  # what the propagators write for it: no state, no baggage
            headers = {"traceparent": f"00-{root.trace_id:032x}-{root.span_id:016x}-{root.trace_flags:02x}"}
        else:
            headers = {}
            self.tracing.propagator.inject(headers, self.context)
        self._orchestrated(report, None)
        return headers

    def answered(self, report: StreamReport, message: str) -> None:
        """The picker answered the request itself (``message``): the orchestration ends in error."""
        self._orchestrated(report, message)

    def _orchestrated(self, report: StreamReport, error: str | None) -> None:
        span, self.orchestration = self.orchestration, None
        self.tracing.end_open_spans()
        if span is None:
            return
        span.set_attributes({"target_model": report.target_model, "request_prio": report.priority})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def end(self, report: StreamReport, error: str | None = None) -> None:
        """The stream is over: ``gateway.request`` ends, in error when the picker answered with an
        HTTP error or ``error`` (a protocol violation) ended it. Idempotent."""
        if self.orchestration is not None:
            self._orchestrated(report, error or "the stream ended before a routing decision")
        span = self.span
        if not span.is_recording():
            return
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        elif report.error is not None:
            span.set_status(Status(StatusCode.ERROR, str(report.error)))
        span.end()


def new_exporter(settings: TracingSettings) -> SpanExporter:
    """The SDK's exporter ``settings`` name: OTLP over gRPC (its ``OTEL_EXPORTER_OTLP_*`` variables;
    none of the transport ones set: plaintext to ``localhost:4317``), else the console's (stdout, one
    pretty JSON object per span). ConfigurationError, in one line, when the SDK refuses its variables."""
    if settings.exporter != "otlp":
        return ConsoleSpanExporter(out=sys.stdout)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    try:
        if settings.local_collector:
            return OTLPSpanExporter(endpoint=LOCAL_COLLECTOR, insecure=True, timeout=settings.otlp_timeout_s)
        return OTLPSpanExporter(timeout=settings.otlp_timeout_s)
    except Exception as exc:  # the SDK raises what its parsing raises (ValueError, KeyError, OSError, ...)
        raise ConfigurationError(f"--tracing: the OTLP exporter refuses its OTEL_EXPORTER_OTLP_* settings: "
                                 f"{type(exc).__name__}: {str(exc)[:200]}") from None


def new_resource() -> Resource:
    """``service.name`` llm-d-epp and ``service.version``, under ``OTEL_RESOURCE_ATTRIBUTES`` and
    ``OTEL_SERVICE_NAME`` (they win); the SDK's defaults (``telemetry.sdk.*``) are not merged in,
    as the reference's are not."""
    return Resource({"service.name": SERVICE_NAME, "service.version": __version__}, SCHEMA_URL).merge(
        OTELResourceDetector().detect())


def new_tracing(settings: TracingSettings, exporter: SpanExporter | None = None) -> Tracing:
    """The picker's tracing: ``settings`` (their notes logged, one line each), ``exporter`` (default:
    :func:`new_exporter`'s) and :func:`new_resource`'s resource."""
    for note in settings.notes:
        log.warning("picker.tracing_setting %s", note)
    for name in _PEER_INPUT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    tracing = Tracing(settings, exporter if exporter is not None else new_exporter(settings), new_resource())
    exporter_logger = logging.getLogger(_OTLP_LOGGER)
    for earlier in [f for f in exporter_logger.filters if isinstance(f, ExporterLog)]:
        exporter_logger.removeFilter(earlier)  # the SDK's logger is global: one picker's tracing holds it
    exporter_logger.addFilter(tracing.exporter_log)
    log.info("picker.tracing exporter=%s sampler=parentbased_traceidratio ratio=%g", settings.exporter,
             settings.ratio)
    return tracing

