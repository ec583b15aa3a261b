"""The HTTP/1.1 server under ``avp serve`` and ``sim`` fed arbitrary bytes over a real socket: it answers
HTTP/1.1 or closes, and keeps serving a legitimate client (issue 22, item 1)."""

from __future__ import annotations

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.security_http import KeepAlive, exchange, h2c_headers
from evergreen_trio._asgi import HttpServerLimits
from evergreen_trio.avp.server import AVPApp, AVPServerOptions, serve_avp

PREFIXES = [
    b"",
    b"GET /health HTTP/1.1\r\n",
    b"POST /avp/v2/handshake HTTP/1.1\r\nhost: x\r\ncontent-length: 7\r\n",
    b"POST /avp/v2/transmit HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n",
    h2c_headers(),
]
QUICK = AVPServerOptions(body_timeout_s=0.3, http=HttpServerLimits(header_timeout_s=0.3, write_timeout_s=1.0))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PREFIXES), st.binary(max_size=300))
async def test_any_bytes_get_http11_or_a_close_and_the_server_serves_on(prefix: bytes, data: bytes) -> None:
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_avp, AVPApp(QUICK), "127.0.0.1", 0)
        reply, _ = await exchange(port, prefix + data, 2.0)
        assert reply == b"" or reply.startswith(b"HTTP/1.1 "), reply[:80]
        client = await KeepAlive.open(port)
        with trio.fail_after(5):
            assert await client.request("GET", "/health") == (200, b'{"status":"ok"}')
        await client.aclose()
        nursery.cancel_scope.cancel()
