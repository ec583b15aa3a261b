"""Where a ucx:// fetch spends its time: timestamps per step on both ends (``python -m benchmarks.ipc_trace``).

A server process holds a table (``--memory cupy``: its bodies in device memory; ``numpy`` or ``host``:
in host memory) and the client fetches it ``--runs`` times, ``fetch_device`` for ``cupy``/``numpy``
(``numpy`` is the tests' stand-in for device memory) or plain ``fetch`` for ``host``. Both ends
record, on the machine's monotonic clock, each UCX request posted and completed (found complete
after a worker progress), each worker progress and epoll wakeup, each body allocation, and the
connection's handshake; the summary per fetch says where the wall time went. ``--profile`` also
runs one more fetch under cProfile on each end and prints their top functions. ``--out DIR`` keeps
the raw events (JSON) and the profiles. Diagnosis only: the timings come with tracing overhead.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

MiB = 1 << 20
EVENTS: list[tuple[float, str, int]] = []
"""(monotonic seconds, kind, bytes or microseconds) for this process."""


def install() -> None:
    """Trace this process's UCX bridges: a worker proxy stamps progress and request completions."""
    from evergreen_trio.ipc.transports import ucx, ucx_bridge

    class TimedWorker:
        def __init__(self, worker: Any, bridge: Any) -> None:
            self.real, self.bridge, self.stamped = worker, bridge, set[int]()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.real, name)

        def progress(self) -> Any:
            started = time.perf_counter()
            result = self.real.progress()
            now = time.perf_counter()
            EVENTS.append((now, "progress", round((now - started) * 1e6)))
            for request in list(self.bridge._inflight):
                if id(request) not in self.stamped and request.request.completed:
                    self.stamped.add(id(request))
                    EVENTS.append((now, "done", _nbytes(request.buffer)))
            return result

    class TracedBridge(ucx_bridge.WorkerBridge):
        def __init__(self, context: Any) -> None:
            super().__init__(context)
            self.worker = TimedWorker(self.worker, self)

        def send(self, endpoint: Any, tag: int, payload: object) -> Any:
            EVENTS.append((time.perf_counter(), "send", _nbytes(payload)))
            return super().send(endpoint, tag, payload)

        def post_receive(self, probe: Any, target: object) -> Any:
            EVENTS.append((time.perf_counter(), "receive", _nbytes(target)))
            return super().post_receive(probe, target)

    original_listener = ucx_bridge.create_listener
    original_connect = ucx_bridge.connect_address

    def create_listener(bridge: Any, port: int, on_connect: Callable[[int], None]) -> Any:
        worker = bridge.worker
        bridge.worker = worker.real
        try:
            return original_listener(bridge, port, on_connect)
        finally:
            bridge.worker = worker

    def connect_address(bridge: Any, address: bytes) -> Any:
        endpoint = original_connect(bridge, address)
        EVENTS.append((time.perf_counter(), "connected", 0))
        return endpoint

    ucx_bridge.WorkerBridge = TracedBridge  # type: ignore[misc]
    setattr(ucx, "create_listener", create_listener)  # the names ucx.py imported  # noqa: B010
    setattr(ucx, "connect_address", connect_address)  # noqa: B010


def _nbytes(buffer: object) -> int:
    nbytes = getattr(buffer, "nbytes", None)
    return int(nbytes) if nbytes is not None else len(buffer)  # type: ignore[arg-type]


_SERVER = """
import os, sys, json, signal, cProfile, numpy as np, pyarrow as pa, trio
from benchmarks import ipc_trace
ipc_trace.install()
from evergreen_trio.ipc import Catalog, serve
total, body, memory, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
columns = 4
rows = total // (8 * columns)
table = pa.table({f"c{i}": np.random.default_rng(i).random(rows) for i in range(columns)})
catalog = Catalog()
chunk = body // (8 * columns)
if memory == "cupy":
    from evergreen_trio.ipc.gpu import device_catalog_entry
    catalog.add_messages("t", device_catalog_entry(table, max_chunksize=chunk))
else:
    catalog.add_table("t", table, max_chunksize=chunk)
profile = cProfile.Profile() if os.environ.get("IPC_TRACE_PROFILE") else None
async def main():
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            uri = await nursery.start(serve, "ucx://127.0.0.1:0", catalog)
            print(uri, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
if profile is not None:
    profile.enable()
trio.run(main)
if profile is not None:
    profile.disable()
    profile.dump_stats(out + ".prof")
with open(out, "w") as f:
    json.dump(ipc_trace.EVENTS, f)
"""


