"""The sans-IO gRPC client connection (``_grpc/client_wire.py``) fed what a server may send: random bytes,
well-framed random frames, and each bad answer on its own. It never raises; it gives messages no larger
than the limit and one final status per stream; it holds at most one window of unconsumed messages."""

from __future__ import annotations

import hpack
import pytest
from frames import (  # the picker wire's frame constants, as the raw attack client uses them
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    GOAWAY,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    frame,
    settings,
)
from grpclib.const import Status
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._grpc.client_wire import ClientConnection, MessageReceived, StreamEnded, encode_timeout

LIMIT = 300
WINDOW = 65_535


def block(*headers: tuple[str, str]) -> bytes:
    return bytes(hpack.Encoder().encode(list(headers)))


REPLY = block((":status", "200"), ("content-type", "application/grpc"))
OK = block(("grpc-status", "0"))


def message(body: bytes, flag: int = 0) -> bytes:
    return bytes((flag,)) + len(body).to_bytes(4, "big") + body


def goaway(last: int, code: int = 0, said: bytes = b"") -> bytes:
    return frame(GOAWAY, 0, 0, last.to_bytes(4, "big") + code.to_bytes(4, "big") + said)


def opened(streams: int = 1) -> tuple[ClientConnection, list[int]]:
    conn = ClientConnection("server:1", window=WINDOW)
    conn.initiate()
    ids = [conn.start_stream("/s/M", timeout=5.0, max_message_bytes=LIMIT) for _ in range(streams)]
    conn.data_to_send()
    conn.receive(settings())
    assert conn.settled
    return conn, [i for i in ids if i is not None]


def kinds(wire: bytes) -> list[tuple[int, int]]:
    """(frame type, stream id) of each frame in ``wire`` (skipping the client preface)."""
    if wire.startswith(b"PRI"):
        wire = wire[24:]
    out = []
    while len(wire) >= 9:
        size = int.from_bytes(wire[:3], "big")
        out.append((wire[3], int.from_bytes(wire[5:9], "big") & 0x7FFFFFFF))
        wire = wire[9 + size :]
    return out


def check(conn: ClientConnection, events: list[object], ended: set[int], answered: set[int] | None = None) -> None:
    answered = set() if answered is None else answered
    for event in events:
        assert isinstance(event, MessageReceived | StreamEnded)
        if isinstance(event, MessageReceived):
            assert len(event.body) <= LIMIT and event.size == len(event.body) + 5
            assert event.stream_id not in ended
            answered.add(event.stream_id)
        else:
            assert event.stream_id not in ended, "two final statuses"
            assert not (event.unprocessed and event.stream_id in answered), "answered, yet to be sent again"
            ended.add(event.stream_id)
    for stream in conn._streams.values():
        assert len(stream.buffer) <= LIMIT + 5 + 16_384
        assert stream.held <= WINDOW


@pytest.mark.fuzz
@given(st.binary(max_size=2_000), st.integers(1, 300))
def test_random_bytes_give_messages_statuses_or_a_closed_connection(data: bytes, chunk: int) -> None:
    conn, _ = opened(2)
    ended: set[int] = set()
    for offset in range(0, len(data), chunk):
        check(conn, conn.receive(data[offset : offset + chunk]), ended)
        conn.data_to_send()
    if conn.closed:
        assert ended == set(conn._streams)


stream_ids = st.sampled_from([0, 1, 3, 5, 7])
frames = st.one_of(
    st.builds(lambda s, f: frame(HEADERS, f, s, REPLY), stream_ids, st.sampled_from([END_HEADERS, 0, END_HEADERS | 1])),
    st.builds(lambda s, f: frame(HEADERS, f, s, OK), stream_ids, st.sampled_from([END_HEADERS | END_STREAM, 0])),
    st.builds(lambda s, f: frame(CONTINUATION, f, s), stream_ids, st.sampled_from([0, END_HEADERS])),
    st.builds(lambda s, v, f, g: frame(DATA, f, s, message(v, g)), stream_ids, st.binary(max_size=400),
              st.sampled_from([0, END_STREAM]), st.sampled_from([0, 0, 0, 1])),
    st.builds(lambda s, v: frame(DATA, 0, s, v), stream_ids, st.binary(max_size=40)),
    st.builds(lambda s, n: frame(WINDOW_UPDATE, 0, s, n.to_bytes(4, "big")), stream_ids, st.integers(0, 2**31 - 1)),
    st.builds(lambda v: settings((SETTINGS_INITIAL_WINDOW_SIZE, v)), st.integers(0, 2**31 - 1)),
    st.builds(lambda s, c: frame(RST_STREAM, 0, s, c.to_bytes(4, "big")), stream_ids, st.integers(0, 15)),
    st.builds(goaway, st.integers(0, 9), st.integers(0, 15), st.binary(max_size=20)),
    st.builds(lambda k, f, s, p: frame(k, f, s, p), st.integers(0, 12), st.integers(0, 255), stream_ids,
              st.binary(max_size=20)),
)


