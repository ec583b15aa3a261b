"""``topology-extractor``, ``topology-affinity-filter`` and ``-scorer``: llm-d-router's test tables,
invariants, discovery's pod facts, the P/D scheduler's peer, the command's bad input, and a started
picker driven by grpcio as Envoy."""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import trio
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from hypothesis import given
from hypothesis import strategies as st
from picker_cli import EPHEMERAL_PORTS, picker_process, run_cli, wait_health

from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics, EngineConfig
from evergreen_trio.picker.file_discovery import parse_endpoints_file, to_endpoints
from evergreen_trio.picker.k8s.pool_state import PoolState, pool_spec
from evergreen_trio.picker.plugins import ALPHA_TYPES, PLUGIN_TYPES
from evergreen_trio.picker.processor import PREFILLER
from evergreen_trio.picker.scheduler import PickRequest, PoolSnapshot, Scheduler
from evergreen_trio.picker.topology import (
    LEVEL_SCORES,
    Level,
    Topology,
    TopologyExtractor,
    TopologyFilterParams,
    TopologyScorerParams,
    compare,
    topology_filter,
    topology_scores,
)

sys.path.insert(0, str(Path(__file__).parents[1] / "security"))
from picker_requests import PROCESS, channel, headers_message, serve_fake_engine

HEAD = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
PEER = Topology("h1", "r1", "z1", "reg1")


def _plugin(plugin_type: str, parameters: str = "") -> object:
    config = parse_config(HEAD + f"plugins:\n- {{type: {plugin_type}, name: p, parameters: {{{parameters}}}}}\n",
                          cluster_pool="pool")
    return config.epp.plugins["p"].params if config.epp is not None else None


# -- llm-d-router's tests (util/topology/level_test.go, filter_test.go, scorer_test.go) ----------


@pytest.mark.parametrize(("candidate", "level"), [
    (Topology("h1", "r1", "z1", "reg1"), Level.HOST),
    (Topology("h2", "r1", "z1", "reg1"), Level.RACK),
    (Topology("h2", "r2", "z1", "reg1"), Level.ZONE),
    (Topology("h2", "r2", "z2", "reg1"), Level.REGION),
    (Topology("h2", "r2", "z2", "reg2"), Level.NONE),
    (Topology(rack="r1"), Level.RACK),  # sparse: matches at its only populated level
    (None, Level.NONE),
])
def test_compare_gives_the_tightest_shared_level(candidate: Topology | None, level: Level) -> None:
    assert compare(PEER, candidate) is level
    assert compare(None, candidate) is Level.NONE


def test_an_empty_value_never_matches_even_empty_against_empty() -> None:
    assert compare(Topology(zone="z"), Topology(zone="z2")) is Level.NONE
    assert compare(Topology(rack="r"), Topology(rack="r")) is Level.RACK


def test_the_filter_keeps_only_candidates_at_min_affinity() -> None:
    candidates = {"same-host": PEER, "same-rack": Topology("h2", "r1", "z1", "reg1"),
                  "no-match": Topology("h3", "r3", "z3", "reg3")}
    assert topology_filter(Level.HOST, PEER, candidates) == ["same-host"]
    assert topology_filter(Level.RACK, PEER, candidates) == ["same-host", "same-rack"]


def test_the_filter_fails_open() -> None:
    sparse = {"rack-only": Topology(rack="r1")}
    assert topology_filter(Level.RACK, PEER, sparse) == ["rack-only"]
    assert topology_filter(Level.HOST, PEER, sparse) == ["rack-only"]  # none meets host: all kept
    assert topology_filter(Level.HOST, None, {"a": Topology("h1"), "b": Topology("h2")}) == ["a", "b"]


def test_a_candidate_without_a_topology_is_dropped() -> None:
    assert topology_filter(Level.HOST, Topology("h1"), {"same": Topology("h1"), "none": None}) == ["same"]


