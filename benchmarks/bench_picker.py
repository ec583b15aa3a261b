"""Endpoint Picker through a real Envoy (--concurrency 1), loaded by wrk in its own process.

Routes to the same two model servers: Envoy alone (ROUND_ROBIN, no ext_proc), Envoy + our picker
(``evergreen-trio picker``: the sans-IO gRPC connection on a Trio listener) and Envoy + the
grpcio reference picker (``benchmarks/grpcio_picker.py``: grpc.aio, same decision core, same
stream lifetime). Both pickers run twice: routing only (``extProc.observeResponses: false``, the
stream ends once the request is routed) and observing responses (the default: Envoy's response
headers and body round trips too, for token usage). A floor row runs the same gateway against a
do-nothing ext_proc server on our wire (``benchmarks/noop_ext_proc.py``: the destination set, the
body sent back, nothing decided), so what Envoy's ext_proc machinery costs by itself is in the
same run. Envoy is the same for all: request and response bodies FULL_DUPLEX_STREAMED. Model
servers are a second Envoy answering ``/metrics`` and completions with direct responses, so they
are never the bottleneck. wrk (installed from
Debian's packages if missing) runs a Lua script posting an OpenAI completion body, at 1 and 16
connections, three runs each; the table gives the medians.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks._harness import Row, print_table, write_results
from evergreen_trio.picker import gateway_config, run_envoy, write_gateway_config

METRICS = (
    "vllm:num_requests_waiting 1\nvllm:num_requests_running 2\nvllm:kv_cache_usage_perc 0.3\n"
    'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1\n'
)
COMPLETION = json.dumps({
    "id": "cmpl-1", "object": "text_completion", "model": "bench",
    "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
})
WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = '{"model":"bench","prompt":"Summarize the following review of a small family restaurant in two sentences."}'
wrk.headers["Content-Type"] = "application/json"
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"errors":%d,"non2xx":%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""
ROOT = Path(__file__).parent.parent
PICKER_CONFIG = """
pool:
  name: bench
  endpoints: [{endpoints}]
models:
  - name: bench
extProc:
  observeResponses: {observe}
"""
OURS, REF, DIRECT = "evergreen-trio picker", "grpcio picker", "envoy direct"
FLOOR = "do-nothing ext_proc (floor)"
OBSERVED = ", responses observed"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def ensure_wrk() -> str:
    """wrk from PATH, installing Debian's package when missing."""
    found = shutil.which("wrk")
    if found is None:
        subprocess.run(["apt-get", "update", "-qq"], check=False, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True, capture_output=True)
        found = shutil.which("wrk")
    if found is None:
        raise RuntimeError("wrk is not installed and apt-get could not install it")
    return found


def backend_config(ports: list[int], admin_port: int) -> dict[str, Any]:
    """An Envoy playing model servers: /metrics and completions as direct responses."""
    hcm = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
    routes = [
        {"match": {"path": "/metrics"}, "direct_response": {"status": 200, "body": {"inline_string": METRICS}}},
        {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": COMPLETION}},
         "response_headers_to_add": [{"header": {"key": "content-type", "value": "application/json"}}]},
    ]
    listeners = [{
        "name": f"backend{port}",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": hcm, "stat_prefix": "backend", "codec_type": "AUTO",
            "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": routes}]},
            "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        }}]}],
    } for port in ports]
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
            "static_resources": {"listeners": listeners}}


async def _wait_routable(url: str, timeout_s: float = 30.0) -> None:
    """Wait until a request through Envoy and the picker answers 200 (picker up and scraped)."""
    async with httpx.AsyncClient(timeout=2) as client:
        with trio.fail_after(timeout_s):
            while True:
                try:
                    response = await client.post(url, content=b'{"model":"bench","prompt":"warm up"}')
                    if response.status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.1)


def _pids(fragment: str) -> list[int]:
    """Processes whose command line contains ``fragment`` (Linux /proc; none elsewhere)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if fragment in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (0 for a process that is gone)."""
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


