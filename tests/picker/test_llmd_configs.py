"""llm-d-router's own configs (tests/picker/fixtures/llm-d-router, see SOURCE.md there) and the
EndpointPickerConfig keys added for them: apiVersions, strict parameters, data-layer plugins,
the prefix producer and scorer, profiles and the P/D handler; each bad value names its field."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.picker.config import config_from_documents, load_config, parse_config
from evergreen_trio.picker.engine_metrics import EngineConfig
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.plugins import (
    DECODE_FILTER,
    PLUGIN_TYPES,
    PREFILL_FILTER,
    AlwaysDecider,
    LabelSelector,
    PrefixDecider,
)

FIXTURES = Path(__file__).parent / "fixtures" / "llm-d-router"
HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
# Fixture -> None (loads) or the text its one-line error must carry (the plugin or section we lack).
EXPECTED = {
    "chart-default-plugins.yaml": None,
    "chart-default-plugins-sglang.yaml": None,
    "chart-payload-agnostic.yaml": None,
    "dp-epp-config.yaml": None,
    "e2e-deprecated-pd-config.yaml": None,
    "epp-burst-prefix-cache-config.yaml": None,
    "epp-config.yaml": None,
    "gie-v1.5.0-default-plugins.yaml": None,
    "epp-estimate-prefix-cache-config.yaml": None,
    # The reference's own example names `cacheSizeInMB`; its producer's parameter (and ours) is
    # `cacheSizeInMBPerServer`, and strict decoding refuses the unknown field in both.
    "epp-mm-embeddings-cache-config.yaml": "cacheSizeInMB",
    "epp-precise-prefix-cache-config.yaml": None,
    "pd-epp-config.yaml": None,
    "perf-optimized-baseline-plugins.yaml": None,
    "pd-topology-epp-config.yaml": None,
    "probabilistic-admitter-epp-config.yaml": None,
    "sim-e-p-d-epp-config.yaml": None,
    "sim-e-pd-epp-config.yaml": None,
    "sim-epp-config.yaml": None,
    "sim-epp-gpu-config.yaml": None,
    "sim-epp-kvcache-config.yaml": None,
    "sim-epp-no-hit-lru.yaml": None,
    "sim-epp-tokenizer-vllm-http-config.yaml": None,
    "sim-pd-epp-config.yaml": None,
    "sim-program-aware-config.yaml": None,
    "soft-reflective-ceiling-epp-config.yaml": None,
}


def test_every_fixture_has_an_expectation() -> None:
    assert sorted(p.name for p in FIXTURES.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize(("name", "error"), sorted(EXPECTED.items()))
def test_llmd_configs_load_or_name_what_we_lack(name: str, error: str | None) -> None:
    if error is None:
        config = load_config(FIXTURES / name, cluster_pool="pool")
        assert config.scheduler.effective_profiles
        return
    with pytest.raises(ConfigError) as caught:
        load_config(FIXTURES / name, cluster_pool="pool")
    assert error in str(caught.value) and "\n" not in str(caught.value)


def test_chart_default() -> None:
    config = load_config(FIXTURES / "chart-default-plugins.yaml", cluster_pool="pool")
    s = config.scheduler
    assert (s.queue, s.kv_cache, s.prefix_cache, s.lora_affinity) == (2, 2, 3, 0)
    assert s.prefix_auto_tune and s.prefix_block_tokens == 16 and s.max_prefix_tokens == 131_072
    assert s.prefix_cache_capacity == 31_250 and s.handler is None
    assert config.pool.metrics_path == "/metrics" and config.pool.engines == EngineConfig()
    sglang = load_config(FIXTURES / "chart-default-plugins-sglang.yaml", cluster_pool="pool")
    assert sglang.pool.engines.default_engine == "sglang" and sglang.pool.engines.engine_of({}) == "sglang"


def test_pd_topology_runs_topology_affinity_in_the_prefill_profile() -> None:
    s = load_config(FIXTURES / "pd-topology-epp-config.yaml", cluster_pool="pool").scheduler
    prefill = next(p for p in s.profiles if p.name == "prefill")
    assert [f.type for f in prefill.filters] == ["prefill-filter", "topology-affinity-filter"]
    assert prefill.weight("topology-affinity-scorer") == 1


def test_sim_gpu_polls_dcgm_for_the_attribute_plugins() -> None:
    config = load_config(FIXTURES / "sim-epp-gpu-config.yaml", cluster_pool="pool")
    (source,) = config.pool.dcgm_sources
    assert (source.port, source.interval_s, source.use_node_address) == (9400, 1.0, False)
    (profile,) = config.scheduler.profiles
    assert profile.weight("endpoint-attribute-scorer") == 2.0


def test_perf_optimized_baseline_runs_the_no_hit_lru_scorer() -> None:
    s = load_config(FIXTURES / "perf-optimized-baseline-plugins.yaml", cluster_pool="pool").scheduler
    (profile,) = s.profiles
    assert profile.weight("no-hit-lru-scorer") == 2 and profile.weight("prefix-cache-scorer") == 3
    assert s.uses_prefix and s.max_prefix_tokens == 100_000


def test_pd_config() -> None:
    s = load_config(FIXTURES / "pd-epp-config.yaml", cluster_pool="pool").scheduler
    assert s.handler is not None and s.handler.prefill_decider == PrefixDecider(16, 0)
    assert (s.handler.decode, s.handler.prefill, s.handler.stage_order) == ("decode", "prefill", "decode-first")
    prefill, decode = s.profiles
    assert prefill.filters[0].params == PREFILL_FILTER and decode.filters[0].params == DECODE_FILTER
    assert decode.weight("prefix-cache-scorer") == 2 and decode.weight("queue-scorer") == 1
    assert s.max_prefix_tokens == 16_384 and s.prefix_auto_tune and s.uses_prefix


def test_both_api_versions(caplog: pytest.LogCaptureFixture) -> None:
    text = "kind: EndpointPickerConfig\nplugins: [{type: queue-scorer}]\n"
    with caplog.at_level(logging.WARNING):
        parse_config("apiVersion: llm-d.ai/v1alpha1\n" + text, cluster_pool="p")
        assert "deprecated" not in caplog.text
        parse_config("apiVersion: inference.networking.x-k8s.io/v1alpha1\n" + text, cluster_pool="p")
    assert "apiVersion=inference.networking.x-k8s.io/v1alpha1" in caplog.text and "llm-d.ai/v1alpha1" in caplog.text


def test_deprecated_forms_load_and_log(caplog: pytest.LogCaptureFixture) -> None:
    text = HEAD + """plugins:
