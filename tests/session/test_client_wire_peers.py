"""The client's own HTTP/2 (``_grpc/client_wire.py``) against real gRPC servers: grpcio's C core, which
uses HPACK's dynamic table, its own window sizes and SETTINGS, and ends calls with trailers or resets;
and grpclib on ``h2`` (the library the client used before), in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from grpclib.const import Status

from evergreen_trio._grpc.client import ClientOptions, open_client_channel
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, NodeFragment, SessionMessage

PATH = "/test.Echo/Chat"
GUARD_S = 30  # a hang guard, not a timing assertion


def chat(requests: Iterator[BytesValue], context: grpc.ServicerContext) -> Iterator[BytesValue]:
    """Echo each message; ``fail`` aborts NOT_FOUND, ``sleep`` outlives the caller's deadline, ``meta``
    answers with the caller's ``x-key`` metadata."""
    for request in requests:
        if request.value == b"fail":
            context.abort(grpc.StatusCode.NOT_FOUND, "no such thing: 100%")
        if request.value == b"sleep":
            time.sleep(2)
        if request.value == b"meta":
            yield BytesValue(value=dict(context.invocation_metadata())["x-key"].encode())
            continue
        yield request


def grpcio_server(*options: tuple[str, int]) -> tuple[grpc.Server, int]:
    """A started grpcio server of ``chat`` and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[
        ("grpc.max_receive_message_length", 8 << 20),
        ("grpc.max_send_message_length", 8 << 20), *options])
    handler = grpc.method_handlers_generic_handler("test.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(
        chat, request_deserializer=BytesValue.FromString, response_serializer=BytesValue.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


@pytest.fixture
def grpcio_port() -> Iterator[int]:
    server, port = grpcio_server()
    try:
        yield port
    finally:
        server.stop(None)


@pytest.fixture
def grpclib_port() -> Iterator[int]:
    root = Path(__file__).parents[2]
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("grpclib_echo_server.py"))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root,
                              env={"PYTHONPATH": str(root), "PATH": ""})
    try:
        assert server.stdout is not None
        yield int(server.stdout.readline())
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(30)


def unwrapped(error: BaseException) -> BaseException:
    """The one error inside the nurseries' groups."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


async def exchange(port: int, values: list[bytes], options: ClientOptions | None = None) -> list[bytes]:
    """One call: send ``values``, half-close, read every answer."""
    answers: list[bytes] = []
    async with (
        open_client_channel("127.0.0.1", port) as channel,
        channel.open_stream(PATH, BytesValue, lambda items: items, options=options) as stream,
    ):
        for value in values:
            await stream.outbound.put(BytesValue(value=value))
        stream.finish()
        while batch := await stream.inbound.get_batch():
            answers += [message.value for message in batch]  # type: ignore[attr-defined]
    return answers


async def test_messages_both_ways_past_every_window(grpcio_port: int) -> None:
    """Sixteen 1 MiB messages each way: more than grpcio's windows and ours, so both sides wait for
    WINDOW_UPDATEs and DATA is split into frames."""
    values = [bytes([i]) * (1 << 20) for i in range(16)] + [b"small"]
    with trio.fail_after(GUARD_S):
        assert await exchange(grpcio_port, values) == values


async def test_an_abort_gives_the_servers_status_and_message(grpcio_port: int) -> None:
    with trio.fail_after(GUARD_S), pytest.raises(BaseException) as caught:
        await exchange(grpcio_port, [b"first", b"fail"])
    error = unwrapped(caught.value)
    assert isinstance(error, RpcAbortError), error
    assert error.status is Status.NOT_FOUND and error.message == "no such thing: 100%"


async def test_timeout_and_metadata_reach_the_server(grpcio_port: int) -> None:
    options = ClientOptions(metadata={"x-key": "sesame"}, timeout=10.0)
    with trio.fail_after(GUARD_S):
        assert await exchange(grpcio_port, [b"meta"], options) == [b"sesame"]
    with trio.fail_after(GUARD_S), pytest.raises(BaseException) as caught:
        await exchange(grpcio_port, [b"sleep"], ClientOptions(timeout=0.2))
    error = unwrapped(caught.value)
    assert isinstance(error, RpcAbortError) and error.status is Status.DEADLINE_EXCEEDED, error


