"""The ``featureGates`` and ``flowControl:`` parts of an ``EndpointPickerConfig`` -> :class:`FlowControlConfig`.

As llm-d-router reads them::

    featureGates: [flowControl]
    plugins:
    - {type: edf-ordering-policy, name: edf}
    - {type: concurrency-detector, name: cd, parameters: {maxConcurrency: 8}}
    flowControl:
      maxBytes: 1Gi                 # all bands together (optional)
      maxRequests: 2k
      defaultRequestTTL: 60s        # the queue-wait budget; 0s: no limit
      noEndpointRequestTTL: 5m      # while the pool has no endpoints (default: defaultRequestTTL)
      priorityBands:
      - {priority: 10, maxRequests: 100, orderingPolicyRef: edf, fairnessPolicyRef: round-robin-fairness-policy}
      defaultPriorityBand: {maxRequests: 500}
      saturationDetector: {pluginRef: cd}
      enableEviction: true          # evict sheddable in-flight requests for blocked higher bands

A band's ``maxBytes`` and ``maxRequests`` default to 1G and 5000 (0 means the default, as in
llm-d); the global ones are unlimited unless set. Quantities are Kubernetes quantities (``1Gi``,
``500M``, ``2k``), durations Go's (``1m30s``). Policy and detector references name a plugin
declared in ``plugins`` or a stateless built-in type by its own name (:data:`PLUGIN_TYPES`; the
others, like ``program-aware-fairness``, must be declared, as in llm-d).
Every problem is one :class:`ConfigError` naming the field. The plugin types and the section are
registered with :mod:`evergreen_trio.picker.plugins` and :mod:`evergreen_trio.picker.epp_config` on import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from evergreen_trio.picker.checks import integer, mapping, sequence, string
from evergreen_trio.picker.epp_config import EppConfig, register_feature_gate, register_section
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.flow_control.eviction import PRIORITY_THEN_TIME, SHEDDABLE_FILTER
from evergreen_trio.picker.flow_control.program_aware import PROGRAM_AWARE, ProgramAwareParams
from evergreen_trio.picker.flow_control.slo_deadline import SLO_DEADLINE
from evergreen_trio.picker.flow_control.usage_limits import (
    STATIC_USAGE_LIMIT,
    USAGE_LIMIT_POLICIES,
    StaticUsageLimit,
    UsageLimitParams,
)
from evergreen_trio.picker.plugins import Category, Params, Plugin, PluginType, register

FEATURE_GATE = "flowControl"
FCFS, EDF = "fcfs-ordering-policy", "edf-ordering-policy"
GLOBAL_STRICT, ROUND_ROBIN = "global-strict-fairness-policy", "round-robin-fairness-policy"
UTILIZATION, CONCURRENCY = "utilization-detector", "concurrency-detector"
ORDERING_POLICIES = (FCFS, EDF, SLO_DEADLINE)
FAIRNESS_POLICIES = (GLOBAL_STRICT, ROUND_ROBIN, PROGRAM_AWARE)
DETECTORS = (UTILIZATION, CONCURRENCY)
# The types a reference may name without declaring them (llm-d injects some; the stateless ones).
PLUGIN_TYPES = (FCFS, EDF, GLOBAL_STRICT, ROUND_ROBIN, *DETECTORS, STATIC_USAGE_LIMIT)
DEFAULT_BAND_MAX_BYTES = 1_000_000_000
DEFAULT_BAND_MAX_REQUESTS = 5000
DEFAULT_TTL_S = 60.0
CONCURRENCY_MODES = ("requests", "tokens", "hybrid")
_SECTION = "flowControl"
_DETECTOR_KEY = "saturation_detector"  # in EppConfig.extra: the detector flowControl.saturationDetector names


@dataclass(frozen=True)
class BandConfig:
    """One priority band: its capacity and its policies (by type)."""

    priority: int = 0
    max_bytes: int = DEFAULT_BAND_MAX_BYTES
    max_requests: int = DEFAULT_BAND_MAX_REQUESTS
    fairness: str = GLOBAL_STRICT
    ordering: str = FCFS
    # The declared plugin a stateful fairness policy (program-aware-fairness) is: bands naming it share it.
    fairness_name: str | None = None


@dataclass(frozen=True)
class UtilizationDetector:
    """``utilization-detector``: mean over endpoints of max(waiting / queue, kv / kv threshold);
    an endpoint without metrics as fresh as ``metrics_staleness_s`` counts 1.0."""

    queue_depth_threshold: float = 5
    kv_cache_util_threshold: float = 0.8
    metrics_staleness_s: float = 0.2
    headroom: float = 0.0


@dataclass(frozen=True)
class ConcurrencyDetector:
    """``concurrency-detector``: the picker's in-flight requests (or tokens) over the pool's capacity."""

    mode: str = "requests"
    max_concurrency: int = 100
    max_token_concurrency: int = 1_000_000
    headroom: float = 0.0


@dataclass(frozen=True)
class FlowControlConfig:
    """The flow control layer; ``ttl_s``/``no_endpoint_ttl_s`` 0 means no limit."""

    max_bytes: int | None = None
    max_requests: int | None = None
    ttl_s: float = DEFAULT_TTL_S
    no_endpoint_ttl_s: float = DEFAULT_TTL_S
    bands: tuple[BandConfig, ...] = ()
    default_band: BandConfig = field(default_factory=BandConfig)
    default_negative_band: BandConfig | None = None
    detector: UtilizationDetector | ConcurrencyDetector = field(default_factory=UtilizationDetector)
    # Every declared program-aware-fairness plugin (each follows all requests, referenced or not).
    programs: tuple[tuple[str, ProgramAwareParams], ...] = ()
    usage_limit: UsageLimitParams = field(default_factory=StaticUsageLimit)
    eviction: bool = False  # enableEviction: revoke sheddable in-flight requests for blocked higher bands

    def band(self, priority: int) -> BandConfig:
        """The band a priority lands in: a configured one, else a copy of the default template."""
        for band in self.bands:
            if band.priority == priority:
                return band
        template = self.default_negative_band if priority < 0 and self.default_negative_band else self.default_band
        return BandConfig(priority, template.max_bytes, template.max_requests, template.fairness, template.ordering,
                          template.fairness_name)


def queue_wait(config: FlowControlConfig | None) -> float | None:
    """The longest a request may wait in the queue (0: no limit; None: no flow control), for
    the gateway's Envoy ``message_timeout``."""
    if config is None:
        return None
    if not config.ttl_s or not config.no_endpoint_ttl_s:
        return 0.0
    return max(config.ttl_s, config.no_endpoint_ttl_s)


