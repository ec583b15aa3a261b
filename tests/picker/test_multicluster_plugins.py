"""The multicluster plugin family and local-syncer, sans-IO: llm-d-router's test tables
(``*/multicluster_test.go``, ``cmd/epp/runner/multicluster_config_test.go``) ported, and the
config errors through ``evergreen-trio picker``."""

from __future__ import annotations

import itertools
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import run_cli

from evergreen_trio.picker.config import Endpoint, PickerConfig, PoolConfig, parse_config
from evergreen_trio.picker.epp_config import read_endpoint_picker_config
from evergreen_trio.picker.errors import ConfigError, MetricsError
from evergreen_trio.picker.file_discovery import parse_endpoints_file
from evergreen_trio.picker.multicluster import (
    KV_ATTRIBUTE,
    MAX_PAGE_BYTES,
    QUEUE_ATTRIBUTE,
    ClusterPoll,
    PoolMetrics,
    cluster_entry,
    metrics_target,
    min_max_scores,
    parse_pool_page,
    valid_host_or_ip,
    write_pool_attributes,
)
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES
from evergreen_trio.picker.scheduler import SCORERS, PickRequest, PoolSnapshot, Scheduler
from evergreen_trio.picker.tls import client_context

FAMILY = ("multicluster-file-discovery", "multicluster-metrics-data-source", "multicluster-metrics-extractor",
          "multicluster-approx-prefix-cache-producer", "multicluster-session-affinity-filter",
          "multicluster-kv-cache-utilization-scorer", "multicluster-prefix-cache-scorer",
          "multicluster-queue-scorer")


def test_the_family_and_local_syncer_are_registered_and_the_family_is_alpha() -> None:
    for name in (*FAMILY, "local-syncer"):
        assert name in PLUGIN_TYPES, name
    assert set(FAMILY) <= ALPHA_TYPES and "local-syncer" not in ALPHA_TYPES


# -- discovery: TestValidateHostOrIP, TestMetricsHostFromLabels, the factory tests ---------------

@pytest.mark.parametrize(("address", "ok"), [
    ("10.0.0.1", True), ("::1", True), ("gw.cluster-a.example.com", True), ("gateway", True),
    ("gw.example.com.", False), ("GW.example.com", False), ("3com.example.com", True), ("", False),
    ("gw_1.example.com", False), ("12345", True), ("gw:443", False), ("gw\x00.example.com", False),
    ("user@host", False), ("-bad.example.com", False), ("gw..example.com", False),
    ("fe80::1%eth0", False), ("a" * 254, False), (".".join(["a" * 63] * 3), True),
])
def test_a_cluster_address_is_an_ip_literal_or_a_dns_1123_subdomain(address: str, ok: bool) -> None:
    assert valid_host_or_ip(address) is ok


@pytest.mark.parametrize(("labels", "want"), [
    ({"metricsAddress": "10.0.0.11", "metricsPort": "9090"}, ("10.0.0.11", 9090)),
    ({"metricsAddress": "10.0.0.11"}, ("10.0.0.11", 8080)),
    ({"metricsPort": "9090"}, ("10.0.0.12", 8080)),
    ({}, ("10.0.0.12", 8080)),
    ({"metricsAddress": "gw.example.com", "metricsPort": "443"}, ("gw.example.com", 443)),
])
def test_metrics_labels_move_the_scrape_off_the_routable_address(labels: dict[str, str],
                                                                 want: tuple[str, int]) -> None:
    assert metrics_target(Endpoint("10.0.0.12", 8080, labels=tuple(labels.items()))) == want


CLUSTERS = b"""endpoints:
  - name: cluster-a
    address: "gw.cluster-a.example.com"
    port: "443"
  - name: split
    address: "10.0.0.12"
    port: "8080"
    labels: { metricsAddress: "10.0.0.11", metricsPort: "9090" }
"""


