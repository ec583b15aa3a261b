"""The client as a script writer meets it: one connection for many sessions, plain typed errors (never an
exception group made inside the library), arguments checked where they are given, retries at connect
time, and the TLS mismatches said in words on both sides."""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from test_tls import Pki, serve

from evergreen_trio import (
    ActionContext,
    Client,
    ConfigurationError,
    EvergreenTrioError,
    NodeRef,
    Server,
    SessionAbortedError,
    StatusCode,
    blob,
    connect,
    inner,
    ref,
    text,
)
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.client import ClientStateError, UnknownNodeError
from evergreen_trio.errors import ArgumentTypeError
from evergreen_trio.serving.tls import client_context, server_context


def peer_recording_server() -> tuple[Server, list[str]]:
    """ECHO plus PEER, whose handler records the TCP peer (host:port) the server saw its session on."""
    server = Server()
    register_builtin_actions(server)
    peers: list[str] = []

    @server.action("PEER", inputs=["input"], outputs=["output"])
    async def peer(ctx: ActionContext) -> None:
        await ctx.input("input").read_bytes()
        peers.append(ctx.session.stream.peer)
        await ctx.output("output").write("ok", last=True)

    return server, peers


async def start(nursery: trio.Nursery, server: Server | None = None) -> str:
    if server is None:
        server = Server()
        register_builtin_actions(server)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


async def test_sessions_in_turn_and_at_once_share_one_connection(nursery: trio.Nursery) -> None:
    server, peers = peer_recording_server()
    address = await start(nursery, server)
    async with Client(address) as client:
        for _ in range(5):
            async with client.session() as session:
                call = await session.run("PEER", {"input": text("x")}, ["output"])
                assert await call["output"].read_text() == "ok"

        async def one() -> None:
            async with client.session() as session:
                call = await session.run("PEER", {"input": text("x")}, ["output"])
                assert await call["output"].read_text() == "ok"

        async with trio.open_nursery() as sessions:
            for _ in range(8):
                sessions.start_soon(one)
    assert len(peers) == 13
    assert len(set(peers)) == 1, f"the server saw {len(set(peers))} connections: {sorted(set(peers))}"
    async with connect(address) as session:  # the one-shot form: a connection of its own
        await (await session.run("PEER", {"input": text("x")}, ["output"]))["output"].read_text()
    assert peers[-1] != peers[0]


async def test_a_session_after_the_client_closed_is_refused(nursery: trio.Nursery) -> None:
    client = Client(await start(nursery))
    with pytest.raises(ClientStateError, match="is not open"):
        async with client.session():
            pass
    async with client:
        with pytest.raises(ClientStateError, match="already open"):
            await client.__aenter__()
    with pytest.raises(ClientStateError, match="is not open"):
        async with client.session():
            pass