_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
MAX_GO_DURATION_S = (2**63 - 1) / 1e9
"""The longest Go duration (int64 nanoseconds, about 292 years): Go's ParseDuration refuses more."""


def go_duration(value: object, path: str) -> float:
    """A Go duration string (``60s``, ``1m30s``, ``200ms``, ``0s``) -> seconds in 0..MAX_GO_DURATION_S."""
    if isinstance(value, str) and value:
        text = value.strip()
        if text == "0":
            return 0.0
        pos, total = 0, 0.0
        for match in _GO_DURATION.finditer(text):
            if match.start() != pos:
                break
            total += float(match.group(1)) * _GO_UNITS[match.group(2)]
            pos = match.end()
        else:
            if pos == len(text) and pos and total <= MAX_GO_DURATION_S:
                return total
    raise ConfigError(path, "a duration like '60s', '1m30s' or '0s'", value)


_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_QUANTITY_UNITS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: object, path: str) -> int:
    """A Kubernetes quantity (``1Gi``, ``500M``, ``2k``, ``100``) -> a whole number >= 0, a
    fraction rounded up (``1.5`` is 2), as the reference's ``Quantity.Value()``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _QUANTITY.match(value.strip())
        unit = _QUANTITY_UNITS[match.group(2)] if match else 0
        # Digits past float64's range are refused; the value is exact (a float rounds 0.3k to 300.00000000000006).
        if match and math.isfinite(float(match.group(1)) * unit):
            return math.ceil(Fraction(match.group(1)) * unit)
    raise ConfigError(path, "a quantity >= 0 like '100', '2k' or '1Gi'", value)


_DECIMAL_EXPONENTS = {None: 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity_int64(text: str) -> int | None:
    """``resource.ParseQuantity(text).AsInt64()`` for a ``text`` :func:`quantity` takes (the
    reference's gRPC message size flags): None where Go's is not ok. Its int64 form holds at most
    18 digits at a scale >= 0, so a fraction the suffix does not scale to a whole number (``1.5``,
    ``1.0``, ``1.5Mi``) is refused, not rounded; so are a binary multiple of too many digits
    (``1Pi``) and 2**63 or more."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        return None
    whole, _, fraction = match.group(1).partition(".")
    digits = len(whole.lstrip("0") or "0") + len(fraction)  # Go strips leading zeros first
    suffix = match.group(2)
    if suffix in _DECIMAL_EXPONENTS:
        scale = _DECIMAL_EXPONENTS[suffix] - len(fraction)
        if digits > 18 or scale < 0:
            return None
        value = int(whole + fraction) * 10**scale
    else:
        exponent = _QUANTITY_UNITS[suffix].bit_length() - 1
        if fraction or 15 - digits - exponent * 3 // 10 - 1 < 0:  # ParseQuantity's binary fast path
            return None
        value = int(whole) << exponent
    return value if value < 2**63 else None


def _known(doc: Mapping[str, Any], allowed: tuple[str, ...], path: str) -> None:
    for key in doc:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}", f"one of {sorted(allowed)}", key)


