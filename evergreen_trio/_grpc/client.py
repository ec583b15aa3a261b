"""The client end of gRPC streams on Trio alone: the Trio shell over :mod:`client_wire` (no asyncio).

A :class:`ClientChannel` holds one HTTP/2 connection (reopened when the server went away) carrying
many streams. Each connection has two tasks in the channel's nursery: a reader, feeding what it reads
to the sans-IO :class:`~evergreen_trio._grpc.client_wire.ClientConnection` and handing each message
to its stream's ``inbound`` queue, and a writer, which packs what the streams queued on ``outbound``
and owns every write (so no caller's cancellation cuts a frame in half). A stream costs no task: a
put wakes the writer, a message read wakes the stream's reader. Deadlines of all the streams of a
connection are kept by one timer in the writer.
"""

from __future__ import annotations

import heapq
import logging
import math
import re
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
from google.protobuf.message import DecodeError, Message
from grpclib.const import Status

from evergreen_trio._grpc import sockets
from evergreen_trio._grpc.client_wire import ClientConnection, MessageReceived
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.limits import TransportLimits
from evergreen_trio._grpc.streams import INBOUND_CAPACITY, OUTBOUND_CAPACITY, Handoff, MessageStream
from evergreen_trio.errors import ConfigurationError

log = logging.getLogger(__name__)

T = TypeVar("T")

READ_BYTES = 64 * 1024
"""The most a connection's reader takes from its socket (and feeds to h2) at a time."""

PUMP_BYTES = 256 * 1024
"""A stream's messages waiting for the server's flow-control window, past which its queued items stay
queued (and ``outbound.put`` waits once that queue is full)."""

OUTGOING_BYTES = 1024 * 1024
"""Answers the reader queued for the writer (PING and SETTINGS acks, window updates) past which it stops
reading until they are written: a server that floods pings and reads nothing gets no more of our memory."""

CLOSE_SECONDS = 0.5
"""How long a closing client gives its GOAWAY to go out before it closes the socket."""

MAX_BACKOFF_SECONDS = 5.0
"""The longest wait between two connection attempts."""

REPLAY_BYTES = 256 * 1024
"""What a call keeps of the messages it sent until the server's first answer, to send them again if the
server says it did not process the call (grpc-core's default per-call retry buffer); past it, such a
call ends UNAVAILABLE instead."""

TRANSPARENT_RETRIES = 3
"""How many times one call is sent again after the server said it did not process it (REFUSED_STREAM, or
above a GOAWAY's last stream id): a server that refuses every stream cannot keep a call going round."""

_METADATA_KEY = re.compile(r"[0-9a-z_.-]+")
_RESERVED = (":", "grpc-")


@dataclass(frozen=True)
class ClientOptions:
    """How a client stream connects: ``tls`` (``True``: system CAs), ``metadata``, ``timeout`` (sent
    as ``grpc-timeout``), and the largest message it accepts from the server."""

    tls: bool | ssl.SSLContext | None = None
    metadata: Mapping[str, str] | None = None
    timeout: float | None = None
    max_message_bytes: int = TransportLimits().max_message_bytes

    def __post_init__(self) -> None:
        for key, value in (self.metadata or {}).items():
            if not isinstance(key, str) or not _METADATA_KEY.fullmatch(key.lower()) or key.startswith(_RESERVED):
                raise ConfigurationError(f"metadata key {key!r}: expected lower-case letters, digits, '-', '_', '.'")
            if not isinstance(value, str) or not value.isascii() or not value.isprintable():
                raise ConfigurationError(f"metadata {key!r}: expected a printable ASCII string")


class ConnectFailedError(RpcAbortError):
    """The connection could not be made; ``retryable`` when a later try may succeed (refused, no answer)."""

    def __init__(self, message: str, *, retryable: bool, timed_out: bool = False) -> None:
        super().__init__(Status.UNAVAILABLE, message)
        self.retryable = retryable
        self.timed_out = timed_out


