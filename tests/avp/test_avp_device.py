"""AVP around device arrays without host copies (avp.device); a NumPy stand-in runs it on the CPU."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.avp import AVPMetadata, DataType, PayloadType, encode
from evergreen_trio.avp.device import decode_device, encode_device, is_device_array
from evergreen_trio.avp.errors import AVPEncodeError, AVPError, AVPInconsistentError, AVPLengthError
from evergreen_trio.avp.kv import pack_kv


class FakeDevice:
    """A NumPy array posing as device memory: only ``__cuda_array_interface__``, ``view`` and ``reshape``."""

    def __init__(self, array: np.ndarray[Any, Any]) -> None:
        self.array = array

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        interface = dict(self.array.__array_interface__)
        interface["version"] = 3
        return interface

    def view(self, dtype: Any) -> FakeDevice:
        return FakeDevice(self.array.view(dtype))

    def reshape(self, shape: tuple[int, ...]) -> FakeDevice:
        return FakeDevice(self.array.reshape(shape))

    def __getattr__(self, name: str) -> Any:
        if name in ("get", "tobytes", "__array__"):
            raise AssertionError(f"device memory was read on the host ({name})")
        raise AttributeError(name)


def meta(**kwargs: Any) -> AVPMetadata:
    return AVPMetadata(model_id="m", hidden_dim=8, **kwargs)


def test_encode_device_keeps_the_tensor_and_matches_encode() -> None:
    host = np.arange(24, dtype=np.float32).reshape(3, 8)
    device = FakeDevice(host)
    metadata = meta(dtype=DataType.FLOAT32, tensor_shape=(3, 8))
    prefix, *parts = encode_device(device, metadata)
    assert parts == [device] and is_device_array(parts[0])
    assert prefix + host.tobytes() == encode(host, metadata, checksum=False)


def test_kv_parts_mix_host_header_and_device_tensors() -> None:
    layers = [(np.ones((1, 2, 3, 4), np.float16), np.zeros((1, 2, 3, 4), np.float16)) for _ in range(2)]
    metadata = meta(dtype=DataType.FLOAT16, payload_type=PayloadType.KV_CACHE)
    host_parts = pack_kv(layers)
    device_parts = [host_parts[0], *(FakeDevice(p) for p in host_parts[1:])]
    prefix, header, *tensors = encode_device(device_parts, metadata)
    assert all(isinstance(t, FakeDevice) for t in tensors)
    wire = prefix + bytes(header) + b"".join(t.array.tobytes() for t in tensors)
    assert wire == encode(host_parts, metadata, checksum=False)


def test_decode_device_checks_and_views_without_copying() -> None:
    host = np.arange(16, dtype=np.float32).reshape(2, 8)
    metadata = meta(dtype=DataType.FLOAT32, tensor_shape=(2, 8))
    prefix, _ = encode_device(FakeDevice(host), metadata)
    received = FakeDevice(np.frombuffer(host.tobytes(), np.uint8).copy())
    message = decode_device(prefix, received)
    assert message.metadata.tensor_shape == (2, 8)
    typed = message.as_array()
    assert isinstance(typed, FakeDevice) and typed.array.base is not None
    assert np.array_equal(typed.array, host)
    with pytest.raises(AVPLengthError, match="tensor section"):
        decode_device(prefix, FakeDevice(np.zeros(8, np.uint8)))


def test_decode_device_refuses_a_compressed_message() -> None:
    metadata = meta(dtype=DataType.FLOAT32, tensor_shape=(2, 8))
    wire = encode(np.ones((2, 8), np.float32), metadata, compression="fast")
    meta_len = int.from_bytes(wire[8:12], "little")
    with pytest.raises(AVPInconsistentError, match="compressed"):
        decode_device(wire[: 12 + meta_len], FakeDevice(np.zeros(len(wire) - 12 - meta_len, np.uint8)))


@pytest.mark.parametrize(
    ("array", "match"),
    [
        (np.zeros(8, np.float64), "dtype"),
        (np.zeros((4, 4), np.float32)[:, ::2], "C-contiguous"),
        (np.zeros(8, ">f4"), "little-endian"),
    ],
)
def test_encode_device_rejects_bad_arrays(array: np.ndarray[Any, Any], match: str) -> None:
    with pytest.raises(AVPEncodeError, match=match):
        encode_device(FakeDevice(array), meta(dtype=DataType.FLOAT32))


def test_encode_device_rejects_a_shape_mismatch_and_non_arrays() -> None:
    with pytest.raises(AVPEncodeError, match="implies"):
        encode_device(FakeDevice(np.zeros(8, np.float32)), meta(dtype=DataType.FLOAT32, tensor_shape=(3,)))
    with pytest.raises(AVPEncodeError, match="device arrays or host bytes"):
        encode_device([object()], meta())


@pytest.mark.fuzz
@given(st.binary(max_size=256), st.integers(0, 512))
def test_fuzz_decode_device_gives_typed_errors(prefix: bytes, size: int) -> None:
    with contextlib.suppress(AVPError):
        decode_device(prefix, FakeDevice(np.zeros(size, np.uint8)))


@pytest.mark.gpu
def test_cupy_round_trip_stays_on_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    import cupy

    tensor = cupy.arange(32, dtype=cupy.float32).reshape(4, 8)
    metadata = meta(dtype=DataType.FLOAT32, tensor_shape=(4, 8))

    def forbidden(*args: object, **kwargs: object) -> object:
        raise AssertionError("copied to the host")

    monkeypatch.setattr(cupy, "asnumpy", forbidden)
    prefix, part = encode_device(tensor, metadata)
    message = decode_device(prefix, part.reshape(-1).view(cupy.uint8))
    assert isinstance(message.as_array(), cupy.ndarray)
    assert bool((message.as_array() == tensor).all())
