"""The reference Endpoint Picker's ``EndpointPickerConfig`` -> our scheduler and pool settings.

llm-d-router's chart (and GIE v1.5's before it) mounts a plugins file like::

    apiVersion: llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: queue-scorer
    - type: kv-cache-utilization-scorer
    - type: prefix-cache-scorer
    - type: metrics-data-source
      parameters: {scheme: "http", path: "/metrics", insecureSkipVerify: true}
    - type: core-metrics-extractor
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: queue-scorer
        weight: 2
      ...

Each plugin is read by its registered type (:mod:`evergreen_trio.picker.plugins`), strictly: an
unknown parameter, an unknown or unimplemented plugin type, a profile naming an undeclared plugin
is one :class:`ConfigError` naming the field. ``apiVersion`` is ``llm-d.ai/v1alpha1``; the older
``inference.networking.x-k8s.io/v1alpha1`` still loads and logs a deprecation. Profiles keep their
filters, weighted scorers and picker; a ``disagg-profile-handler`` (or its deprecated alias
``pd-profile-handler``) runs the ``decode`` and ``prefill`` profiles (P/D disaggregation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Imported to register their plugin types: request-attribute-reporter, file-discovery, the notification
# sources, token-producer.
from evergreen_trio.picker import attribute_reporter, file_discovery, notifications, token_producer  # noqa: F401
from evergreen_trio.picker.burst_prefix import check_producers
from evergreen_trio.picker.checks import FLOAT_LIMIT, mapping, sequence
from evergreen_trio.picker.dataparallel import DataParallelHandler
from evergreen_trio.picker.dcgm import DCGM_DATA_SOURCE, DCGM_EXTRACTOR, DcgmSource
from evergreen_trio.picker.endpoint_attribute import warn_unpublished
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.headerprofile import HeaderProfileHandler
from evergreen_trio.picker.latency import PRODUCER as LATENCY_PRODUCER
from evergreen_trio.picker.mm_cache import with_default_producer
from evergreen_trio.picker.models_source import MODELS_DATA_EXTRACTOR, MODELS_DATA_SOURCE, ModelsSource
from evergreen_trio.picker.multicluster import (
    CLUSTER_EXTRACTOR,
    CLUSTER_SOURCE,
    ClusterPoll,
    ClusterSource,
    PoolMetrics,
    check_pool_producers,
)
from evergreen_trio.picker.p2p_source import reads_prefix_index
from evergreen_trio.picker.parsers import DEFAULT_REGISTRY
from evergreen_trio.picker.parsers.registry import ParserRegistry
from evergreen_trio.picker.plugins import (
    ALPHA_TYPES,
    PLUGIN_TYPES,
    AlwaysDecider,
    Category,
    Decider,
    DisaggHandler,
    DisaggParams,
    MetricsSourceParams,
    MultimodalDecider,
    PickerParams,
    Plugin,
    PrefixDecider,
    PrefixProducerParams,
    PrefixScorerParams,
    Profile,
    WeightedScorer,
    deprecated,
    read_plugin,
)
from evergreen_trio.picker.syncer import SYNC_INTERVAL, SYNCER_REF, read_syncer
from evergreen_trio.picker.topology import warn_unproduced as warn_no_topology

log = logging.getLogger(__name__)

API_VERSION = "llm-d.ai/v1alpha1"
DEPRECATED_API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
API_VERSIONS = (API_VERSION, DEPRECATED_API_VERSION)
KIND = "EndpointPickerConfig"
# Reference scorer type -> our SchedulerConfig weight field (the flat weights of the first profile).
SCORERS = {
    "queue-scorer": "queue",
    "kv-cache-utilization-scorer": "kv_cache",
    "prefix-cache-scorer": "prefix_cache",
    "lora-affinity-scorer": "lora_affinity",
}
_SATURATION = {"queueDepthThreshold": "queue_threshold", "kvCacheUtilThreshold": "kv_cache_threshold"}
# Top-level sections another module reads: name -> reader(section, path, plugins by name) -> values
# merged into EppConfig.extra. Registered with register_section.
SectionReader = Callable[[object, str, Mapping[str, Plugin]], Mapping[str, Any]]
SECTIONS: dict[str, SectionReader] = {}
_TOP_LEVEL = ("apiVersion", "kind", "plugins", "schedulingProfiles", "saturationDetector", "featureGates", "data",
              "dataLayer", "requestHandler", "parser")


# llm-d-router's feature gates -> whether this picker implements it (register_feature_gate adds).
# haPopulateNonLeaderDatastore: non-leaders keep their endpoint state, which ours always do.
FEATURE_GATES: dict[str, bool] = {"flowControl": False, "haPopulateNonLeaderDatastore": True}


def register_feature_gate(name: str) -> None:
    """Accept ``featureGates: [name]`` (the module that implements the gate calls this)."""
    FEATURE_GATES[name] = True


def register_section(name: str, reader: SectionReader) -> None:
    """Accept the top-level ``name`` section, read by ``reader`` (its values land in ``EppConfig.extra``)."""
    SECTIONS[name] = reader


@dataclass(frozen=True)
class EppConfig:
    """What one ``EndpointPickerConfig`` sets: scheduler fields, pool overrides, the plugins by name,
    and the request parsers (``requestHandler.parsers``, or the default ones)."""

    scheduler: Mapping[str, Any]
    pool: Mapping[str, Any]
    plugins: Mapping[str, Plugin]
    feature_gates: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    parsers: ParserRegistry = DEFAULT_REGISTRY
    discovery: Plugin | None = None  # dataLayer.discovery: it lists the endpoints


def alpha_plugins(epp: EppConfig | None) -> list[Plugin]:
    """The declared plugins of a type llm-d-router registers as Alpha (:data:`ALPHA_TYPES`)."""
    return [plugin for plugin in epp.plugins.values() if plugin.type in ALPHA_TYPES] if epp is not None else []


def is_endpoint_picker_config(doc: Mapping[str, Any]) -> bool:
    return doc.get("kind") == KIND


def _plugins(doc: Mapping[str, Any]) -> dict[str, Plugin]:
    plugins: dict[str, Plugin] = {}
    for i, item in enumerate(sequence(doc.get("plugins") or [], f"{KIND}.plugins")):
        plugin = read_plugin(item, f"{KIND}.plugins[{i}]")
        if plugin.name in plugins:
            raise ConfigError(f"{KIND}.plugins[{i}].name", "a plugin name not declared before", plugin.name)
        plugins[plugin.name] = plugin
    return plugins


def _ref(raw: object, path: str, plugins: Mapping[str, Plugin], *categories: Category) -> Plugin:
    name = raw
    if not isinstance(name, str) or name not in plugins:
        raise ConfigError(path, f"a declared plugin name ({', '.join(plugins)})", name)
    plugin = plugins[name]
    if categories and plugin.category not in categories:
        kinds = " or ".join(c.value for c in categories)
        raise ConfigError(path, f"a {kinds} plugin", f"{name} (a {plugin.category.value})")
    return plugin


def _profile(raw: object, path: str, plugins: Mapping[str, Plugin]) -> Profile:
    entry = mapping(raw, path)
    for key in entry:
        if key not in ("name", "plugins"):
            raise ConfigError(f"{path}.{key}", "one of ['name', 'plugins']", key)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}.name", "a profile name", name)
    filters: list[Plugin] = []
    scorers: list[WeightedScorer] = []
    picker, picks = "max-score-picker", 1
    for i, item in enumerate(sequence(entry.get("plugins") or [], f"{path}.plugins")):
        ref_path = f"{path}.plugins[{i}]"
        ref = mapping(item, ref_path)
        for key in ref:
            if key not in ("pluginRef", "weight"):
                raise ConfigError(f"{ref_path}.{key}", "one of ['pluginRef', 'weight']", key)
        # Producers, pre-request and response plugins listed here do nothing in the profile (as the reference's).
        plugin = _ref(ref.get("pluginRef"), f"{ref_path}.pluginRef", plugins, Category.FILTER, Category.SCORER,
                      Category.PICKER, Category.PRODUCER, Category.PRE_REQUEST, Category.RESPONSE_PROCESSOR)
        weight = ref.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 <= weight < FLOAT_LIMIT:
            raise ConfigError(f"{ref_path}.weight", "a finite number >= 0", weight)
        if plugin.is_filter:
            filters.append(plugin)
        if plugin.category is Category.SCORER:
            scorers.append(WeightedScorer(plugin, float(weight)))
        elif plugin.category is Category.PICKER:
            picker = plugin.type
            picks = plugin.params.max_endpoints if isinstance(plugin.params, PickerParams) else 1
    return Profile(name, tuple(filters), tuple(scorers), picker, picks)


def _default_profile(plugins: Mapping[str, Plugin]) -> Profile:
    """No ``schedulingProfiles``: the reference's default, one profile with every declared plugin."""
    chosen = [p for p in plugins.values() if p.category in (Category.FILTER, Category.SCORER)]
    pickers = [p.type for p in plugins.values() if p.category is Category.PICKER]
    return Profile("default", tuple(p for p in chosen if p.is_filter),
                   tuple(WeightedScorer(p, 1.0) for p in chosen if p.category is Category.SCORER),
                   pickers[-1] if pickers else "max-score-picker")


