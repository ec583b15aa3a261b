"""The client end of a session, for async scripts.

``async with Client("host:port") as client`` holds one HTTP/2 connection; ``client.session()`` opens a
session on it (as many, one after another or at once, as the server allows per connection);
``async with connect("host:port") as session`` is the one-shot form.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from types import TracebackType

import trio

from evergreen_trio._grpc.client import ClientChannel, ClientOptions, ConnectFailedError, open_client_channel
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.dag import SessionAbortedError, SessionError, SessionLimits, StatusCode
from evergreen_trio.errors import ArgumentTypeError, ConfigurationError, EvergreenTrioError, describe_kind, plain_errors
from evergreen_trio.nodes import CLIENT_ROLE
from evergreen_trio.nursery_session import (
    ActionRegistry,
    Outbound,
    Session,
    SessionOptions,
    pack_messages,
)
from evergreen_trio.nursery_session import Call as Call  # re-exported: run()'s result, defined with it
from evergreen_trio.nursery_session import Output as Output
from evergreen_trio.nursery_session import UnknownNodeError as UnknownNodeError
from evergreen_trio.refs import RefResolver, resolver_map


class ClientSession(Session, ActionRegistry):
    """Builds and sends nodes and actions (:meth:`~evergreen_trio.nursery_session.Session.run`),
    reads what the server produces, and serves the actions the server sends (tool calls) to the
    handlers registered with :meth:`~evergreen_trio.nursery_session.ActionRegistry.action`.

    Without a handler for it, an action from the server aborts the session with UNIMPLEMENTED.
    """

    default_role = CLIENT_ROLE
    side = "client"

    def __init__(self, stream: MessageStream[Outbound], options: SessionOptions) -> None:
        # A failed handler's text stays on this side (a client cannot send a status): it is the user's own.
        super().__init__(stream, replace(options, error_details=True))

    async def _settle(self) -> None:
        """With handlers registered, before half-closing: keep serving the server's actions until
        the outputs of every action this side ran are complete and no handler runs."""
        if not self.actions:
            return
        for node_id in self._ran:
            while self.error is None and self.graph.can_arrive(node_id):
                node = self.graph.get(node_id)
                if node is not None and node.complete:
                    break
                await self.barrier.event(node_id).wait()
        while self.error is None and self._running:
            self._idle = trio.Event()
            await self._idle.wait()


def parse_target(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a pair; raises :class:`ConfigurationError` naming ``target``."""
    if not isinstance(target, str):
        raise ArgumentTypeError(f"target: expected 'host:port', got {describe_kind(target)}")
    host, sep, port = target.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536 or host.endswith(":"):
        raise ConfigurationError(f"target {target!r}: expected host:port (e.g. 127.0.0.1:50051)")
    return host.strip("[]") or "127.0.0.1", int(port)


class ClientStateError(EvergreenTrioError, RuntimeError):
    """A :class:`Client` used while not open (or opened twice)."""


