"""pytest plugin (entry point ``evergreen_trio``): an in-process Evergreen server and a connected client.

Fixtures run under pytest-trio: ``evergreen_server`` starts a :class:`~evergreen_trio.Server`
with the built-in actions on a free loopback port and yields its ``host:port``;
``evergreen_session`` yields a :class:`~evergreen_trio.ClientSession` connected to it.
For synchronous tests (hypothesis state machines), ``evergreen_server_process`` runs the
server in a child process and ``evergreen_wire_client`` is a grpcio client of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import pytest
import trio

from evergreen_trio.actions import register_builtin_actions
from evergreen_trio.client import ClientSession, connect
from evergreen_trio.server import Server
from evergreen_trio.testing.subprocess_server import ServerProcess, spawn_server

if TYPE_CHECKING:
    from evergreen_trio.testing.wire import SyncClient


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


@pytest.fixture
def evergreen_server_process() -> Iterator[ServerProcess]:
    """Our server with the built-in actions in a child process (real process separation: it
    can be killed, and its memory is its own); ``.address`` is its ``host:port``."""
    with spawn_server() as server:
        yield server


@pytest.fixture
def evergreen_wire_client(evergreen_server_process: ServerProcess) -> Iterator[SyncClient]:
    """A synchronous grpcio client of ``evergreen_server_process``, for hypothesis properties
    and state machines (``evergreen_trio.testing.machine.machine_for``)."""
    from evergreen_trio.testing.wire import SyncClient

    with SyncClient(evergreen_server_process.address) as client:
        yield client
