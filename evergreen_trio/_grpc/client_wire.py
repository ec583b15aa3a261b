"""The client end of gRPC over HTTP/2, sans-IO: bytes in, events and bytes out; no Trio, no sockets.

Built on h2's state machine (as grpclib is). :class:`ClientConnection` adds what a gRPC client needs
on top: request headers (``grpc-timeout``, metadata), gRPC message framing both ways with a size
limit checked on each message's 5-byte prefix, the final status from trailers (a trailers-only
response, an HTTP error status, a reset, a GOAWAY or a broken connection each become a status too),
outbound flow control (data waits per stream for the peer's window) and inbound flow control that
returns credit only for input consumed: a complete message is held against the window until the
caller says it was taken (:meth:`ClientConnection.consumed`), so a server can make the client hold at
most one window of complete messages per connection, plus one partial message (at most
``max_message_bytes``) per stream. Hostile input never raises: it ends streams, or the connection,
with a status naming what was wrong.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from grpclib.const import Status
from h2.errors import ErrorCodes

WINDOW_BYTES = 4 * 1024 * 1024
"""The client's inbound flow-control window, per stream and per connection (grpclib's client default)."""

MAX_HEADER_LIST_BYTES = 64 * 1024
"""Response headers or trailers larger than this (decoded) end the connection (h2's default, advertised)."""

_HTTP_STATUS = {b"400": Status.INTERNAL, b"401": Status.UNAUTHENTICATED, b"403": Status.PERMISSION_DENIED,
                b"404": Status.UNIMPLEMENTED, b"429": Status.UNAVAILABLE, b"502": Status.UNAVAILABLE,
                b"503": Status.UNAVAILABLE, b"504": Status.UNAVAILABLE}
"""HTTP status -> gRPC status for a response that is not 200 (gRPC's http-grpc-status-mapping.md)."""

_RESET_STATUS = {ErrorCodes.REFUSED_STREAM: Status.UNAVAILABLE, ErrorCodes.CANCEL: Status.CANCELLED,
                 ErrorCodes.ENHANCE_YOUR_CALM: Status.RESOURCE_EXHAUSTED,
                 ErrorCodes.INADEQUATE_SECURITY: Status.PERMISSION_DENIED}
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
    """``stream_id`` is over (nothing more arrives on it) with this final status."""

    stream_id: int
    status: Status
    message: str


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
    """One stream's framing and flow-control state."""

    __slots__ = ("acked", "buffer", "done", "end_sent", "ending", "final", "held", "limit", "out", "out_bytes",
                 "received")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffer = bytearray()  # inbound bytes of a message not yet whole
        self.received = 0  # flow-controlled bytes received
        self.acked = 0  # ... of which credit was given back
        self.held = 0  # ... in whole messages not yet consumed
        self.done = False  # its StreamEnded was given
        self.final: tuple[Status, str] | None = None  # from trailers (or a trailers-only response)
        self.out: deque[bytes] = deque()  # framed messages waiting for the peer's window
        self.out_bytes = 0
        self.ending = False  # end of stream asked for (sent once ``out`` is empty)
        self.end_sent = False


class ClientConnection:
    """One client HTTP/2 connection carrying gRPC calls, as a state machine.

    Call :meth:`initiate`, then send :meth:`data_to_send` whenever it has bytes, and feed every byte
    read to :meth:`receive`. ``settled`` turns true with the server's first SETTINGS; ``accepting``
    is false once no new stream may be opened (the server went away, or the connection failed);
    ``closed`` once nothing more will arrive on it (``reason`` says why).
    """

    def __init__(self, authority: str, *, scheme: str = "http", window: int = WINDOW_BYTES) -> None:
        # The request headers are ours (metadata checked by the shell's ClientOptions): h2's outbound checks
        # cost a third of opening a stream. What the server sends is checked.
        config = h2.config.H2Configuration(client_side=True, header_encoding=None, validate_outbound_headers=False,
                                           normalize_outbound_headers=False)
        self._h2 = h2.connection.H2Connection(config=config)
        self._h2.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: MAX_HEADER_LIST_BYTES,
        })
        self._window = window
        self._authority = authority.encode()
        self._scheme = scheme.encode()
        self._streams: dict[int, _Stream] = {}
        self._header = bytearray()  # a frame header split between reads
        self._frame_left = 0  # bytes of the current frame's body still to come
        self._framed = False  # the server's first frame was seen
        self.settled = False
        self.accepting = True
        self.closed = False
        self.reason = ""

    def initiate(self) -> None:
        """Queue the connection preface (with our SETTINGS and the connection window)."""
        self._h2.initiate_connection()
        if self._window > 65535:  # the connection's window starts at HTTP/2's default whatever SETTINGS say
            self._h2.increment_flow_control_window(self._window - 65535)

    def data_to_send(self) -> bytes:
        """What must go out now (and is no longer held here)."""
        return self._h2.data_to_send()

    def room(self) -> bool:
        """Whether another stream fits in the server's SETTINGS_MAX_CONCURRENT_STREAMS now."""
        return self._h2.open_outbound_streams < self._h2.remote_settings.max_concurrent_streams

    # -- a call's outbound side --------------------------------------------------------------

    def start_stream(self, path: str, *, metadata: Mapping[str, str] | None = None, timeout: float | None = None,
                     max_message_bytes: int) -> int | None:
        """Open a call (its request headers queued); its id, or None when this connection has no stream id
        left (it no longer accepts). Check :attr:`accepting` and :meth:`room` first."""
        try:
            stream_id = self._h2.get_next_available_stream_id()
        except h2.exceptions.NoAvailableStreamIDError:
            self.accepting = False
            return None
        headers = [(b":method", b"POST"), (b":scheme", self._scheme), (b":path", path.encode()),
                   (b":authority", self._authority), (b"te", b"trailers"),
                   (b"content-type", b"application/grpc")]
        if timeout is not None:
            headers.append((b"grpc-timeout", encode_timeout(timeout).encode()))
        headers.extend((key.lower().encode(), value.encode()) for key, value in (metadata or {}).items())
        self._h2.send_headers(stream_id, headers)
        self._streams[stream_id] = _Stream(max_message_bytes)
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

    def reset_stream(self, stream_id: int, code: ErrorCodes = ErrorCodes.CANCEL) -> None:
        """RST_STREAM: the call is abandoned (its queued messages dropped)."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            stream.out.clear()
            stream.out_bytes = 0
            stream.ending = stream.end_sent = True
        if not self.closed:
            with suppress(h2.exceptions.StreamClosedError):  # it ended meanwhile: nothing to reset
                self._h2.reset_stream(stream_id, code)

    def release(self, stream_id: int) -> None:
        """Forget a finished call; the credit it still held goes back to the connection's window. A call
        the server ended before this side's end of stream went out is reset (h2 would keep it open,
        counted against the server's stream limit, for the connection's life)."""
        stream = self._streams.pop(stream_id, None)
        if stream is None or self.closed:
            return
        if stream.received > stream.acked:
            self._h2.acknowledge_received_data(stream.received - stream.acked, stream_id)
        h2_stream = self._h2.streams.get(stream_id)
        if h2_stream is not None and not h2_stream.closed:
            self.reset_stream(stream_id)

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
            self._h2.close_connection()
            self._end_all(Status.UNAVAILABLE, reason)

    # -- input --------------------------------------------------------------------------------

    def receive(self, data: bytes | bytearray) -> list[Event]:
        """Feed bytes read from the server; the events they complete. Never raises on bad input."""
        if self.closed:
            return []
        out: list[Event] = []
        bad = self._scan(data)
        if bad is not None:
            self._h2.close_connection(ErrorCodes.PROTOCOL_ERROR)
            return self._end_all(Status.UNAVAILABLE, f"the server broke the HTTP/2 protocol: {bad}")
        try:
            events = self._h2.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            # h2 queued a GOAWAY naming the error (sent by the caller) and stops here; what this read
            # held before the bad frame is lost with it, as in grpclib.
            why = str(error) or type(error).__name__
            out.extend(self._end_all(Status.UNAVAILABLE, f"the server broke the HTTP/2 protocol: {why}"))
            return out
        for event in events:
            if isinstance(event, h2.events.DataReceived):
                self._on_data(event, out)
            elif isinstance(event, h2.events.ResponseReceived):
                self._on_headers(event.stream_id, event.headers, ended=event.stream_ended is not None, out=out)
            elif isinstance(event, h2.events.TrailersReceived):
                self._on_trailers(event.stream_id, event.headers)
            elif isinstance(event, h2.events.StreamEnded):
                self._on_end(event.stream_id, out)
            elif isinstance(event, h2.events.StreamReset):
                self._on_reset(event.stream_id, event.error_code, out)
            elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
                self.settled = self.settled or isinstance(event, h2.events.RemoteSettingsChanged)
                for stream_id, stream in list(self._streams.items()):
                    if stream.out or (stream.ending and not stream.end_sent):
                        self._send_queued(stream_id, stream)
            elif isinstance(event, h2.events.ConnectionTerminated):
                out.extend(self._on_goaway(event))
                break
        return out

    def connection_lost(self, why: str) -> list[Event]:
        """The transport ended (EOF, reset, TLS failure): every open call ends UNAVAILABLE."""
        if self.closed:
            return []
        return self._end_all(Status.UNAVAILABLE, why)

    # -- internals ----------------------------------------------------------------------------

    def _scan(self, data: bytes | bytearray) -> str | None:
        """What is wrong with the frame headers in ``data``, before h2 buffers a frame of any length it
        claims (h2 checks the length only once the whole frame is in memory): a first frame that is
        not SETTINGS, or a frame over the 16 KiB we allow."""
        pos, end = 0, len(data)
        while pos < end:
            if self._frame_left:
                step = min(self._frame_left, end - pos)
                pos += step
                self._frame_left -= step
                continue
            take = data[pos : pos + 9 - len(self._header)]
            self._header += take
            pos += len(take)
            if len(self._header) < 9:
                return None
            length, kind = int.from_bytes(self._header[:3], "big"), self._header[3]
            if not self._framed:
                self._framed = True
                if kind != 0x4:
                    return f"its first frame is not SETTINGS (it began {_text(bytes(self._header))!r})"
            if length > self._h2.max_inbound_frame_size:
                return f"a frame of {length} bytes, over the {self._h2.max_inbound_frame_size}-byte limit"
            self._frame_left = length
            self._header.clear()
        return None

    def _send_queued(self, stream_id: int, stream: _Stream) -> None:
        h2_conn = self._h2
        try:
            while stream.out:
                room = min(h2_conn.local_flow_control_window(stream_id), h2_conn.max_outbound_frame_size)
                if room <= 0:
                    return
                data = stream.out[0]
                if len(data) <= room:
                    stream.out.popleft()
                    last = stream.ending and not stream.out
                    h2_conn.send_data(stream_id, data, end_stream=last)
                    stream.end_sent = stream.end_sent or last
                    stream.out_bytes -= len(data)
                else:
                    stream.out[0] = data[room:]
                    h2_conn.send_data(stream_id, data[:room])
                    stream.out_bytes -= room
            if stream.ending and not stream.end_sent:
                stream.end_sent = True
                h2_conn.end_stream(stream_id)
        except h2.exceptions.StreamClosedError:  # the server ended or reset it: the rest has nowhere to go
            stream.out.clear()
            stream.out_bytes = 0
            stream.ending = stream.end_sent = True

    def _give_credit(self, stream_id: int, stream: _Stream) -> None:
        credit = stream.received - stream.acked - stream.held
        if credit > 0 and not self.closed:
            stream.acked += credit
            self._h2.acknowledge_received_data(credit, stream_id)

    def _on_data(self, event: h2.events.DataReceived, out: list[Event]) -> None:
        stream_id = event.stream_id
        stream = self._streams.get(stream_id)
        size = event.flow_controlled_length or 0
        if stream is None:  # a call already finished here: its data only fills the window
            if size and not self.closed:
                self._h2.acknowledge_received_data(size, stream_id)
            return
        stream.received += size
        if not stream.done:
            buffer = stream.buffer
            buffer += event.data or b""
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
        self._give_credit(stream_id, stream)

    def _on_headers(self, stream_id: int, headers: list[tuple[bytes, bytes]], *, ended: bool,
                    out: list[Event]) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.done:
            return
        fields = dict(headers)
        status = fields.get(b":status")
        if status != b"200":
            code = _HTTP_STATUS.get(status or b"", Status.UNKNOWN)
            self._fail(stream_id, stream, code, f"the server answered HTTP status {_text(status or b'?')}", out)
            return
        if ended:  # a trailers-only response: the status is in these headers
            self._on_trailers(stream_id, headers)
            return
        kind = fields.get(b"content-type", b"")
        if not kind.startswith(b"application/grpc"):
            why = f"the server answered content-type {_text(kind)!r}, not application/grpc"
            self._fail(stream_id, stream, Status.UNKNOWN, why, out)

    def _on_trailers(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.done or stream.final is not None:
            return
        fields = dict(headers)
        raw = fields.get(b"grpc-status")
        message = _text(unquote_to_bytes(fields.get(b"grpc-message", b"")))
        if raw is None:
            stream.final = (Status.UNKNOWN, "the server's trailers carry no grpc-status")
            return
        try:
            stream.final = (Status(int(raw)), message)
        except ValueError:
            stream.final = (Status.UNKNOWN, f"the server sent grpc-status {_text(raw)!r}")

    def _on_end(self, stream_id: int, out: list[Event]) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.done:
            return
        if stream.buffer and (stream.final is None or stream.final[0] is Status.OK):
            status, why = Status.INVALID_ARGUMENT, "the stream ended inside a message"
        elif stream.final is not None:
            status, why = stream.final
        else:
            status, why = Status.UNAVAILABLE, "the stream ended without a status"
        self._ended(stream_id, stream, status, why, out)

    def _on_reset(self, stream_id: int, code: int | None, out: list[Event]) -> None:
        stream = self._streams.get(stream_id)
        if stream is None or stream.done:
            return
        if stream.final is not None:  # the status came first (a server that aborts, then resets)
            self._ended(stream_id, stream, *stream.final, out)
            return
        status = _RESET_STATUS.get(code, Status.UNAVAILABLE)  # type: ignore[call-overload]
        why = f"the stream ended without a status (reset by the server: {_code_name(code)})"
        self._ended(stream_id, stream, status, why, out)

    def _on_goaway(self, event: h2.events.ConnectionTerminated) -> list[Event]:
        # h2 takes no frame after a GOAWAY (its state machine is closed), so calls the server would
        # still have finished end here too, as they did with grpclib.
        said = _text(event.additional_data or b"")
        why = f"the server went away (GOAWAY {_code_name(event.error_code)}{': ' + said if said else ''})"
        return self._end_all(Status.UNAVAILABLE, why)

    def _fail(self, stream_id: int, stream: _Stream, status: Status, why: str, out: list[Event]) -> None:
        """This side gives up on the call (bad input on it): reset, and end it with ``status``."""
        self.reset_stream(stream_id)
        self._ended(stream_id, stream, status, why, out)

    def _ended(self, stream_id: int, stream: _Stream, status: Status, why: str, out: list[Event]) -> None:
        stream.done = True
        stream.final = (status, why)
        stream.buffer = bytearray()
        stream.out.clear()
        stream.out_bytes = 0
        stream.ending = stream.end_sent = True
        out.append(StreamEnded(stream_id, status, why))

    def _end_all(self, status: Status, why: str) -> list[Event]:
        self.accepting = False
        self.closed = True
        self.reason = why
        out: list[Event] = []
        for stream_id, stream in self._streams.items():
            if not stream.done:
                self._ended(stream_id, stream, status, why, out)
        return out


def _code_name(code: int | None) -> str:
    try:
        return ErrorCodes(code or 0).name
    except ValueError:
        return str(code)


def _text(raw: bytes) -> str:
    """A header value fit for an error message: printable, at most 200 characters."""
    text = raw.decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= 200 else text[:200] + "..."
