"""Sans-IO framing of the Dissociated IPC Protocol: metadata messages, tags, body
descriptors, ``free_data`` messages and the 16-byte frame header of stream transports.

Tag layout (uint64): bits 0-31 the sequence number, bits 56-63 the body type, bits 32-55
zero on every body. We use bits 32-55 for our own tag spaces (metadata on tagged
transports, requests, handshakes): a body tag can never collide with them, and a
receiver that sees bits 32-55 set on something claiming to be a body rejects it.
The reference C++ implementation shifts the body type by 55 bits; the specification
says 56 and so do we (:data:`REFERENCE_BODY_TYPE_SHIFT` documents the difference).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import FramingError, LimitExceededError, RequestRefusedError

UINT32_MAX = 0xFFFF_FFFF
UINT64_MAX = 0xFFFF_FFFF_FFFF_FFFF
SEQ_MASK = 0x0000_0000_FFFF_FFFF
RESERVED_MASK = 0x00FF_FFFF_0000_0000
BODY_TYPE_SHIFT = 56
REFERENCE_BODY_TYPE_SHIFT = 55

METADATA_PREFIX = 5
META_EOS = 0
META_FLATBUFFER = 1
META_REFUSED = 0xFF
"""Our extension (the spec has types 0 and 1): the server refuses the request; the rest is a UTF-8 reason."""
MAX_REASON_BYTES = 512


def _space(name: bytes) -> int:
    return int.from_bytes(name, "big") << 32


METADATA_TAG = _space(b"MET")
"""Tag of metadata messages on tagged transports (UCX); bodies can never match it."""
WANT_DATA_TAG = _space(b"WNT")
"""Default ``want_data`` tag a server advertises in its URI."""
FREE_DATA_TAG = _space(b"FRE")
"""Default ``free_data`` tag a server advertises in its URI."""
HELLO_TAG = _space(b"HEL")
"""UCX handshake: client -> listener, body = the client's worker address."""
ADDRESS_TAG = _space(b"ADR")
"""UCX handshake: server -> client, body = the per-connection server worker address."""
BYE_TAG = _space(b"BYE")
"""UCX: either side is closing the connection (UCX endpoints do not report a graceful close)."""


class BodyType(enum.IntEnum):
    """Bits 56-63 of a body tag."""

    RAW = 0
    DESCRIPTOR = 1


@dataclass(frozen=True)
class MetadataMessage:
    """A type-1 metadata message: sequence number and Flatbuffers header bytes."""

    seq: int
    flatbuffer: bytes


@dataclass(frozen=True)
class EndOfStream:
    """A type-0 metadata message; ``seq`` is the number following the last metadata message."""

    seq: int


@dataclass(frozen=True)
class BodyTag:
    """A decoded body tag."""

    seq: int
    body_type: BodyType


@dataclass(frozen=True)
class BodyDescriptor:
    """A type-1 body: total size and (offset, length) of each buffer in shared memory."""

    total: int
    buffers: tuple[tuple[int, int], ...]


def _check_seq(seq: int) -> None:
    if not 0 <= seq <= UINT32_MAX:
        raise FramingError(f"sequence number: expected 0..{UINT32_MAX}, got {seq}")


def encode_metadata(seq: int, flatbuffer: bytes | memoryview) -> bytes:
    """Frame one Flatbuffers IPC header: type 1, seq (uint32 LE), header bytes."""
    _check_seq(seq)
    return struct.pack("<BI", META_FLATBUFFER, seq) + bytes(flatbuffer)


def encode_end_of_stream(seq: int) -> bytes:
    """The exactly-5-byte End of Stream message."""
    _check_seq(seq)
    return struct.pack("<BI", META_EOS, seq)


def encode_refusal(reason: str) -> bytes:
    """A type-0xFF message telling the client why its request is refused (reason cut to 512 bytes)."""
    return struct.pack("<BI", META_REFUSED, 0) + reason.encode()[:MAX_REASON_BYTES]


