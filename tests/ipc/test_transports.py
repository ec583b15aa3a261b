"""End to end over real TCP, memfd shared memory and UCX: data, leaks, failures, mismatches."""

from __future__ import annotations

import collections
import gc
import importlib.util
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import trio
import trio.testing
from ipc_helpers import client_mappings, memfd_mappings, sample_messages, sample_table

from evergreen_trio.ipc import Catalog, Role, ServeOptions, fetch, fetch_table, serve
from evergreen_trio.ipc.arrow import OutgoingMessage
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import (
    BodyMismatchError,
    ConnectionLostError,
    FramingError,
    IpcError,
    RequestRefusedError,
    TransportError,
    UriError,
)
from evergreen_trio.ipc.framing import (
    METADATA_TAG,
    BodyType,
    encode_end_of_stream,
    encode_frame_header,
    encode_metadata,
    make_tag,
)
from evergreen_trio.ipc.transports.tcp import FramedSocket
from evergreen_trio.ipc.uri import parse_uri

HAVE_UCX = importlib.util.find_spec("ucxx") is not None
SCHEMES = [
    "tcp://127.0.0.1:0",
    "shm://",
    pytest.param("ucx://127.0.0.1:0", marks=pytest.mark.ucx),
]
GUARD_S = 30  # a hang guard, not a timing assertion


def ucx_inflight() -> list[int]:
    if not HAVE_UCX:
        return []
    from evergreen_trio.ipc.transports.ucx_bridge import open_bridges

    return [b.inflight for b in open_bridges()]


def big_table(mib: int = 16) -> pa.Table:
    rows = mib * 2**20 // 16
    return pa.table({"a": np.arange(rows, dtype=np.float64), "b": np.ones(rows)})


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_roundtrip_with_dictionaries(scheme: str, nursery: trio.Nursery) -> None:
    catalog = Catalog()
    catalog.add_table("t", sample_table(), max_chunksize=3_000)
    uri = await nursery.start(serve, scheme, catalog)
    with trio.fail_after(GUARD_S):
        assert (await fetch_table(str(uri), "t")).equals(sample_table())
        async with fetch(str(uri), b"t") as stream:
            batches = [batch async for batch in stream]
    assert pa.Table.from_batches(batches).equals(sample_table())
    del batches
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_unknown_ticket_is_a_clear_error(scheme: str, nursery: trio.Nursery) -> None:
    uri = await nursery.start(serve, scheme, Catalog())
    with trio.fail_after(GUARD_S), pytest.raises(RequestRefusedError, match="unknown ticket b'nope'"):
        await fetch_table(str(uri), "nope")
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_client_leaving_mid_stream_leaks_nothing(scheme: str) -> None:
    catalog = Catalog()
    catalog.add_table("big", big_table(), max_chunksize=2**16)
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=2), warm_bytes=0)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            uri = await nursery.start(serve, scheme, catalog, options)
            async with fetch(str(uri), "big") as stream:
                first = await stream.__anext__()
                assert first.num_rows == 2**16
            del first, stream
            gc.collect()
            # Give the server time to notice the disconnect (bounded by the guard above).
            while client_mappings() or any(ucx_inflight()) or len(ucx_inflight()) > 1:  # noqa: ASYNC110
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert memfd_mappings() == []
    assert ucx_inflight() == []


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_server_dying_mid_stream_is_a_clear_error(scheme: str) -> None:
    catalog = Catalog()
    catalog.add_table("big", big_table(), max_chunksize=2**16)
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=1))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer:
            server_scope = trio.CancelScope()

            async def run_server(task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
                with server_scope:
                    await serve(scheme, catalog, options, task_status=task_status)

            uri = await outer.start(run_server)
            async with fetch(str(uri), "big") as stream:
                held = [await stream.__anext__()]
                server_scope.cancel()
                with pytest.raises(ConnectionLostError, match="server went away"):
                    async for batch in stream:
                        held.append(batch)
            del held


async def test_body_length_mismatch_is_rejected(nursery: trio.Nursery) -> None:
    messages = sample_messages(1_000, 1_000)
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]

    async def lying_server(stream: trio.SocketStream) -> None:
        framed = FramedSocket(stream, IpcLimits())
        await framed.receive_header()
        for seq, message in enumerate(messages):
            await framed.send_frame(METADATA_TAG, encode_metadata(seq, message.flatbuffer))
            if message.body is not None and message.header.has_body:
                short = message.body.slice(0, message.body.size - 8)
                await framed.send_frame(make_tag(seq, BodyType.RAW), short)
        await framed.send_frame(METADATA_TAG, encode_end_of_stream(len(messages)))
        await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, lying_server, [listener])
    port = listener.socket.getsockname()[1]
    with trio.fail_after(GUARD_S), pytest.raises(BodyMismatchError, match="bodyLength"):
        await fetch_table(f"tcp://127.0.0.1:{port}?want_data=1", "t")
    nursery.cancel_scope.cancel()


