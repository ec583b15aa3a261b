"""Shared-memory bodies (body type 1) in memfd segments passed on a Unix socket.

Right after accepting, the server passes two file descriptors in one ``SCM_RIGHTS``
message: the connection's own ``memfd`` segment and the server's :class:`Publication`,
then speaks the stream framing of :mod:`~evergreen_trio.ipc.transports.tcp` on the same
socket. Offsets index the two concatenated (the segment first). A catalog body is
copied into the publication once, by the first stream that sends it; every stream
then announces it as (offset, length) pairs with no copy at all. A body that does not
fit there is copied into the connection's segment per stream, and its region is reused
once ``free_data`` has returned every offset sent for it, or when the client
disconnects. The client maps both read-only and builds batches on them without
copying; both are sealed, so no client can write, shrink or grow them.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import itertools
import math
import mmap
import os
import socket
import tempfile
import weakref
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import trio

from evergreen_trio.ipc.arena import ALIGN, Arena, past_room, window_extent
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
"""``remote_handle`` of shm URIs: the memory arrives as file descriptors on the socket."""

F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
"""Linux >= 5.1: no new writable mapping and no ``write``; mappings made before stay writable."""

MAX_SEGMENTS = 2
"""Descriptors a client maps from the handshake: its segment and the server's publication."""

_SEGMENT_NUMBERS = itertools.count(1)
"""Numbers segment names across every server of the process: two servers' segments never share a name
in ``/proc/PID/maps``."""

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL


def sealed_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A ``size``-byte memfd mapped read-write here, then sealed against every other writer.

    Clients hold its descriptor: unsealed, one could truncate it (the server's next copy
    would die of SIGBUS), or map it writable and change bodies that other clients read.
    Sealed, ``mmap`` with ``PROT_WRITE``, ``write``, ``ftruncate``, punching holes and
    ``mprotect`` to writable all fail for them (tested); only this mapping writes.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        mapping = mmap.mmap(fd, size)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except OSError:
            mapping.close()
            raise
    except OSError as exc:
        os.close(fd)
        raise SharedMemoryError(f"shared memory: could not create a sealed {size}-byte segment: {exc}") from None
    return fd, mapping


class SharedSegment:
    """The server's memfd segment, mapped read-write (sealed for everyone else)."""

    def __init__(self, name: str, size: int) -> None:
        self.fd, self.map = sealed_memfd(name, size)
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


