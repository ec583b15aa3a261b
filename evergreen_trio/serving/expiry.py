"""One timer for every open session's deadline and idle timeout, instead of a task per session.

A task per session cost a spawn, a nursery and two task steps of every session, however short.
Here each session has one entry in a heap ordered by when it may expire next; the server's one
timer task sleeps until the earliest, then looks again at what is due: a session that was active
meanwhile is put back at its new time, one that is due gets ``on_expired`` (which sends its
DEADLINE_EXCEEDED) and is cancelled. Ended sessions leave their entry behind (it is skipped when
it comes up), and the heap is rebuilt once such entries outnumber the live ones.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from evergreen_trio._grpc.streams import MessageStream

DEADLINE_PASSED = "the call's deadline (grpc-timeout) passed"
COMPACT_AFTER = 64
"""Ended sessions' entries left in the heap before it is rebuilt (once they are also half of it)."""


class Running(Protocol):
    @property
    def working(self) -> bool: ...


class Watched:
    """One session's entry: what it is, when it started, its jitter. An ended session's entry lets go
    of the session (it may wait in the heap a while)."""

    __slots__ = ("jitter", "scope", "session", "started", "stream")

    def __init__(self, stream: MessageStream[Any], session: Running, scope: trio.CancelScope) -> None:
        self.stream: MessageStream[Any] | None = stream
        self.session: Running | None = session
        self.scope: trio.CancelScope | None = scope
        self.started = trio.current_time()
        self.jitter = 1.0 + random.random() / 10

    @property
    def done(self) -> bool:
        return self.stream is None

    def release(self) -> None:
        self.stream = self.session = self.scope = None


class SessionExpiry:
    """The timer task (:meth:`run`, for the server's nursery) and the sessions it watches."""

    def __init__(
        self,
        first_message_timeout: float,
        idle_timeout: float | None,
        on_expired: Callable[[MessageStream[Any], str], Awaitable[None]],
    ) -> None:
        self.first_message_timeout = first_message_timeout
        self.idle_timeout = idle_timeout
        self._on_expired = on_expired
        self._heap: list[tuple[float, int, Watched]] = []
        self._order = itertools.count()
        self._ended = 0  # entries of ended sessions still in the heap
        self._sleep: trio.CancelScope | None = None

    def watch(self, stream: MessageStream[Any], session: Running, scope: trio.CancelScope) -> Watched:
        """Watch a session from now: ``scope`` is cancelled when it expires."""
        watched = Watched(stream, session, scope)
        due = self._due(watched, watched.started)
        if due is not None:
            self._push(due[0], watched)
        return watched

    def forget(self, watched: Watched) -> None:
        """The session ended: its entry is skipped, and the heap rebuilt once such entries pile up."""
        if watched.done:
            return
        watched.release()
        self._ended += 1
        if self._ended > COMPACT_AFTER and self._ended * 2 > len(self._heap):
            self._heap = [entry for entry in self._heap if not entry[2].done]
            heapq.heapify(self._heap)
            self._ended = 0

    def _due(self, watched: Watched, now: float) -> tuple[float, str] | None:
        """When the session expires if nothing happens until then, and why (None: never)."""
        stream, session = watched.stream, watched.session
        assert stream is not None and session is not None, "an ended session is not looked at"
        candidates: list[tuple[float, str]] = []
        if stream.deadline is not None:
            candidates.append((stream.deadline, DEADLINE_PASSED))
        if stream.received == 0:  # the peer ended its stream without a message
            timeout = self.first_message_timeout
            candidates.append(
                (watched.started + timeout * watched.jitter, f"no message within {timeout:g} s of opening the session")
            )
        elif self.idle_timeout is not None:
            idle_until = stream.last_activity + self.idle_timeout * watched.jitter
            if session.working:  # an action computes; one waiting for the peer's input does not count
                idle_until = max(idle_until, now + self.idle_timeout)
            candidates.append((idle_until, f"no message either way for {self.idle_timeout:g} s"))
        return min(candidates) if candidates else None

    def _push(self, at: float, watched: Watched) -> None:
        heapq.heappush(self._heap, (at, next(self._order), watched))
        if self._sleep is not None and at < self._sleep.deadline:
            self._sleep.deadline = at

    async def run(self) -> None:
        """Expire sessions as they come due, one per scheduling pass (``on_expired`` takes its turn)."""
        while True:
            now = trio.current_time()
            while self._heap and self._heap[0][0] <= now:
                _, _, watched = heapq.heappop(self._heap)
                if watched.done:
                    self._ended -= 1
                    continue
                due = self._due(watched, now)
                if due is None:
                    continue
                if due[0] > now:
                    self._push(due[0], watched)
                    continue
                stream, scope = watched.stream, watched.scope
                assert stream is not None and scope is not None
                watched.release()  # its session's forget() comes as it ends, and finds it released
                await self._on_expired(stream, due[1])
                scope.cancel()
                now = trio.current_time()
            with trio.CancelScope(deadline=self._heap[0][0] if self._heap else math.inf) as sleep:
                self._sleep = sleep
                await trio.sleep_forever()
            self._sleep = None