async def test_a_deadline_hit_is_a_plain_session_aborted_error_naming_its_status(nursery: trio.Nursery) -> None:
    server = Server()

    @server.action("STUCK", inputs=["input"], outputs=["output"])
    async def stuck(ctx: ActionContext) -> None:
        await trio.sleep_forever()

    address = await start(nursery, server)
    with pytest.raises(SessionAbortedError) as aborted:  # not an ExceptionGroup holding one
        async with connect(address, timeout=0.3) as session:
            call = await session.run("STUCK", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    assert type(aborted.value) is SessionAbortedError
    assert aborted.value.code is StatusCode.DEADLINE_EXCEEDED
    assert str(aborted.value).startswith("DEADLINE_EXCEEDED: ")


async def test_the_callers_own_error_leaves_as_itself(nursery: trio.Nursery) -> None:
    address = await start(nursery)
    with pytest.raises(KeyError, match="mine"):
        async with Client(address) as client, client.session() as session:
            call = await session.run("ECHO", {"input": text("x")}, ["output"])
            async for _chunk in call["output"]:
                raise KeyError("mine")
    with pytest.raises(KeyError, match="mine again"):
        async with Client(address):
            raise KeyError("mine again")


async def test_a_server_abort_leaves_as_itself(nursery: trio.Nursery) -> None:
    address = await start(nursery)
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(address) as session:
            call = await session.run("NO_SUCH_ACTION", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    assert aborted.value.code is StatusCode.UNIMPLEMENTED
    assert str(aborted.value).startswith("UNIMPLEMENTED: ")


async def test_non_nodes_as_inputs_raise_type_errors_naming_the_input(nursery: trio.Nursery) -> None:
    address = await start(nursery)
    async with connect(address) as session:
        leaf = session.open_leaf()
        with pytest.raises(ArgumentTypeError, match=r"input 'input'.*NodeRef\(leaf.id\)") as raised:
            await session.run("ECHO", {"input": leaf}, ["output"])  # type: ignore[dict-item]
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, EvergreenTrioError)
        with pytest.raises(TypeError, match=r"input 'input' must be a node.*got str"):
            await session.run("ECHO", {"input": "plain text"}, ["output"])  # type: ignore[dict-item]
        with pytest.raises(TypeError, match="outputs must be a list"):
            await session.run("ECHO", {"input": text("x")}, "output")
        with pytest.raises(TypeError, match="send: expected a node"):
            await session.send(b"bytes")  # type: ignore[arg-type]
        # The session is untouched by the refused calls: the open leaf still works, by reference.
        call = await session.run("ECHO", {"input": NodeRef(leaf.id)}, ["output"])
        await leaf.write("streamed", last=True)
        assert await call["output"].read_text() == "streamed"


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ((5, {"input": text("x")}, ["output"]), r"run\(5\): the action name must be a str, got int"),
        ((None, {"input": text("x")}, ["output"]), r"the action name must be a str, got NoneType"),
        (("ECHO", [text("x")], ["output"]), r"inputs must be a mapping of input name to node, got list"),
        (("ECHO", {5: text("x")}, ["output"]), r"input names must be str, got int 5"),
        (("ECHO", {"in\udc80put": text("x")}, ["output"]), r"input name 'in\\udc80put' cannot be sent"),
        (("\ud800", {"input": text("x")}, ["output"]), r"the action name '\\ud800' cannot be sent"),
        (("ECHO", {"input": text("x")}, {"output": "o\udfff"}),
         r"output 'output'\'s node id 'o\\udfff' cannot be sent"),
        (("ECHO", {"input": text("x")}, [5]), r"output names must be str, got int 5"),
        (("ECHO", {"input": text("x")}, {"output": 5}), r"output 'output': its node id must be a str, got int 5"),
    ],
)
async def test_arguments_of_the_wrong_type_raise_type_errors_naming_them(
        nursery: trio.Nursery, arguments: tuple[object, object, object], match: str) -> None:
    """Each was protobuf's ``TypeError: bad argument type for built-in operation`` (or an
    AttributeError), naming nothing; ``None`` as the action name sent an action named ''."""
    address = await start(nursery)
    async with connect(address) as session:
        with pytest.raises(ArgumentTypeError, match=match):
            await session.run(*arguments)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match=r"target must be a str, got int"):
            await session.run("ECHO", {"input": text("x")}, ["output"], target=5)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match=r"configs must be an iterable of google.protobuf.Any, got list"):
            await session.run("ECHO", {"input": text("x")}, ["output"], configs=[5])  # type: ignore[list-item]
        call = await session.run("ECHO", {"input": text("still fine")}, ["output"])
        assert await call["output"].read_text() == "still fine"


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: text(5), r"text: value must be a str, got int"),
        (lambda: text(b"x"), r"text: value must be a str \(for bytes, use blob\(\)\), got bytes"),
        (lambda: text("a\udc80"), r"text: value 'a\\udc80' cannot be sent: UTF-8 cannot encode '\\udc80' at 1"),
        (lambda: text("x", id=7), r"leaf: id must be a str, got int 7"),
        (lambda: text("x", mimetype=None), r"leaf: mimetype must be a str, got NoneType"),
        (lambda: text("x", role="\ud800"), r"leaf: role '\\ud800' cannot be sent"),
        (lambda: text("x", id="n\udc80"), r"leaf: id 'n\\udc80' cannot be sent"),
        (lambda: blob("str"), r"blob: data must be bytes or a sequence of bytes \(for a str, use text\(\)\), got str"),
        (lambda: blob(5), r"blob: data must be bytes or a sequence of bytes, got int"),
        (lambda: blob([b"a", 5]), r"blob: data\[1\] must be bytes, got int"),
        (lambda: ref(5), r"ref: uri must be a str or a sequence of str, got int"),
        (lambda: ref(["file:///a", 5]), r"ref: uri must be a str, got int 5"),
        (lambda: ref("file:///\udc80"), r"ref: uri 'file:///\\udc80' cannot be sent"),
        (lambda: inner(1, 2),
         r"inner: child 0 must be a node \(text\(\), blob\(\), ref\(\), inner\(\)\) or a NodeRef, got int"),
        (lambda: inner(text("x"), "y"), r"inner: child 1 must be a node .*, got str"),
        (lambda: inner(text("x"), id=5), r"inner: id must be a str, got int 5"),
        (lambda: NodeRef(5), r"NodeRef: id must be a str, got int 5"),
        (lambda: NodeRef("\udc80"), r"NodeRef: id '\\udc80' cannot be sent"),
    ],
)
def test_node_constructors_refuse_wrong_arguments_naming_them(build: Callable[[], object], match: str) -> None:
    """Each raised a raw AttributeError, TypeError or UnicodeEncodeError (or, for blob([5]), built
    five zero bytes); inner(1, 2) failed only as run() sent it, after the action had gone out."""
    with pytest.raises(ArgumentTypeError, match=match):
        build()