def _handler(plugins: Mapping[str, Plugin],
             profiles: Mapping[str, Profile]) -> DisaggHandler | HeaderProfileHandler | DataParallelHandler | None:
    handlers = [p for p in plugins.values() if p.category is Category.PROFILE_HANDLER]
    if len(handlers) > 1:
        raise ConfigError(f"{KIND}.plugins", "at most one profile handler", [h.name for h in handlers])
    handler = handlers[0] if handlers else None
    one_profile = handler.params if handler is not None and isinstance(handler.params, DataParallelHandler) else None
    if handler is None or handler.type == "single-profile-handler" or one_profile is not None:
        if len(profiles) > 1:
            kind = handler.type if handler is not None else "single-profile-handler"
            raise ConfigError(f"{KIND}.schedulingProfiles", f"one profile (the {kind})", f"{len(profiles)} profiles")
        return one_profile
    if isinstance(handler.params, HeaderProfileHandler):
        return handler.params  # its profiles are named per request: nothing to check against them here
    assert isinstance(handler.params, DisaggParams)
    params = handler.params
    where = f"{KIND}.plugins[{list(plugins).index(handler.name)}].parameters"
    if params.decode not in profiles:
        raise ConfigError(f"{where}.profiles.decode", f"a scheduling profile name ({', '.join(profiles)})",
                          params.decode)
    decider = _decider(params.prefill_decider, f"{where}.deciders.prefill", plugins)
    if decider is None and params.stage_order == "decode-first":
        log.info("picker.pd_off handler=%s (no deciders.prefill: decode profile only)", handler.name)
    return DisaggHandler(params.stage_order, params.decode, params.prefill, params.encode, decider,
                         params.primary_port, _decider(params.encode_decider, f"{where}.deciders.encode", plugins))


