"""The picker's Prometheus metrics, named and labelled as the reference Endpoint Picker's.

One registry per picker instance. The sans-IO core reports what each stream did
(:class:`~evergreen_trio.picker.processor.StreamReport`); :meth:`PickerMetrics.record` turns it
into metrics. Error codes are the reference's names (``BadRequest``, ``BadConfiguration``,
``InferencePoolResourceExhausted``, ``ServiceUnavailable``), not HTTP statuses. Buckets are the
reference's too, so dashboards built for it read ours unchanged.

The metrics a request updates are plain numbers (:class:`CounterFamily`, :class:`GaugeFamily`,
:class:`HistogramFamily`): every request is counted on the picker's one Trio thread, so an update
is an addition, a bucket found by bisection, no lock; a per-request histogram's observation is
appended to a list, its bucket found when the list is folded (every :data:`FOLD_EVERY` streams,
and before a scrape reads it). They are collectors of the same registry,
read into prometheus_client's metric families when it is scraped, and expose exactly what its
``Counter``, ``Gauge`` and ``Histogram`` would (names, labels, ``le`` values, ``_created``, series
order: ``tests/picker/test_telemetry.py`` compares the two). A scrape renders in a worker thread
and may see a request's updates half done, as prometheus_client's per-value locks allow too.

A request updates llm-d-router's ``llm_d_epp_*`` families only; the deprecated names it also
exports are :class:`DerivedFamily` sums of them, computed when scraped (docs/picker.md, Metrics).
"""

from __future__ import annotations

import math
import threading
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from grpclib.const import Status
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample

from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.guards import BoundedLabel, ModelLabels
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.llmd_gauges import LlmdGauges
from evergreen_trio.picker.processor import StreamReport
from evergreen_trio.picker.reclamation_metrics import ReclamationMetrics
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage

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
_TTFT_BUCKETS = (0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 45,
                 60, 120)
_TPOT_BUCKETS = (0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6,
                 0.8, 1, 2)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2)
_REQUEST_PROCESSING_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5,
                               5, 10)
_RESPONSE_PROCESSING_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                2.5, 5)
_MODEL = ["model_name", "target_model_name"]
_REQUEST = [*_MODEL, "fairness_id", "priority"]
_ATTEMPT = ["status", "target_model_name", "endpoint_name", "namespace", "port"]
_PLUGIN = ["extension_point", "plugin_type", "plugin_name"]
_PLUGIN_HELP = ("Plugin processing latency distribution in seconds for each extension point, plugin type and plugin "
                "name.")
_REWRITE = ["model_rewrite_name", "model_name", "target_model"]
# Labelled series kept at hand per picker; label values are already bounded (model names folded,
# pool endpoints, plugin names), this only caps the map against a pool that churns for months.
MAX_CACHED_SERIES = 4096
FOLD_EVERY = 256
"""Streams recorded between two folds of the per-request histograms' pending observations (at most
a few dozen values a stream: a scorer's each, a dozen of the request's own)."""
_T = TypeVar("_T")


def alpha(help_: str) -> str:
    """A help text as the reference renders it (``HelpMsgWithStability(..., ALPHA)``)."""
    return f"[ALPHA] {help_}"


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

    def merged(self, other: CounterSeries | None) -> CounterSeries:
        total = CounterSeries.__new__(CounterSeries)
        total.value, total.created = self.value, self.created
        if other is not None:
            total.value += other.value
            total.created = min(total.created, other.created)
        return total


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

    def merged(self, other: GaugeSeries | None) -> GaugeSeries:
        total = GaugeSeries()
        total.value = self.value + (other.value if other is not None else 0.0)
        return total


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

    def fold(self) -> None:
        """Count the observations waiting to be counted (none wait here: each is counted as it comes)."""

    def merged(self, other: HistogramSeries | None) -> HistogramSeries:
        total = HistogramSeries.__new__(HistogramSeries)
        total.bounds, total.labels, total.created, total.sum = self.bounds, self.labels, self.created, self.sum
        total.counts = list(self.counts)
        if other is not None:
            total.counts = [a + b for a, b in zip(total.counts, other.counts, strict=True)]
            total.sum += other.sum
            total.created = min(total.created, other.created)
        return total


