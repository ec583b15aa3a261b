"""GPU bodies over UCX (CuPy device memory on both ends).

The device tests skip cleanly without CuPy and a CUDA device. On a GPU host run them in
a process of their own, so that the process's UCX context is created after the CUDA
context: ``make test-gpu`` (``CUDA=13`` on a CUDA 13 driver), which fails without a device.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pytest
import trio
from ipc_helpers import sample_table

from evergreen_trio.ipc import Catalog, ServeOptions, serve
from evergreen_trio.ipc.arrow import OutgoingMessage, messages_from_table
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.device_pool import DEFAULT_GROWTH_CAP
from evergreen_trio.ipc.errors import ConnectionLostError, IpcError, LimitExceededError, UriError
from evergreen_trio.ipc.gpu import DeviceMemory, cupy_memory, device_catalog_entry, fetch_device

GUARD_S = 60  # a hang guard, not a timing assertion


def ucx_inflight() -> list[int]:
    from evergreen_trio.ipc.transports.ucx_bridge import open_bridges

    return [b.inflight for b in open_bridges()]


def device_catalog(table: pa.Table, chunk: int) -> Catalog:
    catalog = Catalog()
    catalog.add_messages("t", device_catalog_entry(table, max_chunksize=chunk))
    return catalog


async def test_gpu_fetch_wants_a_ucx_uri() -> None:
    with pytest.raises(UriError, match="ucx://"):
        await fetch_device("tcp://127.0.0.1:1?want_data=1", "t")


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
async def test_gpu_fetch_without_cupy_is_a_typed_error() -> None:
    with pytest.raises(IpcError, match="CuPy"):
        await fetch_device("ucx://127.0.0.1:1?want_data=1", "t")


@pytest.mark.gpu
@pytest.mark.parametrize(("growth_cap", "driver_calls"), [(DEFAULT_GROWTH_CAP, 7), (0, 64)])
def test_cupy_memory_grows_a_fresh_pool_in_few_driver_allocations(growth_cap: int, driver_calls: int) -> None:
    """64 bodies of 1 MiB from a fresh CuPy pool: each rise of the pool's total is one ``cudaMalloc``.

    Every body is its own allocation all the same: filled, they keep their own bytes, and dropped,
    each goes back to the pool.
    """
    import cupy

    pool = cupy.cuda.MemoryPool()
    memory = cupy_memory(growth_cap=growth_cap, pool=pool)
    bodies, rises, total = [], 0, 0
    for i in range(64):
        body = memory.allocate(1 << 20)
        body.fill(i)
        bodies.append(body)
        rises, total = rises + (pool.total_bytes() > total), max(total, pool.total_bytes())
    assert memory.allocate(0).nbytes == 0
    assert rises == driver_calls
    assert [(int(b.min()), int(b.max())) for b in bodies] == [(i, i) for i in range(64)]
    del bodies, body
    assert pool.used_bytes() == 0


async def server_left_alone() -> None:
    """Wait (under the caller's guard) until only the server's listener bridge is open, idle.

    The client's bridge closes before its fetch returns; the server's bridge for that connection
    closes once it has the client's BYE, a moment later: so right after a fetch two are open, with
    nothing in flight (the ``[0, 0]`` seen on a GPU host), which is not a leak.
    """
    while ucx_inflight() != [0]:  # noqa: ASYNC110
        await trio.sleep(0.05)


@pytest.mark.gpu
@pytest.mark.ucx
@pytest.mark.parametrize("chunk", [3_000, 20_000])
async def test_device_bodies_arrive_in_device_memory_byte_exact(chunk: int) -> None:
    """Dictionaries included: the host table equals the source, and each device body
    holds exactly the bytes of the matching host body."""
    import cupy

    table = sample_table()
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            uri = await nursery.start(serve, "ucx://127.0.0.1:0", device_catalog(table, chunk))
            received, host = await fetch_device(str(uri), "t", host=True)
            await server_left_alone()
            nursery.cancel_scope.cancel()
    assert ucx_inflight() == []
    assert host is not None and host.equals(table)
    expected: Sequence[OutgoingMessage] = [
        m for m in messages_from_table(table, max_chunksize=chunk) if m.body is not None and m.body.size
    ]
    assert [m.header.kind for m in received] == [m.header.kind for m in expected]
    for got, want in zip(received, expected, strict=True):
        assert isinstance(got.body, cupy.ndarray)
        assert all(isinstance(view, cupy.ndarray) for view in got.buffers)
        assert got.body.nbytes == got.header.body_length
        assert bytes(cupy.asnumpy(got.body)) == want.body.to_pybytes()  # type: ignore[union-attr]


@pytest.mark.gpu
@pytest.mark.ucx
async def test_device_body_over_the_limit_is_rejected_before_allocation(nursery: trio.Nursery) -> None:
    rows = 2**20
    table = pa.table({"x": np.arange(rows, dtype=np.float64)})
    uri = await nursery.start(serve, "ucx://127.0.0.1:0", device_catalog(table, rows))
    with trio.fail_after(GUARD_S), pytest.raises(LimitExceededError, match="body"):
        await fetch_device(str(uri), "t", IpcLimits(max_body_bytes=1024))
    nursery.cancel_scope.cancel()


class _DyingCatalog(Catalog):
    """Cancels the server the moment a client asks for a stream (a server dying mid-stream)."""

    def __init__(self, scope: trio.CancelScope) -> None:
        super().__init__()
        self.scope = scope

    def lookup(self, ticket: bytes) -> Sequence[OutgoingMessage]:
        self.scope.cancel()
        return super().lookup(ticket)


LOST_WITHIN_S = 5
"""A peer dying mid-stream is a ConnectionLostError within this (a hang guard, not a timing test)."""


@pytest.mark.ucx
@pytest.mark.parametrize("device", [pytest.param("cupy", marks=pytest.mark.gpu), "numpy"])
async def test_device_server_dying_mid_stream_is_a_clear_error(device: str, caplog: pytest.LogCaptureFixture) -> None:
    """The server stops with a 2 MiB body announced and its rendezvous not done.

    On a GPU the body moves by a sender-driven rendezvous (CUDA staging), which never completes
    once the server's worker stops, and a graceful close is no endpoint error: the client hung
    until the server's BYE was made to end its wait. ``UCX_TLS=tcp,self`` does the same on a CPU
    (the next test); the default CPU transports (CMA) are receiver-driven. Afterwards no bridge is
    open, so nothing is in flight.
    """
    memory = HostAsDevice().memory() if device == "numpy" else None
    rows = 4 * 2**20
    table = pa.table({"x": np.arange(rows, dtype=np.float64)})
    scope = trio.CancelScope()
    catalog = _DyingCatalog(scope)
    catalog.add_messages("t", device_catalog_entry(table, max_chunksize=2**18, memory=memory))
    options = ServeOptions(limits=IpcLimits(max_unacked_bodies=1))
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:

            async def run_server(task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await serve("ucx://127.0.0.1:0", catalog, options, task_status=task_status)

            uri = await nursery.start(run_server)
            with trio.fail_after(LOST_WITHIN_S), pytest.raises(ConnectionLostError):
                await fetch_device(str(uri), "t", memory=memory)
    assert ucx_inflight() == []
    if device == "numpy" and "UCX_TLS" not in os.environ:
        # CMA is receiver-driven: every request ends. A receive on a sender-driven rendezvous that
        # stopped ends only with its worker (it and its buffer are kept until then, not freed).
        assert not [r for r in caplog.records if "unreaped" in r.getMessage()]


@pytest.mark.ucx
async def test_server_dying_with_a_sender_driven_rendezvous_is_a_clear_error() -> None:
    """The NumPy case above in a process whose UCX moves bodies over tcp, as CUDA staging does."""
    test = f"{__file__}::test_device_server_dying_mid_stream_is_a_clear_error[numpy]"
    done = await trio.run_process([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                                  env={**os.environ, "UCX_TLS": "tcp,self"}, capture_stdout=True, check=False)
    assert done.returncode == 0, done.stdout.decode()[-3000:]


@pytest.mark.gpu
@pytest.mark.ucx
async def test_device_stream_never_copies_to_the_host_unless_asked(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    import cupy

    table = sample_table()
    uri = await nursery.start(serve, "ucx://127.0.0.1:0", device_catalog(table, 3_000))

    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("a device body was copied to the host")

    with trio.fail_after(GUARD_S):
        monkeypatch.setattr(cupy, "asnumpy", forbidden)
        received, host = await fetch_device(str(uri), "t")
    assert host is None
    assert received and all(isinstance(view, cupy.ndarray) for b in received for view in b.buffers)
    nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- the same code on the CPU: NumPy as "device"


class HostAsDevice:
    """A DeviceMemory on NumPy that counts the copies the stream makes to the host."""

    def __init__(self) -> None:
        self.to_host_calls = 0
        self.allocated: list[np.ndarray] = []

    def memory(self) -> DeviceMemory:
        def allocate(nbytes: int) -> np.ndarray:
            array = np.empty(nbytes, np.uint8)
            self.allocated.append(array)
            return array

        def to_host(array: np.ndarray) -> np.ndarray:
            self.to_host_calls += 1
            return np.array(array, copy=True)

        return DeviceMemory(allocate, np.array, to_host, lambda: None)


@pytest.mark.ucx
@pytest.mark.parametrize("host", [False, True])
async def test_device_path_with_numpy_stand_in_keeps_bodies_where_they_landed(
    host: bool, nursery: trio.Nursery
) -> None:
    """Real UCX, NumPy arrays standing in for device buffers: each body lands in a buffer the
    DeviceMemory allocated, its views are slices of it, and the host sees a copy only if asked."""
    table = sample_table()
    fake = HostAsDevice()
    catalog = Catalog()
    catalog.add_messages("t", device_catalog_entry(table, max_chunksize=3_000, memory=fake.memory()))
    uri = await nursery.start(serve, "ucx://127.0.0.1:0", catalog)
    with trio.fail_after(GUARD_S):
        received, host_table = await fetch_device(str(uri), "t", memory=fake.memory(), host=host)
    expected = [m for m in messages_from_table(table, max_chunksize=3_000) if m.body is not None and m.body.size]
    assert [b.kind for b in received] == [m.header.kind for m in expected]
    for got, want in zip(received, expected, strict=True):
        assert any(got.body is array for array in fake.allocated)
        assert got.body.tobytes() == want.body.to_pybytes()  # type: ignore[union-attr]
        for view, (offset, length) in zip(got.buffers, got.header.buffers, strict=True):
            assert view.base is got.body and view.nbytes == length
            assert view.tobytes() == want.body.to_pybytes()[offset : offset + length]  # type: ignore[union-attr]
    if host:
        assert host_table is not None and host_table.equals(table)
        assert fake.to_host_calls == len(received)
    else:
        assert host_table is None and fake.to_host_calls == 0
    nursery.cancel_scope.cancel()
