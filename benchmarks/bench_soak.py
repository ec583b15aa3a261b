"""Soak: 100,000 sequential Evergreen sessions against one server process; its memory after
the first 10,000 sessions and after the last must differ by under 5%.

Each session is a grpcio client's ECHO of a small DAG (8 nodes, 5 chunks, checked), one after
another. The client opens a new connection every 5,000 sessions, as real clients come and go:
on one connection h2 keeps a record of every closed stream, up to 65,536 of them (about
100 bytes each, 6 MiB or more), which is the connection's memory, not the sessions'.
Memory is the server process's resident set (VmRSS), read from /proc. ``--quick`` runs
1,000 then 10,000 sessions.
"""

from __future__ import annotations

import time

from benchmarks._harness import Row, print_table, write_results
from evergreen_trio.testing.checks import check_valid
from evergreen_trio.testing.model import Call, InnerSpec, LeafSpec, Meta, NodeSpec, Plan, echo, fragments_of
from evergreen_trio.testing.subprocess_server import spawn_server
from evergreen_trio.testing.wire import SyncClient

GROWTH_LIMIT = 0.05
SESSIONS_PER_CONNECTION = 5_000


def soak_plan() -> Plan:
    nodes: dict[str, NodeSpec] = {
        "c:q": LeafSpec(Meta("text/plain"), b"What is in this picture?"),
        "c:img": LeafSpec(Meta("image/png"), bytes(range(256)) * 4),
        "c:eot": LeafSpec(Meta("application/x-protobuf; type=EndOfTurn"), b""),
        "c:turn": InnerSpec(("c:q", "c:img")),
        "c:prompt": InnerSpec(("c:turn", "c:turn", "c:eot")),
    }
    return Plan(nodes, (Call(("c:prompt",), ("o:0",)),), (echo("c:prompt", "o:0"), *fragments_of(nodes)))


def run(quick: bool = False) -> None:
    warm, total = (1_000, 10_000) if quick else (10_000, 100_000)
    plan = soak_plan()
    messages = plan.messages()
    with spawn_server() as server:
        started = time.perf_counter()
        rss_warm = 0
        client = SyncClient(server.address, timeout=30)
        for index in range(1, total + 1):
            check_valid(plan, client.run(messages))
            if index % SESSIONS_PER_CONNECTION == 0:
                client.close()
                client = SyncClient(server.address, timeout=30)
            if index == warm:
                rss_warm = server.rss_bytes()
                warm_seconds = time.perf_counter() - started
        client.close()
        seconds = time.perf_counter() - started
        rss_end, peak = server.rss_bytes(), server.rss_bytes("VmHWM")
    growth = (rss_end - rss_warm) / rss_warm
    rows = [
        Row(f"sessions/s over {total:,} sequential ECHO sessions", total / seconds, "sessions/s"),
        Row(f"server RSS after the first {warm:,} sessions", rss_warm / 2**20, "MiB"),
        Row(f"server RSS after {total:,} sessions", rss_end / 2**20, "MiB", f"after {warm:,}",
            rss_end / rss_warm),
        Row("server peak RSS", peak / 2**20, "MiB"),
        Row("RSS growth after the first sessions", growth * 100, "%", extra={"limit_percent": GROWTH_LIMIT * 100}),
    ]
    print_table("Soak: sequential sessions against one server process", rows)
    verdict = "holds" if abs(growth) < GROWTH_LIMIT else "BROKEN"
    print(f"\nmemory within {GROWTH_LIMIT:.0%}: {verdict} ({growth:+.2%}); first {warm:,} took {warm_seconds:.0f} s")
    write_results("soak", rows, sessions=total, warm_sessions=warm, seconds=seconds, quick=quick,
                  sessions_per_connection=SESSIONS_PER_CONNECTION,
                  growth_within_limit=abs(growth) < GROWTH_LIMIT)
