"""The picker under the issue-22 request attacks (items 7-10), through its ext_proc port.

For each attack a fresh picker (``run_picker`` with an idle fake model server, in its own
process) serves; this process makes back-to-back legitimate ext_proc calls (grpcio, one channel
opened before the attack) first idle, then for as long as an attacker process runs. RSS is the
picker's VmRSS, sampled between calls. The attack clients are ``tests/security/picker_requests.py``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import trio

from benchmarks.security_picker import during_attack
from tests.security.picker_requests import LEGIT_BODY, LISTED, channel, ext_proc

ROOT = Path(__file__).parent.parent
SERVER = """
import sys, trio
from functools import partial
from evergreen_trio.picker import parse_config, run_picker
from tests.security.picker_requests import config_text, serve_fake_engine

async def main():
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(serve_fake_engine)
        config = parse_config(config_text(engine, sys.argv[1]))
        ports = await nursery.start(partial(run_picker, config, grpc_port=0, health_port=0, metrics_port=0))
        print(ports.grpc, ports.metrics, flush=True)

trio.run(main)
"""
ATTACKER = """
import json, sys
from benchmarks.security_picker_requests import ATTACKS
print(json.dumps(ATTACKS[sys.argv[1]][3](int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "quick")))
"""
IDLE_CALLS = 100


def _names_and_scrapes(grpc_port: int, metrics_port: int, quick: bool) -> str:
    import httpx

    from tests.security.picker_requests import REWRITE, model_names

    names = model_names(500 if quick else 2000)
    with channel(grpc_port) as own:
        statuses = {ext_proc(own, f'{{"model":"{n}","prompt":"p"}}'.encode(), {REWRITE: n[::-1]}).status for n in names}
    times, size = [], 0
    for _ in range(10):
        start = time.perf_counter()
        size = len(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).content)
        times.append(time.perf_counter() - start)
    return (f"{len(names)} names answered {sorted(statuses)}; /metrics {size / 1024:,.1f} KB, "
            f"scrape p50 {statistics.median(times) * 1000:.1f} ms")


def _rewrite(grpc_port: int, metrics_port: int, quick: bool) -> str:
    from tests.security.picker_requests import REWRITE

    with channel(grpc_port) as own:
        smuggled = ext_proc(own, LEGIT_BODY, {REWRITE: "internal-only-adapter"}).status
        allowed = ext_proc(own, LEGIT_BODY, {REWRITE: "sim-lora"})
    return f"rewrite to internal-only-adapter: {smuggled}; to sim-lora: {allowed.status} ({allowed.body_model})"


def _objects(grpc_port: int, metrics_port: int, quick: bool) -> str:
    from tests.security.picker_requests import deep_objects_body

    body = deep_objects_body()
    with channel(grpc_port) as own:
        answers = [ext_proc(own, body) for _ in range(2 if quick else 5)]
    return f"{len(answers)} x 16 MiB answered {sorted({a.status for a in answers})}"


def _large_prompt(grpc_port: int, metrics_port: int, quick: bool) -> str:
    from tests.security.picker_requests import MiB

    body = b'{"model":"sim-model","prompt":"' + b"a, b" * (4 * MiB - 16) + b'"}'
    with channel(grpc_port) as own:
        answers = [ext_proc(own, body) for _ in range(2 if quick else 5)]
    return f"{len(answers)} x 16 MiB answered {sorted({a.status for a in answers})}"


def _surrogate(grpc_port: int, metrics_port: int, quick: bool) -> str:
    from tests.security.picker_requests import REWRITE, surrogate_body

    with channel(grpc_port) as own:
        statuses = {ext_proc(own, surrogate_body(), {REWRITE: "sim-lora"}).status for _ in range(200)}
    return f"200 requests answered {sorted(statuses)}"


# name -> (attack, expected, models config, run(grpc port, metrics port, quick) -> observed)
ATTACKS: dict[str, tuple[str, str, str, Callable[[int, int, bool], str]]] = {
    "names": ("7. 2,000 unique 200-char model names + rewrites, then 10 scrapes",
              "unlisted names fold into `other`; /metrics bounded; scrapes rendered off the routing thread",
              "", _names_and_scrapes),
    "rewrite": ("8. `x-gateway-model-name-rewrite` to a listed model that is not a target",
                "404 (as asking for it directly without a list entry); a configured target is honoured",
                LISTED, _rewrite),
    "objects": ("9. 16 MiB body of `{},{},...` (5.6 million objects)",
                "413 before parsing (MAX_BODY_JSON_CONTAINERS)", "", _objects),
    "large": ("9. (reference, not an attack) a 16 MiB prompt string", "routed: what any 16 MiB body costs",
              "", _large_prompt),
    "surrogate": ("10. lone surrogate in the prompt + a model rewrite (200 requests)",
                  "400 and one log line each", LISTED, _surrogate),
}


def _timed_call(own: grpc.Channel) -> float:
    start = time.perf_counter()
    if ext_proc(own, LEGIT_BODY).status != 200:
        raise RuntimeError("the legitimate request was not routed")
    return (time.perf_counter() - start) * 1000


async def _measure(name: str, quick: bool) -> dict[str, object]:
    attack, expected, models, _ = ATTACKS[name]
    server = await trio.lowlevel.open_process([sys.executable, "-c", SERVER, models], cwd=ROOT,
                                              stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await server.stdout.receive_some(100)
        grpc_port, metrics_port = map(int, line.split())
        with channel(grpc_port) as own:
            with trio.fail_after(10):
                while (await trio.to_thread.run_sync(ext_proc, own, LEGIT_BODY)).status == 503:  # noqa: ASYNC110
                    await trio.sleep(0.05)  # until the first scrape marks the endpoint ready
            idle = [await trio.to_thread.run_sync(_timed_call, own) for _ in range(IDLE_CALLS)]
            row = await during_attack(server.pid, [name, str(grpc_port), str(metrics_port),
                                                   "quick" if quick else "full"], ATTACKER,
                                      partial(trio.to_thread.run_sync, _timed_call, own))
    finally:
        server.terminate()
        await server.wait()
    return {"server": "picker", "attack": attack, "expected": expected,
            "idle_p50_ms": round(statistics.median(idle), 3), **row}


def attacks(quick: bool) -> list[dict[str, object]]:
    """One row per request attack (keys described in ``benchmarks/bench_security.py``)."""
    return [trio.run(_measure, name, quick) for name in ATTACKS]
