"""gRPC's length-prefixed messages, as llm-d-router's parsers/util/grpc.go reads a body."""

from __future__ import annotations

HEADER = 5
"""A message's prefix: a compression flag byte, then the length (4 bytes, big-endian)."""


class FrameError(ValueError):
    """A body that does not start with a whole, uncompressed gRPC message."""


def grpc_payload(data: bytes) -> bytes:
    """The first message of a gRPC body (bytes after it are ignored, as the reference does)."""
    if len(data) < HEADER:
        raise FrameError(f"invalid gRPC frame: expected at least {HEADER} bytes for header, got {len(data)}")
    if data[0] == 1:
        raise FrameError("compressed gRPC payload is not supported")
    length = int.from_bytes(data[1:HEADER], "big")
    if len(data) < HEADER + length:
        raise FrameError(f"incomplete gRPC payload: header indicates {length} bytes, but only "
                         f"{len(data) - HEADER} bytes are available")
    return data[HEADER : HEADER + length]
