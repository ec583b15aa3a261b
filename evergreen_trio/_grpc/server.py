"""The Trio shell of :mod:`evergreen_trio._grpc.server_wire`: a TCP (or TLS) listener, one task per connection.

Each connection task reads, feeds the sans-IO connection (which calls the stream processors
synchronously) and writes everything queued in one ``send_all``: an ext_proc request or a message
of a session costs one read and one write here, with no asyncio loop and no Trio/asyncio crossing.
A :class:`StreamMethod` runs a Trio task per stream (a session, a health watch) that reads and
writes a :class:`~evergreen_trio._grpc.streams.MessageStream`; the connection's writer task sends
what those tasks queue. Every wait for the peer has a deadline (:class:`WireTimeouts`),
connections are capped (:attr:`~evergreen_trio._grpc.server_wire.WireLimits.max_connections`), and
a read whose frames queue much output is written in slices (the connection pauses between them).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import trio
from google.protobuf.message import Message
from grpclib.const import Status

from evergreen_trio._grpc import sockets
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.limits import OUT_OF_RESOURCES_ERRNOS
from evergreen_trio._grpc.server_wire import Call, GrpcWireConnection, Method, SyncBidiMethod, WireLimits, refusal
from evergreen_trio._grpc.streams import FinalStatus, MessageStream
from evergreen_trio._refusals import RefusalEpisodes

log = logging.getLogger(__name__)
T = TypeVar("T")

RECEIVE_BYTES = 256 * 1024
_MAX_BACKOFF_S = 1.0
_REFUSAL_SEND_S = 0.1

LISTEN_BACKLOG = 128
"""Connections the kernel completes and holds for a gRPC server to accept (``listen``). Under a flood
the rest wait in the kernel, in order; past it the kernel drops a handshake and the client retries."""

LINGER_BYTES = 4 * 1024 * 1024
"""Unread input dropped before the socket of a connection told to go away closes: closing a socket
with unread input sends a reset, and the reset can destroy the GOAWAY before the peer reads it."""

STREAM_BATCH = 64
"""Outbound items of one task stream packed into messages per turn of its connection's writer."""

CLOSE_TIMEOUT_SECONDS = 5.0
"""How long a stopping server spends telling its connections to go away (GOAWAY) before it closes them."""
_STOPPING = "the server is stopping"
GOAWAY_ACK_TIMEOUT_SECONDS = 2.0
"""How long a graceful GOAWAY's final step waits for the client's PING ACK (see
:meth:`GrpcWireConnection.go_away`); a client that does not answer gets it then."""

SSLContextSource = ssl.SSLContext | Callable[[], ssl.SSLContext]


@dataclass(frozen=True)
class WireTimeouts:
    """Deadlines of the shell, in seconds.

    ``handshake_s``: from accept to the client's preface and first SETTINGS (TLS included).
    ``idle_s``: a connection with no open stream and no frame for this long gets GOAWAY NO_ERROR
    (``None``: kept).
    ``send_s``: a write the peer does not take within this long closes the connection.
    ``keepalive_s`` / ``keepalive_timeout_s``: a connection with open streams and nothing read for
    ``keepalive_s`` is pinged, and closed when the PING is not answered within ``keepalive_timeout_s``
    (a vanished peer; ``None``: no pings).
    """

    handshake_s: float = 10.0
    idle_s: float | None = 300.0
    send_s: float = 30.0
    keepalive_s: float | None = None
    keepalive_timeout_s: float = 20.0


def _unchanged(items: list[Any]) -> Iterable[Message]:
    return items


@dataclass(frozen=True)
class StreamMethod(Generic[T]):
    """A method served by a Trio task per stream: ``handle`` reads and writes the stream's
    :class:`MessageStream` (``pack`` turns its outbound items into messages).

    ``admit`` (optional, plain) sees each new stream (peer, metadata and deadline set) before its
    task starts; raising :class:`RpcAbortError` answers the stream with that status and starts
    nothing. Tasks start once the read that opened their streams is processed; a stream the client
    reset within that read starts none: ``abandon`` (if given) gets it instead, to give back what
    ``admit`` took (rapid reset costs no task). A handler that returns without
    :meth:`MessageStream.finish` ends its stream OK; one that raises :class:`RpcAbortError` ends it
    with that status, any other error with UNKNOWN.
    """

    path: str
    request_type: type[Message]
    handle: Callable[[MessageStream[T]], Awaitable[None]]
    pack: Callable[[list[T]], Iterable[Message]] = _unchanged
    admit: Callable[[MessageStream[T]], object] | None = None
    abandon: Callable[[MessageStream[T]], object] | None = None


