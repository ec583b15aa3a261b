"""The ``EndpointPickerConfig`` plugin registry: each plugin type we run, its strict parameters.

A plugin entry (``{type, name, parameters}``) is read by its :class:`PluginType`: the parameter
names it knows (any other name is one :class:`ConfigError` naming it, as llm-d-router's strict
decoder fails startup) and a parser turning them into a frozen value. Other modules add types
with :func:`register`; every type llm-d-router registers is one (``tests/picker/test_plugin_registry.py``).

The scheduling shapes built from a config live here too: a :class:`Profile` (filters, weighted
scorers, a picker) and the :class:`DisaggHandler` that runs the ``decode``/``prefill`` profiles.
Everything is plain data and pure functions (no I/O).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from evergreen_trio.picker.checks import FLOAT_LIMIT, mapping, sequence, string
from evergreen_trio.picker.engine_metrics import (
    ENGINE_ALIASES,
    ENGINE_LABEL,
    ENGINE_METRICS,
    EngineConfig,
    EngineSpec,
    MetricSpec,
    parse_spec,
)
from evergreen_trio.picker.errors import ConfigError

log = logging.getLogger(__name__)

ROLE_LABEL = "llm-d.ai/role"
APPROX_PRODUCER = "approx-prefix-cache-producer"
MULTICLUSTER_APPROX_PRODUCER = "multicluster-approx-prefix-cache-producer"  # the same producer, another type name


class Category(enum.Enum):
    """Where a plugin type plugs in."""

    SCORER = "scorer"
    FILTER = "filter"
    PICKER = "picker"
    PROFILE_HANDLER = "profile-handler"
    DECIDER = "decider"
    PRODUCER = "producer"
    DATA_SOURCE = "data-source"
    EXTRACTOR = "extractor"
    DISCOVERY = "discovery"
    PARSER = "parser"
    ADMITTER = "admitter"
    RESPONSE_PROCESSOR = "response-processor"
    PRE_REQUEST = "pre-request"
    SYNCER = "cross-replica-syncer"
    OTHER = "other"


class Params:
    """One plugin's ``parameters`` mapping, checked against the names its type knows.

    The typed getters return the default when a key is absent and raise :class:`ConfigError`
    naming ``<path>.<key>`` when a value is wrong.
    """

    def __init__(self, raw: object, path: str, plugin_type: str, known: Sequence[str]) -> None:
        self.path = path
        self.raw: Mapping[str, Any] = mapping(raw if raw is not None else {}, path)
        for key in self.raw:
            if key not in known:
                names = ", ".join(sorted(known)) or "none"
                raise ConfigError(f"{path}.{key}", f"a {plugin_type} parameter ({names})", key)

    def where(self, key: str) -> str:
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        return key in self.raw

    def integer(self, key: str, default: int, *, minimum: int = 0, maximum: int | None = None) -> int:
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
                maximum is not None and value > maximum):
            bound = f"an integer in {minimum}..{maximum}" if maximum is not None else f"an integer >= {minimum}"
            raise ConfigError(self.where(key), bound, value)
        return value

    def number(self, key: str, default: float, *, minimum: float = 0.0, maximum: float | None = None) -> float:
        """A number in ``minimum..maximum`` that float64 holds (:data:`~evergreen_trio.picker.checks.FLOAT_LIMIT`:
        never NaN or an infinity)."""
        value = self.raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not -FLOAT_LIMIT < value < FLOAT_LIMIT or (
                value < minimum or (maximum is not None and value > maximum)):
            low = f" >= {minimum}" if math.isfinite(minimum) else ""
            bound = f" in {minimum}..{maximum}" if maximum is not None and low else (
                f" <= {maximum}" if maximum is not None else low)
            raise ConfigError(self.where(key), f"a finite number{bound}", value)
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(self.where(key), "true or false", value)
        return value

    def text(self, key: str, default: str, *, choices: Sequence[str] = ()) -> str:
        value = self.raw.get(key, default)
        if not isinstance(value, str) or (choices and value not in choices):
            raise ConfigError(self.where(key), " | ".join(choices) if choices else "a string", value)
        return value

    def section(self, key: str, known: Sequence[str]) -> Params:
        """A nested mapping parameter, checked the same way."""
        return Params(self.raw.get(key), self.where(key), key, known)


_DEFERRED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("deferred_deprecations", default=None)


def deprecated(what: str, replacement: str) -> None:
    """Log one deprecation line (the config still loads); inside :func:`deferred_deprecations`,
    only once the whole config has loaded."""
    message = f"{what} (use {replacement})"
    pending = _DEFERRED.get()
    if pending is None:
        log.warning("picker.config_deprecated %s", message)
    elif message not in pending:
        pending.append(message)


@contextlib.contextmanager
def deferred_deprecations() -> Iterator[None]:
    """Hold deprecation lines until the block ends without an error (a config that fails to load
    is then one error line, not warnings about a config that is not used)."""
    pending: list[str] = []
    token = _DEFERRED.set(pending)
    try:
        yield
    finally:
        _DEFERRED.reset(token)
    for message in pending:
        log.warning("picker.config_deprecated %s", message)


@dataclass(frozen=True)
class PluginType:
    """How to read one plugin type: its category, parameter names and parser.

    ``parse`` gets the checked :class:`Params` and returns the plugin's frozen parameters.
    ``replaced_by`` marks a deprecated alias (its use logs a line). ``also_filter`` marks a scorer
    that filters too: a profile listing it runs it among its filters as well (the reference adds
    a plugin to every profile role it implements).
    """

    category: Category
    parameters: tuple[str, ...] = ()
    parse: Callable[[Params], object] = lambda params: None
    replaced_by: str | None = None
    also_filter: bool = False


@dataclass(frozen=True)
class Plugin:
    """One declared plugin: its name, its type and its parsed parameters."""

    name: str
    type: str
    params: object = None

    @property
    def category(self) -> Category:
        return PLUGIN_TYPES[self.type].category

    @property
    def is_filter(self) -> bool:
        """Whether a profile runs it among its filters: a filter, or a scorer that filters too."""
        kind = PLUGIN_TYPES[self.type]
        return kind.category is Category.FILTER or kind.also_filter


PLUGIN_TYPES: dict[str, PluginType] = {}


def register(type_name: str, plugin_type: PluginType) -> None:
    """Make ``type_name`` a plugin type configs may declare (a second registration replaces it)."""
    PLUGIN_TYPES[type_name] = plugin_type


def read_plugin(raw: object, path: str) -> Plugin:
    """One ``plugins[]`` entry -> :class:`Plugin`; ConfigError for an unknown type."""
    entry = mapping(raw, path)
    for key in entry:
        if key not in ("type", "name", "parameters"):
            raise ConfigError(f"{path}.{key}", "one of ['name', 'parameters', 'type']", key)
    kind = entry.get("type")
    if not isinstance(kind, str) or kind not in PLUGIN_TYPES:
        raise ConfigError(f"{path}.type", f"a known plugin type ({', '.join(sorted(PLUGIN_TYPES))})", kind)
    name = entry.get("name", kind)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name", "a non-empty plugin name", name)
    plugin_type = PLUGIN_TYPES[kind]
    if plugin_type.replaced_by is not None:
        deprecated(f"plugin type {kind!r}", repr(plugin_type.replaced_by))
    params = Params(entry.get("parameters"), f"{path}.parameters", kind, plugin_type.parameters)
    return Plugin(name, kind, plugin_type.parse(params))


# -- filters ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LabelFilter:
    """Keeps pods whose ``label`` has one of ``values`` (and unlabelled ones when ``allow_missing``)."""

    label: str
    values: frozenset[str]
    allow_missing: bool = False

    def keeps(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.label)
        return (value is None and self.allow_missing) or value in self.values


# llm-d-router's role filters (filter/bylabel/roles.go): decode keeps unlabelled pods.
DECODE_FILTER = LabelFilter(ROLE_LABEL, frozenset({"decode", "prefill-decode", "both", "encode-prefill-decode"}), True)
PREFILL_FILTER = LabelFilter(
    ROLE_LABEL, frozenset({"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"}))
ENCODE_FILTER = LabelFilter(ROLE_LABEL, frozenset({"encode", "encode-prefill", "encode-prefill-decode"}))

_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


@dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes ``LabelSelector``: ``matchLabels`` and ``matchExpressions``, all must hold."""

    match_labels: tuple[tuple[str, str], ...] = ()
    expressions: tuple[tuple[str, str, frozenset[str]], ...] = ()

    def keeps(self, labels: Mapping[str, str]) -> bool:
        if any(labels.get(key) != value for key, value in self.match_labels):
            return False
        for key, operator, values in self.expressions:
            present = key in labels
            if operator == "In" and not (present and labels[key] in values):
                return False
            if operator == "NotIn" and present and labels[key] in values:
                return False
            if (operator == "Exists") != present and operator in ("Exists", "DoesNotExist"):
                return False
        return True


