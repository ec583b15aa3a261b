"""``endpoint-attribute-filter`` and ``endpoint-attribute-scorer``, sans-IO, with llm-d-router's
semantics (ebab68792, ``filter/endpointattribute``, ``scorer/endpointattribute``): route by one
numeric endpoint attribute.

The attribute is named by ``attribute`` (the filter) or ``attributeKey`` (the scorer) and its
``producer``: omitted, the ``core-metrics-extractor``, whose engines' ``customMetrics`` publish
attributes from each scrape (:mod:`evergreen_trio.picker.engine_metrics`); a name holding ``/``
then needs ``producer`` set (it is the old combined ``Attribute/Producer`` spelling, which would
match nothing). ``dcgm-extractor`` publishes ``GPUUtilization`` (:mod:`evergreen_trio.picker.dcgm`);
no other producer runs here, so another one's attribute is missing on every endpoint; a warning
at startup says so, as it does for a name no engine's ``customMetrics`` has and for the DCGM
attribute with no ``dcgm-extractor`` declared (the reference warns of none of these). Both read
the endpoint's last value, stale or not, as the reference reads its attribute map.

- The filter keeps the endpoints whose value compares true against ``algorithm.threshold``
  (``operator`` ``LessThan`` ... ``NotEqual``, ``value``); an endpoint without the attribute is
  kept (``onMissing: Pass``, the default) or dropped (``Fail``); nothing kept returns every
  candidate when ``fallbackOnEmpty``.
- The scorer normalizes linearly (``algorithm.type`` ``linear_lower_is_better`` or
  ``linear_higher_is_better``) against ``normalization.fixedRange`` (``min`` < ``max``, values
  clamped) or, by default, the range across the candidates holding the attribute (all equal:
  1.0 each). An endpoint without the attribute scores 0, and so does one whose score is NaN (a
  NaN or infinite value: the reference passes the NaN on into the weighted sum).
"""

from __future__ import annotations

import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from evergreen_trio.picker.dcgm import dcgm_published
from evergreen_trio.picker.engine_metrics import EndpointMetrics, EngineConfig
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

if TYPE_CHECKING:
    from evergreen_trio.picker.scheduler import EndpointState, PickRequest, Scheduler

log = logging.getLogger(__name__)

ATTRIBUTE_FILTER = "endpoint-attribute-filter"
ATTRIBUTE_SCORER = "endpoint-attribute-scorer"
CORE_PRODUCER = "core-metrics-extractor"
OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "LessThan": operator.lt, "LessThanOrEqual": operator.le, "GreaterThan": operator.gt,
    "GreaterThanOrEqual": operator.ge, "Equal": operator.eq, "NotEqual": operator.ne,
}
LOWER_IS_BETTER = "linear_lower_is_better"
HIGHER_IS_BETTER = "linear_higher_is_better"


@dataclass(frozen=True)
class AttributeKey:
    """An endpoint attribute: its name and the plugin that publishes it."""

    name: str
    producer: str = CORE_PRODUCER

    def read(self, state: EndpointState) -> float | None:
        """The endpoint's value: the core extractor's from its last scrape, another producer's from
        its attributes; None when it lacks one."""
        if self.producer != CORE_PRODUCER:
            return state.attributes.get((self.name, self.producer))
        return state.metrics.attributes.get(self.name) if state.metrics is not None else None


def _attribute_key(params: Params, name_field: str) -> AttributeKey:
    name = params.text(name_field, "")
    if not name:
        raise ConfigError(params.where(name_field), "a non-empty attribute name (required)", name)
    if params.raw.get("producer") is None:  # omitted (or null): the core metrics extractor's
        if "/" in name:
            head, _, tail = name.rpartition("/")
            raise ConfigError(params.where(name_field), "no '/' unless producer is set (the combined spelling "
                              f"is two parameters: {name_field}: {head!r}, producer: {tail!r})", name)
        return AttributeKey(name)
    return AttributeKey(name, params.text("producer", ""))


def _finite(params: Params, key: str) -> float:
    """A number parameter of any sign (0 when absent, as Go's zero value); JSON has no NaN or infinity."""
    return params.number(key, 0.0, minimum=-math.inf)


def _section(params: Params, key: str, known: Sequence[str]) -> Params | None:
    """The nested ``key`` mapping; None when it is absent or null (Go's nil pointer)."""
    return params.section(key, known) if params.raw.get(key) is not None else None


# -- the filter ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttributeFilterParams:
    """``endpoint-attribute-filter``: the attribute, its threshold, and the missing/empty policies."""

    key: AttributeKey
    operator: str
    value: float
    pass_on_missing: bool = True
    fallback_on_empty: bool = False

    def passes(self, value: float | None) -> bool:
        """Whether an endpoint with ``value`` (None: without the attribute) passes."""
        return self.pass_on_missing if value is None else OPERATORS[self.operator](value, self.value)


def _attribute_filter(params: Params) -> AttributeFilterParams:
    key = _attribute_key(params, "attribute")
    on_missing = params.text("onMissing", "")
    if on_missing not in ("", "Pass", "Fail"):
        raise ConfigError(params.where("onMissing"), "Pass | Fail", on_missing)
    algorithm = params.section("algorithm", ("type", "threshold"))
    algorithm.text("type", "", choices=("threshold",))
    threshold = _section(algorithm, "threshold", ("operator", "value"))
    if threshold is None:
        raise ConfigError(algorithm.where("threshold"), "a threshold (required with type threshold)", None)
    return AttributeFilterParams(key, threshold.text("operator", "", choices=tuple(OPERATORS)),
                                 _finite(threshold, "value"), on_missing != "Fail",
                                 params.boolean("fallbackOnEmpty", False))