def test_the_scorer_curve_and_no_peer() -> None:
    candidates = {"host": PEER, "rack": Topology("x", "r1"), "zone": Topology(zone="z1"),
                  "region": Topology(region="reg1"), "none": Topology("x"), "missing": None}
    assert topology_scores(PEER, candidates) == {"host": 1.0, "rack": 0.2, "zone": 0.05, "region": 0.02,
                                                 "none": 0.0, "missing": 0.0}
    assert set(topology_scores(None, candidates).values()) == {0.0}


@pytest.mark.parametrize(("parameters", "expected"), [
    ("", TopologyFilterParams(Level.HOST)),
    ("minAffinity: ''", TopologyFilterParams(Level.HOST)),
    ("minAffinity: zone, topologyProducerName: topo-2", TopologyFilterParams(Level.ZONE, "topo-2")),
])
def test_filter_factory(parameters: str, expected: TopologyFilterParams) -> None:
    assert _plugin("topology-affinity-filter", parameters) == expected


def test_scorer_and_extractor_factories() -> None:
    assert _plugin("topology-affinity-scorer") == TopologyScorerParams()
    assert _plugin("topology-affinity-scorer", "topologyProducerName: t") == TopologyScorerParams("t")
    assert _plugin("topology-extractor") == TopologyExtractor()
    assert _plugin("topology-extractor", "hostname: topology.hostname, zone: ''") == TopologyExtractor(
        hostname="topology.hostname")


def test_the_three_types_are_implemented_alpha_types() -> None:
    for name in ("topology-extractor", "topology-affinity-filter", "topology-affinity-scorer"):
        assert name in PLUGIN_TYPES and name in ALPHA_TYPES


# -- the extractor (extractor/topology/extractor_test.go) ---------------------------------------


def test_the_extractor_reads_the_configured_labels() -> None:
    extractor = TopologyExtractor(hostname="topology.hostname")
    labelled = Endpoint("10.0.0.1", 8000, labels=(("topology.hostname", "rack-42"),))
    assert extractor.topology(labelled) == Topology("rack-42")
    assert extractor.topology(Endpoint("10.0.0.1", 8000, labels=(("other", "value"),))) is None
    assert extractor.topology(Endpoint("10.0.0.1", 8000)) is None


def test_without_a_hostname_label_the_pods_spec_hostname_counts() -> None:
    extractor = TopologyExtractor()
    zoned = (("topology.kubernetes.io/zone", "z1"),)
    assert extractor.topology(Endpoint("10.0.0.1", 8000, hostname="node-hostname")) == Topology("node-hostname")
    assert extractor.topology(Endpoint("10.0.0.1", 8000, labels=zoned, hostname="n")) == Topology("n", zone="z1")
    # the label wins over spec.hostname
    labelled = (("kubernetes.io/hostname", "label-host"),)
    assert extractor.topology(Endpoint("10.0.0.1", 8000, labels=labelled, hostname="n")) == Topology("label-host")


