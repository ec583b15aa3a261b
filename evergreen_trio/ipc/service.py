"""Public Trio API: a :class:`Catalog` of streams, :func:`serve` it, :func:`fetch` from it.

``serve`` binds the transport named by the URI scheme (``tcp://host:port``,
``shm://`` or ``shm:///socket/path``, ``ucx://host:port``; port 0 picks a free one) and
reports, through ``task_status``, the full URI a client needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import trio

from evergreen_trio.ipc._nursery import open_quiet_nursery
from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_file, messages_from_table
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import TransportError, UnknownTicketError, UriError
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.session import IpcStream, MergedChannel, RawBodies, ServeOptions, serve_connection
from evergreen_trio.ipc.transports.base import ClientChannel
from evergreen_trio.ipc.transports.shm import (
    HANDLE,
    SegmentPool,
    SharedMemoryBodies,
    SharedMemoryMapping,
    receive_segment,
    send_segment,
)
from evergreen_trio.ipc.transports.tcp import FramedSocket, StreamClientChannel, StreamServerChannel
from evergreen_trio.ipc.uri import IpcUri, parse_uri

log = logging.getLogger(__name__)

DEFAULT_OPTIONS = ServeOptions()


def _ticket(ticket: bytes | str) -> bytes:
    return ticket.encode() if isinstance(ticket, str) else bytes(ticket)


class Catalog:
    """Ticket -> IPC messages the server can stream."""

    def __init__(self) -> None:
        self._streams: dict[bytes, Sequence[OutgoingMessage]] = {}

    def add_messages(self, ticket: bytes | str, messages: Sequence[OutgoingMessage]) -> bytes:
        key = _ticket(ticket)
        self._streams[key] = messages
        return key

    def add_table(self, ticket: bytes | str, table: pa.Table, max_chunksize: int | None = None) -> bytes:
        return self.add_messages(ticket, messages_from_table(table, max_chunksize))

    def add_file(self, path: str | os.PathLike[str], ticket: bytes | str | None = None) -> bytes:
        """Serve an Arrow IPC file or stream, memory-mapped; the ticket defaults to its base name."""
        return self.add_messages(ticket if ticket is not None else Path(path).name, messages_from_file(path))

    def lookup(self, ticket: bytes) -> Sequence[OutgoingMessage]:
        try:
            return self._streams[ticket]
        except KeyError:
            raise UnknownTicketError(
                f"want_data: unknown ticket {ticket[:64]!r} (this server has {len(self._streams)})"
            ) from None

    @property
    def tickets(self) -> list[bytes]:
        return list(self._streams)


async def serve(
    uri: str,
    catalog: Catalog,
    options: ServeOptions = DEFAULT_OPTIONS,
    *,
    task_status: trio.TaskStatus[IpcUri] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``catalog`` on the transport of ``uri`` until cancelled."""
    parts = urlsplit(uri)
    if parts.scheme == "tcp":
        await _serve_tcp(parts.hostname or "127.0.0.1", parts.port or 0, catalog, options, task_status)
    elif parts.scheme == "shm":
        await _serve_shm(parts.path, catalog, options, task_status)
    elif parts.scheme == "ucx":
        from evergreen_trio.ipc.transports.ucx import serve_ucx

        await serve_ucx(parts.hostname or "127.0.0.1", parts.port or 0, catalog.lookup, options, task_status)
    else:
        raise UriError(f"serve: expected a tcp://, shm:// or ucx:// URI, got {uri!r}")


async def _serve_tcp(
    host: str, port: int, catalog: Catalog, options: ServeOptions, task_status: trio.TaskStatus[IpcUri]
) -> None:
    listener = (await trio.open_tcp_listeners(port, host=host))[0]

    async def handle(stream: trio.SocketStream) -> None:
        framed = FramedSocket(stream, options.limits)
        async with stream:
            await serve_connection(StreamServerChannel(framed), catalog.lookup, RawBodies(), options, _peer(stream))

    bound_host, bound_port = listener.socket.getsockname()[:2]
    task_status.started(IpcUri("tcp", options.want_data, host=bound_host, port=bound_port))
    await trio.serve_listeners(handle, [listener])


