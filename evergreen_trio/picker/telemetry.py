"""The picker's Prometheus metrics, named and labelled as the reference Endpoint Picker's.

One registry per picker instance. The sans-IO core reports what each stream did
(:class:`~evergreen_trio.picker.processor.StreamReport`); :meth:`PickerMetrics.record` turns it
into metrics. Error codes are the reference's names (``BadRequest``, ``BadConfiguration``,
``InferencePoolResourceExhausted``, ``ServiceUnavailable``), not HTTP statuses. Buckets are the
reference's too, so dashboards built for it read ours unchanged.
"""

from __future__ import annotations

from typing import Any, TypeVar

from grpclib.const import Status
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

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
_M = TypeVar("_M", bound=MetricWrapperBase)


def error_code(status: int) -> str:
    return ERROR_CODES.get(status, "Internal" if status >= 500 else "BadRequest")


def go_code(status: Status) -> str:
    """A gRPC status as Go's ``codes.Code.String()`` names it (``OK``, ``Canceled``, ``InvalidArgument``)."""
    if status is Status.CANCELLED:
        return "Canceled"
    return "OK" if status is Status.OK else status.name.title().replace("_", "")


class StreamMetrics:
    """llm-d-router's opt-in ext_proc stream metrics (``--enable-grpc-stream-metrics``): the streams
    open, how long each stayed open, and how many ended with each gRPC code."""

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
        self._series: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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
        self.saturation = Gauge("llm_d_epp_flow_control_pool_saturation", "The saturation detector's reading",
                                ["inference_pool"], registry=r)
        self.streams = StreamMetrics(r) if stream_metrics else None
        # In-flight eviction (flowControl.enableEviction): the reclamation controller reports here.
        self.reclamation = ReclamationMetrics(r, pool)

    def _series_of(self, metric: _M, *values: str) -> _M:
        """``metric.labels(*values)``, without prometheus_client's checks and lock after the first time
        (per-request metrics are never cleared, so a series once made stays valid)."""
        key = (metric, values)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= MAX_CACHED_SERIES:
                self._series.clear()
            series = self._series[key] = metric.labels(*values)
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
            self.saturation.labels(self.pool).set(flow.saturation())

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
        self._series_of(self.running, self.labels.name(report.client_model)).inc()

    def record(self, report: StreamReport, duration_s: float, *, prefix_index_size: int | None = None) -> None:
        """Everything one finished stream did; ``duration_s`` from its first message to its end."""
        labels = self.labels.pair(report.client_model, report.target_model)
        if report.error is not None:
            self._series_of(self.errors, *labels, error_code(report.error)).inc()
        if report.routed:
            self._series_of(self.running, self.labels.name(report.client_model)).dec()
            self._series_of(self.requests, *labels).inc()
            self._series_of(self.duration, *labels).observe(duration_s)
            self._series_of(self.request_sizes, *labels).observe(report.request_bytes)
            self._series_of(self.response_sizes, *labels).observe(report.response_bytes)
        if report.scheduling_s is not None:
            self.scheduling.observe(report.scheduling_s)
        for plugin, seconds in report.scorer_s.items():
            self._series_of(self.plugin_duration, "Scorer", plugin, plugin).observe(seconds)
        if report.prefix_match is not None:
            matched, total = report.prefix_match
            self.prefix_bytes.observe(matched)
            if total:
                self.prefix_ratio.observe(matched / total)
        if prefix_index_size is not None:
            self.prefix_size.set(prefix_index_size)
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
