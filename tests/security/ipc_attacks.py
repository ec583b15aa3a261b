"""Issue 22, items 11-12: attacks on the IPC servers (tcp://, shm://), as a hostile client sends them;
and hostile servers (:func:`hostile_server`) against the client.

Shared by ``tests/security/test_ipc_attacks.py`` and ``benchmarks/security_ipc.py``. Each attack
takes the server's URI and a scale (1.0: the issue's size) and returns an :class:`IpcOutcome`
saying how the server answered. :class:`LegitClient` makes back-to-back fetches on one
connection opened before the attack (the measure of the stall).
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import pyarrow as pa
import trio

from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_table, split_stream
from evergreen_trio.ipc.config import IpcLimits, MiB
from evergreen_trio.ipc.framing import (
    METADATA_TAG,
    WANT_DATA_TAG,
    BodyType,
    encode_end_of_stream,
    encode_frame_header,
    encode_metadata,
    make_tag,
)
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.session import IpcStream
from evergreen_trio.ipc.transports.tcp import FramedSocket, StreamClientChannel
from evergreen_trio.ipc.uri import IpcUri, parse_uri

KiB = 1 << 10
LEGIT_TICKET = "small"
BIG_TICKET = "big"


def small_table() -> pa.Table:
    return pa.table({"x": list(range(1000))})


def big_table() -> pa.Table:
    """About 8 MiB in 64 batches: a stream a client that never reads blocks."""
    return pa.table({"x": pa.array(range(1 << 20), pa.float64())})


async def open_raw(uri: IpcUri) -> trio.SocketStream:
    """A plain socket to the server (a Unix socket for shm://: its segment descriptor is dropped)."""
    if uri.scheme == "shm":
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        await sock.connect(uri.path)
        return trio.SocketStream(sock)
    return await trio.open_tcp_stream(uri.host, uri.port)


@dataclass
class IpcOutcome:
    """How the server answered the attacking connections."""

    connections: int = 0
    closed: int = 0  # by the server, within the wait
    closed_at_once: int = 0  # within 0.5 s of connecting (refused at accept)
    last_closed_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        text = f"{self.closed} of {self.connections} closed by the server, the last after {self.last_closed_s:.1f} s"
        if self.closed_at_once:
            text += f", {self.closed_at_once} at once"
        return "; ".join([text, *self.notes])


async def _until_closed(stream: trio.SocketStream, started: float, wait_s: float, outcome: IpcOutcome) -> None:
    with trio.move_on_after(wait_s):
        try:
            while await stream.receive_some(64 * KiB):
                pass
        except (trio.BrokenResourceError, OSError):
            pass
        outcome.closed += 1
        elapsed = trio.current_time() - started
        outcome.last_closed_s = max(outcome.last_closed_s, elapsed)
        outcome.closed_at_once += elapsed < 0.5
    await trio.aclose_forcefully(stream)


async def _many(uri: IpcUri, count: int, first_bytes: bytes, wait_s: float) -> IpcOutcome:
    outcome = IpcOutcome(connections=count)
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            stream = await open_raw(uri)
            try:
                await stream.send_all(first_bytes)
            except (trio.BrokenResourceError, OSError):  # refused at accept before we sent
                outcome.closed += 1
                outcome.closed_at_once += 1
                await trio.aclose_forcefully(stream)
                continue
            nursery.start_soon(_until_closed, stream, trio.current_time(), wait_s, outcome)
    return outcome


async def partial_request(uri: IpcUri, scale: float, wait_s: float = 30.0) -> IpcOutcome:
    """2,000 connections, each a frame header announcing a 512 KiB want_data and nothing after."""
    header = encode_frame_header(uri.want_data, 512 * KiB)
    return await _many(uri, max(1, int(2000 * scale)), header, wait_s)


async def silent_connections(uri: IpcUri, scale: float, wait_s: float = 30.0) -> IpcOutcome:
    """3,000 connections that send nothing."""
    return await _many(uri, max(1, int(3000 * scale)), b"", wait_s)


async def want_data_flood(uri: IpcUri, scale: float, wait_s: float = 30.0) -> IpcOutcome:
    """20,000 want_data for a large stream on one connection that never reads."""
    count = max(1, int(20_000 * scale))
    frame = encode_frame_header(uri.want_data, len(BIG_TICKET)) + BIG_TICKET.encode()
    stream = await open_raw(uri)
    outcome = IpcOutcome(connections=1)
    sent = 0
    started = trio.current_time()
    try:
        for start in range(0, count, 1000):
            await stream.send_all(frame * min(1000, count - start))
            sent += min(1000, count - start)
    except (trio.BrokenResourceError, OSError):
        pass  # the server closed the connection while we were still sending
    outcome.notes.append(f"{sent} of {count} want_data sent")
    await trio.sleep(0.2)  # not reading: the server's sends block
    await _until_closed(stream, started, wait_s, outcome)
    return outcome


async def shm_connections(uri: IpcUri, scale: float, wait_s: float = 30.0) -> IpcOutcome:
    """100 silent shm:// connections: each would take a segment of its own."""
    return await _many(uri, max(1, int(100 * scale)), b"", wait_s)


ATTACKS: dict[str, tuple[str, str, Callable[[IpcUri, float, float], Awaitable[IpcOutcome]]]] = {
    "partial_request": ("11. frame header announcing a 512 KiB request, nothing after (2,000 connections)",
                        "closed at first_request_timeout_s; the announced size is never allocated",
                        partial_request),
    "silent_connections": ("11. silent connections (3,000)",
                           "closed at first_request_timeout_s; past max_connections closed at accept",
                           silent_connections),
    "want_data_flood": ("11. 20,000 want_data on one connection that never reads",
                        "closed past max_streams_per_connection (16 streams), sends cut at send_timeout_s",
                        want_data_flood),
    "shm_connections": ("12. silent shm:// connections, each taking a shared-memory segment (100)",
                        "16 get a segment (shm_max_total_bytes // shm_segment_bytes), the rest closed at accept",
                        shm_connections),
}


class LegitClient:
    """One connection opened before the attack; each call fetches the small stream on it."""

    def __init__(self, framed: FramedSocket, uri: IpcUri) -> None:
        self.channel = StreamClientChannel(framed)
        self.uri = uri

    @classmethod
    async def connect(cls, uri: IpcUri | str) -> LegitClient:
        uri = parse_uri(uri) if isinstance(uri, str) else uri
        limits = IpcLimits()
        stream = await trio.open_tcp_stream(uri.host, uri.port)
        return cls(FramedSocket(stream, limits, BufferPool(16 * MiB)), uri)

    async def call(self) -> int:
        """Fetch the small stream once; the rows read."""
        await self.channel.send_request(self.uri.want_data, LEGIT_TICKET.encode())
        rows = 0
        async for batch in IpcStream(self.channel, free_data=None):
            rows += batch.num_rows
        return rows

    async def aclose(self) -> None:
        await self.channel.framed.aclose()



# Hostile servers, as a client meets them: each answers any want_data with the frames it is given.

Frame = tuple[int, bytes]


def stream_frames(messages: Sequence[OutgoingMessage]) -> list[Frame]:
    """A stream's messages as a TCP server frames them: metadata, then its body, then End of Stream."""
    frames: list[Frame] = []
    for seq, message in enumerate(messages):
        frames.append((METADATA_TAG, encode_metadata(seq, message.flatbuffer)))
        if message.body is not None:
            frames.append((make_tag(seq, BodyType.RAW), message.body.to_pybytes()))
    frames.append((METADATA_TAG, encode_end_of_stream(len(messages))))
    return frames


def compressed_messages(table: pa.Table) -> list[OutgoingMessage]:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    return split_stream(sink.getvalue())


def compression_bomb(inflated: int) -> list[Frame]:
    """One ZSTD batch of ``inflated`` bytes of zeros (a few KiB on the wire), honest about its size."""
    return stream_frames(compressed_messages(pa.table({"x": np.zeros(inflated // 8)})))


def forged_compressed_size(declared: int) -> list[Frame]:
    """One small ZSTD batch whose data buffer claims to inflate to ``declared`` bytes."""
    schema, batch = compressed_messages(pa.table({"x": np.zeros(1000)}))
    offset, _ = batch.header.buffers[-1]
    assert batch.body is not None
    body = bytearray(batch.body.to_pybytes())
    struct.pack_into("<q", body, offset, declared)
    return stream_frames([schema, OutgoingMessage(batch.flatbuffer, batch.header, pa.py_buffer(bytes(body)))])


def offsets_past_the_data() -> list[Frame]:
    """A string batch whose second string starts 1 GiB past its data buffer (only its sizes are right)."""
    schema, batch = messages_from_table(pa.table({"s": ["a", "bb", "ccc"]}))
    assert batch.body is not None
    body = bytearray(batch.body.to_pybytes())
    offsets, _ = batch.header.buffers[1]
    body[offsets + 4 : offsets + 8] = (1 << 30).to_bytes(4, "little")
    return stream_frames([schema, OutgoingMessage(batch.flatbuffer, batch.header, pa.py_buffer(bytes(body)))])


def orphan_bodies(count: int, size: int) -> list[Frame]:
    """Bodies 1..count of ``size`` bytes and no metadata: each waits for a schema that never comes."""
    body = bytes(size)
    return [(make_tag(seq, BodyType.RAW), body) for seq in range(1, count + 1)]


@dataclass
class HostileServer:
    """A TCP server answering want_data with fixed frames; counts the bytes the client took."""

    uri: IpcUri
    sent: int = 0


async def hostile_server(nursery: trio.Nursery, frames: Sequence[Frame]) -> HostileServer:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    server = HostileServer(IpcUri("tcp", WANT_DATA_TAG, host="127.0.0.1", port=listener.socket.getsockname()[1]))

    async def answer(stream: trio.SocketStream) -> None:
        framed = FramedSocket(stream, IpcLimits())
        _, nbytes = await framed.receive_header()
        await framed.receive_bytes(nbytes)  # the want_data ticket
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            for tag, payload in frames:
                await stream.send_all(encode_frame_header(tag, len(payload)) + payload)
                server.sent += len(payload)
            await trio.sleep_forever()  # the client ends the connection

    nursery.start_soon(partial(trio.serve_listeners, answer, [listener]))
    return server
