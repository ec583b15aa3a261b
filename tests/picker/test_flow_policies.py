"""Flow control's reference policies beyond FCFS/EDF and round robin/global strict, each with the
reference's tests ported, its config, its place in the queue and in the ext_proc stream:
``program-aware-fairness``, ``slo-deadline-ordering-policy`` and the usage-limit policies
(``static-usage-limit-policy``'s threshold, ``priority-holdback-policy``,
``soft-reflective-ceiling-policy``)."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from evergreen_trio.picker.config import load_config, parse_config
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.flow_control.config import BandConfig, FlowControlConfig
from evergreen_trio.picker.flow_control.gate import FlowGate
from evergreen_trio.picker.flow_control.program_aware import (
    MAX_PROGRAMS,
    PROGRAM_AWARE,
    ProgramAware,
    ProgramAwareParams,
)
from evergreen_trio.picker.flow_control.queue import DISPATCH_TICK_S, FlowQueue, Outcome, QueueItem
from evergreen_trio.picker.flow_control.slo_deadline import MAX_TTFT_MS, SLO_DEADLINE, rank, ttft_slo_ms
from evergreen_trio.picker.flow_control.usage_limits import (
    DOMAINS,
    USAGE_LIMIT_POLICIES,
    PriorityHoldback,
    SoftReflectiveCeiling,
    StaticUsageLimit,
    UsageLimit,
    UsageLimitParams,
    _go_round,
)
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.plugins import PLUGIN_TYPES
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage
from tests.picker.test_flow_control import Clock, epp, flow_picker, start
from tests.picker.test_processor import make_picker, request_body, request_headers, response_body, response_headers

FIXTURES = Path(__file__).parent / "fixtures" / "llm-d-router"


def program_aware(**changes: float) -> ProgramAware:
    return ProgramAware(ProgramAwareParams(**changes), 0.0, random.Random(1))


# -- program-aware-fairness: config ---------------------------------------------------------------


def test_program_aware_is_implemented_and_the_reference_sample_loads() -> None:
    flow = load_config(FIXTURES / "sim-program-aware-config.yaml", cluster_pool="pool").flow_control
    assert flow is not None and flow.programs == ((PROGRAM_AWARE, ProgramAwareParams()),)
    assert flow.default_band.fairness == PROGRAM_AWARE and flow.default_band.fairness_name == PROGRAM_AWARE
    assert flow.band(7).fairness_name == PROGRAM_AWARE  # bands made from the template share the plugin


def test_program_aware_parameters_and_shared_instances() -> None:
    flow = parse_config(epp("""  priorityBands:
  - {priority: 1, fairnessPolicyRef: fair}
  - {priority: 2, fairnessPolicyRef: fair}
  - {priority: 3, fairnessPolicyRef: other}""", """- type: program-aware-fairness
  name: fair
  parameters: {strategy: las, lasWeightService: 0.7, lasWeightHeadWait: 0.3, lasHalfLifeSeconds: 0,
               evictionTtlSeconds: 0, evictionSweepSeconds: 1}
