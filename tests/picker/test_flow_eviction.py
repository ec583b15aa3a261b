"""In-flight eviction, sans-IO: the eviction queue and its two policies, the request evictor, the
reclamation controller (sizing, pacing, timeouts) and the dispatch cycle that drives it, ported
from llm-d-router's tests, with properties of the whole."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, target
from hypothesis import strategies as st

from evergreen_trio.picker.config import parse_config
from evergreen_trio.picker.errors import ConfigError
from evergreen_trio.picker.flow_control.config import ConcurrencyDetector, FlowControlConfig, UtilizationDetector
from evergreen_trio.picker.flow_control.eviction import (
    PRIORITY_THEN_TIME,
    SHEDDABLE_FILTER,
    EvictionItem,
    EvictionQueue,
    PriorityThenTime,
    RequestEvictor,
    SheddableFilter,
)
from evergreen_trio.picker.flow_control.queue import FlowQueue, QueueItem
from evergreen_trio.picker.flow_control.reclamation import (
    CONFIRMED,
    TIMED_OUT,
    ReclamationConfig,
    ReclamationController,
    ReclamationObserver,
    confirmation_grace,
)
from evergreen_trio.picker.plugins import ALPHA_TYPES
from tests.picker.test_flow_control import HEADER, Clock, epp

CONFIG = ReclamationConfig(max_revocations_per_decision=2, confirmation_grace_s=0.1, confirmation_timeout_s=5.0)


def item(request_id: int, priority: int, dispatched_at: float = 0.0,
         evict: Callable[[], None] = lambda: None) -> EvictionItem:
    return EvictionItem(request_id, priority, dispatched_at, evict)


class ThresholdFilter:
    """The reference tests' filter: evictable below ``threshold``."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def accept(self, item: EvictionItem) -> bool:
        return item.priority < self.threshold


class AcceptAll:
    def accept(self, item: EvictionItem) -> bool:
        return True


# -- policies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("priority", "evictable"), [(-1, True), (-100, True), (0, False), (1, False), (100, False)])
def test_sheddable_filter_accepts_negative_priorities_only(priority: int, evictable: bool) -> None:
    assert SheddableFilter().accept(item(1, priority)) is evictable


def test_priority_then_time_evicts_the_lowest_priority_then_the_newest() -> None:
    policy = PriorityThenTime()

    def less(a: EvictionItem, b: EvictionItem) -> bool:
        return policy.key(a) < policy.key(b)

    low_old, low_new = item(1, -2, dispatched_at=99.0), item(2, -2, dispatched_at=100.0)
    mid, high = item(3, 0, dispatched_at=100.0), item(4, 5, dispatched_at=100.0)
    assert less(low_old, mid) and not less(high, mid)
    assert less(low_new, low_old) and not less(low_old, low_new)
    assert not less(mid, mid)


def test_both_policy_types_are_declarable_alpha_and_take_no_parameters() -> None:
    plugins = f"- {{type: {SHEDDABLE_FILTER}, name: f}}\n- {{type: {PRIORITY_THEN_TIME}}}"
    config = parse_config(epp("  enableEviction: true", plugins))
    assert config.flow_control is not None and config.flow_control.eviction
    assert config.epp is not None and {p.type for p in config.epp.plugins.values()} >= {
        SHEDDABLE_FILTER, PRIORITY_THEN_TIME}
    for kind in (SHEDDABLE_FILTER, PRIORITY_THEN_TIME):
        assert kind in ALPHA_TYPES
        with pytest.raises(ConfigError, match=r"plugins\[1\]\.parameters\.maxVictims"):
            parse_config(epp(plugins=f"- {{type: {kind}, parameters: {{maxVictims: 3}}}}"))
    assert parse_config(epp()).flow_control == FlowControlConfig(eviction=False)


def test_confirmation_grace_follows_the_detector() -> None:
    assert confirmation_grace(ConcurrencyDetector(), 0.05, 2.0) == 0.01
    assert confirmation_grace(UtilizationDetector(), 0.05, 2.0) == pytest.approx(2.3)


# -- eviction queue (queue_test.go) --------------------------------------------------------------

NAMES = ["req-1", "req-2", "req-3", "normal", "sheddable", "req-a", "req-b", "p5", "p1", "p3", "p-1", "p0"]
ID = {name: i for i, name in enumerate(NAMES)}
NAME = {i: name for name, i in ID.items()}


