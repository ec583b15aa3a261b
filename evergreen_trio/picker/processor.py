"""The ext_proc side of the picker, sans-IO: :class:`Picker` decides, :class:`ExtProcStream` speaks.

One :class:`ExtProcStream` serves one Envoy ``Process`` stream (one HTTP request): Envoy's
``ProcessingRequest`` messages go in through :meth:`ExtProcStream.on_message`, the
``ProcessingResponse`` messages to send come out. Body modes follow the first message's
``protocol_config``: BUFFERED answers each message as it comes; FULL_DUPLEX_STREAMED holds the
request headers until the body ends, then sends the header response (destination, metadata,
corrected Content-Length) and the body again in chunks of at most 62,000 bytes.

Nothing here records metrics: each stream fills a :class:`StreamReport` (models, error,
sizes, scheduling time, prefix match, served endpoint, token usage) and the shell records it.
When the response ends, the ``request-attribute-reporter`` plugins' numbers ride on the last reply
as dynamic metadata (:mod:`evergreen_trio.picker.attribute_reporter`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from evergreen_trio.picker.attribute_reporter import attribute_reporters, report
from evergreen_trio.picker.attributes import AttributeKey, fairness_label, flow_fairness_id, request_attributes
from evergreen_trio.picker.burst_prefix import BurstEntry, BurstWindow, Replica, burst_producers
from evergreen_trio.picker.config import DestinationMode, PickerConfig
from evergreen_trio.picker.errors import ExtProcError, RequestError
from evergreen_trio.picker.flow_control.eviction import EVICTED_MESSAGE, EVICTED_REASON, EVICTED_STATUS
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.flow_control.key import (
    DEFAULT_FAIRNESS_ID,
    FAIRNESS_HEADERS,
    OBJECTIVE_HEADERS,
    objective_name,
)
from evergreen_trio.picker.flow_control.queue import DROPPED_REASON, Outcome, QueueItem
from evergreen_trio.picker.flow_control.queue import message as outcome_message
from evergreen_trio.picker.guards import rewrite_allowed
from evergreen_trio.picker.inflight import Ticket
from evergreen_trio.picker.latency import LatencyRequest, PredictedLatency, StartPredict
from evergreen_trio.picker.latency_wire import Prediction
from evergreen_trio.picker.mm_cache import MM_PRODUCER, MediaCache, encoder_match, media_items
from evergreen_trio.picker.parsers import DEFAULT_REGISTRY
from evergreen_trio.picker.parsers.registry import request_path
from evergreen_trio.picker.prefix_hash import block_hashes
from evergreen_trio.picker.request import Api, rewrite_model
from evergreen_trio.picker.routing_headers import PREFILL_HEADER, ROUTING_HEADERS
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler, choose_target
from evergreen_trio.picker.served_verifier import (
    DESTINATION_ENDPOINT_SERVED_VERIFIER,
    SERVED_ENDPOINT_HEADER,
    served_verdict,
)
from evergreen_trio.picker.token_estimate import TokenizedPrompt
from evergreen_trio.picker.token_ids import BYTES_PER_TOKEN
from evergreen_trio.picker.token_producer import DEFAULT_PRODUCER, request_producer, tokenize
from evergreen_trio.picker.usage import OPENAI_RESPONSES, ResponseBody, ResponseFormat, Usage
from evergreen_trio.picker.vllm_render import RenderCall

if TYPE_CHECKING:  # the `tracing` extra, imported only with --tracing
    from evergreen_trio.picker.tracing import RequestTrace, Tracing

DESTINATION = "x-gateway-destination-endpoint"
FALLBACK = "x-gateway-destination-endpoint-fallback"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
SCORES = "x-gateway-destination-endpoint-scores"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
MODEL_REWRITE = "x-gateway-model-name-rewrite"
# P/D: the prefill pod (ip:port) for llm-d's routing sidecar beside the decode pod.
PREFILLER = PREFILL_HEADER
# Client-supplied routing headers never go upstream; DESTINATION is always overwritten instead.
STRIPPED_HEADERS = (*OBJECTIVE_HEADERS, *FAIRNESS_HEADERS, MODEL_REWRITE, FALLBACK, SERVED, SUBSET, *ROUTING_HEADERS)
# Most requests carry none of these: one set test says so (a lookup per name otherwise).
_STRIPPED = frozenset(STRIPPED_HEADERS)
_OBJECTIVES = frozenset(OBJECTIVE_HEADERS)

_Mode = processing_mode_pb2.ProcessingMode
NONE, BUFFERED, BUFFERED_PARTIAL = _Mode.NONE, _Mode.BUFFERED, _Mode.BUFFERED_PARTIAL
FULL_DUPLEX = _Mode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_JSON_HEADERS = ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
    header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"), append_action=_OVERWRITE)])


class GapObserver(Protocol):
    """Where a streaming response's chunk gaps go (a histogram series)."""

    def observe(self, amount: float) -> None: ...


@dataclass
class StreamReport:
    """What one ext_proc stream did, filled as it goes; the shell turns it into metrics.

    ``routed`` turns true when a request was sent to an endpoint (it is then running until the
    stream ends); ``error`` is the HTTP status of an answer the picker gave itself. Times are on
    the pool snapshot's clock, from when the request headers came: ``processing_s`` until the
    request was answered or sent on, ``ttft_s`` until the first response byte;
    ``response_processing_s`` is the picker's own time on the response (llm-d-router's measure).
    ``itl`` is told the gap between consecutive chunks of a streaming response (the shell sets it).
    """

    client_model: str = ""
    target_model: str = ""
    fairness_id: str = DEFAULT_FAIRNESS_ID
    priority: int = 0
    streaming: bool = False  # the request asked for a stream, or the response is server-sent events
    routed: bool = False
    scheduled: bool | None = None  # the scheduler ran: whether it found an endpoint
    endpoint: str = ""  # the first endpoint it picked
    rewrite: str | None = None  # the weighted model rewrite (a configured model's name) that chose the target
    error: int | None = None
    request_bytes: int = 0
    response_bytes: int = 0
    scheduling_s: float | None = None
    scorer_s: dict[str, float] = field(default_factory=dict)
    prefix_match: tuple[int, int] | None = None  # (matched bytes, prompt bytes in full blocks)
    served: list[str] = field(default_factory=list)
    usage: Usage | None = None
    processing_s: float | None = None
    ttft_s: float | None = None
    response_processing_s: float = 0.0
    itl: GapObserver | None = None
    recorded: bool = False  # set by the shell once it has recorded this report


