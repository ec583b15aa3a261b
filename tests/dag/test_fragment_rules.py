"""The spec's fragment rules on the sans-IO graph, each test citing the rule it pins."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, ChunkMetadata, NodeFragment
from evergreen_trio.dag import (
    FlattenCursor,
    LeafBytes,
    LeafEnd,
    LeafStart,
    LimitExceededError,
    ProtocolViolationError,
    RefRejectedError,
    SessionGraph,
    SessionLimits,
    StatusCode,
    Wait,
)


def leaf(node_id: str, data: bytes, seq: int = 0, *, continued: bool = False, mimetype: str | None = "text/plain",
         ref: str | None = None) -> NodeFragment:
    chunk = Chunk(ref=ref) if ref is not None else Chunk(data=data)
    if mimetype is not None:
        chunk.metadata.CopyFrom(ChunkMetadata(mimetype=mimetype))
    return NodeFragment(id=node_id, seq=seq, continued=continued, chunk_fragment=chunk)


def parent(node_id: str, *children: str, seq: int = 0, continued: bool = False) -> NodeFragment:
    return NodeFragment(id=node_id, seq=seq, continued=continued, child_ids=children)


def flatten(graph: SessionGraph, root: str) -> list[tuple[str, bytes]] | Wait:
    """Complete flattening, or the first Wait."""
    cursor, out, current = FlattenCursor(graph, root), [], b""
    mimetype = ""
    while (event := cursor.next()) is not None:
        if isinstance(event, Wait):
            return event
        if isinstance(event, LeafStart):
            mimetype, current = event.metadata.mimetype, b""
        elif isinstance(event, LeafBytes):
            current += event.part.data
        elif isinstance(event, LeafEnd):
            out.append((mimetype, current))
    return out


def test_defaults_seq_zero_and_final() -> None:
    """Spec, Default values: seq is 0 and continued is false when not provided."""
    graph = SessionGraph()
    assert graph.add_fragment(NodeFragment(id="a", chunk_fragment=Chunk(data=b"x")))
    node = graph.get("a")
    assert node is not None and node.final_seq == 0 and node.complete


def test_fragments_in_any_order_assemble_by_seq() -> None:
    """Spec, Ordering: fragments may arrive in any order; content is assembled in seq order."""
    graph = SessionGraph()
    graph.add_fragment(leaf("a", b"c", 2))
    graph.add_fragment(leaf("a", b"a", 0, continued=True))
    assert isinstance(flatten(graph, "a"), Wait)
    graph.add_fragment(leaf("a", b"b", 1, continued=True))
    assert flatten(graph, "a") == [("text/plain", b"abc")]


def test_duplicate_seq_is_ignored_silently() -> None:
    """Spec, Ordering: accept the first fragment with a seq number and ignore the rest, no error."""
    graph = SessionGraph()
    assert graph.add_fragment(leaf("a", b"first", 0, continued=True))
    assert not graph.add_fragment(leaf("a", b"second", 0, continued=True, mimetype="other/type"))
    graph.add_fragment(leaf("a", b"!", 1))
    assert flatten(graph, "a") == [("text/plain", b"first!")]


def test_seq_past_final_aborts() -> None:
    """Spec, Boundaries: a seq greater than the final fragment's aborts the session."""
    graph = SessionGraph()
    graph.add_fragment(leaf("a", b"x", 0))
    with pytest.raises(ProtocolViolationError, match="past the final") as info:
        graph.add_fragment(leaf("a", b"y", 1))
    assert info.value.code is StatusCode.INVALID_ARGUMENT


def test_final_after_a_later_seq_aborts() -> None:
    graph = SessionGraph()
    graph.add_fragment(leaf("a", b"y", 3, continued=True))
    with pytest.raises(ProtocolViolationError, match="final fragment"):
        graph.add_fragment(leaf("a", b"x", 1))


