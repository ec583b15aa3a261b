"""The scrapers' keep-alive GET client against the picker's own h11 server (a real HTTP peer)."""

from __future__ import annotations

from functools import partial

import pytest
import trio

from evergreen_trio._http import HttpGetError, HttpRequest, HttpResponse, KeepAliveGetter, serve_http


async def sized(request: HttpRequest) -> HttpResponse:
    """GET /n answers n bytes (204 for none)."""
    size = int(request.target.lstrip("/"))
    return HttpResponse(200 if size else 204, [("content-type", "text/plain")], b"x" * size)


async def test_keeps_one_connection_and_reports_status_and_body(nursery: trio.Nursery) -> None:
    port = await nursery.start(partial(serve_http, sized, "127.0.0.1", 0))
    getter = KeepAliveGetter("127.0.0.1", port, max_body=1000)
    assert await getter.get("/5") == (200, b"xxxxx")
    stream = getter._stream
    assert await getter.get("/0") == (204, b"")
    assert await getter.get("/700") == (200, b"x" * 700)
    assert getter._stream is stream  # kept alive
    with pytest.raises(HttpGetError, match="at most 1000 bytes"):
        await getter.get("/1001")
    assert getter._stream is None  # dropped after an error, reopened on the next GET
    assert await getter.get("/3") == (200, b"xxx")
    await getter.aclose()


async def test_refused_connection_is_a_get_error() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    getter = KeepAliveGetter("127.0.0.1", port, max_body=10)
    with pytest.raises(HttpGetError, match=f"GET http://127.0.0.1:{port}/1"):
        await getter.get("/1")
