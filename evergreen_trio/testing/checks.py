"""Judging one session's outcome against its plan: the invariants every Evergreen server keeps."""

from __future__ import annotations

from evergreen_trio.errors import EvergreenTrioError
from evergreen_trio.testing.model import (
    ECHO,
    ActionUnderTest,
    Call,
    FlatChunk,
    InnerSpec,
    Item,
    LeafSpec,
    Meta,
    ModelError,
    NodeSpec,
    Plan,
    flatten,
    iter_frags,
    reassemble,
    split_leaf,
)
from evergreen_trio.testing.wire import Outcome, SyncClient


class RuleBrokenError(EvergreenTrioError, AssertionError):
    """A server broke a rule; the message says what was expected and what came."""


def _show(chunks: list[FlatChunk], full: bool) -> str:
    shown = [(c.meta if full else c.meta.mimetype, c.data[:24]) for c in chunks[:8]]
    return f"{len(chunks)} chunks {shown}" + (" ..." if len(chunks) > 8 else "")


def check_valid(plan: Plan, outcome: Outcome, *, full_metadata: bool = False) -> None:
    """A valid session ends OK, and each output flattens as the action's reference says
    (mimetypes and bytes; all metadata with ``full_metadata``); for ECHO (``leaves_only``) each
    output is also an inner node of leaves."""
    if not outcome.ok:
        raise RuleBrokenError(f"a valid session must end OK, got {outcome.describe()}")
    try:
        produced = reassemble(iter_frags(outcome.received))
    except ModelError as error:
        raise RuleBrokenError(f"the server's own fragments break the fragment rules: {error}") from None
    model: dict[str, NodeSpec] = {**plan.nodes, **produced}
    for out, expected in plan.expected().items():
        root = produced.get(out)
        if root is None:
            raise RuleBrokenError(f"output {out!r} was never produced (produced: {sorted(produced)[:10]})")
        if plan.action.leaves_only and (
            not isinstance(root, InnerSpec) or not all(isinstance(model.get(c), LeafSpec) for c in root.children)
        ):
            raise RuleBrokenError(f"{plan.action.name} output {out!r} must be an inner node of leaves, got {root!r}")
        try:
            got = flatten(model, out)
        except ModelError as error:
            raise RuleBrokenError(f"output {out!r} cannot be flattened: {error}") from None
        if not full_metadata:
            got = [FlatChunk(Meta(c.meta.mimetype), c.data) for c in got]
            expected = [FlatChunk(Meta(c.meta.mimetype), c.data) for c in expected]
        if got != expected:
            raise RuleBrokenError(
                f"output {out!r} flattens to {_show(got, full_metadata)}, expected {_show(expected, full_metadata)}"
            )


def check_abort(plan: Plan, outcome: Outcome, *, strict_codes: bool = False) -> None:
    """An invalid session ends with a non-OK status (with ``strict_codes``, the one our server uses)."""
    assert plan.violation is not None
    if outcome.hung:
        raise RuleBrokenError(f"{plan.violation.label} ({plan.note}): expected an abort, {outcome.describe()}")
    if outcome.code == 0:
        raise RuleBrokenError(f"{plan.violation.label} ({plan.note}): expected an abort, the session ended OK")
    if strict_codes and outcome.code != plan.violation.code:
        raise RuleBrokenError(
            f"{plan.violation.label} ({plan.note}): expected status {plan.violation.code.name}, "
            f"got {outcome.describe()}"
        )


def probe_plan(action: ActionUnderTest = ECHO) -> Plan:
    """One call of ``action`` on one leaf: the smallest session that shows a server still serves."""
    leaf = LeafSpec(Meta("text/plain"), b"still serving?")
    call = Call(("c:probe",) * len(action.inputs), tuple(f"o:probe{k}" for k in range(len(action.outputs))))
    items: tuple[Item, ...] = (action.act(call), *split_leaf("c:probe", leaf))
    return Plan({"c:probe": leaf}, (call,), items, action=action)


def check_still_serving(client: SyncClient, action: ActionUnderTest = ECHO) -> None:
    """After an abort the server serves the next session (one call of ``action``)."""
    plan = probe_plan(action)
    try:
        check_valid(plan, client.run(plan.messages()))
    except RuleBrokenError as error:
        raise RuleBrokenError(f"after the abort, the next session failed: {error}") from None


__all__ = [
    "RuleBrokenError",
    "check_abort",
    "check_still_serving",
    "check_valid",
    "probe_plan",
]
