"""Codec examples: the published vectors, zero-copy, every error class, every limit crossed."""

from __future__ import annotations

import struct
import zlib
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import zstandard
from avp_strategies import random_array

from evergreen_trio.avp import (
    AVPChecksumError,
    AVPCompressionError,
    AVPEncodeError,
    AVPEnumError,
    AVPError,
    AVPInconsistentError,
    AVPLengthError,
    AVPLimitError,
    AVPLimits,
    AVPMagicError,
    AVPMetadata,
    AVPMetadataError,
    AVPTruncatedError,
    AVPVersionError,
    DataType,
    PayloadType,
    decode,
    encode,
    encode_buffers,
    encode_into,
)
from evergreen_trio.errors import ConfigurationError, EvergreenTrioError

VECTOR_1 = bytes.fromhex(
    "415601002a0000001a00000012076167656e742d61220a746573742d6d6f64656c28044a0104"
    "cdcccc3dcdcc4c3e9a99993ecdcccc3e"
)
VECTOR_2 = bytes.fromhex("415601000d0000000500000028024a01020000803f00000040")
META_1 = AVPMetadata(source_agent_id="agent-a", model_id="test-model", hidden_dim=4, tensor_shape=(4,))
META_2 = AVPMetadata(hidden_dim=2, tensor_shape=(2,))


def test_published_vectors_decode() -> None:
    first = decode(VECTOR_1)
    assert first.metadata == META_1
    assert first.as_array().tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4])
    second = decode(VECTOR_2)
    assert second.metadata == META_2
    assert second.as_array().tolist() == [1.0, 2.0]


def test_published_vectors_encode_byte_for_byte() -> None:
    assert encode(np.array([0.1, 0.2, 0.3, 0.4], dtype="<f4"), META_1, checksum=False) == VECTOR_1
    assert encode(np.array([1.0, 2.0], dtype="<f4").tobytes(), META_2, checksum=False) == VECTOR_2


def test_errors_are_rooted_in_the_package_base() -> None:
    assert issubclass(AVPError, EvergreenTrioError)


def test_uncompressed_payload_is_a_view_of_the_input() -> None:
    data = bytearray(encode(random_array((64,), DataType.FLOAT32), AVPMetadata(tensor_shape=(64,))))
    message = decode(data)
    assert message.payload.obj is data
    array = message.as_array()
    data[-4:] = struct.pack("<f", 42.0)
    assert array[-1] == 42.0


@pytest.mark.parametrize("dtype", list(DataType))
def test_as_array_dtypes(dtype: DataType) -> None:
    array = random_array((3, 5), dtype)
    message = decode(encode(array, AVPMetadata(dtype=dtype, tensor_shape=(3, 5))))
    out = message.as_array()
    assert out.dtype == array.dtype and out.shape == (3, 5)
    np.testing.assert_array_equal(out.view(np.uint8), array.view(np.uint8))
    if dtype is DataType.BFLOAT16:
        assert out.dtype == np.dtype(ml_dtypes.bfloat16)


def test_as_array_without_shape_is_flat() -> None:
    message = decode(encode(np.arange(6, dtype="<f4"), AVPMetadata()))
    assert message.as_array().shape == (6,)


def test_encode_buffers_does_not_copy_the_tensor() -> None:
    array = random_array((128,), DataType.FLOAT16)
    parts = encode_buffers(array, AVPMetadata(dtype=DataType.FLOAT16, tensor_shape=(128,)))
    assert len(parts) == 2
    assert np.shares_memory(np.frombuffer(parts[1], dtype=np.uint8), array)
    assert b"".join(parts) == encode(array, AVPMetadata(dtype=DataType.FLOAT16, tensor_shape=(128,)))


