"""`evergreen-trio serve` with 1 and 2 worker processes, measured in the same run.

Each configuration is the command a user types (``serve --port 0 [--workers 2]``). The load comes
from one grpcio (``grpc.aio``) client process, cheaper per message than ours, holding
``CONCURRENCY`` sessions open at a time over ``CHANNELS`` separate connections (SO_REUSEPORT
spreads connections, not streams, across workers):

- sessions/s: each session is one ECHO of a 64-byte leaf, read to its final status;
- fragments/s: each session streams a leaf of ``FRAGMENTS`` 64-byte fragments into ECHO and reads
  them back; the rate counts fragments echoed (one in, one out each).

The client shares the machine with the servers, so on a 2-core machine the second worker competes
with it for a core: read the ratio as what a second process buys there, not as a scaling law.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from benchmarks._harness import Row, print_table, write_results
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio.serving.server import START_SESSION
from evergreen_trio.testing.model import Frag, Meta, echo, to_messages

CONCURRENCY = 32
CHANNELS = 16
FRAGMENTS = 200
PER_MESSAGE = 50
LEAF = b"x" * 64


def session_messages(fragments: int) -> list[SessionMessage]:
    """ECHO of one leaf cut in ``fragments`` fragments, ``PER_MESSAGE`` fragments a message."""
    items: list[Frag] = [Frag("in", seq, seq < fragments - 1, chunk=(Meta("text/plain") if seq == 0 else None, LEAF))
                         for seq in range(fragments)]
    return to_messages([echo("in", "out"), *items], groups=range(1, fragments + 1, PER_MESSAGE))


async def _load(address: str, seconds: float, fragments: int) -> dict[str, float]:
    import grpc  # type: ignore[import-untyped]

    requests = session_messages(fragments)
    # A local subchannel pool per channel: otherwise grpcio shares one connection among them.
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(CHANNELS)]
    calls = [c.stream_stream(START_SESSION, request_serializer=SessionMessage.SerializeToString,
                             response_deserializer=SessionMessage.FromString) for c in channels]
    done = {"sessions": 0, "fragments": 0, "errors": 0}
    deadline = time.perf_counter() + seconds

    async def worker(index: int) -> None:
        start = calls[index % CHANNELS]
        while time.perf_counter() < deadline:
            try:
                echoed = 0
                async for reply in start(iter(requests), timeout=60):
                    echoed += sum(1 for f in reply.node_fragments if f.chunk_fragment.data)
                done["sessions"] += 1
                done["fragments"] += echoed
            except grpc.RpcError:
                done["errors"] += 1

    began = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    return {**done, "seconds": elapsed}


def client_main(argv: list[str]) -> None:
    address, seconds, fragments = argv[0], float(argv[1]), int(argv[2])
    print(json.dumps(asyncio.run(_load(address, seconds, fragments))))


def _serve(workers: int) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "evergreen_trio.cli", "--log-level", "WARNING", "serve", "--port", "0"]
    if workers > 1:
        command += ["--workers", str(workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    line = process.stdout.readline()
    if "serving on" not in line:
        process.kill()
        raise RuntimeError(f"serve printed {line!r}")
    return process, line.split()[3]


def _stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _measure(workers: int, seconds: float, fragments: int) -> dict[str, float]:
    process, address = _serve(workers)
    try:
        out = subprocess.run([sys.executable, "-m", "benchmarks.bench_workers", address, str(seconds), str(fragments)],
                             check=True, capture_output=True, text=True, timeout=seconds + 120)
        result: dict[str, float] = json.loads(out.stdout)
        return result
    finally:
        _stop(process)


def _rows(seconds: float) -> Iterator[Row]:
    for mode, fragments, unit in (("sessions", 1, "sessions/s"), ("fragments", FRAGMENTS, "fragments/s")):
        rates = {}
        for workers in (1, 2):
            result = _measure(workers, seconds, fragments)
            rate = result[mode] / result["seconds"]
            rates[workers] = rate
            yield Row(f"{mode}, {workers} worker{'s' if workers > 1 else ''}", rate, unit,
                      peer="1 worker" if workers > 1 else "", ratio=rate / rates[1] if workers > 1 else None,
                      extra={**result, "concurrency": CONCURRENCY, "channels": CHANNELS,
                             "fragments_per_session": fragments})


def run(quick: bool = False) -> None:
    seconds = 3.0 if quick else 15.0
    rows = list(_rows(seconds))
    print_table(f"serve --workers: 1 vs 2 processes ({os.cpu_count()} CPUs, {seconds:.0f} s each, "
                f"grpc.aio client, {CONCURRENCY} sessions over {CHANNELS} connections)", rows)
    print(f"\nwrote {write_results('workers', rows, quick=quick, cpus=os.cpu_count(), seconds=seconds)}")


if __name__ == "__main__":
    client_main(sys.argv[1:])
