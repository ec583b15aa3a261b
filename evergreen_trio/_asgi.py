"""What our ASGI apps (the AVP agent server, the model-server simulator) share: the ASGI callable
types, the lifespan handshake and a bounded read of a request body. hypercorn's Trio worker serves them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from evergreen_trio.errors import EvergreenTrioError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGoneError(EvergreenTrioError):
    """The client hung up before its request body was in."""


class BodyTooLargeError(EvergreenTrioError):
    """A request body went past ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body larger than {limit} bytes")
        self.limit = limit


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer the server's lifespan messages until it shuts down (nothing to set up or tear down)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body, read as it arrives.

    Raises :class:`BodyTooLargeError` as soon as more than ``limit`` bytes came, and
    :class:`ClientGoneError` when the client disconnects first. The caller bounds the wait.
    """
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLargeError(limit)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