def decode_metadata(data: bytes | memoryview, limits: IpcLimits = DEFAULT_LIMITS) -> MetadataMessage | EndOfStream:
    """Parse one metadata-stream message."""
    view = memoryview(data)
    if len(view) < METADATA_PREFIX:
        raise FramingError(f"metadata message: expected >= {METADATA_PREFIX} bytes, got {len(view)}")
    kind, seq = struct.unpack_from("<BI", view)
    if kind == META_EOS:
        if len(view) != METADATA_PREFIX:
            raise FramingError(f"End of Stream: expected exactly 5 bytes, got {len(view)}")
        return EndOfStream(seq)
    if kind == META_REFUSED:
        reason = bytes(view[METADATA_PREFIX : METADATA_PREFIX + MAX_REASON_BYTES]).decode("utf-8", "replace")
        raise RequestRefusedError(f"the server refused: {reason}")
    if kind != META_FLATBUFFER:
        raise FramingError(f"metadata message type: expected 0 (EOS) or 1 (Flatbuffers), got {kind}")
    size = len(view) - METADATA_PREFIX
    if size == 0:
        raise FramingError(f"metadata message {seq}: expected Flatbuffers bytes after the prefix, got none")
    if size > limits.max_metadata_bytes:
        raise LimitExceededError(f"metadata message {seq}: expected <= {limits.max_metadata_bytes} bytes, got {size}")
    return MetadataMessage(seq, bytes(view[METADATA_PREFIX:]))


def make_tag(seq: int, body_type: BodyType) -> int:
    """Body tag: sequence number in bits 0-31, body type in bits 56-63."""
    _check_seq(seq)
    return (int(body_type) << BODY_TYPE_SHIFT) | seq


def parse_body_tag(tag: int) -> BodyTag:
    """Decode a body tag; reject reserved bits 32-55 and unknown body types."""
    if not 0 <= tag <= UINT64_MAX:
        raise FramingError(f"tag: expected a uint64, got {tag}")
    if tag & RESERVED_MASK:
        raise FramingError(f"tag {tag:#018x}: expected bits 32-55 to be zero, got {(tag & RESERVED_MASK) >> 32:#x}")
    raw_type = tag >> BODY_TYPE_SHIFT
    try:
        body_type = BodyType(raw_type)
    except ValueError:
        raise FramingError(f"tag {tag:#018x}: expected body type 0 or 1, got {raw_type}") from None
    return BodyTag(tag & SEQ_MASK, body_type)


@dataclass(frozen=True)
class BodyIn:
    """A body as received, its tag parsed and its size checked once by the transport.

    ``body`` is the received memory for a raw body (a host ``pa.Buffer`` or a device
    array) and the decoded :class:`~evergreen_trio.ipc.framing.BodyDescriptor` for a shared-memory body; ``nbytes``
    is the body length it stands for (the descriptor's total).
    """

    tag: BodyTag
    body: object
    nbytes: int


def max_descriptor_bytes(limits: IpcLimits) -> int:
    """The largest descriptor ``limits`` allow: total, count and one (offset, length) per buffer."""
    return 16 + 16 * limits.max_buffers_per_body


def classify_body(tag: int, nbytes: int, limits: IpcLimits, accepts: BodyType) -> BodyTag:
    """Parse a body tag announced with ``nbytes`` and check it before anything is received.

    Raises FramingError for reserved bits, an unknown body type or a body type this
    connection does not carry (``accepts``), LimitExceededError for a body or descriptor
    larger than ``limits`` allow.
    """
    parsed = parse_body_tag(tag)
    if parsed.body_type is not accepts:
        wanted = "an inline body" if accepts is BodyType.RAW else "a shared-memory descriptor"
        got = "an inline body" if parsed.body_type is BodyType.RAW else "a shared-memory descriptor"
        raise FramingError(f"body {parsed.seq}: expected {wanted}, got {got}")
    if accepts is BodyType.DESCRIPTOR:
        if nbytes > max_descriptor_bytes(limits):
            raise LimitExceededError(f"body descriptor: expected <= {max_descriptor_bytes(limits)} bytes, got {nbytes}")
    elif nbytes > limits.max_body_bytes:
        raise LimitExceededError(f"body {parsed.seq}: expected <= {limits.max_body_bytes} bytes, got {nbytes}")
    return parsed


