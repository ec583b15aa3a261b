"""Shared-memory bodies (body type 1) over a memfd segment passed on a Unix socket.

Each connection gets its own anonymous ``memfd`` segment: the server sends the file
descriptor once (``SCM_RIGHTS``) right after accepting, then speaks the stream framing
of :mod:`~evergreen_trio.ipc.transports.tcp` on the same socket. Bodies are copied into
the segment (the producer's copy) and announced as (offset, length) pairs; the client
maps the segment read-only and builds batches on it without copying. A region is
reused once ``free_data`` has returned every offset the server sent for it, or when
the client disconnects (the segment dies with the last mapping: nothing to unlink).
"""

from __future__ import annotations

import array
import collections
import contextlib
import math
import mmap
import os
import socket
import tempfile
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import trio

from evergreen_trio.ipc.arena import Arena, window_extent
from evergreen_trio.ipc.arrow import OutgoingMessage
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import ConnectionLostError, SharedMemoryError, TransportError
from evergreen_trio.ipc.flatbuf import MessageHeader
from evergreen_trio.ipc.framing import BodyDescriptor, BodyType, encode_descriptor, make_tag
from evergreen_trio.ipc.pool import BufferPool
from evergreen_trio.ipc.transports.base import (
    BodyResolver,
    Completion,
    Connection,
    ConnectionCap,
    ConnectionHandler,
    Done,
    ServeOptions,
    ServerChannel,
)
from evergreen_trio.ipc.transports.tcp import StreamServerChannel, open_framed_client
from evergreen_trio.ipc.uri import IpcUri

HANDLE = b"memfd:scm_rights"
"""``remote_handle`` of shm URIs: the segment arrives as a file descriptor on the socket."""


class SharedSegment:
    """The server's memfd segment, mapped read-write."""

    def __init__(self, name: str, size: int) -> None:
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.map = mmap.mmap(self.fd, size)
        except OSError as exc:
            os.close(self.fd)
            raise SharedMemoryError(f"shared memory: could not create a {size}-byte segment: {exc}") from None
        self.size = size
        self.touched = 0
        """No byte at or past this offset was ever written (by a body or by :meth:`prefault`)."""
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self.map, np.uint8)

    def write(self, offset: int, body: pa.Buffer) -> None:
        """The producer's copy into the segment."""
        assert self._array is not None
        np.copyto(self._array[offset : offset + body.size], np.frombuffer(body, np.uint8))
        self.touched = max(self.touched, offset + body.size)

    def prefault(self, end: int) -> None:
        """Touch the pages up to ``end`` now, not during a stream's copies.

        A first touch faults in and zeroes each page, several times slower than the copy
        (1.2 GB/s against 9 here). Nothing was ever written past ``touched``, so zeroes
        there overwrite no body.
        """
        assert self._array is not None
        end = min(end, self.size)
        if end > self.touched:
            self._array[self.touched : end] = 0
            self.touched = end

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._array = None
        self.map.close()


class SegmentPool:
    """Server-wide warm segments, reused across connections.

    The producer's copy into a fresh segment first-touches its pages (the kernel faults
    and zeroes each one), which costs more than the copy itself. A connection that ends
    with every region returned by ``free_data`` gives its segment back for the next
    one; a connection that ends with regions outstanding (its client may still hold
    batches on them) retires the segment, which then lives on only in that client's
    mapping. At most ``keep`` idle segments are kept, and at most ``most`` exist at once
    (in use and idle: the server's shared-memory cap divided by the segment size).
    """

    def __init__(self, size: int, keep: int, most: int) -> None:
        self.size = size
        self.keep = keep
        self.most = most
        self.live = 0
        self._idle: list[SharedSegment] = []
        self._count = 0

    def free(self) -> bool:
        """Whether :meth:`take` would give a segment."""
        return bool(self._idle) or self.live < self.most

    def take(self) -> SharedSegment | None:
        """A segment for a new connection, or None when ``most`` already exist."""
        if self._idle:
            self.live += 1
            return self._idle.pop()
        if self.live >= self.most:
            return None
        segment = self._new()
        self.live += 1
        return segment

    def _new(self) -> SharedSegment:
        self._count += 1
        return SharedSegment(f"evergreen-ipc-{os.getpid()}-{self._count}", self.size)

    def warm(self, nbytes: int) -> None:
        """Fill the idle list with segments prefaulted up to ``nbytes``, before any client comes.

        A connection takes its segment as it is accepted, before the previous one has given
        its own back, so the first two fetches of a new server used to start on fresh
        segments: prefaulting 128 MiB of them cost more than the fetch's copies
        (0.6-0.8 GB/s against 2 GB/s warm, 256 MiB table, this VM).
        """
        while nbytes and len(self._idle) < min(self.keep, self.most):
            segment = self._new()
            segment.prefault(nbytes)
            self._idle.append(segment)

    def give_back(self, segment: SharedSegment, *, clean: bool) -> None:
        self.live -= 1
        if clean and len(self._idle) < self.keep:
            self._idle.append(segment)
        else:
            segment.close()

    def close(self) -> None:
        for segment in self._idle:
            segment.close()
        self._idle.clear()