async def test_an_shm_server_that_cannot_bind_its_path_leaves_it_alone(tmp_path: Path,
                                                                      nursery: trio.Nursery) -> None:
    """A path taken by a file or by a running server's socket is EADDRINUSE; the failed server must not
    unlink it on its way out (it deleted the file, and cut the running server off)."""
    precious = tmp_path / "notes.txt"
    precious.write_text("precious")
    with pytest.raises(OSError, match="Address already in use"):
        await serve(f"shm://{precious}", Catalog())
    assert precious.read_text() == "precious"
    catalog = Catalog()
    catalog.add_table("t", sample_table(100))
    uri = await nursery.start(serve, f"shm://{tmp_path / 'control.sock'}", catalog)
    with pytest.raises(OSError, match="Address already in use"):
        await serve(str(uri), Catalog())
    with trio.fail_after(GUARD_S):
        assert (await fetch_table(str(uri), "t")).num_rows == 100
    nursery.cancel_scope.cancel()


async def test_reserved_bits_on_the_wire_are_rejected(nursery: trio.Nursery) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]

    async def bad_server(stream: trio.SocketStream) -> None:
        await stream.send_all(encode_frame_header(1 << 40, 0))
        await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, bad_server, [listener])
    port = listener.socket.getsockname()[1]
    with trio.fail_after(GUARD_S), pytest.raises(IpcError, match="bits 32-55"):
        await fetch_table(f"tcp://127.0.0.1:{port}?want_data=1", "t")
    nursery.cancel_scope.cancel()


async def test_a_descriptor_on_a_tcp_connection_is_rejected_before_it_is_read(nursery: trio.Nursery) -> None:
    """The transport classifies each body tag once: TCP carries inline bodies only."""
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]

    async def bad_server(stream: trio.SocketStream) -> None:
        await stream.send_all(encode_frame_header(make_tag(0, BodyType.DESCRIPTOR), 1 << 30))
        await trio.sleep_forever()

    nursery.start_soon(trio.serve_listeners, bad_server, [listener])
    port = listener.socket.getsockname()[1]
    with trio.fail_after(GUARD_S), pytest.raises(FramingError, match="expected an inline body"):
        await fetch_table(f"tcp://127.0.0.1:{port}?want_data=1", "t")
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("uri", ["http://127.0.0.1:0", "file:///x", "tcp://[::1"])
async def test_serve_refuses_a_uri_no_transport_serves(uri: str) -> None:
    with pytest.raises(UriError):
        await serve(uri, Catalog())


def test_listen_uris_may_leave_port_path_and_want_data_to_the_server() -> None:
    assert parse_uri("tcp://127.0.0.1:0", listen=True).port == 0
    assert parse_uri("tcp://:0", listen=True).host == "127.0.0.1"
    assert parse_uri("shm://", listen=True).path == ""
    with pytest.raises(UriError, match="want_data"):
        parse_uri("tcp://127.0.0.1:5")


async def test_connection_refused_is_a_transport_error() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    with pytest.raises(TransportError):
        await fetch_table(f"tcp://127.0.0.1:{port}?want_data=1", "t")