def _label_selector(params: Params) -> LabelSelector:
    labels = mapping(params.raw.get("matchLabels", {}), params.where("matchLabels"))
    pairs = tuple(sorted((string(k, params.where("matchLabels")), string(v, params.where(f"matchLabels.{k}")))
                         for k, v in labels.items()))
    expressions = []
    for i, raw in enumerate(sequence(params.raw.get("matchExpressions", []), params.where("matchExpressions"))):
        term = Params(raw, params.where(f"matchExpressions[{i}]"), "matchExpressions", ("key", "operator", "values"))
        key = term.text("key", "")
        operator = term.text("operator", "", choices=_OPERATORS)
        values = sequence(term.raw.get("values", []), term.where("values"))
        if not key or (operator in ("In", "NotIn")) != bool(values):
            raise ConfigError(term.path, "a key, and values exactly for In/NotIn", dict(term.raw))
        expressions.append((key, operator, frozenset(string(v, term.where("values")) for v in values)))
    return LabelSelector(pairs, tuple(expressions))


def _by_label(params: Params) -> LabelFilter:
    label = params.text("label", "")
    values = frozenset(string(v, params.where("validValues"))
                       for v in sequence(params.raw.get("validValues", []), params.where("validValues")))
    allow = params.boolean("allowsNoLabel", False)
    if not label or not (values or allow):
        raise ConfigError(params.path, "a label, and validValues or allowsNoLabel: true", dict(params.raw))
    return LabelFilter(label, values, allow)


