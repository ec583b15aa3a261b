"""Flow control, sans-IO: the config section, the queue's capacity, TTL, policies and detectors,
and a request that parks its ext_proc stream (processor and wire) until dispatched."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.wrappers_pb2 import BytesValue
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._grpc.server_wire import SyncBidiMethod
from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.engine_metrics import EndpointMetrics
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.flow_control.config import (
    BandConfig,
    ConcurrencyDetector,
    FlowControlConfig,
    UtilizationDetector,
    go_duration,
    quantity,
)
from evergreen_trio.picker.flow_control.detectors import concurrency, utilization
from evergreen_trio.picker.flow_control.queue import FlowQueue, Outcome, QueueItem
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.processor import DESTINATION, Picker
from evergreen_trio.picker.scheduler import PoolSnapshot
from tests.picker.test_grpc_wire import PATH, Peer
from tests.picker.test_processor import (
    A,
    B,
    C,
    make_picker,
    request_body,
    request_headers,
    response_body,
    response_headers,
    set_headers,
)

HEADER = "apiVersion: llm-d.ai/v1alpha1"


def epp(section: str = "", plugins: str = "", gates: str = "[flowControl]") -> str:
    return f"""pool: {{name: t, endpoints: ['{A}', '{B}', '{C}']}}
---
{HEADER}
kind: EndpointPickerConfig
featureGates: {gates}
plugins:
- type: queue-scorer
{plugins}
flowControl:
{section or "  {}"}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- config ----------------------------------------------------------------------------------------


def test_section_loads_with_llm_d_defaults() -> None:
    config = parse_config(epp("""  maxBytes: 1Gi
  maxRequests: 2k
  defaultRequestTTL: 1m30s
  priorityBands:
  - {priority: 10, maxRequests: 100, orderingPolicyRef: edf, fairnessPolicyRef: round-robin-fairness-policy}
  - {priority: -1, maxBytes: 0}
  defaultNegativePriorityBand: {maxRequests: 7}
  saturationDetector: {pluginRef: cd}""", """- {type: edf-ordering-policy, name: edf}
- {type: concurrency-detector, name: cd, parameters: {maxConcurrency: 8, concurrencyMode: hybrid}}"""))
    flow = config.flow_control
    assert flow is not None
    assert (flow.max_bytes, flow.max_requests, flow.ttl_s, flow.no_endpoint_ttl_s) == (2**30, 2000, 90.0, 90.0)
    assert flow.band(10) == BandConfig(10, 1_000_000_000, 100, "round-robin-fairness-policy", "edf-ordering-policy")
    assert flow.band(-1).max_bytes == 1_000_000_000 and flow.band(-1).max_requests == 5000
    assert flow.band(-5).max_requests == 7 and flow.band(3) == BandConfig(3)
    assert flow.detector == ConcurrencyDetector("hybrid", 8, 1_000_000, 0.0)
    default = parse_config(epp()).flow_control
    assert default == FlowControlConfig() and default.detector == UtilizationDetector(5, 0.8, 0.2, 0.0)
    assert parse_config(epp(gates="['flowControl=false']")).flow_control is None
    assert parse_config(epp(gates="[]")).flow_control is None
    assert parse_config(epp("  defaultRequestTTL: 0s\n  noEndpointRequestTTL: 5m")).flow_control == FlowControlConfig(
        ttl_s=0.0, no_endpoint_ttl_s=300.0)