@dataclass
class Route:
    """A routing decision: endpoints best first, the model names, the prompt hashes, a new body,
    the prefill endpoint when P/D disaggregates the request, the scores to report (with
    ``emit_endpoint_scores``), and the headers plugins set on the response (session affinity's
    token) and on the request (the routing sidecar's)."""

    endpoints: list[str]
    client_model: str | None = None
    target_model: str | None = None
    hashes: Sequence[int] = ()
    body: bytes | None = None
    served: list[str] = field(default_factory=list)
    prefill: str | None = None
    load: Ticket | None = None  # its share of the endpoint's in-flight load, released once
    prefill_load: Ticket | None = None  # the prefill pod's, released at the first response chunk
    scores: Mapping[str, float] = field(default_factory=dict)
    response_headers: Mapping[str, str] = field(default_factory=dict)
    request_headers: Mapping[str, str] = field(default_factory=dict)
    skip_response: bool = False  # the parser's: end the stream once routed
    response: ResponseFormat = OPENAI_RESPONSES  # the parser's: how the response's usage is read
    latency: Mapping[str, LatencyRequest] = field(default_factory=dict)  # the latency producers' contexts


@dataclass
class Admission:
    """A parsed request waiting for its pick: model names, priority, flow key, prompt estimates,
    and its headers and request attributes (for the plugins that read them)."""

    started: float
    subset: frozenset[str] | None = None
    fairness_id: str = DEFAULT_FAIRNESS_ID
    byte_size: int = 0
    client_model: str | None = None
    target_model: str | None = None
    priority: int = 0
    stream: bool = False
    rewrite: str | None = None
    hashes: Sequence[int] = ()
    body: bytes | None = None
    prompt_bytes: int = 0
    block_tokens: int = 0
    output_cap: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    attributes: Mapping[AttributeKey, str] = field(default_factory=dict)
    media: tuple[bytes, ...] = ()
    skip_response: bool = False
    response: ResponseFormat = OPENAI_RESPONSES
    burst_hashes: Sequence[int] = ()  # the prompt's blocks at the burst producer's block size
    tokens: TokenizedPrompt | None = None
    render: RenderCall | None = None
    """The vllm token backend's render to post before the pick (its reply gives ``tokens``)."""
    request_body: Mapping[str, Any] = field(default_factory=dict)
    latency: Mapping[str, LatencyRequest] | None = None
    """Each ``predicted-latency-producer``'s context, once it began (before the pick)."""


NO_LATENCY: Mapping[str, LatencyRequest] = {}
"""The latency contexts of a request no ``predicted-latency-producer`` saw (shared, never changed)."""

StartRender = Callable[[RenderCall, Mapping[str, Any], Callable[[TokenizedPrompt | None], None]], None]
"""Starts a render (the runtime's task), which calls back with its tokens (None: it failed)."""


