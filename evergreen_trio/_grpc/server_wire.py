"""Sans-IO gRPC server connection (HTTP/2 framing) for bidirectional methods with synchronous logic.

The picker answers one Envoy ext_proc stream per HTTP request, so per-stream cost is what
matters. This connection does only what a gRPC server needs: the preface, SETTINGS, PING,
WINDOW_UPDATE (both directions), HEADERS/CONTINUATION (HPACK decoded by ``hpack``), DATA,
RST_STREAM and GOAWAY. Each stream's :class:`StreamProcessor` is called synchronously; every
reply produced while handling one chunk of input is queued, and the caller writes them all with
one :meth:`GrpcWireConnection.data_to_send` (a loopback write wakes the peer, and costs more than
encoding a small reply). Response header blocks use only the HPACK static table and literals, so
no encoder state is kept.

Bad input never raises: a connection error queues GOAWAY and sets ``closed``; a stream error
resets the stream or ends it with a gRPC status. Cost is bounded for a hostile peer
(:class:`WireLimits`): flow-control credit is returned only for input that was consumed, input
buffered plus replies pending per connection are capped, header blocks are capped in bytes and
frames, untrusted input is never echoed beyond a short sanitized prefix, window changes walk
only the streams blocked on them, one call queues a bounded amount of output (the rest of the
input waits for :meth:`GrpcWireConnection.resume`), and a peer that resets, gets refused or
fails streams faster than a budget gets GOAWAY ENHANCE_YOUR_CALM.
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any, Generic, Protocol, TypeVar

from google.protobuf.message import DecodeError, Message
from grpclib.const import Status

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.http2 import (
    ACK,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_FRAME_SIZE_SETTING,
    MAX_STREAM_ID,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    HeaderDecoder,
    ProtocolViolation,
    frame,
    goaway_frame,
    header_frames,
    hpack_int,
    literal,
    settings_entries,
    settings_frame,
    unpad,
)
from evergreen_trio.limits import check_limits

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
ReqIn = TypeVar("ReqIn", bound=Message, contravariant=True)
RepOut = TypeVar("RepOut", bound=Message, covariant=True)

MAX_ECHOED_CHARS = 64  # of untrusted input (a request path) in a grpc-message
MAX_STATUS_MESSAGE_CHARS = 512  # of a processor's status message, before percent-encoding
GOAWAY_PING = b"goaway\x00\x00"  # the opaque data of go_away's PING, whose ACK sends the final GOAWAY


@dataclass(frozen=True)
class WireLimits:
    """Per-connection limits (advertised in SETTINGS where HTTP/2 has a setting for them).

    ``max_message_bytes`` fits ext_proc: the largest buffered request body
    (``ExtProcConfig.max_request_body_bytes``, 16 MiB) plus 64 KiB for headers and framing.
    A reply longer than ``max_send_message_bytes`` is not sent: its stream ends RESOURCE_EXHAUSTED
    instead (grpc-go's ``MaxSendMsgSize``; its default, 2**31 - 1, is the gRPC length prefix's limit).
    ``window_bytes`` is both the stream and the connection window; stream credit is returned only
    for consumed input. ``max_buffered_bytes`` caps input buffered in partial messages plus
    replies waiting for the peer's window: past it the connection window is not returned.
    ``slice_bytes`` bounds the input one :meth:`GrpcWireConnection.receive_data` processes, and
    the output it queues, before it pauses (so the shell writes and lets other tasks run).
    ``max_stream_errors_per_second`` is the budget of streams reset by the peer, refused, or
    ended with a non-OK status; past it the connection gets GOAWAY ENHANCE_YOUR_CALM.
    ``streams_per_slice``: new streams one slice of input opens at most; the rest of the input waits
    for :meth:`GrpcWireConnection.resume`, so that a connection opening many streams in one write
    takes turns with the other connections (each stream may start a task).
    ``max_refused_streams``: streams of one connection refused (past ``max_concurrent_streams``, or
    by the method's admission: bad credentials) past which it gets GOAWAY ENHANCE_YOUR_CALM (a
    client that honours SETTINGS_MAX_CONCURRENT_STREAMS and holds good credentials sees few).
    ``max_connections`` is per server: the shell closes connections accepted beyond it.
    """

    max_connections: int = 1024
    max_concurrent_streams: int = 1024
    max_header_list_bytes: int = 64 * 1024
    max_message_bytes: int = 16 * 1024 * 1024 + 64 * 1024
    max_send_message_bytes: int = (1 << 31) - 1
    window_bytes: int = 16 * 1024 * 1024
    max_buffered_bytes: int = 48 * 1024 * 1024
    max_header_frames: int = 64
    slice_bytes: int = 64 * 1024
    max_stream_errors_per_second: int = 1000
    max_refused_streams: int = 1024
    streams_per_slice: int = 1024

    def __post_init__(self) -> None:
        """Raises ConfigurationError for a field that is not an int >= 1 (a window past 2**31 - 1)."""
        check_limits(self, maximum={"window_bytes": (1 << 31) - 1})


class StreamProcessor(Protocol[ReqIn, RepOut]):
    """Per-stream synchronous logic of a bidirectional method: messages in, replies out.

    Once ``finished`` is true after a message, its replies are sent with the OK trailers and
    the stream ends there: nothing more is delivered and ``on_end`` is not called. A processor
    may also define ``on_abort()``: it is called once when its stream ends any other way (reset
    by the peer, failed with a status, its connection closed or lost), so that what it holds
    (an in-flight count, a queue slot) is released on every path.

    A processor may park its stream (flow control: the request waits in a queue): ``parked``
    true after ``on_message`` stops delivery (further input stays buffered, unacknowledged). A
    processor that has an ``on_unpark`` attribute gets it set when its stream opens; it calls it
    once it has replies without a message to answer (the parked request's outcome, or flow
    control evicting a running request), and the connection's
    :meth:`GrpcWireConnection.resume_unparked` then sends ``resume()``'s replies and delivers the
    rest of the input (a call after the stream was answered does nothing).

    A *streaming* processor (``streaming`` true: a Trio task behind it produces replies at any
    time) gets ``wake`` set when its stream opens and calls it whenever it has replies, a final
    status, or room for input again; the connection then calls ``resume()`` (while the stream's
    unsent replies stay under a window's worth) and delivers input while ``parked`` is false.
    Its stream does not end with the client's input: ``on_end`` is called, and the stream ends
    once ``finished`` is true after a ``resume()`` (OK), or ``resume()`` raises
    :class:`RpcAbortError` (that status). ``on_closed(status)``, if defined, is called once the
    stream is gone from the connection, whichever way it ended, with the status it was answered
    (CANCELLED when it was reset, or its connection closed, before an answer).
    """

    @property
    def finished(self) -> bool: ...

    def on_message(self, message: ReqIn) -> Sequence[RepOut]: ...

    def on_end(self) -> Sequence[RepOut]: ...


class Call:
    """What a new stream's headers say: its path and, read when asked for, its metadata and
    ``grpc-timeout``; ``peer`` and ``peer_certificate`` are its connection's."""

    __slots__ = ("__dict__", "fields", "path", "peer", "peer_certificate")

    def __init__(self, path: str, fields: Mapping[bytes, bytes], peer: str = "",
                 peer_certificate: Mapping[str, Any] | None = None) -> None:
        self.path = path
        self.fields = fields
        self.peer = peer
        self.peer_certificate = peer_certificate

    @cached_property
    def metadata(self) -> dict[str, str]:
        """Custom metadata as grpclib reads it: pseudo-headers, ``grpc-*``, ``te``, ``content-type``,
        ``user-agent`` and binary (``-bin``) entries left out; keys are lower case on HTTP/2."""
        return {key.decode("latin-1"): value.decode("latin-1") for key, value in self.fields.items()
                if not key.startswith((b":", b"grpc-")) and key not in _NOT_METADATA and not key.endswith(b"-bin")}

    @cached_property
    def timeout(self) -> float | None:
        """Seconds from ``grpc-timeout`` (``None`` without one, or when it is not a valid timeout)."""
        value = self.fields.get(b"grpc-timeout", b"")
        if not 2 <= len(value) <= 9 or not value[:-1].isdigit():
            return None
        unit = _TIMEOUT_UNITS.get(value[-1:])
        return None if unit is None else int(value[:-1]) * unit


_NOT_METADATA = frozenset({b"te", b"content-type", b"user-agent"})
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


@dataclass(frozen=True)
class SyncBidiMethod(Generic[Req, Rep]):
    """A bidirectional-streaming method served by a plain synchronous :class:`StreamProcessor`."""

    path: str
    request_type: type[Req]
    new_processor: Callable[[], StreamProcessor[Req, Rep]]

    def open(self, call: Call) -> StreamProcessor[Req, Rep]:
        """A processor for a new stream (any method's ``open`` may raise :class:`RpcAbortError` to
        answer the stream with that status and start nothing)."""
        return self.new_processor()


class Method(Protocol):
    """What the connection serves at a path: a :class:`SyncBidiMethod`, or a method of the shell's."""

    @property
    def path(self) -> str: ...

    @property
    def request_type(self) -> type[Message]: ...

    def open(self, call: Call) -> StreamProcessor[Any, Any]: ...


def refusal(message: str) -> bytes:
    """What a server sends a connection it will not serve (past its connection cap): an empty
    SETTINGS (its preface) and GOAWAY ENHANCE_YOUR_CALM with last stream 0, so the client knows
    no request was processed and backs off before it retries."""
    return frame(SETTINGS, 0, 0) + goaway_frame(0, ENHANCE_YOUR_CALM, message)


def _percent_encode(message: str) -> str:
    """gRPC's grpc-message encoding: UTF-8, bytes outside printable ASCII and '%' as %XX."""
    return "".join(chr(b) if 0x20 <= b <= 0x7E and b != 0x25 else f"%{b:02X}" for b in message.encode())


def _sanitize(untrusted: bytes) -> str:
    """At most :data:`MAX_ECHOED_CHARS` of ``untrusted``, printable ASCII only, for an error message."""
    head = untrusted[:MAX_ECHOED_CHARS]
    shown = "".join(chr(b) if 0x21 <= b <= 0x7E else "?" for b in head)
    return shown + ("..." if len(untrusted) > MAX_ECHOED_CHARS else "")


# ":status: 200" is static entry 8; content-type is static name 31.
_RESPONSE_HEADERS = b"\x88" + hpack_int(31, 4) + hpack_int(16, 7) + b"application/grpc"
_OK_TRAILERS = literal("grpc-status", "0")
_HTTP_415 = b"\x00" + hpack_int(len(b":status"), 7) + b":status" + hpack_int(3, 7) + b"415"


def _status_block(status: Status, message: str | None) -> bytes:
    block = literal("grpc-status", str(status.value))
    if message:
        block += literal("grpc-message", _percent_encode(message[:MAX_STATUS_MESSAGE_CHARS]))
    return block


class _Stream:
    __slots__ = (
        "completed",
        "credit",
        "end_delivered",
        "headers_sent",
        "id",
        "inbound",
        "method",
        "parked",
        "pending",
        "processor",
        "remote_closed",
        "starved",
        "status",
        "streaming",
        "trailers",
        "unacked",
        "woken",
    )

    def __init__(self, stream_id: int, method: Method | None,
                 processor: StreamProcessor[Any, Any] | None = None) -> None:
        self.id = stream_id
        self.method = method
        self.processor = processor
        self.streaming: bool = getattr(processor, "streaming", False)
        self.end_delivered = False  # on_end was called
        self.woken = False  # queued for resume_unparked
        self.starved = False  # a streaming processor woke while a window's worth of replies waited
        self.inbound = bytearray()
        # Send window relative to the peer's SETTINGS_INITIAL_WINDOW_SIZE, so that a change of the
        # setting costs nothing per stream: window = initial + credit.
        self.credit = 0
        self.pending = bytearray()  # framed gRPC messages not yet sent (flow control)
        self.trailers: bytes | None = None  # header block to send once ``pending`` is out
        self.status: Status | None = None  # what ``trailers`` says
        self.headers_sent = False
        self.remote_closed = False
        self.unacked = 0  # bytes received since the last stream WINDOW_UPDATE
        self.completed = False  # the processor finished or had on_end: no on_abort
        self.parked = False  # the processor waits (flow control): nothing is delivered


_FrameHandler = Callable[["GrpcWireConnection", int, int, bytes], None]
# A frame header read in one call: length (24 bits, as 8 + 16), type, flags, stream id (with its reserved bit).
_FRAME_HEADER = struct.Struct(">BHBBI")
_MESSAGE_PREFIX = struct.Struct(">BI")  # a gRPC message's compressed flag and length


class GrpcWireConnection:
    """One server-side HTTP/2 connection serving :class:`SyncBidiMethod` s by path.

    Feed received bytes to :meth:`receive_data`, write :meth:`data_to_send` to the socket, and
    while ``paused`` call :meth:`resume` (then write again); once ``closed`` is true, write what
    is left and close the socket. ``clock`` (seconds) paces the stream-error budget.
    """

    def __init__(self, methods: Mapping[str, Method], limits: WireLimits | None = None,
                 clock: Callable[[], float] = time.monotonic, *, peer: str = "",
                 peer_certificate: Mapping[str, Any] | None = None) -> None:
        self.methods = methods
        self.limits = limits or WireLimits()
        self.peer = peer
        self.peer_certificate = peer_certificate
        self.closed = False
        self.paused = False
        self._clock = clock
        self._buffer = bytearray()
        self._preface_seen = False
        self._settings_seen = False
        self._out = bytearray()
        self._streams: dict[int, _Stream] = {}
        # Streams with replies waiting for window: on their own window, or on the connection's.
        self._blocked_on_stream: dict[int, _Stream] = {}
        self._blocked_on_connection: dict[int, _Stream] = {}
        # Inbound partial messages + pending replies of synchronous processors, over all streams. A
        # streaming processor's replies are bounded by its own stream (see resume_unparked) and do
        # not hold back input: a client that sends all its input before reading would deadlock.
        self._buffered = 0
        self._credit_high = 0  # an upper bound of every open stream's credit
        self._last_stream_id = 0
        self._decoder = HeaderDecoder(self.limits.max_header_list_bytes)
        self._header_block: bytearray | None = None  # an unfinished HEADERS + CONTINUATION block
        self._header_stream = 0
        self._header_flags = 0
        self._header_frame_count = 0
        self._send_window = DEFAULT_WINDOW
        self._peer_stream_window = DEFAULT_WINDOW
        self._peer_frame_size = DEFAULT_FRAME_SIZE
        self._unacked = 0
        self._unparked: list[int] = []  # parked streams whose processor has its replies
        self._peer_gone = False  # the client sent GOAWAY
        self._going_away = False  # this side sent a graceful GOAWAY (go_away): streams above it are not taken
        self._goaway_message: str | None = None  # go_away's first GOAWAY is out; the final one waits
        self._ignored_id = 0  # the highest stream id opened after either GOAWAY, not taken: its frames are dropped
        # Called when a parked stream becomes ready: the shell then calls resume_unparked and writes.
        self.on_wake: Callable[[], object] = lambda: None
        self._strikes = 0
        self._refusals = 0
        self._opened = 0  # streams opened in this slice of input
        self._strike_second = 0
        window = self.limits.window_bytes
        self._out += settings_frame((SETTINGS_MAX_CONCURRENT_STREAMS, self.limits.max_concurrent_streams),
                                    (SETTINGS_INITIAL_WINDOW_SIZE, window),
                                    (SETTINGS_MAX_HEADER_LIST_SIZE, self.limits.max_header_list_bytes))
        if window > DEFAULT_WINDOW:
            self._out += frame(WINDOW_UPDATE, 0, 0, (window - DEFAULT_WINDOW).to_bytes(4, "big"))

    @property
    def handshake_complete(self) -> bool:
        """Whether the client's preface and first SETTINGS frame have arrived."""
        return self._settings_seen

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def has_output(self) -> bool:
        """Whether :meth:`data_to_send` has bytes."""
        return bool(self._out)

    def data_to_send(self) -> bytes:
        out = bytes(self._out)
        self._out.clear()
        return out

    def receive_data(self, data: bytes | bytearray) -> None:
        """Process received bytes; replies, acknowledgements and errors go to :meth:`data_to_send`.

        Stops early, with ``paused`` true, once :attr:`WireLimits.slice_bytes` of input were
        processed or of output queued; the rest of the input is kept for :meth:`resume`.
        """
        if self.closed:
            return
        self._buffer += data
        try:
            self._process()
        except ProtocolViolation as exc:
            hint = " (a TLS client on a plaintext port?)" if not self._preface_seen and data[:2] == b"\x16\x03" else ""
            self._fail(exc, hint)

    def _fail(self, exc: ProtocolViolation, hint: str = "") -> None:
        log.info("grpc_wire.protocol_error peer=%s code=%d error=%s%s", self.peer or "?", exc.code, exc, hint)
        self._goaway(exc.code, str(exc))

    def resume(self) -> None:
        """Go on with input left by a paused :meth:`receive_data` (call after writing its output)."""
        self.receive_data(b"")

    def close(self, message: str) -> None:
        """Queue GOAWAY NO_ERROR (the shell's timeouts and shutdown) and mark the connection closed."""
        if not self.closed:
            self._goaway(NO_ERROR, message)

    def go_away(self, message: str, *, two_steps: bool = False) -> None:
        """A graceful shutdown: GOAWAY NO_ERROR naming the last stream taken. Open streams go on to
        their end; streams the client opens after it are not taken (their frames are dropped; the
        client knows it may send them again elsewhere); the connection is closed when the last open
        stream ends.

        ``two_steps``, as RFC 9113 (section 6.8), grpc-go and grpc-core do it: first GOAWAY naming
        2^31-1, and a PING. The client opens no stream once it has read them, and its PING ACK
        comes after every stream it opened before, each taken; the ACK (or the shell, calling
        :meth:`finish_going_away`) sends the final GOAWAY. For a server that serves what it takes;
        one that would refuse those streams anyway does better to leave them to be sent elsewhere.
        """
        if self.closed or self._going_away or self._goaway_message is not None:
            return
        self._goaway_message = message
        if not two_steps:
            self.finish_going_away()
            return
        self._out += goaway_frame(MAX_STREAM_ID, NO_ERROR, message)
        self._out += frame(PING, 0, 0, GOAWAY_PING)

    def finish_going_away(self) -> None:
        """The final GOAWAY of a two-step :meth:`go_away`, sent on the PING ACK; the shell calls it
        when the ACK is late (a client that does not answer PINGs keeps no connection open)."""
        message = self._goaway_message
        if message is None or self.closed or self._going_away:
            return
        if not self._streams:
            self._goaway(NO_ERROR, message)
            return
        self._going_away = True
        self._out += goaway_frame(self._last_stream_id, NO_ERROR, message)

    @property
    def has_unparked(self) -> bool:
        """Whether :meth:`resume_unparked` has work."""
        return bool(self._unparked)

    def resume_unparked(self) -> None:
        """Send the replies of the streams that woke (parked, streaming, or evicted), and deliver their
        buffered input."""
        ready, self._unparked = self._unparked, []
        try:
            for stream_id in ready:
                stream = self._streams.get(stream_id)
                if stream is None or self.closed:
                    continue  # reset or aborted meanwhile
                stream.woken = False
                if stream.streaming:
                    if len(stream.pending) >= self.limits.window_bytes:
                        stream.starved = True  # _flush wakes it once the peer took some
                        continue
                elif stream.trailers is not None:
                    continue  # answered meanwhile: nothing more is sent
                stream.parked = False
                self._deliver(stream, end=stream.remote_closed, resumed=True)
        except ProtocolViolation as exc:  # past the stream-error budget
            self._fail(exc)

    def _unpark(self, stream_id: int) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.woken:
            return
        stream.woken = True
        self._unparked.append(stream_id)
        self.on_wake()

    def ping(self) -> None:
        """Queue a PING (keepalive: the shell counts any input that follows as the peer's answer)."""
        if not self.closed:
            self._out += frame(PING, 0, 0, b"keepaliv")

    def abort_streams(self) -> None:
        """Tell every open stream's processor its stream is gone (the shell calls this when the
        connection ends, so nothing a processor holds outlives it)."""
        streams = list(self._streams.values())
        self._streams.clear()
        for stream in streams:
            _abort(stream)

    def _goaway(self, code: int, message: str) -> None:
        self._out += goaway_frame(self._last_stream_id, code, message)
        self.abort_streams()
        self._blocked_on_stream.clear()
        self._blocked_on_connection.clear()
        self._buffer.clear()
        self._buffered = 0
        self.closed = True
        self.paused = False

    def _process(self) -> None:
        buffer = self._buffer
        self.paused = False
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    raise ProtocolViolation(PROTOCOL_ERROR, "expected the HTTP/2 client preface")
                return
            if buffer[: len(PREFACE)] != PREFACE:
                raise ProtocolViolation(PROTOCOL_ERROR, "expected the HTTP/2 client preface")
            del buffer[: len(PREFACE)]
            self._preface_seen = True
        pos = 0
        size = len(buffer)
        budget = self.limits.slice_bytes
        self._opened = 0
        try:
            while size - pos >= 9 and not self.closed:
                if len(self._out) >= budget or pos >= budget:
                    self.paused = True
                    break
                high, low, kind, flags, stream_id = _FRAME_HEADER.unpack_from(buffer, pos)
                length = high << 16 | low
                if length > DEFAULT_FRAME_SIZE:
                    raise ProtocolViolation(FRAME_SIZE_ERROR, f"expected frames of at most {DEFAULT_FRAME_SIZE} "
                                                             f"bytes, got {length}")
                if size - pos < 9 + length:
                    break
                if kind == HEADERS and self._opened >= self.limits.streams_per_slice:
                    self.paused = True  # before a HEADERS: the slice still takes the RST_STREAMs of its streams
                    break
                stream_id &= 0x7FFFFFFF
                payload = bytes(buffer[pos + 9 : pos + 9 + length])
                pos += 9 + length
                self._on_frame(kind, flags, stream_id, payload)
        finally:
            del buffer[:pos]
        self._replenish_connection()

    def _replenish_connection(self) -> None:
        """Return connection window unless input and replies buffered reach the cap (backpressure)."""
        window = self.limits.window_bytes
        if self._unacked >= window // 2 and self._buffered + window <= max(self.limits.max_buffered_bytes, window):
            self._out += frame(WINDOW_UPDATE, 0, 0, self._unacked.to_bytes(4, "big"))
            self._unacked = 0

    def _replenish_stream(self, stream: _Stream) -> None:
        """Return stream window for consumed input (all of it while one partial message needs more)."""
        window = self.limits.window_bytes
        # Both reasons to return credit below need at least half a window unacknowledged. Replies
        # piling up hold back a synchronous processor's input (not a streaming one's: see _buffered).
        if stream.unacked < window // 2 or stream.remote_closed:
            return
        if len(stream.pending) > window and not stream.streaming:
            return
        inbound = stream.inbound
        needed = 5 + int.from_bytes(inbound[1:5], "big") if len(inbound) >= 5 else 0
        consumed = stream.unacked if needed > window else max(0, stream.unacked - len(inbound))
        # Half a window at a time, or sooner when the peer is (nearly) out of credit.
        if consumed and (consumed >= window // 2 or window - stream.unacked < window // 2):
            self._out += frame(WINDOW_UPDATE, 0, stream.id, consumed.to_bytes(4, "big"))
            stream.unacked -= consumed

    def _strike(self, what: str) -> None:
        """Count a reset, refused or failed stream against the per-second budget."""
        second = int(self._clock())
        if second != self._strike_second:
            self._strike_second, self._strikes = second, 0
        self._strikes += 1
        if self._strikes > self.limits.max_stream_errors_per_second:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"more than {self.limits.max_stream_errors_per_second} "
                                                      f"streams reset, refused or failed in a second (last: {what})")

    def _refused(self, what: str) -> None:
        """Count a refused stream: against the per-second budget, and against ``max_refused_streams``."""
        self._refusals += 1
        if self._refusals > self.limits.max_refused_streams:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"more than {self.limits.max_refused_streams} streams "
                                                      f"refused (last: {what})")
        self._strike(what)

    # -- frames ---------------------------------------------------------------------------------

    def _on_frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            raise ProtocolViolation(PROTOCOL_ERROR, f"expected CONTINUATION, got frame type {kind}")
        if not self._settings_seen and (kind != SETTINGS or flags & ACK):
            raise ProtocolViolation(PROTOCOL_ERROR, f"expected SETTINGS after the preface, got frame type {kind}")
        handler = _HANDLERS.get(kind)
        if handler is not None:  # unknown frame types are ignored (RFC 9113 section 4.1)
            handler(self, flags, stream_id, payload)

    def _ping(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id or len(payload) != 8:
            raise ProtocolViolation(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR,
                                   "expected PING with 8 bytes on stream 0")
        if not flags & ACK:
            self._out += frame(PING, ACK, 0, payload)
        elif payload == GOAWAY_PING:
            self.finish_going_away()

    def _rst_stream(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or len(payload) != 4:
            raise ProtocolViolation(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR,
                                   "expected RST_STREAM with 4 bytes on a stream")
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._remove(stream)
            self._strike("RST_STREAM")
        elif stream_id > max(self._last_stream_id, self._ignored_id):
            raise ProtocolViolation(PROTOCOL_ERROR, f"expected RST_STREAM on a used stream, got idle {stream_id}")
        # A reset of a stream this side already answered costs nothing and is no strike: Envoy
        # resets every ext_proc stream the picker answered, one per request.

    def _priority(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or len(payload) != 5:
            raise ProtocolViolation(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR,
                                   "expected PRIORITY with 5 bytes on a stream")

    def _goaway_frame(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id or len(payload) < 8:
            raise ProtocolViolation(PROTOCOL_ERROR, "expected GOAWAY with at least 8 bytes on stream 0")
        # The client opens no more streams: the connection closes once its open ones have ended.
        self._peer_gone = True
        if not self._streams:
            self._goaway(NO_ERROR, "the client sent GOAWAY")

    def _push_promise(self, flags: int, stream_id: int, payload: bytes) -> None:
        raise ProtocolViolation(PROTOCOL_ERROR, "expected no PUSH_PROMISE from a client")

    def _data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, "expected DATA on a stream, got stream 0")
        self._unacked += len(payload)
        if self._unacked > self.limits.window_bytes:
            raise ProtocolViolation(FLOW_CONTROL_ERROR, "peer sent past the connection window")
        data = unpad(flags, payload)
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id > max(self._last_stream_id, self._ignored_id):
                raise ProtocolViolation(PROTOCOL_ERROR, f"expected DATA on an open stream, got idle stream {stream_id}")
            return  # a stream this side already ended, reset, or did not take
        if stream.remote_closed:
            self._reset(stream, STREAM_CLOSED)
            return
        stream.unacked += len(payload)
        if stream.unacked > self.limits.window_bytes:
            self._reset(stream, FLOW_CONTROL_ERROR)
            return
        if stream.trailers is None:  # an answered stream's further input is dropped, not buffered
            stream.inbound += data
            self._buffered += len(data)
        self._deliver(stream, end=bool(flags & END_STREAM))

    def _headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, "expected HEADERS on a stream, got stream 0")
        block = unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "expected a 5-byte priority in HEADERS")
            block = block[5:]
        self._header_block = bytearray(block)
        self._header_stream, self._header_flags = stream_id, flags
        self._header_frame_count = 1
        if flags & END_HEADERS:
            self._end_headers()

    def _continuation(self, flags: int, stream_id: int, payload: bytes) -> None:
        if self._header_block is None or stream_id != self._header_stream:
            raise ProtocolViolation(PROTOCOL_ERROR, "expected CONTINUATION only right after HEADERS of its stream")
        self._header_frame_count += 1
        if self._header_frame_count > self.limits.max_header_frames:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"expected a header block in at most "
                                                      f"{self.limits.max_header_frames} frames")
        self._header_block += payload
        if len(self._header_block) > self.limits.max_header_list_bytes:
            raise ProtocolViolation(PROTOCOL_ERROR, f"expected a header block of at most "
                                                   f"{self.limits.max_header_list_bytes} bytes")
        if flags & END_HEADERS:
            self._end_headers()

    def _end_headers(self) -> None:
        assert self._header_block is not None
        block, stream_id, flags = bytes(self._header_block), self._header_stream, self._header_flags
        self._header_block = None
        fields = self._decoder.decode(block)  # always decoded: HPACK state is per connection
        stream = self._streams.get(stream_id)
        if stream is not None:  # trailers from the client
            if not flags & END_STREAM:
                self._reset(stream, PROTOCOL_ERROR)
                return
            self._deliver(stream, end=True)
            return
        if stream_id <= self._last_stream_id:
            return  # a stream this side already ended
        if stream_id % 2 == 0:
            raise ProtocolViolation(PROTOCOL_ERROR, f"expected an odd client stream id, got {stream_id}")
        if self._peer_gone or self._going_away:
            # Opened after the client's GOAWAY (no stream to be answered on) or after ours (above its
            # last stream id: the client knows it was not taken). Its later frames are dropped too.
            self._ignored_id = max(self._ignored_id, stream_id)
            return
        self._last_stream_id = stream_id
        if len(self._streams) >= self.limits.max_concurrent_streams:
            self._out += frame(RST_STREAM, 0, stream_id, REFUSED_STREAM.to_bytes(4, "big"))
            self._refused("refused stream")
            return
        if fields.get(b":method") != b"POST" or not fields.get(b"content-type", b"").startswith(b"application/grpc"):
            self._out += frame(HEADERS, END_HEADERS | END_STREAM, stream_id, _HTTP_415)
            self._out += frame(RST_STREAM, 0, stream_id, NO_ERROR.to_bytes(4, "big"))
            self._strike("not a gRPC request")
            return
        raw_path = fields.get(b":path", b"")
        path = raw_path.decode("latin-1")
        method = self.methods.get(path)
        if method is None:
            self._answer(stream_id, flags, Status.UNIMPLEMENTED, f"method {_sanitize(raw_path)} not found")
            self._strike("unknown method")
            return
        try:
            processor = method.open(Call(path, fields, self.peer, self.peer_certificate))
        except RpcAbortError as refused:  # the method's admission: refused before anything started
            self._answer(stream_id, flags, refused.status, refused.message)
            self._refused("stream not admitted")
            return
        except Exception as exc:  # a method's bug must not take the connection down
            log.exception("grpc_wire.open_failed path=%s", path)
            self._answer(stream_id, flags, Status.UNKNOWN, type(exc).__name__)
            self._strike("stream failed to open")
            return
        stream = _Stream(stream_id, method, processor)
        self._streams[stream_id] = stream
        self._opened += 1
        if stream.streaming:
            processor.wake = partial(self._unpark, stream_id)  # type: ignore[attr-defined]
        elif hasattr(processor, "on_unpark"):
            processor.on_unpark = partial(self._unpark, stream_id)
        if flags & END_STREAM:
            self._deliver(stream, end=True)

    def _answer(self, stream_id: int, flags: int, status: Status, message: str) -> None:
        """End a stream that never opened with a trailers-only ``status``."""
        stream = _Stream(stream_id, None)
        stream.trailers = _status_block(status, message)
        stream.remote_closed = bool(flags & END_STREAM)
        self._flush(stream)

    def _settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, "expected SETTINGS on stream 0")
        if flags & ACK:
            if payload:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "expected an empty SETTINGS ACK")
            return
        entries = settings_entries(payload)
        self._settings_seen = True
        grew = False
        for key, value in entries:
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, f"expected an initial window <= {MAX_WINDOW}")
                if value + self._credit_high > MAX_WINDOW:
                    # Rare: tighten the bound to the open streams' real credits before deciding.
                    self._credit_high = max((s.credit for s in self._streams.values()), default=0)
                    if value + self._credit_high > MAX_WINDOW:
                        raise ProtocolViolation(FLOW_CONTROL_ERROR, "initial window change overflows a stream window "
                                                                   "past 2^31-1 (RFC 9113 section 6.9.2)")
                grew |= value > self._peer_stream_window
                self._peer_stream_window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE_SETTING:
                    raise ProtocolViolation(PROTOCOL_ERROR,
                                            f"expected a max frame size in 16384..16777215, got {value}")
                self._peer_frame_size = value
        self._out += frame(SETTINGS, ACK, 0)
        if grew:  # only a larger stream window can unblock a stream
            self._flush_blocked(self._blocked_on_stream)
        self._replenish_connection()

    def _window_update(self, flags: int, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "expected a 4-byte WINDOW_UPDATE")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not stream_id:
            if not increment or self._send_window + increment > MAX_WINDOW:
                raise ProtocolViolation(FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR,
                                       "expected a connection window increment in 1..2^31-1 in total")
            self._send_window += increment
            self._flush_blocked(self._blocked_on_connection)
            self._replenish_connection()
            return
        stream = self._streams.get(stream_id)
        if stream is None:
            return
        if not increment or self._peer_stream_window + stream.credit + increment > MAX_WINDOW:
            self._reset(stream, FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR)
            return
        stream.credit += increment
        self._credit_high = max(self._credit_high, stream.credit)
        self._flush(stream)

    # -- gRPC -----------------------------------------------------------------------------------

    def _deliver(self, stream: _Stream, *, end: bool, resumed: bool = False) -> None:
        """Hand complete messages to the processor; queue its replies (and trailers when done).

        ``resumed``: the stream woke (see :meth:`resume_unparked`): ``resume()``'s replies go first.
        """
        processor, method = stream.processor, stream.method
        assert processor is not None and method is not None
        inbound = stream.inbound
        before = len(inbound)
        failed = False
        try:
            replies: list[Message] = []
            if resumed:
                replies.extend(processor.resume())  # type: ignore[attr-defined]
                if processor.finished:
                    stream.trailers, stream.status = _OK_TRAILERS, Status.OK
                    stream.completed = True
                elif stream.streaming:
                    stream.parked = getattr(processor, "parked", False)
            while len(inbound) >= 5 and stream.trailers is None and not stream.parked:
                compressed, size = _MESSAGE_PREFIX.unpack_from(inbound)
                if compressed != 0:
                    raise RpcAbortError(Status.UNIMPLEMENTED, "expected uncompressed messages")
                if size > self.limits.max_message_bytes:
                    raise RpcAbortError(Status.RESOURCE_EXHAUSTED,
                                    f"message of {size} bytes exceeds the limit of {self.limits.max_message_bytes}")
                if len(inbound) < 5 + size:
                    break
                with memoryview(inbound) as view:  # one copy (slicing the bytearray would make two)
                    encoded = bytes(view[5 : 5 + size])
                del inbound[: 5 + size]
                try:  # from bytes, upb refers to the input rather than copying large fields again
                    message = method.request_type.FromString(encoded)
                except DecodeError:
                    raise RpcAbortError(
                        Status.INTERNAL, f"could not decode a {method.request_type.__name__}"
                    ) from None
                replies.extend(processor.on_message(message))
                if processor.finished:
                    stream.trailers, stream.status = _OK_TRAILERS, Status.OK
                    stream.completed = True
                elif getattr(processor, "parked", False):
                    stream.parked = True
            if end and stream.trailers is None and not stream.parked and not stream.end_delivered:
                stream.remote_closed = stream.end_delivered = True
                if inbound:
                    raise RpcAbortError(Status.INTERNAL, "stream ended inside a message")
                replies.extend(processor.on_end())
                if not stream.streaming:
                    stream.completed = True
                    stream.trailers, stream.status = _OK_TRAILERS, Status.OK
        except RpcAbortError as exc:
            stream.trailers, stream.status = _status_block(exc.status, exc.message), exc.status
            failed = True
        except Exception as exc:  # a processor bug must not take the connection down
            log.exception("grpc_wire.processor_failed path=%s", method.path)
            stream.trailers, stream.status = _status_block(Status.UNKNOWN, type(exc).__name__), Status.UNKNOWN
            failed = True
        outgoing: list[bytes] = []
        for reply in replies:
            data = reply.SerializeToString()
            if len(data) > self.limits.max_send_message_bytes:  # as grpc-go's MaxSendMsgSize answers
                stream.status = Status.RESOURCE_EXHAUSTED
                stream.trailers = _status_block(stream.status, f"trying to send message larger than "
                                                f"max ({len(data)} vs. {self.limits.max_send_message_bytes})")
                failed = True
                break
            outgoing.append(data)
        if stream.trailers is not None and inbound:
            inbound.clear()  # input after the answer is never read
        if before:
            self._buffered -= before - len(inbound)
        pending = len(stream.pending)
        for data in outgoing:
            stream.pending += b"\x00" + len(data).to_bytes(4, "big") + data
        if not stream.streaming:
            self._buffered += len(stream.pending) - pending
        if end:
            stream.remote_closed = True
        self._flush(stream)
        if failed:
            self._strike("failed stream")

    def _flush(self, stream: _Stream) -> None:
        """Queue what flow control allows of ``stream``'s replies, then its trailers."""
        out = self._out
        if stream.pending and not stream.headers_sent:
            out += frame(HEADERS, END_HEADERS, stream.id, _RESPONSE_HEADERS)
            stream.headers_sent = True
        pending = stream.pending
        while pending:
            size = min(len(pending), self._peer_stream_window + stream.credit, self._send_window,
                       self._peer_frame_size)
            if size <= 0:
                break
            out += frame(DATA, 0, stream.id, pending[:size])
            del pending[:size]
            if not stream.streaming:
                self._buffered -= size
            stream.credit -= size
            self._send_window -= size
        self._unblock(stream)
        if pending:
            blocked = self._blocked_on_connection if self._send_window <= 0 else self._blocked_on_stream
            blocked[stream.id] = stream
        if stream.starved and len(pending) < self.limits.window_bytes:
            stream.starved = False
            self._unpark(stream.id)
        if pending or stream.trailers is None:
            self._replenish_stream(stream)
            return
        block = stream.trailers if stream.headers_sent else _RESPONSE_HEADERS + stream.trailers
        out += header_frames(stream.id, END_STREAM, block, self._peer_frame_size)
        if not stream.remote_closed:
            # Tell the client to stop sending on a stream whose answer is complete.
            out += frame(RST_STREAM, 0, stream.id, NO_ERROR.to_bytes(4, "big"))
        self._remove(stream)

    def _flush_blocked(self, blocked: dict[int, _Stream]) -> None:
        """Flush the streams of one blocked set, until the connection window runs out."""
        for stream in list(blocked.values()):
            if self._send_window <= 0:
                if blocked is self._blocked_on_stream:  # their own windows may have grown: now the connection's
                    self._blocked_on_connection.update(blocked)
                    blocked.clear()
                return
            self._flush(stream)

    def _reset(self, stream: _Stream, code: int) -> None:
        self._out += frame(RST_STREAM, 0, stream.id, code.to_bytes(4, "big"))
        self._remove(stream)
        self._strike(f"stream reset with code {code}")

    def _unblock(self, stream: _Stream) -> None:
        if self._blocked_on_stream:  # usually empty: skip the lookups
            self._blocked_on_stream.pop(stream.id, None)
        if self._blocked_on_connection:
            self._blocked_on_connection.pop(stream.id, None)

    def _remove(self, stream: _Stream) -> None:
        self._streams.pop(stream.id, None)
        _abort(stream)
        if (self._peer_gone or self._going_away) and not self._streams and not self.closed:
            self._goaway(NO_ERROR, "the client sent GOAWAY" if self._peer_gone else "the last stream ended")
        self._unblock(stream)
        if stream.inbound or stream.pending:
            self._buffered -= len(stream.inbound) + (0 if stream.streaming else len(stream.pending))
            stream.inbound.clear()
            stream.pending.clear()