def _peer(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername())
    except OSError:
        return "?"


async def _serve_shm(path: str, catalog: Catalog, options: ServeOptions, task_status: trio.TaskStatus[IpcUri]) -> None:
    workdir = None
    if not path:
        workdir = tempfile.mkdtemp(prefix="evergreen-ipc-")
        path = os.path.join(workdir, "control.sock")
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    segments = SegmentPool(options.limits.shm_segment_bytes, options.limits.shm_idle_segments)
    counter = 0
    try:
        await sock.bind(path)
        sock.listen()

        async def handle(stream: trio.SocketStream) -> None:
            nonlocal counter
            counter += 1
            segment = segments.take()
            limits = options.limits
            bodies = SharedMemoryBodies(
                segment, segments, limits.shm_batch_bytes, max(1, limits.max_unacked_bodies // 2)
            )
            async with stream:
                try:
                    await send_segment(stream, segment)
                except TransportError:
                    bodies.release_all()
                    return
                channel = StreamServerChannel(FramedSocket(stream, options.limits))
                await serve_connection(channel, catalog.lookup, bodies, options, f"shm#{counter}")

        task_status.started(
            IpcUri("shm", options.want_data, path=path, free_data=options.free_data, remote_handle=HANDLE)
        )
        await trio.serve_listeners(handle, [trio.SocketListener(sock)])
    finally:
        sock.close()
        segments.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        if workdir is not None:
            os.rmdir(workdir)


@asynccontextmanager
async def _connect(
    parsed: IpcUri, ticket: bytes, limits: IpcLimits, pool: BufferPool
) -> AsyncIterator[tuple[ClientChannel, SharedMemoryMapping | None]]:
    """A client channel to one server that has been sent want_data (and the mapping, for shm)."""
    if parsed.scheme == "ucx":
        from evergreen_trio.ipc.transports.ucx import connect_ucx

        async with connect_ucx(parsed, limits, pool) as ucx_channel:
            await ucx_channel.send_request(parsed.want_data, ticket)
            yield ucx_channel, None
        return
    resolver = None
    try:
        with trio.fail_after(limits.connect_timeout_s):
            if parsed.scheme == "tcp":
                socket_stream = await trio.open_tcp_stream(parsed.host, parsed.port)
            else:
                sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
                try:
                    await sock.connect(parsed.path)
                except BaseException:
                    sock.close()
                    raise
                socket_stream = trio.SocketStream(sock)
            channel = StreamClientChannel(FramedSocket(socket_stream, limits, pool))
            try:
                # want_data goes out before the segment comes in: one round trip fewer.
                await channel.send_request(parsed.want_data, ticket)
                if parsed.scheme == "shm":
                    resolver = SharedMemoryMapping(await receive_segment(socket_stream.socket))
            except BaseException:
                await trio.aclose_forcefully(socket_stream)
                raise
    except (OSError, trio.TooSlowError) as exc:
        raise TransportError(f"connect {parsed}: expected a listening server, got {exc!r}") from None
    async with socket_stream:
        yield channel, resolver


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
    key = _ticket(ticket)
    async with _connect(parsed, key, limits, pool) as (channel, resolver):
        if data_uri is None:
            yield IpcStream(channel, free_data=parsed.free_data, resolver=resolver, limits=limits, copy=copy)
            return
        data_parsed = parse_uri(data_uri) if isinstance(data_uri, str) else data_uri
        async with _connect(data_parsed, key, limits, pool) as (data_channel, data_resolver):
            merged = MergedChannel(channel, data_channel)
            stream = IpcStream(
                merged, free_data=data_parsed.free_data, resolver=data_resolver, limits=limits, copy=copy
            )
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
