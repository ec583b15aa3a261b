"""The small interface every transport implements, and what flows through it."""

from __future__ import annotations

from collections.abc import Sequence
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

    @property
    def done(self) -> bool:
        """Whether :meth:`wait` would return at once."""
        ...

    async def wait(self) -> None: ...


class Done:
    """A body acknowledged as soon as it was handed to the transport."""

    done = True

    async def wait(self) -> None:
        return None


class ServerChannel(Protocol):
    """Server side of one client connection."""

    async def receive_request(self) -> tuple[int, bytes]:
        """Next (tag, payload) from the client: want_data or free_data. Raises ConnectionLostError."""
        ...

    async def send_metadata(self, frames: Sequence[bytes]) -> None:
        """Send metadata-stream messages in order (a transport may coalesce them)."""
        ...

    async def post_body(self, tag: int, body: object) -> Completion:
        """Start sending one body; the returned completion is its acknowledgement."""
        ...

    async def send_descriptors(self, descriptors: Sequence[tuple[int, bytes]]) -> None:
        """Send small tagged bodies (shared-memory descriptors) in order, coalesced if possible."""
        ...


class ClientChannel(Protocol):
    """Client side of one connection."""

    async def send_request(self, tag: int, payload: bytes) -> None: ...

    async def receive(self) -> MetadataIn | BodyIn:
        """Next message from the server. Raises ConnectionLostError if the server is gone."""
        ...

    def ready(self) -> bool:
        """Whether :meth:`receive` can return without waiting for the peer."""
        ...


class BodyResolver(Protocol):
    """Turns a type-1 body descriptor into host memory (shared-memory transports)."""

    def resolve(self, descriptor: object, header: MessageHeader, *, copy: bool) -> pa.Buffer: ...

    def take_freed(self) -> list[int]:
        """Offsets whose batches were released since the last call (to send in free_data)."""
        ...
