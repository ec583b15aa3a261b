"""Minimal HTTP/1.1 on Trio + h11: a server for the Prometheus exporters (the picker's and the
Evergreen server's, :mod:`evergreen_trio.serving.metrics`) and the tests' model servers, and a keep-alive
GET client for the picker's scrapers.

Server: keep-alive, request bodies up to a limit, and streamed responses (each chunk a separate
write, so an SSE body really arrives in pieces). Client: one connection per endpoint, reopened
after any failure; about a fifth of httpx's CPU per scrape, which matters at 20 scrapes a second
per endpoint on the same thread as the ext_proc server.
"""

from __future__ import annotations

import logging
import math
import ssl
from collections.abc import AsyncIterable, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import h11
import trio

from evergreen_trio._logsafe import peer_text
from evergreen_trio._refusals import RefusalEpisodes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpRequest:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class HttpResponse:
    """A response; ``chunks`` (if any), then ``stream``'s, are sent one write each after ``body``, chunk-encoded."""

    status: int = 200
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    chunks: Sequence[bytes] | None = None
    stream: AsyncIterable[bytes] | None = None


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class DropConnection(Exception):
    """Raised by a handler: close the connection without answering (a stand-in's lost connection)."""


async def _read_request(
    conn: h11.Connection, stream: trio.abc.Stream, max_body: int
) -> HttpRequest | None:
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65536)))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                raise h11.RemoteProtocolError(f"request body larger than {max_body} bytes", 413)
        elif isinstance(event, h11.EndOfMessage) and request is not None:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
            return HttpRequest(request.method.decode(), request.target.decode("latin-1"), headers, bytes(body))
        else:
            return None


class _SendTimeoutError(Exception):
    """One write waited longer than the connection's send deadline: the peer is not reading."""


async def _send(conn: h11.Connection, stream: trio.abc.Stream, event: h11.Event, deadline_s: float = math.inf) -> None:
    data = conn.send(event)
    if data:
        with trio.move_on_after(deadline_s) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            raise _SendTimeoutError


async def _connection(
    handler: Handler, max_body: int, read_timeout: float, stream: trio.abc.Stream, send_timeout: float = math.inf
) -> None:
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            try:
                request = None
                with trio.move_on_after(read_timeout):  # a whole request, or the wait for the next one
                    request = await _read_request(conn, stream, max_body)
                if request is None:  # the peer closed, or was too slow
                    return
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    status = exc.error_status_hint
                    await _send(conn, stream, h11.Response(status_code=status, headers=[("content-length", "0")]),
                                send_timeout)
                return
            try:
                response = await handler(request)
            except DropConnection:
                return
            except Exception as error:  # the handler's bug: this connection ends, the server goes on
                log.error("http.handler_error path=%s error=%s: %s", peer_text(request.target),
                          type(error).__name__, peer_text(str(error)))
                await _send(conn, stream, h11.Response(status_code=500, headers=[("content-length", "0"),
                                                                                  ("connection", "close")]),
                            send_timeout)
                await _send(conn, stream, h11.EndOfMessage(), send_timeout)
                return
            headers = list(response.headers)
            if response.chunks is None and response.stream is None:
                headers.append(("content-length", str(len(response.body))))
            await _send(conn, stream, h11.Response(status_code=response.status, headers=headers), send_timeout)
            if response.body:
                await _send(conn, stream, h11.Data(data=response.body), send_timeout)
            for chunk in response.chunks or ():
                await _send(conn, stream, h11.Data(data=chunk), send_timeout)
            if response.stream is not None:
                try:
                    async for chunk in response.stream:
                        await _send(conn, stream, h11.Data(data=chunk), send_timeout)
                except (_SendTimeoutError, trio.BrokenResourceError, trio.ClosedResourceError):
                    raise
                except Exception as error:  # the body's source failed midway: the response cannot end well
                    log.error("http.stream_error path=%s error=%s: %s", peer_text(request.target),
                              type(error).__name__, peer_text(str(error)))
                    return
            await _send(conn, stream, h11.EndOfMessage(), send_timeout)
            if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except _SendTimeoutError:
        log.info("http.send_timeout timeout_s=%s", send_timeout)
    except (trio.BrokenResourceError, trio.ClosedResourceError, h11.LocalProtocolError):
        return
    finally:
        await stream.aclose()


