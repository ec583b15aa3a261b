"""Issue 22, item 4: the session server's caps before authorization and per peer, over real sockets.

Each test runs an attack client from ``benchmarks/security_session.py`` against an in-process
server and checks the server's answer and that a legitimate session still completes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import pytest
import trio

from benchmarks.security_session import (
    ENHANCE_YOUR_CALM,
    RawH2,
    connection_flood,
    health_watches,
    one_peer_sessions,
    unauthenticated_streams,
)
from evergreen_trio import Client, Server, SessionAbortedError, connect, text
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.serving.auth import Peer, UnauthenticatedError
from evergreen_trio.serving.server import IDLE_TIMEOUT_SECONDS

TOKEN = "Bearer let-me-in"


@pytest.fixture
async def nursery_() -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        yield nursery
        nursery.cancel_scope.cancel()


async def start(nursery: trio.Nursery, **options: object) -> tuple[Server, int]:
    server = Server(**options)  # type: ignore[arg-type]
    register_builtin_actions(server)
    port: int = await nursery.start(server.serve, "127.0.0.1", 0)
    return server, port


async def legit_session_completes(port: int, metadata: Mapping[str, str] | None = None) -> None:
    with trio.fail_after(10):  # a hang guard
        async with connect(f"127.0.0.1:{port}", metadata=metadata) as session:
            call = await session.run("ECHO", {"input": text("legit")}, ["output"])
            assert await call["output"].read_text() == "legit"


def token_required(metadata: Mapping[str, str], peer: Peer) -> str:
    if metadata.get("authorization") != TOKEN:
        raise UnauthenticatedError("a bearer token is required")
    return "someone"


async def test_connections_past_the_cap_get_goaway_enhance_your_calm_with_last_stream_0(
    nursery_: trio.Nursery,
) -> None:
    _, port = await start(nursery_, max_connections=20)
    observed = await connection_flood(port, 30)
    assert observed.startswith("10 of 30 refused with GOAWAY ENHANCE_YOUR_CALM (last stream 0)"), observed
    await legit_session_completes(port)  # the flood's connections are closed: slots are back


async def test_one_peer_gets_its_share_of_the_sessions_and_another_peer_still_gets_in(nursery_: trio.Nursery) -> None:
    server, port = await start(nursery_, max_sessions=100, max_sessions_per_peer=30)
    async with trio.open_nursery() as nursery:
        results: list[str] = []

        async def attack() -> None:
            results.append(await one_peer_sessions(port, 50, source="127.0.0.2"))

        nursery.start_soon(attack)
        with trio.fail_after(10):
            while server.open_sessions < 30:  # noqa: ASYNC110 - a server counter has no event
                await trio.sleep(0.02)
        await legit_session_completes(port)  # from 127.0.0.1, while 127.0.0.2 holds its 30
    assert results == ["30 held, 20 refused with grpc-status 8 (the peer's share)"]
    hits = server.metrics.registry.get_sample_value("evergreen_limit_hits_total", {"limit": "max_sessions_per_peer"})
    assert hits == 20


async def test_unauthenticated_sessions_are_refused_before_they_count_and_a_flood_gets_goaway(
    nursery_: trio.Nursery,
) -> None:
    """With a plain authorize, a session without a token ends UNAUTHENTICATED in the acceptor: it never
    holds one of ``max_sessions`` (5 here), starts no task, and past 100 refusals the connection is
    told to calm down."""
    server, port = await start(nursery_, authorize=token_required, max_sessions=5)
    observed = await unauthenticated_streams(port, 300)
    assert "GOAWAY ENHANCE_YOUR_CALM" in observed, observed
    assert "'16'" in observed and "'8'" not in observed, observed  # UNAUTHENTICATED, never RESOURCE_EXHAUSTED
    assert server.open_sessions == 0
    for _ in range(6):  # more than max_sessions one after another: the refused ones held nothing
        await legit_session_completes(port, {"authorization": TOKEN})
    with pytest.raises(Exception, match="a bearer token is required"):
        await legit_session_completes(port)


async def test_health_watches_are_capped_and_end_after_their_time(nursery_: trio.Nursery) -> None:
    server, port = await start(nursery_)
    observed = await health_watches(port, 120)
    assert observed == "100 held, 20 refused with grpc-status 8", observed
    health = server.health
    with trio.fail_after(10):  # the closed connections' watches end with them
        while health.watches:  # noqa: ASYNC110 - a server counter has no event
            await trio.sleep(0.02)
    health.watch_seconds = 0.3
    client = await RawH2.open(port)
    from grpclib.health.v1.health_pb2 import HealthCheckRequest

    from benchmarks.security_session import message_prefix

    body = HealthCheckRequest(service="").SerializeToString()
    await client.send(client.headers(1, path="/grpc.health.v1.Health/Watch") + client.data(1, message_prefix(len(body))
                                                                                       + body))
    await client.until(lambda c: 1 in c.statuses, 10)
    assert client.statuses[1].startswith("0"), client.statuses  # ended OK after 0.3 s: watch again
    await client.aclose()
    await legit_session_completes(port)


def test_the_idle_timeout_is_two_minutes_by_default() -> None:
    assert IDLE_TIMEOUT_SECONDS == 120.0
    assert Server().idle_timeout == IDLE_TIMEOUT_SECONDS


async def test_sessions_per_connection_past_a_settings_value_are_refused_at_construction(
    nursery_: trio.Nursery,
) -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS is 32 bits: 2**32 built a server whose first connection's
    SETTINGS frame raised OverflowError and ended the whole server."""
    with pytest.raises(ValueError, match=r"max_streams_per_connection must be at most 4294967295"):
        Server(max_sessions_per_connection=2**32)
    _, port = await start(nursery_, max_sessions_per_connection=2**32 - 1)
    await legit_session_completes(port)


