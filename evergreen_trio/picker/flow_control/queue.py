"""The flow control queue, sans-IO: bands of flows of requests, capacity, TTL, dispatch by policy.

:class:`FlowQueue` is what llm-d-router's flow controller does, as plain calls: :meth:`~FlowQueue.enqueue`
admits a request into its priority band's flow (keyed by fairness id) or rejects it when the band
or the whole queue is full; :meth:`~FlowQueue.dispatch` hands out requests, highest band first,
while ``saturation()`` stays below each priority level's ceiling from the usage-limit policy
(:mod:`.usage_limits`; 1.0 by default) and stops at the first level it reaches (head-of-line
blocking, so lower priorities never overtake); :meth:`~FlowQueue.expire` evicts requests past
their queue-wait budget. A band picks its next flow with its fairness policy
(``global-strict-fairness-policy``: the flow whose head request comes first by the ordering
policy; ``round-robin-fairness-policy``: the flows in turn, sorted by id;
``program-aware-fairness``: :mod:`.program_aware`) and a flow its next request with its ordering
policy (``fcfs-ordering-policy``: first enqueued; ``edf-ordering-policy``: earliest deadline =
enqueue time + TTL, no deadline last; ``slo-deadline-ordering-policy``: :mod:`.slo_deadline`).

Every request here gets the same TTL, so within a flow enqueue order is EDF's deadline order too:
a flow is an insertion-ordered dict (removal of a cancelled request is O(1)), plus a heap where
the SLO deadline orders it. Empty flows and bands are dropped at once, so memory follows what is
queued, which the band and global caps bound.
"""

from __future__ import annotations

import enum
import heapq
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from evergreen_trio.picker.flow_control import slo_deadline
from evergreen_trio.picker.flow_control.config import EDF, ROUND_ROBIN, BandConfig, FlowControlConfig
from evergreen_trio.picker.flow_control.program_aware import ProgramAware
from evergreen_trio.picker.flow_control.usage_limits import UsageLimit

DROPPED_REASON = "x-llm-d-request-dropped-reason"
DISPATCH_TICK_S = 0.001  # llm-d's flow controller runs a dispatch cycle every millisecond


class Outcome(enum.Enum):
    """How a request left the queue; all but DISPATCHED carry (HTTP status, dropped reason)."""

    DISPATCHED = (200, "")
    REJECTED_SATURATED = (429, "rejected-saturated")
    EVICTED_TTL = (429, "rejected-ttl-expired")
    EVICTED_NO_ENDPOINTS = (503, "rejected-no-endpoints")
    CANCELLED = (503, "rejected-context-cancelled")
    SHUTTING_DOWN = (503, "rejected-shutting-down")

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def reason(self) -> str:
        return self.value[1]


_MESSAGES = {
    Outcome.REJECTED_SATURATED: "request rejected by flow control: queue capacity exceeded",
    Outcome.EVICTED_TTL: "request timed out in queue",
    Outcome.EVICTED_NO_ENDPOINTS: "request timed out in queue and no endpoints are available",
    Outcome.CANCELLED: "client disconnected",
    Outcome.SHUTTING_DOWN: "flow controller shutting down",
}


def message(outcome: Outcome) -> str:
    """The error message llm-d gives an outcome."""
    return _MESSAGES.get(outcome, "")


@dataclass(eq=False)
class QueueItem:
    """One queued request: its flow key, size, headers, when it came, and whom to tell how it left.

    ``received_at`` is when its request headers came (the queue's clock; None: when enqueued);
    ``program_picked``: a program-aware pick chose it (its wait then counts in that policy's
    mean); ``running``: scheduled and not yet completed (see :meth:`FlowGate.started`);
    ``on_evict``: tells its stream that in-flight eviction revoked it (None: it cannot be evicted).
    """

    fairness_id: str
    priority: int
    byte_size: int
    on_outcome: Callable[[Outcome], None]
    headers: Mapping[str, str] = field(default_factory=dict)
    received_at: float | None = None
    enqueued_at: float = 0.0
    outcome: Outcome | None = None
    seq: int = 0
    program_picked: bool = False
    running: bool = False
    on_evict: Callable[[], None] | None = None
    models: tuple[str, str] = ("", "")  # (model, target model): the metrics' labels


