"""The picker wire under each issue-11 attack: a legitimate call's latency during the attack, and RSS growth.

For each attack of ``tests/security/frames.py`` a fresh picker wire server (``serve_grpc``
with the echo method and default :class:`WireLimits`; handshake, idle and send deadlines 2 s so
that the timeout attacks end quickly) runs in its own process, the attacker in another, and this
process makes back-to-back legitimate calls on one connection opened before the attack: first
idle, then for as long as the attacker runs. RSS is the server's VmRSS, sampled between calls.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path

import trio

from tests.security.frames import ATTACKS, SETTINGS, Attack, RawClient

ROOT = Path(__file__).parent.parent
SERVER = """
import trio
from functools import partial
from evergreen_trio._grpc.server import WireTimeouts, serve_grpc
from tests.security.frames import ECHO

async def main():
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_grpc, [ECHO], "127.0.0.1", 0,
                                           timeouts=WireTimeouts(handshake_s=2, idle_s=2, send_s=2)))
        print(port, flush=True)

trio.run(main)
"""
ATTACKER = """
import json, sys, trio
from tests.security import frames
attack = frames.ATTACKS[int(sys.argv[1])]
print(json.dumps(trio.run(attack.run, int(sys.argv[2]), float(sys.argv[3])).describe()))
"""
# The size of each attack, as a fraction of what the issue measured: (full run, --quick).
SCALES = {"reflection": (1.0, 1.0), "settings_flood": (1.0, 0.25), "buffer_fill": (1.0, 0.3),
          "continuation_flood": (10.0, 0.1), "connection_flood": (1.0, 0.4), "rapid_reset": (1.0, 0.1),
          "non_reader": (1.0, 0.25)}
IDLE_CALLS = 200


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def _timed_call(client: RawClient) -> float:
    start = trio.current_time()
    if not await client.call():
        raise RuntimeError("the legitimate call failed")
    return (trio.current_time() - start) * 1000


async def _measure(index: int, attack: Attack, quick: bool) -> dict[str, object]:
    scale = SCALES.get(attack.run.__name__, (1.0, 1.0))[quick]
    server = await trio.lowlevel.open_process([sys.executable, "-c", SERVER], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        port = int(await server.stdout.receive_some(100))
        legit = await RawClient.connect(port)
        await legit.read_until(lambda f: f.kind == SETTINGS, 5.0)
        idle = [await _timed_call(legit) for _ in range(IDLE_CALLS)]
        row = await during_attack(server.pid, [str(index), str(port), str(scale)], ATTACKER,
                                  partial(_timed_call, legit))
        await legit.aclose()
    finally:
        server.terminate()
        await server.wait()
    return {"server": "picker", "attack": f"{attack.item}. {attack.name}", "expected": attack.expected,
            "idle_p50_ms": round(statistics.median(idle), 3), **row, "scale": scale}


async def during_attack(pid: int, args: list[str], attacker: str,
                        call: Callable[[], Awaitable[float]]) -> dict[str, object]:
    """Run ``python -c attacker *args`` (it prints the observed answer as JSON) while ``call``
    (a legitimate call, returning its ms) runs back to back; the row's measured keys."""
    base = peak = _rss_mib(pid)
    during: list[float] = []
    done = trio.Event()
    finished: list[subprocess.CompletedProcess[bytes]] = []

    async def attack_process() -> None:
        finished.append(await trio.run_process([sys.executable, "-c", attacker, *args], cwd=ROOT,
                                               capture_stdout=True, check=False))
        done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attack_process)
        while not done.is_set():
            during.append(await call())
            peak = max(peak, _rss_mib(pid))
            await trio.sleep(0.002)
    output, code = finished[0].stdout, finished[0].returncode
    return {
        "observed": json.loads(output.decode()) if code == 0 else f"attacker exited {code}",
        "p50_ms": round(statistics.median(during), 3) if during else None,
        "max_ms": round(max(during), 3) if during else None, "rss_growth_mib": round(peak - base, 1),
        "legit_calls": len(during),
    }


def attacks(quick: bool) -> list[dict[str, object]]:
    """One row per picker attack (keys described in ``benchmarks/bench_security.py``)."""
    return [trio.run(_measure, index, attack, quick) for index, attack in enumerate(ATTACKS)]