def _pod(name: str, ip: str, *, ready: bool = True, hostname: str | None = None,
         labels: dict[str, str] | None = None) -> dict[str, object]:
    spec = {"hostname": hostname} if hostname is not None else {}
    return {"metadata": {"name": name, "labels": labels or {}}, "spec": spec,
            "status": {"podIP": ip, "hostIP": "192.168.0.9",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def test_kubernetes_discovery_carries_the_pods_name_hostname_and_node() -> None:
    state = PoolState(pool_spec({"selector": {"app": "vllm"}, "targetPorts": [{"number": 8000}, {"number": 8001}]}),
                      EngineConfig())
    state.replace_pods([_pod("worker-5", "10.0.0.5", hostname="node-hostname"), _pod("worker-6", "10.0.0.6"),
                        _pod("worker-9", "10.0.0.9", ready=False, hostname="h9")])
    endpoints = state.endpoints()
    assert [(e.address, e.name, e.hostname, e.node_address) for e in endpoints] == [
        ("10.0.0.5:8000", "worker-5", "node-hostname", "192.168.0.9"),
        ("10.0.0.5:8001", "worker-5", "node-hostname", "192.168.0.9"),  # every rank of the pod
        ("10.0.0.6:8000", "worker-6", "", "192.168.0.9"), ("10.0.0.6:8001", "worker-6", "", "192.168.0.9")]
    assert TopologyExtractor().topology(endpoints[0]) == Topology("node-hostname")
    state.apply("MODIFIED", _pod("worker-5", "10.0.0.5", hostname=""))
    assert TopologyExtractor().topology(state.endpoints()[0]) is None


def test_a_file_discovered_endpoint_has_its_name_and_labels_only() -> None:
    entries, errors = parse_endpoints_file(
        b"endpoints:\n- {name: vllm-0, address: 10.0.0.1, port: '8000', labels: {topology.kubernetes.io/rack: r7}}\n")
    assert not errors
    config = parse_config("pool: {name: p, endpoints: ['10.9.9.9:1']}\n")
    (endpoint,) = to_endpoints(entries, config.pool)
    assert (endpoint.name, endpoint.hostname, endpoint.node_address) == ("vllm-0", "", "")
    assert TopologyExtractor().topology(endpoint) == Topology(rack="r7")


# -- invariants ---------------------------------------------------------------------------------

_NAMES = st.sampled_from(["", "a", "b"])
_TOPOLOGIES = st.none() | st.builds(Topology, _NAMES, _NAMES, _NAMES, _NAMES)


@given(st.dictionaries(st.text(max_size=4), _TOPOLOGIES, max_size=8), _TOPOLOGIES, st.sampled_from(list(Level)[:4]))
def test_the_filter_keeps_an_ordered_non_empty_subset(candidates: dict[str, Topology | None], peer: Topology | None,
                                                      level: Level) -> None:
    kept = topology_filter(level, peer, candidates)
    assert kept == [a for a in candidates if a in kept]
    assert bool(kept) == bool(candidates)
    if peer is not None and len(kept) < len(candidates):
        assert all(compare(peer, candidates[a]) <= level for a in kept)


@given(st.dictionaries(st.text(max_size=4), _TOPOLOGIES, max_size=8), _TOPOLOGIES)
def test_scores_are_in_0_1_and_compare_is_symmetric(candidates: dict[str, Topology | None],
                                                    peer: Topology | None) -> None:
    scores = topology_scores(peer, candidates)
    assert set(scores) == set(candidates) and all(0.0 <= s <= 1.0 for s in scores.values())
    for topology in candidates.values():
        assert compare(peer, topology) is compare(topology, peer)
        assert LEVEL_SCORES[compare(peer, topology)] == scores[next(a for a, t in candidates.items() if t == topology)]


# -- in the P/D scheduler -----------------------------------------------------------------------

DECODE, PREFILL_NEAR, PREFILL_FAR, PREFILL_BARE, DECODE_FAR = (f"10.0.2.{i}:8000" for i in range(1, 6))
PD = """plugins:
- {type: prefill-filter}
- {type: decode-filter}
- {type: queue-scorer}
- {type: max-score-picker}
- {type: always-disagg-pd-decider}
- {type: topology-extractor%s}
- {type: topology-affinity-filter, parameters: {minAffinity: %s}}
- {type: topology-affinity-scorer}
- {type: disagg-profile-handler, parameters: {stageOrder: %s, deciders: {prefill: %s}}}
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}%s]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: queue-scorer}%s]
"""
ROLES = [(DECODE, "decode", "host: h1, rack: r1"), (PREFILL_NEAR, "prefill", "host: h2, rack: r1"),
         (PREFILL_FAR, "prefill", "host: h3, rack: r9"), (PREFILL_BARE, "prefill", "")]


def _labels(role: str, where: str) -> str:
    labels = [f"llm-d.ai/role: {role}"]
    for part in filter(None, where.split(", ")):
        key, value = part.split(": ")
        labels.append(f"{'kubernetes.io/hostname' if key == 'host' else 'topology.kubernetes.io/' + key}: {value}")
    return "{" + ", ".join(labels) + "}"


def _pd_text(roles: Sequence[tuple[str, str, str]], *, prefill: str = "topology-affinity-filter", decode: str = "",
             level: str = "rack", order: str = "decode-first", extractor: str = "") -> str:
    endpoints = "\n".join(f"  - {{address: '{a}', labels: {_labels(role, where)}}}" for a, role, where in roles)
    decider = "always-disagg-pd-decider" if order == "decode-first" else "''"
    refs = [f", {{pluginRef: {name}}}" if name else "" for name in (prefill, decode)]
    return (f"pool:\n  name: pd\n  endpoints:\n{endpoints}\n---\n" + HEAD
            + PD % (extractor, level, order, decider, *refs))


def _pd(roles: Sequence[tuple[str, str, str]] = ROLES, waiting: dict[str, float] | None = None,
        **options: str) -> Scheduler:
    config = parse_config(_pd_text(roles, **options))
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics(waiting=(waiting or {}).get(endpoint.address, 0)))
    return Scheduler(config, snapshot, random.Random(3))


def test_the_prefill_profile_keeps_the_pods_near_the_decode_pick() -> None:
    # The near prefill pod is the busiest: only the filter sends prefill there.
    scheduler = _pd(waiting={PREFILL_NEAR: 9})
    for _ in range(5):
        result = scheduler.schedule(PickRequest("m", 0))
        assert (result.endpoints, result.prefill, scheduler.peer) == ([DECODE], PREFILL_NEAR, DECODE)
    scheduler = _pd(level="host", waiting={PREFILL_NEAR: 9})  # nobody on h1: fails open, the least loaded wins
    assert scheduler.schedule(PickRequest("m", 0)).prefill in (PREFILL_FAR, PREFILL_BARE)


def test_the_scorer_breaks_ties_by_its_curve() -> None:
    scheduler = _pd(prefill="topology-affinity-scorer")
    assert all(scheduler.schedule(PickRequest("m", 0)).prefill == PREFILL_NEAR for _ in range(5))
    scheduler = _pd(prefill="topology-affinity-scorer", waiting={PREFILL_NEAR: 1})  # rack's 0.2 < a queue gap
    assert scheduler.schedule(PickRequest("m", 0)).prefill != PREFILL_NEAR


def test_prefill_first_the_prefill_pick_is_the_decode_profiles_peer() -> None:
    roles = [(DECODE, "decode", "host: h1, rack: r1"), (DECODE_FAR, "decode", "host: h5, rack: r5"),
             (PREFILL_NEAR, "prefill", "host: h2, rack: r1")]
    scheduler = _pd(roles, {DECODE: 9}, prefill="", decode="topology-affinity-filter", order="prefill-first")
    for _ in range(5):
        result = scheduler.schedule(PickRequest("m", 0))
        assert (result.endpoints, result.prefill, scheduler.peer) == ([DECODE], PREFILL_NEAR, PREFILL_NEAR)


def test_no_extractor_of_that_name_keeps_every_candidate_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        scheduler = _pd(extractor=", name: other-topology", waiting={PREFILL_NEAR: 9})
    assert "picker.topology_not_produced" in caplog.text and "'topology-extractor'" in caplog.text
    assert scheduler.schedule(PickRequest("m", 0)).prefill != PREFILL_NEAR  # no topology: the least loaded wins


def test_outside_pd_there_is_no_peer() -> None:
    config = parse_config("pool: {name: p, endpoints: ['10.0.0.1:8000', '10.0.0.2:8000']}\n---\n" + HEAD
                          + "plugins:\n- {type: topology-extractor}\n- {type: topology-affinity-filter}\n"
                          + "- {type: topology-affinity-scorer}\n")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: 0.0)
    for endpoint in config.pool.endpoints:
        snapshot.update(endpoint.address, EndpointMetrics())
    scheduler = Scheduler(config, snapshot, random.Random(1))
    result = scheduler.schedule(PickRequest("m", 0), 2)
    assert sorted(result.endpoints) == ["10.0.0.1:8000", "10.0.0.2:8000"] and set(result.scores.values()) == {0.0}


