"""Log fields a peer chose (paths, agent and model ids, reasons quoting its input) made safe for a log line."""

from __future__ import annotations

import json

MAX_FIELD_CHARS = 200
"""A peer's field is cut to this many characters (then ``...``) before escaping."""


def peer_text(value: str | bytes, limit: int = MAX_FIELD_CHARS) -> str:
    """``value`` as one printable ASCII token: control characters, line and paragraph separators and
    all non-ASCII escaped JSON-style (``\\n``, ``\\u2028``), bytes read as Latin-1, cut to ``limit`` chars.

    A newline in a peer's field can then never start a forged log line.
    """
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return json.dumps(cut, ensure_ascii=True)[1:-1]