- {type: approx-prefix-cache-producer, parameters: {maxPrefixBlocksToMatch: 10, blockSize: 32, autoTune: false}}
- {type: prefix-cache-scorer}
- {type: decode-filter}
- {type: prefill-filter}
- {type: always-disagg-pd-decider, name: always}
- {type: pd-profile-handler, parameters: {deciderPluginName: always, primaryPort: 0}}
- {type: by-label, name: gpu, parameters: {label: gpu, validValues: [h100]}}
schedulingProfiles:
- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: gpu}, {pluginRef: prefix-cache-scorer}]}
- {name: prefill, plugins: [{pluginRef: prefill-filter}]}
"""
    with caplog.at_level(logging.WARNING):
        s = parse_config(text, cluster_pool="p").scheduler
    assert s.handler is not None and s.handler.prefill_decider == AlwaysDecider()
    assert s.prefix_block_tokens == 32 and not s.prefix_auto_tune and s.max_prefix_blocks == 10
    for word in ("pd-profile-handler", "by-label", "maxPrefixBlocksToMatch", "blockSize"):
        assert word in caplog.text


def test_legacy_prefix_scorer_parameters_keep_their_meaning() -> None:
    text = HEAD + "plugins: [{type: prefix-cache-scorer, parameters: {hashBlockSize: 64, lruCapacityPerServer: 9}}]"
    s = parse_config(text, cluster_pool="p").scheduler
    assert s.prefix_block_bytes == 64 and s.prefix_cache_capacity == 9 and not s.prefix_auto_tune


def test_label_selector_filter() -> None:
    text = HEAD + """plugins:
