"""The AVP binary codec (sans-IO): encode to bytes, into a buffer or as scatter-gather parts; decode with a view.

Wire layout: 12-byte header ``<2sBBII`` (magic "AV", version 1, flags, payload_length, metadata_length),
protobuf ``avp.Metadata``, then the tensor bytes (zstd-compressed when flag bit 0 is set).

Decoding checks every length against the message, the limits and the metadata before it allocates;
an uncompressed payload is returned as a view into the input, so the only work left is the CRC
(python-isal, several times faster than zlib's for the same values). The checks of a header and
metadata seen before (all but the trailing checksum field) are kept, so a stream pays for them once.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable
from typing import Any, Literal, cast

import numpy as np
import zstandard
from google.protobuf.message import DecodeError as ProtobufDecodeError
from isal.isal_zlib import crc32

from evergreen_trio._memory import joined
from evergreen_trio._proto.avp import avp_pb2 as pb2
from evergreen_trio._proto.avp.avp_pb2 import Metadata
from evergreen_trio.avp.dtypes import DTYPE_BY_NAME, ITEMSIZE, KV_HEADER_SIZE, DataType, require_cupy
from evergreen_trio.avp.errors import (
    AVPChecksumError,
    AVPCompressionError,
    AVPEncodeError,
    AVPEnumError,
    AVPError,
    AVPInconsistentError,
    AVPLengthError,
    AVPLimitError,
    AVPMagicError,
    AVPMetadataError,
    AVPTruncatedError,
    AVPVersionError,
)
from evergreen_trio.avp.kv import read_kv_header
from evergreen_trio.avp.message import (
    DEFAULT_LIMITS,
    FLAG_COMPRESSED,
    FLAG_HAS_MAP,
    FLAG_KV_CACHE,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    RESERVED_FLAGS,
    AVPHeader,
    AVPLimits,
    AVPMessage,
    AVPMetadata,
    CommunicationMode,
    PayloadType,
    implied_payload_size,
)

HEADER = struct.Struct("<2sBBII")
Compression = Literal["fast", "balanced", "max"]
# The reference's CompressionLevel values, so equal inputs give equal bytes.
ZSTD_LEVELS: dict[str, int] = {"fast": 1, "balanced": 3, "max": 19}
ZSTD = "zstd"
_UINT32_MAX = 0xFFFFFFFF
# Enum members as module constants: on Python 3.11 ``PayloadType.KV_CACHE`` costs ~0.4 us per lookup
# (a descriptor call), a measurable share of decoding a 4096-d message.
_KV_CACHE = PayloadType.KV_CACHE

# zstd contexts must not be shared between threads; one set per thread.
_per_thread = threading.local()


def _thread_local(name: str, factory: Callable[[], Any]) -> Any:
    value = getattr(_per_thread, name, None)
    if value is None:
        value = factory()
        setattr(_per_thread, name, value)
    return value


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _thread_local("compressors", dict)
    compressor = cache.get(level)
    if compressor is None:
        compressor = cache[level] = zstandard.ZstdCompressor(level=level)
    return compressor


def _decompressor() -> zstandard.ZstdDecompressor:
    decompressor: zstandard.ZstdDecompressor = _thread_local("decompressor", zstandard.ZstdDecompressor)
    return decompressor


def zstd_bound(size: int) -> int:
    """ZSTD_COMPRESSBOUND: the largest a zstd frame of ``size`` input bytes can be."""
    small = (128 * 1024 - size) >> 11 if size < 128 * 1024 else 0
    return size + (size >> 8) + small


# ---------------------------------------------------------------- encode


def _array_view(array: np.ndarray[Any, Any], dtype: DataType) -> memoryview:
    got = DTYPE_BY_NAME.get(array.dtype.name)
    if got != dtype:
        raise AVPEncodeError(f"payload array: expected dtype {dtype.name.lower()} (metadata.dtype), got {array.dtype}")
    if array.dtype.byteorder == ">":
        raise AVPEncodeError(f"payload array: expected little-endian data, got {array.dtype.str}")
    if not array.flags.c_contiguous:
        raise AVPEncodeError("payload array: expected a C-contiguous array (np.ascontiguousarray), got strided")
    return array.reshape(-1).view(np.uint8).data


_BYTES = (bytes, bytearray)
_SEQUENCES = (list, tuple)


def _byte_view(part: Any, dtype: DataType) -> memoryview:
    if isinstance(part, _BYTES):
        return memoryview(part)
    if isinstance(part, np.ndarray):
        return _array_view(part, dtype)
    if hasattr(part, "__cuda_array_interface__"):
        # Bytes out means host bytes: the copy is what was asked for (avp.device keeps it on the GPU).
        return _array_view(require_cupy().asnumpy(part), dtype)
    try:
        view = memoryview(part)
    except TypeError:
        raise AVPEncodeError(
            f"payload: expected bytes, a buffer, a NumPy/CuPy array or a list of them, got {type(part).__name__}"
        ) from None
    if not view.c_contiguous:
        raise AVPEncodeError("payload buffer: expected a C-contiguous buffer, got strided")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


_PAYLOAD_TYPE_VALUES = frozenset(PayloadType)
_DTYPE_VALUES = frozenset(DataType)
_MODE_VALUES = frozenset(CommunicationMode)


def _check_enum(values: frozenset[int], value: Any, name: str, enum_type: Any) -> None:
    if value not in values:
        raise AVPEncodeError(
            f"metadata.{name}: expected one of {[member.name for member in enum_type]}, got {value!r}"
        )


def _metadata_message(metadata: AVPMetadata, compressed: bool) -> Metadata:
    # Only non-default fields are set (proto3 omits defaults anyway); the map is filled in the
    # caller's order, as the reference does, so the serialised bytes match its output exactly.
    m = metadata
    _check_enum(_PAYLOAD_TYPE_VALUES, m.payload_type, "payload_type", PayloadType)
    _check_enum(_DTYPE_VALUES, m.dtype, "dtype", DataType)
    _check_enum(_MODE_VALUES, m.mode, "mode", CommunicationMode)
    try:
        pb = Metadata()
        if m.session_id:
            pb.session_id = m.session_id
        if m.source_agent_id:
            pb.source_agent_id = m.source_agent_id
        if m.target_agent_id:
            pb.target_agent_id = m.target_agent_id
        if m.model_id:
            pb.model_id = m.model_id
        if m.hidden_dim:
            pb.hidden_dim = m.hidden_dim
        if m.num_layers:
            pb.num_layers = m.num_layers
        if m.payload_type:
            pb.payload_type = cast(pb2.PayloadType, m.payload_type)
        if m.dtype:
            pb.dtype = cast(pb2.DataType, m.dtype)
        if m.tensor_shape:
            pb.tensor_shape.extend(m.tensor_shape)
        if m.mode:
            pb.mode = cast(pb2.CommunicationMode, m.mode)
        if compressed:
            pb.compression = ZSTD
        if m.avp_map_id:
            pb.avp_map_id = m.avp_map_id
        for key, value in m.extra.items():
            pb.extra[key] = value
    except (ValueError, TypeError) as exc:
        raise AVPEncodeError(f"metadata: expected values the proto's types accept, got {exc}") from None
    return pb


_CACHE_SIZE = 64
# Serialised metadata without the checksum, by every field but the checksum: immutable bytes, so one
# cache serves every thread.
_serialised: dict[tuple[Any, ...], bytes] = {}


def _metadata_bytes(metadata: AVPMetadata, compressed: bool, checksum: int | None) -> bytes:
    """Serialise the metadata. A stream of messages repeats everything but the checksum, so the
    serialised rest is kept, keyed by every other field, and the checksum field is appended to it:
    protobuf encoders write fields in number order and ``payload_checksum`` (15) is the last."""
    m = metadata
    serialised: bytes | None = None
    key: tuple[Any, ...] | None = None
    if not m.extra:
        key = (m.session_id, m.source_agent_id, m.target_agent_id, m.model_id, m.hidden_dim, m.num_layers,
               m.payload_type, m.dtype, m.tensor_shape, m.mode, m.avp_map_id, compressed)
        try:
            serialised = _serialised.get(key)
        except TypeError:  # an unhashable field (a list shape): build it uncached
            key = None
    if serialised is None:
        serialised = _metadata_message(m, compressed).SerializeToString()
        if key is not None:
            if len(_serialised) >= _CACHE_SIZE:
                _serialised.clear()
            _serialised[key] = serialised
    return serialised if checksum is None else serialised + _checksum_field_bytes(checksum)


def _checksum_field_bytes(checksum: int) -> bytes:
    """``payload_checksum`` (field 15, a uint32 ``checksum``) as protobuf writes it: tag 0x78, then a varint."""
    if checksum >= 1 << 28:  # 15 in 16 CRCs: unrolled, a loop costs twice as much
        return bytes((0x78, checksum & 0x7F | 0x80, checksum >> 7 & 0x7F | 0x80, checksum >> 14 & 0x7F | 0x80,
                      checksum >> 21 & 0x7F | 0x80, checksum >> 28))
    out = bytearray(b"\x78")
    while checksum > 0x7F:
        out.append(checksum & 0x7F | 0x80)
        checksum >>= 7
    out.append(checksum)
    return bytes(out)


def encode_buffers(
    payload: Any,
    metadata: AVPMetadata,
    *,
    compression: Compression | None = None,
    checksum: bool = True,
) -> list[bytes | memoryview]:
    """Encode as scatter-gather parts ``[header + metadata, *tensor parts]`` without copying the tensor.

    ``payload`` is bytes, a buffer, a NumPy/CuPy array of ``metadata.dtype``, or a list of those (as
    `pack_kv` returns). ``metadata.compression`` and ``metadata.payload_checksum`` are ignored: the
    keyword arguments decide them. Flags follow the metadata: KV iff ``payload_type`` is KV_CACHE,
    has-map iff ``avp_map_id``.
    """
    _check_enum(_DTYPE_VALUES, metadata.dtype, "dtype", DataType)  # the views below name it
    if isinstance(payload, _SEQUENCES):
        views = [_byte_view(part, metadata.dtype) for part in payload]
        size = sum(map(len, views))
    else:
        views = [_byte_view(payload, metadata.dtype)]
        size = len(views[0])
    if metadata.tensor_shape:
        implied = implied_payload_size(metadata)
        if implied != size:
            raise AVPEncodeError(
                f"payload: tensor_shape {list(metadata.tensor_shape)} of {DataType(metadata.dtype).name} implies "
                f"{implied} bytes, got {size}"
            )
    crc: int | None = None
    if checksum:
        crc = 0
        for view in views:
            crc = crc32(view, crc)
    body: list[bytes | memoryview] = list(views) if compression is None else []
    if compression is not None:
        if compression not in ZSTD_LEVELS:
            raise AVPEncodeError(f"compression: expected one of {sorted(ZSTD_LEVELS)} or None, got {compression!r}")
        compressor = _compressor(ZSTD_LEVELS[compression])
        if len(views) == 1:
            body.append(compressor.compress(views[0]))
        else:
            stream = compressor.compressobj(size=size)
            body.append(b"".join([*(stream.compress(view) for view in views), stream.flush()]))
        size = len(body[0])
    body.insert(0, frame_prefix(metadata, compression is not None, crc, size))
    return body


def frame_prefix(metadata: AVPMetadata, compressed: bool, checksum: int | None, tensor_bytes: int) -> bytes:
    """The 12-byte header and the metadata that precede a tensor section of ``tensor_bytes``."""
    meta = _metadata_bytes(metadata, compressed, checksum)
    payload_length = len(meta) + tensor_bytes
    if payload_length > _UINT32_MAX:
        raise AVPEncodeError(f"payload_length: expected at most {_UINT32_MAX} bytes (uint32), got {payload_length}")
    flags = FLAG_COMPRESSED if compressed else 0
    if metadata.avp_map_id:
        flags |= FLAG_HAS_MAP
    if metadata.payload_type == _KV_CACHE:
        flags |= FLAG_KV_CACHE
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, flags, payload_length, len(meta)) + meta


def encode(
    payload: Any,
    metadata: AVPMetadata,
    *,
    compression: Compression | None = None,
    checksum: bool = True,
) -> bytes:
    """Encode one message into bytes (one copy of the tensor); see `encode_buffers` for the arguments."""
    parts = encode_buffers(payload, metadata, compression=compression, checksum=checksum)
    if compression is not None:
        # Measured: joining a fresh zstd frame into huge pages stalled 1.2-1.5 s on a process's first
        # such call (a plain join: 0.2 s); uncompressed payloads showed no stall and join 2x faster.
        return b"".join(parts)
    return joined(parts, sum(map(len, parts)))


def encode_into(
    buffer: Any,
    payload: Any,
    metadata: AVPMetadata,
    *,
    compression: Compression | None = None,
    checksum: bool = True,
) -> int:
    """Encode into the writable ``buffer`` from its start; return the number of bytes written."""
    parts = encode_buffers(payload, metadata, compression=compression, checksum=checksum)
    try:
        target = memoryview(buffer).cast("B")
    except TypeError:
        raise AVPEncodeError(f"buffer: expected a writable contiguous buffer, got {type(buffer).__name__}") from None
    total = sum(len(part) for part in parts)
    if target.readonly or len(target) < total:
        raise AVPEncodeError(
            f"buffer: expected a writable buffer of at least {total} bytes, "
            f"got {'a read-only' if target.readonly else 'a'} buffer of {len(target)}"
        )
    offset = 0
    for part in parts:
        target[offset : offset + len(part)] = part
        offset += len(part)
    return total


# ---------------------------------------------------------------- decode


_new_header = tuple.__new__


def parse_header(data: memoryview, limits: AVPLimits, strict: bool) -> AVPHeader:
    """Parse and check the 12-byte header: magic, version, flags, and both lengths against ``limits``."""
    if len(data) < HEADER_SIZE:
        raise AVPTruncatedError(f"header: expected {HEADER_SIZE} bytes, got {len(data)}")
    magic, version, flags, payload_length, metadata_length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise AVPMagicError(f"magic: expected 4156 ('AV'), got {magic.hex()}")
    if version != PROTOCOL_VERSION:
        raise AVPVersionError(f"version: expected {PROTOCOL_VERSION}, got {version}")
    if strict and flags & RESERVED_FLAGS:
        raise AVPInconsistentError(f"flags: expected reserved bits 3-7 clear, got {flags:#04x}")
    if metadata_length > payload_length:
        raise AVPLengthError(
            f"metadata_length: expected at most payload_length={payload_length}, got {metadata_length}"
        )
    if metadata_length > limits.max_metadata_bytes:
        raise AVPLimitError(
            f"metadata_length: expected at most max_metadata_bytes={limits.max_metadata_bytes}, "
            f"got {metadata_length}"
        )
    section = payload_length - metadata_length
    cap = limits.max_payload_bytes
    if flags & FLAG_COMPRESSED:
        cap = zstd_bound(cap)
    if section > cap:
        raise AVPLimitError(
            f"tensor section: expected at most {cap} bytes (max_payload_bytes={limits.max_payload_bytes}), "
            f"got {section}"
        )
    return _new_header(AVPHeader, (version, flags, payload_length, metadata_length))


# upb parses any buffer; the stubs only name bytes.
_parse_metadata_bytes = cast(Callable[[memoryview], Metadata], Metadata.FromString)
_PAYLOAD_TYPE_BY_VALUE = {int(member): member for member in PayloadType}
_DTYPE_BY_VALUE = {int(member): member for member in DataType}
_MODE_BY_VALUE = {int(member): member for member in CommunicationMode}


def _enum_error(pb: Metadata) -> AVPEnumError:
    for name, enum_type in (("payload_type", PayloadType), ("dtype", DataType), ("mode", CommunicationMode)):
        value = getattr(pb, name)
        if value not in enum_type._value2member_map_:
            return AVPEnumError(
                f"metadata.{name}: expected one of {[member.name for member in enum_type]}, got {value}"
            )
    raise AssertionError("unreachable: _enum_error called with known enum values")


def _flags_error(flags: int, implied: int) -> AVPInconsistentError:
    for bit, name, field in (
        (FLAG_COMPRESSED, "compressed", "metadata.compression set"),
        (FLAG_HAS_MAP, "has-map", "metadata.avp_map_id non-empty"),
        (FLAG_KV_CACHE, "KV-cache", "metadata.payload_type KV_CACHE"),
    ):
        if flags & bit != implied & bit:
            return AVPInconsistentError(
                f"flags: expected the {name} bit {'set' if implied & bit else 'clear'} as {field} "
                f"{'says' if implied & bit else 'is not'}, got it {'set' if flags & bit else 'clear'} "
                "(decode with strict=False to follow the metadata)"
            )
    raise AssertionError("unreachable: _flags_error called with agreeing flags")


def parse_metadata(header: AVPHeader, raw: memoryview, limits: AVPLimits, strict: bool) -> AVPMetadata:
    """Parse the metadata section and check it against the header's flags (strictly unless ``strict=False``).

    Lenient mode is the reference's way: the compressed bit decides decompression (and the decoded
    ``compression``), the metadata decides the payload type, the other bits are ignored.
    """
    try:
        pb = _parse_metadata_bytes(raw)
    except ProtobufDecodeError as exc:
        raise AVPMetadataError(f"metadata: expected a protobuf avp.Metadata of {len(raw)} bytes, got {exc}") from None
    shape = tuple(pb.tensor_shape[:])
    if len(shape) > limits.max_rank:
        raise AVPLimitError(f"tensor_shape: expected rank <= {limits.max_rank}, got rank {len(shape)}")
    extra = pb.extra
    if len(extra) > limits.max_extra_entries:
        raise AVPLimitError(f"extra: expected at most max_extra_entries={limits.max_extra_entries}, got {len(extra)}")
    payload_type = _PAYLOAD_TYPE_BY_VALUE.get(pb.payload_type)
    dtype = _DTYPE_BY_VALUE.get(pb.dtype)
    mode = _MODE_BY_VALUE.get(pb.mode)
    if payload_type is None or dtype is None or mode is None:
        raise _enum_error(pb)
    flags = header.flags
    compressed = flags & FLAG_COMPRESSED
    has_compression = pb.HasField("compression")
    if has_compression and (compressed or strict) and pb.compression != ZSTD:
        raise AVPCompressionError(f"metadata.compression: expected 'zstd', got {pb.compression!r}")
    avp_map_id = pb.avp_map_id
    if strict:
        implied = (
            (FLAG_COMPRESSED if has_compression else 0)
            | (FLAG_HAS_MAP if avp_map_id else 0)
            | (FLAG_KV_CACHE if payload_type is _KV_CACHE else 0)
        )
        if implied != flags:
            raise _flags_error(flags, implied)
    return AVPMetadata(
        pb.session_id,
        pb.source_agent_id,
        pb.target_agent_id,
        pb.model_id,
        pb.hidden_dim,
        pb.num_layers,
        payload_type,
        dtype,
        shape,
        mode,
        ZSTD if compressed else None,
        avp_map_id,
        dict(extra) if extra else {},
        pb.payload_checksum if pb.HasField("payload_checksum") else None,
    )


def tensor_size(header: AVPHeader, metadata: AVPMetadata, limits: AVPLimits) -> int | None:
    """The tensor bytes expected after decompression, when known; checks an uncompressed section's length."""
    shape = metadata.tensor_shape
    if not shape:
        return None
    # parse_metadata checked the rank; the KV header's 17 bytes are part of a KV payload.
    expected = math.prod(shape) * ITEMSIZE[metadata.dtype]
    if metadata.payload_type is _KV_CACHE:
        expected += KV_HEADER_SIZE
    if expected > limits.max_payload_bytes:
        raise AVPLimitError(
            f"tensor_shape {list(shape)} of {metadata.dtype.name} implies {expected} payload "
            f"bytes, above max_payload_bytes={limits.max_payload_bytes}"
        )
    if not header.flags & FLAG_COMPRESSED and expected != header.payload_length - header.metadata_length:
        raise AVPInconsistentError(
            f"tensor_shape {list(shape)} of {metadata.dtype.name} implies {expected} payload "
            f"bytes, got {header.tensor_section_length}"
        )
    return expected


