"""gRPC health (``grpc.health.v1.Health``) for servers on the bridge: grpclib's service under our names.

grpclib keys a health check by servable, naming it from the servable's ``__mapping__`` paths;
:class:`HealthName` is a servable that only carries a name. A status is set from Trio with a
plain call (grpclib's watchers are woken on the same thread, on the trio-asyncio loop).
"""

from __future__ import annotations

from collections.abc import Iterable

from grpclib.health.check import ServiceStatus
from grpclib.health.service import OVERALL, Health


class HealthName:
    """A service name for grpclib's Health, which keys its checks by servable (``/name/method``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __mapping__(self) -> dict[str, None]:
        return {f"/{self.name}/Check": None}


class ServingStatus:
    """One SERVING / NOT_SERVING flag answered under several service names (``""`` is the server's).

    ``servable`` goes in the grpclib server's servables; it starts NOT_SERVING.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._status = ServiceStatus()
        self._status.set(False)
        self.servable = Health({OVERALL if name == "" else HealthName(name): [self._status] for name in names})

    @property
    def serving(self) -> bool:
        return self._status.__status__() is True

    def set(self, serving: bool) -> None:
        self._status.set(serving)
