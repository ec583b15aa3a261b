"""`decode`'s known-prefix path against `_decode_general` (every check on every byte): same outcome on any input."""

from __future__ import annotations

import struct
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from avp_strategies import COMPRESSIONS, messages, random_array
from hypothesis import example, given
from hypothesis import strategies as st

from evergreen_trio._proto.avp.avp_pb2 import Metadata
from evergreen_trio.avp import (
    AVPChecksumError,
    AVPError,
    AVPInconsistentError,
    AVPLimitError,
    AVPLimits,
    AVPMetadata,
    DataType,
    PayloadType,
    codec,
    decode,
    encode,
)
from evergreen_trio.avp.codec import _checksum_field, _checksum_field_bytes, _decode_general
from evergreen_trio.avp.message import DEFAULT_LIMITS, HEADER_SIZE

Outcome = tuple[Any, ...]


def _outcome(fn: Any, data: bytes, limits: AVPLimits, strict: bool) -> Outcome:
    try:
        message = fn(data, limits, strict)
    except AVPError as exc:
        return type(exc), str(exc)
    return message.header, message.metadata, bytes(message.payload)


def _known(data: bytes, limits: AVPLimits, strict: bool) -> Any:
    return decode(data, limits=limits, strict=strict)


def _general(data: bytes, limits: AVPLimits, strict: bool) -> Any:
    return _decode_general(memoryview(data), limits, strict)


def _same(data: bytes, limits: AVPLimits = DEFAULT_LIMITS, strict: bool = True) -> Outcome:
    """Decode twice (learning, then knowing the prefix) and once without the cache; all three agree."""
    general = _outcome(_general, data, limits, strict)
    assert _outcome(_known, data, limits, strict) == general
    assert _outcome(_known, data, limits, strict) == general
    return general


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        out.append(value & 0x7F | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


@pytest.mark.fuzz
@given(messages(), COMPRESSIONS, st.booleans(), st.booleans(), st.data())
def test_mutated_messages_decode_as_the_general_path_does(
    message: tuple[AVPMetadata, Any, Any], compression: str | None, checksum: bool, strict: bool,
    data: st.DataObject,
) -> None:
    metadata, payload, _ = message
    encoded = encode(payload, metadata, compression=compression, checksum=checksum)  # type: ignore[arg-type]
    assert not isinstance(_same(encoded, strict=strict)[0], type)  # a valid message decodes
    mutated = bytearray(encoded)
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] = data.draw(st.integers(0, 255))
    _same(bytes(mutated[: data.draw(st.integers(0, len(mutated)))]), strict=strict)
    _same(bytes(mutated), strict=strict)


@pytest.mark.fuzz
@given(st.binary(max_size=40), st.binary(min_size=1, max_size=7), st.binary(max_size=16), st.sampled_from([0, 1, 4]),
       st.booleans())
def test_arbitrary_metadata_tails_decode_as_the_general_path_does(
    head: bytes, tail: bytes, section: bytes, flags: int, strict: bool
) -> None:
    # Valid fields, then bytes shaped like (or almost like) a trailing checksum field.
    prefix = Metadata(model_id="m", hidden_dim=len(head)).SerializeToString()
    for meta in (prefix + b"\x78" + tail, prefix + head + b"\x78" + tail, head + tail):
        frame = struct.pack("<2sBBII", b"AV", 1, flags, len(meta) + len(section), len(meta))
        _same(frame + meta + section, strict=strict)


@given(st.text(max_size=6), st.integers(0, 2**64 - 1))
@example("", 0xFFFFFFFF)
@example("", 2**35 - 1)
def test_checksum_field_reads_what_upb_reads(model_id: str, value: int) -> None:
    prefix = Metadata(session_id="s", model_id=model_id).SerializeToString()
    # Canonical, truncated to 32 bits, and a non-canonical two-byte form (upb reads all three).
    for varint in (_varint(value), _varint(value & 0xFFFFFFFF), bytes([0x80 | (value & 0x7F), 0])):
        meta = prefix + b"\x78" + varint
        head = bytes(HEADER_SIZE) + meta
        cut, checksum = _checksum_field(head)
        parsed = Metadata.FromString(meta)
        if len(varint) <= 5 and len(meta) >= 6:
            assert (cut, checksum) == (HEADER_SIZE + len(prefix), parsed.payload_checksum)
        else:  # longer than a uint32's varint, or metadata too short to split: the whole prefix is the key
            assert (cut, checksum) == (len(head), None)


