"""The AVP JSON fallback message (``JSONMessage``), sent when the handshake resolves to JSON_MODE. Sans-IO.

The JSON shape is the reference's ``JSONMessage.to_dict()``: ``extra`` is omitted when empty.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from evergreen_trio.avp.errors import AVPTextError
from evergreen_trio.avp.handshake import AVP_VERSION
from evergreen_trio.avp.jsonfields import load_object, typed

MAX_TEXT_MESSAGE_BYTES = 1 << 20
_STRINGS = ("avp_version", "session_id", "source_agent_id", "target_agent_id", "content")


@dataclass(frozen=True, slots=True)
class JSONMessage:
    avp_version: str = AVP_VERSION
    session_id: str = ""
    source_agent_id: str = ""
    target_agent_id: str = ""
    content: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


def text_to_json(message: JSONMessage) -> bytes:
    """Serialise as UTF-8 JSON with the reference's keys."""
    out: dict[str, Any] = {key: getattr(message, key) for key in _STRINGS}
    if message.extra:
        out["extra"] = message.extra
    return json.dumps(out, separators=(",", ":")).encode()


def text_from_json(data: bytes | str, *, max_bytes: int = MAX_TEXT_MESSAGE_BYTES) -> JSONMessage:
    """Parse a JSONMessage; missing keys take their defaults, wrong types or size raise `AVPTextError`."""
    obj = load_object(data, max_bytes=max_bytes, where="text message", error=AVPTextError)
    fields: dict[str, Any] = {
        key: typed(obj, key, str, AVP_VERSION if key == "avp_version" else "", "text message", AVPTextError)
        for key in _STRINGS
    }
    fields["extra"] = typed(obj, "extra", dict, {}, "text message", AVPTextError)
    return JSONMessage(**fields)
