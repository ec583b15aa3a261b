"""An AVP agent over HTTP on Trio: our ASGI app under our HTTP/1.1 server (`evergreen_trio._asgi`).

The same endpoints, headers and answers as the reference's ``create_app`` (see `binding`), plus an
optional bearer token (fixed, or the lines of a :class:`~evergreen_trio.serving.auth.TokenFile`). Each request
body is bounded before it is read (``Content-Length``) and while it is read, and must arrive within
``body_timeout_s``. A request takes one of ``max_concurrent_requests`` slots (at most
``max_requests_per_peer`` per client address) from its first body byte, so clients that send headers
and no body hold a connection only; ``/health`` takes none. Request bodies in flight, with what
compressed ones inflate to, are bounded by ``max_inflight_body_bytes``, and large or compressed
messages are decoded on at most ``decode_threads`` worker threads, off the event loop. Binary
messages are decoded strictly with the server's `AVPLimits`. A bad request gets its status and one
line (the peer's fields escaped); the server keeps serving.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio

from evergreen_trio._asgi import (
    BodyTooLargeError,
    ClientGoneError,
    HttpServerLimits,
    Receive,
    Scope,
    Send,
    lifespan,
    serve_asgi,
)
from evergreen_trio._logsafe import peer_text
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
from evergreen_trio.avp.message import DEFAULT_LIMITS, FLAG_COMPRESSED, HEADER_SIZE, AVPLimits, AVPMessage
from evergreen_trio.errors import ConfigurationError
from evergreen_trio.serving.auth import TokenFile

log = logging.getLogger(__name__)

MessageHandler = Callable[[AVPMessage], Awaitable[dict[str, Any]]]
TextHandler = Callable[[JSONMessage], Awaitable[dict[str, Any]]]


async def describe_message(message: AVPMessage) -> dict[str, Any]:
    """The built-in receiver: `binding.receiver_answer`; a payload it cannot shape (a shapeless one that
    is not a whole number of items, which decoding accepts as the reference does) is a 400."""
    try:
        return binding.receiver_answer(message)
    except AVPError as error:
        raise AVPRequestError(400, f"bad AVP message: {error}") from None


async def acknowledge_text(message: JSONMessage) -> dict[str, Any]:
    """The built-in text receiver: the session id and the content's length in characters."""
    return {"session_id": message.session_id, "chars": len(message.content)}


@dataclass(frozen=True)
class AVPServerOptions:
    """What an AVP HTTP server accepts. ``hello``: this agent's HelloMessage (None: echo the caller's).

    ``token``: one accepted bearer token; ``token_file``: the tokens of a file, re-read when it changes.
    """

    token: bytes | None = field(default=None, repr=False)
    token_file: TokenFile | None = None
    hello: HelloMessage | None = None
    limits: AVPLimits = DEFAULT_LIMITS
    maps: frozenset[str] = frozenset()
    session_ttl_s: float = DEFAULT_SESSION_TTL_S
    body_timeout_s: float = 30.0
    """A request body must be in within this many seconds of its headers (else 408)."""
    max_concurrent_requests: int = 256
    """Requests past their first body byte at once, all clients together; past it, 503 at once."""
    max_requests_per_peer: int = 64
    """Of those, from one client address; past it, 503 at once."""
    max_inflight_body_bytes: int = 256 * 1024 * 1024
    """Request body bytes received and held at once, all requests together, with what compressed
    tensors inflate to (exceeded by at most ``decode_threads`` messages being inflated); past it, 503."""
    decode_threads: int = 1
    """Worker threads decoding messages that are compressed or larger than ``decode_inline_bytes``."""
    decode_inline_bytes: int = 1024 * 1024
    """Uncompressed messages up to this size are decoded on the event loop (cheaper than a thread hop)."""
    http: HttpServerLimits = field(default_factory=HttpServerLimits)
    """Connections, header size and the header, write and keep-alive deadlines of the HTTP server."""

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_requests_per_peer", "max_inflight_body_bytes",
                     "decode_threads", "decode_inline_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise AVPServerOptionsError(f"AVPServerOptions.{name}: expected an int >= 1, got {value!r}")
        if not isinstance(self.body_timeout_s, int | float) or not self.body_timeout_s > 0:
            raise AVPServerOptionsError(f"AVPServerOptions.body_timeout_s: expected a number > 0, "
                                        f"got {self.body_timeout_s!r}")
        if self.token is not None and self.token_file is not None:
            raise AVPServerOptionsError("AVPServerOptions: expected token or token_file, got both")

    @property
    def max_binary_bytes(self) -> int:
        """The largest message the limits allow: header, metadata and a (possibly compressed) tensor."""
        return HEADER_SIZE + self.limits.max_metadata_bytes + zstd_bound(self.limits.max_payload_bytes)


