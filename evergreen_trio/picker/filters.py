"""Load filters, sans-IO, with llm-d-router's semantics (ebab68792).

``utilization-filter`` (``filter/utilization``): keeps the candidates whose every condition holds,
a condition capping one metric at ``maxValue``: ``active-requests`` (the requests this picker has
in flight there, as the ``inflight-load-producer`` counts them), ``running-requests``,
``waiting-queue`` and ``kv-cache-utilization`` (the last scrape, stale or not, as the reference
reads the endpoint's metrics; none scraped counts 0). When nothing passes, ``fallbackOnEmpty``
returns every candidate, else none.

The scheduler runs it (its function is merged into the scheduler's filters); the type is
registered on import.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.checks import sequence
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Scheduler

UTILIZATION = "utilization-filter"
ACTIVE_REQUESTS = "active-requests"
RUNNING_REQUESTS = "running-requests"
WAITING_QUEUE = "waiting-queue"
KV_CACHE_UTILIZATION = "kv-cache-utilization"
UTILIZATION_METRICS = (ACTIVE_REQUESTS, RUNNING_REQUESTS, WAITING_QUEUE, KV_CACHE_UTILIZATION)


@dataclass(frozen=True)
class Condition:
    """One cap: an endpoint passes while ``metric`` is at most ``max_value``."""

    metric: str
    max_value: float


@dataclass(frozen=True)
class UtilizationParams:
    """``utilization-filter``: the caps every kept endpoint satisfies, and the empty-result policy."""

    conditions: tuple[Condition, ...]
    fallback_on_empty: bool = False


def _condition(params: Params) -> Condition:
    metric = params.text("metric", "", choices=UTILIZATION_METRICS)
    if not params.has("maxValue"):
        raise ConfigError(params.where("maxValue"), f"a maxValue for {metric} (required)", None)
    # Only a fraction is a sensible KV cap; the reference refuses more than 1 for it alone.
    return Condition(metric, params.number("maxValue", 0.0, maximum=1.0 if metric == KV_CACHE_UTILIZATION else None))


def _utilization(params: Params) -> UtilizationParams:
    listed = params.raw.get("conditions")
    conditions = tuple(
        _condition(Params(raw, params.where(f"conditions[{i}]"), "conditions", ("metric", "maxValue")))
        for i, raw in enumerate(sequence([] if listed is None else listed, params.where("conditions"))))
    if not conditions:
        raise ConfigError(params.where("conditions"), "at least one condition", listed)
    params.text("inFlightLoadProducerName", "")  # our in-flight counts are the one producer's
    return UtilizationParams(conditions, params.boolean("fallbackOnEmpty", False))


def metric_value(metric: str, metrics: EndpointMetrics | None, active_requests: int) -> float:
    """The value a condition on ``metric`` compares; scraped metrics count 0 when there are none."""
    if metric == ACTIVE_REQUESTS:
        return float(active_requests)
    if metrics is None:
        return 0.0
    if metric == RUNNING_REQUESTS:
        return metrics.running
    if metric == WAITING_QUEUE:
        return metrics.waiting
    return metrics.kv_usage


def utilization(params: UtilizationParams, loads: Mapping[str, tuple[EndpointMetrics | None, int]]) -> list[str]:
    """The addresses kept, in order; ``loads``: each candidate's last metrics and in-flight requests."""
    # "Exceeds drops" rather than "at most keeps", as the reference compares: a NaN metric passes.
    kept = [address for address, (metrics, active) in loads.items()
            if not any(metric_value(c.metric, metrics, active) > c.max_value for c in params.conditions)]
    return list(loads) if not kept and params.fallback_on_empty else kept


def _utilization_filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
                        params: object) -> list[EndpointState]:
    assert isinstance(params, UtilizationParams)
    by_address = {s.endpoint.address: s for s in candidates}
    loads = {a: (s.metrics, scheduler.inflight.requests(a)) for a, s in by_address.items()}
    return [by_address[a] for a in utilization(params, loads)]


register(UTILIZATION, PluginType(Category.FILTER, ("conditions", "fallbackOnEmpty", "inFlightLoadProducerName"),
                                 _utilization))

LOAD_FILTERS = {UTILIZATION: _utilization_filter}
