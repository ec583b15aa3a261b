"""Published bodies: a catalog's bodies copied once into sealed shared memory every shm connection maps."""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import gc
import mmap
import os
import socket
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import trio
from ipc_helpers import sample_messages, sample_table

from evergreen_trio.ipc import Catalog, ServeOptions, fetch, fetch_table, serve
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import ConnectionLostError, SharedMemoryError
from evergreen_trio.ipc.flatbuf import MessageHeader, MessageKind
from evergreen_trio.ipc.framing import BodyDescriptor, encode_free_data
from evergreen_trio.ipc.transports.shm import Publication, SharedMemoryMapping, receive_segment, sealed_memfd
from evergreen_trio.ipc.uri import IpcUri

GUARD_S = 30
MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_PUNCH_HOLE_KEEP_SIZE = 3
_PROT_READ_WRITE = 3


def big_table(mib: int) -> pa.Table:
    rows = mib * MiB // 16
    return pa.table({"a": np.arange(rows, dtype=np.float64), "b": np.ones(rows)})


def server_rss(published: bool) -> int:
    """Resident bytes of the server's own (writable) mappings: its publication, or its segments."""
    total, counting = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith("/memfd:"):  # a mapping's header line
            name = fields[5]
            counting = fields[1] == "rw-s" and "evergreen-ipc" in name and name.endswith("-published") == published
        elif fields and fields[0].endswith(":") and fields[0][0].isupper():
            if counting and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
        else:
            counting = False  # another mapping
    return total


def client_publication_spans() -> list[tuple[int, int]]:
    """Address ranges of the clients' (read-only) mappings of a publication."""
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "-published" in line and " r--s " in line:
            lo, hi = line.split()[0].split("-")
            spans.append((int(lo, 16), int(hi, 16)))
    return spans


def published_rss() -> int:
    return server_rss(published=True)


def segments_rss() -> int:
    return server_rss(published=False)


async def fetch_batches(uri: IpcUri, ticket: str) -> pa.Table:
    """Zero-copy: every batch built on shared memory, validated by pyarrow while it is held."""
    batches = []
    async with fetch(str(uri), ticket) as stream:
        async for batch in stream:
            batch.validate(full=True)
            batches.append(pa.record_batch([pa.concat_arrays([c]) for c in batch.columns], schema=batch.schema))
            del batch
        await stream.flush_frees()
    return pa.Table.from_batches(batches)


@pytest.mark.parametrize("source", ["file", "table"])
async def test_published_bodies_read_back_as_pyarrow_wrote_them(
    source: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    table = sample_table()
    path = tmp_path / "t.arrow"
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=3_000)
    catalog = Catalog()
    if source == "file":
        catalog.add_file(path, "t")
    else:
        catalog.add_table("t", table, max_chunksize=3_000)
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0))
    expected = pa.ipc.open_file(str(path)).read_all()  # pyarrow's own reader of the same bytes
    with trio.fail_after(GUARD_S):
        for _ in range(3):  # the first fetch publishes, later ones only send descriptors
            assert (await fetch_batches(uri, "t")).equals(expected)
            assert (await fetch_table(str(uri), "t")).equals(expected)  # copy=True: copied out
    nursery.cancel_scope.cancel()


async def test_zero_copy_batches_live_on_the_publication(nursery: trio.Nursery) -> None:
    catalog = Catalog()
    catalog.add_table("t", big_table(4), max_chunksize=2**16)
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0))
    gc.collect()  # an earlier test's batches (and so its mapping) may be waiting for the collector
    assert client_publication_spans() == []
    with trio.fail_after(GUARD_S):
        async with fetch(str(uri), "t") as stream:
            async for batch in stream:
                address = batch.column(0).buffers()[1].address
                assert any(lo <= address < hi for lo, hi in client_publication_spans())
                del batch
    nursery.cancel_scope.cancel()


