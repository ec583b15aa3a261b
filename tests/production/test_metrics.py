"""Session metrics scraped over HTTP after real sessions: in process, and from `serve --metrics-port`."""

from __future__ import annotations

import socket
from functools import partial

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from ops_helpers import scrape, serve, value

from evergreen_trio import ActionContext, Server, SessionAbortedError, SessionLimits, connect, inner, text
from evergreen_trio._http import HttpRequest, HttpResponse, serve_http
from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.dag import LimitExceededError, ProtocolViolationError, SessionError, UnknownActionError
from evergreen_trio.nodes import NodeLike
from evergreen_trio.serving.metrics import abort_reason, serve_metrics

HANG_GUARD = 60


async def _session(address: str, action: str, node: NodeLike, name: str = "input") -> str:
    try:
        async with connect(address) as session:
            call = await session.run(action, {name: node}, ["output"])
            await call["output"].read_chunks()
        return "OK"
    except SessionAbortedError as aborted:
        return aborted.code.name


async def test_sessions_actions_fragments_aborts_and_limits_are_counted() -> None:
    server = Server(limits=SessionLimits(max_nodes=8))
    register_builtin_actions(server)

    @server.action("BOOM", inputs=["input"], outputs=["output"])
    async def boom(ctx: ActionContext) -> None:
        raise RuntimeError("handler bug")

    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            metrics_port = await nursery.start(serve_metrics, server.metrics.registry, "127.0.0.1", 0)
            address = f"127.0.0.1:{port}"
            assert await _session(address, "ECHO", inner(text("a"), text("bc"))) == "OK"
            assert await _session(address, "ECHO", inner(text("again"))) == "OK"
            assert await _session(address, "NOPE", text("x")) == "UNIMPLEMENTED"
            assert await _session(address, "BOOM", text("x")) == "INTERNAL"
            wide = inner(*(text(str(i)) for i in range(20)))
            assert await _session(address, "ECHO", wide) == "RESOURCE_EXHAUSTED"
            assert await _session(address, "ECHO", text("x"), name="bogus") == "INVALID_ARGUMENT"
            samples = await scrape(f"http://127.0.0.1:{metrics_port}/metrics")
            nursery.cancel_scope.cancel()
    assert value(samples, "evergreen_sessions_started_total") == 6
    assert value(samples, "evergreen_sessions_active") == 0
    assert value(samples, "evergreen_sessions_ended_total", code="OK") == 2
    for code in ("UNIMPLEMENTED", "INTERNAL", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"):
        assert value(samples, "evergreen_sessions_ended_total", code=code) == 1, code
    assert value(samples, "evergreen_action_duration_seconds_count", action="ECHO", code="OK") == 2
    assert value(samples, "evergreen_action_duration_seconds_count", action="BOOM", code="INTERNAL") == 1
    assert value(samples, "evergreen_action_duration_seconds_bucket", action="ECHO", code="OK", le="+Inf") == 2
    # In: 3 + 2 fragments of the OK sessions, then what the refused ones sent. Out: ECHO's wrapper
    # node's child lists and one leaf per input leaf (3 + 2).
    assert value(samples, "evergreen_fragments_total", direction="in") >= 5
    assert value(samples, "evergreen_fragments_total", direction="out") >= 5
    assert value(samples, "evergreen_fragment_bytes_total", direction="in") > len("abcagain")
    assert value(samples, "evergreen_fragment_bytes_total", direction="out") > len("abcagain")
    assert value(samples, "evergreen_session_aborts_total", reason="unknown_action") == 1
    assert value(samples, "evergreen_session_aborts_total", reason="action_failed") == 1
    assert value(samples, "evergreen_session_aborts_total", reason="limit_exceeded") == 1
    assert value(samples, "evergreen_session_aborts_total", reason="protocol_violation") == 1
    assert value(samples, "evergreen_limit_hits_total", limit="max_nodes") == 1


def test_abort_reasons_are_snake_case_class_names() -> None:
    assert abort_reason(ProtocolViolationError("x")) == "protocol_violation"
    assert abort_reason(LimitExceededError("x", limit="max_depth")) == "limit_exceeded"
    assert abort_reason(UnknownActionError("x")) == "unknown_action"
    assert abort_reason(SessionError("x")) == "session"


async def test_serve_metrics_port_after_real_sessions() -> None:
    with trio.fail_after(HANG_GUARD):
        async with serve("--metrics-port", "0", lines=2) as server:
            assert await _session(server.address, "ECHO", inner(text("hello "), text("world"))) == "OK"
            samples = await scrape(server.metrics_url)
            async with httpx.AsyncClient(timeout=10) as client:
                assert (await client.post(server.metrics_url, content=b"x")).status_code == 405
                assert (await client.post(server.metrics_url, content=b"x" * 10_000)).status_code == 413
    assert value(samples, "evergreen_sessions_started_total") == 1
    assert value(samples, "evergreen_sessions_ended_total", code="OK") == 1
    assert value(samples, "evergreen_action_duration_seconds_count", action="ECHO", code="OK") == 1
    assert value(samples, "evergreen_fragments_total", direction="in") >= 2


@given(st.binary(max_size=2048))
def test_the_exporter_survives_any_bytes(garbage: bytes) -> None:
    async def main() -> None:
        server = Server()
        with trio.fail_after(HANG_GUARD):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_metrics, server.metrics.registry, "127.0.0.1", 0)
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(garbage)
                await stream.send_eof()
                while await stream.receive_some(65536):  # an answer (maybe 400), then the server closes
                    pass
                await stream.aclose()
                samples = await scrape(f"http://127.0.0.1:{port}/metrics")
                assert value(samples, "evergreen_sessions_started_total") == 0
                nursery.cancel_scope.cancel()

    trio.run(main)


async def _ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, [], b"ok")


async def test_the_http_server_closes_slow_and_surplus_connections() -> None:
    with trio.fail_after(HANG_GUARD):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(partial(serve_http, _ok, "127.0.0.1", 0, read_timeout=0.5, max_connections=2))
            slow = await trio.open_tcp_stream("127.0.0.1", port)
            await slow.send_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n")  # never finishes its headers
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            await trio.sleep(0.1)
            surplus = await trio.open_tcp_stream("127.0.0.1", port)
            assert await surplus.receive_some(100) == b""  # a third connection: closed at once
            assert await slow.receive_some(100) == b""  # closed after read_timeout
            assert await idle.receive_some(100) == b""
            async with httpx.AsyncClient(timeout=10) as client:  # then it serves again
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
            nursery.cancel_scope.cancel()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback")
async def test_an_ipv6_host_is_announced_in_brackets() -> None:
    """``--host ::1`` announced ``::1:PORT`` and ``http://::1:PORT/metrics``, which no client or URL takes."""
    with trio.fail_after(HANG_GUARD):
        async with serve("--host", "::1", "--metrics-port", "0", lines=2) as server:
            assert server.address.startswith("[::1]:"), server.lines
            assert await _session(server.address, "ECHO", text("v6")) == "OK"
            assert server.metrics_url.startswith("http://[::1]:"), server.lines
            assert value(await scrape(server.metrics_url), "evergreen_sessions_started_total") == 1
