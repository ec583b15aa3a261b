"""What the server wire does for the session server beyond the picker's synchronous methods: a
stream's Call, admission, streaming processors (a task behind them), refusals past a count, and a
client's GOAWAY. In memory, against h2's client (``Peer`` from the picker's wire tests)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence
from functools import partial

import hpack
import trio
from google.protobuf.wrappers_pb2 import BytesValue
from grpclib.const import Status
from h2_frames import parse_frames
from hyperframe.frame import GoAwayFrame, HeadersFrame, PingFrame, SettingsFrame
from hypothesis import given, settings
from hypothesis import strategies as st

from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._grpc.http2 import ACK, PING, frame
from evergreen_trio._grpc.server import StreamMethod, WireTimeouts, serve_grpc
from evergreen_trio._grpc.server_wire import GOAWAY_PING, Call, StreamProcessor, WireLimits
from evergreen_trio._grpc.streams import MessageStream
from tests.picker.test_grpc_wire import PATH, Peer, grpc_message


class Opener:
    """A method whose ``open`` records each Call and refuses, fails or opens as told."""

    path = PATH
    request_type = BytesValue

    def __init__(self, make: type[StreamProcessor[BytesValue, BytesValue]] | None = None,
                 refuse: RpcAbortError | None = None, fail: bool = False) -> None:
        self.calls: list[Call] = []
        self.opened: list[StreamProcessor[BytesValue, BytesValue]] = []
        self.make, self.refuse, self.fail = make, refuse, fail

    def open(self, call: Call) -> StreamProcessor[BytesValue, BytesValue]:
        self.calls.append(call)
        if self.refuse is not None:
            raise self.refuse
        if self.fail:
            raise KeyError("bug")
        assert self.make is not None
        processor = self.make()
        self.opened.append(processor)
        return processor


class Streaming:
    """A streaming processor driven by the test: ``queue`` replies, ``end`` with a status, then wake."""

    streaming = True

    def __init__(self) -> None:
        self.finished = False
        self.parked = False
        self.received: list[bytes] = []
        self.queued: list[BytesValue] = []
        self.final: RpcAbortError | None = None
        self.ended_input = False
        self.closed = 0
        self.statuses: list[Status] = []
        self.aborted = 0
        self.wake = lambda: None

    def on_message(self, message: BytesValue) -> Sequence[BytesValue]:
        self.received.append(message.value)
        return ()

    def on_end(self) -> Sequence[BytesValue]:
        self.ended_input = True
        return ()

    def resume(self) -> Sequence[BytesValue]:
        replies, self.queued = self.queued, []
        if not replies and self.final is not None:
            if self.final.status is not Status.OK:
                raise self.final
            self.finished = True
        return replies

    def on_abort(self) -> None:
        self.aborted += 1

    def on_closed(self, status: Status) -> None:
        self.closed += 1
        self.statuses.append(status)


def peer_with(method: Opener, limits: WireLimits | None = None) -> Peer:
    peer = Peer(limits)
    peer.server.methods = {PATH: method}
    return peer


def open_stream(peer: Peer, metadata: Sequence[tuple[str, str]] = ()) -> int:
    stream_id: int = peer.client.get_next_available_stream_id()
    peer.client.send_headers(stream_id, [
        (":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
        ("content-type", "application/grpc"), ("te", "trailers"), *metadata])
    peer.pump()
    return stream_id


def test_a_call_carries_metadata_and_timeout_as_grpclib_read_them() -> None:
    method = Opener(Streaming)
    peer = peer_with(method)
    open_stream(peer, [("authorization", "Bearer t"), ("grpc-timeout", "250m"), ("x-bin", "AAAA"),
                       ("user-agent", "grpc-python"), ("grpc-encoding", "identity")])
    open_stream(peer, [("grpc-timeout", "12x")])
    first, second = method.calls
    assert first.path == PATH
    assert first.metadata == {"authorization": "Bearer t"}
    assert first.timeout == 0.25
    assert second.timeout is None  # not a valid timeout: none


def test_open_may_refuse_with_a_status_and_a_bug_is_unknown() -> None:
    peer = peer_with(Opener(refuse=RpcAbortError(Status.UNAUTHENTICATED, "a bearer token is required")))
    refused = open_stream(peer)
    assert peer.trailers(refused)["grpc-status"] == str(Status.UNAUTHENTICATED.value)
    assert peer.trailers(refused)["grpc-message"] == "a bearer token is required"
    peer.server.methods = {PATH: Opener(fail=True)}
    failed = open_stream(peer)
    assert peer.trailers(failed)["grpc-status"] == str(Status.UNKNOWN.value)
    assert not peer.server.closed and peer.server.open_streams == 0


def test_refusals_past_the_count_get_goaway_enhance_your_calm() -> None:
    peer = peer_with(Opener(refuse=RpcAbortError(Status.UNAUTHENTICATED, "no")), WireLimits(max_refused_streams=3))
    for _ in range(4):
        open_stream(peer)
    assert peer.server.closed
    goaways = [e for e in peer.events if type(e).__name__ == "ConnectionTerminated"]
    assert goaways and goaways[0].error_code == 0xB


def test_a_streaming_stream_outlives_the_clients_end_and_ends_with_its_status() -> None:
    method = Opener(Streaming)
    peer = peer_with(method)
    stream_id = open_stream(peer)
    peer.send(stream_id, b"in", end=True)
    processor = method.opened[0]
    assert isinstance(processor, Streaming)
    assert processor.received == [b"in"] and processor.ended_input
    assert peer.trailers(stream_id) == {}  # the client's end is not the stream's
    processor.queued = [BytesValue(value=b"out")]
    processor.final = RpcAbortError(Status.OK, "")
    processor.wake()
    peer.server.resume_unparked()
    peer.pump()
    assert peer.trailers(stream_id) == {}  # the replies first, the status at the next wake
    processor.wake()
    peer.server.resume_unparked()
    peer.pump()
    assert peer.replies(stream_id) == [b"out"]
    assert peer.trailers(stream_id)["grpc-status"] == "0"
    assert (processor.closed, processor.aborted) == (1, 0)
    assert processor.statuses == [Status.OK]


def test_a_streaming_stream_fails_with_the_status_resume_raises_and_a_reset_aborts_it() -> None:
    method = Opener(Streaming)
    peer = peer_with(method)
    failing, reset = open_stream(peer), open_stream(peer)
    first, second = method.opened
    assert isinstance(first, Streaming) and isinstance(second, Streaming)
    first.final = RpcAbortError(Status.DEADLINE_EXCEEDED, "no message within 1 s")
    first.wake()
    peer.server.resume_unparked()
    peer.pump()
    assert peer.trailers(failing)["grpc-status"] == str(Status.DEADLINE_EXCEEDED.value)
    peer.client.reset_stream(reset)
    peer.pump()
    assert (first.closed, first.aborted) == (1, 1)  # a stream failed with a status is aborted too
    assert (second.closed, second.aborted) == (1, 1)
    assert (first.statuses, second.statuses) == ([Status.DEADLINE_EXCEEDED], [Status.CANCELLED])


def test_unread_replies_of_a_streaming_stream_stop_its_output_not_its_input() -> None:
    """Replies pile up to a window while the client reads none; the client can still send (one that
    sends everything before reading would deadlock otherwise), and the stream takes more replies
    once the client has read some."""
    method = Opener(Streaming)
    peer = Peer(WireLimits(window_bytes=65_535), window=65_535, ack=False)
    peer.server.methods = {PATH: method}
    stream_id = open_stream(peer)
    processor = method.opened[0]
    assert isinstance(processor, Streaming)
    resumed = 0
    for _ in range(20):  # 20 x 16 KiB of replies
        processor.queued = [BytesValue(value=b"r" * 16_384)]
        processor.wake()
        before = processor.queued
        peer.server.resume_unparked()
        resumed += not processor.queued and bool(before)
    peer.pump()
    assert resumed < 20  # past a window of unsent replies the stream is not asked for more
    for _ in range(8):  # 8 x 16 KiB of input, more than the window the replies hold
        peer.send(stream_id, b"i" * 16_000)
    assert len(processor.received) == 8


def test_has_output_says_whether_a_write_is_due() -> None:
    """A message a stream task takes queues no reply of its own: the shell's reader then skips its
    write, and the writers' lock with it."""
    peer = peer_with(Opener(Streaming))
    stream_id = open_stream(peer)
    assert not peer.server.has_output
    peer.client.send_data(stream_id, grpc_message(b"x"))
    peer.server.receive_data(peer.client.data_to_send())
    assert not peer.server.has_output
    peer.server.ping()
    assert peer.server.has_output and peer.server.data_to_send() and not peer.server.has_output


