"""The session's node graph and the spec's fragment rules, as plain bookkeeping (sans-IO).

Each rule cites the specification (evergreen-spec, "Data model description").
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from enum import Enum
from itertools import repeat

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import ChunkMetadata, NodeFragment
from evergreen_trio.dag.errors import LimitExceededError, ProtocolViolationError, RefRejectedError
from evergreen_trio.dag.limits import SessionLimits

ATTACH_STEP = 8192
"""A fragment's children are attached (checked for cycles and depth, their parents recorded) this
many at a time: the rest wait for :meth:`SessionGraph.attach_more`, which the session calls between
scheduling passes (100,000 children in one fragment took 50-130 ms of one step, on each side)."""


class NodeKind(Enum):
    """What a node turned out to be, from its first fragment with a payload."""

    UNKNOWN = "unknown"
    """Only fragments without payload so far."""
    LEAF = "leaf"
    INNER = "inner"


@dataclass(frozen=True, slots=True)
class LeafPart:
    """One fragment's share of a leaf: inline bytes, or an external ref (URI)."""

    data: bytes
    ref: str | None = None


Part = LeafPart | tuple[str, ...] | None
"""A leaf part, an inner part (child ids), or None for a fragment that carries neither."""


class Node:
    """What has arrived of one node."""

    __slots__ = ("_later_metadata", "final_seq", "id", "kind", "local", "metadata", "parts")

    def __init__(self, node_id: str, *, local: bool) -> None:
        self.id = node_id
        self.kind = NodeKind.UNKNOWN
        self.parts: dict[int, Part] = {}
        self.final_seq: int | None = None
        self.metadata: ChunkMetadata | None = None
        self.local = local
        # Metadata seen on a fragment after seq 0 that arrived before seq 0: checked when seq 0 comes.
        self._later_metadata: list[tuple[int, ChunkMetadata]] | None = None

    @property
    def complete(self) -> bool:
        """Every part up to the final one has arrived."""
        return self.final_seq is not None and len(self.parts) == self.final_seq + 1

    @property
    def mimetype(self) -> str:
        """The leaf's mimetype, empty for an inner node or before its metadata arrives."""
        return self.metadata.mimetype if self.metadata is not None else ""