async def _wrk(
    wrk: str, script: Path, url: str, connections: int, seconds: int, watched: dict[str, list[int]]
) -> dict[str, float]:
    """One wrk run; besides rate and latency, the CPU ms per request of each ``watched`` process group."""
    before = {name: _cpu_seconds(pids) for name, pids in watched.items()}
    result = await trio.run_process(
        [wrk, "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "5s", "-s", str(script), url],
        capture_stdout=True, capture_stderr=True)
    line = next(x for x in result.stdout.decode().splitlines() if x.startswith("WRK "))
    data = json.loads(line[4:])
    requests = max(1, data["requests"])
    sample = {
        "rps": data["requests"] / (data["duration_us"] / 1e6),
        "p50_ms": data["p50_us"] / 1000,
        "p99_ms": data["p99_us"] / 1000,
        "errors": data["errors"] + data["non2xx"],
    }
    for name, pids in watched.items():
        sample[f"{name}_cpu_ms_per_req"] = round(1000 * (_cpu_seconds(pids) - before[name]) / requests, 4)
    return sample


def _median(samples: list[dict[str, float]], key: str) -> float:
    values = sorted(s[key] for s in samples)
    return values[len(values) // 2]


async def _measure(quick: bool) -> dict[str, dict[int, list[dict[str, float]]]]:
    wrk = ensure_wrk()
    runs, seconds = (1, 2) if quick else (3, 6)
    work = Path(tempfile.mkdtemp(prefix="bench-picker-"))
    script = work / "post.lua"
    script.write_text(WRK_SCRIPT)
    backends = [_free_port(), _free_port()]
    pool = [f"127.0.0.1:{p}" for p in backends]
    picker_port, listener, rr_port = _free_port(), _free_port(), _free_port()
    backend_admin, gateway_admin = _free_port(), _free_port()
    configs = {}
    for observe in ("false", "true"):
        configs[observe] = work / f"picker-{observe}.yaml"
        configs[observe].write_text(PICKER_CONFIG.format(endpoints=", ".join(pool), observe=observe))
    backend_path = write_gateway_config(work / "backends.json", backend_config(backends, backend_admin))
    gateway_path = write_gateway_config(work / "gateway.json", gateway_config(
        f"127.0.0.1:{picker_port}", listener, admin_port=gateway_admin,
        round_robin_endpoints=pool, round_robin_port=rr_port))
    python = sys.executable
    pickers: dict[str, list[str]] = {FLOOR: [python, "-m", "benchmarks.noop_ext_proc", "--port", str(picker_port),
                                             *(arg for address in pool for arg in ("--endpoint", address))]}
    for observe, suffix in (("false", ""), ("true", OBSERVED)):
        config = str(configs[observe])
        pickers[OURS + suffix] = [
            python, "-m", "evergreen_trio.cli", "--log-level", "WARNING", "picker", "--config", config,
            "--grpc-port", str(picker_port), "--grpc-health-port", str(_free_port()),
            "--metrics-port", str(_free_port())]
        pickers[REF + suffix] = [python, "-m", "benchmarks.grpcio_picker", "--config", config,
                                 "--port", str(picker_port)]
    results: dict[str, dict[int, list[dict[str, float]]]] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(run_envoy, backend_path, admin_port=backend_admin))
        await nursery.start(partial(run_envoy, gateway_path, admin_port=gateway_admin))
        variants: list[tuple[str, list[str] | None, str]] = [
            (DIRECT, None, f"http://127.0.0.1:{rr_port}/v1/completions"),
            *((name, command, f"http://127.0.0.1:{listener}/v1/completions") for name, command in pickers.items()),
        ]
        for name, command, url in variants:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as inner:
                    if command is not None:
                        inner.start_soon(partial(trio.run_process, command, check=False, cwd=ROOT))
                    await _wait_routable(url)
                    watched = {"gateway_envoy": _pids(str(gateway_path)), "backend_envoy": _pids(str(backend_path))}
                    if command is not None:  # found by its config, or the floor by its module
                        config = command[command.index("--config") + 1] if "--config" in command else ""
                        watched["picker"] = _pids(f"--config {config}" if config else command[2])
                    results[name] = {}
                    for connections in (1, 16):
                        await _wrk(wrk, script, url, connections, 1, watched)  # warm-up
                        results[name][connections] = [
                            await _wrk(wrk, script, url, connections, seconds, watched) for _ in range(runs)]
                    scope.cancel()
        nursery.cancel_scope.cancel()
    shutil.rmtree(work, ignore_errors=True)
    return results


def run(quick: bool = False) -> None:
    results = trio.run(_measure, quick)
    rows: list[Row] = []
    peers = {OURS: REF, OURS + OBSERVED: REF + OBSERVED}
    for connections in (1, 16):
        for name in (DIRECT, FLOOR, OURS, REF, OURS + OBSERVED, REF + OBSERVED):
            samples = results[name][connections]
            rps, p50, p99 = (_median(samples, k) for k in ("rps", "p50_ms", "p99_ms"))
            extra = {"samples": samples}
            peer = peers.get(name, "")
            peer_samples = results[peer][connections] if peer else samples
            rows.append(Row(f"{name} c={connections} throughput", rps, "req/s", peer,
                            rps / _median(peer_samples, "rps") if peer else None, extra))
            rows.append(Row(f"{name} c={connections} p50", p50, "ms", peer,
                            p50 / _median(peer_samples, "p50_ms") if peer else None))
            rows.append(Row(f"{name} c={connections} p99", p99, "ms", peer,
                            p99 / _median(peer_samples, "p99_ms") if peer else None))
            for process in ("picker", "gateway_envoy"):
                key = f"{process}_cpu_ms_per_req"
                if key in samples[0]:
                    rows.append(Row(f"{name} c={connections} {process.replace('_', ' ')} CPU per request",
                                    _median(samples, key), "ms"))
        direct = results[DIRECT][connections]
        for name in (FLOOR, OURS, OURS + OBSERVED):
            rps = _median(results[name][connections], "rps")
            rows.append(Row(f"{name} c={connections} throughput vs envoy direct", rps, "req/s", DIRECT,
                            rps / _median(direct, "rps")))
        for name in (FLOOR, OURS, REF, OURS + OBSERVED, REF + OBSERVED):
            added = _median(results[name][connections], "p50_ms") - _median(results[DIRECT][connections], "p50_ms")
            rows.append(Row(f"{name} c={connections} added p50 vs envoy direct", added, "ms", DIRECT))
    print_table("Endpoint Picker through Envoy (wrk, POST /v1/completions, median of runs)", rows)
    write_results("picker", rows, quick=quick, runs=1 if quick else 3, tool="wrk -t1", envoy="--concurrency 1")