@pytest.mark.parametrize(("accept", "tracked", "untracked", "in_flight", "evictable", "popped", "left"), [
    (AcceptAll(), [("req-1", -1)], ["req-1"], 0, 0, None, None),  # track evictable and untrack
    (ThresholdFilter(0), [("normal", 5)], [], 1, 0, None, None),  # non-evictable: in flight only
    (ThresholdFilter(0), [("sheddable", -1), ("normal", 5)], [], 2, 1, ["sheddable"], (1, 0)),
    (ThresholdFilter(0), [("normal", 5)], ["normal"], 0, 0, None, None),  # untrack non-evictable
    (AcceptAll(), [("req-1", -1)], ["req-2"], 1, 1, None, None),  # untrack unknown: nothing
    (AcceptAll(), [("req-1", -1), ("req-2", -2), ("req-3", -3)], ["req-3"], 2, 2, ["req-2", "req-1"], (0, 0)),
    (AcceptAll(), [("req-1", -1), ("req-1", -1)], [], 1, 1, ["req-1"], (0, 0)),  # a duplicate replaces
    (AcceptAll(), [("req-a", 5), ("req-a", -10), ("req-b", -5)], [], 2, 2, ["req-a", "req-b"], (0, 0)),
    (AcceptAll(), [("p5", 5), ("p1", 1), ("p3", 3), ("p-1", -1), ("p0", 0)], [], 5, 5,
     ["p-1", "p0", "p1", "p3", "p5"], (0, 0)),
])
def test_eviction_queue_track_and_untrack(accept: AcceptAll | ThresholdFilter, tracked: list[tuple[str, int]],
                                          untracked: list[str], in_flight: int, evictable: int,
                                          popped: list[str] | None, left: tuple[int, int] | None) -> None:
    queue = EvictionQueue(PriorityThenTime(), accept)
    for name, priority in tracked:
        queue.track(item(ID[name], priority))
    for name in untracked:
        queue.untrack(ID[name])
    assert (queue.in_flight, queue.evictable) == (in_flight, evictable)
    if popped is not None:
        assert [NAME[i.request_id] for i in queue.pop_n(100)] == popped
        assert (queue.in_flight, queue.evictable) == left


def test_eviction_queue_ties_go_to_the_newest_dispatch_pop_n_bounds_and_peek() -> None:
    queue = EvictionQueue(PriorityThenTime(), AcceptAll())
    queue.track(item(1, 0, dispatched_at=100.1))  # newer
    queue.track(item(2, 0, dispatched_at=99.9))  # oldest
    queue.track(item(3, 0, dispatched_at=100.0))
    assert [i.request_id for i in queue.pop_n(3)] == [1, 3, 2]
    assert queue.pop_n(5) == [] and queue.pop_n(0) == [] and queue.peek() is None
    queue.track(item(4, 0))
    queue.track(item(5, 0, dispatched_at=0.001))
    assert queue.pop_n(0) == [] and queue.evictable == 2
    assert len(queue.pop_n(10)) == 2 and (queue.in_flight, queue.evictable) == (0, 0)
    for request_id, priority in ((6, 5), (7, -1), (8, 2)):
        queue.track(item(request_id, priority))
    peeked = queue.peek()
    assert peeked is not None and peeked.request_id == 7 and queue.evictable == 3
    with pytest.raises(AttributeError):
        peeked.priority = 999  # type: ignore[misc]  # frozen: the heap cannot be corrupted through it


@given(st.lists(st.tuples(st.sampled_from(["track", "untrack", "pop", "peek"]), st.integers(0, 30),
                          st.integers(-3, 3)), max_size=300))
def test_eviction_queue_stays_ordered_and_bounded(steps: list[tuple[str, int, int]]) -> None:
    """The reference's concurrency test, as a property: in flight >= evictable, victims in order,
    and the heap never holds more than twice what is evictable (plus a constant)."""
    queue = EvictionQueue(PriorityThenTime(), ThresholdFilter(1))
    model: dict[int, int] = {}  # id -> priority, what is tracked
    for step, (op, request_id, priority) in enumerate(steps):
        if op == "track":
            queue.track(item(request_id, priority, dispatched_at=float(step)))
            model[request_id] = priority
        elif op == "untrack":
            queue.untrack(request_id)
            model.pop(request_id, None)
        elif op == "pop":
            for victim in queue.pop_n(1):
                assert victim.priority == min(p for p in model.values() if p < 1)
                del model[victim.request_id]
        else:
            queue.peek()
        assert queue.in_flight == len(model) >= queue.evictable == sum(p < 1 for p in model.values())
        assert len(queue._heap) <= 2 * queue.evictable + 17
    drained = [i.priority for i in queue.pop_n(len(model) + 1)]
    assert drained == sorted(drained) and queue.evictable == 0


