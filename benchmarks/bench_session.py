"""Evergreen sessions against a raw grpclib bidi echo on plain asyncio, measured in the same run.

(a) raw grpclib: N one-fragment messages echoed on one stream (messages/s), one-message round trips
on that open stream, and whole bidi calls (one message each way, to the trailers) on the open channel;
(b) ours: a client streams a 10,000-leaf input into a server action that consumes it and streams a
10,000-fragment output (fragments/s, both directions counted), one-chunk ECHO round trips within
one session, whole one-ECHO sessions on a reused connection (``Client.session()``) and on a
connection each (``connect()``); plus the server-side memory per live node for 100,000 small nodes;
(c) the Trio floor (``trio_floor_echo``): (a)'s round trips and calls over the picker's sans-IO wire
and an ``h2`` client on Trio sockets, no session layer and no asyncio: what the session rows cost
above what Trio and HTTP/2 themselves cost.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass, field

import trio

from benchmarks._harness import Row, percentile, print_table, write_results
from evergreen_trio import ActionContext, Client, ClientSession, Server, connect, inner, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, ChunkMetadata, NodeFragment
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag import SessionGraph

LEAF_BYTES = 64


def _peer(module: str, *args: int) -> dict[str, object]:
    """Run the peer ``benchmarks.<module>`` in a process of its own; the JSON object it prints."""
    out = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *map(str, args)],
                         check=True, capture_output=True, text=True)
    result: dict[str, object] = json.loads(out.stdout)
    return result


def raw_grpclib(count: int, round_trips: int, calls: int) -> dict[str, object]:
    result = _peer("grpclib_echo", count, LEAF_BYTES, round_trips, calls)
    if not str(result["loop"]).startswith("asyncio."):
        raise RuntimeError(f"raw grpclib ran on {result['loop']}, not plain asyncio")
    return result


def trio_floor(round_trips: int, calls: int) -> dict[str, object]:
    return _peer("trio_floor_echo", LEAF_BYTES, round_trips, calls)


def new_server() -> Server:
    server = Server()
    register_builtin_actions(server)

    @server.action("SINK_AND_STREAM", inputs=["input"], outputs=["output"])
    async def sink_and_stream(ctx: ActionContext) -> None:
        leaves = 0
        async for chunk in ctx.input("input"):
            await chunk.read()
            leaves += 1
        output = ctx.output("output")
        piece = b"y" * LEAF_BYTES
        for i in range(leaves):
            await output.write(piece, mimetype="text/plain" if i == 0 else None, last=i == leaves - 1)

    return server


@dataclass
class Ours:
    """What one run of our side measured."""

    rate: float = 0.0
    round_trips: list[float] = field(default_factory=list)
    sessions: list[float] = field(default_factory=list)
    one_shot: list[float] = field(default_factory=list)
    round_trip_cpu: float = 0.0
    session_cpu: float = 0.0


async def one_echo(session: ClientSession, payload: str) -> None:
    echo = await session.run("ECHO", {"input": text(payload)}, ["output"])
    await echo["output"].read_bytes()


async def ours(leaves: int, round_trips: int, sessions: int) -> Ours:
    server = new_server()
    measured = Ours()
    payload = "x" * LEAF_BYTES
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with Client(f"127.0.0.1:{port}") as client:
            async with client.session() as session:
                tree = inner(*[text(payload) for _ in range(leaves)])
                start = time.perf_counter()
                call = await session.run("SINK_AND_STREAM", {"input": tree}, ["output"])
                received = len(await call["output"].read_bytes()) // LEAF_BYTES
                measured.rate = 2 * leaves / (time.perf_counter() - start)
                assert received == leaves
                cpu = time.process_time()
                for _ in range(round_trips):
                    t = time.perf_counter()
                    await one_echo(session, payload)
                    measured.round_trips.append(time.perf_counter() - t)
                measured.round_trip_cpu = (time.process_time() - cpu) / round_trips
            cpu = time.process_time()
            for _ in range(sessions):
                t = time.perf_counter()
                async with client.session() as session:
                    await one_echo(session, payload)
                measured.sessions.append(time.perf_counter() - t)
            measured.session_cpu = (time.process_time() - cpu) / sessions
        for _ in range(max(sessions // 10, 5)):
            t = time.perf_counter()
            async with connect(f"127.0.0.1:{port}") as session:
                await one_echo(session, payload)
            measured.one_shot.append(time.perf_counter() - t)
        nursery.cancel_scope.cancel()
    return measured


def memory_per_node(nodes: int) -> float:
    metadata = ChunkMetadata(mimetype="text/plain")
    fragments = [
        NodeFragment(id=f"node-{i}", chunk_fragment=Chunk(metadata=metadata, data=b"x" * 16)) for i in range(nodes)
    ]
    tracemalloc.start()
    graph = SessionGraph()
    for fragment in fragments:
        graph.add_fragment(fragment)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size / nodes


def run(quick: bool = False) -> None:
    leaves, round_trips, sessions, runs = (2_000, 200, 100, 1) if quick else (10_000, 500, 300, 3)
    raw_rates: list[float] = []
    raw_rtts: list[float] = []
    raw_calls: list[float] = []
    raw_cpu: list[tuple[float, float]] = []
    runs_ours: list[Ours] = []
    floor_rtts: list[float] = []
    floor_calls: list[float] = []

    def one_raw() -> None:
        result = raw_grpclib(2 * leaves, round_trips, sessions)
        raw_rtts.extend(result["round_trips_s"])  # type: ignore[arg-type]
        raw_calls.extend(result["calls_s"])  # type: ignore[arg-type]
        raw_cpu.append((float(result["round_trip_cpu_s"]), float(result["call_cpu_s"])))  # type: ignore[arg-type]
        rate = float(result["messages_per_s"])  # type: ignore[arg-type]
        raw_rates.append(rate)

    def one_ours() -> None:
        runs_ours.append(trio.run(ours, leaves, round_trips, sessions))

    def one_floor() -> None:
        result = trio_floor(round_trips, sessions)
        floor_rtts.extend(result["round_trips_s"])  # type: ignore[arg-type]
        floor_calls.extend(result["calls_s"])  # type: ignore[arg-type]

    # Alternated, not all of one then all of the other: on a shared machine the load changes within a
    # minute, and the ratios compare runs made close together.
    for _ in range(runs):
        one_raw()
        one_floor()
        one_ours()
    raw_rate = statistics.median(raw_rates)
    our_rate = statistics.median(m.rate for m in runs_ours)

    def us(values: list[float], q: float) -> float:
        return percentile(values, q) * 1e6

    our_rtts = [v for m in runs_ours for v in m.round_trips]
    our_sessions = [v for m in runs_ours for v in m.sessions]
    one_shot = [v for m in runs_ours for v in m.one_shot]
    raw_p50, raw_p99 = us(raw_rtts, 50), us(raw_rtts, 99)
    our_p50, our_p99 = us(our_rtts, 50), us(our_rtts, 99)
    raw_call_p50, our_session_p50 = us(raw_calls, 50), us(our_sessions, 50)
    # CPU time per operation (both ends run in the one process, in both cases): on a loaded machine
    # wall-clock percentiles also measure preemption, which hits a longer operation more often.
    raw_rt_cpu = statistics.median(c[0] for c in raw_cpu) * 1e6
    raw_call_cpu = statistics.median(c[1] for c in raw_cpu) * 1e6
    our_rt_cpu = statistics.median(m.round_trip_cpu for m in runs_ours) * 1e6
    our_session_cpu = statistics.median(m.session_cpu for m in runs_ours) * 1e6
    per_node = memory_per_node(10_000 if quick else 100_000)
    rows = [
        Row("raw grpclib echo (asyncio), messages", raw_rate, "msg/s"),
        Row(f"session: {leaves:,} leaves in + {leaves:,} fragments out", our_rate, "frag/s", "raw grpclib",
            our_rate / raw_rate),
        Row("raw grpclib round trip p50", raw_p50, "us"),
        Row("raw grpclib round trip p99", raw_p99, "us"),
        Row("Trio floor round trip p50 (picker's wire + h2, no session)", us(floor_rtts, 50), "us",
            "raw grpclib p50", us(floor_rtts, 50) / raw_p50),
        Row("session one-chunk ECHO round trip p50", our_p50, "us", "raw grpclib p50", our_p50 / raw_p50),
        Row("session one-chunk ECHO round trip p99", our_p99, "us", "raw grpclib p99", our_p99 / raw_p99),
        Row("raw grpclib whole bidi call on an open channel p50", raw_call_p50, "us"),
        Row("Trio floor whole bidi call p50 (picker's wire + h2, no session)", us(floor_calls, 50), "us",
            "raw grpclib call p50", us(floor_calls, 50) / raw_call_p50),
        Row("whole one-ECHO session, reused connection (Client.session) p50", our_session_p50, "us",
            "raw grpclib call p50", our_session_p50 / raw_call_p50,
            {"mean_us": statistics.mean(our_sessions) * 1e6, "raw_mean_us": statistics.mean(raw_calls) * 1e6}),
        Row("whole one-ECHO session, own connection (connect) p50", us(one_shot, 50), "us",
            "raw grpclib call p50", us(one_shot, 50) / raw_call_p50),
        Row("raw grpclib round trip, CPU per op", raw_rt_cpu, "us"),
        Row("session one-chunk ECHO round trip, CPU per op", our_rt_cpu, "us", "raw grpclib CPU",
            our_rt_cpu / raw_rt_cpu),
        Row("raw grpclib whole bidi call, CPU per op", raw_call_cpu, "us"),
        Row("whole one-ECHO session, reused connection, CPU per op", our_session_cpu, "us", "raw grpclib call CPU",
            our_session_cpu / raw_call_cpu),
        Row("server memory per live node (16-byte leaves)", per_node, "bytes"),
    ]
    print_table("Evergreen sessions vs raw grpclib (loopback, median of runs)", rows)
    path = write_results("session", rows, samples={"raw_rates": raw_rates, "our_rates": [m.rate for m in runs_ours]},
                         targets={"throughput_ratio_min": 0.7, "p50_ratio_max": 1.5, "p99_ratio_max": 3.0,
                                  "session_p50_ratio_max": 2.0})
    print(f"\nwrote {path}")