class Picker:
    """Shared by every stream of one picker: config, the metrics snapshot and the scheduler."""

    def __init__(self, config: PickerConfig, snapshot: PoolSnapshot, *, rng: random.Random | None = None) -> None:
        self.config = config
        self.snapshot = snapshot
        self.rng = rng or random.Random()
        self.scheduler = Scheduler(config, snapshot, self.rng)
        self.parsers = config.epp.parsers if config.epp is not None else DEFAULT_REGISTRY
        self.plugins = tuple(config.epp.plugins.values()) if config.epp is not None else ()
        self.reporters = attribute_reporters(self.plugins)
        self.tokens = request_producer(config.epp.plugins if config.epp is not None else {}, config.scheduler.handler)
        self.start_render: StartRender | None = None  # set by the runtime for the vllm token backend
        self.latency = {name: state for name, state in self.scheduler.plugin_states.items()
                        if isinstance(state, PredictedLatency)}
        for name, producer in self.latency.items():
            producer.name = name
            producer.metrics_of = snapshot.metrics_of
        self.start_predict: StartPredict | None = None  # set by the runtime when a latency producer runs
        self.verifies_served = any(p.type == DESTINATION_ENDPOINT_SERVED_VERIFIER for p in self.plugins)
        self.reads_media = any(p.type == MM_PRODUCER for p in self.plugins)
        self.flow = FlowGate(config.flow_control, snapshot, self.scheduler.inflight,
                             refresh_interval_s=config.pool.refresh_interval_s) if config.flow_control else None
        # InferenceObjective name -> priority: the config's, and in cluster mode the watched CRDs' over them.
        self.objectives: Mapping[str, int] = dict(config.objectives)
        if self.flow is not None:
            self.flow.provision(self.objectives.values())
        mode = config.ext_proc.destination_mode
        self.pick_count = {DestinationMode.SINGLE: 1, DestinationMode.FALLBACK: 2}.get(
            mode, config.ext_proc.max_endpoints_in_list)
        # burst-prefix-cache-producer: requests wait for its window to seal (the shell seals it on time).
        bursts = burst_producers(config.epp.plugins) if config.epp is not None else {}
        self.burst = next((BurstWindow(name, params, time.monotonic) for name, params in bursts.items()), None)
        self.hashes_prompts = config.scheduler.uses_prefix or self.burst is not None
        # A plain routing reply's bytes by (phase, destination, fallback): parsing them back is
        # several times cheaper than building the message field by field (see ExtProcStream._decision).
        self.plain_decisions: dict[tuple[str, str, str | None], bytes] = {}
        self.tracing: Tracing | None = None  # set by the runtime with --tracing

    def set_cluster_objectives(self, objectives: Mapping[str, int]) -> None:
        """The InferenceObjectives watched in the cluster (they win over the config's of the same name)."""
        self.objectives = {**self.config.objectives, **objectives}
        if self.flow is not None:
            self.flow.provision(self.objectives.values())

    def new_stream(self) -> ExtProcStream:
        """The sans-IO state of one ext_proc stream (one HTTP request through Envoy)."""
        return ExtProcStream(self)

    def route(self, path: str, headers: Mapping[str, str], body: bytes | None,
              subset: frozenset[str] | None, report: StreamReport | None = None) -> Route:
        """Decide where a request to ``path`` goes, noting it in ``report``; RequestError for
        400/404/429/500/503."""
        report = report if report is not None else StreamReport()
        return self.pick(self.admit(path, headers, body, subset, report), report)

    def admit(self, path: str, headers: Mapping[str, str], body: bytes | None,
              subset: frozenset[str] | None, report: StreamReport) -> Admission:
        """Read what scheduling needs from the request (its flow key too); RequestError for 400/404."""
        started = time.perf_counter()
        admission = Admission(started=started, subset=subset, byte_size=len(body) if body is not None else 0,
                              headers=headers)
        try:
            if self.plugins:  # else none: Admission's own empty map
                admission.attributes = request_attributes(self.plugins, headers)
            if self.flow is not None:
                admission.fairness_id = flow_fairness_id(headers, admission.attributes)
            else:  # only a metric label then: never a reason to refuse the request
                admission.fairness_id = fairness_label(headers, admission.attributes)
            if body is not None:
                request = self.parsers.parse(path, headers, body)
                admission.skip_response, admission.response = request.skip_response, request.response
                admission.stream = request.stream
                model = None
                if request.model:  # a parser reading no model (passthrough) leaves the model checks out
                    admission.client_model = request.model
                    model = self.config.model(request.model)
                    if model is None and self.config.models:
                        raise RequestError(404, f"model {request.model!r} matches no configured model")
                    if model is not None:
                        admission.priority = model.priority
                rewrite = headers.get(MODEL_REWRITE)
                if rewrite and not rewrite_allowed(self.config, model, rewrite):
                    raise RequestError(404, f"{MODEL_REWRITE} {rewrite[:64]!r} is not a target model of "
                                            f"{request.model[:64]!r}")
                target = rewrite or None
                if request.rewritable:  # else the body goes as received, as the reference's director does
                    target = rewrite or (choose_target(model, self.rng) if model is not None else request.model)
                    if not rewrite and model is not None and model.target_models:
                        admission.rewrite = model.name
                    if not target:
                        raise RequestError(400, "model not found in request body")
                    if target != request.model:
                        admission.body = rewrite_model(request, target)
                admission.target_model = target
                if self.tokens is not None:
                    admission.tokens, admission.render = tokenize(self.tokens, path, request, headers)
                    admission.request_body = request.body
                    if admission.render is None:  # else once rendered
                        self.hash_prompt(admission, admission.tokens)
                elif self.hashes_prompts:  # the reference's auto-added estimate producer: its tokens are the request's
                    admission.tokens = tokenize(DEFAULT_PRODUCER, path, request, headers)[0]
                    self.hash_prompt(admission, admission.tokens)
                admission.prompt_bytes = request.prompt_size(self.config.scheduler.chars_per_token)
                admission.output_cap = request.output_cap
                if self.reads_media and request.api is Api.CHAT:
                    admission.media = media_items(request.body)
            objective = None if _OBJECTIVES.isdisjoint(headers) else objective_name(headers)
            if objective is not None and objective in self.objectives:
                admission.priority = self.objectives[objective]
        except RequestError as exc:
            self._failed(report, admission, exc)
            raise
        return admission

    def hash_prompt(self, admission: Admission, tokens: TokenizedPrompt | None) -> None:
        """The prompt's block hashes from its tokens (none without): the approximate prefix
        index's at its geometry now, and the burst producer's at its own block size."""
        target = admission.target_model or ""
        if self.config.scheduler.uses_prefix:
            admission.block_tokens, max_blocks = self.scheduler.prefix_geometry()
            admission.hashes = block_hashes(target, tokens, admission.block_tokens, max_blocks)
        if self.burst is not None:
            burst = self.burst.params
            admission.burst_hashes = block_hashes(target, tokens, burst.block_size_tokens, burst.max_blocks)

    def burst_replicas(self, subset: frozenset[str] | None) -> list[Replica]:
        """The candidates a burst window assigns among: the ready endpoints (in the subset hint)."""
        return [Replica(s.endpoint.address, s.metrics.running if s.metrics is not None else 0.0)
                for s in self.snapshot.states.values()
                if s.ready and (subset is None or s.endpoint.host in subset)]

    def begin_latency(self, admission: Admission) -> list[LatencyRequest]:
        """The latency producers' contexts for ``admission`` (its candidates' features now, as the
        reference's Produce before the profiles), kept on it; those that want predictions."""
        scheduler = self.scheduler
        candidates = [s for s in self.snapshot.states.values()
                      if s.ready and (admission.subset is None or s.endpoint.host in admission.subset)]
        addresses = [s.endpoint.address for s in candidates]
        approx = scheduler.prefix.matches(admission.hashes, addresses) if admission.hashes else {}
        request = PickRequest(admission.target_model, admission.priority, admission.hashes,
                              prompt_bytes=admission.prompt_bytes, attributes=admission.attributes,
                              media=admission.media, tokens=admission.tokens)
        tokens = scheduler.prompt_tokens(request)
        inflight = scheduler.inflight
        requests = {a: inflight.requests(a) for a in addresses}
        in_flight_tokens = {a: inflight.tokens(a) for a in addresses}
        contexts = {}
        for name, producer in self.latency.items():
            params, states = producer.params, scheduler.plugin_states
            matches, total, _ = scheduler.prefix_match_info(request, addresses, params.prefix_producer, approx)
            cache = states.get(params.encoder_producer) if params.encoder_producer else None
            encoder = encoder_match(cache if isinstance(cache, MediaCache) else None, admission.media, addresses)
            context = contexts[name] = producer.begin(
                admission.headers, candidates, matches, total, tokens, requests, in_flight_tokens, encoder)
            context.model, context.target_model = admission.client_model or "", admission.target_model or ""
        admission.latency = contexts
        return [c for c in contexts.values() if c.owner.wants_predictions(c)]

    def pick(self, admission: Admission, report: StreamReport) -> Route:
        """Pick endpoints for an admitted request and count it in flight; RequestError for 429/500/503."""
        pick = PickRequest(admission.target_model, admission.priority, admission.hashes, admission.subset,
                           admission.prompt_bytes, admission.headers, admission.attributes, admission.media,
                           admission.tokens, admission.latency or NO_LATENCY)
        try:
            schedule = self.scheduler.schedule(pick, self.pick_count)
            endpoints = schedule.endpoints
        except RequestError as exc:
            self._failed(report, admission, exc)
            report.scheduled = False
            raise
        self._noted(report, admission)
        report.routed = report.scheduled = True
        report.endpoint = endpoints[0]
        report.streaming, report.rewrite = admission.stream, admission.rewrite
        report.scheduling_s = time.perf_counter() - admission.started
        scheduler = self.scheduler
        report.scorer_s = dict(scheduler.scorer_seconds)
        first, prefill = endpoints[0], schedule.prefill
        tokens = scheduler.prompt_tokens(pick)
        uncached = scheduler.uncached_tokens(pick, (first,), tokens)[first]
        if admission.hashes:  # in bytes at 4 a token, as the reference reports them
            block = admission.block_tokens * BYTES_PER_TOKEN  # the geometry the prompt was hashed with
            report.prefix_match = (scheduler.prefix_matches.get(first, 0) * block, len(admission.hashes) * block)
            scheduler.prefix.add(first, admission.hashes)
            if prefill is not None and prefill != first:
                scheduler.prefix.add(prefill, admission.hashes)
        inflight, group = scheduler.inflight, (admission.fairness_id, admission.priority)
        ticket = inflight.dispatch(first, uncached, prompt_tokens=tokens, client_output_cap=admission.output_cap,
                                   group=group)
        prefill_ticket = None
        if prefill is not None:
            prefill_ticket = inflight.dispatch(prefill, scheduler.uncached_tokens(pick, (prefill,), tokens)[prefill],
                                               group=group)
        return Route(schedule.destinations or endpoints, admission.client_model, admission.target_model,
                     admission.hashes, admission.body,
                     prefill=prefill, load=ticket, prefill_load=prefill_ticket,
                     scores=schedule.scores if self.config.ext_proc.emit_endpoint_scores else {},
                     response_headers=schedule.response_headers, request_headers=schedule.request_headers,
                     skip_response=admission.skip_response,
                     response=admission.response, latency=admission.latency or NO_LATENCY)

    @staticmethod
    def _noted(report: StreamReport, admission: Admission) -> None:
        """The request's labels, in ``report``: its models, fairness id and priority."""
        report.client_model, report.target_model = admission.client_model or "", admission.target_model or ""
        report.fairness_id, report.priority = admission.fairness_id, admission.priority

    @classmethod
    def _failed(cls, report: StreamReport, admission: Admission, exc: RequestError) -> None:
        cls._noted(report, admission)
        report.error = exc.status

    def record_served(self, route: Route, served: str) -> None:
        """Envoy reported the endpoint that served: note it and teach the prefix index."""
        if served in route.served:
            return
        route.served.append(served)
        if route.hashes and served != route.endpoints[0] and served in self.snapshot.states:
            self.scheduler.prefix.add(served, route.hashes)