class PendingHistogramSeries(HistogramSeries):
    """A histogram series whose ``observe`` is its list of pending values' ``append``: a C call, no
    Python frame per observation. :meth:`fold` counts them later, in the order they came (the same
    additions to the sum in the same order: the same numbers, to the last bit); its family folds
    them under its lock before a scrape reads the series, the metrics every :data:`FOLD_EVERY`
    streams recorded."""

    __slots__ = ("observe", "pending")

    observe: Callable[[float], None]  # type: ignore[assignment]  # the list's append, set per series

    def __init__(self, bounds: list[float], labels: list[str]) -> None:
        super().__init__(bounds, labels)
        self.pending: list[float] = []
        self.observe = self.pending.append

    def fold(self) -> None:
        pending = self.pending
        waiting = len(pending)  # values appended meanwhile (the Trio thread, during a scrape's fold) stay
        if not waiting:
            return
        bounds, counts, total = self.bounds, self.counts, self.sum
        for amount in pending[:waiting]:  # HistogramSeries.observe, inline
            total += amount
            i = bisect_left(bounds, amount)
            if amount <= bounds[i]:
                counts[i] += 1
        self.sum = total
        del pending[:waiting]


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

    def series(self) -> list[tuple[tuple[str, ...], Any]]:
        """Each series with its label values, in the order they were made, as a scrape reads them."""
        with self._lock:
            return list(self._children.items())

    def collect(self) -> list[Metric]:
        family = self.family(self.name, self.documentation, labels=self.labelnames)
        created = _created_shown()
        for values, child in self.series():
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
                 registry: CollectorRegistry | None = None, *, buckets: Sequence[float], pending: bool = False) -> None:
        """``pending``: its series are :class:`PendingHistogramSeries`, whose owner calls :meth:`fold`
        often enough to bound what waits (the family folds before a scrape reads it)."""
        self.pending = pending
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
        return PendingHistogramSeries(self.bounds, self.le) if self.pending else HistogramSeries(self.bounds, self.le)

    def series(self) -> list[tuple[tuple[str, ...], Any]]:
        with self._lock:  # the Trio thread's folds take it too: one fold at a time
            children = list(self._children.items())
            for _, child in children:
                child.fold()
        return children

    def fold(self) -> None:
        """Count every series' pending observations."""
        self.series()


class DerivedFamily:
    """A family read from another's series at scrape time, none of its own to update: each series
    is the sum of ``source``'s series whose label values at ``keep`` are its own (``keep`` may be
    every label, under other names: a renamed copy). What llm-d-router writes twice (a deprecated
    family beside its ``llm_d_epp_*`` one, with the same observations and fewer labels) costs a
    request one update.

    Series come in the order the source made them; a sum's ``_created`` is its first source
    series'. Counts are exact (whole numbers far below 2**53); a histogram's ``_sum`` adds the
    source series' sums, which may round differently in the last digits from one running sum.
    """

    def __init__(self, source: _Family, name: str, documentation: str, labelnames: Sequence[str],
                 keep: Sequence[int], registry: CollectorRegistry) -> None:
        if len(labelnames) != len(keep) or any(not 0 <= i < len(source.labelnames) for i in keep):
            raise ValueError(f"expected one source label index per label name of {name}")
        self.source, self.name, self.documentation = source, name, documentation
        self.labelnames, self.keep = tuple(labelnames), tuple(keep)
        registry.register(self)

    def describe(self) -> list[Metric]:
        return [self.source.family(self.name, self.documentation, labels=self.labelnames)]

    def collect(self) -> list[Metric]:
        source, keep = self.source, self.keep
        family = source.family(self.name, self.documentation, labels=self.labelnames)
        created = _created_shown()
        children = source.series()
        sums: dict[tuple[str, ...], Any] = {}
        for values, child in children:
            key = tuple(values[i] for i in keep)
            total = sums.get(key)
            sums[key] = total.merged(child) if total is not None else child.merged(None)
        for key, total in sums.items():
            total.expose(family, dict(zip(self.labelnames, key, strict=True)), created)
        return [family]


