"""A server and a session in a few lines, for tests that cannot use the pytest fixtures (each
hypothesis ``@given`` example runs in its own ``trio.run``).

>>> async def test_upper(evergreen_app):  # doctest: +SKIP
...     async with open_session(evergreen_app) as session:
...         call = await session.run("UPPER", {"input": text("hi")}, ["output"])
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from evergreen_trio.client import ClientSession, connect
from evergreen_trio.serving.server import Server


@asynccontextmanager
async def serving(server: Server) -> AsyncIterator[str]:
    """Serve ``server`` on a free loopback port for the block; yields its ``host:port``. At exit the
    server stops (sessions still open end with UNAVAILABLE)."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield f"127.0.0.1:{port}"
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_session(server: Server, *, timeout: float | None = 60.0) -> AsyncIterator[ClientSession]:  # noqa: ASYNC109
    """Serve ``server`` (:func:`serving`) and yield a session connected to it (``timeout`` as ``connect``'s)."""
    async with serving(server) as address, connect(address, timeout=timeout) as session:
        yield session


__all__ = [
    "open_session",
    "serving",
]