async def test_the_catalog_is_published_before_the_uri_is_reported(nursery: trio.Nursery) -> None:
    """So a new server's first fetch copies nothing either; a table added later is published by its first fetch."""
    catalog = Catalog()
    catalog.add_table("t", big_table(4), max_chunksize=2**16)
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0))
    assert 4 * MiB <= published_rss() < 5 * MiB
    catalog.add_table("later", big_table(2), max_chunksize=2**16)
    with trio.fail_after(GUARD_S):
        assert (await fetch_batches(uri, "t")).equals(big_table(4))
        assert 4 * MiB <= published_rss() < 5 * MiB
        assert (await fetch_batches(uri, "later")).equals(big_table(2))
        assert 6 * MiB <= published_rss() < 7 * MiB
    nursery.cancel_scope.cancel()


async def test_many_connections_share_one_publication(nursery: trio.Nursery) -> None:
    """Memory does not grow per connection: the bodies are resident once, and no segment is touched."""
    catalog = Catalog()
    catalog.add_table("t", big_table(8), max_chunksize=2**16)  # eight 1 MiB bodies
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0))
    with trio.fail_after(GUARD_S):
        after_first = published_rss()
        assert 8 * MiB <= after_first < 9 * MiB
        async with trio.open_nursery() as clients:
            for _ in range(6):  # at once: six connections, six segments, one publication
                clients.start_soon(fetch_batches, uri, "t")
        assert published_rss() == after_first
        assert segments_rss() < MiB  # the segments took no body
    nursery.cancel_scope.cancel()


async def test_bodies_past_shm_published_bytes_are_copied_per_stream(nursery: trio.Nursery) -> None:
    catalog = Catalog()
    table = big_table(8)
    catalog.add_table("t", table, max_chunksize=2**16)
    limits = IpcLimits(shm_published_bytes=3 * MiB + 4096)  # room for three of the eight bodies
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(limits=limits, warm_bytes=0))
    with trio.fail_after(GUARD_S):
        for _ in range(2):
            assert (await fetch_batches(uri, "t")).equals(table)
            assert (await fetch_table(str(uri), "t")).equals(table)
        assert 3 * MiB <= published_rss() < 4 * MiB
        assert segments_rss() >= MiB  # the other five went through the connection's segment
    nursery.cancel_scope.cancel()


async def test_a_client_cannot_write_shrink_or_grow_the_shared_memory(nursery: trio.Nursery) -> None:
    """Both descriptors a client receives (its segment, the publication) are sealed against it."""
    catalog = Catalog()
    catalog.add_table("t", big_table(1), max_chunksize=2**14)
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0))
    with trio.fail_after(GUARD_S):
        await fetch_batches(uri, "t")  # publishes
        sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
        with sock:
            await sock.connect(uri.path)
            fds = await receive_segment(sock)
    assert len(fds) == 2
    try:
        for fd in fds:
            size = os.fstat(fd).st_size
            with pytest.raises(PermissionError):
                mmap.mmap(fd, size)  # shared and writable
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size * 2)
            reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(reopened, size)
            finally:
                os.close(reopened)
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
            assert _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE_KEEP_SIZE, 0, 4096) == -1
            assert ctypes.get_errno() == errno.EPERM
            readonly = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            view = np.frombuffer(readonly, np.uint8)
            _libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            assert _libc.mprotect(view.ctypes.data, 4096, _PROT_READ_WRITE) == -1
            assert ctypes.get_errno() == errno.EACCES
            del view
            readonly.close()
    finally:
        for fd in fds:
            os.close(fd)
    # Still served intact to the next client.
    with trio.fail_after(GUARD_S):
        assert (await fetch_batches(uri, "t")).equals(big_table(1))
    nursery.cancel_scope.cancel()


def _mapping(segment: int, publication: int) -> SharedMemoryMapping:
    fds = []
    for name, size in (("segment", segment), ("published", publication)):
        fd, view = sealed_memfd(f"evergreen-test-{name}", size)
        view.close()
        fds.append(fd)
    return SharedMemoryMapping(fds)  # closes them


