"""HTTP/2 pieces both gRPC wires share (sans-IO): frame and setting numbers, frame and HPACK encoding
without table state, and a header-block decoder that remembers repeated blocks.

Header blocks this side sends use only HPACK's static table and literals, so no encoder state is kept
and nothing the peer says about its table size matters; blocks it receives are decoded by ``hpack``.
"""

from __future__ import annotations

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 0x2, 0x3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_FRAME_SIZE_SETTING = 16_777_215
MAX_CACHED_HEADER_BLOCKS = 16  # decoded header blocks kept per connection (a peer's repeat)
MAX_CACHED_HEADER_BLOCK_BYTES = 1024  # larger blocks are decoded every time

ERROR_NAMES = {NO_ERROR: "NO_ERROR", PROTOCOL_ERROR: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR",
               FLOW_CONTROL_ERROR: "FLOW_CONTROL_ERROR", 0x4: "SETTINGS_TIMEOUT", STREAM_CLOSED: "STREAM_CLOSED",
               FRAME_SIZE_ERROR: "FRAME_SIZE_ERROR", REFUSED_STREAM: "REFUSED_STREAM", CANCEL: "CANCEL",
               COMPRESSION_ERROR: "COMPRESSION_ERROR", 0xA: "CONNECT_ERROR", ENHANCE_YOUR_CALM: "ENHANCE_YOUR_CALM",
               0xC: "INADEQUATE_SECURITY", 0xD: "HTTP_1_1_REQUIRED"}


class ProtocolViolation(Exception):
    """A connection error (RFC 9113 section 5.4.1): GOAWAY with ``code``, and the connection ends."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def frame(kind: int, flags: int, stream_id: int, payload: bytes | bytearray = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream_id.to_bytes(4, "big") + payload


def settings_frame(*entries: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(key.to_bytes(2, "big") + value.to_bytes(4, "big") for key, value in entries))


def settings_entries(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS payload's (identifier, value) pairs; raises :class:`ProtocolViolation` FRAME_SIZE_ERROR
    when it is not made of 6-byte entries."""
    if len(payload) % 6:
        raise ProtocolViolation(FRAME_SIZE_ERROR, "expected SETTINGS of 6-byte entries")
    return [(int.from_bytes(payload[at : at + 2], "big"), int.from_bytes(payload[at + 2 : at + 6], "big"))
            for at in range(0, len(payload), 6)]


def goaway_frame(last_stream_id: int, code: int, message: str = "") -> bytes:
    """GOAWAY with ``code`` and at most 256 bytes of ``message`` as its debug data."""
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + code.to_bytes(4, "big") + message.encode()[:256])


def header_frames(stream_id: int, flags: int, block: bytes, max_frame: int) -> bytes:
    """HEADERS with ``flags`` (END_HEADERS added), split into CONTINUATION frames past ``max_frame``."""
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    chunks = [block[i : i + max_frame] for i in range(0, len(block), max_frame)]
    out = [frame(HEADERS, flags, stream_id, chunks[0])]
    out += [frame(CONTINUATION, 0, stream_id, chunk) for chunk in chunks[1:-1]]
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, chunks[-1]))
    return b"".join(out)


def hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal_bytes(name: bytes, value: bytes) -> bytes:
    """A header field as 'literal without indexing, new name' (no Huffman, no table state)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def literal(name: str, value: str) -> bytes:
    return literal_bytes(name.encode("ascii"), value.encode("ascii"))


def indexed_name_literal(index: int, value: bytes) -> bytes:
    """'Literal without indexing' whose name is static table entry ``index``."""
    return hpack_int(index, 4) + hpack_int(len(value), 7) + value


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding; raises :class:`ProtocolViolation` for padding as
    long as the frame."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolViolation(PROTOCOL_ERROR, "expected padding shorter than the frame")
    return payload[1 : len(payload) - payload[0]]


class HeaderDecoder:
    """``hpack.Decoder`` for one connection; a repeated block costs a lookup while the table is unchanged
    (a gRPC peer's headers repeat on every stream, as Envoy's and grpcio's do)."""

    def __init__(self, max_header_list_bytes: int) -> None:
        self._decoder = hpack.Decoder(max_header_list_size=max_header_list_bytes)
        self._cache: dict[bytes, dict[bytes, bytes]] = {}

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        """The fields of ``block`` (a later duplicate name wins); raises :class:`ProtocolViolation`
        COMPRESSION_ERROR on a bad block."""
        cache = self._cache
        fields = cache.get(block)
        if fields is not None:
            return fields
        table = self._decoder.header_table
        entries = table.dynamic_entries
        before = (entries[0] if entries else None, len(entries), table.maxsize)
        try:
            headers = self._decoder.decode(block, raw=True)
        except (hpack.HPACKError, ValueError, IndexError) as exc:
            raise ProtocolViolation(COMPRESSION_ERROR, f"expected a valid HPACK block ({type(exc).__name__})") from None
        fields = {bytes(k): bytes(v) for k, v in headers}
        # An insertion makes a new first entry, an eviction or resize changes the length or size.
        if before[0] is not (entries[0] if entries else None) or before[1:] != (len(entries), table.maxsize):
            cache.clear()  # and this block is not kept: decoding it again changes the table again
        elif len(cache) < MAX_CACHED_HEADER_BLOCKS and len(block) <= MAX_CACHED_HEADER_BLOCK_BYTES:
            cache[block] = fields
        return fields
