"""AVP handshake (sans-IO): HelloMessage JSON and the mode resolution between two model identities.

`resolve_mode` applies the reference's five rules in order (``CompatibilityResolver.resolve``):

1. equal non-empty ``model_hash`` -> LATENT (``hash_match``);
2. same ``model_family``, ``hidden_dim`` and ``num_layers`` (non-zero) -> LATENT (``structural_match``);
3. equal non-empty ``tokenizer_hash`` -> LATENT with ``avp_map_id`` ``vocab:<hash[:16]>`` (``shared_tokenizer``);
4. a Rosetta ``.avp-map`` for the (local, remote) model hashes -> LATENT with its map id (``avp_map_file``);
5. at least 100 tokens shared by the two vocabularies -> LATENT, ``vocab_overlap:<count>``;

else JSON_MODE (``json_fallback``). Rule 4's file lookup is the caller's
(`evergreen_trio.avp.maps.find_maps` lists a map directory), so this module does no I/O.
Each resolution names a new session id and its TTL.
The JSON shape is the reference's ``HelloMessage.to_dict()``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from evergreen_trio._logsafe import peer_text
from evergreen_trio.avp.errors import AVPHandshakeError
from evergreen_trio.avp.jsonfields import load_object, typed
from evergreen_trio.avp.message import CommunicationMode

logger = logging.getLogger(__name__)

AVP_VERSION = "0.6.2"
MAX_HELLO_BYTES = 64 * 1024
DEFAULT_SESSION_TTL_S = 3600.0
"""The reference's ``Session.ttl`` default: one hour."""
MIN_VOCAB_OVERLAP = 100
"""Rule 5 needs at least this many shared tokens (the reference's ``min_overlap``)."""
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
    """The outcome of `resolve_mode`: the mode, which rule decided it, the projection map, and the session."""

    mode: CommunicationMode
    path: str
    avp_map_id: str = ""
    session_id: str = ""
    ttl_s: float = DEFAULT_SESSION_TTL_S


def map_id(source_hash: str, target_hash: str) -> str:
    """The Rosetta map id of a model pair (also its file's stem): ``<source[:16]>_<target[:16]>``."""
    return f"{source_hash[:16]}_{target_hash[:16]}"


def _resolve(
    local: ModelIdentity,
    remote: ModelIdentity,
    maps: Collection[str],
    local_vocab: Iterable[str] | None,
    remote_vocab: Iterable[str] | None,
) -> tuple[CommunicationMode, str, str]:
    if local.model_hash and local.model_hash == remote.model_hash:
        return CommunicationMode.LATENT, "hash_match", ""
    if (
        local.model_family
        and local.model_family == remote.model_family
        and local.hidden_dim > 0
        and local.hidden_dim == remote.hidden_dim
        and local.num_layers > 0
        and local.num_layers == remote.num_layers
    ):
        return CommunicationMode.LATENT, "structural_match", ""
    if local.tokenizer_hash and local.tokenizer_hash == remote.tokenizer_hash:
        return CommunicationMode.LATENT, "shared_tokenizer", f"vocab:{local.tokenizer_hash[:16]}"
    if local.model_hash and remote.model_hash and map_id(local.model_hash, remote.model_hash) in maps:
        return CommunicationMode.LATENT, "avp_map_file", map_id(local.model_hash, remote.model_hash)
    if local_vocab is not None and remote_vocab is not None:
        shared = len(set(local_vocab).intersection(remote_vocab))
        if shared >= MIN_VOCAB_OVERLAP:
            return CommunicationMode.LATENT, "vocab_overlap", f"vocab_overlap:{shared}"
    return CommunicationMode.JSON_MODE, "json_fallback", ""


def resolve_mode(
    local: ModelIdentity,
    remote: ModelIdentity,
    *,
    maps: Collection[str] = frozenset(),
    local_vocab: Iterable[str] | None = None,
    remote_vocab: Iterable[str] | None = None,
    session_id: str | None = None,
    ttl_s: float = DEFAULT_SESSION_TTL_S,
) -> Resolution:
    """The mode two agents talk in (the five rules above) and a new session (``session_id`` or a uuid4 hex).

    ``maps``: the map ids available locally (`evergreen_trio.avp.maps.find_maps`);
    ``local_vocab``/``remote_vocab``: the two tokenizers' token strings (a vocabulary dict's keys), for rule 5.
    """
    mode, path, avp_map = _resolve(local, remote, maps, local_vocab, remote_vocab)
    resolution = Resolution(mode, path, avp_map, session_id or uuid.uuid4().hex, ttl_s)
    logger.info(
        "avp.handshake resolved path=%s mode=%s avp_map_id=%s local_model=%s remote_model=%s",
        path,
        mode.name,
        peer_text(avp_map or "-"),
        peer_text(local.model_id),
        peer_text(remote.model_id),
    )
    return resolution


def identity_dict(identity: ModelIdentity) -> dict[str, Any]:
    """The identity as the reference's ``ModelIdentity.to_dict()`` writes it."""
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
        out["identity"] = identity_dict(hello.identity)
    return json.dumps(out, separators=(",", ":")).encode()


def hello_from_json(data: bytes | str, *, max_bytes: int = MAX_HELLO_BYTES) -> HelloMessage:
    """Parse a HelloMessage; missing keys take their defaults, wrong types raise `AVPHandshakeError`."""
    obj = load_object(data, max_bytes=max_bytes, where="hello", error=AVPHandshakeError)
    identity = None
    raw_identity = obj.get("identity")
    if raw_identity is not None:
        if not isinstance(raw_identity, dict):
            raise AVPHandshakeError(f"hello.identity: expected a JSON object, got {type(raw_identity).__name__}")
        where = "hello.identity"
        identity = identity_from_dict(raw_identity, where)
    return HelloMessage(
        agent_id=typed(obj, "agent_id", str, "", "hello", AVPHandshakeError),
        avp_version=typed(obj, "avp_version", str, AVP_VERSION, "hello", AVPHandshakeError),
        identity=identity,
        capabilities=typed(obj, "capabilities", dict, {}, "hello", AVPHandshakeError),
    )


def identity_from_dict(raw: dict[str, Any], where: str) -> ModelIdentity:
    """A ModelIdentity from its JSON object; missing keys default, wrong types raise `AVPHandshakeError`."""
    fields: dict[str, Any] = {key: typed(raw, key, str, "", where, AVPHandshakeError) for key in _IDENTITY_STRINGS}
    fields.update({key: typed(raw, key, int, 0, where, AVPHandshakeError) for key in _IDENTITY_INTS})
    return ModelIdentity(**fields)
