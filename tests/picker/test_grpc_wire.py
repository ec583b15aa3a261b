"""The sans-IO gRPC server connection against real peers: the ``h2`` client in memory, grpcio over TCP."""

from __future__ import annotations

import itertools
import os
import queue
import threading
from collections.abc import Sequence
from functools import partial

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from grpclib.const import Status
from hpack import NeverIndexedHeaderTuple
from hyperframe.frame import PingFrame
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.security_session import RawH2
from evergreen_trio._grpc import http2
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.http2 import HeaderDecoder
from evergreen_trio._grpc.server import GracefulStop, serve_grpc
from evergreen_trio._grpc.server_wire import GOAWAY_PING, PREFACE, GrpcWireConnection, SyncBidiMethod, WireLimits

PATH = "/test.Echo/Chat"


class Echo:
    """Replies with each message; b"stop" finishes the stream, b"fail" and b"bug" end it in error."""

    def __init__(self) -> None:
        self.finished = False
        self.ended = False

    def on_message(self, message: BytesValue) -> Sequence[BytesValue]:
        if message.value == b"fail":
            raise RpcAbortError(Status.INVALID_ARGUMENT, "asked to fail: é%")
        if message.value == b"bug":
            raise KeyError("bug")
        self.finished = message.value == b"stop"
        return [BytesValue(value=message.value)]

    def on_end(self) -> Sequence[BytesValue]:
        self.ended = True
        return [BytesValue(value=b"end")]


METHOD = SyncBidiMethod(PATH, BytesValue, Echo)


def fields(headers: object) -> dict[str, str]:
    """h2's header pairs (str with a header_encoding, bytes without) as a str dict."""
    pairs: list[tuple[str | bytes, str | bytes]] = list(headers)  # type: ignore[call-overload]
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in pairs}


def grpc_message(value: bytes, flag: int = 0) -> bytes:
    data = BytesValue(value=value).SerializeToString()
    return bytes([flag]) + len(data).to_bytes(4, "big") + data


class Peer:
    """An h2 client wired to a :class:`GrpcWireConnection` in memory."""

    def __init__(self, limits: WireLimits | None = None, window: int = 65_535, ack: bool = True) -> None:
        self.ack = ack
        self.server = GrpcWireConnection({PATH: METHOD}, limits)
        self.client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.client.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.client.initiate_connection()
        self.events: list[h2.events.Event] = []
        self.data: dict[int, bytearray] = {}
        self.pump()

    def pump(self) -> None:
        for _ in range(1000):
            out = self.client.data_to_send()
            if out:
                self.server.receive_data(out)
            back = self.server.data_to_send()
            if not out and not back:
                return
            if back:
                for event in self.client.receive_data(back):
                    self.events.append(event)
                    if isinstance(event, h2.events.DataReceived):
                        self.data.setdefault(event.stream_id, bytearray()).extend(event.data)
                        if self.ack:
                            self.client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)

    def open(self, path: str = PATH, content_type: str = "application/grpc") -> int:
        stream_id: int = self.client.get_next_available_stream_id()
        self.client.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "picker"),
            ("content-type", content_type), ("te", "trailers")])
        return stream_id

    def send(self, stream_id: int, *values: bytes, end: bool = False) -> None:
        self.client.send_data(stream_id, b"".join(grpc_message(v) for v in values), end_stream=end)
        self.pump()

    def replies(self, stream_id: int) -> list[bytes]:
        data, out = bytes(self.data.get(stream_id, b"")), []
        while data:
            size = int.from_bytes(data[1:5], "big")
            out.append(BytesValue.FromString(data[5 : 5 + size]).value)
            data = data[5 + size :]
        return out

    def trailers(self, stream_id: int) -> dict[str, str]:
        for event in self.events:
            if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived) and (
                    event.stream_id == stream_id and "grpc-status" in fields(event.headers)):
                return fields(event.headers)
        return {}

    def reset(self, stream_id: int) -> int | None:
        for event in self.events:
            if isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                return int(event.error_code)
        return None


def test_messages_replies_and_ok_trailers_at_client_end() -> None:
    peer = Peer()
    stream = peer.open()
    peer.send(stream, b"a", b"b")
    assert peer.replies(stream) == [b"a", b"b"]
    assert peer.trailers(stream) == {}
    peer.send(stream, b"c", end=True)
    assert peer.replies(stream) == [b"a", b"b", b"c", b"end"]
    assert peer.trailers(stream)["grpc-status"] == "0"
    assert peer.reset(stream) is None


