"""Deadlines: a client ``timeout`` becomes ``grpc-timeout``; past it the server ends the session with
DEADLINE_EXCEEDED and cancels its nursery (the running handler is cancelled), for our client and grpcio's."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import trio

from evergreen_trio import Server, SessionAbortedError, connect, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, NamedParameter, SessionMessage
from evergreen_trio.dag import StatusCode
from evergreen_trio.nursery_session import ActionContext
from evergreen_trio.serving.server import START_SESSION


class Stuck:
    """A server whose STUCK action never ends on its own; it records whether it was cancelled."""

    def __init__(self) -> None:
        self.server = Server()
        self.started = trio.Event()
        self.cancelled = trio.Event()
        self.deadlines: list[float | None] = []

        @self.server.action("STUCK", inputs=["input"], outputs=["output"])
        async def stuck(ctx: ActionContext) -> None:
            self.deadlines.append(ctx.session.stream.deadline)
            self.started.set()
            try:
                await trio.sleep_forever()
            except trio.Cancelled:
                self.cancelled.set()
                raise


async def test_client_timeout_is_grpc_timeout_and_the_handler_is_cancelled(nursery: trio.Nursery) -> None:
    stuck = Stuck()
    port = await nursery.start(stuck.server.serve, "127.0.0.1", 0)
    start = trio.current_time()
    with pytest.raises(SessionAbortedError) as aborted:
        async with connect(f"127.0.0.1:{port}", timeout=0.5) as session:
            call = await session.run("STUCK", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    assert aborted.value.code is StatusCode.DEADLINE_EXCEEDED
    assert trio.current_time() - start < 10  # a hang guard
    deadline = stuck.deadlines[0]
    assert deadline is not None and deadline - start < 1.0  # the server knew the client's deadline
    with trio.fail_after(5):
        await stuck.cancelled.wait()
    with trio.fail_after(5):
        while stuck.server.open_sessions:  # noqa: ASYNC110 - no event for the count
            await trio.sleep(0.02)


async def test_a_server_that_does_not_answer_is_not_waited_for_past_the_timeout() -> None:
    """A listener that accepts and never speaks HTTP/2: the client's own deadline ends the session."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        held: list[trio.SocketStream] = []

        async def hold(stream: trio.SocketStream) -> None:
            held.append(stream)
            await trio.sleep_forever()

        nursery.start_soon(trio.serve_listeners, hold, [listener])
        with trio.fail_after(10), pytest.raises(SessionAbortedError) as aborted:
            async with connect(f"127.0.0.1:{port}", timeout=0.3) as session:
                call = await session.run("ECHO", {"input": text("x")}, ["output"])
                await call["output"].read_bytes()
        assert aborted.value.code is StatusCode.DEADLINE_EXCEEDED
        nursery.cancel_scope.cancel()


def grpcio_stuck(address: str) -> grpc.StatusCode:
    def requests() -> Iterator[SessionMessage]:
        yield SessionMessage(actions=[Action(name="STUCK", inputs=[NamedParameter(name="input", id="i")],
                                             outputs=[NamedParameter(name="output", id="o")])])

    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(START_SESSION, request_serializer=SessionMessage.SerializeToString,
                                     response_deserializer=SessionMessage.FromString)
        try:
            list(call(requests(), timeout=0.5))
        except grpc.RpcError as error:
            return error.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


async def test_grpcio_timeout_cancels_the_handler(nursery: trio.Nursery) -> None:
    stuck = Stuck()
    port = await nursery.start(stuck.server.serve, "127.0.0.1", 0)
    code = await trio.to_thread.run_sync(grpcio_stuck, f"127.0.0.1:{port}")
    assert code is grpc.StatusCode.DEADLINE_EXCEEDED
    with trio.fail_after(5):
        await stuck.cancelled.wait()
