"""AVP data model: enums with the proto's values, metadata, header, limits and the decoded message."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from evergreen_trio.avp.dtypes import ITEMSIZE, KV_HEADER_SIZE, NUMPY_DTYPES, DataType, to_device
from evergreen_trio.avp.errors import AVPEncodeError, AVPInconsistentError
from evergreen_trio.avp.kv import kv_block
from evergreen_trio.limits import check_limits

MAGIC = b"AV"
PROTOCOL_VERSION = 0x01
HEADER_SIZE = 12
FLAG_COMPRESSED = 0x01
FLAG_HAS_MAP = 0x02
FLAG_KV_CACHE = 0x04
RESERVED_FLAGS = 0xF8
MiB = 1 << 20


class PayloadType(enum.IntEnum):
    """What the payload carries (``avp.PayloadType`` in the metadata)."""

    HIDDEN_STATE = 0
    KV_CACHE = 1
    EMBEDDING = 2


# A module constant: on Python 3.11 each ``PayloadType.KV_CACHE`` lookup is a descriptor call (~0.4 us).
_KV_CACHE = PayloadType.KV_CACHE


class CommunicationMode(enum.IntEnum):
    """Latent (tensors) or JSON messages (``avp.CommunicationMode``)."""

    LATENT = 0
    JSON_MODE = 1



@dataclass(slots=True)
class AVPMetadata:
    """The protobuf metadata of a message, field for field (names and numbers as in ``proto/avp/avp.proto``).

    On encode, ``compression`` and ``payload_checksum`` are set by `encode` from its arguments.
    """

    session_id: str = ""
    source_agent_id: str = ""
    target_agent_id: str = ""
    model_id: str = ""
    hidden_dim: int = 0
    num_layers: int = 0
    payload_type: PayloadType = PayloadType.HIDDEN_STATE
    dtype: DataType = DataType.FLOAT32
    tensor_shape: tuple[int, ...] = ()
    mode: CommunicationMode = CommunicationMode.LATENT
    compression: str | None = None
    avp_map_id: str = ""
    extra: dict[str, str] = field(default_factory=dict)
    payload_checksum: int | None = None


class AVPHeader(NamedTuple):
    """The fixed 12-byte header (magic checked, so not kept)."""

    version: int
    flags: int
    payload_length: int
    metadata_length: int

    @property
    def compressed(self) -> bool:
        """The payload is zstd-compressed."""
        return bool(self.flags & FLAG_COMPRESSED)

    @property
    def has_map(self) -> bool:
        """The message carries a vocabulary map."""
        return bool(self.flags & FLAG_HAS_MAP)

    @property
    def is_kv_cache(self) -> bool:
        """The payload is a KV cache (a KVCacheHeader leads it)."""
        return bool(self.flags & FLAG_KV_CACHE)

    @property
    def tensor_section_length(self) -> int:
        """Bytes after the metadata, as sent (compressed or not)."""
        return self.payload_length - self.metadata_length


@dataclass(frozen=True, slots=True)
class AVPLimits:
    """Bounds the decoder enforces before allocating anything.

    ``max_payload_bytes`` caps the tensor bytes after decompression (the zstd-bomb guard) and the
    uncompressed tensor section; raise it for large KV caches (the default is 64 MiB).
    """

    max_payload_bytes: int = 64 * MiB
    max_metadata_bytes: int = 64 * 1024
    max_rank: int = 8
    max_extra_entries: int = 256

    def __post_init__(self) -> None:
        """Raises ConfigurationError for a negative field or a payload cap past uint32 lengths (4 GiB - 1)."""
        check_limits(self, minimum=0, maximum={"max_payload_bytes": 0xFFFFFFFF})


DEFAULT_LIMITS = AVPLimits()
"""The limits decoding uses when given none."""


def implied_payload_size(metadata: AVPMetadata) -> int | None:
    """Tensor bytes that ``tensor_shape`` and ``dtype`` imply (plus the 17-byte KV header), or None without a shape.

    Raises AVPEncodeError for a ``dtype`` that is not a DataType or a shape that is not a sequence of ints.
    """
    shape = metadata.tensor_shape
    if not shape:
        return None
    itemsize = ITEMSIZE.get(metadata.dtype)
    if itemsize is None:
        raise AVPEncodeError(f"metadata.dtype: expected one of {[member.name for member in DataType]}, "
                             f"got {metadata.dtype!r}")
    try:
        size = math.prod(shape) * itemsize
    except TypeError:  # None or a string among the dimensions, or no sequence at all
        raise AVPEncodeError(f"metadata.tensor_shape: expected a sequence of ints, got {shape!r:.80}") from None
    if metadata.payload_type == _KV_CACHE:
        size += KV_HEADER_SIZE
    return size


@dataclass(slots=True)
class AVPMessage:
    """A decoded message. ``payload`` is the tensor bytes: a view into the input when it was not compressed."""

    header: AVPHeader
    metadata: AVPMetadata
    payload: memoryview

    def as_array(self, *, gpu: bool = False) -> Any:
        """The payload as a NumPy view of ``dtype`` shaped ``tensor_shape`` (1-D without a shape).

        KV-cache payloads come shaped ``[num_layers, 2, num_kv_heads, seq_len, head_dim]`` (K then V per
        layer), read from the 17-byte KV header. ``gpu=True`` copies it to a CuPy array instead.
        """
        meta = self.metadata
        if meta.payload_type == _KV_CACHE:
            array = kv_block(self.payload)
        else:
            np_dtype = NUMPY_DTYPES[meta.dtype]
            if len(self.payload) % np_dtype.itemsize:
                raise AVPInconsistentError(
                    f"payload of {len(self.payload)} bytes is not a whole number of {meta.dtype.name} items"
                )
            array = np.frombuffer(self.payload, dtype=np_dtype)
            if meta.tensor_shape:
                array = array.reshape(meta.tensor_shape)
        return to_device(array) if gpu else array