# -- scorers, pickers, producers ------------------------------------------------------------------


def prefix_producer_name(params: Params) -> None:
    """Check ``prefixMatchInfoProducerName``: empty (the default producer) or the one producer we run."""
    name = params.text("prefixMatchInfoProducerName", "")
    if name not in ("", APPROX_PRODUCER):
        raise ConfigError(params.where("prefixMatchInfoProducerName"), f"{APPROX_PRODUCER} (the one we run)", name)


@dataclass(frozen=True)
class PrefixScorerParams:
    """``prefix-cache-scorer``: score = w * min(1, matched tokens / scale)^2 + (1 - w) * match ratio.

    ``producer`` names the producer whose matches it reads: "" for the approximate prefix cache,
    else a declared ``burst-prefix-cache-producer`` (:mod:`evergreen_trio.picker.burst_prefix`)."""

    match_length_weight: float = 0.0
    match_length_scale_tokens: int = 8192
    producer: str = ""
    # GIE v1.x parameters (the scorer then also held the index): SchedulerConfig field -> value.
    legacy: tuple[tuple[str, int], ...] = ()

    def score(self, matched_tokens: float, ratio: float) -> float:
        """The score of a candidate caching ``matched_tokens`` leading tokens, ``ratio`` of the prompt's blocks."""
        weight = self.match_length_weight
        length = min(1.0, matched_tokens / self.match_length_scale_tokens) ** 2 if weight else 0.0
        return weight * length + (1.0 - weight) * ratio


