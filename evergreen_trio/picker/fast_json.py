"""JSON objects read by msgspec where it reads exactly what ``json.loads`` reads, about four times
as fast; json reads the rest.

On a text both accept, msgspec's document is json's: the same keys in the same order (a repeated
name: the last value, in the first one's place), the same ints (up to Python's 4,300 digits),
floats and strings (``tests/picker/test_request_path_cpu.py`` compares them on hostile bodies).
What msgspec refuses and json reads (NaN and Infinity, a number past float64, a lone surrogate,
a byte-order mark, UTF-16) is left to json, so its document or its error is json's. Both count
nesting against Python's recursion limit, each its own way: a text that could nest deeper than
:data:`MAX_DEPTH` is left to json.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

MAX_DEPTH = 512
"""Nesting msgspec is trusted with: far from the recursion limit, with any stack a stream runs on."""
_DECODE: Callable[[bytes], Any] = msgspec.json.Decoder().decode


def json_object(data: bytes) -> dict[str, Any] | None:
    """``json.loads(data)`` for a text starting with ``{`` that msgspec reads, else None (json's to read)."""
    # Valid text nests at most half its length deep, and at most as deep as it has { and [.
    if data[:1] != b"{" or (len(data) > 2 * MAX_DEPTH and data.count(b"{") + data.count(b"[") > MAX_DEPTH):
        return None
    try:
        doc: dict[str, Any] = _DECODE(data)
    except (ValueError, RecursionError):  # msgspec's errors are ValueErrors
        return None
    return doc


def loads(data: bytes) -> Any:
    """``json.loads(data)``, msgspec reading it where :func:`json_object` does."""
    doc = json_object(data)
    return doc if doc is not None else json.loads(data)