def _tls_failed(target: str, error: ssl.SSLError) -> str:
    hint = ""
    if error.reason in {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"}:
        hint = " (the server answered in plaintext: is it serving without TLS? then connect without tls=)"
    return f"TLS handshake with {target} failed: {error}{hint}"


def _default_tls() -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    return context


class _Inbound(Handoff[Message]):
    """A stream's received messages, each with its size on the wire: taking them gives their
    flow-control credit back to the server (nothing else does)."""

    def __init__(self, capacity: int, on_consumed: Callable[[int], None]) -> None:
        super().__init__(capacity)
        self._sizes: deque[int] = deque()
        self._on_consumed = on_consumed

    def deliver(self, message: Message, size: int) -> None:
        """Queue ``message`` (``size`` bytes on the wire); taken at once by the ``consumer``, or dropped
        once the reader has released the stream, it gives its credit back at once."""
        if self._closed or self.push(message):  # dropped, or taken at once by the consumer
            self._on_consumed(size)
        else:
            self._sizes.append(size)

    def _take(self, limit: int) -> list[Message]:
        batch = super()._take(limit)
        if batch:
            self._on_consumed(sum(self._sizes.popleft() for _ in batch))
        return batch

    def release(self) -> None:
        super().release()
        if self._sizes:
            self._on_consumed(sum(self._sizes))
            self._sizes.clear()


class _Outbound(Handoff[T]):
    """A stream's queued items: each put (and the close) wakes the connection's writer."""

    def __init__(self, capacity: int, wake: Callable[[], None]) -> None:
        super().__init__(capacity)
        self._wake_writer = wake

    def _wake(self) -> None:
        super()._wake()
        if self._items or self._closed:
            self._wake_writer()

    def abandon(self, error: RpcAbortError | None) -> None:
        """The stream is over: drop what is queued; a later put raises HandoffClosedError from ``error``."""
        self.close(error)
        self._items.clear()

    def take_now(self, limit: int) -> list[T]:
        """What is queued (up to ``limit``), without waiting."""
        return self._take(limit)

    @property
    def drained(self) -> bool:
        return self._closed and not self._items


class _Call:
    """One call (a stream of a connection; another one's if it is sent again)."""

    __slots__ = ("deadline", "finishing", "link", "options", "path", "replay", "replay_bytes", "reply_type", "retries",
                 "retrying", "session", "stream_id", "strikes")

    def __init__(self, session: MessageStream[Any], reply_type: type[Message], path: str, options: ClientOptions,
                 link: list[tuple[_Connection, _Call]]) -> None:
        self.session = session
        self.reply_type = reply_type
        self.path = path
        self.options = options
        self.deadline = math.inf if options.timeout is None else trio.current_time() + options.timeout
        self.link = link  # [(connection, self)] while on a connection: how the stream's handoffs reach it
        self.stream_id = 0
        self.finishing = False  # its end (half-close or reset) was sent
        # What was sent until the server's first answer, kept to send again (None: answered, or past
        # REPLAY_BYTES); how many times it was sent again, and of those how many count against
        # TRANSPARENT_RETRIES (see Channel._retry); the wait to do so, cancelled with the stream.
        self.replay: list[bytes] | None = []
        self.replay_bytes = 0
        self.retries = self.strikes = 0
        self.retrying: trio.CancelScope | None = None

    def keep(self, body: bytes) -> None:
        """Keep a message sent, for a replay, within ``REPLAY_BYTES``."""
        if self.replay is not None:
            self.replay_bytes += len(body)
            if self.replay_bytes > REPLAY_BYTES:
                self.replay = None
            else:
                self.replay.append(body)

    def close_stream(self, error: RpcAbortError | None) -> None:
        """The call is over: its stream's reader sees ``error`` (None: OK) after what it received."""
        session = self.session
        session.inbound.close(error)
        outbound = session.outbound
        assert isinstance(outbound, _Outbound)
        outbound.abandon(error)
        session._mark_closed()


class _Connection:
    """One HTTP/2 connection: its socket, its sans-IO state, its reader and writer tasks."""

    def __init__(self, stream: trio.abc.Stream, core: ClientConnection, target: str) -> None:
        self.stream = stream
        self.core = core
        self.target = target
        self.calls: dict[int, _Call] = {}
        self.room = trio.Event()  # set when a stream ends (a waiting one may fit)
        self._ready: dict[_Call, None] = {}  # calls with something for the writer, in order
        self._outgoing: list[bytes] = []  # bytes the reader produced (acks, window updates)
        self._wakeup = trio.Event()
        self._sent: trio.Event | None = None  # the reader's wait for the next write (made only then)
        self._deadlines: list[tuple[float, int]] = []
        self._waiting = trio.CancelScope()  # the reader's wait for input, cut short at the next deadline
        self._blocked: set[_Call] = set()  # calls whose items wait for the server's window
        self._scope = trio.CancelScope()
        self._finished = trio.Event()
        # Sends again a call the server did not process (the channel's); None: such a call just ends.
        self.retry: Callable[[_Call, _Connection], None] | None = None

    def usable(self) -> bool:
        return self.core.accepting

    # -- streams --------------------------------------------------------------------------------

    def open(self, call: _Call) -> bool:
        """Start ``call`` on this connection now; False when it does not fit (no room, or going away)."""
        if not self.core.accepting or not self.core.room():
            return False
        options = call.options
        timeout = options.timeout  # sent again: what is left of it
        if call.retries and timeout is not None:
            timeout = max(call.deadline - trio.current_time(), 0.0)
        stream_id = self.core.start_stream(call.path, metadata=options.metadata, timeout=timeout,
                                           max_message_bytes=options.max_message_bytes)
        if stream_id is None:
            return False
        call.stream_id = stream_id
        self.calls[stream_id] = call
        for body in call.replay if call.retries and call.replay else ():
            self.core.send_message(stream_id, body)
        if call.deadline < math.inf:
            heapq.heappush(self._deadlines, (call.deadline, stream_id))
            self._waiting.deadline = min(self._waiting.deadline, call.deadline)
        self.ready(call)
        return True

    def ready(self, call: _Call) -> None:
        self._ready[call] = None
        self._wakeup.set()

    def end(self, call: _Call, status: Status, message: str) -> None:
        """The stream is over: its reader sees ``status`` after what was already received."""
        if self._detach(call):
            call.close_stream(None if status is Status.OK else RpcAbortError(status, message or status.name))

    def _detach(self, call: _Call) -> bool:
        """Take ``call`` off this connection (False if it was not on it)."""
        if self.calls.pop(call.stream_id, None) is None:
            return False
        self.core.release(call.stream_id)
        self._ready.pop(call, None)
        self.room.set()
        self.room = trio.Event()
        self._send_soon()  # what release() gave back (window updates)
        return True

    def end_all(self, why: str) -> None:
        for event in self.core.connection_lost(why):
            self._on_event(event)
        for call in list(self.calls.values()):  # those the core had already forgotten
            self.end(call, Status.UNAVAILABLE, why)

    def consumed(self, call: _Call, size: int) -> None:
        if call.stream_id in self.calls:
            self.core.consumed(call.stream_id, size)
            self._send_soon()

    def _send_soon(self) -> None:
        """Hand what the core has to send (acks, window updates) to the writer; wake it only then."""
        if out := self.core.data_to_send():
            self._outgoing.append(out)
            self._wakeup.set()

    # -- tasks ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Read and write until the connection ends (or the channel cancels it); never raises.

        The writer decides when: it returns once the connection is over and its last bytes (a
        GOAWAY) are out, and the reader is cancelled then."""
        with self._scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read)
                    await self._write()
                    nursery.cancel_scope.cancel()
            finally:
                self.end_all(self.core.reason or f"the connection to {self.target} was closed")
                await trio.aclose_forcefully(self.stream)
                self._finished.set()

    async def close(self, why: str) -> None:
        """GOAWAY (given ``CLOSE_SECONDS`` to go out), then the socket; every open stream ends UNAVAILABLE."""
        self.core.close(why)
        self.end_all(why)
        self._wakeup.set()
        with trio.move_on_after(CLOSE_SECONDS):
            await self._finished.wait()
        self._scope.cancel()

    async def _read(self) -> None:
        """Read and dispatch; the calls' deadlines are kept here (a cancelled read loses nothing, while
        the writer may wait on a server that stopped reading)."""
        try:
            while not self.core.closed:
                self._expire()
                # One scope for every read until the next deadline, not a scope's enter and exit per read;
                # a call opened meanwhile with an earlier deadline moves it (open).
                self._waiting = trio.CancelScope(deadline=self._deadlines[0][0] if self._deadlines else math.inf)
                with self._waiting:
                    while not self.core.closed:
                        # What the server made us answer (pings, acks) waits for a server that reads it.
                        while self._outgoing and sum(map(len, self._outgoing)) > OUTGOING_BYTES:
                            if self._sent is None:
                                self._sent = trio.Event()
                            await self._sent.wait()
                        data = await self.stream.receive_some(READ_BYTES)
                        if not data:
                            self.end_all(f"{self.target} closed the connection")  # closes the core
                            break
                        for event in self.core.receive(data):
                            self._on_event(event)
                        self._send_soon()
                        if self._blocked:  # the server's window may have opened for what waits
                            for call in self._blocked:
                                self.ready(call)
                            self._blocked.clear()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self.end_all(f"the connection to {self.target} was lost: {_cause(error)}")
        self._wakeup.set()  # the writer sends what is left (a GOAWAY) and ends the connection

    def _on_event(self, event: Any) -> None:
        call = self.calls.get(event.stream_id)
        if call is None:
            return
        if isinstance(event, MessageReceived):
            try:
                message = call.reply_type.FromString(event.body)
            except DecodeError as error:
                self.core.reset_stream(call.stream_id)
                self.end(call, Status.INVALID_ARGUMENT, f"not a {call.reply_type.__name__}: {error}")
                return
            inbound = call.session.inbound
            assert isinstance(inbound, _Inbound)
            inbound.deliver(message, event.size)
            call.session.received += 1
            call.replay = None  # answered: the server processed it
        elif event.unprocessed and call.replay is not None and call.strikes < TRANSPARENT_RETRIES and self.retry:
            log.debug("grpc.call_not_processed target=%s stream=%d: %s; sending it again", self.target,
                      event.stream_id, event.message)
            self._detach(call)
            call.link.clear()
            self.retry(call, self)
        else:
            self.end(call, event.status, event.message)

    async def _write(self) -> None:
        try:
            while not (self.core.closed and not self._ready and not self._outgoing):
                if not self._ready and not self._outgoing:
                    await self._wakeup.wait()
                    self._wakeup = trio.Event()
                ready, self._ready = self._ready, {}
                for call in ready:
                    self._pump(call)
                out = b"".join(self._outgoing) if self._outgoing else b""
                self._outgoing.clear()
                if data := out + self.core.data_to_send():
                    await sockets.send(self.stream, data)
                    if self._sent is not None:
                        self._sent.set()
                        self._sent = None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self.end_all(f"the connection to {self.target} was lost: {_cause(error)}")

    def _pump(self, call: _Call) -> None:
        """Move ``call``'s queued items into the core (as the window allows); at its end, half-close
        or reset."""
        if call.stream_id not in self.calls:
            return
        session, stream_id = call.session, call.stream_id
        outbound = session.outbound
        assert isinstance(outbound, _Outbound)
        while True:
            if self.core.pending(stream_id) >= PUMP_BYTES:
                self._blocked.add(call)
                return
            batch = outbound.take_now(1 << 30)
            if not batch:
                break
            for message in session.pack(batch):
                body = message.SerializeToString()
                self.core.send_message(stream_id, body)
                if call.replay is not None:
                    call.keep(body)
        if outbound.drained and not call.finishing:
            call.finishing = True
            final = session.final
            if final is not None and final.status is not Status.OK:
                self.core.reset_stream(stream_id)
                self.end(call, final.status, final.message or final.status.name)
            else:
                self.core.end_stream(stream_id)

    def _expire(self) -> None:
        now = trio.current_time()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, stream_id = heapq.heappop(self._deadlines)
            call = self.calls.get(stream_id)
            if call is not None:
                self.core.reset_stream(stream_id)
                timeout = call.options.timeout if call.options.timeout is not None else 0.0
                self.end(call, Status.DEADLINE_EXCEEDED, f"no answer within {timeout:g} s")


def _cause(error: BaseException) -> str:
    cause = error.__cause__ or error
    return str(cause) or type(cause).__name__


async def _connect(host: str, port: int, tls: bool | ssl.SSLContext | None, seconds: float) -> _Connection:
    """Open a connection and wait for the server's first SETTINGS (its HTTP/2 preface), all within
    ``seconds``; raises :class:`ConnectFailedError` saying why not."""
    target = f"{host}:{port}"
    with trio.move_on_after(seconds):
        try:
            tcp = await trio.open_tcp_stream(host, port)
        except OSError as error:
            raise ConnectFailedError(f"cannot reach {target}: {error}", retryable=True) from None
        stream: trio.abc.Stream = tcp
        try:
            if tls:
                context = tls if isinstance(tls, ssl.SSLContext) else _default_tls()
                stream = trio.SSLStream(tcp, context, server_hostname=host)
                await stream.do_handshake()
            core = ClientConnection(target, scheme="https" if tls else "http")
            core.initiate()
            await stream.send_all(core.data_to_send())
            return await _settle(stream, core, target, tls)
        except trio.BrokenResourceError as error:
            await trio.aclose_forcefully(stream)
            if isinstance(error.__cause__, ssl.SSLError):
                raise ConnectFailedError(_tls_failed(target, error.__cause__), retryable=False) from None
            raise ConnectFailedError(f"cannot reach {target}: {_cause(error)}", retryable=True) from None
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
    raise ConnectFailedError(f"{target} did not answer within {seconds:g} s", retryable=True, timed_out=True)


async def _settle(stream: trio.abc.Stream, core: ClientConnection, target: str,
                  tls: bool | ssl.SSLContext | None) -> _Connection:
    """Read until the server's SETTINGS."""
    spoke = False
    while not core.settled:
        try:
            data = await stream.receive_some(READ_BYTES)
        except trio.BrokenResourceError as error:
            if spoke or not isinstance(error.__cause__, ConnectionResetError):
                raise
            data = b""  # reset at once: as good as closed
        if not data:
            await trio.aclose_forcefully(stream)
            if spoke:
                raise ConnectFailedError(f"{target} closed the connection before its HTTP/2 SETTINGS", retryable=True)
            # Most often a TLS server that got a plaintext client's preface.
            hint = "" if tls else " (is it serving TLS? then connect with tls=True or tls=client_context(...))"
            raise ConnectFailedError(f"{target} closed the connection without a word of HTTP/2{hint}",
                                     retryable=False)
        spoke = True
        core.receive(data)
        if core.closed:
            await trio.aclose_forcefully(stream)
            if core.went_away:  # at once: a server at its connection cap, or shutting down
                raise ConnectFailedError(f"{target} turned the connection away: {core.reason}", retryable=True)
            raise ConnectFailedError(f"{target} does not speak gRPC's HTTP/2: {core.reason}", retryable=False)
    return _Connection(stream, core, target)