@pytest.mark.parametrize("publish", [True, False], ids=["published", "copied"])
async def test_shm_batches_live_on_the_segment_and_are_freed(publish: bool, nursery: trio.Nursery) -> None:
    catalog = Catalog()
    catalog.add_table("t", sample_table(), max_chunksize=3_000)
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=2), publish=publish)
    uri = await nursery.start(serve, "shm://", catalog, options)
    with trio.fail_after(GUARD_S):
        async with fetch(str(uri), "t") as stream:
            rows = 0
            async for batch in stream:
                address = batch.column(0).buffers()[1].address
                assert any(
                    int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16)
                    for line in memfd_mappings()
                )
                rows += batch.num_rows
                del batch  # frees flow back, so a window of 2 does not stall the stream
    assert rows == sample_table().num_rows
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_server_process_killed_mid_stream_is_a_clear_error(scheme: str, tmp_path: Path) -> None:
    """A server that crashes (SIGKILL, no goodbye) fails the client with a typed error;
    over UCX the client may be inside a CMA read of the dead server's memory, which
    peer-failure mode turns into a failed request instead of an abort. Over shm:// the bodies are
    published before the URI is printed and descriptors go out at once, so the client may already
    hold them all: the stream then ends whole (its mappings keep the memory), never half-read."""
    path = tmp_path / "big.arrow"
    table = big_table(64)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=2**16)
    cmd = [sys.executable, "-m", "evergreen_trio.cli", "ipc", "serve", str(path), "--uri", scheme]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # noqa: ASYNC220
    try:
        assert proc.stdout is not None
        served = (await trio.to_thread.run_sync(proc.stdout.readline)).strip()
        with trio.fail_after(GUARD_S):
            async with fetch(served, path.name, copy=True) as stream:
                held = [await stream.__anext__()]
                proc.kill()
                await trio.to_thread.run_sync(proc.wait)
                try:
                    async for batch in stream:
                        held.append(batch)
                except ConnectionLostError as error:
                    assert "server went away" in str(error)
                else:
                    assert scheme.startswith("shm") and sum(b.num_rows for b in held) == table.num_rows
    finally:
        proc.kill()
        proc.wait()
    del held, stream
    gc.collect()
    assert memfd_mappings() == []
    assert ucx_inflight() == []