# -- request evictor (request_evictor_test.go) ---------------------------------------------------


def tracked(evictor: RequestEvictor, *priorities: int) -> list[int]:
    """Track a request per priority (ids from 1); the ids each ``evict`` call reported."""
    signalled: list[int] = []
    for request_id, priority in enumerate(priorities, 1):
        evictor.track(item(request_id, priority, dispatched_at=float(request_id),
                           evict=lambda i=request_id: signalled.append(i)))  # type: ignore[misc]
    return signalled


def test_evict_n_signals_untracks_and_confirms_once_only_the_evicted() -> None:
    evictor = RequestEvictor(accept=AcceptAll())
    terminated: list[int] = []
    evictor.on_terminated = terminated.append
    signalled = tracked(evictor, -1, -1)
    assert evictor.stats() == (2, 2)
    assert evictor.evict_n(1, 0) == [2] and signalled == [2]  # the newer dispatch goes first
    assert evictor.stats() == (1, 1) and evictor.unconfirmed == 1
    evictor.untrack(2)
    evictor.untrack(2)  # the idempotent second cleanup does not notify again
    evictor.untrack(1)  # a natural completion does not notify
    assert terminated == [2] and evictor.stats() == (0, 0) and evictor.unconfirmed == 0


def test_evict_n_stops_at_the_priority_bound_and_peeks_the_victim_priority() -> None:
    evictor = RequestEvictor(accept=AcceptAll())
    assert evictor.victim_priority() is None
    signalled = tracked(evictor, -5, -1)
    assert evictor.victim_priority() == -5
    assert evictor.evict_n(2, -1) == [1] and signalled == [1]  # -1 is not strictly below the demand
    assert evictor.stats() == (1, 1) and evictor.victim_priority() == -1


@given(st.lists(st.integers(-5, 5), max_size=30), st.integers(0, 10), st.integers(-5, 6))
def test_evict_n_takes_the_lowest_victims_strictly_below_the_bound(priorities: list[int], n: int, bound: int) -> None:
    evictor = RequestEvictor(accept=AcceptAll())
    signalled = tracked(evictor, *priorities)
    evicted = evictor.evict_n(n, bound)
    below = sorted((p, -i) for i, p in enumerate(priorities, 1) if p < bound)
    assert evicted == signalled == [-i for _, i in below[:n]]
    assert evictor.stats() == (len(priorities) - len(evicted),) * 2


def test_the_default_policies_leave_non_sheddable_requests_alone() -> None:
    evictor = RequestEvictor()
    tracked(evictor, 0, 3, -2)
    assert evictor.stats() == (3, 1) and evictor.evict_n(5, 10) == [3] and evictor.evict_n(5, 10) == []


# -- reclamation controller (reclamation_test.go) ------------------------------------------------


@dataclass
class FakeEvictor:
    """The reference's fakeInFlightEvictor: counts, a victim priority, and the calls made."""

    in_flight: int = 0
    evictable: int = 0
    victim: int | None = None
    calls: list[tuple[int, int]] = field(default_factory=list)  # (n, priority bound)
    next_id: int = 0

    def evict_n(self, n: int, priority_bound: int) -> list[int]:
        self.calls.append((n, priority_bound))
        n = min(n, self.evictable)
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        self.evictable -= n
        self.in_flight -= n
        return ids

    def stats(self) -> tuple[int, int]:
        return self.in_flight, self.evictable

    def victim_priority(self) -> int | None:
        return self.victim

    @property
    def counts(self) -> list[int]:
        return [n for n, _ in self.calls]


def controller(evictor: FakeEvictor, clock: Clock | None = None) -> ReclamationController:
    return ReclamationController(CONFIG, evictor, clock or Clock())


@pytest.mark.parametrize(("in_flight", "evictable", "saturation", "ceiling", "expected"), [
    (6, 6, 1.2, 1.0, [1]),  # credit 0.2, deficit 0.2: one
    (4, 4, 2.0, 1.0, [2]),  # credit 0.5, deficit 1.0: two, the cap
    (4, 1, 2.0, 1.0, [1]),  # capped by what is evictable
    (6, 6, 0.9, 1.0, []),  # no deficit
    (10, 10, 1.0, 1.0, [1]),  # exactly at the ceiling still blocks dispatch: one
    (0, 0, 1.5, 1.0, []),  # nothing tracked
])
def test_reclamation_sizing(in_flight: int, evictable: int, saturation: float, ceiling: float,
                            expected: list[int]) -> None:
    evictor = FakeEvictor(in_flight, evictable)
    controller(evictor).reclaim(saturation, ceiling, 0)
    assert evictor.counts == expected


