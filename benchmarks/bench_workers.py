"""`evergreen-trio serve --workers N` for N = 1, 2, 4, 8, servers and load on disjoint cores.

Each configuration is the command a user types (``serve --port 0 [--workers N]``). The load comes
from grpcio (``grpc.aio``) client processes, cheaper per message than ours, each holding
``CONCURRENCY`` sessions open at a time over ``CHANNELS`` separate connections (SO_REUSEPORT
spreads connections, not streams, across workers):

- sessions/s: each session is one ECHO of a 64-byte leaf, read to its final status;
- fragments/s: each session streams a leaf of ``FRAGMENTS`` 64-byte fragments into ECHO and reads
  them back; the rate counts fragments echoed (one in, one out each).

Cores (``os.sched_getaffinity``): the servers get the first N (``sched_setaffinity`` before exec,
which the workers inherit), and one load process is pinned to each core after the largest N that
fits, the same load for every N. N fits when at least one core is left for the load; N not fitting
but at most the core count runs with servers and load sharing every core (marked ``shared``), and
a larger N is skipped; the table and the JSON say which. Each load process reports the share of a
core it used (``load_cpu``): near 1.0, the load, not the servers, is the bottleneck.

Goal on a 16-core host: N workers >= 0.7 x N times one worker, up to 8. On a 2-core machine only
N = 1 fits (and N = 2 runs shared), so that goal cannot be measured there.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks._harness import Row, print_table, run_plain_asyncio, write_results
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage
from evergreen_trio.serving.server import START_SESSION
from evergreen_trio.testing.model import Frag, Meta, echo, to_messages

CONCURRENCY = 32
CHANNELS = 16
FRAGMENTS = 200
PER_MESSAGE = 50
LEAF = b"x" * 64
WORKERS = (1, 2, 4, 8)
GOAL = 0.7
"""N workers should do at least GOAL x N of one worker's rate."""


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

    began, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker(i) for i in range(CONCURRENCY)))
    elapsed = time.perf_counter() - began
    for channel in channels:
        await channel.close()
    return {**done, "seconds": elapsed, "load_cpu": (time.process_time() - cpu) / elapsed}


def client_main(argv: list[str]) -> None:
    address, seconds, fragments = argv[0], float(argv[1]), int(argv[2])
    print(json.dumps(run_plain_asyncio(_load(address, seconds, fragments))))


def _pinned(cores: Sequence[int] | None) -> Callable[[], None] | None:
    """A ``preexec_fn`` pinning the child (and what it forks) to ``cores``; None leaves it free."""
    if cores is None:
        return None
    chosen = set(cores)
    return lambda: os.sched_setaffinity(0, chosen)


