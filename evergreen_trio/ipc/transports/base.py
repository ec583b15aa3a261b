"""The interface every transport implements, and what flows through it.

A transport (``tcp``, ``shm``, ``ucx``) is one object with two methods, chosen by URI
scheme from :data:`~evergreen_trio.ipc.transports.registry.TRANSPORTS` (the way httpcore
picks one network backend): :meth:`Transport.serve` accepts connections and hands each
to a :data:`ConnectionHandler`; :meth:`Transport.connect` opens a client connection that
has sent ``want_data``. Body tags are parsed once, in the transport
(:func:`~evergreen_trio.ipc.framing.classify_body`); what reaches the reassembler is a
typed :class:`~evergreen_trio.ipc.framing.BodyIn`.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa
import trio

from evergreen_trio._refusals import RefusalEpisodes
from evergreen_trio.ipc.arrow import OutgoingMessage
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import FramingError
from evergreen_trio.ipc.flatbuf import MessageHeader
from evergreen_trio.ipc.framing import FREE_DATA_TAG, WANT_DATA_TAG, BodyIn, BodyType, make_tag
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.uri import IpcUri

log = logging.getLogger(__name__)

Lookup = Callable[[bytes], Sequence[OutgoingMessage]]
"""Ticket -> the messages of its stream; raises UnknownTicketError."""


class Role(enum.Enum):
    """What a server sends for a want_data: the spec lets one process or two serve a stream."""

    BOTH = "both"
    METADATA = "metadata"
    DATA = "data"


@dataclass(frozen=True)
class ServeOptions:
    """The tags a server advertises, the limits it enforces and the streams it serves."""

    want_data: int = WANT_DATA_TAG
    free_data: int = FREE_DATA_TAG
    limits: IpcLimits = DEFAULT_LIMITS
    role: Role = Role.BOTH
    warm_bytes: int | None = None
    """Shared memory: prefault this many bytes of each idle segment before serving (0: none). When None,
    :func:`~evergreen_trio.ipc.serve` sets it to the largest window a catalog stream needs."""
    publish: bool = True
    """Shared memory: publish each body once in memory every connection maps (no copy per fetch), up to
    ``shm_published_bytes``; False copies every body into the connection's segment per stream."""
    preload: tuple[Sequence[OutgoingMessage], ...] | None = None
    """Shared memory, publishing: streams to publish before serving (others are published by their first
    fetch). When None, :func:`~evergreen_trio.ipc.serve` sets it to the catalog's streams at start."""


@dataclass(frozen=True)
class MetadataIn:
    """A metadata-stream message as received."""

    data: bytes


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
    """The one resolve step of a connection: a received body into the buffer pyarrow reads.

    Chosen once per connection by its transport (inline host bodies, shared memory, or
    device memory), never per body.
    """

    def resolve(self, body: object, header: MessageHeader, *, copy: bool) -> pa.Buffer: ...

    def take_freed(self) -> list[int]:
        """Offsets whose batches were released since the last call (to send in free_data)."""
        ...


class HostBodies:
    """Inline bodies already in host memory (``pa.Buffer``): used as they are."""

    def resolve(self, body: object, header: MessageHeader, *, copy: bool) -> pa.Buffer:
        assert isinstance(body, pa.Buffer)
        return body

    def take_freed(self) -> list[int]:
        return []


class BodySender(Protocol):
    """How a server places bodies: inline (type 0) or in shared memory (type 1)."""

    async def post(self, channel: ServerChannel, seq: int, message: OutgoingMessage) -> Completion:
        """Place one body; it may be announced only at the next :meth:`flush`."""
        ...

    async def flush(self, channel: ServerChannel) -> None:
        """Announce every body posted so far (called before waiting, and at the end)."""
        ...

    @property
    def queued(self) -> int:
        """Bodies posted but not yet announced to the client."""
        ...

    def prepare(self, messages: Sequence[OutgoingMessage], window: int) -> None:
        """Get ready for a stream whose bodies are posted at most ``window`` unacknowledged."""
        ...

    def on_free(self, offsets: Sequence[int]) -> None: ...

    def release_all(self) -> None: ...


class RawBodies:
    """Body type 0: the packed IPC body itself, sent as soon as it is posted."""

    async def post(self, channel: ServerChannel, seq: int, message: OutgoingMessage) -> Completion:
        body = message.body if message.body is not None else pa.py_buffer(b"")
        return await channel.post_body(make_tag(seq, BodyType.RAW), body)

    async def flush(self, channel: ServerChannel) -> None:
        return None

    queued = 0

    def prepare(self, messages: Sequence[OutgoingMessage], window: int) -> None:
        return None

    def on_free(self, offsets: Sequence[int]) -> None:
        raise FramingError(f"free_data: expected none for inline bodies, got {len(offsets)} offsets")

    def release_all(self) -> None:
        return None


ConnectionHandler = Callable[[ServerChannel, BodySender, str], Awaitable[None]]
"""Serves one accepted connection: its channel, how its bodies are placed, a peer name for logs."""


@dataclass(frozen=True)
class Connection:
    """A client connection that has sent want_data: its channel and its resolve step."""

    channel: ClientChannel
    bodies: BodyResolver


class Transport(Protocol):
    """One transport: serve connections on a URI, or connect to one."""

    async def serve(
        self,
        uri: IpcUri,
        handler: ConnectionHandler,
        options: ServeOptions,
        task_status: trio.TaskStatus[IpcUri],
    ) -> None:
        """Listen on ``uri`` (port 0 / no path: pick one), report the full URI, serve until cancelled.

        Raises OSError when the address cannot be bound.
        """
        ...

    def connect(
        self, uri: IpcUri, ticket: bytes | None, limits: IpcLimits, pool: BufferPool
    ) -> AbstractAsyncContextManager[Connection]:
        """Connect and send want_data with ``ticket`` (none: connect only); raises TransportError when no
        server answers."""
        ...


StreamHandler = Callable[[trio.SocketStream], Awaitable[None]]


class ConnectionCap:
    """A server's open connections, at most ``limit``: one more is closed at accept.

    One warning per episode of refusals, one info line when it ends (``RefusalEpisodes``).
    ``full`` lets a transport refuse for its own reason too (shared memory exhausted): it returns
    the reason, or None when a connection may come in.
    """

    def __init__(self, limit: int, scheme: str, full: Callable[[], str | None] = lambda: None) -> None:
        self.limit = limit
        self.scheme = scheme
        self.full = full
        self.active = 0
        self.refusals = RefusalEpisodes()

    def wrap(self, handle: StreamHandler) -> StreamHandler:
        """``handle`` for connections under the cap; the others are closed at once."""

        async def capped(stream: trio.SocketStream) -> None:
            reason = f"{self.limit} connections open (max_connections)" if self.active >= self.limit else self.full()
            if reason is not None:
                if self.refusals.refuse(trio.current_time()):
                    log.warning("ipc.connection_refused scheme=%s active=%d reason=%s: refusing new connections",
                                self.scheme, self.active, reason)
                await trio.aclose_forcefully(stream)
                return
            if refused := self.refusals.admit(trio.current_time()):
                log.info("ipc.accepting_again scheme=%s refused=%d", self.scheme, refused)
            self.active += 1
            try:
                await handle(stream)
            finally:
                self.active -= 1

        return capped
