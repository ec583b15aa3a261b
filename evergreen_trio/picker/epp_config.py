"""The reference Endpoint Picker's ``EndpointPickerConfig`` -> our :class:`SchedulerConfig`.

The official ``inferencepool`` Helm chart mounts a plugins file like::

    apiVersion: inference.networking.x-k8s.io/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: queue-scorer
    - type: kv-cache-utilization-scorer
    - type: prefix-cache-scorer
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: queue-scorer
        weight: 2
      ...

Our scheduler is one weighted sum of four scorers followed by a max-score pick, which is exactly
what one profile of these plugins describes: each scorer's profile weight becomes our weight (a
scorer the profile leaves out gets 0), the picker and the profile handler name the only behaviour
we have. An unknown plugin type is one :class:`ConfigError` naming it and listing the known ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from evergreen_trio.picker import inflight
from evergreen_trio.picker.checks import integer, mapping, sequence
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.flow_control import config as flow_control

API_VERSIONS = ("inference.networking.x-k8s.io/v1alpha1",)
KIND = "EndpointPickerConfig"
# Reference plugin type -> our SchedulerConfig weight field (None: accepted, no weight).
SCORERS = {
    "queue-scorer": "queue",
    "kv-cache-utilization-scorer": "kv_cache",
    "prefix-cache-scorer": "prefix_cache",
    "lora-affinity-scorer": "lora_affinity",
}
OTHER_PLUGINS = ("max-score-picker", "single-profile-handler")
# In-flight load (evergreen_trio.picker.inflight): the producer and its scorers set LoadConfig.
LOAD_PLUGINS = (inflight.PRODUCER, *inflight.SCORERS)
KNOWN_TYPES = (*SCORERS, *OTHER_PLUGINS, *LOAD_PLUGINS, *flow_control.PLUGIN_TYPES)
# prefix-cache-scorer parameters -> SchedulerConfig fields. The reference's hashBlockSize counts
# characters of the prompt; ours is tokens x charsPerToken, so it lands with charsPerToken 1.
_PREFIX_PARAMETERS = {"maxPrefixBlocksToMatch": "max_prefix_blocks", "lruCapacityPerServer": "prefix_cache_capacity"}
_SCORE_FIELDS = {**SCORERS, **inflight.SCORERS}
_SATURATION = {"queueDepthThreshold": "queue_threshold", "kvCacheUtilThreshold": "kv_cache_threshold"}


def _plugins(doc: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """The declared plugins by name -> type, and the scheduler values their parameters set."""
    names: dict[str, str] = {}
    values: dict[str, Any] = {}
    for i, item in enumerate(sequence(doc.get("plugins", []), f"{KIND}.plugins")):
        path = f"{KIND}.plugins[{i}]"
        plugin = mapping(item, path)
        unknown = set(plugin) - {"type", "name", "parameters"}
        if unknown:
            first = sorted(unknown)[0]
            raise ConfigError(f"{path}.{first}", "one of ['name', 'parameters', 'type']", first)
        kind = plugin.get("type")
        if kind not in KNOWN_TYPES:
            raise ConfigError(f"{path}.type", f"a known plugin type ({', '.join(KNOWN_TYPES)})", kind)
        name = plugin.get("name", kind)
        if not isinstance(name, str) or not name or name in names:
            raise ConfigError(f"{path}.name", "a plugin name not declared before", name)
        names[name] = kind
        parameters = mapping(plugin.get("parameters") or {}, f"{path}.parameters")
        if kind in flow_control.PLUGIN_TYPES:
            pass  # validated by flow_control.flow_control_config, with the section that uses them
        elif kind in LOAD_PLUGINS:
            values.setdefault("load", {}).update(inflight.plugin_values(kind, parameters, f"{path}.parameters"))
        elif kind == "prefix-cache-scorer":
            for key, value in parameters.items():
                if key == "hashBlockSize":
                    values["prefix_block_tokens"] = integer(value, f"{path}.parameters.{key}", minimum=1)
                    values["chars_per_token"] = 1
                elif key in _PREFIX_PARAMETERS:
                    values[_PREFIX_PARAMETERS[key]] = integer(value, f"{path}.parameters.{key}", minimum=1)
                else:
                    expected = f"one of {sorted(['hashBlockSize', *_PREFIX_PARAMETERS])}"
                    raise ConfigError(f"{path}.parameters.{key}", expected, key)
    return names, values


def _weights(doc: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, float]:
    profiles = sequence(doc.get("schedulingProfiles", []), f"{KIND}.schedulingProfiles")
    if not profiles:  # the reference's default: one profile with every declared plugin, weight 1
        return {_SCORE_FIELDS[kind]: 1.0 for kind in names.values() if kind in _SCORE_FIELDS}
    if len(profiles) > 1:
        raise ConfigError(f"{KIND}.schedulingProfiles", "one profile (the single-profile-handler)",
                          f"{len(profiles)} profiles")
    path = f"{KIND}.schedulingProfiles[0]"
    profile = mapping(profiles[0], path)
    weights: dict[str, float] = {}
    for i, item in enumerate(sequence(profile.get("plugins", []), f"{path}.plugins")):
        ref_path = f"{path}.plugins[{i}]"
        ref = mapping(item, ref_path)
        name = ref.get("pluginRef")
        if not isinstance(name, str) or name not in names:
            raise ConfigError(f"{ref_path}.pluginRef", f"a declared plugin name ({', '.join(names)})", name)
        weight = ref.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ConfigError(f"{ref_path}.weight", "a number >= 0", weight)
        if names[name] in _SCORE_FIELDS:
            weights[_SCORE_FIELDS[names[name]]] = float(weight)
    return weights


def is_endpoint_picker_config(doc: Mapping[str, Any]) -> bool:
    return doc.get("kind") == KIND


def scheduler_values(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for :class:`SchedulerConfig` from one ``EndpointPickerConfig`` document.

    Raises :class:`ConfigError` for a wrong apiVersion, an unknown plugin type or field, a profile
    naming an undeclared plugin, or no scorer with a weight above 0.
    """
    if doc.get("apiVersion") not in API_VERSIONS:
        raise ConfigError(f"{KIND}.apiVersion", " or ".join(API_VERSIONS), doc.get("apiVersion"))
    allowed = {"apiVersion", "kind", "plugins", "schedulingProfiles", "saturationDetector", "featureGates", "data",
               "flowControl"}
    for key in doc:
        if key not in allowed:
            raise ConfigError(f"{KIND}.{key}", f"one of {sorted(allowed)}", key)
    names, values = _plugins(doc)
    weights = _weights(doc, names)
    if not any(weights.values()):
        raise ConfigError(f"{KIND}.schedulingProfiles", "at least one scorer with a weight > 0", weights)
    values.update({field: weights.get(field, 0.0) for field in SCORERS.values()})
    load = values.pop("load", {}) | {field: weights.get(field, 0.0) for field in inflight.SCORERS.values()}
    values["load"] = inflight.LoadConfig(**load)
    saturation = mapping(doc.get("saturationDetector") or {}, f"{KIND}.saturationDetector")
    for key, value in saturation.items():
        path = f"{KIND}.saturationDetector.{key}"
        if key in _SATURATION:
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(path, "a positive number", value)
            values[_SATURATION[key]] = float(value)
        elif key != "metricsStalenessThreshold":  # the pool's, set by --metrics-staleness-threshold
            raise ConfigError(path, f"one of {sorted([*_SATURATION, 'metricsStalenessThreshold'])}", key)
    return values