@given(st.integers(0, 2**32 - 1))
@example(0)
@example(2**28 - 1)
@example(2**28)
def test_the_checksum_field_is_written_as_upb_writes_it(checksum: int) -> None:
    assert _checksum_field_bytes(checksum) == Metadata(payload_checksum=checksum).SerializeToString()
    head = bytes(HEADER_SIZE) + Metadata(model_id="model").SerializeToString() + _checksum_field_bytes(checksum)
    assert _checksum_field(head)[1] == checksum


def test_a_stream_learns_its_prefix_once_and_checks_every_crc() -> None:
    metadata = AVPMetadata(model_id="m", dtype=DataType.FLOAT16, tensor_shape=(1, 64))
    codec._known.clear()
    for seed in range(20):
        array = random_array((1, 64), DataType.FLOAT16, seed)
        message = decode(encode(array, metadata))
        np.testing.assert_array_equal(message.as_array(), array)
        assert message.metadata == replace(metadata, payload_checksum=message.metadata.payload_checksum)
    # One prefix per length of the checksum's varint (most CRCs take 5 bytes).
    assert 1 <= len(codec._known) <= 5


@pytest.mark.parametrize("compression", [None, "fast"])
def test_any_changed_tensor_byte_raises_the_checksum_error_on_a_known_prefix(compression: str | None) -> None:
    array = random_array((4, 8), DataType.FLOAT32)
    metadata = AVPMetadata(model_id="m", tensor_shape=(4, 8))
    message = encode(array, metadata, compression=compression)  # type: ignore[arg-type]
    decode(message)
    for position in range(HEADER_SIZE + struct.unpack_from("<I", message, 8)[0], len(message)):
        corrupted = bytearray(message)
        corrupted[position] ^= 0x01
        with pytest.raises(AVPError) as info:
            decode(bytes(corrupted))
        if compression is None:
            assert isinstance(info.value, AVPChecksumError)


def test_a_changed_checksum_varint_raises_a_typed_error() -> None:
    message = encode(random_array((1, 16), DataType.FLOAT32), AVPMetadata(tensor_shape=(1, 16)))
    decode(message)
    meta_end = HEADER_SIZE + struct.unpack_from("<I", message, 8)[0]
    cut, _ = _checksum_field(message[:meta_end])
    for position in range(cut + 1, meta_end):
        for flip in (0x01, 0x80):
            corrupted = bytearray(message)
            corrupted[position] ^= flip
            with pytest.raises(AVPError):
                decode(bytes(corrupted))


def test_other_limits_or_strictness_are_checked_anew_on_a_known_prefix() -> None:
    array = random_array((1, 256), DataType.FLOAT32)
    message = encode(array, AVPMetadata(tensor_shape=(1, 256)))
    decode(message)
    with pytest.raises(AVPLimitError, match="max_payload_bytes=512"):
        decode(message, limits=AVPLimits(max_payload_bytes=512))
    with pytest.raises(AVPLimitError, match="rank <= 1"):
        decode(message, limits=AVPLimits(max_rank=1))
    decode(message)
    # A KV flag the metadata does not back: strict refuses, lenient follows the metadata.
    flagged = bytearray(message)
    flagged[3] |= 0x04
    assert decode(bytes(flagged), strict=False).metadata.payload_type is PayloadType.HIDDEN_STATE
    with pytest.raises(AVPInconsistentError, match="KV-cache bit"):
        decode(bytes(flagged))
    assert decode(bytes(flagged), strict=False).metadata.payload_type is PayloadType.HIDDEN_STATE


def test_the_cache_of_prefixes_stays_bounded() -> None:
    array = random_array((1, 4), DataType.FLOAT32)
    for index in range(3 * codec._KNOWN_MAX):
        decode(encode(array, AVPMetadata(model_id=str(index), tensor_shape=(1, 4))))
        assert len(codec._known) <= codec._KNOWN_MAX
    big = AVPMetadata(model_id="m" * (codec._KNOWN_METADATA + 1), tensor_shape=(1, 4))
    codec._known.clear()
    message = decode(encode(array, big))
    assert message.metadata.model_id == big.model_id and not codec._known


def test_decoded_metadata_is_not_shared_between_messages() -> None:
    message = encode(b"\0" * 4, AVPMetadata(extra={"k": "v"}, tensor_shape=(1,)))
    first, second = decode(message), decode(message)
    first.metadata.extra["k"] = "changed"
    assert second.metadata.extra == {"k": "v"} and first.metadata is not second.metadata
