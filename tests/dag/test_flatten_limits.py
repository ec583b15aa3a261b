"""Issue 22, item 3: flattening counts a shared node each time it is repeated, and stops at the limits."""

from __future__ import annotations

import pytest

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, NodeFragment
from evergreen_trio.dag import (
    FlattenCursor,
    FlattenEvent,
    LeafBytes,
    LimitExceededError,
    Pause,
    SessionGraph,
    SessionLimits,
    StatusCode,
)


def shared(limits: SessionLimits, times: int, data: bytes = b"0123456789") -> SessionGraph:
    """``root`` naming one leaf ``times`` times."""
    graph = SessionGraph(limits)
    graph.add_fragment(NodeFragment(id="leaf", chunk_fragment=Chunk(data=data)))
    graph.add_fragment(NodeFragment(id="root", child_ids=["leaf"] * times))
    return graph


def walk(cursor: FlattenCursor, budget: int | None = None) -> list[FlattenEvent]:
    events = []
    while (event := cursor.next(budget)) is not None:
        events.append(event)
    return events


def test_flattened_bytes_count_every_repetition_up_to_the_limit() -> None:
    exact = FlattenCursor(shared(SessionLimits(max_flattened_bytes=50), 5), "root")
    assert sum(len(e.part.data) for e in walk(exact) if isinstance(e, LeafBytes)) == 50
    over = FlattenCursor(shared(SessionLimits(max_flattened_bytes=49), 5), "root")
    with pytest.raises(LimitExceededError, match="flattens to more than 49 bytes") as info:
        walk(over)
    assert info.value.limit == "max_flattened_bytes"
    assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
    assert over.bytes == 50  # stopped at the part that crossed it, before returning it


def test_flattened_nodes_count_every_repetition_up_to_the_limit() -> None:
    walk(FlattenCursor(shared(SessionLimits(max_flattened_nodes=6), 5), "root"))  # root + 5 leaves
    with pytest.raises(LimitExceededError, match="more than 5 nodes") as info:
        walk(FlattenCursor(shared(SessionLimits(max_flattened_nodes=5), 5), "root"))
    assert info.value.limit == "max_flattened_nodes"


def test_empty_nodes_count_too() -> None:
    """Nodes with no payload produce no event, but the walk through them is counted and paused."""
    graph = SessionGraph(SessionLimits(max_flattened_nodes=2_000))
    graph.add_fragment(NodeFragment(id="empty"))
    graph.add_fragment(NodeFragment(id="root", child_ids=["empty"] * 1_999))
    cursor = FlattenCursor(graph, "root")
    events = walk(cursor, budget=100)
    assert events and all(isinstance(event, Pause) for event in events)
    graph.add_fragment(NodeFragment(id="more", child_ids=["empty"] * 2_000))
    with pytest.raises(LimitExceededError):
        walk(FlattenCursor(graph, "more"))


def test_a_budget_pauses_between_events_without_losing_any() -> None:
    graph = shared(SessionLimits(), 300)
    paused = [e for e in walk(FlattenCursor(graph, "root"), budget=2) if not isinstance(e, Pause)]
    assert paused == walk(FlattenCursor(graph, "root"))
