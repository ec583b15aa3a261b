"""Evergreen rules over real sessions: default roles on the wire, one use per parameter name, and a
failing action cancelling its siblings."""

from __future__ import annotations

import asyncio

import pytest
import trio

from evergreen_trio import ActionContext, NodeRef, Server, SessionAbortedError, StatusCode, connect, inner, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import (
    Action,
    Chunk,
    ChunkMetadata,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.nodes import CLIENT_ROLE, SERVER_ROLE
from evergreen_trio.testing.wire import SyncClient


async def _serve(nursery: trio.Nursery, server: Server) -> str:
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


def _leaf(node_id: str, data: bytes, role: str = "") -> NodeFragment:
    return NodeFragment(id=node_id, chunk_fragment=Chunk(metadata=ChunkMetadata(mimetype="text/plain", role=role),
                                                         data=data))


async def test_unset_roles_get_defaults_on_the_wire(nursery: trio.Nursery) -> None:
    """Our client sends ``user`` for a leaf with no role; the server's outputs carry ``assistant``."""
    seen: list[str] = []
    server = Server()
    register_builtin_actions(server)

    @server.action("ROLES", inputs=["input"], outputs=["output"])
    async def roles(ctx: ActionContext) -> None:
        async for chunk in ctx.input("input"):
            seen.append(chunk.metadata.role)
            await chunk.read()
        await ctx.output("output").write("ok", last=True)

    address = await _serve(nursery, server)
    async with connect(address) as session:
        leaf = session.open_leaf()
        prompt = inner(text("a"), text("b", role="system"), NodeRef(leaf.id))
        call = await session.run("ROLES", {"input": prompt}, ["output"])
        await leaf.write("c", last=True)
        chunks = await call["output"].read_chunks()
    assert seen == [CLIENT_ROLE, "system", CLIENT_ROLE] == ["user", "system", "user"]
    assert [meta.role for meta, _ in chunks] == [SERVER_ROLE] == ["assistant"]

    # The raw view: what the server itself put on the wire for GENERATE's output.
    action = Action(name="GENERATE", inputs=[NamedParameter(name="prompt", id="p")],
                    outputs=[NamedParameter(name="response", id="r")])
    messages = [SessionMessage(actions=[action], node_fragments=[_leaf("p", b"hi", role="user")])]
    with SyncClient(address) as client:
        outcome = await trio.to_thread.run_sync(client.run, messages)
    assert outcome.ok, outcome.describe()
    first = [f for m in outcome.received for f in m.node_fragments if f.id == "r" and f.seq == 0]
    assert first[0].chunk_fragment.metadata.role == "assistant"


@pytest.mark.parametrize("side", ["inputs", "outputs"])
async def test_a_parameter_name_given_twice_aborts_naming_it(nursery: trio.Nursery, side: str) -> None:
    server = Server()
    register_builtin_actions(server)
    address = await _serve(nursery, server)
    action = Action(name="ECHO", inputs=[NamedParameter(name="input", id="a")],
                    outputs=[NamedParameter(name="output", id="o1")])
    getattr(action, side).append(NamedParameter(name=side[:-1], id="b" if side == "inputs" else "o2"))
    messages = [SessionMessage(actions=[action], node_fragments=[_leaf("a", b"x"), _leaf("b", b"y")])]
    with SyncClient(address) as client:
        outcome = await trio.to_thread.run_sync(client.run, messages)
    assert outcome.code == StatusCode.INVALID_ARGUMENT
    assert f"{side[:-1]} '{side[:-1]}' given twice" in outcome.details
    # The server keeps serving.
    async with connect(address) as session:
        call = await session.run("ECHO", {"input": text("still here")}, ["output"])
        assert await call["output"].read_text() == "still here"


async def test_a_failing_action_cancels_its_siblings(nursery: trio.Nursery) -> None:
    """The sibling's handler sees trio.Cancelled (not only the session's end), and its cleanup runs."""
    started, cancelled = trio.Event(), trio.Event()
    server = Server()

    @server.action("WAIT", inputs=[], outputs=["output"])
    async def wait(ctx: ActionContext) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    @server.action("FAIL", inputs=[], outputs=["output"])
    async def fail(ctx: ActionContext) -> None:
        await started.wait()
        raise RuntimeError("boom")

    address = await _serve(nursery, server)
    with pytest.raises(SessionAbortedError) as caught:
        async with connect(address) as session:
            await session.run("WAIT", {}, ["output"])
            await session.run("FAIL", {}, ["output"])
            with trio.fail_after(30):
                await trio.sleep_forever()
    assert caught.value.code == StatusCode.INTERNAL
    assert "action FAIL" in caught.value.message and "error id" in caught.value.message
    with trio.fail_after(30):
        await cancelled.wait()


class _LibraryStop(BaseException):
    """A library's own BaseException subclass (as asyncio.CancelledError is one)."""


@pytest.mark.parametrize("kind", [asyncio.CancelledError, _LibraryStop])
async def test_a_handler_raising_another_base_exception_fails_its_action_and_the_server_serves_on(
        nursery: trio.Nursery, kind: type[BaseException]) -> None:
    """Only Trio's cancellation, Ctrl-C and SystemExit pass through a handler: any other BaseException
    fails the action with INTERNAL, as an Exception does (it used to end the whole server)."""
    server = Server()
    register_builtin_actions(server)

    @server.action("STOP", inputs=["input"], outputs=["output"])
    async def stop(ctx: ActionContext) -> None:
        raise kind("stopped")

    address = await _serve(nursery, server)
    with pytest.raises(SessionAbortedError) as caught:
        async with connect(address) as session:
            call = await session.run("STOP", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    assert caught.value.code == StatusCode.INTERNAL
    assert "action STOP" in caught.value.message and "error id" in caught.value.message
    async with connect(address) as session:
        call = await session.run("ECHO", {"input": text("still here")}, ["output"])
        assert await call["output"].read_text() == "still here"


async def test_ctrl_c_in_a_handler_leaves_serve_as_a_plain_keyboard_interrupt() -> None:
    """Trio raises Ctrl-C in the task that runs when it comes (a handler busy computing): ``serve``
    raises it alone, not inside the session's, connection's and server's nursery groups."""
    server = Server()

    @server.action("BUSY", inputs=["input"], outputs=["output"])
    async def busy(ctx: ActionContext) -> None:
        raise KeyboardInterrupt

    raised: list[BaseException] = []

    async def serve(task_status: trio.TaskStatus[int]) -> None:
        try:
            await server.serve("127.0.0.1", 0, task_status=task_status)
        except BaseException as error:  # what leaves serve is the assertion
            raised.append(error)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve)
        with pytest.raises(SessionAbortedError) as caught:
            async with connect(f"127.0.0.1:{port}") as session:
                call = await session.run("BUSY", {"input": text("x")}, ["output"])
                await call["output"].read_bytes()
    assert caught.value.code == StatusCode.UNAVAILABLE
    assert len(raised) == 1 and type(raised[0]) is KeyboardInterrupt, raised


async def test_nodes_a_handler_made_with_child_and_left_open_are_closed_when_it_returns(nursery: trio.Nursery) -> None:
    """Returning closes the action's outputs and the nodes ``child()`` made below them: a reader of the
    output waited for the open ones' final fragments until the idle timeout (here: forever)."""
    server = Server(idle_timeout=None)

    @server.action("OPEN", inputs=["input"], outputs=["output"])
    async def left_open(ctx: ActionContext) -> None:
        output = ctx.output("output")
        await (await output.child()).write("streamed, ")  # neither last=True nor close()
        middle = await output.child(last=True)  # the output's final fragment names it
        await (await middle.child()).write("and deeper")
        await (await ctx.output("unrequested").child()).write("dropped")

    address = await _serve(nursery, server)
    with trio.fail_after(10):
        async with connect(address) as session:
            call = await session.run("OPEN", {"input": text("x")}, ["output"])
            assert await call["output"].read_text() == "streamed, and deeper"


async def test_an_abort_reason_quoting_the_peers_names_is_logged_as_one_bounded_line(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """An action name or output name with a newline started a forged line in the server's log (and one
    of a message's size made a 5 MB line): the reason is escaped and cut as other peer fields are."""
    server = Server()
    register_builtin_actions(server)
    address = await _serve(nursery, server)
    forged = "\nERROR evergreen_trio.serving forged "
    messages = [SessionMessage(actions=[Action(name="X" + forged + "y" * 100_000)]),
                SessionMessage(actions=[Action(name="ECHO", inputs=[NamedParameter(name="input", id="p")],
                                               outputs=[NamedParameter(name="out" + forged, id="o" + forged)])])]
    caplog.set_level("INFO", logger="evergreen_trio.nursery_session")
    with SyncClient(address) as client:
        for message in messages:
            outcome = await trio.to_thread.run_sync(client.run, [message])
            assert outcome.code in (StatusCode.UNIMPLEMENTED, StatusCode.INVALID_ARGUMENT), outcome.describe()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("session.abort")]
    assert len(lines) == 2, lines
    for line in lines:
        assert "\n" not in line and len(line) < 700, line[:300]
        assert "\\nERROR evergreen_trio.serving forged" in line


async def test_a_failed_action_quoting_the_peers_output_ids_is_logged_as_one_bounded_line(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """The action.failed line quoted the action's output ids as the peer chose them, unbounded (``%r``:
    a message's size on one line): ``what`` is escaped and cut as the session.abort reason is."""
    server = Server()

    @server.action("BOOM", inputs=["input"], outputs=["output"])
    async def boom(ctx: ActionContext) -> None:
        raise ValueError("boom")

    address = await _serve(nursery, server)
    forged = "\nERROR evergreen_trio.serving forged \u2028"
    message = SessionMessage(
        actions=[Action(name="BOOM", inputs=[NamedParameter(name="input", id="p")],
                        outputs=[NamedParameter(name="output", id="o" + forged + "y" * 100_000)])],
        node_fragments=[_leaf("p", b"x")])
    caplog.set_level("INFO", logger="evergreen_trio.nursery_session")
    with SyncClient(address) as client:
        outcome = await trio.to_thread.run_sync(client.run, [message])
    assert outcome.code == StatusCode.INTERNAL, outcome.describe()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("action.failed")]
    assert len(lines) == 1, lines
    assert "\n" not in lines[0] and "\u2028" not in lines[0] and len(lines[0]) < 700, lines[0][:300]
    assert "o\\nERROR evergreen_trio.serving forged \\u2028yyy" in lines[0]
