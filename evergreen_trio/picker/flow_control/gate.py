"""The picker's flow control, sans-IO: the queue, the pool it watches and the saturation detector.

:meth:`FlowGate.submit` admits a request and dispatches at once what saturation allows, so an
unsaturated pool adds no wait; :meth:`FlowGate.poll` (the Trio shell calls it after every scrape,
at the next TTL deadline, and at least once per scrape interval) follows the pool, evicts what
expired and dispatches again. With ``enableEviction`` it tracks each scheduled request until it
completes (:mod:`.eviction`) and, when saturation blocks a band, lets the reclamation controller
(:mod:`.reclamation`) evict sheddable in-flight requests.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from evergreen_trio.picker.flow_control.config import FlowControlConfig
from evergreen_trio.picker.flow_control.detectors import Reading, staged_saturation
from evergreen_trio.picker.flow_control.eviction import EvictionItem, RequestEvictor
from evergreen_trio.picker.flow_control.queue import FlowQueue, QueueItem
from evergreen_trio.picker.flow_control.reclamation import (
    ReclamationConfig,
    ReclamationController,
    confirmation_grace,
)
from evergreen_trio.picker.inflight import InflightLoad
from evergreen_trio.picker.scheduler import PoolSnapshot
from evergreen_trio.picker.usage import Usage


class FlowGate:
    """One pool's flow control: ``queue`` plus the detector's reading of ``snapshot`` and ``load``,
    per pipeline stage as llm-d-router's flow controller reads it (the largest one gates).

    ``refresh_interval_s`` (the scrape interval) sizes eviction's confirmation grace. ``wake`` is
    the shell's: it polls soon after, which it is asked to when an evicted request's stream ended.
    """

    def __init__(self, config: FlowControlConfig, snapshot: PoolSnapshot, load: InflightLoad, *,
                 refresh_interval_s: float = 0.05) -> None:
        self.config = config
        self.snapshot = snapshot
        self.load = load
        self.queue = FlowQueue(config, snapshot.clock)
        self.readings: dict[str, Reading] = {}
        self.wake: Callable[[], object] = lambda: None
        self.evictor: RequestEvictor | None = None
        self.reclamation: ReclamationController | None = None
        if config.eviction:
            self.evictor = RequestEvictor()
            grace = confirmation_grace(config.detector, refresh_interval_s, snapshot.staleness_s)
            self.reclamation = ReclamationController(ReclamationConfig(confirmation_grace_s=grace), self.evictor,
                                                     lambda: self.queue.clock())
            self.evictor.on_terminated = self._confirmed
            self.queue.on_blocked = self._blocked

    def saturation(self) -> float:
        """The configured detector's effective reading of the pool now (1.0 or more: dispatch nothing);
        the readings per stage are kept in :attr:`readings` for the metrics."""
        self.readings = staged_saturation(self.config.detector, list(self.snapshot.states.values()),
                                          self.snapshot.clock(), self.load)
        return self.readings["effective"].saturation

    def submit(self, item: QueueItem) -> None:
        """Queue ``item`` and dispatch what the pool takes now; the item's outcome may come at once."""
        self.queue.set_pool_empty(not self.snapshot.states)
        if self.queue.enqueue(item):
            self.queue.dispatch(self.saturation)

    def poll(self) -> None:
        """Follow the pool, evict expired requests, dispatch what saturation allows."""
        self.queue.set_pool_empty(not self.snapshot.states)
        self.queue.expire()
        self.queue.dispatch(self.saturation)

    def started(self, item: QueueItem) -> None:
        """``item`` was dispatched and scheduled (the reference's PreRequest): the program-aware
        policies count it in flight."""
        now = self.snapshot.clock()
        item.running = True
        for program in self.queue.programs.values():
            program.dispatched(item.fairness_id, item.enqueued_at if item.program_picked else None, now)
        if self.evictor is not None and item.on_evict is not None:
            self.evictor.track(EvictionItem(item.seq, item.priority, self.queue.clock(), item.on_evict))

    def completed(self, item: QueueItem, usage: Usage | None) -> None:
        """A started ``item``'s response ended, or its stream did (the reference's end-of-stream
        hook): the program-aware policies add its tokens to its program's service. Once per item."""
        if not item.running:
            return
        item.running = False
        now = self.snapshot.clock()
        for program in self.queue.programs.values():
            program.completed(item.fairness_id, usage, now)
        if self.evictor is not None:
            self.evictor.untrack(item.seq)

    def provision(self, priorities: Iterable[int]) -> None:
        """The InferenceObjectives' priorities (all of them, each time they change): llm-d keeps a
        band for each, which the usage-limit policies count even while it is empty."""
        self.queue.provision(priorities)

    def next_deadline(self) -> float:
        """When to poll next: a queued request's budget runs out, a soft reflective ceiling that
        shut the last dispatch may open, or, while requests wait, eviction's pacing gate may (inf: none)."""
        reclaim = self.reclamation.next_change() if self.reclamation is not None and len(self.queue) else math.inf
        return min(self.queue.next_deadline(), self.queue.retry_at, reclaim)

    def _blocked(self, saturation: float, priorities: list[int], ceilings: list[float], index: int) -> None:
        assert self.reclamation is not None
        self.reclamation.maybe_reclaim(saturation, priorities, ceilings, index, self.queue.holds)

    def _confirmed(self, request_id: int) -> None:
        """An evicted request's stream ended: its capacity may be free (the concurrency detector
        sees it at once), so the shell polls again."""
        assert self.reclamation is not None
        self.reclamation.confirm(request_id)
        self.wake()