def test_finished_processor_ends_the_stream_and_resets_the_client_side() -> None:
    peer = Peer()
    stream = peer.open()
    peer.send(stream, b"stop", b"ignored")
    assert peer.replies(stream) == [b"stop"]
    assert peer.trailers(stream)["grpc-status"] == "0"
    assert peer.reset(stream) == 0


def _rst(stream_id: int) -> bytes:
    """A raw RST_STREAM CANCEL frame (h2's client refuses to reset a stream it saw closed)."""
    return (4).to_bytes(3, "big") + bytes([3, 0]) + stream_id.to_bytes(4, "big") + (8).to_bytes(4, "big")


def test_resets_of_answered_streams_are_not_strikes_but_of_idle_streams_are_an_error() -> None:
    # Envoy resets every stream the picker ended early (routing only): one per request, far
    # above the stream-error budget at a busy gateway; only resets of open streams count.
    peer = Peer(limits=WireLimits(max_stream_errors_per_second=3))
    for _ in range(10):
        stream = peer.open()
        peer.send(stream, b"stop")
        assert peer.reset(stream) == 0
        peer.server.receive_data(_rst(stream))
    assert not peer.server.closed
    for _ in range(4):  # rapid reset: open streams reset by the peer are strikes
        stream = peer.open()
        peer.pump()
        peer.server.receive_data(_rst(stream))
    assert peer.server.closed
    assert b"streams reset, refused or failed" in peer.server.data_to_send()
    idle = Peer()
    idle.server.receive_data(_rst(9))
    assert idle.server.closed
    assert b"got idle 9" in idle.server.data_to_send()


def test_rpc_status_and_processor_bug_become_grpc_statuses() -> None:
    peer = Peer()
    failing, buggy = peer.open(), peer.open()
    peer.send(failing, b"fail")
    peer.send(buggy, b"bug")
    assert peer.trailers(failing)["grpc-status"] == str(Status.INVALID_ARGUMENT.value)
    assert peer.trailers(failing)["grpc-message"] == "asked to fail: %C3%A9%25"
    assert peer.trailers(buggy)["grpc-status"] == str(Status.UNKNOWN.value)
    assert not peer.server.closed


def test_unknown_method_and_non_grpc_request() -> None:
    peer = Peer()
    unknown = peer.open(path="/no.Such/Method")
    peer.pump()
    assert peer.trailers(unknown)["grpc-status"] == str(Status.UNIMPLEMENTED.value)
    plain = peer.open(content_type="text/plain")
    peer.pump()
    statuses = [fields(e.headers).get(":status") for e in peer.events
                if isinstance(e, h2.events.ResponseReceived) and e.stream_id == plain]
    assert statuses == ["415"]


def test_compressed_and_oversized_messages() -> None:
    peer = Peer(limits=WireLimits(max_message_bytes=100))
    compressed, big = peer.open(), peer.open()
    peer.client.send_data(compressed, grpc_message(b"x", flag=1))
    peer.send(big, b"y" * 200)
    assert peer.trailers(compressed)["grpc-status"] == str(Status.UNIMPLEMENTED.value)
    assert peer.trailers(big)["grpc-status"] == str(Status.RESOURCE_EXHAUSTED.value)


def test_a_reply_over_the_send_cap_ends_its_stream_resource_exhausted_after_the_replies_before_it() -> None:
    """``--grpc-max-send-msg-size``: grpc-go fails the call at a reply over the cap; so does the wire."""
    peer = Peer(limits=WireLimits(max_send_message_bytes=10))
    stream, other = peer.open(), peer.open()
    peer.send(stream, b"short", b"x" * 20, b"after")
    assert peer.replies(stream) == [b"short"]
    trailers = peer.trailers(stream)
    assert trailers["grpc-status"] == str(Status.RESOURCE_EXHAUSTED.value)
    assert trailers["grpc-message"].startswith("trying to send message larger than max (22 vs. 10)")
    peer.send(other, b"fine", end=True)
    assert peer.replies(other) == [b"fine", b"end"] and not peer.server.closed


def test_large_messages_respect_both_flow_control_windows() -> None:
    peer = Peer(limits=WireLimits(window_bytes=100_000), window=20_000)
    stream = peer.open()
    payload = os.urandom(700_000)
    message = grpc_message(payload)
    for offset in range(0, len(message), 16_384):
        window = peer.client.local_flow_control_window(stream)
        while window < 16_384:
            peer.pump()
            window = peer.client.local_flow_control_window(stream)
        peer.client.send_data(stream, message[offset : offset + 16_384])
        peer.pump()
    peer.client.end_stream(stream)
    peer.pump()
    assert peer.replies(stream) == [payload, b"end"]
    assert peer.trailers(stream)["grpc-status"] == "0"


