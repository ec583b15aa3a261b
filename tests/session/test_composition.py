"""Composition over a real server: ``ctx.call`` (another action of the same server, in-process, with
TLS and a token on), actions from the server to the client (``ctx.session.run`` and
``ClientSession.action``), and what a failure on either side tells the other."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from test_tls import Pki

from evergreen_trio import (
    ActionContext,
    NodeRef,
    Server,
    SessionAbortedError,
    SessionError,
    StatusCode,
    connect,
    inner,
    text,
)
from evergreen_trio.dag import ActionFailedError, UnknownActionError
from evergreen_trio.serving.auth import TokenFileAuthorizer
from evergreen_trio.serving.tls import client_context, server_context


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def agent_server(**options: object) -> tuple[Server, list[str | None]]:
    """UPPER upper-cases its input; SHOUT calls UPPER in-process on its input and a new node;
    principals seen by UPPER are recorded."""
    server = Server(**options)  # type: ignore[arg-type]
    seen: list[str | None] = []

    @server.action("UPPER", inputs=["input"], outputs=["output"])
    async def upper(ctx: ActionContext) -> None:
        seen.append(ctx.principal)
        await ctx.output("output").write((await ctx.input("input").read_text()).upper(), last=True)

    @server.action("SHOUT", inputs=["input"], outputs=["output"])
    async def shout(ctx: ActionContext) -> None:
        original = NodeRef(ctx.input("input").node_id)
        call = await ctx.call("UPPER", {"input": inner(original, text("!"))}, ["output"])
        await ctx.output("output").write(await call["output"].read_text(), last=True)

    return server, seen


async def test_ctx_call_runs_an_action_in_process_with_tls_and_a_token(
    pki: Pki, tmp_path: Path, nursery: trio.Nursery
) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("secret-token\n")
    server, seen = agent_server(tls=server_context(pki.server_cert, pki.server_key),
                                authorize=TokenFileAuthorizer(tokens))
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with connect(f"127.0.0.1:{port}", tls=client_context(ca_file=pki.ca_file), timeout=30,
                       metadata={"authorization": "Bearer secret-token"}) as session:
        call = await session.run("SHOUT", {"input": text("hello")}, ["output"])
        assert await call["output"].read_text() == "HELLO!"
        # The in-process call's nodes stayed on the server: the client holds its input and the output only.
        assert set(session.graph.nodes) == {call.action.inputs[0].id, call.action.outputs[0].id}
    assert seen == [seen[0]] and seen[0] is not None and seen[0].startswith("token:")


async def test_an_inner_failure_fails_the_outer_action_with_its_status(nursery: trio.Nursery) -> None:
    server = Server()

    @server.action("DENY", inputs=["input"], outputs=["output"])
    async def deny(ctx: ActionContext) -> None:
        raise SessionError("not for you", code=StatusCode.PERMISSION_DENIED)

    @server.action("OUTER", inputs=["input"], outputs=["output"])
    async def outer(ctx: ActionContext) -> None:
        call = await ctx.call("DENY", {"input": text("x")}, ["output"])
        await call["output"].read_bytes()
        await ctx.output("output").write("unreachable", last=True)

    @server.action("MISSING", inputs=["input"], outputs=["output"])
    async def missing(ctx: ActionContext) -> None:
        await ctx.call("NOPE", {"input": text("x")}, ["output"])

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    for action, code, words in (("OUTER", StatusCode.PERMISSION_DENIED, "not for you"),
                                ("MISSING", StatusCode.UNIMPLEMENTED, "NOPE")):
        with pytest.raises(SessionAbortedError) as aborted:
            async with connect(f"127.0.0.1:{port}", timeout=30) as session:
                call = await session.run(action, {"input": text("x")}, ["output"])
                await call["output"].read_bytes()
        assert aborted.value.code is code and words in aborted.value.message


async def test_an_in_process_node_cannot_leak_into_what_the_peer_gets(nursery: trio.Nursery) -> None:
    server, _ = agent_server()

    @server.action("LEAK", inputs=["input"], outputs=["output"])
    async def leak(ctx: ActionContext) -> None:
        call = await ctx.call("UPPER", {"input": text("x")}, ["output"])
        await ctx.output("output").add_children([call["output"].node_id], last=True)

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:
            call = await session.run("LEAK", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    assert aborted.value.code is StatusCode.FAILED_PRECONDITION and "ctx.call" in aborted.value.message


@pytest.mark.parametrize("named_as", ["the input", "a child of the input"])
async def test_the_peer_cannot_read_an_in_process_node_by_naming_it(nursery: trio.Nursery, named_as: str) -> None:
    """A ctx.call output's id may be known to the peer (chosen by the handler, or another id of the
    session's counter): an input the peer names reaches it only to abort PERMISSION_DENIED. Before,
    UPPER on it sent the in-process node's content to the client."""
    from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, NamedParameter

    server, _ = agent_server()

    @server.action("SECRET", inputs=["input"], outputs=["output"])
    async def secret(ctx: ActionContext) -> None:
        await ctx.output("output").write("the api key", last=True)

    @server.action("AGENT", inputs=["input"], outputs=["output"])
    async def agent(ctx: ActionContext) -> None:
        call = await ctx.call("SECRET", {"input": text("x")}, {"output": "scratch"})
        await ctx.output("output").write(f"{len(await call['output'].read_bytes())} bytes read", last=True)

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:
            call = await session.run("AGENT", {"input": text("?")}, ["output"])
            assert await call["output"].read_text() == "11 bytes read"
            # As a hostile client would: run() refuses a NodeRef to a node it does not know of.
            node = "scratch" if named_as == "the input" else (await session.send(inner(NodeRef("scratch")))).id
            await session.send_action(Action(name="UPPER", inputs=[NamedParameter(name="input", id=node)],
                                             outputs=[NamedParameter(name="output", id="leak")]))
            leaked = await session.input("leak").read_text()
            raise AssertionError(f"the client read {leaked!r}")
    assert aborted.value.code is StatusCode.PERMISSION_DENIED
    assert "node 'scratch' was made by ctx.call" in aborted.value.message


