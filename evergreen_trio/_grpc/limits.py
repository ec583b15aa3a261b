"""Transport limits of the session server: plain Python, no I/O.

``serving/server.py`` turns them into the server wire's limits and its shell's deadlines; see docs/security.md.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

MAX_SETTINGS_VALUE = 2**32 - 1
"""The largest value an HTTP/2 SETTINGS frame carries (32 bits): ``max_streams_per_connection``'s bound."""


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
    - ``max_stream_errors_per_second``: streams of one connection reset by the peer, refused, or ended
      with an error status within one second, past which it gets GOAWAY(ENHANCE_YOUR_CALM) (rapid
      reset, CVE-2023-44487). A connection that had more than ``max_streams_per_connection`` streams
      refused (past the stream cap, or by the admission check: bad credentials) gets the same GOAWAY
      (a client that honours SETTINGS_MAX_CONCURRENT_STREAMS and holds a good token sees a few at most).
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
    max_stream_errors_per_second: int = 500

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_streams", "max_streams_per_peer", "max_streams_per_connection",
                     "max_message_bytes", "max_stream_errors_per_second"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_streams_per_connection > MAX_SETTINGS_VALUE:
            raise ValueError(f"max_streams_per_connection must be at most {MAX_SETTINGS_VALUE} (an HTTP/2 SETTINGS "
                             f"value), got {self.max_streams_per_connection}")
        for name in ("handshake_timeout", "keepalive_time", "keepalive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.idle_timeout is not None and not self.idle_timeout > 0:
            raise ValueError(f"idle_timeout must be positive or None, got {self.idle_timeout}")


MAX_HEALTH_WATCHES = 100
"""``Health/Watch`` streams open at once on a server; past it a new one gets RESOURCE_EXHAUSTED."""

HEALTH_WATCH_SECONDS = 60.0
"""A ``Health/Watch`` stream ends (OK) after this long; a client that still cares watches again."""

OUT_OF_RESOURCES_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
"""``accept()`` failures that mean "out of descriptors or memory": a server stops accepting for a
while instead of failing again on every pass (the listening socket stays ready)."""
