"""evergreen-trio: Trio structured concurrency for GenAI wire protocols.

The Evergreen session API lives here; the other protocols are subpackages:
``evergreen_trio.picker`` (Endpoint Picker), ``evergreen_trio.avp`` (AVP codec),
``evergreen_trio.ipc`` (Arrow Dissociated IPC).
"""

from importlib.metadata import PackageNotFoundError, version

from evergreen_trio.client import Call, Client, ClientSession, Output, connect
from evergreen_trio.dag import (
    LimitExceededError,
    ProtocolViolationError,
    SessionAbortedError,
    SessionError,
    SessionLimits,
    StatusCode,
)
from evergreen_trio.errors import ConfigurationError, EvergreenTrioError
from evergreen_trio.nodes import NodeRef, blob, inner, ref, text
from evergreen_trio.nursery_session import ActionContext, ChunkReader, InputStream, OutputNode
from evergreen_trio.refs import FileResolver, RefResolver
from evergreen_trio.serving.server import Server

try:
    __version__ = version("evergreen-trio")
    """The installed distribution's version (pyproject's ``[project] version``)."""
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

__all__ = [
    "ActionContext",
    "Call",
    "ChunkReader",
    "Client",
    "ClientSession",
    "ConfigurationError",
    "EvergreenTrioError",
    "FileResolver",
    "InputStream",
    "LimitExceededError",
    "NodeRef",
    "Output",
    "OutputNode",
    "ProtocolViolationError",
    "RefResolver",
    "Server",
    "SessionAbortedError",
    "SessionError",
    "SessionLimits",
    "StatusCode",
    "blob",
    "connect",
    "inner",
    "ref",
    "text",
]
