"""GPU bodies over UCX: bodies stay in device memory end to end.

The server sends device buffers as the protocol's raw (type 0) bodies, so the tagged
message goes device to device through UCX (``cuda_copy``/``cuda_ipc``, part of the
default ``UCX_TLS`` on a host with an NVIDIA driver). The client receives each body
straight into a device buffer of the announced length (limits checked first) and hands
it on as a :class:`DeviceBatch`: the whole body plus one zero-copy device view per IPC
buffer (validity, offsets, data, in the schema's depth-first order), each a CuPy array
that also exports DLPack (``torch.from_dlpack(view)``). Nothing is copied to the host
unless asked: ``host=True`` also builds a ``pyarrow.RecordBatch`` from a host copy.
Only the schema (it has no body) is decoded on the host. Device catalogs are served over
``ucx://`` only.

UCX must find a current CUDA context when it creates its context, and that context is
shared by the whole process: call :func:`init_cuda` (:func:`cupy_memory` does) before
anything in the process uses UCX. CuPy is imported only here, only when used. A
:class:`DeviceMemory` other than CuPy's (NumPy's, in the tests) runs the same code on a
host without a GPU.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_table
from evergreen_trio.ipc.client import IpcClient, open_client
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.device_pool import DEFAULT_GROWTH_CAP, PoolGrowth, growing_allocator
from evergreen_trio.ipc.errors import IpcError, UriError
from evergreen_trio.ipc.flatbuf import MessageHeader, MessageKind
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.reassembly import ReadyMessage
from evergreen_trio.ipc.session import MessagePump
from evergreen_trio.ipc.transports.base import ClientChannel, Connection, HostBodies
from evergreen_trio.ipc.uri import IpcUri, parse_uri


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise IpcError("GPU bodies: expected CuPy: pip install 'evergreen-trio[gpu]' (CUDA 12) or "
                       "'evergreen-trio[gpu-cu13]' (CUDA 13)") from None
    return cupy


def init_cuda() -> Any:
    """Create (or make current) the CUDA context of the current device; return ``cupy``.

    ``cudaFree(0)`` is the usual way to force the primary context into existence
    without allocating. Raises IpcError without CuPy or a usable device.
    """
    cupy = _cupy()
    try:
        cupy.cuda.runtime.free(0)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise IpcError(f"GPU bodies: expected a usable CUDA device, got {exc}") from None
    return cupy


@dataclass(frozen=True)
class DeviceMemory:
    """How device buffers are made, filled from the host, and (only when asked) copied back."""

    allocate: Callable[[int], Any]
    """A 1-D ``uint8`` device array of that many bytes (UCX receives into it)."""
    from_host: Callable[[npt.NDArray[np.uint8]], Any]
    to_host: Callable[[Any], npt.NDArray[np.uint8]]
    synchronize: Callable[[], None]
    """Wait for copies issued so far (before UCX reads a buffer a stream may still write)."""


def cupy_memory(*, growth_cap: int = DEFAULT_GROWTH_CAP, pool: Any = None) -> DeviceMemory:
    """CuPy's device memory on the current device (the CUDA context is created first).

    Bodies come from ``pool`` (a ``cupy.cuda.MemoryPool``), grown ahead of them in steps that
    double up to ``growth_cap`` bytes (:class:`~evergreen_trio.ipc.device_pool.PoolGrowth`;
    ``0`` allocates each body on its own). By default that is CuPy's default pool while it is
    CuPy's allocator; under another allocator (``cupy.cuda.set_allocator``, RMM's, say) bodies
    come from that allocator as ``cupy.empty`` would, with no growth ahead.
    """
    growth = PoolGrowth(growth_cap)
    cupy = init_cuda()
    if pool is None and getattr(cupy.cuda.get_allocator(), "__self__", None) is cupy.get_default_memory_pool():
        pool = cupy.get_default_memory_pool()
    allocate = (
        growing_allocator(cupy, pool, growth) if pool is not None else lambda nbytes: cupy.empty(nbytes, cupy.uint8)
    )
    return DeviceMemory(
        allocate=allocate,
        from_host=cupy.asarray,
        to_host=cupy.asnumpy,
        synchronize=lambda: cupy.cuda.get_current_stream().synchronize(),
    )


def device_catalog_entry(
    table: pa.Table, max_chunksize: int | None = None, memory: DeviceMemory | None = None
) -> list[OutgoingMessage]:
    """A table's messages with every body copied once to the device (CuPy's by default).

    The bodies are device ``uint8`` arrays (where :class:`OutgoingMessage` normally holds a
    ``pyarrow.Buffer``); the copies are finished before this returns, so UCX never reads
    a buffer that a stream is still writing.
    """
    memory = memory if memory is not None else cupy_memory()
    out = []
    for message in messages_from_table(table, max_chunksize):
        if message.body is None or not message.body.size:
            out.append(message)
        else:
            out.append(replace(message, body=memory.from_host(np.frombuffer(message.body, np.uint8))))
    memory.synchronize()
    return out


@dataclass(frozen=True)
class DeviceBatch:
    """One received message with a body, its body in device memory.

    ``kind`` is RECORD_BATCH or DICTIONARY_BATCH (device consumers need dictionaries too).
    ``host`` is the pyarrow batch built from a host copy, only for record batches of a
    stream opened with ``host=True``.
    """

    seq: int
    flatbuffer: bytes
    header: MessageHeader
    body: Any
    host: pa.RecordBatch | None = None

    @property
    def kind(self) -> MessageKind:
        return self.header.kind

    @property
    def buffers(self) -> list[Any]:
        """One zero-copy device view per IPC buffer, in the order of the message's buffer list."""
        return [self.body[offset : offset + length] for offset, length in self.header.buffers]


