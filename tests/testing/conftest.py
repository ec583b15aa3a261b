"""A server in a child process with small limits, shared by the kit's over-the-wire tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from evergreen_trio.dag import SessionLimits
from evergreen_trio.testing.subprocess_server import ServerProcess, spawn_server
from evergreen_trio.testing.wire import SyncClient

SMALL_LIMITS = SessionLimits(
    max_nodes=400,
    max_buffered_bytes=32768,
    max_fragment_bytes=1024,
    max_depth=40,
    max_concurrent_actions=6,
    max_children_per_fragment=64,
)


@pytest.fixture
def small_limits() -> SessionLimits:
    return SMALL_LIMITS


@pytest.fixture(scope="module")
def small_server() -> Iterator[ServerProcess]:
    with spawn_server(SMALL_LIMITS) as server:
        yield server


@pytest.fixture
def wire_client(small_server: ServerProcess) -> Iterator[SyncClient]:
    with SyncClient(small_server.address, timeout=20) as client:
        yield client
