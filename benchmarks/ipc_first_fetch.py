"""A first ``fetch_device`` in a new process: the pool as the library grows it, not grown, grown by hand (GPU host).

``python -m benchmarks.ipc_first_fetch``: one server process holding a 4 GiB table in device memory
(64 MiB bodies, as ``python -m benchmarks ipc_gpu``), then client processes in turn, each mode three
times: ``default`` (``cupy_memory()``, which grows CuPy's pool ahead of the bodies in doubling steps),
``off`` (``cupy_memory(growth_cap=0)``: each body its own allocation, the library before it grew the
pool) and ``grown`` (growth off, but the fetch's size taken from the pool in one allocation and freed
beforehand, as a consumer that knows its working set can). Each client creates its CUDA and UCX
contexts (timed apart by ``ipc_gpu``), opens a kept connection (``connect_device``) and fetches the
table four times. Printed per process: the pool's growth by hand in ms, the first fetch, the later
ones, first / steady (the median of the later three), and the pool's size at the end;
then the median first / steady of each mode. Needs CuPy, ucxx and a CUDA device: without them it
says why and exits 0, as ``python -m benchmarks ipc_gpu`` does.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

from benchmarks.bench_ipc_gpu import _SERVER, BODY, gpu_missing
from evergreen_trio.ipc.transports.ucx_bridge import CUDA_TLS, DEFAULT_TLS

TOTAL = 4 << 30

CLIENT = r"""
import statistics, sys, time, cupy
from benchmarks.bench_ipc_gpu import _kept_connection
from evergreen_trio.ipc.gpu import cupy_memory
from evergreen_trio.ipc.transports.ucx_bridge import create_context
uri, mode, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
memory = cupy_memory(growth_cap=0) if mode != "default" else cupy_memory()
create_context()
grow_ms = 0.0
if mode == "grown":
    started = time.perf_counter()
    block = cupy.get_default_memory_pool().malloc(total)
    del block
    cupy.cuda.Device().synchronize()
    grow_ms = (time.perf_counter() - started) * 1e3
first, later = _kept_connection(uri, 3, memory)
steady = statistics.median(later)
print(f"{mode}: pool grown by hand in {grow_ms:.1f} ms; first {first:.1f} GB/s, later "
      f"{', '.join(f'{r:.1f}' for r in later)}; first / steady {first / steady:.2f}x; "
      f"pool {cupy.get_default_memory_pool().total_bytes() >> 20} MiB", flush=True)
print(f"RATIO {mode} {first / steady}", flush=True)
"""


def main() -> None:
    missing = gpu_missing()
    if missing is not None:
        print(f"ipc_first_fetch: skipped: {missing}")
        return
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", f"{DEFAULT_TLS},{CUDA_TLS}")}
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(TOTAL), str(BODY), "device"], env=env,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    uri = server.stdout.readline().strip()
    print(f"{TOTAL >> 20} MiB in {BODY >> 20} MiB bodies, UCX_TLS={env['UCX_TLS']}", flush=True)
    ratios: dict[str, list[float]] = {}
    try:
        for mode in ("default", "off", "grown") * 3:
            out = subprocess.run([sys.executable, "-c", CLIENT, uri, mode, str(TOTAL)], env=env, timeout=120,
                                 check=True, stdout=subprocess.PIPE, text=True).stdout
            for line in out.splitlines():
                if line.startswith("RATIO "):
                    ratios.setdefault(mode, []).append(float(line.split()[2]))
                else:
                    print(line, flush=True)
        for mode, values in ratios.items():
            print(f"{mode}: first / steady, median of {len(values)}: {statistics.median(values):.2f}x "
                  f"({', '.join(f'{v:.2f}' for v in values)})", flush=True)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
