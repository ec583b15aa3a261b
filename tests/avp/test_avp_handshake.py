"""The handshake's five rules, session id, TTL and the JSON fallback message, against the reference ``avp``."""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import avp as reference
import avp.rosetta.registry as reference_registry
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evergreen_trio.avp import AVPHandshakeError, CommunicationMode
from evergreen_trio.avp.errors import AVPTextError
from evergreen_trio.avp.fallback import JSONMessage, text_from_json, text_to_json
from evergreen_trio.avp.handshake import (
    DEFAULT_SESSION_TTL_S,
    HelloMessage,
    ModelIdentity,
    hello_from_json,
    hello_to_json,
    map_id,
    resolve_mode,
)
from evergreen_trio.avp.maps import find_maps

HASHES = ["", "a" * 64, "b" * 64, "a" * 16 + "c" * 48]
IDENTITIES = st.builds(
    ModelIdentity,
    model_family=st.sampled_from(["", "llama", "qwen2"]),
    model_id=st.text(max_size=8),
    model_hash=st.sampled_from(HASHES),
    hidden_dim=st.sampled_from([0, 2048, 4096]),
    num_layers=st.sampled_from([0, 16, 32]),
    num_kv_heads=st.integers(0, 64),
    head_dim=st.integers(0, 256),
    tokenizer_hash=st.sampled_from(["", "t" * 64, "u" * 64]),
)
# Vocabularies around the 100-shared-token threshold: a common core of 0..150 tokens plus private ones.
VOCABS = st.one_of(
    st.none(),
    st.builds(lambda shared, own: {f"tok{i}": i for i in range(shared)} | {f"{own}{i}": i for i in range(20)},
              st.integers(0, 150), st.sampled_from(["x", "y"])),
)


class _Tokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def _reference_identity(identity: ModelIdentity) -> Any:
    return reference.ModelIdentity.from_dict(json.loads(hello_to_json(HelloMessage(identity=identity)))["identity"])


@given(IDENTITIES, IDENTITIES, st.sets(st.tuples(st.sampled_from(HASHES[1:]), st.sampled_from(HASHES[1:]))),
       VOCABS, VOCABS)
def test_resolution_equals_the_references(
    local: ModelIdentity,
    remote: ModelIdentity,
    map_pairs: set[tuple[str, str]],
    local_vocab: dict[str, int] | None,
    remote_vocab: dict[str, int] | None,
) -> None:
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(reference_registry, "_MAP_DIR", Path(tmp)):
        for source, target in map_pairs:
            (Path(tmp) / f"{map_id(source, target)}.pt").write_bytes(b"")
        theirs = reference.CompatibilityResolver.resolve(
            _reference_identity(local),
            _reference_identity(remote),
            None if local_vocab is None else _Tokenizer(local_vocab),
            None if remote_vocab is None else _Tokenizer(remote_vocab),
        )
        maps = find_maps(Path(tmp))
        ours = resolve_mode(local, remote, maps=maps, local_vocab=local_vocab, remote_vocab=remote_vocab)
    assert (int(ours.mode), ours.path, ours.avp_map_id) == (int(theirs.mode), theirs.resolution_path, theirs.avp_map_id)


def test_shared_tokenizer_is_latent_on_both_sides() -> None:
    """The disagreement the issue names: different models sharing a tokenizer."""
    a = ModelIdentity(model_family="llama", model_hash="a" * 64, hidden_dim=20, num_layers=16, tokenizer_hash="t" * 64)
    b = ModelIdentity(model_family="qwen2", model_hash="b" * 64, hidden_dim=40, num_layers=32, tokenizer_hash="t" * 64)
    ours = resolve_mode(a, b)
    assert ours.mode is CommunicationMode.LATENT
    assert (ours.path, ours.avp_map_id) == ("shared_tokenizer", "vocab:" + "t" * 16)


def test_resolution_names_a_session_and_its_ttl() -> None:
    first, second = resolve_mode(ModelIdentity(), ModelIdentity()), resolve_mode(ModelIdentity(), ModelIdentity())
    assert len(first.session_id) == 32 and first.session_id != second.session_id
    assert first.ttl_s == DEFAULT_SESSION_TTL_S == 3600.0
    fixed = resolve_mode(ModelIdentity(), ModelIdentity(), session_id="s1", ttl_s=5.0)
    assert (fixed.session_id, fixed.ttl_s) == ("s1", 5.0)


def test_find_maps_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert find_maps(tmp_path / "absent") == frozenset()
    (tmp_path / "abc_def.pt").write_bytes(b"")
    (tmp_path / "notes.txt").write_bytes(b"")
    assert find_maps(tmp_path) == {"abc_def"}


TEXTS = st.builds(
    JSONMessage,
    session_id=st.text(max_size=8),
    source_agent_id=st.text(max_size=8),
    target_agent_id=st.text(max_size=8),
    content=st.text(max_size=40),
    extra=st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
)


@given(TEXTS)
def test_json_message_round_trips_with_reference(message: JSONMessage) -> None:
    theirs = reference.JSONMessage.from_json(text_to_json(message).decode())
    assert theirs.to_dict() == json.loads(text_to_json(message))
    assert text_from_json(theirs.to_json()) == message


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"[]", "expected a JSON object, got list"),
        (b"{", "invalid JSON"),
        (b'{"content": 5}', r"text message.content: expected a JSON str, got int"),
        (b'{"extra": []}', r"text message.extra: expected a JSON dict"),
        (b"{}" + b" " * (1 << 20), "expected at most"),
    ],
)
def test_json_message_rejects(data: bytes, match: str) -> None:
    with pytest.raises(AVPTextError, match=match):
        text_from_json(data)


@pytest.mark.fuzz
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_fuzz_json_documents_raise_only_typed_errors(data: bytes) -> None:
    for parse, error in ((text_from_json, AVPTextError), (hello_from_json, AVPHandshakeError)):
        with contextlib.suppress(error):
            parse(data)
