"""Sessions over real gRPC: the spec's examples, streaming through barriers, and every abort status."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from evergreen_trio import (
    ActionContext,
    FileResolver,
    Server,
    SessionAbortedError,
    SessionLimits,
    StatusCode,
    blob,
    connect,
    inner,
    ref,
    text,
)
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.testing.model import Act, echo, frag_of, to_messages
from evergreen_trio.testing.wire import SyncClient


async def start(nursery: trio.Nursery, server: Server | None = None) -> tuple[Server, str]:
    if server is None:
        server = Server()
        register_builtin_actions(server)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, f"127.0.0.1:{port}"


async def test_spec_two_turn_example_with_file_refs(nursery: trio.Nursery, tmp_path: Path) -> None:
    (tmp_path / "part1").write_bytes(b"VIDEO-PART-1;")
    (tmp_path / "part2").write_bytes(b"VIDEO-PART-2")
    server = Server(resolvers=[FileResolver([tmp_path])])
    register_builtin_actions(server)
    _, address = await start(nursery, server)
    async with connect(address) as session:
        video = ref([f"file://{tmp_path}/part1", f"file://{tmp_path}/part2"], mimetype="video/mp4", id="video_1")
        prompt = inner(text("Write a summary of this video: ", id="question_1"), video, id="prompt_1")
        first = await session.run("GENERATE", {"prompt": prompt}, {"response": "response_1"})
        answer_1 = await first["response"].read_text()
        echo = await session.run("ECHO", {"input": inner(text("Who's winning?"), id="p")}, ["output"])
        assert await echo["output"].read_chunks() == [(text("").__class__ and echo_metadata(), b"Who's winning?")]
        second = await session.run(
            "GENERATE",
            {"prompt": inner(first["response"].ref, text("Who's winning?", id="question_2"), id="prompt_2")},
            {"response": "response_2"},
        )
        answer_2 = await second["response"].read_text()
        flattened = await (await session.run("ECHO", {"input": inner(prompt_ref("prompt_1"))}, ["output"]))[
            "output"
        ].read_chunks()
    assert answer_1 and answer_2 and answer_1 != answer_2
    assert [(m.mimetype, data) for m, data in flattened] == [
        ("text/plain", b"Write a summary of this video: "),
        ("video/mp4", b"VIDEO-PART-1;VIDEO-PART-2"),
    ]


def echo_metadata() -> object:
    from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import ChunkMetadata

    return ChunkMetadata(mimetype="text/plain", role="user")


def prompt_ref(node_id: str) -> object:
    from evergreen_trio import NodeRef

    return NodeRef(node_id)


async def test_consumer_streams_first_leaf_while_later_ones_are_unsent(nursery: trio.Nursery) -> None:
    """The ECHO output's first child arrives while the client has not yet written the second input leaf."""
    _, address = await start(nursery)
    async with connect(address) as session:
        late = session.open_leaf()
        call = await session.run("ECHO", {"input": inner(text("early"), prompt_ref(late.id))}, ["output"])
        chunks = aiter(call["output"])
        first = await anext(chunks)
        assert (first.mimetype, await first.read()) == ("text/plain", b"early")
        await late.write(b"late-1", mimetype="application/octet-stream")
        await late.write(b"late-2", last=True)
        second = await anext(chunks)
        assert await second.read() == b"late-1late-2"


async def test_blob_parts_and_shared_children_flatten_in_order(nursery: trio.Nursery) -> None:
    _, address = await start(nursery)
    shared = text("S", id="shared")
    async with connect(address) as session:
        await session.send(shared)
        call = await session.run(
            "ECHO",
            {"input": inner(prompt_ref("shared"), blob([b"a", b"b", b"c"], mimetype="x/y"), prompt_ref("shared"))},
            ["output"],
        )
        chunks = await call["output"].read_chunks()
    assert [(m.mimetype, d) for m, d in chunks] == [("text/plain", b"S"), ("x/y", b"abc"), ("text/plain", b"S")]


async def abort_code(address: str, action: str, inputs: dict[str, object], target: str = "") -> SessionAbortedError:
    with pytest.raises(SessionAbortedError) as info:
        async with connect(address) as session:
            call = await session.run(action, inputs, ["output"], target=target)  # type: ignore[arg-type]
            await call["output"].read_bytes()
    return info.value


async def test_abort_statuses_name_the_fault_and_server_keeps_serving(nursery: trio.Nursery) -> None:
    server = Server(limits=SessionLimits(max_fragment_bytes=16))
    register_builtin_actions(server)

    @server.action("FAIL", inputs=["input"], outputs=["output"])
    async def fail(ctx: ActionContext) -> None:
        raise ValueError("model exploded")

    _, address = await start(nursery, server)
    unknown = await abort_code(address, "NOPE", {"input": text("x")})
    assert unknown.code is StatusCode.UNIMPLEMENTED and "NOPE" in unknown.message
    target = await abort_code(address, "ECHO", {"input": text("x")}, target="tpu-7")
    assert target.code is StatusCode.NOT_FOUND and "tpu-7" in target.message
    failed = await abort_code(address, "FAIL", {"input": text("x")})
    assert failed.code is StatusCode.INTERNAL and "FAIL" in failed.message and "error id" in failed.message
    too_big = await abort_code(address, "ECHO", {"input": blob(b"x" * 17)})
    assert too_big.code is StatusCode.RESOURCE_EXHAUSTED
    bad_input = await abort_code(address, "ECHO", {"prompt": text("x")})
    assert bad_input.code is StatusCode.INVALID_ARGUMENT and "prompt" in bad_input.message
    refs_off = await abort_code(address, "ECHO", {"input": ref("file:///etc/passwd")})
    assert refs_off.code is StatusCode.INVALID_ARGUMENT and "resolves: none" in refs_off.message
    async with connect(address) as session:
        call = await session.run("ECHO", {"input": text("still serving")}, ["output"])
        assert await call["output"].read_bytes() == b"still serving"
    assert server.open_sessions == 0