def _abort(stream: _Stream) -> None:
    """Call the processor's ``on_abort`` once, unless its stream completed, then its ``on_closed``
    with the stream's status; a failure is logged."""
    processor = stream.processor
    if processor is None:
        return
    stream.processor = None
    calls = (("on_abort", ()), ("on_closed", (stream.status or Status.CANCELLED,)))
    for hook, args in calls if not stream.completed else calls[1:]:
        callback = getattr(processor, hook, None)
        if callback is not None:
            try:
                callback(*args)
            except Exception:  # a processor bug must not take the connection down
                log.exception("grpc_wire.%s_failed path=%s", hook, stream.method.path if stream.method else "?")
    stream.completed = True


_HANDLERS: dict[int, _FrameHandler] = {
    DATA: GrpcWireConnection._data,
    HEADERS: GrpcWireConnection._headers,
    PRIORITY: GrpcWireConnection._priority,
    RST_STREAM: GrpcWireConnection._rst_stream,
    SETTINGS: GrpcWireConnection._settings,
    PUSH_PROMISE: GrpcWireConnection._push_promise,
    PING: GrpcWireConnection._ping,
    GOAWAY: GrpcWireConnection._goaway_frame,
    WINDOW_UPDATE: GrpcWireConnection._window_update,
    CONTINUATION: GrpcWireConnection._continuation,
}
