"""Issue 22, items 2 and 3: session bookkeeping whose cost must follow the input, over a real socket.

Each test runs an attack client from ``benchmarks/security_session.py`` against an in-process
server while a legitimate ECHO session loops on other connections, and checks the server's
answer and that the legitimate sessions kept completing. Ceilings are hang guards, not timings.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable

import pytest
import trio

from benchmarks.security_session import cycle_check_cost, echo_once, flatten_fanout, rss_mib
from evergreen_trio import Server, SessionLimits
from evergreen_trio.actions import register_builtin_actions

LEGIT_CEILING_MS = 5000.0
"""The slowest legitimate session allowed during an attack (a hang guard: before the fixes, 6 s)."""


@pytest.fixture
async def nursery_() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


async def start(nursery: trio.Nursery, **options: object) -> int:
    server = Server(**options)  # type: ignore[arg-type]
    register_builtin_actions(server)
    port: int = await nursery.start(server.serve, "127.0.0.1", 0)
    return port


async def with_legit_probe(port: int, attack: Awaitable[str]) -> tuple[str, list[float]]:
    """Run ``attack`` while ECHO sessions loop on fresh connections; (its answer, their durations in ms)."""
    samples: list[float] = []
    async with trio.open_nursery() as nursery:

        async def probe() -> None:
            while True:
                samples.append(await echo_once(f"127.0.0.1:{port}"))
                await trio.sleep(0.02)

        nursery.start_soon(probe)
        observed = await attack
        samples.append(await echo_once(f"127.0.0.1:{port}"))
        nursery.cancel_scope.cancel()
    return observed, samples


async def test_item2_fragments_naming_the_top_of_a_wide_chain_cost_what_they_hold(nursery_: trio.Nursery) -> None:
    port = await start(nursery_)
    with trio.fail_after(120):  # before: 6 s of frozen server per fragment, 20 minutes for these
        observed, samples = await with_legit_probe(port, cycle_check_cost(port, 200))
    assert observed.startswith("200 fragments naming c1 checked in"), observed
    assert max(samples) < LEGIT_CEILING_MS, samples


async def test_item3_generate_over_a_shared_4_mib_leaf_stops_at_max_flattened_bytes(nursery_: trio.Nursery) -> None:
    """The issue's attack, past the default limit: 300 x 4 MiB is 1.2 GiB flattened; refused at 1 GiB,
    and the toy GENERATE holds no more than a chunk of it."""
    port = await start(nursery_)
    before = rss_mib(os.getpid())
    with trio.fail_after(120):
        observed, samples = await with_legit_probe(port, flatten_fanout(port, "GENERATE", 4 << 20, (300,)))
    assert observed.startswith("grpc-status 8 "), observed  # RESOURCE_EXHAUSTED
    assert "flattens to more than 1073741824 bytes" in observed
    assert max(samples) < LEGIT_CEILING_MS, samples
    assert rss_mib(os.getpid()) - before < 128  # the client's and server's copies of one 4 MiB leaf, and slack


async def test_item3_a_fan_just_under_the_limit_is_served(nursery_: trio.Nursery) -> None:
    port = await start(nursery_, limits=SessionLimits(max_flattened_bytes=1000, max_flattened_nodes=1 + 10 + 100))
    with trio.fail_after(30):
        assert await flatten_fanout(port, "ECHO", 10, (10, 10)) == "grpc-status 0"
        observed = await flatten_fanout(port, "ECHO", 10, (11, 10))
    assert observed.startswith("grpc-status 8 "), observed


async def test_item3_echo_over_a_1000_x_1000_fan_stops_at_max_flattened_nodes(nursery_: trio.Nursery) -> None:
    """ECHO-style fan-out (one 1-byte leaf shared 1000 x 1000 times) against a lowered node limit,
    with the legitimate sessions served meanwhile (the walk pauses every 1024 steps)."""
    port = await start(nursery_, limits=SessionLimits(max_flattened_nodes=5_000))
    with trio.fail_after(120):
        observed, samples = await with_legit_probe(port, flatten_fanout(port, "ECHO", 1, (1000, 1000)))
    assert observed.startswith("grpc-status 8 "), observed
    assert "flattens through more than 5000 nodes" in observed
    assert max(samples) < LEGIT_CEILING_MS, samples


async def test_item3_empty_nodes_shared_a_million_times_pause_and_stop(nursery_: trio.Nursery) -> None:
    """Nodes with no payload yield no event; the walk through them still counts and pauses.
    At the default limit: 1000 x 1001 repetitions of one empty node."""
    port = await start(nursery_)
    with trio.fail_after(120):
        observed, samples = await with_legit_probe(port, flatten_fanout(port, "GENERATE", None, (1000, 1001)))
    assert observed.startswith("grpc-status 8 "), observed
    assert "flattens through more than 1000000 nodes" in observed
    assert max(samples) < LEGIT_CEILING_MS, samples
