"""An Evergreen server: actions registered by name, one nursery per session, all in one server nursery."""

from __future__ import annotations

import gc
import inspect
import logging
import random
import ssl
import weakref
from collections.abc import Iterable
from functools import partial
from typing import Any

import trio
from grpclib.const import Status

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.health import ServerHealth
from evergreen_trio._grpc.limits import TransportLimits
from evergreen_trio._grpc.reflection import reflection_methods
from evergreen_trio._grpc.server import StreamMethod, WireTimeouts, serve_grpc
from evergreen_trio._grpc.server_wire import SyncBidiMethod, WireLimits
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import SERVICE, START_SESSION
from evergreen_trio.dag import SessionError, SessionLimits, StatusCode
from evergreen_trio.errors import plain_errors
from evergreen_trio.nursery_session import (
    PACK_BYTES,
    ActionRegistry,
    ActionSpec,
    Outbound,
    ServerSession,
    SessionOptions,
    pack_messages,
)
from evergreen_trio.refs import RefResolver, resolver_map
from evergreen_trio.serving.auth import Authorizer, Peer
from evergreen_trio.serving.expiry import DEADLINE_PASSED, SessionExpiry
from evergreen_trio.serving.metrics import SessionMetrics

log = logging.getLogger(__name__)

DRAIN_GRACE_SECONDS = 30.0
"""How long :meth:`Server.drain` lets open sessions run by default."""

IDLE_TIMEOUT_SECONDS = 120.0
"""``Server(idle_timeout=)``'s default: a session silent both ways with no action working (one
waiting for the peer's input does not count), or a connection with no session, is ended after this
long (it was 300 s: an idle session holds its share of the caps, so a short life bounds what idle
peers can hold)."""

FORGET_STEP = 4096
"""A finished session's graph is freed this many entries per scheduling pass (see ``SessionGraph.forget``)."""


SESSION_WINDOW_BYTES = 4 * 1024 * 1024
"""The HTTP/2 stream and connection window a session server grants (grpclib's default, which it served with)."""

STREAMS_PER_SLICE = 8
"""New sessions one connection opens per slice of its input (per Trio scheduling pass): 50 connections
writing 100 HEADERS each started 5,000 session tasks in one pass, which every other client then
waited behind (a 280 ms stall; 8 a slice: see ``python -m benchmarks.security_session``)."""

SHUTDOWN_GRACE_SECONDS = 5.0
"""How long a stopping server waits for open sessions to receive their UNAVAILABLE status."""


GC_THRESHOLDS = (10_000, 5, 20)
"""The garbage collector's thresholds in a serving process (:func:`tune_gc`; CPython's are (700, 10, 10))."""