async def test_a_bad_node_is_refused_before_run_sends_anything(nursery: trio.Nursery) -> None:
    """A node whose child fails as it is sent would leave the peer's action waiting for an input
    that never comes: nothing goes out, and the session serves on."""
    address = await start(nursery)
    async with connect(address) as session:
        with pytest.raises(ArgumentTypeError, match="child 1 must be a node"):
            await session.run("ECHO", {"input": inner(text("a"), 2)}, ["output"])  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match="input name 'in\\\\udc80put' cannot be sent"):
            await session.run("ECHO", {"in\udc80put": text("a")}, ["output"])
        call = await session.run("ECHO", {"input": inner(text("a"), blob([b"b", b"c"]))}, ["output"])
        assert await call["output"].read_bytes() == b"abc"


async def test_a_noderef_to_no_node_of_the_session_is_refused_at_once(nursery: trio.Nursery) -> None:
    address = await start(nursery)
    with trio.fail_after(5):
        async with connect(address) as session:
            with pytest.raises(UnknownNodeError, match="'nowhere'") as refused:
                await session.run("ECHO", {"input": NodeRef("nowhere")}, ["output"])
            assert refused.value.code is StatusCode.NOT_FOUND
            first = await session.run("ECHO", {"input": text("reuse me")}, ["output"])
            again = await session.run("ECHO", {"input": first["output"].ref}, ["output"])  # a node it expects
            assert await again["output"].read_text() == "reuse me"


