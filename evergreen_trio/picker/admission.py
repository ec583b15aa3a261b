"""Admission plugins, sans-IO, run as llm-d-router's director runs its Admitters (ebab68792).

The admission step comes after flow control (or the legacy saturation shedding) and the check
that the pool has candidates, before the scheduling profiles. Every declared admitter sees the
request's priority and the candidates' last scraped metrics; the first to deny it ends the
request with 500 and ``request cannot be admitted: <its reason>`` (the reference's
``errcommon.Internal``, whatever code the admitter's own error had). They run in declaration
order (the reference's order is its plugin map's, unspecified).

``probabilistic-admitter`` (``requestcontrol/admitter/probabilisticadmitter``): admits every
request of priority 0 or more, and a sheddable one (below 0) unless a uniform draw falls under
``min(saturation^power x k, 1)``, the saturation being the candidates' mean of
``max(waiting / queueDepthThreshold, kv usage / kvCacheUtilThreshold)`` (an endpoint never
scraped counts 1). With no candidates it admits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError, RequestError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

PROBABILISTIC = "probabilistic-admitter"
# Go's int, which the reference decodes queueDepthThreshold into.
_GO_INT_MAX = 2**63 - 1


@runtime_checkable
class Admitter(Protocol):
    """One declared admitter's parameters, able to judge a request."""

    def denial(self, priority: int, metrics: Sequence[EndpointMetrics | None],
               draw: Callable[[], float]) -> str | None:
        """Why the request is denied (the reference's error text), or None to admit it.

        ``metrics``: each candidate's last scrape (None: never scraped); ``draw``: a uniform draw
        in [0, 1), called only when the decision needs one.
        """


def admit(admitters: Iterable[Admitter], priority: int, metrics: Sequence[EndpointMetrics | None],
          draw: Callable[[], float]) -> None:
    """Run ``admitters`` in order; RequestError 500 with the first denial's reason."""
    for admitter in admitters:
        reason = admitter.denial(priority, metrics, draw)
        if reason is not None:
            raise RequestError(500, f"request cannot be admitted: {reason}")


def declared_admitters(plugins: Iterable[Plugin]) -> list[Admitter]:
    """The admitters among a config's declared plugins, in declaration order."""
    return [p.params for p in plugins if p.category is Category.ADMITTER and isinstance(p.params, Admitter)]


def _go_pow(base: float, exponent: float) -> float:
    """``math.Pow``: an overflow is +Inf and a negative base to a fraction NaN, where Python raises."""
    try:
        return math.pow(base, exponent)
    except OverflowError:
        return math.inf
    except ValueError:
        return math.nan


def _go_max(a: float, b: float) -> float:
    """``math.Max``: NaN if either is (Python's max depends on the order)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


@dataclass(frozen=True)
class ProbabilisticAdmitter:
    """``probabilistic-admitter``'s parameters: full-load thresholds and the shedding curve."""

    queue_depth_threshold: int = 5
    kv_cache_util_threshold: float = 0.8
    power: float = 5.0
    k: float = 300.0

    def saturation(self, metrics: Sequence[EndpointMetrics | None]) -> float:
        """The mean over ``metrics`` (not empty) of max(waiting / queue threshold, kv / kv threshold)."""
        total = 0.0
        for endpoint in metrics:
            if endpoint is None:
                total += 1.0
            else:
                total += _go_max(endpoint.waiting / self.queue_depth_threshold,
                                 endpoint.kv_usage / self.kv_cache_util_threshold)
        return total / len(metrics)

    def probability(self, saturation: float) -> float:
        """The rejection probability of a sheddable request at ``saturation``."""
        return min(_go_pow(saturation, self.power) * self.k, 1.0)

    def denial(self, priority: int, metrics: Sequence[EndpointMetrics | None],
               draw: Callable[[], float]) -> str | None:
        if priority >= 0 or not metrics:
            return None
        saturation = self.saturation(metrics)
        probability = self.probability(saturation)
        if not draw() < probability:
            return None
        # Go's %.3f writes +Inf so; a denial's probability is always a number in (0, 1].
        shown = "+Inf" if saturation == math.inf else f"{saturation:.3f}"
        return (f"inference error: ResourceExhausted - probabilistic-admitter: rejected, saturation={shown} "
                f"prob={probability:.2f}")


def _positive(params: Params, key: str, default: float) -> float:
    """A finite number > 0 (JSON, which the reference decodes its parameters from, has no infinity)."""
    value = params.number(key, default, minimum=-math.inf)
    if value <= 0:
        raise ConfigError(params.where(key), "a finite number > 0", value)
    return value


def _probabilistic(params: Params) -> ProbabilisticAdmitter:
    return ProbabilisticAdmitter(
        params.integer("queueDepthThreshold", 5, minimum=1, maximum=_GO_INT_MAX),
        _positive(params, "kvCacheUtilThreshold", 0.8), _positive(params, "power", 5.0), _positive(params, "k", 300.0))


register(PROBABILISTIC, PluginType(Category.ADMITTER, ("queueDepthThreshold", "kvCacheUtilThreshold", "power", "k"),
                                   _probabilistic))
