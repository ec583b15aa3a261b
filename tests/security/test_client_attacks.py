"""A hostile server, over a real socket, against the session client (``Client``/``connect``).

Each answer it can give (garbage, silence, a stream never answered, an oversized message, GOAWAY or a
broken frame mid-stream, a refused stream) ends in one plain :class:`SessionAbortedError` naming what
happened, within the client's deadlines; never a hang, never an exception group. A call the server
says it did not process is sent again, a bounded number of times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue

from evergreen_trio import Client, NodeRef, SessionAbortedError, StatusCode, text
from evergreen_trio._grpc.client import REPLAY_BYTES, TRANSPARENT_RETRIES, ClientChannel, open_client_channel
from evergreen_trio._grpc.errors import RpcAbortError

Behaviour = Callable[[trio.SocketStream], Awaitable[None]]


async def hostile(nursery: trio.Nursery, behave: Behaviour) -> tuple[str, list[int]]:
    """A server that runs ``behave`` on each connection; its address and a count of connections."""
    accepted = [0]

    async def handler(stream: trio.SocketStream) -> None:
        accepted[0] += 1
        async with stream:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await behave(stream)

    listeners = await nursery.start(trio.serve_tcp, handler, 0)
    return f"127.0.0.1:{listeners[0].socket.getsockname()[1]}", accepted


async def speak(stream: trio.SocketStream) -> h2.connection.H2Connection:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
    conn.initiate_connection()
    await stream.send_all(conn.data_to_send())
    return conn


async def request(stream: trio.SocketStream, conn: h2.connection.H2Connection) -> int:
    """Read until the client opens a stream (and its first message arrives); its id."""
    while True:
        data = await stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError
        events = conn.receive_data(data)
        await stream.send_all(conn.data_to_send())
        ids = [e.stream_id for e in events if isinstance(e, h2.events.DataReceived)]
        if ids:
            return ids[0]


async def reply(stream: trio.SocketStream, conn: h2.connection.H2Connection, stream_id: int, after: bytes) -> None:
    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    await stream.send_all(conn.data_to_send() + after)
    await trio.sleep_forever()


async def one_echo(address: str, **options: object) -> SessionAbortedError:
    with trio.fail_after(10), pytest.raises(SessionAbortedError) as aborted:
        async with Client(address, **options) as client, client.session() as session:  # type: ignore[arg-type]
            call = await session.run("ECHO", {"input": text("x")}, ["output"])
            await call["output"].read_bytes()
    assert type(aborted.value) is SessionAbortedError
    return aborted.value


async def test_garbage_instead_of_http2_is_said_so(nursery: trio.Nursery) -> None:
    async def garbage(stream: trio.SocketStream) -> None:
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
        await trio.sleep_forever()

    address, _ = await hostile(nursery, garbage)
    error = await one_echo(address)
    assert error.code is StatusCode.UNAVAILABLE and "does not speak gRPC's HTTP/2" in str(error)


async def test_a_silent_server_fails_the_connect_within_connect_timeout(nursery: trio.Nursery) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    address, accepted = await hostile(nursery, silent)
    with trio.fail_after(10):
        error = await one_echo(address, connect_timeout=0.3, retries=1, backoff=0.05)
    assert error.code is StatusCode.UNAVAILABLE and "did not answer within 0.3 s" in str(error)
    assert accepted[0] == 2  # retried once


async def test_a_stream_never_answered_ends_at_the_timeout(nursery: trio.Nursery) -> None:
    async def mute(stream: trio.SocketStream) -> None:
        conn = await speak(stream)
        await request(stream, conn)
        async for data in stream:  # acks settings and pings, answers nothing
            conn.receive_data(data)
            await stream.send_all(conn.data_to_send())

    address, _ = await hostile(nursery, mute)
    start = trio.current_time()
    error = await one_echo(address, timeout=0.4)
    assert error.code is StatusCode.DEADLINE_EXCEEDED
    assert trio.current_time() - start < 5


@pytest.mark.parametrize(
    ("after", "code", "said"),
    [
        (b"\x00\x00\x05\x00\x00\x00\x00\x00\x01" + b"\x00\x06\x40\x00\x00", StatusCode.RESOURCE_EXHAUSTED,
         "a message of 104857600 bytes, over the"),
        # A GOAWAY below the stream it already answered: the call ends (a last stream id at or above
        # it would let it run on).
        (b"\x00\x00\x08\x07\x00\x00\x00\x00\x00" + b"\x00\x00\x00\x00\x00\x00\x00\x0b", StatusCode.UNAVAILABLE,
         "GOAWAY ENHANCE_YOUR_CALM"),
        (b"\x00\x00\x04\x00\x00\x00\x00\x00\x00junk", StatusCode.UNAVAILABLE, "broke the HTTP/2 protocol"),
        (b"\x00\x00\x04\x03\x00\x00\x00\x00\x01\x00\x00\x00\x07", StatusCode.UNAVAILABLE, "REFUSED_STREAM"),
        (b"\x00\x00\x05\x00\x00\x00\x00\x00\x01\x00\x00\x00\x00\x03" + b"\x00\x00\x03\x00\x00\x00\x00\x00\x01abc",
         StatusCode.INVALID_ARGUMENT, "not a SessionMessage"),
    ],
    ids=["oversized-message", "goaway-mid-stream", "bad-frame-mid-stream", "refused-stream", "not-a-message"],
)
async def test_a_bad_answer_mid_stream_is_one_status(
    nursery: trio.Nursery, after: bytes, code: StatusCode, said: str
) -> None:
    async def answer(stream: trio.SocketStream) -> None:
        conn = await speak(stream)
        stream_id = await request(stream, conn)
        assert stream_id == 1
        await reply(stream, conn, stream_id, after)

    address, _ = await hostile(nursery, answer)
    error = await one_echo(address)
    assert error.code is code and said in str(error), error


async def test_a_server_that_never_processes_a_call_gets_it_a_bounded_number_of_times(nursery: trio.Nursery) -> None:
    """GOAWAY(last stream 0) on every connection, as the call arrives: the call was not processed, so
    it is sent again on a new connection, at most TRANSPARENT_RETRIES times; then the session ends
    UNAVAILABLE naming the GOAWAY, and the next session starts on a new connection too."""

    async def go_away(stream: trio.SocketStream) -> None:
        conn = await speak(stream)
        await request(stream, conn)
        conn.close_connection(last_stream_id=0, additional_data=b"restarting")
        await stream.send_all(conn.data_to_send())
        await trio.sleep_forever()

    address, accepted = await hostile(nursery, go_away)
    with trio.fail_after(10):
        async with Client(address) as client:
            for _ in range(2):
                with pytest.raises(SessionAbortedError, match="GOAWAY NO_ERROR: restarting"):
                    async with client.session() as session:
                        call = await session.run("ECHO", {"input": text("x")}, ["output"])
                        await call["output"].read_bytes()
    assert accepted[0] == 2 * (1 + TRANSPARENT_RETRIES)


async def read_message(stream: trio.SocketStream, conn: h2.connection.H2Connection) -> tuple[int, bytes]:
    """Read until the client's first whole gRPC message; its stream id and the message, framed."""
    received = b""
    while len(received) < 5 or len(received) < 5 + int.from_bytes(received[1:5], "big"):
        data = await stream.receive_some(65536)
        if not data:
            raise trio.BrokenResourceError
        for event in conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                stream_id, received = event.stream_id, received + event.data
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        await stream.send_all(conn.data_to_send())
    return stream_id, received


