"""Hypothesis strategies for Evergreen sessions: node DAGs, the fragment streams that deliver
them, and invalid sessions labelled with the rule they break.

``dags()`` builds DAGs of leaves with several mimetypes, shared children and deep chains.
``sessions()`` turns one into a :class:`~evergreen_trio.testing.model.Plan`: one or more calls
of the action under test (ECHO unless an :class:`~evergreen_trio.testing.model.ActionUnderTest`
is given; some reusing earlier outputs without resending them), every node split into fragments
at arbitrary points, fragments reordered and interleaved across nodes and actions, (id, seq)
retries duplicated, actions sent before or after their inputs, and messages split anywhere.
``invalid_sessions()`` mutates such a plan so it breaks exactly one rule
(:class:`~evergreen_trio.testing.model.Violation`). Expected results come from
:meth:`~evergreen_trio.testing.model.Plan.expected`, a pure function of the plan.

Client node ids start with ``c:`` and output ids with ``o:``; past that, ids are arbitrary
text (the spec: ids carry no meaning), never containing ``/``, which servers commonly use to
name the children they produce.
"""

from __future__ import annotations

from evergreen_trio._extras import require_extra

require_extra("testing", __name__)

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hypothesis import strategies as st

from evergreen_trio.dag.limits import SessionLimits
from evergreen_trio.testing.model import (
    ECHO,
    Act,
    ActionUnderTest,
    Call,
    Frag,
    InnerSpec,
    Item,
    LeafSpec,
    Meta,
    NodeSpec,
    Plan,
    Violation,
    split_inner,
    split_leaf,
)

MIMETYPES = (
    "text/plain",
    "application/octet-stream",
    "image/png",
    "video/mp4",
    "audio/wav",
    "application/json",
    "application/x-protobuf; type=EndOfTurn",
)
"""The mimetypes generated leaves carry."""

_ID_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="/", exclude_categories=["Cs", "Cc"]),
    min_size=1,
    max_size=6,
)


def metas(*, full: bool = False) -> st.SearchStrategy[Meta]:
    """Chunk metadata: a mimetype, and with ``full`` also a role and a file name."""
    if not full:
        return st.builds(Meta, st.sampled_from(MIMETYPES))
    return st.builds(
        Meta,
        st.sampled_from(MIMETYPES),
        st.sampled_from(["", "user", "model"]),
        st.sampled_from(["", "a.txt", "clip.mp4"]),
    )


@dataclass(frozen=True)
class DagShape:
    """Bounds for generated DAGs; the defaults fit any reasonable server's limits."""

    max_leaves: int = 6
    max_inner: int = 6
    max_children: int = 5
    max_flat: int = 24
    """Chunks in a root's flattening (sharing multiplies it, so it is capped while building)."""
    max_data: int = 48
    max_chain: int = 16
    """Inner levels of a deep chain."""
    full_metadata: bool = False
    text_only: bool = False
    """Every leaf ``text/plain`` with UTF-8 text (at most ``max_data`` bytes): for actions that read text."""


DEFAULT_SHAPE = DagShape()
"""The DagShape ``dags`` draws with when given none."""


@dataclass(frozen=True)
class Dag:
    """A generated session DAG: its nodes by id and the id of the root."""

    nodes: dict[str, NodeSpec]
    root: str


def _leaf_metas(shape: DagShape) -> st.SearchStrategy[Meta]:
    return st.just(Meta("text/plain")) if shape.text_only else metas(full=shape.full_metadata)


