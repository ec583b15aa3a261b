"""The session server's message reader fed arbitrary bytes: messages, the end, or RpcAbortError with a status."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._grpc.bridge import _recv_message
from evergreen_trio._grpc.errors import RpcAbortError
from evergreen_trio._proto.evergreen.v2.evergreen_pb2 import SessionMessage


class BufferStream:
    """grpclib's protocol stream as ``_recv_message`` sees it: ``recv_data(n)`` over fixed bytes."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def recv_data(self, size: int) -> bytes:
        if not self.data:
            return b""
        if len(self.data) < size:  # what grpclib's Buffer does when the stream ends mid-read
            raise AssertionError("Received less data than expected")
        chunk, self.data = self.data[:size], self.data[size:]
        return chunk


async def drain(data: bytes, limit: int) -> list[SessionMessage]:
    stream, messages = BufferStream(data), []
    while (message := await _recv_message(stream, SessionMessage, limit)) is not None:
        assert isinstance(message, SessionMessage)
        messages.append(message)
    return messages


@pytest.mark.fuzz
@given(st.binary(max_size=256), st.integers(min_value=0, max_value=64))
async def test_any_bytes_give_messages_or_a_status(data: bytes, limit: int) -> None:
    try:
        await drain(data, limit)
    except RpcAbortError as abort:
        assert abort.status.name in {"RESOURCE_EXHAUSTED", "UNIMPLEMENTED", "INVALID_ARGUMENT"}


@given(st.lists(st.text(max_size=20), max_size=5))
async def test_valid_messages_round_trip(texts: list[str]) -> None:
    messages = [SessionMessage(actions=[{"name": t}]) for t in texts]
    wire = b"".join(b"\x00" + len(m.SerializeToString()).to_bytes(4, "big") + m.SerializeToString() for m in messages)
    assert await drain(wire, 1 << 20) == messages


async def test_the_limit_is_checked_on_the_prefix_alone() -> None:
    with pytest.raises(RpcAbortError, match="a message of 4294967295 bytes, over the 100-byte limit"):
        await drain(b"\x00\xff\xff\xff\xff", 100)  # no body at all: refused before reading one
