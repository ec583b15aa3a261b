"""Arrow Dissociated IPC throughput: a 256 MiB table (4 float64 columns, ~8 MiB batches).

Each transport's server runs in its own process (``evergreen-trio ipc serve`` on a
memory-mapped Arrow file, or the pyarrow peer) and the client in this one; GB/s is the
median of seven timed fetches after one warm-up round; the rounds alternate the cases.
The warm-up round is each new server's first fetch, reported against its steady state;
shm is also served from an in-memory table (``Catalog.add_table``) to compare with the file,
and from the file with publishing off (``ServeOptions(publish=False)``: every fetch copies
each body into the connection's segment, the design before bodies were published).
Receive buffers are pooled across fetches; every client validates each batch. Peers
measured in the same run: plain Arrow IPC stream over a loopback TCP socket,
``pyarrow.flight`` DoGet on localhost, and one memcpy into touched memory (per round the
best of three copies).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.flight as flight
import trio

from benchmarks._harness import Row, print_table, write_results
from evergreen_trio.ipc import BufferPool, connect, fetch
from evergreen_trio.ipc.transports.ucx_bridge import DEFAULT_TLS

RUNS = 7
MiB = 1 << 20

_PLAIN_SERVER = """
import socket, sys, pyarrow as pa
table = pa.ipc.open_file(pa.memory_map(sys.argv[1])).read_all()
srv = socket.create_server(("127.0.0.1", 0))
print(srv.getsockname()[1], flush=True)
while True:
    conn, _ = srv.accept()
    with conn, conn.makefile("wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
"""

_SHM_SERVER = """
import sys, trio, pyarrow as pa
from evergreen_trio.ipc import Catalog, ServeOptions, serve
path, source, publish = sys.argv[1], sys.argv[2], sys.argv[3] == "publish"
catalog = Catalog()
if source == "table":
    with pa.OSFile(path) as f:
        catalog.add_table("table.arrow", pa.ipc.open_file(f).read_all())
else:
    catalog.add_file(path)
async def main():
    async with trio.open_nursery() as nursery:
        print(await nursery.start(serve, "shm://", catalog, ServeOptions(publish=publish)), flush=True)
trio.run(main)
"""

_FLIGHT_SERVER = """
import sys, pyarrow as pa, pyarrow.flight as fl
table = pa.ipc.open_file(pa.memory_map(sys.argv[1])).read_all()
class S(fl.FlightServerBase):
    def do_get(self, context, ticket):
        return fl.RecordBatchStream(table)
s = S("grpc://127.0.0.1:0")
print(s.port, flush=True)
s.serve()
"""


def make_file(path: Path, total: int) -> int:
    rows = total // 32
    rng = np.random.default_rng(0)
    table = pa.table({f"c{i}": rng.random(rows) for i in range(4)})
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=8 * MiB // 32)
    # Write the file back now, not during the timed rounds (every case serves it).
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return int(table.nbytes)


@contextlib.contextmanager
def server(cmd: list[str]) -> Iterator[str]:
    """Run a server process for the block; yield the first line it prints (URI or port)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.terminate()
        proc.wait()


def gbps(nbytes: int, fn: Callable[[], int]) -> Callable[[], float]:
    def measure() -> float:
        started = time.perf_counter()
        got = fn()
        elapsed = time.perf_counter() - started
        assert got == nbytes, (got, nbytes)
        return nbytes / elapsed / 1e9

    return measure


def ours(uri: str, pool: BufferPool) -> int:
    async def main() -> int:
        total = 0
        async with fetch(uri, "table.arrow", pool=pool) as stream:
            async for batch in stream:
                total += validated(batch)
                del batch
        return total

    return trio.run(main)


def ours_kept(uri: str, pool: BufferPool, nbytes: int) -> float:
    """GB/s of a fetch over a kept connection (``ipc.connect``): one fetch opens it, the next is timed."""

    async def main() -> float:
        async with connect(uri, pool=pool) as client:
            for _ in range(2):  # the second fetch is the one timed
                started = time.perf_counter()
                total = 0
                async with client.fetch("table.arrow") as stream:
                    async for batch in stream:
                        total += validated(batch)
                        del batch
                assert total == nbytes, (total, nbytes)
        return nbytes / (time.perf_counter() - started) / 1e9

    return trio.run(main)


def validated(batch: pa.RecordBatch) -> int:
    """Every client checks each batch's structure (pyarrow's cheap validation) and counts its bytes."""
    batch.validate()
    return int(batch.nbytes)


def plain(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rb") as f:
        return sum(validated(batch) for batch in pa.ipc.open_stream(f))


def flight_get(port: int) -> int:
    with flight.connect(f"grpc://127.0.0.1:{port}") as client:
        return sum(validated(chunk.data) for chunk in client.do_get(flight.Ticket(b"t")))


def run(quick: bool = False) -> None:
    total = (32 if quick else 256) * MiB
    runs = 1 if quick else RUNS
    os.environ.setdefault("UCX_TLS", DEFAULT_TLS)
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        path = Path(tmp) / "table.arrow"
        nbytes = make_file(path, total)
        pool = BufferPool(2 * total)
        cli = [sys.executable, "-m", "evergreen_trio.cli", "--log-level", "WARNING", "ipc", "serve", str(path)]
        cases: dict[str, Callable[[], float]] = {}
        for name, uri in (("ucx", "ucx://127.0.0.1:0"), ("tcp", "tcp://127.0.0.1:0"), ("shm", "shm://")):
            served = stack.enter_context(server([*cli, "--uri", uri]))
            cases[name] = gbps(nbytes, lambda served=served: ours(served, pool))  # type: ignore[misc]
            if name == "ucx":
                cases["ucx_kept"] = lambda served=served: ours_kept(served, pool, nbytes)  # type: ignore[misc]
        for name, source, publish in (("shm_memory", "table", "publish"), ("shm_copied", "file", "copy")):
            served = stack.enter_context(server([sys.executable, "-c", _SHM_SERVER, str(path), source, publish]))
            cases[name] = gbps(nbytes, lambda served=served: ours(served, pool))  # type: ignore[misc]
        for name, script, client in (("plain", _PLAIN_SERVER, plain), ("flight", _FLIGHT_SERVER, flight_get)):
            port = int(stack.enter_context(server([sys.executable, "-c", script, str(path)])))
            cases[name] = gbps(nbytes, lambda client=client, port=port: client(port))  # type: ignore[misc]
        src = np.ones(nbytes // 8)
        dst = np.zeros_like(src)

        def memcpy() -> int:
            np.copyto(dst, src)
            return nbytes

        one_copy = gbps(nbytes, memcpy)
        # The physical limit: a copy that other jobs preempted would flatter every ratio
        # against it, so each round takes the best of three copies.
        cases["memcpy"] = lambda: max(one_copy() for _ in range(3))
        # Rounds alternate the cases, so load from other jobs on this shared machine
        # falls on all of them alike; the first round only warms up (pools, page cache).
        samples: dict[str, list[float]] = {name: [] for name in cases}
        first: dict[str, float] = {}
        for round_ in range(runs + 1):
            for name, measure in cases.items():
                value = measure()
                if round_:
                    samples[name].append(value)
                else:
                    first[name] = value
    results = {name: (statistics.median(values), values) for name, values in samples.items()}

    flight_v, plain_v, memcpy_v = results["flight"][0], results["plain"][0], results["memcpy"][0]
    shm_v, memory_v, copied_v = results["shm"][0], results["shm_memory"][0], results["shm_copied"][0]
    cases_rows = [
        ("ucx", Row("(a) ucx (ours)", results["ucx"][0], "GB/s", "flight", results["ucx"][0] / flight_v)),
        ("ucx", Row("(a) ucx vs plain IPC/TCP", results["ucx"][0], "GB/s", "plain ipc", results["ucx"][0] / plain_v)),
        ("ucx_kept", Row("(a) ucx, kept connection (ipc.connect) vs plain IPC/TCP", results["ucx_kept"][0], "GB/s",
                         "plain ipc", results["ucx_kept"][0] / plain_v)),
        ("tcp", Row("(b) tcp (ours)", results["tcp"][0], "GB/s", "plain ipc", results["tcp"][0] / plain_v)),
        ("plain", Row("(c) plain Arrow IPC stream, loopback TCP", plain_v, "GB/s")),
        ("flight", Row("(d) pyarrow.flight do_get", flight_v, "GB/s")),
        ("shm", Row("(e) shm (ours, bodies published once)", shm_v, "GB/s", "memcpy", shm_v / memcpy_v)),
        ("shm_memory", Row("(e) shm, in-memory table (Catalog.add_table)", memory_v, "GB/s", "memcpy",
                           memory_v / memcpy_v)),
        ("shm", Row("(e) shm, ipc serve FILE vs in-memory table", shm_v, "GB/s", "in-memory table",
                    shm_v / memory_v)),
        ("shm_copied", Row("(e) shm, publishing off (a copy per fetch, publish=False)",
                           copied_v, "GB/s", "memcpy", copied_v / memcpy_v)),
        ("memcpy", Row("(f) memcpy into touched memory", memcpy_v, "GB/s")),
    ]
    rows = []
    for key, row in cases_rows:
        row.extra["samples"] = results[key][1]
        rows.append(row)
    for key, label in (("ucx", "(a) ucx"), ("tcp", "(b) tcp"), ("shm", "(e) shm"),
                       ("shm_memory", "(e) shm in-memory table")):
        steady = results[key][0]
        rows.append(Row(f"{label}, a new server's first fetch", first[key], "GB/s", "its steady state",
                        first[key] / steady))
    print_table(f"ipc: {nbytes / MiB:.0f} MiB, 4 float64 columns, ~8 MiB batches, median of {runs}", rows)
    write_results("ipc", rows, table_bytes=nbytes, batch_bytes=8 * MiB, runs=runs, ucx_tls=os.environ["UCX_TLS"])
