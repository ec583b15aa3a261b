"""Arrow tables by reference inside a session: Evergreen ``ref`` chunks that name Dissociated IPC streams.

A chunk's ref ``tcp://``, ``shm://`` or ``ucx://`` is a Dissociated IPC URI plus ``ticket=``;
``grpc://host:port?ticket=..`` is a Flight location whose ``GetFlightInfo`` points at one.
The table travels out of band over that transport; the session carries only the URI.

- Reading (either side): ``async with open_arrow(chunk) as batches: async for batch in batches``.
  A chunk holding an Arrow IPC stream inline reads the same way.
- Writing: an :class:`ArrowExchange` serves published tables over one transport;
  ``await exchange.publish(ctx.output("table"), table)`` emits the ref.
- Refused unless enabled: a side resolves these refs only with the resolvers of
  :func:`arrow_resolvers` (or :meth:`ArrowExchange.resolvers`) passed to ``Server``/``connect``;
  hosts and socket folders outside the allow-lists are PERMISSION_DENIED, malformed refs
  INVALID_ARGUMENT, a transfer that fails UNAVAILABLE.
"""

from __future__ import annotations

from evergreen_trio._extras import require_extra

require_extra("ipc", __name__)

import itertools
import os
import secrets
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator, Collection, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes, urlsplit

import pyarrow as pa
import pyarrow.ipc
import trio

from evergreen_trio.dag.errors import ProtocolViolationError, RefRejectedError, StatusCode
from evergreen_trio.ipc import Catalog, IpcError, IpcLimits, IpcUri, ServeOptions, UnknownTicketError, fetch, serve
from evergreen_trio.ipc.config import DEFAULT_LIMITS
from evergreen_trio.ipc.errors import UriError
from evergreen_trio.ipc.uri import parse_uri
from evergreen_trio.nursery_session import ChunkReader, OutputNode
from evergreen_trio.refs import ExternalRef

ARROW_STREAM = "application/vnd.apache.arrow.stream"
"""Mimetype of an Arrow IPC stream chunk (inline or by reference)."""
ARROW_SCHEMES = ("tcp", "shm", "ucx", "grpc")
LOOPBACK = ("127.0.0.1", "::1", "localhost")
_MAX_TICKET = 4096


def arrow_ref(uri: IpcUri | str, ticket: bytes | str) -> str:
    """The ref URI of ``ticket`` served at ``uri`` (an IPC URI or a ``grpc://`` Flight location)."""
    key = ticket.encode() if isinstance(ticket, str) else ticket
    text = str(uri)
    return f"{text}{'&' if '?' in text else '?'}ticket={quote(key, safe='')}"


def _ticket(query: str, uri: str) -> bytes:
    tickets = [
        unquote_to_bytes(value) for key, _, value in (p.partition("=") for p in query.split("&")) if key == "ticket"
    ]
    if len(tickets) != 1 or not tickets[0]:
        raise RefRejectedError(f"ref {uri[:200]!r}: expected exactly one non-empty ticket= parameter")
    if len(tickets[0]) > _MAX_TICKET:
        raise RefRejectedError(f"ref {uri[:80]!r}...: expected a ticket <= {_MAX_TICKET} bytes, got {len(tickets[0])}")
    return tickets[0]