@pytest.mark.fuzz
@given(st.lists(frames, max_size=30), st.integers(1, 500), st.booleans())
def test_framed_conversations_never_raise_and_keep_the_accounting(
    sequence: list[bytes], chunk: int, consume: bool
) -> None:
    conn, ids = opened(3)
    ended: set[int] = set()
    answered: set[int] = set()
    data = b"".join(sequence)
    for offset in range(0, len(data), chunk):
        events = conn.receive(data[offset : offset + chunk])
        check(conn, events, ended, answered)
        if consume:
            for event in events:
                if isinstance(event, MessageReceived):
                    conn.consumed(event.stream_id, event.size)
        conn.data_to_send()
    if conn.closed:  # by the server: each call had its final status
        assert set(ids) <= ended
    for stream_id in ids:
        conn.send_message(stream_id, b"x" * 100)
        conn.end_stream(stream_id)
        conn.release(stream_id)
    conn.data_to_send()
    if not conn.accepting:  # after a GOAWAY, the last call's end closes the connection
        assert conn.closed


def test_a_whole_call_gives_its_messages_then_ok() -> None:
    conn, [sid] = opened()
    events = conn.receive(frame(HEADERS, END_HEADERS, sid, REPLY) + frame(DATA, 0, sid, message(b"a") + message(b"bc"))
                          + frame(HEADERS, END_HEADERS | END_STREAM, sid, OK))
    assert [(type(e).__name__, getattr(e, "body", None)) for e in events] == [
        ("MessageReceived", b"a"), ("MessageReceived", b"bc"), ("StreamEnded", None)]
    assert events[-1] == StreamEnded(sid, events[-1].status, "") and events[-1].status.name == "OK"


