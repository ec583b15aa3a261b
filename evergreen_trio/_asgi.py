"""What our ASGI apps (the AVP agent server, the model-server simulator) share: the ASGI callable
types, the lifespan handshake, a bounded read of a request body, and the server that runs them.

The server is HTTP/1.1 only, on h11 (a sans-IO parser that answers any malformed input with an
exception we turn into a 4xx and a closed connection). It replaced hypercorn's Trio worker, whose
cleartext HTTP/2 let one bad frame end the whole server (issue 22; the measurements are in
docs/security.md). Every wait for the peer has a deadline, connections are capped in total and per
peer address, and a connection's failure, whatever it is, closes that connection and nothing else.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote_to_bytes

import h11
import trio

from evergreen_trio._logsafe import peer_text
from evergreen_trio.errors import EvergreenTrioError
from evergreen_trio.limits import check_limits

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ClientGoneError(EvergreenTrioError):
    """The client hung up (or stopped reading) before its request was done."""


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


async def read_body(receive: Receive, limit: int, *, first: bytes | None = None) -> bytes:
    """The request body, read as it arrives (after ``first``, a chunk the caller already received).

    Raises :class:`BodyTooLargeError` as soon as more than ``limit`` bytes came, and
    :class:`ClientGoneError` when the client disconnects first. The caller bounds the wait.
    """
    parts: list[bytes] = []
    size = 0
    more = True
    if first is not None:
        parts.append(first)
        size = len(first)
    while more:
        if size > limit:
            raise BodyTooLargeError(limit)
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGoneError
        chunk = message.get("body", b"")
        size += len(chunk)
        parts.append(chunk)
        more = message.get("more_body", False)
    if size > limit:
        raise BodyTooLargeError(limit)
    return b"".join(parts)


@dataclass(frozen=True)
class HttpServerLimits:
    """What the HTTP/1.1 server under the AVP agent and the simulator allows a client."""

    max_connections: int = 1024
    """Open connections, all peers together; past it a new one is closed at once."""
    max_connections_per_peer: int = 128
    """Open connections from one IP address; past it a new one is closed at once."""
    max_header_bytes: int = 16 * 1024
    """Request line and headers (431 past it)."""
    header_timeout_s: float = 5.0
    """A request's line and headers must be in this soon after the connection opened or the previous
    response ended (the keep-alive idle time included); else the connection is closed."""
    body_timeout_s: float = 60.0
    """A request body must be in this soon after its headers (the apps answer 408 sooner: this is the
    backstop); else the app sees ``http.disconnect`` and the connection is closed."""
    write_timeout_s: float = 30.0
    """Each response write must be taken by the client this soon (a client that stops reading is dropped)."""

    def __post_init__(self) -> None:
        check_limits(self)


def _client_gone(error: BaseException) -> bool:
    """Whether ``error`` is :class:`ClientGoneError`, or a group of nothing else."""
    if isinstance(error, BaseExceptionGroup):
        return error.split(ClientGoneError)[1] is None
    return isinstance(error, ClientGoneError)


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


class _Connection:
    """One HTTP/1.1 connection: requests one after another, each handed to the app."""

    def __init__(self, app: ASGIApp, limits: HttpServerLimits, stream: trio.SocketStream,
                 client: tuple[str, int], server: tuple[str, int]) -> None:
        self.app, self.limits, self.stream = app, limits, stream
        self.client, self.server = client, server
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        self.body_deadline = 0.0
        self.body_done = False
        self.body_expected = False  # the request declared a body (Content-Length > 0, or chunked)
        self.early: list[object] = []  # body events read ahead of the app (see _read_buffered_body)
        self.gone = False  # the client closed, or broke a rule mid-request: close when the app is done
        self.response: h11.Response | None = None
        self.response_done = False
        self.head = False

    async def run(self) -> None:
        while True:
            request = None  # stays None when the header deadline passes
            with trio.move_on_after(self.limits.header_timeout_s):
                request = await self._read_head()
            if request is None:
                return
            if not await self._handle(request):
                return
            self._drain_buffered()
            if self.conn.our_state is not h11.DONE or self.conn.their_state is not h11.DONE:
                return
            self.conn.start_next_cycle()

    def _read_buffered_body(self) -> bool:
        """Read ahead (for the app, see :attr:`early`) what of the body is already buffered; whether
        the whole body is in (a connection may be kept alive after a response only then)."""
        try:
            while self.conn.their_state is h11.SEND_BODY:
                event = self.conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    return False
                self.early.append(event)
        except h11.RemoteProtocolError:
            return False
        return True

    def _drain_buffered(self) -> None:
        """Consume the rest of a request the app did not read, as far as it is already buffered
        (an empty body's end, typically); a body still on the wire closes the connection instead."""
        self._read_buffered_body()
        self.early.clear()

    async def _read_head(self) -> h11.Request | None:
        """The next request's head; None when the peer closed or sent garbage (answered 4xx)."""
        try:
            event = await self._next_event()
            # else ConnectionClosed (PAUSED cannot happen at the start of a cycle)
            return event if isinstance(event, h11.Request) else None
        except h11.RemoteProtocolError as error:
            await self._refuse(error.error_status_hint, str(error))
            return None

    async def _next_event(self) -> object:
        """h11's next event, reading from the socket as it needs (a closed socket: ConnectionClosed)."""
        if self.early:
            return self.early.pop(0)
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self._receive())

    async def _receive(self) -> bytes:
        try:
            return bytes(await self.stream.receive_some(65536))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return b""

    async def _refuse(self, status: int, reason: str) -> None:
        log.info("http.refused peer=%s status=%d reason=%s", self.client[0], status, peer_text(reason))
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            body = f"{reason}\n".encode()
            await self._write(h11.Response(status_code=status, reason=_reason(status), headers=[
                ("content-type", "text/plain"), ("content-length", str(len(body))), ("connection", "close")]))
            await self._write(h11.Data(data=body))
            await self._write(h11.EndOfMessage())

    async def _write(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if not data:
            return
        with trio.move_on_after(self.limits.write_timeout_s) as scope:
            try:
                await self.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                raise ClientGoneError("the client closed the connection") from None
        if scope.cancelled_caught:
            raise ClientGoneError(f"the client took no response bytes for {self.limits.write_timeout_s}s")

    async def _handle(self, request: h11.Request) -> bool:
        """Run the app for ``request``; False when the connection must close."""
        if request.http_version not in (b"1.0", b"1.1"):  # e.g. the h2c preface, "PRI * HTTP/2.0"
            await self._refuse(505, "this server speaks HTTP/1.1 only (no cleartext HTTP/2)")
            return False
        target = request.target
        raw_path, _, query = target.partition(b"?")
        try:
            path = unquote_to_bytes(raw_path).decode("utf-8")
        except UnicodeDecodeError:
            await self._refuse(400, "the request target is not UTF-8 once percent-decoded")
            return False
        scope: Scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": request.http_version.decode(), "method": request.method.decode("ascii"),
            "scheme": "http", "path": path, "raw_path": raw_path, "query_string": query, "root_path": "",
            "headers": [(name.lower(), value) for name, value in request.headers],
            "client": self.client, "server": self.server,
        }
        self.body_deadline = trio.current_time() + self.limits.body_timeout_s
        self.body_done = False
        self.body_expected = any(name.lower() == b"transfer-encoding" or (name.lower() == b"content-length"
                                 and value.strip() != b"0") for name, value in request.headers)
        self.response, self.response_done = None, False
        self.head = request.method == b"HEAD"
        try:
            await self.app(scope, self._app_receive, self._app_send)
        except Exception as error:
            if _client_gone(error):  # raised by our send, perhaps through the app's nursery
                return False
            # the app's bug: this connection ends, the server goes on
            log.error("http.app_error peer=%s path=%s error=%s: %s", self.client[0], peer_text(path),
                      type(error).__name__, peer_text(str(error)))
            if self.response is None:
                await self._refuse(500, "internal error")
            return False
        if not self.response_done:
            if self.response is None and not self.gone:
                await self._refuse(500, "the app sent no response")
            return False
        return not self.gone

    async def _app_receive(self) -> dict[str, Any]:
        if self.gone:
            return {"type": "http.disconnect"}
        if self.body_done:
            return await self._wait_for_disconnect()
        with trio.move_on_at(self.body_deadline):
            try:
                event = await self._next_event()
                if isinstance(event, h11.Data):
                    return {"type": "http.request", "body": bytes(event.data), "more_body": True}
                if isinstance(event, h11.EndOfMessage):
                    self.body_done = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                # else the client closed mid-body
            except h11.RemoteProtocolError as error:
                log.info("http.bad_body peer=%s reason=%s", self.client[0], peer_text(str(error)))
        self.gone = True
        return {"type": "http.disconnect"}

    async def _wait_for_disconnect(self) -> dict[str, Any]:
        """After the body: wait until the client closes (``http.disconnect``), keeping what it pipelines."""
        buffered = 0
        while True:
            data = await self._receive()
            if not data:
                self.gone = True
                return {"type": "http.disconnect"}
            buffered += len(data)
            if buffered > self.limits.max_header_bytes:
                await trio.sleep_forever()  # no more reading until this response is done
            self.conn.receive_data(data)  # a pipelined request: h11 holds it for the next cycle

    async def _app_send(self, message: dict[str, Any]) -> None:
        if self.gone:
            raise ClientGoneError("the client closed the connection")
        if message["type"] == "http.response.start":
            status = message["status"]
            self.response = h11.Response(status_code=status, reason=_reason(status),
                                         headers=list(message.get("headers", ())))
            return
        if message["type"] != "http.response.body" or self.response is None or self.response_done:
            raise RuntimeError(f"unexpected ASGI message {message['type']!r} in this state")
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        if self.conn.our_state is h11.SEND_RESPONSE:
            response = self.response
            extra: list[tuple[bytes, bytes]] = []
            if not more and not any(name.lower() == b"content-length" for name, _ in response.headers):
                extra.append((b"content-length", str(len(body)).encode()))
            if self.body_expected and not self.body_done and not self._read_buffered_body():
                # Answered before the body is in (a refusal): the connection closes after this
                # response, so say so; a client reusing it would find it closed under its next request.
                extra.append((b"connection", b"close"))
            if extra:
                response = h11.Response(status_code=response.status_code, reason=response.reason,
                                        headers=[*response.headers, *extra])
            await self._write(response)
        if body and not self.head:  # a HEAD response carries the headers only
            await self._write(h11.Data(data=body))
        if not more:
            await self._write(h11.EndOfMessage())
            self.response_done = True


