"""pyarrow glue: split IPC streams into (metadata, body) pairs and rebuild batches from them.

The sender never re-serializes: an Arrow IPC stream or file already holds each message
as a Flatbuffers header followed by its packed body, so :func:`split_stream` walks it
with ``pyarrow.ipc.MessageReader`` and keeps zero-copy slices. The receiver rebuilds
batches with pyarrow's own stream reader on a :class:`StreamFeeder`, a file-like object
whose ``read_buffer`` hands pyarrow the received body buffers themselves, so bodies are
not copied and dictionary batches are handled by pyarrow (``read_record_batch`` alone
cannot resolve dictionaries).
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.ipc

from evergreen_trio._files import READ_WITHOUT_WAITING, not_regular
from evergreen_trio.ipc.config import DEFAULT_LIMITS, IpcLimits
from evergreen_trio.ipc.errors import FramingError, IpcError, LimitExceededError
from evergreen_trio.ipc.flatbuf import MessageHeader, MessageKind, parse_message_header

FILE_MAGIC = b"ARROW1"
_CONTINUATION = b"\xff\xff\xff\xff"
_EOS_MARKER = _CONTINUATION + b"\x00\x00\x00\x00"
_I64 = struct.Struct("<q")


@dataclass(frozen=True)
class OutgoingMessage:
    """One IPC message ready to send: its Flatbuffers header and its body (if any)."""

    flatbuffer: pa.Buffer
    header: MessageHeader
    body: pa.Buffer | None


def split_stream(data: pa.Buffer) -> list[OutgoingMessage]:
    """Split a serialized IPC stream into messages without copying bodies."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(data))
        messages = []
        for message in reader:
            flatbuffer = message.metadata
            header = parse_message_header(flatbuffer.to_pybytes())
            body = message.body if header.has_body else None
            messages.append(OutgoingMessage(flatbuffer, header, body))
    except (pa.ArrowException, OSError) as exc:
        raise FramingError(f"IPC stream: expected Arrow IPC messages, got an error from pyarrow: {exc}") from None
    if not messages or messages[0].header.kind is not MessageKind.SCHEMA:
        raise FramingError("IPC stream: expected a Schema message first")
    return messages


def messages_from_batches(schema: pa.Schema, batches: Iterable[pa.RecordBatch]) -> list[OutgoingMessage]:
    """Serialize batches once (pyarrow's stream writer, dictionaries included) and split them."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return split_stream(sink.getvalue())


def messages_from_table(table: pa.Table, max_chunksize: int | None = None) -> list[OutgoingMessage]:
    """A table's batches as messages; ``max_chunksize`` rows per batch if given."""
    return messages_from_batches(table.schema, table.to_batches(max_chunksize=max_chunksize))