def test_a_slice_of_input_opens_at_most_streams_per_slice_and_keeps_their_resets() -> None:
    """Five HEADERS in one read, two streams a slice: the rest waits for ``resume`` (the shell lets
    other connections run between slices); a stream's RST_STREAM right after it stays in its slice."""
    method = Opener(Streaming)
    peer = peer_with(method, WireLimits(streams_per_slice=2))
    for _ in range(5):
        stream_id = peer.client.get_next_available_stream_id()
        peer.client.send_headers(stream_id, [
            (":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
            ("content-type", "application/grpc"), ("te", "trailers")])
    peer.client.reset_stream(stream_id)
    peer.server.receive_data(peer.client.data_to_send())
    opened = [len(method.opened)]
    while peer.server.paused:
        peer.server.resume()
        opened.append(len(method.opened))
    assert opened == [2, 4, 5]
    assert peer.server.open_streams == 4  # the last one's reset came in its slice


async def test_a_silent_peer_with_an_open_stream_is_pinged_then_closed() -> None:
    """Keepalive over a real socket: a connection with an open stream and nothing read for
    ``keepalive_s`` gets a PING; left unanswered for ``keepalive_timeout_s``, the connection ends."""
    async def hold(stream: MessageStream[BytesValue]) -> None:
        await trio.sleep_forever()

    timeouts = WireTimeouts(keepalive_s=0.2, keepalive_timeout_s=0.3)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_grpc, [StreamMethod(PATH, BytesValue, hold)], "127.0.0.1", 0,
                                           timeouts=timeouts))
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        await sock.connect(("127.0.0.1", port))
        headers = HeadersFrame(1, hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", PATH),
                                                  (":authority", "x"), ("content-type", "application/grpc")]))
        headers.flags.add("END_HEADERS")
        await sock.send(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + SettingsFrame(0).serialize() + headers.serialize())
        received = b""
        with trio.fail_after(10):  # a hang guard
            while chunk := await sock.recv(65536):  # read everything, answer nothing
                received += chunk
        sock.close()
        kinds = [type(f) for f in parse_frames(received)]
        assert PingFrame in kinds and GoAwayFrame in kinds, kinds
        assert kinds.index(PingFrame) < kinds.index(GoAwayFrame)
        nursery.cancel_scope.cancel()