async def _tls_connection(handler: Handler, max_body: int, read_timeout: float, stream: trio.SocketStream,
                          send_timeout: float, context: ssl.SSLContext | Callable[[], ssl.SSLContext]) -> None:
    tls = trio.SSLStream(stream, context if isinstance(context, ssl.SSLContext) else context(), server_side=True)
    shaken = False
    with trio.move_on_after(read_timeout):
        try:
            await tls.do_handshake()
            shaken = True
        except trio.BrokenResourceError as exc:  # not TLS, or a client certificate refused
            log.info("http.tls_handshake_failed error=%s", exc.__cause__ or exc)
    if not shaken:
        await trio.aclose_forcefully(stream)
        return
    await _connection(handler, max_body, read_timeout, tls, send_timeout)


async def serve_http(
    handler: Handler,
    host: str,
    port: int,
    *,
    max_body: int = 64 * 1024 * 1024,
    read_timeout: float = 30.0,
    max_connections: int = 256,
    send_timeout: float = math.inf,
    max_connections_per_client: int | None = None,
    ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host:port`` until cancelled; ``started`` gets the bound port.

    A connection is closed when a request (or, kept alive, the next one) takes longer than
    ``read_timeout`` to arrive, or when one write waits longer than ``send_timeout`` for the peer to
    read; past ``max_connections`` open at once, or ``max_connections_per_client`` from one remote
    address, a new one is closed at once (one warning per episode of refusals). With ``ssl_context`` (or a callable
    asked per connection, for reloading) each connection is TLS, its handshake bounded by ``read_timeout``.
    A handler that raises gets its request a 500 and its connection closed (one error line); a
    response stream that raises midway closes its connection. The server goes on either way.
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound: int = listeners[0].socket.getsockname()[1]
    log.debug("http.listening host=%s port=%d", host, bound)
    open_connections = 0
    per_client: dict[str, int] = {}
    refusals = RefusalEpisodes()

    async def connection(stream: trio.SocketStream) -> None:
        nonlocal open_connections
        try:
            client = str(stream.socket.getpeername()[0])
        except OSError:  # gone already
            await stream.aclose()
            return
        held = per_client.get(client, 0)
        if open_connections >= max_connections or (
            max_connections_per_client is not None and held >= max_connections_per_client
        ):
            if refusals.refuse(trio.current_time()):
                which = "max_connections" if open_connections >= max_connections else "max_connections_per_client"
                log.warning("http.refused port=%d open=%d client=%s client_open=%d (%s)", bound,
                            open_connections, client, held, which)
            await stream.aclose()
            return
        refusals.admit(trio.current_time())
        open_connections += 1
        per_client[client] = held + 1
        try:
            if ssl_context is None:
                await _connection(handler, max_body, read_timeout, stream, send_timeout)
            else:
                await _tls_connection(handler, max_body, read_timeout, stream, send_timeout, ssl_context)
        finally:
            open_connections -= 1
            per_client[client] -= 1
            if not per_client[client]:
                del per_client[client]

    async with trio.open_nursery() as nursery:
        task_status.started(bound)
        await trio.serve_listeners(connection, listeners, handler_nursery=nursery)


def content_coding(headers: Mapping[str, str]) -> str | None:
    """The content-coding a response declares, escaped and cut for an error message; None for none or
    ``identity``. A client that asked for ``accept-encoding: identity`` reads the body raw, so a coded
    one is refused, never inflated (10 kB of zstd can hold GBs)."""
    coding = headers.get("content-encoding", "identity")
    return None if coding.strip().lower() in ("", "identity") else peer_text(coding, 40)


class HttpGetError(Exception):
    """A GET failed: connection refused or lost, a malformed response, or a body over the limit."""


async def read_response(conn: h11.Connection, stream: trio.abc.Stream, max_body: int) -> tuple[int, bytes]:
    """``(status, body)`` of the response ``conn`` (a client's h11 connection) reads from ``stream``;
    ``h11.RemoteProtocolError`` past ``max_body`` bytes of body or when the peer closes early."""
    status, body = 0, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65536)))  # SSLStream's may be a bytearray
        elif isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                raise h11.RemoteProtocolError(f"expected a body of at most {max_body} bytes, got one larger than that")
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            raise h11.RemoteProtocolError("connection closed before the response ended")