class RequestSeries:
    """One label set's series of the request set (model, target model, fairness id, priority),
    each made at its first update as the reference's ``WithLabelValues`` makes it, then kept at
    hand: a routed stream's report holds this (as its ``itl``: the gaps between its chunks).
    ``routed``: requests, duration, request and response sizes, which every routed request updates."""

    __slots__ = ("_metrics", "cached", "input", "itl", "labels", "ntpot", "output", "routed", "running", "tpot",
                 "ttft")

    def __init__(self, metrics: PickerMetrics, labels: tuple[str, str, str, str]) -> None:
        self._metrics, self.labels = metrics, labels
        self.routed: tuple[CounterSeries, HistogramSeries, HistogramSeries, HistogramSeries] | None = None
        self.running: GaugeSeries | None = None
        self.input: HistogramSeries | None = None
        self.output: HistogramSeries | None = None
        self.cached: HistogramSeries | None = None
        self.ntpot: HistogramSeries | None = None
        self.tpot: HistogramSeries | None = None
        self.ttft: dict[bool, HistogramSeries] = {}
        self.itl: HistogramSeries | None = None

    def observe(self, gap: float) -> None:
        """A streaming response's gap between two chunks (``llm_d_epp_request_streaming_itl_seconds``);
        a negative one is no observation, as the reference's."""
        if gap < 0:
            return
        itl = self.itl
        if itl is None:
            itl = self.itl = self._metrics.itl.labels(*self.labels)
        itl.observe(gap)


def _single(family: _Family) -> Any:
    """The one series of a family without label names (made with the family, as prometheus_client's)."""
    return family.labels()


