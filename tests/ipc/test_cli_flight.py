"""The CLI (`ipc serve` / `ipc get`) and the Flight control plane."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.flight as flight
import pytest
import trio
from ipc_helpers import sample_table

from evergreen_trio.ipc import Catalog, serve
from evergreen_trio.ipc.cli import get
from evergreen_trio.ipc.errors import TransportError, UnknownTicketError
from evergreen_trio.ipc.flight import ControlPlane, fetch_through_flight


def write_file(path: Path) -> pa.Table:
    table = sample_table()
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=4_000)
    return table


@pytest.mark.parametrize(
    "uri", ["tcp://127.0.0.1:0", "shm://", pytest.param("ucx://127.0.0.1:0", marks=pytest.mark.ucx)]
)
async def test_serve_prints_the_uri_and_get_writes_a_file(tmp_path: Path, uri: str) -> None:
    table = write_file(tmp_path / "data.arrow")
    cmd = [sys.executable, "-m", "evergreen_trio.cli", "ipc", "serve", str(tmp_path / "data.arrow"), "--uri", uri]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # noqa: ASYNC220
    try:
        assert proc.stdout is not None
        served = await trio.to_thread.run_sync(proc.stdout.readline)
        assert served.startswith(uri.split(":")[0] + "://") and "want_data=" in served
        with trio.fail_after(60):
            rows = await get(served.strip(), "data.arrow", tmp_path / "out.arrow")
    finally:
        proc.terminate()
        proc.wait()
    assert rows == table.num_rows
    assert pa.ipc.open_file(str(tmp_path / "out.arrow")).read_all().equals(table)


@pytest.mark.ucx
async def test_ucx_serve_prints_the_uri_first_and_ucx_logs_to_stderr(tmp_path: Path) -> None:
    # An unknown UCX_ variable makes UCX log a warning: it must go to stderr, never before the URI.
    write_file(tmp_path / "data.arrow")
    cmd = [sys.executable, "-m", "evergreen_trio.cli", "ipc", "serve", str(tmp_path / "data.arrow"), "--uri",
           "ucx://127.0.0.1:0"]
    env = {**os.environ, "UCX_NOT_A_VARIABLE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # noqa: ASYNC220
    try:
        assert proc.stdout is not None
        first = await trio.to_thread.run_sync(proc.stdout.readline)
        assert first.startswith("ucx://") and "want_data=" in first
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    assert "UCX" not in out
    assert "UCX_NOT_A_VARIABLE" in err


async def test_two_serve_processes_split_metadata_and_data(tmp_path: Path) -> None:
    table = write_file(tmp_path / "data.arrow")
    base = [sys.executable, "-m", "evergreen_trio.cli", "ipc", "serve", str(tmp_path / "data.arrow")]
    procs = []
    for role, uri in (("metadata", "tcp://127.0.0.1:0"), ("data", "shm://")):
        cmd = [*base, "--role", role, "--uri", uri]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))  # noqa: ASYNC220
    try:
        meta_uri, data_uri = [(await trio.to_thread.run_sync(p.stdout.readline)).strip() for p in procs]  # type: ignore[union-attr]
        with trio.fail_after(60):
            rows = await get(meta_uri, "data.arrow", tmp_path / "out.arrow", data_uri=data_uri)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    assert rows == table.num_rows
    assert pa.ipc.open_file(str(tmp_path / "out.arrow")).read_all().equals(table)


async def test_flight_points_at_the_dissociated_uri(nursery: trio.Nursery) -> None:
    catalog = Catalog()
    catalog.add_table("t", sample_table(), max_chunksize=5_000)
    uri = await nursery.start(serve, "tcp://127.0.0.1:0", catalog)
    plane = ControlPlane("grpc://127.0.0.1:0", catalog, uri)
    try:
        location = f"grpc://127.0.0.1:{plane.port}"
        info = await trio.to_thread.run_sync(
            lambda: flight.connect(location).get_flight_info(flight.FlightDescriptor.for_path(b"t"))
        )
        assert info.endpoints[0].locations[0].uri.decode() == str(uri)
        assert info.total_records == sample_table().num_rows
        assert (await fetch_through_flight(location, "t")).equals(sample_table())
        plain = await trio.to_thread.run_sync(lambda: flight.connect(location).do_get(flight.Ticket(b"t")).read_all())
        assert plain.equals(sample_table())
    finally:
        await trio.to_thread.run_sync(plane.shutdown)
    nursery.cancel_scope.cancel()


async def test_flight_fetch_from_a_closed_port_is_a_transport_error() -> None:
    """Connection refused is the transport's failure, not an unknown ticket (it was UnknownTicketError)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with trio.fail_after(30), pytest.raises(TransportError, match=r"Connection refused|unavailable") as caught:
        await fetch_through_flight(f"grpc://127.0.0.1:{port}", "t")
    assert not isinstance(caught.value, UnknownTicketError)
