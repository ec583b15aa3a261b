"""Limits and tunables of the Dissociated IPC layer: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from evergreen_trio.errors import ConfigurationError
from evergreen_trio.limits import check_limits

MiB = 1 << 20


@dataclass(frozen=True)
class IpcLimits:
    """Every bound the IPC layer enforces, with its default.

    ``max_unacked_bodies`` is the backpressure rule: a server keeps at most this many
    bodies per stream unacknowledged (UCX: send request not complete; TCP: not yet
    written to the socket; shared memory: not yet returned by ``free_data``).
    ``shm_batch_bytes``: a shared-memory server announces bodies in groups of about
    this many bytes (and at most half the window), one control send per group.

    Server side, against hostile clients: ``max_connections`` open at once (more are closed
    at accept), ``max_streams_per_connection`` want_data streams running on one connection
    (one more closes it), ``first_request_timeout_s`` from accept to the first complete
    request, ``idle_timeout_s`` with no request and no stream running, ``send_timeout_s``
    for each MiB sent (a client that stops reading). ``shm_segment_bytes`` is the shared
    memory of one connection; ``shm_max_total_bytes`` caps all of a server's segments
    (live and idle), so a shm:// server takes at most ``shm_max_total_bytes //
    shm_segment_bytes`` connections. ``shm_published_bytes`` caps the bodies a shm://
    server publishes once for every connection (bodies past it are copied per stream).

    Client side, against hostile servers: ``max_decompressed_bytes`` caps what one compressed
    batch (LZ4_FRAME / ZSTD body compression) declares it inflates to, checked before it is inflated;
    ``max_pending_bytes`` caps the metadata and inline bodies one stream holds waiting for their
    other half or an earlier message (at least ``max_body_bytes``: a body may overtake its metadata).
    """

    max_metadata_bytes: int = 1 * MiB
    max_body_bytes: int = 2048 * MiB
    max_decompressed_bytes: int = 2048 * MiB
    max_ticket_bytes: int = 4096
    max_buffers_per_body: int = 65_536
    max_free_data_offsets: int = 65_536
    max_pending_messages: int = 4096
    max_pending_bytes: int = 4096 * MiB
    max_unacked_bodies: int = 16
    shm_segment_bytes: int = 1024 * MiB
    shm_idle_segments: int = 2
    shm_batch_bytes: int = 64 * MiB
    pool_bytes: int = 512 * MiB
    connect_timeout_s: float = 10.0
    max_connections: int = 1024
    max_streams_per_connection: int = 16
    first_request_timeout_s: float = 10.0
    idle_timeout_s: float = 60.0
    send_timeout_s: float = 30.0
    shm_max_total_bytes: int = 16 * 1024 * MiB
    shm_published_bytes: int = 4096 * MiB

    def __post_init__(self) -> None:
        """Raises ConfigurationError for a field that is not positive (and max_pending_messages >= 2**31,
        half the sequence space, max_pending_bytes below max_body_bytes, or shm_max_total_bytes below
        one segment)."""
        check_limits(self, maximum={"max_pending_messages": (1 << 31) - 1})
        if self.max_pending_bytes < self.max_body_bytes:
            raise ConfigurationError(f"IpcLimits.max_pending_bytes: expected at least max_body_bytes "
                                     f"({self.max_body_bytes}), got {self.max_pending_bytes}")
        if self.shm_max_total_bytes < self.shm_segment_bytes:
            raise ConfigurationError(f"IpcLimits.shm_max_total_bytes: expected at least shm_segment_bytes "
                                     f"({self.shm_segment_bytes}), got {self.shm_max_total_bytes}")


DEFAULT_LIMITS = IpcLimits()
"""The limits transports use when given none."""
