"""The picker's Prometheus metrics, named and labelled as the reference Endpoint Picker's.

One registry per picker instance. The sans-IO core reports what each stream did
(:class:`~evergreen_trio.picker.processor.StreamReport`); :meth:`PickerMetrics.record` turns it
into metrics. Error codes are the reference's names (``BadRequest``, ``BadConfiguration``,
``InferencePoolResourceExhausted``, ``ServiceUnavailable``), not HTTP statuses. Buckets are the
reference's too, so dashboards built for it read ours unchanged.

The metrics a request updates are plain numbers (:class:`CounterFamily`, :class:`GaugeFamily`,
:class:`HistogramFamily`): every request is counted on the picker's one Trio thread, so an update
is an addition, a bucket found by bisection, no lock. They are collectors of the same registry,
read into prometheus_client's metric families when it is scraped, and expose exactly what its
``Counter``, ``Gauge`` and ``Histogram`` would (names, labels, ``le`` values, ``_created``, series
order: ``tests/picker/test_telemetry.py`` compares the two). A scrape renders in a worker thread
and may see a request's updates half done, as prometheus_client's per-value locks allow too.
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from grpclib.const import Status
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from evergreen_trio.picker.flow_control.config import UtilizationDetector
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.guards import ModelLabels
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.processor import StreamReport
from evergreen_trio.picker.reclamation_metrics import ReclamationMetrics
from evergreen_trio.picker.scheduler import PoolSnapshot

VERSION = "0.1.0"
# HTTP status the picker answered with -> the reference's error code name.
ERROR_CODES = {400: "BadRequest", 404: "BadConfiguration", 413: "BadRequest", 429: "InferencePoolResourceExhausted",
               503: "ServiceUnavailable"}
_SCHEDULER_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_DURATION_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30,
                     45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600)
_REQUEST_SIZE_BUCKETS = tuple(float(2**i) for i in range(6, 31))
_RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
_INPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536, 131072,
                        262144, 524288, 1048576)
_OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_NTPOT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_STREAM_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600)
_MODEL = ["model_name", "target_model_name"]
# Labelled series kept at hand per picker; label values are already bounded (model names folded,
# pool endpoints, plugin names), this only caps the map against a pool that churns for months.
MAX_CACHED_SERIES = 4096
_ROUTED = object()  # the series map's key for a routed request's series of one label set
# The series map's keys for a stream's model names' labels, and for a client model's running series
# (ModelLabels' answer for a name or a pair never changes once given: caching it changes nothing).
_LABELS = object()
_RUNNING = object()
_T = TypeVar("_T")


def error_code(status: int) -> str:
    return ERROR_CODES.get(status, "Internal" if status >= 500 else "BadRequest")


def go_code(status: Status) -> str:
    """A gRPC status as Go's ``codes.Code.String()`` names it (``OK``, ``Canceled``, ``InvalidArgument``)."""
    if status is Status.CANCELLED:
        return "Canceled"
    return "OK" if status is Status.OK else status.name.title().replace("_", "")


# -- per-request metrics: plain numbers, read at scrape time ----------------------------------------

# prometheus_client leaves the ``_created`` samples out when told to (PROMETHEUS_DISABLE_CREATED_SERIES,
# disable_created_metrics()); an unregistered counter of its own says which, at each scrape.
_CREATED_PROBE = Counter("evergreen_created_probe", "", registry=None)


def _created_shown() -> bool:
    return any(s.name.endswith("_created") for metric in _CREATED_PROBE.collect() for s in metric.samples)


class CounterSeries:
    """One counter series: ``value`` only goes up."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount

    def expose(self, family: Any, labels: dict[str, str], created: bool) -> None:
        family.add_metric(labels.values(), self.value, created=self.created if created else None)


class GaugeSeries:
    """One gauge series."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value += -amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def expose(self, family: Any, labels: dict[str, str], created: bool) -> None:
        family.add_metric(labels.values(), self.value)