def start_server(
    total: int, body: int, memory: str, out: str, env: dict[str, str]
) -> tuple[subprocess.Popen[str], str]:
    """The server process and the URI it printed."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(total), str(body), memory, out], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while not (line := proc.stdout.readline()).startswith("ucx://"):  # UCX may log to stdout too
        if not line:
            raise RuntimeError("the server exited before printing its URI")
    return proc, line.strip()


def _fetches(uri: str, memory: str, runs: int, kept: bool) -> None:
    """``runs`` fetches, each marked at its start and end: over one kept connection, or one each."""
    from evergreen_trio.ipc import connect
    from evergreen_trio.ipc.gpu import DeviceMemory, connect_device, cupy_memory

    def device_memory() -> DeviceMemory:
        import numpy as np

        base = cupy_memory() if memory == "cupy" else DeviceMemory(
            lambda n: np.empty(n, np.uint8), np.asarray, np.asarray, lambda: None)

        def allocate(nbytes: int) -> Any:
            started = time.perf_counter()
            array = base.allocate(nbytes)
            EVENTS.append((time.perf_counter(), "allocate", round((time.perf_counter() - started) * 1e6)))
            return array

        return DeviceMemory(allocate, base.from_host, base.to_host, base.synchronize)

    async def one(client: Any) -> None:
        if memory == "host":
            table = await client.fetch_table("t")
            total = table.nbytes
        else:
            batches, _ = await client.fetch("t")
            total = sum(int(batch.body.nbytes) for batch in batches)
        EVENTS.append((time.perf_counter(), "end", total))

    async def main() -> None:
        def client() -> Any:
            return connect(uri) if memory == "host" else connect_device(uri, memory=device_memory())

        if kept:
            async with client() as kept_client:
                for _ in range(runs):
                    EVENTS.append((time.perf_counter(), "start", 0))
                    await one(kept_client)
        else:
            for _ in range(runs):
                EVENTS.append((time.perf_counter(), "start", 0))  # the connection's set-up counts
                async with client() as new_client:
                    await one(new_client)

    trio.run(main)


Event = tuple[float, str, int]


def _spans(events: list[Event], marks: list[tuple[float, float]]) -> list[list[Event]]:
    return [[e for e in events if start <= e[0] <= end] for start, end in marks]


def summarize(client: list[Event], server: list[Event], body: int) -> list[dict[str, Any]]:
    """Per fetch: wall, handshake, first body, body spacing, time in progress, allocations, server sends."""
    starts = [t for t, kind, _ in client if kind == "start"]
    ends = [t for t, kind, _ in client if kind == "end"]
    out = []
    marks = list(zip(starts, ends, strict=True))
    for (start, end), mine, theirs in zip(marks, _spans(client, marks), _spans(server, marks), strict=True):
        def times(events: list[Event], kind: str, big: bool = True) -> list[float]:
            return [t for t, k, n in events if k == kind and (n >= body // 2) == big]

        posted, done = times(mine, "receive"), times(mine, "done")
        sent, acked = times(theirs, "send"), times(theirs, "done")
        connected = [t for t, k, _ in mine if k == "connected"]
        progress = [n for _, k, n in mine if k == "progress"]
        allocate = [n for _, k, n in mine if k == "allocate"]
        gaps = [b - a for a, b in itertools.pairwise(done)]
        nbytes = next(n for _, k, n in mine if k == "end")
        us = 1e6
        out.append({
            "wall_ms": (end - start) * 1e3,
            "GB/s": nbytes / (end - start) / 1e9,
            "bodies": len(posted),
            "handshake_ms": (connected[0] - start) * 1e3 if connected else None,
            "first_body_sent_ms": (sent[0] - start) * 1e3 if sent else None,
            "first_body_posted_ms": (posted[0] - start) * 1e3 if posted else None,
            "last_body_done_ms": (done[-1] - start) * 1e3 if done else None,
            "body_post_to_done_us_median": statistics.median(
                [d - p for p, d in zip(posted, done, strict=False)]) * us if done else None,
            "body_done_gap_us_median": statistics.median(gaps) * us if gaps else None,
            "body_done_gap_us_max": max(gaps) * us if gaps else None,
            "server_send_to_done_us_median": statistics.median(
                [a - s for s, a in zip(sent, acked, strict=False)]) * us if acked else None,
            "client_progress_calls": len(progress),
            "client_progress_ms": sum(progress) / 1e3,
            "client_allocate_ms": sum(allocate) / 1e3,
            "client_allocate_us_max": max(allocate, default=0),
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ipc_trace", description=__doc__.splitlines()[0])
    parser.add_argument("--memory", choices=("cupy", "numpy", "host"), default="cupy")
    parser.add_argument("--total-mib", type=int, default=4096)
    parser.add_argument("--body-mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=4, help="fetches, the first included")
    parser.add_argument("--kept", action="store_true", help="every fetch over one kept connection (connect)")
    parser.add_argument("--profile", action="store_true", help="one more fetch under cProfile on each end")
    parser.add_argument("--out", type=Path, help="keep raw events and profiles here")
    args = parser.parse_args()
    install()
    out = args.out or Path(tempfile.mkdtemp(prefix="ipc_trace-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    if args.profile:
        env["IPC_TRACE_PROFILE"] = "1"
    body = args.body_mib * MiB
    server_out = str(out / f"server-{args.memory}.json")
    proc, uri = start_server(args.total_mib * MiB, body, args.memory, server_out, env)
    try:
        _fetches(uri, args.memory, args.runs, args.kept)
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            _fetches(uri, args.memory, 1, False)
            profile.disable()
            profile.dump_stats(out / f"client-{args.memory}.prof")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    server = [tuple(e) for e in json.loads(Path(server_out).read_text())]
    rows = summarize(EVENTS, server, body)
    (out / f"client-{args.memory}.json").write_text(json.dumps(EVENTS))
    (out / f"summary-{args.memory}.json").write_text(json.dumps(rows, indent=1))
    print(f"\n## ipc_trace: {args.total_mib} MiB in {args.body_mib} MiB bodies, memory={args.memory}, "
          f"{'kept connection' if args.kept else 'a connection per fetch'}"
          f", UCX_TLS={os.environ.get('UCX_TLS', '(default)')}\n")
    keys = list(rows[0])
    print("| " + " | ".join(["fetch", *keys]) + " |")
    print("|" + "---|" * (len(keys) + 1))
    for i, row in enumerate(rows):
        cells = ["" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v) for v in row.values()]
        print("| " + " | ".join([str(i), *cells]) + " |")
    if args.profile:
        for side in ("client", "server"):
            path = out / f"{side}-{args.memory}.prof"
            if path.exists():
                what = "one profiled fetch" if side == "client" else "the whole server"
                print(f"\n### {side}: top functions by own time ({what})\n")
                pstats.Stats(str(path)).sort_stats("tottime").print_stats(18)
    print(f"raw events and profiles: {out}")


if __name__ == "__main__":
    main()
