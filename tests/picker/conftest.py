"""Fixtures for the picker tests: fake model servers per test, one real Envoy per module and mode."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

# The whole folder needs the picker extra: without it, skip it naming the extra (not a collection error).
pytest.importorskip("evergreen_trio.picker", exc_type=ImportError)

from picker_fakes import FakeModelServer, Gateway, free_port, start_envoy, stop_envoy

# Each fake model server on its own loopback address, as pods have their own IPs: Envoy's subset
# hint names endpoints by address (llm-d-router matches it by IP alone).
BACKEND_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@dataclass(frozen=True)
class Ports:
    """Ports fixed for a module, so its Envoy's static config matches every test's picker."""

    picker: int
    backends: tuple[int, ...]

    @property
    def pool(self) -> list[str]:
        return [f"{host}:{p}" for host, p in zip(BACKEND_HOSTS, self.backends, strict=True)]


@pytest.fixture(scope="module")
def ports() -> Ports:
    return Ports(free_port(), tuple(free_port() for _ in range(3)))


@pytest.fixture(scope="module")
def envoy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("envoy")


@pytest.fixture(scope="module")
def duplex_gateway(envoy_dir: Path, ports: Ports) -> Iterator[Gateway]:
    gateway = start_envoy(envoy_dir, ports.picker, ports.pool)
    yield gateway
    stop_envoy(gateway)


@pytest.fixture(scope="module")
def buffered_gateway(envoy_dir: Path, ports: Ports) -> Iterator[Gateway]:
    gateway = start_envoy(envoy_dir, ports.picker, ports.pool,
                          request_body_mode="BUFFERED", response_body_mode="BUFFERED")
    yield gateway
    stop_envoy(gateway)


@pytest.fixture
async def backends(nursery: trio.Nursery, ports: Ports) -> list[FakeModelServer]:
    servers = [FakeModelServer(port, host=host) for host, port in zip(BACKEND_HOSTS, ports.backends, strict=True)]
    for server in servers:
        await nursery.start(server.serve)
    return servers
