"""Saturation detectors, sans-IO: how full the pool is, 1.0 meaning "dispatch nothing more now".

``utilization-detector`` reads the scraped metrics (fail-closed: an endpoint whose metrics are
missing, failed or older than ``metricsStalenessThreshold`` counts as saturated);
``concurrency-detector`` reads the picker's own in-flight counts, so it reacts to each dispatch
at once. Both return 1.0 for an empty pool, as llm-d's do. ``headroom`` only matters to the
detectors' scheduling-filter role in llm-d, which profiles here do not have: it is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from evergreen_trio.picker.flow_control.config import ConcurrencyDetector, UtilizationDetector
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.plugins import ROLE_LABEL

if TYPE_CHECKING:  # the scheduler runs these detectors for the legacy admission
    from evergreen_trio.picker.scheduler import EndpointState

# llm-d-router's partitionEndpoints: which stage's saturation an endpoint's role counts towards. No
# role label, or an empty one, is decode; encode-only and unknown roles take no stage traffic.
_PREFILL_ROLES = frozenset({"prefill", "encode-prefill"})
_DECODE_ROLES = frozenset({"decode", ""})
_BOTH_ROLES = frozenset({"prefill-decode", "both", "encode-prefill-decode"})


class Reading(NamedTuple):
    """A detector's reading: the saturation, and how many endpoints it counted saturated for
    missing or stale metrics (the utilization detector's ``stale_endpoints``; 0 for the others)."""

    saturation: float
    stale: int = 0


def utilization(config: UtilizationDetector, states: Sequence[EndpointState], now: float) -> Reading:
    """Mean over endpoints of max(waiting / queueDepthThreshold, kv / kvCacheUtilThreshold)."""
    if not states:
        return Reading(1.0)
    total = 0.0
    stale = 0
    for state in states:
        metrics = state.metrics
        if metrics is None or not state.ready or now - state.updated_at > config.metrics_staleness_s:
            total += 1.0
            stale += 1
        else:
            total += max(metrics.waiting / config.queue_depth_threshold,
                         metrics.kv_usage / config.kv_cache_util_threshold)
    return Reading(total / len(states), stale)


def concurrency(config: ConcurrencyDetector, states: Sequence[EndpointState], load: InflightLoad) -> Reading:
    """In-flight requests (or tokens) over the endpoints' capacity; ``hybrid``: the mean per endpoint
    of the larger of the two ratios."""
    addresses = [s.endpoint.address for s in states]
    if not addresses:
        return Reading(1.0)
    requests = sum(load.requests(a) for a in addresses)
    tokens = sum(load.tokens(a) for a in addresses)
    if config.mode == "tokens":
        return Reading(tokens / (len(addresses) * config.max_token_concurrency))
    if config.mode == "hybrid":
        return Reading(sum(max(load.requests(a) / config.max_concurrency, load.tokens(a) / config.max_token_concurrency)
                           for a in addresses) / len(addresses))
    return Reading(requests / (len(addresses) * config.max_concurrency))


def saturation(config: UtilizationDetector | ConcurrencyDetector, states: Sequence[EndpointState], now: float,
               load: InflightLoad) -> Reading:
    """The configured detector's reading of ``states`` (the candidates) at ``now``."""
    if isinstance(config, ConcurrencyDetector):
        return concurrency(config, states, load)
    return utilization(config, states, now)


def stages(states: Sequence[EndpointState]) -> dict[str, list[EndpointState]]:
    """The endpoints each pipeline stage reads, by their ``llm-d.ai/role`` label: ``prefill`` and
    ``decode``, the interleaved roles in both; a stage with no endpoint is left out."""
    prefill: list[EndpointState] = []
    decode: list[EndpointState] = []
    for state in states:
        role = state.endpoint.label_map.get(ROLE_LABEL, "")
        if role in _PREFILL_ROLES or role in _BOTH_ROLES:
            prefill.append(state)
        if role in _DECODE_ROLES or role in _BOTH_ROLES:
            decode.append(state)
    return {name: part for name, part in (("prefill", prefill), ("decode", decode)) if part}


def staged_saturation(config: UtilizationDetector | ConcurrencyDetector, states: Sequence[EndpointState],
                      now: float, load: InflightLoad) -> dict[str, Reading]:
    """llm-d-router's flow-control reading: one per stage that has endpoints, and ``effective``,
    the largest of them (the whole pool's reading when no stage has any), which gates dispatch."""
    readings = {name: saturation(config, part, now, load) for name, part in stages(states).items()}
    readings["effective"] = (max(readings.values(), key=lambda r: r.saturation) if readings
                             else saturation(config, states, now, load))
    return readings