def test_encode_into_a_caller_buffer() -> None:
    array = random_array((16,), DataType.FLOAT32)
    metadata = AVPMetadata(tensor_shape=(16,))
    expected = encode(array, metadata, compression="fast")
    buffer = bytearray(len(expected) + 10)
    written = encode_into(buffer, array, metadata, compression="fast")
    assert written == len(expected) and bytes(buffer[:written]) == expected
    with pytest.raises(AVPEncodeError, match="at least"):
        encode_into(bytearray(written - 1), array, metadata, compression="fast")
    with pytest.raises(AVPEncodeError, match="read-only"):
        encode_into(bytes(written), array, metadata, compression="fast")


@pytest.mark.parametrize(
    ("payload", "metadata", "match"),
    [
        (np.zeros(4, dtype="<f2"), AVPMetadata(), "expected dtype float32"),
        (np.zeros(4, dtype=">f4"), AVPMetadata(), "little-endian"),
        (np.zeros((4, 4), dtype="<f4")[:, ::2], AVPMetadata(), "C-contiguous"),
        (b"\0" * 12, AVPMetadata(tensor_shape=(4,)), "implies 16 bytes, got 12"),
        (b"", AVPMetadata(dtype=9), "metadata.dtype"),  # type: ignore[arg-type]
        (b"", AVPMetadata(payload_type=7), "metadata.payload_type"),  # type: ignore[arg-type]
        (b"", AVPMetadata(hidden_dim=-1), "proto's types"),
        (b"", AVPMetadata(model_id=5), "proto's types"),  # type: ignore[arg-type]
        (object(), AVPMetadata(), "expected bytes, a buffer"),
        (np.zeros(4, dtype="<f4"), AVPMetadata(dtype=9), "metadata.dtype"),  # type: ignore[arg-type]
        (b"\0" * 8, AVPMetadata(dtype=9, tensor_shape=(2,)), "metadata.dtype"),  # type: ignore[arg-type]
        (b"\0" * 8, AVPMetadata(tensor_shape=(2, None)), "metadata.tensor_shape"),  # type: ignore[arg-type]
        (b"\0" * 8, AVPMetadata(tensor_shape=("a", "b")), "metadata.tensor_shape"),  # type: ignore[arg-type]
        (b"\0" * 8, AVPMetadata(tensor_shape=8), "metadata.tensor_shape"),  # type: ignore[arg-type]
    ],
)
def test_encode_rejects_bad_input(payload: object, metadata: AVPMetadata, match: str) -> None:
    with pytest.raises(AVPEncodeError, match=match):
        encode(payload, metadata)


def test_encode_rejects_unknown_compression() -> None:
    with pytest.raises(AVPEncodeError, match="compression"):
        encode(b"", AVPMetadata(), compression="lz4")  # type: ignore[arg-type]


def _message(metadata: AVPMetadata | None = None, payload: bytes = b"\0" * 16, **kwargs: object) -> bytes:
    return encode(payload, metadata or AVPMetadata(tensor_shape=(4,)), **kwargs)  # type: ignore[arg-type]


def _with_header(data: bytes, *, flags: int | None = None, payload_length: int | None = None,
                 metadata_length: int | None = None) -> bytes:
    magic, version, old_flags, old_pl, old_ml = struct.unpack_from("<2sBBII", data)
    head = struct.pack(
        "<2sBBII",
        magic,
        version,
        old_flags if flags is None else flags,
        old_pl if payload_length is None else payload_length,
        old_ml if metadata_length is None else metadata_length,
    )
    return head + data[12:]


