"""Interop: grpcio drives a session against our server; our client talks to our server in another process."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import trio

from evergreen_trio import Server, connect, inner, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import (
    Action,
    Chunk,
    ChunkMetadata,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from evergreen_trio._wire import START_SESSION
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.testing.subprocess_server import serve_command


def grpcio_echo(address: str, credentials: grpc.ChannelCredentials | None = None) -> list[SessionMessage]:
    """A blocking grpcio client: the spec's streamed-chain example through ECHO (over TLS with ``credentials``)."""

    def requests() -> Iterator[SessionMessage]:
        yield SessionMessage(
            actions=[
                Action(
                    name="ECHO",
                    inputs=[NamedParameter(name="input", id="prompt_1")],
                    outputs=[NamedParameter(name="output", id="echo_1")],
                )
            ]
        )
        yield SessionMessage(node_fragments=[NodeFragment(id="prompt_1", child_ids=["prompt_1_text"], continued=True)])
        text_chunk = Chunk(metadata=ChunkMetadata(mimetype="text/plain"), data=b"Write a heroic novel.")
        yield SessionMessage(node_fragments=[NodeFragment(id="prompt_1_text", chunk_fragment=text_chunk)])
        yield SessionMessage(node_fragments=[NodeFragment(id="prompt_1", child_ids=["prompt_1_eot"], seq=1)])
        eot = Chunk(metadata=ChunkMetadata(mimetype="application/x-protobuf; type=EndOfTurn"))
        yield SessionMessage(node_fragments=[NodeFragment(id="prompt_1_eot", chunk_fragment=eot)])

    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel:
        call = channel.stream_stream(
            START_SESSION,
            request_serializer=SessionMessage.SerializeToString,
            response_deserializer=SessionMessage.FromString,
        )
        return list(call(requests(), timeout=30))


async def test_grpcio_client_against_our_server(nursery: trio.Nursery) -> None:
    server = Server()
    register_builtin_actions(server)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    replies = await trio.to_thread.run_sync(grpcio_echo, f"127.0.0.1:{port}")
    fragments = [f for message in replies for f in message.node_fragments]
    leaves = {f.id: f for f in fragments if f.HasField("chunk_fragment") and f.chunk_fragment.data}
    children = [c for f in sorted((f for f in fragments if f.id == "echo_1"), key=lambda f: f.seq) for c in f.child_ids]
    assert len(children) == 2
    assert leaves[children[0]].chunk_fragment.data == b"Write a heroic novel."
    eot = next(f for f in fragments if f.id == children[1] and f.seq == 0)
    assert eot.chunk_fragment.metadata.mimetype == "application/x-protobuf; type=EndOfTurn"
    assert [f for f in fragments if f.id == "echo_1"][-1].continued is False


async def test_our_client_against_our_server_in_another_process() -> None:
    async with serve_command() as line:
        address = line.split()[-1]
        async with connect(address) as session:
            call = await session.run("ECHO", {"input": inner(text("across "), text("processes"))}, ["output"])
            assert await call["output"].read_text() == "across processes"
            generated = await session.run("GENERATE", {"prompt": text("hello")}, ["response"])
            assert "hello" in await generated["response"].read_text()


@pytest.mark.parametrize("bad_address", ["no-port", "host:notaport", "host:\u00b2", "host:\u0661\u0662"])
def test_connect_rejects_malformed_targets(bad_address: str) -> None:
    from evergreen_trio.client import parse_target

    with pytest.raises(ValueError, match="host:port"):
        parse_target(bad_address)
