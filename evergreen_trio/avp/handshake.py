"""AVP handshake (sans-IO): HelloMessage JSON and the mode resolution between two model identities.

Same model hash, or same family with the same hidden_dim and num_layers, means LATENT; anything
else JSON_MODE. The JSON shape is the reference's ``HelloMessage.to_dict()``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from evergreen_trio.avp.errors import AVPHandshakeError
from evergreen_trio.avp.message import CommunicationMode

logger = logging.getLogger(__name__)

AVP_VERSION = "0.6.2"
MAX_HELLO_BYTES = 64 * 1024
_IDENTITY_STRINGS = ("model_family", "model_id", "model_hash", "tokenizer_hash")
_IDENTITY_INTS = ("hidden_dim", "num_layers", "num_kv_heads", "head_dim")


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    model_family: str = ""
    model_id: str = ""
    model_hash: str = ""
    hidden_dim: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    tokenizer_hash: str = ""


@dataclass(frozen=True, slots=True)
class HelloMessage:
    agent_id: str = ""
    avp_version: str = AVP_VERSION
    identity: ModelIdentity | None = None
    capabilities: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Resolution:
    """The outcome of `resolve_mode`: the mode and which rule decided it."""

    mode: CommunicationMode
    path: str


def resolve_mode(local: ModelIdentity, remote: ModelIdentity) -> Resolution:
    """LATENT for a model-hash match or a structural match (family, hidden_dim, num_layers), else JSON_MODE."""
    if local.model_hash and local.model_hash == remote.model_hash:
        resolution = Resolution(CommunicationMode.LATENT, "hash_match")
    elif (
        local.model_family
        and local.model_family == remote.model_family
        and local.hidden_dim > 0
        and local.hidden_dim == remote.hidden_dim
        and local.num_layers > 0
        and local.num_layers == remote.num_layers
    ):
        resolution = Resolution(CommunicationMode.LATENT, "structural_match")
    else:
        resolution = Resolution(CommunicationMode.JSON_MODE, "json_fallback")
    logger.info(
        "avp.handshake resolved path=%s mode=%s local_model=%s remote_model=%s",
        resolution.path,
        resolution.mode.name,
        local.model_id,
        remote.model_id,
    )
    return resolution


def _identity_dict(identity: ModelIdentity) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model_family": identity.model_family,
        "model_id": identity.model_id,
        "model_hash": identity.model_hash,
        "hidden_dim": identity.hidden_dim,
        "num_layers": identity.num_layers,
        "num_kv_heads": identity.num_kv_heads,
        "head_dim": identity.head_dim,
    }
    if identity.tokenizer_hash:
        out["tokenizer_hash"] = identity.tokenizer_hash
    return out


def hello_to_json(hello: HelloMessage) -> bytes:
    """Serialise as UTF-8 JSON with the reference's keys (``identity`` omitted when None)."""
    out: dict[str, Any] = {
        "agent_id": hello.agent_id,
        "avp_version": hello.avp_version,
        "capabilities": hello.capabilities,
    }
    if hello.identity is not None:
        out["identity"] = _identity_dict(hello.identity)
    return json.dumps(out, separators=(",", ":")).encode()


def _typed(obj: dict[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    value = obj.get(key, default)
    negative_or_bool = isinstance(value, bool) or (isinstance(value, int) and value < 0)
    if not isinstance(value, kind) or (kind is int and negative_or_bool):
        expected = "a non-negative integer" if kind is int else f"a JSON {kind.__name__}"
        raise AVPHandshakeError(f"{where}.{key}: expected {expected}, got {type(value).__name__} {value!r:.40}")
    return value


def hello_from_json(data: bytes | str, *, max_bytes: int = MAX_HELLO_BYTES) -> HelloMessage:
    """Parse a HelloMessage; missing keys take their defaults, wrong types raise `AVPHandshakeError`."""
    if len(data) > max_bytes:
        raise AVPHandshakeError(f"hello: expected at most {max_bytes} bytes, got {len(data)}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise AVPHandshakeError(f"hello: expected a JSON object, got invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise AVPHandshakeError(f"hello: expected a JSON object, got {type(obj).__name__}")
    identity = None
    raw_identity = obj.get("identity")
    if raw_identity is not None:
        if not isinstance(raw_identity, dict):
            raise AVPHandshakeError(f"hello.identity: expected a JSON object, got {type(raw_identity).__name__}")
        where = "hello.identity"
        fields: dict[str, Any] = {key: _typed(raw_identity, key, str, "", where) for key in _IDENTITY_STRINGS}
        fields.update({key: _typed(raw_identity, key, int, 0, where) for key in _IDENTITY_INTS})
        identity = ModelIdentity(**fields)
    return HelloMessage(
        agent_id=_typed(obj, "agent_id", str, "", "hello"),
        avp_version=_typed(obj, "avp_version", str, AVP_VERSION, "hello"),
        identity=identity,
        capabilities=_typed(obj, "capabilities", dict, {}, "hello"),
    )
