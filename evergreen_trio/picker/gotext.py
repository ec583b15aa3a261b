"""Go's text rules that llm-d-router's parsing relies on, for the parts of ours that must read text
as it does (sans-IO).

Request header values are the reference's raw bytes (a Go string); ours hold them one character a
byte (latin-1, see ``processor._headers``). :func:`trim_space` and :func:`header_text` read such a
value as Go does: ``strings.TrimSpace`` trims only whole UTF-8 encoded space runes, and a value
equals a configured (UTF-8) name only when its bytes do.
"""

from __future__ import annotations

import re

# strings.TrimSpace trims unicode.IsSpace's runes, which are not str.strip's.
GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
           "\u2028\u2029\u202f\u205f\u3000"
_ASCII_SPACE = GO_SPACE[:6]
_ATOI = re.compile(r"[+-]?[0-9]+")


def trim_space(value: str) -> str:
    """``strings.TrimSpace`` of a header value held one character a byte: a lone 0x85 or 0xA0 byte
    (no UTF-8 rune) or a control such as 0x1F stays, where ``str.strip`` would remove it. A value
    with a character past 0xFF is text already (an ext_proc ``value``, not ``raw_value``)."""
    if value.isascii():
        return value.strip(_ASCII_SPACE)
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:
        return value.strip(GO_SPACE)
    # Undecodable bytes become lone surrogates, which are no space and come back as they were.
    text = raw.decode("utf-8", "surrogateescape").strip(GO_SPACE)
    return text.encode("utf-8", "surrogateescape").decode("latin-1")


def header_text(value: str) -> str | None:
    """A header value held one character a byte as the text its bytes encode in UTF-8, to compare
    with a configured name; None when they are no UTF-8 (no configured name has those bytes)."""
    if value.isascii():
        return value
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeEncodeError:
        return value
    except UnicodeDecodeError:
        return None


def atoi(text: str) -> int | None:
    """``strconv.Atoi``: an optional sign and ASCII digits, within int64; None for anything else."""
    if not _ATOI.fullmatch(text):
        return None
    value = int(text)
    return value if -(2**63) <= value < 2**63 else None