class HistogramSeries:
    """One histogram series: a count per bucket (not cumulative: summed at scrape time) and the sum."""

    __slots__ = ("bounds", "counts", "created", "labels", "sum")

    def __init__(self, bounds: list[float], labels: list[str]) -> None:
        self.bounds, self.labels = bounds, labels
        self.counts = [0.0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        bounds = self.bounds
        i = bisect_left(bounds, amount)  # the first bound >= amount (+Inf is last)
        if amount <= bounds[i]:  # false only for NaN, which no bucket counts
            self.counts[i] += 1

    def expose(self, family: Any, labels: dict[str, str], created: bool) -> None:
        buckets, total = [], 0.0
        for le, count in zip(self.labels, self.counts, strict=True):
            total += count
            buckets.append((le, total))
        family.add_metric(labels.values(), buckets, self.sum)  # every bound is >= 0: _count and _sum follow
        if created:  # which HistogramMetricFamily does not write
            family.samples.append(Sample(family.name + "_created", labels, self.created, None))


class _Family:
    """A metric family of per-request series, a collector in ``registry``: what prometheus_client's
    metric of this type and these label names exposes, series in the order they were first used."""

    family: Any = None  # prometheus_client's metric family class of the type

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None) -> None:
        self.name, self.documentation = name, documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], Any] = {}
        self._lock = threading.Lock()  # series made here vs. a scrape's copy (scrapes render in a worker thread)
        if not self.labelnames:
            self.labels()  # the one series, there from the start
        if registry is not None:
            registry.register(self)

    def _new(self) -> Any:
        raise NotImplementedError

    def labels(self, *values: object) -> Any:
        """The series of these label values (made on first use; with no label names, the one series)."""
        if len(values) != len(self.labelnames):
            raise ValueError("Incorrect label count")
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.setdefault(key, self._new())
        return child

    def describe(self) -> list[Metric]:
        return [self.family(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[Metric]:
        family = self.family(self.name, self.documentation, labels=self.labelnames)
        created = _created_shown()
        with self._lock:
            children = list(self._children.items())
        for values, child in children:
            child.expose(family, dict(zip(self.labelnames, values, strict=True)), created)
        return [family]


class CounterFamily(_Family):
    family = CounterMetricFamily

    def _new(self) -> CounterSeries:
        return CounterSeries()


class GaugeFamily(_Family):
    family = GaugeMetricFamily

    def _new(self) -> GaugeSeries:
        return GaugeSeries()


class HistogramFamily(_Family):
    family = HistogramMetricFamily

    def __init__(self, name: str, documentation: str, labelnames: Iterable[str] = (),
                 registry: CollectorRegistry | None = None, *, buckets: Sequence[float]) -> None:
        # prometheus_client's own histogram checks the buckets and writes their ``le`` values
        stock = Histogram(name, documentation, buckets=buckets, registry=None)
        self.le = [s.labels["le"] for metric in stock.collect() for s in metric.samples if s.name.endswith("_bucket")]
        self.bounds = [float(b) for b in buckets]
        if self.bounds[-1] != math.inf:
            self.bounds.append(math.inf)
        if self.bounds[0] < 0:  # prometheus_client leaves _sum out then, its metric family _count too
            raise ValueError("expected buckets of at least 0")
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> HistogramSeries:
        return HistogramSeries(self.bounds, self.le)


def _single(family: _Family) -> Any:
    """The one series of a family without label names (made with the family, as prometheus_client's)."""
    return family.labels()


class StreamMetrics:
    """llm-d-router's opt-in ext_proc stream metrics (``--enable-grpc-stream-metrics``): the streams
    open, how long each stayed open, and how many ended with each gRPC code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.inflight = GaugeFamily("llm_d_epp_extproc_streams_inflight",
                                    "Number of ext_proc gRPC streams currently open.", registry=registry)
        self.duration = HistogramFamily("llm_d_epp_extproc_stream_duration_seconds",
                                        "Duration an ext_proc gRPC stream stays open, in seconds.",
                                        buckets=_STREAM_BUCKETS, registry=registry)
        self.ended = CounterFamily("llm_d_epp_extproc_streams",
                                   "Total ext_proc gRPC streams completed, by gRPC status code.", ["code"],
                                   registry=registry)
        self._inflight: GaugeSeries = _single(self.inflight)
        self._duration: HistogramSeries = _single(self.duration)

    def opened(self) -> None:
        self._inflight.inc()

    def closed(self, status: Status, duration_s: float) -> None:
        self._inflight.dec()
        self._duration.observe(duration_s)
        self.ended.labels(go_code(status)).inc()


class PickerMetrics:
    """The reference's metrics plus ours (served endpoints, tokens by kind).

    Model names are folded by ``labels`` (:class:`~evergreen_trio.picker.guards.ModelLabels`:
    unlisted and surplus names become ``other``), so clients cannot grow the label set.
    ``streams`` (:class:`StreamMetrics`) only with ``stream_metrics``, as the reference registers them.
    """

    def __init__(self, pool: str, registry: CollectorRegistry | None = None,
                 labels: ModelLabels | None = None, *, stream_metrics: bool = False) -> None:
        self.pool = pool
        self.labels = labels if labels is not None else ModelLabels()
        self._series: dict[tuple[object, ...], Any] = {}
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = CounterFamily("inference_objective_request", "Requests routed, by model and target model",
                                      _MODEL, registry=r)
        self.errors = CounterFamily("inference_objective_request_error", "Requests answered with an error, by code",
                                    [*_MODEL, "error_code"], registry=r)
        self.duration = HistogramFamily("inference_objective_request_duration_seconds", "Request latency",
                                        _MODEL, buckets=_DURATION_BUCKETS, registry=r)
        self.request_sizes = HistogramFamily("inference_objective_request_sizes", "Request body bytes",
                                             _MODEL, buckets=_REQUEST_SIZE_BUCKETS, registry=r)
        self.response_sizes = HistogramFamily("inference_objective_response_sizes", "Response body bytes",
                                              _MODEL, buckets=_RESPONSE_SIZE_BUCKETS, registry=r)
        self.input_tokens = HistogramFamily("inference_objective_input_tokens", "Prompt tokens per request",
                                            _MODEL, buckets=_INPUT_TOKEN_BUCKETS, registry=r)
        self.output_tokens = HistogramFamily("inference_objective_output_tokens", "Completion tokens per request",
                                             _MODEL, buckets=_OUTPUT_TOKEN_BUCKETS, registry=r)
        self.running = GaugeFamily("inference_objective_running_requests", "Requests routed and not yet finished",
                                   ["model_name"], registry=r)
        self.ntpot = HistogramFamily("inference_objective_normalized_time_per_output_token_seconds",
                                     "Request latency divided by its completion tokens", _MODEL,
                                     buckets=_NTPOT_BUCKETS, registry=r)
        self.scheduling = HistogramFamily("inference_extension_scheduler_e2e_duration_seconds",
                                          "Time to pick an endpoint", buckets=_SCHEDULER_BUCKETS, registry=r)
        self.plugin_duration = HistogramFamily("inference_extension_plugin_duration_seconds", "Time per scorer",
                                               ["extension_point", "plugin_type", "plugin_name"],
                                               buckets=_SCHEDULER_BUCKETS, registry=r)
        self.prefix_size = GaugeFamily("inference_extension_prefix_indexer_size", "Block hashes in the prefix index",
                                       registry=r)
        self.prefix_ratio = HistogramFamily("inference_extension_prefix_indexer_hit_ratio",
                                            "Matched share of the prompt's prefix blocks",
                                            buckets=tuple(i / 10 for i in range(11)), registry=r)
        self.prefix_bytes = HistogramFamily("inference_extension_prefix_indexer_hit_bytes", "Matched prefix bytes",
                                            buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                     32768, 65536), registry=r)
        self.info = Gauge("inference_extension_info", "Build information", ["commit", "build_ref"], registry=r)
        self.info.labels("", f"evergreen-trio-{VERSION}").set(1)
        self.avg_queue = Gauge("inference_pool_average_queue_size", "Mean waiting requests per ready endpoint",
                               ["name"], registry=r)
        self.avg_kv = Gauge("inference_pool_average_kv_cache_utilization", "Mean KV-cache usage per ready endpoint",
                            ["name"], registry=r)
        self.ready = Gauge("inference_pool_ready_pods", "Endpoints whose last scrape succeeded", ["name"], registry=r)
        self.pod_queue = Gauge("inference_pool_per_pod_queue_size", "Waiting requests per endpoint",
                               ["name", "model_server_pod"], registry=r)
        self.served = CounterFamily("inference_extension_served_requests",
                                    "Requests Envoy reports served, by endpoint", ["endpoint"], registry=r)
        self.tokens = CounterFamily("inference_objective_tokens", "Tokens reported in responses, by model and kind",
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
        self.streams = StreamMetrics(r) if stream_metrics else None
        # In-flight eviction (flowControl.enableEviction): the reclamation controller reports here.
        self.reclamation = ReclamationMetrics(r, pool)
        self._scheduling: HistogramSeries = _single(self.scheduling)
        self._prefix_size: GaugeSeries = _single(self.prefix_size)
        self._prefix_ratio: HistogramSeries = _single(self.prefix_ratio)
        self._prefix_bytes: HistogramSeries = _single(self.prefix_bytes)

    def _series_of(self, metric: _Family, *values: str) -> Any:
        """``metric.labels(*values)``, looked up in one map (per-request metrics are never cleared,
        so a series once made stays valid)."""
        key = (metric, values)
        series = self._series.get(key)
        return series if series is not None else self._cache(key, metric.labels(*values))

    def _routed_series(self, labels: tuple[str, str], running: str) -> tuple[Any, ...]:
        """A routed request's series (running, requests, duration, request and response sizes) by
        one lookup; made in that order the first time, as one by one."""
        key = (_ROUTED, (*labels, running))
        series = self._series.get(key)
        if series is None:
            series = self._cache(key, (
                self._series_of(self.running, running), self._series_of(self.requests, *labels),
                self._series_of(self.duration, *labels), self._series_of(self.request_sizes, *labels),
                self._series_of(self.response_sizes, *labels)))
        return series

    def _cache(self, key: tuple[object, ...], value: _T) -> _T:
        """Keep ``value`` at ``key`` in the series map (cleared when full: its keys come from clients)."""
        if len(self._series) >= MAX_CACHED_SERIES:
            self._series.clear()
        self._series[key] = value
        return value

    def _labels_of(self, client_model: str, target_model: str) -> tuple[tuple[str, str], str]:
        """The (model, target model) label values of a stream's model names, and its running
        series' model label (made in that order the first time, as before they were cached)."""
        return self._cache((_LABELS, client_model, target_model), (
            self.labels.pair(client_model, target_model), self.labels.name(client_model)))

    def _running_of(self, client_model: str) -> GaugeSeries:
        series: GaugeSeries = self._series_of(self.running, self.labels.name(client_model))
        return self._cache((_RUNNING, client_model), series)

    def _scorer_series(self, plugin: str) -> HistogramSeries:
        key = (self.plugin_duration, plugin)
        series: HistogramSeries | None = self._series.get(key)
        if series is None:
            series = self._cache(key, self._series_of(self.plugin_duration, "Scorer", plugin, plugin))
        return series

    def observe_load(self, snapshot: PoolSnapshot, load: InflightLoad, flow: FlowGate | None) -> None:
        """The picker's in-flight counts per endpoint and, with flow control, its queue and saturation
        (llm-d-router's ``llm_d_epp_*`` names)."""
        self.inflight_requests.clear()
        self.inflight_tokens.clear()
        for address in snapshot.states:
            self.inflight_requests.labels(address).set(load.requests(address))
            self.inflight_tokens.labels(address).set(load.tokens(address))
        if flow is not None:
            self.queue_size.clear()
            self.queue_bytes.clear()
            for priority, (requests, size) in flow.queue.stats().items():
                self.queue_size.labels(str(priority), self.pool).set(requests)
                self.queue_bytes.labels(str(priority), self.pool).set(size)
            flow.saturation()  # read now: the stages' readings too
            self.saturation.clear()  # a stage with no endpoint is no series, as the reference deletes it
            for stage, reading in flow.readings.items():
                self.saturation.labels(self.pool, stage).set(reading.saturation)
            if isinstance(flow.config.detector, UtilizationDetector):
                self.stale_endpoints.labels("utilization-detector").set(flow.readings["effective"].stale)

    def observe_pool(self, snapshot: PoolSnapshot) -> None:
        ready = [s for s in snapshot.ready_states() if s.metrics is not None]
        self.ready.labels(self.pool).set(len(ready))
        waiting = [s.metrics.waiting for s in ready if s.metrics is not None]
        kv = [s.metrics.kv_usage for s in ready if s.metrics is not None]
        self.avg_queue.labels(self.pool).set(sum(waiting) / len(waiting) if waiting else 0.0)
        self.avg_kv.labels(self.pool).set(sum(kv) / len(kv) if kv else 0.0)
        self.pod_queue.clear()  # endpoints come and go with discovery
        for state in ready:
            if state.metrics is not None:
                self.pod_queue.labels(self.pool, state.endpoint.address).set(state.metrics.waiting)

    def started(self, report: StreamReport) -> None:
        """The request was routed: it runs until :meth:`record`."""
        client = report.client_model
        running: GaugeSeries = self._series.get((_RUNNING, client)) or self._running_of(client)
        running.value += 1  # GaugeSeries.inc, inline (as the counter and gauge below: one call less each)

    def record(self, report: StreamReport, duration_s: float, *, prefix_index_size: int | None = None) -> None:
        """Everything one finished stream did; ``duration_s`` from its first message to its end."""
        series = self._series
        client, target = report.client_model, report.target_model
        labels, running_label = series.get((_LABELS, client, target)) or self._labels_of(client, target)
        if report.error is not None:
            self._series_of(self.errors, *labels, error_code(report.error)).inc()
        if report.routed:
            running, requests, duration, request_sizes, response_sizes = self._routed_series(labels, running_label)
            running.value -= 1
            requests.value += 1
            duration.observe(duration_s)
            request_sizes.observe(report.request_bytes)
            response_sizes.observe(report.response_bytes)
        if report.scheduling_s is not None:
            self._scheduling.observe(report.scheduling_s)
        for plugin, seconds in report.scorer_s.items():
            (series.get((self.plugin_duration, plugin)) or self._scorer_series(plugin)).observe(seconds)
        if report.prefix_match is not None:
            matched, total = report.prefix_match
            self._prefix_bytes.observe(matched)
            if total:
                self._prefix_ratio.observe(matched / total)
        if prefix_index_size is not None:
            self._prefix_size.set(prefix_index_size)
        for endpoint in report.served:
            self._series_of(self.served, endpoint).inc()
        usage = report.usage
        if usage is not None:
            if usage.prompt_tokens:
                self._series_of(self.input_tokens, *labels).observe(usage.prompt_tokens)
            if usage.completion_tokens:
                self._series_of(self.output_tokens, *labels).observe(usage.completion_tokens)
                if report.routed:
                    self._series_of(self.ntpot, *labels).observe(duration_s / usage.completion_tokens)
            for kind, value in (("prompt", usage.prompt_tokens), ("completion", usage.completion_tokens),
                                ("cached", usage.cached_tokens)):
                if value:
                    self._series_of(self.tokens, labels[0], kind).inc(value)
