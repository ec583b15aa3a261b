"""Load: many concurrent sessions on one server process, each running ECHO on a 100-node DAG.

CI runs 100 sessions; ``EVERGREEN_LOAD_SESSIONS=1000`` runs the full load (about a minute on
two shared cores). The server runs in its own process so its peak memory (VmHWM) is its own;
the clients are this process's Trio tasks, each with its own connection. Time and peak memory
are printed (``-s`` shows them), never asserted.
"""

from __future__ import annotations

import os
import time

import trio

from evergreen_trio import blob, connect, inner, text
from evergreen_trio.nodes import Inner
from evergreen_trio.testing.subprocess_server import spawn_server

SESSIONS = int(os.environ.get("EVERGREEN_LOAD_SESSIONS", "100"))
GROUPS = 33
"""Root + 33 inner nodes + 66 leaves = 100 nodes; 66 flattened chunks."""


def dag(session: int) -> tuple[Inner, list[tuple[str, bytes]]]:
    """A 100-node DAG unique to ``session`` and its expected flattening (mimetype, bytes)."""
    groups, expected = [], []
    for g in range(GROUPS):
        words = f"session {session} group {g}"
        data = [bytes([session % 256, g]) * 8, b"tail"]
        groups.append(inner(text(words), blob(data)))
        expected += [("text/plain", words.encode()), ("application/octet-stream", b"".join(data))]
    return inner(*groups), expected


async def _session(address: str, index: int, results: list[bool]) -> None:
    root, expected = dag(index)
    async with connect(address) as session:
        call = await session.run("ECHO", {"input": root}, ["output"])
        chunks = await call["output"].read_chunks()
    results.append([(m.mimetype, data) for m, data in chunks] == expected)


async def test_concurrent_sessions_all_complete_correctly() -> None:
    with spawn_server() as server:
        results: list[bool] = []
        started = time.perf_counter()
        with trio.fail_after(600):  # a hang guard, not a timing assertion
            async with trio.open_nursery() as nursery:
                for index in range(SESSIONS):
                    nursery.start_soon(_session, server.address, index, results)
        seconds = time.perf_counter() - started
        peak = server.rss_bytes("VmHWM")
    assert len(results) == SESSIONS and all(results)
    print(f"\nload: {SESSIONS} concurrent ECHO sessions x 100 nodes in {seconds:.2f} s; "
          f"server peak RSS {peak / 2**20:.1f} MiB")
