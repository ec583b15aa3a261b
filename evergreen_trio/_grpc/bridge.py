"""The one grpclib <-> Trio bridge: the only module of the package that touches asyncio.

grpclib runs on a trio-asyncio loop. Crossing between Trio and asyncio once per message
costs about 50 us, so nothing here crosses per message: each gRPC stream gets two
long-lived asyncio pumps (reader and writer) that exchange messages with Trio tasks
through a :class:`Handoff`, a same-thread queue whose put and get are plain calls that
wait only for backpressure. Both sides run on the Trio thread, so waking the other side
is a plain ``Event.set`` / ``Future.set_result``.

Rules kept here: no single ``recv_message`` is ever cancelled (that corrupted framing in
a test; a stream that must stop is reset, which ends the pending read with an error);
shutdown steps are shielded; a final status always reaches the peer.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import socket
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import h2.exceptions
import trio
import trio_asyncio
from google.protobuf.message import Message
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError
from grpclib.server import Server, Stream

from evergreen_trio.errors import EvergreenTrioError

log = logging.getLogger(__name__)

T = TypeVar("T")
Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
ReqIn = TypeVar("ReqIn", bound=Message, contravariant=True)
RepOut = TypeVar("RepOut", bound=Message, covariant=True)


CLOSE_TIMEOUT_SECONDS = 5.0
"""How long a stopping server waits for grpclib to release its connections."""


class RpcAbort(EvergreenTrioError):
    """Ends a gRPC stream with ``status``; raised by handlers, or received when the peer ended it so."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message


class HandoffClosed(EvergreenTrioError):
    """The other side closed the handoff; ``error`` says why when it failed."""


class Handoff(Generic[T]):
    """A bounded same-thread queue between an asyncio pump and Trio tasks.

    ``put``/``get_batch`` are for Trio, ``aio_put``/``aio_get_batch`` for asyncio. A put waits
    only while ``capacity`` items are queued (backpressure); a get waits only while empty,
    then takes everything queued at once (batched receive).
    """

    def __init__(self, capacity: int) -> None:
        self._items: deque[T] = deque()
        self._capacity = capacity
        self._closed = False
        self._error: BaseException | None = None
        self._trio_wakeup: trio.Event | None = None
        self._aio_wakeup: asyncio.Future[None] | None = None

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
        if self._aio_wakeup is not None:
            if not self._aio_wakeup.done():
                self._aio_wakeup.set_result(None)
            self._aio_wakeup = None

    def _push(self, item: T) -> None:
        if self._closed:
            raise HandoffClosed("the stream is closed") from self._error
        self._items.append(item)
        self._wake()

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
        """Close and drop what is held: queued items and the error (whose traceback keeps frames)."""
        self.close()
        self._items.clear()
        self._error = None

    def _full(self) -> bool:
        return len(self._items) >= self._capacity and not self._closed

    def _empty(self) -> bool:
        return not self._items and not self._closed

    async def put(self, item: T) -> None:
        """Trio side: queue ``item``, waiting while the queue is full."""
        while self._full():
            if self._trio_wakeup is None:
                self._trio_wakeup = trio.Event()
            await self._trio_wakeup.wait()
        self._push(item)

    async def get_batch(self, limit: int = 1 << 30) -> list[T]:
        """Trio side: wait for items, return up to ``limit``; ``[]`` once closed and drained."""
        while self._empty():
            if self._trio_wakeup is None:
                self._trio_wakeup = trio.Event()
            await self._trio_wakeup.wait()
        return self._take(limit)

    async def _aio_wait(self) -> None:
        if self._aio_wakeup is None:
            self._aio_wakeup = asyncio.get_running_loop().create_future()
        await self._aio_wakeup

    async def aio_put(self, item: T) -> None:
        """asyncio side: queue ``item``, waiting while the queue is full."""
        while self._full():
            await self._aio_wait()
        self._push(item)

    async def aio_get_batch(self, limit: int = 1 << 30) -> list[T]:
        """asyncio side: wait for items, return up to ``limit``; ``[]`` once closed and drained."""
        while self._empty():
            await self._aio_wait()
        return self._take(limit)