def _prefix_scorer(params: Params) -> PrefixScorerParams:
    weight = params.number("matchLengthWeight", 0.0, maximum=1.0)
    scale = params.integer("matchLengthScaleTokens", 8192, minimum=0)
    if weight > 0 and scale <= 0:
        raise ConfigError(params.where("matchLengthScaleTokens"), "> 0 when matchLengthWeight > 0", scale)
    producer = params.text("prefixMatchInfoProducerName", "")  # epp_config checks it names a declared producer
    legacy = []
    for key, field in (("hashBlockSize", "prefix_block_tokens"), ("maxPrefixBlocksToMatch", "max_prefix_blocks"),
                       ("lruCapacityPerServer", "prefix_cache_capacity")):
        if params.has(key):
            deprecated(f"{params.where(key)}", "approx-prefix-cache-producer's parameters")
            legacy.append((field, params.integer(key, 1, minimum=1)))
    approx = producer in (APPROX_PRODUCER, MULTICLUSTER_APPROX_PRODUCER)
    return PrefixScorerParams(weight, scale, producer="" if approx else producer,
                              legacy=tuple(legacy))


MIN_BLOCK_TOKENS = 64
"""The smallest block the approximate producer hashes (its ``minBlockSizeTokens``): smaller
configured or scraped sizes are raised to it, so the index holds few entries per prompt."""


@dataclass(frozen=True)
class PrefixProducerParams:
    """``approx-prefix-cache-producer``: the block size (scraped when ``auto_tune``), match and LRU caps."""

    auto_tune: bool = True
    block_size_tokens: int = 16
    max_prefix_tokens: int = 131_072
    max_prefix_blocks: int = 2048
    lru_capacity_per_server: int = 31_250


def _prefix_producer(params: Params) -> PrefixProducerParams:
    auto_tune = params.boolean("autoTune", True)
    block = params.integer("blockSizeTokens", 16, minimum=0)
    if params.has("blockSize"):
        deprecated(params.where("blockSize"), "blockSizeTokens")
        block = params.integer("blockSize", 16, minimum=1) if not params.has("blockSizeTokens") else block
    if block <= 0 and not auto_tune:
        raise ConfigError(params.where("blockSizeTokens"), "> 0 when autoTune is false", block)
    if params.has("maxPrefixBlocksToMatch"):
        deprecated(params.where("maxPrefixBlocksToMatch"), "maxPrefixTokensToMatch")
    if 0 < block < MIN_BLOCK_TOKENS:  # raised at request time, as the reference's GetBlockSize does
        log.warning("picker.prefix_block_raised %s=%d minimum=%d (llm-d-router#1158)",
                    params.where("blockSizeTokens"), block, MIN_BLOCK_TOKENS)
    return PrefixProducerParams(
        auto_tune, block or 16, params.integer("maxPrefixTokensToMatch", 131_072, minimum=0),
        params.integer("maxPrefixBlocksToMatch", 2048), params.integer("lruCapacityPerServer", 31_250, minimum=1))


@dataclass(frozen=True)
class PickerParams:
    """A picker's ``maxNumOfEndpoints`` (1 by default; the count returned follows ``extProc.destinationMode``)."""

    max_endpoints: int = 1


def picker_params(params: Params) -> PickerParams:
    return PickerParams(params.integer("maxNumOfEndpoints", 1, minimum=1))


# -- P/D: deciders and the disaggregation profile handler ---------------------------------------


@dataclass(frozen=True)
class PrefixDecider:
    """``prefix-based-pd-decider``: disaggregate when the prompt's tokens not cached on the chosen
    decode pod reach ``non_cached_tokens`` (0 = never), for prompts of ``prompt_tokens`` or more."""

    non_cached_tokens: int = 0
    prompt_tokens: int = 0

    def disaggregate(self, prompt_tokens: int, cached_tokens: int, multimodal: bool = False) -> bool:
        if self.non_cached_tokens == 0 or prompt_tokens < self.prompt_tokens:
            return False
        return prompt_tokens >= self.non_cached_tokens and prompt_tokens - cached_tokens >= self.non_cached_tokens


