"""A flood of connections is accepted a few per scheduling pass, each set up at once and cheaply
(issue 22 item 4: 1,100 idle connections against ``--max-connections 1000`` stalled a legitimate
client 136-364 ms, the work of each batch of 100 accepts queued ahead of its every step).

Over real sockets against an in-process server; the stall itself is measured by
``python -m benchmarks.security_session --only "1,100 idle"``.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
import trio
from hyperframe.frame import Frame, SettingsFrame, WindowUpdateFrame

from benchmarks.security_session import PREFACE, echo_once
from evergreen_trio import Server
from evergreen_trio._grpc.bridge import ACCEPTS_PER_PASS, LISTEN_BACKLOG, _GuardedServer
from evergreen_trio.actions import register_builtin_actions
from tests.security.test_session_attacks import nursery_
from tests.security.test_session_turns import _Passes

__all__ = ["nursery_"]  # the fixture, shared with the session attacks

FLOOD = 100
"""Connections opened before the server may accept any (within ``LISTEN_BACKLOG``: none is dropped)."""

SETTINGS = PREFACE + SettingsFrame(0).serialize()


@pytest.fixture
async def passes() -> AsyncIterator[_Passes]:
    counter = _Passes()
    trio.lowlevel.add_instrument(counter)
    yield counter
    trio.lowlevel.remove_instrument(counter)


def _frames(data: bytes) -> list[Frame]:
    frames = []
    while len(data) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        frames.append(frame)
        data = data[9 + length :]
    return frames


async def test_a_flood_of_connections_is_accepted_a_few_per_pass(
    nursery_: trio.Nursery, passes: _Passes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 connections waiting at once are admitted at most ``ACCEPTS_PER_PASS`` a pass (asyncio took
    up to 100 and queued about 500 callbacks for them ahead of everyone), a legitimate session is
    served meanwhile, each connection gets one SETTINGS frame (one ACK to process, not two), and the
    closed ones are forgotten."""
    assert FLOOD <= LISTEN_BACKLOG
    admitted: list[int] = []
    servers: list[_GuardedServer] = []
    all_admitted, all_closed = trio.Event(), trio.Event()
    admit, close = _GuardedServer.connection_admitted, _GuardedServer.connection_closed

    def counted(self: _GuardedServer) -> None:
        admitted.append(passes.count)
        if not servers:
            servers.append(self)
        if len(admitted) == FLOOD + 2:  # and the two probes' connections
            all_admitted.set()
        admit(self)

    def closed(self: _GuardedServer) -> None:
        close(self)
        if all_admitted.is_set() and not self.open_connections:
            all_closed.set()

    monkeypatch.setattr(_GuardedServer, "connection_admitted", counted)
    monkeypatch.setattr(_GuardedServer, "connection_closed", closed)
    server = Server(first_message_timeout=30, idle_timeout=30)
    register_builtin_actions(server)
    port = await nursery_.start(server.serve, "127.0.0.1", 0)
    await echo_once(f"127.0.0.1:{port}")
    clients = []
    try:
        for _ in range(FLOOD):  # the kernel completes each handshake; none is accepted until we yield
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(SETTINGS)
            clients.append(client)
        start = passes.count
        with trio.fail_after(30):  # a hang guard
            legit = await echo_once(f"127.0.0.1:{port}")
            await all_admitted.wait()
        per_pass = [admitted.count(n) for n in range(start, passes.count + 1)]
        assert max(per_pass) <= ACCEPTS_PER_PASS, per_pass
        assert legit > 0
        for client in clients:
            client.setblocking(False)
        await trio.sleep(0.1)
        first = _frames(clients[0].recv(1 << 16))
        settings = [f for f in first if isinstance(f, SettingsFrame) and "ACK" not in f.flags]
        assert len(settings) == 1, first
        assert settings[0].settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 100
        assert SettingsFrame.INITIAL_WINDOW_SIZE in settings[0].settings
        assert any(isinstance(f, WindowUpdateFrame) and f.stream_id == 0 for f in first), first
    finally:
        for client in clients:
            client.close()
    guarded = servers[0]
    with trio.fail_after(30):
        await all_closed.wait()
        await echo_once(f"127.0.0.1:{port}")  # a new connection collects the closed ones
    assert len(guarded._handlers) <= 2, len(guarded._handlers)  # the last probe's, maybe not yet closed