def tune_gc() -> None:
    """Set up this process's garbage collector for a server holding many sessions (``serve`` calls it).

    A full collection scans every live object on the one thread, and a silent session holds about
    100 of them: with 5,000 sessions open, each full collection froze the server 300-700 ms, and
    CPython's default thresholds ran ten of them while a flood opened its sessions. Objects alive
    once the server is built are frozen (never scanned again), and the thresholds make full
    collections rare (after about a million more objects, not 70,000); the young ones stay cheap.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class Server(ActionRegistry):
    """Serves ``EvergreenService.StartSession``.

    >>> server = Server()
    >>> @server.action("GENERATE", inputs=["prompt"], outputs=["response"])
    ... async def generate(ctx): ...

    Transport and security (docs/security.md):

    - ``tls``: serve TLS (:func:`evergreen_trio.serving.tls.server_context`); ``authorize``: called with each
      session's metadata and :class:`~evergreen_trio.serving.auth.Peer` before the session starts.
    - ``max_sessions`` open on the server, ``max_sessions_per_peer`` from one remote address (its
      share), ``max_sessions_per_connection`` (advertised as HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS;
      a stream past it gets RST_STREAM(REFUSED_STREAM)), ``max_connections`` (past it a new
      connection gets GOAWAY(ENHANCE_YOUR_CALM) and is closed). A plain (not async) ``authorize``
      runs before a session is counted or started: a refusal costs no task, and a connection with
      more than ``max_sessions_per_connection`` refusals gets GOAWAY(ENHANCE_YOUR_CALM).
    - ``first_message_timeout``: a session that sends nothing that long, and a connection that does
      not finish its HTTP/2 (and TLS) handshake, are ended. ``idle_timeout``: a session with no
      message either way and no action working that long (an action waiting for the peer's input
      does not count), and a connection with no session, are
      ended (``None``: never). Both end a session with DEADLINE_EXCEEDED, as does the client's
      ``grpc-timeout``; the session's nursery is cancelled.
    - ``max_message_bytes``: an inbound gRPC message claiming more is refused on its 5-byte
      prefix with RESOURCE_EXHAUSTED (default: ``limits.max_fragment_bytes`` plus the 1 MiB a
      peer packs fragments into, plus 64 KiB).
    - ``error_details``: send a failed handler's exception text to the client. By default the
      client gets the status and ``(error id ...)``, an id the server's log line also has.
    - ``reflection``: answer gRPC server reflection (v1 and v1alpha) on the port, so grpcurl and
      similar tools list and describe ``evergreen.v2.EvergreenService`` and ``grpc.health.v1.Health``.
    """

    def __init__(
        self,
        *,
        limits: SessionLimits | None = None,
        resolvers: Iterable[RefResolver] = (),
        targets: Iterable[str] = ("",),
        fragment_bytes: int = 256 * 1024,
        tls: ssl.SSLContext | None = None,
        authorize: Authorizer | None = None,
        max_sessions: int = 10_000,
        max_sessions_per_peer: int = 2_500,
        max_sessions_per_connection: int = 100,
        max_connections: int = 4096,
        first_message_timeout: float = 30.0,
        idle_timeout: float | None = IDLE_TIMEOUT_SECONDS,
        max_message_bytes: int | None = None,
        error_details: bool = False,
        reflection: bool = True,
    ) -> None:
        limits = limits or SessionLimits()
        self.metrics = SessionMetrics()
        self.options = SessionOptions(
            limits=limits, resolvers=resolver_map(resolvers), fragment_bytes=fragment_bytes, metrics=self.metrics,
            error_details=error_details,
        )
        self.targets = frozenset(targets)
        self.tls = tls
        self.authorize = authorize
        self.first_message_timeout = first_message_timeout
        self.idle_timeout = idle_timeout
        self.transport_limits = TransportLimits(
            max_connections=max_connections,
            max_streams=max_sessions,
            max_streams_per_peer=max_sessions_per_peer,
            max_streams_per_connection=max_sessions_per_connection,
            max_message_bytes=max_message_bytes or limits.max_fragment_bytes + PACK_BYTES + 64 * 1024,
            handshake_timeout=first_message_timeout,
            idle_timeout=idle_timeout,
        )
        self.actions: dict[str, ActionSpec] = {}
        self.reflection = reflection
        self.health = ServerHealth(("", SERVICE))
        self._open: set[MessageStream[Outbound]] = set()
        self._per_peer: dict[str, int] = {}
        self._saturated = False  # the session cap was reached (one warning per episode)
        self._authorize_plain = False  # set by serve: authorize runs in _admit_session
        # Principals of the sessions a plain authorize admitted before they were counted.
        self._admitted: weakref.WeakKeyDictionary[MessageStream[Outbound], object] = weakref.WeakKeyDictionary()
        self._draining = trio.Event()  # set by drain: sessions refused, connections get a graceful GOAWAY
        self._session_closed: trio.Event | None = None
        self._expiring = trio.Lock()  # see _expired
        self._expiry = SessionExpiry(self.first_message_timeout, self.idle_timeout, self._expired)

    @property
    def open_sessions(self) -> int:
        """Sessions being served now."""
        return len(self._open)

    @property
    def draining(self) -> bool:
        """True once ``drain`` began: new sessions are refused, open ones finish."""
        return self._draining.is_set()

    async def serve(
        self,
        host: str = "127.0.0.1",
        port: int = 50051,
        *,
        reuse_port: bool = False,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled; ``task_status.started`` gets the bound port (0 picks a free one).

        ``reuse_port`` (SO_REUSEPORT) lets several processes serve one port (``serve --workers``).
        Cancelled, it ends the sessions still open with UNAVAILABLE; :meth:`drain` first to let
        them finish. Raises ``OSError`` when the address cannot be bound.
        """
        self._authorize_plain = _plain(self.authorize)  # once, not per session
        # The timeouts as they are when serving starts.
        self._expiry = SessionExpiry(self.first_message_timeout, self.idle_timeout, self._expired)
        sessions: StreamMethod[Outbound] = StreamMethod(
            START_SESSION, SessionMessage, self._run_session, pack_messages, admit=self._admit_session,
            abandon=self._forget)
        methods: list[SyncBidiMethod[Any, Any] | StreamMethod[Any]] = [sessions, *self.health.methods]
        if self.reflection:
            methods += reflection_methods([SERVICE, "grpc.health.v1.Health"])
        limits = self.transport_limits
        try:
            with plain_errors():  # Ctrl-C in a handler leaves as a plain KeyboardInterrupt, not in nested groups
                async with trio.open_nursery() as nursery:
                    bound = await nursery.start(partial(
                        serve_grpc, methods, host, port, limits=wire_limits(limits), timeouts=wire_timeouts(limits),
                        ssl_context=self.tls, reuse_port=reuse_port, before_close=self._end_open_sessions,
                        going_away=self._draining))
                    nursery.start_soon(self._expiry.run)
                    self.health.set(ready=not self.draining, live=True)
                    task_status.started(bound)
        finally:
            self.health.set(ready=False, live=False)

    async def drain(self, grace: float = DRAIN_GRACE_SECONDS) -> int:
        """Stop accepting sessions and let the open ones finish, for at most ``grace`` seconds.

        From now on readiness answers NOT_SERVING (liveness stays SERVING), each connection open now
        gets a graceful GOAWAY (its open sessions go on; its client opens new ones on a new
        connection, which behind a load balancer reaches another server), and a new session ends at
        once with UNAVAILABLE (no handler runs; the client may retry elsewhere). Returns how many
        sessions are still open; cancelling :meth:`serve` then ends them with UNAVAILABLE.
        """
        self._draining.set()
        self.health.set(ready=False, live=True)
        log.info("server.draining open=%d grace_s=%s", len(self._open), grace)
        with trio.move_on_after(grace):
            while self._open:
                self._session_closed = trio.Event()
                await self._session_closed.wait()
        log.info("server.drained still_open=%d", len(self._open))
        return len(self._open)

    def _admit_session(self, stream: MessageStream[Outbound]) -> None:
        """Admit a new session before its task starts, or raise RpcAbortError with the status that
        refuses it: UNAVAILABLE while draining, a plain ``authorize``'s refusal (before the session
        counts), RESOURCE_EXHAUSTED past ``max_sessions`` or the peer's ``max_sessions_per_peer``."""
        if self._draining.is_set():
            self.metrics.aborted("draining")
            raise RpcAbortError(Status.UNAVAILABLE, "the server is draining; open the session elsewhere")
        if self._authorize_plain:
            self._admit(stream)
        limits = self.transport_limits
        host = _host(stream.peer)
        if len(self._open) >= limits.max_streams:
            if not self._saturated:  # once per episode: a flood must not flood the log too
                self._saturated = True
                log.warning("grpc.session_cap_reached open=%d peer=%s", len(self._open), stream.peer)
            self.metrics.limit_hit("max_sessions")
            raise RpcAbortError(Status.RESOURCE_EXHAUSTED,
                                f"the server has {limits.max_streams} sessions open, its limit")
        self._saturated = False
        share = limits.max_streams_per_peer
        if self._per_peer.get(host, 0) >= share:
            self.metrics.limit_hit("max_sessions_per_peer")
            raise RpcAbortError(Status.RESOURCE_EXHAUSTED, f"{host} has {share} sessions open, its share of the server")
        self._per_peer[host] = self._per_peer.get(host, 0) + 1
        self._open.add(stream)

    async def _run_session(self, stream: MessageStream[Outbound]) -> None:
        self.metrics.session_started()
        try:
            opened, principal = await self._opened(stream)
            if opened:
                session = ServerSession(stream, self.options, self.actions, self.targets)
                session.principal = principal  # type: ignore[assignment]
                with trio.CancelScope() as scope:
                    watched = self._expiry.watch(stream, session, scope)
                    try:
                        await session.run_session()
                    finally:
                        self._expiry.forget(watched)
                # Its status is on its way: free what it held in steps (FORGET_STEP entries each).
                while not session.graph.forget(FORGET_STEP):
                    await trio.lowlevel.checkpoint()
        finally:
            self.metrics.session_ended(stream.final.status.name if stream.final else StatusCode.UNAVAILABLE.name)
            stream.finish(StatusCode.UNAVAILABLE, "the server ended the session")  # unless it has its status
            stream.release()
            # The final status goes out on the connection's writer: a session stays open until it has, so
            # that a stopping server (``_end_open_sessions``) waits for it before it says GOAWAY
            # (which ends this wait however slow the client is to read).
            await stream.wait_closed(shield=True)
            self._forget(stream)

    def _forget(self, stream: MessageStream[Outbound]) -> None:
        """Give back what ``_admit_session`` took: at the end of the session, or in its place when the
        client reset the stream before the session started (rapid reset starts no task)."""
        self._open.discard(stream)
        host = _host(stream.peer)
        self._per_peer[host] -= 1
        if not self._per_peer[host]:
            del self._per_peer[host]
        if self._session_closed is not None:
            self._session_closed.set()

    async def _opened(self, stream: MessageStream[Outbound]) -> tuple[bool, object]:
        """Authorize the session and wait for its first message (or the end of its stream) before
        anything is built for it: (True, the principal), or (False, None) once it has ended.

        A silent session holds one task and no graph (a flood of them is a flood of small
        objects). Both steps end at ``first_message_timeout`` (up to 10% more, at random, so that
        sessions a flood opened together do not all end in one pass) or the call's deadline.
        """
        now = trio.current_time()
        if self.authorize is None and stream.inbound.ready and (stream.deadline is None or stream.deadline > now):
            return True, None  # the first message came with the headers (the common case): no wait, no timer
        timeout = self.first_message_timeout
        at = now + timeout * (1.0 + random.random() / 10)
        why = f"no message within {timeout:g} s of opening the session"
        if stream.deadline is not None and stream.deadline < at:
            at, why = stream.deadline, DEADLINE_PASSED
        with trio.move_on_at(at):
            # A deadline already past when the task starts ends it here, even when nothing below has
            # to wait (the whole input came with the headers): no session starts after its deadline.
            await trio.lowlevel.checkpoint_if_cancelled()
            authorized, principal = await self._authorized(stream)
            if authorized:
                await stream.inbound.wait()
            return authorized, principal
        await self._expired(stream, why)
        return False, None
    def _admit(self, stream: MessageStream[Outbound]) -> None:
        """A plain ``authorize``, run in the acceptor before the session is counted: a refusal is
        raised as RpcAbortError (the stream ends with its status; nothing starts for it)."""
        assert self.authorize is not None
        try:
            self._admitted[stream] = self.authorize(stream.metadata, Peer(stream.peer, stream.peer_certificate))
        except SessionError as refused:
            log.info("session.refused peer=%s code=%s reason=%s", stream.peer, refused.code.name, refused.message)
            self.metrics.aborted(refused.code.name.lower())
            raise RpcAbortError(Status(refused.code.value), refused.message) from None
        except Exception:
            log.exception("session.authorize_failed peer=%s", stream.peer)
            raise RpcAbortError(Status.INTERNAL, "the server could not check the credentials") from None

    async def _authorized(self, stream: MessageStream[Outbound]) -> tuple[bool, object]:
        """Run ``authorize`` (unless it ran at admission): (True, the principal), or (False, None)
        when it refused, the stream then ended with its status."""
        if self.authorize is None:
            return True, None
        try:
            if stream in self._admitted:
                principal = self._admitted.pop(stream)
            else:
                principal = self.authorize(stream.metadata, Peer(stream.peer, stream.peer_certificate))
            if inspect.isawaitable(principal):
                principal = await principal
        except SessionError as refused:
            log.info("session.refused peer=%s code=%s reason=%s", stream.peer, refused.code.name, refused.message)
            stream.finish(refused.code, refused.message)
            self.metrics.aborted(refused.code.name.lower())
            return False, None
        except Exception:
            log.exception("session.authorize_failed peer=%s", stream.peer)
            stream.finish(StatusCode.INTERNAL, "the server could not check the credentials")
            return False, None
        return True, principal

    async def _expired(self, stream: MessageStream[Outbound], why: str) -> None:
        """End an expired session's stream with DEADLINE_EXCEEDED, in its turn: one session per
        scheduling pass, first come first served. A flood's sessions all expire at about the same
        time; ended together, their endings (and their status frames, queued on their connections
        ahead of everyone else's) stalled every other session for seconds."""
        async with self._expiring:
            await trio.lowlevel.checkpoint()
        log.info("session.expired peer=%s reason=%s", stream.peer, why)
        stream.finish(StatusCode.DEADLINE_EXCEEDED, why)
        self.metrics.aborted("deadline_exceeded")

    async def _end_open_sessions(self) -> None:
        """Before the connections are told to go away, let each open stream send its final status."""
        with trio.move_on_after(SHUTDOWN_GRACE_SECONDS):
            for stream in list(self._open):
                stream.finish(StatusCode.UNAVAILABLE, "the server is shutting down")
                await stream.wait_closed()


