"""The kit drives any action, not only ECHO: the user names it, its inputs and outputs, and gives a
reference function; conformance and the strategies then judge the server's answers by it, and a
bug planted in a user's action is caught with a small shrunk counterexample."""

from __future__ import annotations

import io
import re
from collections.abc import Mapping

import pytest
import trio
from hypothesis import given, settings

from evergreen_trio import Server
from evergreen_trio.nursery_session import ActionContext
from evergreen_trio.testing.conformance import run_conformance
from evergreen_trio.testing.model import ActionUnderTest, Call, FlatChunk, ModelError, Plan
from evergreen_trio.testing.strategies import sessions


def upper_reference(inputs: Mapping[str, list[FlatChunk]]) -> dict[str, list[FlatChunk]]:
    """UPPER: each chunk of ``text``, its bytes upper-cased, in order."""
    return {"shouted": [FlatChunk(c.meta, c.data.upper()) for c in inputs["text"]]}


def concat_reference(inputs: Mapping[str, list[FlatChunk]]) -> dict[str, list[FlatChunk]]:
    """CONCAT: ``head``'s chunks then ``tail``'s, and their count as one text chunk."""
    both = [*inputs["head"], *inputs["tail"]]
    return {"joined": both, "count": [FlatChunk(both[0].meta.__class__("text/plain"), str(len(both)).encode())]}


UPPER = ActionUnderTest("UPPER", ("text",), ("shouted",), upper_reference)
CONCAT = ActionUnderTest("CONCAT", ("head", "tail"), ("joined", "count"), concat_reference)


async def _upper(ctx: ActionContext) -> None:
    output = ctx.output("shouted")
    async for chunk in ctx.input("text"):
        leaf = await output.child()
        await leaf.write((await chunk.read()).upper(), metadata=chunk.metadata, last=True)


async def _upper_forgets_after_the_first_chunk(ctx: ActionContext) -> None:
    """A planted bug: only the first chunk is upper-cased."""
    output = ctx.output("shouted")
    first = True
    async for chunk in ctx.input("text"):
        data = await chunk.read()
        leaf = await output.child()
        await leaf.write(data.upper() if first else data, metadata=chunk.metadata, last=True)
        first = False


async def _concat(ctx: ActionContext) -> None:
    joined, count = ctx.output("joined"), 0
    for name in ("head", "tail"):
        async for chunk in ctx.input(name):
            leaf = await joined.child()
            await leaf.write(await chunk.read(), metadata=chunk.metadata, last=True)
            count += 1
    await ctx.output("count").write(str(count), mimetype="text/plain", last=True)


def _server() -> Server:
    server = Server()
    server.add_action("UPPER", _upper, inputs=["text"], outputs=["shouted"])
    server.add_action("CONCAT", _concat, inputs=["head", "tail"], outputs=["joined", "count"])
    server.add_action("BUGGY_UPPER", _upper_forgets_after_the_first_chunk, inputs=["text"], outputs=["shouted"])
    return server


async def _conformance(action: ActionUnderTest, *rules: str, examples: int = 12) -> tuple[bool, str]:
    out = io.StringIO()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(_server().serve, "127.0.0.1", 0)
        only = [arg for rule in rules for arg in (rule,)]
        results = await trio.to_thread.run_sync(
            lambda: run_conformance(f"127.0.0.1:{port}", examples=examples, only=only, out=out, action=action,
                                    derandomize=True)
        )
        nursery.cancel_scope.cancel()
    return bool(results) and all(r.holds for r in results), out.getvalue()


async def test_a_correct_user_action_passes_the_rules() -> None:
    holds, report = await _conformance(UPPER, "round-trip", "any-order", "output-reuse", "abort-cycle", "stateful")
    assert holds, report


async def test_an_action_with_two_inputs_and_two_outputs_passes_the_rules() -> None:
    holds, report = await _conformance(CONCAT, "round-trip", "output-reuse", "shared-nodes", "abort-seq-past-final")
    assert holds, report


async def test_a_bug_planted_in_a_user_action_is_caught_and_shrunk_small() -> None:
    buggy = ActionUnderTest("BUGGY_UPPER", ("text",), ("shouted",), upper_reference)
    holds, report = await _conformance(buggy, "round-trip", examples=60)
    assert not holds and "FAIL  round-trip" in report, report
    frags = re.findall(r"Frag\(", report)
    # Small: a few leaves under one inner node (shrinking is heuristic; before nodes were list
    # elements it stopped at chains of up to 16 levels).
    assert len(frags) <= 8 and "children=" in report, report
    assert "flattens to 2 chunks" in report, report


@settings(max_examples=30, deadline=None)
@given(sessions(action=CONCAT))
def test_every_generated_call_names_each_parameter_once(plan: Plan) -> None:
    for call in plan.calls:
        assert len(call.inputs) == 2 and len(call.outputs) == 2
    expected = plan.expected()
    assert set(expected) == {out for call in plan.calls for out in call.outputs}
    for call in plan.calls:
        joined, count = (expected[out] for out in call.outputs)
        assert count[0].data == str(len(joined)).encode()


def test_a_reference_that_forgets_an_output_is_a_model_error() -> None:
    forgetful = ActionUnderTest("UPPER", ("text",), ("shouted", "extra"), upper_reference)
    with pytest.raises(ModelError, match="gave no \\['extra'\\]"):
        forgetful.expect({"text": []})
    with pytest.raises(ModelError, match="parameter names repeat"):
        ActionUnderTest("X", ("a", "a"), ("b",), upper_reference)
    assert Call(("c:a",), ("o:0",)) == Call(("c:a",), ("o:0",))
