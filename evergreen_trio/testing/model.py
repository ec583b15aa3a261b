"""A plain-Python model of Evergreen sessions, independent of any server: what a client sends,
what the action under test (ECHO, or any action with a reference function) must answer, and a
strict reading of what a server sent back.

Everything here is pure (no I/O, no event loop), so a test can state the expected result of a
session before running it, and a conformance run can judge a server with code that shares
nothing with the server under test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise
from typing import Any

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import (
    Action,
    ChunkMetadata,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from evergreen_trio.dag.errors import StatusCode
from evergreen_trio.errors import EvergreenTrioError


class ModelError(EvergreenTrioError):
    """What a server sent cannot be read as Evergreen nodes, or a model was built wrong."""


# --------------------------------------------------------------------------------------------
# Nodes


@dataclass(frozen=True)
class Meta:
    """Chunk metadata as a hashable value (the fields the kit generates)."""

    mimetype: str
    role: str = ""
    original_file_name: str = ""

    def proto(self) -> ChunkMetadata:
        """As the protobuf message."""
        return ChunkMetadata(mimetype=self.mimetype, role=self.role, original_file_name=self.original_file_name)

    @classmethod
    def of(cls, metadata: ChunkMetadata) -> Meta:
        """From the protobuf message."""
        return cls(metadata.mimetype, metadata.role, metadata.original_file_name)


@dataclass(frozen=True)
class LeafSpec:
    """A leaf: one chunk, its bytes the concatenation of its fragments' data."""

    meta: Meta
    data: bytes


@dataclass(frozen=True)
class InnerSpec:
    """An inner node: its children flatten in order; a child may appear several times."""

    children: tuple[str, ...]


@dataclass(frozen=True)
class FlatChunk:
    """One chunk of a flattened node."""

    meta: Meta
    data: bytes

    def __repr__(self) -> str:
        return f"({self.meta.mimetype!r}, {self.data!r})"


@dataclass(frozen=True)
class Produced:
    """A node the server produces, known by its expected flattening (the action's reference)."""

    chunks: tuple[FlatChunk, ...]


NodeSpec = LeafSpec | InnerSpec | Produced
"""A node of the model: a leaf, an inner node, or one a server produces."""


def flatten(nodes: Mapping[str, NodeSpec], root: str, *, limit: int = 1 << 20) -> list[FlatChunk]:
    """The expected flattening of ``root``: the depth-first concatenation of the leaves' chunks,
    a shared node repeated wherever it appears. Raises ModelError on a missing node, a cycle,
    or more than ``limit`` chunks."""
    out: list[FlatChunk] = []
    path: list[str] = []

    def walk(node_id: str) -> None:
        if node_id in path:
            raise ModelError(f"node {node_id!r} includes itself (path {' -> '.join([*path, node_id])})")
        node = nodes.get(node_id)
        if node is None:
            raise ModelError(f"node {node_id!r} is named but not in the model")
        if isinstance(node, Produced | LeafSpec):
            chunks = node.chunks if isinstance(node, Produced) else (FlatChunk(node.meta, node.data),)
            if len(out) + len(chunks) > limit:
                raise ModelError(f"flattening has more than {limit} chunks")
            out.extend(chunks)
            return
        path.append(node_id)
        for child in node.children:
            walk(child)
        path.pop()

    walk(root)
    return out


def depth(nodes: Mapping[str, NodeSpec], root: str) -> int:
    """Levels of inner nodes from ``root`` down to its deepest leaf (a leaf has depth 0)."""
    memo: dict[str, int] = {}

    def walk(node_id: str) -> int:
        if node_id not in memo:
            node = nodes[node_id]
            if isinstance(node, LeafSpec):
                memo[node_id] = 0
            elif isinstance(node, Produced):
                memo[node_id] = 1  # an inner node of leaves, as ECHO answers
            else:
                memo[node_id] = 1 + max((walk(c) for c in node.children), default=0)
        return memo[node_id]

    return walk(root)


# --------------------------------------------------------------------------------------------
# What goes on the wire