class Publication:
    """Server-wide shared memory holding each catalog body once, for every connection.

    A catalog's messages do not change once added, so the first shm stream that sends a
    body copies it here and later streams send descriptors only. Bodies are placed from
    the lowest address up, never moved, rewritten or released while the server runs
    (those of a removed catalog entry too, though its messages are not kept); at most ``size`` bytes
    (``shm_published_bytes``) are placed, and a body that does not fit takes the
    per-connection segment. The memfd is sparse: only placed bodies use memory.
    """

    def __init__(self, name: str, size: int) -> None:
        self.fd, self.map = sealed_memfd(name, size)
        self.size = size
        self.used = 0
        self._array: npt.NDArray[np.uint8] | None = np.frombuffer(self.map, np.uint8)
        # id(message) -> its offset here; the entry goes when the message does (before its id can be reused).
        self._placed: dict[int, int] = {}

    def find(self, message: OutgoingMessage) -> int | None:
        """The offset of ``message``'s published body, or None."""
        return self._placed.get(id(message))

    def copied(self, messages: Sequence[OutgoingMessage]) -> list[int]:
        """The body lengths of ``messages`` that a stream would copy into its segment (not published, not fitting)."""
        unpublished = (m.header.body_length for m in messages if m.header.has_body and self.find(m) is None)
        return past_room(unpublished, self.size - self.used)[0]

    def place(self, message: OutgoingMessage) -> int | None:
        """The offset of ``message``'s body here, copied now if it was not yet; None if it does not fit."""
        found = self.find(message)
        if found is not None:
            return found
        start = self.used + (-self.used % ALIGN)
        size = message.header.body_length
        if start + size > self.size:
            return None
        assert self._array is not None
        if message.body is not None and message.body.size:
            np.copyto(self._array[start : start + message.body.size], np.frombuffer(message.body, np.uint8))
        self.used = start + size
        self._placed[id(message)] = start
        weakref.finalize(message, self._placed.pop, id(message), None)
        return start

    def close(self) -> None:
        os.close(self.fd)
        self._array = None
        self._placed.clear()
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
        return SharedSegment(f"evergreen-ipc-{os.getpid()}-{next(_SEGMENT_NUMBERS)}", self.size)

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
    """:class:`~evergreen_trio.ipc.transports.base.BodySender` placing bodies in shared memory.

    A body published in ``publication`` (placed there by the first stream that sends it)
    is announced with no copy and acknowledged at once: it lives as long as the server,
    and its ``free_data`` releases nothing. Any other body is copied into the
    connection's segment and acknowledged by ``free_data``.

    Descriptors are announced in groups (one control send per group, not one per body):
    a group ends at ``batch_bytes`` of bodies or ``batch_count`` bodies (half the window,
    so frees of one group flow back while the next fills), and before the server waits
    for anything.
    """

    def __init__(
        self, segment: SharedSegment, pool: SegmentPool | None = None, batch_bytes: int = 1, batch_count: int = 1,
        wait_s: float = math.inf, publication: Publication | None = None,
    ) -> None:
        self.segment = segment
        self.publication = publication
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
        published = None if self.publication is None else self.publication.place(message)
        if published is not None:
            await self._announce(channel, seq, size, self.segment.size + published, message)
            return Done()
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
        completion: Completion = Done()
        if message.header.buffers:
            region = _Region(start, collections.Counter(start + offset for offset, _ in message.header.buffers))
            for offset in region.offsets:
                self._owner[offset] = region
            completion = region
        else:
            self._release(start)
        await self._announce(channel, seq, size, start, message)
        return completion

    async def _announce(
        self, channel: ServerChannel, seq: int, size: int, start: int, message: OutgoingMessage
    ) -> None:
        """Queue the descriptor of a body placed at ``start``; send the group once it is full."""
        buffers = tuple((start + offset, length) for offset, length in message.header.buffers)
        self._queued.append((make_tag(seq, BodyType.DESCRIPTOR), encode_descriptor(BodyDescriptor(size, buffers))))
        self._queued_bytes += size
        if self._queued_bytes >= self.batch_bytes or len(self._queued) >= self.batch_count:
            await self.flush(channel)

    def prepare(self, messages: Sequence[OutgoingMessage], window: int) -> None:
        """Prefault the extent a window of this stream's largest bodies can occupy.

        With at most ``window`` regions alive and first-fit from the lowest address, the
        stream stays inside that extent, so a warm segment takes no page faults at all.
        Published bodies (and those about to be) take no segment space.
        """
        if self.publication is None:
            lengths = [m.header.body_length for m in messages if m.header.has_body]
        else:
            lengths = self.publication.copied(messages)
        self.segment.prefault(window_extent(lengths, window))

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
        published_end = self.segment.size + (0 if self.publication is None else self.publication.used)
        for offset in offsets:
            if self.segment.size <= offset < published_end:
                continue  # a published body: it lives as long as the server
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