def test_a_graceful_goaway_in_two_steps_takes_the_streams_that_raced_it_and_drops_later_ones_quietly() -> None:
    """``go_away`` (a graceful stop), in two steps: GOAWAY NO_ERROR naming 2^31-1, and a PING. A
    stream the client opened before it saw them is taken; the PING's ACK brings the final GOAWAY,
    naming the last stream taken; a stream opened after that is not taken, and its DATA is dropped,
    not a protocol error. The open streams go on to their statuses, and the last one's end closes
    the connection. The frames are read raw: h2 treats a received GOAWAY as the connection's end."""
    method = Opener(Streaming)
    peer = peer_with(method)
    taken = open_stream(peer)
    peer.send(taken, b"still here", end=True)
    raced = peer.client.get_next_available_stream_id()
    request = [(":method", "POST"), (":scheme", "http"), (":path", PATH), (":authority", "x"),
               ("content-type", "application/grpc"), ("te", "trailers")]
    peer.client.send_headers(raced, request)
    peer.client.send_data(raced, b"\0\0\0\0\x02hi", end_stream=True)
    in_flight = peer.client.data_to_send()
    peer.server.go_away("the server is stopping", two_steps=True)
    frames = parse_frames(peer.server.data_to_send())
    assert [(f.last_stream_id, f.error_code) for f in frames if isinstance(f, GoAwayFrame)] == [(2**31 - 1, 0)]
    assert [f.opaque_data for f in frames if isinstance(f, PingFrame)] == [GOAWAY_PING]
    peer.server.receive_data(in_flight)  # sent before the client saw the GOAWAY
    assert len(method.opened) == 2
    peer.server.receive_data(frame(PING, ACK, 0, GOAWAY_PING))
    frames = parse_frames(peer.server.data_to_send())
    assert [(f.last_stream_id, f.error_code) for f in frames if isinstance(f, GoAwayFrame)] == [(raced, 0)]
    late = peer.client.get_next_available_stream_id()
    peer.client.send_headers(late, request)
    peer.client.send_data(late, b"\0\0\0\0\x02hi", end_stream=True)
    peer.server.receive_data(peer.client.data_to_send())
    assert len(method.opened) == 2 and not parse_frames(peer.server.data_to_send()) and not peer.server.closed
    out = b""
    for processor in method.opened:
        assert isinstance(processor, Streaming)
        processor.queued = [BytesValue(value=b"answer")]
        processor.final = RpcAbortError(Status.OK, "")
        for _ in range(2):
            processor.wake()
            peer.server.resume_unparked()
            out += peer.server.data_to_send()
    assert method.opened[0].received == [b"still here"]  # type: ignore[attr-defined]
    frames = parse_frames(out)
    assert [(type(f).__name__, f.stream_id) for f in frames] == [
        ("HeadersFrame", taken), ("DataFrame", taken), ("HeadersFrame", taken),
        ("HeadersFrame", raced), ("DataFrame", raced), ("HeadersFrame", raced), ("GoAwayFrame", 0)]
    assert peer.server.closed