class AVPServerOptionsError(ConfigurationError):
    """An :class:`AVPServerOptions` combination that cannot work (the message names it)."""


class _Budget:
    """Slots and body bytes in use, in total and per client address."""

    def __init__(self, options: AVPServerOptions) -> None:
        self.options = options
        self.requests = 0
        self.per_peer: dict[str, int] = {}
        self.body_bytes = 0

    def take_slot(self, peer: str) -> None:
        """Count a request of ``peer``; raises the 503 when a cap is reached."""
        if self.requests >= self.options.max_concurrent_requests:
            raise AVPRequestError(
                503, f"busy: {self.requests} requests in progress (max_concurrent_requests); retry later")
        if self.per_peer.get(peer, 0) >= self.options.max_requests_per_peer:
            raise AVPRequestError(
                503, f"busy: {self.per_peer[peer]} requests in progress from {peer} (max_requests_per_peer)")
        self.requests += 1
        self.per_peer[peer] = self.per_peer.get(peer, 0) + 1

    def give_slot(self, peer: str) -> None:
        """Undo one :meth:`take_slot`."""
        self.requests -= 1
        self.per_peer[peer] -= 1
        if not self.per_peer[peer]:
            del self.per_peer[peer]

    def charge(self, held: list[int], size: int) -> None:
        """Count ``size`` more bytes of one request (its running total in ``held[0]``); 503 past the cap."""
        if self.body_bytes + size > self.options.max_inflight_body_bytes:
            raise AVPRequestError(503, f"busy: {self.body_bytes} bytes of requests in memory "
                                       f"(max_inflight_body_bytes); retry later")
        self.body_bytes += size
        held[0] += size


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
        self._budget = _Budget(self.options)
        self._decoders = trio.CapacityLimiter(self.options.decode_threads)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        headers: Mapping[bytes, bytes] = dict(scope["headers"])
        peer = str((scope.get("client") or ("-",))[0])
        agent = peer_text(headers.get(b"avp-agent-id", b"-"), 100)
        try:
            status, document = await self._route(path, method, headers, receive, peer)
        except AVPRequestError as refusal:
            log.info("avp.http.refused peer=%s path=%s agent=%s status=%d reason=%s", peer, peer_text(path, 100),
                     agent, refusal.status, peer_text(refusal.message))
            status, document = refusal.status, {"success": False, "message": refusal.message}
        except ClientGoneError:
            log.info("avp.http.abort peer=%s path=%s agent=%s reason=client-gone-before-body", peer,
                     peer_text(path, 100), agent)
            return
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", binding.JSON_CONTENT_TYPE.encode()),
            (b"avp-version", binding.AVP_VERSION_HEADER.encode()),
        ]})
        await send({"type": "http.response.body", "body": binding.answer(document)})

    async def _route(
        self, path: str, method: str, headers: Mapping[bytes, bytes], receive: Receive, peer: str
    ) -> tuple[int, dict[str, Any]]:
        refusal = binding.check_route(path, method)
        if refusal is None and path != binding.HEALTH_PATH:
            refusal = binding.check_token(headers.get(b"authorization"), self.options.token, self.options.token_file)
        if refusal is not None:
            raise refusal
        if path == binding.HEALTH_PATH:
            return 200, {"status": "ok"}
        if path == binding.TRANSMIT_PATH:
            async with self._request(headers, receive, self.options.max_binary_bytes, peer) as (body, held):
                message = await self._decode(body, held)
                return 200, {"success": True, **await self.on_message(message)}
        if path == binding.TEXT_PATH:
            if self.on_text is None:
                raise AVPRequestError(501, "Text handler not configured")
            async with self._request(headers, receive, MAX_TEXT_MESSAGE_BYTES, peer) as (body, _):
                try:
                    text = text_from_json(body)
                except AVPError as error:
                    raise AVPRequestError(400, f"Invalid message: {error}") from None
                return 200, {"success": True, **await self.on_text(text)}
        async with self._request(headers, receive, MAX_HELLO_BYTES, peer) as (body, _):
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

    async def _decode(self, body: bytes, held: list[int]) -> AVPMessage:
        """The strictly decoded message; inflating or checking a large one runs on a worker thread."""
        compressed = len(body) >= HEADER_SIZE and body[3] & FLAG_COMPRESSED
        try:
            if not compressed and len(body) <= self.options.decode_inline_bytes:
                return decode(body, limits=self.options.limits)
            message = await trio.to_thread.run_sync(
                partial(decode, body, limits=self.options.limits), limiter=self._decoders)
        except AVPError as error:
            raise AVPRequestError(400, f"bad AVP message: {error}") from None
        if compressed:
            self._budget.charge(held, len(message.payload))
        return message

    @asynccontextmanager
    async def _request(
        self, headers: Mapping[bytes, bytes], receive: Receive, limit: int, peer: str
    ) -> AsyncIterator[tuple[bytes, list[int]]]:
        """The body, read within ``body_timeout_s``, with a slot held from its first byte until the
        block ends, and its bytes (``held[0]``, grown by :meth:`_decode`) counted until then."""
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            got = declared[:20].decode("latin-1")
            raise AVPRequestError(413, f"request body: expected at most {limit} bytes, got Content-Length {got}")
        budget = self._budget
        held = [0]
        slot = False
        body: bytes | None = None
        try:
            with trio.move_on_after(self.options.body_timeout_s):
                first = await receive()  # a client that sends headers and no body holds no slot
                if first["type"] == "http.disconnect":
                    raise ClientGoneError
                budget.take_slot(peer)
                slot = True
                chunks = [first.get("body", b"")]
                more = first.get("more_body", False)
                size = len(chunks[0])
                budget.charge(held, size)
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise ClientGoneError
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise BodyTooLargeError(limit)
                    budget.charge(held, len(chunk))
                    chunks.append(chunk)
                    more = message.get("more_body", False)
                if size > limit:
                    raise BodyTooLargeError(limit)
                body = b"".join(chunks)
                del chunks
            if body is None:
                seconds = self.options.body_timeout_s
                raise AVPRequestError(408, f"request body: expected it within {seconds}s, got part of it by then")
            yield body, held
        except BodyTooLargeError:
            raise AVPRequestError(413, f"request body: expected at most {limit} bytes, got more") from None
        finally:
            budget.body_bytes -= held[0]
            if slot:
                budget.give_slot(peer)


async def serve_avp(
    app: AVPApp, host: str = "127.0.0.1", port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve ``app`` on ``host:port`` (0: any free port) until cancelled; ``task_status`` gets the port."""
    async with trio.open_nursery() as nursery:
        bound: int = await nursery.start(partial(serve_asgi, app, host, port, app.options.http, name="avp.http"))
        log.info("avp.http.listening host=%s port=%d token=%s", host, bound,
                 app.options.token is not None or app.options.token_file is not None)
        task_status.started(bound)
