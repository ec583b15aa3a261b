"""GPU bodies over UCX: bodies live in CuPy device memory on both ends.

The server sends device buffers as the protocol's raw (type 0) bodies, so the tagged
message goes device to device through UCX (CUDA transports must be in ``UCX_TLS``).
The client receives each body into a fresh CuPy buffer; it can keep the device
buffers (for GPU consumers) and, on request, build host batches from them.
Needs CuPy and a CUDA device; nothing here is imported otherwise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa

from evergreen_trio.ipc.arrow import BatchDecoder, OutgoingMessage, messages_from_table
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import ConnectionLostError, IpcError
from evergreen_trio.ipc.framing import METADATA_TAG, parse_body_tag
from evergreen_trio.ipc.reassembly import Reassembler
from evergreen_trio.ipc.uri import IpcUri, parse_uri


def _cupy() -> Any:
    try:
        import cupy
    except ImportError:
        raise IpcError("GPU bodies: expected CuPy to be installed, got ImportError") from None
    return cupy


def device_catalog_entry(table: pa.Table, max_chunksize: int | None = None) -> list[OutgoingMessage]:
    """A table's messages with every body copied once to the current CUDA device."""
    cupy = _cupy()
    out = []
    for message in messages_from_table(table, max_chunksize):
        if message.body is None:
            out.append(message)
        else:
            out.append(replace(message, body=cupy.asarray(memoryview(message.body))))
    return out


async def fetch_device(
    uri: str | IpcUri, ticket: bytes | str, limits: IpcLimits = DEFAULT_LIMITS
) -> tuple[list[tuple[bytes, Any]], pa.Table]:
    """Fetch over UCX into device memory: (flatbuffer, device body) pairs and the host table."""
    from evergreen_trio.ipc.pool import BufferPool
    from evergreen_trio.ipc.transports.ucx import connect_ucx

    cupy = _cupy()
    parsed = parse_uri(uri) if isinstance(uri, str) else uri
    machine = Reassembler(limits)
    received: list[tuple[bytes, Any]] = []
    decoder = BatchDecoder()
    batches = []
    async with connect_ucx(parsed, limits, BufferPool(limits.pool_bytes)) as channel:
        await channel.send_request(parsed.want_data, ticket.encode() if isinstance(ticket, str) else ticket)
        bridge = channel.bridge
        while not machine.finished:
            probe = await bridge.probe(0, 0)
            tag, nbytes = int(probe.sender_tag.value), int(probe.length)
            if tag == METADATA_TAG:
                data = bytearray(nbytes)
                await bridge.receive(probe, data)
                machine.on_metadata(bytes(data))
            else:
                parse_body_tag(tag)
                body = cupy.empty(nbytes, cupy.uint8)
                await bridge.receive(probe, body)
                machine.on_body(tag, body, nbytes)
            for ready in machine.pop_ready():
                received.append((ready.flatbuffer, ready.body))
                host = None if ready.body is None else pa.py_buffer(cupy.asnumpy(ready.body))
                batch = decoder.feed(ready.flatbuffer, ready.header, host)
                if batch is not None:
                    batches.append(batch)
    if decoder.schema is None:
        raise ConnectionLostError("GPU fetch: stream ended without a schema")
    return received, pa.Table.from_batches(batches, schema=decoder.schema)