def test_replies_the_client_does_not_read_stop_its_window() -> None:
    peer = Peer(limits=WireLimits(window_bytes=40_000), window=1_000, ack=False)
    stream = peer.open()
    sent = 0
    while peer.client.local_flow_control_window(stream) >= 10_005 and sent < 100:
        peer.send(stream, b"z" * 10_000)
        sent += 1
    # Replies pile up unread; the server stopped returning window, so the client is blocked.
    assert sent < 10
    assert peer.client.local_flow_control_window(stream) < 10_005


def test_input_after_the_answer_is_dropped_while_the_answer_waits_for_window() -> None:
    peer = Peer(window=1_000, ack=False)
    stream = peer.open()
    peer.send(stream, b"x" * 5_000, b"stop")
    held = peer.server._streams[stream]  # answered, replies held back by the client's window
    assert held.trailers is not None and held.pending
    peer.send(stream, b"y" * 10_000)
    assert not held.inbound


def test_concurrent_stream_limit_refuses_streams() -> None:
    peer = Peer(limits=WireLimits(max_concurrent_streams=1))
    # A misbehaving client that ignores the advertised limit.
    peer.client.remote_settings = h2.settings.Settings(client=False, initial_values={
        h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 10})
    first, second = peer.open(), peer.open()
    peer.send(first, b"a")
    assert peer.replies(first) == [b"a"]
    assert peer.reset(second) == 7  # REFUSED_STREAM


def test_ping_is_acknowledged_and_bad_preface_is_goaway() -> None:
    peer = Peer()
    peer.client.ping(b"12345678")
    peer.pump()
    assert any(isinstance(e, h2.events.PingAckReceived) for e in peer.events)
    server = GrpcWireConnection({PATH: METHOD})
    server.receive_data(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 20)
    assert server.closed
    assert b"expected the HTTP/2 client preface" in server.data_to_send()


def _client_bytes() -> bytes:
    """The client bytes of a two-stream conversation with a PING, for splitting and mutating."""
    peer = Peer()
    chunks = []
    original = peer.server.receive_data

    def record(data: bytes) -> None:
        chunks.append(data)
        original(data)

    peer.server.receive_data = record  # type: ignore[method-assign]
    first, second = peer.open(), peer.open()
    peer.client.send_data(first, grpc_message(b"a" * 300))
    peer.client.ping(b"abcdefgh")
    peer.client.send_data(second, grpc_message(b"stop"), end_stream=True)
    peer.client.send_data(first, grpc_message(b"b"), end_stream=True)
    peer.pump()
    return b"".join(chunks)


CLIENT_BYTES = _client_bytes()


def _feed(chunks: list[bytes]) -> bytes:
    server = GrpcWireConnection({PATH: METHOD})
    out = bytearray(server.data_to_send())
    for chunk in chunks:
        server.receive_data(chunk)
        out += server.data_to_send()
    return bytes(out)


@given(st.lists(st.integers(min_value=0, max_value=len(CLIENT_BYTES)), max_size=20))
def test_split_points_do_not_change_the_answer(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(CLIENT_BYTES)]
    chunks = [CLIENT_BYTES[a:b] for a, b in itertools.pairwise(bounds)]
    assert _feed(chunks) == _feed([CLIENT_BYTES])


@pytest.mark.fuzz
@given(st.binary(max_size=2000), st.booleans())
def test_fuzz_arbitrary_bytes_never_raise(data: bytes, with_preface: bool) -> None:
    server = GrpcWireConnection({PATH: METHOD}, WireLimits(max_message_bytes=1000))
    server.receive_data((PREFACE if with_preface else b"") + data)
    server.data_to_send()


@pytest.mark.fuzz
@given(st.data())
def test_fuzz_mutated_conversation_never_raises(data: st.DataObject) -> None:
    raw = bytearray(CLIENT_BYTES)
    for _ in range(data.draw(st.integers(1, 8))):
        index = data.draw(st.integers(len(PREFACE), len(raw) - 1))
        raw[index] = data.draw(st.integers(0, 255))
    server = GrpcWireConnection({PATH: METHOD})
    server.receive_data(bytes(raw))
    server.data_to_send()


