"""Deadlines: a client ``timeout`` becomes ``grpc-timeout``; past it the server ends the session with
DEADLINE_EXCEEDED and cancels its nursery (the running handler is cancelled), for our client and grpcio's."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import grpc
import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from grpclib.const import Status

from evergreen_trio import Server, SessionAbortedError, connect, text
from evergreen_trio._grpc.client import ClientOptions, open_client_channel
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.server import StreamMethod, serve_grpc
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Action, NamedParameter, SessionMessage
from evergreen_trio.dag import StatusCode
from evergreen_trio.nursery_session import ActionContext
from evergreen_trio.serving.server import START_SESSION

PATH = "/test.Silent/Hold"


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


async def test_the_clients_reader_keeps_each_calls_deadline_while_others_stay_open(nursery: trio.Nursery) -> None:
    """One connection, a server that never answers (and keeps no deadline): a call without a timeout
    stays open while calls with one, opened after the reader began to wait, each end
    DEADLINE_EXCEEDED on the client's own clock (its reader waits in one cancel scope until the
    next deadline, moved by each call that opens)."""

    async def silent(stream: MessageStream[BytesValue]) -> None:
        await trio.sleep_forever()

    port = await nursery.start(partial(serve_grpc, [StreamMethod(PATH, BytesValue, silent)], "127.0.0.1", 0))
    async with (
        open_client_channel("127.0.0.1", port) as channel,
        channel.open_stream(PATH, BytesValue, lambda items: items) as open_call,
    ):
        await open_call.outbound.put(BytesValue(value=b"waits"))
        for timeout in (0.2, 0.1):
            with trio.fail_after(10):  # a hang guard
                async with channel.open_stream(PATH, BytesValue, lambda items: items,
                                               options=ClientOptions(timeout=timeout)) as call:
                    await call.outbound.put(BytesValue(value=b"times out"))
                    with pytest.raises(RpcAbortError) as ended:
                        await call.inbound.get_batch()
            assert ended.value.status is Status.DEADLINE_EXCEEDED
            assert ended.value.message == f"no answer within {timeout:g} s"
        assert not open_call.inbound.ready
        open_call.finish(Status.CANCELLED)
    nursery.cancel_scope.cancel()