@pytest.mark.parametrize(("section", "plugins", "field"), [
    ("  maxBytes: lots", "", "flowControl.maxBytes"),
    ("  maxRequests: -1", "", "flowControl.maxRequests"),
    ("  defaultRequestTTL: 60", "", "flowControl.defaultRequestTTL"),
    ("  noEndpointRequestTTL: 5 minutes", "", "flowControl.noEndpointRequestTTL"),
    ("  priorityBands: {priority: 1}", "", "flowControl.priorityBands"),
    ("  priorityBands: [{maxRequests: 1}]", "", "flowControl.priorityBands[0].priority"),
    ("  priorityBands: [{priority: 1}, {priority: 1}]", "", "flowControl.priorityBands[1].priority"),
    ("  priorityBands: [{priority: 1, maxRequest: 1}]", "", "flowControl.priorityBands[0].maxRequest"),
    ("  priorityBands: [{priority: 1, fairnessPolicyRef: fcfs-ordering-policy}]", "",
     "flowControl.priorityBands[0].fairnessPolicyRef"),
    ("  priorityBands: [{priority: 1, orderingPolicyRef: nope}]", "", "flowControl.priorityBands[0].orderingPolicyRef"),
    ("  defaultPriorityBand: {priority: 3}", "", "flowControl.defaultPriorityBand.priority"),
    ("  defaultNegativePriorityBand: {maxBytes: 1x}", "", "flowControl.defaultNegativePriorityBand.maxBytes"),
    ("  saturationDetector: {pluginRef: missing}", "", "flowControl.saturationDetector.pluginRef"),
    ("  saturationDetector: {queueDepthThreshold: 5}", "", "flowControl.saturationDetector.queueDepthThreshold"),
    ("  usageLimitPolicyPluginRef: soft-reflective-ceiling-policy", "", "flowControl.usageLimitPolicyPluginRef"),
    ("  enableEviction: sometimes", "", "flowControl.enableEviction"),
    ("  maxQueue: 3", "", "flowControl.maxQueue"),
    ("", "- {type: utilization-detector, parameters: {queueDepthThreshold: 0}}",
     "EndpointPickerConfig.plugins[1].parameters.queueDepthThreshold"),
    ("", "- {type: utilization-detector, parameters: {kvCacheUtilThreshold: 1.5}}",
     "EndpointPickerConfig.plugins[1].parameters.kvCacheUtilThreshold"),
    ("", "- {type: utilization-detector, parameters: {metricsStalenessThreshold: 0s}}",
     "EndpointPickerConfig.plugins[1].parameters.metricsStalenessThreshold"),
    ("", "- {type: utilization-detector, parameters: {headroom: -0.1}}",
     "EndpointPickerConfig.plugins[1].parameters.headroom"),
    ("", "- {type: utilization-detector, parameters: {queueDepth: 3}}",
     "EndpointPickerConfig.plugins[1].parameters.queueDepth"),
    ("", "- {type: concurrency-detector, parameters: {concurrencyMode: bytes}}",
     "EndpointPickerConfig.plugins[1].parameters.concurrencyMode"),
    ("", "- {type: concurrency-detector, parameters: {maxConcurrency: 0}}",
     "EndpointPickerConfig.plugins[1].parameters.maxConcurrency"),
    ("", "- {type: concurrency-detector, parameters: {maxTokenConcurrency: many}}",
     "EndpointPickerConfig.plugins[1].parameters.maxTokenConcurrency"),
    ("", "- {type: concurrency-detector, parameters: {headroom: lots}}",
     "EndpointPickerConfig.plugins[1].parameters.headroom"),
    ("", "- {type: concurrency-detector, parameters: {inFlightLoadProducerName: 3}}",
     "EndpointPickerConfig.plugins[1].parameters.inFlightLoadProducerName"),
    ("  priorityBands: [{priority: one}]", "", "flowControl.priorityBands[0].priority"),
    ("  priorityBands: [{priority: 1, maxRequests: many}]", "", "flowControl.priorityBands[0].maxRequests"),
    ("  defaultPriorityBand: {fairnessPolicyRef: 7}", "", "flowControl.defaultPriorityBand.fairnessPolicyRef"),
    ("  saturationDetector: {pluginRef: fcfs-ordering-policy}", "", "flowControl.saturationDetector.pluginRef"),
    ("", "- {type: fcfs-ordering-policy, parameters: {strict: true}}",
     "EndpointPickerConfig.plugins[1].parameters.strict"),
])
def test_bad_flow_control_config_names_the_field(section: str, plugins: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(epp(section, plugins))
    assert info.value.field == (field if field.startswith("EndpointPickerConfig.") else f"EndpointPickerConfig.{field}")


def test_bad_feature_gate_and_gate_off_still_validates() -> None:
    with pytest.raises(ConfigError, match=r"featureGates\[0\]"):
        parse_config(epp(gates="['flowControl=maybe']"))
    with pytest.raises(ConfigError, match="maxBytes"):
        parse_config(epp("  maxBytes: lots", gates="[]"))


def test_go_durations_and_quantities() -> None:
    assert [go_duration(v, "d") for v in ("60s", "1m30s", "200ms", "0s", "0", "1.5h")] == [60, 90, 0.2, 0, 0, 5400]
    assert go_duration("2562047h", "d") == 2562047 * 3600  # Go's longest duration is about 2562047.8h
    for bad in ("", "s", "10", "1m x", "-1s", 5, "2562048h", "9" * 400 + "s"):
        with pytest.raises(ConfigError):
            go_duration(bad, "d")
    assert [quantity(v, "q") for v in (0, 7, "100", "2k", "1Gi", "500M", "1.5Ki")] == [
        0, 7, 100, 2000, 2**30, 500_000_000, 1536]
    # A fraction rounds up, as Quantity.Value() (the reference's maxBytes); exactly: 0.3k is 300.
    assert [quantity(v, "q") for v in ("1.5", "0.1", "1.0001Ki", "0.3k", "1.10k")] == [2, 1, 1025, 300, 1100]
    for bad in (-1, "1x", "", True, 1.5, "k", "9" * 400, "9" * 400 + "Ei"):
        with pytest.raises(ConfigError):
            quantity(bad, "q")


# -- queue -----------------------------------------------------------------------------------------


def items(log: list[tuple[str, Outcome]], *specs: tuple[str, str, int, int]) -> list[QueueItem]:
    """(name, fairness id, priority, bytes) -> items that log their outcome."""
    made = []
    for name, flow, priority, size in specs:
        made.append(QueueItem(flow, priority, size, lambda outcome, name=name: log.append((name, outcome))))
    return made


def open_pool() -> float:
    return 0.0


def test_capacity_band_and_global_caps_are_real_caps() -> None:
    log: list[tuple[str, Outcome]] = []
    config = FlowControlConfig(max_requests=3, bands=(BandConfig(5, max_bytes=100, max_requests=2),))
    queue = FlowQueue(config, Clock())
    a, b, c, d, e = items(log, ("a", "f", 5, 60), ("b", "f", 5, 50), ("c", "g", 5, 10), ("d", "f", 0, 1),
                          ("e", "f", 1, 1))
    assert queue.enqueue(a) and not queue.enqueue(b)  # band bytes
    assert queue.enqueue(c) and queue.enqueue(d)
    assert not queue.enqueue(e)  # global requests
    assert log == [("b", Outcome.REJECTED_SATURATED), ("e", Outcome.REJECTED_SATURATED)]
    assert (queue.requests, queue.bytes) == (3, 71) and queue.stats() == {5: (2, 70), 0: (1, 1)}


def test_higher_priority_first_and_head_of_line_blocking() -> None:
    log: list[tuple[str, Outcome]] = []
    queue = FlowQueue(FlowControlConfig(), Clock())
    for item in items(log, ("low", "f", -1, 1), ("mid", "f", 0, 1), ("high", "g", 9, 1), ("mid2", "g", 0, 1)):
        queue.enqueue(item)
    readings = iter([0.5, 0.9, 1.0])
    assert queue.dispatch(lambda: next(readings)) == 2
    assert [name for name, _ in log] == ["high", "mid"]
    assert queue.dispatch(lambda: 1.2) == 0
    assert queue.dispatch(open_pool) == 2
    assert [name for name, _ in log] == ["high", "mid", "mid2", "low"]
    assert not queue.stats()


def test_round_robin_takes_flows_in_turn_global_strict_takes_the_oldest() -> None:
    for fairness, expected in (("round-robin-fairness-policy", ["a1", "b1", "c1", "a2", "b2", "a3"]),
                               ("global-strict-fairness-policy", ["a1", "a2", "a3", "b1", "b2", "c1"])):
        log: list[tuple[str, Outcome]] = []
        queue = FlowQueue(FlowControlConfig(default_band=BandConfig(fairness=fairness)), Clock())
        for item in items(log, ("a1", "a", 0, 1), ("a2", "a", 0, 1), ("a3", "a", 0, 1), ("b1", "b", 0, 1),
                          ("b2", "b", 0, 1), ("c1", "c", 0, 1)):
            queue.enqueue(item)
        queue.dispatch(open_pool)
        assert [name for name, _ in log] == expected


def test_edf_orders_heads_by_deadline_and_no_deadline_is_fcfs() -> None:
    clock = Clock()
    for ttl in (30.0, 0.0):
        log: list[tuple[str, Outcome]] = []
        queue = FlowQueue(FlowControlConfig(ttl_s=ttl, default_band=BandConfig(ordering="edf-ordering-policy")), clock)
        for item in items(log, ("first", "b", 0, 1), ("second", "a", 0, 1)):
            queue.enqueue(item)
            clock.now += 1
        queue.dispatch(open_pool)
        assert [name for name, _ in log] == ["first", "second"]


def test_ttl_429_with_endpoints_503_without_and_regime_change_restarts_the_budget() -> None:
    clock = Clock()
    log: list[tuple[str, Outcome]] = []
    queue = FlowQueue(FlowControlConfig(ttl_s=10.0, no_endpoint_ttl_s=30.0), clock)
    first, second, third = items(log, ("1", "f", 0, 1), ("2", "f", 0, 1), ("3", "f", 0, 1))
    queue.enqueue(first)
    clock.now += 5
    queue.enqueue(second)
    assert queue.next_deadline() == 110.0
    clock.now = 110.0
    assert queue.expire() == 1 and log == [("1", Outcome.EVICTED_TTL)]
    queue.set_pool_empty(True)  # a fresh 30 s budget from now
    assert queue.next_deadline() == 140.0
    clock.now = 139.0
    assert queue.expire() == 0
    clock.now = 140.0
    assert queue.expire() == 1 and log[-1] == ("2", Outcome.EVICTED_NO_ENDPOINTS)
    queue.enqueue(third)
    queue.set_pool_empty(False)
    assert queue.next_deadline() == 150.0
    off = FlowQueue(FlowControlConfig(ttl_s=0.0, no_endpoint_ttl_s=0.0), clock)
    off.enqueue(items(log, ("4", "f", 0, 1))[0])
    assert off.next_deadline() == math.inf


def test_cancel_and_shutdown() -> None:
    log: list[tuple[str, Outcome]] = []
    queue = FlowQueue(FlowControlConfig(), Clock())
    a, b, c = items(log, ("a", "f", 0, 1), ("b", "f", 0, 1), ("c", "f", 0, 1))
    queue.enqueue(a)
    queue.enqueue(b)
    queue.cancel(a)
    queue.cancel(a)  # once
    queue.shutdown()
    assert not queue.enqueue(c)
    assert log == [("a", Outcome.CANCELLED), ("b", Outcome.SHUTTING_DOWN), ("c", Outcome.SHUTTING_DOWN)]
    assert (queue.requests, queue.bytes, queue.stats()) == (0, 0, {})


@given(st.lists(st.tuples(st.sampled_from("eecdxt"), st.integers(-2, 2), st.sampled_from("abc"),
                          st.integers(0, 50)), max_size=60))
def test_every_request_gets_exactly_one_outcome_and_caps_hold(steps: list[tuple[str, int, str, int]]) -> None:
    clock = Clock()
    outcomes: dict[int, list[Outcome]] = {}
    config = FlowControlConfig(max_bytes=120, ttl_s=5.0, default_band=BandConfig(max_requests=4, max_bytes=100,
                                                                                  fairness="round-robin-fairness-policy"))
    queue = FlowQueue(config, clock)
    queued: list[QueueItem] = []
    for action, priority, flow, size in steps:
        if action == "e":
            key = len(outcomes)
            outcomes[key] = []
            item = QueueItem(flow, priority, size, outcomes[key].append)
            if queue.enqueue(item):
                queued.append(item)
        elif action == "c" and queued:
            queue.cancel(queued[size % len(queued)])
        elif action == "d":
            queue.dispatch(lambda: 0.0, limit=size % 3)
        elif action == "x":
            clock.now += size / 10
            queue.expire()
        else:
            queue.set_pool_empty(size % 2 == 0)
        assert queue.bytes <= 120 and all(r <= 4 and b <= 100 for r, b in queue.stats().values())
        assert queue.requests == sum(1 for o in outcomes.values() if not o)
    queue.shutdown()
    assert all(len(o) == 1 for o in outcomes.values())
    assert (queue.requests, queue.bytes) == (0, 0)


# -- detectors -------------------------------------------------------------------------------------


def test_utilization_is_fail_closed_and_concurrency_counts_in_flight() -> None:
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}', '{B}']}}")
    clock = Clock()
    snapshot = PoolSnapshot(config.pool.endpoints, 2.0, clock)
    states = list(snapshot.states.values())
    detector = UtilizationDetector()
    assert utilization(detector, states, clock.now) == (1.0, 2)  # never scraped: both stale
    snapshot.update(A, EndpointMetrics(waiting=5, kv_usage=0.1))
    snapshot.update(B, EndpointMetrics(waiting=0, kv_usage=0.4))
    assert utilization(detector, states, clock.now) == pytest.approx((0.75, 0))
    clock.now += 0.3  # past 200 ms: stale
    assert utilization(detector, states, clock.now) == (1.0, 2)
    assert utilization(detector, [], clock.now) == (1.0, 0)
    load = InflightLoad()
    for _ in range(3):
        load.dispatch(A, 100)
    assert concurrency(ConcurrencyDetector(max_concurrency=2), states, load).saturation == 0.75
    assert concurrency(ConcurrencyDetector(mode="tokens", max_token_concurrency=300), states, load).saturation == 0.5
    assert concurrency(ConcurrencyDetector(mode="hybrid", max_concurrency=2, max_token_concurrency=1000),
                       states, load).saturation == 0.75


