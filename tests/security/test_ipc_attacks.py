"""Issue 22, items 11-12: the IPC servers (tcp://, shm://) under attack over real sockets.

Each test runs a server with short deadlines (0.5 s) and checks how it answered the attacking
connections, that a legitimate fetch is answered (on a connection opened before the attack, or
once the attack is over), and that Python allocations stay bounded (tracemalloc peak). Precise
stall and RSS figures: ``python -m benchmarks security``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pyarrow as pa
import pytest
import trio
from ipc_attacks import (
    BIG_TICKET,
    LEGIT_TICKET,
    IpcOutcome,
    LegitClient,
    big_table,
    compression_bomb,
    forged_compressed_size,
    hostile_server,
    offsets_past_the_data,
    open_raw,
    orphan_bodies,
    partial_request,
    silent_connections,
    small_table,
    want_data_flood,
)

from evergreen_trio.ipc import Catalog, IpcLimits, ServeOptions, fetch_table, serve
from evergreen_trio.ipc.config import MiB
from evergreen_trio.ipc.errors import ConfigurationError, IpcError, LimitExceededError
from evergreen_trio.ipc.framing import encode_frame_header
from evergreen_trio.ipc.uri import IpcUri, parse_uri

FAST = IpcLimits(first_request_timeout_s=0.5, idle_timeout_s=0.5, send_timeout_s=0.5, max_connections=64)
SCHEMES = ["tcp://127.0.0.1:0", "shm://"]
GUARD_S = 30.0  # a hang guard, not a timing assertion
CEILING_S = 5.0


def catalog() -> Catalog:
    served = Catalog()
    served.add_table(LEGIT_TICKET, small_table())
    served.add_table(BIG_TICKET, big_table(), max_chunksize=1 << 14)
    return served


async def start(nursery: trio.Nursery, scheme: str, limits: IpcLimits = FAST) -> IpcUri:
    uri: IpcUri = await nursery.start(serve, scheme, catalog(), ServeOptions(limits=limits))
    return uri


@pytest.fixture(params=SCHEMES)
async def uri(request: pytest.FixtureRequest, nursery: trio.Nursery) -> AsyncIterator[IpcUri]:
    yield await start(nursery, request.param)


async def legit_during(uri: IpcUri, attack: partial[object]) -> tuple[object, float]:
    """Run ``attack`` while a legitimate client fetches on a connection opened before it (TCP),
    or right after it (shm); return what the attack returned and the worst fetch time."""
    worst: list[float] = [0.0]
    client = await LegitClient.connect(uri) if uri.scheme == "tcp" else None
    done = trio.Event()

    async def legit() -> None:
        while not done.is_set():
            start_s = trio.current_time()
            if client is not None:
                assert await client.call() == 1000
            else:
                assert (await fetch_table(str(uri), LEGIT_TICKET)).num_rows == 1000
            worst[0] = max(worst[0], trio.current_time() - start_s)
            await trio.sleep(0.02)

    results: list[object] = []
    tracemalloc.start()
    try:
        with trio.fail_after(GUARD_S):
            async with trio.open_nursery() as nursery:
                if client is not None:
                    nursery.start_soon(legit)

                async def run_attack() -> None:
                    results.append(await attack())
                    done.set()

                nursery.start_soon(run_attack)
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if client is not None:
        await client.aclose()
    else:
        start_s = trio.current_time()
        assert (await fetch_table(str(uri), LEGIT_TICKET)).num_rows == 1000
        worst[0] = trio.current_time() - start_s
    assert worst[0] < CEILING_S
    return results[0], peak


async def test_a_frame_header_announcing_512_kib_is_never_allocated(uri: IpcUri) -> None:
    """200 connections each announce a 512 KiB want_data and send nothing more (before: all
    100 MiB allocated and waited on forever); each is closed at the first-request deadline."""
    outcome, peak = await legit_during(uri, partial(partial_request, uri, 0.1, 10.0))
    assert isinstance(outcome, IpcOutcome)
    assert outcome.closed == 200, outcome.describe()
    assert outcome.last_closed_s < 5.0
    assert peak < 200 * 160 * 1024, f"peak {peak / MiB:.1f} MiB"  # the 64 KiB read buffer, not 512 KiB


async def test_silent_connections_are_closed_at_the_first_request_deadline(uri: IpcUri) -> None:
    outcome, _ = await legit_during(uri, partial(silent_connections, uri, 0.02, 10.0))
    assert isinstance(outcome, IpcOutcome)
    assert outcome.closed == 60 and outcome.last_closed_s < 5.0, outcome.describe()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_connections_past_the_cap_are_closed_at_accept(scheme: str, nursery: trio.Nursery,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    uri = await start(nursery, scheme, IpcLimits(max_connections=8, first_request_timeout_s=1.0))
    with trio.fail_after(GUARD_S):
        outcome = await silent_connections(uri, 20 / 3000, 10.0)
    assert outcome.closed == 20
    assert outcome.closed_at_once >= 12, outcome.describe()
    assert caplog.text.count("ipc.connection_refused") == 1
    assert (await fetch_table(str(uri), LEGIT_TICKET)).num_rows == 1000  # once they are gone


async def test_want_data_flood_on_one_connection_is_cut_at_the_stream_cap(
    uri: IpcUri, caplog: pytest.LogCaptureFixture
) -> None:
    """20,000 want_data never read (before: 40,000 tasks, +450 MiB, a 4.2 s stall)."""
    outcome, peak = await legit_during(uri, partial(want_data_flood, uri, 1.0, 10.0))
    assert isinstance(outcome, IpcOutcome)
    assert outcome.closed == 1, outcome.describe()
    assert "max_streams_per_connection" in caplog.text
    assert peak < 64 * MiB, f"peak {peak / MiB:.1f} MiB"


async def test_a_client_that_stops_reading_is_dropped(uri: IpcUri) -> None:
    """16 streams (within the cap) never read: the sends stop at send_timeout_s (TCP) or the
    window of unfreed bodies at idle_timeout_s (shm)."""
    outcome, _ = await legit_during(uri, partial(want_data_flood, uri, 16 / 20_000, 10.0))
    assert isinstance(outcome, IpcOutcome)
    assert outcome.closed == 1 and outcome.last_closed_s < 5.0, outcome.describe()


async def test_an_idle_connection_is_closed_after_its_stream(uri: IpcUri) -> None:
    stream = await open_raw(uri)
    await stream.send_all(encode_frame_header(uri.want_data, len(LEGIT_TICKET)) + LEGIT_TICKET.encode())
    start_s = trio.current_time()
    with trio.fail_after(GUARD_S):
        while await stream.receive_some(1 << 16):  # the stream, then EOF at the idle deadline
            pass
    assert trio.current_time() - start_s < 5.0
    await stream.aclose()


def segments_mapped() -> int:
    """Distinct shared-memory segments mapped in this process (the server's, here)."""
    maps = Path("/proc/self/maps").read_text().splitlines()
    return len({line.split()[-2] for line in maps if "memfd:evergreen-ipc" in line})


async def test_shm_memory_is_capped_in_total(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """Item 12: segments of 4 MiB, 8 MiB in total: a third connection is refused at accept."""
    limits = IpcLimits(shm_segment_bytes=4 * MiB, shm_max_total_bytes=8 * MiB, shm_idle_segments=1,
                       first_request_timeout_s=1.0)
    uri = await start(nursery, "shm://", limits)
    with trio.fail_after(GUARD_S):
        outcome = await silent_connections(uri, 10 / 3000, 10.0)
        assert outcome.closed == 10 and outcome.closed_at_once == 8, outcome.describe()
        assert segments_mapped() <= 2
        assert "shm_max_total_bytes" in caplog.text
        assert (await fetch_table(str(uri), LEGIT_TICKET)).num_rows == 1000


def test_shm_total_below_one_segment_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="shm_max_total_bytes: expected at least"):
        IpcLimits(shm_segment_bytes=8 * MiB, shm_max_total_bytes=4 * MiB)


def test_sigterm_stops_ipc_serve_under_attack(tmp_path: Path) -> None:
    """After the want_data flood and 300 silent connections, SIGTERM still stops ``ipc serve``
    at once (before: the server ignored it)."""
    path = tmp_path / BIG_TICKET  # the ticket is the file's name
    table = big_table()
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=1 << 14)
    cmd = [sys.executable, "-m", "evergreen_trio.cli", "ipc", "serve", str(path), "--uri", "tcp://127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        uri = parse_uri(proc.stdout.readline().strip())

        async def attack() -> None:
            async with trio.open_nursery() as nursery:
                flood = partial(want_data_flood, uri, 1.0, 60.0)
                nursery.start_soon(flood)
                nursery.start_soon(partial(silent_connections, uri, 0.1, 60.0))
                await trio.sleep(1.5)
                proc.send_signal(signal.SIGTERM)
                start_s = time.monotonic()
                await trio.to_thread.run_sync(proc.wait)
                assert time.monotonic() - start_s < 5.0
                nursery.cancel_scope.cancel()

        trio.run(attack)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr


async def test_a_batch_whose_offsets_point_past_its_data_is_rejected(nursery: trio.Nursery) -> None:
    """A server's string offsets past the data buffer are refused, not handed out to crash a reader
    (pyarrow's IPC reader checks only the buffers' sizes)."""
    server = await hostile_server(nursery, offsets_past_the_data())
    with trio.fail_after(GUARD_S), pytest.raises(IpcError, match="Offset invariant failure"):
        await fetch_table(str(server.uri), "t")


async def test_a_compression_bomb_is_refused_before_it_inflates(nursery: trio.Nursery) -> None:
    """A few KiB of ZSTD inflating to 64 MiB, past max_decompressed_bytes=16 MiB (before: inflated
    and delivered; at the default limits 32 KiB became 1 GiB)."""
    server = await hostile_server(nursery, compression_bomb(64 * MiB))
    assert server.sent < 64 * 1024
    refused = pytest.raises(LimitExceededError, match=r"max_decompressed_bytes\), got 67108864 declared")
    with trio.fail_after(GUARD_S), refused:
        await fetch_table(str(server.uri), "bomb", limits=IpcLimits(max_decompressed_bytes=16 * MiB))


async def test_a_compressed_size_past_the_default_limit_is_refused_unallocated(nursery: trio.Nursery) -> None:
    """A 100-byte buffer claiming 1 TiB: refused from its prefix, at the default limits, before pyarrow
    allocates what it claims."""
    server = await hostile_server(nursery, forged_compressed_size(1 << 40))
    before = pa.default_memory_pool().bytes_allocated()
    refused = pytest.raises(LimitExceededError, match=rf"max_decompressed_bytes\), got {1 << 40} declared")
    with trio.fail_after(GUARD_S), refused:
        await fetch_table(str(server.uri), "bomb")
    assert pa.default_memory_pool().bytes_allocated() - before < 16 * MiB


async def test_bodies_held_for_metadata_that_never_comes_are_bounded(nursery: trio.Nursery) -> None:
    """64 bodies of 1 MiB and no schema: the client refuses the ninth past max_pending_bytes=8 MiB
    (before: it held all of them; at the defaults 4096 bodies of 2 GiB)."""
    server = await hostile_server(nursery, orphan_bodies(64, MiB))
    limits = IpcLimits(max_pending_bytes=8 * MiB, max_body_bytes=MiB)
    refused = pytest.raises(LimitExceededError, match=r"body 9: .*\(max_pending_bytes\), got 8388608 held")
    with trio.fail_after(10), refused:
        await fetch_table(str(server.uri), "park", limits=limits)


def test_pending_bytes_below_one_body_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="max_pending_bytes: expected at least max_body_bytes"):
        IpcLimits(max_pending_bytes=MiB, max_body_bytes=2 * MiB)
