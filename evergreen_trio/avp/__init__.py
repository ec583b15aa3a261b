"""AVP (Agent Vector Protocol): a sans-IO, zero-copy, hardened codec for latent payloads, and its session binding."""

from evergreen_trio._extras import AVP_CODEC_MODULES, require_extra

require_extra("avp", __name__, AVP_CODEC_MODULES)

from evergreen_trio.avp.codec import decode, encode, encode_buffers, encode_into
from evergreen_trio.avp.dtypes import DataType
from evergreen_trio.avp.errors import (
    AVPChecksumError,
    AVPCompressionError,
    AVPDeviceError,
    AVPEncodeError,
    AVPEnumError,
    AVPError,
    AVPFormatError,
    AVPHandshakeError,
    AVPInconsistentError,
    AVPLengthError,
    AVPLimitError,
    AVPMagicError,
    AVPMetadataError,
    AVPTruncatedError,
    AVPVersionError,
)
from evergreen_trio.avp.incremental import AVPDecoder
from evergreen_trio.avp.kv import KVCacheHeader, pack_kv, unpack_kv
from evergreen_trio.avp.message import (
    DEFAULT_LIMITS,
    AVPHeader,
    AVPLimits,
    AVPMessage,
    AVPMetadata,
    CommunicationMode,
    PayloadType,
)
from evergreen_trio.avp.stream import avp_fragments

__all__ = [
    "DEFAULT_LIMITS",
    "AVPChecksumError",
    "AVPCompressionError",
    "AVPDecoder",
    "AVPDeviceError",
    "AVPEncodeError",
    "AVPEnumError",
    "AVPError",
    "AVPFormatError",
    "AVPHandshakeError",
    "AVPHeader",
    "AVPInconsistentError",
    "AVPLengthError",
    "AVPLimitError",
    "AVPLimits",
    "AVPMagicError",
    "AVPMessage",
    "AVPMetadata",
    "AVPMetadataError",
    "AVPTruncatedError",
    "AVPVersionError",
    "CommunicationMode",
    "DataType",
    "KVCacheHeader",
    "PayloadType",
    "avp_fragments",
    "decode",
    "encode",
    "encode_buffers",
    "encode_into",
    "pack_kv",
    "unpack_kv",
]
