"""A server shut down with sessions open: every client gets UNAVAILABLE, none hangs."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import grpc  # type: ignore[import-untyped]
import pytest
import trio

from evergreen_trio import NodeRef, Server, SessionAbortedError, StatusCode, connect
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.testing.model import Frag, Meta, echo, to_messages
from evergreen_trio.testing.subprocess_server import spawn_server

HANG_GUARD = 30


async def _open_session_until_aborted(port: int, ready: trio.Semaphore, codes: list[StatusCode]) -> None:
    """A session whose ECHO waits for input that never comes, until the server goes away."""
    try:
        async with connect(f"127.0.0.1:{port}") as session:
            leaf = session.open_leaf()
            call = await session.run("ECHO", {"input": NodeRef(leaf.id)}, ["output"])
            await leaf.write("part one; the rest never comes")
            ready.release()
            await call["output"].read_chunks()
    except SessionAbortedError as aborted:
        codes.append(aborted.code)


async def test_cancelling_the_server_ends_open_sessions_with_unavailable() -> None:
    server = Server()
    register_builtin_actions(server)
    codes: list[StatusCode] = []
    ready = trio.Semaphore(0)
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as clients, trio.open_nursery() as serving:
            port = await serving.start(server.serve, "127.0.0.1", 0)
            for _ in range(3):
                clients.start_soon(_open_session_until_aborted, port, ready, codes)
            for _ in range(3):
                await ready.acquire()
            while server.open_sessions < 3:  # noqa: ASYNC110 - the clients' first messages are on their way
                await trio.sleep(0.02)
            serving.cancel_scope.cancel()
    assert codes == [StatusCode.UNAVAILABLE] * 3
    assert server.open_sessions == 0


def _grpcio_session(address: str, opened: threading.Event) -> grpc.StatusCode:
    """A grpcio client with a session open (an ECHO waiting for input) until the server ends it."""
    leaf = [echo("c:a", "o:0"), Frag("c:a", 0, True, chunk=(Meta("text/plain"), b"part one"))]
    hold = threading.Event()

    def requests() -> Iterator[SessionMessage]:
        yield from to_messages(leaf)
        opened.set()
        hold.wait(HANG_GUARD)

    with grpc.insecure_channel(address) as channel:
        start = channel.stream_stream(
            START_SESSION, request_serializer=SessionMessage.SerializeToString,
            response_deserializer=SessionMessage.FromString,
        )
        try:
            for _ in start(requests(), timeout=HANG_GUARD):
                pass
        except grpc.RpcError as error:
            return error.code()
        finally:
            hold.set()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_a_server_process_stopped_with_a_grpcio_session_open_gives_unavailable(how: str) -> None:
    with spawn_server() as server:
        opened = threading.Event()
        result: list[grpc.StatusCode] = []
        client = threading.Thread(target=lambda: result.append(_grpcio_session(server.address, opened)))
        client.start()
        assert opened.wait(HANG_GUARD)
        trio.run(trio.sleep, 0.2)  # lets the server start the session's action
        server.process.send_signal(getattr(signal, how))
        client.join(HANG_GUARD + 5)
        assert not client.is_alive()
    assert result == [grpc.StatusCode.UNAVAILABLE]