def test_the_cluster_file_takes_hostnames_where_the_pod_file_does_not() -> None:
    entries, errors = parse_endpoints_file(CLUSTERS, cluster_entry)
    assert errors == [] and [(e.name, e.address, e.port) for e in entries] == [
        ("cluster-a", "gw.cluster-a.example.com", 443), ("split", "10.0.0.12", 8080)]
    _, stock = parse_endpoints_file(CLUSTERS)
    assert stock == ["endpoint 'cluster-a': invalid IPv4 address 'gw.cluster-a.example.com'"]


def test_a_bad_cluster_entry_is_one_line_naming_it_and_the_others_load() -> None:
    data = b"""endpoints:
  - {name: good, address: gw.example.com, port: "443"}
  - {name: upper, address: GW.example.com, port: "443"}
  - {name: metrics-host, address: gw.example.com, port: "443", labels: {metricsAddress: "a b"}}
  - {name: metrics-port, address: gw.example.com, port: "443", labels: {metricsAddress: m.example.com,
     metricsPort: "70000"}}
"""
    entries, errors = parse_endpoints_file(data, cluster_entry)
    assert [e.name for e in entries] == ["good"]
    assert errors == ["endpoint 'upper': invalid host 'GW.example.com'",
                      "endpoint 'metrics-host': invalid metricsAddress label 'a b'",
                      "endpoint 'metrics-port': invalid metricsPort label '70000'"]


# -- the extractor: TestMultiClusterMetricsExtractor and its custom names -------------------------

def page(**values: float) -> bytes:
    return "".join(f"# TYPE {name} gauge\n{name}{{name=\"pool\"}} {value}\n" for name, value in values.items()).encode()


@pytest.mark.parametrize(("values", "error", "want"), [
    ({"llm_d_epp_average_kv_cache_utilization": 0.42, "llm_d_epp_average_queue_size": 7}, False,
     {KV_ATTRIBUTE: 0.42, QUEUE_ATTRIBUTE: 7.0}),
    ({"llm_d_epp_average_kv_cache_utilization": 0.9}, True, {KV_ATTRIBUTE: 0.9}),
    ({}, True, {}),
    ({"llm_d_epp_average_kv_cache_utilization": math.nan, "llm_d_epp_average_queue_size": 3}, True,
     {QUEUE_ATTRIBUTE: 3.0}),
])
def test_the_extractor_writes_each_aggregate_it_finds(values: dict[str, float], error: bool,
                                                      want: dict[tuple[str, str], float]) -> None:
    attributes: dict[tuple[str, str], float] = {}
    parsed = parse_pool_page(page(**values), PoolMetrics())
    if error:
        with pytest.raises(MetricsError):
            write_pool_attributes(attributes, parsed)
    else:
        write_pool_attributes(attributes, parsed)
    assert attributes == want


def test_custom_metric_names_fill_the_same_attributes_and_a_bad_one_fails_the_config() -> None:
    plugin = {"type": "multicluster-metrics-extractor",
              "parameters": {"kvCacheUtilizationMetric": "custom_kv", "queueSizeMetric": "custom_queue"}}
    metrics = epp([plugin]).plugins["multicluster-metrics-extractor"].params
    assert isinstance(metrics, PoolMetrics)
    attributes: dict[tuple[str, str], float] = {}
    write_pool_attributes(attributes, parse_pool_page(page(custom_kv=0.3, custom_queue=2), metrics))
    assert attributes == {KV_ATTRIBUTE: 0.3, QUEUE_ATTRIBUTE: 2.0}
    plugin["parameters"] = {"kvCacheUtilizationMetric": "1_bad"}
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.kvCacheUtilizationMetric"):
        epp([plugin])


@pytest.mark.parametrize("body", [b"\xff\xfe not prometheus {{{", b"x" * (MAX_PAGE_BYTES + 1)])
def test_a_page_that_does_not_parse_is_the_sources_error(body: bytes) -> None:
    with pytest.raises(MetricsError):
        parse_pool_page(body, PoolMetrics())