# -- processor -------------------------------------------------------------------------------------


def flow_picker(section: str = "", plugins: str = "") -> Picker:
    return make_picker("---" + epp(section, plugins).split("---", 1)[1], metrics=[EndpointMetrics()] * 3)


def concurrency_picker(section: str = "", max_concurrency: int = 1) -> Picker:
    return flow_picker("  saturationDetector: {pluginRef: concurrency-detector}\n" + section,
                       f"- {{type: concurrency-detector, parameters: {{maxConcurrency: {max_concurrency}}}}}")


def start(picker: Picker, body: dict[str, object] | None = None,
          extra: tuple[tuple[str, str], ...] = ()) -> tuple[object, list[ep.ProcessingResponse]]:
    stream = picker.new_stream()
    stream.on_message(request_headers(extra=extra))
    replies = stream.on_message(request_body(json.dumps(body or {"model": "plain", "prompt": "hi"}).encode()))
    return stream, list(replies)


def dropped(replies: list[ep.ProcessingResponse]) -> tuple[int, str]:
    (reply,) = replies
    headers = {o.header.key: o.header.raw_value.decode() for o in reply.immediate_response.headers.set_headers}
    return reply.immediate_response.status.code, headers.get("x-llm-d-request-dropped-reason", "")


def test_unsaturated_pool_dispatches_at_once_then_requests_park_until_capacity_frees() -> None:
    picker = concurrency_picker()  # 3 endpoints x 1 request
    assert picker.flow is not None
    streams = [start(picker) for _ in range(5)]
    assert [bool(replies) for _, replies in streams] == [True, True, True, False, False]
    parked = [stream for stream, _ in streams[3:]]
    assert all(s.parked for s in parked)  # type: ignore[attr-defined]
    woken: list[int] = []
    parked[0].on_unpark = lambda: woken.append(0)  # type: ignore[attr-defined]
    first = streams[0][0]
    first.on_message(response_headers())  # type: ignore[attr-defined]
    first.on_message(response_body(b"{}", end=True))  # type: ignore[attr-defined]
    picker.flow.poll()
    assert woken == [0] and not parked[0].parked  # type: ignore[attr-defined]
    (decision, *_) = parked[0].resume()  # type: ignore[attr-defined]
    assert set_headers(decision.request_headers.response.header_mutation)[DESTINATION] in (A, B, C)
    assert parked[1].parked  # type: ignore[attr-defined]