@pytest.mark.parametrize("limit", [None, 4])
async def test_many_calls_on_one_connection_within_the_servers_stream_limit(limit: int | None) -> None:
    """40 calls at once on one connection all finish (grpcio's HPACK table, filled by the first answers,
    decodes the later ones). With ``grpc.max_concurrent_streams`` 4, grpcio counts a stream until its
    handler thread ends, so a call opened as one ended may be refused (REFUSED_STREAM): not processed,
    it is sent again, and finishes too."""
    server, grpcio_port = grpcio_server(*([("grpc.max_concurrent_streams", limit)] if limit else []))
    results: list[list[bytes]] = []

    async def one(channel: object, i: int) -> None:
        async with channel.open_stream(  # type: ignore[attr-defined]
                PATH, BytesValue, lambda items: items) as stream:
            await stream.outbound.put(BytesValue(value=b"call %d" % i))
            stream.finish()
            answers = []
            while batch := await stream.inbound.get_batch():
                answers += [message.value for message in batch]
            results.append(answers)

    try:
        with trio.fail_after(GUARD_S):
            async with open_client_channel("127.0.0.1", grpcio_port) as channel, trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(one, channel, i)
    finally:
        server.stop(None)
    assert sorted(results) == sorted([[b"call %d" % i] for i in range(40)])


async def test_a_call_in_flight_runs_to_its_end_through_a_graceful_shutdown() -> None:
    """grpcio's ``stop(grace)`` says GOAWAY at once and lets the calls in flight finish within the grace.
    The client's call goes on through it (it used to end UNAVAILABLE at the GOAWAY), and the
    connection closes after it."""
    server, port = grpcio_server()
    try:
        with trio.fail_after(GUARD_S):
            async with (
                open_client_channel("127.0.0.1", port) as channel,
                channel.open_stream(PATH, BytesValue, lambda items: items) as stream,
            ):
                await stream.outbound.put(BytesValue(value=b"before"))
                assert [m.value for m in await stream.inbound.get_batch()] == [b"before"]  # type: ignore[attr-defined]
                stopped = server.stop(GUARD_S)
                connection = channel._connection
                while connection.core.accepting:  # noqa: ASYNC110 (nothing to wait on says the GOAWAY came)
                    await trio.sleep(0.01)
                await stream.outbound.put(BytesValue(value=b"after"))
                stream.finish()
                answers = []
                while batch := await stream.inbound.get_batch():
                    answers += [m.value for m in batch]  # type: ignore[attr-defined]
                assert answers == [b"after"]
            assert connection.core.closed
    finally:
        server.stop(None)
    assert stopped.wait(GUARD_S)


async def test_sessions_messages_through_a_grpclib_server(grpclib_port: int) -> None:
    """Its StartSession echo: small and 1 MiB messages (past h2's 64 KiB default windows), in order."""
    sizes = [1, 1 << 20, 10, 3 << 20, 0]
    sent = [SessionMessage(node_fragments=[NodeFragment(id=f"n{i}", chunk_fragment=Chunk(data=b"s" * size))])
            for i, size in enumerate(sizes)]
    answers: list[SessionMessage] = []
    with trio.fail_after(GUARD_S):
        for _ in range(3):  # three calls on one connection
            async with (
                open_client_channel("127.0.0.1", grpclib_port) as channel,
                channel.open_stream("/evergreen.v2.EvergreenService/StartSession", SessionMessage,
                                    lambda items: items, options=ClientOptions(max_message_bytes=8 << 20)) as stream,
            ):
                for message in sent:
                    await stream.outbound.put(message)
                stream.finish()
                while batch := await stream.inbound.get_batch():
                    answers += batch  # type: ignore[arg-type]
    assert answers == sent * 3
