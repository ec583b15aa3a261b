"""KV-cache payload layout: a 17-byte ``<IIIIB`` header, then ``[K_l0][V_l0][K_l1][V_l1]...``.

Each K and V is a contiguous little-endian ``[1, num_kv_heads, seq_len, head_dim]`` tensor. Packing
returns the caller's arrays as scatter-gather parts; unpacking returns views into the payload.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from evergreen_trio.avp.dtypes import (
    DTYPE_BY_NAME,
    ITEMSIZE,
    KV_HEADER_SIZE,
    NUMPY_DTYPES,
    DataType,
    to_device,
)
from evergreen_trio.avp.errors import AVPEncodeError, AVPFormatError, AVPInconsistentError

KV_HEADER = struct.Struct("<IIIIB")
# The KV header's dtype byte uses DataType's values for the three float types; INT8 has none.
KV_DTYPES = (DataType.FLOAT32, DataType.FLOAT16, DataType.BFLOAT16)


@dataclass(frozen=True, slots=True)
class KVCacheHeader:
    """The 17-byte header in front of a KV-cache payload: its shape and element type."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    dtype: DataType = DataType.FLOAT16

    def to_bytes(self) -> bytes:
        """The 17 header bytes (little endian)."""
        return KV_HEADER.pack(self.num_layers, self.num_kv_heads, self.head_dim, self.seq_len, self.dtype)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> KVCacheHeader:
        """Parse the header at the start of ``data``; AVPFormatError when short or of an unknown dtype."""
        if len(data) < KV_HEADER_SIZE:
            raise AVPFormatError(f"KV-cache header: expected {KV_HEADER_SIZE} bytes, got {len(data)}")
        layers, heads, head_dim, seq_len, dtype_byte = KV_HEADER.unpack_from(data)
        if dtype_byte >= len(KV_DTYPES):
            raise AVPFormatError(
                f"KV-cache header dtype byte: expected 0 (float32), 1 (float16) or 2 (bfloat16), got {dtype_byte}"
            )
        return cls(layers, heads, head_dim, seq_len, KV_DTYPES[dtype_byte])

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        """Shape of each K and each V tensor."""
        return (1, self.num_kv_heads, self.seq_len, self.head_dim)

    @property
    def payload_size(self) -> int:
        """Bytes of the whole KV payload, header included."""
        per_tensor = self.num_kv_heads * self.seq_len * self.head_dim * ITEMSIZE[self.dtype]
        return KV_HEADER_SIZE + 2 * self.num_layers * per_tensor


def read_kv_header(payload: memoryview) -> KVCacheHeader:
    """Parse the KV header and check that the payload has exactly the size it implies."""
    header = KVCacheHeader.from_bytes(payload)
    if header.payload_size != len(payload):
        raise AVPInconsistentError(
            f"KV-cache header {header.num_layers} layers x {header.num_kv_heads} heads x {header.seq_len} "
            f"tokens x {header.head_dim} dims of {header.dtype.name} implies {header.payload_size} payload "
            f"bytes, got {len(payload)}"
        )
    return header


def kv_block(payload: memoryview) -> np.ndarray[Any, Any]:
    """The K/V data as one ``[num_layers, 2, num_kv_heads, seq_len, head_dim]`` view (index 0 is K, 1 is V)."""
    header = read_kv_header(payload)
    data = np.frombuffer(payload, dtype=NUMPY_DTYPES[header.dtype], offset=KV_HEADER_SIZE)
    return data.reshape(header.num_layers, 2, header.num_kv_heads, header.seq_len, header.head_dim)


def unpack_kv(payload: memoryview, *, gpu: bool = False) -> tuple[KVCacheHeader, list[tuple[Any, Any]]]:
    """Split a KV payload into per-layer ``(K, V)`` views shaped ``[1, num_kv_heads, seq_len, head_dim]``.

    ``gpu=True`` copies the whole block to the device once (CuPy) and returns views of that.
    """
    block: Any = kv_block(payload)
    if gpu:
        block = to_device(block)
    header = read_kv_header(payload)
    return header, [(block[layer, 0:1], block[layer, 1:2]) for layer in range(header.num_layers)]


def kv_header_of(layers: Sequence[tuple[Any, Any]]) -> KVCacheHeader:
    """The header describing ``layers`` (NumPy or CuPy arrays); every K and V must share shape and dtype."""
    if not layers:
        raise AVPEncodeError("KV cache: expected at least one (K, V) layer, got none")
    first = layers[0][0]
    shape = tuple(first.shape)
    if len(shape) != 4 or shape[0] != 1:
        raise AVPEncodeError(f"KV cache: expected K/V shaped [1, heads, seq_len, head_dim], got {list(shape)}")
    dtype = DTYPE_BY_NAME.get(str(first.dtype))
    if dtype not in KV_DTYPES:
        raise AVPEncodeError(f"KV cache: expected float32, float16 or bfloat16 tensors, got {first.dtype}")
    for index, pair in enumerate(layers):
        for name, tensor in zip("KV", pair, strict=True):
            if tuple(tensor.shape) != shape or tensor.dtype != first.dtype:
                raise AVPEncodeError(
                    f"KV cache layer {index} {name}: expected {list(shape)} {first.dtype}, "
                    f"got {list(tensor.shape)} {tensor.dtype}"
                )
    return KVCacheHeader(len(layers), shape[1], shape[3], shape[2], dtype)


def pack_kv(layers: Sequence[tuple[Any, Any]]) -> list[Any]:
    """The KV payload as scatter-gather parts ``[header bytes, K0, V0, K1, V1, ...]``, the arrays not copied.

    Pass the list to `encode`/`encode_buffers` as the payload.
    """
    header = kv_header_of(layers)
    parts: list[Any] = [header.to_bytes()]
    for key, value in layers:
        parts.extend((key, value))
    return parts
