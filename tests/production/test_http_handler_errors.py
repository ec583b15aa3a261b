"""The exporters' HTTP server (``evergreen_trio._http.serve_http``) when its handler fails, over a real socket.

A handler that raises, or a response stream that raises midway, ends that connection only: the
server keeps serving new connections and the connections already open.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import pytest
import trio

from benchmarks.security_http import KeepAlive, exchange, status_line
from evergreen_trio._http import HttpRequest, HttpResponse, serve_http


async def _broken_stream() -> AsyncIterator[bytes]:
    yield b"first part"
    raise RuntimeError("the source died")


async def _handler(request: HttpRequest) -> HttpResponse:
    if request.target == "/boom":
        raise RuntimeError("the handler's bug\nwith a second line")
    if request.target == "/midway":
        return HttpResponse(200, stream=_broken_stream())
    return HttpResponse(200, body=b"fine")


async def test_a_raising_handler_answers_500_and_the_server_goes_on(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    port = await nursery.start(serve_http, _handler, "127.0.0.1", 0)
    kept = await KeepAlive.open(port)
    assert await kept.request("GET", "/") == (200, b"fine")
    with caplog.at_level(logging.ERROR, logger="evergreen_trio._http"):
        reply, closed = await exchange(port, b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status_line(reply).split()[0] == "500" and closed
    [line] = [r.getMessage() for r in caplog.records if "http.handler_error" in r.getMessage()]
    assert "RuntimeError" in line and "\n" not in line
    assert await kept.request("GET", "/") == (200, b"fine")  # a connection opened before
    fresh = await KeepAlive.open(port)
    assert await fresh.request("GET", "/") == (200, b"fine")  # and a new one


async def test_a_stream_that_raises_midway_closes_its_connection_only(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    port = await nursery.start(serve_http, _handler, "127.0.0.1", 0)
    with caplog.at_level(logging.ERROR, logger="evergreen_trio._http"):
        reply, closed = await exchange(port, b"GET /midway HTTP/1.1\r\nhost: x\r\n\r\n")
    assert status_line(reply).split()[0] == "200" and b"first part" in reply and closed
    assert not reply.endswith(b"0\r\n\r\n")  # the chunked body was never ended as if whole
    assert any("http.stream_error" in r.getMessage() for r in caplog.records)
    fresh = await KeepAlive.open(port)
    assert await fresh.request("GET", "/") == (200, b"fine")