LINGER_S = 1.0
"""After its last response, a connection's unread input is read and dropped for up to this long
(and :data:`LINGER_BYTES`), so that closing does not reset the connection before the client has
read the answer."""

LINGER_BYTES = 16 << 20
"""The most unread input a closing connection drops. An HTTP/1.1 client (httpx, h11) reads no
answer until it has sent its whole body, so a body refused at its head (413, 401) is read to its
end; with 1 MiB, a 2 MiB upload's 413 was lost to the reset in about 1 run of 4 on a loaded machine."""


async def _linger_close(stream: trio.SocketStream) -> None:
    with trio.move_on_after(LINGER_S):
        try:
            await stream.send_eof()
            dropped = 0
            while dropped < LINGER_BYTES and (data := await stream.receive_some(65536)):
                dropped += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    await stream.aclose()


async def serve_asgi(
    app: ASGIApp,
    host: str,
    port: int,
    limits: HttpServerLimits | None = None,
    *,
    name: str = "http",
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` over HTTP/1.1 on ``host:port`` (0: any free port) until cancelled.

    ``task_status`` gets the bound port. Lifespan messages are not sent (our apps need none).
    """
    limits = limits or HttpServerLimits()
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound: int = listeners[0].socket.getsockname()[1]
    open_total = 0
    per_peer: dict[str, int] = {}
    refused, last_report = 0, -math.inf

    async def connection(stream: trio.SocketStream) -> None:
        nonlocal open_total
        try:
            client = stream.socket.getpeername()[:2]
            local = stream.socket.getsockname()[:2]
        except OSError:
            await stream.aclose()
            return
        peer = client[0]
        if open_total >= limits.max_connections or per_peer.get(peer, 0) >= limits.max_connections_per_peer:
            nonlocal refused, last_report
            refused += 1
            if trio.current_time() - last_report >= 1.0:  # one line per second of a flood, not one per connection
                log.warning("%s.refused peer=%s open=%d from_peer=%d refused=%d (max_connections, "
                            "max_connections_per_peer)", name, peer, open_total, per_peer.get(peer, 0), refused)
                last_report, refused = trio.current_time(), 0
            await stream.aclose()
            return
        open_total += 1
        per_peer[peer] = per_peer.get(peer, 0) + 1
        try:
            await _Connection(app, limits, stream, client, local).run()
        except Exception as error:  # never the whole server for one connection's trouble
            if not _client_gone(error):
                log.error("%s.connection_error peer=%s error=%s: %s", name, peer, type(error).__name__,
                          peer_text(str(error)))
        finally:
            open_total -= 1
            per_peer[peer] -= 1
            if not per_peer[peer]:
                del per_peer[peer]
            with trio.CancelScope(shield=True):
                await _linger_close(stream)

    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(connection, listeners, handler_nursery=nursery)