@dataclass(frozen=True)
class AlwaysDecider:
    """``always-disagg-pd-decider``: every request runs the prefill profile too."""

    def disaggregate(self, prompt_tokens: int, cached_tokens: int, multimodal: bool = False) -> bool:
        return True


@dataclass(frozen=True)
class MultimodalDecider:
    """``always-disagg-multimodal-decider``: disaggregate (the encode stage, as a rule) exactly
    when the token producer found a multimodal item in the prompt."""

    def disaggregate(self, prompt_tokens: int, cached_tokens: int, multimodal: bool = False) -> bool:
        return multimodal


Decider = PrefixDecider | AlwaysDecider | MultimodalDecider


def _prefix_decider(params: Params) -> PrefixDecider:
    decider = PrefixDecider(params.integer("nonCachedTokens", 0), params.integer("promptTokens", 0))
    if decider.non_cached_tokens == 0:
        log.info("picker.pd_decider_off plugin=prefix-based-pd-decider (nonCachedTokens=0)")
    return decider


STAGE_ORDERS = ("decode-first", "prefill-first")


@dataclass(frozen=True)
class DisaggParams:
    """The handler's parameters as written: profile names and decider plugin *names*."""

    stage_order: str = "decode-first"
    decode: str = "decode"
    prefill: str = "prefill"
    encode: str = "encode"
    prefill_decider: str = ""
    encode_decider: str = ""
    primary_port: int = 0


@dataclass(frozen=True)
class DisaggHandler:
    """``disagg-profile-handler`` resolved: profile names and the prefill and encode deciders.

    No prefill decider means no P/D (with decode-first order); no encode decider, no E/PD. A
    ``primary_port`` (``pd-profile-handler``'s ``primaryPort``; 0: none) sends the request to the
    decode pod's primary port, data-parallel style.
    """

    stage_order: str = "decode-first"
    decode: str = "decode"
    prefill: str = "prefill"
    encode: str = "encode"
    prefill_decider: Decider | None = None
    primary_port: int = 0
    encode_decider: Decider | None = None


def _stage_order(value: str, where: str) -> str:
    folded = value.lower().replace("-", "").replace("_", "")
    if folded in ("", "decodefirst", "decode"):
        return "decode-first"
    if folded in ("prefillfirst", "prefill"):
        return "prefill-first"
    raise ConfigError(where, " | ".join(STAGE_ORDERS), value)


_DISAGG_LEGACY = {"decodeProfile": "profiles.decode", "prefillProfile": "profiles.prefill",
                  "encodeProfile": "profiles.encode", "prefillDeciderPluginName": "deciders.prefill",
                  "deciderPluginName": "deciders.prefill", "encodeDeciderPluginName": "deciders.encode"}


def _disagg(params: Params) -> DisaggParams:
    order = _stage_order(params.text("stageOrder", ""), params.where("stageOrder"))
    legacy = [key for key in _DISAGG_LEGACY if params.has(key)]
    nested = [key for key in ("profiles", "deciders") if params.has(key)]
    if legacy and nested:
        raise ConfigError(params.where(legacy[0]), "either nested profiles/deciders or the deprecated flat fields",
                          "both")
    for key in legacy:
        deprecated(params.where(key), _DISAGG_LEGACY[key])
    profiles = params.section("profiles", ("decode", "prefill", "encode"))
    deciders = params.section("deciders", ("prefill", "encode"))
    prefill_decider = deciders.text("prefill", params.text(
        "prefillDeciderPluginName", params.text("deciderPluginName", "")))
    result = DisaggParams(
        order,
        profiles.text("decode", params.text("decodeProfile", "")) or "decode",
        profiles.text("prefill", params.text("prefillProfile", "")) or "prefill",
        profiles.text("encode", params.text("encodeProfile", "")) or "encode",
        prefill_decider,
        deciders.text("encode", params.text("encodeDeciderPluginName", "")),
    )
    if order == "prefill-first" and result.prefill_decider:
        raise ConfigError(deciders.where("prefill"), "no prefill decider with stageOrder prefill-first",
                          result.prefill_decider)
    return result


