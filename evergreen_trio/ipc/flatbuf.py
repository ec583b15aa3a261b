"""A bounds-checked reader for the few fields of an Arrow IPC ``Message`` header we need.

The client must know, from metadata alone, whether a message carries a body, how long
that body is and where its buffers lie, to match it against the tagged body and to
check a body descriptor. pyarrow does not expose that before the body is present, so
this module walks the Flatbuffers table directly. Every offset is checked: arbitrary
bytes give :class:`FlatbufferError`, never ``IndexError`` or ``struct.error``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

from evergreen_trio.ipc.errors import FlatbufferError

_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_BUFFER = struct.Struct("<qq")


class MessageKind(enum.IntEnum):
    """The ``MessageHeader`` union members that may appear in an IPC stream (tensors may not)."""

    SCHEMA = 1
    DICTIONARY_BATCH = 2
    RECORD_BATCH = 3


@dataclass(frozen=True)
class MessageHeader:
    """What the transport needs from an IPC header: kind, body length and buffer layout.

    ``compressed``: the batch names a body compression (each non-empty buffer then starts with
    its int64 uncompressed length).
    """

    kind: MessageKind
    body_length: int
    buffers: tuple[tuple[int, int], ...]
    compressed: bool = False

    @property
    def has_body(self) -> bool:
        """Record and dictionary batches are followed by a tagged body (possibly empty)."""
        return self.kind in (MessageKind.RECORD_BATCH, MessageKind.DICTIONARY_BATCH)


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.buf = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)

    def _unpack(self, fmt: struct.Struct, pos: int, what: str) -> int:
        if pos < 0 or pos + fmt.size > len(self.buf):
            raise FlatbufferError(f"{what}: expected {fmt.size} bytes at offset {pos}, buffer has {len(self.buf)}")
        value: int = fmt.unpack_from(self.buf, pos)[0]
        return value

    def table(self, pos: int, what: str) -> tuple[int, int, int]:
        """Return (table position, vtable position, vtable length in bytes)."""
        vtable = pos - self._unpack(_I32, pos, what)
        vt_len = self._unpack(_U16, vtable, f"{what} vtable")
        if vt_len < 4 or vt_len % 2:
            raise FlatbufferError(f"{what}: expected an even vtable length >= 4, got {vt_len}")
        self._unpack(_U16, vtable + vt_len - 2, f"{what} vtable")
        return pos, vtable, vt_len

    def field(self, table: tuple[int, int, int], index: int) -> int | None:
        pos, vtable, vt_len = table
        slot = 4 + 2 * index
        if slot + 2 > vt_len:
            return None
        off = self._unpack(_U16, vtable + slot, "vtable slot")
        return None if off == 0 else pos + off

    def scalar(self, table: tuple[int, int, int], index: int, fmt: struct.Struct, what: str) -> int:
        pos = self.field(table, index)
        return 0 if pos is None else self._unpack(fmt, pos, what)

    def indirect(self, table: tuple[int, int, int], index: int, what: str) -> int | None:
        pos = self.field(table, index)
        return None if pos is None else pos + self._unpack(_U32, pos, what)


def parse_message_header(data: bytes | memoryview, *, max_buffers: int = 65_536) -> MessageHeader:
    """Parse an Arrow IPC ``Message`` Flatbuffer; raise :class:`FlatbufferError` if malformed."""
    r = _Reader(data)
    root = r.table(r._unpack(_U32, 0, "root offset"), "Message")
    kind_value = r.scalar(root, 1, struct.Struct("<B"), "Message.header_type")
    try:
        kind = MessageKind(kind_value)
    except ValueError:
        raise FlatbufferError(
            f"Message.header_type: expected one of {[k.value for k in MessageKind]}, got {kind_value}"
        ) from None
    body_length = r.scalar(root, 3, _I64, "Message.bodyLength")
    if body_length < 0:
        raise FlatbufferError(f"Message.bodyLength: expected >= 0, got {body_length}")
    header_pos = r.indirect(root, 2, "Message.header")
    if header_pos is None:
        raise FlatbufferError(f"Message.header: expected a {kind.name} table, got none")
    buffers: tuple[tuple[int, int], ...] = ()
    compressed = False
    if kind is MessageKind.DICTIONARY_BATCH:
        dictionary = r.table(header_pos, "DictionaryBatch")
        header_pos = r.indirect(dictionary, 1, "DictionaryBatch.data")
        if header_pos is None:
            raise FlatbufferError("DictionaryBatch.data: expected a RecordBatch table, got none")
    if kind in (MessageKind.RECORD_BATCH, MessageKind.DICTIONARY_BATCH):
        batch = r.table(header_pos, "RecordBatch")
        compressed = r.field(batch, 3) is not None  # RecordBatch.compression: pyarrow inflates every buffer
        vec = r.indirect(batch, 2, "RecordBatch.buffers")
        if vec is not None:
            count = r._unpack(_U32, vec, "RecordBatch.buffers length")
            if count > max_buffers:
                raise FlatbufferError(f"RecordBatch.buffers: expected <= {max_buffers} buffers, got {count}")
            end = vec + 4 + count * _BUFFER.size
            if end > len(r.buf):
                raise FlatbufferError(
                    f"RecordBatch.buffers: expected {count} buffers ending at {end}, buffer has {len(r.buf)}"
                )
            buffers = tuple(_BUFFER.iter_unpack(r.buf[vec + 4 : end]))
        for offset, length in buffers:
            if offset < 0 or length < 0 or offset + length > body_length:
                raise FlatbufferError(
                    f"RecordBatch buffer: expected within body of {body_length} bytes, "
                    f"got offset {offset} length {length}"
                )
    elif kind is MessageKind.SCHEMA:
        r.table(header_pos, "Schema")
    return MessageHeader(kind=kind, body_length=body_length, buffers=buffers, compressed=compressed)