class Client:
    """One HTTP/2 connection to an Evergreen server, for many sessions: ``async with Client(target) as client``.

    ``client.session()`` opens a session on the connection (the same :class:`ClientSession` as
    :func:`connect`); sessions may follow one another or run at once, up to the server's
    ``max_sessions_per_connection``. Leaving the block closes the connection; open sessions must end
    first (open them inside the block).

    ``tls``: ``True`` verifies the server against the system's CAs, an ``ssl.SSLContext``
    (:func:`evergreen_trio.serving.tls.client_context`) as it says. ``metadata`` goes with every session (a
    bearer token: ``{"authorization": "Bearer ..."}``). ``timeout`` bounds each session: it is sent as
    ``grpc-timeout``, and past it the session aborts with DEADLINE_EXCEEDED on both sides.
    ``connect_timeout`` bounds the connection's setup (TCP, TLS, the server's HTTP/2 preface);
    ``retries`` more attempts are made when the server is unreachable, ``backoff`` seconds apart
    (doubling, at most 5 s). A connection that cannot be made raises :class:`SessionAbortedError`
    (UNAVAILABLE) from ``async with``, saying why (refused, a TLS mismatch, no answer in time).
    """

    def __init__(
        self,
        target: str,
        *,
        tls: bool | ssl.SSLContext | None = None,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,
        limits: SessionLimits | None = None,
        resolvers: Iterable[RefResolver] = (),
        fragment_bytes: int = 256 * 1024,
        connect_timeout: float = 10.0,
        retries: int = 0,
        backoff: float = 0.2,
    ) -> None:
        self.host, self.port = parse_target(target)
        self.target = target
        for name, value in (("timeout", timeout), ("connect_timeout", connect_timeout), ("backoff", backoff)):
            if value is not None and not value > 0:
                raise ConfigurationError(f"Client {name}: expected a positive number of seconds, got {value!r}")
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ConfigurationError(f"Client retries: expected a count >= 0, got {retries!r}")
        self.tls = tls
        self.metadata = dict(metadata or {})
        self.timeout = timeout
        self.options = SessionOptions(limits or SessionLimits(), resolver_map(resolvers), fragment_bytes)
        self.connect_timeout = connect_timeout
        self.retries = retries
        self.backoff = backoff
        self._channel: ClientChannel | None = None
        self._exit: contextlib.AsyncExitStack | None = None

    async def __aenter__(self) -> Client:
        if self._exit is not None:
            raise ClientStateError(f"Client({self.target!r}) is already open")
        stack = contextlib.AsyncExitStack()
        try:
            self._channel = await stack.enter_async_context(self._connect())
        except BaseException:
            await stack.aclose()
            raise
        self._exit = stack
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        stack, self._exit, self._channel = self._exit, None, None
        assert stack is not None
        return await stack.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _connect(self) -> AsyncIterator[ClientChannel]:
        try:
            with plain_errors():
                async with open_client_channel(
                    self.host, self.port, tls=self.tls, connect_timeout=self.connect_timeout,
                    retries=self.retries, backoff=self.backoff,
                ) as channel:
                    yield channel
        except ConnectFailedError as error:
            # connect()'s timeout bounds the whole session, its connection included.
            code = StatusCode.UNAVAILABLE
            if error.timed_out and self.timeout is not None and self.timeout <= self.connect_timeout:
                code = StatusCode.DEADLINE_EXCEEDED
            raise SessionAbortedError(error.message, code=code) from None

    @asynccontextmanager
    async def session(
        self,
        *,
        metadata: Mapping[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - it becomes grpc-timeout
    ) -> AsyncIterator[ClientSession]:
        """Open a session on this connection. Leaving the block ends the client's side of the stream and
        waits for the server to finish; a server abort raises :class:`SessionAbortedError` here.

        ``metadata`` is added to the client's; ``timeout`` replaces the client's for this session.
        """
        if self._channel is None:
            raise ClientStateError(f"Client({self.target!r}) is not open (async with Client(target) as client)")
        seconds = self.timeout if timeout is None else timeout
        wire = ClientOptions(tls=self.tls, metadata={**self.metadata, **(metadata or {})}, timeout=seconds)
        with plain_errors():
            async with self._channel.open_stream(
                START_SESSION, SessionMessage, pack_messages, options=wire
            ) as stream:
                session = ClientSession(stream, self.options)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_receive, session, nursery.cancel_scope, seconds)
                    try:
                        yield session
                        await session._settle()
                    except SessionError as error:
                        session.fail(error)
                        stream.finish(error.code, error.message)
                    except BaseException:
                        if session.error is None:
                            stream.finish(StatusCode.CANCELLED, "the client gave up")
                        raise
                    stream.finish()
            if session.error is not None:
                raise session.error


@asynccontextmanager
async def connect(
    target: str,
    *,
    tls: bool | ssl.SSLContext | None = None,
    metadata: Mapping[str, str] | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 - the pinned interface; it becomes grpc-timeout too
    limits: SessionLimits | None = None,
    resolvers: Iterable[RefResolver] = (),
    fragment_bytes: int = 256 * 1024,
    connect_timeout: float = 10.0,
    retries: int = 0,
) -> AsyncIterator[ClientSession]:
    """Open one session to ``host:port`` on a connection of its own (a one-shot :class:`Client`; the
    arguments are the Client's). Leaving the block ends the client's side of the stream, waits for
    the server to finish and closes the connection; a server abort raises
    :class:`SessionAbortedError` here. For many sessions, open a :class:`Client` and reuse it.
    """
    client = Client(
        target, tls=tls, metadata=metadata, timeout=timeout, limits=limits, resolvers=resolvers,
        fragment_bytes=fragment_bytes, connect_timeout=min(connect_timeout, timeout or connect_timeout),
        retries=retries,
    )
    async with client, client.session() as session:
        yield session


async def _receive(session: ClientSession, scope: trio.CancelScope, seconds: float | None) -> None:
    if seconds is None:
        await _serve(session, scope)
        return
    # The client's side of the deadline: a server that does not answer in time is not waited for.
    with trio.move_on_after(seconds) as timer:
        await _serve(session, scope)
    if timer.cancelled_caught:
        why = f"no answer within the {seconds:g} s timeout"
        _abort(session, scope, SessionAbortedError(why, code=StatusCode.DEADLINE_EXCEEDED))


async def _serve(session: ClientSession, scope: trio.CancelScope) -> None:
    try:
        await session.serve()
    except SessionError as error:
        _abort(session, scope, error)


def _abort(session: ClientSession, scope: trio.CancelScope, error: SessionError) -> None:
    session.fail(error)
    session.stream.finish(error.code, error.message)
    scope.cancel()