# -- the scorers: TestMultiClusterScorer_Score (queue and kv) ------------------------------------

def scheduler(config_text: str, attributes: list[dict[tuple[str, str], float] | None]) -> Scheduler:
    config = parse_config(config_text)
    endpoints = [Endpoint("10.0.0.1", 8000 + i) for i in range(len(attributes))]
    snapshot = PoolSnapshot(endpoints, 2.0, lambda: 0.0)
    for endpoint, values in zip(endpoints, attributes, strict=True):
        if values is not None:
            snapshot.states[endpoint.address].attributes.update(values)
    return Scheduler(config, snapshot, random.Random(0))


def scores(scorer: str, attributes: list[dict[tuple[str, str], float] | None]) -> list[float | None]:
    chosen = scheduler(f"""pool: {{name: p, endpoints: ['127.0.0.1:9']}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins: [{{type: {scorer}}}, {{type: multicluster-metrics-extractor}}]
""", attributes)
    function = chosen.config.effective_profiles[0].scorers[0]
    states = list(chosen.snapshot.states.values())
    got = SCORERS[function.plugin.type](chosen, PickRequest("m", 0), states, {}, function.plugin.params)
    return [got.get(s.endpoint.address) for s in states]


@pytest.mark.parametrize(("queues", "want"), [
    ([2, 6, 10], [1.0, 0.5, 0.0]),
    ([4, 4], [1.0, 1.0]),
    ([None], [None]),
    ([2, None, 10], [1.0, None, 0.0]),
])
def test_the_queue_scorer_min_max_normalizes_across_clusters(queues: list[float | None],
                                                             want: list[float | None]) -> None:
    got = scores("multicluster-queue-scorer", [None if q is None else {QUEUE_ATTRIBUTE: q} for q in queues])
    assert got == pytest.approx(want)


@pytest.mark.parametrize(("util", "want"), [(0.2, 0.8), (0.9, 0.1), (None, None), (1.7, 0.0), (-3.0, 1.0)])
def test_the_kv_scorer_is_one_minus_the_pool_utilization(util: float | None, want: float | None) -> None:
    got = scores("multicluster-kv-cache-utilization-scorer", [None if util is None else {KV_ATTRIBUTE: util}])
    assert got == [pytest.approx(want) if want is not None else None]


finite = st.floats(allow_nan=False, allow_infinity=False)


@given(st.dictionaries(st.text(max_size=3), finite, max_size=8))
def test_queue_scores_lie_in_0_1_the_shortest_queue_scores_1_and_equal_queues_all_1(
        queues: dict[str, float]) -> None:
    got = min_max_scores(queues)
    assert got.keys() == queues.keys()
    assert all(0.0 <= score <= 1.0 for score in got.values())
    if queues:
        assert got[min(queues, key=queues.__getitem__)] == 1.0
        if len(set(queues.values())) == 1:
            assert set(got.values()) == {1.0}
        else:
            assert got[max(queues, key=queues.__getitem__)] == 0.0


@given(st.lists(finite, min_size=2, max_size=8))
def test_a_longer_queue_never_scores_higher(queues: list[float]) -> None:
    got = min_max_scores({str(i): q for i, q in enumerate(queues)})
    ranked = sorted(range(len(queues)), key=queues.__getitem__)
    assert all(got[str(a)] >= got[str(b)] for a, b in itertools.pairwise(ranked))


# -- the config: TestMultiClusterConfigLoad, the data source, the syncer reference ---------------

def epp(plugins: list[dict[str, Any]], data_layer: dict[str, Any] | None = None) -> Any:
    doc: dict[str, Any] = {"apiVersion": "llm-d.ai/v1alpha1", "kind": "EndpointPickerConfig", "plugins": plugins}
    if data_layer is not None:
        doc["dataLayer"] = data_layer
    return read_endpoint_picker_config(doc)