def test_a_graceful_goaway_not_acknowledged_is_finished_by_the_shell() -> None:
    """A client that does not answer the PING: ``finish_going_away`` (the shell's timer) sends the
    final GOAWAY; with no stream open, the connection closes then."""
    peer = peer_with(Opener(Streaming))
    peer.server.go_away("the server is stopping", two_steps=True)
    assert not peer.server.closed
    peer.server.data_to_send()
    peer.server.finish_going_away()
    frames = parse_frames(peer.server.data_to_send())
    assert [(f.last_stream_id, f.error_code) for f in frames if isinstance(f, GoAwayFrame)] == [(0, 0)]
    assert peer.server.closed


def test_a_graceful_goaway_with_no_open_stream_closes_at_once_or_in_two_steps_on_the_ping_ack() -> None:
    peer = peer_with(Opener(Streaming))
    peer.server.go_away("the server is draining")
    assert peer.server.closed
    peer = peer_with(Opener(Streaming))
    peer.server.go_away("the server is stopping", two_steps=True)
    assert not peer.server.closed
    peer.server.receive_data(frame(PING, ACK, 0, GOAWAY_PING))
    assert peer.server.closed


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["open", "ack", "finish", "end_one", "go_away"]), max_size=24), st.booleans())
def test_a_graceful_goaway_never_takes_a_stream_above_its_final_goaway(actions: list[str], two_steps: bool) -> None:
    """Streams opened, PING ACKs, the shell's timer and the streams' ends in any order around a
    ``go_away``: nothing raises; a stream is taken exactly when no final GOAWAY naming a lower
    stream came before it; once the final GOAWAY is out and no stream is open, the connection is closed."""
    method = Opener(Streaming)
    peer = peer_with(method)
    final: int | None = None  # the last stream id the final GOAWAY named
    opened: list[int] = []
    for action in actions:
        if action == "open":
            stream_id = peer.client.get_next_available_stream_id()
            peer.client.send_headers(stream_id, [(":method", "POST"), (":scheme", "http"), (":path", PATH),
                                                 (":authority", "x"), ("content-type", "application/grpc")])
            peer.server.receive_data(peer.client.data_to_send())
            if final is None and not peer.server.closed:
                opened.append(stream_id)
        elif action == "ack":
            peer.server.receive_data(frame(PING, ACK, 0, GOAWAY_PING))
        elif action == "finish":
            peer.server.finish_going_away()
        elif action == "go_away":
            peer.server.go_away("the server is stopping", two_steps=two_steps)
        else:
            for processor in method.opened:
                assert isinstance(processor, Streaming)
                if processor.final is None:
                    processor.final = RpcAbortError(Status.OK, "")
                    processor.wake()
                    peer.server.resume_unparked()
                    break
        for goaway in parse_frames(peer.server.data_to_send()):
            if isinstance(goaway, GoAwayFrame) and goaway.last_stream_id != 2**31 - 1:
                final = goaway.last_stream_id if final is None else final
                assert goaway.last_stream_id in (final, 0) and goaway.error_code == 0
        assert len(method.opened) == len(opened)
        if final is not None:
            assert all(stream_id <= final for stream_id in opened)
            if all(p.final is not None for p in method.opened):  # type: ignore[attr-defined]
                assert peer.server.closed


SIBLING_FAILS_AT_ONCE = """
import trio
from evergreen_trio._grpc.server import serve_grpc

async def fail_at_once():
    raise RuntimeError("a sibling failed")

async def main():
    for _ in range(20):  # the sibling fails at each of the start's first checkpoints in turn
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fail_at_once)
                await nursery.start(serve_grpc, [], "127.0.0.1", 0)
                await trio.sleep_forever()
        except BaseExceptionGroup as group:
            assert group.subgroup(RuntimeError) is not None
    print("ended")

trio.run(main)
"""


def test_a_server_whose_start_a_failing_sibling_cancelled_ends_with_it() -> None:
    """A sibling failing at once cancels ``nursery.start(serve_grpc, ...)`` before the server is
    up: its shielded task nursery, kept by Trio in the cancelled start and its scope handed to no
    one, used to hang the nursery for ever (a picker whose file discovery failed never exited).
    Run in a subprocess: the old code hangs where no timeout of Trio's reaches."""
    done = subprocess.run([sys.executable, "-c", SIBLING_FAILS_AT_ONCE], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0 and done.stdout.strip() == "ended", done.stderr