def attribute_filter(params: AttributeFilterParams, values: Mapping[str, float | None]) -> list[str]:
    """The addresses kept, in order; ``values``: each candidate's attribute (None: missing)."""
    kept = [address for address, value in values.items() if params.passes(value)]
    return list(values) if not kept and params.fallback_on_empty else kept


# -- the scorer ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttributeScorerParams:
    """``endpoint-attribute-scorer``: the attribute, the direction, and a fixed range (None: adaptive)."""

    key: AttributeKey
    lower_is_better: bool = True
    fixed_range: tuple[float, float] | None = None


def _attribute_scorer(params: Params) -> AttributeScorerParams:
    key = _attribute_key(params, "attributeKey")
    algorithm = params.section("algorithm", ("type", "normalization"))
    kind = algorithm.text("type", "", choices=(LOWER_IS_BETTER, HIGHER_IS_BETTER))
    normalization = algorithm.section("normalization", ("fixedRange", "adaptiveRange"))
    fixed = _section(normalization, "fixedRange", ("min", "max"))
    adaptive = _section(normalization, "adaptiveRange", ())
    if fixed is not None and adaptive is not None:
        raise ConfigError(normalization.path, "at most one normalization strategy", "fixedRange and adaptiveRange")
    bounds = None
    if fixed is not None:
        bounds = (_finite(fixed, "min"), _finite(fixed, "max"))
        if bounds[0] >= bounds[1]:
            raise ConfigError(fixed.path, "min < max", dict(fixed.raw))
    return AttributeScorerParams(key, kind == LOWER_IS_BETTER, bounds)


def attribute_scores(params: AttributeScorerParams, values: Mapping[str, float | None]) -> dict[str, float]:
    """A score in [0, 1] for every address in ``values`` (each candidate's attribute, None: missing)."""
    if params.fixed_range is not None:
        low, high = params.fixed_range
    else:  # compared as the reference compares: a NaN value widens nothing
        low, high = math.inf, -math.inf
        for value in values.values():
            if value is not None:
                low, high = (value if value < low else low), (value if value > high else high)
    scores = {}
    for address, value in values.items():
        if value is None:
            scores[address] = 0.0
            continue
        if params.fixed_range is None and low == high:
            scores[address] = 1.0  # every endpoint with the attribute has the same value
            continue
        normalized = (value - low) / (high - low)
        if math.isnan(normalized):
            scores[address] = 0.0
            continue
        normalized = min(1.0, max(0.0, normalized))  # only a fixed range can put it outside
        scores[address] = 1.0 - normalized if params.lower_is_better else normalized
    return scores


def warn_unpublished(plugins: Mapping[str, Plugin]) -> None:
    """Log one warning per declared attribute plugin whose attribute nothing here publishes: another
    producer's, or a name no engine's ``customMetrics`` has (every endpoint then lacks it)."""
    engines = [p.params for p in plugins.values() if isinstance(p.params, EngineConfig)]
    published = {key for config in engines for spec in config.engines.values() for key, _ in spec.custom}
    others = dcgm_published(plugins)
    for plugin in plugins.values():
        if not isinstance(plugin.params, AttributeFilterParams | AttributeScorerParams):
            continue
        key = plugin.params.key
        if key.producer != CORE_PRODUCER:
            if (key.name, key.producer) in others:
                continue
            why = f"no plugin declared here publishes {key.name!r} of producer {key.producer!r}"
        elif key.name not in published:
            why = "no customMetrics entry of core-metrics-extractor has that attributeKey"
        else:
            continue
        log.warning("picker.attribute_not_published plugin=%s attribute=%r: %s, so every endpoint lacks it",
                    plugin.name, key.name, why)


# -- in the scheduler ---------------------------------------------------------------------------


def _values(key: AttributeKey, candidates: Sequence[EndpointState]) -> dict[str, float | None]:
    return {s.endpoint.address: key.read(s) for s in candidates}


def _filter(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            params: object) -> list[EndpointState]:
    assert isinstance(params, AttributeFilterParams)
    by_address = {s.endpoint.address: s for s in candidates}
    return [by_address[a] for a in attribute_filter(params, _values(params.key, candidates))]


def _scorer(scheduler: Scheduler, request: PickRequest, candidates: Sequence[EndpointState],
            fresh: Mapping[str, EndpointMetrics], params: object) -> dict[str, float]:
    assert isinstance(params, AttributeScorerParams)
    return attribute_scores(params, _values(params.key, candidates))


register(ATTRIBUTE_FILTER, PluginType(
    Category.FILTER, ("attribute", "producer", "onMissing", "fallbackOnEmpty", "algorithm"), _attribute_filter))
register(ATTRIBUTE_SCORER, PluginType(Category.SCORER, ("attributeKey", "producer", "algorithm"), _attribute_scorer))

ATTRIBUTE_FILTERS = {ATTRIBUTE_FILTER: _filter}
ATTRIBUTE_SCORERS = {ATTRIBUTE_SCORER: _scorer}