@dataclass(frozen=True)
class Frag:
    """One NodeFragment. ``chunk`` is (metadata or None, data) for a leaf fragment."""

    id: str
    seq: int
    continued: bool
    children: tuple[str, ...] = ()
    chunk: tuple[Meta | None, bytes] | None = None

    def proto(self) -> NodeFragment:
        """As the protobuf message."""
        fragment = NodeFragment(id=self.id, seq=self.seq, continued=self.continued, child_ids=self.children)
        if self.chunk is not None:
            meta, data = self.chunk
            fragment.chunk_fragment.data = data
            if meta is not None:
                fragment.chunk_fragment.metadata.CopyFrom(meta.proto())
        return fragment

    def __repr__(self) -> str:
        parts = [f"{self.id!r}#{self.seq}" + ("+" if self.continued else "")]
        if self.children:
            parts.append(f"children={list(self.children)!r}")
        if self.chunk is not None:
            meta, data = self.chunk
            if meta is not None:
                parts.append(f"meta={meta.mimetype!r}" + (f"/{meta.role!r}" if meta.role else ""))
            parts.append(f"data={data[:16]!r}" + (f"..({len(data)}B)" if len(data) > 16 else ""))
        return "Frag(" + " ".join(parts) + ")"


@dataclass(frozen=True)
class Act:
    """One Action: ``inputs`` and ``outputs`` are (parameter name, node id) pairs."""

    name: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]

    def proto(self) -> Action:
        """As the protobuf message."""
        return Action(
            name=self.name,
            inputs=[NamedParameter(name=n, id=i) for n, i in self.inputs],
            outputs=[NamedParameter(name=n, id=i) for n, i in self.outputs],
        )

    def __repr__(self) -> str:
        ins = ", ".join(f"{n}={i!r}" for n, i in self.inputs)
        outs = ", ".join(f"{n}={i!r}" for n, i in self.outputs)
        return f"Act({self.name} in[{ins}] out[{outs}])"


Item = Frag | Act
"""One thing a client sends: a fragment or an action."""


def echo(input_id: str, output_id: str) -> Act:
    """An ECHO action from ``input_id`` to ``output_id``."""
    return ECHO.act(Call((input_id,), (output_id,)))


Reference = Callable[[Mapping[str, list[FlatChunk]]], Mapping[str, Sequence[FlatChunk]]]
"""Given each input parameter's flattened chunks, the expected flattening of each output."""


