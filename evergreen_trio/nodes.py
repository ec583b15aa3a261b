"""Node values a client builds before sending: ``text``, ``blob``, ``ref``, ``inner``.

They describe content; :meth:`evergreen_trio.client.ClientSession.send` gives them ids and
sends their fragments. A :class:`NodeRef` names a node already in the session (an earlier
output, say), so it can be reused without sending it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CLIENT_ROLE = "user"
"""The ``role`` a client's chunk carries when its builder named none (the upstream proto: an unset role
must get a suitable default before it is sent)."""
SERVER_ROLE = "assistant"
"""The ``role`` of a chunk a server's action writes with ``mimetype=`` only (no ChunkMetadata of its own)."""


@dataclass(frozen=True)
class NodeRef:
    """A node already in the session, by id."""

    id: str


@dataclass(frozen=True)
class Leaf:
    """A leaf: parts (inline bytes or ``Ref`` URIs) concatenated in order, one fragment each."""

    parts: tuple[bytes | RefURI, ...]
    mimetype: str
    id: str | None = None
    role: str = ""
    """Empty: sent as `CLIENT_ROLE`."""


@dataclass(frozen=True)
class RefURI:
    uri: str


@dataclass(frozen=True)
class Inner:
    """An inner node: its children flatten in order."""

    children: tuple[NodeLike, ...]
    id: str | None = None


NodeLike = Leaf | Inner | NodeRef


def text(value: str, *, mimetype: str = "text/plain", id: str | None = None, role: str = "") -> Leaf:
    """A leaf of one UTF-8 fragment (``text/plain`` unless ``mimetype`` says otherwise); ``role``
    as :class:`~evergreen_trio.nodes.Leaf` says (empty: the sending side's default)."""
    return Leaf((value.encode(),), mimetype, id, role)


def blob(
    data: bytes | Sequence[bytes],
    *,
    mimetype: str = "application/octet-stream",
    id: str | None = None,
    role: str = "",
) -> Leaf:
    """Bytes; a sequence of byte strings is sent as that many fragments."""
    parts = (data,) if isinstance(data, bytes | bytearray | memoryview) else tuple(data)
    return Leaf(tuple(bytes(p) for p in parts), mimetype, id, role)


def ref(
    uri: str | Sequence[str], *, mimetype: str = "application/octet-stream", id: str | None = None, role: str = ""
) -> Leaf:
    """External content by URI; several URIs are concatenated in order (the spec's video parts)."""
    uris = (uri,) if isinstance(uri, str) else tuple(uri)
    return Leaf(tuple(RefURI(u) for u in uris), mimetype, id, role)


def inner(*children: NodeLike, id: str | None = None) -> Inner:
    """An inner node of ``children`` (nodes or NodeRefs), flattened in this order."""
    return Inner(children, id)
