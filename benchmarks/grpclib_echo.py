"""The peer for bench_session: a raw grpclib bidirectional echo on plain asyncio (no Trio, no sessions).

Run as a script; prints one JSON object: messages/s for a stream of N one-fragment messages
echoed back, per-message round-trip latencies on that open stream, and the latencies of whole
bidirectional calls (open, one message each way, end, trailers) on the open channel; and the
process's CPU time per round trip and per call (both ends run in this one process); and the
class of the asyncio loop it ran on.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from grpclib.client import Channel
from grpclib.const import Cardinality, Handler
from grpclib.server import Server

from benchmarks._harness import run_plain_asyncio
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, ChunkMetadata, NodeFragment, SessionMessage

PATH = "/evergreen.v2.EvergreenService/StartSession"


class Echo:
    async def echo(self, stream: object) -> None:
        async for message in stream:  # type: ignore[attr-defined]
            await stream.send_message(message)  # type: ignore[attr-defined]

    def __mapping__(self) -> dict[str, Handler]:
        return {PATH: Handler(self.echo, Cardinality.STREAM_STREAM, SessionMessage, SessionMessage)}


def message(i: int, size: int) -> SessionMessage:
    chunk = Chunk(metadata=ChunkMetadata(mimetype="text/plain"), data=b"x" * size)
    return SessionMessage(node_fragments=[NodeFragment(id=f"n{i}", chunk_fragment=chunk)])


async def main(count: int, size: int, round_trips: int, calls: int) -> dict[str, object]:
    server = Server([Echo()])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = Channel("127.0.0.1", port)
    messages = [message(i, size) for i in range(count)]
    async with channel.request(PATH, Cardinality.STREAM_STREAM, SessionMessage, SessionMessage) as stream:
        await stream.send_request()

        async def send() -> None:
            for m in messages:
                await stream.send_message(m)

        start = time.perf_counter()
        sender = asyncio.ensure_future(send())
        for _ in range(count):
            await stream.recv_message()
        elapsed = time.perf_counter() - start
        await sender
        latencies = []
        cpu = time.process_time()
        for i in range(round_trips):
            t = time.perf_counter()
            await stream.send_message(messages[i % count])
            await stream.recv_message()
            latencies.append(time.perf_counter() - t)
        round_trip_cpu = (time.process_time() - cpu) / max(round_trips, 1)
        await stream.end()
    call_latencies = []
    cpu = time.process_time()
    for i in range(calls):
        t = time.perf_counter()
        async with channel.request(PATH, Cardinality.STREAM_STREAM, SessionMessage, SessionMessage) as stream:
            await stream.send_message(messages[i % count])
            await stream.recv_message()
            await stream.end()
            async for _ in stream:  # to the server's trailers
                pass
        call_latencies.append(time.perf_counter() - t)
    call_cpu = (time.process_time() - cpu) / max(calls, 1)
    channel.close()
    server.close()
    await server.wait_closed()
    loop = type(asyncio.get_running_loop())
    return {"loop": f"{loop.__module__}.{loop.__qualname__}", "messages_per_s": count / elapsed,
            "round_trips_s": latencies, "calls_s": call_latencies,
            "round_trip_cpu_s": round_trip_cpu, "call_cpu_s": call_cpu}


if __name__ == "__main__":
    count, size, round_trips, calls = (int(a) for a in sys.argv[1:5])
    print(json.dumps(run_plain_asyncio(main(count, size, round_trips, calls))))