class ArrowRefResolver:
    """Resolves Arrow refs of one scheme (``tcp``, ``shm``, ``ucx`` or Flight ``grpc``).

    Only hosts in ``allow_hosts`` (loopback by default) and shm control sockets under
    ``allow_socket_dirs`` (the temp folder by default) are ever contacted: a peer cannot
    make this side connect anywhere else. Batches are copied out of shared memory unless
    ``zero_copy`` (then a reader must drop each batch before the server can reuse its
    memory: holding more than ``max_unacked_bodies`` of them stalls the stream).
    """

    def __init__(
        self,
        scheme: str,
        *,
        allow_hosts: Collection[str] = LOOPBACK,
        allow_socket_dirs: Sequence[str | os.PathLike[str]] = (tempfile.gettempdir(),),
        limits: IpcLimits = DEFAULT_LIMITS,
        zero_copy: bool = False,
    ) -> None:
        if scheme not in ARROW_SCHEMES:
            raise ValueError(f"ArrowRefResolver: expected a scheme in {ARROW_SCHEMES}, got {scheme!r}")
        self.scheme = scheme
        self.allow_hosts = frozenset(allow_hosts)
        self.allow_socket_dirs = tuple(Path(os.path.realpath(d)) for d in allow_socket_dirs)
        self.limits = limits
        self.zero_copy = zero_copy

    def _parse(self, uri: str) -> tuple[IpcUri | str, bytes]:
        """(IPC URI or Flight location, ticket); RefRejectedError saying why ``uri`` is refused."""
        try:
            parts = urlsplit(uri)
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise RefRejectedError(
                f"ref {uri[:200]!r}: expected scheme://host:port?...&ticket=..., got {exc}"
            ) from None
        if parts.scheme.lower() != self.scheme:
            raise RefRejectedError(f"ref {uri[:200]!r}: expected a {self.scheme}:// URI")
        ticket = _ticket(parts.query, uri)
        if self.scheme == "grpc":
            if not port:
                raise RefRejectedError(f"ref {uri[:200]!r}: expected grpc://host:port")
            if host not in self.allow_hosts:
                raise RefRejectedError(f"ref {uri[:200]!r}: host not allowed", code=StatusCode.PERMISSION_DENIED)
            return f"grpc://{parts.netloc}", ticket
        return self._allowed(uri, repr(uri)), ticket

    def _allowed(self, uri: str, ref: str) -> IpcUri:
        """``uri`` as a Dissociated IPC URI the allow-lists admit; else RefRejectedError naming ``ref``."""
        try:
            parsed = parse_uri(uri)
        except UriError as exc:
            raise RefRejectedError(f"ref {ref[:200]}: {exc}") from None
        if parsed.scheme == "shm":
            real = Path(os.path.realpath(parsed.path))
            if not any(root in real.parents for root in self.allow_socket_dirs):
                raise RefRejectedError(
                    f"ref {ref}: socket outside the allowed folders", code=StatusCode.PERMISSION_DENIED
                )
        elif parsed.host not in self.allow_hosts:
            raise RefRejectedError(f"ref {ref}: host not allowed", code=StatusCode.PERMISSION_DENIED)
        return parsed

    def check(self, uri: str) -> None:
        self._parse(uri)

    @asynccontextmanager
    async def open_batches(self, uri: str) -> AsyncIterator[AsyncIterator[pa.RecordBatch]]:
        """Fetch the table ``uri`` names out of band; yield its record batches as they arrive.

        Raises RefRejectedError (UNAVAILABLE, or NOT_FOUND for a ticket the server does not know).
        """
        location, ticket = self._parse(uri)
        try:
            if isinstance(location, str):
                from evergreen_trio.ipc.flight import locate

                data_uri, ticket = await locate(location, ticket, timeout_s=self.limits.connect_timeout_s)
                # The Flight server is a peer too: where it points must pass the same allow-lists.
                location = self._allowed(data_uri, f"{uri!r} (its Flight server points at {data_uri[:200]!r})")
            async with fetch(location, ticket, limits=self.limits, copy=not self.zero_copy) as stream:
                yield stream
        except UnknownTicketError as exc:
            raise RefRejectedError(f"ref {uri!r}: {exc}", code=StatusCode.NOT_FOUND) from None
        except IpcError as exc:
            raise RefRejectedError(f"ref {uri!r}: transfer failed: {exc}", code=StatusCode.UNAVAILABLE) from None

    async def open(self, uri: str) -> AsyncIterator[bytes]:
        """The table as Arrow IPC stream bytes, for readers that want bytes (one batch per block)."""
        async with self.open_batches(uri) as batches:
            writer: pa.ipc.RecordBatchStreamWriter | None = None
            sink = _Blocks()
            async for batch in batches:
                if writer is None:
                    writer = pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), batch.schema)
                writer.write_batch(batch)
                yield sink.take()
            if writer is not None:
                writer.close()
                yield sink.take()


class _Blocks:
    """A write-only file collecting what pyarrow's stream writer writes."""

    closed = False

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self._parts.append(bytes(data))
        return len(self._parts[-1])

    def flush(self) -> None:
        return None

    def take(self) -> bytes:
        block = b"".join(self._parts)
        self._parts.clear()
        return block


def arrow_resolvers(schemes: Iterable[str] = ARROW_SCHEMES, **options: Any) -> list[ArrowRefResolver]:
    """One :class:`ArrowRefResolver` per scheme, sharing ``options``; pass them as ``resolvers=``."""
    return [ArrowRefResolver(scheme, **options) for scheme in schemes]


async def _inline_batches(data: bytes) -> AsyncIterator[pa.RecordBatch]:
    """The batches of an inline IPC stream, each fully validated: a peer's offsets past their data
    would otherwise crash the handler that reads them."""
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(data))
        batches = list(reader)
        for batch in batches:
            batch.validate(full=True)
    except (pa.ArrowException, OSError) as exc:
        raise ProtocolViolationError(
            f"Arrow chunk: expected an Arrow IPC stream, got an error from pyarrow: {exc}"
        ) from None
    for batch in batches:
        await trio.lowlevel.checkpoint()
        yield batch


