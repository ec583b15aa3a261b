"""Node values a client builds before sending: ``text``, ``blob``, ``ref``, ``inner``.

They describe content; :meth:`evergreen_trio.client.ClientSession.send` gives them ids and
sends their fragments. A :class:`NodeRef` names a node already in the session (an earlier
output, say), so it can be reused without sending it again.

Each is checked when it is built (raising :class:`~evergreen_trio.errors.ArgumentTypeError`):
``run`` sends the action before its new input nodes, so a node failing as it is sent would leave
the peer waiting for an input that never comes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any

from evergreen_trio.errors import ArgumentTypeError, describe_kind

CLIENT_ROLE = "user"
"""The ``role`` a client's chunk carries when its builder named none (the upstream proto: an unset role
must get a suitable default before it is sent)."""
SERVER_ROLE = "assistant"
"""The ``role`` of a chunk a server's action writes with ``mimetype=`` only (no ChunkMetadata of its own)."""


@dataclass(frozen=True)
class NodeRef:
    """A node already in the session, by id."""

    id: str

    def __post_init__(self) -> None:
        """Raises ArgumentTypeError for an id that is not a str or that UTF-8 cannot encode."""
        if type(self.id) is not str or not self.id.isascii():  # the common case: no call
            check_names("NodeRef", (("id", self.id),))


@dataclass(frozen=True)
class Leaf:
    """A leaf: parts (inline bytes or ``Ref`` URIs) concatenated in order, one fragment each."""

    parts: tuple[bytes | RefURI, ...]
    mimetype: str
    id: str | None = None
    role: str = ""
    """Empty: sent as `CLIENT_ROLE`."""

    def __post_init__(self) -> None:
        """Raises ArgumentTypeError for a part that is neither bytes nor a RefURI, and for a mimetype,
        role or id (None allowed) that is not a str or that UTF-8 cannot encode."""
        if not all(map(isinstance, self.parts, repeat((bytes, RefURI)))):
            index, part = next((i, p) for i, p in enumerate(self.parts) if not isinstance(p, bytes | RefURI))
            raise ArgumentTypeError(f"leaf: part {index} must be bytes or a RefURI, got {describe_kind(part)}")
        mimetype, role, node_id = self.mimetype, self.role, self.id
        # The common case (ASCII str, no id) without a call: text() builds one leaf per ECHO.
        if not (type(mimetype) is str and type(role) is str and mimetype.isascii() and role.isascii()
                and node_id is None):
            names = (("mimetype", mimetype), ("role", role))
            check_names("leaf", names if node_id is None else (*names, ("id", node_id)))


@dataclass(frozen=True)
class RefURI:
    uri: str

    def __post_init__(self) -> None:
        """Raises ArgumentTypeError for a URI that is not a str or that UTF-8 cannot encode."""
        if type(self.uri) is not str or not self.uri.isascii():
            check_names("ref", (("uri", self.uri),))


@dataclass(frozen=True)
class Inner:
    """An inner node: its children flatten in order."""

    children: tuple[NodeLike, ...]
    id: str | None = None

    def __post_init__(self) -> None:
        """Raises ArgumentTypeError for a child that is not a node and for an id (None allowed) that
        is not a str or that UTF-8 cannot encode."""
        # map and all: C speed over the 100,000 children an inner node may have.
        if not all(map(isinstance, self.children, repeat(_NODE_TYPES))):
            index, child = next((i, c) for i, c in enumerate(self.children) if not isinstance(c, _NODE_TYPES))
            raise ArgumentTypeError(f"inner: child {index} must be a node (text(), blob(), ref(), inner()) or a "
                                    f"NodeRef, got {describe_kind(child)}")
        if self.id is not None and (type(self.id) is not str or not self.id.isascii()):
            check_names("inner", (("id", self.id),))


NodeLike = Leaf | Inner | NodeRef
_NODE_TYPES = (Leaf, Inner, NodeRef)


def check_names(owner: str, names: Iterable[tuple[str, object]]) -> None:
    """Raises ArgumentTypeError naming the first of ``names`` (argument, value) that is not a str or
    holds a lone surrogate (protobuf's str fields refuse those as they are sent, with a raw error)."""
    for argument, value in names:
        if not isinstance(value, str):
            raise ArgumentTypeError(f"{owner}: {argument} must be a str, got {describe_kind(value)} {value!r:.80}")
        if not value.isascii():  # isascii reads a flag: the common case costs no encoding
            try:
                value.encode()
            except UnicodeEncodeError as error:
                raise ArgumentTypeError(_unencodable(f"{owner}: {argument}", value, error)) from None


def _unencodable(what: str, value: str, error: UnicodeEncodeError) -> str:
    """How an error names ``what``, a str UTF-8 cannot encode (a lone surrogate)."""
    return (f"{what} {value!r:.80} cannot be sent: UTF-8 cannot encode {value[error.start]!r} "
            f"at {error.start} ({error.reason})")


def text(value: str, *, mimetype: str = "text/plain", id: str | None = None, role: str = "") -> Leaf:
    """A leaf of one UTF-8 fragment (``text/plain`` unless ``mimetype`` says otherwise); ``role``
    as :class:`~evergreen_trio.nodes.Leaf` says (empty: the sending side's default)."""
    if not isinstance(value, str):
        hint = " (for bytes, use blob())" if isinstance(value, bytes | bytearray | memoryview) else ""
        raise ArgumentTypeError(f"text: value must be a str{hint}, got {describe_kind(value)}")
    try:
        data = value.encode()
    except UnicodeEncodeError as error:
        raise ArgumentTypeError(_unencodable("text: value", value, error)) from None
    return Leaf((data,), mimetype, id, role)


def blob(
    data: bytes | Sequence[bytes],
    *,
    mimetype: str = "application/octet-stream",
    id: str | None = None,
    role: str = "",
) -> Leaf:
    """Bytes; a sequence of byte strings is sent as that many fragments."""
    if isinstance(data, bytes | bytearray | memoryview):
        return Leaf((bytes(data),), mimetype, id, role)
    parts = _parts("blob", "data", "bytes or a sequence of bytes", data)
    for index, part in enumerate(parts):  # bytes(5) would be five zero bytes, not an error
        if not isinstance(part, bytes | bytearray | memoryview):
            raise ArgumentTypeError(f"blob: data[{index}] must be bytes, got {describe_kind(part)}")
    return Leaf(tuple(map(bytes, parts)), mimetype, id, role)


def ref(
    uri: str | Sequence[str], *, mimetype: str = "application/octet-stream", id: str | None = None, role: str = ""
) -> Leaf:
    """External content by URI; several URIs are concatenated in order (the spec's video parts)."""
    if isinstance(uri, str):
        return Leaf((RefURI(uri),), mimetype, id, role)
    return Leaf(tuple(map(RefURI, _parts("ref", "uri", "a str or a sequence of str", uri))), mimetype, id, role)


def _parts(caller: str, argument: str, takes: str, value: object) -> tuple[Any, ...]:
    """The parts of a multi-part ``value`` (any iterable but a str), or ArgumentTypeError naming ``argument``;
    the caller checks each part."""
    if isinstance(value, Iterable) and not isinstance(value, str):
        return tuple(value)
    hint = " (for a str, use text())" if isinstance(value, str) else ""
    raise ArgumentTypeError(f"{caller}: {argument} must be {takes}{hint}, got {describe_kind(value)}")


def inner(*children: NodeLike, id: str | None = None) -> Inner:
    """An inner node of ``children`` (nodes or NodeRefs), flattened in this order."""
    return Inner(children, id)