class _WatchedCatalog(Catalog):
    """A catalog that says when a client asked for a stream."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = trio.Event()

    def lookup(self, ticket: bytes) -> Sequence[OutgoingMessage]:
        self.asked.set()
        return super().lookup(ticket)


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_client_process_killed_mid_stream_leaves_the_server_serving(scheme: str, tmp_path: Path) -> None:
    catalog = _WatchedCatalog()
    catalog.add_table("big", big_table(64), max_chunksize=2**16)
    catalog.add_table("t", sample_table(), max_chunksize=3_000)
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=1))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            uri = await nursery.start(serve, scheme, catalog, options)
            out = str(tmp_path / "out.arrow")
            cmd = [sys.executable, "-m", "evergreen_trio.cli", "ipc", "get", str(uri), "big", "--out", out]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: ASYNC220
            try:
                await catalog.asked.wait()
            finally:
                proc.kill()
                await trio.to_thread.run_sync(proc.wait)
            assert (await fetch_table(str(uri), "t")).equals(sample_table())
            while any(ucx_inflight()) or len(ucx_inflight()) > 1:  # noqa: ASYNC110
                await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    assert ucx_inflight() == []


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_metadata_stays_within_the_clients_pending_bound(scheme: str, nursery: trio.Nursery) -> None:
    """Metadata is sent in coalesced runs, but never so far ahead of the bodies that a
    client with a small ``max_pending_messages`` would have to reject it."""
    table = pa.table({"x": np.arange(2_000, dtype=np.float64)})
    limits = IpcLimits(max_pending_messages=8)
    catalog = Catalog()
    catalog.add_table("t", table, max_chunksize=5)
    uri = await nursery.start(serve, scheme, catalog, ServeOptions(limits=limits))
    with trio.fail_after(GUARD_S):
        assert (await fetch_table(str(uri), "t", limits=limits)).equals(table)
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "limits",
    [
        IpcLimits(max_unacked_bodies=2, shm_batch_bytes=2**30),
        IpcLimits(max_unacked_bodies=64, shm_batch_bytes=2**30, shm_segment_bytes=256 * 1024),
    ],
    ids=["window", "segment"],
)
async def test_shm_grouped_descriptors_never_stall(limits: IpcLimits, nursery: trio.Nursery) -> None:
    """Descriptors wait for a group, but go out before the server waits for a free
    window slot or segment space, so a client returning memory keeps the stream going
    (bodies copied per stream: published ones wait for nothing)."""
    catalog = Catalog()
    catalog.add_table("t", sample_table(), max_chunksize=1_000)
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(limits=limits, publish=False))
    with trio.fail_after(GUARD_S):
        async with fetch(str(uri), "t") as stream:
            rows = 0
            async for batch in stream:
                rows += batch.num_rows
                del batch
    assert rows == sample_table().num_rows
    nursery.cancel_scope.cancel()


async def test_shm_segment_is_reused_only_after_a_clean_finish(nursery: trio.Nursery) -> None:
    """Warm segments skip first-touch faults; one with regions still held is never reused
    (bodies copied per stream, not published)."""
    catalog = Catalog()
    catalog.add_table("t", sample_table(), max_chunksize=3_000)
    # No warm idle segments at start (test_shm_warm.py has those): the mapped names are this client's.
    uri = await nursery.start(serve, "shm://", catalog, ServeOptions(warm_bytes=0, publish=False))

    async def segment_names(keep: bool) -> tuple[set[str], list[pa.RecordBatch]]:
        held = []
        async with fetch(str(uri), "t") as stream:
            async for batch in stream:
                if keep:
                    held.append(batch)
                del batch
            names = {line.split("/memfd:")[1].split()[0] for line in memfd_mappings()}
        # Let the server see the disconnect before the next connection comes in.
        await trio.testing.wait_all_tasks_blocked()
        return names, held

    with trio.fail_after(GUARD_S):
        first, _ = await segment_names(keep=False)
        second, held = await segment_names(keep=True)
        assert second == first  # clean finish: the warm segment came back
        third, _ = await segment_names(keep=False)
        assert third - second  # batches still held on the second one: a new segment
        assert pa.Table.from_batches(held).equals(sample_table())
    nursery.cancel_scope.cancel()


async def test_shm_warm_segment_takes_no_page_faults(nursery: trio.Nursery) -> None:
    """The first stream prefaults a window's worth of the segment; later streams on the
    warm segment copy into touched pages only (a first touch costs more than the copy)."""
    rows = 4 * 2**20
    table = pa.table({"a": np.arange(rows, dtype=np.float64), "b": np.ones(rows)})
    catalog = Catalog()
    catalog.add_table("t", table, max_chunksize=2**18)  # 4 MiB bodies, 1,024 pages each
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=4), publish=False)
    uri = await nursery.start(serve, "shm://", catalog, options)

    async def faults_of_one_fetch(hold: int) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held: collections.deque[pa.RecordBatch] = collections.deque(maxlen=hold)
        async with fetch(str(uri), "t") as stream:
            async for batch in stream:
                held.append(batch)
                del batch
            held.clear()
            await stream.flush_frees()  # all returned: the segment stays in the warm pool
        await trio.testing.wait_all_tasks_blocked()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    with trio.fail_after(GUARD_S):
        await faults_of_one_fetch(hold=1)
        # Holding more batches spreads the stream over more of the segment: still warm.
        assert await faults_of_one_fetch(hold=3) < 256
    nursery.cancel_scope.cancel()


SPLITS = [
    ("tcp://127.0.0.1:0", "tcp://127.0.0.1:0"),
    ("tcp://127.0.0.1:0", "shm://"),
    pytest.param(
        "ucx://127.0.0.1:0",
        "ucx://127.0.0.1:0",
        marks=pytest.mark.ucx,
    ),
]


@pytest.mark.parametrize(("meta_scheme", "data_scheme"), SPLITS)
async def test_metadata_and_data_from_two_servers(meta_scheme: str, data_scheme: str, nursery: trio.Nursery) -> None:
    """The spec's two-process server: want_data goes to each, free_data to the data server."""
    catalog = Catalog()
    catalog.add_table("t", sample_table(), max_chunksize=3_000)
    meta_uri = await nursery.start(serve, meta_scheme, catalog, ServeOptions(role=Role.METADATA))
    data_uri = await nursery.start(
        serve, data_scheme, catalog, ServeOptions(role=Role.DATA, limits=IpcLimits(max_unacked_bodies=2))
    )
    with trio.fail_after(GUARD_S):
        async with fetch(str(meta_uri), "t", data_uri=str(data_uri), copy=True) as stream:
            batches = [batch async for batch in stream]
    assert pa.Table.from_batches(batches).equals(sample_table())
    nursery.cancel_scope.cancel()


async def test_data_server_dying_in_a_split_stream_is_a_clear_error() -> None:
    catalog = Catalog()
    catalog.add_table("big", big_table(), max_chunksize=2**16)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as outer:
            meta_uri = await outer.start(serve, "tcp://127.0.0.1:0", catalog, ServeOptions(role=Role.METADATA))
            data_scope = trio.CancelScope()
            options = ServeOptions(role=Role.DATA, limits=IpcLimits(max_unacked_bodies=1))

            async def run_data(task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
                with data_scope:
                    await serve("tcp://127.0.0.1:0", catalog, options, task_status=task_status)

            data_uri = await outer.start(run_data)
            async with fetch(str(meta_uri), "big", data_uri=str(data_uri)) as stream:
                held = [await stream.__anext__()]
                data_scope.cancel()
                with pytest.raises(ConnectionLostError, match="data server"):
                    async for batch in stream:
                        held.append(batch)
            outer.cancel_scope.cancel()
