"""A session stream's input fed arbitrary bytes, as the server wire delivers it to a task-per-stream
method (the session server's ``StartSession``): whole messages reach the task in order, or the stream
ends with a gRPC status naming what was wrong; nothing raises."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._grpc.server import StreamMethod, _TaskMethod
from evergreen_trio._grpc.server_wire import GrpcWireConnection, WireLimits
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import START_SESSION


async def exchange(body: bytes, limit: int) -> tuple[list[SessionMessage], str]:
    """Send ``body`` as one session stream's whole input: (messages its task read, grpc-status)."""
    received: list[SessionMessage] = []

    async def handle(stream: MessageStream[SessionMessage]) -> None:
        while batch := await stream.inbound.get_batch():
            received.extend(batch)  # type: ignore[arg-type]

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    client.initiate_connection()
    status = ""
    async with trio.open_nursery() as nursery:
        method = _TaskMethod(StreamMethod(START_SESSION, SessionMessage, handle), nursery)
        server = GrpcWireConnection({START_SESSION: method}, WireLimits(max_message_bytes=limit))
        client.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", START_SESSION),
                                (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
        client.send_data(1, body, end_stream=True)
        server.receive_data(client.data_to_send())
        method.start_opened()
        for _ in range(20):  # the task reads, finishes; the wire sends its status
            await trio.testing.wait_all_tasks_blocked()
            server.resume_unparked()
            for event in client.receive_data(server.data_to_send()):
                if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                    status = dict(event.headers).get("grpc-status", status)
            if status:
                break
    return received, status


@pytest.mark.fuzz
@given(st.binary(max_size=256), st.integers(min_value=1, max_value=64))
async def test_any_bytes_give_messages_or_a_status(data: bytes, limit: int) -> None:
    received, status = await exchange(data, limit)
    assert status in {"0", "8", "12", "13"}, status  # OK, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL
    if status != "0":
        return
    framed = b"".join(b"\x00" + len(m.SerializeToString()).to_bytes(4, "big") + m.SerializeToString()
                      for m in received)
    assert len(framed) <= len(data)


@given(st.lists(st.text(max_size=20), max_size=5))
async def test_valid_messages_round_trip(texts: list[str]) -> None:
    messages = [SessionMessage(actions=[{"name": t}]) for t in texts]
    wire = b"".join(b"\x00" + len(m.SerializeToString()).to_bytes(4, "big") + m.SerializeToString() for m in messages)
    assert await exchange(wire, 1 << 20) == (messages, "0")


async def test_the_limit_is_checked_on_the_prefix_alone() -> None:
    received, status = await exchange(b"\x00\xff\xff\xff\xff", 100)  # no body at all: refused before reading one
    assert (received, status) == ([], "8")
