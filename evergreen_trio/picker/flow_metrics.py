"""Flow control's per-request metrics, named and labelled as llm-d-router's.

:class:`FlowControlMetrics` is the queue's observer
(:class:`~evergreen_trio.picker.flow_control.queue.FlowObserver`): the requests held (count and
bytes, per fairness id, priority and models), how long each stayed and how it left, how long
enqueueing and each dispatch cycle took. Their deprecated ``inference_extension_flow_control_*``
names are :class:`~evergreen_trio.picker.telemetry.DerivedFamily` copies, read at scrape time.
Labels are bounded as the request set's: the metrics' ``fairness`` and model ``labels``.

Outcomes carry the reference's ``QueueOutcome`` names. A flow's series stay once made (the
reference deletes an idle flow's): the bounded fairness ids bound them.
"""

from __future__ import annotations

from typing import Any

from evergreen_trio.picker.flow_control.queue import FlowObserver, Outcome, QueueItem
from evergreen_trio.picker.telemetry import (
    MAX_CACHED_SERIES,
    CounterFamily,
    DerivedFamily,
    GaugeFamily,
    HistogramFamily,
    HistogramSeries,
    PickerMetrics,
    alpha,
)

_QUEUE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_CYCLE_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
_HELD = ["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]
_QUEUED = ["fairness_id", "priority", "outcome", "inference_pool", "model_name", "target_model_name"]
_ENQUEUE = ["fairness_id", "priority", "outcome"]
OUTCOMES = {Outcome.DISPATCHED: "Dispatched", Outcome.REJECTED_SATURATED: "RejectedCapacity",
            Outcome.EVICTED_TTL: "EvictedTTL", Outcome.EVICTED_NO_ENDPOINTS: "EvictedNoEndpoints",
            Outcome.CANCELLED: "EvictedContextCancelled"}


def outcome_name(item: QueueItem, outcome: Outcome | None) -> str:
    """The reference's name of how ``item`` left (shutting down: rejected, or evicted once queued)."""
    if outcome is None:
        return "NotYetFinalized"
    return OUTCOMES.get(outcome) or ("EvictedOther" if item.seq else "RejectedOther")


class FlowControlMetrics(FlowObserver):
    """``llm_d_epp_flow_control_{queue_size,queue_bytes,request_queue_duration_seconds,
    request_enqueue_duration_seconds,dispatch_cycle_duration_seconds,requests_total}`` and the
    deprecated names of the first five."""

    def __init__(self, metrics: PickerMetrics) -> None:
        self.metrics, self.pool = metrics, metrics.pool
        r = metrics.registry
        self._series: dict[tuple[object, ...], Any] = {}

        def deprecated(source: Any, name: str) -> None:
            help_ = source.documentation.removeprefix("[ALPHA] ")
            DerivedFamily(source, f"inference_extension_flow_control_{name}",
                          alpha(f"[Deprecated: Use llm_d_epp_flow_control_{name}] {help_}"), source.labelnames,
                          range(len(source.labelnames)), r)

        self.queue_size = GaugeFamily("llm_d_epp_flow_control_queue_size", alpha(
            "Current number of requests actively held in the Flow Control queue."), _HELD, registry=r)
        self.queue_bytes = GaugeFamily("llm_d_epp_flow_control_queue_bytes", alpha(
            "Current total size in bytes of requests actively held in the Flow Control queue."), _HELD, registry=r)
        self.queue_duration = HistogramFamily("llm_d_epp_flow_control_request_queue_duration_seconds", alpha(
            "Distribution of total time requests spend in the Flow Control layer (from enqueue to final outcome)."),
            _QUEUED, buckets=_QUEUE_BUCKETS, registry=r)
        self.enqueue_duration = HistogramFamily("llm_d_epp_flow_control_request_enqueue_duration_seconds", alpha(
            "Distribution of time taken to enqueue requests into the Flow Control layer."), _ENQUEUE,
            buckets=_CYCLE_BUCKETS, registry=r)
        self.dispatch_cycle_duration = HistogramFamily(
            "llm_d_epp_flow_control_dispatch_cycle_duration_seconds",
            alpha("Distribution of time taken for each internal dispatch cycle in the Flow Control layer."),
            buckets=_CYCLE_BUCKETS, registry=r)
        self.requests = CounterFamily("llm_d_epp_flow_control_requests", alpha(
            "Total number of requests processed by the Flow Control layer."), ["outcome", "priority", "inference_pool"],
            registry=r)
        for source, name in ((self.queue_size, "queue_size"), (self.queue_bytes, "queue_bytes"),
                             (self.queue_duration, "request_queue_duration_seconds"),
                             (self.enqueue_duration, "request_enqueue_duration_seconds"),
                             (self.dispatch_cycle_duration, "dispatch_cycle_duration_seconds")):
            deprecated(source, name)
        self._cycle: HistogramSeries = self.dispatch_cycle_duration.labels()

    def _of(self, family: Any, *values: str) -> Any:
        key = (family, *values)
        series = self._series.get(key)
        if series is None:
            if len(self._series) >= MAX_CACHED_SERIES:
                self._series.clear()
            series = self._series[key] = family.labels(*values)
        return series

    def _held(self, item: QueueItem) -> tuple[str, str, str, str, str]:
        model, target = self.metrics.labels.pair(*item.models)
        return self.metrics.fairness.bound(item.fairness_id), str(item.priority), self.pool, model, target

    def entered(self, item: QueueItem) -> None:
        labels = self._held(item)
        self._of(self.queue_size, *labels).inc()
        self._of(self.queue_bytes, *labels).inc(item.byte_size)

    def enqueued(self, item: QueueItem, seconds: float) -> None:
        fairness = self.metrics.fairness.bound(item.fairness_id)
        self._of(self.enqueue_duration, fairness, str(item.priority), outcome_name(item, item.outcome)).observe(
            seconds)

    def left(self, item: QueueItem, outcome: Outcome, waited_s: float) -> None:
        fairness, priority, pool, model, target = labels = self._held(item)
        self._of(self.queue_size, *labels).dec()
        self._of(self.queue_bytes, *labels).dec(item.byte_size)
        name = outcome_name(item, outcome)
        self._of(self.queue_duration, fairness, priority, name, pool, model, target).observe(waited_s)
        self._of(self.requests, name, priority, pool).inc()

    def dispatch_cycle(self, seconds: float) -> None:
        self._cycle.observe(seconds)
