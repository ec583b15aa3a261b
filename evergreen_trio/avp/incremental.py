"""Sans-IO incremental decoder: feed a message in arbitrary pieces, get the decoded message at the end.

The header and metadata are checked as soon as they are in; only then is the tensor section's
buffer allocated, once, at its final size, and each piece is copied straight into it. An
uncompressed payload is a view of that buffer, so the pieces are never joined.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from evergreen_trio.avp.codec import byte_input, finish_payload, parse_header, parse_metadata, tensor_size
from evergreen_trio.avp.errors import AVPLengthError, AVPTruncatedError
from evergreen_trio.avp.message import DEFAULT_LIMITS, HEADER_SIZE, AVPHeader, AVPLimits, AVPMessage, AVPMetadata


class AVPDecoder:
    """Decode one AVP message from pieces: call `feed` per piece, then `close` at the end of input.

    ``feed`` returns the message once its last byte arrives (and None before); bytes after the end
    of the message are an `AVPLengthError`. After any `AVPError` the decoder is spent.
    """

    def __init__(self, *, limits: AVPLimits = DEFAULT_LIMITS, strict: bool = True) -> None:
        self._limits = limits
        self._strict = strict
        self._prefix = bytearray()
        self._header: AVPHeader | None = None
        self._metadata: AVPMetadata | None = None
        self._expected: int | None = None
        self._section: memoryview | None = None
        self._filled = 0
        self._message: AVPMessage | None = None

    @property
    def bytes_received(self) -> int:
        """Bytes fed so far."""
        return len(self._prefix) + self._filled

    @property
    def message(self) -> AVPMessage | None:
        """The decoded message once complete, else None."""
        return self._message

    def feed(self, data: Any) -> AVPMessage | None:
        """Take the next piece (any buffer); the message once complete, else None.

        Raises an AVPError subclass for a bad header, metadata, length or checksum, and
        AVPLengthError for bytes past the message's end or a piece that is not a contiguous buffer.
        """
        view = byte_input(data)
        while view:
            if self._message is not None:
                raise AVPLengthError(
                    f"input: expected the message to end after {self.bytes_received} bytes, "
                    f"got {len(view)} more"
                )
            view = self._feed_prefix(view) if self._section is None else self._feed_section(view)
        return self._message

    def close(self) -> AVPMessage:
        """Signal the end of input; return the message or raise `AVPTruncatedError`."""
        if self._message is None:
            wanted = HEADER_SIZE if self._header is None else HEADER_SIZE + self._header.payload_length
            raise AVPTruncatedError(f"message: expected {wanted} bytes, input ended after {self.bytes_received}")
        return self._message

    def _feed_prefix(self, view: memoryview) -> memoryview:
        prefix = self._prefix
        header = self._header
        wanted = HEADER_SIZE if header is None else HEADER_SIZE + header.metadata_length
        take = min(wanted - len(prefix), len(view))
        prefix += view[:take]
        if len(prefix) == wanted:
            if header is None:
                header = self._header = parse_header(memoryview(bytes(prefix)), self._limits, self._strict)
                if header.metadata_length == 0:
                    self._start_section(header)
            else:
                self._start_section(header)
        return view[take:]

    def _start_section(self, header: AVPHeader) -> None:
        raw = memoryview(bytes(self._prefix[HEADER_SIZE:]))
        self._metadata = parse_metadata(header, raw, self._limits, self._strict)
        self._expected = tensor_size(header, self._metadata, self._limits)
        self._section = np.empty(header.tensor_section_length, dtype=np.uint8).data
        if not self._section:
            self._complete()

    def _feed_section(self, view: memoryview) -> memoryview:
        section = self._section
        assert section is not None
        take = min(len(section) - self._filled, len(view))
        section[self._filled : self._filled + take] = view[:take]
        self._filled += take
        if self._filled == len(section):
            self._complete()
        return view[take:]

    def _complete(self) -> None:
        header, metadata, section = self._header, self._metadata, self._section
        assert header is not None and metadata is not None and section is not None
        payload = finish_payload(header, metadata, section, self._expected, self._limits, self._strict)
        self._message = AVPMessage(header, metadata, payload)