def host_port(host: str, port: int) -> str:
    """``host:port`` as a URL's authority (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class HttpPostError(Exception):
    """A one-shot POST or GET failed: no reply in time, connection refused or lost, a malformed
    response, or a body over the limit."""


async def post_once(host: str, port: int, path: str, body: bytes, *, timeout_s: float,
                    max_body: int) -> tuple[int, bytes]:
    """``(status, body)`` of ``POST path`` with a JSON ``body`` on a connection of its own, closed
    after it, all within ``timeout_s``; :class:`HttpPostError` naming what failed."""
    return await _once("POST", host, port, path, body, timeout_s, max_body)


async def get_once(host: str, port: int, path: str, *, timeout_s: float, max_body: int) -> tuple[int, bytes]:
    """``(status, body)`` of ``GET path``, as :func:`post_once`."""
    return await _once("GET", host, port, path, None, timeout_s, max_body)


async def _once(method: str, host: str, port: int, path: str, body: bytes | None, timeout_s: float,
                max_body: int) -> tuple[int, bytes]:
    authority = host_port(host, port)
    headers = [("host", authority), ("connection", "close")]
    if body is not None:
        headers += [("content-type", "application/json"), ("content-length", str(len(body)))]
    try:
        with trio.fail_after(timeout_s):
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                conn = h11.Connection(h11.CLIENT)
                message = conn.send(h11.Request(method=method, target=path, headers=headers))
                if body is not None:
                    message += conn.send(h11.Data(data=body))
                await stream.send_all(message + conn.send(h11.EndOfMessage()))
                return await read_response(conn, stream, max_body)
    except trio.TooSlowError:
        raise HttpPostError(f"{method} http://{authority}{path}: no reply within {timeout_s:g}s") from None
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
        raise HttpPostError(f"{method} http://{authority}{path}: {type(exc).__name__}: {exc}") from None


class KeepAliveGetter:
    """Repeated GETs to one ``host:port`` over one kept-alive connection (reopened after errors);
    over TLS with ``ssl_context`` (the server's certificate checked against ``host`` when the
    context checks hostnames)."""

    def __init__(self, host: str, port: int, *, max_body: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.max_body, self.ssl_context = host, port, max_body, ssl_context
        self._authority = host_port(host, port)
        self._scheme = "http" if ssl_context is None else "https"
        self._stream: trio.abc.Stream | None = None
        self._conn = h11.Connection(h11.CLIENT)

    async def get(self, target: str) -> tuple[int, bytes]:
        """``(status, body)`` of ``GET target``; :class:`HttpGetError` on any failure."""
        try:
            return await self._get(target)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError) as exc:
            await self.aclose()
            # trio reports a failed TLS handshake as BrokenResourceError caused by the ssl error.
            cause = exc.__cause__ if isinstance(exc.__cause__, ssl.SSLError) else exc
            raise HttpGetError(f"GET {self._scheme}://{self._authority}{target}: {type(cause).__name__}: {cause}") \
                from None
        except BaseException:
            await self.aclose()  # cancelled mid-response: the connection's state is unknown
            raise

    async def _get(self, target: str) -> tuple[int, bytes]:
        if self._stream is None:
            tcp = await trio.open_tcp_stream(self.host, self.port)
            if self.ssl_context is None:
                self._stream = tcp
            else:
                tls = trio.SSLStream(tcp, self.ssl_context, server_hostname=self.host)
                self._stream = tls
                await tls.do_handshake()
            self._conn = h11.Connection(h11.CLIENT)
        conn, stream = self._conn, self._stream
        await stream.send_all(conn.send(h11.Request(method="GET", target=target, headers=[
            ("host", self._authority), ("accept", "text/plain")])) + conn.send(h11.EndOfMessage()))
        status, body = await read_response(conn, stream, self.max_body)
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        else:
            await self.aclose()
        return status, body

    async def aclose(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()
