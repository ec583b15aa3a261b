"""gRPC health on the serving port, and graceful drain: in process, and `serve` stopped by SIGTERM."""

from __future__ import annotations

import signal

import trio
from ops_helpers import health, held_echo, serve, wait_health

from evergreen_trio import Client, Server, SessionAbortedError, connect, text
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.serving.server import SERVICE

HANG_GUARD = 60


async def _one_echo(address: str) -> str:
    try:
        async with connect(address) as session:
            call = await session.run("ECHO", {"input": text("hi")}, ["output"])
            assert await call["output"].read_text() == "hi"
        return "OK"
    except SessionAbortedError as aborted:
        return aborted.code.name


async def test_health_answers_serving_then_not_serving_while_draining() -> None:
    server = Server()
    register_builtin_actions(server)
    result: list[str] = []
    opened, release = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as clients, trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            address = f"127.0.0.1:{port}"
            assert await health(address) == "SERVING"
            assert await health(address, SERVICE) == "SERVING"
            assert await health(address, "liveness") == "SERVING"
            assert await health(address, "no.such.Service") == "NOT_FOUND"
            clients.start_soon(held_echo, address, opened, release, result)
            await opened.acquire()
            drained = trio.Event()

            async def drain() -> None:
                assert await server.drain(grace=HANG_GUARD) == 0
                drained.set()

            nursery.start_soon(drain)
            await trio.testing.wait_all_tasks_blocked()
            assert await health(address) == "NOT_SERVING"
            assert await health(address, SERVICE) == "NOT_SERVING"
            assert await health(address, "liveness") == "SERVING"  # draining, not dead
            assert await _one_echo(address) == "UNAVAILABLE"  # refused: no handler runs
            assert not drained.is_set()
            release.set()
            await drained.wait()
            nursery.cancel_scope.cancel()
    assert result == ["OK"]
    assert server.metrics.registry.get_sample_value("evergreen_session_aborts_total", {"reason": "draining"}) == 1


async def test_sigterm_drains_open_sessions_then_exits_zero() -> None:
    result: list[str] = []
    opened, release = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with serve("--drain-grace", "30") as server, trio.open_nursery() as nursery:
            assert await health(server.address) == "SERVING"
            nursery.start_soon(held_echo, server.address, opened, release, result)
            await opened.acquire()
            server.signal(signal.SIGTERM)
            await wait_health(server.address, "NOT_SERVING", SERVICE)
            assert await _one_echo(server.address) == "UNAVAILABLE"
            assert server.process.returncode is None  # still draining: the session is open
            release.set()
            assert await server.process.wait() == 0
    assert result == ["OK"]


async def test_sessions_still_open_after_the_grace_end_with_unavailable() -> None:
    result: list[str] = []
    opened, never = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with serve("--drain-grace", "1") as server, trio.open_nursery() as nursery:
            nursery.start_soon(held_echo, server.address, opened, never, result)
            await opened.acquire()
            started = trio.current_time()
            server.signal(signal.SIGTERM)
            assert await server.process.wait() == 0
            assert trio.current_time() - started >= 1.0
    assert result == ["UNAVAILABLE"]


async def test_a_second_signal_ends_a_long_drain_at_once() -> None:
    result: list[str] = []
    opened, never = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with serve("--drain-grace", "600") as server, trio.open_nursery() as nursery:
            nursery.start_soon(held_echo, server.address, opened, never, result)
            await opened.acquire()
            server.signal(signal.SIGTERM)
            await wait_health(server.address, "NOT_SERVING")
            server.signal(signal.SIGINT)
            assert await server.process.wait() == 0
    assert result == ["UNAVAILABLE"]


async def test_a_drain_moves_a_reused_clients_next_session_to_a_new_connection() -> None:
    """A draining server says GOAWAY on each connection: a reused `Client`'s open session goes on to
    its end, that connection then closes, and the client's next session opens a new connection
    (behind a load balancer, to another server; here the same one, which refuses it while draining).
    Without it the client kept sending new sessions to the draining server on its old connection."""
    server = Server()
    register_builtin_actions(server)
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            async with Client(f"127.0.0.1:{port}") as client:
                async with client.session() as session:
                    call = await session.run("ECHO", {"input": text("before")}, ["output"])
                    assert await call["output"].read_text() == "before"
                    assert client._channel is not None
                    first = client._channel._connection
                    nursery.start_soon(server.drain, HANG_GUARD)
                    await trio.testing.wait_all_tasks_blocked()
                    assert not first.core.accepting  # the GOAWAY came
                    call = await session.run("ECHO", {"input": text("after")}, ["output"])
                    assert await call["output"].read_text() == "after"
                await first._finished.wait()  # closed once its last session ended
                try:
                    async with client.session() as late:
                        await late.run("ECHO", {"input": text("late")}, ["output"])
                except SessionAbortedError as refused:
                    assert refused.code.name == "UNAVAILABLE" and "draining" in str(refused)
                assert client._channel._connection is not first
            nursery.cancel_scope.cancel()


async def test_a_draining_server_that_is_cancelled_ends_its_sessions_with_unavailable() -> None:
    server = Server()
    register_builtin_actions(server)
    result: list[str] = []
    opened, never = trio.Semaphore(0), trio.Event()
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as clients, trio.open_nursery() as serving:
            port = await serving.start(server.serve, "127.0.0.1", 0)
            clients.start_soon(held_echo, f"127.0.0.1:{port}", opened, never, result)
            await opened.acquire()
            assert await server.drain(grace=0.2) == 1
            serving.cancel_scope.cancel()
    assert result == ["UNAVAILABLE"]
    assert server.open_sessions == 0
    ended = server.metrics.registry.get_sample_value("evergreen_sessions_ended_total", {"code": "UNAVAILABLE"})
    assert ended == 1