async def test_grpcio_client_over_tcp(nursery: trio.Nursery) -> None:
    port = await nursery.start(partial(serve_grpc, [METHOD], "127.0.0.1", 0))
    big = os.urandom(3_000_000)

    def call(values: list[bytes]) -> tuple[list[bytes], grpc.StatusCode, str]:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=[
                ("grpc.max_receive_message_length", 8_000_000), ("grpc.max_send_message_length", 8_000_000)]) as ch:
            rpc = ch.stream_stream(PATH, request_serializer=BytesValue.SerializeToString,
                                   response_deserializer=BytesValue.FromString)
            calls = rpc(iter([BytesValue(value=v) for v in values]))
            try:
                return [r.value for r in calls], calls.code(), calls.details() or ""
            except grpc.RpcError as exc:
                return [], exc.code(), exc.details() or ""

    replies, code, _ = await trio.to_thread.run_sync(call, [b"a", big, b"b"])
    assert replies == [b"a", big, b"b", b"end"] and code == grpc.StatusCode.OK
    replies, code, _ = await trio.to_thread.run_sync(call, [b"x", b"stop", b"y"])
    assert replies == [b"x", b"stop"] and code == grpc.StatusCode.OK
    _, code, details = await trio.to_thread.run_sync(call, [b"fail"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details == "asked to fail: é%"


async def test_a_graceful_stop_closes_the_port_and_returns_once_the_open_stream_ended(nursery: trio.Nursery) -> None:
    """grpc-go's ``GracefulStop``: no new connection, a GOAWAY NO_ERROR on the open one, whose stream
    goes on (a grpcio client sends on it after the stop began) to its OK; then the stop is over."""
    stop = GracefulStop()
    port = await nursery.start(partial(serve_grpc, [METHOD], "127.0.0.1", 0, graceful_stop=stop))
    requests: queue.Queue[bytes | None] = queue.Queue()
    first_reply = threading.Event()

    def call() -> tuple[list[bytes], grpc.StatusCode]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            rpc = channel.stream_stream(PATH, request_serializer=BytesValue.SerializeToString,
                                        response_deserializer=BytesValue.FromString)
            calls = rpc(BytesValue(value=v) for v in iter(requests.get, None))
            replies = []
            for reply in calls:
                replies.append(reply.value)
                first_reply.set()
            return replies, calls.code()

    result: list[tuple[list[bytes], grpc.StatusCode]] = []
    called = trio.Event()

    async def run_call() -> None:
        result.append(await trio.to_thread.run_sync(call))
        called.set()

    nursery.start_soon(run_call)
    requests.put(b"a")
    assert await trio.to_thread.run_sync(first_reply.wait, 10)
    stopped = trio.Event()

    async def run_stop() -> None:
        await stop()
        stopped.set()

    nursery.start_soon(run_stop)
    await trio.sleep(0.2)
    assert not stopped.is_set()
    with pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", port)
    requests.put(b"b")
    requests.put(None)
    with trio.fail_after(10):
        await stopped.wait()
        await called.wait()
    assert result == [([b"a", b"b", b"end"], grpc.StatusCode.OK)]


def _message(value: bytes) -> bytes:
    body = BytesValue(value=value).SerializeToString()
    return b"\0" + len(body).to_bytes(4, "big") + body


async def test_a_graceful_stop_takes_the_stream_that_raced_its_goaway_even_from_a_client_deaf_to_pings(
        nursery: trio.Nursery) -> None:
    """The stop's GOAWAY comes in two steps (RFC 9113 section 6.8, as grpc-go's): first naming 2^31-1,
    with a PING. A stream the client opened before it read them (here: after, not answering the
    PING) is taken and served; the final GOAWAY, naming it, comes without the ACK after
    ``GOAWAY_ACK_TIMEOUT_SECONDS``; a stream opened after that is not taken. Over a real socket."""
    stop = GracefulStop()
    port = await nursery.start(partial(serve_grpc, [METHOD], "127.0.0.1", 0, graceful_stop=stop))
    client = await RawH2.open(port)
    await client.send(client.headers(1, path=PATH) + client.data(1, _message(b"first")))
    assert await client.until(lambda c: bool(c.settings), 10)  # SETTINGS exchanged
    client.answer = False  # PINGs go unanswered from now on
    stopped = trio.Event()

    async def run_stop() -> None:
        await stop()
        stopped.set()

    nursery.start_soon(run_stop)
    assert await client.until(lambda c: c.goaway_last_stream == 2**31 - 1, 10)
    await client.send(client.headers(3, path=PATH) + client.data(3, _message(b"raced"), end_stream=True))
    assert await client.until(lambda c: c.goaway_last_stream == 3, 10)
    await client.send(client.headers(5, path=PATH) + client.data(5, _message(b"late"), end_stream=True))
    await client.send(client.data(1, _message(b"last"), end_stream=True))
    assert await client.until(lambda c: {1, 3} <= c.statuses.keys() and c.closed, 10)
    assert client.statuses == {1: "0 ", 3: "0 "} and client.goaway == 0
    with trio.fail_after(10):
        await stopped.wait()
    await client.aclose()


async def test_a_spoofed_goaway_ping_ack_before_any_stop_changes_nothing(nursery: trio.Nursery) -> None:
    """A client acknowledging the graceful stop's PING it was never sent (hostile, or confused): no
    GOAWAY, no error; its stream is served to OK and the server keeps serving others."""
    port = await nursery.start(partial(serve_grpc, [METHOD], "127.0.0.1", 0))
    client = await RawH2.open(port)
    spoofed = PingFrame(0, flags=["ACK"], opaque_data=GOAWAY_PING).serialize()
    await client.send(spoofed + client.headers(1, path=PATH) + spoofed
                      + client.data(1, _message(b"x"), end_stream=True))
    assert await client.until(lambda c: 1 in c.statuses, 10)
    assert client.statuses == {1: "0 "} and client.goaway is None and not client.closed
    await client.aclose()
    second = await RawH2.open(port)
    await second.send(second.headers(1, path=PATH) + second.data(1, _message(b"y"), end_stream=True))
    assert await second.until(lambda c: 1 in c.statuses, 10) and second.statuses == {1: "0 "}
    await second.aclose()


def _blocks() -> list[bytes]:
    """Raw header blocks that insert into, refer to, and resize the HPACK table when replayed."""
    encoder = hpack.Encoder()
    blocks = [bytes(encoder.encode([(":path", PATH), ("x-a", "1")])),  # inserts
              bytes(encoder.encode([(":path", PATH), ("x-a", "1")])),  # refers to dynamic entries only
              bytes(encoder.encode([("x-b", "2"), ("x-a", "1")])),
              bytes(encoder.encode([("x-c", "3")], huffman=False))]
    encoder.header_table_size = 60
    blocks.append(bytes(encoder.encode([("x-d", "4")])))  # a table size update, then an insert
    return [*blocks, b"\xbf\x7f", b"\x20"]  # a dynamic index past the table; a resize to 0


@given(st.lists(st.sampled_from(_blocks()), max_size=30))
def test_cached_header_blocks_decode_as_hpack_does(sequence: list[bytes]) -> None:
    # Replayed in any order, repeated blocks decode as a fresh decoder decodes them, including
    # blocks that change the table each time (never answered from the cache).
    decoder = HeaderDecoder(64 * 1024)
    reference = hpack.Decoder()
    for block in sequence:
        try:
            expected: dict[bytes, bytes] | None = {bytes(k): bytes(v) for k, v in reference.decode(block, raw=True)}
        except (hpack.HPACKError, IndexError):
            expected = None
        try:
            got: dict[bytes, bytes] | None = decoder.decode(block)
        except Exception:
            got = None
        assert got == expected
        if expected is None:
            return  # a connection error: the connection is done


def test_header_block_cache_is_capped_in_blocks_and_bytes() -> None:
    encoder = hpack.Encoder()
    decoder = HeaderDecoder(64 * 1024)
    reference = hpack.Decoder()

    def check(block: bytes) -> None:
        assert decoder.decode(block) == {bytes(k): bytes(v) for k, v in reference.decode(block, raw=True)}

    count = http2.MAX_CACHED_HEADER_BLOCKS + 5
    for i in range(count):  # each inserts into the table: none is kept
        check(bytes(encoder.encode([("x-n", str(i))])))
    assert not decoder._cache
    for i in range(count):  # each only refers to a table entry: kept, up to the cap
        check(bytes([0x80 | (62 + i)]))
    assert len(decoder._cache) == http2.MAX_CACHED_HEADER_BLOCKS
    decoder._cache.clear()
    value = "v" * http2.MAX_CACHED_HEADER_BLOCK_BYTES
    large = bytes(encoder.encode([NeverIndexedHeaderTuple("x-big", value)], huffman=False))
    check(large)
    check(large)
    assert not decoder._cache
