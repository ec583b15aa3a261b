"""A connection to one server, reused by the fetches that run on it one after another.

Opening a connection is the costly part of a short fetch: a ``ucx://`` connection makes a UCX
worker and endpoint at each end and runs their wire-up (tens of milliseconds, more than
moving 4 GiB between processes on one GPU). :func:`connect` opens one when the first fetch
needs it and keeps it for the next, as a gRPC channel or an HTTP/2 connection is kept.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import pyarrow as pa
import trio

from evergreen_trio.ipc._nursery import open_quiet_nursery
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import ConnectionLostError
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.session import IpcStream, MessagePump
from evergreen_trio.ipc.transports.base import Connection
from evergreen_trio.ipc.transports.registry import transport_for
from evergreen_trio.ipc.uri import IpcUri, parse_uri

S = TypeVar("S", bound=MessagePump[Any])
OpenConnection = Callable[[bytes | None], AbstractAsyncContextManager[Connection]]
"""Connect and send want_data with this ticket, or connect only (a transport's ``connect``)."""


def ticket_bytes(ticket: bytes | str) -> bytes:
    return ticket.encode() if isinstance(ticket, str) else bytes(ticket)


class IpcClient:
    """Streams from one server, one at a time, over one kept connection.

    :func:`connect` opens it at once, so a connection error comes from ``connect`` and the first
    fetch finds it open; the connection lives in a task of the client's nursery, so any task may fetch. A stream
    left before its end closes the connection (what was still in flight goes with it); the
    next fetch opens another. So does a fetch that finds the kept connection closed by the
    server (``idle_timeout_s``): its stream's first message never came, so it is asked again,
    once, on a new connection.
    """

    def __init__(self, nursery: trio.Nursery, uri: IpcUri, open_connection: OpenConnection, limits: IpcLimits) -> None:
        self.uri = uri
        self.limits = limits
        self._nursery = nursery
        self._open_connection = open_connection
        self._lock = trio.Lock()
        self._connection: Connection | None = None
        self._release: trio.Event | None = None
        self.connections = 0
        """Connections opened so far."""

    def fetch(self, ticket: bytes | str, *, copy: bool = False) -> AbstractAsyncContextManager[IpcStream]:
        """Send want_data and yield the stream of ``pyarrow.RecordBatch`` (as :func:`fetch`)."""
        return self._open_stream(ticket, lambda connection: IpcStream(
            connection.channel, free_data=self.uri.free_data, bodies=connection.bodies, limits=self.limits, copy=copy))

    async def fetch_table(self, ticket: bytes | str) -> pa.Table:
        """A whole stream as one ``pyarrow.Table``."""
        async with self.fetch(ticket) as stream:
            return await stream.read_all()

    @asynccontextmanager
    async def _open_stream(self, ticket: bytes | str, make_stream: Callable[[Connection], S]) -> AsyncIterator[S]:
        """Yield ``make_stream``'s stream once its first message (the schema) has arrived (``fetch`` and
        the GPU client's ``open`` are this with their stream types)."""
        key = ticket_bytes(ticket)
        async with self._lock:
            stream = await self._start(key, make_stream)
            try:
                yield stream
            finally:
                if not stream.finished:
                    self._drop()

    async def _start(self, key: bytes, make_stream: Callable[[Connection], S]) -> S:
        if self._connection is not None:
            with contextlib.suppress(ConnectionLostError):  # closed while kept (idle): ask again on a new one
                return await self._begin(make_stream, key)
        self._connection = await self._nursery.start(self._hold, key)
        return await self._begin(make_stream, None)

    async def _begin(self, make_stream: Callable[[Connection], S], key: bytes | None) -> S:
        """Send want_data (``key``: not sent with the connection) and wait for the stream's schema; any
        failure drops the connection."""
        assert self._connection is not None
        try:
            if key is not None:
                await self._connection.channel.send_request(self.uri.want_data, key)
            stream = make_stream(self._connection)
            await stream.wait_schema()
        except BaseException:
            self._drop()
            raise
        return stream

    async def open(self) -> None:
        """Open the connection now, without a request (the first fetch would otherwise open it)."""
        self._connection = await self._nursery.start(self._hold, None)

    async def _hold(self, key: bytes | None, task_status: trio.TaskStatus[Connection]) -> None:
        # Closed by an event, not by cancelling this task: the connection closes as a fetch's own
        # would, and no Cancelled (whose traceback holds the canceller's frames) keeps it alive in a
        # reference cycle until the garbage collector runs (CPython 3.13 kept the mapped segment so).
        release = self._release = trio.Event()
        async with self._open_connection(key) as connection:
            self.connections += 1
            task_status.started(connection)
            await release.wait()

    def _drop(self) -> None:
        if self._release is not None:
            self._release.set()
        self._connection = self._release = None


@asynccontextmanager
async def open_client(
    uri: str | IpcUri, open_connection: OpenConnection, limits: IpcLimits, *, eager: bool
) -> AsyncIterator[IpcClient]:
    """An :class:`IpcClient` whose connection closes when the block ends; ``eager``: opened first.

    A client for one fetch is not eager: its connection goes out with its request, one round
    trip fewer over TCP.
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    async with open_quiet_nursery() as nursery:
        try:
            client = IpcClient(nursery, parsed, open_connection, limits)
            if eager:
                await client.open()
            yield client
        finally:
            client._drop()


def connect(
    uri: str | IpcUri, *, limits: IpcLimits = DEFAULT_LIMITS, pool: BufferPool | None = None, eager: bool = True
) -> AbstractAsyncContextManager[IpcClient]:
    """A client that keeps its connection to ``uri`` between fetches; raises TransportError when no server answers.

    ``async with connect(uri) as client:`` then ``client.fetch(ticket)`` / ``client.fetch_table(ticket)``
    as often as needed; no fetch pays for the connection's set-up. ``eager=False`` leaves opening it
    to the first fetch.
    """
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    buffers = pool if pool is not None else BufferPool(limits.pool_bytes)
    transport = transport_for(parsed.scheme)
    return open_client(parsed, lambda key: transport.connect(parsed, key, limits, buffers), limits, eager=eager)