def test_band_full_is_429_rejected_saturated_and_ttl_expiry_429_then_503_without_endpoints() -> None:
    picker = concurrency_picker("  defaultPriorityBand: {maxRequests: 1}\n  defaultRequestTTL: 10s")
    assert picker.flow is not None
    for _ in range(3):
        start(picker)
    waiting, _ = start(picker)
    _, replies = start(picker)
    assert dropped(replies) == (429, "rejected-saturated")
    picker.snapshot.clock = lambda: 1000.0  # type: ignore[method-assign]
    picker.flow.queue.clock = picker.snapshot.clock
    picker.flow.poll()
    assert dropped(list(waiting.resume())) == (429, "rejected-ttl-expired")  # type: ignore[attr-defined]
    assert waiting.finished and waiting.report.error == 429  # type: ignore[attr-defined]
    empty = concurrency_picker("  defaultRequestTTL: 10s")
    assert empty.flow is not None
    empty.snapshot.set_endpoints(())
    stream, replies = start(empty)
    assert replies == []
    empty.flow.queue.clock = lambda: 1000.0
    empty.flow.poll()
    assert dropped(list(stream.resume())) == (503, "rejected-no-endpoints")  # type: ignore[attr-defined]


def test_client_gone_leaves_the_queue_and_shutdown_is_503() -> None:
    picker = concurrency_picker()
    assert picker.flow is not None
    for _ in range(3):
        start(picker)
    gone, _ = start(picker)
    staying, _ = start(picker)
    gone.on_abort()  # type: ignore[attr-defined]
    assert gone.item.outcome is Outcome.CANCELLED and len(picker.flow.queue) == 1  # type: ignore[attr-defined]
    picker.flow.queue.shutdown()
    assert dropped(list(staying.resume())) == (503, "rejected-shutting-down")  # type: ignore[attr-defined]