class FlowObserver(Protocol):
    """What the queue reports to the metrics (llm-d-router's flow control metrics)."""

    def entered(self, item: QueueItem) -> None:
        """``item`` came to flow control (it counts as queued until it leaves)."""

    def enqueued(self, item: QueueItem, seconds: float) -> None:
        """Enqueueing ``item`` took ``seconds`` (its outcome is set when that rejected it)."""

    def left(self, item: QueueItem, outcome: Outcome, waited_s: float) -> None:
        """``item`` left with ``outcome`` after ``waited_s`` in flow control."""

    def dispatch_cycle(self, seconds: float) -> None:
        """One dispatch cycle took ``seconds``."""


@dataclass
class _Flow:
    """One flow's requests: ``items`` in enqueue order (O(1) removal; the first is the oldest) and,
    in a band ordered by SLO deadline, a heap of (deadline, arrival, seq) whose removed entries are
    dropped when they surface (and the heap rebuilt once they are most of it)."""

    items: dict[int, QueueItem] = field(default_factory=dict)
    heap: list[tuple[float, int, int]] | None = None

    def add(self, item: QueueItem, rank: tuple[float, int] | None) -> None:
        self.items[item.seq] = item
        if rank is not None:
            self.heap = self.heap if self.heap is not None else []
            heapq.heappush(self.heap, (*rank, item.seq))

    def remove(self, seq: int) -> bool:
        if self.items.pop(seq, None) is None:
            return False
        if self.heap is not None and len(self.heap) > 2 * len(self.items) + 16:
            self.heap = [entry for entry in self.heap if entry[2] in self.items]
            heapq.heapify(self.heap)
        return True

    def head(self) -> QueueItem:
        """The request its ordering policy serves next."""
        if self.heap is None:
            return next(iter(self.items.values()))
        while self.heap[0][2] not in self.items:
            heapq.heappop(self.heap)
        return self.items[self.heap[0][2]]

    def head_rank(self) -> tuple[float, int, int]:
        self.head()
        assert self.heap is not None
        return self.heap[0]


@dataclass
class _Band:
    config: BandConfig
    flows: dict[str, _Flow] = field(default_factory=dict)
    requests: int = 0
    bytes: int = 0
    last_flow: str | None = None  # round robin's cursor


