"""``LeafStart.last`` and ``LeafBytes.last``: what a writer copying an input (ECHO) may mark final early.

A wrong True would end an output before its input does, so the property is: ``last`` is never True
for a chunk that another follows, and it is True for the final chunk of an input that arrived whole
(with no empty fragment trailing after it, which the cursor only knows of once it reaches it)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, ChunkMetadata, NodeFragment
from evergreen_trio.dag import FlattenCursor, LeafBytes, LeafStart, SessionGraph, Wait

Tree = list[bytes] | tuple["Tree", ...]
"""A leaf's parts (a list), or an inner node's children (a tuple)."""

trees: st.SearchStrategy[Tree] = st.recursive(
    st.lists(st.binary(max_size=3), min_size=1, max_size=3),
    lambda children: st.tuples(children) | st.tuples(children, children) | st.tuples(children, children, children),
    max_leaves=8,
)


def fragments(tree: Tree, *, trailing: bool, ids: itertools.count[int]) -> tuple[str, list[NodeFragment]]:
    """The node's id and every fragment of it and below; ``trailing``: inner nodes end with an empty
    final fragment (as ``OutputNode.close`` sends) instead of naming their children in it."""
    node_id = f"n{next(ids)}"
    if isinstance(tree, list):
        metadata = ChunkMetadata(mimetype="text/plain")
        out = [
            NodeFragment(id=node_id, seq=seq, continued=seq < len(tree) - 1,
                         chunk_fragment=Chunk(data=data, metadata=metadata if seq == 0 else None))
            for seq, data in enumerate(tree)
        ]
        return node_id, out
    below = [fragments(child, trailing=trailing, ids=ids) for child in tree]
    out = [NodeFragment(id=node_id, seq=0, continued=trailing, child_ids=[child_id for child_id, _ in below])]
    if trailing:
        out.append(NodeFragment(id=node_id, seq=1))
    return node_id, out + [f for _, fs in below for f in fs]


def walk(graph: SessionGraph, root: str) -> list[object]:
    cursor = FlattenCursor(graph, root)
    events: list[object] = []
    while (event := cursor.next()) is not None:
        assert not isinstance(event, Wait)
        events.append(event)
    return events


@given(trees, st.booleans())
def test_last_marks_only_the_final_chunk_and_final_parts(tree: Tree, trailing: bool) -> None:
    graph = SessionGraph()
    root, fs = fragments(tree, trailing=trailing, ids=itertools.count())
    for fragment in fs:
        graph.add_fragment(fragment)
    events = walk(graph, root)
    starts = [index for index, event in enumerate(events) if isinstance(event, LeafStart)]
    for index in starts[:-1]:
        event = events[index]
        assert isinstance(event, LeafStart) and not event.last
    final = events[starts[-1]]
    assert isinstance(final, LeafStart)
    assert final.last == (not trailing or isinstance(tree, list))
    for index, event in enumerate(events):
        if isinstance(event, LeafBytes):
            assert event.last == (not isinstance(events[index + 1], LeafBytes))


def test_a_chunk_is_not_last_while_a_node_above_it_may_still_name_more_children() -> None:
    graph = SessionGraph()
    graph.add_fragment(NodeFragment(id="root", seq=0, continued=True, child_ids=["a"]))
    graph.add_fragment(NodeFragment(id="a", chunk_fragment=Chunk(data=b"x")))
    cursor = FlattenCursor(graph, "root")
    start = cursor.next()
    assert isinstance(start, LeafStart) and start.node_id == "a" and not start.last
    data = cursor.next()
    assert isinstance(data, LeafBytes) and data.last
    cursor.next()  # LeafEnd
    assert isinstance(cursor.next(), Wait)
