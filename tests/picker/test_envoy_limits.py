"""Envoy's downstream connection limit, which the gateway config sets (crossed with a real Envoy)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from picker_fakes import free_port, start_envoy, stop_envoy

from evergreen_trio.picker.envoy_config import gateway_config

pytestmark = pytest.mark.envoy


def _request(sock: socket.socket) -> bytes:
    """Send a request (no picker runs, so an answer is an error status) and read until close or reply."""
    sock.settimeout(10)
    sock.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    return sock.recv(65536)


def test_connections_past_the_limit_are_refused(tmp_path: Path) -> None:
    gateway = start_envoy(tmp_path, free_port(), ["127.0.0.1:1"], max_downstream_connections=2)
    held = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(2)]
    try:
        assert all(_request(sock).startswith(b"HTTP/1.1 ") for sock in held)
        time.sleep(0.2)  # lets Envoy's overload manager count them
        with socket.create_connection(("127.0.0.1", gateway.port)) as extra:
            try:
                refused = _request(extra) == b""
            except ConnectionResetError:
                refused = True
        assert refused
    finally:
        for sock in held:
            sock.close()
        stop_envoy(gateway)


def test_the_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_downstream_connections"):
        gateway_config("127.0.0.1:9002", 8080, admin_port=9901, max_downstream_connections=0)