async def test_refusing_a_connection_keeps_the_ones_already_served(nursery_: trio.Nursery) -> None:
    _, port = await start(nursery_, max_connections=1)
    async with connect(f"127.0.0.1:{port}") as session:  # holds one connection, mid-session
        refused = await RawH2.open(port)
        await refused.until(lambda c: c.goaway is not None, 10)
        assert (refused.goaway, refused.goaway_last_stream) == (ENHANCE_YOUR_CALM, 0)
        await refused.aclose()
        call = await session.run("ECHO", {"input": text("still served")}, ["output"])
        assert await call["output"].read_text() == "still served"


async def test_a_client_turned_away_at_the_cap_is_told_so_and_retries(nursery_: trio.Nursery) -> None:
    """A session client past the server's connection cap gets the server's GOAWAY as its reason (not
    "does not speak gRPC's HTTP/2"), as a failure ``retries`` tries again: with ``retries``, a late
    session gets in once the held one has ended."""
    _, port = await start(nursery_, max_connections=1)
    address = f"127.0.0.1:{port}"
    holding, release = trio.Event(), trio.Event()
    retried: list[str] = []

    async def hold() -> None:
        async with connect(address) as session:
            call = await session.run("ECHO", {"input": text("held")}, ["output"])
            assert await call["output"].read_text() == "held"
            holding.set()
            await release.wait()

    async def late_with_retries() -> None:
        async with Client(address, retries=50, backoff=0.05) as client, client.session() as late:
            call = await late.run("ECHO", {"input": text("later")}, ["output"])
            retried.append(await call["output"].read_text())

    with trio.fail_after(30):  # a hang guard
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hold)
            await holding.wait()
            with pytest.raises(SessionAbortedError) as turned_away:
                async with connect(address) as late:
                    await late.run("ECHO", {"input": text("late")}, ["output"])
            error = str(turned_away.value)
            assert "turned the connection away" in error and "GOAWAY ENHANCE_YOUR_CALM" in error, error
            nursery.start_soon(late_with_retries)
            await trio.sleep(0.2)  # turned away at least once meanwhile
            release.set()
    assert retried == ["later"]
