"""Issue 22, item 6: the metrics port's send deadline and per-client share, over a real socket."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from benchmarks.security_session import SCRAPE, closed_by_server, connect_from, scrape_from
from evergreen_trio.serving.metrics import MAX_SCRAPE_CONNECTIONS_PER_CLIENT, SessionMetrics, serve_metrics


@pytest.fixture
async def metrics_port() -> AsyncIterator[int]:
    async with trio.open_nursery() as nursery:
        port: int = await nursery.start(
            lambda task_status: serve_metrics(SessionMetrics().registry, "127.0.0.1", 0, send_timeout=0.5,
                                              task_status=task_status)
        )
        yield port
        nursery.cancel_scope.cancel()


async def test_one_client_gets_its_share_and_another_client_still_scrapes(metrics_port: int) -> None:
    held = [await connect_from("127.0.0.2", metrics_port) for _ in range(MAX_SCRAPE_CONNECTIONS_PER_CLIENT)]
    one_more = await connect_from("127.0.0.2", metrics_port)
    assert await closed_by_server(one_more) == 0  # closed at accept, nothing sent
    assert (await scrape_from("127.0.0.3", metrics_port)).startswith(b"HTTP/1.1 200")
    for stream in held:
        await stream.aclose()
    with trio.fail_after(10):  # the share is back once its connections close
        while True:
            try:
                assert (await scrape_from("127.0.0.2", metrics_port)).startswith(b"HTTP/1.1 200")
                break
            except (AssertionError, trio.BrokenResourceError, trio.TooSlowError):
                await trio.sleep(0.05)


async def test_a_client_that_never_reads_is_disconnected_at_the_send_deadline(metrics_port: int) -> None:
    stream = await connect_from("127.0.0.2", metrics_port)
    with trio.fail_after(10):
        await stream.send_all(SCRAPE * 5000)  # pipelined; each response is a few KiB, never read
    await trio.sleep(1.5)  # the server's buffers fill, one write waits past the 0.5 s deadline
    assert (await scrape_from("127.0.0.3", metrics_port)).startswith(b"HTTP/1.1 200")
    answered = await closed_by_server(stream)
    assert answered is not None and 0 < answered < 5000
