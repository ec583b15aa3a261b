"""Saturation detectors, sans-IO: how full the pool is, 1.0 meaning "dispatch nothing more now".

``utilization-detector`` reads the scraped metrics (fail-closed: an endpoint whose metrics are
missing, failed or older than ``metricsStalenessThreshold`` counts as saturated);
``concurrency-detector`` reads the picker's own in-flight counts, so it reacts to each dispatch
at once. Both return 1.0 for an empty pool, as llm-d's do. ``headroom`` only matters to the
detectors' scheduling-filter role in llm-d, which profiles here do not have: it is accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from evergreen_trio.picker.flow_control.config import ConcurrencyDetector, UtilizationDetector
from evergreen_trio.picker.inflight import InflightLoad

if TYPE_CHECKING:  # the scheduler runs these detectors for the legacy admission
    from evergreen_trio.picker.scheduler import PoolSnapshot


def utilization(config: UtilizationDetector, snapshot: PoolSnapshot) -> float:
    """Mean over endpoints of max(waiting / queueDepthThreshold, kv / kvCacheUtilThreshold)."""
    states = list(snapshot.states.values())
    if not states:
        return 1.0
    now = snapshot.clock()
    total = 0.0
    for state in states:
        metrics = state.metrics
        if metrics is None or not state.ready or now - state.updated_at > config.metrics_staleness_s:
            total += 1.0
        else:
            total += max(metrics.waiting / config.queue_depth_threshold,
                         metrics.kv_usage / config.kv_cache_util_threshold)
    return total / len(states)


def concurrency(config: ConcurrencyDetector, snapshot: PoolSnapshot, load: InflightLoad) -> float:
    """In-flight requests (or tokens) over the pool's capacity; ``hybrid``: the mean per endpoint of
    the larger of the two ratios."""
    addresses = list(snapshot.states)
    if not addresses:
        return 1.0
    requests = sum(load.requests(a) for a in addresses)
    tokens = sum(load.tokens(a) for a in addresses)
    if config.mode == "tokens":
        return tokens / (len(addresses) * config.max_token_concurrency)
    if config.mode == "hybrid":
        return sum(max(load.requests(a) / config.max_concurrency, load.tokens(a) / config.max_token_concurrency)
                   for a in addresses) / len(addresses)
    return requests / (len(addresses) * config.max_concurrency)


def saturation(config: UtilizationDetector | ConcurrencyDetector, snapshot: PoolSnapshot,
               load: InflightLoad) -> float:
    """The configured detector's reading."""
    if isinstance(config, ConcurrencyDetector):
        return concurrency(config, snapshot, load)
    return utilization(config, snapshot)