def _decider(name: str, where: str, plugins: Mapping[str, Plugin]) -> Decider | None:
    """The decider plugin ``name`` refers to (None for no name)."""
    if not name:
        return None
    chosen = _ref(name, where, plugins, Category.DECIDER).params
    assert isinstance(chosen, PrefixDecider | AlwaysDecider | MultimodalDecider)
    return chosen


def _prefix_values(plugins: Mapping[str, Plugin]) -> dict[str, Any]:
    producers = [p.params for p in plugins.values() if isinstance(p.params, PrefixProducerParams)]
    legacy = {k: v for p in plugins.values() if isinstance(p.params, PrefixScorerParams) for k, v in p.params.legacy}
    if legacy and not producers:  # a GIE v1.x config: block size in characters, no tuning
        values: dict[str, Any] = dict(legacy)
        if "prefix_block_tokens" in values:
            values["chars_per_token"] = 1
        return values
    producer = producers[0] if producers else PrefixProducerParams()
    return {"prefix_auto_tune": producer.auto_tune, "prefix_block_tokens": producer.block_size_tokens,
            "max_prefix_tokens": producer.max_prefix_tokens, "max_prefix_blocks": producer.max_prefix_blocks,
            "prefix_cache_capacity": producer.lru_capacity_per_server}