def test_flow_key_headers_and_their_bad_values() -> None:
    picker = make_picker("objectives: [{name: urgent, priority: 5}]\n---" + epp().split("---", 1)[1],
                         metrics=[EndpointMetrics()] * 3)
    seen: list[QueueItem] = []
    assert picker.flow is not None
    submit: Callable[[QueueItem], None] = picker.flow.submit
    picker.flow.submit = lambda item: (seen.append(item), submit(item))[1]  # type: ignore[method-assign]
    start(picker, extra=(("x-llm-d-inference-fairness-id", "tenant-a"), ("x-llm-d-inference-objective", "urgent")))
    start(picker, extra=(("x-gateway-inference-fairness-id", "tenant-b"), ("x-gateway-inference-objective", "urgent")))
    start(picker)
    assert [(i.fairness_id, i.priority) for i in seen] == [("tenant-a", 5), ("tenant-b", 5), ("default-flow", 0)]
    for bad in ("x" * 257, "two words", "caf\u00e9"):
        for header in ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"):
            _, replies = start(picker, extra=((header, bad),))
            assert replies[0].immediate_response.status.code == 400
    seen.clear()
    for unknown in ("no-such-objective", "", "x" * 5000):  # an unknown objective sets no priority
        start(picker, extra=(("x-llm-d-inference-objective", unknown), ("x-llm-d-inference-fairness-id", " ")))
    assert [(i.fairness_id, i.priority) for i in seen] == [("default-flow", 0)] * 3