@pytest.mark.parametrize("target", ["127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "host:70000", ""])
async def test_a_target_without_a_port_is_a_configuration_error_naming_it(target: str) -> None:
    with pytest.raises(ConfigurationError, match=f"target {target!r}: expected host:port"):
        async with connect(target):
            pass


@pytest.mark.parametrize(
    ("option", "value"), [("retries", -1), ("retries", 1.5), ("connect_timeout", 0), ("backoff", -1), ("timeout", 0)]
)
def test_bad_client_settings_are_configuration_errors(option: str, value: object) -> None:
    with pytest.raises(ConfigurationError, match=f"Client {option}"):
        Client("127.0.0.1:50051", **{option: value})  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_nothing_listening_is_unavailable_at_once_and_retries_wait_for_a_late_server(
    nursery: trio.Nursery,
) -> None:
    port = free_port()
    with trio.fail_after(5), pytest.raises(SessionAbortedError, match="UNAVAILABLE: cannot reach") as refused:
        async with Client(f"127.0.0.1:{port}"):
            pass
    assert refused.value.code is StatusCode.UNAVAILABLE

    async def late_server() -> None:
        await trio.sleep(0.5)
        server = Server()
        register_builtin_actions(server)
        await server.serve("127.0.0.1", port)

    nursery.start_soon(late_server)
    with trio.fail_after(20):
        async with Client(f"127.0.0.1:{port}", retries=8, backoff=0.1) as client, client.session() as session:
            call = await session.run("ECHO", {"input": text("late")}, ["output"])
            assert await call["output"].read_text() == "late"


async def test_a_plaintext_client_of_a_tls_server_is_told_so_and_the_server_logs_the_peer(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = Pki(tmp_path)
    port = await serve(nursery, server_context(pki.server_cert, pki.server_key))
    caplog.set_level(logging.INFO, logger="evergreen_trio")
    with trio.fail_after(10), pytest.raises(SessionAbortedError, match="is it serving TLS") as refused:
        async with connect(f"127.0.0.1:{port}"):
            pass
    assert refused.value.code is StatusCode.UNAVAILABLE
    lines = [r.getMessage() for r in caplog.records if "tls_handshake_failed" in r.getMessage()]
    assert len(lines) == 1 and "peer=127.0.0.1:" in lines[0] and "plaintext" in lines[0], lines


async def test_a_tls_client_of_a_plaintext_server_is_told_so_and_the_server_logs_the_peer(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pki = Pki(tmp_path)
    address = await start(nursery)
    caplog.set_level(logging.INFO, logger="evergreen_trio")
    tls: ssl.SSLContext = client_context(ca_file=pki.ca_file)
    with trio.fail_after(10), pytest.raises(SessionAbortedError, match="serving without TLS") as refused:
        async with connect(address, tls=tls):
            pass
    assert refused.value.code is StatusCode.UNAVAILABLE
    lines = [r.getMessage() for r in caplog.records if "protocol_error" in r.getMessage()]
    assert len(lines) == 1 and "peer=" in lines[0] and "TLS client" in lines[0], lines


async def test_tasks_started_before_the_client_opened_can_use_it(nursery: trio.Nursery) -> None:
    """The stream's asyncio task runs in the context the Client was opened in, whoever opens it."""
    address = await start(nursery)
    opened = trio.Event()
    answers: list[str] = []
    client = Client(address)

    done = trio.Event()

    async def early_task() -> None:
        await opened.wait()
        async with client.session() as session:
            call = await session.run("ECHO", {"input": text("early")}, ["output"])
            answers.append(await call["output"].read_text())
        done.set()

    async with trio.open_nursery() as tasks:
        tasks.start_soon(early_task)
        async with client:
            opened.set()
            with trio.fail_after(10):
                await done.wait()  # its session must end before the client closes (this raced)
    assert answers == ["early"]


async def test_a_session_still_open_when_the_client_closes_ends_unavailable(nursery: trio.Nursery) -> None:
    """A session of another task, open when the Client block exits: it ends with UNAVAILABLE, and
    neither it nor the closing client waits forever (its end waited, shielded, for trailers)."""
    address = await start(nursery)
    client = Client(address)
    opened, started = trio.Event(), trio.Event()
    errors: list[SessionAbortedError] = []

    async def other_task() -> None:
        await opened.wait()
        try:
            async with client.session() as session:
                await session.run("ECHO", {"input": text("x")}, ["output"])
                started.set()
                await trio.sleep_forever()
        except SessionAbortedError as error:
            errors.append(error)

    with trio.fail_after(10):
        async with trio.open_nursery() as tasks:
            tasks.start_soon(other_task)
            async with client:
                opened.set()
                await started.wait()
    assert [e.code for e in errors] == [StatusCode.UNAVAILABLE]


async def test_a_connection_lost_after_the_servers_first_message_ends_the_session(nursery: trio.Nursery) -> None:
    """The connection drops (here a proxy between the two closes it) once the server has answered
    something: the session ends with UNAVAILABLE. The client's read of the next message waited
    forever, and so did its session's end, shielded, past any fail_after."""
    server = Server()

    @server.action("HALF", inputs=["input"], outputs=["output"])
    async def half(ctx: ActionContext) -> None:
        await ctx.output("output").write("first")
        await trio.sleep_forever()

    address = await start(nursery, server)
    host, port = address.rsplit(":", 1)
    cut = trio.CancelScope()

    async def proxy(client_side: trio.SocketStream) -> None:
        async def pump(source: trio.abc.ReceiveStream, sink: trio.abc.SendStream) -> None:
            async for data in source:
                await sink.send_all(data)

        with cut:
            async with await trio.open_tcp_stream(host, int(port)) as server_side, trio.open_nursery() as pumps:
                pumps.start_soon(pump, client_side, server_side)
                pumps.start_soon(pump, server_side, client_side)
        await client_side.aclose()

    listeners = await nursery.start(trio.serve_tcp, proxy, 0)
    proxy_port = listeners[0].socket.getsockname()[1]
    with trio.fail_after(10), pytest.raises(SessionAbortedError) as ended:
        async with Client(f"127.0.0.1:{proxy_port}") as client, client.session() as session:
            call = await session.run("HALF", {"input": text("x")}, ["output"])
            chunk = await call["output"].__aiter__().__anext__()
            pieces = chunk.__aiter__()
            assert await pieces.__anext__() == b"first"  # the client has the server's first message
            cut.cancel()
            await pieces.__anext__()
    assert ended.value.code is StatusCode.UNAVAILABLE