def _pool_values(plugins: Mapping[str, Plugin]) -> dict[str, Any]:
    from evergreen_trio.picker.config import parse_duration  # config imports this module

    values: dict[str, Any] = {}
    for name, plugin in plugins.items():
        if isinstance(plugin.params, MetricsSourceParams):
            values["metrics_path"] = plugin.params.path
            values["metrics_port"] = plugin.params.port
            values["metrics_tls"] = plugin.params.tls
            if plugin.params.interval is not None:
                where = f"{KIND}.plugins[{list(plugins).index(name)}].parameters.interval"
                values["refresh_interval_s"] = parse_duration(plugin.params.interval, where)
        elif plugin.type == "core-metrics-extractor":
            values["engines"] = plugin.params
    return values


# Extractor type -> the source type whose data it reads (the reference fails startup on a mismatch).
_EXTRACTS = {"core-metrics-extractor": "metrics-data-source", MODELS_DATA_EXTRACTOR: MODELS_DATA_SOURCE,
             DCGM_EXTRACTOR: DCGM_DATA_SOURCE, CLUSTER_EXTRACTOR: CLUSTER_SOURCE}
# Polled sources -> the pool field listing them: a source is polled when listed with its extractor.
_POLLED = {MODELS_DATA_EXTRACTOR: "models_sources", DCGM_EXTRACTOR: "dcgm_sources"}


def _data_layer(doc: Mapping[str, Any], plugins: Mapping[str, Plugin]) -> tuple[Plugin | None, dict[str, Any]]:
    """Check ``dataLayer``: the plugin ``discovery.pluginRef`` names, if any, and the pool fields
    listing the polled sources (those listed with their extractor: the ones worth polling)."""
    path = f"{KIND}.dataLayer"
    layer = mapping(doc.get("dataLayer") or {}, path)
    known = ("discovery", "sources", SYNCER_REF, SYNC_INTERVAL)
    for key in layer:
        if key not in known:
            raise ConfigError(f"{path}.{key}", f"one of {sorted(known)}", key)
    read_syncer(layer, path, plugins)
    polled_sources: dict[str, list[ModelsSource | DcgmSource]] = {}
    clusters: dict[str, ClusterPoll] = {}  # the multicluster source listed, by its name
    for i, raw in enumerate(sequence(layer.get("sources") or [], f"{path}.sources")):
        source = mapping(raw, f"{path}.sources[{i}]")
        for key in source:
            if key not in ("pluginRef", "extractors"):
                raise ConfigError(f"{path}.sources[{i}].{key}", "one of ['extractors', 'pluginRef']", key)
        polled = _ref(source.get("pluginRef"), f"{path}.sources[{i}].pluginRef", plugins, Category.DATA_SOURCE)
        if isinstance(polled.params, ClusterSource):
            clusters.setdefault(polled.name, ClusterPoll(polled.params))
        for j, extractor in enumerate(sequence(source.get("extractors") or [], f"{path}.sources[{i}].extractors")):
            where = f"{path}.sources[{i}].extractors[{j}]"
            reads = _ref(mapping(extractor, where).get("pluginRef"), f"{where}.pluginRef", plugins, Category.EXTRACTOR)
            if _EXTRACTS.get(reads.type, polled.type) != polled.type:
                raise ConfigError(f"{where}.pluginRef", f"an extractor of {polled.type}'s data",
                                  f"{reads.name} (a {reads.type}, which reads a {_EXTRACTS[reads.type]}'s)")
            if isinstance(reads.params, PoolMetrics):
                clusters[polled.name] = ClusterPoll(clusters[polled.name].source, reads.params)
            listed = polled_sources.setdefault(_POLLED[reads.type], []) if reads.type in _POLLED else None
            if listed is not None and isinstance(polled.params, ModelsSource | DcgmSource) \
                    and polled.params not in listed:
                listed.append(polled.params)
    sources: dict[str, Any] = {key: tuple(listed) for key, listed in polled_sources.items()}
    if len(clusters) > 1:
        raise ConfigError(f"{path}.sources", f"at most one {CLUSTER_SOURCE} (this picker polls one)", list(clusters))
    if clusters:
        sources["multicluster"] = next(iter(clusters.values()))
    if layer.get("discovery") is None:
        return None, sources
    discovery = mapping(layer["discovery"], f"{path}.discovery")
    for key in discovery:
        if key != "pluginRef":
            raise ConfigError(f"{path}.discovery.{key}", "one of ['pluginRef']", key)
    return _ref(discovery.get("pluginRef"), f"{path}.discovery.pluginRef", plugins, Category.DISCOVERY), sources