def test_objectives_from_files_in_both_groups() -> None:
    config = parse_config(f"""pool: {{name: pool, endpoints: ['{A}']}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {{name: critical}}
spec: {{priority: 10, poolRef: {{group: inference.networking.k8s.io, name: pool}}}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {{name: batch}}
spec: {{priority: -1, poolRef: {{name: pool}}}}
---
apiVersion: llm-d.ai/v1alpha2
kind: InferenceObjective
metadata: {{name: elsewhere}}
spec: {{priority: 3, poolRef: {{name: other-pool}}}}
""")
    assert dict(config.objectives) == {"critical": 10, "batch": -1}
    with pytest.raises(ConfigError, match="priority"):
        parse_config(f"pool: {{name: pool, endpoints: ['{A}']}}\n---\napiVersion: llm-d.ai/v1alpha2\n"
                     "kind: InferenceObjective\nmetadata: {name: x}\nspec: {priority: high}\n")


async def test_the_shell_polls_each_interval_and_after_scrapes_and_sheds_on_shutdown(
        autojump_clock: object) -> None:
    import trio
    import trio.testing

    from evergreen_trio.picker.runtime import _flow_control

    picker = concurrency_picker()
    gate = picker.flow
    assert gate is not None
    gate.queue.clock = trio.current_time
    for _ in range(3):
        start(picker)
    waiting, _ = start(picker)
    polls: list[float] = []
    poll = gate.poll
    gate.poll = lambda: (polls.append(trio.current_time()), poll())[1]  # type: ignore[method-assign]
    wake = [trio.Event()]

    def new_wake() -> trio.Event:
        wake[0] = trio.Event()
        return wake[0]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_flow_control, gate, 0.05, wake[0], new_wake)
        await trio.sleep(0.5)
        assert 9 <= len(polls) <= 11  # one per scrape interval
        counters = picker.scheduler.inflight._counters
        for counter in counters.values():
            counter.requests = 0  # the pool's requests finished (as if their streams ended)
        wake[0].set()  # a scrape
        await trio.testing.wait_all_tasks_blocked()
        assert waiting.item.outcome is Outcome.DISPATCHED  # type: ignore[attr-defined]
        for address in (A, B, C):
            picker.scheduler.inflight.dispatch(address, 0)  # the pool is full again
        last, replies = start(picker)
        assert not replies
        nursery.cancel_scope.cancel()
    assert dropped(list(last.resume())) == (503, "rejected-shutting-down")  # type: ignore[attr-defined]
    assert gate.queue.closed and len(gate.queue) == 0


