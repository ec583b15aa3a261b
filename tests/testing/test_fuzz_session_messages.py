"""SessionMessage handling in the DAG core under fuzzing: arbitrary bytes parsed as a
SessionMessage (protobuf's DecodeError is the parser's typed refusal), and arbitrary or
mutated messages fed to SessionGraph and walked with FlattenCursor. Nothing but a
SessionError may come out."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import (
    Action,
    Chunk,
    ChunkMetadata,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from evergreen_trio.dag import FlattenCursor, SessionError, SessionGraph, SessionLimits, Wait
from evergreen_trio.testing.model import Plan
from evergreen_trio.testing.strategies import sessions

LIMITS = SessionLimits(
    max_nodes=64, max_buffered_bytes=4096, max_fragment_bytes=512, max_depth=16, max_children_per_fragment=16
)
STEPS = 2_000
"""Flattening events walked per root: a shared DAG may flatten to exponentially many chunks."""

IDS = st.sampled_from(["", "a", "b", "c", "d", "o"])


def _handle(messages: list[SessionMessage]) -> None:
    """What a server does with received messages, minus the waiting: claim outputs, add
    fragments, and once the peer has ended its stream, walk every input and node."""
    graph = SessionGraph(LIMITS, ref_schemes=frozenset({"file"}))
    inputs: list[str] = []
    try:
        for message in messages:
            for action in message.actions:
                inputs.extend(p.id for p in action.inputs)
                for param in action.outputs:
                    graph.reserve_output(param.id, f"action {action.name!r}", local=True)
            for fragment in message.node_fragments:
                graph.add_fragment(fragment)
        graph.peer_closed = True
        for root in [*inputs, *list(graph.nodes)]:
            cursor = FlattenCursor(graph, root)
            for _ in range(STEPS):
                event = cursor.next()
                if event is None or isinstance(event, Wait):
                    break
    except SessionError:
        pass


@pytest.mark.fuzz
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data: bytes) -> None:
    try:
        message = SessionMessage.FromString(data)
    except DecodeError:
        return
    _handle([message])


_metadata = st.builds(ChunkMetadata, mimetype=st.sampled_from(["", "text/plain", "image/png"]))
_chunk = st.one_of(
    st.builds(Chunk, metadata=_metadata, data=st.binary(max_size=600)),
    st.builds(Chunk, data=st.binary(max_size=8)),
    st.builds(Chunk, metadata=_metadata, ref=st.sampled_from(["file:///x", "http://x", "", "no-scheme"])),
)
_fragment = st.builds(
    NodeFragment,
    id=IDS,
    seq=st.integers(-2, 6),
    continued=st.booleans(),
    child_ids=st.lists(IDS, max_size=20),
    chunk_fragment=st.one_of(st.none(), _chunk),
)
_param = st.builds(NamedParameter, name=st.sampled_from(["input", "output", ""]), id=IDS)
_action = st.builds(Action, name=st.sampled_from(["ECHO", ""]), inputs=st.lists(_param, max_size=2),
                    outputs=st.lists(_param, max_size=2))
_message = st.builds(SessionMessage, node_fragments=st.lists(_fragment, max_size=12),
                     actions=st.lists(_action, max_size=2))


@pytest.mark.fuzz
@given(st.lists(_message, min_size=1, max_size=4))
def test_arbitrary_messages(messages: list[SessionMessage]) -> None:
    _handle(messages)


@pytest.mark.fuzz
@given(sessions(), st.data())
def test_mutated_valid_sessions(plan: Plan, data: st.DataObject) -> None:
    wire = bytearray(b"".join(m.SerializeToString() for m in plan.messages()[:1]))
    for _ in range(data.draw(st.integers(1, 8))):
        if wire:
            index = data.draw(st.integers(0, len(wire) - 1))
            wire[index] = data.draw(st.integers(0, 255))
    try:
        message = SessionMessage.FromString(bytes(wire))
    except DecodeError:
        return
    _handle([message, *plan.messages()[1:]])
