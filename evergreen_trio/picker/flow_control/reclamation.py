"""When flow control evicts in-flight requests, and how many: llm-d-router's reclamation controller, sans-IO.

A dispatch cycle that stops at a priority level the saturation blocks (head-of-line blocking)
calls :meth:`ReclamationController.maybe_reclaim`. Demand is eligible when a blocked band, with
an attainable ceiling (> 0), holds queued requests of a priority strictly above the next victim's.
Then one decision sizes the revocations, all in the saturation gauge's units::

    reclaim target = saturation - the blocked band's ceiling
    credit         = saturation / requests in flight      (a request's mean footprint)
    n              = max(1, ceil((target - pending reclaim) / credit)),
                     capped by max_revocations_per_decision and by the evictable requests

and evicts them, none at or above the demand's priority. Pacing is stop-and-wait: the next
decision waits until every revocation is confirmed (its stream ended) or timed out
(``confirmation_timeout_s``), and each one's debit has cooled for ``confirmation_grace_s``
(the time the freed capacity takes to show in the gauge). The grace comes from the detector
(:func:`confirmation_grace`), as llm-d-router derives it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from evergreen_trio.picker.flow_control.config import ConcurrencyDetector, UtilizationDetector

DEFAULT_MAX_REVOCATIONS_PER_DECISION = 2
DEFAULT_CONFIRMATION_GRACE_S = 0.5
DEFAULT_CONFIRMATION_TIMEOUT_S = 10.0
# The engine's abort and KV garbage collection before freed capacity shows in scraped metrics.
ENGINE_RECLAIM_BUDGET_S = 0.25
# A detector reading the picker's own counts sees the capacity at once: a few dispatch ticks.
LEADING_SENSOR_GRACE_S = 0.01
CONFIRMED, TIMED_OUT = "confirmed", "timed_out"


@dataclass(frozen=True)
class ReclamationConfig:
    """The controller's tuning (llm-d-router's defaults; its API exposes none of them)."""

    max_revocations_per_decision: int = DEFAULT_MAX_REVOCATIONS_PER_DECISION
    confirmation_grace_s: float = DEFAULT_CONFIRMATION_GRACE_S
    confirmation_timeout_s: float = DEFAULT_CONFIRMATION_TIMEOUT_S


def confirmation_grace(detector: UtilizationDetector | ConcurrencyDetector, refresh_interval_s: float,
                       staleness_s: float) -> float:
    """How long a confirmed revocation keeps suppressing the next decision: 10 ms with the
    ``concurrency-detector`` (its counts drop when the stream ends), else a scrape interval, the
    metrics staleness threshold and the engine's reclaim budget (llm-d-router's derivation)."""
    if isinstance(detector, ConcurrencyDetector):
        return LEADING_SENSOR_GRACE_S
    return refresh_interval_s + staleness_s + ENGINE_RECLAIM_BUDGET_S


class InFlightEvictor(Protocol):
    """What the controller needs of the eviction side (a :class:`~.eviction.RequestEvictor`)."""

    def evict_n(self, n: int, priority_bound: int) -> list[int]: ...

    def stats(self) -> tuple[int, int]: ...

    def victim_priority(self) -> int | None: ...


class ReclamationObserver:
    """What the controller reports (llm-d-router's reclamation metrics); this one records nothing."""

    def issued(self, priority: int, count: int) -> None:
        """``count`` revocations were issued for demand at ``priority``."""

    def revoked(self, outcome: str) -> None:
        """One revocation ended: ``confirmed`` or ``timed_out``."""

    def reclaim_target(self, target: float) -> None:
        """The last decision's deficit."""

    def pending_reclaim(self, pending: float) -> None:
        """The debits of revocations outstanding or cooling."""

    def confirmed_after(self, seconds: float) -> None:
        """A revocation was confirmed this long after it was issued."""


@dataclass
class _Revocation:
    credit: float
    issued_at: float


class ReclamationController:
    """Decides when in-flight eviction fires and how many requests it revokes; ``clock`` is monotonic seconds."""

    def __init__(self, config: ReclamationConfig, evictor: InFlightEvictor, clock: Callable[[], float],
                 observer: ReclamationObserver | None = None) -> None:
        self.config = config
        self.evictor = evictor
        self.clock = clock
        self.observer = observer or ReclamationObserver()
        self.outstanding: dict[int, _Revocation] = {}
        self.cooling: list[tuple[float, float]] = []  # (credit, when its debit expires)
        self.pending_reclaim = 0.0
        # While a decision evicts: the streams that ended already (an evict signal may end one at once).
        self._ended_early: set[int] | None = None

    def gate_open(self) -> bool:
        """Whether a decision may run: nothing outstanding, nothing cooling (timed-out revocations
        and cooled debits are retired first)."""
        now = self.clock()
        self._sweep_timeouts(now)
        self._expire_cooling(now)
        return not self.outstanding and not self.cooling

    def maybe_reclaim(self, saturation: float, priorities: Sequence[int], ceilings: Sequence[float],
                      blocked_at: int, queued: Callable[[int], bool]) -> None:
        """A dispatch cycle stopped at ``priorities[blocked_at]`` (levels highest first, with their
        ``ceilings``); reclaim for the first blocked level that holds queued requests (``queued``)
        of a priority strictly above the next victim's."""
        if not self.gate_open():
            return
        victim = self.evictor.victim_priority()
        if victim is None:
            return
        for priority, ceiling in zip(priorities[blocked_at:], ceilings[blocked_at:], strict=True):
            if priority <= victim:
                return  # no same-band churn, and later levels are lower still
            # A zero ceiling is a policy that the band never dispatches: no reclamation can open it.
            if ceiling <= 0 or saturation < ceiling or not queued(priority):
                continue
            self.reclaim(saturation, ceiling, priority)
            return

    def reclaim(self, saturation: float, ceiling: float, demand_priority: int) -> None:
        """One sizing decision for demand at ``demand_priority`` blocked by ``ceiling``, and its revocations."""
        in_flight, evictable = self.evictor.stats()
        if in_flight <= 0 or evictable <= 0:
            return
        credit = saturation / in_flight
        if not (credit > 0 and math.isfinite(credit)):
            return
        target = saturation - ceiling
        net = target - self.pending_reclaim
        self.observer.reclaim_target(target)
        if net < 0 or (net == 0 and self.pending_reclaim > 0):
            return  # the debits pending cover the deficit
        # Dispatch needs saturation below the ceiling, strictly: at net 0 one revocation is still due.
        cap = min(self.config.max_revocations_per_decision, evictable)
        count = min(cap, max(1, math.ceil(min(net / credit, cap))))
        self._ended_early = set()
        try:
            evicted = self.evictor.evict_n(count, demand_priority)
        finally:
            ended, self._ended_early = self._ended_early, None
        now = self.clock()
        for request_id in evicted:
            self.outstanding[request_id] = _Revocation(credit, now)
            self.pending_reclaim += credit
        self.observer.issued(demand_priority, len(evicted))
        self.observer.pending_reclaim(self.pending_reclaim)
        for request_id in ended.intersection(evicted):
            self.confirm(request_id)

    def confirm(self, request_id: int) -> None:
        """An evicted request's stream ended; an id not outstanding (timed out already) is ignored."""
        if self._ended_early is not None:
            self._ended_early.add(request_id)  # its revocation is being issued: confirmed right after
            return
        revocation = self.outstanding.pop(request_id, None)
        if revocation is None:
            return
        now = self.clock()
        self.cooling.append((revocation.credit, now + self.config.confirmation_grace_s))
        self.observer.revoked(CONFIRMED)
        self.observer.confirmed_after(now - revocation.issued_at)

    def next_change(self) -> float:
        """When a revocation times out or a debit cools (inf: none is due), for the shell to poll
        then; what is due already is retired first, so the time is in the future (no busy poll)."""
        now = self.clock()
        self._sweep_timeouts(now)
        self._expire_cooling(now)
        timeout = self.config.confirmation_timeout_s
        return min((*(r.issued_at + timeout for r in self.outstanding.values()),
                    *(expires for _, expires in self.cooling)), default=math.inf)

    def _sweep_timeouts(self, now: float) -> None:
        """A revocation never confirmed within the timeout counts as confirmed (a hung stream must
        not hold the gate shut)."""
        timeout = self.config.confirmation_timeout_s
        for request_id in [i for i, r in self.outstanding.items() if now - r.issued_at >= timeout]:
            revocation = self.outstanding.pop(request_id)
            self.cooling.append((revocation.credit, now + self.config.confirmation_grace_s))
            self.observer.revoked(TIMED_OUT)

    def _expire_cooling(self, now: float) -> None:
        expired = [credit for credit, expires in self.cooling if now >= expires]
        if not expired:
            return
        self.cooling = [debit for debit in self.cooling if now < debit[1]]
        # With no debit left the sum is 0 exactly: a float residue must not swallow a boundary decision.
        left = self.pending_reclaim - sum(expired) if self.cooling or self.outstanding else 0.0
        self.pending_reclaim = max(left, 0.0)
        self.observer.pending_reclaim(self.pending_reclaim)