class FlowQueue:
    """Priority bands of per-fairness-id flows, with llm-d's capacity, TTL and dispatch rules.

    ``clock`` is monotonic seconds. Outcomes are delivered by calling the item's ``on_outcome``
    (after the item left every structure, so a callback may enqueue again).
    """

    def __init__(self, config: FlowControlConfig, clock: Callable[[], float], rng: random.Random | None = None,
                 ) -> None:
        self.config = config
        self.clock = clock
        rng = rng or random.Random()
        self.programs = {name: ProgramAware(params, clock(), rng) for name, params in config.programs}
        self.usage_limit = UsageLimit(config.usage_limit)
        self._static = frozenset((0, *(band.priority for band in config.bands)))
        self._desired: frozenset[int] = frozenset()
        # When a soft reflective ceiling shut the last dispatch cycle: poll again then (inf: no need).
        self.retry_at = math.inf
        self._bands: dict[int, _Band] = {}
        self.requests = 0
        self.bytes = 0
        self._seq = 0
        self._pool_empty = False
        self._regime_since = clock()
        self.closed = False
        # Called when a dispatch cycle stops at a level saturation blocks: (saturation, the levels
        # highest first, their ceilings, the blocked level's index). In-flight eviction hooks in here.
        self.on_blocked: Callable[[float, list[int], list[float], int], None] | None = None
        self.observer: FlowObserver | None = None

    def __len__(self) -> int:
        return self.requests

    def enqueue(self, item: QueueItem) -> bool:
        """Queue ``item``; False (its outcome delivered: saturated or shutting down) when it cannot be."""
        item.enqueued_at = self.clock()
        observer = self.observer
        if observer is None:
            return self._enqueue(item)
        observer.entered(item)
        start = time.perf_counter()
        queued = self._enqueue(item)
        observer.enqueued(item, time.perf_counter() - start)
        return queued

    def _enqueue(self, item: QueueItem) -> bool:
        if self.closed:
            self._deliver(item, Outcome.SHUTTING_DOWN)
            return False
        band = self._bands.get(item.priority)
        config = band.config if band is not None else self.config.band(item.priority)
        global_full = (self.config.max_requests is not None and self.requests + 1 > self.config.max_requests) or (
            self.config.max_bytes is not None and self.bytes + item.byte_size > self.config.max_bytes)
        requests, size = (band.requests, band.bytes) if band is not None else (0, 0)
        if global_full or requests + 1 > config.max_requests or size + item.byte_size > config.max_bytes:
            self._deliver(item, Outcome.REJECTED_SATURATED)
            return False
        if band is None:
            band = self._bands[item.priority] = _Band(config)
        self._seq += 1
        item.seq = self._seq
        if item.received_at is None:
            item.received_at = item.enqueued_at
        by_slo = config.ordering == slo_deadline.SLO_DEADLINE
        rank = slo_deadline.rank(item.headers, item.received_at) if by_slo else None
        band.flows.setdefault(item.fairness_id, _Flow()).add(item, rank)
        band.requests += 1
        band.bytes += item.byte_size
        self.requests += 1
        self.bytes += item.byte_size
        return True

    def cancel(self, item: QueueItem) -> None:
        """The client went away: drop ``item`` if still queued (outcome CANCELLED)."""
        if self._remove(item):
            self._deliver(item, Outcome.CANCELLED)

    def dispatch(self, saturation: Callable[[], float], *, limit: int | None = None) -> int:
        """Run dispatch cycles, one request each, until a cycle hands out none; the number dispatched."""
        count = 0
        self.retry_at = math.inf
        observer = self.observer
        while self.requests and (limit is None or count < limit):
            start = time.perf_counter() if observer is not None else 0.0
            item = self._cycle(saturation())
            if observer is not None:
                observer.dispatch_cycle(time.perf_counter() - start)
            if item is None:
                break
            self._remove(item)
            self._deliver(item, Outcome.DISPATCHED)
            count += 1
        return count

    def provision(self, priorities: Iterable[int]) -> None:
        """The priorities the InferenceObjectives give: their bands count as levels even when empty."""
        self._desired = frozenset(priorities)

    def priorities(self) -> list[int]:
        """The priority levels llm-d's registry holds, highest first: the configured bands and 0,
        the InferenceObjectives' priorities, and any band holding requests."""
        return sorted(self._static | self._desired | self._bands.keys(), reverse=True)

    def holds(self, priority: int) -> bool:
        """Whether the band of ``priority`` holds queued requests."""
        return priority in self._bands

    def set_pool_empty(self, empty: bool) -> None:
        """Follow the pool: with no endpoints ``noEndpointRequestTTL`` applies; a change restarts budgets."""
        if empty != self._pool_empty:
            self._pool_empty, self._regime_since = empty, self.clock()

    def ttl(self) -> float:
        """The queue-wait budget of the current regime (0: none)."""
        return self.config.no_endpoint_ttl_s if self._pool_empty else self.config.ttl_s

    def _deadline(self, item: QueueItem) -> float:
        ttl = self.ttl()
        return max(item.enqueued_at, self._regime_since) + ttl if ttl > 0 else math.inf

    def expire(self) -> int:
        """Evict requests past their budget (503 no endpoints while the pool is empty, else 429)."""
        now = self.clock()
        expired = [item for item in self._items() if self._deadline(item) <= now]
        outcome = Outcome.EVICTED_NO_ENDPOINTS if self._pool_empty else Outcome.EVICTED_TTL
        for item in expired:
            self._remove(item)
            self._deliver(item, outcome)
        return len(expired)

    def next_deadline(self) -> float:
        """When :meth:`expire` next has work (inf: never, until something changes)."""
        if not self.requests or self.ttl() <= 0:
            return math.inf
        # Each flow's first item is its oldest: the earliest deadline is among them.
        return min(self._deadline(next(iter(flow.items.values())))
                   for band in self._bands.values() for flow in band.flows.values())

    def shutdown(self) -> None:
        """Refuse new requests and evict every queued one (503 shutting down)."""
        self.closed = True
        for item in list(self._items()):
            self._remove(item)
            self._deliver(item, Outcome.SHUTTING_DOWN)

    # -- policies -------------------------------------------------------------------------------

    def _key(self, band: _Band, flow: _Flow) -> tuple[float, ...]:
        """Its head's place in the band's ordering, to compare flows by (global strict)."""
        if flow.heap is not None:
            return flow.head_rank()
        head = flow.head()
        if band.config.ordering == EDF:
            return (self._deadline(head), head.seq)
        return (head.seq,)

    def _cycle(self, saturation: float) -> QueueItem | None:
        """One dispatch cycle: the usage-limit policy's ceilings for the priority levels, highest
        first; the first level whose ceiling ``saturation`` reaches ends the cycle (head-of-line
        blocking, so lower priorities never overtake); else the first band with a request gives its pick."""
        priorities = self.priorities()
        ceilings = self.usage_limit.ceilings(saturation, priorities)
        for index, (priority, ceiling) in enumerate(zip(priorities, ceilings, strict=True)):
            if saturation >= ceiling:
                if self.usage_limit.alternating:  # the reference's 1 ms dispatch ticker would try again
                    self.retry_at = self.clock() + DISPATCH_TICK_S
                if self.on_blocked is not None:
                    self.on_blocked(saturation, priorities, ceilings, index)
                return None
            band = self._bands.get(priority)
            item = self._pick(band) if band is not None else None
            if item is not None:
                return item
        return None

    def _pick(self, band: _Band) -> QueueItem | None:
        """The band's fairness policy picks a flow, whose head goes next."""
        heads: Mapping[str, QueueItem] = {key: flow.head() for key, flow in band.flows.items()}
        if not heads:
            return None
        if band.config.fairness == ROUND_ROBIN:
            keys = sorted(heads)  # llm-d: sorted flow keys, the one after the last picked, else the first
            start = keys.index(band.last_flow) + 1 if band.last_flow is not None and band.last_flow in heads else 0
            band.last_flow = keys[start % len(keys)]
            return heads[band.last_flow]
        if band.config.fairness_name is not None:  # program-aware-fairness
            program = self.programs[band.config.fairness_name]
            chosen = program.pick({key: head.enqueued_at for key, head in heads.items()}, self.clock())
            if chosen is None:
                return None
            heads[chosen].program_picked = True
            return heads[chosen]
        best = min(band.flows, key=lambda key: self._key(band, band.flows[key]))
        return heads[best]

    # -- bookkeeping ----------------------------------------------------------------------------

    def _items(self) -> Iterator[QueueItem]:
        for band in list(self._bands.values()):
            for flow in list(band.flows.values()):
                yield from list(flow.items.values())

    def _remove(self, item: QueueItem) -> bool:
        band = self._bands.get(item.priority)
        flow = band.flows.get(item.fairness_id) if band is not None else None
        if band is None or flow is None or not flow.remove(item.seq):
            return False
        if not flow.items:
            del band.flows[item.fairness_id]
        band.requests -= 1
        band.bytes -= item.byte_size
        self.requests -= 1
        self.bytes -= item.byte_size
        if not band.requests:
            del self._bands[item.priority]
        return True

    def _deliver(self, item: QueueItem, outcome: Outcome) -> None:
        item.outcome = outcome
        if self.observer is not None:
            self.observer.left(item, outcome, self.clock() - item.enqueued_at)
        item.on_outcome(outcome)

    def stats(self) -> dict[int, tuple[int, int]]:
        """Per band priority: (requests, bytes) queued."""
        return {p: (b.requests, b.bytes) for p, b in self._bands.items()}
