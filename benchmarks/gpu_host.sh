#!/usr/bin/env bash
# Every GPU and many-core check in one run, for a lent GPU host whose python3 has CuPy, pyarrow, numpy
# and grpcio but not our other dependencies: those come as cp312 wheels in .whl/ (docs/ipc.md, "GPU
# host"). Results go under $OUT (default ./gpu-host-out): the log, the results JSON, trace summaries.
# With arguments, only those steps run (e.g. `bash benchmarks/gpu_host.sh tests ipc_gpu first_fetch`,
# to fit a short lease); the steps: tests ipc_gpu trace_new trace_kept first_fetch workers ipc session, and
# picker (not in the default set: it needs Envoy's wheel and wrk's .deb, WHEELS=.whl-picker; docs/picker.md).
set -u
OUT=${OUT:-$PWD/gpu-host-out}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 BENCH_RESULTS_DIR=$OUT/r
WHEELS=${WHEELS:-.whl}  # the picker step's set (Envoy's wheel, wrk's .deb) is another: WHEELS=.whl-picker
if [ -d "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
    for deb in "$WHEELS"/*.deb; do [ -e "$deb" ] && dpkg -x "$deb" /tmp/debs; done
    [ -d /tmp/debs ] && export PATH=/tmp/debs/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu
    [ -d /tmp/site/envoy/_bin ] && chmod +x /tmp/site/envoy/_bin/envoy && export PATH=/tmp/site/envoy/_bin:$PATH
fi
step() { echo; echo "=== $* ($(date +%T))"; }
tests() {
    timeout 150 python3 -m pytest -q -m "gpu or ucx" --require-gpu \
        tests/ipc/test_gpu.py tests/ipc/test_ipc_client.py tests/avp/test_avp_device.py
}
ipc_gpu() { timeout 180 python3 -m benchmarks ipc_gpu; }
trace_new() {
    timeout 50 python3 -m benchmarks.ipc_trace --memory cupy --total-mib 1024 --runs 4 --profile --out /tmp/trace-new \
        && cp /tmp/trace-new/summary-cupy.json "$OUT/trace-new.json"
}
trace_kept() {
    timeout 50 python3 -m benchmarks.ipc_trace --memory cupy --total-mib 1024 --runs 5 --kept --out /tmp/trace-kept \
        && cp /tmp/trace-kept/summary-cupy.json "$OUT/trace-kept.json"
}
first_fetch() { timeout 120 python3 -m benchmarks.ipc_first_fetch; }
workers() { timeout 100 python3 -m benchmarks workers --quick; }
ipc() { timeout 90 python3 -m benchmarks ipc --quick; }
session() { timeout 90 python3 -m benchmarks session; }
picker() { timeout 420 python3 -m benchmarks picker; }  # Envoy and wrk: WHEELS=.whl-picker
[ $# -gt 0 ] || set -- tests ipc_gpu trace_new trace_kept first_fetch workers ipc session
{
step host; nvidia-smi -L; nproc; python3 -c "import cupy, numpy, pyarrow, ucxx, trio; print('cupy', cupy.__version__, \
'numpy', numpy.__version__, 'pyarrow', pyarrow.__version__, 'ucxx', ucxx.__version__, 'trio', trio.__version__)"
for name in "$@"; do step "$name"; "$name"; done
step done
} 2>&1 | tee "$OUT/log.txt"