def test_the_gate_shuts_until_every_revocation_confirmed_and_cooled() -> None:
    clock = Clock()
    evictor = FakeEvictor(4, 4)
    rc = controller(evictor, clock)
    assert rc.gate_open()
    rc.reclaim(2.0, 1.0, 0)
    assert evictor.counts == [2] and not rc.gate_open() and rc.pending_reclaim == 1.0
    rc.confirm(0)
    assert not rc.gate_open()  # one of two
    rc.confirm(1)
    assert not rc.gate_open()  # all confirmed, cooling for the grace
    assert rc.next_change() == pytest.approx(clock.now + CONFIG.confirmation_grace_s)
    clock.now += CONFIG.confirmation_grace_s + 0.001
    assert rc.gate_open() and rc.pending_reclaim == 0.0 and rc.next_change() == float("inf")


def test_the_next_change_is_never_in_the_past() -> None:
    """The shell sleeps until it: a time already past, with requests queued that no dispatch cycle
    blocks on (so nothing retires it), would make it poll without pause."""
    clock = Clock()
    rc = controller(FakeEvictor(4, 4), clock)
    rc.reclaim(2.0, 1.0, 0)
    clock.now += CONFIG.confirmation_timeout_s + 1
    assert rc.next_change() == pytest.approx(clock.now + CONFIG.confirmation_grace_s)
    clock.now += 1
    assert rc.next_change() == float("inf") and rc.gate_open()


def test_an_unknown_confirmation_is_ignored() -> None:
    rc = controller(FakeEvictor(4, 4))
    rc.confirm(12345)
    assert rc.gate_open()


def test_a_confirmation_timeout_reopens_the_gate_and_a_late_confirmation_is_ignored() -> None:
    clock = Clock()
    rc = controller(FakeEvictor(4, 4), clock)
    rc.reclaim(2.0, 1.0, 0)
    assert not rc.gate_open() and rc.next_change() == clock.now + CONFIG.confirmation_timeout_s
    clock.now += CONFIG.confirmation_timeout_s + 0.001
    assert not rc.gate_open()  # retired, and the grace starts now
    clock.now += CONFIG.confirmation_grace_s + 0.001
    assert rc.gate_open()
    rc.confirm(0)
    assert rc.gate_open()


def test_the_pending_debit_suppresses_a_repeat_decision_on_the_same_signal() -> None:
    evictor = FakeEvictor(4, 4)
    rc = controller(evictor)
    rc.reclaim(2.0, 1.0, 0)
    rc.reclaim(2.0, 1.0, 0)  # a caller bypassing the gate
    assert evictor.counts == [2]


def test_the_demand_priority_is_the_victim_bound() -> None:
    evictor = FakeEvictor(4, 4)
    controller(evictor).reclaim(2.0, 1.0, -1)
    assert [bound for _, bound in evictor.calls] == [-1]


