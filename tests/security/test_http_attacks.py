"""Issue 22, items 1, 13, 14 and 16: ``avp serve`` and ``sim`` under hostile HTTP clients, over a real socket.

Each test runs an attack client from ``benchmarks/security_http.py`` against an in-process server and
asserts the server's answer, that a legitimate client on its own connection is still served, and that
this process's RSS stays bounded. Ceilings are generous; the measured stall and memory figures are in
``python -m benchmarks security``.
"""

from __future__ import annotations

import json
import logging
import threading
from functools import partial
from typing import Any

import pytest
import trio

from benchmarks.security_http import (
    KeepAlive,
    exchange,
    h2c_bad_path,
    h2c_priority_flood,
    h2c_upgrade,
    header_only_requests,
    newline_model_id,
    non_ascii_request_line,
    non_reader,
    read_until_closed,
    small_message,
    status_line,
    zstd_bomb,
)
from evergreen_trio._asgi import ClientGoneError, HttpServerLimits, serve_asgi
from evergreen_trio.avp import server as avp_server
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, AVPServerOptionsError, serve_avp
from evergreen_trio.sim.config import SimConfig
from evergreen_trio.sim.server import run_sim
from tests.security.test_session_attacks import LEGIT_CEILING_S, MEMORY_CEILING_MIB, nursery_, rss

__all__ = ["nursery_"]  # the fixture, shared with the session attacks


async def start_avp(nursery: trio.Nursery, app: AVPApp | None = None, **options: Any) -> int:
    port: int = await nursery.start(serve_avp, app or AVPApp(AVPServerOptions(**options)), "127.0.0.1", 0)
    return port


async def start_server(nursery: trio.Nursery, kind: str) -> int:
    if kind == "avp":
        return await start_avp(nursery)
    port: int = await nursery.start(partial(run_sim, SimConfig()))
    return port


async def legit(client: KeepAlive, kind: str) -> None:
    """One legitimate request on ``client``'s connection: 200 within the ceiling."""
    with trio.fail_after(LEGIT_CEILING_S):
        if kind == "avp":
            status, _ = await client.request("POST", "/avp/v2/transmit", small_message())
        else:
            status, _ = await client.request("GET", "/v1/models")
    assert status == 200


# ------------------------------------------------------------------ item 1: one frame ends only its connection


@pytest.mark.parametrize("kind", ["avp", "sim"])
@pytest.mark.parametrize("attack", [h2c_bad_path, h2c_priority_flood], ids=["bad_path", "priority_flood"])
async def test_item1_h2c_frames_close_that_connection_only(nursery_: trio.Nursery, kind: str, attack: Any) -> None:
    port = await start_server(nursery_, kind)
    client = await KeepAlive.open(port)
    await legit(client, kind)
    before = rss()
    assert await attack(port, 1.0) == "505 HTTP Version Not Supported, closed"
    await legit(client, kind)  # the connection opened before
    fresh = await KeepAlive.open(port)
    await legit(fresh, kind)  # and a new one: the server is up
    assert rss() - before < MEMORY_CEILING_MIB


@pytest.mark.parametrize("kind", ["avp", "sim"])
async def test_item1_bad_request_lines_get_400_and_upgrade_is_ignored(nursery_: trio.Nursery, kind: str) -> None:
    port = await start_server(nursery_, kind)
    client = await KeepAlive.open(port)
    assert await non_ascii_request_line(port, 1.0) == "400 Bad Request; 400 Bad Request"
    assert await h2c_upgrade(port, 1.0) == "200 OK"  # served as HTTP/1.1; no 101
    await legit(client, kind)


