"""A write that takes what the kernel accepts at once, for the gRPC connections' writers.

``trio.SocketStream.send_all`` yields to the scheduler after every send, even one the kernel took whole,
and a timer around it (the send timeout) is a deadline to register and remove: two of the costs per
message that a session pays on each side. A small gRPC write almost always fits the socket buffer, so
the writers try this first and wait (with their timeout) only for what is left.
"""

from __future__ import annotations

import math
import os
import sys

import trio


def write_now(stream: trio.abc.Stream, data: bytes | bytearray | memoryview) -> int:
    """Write to a plain TCP ``stream`` what its socket takes now, without waiting or yielding; the number
    of bytes written (0 for a TLS stream, whose records only it may write, or on Windows). Raises
    ``trio.BrokenResourceError`` when the connection is gone, as ``send_all`` does."""
    if type(stream) is not trio.SocketStream or sys.platform == "win32":
        return 0
    try:
        return os.write(stream.socket.fileno(), data)
    except BlockingIOError:
        return 0
    except OSError as error:
        raise trio.BrokenResourceError(f"socket connection broken: {error}") from error


async def send(stream: trio.abc.Stream, data: bytes, *, timeout: float = math.inf) -> None:  # noqa: ASYNC109
    """Send all of ``data``: what the socket takes at once without yielding, the rest with ``send_all``
    within ``timeout`` seconds (``trio.TooSlowError`` past it). The timer is set only when there is a wait
    (a caller's ``fail_after`` would cost a deadline on every send)."""
    sent = write_now(stream, data)
    if sent < len(data):  # the socket is full: wait
        with trio.fail_after(timeout):
            await stream.send_all(memoryview(data)[sent:])