@dataclass
class _Region:
    start: int
    offsets: collections.Counter[int]
    freed: trio.Event = field(default_factory=trio.Event)

    @property
    def done(self) -> bool:
        return self.freed.is_set()

    async def wait(self) -> None:
        await self.freed.wait()


class SharedMemoryBodies:
    """:class:`~evergreen_trio.ipc.transports.base.BodySender` placing bodies in a segment.

    Descriptors are announced in groups (one control send per group, not one per body):
    a group ends at ``batch_bytes`` of bodies or ``batch_count`` bodies (half the window,
    so frees of one group flow back while the next fills), and before the server waits
    for anything.
    """

    def __init__(
        self, segment: SharedSegment, pool: SegmentPool | None = None, batch_bytes: int = 1, batch_count: int = 1,
        wait_s: float = math.inf,
    ) -> None:
        self.segment = segment
        self.wait_s = wait_s
        self.pool = pool
        self.batch_bytes = batch_bytes
        self.batch_count = batch_count
        self.arena = Arena(segment.size)
        self._owner: dict[int, _Region] = {}
        self._space = trio.Event()
        self._queued: list[tuple[int, bytes]] = []
        self._queued_bytes = 0

    async def post(self, channel: ServerChannel, seq: int, message: OutgoingMessage) -> Completion:
        size = message.header.body_length
        start = self.arena.allocate(size)
        while start is None:
            await self.flush(channel)
            with trio.move_on_after(self.wait_s) as waited:
                await self._space.wait()
            if waited.cancelled_caught:
                raise ConnectionLostError(f"client freed no shared memory for {self.wait_s:g} s (idle_timeout_s)")
            start = self.arena.allocate(size)
        if message.body is not None and message.body.size:
            self.segment.write(start, message.body)
        buffers = tuple((start + offset, length) for offset, length in message.header.buffers)
        completion: Completion = Done()
        if buffers:
            region = _Region(start, collections.Counter(offset for offset, _ in buffers))
            for offset in region.offsets:
                self._owner[offset] = region
            completion = region
        else:
            self._release(start)
        self._queued.append((make_tag(seq, BodyType.DESCRIPTOR), encode_descriptor(BodyDescriptor(size, buffers))))
        self._queued_bytes += size
        if self._queued_bytes >= self.batch_bytes or len(self._queued) >= self.batch_count:
            await self.flush(channel)
        return completion

    def prepare(self, messages: Sequence[OutgoingMessage], window: int) -> None:
        """Prefault the extent a window of this stream's largest bodies can occupy.

        With at most ``window`` regions alive and first-fit from the lowest address, the
        stream stays inside that extent, so a warm segment takes no page faults at all.
        """
        self.segment.prefault(window_extent((m.header.body_length for m in messages if m.header.has_body), window))

    @property
    def queued(self) -> int:
        return len(self._queued)

    async def flush(self, channel: ServerChannel) -> None:
        if self._queued:
            queued, self._queued, self._queued_bytes = self._queued, [], 0
            await channel.send_descriptors(queued)

    def _release(self, start: int) -> None:
        self.arena.free(start)
        self._space.set()
        self._space = trio.Event()

    def on_free(self, offsets: Sequence[int]) -> None:
        for offset in offsets:
            region = self._owner.get(offset)
            if region is None:
                raise SharedMemoryError(f"free_data: expected an offset we sent and not yet freed, got {offset}")
            region.offsets[offset] -= 1
            if region.offsets[offset] == 0:
                del region.offsets[offset]
                del self._owner[offset]
            if not region.offsets:
                self._release(region.start)
                region.freed.set()

    @property
    def outstanding(self) -> int:
        """Regions the client still holds."""
        return len(self.arena.regions())

    def release_all(self) -> None:
        clean = not self.arena.regions()
        for region in {id(r): r for r in self._owner.values()}.values():
            region.freed.set()
        self._owner.clear()
        if self.pool is None:
            self.segment.close()
        else:
            self.pool.give_back(self.segment, clean=clean)


async def send_segment(stream: trio.SocketStream, segment: SharedSegment) -> None:
    """Pass the segment's descriptor to the client (one byte plus SCM_RIGHTS)."""
    fds = array.array("i", [segment.fd])
    try:
        await stream.socket.sendmsg([b"M"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    except OSError as exc:
        raise ConnectionLostError(f"client left before receiving the segment: {exc}") from None


async def receive_segment(sock: trio.socket.SocketType) -> int:
    """The descriptor the server passed; raise SharedMemoryError if none came."""
    size = socket.CMSG_SPACE(array.array("i").itemsize)
    try:
        data, ancillary, _flags, _addr = await sock.recvmsg(1, size)
    except OSError as exc:
        raise ConnectionLostError(f"server closed before passing its segment: {exc}") from None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(payload) >= 4:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % 4])
            for extra in fds[1:]:
                os.close(extra)
            return fds[0]
    raise SharedMemoryError(f"shm handshake: expected a segment descriptor, got {data!r} without one")


