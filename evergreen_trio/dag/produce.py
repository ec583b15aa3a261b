"""Building the fragments of a node this side produces (sans-IO): seq numbering, metadata on
seq 0 only, payloads split to the fragment size, and exactly one final fragment."""

from __future__ import annotations

from collections.abc import Iterable

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, ChunkMetadata, NodeFragment
from evergreen_trio.dag.errors import ProtocolViolationError


class FragmentBuilder:
    """Fragments for one node. ``last=True`` marks the final fragment; :meth:`close` sends an
    empty final fragment when none was marked (a producer streaming tokens learns it is done
    only after the last one went out)."""

    __slots__ = ("_fragment_bytes", "_leaf", "_seq", "closed", "node_id")

    def __init__(self, node_id: str, *, fragment_bytes: int = 1 << 20) -> None:
        self.node_id = node_id
        self._fragment_bytes = fragment_bytes
        self._seq = 0
        self._leaf: bool | None = None
        self.closed = False

    @property
    def started(self) -> bool:
        """A fragment was built already (so the metadata, which goes on seq 0, is settled)."""
        return self._seq > 0

    def _next(self, last: bool) -> NodeFragment:
        if self.closed:
            raise ProtocolViolationError(f"node {self.node_id!r}: written after its final fragment")
        fragment = NodeFragment(id=self.node_id, seq=self._seq, continued=not last)
        self._seq += 1
        self.closed = last
        return fragment

    def _kind(self, leaf: bool) -> None:
        if self._leaf is None:
            self._leaf = leaf
        elif self._leaf != leaf:
            raise ProtocolViolationError(f"node {self.node_id!r}: a node is a leaf or inner, not both")

    def data(self, payload: bytes, metadata: ChunkMetadata | None = None, *, last: bool = False) -> list[NodeFragment]:
        """Inline bytes, split into fragments of at most ``fragment_bytes``."""
        self._kind(True)
        size = self._fragment_bytes
        pieces = [payload] if len(payload) <= size else [payload[i : i + size] for i in range(0, len(payload), size)]
        out = []
        for index, piece in enumerate(pieces):
            fragment = self._next(last and index == len(pieces) - 1)
            chunk = fragment.chunk_fragment
            chunk.data = piece
            if fragment.seq == 0:
                chunk.metadata.CopyFrom(metadata or ChunkMetadata())
            out.append(fragment)
        return out

    def ref(self, uri: str, metadata: ChunkMetadata | None = None, *, last: bool = False) -> NodeFragment:
        """An external reference; its content is concatenated in seq order like inline data."""
        self._kind(True)
        fragment = self._next(last)
        fragment.chunk_fragment.ref = uri
        if fragment.seq == 0:
            fragment.chunk_fragment.metadata.CopyFrom(metadata or ChunkMetadata())
        return fragment

    def children(self, child_ids: Iterable[str], *, last: bool = False) -> NodeFragment:
        """The next fragment of an inner node, naming ``child_ids``; ProtocolViolationError if the node
        is a leaf or already closed."""
        self._kind(False)
        fragment = self._next(last)
        fragment.child_ids.extend(child_ids)
        return fragment

    def close(self) -> NodeFragment | None:
        """The final fragment, unless one was already sent."""
        if self.closed:
            return None
        fragment = self._next(True)
        if self._leaf:
            fragment.chunk_fragment.CopyFrom(Chunk())
            if fragment.seq == 0:
                fragment.chunk_fragment.metadata.CopyFrom(ChunkMetadata())
        return fragment
