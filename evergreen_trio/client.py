"""The client end of a session, for async scripts: ``async with connect("host:port") as session``."""

from __future__ import annotations

import math
import ssl
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace

import trio

from evergreen_trio._grpc.bridge import ClientOptions, MessageStream, open_client_stream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.dag import SessionAbortedError, SessionError, SessionLimits, StatusCode
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
from evergreen_trio.refs import RefResolver, resolver_map


class ClientSession(Session, ActionRegistry):
    """Builds and sends nodes and actions (:meth:`run`), reads what the server produces, and serves
    the actions the server sends (tool calls) to the handlers registered with :meth:`action`.

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
                await self.barrier.wait(node_id)
        while self.error is None and self._running:
            self._idle = trio.Event()
            await self._idle.wait()


def parse_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"expected host:port, got {target!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


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
) -> AsyncIterator[ClientSession]:
    """Open a session to ``host:port``. Leaving the block ends the client's side of the stream and
    waits for the server to finish; a server abort raises :class:`SessionAbortedError` here.

    ``tls``: ``True`` verifies the server against the system's CAs, an ``ssl.SSLContext``
    (:func:`evergreen_trio.tls.client_context`) as it says. ``metadata`` goes with the call (a bearer
    token: ``{"authorization": "Bearer ..."}``). ``timeout`` bounds the whole session: it is sent as
    ``grpc-timeout``, and past it the session aborts with DEADLINE_EXCEEDED on both sides.
    """
    host, port = parse_target(target)
    options = SessionOptions(limits or SessionLimits(), resolver_map(resolvers), fragment_bytes)
    wire = ClientOptions(tls=tls, metadata=metadata, timeout=timeout)
    async with open_client_stream(
        host, port, START_SESSION, SessionMessage, SessionMessage, pack_messages, options=wire
    ) as stream:
        session = ClientSession(stream, options)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_receive, session, nursery.cancel_scope, timeout)
            try:
                yield session
                await session._settle()
            except SessionError as error:
                # Raised plainly below, not wrapped in the nurseries' exception groups.
                session.fail(error)
                stream.finish(error.code, error.message)
            except BaseException:
                if session.error is None:
                    stream.finish(StatusCode.CANCELLED, "the client gave up")
                raise
            stream.finish()
    if session.error is not None:
        raise session.error


async def _receive(session: ClientSession, scope: trio.CancelScope, seconds: float | None) -> None:
    # The client's side of the deadline: a server that does not answer in time is not waited for.
    with trio.move_on_after(math.inf if seconds is None else seconds) as timer:
        try:
            await session.serve()
        except SessionError as error:
            _abort(session, scope, error)
    if timer.cancelled_caught:
        why = f"no answer within the {seconds:g} s timeout"
        _abort(session, scope, SessionAbortedError(why, code=StatusCode.DEADLINE_EXCEEDED))


def _abort(session: ClientSession, scope: trio.CancelScope, error: SessionError) -> None:
    session.fail(error)
    session.stream.finish(error.code, error.message)
    scope.cancel()

