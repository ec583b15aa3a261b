"""In-flight eviction, sans-IO: which dispatched requests flow control may revoke, and in what order.

llm-d-router's ``pkg/epp/flowcontrol/eviction``. Every request flow control dispatches is tracked
while its ext_proc stream is open (:meth:`RequestEvictor.track` when it is scheduled,
:meth:`RequestEvictor.untrack` once when its stream ends, whichever way). The filter policy says
which of them may be evicted (``sheddable-eviction-filter``: priority < 0) and the ordering policy
which goes first (``priority-then-time-eviction-order-policy``: the lowest priority, then the most
recently dispatched, which has the least KV cache invested). :meth:`RequestEvictor.evict_n` revokes
victims in that order, strictly below a priority bound, by calling each one's ``evict``: its stream
then answers 429 with the dropped reason ``evicted`` and ends. When an evicted request's stream
ends, ``on_terminated`` hears of it once: the reclamation controller's confirmation.

Requests are keyed by an id the picker gives them (the queue's sequence number), not by the
client's ``x-request-id`` as in llm-d-router: a client-chosen id could name another request.
Memory follows the open streams: a tracked id is dropped when its stream ends, evicted or not.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)

SHEDDABLE_FILTER = "sheddable-eviction-filter"
PRIORITY_THEN_TIME = "priority-then-time-eviction-order-policy"
# What an evicted request's client gets (llm-d-router's ImmediateResponse and dropped reason).
EVICTED_STATUS = 429
EVICTED_REASON = "evicted"
EVICTED_MESSAGE = "request evicted by flow control"


@dataclass(frozen=True, eq=False)
class EvictionItem:
    """A dispatched request that may be evicted: its id, priority, when it was dispatched (the
    queue's clock), and ``evict``, which tells its stream to end (llm-d-router's ``EvictCh``)."""

    request_id: int
    priority: int
    dispatched_at: float
    evict: Callable[[], None]


class EvictionFilter(Protocol):
    """Which tracked requests are evictable (llm-d-router's ``EvictionFilterPolicy``)."""

    def accept(self, item: EvictionItem) -> bool: ...


class EvictionOrdering(Protocol):
    """Which evictable request goes first: the smallest key (llm-d-router's ``EvictionOrderingPolicy.Less``)."""

    def key(self, item: EvictionItem) -> tuple[float, ...]: ...


class SheddableFilter:
    """``sheddable-eviction-filter``: only sheddable requests (priority < 0) may be evicted."""

    def accept(self, item: EvictionItem) -> bool:
        return item.priority < 0


class PriorityThenTime:
    """``priority-then-time-eviction-order-policy``: the lowest priority first, then the newest dispatch."""

    def key(self, item: EvictionItem) -> tuple[float, ...]:
        return (item.priority, -item.dispatched_at)


_Entry = tuple[tuple[float, ...], int, EvictionItem]


class EvictionQueue:
    """Every tracked request, and the evictable ones in a heap by the ordering policy.

    Untracking drops an entry from the index at once and leaves it in the heap until it surfaces
    (the heap is rebuilt once dead entries are most of it), so both stay within twice what is
    tracked. Ties of the ordering go to the most recently tracked.
    """

    def __init__(self, ordering: EvictionOrdering, accept: EvictionFilter) -> None:
        self._ordering = ordering
        self._filter = accept
        self._in_flight: dict[int, EvictionItem] = {}
        self._live: dict[int, _Entry] = {}  # evictable id -> its entry in the heap
        self._heap: list[_Entry] = []
        self._seq = 0

    def track(self, item: EvictionItem) -> None:
        """Follow ``item``; an id tracked already is replaced."""
        self.untrack(item.request_id)
        self._in_flight[item.request_id] = item
        if self._filter.accept(item):
            self._seq += 1
            entry = (self._ordering.key(item), -self._seq, item)
            self._live[item.request_id] = entry
            heapq.heappush(self._heap, entry)

    def untrack(self, request_id: int) -> None:
        """Forget ``request_id`` (nothing when it is not tracked)."""
        self._in_flight.pop(request_id, None)
        if self._live.pop(request_id, None) is not None and len(self._heap) > 2 * len(self._live) + 16:
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def peek(self) -> EvictionItem | None:
        """The next victim, left in place; None when nothing is evictable."""
        heap = self._heap
        while heap and self._live.get(heap[0][2].request_id) is not heap[0]:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def pop_n(self, n: int) -> list[EvictionItem]:
        """Take up to ``n`` victims, in order; they are no longer tracked."""
        taken: list[EvictionItem] = []
        while len(taken) < n:
            item = self.peek()
            if item is None:
                break
            heapq.heappop(self._heap)
            del self._live[item.request_id]
            del self._in_flight[item.request_id]
            taken.append(item)
        return taken

    @property
    def evictable(self) -> int:
        return len(self._live)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)


class RequestEvictor:
    """Tracks dispatched requests and evicts them (llm-d-router's ``RequestEvictor`` with its
    ``ImmediateResponseEvictor``): ``on_terminated`` hears once of each evicted request's stream end."""

    def __init__(self, ordering: EvictionOrdering | None = None, accept: EvictionFilter | None = None) -> None:
        self.queue = EvictionQueue(ordering or PriorityThenTime(), accept or SheddableFilter())
        self._evicted: set[int] = set()  # evicted, their streams not ended yet
        self.on_terminated: Callable[[int], None] = lambda request_id: None

    def track(self, item: EvictionItem) -> None:
        """A request was dispatched (the reference's PreRequest)."""
        self.queue.track(item)

    def untrack(self, request_id: int) -> None:
        """A tracked request's stream ended, whichever way; an evicted one's is confirmed."""
        self.queue.untrack(request_id)
        if request_id in self._evicted:
            self._evicted.discard(request_id)
            self.on_terminated(request_id)

    def victim_priority(self) -> int | None:
        """The priority of the request :meth:`evict_n` would evict first; None when none is evictable."""
        item = self.queue.peek()
        return item.priority if item is not None else None

    def stats(self) -> tuple[int, int]:
        """(tracked requests, evictable requests)."""
        return self.queue.in_flight, self.queue.evictable

    def evict_n(self, n: int, priority_bound: int) -> list[int]:
        """Evict up to ``n`` requests in victim order, stopping at the first whose priority is not
        strictly below ``priority_bound`` (no victim at or above the demand it makes room for);
        the ids evicted. Each victim is untracked and told through its ``evict``."""
        evicted: list[int] = []
        while len(evicted) < n:
            victim = self.queue.peek()
            if victim is None or victim.priority >= priority_bound:
                break
            self.queue.pop_n(1)
            self._evicted.add(victim.request_id)  # before the signal: its stream may end at once
            victim.evict()
            evicted.append(victim.request_id)
        if evicted:
            log.info("picker.flow_control_evicted requested=%d evicted=%d priority_bound=%d", n, len(evicted),
                     priority_bound)
        return evicted

    @property
    def unconfirmed(self) -> int:
        """Evicted requests whose streams have not ended yet."""
        return len(self._evicted)
