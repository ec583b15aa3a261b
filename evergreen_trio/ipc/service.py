"""Public Trio API: a :class:`Catalog` of streams, :func:`serve` it, :func:`fetch` from it.

``serve`` binds the transport named by the URI scheme (``tcp://host:port``,
``shm://`` or ``shm:///socket/path``, ``ucx://host:port``; port 0 picks a free one) and
reports, through ``task_status``, the full URI a client needs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pyarrow as pa
import trio

from evergreen_trio.ipc._nursery import open_quiet_nursery
from evergreen_trio.ipc.arena import past_room, window_extent
from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_file, messages_from_table
from evergreen_trio.ipc.client import connect, ticket_bytes
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import UnknownTicketError
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.session import IpcStream, MergedChannel, serve_connection
from evergreen_trio.ipc.transports.base import BodySender, ServeOptions, ServerChannel
from evergreen_trio.ipc.transports.registry import transport_for
from evergreen_trio.ipc.uri import IpcUri, parse_uri

DEFAULT_OPTIONS = ServeOptions()


class Catalog:
    """Ticket -> IPC messages the server can stream."""

    def __init__(self) -> None:
        self._streams: dict[bytes, Sequence[OutgoingMessage]] = {}

    def add_messages(self, ticket: bytes | str, messages: Sequence[OutgoingMessage]) -> bytes:
        """Serve ``messages`` under ``ticket`` (replacing what it named); return the ticket as bytes."""
        key = ticket_bytes(ticket)
        self._streams[key] = messages
        return key

    def add_table(self, ticket: bytes | str, table: pa.Table, max_chunksize: int | None = None) -> bytes:
        """Serve ``table`` under ``ticket`` in batches of at most ``max_chunksize`` rows; return the ticket."""
        return self.add_messages(ticket, messages_from_table(table, max_chunksize))

    def add_file(self, path: str | os.PathLike[str], ticket: bytes | str | None = None) -> bytes:
        """Serve an Arrow IPC file or stream, memory-mapped; the ticket defaults to its base name."""
        return self.add_messages(ticket if ticket is not None else Path(path).name, messages_from_file(path))

    def remove(self, ticket: bytes | str) -> None:
        """Stop serving ``ticket`` (streams already started finish); unknown tickets are ignored."""
        self._streams.pop(ticket_bytes(ticket), None)

    def lookup(self, ticket: bytes) -> Sequence[OutgoingMessage]:
        """The messages ``ticket`` names; UnknownTicketError when it names none."""
        try:
            return self._streams[ticket]
        except KeyError:
            raise UnknownTicketError(
                f"want_data: unknown ticket {ticket[:64]!r} (this server has {len(self._streams)})"
            ) from None

    def window_extent(self, window: int, published: int = 0) -> int:
        """The most shared memory one stream keeps live with ``window`` bodies unacknowledged.

        A shm server publishes the first ``published`` bytes of bodies once for every
        connection instead; those take no segment space and are left out.
        """
        room, extents = published, [0]
        for messages in self._streams.values():
            copied, room = past_room((m.header.body_length for m in messages if m.header.has_body), room)
            extents.append(window_extent(copied, window))
        return max(extents)

    @property
    def streams(self) -> tuple[Sequence[OutgoingMessage], ...]:
        """The messages of every ticket served now."""
        return tuple(self._streams.values())

    @property
    def tickets(self) -> list[bytes]:
        """The tickets served now."""
        return list(self._streams)


async def serve(
    uri: str,
    catalog: Catalog,
    options: ServeOptions = DEFAULT_OPTIONS,
    *,
    task_status: trio.TaskStatus[IpcUri] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``catalog`` on the transport of ``uri`` until cancelled.

    Raises UriError for a URI no transport serves, OSError when it cannot be bound.
    """
    parsed = parse_uri(uri, listen=True)
    if parsed.scheme == "shm" and options.warm_bytes is None:
        # Idle segments start warm for the streams served now, so a first fetch runs as fast as later ones
        # (bodies to be published are copied once, into the publication, and need no segment).
        published = options.limits.shm_published_bytes if options.publish else 0
        options = dataclasses.replace(
            options, warm_bytes=catalog.window_extent(options.limits.max_unacked_bodies, published)
        )
    if parsed.scheme == "shm" and options.publish and options.preload is None:
        # Published before the URI is reported: the first fetch copies nothing either.
        options = dataclasses.replace(options, preload=catalog.streams)

    async def handler(channel: ServerChannel, bodies: BodySender, peer: str) -> None:
        await serve_connection(channel, catalog.lookup, bodies, options, peer)

    await transport_for(parsed.scheme).serve(parsed, handler, options, task_status)


@asynccontextmanager
async def fetch(
    uri: str | IpcUri,
    ticket: bytes | str,
    *,
    data_uri: str | IpcUri | None = None,
    limits: IpcLimits = DEFAULT_LIMITS,
    copy: bool = False,
    pool: BufferPool | None = None,
) -> AsyncIterator[IpcStream]:
    """Connect, send ``want_data`` with ``ticket`` and yield the stream of batches.

    With ``data_uri``, ``uri`` names the server of the metadata stream and ``data_uri``
    the server of the bodies (the spec's two-process case): want_data goes to each,
    free_data to the data server.
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    pool = pool if pool is not None else BufferPool(limits.pool_bytes)
    if data_uri is None:
        async with connect(parsed, limits=limits, pool=pool, eager=False) as client, client.fetch(
            ticket, copy=copy
        ) as stream:
            yield stream
        return
    key = ticket_bytes(ticket)
    async with transport_for(parsed.scheme).connect(parsed, key, limits, pool) as connection:
        data_parsed = parse_uri(data_uri) if isinstance(data_uri, str) else data_uri
        async with transport_for(data_parsed.scheme).connect(data_parsed, key, limits, pool) as data:
            merged = MergedChannel(connection.channel, data.channel)
            stream = IpcStream(merged, free_data=data_parsed.free_data, bodies=data.bodies, limits=limits, copy=copy)
            async with open_quiet_nursery() as nursery:
                merged.start(nursery)
                try:
                    yield stream
                finally:
                    nursery.cancel_scope.cancel()


async def fetch_table(uri: str | IpcUri, ticket: bytes | str, **kwargs: object) -> pa.Table:
    """Fetch a whole stream as a ``pyarrow.Table``."""
    async with fetch(uri, ticket, **kwargs) as stream:  # type: ignore[arg-type]
        return await stream.read_all()
