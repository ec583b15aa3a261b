"""Limits and tunables of the Dissociated IPC layer: one frozen dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    max_metadata_bytes: int = 1 * MiB
    max_body_bytes: int = 2048 * MiB
    max_ticket_bytes: int = 4096
    max_buffers_per_body: int = 65_536
    max_free_data_offsets: int = 65_536
    max_pending_messages: int = 4096
    max_unacked_bodies: int = 16
    shm_segment_bytes: int = 1024 * MiB
    shm_idle_segments: int = 2
    shm_batch_bytes: int = 64 * MiB
    pool_bytes: int = 512 * MiB
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        """Raises ConfigurationError for a field that is not positive (and max_pending_messages >= 2**31,
        half the sequence space)."""
        check_limits(self, maximum={"max_pending_messages": (1 << 31) - 1})


DEFAULT_LIMITS = IpcLimits()
"""The limits transports use when given none."""
