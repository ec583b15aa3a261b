"""Arrow tables by reference inside a real Evergreen session (gRPC) over real IPC transports."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.flight as flight
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio import Server, blob, connect, ref
from evergreen_trio.arrow_refs import (
    ARROW_STREAM,
    ArrowExchange,
    ArrowRefResolver,
    arrow_ref,
    open_arrow,
    read_arrow,
)
from evergreen_trio.dag import RefRejectedError, SessionAbortedError, StatusCode
from evergreen_trio.ipc import Catalog, IpcLimits, serve
from evergreen_trio.nursery_session import ActionContext

GUARD_S = 120
SCHEMES = [
    "tcp://127.0.0.1:0",
    "shm://",
    pytest.param("ucx://127.0.0.1:0", marks=pytest.mark.ucx),
]


def table_of(nbytes: int) -> pa.Table:
    rows = nbytes // 16
    return pa.table({"a": np.arange(rows, dtype=np.int64), "b": np.arange(rows, dtype=np.float64) * 0.5})


def doubling_server(exchange: ArrowExchange, **server_options: object) -> Server:
    """An action reading a table by ref (or inline) and publishing a derived table by ref."""
    server = Server(**server_options)  # type: ignore[arg-type]

    @server.action("DOUBLE", inputs=["table"], outputs=["table"])
    async def double(ctx: ActionContext) -> None:
        batches = []
        async for chunk in ctx.input("table"):
            async with open_arrow(chunk) as stream:
                async for batch in stream:
                    batches.append(pa.record_batch([batch["a"], pc.multiply(batch["b"], 2)], ["a", "b"]))
        await exchange.publish(ctx.output("table"), pa.Table.from_batches(batches))

    @server.action("ROWS", inputs=["table"], outputs=["rows"])
    async def rows(ctx: ActionContext) -> None:
        total = 0
        async for chunk in ctx.input("table"):
            async with open_arrow(chunk) as stream:
                async for batch in stream:
                    total += batch.num_rows
        await ctx.output("rows").write(str(total), last=True)

    return server


async def start_exchange(nursery: trio.Nursery, uri: str) -> ArrowExchange:
    exchange = ArrowExchange(uri, max_chunksize=1 << 16)
    await nursery.start(exchange.serve)
    return exchange


async def start_server(nursery: trio.Nursery, server: Server) -> str:
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return f"127.0.0.1:{port}"


@pytest.mark.parametrize("uri", SCHEMES)
async def test_table_goes_in_and_comes_out_by_reference(uri: str) -> None:
    table = table_of(4 << 20)
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            server_exchange = await start_exchange(nursery, uri)
            client_exchange = await start_exchange(nursery, uri)
            server = doubling_server(server_exchange, resolvers=server_exchange.resolvers())
            address = await start_server(nursery, server)
            async with connect(address, resolvers=client_exchange.resolvers()) as session:
                table_ref = client_exchange.add(table)
                assert table_ref.startswith(uri.split(":")[0] + "://")
                call = await session.run("DOUBLE", {"table": ref(table_ref, mimetype=ARROW_STREAM)}, ["table"])
                got = [(chunk.mimetype, await read_arrow(chunk)) async for chunk in call["table"]]
            nursery.cancel_scope.cancel()
    [(mimetype, doubled)] = got
    assert mimetype == ARROW_STREAM
    assert doubled.column("a").equals(table.column("a"))
    assert np.array_equal(doubled.column("b").to_numpy(), table.column("b").to_numpy() * 2)


async def test_the_same_handler_reads_an_inline_arrow_stream(nursery: trio.Nursery) -> None:
    table = table_of(1 << 20)
    exchange = await start_exchange(nursery, "tcp://127.0.0.1:0")
    address = await start_server(nursery, doubling_server(exchange))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    async with connect(address) as session:
        call = await session.run("ROWS", {"table": blob(sink.getvalue().to_pybytes(), mimetype=ARROW_STREAM)}, ["rows"])
        assert await call["rows"].read_text() == str(table.num_rows)


async def test_an_inline_stream_whose_offsets_point_past_its_data_is_a_protocol_violation(
    nursery: trio.Nursery,
) -> None:
    """A peer's inline string offsets past the data buffer abort the session instead of reaching the handler."""
    exchange = await start_exchange(nursery, "tcp://127.0.0.1:0")
    address = await start_server(nursery, doubling_server(exchange))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, pa.schema({"s": pa.string()})) as writer:
        writer.write_table(pa.table({"s": ["a", "bb", "ccc"]}))
    stream = bytearray(sink.getvalue().to_pybytes())
    offsets = bytes(stream).rindex(b"".join(n.to_bytes(4, "little") for n in (0, 1, 3, 6)))
    stream[offsets + 4 : offsets + 8] = (1 << 30).to_bytes(4, "little")  # the second string's start
    with pytest.raises(SessionAbortedError, match="Offset invariant failure") as caught:
        async with connect(address) as session:
            call = await session.run("ROWS", {"table": blob(bytes(stream), mimetype=ARROW_STREAM)}, ["rows"])
            await call["rows"].read_text()
    assert caught.value.code == StatusCode.INVALID_ARGUMENT