def echo_answer(conn: h2.connection.H2Connection, stream_id: int, message: bytes) -> bytes:
    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    conn.send_data(stream_id, message)
    conn.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
    return conn.data_to_send()


@pytest.mark.parametrize("size", [10, REPLAY_BYTES + 1])
async def test_a_call_not_processed_is_sent_again_with_what_it_sent(nursery: trio.Nursery, size: int) -> None:
    """A server restarting as the call arrives (GOAWAY below it), then a new connection that answers:
    the call, its message included, goes again on the new connection and gets its answer, unseen by
    the caller. A call that sent more than REPLAY_BYTES before any answer keeps no copy: it ends
    UNAVAILABLE."""
    seen: list[bytes] = []

    async def restart_once(stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.initiate_connection()
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
        conn.increment_flow_control_window(1 << 20)
        await stream.send_all(conn.data_to_send())
        stream_id, message = await read_message(stream, conn)
        seen.append(message)
        if len(seen) == 1:
            conn.close_connection(last_stream_id=0, additional_data=b"restarting")
            await stream.send_all(conn.data_to_send())
        else:
            await stream.send_all(echo_answer(conn, stream_id, message))
        await trio.sleep_forever()

    address, accepted = await hostile(nursery, restart_once)
    host, port = address.rsplit(":", 1)
    value = b"v" * size
    answers: list[bytes] = []
    fails = pytest.raises(BaseException) if size > REPLAY_BYTES else contextlib.nullcontext()
    with trio.fail_after(10), fails as caught:
        async with (
            open_client_channel(host, int(port)) as channel,
            channel.open_stream("/test.Echo/Chat", BytesValue, lambda items: items) as stream,
        ):
            await stream.outbound.put(BytesValue(value=value))
            stream.finish()
            while batch := await stream.inbound.get_batch():
                answers += [message.value for message in batch]  # type: ignore[attr-defined]
    if size > REPLAY_BYTES:
        error = caught.value  # type: ignore[union-attr]
        while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:  # the channel's nursery
            error = error.exceptions[0]
        assert isinstance(error, RpcAbortError) and "GOAWAY NO_ERROR: restarting" in error.message, error
        assert accepted[0] == 1
    else:
        assert answers == [value] and accepted[0] == 2 and seen[0] == seen[1]


async def test_a_session_cancelled_while_its_call_waits_to_be_sent_again_ends_at_once(
    nursery: trio.Nursery,
) -> None:
    """The call was not processed (GOAWAY below it); the new connection's server never says a word,
    so sending it again would wait for the connect timeout. The caller's cancellation ends that wait:
    leaving the block does not sit out a shielded wait."""
    async def go_away_then_mute(stream: trio.SocketStream) -> None:
        if accepted[0] == 1:
            conn = await speak(stream)
            await request(stream, conn)
            conn.close_connection(last_stream_id=0)
            await stream.send_all(conn.data_to_send())
        await trio.sleep_forever()

    address, accepted = await hostile(nursery, go_away_then_mute)
    async with Client(address, connect_timeout=30) as client:
        start = trio.current_time()
        with trio.move_on_after(0.5) as cancelled:
            async with client.session() as session:
                call = await session.run("ECHO", {"input": text("x")}, ["output"])
                await call["output"].read_bytes()
        assert cancelled.cancelled_caught
        assert trio.current_time() - start < 10  # not the 30 s connect timeout
    assert accepted[0] == 2


async def test_a_server_that_stops_reading_leaves_the_client_closable(nursery: trio.Nursery) -> None:
    """The server never reads: the client's writes back up (a full socket), its session hits its
    timeout, and leaving the block closes the connection at once (no write waits forever)."""

    async def deaf(stream: trio.SocketStream) -> None:
        conn = await speak(stream)
        await request(stream, conn)
        conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 2**31 - 1})
        conn.increment_flow_control_window(2**31 - 1 - 65535)
        await stream.send_all(conn.data_to_send())
        await trio.sleep_forever()

    address, _ = await hostile(nursery, deaf)
    with trio.fail_after(15), pytest.raises(SessionAbortedError) as aborted:
        async with Client(address, timeout=1.0) as client, client.session() as session:
            leaf = session.open_leaf()
            await session.run("ECHO", {"input": NodeRef(leaf.id)}, ["output"])
            while True:
                await leaf.write(b"w" * 65536)
    assert aborted.value.code is StatusCode.DEADLINE_EXCEEDED


