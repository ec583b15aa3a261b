"""Reading raw HTTP/2 bytes back as frames, for tests that speak to a server over a bare socket."""

from __future__ import annotations

from hyperframe.frame import Frame


def parse_frames(data: bytes) -> list[Frame]:
    """Every whole frame in ``data``, in order (a trailing partial frame is left out)."""
    frames = []
    while len(data) >= 9:
        frame, length = Frame.parse_frame_header(memoryview(data[:9]))
        frame.parse_body(memoryview(data[9 : 9 + length]))
        frames.append(frame)
        data = data[9 + length :]
    return frames