class ClientChannel:
    """One HTTP/2 connection to a server, carrying many streams; reopened for the next stream once the
    server went away (a stream that then cannot connect ends with UNAVAILABLE). Open with
    :func:`open_client_channel`.
    """

    def __init__(self, nursery: trio.Nursery, connection: _Connection, host: str, port: int,
                 tls: bool | ssl.SSLContext | None, connect_timeout: float) -> None:
        self._nursery = nursery
        self._connection = connection
        self._host, self._port, self._tls, self._connect_timeout = host, port, tls, connect_timeout
        self.target = f"{host}:{port}"
        self._reconnecting = trio.Lock()
        self._closed = False
        self._connections = [connection]  # the current one last; earlier ones end when the server is done
        connection.retry = self._retry

    @asynccontextmanager
    async def open_stream(
        self,
        path: str,
        reply_type: type[Message],
        pack: Callable[[list[T]], Iterable[Message]],
        *,
        options: ClientOptions | None = None,
    ) -> AsyncIterator[MessageStream[T]]:
        """Open a bidirectional stream on this connection and hand it to Trio until the block exits.

        At exit the stream is half-closed (or reset, when :meth:`MessageStream.finish` was given a
        non-OK status) and the block waits for the server's trailers (within the stream's timeout,
        when it has one). No task is started for it.
        """
        options = options or ClientOptions()
        # The started call, for the stream's handoffs to reach; emptied at the end, so that the stream
        # and its call (which holds the stream) are freed by reference counting, not left as a cycle.
        link: list[tuple[_Connection, _Call]] = []

        def consumed(size: int) -> None:
            if link:
                link[0][0].consumed(link[0][1], size)

        def wake() -> None:
            if link:
                link[0][0].ready(link[0][1])

        session: MessageStream[T] = MessageStream(pack, inbound=_Inbound(INBOUND_CAPACITY, consumed),
                                                  outbound=_Outbound(OUTBOUND_CAPACITY, wake))
        session.peer = self.target
        call = _Call(session, reply_type, path, options, link)
        try:
            connection = await self._start(call)
        except RpcAbortError as error:
            # Its reader learns why; what is put meanwhile goes nowhere (a closed outbound would make
            # the first put fail first, with no reason given).
            session.inbound.close(error)
            session._mark_closed()
        else:
            link.append((connection, call))
        try:
            yield session
        except BaseException:
            if call.retrying is not None:  # no waiting, shielded, for a call to be sent again
                call.retrying.cancel()
            raise
        finally:
            session.finish()
            await session.wait_closed(shield=True)
            link.clear()

    def _retry(self, call: _Call, refused_by: _Connection) -> None:
        """Send ``call`` again (its connection took it off: the server did not process it).

        A refusal while the connection still carries other calls is its server counting streams
        longer than it said (grpcio counts one until its handler thread ends): the call waits for
        one of those to end before it is sent again, so that wait, not :data:`TRANSPARENT_RETRIES`,
        bounds it (under load one call may be refused several times while the others progress).
        """
        call.retries += 1
        # Taken now: one ending before the restart task runs counts (it has made room already).
        room = refused_by.room if refused_by.usable() and refused_by.calls else None
        if room is None:
            call.strikes += 1
        call.finishing = False
        call.retrying = trio.CancelScope()
        self._nursery.start_soon(self._restart, call, room)

    async def _restart(self, call: _Call, room: trio.Event | None) -> None:
        error = RpcAbortError(Status.CANCELLED, "the call was cancelled while it was being sent again")
        connection = None
        assert call.retrying is not None
        try:
            with call.retrying:
                if room is not None:
                    with trio.move_on_at(call.deadline):
                        await room.wait()
                connection = await self._start(call)
        except RpcAbortError as failed:
            error = failed
        finally:
            call.retrying = None
            if connection is None:
                call.close_stream(error)
            else:
                call.link.append((connection, call))

    async def _start(self, call: _Call) -> _Connection:
        """Start ``call`` on a connection with room for it, reopening the connection if the server
        went away; raises :class:`RpcAbortError` when it cannot (within the call's deadline)."""
        if not self._closed and self._connection.open(call):
            return self._connection  # the common case: room on the open connection, no wait and no timer
        with trio.move_on_at(call.deadline):
            while True:
                if self._closed:
                    raise RpcAbortError(Status.UNAVAILABLE, f"the connection to {self.target} was closed")
                connection = self._connection
                if connection.open(call):
                    return connection
                if connection.usable():  # full: wait for one of its streams to end
                    if not connection.calls:
                        raise RpcAbortError(Status.UNAVAILABLE, f"{self.target} allows no stream on its connection "
                                            "(SETTINGS_MAX_CONCURRENT_STREAMS 0)")
                    await connection.room.wait()
                    continue
                async with self._reconnecting:
                    if self._connection is connection and not self._closed:
                        try:
                            fresh = await _connect(self._host, self._port, self._tls, self._connect_timeout)
                        except ConnectFailedError as error:
                            raise RpcAbortError(Status.UNAVAILABLE, error.message) from None
                        fresh.retry = self._retry
                        self._connection = fresh
                        self._connections = [c for c in self._connections if not c.core.closed] + [fresh]
                        self._nursery.start_soon(fresh.run)
        raise RpcAbortError(Status.DEADLINE_EXCEEDED, f"no answer within {call.options.timeout:g} s")

    async def _close(self) -> None:
        self._closed = True
        for connection in self._connections:
            await connection.close(f"the connection to {self.target} was closed")


