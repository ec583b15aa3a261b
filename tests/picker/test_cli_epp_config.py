"""The reference's EndpointPickerConfig (what --config-file / --config-text carry) onto our
scheduler; the sans-IO pool/pod readers discovery feeds; both fuzzed with hypothesis."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import SchedulerConfig, parse_config
from evergreen_trio.picker.epp_config import scheduler_values
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.k8s.pool_state import PoolSpecError, PoolState, pod_address, pool_spec
from evergreen_trio.picker.plugins import PLUGIN_TYPES

CHART_DEFAULT = (Path(__file__).parents[1] / "deploy" / "chart" / "default-plugins.yaml").read_text()
HEAD = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"


def test_the_charts_default_plugins_file() -> None:
    config = parse_config(CHART_DEFAULT, cluster_pool="pool")
    assert (config.scheduler.queue, config.scheduler.kv_cache, config.scheduler.prefix_cache,
            config.scheduler.lora_affinity) == (2.0, 2.0, 3.0, 0.0)
    assert config.pool.name == "pool" and config.pool.endpoints == ()


def test_every_known_plugin_and_parameters() -> None:
    text = HEAD + """plugins:
- {type: queue-scorer}
- {type: kv-cache-utilization-scorer, name: kv}
- {type: prefix-cache-scorer, parameters: {hashBlockSize: 32, maxPrefixBlocksToMatch: 64, lruCapacityPerServer: 100}}
- {type: lora-affinity-scorer}
- {type: max-score-picker}
- {type: single-profile-handler}
saturationDetector: {queueDepthThreshold: 8, kvCacheUtilThreshold: 0.9}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: kv, weight: 5}, {pluginRef: prefix-cache-scorer},
            {pluginRef: lora-affinity-scorer, weight: 0.5}, {pluginRef: max-score-picker}]