def _utilization(params: Params) -> UtilizationDetector:
    staleness = go_duration(params.raw.get("metricsStalenessThreshold", "200ms"),
                            params.where("metricsStalenessThreshold"))
    if staleness <= 0:
        raise ConfigError(params.where("metricsStalenessThreshold"), "a duration > 0",
                          params.raw["metricsStalenessThreshold"])
    kv = params.number("kvCacheUtilThreshold", 0.8, maximum=1.0)
    if kv <= 0:
        raise ConfigError(params.where("kvCacheUtilThreshold"), "a number in (0, 1]", kv)
    return UtilizationDetector(params.integer("queueDepthThreshold", 5, minimum=1), kv, staleness,
                               params.number("headroom", 0.0))


def _concurrency(params: Params) -> ConcurrencyDetector:
    params.text("inFlightLoadProducerName", "")
    return ConcurrencyDetector(params.text("concurrencyMode", "requests", choices=CONCURRENCY_MODES),
                               params.integer("maxConcurrency", 100, minimum=1),
                               params.integer("maxTokenConcurrency", 1_000_000, minimum=1),
                               params.number("headroom", 0.0))


# These llm-d policies take no parameters; the eviction ones are always the policies eviction
# uses (llm-d-router wires them in whether declared or not).
for _policy in (FCFS, EDF, GLOBAL_STRICT, ROUND_ROBIN, SHEDDABLE_FILTER, PRIORITY_THEN_TIME):
    register(_policy, PluginType(Category.OTHER))
register(UTILIZATION, PluginType(Category.OTHER, (
    "queueDepthThreshold", "kvCacheUtilThreshold", "metricsStalenessThreshold", "headroom"), _utilization))
register(CONCURRENCY, PluginType(Category.OTHER, (
    "concurrencyMode", "maxConcurrency", "maxTokenConcurrency", "headroom", "inFlightLoadProducerName"), _concurrency))
_BUILT_IN = {UTILIZATION: UtilizationDetector(), CONCURRENCY: ConcurrencyDetector(),
             STATIC_USAGE_LIMIT: StaticUsageLimit()}