# -- the command --------------------------------------------------------------------------------


@pytest.mark.parametrize(("plugin_type", "parameters", "field"), [
    ("topology-affinity-filter", "{minAffinity: datacenter}", "minAffinity"),
    ("topology-affinity-filter", "{minAffinity: 3}", "minAffinity"),
    ("topology-affinity-filter", "{topologyProducerName: [a]}", "topologyProducerName"),
    ("topology-affinity-filter", "{maxAffinity: host}", "maxAffinity"),
    ("topology-affinity-scorer", "{minAffinity: host}", "minAffinity"),
    ("topology-extractor", "{hostname: 7}", "hostname"),
    ("topology-extractor", "{datacenter: dc}", "datacenter"),
])
def test_each_bad_parameter_is_one_line_and_exit_2(plugin_type: str, parameters: str, field: str) -> None:
    text = HEAD + f"plugins:\n- {{type: {plugin_type}, parameters: {parameters}}}\n"
    result = run_cli(["--pool-name", "p", "--allow-experimental-plugins=true", "--config-text", text])
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"EndpointPickerConfig.plugins[0].parameters.{field}: expected" in line, line


# -- a started picker, grpcio as Envoy ----------------------------------------------------------


def _route(port: int) -> tuple[str, str | None]:
    """One chat request through ext_proc: (the destination, the prefill header or None)."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    with channel(port) as own:
        call = own.stream_stream(PROCESS, request_serializer=ep.ProcessingRequest.SerializeToString,
                                 response_deserializer=ep.ProcessingResponse.FromString)
        messages: Sequence[ep.ProcessingRequest] = [
            headers_message(path="/v1/chat/completions"),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))]
        for reply in call(iter(messages), timeout=30):
            if reply.HasField("immediate_response"):
                return f"status {reply.immediate_response.status.code}", None
            if reply.HasField("request_body"):
                lb = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields
                mutation = reply.request_body.response.header_mutation
                headers = {o.header.key: o.header.raw_value.decode() for o in mutation.set_headers}
                return lb["x-gateway-destination-endpoint"].string_value, headers.get(PREFILLER)
    raise AssertionError("no answer to the body")


async def test_a_started_picker_sends_prefill_near_the_decode_pod(nursery: trio.Nursery, tmp_path: Path) -> None:
    # The near prefill engine has the deepest queue: without the filter it would never be chosen.
    ports = [await nursery.start(serve_fake_engine, waiting) for waiting in (0, 9, 0, 0)]
    roles = [(f"127.0.0.1:{port}", role, where) for port, (_, role, where) in zip(ports, ROLES, strict=True)]
    config = tmp_path / "picker.yaml"
    config.write_text(_pd_text(roles))
    args = ["--config", str(config), "--allow-experimental-plugins=true", "--refresh-metrics-interval", "50ms",
            *EPHEMERAL_PORTS]
    async with picker_process(args) as picker:
        await wait_health("127.0.0.1", picker.health, "readiness")
        with trio.fail_after(10):
            while (await trio.to_thread.run_sync(_route, picker.grpc))[0].startswith("status"):  # noqa: ASYNC110
                await trio.sleep(0.05)
        for _ in range(3):
            assert await trio.to_thread.run_sync(_route, picker.grpc) == (roles[0][0], roles[1][0])
