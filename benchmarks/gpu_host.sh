#!/usr/bin/env bash
# Every GPU and many-core check in one run, for a lent GPU host whose python3 has CuPy, pyarrow, numpy
# and grpcio but not our other dependencies: those come as cp312 wheels in .whl/ (docs/ipc.md, "GPU
# host"). Results go under $OUT (default ./gpu-host-out): the log, the results JSON, trace summaries.
set -u
OUT=${OUT:-$PWD/gpu-host-out}
mkdir -p "$OUT/r"
export PYTHONUNBUFFERED=1 BENCH_RESULTS_DIR=$OUT/r
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
step() { echo; echo "=== $* ($(date +%T))"; }
{
step host; nvidia-smi -L; nproc; python3 -c "import cupy, numpy, pyarrow, ucxx, trio; print('cupy', cupy.__version__, \
'numpy', numpy.__version__, 'pyarrow', pyarrow.__version__, 'ucxx', ucxx.__version__, 'trio', trio.__version__)"
step gpu tests; timeout 120 python3 -m pytest -q -m "gpu or ucx" \
    --require-gpu tests/ipc/test_gpu.py tests/ipc/test_ipc_client.py tests/avp/test_avp_device.py
step ipc_gpu; timeout 180 python3 -m benchmarks ipc_gpu
step trace, a new connection per fetch; timeout 50 python3 -m benchmarks.ipc_trace --memory cupy --total-mib 1024 \
    --runs 4 --profile --out /tmp/trace-new && cp /tmp/trace-new/summary-cupy.json "$OUT/trace-new.json"
step trace, kept connection; timeout 50 python3 -m benchmarks.ipc_trace --memory cupy --total-mib 1024 --runs 5 \
    --kept --out /tmp/trace-kept && cp /tmp/trace-kept/summary-cupy.json "$OUT/trace-kept.json"
step first fetch, pool fresh or grown; timeout 60 python3 -m benchmarks.ipc_first_fetch
step workers; timeout 100 python3 -m benchmarks workers --quick
step ipc on CPU; timeout 90 python3 -m benchmarks ipc --quick
step session; timeout 90 python3 -m benchmarks session
step done
} 2>&1 | tee "$OUT/log.txt"