class DeviceStream(MessagePump[DeviceBatch]):
    """An async iterator of :class:`DeviceBatch`: bodies never leave the device unless ``host``.

    The schema is decoded on the host (it has no body); with ``host=True`` every body is
    also copied to the host once and decoded by pyarrow (dictionaries included).
    """

    def __init__(
        self,
        channel: ClientChannel,
        memory: DeviceMemory,
        *,
        limits: IpcLimits = DEFAULT_LIMITS,
        host: bool = False,
    ) -> None:
        super().__init__(channel, free_data=None, limits=limits)
        self._memory = memory
        self._host = host

    def _deliver(self, ready: ReadyMessage) -> None:
        if ready.body is None:
            # The schema, or a batch without a body: nothing to keep on the device.
            empty = self._decoder.feed(ready.flatbuffer, ready.header, None)
            if ready.header.kind is MessageKind.RECORD_BATCH:
                body = self._memory.allocate(0)
                self._items.append(DeviceBatch(ready.seq, ready.flatbuffer, ready.header, body, empty))
            return
        host_batch = None
        if self._host:
            host_batch = self._decoder.feed(
                ready.flatbuffer, ready.header, pa.py_buffer(self._memory.to_host(ready.body))
            )
        self._items.append(DeviceBatch(ready.seq, ready.flatbuffer, ready.header, ready.body, host_batch))

    async def read_all(self) -> tuple[list[DeviceBatch], pa.Table | None]:
        """Every remaining device batch, and (with ``host=True``) the host table."""
        batches = [batch async for batch in self]
        if not self._host:
            return batches, None
        if self._decoder.schema is None:
            raise IpcError("stream: expected a schema, got none")
        hosts = [b.host for b in batches if b.host is not None]
        return batches, pa.Table.from_batches(hosts, schema=self._decoder.schema)


def _ucx_uri(uri: str | IpcUri) -> IpcUri:
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    if parsed.scheme != "ucx":
        raise UriError(f"GPU fetch: expected a ucx:// URI, got {parsed.scheme}://")
    return parsed


class DeviceClient:
    """Device streams from one server over one kept ``ucx://`` connection (see :class:`IpcClient`)."""

    def __init__(self, client: IpcClient, memory: DeviceMemory) -> None:
        self.client = client
        self.memory = memory

    def open(self, ticket: bytes | str, *, host: bool = False) -> AbstractAsyncContextManager[DeviceStream]:
        """Send want_data and yield the :class:`DeviceStream` once its schema has arrived."""
        return self.client._open_stream(ticket, lambda connection: DeviceStream(
            connection.channel, self.memory, limits=self.client.limits, host=host))

    async def fetch(self, ticket: bytes | str, *, host: bool = False) -> tuple[list[DeviceBatch], pa.Table | None]:
        """The whole stream as device batches, and (with ``host=True``) the host table."""
        async with self.open(ticket, host=host) as stream:
            return await stream.read_all()


@asynccontextmanager
async def connect_device(
    uri: str | IpcUri, *, limits: IpcLimits = DEFAULT_LIMITS, memory: DeviceMemory | None = None, eager: bool = True
) -> AsyncIterator[DeviceClient]:
    """A client that keeps its ``ucx://`` connection between device fetches (see :func:`connect`).

    Raises UriError for a URI that is not ``ucx://`` and IpcError without CuPy / a device (when
    ``memory`` is not given), before connecting; TransportError when no server answers.
    """
    parsed = _ucx_uri(uri)
    memory = memory if memory is not None else cupy_memory()
    # Imported once the URI and the memory are checked: a bad call fails the same without the ucx extra.
    from evergreen_trio.ipc.transports.ucx import connect_ucx

    @asynccontextmanager
    async def open_connection(key: bytes | None) -> AsyncIterator[Connection]:
        async with connect_ucx(parsed, limits, BufferPool(limits.pool_bytes), device=memory.allocate) as channel:
            if key is not None:
                await channel.send_request(parsed.want_data, key)
            yield Connection(channel, HostBodies())

    async with open_client(parsed, open_connection, limits, eager=eager) as client:
        yield DeviceClient(client, memory)


@asynccontextmanager
async def open_device(
    uri: str | IpcUri,
    ticket: bytes | str,
    *,
    limits: IpcLimits = DEFAULT_LIMITS,
    memory: DeviceMemory | None = None,
    host: bool = False,
) -> AsyncIterator[DeviceStream]:
    """Fetch over UCX with every raw body received into device memory; yield the stream.

    Raises UriError for a URI that is not ``ucx://``, IpcError without CuPy / a device
    (when ``memory`` is not given), and the usual IPC errors while streaming.
    """
    async with connect_device(uri, limits=limits, memory=memory, eager=False) as client, client.open(
        ticket, host=host
    ) as stream:
        yield stream


async def fetch_device(
    uri: str | IpcUri,
    ticket: bytes | str,
    limits: IpcLimits = DEFAULT_LIMITS,
    *,
    memory: DeviceMemory | None = None,
    host: bool = False,
) -> tuple[list[DeviceBatch], pa.Table | None]:
    """The whole stream as device batches, and (with ``host=True``) the host table."""
    async with connect_device(uri, limits=limits, memory=memory, eager=False) as client:
        return await client.fetch(ticket, host=host)
