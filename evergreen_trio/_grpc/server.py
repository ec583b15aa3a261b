"""The Trio shell of :mod:`evergreen_trio._grpc.server_wire`: a TCP (or TLS) listener, one task per connection.

Each connection task reads, feeds the sans-IO connection (which calls the stream processors
synchronously) and writes everything queued in one ``send_all``: an ext_proc request costs one
read and one write here, with no asyncio loop and no Trio/asyncio crossing. Every wait for the
peer has a deadline (:class:`WireTimeouts`), connections are capped
(:attr:`~evergreen_trio._grpc.server_wire.WireLimits.max_connections`), and a read whose
frames queue much output is written in slices (the connection pauses between them).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from evergreen_trio._grpc.limits import OUT_OF_RESOURCES_ERRNOS
from evergreen_trio._grpc.server_wire import GrpcWireConnection, SyncBidiMethod, WireLimits, refusal

log = logging.getLogger(__name__)
RECEIVE_BYTES = 256 * 1024
_MAX_BACKOFF_S = 1.0
_REFUSAL_SEND_S = 0.1

SSLContextSource = ssl.SSLContext | Callable[[], ssl.SSLContext]


@dataclass(frozen=True)
class WireTimeouts:
    """Deadlines of the shell, in seconds.

    ``handshake_s``: from accept to the client's preface and first SETTINGS (TLS included).
    ``idle_s``: a connection with no open stream and no frame for this long gets GOAWAY NO_ERROR.
    ``send_s``: a write the peer does not take within this long closes the connection.
    """

    handshake_s: float = 10.0
    idle_s: float = 300.0
    send_s: float = 30.0


def _peer(stream: trio.SocketStream) -> str:
    try:
        host, port = stream.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class _Server:
    """Accepts connections up to the cap and serves each in its own task."""

    def __init__(self, methods: dict[str, SyncBidiMethod[Any, Any]], limits: WireLimits, timeouts: WireTimeouts,
                 ssl_context: SSLContextSource | None) -> None:
        self.methods = methods
        self.limits = limits
        self.timeouts = timeouts
        self.ssl_context = ssl_context
        self.active = 0
        self.refused = 0  # connections refused since the cap was last reached

    async def accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
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
                if not self.refused:
                    log.warning("grpc_wire.connection_refused active=%d cap=%d: refusing new connections",
                                self.active, self.limits.max_connections)
                self.refused += 1
                await self._refuse(stream)
                continue
            if self.refused:
                log.info("grpc_wire.accepting_again refused=%d", self.refused)
                self.refused = 0
            self.active += 1
            nursery.start_soon(self.serve_connection, stream)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """Close a connection past the cap; a plaintext one first gets GOAWAY ENHANCE_YOUR_CALM
        (a TLS one cannot be told before its handshake, which the cap exists to avoid)."""
        if self.ssl_context is None:
            message = refusal(f"over the limit of {self.limits.max_connections} connections")
            # A new socket's buffer takes it at once; a peer already gone does not matter.
            with trio.move_on_after(_REFUSAL_SEND_S), contextlib.suppress(trio.BrokenResourceError):
                await stream.send_all(message)
        await trio.aclose_forcefully(stream)

    async def serve_connection(self, raw: trio.SocketStream) -> None:
        handshake_deadline = trio.current_time() + self.timeouts.handshake_s
        try:
            stream: trio.abc.Stream = raw
            if self.ssl_context is not None:
                context = self.ssl_context() if callable(self.ssl_context) else self.ssl_context
                context.set_alpn_protocols(["h2"])
                tls = trio.SSLStream(raw, context, server_side=True)
                if not await self._tls_handshake(tls, handshake_deadline):
                    return
                stream = tls
            connection = GrpcWireConnection(self.methods, self.limits)
            lot, lock = trio.lowlevel.ParkingLot(), trio.StrictFIFOLock()
            connection.on_wake = lot.unpark_all
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._resume_parked, stream, connection, lot, lock)
                    await self._converse(stream, connection, handshake_deadline, _peer(raw), lock)
                    nursery.cancel_scope.cancel()
            finally:
                connection.abort_streams()  # lost, closed or cancelled: release what streams hold
        finally:
            self.active -= 1
            await trio.aclose_forcefully(raw)

    async def _tls_handshake(self, stream: trio.SSLStream[trio.SocketStream], deadline: float) -> bool:
        with trio.move_on_at(deadline):
            try:
                await stream.do_handshake()
            except trio.BrokenResourceError as exc:
                log.info("grpc_wire.tls_failed error=%r", exc.__cause__ or exc)
                return False
            return True
        log.info("grpc_wire.connection_timeout reason=no TLS handshake in time")
        return False

    async def _converse(self, stream: trio.abc.Stream, connection: GrpcWireConnection,
                        handshake_deadline: float, peer: str, lock: trio.StrictFIFOLock) -> None:
        timeouts = self.timeouts
        try:
            await self._send(stream, connection, lock)
            while not connection.closed:
                if not connection.handshake_complete:
                    deadline, why = handshake_deadline, "no preface and SETTINGS in time"
                elif not connection.open_streams:
                    deadline, why = trio.current_time() + timeouts.idle_s, "idle"
                else:
                    deadline, why = math.inf, ""
                data: bytes | bytearray | None = None
                with trio.move_on_at(deadline):  # only the wait for the peer, not our own work
                    data = await stream.receive_some(RECEIVE_BYTES)
                if data is None:
                    log.info("grpc_wire.connection_timeout peer=%s reason=%s", peer, why)
                    connection.close(why)
                    await self._send(stream, connection, lock)
                    return
                if not data:
                    return
                connection.receive_data(data)
                await self._send(stream, connection, lock)
                while connection.paused:  # a bounded slice at a time, letting other tasks run between
                    await trio.lowlevel.checkpoint()
                    connection.resume()
                    await self._send(stream, connection, lock)
        except trio.TooSlowError:
            log.info("grpc_wire.connection_timeout peer=%s reason=peer took no data for %g s",
                     peer, timeouts.send_s)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            log.debug("grpc_wire.connection_lost peer=%s error=%r", peer, exc)

    async def _resume_parked(self, stream: trio.abc.Stream, connection: GrpcWireConnection,
                             lot: trio.lowlevel.ParkingLot, lock: trio.StrictFIFOLock) -> None:
        """Send what parked streams (requests waiting in flow control) have once they are ready."""
        with contextlib.suppress(trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError):
            while not connection.closed:
                if not connection.has_unparked:
                    await lot.park()
                connection.resume_unparked()
                await self._send(stream, connection, lock)

    async def _send(self, stream: trio.abc.Stream, connection: GrpcWireConnection,
                    lock: trio.StrictFIFOLock) -> None:
        # Two tasks write (the reader's replies, the parked streams'): one send_all at a time. The
        # lock is taken without a checkpoint when free (the common case costs nothing more).
        if lock.locked():
            await lock.acquire()
        else:
            lock.acquire_nowait()
        try:
            out = connection.data_to_send()
            if out:
                with trio.fail_after(self.timeouts.send_s):
                    await stream.send_all(out)
        finally:
            lock.release()




async def serve_sync_bidi(
    methods: Sequence[SyncBidiMethod[Any, Any]],
    host: str,
    port: int,
    *,
    limits: WireLimits | None = None,
    timeouts: WireTimeouts | None = None,
    ssl_context: SSLContextSource | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``methods`` over gRPC on ``host:port`` until cancelled; ``started`` gets the bound port.

    With ``ssl_context`` (a context, or a callable called per accepted connection so that a
    reloaded certificate applies to new connections) each connection is TLS with ALPN ``h2``.
    Raises :class:`OSError` when the port cannot be bound.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound: int = listeners[0].socket.getsockname()[1]
    server = _Server({m.path: m for m in methods}, limits or WireLimits(), timeouts or WireTimeouts(), ssl_context)
    log.info("grpc_wire.listening host=%s port=%d tls=%s", host, bound, ssl_context is not None)
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(server.accept_loop, listener, nursery)
        task_status.started(bound)
