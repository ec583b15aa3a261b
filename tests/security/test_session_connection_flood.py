"""A flood of connections is accepted and set up cheaply while a legitimate client is served (issue 22
item 4: 1,100 idle connections against ``--max-connections 1000`` stalled a legitimate client 136-364 ms
on the grpclib server, the work of each batch of 100 accepts queued ahead of its every step).

Over real sockets against an in-process server; the stall itself is measured by
``python -m benchmarks.security_session --only "1,100 idle"``.
"""

from __future__ import annotations

import socket

import trio
from h2_frames import parse_frames
from hyperframe.frame import SettingsFrame, WindowUpdateFrame

from benchmarks.security_session import PREFACE, echo_once
from evergreen_trio import Server
from evergreen_trio._grpc.server import LISTEN_BACKLOG
from evergreen_trio.actions import register_builtin_actions
from tests.security.test_session_attacks import nursery_

__all__ = ["nursery_"]  # the fixture, shared with the session attacks

FLOOD = 100
"""Connections opened before the server may accept any (within ``LISTEN_BACKLOG``: none is dropped)."""

SETTINGS = PREFACE + SettingsFrame(0).serialize()





async def test_a_flood_of_connections_is_served_while_a_legitimate_session_is(nursery_: trio.Nursery) -> None:
    """100 connections waiting at once: a legitimate session is served meanwhile, each connection
    gets one SETTINGS frame (one ACK to process, not two) advertising the stream cap and the window,
    and once the flood closes, the server serves on."""
    assert FLOOD <= LISTEN_BACKLOG
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
        with trio.fail_after(30):  # a hang guard
            legit = await echo_once(f"127.0.0.1:{port}")
        assert legit > 0
        for client in clients:
            client.setblocking(False)
        await trio.sleep(0.1)
        first = parse_frames(clients[0].recv(1 << 16))
        settings = [f for f in first if isinstance(f, SettingsFrame) and "ACK" not in f.flags]
        assert len(settings) == 1, first
        assert settings[0].settings[SettingsFrame.MAX_CONCURRENT_STREAMS] == 100
        assert SettingsFrame.INITIAL_WINDOW_SIZE in settings[0].settings
        assert any(isinstance(f, WindowUpdateFrame) and f.stream_id == 0 for f in first), first
    finally:
        for client in clients:
            client.close()
    with trio.fail_after(30):
        await echo_once(f"127.0.0.1:{port}")