def test_repeated_identical_metadata_is_accepted() -> None:
    """Spec, example 1: the second video fragment repeats seq 0's metadata."""
    graph = SessionGraph()
    graph.add_fragment(leaf("v", b"1", 0, continued=True, mimetype="video/mp4"))
    graph.add_fragment(leaf("v", b"2", 1, mimetype="video/mp4"))
    assert flatten(graph, "v") == [("video/mp4", b"12")]


@pytest.mark.parametrize("seq0_first", [True, False])
def test_different_metadata_on_later_fragment_aborts(seq0_first: bool) -> None:
    """Spec, Mime type: other fragments must not carry metadata different from seq 0's."""
    graph = SessionGraph()
    first, second = leaf("v", b"1", 0, continued=True), leaf("v", b"2", 1, mimetype="image/png")
    if not seq0_first:
        first, second = second, first
    graph.add_fragment(first)
    with pytest.raises(ProtocolViolationError, match="metadata differs"):
        graph.add_fragment(second)


def test_metadata_on_fragments_before_seq_0_costs_what_each_holds() -> None:
    """200,000 fragments repeating the metadata, before seq 0: each was kept by copying the list of
    those before it (quadratic: about 40 s here); now they take about a second, then seq 0 checks them."""
    graph = SessionGraph()
    fragments = [leaf("v", b"", seq, continued=True) for seq in range(1, 200_001)]
    started = time.perf_counter()
    for fragment in fragments:
        graph.add_fragment(fragment)
    graph.add_fragment(leaf("v", b"", 0, continued=True))
    elapsed = time.perf_counter() - started
    assert elapsed < 10.0, f"200,000 fragments took {elapsed:.2f} s"
    with pytest.raises(ProtocolViolationError, match="seq 1: metadata differs from seq 0's"):
        other = SessionGraph()
        other.add_fragment(leaf("v", b"", 1, continued=True))
        other.add_fragment(leaf("v", b"", 0, continued=True, mimetype="image/png"))


def test_leaf_and_inner_mixed_aborts() -> None:
    """A node is a leaf (chunks) or an inner node (child_ids)."""
    graph = SessionGraph()
    graph.add_fragment(parent("p", "a", continued=True))
    with pytest.raises(ProtocolViolationError, match="leaf fragment for a node that is inner"):
        graph.add_fragment(leaf("p", b"x", 1))
    with pytest.raises(ProtocolViolationError, match="chunk and child_ids"):
        graph.add_fragment(NodeFragment(id="q", child_ids=["a"], chunk_fragment=Chunk(data=b"x")))


def test_children_may_arrive_later_and_shared_nodes_repeat() -> None:
    """Spec, Ordering: a node may name children not received yet; a node may have several parents."""
    graph = SessionGraph()
    graph.add_fragment(parent("root", "x", "shared", "y"))
    graph.add_fragment(parent("x", "shared"))
    assert flatten(graph, "root") == Wait("shared", 0)
    graph.add_fragment(leaf("shared", b"S"))
    graph.add_fragment(parent("y", "shared"))
    assert flatten(graph, "root") == [("text/plain", b"S")] * 3


def test_streamed_child_ids_concatenate_in_seq_order() -> None:
    """Spec, Streamed chains: an inner node's child_ids may come over several seqs."""
    graph = SessionGraph()
    graph.add_fragment(parent("p", "eot", seq=1))
    graph.add_fragment(parent("p", "text", continued=True))
    graph.add_fragment(leaf("text", b"Write a novel."))
    graph.add_fragment(leaf("eot", b"", mimetype="application/x-protobuf; type=EndOfTurn"))
    assert flatten(graph, "p") == [("text/plain", b"Write a novel."), ("application/x-protobuf; type=EndOfTurn", b"")]


@pytest.mark.parametrize("order", [["a", "b"], ["b", "a"]])
def test_cycle_aborts(order: list[str]) -> None:
    """Spec, Ordering: nodes cannot transitively include themselves."""
    graph = SessionGraph()
    fragments = {"a": parent("a", "b"), "b": parent("b", "a")}
    graph.add_fragment(fragments[order[0]])
    with pytest.raises(ProtocolViolationError, match="include itself"):
        graph.add_fragment(fragments[order[1]])
    with pytest.raises(ProtocolViolationError, match="include itself"):
        graph.add_fragment(parent("self", "self"))


