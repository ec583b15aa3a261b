"""The picker's metrics expose what prometheus_client's own metrics did, byte for byte.

The per-request metrics are plain numbers read at scrape time (:mod:`evergreen_trio.picker.telemetry`).
``ReferenceMetrics`` below is :class:`PickerMetrics` as it was before, on prometheus_client's
``Counter``, ``Gauge`` and ``Histogram``: for any sequence of stream reports, both expositions
(Prometheus text and OpenMetrics) are the same, ``_created`` timestamps included.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from grpclib.const import Status
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics, enable_created_metrics
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from evergreen_trio.picker import telemetry
from evergreen_trio.picker.guards import ModelLabels
from evergreen_trio.picker.processor import StreamReport
from evergreen_trio.picker.reclamation_metrics import ReclamationMetrics
from evergreen_trio.picker.telemetry import (
    _DURATION_BUCKETS,
    _INPUT_TOKEN_BUCKETS,
    _MODEL,
    _NTPOT_BUCKETS,
    _OUTPUT_TOKEN_BUCKETS,
    _REQUEST_SIZE_BUCKETS,
    _RESPONSE_SIZE_BUCKETS,
    _SCHEDULER_BUCKETS,
    _STREAM_BUCKETS,
    VERSION,
    HistogramFamily,
    PickerMetrics,
    error_code,
    go_code,
)
from evergreen_trio.picker.usage import Usage


class ReferenceStreamMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.inflight = Gauge("llm_d_epp_extproc_streams_inflight", "Number of ext_proc gRPC streams currently open.",
                              registry=registry)
        self.duration = Histogram("llm_d_epp_extproc_stream_duration_seconds",
                                  "Duration an ext_proc gRPC stream stays open, in seconds.",
                                  buckets=_STREAM_BUCKETS, registry=registry)
        self.ended = Counter("llm_d_epp_extproc_streams", "Total ext_proc gRPC streams completed, by gRPC status code.",
                             ["code"], registry=registry)

    def opened(self) -> None:
        self.inflight.inc()

    def closed(self, status: Status, duration_s: float) -> None:
        self.inflight.dec()
        self.duration.observe(duration_s)
        self.ended.labels(go_code(status)).inc()


class ReferenceMetrics:
    """The per-request part of the old PickerMetrics, verbatim (every family, in its order)."""

    def __init__(self, pool: str, *, stream_metrics: bool = False) -> None:
        self.pool = pool
        self.labels = ModelLabels()
        self.registry = r = CollectorRegistry()
        self.requests = Counter("inference_objective_request", "Requests routed, by model and target model",
                                _MODEL, registry=r)
        self.errors = Counter("inference_objective_request_error", "Requests answered with an error, by code",
                              [*_MODEL, "error_code"], registry=r)
        self.duration = Histogram("inference_objective_request_duration_seconds", "Request latency",
                                  _MODEL, buckets=_DURATION_BUCKETS, registry=r)
        self.request_sizes = Histogram("inference_objective_request_sizes", "Request body bytes",
                                       _MODEL, buckets=_REQUEST_SIZE_BUCKETS, registry=r)
        self.response_sizes = Histogram("inference_objective_response_sizes", "Response body bytes",
                                        _MODEL, buckets=_RESPONSE_SIZE_BUCKETS, registry=r)
        self.input_tokens = Histogram("inference_objective_input_tokens", "Prompt tokens per request",
                                      _MODEL, buckets=_INPUT_TOKEN_BUCKETS, registry=r)
        self.output_tokens = Histogram("inference_objective_output_tokens", "Completion tokens per request",
                                       _MODEL, buckets=_OUTPUT_TOKEN_BUCKETS, registry=r)
        self.running = Gauge("inference_objective_running_requests", "Requests routed and not yet finished",
                             ["model_name"], registry=r)
        self.ntpot = Histogram("inference_objective_normalized_time_per_output_token_seconds",
                               "Request latency divided by its completion tokens", _MODEL, buckets=_NTPOT_BUCKETS,
                               registry=r)
        self.scheduling = Histogram("inference_extension_scheduler_e2e_duration_seconds",
                                    "Time to pick an endpoint", buckets=_SCHEDULER_BUCKETS, registry=r)
        self.plugin_duration = Histogram("inference_extension_plugin_duration_seconds", "Time per scorer",
                                         ["extension_point", "plugin_type", "plugin_name"],
                                         buckets=_SCHEDULER_BUCKETS, registry=r)
        self.prefix_size = Gauge("inference_extension_prefix_indexer_size", "Block hashes in the prefix index",
                                 registry=r)
        self.prefix_ratio = Histogram("inference_extension_prefix_indexer_hit_ratio",
                                      "Matched share of the prompt's prefix blocks",
                                      buckets=tuple(i / 10 for i in range(11)), registry=r)
        self.prefix_bytes = Histogram("inference_extension_prefix_indexer_hit_bytes", "Matched prefix bytes",
                                      buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768,
                                               65536), registry=r)
        self.info = Gauge("inference_extension_info", "Build information", ["commit", "build_ref"], registry=r)
        self.info.labels("", f"evergreen-trio-{VERSION}").set(1)
        self.avg_queue = Gauge("inference_pool_average_queue_size", "Mean waiting requests per ready endpoint",
                               ["name"], registry=r)
        self.avg_kv = Gauge("inference_pool_average_kv_cache_utilization", "Mean KV-cache usage per ready endpoint",
                            ["name"], registry=r)
        self.ready = Gauge("inference_pool_ready_pods", "Endpoints whose last scrape succeeded", ["name"], registry=r)
        self.pod_queue = Gauge("inference_pool_per_pod_queue_size", "Waiting requests per endpoint",
                               ["name", "model_server_pod"], registry=r)
        self.served = Counter("inference_extension_served_requests", "Requests Envoy reports served, by endpoint",
                              ["endpoint"], registry=r)
        self.tokens = Counter("inference_objective_tokens", "Tokens reported in responses, by model and kind",
                              ["model_name", "kind"], registry=r)
        self.inflight_requests = Gauge("llm_d_epp_inflight_requests", "In-flight requests per endpoint",
                                       ["endpoint_name"], registry=r)
        self.inflight_tokens = Gauge("llm_d_epp_inflight_tokens", "In-flight tokens per endpoint",
                                     ["endpoint_name"], registry=r)
        self.queue_size = Gauge("llm_d_epp_flow_control_queue_size", "Requests held in the flow control queue",
                                ["priority", "inference_pool"], registry=r)
        self.queue_bytes = Gauge("llm_d_epp_flow_control_queue_bytes", "Bytes held in the flow control queue",
                                 ["priority", "inference_pool"], registry=r)
        self.saturation = Gauge("llm_d_epp_flow_control_pool_saturation",
                                "The saturation detector's reading per stage (prefill, decode) and the effective one",
                                ["inference_pool", "stage"], registry=r)
        self.stale_endpoints = Gauge("llm_d_epp_flow_control_stale_endpoints",
                                     "Endpoints the utilization detector last read as saturated for missing or "
                                     "stale metrics", ["detector"], registry=r)
        self.streams = ReferenceStreamMetrics(r) if stream_metrics else None
        self.reclamation = ReclamationMetrics(r, pool)  # prometheus_client's own metrics, as in PickerMetrics

    def started(self, report: StreamReport) -> None:
        self.running.labels(self.labels.name(report.client_model)).inc()

    def record(self, report: StreamReport, duration_s: float, *, prefix_index_size: int | None = None) -> None:
        labels = self.labels.pair(report.client_model, report.target_model)
        if report.error is not None:
            self.errors.labels(*labels, error_code(report.error)).inc()
        if report.routed:
            self.running.labels(self.labels.name(report.client_model)).dec()
            self.requests.labels(*labels).inc()
            self.duration.labels(*labels).observe(duration_s)
            self.request_sizes.labels(*labels).observe(report.request_bytes)
            self.response_sizes.labels(*labels).observe(report.response_bytes)
        if report.scheduling_s is not None:
            self.scheduling.observe(report.scheduling_s)
        for plugin, seconds in report.scorer_s.items():
            self.plugin_duration.labels("Scorer", plugin, plugin).observe(seconds)
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
            if usage.completion_tokens:
                self.output_tokens.labels(*labels).observe(usage.completion_tokens)
                if report.routed:
                    self.ntpot.labels(*labels).observe(duration_s / usage.completion_tokens)
            for kind, value in (("prompt", usage.prompt_tokens), ("completion", usage.completion_tokens),
                                ("cached", usage.cached_tokens)):
                if value:
                    self.tokens.labels(labels[0], kind).inc(value)


BOUNDARIES = sorted({float(b) for buckets in (_DURATION_BUCKETS, _SCHEDULER_BUCKETS, _NTPOT_BUCKETS,
                                              _STREAM_BUCKETS) for b in buckets} | {i / 10 for i in range(11)})
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
    routed=st.booleans(),
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
)
# (report, started first, duration, prefix index size), or a stream's end (status, duration).
operations = st.lists(st.one_of(
    st.tuples(st.just("record"), reports, st.booleans(), seconds, st.one_of(st.none(), st.integers(0, 10**6))),
    st.tuples(st.just("stream"), st.sampled_from(list(Status)), seconds),
), max_size=25)


@contextmanager
def frozen_clock() -> Iterator[list[float]]:
    """``time.time()`` reads the returned cell: both implementations stamp ``_created`` from it."""
    now = [1_700_000_000.0]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", lambda: now[0])
        yield now


def apply(metrics: Any, operation: tuple[Any, ...]) -> None:
    if operation[0] == "stream":
        if metrics.streams is not None:
            metrics.streams.opened()
            metrics.streams.closed(operation[1], operation[2])
        return
    _, report, started, duration_s, index_size = operation
    if started:
        metrics.started(report)
    metrics.record(report, duration_s, prefix_index_size=index_size)


def expositions(registry: CollectorRegistry) -> tuple[bytes, bytes]:
    return generate_latest(registry), generate_openmetrics(registry)


@settings(max_examples=200, deadline=None)
@given(operations=operations, stream_metrics=st.booleans(), created=st.booleans())
def test_exposition_is_the_same_as_prometheus_client_metrics(
        operations: list[tuple[Any, ...]], stream_metrics: bool, created: bool) -> None:
    try:
        if not created:
            disable_created_metrics()
        with frozen_clock() as now:
            reference = ReferenceMetrics("pool", stream_metrics=stream_metrics)
            metrics = PickerMetrics("pool", stream_metrics=stream_metrics)
            assert expositions(metrics.registry) == expositions(reference.registry)
            for operation in operations:
                now[0] += 1.5  # a series made now says so in its _created sample
                apply(reference, operation)
                apply(metrics, operation)
            now[0] += 1.5
            assert expositions(metrics.registry) == expositions(reference.registry)
    finally:
        enable_created_metrics()


def test_the_same_exposition_for_a_routed_and_observed_request() -> None:
    """A plain check beside the property: one request's every metric, each family's samples compared."""
    report = StreamReport(client_model="m", target_model="m", routed=True, request_bytes=120, response_bytes=300,
                          scheduling_s=0.0004, scorer_s={"queue-scorer": 1e-5, "prefix-cache-scorer": 2e-5},
                          prefix_match=(64, 128), served=["10.0.0.1:8000"],
                          usage=Usage(prompt_tokens=12, completion_tokens=3, cached_tokens=4))
    with frozen_clock():
        reference, metrics = ReferenceMetrics("pool"), PickerMetrics("pool")
        for implementation in (reference, metrics):
            implementation.started(report)
            implementation.record(report, 0.25, prefix_index_size=7)
        for name in ("requests", "duration", "running", "scheduling", "plugin_duration", "prefix_ratio", "tokens"):
            assert getattr(metrics, name).collect() == getattr(reference, name).collect(), name
        assert generate_latest(metrics.registry) == generate_latest(reference.registry)
    text = generate_latest(metrics.registry).decode()
    assert 'inference_objective_request_total{model_name="m",target_model_name="m"} 1.0' in text
    assert 'inference_objective_running_requests{model_name="m"} 0.0' in text
    assert "inference_extension_prefix_indexer_hit_ratio_bucket{le=\"0.5\"} 1.0" in text


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