@asynccontextmanager
async def open_arrow(chunk: ChunkReader) -> AsyncIterator[AsyncIterator[pa.RecordBatch]]:
    """The record batches of an Arrow chunk: one Arrow ref (fetched out of band) or an inline IPC stream.

    Raises RefRejectedError for a ref this side has no Arrow resolver for (or several refs in
    one chunk), ProtocolViolationError for inline bytes that are not an Arrow IPC stream.
    """
    refs: list[ExternalRef] = []
    inline: list[bytes] = []
    async for part in chunk.parts():
        if isinstance(part, ExternalRef):
            refs.append(part)
        else:
            inline.append(part)
    if not refs:
        yield _inline_batches(b"".join(inline))
        return
    if len(refs) > 1 or inline:
        raise RefRejectedError(f"Arrow chunk {chunk.node_id!r}: expected one ref or inline bytes, got {len(refs)} refs")
    resolver = refs[0].resolver
    if not isinstance(resolver, ArrowRefResolver):
        raise RefRejectedError(f"Arrow chunk {chunk.node_id!r}: ref {refs[0].uri!r} does not name an Arrow stream")
    async with resolver.open_batches(refs[0].uri) as batches:
        yield batches


async def read_arrow(chunk: ChunkReader) -> pa.Table:
    """The whole table of an Arrow chunk (see :func:`open_arrow`)."""
    async with open_arrow(chunk) as batches:
        collected = [batch async for batch in batches]
    if not collected:
        raise ProtocolViolationError(f"Arrow chunk {chunk.node_id!r}: expected at least one record batch, got none")
    return pa.Table.from_batches(collected)


class ArrowExchange:
    """Publishes tables over one Dissociated IPC transport and resolves Arrow refs.

    Run :meth:`serve` in a nursery (``await nursery.start(exchange.serve)``), pass
    :meth:`resolvers` to ``Server``/``connect``, and publish from a handler with
    :meth:`publish`. At most ``max_bytes`` of published tables are kept: the oldest are
    dropped first (a ref to a dropped table resolves to NOT_FOUND/UNAVAILABLE).
    """

    def __init__(
        self,
        uri: str = "tcp://127.0.0.1:0",
        *,
        limits: IpcLimits = DEFAULT_LIMITS,
        max_bytes: int = 4 << 30,
        max_chunksize: int | None = None,
    ) -> None:
        self.listen = uri
        self.limits = limits
        self.max_bytes = max_bytes
        self.max_chunksize = max_chunksize
        self.catalog = Catalog()
        self.uri: IpcUri | None = None
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._total = 0
        self._counter = itertools.count(1)
        self._prefix = secrets.token_hex(6)

    async def serve(self, *, task_status: trio.TaskStatus[IpcUri] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve published tables until cancelled; ``task_status`` gets the URI clients fetch from."""

        async def record(task_status: trio.TaskStatus[IpcUri] = trio.TASK_STATUS_IGNORED) -> None:
            await serve(self.listen, self.catalog, ServeOptions(limits=self.limits), task_status=task_status)

        async with trio.open_nursery() as nursery:
            self.uri = await nursery.start(record)
            task_status.started(self.uri)

    def resolvers(self, **options: Any) -> list[ArrowRefResolver]:
        """Resolvers for every Arrow scheme (``limits`` default to this exchange's)."""
        options.setdefault("limits", self.limits)
        return arrow_resolvers(**options)

    def add(self, table: pa.Table) -> str:
        """Serve ``table`` under a fresh unguessable ticket; return its ref URI."""
        if self.uri is None:
            raise IpcError("ArrowExchange.add: expected serve() to be running, got no URI yet")
        ticket = f"{self._prefix}-{next(self._counter)}-{secrets.token_hex(8)}".encode()
        self.catalog.add_table(ticket, table, self.max_chunksize)
        self._sizes[ticket] = table.nbytes
        self._total += table.nbytes
        while self._total > self.max_bytes and len(self._sizes) > 1:
            old, size = self._sizes.popitem(last=False)
            self._total -= size
            self.catalog.remove(old)
        return arrow_ref(self.uri, ticket)

    async def publish(self, output: OutputNode, table: pa.Table, *, last: bool = True) -> str:
        """Serve ``table`` and write its ref as the next chunk of ``output``; return the ref."""
        uri = self.add(table)
        await output.write_ref(uri, mimetype=ARROW_STREAM, last=last)
        return uri