async def test_the_shell_waits_for_a_queued_deadline_on_the_queues_own_clock() -> None:
    """The queue's deadlines are on the pool snapshot's clock, Trio's is another (it starts at a
    random offset): a queued request with a budget made the shell poll without waiting at all."""
    import trio

    from evergreen_trio.picker.runtime import _flow_control

    picker = concurrency_picker()
    gate = picker.flow
    assert gate is not None
    for _ in range(4):
        start(picker)  # three fill the pool, the fourth waits with the default budget
    assert len(gate.queue) == 1 and gate.next_deadline() < math.inf
    polls = [0]
    poll = gate.poll
    gate.poll = lambda: (polls.__setitem__(0, polls[0] + 1), poll())[1]  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_flow_control, gate, 0.05, trio.Event(), trio.Event)
        await trio.sleep(0.3)
        nursery.cancel_scope.cancel()
    assert polls[0] <= 20  # one per interval (about 6); it was thousands


# -- wire ------------------------------------------------------------------------------------------


class Parking:
    """Parks on b"wait" until :meth:`release`; echoes everything else; counts aborts."""

    instances: list[Parking] = []

    def __init__(self) -> None:
        self.finished = False
        self.parked = False
        self.on_unpark: Callable[[], None] | None = None
        self.aborted = 0
        self.ended = False
        Parking.instances.append(self)

    def on_message(self, message: BytesValue) -> list[BytesValue]:
        if message.value == b"wait":
            self.parked = True
            return []
        return [message]

    def release(self) -> None:
        self.parked = False
        assert self.on_unpark is not None
        self.on_unpark()

    def resume(self) -> list[BytesValue]:
        return [BytesValue(value=b"dispatched")]

    def on_end(self) -> list[BytesValue]:
        self.ended = True
        return [BytesValue(value=b"end")]

    def on_abort(self) -> None:
        self.aborted += 1


def parking_peer(monkeypatch: pytest.MonkeyPatch) -> tuple[Peer, list[int]]:
    monkeypatch.setattr(Parking, "instances", [])
    peer = Peer()
    peer.server.methods = {PATH: SyncBidiMethod(PATH, BytesValue, Parking)}
    wakes: list[int] = []
    peer.server.on_wake = lambda: wakes.append(1)
    return peer, wakes