@pytest.mark.parametrize(
    ("answer", "status", "text"),
    [
        (lambda s: frame(HEADERS, END_HEADERS | END_STREAM, s, block((":status", "200"), ("grpc-status", "5"),
                                                                     ("grpc-message", "no%20such"))),
         "NOT_FOUND", "no such"),
        (lambda s: frame(HEADERS, END_HEADERS | END_STREAM, s, block((":status", "404"))), "UNIMPLEMENTED",
         "HTTP status 404"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(HEADERS, END_HEADERS | END_STREAM, s,
                                                                 block(("grpc-status", "99x"))),
         "UNKNOWN", "grpc-status '99x'"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(HEADERS, END_HEADERS | END_STREAM, s,
                                                                 block(("x", "y"))),
         "UNKNOWN", "no grpc-status"),
        (lambda s: frame(HEADERS, END_HEADERS, s, block((":status", "200"), ("content-type", "text/html"))),
         "UNKNOWN", "content-type 'text/html'"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(DATA, 0, s, message(b"x" * LIMIT)[:-1])
         + frame(HEADERS, END_HEADERS | END_STREAM, s, OK), "INVALID_ARGUMENT", "ended inside a message"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(DATA, END_STREAM, s), "UNAVAILABLE",
         "without a status"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(DATA, 0, s, message(b"x" * (LIMIT + 1))),
         "RESOURCE_EXHAUSTED", f"a message of {LIMIT + 1} bytes, over the {LIMIT}-byte limit"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(DATA, 0, s, message(b"x", flag=1)),
         "UNIMPLEMENTED", "compressed"),
        (lambda s: frame(RST_STREAM, 0, s, (7).to_bytes(4, "big")), "UNAVAILABLE", "REFUSED_STREAM"),
        (lambda s: goaway(s - 1, 11, b"calm down"),
         "UNAVAILABLE", "GOAWAY ENHANCE_YOUR_CALM: calm down"),
        (lambda s: b"\x00\x00\x04\x00\x00\x00\x00\x00\x00junk", "UNAVAILABLE", "broke the HTTP/2 protocol"),
        (lambda s: b"\xff\xff\xff\x00\x00\x00\x00\x00\x01", "UNAVAILABLE", "a frame of 16777215 bytes, over the"),
        (lambda s: frame(DATA, 0, s, message(b"x")), "INTERNAL", "DATA before its response headers"),
        (lambda s: frame(HEADERS, END_HEADERS, s, REPLY) + frame(HEADERS, END_HEADERS, s, OK), "INTERNAL",
         "trailers that do not end the stream"),
        (lambda s: frame(0x5, END_HEADERS, s, (2).to_bytes(4, "big") + REPLY), "UNAVAILABLE", "PUSH_PROMISE"),
        (lambda s: frame(DATA, 0, s + 2, message(b"x")), "UNAVAILABLE", "never opened"),
        (lambda s: frame(HEADERS, 0, s, REPLY) + frame(DATA, 0, s), "UNAVAILABLE", "expected CONTINUATION"),
        (lambda s: frame(HEADERS, 0, s, REPLY) + frame(CONTINUATION, 0, s) * 70, "UNAVAILABLE", "over 64 frames"),
        (lambda s: frame(WINDOW_UPDATE, 0, 0, (2**31 - 1).to_bytes(4, "big")), "UNAVAILABLE", "past 2^31-1"),
    ],
    ids=["trailers-only", "http-404", "bad-grpc-status", "no-grpc-status", "not-grpc", "cut-message",
         "no-trailers", "over-the-limit", "compressed", "refused", "goaway", "bad-frame",
         "huge-frame-refused-on-its-header", "data-first", "trailers-not-ending", "push", "idle-stream",
         "no-continuation", "continuation-flood", "window-overflow"],
)
def test_each_bad_answer_is_one_final_status(answer: object, status: str, text: str) -> None:
    conn, [sid] = opened()
    events = conn.receive(answer(sid))  # type: ignore[operator]
    final = [e for e in events if isinstance(e, StreamEnded)]
    assert len(final) == 1 and final[0].status.name == status and text in final[0].message, final


def test_a_goaway_ends_only_the_calls_above_its_last_stream_and_says_they_were_not_processed() -> None:
    """RFC 9113, 6.8, as a graceful shutdown uses it: calls up to the last stream id run on to their end;
    those above it end UNAVAILABLE, marked as not processed (the shell may send them again); no new
    call starts; the last call's end closes the connection, with a GOAWAY back."""
    conn, [first, second, third] = opened(3)
    events = conn.receive(frame(HEADERS, END_HEADERS, first, REPLY) + goaway(second, said=b"Server shutdown"))
    assert events == [StreamEnded(third, Status.UNAVAILABLE, "the server went away (GOAWAY NO_ERROR: Server shutdown)",
                                  unprocessed=True)]
    assert not conn.accepting and not conn.closed
    events = conn.receive(frame(DATA, 0, first, message(b"answer"))
                          + frame(HEADERS, END_HEADERS | END_STREAM, first, OK)
                          + frame(HEADERS, END_HEADERS | END_STREAM, second, REPLY + OK))
    assert [(type(e).__name__, e.stream_id) for e in events] == [
        ("MessageReceived", first), ("StreamEnded", first), ("StreamEnded", second)]
    assert all(not e.unprocessed for e in events if isinstance(e, StreamEnded))
    assert conn.closed and (GOAWAY, 0) in kinds(conn.data_to_send())


def test_a_second_goaway_lowers_the_last_stream_and_a_released_call_closes_the_connection() -> None:
    """grpc-core's graceful shutdown: GOAWAY(2^31-1), then GOAWAY(the real last stream id)."""
    conn, [first, second] = opened(2)
    assert conn.receive(goaway(2**31 - 1)) == []
    [event] = conn.receive(goaway(first))
    assert isinstance(event, StreamEnded) and event.stream_id == second and event.unprocessed
    assert not conn.closed
    conn.release(first)  # the caller gave up on it: nothing is left to wait for
    assert conn.closed