def _host(peer: str) -> str:
    """The address part of ``host:port`` (``[v6]:port``): a peer's share is counted per address."""
    return peer.rpartition(":")[0] or peer


def wire_limits(limits: TransportLimits) -> WireLimits:
    """The server wire's limits for a session server's :class:`TransportLimits`."""
    return WireLimits(
        max_connections=limits.max_connections,
        max_concurrent_streams=limits.max_streams_per_connection,
        max_message_bytes=limits.max_message_bytes,
        window_bytes=SESSION_WINDOW_BYTES,
        max_buffered_bytes=max(SESSION_WINDOW_BYTES, 3 * limits.max_message_bytes),
        max_stream_errors_per_second=limits.max_stream_errors_per_second,
        max_refused_streams=limits.max_streams_per_connection,
        streams_per_slice=STREAMS_PER_SLICE,
    )


def wire_timeouts(limits: TransportLimits) -> WireTimeouts:
    """The server shell's deadlines for a session server's :class:`TransportLimits`."""
    return WireTimeouts(handshake_s=limits.handshake_timeout, idle_s=limits.idle_timeout,
                        keepalive_s=limits.keepalive_time, keepalive_timeout_s=limits.keepalive_timeout)


def _plain(authorize: Authorizer | None) -> bool:
    """Whether ``authorize`` is a plain function (it may then run in the acceptor, before counting)."""
    if authorize is None:
        return False
    call = getattr(authorize, "__call__", None)  # noqa: B004 - a callable object's own __call__
    return not (inspect.iscoroutinefunction(authorize) or inspect.iscoroutinefunction(call))