def _pd_handler(params: Params) -> DisaggParams:
    primary_port = params.integer("primaryPort", 0, maximum=65535)
    if primary_port:
        deprecated(params.where("primaryPort"), "none: Istio >= 1.28.1 needs no primaryPort")
    for key in ("prefixPluginType", "prefixPluginName", "prefixMatchInfoProducerName"):
        params.text(key, "")
    return DisaggParams(decode=params.text("decodeProfile", "decode") or "decode",
                        prefill=params.text("prefillProfile", "prefill") or "prefill",
                        prefill_decider=params.text("deciderPluginName", "prefix-based-pd-decider"),
                        primary_port=primary_port)


# -- data layer ---------------------------------------------------------------------------------


TlsOptions = tuple[bool, str, str, str]
"""An https data source's client TLS: skip verification, CA file, client certificate and key files
(the arguments of :func:`evergreen_trio.picker.tls.client_context`)."""


@dataclass(frozen=True)
class MetricsSourceParams:
    """``metrics-data-source``: where the model servers' metrics are scraped (``tls``: over https)."""

    path: str = "/metrics"
    port: int | None = None
    interval: str | None = None
    tls: TlsOptions | None = None


def tls_parameters(params: Params, skip_verify: bool) -> TlsOptions:
    """A source's ``insecureSkipVerify`` (``skip_verify`` by default), ``caCertPath``,
    ``clientCertPath`` and ``clientKeyPath``."""
    return (params.boolean("insecureSkipVerify", skip_verify), params.text("caCertPath", ""),
            params.text("clientCertPath", ""), params.text("clientKeyPath", ""))


def https_options(params: Params, skip_verify: bool) -> TlsOptions:
    """:func:`tls_parameters` of an https source; certificate files that do not load fail the
    config, as the reference's factory reads them."""
    from evergreen_trio.picker.tls import TlsError, client_context  # the `picker` extra

    options = tls_parameters(params, skip_verify)
    try:
        client_context(*options)
    except TlsError as exc:  # its message names the file
        raise ConfigError(params.path, "readable PEM files at caCertPath, clientCertPath, clientKeyPath",
                          str(exc)) from None
    return options


def http_source(params: Params, default_path: str, what: str) -> tuple[str, TlsOptions | None]:
    """A data source's ``scheme`` (http or https) and ``path`` (starting with '/'); over https its
    :func:`https_options` (the reference's default: the server's certificate not verified), over
    http None, with the certificate paths refused. ``what`` names the traffic in errors."""
    if params.text("scheme", "http", choices=("http", "https")) == "https":
        tls: TlsOptions | None = https_options(params, True)
    else:
        tls = None
        params.boolean("insecureSkipVerify", True)
        for key in ("caCertPath", "clientCertPath", "clientKeyPath"):
            if params.text(key, ""):
                raise ConfigError(params.where(key), f"empty ({what} over http)", params.raw[key])
    path = params.text("path", default_path)
    if not path.startswith("/"):
        raise ConfigError(params.where("path"), "a path starting with '/'", path)
    return path, tls


def _metrics_source(params: Params) -> MetricsSourceParams:
    path, tls = http_source(params, "/metrics", "metrics are scraped")
    port = params.integer("port", 1, minimum=1, maximum=65535) if params.has("port") else None
    interval = params.text("interval", "") or None
    return MetricsSourceParams(path, port, interval, tls)


_ENGINE_KEYS = ("name", "queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec", "cacheInfoSpec",
                "cacheBlockSizeLabelName", "cacheNumBlocksLabelName", "cacheBlockSizeSpec", "cacheNumBlocksSpec",
                "customMetrics")