async def test_flight_grpc_location_resolves_to_the_ipc_stream(nursery: trio.Nursery) -> None:
    from evergreen_trio.ipc.flight import ControlPlane

    table = table_of(1 << 20)
    catalog = Catalog()
    catalog.add_table("t", table, max_chunksize=1 << 15)
    data_uri = await nursery.start(serve, "tcp://127.0.0.1:0", catalog)
    plane = ControlPlane("grpc://127.0.0.1:0", catalog, data_uri)
    try:
        exchange = await start_exchange(nursery, "tcp://127.0.0.1:0")
        address = await start_server(nursery, doubling_server(exchange, resolvers=exchange.resolvers()))
        async with connect(address) as session:
            flight_ref = arrow_ref(f"grpc://127.0.0.1:{plane.port}", "t")
            call = await session.run("ROWS", {"table": ref(flight_ref, mimetype=ARROW_STREAM)}, ["rows"])
            assert await call["rows"].read_text() == str(table.num_rows)
    finally:
        plane.shutdown()


async def abort_of(address: str, uri: str) -> SessionAbortedError:
    with pytest.raises(SessionAbortedError) as caught:
        async with connect(address) as session:
            call = await session.run("ROWS", {"table": ref(uri, mimetype=ARROW_STREAM)}, ["rows"])
            await call["rows"].read_text()
    return caught.value


async def test_a_flight_location_cannot_point_past_the_allowed_hosts(nursery: trio.Nursery) -> None:
    """The data URI a Flight server answers with passes the allow-lists too: an allowed (loopback) Flight
    server pointing at a host outside them (127.0.0.2 here) is PERMISSION_DENIED, and nothing connects there."""
    from evergreen_trio.ipc.flight import ControlPlane

    catalog = Catalog()
    catalog.add_table("t", table_of(1 << 10))
    data_uri = await nursery.start(serve, "tcp://127.0.0.2:0", catalog)
    plane = ControlPlane("grpc://127.0.0.1:0", catalog, data_uri)
    try:
        resolver = ArrowRefResolver("grpc")
        with pytest.raises(RefRejectedError, match="host not allowed") as caught:
            async with resolver.open_batches(arrow_ref(f"grpc://127.0.0.1:{plane.port}", "t")) as batches:
                async for _ in batches:
                    pass
    finally:
        plane.shutdown()
    assert caught.value.code == StatusCode.PERMISSION_DENIED


async def test_a_flight_server_that_does_not_answer_is_unavailable_after_the_connect_timeout(
    nursery: trio.Nursery,
) -> None:
    """GetFlightInfo has a deadline (``connect_timeout_s``): a Flight server that holds the call (5 s here)
    does not hold the resolver with it."""
    from evergreen_trio.ipc.flight import ControlPlane

    release = threading.Event()

    class Stalling(ControlPlane):
        def get_flight_info(self, context: object, descriptor: object) -> object:
            release.wait(5)
            return super().get_flight_info(context, descriptor)

    catalog = Catalog()
    catalog.add_table("t", table_of(1 << 10))
    plane = Stalling("grpc://127.0.0.1:0", catalog, await nursery.start(serve, "tcp://127.0.0.1:0", catalog))
    try:
        resolver = ArrowRefResolver("grpc", limits=IpcLimits(connect_timeout_s=0.5))
        started = time.monotonic()
        with pytest.raises(RefRejectedError, match=r"no answer within 0\.5s") as caught:
            async with resolver.open_batches(arrow_ref(f"grpc://127.0.0.1:{plane.port}", "t")) as batches:
                async for _ in batches:
                    pass
        assert time.monotonic() - started < 4
    finally:
        release.set()
        plane.shutdown()
    assert caught.value.code == StatusCode.UNAVAILABLE


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def flight_ref_code(location: str, ticket: str) -> tuple[StatusCode, str]:
    with pytest.raises(RefRejectedError) as caught:
        async with ArrowRefResolver("grpc").open_batches(arrow_ref(location, ticket)) as batches:
            async for _ in batches:
                pass
    return caught.value.code, str(caught.value)


