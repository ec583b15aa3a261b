"""gRPC health (``grpc.health.v1.Health``, Check and Watch) served on the server wire.

Readiness and liveness are two booleans set from Trio with a plain call. Check is a synchronous
processor; each Watch is a Trio task that sends its service's status at once, then whenever a
change (one :class:`trio.Event` per change) makes it differ from what it last sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, cast

import trio
from grpclib.const import Status
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.limits import HEALTH_WATCH_SECONDS, MAX_HEALTH_WATCHES
from evergreen_trio._grpc.server import StreamMethod
from evergreen_trio._grpc.server_wire import SyncBidiMethod
from evergreen_trio._grpc.streams import HandoffClosedError, MessageStream

CHECK_PATH = "/grpc.health.v1.Health/Check"
WATCH_PATH = "/grpc.health.v1.Health/Watch"

SERVING, NOT_SERVING = HealthCheckResponse.SERVING, HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = HealthCheckResponse.SERVICE_UNKNOWN
# Replies are only ever serialized, so one message per status serves every stream.
_REPLIES = {status: HealthCheckResponse(status=status) for status in (SERVING, NOT_SERVING, SERVICE_UNKNOWN)}
_READY, _LIVE, _BOTH = range(3)


class _Check:
    """One Check stream: its first request is answered and ends the stream."""

    __slots__ = ("_health", "finished")

    def __init__(self, health: ServerHealth) -> None:
        self._health = health
        self.finished = False

    def on_message(self, request: HealthCheckRequest) -> Sequence[HealthCheckResponse]:
        status = self._health.status(request.service)
        if status == SERVICE_UNKNOWN:
            raise RpcAbortError(Status.NOT_FOUND, "unknown service")
        self.finished = True
        return (_REPLIES[status],)

    def on_end(self) -> Sequence[HealthCheckResponse]:
        raise RpcAbortError(Status.INTERNAL, "expected a HealthCheckRequest before the end of the stream")


class ServerHealth:
    """A server's health: readiness under each of ``ready_names``, liveness under ``"liveness"``;
    ``""`` (the server's overall status) is readiness when named, else ready and live. Both start
    NOT_SERVING. :attr:`methods` go on the server wire: at most ``max_watches`` Watch streams are
    open at once, and each ends OK after ``watch_seconds``.

    A draining server is live but not ready: a Kubernetes liveness probe must not kill it while
    its readiness probe takes it out of rotation.
    """

    LIVENESS = "liveness"

    def __init__(self, ready_names: Iterable[str], *, max_watches: int = MAX_HEALTH_WATCHES,
                 watch_seconds: float = HEALTH_WATCH_SECONDS) -> None:
        self._kinds = {"": _BOTH} | dict.fromkeys(ready_names, _READY) | {self.LIVENESS: _LIVE}
        self._ready = self._live = False
        self._changed = trio.Event()  # set at the next change, then replaced
        self._watches = 0
        self.max_watches = max_watches
        self.watch_seconds = watch_seconds
        self.check = SyncBidiMethod(CHECK_PATH, HealthCheckRequest, partial(_Check, self))
        """``Health/Check``, a synchronous method of the server wire."""

    @property
    def methods(self) -> list[SyncBidiMethod[Any, Any] | StreamMethod[Any]]:
        """``Health/Check`` and ``Health/Watch``, for :func:`~evergreen_trio._grpc.server.serve_grpc`."""
        return [self.check, StreamMethod(WATCH_PATH, HealthCheckRequest, self.watch, admit=self.admit_watch,
                                         abandon=self.abandon_watch)]

    @property
    def ready(self) -> bool:
        """Whether the server is ready (what the names in ``ready_names`` report)."""
        return self._ready

    @property
    def watches(self) -> int:
        """Watch streams open now (admitted and not yet ended)."""
        return self._watches

    def set(self, *, ready: bool, live: bool) -> None:
        """Set both statuses; open watches whose service's status changed send it."""
        if (ready, live) != (self._ready, self._live):
            self._ready, self._live = ready, live
            self._changed.set()
            self._changed = trio.Event()

    def status(self, service: str) -> HealthCheckResponse.ServingStatus.ValueType:
        """``service``'s status now: SERVING, NOT_SERVING, or SERVICE_UNKNOWN for a name not served."""
        kind = self._kinds.get(service)
        if kind is None:
            return SERVICE_UNKNOWN
        up = self._ready if kind == _READY else self._live if kind == _LIVE else self._ready and self._live
        return SERVING if up else NOT_SERVING

    def admit_watch(self, stream: MessageStream[HealthCheckResponse]) -> None:
        """Take one of ``max_watches`` for a new Watch stream, released when :meth:`watch` ends
        (so the shell runs :meth:`watch` for every stream admitted); past the cap, raises
        :class:`RpcAbortError` RESOURCE_EXHAUSTED."""
        if self._watches >= self.max_watches:
            raise RpcAbortError(Status.RESOURCE_EXHAUSTED, f"{self.max_watches} health watches open, the limit")
        self._watches += 1

    def abandon_watch(self, stream: MessageStream[HealthCheckResponse]) -> None:
        """Give back the slot of an admitted Watch stream reset before :meth:`watch` started."""
        self._watches -= 1

    async def watch(self, stream: MessageStream[HealthCheckResponse]) -> None:
        """Serve one admitted Watch stream: its request's service's status at once, then each change,
        until ``watch_seconds`` have passed (then OK) or the stream is gone."""
        try:
            with trio.move_on_after(self.watch_seconds):
                batch = await stream.inbound.get_batch(1)  # RpcAbortError: the client is gone
                if not batch:
                    raise RpcAbortError(Status.INTERNAL, "expected a HealthCheckRequest before the end of the stream")
                service = cast(HealthCheckRequest, batch[0]).service
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_until_gone, stream, nursery.cancel_scope)
                    await self._send_changes(stream, service)
                    nursery.cancel_scope.cancel()
        finally:
            self._watches -= 1
        stream.finish(Status.OK)

    async def _send_changes(self, stream: MessageStream[HealthCheckResponse], service: str) -> None:
        sent = None
        try:
            while stream.final is None:
                changed = self._changed  # taken before the status is read: no change is missed
                status = self.status(service)
                if status != sent:
                    await stream.outbound.put(_REPLIES[status])  # waits while the client reads nothing
                    sent = status
                await changed.wait()
        except HandoffClosedError:  # the stream was finished elsewhere
            pass


async def _until_gone(stream: MessageStream[Any], done: trio.CancelScope) -> None:
    """Cancel ``done`` once ``stream``'s client is gone (more requests on it are read and ignored)."""
    try:
        while await stream.inbound.get_batch():
            pass
        await stream.wait_closed()  # half-closed: the stream lasts until the shell releases it
    except RpcAbortError:  # the shell closed the inbound side with the stream's end
        pass
    done.cancel()
