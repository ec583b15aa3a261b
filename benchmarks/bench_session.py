"""Evergreen sessions against a raw grpclib bidi echo on plain asyncio, measured in the same run.

(a) raw grpclib: N one-fragment messages echoed on one stream (messages/s) and one-message round trips;
(b) ours: a client streams a 10,000-leaf input into a server action that consumes it and streams a
10,000-fragment output (fragments/s, both directions counted), and one-chunk ECHO round trips within
one session; plus the server-side memory per live node for 100,000 small nodes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import tracemalloc

import trio

from benchmarks._harness import Row, median_of, percentile, print_table, write_results
from evergreen_trio import ActionContext, Server, connect, inner, text
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import Chunk, ChunkMetadata, NodeFragment
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag import SessionGraph

LEAF_BYTES = 64


def raw_grpclib(count: int, round_trips: int) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.grpclib_echo", str(count), str(LEAF_BYTES), str(round_trips)],
        check=True, capture_output=True, text=True,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


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


async def ours(leaves: int, round_trips: int) -> tuple[float, list[float]]:
    server = new_server()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with connect(f"127.0.0.1:{port}") as session:
            payload = "x" * LEAF_BYTES
            tree = inner(*[text(payload) for _ in range(leaves)])
            start = time.perf_counter()
            call = await session.run("SINK_AND_STREAM", {"input": tree}, ["output"])
            received = len(await call["output"].read_bytes()) // LEAF_BYTES
            elapsed = time.perf_counter() - start
            assert received == leaves
            latencies = []
            for _ in range(round_trips):
                t = time.perf_counter()
                echo = await session.run("ECHO", {"input": text(payload)}, ["output"])
                await echo["output"].read_bytes()
                latencies.append(time.perf_counter() - t)
        nursery.cancel_scope.cancel()
    return 2 * leaves / elapsed, latencies


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
    leaves, round_trips, runs = (2_000, 100, 1) if quick else (10_000, 500, 3)
    raw_rates, raw_rtts, our_rates, our_rtts = [], [], [], []

    def one_raw() -> float:
        result = raw_grpclib(2 * leaves, round_trips)
        raw_rtts.extend(result["round_trips_s"])  # type: ignore[arg-type]
        rate = float(result["messages_per_s"])  # type: ignore[arg-type]
        raw_rates.append(rate)
        return rate

    def one_ours() -> float:
        rate, latencies = trio.run(ours, leaves, round_trips)
        our_rtts.extend(latencies)
        our_rates.append(rate)
        return rate

    raw_rate, _ = median_of(runs, one_raw)
    our_rate, _ = median_of(runs, one_ours)
    raw_p50, raw_p99 = percentile(raw_rtts, 50) * 1e6, percentile(raw_rtts, 99) * 1e6
    our_p50, our_p99 = percentile(our_rtts, 50) * 1e6, percentile(our_rtts, 99) * 1e6
    per_node = memory_per_node(10_000 if quick else 100_000)
    rows = [
        Row("raw grpclib echo (asyncio), messages", raw_rate, "msg/s"),
        Row(f"session: {leaves:,} leaves in + {leaves:,} fragments out", our_rate, "frag/s", "raw grpclib",
            our_rate / raw_rate),
        Row("raw grpclib round trip p50", raw_p50, "us"),
        Row("raw grpclib round trip p99", raw_p99, "us"),
        Row("session one-chunk ECHO round trip p50", our_p50, "us", "raw grpclib p50", our_p50 / raw_p50),
        Row("session one-chunk ECHO round trip p99", our_p99, "us", "raw grpclib p99", our_p99 / raw_p99),
        Row("server memory per live node (16-byte leaves)", per_node, "bytes"),
    ]
    print_table("Evergreen sessions vs raw grpclib (loopback, median of runs)", rows)
    path = write_results("session", rows, samples={"raw_rates": raw_rates, "our_rates": our_rates},
                         targets={"throughput_ratio_min": 0.7, "p50_ratio_max": 2.0})
    print(f"\nwrote {path}")
