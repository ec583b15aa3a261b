"""Transport limits of the session server and the premature-reset budget: plain Python, no I/O.

The bridge's grpclib protocol applies them per connection; see docs/security.md.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass


@dataclass(frozen=True)
class TransportLimits:
    """Bounds on what one peer can make the session server hold or do.

    - ``max_connections``: connections open on the server; past it a new one gets SETTINGS and
      GOAWAY(ENHANCE_YOUR_CALM, last stream 0: nothing was processed) and is closed, as the picker does.
    - ``max_streams``: sessions open on the whole server; past it a new one gets RESOURCE_EXHAUSTED.
    - ``max_streams_per_peer``: sessions open from one remote address (its share of ``max_streams``);
      past it a new one gets RESOURCE_EXHAUSTED. Counted after the admission check (authorization).
    - ``max_streams_per_connection``: advertised as SETTINGS_MAX_CONCURRENT_STREAMS; a stream past
      it is refused alone with RST_STREAM(REFUSED_STREAM), the connection's other streams go on.
    - ``max_message_bytes``: a gRPC message whose 5-byte prefix claims more is refused with
      RESOURCE_EXHAUSTED before any of it is buffered.
    - ``handshake_timeout``: a connection that has not sent its HTTP/2 preface and SETTINGS by then
      is closed.
    - ``idle_timeout``: a connection with no open stream and no frame for that long gets
      GOAWAY(NO_ERROR) and is closed (``None``: kept).
    - ``keepalive_time`` / ``keepalive_timeout``: a connection with open streams is pinged after
      that much silence and closed when the ping is not answered in time (a vanished peer).
    - ``premature_resets``: past this many streams on one connection, if more than half were reset
      by the peer within ``premature_reset_seconds`` of opening, GOAWAY(ENHANCE_YOUR_CALM) (rapid
      reset, CVE-2023-44487; Envoy's ``premature_reset_total_stream_count`` works the same way).
      A connection that had more than ``max_streams_per_connection`` streams refused (past the stream
      cap, or by the admission check: bad credentials) gets the same GOAWAY (a client that honours
      SETTINGS_MAX_CONCURRENT_STREAMS and holds a good token sees a few at most).
    """

    max_connections: int = 4096
    max_streams: int = 10_000
    max_streams_per_peer: int = 2_500
    max_streams_per_connection: int = 100
    max_message_bytes: int = 5 * 1024 * 1024 + 64 * 1024
    handshake_timeout: float = 30.0
    idle_timeout: float | None = 120.0
    keepalive_time: float = 60.0
    keepalive_timeout: float = 20.0
    premature_resets: int = 500
    premature_reset_seconds: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_streams", "max_streams_per_peer", "max_streams_per_connection",
                     "max_message_bytes", "premature_resets"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("handshake_timeout", "keepalive_time", "keepalive_timeout", "premature_reset_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise ValueError(f"idle_timeout must be positive or None, got {self.idle_timeout}")


class ResetBudget:
    """Counts a connection's streams, those the peer reset soon after opening them, and those refused."""

    def __init__(self, limits: TransportLimits) -> None:
        self._min_streams = limits.premature_resets
        self._max_refused = limits.max_streams_per_connection
        self.premature_after = limits.premature_reset_seconds
        self.streams = 0
        self.premature = 0
        self.refusals = 0

    def opened(self) -> None:
        self.streams += 1

    def reset(self, lifetime: float) -> None:
        """A stream the peer reset ``lifetime`` seconds after it opened."""
        if lifetime < self.premature_after:
            self.premature += 1

    def refused(self) -> None:
        """A stream refused: the connection had its maximum of streams open, or the stream was not admitted."""
        self.refusals += 1

    @property
    def exceeded(self) -> str | None:
        """Why the connection should be told to calm down, or None."""
        if self.streams >= self._min_streams and 2 * self.premature > self.streams:
            return f"{self.premature} of {self.streams} streams reset by the peer soon after opening"
        if self.refusals > self._max_refused:
            return f"{self.refusals} streams refused (past SETTINGS_MAX_CONCURRENT_STREAMS, or unauthorized)"
        return None


class FrameScanner:
    """Finds the HTTP/2 frames in a connection's input (after the client's 24-byte preface), so that
    the input can be cut before a HEADERS frame that would open one stream too many."""

    def __init__(self) -> None:
        self._skip = 24  # bytes before the next frame header: the preface, then each frame's body
        self._header = bytearray()  # a frame header split between two reads

    def cut(self, data: bytes | memoryview, max_streams: int) -> tuple[int, int]:
        """(size, streams): the longest start of ``data`` (the input after what was cut before) in
        which at most ``max_streams`` HEADERS frames open a stream that a later RST_STREAM in it
        does not reset (those start nothing), and how many do. The scanner moves past ``size`` bytes."""
        pos = 0
        end = len(data)
        live: set[int] = set()
        split = 0  # HEADERS whose frame header was split between reads, counted as live
        while pos < end:
            if self._skip:
                step = min(self._skip, end - pos)
                pos += step
                self._skip -= step
                continue
            if not self._header and end - pos >= 9:
                kind = data[pos + 3]
                if kind in (1, 3):  # HEADERS, RST_STREAM
                    stream_id = int.from_bytes(data[pos + 5 : pos + 9], "big") & 0x7FFFFFFF
                    if kind == 3:
                        live.discard(stream_id)
                    elif len(live) + split >= max_streams and stream_id not in live:
                        return pos, len(live) + split
                    else:
                        live.add(stream_id)
                self._skip = 9 + int.from_bytes(data[pos : pos + 3], "big")
                continue
            take = data[pos : pos + 9 - len(self._header)]
            self._header += take
            pos += len(take)
            if len(self._header) == 9:
                split += self._header[3] == 1
                self._skip = int.from_bytes(self._header[:3], "big")
                self._header.clear()
        return pos, len(live) + split


MAX_HEALTH_WATCHES = 100
"""``Health/Watch`` streams open at once on a server; past it a new one gets RESOURCE_EXHAUSTED."""

HEALTH_WATCH_SECONDS = 60.0
"""A ``Health/Watch`` stream ends (OK) after this long; a client that still cares watches again."""

OUT_OF_RESOURCES_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` failures that mean "out of descriptors or memory": a server stops accepting for a
while instead of failing again on every pass (the listening socket stays ready)."""
