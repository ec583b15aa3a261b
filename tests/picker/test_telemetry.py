"""The picker's metrics expose what prometheus_client's own metrics did, byte for byte.

The per-request metrics are plain numbers read at scrape time (:mod:`evergreen_trio.picker.telemetry`).
``ReferenceMetrics`` below is :class:`PickerMetrics` as it was before, on prometheus_client's
``Counter``, ``Gauge`` and ``Histogram``: for any sequence of stream reports, both expositions
(Prometheus text and OpenMetrics) are the same, ``_created`` timestamps included.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from grpclib.const import Status
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics, enable_created_metrics
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from evergreen_trio.picker import telemetry
from evergreen_trio.picker.config import Endpoint
from evergreen_trio.picker.guards import BoundedLabel, ModelLabels
from evergreen_trio.picker.inflight import InflightLoad, LoadConfig, Ticket
from evergreen_trio.picker.llmd_gauges import LlmdGauges
from evergreen_trio.picker.processor import StreamReport
from evergreen_trio.picker.reclamation_metrics import ReclamationMetrics
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.telemetry import (
    _DURATION_BUCKETS,
    _INPUT_TOKEN_BUCKETS,
    _ITL_BUCKETS,
    _MODEL,
    _NTPOT_BUCKETS,
    _OUTPUT_TOKEN_BUCKETS,
    _PLUGIN_HELP,
    _REQUEST,
    _REQUEST_PROCESSING_BUCKETS,
    _REQUEST_SIZE_BUCKETS,
    _RESPONSE_PROCESSING_BUCKETS,
    _RESPONSE_SIZE_BUCKETS,
    _SCHEDULER_BUCKETS,
    _STREAM_BUCKETS,
    _TPOT_BUCKETS,
    _TTFT_BUCKETS,
    VERSION,
    HistogramFamily,
    HistogramSeries,
    PickerMetrics,
    alpha,
    error_code,
    go_code,
)
from evergreen_trio.picker.usage import Usage


class ReferenceStreamMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.inflight = Gauge("llm_d_epp_extproc_streams_inflight",
                              alpha("Number of ext_proc gRPC streams currently open."), registry=registry)
        self.duration = Histogram("llm_d_epp_extproc_stream_duration_seconds",
                                  alpha("Duration an ext_proc gRPC stream stays open, in seconds."),
                                  buckets=_STREAM_BUCKETS, registry=registry)
        self.ended = Counter("llm_d_epp_extproc_streams",
                             alpha("Total ext_proc gRPC streams completed, by gRPC status code."), ["code"],
                             registry=registry)

    def opened(self) -> None:
        self.inflight.inc()

    def closed(self, status: Status, duration_s: float) -> None:
        self.inflight.dec()
        self.duration.observe(duration_s)
        self.ended.labels(go_code(status)).inc()


@dataclass
class Observer:
    observe: Callable[[float], None]


def old(new: str, help_: str) -> str:
    return alpha(f"[Deprecated: Use {new}] {help_}")


class ReplacingRegistry(CollectorRegistry):
    """A registry that registers each of ``replacements`` in place of a collector of the same name
    (so the reference's own family is where the replaced one would be in the exposition)."""

    def __init__(self, replacements: list[Gauge]) -> None:
        super().__init__()
        self.replacements = replacements

    def register(self, collector: Collector) -> None:
        names = {metric.name for metric in collector.describe()}
        for replacement in self.replacements:
            if names & {metric.name for metric in replacement.describe()}:
                collector = replacement
        super().register(collector)


class ReferenceMetrics:
    """The per-request part of PickerMetrics on prometheus_client's own metrics, written as
    llm-d-router writes them: every observation into the llm_d_epp_* family and its deprecated one."""

    def __init__(self, pool: str, *, stream_metrics: bool = False) -> None:
        self.pool = pool
        self.labels = ModelLabels()
        self.fairness = BoundedLabel()
        # The in-flight gauges, written as llm-d-router's inflight-load-producer writes them (at each dispatch
        # and release; fairness_id bounded as the request families are, which it does not do), registered
        # where LlmdGauges registers its own.
        inflight = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]
        self.inflight_requests = Gauge("llm_d_epp_inflight_requests", alpha(
            "Current number of in-flight requests per endpoint, as tracked by the in-flight load producer."),
            inflight, registry=None)
        self.inflight_tokens = Gauge("llm_d_epp_inflight_tokens", alpha(
            "Current number of in-flight tokens per endpoint (uncached prompt tokens, optionally plus estimated "
            "output), as tracked by the in-flight load producer."), inflight, registry=None)
        self.registry = r = ReplacingRegistry([self.inflight_requests, self.inflight_tokens])
        req = _REQUEST
        self.requests = Counter("llm_d_epp_request", alpha("Total number of processed requests."), req, registry=r)
        self.errors = Counter("llm_d_epp_request_error", alpha("Total number of request errors."),
                              [*req, "error_code"], registry=r)
        self.duration = Histogram("llm_d_epp_request_duration_seconds",
                                  alpha("End-to-end request latency distribution in seconds."), req,
                                  buckets=_DURATION_BUCKETS, registry=r)
        self.request_sizes = Histogram("llm_d_epp_request_size_bytes",
                                       alpha("Incoming request body size distribution in bytes."), req,
                                       buckets=_REQUEST_SIZE_BUCKETS, registry=r)
        self.response_sizes = Histogram("llm_d_epp_response_size_bytes",
                                        alpha("Outgoing response body size distribution in bytes."), req,
                                        buckets=_RESPONSE_SIZE_BUCKETS, registry=r)
        self.input_tokens = Histogram("llm_d_epp_request_input_tokens",
                                      alpha("Input token count distribution per request."), req,
                                      buckets=_INPUT_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("llm_d_epp_request_output_tokens",
                                       alpha("Output token count distribution per request."), req,
                                       buckets=_OUTPUT_TOKEN_BUCKETS, registry=r)
        self.cached_tokens = Histogram("llm_d_epp_request_cached_tokens", alpha(
            "Distribution of prompt tokens read from cache per request, as reported by the model server in the "
            "response."), req, buckets=_INPUT_TOKEN_BUCKETS, registry=r)
        self.running = Gauge("llm_d_epp_request_running", alpha("Current number of active running requests."), req,
                             registry=r)
        self.ntpot = Histogram("llm_d_epp_request_ntpot_seconds", alpha(
            "Normalized time per output token in seconds (end-to-end latency divided by output token count)."),
            req, buckets=_NTPOT_BUCKETS, registry=r)
        self.ttft = Histogram("llm_d_epp_request_ttft_seconds", alpha(
            "Time to first token in seconds, measured from request received to first response byte. For "
            "non-streaming requests, this equals total request duration."), [*req, "streaming"],
            buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("llm_d_epp_request_streaming_tpot_seconds", alpha(
            "Average time per output token in seconds for streaming requests, computed as (e2e - TTFT) / "
            "(output_tokens - 1)."), req, buckets=_TPOT_BUCKETS, registry=r)
        self.itl = Histogram("llm_d_epp_request_streaming_itl_seconds", alpha(
            "Inter-token latency in seconds for streaming requests, measured as the time between consecutive "
            "response body chunks."), req, buckets=_ITL_BUCKETS, registry=r)
        self.old_requests = Counter("inference_objective_request", old(
            "llm_d_epp_request_total",
            "Counter of inference objective requests broken out for each model and target model."),
            [*_MODEL, "priority"], registry=r)
        self.old_errors = Counter("inference_objective_request_error", old(
            "llm_d_epp_request_error_total",
            "Counter of inference objective requests errors broken out for each model and target model."),
            [*_MODEL, "error_code"], registry=r)
        self.old_duration = Histogram("inference_objective_request_duration_seconds", old(
            "llm_d_epp_request_duration_seconds",
            "Inference objective response latency distribution in seconds for each model and target model."),
            _MODEL, buckets=_DURATION_BUCKETS, registry=r)
        self.old_request_sizes = Histogram("inference_objective_request_sizes", old(
            "llm_d_epp_request_size_bytes",
            "Inference objective requests size distribution in bytes for each model and target model."),
            _MODEL, buckets=_REQUEST_SIZE_BUCKETS, registry=r)
        self.old_response_sizes = Histogram("inference_objective_response_sizes", old(
            "llm_d_epp_response_size_bytes",
            "Inference objective responses size distribution in bytes for each model and target model."),
            _MODEL, buckets=_RESPONSE_SIZE_BUCKETS, registry=r)
        self.old_input_tokens = Histogram("inference_objective_input_tokens", old(
            "llm_d_epp_request_input_tokens",
            "Inference objective input token count distribution for requests in each model."),
            _MODEL, buckets=_INPUT_TOKEN_BUCKETS, registry=r)
        self.old_output_tokens = Histogram("inference_objective_output_tokens", old(
            "llm_d_epp_request_output_tokens",
            "Inference objective output token count distribution for requests in each model."),
            _MODEL, buckets=_OUTPUT_TOKEN_BUCKETS, registry=r)
        self.old_cached_tokens = Histogram("inference_objective_prompt_cached_tokens", old(
            "llm_d_epp_request_cached_tokens",
            "Inference objective prompt cached token count distribution for requests in each model."),
            _MODEL, buckets=_INPUT_TOKEN_BUCKETS, registry=r)
        self.old_running = Gauge("inference_objective_running_requests", old(
            "llm_d_epp_request_running", "Inference objective number of running requests in each model."),
            ["model_name"], registry=r)
        self.old_ntpot = Histogram("inference_objective_normalized_time_per_output_token_seconds", old(
            "llm_d_epp_request_ntpot_seconds",
            "Inference objective latency divided by number of output tokens in seconds for each model and target "
            "model."), _MODEL, buckets=_NTPOT_BUCKETS, registry=r)
        e2e = "End-to-end scheduling latency distribution in seconds."
        self.scheduling = Histogram("llm_d_epp_scheduler_e2e_duration_seconds", alpha(e2e),
                                    buckets=_SCHEDULER_BUCKETS, registry=r)
        self.old_scheduling = Histogram("inference_extension_scheduler_e2e_duration_seconds",
                                        old("llm_d_epp_scheduler_e2e_duration_seconds", e2e),
                                        buckets=_SCHEDULER_BUCKETS, registry=r)
        attempts = "Total number of scheduling attempts."
        self.attempts = Counter("llm_d_epp_scheduler_attempts", alpha(attempts),
                                ["status", "target_model_name", "endpoint_name", "namespace", "port"], registry=r)
        self.old_attempts = Counter("inference_extension_scheduler_attempts",
                                    old("llm_d_epp_scheduler_attempts_total", attempts),
                                    ["status", "target_model_name", "pod_name", "namespace", "port"], registry=r)
        plugin = ["extension_point", "plugin_type", "plugin_name"]
        self.plugin_duration = Histogram("llm_d_epp_plugin_duration_seconds", alpha(_PLUGIN_HELP), plugin,
                                         buckets=_SCHEDULER_BUCKETS, registry=r)
        self.old_plugin_duration = Histogram("inference_extension_plugin_duration_seconds",
                                             old("llm_d_epp_plugin_duration_seconds", _PLUGIN_HELP), plugin,
                                             buckets=_SCHEDULER_BUCKETS, registry=r)
        Counter("llm_d_epp_plugin_data_scope_violations", alpha(
            "Total number of endpoint attribute accesses rejected because the plugin did not declare the DataKey "
            "in Produces() or Consumes(), by extension point, plugin type, plugin name and access kind (read or "
            "write). A non-zero value means a plugin's implementation has drifted from its declaration; rejected "
            "reads resolve as absent and rejected writes are dropped."), [*plugin, "access"], registry=r)
        self.request_processing = Histogram("llm_d_epp_request_processing_duration_seconds", alpha(
            "EPP request processing latency distribution in seconds, from request receipt until the request body "
            "has been handled, including admission control."), buckets=_REQUEST_PROCESSING_BUCKETS, registry=r)
        self.response_processing = Histogram("llm_d_epp_response_processing_duration_seconds", alpha(
            "EPP response processing latency distribution in seconds: the sum of per-chunk handler time for a "
            "streamed response, or the interval from response headers to completion for a non-streaming "
            "response."), buckets=_RESPONSE_PROCESSING_BUCKETS, registry=r)
        rewrite = ["model_rewrite_name", "model_name", "target_model"]
        self.rewrites = Counter("llm_d_epp_model_rewrite_decisions",
                                alpha("Total number of inference model rewrite decisions."), rewrite, registry=r)
        self.old_rewrites = Counter("inference_extension_model_rewrite_decisions",
                                    alpha("Total number of inference model rewrite decisions."), rewrite, registry=r)
        self.prefix_size = Gauge("inference_extension_prefix_indexer_size", "Block hashes in the prefix index",
                                 registry=r)
        self.prefix_ratio = Histogram("inference_extension_prefix_indexer_hit_ratio",
                                      "Matched share of the prompt's prefix blocks",
                                      buckets=tuple(i / 10 for i in range(11)), registry=r)
        self.prefix_bytes = Histogram("inference_extension_prefix_indexer_hit_bytes", "Matched prefix bytes",
                                      buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                                               65536), registry=r)
        self.served = Counter("inference_extension_served_requests", "Requests Envoy reports served, by endpoint",
                              ["endpoint"], registry=r)
        self.tokens = Counter("inference_objective_tokens", "Tokens reported in responses, by model and kind",
                              ["model_name", "kind"], registry=r)
        LlmdGauges(r, pool, f"evergreen-trio-{VERSION}")  # prometheus_client's own gauges, as in PickerMetrics
        self.tickets: list[list[Any]] = []  # [labels, prompt tokens held, tokens held, requests held]
        self.streams = ReferenceStreamMetrics(r) if stream_metrics else None
        self.reclamation = ReclamationMetrics(r, pool)  # prometheus_client's own metrics, as in PickerMetrics

    def dispatch(self, address: str, fairness_id: str, priority: int, tokens: int) -> None:
        labels = (address, "", PRODUCER_NAME, self.fairness.bound(fairness_id), str(priority))
        self.inflight_requests.labels(*labels).inc()
        self.inflight_tokens.labels(*labels).inc(tokens)
        self.tickets.append([labels, tokens, tokens, 1])

    def release_prompt(self, index: int) -> None:
        ticket = self.tickets[index]
        give, ticket[1] = min(ticket[1], ticket[2]), 0
        if give:
            ticket[2] -= give
            self.inflight_tokens.labels(*ticket[0]).dec(give)

    def release(self, index: int) -> None:
        ticket = self.tickets[index]
        if ticket[2]:
            self.inflight_tokens.labels(*ticket[0]).dec(ticket[2])
            ticket[1] = ticket[2] = 0
        if ticket[3]:
            ticket[3] = 0
            self.inflight_requests.labels(*ticket[0]).dec()

    def _labels(self, report: StreamReport) -> tuple[str, str, str, str]:
        model, target = self.labels.pair(report.client_model, report.target_model)
        return model, target, self.fairness.bound(report.fairness_id), str(report.priority)

    def started(self, report: StreamReport) -> None:
        labels = self._labels(report)
        if report.client_model:
            self.running.labels(*labels).inc()
            self.old_running.labels(labels[0]).inc()
        report.itl = Observer(lambda gap: self.itl.labels(*labels).observe(gap))

    def record(self, report: StreamReport, duration_s: float, *, prefix_index_size: int | None = None) -> None:
        labels = self._labels(report)
        model, target, _, priority = labels
        if report.error is not None:
            code = error_code(report.error)
            self.errors.labels(*labels, code).inc()
            self.old_errors.labels(model, target, code).inc()
        if report.processing_s is not None:
            self.request_processing.observe(report.processing_s)
        if report.scheduled is not None:
            endpoint = report.endpoint if report.scheduled else ""
            values = ("success" if report.scheduled else "failure", self.labels.name(report.target_model), endpoint,
                      "", endpoint.rpartition(":")[2] if endpoint else "")
            self.attempts.labels(*values).inc()
            self.old_attempts.labels(*values).inc()
        if report.routed:
            if report.client_model:
                self.running.labels(*labels).dec()
                self.old_running.labels(model).dec()
            self.requests.labels(*labels).inc()
            self.old_requests.labels(model, target, priority).inc()
            for new, legacy, value in ((self.duration, self.old_duration, duration_s),
                                       (self.request_sizes, self.old_request_sizes, report.request_bytes),
                                       (self.response_sizes, self.old_response_sizes, report.response_bytes)):
                new.labels(*labels).observe(value)
                legacy.labels(model, target).observe(value)
            if report.ttft_s is not None and report.ttft_s > 0:
                self.ttft.labels(*labels, "true" if report.streaming else "false").observe(report.ttft_s)
            if report.response_processing_s > 0:
                self.response_processing.observe(report.response_processing_s)
            if report.rewrite is not None:
                self.rewrites.labels(report.rewrite, model, target).inc()
                self.old_rewrites.labels(report.rewrite, model, target).inc()
        if report.scheduling_s is not None:
            self.scheduling.observe(report.scheduling_s)
            self.old_scheduling.observe(report.scheduling_s)
        for plugin, seconds in report.scorer_s.items():
            self.plugin_duration.labels("Scorer", plugin, plugin).observe(seconds)
            self.old_plugin_duration.labels("Scorer", plugin, plugin).observe(seconds)
        if report.prefix_match is not None:
            matched, total = report.prefix_match
            self.prefix_bytes.observe(matched)
            if total:
                self.prefix_ratio.observe(matched / total)
        if prefix_index_size is not None:
            self.prefix_size.set(prefix_index_size)
        for endpoint in report.served:
            self.served.labels(endpoint).inc()
        usage = report.usage
        if usage is not None:
            if usage.prompt_tokens:
                self.input_tokens.labels(*labels).observe(usage.prompt_tokens)
                self.old_input_tokens.labels(model, target).observe(usage.prompt_tokens)
            if usage.completion_tokens:
                self.output_tokens.labels(*labels).observe(usage.completion_tokens)
                self.old_output_tokens.labels(model, target).observe(usage.completion_tokens)
                if report.routed:
                    ntpot = duration_s / usage.completion_tokens
                    self.ntpot.labels(*labels).observe(ntpot)
                    self.old_ntpot.labels(model, target).observe(ntpot)
                    ttft = report.ttft_s
                    if report.streaming and usage.completion_tokens > 1 and ttft is not None and 0 < ttft < duration_s:
                        self.tpot.labels(*labels).observe((duration_s - ttft) / (usage.completion_tokens - 1))
            if usage.cached_tokens is not None:
                self.cached_tokens.labels(*labels).observe(usage.cached_tokens)
                self.old_cached_tokens.labels(model, target).observe(usage.cached_tokens)
            for kind, value in (("prompt", usage.prompt_tokens), ("completion", usage.completion_tokens),
                                ("cached", usage.cached_tokens)):
                if value:
                    self.tokens.labels(model, kind).inc(value)


BOUNDARIES = sorted({float(b) for buckets in (_DURATION_BUCKETS, _SCHEDULER_BUCKETS, _NTPOT_BUCKETS, _STREAM_BUCKETS,
                                              _TTFT_BUCKETS, _TPOT_BUCKETS, _ITL_BUCKETS, _REQUEST_PROCESSING_BUCKETS,
                                              _RESPONSE_PROCESSING_BUCKETS) for b in buckets}
                    | {i / 10 for i in range(11)})
SIZES = sorted({int(b) for buckets in (_REQUEST_SIZE_BUCKETS, _RESPONSE_SIZE_BUCKETS, _INPUT_TOKEN_BUCKETS,
                                       _OUTPUT_TOKEN_BUCKETS) for b in buckets})
# Seconds: every bucket bound exactly (``le`` is inclusive), next to one, anywhere, and the odd ones.
seconds = st.one_of(st.sampled_from(BOUNDARIES), st.sampled_from(BOUNDARIES).map(lambda b: math.nextafter(b, 0)),
                    st.sampled_from(BOUNDARIES).map(lambda b: math.nextafter(b, math.inf)),
                    st.floats(min_value=0, max_value=1e5), st.sampled_from([math.inf, math.nan, 0.0]))
sizes = st.one_of(st.sampled_from(SIZES), st.sampled_from(SIZES).map(lambda b: b + 1), st.integers(0, 2**40))
tokens = st.one_of(st.none(), st.just(0), sizes)
models = st.sampled_from(["", "m", "food-review", "food-review-v1", "other", "x" * 300, "tab\tname"])
reports = st.builds(
    StreamReport,
    client_model=models,
    target_model=models,
    fairness_id=st.sampled_from(["default-flow", "tenant-a", "tenant-b", "tenant-c", "other", ""]),
    priority=st.integers(-2, 2),
    streaming=st.booleans(),
    routed=st.booleans(),
    scheduled=st.one_of(st.none(), st.booleans()),
    endpoint=st.sampled_from(["10.0.0.1:8000", "[::1]:9", ""]),
    rewrite=st.one_of(st.none(), st.sampled_from(["food-review", "x"])),
    error=st.one_of(st.none(), st.sampled_from([400, 404, 413, 429, 500, 502, 503])),
    request_bytes=sizes,
    response_bytes=sizes,
    scheduling_s=st.one_of(st.none(), seconds),
    scorer_s=st.dictionaries(st.sampled_from(["queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"]),
                             seconds, max_size=3),
    prefix_match=st.one_of(st.none(), st.tuples(st.integers(0, 70_000), st.integers(0, 70_000))),
    served=st.lists(st.sampled_from(["10.0.0.1:8000", "10.0.0.2:8000", "[::1]:9"]), max_size=2),
    usage=st.one_of(st.none(), st.builds(Usage, prompt_tokens=tokens, completion_tokens=tokens,
                                         cached_tokens=tokens)),
    processing_s=st.one_of(st.none(), seconds),
    ttft_s=st.one_of(st.none(), seconds),
    response_processing_s=st.one_of(st.just(0.0), seconds),
)
# (report, started first, its chunk gaps, duration, prefix index size), or a stream's end (status, duration),
# or a scrape (both expositions compared then).
ENDPOINTS = ("10.0.0.1:8000", "[::1]:9")
PRODUCER_NAME = "load"
operations = st.lists(st.one_of(
    st.tuples(st.just("record"), reports, st.booleans(), st.lists(seconds, max_size=3), seconds,
              st.one_of(st.none(), st.integers(0, 10**6))),
    st.tuples(st.just("stream"), st.sampled_from(list(Status)), seconds),
    st.tuples(st.just("dispatch"), st.sampled_from(ENDPOINTS), reports.map(lambda r: r.fairness_id),
              st.integers(-2, 2), st.integers(0, 10**6)),
    st.tuples(st.sampled_from(["release_prompt", "release"]), st.integers(0, 30)),
    st.tuples(st.just("scrape")),
), max_size=25)


class Inflight:
    """Our side of the in-flight operations: the real :class:`InflightLoad` and its tickets, observed into
    ``metrics`` after each (the picker observes after each endpoint scrape)."""

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics = metrics
        self.load = InflightLoad(LoadConfig(producer_name=PRODUCER_NAME))
        self.snapshot = PoolSnapshot([Endpoint(a.rpartition(":")[0].strip("[]"), int(a.rpartition(":")[2]))
                                      for a in ENDPOINTS], 2.0, lambda: 0.0)
        self.tickets: list[Ticket] = []

    def dispatch(self, address: str, fairness_id: str, priority: int, tokens: int) -> None:
        self.tickets.append(self.load.dispatch(address, tokens, group=(fairness_id, priority)))
        self.observe()

    def release_prompt(self, index: int) -> None:
        self.tickets[index].release_prompt()
        self.observe()

    def release(self, index: int) -> None:
        self.tickets[index].release()
        self.observe()

    def observe(self) -> None:
        self.metrics.observe_load(self.snapshot, self.load, None)


@contextmanager
def frozen_clock() -> Iterator[list[float]]:
    """``time.time()`` reads the returned cell: both implementations stamp ``_created`` from it."""
    now = [1_700_000_000.0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", lambda: now[0])
        yield now


def apply(metrics: Any, operation: tuple[Any, ...], inflight: Any = None) -> None:
    """One operation on ``metrics`` (its in-flight ones on ``inflight``: ``metrics`` itself when None)."""
    inflight = metrics if inflight is None else inflight
    if operation[0] == "dispatch":
        inflight.dispatch(*operation[1:])
        return
    if operation[0] in ("release_prompt", "release"):
        if inflight.tickets:
            getattr(inflight, operation[0])(operation[1] % len(inflight.tickets))
        return
    if operation[0] == "stream":
        if metrics.streams is not None:
            metrics.streams.opened()
            metrics.streams.closed(operation[1], operation[2])
        return
    _, report, started, gaps, duration_s, index_size = operation
    if started:
        metrics.started(report)
        for gap in gaps:
            report.itl.observe(gap)
    metrics.record(report, duration_s, prefix_index_size=index_size)


# The deprecated histograms PickerMetrics derives: their _sum adds the llm_d_epp_* series' sums.
DERIVED_SUMS = ("inference_objective_", "inference_extension_scheduler_e2e_", "inference_extension_plugin_duration_")


def _same_sum(ours: str, theirs: str) -> bool:
    (name, value), (their_name, their_value) = ours.rsplit(" ", 1), theirs.rsplit(" ", 1)
    a, b = float(value), float(their_value)
    return name == their_name and (math.isclose(a, b, rel_tol=1e-9) or (math.isnan(a) and math.isnan(b)))


def assert_same(ours: bytes, theirs: bytes) -> None:
    """The same exposition, but for the last digits of a derived histogram's ``_sum``."""
    for mine, other in zip(ours.decode().splitlines(), theirs.decode().splitlines(), strict=True):
        if mine != other:
            assert mine.startswith(DERIVED_SUMS) and "_sum" in mine.split(" ")[0], (mine, other)
            assert _same_sum(mine, other), (mine, other)


def expositions(registry: CollectorRegistry) -> tuple[bytes, bytes]:
    return generate_latest(registry), generate_openmetrics(registry)


def assert_same_expositions(ours: CollectorRegistry, theirs: CollectorRegistry) -> None:
    for mine, other in zip(expositions(ours), expositions(theirs), strict=True):
        assert_same(mine, other)


@settings(max_examples=200, deadline=None)
@given(operations=operations, stream_metrics=st.booleans(), created=st.booleans(),
       fold_every=st.sampled_from([1, 3, telemetry.FOLD_EVERY]))
def test_exposition_is_the_same_as_prometheus_client_metrics(
        operations: list[tuple[Any, ...]], stream_metrics: bool, created: bool, fold_every: int) -> None:
    """The same exposition at every scrape, whenever the pending observations were folded."""
    try:
        if not created:
            disable_created_metrics()
        with frozen_clock() as now, pytest.MonkeyPatch.context() as patch:
            patch.setattr(telemetry, "FOLD_EVERY", fold_every)
            reference = ReferenceMetrics("pool", stream_metrics=stream_metrics)
            metrics = PickerMetrics("pool", stream_metrics=stream_metrics)
            reference.fairness, metrics.fairness = BoundedLabel(2), BoundedLabel(2)  # an overflow in reach
            assert_same_expositions(metrics.registry, reference.registry)
            inflight = Inflight(metrics)
            for operation in operations:
                now[0] += 1.5  # a series made now says so in its _created sample
                if operation[0] == "scrape":
                    assert_same_expositions(metrics.registry, reference.registry)
                    continue
                apply(reference, operation)
                apply(metrics, operation, inflight)
            now[0] += 1.5
            assert_same_expositions(metrics.registry, reference.registry)
    finally:
        enable_created_metrics()


def test_the_same_exposition_for_a_routed_and_observed_request() -> None:
    """A plain check beside the property: one streamed request's every metric, each family's samples compared."""
    report = StreamReport(client_model="m", target_model="m", fairness_id="tenant-a", priority=2, streaming=True,
                          routed=True, scheduled=True, endpoint="10.0.0.1:8000", request_bytes=120,
                          response_bytes=300, scheduling_s=0.0004,
                          scorer_s={"queue-scorer": 1e-5, "prefix-cache-scorer": 2e-5}, prefix_match=(64, 128),
                          served=["10.0.0.1:8000"], usage=Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=4),
                          processing_s=0.001, ttft_s=0.05, response_processing_s=0.0002)
    with frozen_clock():
        reference, metrics = ReferenceMetrics("pool"), PickerMetrics("pool")
        for implementation in (reference, metrics):
            implementation.started(report)
            assert report.itl is not None
            report.itl.observe(0.02)
            implementation.record(report, 0.25, prefix_index_size=7)
        for name in ("requests", "duration", "running", "scheduling", "plugin_duration", "prefix_ratio", "tokens",
                     "ttft", "tpot", "itl", "attempts"):
            assert getattr(metrics, name).collect() == getattr(reference, name).collect(), name
        assert generate_latest(metrics.registry) == generate_latest(reference.registry)
    got = samples(metrics.registry)
    labels = {"model_name": "m", "target_model_name": "m", "fairness_id": "tenant-a", "priority": "2"}
    assert got[key("llm_d_epp_request_total", **labels)] == 1
    assert got[key("inference_objective_request_total", model_name="m", target_model_name="m", priority="2")] == 1
    assert got[key("llm_d_epp_request_running", **labels)] == 0
    assert got[key("inference_objective_running_requests", model_name="m")] == 0
    assert got[key("llm_d_epp_request_ttft_seconds_bucket", **labels, streaming="true", le="0.05")] == 1
    assert got[key("llm_d_epp_request_streaming_tpot_seconds_sum", **labels)] == pytest.approx(0.1)  # (0.25-0.05)/2
    assert got[key("llm_d_epp_request_streaming_itl_seconds_bucket", **labels, le="0.02")] == 1
    assert got[key("llm_d_epp_request_cached_tokens_sum", **labels)] == 4
    assert got[key("inference_objective_prompt_cached_tokens_sum", model_name="m", target_model_name="m")] == 4
    endpoint = {"namespace": "", "port": "8000", "status": "success", "target_model_name": "m"}
    assert got[key("llm_d_epp_scheduler_attempts_total", endpoint_name="10.0.0.1:8000", **endpoint)] == 1
    assert got[key("inference_extension_scheduler_attempts_total", pod_name="10.0.0.1:8000", **endpoint)] == 1
    assert got[key("llm_d_epp_request_processing_duration_seconds_count")] == 1
    assert got[key("llm_d_epp_response_processing_duration_seconds_count")] == 1
    assert got[key("inference_extension_prefix_indexer_hit_ratio_bucket", le="0.5")] == 1
    text = generate_latest(metrics.registry).decode()
    assert "# HELP llm_d_epp_plugin_data_scope_violations_total [ALPHA] Total number" in text


def key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset(labels.items())


def samples(registry: CollectorRegistry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the registry's Prometheus text, by name and labels."""
    text = generate_latest(registry).decode()
    return {key(s.name, **s.labels): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def test_a_histogram_counts_each_value_in_the_first_bucket_whose_bound_is_at_least_it() -> None:
    family = HistogramFamily("h", "doc", buckets=(1, 2, 4))
    series = family.labels()
    for value in (0, 1, 1.5, 2, 4, 5, math.inf, math.nan):
        series.observe(value)
    assert series.counts == [2, 2, 1, 2]  # NaN is in no bucket (and in the sum), as prometheus_client has it
    assert math.isnan(series.sum)


def test_families_reject_what_prometheus_client_rejects() -> None:
    with pytest.raises(ValueError, match="sorted"):
        HistogramFamily("h", "doc", buckets=(2, 1))
    with pytest.raises(ValueError, match="at least 0"):  # prometheus_client would leave its _sum out
        HistogramFamily("h", "doc", buckets=(-1, 1))
    family = telemetry.CounterFamily("c", "doc", ["a"])
    with pytest.raises(ValueError, match="label count"):
        family.labels("x", "y")
    with pytest.raises(ValueError, match="non-negative"):
        family.labels("x").inc(-1)
    registry = CollectorRegistry()
    telemetry.CounterFamily("c", "doc", registry=registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("c", "doc", registry=registry)


def test_a_scrape_folding_while_values_come_loses_none() -> None:
    """A scrape in another thread folds a pending series while observations keep coming: each is
    counted once, and the sum is the one running sum."""
    family = HistogramFamily("h", "doc", buckets=(0.5, 1.0), pending=True)
    series = family.labels()
    values = [(i % 7) / 4 for i in range(100_000)]
    done = threading.Event()

    def scrape() -> None:
        while not done.is_set():
            family.series()

    scraper = threading.Thread(target=scrape)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns often
    scraper.start()
    try:
        for value in values:
            series.observe(value)
    finally:
        done.set()
        scraper.join()
        sys.setswitchinterval(interval)
    family.fold()
    expected = HistogramSeries(family.bounds, family.le)
    for value in values:
        expected.observe(value)
    assert (series.counts, series.sum, series.pending) == (expected.counts, expected.sum, [])
