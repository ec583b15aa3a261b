"""The gRPC status error every layer raises and receives: plain Python, no I/O."""

from __future__ import annotations

from grpclib.const import Status

from evergreen_trio.errors import EvergreenTrioError


class RpcAbortError(EvergreenTrioError):
    """Ends a gRPC stream with ``status``; raised by handlers, or received when the peer ended it so."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