async def test_item1_head_and_pipelined_requests_are_answered_in_order(
    nursery_: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    port = await start_avp(nursery_)
    with caplog.at_level(logging.INFO):
        reply, closed = await exchange(port, b"HEAD /health HTTP/1.1\r\nhost: x\r\n\r\n"
                                             b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", 1.0)
    first, second = reply.split(b"\r\n\r\n", 1)
    assert first.startswith(b"HTTP/1.1 405 ") and b"content-length: 57" in first  # headers only
    assert second.startswith(b"HTTP/1.1 200 OK") and second.endswith(b'{"status":"ok"}') and not closed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_item1_a_client_gone_inside_the_apps_nursery_is_no_error(
    nursery_: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    async def streaming(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async with trio.open_nursery():  # as the simulator streams: our send's error arrives grouped
            raise ClientGoneError("the client closed the connection")

    port = await nursery_.start(serve_asgi, streaming, "127.0.0.1", 0)
    with caplog.at_level(logging.INFO):
        assert await exchange(port, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n") == (b"", True)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def test_item1_an_app_error_ends_its_connection_not_the_server(nursery_: trio.Nursery) -> None:
    async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/boom":
            raise RuntimeError("the app's bug")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"fine"})

    port = await nursery_.start(serve_asgi, broken, "127.0.0.1", 0)
    reply, closed = await exchange(port, b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status_line(reply) == "500 Internal Server Error" and closed
    client = await KeepAlive.open(port)
    assert await client.request("GET", "/") == (200, b"fine")


async def test_item1_connections_are_capped_per_peer(
    nursery_: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    limits = HttpServerLimits(max_connections_per_peer=3)
    port = await start_avp(nursery_, http=limits)
    clients = [await KeepAlive.open(port) for _ in range(3)]
    for client in clients:
        await legit(client, "avp")
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            reply, closed = await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert (reply, closed) == (b"", True)  # past three from this address: closed at once
    assert sum("avp.http.refused peer=127.0.0.1" in r.getMessage() for r in caplog.records) == 1  # not one each
    await legit(clients[0], "avp")


async def test_item1_a_slow_header_is_dropped_at_the_header_deadline(nursery_: trio.Nursery) -> None:
    port = await start_avp(nursery_, http=HttpServerLimits(header_timeout_s=0.3))
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # and never the blank line
        assert await read_until_closed(stream, 10) == (b"", True)


# ------------------------------------------------------------------ item 13: slots from the first body byte


async def test_item13_header_only_requests_hold_no_slot(nursery_: trio.Nursery) -> None:
    port = await start_avp(nursery_, max_concurrent_requests=4, body_timeout_s=1.0)
    client = await KeepAlive.open(port)
    results: list[str] = []

    async def attack() -> None:
        results.append(await header_only_requests(port, 20 / 260))  # 20 requests, 5 times the slots

    async with trio.open_nursery() as nursery:
        nursery.start_soon(attack)
        await trio.sleep(0.3)  # the attack's headers are in; its bodies never come
        await legit(client, "avp")  # not 503: the header-only requests hold no slot
        assert await client.request("GET", "/health") == (200, b'{"status":"ok"}')
    assert results == ["20 x 408 Request Timeout"]


async def test_item13_per_peer_slots_and_health_outside_the_cap(nursery_: trio.Nursery) -> None:
    release = trio.Event()
    entered = 0

    async def slow(message: Any) -> dict[str, Any]:
        nonlocal entered
        entered += 1
        await release.wait()
        return {}

    app = AVPApp(AVPServerOptions(max_requests_per_peer=2), on_message=slow)
    port = await start_avp(nursery_, app)
    statuses: list[int] = []

    async def post() -> None:
        client = await KeepAlive.open(port)
        statuses.append((await client.request("POST", "/avp/v2/transmit", small_message()))[0])
        await client.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post)
        nursery.start_soon(post)
        with trio.fail_after(LEGIT_CEILING_S):
            while entered < 2:  # noqa: ASYNC110 - the handler's counter has no event
                await trio.sleep(0.01)
        third = await KeepAlive.open(port)
        status, body = await third.request("POST", "/avp/v2/transmit", small_message())
        assert status == 503 and b"max_requests_per_peer" in body
        assert await third.request("GET", "/health") == (200, b'{"status":"ok"}')  # outside the cap
        release.set()
    assert statuses == [200, 200]


# ------------------------------------------------------------------ item 14: bounded memory, deadlines, off-loop decode


async def test_item14_bodies_in_flight_are_capped_in_bytes(nursery_: trio.Nursery) -> None:
    port = await start_avp(nursery_, max_inflight_body_bytes=1 << 20, body_timeout_s=2.0)
    head = b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (4 << 20)
    holder = await trio.open_tcp_stream("127.0.0.1", port)
    async with holder:
        await holder.send_all(head + b"AV" + b"\0" * (700 << 10))  # 700 KiB held, the rest never sent
        await trio.sleep(0.2)
        reply, closed = await exchange(port, head + b"AV" + b"\0" * (700 << 10))
        assert status_line(reply) == "503 Service Unavailable" and b"max_inflight_body_bytes" in reply and closed
        client = await KeepAlive.open(port)
        await legit(client, "avp")  # a small body still fits
        reply, _ = await read_until_closed(holder, 10)
        assert status_line(reply) == "408 Request Timeout"


async def test_item14_a_zstd_bomb_is_inflated_off_the_event_loop(
    nursery_: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    decode = avp_server.decode  # type: ignore[attr-defined]

    def spy(body: bytes, **kwargs: Any) -> Any:
        threads.append(threading.get_ident())
        return decode(body, **kwargs)

    monkeypatch.setattr(avp_server, "decode", spy)
    port = await start_avp(nursery_)
    bomb = zstd_bomb()
    assert len(bomb) < 4096
    client, attacker = await KeepAlive.open(port), await KeepAlive.open(port)
    before = rss()
    for _ in range(3):
        status, body = await attacker.request("POST", "/avp/v2/transmit", bomb)
        assert status == 200 and json.loads(body)["bytes"] == 64 << 20
        await legit(client, "avp")
    assert rss() - before < 2 * MEMORY_CEILING_MIB  # one 64 MiB tensor, and the allocator's slack
    loop_thread = threading.get_ident()
    assert len(threads) == 6 and sum(t != loop_thread for t in threads) == 3  # the bombs; not the small ones


async def test_item14_a_client_that_never_reads_is_dropped(nursery_: trio.Nursery) -> None:
    port = await start_avp(nursery_, http=HttpServerLimits(write_timeout_s=0.5))
    client = await KeepAlive.open(port)
    before = rss()
    observed = await non_reader(port, 0.5)  # gives up after 30 s
    assert observed.startswith("dropped after "), observed
    await legit(client, "avp")
    assert rss() - before < MEMORY_CEILING_MIB


# ------------------------------------------------------------------ item 16: peer fields escaped in logs


async def test_item16_a_newline_in_model_id_yields_one_escaped_log_line(
    nursery_: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    port = await start_avp(nursery_)
    with caplog.at_level(logging.INFO):
        assert await newline_model_id(port, 1.0) == "200"
    lines = [line for line in caplog.text.splitlines() if "forged.line" in line]
    assert len(lines) == 1 and "remote_model=m\\nWARNING forged.line admin=1" in lines[0]
    assert not any(line.startswith("WARNING forged") for line in caplog.text.splitlines())


async def test_item16_refusals_escape_the_path_and_agent(
    nursery_: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    port = await start_avp(nursery_)
    client = await KeepAlive.open(port)
    with caplog.at_level(logging.INFO):
        status, _ = await client.request("GET", "/x%0aINFO%20forged", headers=(("avp-agent-id", "a\x1b[31m"),))
    assert status == 404
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("avp.http.refused")]
    assert "path=/x\\nINFO forged" in line and "agent=a\\u001b[31m" in line and "\n" not in line


def test_avp_server_options_are_checked() -> None:
    with pytest.raises(AVPServerOptionsError, match=r"AVPServerOptions\.max_requests_per_peer: expected an int"):
        AVPServerOptions(max_requests_per_peer=0)


# ------------------------------------------------------------------ item 1: the gateway outlives a failing sim


async def test_item1_a_failing_sim_is_restarted_on_its_port_not_fatal(nursery_: trio.Nursery) -> None:
    from evergreen_trio.stack.gateway import _sim_part

    ports: list[int] = []

    async def flaky(config: SimConfig, *, host: str, port: int, task_status: Any) -> None:
        ports.append(port)
        task_status.started(port or 4242)
        if len(ports) < 3:
            raise RuntimeError("sim crashed\nFORGED line")  # what a crash inside a sim looks like
        await trio.sleep_forever()

    assert await nursery_.start(partial(_sim_part, "sim-1", SimConfig(), run=flaky)) == 4242
    with trio.fail_after(LEGIT_CEILING_S):
        while len(ports) < 3:  # noqa: ASYNC110 - the fake's counter has no event
            await trio.sleep(0.05)
    assert ports == [0, 4242, 4242]  # restarted twice, each time on the port the pool knows


async def test_item1_a_sim_that_cannot_start_fails_the_gateway() -> None:
    from evergreen_trio.stack.gateway import _sim_part

    async def broken(config: SimConfig, *, host: str, port: int, task_status: Any) -> None:
        raise OSError("address in use")

    with pytest.raises(BaseExceptionGroup) as caught, trio.fail_after(LEGIT_CEILING_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(_sim_part, "sim-1", SimConfig(), run=broken))
    assert caught.group_contains(OSError, match="address in use")


@pytest.mark.envoy
async def test_item1_h2c_frames_at_a_gateway_sim_leave_the_gateway_serving(nursery_: trio.Nursery) -> None:
    import httpx

    from evergreen_trio.stack.gateway import GatewaySettings, run_gateway

    info = await nursery_.start(run_gateway, GatewaySettings(listen="127.0.0.1:0", simulate=1))
    port = int(info.endpoints[0].rsplit(":", 1)[1])
    assert await h2c_bad_path(port, 1.0) == "505 HTTP Version Not Supported, closed"
    assert await h2c_priority_flood(port, 1.0) == "505 HTTP Version Not Supported, closed"
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{info.url}/v1/completions", json={"model": "sim-model", "prompt": "hi",
                                                                        "max_tokens": 2})
    assert response.status_code == 200
