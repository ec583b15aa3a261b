"""Flattening: the depth-first concatenation of the leaves' chunks, as a resumable cursor (sans-IO).

Spec: "The input and output of an action is the result of flattening the respective tree of
nodes into a list of chunks". The cursor walks what has arrived and says what it waits for,
so a consumer can stream the first leaf while later leaves and children are still on the way.
"""

from __future__ import annotations

from dataclasses import dataclass

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import ChunkMetadata
from evergreen_trio.dag.errors import LimitExceededError, ProtocolViolationError
from evergreen_trio.dag.graph import LeafPart, NodeKind, SessionGraph


@dataclass(frozen=True, slots=True)
class LeafStart:
    """A leaf's chunk begins; one flattened chunk per leaf. ``last``: no chunk follows it (everything
    after it in the walk has arrived and is empty); False when that is not known yet."""

    node_id: str
    metadata: ChunkMetadata
    last: bool = False


@dataclass(frozen=True, slots=True)
class LeafBytes:
    """The next part of the current leaf: inline bytes, or a ref to resolve. ``last``: it is the
    leaf's final part (the leaf's LeafEnd follows)."""

    node_id: str
    seq: int
    part: LeafPart
    last: bool = False


@dataclass(frozen=True, slots=True)
class LeafEnd:
    """The leaf ``node_id`` has no more bytes (its final fragment arrived)."""

    node_id: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing more until ``seq`` of ``node_id`` arrives."""

    node_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class Pause:
    """The walk took ``FlattenCursor.next``'s ``budget`` steps without an event: call it again
    (a shell lets other work run first)."""


FlattenEvent = LeafStart | LeafBytes | LeafEnd | Wait | Pause
"""What ``FlattenCursor.next`` returns while a walk is not done."""

_PAUSE = Pause()

_EMPTY_METADATA = ChunkMetadata()


class _Frame:
    __slots__ = ("children", "index", "node_id", "seq", "started")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.seq = 0
        self.children: tuple[str, ...] = ()
        self.index = 0
        self.started = False


class FlattenCursor:
    """Walks the DAG below ``root`` in flattening order; ``next()`` returns None when done.

    A shared node is repeated wherever it appears, and counted each time: past
    ``limits.max_flattened_nodes`` nodes entered or ``limits.max_flattened_bytes`` inline bytes, or depth
    beyond ``limits.max_depth``, it raises LimitExceededError before returning the event that
    crosses it; waiting for a node the peer can no longer send raises ProtocolViolationError.
    """

    def __init__(self, graph: SessionGraph, root: str) -> None:
        self._graph = graph
        self._stack = [_Frame(root)]
        self.nodes = 1
        """Nodes entered so far (the root included)."""
        self.bytes = 0
        """Inline bytes returned so far."""

    def next(self, budget: int | None = None) -> FlattenEvent | None:
        """The next event, a Wait when the next part has not arrived, or None when done; with a
        ``budget``, a Pause after that many steps through nodes without an event.

        Raises LimitExceededError past a limit and ProtocolViolationError when the part waited for
        can no longer arrive.
        """
        graph, stack = self._graph, self._stack
        nodes, limits = graph.nodes, graph.limits  # read on every step: no method call, no attribute chain
        steps = 0
        while stack:
            steps += 1
            if budget is not None and steps > budget:
                return _PAUSE
            frame = stack[-1]
            if frame.index < len(frame.children):
                child = frame.children[frame.index]
                frame.index += 1
                if len(stack) > limits.max_depth:  # the child would sit len(stack) levels below
                    raise LimitExceededError(f"node {child!r}: nesting deeper than {limits.max_depth}",
                                        limit="max_depth")
                self.nodes += 1
                if self.nodes > limits.max_flattened_nodes:
                    raise LimitExceededError(
                        f"node {child!r}: the input flattens through more than {limits.max_flattened_nodes} "
                        "nodes (shared nodes count each time)",
                        limit="max_flattened_nodes",
                    )
                stack.append(_Frame(child))
                continue
            node = nodes.get(frame.node_id)
            if node is None or frame.seq not in node.parts:
                if node is not None and node.final_seq is not None and frame.seq > node.final_seq:
                    stack.pop()
                    if frame.started:
                        return LeafEnd(frame.node_id)
                    continue
                return self._wait(frame.node_id, frame.seq)
            part = node.parts[frame.seq]
            if isinstance(part, LeafPart):
                if not frame.started:
                    frame.started = True
                    return LeafStart(node.id, node.metadata or _EMPTY_METADATA, self._nothing_after())
                self.bytes += len(part.data)
                if self.bytes > limits.max_flattened_bytes:
                    raise LimitExceededError(
                        f"node {node.id!r} seq {frame.seq}: the input flattens to more than "
                        f"{limits.max_flattened_bytes} bytes (shared nodes count each time)",
                        limit="max_flattened_bytes",
                    )
                frame.seq += 1
                return LeafBytes(node.id, frame.seq - 1, part, frame.seq - 1 == node.final_seq)
            frame.seq += 1
            if part is not None:
                frame.children, frame.index = part, 0
            elif node.kind is NodeKind.LEAF and not frame.started:
                frame.started = True
                return LeafStart(node.id, node.metadata or _EMPTY_METADATA, self._nothing_after())
        return None

    def _nothing_after(self) -> bool:
        """Whether every node above the current leaf has arrived whole and has no child left to walk.

        Stops at the first one that has (usually the leaf's parent, so O(1) a leaf), and is at most
        the depth the walk already went down to reach the leaf."""
        graph, stack = self._graph, self._stack
        for index in range(len(stack) - 2, -1, -1):
            frame = stack[index]
            if frame.index < len(frame.children):
                return False
            node = graph.get(frame.node_id)
            if node is None or node.final_seq is None or frame.seq <= node.final_seq:
                return False
        return True

    def _wait(self, node_id: str, seq: int) -> Wait:
        if not self._graph.can_arrive(node_id):
            raise ProtocolViolationError(
                f"node {node_id!r} seq {seq} is needed, but the peer ended its stream without it"
            )
        return Wait(node_id, seq)
