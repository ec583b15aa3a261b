"""Usage-limit policies (llm-d-router's flowcontrol/usagelimits), sans-IO: each dispatch cycle
they give every priority level a ceiling, and a band whose ceiling the pool's saturation reaches
is not served (nor, head-of-line, any band below it) on that cycle.

- ``static-usage-limit-policy`` (the default): ``threshold`` (1.0) for every band.
- ``priority-holdback-policy``: from ``maxCeiling`` (1.0) for the highest priority to
  ``minCeiling`` (required) for the lowest, linearly by rank (``domain: rank``, the default) or by
  priority value (``domain: value``); one priority level alone gets ``maxCeiling``.
- ``soft-reflective-ceiling-policy``: band i of N (0 the highest) is open while saturation is
  below 1 - i x saturation / (N - 1); past that, every such band opens together on one cycle in
  round(saturation / (1 - saturation)) (a tick shared by all, counted on the cycles where some
  band is past its ceiling), and at saturation 1.0 it stays shut. Band 0 is never held back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, PluginType, register

STATIC_USAGE_LIMIT = "static-usage-limit-policy"
PRIORITY_HOLDBACK = "priority-holdback-policy"
SOFT_REFLECTIVE_CEILING = "soft-reflective-ceiling-policy"
USAGE_LIMIT_POLICIES = (STATIC_USAGE_LIMIT, PRIORITY_HOLDBACK, SOFT_REFLECTIVE_CEILING)
DOMAINS = ("rank", "value")


@dataclass(frozen=True)
class StaticUsageLimit:
    """The same ceiling for every band (the reference checks no range: 1.0 is "no gating")."""

    threshold: float = 1.0


@dataclass(frozen=True)
class PriorityHoldback:
    """Ceilings from ``max_ceiling`` (highest priority) down to ``min_ceiling`` (lowest)."""

    min_ceiling: float
    max_ceiling: float = 1.0
    domain: str = "rank"


@dataclass(frozen=True)
class SoftReflectiveCeiling:
    """No parameters: saturation and the number of priority levels decide."""


UsageLimitParams = StaticUsageLimit | PriorityHoldback | SoftReflectiveCeiling


def _finite(params: Params, key: str, default: float) -> float:
    return params.number(key, default, minimum=-math.inf)


def _static(params: Params) -> StaticUsageLimit:
    return StaticUsageLimit(_finite(params, "threshold", 1.0))


def _holdback(params: Params) -> PriorityHoldback:
    if params.raw.get("minCeiling") is None:
        raise ConfigError(params.where("minCeiling"), "a number in [0.0, 1.0) (it is required)", None)
    params.text("shape", "linear", choices=("linear",))
    domain = params.text("domain", "rank", choices=DOMAINS)
    low = _finite(params, "minCeiling", 0.0)
    if not 0.0 <= low < 1.0:
        raise ConfigError(params.where("minCeiling"), "a number in [0.0, 1.0)", low)
    high = _finite(params, "maxCeiling", 1.0)
    if not 0.0 < high <= 1.0:
        raise ConfigError(params.where("maxCeiling"), "a number in (0.0, 1.0]", high)
    if low >= high:
        raise ConfigError(params.where("minCeiling"), f"less than maxCeiling ({high})", low)
    return PriorityHoldback(low, high, domain)


register(STATIC_USAGE_LIMIT, PluginType(Category.OTHER, ("threshold",), _static))
register(PRIORITY_HOLDBACK, PluginType(Category.OTHER, ("shape", "domain", "minCeiling", "maxCeiling"), _holdback))
register(SOFT_REFLECTIVE_CEILING, PluginType(Category.OTHER, (), lambda params: SoftReflectiveCeiling()))


def _go_round(value: float) -> float:
    """Go's math.Round: half away from zero (Python's round() goes to even)."""
    whole = math.trunc(value)
    return whole + math.copysign(1.0, value) if abs(value - whole) >= 0.5 else whole


class UsageLimit:
    """The configured policy, with the soft reflective ceiling's shared tick."""

    def __init__(self, params: UsageLimitParams) -> None:
        self.params = params
        self.tick = 0
        # Whether the last call shut a band that a later call may open with nothing else changed.
        self.alternating = False

    def ceilings(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        """One ceiling per priority level (``priorities`` highest first); called once per dispatch cycle."""
        params = self.params
        if isinstance(params, StaticUsageLimit):
            return [params.threshold] * len(priorities)
        if isinstance(params, PriorityHoldback):
            return _holdback_ceilings(params, priorities)
        return self._soft_reflective(saturation, priorities)

    def _soft_reflective(self, saturation: float, priorities: Sequence[int]) -> list[float]:
        n = len(priorities)
        self.alternating = False
        if n <= 1:
            return [1.0] * n
        # Ceilings fall with rank, so some band is past its ceiling iff the lowest (1 - saturation) is.
        is_open = False
        if 1.0 - saturation <= saturation < 1.0:
            # 1e-9 guards against round-off when saturation is very near 1.0.
            period = max(1, int(_go_round(saturation / (1.0 - saturation + 1e-9))))
            self.tick += 1
            is_open = self.tick % period == 0
        ceilings = [1.0]
        for i in range(1, n):
            if saturation < 1.0 - i * saturation / (n - 1):
                ceilings.append(1.0)
            elif saturation >= 1.0:
                ceilings.append(0.0)
            else:
                self.alternating = True
                ceilings.append(1.0 if is_open else 0.0)
        return ceilings


def _holdback_ceilings(params: PriorityHoldback, priorities: Sequence[int]) -> list[float]:
    n = len(priorities)
    high, low = params.max_ceiling, params.min_ceiling
    if n <= 1:
        return [high] * n  # one priority level: no holdback, work-conserving
    if params.domain == "rank":
        return [high - i * (high - low) / (n - 1) for i in range(n)]
    top, bottom = priorities[0], priorities[-1]
    if top == bottom:
        return [high] * n
    return [low + (p - bottom) / (top - bottom) * (high - low) for p in priorities]
