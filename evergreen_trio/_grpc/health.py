"""gRPC health (``grpc.health.v1.Health``) for servers on the bridge: grpclib's service under our names.

grpclib keys a health check by servable, naming it from the servable's ``__mapping__`` paths;
:class:`HealthName` is a servable that only carries a name. A status is set from Trio with a
plain call (grpclib's watchers are woken on the same thread, on the trio-asyncio loop).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL

from evergreen_trio._grpc.limits import HEALTH_WATCH_SECONDS, MAX_HEALTH_WATCHES

if TYPE_CHECKING:
    from evergreen_trio._grpc.bridge import BoundedHealth


class HealthName:
    """A service name for grpclib's Health, which keys its checks by servable (``/name/method``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __mapping__(self) -> dict[str, None]:
        return {f"/{self.name}/Check": None}


class ServerHealth:
    """A server's health: readiness under ``ready_names`` (``""`` is the server's overall status),
    liveness under ``"liveness"``. Both start NOT_SERVING; ``servable`` (a :class:`BoundedHealth`:
    ``max_watches``, ``watch_seconds``) goes in the grpclib server's servables; it is made when first
    asked for, at serving time, so that building a server imports no trio-asyncio.

    A draining server is live but not ready: a Kubernetes liveness probe must not kill it while
    its readiness probe takes it out of rotation.
    """

    LIVENESS = "liveness"

    def __init__(self, ready_names: Iterable[str], *, max_watches: int = MAX_HEALTH_WATCHES,
                 watch_seconds: float = HEALTH_WATCH_SECONDS) -> None:
        self._ready, self._live = ServiceStatus(), ServiceStatus()
        self._ready.set(False)
        self._live.set(False)
        checks: dict[Any, list[ServiceStatus]] = {
            OVERALL if name == "" else HealthName(name): [self._ready] for name in ready_names}
        checks[HealthName(self.LIVENESS)] = [self._live]
        self._checks, self._max_watches, self._watch_seconds = checks, max_watches, watch_seconds

    @cached_property
    def servable(self) -> BoundedHealth:
        # Imported here, not at the top: the bridge imports trio-asyncio, which replaces
        # asyncio.new_event_loop for the whole process, so importing evergreen_trio must not.
        from evergreen_trio._grpc.bridge import BoundedHealth

        return BoundedHealth(self._checks, max_watches=self._max_watches, watch_seconds=self._watch_seconds)

    @property
    def ready(self) -> bool:
        return self._ready.__status__() is True

    def set(self, *, ready: bool, live: bool) -> None:
        self._ready.set(ready)
        self._live.set(live)
