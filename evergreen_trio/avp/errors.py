"""The AVP error hierarchy: every error the codec raises is an `AVPError`.

Messages say what was expected and what came; they never quote payload bytes.
"""

from __future__ import annotations

from evergreen_trio.errors import EvergreenTrioError


class AVPError(EvergreenTrioError):
    """Base of every AVP error."""


class AVPFormatError(AVPError):
    """The bytes are not a well-formed AVP message."""


class AVPMagicError(AVPFormatError):
    """The first two bytes are not ``AV`` (0x41 0x56)."""


class AVPVersionError(AVPFormatError):
    """The version byte is not 0x01."""


class AVPTruncatedError(AVPFormatError):
    """The message ended before the lengths in its header said it would."""


class AVPLengthError(AVPFormatError):
    """The header's lengths contradict each other or the message."""


class AVPMetadataError(AVPFormatError):
    """The metadata section is not a valid protobuf ``avp.Metadata``."""


class AVPEnumError(AVPFormatError):
    """An enum field carries a value this codec does not know."""


class AVPInconsistentError(AVPError):
    """Header flags, metadata and payload disagree (flags vs metadata, shape vs size, KV header)."""


class AVPChecksumError(AVPError):
    """The payload's CRC32 differs from ``payload_checksum``."""


class AVPCompressionError(AVPError):
    """The compressed payload is corrupt or uses an unsupported algorithm."""


class AVPLimitError(AVPError):
    """A size or count exceeds a configured `AVPLimits` value."""


class AVPEncodeError(AVPError):
    """``encode`` was given a payload or metadata it cannot put on the wire."""


class AVPDeviceError(AVPError):
    """A GPU array was asked for, but CuPy or a device is missing, or the dtype has no CuPy equivalent."""


class AVPHandshakeError(AVPError):
    """A HelloMessage is malformed."""


class AVPTextError(AVPError):
    """A JSON fallback message (``JSONMessage``) is malformed."""


class AVPTransportError(AVPError):
    """An AVP HTTP request failed: no answer, an error status (``status_code``), or an unreadable answer."""

    def __init__(self, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class AVPRequestError(AVPError):
    """An AVP HTTP request the server refuses: the HTTP ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