def test_parked_stream_holds_its_input_until_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    peer, wakes = parking_peer(monkeypatch)
    stream = peer.open()
    peer.send(stream, b"wait", b"after", end=True)
    assert peer.replies(stream) == [] and not peer.server.has_unparked
    (processor,) = Parking.instances
    processor.release()
    assert wakes == [1] and peer.server.has_unparked
    peer.server.resume_unparked()
    peer.pump()
    assert peer.replies(stream) == [b"dispatched", b"after", b"end"]
    assert peer.trailers(stream)["grpc-status"] == "0" and processor.aborted == 0


def test_a_parked_stream_reset_or_its_connection_lost_is_aborted_once(monkeypatch: pytest.MonkeyPatch) -> None:
    peer, _ = parking_peer(monkeypatch)
    reset, lost = peer.open(), peer.open()
    peer.send(reset, b"wait")
    peer.send(lost, b"wait")
    first, second = Parking.instances
    peer.client.reset_stream(reset)
    peer.pump()
    assert first.aborted == 1
    first.release()  # its outcome came anyway: nothing is sent on a gone stream
    peer.server.resume_unparked()
    peer.server.abort_streams()
    assert (first.aborted, second.aborted) == (1, 1)


def test_gateway_message_timeout_covers_the_queue_wait() -> None:
    from evergreen_trio.picker.envoy_config import gateway_config
    from evergreen_trio.picker.flow_control.config import queue_wait

    def timeout(**options: object) -> str:
        config = gateway_config("127.0.0.1:9002", 8080, admin_port=9901, **options)  # type: ignore[arg-type]
        (listener,) = config["static_resources"]["listeners"]
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        return str(next(f for f in filters if f["name"] == "envoy.filters.http.ext_proc")["typed_config"][
            "message_timeout"])

    assert timeout() == "5.0s"
    assert timeout(queue_wait_s=60.0) == "65.0s" and timeout(queue_wait_s=0.0) == "3600.0s"
    assert timeout(queue_wait_s=3595.0) == timeout(queue_wait_s=7200.0) == "3600.0s"  # Envoy's largest
    with pytest.raises(ValueError, match="queue wait"):
        timeout(queue_wait_s=-1.0)
    assert queue_wait(None) is None and queue_wait(FlowControlConfig()) == 60.0
    assert queue_wait(FlowControlConfig(ttl_s=10.0, no_endpoint_ttl_s=300.0)) == 300.0
    assert queue_wait(FlowControlConfig(ttl_s=0.0)) == 0.0


def test_the_docs_flow_control_example_loads() -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "picker.md").read_text()
    (example,) = [b for b in re.findall(r"^```yaml\n(.*?)^```", doc, re.M | re.S) if "featureGates: [flowControl]" in b]
    config = parse_config(f"pool: {{name: t, endpoints: ['{A}']}}\n---\n{example}")
    assert config.flow_control is not None and config.flow_control.band(10).ordering == "edf-ordering-policy"
    assert config.flow_control.detector == ConcurrencyDetector(max_concurrency=8)


def test_a_sheddable_request_queues_instead_of_the_legacy_429() -> None:
    picker = make_picker("---" + epp().split("---", 1)[1], metrics=[EndpointMetrics(waiting=10)] * 3)
    assert picker.flow is not None and picker.scheduler.saturation() >= 1.0
    stream, replies = start(picker, {"model": "batch", "prompt": "later"})
    assert replies == [] and stream.item.priority == -1  # type: ignore[attr-defined]
    for address in (A, B, C):
        picker.snapshot.update(address, EndpointMetrics(waiting=9))  # still saturated for the legacy check
    picker.flow.config = picker.flow.queue.config = FlowControlConfig(
        detector=UtilizationDetector(queue_depth_threshold=100))
    picker.flow.poll()
    (decision, *_) = stream.resume()  # type: ignore[attr-defined]
    assert decision.HasField("request_headers")


def test_gateway_config_queue_wait_as_a_subprocess() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "evergreen_trio.cli", "gateway-config", "--queue-wait", "1m30s",
                           "--request-body-mode", "BUFFERED"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert '"message_timeout": "95.0s"' in done.stdout
