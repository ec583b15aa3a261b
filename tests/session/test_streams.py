"""No data vanishes silently: bytes written without a mimetype say application/octet-stream,
``read_text`` refuses a chunk that is not text (naming its mimetype), and a stream read twice
reads its node again from the start."""

from __future__ import annotations

import pytest
import trio

from evergreen_trio import ActionContext, Server, SessionAbortedError, blob, connect, inner, text
from evergreen_trio.dag import NotTextError, StatusCode


async def test_bytes_default_to_octet_stream_and_read_text_names_what_is_not_text(nursery: trio.Nursery) -> None:
    server = Server()

    @server.action("BYTES", inputs=["input"], outputs=["output"])
    async def write_bytes(ctx: ActionContext) -> None:
        await ctx.output("output").write(b"\x00\x01", last=True)

    @server.action("TEXT", inputs=["input"], outputs=["output"])
    async def read_text(ctx: ActionContext) -> None:
        await ctx.output("output").write(await ctx.input("input").read_text(), last=True)

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with connect(f"127.0.0.1:{port}", timeout=30) as session:
        call = await session.run("BYTES", {"input": text("")}, ["output"])
        [(metadata, data)] = await call["output"].read_chunks()
        assert (metadata.mimetype, data) == ("application/octet-stream", b"\x00\x01")
        with pytest.raises(NotTextError) as not_text:
            await call["output"].read_text()
        assert not_text.value.mimetype == "application/octet-stream"
        assert "application/octet-stream" in str(not_text.value)
        assert await call["output"].read_text(mimetype_prefix="") == "\x00\x01"
    # A handler's read_text of a non-text input aborts with INVALID_ARGUMENT naming the mimetype.
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(f"127.0.0.1:{port}", timeout=30) as session:
            image = blob(b"\x89PNG", mimetype="image/png")
            call = await session.run("TEXT", {"input": inner(text("a"), image)}, ["output"])
            await call["output"].read_text()
    assert aborted.value.code is StatusCode.INVALID_ARGUMENT
    assert "image/png" in str(aborted.value)


async def test_a_stream_read_twice_reads_its_node_again(nursery: trio.Nursery) -> None:
    server = Server()

    @server.action("TWICE", inputs=["input"], outputs=["output"])
    async def twice(ctx: ActionContext) -> None:
        first = await ctx.input("input").read_text()
        second = await ctx.input("input").read_text()
        await ctx.output("output").write(first + "|" + second, last=True)

    port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with connect(f"127.0.0.1:{port}", timeout=30) as session:
        call = await session.run("TWICE", {"input": inner(text("a"), text("b"))}, ["output"])
        output = call["output"]
        assert await output.read_text() == "ab|ab"
        assert await output.read_text() == "ab|ab"
        assert [chunk.mimetype async for chunk in output] == ["text/plain"]
