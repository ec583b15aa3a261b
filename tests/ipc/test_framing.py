"""Framing, tags, descriptors, free_data, frame headers, Flatbuffers headers and URIs."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from ipc_helpers import sample_messages

from evergreen_trio.errors import ConfigurationError, EvergreenTrioError
from evergreen_trio.ipc.config import IpcLimits
from evergreen_trio.ipc.errors import FramingError, IpcError, LimitExceededError, UriError
from evergreen_trio.ipc.flatbuf import MessageKind, parse_message_header
from evergreen_trio.ipc.framing import (
    BODY_TYPE_SHIFT,
    FREE_DATA_TAG,
    METADATA_TAG,
    RESERVED_MASK,
    WANT_DATA_TAG,
    BodyDescriptor,
    BodyTag,
    BodyType,
    EndOfStream,
    MetadataMessage,
    decode_descriptor,
    decode_frame_header,
    decode_free_data,
    decode_metadata,
    encode_descriptor,
    encode_end_of_stream,
    encode_frame_header,
    encode_free_data,
    encode_metadata,
    make_tag,
    parse_body_tag,
)
from evergreen_trio.ipc.uri import IpcUri, parse_uri

seqs = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


def test_spec_examples() -> None:
    assert encode_end_of_stream(7) == b"\x00\x07\x00\x00\x00"
    assert encode_metadata(1, b"FB") == b"\x01\x01\x00\x00\x00FB"
    assert make_tag(5, BodyType.DESCRIPTOR) == (1 << 56) | 5
    assert BODY_TYPE_SHIFT == 56
    assert parse_body_tag((1 << 56) | 0xFFFFFFFF) == BodyTag(0xFFFFFFFF, BodyType.DESCRIPTOR)
    assert decode_free_data(b"\x01" + b"\x00" * 7) == (1,)


def test_our_tag_spaces_never_look_like_bodies() -> None:
    for tag in (METADATA_TAG, WANT_DATA_TAG, FREE_DATA_TAG):
        assert tag & RESERVED_MASK
        with pytest.raises(FramingError, match="bits 32-55"):
            parse_body_tag(tag)


@given(seqs, st.binary(min_size=1, max_size=64))
def test_metadata_roundtrip(seq: int, flatbuffer: bytes) -> None:
    assert decode_metadata(encode_metadata(seq, flatbuffer)) == MetadataMessage(seq, flatbuffer)
    assert decode_metadata(encode_end_of_stream(seq)) == EndOfStream(seq)


@given(seqs, st.sampled_from(BodyType))
def test_tag_roundtrip_and_seq_mask(seq: int, body_type: BodyType) -> None:
    tag = make_tag(seq, body_type)
    assert tag & 0x00000000FFFFFFFF == seq
    assert parse_body_tag(tag) == BodyTag(seq, body_type)


@given(u64)
def test_tags_with_reserved_bits_are_rejected(tag: int) -> None:
    if tag & RESERVED_MASK or tag >> 56 > 1:
        with pytest.raises(FramingError):
            parse_body_tag(tag)
    else:
        assert parse_body_tag(tag).seq == tag & 0xFFFFFFFF


@given(st.lists(st.tuples(st.integers(0, 2**40), st.integers(0, 2**20)), max_size=20), st.integers(0, 2**20))
def test_descriptor_roundtrip(buffers: list[tuple[int, int]], slack: int) -> None:
    descriptor = BodyDescriptor(sum(length for _, length in buffers) + slack, tuple(buffers))
    assert decode_descriptor(encode_descriptor(descriptor)) == descriptor


@given(st.lists(u64, min_size=1, max_size=50))
def test_free_data_roundtrip(offsets: list[int]) -> None:
    assert decode_free_data(encode_free_data(offsets)) == tuple(offsets)


@given(u64, st.integers(0, 1 << 20))
def test_frame_header_roundtrip(tag: int, length: int) -> None:
    assert decode_frame_header(encode_frame_header(tag, length)) == (tag, length)


def test_limits_are_enforced() -> None:
    limits = IpcLimits(max_metadata_bytes=8, max_buffers_per_body=1, max_free_data_offsets=1, max_body_bytes=10)
    with pytest.raises(LimitExceededError):
        decode_metadata(encode_metadata(0, b"x" * 9), limits)
    with pytest.raises(LimitExceededError):
        decode_descriptor(encode_descriptor(BodyDescriptor(2, ((0, 1), (1, 1)))), limits)
    with pytest.raises(LimitExceededError):
        decode_free_data(encode_free_data([1, 2]), limits)
    with pytest.raises(LimitExceededError):
        decode_frame_header(encode_frame_header(0, 11), limits)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_unacked_bodies": 0}, r"IpcLimits\.max_unacked_bodies: expected an int >= 1, got 0"),
        ({"max_body_bytes": 1.5}, r"IpcLimits\.max_body_bytes: expected an int"),
        ({"connect_timeout_s": 0}, r"IpcLimits\.connect_timeout_s: expected a number > 0"),
        ({"max_pending_messages": 1 << 31}, r"IpcLimits\.max_pending_messages: expected at most 2147483647"),
    ],
)
def test_a_bad_limit_is_a_configuration_error_not_a_limit_crossed(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message) as info:
        IpcLimits(**settings)  # type: ignore[arg-type]
    assert not isinstance(info.value, LimitExceededError)


def test_flatbuffer_headers_from_pyarrow() -> None:
    messages = sample_messages()
    kinds = [parse_message_header(m.flatbuffer.to_pybytes()).kind for m in messages]
    assert kinds[0] is MessageKind.SCHEMA
    assert MessageKind.DICTIONARY_BATCH in kinds and MessageKind.RECORD_BATCH in kinds
    for message in messages[1:]:
        header = parse_message_header(message.flatbuffer.to_pybytes())
        assert header.body_length == message.body.size
        assert header.buffers and header.has_body


def test_uri_examples() -> None:
    uri = parse_uri("ucx://10.0.0.1:1234?want_data=42&free_data=7&remote_handle=cmtleQ%3D%3D")
    assert uri == IpcUri("ucx", 42, host="10.0.0.1", port=1234, free_data=7, remote_handle=b"rkey")
    assert parse_uri(str(uri)) == uri
    assert parse_uri("shm:///tmp/a b.sock?want_data=1").path == "/tmp/a b.sock"
    for bad in (
        "ucx://h:1",
        "ucx://h:1?want_data=-1",
        "ucx://h:1?want_data=18446744073709551616",
        "http://h:1?want_data=1",
        "ucx://h:1?want_data=1&remote_handle=!!",
        "ucx://h:1?want_data=1&want_data=2",
        "tcp://h?want_data=1",
        "ucx://h:1?want_data=\u00b2",  # a superscript two: str.isdigit() says yes, int() says no
        "ucx://h:1?want_data=%C2%B9",
        "ucx://h:1?want_data=1&free_data=\u0661",  # an Arabic-Indic one
    ):
        with pytest.raises(UriError):
            parse_uri(bad)


@given(st.sampled_from(["ucx", "tcp"]), u64, st.integers(1, 65535), st.none() | u64, st.none() | st.binary(max_size=40))
def test_uri_roundtrip(scheme: str, want: int, port: int, free: int | None, handle: bytes | None) -> None:
    uri = IpcUri(scheme, want, host="127.0.0.1", port=port, free_data=free, remote_handle=handle)
    assert parse_uri(str(uri)) == uri


def _decoders(limits: IpcLimits) -> list[object]:
    return [
        lambda b: decode_metadata(b, limits),
        lambda b: decode_descriptor(b, limits),
        lambda b: decode_free_data(b, limits),
        lambda b: decode_frame_header(b, limits),
        lambda b: parse_message_header(b),
        lambda b: parse_uri(b.decode("latin-1")),
        lambda b: parse_body_tag(int.from_bytes(b[:8].ljust(8, b"\0"), "little")),
    ]


@pytest.mark.fuzz
@given(st.binary(max_size=300), st.integers(0, 6))
def test_fuzz_decoders_raise_typed_errors(data: bytes, which: int) -> None:
    decoder = _decoders(IpcLimits(max_metadata_bytes=256))[which]
    try:
        decoder(data)  # type: ignore[operator]
    except IpcError as exc:
        assert isinstance(exc, EvergreenTrioError)


@pytest.mark.fuzz
@given(st.data())
def test_fuzz_mutated_flatbuffers(data: st.DataObject) -> None:
    raw = bytearray(data.draw(st.sampled_from([m.flatbuffer.to_pybytes() for m in sample_messages(100, 50)])))
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    with contextlib.suppress(IpcError):
        parse_message_header(bytes(raw[:cut]))