MAX_PLAIN_DECISIONS = 4096
"""Plain routing replies kept serialized per picker (their keys are endpoints: cleared when full)."""

# Replies are built by setting fields in place (``reply.request_body.response...``): protobuf's
# keyword constructors copy each nested message into its parent, which costs several times more.


def _header_option(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE)


def _set_header(mutation: ep.HeaderMutation, key: str, value: str) -> None:
    """Add ``key: value`` to ``mutation``'s headers to set (as :func:`_header_option` makes it)."""
    option = mutation.set_headers.add()
    header = option.header
    header.key = key
    header.raw_value = value.encode()
    option.append_action = _OVERWRITE


def immediate(status: int, message: str, dropped_reason: str = "") -> ep.ProcessingResponse:
    """An ImmediateResponse with an OpenAI-style JSON error body (and flow control's
    ``x-llm-d-request-dropped-reason`` when it dropped the request)."""
    error = {"error": {"message": message, "type": "endpoint_picker", "code": status}}
    body = json.dumps(error, separators=(",", ":")).encode()
    headers = _JSON_HEADERS
    if dropped_reason:
        headers = ep.HeaderMutation(set_headers=[*_JSON_HEADERS.set_headers,
                                                 _header_option(DROPPED_REASON, dropped_reason)])
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=headers, body=body,
        details=f"endpoint_picker_{status}"))


def _struct_strings(value: struct_pb2.Value) -> list[str]:
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values if v.string_value]
    if kind == "string_value":
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []


def subset_host(entry: str) -> str:
    """The host of one subset-hint entry (``10.0.1.0:8080`` -> ``10.0.1.0``, ``[fd00::1]:8080`` ->
    ``fd00::1``; an entry without a port is its host): llm-d-router matches endpoints by address alone."""
    if entry.startswith("["):
        return entry[1:].partition("]")[0]
    host, colon, _ = entry.rpartition(":")
    return host if colon and ":" not in host else entry


def _metadata_value(metadata: base_pb2.Metadata, namespace: str, key: str) -> struct_pb2.Value | None:
    if namespace not in metadata.filter_metadata:
        return None
    fields = metadata.filter_metadata[namespace].fields
    value: struct_pb2.Value | None = fields.get(key)
    return value


def _headers(message: ep.HttpHeaders) -> dict[str, str]:
    headers = {}
    for h in message.headers.headers:
        raw = h.raw_value
        headers[h.key.lower()] = raw.decode("latin-1") if raw else h.value
    return headers


def _response_header_fields(message: ep.HttpHeaders) -> tuple[str, bool]:
    """What the response's headers tell the picker, as :func:`_headers` reads them: the content type
    ("" without one) and whether a content length is set (without a map of every header)."""
    content_type, has_length = "", False
    for h in message.headers.headers:
        key = h.key.lower()
        if key == "content-type":
            raw = h.raw_value
            content_type = raw.decode("latin-1") if raw else h.value
        elif key == "content-length":
            has_length = True
    return content_type, has_length


def _chunks(body: bytes, size: int, end_of_stream: bool, phase: str = "request_body") -> list[ep.ProcessingResponse]:
    """``body`` as streamed body mutations of at most ``size`` bytes, in ``phase`` (``request_body``
    or ``response_body``); the last one carries ``end_of_stream``."""
    pieces = [body[i : i + size] for i in range(0, len(body), size)] if len(body) > size else [body]
    last = len(pieces) - 1
    replies = []
    for i, piece in enumerate(pieces):
        reply = ep.ProcessingResponse()
        streamed = getattr(reply, phase).response.body_mutation.streamed_response
        streamed.SetInParent()
        streamed.body = piece
        streamed.end_of_stream = end_of_stream and i == last
        replies.append(reply)
    return replies


def _empty(phase: str) -> ep.ProcessingResponse:
    """A reply that changes nothing in ``phase`` (``request_trailers``, ``response_headers``...)."""
    reply = ep.ProcessingResponse()
    getattr(reply, phase).SetInParent()
    return reply