class _Lease:
    __slots__ = ("mapping", "offsets")

    def __init__(self, mapping: SharedMemoryMapping, offsets: list[int]) -> None:
        self.mapping = mapping
        self.offsets = offsets

    def __del__(self) -> None:
        self.mapping._freed.extend(self.offsets)


class SharedMemoryMapping:
    """The client's read-only mapping; resolves descriptors into zero-copy pyarrow buffers."""

    def __init__(self, fd: int) -> None:
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except (OSError, ValueError) as exc:
            raise SharedMemoryError(f"shared memory: could not map the server's segment: {exc}") from None
        finally:
            os.close(fd)
        self.size = size
        self._array: npt.NDArray[np.uint8] = np.frombuffer(self._map, np.uint8)
        self._address = self._array.ctypes.data
        self._freed: list[int] = []

    def resolve(self, descriptor: object, header: MessageHeader, *, copy: bool) -> pa.Buffer:
        assert isinstance(descriptor, BodyDescriptor)
        for offset, length in descriptor.buffers:
            if offset + length > self.size:
                raise SharedMemoryError(
                    f"body descriptor: expected buffers inside the {self.size}-byte segment, "
                    f"got offset {offset} length {length}"
                )
        offsets = [offset for offset, _ in descriptor.buffers]
        base = descriptor.buffers[0][0] - header.buffers[0][0] if descriptor.buffers else 0
        in_place = (
            bool(descriptor.buffers)
            and base >= 0
            and base + header.body_length <= self.size
            and all(o - base == h for (o, _), (h, _) in zip(descriptor.buffers, header.buffers, strict=True))
        )
        if in_place and not copy:
            return pa.foreign_buffer(self._address + base, header.body_length, base=_Lease(self, offsets))
        # Buffers scattered differently from the packed layout (or a copy was asked for):
        # pack them at their metadata offsets, then the segment can be freed at once.
        body = np.zeros(header.body_length, np.uint8)
        for (offset, length), (target, _) in zip(descriptor.buffers, header.buffers, strict=True):
            body[target : target + length] = self._array[offset : offset + length]
        self._freed.extend(offsets)
        return pa.py_buffer(body)

    def take_freed(self) -> list[int]:
        freed, self._freed = self._freed, []
        return freed


async def _open_unix(path: str) -> trio.SocketStream:
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.connect(path)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def _map_segment(stream: trio.SocketStream) -> BodyResolver:
    return SharedMemoryMapping(await receive_segment(stream.socket))


class ShmTransport:
    """``shm:///control/socket``: framing on a Unix socket, bodies in a memfd segment."""

    async def serve(
        self,
        uri: IpcUri,
        handler: ConnectionHandler,
        options: ServeOptions,
        task_status: trio.TaskStatus[IpcUri],
    ) -> None:
        path, workdir = uri.path, None
        if not path:
            workdir = tempfile.mkdtemp(prefix="evergreen-ipc-")
            path = os.path.join(workdir, "control.sock")
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        limits = options.limits
        segments = SegmentPool(limits.shm_segment_bytes, limits.shm_idle_segments,
                               limits.shm_max_total_bytes // limits.shm_segment_bytes)
        def full() -> str | None:
            if segments.free():
                return None
            return f"{segments.most} segments of {limits.shm_segment_bytes} bytes in use (shm_max_total_bytes)"

        cap = ConnectionCap(limits.max_connections, "shm", full)
        counter = 0
        try:
            segments.warm(options.warm_bytes or 0)
            await sock.bind(path)
            sock.listen()

            async def handle(stream: trio.SocketStream) -> None:
                nonlocal counter
                counter += 1
                segment = segments.take()
                assert segment is not None  # the cap admits a connection only when one is free
                bodies = SharedMemoryBodies(
                    segment, segments, limits.shm_batch_bytes, max(1, limits.max_unacked_bodies // 2),
                    limits.idle_timeout_s,
                )
                async with stream:
                    try:
                        await send_segment(stream, segment)
                    except TransportError:
                        bodies.release_all()
                        return
                    await handler(StreamServerChannel.accepted(stream, limits), bodies, f"shm#{counter}")

            task_status.started(
                IpcUri("shm", options.want_data, path=path, free_data=options.free_data, remote_handle=HANDLE)
            )
            await trio.serve_listeners(cap.wrap(handle), [trio.SocketListener(sock)])
        finally:
            sock.close()
            segments.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            if workdir is not None:
                os.rmdir(workdir)

    def connect(
        self, uri: IpcUri, ticket: bytes, limits: IpcLimits, pool: BufferPool
    ) -> AbstractAsyncContextManager[Connection]:
        async def open_stream() -> trio.SocketStream:
            return await _open_unix(uri.path)

        return open_framed_client(uri, ticket, limits, pool, open_stream, BodyType.DESCRIPTOR, _map_segment)