def _no_op() -> None:
    pass


class _TaskStream:
    """The wire's processor for a :class:`StreamMethod` stream: input goes to the stream's ``inbound``
    (parking the stream while it is full), replies come from its ``outbound`` when the task queued
    some (``wake``), and the stream ends with the task's final status."""

    streaming = True

    def __init__(self, stream: MessageStream[Any]) -> None:
        self.stream = stream
        self.finished = False
        self.wake: Callable[[], object] = _no_op  # set by the wire
        self.gone = False  # reset by the peer, or its connection ended
        self._parked = False
        self._taking = False
        stream.inbound.notify = self._inbound_changed
        stream.outbound.notify = self._outbound_changed

    @property
    def parked(self) -> bool:
        self._parked = self.stream.inbound.full
        return self._parked

    def _inbound_changed(self) -> None:
        if self._parked and not self.stream.inbound.full:
            self._parked = False
            self.wake()

    def _outbound_changed(self) -> None:
        if not self._taking:
            self.wake()

    def on_message(self, message: Message) -> Sequence[Message]:
        stream = self.stream
        stream.received += 1
        stream.last_activity = trio.current_time()
        if not stream.inbound.closed:  # else the task reads no more: dropped
            stream.inbound.push(message)
        return ()

    def on_end(self) -> Sequence[Message]:
        self.stream.inbound.close()
        return ()

    def resume(self) -> Sequence[Message]:
        stream = self.stream
        outbound = stream.outbound
        self._taking = True
        try:
            items = outbound.take_nowait(STREAM_BATCH)
        finally:
            self._taking = False
        final = stream.final or FinalStatus(Status.UNAVAILABLE, "the server closed the stream")
        if items:
            stream.last_activity = trio.current_time()
            if outbound.drained and final.status is Status.OK:
                self.finished = True
            elif outbound.closed or len(items) == STREAM_BATCH:
                self.wake()  # more to send, or the final status
            return list(stream.pack(items))
        if outbound.drained:
            if final.status is not Status.OK:
                raise RpcAbortError(final.status, final.message or "")
            self.finished = True
        return ()

    def on_abort(self) -> None:
        """Reset by the peer, or the connection ended: the task learns why from its stream."""
        self.gone = True
        stream = self.stream
        if stream.deadline is not None and trio.current_time() >= stream.deadline:
            status, why = Status.DEADLINE_EXCEEDED, "the call's deadline passed"
        else:
            status, why = Status.UNAVAILABLE, "the client went away"
        stream.inbound.close(RpcAbortError(status, why))
        stream.finish(status, why)

    def on_closed(self, status: Status) -> None:
        stream = self.stream
        stream.inbound.notify = stream.outbound.notify = None
        stream.inbound.close()
        stream._mark_closed()


class _TaskMethod:
    """A :class:`StreamMethod` bound to the nursery its stream tasks run in."""

    def __init__(self, method: StreamMethod[Any], nursery: trio.Nursery) -> None:
        self.method = method
        self.path = method.path
        self.request_type = method.request_type
        self._nursery = nursery
        self._opened: list[_TaskStream] = []  # since the last start_opened

    def start_opened(self) -> None:
        """Start the tasks of the streams opened since the last call (the shell calls it after each
        slice of input), except those already gone (see :class:`StreamMethod`'s ``abandon``)."""
        opened, self._opened = self._opened, []
        method = self.method
        for processor in opened:
            if processor.gone and method.abandon is not None:
                method.abandon(processor.stream)
            else:
                self._nursery.start_soon(_run_stream, method.handle, processor.stream, name=method.path)

    def open(self, call: Call) -> _TaskStream:
        method = self.method
        stream: MessageStream[Any] = MessageStream(method.pack)
        stream.peer = call.peer
        stream.peer_certificate = dict(call.peer_certificate) if call.peer_certificate is not None else None
        stream.metadata = call.metadata
        if call.timeout is not None:
            stream.deadline = trio.current_time() + call.timeout
        if method.admit is not None:
            method.admit(stream)
        processor = _TaskStream(stream)
        self._opened.append(processor)
        return processor


