"""An incremental ``text/event-stream`` decoder (sans-IO): bytes in any split, events out.

Follows the WHATWG "event stream interpretation": lines end in CRLF, LF or CR; ``:`` starts a
comment; ``data`` lines accumulate (joined by LF) until a blank line dispatches the event; a field
without a colon has an empty value; one space after the colon is dropped; a leading BOM is
ignored; an event without ``data`` is not dispatched; an unterminated event at the end of the
stream is discarded. ``retry`` is ignored (a one-shot request never reconnects). Lines and event
data are bounded, so a peer that never sends a newline costs at most ``max_line_bytes``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from evergreen_trio.generate.errors import ResponseTooLargeError, SSEError

_EOL = re.compile(rb"[\r\n]")
_BOM = "\ufeff"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: its data (data lines joined by LF), type and last event id."""

    data: str
    event: str = "message"
    id: str = ""


class SSEDecoder:
    """Feed bytes as they arrive; each call returns the events completed by them.

    Raises :class:`SSEError` for bytes that are not UTF-8 and :class:`ResponseTooLargeError` for a
    line over ``max_line_bytes`` or an event whose data is over ``max_event_bytes``.
    """

    def __init__(self, *, max_line_bytes: int = 1 << 20, max_event_bytes: int = 1 << 20) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already known to hold no line end
        self._skip_lf = False  # the last line ended in CR: an LF first in the next bytes belongs to it
        self._first_line = True
        self._data: list[str] = []
        self._data_bytes = 0
        self._event = ""
        self._last_id = ""

    def feed(self, data: bytes) -> list[SSEEvent]:
        """The events ``data`` completes; raises SSEError or ResponseTooLargeError as the class says."""
        buffer = self._buffer
        if self._skip_lf and data:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buffer += data
        events: list[SSEEvent] = []
        start = 0
        while True:
            match = _EOL.search(buffer, max(start, self._scanned))
            if match is None:
                break
            end = match.start()
            self._check_line(end - start)
            self._line(bytes(buffer[start:end]), events)
            start = end + 1
            if buffer[end] == 0x0D:  # CR: swallow the LF of a CRLF, now or in the next bytes
                if start < len(buffer):
                    if buffer[start] == 0x0A:
                        start += 1
                else:
                    self._skip_lf = True
        del buffer[:start]
        self._scanned = len(buffer)
        self._check_line(len(buffer))
        return events

    def _check_line(self, size: int) -> None:
        if size > self.max_line_bytes:
            raise ResponseTooLargeError(
                f"expected SSE lines of at most {self.max_line_bytes} bytes, got one of {size} bytes or more"
            )

    def _line(self, raw: bytes, events: list[SSEEvent]) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise SSEError(f"expected UTF-8 in the event stream, got {error.reason} at byte {error.start}") from None
        if self._first_line:
            self._first_line = False
            line = line.removeprefix(_BOM)
        if not line:
            self._dispatch(events)
            return
        if line.startswith(":"):
            return
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data_bytes += len(raw)
            if self._data_bytes > self.max_event_bytes:
                raise ResponseTooLargeError(
                    f"expected SSE events of at most {self.max_event_bytes} data bytes, got more"
                )
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._last_id = value

    def _dispatch(self, events: list[SSEEvent]) -> None:
        if self._data:
            events.append(SSEEvent("\n".join(self._data), self._event or "message", self._last_id))
        self._data, self._data_bytes, self._event = [], 0, ""
