"""An image's pixel size from its header, as Go's ``image.DecodeConfig`` reads it (PNG, JPEG, GIF).

llm-d-router's token estimate decodes a base64 image's dimensions this way (mm_estimate.go) to
count its placeholder tokens. Only the header is read: the base64 text is decoded a block at a
time until the size is known, so a huge data URL costs what its header needs (bounded by
:data:`MAX_HEADER_BYTES`). Pure functions, no I/O.
"""

from __future__ import annotations

import binascii
import struct
import zlib
from collections.abc import Callable, Iterator

MAX_HEADER_BYTES = 1 << 20
"""Decoded bytes read at most for a header (a JPEG's size can follow large APP segments)."""
MAX_HEADER_READS = 1 << 18
"""Header fields read at most for one request's images (see :class:`ReadBudget`): about 60 ms,
what parsing a 16 MiB body costs."""
_BLOCK_CHARS = 4096  # base64 characters decoded per step (a multiple of 4)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Go's image/png: the bit depths each color type allows (checkHeader's cb table).
_PNG_DEPTHS = {0: (1, 2, 4, 8, 16), 2: (8, 16), 3: (1, 2, 4, 8), 4: (8, 16), 6: (8, 16)}
_INT32_MAX = 2**31 - 1


class _Short(Exception):
    """The decoded bytes ended before the header did."""


class ReadBudget:
    """The header fields left to read for one request's images. Each read is Python work, and a
    header can be all reads (a JPEG's stray bytes one at a time, 4-byte segments, 12-byte PNG
    chunks): without a bound, 16 MiB of them cost seconds of the routing thread per request.
    Images read past it have no size, as a cut-short header."""

    reads = MAX_HEADER_READS
    """Reads left; an instance's own once it reads (no ``__init__``: most requests carry no image)."""


class _Reader:
    """Decoded bytes of a base64 text, produced block by block as the header parser asks."""

    def __init__(self, text: str, budget: ReadBudget) -> None:
        self._blocks = self._decode(text)
        self._data = bytearray()
        self.pos = 0
        self._budget = budget

    @staticmethod
    def _decode(text: str) -> Iterator[bytes]:
        # Go's base64 decoder skips CR and LF; anything else outside the alphabet is an error.
        for start in range(0, len(text), _BLOCK_CHARS):
            chunk = text[start : start + _BLOCK_CHARS].replace("\r", "").replace("\n", "")
            try:
                yield binascii.a2b_base64(chunk.encode("ascii"), strict_mode=True)
            except (binascii.Error, UnicodeEncodeError, ValueError):
                return

    def read(self, size: int) -> bytes:
        end = self.pos + size
        self._budget.reads -= 1
        if end > MAX_HEADER_BYTES or self._budget.reads < 0:
            raise _Short
        while len(self._data) < end:
            block = next(self._blocks, None)
            if block is None:
                raise _Short
            self._data += block
        out = bytes(self._data[self.pos : end])
        self.pos = end
        return out


def _png(r: _Reader) -> tuple[int, int] | None:
    r.read(8)
    length, kind = struct.unpack(">I4s", r.read(8))
    if kind != b"IHDR" or length != 13:
        return None
    data = r.read(13)
    (crc,) = struct.unpack(">I", r.read(4))
    if zlib.crc32(kind + data) != crc:
        return None
    width, height, depth, color, compression, filtering, interlace = struct.unpack(">IIBBBBB", data)
    if compression or filtering or interlace > 1 or depth not in _PNG_DEPTHS.get(color, ()):
        return None
    if width > _INT32_MAX or height > _INT32_MAX:
        return None
    if color == 3:  # paletted: Go's DecodeConfig reads on through the PLTE chunk, checking each CRC
        while True:
            length, kind = struct.unpack(">I4s", r.read(8))
            if kind in (b"IDAT", b"IHDR", b"IEND") or length > _INT32_MAX:
                return None  # out of order, or no palette before the data
            data = r.read(length)
            if zlib.crc32(kind + data) != struct.unpack(">I", r.read(4))[0]:
                return None
            if kind == b"PLTE":
                entries, rest = divmod(length, 3)
                if rest or not 0 < entries <= min(256, 1 << depth):
                    return None
                break
    return width, height


def _gif(r: _Reader) -> tuple[int, int] | None:
    header = r.read(13)
    if header[:6] not in (b"GIF87a", b"GIF89a"):
        return None
    width, height, flags = struct.unpack("<HHB", header[6:11])
    if flags & 0x80:
        r.read(3 << ((flags & 7) + 1))  # the global color table must be there
    return width, height


def _jpeg(r: _Reader) -> tuple[int, int] | None:
    r.read(2)
    while True:
        marker = r.read(2)
        while marker[0] != 0xFF or marker[1] == 0xFF:  # Go skips stray and fill bytes before a marker
            marker = marker[1:] + r.read(1)
        code = marker[1]
        if code == 0x00 or 0xD0 <= code <= 0xD7:
            continue  # an escaped 0xFF, or a restart marker: no length
        if code == 0xD9:
            return None  # the end of the image before any frame header
        (length,) = struct.unpack(">H", r.read(2))
        if length < 2:
            return None
        if code in _SOF:
            body = r.read(length - 2)
            if len(body) < 6:
                return None
            precision, height, width, components = struct.unpack(">BHHB", body[:6])
            if precision != 8 or components not in (1, 3, 4) or length - 2 != 6 + 3 * components:
                return None
            return width, height
        if code not in _SKIPPED:
            return None  # scan data before a frame header, or a frame type Go does not decode
        r.read(length - 2)


_SOF = (0xC0, 0xC1, 0xC2)  # baseline, extended sequential, progressive: what Go decodes
_SKIPPED = frozenset({0xC4, 0xDB, 0xDD, 0xFE, *range(0xE0, 0xF0)})  # tables, restart interval, APPn, comments


_FORMATS: tuple[tuple[bytes, Callable[[_Reader], tuple[int, int] | None]], ...] = (
    (_PNG_SIGNATURE, _png), (b"\xff\xd8", _jpeg), (b"GIF8", _gif))


def base64_image_size(payload: str, budget: ReadBudget | None = None) -> tuple[int, int] | None:
    """(width, height) of a base64-encoded PNG, JPEG or GIF (None when it is not one, or its
    header is cut short, past ``budget`` (the request's; None: the image's own) or invalid, or a
    dimension is not positive)."""
    reader = _Reader(payload, budget if budget is not None else ReadBudget())
    try:
        head = reader.read(4)
    except _Short:
        return None
    for magic, parse in _FORMATS:
        if head.startswith(magic[:4]):
            reader.pos = 0
            try:
                size = parse(reader)
            except (_Short, struct.error):
                return None
            if size is None or size[0] <= 0 or size[1] <= 0:
                return None
            return size
    return None


def data_url_image_size(url: str, budget: ReadBudget | None = None) -> tuple[int, int] | None:
    """(width, height) of a ``data:image/...;base64,`` URL's image (None for any other URL)."""
    if not url.startswith("data:image/"):
        return None
    index = url.find("base64,")
    if index < 0:
        return None
    return base64_image_size(url[index + len("base64,") :], budget)