async def test_a_flight_server_that_is_not_there_is_unavailable_not_an_unknown_ticket() -> None:
    """Connection refused (gRPC UNAVAILABLE) was reported as NOT_FOUND, as if the ticket were unknown."""
    with trio.fail_after(GUARD_S):
        code, message = await flight_ref_code(f"grpc://127.0.0.1:{closed_port()}", "t")
    assert code == StatusCode.UNAVAILABLE, message
    assert "Connection refused" in message or "unavailable" in message


async def test_only_an_unknown_ticket_answer_is_not_found(nursery: trio.Nursery) -> None:
    """ControlPlane's answer for a ticket it does not have, and a Flight server's NOT_FOUND, are NOT_FOUND;
    a Flight server failing otherwise (INTERNAL) is UNAVAILABLE."""
    from evergreen_trio.ipc.flight import ControlPlane

    class Answering(flight.FlightServerBase):  # type: ignore[misc]
        def get_flight_info(self, context: object, descriptor: flight.FlightDescriptor) -> flight.FlightInfo:
            if descriptor.path[0] == b"gone":
                raise KeyError("no such flight")  # pyarrow answers NOT_FOUND
            raise flight.FlightInternalError("disk on fire")

    catalog = Catalog()
    catalog.add_table("t", table_of(1 << 10))
    plane = ControlPlane("grpc://127.0.0.1:0", catalog, await nursery.start(serve, "tcp://127.0.0.1:0", catalog))
    other = Answering("grpc://127.0.0.1:0")
    try:
        with trio.fail_after(GUARD_S):
            assert (await flight_ref_code(f"grpc://127.0.0.1:{plane.port}", "missing"))[0] == StatusCode.NOT_FOUND
            assert (await flight_ref_code(f"grpc://127.0.0.1:{other.port}", "gone"))[0] == StatusCode.NOT_FOUND
            code, message = await flight_ref_code(f"grpc://127.0.0.1:{other.port}", "t")
            assert code == StatusCode.UNAVAILABLE and "disk on fire" in message
    finally:
        plane.shutdown()
        other.shutdown()