@pytest.mark.parametrize("sealing", [0, os.MFD_ALLOW_SEALING], ids=["unsealable", "unsealed"])
async def test_a_segment_the_server_could_still_shrink_is_refused(sealing: int) -> None:
    """A memfd without F_SEAL_SHRINK is refused before it is mapped: its server could truncate it
    under the client's zero-copy batches, and reading them would die of SIGBUS."""
    fd = os.memfd_create("evergreen-test-unsealed", os.MFD_CLOEXEC | sealing)
    os.ftruncate(fd, 4096)
    left, right = trio.socket.socketpair(trio.socket.AF_UNIX)
    with left, right:
        await left.sendmsg([b"M"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])
        os.close(fd)
        fds = await receive_segment(right)
    with pytest.raises(SharedMemoryError, match="F_SEAL_SHRINK"):
        SharedMemoryMapping(fds)
    for received in fds:  # closed all the same
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(received)


@pytest.mark.parametrize(
    "buffers",
    [
        ((8192, 4096), (12_288, 1)),  # past the end of both
        ((4096 - 8, 16),),  # straddles the segment and the publication
        ((2**64 - 8, 16),),  # wraps around
        ((0, 2**63),),
    ],
    ids=["past-the-end", "straddling", "wrapping", "huge"],
)
def test_descriptors_outside_the_shared_memory_are_refused(buffers: tuple[tuple[int, int], ...]) -> None:
    mapping = _mapping(4096, 8192)
    header = MessageHeader(MessageKind.RECORD_BATCH, sum(n for _, n in buffers),
                           tuple((0, n) for _, n in buffers))
    for copy in (False, True):
        with pytest.raises(SharedMemoryError, match="expected buffers inside the 12288 bytes"):
            mapping.resolve(BodyDescriptor(header.body_length, buffers), header, copy=copy)


def test_descriptors_resolve_in_either_mapping() -> None:
    mapping = _mapping(4096, 8192)
    header = MessageHeader(MessageKind.RECORD_BATCH, 64, ((0, 64),))
    for offset in (0, 4096 - 64, 4096, 4096 + 8192 - 64):
        body = mapping.resolve(BodyDescriptor(64, ((offset, 64),)), header, copy=False)
        assert body.size == 64 and body.to_pybytes() == bytes(64)


def test_a_publication_keeps_no_message_alive() -> None:
    """A removed catalog entry's messages (and their table) are freed; their bytes stay published."""
    publication = Publication("evergreen-test-published", 4 * MiB)
    try:
        messages = [m for m in sample_messages() if m.header.has_body]
        offsets = [publication.place(m) for m in messages]
        assert [publication.place(m) for m in messages] == offsets  # placed once
        used = publication.used
        probe = messages[-1]
        assert publication.find(probe) == offsets[-1]
        del messages, probe
        gc.collect()
        assert publication._placed == {}
        assert publication.used == used
    finally:
        publication.close()


@pytest.mark.parametrize("published", [True, False], ids=["published-offset", "past-the-publication"])
async def test_free_data_of_published_offsets_releases_nothing(
    published: bool, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """Over a real socket: freeing a published offset (twice, or never sent on this connection) is
    accepted and changes nothing; an offset past what was published closes the connection."""
    table = big_table(2)
    catalog = Catalog()
    catalog.add_table("t", table, max_chunksize=2**16)
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0))
    segment = IpcLimits().shm_segment_bytes
    offset = segment if published else segment + 4 * MiB
    with trio.fail_after(GUARD_S):
        async with fetch(str(uri), "t", copy=True) as stream:
            for _ in range(2):
                # Past the publication, the server may close the connection on the first free.
                with contextlib.suppress(*(() if published else (ConnectionLostError,))):
                    await stream._channel.send_request(uri.free_data, encode_free_data([offset]))
            if published:
                assert pa.Table.from_batches([batch async for batch in stream]).equals(table)
            else:
                # The server may have sent the whole stream before it reads the free: then the close comes after.
                with contextlib.suppress(ConnectionLostError):
                    async for _batch in stream:
                        pass
                while "free_data: expected an offset we sent and not yet freed" not in caplog.text:  # noqa: ASYNC110
                    await trio.sleep(0.01)
                assert f"got {offset}" in caplog.text
        assert (await fetch_batches(uri, "t")).equals(table)  # the next client is served intact
    nursery.cancel_scope.cancel()