def _serve(workers: int, cores: Sequence[int] | None) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "evergreen_trio.cli", "--log-level", "WARNING", "serve", "--port", "0"]
    if workers > 1:
        command += ["--workers", str(workers)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, preexec_fn=_pinned(cores),
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert process.stdout is not None
    line = process.stdout.readline()
    if "serving on" not in line:
        process.kill()
        raise RuntimeError(f"serve printed {line!r}")
    return process, line.split()[3]


def siblings(core: int) -> str:
    """The logical CPUs sharing ``core``'s physical core, as Linux lists them ("" where it does not say)."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return ""


def _stop(process: subprocess.Popen[str]) -> None:
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@dataclass(frozen=True)
class Layout:
    """Where one configuration runs: the servers' cores and one core per load process (None: any)."""

    workers: int
    server_cores: tuple[int, ...] | None
    load_cores: tuple[int | None, ...]

    @property
    def shared(self) -> bool:
        return self.server_cores is None


def layouts(cores: Sequence[int], counts: Sequence[int] = WORKERS) -> tuple[list[Layout], list[str]]:
    """The configurations that fit on ``cores``, and a note for each N that does not."""
    pinned = [n for n in counts if n < len(cores)]
    load = tuple(cores[max(pinned):]) if pinned else (None,)
    found, notes = [], []
    for n in counts:
        if n in pinned:
            found.append(Layout(n, tuple(cores[:n]), load))
        elif n <= len(cores):
            found.append(Layout(n, None, (None,) * len(load)))
            notes.append(f"{n} workers: servers and load share all {len(cores)} cores (pinned needs {n + 1})")
        else:
            notes.append(f"{n} workers: skipped, needs {n + 1} cores, this host has {len(cores)}")
    return found, notes


def _measure(layout: Layout, seconds: float, fragments: int) -> dict[str, float]:
    process, address = _serve(layout.workers, layout.server_cores)
    command = [sys.executable, "-m", "benchmarks.bench_workers", address, str(seconds), str(fragments)]
    try:
        loads = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                                  preexec_fn=_pinned(None if core is None else [core]))
                 for core in layout.load_cores]
        results = []
        for load in loads:
            out, _ = load.communicate(timeout=seconds + 120)
            if load.returncode:
                raise RuntimeError(f"load process exited {load.returncode}")
            results.append(json.loads(out))
    finally:
        _stop(process)
    total = {key: sum(r[key] for r in results) for key in ("sessions", "fragments", "errors")}
    return {**total, "seconds": max(r["seconds"] for r in results),
            "load_cpu": statistics.median(r["load_cpu"] for r in results)}


def _rows(seconds: float, found: Sequence[Layout]) -> Iterator[Row]:
    for mode, fragments, unit in (("sessions", 1, "sessions/s"), ("fragments", FRAGMENTS, "fragments/s")):
        one = None
        for layout in found:
            result = _measure(layout, seconds, fragments)
            rate = result[mode] / result["seconds"]
            one = rate if layout.workers == 1 else one
            ratio = rate / one if one and layout.workers > 1 else None
            shared = " (shared cores)" if layout.shared else ""
            yield Row(f"{mode}, {layout.workers} worker{'s' if layout.workers > 1 else ''}{shared}", rate, unit,
                      peer="1 worker" if ratio is not None else "", ratio=ratio,
                      extra={**result, "concurrency": CONCURRENCY, "channels": CHANNELS,
                             "fragments_per_session": fragments, "server_cores": layout.server_cores,
                             "load_processes": len(layout.load_cores), "load_cores": layout.load_cores,
                             "per_worker": None if ratio is None else ratio / layout.workers})


def run(quick: bool = False) -> None:
    seconds = 3.0 if quick else 15.0
    cores = sorted(os.sched_getaffinity(0))
    busy = os.getloadavg()[0]  # recorded: other work on the machine depresses every rate
    found, notes = layouts(cores)
    rows = list(_rows(seconds, found))
    print_table(f"serve --workers N ({len(cores)} cores, {seconds:.0f} s each, grpc.aio load processes of "
                f"{CONCURRENCY} sessions over {CHANNELS} connections, one per load core)", rows)
    pinned = [row for row in rows if row.extra["per_worker"] is not None and row.extra["server_cores"]]
    missed = [row.case for row in pinned if row.extra["per_worker"] < GOAL]
    if pinned:
        print(f"\ngoal >= {GOAL} x N of one worker: {'missed by ' + ', '.join(missed) if missed else 'met'}")
    else:
        print(f"\ngoal >= {GOAL} x N of one worker: not measurable here (no N > 1 on cores of its own)")
    for note in notes:
        print(note)
    # SMT: where a core's siblings list more than one CPU, a server and a load process may share a physical core.
    topology = {core: siblings(core) for core in cores}
    smt = any("," in listed or "-" in listed for listed in topology.values())
    host = f"{len(cores)} cores, {'SMT: some share a physical core' if smt else 'one thread per physical core'}"
    print(host)
    path = write_results("workers", rows, quick=quick, cpus=len(cores), seconds=seconds, notes=notes,
                         load_average_before=busy, thread_siblings=topology, host=host)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    client_main(sys.argv[1:])