async def send_segment(stream: trio.SocketStream, segment: SharedSegment, publication: Publication | None) -> None:
    """Pass the segment's descriptor, then the publication's, to the client (one byte plus SCM_RIGHTS)."""
    fds = array.array("i", [segment.fd] if publication is None else [segment.fd, publication.fd])
    try:
        await stream.socket.sendmsg([b"M"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    except OSError as exc:
        raise ConnectionLostError(f"client left before receiving the segment: {exc}") from None


async def receive_segment(sock: trio.socket.SocketType) -> list[int]:
    """The descriptors the server passed (segment, publication if any); SharedMemoryError if none came."""
    size = socket.CMSG_SPACE(MAX_SEGMENTS * array.array("i").itemsize)
    try:
        data, ancillary, _flags, _addr = await sock.recvmsg(1, size)
    except OSError as exc:
        raise ConnectionLostError(f"server closed before passing its segment: {exc}") from None
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS and len(payload) >= 4:
            fds = array.array("i")
            fds.frombytes(payload[: len(payload) - len(payload) % 4])
            for extra in fds[MAX_SEGMENTS:]:
                os.close(extra)
            return list(fds[:MAX_SEGMENTS])
    raise SharedMemoryError(f"shm handshake: expected a segment descriptor, got {data!r} without one")


class _Lease:
    __slots__ = ("mapping", "offsets")

    def __init__(self, mapping: SharedMemoryMapping, offsets: list[int]) -> None:
        self.mapping = mapping
        self.offsets = offsets

    def __del__(self) -> None:
        self.mapping._freed.extend(self.offsets)


class _Mapped:
    """One read-only mapping, at ``start`` in the connection's offsets."""

    __slots__ = ("address", "array", "end", "map", "start")

    def __init__(self, fd: int, start: int) -> None:
        # Unsealed, the server could truncate the memory under our batches: reading them would die of SIGBUS.
        if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
            raise SharedMemoryError("shared memory: expected a segment sealed against shrinking (F_SEAL_SHRINK), "
                                    "got one its server could truncate")
        size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self.map, np.uint8)
        self.address = self.array.ctypes.data
        self.start = start
        self.end = start + size

    def holds(self, offset: int, length: int) -> bool:
        return self.start <= offset and offset + length <= self.end


class SharedMemoryMapping:
    """The client's read-only mappings; resolves descriptors into zero-copy pyarrow buffers.

    Offsets index the server's descriptors concatenated in the order passed (the
    connection's segment, then the server's publication); every buffer must lie inside
    one of them.
    """

    def __init__(self, fds: Sequence[int]) -> None:
        self._maps: list[_Mapped] = []
        try:
            for fd in fds:
                self._maps.append(_Mapped(fd, self._maps[-1].end if self._maps else 0))
        except (OSError, ValueError) as exc:
            raise SharedMemoryError(f"shared memory: could not map the server's segment: {exc}") from None
        finally:
            for fd in fds:
                os.close(fd)
        # Later mappings first: a zero-length buffer at a boundary belongs to the one it starts.
        self._maps.reverse()
        self.size = max((m.end for m in self._maps), default=0)
        self._freed: list[int] = []

    def _find(self, offset: int, length: int) -> _Mapped | None:
        for mapped in self._maps:
            if mapped.holds(offset, length):
                return mapped
        return None

    def resolve(self, descriptor: object, header: MessageHeader, *, copy: bool) -> pa.Buffer:
        assert isinstance(descriptor, BodyDescriptor)
        homes = []
        for offset, length in descriptor.buffers:
            mapped = self._find(offset, length)
            if mapped is None:
                raise SharedMemoryError(
                    f"body descriptor: expected buffers inside the {self.size} bytes of shared memory, "
                    f"got offset {offset} length {length}"
                )
            homes.append(mapped)
        offsets = [offset for offset, _ in descriptor.buffers]
        base = descriptor.buffers[0][0] - header.buffers[0][0] if descriptor.buffers else 0
        home = self._find(base, header.body_length) if descriptor.buffers and base >= 0 else None
        in_place = (
            home is not None
            and all(home.holds(o, n) for o, n in descriptor.buffers)
            and all(o - base == h for (o, _), (h, _) in zip(descriptor.buffers, header.buffers, strict=True))
        )
        if in_place and not copy:
            assert home is not None
            return pa.foreign_buffer(home.address + base - home.start, header.body_length, base=_Lease(self, offsets))
        # Buffers scattered differently from the packed layout (or a copy was asked for):
        # pack them at their metadata offsets, then the memory can be freed at once.
        body = np.zeros(header.body_length, np.uint8)
        for (offset, length), (target, _), mapped in zip(descriptor.buffers, header.buffers, homes, strict=True):
            body[target : target + length] = mapped.array[offset - mapped.start : offset - mapped.start + length]
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
        publication: Publication | None = None
        segments = SegmentPool(limits.shm_segment_bytes, limits.shm_idle_segments,
                               limits.shm_max_total_bytes // limits.shm_segment_bytes)
        def full() -> str | None:
            if segments.free():
                return None
            return f"{segments.most} segments of {limits.shm_segment_bytes} bytes in use (shm_max_total_bytes)"

        cap = ConnectionCap(limits.max_connections, "shm", full)
        counter = 0
        bound = False  # the path is ours to unlink only once our bind made it
        try:
            if options.publish:
                publication = Publication(f"evergreen-ipc-{os.getpid()}-published", limits.shm_published_bytes)
                for messages in options.preload or ():
                    for message in messages:
                        if message.header.has_body:
                            publication.place(message)
            segments.warm(options.warm_bytes or 0)
            await sock.bind(path)
            bound = True
            sock.listen()

            async def handle(stream: trio.SocketStream) -> None:
                nonlocal counter
                counter += 1
                segment = segments.take()
                assert segment is not None  # the cap admits a connection only when one is free
                bodies = SharedMemoryBodies(
                    segment, segments, limits.shm_batch_bytes, max(1, limits.max_unacked_bodies // 2),
                    limits.idle_timeout_s, publication,
                )
                async with stream:
                    try:
                        await send_segment(stream, segment, publication)
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
            if publication is not None:
                publication.close()
            if bound:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if workdir is not None:
                os.rmdir(workdir)

    def connect(
        self, uri: IpcUri, ticket: bytes | None, limits: IpcLimits, pool: BufferPool
    ) -> AbstractAsyncContextManager[Connection]:
        async def open_stream() -> trio.SocketStream:
            return await _open_unix(uri.path)

        return open_framed_client(uri, ticket, limits, pool, open_stream, BodyType.DESCRIPTOR, _map_segment)