def _parser(raw: object, path: str, plugins: Mapping[str, Plugin]) -> Plugin:
    entry = mapping(raw, path)
    for key in entry:
        if key != "pluginRef":
            raise ConfigError(f"{path}.{key}", "one of ['pluginRef']", key)
    name = entry.get("pluginRef")
    if isinstance(name, str) and name not in plugins and name in PLUGIN_TYPES:
        # As the reference: a name not declared but naming a plugin type is a plugin of that type.
        plugins = {name: read_plugin({"type": name}, f"{path}.pluginRef")}
    return _ref(name, f"{path}.pluginRef", plugins, Category.PARSER)


def _request_handler(doc: Mapping[str, Any], plugins: Mapping[str, Plugin]) -> ParserRegistry:
    """The parsers ``requestHandler.parsers`` lists (or the deprecated top-level ``parser``, when
    it lists none); the default ones when neither does."""
    path = f"{KIND}.requestHandler"
    section = mapping(doc.get("requestHandler") or {}, path)
    for key in section:
        if key != "parsers":
            raise ConfigError(f"{path}.{key}", "one of ['parsers']", key)
    refs = [(f"{path}.parsers[{i}]", raw) for i, raw in enumerate(sequence(section.get("parsers") or [],
                                                                           f"{path}.parsers"))]
    if doc.get("parser") is not None:
        deprecated(f"{KIND}.parser", "requestHandler.parsers")
        if not refs:
            refs = [(f"{KIND}.parser", doc["parser"])]
    if not refs:
        return DEFAULT_REGISTRY
    return ParserRegistry([_parser(raw, where, plugins) for where, raw in refs])