@pytest.mark.parametrize(
    ("data", "error", "match"),
    [
        (b"AV\x01", AVPTruncatedError, "expected 12 bytes, got 3"),
        (b"XY" + _message()[2:], AVPMagicError, "expected 4156"),
        (b"AV\x02" + _message()[3:], AVPVersionError, "expected 1, got 2"),
        (_message()[:-1], AVPTruncatedError, "expected 37 bytes .*, got 36"),
        (_message() + b"\0", AVPLengthError, "expected 37 bytes .*, got 38"),
        (_with_header(_message(), metadata_length=1000), AVPLengthError, "at most payload_length"),
        (_with_header(_message(), flags=0x08), AVPInconsistentError, "reserved bits"),
        (_with_header(_message(), flags=0x04), AVPInconsistentError, "KV-cache bit clear"),
        (_with_header(_message(), flags=0x02), AVPInconsistentError, "has-map bit clear"),
        (_with_header(_message(AVPMetadata(avp_map_id="m", tensor_shape=(4,))), flags=0), AVPInconsistentError,
         "has-map bit set"),
        (_message(checksum=False).replace(b"\x4a\x01\x04", b"\x4a\x01\x05"), AVPInconsistentError,
         "implies 20 payload bytes"),
    ],
    ids=lambda value: value.__name__ if isinstance(value, type) else None,
)
def test_decode_errors(data: bytes, error: type[AVPError], match: str) -> None:
    with pytest.raises(error, match=match):
        decode(data)


def test_checksum_mismatch() -> None:
    data = bytearray(_message())
    data[-1] ^= 1
    with pytest.raises(AVPChecksumError, match="payload_checksum: expected 0x"):
        decode(data)
    assert decode(bytes(_message(checksum=False))[:-1] + b"\x01").payload[-1] == 1


def _raw_message(metadata: bytes, tensor: bytes, flags: int = 0) -> bytes:
    return struct.pack("<2sBBII", b"AV", 1, flags, len(metadata) + len(tensor), len(metadata)) + metadata + tensor


def test_unknown_enum_values_are_rejected() -> None:
    for field_tag, name in ((0x38, "payload_type"), (0x40, "dtype"), (0x50, "mode")):
        with pytest.raises(AVPEnumError, match=f"metadata.{name}: expected one of .* got 9"):
            decode(_raw_message(bytes([field_tag, 9]), b""))


def test_unparsable_metadata() -> None:
    with pytest.raises(AVPMetadataError, match=r"avp\.Metadata of 2 bytes"):
        decode(_raw_message(b"\x0a\x05", b""))


def test_flags_disagreeing_with_metadata_strict_and_lenient() -> None:
    # Compressed bit set, metadata.compression unset: the reference decompresses by the bit.
    raw = b"\0" * 16
    tensor = zstandard.ZstdCompressor().compress(raw)
    metadata = b"\x4a\x01\x04"
    data = _raw_message(metadata, tensor, flags=0x01)
    with pytest.raises(AVPInconsistentError, match="compressed bit clear"):
        decode(data)
    lenient = decode(data, strict=False)
    assert bytes(lenient.payload) == raw and lenient.metadata.compression == "zstd"
    # KV bit set on a hidden state: metadata decides the payload type.
    kv_flagged = _with_header(_message(), flags=0x04 | 0x08)
    assert decode(kv_flagged, strict=False).metadata.payload_type is PayloadType.HIDDEN_STATE


def test_unsupported_compression_name() -> None:
    data = _raw_message(b"\x5a\x03lz4", b"", flags=0x01)
    with pytest.raises(AVPCompressionError, match="expected 'zstd', got 'lz4'"):
        decode(data, strict=False)


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigurationError, match=r"AVPLimits\.max_rank"):
        AVPLimits(max_rank=-1)
    with pytest.raises(ConfigurationError, match=r"AVPLimits\.max_payload_bytes: expected at most 4294967295"):
        AVPLimits(max_payload_bytes=1 << 32)


def test_each_limit_is_enforced() -> None:
    big = _message(AVPMetadata(tensor_shape=(4,), extra={"a": "1", "b": "2"}))
    with pytest.raises(AVPLimitError, match="max_metadata_bytes=4"):
        decode(big, limits=AVPLimits(max_metadata_bytes=4))
    with pytest.raises(AVPLimitError, match="max_extra_entries=1"):
        decode(big, limits=AVPLimits(max_extra_entries=1))
    with pytest.raises(AVPLimitError, match="rank <= 1"):
        decode(_message(AVPMetadata(tensor_shape=(2, 2))), limits=AVPLimits(max_rank=1))
    with pytest.raises(AVPLimitError, match="max_payload_bytes=15"):
        decode(big, limits=AVPLimits(max_payload_bytes=15))
    huge_shape = _raw_message(b"\x4a\x03\xff\xff\x03", b"")
    with pytest.raises(AVPLimitError, match="implies 262140 payload bytes, above max_payload_bytes=1024"):
        decode(huge_shape, limits=AVPLimits(max_payload_bytes=1024))