def _ref(value: object, plugins: Mapping[str, Plugin], kinds: tuple[str, ...], path: str) -> Plugin:
    """The plugin ``value`` names: a declared one, else a built-in type by its own name."""
    name = string(value, path)
    plugin = plugins.get(name) or (Plugin(name, name, _BUILT_IN.get(name)) if name in PLUGIN_TYPES else None)
    if plugin is None or plugin.type not in kinds:
        raise ConfigError(path, f"a declared plugin of type {' or '.join(kinds)}", name)
    return plugin


def _band(doc: Mapping[str, Any], plugins: Mapping[str, Plugin], path: str, *, template: bool) -> BandConfig:
    keys = ("maxBytes", "maxRequests", "fairnessPolicyRef", "orderingPolicyRef")
    _known(doc, keys if template else ("priority", *keys), path)
    priority = 0 if template else integer(doc.get("priority"), f"{path}.priority")
    max_bytes = quantity(doc.get("maxBytes", 0), f"{path}.maxBytes") or DEFAULT_BAND_MAX_BYTES
    max_requests = quantity(doc.get("maxRequests", 0), f"{path}.maxRequests") or DEFAULT_BAND_MAX_REQUESTS
    fairness = _ref(_or_default(doc.get("fairnessPolicyRef"), GLOBAL_STRICT), plugins, FAIRNESS_POLICIES,
                    f"{path}.fairnessPolicyRef")
    ordering = _ref(_or_default(doc.get("orderingPolicyRef"), FCFS), plugins, ORDERING_POLICIES,
                    f"{path}.orderingPolicyRef")
    name = fairness.name if fairness.type == PROGRAM_AWARE else None
    return BandConfig(priority, max_bytes, max_requests, fairness.type, ordering.type, name)


def _or_default(ref: object, default: str) -> object:
    """An unset or empty reference names llm-d's default plugin (injected under its type's name
    unless a plugin of that name is declared)."""
    return default if ref is None or ref == "" else ref


def gate_enabled(gates: Sequence[str]) -> bool:
    """Whether ``featureGates`` turns flow control on (``flowControl``, ``flowControl=true``)."""
    enabled = False
    for i, gate in enumerate(gates):
        name, _, value = gate.partition("=")
        if value not in ("", "true", "false"):
            raise ConfigError(f"EndpointPickerConfig.featureGates[{i}]", "'name', 'name=true' or 'name=false'", gate)
        if name == FEATURE_GATE:
            enabled = value != "false"
    return enabled


