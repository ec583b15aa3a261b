"""pyarrow glue: splitting without re-serializing, zero-copy reassembly, dictionaries, files."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pyarrow as pa
import pytest
from ipc_helpers import sample_table

from evergreen_trio.ipc.arrow import (
    BatchDecoder,
    decompressed_bytes,
    messages_from_file,
    messages_from_table,
    read_messages,
    split_stream,
)
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import FramingError, IpcError, LimitExceededError
from evergreen_trio.ipc.flatbuf import MessageHeader, MessageKind


def test_zero_copy_reassembly_with_dictionaries() -> None:
    table = sample_table()
    messages = messages_from_table(table, max_chunksize=3_000)
    decoder = BatchDecoder()
    batches = []
    for message in messages:
        batch = decoder.feed(message.flatbuffer.to_pybytes(), message.header, message.body)
        if batch is not None:
            data = batch.column(0).buffers()[1]
            assert message.body.address <= data.address < message.body.address + message.body.size
            batches.append(batch)
    assert pa.Table.from_batches(batches).equals(table)


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_compressed_batches_are_bounded_by_what_they_declare(codec: str) -> None:
    """Both columns count at their uncompressed size; one byte less of max_decompressed_bytes refuses the batch."""
    table = pa.table({"zeros": pa.array([0.0] * 4096), "noise": pa.array(list(os.urandom(4096)), pa.uint8())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(compression=codec)) as writer:
        writer.write_table(table)
    schema, batch = split_stream(sink.getvalue())
    assert batch.header.compressed and not schema.header.compressed
    assert batch.body is not None
    assert decompressed_bytes(batch.header, batch.body) == 4096 * 8 + 4096
    for limit, refused in ((4096 * 9, False), (4096 * 9 - 1, True)):
        decoder = BatchDecoder(IpcLimits(max_decompressed_bytes=limit))
        decoder.feed(schema.flatbuffer.to_pybytes(), schema.header, None)
        if refused:
            with pytest.raises(LimitExceededError, match="max_decompressed_bytes"):
                decoder.feed(batch.flatbuffer.to_pybytes(), batch.header, batch.body)
        else:
            assert decoder.feed(batch.flatbuffer.to_pybytes(), batch.header, batch.body).equals(table.to_batches()[0])


def test_a_buffer_sent_uncompressed_counts_its_length() -> None:
    """Prefix -1: the buffer follows as it is; 100: inflates to 100; empty buffers have no prefix."""
    body = pa.py_buffer(struct.pack("<q", -1) + bytes(16) + struct.pack("<q", 100) + bytes(8))
    header = MessageHeader(MessageKind.RECORD_BATCH, body.size, ((0, 24), (24, 0), (24, 16)), compressed=True)
    assert decompressed_bytes(header, body) == 16 + 100
    forged = pa.py_buffer(struct.pack("<q", -2) + bytes(8))
    with pytest.raises(IpcError, match="expected uncompressed lengths >= -1, got -2"):
        decompressed_bytes(MessageHeader(MessageKind.RECORD_BATCH, 16, ((0, 16),), compressed=True), forged)


@pytest.mark.parametrize("fmt", ["file", "stream"])
def test_files_are_split_in_place(tmp_path: Path, fmt: str) -> None:
    table = sample_table()
    path = tmp_path / "t.arrow"
    opener = pa.ipc.new_file if fmt == "file" else pa.ipc.new_stream
    with opener(str(path), table.schema) as writer:
        writer.write_table(table, max_chunksize=5_000)
    schema, batches = read_messages(messages_from_file(path))
    assert pa.Table.from_batches(batches, schema=schema).equals(table)


def test_garbage_files_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bad.arrow"
    path.write_bytes(b"\xff\xff\xff\xff\x10\x00\x00\x00" + b"\x01" * 16)
    with pytest.raises(FramingError):
        messages_from_file(path)
    path.write_bytes(b"")
    with pytest.raises(FramingError):
        messages_from_file(path)
    with pytest.raises(FramingError, match="expected a regular file"):
        messages_from_file("/dev/zero")  # its size says 0, its reads never end
