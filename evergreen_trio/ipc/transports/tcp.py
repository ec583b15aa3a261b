"""Stream transports on Trio sockets (TCP, and the Unix socket of shared memory).

One connection carries everything as (tag uint64 LE, length uint64 LE, bytes) frames:
metadata messages under :data:`METADATA_TAG`, bodies under their body tags, and the
client's want_data / free_data requests under the tags from the URI. Bodies are read
with ``recv_into`` straight into pooled buffers; small frames are read and written in
batches of about 64 KiB.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pyarrow as pa
import trio

from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import ConnectionLostError, LimitExceededError, TransportError
from evergreen_trio.ipc.framing import (
    FRAME_HEADER,
    METADATA_TAG,
    BodyIn,
    BodyType,
    body_in,
    classify_body,
    decode_frame_header,
    encode_frame_header,
)
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.transports.base import (
    BodyResolver,
    Completion,
    Connection,
    ConnectionCap,
    ConnectionHandler,
    Done,
    HostBodies,
    MetadataIn,
    RawBodies,
    ServeOptions,
)
from evergreen_trio.ipc.uri import IpcUri

_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_COALESCE_BYTES = 64 * 1024
_SEND_PIECE = 1 << 20
_SERVER_INBOX_BYTES = 4096


class FramedSocket:
    """Frame sends (serialised by a lock) and buffered exact receives on one Trio socket stream.

    Small frames are read through a 64 KiB buffer, so a burst of metadata or descriptor
    frames costs one ``recv`` instead of two per frame; large payloads go straight into
    their destination with ``recv_into``. Sends coalesce small frames the same way.
    """

    def __init__(self, stream: trio.SocketStream, limits: IpcLimits, pool: BufferPool | None = None,
                 inbox_bytes: int = _COALESCE_BYTES) -> None:
        self.stream = stream
        self.limits = limits
        self.pool = pool
        self._sock = stream.socket
        self._lock = trio.Lock()
        self._inbox = bytearray(inbox_bytes)
        self._start = 0
        self._end = 0

    async def send_frames(self, frames: Sequence[tuple[int, object]]) -> None:
        """Send frames in order, small ones coalesced into sends of about 64 KiB."""
        pending = bytearray()
        try:
            async with self._lock:
                for tag, payload in frames:
                    view = memoryview(payload).cast("B")  # type: ignore[arg-type]
                    pending += encode_frame_header(tag, view.nbytes)
                    if view.nbytes <= _COALESCE_BYTES:
                        pending += view
                        if len(pending) < _COALESCE_BYTES:
                            continue
                    else:
                        await self._send_all(pending)
                        pending = view  # type: ignore[assignment]
                    await self._send_all(pending)
                    pending = bytearray()
                if pending:
                    await self._send_all(pending)
        except _CLOSED as exc:
            raise ConnectionLostError(f"peer closed the connection while we sent {len(frames)} frames: {exc}") from None

    async def _send_all(self, data: bytearray | memoryview) -> None:
        """Send in pieces of 1 MiB, each within ``send_timeout_s``: a peer that stops reading
        is dropped, one that reads slowly is not."""
        view = memoryview(data)
        for start in range(0, len(view), _SEND_PIECE):
            with trio.move_on_after(self.limits.send_timeout_s) as scope:
                await self.stream.send_all(view[start : start + _SEND_PIECE])
            if scope.cancelled_caught:
                raise ConnectionLostError(
                    f"peer read nothing for {self.limits.send_timeout_s:g} s (a 1 MiB send did not complete)")

    async def send_frame(self, tag: int, payload: object) -> None:
        await self.send_frames(((tag, payload),))

    def ready(self) -> bool:
        """Whether a whole small frame is already buffered (receiving it will not wait)."""
        buffered = self._end - self._start
        if buffered < FRAME_HEADER.size:
            return False
        _tag, length = FRAME_HEADER.unpack_from(self._inbox, self._start)
        return bool(buffered - FRAME_HEADER.size >= length)

    async def _recv(self, view: memoryview) -> int:
        try:
            got = await self._sock.recv_into(view)
        except _CLOSED as exc:
            raise ConnectionLostError(f"connection reset: {exc}") from None
        if got == 0:
            raise ConnectionLostError(f"peer closed the connection with {len(view)} bytes of a frame unread")
        return got

    async def _buffer(self, nbytes: int) -> None:
        """Have at least ``nbytes`` (<= the buffer size) buffered."""
        if self._start + nbytes > len(self._inbox):
            rest = self._end - self._start
            self._inbox[:rest] = self._inbox[self._start : self._end]
            self._start, self._end = 0, rest
        while self._end - self._start < nbytes:
            self._end += await self._recv(memoryview(self._inbox)[self._end :])

    async def _receive_into(self, view: memoryview) -> None:
        if len(view) <= len(self._inbox) // 2:
            await self._buffer(len(view))
        take = min(len(view), self._end - self._start)
        view[:take] = self._inbox[self._start : self._start + take]
        self._start += take
        view = view[take:]
        while view:
            view = view[await self._recv(view) :]

    async def receive_header(self) -> tuple[int, int]:
        await self._buffer(FRAME_HEADER.size)
        header = memoryview(self._inbox)[self._start : self._start + FRAME_HEADER.size]
        self._start += FRAME_HEADER.size
        return decode_frame_header(header, self.limits)

    async def receive_bytes(self, nbytes: int) -> bytes:
        """The next ``nbytes``, held only as they arrive: a header announcing a large frame
        with nothing after it costs the buffer, not the announced size."""
        if nbytes <= len(self._inbox) // 2:
            await self._buffer(nbytes)
            self._start += nbytes
            return bytes(memoryview(self._inbox)[self._start - nbytes : self._start])
        data = bytearray()
        while len(data) < nbytes:
            if self._start == self._end:
                self._start = self._end = 0
                self._end = await self._recv(memoryview(self._inbox))
            take = min(nbytes - len(data), self._end - self._start)
            data += self._inbox[self._start : self._start + take]
            self._start += take
        return bytes(data)

    async def receive_pooled(self, nbytes: int) -> pa.Buffer:
        assert self.pool is not None
        buffer, view = self.pool.acquire(nbytes)
        await self._receive_into(view)
        return buffer

    async def aclose(self) -> None:
        await self.stream.aclose()


class StreamServerChannel:
    """:class:`ServerChannel` over a framed socket (:meth:`accepted` for a new connection)."""

    def __init__(self, framed: FramedSocket) -> None:
        self.framed = framed
        limits = framed.limits
        self._max_request = max(limits.max_ticket_bytes, 8 * limits.max_free_data_offsets)

    @classmethod
    def accepted(cls, stream: trio.SocketStream, limits: IpcLimits) -> StreamServerChannel:
        """The channel of an accepted connection: its read buffer is small (requests are, and an
        idle connection should cost little); a larger request is read in pieces as it arrives."""
        return cls(FramedSocket(stream, limits, inbox_bytes=_SERVER_INBOX_BYTES))

    async def receive_request(self) -> tuple[int, bytes]:
        tag, nbytes = await self.framed.receive_header()
        if nbytes > self._max_request:
            raise LimitExceededError(f"request tag {tag:#x}: expected <= {self._max_request} bytes, got {nbytes}")
        return tag, await self.framed.receive_bytes(nbytes)

    async def send_metadata(self, frames: Sequence[bytes]) -> None:
        await self.framed.send_frames([(METADATA_TAG, frame) for frame in frames])

    async def post_body(self, tag: int, body: object) -> Completion:
        await self.framed.send_frame(tag, body)
        return Done()

    async def send_descriptors(self, descriptors: Sequence[tuple[int, bytes]]) -> None:
        await self.framed.send_frames(descriptors)


class StreamClientChannel:
    """:class:`ClientChannel` over a framed socket; raw bodies land in pooled buffers.

    ``accepts`` is the one body type the connection carries (inline on TCP, descriptors
    on shared memory); each body tag is classified once, here, before its bytes are read.
    """

    def __init__(self, framed: FramedSocket, accepts: BodyType = BodyType.RAW) -> None:
        self.framed = framed
        self.accepts = accepts

    async def send_request(self, tag: int, payload: bytes) -> None:
        await self.framed.send_frame(tag, payload)

    async def receive(self) -> MetadataIn | BodyIn:
        tag, nbytes = await self.framed.receive_header()
        if tag == METADATA_TAG:
            return MetadataIn(await self.framed.receive_bytes(nbytes))
        limits = self.framed.limits
        parsed = classify_body(tag, nbytes, limits, self.accepts)
        if parsed.body_type is BodyType.DESCRIPTOR:
            return body_in(parsed, await self.framed.receive_bytes(nbytes), nbytes, limits)
        return body_in(parsed, await self.framed.receive_pooled(nbytes), nbytes, limits)

    def ready(self) -> bool:
        return self.framed.ready()


def _peer(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername())
    except OSError:
        return "?"


OpenStream = Callable[[], Awaitable[trio.SocketStream]]
Handshake = Callable[[trio.SocketStream], Awaitable[BodyResolver]]


async def _host_bodies(stream: trio.SocketStream) -> BodyResolver:
    return HostBodies()


@asynccontextmanager
async def open_framed_client(
    uri: IpcUri,
    ticket: bytes | None,
    limits: IpcLimits,
    pool: BufferPool,
    open_stream: OpenStream,
    accepts: BodyType = BodyType.RAW,
    handshake: Handshake = _host_bodies,
) -> AsyncIterator[Connection]:
    """Open a socket stream, send want_data (with a ticket), run ``handshake`` (within the connect timeout).

    Raises TransportError when no server answers in ``limits.connect_timeout_s``.
    """
    try:
        with trio.fail_after(limits.connect_timeout_s):
            socket_stream = await open_stream()
            channel = StreamClientChannel(FramedSocket(socket_stream, limits, pool), accepts)
            try:
                if ticket is not None:
                    # want_data goes out before any handshake reply comes in: one round trip fewer.
                    await channel.send_request(uri.want_data, ticket)
                bodies = await handshake(socket_stream)
            except BaseException:
                await trio.aclose_forcefully(socket_stream)
                raise
    except (OSError, trio.TooSlowError) as exc:
        raise TransportError(f"connect {uri}: expected a listening server, got {exc!r}") from None
    async with socket_stream:
        yield Connection(channel, bodies)


class TcpTransport:
    """``tcp://host:port``: everything framed on one TCP connection, bodies inline."""

    async def serve(
        self,
        uri: IpcUri,
        handler: ConnectionHandler,
        options: ServeOptions,
        task_status: trio.TaskStatus[IpcUri],
    ) -> None:
        listener = (await trio.open_tcp_listeners(uri.port, host=uri.host))[0]

        async def handle(stream: trio.SocketStream) -> None:
            async with stream:
                await handler(StreamServerChannel.accepted(stream, options.limits), RawBodies(), _peer(stream))

        bound_host, bound_port = listener.socket.getsockname()[:2]
        task_status.started(IpcUri("tcp", options.want_data, host=bound_host, port=bound_port))
        await trio.serve_listeners(ConnectionCap(options.limits.max_connections, "tcp").wrap(handle), [listener])

    def connect(
        self, uri: IpcUri, ticket: bytes | None, limits: IpcLimits, pool: BufferPool
    ) -> AbstractAsyncContextManager[Connection]:
        async def open_stream() -> trio.SocketStream:
            return await trio.open_tcp_stream(uri.host, uri.port)

        return open_framed_client(uri, ticket, limits, pool, open_stream)