class Recorder(ReclamationObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def issued(self, priority: int, count: int) -> None:
        self.events.append(("issued", (priority, count)))

    def revoked(self, outcome: str) -> None:
        self.events.append(("revoked", outcome))

    def reclaim_target(self, target: float) -> None:
        self.events.append(("target", round(target, 6)))

    def pending_reclaim(self, pending: float) -> None:
        self.events.append(("pending", round(pending, 6)))

    def confirmed_after(self, seconds: float) -> None:
        self.events.append(("confirmed_after", round(seconds, 6)))


def test_the_observer_hears_what_the_reference_records() -> None:
    clock = Clock()
    recorder = Recorder()
    rc = ReclamationController(CONFIG, FakeEvictor(4, 4), clock, recorder)
    rc.reclaim(2.0, 1.0, 10)
    clock.now += 0.25
    rc.confirm(0)
    clock.now += CONFIG.confirmation_timeout_s
    rc.gate_open()
    clock.now += CONFIG.confirmation_grace_s
    rc.gate_open()
    assert recorder.events == [
        ("target", 1.0), ("issued", (10, 2)), ("pending", 1.0),
        ("revoked", CONFIRMED), ("confirmed_after", 0.25),
        ("revoked", TIMED_OUT), ("pending", 0.5),  # the confirmed one cooled; the timed-out one cools now
        ("pending", 0.0),
    ]


# -- the dispatch cycle (maybeReclaim) -----------------------------------------------------------


def blocked_queue(evictor: FakeEvictor, saturation: float, *, ceiling_config: str = "",
                  priority: int = 10) -> tuple[FlowQueue, ReclamationController]:
    """A queue holding one request at ``priority`` whose dispatch cycles read ``saturation``."""
    config = parse_config(epp(f"  priorityBands: [{{priority: {priority}}}]{ceiling_config}")).flow_control
    assert config is not None
    clock = Clock()
    queue = FlowQueue(config, clock)
    rc = controller(evictor, clock)
    queue.on_blocked = lambda s, levels, ceilings, i: rc.maybe_reclaim(s, levels, ceilings, i, queue.holds)
    queue.enqueue(QueueItem("flow", priority, 10, lambda outcome: None))
    assert queue.dispatch(lambda: saturation) == 0
    return queue, rc


def test_a_head_of_line_block_with_eligible_demand_reclaims() -> None:
    evictor = FakeEvictor(6, 3, victim=-1)
    blocked_queue(evictor, 1.2)
    assert evictor.calls == [(1, 10)]  # credit 0.2, deficit 0.2


def test_no_queued_demand_no_reclamation() -> None:
    evictor = FakeEvictor(6, 3, victim=-1)
    queue, _ = blocked_queue(evictor, 1.2)
    evictor.calls.clear()
    queue.shutdown()  # the band is empty now
    queue.closed = False
    queue.dispatch(lambda: 1.2)
    assert evictor.calls == []
    rc = controller(evictor)
    rc.maybe_reclaim(1.2, [10, 0], [1.0, 1.0], 0, lambda priority: False)
    assert evictor.calls == []


@pytest.mark.parametrize(("victim", "reason"), [(10, "victim not strictly lower"), (None, "nothing evictable")])
def test_no_reclamation_without_a_strictly_lower_victim(victim: int | None, reason: str) -> None:
    evictor = FakeEvictor(6, 3 if victim is not None else 0, victim=victim)
    blocked_queue(evictor, 1.2)
    assert evictor.calls == [], reason


def test_a_shut_gate_skips_the_demand_scan_on_repeated_cycles() -> None:
    evictor = FakeEvictor(6, 6, victim=-1)
    queue, _ = blocked_queue(evictor, 1.2)
    for _ in range(10):
        queue.dispatch(lambda: 1.2)
    assert evictor.counts == [1]


def test_a_zero_ceiling_band_is_no_demand() -> None:
    evictor = FakeEvictor(6, 6, victim=-1)
    rc = controller(evictor)
    rc.maybe_reclaim(1.0, [10], [0.0], 0, lambda priority: True)
    assert evictor.calls == []
    rc.maybe_reclaim(1.0, [10], [0.9], 0, lambda priority: True)
    assert evictor.counts == [1]


def test_a_lower_blocked_band_is_demand_when_the_higher_one_is_empty() -> None:
    """Each band's ceiling is checked apart: the first level that blocks may be empty."""
    evictor = FakeEvictor(6, 6, victim=-1)
    rc = controller(evictor)
    rc.maybe_reclaim(1.0, [10, 5, 0], [0.9, 0.8, 1.0], 0, lambda priority: priority == 5)
    assert evictor.calls == [(2, 5)]  # credit 1/6, deficit 0.2


# -- properties ----------------------------------------------------------------------------------

Step = tuple[str, int, float]
STEPS = st.one_of(
    st.tuples(st.just("dispatch"), st.integers(-3, 1), st.just(0.0)),  # a request at that priority
    st.tuples(st.just("end"), st.integers(0, 50), st.just(0.0)),  # the stream of the i-th one in flight
    st.tuples(st.just("evicted_end"), st.just(0), st.just(0.0)),  # an evicted request's stream ends
    st.tuples(st.just("tick"), st.just(0), st.floats(0.0, 6.0)),  # seconds pass
    st.tuples(st.just("blocked"), st.integers(-2, 2), st.floats(0.0, 3.0)),  # demand priority, saturation - 1
)


@dataclass
class Revoked:
    priority: int  # the victim's
    demand: int  # the priority it made room for
    issued_at: float
    confirmed_at: float | None = None


@given(st.lists(STEPS, max_size=200))
def test_eviction_invariants(steps: list[Step]) -> None:
    """Requests dispatched, their streams ending, time passing and blocked dispatch cycles, in any
    order: no victim at or above its demand's priority; at most the cap per decision; no decision
    before every earlier revocation was confirmed (or timed out) and cooled; each evicted stream
    confirmed exactly once; tracked ids follow the open streams."""
    clock = Clock()
    evictor = RequestEvictor()
    rc = ReclamationController(CONFIG, evictor, clock)
    open_streams: dict[int, int] = {}  # id -> priority, dispatched and not ended
    revoked: dict[int, Revoked] = {}
    decision: list[int] = []
    demand = 0

    def evict(request_id: int) -> None:
        decision.append(request_id)
        revoked[request_id] = Revoked(open_streams[request_id], demand, clock.now)

    def terminated(request_id: int) -> None:
        assert revoked[request_id].confirmed_at is None, "confirmed twice"
        revoked[request_id].confirmed_at = clock.now
        rc.confirm(request_id)

    evictor.on_terminated = terminated
    grace, timeout = CONFIG.confirmation_grace_s, CONFIG.confirmation_timeout_s
    for op, priority, amount in steps:
        if op == "dispatch":
            request_id = max((*open_streams, *revoked, 0)) + 1
            open_streams[request_id] = priority
            evictor.track(item(request_id, priority, clock.now, evict=lambda i=request_id: evict(i)))  # type: ignore[misc]
        elif op == "end" and open_streams:
            request_id = sorted(open_streams)[priority % len(open_streams)]
            del open_streams[request_id]
            evictor.untrack(request_id)
        elif op == "evicted_end" and open_streams.keys() & revoked.keys():
            request_id = min(open_streams.keys() & revoked.keys())
            del open_streams[request_id]
            evictor.untrack(request_id)
        elif op == "tick":
            clock.now += amount
        elif op == "blocked":
            earlier = list(revoked.values())
            demand = priority
            decision.clear()
            rc.maybe_reclaim(1.0 + amount, [priority], [1.0], 0, lambda p: True)
            assert len(decision) <= CONFIG.max_revocations_per_decision
            for victim in (revoked[i] for i in decision):
                assert victim.priority < victim.demand
            if decision:
                assert all((r.confirmed_at is not None and clock.now >= r.confirmed_at + grace)
                           or clock.now >= r.issued_at + timeout + grace for r in earlier), "paced too soon"
                assert not rc.gate_open()
        in_flight = {i for i in open_streams if i not in revoked}
        assert evictor.stats() == (len(in_flight), sum(open_streams[i] < 0 for i in in_flight))
        assert evictor.unconfirmed == sum(1 for i in revoked if i in open_streams)
    target(float(len(revoked)))  # steer towards runs that evict a lot
    for request_id in list(open_streams):
        evictor.untrack(request_id)
    assert all(r.confirmed_at is not None for r in revoked.values())
    assert evictor.stats() == (0, 0) and evictor.unconfirmed == 0


def test_a_stream_that_ends_inside_its_evict_signal_is_confirmed_once_its_decision_lands() -> None:
    """The reference holds a lock across EvictN so that a confirmation waits for its revocation;
    here a stream ending inside its ``evict`` call is confirmed right after the decision."""
    clock = Clock()
    evictor = RequestEvictor()
    rc = ReclamationController(CONFIG, evictor, clock)
    confirmed: list[int] = []
    evictor.on_terminated = lambda i: (confirmed.append(i), rc.confirm(i))[1]  # type: ignore[func-returns-value]
    evictor.track(item(1, -1, evict=lambda: evictor.untrack(1)))
    rc.reclaim(2.0, 1.0, 0)
    assert confirmed == [1] and evictor.stats() == (0, 0) and not rc.outstanding and len(rc.cooling) == 1
    clock.now += CONFIG.confirmation_grace_s
    assert rc.gate_open()


def test_the_docs_eviction_example_turns_eviction_on() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "picker.md").read_text()
    (example,) = [b for b in re.findall(r"^```yaml\n(.*?)^```", doc, re.M | re.S) if "enableEviction: true" in b]
    flow = parse_config(epp().split("---", 1)[0] + "---\n" + HEADER + "\nkind: EndpointPickerConfig\n"
                        "featureGates: [flowControl]\n" + example).flow_control
    assert flow is not None and flow.eviction and isinstance(flow.detector, ConcurrencyDetector)