# ---------------------------------------------------------------------------------------------
# Serving


class _CancelledTimerPurge:
    """Drops cancelled timers from a trio-asyncio loop's heap once they are half of it.

    trio-asyncio keeps a cancelled timer until it is due, and grpclib starts one per request that
    carries a deadline (grpcio clients send one with every call): at 400 sessions/s with 30 s
    deadlines that is 12,000 dead timers, a few MiB. asyncio's own loop purges them the same way.
    """

    MIN_PURGE = 256

    def __init__(self, loop: Any) -> None:
        self._loop = loop
        self._cancelled = 0

    def __call__(self, handle: asyncio.TimerHandle) -> None:
        self._cancelled += 1
        timers: list[asyncio.TimerHandle] = self._loop._timers
        if self._cancelled > self.MIN_PURGE and 2 * self._cancelled > len(timers):
            timers[:] = [timer for timer in timers if not timer.cancelled()]
            heapq.heapify(timers)
            self._cancelled = 0


@asynccontextmanager
async def _open_loop() -> AsyncIterator[None]:
    async with trio_asyncio.open_loop() as loop:
        loop._timer_handle_cancelled = _CancelledTimerPurge(loop)
        yield


def _bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP: asyncio disables Nagle only on sockets that say so, and accepted
    # sockets inherit it (with Nagle on, each ext_proc exchange stalled about 40 ms on a delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:  # several processes listen on the port; the kernel spreads new connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve_grpclib(
    servables: Sequence[Any],
    host: str,
    port: int,
    *,
    before_close: Callable[[], Any] | None = None,
    reuse_port: bool = False,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve grpclib ``servables`` on ``host:port`` until cancelled; ``started`` gets the bound port.

    On cancellation, ``before_close`` (a Trio async function) runs first, shielded, so open
    streams can end with a status of their own before grpclib cancels what is left.
    ``reuse_port`` sets SO_REUSEPORT, so other processes can listen on the same port.
    """
    sock = _bind(host, port, reuse_port=reuse_port)
    bound_port: int = sock.getsockname()[1]
    async with _open_loop():
        server = Server(list(servables))
        # grpclib drops the handlers of closed connections (and with them each connection's h2
        # state, about 100 bytes per stream it served) only every tenth new connection; a server
        # that clients keep reconnecting to then holds up to ten dead connections. Every one:
        server.__gc_interval__ = 1
        await trio_asyncio.aio_as_trio(server.start)(sock=sock)
        log.info("grpc.listening host=%s port=%d", host, bound_port)
        try:
            task_status.started(bound_port)
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                if before_close is not None:
                    await before_close()
                server.close()
                # grpclib waits for connections the peer keeps open; a stopping server does not.
                with trio.move_on_after(CLOSE_TIMEOUT_SECONDS):
                    await trio_asyncio.aio_as_trio(server.wait_closed)()
                log.info("grpc.closed port=%d", bound_port)


# ---------------------------------------------------------------------------------------------
# Message streams handed to Trio


@dataclass
class FinalStatus:
    status: Status
    message: str | None = None


class MessageStream(Generic[T]):
    """The Trio side's handle on one gRPC stream.

    ``inbound`` yields received messages (``[]`` at the peer's end of stream; :class:`RpcAbort`
    when the stream ended with an error status); ``outbound`` takes items that ``pack``
    turns into messages. :meth:`finish` ends the stream: on a server with a status, on a
    client by half-closing (or resetting, for a non-OK status).
    """

    def __init__(
        self,
        pack: Callable[[list[T]], Iterable[Message]],
        *,
        inbound_capacity: int = 64,
        outbound_capacity: int = 1024,
    ) -> None:
        self.inbound: Handoff[Message] = Handoff(inbound_capacity)
        self.outbound: Handoff[T] = Handoff(outbound_capacity)
        self.pack = pack
        self.final: FinalStatus | None = None
        self.peer: str = ""
        self._done = trio.Event()

    def finish(self, status: Status | int = Status.OK, message: str | None = None) -> None:
        """End the stream: queued items are sent first, then the status (server) or end of stream."""
        if self.final is None:
            self.final = FinalStatus(status if isinstance(status, Status) else Status(status), message)
            self.outbound.close()

    async def wait_closed(self) -> None:
        """Wait until the asyncio side has sent everything and released the stream."""
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


async def _pump_in(stream: Any, inbound: Handoff[Message]) -> None:
    """Server side: read every message into ``inbound``; never cancelled, it ends when the stream does."""
    try:
        while (message := await stream.recv_message()) is not None:
            await inbound.aio_put(message)
        inbound.close()
    except (StreamTerminatedError, ConnectionError) as exc:
        inbound.close(RpcAbort(Status.UNAVAILABLE, f"stream terminated: {exc}"))
    except HandoffClosed:
        pass


async def _client_pump_in(stream: Any, inbound: Handoff[Message]) -> None:
    """Client side: like :func:`_pump_in`, then the server's status from its trailers.

    A server that aborts sends trailers and then resets the stream, so the read may end with a
    reset although the status already arrived: the trailers (or a trailers-only response's
    headers) are read from grpclib's protocol stream, where they are kept whatever came after.
    """
    try:
        while (message := await stream.recv_message()) is not None:
            await inbound.aio_put(message)
    except GRPCError as exc:  # a trailers-only response
        inbound.close(RpcAbort(exc.status, exc.message or exc.status.name))
        return
    except (StreamTerminatedError, ConnectionError):
        pass
    except HandoffClosed:
        return
    trailers = stream._stream.trailers
    if trailers is None and stream._stream.headers is not None and "grpc-status" in dict(stream._stream.headers):
        trailers = stream._stream.headers  # a trailers-only response, then the reset
    if trailers is None:
        inbound.close(RpcAbort(Status.UNAVAILABLE, "the stream ended without a status"))
        return
    try:
        status, message_text, _ = stream._process_grpc_status(dict(trailers))
    except GRPCError as exc:
        status, message_text = exc.status, exc.message
    if status is Status.OK:
        inbound.close()
    else:
        inbound.close(RpcAbort(status, message_text or status.name))


async def _pump_out(stream: Any, session: MessageStream[Any]) -> None:
    """Send packed batches of ``session.outbound`` until the Trio side finishes the stream."""
    while True:
        batch = await session.outbound.aio_get_batch()
        if not batch:
            return
        for message in session.pack(batch):
            await stream.send_message(message)


class SessionAcceptor(Generic[Req, T]):
    """Serves one bidirectional method by handing each new stream to a Trio acceptor task."""

    def __init__(
        self,
        path: str,
        request_type: type[Req],
        reply_type: type[Message],
        pack: Callable[[list[T]], Iterable[Message]],
        *,
        backlog: int = 1024,
    ) -> None:
        self.path = path
        self.request_type = request_type
        self.reply_type = reply_type
        self._pack = pack
        self.accepted: Handoff[MessageStream[T]] = Handoff(backlog)

    def __mapping__(self) -> dict[str, Handler]:
        handler = Handler(self._handle, Cardinality.STREAM_STREAM, self.request_type, self.reply_type)
        return {self.path: handler}

    async def _handle(self, stream: Stream[Any, Any]) -> None:
        session: MessageStream[T] = MessageStream(self._pack)
        session.peer = str(stream.peer.addr() if stream.peer else "")
        reader = asyncio.ensure_future(_pump_in(stream, session.inbound))
        try:
            await self.accepted.aio_put(session)
            await _pump_out(stream, session)
            final = session.final or FinalStatus(Status.UNAVAILABLE, "server closed the session")
            if final.status is not Status.OK:
                raise GRPCError(final.status, final.message)
        except (StreamTerminatedError, ConnectionError) as exc:
            session.inbound.close(RpcAbort(Status.UNAVAILABLE, f"stream terminated: {exc}"))
            session.outbound.close()
        except HandoffClosed:
            raise GRPCError(Status.UNAVAILABLE, "server is shutting down") from None
        finally:
            # A client that went away (reset, dead connection) cancels this handler: the Trio side
            # learns it here, or its receive loop would wait forever with the session's nodes.
            session.inbound.close(RpcAbort(Status.UNAVAILABLE, "the client went away"))
            session.finish(Status.UNAVAILABLE, "stream ended")
            session._mark_closed()
            # Once the handler ends, grpclib releases the stream (acking unread data) and nothing
            # will complete the reader's read: a pending task left to the GC would be reported
            # into trio-asyncio's loop and take the server down. No one reads this stream again,
            # so cancelling the read cannot corrupt framing.
            reader.add_done_callback(_log_task_error)
            reader.cancel()


def _log_task_error(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("grpc.pump_failed error=%r", task.exception())


@asynccontextmanager
async def open_client_stream(
    host: str,
    port: int,
    path: str,
    request_type: type[Message],
    reply_type: type[Req],
    pack: Callable[[list[T]], Iterable[Message]],
    *,
    metadata: Mapping[str, str] | None = None,
) -> AsyncIterator[MessageStream[T]]:
    """Open a bidirectional stream to ``host:port`` and hand it to Trio until the block exits.

    At exit the stream is half-closed (or reset, when :meth:`MessageStream.finish` was given a
    non-OK status) and the block waits for the server's trailers.
    """
    session: MessageStream[T] = MessageStream(pack)
    session.peer = f"{host}:{port}"
    async with _open_loop(), trio.open_nursery() as nursery:
        nursery.start_soon(
            trio_asyncio.aio_as_trio(_client_main), host, port, path, request_type, reply_type, session, metadata
        )
        try:
            yield session
        finally:
            session.finish()
            with trio.CancelScope(shield=True):
                await session.wait_closed()


async def _client_main(
    host: str,
    port: int,
    path: str,
    request_type: type[Message],
    reply_type: type[Message],
    session: MessageStream[Any],
    metadata: Mapping[str, str] | None,
) -> None:
    channel = Channel(host, port)
    try:
        async with channel.request(
            path, Cardinality.STREAM_STREAM, request_type, reply_type, metadata=dict(metadata or {})
        ) as stream:
            await stream.send_request()
            reader = asyncio.ensure_future(_client_pump_in(stream, session.inbound))
            try:
                await _pump_out(stream, session)
                final = session.final
                if final is not None and final.status is not Status.OK:
                    # The stream is reset, so its framing no longer matters: the pending read may go.
                    await stream.cancel()
                    reader.cancel()
                    session.inbound.close(RpcAbort(final.status, final.message or final.status.name))
                else:
                    if not reader.done():
                        await _half_close(stream)
                    await asyncio.shield(reader)
            except (StreamTerminatedError, ConnectionError, GRPCError) as exc:
                status = exc.status if isinstance(exc, GRPCError) else Status.UNAVAILABLE
                session.inbound.close(RpcAbort(status, str(exc)))
                await asyncio.shield(reader)
    except (OSError, StreamTerminatedError, GRPCError, ProtocolError) as exc:
        status = exc.status if isinstance(exc, GRPCError) else Status.UNAVAILABLE
        session.inbound.close(RpcAbort(status, f"cannot reach {host}:{port}: {exc}"))
    finally:
        session.outbound.close()
        channel.close()
        session._mark_closed()


async def _half_close(stream: Any) -> None:
    """End the request stream; a server that already ended (and reset) the stream makes it moot."""
    with suppress(StreamTerminatedError, ConnectionError, h2.exceptions.StreamClosedError):
        await stream.end()
