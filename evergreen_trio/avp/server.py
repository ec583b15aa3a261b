"""An AVP agent over HTTP on Trio: our ASGI app under hypercorn's Trio worker (HTTP/1.1 and cleartext HTTP/2).

The same endpoints, headers and answers as the reference's ``create_app`` (see `binding`), plus an
optional bearer token. Each request body is bounded before it is read (``Content-Length``) and while it
is read, and must arrive within ``body_timeout_s``; binary messages are decoded strictly with the
server's `AVPLimits`. A bad request gets its status and one line; the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from evergreen_trio._asgi import BodyTooLargeError, ClientGoneError, Receive, Scope, Send, lifespan, read_body
from evergreen_trio.avp import binding
from evergreen_trio.avp.codec import decode, zstd_bound
from evergreen_trio.avp.errors import AVPError, AVPRequestError
from evergreen_trio.avp.fallback import MAX_TEXT_MESSAGE_BYTES, JSONMessage, text_from_json
from evergreen_trio.avp.handshake import (
    DEFAULT_SESSION_TTL_S,
    MAX_HELLO_BYTES,
    HelloMessage,
    ModelIdentity,
    hello_from_json,
)
from evergreen_trio.avp.handshake import resolve_mode as resolve
from evergreen_trio.avp.message import DEFAULT_LIMITS, HEADER_SIZE, AVPLimits, AVPMessage

log = logging.getLogger(__name__)

MessageHandler = Callable[[AVPMessage], Awaitable[dict[str, Any]]]
TextHandler = Callable[[JSONMessage], Awaitable[dict[str, Any]]]


async def describe_message(message: AVPMessage) -> dict[str, Any]:
    """The built-in receiver: `binding.receiver_answer`."""
    return binding.receiver_answer(message)


async def acknowledge_text(message: JSONMessage) -> dict[str, Any]:
    """The built-in text receiver: the session id and the content's length in characters."""
    return {"session_id": message.session_id, "chars": len(message.content)}


@dataclass(frozen=True)
class AVPServerOptions:
    """What an AVP HTTP server accepts. ``hello``: this agent's HelloMessage (None: echo the caller's)."""

    token: bytes | None = field(default=None, repr=False)
    hello: HelloMessage | None = None
    limits: AVPLimits = DEFAULT_LIMITS
    maps: frozenset[str] = frozenset()
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    body_timeout_s: float = 30.0
    """A request body must be in within this many seconds (else 408)."""
    keep_alive_timeout_s: float = 5.0
    max_concurrent_streams: int = 100
    """HTTP/2 streams per connection."""
    max_concurrent_requests: int = 256
    """Requests being handled at once, all connections together; past it, 503 at once."""

    @property
    def max_binary_bytes(self) -> int:
        """The largest message the limits allow: header, metadata and a (possibly compressed) tensor."""
        return HEADER_SIZE + self.limits.max_metadata_bytes + zstd_bound(self.limits.max_payload_bytes)


class AVPApp:
    """The ASGI app: routes, token, bounded bodies, strict decoding, then the handlers."""

    def __init__(
        self,
        options: AVPServerOptions | None = None,
        *,
        on_message: MessageHandler = describe_message,
        on_text: TextHandler | None = acknowledge_text,
    ) -> None:
        self.options = options or AVPServerOptions()
        self.on_message = on_message
        self.on_text = on_text
        self._active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers: Mapping[bytes, bytes] = dict(scope["headers"])
        agent = headers.get(b"avp-agent-id", b"-").decode("latin-1")[:100]
        try:
            if self._active >= self.options.max_concurrent_requests:
                raise AVPRequestError(
                    503, f"busy: {self._active} requests in progress (max_concurrent_requests); retry later"
                )
            self._active += 1
            try:
                status, document = await self._route(path, method, headers, receive)
            finally:
                self._active -= 1
        except AVPRequestError as refusal:
            log.info("avp.http.refused path=%s agent=%s status=%d reason=%s", path[:100], agent, refusal.status,
                     refusal.message)
            status, document = refusal.status, {"success": False, "message": refusal.message}
        except ClientGoneError:
            log.info("avp.http.abort path=%s agent=%s reason=client-gone-before-body", path[:100], agent)
            return
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", binding.JSON_CONTENT_TYPE.encode()),
            (b"avp-version", binding.AVP_VERSION_HEADER.encode()),
        ]})
        await send({"type": "http.response.body", "body": binding.answer(document)})

    async def _route(
        self, path: str, method: str, headers: Mapping[bytes, bytes], receive: Receive
    ) -> tuple[int, dict[str, Any]]:
        refusal = binding.check_route(path, method)
        if refusal is None and path != binding.HEALTH_PATH:
            refusal = binding.check_token(headers.get(b"authorization"), self.options.token)
        if refusal is not None:
            raise refusal
        if path == binding.HEALTH_PATH:
            return 200, {"status": "ok"}
        if path == binding.TRANSMIT_PATH:
            body = await self._body(headers, receive, self.options.max_binary_bytes)
            try:
                message = decode(body, limits=self.options.limits)
            except AVPError as error:
                raise AVPRequestError(400, f"bad AVP message: {error}") from None
            return 200, {"success": True, **await self.on_message(message)}
        if path == binding.TEXT_PATH:
            if self.on_text is None:
                raise AVPRequestError(501, "Text handler not configured")
            body = await self._body(headers, receive, MAX_TEXT_MESSAGE_BYTES)
            try:
                text = text_from_json(body)
            except AVPError as error:
                raise AVPRequestError(400, f"Invalid message: {error}") from None
            return 200, {"success": True, **await self.on_text(text)}
        body = await self._body(headers, receive, MAX_HELLO_BYTES)
        try:
            hello = hello_from_json(body)
        except AVPError as error:
            raise AVPRequestError(400, f"Invalid handshake: {error}") from None
        mine = self.options.hello
        # A hello without an identity is accepted, as the reference does; it resolves to JSON.
        remote = hello.identity or ModelIdentity()
        local = (mine.identity if mine is not None else None) or remote
        resolution = resolve(local, remote, maps=self.options.maps, ttl_s=self.options.session_ttl_s)
        return 200, {"success": True, **binding.handshake_answer(hello, mine, resolution)}

    async def _body(self, headers: Mapping[bytes, bytes], receive: Receive, limit: int) -> bytes:
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            got = declared[:20].decode("latin-1")
            raise AVPRequestError(413, f"request body: expected at most {limit} bytes, got Content-Length {got}")
        with trio.move_on_after(self.options.body_timeout_s):
            try:
                return await read_body(receive, limit)
            except BodyTooLargeError:
                raise AVPRequestError(413, f"request body: expected at most {limit} bytes, got more") from None
        seconds = self.options.body_timeout_s
        raise AVPRequestError(408, f"request body: expected it within {seconds}s, got part of it by then")


async def serve_avp(
    app: AVPApp, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` on ``host:port`` (0: any free port) until cancelled; ``task_status`` gets the port."""
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.errorlog = log
    config.accesslog = None
    config.keep_alive_timeout = app.options.keep_alive_timeout_s
    config.h2_max_concurrent_streams = app.options.max_concurrent_streams
    config.graceful_timeout = 1.0
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(partial(serve, app, config))  # type: ignore[arg-type]
        bound = int(binds[0].rsplit(":", 1)[1])
        log.info("avp.http.listening host=%s port=%d token=%s", host, bound, app.options.token is not None)
        task_status.started(bound)
