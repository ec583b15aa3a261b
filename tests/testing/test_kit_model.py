"""The kit's pure parts: the model's flattening and reassembly, and the strategies checked
against the package's own sans-IO DAG core (no server, no event loop)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given

from evergreen_trio.dag import FlattenCursor, LeafBytes, LeafStart, SessionError, SessionGraph, SessionLimits, Wait
from evergreen_trio.testing.model import (
    Act,
    Call,
    FlatChunk,
    Frag,
    InnerSpec,
    LeafSpec,
    Meta,
    ModelError,
    NodeSpec,
    Plan,
    Produced,
    Violation,
    echo,
    flatten,
    iter_frags,
    reassemble,
    split_leaf,
    to_messages,
)
from evergreen_trio.testing.strategies import (
    concurrent_actions_session,
    invalid_sessions,
    sessions,
)

TEXT, VIDEO = Meta("text/plain"), Meta("video/mp4")
LIMITS = SessionLimits(
    max_nodes=300, max_buffered_bytes=16384, max_fragment_bytes=1024, max_depth=24, max_children_per_fragment=64
)


def test_flatten_is_depth_first_and_repeats_shared_nodes() -> None:
    # The spec's second turn: prompt_2 = [prompt_1, response_1, question_2], prompt_1 = [question_1, video_1].
    nodes: dict[str, NodeSpec] = {
        "question_1": LeafSpec(TEXT, b"Write a summary of this video: "),
        "video_1": LeafSpec(VIDEO, b"part1part2"),
        "prompt_1": InnerSpec(("question_1", "video_1")),
        "response_1": LeafSpec(TEXT, b"It is a translation of an F1 race. "),
        "question_2": LeafSpec(TEXT, b"Who's winning?"),
        "prompt_2": InnerSpec(("prompt_1", "response_1", "question_2", "question_1")),
    }
    assert [c.data for c in flatten(nodes, "prompt_2")] == [
        b"Write a summary of this video: ", b"part1part2", b"It is a translation of an F1 race. ",
        b"Who's winning?", b"Write a summary of this video: ",
    ]
    assert flatten({**nodes, "out": Produced(tuple(flatten(nodes, "prompt_1")))}, "out") == flatten(nodes, "prompt_1")


def test_flatten_rejects_cycles_and_missing_nodes() -> None:
    with pytest.raises(ModelError, match="includes itself"):
        flatten({"a": InnerSpec(("b",)), "b": InnerSpec(("a",))}, "a")
    with pytest.raises(ModelError, match="not in the model"):
        flatten({"a": InnerSpec(("b",))}, "a")


def test_reassemble_reads_a_streamed_leaf_and_inner_node() -> None:
    frags = [
        Frag("r", 1, True, children=("l",)), Frag("l", 1, False, chunk=(None, b"cd")),
        Frag("r", 0, True, children=("l",)), Frag("l", 0, True, chunk=(TEXT, b"ab")),
        Frag("l", 0, True, chunk=(TEXT, b"ignored retry")), Frag("r", 2, False),
    ]
    assert reassemble(frags) == {"r": InnerSpec(("l", "l")), "l": LeafSpec(TEXT, b"abcd")}


@pytest.mark.parametrize(
    ("frags", "match"),
    [
        ([Frag("a", 0, True, chunk=(TEXT, b""))], "no final"),
        ([Frag("a", 1, False, chunk=(TEXT, b""))], "expected 0..1"),
        ([Frag("a", 0, True, chunk=(TEXT, b"")), Frag("a", 1, False, children=("b",))], "both"),
        ([Frag("a", 0, True, chunk=(TEXT, b"")), Frag("a", 1, False, chunk=(VIDEO, b""))], "metadata differs"),
        ([Frag("a", 0, False, chunk=(None, b""))], "no metadata"),
        ([Frag("a", 0, False, children=("b",)), Frag("a", 1, False, children=("b",))], "final fragments"),
    ],
)
def test_reassemble_names_what_a_producer_broke(frags: list[Frag], match: str) -> None:
    with pytest.raises(ModelError, match=match):
        reassemble(frags)


def test_messages_keep_item_order() -> None:
    items = [Frag("a", 0, False, chunk=(TEXT, b"x")), echo("a", "o"), Frag("b", 0, False, chunk=(TEXT, b""))]
    messages = to_messages(items)
    assert [(len(m.actions), len(m.node_fragments)) for m in messages] == [(0, 1), (1, 1)]
    assert [f.id for f in iter_frags(messages)] == ["a", "b"]
    assert len(to_messages(items, [1, 2])) == 3


def _feed(plan: Plan, limits: SessionLimits | None = None) -> dict[str, list[FlatChunk]]:
    """Play ``plan`` into the DAG core as a server would receive it; flatten every input that
    does not wait on a server-produced node."""
    graph = SessionGraph(limits)
    for message in plan.messages():
        for action in message.actions:
            for param in action.outputs:
                graph.reserve_output(param.id, f"action {action.name}", local=True)
        for fragment in message.node_fragments:
            graph.add_fragment(fragment)
    graph.peer_closed = True
    outputs = {out for call in plan.calls for out in call.outputs}
    flattened: dict[str, list[FlatChunk]] = {}
    for call in plan.calls:
        (inp,), (out,) = call.inputs, call.outputs
        chunks: list[FlatChunk] = []
        cursor = FlattenCursor(graph, inp)
        while (event := cursor.next()) is not None:
            if isinstance(event, Wait):
                assert event.node_id in outputs, f"waits for {event.node_id!r}, which no one produces"
                break
            if isinstance(event, LeafStart):
                chunks.append(FlatChunk(Meta.of(event.metadata), b""))
            elif isinstance(event, LeafBytes):
                chunks[-1] = FlatChunk(chunks[-1].meta, chunks[-1].data + event.part.data)
        else:
            flattened[out] = chunks
    return flattened


@given(sessions())
def test_valid_sessions_flatten_in_the_dag_core_as_the_model_says(plan: Plan) -> None:
    expected = plan.expected()
    for out, chunks in _feed(plan).items():
        assert chunks == expected[out]


@given(invalid_sessions(list(Violation), limits=LIMITS))
def test_each_invalid_session_aborts_in_the_dag_core_with_its_status(plan: Plan) -> None:
    assert plan.violation is not None
    assume(plan.note != "concurrent actions")  # a runtime limit; the graph does not count actions
    with pytest.raises(SessionError) as caught:
        _feed(plan, LIMITS)
    assert caught.value.code == plan.violation.code, (plan.note, caught.value)


def test_concurrent_actions_session_has_one_action_too_many() -> None:
    plan = concurrent_actions_session(LIMITS)
    actions = [item for item in plan.items if isinstance(item, Act)]
    assert len(actions) == LIMITS.max_concurrent_actions + 1
    assert plan.items.index(actions[-1]) < plan.items.index(split_leaf("c:in", LeafSpec(TEXT, b"hi"))[0])


def test_graph_and_cursor_agree_on_max_depth() -> None:
    """SessionLimits.max_depth is "nesting levels below an action's input node": the graph and
    the flattening cursor both accept a leaf exactly max_depth levels below (they once differed by one)."""
    limits = SessionLimits(max_depth=4)
    nodes: dict[str, NodeSpec] = {"n0": LeafSpec(TEXT, b"x")}
    for level in range(1, limits.max_depth + 1):
        nodes[f"n{level}"] = InnerSpec((f"n{level - 1}",))
    root = f"n{limits.max_depth}"
    frags = [f for k, v in nodes.items() for f in _frags(k, v)]
    plan = Plan(nodes, (Call((root,), ("o",)),), (echo(root, "o"), *frags))
    assert _feed(plan, limits)["o"] == [FlatChunk(TEXT, b"x")]


def _frags(node_id: str, node: NodeSpec) -> list[Frag]:
    if isinstance(node, LeafSpec):
        return split_leaf(node_id, node)
    assert isinstance(node, InnerSpec)
    return [Frag(node_id, 0, False, children=node.children)]
