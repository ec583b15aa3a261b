"""An Evergreen server: actions registered by name, one nursery per session, all in one server nursery.

Beside ``StartSession`` the serving port answers gRPC health: ``""`` and
``evergreen.v2.EvergreenService`` are SERVING while it accepts sessions, NOT_SERVING once
:meth:`Server.drain` starts; ``liveness`` stays SERVING while it serves, draining included.
Session, action and fragment metrics go to ``server.metrics``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from functools import partial

import trio

from evergreen_trio._grpc.bridge import MessageStream, SessionAcceptor, serve_grpclib
from evergreen_trio._grpc.health import ServerHealth
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio.dag import SessionLimits, StatusCode
from evergreen_trio.metrics import SessionMetrics
from evergreen_trio.nursery_session import (
    ActionSpec,
    Handler,
    Outbound,
    ServerSession,
    SessionOptions,
    pack_messages,
)
from evergreen_trio.refs import RefResolver, resolver_map

log = logging.getLogger(__name__)

SERVICE = "evergreen.v2.EvergreenService"
START_SESSION = f"/{SERVICE}/StartSession"

DRAIN_GRACE_SECONDS = 30.0
"""How long :meth:`Server.drain` lets open sessions run by default."""

SHUTDOWN_GRACE_SECONDS = 5.0
"""How long a stopping server waits for open sessions to receive their UNAVAILABLE status."""


class Server:
    """Serves ``EvergreenService.StartSession``.

    >>> server = Server()
    >>> @server.action("GENERATE", inputs=["prompt"], outputs=["response"])
    ... async def generate(ctx): ...
    """

    def __init__(
        self,
        *,
        limits: SessionLimits | None = None,
        resolvers: Iterable[RefResolver] = (),
        targets: Iterable[str] = ("",),
        fragment_bytes: int = 256 * 1024,
    ) -> None:
        self.metrics = SessionMetrics()
        self.options = SessionOptions(
            limits=limits or SessionLimits(), resolvers=resolver_map(resolvers), fragment_bytes=fragment_bytes,
            metrics=self.metrics,
        )
        self.targets = frozenset(targets)
        self.actions: dict[str, ActionSpec] = {}
        self.health = ServerHealth(("", SERVICE))
        self._open: set[MessageStream[Outbound]] = set()
        self._draining = False
        self._session_closed: trio.Event | None = None

    def add_action(self, name: str, handler: Handler, *, inputs: Iterable[str], outputs: Iterable[str]) -> None:
        if name in self.actions:
            raise ValueError(f"action {name!r} is already registered")
        self.actions[name] = ActionSpec(name, handler, frozenset(inputs), frozenset(outputs))

    def action(
        self, name: str, *, inputs: Iterable[str] = (), outputs: Iterable[str] = ()
    ) -> Callable[[Handler], Handler]:
        """Register the decorated coroutine function as action ``name``."""

        def register(handler: Handler) -> Handler:
            self.add_action(name, handler, inputs=inputs, outputs=outputs)
            return handler

        return register

    @property
    def open_sessions(self) -> int:
        return len(self._open)

    @property
    def draining(self) -> bool:
        return self._draining

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
        them finish.
        """
        acceptor: SessionAcceptor[SessionMessage, Outbound] = SessionAcceptor(
            START_SESSION, SessionMessage, SessionMessage, pack_messages
        )
        grpc = partial(serve_grpclib, before_close=self._end_open_sessions, reuse_port=reuse_port)
        try:
            async with trio.open_nursery() as nursery:
                bound = await nursery.start(grpc, [acceptor, self.health.servable], host, port)
                nursery.start_soon(self._accept, acceptor)
                self.health.set(ready=not self._draining, live=True)
                task_status.started(bound)
        finally:
            self.health.set(ready=False, live=False)

    async def drain(self, grace: float = DRAIN_GRACE_SECONDS) -> int:
        """Stop accepting sessions and let the open ones finish, for at most ``grace`` seconds.

        From now on readiness answers NOT_SERVING (liveness stays SERVING) and a new session
        ends at once with UNAVAILABLE (no handler runs; the client may retry elsewhere). Returns
        how many sessions are still open; cancelling :meth:`serve` then ends them with UNAVAILABLE.
        """
        self._draining = True
        self.health.set(ready=False, live=True)
        log.info("server.draining open=%d grace_s=%s", len(self._open), grace)
        with trio.move_on_after(grace):
            while self._open:
                self._session_closed = trio.Event()
                await self._session_closed.wait()
        log.info("server.drained still_open=%d", len(self._open))
        return len(self._open)

    async def _accept(self, acceptor: SessionAcceptor[SessionMessage, Outbound]) -> None:
        async with trio.open_nursery() as sessions:
            try:
                while True:
                    # The batch is only an argument: a loop variable here would keep the last
                    # accepted stream (and, through its final error, its frames) alive.
                    self._start_sessions(sessions, await acceptor.accepted.get_batch())
            finally:
                acceptor.accepted.close()

    def _start_sessions(self, nursery: trio.Nursery, streams: list[MessageStream[Outbound]]) -> None:
        for stream in streams:
            if self._draining:
                stream.finish(StatusCode.UNAVAILABLE, "the server is draining; open the session elsewhere")
                stream.release()
                self.metrics.aborted("draining")
            else:
                nursery.start_soon(self._run_session, stream)

    async def _run_session(self, stream: MessageStream[Outbound]) -> None:
        self._open.add(stream)
        self.metrics.session_started()
        try:
            await ServerSession(stream, self.options, self.actions, self.targets).run()
        finally:
            self.metrics.session_ended(stream.final.status.name if stream.final else StatusCode.UNAVAILABLE.name)
            stream.release()
            # The final status goes out on grpclib's side: a session stays open until it has, so
            # that a stopping server (``_drain``) waits for it before grpclib cancels the stream
            # (which ends this wait however slow the client is to read).
            with trio.CancelScope(shield=True):
                await stream.wait_closed()
            self._open.discard(stream)
            if self._session_closed is not None:
                self._session_closed.set()

    async def _end_open_sessions(self) -> None:
        """Before grpclib cancels what is left, let each open stream send its final status."""
        with trio.move_on_after(SHUTDOWN_GRACE_SECONDS):
            for stream in list(self._open):
                stream.finish(14, "the server is shutting down")
                await stream.wait_closed()
