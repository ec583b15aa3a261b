"""GPU bodies over UCX against ucxx's own benchmark, in the same run (needs CuPy and a CUDA device).

Cases, 4 GiB of device data in 64 MiB bodies (``--quick``: 512 MiB) on one GPU, server in its own
process: ``fetch_device`` over a kept connection (``connect_device``: the first fetch, which opens the
connection, and the steady state, median of three after it), ``fetch_device(uri)`` with a new
connection per call, the same without device support (fetch to host, then ``cupy.asarray`` per
batch), and the peer: ``python -m ucxx.benchmarks.send_recv -o cupy -n 67108864 -l ucxx-core
--reuse-alloc`` with the same ``UCX_TLS`` and endpoint error handling on (its default), whose median
bandwidth is the ratio's denominator. The process's one-time set-up (its CUDA context, its UCX
context) is timed apart, before the first fetch. Every process runs with ``UCX_PROTO_INFO=y``; the
protocol lines UCX prints (what it selected for the bodies, e.g. ``cuda_ipc``) are printed with the
table and kept in the JSON. Without CuPy or a device it prints why and writes nothing, keeping the
last GPU results.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import trio

from benchmarks._harness import Row, print_table, write_results
from evergreen_trio.ipc import fetch
from evergreen_trio.ipc.transports.ucx_bridge import CUDA_TLS, DEFAULT_TLS

MiB = 1 << 20
BODY = 64 * MiB
RUNS = 3

_SERVER = """
import sys, trio, numpy as np, pyarrow as pa
from evergreen_trio.ipc import Catalog, serve
from evergreen_trio.ipc.gpu import device_catalog_entry
total, body, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "device"
columns = 4
rows = total // (8 * columns)
table = pa.table({f"c{i}": np.random.default_rng(i).random(rows) for i in range(columns)})
catalog = Catalog()
chunk = body // (8 * columns)
if device:
    catalog.add_messages("t", device_catalog_entry(table, max_chunksize=chunk))
else:
    catalog.add_table("t", table, max_chunksize=chunk)
async def main():
    async with trio.open_nursery() as nursery:
        uri = await nursery.start(serve, "ucx://127.0.0.1:0", catalog)
        print(uri, flush=True)
trio.run(main)
"""


def gpu_missing() -> str | None:
    """Why this area cannot run here, or None when CuPy sees a CUDA device."""
    try:
        import cupy  # optional: the gpu extra
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); install the gpu extra on a GPU host: pip install -e '.[gpu]'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA reports a missing driver in several ways
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return None if count else "no CUDA device (cupy sees 0)"


def _proto_lines(text: str) -> list[str]:
    """The protocol-selection lines UCX_PROTO_INFO=y printed (deduplicated, in order)."""
    keep = [line.strip() for line in text.splitlines() if "|" in line and ("rndv" in line or "rendezvous" in line
                                                                          or "cuda" in line or "copy" in line)]
    return list(dict.fromkeys(keep))


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def ucxx_send_recv(env: dict[str, str], iterations: int) -> tuple[float, list[str]]:
    """ucxx's own benchmark on this GPU: median bandwidth in GB/s and what UCX selected."""
    cmd = [sys.executable, "-m", "ucxx.benchmarks.send_recv", "-o", "cupy", "-n", str(BODY), "-l", "ucxx-core",
           "--reuse-alloc", "--n-iter", str(iterations), "--no-detailed-report"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=True)
    match = re.search(r"Bandwidth \(median\)\s*\|\s*([\d.]+)\s*([KMGT]?i?B)/s", result.stdout)
    if match is None:
        raise RuntimeError(f"ucxx send_recv printed no median bandwidth:\n{result.stdout[-2000:]}")
    return float(match.group(1)) * _UNITS[match.group(2)] / 1e9, _proto_lines(result.stdout + result.stderr)


def _fetch_device(uri: str) -> int:
    from evergreen_trio.ipc.gpu import fetch_device  # imports CuPy

    async def main() -> int:
        batches, _ = await fetch_device(uri, "t")
        return sum(int(batch.body.nbytes) for batch in batches)

    return trio.run(main)


def _kept_connection(uri: str, runs: int, memory: Any = None) -> tuple[float, list[float]]:
    """GB/s of each fetch over one kept connection: the first (which opens it), then the later ones."""
    from evergreen_trio.ipc.gpu import connect_device  # imports CuPy

    async def main() -> list[float]:
        rates = []
        async with connect_device(uri, memory=memory) as client:
            for _ in range(runs + 1):
                started = time.perf_counter()
                batches, _ = await client.fetch("t")
                rates.append(sum(int(b.body.nbytes) for b in batches) / (time.perf_counter() - started) / 1e9)
                del batches
        return rates

    rates = trio.run(main)
    return rates[0], rates[1:]


