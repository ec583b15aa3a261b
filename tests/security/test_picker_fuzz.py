"""Hypothesis fuzz of the picker wire's bounded paths: well-framed random frames, small slices, pause/resume.

The byte-level fuzz in ``tests/picker/test_grpc_wire.py`` rarely produces valid frame headers;
here every frame is well framed, so the new paths (CONTINUATION counting, window overflow,
blocked-stream sets, the buffer accounting, the stream-error budget, sliced processing) run.
"""

from __future__ import annotations

import hpack
import pytest
from frames import ECHO, ECHO_PATH, frame, grpc_message, settings
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._grpc.server_wire import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PREFACE,
    SETTINGS_INITIAL_WINDOW_SIZE,
    WINDOW_UPDATE,
    GrpcWireConnection,
    WireLimits,
)

LIMITS = WireLimits(window_bytes=70_000, max_buffered_bytes=100_000, max_header_frames=4, slice_bytes=200,
                    max_stream_errors_per_second=20, max_concurrent_streams=4)
BLOCK = bytes(hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", ECHO_PATH),
                                      (":authority", "p"), ("content-type", "application/grpc")]))
stream_ids = st.sampled_from([0, 1, 3, 5, 7, 9])
frames = st.one_of(
    st.builds(lambda s, f: frame(HEADERS, f, s, BLOCK), stream_ids, st.sampled_from([END_HEADERS, 0, END_STREAM | 4])),
    st.builds(lambda s, f: frame(CONTINUATION, f, s), stream_ids, st.sampled_from([0, END_HEADERS])),
    st.builds(lambda s, v, f: frame(DATA, f, s, grpc_message(v)), stream_ids, st.binary(max_size=300),
              st.sampled_from([0, END_STREAM])),
    st.builds(lambda s, n: frame(WINDOW_UPDATE, 0, s, n.to_bytes(4, "big")), stream_ids,
              st.integers(0, 2**31 - 1)),
    st.builds(lambda v: settings((SETTINGS_INITIAL_WINDOW_SIZE, v)), st.integers(0, 2**31 - 1)),
    st.builds(lambda s, c: frame(3, 0, s, c.to_bytes(4, "big")), stream_ids, st.integers(0, 15)),  # RST_STREAM
    st.builds(lambda k, f, s, p: frame(k, f, s, p), st.integers(0, 12), st.integers(0, 255), stream_ids,
              st.binary(max_size=20)),
)


@pytest.mark.fuzz
@given(st.lists(frames, max_size=40), st.integers(1, 500), st.floats(0, 3))
def test_fuzz_framed_conversations_keep_the_accounting(sequence: list[bytes], chunk: int, clock_step: float) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += clock_step
        return now[0]

    server = GrpcWireConnection({ECHO_PATH: ECHO}, LIMITS, clock=clock)
    data = PREFACE + settings((SETTINGS_INITIAL_WINDOW_SIZE, 100)) + b"".join(sequence)
    for offset in range(0, len(data), chunk):
        server.receive_data(data[offset : offset + chunk])
        for _ in range(10_000):
            out = server.data_to_send()
            assert len(out) <= LIMITS.slice_bytes + 2 * 16_384 + 1024
            if not server.paused:
                break
            server.resume()
        assert not server.paused
        streams = server._streams.values()
        assert server._buffered == sum(len(s.inbound) + len(s.pending) for s in streams)
        assert set(server._blocked_on_stream) | set(server._blocked_on_connection) <= set(server._streams)
        if server.closed:
            assert not streams
