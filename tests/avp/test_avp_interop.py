"""Interop with the reference package ``avp`` 0.6.x: both directions, byte-identical output, and the bomb."""

from __future__ import annotations

import json
from typing import Any

import avp as reference
import numpy as np
import pytest
import zstandard
from avp import avp_pb2 as reference_pb2
from avp_strategies import KV_DTYPES, kv_layers, metadata_fields, random_array
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio._proto.avp import avp_pb2
from evergreen_trio.avp import AVPLimitError, AVPMetadata, DataType, PayloadType, decode, encode, pack_kv
from evergreen_trio.avp.handshake import HelloMessage, ModelIdentity, hello_from_json, hello_to_json

REFERENCE_LEVELS = {
    None: reference.CompressionLevel.NONE,
    "fast": reference.CompressionLevel.FAST,
    "balanced": reference.CompressionLevel.BALANCED,
}
# The reference knows HIDDEN_STATE and KV_CACHE only (its enum lacks EMBEDDING).
REFERENCE_PAYLOAD_TYPES = (PayloadType.HIDDEN_STATE, PayloadType.KV_CACHE)


def test_generated_descriptor_is_the_references() -> None:
    assert avp_pb2.DESCRIPTOR.serialized_pb == reference_pb2.DESCRIPTOR.serialized_pb
    assert avp_pb2.Metadata is reference_pb2.Metadata


def _to_reference(metadata: AVPMetadata) -> Any:
    return reference.AVPMetadata(
        session_id=metadata.session_id,
        source_agent_id=metadata.source_agent_id,
        target_agent_id=metadata.target_agent_id,
        model_id=metadata.model_id,
        hidden_dim=metadata.hidden_dim,
        num_layers=metadata.num_layers,
        payload_type=reference.PayloadType(int(metadata.payload_type)),
        dtype=reference.DataType(int(metadata.dtype)),
        tensor_shape=tuple(metadata.tensor_shape),
        mode=reference.CommunicationMode(int(metadata.mode)),
        avp_map_id=metadata.avp_map_id,
        extra=dict(metadata.extra),
    )


@st.composite
def reference_cases(draw: st.DrawFn) -> tuple[AVPMetadata, bytes]:
    fields = draw(metadata_fields())
    payload_type = draw(st.sampled_from(REFERENCE_PAYLOAD_TYPES))
    if payload_type is PayloadType.KV_CACHE:
        dtype = draw(st.sampled_from(KV_DTYPES))
        layers = kv_layers(draw(st.integers(1, 3)), 2, draw(st.integers(0, 4)), 4, dtype)
        return AVPMetadata(payload_type=payload_type, dtype=dtype, **fields), b"".join(
            bytes(memoryview(part).cast("B")) if isinstance(part, bytes) else part.tobytes() for part in pack_kv(layers)
        )
    dtype = draw(st.sampled_from(DataType))
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=1, max_size=3)))
    array = random_array(shape, dtype, draw(st.integers(0, 100)))
    return AVPMetadata(payload_type=payload_type, dtype=dtype, tensor_shape=shape, **fields), array.tobytes()


@given(reference_cases(), st.sampled_from([None, "fast", "balanced"]))
def test_reference_encodes_we_decode_and_bytes_are_identical(case: tuple[AVPMetadata, bytes],
                                                             compression: str | None) -> None:
    metadata, payload = case
    theirs = reference.encode(payload, _to_reference(metadata), REFERENCE_LEVELS[compression])
    ours = encode(payload, metadata, compression=compression)  # type: ignore[arg-type]
    assert ours == theirs
    decoded = decode(theirs)
    assert bytes(decoded.payload) == payload
    expected = _to_reference(metadata)
    expected.compression = "zstd" if compression else None
    got = decoded.metadata
    for name in ("session_id", "source_agent_id", "target_agent_id", "model_id", "hidden_dim", "num_layers",
                 "tensor_shape", "avp_map_id", "extra", "compression"):
        assert getattr(got, name) == getattr(expected, name), name
    assert (int(got.payload_type), int(got.dtype), int(got.mode)) == (
        int(expected.payload_type), int(expected.dtype), int(expected.mode))


@given(reference_cases(), st.sampled_from([None, "fast"]), st.booleans())
def test_we_encode_reference_decodes(case: tuple[AVPMetadata, bytes], compression: str | None,
                                     checksum: bool) -> None:
    metadata, payload = case
    theirs = reference.decode(encode(payload, metadata, compression=compression, checksum=checksum))  # type: ignore[arg-type]
    assert theirs.payload == payload
    assert theirs.metadata.model_id == metadata.model_id and theirs.metadata.extra == metadata.extra
    assert tuple(theirs.metadata.tensor_shape) == metadata.tensor_shape
    assert int(theirs.metadata.payload_type) == int(metadata.payload_type)


def test_reference_kv_cache_decodes_to_views() -> None:
    layers = kv_layers(2, 2, 3, 4, DataType.BFLOAT16)
    kv_bytes = b"".join(part if isinstance(part, bytes) else part.tobytes() for part in pack_kv(layers))
    metadata = reference.AVPMetadata(dtype=reference.DataType.BFLOAT16, extra={"model_hash": "abc"})
    message = decode(reference.encode_kv_cache(kv_bytes, metadata))
    from evergreen_trio.avp import unpack_kv

    header, unpacked = unpack_kv(message.payload)
    assert header.num_layers == 2 and header.dtype is DataType.BFLOAT16
    for (key, value), (got_key, got_value) in zip(layers, unpacked, strict=True):
        np.testing.assert_array_equal(got_key.view(np.uint16), key.view(np.uint16))
        np.testing.assert_array_equal(got_value.view(np.uint16), value.view(np.uint16))


def test_zstd_bomb_reference_allocates_we_refuse() -> None:
    size = 80 << 20
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(size))
    metadata = avp_pb2.Metadata(compression="zstd").SerializeToString()
    import struct

    data = struct.pack("<2sBBII", b"AV", 1, 1, len(metadata) + len(bomb), len(metadata)) + metadata + bomb
    assert len(data) < 10_000
    assert len(reference.decode(data).payload) == size  # 80 MiB allocated from a < 10 KB message
    with pytest.raises(AVPLimitError, match="above max_payload_bytes"):
        decode(data)


IDENTITIES = st.builds(
    ModelIdentity,
    model_family=st.sampled_from(["", "llama", "qwen2"]),
    model_id=st.text(max_size=8),
    model_hash=st.sampled_from(["", "h1", "h2"]),
    hidden_dim=st.sampled_from([0, 2048, 4096]),
    num_layers=st.sampled_from([0, 16, 32]),
    num_kv_heads=st.integers(0, 64),
    head_dim=st.integers(0, 256),
)


def _reference_identity(identity: ModelIdentity) -> Any:
    return reference.ModelIdentity.from_dict(json.loads(hello_to_json(HelloMessage(identity=identity)))["identity"])


@given(IDENTITIES, st.text(max_size=8))
def test_hello_json_round_trips_with_reference(identity: ModelIdentity, agent_id: str) -> None:
    hello = HelloMessage(agent_id=agent_id, identity=identity, capabilities={"latent": True})
    theirs = reference.HelloMessage.from_dict(json.loads(hello_to_json(hello)))
    assert theirs.to_dict() == json.loads(hello_to_json(hello))
    assert hello_from_json(json.dumps(theirs.to_dict())) == hello