def _set_up_ms() -> dict[str, float]:
    """The process's one-time costs, paid before its first fetch: CUDA context, UCX context."""
    from evergreen_trio.ipc.gpu import init_cuda
    from evergreen_trio.ipc.transports.ucx_bridge import create_context

    started = time.perf_counter()
    init_cuda()
    cuda = time.perf_counter()
    create_context()
    return {"CUDA context": (cuda - started) * 1e3, "UCX context": (time.perf_counter() - cuda) * 1e3}


def _fetch_host_then_device(uri: str) -> int:
    import cupy  # optional: the gpu extra

    async def main() -> int:
        total = 0
        async with fetch(uri, "t") as stream:
            async for batch in stream:
                for column in batch.columns:
                    total += int(cupy.asarray(column.to_numpy(zero_copy_only=False)).nbytes)
                del batch
        cupy.cuda.get_current_stream().synchronize()
        return total

    return trio.run(main)


def _timed(fn: Any, uri: str, runs: int) -> tuple[float, list[float], int]:
    """GB/s of the first call and of each later one."""
    rates, got = [], 0
    for _ in range(runs + 1):
        started = time.perf_counter()
        got = fn(uri)
        rates.append(got / (time.perf_counter() - started) / 1e9)
    return rates[0], rates[1:], got


def run(quick: bool = False) -> None:
    missing = gpu_missing()
    if missing is not None:
        print(f"\n## ipc_gpu\n\nskipped: {missing}. Nothing written; see docs/ipc.md (GPU rows) for what is "
              "measured where and why.")
        return
    total = (512 if quick else 4096) * MiB
    runs = 1 if quick else RUNS
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_TLS": os.environ.get("UCX_TLS", f"{DEFAULT_TLS},{CUDA_TLS}")}
    os.environ.update(UCX_PROTO_INFO="y", UCX_TLS=env["UCX_TLS"])
    peer, peer_proto = ucxx_send_recv(env, 20 if quick else 100)
    set_up = _set_up_ms()
    results: dict[str, tuple[float, list[float]]] = {}
    protocols: dict[str, list[str]] = {}
    cases: list[tuple[str, str, Any]] = [
        ("fetch_device, kept connection", "device", lambda uri: _kept_connection(uri, runs)),
        ("fetch_device, a new connection per call", "device", lambda uri: _timed(_fetch_device, uri, runs)[:2]),
        ("fetch to host, then cupy.asarray", "host", lambda uri: _timed(_fetch_host_then_device, uri, runs)[:2]),
    ]
    for name, device, measure in cases:
        proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(total), str(BODY), device], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        printed = []
        try:
            assert proc.stdout is not None
            while not (line := proc.stdout.readline()).startswith("ucx://"):  # UCX logs to stdout too
                if not line:
                    raise RuntimeError(f"the {device} server exited before printing its URI")
                printed.append(line)
            results[name] = measure(line.strip())
        finally:
            proc.terminate()
            out, err = proc.communicate(timeout=60)
        protocols[name] = _proto_lines("".join(printed) + out + err)
    rows = []
    steady = {name: statistics.median(later) for name, (_, later) in results.items()}
    for name, (first, later) in results.items():
        rows.append(Row(f"{name}, steady state", steady[name], "GB/s", "ucxx send_recv", steady[name] / peer,
                        {"samples": later}))
        rows.append(Row(f"{name}, first fetch", first, "GB/s", "its steady state", first / steady[name]))
    rows.append(Row("ucxx send_recv -o cupy -l ucxx-core --reuse-alloc (median)", peer, "GB/s"))
    rows.extend(Row(f"process set-up before the first fetch: {what}", ms, "ms") for what, ms in set_up.items())
    print_table(f"ipc_gpu: {total / MiB:.0f} MiB in {BODY // MiB} MiB bodies, one GPU, UCX_TLS={env['UCX_TLS']}",
                rows)
    for name, lines in (("ucxx send_recv", peer_proto), *protocols.items()):
        print(f"\nUCX_PROTO_INFO ({name}):")
        print("\n".join(f"  {line}" for line in lines) or "  (nothing printed)")
    import cupy  # optional: the gpu extra

    host = f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {os.cpu_count()} cores"
    write_results("ipc_gpu", rows, host=host, ucx_tls=env["UCX_TLS"],
                  protocols={"ucxx send_recv": peer_proto, **protocols}, quick=quick)
