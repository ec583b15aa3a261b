"""Strict reading of the small JSON documents AVP exchanges (HelloMessage, JSONMessage), sans-IO."""

from __future__ import annotations

import json
from typing import Any

from evergreen_trio.avp.errors import AVPError


def load_object(data: bytes | str, *, max_bytes: int, where: str, error: type[AVPError]) -> dict[str, Any]:
    """Parse ``data`` as one JSON object of at most ``max_bytes``; else raise ``error`` naming ``where``."""
    if len(data) > max_bytes:
        raise error(f"{where}: expected at most {max_bytes} bytes, got {len(data)}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise error(f"{where}: expected a JSON object, got invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise error(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def typed(obj: dict[str, Any], key: str, kind: type, default: Any, where: str, error: type[AVPError]) -> Any:
    """``obj[key]`` (``default`` when missing) if it is a ``kind`` (ints: non-negative, not bool); else ``error``."""
    value = obj.get(key, default)
    negative_or_bool = isinstance(value, bool) or (isinstance(value, int) and value < 0)
    if not isinstance(value, kind) or (kind is int and negative_or_bool):
        expected = "a non-negative integer" if kind is int else f"a JSON {kind.__name__}"
        raise error(f"{where}.{key}: expected {expected}, got {type(value).__name__} {value!r:.40}")
    return value
