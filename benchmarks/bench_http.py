"""The ASGI servers that run under Trio, serving the AVP agent: requests/s and latency (issue 22, item 1).

Candidates: our HTTP/1.1 server on h11 (``evergreen_trio._asgi.serve_asgi``, what ``avp serve`` and
``sim`` use) and hypercorn's Trio worker (what they used before; HTTP/1.1 here, as Envoy and the AVP
reference client speak). uvicorn, granian and daphne need asyncio or their own loops, not Trio. Each
server runs the same ``AVPApp`` in its own process; this process runs ``CLIENTS`` keep-alive clients
that POST a small AVP message (64 float32) back to back. Both candidates are measured in the same run,
alternating, and the table gives the median of the runs. Writes ``benchmarks/results/http.json``.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys

import trio

from benchmarks._harness import RESULTS_DIR
from benchmarks.security_http import ROOT, KeepAlive, small_message

CLIENTS = 8
SERVERS = {
    "ours (h11)": """
import trio
from evergreen_trio.avp.server import AVPApp, serve_avp
async def main():
    async with trio.open_nursery() as nursery:
        print(await nursery.start(serve_avp, AVPApp(), "127.0.0.1", 0), flush=True)
trio.run(main)
""",
    "hypercorn (trio)": """
import logging, trio
from functools import partial
from hypercorn.config import Config
from hypercorn.trio import serve
from evergreen_trio.avp.server import AVPApp
async def main():
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = logging.getLogger("quiet")
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, AVPApp(), config))
        print(binds[0].rsplit(":", 1)[1], flush=True)
trio.run(main)
""",
}


async def _run(code: str, requests: int) -> dict[str, float]:
    process = await trio.lowlevel.open_process([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE)
    body = small_message()
    latencies: list[float] = []
    try:
        assert process.stdout is not None
        port = int(await process.stdout.receive_some(100))

        async def client(count: int) -> None:
            connection = await KeepAlive.open(port)
            for _ in range(count):
                start = trio.current_time()
                status, _ = await connection.request("POST", "/avp/v2/transmit", body)
                latencies.append((trio.current_time() - start) * 1000)
                assert status == 200, status
            await connection.aclose()

        warm = await KeepAlive.open(port)
        for _ in range(50):
            await warm.request("POST", "/avp/v2/transmit", body)
        await warm.aclose()
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(CLIENTS):
                nursery.start_soon(client, requests // CLIENTS)
        elapsed = trio.current_time() - started
    finally:
        process.terminate()
        await process.wait()
    latencies.sort()
    return {"requests_per_s": len(latencies) / elapsed, "p50_ms": statistics.median(latencies),
            "p99_ms": latencies[int(len(latencies) * 0.99) - 1]}


def run(quick: bool = False) -> None:
    rounds, requests = (1, 800) if quick else (3, 4000)
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SERVERS}
    for _ in range(rounds):
        for name, code in SERVERS.items():
            results[name].append(trio.run(_run, code, requests))
    rows = [{"server": name, **{key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}}
            for name, runs in results.items()]
    print(f"\n## ASGI servers on Trio: AVP transmit, {CLIENTS} keep-alive clients, {requests} requests, "
          f"median of {rounds}\n")
    print("| server | requests/s | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['server']} | {row['requests_per_s']:,.0f} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} |")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "http.json").write_text(json.dumps({
        "area": "http", "quick": quick, "clients": CLIENTS, "requests": requests, "rounds": rounds,
        "machine": {"python": platform.python_version(), "platform": platform.platform()}, "rows": rows,
    }, indent=2) + "\n")
