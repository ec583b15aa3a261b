"""pyarrow glue: splitting without re-serializing, zero-copy reassembly, dictionaries, files."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from ipc_helpers import sample_table

from evergreen_trio.ipc.arrow import BatchDecoder, messages_from_file, messages_from_table, read_messages
from evergreen_trio.ipc.errors import FramingError


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
