"""Picker configuration: YAML and Kubernetes-style manifests -> frozen dataclasses, validated once.

A config file is a YAML stream. One plain document (no ``kind``) holds ``pool``, ``models``,
``objectives``, ``scheduler`` and ``extProc``; any number of Kubernetes documents
(``InferencePool``, ``InferenceModel``, ``InferenceObjective``) may sit beside it, so a pool
described for a cluster runs here unchanged with a static endpoint list. The reference picker's
``EndpointPickerConfig`` (:mod:`evergreen_trio.picker.epp_config`) may stand in for the ``scheduler``
section. In cluster mode (``pool_name`` given) the endpoints come from the InferencePool's pods, so
the plain document and its ``pool`` section are optional and list no endpoints. Every problem raises
one :class:`ConfigError` naming the field by its path.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from evergreen_trio.picker.affinity import PREFIX_READERS
from evergreen_trio.picker.checks import FLOAT_LIMIT, integer, mapping, number, sequence, string
from evergreen_trio.picker.dataparallel import DataParallelHandler
from evergreen_trio.picker.dcgm import DcgmSource
from evergreen_trio.picker.engine_metrics import ENGINE_ALIASES, ENGINE_METRICS, EngineConfig
from evergreen_trio.picker.epp_config import EppConfig, is_endpoint_picker_config, read_endpoint_picker_config
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.flow_control.config import (
    ConcurrencyDetector,
    FlowControlConfig,
    UtilizationDetector,
    flow_control_config,
    saturation_detector,
)
from evergreen_trio.picker.headerprofile import HeaderProfileHandler
from evergreen_trio.picker.inflight import LoadConfig, producer_config
from evergreen_trio.picker.models_source import ModelsSource
from evergreen_trio.picker.multicluster import PREFIX_SCORER, ClusterPoll
from evergreen_trio.picker.plugins import (
    DisaggHandler,
    Plugin,
    Profile,
    TlsOptions,
    WeightedScorer,
    deferred_deprecations,
)

ENGINES = (*ENGINE_METRICS, *ENGINE_ALIASES)
CRITICALITY_PRIORITY = {"Critical": 1, "Standard": 0, "Sheddable": -1}
SCORER_KEYS = {
    "queue": "queue", "kv-cache": "kv_cache", "prefix-cache": "prefix_cache", "lora-affinity": "lora_affinity",
}
# The in-flight load scorers' weights (LoadConfig fields, evergreen_trio.picker.inflight).
LOAD_SCORER_KEYS = {
    "active-request": "active_request", "token-load": "token_load", "running-requests": "running_requests",
    "load-aware": "load_aware",
}
MAX_CONFIG_BYTES = 4 * 1024 * 1024


class DestinationMode(enum.Enum):
    """How the picked endpoints are told to Envoy.

    SINGLE: one endpoint in the header and ``envoy.lb`` metadata. FALLBACK: the same plus the
    runner-up in ``x-gateway-destination-endpoint-fallback``. LIST: an ordered comma-separated
    list in both the header and the metadata (walked by Envoy's override_host policy on retry).
    """

    SINGLE = "single"
    FALLBACK = "fallback"
    LIST = "list"


@dataclass(frozen=True)
class Endpoint:
    """One model server: ``host:port``, the engine whose metric names it exports, its pod labels,
    and what discovery knows of its pod: its name (a file entry's ``name``), its ``spec.hostname``
    and its node's IP (``status.hostIP``), empty where unknown. Those three are not compared: an
    endpoint is its address, engine and labels."""

    host: str
    port: int
    engine: str = "vllm"
    labels: tuple[tuple[str, str], ...] = ()
    name: str = field(default="", compare=False)
    hostname: str = field(default="", compare=False)
    node_address: str = field(default="", compare=False)

    @cached_property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @cached_property
    def label_map(self) -> Mapping[str, str]:
        """The pod labels as a mapping (what filters read)."""
        return dict(self.labels)


@dataclass(frozen=True)
class TargetModel:
    name: str
    weight: int


@dataclass(frozen=True)
class ModelConfig:
    """A client-facing model name, its priority (negative = sheddable) and weighted targets."""

    name: str
    priority: int = 0
    target_models: tuple[TargetModel, ...] = ()

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


@dataclass(frozen=True)
class PoolConfig:
    """The pool: its name, its model servers, and how often and where their metrics are scraped.

    ``metrics_port`` (a ``metrics-data-source`` port) scrapes that port instead of the serving
    one; ``engines`` says which metric names each pod's engine exports; ``models_sources`` read
    each endpoint's served models (``models-data-source``s wired to a ``models-data-extractor``),
    ``dcgm_sources`` its GPU utilization (``dcgm-data-source``s wired to a ``dcgm-extractor``).
    ``multicluster`` (a listed ``multicluster-metrics-data-source``) makes the endpoints peer
    clusters, polled for their pool aggregates instead of scraped as model servers.
    ``metrics_tls`` (a ``metrics-data-source`` with ``scheme: https``) scrapes over https.
    """

    name: str
    endpoints: tuple[Endpoint, ...]
    refresh_interval_s: float = 0.05
    staleness_threshold_s: float = 2.0
    scrape_timeout_s: float = 1.0
    metrics_path: str = "/metrics"
    metrics_port: int | None = None
    metrics_tls: TlsOptions | None = None
    engines: EngineConfig = field(default_factory=EngineConfig)
    models_sources: tuple[ModelsSource, ...] = ()
    dcgm_sources: tuple[DcgmSource, ...] = ()
    multicluster: ClusterPoll | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """Scorer weights (0 disables a scorer), the prefix-cache and saturation parameters, and the
    scheduling profiles with their handler.

    ``profiles`` empty means one profile of the four flat weights. ``handler`` None runs the one
    profile; a :class:`~evergreen_trio.picker.plugins.DisaggHandler` runs decode and prefill profiles (P/D), a
    :class:`~evergreen_trio.picker.headerprofile.HeaderProfileHandler` the one a request header names, a
    :class:`~evergreen_trio.picker.dataparallel.DataParallelHandler` the one profile, sent to the pods'
    primary port. With
    ``prefix_auto_tune`` the block size is the model servers' scraped one; ``max_prefix_tokens``
    (when > 0) caps the hashed prefix in tokens, else ``max_prefix_blocks`` caps it in blocks.
    """

    queue: float = 2.0
    kv_cache: float = 2.0
    prefix_cache: float = 3.0
    lora_affinity: float = 0.0
    prefix_block_tokens: int = 16
    chars_per_token: int = 4
    prefix_cache_capacity: int = 31_250
    max_prefix_blocks: int = 256
    queue_threshold: float = 5.0
    kv_cache_threshold: float = 0.8
    load: LoadConfig = field(default_factory=LoadConfig)  # in-flight load and the load scorers
    prefix_auto_tune: bool = False
    max_prefix_tokens: int = 0
    profiles: tuple[Profile, ...] = ()
    handler: DisaggHandler | HeaderProfileHandler | DataParallelHandler | None = None
    prefix_readers: bool = False  # a declared plugin outside the profiles reads the prefix matches

    @property
    def prefix_block_bytes(self) -> int:
        return self.prefix_block_tokens * self.chars_per_token

    @cached_property
    def effective_profiles(self) -> tuple[Profile, ...]:
        """``profiles``, or the one profile the flat weights describe."""
        if self.profiles:
            return self.profiles
        weights = {"queue-scorer": self.queue, "kv-cache-utilization-scorer": self.kv_cache,
                   "prefix-cache-scorer": self.prefix_cache, "lora-affinity-scorer": self.lora_affinity,
                   **self.load.weights()}
        scorers = tuple(WeightedScorer(Plugin(kind, kind), w) for kind, w in weights.items() if w)
        return (Profile("default", (), scorers),)

    @cached_property
    def uses_prefix(self) -> bool:
        """Whether a request's prompt must be hashed: a profile scores the prefix or filters or
        scores by its matches, P/D decides on it, or another plugin reads its matches."""
        return self.prefix_readers or isinstance(self.handler, DisaggHandler) or any(
            p.weight("prefix-cache-scorer") or p.weight(PREFIX_SCORER)
            or any(f.type in PREFIX_READERS for f in p.filters)
            or any(s.weight and s.plugin.type in PREFIX_READERS for s in p.scorers)
            for p in self.effective_profiles)


@dataclass(frozen=True)
class ExtProcConfig:
    """Limits and modes of the ext_proc stream handling.

    ``observe_responses`` false ends each ext_proc stream as soon as the request is routed (unless
    the model name must be rewritten back in the response, or a plugin needs the response): Envoy
    then skips the response round trips, and token usage and served-endpoint reports are not collected.

    The reference picker's flags: ``max_receive_message_bytes`` / ``max_send_message_bytes``
    (``--grpc-max-recv-msg-size`` / ``--grpc-max-send-msg-size``; None: a message holds the
    largest body cap plus 64 KiB, and replies are not capped); ``emit_endpoint_scores``
    (``--emit-endpoint-scores``: the primary profile's score of every candidate in
    ``envoy.lb/x-gateway-destination-endpoint-scores``); ``honor_subset_hint`` false
    (``--disable-endpoint-subset-filter``) ignores Envoy's ``envoy.lb.subset_hint``;
    ``stream_metrics`` (``--enable-grpc-stream-metrics``) adds the ``llm_d_epp_extproc_stream*`` metrics.
    """

    destination_mode: DestinationMode = DestinationMode.SINGLE
    observe_responses: bool = True
    max_endpoints_in_list: int = 3
    max_request_body_bytes: int = 16 * 1024 * 1024
    max_response_body_bytes: int = 16 * 1024 * 1024
    streamed_chunk_bytes: int = 62_000
    max_receive_message_bytes: int | None = None
    max_send_message_bytes: int | None = None
    emit_endpoint_scores: bool = False
    honor_subset_hint: bool = True
    stream_metrics: bool = False


@dataclass(frozen=True)
class PickerConfig:
    """Everything the picker needs; ``models`` empty means every model name is accepted."""

    pool: PoolConfig
    models: tuple[ModelConfig, ...] = ()
    objectives: Mapping[str, int] = field(default_factory=dict)
    scheduler: SchedulerConfig = SchedulerConfig()
    ext_proc: ExtProcConfig = ExtProcConfig()
    flow_control: FlowControlConfig | None = None  # featureGates: [flowControl] in an EndpointPickerConfig
    epp: EppConfig | None = None  # the EndpointPickerConfig as read (plugins by name, feature gates, sections)
    # Behind the legacy admission (flow control off); None: the scheduler's thresholds with the pool's staleness.
    saturation_detector: UtilizationDetector | ConcurrencyDetector | None = None

    def model(self, name: str) -> ModelConfig | None:
        """The configured model ``name``, or None when it is not configured."""
        for model in self.models:
            if model.name == name:
                return model
        return None


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


def parse_duration(value: object, path: str) -> float:
    """Seconds > 0 and finite, from a number or a string like ``50ms``, ``2s`` or ``1m``."""
    if isinstance(value, bool):
        raise ConfigError(path, "a duration like '50ms' or '2s'", value)
    if isinstance(value, int | float) and 0 < value < FLOAT_LIMIT:
        return float(value)
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            seconds = float(match.group(1)) * _UNITS[match.group(2)]
            if 0 < seconds < math.inf:
                return seconds
    raise ConfigError(path, "a positive duration like '50ms' or '2s'", value)







def _no_unknown(doc: Mapping[str, Any], allowed: set[str], path: str) -> None:
    for key in doc:
        if key not in allowed:
            where = f"{path}.{key}" if path else key
            raise ConfigError(where, f"one of {sorted(allowed)}", key)


def parse_address(value: object, path: str, *, default_port: int | None = None) -> tuple[str, int]:
    """``ip:port`` (``[v6]:port``) -> (host, port); a bare host takes ``default_port``."""
    text = string(value, path)
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ConfigError(path, "'[ipv6]:port'", value)
        host, port_text = text[1:end], text[end + 1 :].removeprefix(":")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if not port_text:
        if default_port is None:
            raise ConfigError(path, "'host:port'", value)
        port_text = str(default_port)
    if not (port_text.isascii() and port_text.isdigit()) or not 0 < int(port_text) < 65536:
        raise ConfigError(path, "a port in 1..65535", value)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(path, "an IP address (Envoy's ORIGINAL_DST needs ip:port)", value) from None
    return host, int(port_text)


def _criticality(spec: Mapping[str, Any], path: str) -> int:
    if "priority" in spec:
        return integer(spec["priority"], f"{path}.priority")
    if "criticality" in spec:
        value = spec["criticality"]
        if not isinstance(value, str) or value not in CRITICALITY_PRIORITY:  # a list or a map is unhashable
            raise ConfigError(f"{path}.criticality", "Critical, Standard or Sheddable", value)
        return CRITICALITY_PRIORITY[value]
    return 0


def _target_models(value: object, path: str) -> tuple[TargetModel, ...]:
    targets = []
    for i, item in enumerate(sequence(value, path)):
        entry = mapping(item, f"{path}[{i}]")
        _no_unknown(entry, {"name", "weight"}, f"{path}[{i}]")
        name = string(entry.get("name"), f"{path}[{i}].name")
        weight = integer(entry.get("weight", 1), f"{path}[{i}].weight", minimum=0)
        targets.append(TargetModel(name, weight))
    return tuple(targets)


def _model(doc: Mapping[str, Any], path: str, name_key: str) -> ModelConfig:
    name = string(doc.get(name_key), f"{path}.{name_key}")
    targets = _target_models(doc["targetModels"], f"{path}.targetModels") if "targetModels" in doc else ()
    return ModelConfig(name, _criticality(doc, path), targets)


def _labels(value: object, path: str) -> tuple[tuple[str, str], ...]:
    labels = mapping(value, path)
    return tuple(sorted((string(k, path), string(v, f"{path}.{k}")) for k, v in labels.items()))


def _pool(
    doc: Mapping[str, Any], *, name: str | None, default_port: int | None, discovered: bool = False,
    engines: EngineConfig | None = None,
) -> PoolConfig:
    engines = engines or EngineConfig()
    _no_unknown(
        doc,
        {"name", "endpoints", "refreshMetricsInterval", "metricsStalenessThreshold", "scrapeTimeout", "metricsPath"},
        "pool",
    )
    pool_name = name if name is not None else string(doc.get("name", "default"), "pool.name")
    if name is not None and "name" in doc and doc["name"] != name:
        raise ConfigError("pool.name", f"the InferencePool's name {name!r}", doc["name"])
    endpoints: list[Endpoint] = []
    if discovered and "endpoints" in doc:
        raise ConfigError("pool.endpoints", "no static endpoints (--pool-name or dataLayer.discovery lists them)",
                          "a list")
    raw = [] if discovered else sequence(doc.get("endpoints"), "pool.endpoints")
    if not raw and not discovered:
        raise ConfigError("pool.endpoints", "at least one endpoint", raw)
    for i, item in enumerate(raw):
        path = f"pool.endpoints[{i}]"
        entry = {"address": item} if isinstance(item, str) else mapping(item, path)
        _no_unknown(entry, {"address", "engine", "labels"}, path)
        host, port = parse_address(entry.get("address"), f"{path}.address", default_port=default_port)
        labels = _labels(entry.get("labels", {}), f"{path}.labels")
        engine = entry.get("engine", engines.engine_of(dict(labels)))
        if engine not in (*ENGINES, *engines.engines):
            raise ConfigError(f"{path}.engine", " | ".join(dict.fromkeys((*ENGINES, *engines.engines))), engine)
        endpoint = Endpoint(host, port, engine, labels)
        if any(e.address == endpoint.address for e in endpoints):
            raise ConfigError(f"{path}.address", "an address not listed before", endpoint.address)
        endpoints.append(endpoint)
    metrics_path = string(doc.get("metricsPath", "/metrics"), "pool.metricsPath")
    if not metrics_path.startswith("/"):
        raise ConfigError("pool.metricsPath", "a path starting with '/'", metrics_path)
    return PoolConfig(
        pool_name,
        tuple(endpoints),
        parse_duration(doc.get("refreshMetricsInterval", "50ms"), "pool.refreshMetricsInterval"),
        parse_duration(doc.get("metricsStalenessThreshold", "2s"), "pool.metricsStalenessThreshold"),
        parse_duration(doc.get("scrapeTimeout", "1s"), "pool.scrapeTimeout"),
        metrics_path,
        engines=engines,
    )


def _scheduler(doc: Mapping[str, Any]) -> SchedulerConfig:
    _no_unknown(
        doc,
        {"weights", "prefixBlockTokens", "charsPerToken", "prefixCacheCapacity", "maxPrefixBlocks",
         "queueThreshold", "kvCacheThreshold"},
        "scheduler",
    )
    values: dict[str, Any] = {}
    if "weights" in doc:
        weights = mapping(doc["weights"], "scheduler.weights")
        _no_unknown(weights, set(SCORER_KEYS) | set(LOAD_SCORER_KEYS), "scheduler.weights")
        values = {SCORER_KEYS[k]: number(v, f"scheduler.weights.{k}") for k, v in weights.items() if k in SCORER_KEYS}
        load: dict[str, Any] = {LOAD_SCORER_KEYS[k]: number(v, f"scheduler.weights.{k}")
                                for k, v in weights.items() if k in LOAD_SCORER_KEYS}
        values["load"] = LoadConfig(**load)
        if not any(values.get(k, getattr(SchedulerConfig, k)) for k in SCORER_KEYS.values()) and not any(
                getattr(values["load"], k) for k in LOAD_SCORER_KEYS.values()):
            raise ConfigError("scheduler.weights", "at least one weight > 0", dict(weights))
    ints = {"prefixBlockTokens": "prefix_block_tokens", "charsPerToken": "chars_per_token",
            "prefixCacheCapacity": "prefix_cache_capacity", "maxPrefixBlocks": "max_prefix_blocks"}
    for key, attr in ints.items():
        if key in doc:
            values[attr] = integer(doc[key], f"scheduler.{key}", minimum=1)
    for key, attr in {"queueThreshold": "queue_threshold", "kvCacheThreshold": "kv_cache_threshold"}.items():
        if key in doc:
            values[attr] = number(doc[key], f"scheduler.{key}", positive=True)
    return SchedulerConfig(**values)


def _ext_proc(doc: Mapping[str, Any]) -> ExtProcConfig:
    _no_unknown(
        doc,
        {"destinationMode", "maxEndpointsInList", "maxRequestBodyBytes", "maxResponseBodyBytes",
         "streamedChunkBytes", "observeResponses"},
        "extProc",
    )
    values: dict[str, Any] = {}
    if "destinationMode" in doc:
        modes = [m.value for m in DestinationMode]
        if doc["destinationMode"] not in modes:
            raise ConfigError("extProc.destinationMode", " | ".join(modes), doc["destinationMode"])
        values["destination_mode"] = DestinationMode(doc["destinationMode"])
    if "observeResponses" in doc:
        if not isinstance(doc["observeResponses"], bool):
            raise ConfigError("extProc.observeResponses", "true or false", doc["observeResponses"])
        values["observe_responses"] = doc["observeResponses"]
    ints = {"maxEndpointsInList": "max_endpoints_in_list", "maxRequestBodyBytes": "max_request_body_bytes",
            "maxResponseBodyBytes": "max_response_body_bytes", "streamedChunkBytes": "streamed_chunk_bytes"}
    for key, attr in ints.items():
        if key in doc:
            values[attr] = integer(doc[key], f"extProc.{key}", minimum=2 if key == "maxEndpointsInList" else 1)
    if values.get("streamed_chunk_bytes", 0) > 62_000:
        raise ConfigError("extProc.streamedChunkBytes", "at most 62000 (Envoy's limit)", doc["streamedChunkBytes"])
    return ExtProcConfig(**values)


def _manifest_pool_ref(spec: Mapping[str, Any], path: str) -> str | None:
    if "poolRef" not in spec:
        return None
    return string(mapping(spec["poolRef"], f"{path}.poolRef").get("name"), f"{path}.poolRef.name")


def config_from_documents(documents: Sequence[object], *, cluster_pool: str | None = None) -> PickerConfig:
    """Build the config from parsed YAML documents (one plain document plus any manifests).

    ``cluster_pool`` (cluster mode) names the InferencePool whose pods are the endpoints.
    Deprecated spellings are logged once the whole config has loaded.
    """
    with deferred_deprecations():
        return _config_from_documents(documents, cluster_pool)


def _config_from_documents(documents: Sequence[object], cluster_pool: str | None) -> PickerConfig:
    plain: Mapping[str, Any] | None = None
    picker_config: Mapping[str, Any] | None = None
    pool_name: str | None = cluster_pool
    default_port: int | None = None
    models: list[ModelConfig] = []
    objectives: dict[str, int] = {}
    manifest_models: list[tuple[str | None, ModelConfig]] = []
    manifest_objectives: list[tuple[str | None, str, int]] = []
    for index, raw in enumerate(documents):
        if raw is None:
            continue
        doc = mapping(raw, f"document[{index}]")
        if "kind" not in doc:
            if plain is not None:
                raise ConfigError(f"document[{index}]", "one plain config document", "a second one")
            plain = doc
            continue
        if is_endpoint_picker_config(doc):
            if picker_config is not None:
                raise ConfigError(f"document[{index}]", "one EndpointPickerConfig", "a second one")
            picker_config = doc
            continue
        kind, where = doc["kind"], f"{doc['kind']}"
        spec = mapping(doc.get("spec"), f"{where}.spec")
        name = string(mapping(doc.get("metadata"), f"{where}.metadata").get("name"), f"{where}.metadata.name")
        if kind == "InferencePool":
            if cluster_pool is not None:
                continue  # the live pool is watched; a manifest beside the config is documentation
            if pool_name is not None:
                raise ConfigError(f"document[{index}]", "one InferencePool", "a second one")
            pool_name = name
            if "targetPorts" in spec:
                ports = sequence(spec["targetPorts"], "InferencePool.spec.targetPorts")
                first = mapping(ports[0] if ports else None, "InferencePool.spec.targetPorts[0]")
                default_port = integer(first.get("number"), "InferencePool.spec.targetPorts[0].number", minimum=1)
            elif "targetPortNumber" in spec:
                default_port = integer(spec["targetPortNumber"], "InferencePool.spec.targetPortNumber", minimum=1)
        elif kind == "InferenceModel":
            path = f"InferenceModel {name}.spec"
            manifest_models.append((_manifest_pool_ref(spec, path), _model(spec, path, "modelName")))
        elif kind == "InferenceObjective":
            path = f"InferenceObjective {name}.spec"
            manifest_objectives.append((_manifest_pool_ref(spec, path), name, _criticality(spec, path)))
        else:
            expected = "EndpointPickerConfig, InferencePool, InferenceModel or InferenceObjective"
            raise ConfigError(f"document[{index}].kind", expected, kind)
    epp = read_endpoint_picker_config(picker_config) if picker_config is not None else None
    # The InferencePool or a dataLayer.discovery plugin lists the endpoints.
    discovered = cluster_pool is not None or (epp is not None and epp.discovery is not None)
    if discovered and plain is None:
        plain = {}
    if plain is None or ("pool" not in plain and not discovered):
        raise ConfigError("pool", "a 'pool' section with static endpoints", None)
    _no_unknown(plain, {"pool", "models", "objectives", "scheduler", "extProc"}, "")
    pool_values = dict(epp.pool) if epp is not None else {}
    pool = _pool(mapping(plain.get("pool", {}), "pool"), name=pool_name, default_port=default_port,
                 discovered=discovered, engines=pool_values.pop("engines", None))
    pool = dataclasses.replace(pool, **pool_values)
    for i, item in enumerate(sequence(plain.get("models", []), "models")):
        entry = mapping(item, f"models[{i}]")
        _no_unknown(entry, {"name", "criticality", "priority", "targetModels"}, f"models[{i}]")
        models.append(_model(entry, f"models[{i}]", "name"))
    models.extend(model for ref, model in manifest_models if ref in (None, pool.name))
    seen: set[str] = set()
    for i, model in enumerate(models):
        if model.name in seen:
            raise ConfigError(f"models[{i}].name", "a model name not configured before", model.name)
        seen.add(model.name)
    for i, item in enumerate(sequence(plain.get("objectives", []), "objectives")):
        entry = mapping(item, f"objectives[{i}]")
        _no_unknown(entry, {"name", "priority", "criticality"}, f"objectives[{i}]")
        objectives[string(entry.get("name"), f"objectives[{i}].name")] = _criticality(entry, f"objectives[{i}]")
    objectives.update({name: prio for ref, name, prio in manifest_objectives if ref in (None, pool.name)})
    if picker_config is not None and "scheduler" in plain:
        raise ConfigError("scheduler", "either a 'scheduler' section or an EndpointPickerConfig", "both")
    scheduler = (SchedulerConfig(**epp.scheduler, load=producer_config(epp.plugins)) if epp is not None
                 else _scheduler(mapping(plain.get("scheduler", {}), "scheduler")))
    return PickerConfig(
        pool=pool,
        models=tuple(models),
        objectives=objectives,
        scheduler=scheduler,
        ext_proc=_ext_proc(mapping(plain.get("extProc", {}), "extProc")),
        flow_control=flow_control_config(epp) if epp is not None else None,
        epp=epp,
        saturation_detector=saturation_detector(epp) if epp is not None else None,
    )


def parse_documents(text: str) -> list[object]:
    """The YAML documents of a config stream; a syntax error's field is its ``line:column``."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError("file", f"at most {MAX_CONFIG_BYTES} bytes", f"{len(text)} bytes")
    try:
        return list(yaml.safe_load_all(text))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else "file"
        raise ConfigError(where, "valid YAML", exc.problem or str(exc).splitlines()[0]) from None
    except yaml.YAMLError as exc:
        raise ConfigError("file", "valid YAML", str(exc).splitlines()[0]) from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConfigError("file", "valid YAML", type(exc).__name__) from None


def parse_config(text: str, *, cluster_pool: str | None = None) -> PickerConfig:
    """Parse a YAML config stream; every problem is a :class:`ConfigError`."""
    return config_from_documents(parse_documents(text), cluster_pool=cluster_pool)


def _in_file(path: str | Path, error: ConfigError) -> ConfigError:
    """``error`` with its field prefixed by the file: ``FILE:line:column`` or ``FILE: field``."""
    if error.field == "file":
        field = str(path)
    elif error.field[:1].isdigit():
        field = f"{path}:{error.field}"
    else:
        field = f"{path}: {error.field}"
    return ConfigError(field, error.expected, error.got)


def read_documents(path: str | Path) -> list[object]:
    """The YAML documents of a config file; a :class:`ConfigError` names the file (and line:column)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(str(path), "a readable UTF-8 file", reason) from None
    try:
        return parse_documents(text)
    except ConfigError as exc:
        raise _in_file(path, exc) from None


def load_config(path: str | Path, *, cluster_pool: str | None = None) -> PickerConfig:
    """Read and parse a config file; a :class:`ConfigError`'s field starts with the file's name."""
    documents = read_documents(path)
    try:
        return config_from_documents(documents, cluster_pool=cluster_pool)
    except ConfigError as exc:
        raise _in_file(path, exc) from None