def read_endpoint_picker_config(doc: Mapping[str, Any]) -> EppConfig:
    """Read one ``EndpointPickerConfig`` document; :class:`ConfigError` for any mistake in it."""
    version = doc.get("apiVersion")
    if version not in API_VERSIONS:
        raise ConfigError(f"{KIND}.apiVersion", " or ".join(API_VERSIONS), version)
    if version == DEPRECATED_API_VERSION:
        deprecated(f"apiVersion={version}", API_VERSION)
    allowed = (*_TOP_LEVEL, *SECTIONS)
    for key in doc:
        if key == "flowControl" and key not in SECTIONS:
            raise ConfigError(f"{KIND}.{key}", "a section this picker implements", "flowControl (not implemented)")
        if key not in allowed:
            raise ConfigError(f"{KIND}.{key}", f"one of {sorted(allowed)}", key)
    plugins = with_default_producer(_plugins(doc), f"{KIND}.plugins")
    raw_profiles = sequence(doc.get("schedulingProfiles") or [], f"{KIND}.schedulingProfiles")
    profiles: dict[str, Profile] = {}
    for i, raw in enumerate(raw_profiles):
        profile = _profile(raw, f"{KIND}.schedulingProfiles[{i}]", plugins)
        if profile.name in profiles:
            raise ConfigError(f"{KIND}.schedulingProfiles[{i}].name", "a profile name not used before", profile.name)
        profiles[profile.name] = profile
    if not profiles:
        profiles["default"] = _default_profile(plugins)
    handler = _handler(plugins, profiles)
    discovery, polled_sources = _data_layer(doc, plugins)
    parsers = _request_handler(doc, plugins)
    first = next(iter(profiles.values()))
    values: dict[str, Any] = {field: first.weight(kind) for kind, field in SCORERS.items()}
    values.update(_prefix_values(plugins), profiles=tuple(profiles.values()), handler=handler)
    if reads_prefix_index(plugins) or any(p.type == LATENCY_PRODUCER for p in plugins.values()):
        values["prefix_readers"] = True
    saturation = mapping(doc.get("saturationDetector") or {}, f"{KIND}.saturationDetector")
    if "pluginRef" in saturation:
        doc = _migrate_detector_ref(doc, saturation)
        saturation = {}
    for key, value in saturation.items():
        path = f"{KIND}.saturationDetector.{key}"
        if key in _SATURATION:
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < FLOAT_LIMIT:
                raise ConfigError(path, "a finite positive number", value)
            values[_SATURATION[key]] = float(value)
        elif key != "metricsStalenessThreshold":  # the pool's, set by --metrics-staleness-threshold
            raise ConfigError(path, f"one of {sorted([*_SATURATION, 'metricsStalenessThreshold', 'pluginRef'])}", key)
    raw_gates = sequence(doc.get("featureGates") or [], f"{KIND}.featureGates")
    for i, gate in enumerate(raw_gates):
        # A gate is "name", "name=true" or "name=false", as llm-d's parser takes them.
        name, _, value = gate.partition("=") if isinstance(gate, str) else ("", "", "")
        if FEATURE_GATES.get(name) and value in ("", "true", "false"):
            continue
        got = f"{gate} (not implemented)" if name in FEATURE_GATES and not FEATURE_GATES[name] else gate
        raise ConfigError(f"{KIND}.featureGates[{i}]", f"a feature gate this picker implements "
                          f"({', '.join(g for g, on in FEATURE_GATES.items() if on)})", got)
    gates = tuple(str(g) for g in raw_gates)
    extra: dict[str, Any] = {}
    for name, reader in SECTIONS.items():
        if name in doc:
            extra.update(reader(doc[name], f"{KIND}.{name}", plugins))
    warn_unpublished(plugins)
    check_producers(plugins, lambda name: f"{KIND}.plugins[{list(plugins).index(name)}].parameters")
    check_pool_producers(plugins, f"{KIND}.plugins")
    warn_no_topology(plugins)
    pool = {**_pool_values(plugins), **polled_sources}
    return EppConfig(values, pool, plugins, gates, extra, parsers, discovery)


def _migrate_detector_ref(doc: Mapping[str, Any], saturation: Mapping[str, Any]) -> Mapping[str, Any]:
    """llm-d-router's deprecated top-level ``saturationDetector: {pluginRef}`` stands for
    ``flowControl.saturationDetector`` unless that is set (its config loader copies it so); the
    thresholds form (``queueDepthThreshold``...) is the Gateway API Inference Extension's older one."""
    if len(saturation) > 1:
        raise ConfigError(f"{KIND}.saturationDetector", "either pluginRef or the thresholds "
                          f"({', '.join(sorted(_SATURATION))}), not both", sorted(saturation))
    flow = mapping(doc.get("flowControl") or {}, f"{KIND}.flowControl")
    if "saturationDetector" in flow:
        return doc
    return {**doc, "flowControl": {**flow, "saturationDetector": {"pluginRef": saturation["pluginRef"]}}}


def scheduler_values(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :class:`SchedulerConfig` from one ``EndpointPickerConfig`` document."""
    return dict(read_endpoint_picker_config(doc).scheduler)