def _leaf_data(shape: DagShape) -> st.SearchStrategy[bytes]:
    if not shape.text_only:
        return st.binary(max_size=shape.max_data)
    text = st.text(alphabet=st.characters(codec="utf-8"), max_size=shape.max_data // 4)
    return text.map(str.encode)


def _fresh(name: str, used: dict[str, NodeSpec]) -> str:
    """``c:NAME``, made unique with a suffix when an earlier node drew the same name."""
    node_id, k = f"c:{name}", 1
    while node_id in used:
        node_id, k = f"c:{name}~{k}", k + 1
    return node_id


_PICK = st.integers(0, 1 << 16)
"""A child choice, taken modulo the nodes built so far: it shrinks towards the first node."""


@st.composite
def dags(draw: st.DrawFn, shape: DagShape = DEFAULT_SHAPE) -> Dag:
    """A DAG of client nodes: leaves (several mimetypes, possibly empty), inner nodes picking
    earlier nodes as children (so children are shared, even twice in one parent), or a deep
    chain. The root is the last node built; a few nodes may be unreachable from it.

    Every node is one element of a drawn list, so hypothesis shrinks a failing DAG by deleting
    nodes (a chain by dropping levels) instead of redrawing everything after a changed count.
    """
    chain = draw(st.booleans())
    leaves = draw(st.lists(st.tuples(_ID_TEXT, _leaf_metas(shape), _leaf_data(shape)),
                           min_size=1, max_size=shape.max_leaves))
    if chain:
        levels = draw(st.lists(st.tuples(_ID_TEXT, st.booleans(), st.lists(_PICK, max_size=1)),
                               min_size=1, max_size=shape.max_chain))
        inner = [(name, [*extra, -1] if before else [-1, *extra]) for name, before, extra in levels]
    else:
        inner = draw(st.lists(st.tuples(_ID_TEXT, st.lists(_PICK, min_size=1, max_size=shape.max_children)),
                              max_size=shape.max_inner))
    nodes: dict[str, NodeSpec] = {}
    ids: list[str] = []
    flat: list[int] = []
    for name, meta, data in leaves:
        ids.append(_fresh(name, nodes))
        nodes[ids[-1]] = LeafSpec(meta, data)
        flat.append(1)
    n_leaves = len(leaves)
    for name, picks in inner:
        built = len(ids)
        # In a chain, -1 is the level below and the other picks are leaves; elsewhere any earlier node.
        indexes = [built - 1 if p < 0 else p % (n_leaves if chain else built) for p in picks]
        children: list[int] = []
        for pick in indexes:
            if children and sum(flat[c] for c in children) + flat[pick] > shape.max_flat:
                break
            children.append(pick)
        ids.append(_fresh(name, nodes))
        nodes[ids[-1]] = InnerSpec(tuple(ids[c] for c in children))
        flat.append(sum(flat[c] for c in children))
    return Dag(nodes, ids[-1])


@dataclass(frozen=True)
class Delivery:
    """How much disorder a session's delivery may have."""

    reorder: bool = True
    split: bool = True
    duplicates: bool = True
    divergent_duplicates: bool = True
    """Retries whose content differs, sent after the first: the first must win."""
    repeat_metadata: bool = False
    """Later leaf fragments repeat seq 0's metadata (the spec's example does; the rule text does not)."""
    max_calls: int = 3
    reuse_outputs: bool = True


DEFAULT_DELIVERY = Delivery()
"""The Delivery the exchange strategies use when given none."""


def _cuts(draw: st.DrawFn, length: int, *, allow_empty: bool, enabled: bool) -> list[int]:
    if not enabled or length < 1:
        return []
    lo = 0 if allow_empty else 1
    hi = length if allow_empty else length - 1
    if hi < lo:
        return []
    return sorted(draw(st.lists(st.integers(lo, hi), max_size=4, unique=not allow_empty)))


def _node_fragments(draw: st.DrawFn, nodes: dict[str, NodeSpec], delivery: Delivery) -> dict[str, list[Frag]]:
    """Each client node's fragments, split at drawn points."""
    out: dict[str, list[Frag]] = {}
    for node_id, node in nodes.items():
        if isinstance(node, LeafSpec):
            cuts = _cuts(draw, len(node.data), allow_empty=True, enabled=delivery.split)
            out[node_id] = split_leaf(node_id, node, cuts, repeat_meta=delivery.repeat_metadata)
        elif isinstance(node, InnerSpec):
            cuts = _cuts(draw, len(node.children), allow_empty=False, enabled=delivery.split)
            out[node_id] = split_inner(node_id, node, cuts)
    return out


def _divergent(frag: Frag) -> Frag:
    """A retry of ``frag`` with other content of the same kind (and no metadata change)."""
    if frag.chunk is not None:
        return replace(frag, chunk=(frag.chunk[0], frag.chunk[1] + b"\xffretry"))
    return replace(frag, children=frag.children[::-1][:1])


@dataclass
class _Order:
    """Delivery being built: fragments in order, then late items and actions placed among them."""

    frags: list[Item]
    actions: list[tuple[Act, int, int | None]]
    """(action, lowest position, highest position or None); positions index ``frags``."""


def _place_after(draw: st.DrawFn, items: list[Item], item: Item, anchor: Item | None) -> None:
    lo = 0 if anchor is None else max(i for i, x in enumerate(items) if x is anchor) + 1
    items.insert(draw(st.integers(lo, len(items))), item)


def _deliver(draw: st.DrawFn, order: _Order, delivery: Delivery) -> tuple[tuple[Item, ...], tuple[int, ...]]:
    """Place the actions (in order, each within its bounds) and draw where messages split."""
    items = order.frags
    positions: list[int] = []
    floor = 0
    for _, lo, hi in order.actions:
        low = max(lo, floor)
        high = len(items) if hi is None else max(hi, low)
        pos = draw(st.integers(low, high)) if delivery.reorder else low
        positions.append(pos)
        floor = pos
    merged: list[Item] = []
    pending = list(zip(positions, (a for a, _, _ in order.actions), strict=True))
    for index, frag in enumerate([*items, None]):
        while pending and pending[0][0] == index:
            merged.append(pending.pop(0)[1])
        if frag is not None:
            merged.append(frag)
    groups: tuple[int, ...] = ()
    if delivery.split and len(merged) > 1:
        groups = tuple(sorted(draw(st.sets(st.integers(1, len(merged) - 1), max_size=4))))
    return tuple(merged), groups


def _first_ref(items: Sequence[Item], node_ids: set[str]) -> int | None:
    for index, item in enumerate(items):
        if isinstance(item, Frag) and node_ids.intersection(item.children):
            return index
    return None


@dataclass
class _Draft:
    action: ActionUnderTest
    nodes: dict[str, NodeSpec]
    calls: list[Call]
    frags: dict[str, list[Frag]]


def _output_ids(action: ActionUnderTest, index: int | str) -> tuple[str, ...]:
    return tuple(f"o:{index}" if k == 0 else f"o:{index}.{k}" for k in range(len(action.outputs)))


@st.composite
def _drafts(draw: st.DrawFn, shape: DagShape, delivery: Delivery, action: ActionUnderTest) -> _Draft:
    dag = draw(dags(shape))
    nodes = dict(dag.nodes)
    pool = list(nodes)
    calls: list[Call] = []
    n_calls = draw(st.integers(1, delivery.max_calls))
    for index in range(n_calls):
        earlier = [out for call in calls for out in call.outputs]
        inputs: list[str] = []
        for k in range(len(action.inputs)):
            mode = draw(st.sampled_from(["root", "pool", "reuse", "nest"])) if delivery.reuse_outputs else "root"
            if not earlier or mode == "root":
                inp = dag.root
            elif mode == "pool":
                inp = draw(st.sampled_from(pool))
            elif mode == "reuse":
                inp = draw(st.sampled_from(earlier))
            else:
                inp = f"c:nest{index}" + (f".{k}" if k else "")
                nodes[inp] = InnerSpec((draw(st.sampled_from(earlier)), draw(st.sampled_from(pool))))
            inputs.append(inp)
        calls.append(Call(tuple(inputs), _output_ids(action, index)))
    return _Draft(action, nodes, calls, _node_fragments(draw, nodes, delivery))


def _order(draw: st.DrawFn, draft: _Draft, delivery: Delivery) -> _Order:
    frags: list[Item] = [f for node_frags in draft.frags.values() for f in node_frags]
    if delivery.reorder:
        frags = list(draw(st.permutations(frags)))
    if delivery.duplicates and frags:
        originals = list(frags)
        for pick, divergent in draw(st.lists(st.tuples(st.integers(0, len(originals) - 1), st.booleans()),
                                             max_size=4)):
            original = originals[pick]
            assert isinstance(original, Frag)
            if divergent and delivery.divergent_duplicates:
                _place_after(draw, frags, _divergent(original), original)
            else:
                _place_after(draw, frags, original, None)
    actions: list[tuple[Act, int, int | None]] = []
    for index, call in enumerate(draft.calls):
        # An action goes before any fragment naming its outputs or a later one's: a node may
        # name a child that has not arrived, but the output must be claimed by then.
        later = {out for later_call in draft.calls[index:] for out in later_call.outputs}
        actions.append((draft.action.act(call), 0, _first_ref(frags, later)))
    return _Order(frags, actions)


@st.composite
def sessions(
    draw: st.DrawFn,
    shape: DagShape = DEFAULT_SHAPE,
    delivery: Delivery = DEFAULT_DELIVERY,
    action: ActionUnderTest = ECHO,
) -> Plan:
    """A valid session: calls of ``action`` (ECHO by default) over a generated DAG, delivered
    with drawn disorder; ``plan.expected()`` gives each output by the action's reference."""
    draft = draw(_drafts(shape, delivery, action))
    items, groups = _deliver(draw, _order(draw, draft, delivery), delivery)
    return Plan(draft.nodes, tuple(draft.calls), items, groups, action=action)


# --------------------------------------------------------------------------------------------
# Invalid sessions


def _reachable(nodes: dict[str, NodeSpec], root: str) -> list[list[str]]:
    """Paths from ``root`` to every inner node below it (first path found for each)."""
    paths: dict[str, list[str]] = {}
    stack = [[root]]
    while stack:
        path = stack.pop()
        node = nodes.get(path[-1])
        if isinstance(node, InnerSpec) and path[-1] not in paths:
            paths[path[-1]] = path
            stack.extend([*path, child] for child in node.children)
    return list(paths.values())


def _rewire_first_input(draft: _Draft, node_id: str) -> None:
    """The first call reads ``node_id`` as its first input."""
    first = draft.calls[0]
    draft.calls[0] = Call((node_id, *first.inputs[1:]), first.outputs)


def _with_inner(draft: _Draft) -> str:
    """The first call's first input, made an inner node if it was not (wrapping the old input)."""
    inp = draft.calls[0].inputs[0]
    if isinstance(draft.nodes.get(inp), InnerSpec):
        return inp
    wrapper = "c:wrap"
    draft.nodes[wrapper] = InnerSpec((inp,))
    draft.frags[wrapper] = split_inner(wrapper, InnerSpec((inp,)))
    _rewire_first_input(draft, wrapper)
    return wrapper


def _mutate_cycle(draw: st.DrawFn, draft: _Draft) -> tuple[str, list[tuple[Frag, Frag | None]]]:
    root = _with_inner(draft)
    path = draw(st.sampled_from(_reachable(draft.nodes, root)))
    target, ancestor = path[-1], draw(st.sampled_from(path))
    frags = draft.frags[target]
    k = draw(st.integers(0, len(frags) - 1))
    children = list(frags[k].children)
    children.insert(draw(st.integers(0, len(children))), ancestor)
    frags[k] = replace(frags[k], children=tuple(children))
    return f"{target!r} names its ancestor {ancestor!r}", []


def _append(frags: list[Frag], frag_of_seq: Callable[[int], Frag]) -> Frag:
    """Make the node's last fragment continued and append a new final one."""
    frags[-1] = replace(frags[-1], continued=True)
    extra = frag_of_seq(frags[-1].seq + 1)
    frags.append(extra)
    return extra


def _mutate_seq_past_final(draw: st.DrawFn, draft: _Draft) -> tuple[str, list[tuple[Frag, Frag | None]]]:
    node_id = draw(st.sampled_from(sorted(draft.frags)))
    frags = draft.frags[node_id]
    final = frags[-1]
    seq = final.seq + draw(st.integers(1, 3))
    leaf = next(iter(draft.nodes))
    extra = Frag(node_id, seq, draw(st.booleans()), chunk=(None, b"late") if final.chunk is not None else None,
                 children=() if final.chunk is not None else (leaf,))
    return f"{node_id!r} seq {seq} after final seq {final.seq}", [(extra, final)]


def _mutate_metadata(draw: st.DrawFn, draft: _Draft) -> tuple[str, list[tuple[Frag, Frag | None]]]:
    leaves = sorted(k for k, v in draft.nodes.items() if isinstance(v, LeafSpec))
    node_id = draw(st.sampled_from(leaves))
    frags = draft.frags[node_id]
    if len(frags) == 1:
        _append(frags, lambda seq: Frag(node_id, seq, False, chunk=(None, b"")))
    k = draw(st.integers(1, len(frags) - 1))
    first_meta = frags[0].chunk[0] if frags[0].chunk else None
    assert first_meta is not None
    other = draw(metas().filter(lambda m: m != first_meta))
    chunk = frags[k].chunk
    assert chunk is not None
    frags[k] = replace(frags[k], chunk=(other, chunk[1]))
    return f"{node_id!r} seq {k} metadata {other.mimetype!r} after {first_meta.mimetype!r}", []


def _mutate_mixed(draw: st.DrawFn, draft: _Draft) -> tuple[str, list[tuple[Frag, Frag | None]]]:
    node_id = draw(st.sampled_from(sorted(draft.frags)))
    frags = draft.frags[node_id]
    leaves = sorted(k for k, v in draft.nodes.items() if isinstance(v, LeafSpec) and k != node_id)
    is_leaf = frags[0].chunk is not None
    child = draw(st.sampled_from(leaves)) if leaves else "c:absent"
    if draw(st.booleans()):
        k = draw(st.integers(0, len(frags) - 1))
        if is_leaf:
            frags[k] = replace(frags[k], children=(child,))
        else:
            frags[k] = replace(frags[k], chunk=(None, b"mixed"))
        return f"{node_id!r} seq {k} carries a chunk and child_ids", []
    if is_leaf:
        extra = _append(frags, lambda seq: Frag(node_id, seq, False, children=(child,)))
    else:
        extra = _append(frags, lambda seq: Frag(node_id, seq, False, chunk=(None, b"mixed")))
    kind = "child_ids" if is_leaf else "chunk"
    return f"{node_id!r} seq {extra.seq} carries {kind} in a {'leaf' if is_leaf else 'inner node'}", []


def _over_limit(draw: st.DrawFn, draft: _Draft, limits: SessionLimits) -> str:
    """Add a node (and rewire the first call to include it) that crosses one limit."""
    which = draw(st.sampled_from(["fragment bytes", "buffered bytes", "nodes", "depth", "children per fragment"]))
    inp = draft.calls[0].inputs[0]
    big = "c:big"
    if which == "fragment bytes":
        leaf = LeafSpec(Meta("application/octet-stream"), b"x" * (limits.max_fragment_bytes + 1))
        draft.nodes[big] = leaf
        draft.frags[big] = split_leaf(big, leaf)
    elif which == "buffered bytes":
        size = limits.max_fragment_bytes
        count = limits.max_buffered_bytes // size + 1
        leaf = LeafSpec(Meta("application/octet-stream"), b"y" * (size * count))
        draft.nodes[big] = leaf
        draft.frags[big] = split_leaf(big, leaf, [size * i for i in range(1, count)])
    elif which == "nodes":
        count = limits.max_nodes + 1
        names = [f"c:n{i}" for i in range(count)]
        for name in names:
            draft.nodes[name] = LeafSpec(Meta("text/plain"), b"")
            draft.frags[name] = split_leaf(name, LeafSpec(Meta("text/plain"), b""))
        per = limits.max_children_per_fragment
        draft.nodes[big] = InnerSpec(tuple(names))
        draft.frags[big] = split_inner(big, InnerSpec(tuple(names)), list(range(per, count, per)))
    elif which == "depth":
        below = inp
        for level in range(limits.max_depth + 1):
            name = f"c:d{level}"
            draft.nodes[name] = InnerSpec((below,))
            draft.frags[name] = split_inner(name, InnerSpec((below,)))
            below = name
        draft.nodes[big] = InnerSpec((below,))
        draft.frags[big] = split_inner(big, InnerSpec((below,)))
    else:
        children = (inp,) * (limits.max_children_per_fragment + 1)
        draft.nodes[big] = InnerSpec(children)
        draft.frags[big] = split_inner(big, InnerSpec(children))
    wrapper = "c:top"
    draft.nodes[wrapper] = InnerSpec((big, inp))
    draft.frags[wrapper] = split_inner(wrapper, InnerSpec((big, inp)))
    _rewire_first_input(draft, wrapper)
    return which


_MUTATIONS = {
    Violation.CYCLE: _mutate_cycle,
    Violation.SEQ_PAST_FINAL: _mutate_seq_past_final,
    Violation.CHANGED_METADATA: _mutate_metadata,
    Violation.LEAF_AND_INNER: _mutate_mixed,
}

SPEC_VIOLATIONS = (
    Violation.CYCLE,
    Violation.SEQ_PAST_FINAL,
    Violation.CHANGED_METADATA,
    Violation.LEAF_AND_INNER,
    Violation.REUSED_OUTPUT_ID,
)
"""What every server must abort on; OVER_LIMIT depends on a server's own limits."""


@st.composite
def invalid_sessions(
    draw: st.DrawFn,
    violations: Sequence[Violation] = SPEC_VIOLATIONS,
    *,
    limits: SessionLimits | None = None,
    shape: DagShape = DEFAULT_SHAPE,
    delivery: Delivery = DEFAULT_DELIVERY,
    action: ActionUnderTest = ECHO,
) -> Plan:
    """A session of ``action`` calls that breaks exactly one rule, drawn from ``violations``.
    OVER_LIMIT needs the server's ``limits`` (keep them small: a plan may carry
    ``max_buffered_bytes`` of data)."""
    violation = draw(st.sampled_from(list(violations)))
    if violation is Violation.OVER_LIMIT:
        if limits is None:
            raise ValueError("OVER_LIMIT plans need the server's limits")
        if draw(st.integers(0, 5)) == 0:
            return concurrent_actions_session(limits, action)
    draft = draw(_drafts(shape, replace(delivery, divergent_duplicates=False), action))
    late: list[tuple[Frag, Frag | None]] = []
    if violation is Violation.REUSED_OUTPUT_ID:
        note = _reuse_output(draw, draft)
    elif violation is Violation.OVER_LIMIT:
        assert limits is not None
        note = _over_limit(draw, draft, limits)
    else:
        note, late = _MUTATIONS[violation](draw, draft)
    order = _order(draw, draft, delivery)
    for item, anchor in late:
        _place_after(draw, order.frags, item, anchor)
    if violation is Violation.REUSED_OUTPUT_ID:
        _anchor_reuse(order, draft)
    items, groups = _deliver(draw, order, delivery)
    return Plan(draft.nodes, tuple(draft.calls), items, groups, violation, note, action)


def _reuse_output(draw: st.DrawFn, draft: _Draft) -> str:
    """Name as an output (the first) either a node the client sent or an earlier call's output."""
    fresh = _output_ids(draft.action, "reuse")[1:]
    if draw(st.booleans()):
        sent = draw(st.sampled_from(sorted(draft.frags)))
        draft.calls.append(Call(draft.calls[0].inputs, (sent, *fresh)))
        return f"output {sent!r} is a node the client sent"
    earlier = draw(st.sampled_from([out for call in draft.calls for out in call.outputs]))
    draft.calls.append(Call(draft.calls[0].inputs, (earlier, *fresh)))
    return f"output {earlier!r} is an earlier action's output"


def _anchor_reuse(order: _Order, draft: _Draft) -> None:
    """The reusing action (the last) goes after the node it names was sent or claimed."""
    act, _, _ = order.actions[-1]
    reused = act.outputs[0][1]
    if reused in draft.frags:
        last = max(i for i, x in enumerate(order.frags) if isinstance(x, Frag) and x.id == reused)
        order.actions[-1] = (act, last + 1, None)
    else:
        order.actions[-1] = (act, 0, None)


def concurrent_actions_session(limits: SessionLimits, action: ActionUnderTest = ECHO) -> Plan:
    """``max_concurrent_actions + 1`` calls sent before any input: the last one is over the limit."""
    leaf = LeafSpec(Meta("text/plain"), b"hi")
    nodes: dict[str, NodeSpec] = {"c:in": leaf}
    inputs = ("c:in",) * len(action.inputs)
    calls = tuple(Call(inputs, _output_ids(action, i)) for i in range(limits.max_concurrent_actions + 1))
    items: tuple[Item, ...] = (*(action.act(call) for call in calls), *split_leaf("c:in", leaf))
    return Plan(nodes, calls, items, (), Violation.OVER_LIMIT, "concurrent actions", action)


def expected_outputs(plan: Plan) -> dict[str, list[tuple[str, bytes]]]:
    """Each output's expected flattening as (mimetype, bytes) pairs: a convenience for tests."""
    return {out: [(c.meta.mimetype, c.data) for c in chunks] for out, chunks in plan.expected().items()}


__all__ = [
    "DEFAULT_DELIVERY",
    "DEFAULT_SHAPE",
    "MIMETYPES",
    "SPEC_VIOLATIONS",
    "Dag",
    "DagShape",
    "Delivery",
    "concurrent_actions_session",
    "dags",
    "expected_outputs",
    "invalid_sessions",
    "metas",
    "sessions",
]
