"""The picker's gauges read from the pool, the in-flight load and flow control, named as llm-d-router's.

Set after each endpoint scrape (not per request), on prometheus_client's own ``Gauge``. Each
``llm_d_epp_*`` gauge that replaced an older name is set under both, as the reference sets them;
help texts are the reference's as it renders them (``[ALPHA] ...``).

The pool's averages and standard deviations are the reference's ``calculateSummary``: over the
endpoints with fresh metrics, the sample standard deviation, both rounded to two decimals as Go's
``math.Round`` rounds (half away from zero); with no such endpoint only the ready count is set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from evergreen_trio.picker.flow_control.config import UtilizationDetector
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.guards import BoundedLabel
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.scheduler import PoolSnapshot

_POOL = ["name"]
_DEPRECATED = "[ALPHA] [Deprecated: Use {}] {}"
_SATURATION_HELP = (
    "Pool saturation signal gating Flow Control dispatch. The stage label partitions by pipeline role: 'prefill' "
    "and 'decode' are per-stage signals, 'effective' is max(prefill, decode) and is the value used for gating. 1.0 "
    "is the gating set point; values above 1.0 indicate the magnitude of oversubscription past it. An empty pool "
    "reads as 1.0. With the default utilization detector, endpoints with missing or stale metrics score as fully "
    "saturated (fail-closed; see {}).")


def go_round2(value: float) -> float:
    """``math.Round(value*100)/100`` as Go computes it (halves away from zero, not to even)."""
    scaled = value * 100
    whole = float(math.trunc(scaled))
    if abs(scaled - whole) >= 0.5:
        whole += math.copysign(1, scaled)
    return whole / 100


def mean_and_deviation(values: Sequence[float]) -> tuple[float, float]:
    """The reference's summary of one pool metric: the mean and the sample standard deviation
    (n - 1, at least 1), each rounded to two decimals."""
    mean = sum(values) / len(values)
    squares = sum((v - mean) * (v - mean) for v in values)
    return go_round2(mean), go_round2(math.sqrt(squares / max(1.0, len(values) - 1)))


class LlmdGauges:
    """Pool summaries, build info, per-endpoint queue and in-flight load, flow control's saturation
    and capacity use (what it holds per request: :mod:`evergreen_trio.picker.flow_metrics`), the
    data layer's error counters."""

    def __init__(self, registry: CollectorRegistry, pool: str, build_ref: str) -> None:
        self.pool = pool
        r = registry

        def gauge(name: str, help_: str, labels: Sequence[str]) -> Gauge:
            return Gauge(name, f"[ALPHA] {help_}", labels, registry=r)

        def pair(old: str, new: str, help_: str, labels: Sequence[str]) -> tuple[Gauge, Gauge]:
            return (Gauge(old, _DEPRECATED.format(new, help_), labels, registry=r), gauge(new, help_, labels))

        kv_help = "The average kv cache utilization for an inference server pool."
        queue_help = "The average number of requests pending in the model server queue."
        running_help = "The average number of running requests across model servers in the pool."
        self.avg_kv = pair("inference_pool_average_kv_cache_utilization", "llm_d_epp_average_kv_cache_utilization",
                           kv_help, _POOL)
        self.avg_queue = pair("inference_pool_average_queue_size", "llm_d_epp_average_queue_size", queue_help, _POOL)
        self.avg_running = pair("inference_pool_average_running_requests", "llm_d_epp_average_running_requests",
                                running_help, _POOL)
        self.std_kv = gauge("llm_d_epp_std_dev_kv_cache_utilization",
                            "The standard deviation kv cache utilization for an inference server pool.", _POOL)
        self.std_queue = gauge("llm_d_epp_std_dev_queue_size",
                               "The standard deviation number of requests pending in the model server queue.", _POOL)
        self.std_running = gauge("llm_d_epp_std_dev_running_requests",
                                 "The standard deviation number of running requests across model servers in the "
                                 "pool.", _POOL)
        self.ready = (Gauge("inference_pool_ready_pods", _DEPRECATED.format(
                          "llm_d_epp_ready_endpoints", "The number of ready pods in the inference server pool."),
                            _POOL, registry=r),
                      gauge("llm_d_epp_ready_endpoints", "The number of ready endpoints in the inference server pool.",
                            _POOL))
        self.pod_queue = (gauge("inference_pool_per_pod_queue_size", "The total number of requests pending in the "
                                "model server queue for each underlying pod.", ["name", "model_server_pod"]),
                          gauge("llm_d_epp_per_endpoint_queue_size", "The total number of requests pending in the "
                                "model server queue for each underlying endpoint.", ["name", "model_server_endpoint"]))
        info_help = "General information of the current build of Inference Extension."
        for name in ("inference_extension_info", "llm_d_epp_info"):
            gauge(name, info_help, ["commit", "build_ref"]).labels("", build_ref).set(1)
        inflight = ["endpoint_name", "namespace", "producer_name", "fairness_id", "priority"]
        self.inflight_requests = gauge("llm_d_epp_inflight_requests", "Current number of in-flight requests per "
                                       "endpoint, as tracked by the in-flight load producer.", inflight)
        self.inflight_tokens = gauge("llm_d_epp_inflight_tokens", "Current number of in-flight tokens per endpoint "
                                     "(uncached prompt tokens, optionally plus estimated output), as tracked by the "
                                     "in-flight load producer.", inflight)
        # Per endpoint: every in-flight series made (label values -> the two gauges' children), and those
        # that were not 0 when last set (only they can need a reset to 0).
        self._inflight: dict[str, dict[tuple[str, ...], tuple[Gauge, Gauge]]] = {}
        self._inflight_live: dict[str, set[tuple[str, ...]]] = {}
        stages = ["inference_pool", "stage"]
        self.saturation = (
            Gauge("inference_extension_flow_control_pool_saturation", _DEPRECATED.format(
                "llm_d_epp_flow_control_pool_saturation",
                _SATURATION_HELP.format("llm_d_epp_flow_control_stale_endpoints")), stages, registry=r),
            gauge("llm_d_epp_flow_control_pool_saturation", _SATURATION_HELP.format("flow_control_stale_endpoints"),
                  stages))
        self.stale_endpoints = gauge(
            "llm_d_epp_flow_control_stale_endpoints",
            "Number of candidate endpoints whose metrics are missing or older than the staleness threshold, as of the "
            "most recent saturation evaluation. Recorded by the utilization saturation detector, which scores these "
            "endpoints as fully saturated in flow_control_pool_saturation (fail-closed): a nonzero value during a "
            "dispatch stall indicates a metrics collection problem rather than genuine overload. This gauge carries "
            "no stage label and is written on every detector call, so it reflects the most recently evaluated stage; "
            "a reading of 0 does not rule out stale metrics in another stage. Per-stage stale accounting is tracked "
            "in #2475.", ["detector"])
        band_help = ("Fraction of a priority band's effective {0} capacity currently occupied, aggregated over every "
                     "flow in the band (0.0-1.0). The denominator falls back to a default when the band does not "
                     "configure one, so every configured band reports a series. The all-bands rollup is a separate "
                     "metric, flow_control_global_capacity_utilization_{1}.")
        global_help = ("Fraction of the global {0} capacity currently occupied across all priority bands (0.0-1.0). "
                       "Global capacity is optional and unset by default; this series is emitted only when it is "
                       "configured. Kept separate from flow_control_capacity_utilization_{1} so aggregations over "
                       "the per-band family do not double count the rollup.")
        self.band_use = {unit: gauge(f"llm_d_epp_flow_control_capacity_utilization_{unit}",
                                     band_help.format(kind, unit), ["priority", "inference_pool"])
                         for unit, kind in (("requests", "request-count"), ("bytes", "byte-size"))}
        self.global_use = {unit: gauge(f"llm_d_epp_flow_control_global_capacity_utilization_{unit}",
                                       global_help.format(kind, unit), ["inference_pool"])
                           for unit, kind in (("requests", "request-count"), ("bytes", "byte-size"))}
        poll_help = "Data-source poll errors per source type."
        extract_help = "Extract errors per source/extractor type."
        self.poll_errors = (
            Counter("llm_d_inference_scheduler_datalayer_poll_errors", _DEPRECATED.format(
                "llm_d_epp_datalayer_poll_errors_total", poll_help), ["source_type"], registry=r),
            Counter("llm_d_epp_datalayer_poll_errors", f"[ALPHA] {poll_help}", ["source_type"], registry=r))
        self.extract_errors = (
            Counter("llm_d_inference_scheduler_datalayer_extract_errors", _DEPRECATED.format(
                "llm_d_epp_datalayer_extract_errors_total", extract_help), ["source_type", "extractor_type"],
                registry=r),
            Counter("llm_d_epp_datalayer_extract_errors", f"[ALPHA] {extract_help}", ["source_type", "extractor_type"],
                    registry=r))

    def poll_error(self, source_type: str) -> None:
        """A data source's poll failed (a scrape that got no answer, or not a 200)."""
        for counter in self.poll_errors:
            counter.labels(source_type).inc()

    def extract_error(self, source_type: str, extractor_type: str) -> None:
        """A data source's answer could not be read (a metrics page that does not parse)."""
        for counter in self.extract_errors:
            counter.labels(source_type, extractor_type).inc()

    def observe_pool(self, snapshot: PoolSnapshot) -> None:
        ready = [s for s in snapshot.ready_states() if s.metrics is not None]
        for gauge in self.ready:
            gauge.labels(self.pool).set(len(ready))
        for gauge in self.pod_queue:
            gauge.clear()  # endpoints come and go with discovery
        metrics = [s.metrics for s in ready if s.metrics is not None]
        for state in ready:
            if state.metrics is not None:
                for gauge in self.pod_queue:
                    gauge.labels(self.pool, state.endpoint.address).set(state.metrics.waiting)
        if not metrics:
            return
        for (old, new), std, values in (
                (self.avg_kv, self.std_kv, [m.kv_usage for m in metrics]),
                (self.avg_queue, self.std_queue, [m.waiting for m in metrics]),
                (self.avg_running, self.std_running, [m.running for m in metrics])):
            mean, deviation = mean_and_deviation(values)
            old.labels(self.pool).set(mean)
            new.labels(self.pool).set(mean)
            std.labels(self.pool).set(deviation)

    def observe_load(self, snapshot: PoolSnapshot, load: InflightLoad, flow: FlowGate | None,
                     fairness: BoundedLabel | None = None) -> None:
        """The picker's in-flight counts per endpoint (``fairness``: the request families' bound on
        fairness ids) and, with flow control, its queue, saturation and capacity use."""
        self._observe_inflight(snapshot, load, fairness or BoundedLabel())
        if flow is None:
            return
        self._capacity(flow, flow.queue.stats())
        flow.saturation()  # read now: the stages' readings too
        for gauge in self.saturation:
            gauge.clear()  # a stage with no endpoint is no series, as the reference deletes it
            for stage, reading in flow.readings.items():
                gauge.labels(self.pool, stage).set(reading.saturation)
        if isinstance(flow.config.detector, UtilizationDetector):
            self.stale_endpoints.labels("utilization-detector").set(flow.readings["effective"].stale)

    def _observe_inflight(self, snapshot: PoolSnapshot, load: InflightLoad, fairness: BoundedLabel) -> None:
        """``llm_d_epp_inflight_*{endpoint_name, namespace, producer_name, fairness_id, priority}``: as the
        reference's producer, a series once made stays (at 0 when idle); here until its endpoint leaves
        the pool. ``endpoint_name`` is the address and ``namespace`` empty, as in the scheduler's attempts."""
        made, live = self._inflight, self._inflight_live
        for address in [a for a in made if a not in snapshot.states]:
            for labels in made.pop(address):
                self.inflight_requests.remove(*labels)
                self.inflight_tokens.remove(*labels)
            live.pop(address, None)
        producer = load.config.producer_name
        for address in snapshot.states:
            now: dict[tuple[str, ...], list[int]] = {}
            for (fairness_id, priority), requests, tokens in load.groups(address):
                total = now.setdefault((address, "", producer, fairness.bound(fairness_id), str(priority)), [0, 0])
                total[0] += requests
                total[1] += tokens
            series = made.setdefault(address, {})
            for labels in live.get(address, set()) - now.keys():
                for child in series[labels]:
                    child.set(0)
            for labels, (requests, tokens) in now.items():
                pair = series.get(labels)
                if pair is None:
                    pair = series[labels] = (self.inflight_requests.labels(*labels),
                                             self.inflight_tokens.labels(*labels))
                pair[0].set(requests)
                pair[1].set(tokens)
            live[address] = set(now)

    def _capacity(self, flow: FlowGate, stats: dict[int, tuple[int, int]]) -> None:
        """Each priority level's share of its band's capacity; the whole queue's of the global one when set."""
        config = flow.config
        for priority in flow.queue.priorities():
            band = config.band(priority)
            requests, size = stats.get(priority, (0, 0))
            self.band_use["requests"].labels(str(priority), self.pool).set(requests / band.max_requests)
            self.band_use["bytes"].labels(str(priority), self.pool).set(size / band.max_bytes)
        if config.max_requests is not None:
            self.global_use["requests"].labels(self.pool).set(flow.queue.requests / config.max_requests)
        if config.max_bytes is not None:
            self.global_use["bytes"].labels(self.pool).set(flow.queue.bytes / config.max_bytes)