- type: label-selector-filter
  parameters:
    matchLabels: {zone: a}
    matchExpressions:
    - {key: gpu, operator: In, values: [h100, h200]}
    - {key: draining, operator: DoesNotExist}
    - {key: tier, operator: NotIn, values: [spot]}
    - {key: rack, operator: Exists}
- type: queue-scorer
"""
    selector = parse_config(text, cluster_pool="p").scheduler.profiles[0].filters[0].params
    assert isinstance(selector, LabelSelector)
    good = {"zone": "a", "gpu": "h100", "rack": "1"}
    assert selector.keeps(good)
    for bad in ({**good, "zone": "b"}, {**good, "gpu": "a100"}, {**good, "draining": "1"}, {**good, "tier": "spot"},
                {"zone": "a", "gpu": "h100"}):
        assert not selector.keeps(bad)


def test_role_filters_read_llmd_role_values() -> None:
    for role in ("decode", "prefill-decode", "both", "encode-prefill-decode"):
        assert DECODE_FILTER.keeps({"llm-d.ai/role": role})
    assert DECODE_FILTER.keeps({}) and not PREFILL_FILTER.keeps({})
    for role in ("prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"):
        assert PREFILL_FILTER.keeps({"llm-d.ai/role": role})
    assert not DECODE_FILTER.keeps({"llm-d.ai/role": "prefill"})
    assert not PREFILL_FILTER.keeps({"llm-d.ai/role": "decode"})
    assert not DECODE_FILTER.keeps({"llm-d.ai/role": "encode"})


def test_prefix_decider() -> None:
    decider = PrefixDecider(non_cached_tokens=16, prompt_tokens=0)
    assert decider.disaggregate(100, 0) and decider.disaggregate(100, 84)
    assert not decider.disaggregate(100, 85) and not decider.disaggregate(15, 0)
    assert not PrefixDecider(0).disaggregate(10**6, 0)
    assert not PrefixDecider(16, prompt_tokens=200).disaggregate(100, 0)


def test_core_metrics_extractor_engine_configs() -> None:
    text = HEAD + """plugins:
- type: queue-scorer
- type: core-metrics-extractor
  parameters:
    engineLabelKey: example.com/engine
    defaultEngine: mine
    engineConfigs:
    - {name: mine, queuedRequestsSpec: "q{kind=wait}", runningRequestsSpec: r, kvUsageSpec: kv}
