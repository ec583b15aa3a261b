"""The IPC servers (tcp://, shm://) under the issue-22 attacks (items 11-12).

For each attack a fresh server process serves one catalog on ``tcp://`` and ``shm://`` at once
(default :class:`IpcLimits`, so connections expire at the 10 s first-request deadline, spread over
a second; idle and send deadlines 2 s, so that a client that stops reading is dropped quickly); this
process fetches a small stream back to back on one TCP connection
opened before the attack, first idle, then for as long as an attacker process runs. RSS is the
server's VmRSS, sampled between fetches. The attack clients are ``tests/security/ipc_attacks.py``.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from functools import partial
from pathlib import Path

import trio

from benchmarks.security_picker import during_attack
from tests.security.ipc_attacks import ATTACKS, LegitClient

ROOT = Path(__file__).parent.parent
SERVER = """
import trio
from functools import partial
from evergreen_trio.ipc import Catalog, IpcLimits, ServeOptions, serve
from tests.security.ipc_attacks import BIG_TICKET, LEGIT_TICKET, big_table, small_table

async def main():
    catalog = Catalog()
    catalog.add_table(LEGIT_TICKET, small_table())
    catalog.add_table(BIG_TICKET, big_table(), max_chunksize=1 << 14)
    options = ServeOptions(limits=IpcLimits(idle_timeout_s=2, send_timeout_s=2))
    async with trio.open_nursery() as nursery:
        tcp = await nursery.start(serve, "tcp://127.0.0.1:0", catalog, options)
        shm = await nursery.start(serve, "shm://", catalog, options)
        print(tcp, shm, flush=True)

trio.run(main)
"""
ATTACKER = """
import json, sys, trio
from evergreen_trio.ipc.uri import parse_uri
from tests.security.ipc_attacks import ATTACKS
outcome = trio.run(ATTACKS[sys.argv[1]][2], parse_uri(sys.argv[2]), float(sys.argv[3]), 60.0)
print(json.dumps(outcome.describe()))
"""
# (attack, scheme, scale for a full run, for --quick)
ROWS = [("partial_request", "tcp", 1.0, 0.25), ("silent_connections", "tcp", 1.0, 0.4),
        ("want_data_flood", "tcp", 1.0, 1.0), ("partial_request", "shm", 0.1, 0.05),
        ("shm_connections", "shm", 1.0, 1.0)]
IDLE_CALLS = 100


async def _timed_call(client: LegitClient) -> float:
    start = trio.current_time()
    if await client.call() != 1000:
        raise RuntimeError("the legitimate fetch came back short")
    return (trio.current_time() - start) * 1000


async def _measure(name: str, scheme: str, scale: float) -> dict[str, object]:
    attack, expected, _ = ATTACKS[name]
    server = await trio.lowlevel.open_process([sys.executable, "-c", SERVER], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        line = b""
        while not line.endswith(b"\n"):
            line += await server.stdout.receive_some(4096)
        tcp, shm = line.decode().split()
        legit = await LegitClient.connect(tcp)
        idle = [await _timed_call(legit) for _ in range(IDLE_CALLS)]
        row = await during_attack(server.pid, [name, tcp if scheme == "tcp" else shm, str(scale)], ATTACKER,
                                  partial(_timed_call, legit))
        await legit.aclose()
    finally:
        server.terminate()
        await server.wait()
    if scale != 1.0:
        attack += f" (x{scale:g})"
    return {"server": "ipc", "attack": f"{attack} over {scheme}://", "expected": expected,
            "idle_p50_ms": round(statistics.median(idle), 3), **row, "scale": scale}


def attacks(quick: bool) -> list[dict[str, object]]:
    """One row per IPC attack (keys described in ``benchmarks/bench_security.py``)."""
    return [trio.run(_measure, name, scheme, quick_scale if quick else scale)
            for name, scheme, scale, quick_scale in ROWS]