def _engine(params: Params) -> EngineSpec:
    name = params.text("name", "")
    if not name or name == "default":
        raise ConfigError(params.where("name"), "an engine name (not 'default', which is reserved)", name)
    spec = partial(_metric_spec, params)
    kv = spec("kvUsageSpec")
    return EngineSpec(name, spec("queuedRequestsSpec"), spec("runningRequestsSpec"), (kv,) if kv else (),
                      spec("loraSpec"), spec("cacheInfoSpec"), params.text("cacheBlockSizeLabelName", "block_size"),
                      params.text("cacheNumBlocksLabelName", "num_gpu_blocks"), spec("cacheBlockSizeSpec"),
                      spec("cacheNumBlocksSpec"), _custom_metrics(params))


def _metric_spec(params: Params, key: str) -> MetricSpec | None:
    """The metric spec at ``key`` (None when empty or absent)."""
    text = params.text(key, "")
    try:
        return parse_spec(text) if text else None
    except ValueError as exc:
        raise ConfigError(params.where(key), "a metric spec like 'name' or 'name{label=value}'", text) from exc


def _custom_metrics(params: Params) -> tuple[tuple[str, MetricSpec], ...]:
    """An engine's ``customMetrics``: (attributeKey, metricSpec) pairs, each key once, both required."""
    listed = params.raw.get("customMetrics")
    custom: dict[str, MetricSpec] = {}
    for i, raw in enumerate(sequence([] if listed is None else listed, params.where("customMetrics"))):
        entry = Params(raw, params.where(f"customMetrics[{i}]"), "customMetrics", ("attributeKey", "metricSpec"))
        key = entry.text("attributeKey", "")
        if not key or key in custom:
            raise ConfigError(entry.where("attributeKey"), "an attribute key, not empty and not used before", key)
        metric = _metric_spec(entry, "metricSpec")
        if metric is None:
            raise ConfigError(entry.where("metricSpec"), "a metric spec (required)", entry.raw.get("metricSpec"))
        custom[key] = metric
    return tuple(custom.items())


def _core_extractor(params: Params) -> EngineConfig:
    engines = dict(ENGINE_METRICS)
    for i, raw in enumerate(sequence(params.raw.get("engineConfigs", []), params.where("engineConfigs"))):
        engine = _engine(Params(raw, params.where(f"engineConfigs[{i}]"), "engineConfigs", _ENGINE_KEYS))
        engines[engine.name] = engine
    default = params.text("defaultEngine", "") or "vllm"
    if ENGINE_ALIASES.get(default, default) not in engines:
        raise ConfigError(params.where("defaultEngine"), f"a known engine ({', '.join(engines)})", default)
    return EngineConfig(params.text("engineLabelKey", "") or ENGINE_LABEL, default, engines)


register("queue-scorer", PluginType(Category.SCORER))
register("kv-cache-utilization-scorer", PluginType(Category.SCORER))
register("lora-affinity-scorer", PluginType(Category.SCORER))
register("prefix-cache-scorer", PluginType(
    Category.SCORER, ("matchLengthWeight", "matchLengthScaleTokens", "prefixMatchInfoProducerName",
                      "hashBlockSize", "maxPrefixBlocksToMatch", "lruCapacityPerServer"), _prefix_scorer))
register("approx-prefix-cache-producer", PluginType(
    Category.PRODUCER, ("autoTune", "blockSizeTokens", "blockSize", "maxPrefixBlocksToMatch", "maxPrefixTokensToMatch",
                        "lruCapacityPerServer"), _prefix_producer))
register("max-score-picker", PluginType(Category.PICKER, ("maxNumOfEndpoints",), picker_params))
register("random-picker", PluginType(Category.PICKER, ("maxNumOfEndpoints",), picker_params))
register("single-profile-handler", PluginType(Category.PROFILE_HANDLER))
register("disagg-profile-handler", PluginType(
    Category.PROFILE_HANDLER, ("stageOrder", "profiles", "deciders", *_DISAGG_LEGACY), _disagg))
