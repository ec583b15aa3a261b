"""Go's text rules that llm-d-router's parsing relies on, for the parts of ours that must read text
as it does (sans-IO)."""

from __future__ import annotations

import re

# strings.TrimSpace trims unicode.IsSpace's runes, which are not str.strip's.
GO_SPACE = "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
           "\u2028\u2029\u202f\u205f\u3000"
_ATOI = re.compile(r"[+-]?[0-9]+")


def atoi(text: str) -> int | None:
    """``strconv.Atoi``: an optional sign and ASCII digits, within int64; None for anything else."""
    if not _ATOI.fullmatch(text):
        return None
    value = int(text)
    return value if -(2**63) <= value < 2**63 else None