def test_nesting_deeper_than_limit_aborts() -> None:
    graph = SessionGraph(SessionLimits(max_depth=4))
    for depth in range(4):  # top down: each link raises the height of every node above it
        graph.add_fragment(parent(f"n{depth}", f"n{depth + 1}"))
    with pytest.raises(LimitExceededError, match="deeper than 4") as info:
        graph.add_fragment(parent("n4", "n5"))  # n5 would sit 5 levels below n0
    assert info.value.code is StatusCode.RESOURCE_EXHAUSTED
    cursor_only = SessionGraph(SessionLimits(max_depth=4))
    for depth in range(4):
        cursor_only.add_fragment(parent(f"n{depth}", f"n{depth + 1}"))
    cursor_only.add_fragment(leaf("n4", b"x"))
    assert flatten(cursor_only, "n0") == [("text/plain", b"x")]  # a leaf exactly 4 levels below
    bottom_up = SessionGraph(SessionLimits(max_depth=3))
    for depth in range(3, 0, -1):
        bottom_up.add_fragment(parent(f"n{depth}", f"n{depth + 1}"))
    with pytest.raises(LimitExceededError):
        bottom_up.add_fragment(parent("n0", "n1"))


@pytest.mark.parametrize(
    ("limits", "fragments", "match"),
    [
        (SessionLimits(max_nodes=2), [leaf("a", b""), leaf("b", b""), leaf("c", b"")], "nodes"),
        (SessionLimits(max_fragment_bytes=3), [leaf("a", b"1234")], "in one fragment"),
        (SessionLimits(max_buffered_bytes=5), [leaf("a", b"123"), leaf("b", b"456")], "would hold"),
        # A ref's URI is held as inline bytes are (up to a message's size each, uncounted before).
        (SessionLimits(max_buffered_bytes=64), [leaf("a", b"", ref="file:///" + "x" * 60)], "would hold 69 bytes"),
        (SessionLimits(max_children_per_fragment=2), [parent("p", "a", "b", "c")], "child_ids"),
        # Node ids and child ids are held for the session: a byte a character, as inline bytes.
        (SessionLimits(max_buffered_bytes=64), [leaf("a", b"x" * 60), leaf("b" * 4, b"")],
         "with its id of 4 characters the session would hold 65 bytes"),
        (SessionLimits(max_buffered_bytes=64), [parent("p", "a" * 30, "b" * 34)],
         "with its 2 child ids the session would hold 65 bytes"),
        # Empty fragments and child ids hold memory that max_buffered_bytes does not count.
        (SessionLimits(max_parts=3), [NodeFragment(id="a", seq=seq, continued=True) for seq in range(4)],
         "4 fragments and child ids"),
        (SessionLimits(max_parts=3), [leaf("a", b"", seq=seq, continued=True) for seq in range(4)],
         "4 fragments and child ids"),
        (SessionLimits(max_parts=3), [parent("p", "a", "b", "c")], "4 fragments and child ids"),
        # Ids named as children but never sent are nodes to be.
        (SessionLimits(max_nodes=2), [parent("p", "a", "b", "c")], "names more than 2 nodes as children"),
        (SessionLimits(max_nodes=2), [parent("p", "a", "b", continued=True), parent("p", "c", seq=1)],
         "names more than 2 nodes as children"),
    ],
)
def test_limits_abort_with_resource_exhausted(
    limits: SessionLimits, fragments: list[NodeFragment], match: str
) -> None:
    graph = SessionGraph(limits, ref_schemes=frozenset({"file"}))
    with pytest.raises(LimitExceededError, match=match) as info:
        for fragment in fragments:
            graph.add_fragment(fragment)
    assert info.value.code is StatusCode.RESOURCE_EXHAUSTED


