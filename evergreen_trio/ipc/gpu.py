"""GPU bodies over UCX: bodies live in CuPy device memory on both ends.

The server sends device buffers as the protocol's raw (type 0) bodies, so the tagged
message goes device to device through UCX (``cuda_copy``/``cuda_ipc``, part of the
default ``UCX_TLS`` on a host with an NVIDIA driver). The client receives each body straight into a CuPy buffer of the
announced length (limits checked first) through the same channel and stream code as
host bodies, keeps the device buffers for GPU consumers and builds host batches from
them for pyarrow. Device catalogs are served over ``ucx://`` only.

UCX must find a current CUDA context when it creates its context, and that context is
shared by the whole process: call :func:`init_cuda` (both functions here do) before
anything in the process uses UCX. Needs CuPy and a CUDA device; nothing here is
imported otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa

from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_table
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import IpcError, UriError
from evergreen_trio.ipc.flatbuf import MessageHeader
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.session import IpcStream
from evergreen_trio.ipc.uri import IpcUri, parse_uri


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise IpcError("GPU bodies: expected CuPy to be installed, got ImportError") from None
    return cupy


def init_cuda() -> Any:
    """Create (or make current) the CUDA context of the current device; return ``cupy``.

    ``cudaFree(0)`` is the usual way to force the primary context into existence
    without allocating.
    """
    cupy = _cupy()
    try:
        cupy.cuda.runtime.free(0)
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise IpcError(f"GPU bodies: expected a usable CUDA device, got {exc}") from None
    return cupy


def device_catalog_entry(table: pa.Table, max_chunksize: int | None = None) -> list[OutgoingMessage]:
    """A table's messages with every body copied once to the current CUDA device.

    The bodies are CuPy ``uint8`` arrays (where :class:`OutgoingMessage` normally holds a
    ``pyarrow.Buffer``); the copies are finished before this returns, so UCX never
    reads a buffer that a stream is still writing.
    """
    cupy = init_cuda()
    out = []
    for message in messages_from_table(table, max_chunksize):
        if message.body is None or not message.body.size:
            out.append(message)
        else:
            out.append(replace(message, body=cupy.asarray(np.frombuffer(message.body, np.uint8))))
    cupy.cuda.get_current_stream().synchronize()
    return out


@dataclass(frozen=True)
class DeviceMessage:
    """One received message with a body: its header and its body in device memory."""

    seq: int
    flatbuffer: bytes
    header: MessageHeader
    body: Any


async def fetch_device(
    uri: str | IpcUri, ticket: bytes | str, limits: IpcLimits = DEFAULT_LIMITS
) -> tuple[list[DeviceMessage], pa.Table]:
    """Fetch over UCX into device memory: the device bodies in order, and the host table."""
    from evergreen_trio.ipc.transports.ucx import connect_ucx

    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    if parsed.scheme != "ucx":
        raise UriError(f"GPU fetch: expected a ucx:// URI, got {parsed.scheme}://")
    cupy = init_cuda()
    received: list[DeviceMessage] = []

    def allocate(nbytes: int) -> Any:
        return cupy.empty(nbytes, cupy.uint8)

    class ToHost:
        def resolve(self, body: object, header: MessageHeader, *, copy: bool) -> pa.Buffer:
            received.append(DeviceMessage(len(received), b"", header, body))
            return pa.py_buffer(cupy.asnumpy(body))

        def take_freed(self) -> list[int]:
            return []

    key = ticket.encode() if isinstance(ticket, str) else bytes(ticket)
    async with connect_ucx(parsed, limits, BufferPool(limits.pool_bytes), device=allocate) as channel:
        await channel.send_request(parsed.want_data, key)
        table = await IpcStream(channel, free_data=None, limits=limits, bodies=ToHost()).read_all()
    return received, table
