"""What a gRPC stream looks like to the Trio side, whichever transport carries it: no asyncio here.

A :class:`MessageStream` pairs two :class:`Handoff` queues (inbound messages, outbound items). The
server's shell (``server.py``) fills and drains them for a task-per-stream method through the server
wire, told of the Trio side's puts and takes by ``notify``; the client (``client.py``) does the same
through the client wire.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio
from google.protobuf.message import Message
from grpclib.const import Status

from evergreen_trio.errors import EvergreenTrioError

T = TypeVar("T")

INBOUND_CAPACITY = 64
"""Received messages a stream queues for its Trio reader (the transport's flow control bounds the rest)."""

OUTBOUND_CAPACITY = 1024
"""Items a stream queues for its transport before a put waits."""


class HandoffClosedError(EvergreenTrioError):
    """The other side closed the handoff; ``error`` says why when it failed."""


class Handoff(Generic[T]):
    """A bounded same-thread queue between a transport and Trio tasks.

    A put waits only while ``capacity`` items are queued (backpressure); a get waits only while
    empty, then takes everything queued at once (batched receive). A transport that must not wait
    (one reader serving many streams, bounded by flow control instead) queues with :meth:`push`.
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._closed = False
        self._error: BaseException | None = None
        self._trio_wakeup: trio.Event | None = None
        self.notify: Callable[[], object] | None = None
        """Called on every change (a put, a take, the close): how a transport learns of the Trio side's."""
        self.consumer: Callable[[T], bool] | None = None
        """The Trio side's taker of an item pushed while none is queued, in the pusher's step: True when
        it took the item (then nothing is queued and nobody is woken), False to have it queued."""

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, error: BaseException | None = None) -> None:
        """No more puts; gets drain what is queued, then raise ``error`` or return ``[]``."""
        if not self._closed:
            self._closed = True
            self._error = error
            self._wake()

    def _wake(self) -> None:
        if self._trio_wakeup is not None:
            self._trio_wakeup.set()
            self._trio_wakeup = None
        if self.notify is not None:
            self.notify()

    def push(self, item: T) -> bool:
        """Queue ``item`` now, full or not, unless the ``consumer`` takes it at once (True then); raises
        :class:`HandoffClosedError` once closed."""
        if self._closed:
            raise HandoffClosedError("the stream is closed") from self._error
        if not self._items and self.consumer is not None and self.consumer(item):
            return True
        self._items.append(item)
        self._wake()
        return False

    def _take(self, limit: int) -> list[T]:
        if not self._items:
            if self._error is not None:
                raise self._error
            return []
        count = min(limit, len(self._items))
        batch = [self._items.popleft() for _ in range(count)]
        self._wake()
        return batch

    def release(self) -> None:
        """Close and drop what is held: queued items, the error (whose traceback keeps frames) and the consumer."""
        self.close()
        self._items.clear()
        self._error = None
        self.consumer = None

    def take_nowait(self, limit: int) -> list[T]:
        """Transport side: up to ``limit`` queued items, now (``[]`` when none; the error once closed and drained)."""
        return self._take(limit)

    @property
    def full(self) -> bool:
        """Whether a put would wait (``capacity`` items queued, the handoff open)."""
        return self._full()

    @property
    def drained(self) -> bool:
        """Closed, and every item taken."""
        return self._closed and not self._items

    def _full(self) -> bool:
        return len(self._items) >= self._capacity and not self._closed

    @property
    def ready(self) -> bool:
        """Whether :meth:`wait` returns at once: an item is queued, or the handoff is closed."""
        return not self._empty()

    def _empty(self) -> bool:
        return not self._items and not self._closed

    async def put(self, item: T) -> None:
        """Trio side: queue ``item``, waiting while the queue is full."""
        while len(self._items) >= self._capacity and not self._closed:  # _full(), inline: a put per fragment
            if self._trio_wakeup is None:
                self._trio_wakeup = trio.Event()
            await self._trio_wakeup.wait()
        self.push(item)

    async def wait(self) -> None:
        """Trio side: wait until an item is queued or the handoff is closed (taking nothing)."""
        while self._empty():
            if self._trio_wakeup is None:
                self._trio_wakeup = trio.Event()
            await self._trio_wakeup.wait()

    async def get_batch(self, limit: int = 1 << 30) -> list[T]:
        """Trio side: wait for items, return up to ``limit``; ``[]`` once closed and drained.

        A cancellation point either way, a scheduling point only when it waits: items already queued
        are taken in the same step (a scheduling pass fewer on a message's way to its session; a
        caller looping over batches still yields, since the items come from other tasks)."""
        if self._empty():
            await self.wait()
        else:
            await trio.lowlevel.checkpoint_if_cancelled()
        return self._take(limit)


@dataclass
class FinalStatus:
    status: Status
    message: str | None = None


class MessageStream(Generic[T]):
    """The Trio side's handle on one gRPC stream.

    ``inbound`` yields received messages (``[]`` at the peer's end of stream; :class:`RpcAbortError`
    when the stream ended with an error status); ``outbound`` takes items that ``pack``
    turns into messages. :meth:`finish` ends the stream: on a server with a status, on a
    client by half-closing (or resetting, for a non-OK status).

    On a server, ``metadata`` (lower-case keys; binary ``-bin`` entries left out), ``peer``,
    ``peer_certificate`` (mTLS) and ``deadline`` (Trio time, from ``grpc-timeout``) describe the
    call; ``received`` counts inbound messages and ``last_activity`` (Trio time) is when the last
    message went either way.
    """

    def __init__(
        self,
        pack: Callable[[list[T]], Iterable[Message]],
        *,
        inbound_capacity: int = INBOUND_CAPACITY,
        outbound_capacity: int = OUTBOUND_CAPACITY,
        inbound: Handoff[Message] | None = None,
        outbound: Handoff[T] | None = None,
    ) -> None:
        self.inbound: Handoff[Message] = inbound if inbound is not None else Handoff(inbound_capacity)
        self.outbound: Handoff[T] = outbound if outbound is not None else Handoff(outbound_capacity)
        self.pack = pack
        self.final: FinalStatus | None = None
        self.peer: str = ""
        self.peer_certificate: dict[str, Any] | None = None
        self.metadata: dict[str, str] = {}
        self.deadline: float | None = None
        self.received = 0
        self.last_activity = trio.current_time()
        self._done = trio.Event()

    def finish(self, status: Status | int = Status.OK, message: str | None = None) -> None:
        """End the stream: queued items are sent first, then the status (server) or end of stream."""
        if self.final is None:
            self.final = FinalStatus(status if isinstance(status, Status) else Status(status), message)
            self.outbound.close()

    async def wait_closed(self, *, shield: bool = False) -> None:
        """Wait until the transport has sent everything and released the stream (``shield``: whatever
        cancels the caller). No scheduling pass and no cancel scope when it already has: a client leaving
        a finished session goes on in the same step."""
        if self._done.is_set():
            return
        if shield:
            with trio.CancelScope(shield=True):
                await self._done.wait()
        else:
            await self._done.wait()

    def release(self) -> None:
        """The Trio side reads no more: drop unread messages and the final error.

        grpclib keeps finished handler tasks (and their exceptions' tracebacks, which reach this
        stream) until its periodic cleanup; released, the stream no longer keeps a session alive.
        Outbound items stay: they are still being sent.
        """
        self.inbound.release()

    def _mark_closed(self) -> None:
        self._done.set()