async def _run_stream(handle: Callable[[MessageStream[Any]], Awaitable[None]], stream: MessageStream[Any]) -> None:
    try:
        await handle(stream)
    except RpcAbortError as abort:
        stream.finish(abort.status, abort.message)
    except Exception:
        log.exception("grpc.handler_failed peer=%s", stream.peer)
        stream.finish(Status.UNKNOWN, "the handler failed")
    finally:
        stream.finish()  # OK, unless the stream already has its status


def _address(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        host = f"[{addr[0]}]" if ":" in str(addr[0]) else str(addr[0])
        return f"{host}:{addr[1]}"
    return str(addr or "?")


def _peer(stream: trio.SocketStream) -> str:
    try:
        return _address(stream.socket.getpeername())
    except OSError:
        return "?"


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (Nagle off; ``reuse_port``: SO_REUSEPORT, so that
    several processes serve one port and the kernel spreads connections among them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


class _Connection:
    """One served connection: its socket, its sans-IO state and the lock its two writers share."""

    def __init__(self, stream: trio.abc.Stream, wire: GrpcWireConnection, peer: str) -> None:
        self.stream = stream
        self.wire = wire
        self.peer = peer
        self.lock = trio.StrictFIFOLock()
        self.lot = trio.lowlevel.ParkingLot()
        wire.on_wake = self.lot.unpark_all


class _Server:
    """Accepts connections up to the cap and serves each in its own task."""

    def __init__(self, methods: Sequence[SyncBidiMethod[Any, Any] | StreamMethod[Any]], limits: WireLimits,
                 timeouts: WireTimeouts, ssl_context: SSLContextSource | None) -> None:
        self.limits = limits
        self.timeouts = timeouts
        self.ssl_context = ssl_context
        self.active = 0
        self.refusals = RefusalEpisodes()
        self.connections: set[_Connection] = set()
        self.stopping = False  # a graceful stop: every connection, even one accepted before it, goes away
        self._connection_ended: trio.Event | None = None
        self._methods = methods
        self.methods: dict[str, Method] = {}
        self._task_methods: list[_TaskMethod] = []
        self.nursery: trio.Nursery | None = None

    async def run_tasks(self, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        """The nursery of connection and stream tasks, shielded: a stopping server says goodbye first
        (see :func:`serve_grpc`) and then cancels the returned scope."""
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                self._task_methods = [_TaskMethod(m, nursery) for m in self._methods if isinstance(m, StreamMethod)]
                self.methods = {m.path: m for m in self._methods if isinstance(m, SyncBidiMethod)}
                self.methods.update({m.path: m for m in self._task_methods})
                task_status.started(scope)
                # A start() cancelled before this (a sibling of the server failed at once) keeps this
                # task and waits for it, and nobody holds the scope to cancel it: end now, unshielded.
                await trio.lowlevel.checkpoint_if_cancelled()
                scope.shield = True
                await trio.sleep_forever()

    async def accept_loop(self, listener: trio.SocketListener) -> None:
        assert self.nursery is not None
        backoff = 0.0
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES_ERRNOS:
                    raise
                if not backoff:
                    log.warning("grpc_wire.accept_failed error=%s: backing off (out of file descriptors?)",
                                errno.errorcode.get(exc.errno or 0, exc.errno))
                backoff = min(_MAX_BACKOFF_S, backoff * 2 or 0.01)
                await trio.sleep(backoff)
                continue
            backoff = 0.0
            if self.active >= self.limits.max_connections:
                if self.refusals.refuse(trio.current_time()):
                    log.warning("grpc_wire.connection_refused active=%d cap=%d: refusing new connections",
                                self.active, self.limits.max_connections)
                await self._refuse(stream)
                continue
            if refused := self.refusals.admit(trio.current_time()):
                log.info("grpc_wire.accepting_again refused=%d", refused)
            self.active += 1
            self.nursery.start_soon(self.serve_connection, stream)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Close a connection past the cap; a plaintext one first gets GOAWAY ENHANCE_YOUR_CALM
        (a TLS one cannot be told before its handshake, which the cap exists to avoid)."""
        if self.ssl_context is None:
            message = refusal(f"over the limit of {self.limits.max_connections} connections")
            # A new socket's buffer takes it at once; a peer already gone does not matter.
            with trio.move_on_after(_REFUSAL_SEND_S), contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(message)
            _drop_unread(stream)
        await trio.aclose_forcefully(stream)

    async def serve_connection(self, raw: trio.SocketStream) -> None:
        handshake_deadline = trio.current_time() + self.timeouts.handshake_s
        peer = _peer(raw)
        try:
            stream: trio.abc.Stream = raw
            certificate = None
            if self.ssl_context is not None:
                context = self.ssl_context() if callable(self.ssl_context) else self.ssl_context
                context.set_alpn_protocols(["h2"])
                tls = trio.SSLStream(raw, context, server_side=True)
                if not await self._tls_handshake(tls, handshake_deadline, peer):
                    return
                stream, certificate = tls, tls.getpeercert() or None
            wire = GrpcWireConnection(self.methods, self.limits, peer=peer, peer_certificate=certificate)
            if self.stopping:  # accepted before the port closed, its TLS handshake done after the GOAWAYs
                wire.go_away(_STOPPING)  # no stream yet: closed at once
            connection = _Connection(stream, wire, peer)
            self.connections.add(connection)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._resume_parked, connection, nursery.cancel_scope)
                    await self._converse(connection, handshake_deadline)
                    nursery.cancel_scope.cancel()
            finally:
                self.connections.discard(connection)
                wire.abort_streams()  # lost, closed or cancelled: release what streams hold
            if wire.closed:
                _drop_unread(raw)
        finally:
            self.active -= 1
            if self._connection_ended is not None:
                self._connection_ended.set()
            await trio.aclose_forcefully(raw)

    async def _tls_handshake(self, stream: trio.SSLStream[trio.SocketStream], deadline: float, peer: str) -> bool:
        with trio.move_on_at(deadline):
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                error = exc.__cause__ or exc
                hint = " (a plaintext client?)" if getattr(error, "reason", None) in _NOT_TLS else ""
                log.info("grpc_wire.tls_handshake_failed peer=%s error=%s%s", peer,
                         str(error) or type(error).__name__, hint)
                return False
            return True
        log.info("grpc_wire.connection_timeout peer=%s reason=no TLS handshake in time", peer)
        return False

    def _wait_deadline(self, wire: GrpcWireConnection, handshake_deadline: float, last_read: float,
                       ping_sent: float | None) -> tuple[float, str]:
        """Until when the next read may wait, and what it means when nothing came by then."""
        timeouts = self.timeouts
        if not wire.handshake_complete:
            return handshake_deadline, "no preface and SETTINGS in time"
        if not wire.open_streams:
            if timeouts.idle_s is None:
                return math.inf, ""
            return last_read + timeouts.idle_s, f"no stream for {timeouts.idle_s:g} s"
        if timeouts.keepalive_s is None:
            return math.inf, ""
        if ping_sent is not None:
            return ping_sent + timeouts.keepalive_timeout_s, "no answer to a keepalive PING"
        return last_read + timeouts.keepalive_s, "keepalive"

    async def _converse(self, connection: _Connection, handshake_deadline: float) -> None:
        stream, wire, peer = connection.stream, connection.wire, connection.peer
        last_read = trio.current_time()
        ping_sent: float | None = None
        try:
            await self._send(connection)
            while not wire.closed:
                deadline, why = self._wait_deadline(wire, handshake_deadline, last_read, ping_sent)
                data: bytes | bytearray | None = None
                if deadline == math.inf:  # no cancel scope (its enter and exit) where nothing would fire
                    data = await stream.receive_some(RECEIVE_BYTES)
                else:
                    with trio.move_on_at(deadline):  # only the wait for the peer, not our own work
                        data = await stream.receive_some(RECEIVE_BYTES)
                if data is None:
                    if why == "keepalive":
                        ping_sent = trio.current_time()
                        wire.ping()
                        await self._send(connection)
                        continue
                    log.info("grpc_wire.connection_timeout peer=%s reason=%s", peer, why)
                    wire.close(why)
                    await self._send(connection)
                    return
                if not data:
                    return
                ping_sent = None
                wire.receive_data(data)
                self._start_opened()
                await self._send(connection)
                while wire.paused:  # a bounded slice at a time, letting other tasks run between
                    await trio.lowlevel.checkpoint()
                    wire.resume()
                    self._start_opened()
                    await self._send(connection)
                last_read = trio.current_time()  # once it is all processed: our own work is no silence
        except trio.TooSlowError:
            log.info("grpc_wire.connection_timeout peer=%s reason=peer took no data for %g s",
                     peer, self.timeouts.send_s)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("grpc_wire.connection_lost peer=%s error=%r", peer, exc)

    def _start_opened(self) -> None:
        for method in self._task_methods:
            method.start_opened()

    async def _resume_parked(self, connection: _Connection, scope: trio.CancelScope) -> None:
        """Send what parked streams (flow control) and stream tasks have, once they have it; once that
        closed the connection (its last stream ended after the client's GOAWAY, or streams failed past
        the budget), stop the reader too."""
        wire = connection.wire
        with contextlib.suppress(trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
            while not wire.closed:
                if not wire.has_unparked:
                    await connection.lot.park()
                wire.resume_unparked()
                await self._send(connection)
        scope.cancel()

    async def _send(self, connection: _Connection) -> None:
        # Two tasks write (the reader's replies, the parked streams'): one send_all at a time. The
        # lock is taken without a checkpoint when free (the common case costs nothing more), and not
        # at all with nothing to send (a read that only fed a stream task).
        if not connection.wire.has_output:
            return
        lock = connection.lock
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()
        try:
            out = connection.wire.data_to_send()
            if out:
                await sockets.send(connection.stream, out, timeout=self.timeouts.send_s)
        finally:
            lock.release()

    async def go_away(self, message: str, *, two_steps: bool = False) -> None:
        """A graceful GOAWAY on every connection: its open streams go on, new ones go elsewhere. In
        ``two_steps`` the final GOAWAY of each goes on its client's PING ACK, or after
        ``GOAWAY_ACK_TIMEOUT_SECONDS`` (see :meth:`GrpcWireConnection.go_away`)."""
        await self._tell_each(lambda wire: wire.go_away(message, two_steps=two_steps))
        if two_steps:
            assert self.nursery is not None
            self.nursery.start_soon(self._finish_going_away)

    async def _finish_going_away(self) -> None:
        await trio.sleep(GOAWAY_ACK_TIMEOUT_SECONDS)
        await self._tell_each(GrpcWireConnection.finish_going_away)

    async def stop_gracefully(self) -> None:
        """A graceful GOAWAY on every connection; returns once the last has closed (after its last stream)."""
        self.stopping = True
        await self.go_away(_STOPPING, two_steps=True)  # every stream taken is served
        while self.active:
            self._connection_ended = trio.Event()
            await self._connection_ended.wait()

    async def say_goodbye(self) -> None:
        """GOAWAY on every connection (streams still open are aborted)."""
        await self._tell_each(lambda wire: wire.close("the server is shutting down"))

    async def _tell_each(self, tell: Callable[[GrpcWireConnection], None]) -> None:
        """``tell`` each connection's wire, write what it queued (each write bounded), and wake its
        writer task: one whose wire ``tell`` closed (its last stream had ended) then ends the connection."""
        for connection in list(self.connections):
            tell(connection.wire)
            with trio.move_on_after(_REFUSAL_SEND_S), contextlib.suppress(
                    trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
                await self._send(connection)
            connection.lot.unpark_all()


class GracefulStop:
    """Asks :func:`serve_grpc` for a graceful stop: ``await stop()`` returns once it is over."""

    def __init__(self) -> None:
        self.requested = trio.Event()
        self.done = trio.Event()

    async def __call__(self) -> None:
        self.requested.set()
        await self.done.wait()


async def _go_away_when(server: _Server, going_away: trio.Event) -> None:
    await going_away.wait()
    # One step: a draining server refuses new streams anyway, so those that race the GOAWAY do
    # better above its last stream id, where clients know to send them again elsewhere.
    await server.go_away("the server is draining")


def _drop_unread(stream: trio.SocketStream) -> None:
    """Read and drop what the peer already sent, up to ``LINGER_BYTES`` (see there)."""
    left = LINGER_BYTES
    with contextlib.suppress(OSError):  # BlockingIOError: nothing more is waiting
        while left > 0 and (chunk := os.read(stream.socket.fileno(), min(left, RECEIVE_BYTES))):
            left -= len(chunk)


_NOT_TLS = frozenset({"HTTP_REQUEST", "WRONG_VERSION_NUMBER", "UNSUPPORTED_PROTOCOL", "RECORD_LAYER_FAILURE",
                      "UNKNOWN_PROTOCOL", "PACKET_LENGTH_TOO_LONG"})


async def serve_grpc(
    methods: Sequence[SyncBidiMethod[Any, Any] | StreamMethod[Any]],
    host: str,
    port: int,
    *,
    limits: WireLimits | None = None,
    timeouts: WireTimeouts | None = None,
    ssl_context: SSLContextSource | None = None,
    reuse_port: bool = False,
    before_close: Callable[[], Awaitable[object]] | None = None,
    going_away: trio.Event | None = None,
    graceful_stop: GracefulStop | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``methods`` over gRPC on ``host:port`` until cancelled; ``started`` gets the bound port.

    With ``ssl_context`` (a context, or a callable called per accepted connection so that a
    reloaded certificate applies to new connections) each connection is TLS with ALPN ``h2``.
    ``reuse_port``: see :func:`bind`. Cancelled, it stops accepting, runs ``before_close`` (so that
    open streams end with a status of their own) while connections are still served, sends GOAWAY
    on each, then cancels what is left. Once ``going_away`` is set (a drain), every connection open
    then gets a graceful GOAWAY (see :meth:`GrpcWireConnection.go_away`): clients send new streams
    elsewhere. Once ``graceful_stop`` is called (as grpc-go's ``GracefulStop``), the port closes,
    every connection gets a graceful GOAWAY, and it returns once the last has closed (its streams
    ended); the call returns then too. Bound it by cancelling. Raises :class:`OSError` when the port cannot be bound.
    """
    sock = bind(host, port, reuse_port=reuse_port)
    bound: int = sock.getsockname()[1]
    server = _Server(methods, limits or WireLimits(), timeouts or WireTimeouts(), ssl_context)
    log.info("grpc_wire.listening host=%s port=%d tls=%s", host, bound, ssl_context is not None)
    with trio.socket.from_stdlib_socket(sock) as listening:
        async with trio.open_nursery() as nursery:
            tasks: trio.CancelScope = await nursery.start(server.run_tasks)
            try:
                async with trio.open_nursery() as accepting:
                    accepting.start_soon(server.accept_loop, trio.SocketListener(listening))
                    if going_away is not None:
                        nursery.start_soon(_go_away_when, server, going_away)
                    task_status.started(bound)
                    if graceful_stop is None:
                        await trio.sleep_forever()
                    await graceful_stop.requested.wait()
                    accepting.cancel_scope.cancel()
                listening.close()
                log.info("grpc_wire.stopping port=%d connections=%d", bound, server.active)
                await server.stop_gracefully()
                graceful_stop.done.set()
                nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    with trio.move_on_after(CLOSE_TIMEOUT_SECONDS):
                        if before_close is not None:
                            await before_close()
                        await server.say_goodbye()
                    tasks.cancel()
                    log.info("grpc_wire.closed port=%d", bound)