async def test_refs_are_refused_unless_the_server_enables_them(nursery: trio.Nursery) -> None:
    exchange = await start_exchange(nursery, "tcp://127.0.0.1:0")
    table_ref = exchange.add(table_of(1 << 16))
    closed = await start_server(nursery, doubling_server(exchange))
    assert (await abort_of(closed, table_ref)).code == StatusCode.INVALID_ARGUMENT
    opened = await start_server(nursery, doubling_server(exchange, resolvers=exchange.resolvers()))
    far = table_ref.replace("127.0.0.1", "10.1.2.3")
    assert (await abort_of(opened, far)).code == StatusCode.PERMISSION_DENIED
    assert (await abort_of(opened, "shm:///etc/evil.sock?want_data=1&ticket=x")).code == StatusCode.PERMISSION_DENIED
    assert (await abort_of(opened, "tcp://127.0.0.1:1?want_data=1")).code == StatusCode.INVALID_ARGUMENT
    # The server keeps serving: a good ref still works.
    async with connect(opened) as session:
        call = await session.run("ROWS", {"table": ref(table_ref, mimetype=ARROW_STREAM)}, ["rows"])
        assert await call["rows"].read_text() == str((1 << 16) // 16)


@pytest.mark.parametrize(
    "uri",
    [
        "tcp://127.0.0.1:5?want_data=1",
        "tcp://127.0.0.1:5?want_data=1&ticket=a&ticket=b",
        "tcp://127.0.0.1?want_data=1&ticket=a",
        "tcp://127.0.0.1:5?ticket=a",
        "tcp://127.0.0.1:5?want_data=%C2%B2&ticket=a",
        "grpc://127.0.0.1?ticket=a",
        "http://127.0.0.1:5?want_data=1&ticket=a",
    ],
)
def test_malformed_refs_are_invalid_argument(uri: str) -> None:
    scheme = uri.split(":")[0]
    resolver = ArrowRefResolver(scheme if scheme != "http" else "tcp")
    with pytest.raises(RefRejectedError) as caught:
        resolver.check(uri)
    assert caught.value.code in (StatusCode.INVALID_ARGUMENT, StatusCode.PERMISSION_DENIED)


@pytest.mark.fuzz
@given(st.sampled_from(["tcp", "shm", "ucx", "grpc"]), st.text(max_size=120))
def test_fuzz_any_ref_text_is_accepted_or_refused_with_a_status(scheme: str, tail: str) -> None:
    resolver = ArrowRefResolver(scheme)
    for uri in (tail, f"{scheme}://{tail}", f"{scheme}://127.0.0.1:9?want_data=1&ticket={tail}"):
        try:
            resolver.check(uri)
        except RefRejectedError as refused:
            assert refused.code in (StatusCode.INVALID_ARGUMENT, StatusCode.PERMISSION_DENIED)


async def test_a_ticket_the_server_does_not_know_is_a_clear_error() -> None:
    with trio.fail_after(GUARD_S):
        async with trio.open_nursery() as nursery:
            uri = await nursery.start(serve, "tcp://127.0.0.1:0", Catalog())
            resolver = ArrowRefResolver("tcp", limits=IpcLimits(connect_timeout_s=5))
            with pytest.raises(RefRejectedError) as caught:
                async with resolver.open_batches(arrow_ref(uri, "missing")) as batches:
                    async for _ in batches:
                        pass
            nursery.cancel_scope.cancel()
    assert caught.value.code in (StatusCode.NOT_FOUND, StatusCode.UNAVAILABLE)


# ---------------------------------------------------------------- 256 MiB, by reference against inline


@dataclass
class Counted:
    bytes_up: int = 0
    bytes_down: int = 0


async def counting_proxy(target_port: int, counted: Counted, task_status: trio.TaskStatus[int]) -> None:
    """A TCP relay in front of the gRPC server: counts the session's bytes on the wire."""

    async def pump(source: trio.SocketStream, sink: trio.SocketStream, up: bool) -> None:
        try:
            async for data in source:
                if up:
                    counted.bytes_up += len(data)
                else:
                    counted.bytes_down += len(data)
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(sink)

    async def handle(client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", target_port)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, upstream, True)
            nursery.start_soon(pump, upstream, client, False)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handle, listeners)


async def move_table(table: pa.Table, uri: str, *, by_ref: bool) -> tuple[int, float]:
    """Send ``table`` to ROWS through a session; return (gRPC bytes client->server, seconds)."""
    counted = Counted()
    async with trio.open_nursery() as nursery:
        exchange = await start_exchange(nursery, uri)
        server = doubling_server(exchange, resolvers=exchange.resolvers())
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        proxy_port = await nursery.start(counting_proxy, port, counted)
        if by_ref:
            node = ref(exchange.add(table), mimetype=ARROW_STREAM)
        else:
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
            node = blob(sink.getvalue().to_pybytes(), mimetype=ARROW_STREAM)
        start = time.perf_counter()
        async with connect(f"127.0.0.1:{proxy_port}") as session:
            call = await session.run("ROWS", {"table": node}, ["rows"])
            assert await call["rows"].read_text() == str(table.num_rows)
        elapsed = time.perf_counter() - start
        nursery.cancel_scope.cancel()
    return counted.bytes_up, elapsed


@pytest.mark.parametrize("uri", ["tcp://127.0.0.1:0", "shm://"])
async def test_256_mib_table_by_reference_against_inline(uri: str) -> None:
    table = table_of(256 << 20)
    with trio.fail_after(4 * GUARD_S):
        ref_bytes, ref_s = await move_table(table, uri, by_ref=True)
        inline_bytes, inline_s = await move_table(table, uri, by_ref=False)
    print(f"\n{uri}: by ref {ref_bytes} gRPC bytes {ref_s:.2f}s; inline {inline_bytes} gRPC bytes {inline_s:.2f}s")
    assert ref_bytes < 64 * 1024  # the URI, not the table
    assert inline_bytes > 256 << 20
    assert ref_s < inline_s * 3  # generous: only a gross regression fails


async def test_published_tables_are_bounded_oldest_dropped_first(nursery: trio.Nursery) -> None:
    exchange = ArrowExchange("tcp://127.0.0.1:0", max_bytes=3 << 20)
    await nursery.start(exchange.serve)
    refs = [exchange.add(table_of(1 << 20)) for _ in range(5)]
    resolver = ArrowRefResolver("tcp")
    with pytest.raises(RefRejectedError):
        async with resolver.open_batches(refs[0]) as batches:
            async for _ in batches:
                pass
    async with resolver.open_batches(refs[-1]) as batches:
        assert sum([batch.num_rows async for batch in batches]) == (1 << 20) // 16