def body_in(tag: BodyTag, payload: object, nbytes: int, limits: IpcLimits) -> BodyIn:
    """The typed body for a classified tag: descriptors are decoded here, raw bodies kept.

    Raises FramingError / LimitExceededError for a malformed descriptor.
    """
    if tag.body_type is BodyType.DESCRIPTOR:
        descriptor = decode_descriptor(memoryview(payload), limits)  # type: ignore[arg-type]
        return BodyIn(tag, descriptor, descriptor.total)
    return BodyIn(tag, payload, nbytes)


def encode_descriptor(descriptor: BodyDescriptor) -> bytes:
    """Serialize a type-1 body: total, count, then (offset, length) pairs, all uint64 LE."""
    flat = [descriptor.total, len(descriptor.buffers)]
    for offset, length in descriptor.buffers:
        flat += [offset, length]
    return struct.pack(f"<{len(flat)}Q", *flat)


def decode_descriptor(data: bytes | memoryview, limits: IpcLimits = DEFAULT_LIMITS) -> BodyDescriptor:
    """Parse a type-1 body; the buffer count must match the message length exactly."""
    view = memoryview(data)
    if len(view) < 16 or len(view) % 16:
        raise FramingError(f"body descriptor: expected 16 + 16*n bytes, got {len(view)}")
    total, count = struct.unpack_from("<QQ", view)
    if count > limits.max_buffers_per_body:
        raise LimitExceededError(f"body descriptor: expected <= {limits.max_buffers_per_body} buffers, got {count}")
    if len(view) != 16 + 16 * count:
        raise FramingError(f"body descriptor: {count} buffers need {16 + 16 * count} bytes, got {len(view)}")
    flat = struct.unpack_from(f"<{2 * count}Q", view, 16)
    buffers = tuple(zip(flat[0::2], flat[1::2], strict=True))
    if sum(length for _, length in buffers) > total:
        raise FramingError(f"body descriptor: buffer lengths sum past the declared total {total}")
    return BodyDescriptor(total, buffers)


def encode_free_data(offsets: Sequence[int]) -> bytes:
    """One ``free_data`` message: one or more uint64 LE offsets."""
    if not offsets:
        raise FramingError("free_data: expected at least one offset, got none")
    return struct.pack(f"<{len(offsets)}Q", *offsets)


def decode_free_data(data: bytes | memoryview, limits: IpcLimits = DEFAULT_LIMITS) -> tuple[int, ...]:
    """Parse a ``free_data`` message."""
    view = memoryview(data)
    if not view or len(view) % 8:
        raise FramingError(f"free_data: expected a non-empty multiple of 8 bytes, got {len(view)}")
    count = len(view) // 8
    if count > limits.max_free_data_offsets:
        raise LimitExceededError(f"free_data: expected <= {limits.max_free_data_offsets} offsets, got {count}")
    return struct.unpack_from(f"<{count}Q", view)


FRAME_HEADER = struct.Struct("<QQ")


def encode_frame_header(tag: int, length: int) -> bytes:
    """Stream transports (TCP, Unix sockets) frame every message as (tag, length, bytes)."""
    return FRAME_HEADER.pack(tag, length)


def decode_frame_header(data: bytes | memoryview, limits: IpcLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """Parse a 16-byte frame header and bound its length before anything is allocated."""
    view = memoryview(data)
    if len(view) != FRAME_HEADER.size:
        raise FramingError(f"frame header: expected {FRAME_HEADER.size} bytes, got {len(view)}")
    tag, length = FRAME_HEADER.unpack(view)
    bound = limits.max_body_bytes if not tag & RESERVED_MASK else limits.max_metadata_bytes
    if length > bound:
        raise LimitExceededError(f"frame with tag {tag:#018x}: expected <= {bound} bytes, got {length}")
    return tag, length