def test_a_refused_stream_is_unprocessed_only_before_its_response() -> None:
    conn, [early, late] = opened(2)
    refused = (7).to_bytes(4, "big")
    events = conn.receive(frame(RST_STREAM, 0, early, refused) + frame(HEADERS, END_HEADERS, late, REPLY)
                          + frame(RST_STREAM, 0, late, refused))
    ended = [(e.stream_id, e.unprocessed) for e in events if isinstance(e, StreamEnded)]
    assert ended == [(early, True), (late, False)]
    assert conn.accepting


def test_response_headers_over_the_header_list_limit_end_the_connection() -> None:
    conn, [sid] = opened()
    big = bytes(hpack.Encoder().encode([(":status", "200"), ("x-padding", "p" * 70_000)], huffman=False))
    pieces = [big[i : i + 16_384] for i in range(0, len(big), 16_384)]
    wire = frame(HEADERS, 0, sid, pieces[0]) + b"".join(
        frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0, sid, p) for i, p in enumerate(pieces) if i)
    events = conn.receive(wire)
    assert conn.closed and [e.status.name for e in events if isinstance(e, StreamEnded)] == ["UNAVAILABLE"]
    assert "header" in conn.reason.lower(), conn.reason


def test_a_first_frame_other_than_settings_is_not_http2() -> None:
    conn = ClientConnection("server:1")
    conn.initiate()
    conn.receive(b"HTTP/1.1 400 Bad Request\r\n")
    assert conn.closed and "first frame is not SETTINGS (it began 'HTTP/1.1 ')" in conn.reason


def test_a_message_over_the_limit_is_refused_on_its_prefix_and_the_stream_reset() -> None:
    conn, [sid] = opened()
    events = conn.receive(frame(HEADERS, END_HEADERS, sid, REPLY) + frame(DATA, 0, sid, b"\x00\xff\xff\xff\xff"))
    assert [e.status.name for e in events if isinstance(e, StreamEnded)] == ["RESOURCE_EXHAUSTED"]
    assert (RST_STREAM, sid) in kinds(conn.data_to_send())


def test_credit_goes_back_only_for_consumed_messages() -> None:
    """Whole messages hold the window until taken: a server cannot make the client buffer more than
    one window of them (a partial message is credited at once: its size is bounded by the limit)."""
    conn = ClientConnection("server:1", window=WINDOW)
    conn.initiate()
    sid = conn.start_stream("/s/M", max_message_bytes=20_000)
    assert sid is not None
    conn.receive(settings())
    conn.data_to_send()
    body = b"y" * 10_000
    events = conn.receive(frame(HEADERS, END_HEADERS, sid, REPLY)
                          + b"".join(frame(DATA, 0, sid, message(body)) for _ in range(4)))
    assert len(events) == 4
    assert not [k for k in kinds(conn.data_to_send()) if k[0] == WINDOW_UPDATE]
    for event in events:
        assert isinstance(event, MessageReceived)
        conn.consumed(sid, event.size)
    assert {(WINDOW_UPDATE, 0), (WINDOW_UPDATE, sid)} <= set(kinds(conn.data_to_send()))


