"""``write_now``: the gRPC writers' first try, which takes what the socket accepts without waiting."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from evergreen_trio._grpc.sockets import send, write_now


async def test_it_writes_what_fits_and_never_waits() -> None:
    left, right = trio.socket.socketpair()
    stream = trio.SocketStream(left)
    with right:
        sent = write_now(stream, b"x" * 50_000_000)
        assert 0 < sent < 50_000_000  # the socket buffer's worth
        assert write_now(stream, b"y" * 1_000) == 0  # full: nothing, and no wait
        await stream.aclose()


async def test_a_closed_peer_is_a_broken_resource_as_send_all_says() -> None:
    left, right = trio.socket.socketpair()
    stream = trio.SocketStream(left)
    right.close()
    with pytest.raises(trio.BrokenResourceError):
        write_now(stream, b"z")
    await stream.aclose()


def test_a_stream_other_than_plain_tcp_is_left_to_send_all() -> None:
    assert write_now(trio.testing.MemorySendStream(), b"tls records are the TLS stream's to write") == 0


async def test_send_waits_for_the_rest_within_its_timeout() -> None:
    left, right = trio.socket.socketpair()
    stream = trio.SocketStream(left)
    with right:
        await send(stream, b"small")  # taken at once
        assert await right.recv(16) == b"small"
        with pytest.raises(trio.TooSlowError):
            await send(stream, b"x" * 50_000_000, timeout=0.2)  # a peer that does not read
        await stream.aclose()
