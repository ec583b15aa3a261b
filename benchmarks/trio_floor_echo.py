"""The Trio floor for bench_session: one message echoed over loopback with no session and no asyncio.

The server is the picker's sans-IO gRPC wire (``serve_grpc``) with an echo processor; the
client is the ``h2`` library's connection on a Trio socket, driven inline. Both ends run in this
one process, as in ``grpclib_echo``. It measures what Trio plus a lean HTTP/2 costs for the same
work as raw grpclib on asyncio, so that the session rows can be read as floor + session layer.

Run as a script; prints one JSON object: per-message round-trip latencies on one open stream,
whole bidirectional calls (open, one message each way, end, trailers) on the open connection, and
the process's CPU time per round trip and per call.
"""

from __future__ import annotations

import json
import sys
import time

import h2.config
import h2.connection
import h2.events
import trio

from benchmarks.grpclib_echo import PATH, message
from evergreen_trio._grpc.client_wire import frame
from evergreen_trio._grpc.server import serve_grpc
from evergreen_trio._grpc.server_wire import SyncBidiMethod
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage

HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "127.0.0.1"),
           ("content-type", "application/grpc"), ("te", "trailers")]


class Echo:
    """Answers every message with itself."""

    finished = False

    def on_message(self, message: SessionMessage) -> list[SessionMessage]:
        return [message]

    def on_end(self) -> list[SessionMessage]:
        return []


class FloorClient:
    """The h2 client connection, driven inline: send, then read until the stream has what it waits for."""

    def __init__(self, socket: trio.SocketStream) -> None:
        self.socket = socket
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.h2.initiate_connection()

    async def flush(self) -> None:
        out = self.h2.data_to_send()
        if out:
            await self.socket.send_all(out)

    async def open(self) -> int:
        stream_id: int = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream_id, HEADERS)
        return stream_id

    async def exchange(self, stream_id: int, framed: bytes, *, end: bool = False) -> None:
        """Send one framed message (and end the stream, with ``end``); read the echo (and the trailers)."""
        self.h2.send_data(stream_id, framed, end_stream=end)
        await self.flush()
        received, ended = 0, False
        while received < len(framed) or (end and not ended):
            for event in self.h2.receive_data(await self.socket.receive_some(65_536)):
                if isinstance(event, h2.events.DataReceived):
                    received += len(event.data)
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
            await self.flush()


async def main(size: int, round_trips: int, calls: int) -> dict[str, object]:
    one = frame(message(0, size).SerializeToString())
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_grpc, [SyncBidiMethod(PATH, SessionMessage, Echo)], "127.0.0.1", 0)
        client = FloorClient(await trio.open_tcp_stream("127.0.0.1", port))
        stream_id = await client.open()
        latencies = []
        cpu = time.process_time()
        for _ in range(round_trips):
            t = time.perf_counter()
            await client.exchange(stream_id, one)
            latencies.append(time.perf_counter() - t)
        round_trip_cpu = (time.process_time() - cpu) / max(round_trips, 1)
        call_latencies = []
        cpu = time.process_time()
        for _ in range(calls):
            t = time.perf_counter()
            await client.exchange(await client.open(), one, end=True)
            call_latencies.append(time.perf_counter() - t)
        call_cpu = (time.process_time() - cpu) / max(calls, 1)
        await client.socket.aclose()
        nursery.cancel_scope.cancel()
    return {"round_trips_s": latencies, "calls_s": call_latencies, "round_trip_cpu_s": round_trip_cpu,
            "call_cpu_s": call_cpu}


if __name__ == "__main__":
    size, round_trips, calls = (int(a) for a in sys.argv[1:4])
    print(json.dumps(trio.run(main, size, round_trips, calls)))