def messages_from_file(path: str | os.PathLike[str]) -> list[OutgoingMessage]:
    """Memory-map an Arrow IPC file or stream and split it; bodies stay in the mapping.

    Raises FramingError, naming ``path``, for anything but a non-empty regular file of Arrow IPC
    (a FIFO is refused, not waited on).
    """
    fd = os.open(path, READ_WITHOUT_WAITING)
    try:
        status = os.fstat(fd)
        if (kind := not_regular(status.st_mode)) is not None:
            raise FramingError(f"{os.fspath(path)}: expected a regular file holding Arrow IPC, got {kind}")
        if status.st_size == 0:
            raise FramingError(f"{os.fspath(path)}: expected an Arrow IPC file or stream, got an empty file")
        mapped = pa.py_buffer(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
    finally:
        os.close(fd)
    if mapped.size >= 8 and mapped[: len(FILE_MAGIC)].to_pybytes() == FILE_MAGIC:
        # The file format is "ARROW1", padding, then a complete stream ending in EOS.
        mapped = mapped.slice(8)
    try:
        return split_stream(mapped)
    except FramingError as exc:
        raise FramingError(f"{os.fspath(path)}: {exc}") from None


def _padded(flatbuffer: pa.Buffer | bytes) -> bytes:
    raw = flatbuffer.to_pybytes() if isinstance(flatbuffer, pa.Buffer) else bytes(flatbuffer)
    return raw + b"\x00" * (-len(raw) % 8)


class StreamFeeder:
    """A file-like source for ``pyarrow.ipc.open_stream`` fed one message at a time.

    pyarrow calls ``read_buffer`` and wraps the returned object without copying, so a
    body pushed here becomes the parent buffer of the arrays pyarrow builds.
    """

    closed = False

    def __init__(self) -> None:
        self._chunks: collections.deque[pa.Buffer] = collections.deque()

    def push(self, flatbuffer: pa.Buffer | bytes, body: pa.Buffer | None) -> None:
        """Queue one encapsulated message: continuation, length, padded header, body."""
        meta = _padded(flatbuffer)
        self._chunks.append(pa.py_buffer(_CONTINUATION + struct.pack("<i", len(meta)) + meta))
        if body is not None and body.size:
            self._chunks.append(body)

    def push_end(self) -> None:
        self._chunks.append(pa.py_buffer(_EOS_MARKER))

    def read_buffer(self, nbytes: int = -1) -> pa.Buffer:
        if not self._chunks:
            return pa.py_buffer(b"")
        head = self._chunks[0]
        if nbytes < 0 or nbytes == head.size:
            return self._chunks.popleft()
        if nbytes < head.size:
            self._chunks[0] = head.slice(nbytes)
            return head.slice(0, nbytes)
        parts = []
        while nbytes > 0 and self._chunks:
            part = self.read_buffer(min(nbytes, self._chunks[0].size))
            parts.append(part.to_pybytes())
            nbytes -= part.size
        return pa.py_buffer(b"".join(parts))

    def read(self, nbytes: int = -1) -> bytes:
        return bytes(self.read_buffer(nbytes).to_pybytes())

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self._chunks.clear()


def decompressed_bytes(header: MessageHeader, body: pa.Buffer) -> int:
    """What the buffers of a compressed batch inflate to, as their int64 prefixes declare.

    A prefix of -1 marks a buffer sent uncompressed (its length less the prefix); a buffer
    shorter than its prefix holds nothing to inflate (pyarrow rejects it if not empty).
    Raises IpcError for a prefix below -1.
    """
    view = memoryview(body)
    total = 0
    for offset, length in header.buffers:
        if length < _I64.size:
            continue
        declared: int = _I64.unpack_from(view, offset)[0]
        if declared < -1:
            raise IpcError(f"IPC message {header.kind.name}: expected uncompressed lengths >= -1, got {declared}")
        total += length - _I64.size if declared == -1 else declared
    return total


class BatchDecoder:
    """Turn in-order (header, body) messages into ``pyarrow.RecordBatch``es with pyarrow's reader."""

    def __init__(self, limits: IpcLimits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._feeder = StreamFeeder()
        self._reader: pa.ipc.RecordBatchStreamReader | None = None

    @property
    def schema(self) -> pa.Schema | None:
        return None if self._reader is None else self._reader.schema

    def feed(self, flatbuffer: bytes, header: MessageHeader, body: pa.Buffer | None) -> pa.RecordBatch | None:
        """Feed one message; return the batch it completes (dictionaries complete none).

        Each batch is fully validated (offsets, dictionary indices, UTF-8): pyarrow's reader checks
        only buffer sizes, and a peer's offset past its data would crash whoever reads the value.
        Raises LimitExceededError for a compressed batch declaring more than ``max_decompressed_bytes``.
        """
        if header.compressed and body is not None:
            # pyarrow allocates what each buffer's prefix declares: 32 KiB of ZSTD can claim 1 GiB.
            declared = decompressed_bytes(header, body)
            if declared > self._limits.max_decompressed_bytes:
                raise LimitExceededError(
                    f"IPC message {header.kind.name}: expected a compressed body inflating to <= "
                    f"{self._limits.max_decompressed_bytes} bytes (max_decompressed_bytes), got {declared} declared")
        self._feeder.push(flatbuffer, body)
        try:
            if self._reader is None:
                self._reader = pa.ipc.open_stream(self._feeder)
                return None
            if header.kind is MessageKind.RECORD_BATCH:
                batch: pa.RecordBatch = self._reader.read_next_batch()
                batch.validate(full=True)
                return batch
        except (pa.ArrowException, OSError, StopIteration) as exc:
            raise IpcError(f"IPC message {header.kind.name}: pyarrow rejected it: {exc}") from None
        return None


def read_messages(messages: Iterable[OutgoingMessage]) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """Decode outgoing messages locally (Flight's DoGet, checks) with pyarrow's reader."""
    decoder = BatchDecoder()
    batches = []
    for message in messages:
        batch = decoder.feed(message.flatbuffer, message.header, message.body)
        if batch is not None:
            batches.append(batch)
    assert decoder.schema is not None
    return decoder.schema, batches