@asynccontextmanager
async def open_client_channel(
    host: str,
    port: int,
    *,
    tls: bool | ssl.SSLContext | None = None,
    connect_timeout: float = 10.0,
    retries: int = 0,
    backoff: float = 0.2,
) -> AsyncIterator[ClientChannel]:
    """Connect to ``host:port`` and yield the channel until the block exits.

    Raises :class:`ConnectFailedError` when the connection cannot be made, after ``retries`` more
    tries ``backoff`` seconds apart (doubling, at most 5 s) for the failures worth retrying.
    """
    attempt = 0
    while True:
        try:
            connection = await _connect(host, port, tls, connect_timeout)
            break
        except ConnectFailedError as error:
            if not error.retryable or attempt >= retries:
                raise
            log.info("grpc.connect_retry target=%s:%d attempt=%d error=%s", host, port, attempt + 1, error.message)
            await trio.sleep(min(backoff * 2**attempt, MAX_BACKOFF_SECONDS))
            attempt += 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(connection.run)
        channel = ClientChannel(nursery, connection, host, port, tls, connect_timeout)
        try:
            yield channel
        finally:
            with trio.CancelScope(shield=True):
                await channel._close()


@asynccontextmanager
async def open_client_stream(
    host: str,
    port: int,
    path: str,
    reply_type: type[Message],
    pack: Callable[[list[T]], Iterable[Message]],
    *,
    options: ClientOptions | None = None,
) -> AsyncIterator[MessageStream[T]]:
    """One stream on a connection of its own (see :meth:`ClientChannel.open_stream`)."""
    tls = options.tls if options is not None else None
    async with open_client_channel(host, port, tls=tls) as channel, channel.open_stream(
        path, reply_type, pack, options=options
    ) as stream:
        yield stream