- {type: program-aware-fairness, name: other, parameters: {strategy: ''}}
- {type: program-aware-fairness, name: unused}""")).flow_control
    assert flow is not None
    assert dict(flow.programs) == {"fair": ProgramAwareParams(0.0, 1.0, 0.7, 0.3, 0.0), "other": ProgramAwareParams(),
                                   "unused": ProgramAwareParams()}
    assert [flow.band(p).fairness_name for p in (1, 2, 3, 0)] == ["fair", "fair", "other", None]
    queue = FlowQueue(flow, Clock())
    assert sorted(queue.programs) == ["fair", "other", "unused"]


@pytest.mark.parametrize(("parameters", "field"), [
    ("{strategy: wfq}", "strategy"),
    ("{evictionTtlSeconds: -1}", "evictionTtlSeconds"),
    ("{evictionSweepSeconds: 0}", "evictionSweepSeconds"),
    ("{lasWeightService: -0.1}", "lasWeightService"),
    ("{lasWeightHeadWait: .nan}", "lasWeightHeadWait"),
    ("{lasHalfLifeSeconds: -1}", "lasHalfLifeSeconds"),
    ("{lasDecayFactor: 0.99997}", "lasDecayFactor"),
    ("{lasWeightService: high}", "lasWeightService"),
])
def test_bad_program_aware_parameter_names_the_field(parameters: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(epp("", f"- {{type: program-aware-fairness, parameters: {parameters}}}"))
    assert info.value.field == f"EndpointPickerConfig.plugins[1].parameters.{field}"


def test_program_aware_must_be_declared_to_be_referenced() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(epp("  defaultPriorityBand: {fairnessPolicyRef: program-aware-fairness}"))
    assert info.value.field == "EndpointPickerConfig.flowControl.defaultPriorityBand.fairnessPolicyRef"


# -- program-aware-fairness: the reference's tests -------------------------------------------------


def test_pick_nothing_from_no_flows() -> None:
    assert program_aware().pick({}, 0.0) is None


def test_las_prefers_lower_service_and_cold_start_uses_head_wait() -> None:
    policy = program_aware(weight_service=1.0, weight_head_wait=0.0, half_life_s=0.0)
    policy.completed("alpha", Usage(1000, 0), 0.0)
    policy.completed("beta", Usage(10, 0), 0.0)
    assert policy.pick({"alpha": 0.0, "beta": 0.0}, 0.0) == "beta"
    cold = program_aware(weight_service=1.0, weight_head_wait=1.0)
    assert cold.pick({"alpha": 9.5, "beta": 9.95}, 10.0) == "alpha"


def test_an_idle_program_service_decays_without_being_visited() -> None:
    policy = program_aware(weight_service=1.0, weight_head_wait=0.0, half_life_s=1.0)
    heavy = policy.program("heavy", 0.0)
    heavy.service, heavy.decayed_at = 1000.0, 0.0
    light = policy.program("light", 10.0)
    light.service, light.decayed_at = 10.0, 10.0
    assert policy.pick({"heavy": 10.0, "light": 10.0}, 10.0) == "heavy"  # 1000 / 2**10 < 10
    assert policy.programs["heavy"].service == pytest.approx(1000 / 1024)


def test_completion_adds_prompt_plus_twice_completion_after_pending_decay() -> None:
    policy = program_aware(half_life_s=1.0)
    policy.completed("alpha", Usage(100, 50), 5.0)
    assert policy.service(policy.programs["alpha"], 5.0) == 200.0
    policy.completed("alpha", None, 6.0)  # no usage learned: no tokens, the decay still applies
    assert policy.programs["alpha"].service == 100.0
    policy.completed("alpha", Usage(None, 5), 7.0)
    assert policy.programs["alpha"].service == 60.0  # 100 halves to 50 before the +10 lands
    flat = program_aware(half_life_s=0.0)
    flat.completed("alpha", Usage(100, 0), 0.0)
    assert flat.service(flat.programs["alpha"], 3600.0) == 100.0


def test_dispatch_counts_and_the_mean_wait_of_picked_requests() -> None:
    policy = program_aware()
    policy.dispatched("alpha", 0.95, 1.0)
    policy.dispatched("alpha", 0.85, 1.0)
    policy.dispatched("alpha", None, 1.0)  # not chosen by a program-aware pick: no wait observed
    alpha = policy.programs["alpha"]
    assert (alpha.in_flight, alpha.dispatched, alpha.wait_count) == (3, 3, 2)
    assert alpha.mean_wait_ms == pytest.approx(100.0, abs=1)
    policy.completed("alpha", None, 2.0)
    assert (alpha.in_flight, alpha.last_completion) == (2, 2.0)


def test_programs_are_bounded_the_least_recently_active_idle_one_first() -> None:
    """A flood of new program ids keeps MAX_PROGRAMS; one in flight is never dropped (its counts)."""
    policy = program_aware()
    policy.dispatched("busy", None, 0.0)  # in flight, and the oldest
    policy.program("old", 0.0)
    policy.program("active", 0.0)
    for i in range(MAX_PROGRAMS + 100):
        policy.program(f"flood-{i}", 1.0)
        if i == 10:
            policy.completed("active", None, 1.0)  # activity: now among the most recent
    assert len(policy.programs) == MAX_PROGRAMS
    assert "busy" in policy.programs and "old" not in policy.programs and "flood-0" not in policy.programs
    assert "active" in policy.programs and f"flood-{MAX_PROGRAMS + 99}" in policy.programs
    policy.completed("busy", None, 2.0)
    assert policy.programs["busy"].in_flight == 0


def test_idle_programs_are_forgotten_on_the_sweep_schedule() -> None:
    policy = program_aware(eviction_ttl_s=1.0, eviction_sweep_s=10.0)
    policy.program("never-completed", 0.0)
    policy.dispatched("in-flight", None, 0.0)
    policy.dispatched("recent", None, 0.0)
    policy.completed("recent", None, 9.5)
    policy.program("probe", 9.9)
    assert sorted(policy.programs) == ["in-flight", "never-completed", "probe", "recent"]  # no sweep before 10 s
    policy.program("probe", 10.2)  # the sweep at 10 s: idle for more than 1 s and nothing in flight
    assert sorted(policy.programs) == ["in-flight", "probe", "recent"]
    policy.program("probe", 25.0)  # the one at 20 s
    assert sorted(policy.programs) == ["in-flight", "probe"]
    kept = program_aware(eviction_ttl_s=0.0, eviction_sweep_s=1.0)
    kept.program("alpha", 0.0)
    kept.program("beta", 1e6)
    assert sorted(kept.programs) == ["alpha", "beta"]


def test_a_forgotten_program_starts_again_from_zero_service() -> None:
    policy = program_aware(half_life_s=0.0, eviction_ttl_s=1.0, eviction_sweep_s=1.0)
    policy.dispatched("alpha", None, 0.0)
    policy.completed("alpha", Usage(100, 0), 0.0)
    assert policy.service(policy.program("alpha", 5.0), 5.0) == 0.0
    policy.completed("beta", Usage(100, 0), 0.0)  # a completion never dispatched: in flight -1, kept (as llm-d)
    assert policy.program("beta", 50.0).in_flight == -1


def test_ties_are_broken_at_random() -> None:
    policy = program_aware(weight_service=1.0, weight_head_wait=0.0)
    assert {policy.pick({"a": 0.0, "b": 0.0, "c": 0.0}, 0.0) for _ in range(60)} == {"a", "b", "c"}


# -- program-aware-fairness: in the queue ----------------------------------------------------------


def fair_queue(clock: Clock, **changes: float) -> FlowQueue:
    config = FlowControlConfig(default_band=BandConfig(fairness=PROGRAM_AWARE, fairness_name="fair"),
                               programs=(("fair", ProgramAwareParams(**changes)),))
    return FlowQueue(config, clock, random.Random(2))


def queued(queue: FlowQueue, log: list[str], name: str, flow: str) -> QueueItem:
    item = QueueItem(flow, 0, 1, lambda outcome: log.append(name))
    assert queue.enqueue(item)
    return item


def test_the_queue_serves_the_least_served_program_and_marks_its_pick() -> None:
    clock = Clock()
    queue = fair_queue(clock, weight_service=1.0, weight_head_wait=0.0)
    program = queue.programs["fair"]
    program.completed("heavy", Usage(500, 0), clock.now)
    log: list[str] = []
    heavy = queued(queue, log, "heavy", "heavy")
    light = queued(queue, log, "light", "light")
    assert queue.dispatch(lambda: 0.0, limit=1) == 1 and log == ["light"]
    assert light.program_picked and not heavy.program_picked
    other = FlowQueue(FlowControlConfig(programs=(("fair", ProgramAwareParams()),)), clock)
    item = queued(other, log, "strict", "x")
    other.dispatch(lambda: 0.0)
    assert not item.program_picked  # a global-strict band does not stash the enqueue time


@settings(max_examples=50)
@given(st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=6),
       st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.01, max_value=1.0))
def test_backlogged_programs_with_equal_costs_are_each_served_every_n_picks(
        backlogs: list[int], weight_wait: float, weight_service: float) -> None:
    clock = Clock()
    queue = fair_queue(clock, weight_service=weight_service, weight_head_wait=weight_wait, half_life_s=30.0)
    program = queue.programs["fair"]
    log: list[str] = []
    for depth in range(max(backlogs)):
        for i, backlog in enumerate(backlogs):
            if depth < backlog:
                queued(queue, log, f"p{i}", f"p{i}")
    left = {f"p{i}": backlog for i, backlog in enumerate(backlogs)}
    last_served = dict.fromkeys(left, -1)
    for step in range(sum(backlogs)):
        assert all(step - last_served[flow] <= len(backlogs) for flow, n in left.items() if n)
        clock.now += 0.001
        assert queue.dispatch(lambda: 0.0, limit=1) == 1
        last_served[log[-1]] = step
        left[log[-1]] -= 1
        program.dispatched(log[-1], None, clock.now)
        program.completed(log[-1], Usage(10, 5), clock.now)
    assert not len(queue) and sorted(log) == sorted(f"p{i}" for i, n in enumerate(backlogs) for _ in range(n))


# -- program-aware-fairness: the ext_proc stream's hooks -------------------------------------------


def test_streams_feed_the_program_aware_policy_dispatch_then_usage() -> None:
    picker = flow_picker("  defaultPriorityBand: {fairnessPolicyRef: program-aware-fairness}",
                         "- {type: program-aware-fairness, parameters: {lasHalfLifeSeconds: 0}}")
    assert picker.flow is not None
    program = picker.flow.queue.programs[PROGRAM_AWARE]
    stream, replies = start(picker, extra=(("x-llm-d-inference-fairness-id", "tenant-a"),))
    assert replies and stream.item.program_picked  # type: ignore[attr-defined]
    tenant = program.programs["tenant-a"]
    assert (tenant.in_flight, tenant.dispatched, tenant.wait_count) == (1, 1, 1)
    stream.on_message(response_headers())  # type: ignore[attr-defined]
    usage = {"usage": {"prompt_tokens": 7, "completion_tokens": 4}}
    stream.on_message(response_body(json.dumps(usage).encode()))  # type: ignore[attr-defined]
    assert (tenant.in_flight, tenant.service) == (0, 15.0)
    stream.on_abort()  # type: ignore[attr-defined]  # the stream's end after the response's: counted once
    assert (tenant.in_flight, tenant.service) == (0, 15.0)
    gone, _ = start(picker)
    gone.on_abort()  # type: ignore[attr-defined]  # a dispatched stream reset before its response
    default = program.programs["default-flow"]
    assert (default.in_flight, default.dispatched, default.service) == (0, 1, 0.0)


def test_a_request_that_fails_scheduling_is_not_counted() -> None:
    picker = flow_picker("  defaultPriorityBand: {fairnessPolicyRef: program-aware-fairness}",
                         "- {type: program-aware-fairness}")
    assert picker.flow is not None
    stream = picker.new_stream()
    stream.on_message(request_headers(subset=struct_pb2.Value(string_value="10.9.9.9:1")))
    (reply,) = stream.on_message(request_body(b'{"model": "plain", "prompt": "hi"}'))
    assert reply.immediate_response.status.code == 503 and stream.item is not None
    assert stream.item.outcome is Outcome.DISPATCHED and not stream.item.running
    entry = picker.flow.queue.programs[PROGRAM_AWARE].programs["default-flow"]  # seen by the pick
    assert (entry.dispatched, entry.in_flight) == (0, 0)
    stream.on_abort()
    assert entry.in_flight == 0


# -- slo-deadline-ordering-policy ------------------------------------------------------------------


@pytest.mark.parametrize(("headers", "expected"), [
    ({"x-llm-d-slo-ttft-ms": "200"}, 200),
    ({"x-slo-ttft-ms": "150"}, 150),
    ({"x-llm-d-slo-ttft-ms": "200", "x-slo-ttft-ms": "50"}, 200),
    ({"x-llm-d-slo-ttft-ms": "", "x-slo-ttft-ms": "50"}, None),  # the first present wins, even empty
    ({"x-llm-d-slo-ttft-ms": " 30\t"}, 30),
    ({"x-llm-d-slo-ttft-ms": "+30"}, 30),
    ({"x-llm-d-slo-ttft-ms": "-0"}, 0),
    ({"x-llm-d-slo-ttft-ms": "\xa030\x85"}, 30),
    ({"x-llm-d-slo-ttft-ms": "\x1c30"}, None),  # not Go whitespace
    ({"x-llm-d-slo-ttft-ms": "-1"}, None),
    ({"x-llm-d-slo-ttft-ms": "x"}, None),
    ({"x-llm-d-slo-ttft-ms": "1.5"}, None),
    ({"x-llm-d-slo-ttft-ms": "1_000"}, None),
    ({"x-llm-d-slo-ttft-ms": "\u0663"}, None),
    ({"x-llm-d-slo-ttft-ms": str(MAX_TTFT_MS)}, MAX_TTFT_MS),
    ({"x-llm-d-slo-ttft-ms": str(MAX_TTFT_MS + 1)}, None),
    ({"x-llm-d-slo-ttft-ms": str(2**63 - 1)}, None),  # would overflow Go's Duration
    ({"x-llm-d-slo-ttft-ms": str(2**64)}, None),
    ({"x-some-header": "200"}, None),
    ({}, None),
])
def test_ttft_slo_header(headers: dict[str, str], expected: int | None) -> None:
    assert ttft_slo_ms(headers) == expected


def test_slo_ranks_as_the_reference_less() -> None:
    now = 1000.0

    def slo(received: float, ms: str | None) -> tuple[float, int]:
        return rank({} if ms is None else {"x-llm-d-slo-ttft-ms": ms}, received)

    a, b, c, d = slo(now, "100"), slo(now, "50"), slo(now + 0.02, "50"), slo(now, None)
    e, f = slo(now - 1, "1050"), slo(now, str(2**63 - 1))
    assert b < a and c < a and a < d and e < b and a < f
    assert rank({"x-llm-d-slo-ttft-ms": "200"}, now)[0] == round(now * 1e9) + 200_000_000
    assert slo(now, None) < slo(now + 1, "x")  # no deadline: first come first served


def slo_queue(clock: Clock, fairness: str = "global-strict-fairness-policy") -> FlowQueue:
    return FlowQueue(FlowControlConfig(default_band=BandConfig(fairness=fairness, ordering=SLO_DEADLINE)), clock)


def slo_item(log: list[str], name: str, flow: str, ms: str | None, received: float) -> QueueItem:
    headers = {} if ms is None else {"x-llm-d-slo-ttft-ms": ms}
    return QueueItem(flow, 0, 1, lambda outcome: log.append(name), headers, received)


def test_slo_orders_within_a_flow_and_across_flows() -> None:
    clock = Clock()
    log: list[str] = []
    queue = slo_queue(clock)
    for item in (slo_item(log, "loose", "a", "5000", 100.0), slo_item(log, "none", "a", None, 99.0),
                 slo_item(log, "tight", "a", "100", 100.5), slo_item(log, "other", "b", "300", 100.0),
                 slo_item(log, "late-none", "b", None, 99.5)):
        assert queue.enqueue(item)
    queue.dispatch(lambda: 0.0)
    assert log == ["other", "tight", "loose", "none", "late-none"]
    log.clear()
    queue = slo_queue(clock, "round-robin-fairness-policy")
    for item in (slo_item(log, "a-loose", "a", "900", 100.0), slo_item(log, "a-tight", "a", "10", 100.0),
                 slo_item(log, "b-none", "b", None, 100.0), slo_item(log, "b-tight", "b", "1", 100.0)):
        queue.enqueue(item)
    queue.dispatch(lambda: 0.0)
    assert log == ["a-tight", "b-tight", "a-loose", "b-none"]


def test_slo_queue_without_arrival_time_uses_the_enqueue_time_and_cancels_stay_cheap() -> None:
    clock = Clock()
    log: list[str] = []
    queue = slo_queue(clock)
    items = [slo_item(log, str(i), "a", str(1000 - 2 * i), None) for i in range(200)]  # later ones due first
    for item in items:
        queue.enqueue(item)
        clock.now += 0.001
    assert items[0].received_at == 100.0
    for item in items[1:190]:
        queue.cancel(item)
    flow = queue._bands[0].flows["a"]
    assert flow.heap is not None and len(flow.heap) <= 2 * len(flow.items) + 16
    log.clear()
    queue.dispatch(lambda: 0.0)
    assert log == [str(i) for i in range(199, 189, -1)] + ["0"]


@settings(max_examples=100)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.one_of(st.none(), st.integers(-5, 3000).map(str),
                                                             st.sampled_from(["", "x", " 7 "])),
                          st.integers(0, 2000), st.booleans()), min_size=1, max_size=40),
       st.sampled_from(["global-strict-fairness-policy", "round-robin-fairness-policy"]))
def test_slo_dispatch_order_is_the_deadline_order(
        specs: list[tuple[str, str | None, int, bool]], fairness: str) -> None:
    clock = Clock()
    log: list[str] = []
    queue = slo_queue(clock, fairness)
    made = []
    for i, (flow, ms, received_ms, cancel) in enumerate(specs):
        item = slo_item(log, str(i), flow, ms, received_ms / 1000)
        assert queue.enqueue(item)
        made.append((item, cancel))
    for item, cancel in made:
        if cancel:
            queue.cancel(item)
    log.clear()
    queue.dispatch(lambda: 0.0)
    kept = [item for item, cancel in made if not cancel]
    order = {item.seq: (rank(item.headers, item.received_at or 0.0), item.seq) for item in kept}
    dispatched = [made[int(name)][0] for name in log]
    assert sorted(i.seq for i in dispatched) == sorted(i.seq for i in kept)
    for flow in "abc":  # within a flow: earliest deadline, then arrival, then enqueue order
        seqs = [i.seq for i in dispatched if i.fairness_id == flow]
        assert seqs == sorted(seqs, key=order.__getitem__)
    if fairness == "global-strict-fairness-policy":  # across flows too: one total order
        assert [i.seq for i in dispatched] == sorted(order, key=order.__getitem__)


def test_slo_deadline_config_and_the_stream_passes_its_headers() -> None:
    plugins = "- {type: slo-deadline-ordering-policy, name: slo}"
    flow = parse_config(epp("  defaultPriorityBand: {orderingPolicyRef: slo}", plugins)).flow_control
    assert flow is not None and flow.default_band.ordering == SLO_DEADLINE
    for section, extra, field in (
            ("  defaultPriorityBand: {orderingPolicyRef: slo-deadline-ordering-policy}", "",
             "flowControl.defaultPriorityBand.orderingPolicyRef"),  # not injected: declare it, as in llm-d
            ("", "- {type: slo-deadline-ordering-policy, parameters: {header: x}}", "plugins[1].parameters.header")):
        with pytest.raises(ConfigError) as info:
            parse_config(epp(section, extra))
        assert info.value.field == f"EndpointPickerConfig.{field}"
    picker = flow_picker("  saturationDetector: {pluginRef: concurrency-detector}\n"
                         "  defaultPriorityBand: {orderingPolicyRef: slo}",
                         plugins + "\n- {type: concurrency-detector, parameters: {maxConcurrency: 1}}")
    assert picker.flow is not None
    clock = Clock()
    picker.snapshot.clock = picker.flow.queue.clock = clock  # type: ignore[method-assign]
    busy = [start(picker)[0] for _ in range(3)]
    loose, _ = start(picker, extra=(("x-llm-d-slo-ttft-ms", "5000"),))
    clock.now += 1.0
    tight, _ = start(picker, extra=(("x-slo-ttft-ms", "100"),))
    assert loose.item.received_at == 100.0 and tight.item.received_at == 101.0  # type: ignore[attr-defined]
    assert loose.parked and tight.parked  # type: ignore[attr-defined]
    busy[0].on_abort()  # type: ignore[attr-defined]
    picker.flow.poll()
    assert not tight.parked and loose.parked  # type: ignore[attr-defined]


# -- usage-limit policies ----------------------------------------------------------------------------


def holdback(low: float, high: float = 1.0, domain: str = "rank") -> UsageLimit:
    return UsageLimit(PriorityHoldback(low, high, domain))


def test_usage_limit_configs() -> None:
    def usage(section: str, plugins: str = "") -> object:
        flow = parse_config(epp(section, plugins)).flow_control
        assert flow is not None
        return flow.usage_limit

    assert usage("") == StaticUsageLimit(1.0)
    assert usage("", "- {type: static-usage-limit-policy, parameters: {threshold: 0.8}}") == StaticUsageLimit(0.8)
    assert usage("  usageLimitPolicyPluginRef: ''", "- {type: static-usage-limit-policy, parameters: {threshold: 2}}"
                 ) == StaticUsageLimit(2.0)  # the reference checks no range
    assert usage("  usageLimitPolicyPluginRef: hb", "- {type: priority-holdback-policy, name: hb, parameters: "
                 "{shape: linear, domain: value, minCeiling: 0.4, maxCeiling: 0.9}}"
                 ) == PriorityHoldback(0.4, 0.9, "value")
    assert usage("  usageLimitPolicyPluginRef: hb", "- {type: priority-holdback-policy, name: hb, parameters: "
                 "{minCeiling: 0}}") == PriorityHoldback(0.0, 1.0, "rank")
    assert usage("  usageLimitPolicyPluginRef: soft-reflective-ceiling-policy",
                 "- {type: soft-reflective-ceiling-policy, parameters: {}}") == SoftReflectiveCeiling()
    # A declared plugin named like llm-d's default is the default, whatever its type (as the reference resolves it).
    assert usage("", "- {type: soft-reflective-ceiling-policy, name: static-usage-limit-policy}"
                 ) == SoftReflectiveCeiling()
    no_section = parse_config(epp("", "- {type: static-usage-limit-policy, parameters: {threshold: 0.5}}").replace(
        "flowControl:\n  {}\n", "")).flow_control
    assert no_section is not None and no_section.usage_limit == StaticUsageLimit(0.5)
    sample = load_config(FIXTURES / "soft-reflective-ceiling-epp-config.yaml", cluster_pool="pool").flow_control
    assert sample is not None and sample.usage_limit == SoftReflectiveCeiling()
    assert set(USAGE_LIMIT_POLICIES) <= set(PLUGIN_TYPES)


@pytest.mark.parametrize(("plugin", "field"), [
    ("{type: priority-holdback-policy}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {domain: rank}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: null}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {shape: sigmoid, minCeiling: 0.5}}", "shape"),
    ("{type: priority-holdback-policy, parameters: {domain: unknown, minCeiling: 0.5}}", "domain"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: -0.1}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: 1.0}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: 0.5, maxCeiling: 0.0}}", "maxCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: 0.5, maxCeiling: 1.1}}", "maxCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: 0.5, maxCeiling: 0.5}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: 0.8, maxCeiling: 0.5}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: low}}", "minCeiling"),
    ("{type: priority-holdback-policy, parameters: {minCeiling: 0.5, ceiling: 1}}", "ceiling"),
    ("{type: soft-reflective-ceiling-policy, parameters: {threshold: 0.5}}", "threshold"),
    ("{type: static-usage-limit-policy, parameters: {threshold: .nan}}", "threshold"),
    ("{type: static-usage-limit-policy, parameters: {threshold: high}}", "threshold"),
    ("{type: static-usage-limit-policy, parameters: {ceiling: 1}}", "ceiling"),
])
def test_bad_usage_limit_parameter_names_the_field(plugin: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(epp("", f"- {plugin}"))
    assert info.value.field == f"EndpointPickerConfig.plugins[1].parameters.{field}"


@pytest.mark.parametrize(("section", "plugins"), [
    ("  usageLimitPolicyPluginRef: priority-holdback-policy", ""),  # not injected: declare it
    ("  usageLimitPolicyPluginRef: fair", "- {type: program-aware-fairness, name: fair}"),
    ("  usageLimitPolicyPluginRef: 3", ""),
])
def test_bad_usage_limit_reference_names_the_field(section: str, plugins: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(epp(section, plugins))
    assert info.value.field == "EndpointPickerConfig.flowControl.usageLimitPolicyPluginRef"


def test_priority_holdback_ceilings_as_the_reference() -> None:
    approx = pytest.approx
    assert holdback(0.5).ceilings(0.5, []) == []
    for policy in (holdback(0.5), holdback(0.5, domain="value"), holdback(0.5, 0.9)):
        assert policy.ceilings(0.5, [10]) == [policy.params.max_ceiling]  # type: ignore[union-attr]
    rank, value = holdback(0.5), holdback(0.5, domain="value")
    assert rank.ceilings(0, [100, 10]) == approx([1.0, 0.5])
    assert rank.ceilings(0, [100, 50, 10]) == approx([1.0, 0.75, 0.5])
    assert rank.ceilings(0, [100, 75, 50, 10]) == approx([1.0, 0.8333333, 0.6666666, 0.5])
    assert rank.ceilings(0, [1000, 2, 1]) == approx(rank.ceilings(0, [100, 50, 10]))
    assert holdback(0.0).ceilings(0, [10, 5, 1]) == approx([1.0, 0.5, 0.0])
    assert holdback(0.8, 0.9).ceilings(0, [10, 5, 1]) == approx([0.9, 0.85, 0.8])
    assert value.ceilings(0, [100, 10]) == approx([1.0, 0.5])
    assert value.ceilings(0, [90, 50, 10]) == approx([1.0, 0.75, 0.5])
    assert value.ceilings(0, [100, 50, 10]) == approx([1.0, 0.7222222, 0.5])
    assert value.ceilings(0, [100, 2, 1]) == approx([1.0, 0.50505, 0.5], abs=1e-5)
    assert value.ceilings(0, [10, 10, 10]) == [1.0, 1.0, 1.0]
    assert value.ceilings(0, [100, 10, 10]) == approx([1.0, 0.5, 0.5])
    low, middle, high = value.ceilings(0, [10, -5, -20])[::-1]
    assert (high, low) == approx((1.0, 0.5)) and low < middle < high
    assert rank.ceilings(0, [100, 55, 10]) == approx(value.ceilings(0, [100, 55, 10]))


@given(st.lists(st.integers(-1000, 1000), min_size=1, max_size=12, unique=True),
       st.floats(0.0, 0.99), st.floats(0.01, 1.0), st.sampled_from(DOMAINS), st.floats(0.0, 2.0))
def test_ceilings_never_rise_down_the_priorities(
        levels: list[int], low: float, span: float, domain: str, saturation: float) -> None:
    priorities = sorted(levels, reverse=True)
    high = min(1.0, low + span)
    if low >= high:
        return
    hold = holdback(low, high, domain).ceilings(saturation, priorities)
    assert hold[0] == pytest.approx(high) and all(low - 1e-9 <= c <= high + 1e-9 for c in hold)
    soft = UsageLimit(SoftReflectiveCeiling())
    for ceilings in (hold, *(soft.ceilings(saturation, priorities) for _ in range(4))):
        assert all(a >= b - 1e-12 for a, b in itertools.pairwise(ceilings))


def test_soft_reflective_ceilings_as_the_reference() -> None:
    policy = UsageLimit(SoftReflectiveCeiling())
    assert policy.ceilings(0.9, []) == []
    for saturation in (0.0, 0.5, 0.99, 1.0):
        assert policy.ceilings(saturation, [100]) == [1.0]
    for saturation in (0.0, 0.3, 0.5, 0.7, 0.99, 1.0, 1.5):
        assert policy.ceilings(saturation, [100, 0, -50])[0] == 1.0
    assert policy.ceilings(0.3, [100, 0, -50]) == [1.0, 1.0, 1.0]
    assert policy.ceilings(1.0, [100, 0, -50]) == [1.0, 0.0, 0.0]
    first, second, *gated = policy.ceilings(0.7, [100, 50, 0, -50])
    assert (first, second) == (1.0, 1.0) and set(gated) <= {0.0, 1.0} and len(set(gated)) == 1
    for saturation, pattern in ((0.7, [0.0, 1.0] * 3), (0.75, [0.0, 0.0, 1.0] * 2)):
        policy = UsageLimit(SoftReflectiveCeiling())
        assert [policy.ceilings(saturation, [100, -50]) for _ in pattern] == [[1.0, p] for p in pattern]
    assert len(policy.ceilings(0.7, [100, 50, 0, -50])) == 4  # the levels may grow between calls
    policy = UsageLimit(SoftReflectiveCeiling())
    for _ in range(3):
        policy.ceilings(0.6, [100, 0, -50])
    opened = [policy.ceilings(0.7, [100, 0, -50]) for _ in range(100)]
    assert all(c[1] == c[2] for c in opened) and sum(c[2] for c in opened) == 50  # open together, half the time
    assert _go_round(2.5) == 3 and _go_round(1.5) == 2 and _go_round(-2.5) == -3 and _go_round(2.4999) == 2


def usage_queue(clock: Clock, usage: UsageLimitParams, *bands: int) -> FlowQueue:
    config = FlowControlConfig(bands=tuple(BandConfig(p) for p in bands), usage_limit=usage)
    return FlowQueue(config, clock)


def test_holdback_gates_lower_bands_first_and_idle_levels_count() -> None:
    clock = Clock()
    log: list[str] = []
    queue = usage_queue(clock, PriorityHoldback(0.4, 1.0), 10, -10)
    assert queue.priorities() == [10, 0, -10]  # configured bands and 0, idle or not
    for name, priority in (("low", -10), ("mid", 0), ("high", 10)):
        queue.enqueue(QueueItem(name, priority, 1, lambda outcome, name=name: log.append(name)))
    assert queue.dispatch(lambda: 0.75) == 1 and log == ["high"]  # ceilings 1.0, 0.7, 0.4
    assert queue.dispatch(lambda: 0.5) == 1 and log == ["high", "mid"]
    assert queue.dispatch(lambda: 0.4) == 0  # -10's ceiling 0.4 is reached (0 is now idle but counts)
    assert queue.dispatch(lambda: 0.39) == 1 and log == ["high", "mid", "low"]
    alone = usage_queue(clock, PriorityHoldback(0.4, 0.9))
    alone.provision([5])
    assert alone.priorities() == [5, 0]
    alone.enqueue(QueueItem("x", 0, 1, lambda outcome: log.append("zero")))
    assert alone.dispatch(lambda: 0.5) == 0  # two levels (5 provisioned by an objective): 0 gets 0.4
    alone.provision([])
    assert alone.dispatch(lambda: 0.5) == 1  # 0 alone: maxCeiling 0.9
    assert alone.dispatch(lambda: 0.95) == 0 and alone.retry_at == math.inf


def test_static_threshold_gates_every_band() -> None:
    clock = Clock()
    log: list[str] = []
    queue = usage_queue(clock, StaticUsageLimit(0.8))
    queue.enqueue(QueueItem("x", 3, 1, lambda outcome: log.append("x")))
    assert queue.dispatch(lambda: 0.8) == 0 and queue.dispatch(lambda: 0.79) == 1


def test_soft_reflective_opens_gated_bands_one_cycle_in_period_and_asks_for_the_next_tick() -> None:
    clock = Clock()
    log: list[str] = []
    config = FlowControlConfig(bands=(BandConfig(10),), usage_limit=SoftReflectiveCeiling())
    gate = FlowGate(config, PoolSnapshot((), 1.0, clock), InflightLoad())
    queue = gate.queue
    for i in range(4):
        queue.enqueue(QueueItem("low", 0, 1, lambda outcome, i=i: log.append(f"low{i}")))
    queue.enqueue(QueueItem("high", 10, 1, lambda outcome: log.append("high")))
    # Saturation 0.75 and two levels: band 0 is past its ceiling (0.25): open one cycle in 3.
    assert queue.dispatch(lambda: 0.75) == 1 and log == ["high"]  # tick 1 (shut) still serves band 10; 2 shuts
    assert queue.retry_at == clock.now + DISPATCH_TICK_S and gate.next_deadline() == queue.retry_at
    assert queue.dispatch(lambda: 0.75) == 1 and log[-1] == "low0"  # tick 3 opens; tick 4 shuts
    assert queue.dispatch(lambda: 0.75) == 0  # tick 5
    assert queue.dispatch(lambda: 0.75) == 1 and log[-1] == "low1"  # tick 6, then 7
    assert queue.dispatch(lambda: 0.3) == 2 and queue.retry_at == math.inf and gate.next_deadline() == math.inf


def test_the_picker_provisions_the_objectives_priorities() -> None:
    picker = make_picker("objectives: [{name: urgent, priority: 5}]\n---" + epp("  priorityBands: [{priority: 2}]"
                                                                               ).split("---", 1)[1])
    assert picker.flow is not None and picker.flow.queue.priorities() == [5, 2, 0]
    picker.set_cluster_objectives({"batch": -3})
    assert picker.flow.queue.priorities() == [5, 2, 0, -3]
    picker.set_cluster_objectives({"urgent": 1})
    assert picker.flow.queue.priorities() == [2, 1, 0]


def test_the_docs_holdback_example_gives_the_ceilings_it_says() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "picker.md").read_text()
    (example,) = [b for b in re.findall(r"^```yaml\n(.*?)^```", doc, re.M | re.S) if "priority-holdback-policy" in b]
    flow = parse_config(epp().split("---", 1)[0] + "---\napiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"
                        "featureGates: [flowControl]\n" + example).flow_control
    assert flow is not None
    queue = FlowQueue(flow, Clock())
    assert queue.usage_limit.ceilings(0.5, queue.priorities()) == pytest.approx([0.9, 0.65, 0.4])
