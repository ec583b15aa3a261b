"""AVP tensors that stay on the GPU: encode and decode around device arrays, no host copy.

``encode``/``encode_buffers`` make host bytes for byte transports (HTTP, gRPC), so a
device payload is copied to the host there: that is the host fallback, taken only by
asking for bytes. :func:`encode_device` keeps the tensor where it is: it returns the
host prefix (12-byte header and metadata, a few hundred bytes) followed by the tensor
parts as the device arrays themselves, for a transport that moves device memory (UCX
tagged sends, Dissociated IPC bodies over ``ucx://``). :func:`decode_device` is the
receiving side: it parses the prefix on the host and checks the device tensor against
it. No payload checksum and no compression on this path: both need the bytes on the
host.

Device arrays are recognised by ``__cuda_array_interface__`` (CuPy, PyTorch, Numba);
only that interface is read, so nothing here imports CuPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from evergreen_trio.avp.codec import frame_prefix, parse_header, parse_metadata
from evergreen_trio.avp.dtypes import DTYPE_BY_NAME, NUMPY_DTYPES, DataType
from evergreen_trio.avp.errors import AVPEncodeError, AVPInconsistentError, AVPLengthError
from evergreen_trio.avp.message import (
    DEFAULT_LIMITS,
    FLAG_COMPRESSED,
    HEADER_SIZE,
    AVPHeader,
    AVPLimits,
    AVPMetadata,
    PayloadType,
    implied_payload_size,
)


def is_device_array(part: Any) -> bool:
    """Whether ``part`` lives in device memory (it exposes ``__cuda_array_interface__``)."""
    return hasattr(part, "__cuda_array_interface__")


def device_nbytes(part: Any, dtype: DataType | None = None) -> int:
    """Bytes of a C-contiguous little-endian device array (of ``dtype`` if given, or raw ``uint8``).

    Reads only ``__cuda_array_interface__``. Raises AVPEncodeError naming what is wrong.
    """
    interface = part.__cuda_array_interface__
    np_dtype: np.dtype[Any] = np.dtype(interface["typestr"])
    if dtype is not None and DTYPE_BY_NAME.get(np_dtype.name) != dtype and np_dtype != np.uint8:
        raise AVPEncodeError(f"device payload: expected dtype {dtype.name.lower()} (metadata.dtype), got {np_dtype}")
    if np_dtype.byteorder == ">":
        raise AVPEncodeError(f"device payload: expected little-endian data, got {np_dtype.str}")
    shape: tuple[int, ...] = tuple(int(extent) for extent in interface["shape"])
    strides = interface.get("strides")
    if strides is not None:
        expected: list[int] = []
        step = int(np_dtype.itemsize)
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if tuple(strides) != tuple(reversed(expected)) and math.prod(shape) > 1:
            raise AVPEncodeError("device payload: expected a C-contiguous array, got strided")
    return math.prod(shape) * int(np_dtype.itemsize)


def encode_device(payload: Any, metadata: AVPMetadata) -> list[Any]:
    """``[header + metadata (bytes), *tensor parts]`` with every device part left on the device.

    ``payload`` is a device array of ``metadata.dtype`` or a list of parts (host bytes,
    such as the 17-byte KV header of `pack_kv`, and device arrays). Sending the parts in
    order gives the same message bytes ``encode(..., checksum=False)`` gives. Raises
    AVPEncodeError for a part of another dtype, a strided part, or sizes that disagree
    with ``tensor_shape``.
    """
    parts = list(payload) if isinstance(payload, list | tuple) else [payload]
    size = 0
    for part in parts:
        if is_device_array(part):
            size += device_nbytes(part, metadata.dtype)
        elif isinstance(part, bytes | bytearray | memoryview):
            size += memoryview(part).nbytes
        else:
            raise AVPEncodeError(f"device payload: expected device arrays or host bytes, got {type(part).__name__}")
    implied = implied_payload_size(metadata)
    if implied is not None and implied != size:
        raise AVPEncodeError(
            f"payload: tensor_shape {list(metadata.tensor_shape)} of {DataType(metadata.dtype).name} implies "
            f"{implied} bytes, got {size}"
        )
    return [frame_prefix(metadata, False, None, size), *parts]


@dataclass(frozen=True)
class DeviceAVPMessage:
    """A message whose tensor section is in device memory (a flat ``uint8`` device array)."""

    header: AVPHeader
    metadata: AVPMetadata
    tensor: Any

    def as_array(self) -> Any:
        """The tensor as a device view of ``dtype`` shaped ``tensor_shape`` (1-D without one); no copy.

        KV-cache payloads keep their 17-byte KV header in front: they come back flat ``uint8``.
        Uses the array's own ``view``/``reshape`` (CuPy's on a GPU).
        """
        meta = self.metadata
        if meta.payload_type == PayloadType.KV_CACHE:
            return self.tensor
        typed = self.tensor.view(NUMPY_DTYPES[meta.dtype])
        return typed.reshape(meta.tensor_shape) if meta.tensor_shape else typed


def decode_device(
    prefix: bytes | memoryview, tensor: Any, *, limits: AVPLimits = DEFAULT_LIMITS, strict: bool = True
) -> DeviceAVPMessage:
    """Parse the host ``prefix`` (header + metadata) and check ``tensor`` (device) against it.

    Raises the decoder's errors for a bad prefix, AVPInconsistentError for a compressed
    message (it cannot be decompressed on the device), AVPLengthError when the tensor is
    not the size the header announces.
    """
    view = memoryview(prefix).cast("B")
    header = parse_header(view, limits, strict)
    if header.flags & FLAG_COMPRESSED:
        raise AVPInconsistentError("flags: a compressed tensor section cannot be decoded on the device")
    if len(view) != HEADER_SIZE + header.metadata_length:
        raise AVPLengthError(
            f"prefix: expected {HEADER_SIZE + header.metadata_length} bytes (header + metadata), got {len(view)}"
        )
    metadata = parse_metadata(header, view[HEADER_SIZE:], limits, strict)
    section = header.payload_length - header.metadata_length
    got = device_nbytes(tensor)
    if got != section:
        raise AVPLengthError(f"tensor section: expected {section} bytes (payload_length), got {got} on the device")
    return DeviceAVPMessage(header, metadata, tensor)
