"""Protocol invariants: round trips for every dtype, payload type, compression and shape; fuzzed decoders."""

from __future__ import annotations

import contextlib
import struct
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from avp_strategies import COMPRESSIONS, messages
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.avp import AVPError, AVPMetadata, decode, encode, encode_buffers
from evergreen_trio.avp.incremental import AVPDecoder


def _expected(metadata: AVPMetadata, compression: str | None) -> AVPMetadata:
    return replace(metadata, compression="zstd" if compression else None)


@given(messages(), COMPRESSIONS, st.booleans())
def test_round_trip(message: tuple[AVPMetadata, Any, np.ndarray[Any, Any]], compression: str | None,
                    checksum: bool) -> None:
    metadata, payload, array = message
    data = encode(payload, metadata, compression=compression, checksum=checksum)  # type: ignore[arg-type]
    decoded = decode(data)
    assert replace(decoded.metadata, payload_checksum=None) == _expected(metadata, compression)
    assert (decoded.metadata.payload_checksum is not None) == checksum
    out = decoded.as_array()
    assert out.shape == array.shape and out.dtype == array.dtype
    np.testing.assert_array_equal(out.view(np.uint8), array.view(np.uint8))
    assert b"".join(encode_buffers(payload, metadata, compression=compression, checksum=checksum)) == data


@given(messages(), COMPRESSIONS, st.data())
def test_incremental_equals_one_shot(message: tuple[AVPMetadata, Any, Any], compression: str | None,
                                     data: st.DataObject) -> None:
    metadata, payload, _ = message
    encoded = encode(payload, metadata, compression=compression)  # type: ignore[arg-type]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(encoded)), max_size=8)))
    decoder = AVPDecoder()
    results = [decoder.feed(encoded[a:b]) for a, b in zip([0, *cuts], [*cuts, len(encoded)], strict=True)]
    assert results[-1] is not None
    incremental = decoder.close()
    one_shot = decode(encoded)
    assert incremental.metadata == one_shot.metadata
    assert bytes(incremental.payload) == bytes(one_shot.payload)


def _decode_or_avp_error(data: bytes, strict: bool) -> None:
    with contextlib.suppress(AVPError):
        decode(data, strict=strict).as_array()


@pytest.mark.fuzz
@given(st.binary(max_size=256), st.booleans())
def test_fuzz_arbitrary_bytes(data: bytes, strict: bool) -> None:
    _decode_or_avp_error(data, strict)


@pytest.mark.fuzz
@given(st.binary(max_size=200), st.booleans())
def test_fuzz_arbitrary_metadata_behind_a_valid_header(raw: bytes, strict: bool) -> None:
    split = len(raw) // 2
    for flags in (0, 1, 2, 4, 7):
        head = struct.pack("<2sBBII", b"AV", 1, flags, len(raw), split)
        _decode_or_avp_error(head + raw, strict)


@pytest.mark.fuzz
@given(messages(), COMPRESSIONS, st.data())
def test_fuzz_mutated_messages(message: tuple[AVPMetadata, Any, Any], compression: str | None,
                               data: st.DataObject) -> None:
    metadata, payload, _ = message
    encoded = bytearray(encode(payload, metadata, compression=compression))  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        encoded[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(encoded)))
    mutated = bytes(encoded[:cut])
    for strict in (True, False):
        _decode_or_avp_error(mutated, strict)
        _decode_or_avp_error(bytes(encoded), strict)


@pytest.mark.fuzz
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_fuzz_incremental_pieces(pieces: list[bytes]) -> None:
    decoder = AVPDecoder()
    with contextlib.suppress(AVPError):
        for piece in pieces:
            decoder.feed(piece)
        decoder.close()