def test_zstd_bomb_is_bounded() -> None:
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(80 << 20))
    assert len(bomb) < 10_000
    data = encode(bomb, AVPMetadata(), checksum=False)
    data = _raw_message(b"\x5a\x04zstd", bomb, flags=0x01)
    with pytest.raises(AVPLimitError, match="declares 83886080 bytes, above max_payload_bytes=67108864"):
        decode(data)


def test_zstd_bomb_without_declared_size_is_bounded() -> None:
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    bomb = stream.compress(bytes(2 << 20)) + stream.flush()
    data = _raw_message(b"\x5a\x04zstd", bomb, flags=0x01)
    with pytest.raises(AVPLimitError, match="more than max_payload_bytes=1048576"):
        decode(data, limits=AVPLimits(max_payload_bytes=1 << 20))
    assert len(decode(data).payload) == 2 << 20


def test_zstd_size_must_match_the_shape() -> None:
    tensor = zstandard.ZstdCompressor().compress(bytes(20))
    with pytest.raises(AVPInconsistentError, match="declares 20 bytes, tensor_shape implies 16"):
        decode(_raw_message(b"\x4a\x01\x04\x5a\x04zstd", tensor, flags=0x01))
    stream = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    undeclared = stream.compress(bytes(20)) + stream.flush()
    with pytest.raises(AVPCompressionError, match="expected 16 decompressed bytes, got more"):
        decode(_raw_message(b"\x4a\x01\x04\x5a\x04zstd", undeclared, flags=0x01))


def test_corrupt_zstd() -> None:
    with pytest.raises(AVPCompressionError, match="zstd"):
        decode(_raw_message(b"\x5a\x04zstd", b"not zstd at all", flags=0x01))
    tensor = zstandard.ZstdCompressor().compress(bytes(16)) + b"trailing garbage"
    with pytest.raises(AVPCompressionError, match="zstd"):
        decode(_raw_message(b"\x5a\x04zstd", tensor, flags=0x01))


def test_compressed_round_trip_verifies_crc_of_uncompressed_bytes() -> None:
    array = random_array((256,), DataType.FLOAT32)
    data = encode(array, AVPMetadata(tensor_shape=(256,)), compression="balanced")
    message = decode(data)
    assert message.metadata.compression == "zstd"
    assert message.metadata.payload_checksum == zlib.crc32(array.tobytes())
    np.testing.assert_array_equal(message.as_array(), array)


def test_decode_accepts_any_contiguous_buffer() -> None:
    data = _message()
    as_words = np.frombuffer(data[: len(data) // 4 * 4], dtype=np.uint32)
    with pytest.raises(AVPTruncatedError):
        decode(as_words)
    assert decode(memoryview(data)).metadata == replace(decode(data).metadata)


def test_repeated_metadata_encodes_each_checksum_anew() -> None:
    metadata = AVPMetadata(model_id="m", tensor_shape=(4,))
    first, second = np.arange(4, dtype="<f4"), np.arange(4, 8, dtype="<f4")
    a = encode(first, metadata)
    b = encode(second, metadata)
    c = encode(first, metadata, checksum=False)
    assert decode(a).metadata.payload_checksum == zlib.crc32(first.tobytes())
    assert decode(b).metadata.payload_checksum == zlib.crc32(second.tobytes())
    assert decode(c).metadata.payload_checksum is None
    assert encode(first, metadata) == a
    assert encode(first, replace(metadata, tensor_shape=[4])) == a  # type: ignore[arg-type]