register("pd-profile-handler", PluginType(
    Category.PROFILE_HANDLER, ("decodeProfile", "prefillProfile", "prefixPluginType", "prefixPluginName", "primaryPort",
                               "deciderPluginName", "prefixMatchInfoProducerName"), _pd_handler,
    replaced_by="disagg-profile-handler"))
register("prefix-based-pd-decider", PluginType(Category.DECIDER, ("nonCachedTokens", "promptTokens"), _prefix_decider))
register("always-disagg-pd-decider", PluginType(Category.DECIDER, (), lambda params: AlwaysDecider()))
register("always-disagg-multimodal-decider", PluginType(Category.DECIDER, (), lambda params: MultimodalDecider()))
register("decode-filter", PluginType(Category.FILTER, (), lambda params: DECODE_FILTER))
register("prefill-filter", PluginType(Category.FILTER, (), lambda params: PREFILL_FILTER))
register("encode-filter", PluginType(Category.FILTER, (), lambda params: ENCODE_FILTER))
register("label-selector-filter", PluginType(Category.FILTER, ("matchLabels", "matchExpressions"), _label_selector))
register("by-label-selector", PluginType(Category.FILTER, ("matchLabels", "matchExpressions"), _label_selector,
                                         replaced_by="label-selector-filter"))
register("by-label", PluginType(Category.FILTER, ("label", "validValues", "allowsNoLabel"), _by_label,
                                replaced_by="label-selector-filter"))
register("metrics-data-source", PluginType(
    Category.DATA_SOURCE, ("scheme", "path", "port", "insecureSkipVerify", "caCertPath", "clientCertPath",
                           "clientKeyPath", "interval"), _metrics_source))
register("core-metrics-extractor", PluginType(
    Category.EXTRACTOR, ("engineLabelKey", "defaultEngine", "engineConfigs"), _core_extractor))

# llm-d-router's Alpha plugin types (cmd/epp/runner/runner.go registers each type with its stability):
# the reference refuses a config declaring one unless it runs with --allow-experimental-plugins.
ALPHA_TYPES = frozenset({
    "agent-identity", "burst-prefix-cache-producer", "dcgm-data-source", "dcgm-extractor",
    "disaggregatedset-rollout-screener", "endpoint-attribute-filter", "endpoint-attribute-scorer",
    "header-label-affinity-scorer", "header-profile-handler", "multicluster-approx-prefix-cache-producer",
    "multicluster-file-discovery", "multicluster-kv-cache-utilization-scorer", "multicluster-metrics-data-source",
    "multicluster-metrics-extractor", "multicluster-prefix-cache-scorer", "multicluster-queue-scorer",
    "multicluster-session-affinity-filter", "p2p-source-producer", "priority-holdback-policy",
    "priority-then-time-eviction-order-policy", "session-affinity-filter", "session-affinity-scorer",
    "sheddable-eviction-filter", "soft-reflective-ceiling-policy", "topology-affinity-filter",
    "topology-affinity-scorer", "topology-extractor", "utilization-filter",
})


# -- scheduling profiles ------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightedScorer:
    """A scorer in a profile with its weight."""

    plugin: Plugin
    weight: float


@dataclass(frozen=True)
class Profile:
    """One scheduling profile: filters in order, weighted scorers, its picker's type
    (``max-score-picker`` by default) and that picker's ``maxNumOfEndpoints`` (what the encode
    stage picks; the primary profile's count follows ``extProc.destinationMode``)."""

    name: str
    filters: tuple[Plugin, ...] = ()
    scorers: tuple[WeightedScorer, ...] = ()
    picker: str = "max-score-picker"
    picks: int = 1

    def weight(self, scorer_type: str) -> float:
        """The summed weight of this profile's scorers of ``scorer_type``."""
        return sum(s.weight for s in self.scorers if s.plugin.type == scorer_type)