def reference_config(clusters: Path, with_extractor: bool) -> str:
    """multicluster_config_test.go's config (the README example), its extractor dropped when asked."""
    extractor = "  - type: multicluster-metrics-extractor\n    name: metrics-extractor\n" if with_extractor else ""
    binding = "      extractors:\n        - pluginRef: metrics-extractor\n" if with_extractor else ""
    return f"""apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - type: multicluster-file-discovery
    name: discovery
    parameters:
      path: "{clusters}"
  - type: multicluster-metrics-data-source
    name: metrics-source
    parameters:
      scheme: https
{extractor}  - type: multicluster-session-affinity-filter
    name: session-affinity
  - type: multicluster-kv-cache-utilization-scorer
    name: kv-cache
  - type: multicluster-queue-scorer
    name: queue
  - type: max-score-picker
  - type: single-profile-handler
dataLayer:
  discovery:
    pluginRef: discovery
  sources:
    - pluginRef: metrics-source
{binding}"""


def test_the_reference_multicluster_config_loads_and_resolves_each_type(tmp_path: Path) -> None:
    config = epp_of(reference_config(tmp_path / "clusters.yaml", True))
    for name, want in {"discovery": "multicluster-file-discovery", "metrics-source": "multicluster-metrics-data-source",
                       "metrics-extractor": "multicluster-metrics-extractor",
                       "session-affinity": "multicluster-session-affinity-filter",
                       "kv-cache": "multicluster-kv-cache-utilization-scorer",
                       "queue": "multicluster-queue-scorer"}.items():
        assert config.plugins[name].type == want
    poll = config.pool["multicluster"]
    assert isinstance(poll, ClusterPoll) and poll.metrics == PoolMetrics()
    assert poll.source.tls_options == (False, "", "", "")  # https, verified by default
    (profile,) = parse_config(reference_config(tmp_path / "c.yaml", True)).scheduler.effective_profiles
    assert [f.type for f in profile.filters] == ["multicluster-session-affinity-filter"]
    assert [s.plugin.type for s in profile.scorers] == ["multicluster-kv-cache-utilization-scorer",
                                                         "multicluster-queue-scorer"]


def epp_of(text: str) -> Any:
    return read_endpoint_picker_config(yaml.safe_load(text))


def test_without_the_extractor_the_scorers_required_key_has_no_producer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no default producer found") as raised:
        epp_of(reference_config(tmp_path / "clusters.yaml", False))
    assert raised.value.field == "EndpointPickerConfig.plugins[3]"


def test_the_source_speaks_http_when_told_and_refuses_an_unreadable_ca(tmp_path: Path) -> None:
    source = {"type": "multicluster-metrics-data-source", "name": "s", "parameters": {"scheme": "http"}}
    assert epp([source], {"sources": [{"pluginRef": "s"}]}).pool["multicluster"].source.tls_options is None
    source["parameters"] = {"caCertPath": str(tmp_path / "missing.crt")}
    with pytest.raises(ConfigError, match=r"missing\.crt"):
        epp([source])
    source["parameters"] = {"scheme": "ftp"}
    with pytest.raises(ConfigError, match=r"parameters\.scheme"):
        epp([source])
    skip = epp([{**source, "parameters": {"insecureSkipVerify": True}}]).plugins["s"].params.tls_options
    assert not client_context(*skip).check_hostname and client_context().check_hostname


def test_the_extractor_reads_only_the_multicluster_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="an extractor of metrics-data-source's data"):
        epp([{"type": "metrics-data-source"}, {"type": "multicluster-metrics-extractor"}],
            {"sources": [{"pluginRef": "metrics-data-source",
                          "extractors": [{"pluginRef": "multicluster-metrics-extractor"}]}]})