async def test_a_server_that_allows_no_stream_is_said_so(nursery: trio.Nursery) -> None:
    async def closed_shop(stream: trio.SocketStream) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        conn.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})
        conn.initiate_connection()
        await stream.send_all(conn.data_to_send())
        async for data in stream:
            conn.receive_data(data)
            await stream.send_all(conn.data_to_send())

    address, _ = await hostile(nursery, closed_shop)
    error = await one_echo(address)
    assert error.code is StatusCode.UNAVAILABLE and "SETTINGS_MAX_CONCURRENT_STREAMS 0" in str(error)


async def test_a_ping_flood_from_a_server_that_reads_nothing_is_bounded(nursery: trio.Nursery) -> None:
    """Each PING makes the client queue an ack; a server that never reads them stops being read past
    OUTGOING_BYTES of acks, and the session still ends at its timeout."""
    from evergreen_trio._grpc.client import OUTGOING_BYTES

    async def flood(stream: trio.SocketStream) -> None:
        conn = await speak(stream)
        await request(stream, conn)
        ping = b"\x00\x00\x08\x06\x00\x00\x00\x00\x00" + b"12345678"
        with trio.move_on_after(5):
            while True:
                await stream.send_all(ping * 4096)
        await trio.sleep_forever()

    address, _ = await hostile(nursery, flood)
    seen: list[int] = []

    async def watch(client: Client) -> None:
        connection = client._channel._connection  # type: ignore[union-attr]
        while True:
            seen.append(sum(map(len, connection._outgoing)))
            await trio.sleep(0.005)

    with trio.fail_after(15), pytest.raises(SessionAbortedError) as aborted:
        async with Client(address, timeout=1.0) as client, trio.open_nursery() as watching:
            watching.start_soon(watch, client)
            try:
                async with client.session() as session:
                    call = await session.run("ECHO", {"input": text("x")}, ["output"])
                    await call["output"].read_bytes()
            finally:
                watching.cancel_scope.cancel()
    assert aborted.value.code is StatusCode.DEADLINE_EXCEEDED
    assert max(seen) > 64 * 1024, "the flood did not reach the client"
    assert max(seen) <= OUTGOING_BYTES + 128 * 1024, max(seen)


