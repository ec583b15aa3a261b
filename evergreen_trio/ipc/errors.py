"""The Dissociated IPC error hierarchy, rooted in :class:`EvergreenTrioError`."""

from __future__ import annotations

from evergreen_trio.errors import ConfigurationError, EvergreenTrioError


class IpcError(EvergreenTrioError):
    """Base of every Dissociated IPC error."""


class FramingError(IpcError):
    """Bytes on the wire do not form a valid message, tag, descriptor or frame."""


class FlatbufferError(FramingError):
    """An Arrow IPC Flatbuffers header is truncated or inconsistent."""


class UriError(IpcError, ConfigurationError):
    """A Dissociated IPC URI is missing a parameter or carries a malformed one."""


class SequenceError(IpcError):
    """Sequence numbers repeat, run past End of Stream, or leave a gap."""


class BodyMismatchError(IpcError):
    """A body disagrees with its metadata (length, buffer count, buffer layout)."""


class LimitExceededError(IpcError):
    """A configured limit (size, count, window) was crossed."""


class UnknownTicketError(IpcError):
    """The server has no stream for the requested ticket."""


class RequestRefusedError(IpcError):
    """The server refused the request and said why (an unknown ticket, a ticket too long)."""


class TransportError(IpcError):
    """The transport failed: connection refused, reset, or closed mid-stream."""


class ConnectionLostError(TransportError):
    """The peer went away before the stream finished."""


class SharedMemoryError(IpcError):
    """A shared-memory segment could not be created, passed, mapped or addressed."""
