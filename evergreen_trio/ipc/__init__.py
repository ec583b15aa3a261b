"""Apache Arrow Dissociated IPC on Trio: metadata and bodies on separate streams.

Serve pyarrow tables or Arrow IPC files over UCX, TCP or shared memory and read them
back as ``pyarrow.RecordBatch``es. See ``docs/ipc.md``.
"""

from evergreen_trio._extras import require_extra

require_extra("ipc", __name__)

from evergreen_trio.ipc.client import IpcClient, connect
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import (
    BodyMismatchError,
    ConnectionLostError,
    FlatbufferError,
    FramingError,
    IpcError,
    LimitExceededError,
    RequestRefusedError,
    SequenceError,
    SharedMemoryError,
    TransportError,
    UnknownTicketError,
    UriError,
)
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.service import Catalog, fetch, fetch_table, serve
from evergreen_trio.ipc.session import IpcStream
from evergreen_trio.ipc.transports.base import Role, ServeOptions
from evergreen_trio.ipc.uri import IpcUri, parse_uri

__all__ = [
    "DEFAULT_LIMITS",
    "BodyMismatchError",
    "BufferPool",
    "Catalog",
    "ConnectionLostError",
    "FlatbufferError",
    "FramingError",
    "IpcClient",
    "IpcError",
    "IpcLimits",
    "IpcStream",
    "IpcUri",
    "LimitExceededError",
    "RequestRefusedError",
    "Role",
    "SequenceError",
    "ServeOptions",
    "SharedMemoryError",
    "TransportError",
    "UnknownTicketError",
    "UriError",
    "connect",
    "fetch",
    "fetch_table",
    "parse_uri",
    "serve",
]
