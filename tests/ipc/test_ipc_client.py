"""A kept connection (``ipc.connect``): fetches after the first skip the set-up, over every transport."""

from __future__ import annotations

import gc

import numpy as np
import pyarrow as pa
import pytest
import trio
from ipc_helpers import client_mappings, sample_table

from evergreen_trio.ipc import (
    Catalog,
    IpcLimits,
    RequestRefusedError,
    ServeOptions,
    TransportError,
    connect,
    fetch_table,
    serve,
)
from evergreen_trio.ipc.gpu import DeviceMemory, connect_device, device_catalog_entry

SCHEMES = [
    "tcp://127.0.0.1:0",
    "shm://",
    pytest.param("ucx://127.0.0.1:0", marks=pytest.mark.ucx),
]
GUARD_S = 30  # a hang guard, not a timing assertion


def catalog() -> Catalog:
    served = Catalog()
    served.add_table("t", sample_table(), max_chunksize=3_000)
    served.add_table("small", sample_table(100))
    return served


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_fetches_share_one_connection(scheme: str, nursery: trio.Nursery) -> None:
    uri = await nursery.start(serve, scheme, catalog())
    with trio.fail_after(GUARD_S):
        async with connect(uri) as client:
            for ticket, rows in [("t", 20_000), ("small", 100), ("t", 20_000)]:
                assert (await client.fetch_table(ticket)).equals(sample_table(rows))
            async with client.fetch("t") as stream:
                batches = [batch async for batch in stream]
            assert pa.Table.from_batches(batches).equals(sample_table())
            assert client.connections == 1
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_stream_left_early_closes_its_connection_and_the_next_fetch_opens_one(
    scheme: str, nursery: trio.Nursery
) -> None:
    uri = await nursery.start(serve, scheme, catalog())
    with trio.fail_after(GUARD_S):
        async with connect(uri) as client:
            async with client.fetch("t") as stream:
                first = await stream.__anext__()
            assert first.num_rows == 3_000
            del first, stream
            assert (await client.fetch_table("t")).equals(sample_table())
            assert client.connections == 2
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_a_connection_the_server_closed_while_kept_is_replaced(scheme: str, nursery: trio.Nursery) -> None:
    options = ServeOptions(limits=IpcLimits(idle_timeout_s=0.2, first_request_timeout_s=5))
    uri = await nursery.start(serve, scheme, catalog(), options)
    with trio.fail_after(GUARD_S):
        async with connect(uri) as client:
            assert (await client.fetch_table("small")).equals(sample_table(100))
            await trio.sleep(1.0)  # the server closes the idle connection
            assert (await client.fetch_table("small")).equals(sample_table(100))
            assert client.connections == 2
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("scheme", SCHEMES)
async def test_an_unknown_ticket_is_refused_and_the_client_fetches_on(scheme: str, nursery: trio.Nursery) -> None:
    uri = await nursery.start(serve, scheme, catalog())
    with trio.fail_after(GUARD_S):
        async with connect(uri) as client:
            assert (await client.fetch_table("small")).equals(sample_table(100))
            with pytest.raises(RequestRefusedError, match="unknown ticket b'nope'"):
                await client.fetch_table("nope")
            assert (await client.fetch_table("small")).equals(sample_table(100))
    nursery.cancel_scope.cancel()


async def test_a_closed_client_leaves_no_cycle_holding_its_mapping(nursery: trio.Nursery) -> None:
    """Its connection is let go at once, not when the garbage collector next runs: closing it by
    cancelling the task that held it left a Cancelled whose traceback held the connection (and the
    client's mapping of the segment) in a reference cycle on CPython 3.13."""
    uri = await nursery.start(serve, "shm://", catalog(), ServeOptions(publish=False))
    gc.collect()  # what earlier tests left for the collector
    gc.disable()
    try:
        with trio.fail_after(GUARD_S):
            async with connect(uri) as client, client.fetch("t") as stream:
                rows = sum([batch.num_rows async for batch in stream])
            assert rows == 20_000
            del client, stream
            assert client_mappings() == []
            assert (await fetch_table(uri, "t")).num_rows == 20_000
            assert client_mappings() == []
    finally:
        gc.enable()
    nursery.cancel_scope.cancel()


async def test_fetches_from_several_tasks_take_turns(nursery: trio.Nursery) -> None:
    uri = await nursery.start(serve, "tcp://127.0.0.1:0", catalog())
    tables: list[pa.Table] = []
    with trio.fail_after(GUARD_S):
        async with connect(uri) as client, trio.open_nursery() as fetchers:
            for _ in range(4):
                fetchers.start_soon(lambda: _append(client, tables))
    assert len(tables) == 4 and all(table.equals(sample_table()) for table in tables)
    nursery.cancel_scope.cancel()


async def _append(client: object, tables: list[pa.Table]) -> None:
    tables.append(await client.fetch_table("t"))  # type: ignore[attr-defined]


@pytest.mark.ucx
async def test_device_fetches_share_one_connection(nursery: trio.Nursery) -> None:
    """The GPU client over real UCX, NumPy arrays standing in for device buffers."""
    memory = DeviceMemory(lambda n: np.empty(n, np.uint8), np.array, lambda a: np.array(a, copy=True), lambda: None)
    served = Catalog()
    served.add_messages("t", device_catalog_entry(sample_table(), max_chunksize=3_000, memory=memory))
    uri = await nursery.start(serve, "ucx://127.0.0.1:0", served)
    with trio.fail_after(GUARD_S):
        async with connect_device(uri, memory=memory) as client:
            for _ in range(3):
                batches, table = await client.fetch("t", host=True)
                assert table is not None and table.equals(sample_table())
                assert all(isinstance(batch.body, np.ndarray) for batch in batches)
            assert client.client.connections == 1
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("eager", [True, False])
async def test_no_server_is_a_transport_error_from_connect_or_the_first_fetch(eager: bool) -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    with trio.fail_after(GUARD_S), pytest.raises(TransportError, match="expected a listening server"):
        async with connect(f"tcp://127.0.0.1:{port}?want_data=1", eager=eager) as client:
            assert not eager, "an eager client connects before its block runs"
            await client.fetch_table("t")