async def test_output_ids_must_be_new(nursery: trio.Nursery) -> None:
    _, address = await start(nursery)
    with pytest.raises(SessionAbortedError) as info:
        async with connect(address) as session:
            call = await session.run("ECHO", {"input": text("a", id="a")}, {"output": "out"})
            await call["output"].read_bytes()
            session.graph.nodes.pop("out")  # forget locally, so only the server can object
            session.graph._outputs.pop("out")
            again = await session.run("ECHO", {"input": text("b")}, {"output": "out"})
            await again["output"].read_bytes()
    assert info.value.code is StatusCode.INVALID_ARGUMENT and "'out' is not new" in info.value.message


async def test_unrequested_outputs_are_not_produced(nursery: trio.Nursery) -> None:
    server = Server()

    @server.action("TWO", inputs=[], outputs=["a", "b"])
    async def two(ctx: ActionContext) -> None:
        await ctx.output("a").write("A")
        await ctx.output("b").write("B")

    _, address = await start(nursery, server)
    async with connect(address) as session:
        call = await session.run("TWO", {}, ["a"])
        assert await call["a"].read_text() == "A"
    assert [n for n in session.graph.nodes if n.startswith("<")] == []
    assert len(session.graph.nodes) == 1


async def test_server_shutdown_ends_open_sessions_with_unavailable(nursery: trio.Nursery) -> None:
    server = Server()
    started = trio.Event()

    @server.action("WAIT", inputs=[], outputs=["output"])
    async def wait(ctx: ActionContext) -> None:
        started.set()
        await trio.sleep_forever()

    server_scope = trio.CancelScope()

    async def run_server(task_status: trio.TaskStatus[int]) -> None:
        with server_scope:
            await server.serve("127.0.0.1", 0, task_status=task_status)

    port = await nursery.start(run_server)
    with pytest.raises(SessionAbortedError) as info, trio.fail_after(15):
        async with connect(f"127.0.0.1:{port}") as session:
            call = await session.run("WAIT", {}, ["output"])
            await started.wait()
            server_scope.cancel()
            await call["output"].read_bytes()
    assert info.value.code is StatusCode.UNAVAILABLE


@pytest.mark.parametrize(
    "uri",
    ["file:///{root}/../secret", "file:///etc/passwd", "file://evil.example/{root}/a", "file:///{root}/link/secret",
     "http://x/a", "file:relative"],
)
def test_file_resolver_refuses_traversal(tmp_path: Path, uri: str) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (tmp_path / "secret").write_text("no")
    (root / "link").symlink_to(tmp_path)
    from evergreen_trio.dag import RefRejectedError

    with pytest.raises(RefRejectedError):
        FileResolver([root]).path(uri.format(root=str(root).lstrip("/")))


def test_a_file_ref_too_long_to_be_a_path_is_refused_before_it_is_resolved(tmp_path: Path) -> None:
    """os.path.realpath of a 1 MB ``/a/a/...`` took about 15 s of the one thread (quadratic in its
    components), on the ref's arrival; no path past PATH_MAX can be opened anyway."""
    from evergreen_trio.dag import RefRejectedError

    resolver = FileResolver([tmp_path])
    resolver.check(f"file://{tmp_path}/{'a' * 3000}")  # long, but a path
    started = time.perf_counter()
    with pytest.raises(RefRejectedError, match="a path longer than 4096 bytes"):
        resolver.check("file://" + "/a" * 500_000)
    assert time.perf_counter() - started < 1.0


async def test_a_child_output_read_after_the_peer_ends_its_stream_is_awaited_not_refused(
    nursery: trio.Nursery,
) -> None:
    """A later ECHO reads an earlier action's output whose child is named but not yet written
    when the client half-closes: the child is produced here, so the reader waits for it."""
    server = Server()
    register_builtin_actions(server)

    @server.action("CHILD_LATER", inputs=[], outputs=["output"])
    async def child_later(ctx: ActionContext) -> None:
        output = ctx.output("output")
        child = await output.child()
        await output.close()
        while not ctx.session.graph.peer_closed:  # noqa: ASYNC110 - the graph has no event for it
            await trio.sleep(0.01)
        for _ in range(10):  # lets ECHO's reader look at the child first
            await trio.lowlevel.checkpoint()
        await child.write("written late", last=True)

    _, address = await start(nursery, server)
    items = [Act("CHILD_LATER", (), (("output", "o:0"),)), echo("o:0", "o:1")]
    with SyncClient(address) as client:
        outcome = await trio.to_thread.run_sync(client.run, to_messages(items))
    assert outcome.ok, outcome.describe()
    echoed = [frag_of(f) for m in outcome.received for f in m.node_fragments if f.id.startswith("o:1")]
    assert any(f.chunk and f.chunk[1] == b"written late" for f in echoed), echoed