@dataclass(frozen=True)
class Call:
    """One call of the action under test: node ids for its inputs and its outputs, in the order
    of the :class:`ActionUnderTest`'s ``inputs`` and ``outputs``."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class ActionUnderTest:
    """An action a server offers, as the kit drives it: its name, input and output parameter
    names, and ``reference``, a pure function giving the expected outputs for given inputs.

    ``leaves_only`` also requires each output to be an inner node whose children are leaves
    (ECHO's shape); otherwise only an output's flattening is compared.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reference: Reference
    leaves_only: bool = False

    def __post_init__(self) -> None:
        if not self.inputs or not self.outputs:
            raise ModelError(f"action {self.name!r}: the kit needs at least one input and one output")
        if len(set(self.inputs)) != len(self.inputs) or len(set(self.outputs)) != len(self.outputs):
            raise ModelError(f"action {self.name!r}: parameter names repeat")

    def act(self, call: Call) -> Act:
        """The wire Action for ``call``."""
        return Act(self.name, tuple(zip(self.inputs, call.inputs, strict=True)),
                   tuple(zip(self.outputs, call.outputs, strict=True)))

    def expect(self, flattened: Mapping[str, list[FlatChunk]]) -> dict[str, tuple[FlatChunk, ...]]:
        """The reference's outputs for ``flattened`` inputs, checked to name every output."""
        got = self.reference(flattened)
        missing = set(self.outputs) - set(got)
        if missing:
            raise ModelError(f"the reference of {self.name!r} gave no {sorted(missing)}")
        return {name: tuple(got[name]) for name in self.outputs}


ECHO = ActionUnderTest("ECHO", ("input",), ("output",), lambda inputs: {"output": inputs["input"]}, leaves_only=True)
"""The spec's ECHO: its output flattens exactly as its input, as an inner node of leaves."""


def split_leaf(node_id: str, leaf: LeafSpec, cuts: Sequence[int] = (), *, repeat_meta: bool = False) -> list[Frag]:
    """A leaf's fragments, its data cut at ``cuts`` (sorted offsets); metadata on seq 0
    (and repeated, identical, on later seqs when ``repeat_meta``: the spec's own example does)."""
    bounds = [0, *cuts, len(leaf.data)]
    last = len(bounds) - 2
    return [
        Frag(node_id, seq, seq < last, chunk=(leaf.meta if seq == 0 or repeat_meta else None, leaf.data[a:b]))
        for seq, (a, b) in enumerate(pairwise(bounds))
    ]


def split_inner(node_id: str, inner: InnerSpec, cuts: Sequence[int] = ()) -> list[Frag]:
    """An inner node's fragments, its child list cut at ``cuts`` (sorted, each piece non-empty)."""
    bounds = [0, *cuts, len(inner.children)]
    last = len(bounds) - 2
    return [
        Frag(node_id, seq, seq < last, children=inner.children[a:b])
        for seq, (a, b) in enumerate(pairwise(bounds))
    ]


def fragments_of(nodes: Mapping[str, NodeSpec]) -> list[Frag]:
    """Every client node as one fragment each, in insertion order (the simplest delivery)."""
    out: list[Frag] = []
    for node_id, node in nodes.items():
        if isinstance(node, LeafSpec):
            out.extend(split_leaf(node_id, node))
        elif isinstance(node, InnerSpec):
            out.extend(split_inner(node_id, node))
    return out


def to_messages(items: Sequence[Item], groups: Sequence[int] = ()) -> list[SessionMessage]:
    """Pack ``items`` into SessionMessages, a new message starting at each index in ``groups``.

    Within one message actions precede fragments, so a message starts wherever an action
    follows a fragment: the receiver then sees every item in the order given.
    """
    starts = set(groups)
    messages: list[SessionMessage] = []
    current = SessionMessage()
    for index, item in enumerate(items):
        split = index in starts or (isinstance(item, Act) and len(current.node_fragments) > 0)
        if split and (current.node_fragments or current.actions):
            messages.append(current)
            current = SessionMessage()
        if isinstance(item, Act):
            current.actions.append(item.proto())
        else:
            current.node_fragments.append(item.proto())
    if current.node_fragments or current.actions:
        messages.append(current)
    return messages


# --------------------------------------------------------------------------------------------
# Plans: a session to play and what it must end with


class Violation(Enum):
    """A rule an invalid session breaks, with the status our server answers (any non-OK status
    is an abort for the specification, which names no codes)."""

    CYCLE = ("cycle", StatusCode.INVALID_ARGUMENT)
    SEQ_PAST_FINAL = ("seq past final", StatusCode.INVALID_ARGUMENT)
    CHANGED_METADATA = ("changed metadata", StatusCode.INVALID_ARGUMENT)
    LEAF_AND_INNER = ("leaf and inner mixed", StatusCode.INVALID_ARGUMENT)
    REUSED_OUTPUT_ID = ("reused output id", StatusCode.INVALID_ARGUMENT)
    OVER_LIMIT = ("over-limit size", StatusCode.RESOURCE_EXHAUSTED)

    def __init__(self, label: str, code: StatusCode) -> None:
        self.label = label
        self.code = code


@dataclass(frozen=True)
class Plan:
    """One session: the client's nodes, the calls of ``action`` (ECHO unless another is given),
    the items in delivery order, and where messages split. ``violation`` is None for a valid
    session."""

    nodes: Mapping[str, NodeSpec]
    calls: tuple[Call, ...]
    items: tuple[Item, ...]
    groups: tuple[int, ...] = ()
    violation: Violation | None = None
    note: str = ""
    action: ActionUnderTest = ECHO

    def messages(self) -> list[SessionMessage]:
        """The plan's items packed into SessionMessages, split where ``groups`` says."""
        return to_messages(self.items, self.groups)

    def model(self) -> dict[str, NodeSpec]:
        """Client nodes plus every call's outputs (as their expected flattening), for :func:`flatten`.

        Calls are resolved in order: a call may read an earlier call's outputs.
        """
        model: dict[str, NodeSpec] = dict(self.nodes)
        for call in self.calls:
            inputs = {name: flatten(model, node_id) for name, node_id in zip(self.action.inputs, call.inputs,
                                                                              strict=True)}
            expected = self.action.expect(inputs)
            for name, node_id in zip(self.action.outputs, call.outputs, strict=True):
                model[node_id] = Produced(expected[name])
        return model

    def expected(self) -> dict[str, list[FlatChunk]]:
        """Each output id's expected flattening."""
        model = self.model()
        return {out: flatten(model, out) for call in self.calls for out in call.outputs}

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        """Hypothesis (and IPython) print counterexamples through this: one item per line."""
        printer.text(repr(self))

    def __repr__(self) -> str:
        head = f"Plan({self.violation.label!r}, {self.note!r})" if self.violation else "Plan(valid)"
        lines = [head, *(f"  {item!r}" for item in self.items)]
        if self.groups:
            lines.append(f"  message splits at {list(self.groups)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Reading what a server sent


@dataclass
class _Assembly:
    parts: dict[int, Frag] = field(default_factory=dict)
    final: int | None = None


def reassemble(fragments: Iterable[Frag]) -> dict[str, NodeSpec]:
    """Nodes from a server's fragments, checked against the fragment rules a producer must keep:
    seqs 0..final all present and none past the final, metadata on seq 0 (a later fragment may
    only repeat it), a node a leaf or inner but not both. A repeated (id, seq) keeps the first.
    Raises ModelError naming the node at fault."""
    by_id: dict[str, _Assembly] = {}
    for fragment in fragments:
        node = by_id.setdefault(fragment.id, _Assembly())
        if fragment.seq in node.parts:
            continue
        node.parts[fragment.seq] = fragment
        if not fragment.continued:
            if node.final is not None:
                raise ModelError(f"node {fragment.id!r}: final fragments at seq {node.final} and {fragment.seq}")
            node.final = fragment.seq
    return {node_id: _assemble(node_id, node) for node_id, node in by_id.items()}


def _assemble(node_id: str, node: _Assembly) -> NodeSpec:
    if node.final is None:
        raise ModelError(f"node {node_id!r}: no final fragment (seqs {sorted(node.parts)})")
    if sorted(node.parts) != list(range(node.final + 1)):
        raise ModelError(f"node {node_id!r}: seqs {sorted(node.parts)}, expected 0..{node.final}")
    ordered = [node.parts[seq] for seq in range(node.final + 1)]
    leaf = [f for f in ordered if f.chunk is not None]
    inner = [f for f in ordered if f.children]
    if leaf and inner:
        raise ModelError(f"node {node_id!r}: both chunk and child_ids fragments")
    if not leaf:
        return InnerSpec(tuple(c for f in inner for c in f.children))
    first = ordered[0].chunk
    if first is None or first[0] is None:
        raise ModelError(f"node {node_id!r}: seq 0 carries no metadata")
    meta = first[0]
    for fragment in ordered[1:]:
        if fragment.chunk is not None and fragment.chunk[0] not in (None, meta):
            raise ModelError(f"node {node_id!r} seq {fragment.seq}: metadata differs from seq 0's")
    return LeafSpec(meta, b"".join(f.chunk[1] for f in leaf if f.chunk is not None))


def frag_of(fragment: NodeFragment) -> Frag:
    """The model of a received NodeFragment (a ref payload reads as its URI's bytes)."""
    chunk: tuple[Meta | None, bytes] | None = None
    if fragment.HasField("chunk_fragment"):
        c = fragment.chunk_fragment
        payload = c.ref.encode() if c.WhichOneof("payload") == "ref" else c.data
        chunk = (Meta.of(c.metadata) if c.HasField("metadata") else None, payload)
    return Frag(fragment.id, fragment.seq, fragment.continued, tuple(fragment.child_ids), chunk)


def iter_frags(messages: Iterable[SessionMessage]) -> Iterator[Frag]:
    """Every fragment of ``messages``, in order, as the model reads it."""
    for message in messages:
        for fragment in message.node_fragments:
            yield frag_of(fragment)


__all__ = [
    "ECHO",
    "Act",
    "ActionUnderTest",
    "Call",
    "FlatChunk",
    "Frag",
    "InnerSpec",
    "Item",
    "LeafSpec",
    "Meta",
    "ModelError",
    "NodeSpec",
    "Plan",
    "Produced",
    "Reference",
    "Violation",
    "depth",
    "echo",
    "flatten",
    "frag_of",
    "fragments_of",
    "iter_frags",
    "reassemble",
    "split_inner",
    "split_leaf",
    "to_messages",
]
