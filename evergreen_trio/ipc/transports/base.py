"""The small interface every transport implements, and what flows through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from evergreen_trio.ipc.flatbuf import MessageHeader


@dataclass(frozen=True)
class MetadataIn:
    """A metadata-stream message as received."""

    data: bytes


@dataclass(frozen=True)
class BodyIn:
    """A tagged body as received: host ``pa.Buffer``, descriptor bytes or a device array."""

    tag: int
    body: object
    nbytes: int


class Completion(Protocol):
    """The transport's acknowledgement of one body (the backpressure unit)."""

    async def wait(self) -> None: ...


class Done:
    """A body acknowledged as soon as it was handed to the transport."""

    async def wait(self) -> None:
        return None


class ServerChannel(Protocol):
    """Server side of one client connection."""

    async def receive_request(self) -> tuple[int, bytes]:
        """Next (tag, payload) from the client: want_data or free_data. Raises ConnectionLostError."""
        ...

    async def send_metadata(self, frame: bytes) -> None: ...

    async def post_body(self, tag: int, body: object) -> Completion:
        """Start sending one body; the returned completion is its acknowledgement."""
        ...


class ClientChannel(Protocol):
    """Client side of one connection."""

    async def send_request(self, tag: int, payload: bytes) -> None: ...

    async def receive(self) -> MetadataIn | BodyIn:
        """Next message from the server. Raises ConnectionLostError if the server is gone."""
        ...


class BodyResolver(Protocol):
    """Turns a type-1 body descriptor into host memory (shared-memory transports)."""

    def resolve(self, descriptor: object, header: MessageHeader, *, copy: bool) -> pa.Buffer: ...

    def take_freed(self) -> list[int]:
        """Offsets whose batches were released since the last call (to send in free_data)."""
        ...
