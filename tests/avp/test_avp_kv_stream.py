"""KV-cache layout, the incremental decoder's buffer, the stream binding, the handshake JSON, CuPy placement."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from avp_strategies import kv_layers, random_array
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.avp import (
    AVPDeviceError,
    AVPEncodeError,
    AVPFormatError,
    AVPHandshakeError,
    AVPInconsistentError,
    AVPLengthError,
    AVPLimitError,
    AVPLimits,
    AVPMetadata,
    AVPTruncatedError,
    DataType,
    KVCacheHeader,
    PayloadType,
    decode,
    encode,
    encode_buffers,
    pack_kv,
    unpack_kv,
)
from evergreen_trio.avp.handshake import HelloMessage, ModelIdentity, hello_from_json, hello_to_json, resolve_mode
from evergreen_trio.avp.incremental import AVPDecoder
from evergreen_trio.avp.message import CommunicationMode
from evergreen_trio.avp.stream import AVP_MIMETYPE, avp_fragments, read_avp

KV_META = AVPMetadata(payload_type=PayloadType.KV_CACHE, dtype=DataType.FLOAT16)


def test_kv_header_round_trip() -> None:
    header = KVCacheHeader(32, 8, 128, 2048, DataType.BFLOAT16)
    raw = header.to_bytes()
    assert len(raw) == 17 and raw[-1] == 2
    assert KVCacheHeader.from_bytes(raw) == header
    assert header.payload_size == 17 + 32 * 2 * 8 * 2048 * 128 * 2


def test_kv_pack_is_scatter_gather_and_unpack_gives_views() -> None:
    layers = kv_layers(3, 2, 5, 4, DataType.FLOAT16)
    parts = pack_kv(layers)
    assert parts[1] is layers[0][0] and parts[2] is layers[0][1]
    buffers = encode_buffers(parts, KV_META)
    assert np.shares_memory(np.frombuffer(buffers[-1], dtype=np.uint8), layers[2][1])
    message = decode(b"".join(buffers))
    header, unpacked = unpack_kv(message.payload)
    assert header == KVCacheHeader(3, 2, 4, 5, DataType.FLOAT16)
    for (key, value), (got_key, got_value) in zip(layers, unpacked, strict=True):
        assert got_key.shape == (1, 2, 5, 4)
        np.testing.assert_array_equal(got_key, key)
        np.testing.assert_array_equal(got_value, value)
        assert np.shares_memory(got_key, np.frombuffer(message.payload, dtype=np.uint8))
    assert message.as_array().shape == (3, 2, 2, 5, 4)


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        ([], "at least one"),
        ([(np.zeros((2, 2, 2, 2), "f2"), np.zeros((2, 2, 2, 2), "f2"))], r"\[1, heads"),
        ([(np.zeros((1, 2, 2, 2), "i1"), np.zeros((1, 2, 2, 2), "i1"))], "float32, float16 or bfloat16"),
        ([(np.zeros((1, 2, 2, 2), "f2"), np.zeros((1, 2, 3, 2), "f2"))], "layer 0 V"),
    ],
)
def test_kv_pack_rejects_bad_layers(layers: list[tuple[Any, Any]], match: str) -> None:
    with pytest.raises(AVPEncodeError, match=match):
        pack_kv(layers)


def test_kv_payload_checks() -> None:
    with pytest.raises(AVPFormatError, match="dtype byte"):
        KVCacheHeader.from_bytes(KVCacheHeader(1, 1, 1, 1).to_bytes()[:-1] + b"\x07")
    with pytest.raises(AVPFormatError, match="expected 17 bytes"):
        decode(encode(b"\0" * 5, KV_META))
    short = KVCacheHeader(1, 1, 1, 2, DataType.FLOAT16).to_bytes() + b"\0" * 6
    with pytest.raises(AVPInconsistentError, match="implies 25 payload bytes, got 23"):
        decode(encode(short, KV_META))
    float32_kv = KVCacheHeader(1, 1, 1, 1, DataType.FLOAT32).to_bytes() + b"\0" * 8
    with pytest.raises(AVPInconsistentError, match="KV-cache header dtype is FLOAT32"):
        decode(encode(float32_kv, KV_META))
    assert decode(encode(float32_kv, KV_META), strict=False).as_array().dtype == np.float32


def test_incremental_decoder_writes_into_one_buffer() -> None:
    array = random_array((1024,), DataType.FLOAT32)
    data = encode(array, AVPMetadata(tensor_shape=(1024,)))
    decoder = AVPDecoder()
    for start in range(0, len(data), 100):
        assert decoder.message is None
        decoder.feed(memoryview(data)[start : start + 100])
    message = decoder.close()
    assert isinstance(message.payload.obj, np.ndarray) and message.payload.obj.nbytes == 4096
    np.testing.assert_array_equal(message.as_array(), array)
    with pytest.raises(AVPLengthError, match="expected the message to end after"):
        decoder.feed(b"x")


def test_incremental_decoder_checks_header_before_allocating() -> None:
    decoder = AVPDecoder(limits=AVPLimits(max_payload_bytes=1024))
    with pytest.raises(AVPLimitError, match="tensor section"):
        decoder.feed(b"AV\x01\x00" + (1 << 30).to_bytes(4, "little") + bytes(4))


def test_incremental_decoder_truncated() -> None:
    decoder = AVPDecoder()
    decoder.feed(encode(b"\0" * 8, AVPMetadata())[:-1])
    with pytest.raises(AVPTruncatedError, match="input ended after"):
        decoder.close()
    with pytest.raises(AVPTruncatedError, match="expected 12 bytes, input ended after 0"):
        AVPDecoder().close()


@pytest.mark.parametrize("piece", ["AV", 5, None, np.arange(12, dtype=np.uint8)[::2]])
def test_a_piece_that_is_not_a_contiguous_buffer_is_a_length_error(piece: object) -> None:
    """`decode` and `AVPDecoder.feed` name the input (AVPLengthError), never raise TypeError or BufferError."""
    with pytest.raises(AVPLengthError, match="input: expected"):
        AVPDecoder().feed(piece)
    with pytest.raises(AVPLengthError, match="input: expected"):
        decode(piece)


async def _pieces(data: list[memoryview]) -> AsyncIterator[memoryview]:
    for piece in data:
        yield piece


@given(st.integers(1, 300), st.sampled_from([None, "fast"]))
def test_fragments_are_bounded_views(fragment_size: int, compression: str | None) -> None:
    array = random_array((200,), DataType.FLOAT16)
    parts = encode_buffers(array, AVPMetadata(dtype=DataType.FLOAT16), compression=compression)  # type: ignore[arg-type]
    fragments = list(avp_fragments(parts, fragment_size))
    assert all(0 < len(fragment) <= fragment_size for fragment in fragments)
    assert b"".join(fragments) == b"".join(parts)
    if compression is None:
        assert any(fragment.obj is array or np.shares_memory(fragment.obj, array) for fragment in fragments)


async def test_read_avp_over_fragments() -> None:
    layers = kv_layers(2, 2, 8, 4, DataType.FLOAT16)
    parts = encode_buffers(pack_kv(layers), KV_META)
    message = await read_avp(_pieces(list(avp_fragments(parts, 64))))
    _, unpacked = unpack_kv(message.payload)
    np.testing.assert_array_equal(unpacked[1][1], layers[1][1])
    assert AVP_MIMETYPE == "application/avp+binary"
    with pytest.raises(AVPTruncatedError):
        await read_avp(_pieces(list(avp_fragments(parts, 64))[:-1]))


def test_fragment_size_must_be_positive() -> None:
    with pytest.raises(AVPEncodeError, match="positive int"):
        list(avp_fragments(b"abc", 0))


def test_resolve_mode_rules() -> None:
    llama = ModelIdentity(model_family="llama", model_hash="h", hidden_dim=4096, num_layers=32)
    assert resolve_mode(llama, ModelIdentity(model_hash="h")).path == "hash_match"
    same_shape = ModelIdentity(model_family="llama", model_hash="other", hidden_dim=4096, num_layers=32)
    assert resolve_mode(llama, same_shape).mode is CommunicationMode.LATENT
    assert resolve_mode(llama, ModelIdentity(model_family="qwen2", hidden_dim=4096, num_layers=32)).mode is (
        CommunicationMode.JSON_MODE
    )


def test_hello_json() -> None:
    hello = HelloMessage(agent_id="a", identity=ModelIdentity(model_id="m", hidden_dim=8, tokenizer_hash="t"))
    assert hello_from_json(hello_to_json(hello)) == hello
    assert hello_from_json(b"{}") == HelloMessage()


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"[1]", "expected a JSON object, got list"),
        (b"{", "invalid JSON"),
        (b'{"agent_id": 3}', "hello.agent_id: expected a JSON str"),
        (b'{"identity": {"hidden_dim": -1}}', "hello.identity.hidden_dim: expected a non-negative integer"),
        (b'{"identity": {"num_layers": true}}', "non-negative integer"),
        (b'{"identity": []}', "hello.identity: expected a JSON object"),
        (b'{"capabilities": 1}', "capabilities: expected a JSON dict"),
        (b" " * 70_000, "at most 65536 bytes"),
    ],
)
def test_hello_json_errors(data: bytes, match: str) -> None:
    with pytest.raises(AVPHandshakeError, match=match):
        hello_from_json(data)


@pytest.mark.fuzz
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_fuzz_hello_json(data: bytes | str) -> None:
    with contextlib.suppress(AVPHandshakeError):
        hello_from_json(data)


def test_gpu_placement_without_cupy_is_a_typed_error() -> None:
    message = decode(encode(np.zeros(4, "<f4"), AVPMetadata()))
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(AVPDeviceError, match="CuPy is not importable"):
            message.as_array(gpu=True)
    else:
        pytest.skip("CuPy is present: covered by test_gpu_placement")


@pytest.mark.gpu
def test_gpu_placement() -> None:
    import cupy

    array = random_array((4, 8), DataType.FLOAT16)
    message = decode(encode(cupy.asarray(array), AVPMetadata(dtype=DataType.FLOAT16, tensor_shape=(4, 8))))
    on_device = message.as_array(gpu=True)
    assert isinstance(on_device, cupy.ndarray)
    np.testing.assert_array_equal(cupy.asnumpy(on_device), array)
    layers = kv_layers(2, 2, 3, 4, DataType.FLOAT16)
    kv = decode(encode(pack_kv([(cupy.asarray(k), cupy.asarray(v)) for k, v in layers]), KV_META))
    _, unpacked = unpack_kv(kv.payload, gpu=True)
    np.testing.assert_array_equal(cupy.asnumpy(unpacked[1][0]), layers[1][0])