async def test_a_call_refused_while_others_run_is_sent_again_until_taken(nursery: trio.Nursery) -> None:
    """A server that counts streams longer than it says (grpcio counts one until its handler thread
    ends) refuses a call while its others run. Each such refusal waits for one of them to end and
    does not count against TRANSPARENT_RETRIES: the call is taken however often it was refused (here
    twice the cap), while a server refusing with nothing else running still ends it at the cap."""
    held_calls, refusals = 2 * TRANSPARENT_RETRIES, 2 * TRANSPARENT_RETRIES

    async def busy(stream: trio.SocketStream) -> None:
        conn = await speak(stream)
        held: list[int] = []
        waiting: list[int] = []  # the refused call's streams, until every other call is held
        refused = 0
        while data := await stream.receive_some(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.DataReceived) and event.data:
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    (waiting if event.data.endswith(b"refuse me") else held).append(event.stream_id)
            while waiting and len(held) + refused >= held_calls:
                stream_id = waiting.pop()
                if refused < refusals:
                    refused += 1
                    conn.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
                    stream_id = held.pop(0)  # one of the others ends: room for the refused one
                    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                else:
                    taken = BytesValue(value=b"taken").SerializeToString()
                    conn.send_headers(stream_id, [(b":status", b"200"), (b"content-type", b"application/grpc")])
                    conn.send_data(stream_id, b"\x00" + len(taken).to_bytes(4, "big") + taken)
                conn.send_headers(stream_id, [(b"grpc-status", b"0")], end_stream=True)
            await stream.send_all(conn.data_to_send())

    address, _ = await hostile(nursery, busy)
    host, port = address.rsplit(":", 1)
    answers: dict[bytes, list[bytes]] = {}

    async def call(channel: ClientChannel, value: bytes) -> None:
        async with channel.open_stream("/test.Echo/Chat", BytesValue, lambda items: items) as stream:
            await stream.outbound.put(BytesValue(value=value))
            stream.finish()
            answers[value] = []
            while batch := await stream.inbound.get_batch():
                answers[value] += [m.value for m in batch]

    with trio.fail_after(10):
        async with open_client_channel(host, int(port)) as channel, trio.open_nursery() as calls:
            for i in range(held_calls):
                calls.start_soon(call, channel, b"other %d" % i)
            await trio.sleep(0.2)  # the others first: the refusals come while they run
            calls.start_soon(call, channel, b"refuse me")
    assert answers.pop(b"refuse me") == [b"taken"]
    assert answers == {b"other %d" % i: [] for i in range(held_calls)}