class ExtProcStream:
    """The per-stream ext_proc state machine (one HTTP request through Envoy)."""

    # destination-endpoint-served-verifier's response header, once the response headers came
    # (a class default: most pickers declare no verifier, and their streams never set it).
    verified: tuple[tuple[str, str], ...] = ()
    trace: RequestTrace | None = None  # its spans, with --tracing (a class default: none without)

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.report = StreamReport()
        self.limits = picker.config.ext_proc
        self.request_mode: int = BUFFERED
        self.response_mode: int = NONE
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.chunks: list[bytes] = []  # the request body as received (BUFFERED: one message holds it all)
        self.body_bytes = 0
        self.route: Route | None = None
        self.routed = False
        self.reader: ResponseBody | None = None
        self.rewrite_sse = False
        self.response_started = False
        self.response_ended = False
        self.response_held = False
        self.usage_recorded = False
        self.reported = False  # the attribute reporters ran (once, at the response's end)
        # True once the stream needs nothing more from Envoy: the server then ends the RPC.
        self.finished = False
        # Flow control: while ``parked`` the request waits in the queue as ``item``; its outcome
        # leaves replies for :meth:`resume` and calls ``on_unpark`` (set by the wire).
        self.parked = False
        self.on_unpark: Callable[[], None] | None = None
        self.item: QueueItem | None = None
        self.received_at: float | None = None  # when the request headers came (the pool's clock)
        self.response_headers_at: float | None = None
        self.last_chunk_at: float | None = None  # a streaming response's last non-empty chunk
        self._resumed: list[ep.ProcessingResponse] = []
        self._abandoned = False
        self._finish: Callable[[Outcome], list[ep.ProcessingResponse]] | None = None
        self._evicting = False  # in-flight eviction revoked it: resume() ends it
        self._burst: BurstEntry | None = None  # its place in a burst producer's window, once it joined
        self._predicting = 0  # latency producers' prediction calls it waits for before its pick

    def on_message(self, message: ep.ProcessingRequest) -> Sequence[ep.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_mode = message.protocol_config.request_body_mode
            self.response_mode = message.protocol_config.response_body_mode
        kind = message.WhichOneof("request")
        if kind is None:
            raise ExtProcError("expected a ProcessingRequest with a request oneof, got an empty one")
        replies = _HANDLERS[kind](self, message)
        if self.response_ended and not self.reported and kind in ("response_body", "response_trailers"):
            self._report_attributes(replies)
        if self.response_ended and not self.finished:
            # Nothing more comes after the response's end: end the RPC here. Envoy would reset it
            # otherwise, once per request, which the wire counts like a client's rapid reset.
            self._finish_usage()
            self.finished = True
        if self.route is not None:  # else no load to settle
            self._settle_load(first_chunk=kind == "response_body")
        return replies

    def _settle_load(self, *, first_chunk: bool = False) -> None:
        route = self.route
        if route is None:
            return
        if route.prefill_load is not None and (first_chunk or self.response_ended or self.finished):
            route.prefill_load.release()  # the first chunk came: the prefill pod handed off
        if route.load is not None:
            if self.response_ended or self.finished:
                route.load.release()
                self._completed()
            elif first_chunk and not self.picker.config.scheduler.load.add_estimated_output_tokens:
                route.load.release_prompt()  # the first chunk came: prefill is done

    def on_end(self) -> Sequence[ep.ProcessingResponse]:
        self._finish_usage()
        self.on_abort()
        return ()

    def on_abort(self) -> None:
        """The stream ended without a response end (client gone, Envoy reset, an error): leave the
        flow control queue, release the request's in-flight load. Idempotent."""
        self.on_unpark = None
        if self._burst is not None:
            self._burst.on_sealed = None  # it stays in its window's assignment, as the reference's
        self._abandoned = True  # a render still running then routes nothing
        if self.item is not None and self.item.outcome is None and self.picker.flow is not None:
            self.picker.flow.queue.cancel(self.item)
        if self.route is not None:
            for ticket in (self.route.load, self.route.prefill_load):
                if ticket is not None:
                    ticket.release()
            if self.route.latency:  # a check, not a call, for the routes without a latency producer
                for context in self.route.latency.values():
                    context.owner.finished(context)
            self._completed()

    def _completed(self) -> None:
        """The routed request is over: flow control's program-aware policies learn its usage (once)."""
        if self.item is not None and self.picker.flow is not None:
            self.picker.flow.completed(self.item, self.report.usage)

    def resume(self) -> Sequence[ep.ProcessingResponse]:
        """The replies a parked request's outcome left, or an eviction's (the wire calls this once woken)."""
        replies, self._resumed = self._resumed, []
        if self._evicting:
            self._evicting = False
            reply = self.eviction()
            if reply is not None:
                replies.append(reply)
        self._settle_load()
        return replies

    def eviction(self) -> ep.ProcessingResponse | None:
        """The ImmediateResponse that ends a request flow control evicted (429, dropped reason
        ``evicted``, as llm-d-router's), or None once its response completed (nothing may follow
        its last chunk)."""
        if self.response_ended or self.finished:
            return None
        return self._immediate(EVICTED_STATUS, EVICTED_MESSAGE, EVICTED_REASON)

    def _on_evict(self) -> None:
        """Flow control revoked this running request: wake the wire, whose resume() ends it."""
        self._evicting = True
        if self.on_unpark is not None:
            self.on_unpark()

    def _on_outcome(self, outcome: Outcome) -> None:
        finish, self._finish = self._finish, None  # it holds this stream: no cycle once decided
        assert finish is not None
        self._proceed(partial(finish, outcome))

    def _proceed(self, step: Callable[[], list[ep.ProcessingResponse]]) -> None:
        """What held the stream (a render, flow control, a burst window, predictions) is done: run
        the next ``step``, which leaves the replies for :meth:`resume` or parks the stream for the
        next holder, and wake the wire only if it was parked and nothing parks it again."""
        was_parked, self.parked = self.parked, False
        self._resumed = step()
        if was_parked and not self.parked and self.on_unpark is not None:
            self.on_unpark()

    # -- request --------------------------------------------------------------------------------

    def _request_headers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if self.headers:
            raise ExtProcError("expected one request_headers message per stream, got a second")
        self.headers = _headers(message.request_headers)
        self.received_at = self.picker.snapshot.clock()
        tracing = self.picker.tracing
        if tracing is not None:
            self.trace = tracing.request(self.headers)
        value = _metadata_value(message.metadata_context, SUBSET_NAMESPACE, SUBSET)
        if value is not None and self.picker.config.ext_proc.honor_subset_hint:
            self.subset = frozenset(subset_host(entry) for entry in _struct_strings(value))
        if message.request_headers.end_of_stream or self.request_mode == NONE:
            return self._decide(None, "headers")
        if self.request_mode == FULL_DUPLEX:
            return []
        if self.request_mode in (BUFFERED, BUFFERED_PARTIAL):
            return [_empty("request_headers")]
        mode = _Mode.BodySendMode.Name(self.request_mode)
        raise ExtProcError(f"expected request body mode BUFFERED or FULL_DUPLEX_STREAMED, got {mode}")

    def _request_body(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if not self.headers or self.routed:
            raise ExtProcError("expected request_body between request_headers and the routing decision")
        chunk = message.request_body.body  # each read of the field copies it: read once
        self.chunks.append(chunk)
        self.body_bytes += len(chunk)
        self.report.request_bytes = self.body_bytes
        if self.body_bytes > self.limits.max_request_body_bytes:
            self.routed = True
            self.chunks.clear()
            self._processed()
            return [self._immediate(413, f"request body larger than {self.limits.max_request_body_bytes} bytes")]
        if self.request_mode == FULL_DUPLEX:
            end = message.request_body.end_of_stream
            return self._decide(self._body(), "headers", duplex_end=True) if end else []
        return self._decide(self._body(), "body")

    def _body(self) -> bytes:
        """The body received so far, joined once (a 16 MiB body costs a copy only when it came in pieces)."""
        if len(self.chunks) > 1:
            self.chunks = [b"".join(self.chunks)]
        return self.chunks[0] if self.chunks else b""

    def _request_trailers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        trailers = _empty("request_trailers")
        if self.request_mode == FULL_DUPLEX and not self.routed:
            return self._decide(self._body(), "headers", duplex_end=False, after=[trailers])
        return [trailers]

    def _decide(self, body: bytes | None, phase: str, *, duplex_end: bool | None = None,
                after: Sequence[ep.ProcessingResponse] = ()) -> list[ep.ProcessingResponse]:
        """Admit the request, then (with the vllm token backend) render its tokens, then route it
        through flow control when on: it may park for the render and in the queue.

        The replies: the response for ``phase`` carrying the decision (in FULL_DUPLEX_STREAMED
        followed by the body in chunks, the last with ``duplex_end``), or an immediate one; then ``after``.
        """
        self.routed = True
        if self.trace is not None:
            self.trace.orchestrate()
        try:
            admission = self.picker.admit(request_path(self.headers), self.headers, body, self.subset, self.report)
        except RequestError as exc:
            self._processed()
            return [self._immediate(exc.status, exc.message, exc.dropped_reason), *after]
        start_render = self.picker.start_render
        if admission.render is not None and start_render is not None:
            self.parked = True  # until the render's reply (or its failure) is in

            def rendered(tokens: TokenizedPrompt | None) -> None:
                if self._abandoned:
                    return
                admission.tokens = tokens
                self.picker.hash_prompt(admission, tokens)
                self._proceed(partial(self._dispatch, admission, phase, duplex_end, after))

            start_render(admission.render, admission.request_body, rendered)
            return [] if self.parked else list(self.resume())  # a render that called back at once
        return self._dispatch(admission, phase, duplex_end, after)

    def _dispatch(self, admission: Admission, phase: str, duplex_end: bool | None,
                  after: Sequence[ep.ProcessingResponse]) -> list[ep.ProcessingResponse]:
        """Route an admitted request, through flow control when on (it may park here)."""
        # A partial of a method, not a closure naming itself: that cycle kept every stream alive
        # until the cyclic collector ran.
        finish = partial(self._finish_outcome, admission, phase, duplex_end, after)
        if self.picker.flow is None:
            return finish(Outcome.DISPATCHED)
        self._finish = finish
        self.item = QueueItem(admission.fairness_id, admission.priority, admission.byte_size, self._on_outcome,
                              admission.headers, self.received_at, on_evict=self._on_evict,
                              models=(admission.client_model or "", admission.target_model or ""))
        self.picker.flow.submit(self.item)
        if self.item.outcome is None:
            self.parked = True
        return list(ExtProcStream.resume(self))  # this class's: a subclass's resume answers the wire

    def _finish_outcome(self, admission: Admission, phase: str, duplex_end: bool | None,
                        after: Sequence[ep.ProcessingResponse], outcome: Outcome) -> list[ep.ProcessingResponse]:
        """The replies once flow control decided ``outcome`` (at once without it): the request's
        route, or its immediate response."""
        self._processed()
        if outcome is not Outcome.DISPATCHED:
            return [self._immediate(outcome.status, outcome_message(outcome), outcome.reason), *after]
        if self.picker.burst is not None and self._burst is None:
            return self._join_burst(admission, partial(self._finish_outcome, admission, phase, duplex_end, after))
        if self.picker.latency and not admission.latency and self._predict(
                admission, partial(self._finish_outcome, admission, phase, duplex_end, after)):
            return []
        if self.trace is not None:  # the scheduler's spans, when this request's are sampled
            self.picker.scheduler.tracing = self.trace.scheduling()
        try:
            route = self.picker.pick(admission, self.report)
        except RequestError as exc:
            return [self._immediate(exc.status, exc.message, exc.dropped_reason), *after]
        if self.item is not None and self.picker.flow is not None:
            self.picker.flow.started(self.item)
        first = self._decision(route, phase)
        if duplex_end is None:
            return [first, *after]
        data = route.body if route.body is not None else self._body()
        return [first, *_chunks(data, self.limits.streamed_chunk_bytes, duplex_end), *after]

    def _join_burst(self, admission: Admission,
                    finish: Callable[[Outcome], list[ep.ProcessingResponse]]) -> list[ep.ProcessingResponse]:
        """Park until the burst producer's window seals, then route with its assignment (a full
        window: route now, with no affinity, as the reference's producer error does)."""
        window = self.picker.burst
        assert window is not None

        def sealed(entry: BurstEntry) -> None:
            admission.attributes = {**admission.attributes, **window.match_attribute(entry)}
            self._proceed(partial(finish, Outcome.DISPATCHED))

        self._burst = window.join(admission.burst_hashes, self.picker.burst_replicas(admission.subset), sealed)
        if self._burst is None:
            self._burst = BurstEntry((), ())  # joined nothing: routed once, now
            return finish(Outcome.DISPATCHED)
        self.parked = True
        return []

    def _predict(self, admission: Admission, finish: Callable[[Outcome], list[ep.ProcessingResponse]]) -> bool:
        """Start the latency producers' predictions and park until they are in (True); False when
        none is to be asked (no predictor client, or predictions off)."""
        start = self.picker.start_predict
        wanted = self.picker.begin_latency(admission)
        if start is None or not wanted:
            return False

        clock = self.picker.snapshot.clock
        started = clock()

        def predicted(context: LatencyRequest, predictions: list[Prediction] | None) -> None:
            if self._abandoned:
                return
            context.owner.predicted(context, predictions, clock() - started)
            self._predicting -= 1
            if not self._predicting:
                self._proceed(partial(finish, Outcome.DISPATCHED))

        self._predicting = len(wanted)
        self.parked = True
        for context in wanted:
            start(list(context.rows.values()), partial(predicted, context))
        return True

    def _processed(self) -> None:
        """The request is answered or about to be sent on (queue wait included)."""
        if self.received_at is not None:
            self.report.processing_s = self.picker.snapshot.clock() - self.received_at

    def _decision(self, route: Route, phase: str) -> ep.ProcessingResponse:
        """The response for ``phase`` that sends the request to ``route``."""
        self.route = route
        if self.trace is not None:  # the request carries its span's context upstream
            route.request_headers = {**route.request_headers, **self.trace.routed(self.report)}
        rewrites_back = route.target_model is not None and route.target_model != route.client_model
        self.finished = route.skip_response or not (
            self.limits.observe_responses or rewrites_back or route.response_headers or self.picker.reporters
            or self.picker.verifies_served)
        mode = self.picker.config.ext_proc.destination_mode
        value = ",".join(route.endpoints) if mode is DestinationMode.LIST else route.endpoints[0]
        fallback = route.endpoints[1] if mode is DestinationMode.FALLBACK and len(route.endpoints) > 1 else None
        if route.body is not None or route.request_headers or route.scores or not _STRIPPED.isdisjoint(self.headers):
            return self._routing_reply(route, phase, value, fallback)
        # A plain reply (the destination, its metadata; nothing of the request's own): the same
        # bytes for every request to this destination, parsed back from the ones made the first time.
        plain = self.picker.plain_decisions
        key = (phase, value, fallback)
        data = plain.get(key)
        if data is None:
            if len(plain) >= MAX_PLAIN_DECISIONS:
                plain.clear()
            data = plain[key] = self._routing_reply(route, phase, value, fallback).SerializeToString()
        return ep.ProcessingResponse.FromString(data)

    def _routing_reply(self, route: Route, phase: str, value: str, fallback: str | None) -> ep.ProcessingResponse:
        """The routing reply for ``phase``, built field by field: the destination ``value`` (and
        ``fallback``) in a header and in ``envoy.lb`` metadata, the route's headers and body."""
        reply = ep.ProcessingResponse()
        common = reply.request_headers.response if phase == "headers" else reply.request_body.response
        mutation = common.header_mutation
        _set_header(mutation, DESTINATION, value)
        if route.body is not None and "content-length" in self.headers:
            _set_header(mutation, "content-length", str(len(route.body)))
        request_headers = route.request_headers
        if request_headers:  # P/D, E/PD and data parallelism only: most routes set none
            for name, header in request_headers.items():
                _set_header(mutation, name, header)
        if not _STRIPPED.isdisjoint(self.headers):
            removed = [h for h in STRIPPED_HEADERS if h in self.headers and h not in request_headers]
            if removed:
                mutation.remove_headers.extend(removed)
        if phase != "headers" and route.body is not None:
            common.body_mutation.body = route.body
        common.clear_route_cache = True
        fields = reply.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields  # Struct.update's walk costs more
        fields[DESTINATION].string_value = value
        if fallback is not None:
            fields[FALLBACK].string_value = fallback
        if route.scores:
            scores = fields[SCORES].struct_value.fields
            for address, score in route.scores.items():
                scores[address].number_value = score
        return reply

    def _immediate(self, status: int, message: str, dropped_reason: str = "") -> ep.ProcessingResponse:
        """An ImmediateResponse ends Envoy's processing of the request, so it ends the stream too."""
        self.finished = True
        self.report.error = status
        if self.trace is not None:
            self.trace.answered(self.report, message)
        return immediate(status, message, dropped_reason)

    # -- response -------------------------------------------------------------------------------

    def _response_headers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        if self.response_started:
            raise ExtProcError("expected one response_headers message per stream, got a second")
        self.response_started = True
        start = self.response_headers_at = self.picker.snapshot.clock()
        replies = self._response_header_replies(message)
        self.report.response_processing_s += self.picker.snapshot.clock() - start
        return replies

    def _response_header_replies(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        content_type, has_length = _response_header_fields(message.response_headers)
        served = _metadata_value(message.metadata_context, LB_NAMESPACE, SERVED)
        route = self.route
        if route is not None and served is not None:
            for address in _struct_strings(served)[:1]:
                self.picker.record_served(route, address)
                self.report.served = list(route.served)
        if self.picker.verifies_served:
            namespaces = message.metadata_context.filter_metadata
            lb = namespaces[LB_NAMESPACE].fields if LB_NAMESPACE in namespaces else None
            self.verified = ((SERVED_ENDPOINT_HEADER, served_verdict(lb)),)
        rewrite = None
        response = route.response if route is not None else OPENAI_RESPONSES
        if (route is not None and route.target_model and route.client_model and route.target_model != route.client_model
                and response.rewrites):
            rewrite = (route.target_model, route.client_model)
        sse = content_type.startswith("text/event-stream")
        if sse:
            self.report.streaming = True
        self.reader = response.reader(sse=sse, rewrite=rewrite, max_bytes=self.limits.max_response_body_bytes)
        self.rewrite_sse = rewrite is not None and sse
        if message.response_headers.end_of_stream or self.response_mode == NONE:
            self.response_ended = True
            if self.route is not None and self.route.latency:
                self._latency_chunk(None, True)
            reply = _empty("response_headers")
            if self._has_response_mutation():
                self._response_mutation(reply.response_headers.response)
            return [reply]
        if self.response_mode == FULL_DUPLEX and rewrite is not None and not sse:
            self.response_held = True
            return []
        removed = ["content-length"] if rewrite is not None and has_length else []
        reply = ep.ProcessingResponse()
        common = reply.response_headers.response
        common.SetInParent()
        self._response_mutation(common, remove=removed)
        return [reply]

    def _has_response_mutation(self) -> bool:
        """Whether the route's plugins, or the served verifier, set response headers (a mutation with
        nothing else would be empty)."""
        return bool(self.verified) or (self.route is not None and bool(self.route.response_headers))

    def _response_mutation(self, common: ep.CommonResponse, *, remove: Sequence[str] = (),
                           set_: Sequence[tuple[str, str]] = ()) -> None:
        """The response headers' mutation, in ``common``: ``remove`` and ``set_`` those, and set the
        headers the route's plugins asked for (no mutation when there is nothing to change)."""
        plugins = self.route.response_headers.items() if self.route is not None else ()
        added = (*set_, *plugins, *self.verified)
        if not added and not remove:
            return
        mutation = common.header_mutation
        for key, value in added:
            _set_header(mutation, key, value)
        if remove:
            mutation.remove_headers.extend(remove)
        mutation.SetInParent()

    def _response_body(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """A response chunk; timed as llm-d-router times it: a streaming response's handler time
        adds up, a non-streaming one's runs from its headers to its end."""
        report = self.report
        if report.streaming:
            start = self.picker.snapshot.clock()
            replies = self._response_chunk(message, start)
            report.response_processing_s += self.picker.snapshot.clock() - start
            return replies
        replies = self._response_chunk(message, None)
        if self.response_ended and self.response_headers_at is not None:
            report.response_processing_s = self.picker.snapshot.clock() - self.response_headers_at
        return replies

    def _response_chunk(self, message: ep.ProcessingRequest, now: float | None) -> list[ep.ProcessingResponse]:
        """``now``: when a chunk of a streaming response came (None otherwise)."""
        if not self.response_started or self.response_ended:
            raise ExtProcError("expected response_body after response_headers and before the body ended")
        chunk = message.response_body.body
        report = self.report
        report.response_bytes += len(chunk)
        if chunk:
            if report.ttft_s is None and self.received_at is not None:
                report.ttft_s = (now if now is not None else self.picker.snapshot.clock()) - self.received_at
            if now is not None:
                if self.last_chunk_at is not None and report.itl is not None:
                    report.itl.observe(now - self.last_chunk_at)
                self.last_chunk_at = now
        end = message.response_body.end_of_stream
        route = self.route
        if route is not None and route.latency:
            self._latency_chunk(now, end or self.response_mode != FULL_DUPLEX)
        if self.response_mode != FULL_DUPLEX:
            self.response_ended = True
            return [self._buffered_response(chunk)]
        self.response_ended = end
        reader = self.reader
        if reader is not None and (self.response_held or self.rewrite_sse):
            try:
                out = reader.feed(chunk)
            except RequestError as exc:
                self.response_ended = True
                return [self._immediate(exc.status, exc.message)]
            if self.response_held:
                return self._release_held(end_of_stream=True) if end else []
            if end:
                out += reader.finish()
            return self._response_chunks(out, end) if out or end else []
        self._track(chunk, end)
        return self._response_chunks(chunk, end)

    def _response_trailers(self, message: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        trailers = _empty("response_trailers")
        self.response_ended = True
        if self.route is not None and self.route.latency:
            self._latency_chunk(None, True)
        if self.response_held:
            return [*self._release_held(end_of_stream=False), trailers]
        if self.rewrite_sse and self.reader is not None and not self.usage_recorded:
            rest = self.reader.finish()
            self._finish_usage()
            return [*self._response_chunks(rest, False), trailers] if rest else [trailers]
        if self.response_mode == FULL_DUPLEX and not self.usage_recorded:
            self._track(b"", True)  # a pass-through body the trailers end: read what it holds
        self._finish_usage()
        return [trailers]

    def _latency_chunk(self, now: float | None, end: bool) -> None:
        """A response body message (``end``: the response's last) for the latency producers'
        training (the reference's ResponseBody hook), of a route they have contexts on (the
        callers check, so that other routes make no call); ``now`` when the caller read the clock."""
        assert self.route is not None
        at = now if now is not None else self.picker.snapshot.clock()
        for context in self.route.latency.values():
            context.owner.on_chunk(context, at, end)

    def _track(self, chunk: bytes, end: bool) -> None:
        """Pass-through chunk: read usage from a copy; a body past the limit just stops tracking."""
        if self.reader is None:
            return
        try:
            self.reader.feed(chunk)
            if end:
                self.reader.finish()
        except RequestError:
            self.reader = None

    def _buffered_response(self, chunk: bytes) -> ep.ProcessingResponse:
        reader = self.reader
        try:
            data = reader.feed(chunk) + reader.finish() if reader is not None else b""
        except RequestError:
            self.reader = reader = None
        self._finish_usage()
        if reader is None or not reader.rewritten:
            return ep.ProcessingResponse(response_body=ep.BodyResponse())
        return ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
            header_mutation=ep.HeaderMutation(set_headers=[_header_option("content-length", str(len(data)))]),
            body_mutation=ep.BodyMutation(body=data))))

    def _release_held(self, *, end_of_stream: bool) -> list[ep.ProcessingResponse]:
        assert self.reader is not None
        data = self.reader.finish()
        self.response_held = False
        headers = ep.ProcessingResponse()
        self._response_mutation(headers.response_headers.response, set_=[("content-length", str(len(data)))])
        return [headers, *self._response_chunks(data, end_of_stream)]

    def _response_chunks(self, data: bytes, end_of_stream: bool) -> list[ep.ProcessingResponse]:
        if end_of_stream:
            self._finish_usage()
        return _chunks(data, self.limits.streamed_chunk_bytes, end_of_stream, "response_body")

    def _finish_usage(self) -> None:
        if self.usage_recorded:
            return
        self.usage_recorded = True
        if self.reader is not None and self.route is not None:
            self.report.usage = self.reader.usage

    def _report_attributes(self, replies: Sequence[ep.ProcessingResponse]) -> None:
        """The response ended: the reporters' numbers go on the last reply as dynamic metadata
        (none after an immediate response, or when the body was too large to read its usage)."""
        self.reported = True
        if not self.picker.reporters or self.reader is None or not replies:
            return
        last = replies[-1]
        if last.HasField("immediate_response"):
            return
        for namespace, values in report(self.picker.reporters, self.reader.usage).items():
            fields = last.dynamic_metadata.fields[namespace].struct_value.fields
            for name, value in values.items():
                fields[name].number_value = value


_HANDLERS: dict[str, Callable[[ExtProcStream, ep.ProcessingRequest], list[ep.ProcessingResponse]]] = {
    "request_headers": ExtProcStream._request_headers,
    "request_body": ExtProcStream._request_body,
    "request_trailers": ExtProcStream._request_trailers,
    "response_headers": ExtProcStream._response_headers,
    "response_body": ExtProcStream._response_body,
    "response_trailers": ExtProcStream._response_trailers,
}