class StreamMetrics:
    """llm-d-router's opt-in ext_proc stream metrics (``--enable-grpc-stream-metrics``): the streams
    open, how long each stayed open, and how many ended with each gRPC code."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.inflight = GaugeFamily("llm_d_epp_extproc_streams_inflight",
                                    alpha("Number of ext_proc gRPC streams currently open."), registry=registry)
        self.duration = HistogramFamily("llm_d_epp_extproc_stream_duration_seconds",
                                        alpha("Duration an ext_proc gRPC stream stays open, in seconds."),
                                        buckets=_STREAM_BUCKETS, registry=registry)
        self.ended = CounterFamily("llm_d_epp_extproc_streams",
                                   alpha("Total ext_proc gRPC streams completed, by gRPC status code."), ["code"],
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
    """llm-d-router's metrics (its ``llm_d_epp_*`` families and their deprecated names) plus ours
    (served endpoints, tokens by kind, the prefix index).

    Model names are folded by ``labels`` (:class:`~evergreen_trio.picker.guards.ModelLabels`:
    unlisted and surplus names become ``other``) and fairness ids by ``fairness``
    (:class:`~evergreen_trio.picker.guards.BoundedLabel`, as the reference's ``boundFairnessID``),
    so clients cannot grow the label set. A request updates the ``llm_d_epp_*`` families only:
    the deprecated ones are :class:`DerivedFamily` sums of them. ``streams``
    (:class:`StreamMetrics`) only with ``stream_metrics``, as the reference registers them.
    """

    def __init__(self, pool: str, registry: CollectorRegistry | None = None,
                 labels: ModelLabels | None = None, *, stream_metrics: bool = False) -> None:
        self.pool = pool
        self.labels = labels if labels is not None else ModelLabels()
        self.fairness = BoundedLabel()
        self._series: dict[tuple[object, ...], Any] = {}
        self._requests: dict[tuple[str, str, str, str], RequestSeries] = {}
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(name: str, help_: str, labelnames: Sequence[str]) -> CounterFamily:
            return CounterFamily(name, alpha(help_), labelnames, registry=r)

        def histogram(name: str, help_: str, labelnames: Sequence[str], buckets: Sequence[float], *,
                      pending: bool = True) -> HistogramFamily:
            # Pending: observed in record() only, which folds them (a stream's chunk gaps are not).
            return HistogramFamily(name, alpha(help_), labelnames, buckets=buckets, registry=r, pending=pending)

        def derived(source: _Family, name: str, replacement: str, help_: str, labelnames: Sequence[str]) -> None:
            keep = [source.labelnames.index(n) for n in labelnames]
            DerivedFamily(source, name, alpha(f"[Deprecated: Use {replacement}] {help_}"), labelnames, keep, r)

        # -- the request set (llm_d_epp_request_*), and its deprecated inference_objective_* sums
        self.requests = counter("llm_d_epp_request", "Total number of processed requests.", _REQUEST)
        self.errors = counter("llm_d_epp_request_error", "Total number of request errors.", [*_REQUEST, "error_code"])
        self.duration = histogram("llm_d_epp_request_duration_seconds",
                                  "End-to-end request latency distribution in seconds.", _REQUEST, _DURATION_BUCKETS)
        self.request_sizes = histogram("llm_d_epp_request_size_bytes",
                                       "Incoming request body size distribution in bytes.", _REQUEST,
                                       _REQUEST_SIZE_BUCKETS)
        self.response_sizes = histogram("llm_d_epp_response_size_bytes",
                                        "Outgoing response body size distribution in bytes.", _REQUEST,
                                        _RESPONSE_SIZE_BUCKETS)
        self.input_tokens = histogram("llm_d_epp_request_input_tokens", "Input token count distribution per request.",
                                      _REQUEST, _INPUT_TOKEN_BUCKETS)
        self.output_tokens = histogram("llm_d_epp_request_output_tokens",
                                       "Output token count distribution per request.", _REQUEST, _OUTPUT_TOKEN_BUCKETS)
        self.cached_tokens = histogram("llm_d_epp_request_cached_tokens",
                                       "Distribution of prompt tokens read from cache per request, as reported by "
                                       "the model server in the response.", _REQUEST, _INPUT_TOKEN_BUCKETS)
        self.running = GaugeFamily("llm_d_epp_request_running", alpha("Current number of active running requests."),
                                   _REQUEST, registry=r)
        self.ntpot = histogram("llm_d_epp_request_ntpot_seconds",
                               "Normalized time per output token in seconds (end-to-end latency divided by output "
                               "token count).", _REQUEST, _NTPOT_BUCKETS)
        self.ttft = histogram("llm_d_epp_request_ttft_seconds",
                              "Time to first token in seconds, measured from request received to first response "
                              "byte. For non-streaming requests, this equals total request duration.",
                              [*_REQUEST, "streaming"], _TTFT_BUCKETS)
        self.tpot = histogram("llm_d_epp_request_streaming_tpot_seconds",
                              "Average time per output token in seconds for streaming requests, computed as "
                              "(e2e - TTFT) / (output_tokens - 1).", _REQUEST, _TPOT_BUCKETS)
        self.itl = histogram("llm_d_epp_request_streaming_itl_seconds",
                             "Inter-token latency in seconds for streaming requests, measured as the time between "
                             "consecutive response body chunks.", _REQUEST, _ITL_BUCKETS, pending=False)
        derived(self.requests, "inference_objective_request", "llm_d_epp_request_total",
                "Counter of inference objective requests broken out for each model and target model.",
                [*_MODEL, "priority"])
        derived(self.errors, "inference_objective_request_error", "llm_d_epp_request_error_total",
                "Counter of inference objective requests errors broken out for each model and target model.",
                [*_MODEL, "error_code"])
        derived(self.duration, "inference_objective_request_duration_seconds", "llm_d_epp_request_duration_seconds",
                "Inference objective response latency distribution in seconds for each model and target model.",
                _MODEL)
        derived(self.request_sizes, "inference_objective_request_sizes", "llm_d_epp_request_size_bytes",
                "Inference objective requests size distribution in bytes for each model and target model.", _MODEL)
        derived(self.response_sizes, "inference_objective_response_sizes", "llm_d_epp_response_size_bytes",
                "Inference objective responses size distribution in bytes for each model and target model.", _MODEL)
        derived(self.input_tokens, "inference_objective_input_tokens", "llm_d_epp_request_input_tokens",
                "Inference objective input token count distribution for requests in each model.", _MODEL)
        derived(self.output_tokens, "inference_objective_output_tokens", "llm_d_epp_request_output_tokens",
                "Inference objective output token count distribution for requests in each model.", _MODEL)
        derived(self.cached_tokens, "inference_objective_prompt_cached_tokens", "llm_d_epp_request_cached_tokens",
                "Inference objective prompt cached token count distribution for requests in each model.", _MODEL)
        derived(self.running, "inference_objective_running_requests", "llm_d_epp_request_running",
                "Inference objective number of running requests in each model.", ["model_name"])
        derived(self.ntpot, "inference_objective_normalized_time_per_output_token_seconds",
                "llm_d_epp_request_ntpot_seconds", "Inference objective latency divided by number of output tokens "
                "in seconds for each model and target model.", _MODEL)

        # -- scheduling
        self.scheduling = histogram("llm_d_epp_scheduler_e2e_duration_seconds",
                                    "End-to-end scheduling latency distribution in seconds.", (), _SCHEDULER_BUCKETS)
        derived(self.scheduling, "inference_extension_scheduler_e2e_duration_seconds",
                "llm_d_epp_scheduler_e2e_duration_seconds", "End-to-end scheduling latency distribution in seconds.",
                ())
        self.attempts = counter("llm_d_epp_scheduler_attempts", "Total number of scheduling attempts.",
                                _ATTEMPT)
        DerivedFamily(self.attempts, "inference_extension_scheduler_attempts",
                      alpha("[Deprecated: Use llm_d_epp_scheduler_attempts_total] Total number of scheduling "
                            "attempts."), ["status", "target_model_name", "pod_name", "namespace", "port"],
                      range(5), r)
        self.plugin_duration = histogram("llm_d_epp_plugin_duration_seconds", _PLUGIN_HELP, _PLUGIN,
                                         _SCHEDULER_BUCKETS)
        derived(self.plugin_duration, "inference_extension_plugin_duration_seconds",
                "llm_d_epp_plugin_duration_seconds", _PLUGIN_HELP, _PLUGIN)
        # No plugin of ours reads or writes an endpoint attribute it did not declare (the data layer
        # hands plugins typed fields, not a key-value store): registered for dashboards, never counted.
        self.data_scope_violations = counter(
            "llm_d_epp_plugin_data_scope_violations",
            "Total number of endpoint attribute accesses rejected because the plugin did not declare the DataKey "
            "in Produces() or Consumes(), by extension point, plugin type, plugin name and access kind (read or "
            "write). A non-zero value means a plugin's implementation has drifted from its declaration; rejected "
            "reads resolve as absent and rejected writes are dropped.", [*_PLUGIN, "access"])
        self.request_processing = histogram(
            "llm_d_epp_request_processing_duration_seconds",
            "EPP request processing latency distribution in seconds, from request receipt until the request body "
            "has been handled, including admission control.", (), _REQUEST_PROCESSING_BUCKETS)
        self.response_processing = histogram(
            "llm_d_epp_response_processing_duration_seconds",
            "EPP response processing latency distribution in seconds: the sum of per-chunk handler time for a "
            "streamed response, or the interval from response headers to completion for a non-streaming response.",
            (), _RESPONSE_PROCESSING_BUCKETS)
        self.rewrites = counter("llm_d_epp_model_rewrite_decisions",
                                "Total number of inference model rewrite decisions.", _REWRITE)
        DerivedFamily(self.rewrites, "inference_extension_model_rewrite_decisions",
                      alpha("Total number of inference model rewrite decisions."), _REWRITE, range(3), r)

        # -- ours, and the picker-wide gauges
        self.prefix_size = GaugeFamily("inference_extension_prefix_indexer_size", "Block hashes in the prefix index",
                                       registry=r)
        self.prefix_ratio = HistogramFamily("inference_extension_prefix_indexer_hit_ratio",
                                            "Matched share of the prompt's prefix blocks",
                                            buckets=tuple(i / 10 for i in range(11)), registry=r, pending=True)
        self.prefix_bytes = HistogramFamily("inference_extension_prefix_indexer_hit_bytes", "Matched prefix bytes",
                                            buckets=(0, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                     32768, 65536), registry=r, pending=True)
        self.served = CounterFamily("inference_extension_served_requests",
                                    "Requests Envoy reports served, by endpoint", ["endpoint"], registry=r)
        self.tokens = CounterFamily("inference_objective_tokens", "Tokens reported in responses, by model and kind",
                                    ["model_name", "kind"], registry=r)
        self.gauges = LlmdGauges(r, pool, f"evergreen-trio-{VERSION}")
        self.streams = StreamMetrics(r) if stream_metrics else None
        # In-flight eviction (flowControl.enableEviction): the reclamation controller reports here.
        self.reclamation = ReclamationMetrics(r, pool)
        self._scheduling: HistogramSeries = _single(self.scheduling)
        self._request_processing: HistogramSeries = _single(self.request_processing)
        self._response_processing: HistogramSeries = _single(self.response_processing)
        self._prefix_size: GaugeSeries = _single(self.prefix_size)
        self._prefix_ratio: HistogramSeries = _single(self.prefix_ratio)
        self._prefix_bytes: HistogramSeries = _single(self.prefix_bytes)
        self._pending = [f for f in vars(self).values() if isinstance(f, HistogramFamily) and f.pending]
        self._unfolded = 0  # streams recorded since the last fold

    def _series_of(self, metric: _Family, *values: str) -> Any:
        """``metric.labels(*values)``, looked up in one map (per-request metrics are never cleared,
        so a series once made stays valid)."""
        key = (metric, values)
        series = self._series.get(key)
        return series if series is not None else self._cache(key, metric.labels(*values))

    def _request_series(self, report: StreamReport) -> RequestSeries:
        """The request set's series for the report's labels: the folded models, the bounded fairness
        id, the priority (what :meth:`started` gave the report, else looked up)."""
        series = report.itl
        if isinstance(series, RequestSeries):
            return series
        model, target = self.labels.pair(report.client_model, report.target_model)
        labels = model, target, self.fairness.bound(report.fairness_id), str(report.priority)
        series = self._requests.get(labels)
        if series is None:
            if len(self._requests) >= MAX_CACHED_SERIES:
                self._requests.clear()
            series = self._requests[labels] = RequestSeries(self, labels)
        return series

    def _running(self, series: RequestSeries) -> GaugeSeries:
        running = series.running
        if running is None:
            running = series.running = self.running.labels(*series.labels)
        return running

    def _cache(self, key: tuple[object, ...], value: _T) -> _T:
        """Keep ``value`` at ``key`` in the series map (cleared when full: its keys come from clients)."""
        if len(self._series) >= MAX_CACHED_SERIES:
            self._series.clear()
        self._series[key] = value
        return value

    def _scorer_series(self, plugin: str) -> HistogramSeries:
        key = (self.plugin_duration, plugin)
        series: HistogramSeries | None = self._series.get(key)
        if series is None:
            series = self._cache(key, self._series_of(self.plugin_duration, "Scorer", plugin, plugin))
        return series

    def _attempt_series(self, report: StreamReport) -> CounterSeries:
        """The scheduling attempt's series: success with its first endpoint (name, namespace, port),
        or failure with none, as the reference's ``RecordSchedulerAttempt``."""
        endpoint = report.endpoint if report.scheduled else ""
        key = (self.attempts, (report.scheduled, report.target_model, endpoint))
        series: CounterSeries | None = self._series.get(key)
        if series is None:
            target = self.labels.name(report.target_model)
            port = endpoint.rpartition(":")[2] if endpoint else ""
            series = self._cache(key, self._series_of(self.attempts, "success" if report.scheduled else "failure",
                                                      target, endpoint, "", port))
        return series

    def observe_load(self, snapshot: PoolSnapshot, load: InflightLoad, flow: FlowGate | None) -> None:
        """The picker's in-flight counts per endpoint and, with flow control, its queue and saturation."""
        self.gauges.observe_load(snapshot, load, flow, self.fairness)

    def observe_pool(self, snapshot: PoolSnapshot) -> None:
        self.gauges.observe_pool(snapshot)

    def started(self, report: StreamReport) -> None:
        """The request was routed: it runs until :meth:`record`; its series go with the report
        (``report.itl``, where a streaming response's chunk gaps go)."""
        series = self._request_series(report)
        if report.client_model:  # the reference counts no running request without a model name
            self._running(series).value += 1  # GaugeSeries.inc, inline (one call less, as below)
        report.itl = series

    def record(self, report: StreamReport, duration_s: float, *, prefix_index_size: int | None = None) -> None:
        """Everything one finished stream did; ``duration_s`` from its first message to its end."""
        self._unfolded += 1
        if self._unfolded >= FOLD_EVERY:
            self.fold()
        series = self._request_series(report)
        if report.error is not None:
            self._series_of(self.errors, *series.labels, error_code(report.error)).inc()
        if report.processing_s is not None:
            self._request_processing.observe(report.processing_s)
        if report.scheduled is not None:
            self._attempt_series(report).inc()
        if report.routed:
            self._record_routed(report, series, duration_s)
        if report.scheduling_s is not None:
            self._scheduling.observe(report.scheduling_s)
        for plugin, seconds in report.scorer_s.items():
            (self._series.get((self.plugin_duration, plugin)) or self._scorer_series(plugin)).observe(seconds)
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
            self._record_usage(report, usage, series, duration_s)

    def fold(self) -> None:
        """Count the per-request histograms' pending observations (what waits stays bounded)."""
        self._unfolded = 0
        for family in self._pending:
            family.fold()

    def _record_routed(self, report: StreamReport, series: RequestSeries, duration_s: float) -> None:
        routed = series.routed
        if routed is None:
            labels = series.labels
            routed = series.routed = (self.requests.labels(*labels), self.duration.labels(*labels),
                                      self.request_sizes.labels(*labels), self.response_sizes.labels(*labels))
        requests, duration, request_sizes, response_sizes = routed
        if report.client_model:
            self._running(series).value -= 1
        requests.value += 1
        duration.observe(duration_s)
        request_sizes.observe(report.request_bytes)
        response_sizes.observe(report.response_bytes)
        ttft = report.ttft_s
        if ttft is not None and ttft > 0:  # the reference's: a first byte, after the request came
            streaming = report.streaming
            ttft_series = series.ttft.get(streaming)
            if ttft_series is None:
                value = "true" if streaming else "false"
                ttft_series = series.ttft[streaming] = self.ttft.labels(*series.labels, value)
            ttft_series.observe(ttft)
        if report.response_processing_s > 0:
            self._response_processing.observe(report.response_processing_s)
        if report.rewrite is not None:
            self._series_of(self.rewrites, report.rewrite, series.labels[0], series.labels[1]).inc()

    def _record_usage(self, report: StreamReport, usage: Usage, series: RequestSeries, duration_s: float) -> None:
        """Token counts, and what they normalize: NTPOT, and TPOT for a streamed response (as the
        reference: more than one output token, a first byte before the end)."""
        prompt, completion, cached = usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
        labels = series.labels
        if prompt:
            if series.input is None:
                series.input = self.input_tokens.labels(*labels)
            series.input.observe(prompt)
        if completion:
            if series.output is None:
                series.output = self.output_tokens.labels(*labels)
            series.output.observe(completion)
            if report.routed:
                if series.ntpot is None:
                    series.ntpot = self.ntpot.labels(*labels)
                series.ntpot.observe(duration_s / completion)
                ttft = report.ttft_s
                if report.streaming and completion > 1 and ttft is not None and 0 < ttft < duration_s:
                    if series.tpot is None:
                        series.tpot = self.tpot.labels(*labels)
                    series.tpot.observe((duration_s - ttft) / (completion - 1))
        if cached is not None:
            if series.cached is None:
                series.cached = self.cached_tokens.labels(*labels)
            series.cached.observe(cached)
        for kind, value in (("prompt", prompt), ("completion", completion), ("cached", cached)):
            if value:
                self._series_of(self.tokens, labels[0], kind).inc(value)