"""
    engines = parse_config(text, cluster_pool="p").pool.engines
    assert engines.engine_of({"example.com/engine": "sglang"}) == "sglang"
    assert engines.engine_of({"llm-d.ai/engine-type": "sglang"}) == "mine"
    spec = engines.spec("unknown-engine")
    assert spec.name == "mine" and spec.waiting is not None and spec.waiting.labels == (("kind", "wait"),)


def test_metrics_data_source() -> None:
    text = HEAD + "plugins: [{type: queue-scorer}, {type: metrics-data-source, parameters: " \
                  "{path: /m, port: 9400, interval: 200ms, scheme: http}}]"
    pool = parse_config(text, cluster_pool="p").pool
    assert (pool.metrics_path, pool.metrics_port, pool.refresh_interval_s) == ("/m", 9400, 0.2)


P = "EndpointPickerConfig.plugins[0].parameters"
BAD = [
    ("{type: approx-prefix-cache-producer, parameters: {blockSizeToken: 16}}", f"{P}.blockSizeToken"),
    ("{type: approx-prefix-cache-producer, parameters: {autoTune: 'yes'}}", f"{P}.autoTune"),
    ("{type: approx-prefix-cache-producer, parameters: {autoTune: false, blockSizeTokens: 0}}", f"{P}.blockSizeTokens"),
    ("{type: approx-prefix-cache-producer, parameters: {maxPrefixTokensToMatch: -1}}", f"{P}.maxPrefixTokensToMatch"),
    ("{type: approx-prefix-cache-producer, parameters: {lruCapacityPerServer: 0}}", f"{P}.lruCapacityPerServer"),
    ("{type: prefix-cache-scorer, parameters: {matchLengthWeight: 1.5}}", f"{P}.matchLengthWeight"),
    ("{type: prefix-cache-scorer, parameters: {matchLengthWeight: 0.5, matchLengthScaleTokens: 0}}",
     f"{P}.matchLengthScaleTokens"),
    ("{type: prefix-cache-scorer, parameters: {prefixMatchInfoProducerName: precise}}",
     f"{P}.prefixMatchInfoProducerName"),
    ("{type: prefix-cache-scorer, parameters: [1]}", P),
    ("{type: metrics-data-source, parameters: {scheme: ftp}}", f"{P}.scheme"),
    ("{type: metrics-data-source, parameters: {scheme: https, insecureSkipVerify: false, caCertPath: /no/ca.pem}}", P),
    ("{type: metrics-data-source, parameters: {scheme: https, insecureSkipVerify: maybe}}", f"{P}.insecureSkipVerify"),
    ("{type: metrics-data-source, parameters: {scheme: https, path: metrics}}", f"{P}.path"),
    ("{type: metrics-data-source, parameters: {path: metrics}}", f"{P}.path"),
    ("{type: metrics-data-source, parameters: {port: 70000}}", f"{P}.port"),
    ("{type: metrics-data-source, parameters: {interval: soon}}", f"{P}.interval"),
    ("{type: metrics-data-source, parameters: {caCertPath: /ca.pem}}", f"{P}.caCertPath"),
    ("{type: metrics-data-source, parameters: {timeout: 1s}}", f"{P}.timeout"),
    ("{type: core-metrics-extractor, parameters: {defaultEngine: tgi}}", f"{P}.defaultEngine"),
    ("{type: core-metrics-extractor, parameters: {engineConfigs: [{name: default}]}}", f"{P}.engineConfigs[0].name"),
    ("{type: core-metrics-extractor, parameters: {engineConfigs: [{name: x, kvUsageSpec: 'a{b'}]}}",
     f"{P}.engineConfigs[0].kvUsageSpec"),
    ("{type: core-metrics-extractor, parameters: {engineConfigs: [{name: x, customMetrics: [{}]}]}}",
     f"{P}.engineConfigs[0].customMetrics[0].attributeKey"),
    ("{type: core-metrics-extractor, parameters: {engineConfigs: [{name: x, extra: 1}]}}",
     f"{P}.engineConfigs[0].extra"),
    ("{type: prefix-based-pd-decider, parameters: {nonCachedTokens: -1}}", f"{P}.nonCachedTokens"),
    ("{type: prefix-based-pd-decider, parameters: {promptTokens: 1.5}}", f"{P}.promptTokens"),
    ("{type: prefix-based-pd-decider, parameters: {threshold: 1}}", f"{P}.threshold"),
    ("{type: disagg-profile-handler, parameters: {stageOrder: sideways}}", f"{P}.stageOrder"),
    ("{type: disagg-profile-handler, parameters: {profiles: {decoder: d}}}", f"{P}.profiles.decoder"),
    ("{type: disagg-profile-handler, parameters: {deciders: {prefill: 3}}}", f"{P}.deciders.prefill"),
    ("{type: disagg-profile-handler, parameters: {stageOrder: prefill-first, deciders: {prefill: x}}}",
     f"{P}.deciders.prefill"),
    ("{type: disagg-profile-handler, parameters: {decodeProfile: d, profiles: {decode: d}}}", f"{P}.decodeProfile"),
    ("{type: pd-profile-handler, parameters: {primaryPort: 70000}}", f"{P}.primaryPort"),
    ("{type: label-selector-filter, parameters: {matchExpressions: [{key: a, operator: Near}]}}",
     f"{P}.matchExpressions[0].operator"),
    ("{type: label-selector-filter, parameters: {matchExpressions: [{key: a, operator: In}]}}",
     f"{P}.matchExpressions[0]"),
    ("{type: label-selector-filter, parameters: {matchLabels: {a: 1}}}", f"{P}.matchLabels.a"),
    ("{type: by-label, parameters: {label: role}}", P),
    ("{type: decode-filter, parameters: {role: decode}}", f"{P}.role"),
    ("{type: max-score-picker, parameters: {maxNumOfEndpoints: 0}}", f"{P}.maxNumOfEndpoints"),
    # NaN passes every range comparison, and JSON (the reference's parameters) has no NaN or
    # infinity: a NaN composite weight loaded, then failed every request in the scorer.
    ("{type: latency-scorer, parameters: {compositeKVWeight: .nan}}", f"{P}.compositeKVWeight"),
    ("{type: latency-scorer, parameters: {ttftWeight: .inf}}", f"{P}.ttftWeight"),
    ("{type: active-request-scorer, parameters: {maxBusyScore: .nan}}", f"{P}.maxBusyScore"),
    ("{type: prefix-cache-scorer, parameters: {matchLengthWeight: .nan}}", f"{P}.matchLengthWeight"),
    ("{type: inflight-load-producer, parameters: {outputRatio: .inf}}", f"{P}.outputRatio"),
    ("{type: prefix-cache-affinity-filter, parameters: {affinityThreshold: -.inf}}", f"{P}.affinityThreshold"),
    ("{type: utilization-detector, parameters: {kvCacheUtilThreshold: .nan}}", f"{P}.kvCacheUtilThreshold"),
    ("{type: program-aware-fairness, parameters: {lasWeightService: .inf}}", f"{P}.lasWeightService"),
]


@pytest.mark.parametrize(("plugin", "field"), BAD)
def test_bad_plugin_parameters_name_the_field(plugin: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(HEAD + f"plugins:\n- {plugin}\n- {{type: queue-scorer, name: q}}\n", cluster_pool="p")
    assert caught.value.field == field, caught.value


PD = HEAD + """plugins:
- {type: decode-filter}
- {type: prefill-filter}
- {type: queue-scorer}
- {type: prefix-based-pd-decider, parameters: {nonCachedTokens: 8}}
"""
BAD_DOCS = [
    (PD + "- {type: disagg-profile-handler, parameters: {deciders: {prefill: nope}}}\n"
     "schedulingProfiles: [{name: decode}]", "EndpointPickerConfig.plugins[4].parameters.deciders.prefill"),
    (PD + "- {type: disagg-profile-handler, parameters: {deciders: {prefill: queue-scorer}}}\n"
     "schedulingProfiles: [{name: decode}]", "EndpointPickerConfig.plugins[4].parameters.deciders.prefill"),
    (PD + "- {type: disagg-profile-handler}\nschedulingProfiles: [{name: prefill}]",
     "EndpointPickerConfig.plugins[4].parameters.profiles.decode"),
    (PD + "- {type: disagg-profile-handler, parameters: {deciders: {encode: x}}}\n"
     "schedulingProfiles: [{name: decode}]", "EndpointPickerConfig.plugins[4].parameters.deciders.encode"),
    (PD + "- {type: disagg-profile-handler}\n- {type: single-profile-handler}", "EndpointPickerConfig.plugins"),
    (PD + "schedulingProfiles: [{name: a}, {name: b}]", "EndpointPickerConfig.schedulingProfiles"),
    (PD + "- {type: disagg-profile-handler}\nschedulingProfiles: [{name: decode}, {name: decode}]",
     "EndpointPickerConfig.schedulingProfiles[1].name"),
    (PD + "schedulingProfiles: [{name: a, plugins: [{pluginRef: prefix-based-pd-decider}]}]",
     "EndpointPickerConfig.schedulingProfiles[0].plugins[0].pluginRef"),
    (PD + "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer, weight: -1}]}]",
     "EndpointPickerConfig.schedulingProfiles[0].plugins[0].weight"),
    # NaN, infinities and integers past float64 (float() raised OverflowError on those).
    *((PD + f"schedulingProfiles: [{{name: a, plugins: [{{pluginRef: queue-scorer, weight: {value}}}]}}]",
       "EndpointPickerConfig.schedulingProfiles[0].plugins[0].weight") for value in (".nan", ".inf", str(10**400))),
    *((HEAD + f"saturationDetector: {{queueDepthThreshold: {value}}}",
       "EndpointPickerConfig.saturationDetector.queueDepthThreshold") for value in (".nan", ".inf", str(10**400))),
    (PD + "schedulingProfiles: [{name: a, extra: 1}]", "EndpointPickerConfig.schedulingProfiles[0].extra"),
    (PD + "dataLayer: {sources: [{pluginRef: queue-scorer}]}", "EndpointPickerConfig.dataLayer.sources[0].pluginRef"),
    (PD + "dataLayer: {discovery: {}}", "EndpointPickerConfig.dataLayer.discovery.pluginRef"),
    (PD + "requestHandler: {parsers: [{pluginRef: queue-scorer}]}",
     "EndpointPickerConfig.requestHandler.parsers[0].pluginRef"),
    (HEAD + "plugins: [{type: pd-profile-handler}]\nschedulingProfiles: [{name: decode}]",
     "EndpointPickerConfig.plugins[0].parameters.deciders.prefill"),
    (HEAD + "plugins: [{type: queue-scorer}, {type: queue-scorer}]", "EndpointPickerConfig.plugins[1].name"),
    (HEAD + "plugins: [{type: predicted-latency-producer, parameters: {sloBufferFactor: 0}}]",
     "EndpointPickerConfig.plugins[0].parameters.sloBufferFactor"),
    (HEAD + "flowControl: {maxRequest: 3}", "EndpointPickerConfig.flowControl.maxRequest"),
    (HEAD + "featureGates: [haPopulateNonLeaderDatastore, warpDrive]", "EndpointPickerConfig.featureGates[1]"),
    (HEAD + "featureGates: [[1]]", "EndpointPickerConfig.featureGates[0]"),
    (HEAD + "featureGates: ['flowControl=maybe']", "EndpointPickerConfig.featureGates[0]"),
]


@pytest.mark.parametrize(("text", "field"), BAD_DOCS)
def test_bad_profiles_and_sections_name_the_field(text: str, field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(text, cluster_pool="p")
    assert caught.value.field == field, caught.value


def test_static_endpoints_with_labels_and_engines() -> None:
    text = """pool:
  endpoints:
  - {address: '10.0.0.1:8000', labels: {llm-d.ai/role: prefill, llm-d.ai/engine-type: sglang}}
  - {address: '10.0.0.2:8000', labels: {inference.networking.k8s.io/engine-type: triton-tensorrt-llm}}
  - {address: '10.0.0.3:8000', engine: trtllm}
  - '10.0.0.4:8000'
