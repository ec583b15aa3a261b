"""Counts per one-chunk ECHO round trip that do not drift with the machine (``python -m benchmarks.session_calls``).

For one ECHO after another in one open session: Python calls (``sys.setprofile`` call events; a
coroutine's resumption counts as one) and C calls, Trio task steps and scheduling passes (a
``trio.abc.Instrument``), and CPU and wall time (these do drift). Three setups, each in one process:

- ``wire``: a ``Client`` and a ``Server`` on loopback, as ``python -m benchmarks session`` runs them;
- ``memory``: the two session ends linked in memory, each message serialized and parsed (no gRPC);
- ``shells``: our gRPC client and server shells echoing a message of the same size through a
  task-per-stream method: the session's transport and task hops without the session layer.

docs/production.md ("What a session costs, against raw grpclib") quotes them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from types import FrameType
from typing import Any

import trio
from google.protobuf.message import Message
from grpclib.const import Status

from evergreen_trio import Client, Server, text
from evergreen_trio._grpc.client import open_client_channel
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.server import StreamMethod, serve_grpc
from evergreen_trio._grpc.streams import MessageStream
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.client import ClientSession
from evergreen_trio.nursery_session import Outbound, ServerSession, SessionOptions, pack_messages
from evergreen_trio.serving.metrics import SessionMetrics

PAYLOAD = "x" * 64
WARM_UP = 50
COUNTED = 200
"""Round trips counted under the profile hook and under the instrument (each its own)."""

RoundTrip = Callable[[], Awaitable[None]]


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.steps = self.passes = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1

    def after_io_wait(self, timeout: float) -> None:
        self.passes += 1


async def measure(round_trip: RoundTrip, rounds: int) -> dict[str, float]:
    """Time ``rounds`` round trips, then count steps and calls over ``COUNTED`` more each."""
    for _ in range(WARM_UP):
        await round_trip()
    walls = []
    cpu = time.process_time()
    for _ in range(rounds):
        start = time.perf_counter()
        await round_trip()
        walls.append(time.perf_counter() - start)
    result = {"cpu_us": (time.process_time() - cpu) / rounds * 1e6, "p50_us": statistics.median(walls) * 1e6}
    steps = Steps()
    trio.lowlevel.add_instrument(steps)
    try:
        for _ in range(COUNTED):
            await round_trip()
    finally:
        trio.lowlevel.remove_instrument(steps)
    calls = {"call": 0, "c_call": 0}

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event in calls:
            calls[event] += 1

    sys.setprofile(count)
    try:
        for _ in range(COUNTED):
            await round_trip()
    finally:
        sys.setprofile(None)
    result.update(python_calls=calls["call"] / COUNTED, c_calls=calls["c_call"] / COUNTED,
                  task_steps=steps.steps / COUNTED, passes=steps.passes / COUNTED)
    return result


def echo_of(session: ClientSession) -> RoundTrip:
    async def round_trip() -> None:
        call = await session.run("ECHO", {"input": text(PAYLOAD)}, ["output"])
        await call["output"].read_bytes()

    return round_trip


def echo_server() -> Server:
    server = Server()
    register_builtin_actions(server)
    return server


async def over_wire(rounds: int) -> dict[str, float]:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(echo_server().serve, "127.0.0.1", 0)
        async with Client(f"127.0.0.1:{port}") as client, client.session() as session:
            result = await measure(echo_of(session), rounds)
        nursery.cancel_scope.cancel()
    return result


async def relay(source: MessageStream[Outbound], target: MessageStream[Outbound]) -> None:
    """The wire, in one task: ``source``'s packed messages, serialized and parsed, into ``target``."""
    while batch := await source.outbound.get_batch():
        for message in source.pack(batch):
            await target.inbound.put(SessionMessage.FromString(message.SerializeToString()))
    final = source.final
    if final is not None and final.status is not Status.OK:
        target.inbound.close(RpcAbortError(final.status, final.message or final.status.name))
    else:
        target.inbound.close()


async def in_memory(rounds: int) -> dict[str, float]:
    server = echo_server()
    ours: MessageStream[Outbound] = MessageStream(pack_messages)
    theirs: MessageStream[Outbound] = MessageStream(pack_messages)
    session = ClientSession(ours, SessionOptions())
    served = ServerSession(theirs, SessionOptions(metrics=SessionMetrics()), server.actions, server.targets)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(relay, ours, theirs)
        nursery.start_soon(relay, theirs, ours)
        nursery.start_soon(served.run_session)
        nursery.start_soon(session.serve)
        result = await measure(echo_of(session), rounds)
        ours.finish()
    return result


async def shells(rounds: int) -> dict[str, float]:
    path = "/benchmarks.Echo/Echo"

    async def echo(stream: MessageStream[Message]) -> None:
        while batch := await stream.inbound.get_batch():
            for message in batch:
                await stream.outbound.put(message)

    message = SessionMessage()
    message.node_fragments.add(id="leaf-1234abcd-1").chunk_fragment.data = PAYLOAD.encode()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_grpc, [StreamMethod(path, SessionMessage, echo)], "127.0.0.1", 0))
        async with (
            open_client_channel("127.0.0.1", port) as channel,
            channel.open_stream(path, SessionMessage, lambda items: items) as stream,
        ):
            async def round_trip() -> None:
                await stream.outbound.put(message)
                await stream.inbound.get_batch()

            result = await measure(round_trip, rounds)
            stream.finish()
        nursery.cancel_scope.cancel()
    return result


SETUPS = {"wire": over_wire, "memory": in_memory, "shells": shells}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.session_calls", description=__doc__.splitlines()[0])
    parser.add_argument("setups", nargs="*", metavar="SETUP", help=f"any of {', '.join(SETUPS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=2000, help="round trips timed per setup (default 2000)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.setups if name not in SETUPS]
    if unknown:
        parser.error(f"unknown setup {unknown[0]!r}: expected any of {', '.join(SETUPS)}")
    columns = ("python_calls", "c_calls", "task_steps", "passes", "cpu_us", "p50_us")
    print(f"| setup | {' | '.join(columns)} |")
    print(f"|---|{'---:|' * len(columns)}")
    for name in args.setups or SETUPS:
        result = trio.run(SETUPS[name], args.rounds)
        print(f"| {name} | " + " | ".join(f"{result[column]:.1f}" for column in columns) + " |")


if __name__ == "__main__":
    main()