def _decompress(section: memoryview, expected: int | None, limits: AVPLimits) -> memoryview:
    cap = limits.max_payload_bytes
    decompressor = _decompressor()
    try:
        declared = zstandard.frame_content_size(section)
    except zstandard.ZstdError as exc:
        raise AVPCompressionError(f"zstd: expected a zstd frame, got {exc}") from None
    if declared >= 0:
        if declared > cap:
            raise AVPLimitError(f"zstd frame declares {declared} bytes, above max_payload_bytes={cap}")
        if expected is not None and declared != expected:
            raise AVPInconsistentError(
                f"zstd frame declares {declared} bytes, tensor_shape implies {expected}; expected them equal"
            )
        # The declared size is checked, so the one-shot call allocates exactly that, once.
        try:
            return memoryview(decompressor.decompress(section, allow_extra_data=False))
        except zstandard.ZstdError as exc:
            raise AVPCompressionError(f"zstd: expected a single valid frame of {declared} bytes, got {exc}") from None
    # Without a declared size, decompress into the implied size, or into cap + 1 bytes of untouched
    # (lazily mapped) memory: filling it all means the payload is over the cap.
    out = np.empty(cap + 1 if expected is None else expected, dtype=np.uint8).data
    filled = 0
    try:
        reader = decompressor.stream_reader(section, read_across_frames=True)
        while filled < len(out):
            count = reader.readinto(out[filled:])
            if not count:
                break
            filled += count
        overflow = filled == len(out) and bool(reader.read(1))
    except zstandard.ZstdError as exc:
        raise AVPCompressionError(f"zstd: expected a valid compressed payload, got {exc}") from None
    if expected is None:
        if filled > cap:
            raise AVPLimitError(f"zstd payload decompresses to more than max_payload_bytes={cap}")
        return out[:filled]
    if overflow or filled != expected:
        raise AVPCompressionError(
            f"zstd payload: expected {expected} decompressed bytes, got {'more' if overflow else filled}"
        )
    return out


