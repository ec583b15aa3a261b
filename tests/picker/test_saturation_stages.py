"""Saturation as llm-d-router reads it: per pipeline stage for flow control, over the request's
located candidates for the legacy admission, and the subset hint matched by address alone."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from evergreen_trio.picker.config import Endpoint, parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import RequestError
from evergreen_trio.picker.flow_control.config import UtilizationDetector
from evergreen_trio.picker.flow_control.detectors import Reading, staged_saturation, stages, utilization
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.processor import subset_host
from evergreen_trio.picker.scheduler import EndpointState, PickRequest, PoolSnapshot, Scheduler
from evergreen_trio.picker.telemetry import PickerMetrics

ROLES = ["prefill", "encode-prefill", "decode", "", None, "prefill-decode", "both", "encode-prefill-decode",
         "encode", "no-such-role"]
NOW = 100.0


def _state(index: int, role: str | None, waiting: float | None) -> EndpointState:
    labels = () if role is None else (("llm-d.ai/role", role),)
    state = EndpointState(Endpoint(f"10.0.0.{index}", 8000, labels=labels))
    if waiting is not None:
        state.metrics, state.updated_at, state.ready = EndpointMetrics(waiting=waiting), NOW, True
    return state


def test_stages_partition_by_role_as_the_reference() -> None:
    by_role = {role: _state(i, role, 0) for i, role in enumerate(ROLES)}
    parts = stages(list(by_role.values()))
    names = {stage: {s.endpoint.label_map.get("llm-d.ai/role") for s in part} for stage, part in parts.items()}
    assert names == {
        "prefill": {"prefill", "encode-prefill", "prefill-decode", "both", "encode-prefill-decode"},
        "decode": {"decode", "", None, "prefill-decode", "both", "encode-prefill-decode"},
    }
    assert stages([by_role["encode"], by_role["no-such-role"]]) == {}


@given(st.lists(st.tuples(st.sampled_from(ROLES), st.none() | st.integers(0, 20)), max_size=12))
def test_effective_is_the_largest_stage_or_the_whole_pool(pool: list[tuple[str | None, int | None]]) -> None:
    states = [_state(i, role, waiting) for i, (role, waiting) in enumerate(pool)]
    detector = UtilizationDetector(queue_depth_threshold=5)
    readings = staged_saturation(detector, states, NOW, InflightLoad())
    staged = {name: r for name, r in readings.items() if name != "effective"}
    assert set(staged) == set(stages(states))
    for name, part in stages(states).items():
        assert staged[name] == utilization(detector, part, NOW)
    if staged:
        assert readings["effective"].saturation == max(r.saturation for r in staged.values())
    else:  # no endpoint serves a stage: the whole pool's reading, 1.0 when it is empty
        assert readings["effective"] == utilization(detector, states, NOW)


def test_a_saturated_prefill_stage_gates_dispatch_though_decode_is_idle() -> None:
    text = """pool: {name: t, endpoints: [
  {address: '10.0.0.1:8000', labels: {llm-d.ai/role: prefill}},
  {address: '10.0.0.2:8000', labels: {llm-d.ai/role: decode}},
  {address: '10.0.0.3:8000', labels: {llm-d.ai/role: decode}}]}
---
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins: [{type: queue-scorer}]
"""
    config = parse_config(text)
    assert config.flow_control is not None
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: NOW)
    snapshot.update("10.0.0.1:8000", EndpointMetrics(waiting=50))
    snapshot.update("10.0.0.2:8000", EndpointMetrics())
    snapshot.update("10.0.0.3:8000", EndpointMetrics())
    load = InflightLoad()
    gate = FlowGate(config.flow_control, snapshot, load)
    assert gate.saturation() == gate.readings["prefill"].saturation >= 1.0  # the whole pool's mean is below 1
    assert gate.readings["decode"] == Reading(0.0, 0)
    assert set(gate.readings) == {"prefill", "decode", "effective"}
    metrics = PickerMetrics("t")
    metrics.observe_load(snapshot, load, gate)
    page = generate_latest(metrics.registry).decode()
    for stage, value in (("prefill", 10.0), ("decode", 0.0), ("effective", 10.0)):
        assert f'llm_d_epp_flow_control_pool_saturation{{inference_pool="t",stage="{stage}"}} {value}' in page
    assert 'llm_d_epp_flow_control_stale_endpoints{detector="utilization-detector"} 0.0' in page


def _scheduler() -> Scheduler:
    config = parse_config("pool: {name: t, endpoints: ['10.0.0.1:8000', '10.0.0.1:8001', '10.0.0.2:8000']}\n"
                          "scheduler: {queueThreshold: 5}\n")
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, lambda: NOW)
    snapshot.update("10.0.0.1:8000", EndpointMetrics(waiting=50))
    snapshot.update("10.0.0.1:8001", EndpointMetrics(waiting=50))
    snapshot.update("10.0.0.2:8000", EndpointMetrics())
    return Scheduler(config, snapshot)


def test_the_legacy_admission_reads_the_requests_candidates() -> None:
    scheduler = _scheduler()
    assert scheduler.saturation() >= 1.0  # the whole pool: two of three endpoints full
    assert scheduler.pick(PickRequest("m", -1, subset=frozenset({"10.0.0.2"}))) == ["10.0.0.2:8000"]
    with pytest.raises(RequestError) as caught:
        scheduler.pick(PickRequest("m", -1, subset=frozenset({"10.0.0.1"})))
    assert (caught.value.status, caught.value.dropped_reason) == (429, "rejected-saturated")
    with pytest.raises(RequestError) as caught:
        scheduler.pick(PickRequest("m", -1))
    assert caught.value.status == 429


def test_a_hosts_every_port_is_in_its_subset() -> None:
    scheduler = _scheduler()
    picked = {scheduler.pick(PickRequest("m", 0, subset=frozenset({"10.0.0.1"})))[0] for _ in range(20)}
    assert picked <= {"10.0.0.1:8000", "10.0.0.1:8001"}
    with pytest.raises(RequestError) as caught:
        scheduler.pick(PickRequest("m", 0, subset=frozenset({"10.0.0.9"})))
    assert (caught.value.status, caught.value.dropped_reason) == (503, "rejected-no-endpoints")


@pytest.mark.parametrize(("entry", "host"), [
    ("10.0.1.0:8080", "10.0.1.0"), ("10.0.1.0", "10.0.1.0"), ("pod-a.ns:9000", "pod-a.ns"),
    ("[fd00::1]:8080", "fd00::1"), ("fd00::1", "fd00::1"), ("[fd00::1]", "fd00::1"), (":8080", ""),
])
def test_subset_host_examples(entry: str, host: str) -> None:
    assert subset_host(entry) == host


@given(st.one_of(st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str),
                 st.from_regex(r"[a-z][a-z0-9.-]{0,30}", fullmatch=True)),
       st.integers(1, 65535))
def test_an_endpoints_address_names_its_host(host: str, port: int) -> None:
    assert subset_host(Endpoint(host, port).address) == host
    if ":" not in host or ipaddress.ip_address(host).version == 6:
        assert subset_host(host) == host