def test_the_prefix_scorer_and_producer_under_their_multicluster_names_hash_prompts() -> None:
    config = parse_config("""pool: {name: p, endpoints: ['127.0.0.1:9']}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {type: multicluster-approx-prefix-cache-producer, parameters: {blockSizeTokens: 128, autoTune: false}}
- type: multicluster-prefix-cache-scorer
  parameters: {prefixMatchInfoProducerName: multicluster-approx-prefix-cache-producer}
""")
    assert isinstance(config, PickerConfig)
    assert config.scheduler.uses_prefix and config.scheduler.prefix_block_tokens == 128


@pytest.mark.parametrize(("layer", "error"), [
    ({"crossReplicaSyncerPluginRef": "sync"}, None),
    ({"crossReplicaSyncerPluginRef": "sync", "crossReplicaSyncInterval": "500ms"}, None),
    ({"crossReplicaSyncerPluginRef": "queue-scorer"}, "queue-scorer (a scorer)"),
    ({"crossReplicaSyncerPluginRef": "nobody"}, "nobody"),
    ({"crossReplicaSyncInterval": "soon"}, "crossReplicaSyncInterval"),
])
def test_the_syncer_reference_names_a_declared_syncer(layer: dict[str, Any], error: str | None) -> None:
    plugins = [{"type": "local-syncer", "name": "sync"}, {"type": "queue-scorer"}]
    if error is None:
        assert epp(plugins, layer).plugins["sync"].type == "local-syncer"
    else:
        with pytest.raises(ConfigError, match=re.escape(error)):
            epp(plugins, layer)


def test_a_cluster_pool_config_has_no_poll_without_the_source_listed() -> None:
    assert "multicluster" not in epp([{"type": "multicluster-metrics-data-source"}]).pool
    assert PoolConfig("p", ()).multicluster is None


def test_the_source_interval_is_a_duration() -> None:
    source = {"type": "multicluster-metrics-data-source", "name": "s", "parameters": {"interval": "250ms"}}
    assert epp([source]).plugins["s"].params.interval_s == 0.25
    source["parameters"] = {"interval": "often"}
    with pytest.raises(ConfigError, match=r"parameters\.interval"):
        epp([source])


@pytest.mark.parametrize(("layer", "culprit"), [
    ("dataLayer: {crossReplicaSyncerPluginRef: queue-scorer}", "crossReplicaSyncerPluginRef"),
    ("dataLayer: {sources: [{pluginRef: mc, extractors: [{pluginRef: metrics-data-source}]}]}", "extractors[0]"),
    ("- {type: multicluster-queue-scorer}", "no default producer found"),
    ("- {type: multicluster-metrics-data-source, name: ca, parameters: {caCertPath: /nonexistent/ca.crt}}",
     "/nonexistent/ca.crt"),
])
def test_a_config_error_through_the_cli_is_one_line_and_exit_2(tmp_path: Path, layer: str, culprit: str) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text(f"""pool: {{name: p, endpoints: ['127.0.0.1:9']}}
---
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- {{type: queue-scorer}}
- {{type: multicluster-metrics-data-source, name: mc}}
- {{type: metrics-data-source}}
{layer}
""")
    done = run_cli(["--config", str(config), "--allow-experimental-plugins"])
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and culprit in lines[0], done.stderr


def test_the_multicluster_prefix_scorer_names_a_declared_producer_as_the_stock_one_does() -> None:
    scorer = {"type": "multicluster-prefix-cache-scorer", "parameters": {"prefixMatchInfoProducerName": "nobody"}}
    with pytest.raises(ConfigError, match=r"plugins\[0\]\.parameters\.prefixMatchInfoProducerName"):
        epp([scorer])
    burst = {"type": "burst-prefix-cache-producer", "name": "burst"}
    scorer["parameters"] = {"prefixMatchInfoProducerName": "burst"}
    assert epp([scorer, burst]).plugins["multicluster-prefix-cache-scorer"].params.producer == "burst"
