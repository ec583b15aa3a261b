"""The client end of gRPC over HTTP/2, sans-IO: bytes in, events and bytes out; no Trio, no sockets.

:class:`ClientConnection` speaks the HTTP/2 a gRPC client needs (as the server wire does, on the
frame numbers and HPACK pieces of :mod:`~evergreen_trio._grpc.http2`): request headers
(``grpc-timeout``, metadata), gRPC message framing both ways with a size limit checked on each
message's 5-byte prefix, the final status from trailers (a trailers-only response, an HTTP error
status, a reset, a GOAWAY or a broken connection each become a status too), outbound flow control
(data waits per stream for the peer's window) and inbound flow control that returns credit only for
input consumed: a complete message is held against the window until the caller says it was taken
(:meth:`ClientConnection.consumed`), so a server can make the client hold at most one window of
complete messages per connection, plus one partial message (at most ``max_message_bytes``) per
stream. Hostile input never raises: it ends streams, or the connection, with a status naming what
was wrong.

It replaced ``h2``'s state machine, which cost a fifth of a whole session's CPU (both ends, in
one process: 20.3% of the samples, against 8.0% for the server's wire doing the same work); see
docs/production.md.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

from grpclib.const import Status

from evergreen_trio._grpc.http2 import (
    ACK,
    CANCEL,
    CONTINUATION,
    DATA,
    DEFAULT_FRAME_SIZE,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    ERROR_NAMES,
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
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    HeaderDecoder,
    ProtocolViolation,
    goaway_frame,
    header_frames,
    indexed_name_literal,
    literal_bytes,
    settings_entries,
    settings_frame,
    unpad,
)
from evergreen_trio._grpc.http2 import frame as http2_frame

WINDOW_BYTES = 4 * 1024 * 1024
"""The client's inbound flow-control window, per stream and per connection (grpclib's client default)."""

MAX_HEADER_LIST_BYTES = 64 * 1024
"""Response headers or trailers larger than this (decoded) end the connection (advertised)."""

MAX_HEADER_FRAMES = 64
"""HEADERS + CONTINUATION frames of one header block, at most (the server wire's default too)."""


_HTTP_STATUS = {b"400": Status.INTERNAL, b"401": Status.UNAUTHENTICATED, b"403": Status.PERMISSION_DENIED,
                b"404": Status.UNIMPLEMENTED, b"429": Status.UNAVAILABLE, b"502": Status.UNAVAILABLE,
                b"503": Status.UNAVAILABLE, b"504": Status.UNAVAILABLE}
"""HTTP status -> gRPC status for a response that is not 200 (gRPC's http-grpc-status-mapping.md)."""

_RESET_STATUS = {REFUSED_STREAM: Status.UNAVAILABLE, CANCEL: Status.CANCELLED,
                 ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED, 0xC: Status.PERMISSION_DENIED}
"""RST_STREAM code -> gRPC status for a stream reset before its status (gRPC's PROTOCOL-HTTP2.md)."""


@dataclass(frozen=True, slots=True)
class MessageReceived:
    """One whole gRPC message (``body``, its prefix removed) on ``stream_id``; ``size`` counts its
    bytes on the wire, to give back with :meth:`ClientConnection.consumed` once taken."""

    stream_id: int
    body: bytes
    size: int


@dataclass(frozen=True, slots=True)
class StreamEnded:
    """``stream_id`` is over (nothing more arrives on it) with this final status. ``unprocessed``: the
    server said it did not process the call (REFUSED_STREAM before any response, or a GOAWAY whose
    last stream id is below it), so it may be sent again, on this connection or another."""

    stream_id: int
    status: Status
    message: str
    unprocessed: bool = False


Event = MessageReceived | StreamEnded


def encode_timeout(seconds: float) -> str:
    """``grpc-timeout``: at most 8 digits, rounded up, in the finest unit that fits."""
    for unit, scale in (("n", 1e9), ("u", 1e6), ("m", 1e3), ("S", 1.0), ("M", 1 / 60), ("H", 1 / 3600)):
        value = -int(-seconds * scale // 1)
        if value < 100_000_000:
            return f"{max(value, 1)}{unit}"
    return "99999999H"


def frame(body: bytes) -> bytes:
    """One uncompressed gRPC message: flag 0, 4-byte length, ``body``."""
    return b"\0" + len(body).to_bytes(4, "big") + body


class _Stream:
    """One stream's HTTP/2 state, framing and flow-control accounting."""

    __slots__ = ("acked", "buffer", "closed", "done", "end_sent", "ending", "final", "headers_seen", "held", "limit",
                 "out", "out_bytes", "received", "remote_closed", "unsent", "window")

    def __init__(self, limit: int, window: int) -> None:
        self.limit = limit
        self.buffer = bytearray()  # inbound bytes of a message not yet whole
        self.received = 0  # flow-controlled bytes received
        self.acked = 0  # ... of which credit was given back
        self.unsent = 0  # ... of which no WINDOW_UPDATE went out yet (sent in batches of half a window)
        self.held = 0  # ... in whole messages not yet consumed
        self.done = False  # its StreamEnded was given
        self.final: tuple[Status, str] | None = None  # from trailers (or a trailers-only response)
        self.out: deque[bytes] = deque()  # framed messages waiting for the peer's window
        self.out_bytes = 0
        self.window = window  # the server's credit for this stream's DATA
        self.ending = False  # end of stream asked for (sent once ``out`` is empty)
        self.end_sent = False
        self.headers_seen = False  # the response headers came: the next HEADERS are trailers
        self.remote_closed = False  # the server's END_STREAM (or a reset either way)
        self.closed = False  # both ends done, or reset: no longer counted against the server's stream limit


class ClientConnection:
    """One client HTTP/2 connection carrying gRPC calls, as a state machine.

    Call :meth:`initiate`, then send :meth:`data_to_send` whenever it has bytes, and feed every byte
    read to :meth:`receive`. ``settled`` turns true with the server's first SETTINGS; ``accepting``
    is false once no new stream may be opened (the server went away, ``went_away``, or the connection
    failed); ``closed`` once nothing more will arrive on it (``reason`` says why).
    """

    def __init__(self, authority: str, *, scheme: str = "http", window: int = WINDOW_BYTES) -> None:
        self._window = window
        # The request headers are ours (metadata checked by the shell's ClientOptions), in HPACK's static
        # table and literals: :method POST (3), :scheme (6 http, 7 https), then :path, then these.
        self._block_start = b"\x83" + (b"\x87" if scheme == "https" else b"\x86")
        self._block_rest = (indexed_name_literal(1, authority.encode()) + literal_bytes(b"te", b"trailers")
                            + indexed_name_literal(31, b"application/grpc"))
        self._streams: dict[int, _Stream] = {}
        self._out = bytearray()
        self._input = bytearray()  # a frame not yet whole
        self._framed = False  # the server's first frame was seen
        self._decoder = HeaderDecoder(MAX_HEADER_LIST_BYTES)
        self._header_block: bytearray | None = None  # an unfinished HEADERS + CONTINUATION block
        self._header_stream = self._header_flags = self._header_frames = 0
        self._next_stream_id = 1
        self._open = 0  # streams counted against the server's SETTINGS_MAX_CONCURRENT_STREAMS
        self._max_streams = MAX_STREAM_ID  # unlimited until the server's SETTINGS say otherwise
        self._peer_window = DEFAULT_WINDOW  # the server's SETTINGS_INITIAL_WINDOW_SIZE
        self._peer_frame_size = DEFAULT_FRAME_SIZE
        self._send_window = DEFAULT_WINDOW  # the server's credit for DATA on the connection
        self._receive_window = DEFAULT_WINDOW  # this side's credit for the server's DATA on the connection
        self._unsent = 0  # connection credit given back but not yet sent as WINDOW_UPDATE
        self.settled = False
        self.accepting = True
        self.closed = False
        self.went_away = False  # the server's GOAWAY (not a broken connection) stopped new streams
        self.reason = ""

    def initiate(self) -> None:
        """Queue the connection preface (with our SETTINGS and the connection window)."""
        self._out += PREFACE + settings_frame((SETTINGS_ENABLE_PUSH, 0), (SETTINGS_INITIAL_WINDOW_SIZE, self._window),
                                              (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST_BYTES))
        if self._window > DEFAULT_WINDOW:  # the connection's window starts at HTTP/2's default whatever SETTINGS say
            self._out += http2_frame(WINDOW_UPDATE, 0, 0, (self._window - DEFAULT_WINDOW).to_bytes(4, "big"))
            self._receive_window = self._window

    def data_to_send(self) -> bytes:
        """What must go out now (and is no longer held here)."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def room(self) -> bool:
        """Whether another stream fits in the server's SETTINGS_MAX_CONCURRENT_STREAMS now."""
        return self._open < self._max_streams

    # -- a call's outbound side --------------------------------------------------------------

    def start_stream(self, path: str, *, metadata: Mapping[str, str] | None = None, timeout: float | None = None,
                     max_message_bytes: int) -> int | None:
        """Open a call (its request headers queued); its id, or None when this connection has no stream id
        left (it no longer accepts). Check :attr:`accepting` and :meth:`room` first."""
        stream_id = self._next_stream_id
        if stream_id > MAX_STREAM_ID or self.closed:
            self.accepting = False
            return None
        self._next_stream_id += 2
        block = self._block_start + indexed_name_literal(4, path.encode()) + self._block_rest
        if timeout is not None:
            block += literal_bytes(b"grpc-timeout", encode_timeout(timeout).encode())
        for key, value in (metadata or {}).items():
            block += literal_bytes(key.lower().encode(), value.encode())
        self._out += header_frames(stream_id, 0, block, self._peer_frame_size)
        self._streams[stream_id] = _Stream(max_message_bytes, self._peer_window)
        self._open += 1
        return stream_id

    def send_message(self, stream_id: int, body: bytes) -> None:
        """Queue one message; it goes out as the peer's window allows (see :meth:`pending`). Dropped
        when the stream is over or half-closed."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.ending:
            return
        data = frame(body)
        stream.out.append(data)
        stream.out_bytes += len(data)
        self._send_queued(stream_id, stream)

    def pending(self, stream_id: int) -> int:
        """Bytes of ``stream_id``'s messages waiting for the peer's flow-control window."""
        stream = self._streams.get(stream_id)
        return 0 if stream is None else stream.out_bytes

    def end_stream(self, stream_id: int) -> None:
        """Half-close, once the queued messages are out."""
        stream = self._streams.get(stream_id)
        if stream is not None and not stream.ending:
            stream.ending = True
            self._send_queued(stream_id, stream)

    def reset_stream(self, stream_id: int, code: int = CANCEL) -> None:
        """RST_STREAM: the call is abandoned (its queued messages dropped)."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._reset(stream_id, stream, code)

    def release(self, stream_id: int) -> None:
        """Forget a finished call; the credit it still held goes back to the connection's window. A call
        the server ended before this side's end of stream went out is reset (else it would stay open,
        counted against the server's stream limit, for the connection's life)."""
        stream = self._streams.pop(stream_id, None)
        if stream is None or self.closed:
            return
        if stream.received > stream.acked:
            self._credit_connection(stream.received - stream.acked)
        self._reset(stream_id, stream, CANCEL)
        if not self.accepting:
            self._close_if_done()

    def consumed(self, stream_id: int, size: int) -> None:
        """``size`` bytes of whole messages (their :attr:`MessageReceived.size`) were taken: their
        credit may go back to the server."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.held -= size
            self._give_credit(stream_id, stream)

    def close(self, reason: str) -> None:
        """GOAWAY(NO_ERROR): this side is done with the connection."""
        if not self.closed:
            self._out += goaway_frame(0, NO_ERROR)
            self._end_all(Status.UNAVAILABLE, reason)

    # -- input --------------------------------------------------------------------------------

    def receive(self, data: bytes | bytearray) -> list[Event]:
        """Feed bytes read from the server; the events they complete. Never raises on bad input."""
        if self.closed:
            return []
        out: list[Event] = []
        self._input += data
        try:
            self._process(out)
        except ProtocolViolation as error:
            # GOAWAY naming the error; what this read held after the bad frame is lost with it.
            self._out += goaway_frame(0, error.code, str(error))
            out.extend(self._end_all(Status.UNAVAILABLE, f"the server broke the HTTP/2 protocol: {error}"))
        return out

    def connection_lost(self, why: str) -> list[Event]:
        """The transport ended (EOF, reset, TLS failure): every open call ends UNAVAILABLE."""
        if self.closed:
            return []
        return self._end_all(Status.UNAVAILABLE, why)

    # -- frames -------------------------------------------------------------------------------

    def _process(self, out: list[Event]) -> None:
        """Every whole frame of the input; a frame's length is checked on its header, before any of it is
        buffered (at most one frame is)."""
        buffer = self._input
        pos, size = 0, len(buffer)
        try:
            while size - pos >= 9 and not self.closed:
                length, kind = int.from_bytes(buffer[pos : pos + 3], "big"), buffer[pos + 3]
                if not self._framed:
                    self._framed = True
                    if kind != SETTINGS:
                        began = _text(bytes(buffer[pos : pos + 9]))
                        raise ProtocolViolation(PROTOCOL_ERROR, f"its first frame is not SETTINGS (it began {began!r})")
                if length > DEFAULT_FRAME_SIZE:
                    raise ProtocolViolation(FRAME_SIZE_ERROR, f"a frame of {length} bytes, over the "
                                                              f"{DEFAULT_FRAME_SIZE}-byte limit")
                if size - pos < 9 + length:
                    break
                flags = buffer[pos + 4]
                stream_id = int.from_bytes(buffer[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                payload = bytes(buffer[pos + 9 : pos + 9 + length])
                pos += 9 + length
                if self._header_block is not None and kind != CONTINUATION:
                    raise ProtocolViolation(PROTOCOL_ERROR, f"expected CONTINUATION, got frame type {kind}")
                handler = _HANDLERS.get(kind)
                if handler is not None:  # unknown frame types are ignored (RFC 9113 section 4.1)
                    handler(self, flags, stream_id, payload, out)
        finally:
            del buffer[:pos]

    def _idle(self, stream_id: int) -> bool:
        """A stream this side never opened (the server opens none: push is off)."""
        return stream_id % 2 == 0 or stream_id >= self._next_stream_id

    def _settings(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        grew = False
        for key, value in settings_entries(payload):
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolViolation(FLOW_CONTROL_ERROR, f"an initial window over {MAX_WINDOW}")
                delta = value - self._peer_window
                for stream in self._streams.values():
                    stream.window += delta
                    if stream.window > MAX_WINDOW:
                        raise ProtocolViolation(FLOW_CONTROL_ERROR, "an initial window change overflows a stream "
                                                                    "window past 2^31-1 (RFC 9113 section 6.9.2)")
                grew |= delta > 0
                self._peer_window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= MAX_FRAME_SIZE_SETTING:
                    raise ProtocolViolation(PROTOCOL_ERROR, f"a max frame size of {value}, not in 16384..16777215")
                self._peer_frame_size = value
            elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                self._max_streams = value
            elif key == SETTINGS_ENABLE_PUSH and value:
                raise ProtocolViolation(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value} from a server")
        self._out += http2_frame(SETTINGS, ACK, 0)
        self.settled = True
        if grew:
            self._send_all_queued()

    def _ping(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if stream_id or len(payload) != 8:
            raise ProtocolViolation(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR,
                                    "a PING not of 8 bytes on stream 0")
        if not flags & ACK:
            self._out += http2_frame(PING, ACK, 0, payload)

    def _window_update(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if len(payload) != 4:
            raise ProtocolViolation(FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not increment:
            raise ProtocolViolation(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
        if not stream_id:
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ProtocolViolation(FLOW_CONTROL_ERROR, "the connection window past 2^31-1")
            self._send_all_queued()
            return
        if self._idle(stream_id):
            raise ProtocolViolation(PROTOCOL_ERROR, f"a WINDOW_UPDATE on stream {stream_id}, never opened")
        stream = self._streams.get(stream_id)
        if stream is None or stream.closed:
            return
        stream.window += increment
        if stream.window > MAX_WINDOW:
            raise ProtocolViolation(FLOW_CONTROL_ERROR, f"the window of stream {stream_id} past 2^31-1")
        self._send_queued(stream_id, stream)

    def _rst_stream(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if not stream_id or len(payload) != 4:
            raise ProtocolViolation(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR,
                                    "an RST_STREAM not of 4 bytes on a stream")
        if self._idle(stream_id):
            raise ProtocolViolation(PROTOCOL_ERROR, f"an RST_STREAM on stream {stream_id}, never opened")
        stream = self._streams.get(stream_id)
        if stream is None or stream.closed:
            return
        stream.remote_closed = True
        self._closed(stream)
        self._drop_output(stream)
        self._on_reset(stream_id, stream, int.from_bytes(payload, "big"), out)

    def _priority(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if not stream_id or len(payload) != 5:
            raise ProtocolViolation(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR,
                                    "a PRIORITY not of 5 bytes on a stream")

    def _push_promise(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        raise ProtocolViolation(PROTOCOL_ERROR, "a PUSH_PROMISE, though push is off")

    def _goaway(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if stream_id or len(payload) < 8:
            raise ProtocolViolation(PROTOCOL_ERROR, "a GOAWAY of under 8 bytes, or on a stream")
        last = int.from_bytes(payload[:4], "big") & MAX_STREAM_ID
        code, said = int.from_bytes(payload[4:8], "big"), _text(payload[8:])
        why = f"the server went away (GOAWAY {_code_name(code)}{': ' + said if said else ''})"
        # RFC 9113, 6.8: streams up to ``last`` may still complete (a graceful shutdown lets them run
        # out); those above it were not processed, so they may be sent again on another connection
        # (unless the server answered one all the same: then it ends, with nothing to say it may be).
        for above_id, stream in self._streams.items():
            if above_id > last and not stream.done:
                stream.remote_closed = True
                self._closed(stream)
                self._ended(above_id, stream, Status.UNAVAILABLE, why, out, unprocessed=not stream.headers_seen)
        # Set after the loop: while accepting, _ended does not look over every stream for each one it ends.
        self.accepting = False
        self.went_away = True
        self.reason = why
        self._close_if_done()

    def _data(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if not stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, "DATA on stream 0")
        size = len(payload)  # flow control counts the padding too
        self._receive_window -= size
        if self._receive_window < 0:
            raise ProtocolViolation(FLOW_CONTROL_ERROR, "DATA past the connection window")
        if self._idle(stream_id):
            raise ProtocolViolation(PROTOCOL_ERROR, f"DATA on stream {stream_id}, never opened")
        data = unpad(flags, payload)
        stream = self._streams.get(stream_id)
        if stream is None or stream.closed or stream.remote_closed:
            if size:  # a call already over here: its data only fills the connection window
                self._credit_connection(size)
            if stream is not None and not stream.closed:  # DATA after the server's END_STREAM
                self._reset(stream_id, stream, STREAM_CLOSED)
            return
        stream.received += size
        if stream.received - stream.acked + stream.unsent > self._window:
            raise ProtocolViolation(FLOW_CONTROL_ERROR, f"DATA past the window of stream {stream_id}")
        if not stream.headers_seen:
            self._fail(stream_id, stream, Status.INTERNAL, "the server sent DATA before its response headers", out)
        elif not stream.done:
            self._take_messages(stream_id, stream, data, out)
        self._give_credit(stream_id, stream)
        if flags & END_STREAM:
            self._remote_end(stream_id, stream, out)

    def _headers(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if not stream_id:
            raise ProtocolViolation(PROTOCOL_ERROR, "HEADERS on stream 0")
        block = unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            if len(block) < 5:
                raise ProtocolViolation(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            block = block[5:]
        self._header_block = bytearray(block)
        self._header_stream, self._header_flags, self._header_frames = stream_id, flags, 1
        if flags & END_HEADERS:
            self._end_headers(out)

    def _continuation(self, flags: int, stream_id: int, payload: bytes, out: list[Event]) -> None:
        if self._header_block is None or stream_id != self._header_stream:
            raise ProtocolViolation(PROTOCOL_ERROR, "a CONTINUATION not right after HEADERS of its stream")
        self._header_frames += 1
        if self._header_frames > MAX_HEADER_FRAMES:
            raise ProtocolViolation(ENHANCE_YOUR_CALM, f"a header block in over {MAX_HEADER_FRAMES} frames")
        self._header_block += payload
        if len(self._header_block) > MAX_HEADER_LIST_BYTES:
            raise ProtocolViolation(PROTOCOL_ERROR, f"a header block over {MAX_HEADER_LIST_BYTES} bytes")
        if flags & END_HEADERS:
            self._end_headers(out)

    def _end_headers(self, out: list[Event]) -> None:
        assert self._header_block is not None
        block, stream_id, flags = bytes(self._header_block), self._header_stream, self._header_flags
        self._header_block = None
        fields = self._decoder.decode(block)  # always decoded: HPACK state is per connection
        if self._idle(stream_id):
            raise ProtocolViolation(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}, never opened")
        stream = self._streams.get(stream_id)
        if stream is None or stream.closed:
            return
        if stream.remote_closed:
            self._reset(stream_id, stream, STREAM_CLOSED)
            return
        ended = bool(flags & END_STREAM)
        if stream.headers_seen:
            if not ended:
                self._fail(stream_id, stream, Status.INTERNAL, "the server sent trailers that do not end the stream",
                           out)
                return
            self._on_trailers(stream, fields)
        else:
            status = fields.get(b":status", b"")
            if status[:1] == b"1" and not ended:
                return  # an informational response: the real one follows
            stream.headers_seen = True
            self._on_headers(stream_id, stream, fields, ended=ended, out=out)
        if ended:
            self._remote_end(stream_id, stream, out)

    # -- streams --------------------------------------------------------------------------------

    def _send_all_queued(self) -> None:
        for stream_id, stream in list(self._streams.items()):
            if stream.out or (stream.ending and not stream.end_sent):
                self._send_queued(stream_id, stream)

    def _send_queued(self, stream_id: int, stream: _Stream) -> None:
        if stream.closed:
            self._drop_output(stream)
            return
        out = self._out
        while stream.out:
            room = min(stream.window, self._send_window, self._peer_frame_size)
            if room <= 0:
                return
            data = stream.out[0]
            if len(data) > room:
                stream.out[0] = data[room:]
                data = data[:room]
            else:
                stream.out.popleft()
            last = stream.ending and not stream.out
            out += http2_frame(DATA, END_STREAM if last else 0, stream_id, data)
            stream.window -= len(data)
            self._send_window -= len(data)
            stream.out_bytes -= len(data)
            if last:
                self._local_end(stream)
        if stream.ending and not stream.end_sent:
            out += http2_frame(DATA, END_STREAM, stream_id)
            self._local_end(stream)

    def _local_end(self, stream: _Stream) -> None:
        stream.end_sent = True
        if stream.remote_closed:
            self._closed(stream)

    def _remote_end(self, stream_id: int, stream: _Stream, out: list[Event]) -> None:
        stream.remote_closed = True
        if stream.end_sent:
            self._closed(stream)
        self._on_end(stream_id, stream, out)

    def _closed(self, stream: _Stream) -> None:
        if not stream.closed:
            stream.closed = True
            self._open -= 1

    def _reset(self, stream_id: int, stream: _Stream, code: int) -> None:
        self._drop_output(stream)
        if not stream.closed and not self.closed:
            self._out += http2_frame(RST_STREAM, 0, stream_id, code.to_bytes(4, "big"))
        stream.remote_closed = True
        self._closed(stream)

    def _drop_output(self, stream: _Stream) -> None:
        stream.out.clear()
        stream.out_bytes = 0
        stream.ending = stream.end_sent = True

    def _give_credit(self, stream_id: int, stream: _Stream) -> None:
        credit = stream.received - stream.acked - stream.held
        if credit <= 0 or self.closed:
            return
        stream.acked += credit
        if not stream.remote_closed:  # else no more DATA comes on it: the connection's credit is enough
            stream.unsent += credit
            if stream.unsent >= self._window // 2:
                self._out += http2_frame(WINDOW_UPDATE, 0, stream_id, stream.unsent.to_bytes(4, "big"))
                stream.unsent = 0
        self._credit_connection(credit)

    def _credit_connection(self, credit: int) -> None:
        self._unsent += credit
        if self._unsent >= self._window // 2 and not self.closed:
            self._out += http2_frame(WINDOW_UPDATE, 0, 0, self._unsent.to_bytes(4, "big"))
            self._receive_window += self._unsent
            self._unsent = 0

    # -- gRPC -----------------------------------------------------------------------------------

    def _take_messages(self, stream_id: int, stream: _Stream, data: bytes, out: list[Event]) -> None:
        buffer = stream.buffer
        buffer += data
        taken = 0
        while len(buffer) - taken >= 5:
            flag, length = buffer[taken], int.from_bytes(buffer[taken + 1 : taken + 5], "big")
            if flag:
                self._fail(stream_id, stream, Status.UNIMPLEMENTED, "compressed messages are not supported", out)
                return
            if length > stream.limit:
                why = f"a message of {length} bytes, over the {stream.limit}-byte limit"
                self._fail(stream_id, stream, Status.RESOURCE_EXHAUSTED, why, out)
                return
            if len(buffer) - taken < 5 + length:
                break
            out.append(MessageReceived(stream_id, bytes(buffer[taken + 5 : taken + 5 + length]), 5 + length))
            stream.held += 5 + length
            taken += 5 + length
        del buffer[:taken]

    def _on_headers(self, stream_id: int, stream: _Stream, fields: Mapping[bytes, bytes], *, ended: bool,
                    out: list[Event]) -> None:
        if stream.done:
            return
        status = fields.get(b":status")
        if status != b"200":
            code = _HTTP_STATUS.get(status or b"", Status.UNKNOWN)
            self._fail(stream_id, stream, code, f"the server answered HTTP status {_text(status or b'?')}", out)
            return
        if ended:  # a trailers-only response: the status is in these headers
            self._on_trailers(stream, fields)
            return
        kind = fields.get(b"content-type", b"")
        if not kind.startswith(b"application/grpc"):
            why = f"the server answered content-type {_text(kind)!r}, not application/grpc"
            self._fail(stream_id, stream, Status.UNKNOWN, why, out)

    def _on_trailers(self, stream: _Stream, fields: Mapping[bytes, bytes]) -> None:
        if stream.done or stream.final is not None:
            return
        raw = fields.get(b"grpc-status")
        message = _text(unquote_to_bytes(fields.get(b"grpc-message", b"")))
        if raw is None:
            stream.final = (Status.UNKNOWN, "the server's trailers carry no grpc-status")
            return
        try:
            stream.final = (Status(int(raw)), message)
        except ValueError:
            stream.final = (Status.UNKNOWN, f"the server sent grpc-status {_text(raw)!r}")

    def _on_end(self, stream_id: int, stream: _Stream, out: list[Event]) -> None:
        if stream.done:
            return
        if stream.buffer and (stream.final is None or stream.final[0] is Status.OK):
            status, why = Status.INVALID_ARGUMENT, "the stream ended inside a message"
        elif stream.final is not None:
            status, why = stream.final
        else:
            status, why = Status.UNAVAILABLE, "the stream ended without a status"
        self._ended(stream_id, stream, status, why, out)

    def _on_reset(self, stream_id: int, stream: _Stream, code: int, out: list[Event]) -> None:
        if stream.done:
            return
        if stream.final is not None:  # the status came first (a server that aborts, then resets)
            self._ended(stream_id, stream, *stream.final, out)
            return
        status = _RESET_STATUS.get(code, Status.UNAVAILABLE)
        why = f"the stream ended without a status (reset by the server: {_code_name(code)})"
        self._ended(stream_id, stream, status, why, out,
                    unprocessed=code == REFUSED_STREAM and not stream.headers_seen)

    def _fail(self, stream_id: int, stream: _Stream, status: Status, why: str, out: list[Event]) -> None:
        """This side gives up on the call (bad input on it): reset, and end it with ``status``."""
        self._reset(stream_id, stream, CANCEL)
        self._ended(stream_id, stream, status, why, out)

    def _ended(self, stream_id: int, stream: _Stream, status: Status, why: str, out: list[Event], *,
               unprocessed: bool = False) -> None:
        stream.done = True
        stream.final = (status, why)
        stream.buffer = bytearray()
        self._drop_output(stream)
        out.append(StreamEnded(stream_id, status, why, unprocessed))
        if not self.accepting:
            self._close_if_done()

    def _close_if_done(self) -> None:
        """After the server's GOAWAY, once its last call is over: GOAWAY back, and the connection is closed."""
        if not self.closed and all(stream.done for stream in self._streams.values()):
            self._out += goaway_frame(0, NO_ERROR)
            self.closed = True

    def _end_all(self, status: Status, why: str) -> list[Event]:
        self.accepting = False
        self.closed = True
        self.reason = why
        out: list[Event] = []
        for stream_id, stream in self._streams.items():
            if not stream.done:
                self._ended(stream_id, stream, status, why, out)
        return out


_FrameHandler = Callable[[ClientConnection, int, int, bytes, list[Event]], None]
_HANDLERS: dict[int, _FrameHandler] = {
    DATA: ClientConnection._data,
    HEADERS: ClientConnection._headers,
    PRIORITY: ClientConnection._priority,
    RST_STREAM: ClientConnection._rst_stream,
    SETTINGS: ClientConnection._settings,
    PUSH_PROMISE: ClientConnection._push_promise,
    PING: ClientConnection._ping,
    GOAWAY: ClientConnection._goaway,
    WINDOW_UPDATE: ClientConnection._window_update,
    CONTINUATION: ClientConnection._continuation,
}


def _code_name(code: int) -> str:
    return ERROR_NAMES.get(code, str(code))


def _text(raw: bytes) -> str:
    """A header value fit for an error message: printable, at most 200 characters."""
    text = raw.decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= 200 else text[:200] + "..."
