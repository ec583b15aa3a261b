"""A server survives garbage collection after many aborted sessions (bridge fault).

Found by the conformance kit: each aborted session used to leave its asyncio reader
(``_pump_in`` in ``evergreen_trio/_grpc/bridge.py``) pending on a ``recv_message`` nobody would
complete; when the garbage collector reclaimed it, asyncio reported "Task was destroyed but it
is pending!" into trio-asyncio's loop and the whole server went down. The handler now cancels
the reader once grpclib is done with the stream.
"""

from __future__ import annotations

import gc

import pytest
import trio

from evergreen_trio import Server, connect, text
from evergreen_trio._grpc.client import open_client_stream
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio._wire import START_SESSION
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.testing.model import Frag, Item, Meta, echo, to_messages

TEXT = Meta("text/plain")

# ECHO waits for c:4 while c:0 turns from a leaf into an inner node (an abort); the client
# is still sending the rest when the server aborts.
ABORTED: list[Item] = [
    echo("c:4", "o:0"),
    Frag("c:0", 0, True, chunk=(TEXT, b"")),
    Frag("c:0", 1, False, children=("c:1",)),
    *(Frag(f"c:{i}", 0, False, chunk=(TEXT, b"")) for i in range(1, 5)),
]


def _as_is(messages: list[SessionMessage]) -> list[SessionMessage]:
    return messages


async def _aborted_session(port: int) -> None:
    async with open_client_stream("127.0.0.1", port, START_SESSION, SessionMessage, _as_is) as stream:
        for message in to_messages(ABORTED):
            await stream.outbound.put(message)
        with pytest.raises(RpcAbortError):
            while await stream.inbound.get_batch():
                pass


async def test_server_survives_gc_after_aborted_sessions() -> None:
    server = Server()
    register_builtin_actions(server)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        for _ in range(30):
            await _aborted_session(port)
            gc.collect()
            await trio.sleep(0.01)
        async with connect(f"127.0.0.1:{port}") as session:
            call = await session.run("ECHO", {"input": text("still serving")}, ["output"])
            assert await call["output"].read_bytes() == b"still serving"
        nursery.cancel_scope.cancel()