def _checksum_error(expected: int, payload: memoryview) -> None:
    raise AVPChecksumError(
        f"payload_checksum: expected {expected:#010x}, got {crc32(payload):#010x} over {len(payload)} payload bytes"
    )


def finish_payload(
    header: AVPHeader,
    metadata: AVPMetadata,
    section: memoryview,
    expected: int | None,
    limits: AVPLimits,
    strict: bool,
) -> memoryview:
    """Decompress (bounded) if needed, verify the checksum and the KV layout; return the tensor bytes."""
    payload = _decompress(section, expected, limits) if header.flags & FLAG_COMPRESSED else section
    if metadata.payload_checksum is not None and crc32(payload) != metadata.payload_checksum:
        _checksum_error(metadata.payload_checksum, payload)
    if metadata.payload_type is _KV_CACHE:
        kv = read_kv_header(payload)
        if strict and kv.dtype is not metadata.dtype:
            raise AVPInconsistentError(
                f"KV-cache header dtype is {kv.dtype.name}, metadata.dtype is {metadata.dtype.name}; "
                "expected them equal"
            )
    return payload


def byte_input(data: Any) -> memoryview:
    """``data`` (bytes or any C-contiguous buffer) as a flat byte view; AVPLengthError for anything else."""
    if isinstance(data, _BYTES):
        return memoryview(data)
    try:
        view = memoryview(data)
    except TypeError:
        raise AVPLengthError(f"input: expected bytes or a buffer, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise AVPLengthError("input: expected a C-contiguous buffer, got strided")
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def decode(data: Any, *, limits: AVPLimits = DEFAULT_LIMITS, strict: bool = True) -> AVPMessage:
    """Decode one whole message from a bytes-like object.

    ``strict=False`` accepts flags that disagree with the metadata, the reference's way: the
    compressed bit decides decompression, the metadata decides the payload type.
    """
    view = memoryview(data) if type(data) is bytes else byte_input(data)
    size = len(view)
    if size < HEADER_SIZE:
        return _decode_general(view, limits, strict)
    payload_length, metadata_length = _LENGTHS.unpack_from(view)
    if size != HEADER_SIZE + payload_length or metadata_length > payload_length or metadata_length > _KNOWN_METADATA:
        return _decode_general(view, limits, strict)
    # The known-prefix path (see below); inline, as a call costs a measurable share of a 4096-d decode.
    meta_end = HEADER_SIZE + metadata_length
    head = view[:meta_end].tobytes()
    cut, checksum = _checksum_field(head)
    key = head[:cut] if checksum is not None else head
    known = _known.get(key)
    if known is None or known[0] is not limits or known[1] is not strict:
        known = _learn(key, view, cut, limits, strict)
    _limits, _strict, header, fields, extra, prefix_checksum, expected, plain = known
    if header is None:
        return _decode_general(view, limits, strict)
    if checksum is None:
        checksum = prefix_checksum
    metadata = AVPMetadata(*fields, dict(extra) if extra else {}, checksum)
    section = view[meta_end:]
    if not plain:
        return AVPMessage(header, metadata, finish_payload(header, metadata, section, expected, limits, strict))
    if checksum is not None and crc32(section) != checksum:
        _checksum_error(checksum, section)
    return AVPMessage(header, metadata, section)


def _decode_general(view: memoryview, limits: AVPLimits, strict: bool) -> AVPMessage:
    """`decode` without the cache of known prefixes: every check run on every byte, in the wire's order."""
    header = parse_header(view, limits, strict)
    # One unpacking instead of a NamedTuple attribute lookup per use (this path is per message).
    _version, flags, payload_length, metadata_length = header
    end = HEADER_SIZE + payload_length
    size = len(view)
    if size != end and (size < end or strict):
        error = AVPTruncatedError if size < end else AVPLengthError
        raise error(f"message: expected {end} bytes (header + payload_length), got {size}")
    meta_end = HEADER_SIZE + metadata_length
    metadata = parse_metadata(header, view[HEADER_SIZE:meta_end], limits, strict)
    expected = tensor_size(header, metadata, limits)
    section = view[meta_end:end]
    if flags & FLAG_COMPRESSED or metadata.payload_type is _KV_CACHE:
        return AVPMessage(header, metadata, finish_payload(header, metadata, section, expected, limits, strict))
    checksum = metadata.payload_checksum
    if checksum is not None and crc32(section) != checksum:
        _checksum_error(checksum, section)
    return AVPMessage(header, metadata, section)


# ---------------------------------------------------------------- decode: known prefixes
#
# A stream repeats the header and the metadata but for ``payload_checksum`` (field 15, the last field
# an encoder writes: fields go out in number order). So the checks of the header and the metadata
# are kept per distinct prefix (the bytes before that field), and a message whose prefix is known
# pays only for reading its checksum, the CRC and the two objects it returns.
#
# Why this gives what `_decode_general` gives on any input: the key holds the whole header (flags and
# both lengths) and every metadata byte but the trailing field, and a prefix is learnt only when it
# parses on its own and passes every check. A protobuf parse reads fields one after another, so a
# prefix that parses alone ends on a field boundary; the full parse then reads the same fields and
# then the trailing field 15, and the last value of a scalar field wins. The checks read no checksum.

_LENGTHS = struct.Struct("<4xII")
_KNOWN_METADATA = 1024  # the most metadata bytes a prefix is kept for
_KNOWN_MAX = 64  # prefixes kept (the whole cache is cleared when full: a churn of prefixes costs a parse each)
# AVPMetadata's fields from session_id to avp_map_id.
_Fields = tuple[
    str, str, str, str, int, int, PayloadType, DataType, tuple[int, ...], CommunicationMode, "str | None", str
]
# What a prefix is known as: limits and strict it was checked under, the header, the metadata (fields,
# extra, the checksum if the prefix held one), the tensor size, plain (neither compressed nor KV).
_Known = tuple[AVPLimits, bool, "AVPHeader | None", _Fields, "dict[str, str]", "int | None", "int | None", bool]
_NO_FIELDS: _Fields = ("", "", "", "", 0, 0, PayloadType.HIDDEN_STATE, DataType.FLOAT32, (), CommunicationMode.LATENT,
                       None, "")
_known: dict[bytes, _Known] = {}


def _checksum_field(head: bytes) -> tuple[int, int | None]:
    """Where a trailing ``payload_checksum`` field starts in header + metadata, and its value; else (len, None).

    The field is its tag 0x78 (field 15, varint) and a 1- to 5-byte varint whose bytes have the high
    bit set but the last. Unrolled: a loop costs twice as much, a measurable share of a 4096-d decode.
    """
    if len(head) < HEADER_SIZE + 6:
        return len(head), None
    tag, a, b, c, d, e = head[-6:]
    if e >= 0x80:
        return len(head), None
    # The first byte without the high bit before the last one must be the tag.
    if d < 0x80:
        value, start = (e, -2) if d == 0x78 else (None, 0)
    elif c < 0x80:
        value, start = ((d & 0x7F) | e << 7, -3) if c == 0x78 else (None, 0)
    elif b < 0x80:
        value, start = ((c & 0x7F) | (d & 0x7F) << 7 | e << 14, -4) if b == 0x78 else (None, 0)
    elif a < 0x80:
        value, start = ((b & 0x7F) | (c & 0x7F) << 7 | (d & 0x7F) << 14 | e << 21, -5) if a == 0x78 else (None, 0)
    elif tag == 0x78:
        # upb reads a uint32 from a longer varint by truncation: so does the mask on the fifth byte.
        value, start = (a & 0x7F) | (b & 0x7F) << 7 | (c & 0x7F) << 14 | (d & 0x7F) << 21 | (e & 0xF) << 28, -6
    else:
        value, start = None, 0
    return len(head) + start, value

def _learn(key: bytes, view: memoryview, cut: int, limits: AVPLimits, strict: bool) -> _Known:
    """Run every check on the header and the metadata before ``cut`` and keep the outcome under ``key``.

    Where a check fails the kept header is None: `_decode_general` then says why, in its order.
    """
    try:
        header = parse_header(view, limits, strict)
        metadata = parse_metadata(header, view[HEADER_SIZE:cut], limits, strict)
        expected = tensor_size(header, metadata, limits)
    except AVPError:
        known: _Known = (limits, strict, None, _NO_FIELDS, {}, None, None, False)
    else:
        m = metadata
        fields = (m.session_id, m.source_agent_id, m.target_agent_id, m.model_id, m.hidden_dim, m.num_layers,
                  m.payload_type, m.dtype, m.tensor_shape, m.mode, m.compression, m.avp_map_id)
        plain = not header.flags & FLAG_COMPRESSED and m.payload_type is not _KV_CACHE
        known = (limits, strict, header, fields, m.extra, m.payload_checksum, expected, plain)
    if len(_known) >= _KNOWN_MAX:
        _known.clear()
    _known[key] = known
    return known
