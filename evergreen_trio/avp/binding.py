"""The AVP HTTP binding, sans-IO: paths, headers, bearer tokens and the JSON answers, as the reference has them.

``POST /avp/v2/handshake`` (a HelloMessage), ``POST /avp/v2/transmit`` (``application/avp+binary``),
``POST /avp/v2/text`` (a JSONMessage), ``GET /health``. Every answer is JSON: ``{"success": true, ...}``,
or ``{"success": false, "message": "..."}`` with 400 (bad message), 401 (bad token), 404, 405, 408,
413 or 501 (no text handler).
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from evergreen_trio.avp.errors import AVPRequestError
from evergreen_trio.avp.handshake import HelloMessage, Resolution, identity_dict
from evergreen_trio.avp.message import AVPMessage
from evergreen_trio.serving.auth import TokenFile

HANDSHAKE_PATH = "/avp/v2/handshake"
TRANSMIT_PATH = "/avp/v2/transmit"
TEXT_PATH = "/avp/v2/text"
HEALTH_PATH = "/health"
ROUTES = {HANDSHAKE_PATH: "POST", TRANSMIT_PATH: "POST", TEXT_PATH: "POST", HEALTH_PATH: "GET"}
AVP_VERSION_HEADER = "0.4"
"""The binding's version, sent as ``AVP-Version`` (the reference's ``AVP_VERSION_HEADER``)."""
BINARY_CONTENT_TYPE = "application/avp+binary"
JSON_CONTENT_TYPE = "application/json"


def answer(document: dict[str, Any]) -> bytes:
    """A JSON answer's body."""
    return json.dumps(document, separators=(",", ":")).encode()


def check_route(path: str, method: str) -> AVPRequestError | None:
    """None when ``method path`` is an AVP endpoint, else the 404/405 refusal."""
    expected = ROUTES.get(path)
    if expected is None:
        return AVPRequestError(404, f"no endpoint {path[:100]!r}; expected one of {', '.join(ROUTES)}")
    if method != expected:
        return AVPRequestError(405, f"{path} takes {expected}, got {method[:10]}")
    return None


def check_token(
    authorization: bytes | None, token: bytes | None, tokens: TokenFile | None = None
) -> AVPRequestError | None:
    """None when no token is configured or ``Authorization: Bearer <token>`` matches ``token`` or a
    line of ``tokens`` (constant time); else the 401 refusal."""
    if token is None and tokens is None:
        return None
    scheme, _, given = (authorization or b"").partition(b" ")
    given = given.strip()
    accepted = scheme.lower() == b"bearer" and (
        (token is not None and hmac.compare_digest(given, token))
        | (tokens is not None and tokens.principal(given) is not None)
    )
    if not accepted:
        return AVPRequestError(401, "expected Authorization: Bearer <token> with the server's token")
    return None


def receiver_answer(message: AVPMessage) -> dict[str, Any]:
    """What ``avp serve``'s built-in receiver says of a decoded message: type, dtype, shape, tensor bytes.

    A KV cache's shape is ``[num_layers, 2, num_kv_heads, seq_len, head_dim]`` (its header's); a payload
    without ``tensor_shape`` is 1-D.
    """
    return {
        "payload_type": message.metadata.payload_type.name,
        "dtype": message.metadata.dtype.name,
        "shape": list(message.as_array().shape),
        "bytes": len(message.payload),
    }


def handshake_answer(hello: HelloMessage, local: HelloMessage | None, resolution: Resolution) -> dict[str, Any]:
    """The handshake's answer: this agent's id and identity (the caller's own echoed when this agent has
    none, as the reference's default does), and the session: id, mode, map id, how it was resolved, TTL."""
    me = local or hello
    return {
        "agent_id": me.agent_id,
        "identity": identity_dict(me.identity) if me.identity is not None else {},
        "session_id": resolution.session_id,
        "mode": resolution.mode.name.removesuffix("_MODE"),  # the reference's names: LATENT, JSON
        "avp_map_id": resolution.avp_map_id,
        "resolution_path": resolution.path,
        "ttl": resolution.ttl_s,
    }
