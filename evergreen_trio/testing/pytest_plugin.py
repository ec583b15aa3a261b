"""pytest plugin (entry point ``evergreen_trio``): an in-process Evergreen server and a connected client.

Fixtures run under pytest-trio: ``evergreen_server`` starts a :class:`~evergreen_trio.Server`
with the built-in actions on a free loopback port and yields its ``host:port``;
``evergreen_session`` yields a :class:`~evergreen_trio.ClientSession` connected to it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.client import ClientSession, connect
from evergreen_trio.server import Server


@pytest.fixture
async def evergreen_server(nursery: trio.Nursery) -> AsyncIterator[str]:
    server = Server()
    register_builtin_actions(server)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    yield f"127.0.0.1:{port}"


@pytest.fixture
async def evergreen_session(evergreen_server: str) -> AsyncIterator[ClientSession]:
    async with connect(evergreen_server) as session:
        yield session