"""
    scheduler = SchedulerConfig(**scheduler_values(yaml.safe_load(text)))
    assert (scheduler.queue, scheduler.kv_cache, scheduler.prefix_cache, scheduler.lora_affinity) == (0, 5, 1, 0.5)
    assert scheduler.prefix_block_bytes == 32 and scheduler.max_prefix_blocks == 64
    assert scheduler.prefix_cache_capacity == 100 and scheduler.queue_threshold == 8


def test_no_profile_means_every_scorer_at_weight_1() -> None:
    values = scheduler_values(yaml.safe_load(HEAD + "plugins: [{type: queue-scorer}, {type: max-score-picker}]"))
    assert values["queue"] == 1.0 and values["kv_cache"] == 0.0


def test_our_yaml_beside_an_endpoint_picker_config(tmp_path: Path) -> None:
    text = "models: [{name: m, criticality: Sheddable}]\n---\n" + CHART_DEFAULT
    config = parse_config(text, cluster_pool="pool")
    assert config.models[0].sheddable and config.scheduler.prefix_cache == 3.0
    static = parse_config("pool: {endpoints: ['10.0.0.1:8000']}\n---\n" + CHART_DEFAULT)
    assert static.scheduler.queue == 2.0 and len(static.pool.endpoints) == 1


@pytest.mark.parametrize(("text", "field"), [
    (HEAD + "plugins: [{type: magic}]", "EndpointPickerConfig.plugins[0].type"),
    (HEAD + "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: [{pluginRef: nope}]}]",
     "EndpointPickerConfig.schedulingProfiles[0].plugins[0].pluginRef"),
    (HEAD + "plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a}, {name: b}]",
     "EndpointPickerConfig.schedulingProfiles"),
    (HEAD + "plugins: [{type: prefix-cache-scorer, parameters: {blockSize: 3}}]",
     "EndpointPickerConfig.plugins[0].parameters.blockSize"),
    ("apiVersion: v2\nkind: EndpointPickerConfig\n", "EndpointPickerConfig.apiVersion"),
    (HEAD + "unknownKey: 1", "EndpointPickerConfig.unknownKey"),
    ("pool: {endpoints: ['10.0.0.1:1']}", "pool.endpoints"),
    ("scheduler: {weights: {queue: 1}}\n---\n" + HEAD + "plugins: [{type: queue-scorer}]", "scheduler"),
])
def test_mistakes_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, cluster_pool="pool")
    assert caught.value.field == field


def test_unknown_type_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + "plugins: [{type: low-queue-filter}]", cluster_pool="pool")
    assert all(kind in caught.value.expected for kind in PLUGIN_TYPES)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 70000) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)


@pytest.mark.fuzz
@given(st.dictionaries(st.sampled_from(["plugins", "schedulingProfiles", "saturationDetector", "x"]), json_values,
                       max_size=3))
def test_fuzz_endpoint_picker_config(body: dict[str, Any]) -> None:
    doc = {"apiVersion": "inference.networking.x-k8s.io/v1alpha1", "kind": "EndpointPickerConfig", **body}
    with contextlib.suppress(ConfigError):
        SchedulerConfig(**scheduler_values(doc))


MALFORMED_PODS = [
    {"metadata": [1]}, {"status": "x"}, {"status": {"conditions": [3, None]}},
    {"status": {"podIP": "not-an-ip", "conditions": [{"type": "Ready", "status": "True"}]}},
]


@pytest.mark.parametrize("pod", MALFORMED_PODS)
def test_malformed_pods_are_not_ready(pod: dict[str, Any]) -> None:
    state = PoolState(pool_spec({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}]}))
    state.apply("ADDED", pod)
    assert pod_address(pod) is None and state.endpoints() == ()


@pytest.mark.parametrize("ports", [[], list(range(1, 10)), list(range(1, 20_001)), [8000, 8000]],
                         ids=["none", "nine", "twenty-thousand", "a-duplicate"])
def test_target_ports_as_the_crd_allows_them(ports: list[int]) -> None:
    """1 to 8 unique ports: 20,000 times 200 pods were 4 million endpoints, 7 s of every event."""
    with pytest.raises(PoolSpecError, match=r"spec\.targetPorts: expected"):
        pool_spec({"selector": {"a": "b"}, "targetPorts": [{"number": p} for p in ports]})
    assert pool_spec({"selector": {"a": "b"}, "targetPorts": [{"number": p} for p in range(1, 9)]}).ports == tuple(
        range(1, 9))


def test_pods_kept_are_bounded() -> None:
    """A selector matching far more pods than a pool has keeps the first Ready ones listed or added,
    and counts the others (they grew without bound, and each event sorted them all)."""
    def ready(i: int, ip: str | None = None) -> dict[str, Any]:
        return {"metadata": {"name": f"m-{i}"}, "status": {"podIP": ip or f"10.0.{i // 256}.{i % 256}",
                                                         "conditions": [{"type": "Ready", "status": "True"}]}}

    state = PoolState(pool_spec({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}]}),
                      max_pods=2)
    state.replace_pods([ready(0), {"metadata": {"name": "pending"}}, ready(1), ready(2)])
    for i in range(3, 1000):
        state.apply("ADDED", ready(i))
    assert sorted(state.pods) == ["m-0", "m-1"] and state.left_out == 998
    state.apply("MODIFIED", ready(1, "10.9.9.9"))  # a kept pod still follows its changes
    assert [e.address for e in state.endpoints()] == ["10.0.0.0:1", "10.9.9.9:1"]
    state.apply("DELETED", ready(0))
    state.apply("ADDED", ready(5))
    assert sorted(state.pods) == ["m-1", "m-5"]


@pytest.mark.fuzz
@given(json_values, json_values)
def test_fuzz_pool_spec_and_pods(spec: Any, pod: Any) -> None:
    with contextlib.suppress(PoolSpecError):
        pool_spec(spec if isinstance(spec, dict) else {"selector": spec})
    if isinstance(pod, dict):
        state = PoolState()
        for kind in ("ADDED", "MODIFIED", "BOOKMARK", "DELETED"):
            try:
                state.apply(kind, pod)
            except (AttributeError, TypeError):
                pytest.fail("a malformed pod must not raise")
        pod_address(pod)