def test_a_server_past_the_window_breaks_the_connection() -> None:
    conn, [sid] = opened()
    flood = frame(HEADERS, END_HEADERS, sid, REPLY) + b"".join(
        frame(DATA, 0, sid, message(b"z" * 250)) for _ in range(WINDOW // 255 + 2))
    events = conn.receive(flood)
    assert conn.closed and [e.status.name for e in events if isinstance(e, StreamEnded)] == ["UNAVAILABLE"]
    assert sum(s.held for s in conn._streams.values()) <= WINDOW


def test_outbound_messages_wait_for_the_servers_window() -> None:
    conn, [sid] = opened()
    conn.receive(frame(HEADERS, END_HEADERS, sid, REPLY))
    conn.send_message(sid, b"q" * 100_000)
    conn.end_stream(sid)
    sent = conn.data_to_send()
    assert 65_535 <= len(sent) < 70_000 and conn.pending(sid) == 100_005 - 65_535
    conn.receive(frame(WINDOW_UPDATE, 0, 0, (50_000).to_bytes(4, "big"))
                 + frame(WINDOW_UPDATE, 0, sid, (50_000).to_bytes(4, "big")))
    assert conn.pending(sid) == 0
    last = kinds(conn.data_to_send())
    assert last and last[-1] == (DATA, sid)


@pytest.mark.parametrize(("seconds", "header"), [(5.0, "5000000u"), (0.25, "250000u"), (1e-12, "1n"),
                                                 (120.0, "120000m"), (1e6, "1000000S"), (1e12, "99999999H")])
def test_grpc_timeout_fits_eight_digits_rounded_up(seconds: float, header: str) -> None:
    assert encode_timeout(seconds) == header


def test_calls_the_server_ends_first_do_not_pile_up() -> None:
    """A server ends each call (trailers) while the client's request still waits for window: each is
    reset when released, so none stays open against the server's stream limit."""
    conn, _ = opened()
    trailers_only = block((":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "0"))
    for _ in range(1_000):
        sid = conn.start_stream("/s/M", max_message_bytes=LIMIT)
        assert sid is not None
        conn.send_message(sid, b"m" * 200)
        conn.end_stream(sid)
        conn.data_to_send()
        assert [e.status.name for e in conn.receive(frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers_only))
                if isinstance(e, StreamEnded)] == ["OK"]
        conn.release(sid)
    assert conn.room() and conn._open == 1  # the call opened() left open


def test_the_request_headers_decode_as_hpack_reads_them() -> None:
    """Our header block (static table and literals, no table state) read by a real HPACK decoder."""
    conn = ClientConnection("example.org:443", scheme="https")
    conn.initiate()
    sid = conn.start_stream("/pkg.Svc/Method", metadata={"X-Token": "t0k"}, timeout=0.5, max_message_bytes=LIMIT)
    wire = conn.data_to_send()
    assert wire.startswith(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    assert [k for k in kinds(wire) if k[1]] == [(HEADERS, sid)]
    start = wire.rindex(bytes((HEADERS, END_HEADERS))) - 3
    size = int.from_bytes(wire[start : start + 3], "big")
    assert hpack.Decoder().decode(wire[start + 9 : start + 9 + size]) == [
        (":method", "POST"), (":scheme", "https"), (":path", "/pkg.Svc/Method"), (":authority", "example.org:443"),
        ("te", "trailers"), ("content-type", "application/grpc"), ("grpc-timeout", "500000u"), ("x-token", "t0k")]


def test_settings_and_pings_are_acknowledged_and_the_stream_limit_kept() -> None:
    conn = ClientConnection("server:1")
    conn.initiate()
    conn.data_to_send()
    conn.receive(settings((0x3, 2)) + frame(PING, 0, 0, b"12345678"))
    assert conn.settled
    answer = conn.data_to_send()
    assert kinds(answer) == [(SETTINGS, 0), (PING, 0)] and answer.endswith(b"12345678")
    first = conn.start_stream("/s/M", max_message_bytes=LIMIT)
    assert conn.room() and conn.start_stream("/s/M", max_message_bytes=LIMIT) is not None and not conn.room()
    assert first is not None
    conn.reset_stream(first)
    assert conn.room()


def test_data_frames_follow_the_servers_max_frame_size() -> None:
    conn = ClientConnection("server:1")
    conn.initiate()
    conn.receive(settings((0x5, 32_768), (SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20))
                 + frame(WINDOW_UPDATE, 0, 0, (1 << 20).to_bytes(4, "big")))
    sid = conn.start_stream("/s/M", max_message_bytes=LIMIT)
    assert sid is not None
    conn.data_to_send()
    conn.send_message(sid, b"d" * 100_000)
    sizes, wire = [], conn.data_to_send()
    while wire:
        size = int.from_bytes(wire[:3], "big")
        sizes.append(size)
        wire = wire[9 + size :]
    assert sizes == [32_768, 32_768, 32_768, 100_005 - 3 * 32_768]