def read_section(raw: object, path: str, plugins: Mapping[str, Plugin]) -> dict[str, Any]:
    """The ``flowControl:`` section -> ``{"flow_control": FlowControlConfig}``, and its
    ``saturationDetector`` as ``"saturation_detector"`` when the section names one (validated
    whether or not the gate is on: a typo must not wait for the gate to be turned on, and the
    legacy admission reads the detector with the gate off, as llm-d-router's)."""
    section = mapping(raw or {}, path)
    _known(section, ("maxBytes", "maxRequests", "defaultRequestTTL", "noEndpointRequestTTL", "priorityBands",
                     "defaultPriorityBand", "defaultNegativePriorityBand", "saturationDetector",
                     "usageLimitPolicyPluginRef", "enableEviction"), path)
    max_bytes = (quantity(section["maxBytes"], f"{path}.maxBytes") or None) if "maxBytes" in section else None
    max_requests = (quantity(section["maxRequests"], f"{path}.maxRequests") or None
                    if "maxRequests" in section else None)
    ttl = go_duration(section["defaultRequestTTL"], f"{path}.defaultRequestTTL") if (
        "defaultRequestTTL" in section) else DEFAULT_TTL_S
    no_endpoint_ttl = go_duration(section["noEndpointRequestTTL"], f"{path}.noEndpointRequestTTL") if (
        "noEndpointRequestTTL" in section) else ttl
    bands: list[BandConfig] = []
    for i, item in enumerate(sequence(section.get("priorityBands", []), f"{path}.priorityBands")):
        where = f"{path}.priorityBands[{i}]"
        band = _band(mapping(item, where), plugins, where, template=False)
        if any(b.priority == band.priority for b in bands):
            raise ConfigError(f"{where}.priority", "a priority no band listed before", band.priority)
        bands.append(band)
    default = _band(mapping(section.get("defaultPriorityBand") or {}, f"{path}.defaultPriorityBand"),
                    plugins, f"{path}.defaultPriorityBand", template=True)
    negative = None
    if section.get("defaultNegativePriorityBand") is not None:
        negative = _band(mapping(section["defaultNegativePriorityBand"], f"{path}.defaultNegativePriorityBand"),
                         plugins, f"{path}.defaultNegativePriorityBand", template=True)
    detector_ref = UTILIZATION
    if section.get("saturationDetector") is not None:
        where = f"{path}.saturationDetector"
        detector_doc = mapping(section["saturationDetector"], where)
        _known(detector_doc, ("pluginRef",), where)
        detector_ref = string(detector_doc.get("pluginRef", UTILIZATION), f"{where}.pluginRef")
        _ref(detector_ref, plugins, DETECTORS, f"{where}.pluginRef")
    usage_limit = _ref(_or_default(section.get("usageLimitPolicyPluginRef"), STATIC_USAGE_LIMIT), plugins,
                       USAGE_LIMIT_POLICIES, f"{path}.usageLimitPolicyPluginRef").params
    assert isinstance(usage_limit, UsageLimitParams)
    eviction = section.get("enableEviction", False)
    if not isinstance(eviction, bool):
        raise ConfigError(f"{path}.enableEviction", "true or false", eviction)
    detector = _detector(plugins, detector_ref)
    read: dict[str, Any] = {"flow_control": FlowControlConfig(
        max_bytes, max_requests, ttl, no_endpoint_ttl, tuple(bands), default, negative, detector, _programs(plugins),
        usage_limit, eviction)}
    if section.get("saturationDetector") is not None:
        read[_DETECTOR_KEY] = detector
    return read


def _programs(plugins: Mapping[str, Plugin]) -> tuple[tuple[str, ProgramAwareParams], ...]:
    return tuple((p.name, p.params) for p in plugins.values() if isinstance(p.params, ProgramAwareParams))


def _detector(plugins: Mapping[str, Plugin], name: str) -> UtilizationDetector | ConcurrencyDetector:
    plugin = _ref(name, plugins, DETECTORS, "flowControl.saturationDetector.pluginRef")
    params = plugin.params
    assert isinstance(params, UtilizationDetector | ConcurrencyDetector)
    return params


register_section("flowControl", read_section)
register_feature_gate(FEATURE_GATE)


def saturation_detector(epp: EppConfig) -> UtilizationDetector | ConcurrencyDetector | None:
    """The detector behind the legacy admission (the ``flowControl`` gate off): sheddable requests
    are dropped while it reads >= 1.0.

    As llm-d-router: ``flowControl.saturationDetector`` (or the deprecated top-level
    ``saturationDetector.pluginRef``), else the ``utilization-detector`` (declared under that name,
    or built in with its defaults). None for the Gateway API Inference Extension's older top-level
    thresholds (``queueDepthThreshold``, ``kvCacheUtilThreshold``): the scheduler's thresholds, which
    they set, with the pool's ``metricsStalenessThreshold``, as without an EndpointPickerConfig.
    """
    named = epp.extra.get(_DETECTOR_KEY)
    if isinstance(named, UtilizationDetector | ConcurrencyDetector):
        return named
    if "queue_threshold" in epp.scheduler or "kv_cache_threshold" in epp.scheduler:
        return None
    return _detector(epp.plugins, UTILIZATION)


def flow_control_config(epp: EppConfig) -> FlowControlConfig | None:
    """The flow control layer an ``EndpointPickerConfig`` turns on, or None when its gate is off."""
    if not gate_enabled(epp.feature_gates):
        return None
    config = epp.extra.get("flow_control") or read_section({}, f"EndpointPickerConfig.{_SECTION}", epp.plugins)[
        "flow_control"]
    assert isinstance(config, FlowControlConfig)
    return config
