"""A first ``fetch_device`` in a new process, with and without CuPy's pool grown beforehand (GPU host).

``python -m benchmarks.ipc_first_fetch``: one server process holding a 4 GiB table in device memory
(64 MiB bodies, as ``python -m benchmarks ipc_gpu``), then client processes in turn, ``fresh`` and
``grown`` three times each. Each client creates its CUDA and UCX contexts (timed apart by
``ipc_gpu``), ``grown`` then takes the fetch's size from CuPy's pool in one allocation and frees it
(the pool keeps the memory), and each opens a kept connection (``connect_device``) and fetches the
table four times. Printed: the pool's growth in ms, the first fetch, the later ones, and first /
steady (the median of the later three). Needs CuPy, ucxx and a CUDA device: without them it says
why and exits 0, as ``python -m benchmarks ipc_gpu`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.bench_ipc_gpu import _SERVER, BODY, gpu_missing
from evergreen_trio.ipc.transports.ucx_bridge import CUDA_TLS, DEFAULT_TLS

TOTAL = 4 << 30

CLIENT = r"""
import statistics, sys, time, cupy
from benchmarks.bench_ipc_gpu import _kept_connection
from evergreen_trio.ipc.gpu import init_cuda
from evergreen_trio.ipc.transports.ucx_bridge import create_context
uri, mode, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
init_cuda()
create_context()
grow_ms = 0.0
if mode == "grown":
    started = time.perf_counter()
    block = cupy.get_default_memory_pool().malloc(total)
    del block
    cupy.cuda.Device().synchronize()
    grow_ms = (time.perf_counter() - started) * 1e3
first, later = _kept_connection(uri, 3)
steady = statistics.median(later)
print(f"{mode}: pool grown in {grow_ms:.1f} ms; first {first:.1f} GB/s, later {', '.join(f'{r:.1f}' for r in later)}; "
      f"first / steady {first / steady:.2f}x", flush=True)
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
    try:
        for mode in ("fresh", "grown") * 3:
            subprocess.run([sys.executable, "-c", CLIENT, uri, mode, str(TOTAL)], env=env, timeout=120, check=True)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
