"""Transport-agnostic binding of AVP messages to streams of pieces (Evergreen chunk fragments, sockets).

No Trio here: `read_avp` only iterates an async iterable, and `avp_fragments` only slices buffers.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterator, Sequence
from typing import Any

from evergreen_trio.avp.errors import AVPEncodeError
from evergreen_trio.avp.incremental import AVPDecoder
from evergreen_trio.avp.message import DEFAULT_LIMITS, AVPLimits, AVPMessage

AVP_MIMETYPE = "application/avp+binary"


async def read_avp(
    pieces: AsyncIterable[bytes | memoryview], *, limits: AVPLimits = DEFAULT_LIMITS, strict: bool = True
) -> AVPMessage:
    """Decode one message from ``pieces`` as they arrive; the payload lands in one preallocated buffer.

    Raises `AVPTruncatedError` if the pieces end early and `AVPLengthError` if more follow the message.
    """
    decoder = AVPDecoder(limits=limits, strict=strict)
    async for piece in pieces:
        decoder.feed(piece)
    return decoder.close()


def avp_fragments(message_buffers: Any, fragment_size: int) -> Iterator[memoryview]:
    """Split an encoded message (bytes, or the parts `encode_buffers` returns) into views of <= ``fragment_size``.

    Fragments never span two parts, so nothing is joined: a part shorter than ``fragment_size``
    (the header and metadata, or a part's tail) goes out as a shorter fragment.
    """
    if isinstance(fragment_size, bool) or not isinstance(fragment_size, int) or fragment_size < 1:
        raise AVPEncodeError(f"fragment_size: expected a positive int, got {fragment_size!r}")
    parts: Sequence[Any] = message_buffers if isinstance(message_buffers, list | tuple) else [message_buffers]
    for part in parts:
        view = memoryview(part).cast("B")
        for start in range(0, len(view), fragment_size):
            yield view[start : start + fragment_size]