class SessionGraph:
    """All nodes of one session, received and produced, with the rules that guard them.

    ``add_fragment`` returns True when the fragment changed the graph and False for a retried
    (id, seq), and raises a :class:`~evergreen_trio.dag.errors.SessionError` for anything
    that must abort the session.
    """

    def __init__(self, limits: SessionLimits | None = None, *, ref_schemes: frozenset[str] = frozenset()) -> None:
        self.limits = limits or SessionLimits()
        self.ref_schemes = ref_schemes
        self.nodes: dict[str, Node] = {}
        self.buffered_bytes = 0
        self.parts = 0
        """Fragments held and the child ids they name (``limits.max_parts``)."""
        self.peer_closed = False
        # Output ids named by actions: id -> (produced on this side?, the action that owns it).
        self._outputs: dict[str, tuple[bool, object]] = {}
        # Heights (longest path down; absent: 0) and parents of every id named as a child, arrived or not.
        self._height: dict[str, int] = {}
        self._parents: dict[str, str | list[str]] = {}
        # Fragments whose children are attached in steps: (parent, children, the next one's index, the
        # fragment's id and seq, for error messages).
        self._attaching: deque[tuple[str, tuple[str, ...], int, tuple[str, int]]] = deque()
        self.attaching = False
        """Children of a fragment with more than ``ATTACH_STEP`` of them wait for :meth:`attach_more`
        (an attribute, not a property: it is read after every fragment)."""

    def forget(self, budget: int) -> bool:
        """Drop up to ``budget`` entries of what the graph holds (nodes, outputs, heights, parents);
        True once it holds nothing. A session over: its graph may hold a million nodes, whose
        freeing at once took 0.1-1 s on the one thread."""
        self._attaching.clear()
        self.attaching = False
        for table in (self.nodes, self._outputs, self._height, self._parents):
            while table and budget > 0:
                table.popitem()
                budget -= 1
        return not (self.nodes or self._outputs or self._height or self._parents)

    def get(self, node_id: str) -> Node | None:
        """The node ``node_id``, or None when no fragment of it has arrived."""
        return self.nodes.get(node_id)

    def reserve_output(self, node_id: str, owner: object, *, local: bool) -> None:
        """Claim ``node_id`` for an action's output; ``owner`` names the action in error messages (as
        ``str(owner)``, made only then). Spec: "The provided node IDs in the output must be new"."""
        if not node_id:
            raise ProtocolViolationError(f"{owner}: an output needs a node id, got an empty one")
        if node_id in self.nodes or node_id in self._outputs:  # not is_new(), inline: claimed per output
            raise ProtocolViolationError(f"{owner}: output node id {node_id!r} is not new in this session")
        self._outputs[node_id] = (local, owner)

    def is_new(self, node_id: str) -> bool:
        """Neither a node of this session nor an id already claimed for an output."""
        return node_id not in self.nodes and node_id not in self._outputs

    def can_arrive(self, node_id: str) -> bool:
        """Whether parts of ``node_id`` may still come: produced here, or the peer has not ended its stream."""
        owner = self._outputs.get(node_id)
        node = self.nodes.get(node_id)
        local = owner[0] if owner is not None else (node is not None and node.local)
        return local or not self.peer_closed

    def add_fragment(self, fragment: NodeFragment, *, local: bool = False) -> bool:
        """Add one fragment (``local``: produced on this side); True when it changed the graph.

        Raises ProtocolViolationError for a fragment breaking the spec's rules,
        LimitExceededError past ``limits`` and RefRejectedError for a ref of a disabled scheme.
        """
        node_id, seq = fragment.id, fragment.seq
        if not node_id:
            raise ProtocolViolationError(f"a node fragment needs an id, got an empty one (seq {seq})")
        if seq < 0:
            raise ProtocolViolationError(f"{_at((node_id, seq))}: seq must be >= 0")
        node = self.nodes.get(node_id)
        if node is None:
            owner = self._outputs.get(node_id)
            if owner is not None and owner[0] != local:
                side = "this side" if owner[0] else "the peer"
                raise ProtocolViolationError(
                    f"{_where(fragment)}: the node is the output of {owner[1]}, produced by {side}")
            if len(self.nodes) >= self.limits.max_nodes:
                raise LimitExceededError(
                    f"{_where(fragment)}: the session holds {len(self.nodes)} nodes, the limit", limit="max_nodes"
                )
            # The id is kept as long as the session (the node's key): ids of a message's size each would
            # otherwise hold max_nodes times that, uncounted.
            held = self.buffered_bytes + len(node_id)
            if held > self.limits.max_buffered_bytes:
                raise LimitExceededError(
                    f"{_where(fragment)}: with its id of {len(node_id)} characters the session would hold {held} "
                    f"bytes, limit {self.limits.max_buffered_bytes}", limit="max_buffered_bytes")
            self.buffered_bytes = held
            node = Node(node_id, local=local)
            self.nodes[node_id] = node
        elif node.local != local:
            raise ProtocolViolationError(f"{_where(fragment)}: the node is produced by the other side")
        parts = node.parts
        # Spec, Ordering: "accept the first received NodeFragment ... with that seq number, and ignore the rest".
        if seq in parts:
            return False
        continued = fragment.continued
        if parts:
            self._check_boundary(node, seq, continued, fragment)
        part = self._part(node, fragment)
        held = self.parts + 1 + (len(part) if isinstance(part, tuple) else 0)
        if held > self.limits.max_parts:
            raise LimitExceededError(
                f"{_where(fragment)}: the session would hold {held} fragments and child ids, "
                f"limit {self.limits.max_parts}", limit="max_parts")
        self.parts = held
        if isinstance(part, tuple) and part:
            where = (node_id, seq)  # formatted only in an error message
            if self._attaching:  # edges are attached in the order they arrive
                self.attach_more(sys.maxsize)
            if node_id in part:
                raise ProtocolViolationError(f"{_at(where)}: child {node_id!r} makes the node include itself")
            self._attach(node_id, part[:ATTACH_STEP], where, part)
            if len(part) > ATTACH_STEP:
                self._attaching.append((node_id, part, ATTACH_STEP, where))
                self.attaching = True
        parts[seq] = part
        if not continued:
            node.final_seq = seq
        return True

    @staticmethod
    def _check_boundary(node: Node, seq: int, continued: bool, fragment: NodeFragment) -> None:
        # Spec, Boundaries: a seq greater than the final fragment's aborts the session.
        if node.final_seq is not None and seq > node.final_seq:
            raise ProtocolViolationError(f"{_where(fragment)}: seq is past the final fragment (seq {node.final_seq})")
        if not continued and max(node.parts) > seq:
            raise ProtocolViolationError(
                f"{_where(fragment)}: final fragment, but seq {max(node.parts)} has already arrived")

    def _part(self, node: Node, fragment: NodeFragment) -> Part:
        if fragment.HasField("chunk_fragment"):
            if fragment.child_ids:
                raise ProtocolViolationError(
                    f"{_where(fragment)}: a fragment carries a chunk and child_ids; a node is a leaf or inner"
                )
            kind = NodeKind.LEAF
        elif fragment.child_ids:
            kind = NodeKind.INNER
        else:
            return None
        if node.kind is not kind and node.kind is not NodeKind.UNKNOWN:
            raise ProtocolViolationError(
                f"{_where(fragment)}: {kind.value} fragment for a node that is {node.kind.value}")
        if kind is NodeKind.INNER:
            children = tuple(fragment.child_ids)
            if len(children) > self.limits.max_children_per_fragment:
                raise LimitExceededError(
                    f"{_where(fragment)}: {len(children)} child_ids, limit {self.limits.max_children_per_fragment}",
                    limit="max_children_per_fragment",
                )
            # Child ids are kept as long as the session: counted as inline bytes are (sum and map: C speed).
            held = self.buffered_bytes + sum(map(len, children))
            if held > self.limits.max_buffered_bytes:
                raise LimitExceededError(
                    f"{_where(fragment)}: with its {len(children)} child ids the session would hold {held} bytes, "
                    f"limit {self.limits.max_buffered_bytes}", limit="max_buffered_bytes")
            self.buffered_bytes = held
            node.kind = kind
            return children
        chunk = fragment.chunk_fragment
        data = chunk.data
        limits = self.limits
        if len(data) > limits.max_fragment_bytes:
            raise LimitExceededError(
                f"{_where(fragment)}: {len(data)} bytes in one fragment, limit {limits.max_fragment_bytes}",
                limit="max_fragment_bytes",
            )
        ref = chunk.ref if not data and chunk.WhichOneof("payload") == "ref" else None  # data: not a ref
        held = self.buffered_bytes + (len(data) if ref is None else len(ref))  # a ref's URI is held as bytes are
        if held > limits.max_buffered_bytes:
            raise LimitExceededError(
                f"{_where(fragment)}: the session would hold {held} bytes, limit {limits.max_buffered_bytes}",
                limit="max_buffered_bytes",
            )
        if ref is not None and not node.local:
            scheme = ref.partition(":")[0].lower()
            if scheme not in self.ref_schemes:
                allowed = ", ".join(sorted(self.ref_schemes)) or "none"
                raise RefRejectedError(
                    f"{_where(fragment)}: ref {ref!r} uses scheme {scheme!r}; this side resolves: {allowed}")
        if fragment.seq == 0 or chunk.HasField("metadata"):
            self._check_metadata(node, fragment)
        self.buffered_bytes = held
        node.kind = kind
        return LeafPart(data, ref)

    @staticmethod
    def _check_metadata(node: Node, fragment: NodeFragment) -> None:
        # Spec, Mime type: metadata belongs to seq 0. A later fragment may repeat it (the spec's own
        # example does); different metadata on a later fragment aborts the session.
        chunk = fragment.chunk_fragment
        if fragment.seq == 0:
            metadata = ChunkMetadata()
            metadata.CopyFrom(chunk.metadata)
            for later_seq, later in node._later_metadata or ():
                if later != metadata:
                    raise ProtocolViolationError(f"node {node.id!r} seq {later_seq}: metadata differs from seq 0's")
            node.metadata, node._later_metadata = metadata, None
        elif chunk.HasField("metadata"):
            if node.metadata is not None:
                if chunk.metadata != node.metadata:
                    raise ProtocolViolationError(f"{_where(fragment)}: metadata differs from seq 0's")
            else:
                later = ChunkMetadata()
                later.CopyFrom(chunk.metadata)
                if node._later_metadata is None:
                    node._later_metadata = []
                node._later_metadata.append((fragment.seq, later))  # in place: a copy per fragment was quadratic

    def attach_more(self, budget: int = 0) -> None:
        """Attach up to ``budget`` (default ``ATTACH_STEP``) more of the waiting children (their
        cycle and depth checks). Raises as :meth:`add_fragment` would have for them."""
        budget = budget or ATTACH_STEP
        while self._attaching and budget > 0:
            parent, children, start, where = self._attaching[0]
            end = min(len(children), start + budget)
            budget -= end - start
            if end == len(children):
                self._attaching.popleft()
                self.attaching = bool(self._attaching)
            else:
                self._attaching[0] = (parent, children, end, where)
            self._attach(parent, children[start:end], where, children)

    def _attach(self, parent: str, children: tuple[str, ...], where: tuple[str, int], whole: tuple[str, ...]) -> None:
        """Record the edges ``parent -> children`` (a step of the fragment's ``whole`` list, which
        names no ``parent``), keeping every id's height (the longest path below it).

        Spec, Ordering: "nodes cannot transitively include themselves"; and no node may have more
        than ``max_depth`` levels below it. Heights only grow and never past ``max_depth``, so over a
        session each id's height is raised at most ``max_depth`` times, each time visiting its
        parents: the work is at most ``max_depth`` visits per edge received, whatever the graph
        already holds (checking a fragment never re-walks what lies below its children).
        """
        # Map and set operations, not a loop per child: C speed for the 8,192 children of a step.
        distinct = frozenset(children)
        parents, height = self._parents, self._height
        named = parents.keys() & distinct
        # Ids named as children are nodes to be: they count against max_nodes before they arrive.
        if len(parents) + len(distinct) - len(named) > self.limits.max_nodes:
            raise LimitExceededError(f"{_at(where)}: the session names more than {self.limits.max_nodes} nodes "
                                     "as children, the limit", limit="max_nodes")
        needed = max(map(self._height.get, distinct, repeat(0))) + 1
        # An edge parent -> child closes a cycle only if child is above parent, hence higher:
        # then parent's height must grow, and the growth climbs to child.
        if needed > height.get(parent, 0):
            if parent in parents or needed > self.limits.max_depth:
                self._raise_height(parent, needed, distinct, where, whole)
            else:  # a node nobody names as a child (a new one, mostly): nothing above it to climb
                height[parent] = needed
        for child in named:
            above = parents[child]
            if isinstance(above, str):
                if above != parent:
                    parents[child] = [above, parent]
            elif above[-1] != parent:
                above.append(parent)
        parents.update(dict.fromkeys(distinct - named if named else distinct, parent))

    def _raise_height(self, start: str, new_height: int, children: frozenset[str], where: tuple[str, int],
                      whole: tuple[str, ...]) -> None:
        """Raise ``start`` to ``new_height`` and its ancestors as far as needed; reaching one of
        ``children`` (the fragment's new children of ``start``) is a cycle."""
        max_depth, height = self.limits.max_depth, self._height
        stack = [(start, new_height)]
        while stack:
            node_id, value = stack.pop()
            if value <= height.get(node_id, 0):
                continue  # raised as far by another path meanwhile
            if value > max_depth:
                looped = self._ancestor_among(start, frozenset(whole))  # a cycle later in the fragment too
                if looped is not None:
                    raise ProtocolViolationError(f"{_at(where)}: child {looped!r} makes the node include itself")
                raise LimitExceededError(f"{_at(where)}: nesting below {node_id!r} is deeper than {max_depth}",
                                         limit="max_depth")
            height[node_id] = value
            for above in self._parents_of(node_id):
                if above in children:
                    raise ProtocolViolationError(f"{_at(where)}: child {above!r} makes the node include itself")
                stack.append((above, value + 1))

    def _parents_of(self, node_id: str) -> list[str]:
        above = self._parents.get(node_id)
        return [] if above is None else [above] if isinstance(above, str) else above

    def _ancestor_among(self, node_id: str, candidates: frozenset[str]) -> str | None:
        """One of ``candidates`` that is an ancestor of ``node_id``, or None: a plain walk up, each id
        once, run only when the session aborts anyway, to tell a cycle from nesting too deep."""
        seen = {node_id}
        stack = [node_id]
        while stack:
            for above in self._parents_of(stack.pop()):
                if above in candidates:
                    return above
                if above not in seen:
                    seen.add(above)
                    stack.append(above)
        return None


def _where(fragment: NodeFragment) -> str:
    """How an error names a fragment (built only when one is raised)."""
    return _at((fragment.id, fragment.seq))


ID_CHARS = 64
"""An error quotes this many characters of a longer node id: the status message keeps 512, and what
crossed a limit must still show after a peer's id of megabytes."""


def _at(where: tuple[str, int]) -> str:
    """How an error names a fragment by its id and seq."""
    node_id = where[0]
    if len(node_id) > ID_CHARS:
        return f"node {node_id[:ID_CHARS]!r}... ({len(node_id)} characters) seq {where[1]}"
    return f"node {node_id!r} seq {where[1]}"