def tool_server() -> Server:
    """AGENT asks the client to run LOOKUP on its question, then answers with what came back."""
    server = Server()

    @server.action("AGENT", inputs=["question"], outputs=["answer"])
    async def agent(ctx: ActionContext) -> None:
        question = NodeRef(ctx.input("question").node_id)
        lookup = await ctx.session.run("LOOKUP", {"query": question}, ["result"])
        found = await lookup["result"].read_text()
        await ctx.output("answer").write(f"the client says: {found}", last=True)

    return server


async def test_the_server_runs_a_tool_on_the_client(nursery: trio.Nursery) -> None:
    port = await nursery.start(tool_server().serve, "127.0.0.1", 0)
    async with connect(f"127.0.0.1:{port}", timeout=30) as session:
        queries: list[str] = []

        @session.action("LOOKUP", inputs=["query"], outputs=["result"])
        async def lookup(ctx: ActionContext) -> None:
            queries.append(await ctx.input("query").read_text())
            await ctx.output("result").write("42", last=True)

        call = await session.run("AGENT", {"question": text("meaning of life?")}, ["answer"])
        assert await call["answer"].read_text() == "the client says: 42"
        # Leaving the block without reading still serves the tool call before half-closing.
        await session.run("AGENT", {"question": text("again?")}, ["answer"])
    assert queries == ["meaning of life?", "again?"]


async def test_a_client_without_the_handler_answers_unimplemented_naming_it(nursery: trio.Nursery) -> None:
    server = tool_server()
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    with pytest.raises(UnknownActionError) as unknown:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:
            call = await session.run("AGENT", {"question": text("?")}, ["answer"])
            await call["answer"].read_text()
    assert unknown.value.code is StatusCode.UNIMPLEMENTED and "LOOKUP" in unknown.value.message
    async with connect(f"127.0.0.1:{port}", timeout=30) as session:  # the server keeps serving
        session.add_action("LOOKUP", _answer_ok, inputs=["query"], outputs=["result"])
        call = await session.run("AGENT", {"question": text("?")}, ["answer"])
        assert await call["answer"].read_text() == "the client says: ok"
    assert server.open_sessions == 0


async def _answer_ok(ctx: ActionContext) -> None:
    await ctx.output("result").write("ok", last=True)


async def test_a_failing_client_handler_raises_its_text_on_the_client(nursery: trio.Nursery) -> None:
    port = await nursery.start(tool_server().serve, "127.0.0.1", 0)
    with pytest.raises(ActionFailedError) as failed:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:

            @session.action("LOOKUP", inputs=["query"], outputs=["result"])
            async def lookup(ctx: ActionContext) -> None:
                raise KeyError("no such page")

            call = await session.run("AGENT", {"question": text("?")}, ["answer"])
            await call["answer"].read_text()
    assert "LOOKUP" in failed.value.message and "no such page" in failed.value.message


@pytest.mark.parametrize("details", [False, True])
async def test_handler_exception_text_reaches_the_client_only_when_the_operator_says_so(
    details: bool, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    server = Server(error_details=details)

    @server.action("BOOM", inputs=["input"], outputs=["output"])
    async def boom(ctx: ActionContext) -> None:
        raise ValueError("db password is hunter2")

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:
            call = await session.run("BOOM", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    message = aborted.value.message
    assert aborted.value.code is StatusCode.INTERNAL and "BOOM" in message
    assert ("hunter2" in message) is details
    error_id = message.split("error id ")[1][:8]
    logged = [r for r in caplog.records if r.getMessage().startswith("action.failed")]
    assert any(error_id in r.getMessage() and r.exc_info for r in logged)


async def test_a_tool_call_after_the_client_half_closed_says_so(nursery: trio.Nursery) -> None:
    """A client without handlers half-closes at once; the server's late tool call names why it cannot work."""
    server = Server()
    errors: list[SessionError] = []

    @server.action("LATE", inputs=[], outputs=["output"])
    async def late(ctx: ActionContext) -> None:
        while not ctx.session.graph.peer_closed:  # the end may come in the same batch as the action
            await ctx.session.barrier.wait("no-such-node")  # woken when the client ends its stream
        try:
            await ctx.session.run("LOOKUP", {}, ["result"])
        except SessionError as error:
            errors.append(error)
            raise

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:
            await session.run("LATE", {}, ["output"])
    assert aborted.value.code is StatusCode.FAILED_PRECONDITION and "ended its side" in aborted.value.message
    assert errors and "the client" in errors[0].message