"""
    endpoints = parse_config(text).pool.endpoints
    assert [e.engine for e in endpoints] == ["sglang", "triton-tensorrt-llm", "trtllm", "vllm"]
    assert endpoints[0].label_map["llm-d.ai/role"] == "prefill"
    for bad, field in (("{address: '10.0.0.1:1', labels: [a]}", "pool.endpoints[0].labels"),
                       ("{address: '10.0.0.1:1', labels: {a: 1}}", "pool.endpoints[0].labels.a"),
                       ("{address: '10.0.0.1:1', engine: tgi}", "pool.endpoints[0].engine")):
        with pytest.raises(ConfigError) as caught:
            parse_config(f"pool: {{endpoints: [{bad}]}}")
        assert caught.value.field == field


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 200_000) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=12)


@st.composite
def _plugin(draw: st.DrawFn) -> dict[str, object]:
    kind = draw(st.sampled_from(sorted(PLUGIN_TYPES)))
    known = PLUGIN_TYPES[kind].parameters
    keys = st.sampled_from(known) if known else st.text(max_size=6)
    return {"type": kind, "parameters": draw(st.dictionaries(keys, _values, max_size=3))}


@pytest.mark.fuzz
@given(st.lists(_plugin(), max_size=5), st.lists(st.sampled_from(sorted(PLUGIN_TYPES)), max_size=4))
def test_fuzz_plugins_and_profiles_only_raise_config_error(plugins: list[dict[str, object]], refs: list[str]) -> None:
    doc = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", "plugins": plugins,
           "schedulingProfiles": [{"name": "decode", "plugins": [{"pluginRef": r} for r in refs]}]}
    with contextlib.suppress(ConfigError):
        config_from_documents([doc], cluster_pool="p")