def test_ids_of_megabytes_are_counted_before_they_are_kept() -> None:
    """A node id or child ids of a message's size each, on fragments without a byte of data: before
    they counted against no byte limit, and a session could hold max_nodes times a message's size."""
    limits = SessionLimits(max_buffered_bytes=8 << 20)
    graph = SessionGraph(limits)
    huge = "x" * (3 << 20)
    graph.add_fragment(NodeFragment(id=huge + "1", continued=True))
    graph.add_fragment(NodeFragment(id=huge + "2", continued=True))
    with pytest.raises(LimitExceededError, match=r"\(3145729 characters\) seq 0: with its id of 3145729 characters "
                                                 r"the session would hold 9437187 bytes") as info:
        graph.add_fragment(NodeFragment(id=huge + "3", continued=True))
    assert info.value.limit == "max_buffered_bytes" and huge + "3" not in graph.nodes
    assert graph.buffered_bytes == 2 * (len(huge) + 1)

    graph = SessionGraph(limits)
    graph.add_fragment(parent("p", huge + "1", continued=True))
    with pytest.raises(LimitExceededError, match="seq 1: with its 2 child ids the session would hold") as info:
        graph.add_fragment(parent("p", huge + "2", huge + "3", seq=1))
    assert info.value.limit == "max_buffered_bytes" and 1 not in graph.nodes["p"].parts
    assert graph.buffered_bytes == 1 + len(huge) + 1


def test_refs_refused_by_default_and_allowed_by_scheme() -> None:
    with pytest.raises(RefRejectedError, match="resolves: none"):
        SessionGraph().add_fragment(leaf("v", b"", ref="file:///tmp/part1"))
    graph = SessionGraph(ref_schemes=frozenset({"file"}))
    graph.add_fragment(leaf("v", b"", ref="file:///tmp/part1", continued=True))
    graph.add_fragment(leaf("v", b"", 1, ref="file:///tmp/part2"))
    cursor = FlattenCursor(graph, "v")
    cursor.next()
    first = cursor.next()
    assert isinstance(first, LeafBytes) and first.part.ref == "file:///tmp/part1"


def test_outputs_must_be_new_and_belong_to_their_producer() -> None:
    """Spec, Generating actions: output node IDs must be new and must not be reused."""
    graph = SessionGraph()
    graph.add_fragment(leaf("prompt", b"q"))
    with pytest.raises(ProtocolViolationError, match="not new"):
        graph.reserve_output("prompt", "action GENERATE", local=True)
    graph.reserve_output("response", "action GENERATE", local=True)
    with pytest.raises(ProtocolViolationError, match="not new"):
        graph.reserve_output("response", "action ECHO", local=True)
    with pytest.raises(ProtocolViolationError, match="output of action GENERATE"):
        graph.add_fragment(leaf("response", b"from the peer"))
    assert graph.add_fragment(leaf("response", b"from us"), local=True)


def test_waiting_for_a_node_the_peer_can_no_longer_send_aborts() -> None:
    graph = SessionGraph()
    graph.add_fragment(parent("p", "missing"))
    graph.peer_closed = True
    with pytest.raises(ProtocolViolationError, match="ended its stream"):
        flatten(graph, "p")


@given(
    st.lists(st.binary(max_size=8), min_size=1, max_size=6),
    st.randoms(use_true_random=False),
    st.lists(st.integers(min_value=0, max_value=5), max_size=4),
)
def test_any_arrival_order_with_retries_flattens_the_same(parts: list[bytes], rnd: object, retries: list[int]) -> None:
    """Invariant: order of arrival and duplicated (id, seq) retries never change the content."""
    fragments = [leaf("a", p, i, continued=i < len(parts) - 1) for i, p in enumerate(parts)]
    fragments += [fragments[i % len(fragments)] for i in retries]
    rnd.shuffle(fragments)  # type: ignore[attr-defined]
    graph = SessionGraph()
    for fragment in fragments:
        graph.add_fragment(fragment)
    assert flatten(graph, "a") == [("text/plain", b"".join(parts))]
